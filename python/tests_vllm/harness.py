"""A vLLM-shaped cluster for tests and the benchmark: one front-end (P0) with a real vLLM
processor-cache object, worker processes (P1) with the matching receiver, and vLLM's own
msgpack codec on the wire. The same driver runs vLLM's ``shm`` and ``lru`` caches and
shmstore's, so their results can be compared item by item.

Per request the driver does what vLLM's processor does (``is_cached``, process the
missing items, ``touch_sender_cache_item`` for all, ``get_and_update_item`` for each,
``release_sender_touches``), optionally runs vLLM's own ``strip_covered_mm_data`` on
some items, as its scheduler does for items covered by the prefix cache (``data=None``,
or only the ``keep_on_cpu`` fields for M-RoPE models), encodes each item with
``MsgpackEncoder`` and sends the request to every worker as one message. A worker
decodes with ``MsgpackDecoder(MultiModalKwargsItem)``, runs ``get_and_update_features``
and answers with a digest of what the model runner will use of every item (keys, field
kinds and parameters, dtypes, shapes and bytes), or with the hashes a
``MultiModalCacheMissError`` named.

Where vLLM runs an engine-core cache (shmstore's gate), the driver runs it too, on the
request decoded as the engine core decodes it, before the workers see the request, and
keeps the request's features until every worker has answered (the engine core holds a
request while it runs). A miss there is vLLM's retry path: the driver invalidates the
hashes and sends the request again. A miss in a shmstore worker fails the request: in
vLLM it stops the engine (vLLM's ``lru`` receiver, which the harness runs in the
workers, runs in the engine core in vLLM, so its misses are retried).
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import random
import resource
import time
from types import SimpleNamespace
from typing import Any

import torch

# ----- setup in every process ---------------------------------------------------------


#: How the tests start worker processes (and second front-ends) unless a test names a
#: method: from a fork server that imported torch, vLLM's cache modules and shmstore once.
#: Spawning pays those imports in every process (~8 s of CPU each on a 2-core machine);
#: forking the test process would copy its stores and threads. vLLM's own two methods,
#: fork and spawn, have a test of their own (test_forked_and_spawned_workers).
START_METHOD = "forkserver"
mp.set_forkserver_preload(
    ["harness", "vllm.multimodal.cache", "vllm.multimodal.inputs", "vllm.v1.serial_utils",
     "shmstore.vllm"]
)


def context(method: str = START_METHOD):
    """The multiprocessing context the tests start processes with."""
    return mp.get_context(method)


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The whole environment a child process gets: this process's now, plus ``env``. A
    fork server's children would otherwise see the environment of the moment it started
    (another test's store name, for one); :func:`setup_process` with ``whole=True``
    installs it."""
    return {**os.environ, **(env or {})}


def setup_process(env: dict[str, str] | None = None, *, whole: bool = False) -> None:
    """What every process of the cluster does first: ``env`` added to the environment,
    or, with ``whole``, made the whole environment (see :func:`child_env`)."""
    if whole:
        os.environ.clear()
    if env:
        os.environ.update(env)
    # CPU-only machines: the registry's torch is a CUDA build, so vLLM would pin decoded
    # tensors, which fails without a driver (ANCHORS.md). vLLM's workers use one thread.
    import vllm.v1.serial_utils as su

    su.PIN_MEMORY = False
    torch.set_num_threads(1)


class StubModelConfig:
    """What the cache classes read of vLLM's ModelConfig (as vLLM's own cache tests do)."""

    supports_multimodal_inputs = True

    def __init__(self, mm):
        self._mm = mm

    def get_multimodal_config(self):
        return self._mm


def make_config(
    *,
    cache_mb: float = 64,
    max_object_mb: int = 8,
    world_size: int = 1,
    data_parallel: int = 1,
    api_servers: int = 1,
) -> SimpleNamespace:
    mm = SimpleNamespace(
        mm_processor_cache_gb=cache_mb / 1024,
        mm_shm_cache_max_object_size_mb=max_object_mb,
        mm_processor_cache_type="shm",
    )
    pc = SimpleNamespace(
        world_size=world_size,
        data_parallel_size=data_parallel,
        data_parallel_size_local=data_parallel,
        data_parallel_external_lb=False,
        _api_process_count=api_servers,
        nnodes=1,
        distributed_executor_backend="mp",
    )
    return SimpleNamespace(model_config=StubModelConfig(mm), parallel_config=pc)


# ----- items ----------------------------------------------------------------------------


def _seed(h: str) -> int:
    return int.from_bytes(hashlib.blake2b(h.encode(), digest_size=8).digest(), "little")


def make_item(h: str, *, scale: float = 1.0, kind: str | None = None):
    """A deterministic ``MultiModalKwargsItem`` for hash ``h``, shaped like vLLM inputs:
    a Qwen2-VL-style image (flat float32 ``pixel_values`` + batched ``image_grid_thw``,
    kept on the CPU for M-RoPE positions as Qwen2-VL declares it),
    a video (bfloat16 ``pixel_values_videos``), a list of tensors of different shapes
    with plain numbers, or an item with a shared field. ``scale`` scales the sizes; a
    hash ending in ``!`` makes an item of 12 MiB (oversize for small test caches)."""
    from vllm.multimodal.inputs import (
        MultiModalBatchedField,
        MultiModalFieldElem,
        MultiModalFlatField,
        MultiModalKwargsItem,
        MultiModalSharedField,
    )

    g = torch.Generator().manual_seed(_seed(h) % (1 << 62))
    kind = kind or ("image", "video", "nested", "shared", "request")[_seed(h) % 5]
    if h.endswith("!"):
        kind, scale = "image", 12 / 1.2  # ~12 MiB
    if kind == "image":
        n = max(4, int(256 * scale))
        pix = torch.randn(n, 1176, generator=g)
        return MultiModalKwargsItem(
            {
                "pixel_values": MultiModalFieldElem(
                    data=pix, field=MultiModalFlatField(slices=[slice(0, n)], dim=0)
                ),
                "image_grid_thw": MultiModalFieldElem(
                    data=torch.tensor([1, n // 4, 4]), field=MultiModalBatchedField(keep_on_cpu=True)
                ),
            }
        )
    if kind == "video":
        n = max(4, int(192 * scale))
        vid = torch.randn(n, 1176, generator=g).to(torch.bfloat16)
        return MultiModalKwargsItem(
            {
                "pixel_values_videos": MultiModalFieldElem(
                    data=vid, field=MultiModalFlatField(slices=[slice(0, n)], dim=0)
                ),
                "video_grid_thw": MultiModalFieldElem(
                    data=torch.tensor([2, n // 8, 4]), field=MultiModalBatchedField(keep_on_cpu=True)
                ),
            }
        )
    if kind == "request":
        # One item of a 3-image request, built as vLLM's processor builds Qwen2-VL's
        # (MultiModalKwargsItems.from_hf_inputs): the items share their field objects,
        # and the flat field lists every item's slice, each a tuple with 0-d tensor
        # bounds (flat_from_sizes).
        from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItems

        sizes = torch.tensor([max(4, int(s * scale)) // 4 * 4 for s in (64, 96, 128)])
        hf = {
            "pixel_values": torch.randn(int(sizes.sum()), 1176, generator=g),
            "image_grid_thw": torch.tensor([[1, int(s) // 4, 4] for s in sizes]),
        }
        config = {
            "pixel_values": MultiModalFieldConfig.flat_from_sizes("image", sizes),
            "image_grid_thw": MultiModalFieldConfig.batched("image", keep_on_cpu=True),
        }
        return MultiModalKwargsItems.from_hf_inputs(hf, config)["image"][_seed(h) % 3]
    if kind == "nested":
        m = max(2, int(64 * scale))
        parts = [torch.randn(m + i, 16, generator=g) for i in range(3)]
        return MultiModalKwargsItem(
            {
                "frames": MultiModalFieldElem(
                    data=[parts[0], [parts[1], parts[2]]],
                    field=MultiModalBatchedField(keep_on_cpu=True),
                ),
                "fps": MultiModalFieldElem(data=2.5, field=MultiModalBatchedField()),
            }
        )
    m = max(2, int(128 * scale))
    return MultiModalKwargsItem(
        {
            "audio": MultiModalFieldElem(
                data=torch.randint(-1000, 1000, (m, 64), generator=g, dtype=torch.int16),
                field=MultiModalSharedField(batch_size=2),
            ),
        }
    )


def float_item(n: int, value: float = 0.0):
    """An item of one batched field: ``n`` float32 elements, all ``value``. Items of one
    ``n`` are objects of one size, whatever their values: tests of exact budgets."""
    import torch
    from vllm.multimodal.inputs import MultiModalBatchedField, MultiModalFieldElem, MultiModalKwargsItem

    return MultiModalKwargsItem({"x": MultiModalFieldElem(
        data=torch.full((n,), float(value)), field=MultiModalBatchedField())})


def make_updates(h: str) -> list:
    """The prompt updates vLLM's processor would make for item ``h`` (deterministic):
    Qwen2-VL's shape (the image pad token repeated once per embedding), or with
    start and end tokens around it and ``select_token_id`` (as InternVL-style models
    make them), or several. A hash ending in ``~`` gets a ``PromptIndex`` target, which
    is not plain data: such updates cannot be shared between front-ends."""
    from vllm.multimodal.processing.processor import (
        PromptIndexTargets,
        PromptUpdateDetails,
        ResolvedPromptUpdate,
        UpdateMode,
    )

    n = 4 + _seed(h) % 200
    pad = 151655
    if h.endswith("~"):
        return [ResolvedPromptUpdate("image", 0, UpdateMode.INSERT, PromptIndexTargets.start(),
                                     PromptUpdateDetails.from_seq([pad] * n))]
    style = _seed(h) // 7 % 3
    if style == 0:
        return [ResolvedPromptUpdate("image", 0, UpdateMode.REPLACE, [pad],
                                     PromptUpdateDetails.from_seq([pad] * n))]
    if style == 1:
        return [ResolvedPromptUpdate("image", 0, UpdateMode.REPLACE, [pad],
                                     PromptUpdateDetails.select_token_id([9] + [pad] * n + [10], pad))]
    return [
        ResolvedPromptUpdate("video", 0, UpdateMode.REPLACE, [pad + 1],
                             PromptUpdateDetails.select_token_ids([9, pad + 1, 11] * n, [pad + 1, 11])),
        ResolvedPromptUpdate("video", 0, UpdateMode.INSERT, [8, 9], PromptUpdateDetails.from_seq([7])),
    ]


def same_updates(a, b) -> bool:
    """Whether two lists of prompt updates do the same: equal fields, and ``is_embed``
    (a function, compared by identity by the dataclass) giving the same mask."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if (x.modality, x.item_idx, x.mode) != (y.modality, y.item_idx, y.mode):
            return False
        if x.content.full != y.content.full or not (
            x.target == y.target or (callable(getattr(x.target, "get_match_index", None))
                                     and x.target.get_match_index([], 0) == y.target.get_match_index([], 0))
        ):
            return False
        ex, ey = x.content.is_embed, y.content.is_embed
        if (ex is None) != (ey is None):
            return False
        if ex is not None and not torch.equal(ex(x.content.full), ey(y.content.full)):
            return False
    return True


def _digest_into(m, x) -> None:
    if isinstance(x, torch.Tensor):
        m.update(f"T{x.dtype}{tuple(x.shape)}".encode())
        m.update(x.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    elif isinstance(x, (list, tuple)):
        m.update(f"{type(x).__name__}{len(x)}".encode())
        for e in x:
            _digest_into(m, e)
    else:
        m.update(repr(x).encode())


def _canonical(x):
    """A field as its parameters' values: slice bounds as ints, lists and tuples alike
    (vLLM's own codec turns 0-d tensor bounds into ints and tuples into lists)."""
    import dataclasses

    if isinstance(x, slice):
        return ("slice", *(None if v is None else int(v) for v in (x.start, x.stop, x.step)))
    if isinstance(x, (list, tuple)):
        return [_canonical(v) for v in x]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (type(x).__name__, [(f.name, _canonical(getattr(x, f.name))) for f in dataclasses.fields(x)])
    return x


def digest(item, *, keep_on_cpu_only: bool = False) -> str:
    """Keys, field kinds with their parameters, and every tensor's dtype, shape, bytes
    (of the fields marked ``keep_on_cpu`` alone, if asked)."""
    m = hashlib.blake2b(digest_size=16)
    for k in sorted(item):
        if keep_on_cpu_only and not item[k].field.keep_on_cpu:
            continue
        elem = item[k]
        m.update(k.encode())
        m.update(repr(_canonical(elem.field)).encode())
        _digest_into(m, elem.data)
    return m.hexdigest()


# ----- the cache classes under test ---------------------------------------------------


def make_sender(kind: str, config):
    if kind == "shmstore":
        from shmstore.vllm import ShmstoreSenderCache

        return ShmstoreSenderCache(config)
    if kind == "vllm-shm":
        from vllm.multimodal.cache.shm import ShmObjectStoreSenderCache

        return ShmObjectStoreSenderCache(config)
    if kind == "vllm-lru":
        from vllm.multimodal.cache.lru import LruKeyReplicatedSenderCache

        return LruKeyReplicatedSenderCache(config.model_config)
    raise ValueError(kind)


def make_receiver(kind: str, config, lock):
    if kind == "shmstore":
        from shmstore.vllm import ShmstoreReceiverCache

        return ShmstoreReceiverCache(config)
    if kind == "vllm-shm":
        from vllm.multimodal.cache.shm import ShmObjectStoreReceiverCache

        return ShmObjectStoreReceiverCache(config, lock)
    if kind == "vllm-lru":
        # vLLM keeps the mirrored receiver in the engine core and broadcasts items to the
        # workers; here each worker keeps one (same mirror, same results).
        from vllm.multimodal.cache.lru import LruKeyReplicatedReceiverCache

        return LruKeyReplicatedReceiverCache(config.model_config)
    raise ValueError(kind)


def make_engine_cache(kind: str, config):
    """The engine core's cache vLLM runs for this kind, or None (vLLM's ``shm``; the
    harness runs vLLM's ``lru`` receiver in the workers)."""
    if kind == "shmstore":
        from shmstore.vllm import ShmstoreEngineGate

        return ShmstoreEngineGate(config)
    return None


def is_inline(kind: str, item) -> bool:
    """Whether the front-end sent the item's data itself rather than a reference."""
    if item is None:
        return False  # vLLM's lru: cached on the other side
    if kind == "shmstore":
        from shmstore.vllm import is_marker

        return not is_marker(item)
    if kind == "vllm-shm":
        return "address" not in item
    return True


# ----- prefix caching ---------------------------------------------------------------------


def covered_by_prefix_cache(item, mm_hash: str, *, mrope: bool):
    """What vLLM's scheduler sends the workers for an item whose placeholder lies inside
    the prefix-cache-covered part of the prompt: its own ``strip_covered_mm_data``, which
    drops the data (``None``), keeps only the ``keep_on_cpu`` fields for M-RoPE models,
    and keeps vLLM ``shm`` address items whole."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.multimodal.utils import strip_covered_mm_data

    spec = MultiModalFeatureSpec(
        data=item, modality="image", identifier=mm_hash,
        mm_position=PlaceholderRange(offset=0, length=1), mm_hash=mm_hash)
    (spec,) = strip_covered_mm_data([spec], num_computed_tokens=1, uses_mrope=mrope)
    return spec.data


def report(data, cover: str | None) -> str | None:
    """A worker's digest of what vLLM's model runner will use of an item: all of it,
    or for an item covered by the prefix cache, its ``keep_on_cpu`` fields under M-RoPE
    (the positions are computed from them) and nothing otherwise."""
    if cover is None:
        return None if data is None else digest(data)
    if cover == "mrope":
        return "no data" if data is None else digest(data, keep_on_cpu_only=True)
    return None


# ----- the wire ---------------------------------------------------------------------------

# Frames below this size travel together in the request's one message; larger ones (a
# tensor sent inline) follow as their own messages, uncopied, as ZMQ's multipart does.
_JOIN_BELOW = 1 << 20


def send_request(conn, header, bufs) -> None:
    """Sends one request as vLLM does: one message (``header`` plus every small frame of
    every item), then each large frame by itself. ``bufs`` holds each item's encoded
    frames, or None for an item that carries no data."""
    small, large, layout = [], [], []
    for b in bufs:
        for frame in b or ():
            n = memoryview(frame).nbytes
            if n < _JOIN_BELOW:
                small.append(frame)
                layout.append(n)
            else:
                large.append(frame)
                layout.append(-n)
    conn.send((header, layout, b"".join(small)))
    for frame in large:
        conn.send_bytes(frame)


def recv_frames(conn, layout, blob) -> list:
    """The frames of a request received with ``send_request``, in order."""
    frames, at, view = [], 0, memoryview(blob)
    for n in layout:
        if n >= 0:
            frames.append(view[at : at + n])
            at += n
        else:
            frames.append(conn.recv_bytes())
    return frames


# ----- a worker process -----------------------------------------------------------------


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def worker_main(kind: str, config, conn, lock, env: dict[str, str]) -> None:
    """A worker: ``env`` is its whole environment (:func:`child_env`)."""
    setup_process(env, whole=True)
    from vllm.multimodal.cache.base import MultiModalCacheMissError
    from vllm.multimodal.inputs import (
        MultiModalFeatureSpec,
        MultiModalKwargsItem,
        PlaceholderRange,
    )
    from vllm.v1.serial_utils import MsgpackDecoder

    receiver = make_receiver(kind, config, lock)
    if kind == "shmstore" and os.environ.get("SHMSTORE_HARNESS_PREFAULT") == "1":
        # The benchmark: what the store's background thread does after attach (map the
        # store), done before measuring, as it is long done when a real worker's first
        # request comes.
        receiver.store.prefault()
    decoder = MsgpackDecoder(MultiModalKwargsItem)
    conn.send(("ready", os.getpid()))
    held: list[Any] = []
    while True:
        msg = conn.recv()
        if msg is None:
            break
        if msg == "cpu":
            conn.send(("cpu", _cpu_s()))
            continue
        (req, entries, mode), layout, blob = msg
        frames = recv_frames(conn, layout, blob)
        features = []
        for h, nbufs, _ in entries:
            data = None
            if nbufs:
                data = decoder.decode(frames[:nbufs])
                del frames[:nbufs]
            features.append(
                MultiModalFeatureSpec(
                    data=data,
                    modality="image",
                    identifier=h,
                    mm_position=PlaceholderRange(offset=0, length=1),
                    mm_hash=h,
                )
            )
        if mode == "pause":
            conn.send(("paused", req, None))  # the test changes the store meanwhile
            conn.recv()
        t0 = time.perf_counter()
        try:
            receiver.get_and_update_features(features)
        except MultiModalCacheMissError as e:
            conn.send(("miss", req, list(e.mm_hashes)))
            continue
        if mode == "fast":
            # What a worker does next: hold torch tensors (no digest, for timing). The
            # reply carries the receiver cache's own time.
            held = [f.data for f in features]
            conn.send(("ok", req, time.perf_counter() - t0))
            continue
        digests = [report(f.data, cover) for f, (_, _, cover) in zip(features, entries)]
        if mode == "hold":
            held.append(features)  # keep the tensors (and their pins)
            conn.send(("holding", req, digests))
            conn.recv()  # killed before anything comes
        conn.send(("ok", req, digests))
    del held


# ----- the front-end driver -------------------------------------------------------------


class Cluster:
    """One front-end in this process and ``n_workers`` worker processes."""

    def __init__(
        self,
        kind: str,
        config,
        n_workers: int,
        *,
        method: str = START_METHOD,
        env: dict[str, str] | None = None,
        sender=None,
        item_scale: float = 1.0,
        mrope: bool = False,
    ):
        self.kind, self.config = kind, config
        #: Whether the model uses M-RoPE (Qwen2-VL): then the scheduler keeps the fields
        #: marked ``keep_on_cpu`` of items covered by the prefix cache.
        self.mrope = mrope
        self.env = dict(env or {})
        self.item_scale = item_scale
        setup_process(self.env)
        self.ctx = context(method)
        self.lock = self.ctx.Lock()
        self.sender = sender if sender is not None else make_sender(kind, config)
        from vllm.v1.serial_utils import MsgpackEncoder

        self.encoder = MsgpackEncoder()
        #: The engine core's cache, where vLLM runs one for this kind (shmstore's gate).
        self.gate = make_engine_cache(kind, config)
        #: The features the engine core holds for each request in flight.
        self._admitted: dict[float, list] = {}
        self.workers: list[tuple[Any, Any]] = []
        for _ in range(n_workers):
            self.workers.append(self._start_worker())
        self.processed: dict[str, int] = {}
        self.stripped = 0
        self.inline = 0
        self.retries = 0

    def _start_worker(self):
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(
            target=worker_main,
            args=(self.kind, self.config, child, self.lock, child_env(self.env)),
        )
        p.start()
        tag, _pid = parent.recv()
        assert tag == "ready"
        return p, parent

    def replace_worker(self, i: int) -> None:
        """Starts a new worker in place of worker ``i`` (after it was killed)."""
        p, conn = self.workers[i]
        p.join(10)
        conn.close()
        self.workers[i] = self._start_worker()

    def _encode(self, item) -> list:
        return list(self.encoder.encode(item))

    def send(self, hashes: list[str], strip: set[int] = frozenset(), mode: str = "digest", to=None,
             before_engine=None):
        """One pass of a request through the sender, the engine core's cache (raising
        vLLM's miss error there) and on to the workers; ``before_engine`` runs between
        the front-end and the engine core (while the request is on its way)."""
        sender = self.sender
        cached = sender.is_cached(hashes)
        new = {}
        for h, c in zip(hashes, cached):
            if not c and h not in new:
                new[h] = (make_item(h, scale=self.item_scale), make_updates(h))
                self.processed[h] = self.processed.get(h, 0) + 1
        for h in hashes:
            sender.touch_sender_cache_item(h)
        outs = []
        try:
            for h in hashes:
                item, updates = sender.get_and_update_item(new.get(h), h)
                assert same_updates(updates, make_updates(h)), h
                outs.append(item)
        finally:
            sender.release_sender_touches()
        bufs, covered = [], []
        for i, (h, item) in enumerate(zip(hashes, outs)):
            cover = None
            if i in strip:
                item = covered_by_prefix_cache(item, h, mrope=self.mrope)
                cover = "mrope" if self.mrope else "unused"
                self.stripped += 1
            else:
                self.inline += is_inline(self.kind, item)
            bufs.append(None if item is None else self._encode(item))
            covered.append(cover)
        req = random.random()
        if before_engine is not None:
            before_engine()
        if self.gate is not None:
            # Raises vLLM's miss error, before any worker sees the request.
            self._admitted[req] = self.admit(hashes, bufs)
        targets = range(len(self.workers)) if to is None else to
        header = (req, [(h, 0 if b is None else len(b), c) for h, b, c in zip(hashes, bufs, covered)], mode)
        for w in targets:
            send_request(self.workers[w][1], header, bufs)
        return req, list(targets)

    def admit(self, hashes: list[str], bufs: list) -> list:
        """The engine core's part: the request's features, decoded as vLLM's engine core
        decodes them, through its cache (``get_and_update_features``)."""
        from vllm.multimodal.inputs import (
            MultiModalFeatureSpec,
            MultiModalKwargsItem,
            PlaceholderRange,
        )
        from vllm.v1.serial_utils import MsgpackDecoder

        if not hasattr(self, "_decoder"):
            self._decoder = MsgpackDecoder(MultiModalKwargsItem)
        features = [
            MultiModalFeatureSpec(
                data=None if b is None else self._decoder.decode(b), modality="image",
                identifier=h, mm_position=PlaceholderRange(offset=0, length=1), mm_hash=h,
            )
            for h, b in zip(hashes, bufs)
        ]
        return self.gate.get_and_update_features(features)

    def collect(self, req, targets):
        out = {}
        for w in targets:
            tag, got, payload = self.workers[w][1].recv()
            assert got == req, (tag, got, req)
            out[w] = (tag, payload)
        self._admitted.pop(req, None)  # the request is done: the engine core lets go
        return out

    def request(self, hashes: list[str], strip: set[int] = frozenset(), mode: str = "digest"):
        """A request, retried after misses the way vLLM's retry path does. Returns each
        worker's digests (None where the item was stripped)."""
        from vllm.multimodal.cache.base import MultiModalCacheMissError

        for _ in range(6):
            try:
                req, targets = self.send(hashes, strip, mode)
            except MultiModalCacheMissError as e:  # the engine core's gate
                misses = set(e.mm_hashes)
            else:
                res = self.collect(req, targets)
                misses = {h for tag, p in res.values() if tag == "miss" for h in p}
                if misses and self.kind == "shmstore":
                    raise AssertionError(
                        f"a worker missed {sorted(misses)} of {hashes}: vLLM would stop")
                if not misses:
                    return {w: p for w, (tag, p) in res.items()}
            self.retries += 1
            for h in misses:
                self.sender.invalidate(h)
        raise AssertionError(f"request {hashes} still missed after 5 retries")

    def worker_cpu(self) -> list[float]:
        out = []
        for _, conn in self.workers:
            conn.send("cpu")
            out.append(conn.recv()[1])
        return out

    def close(self) -> None:
        for p, conn in self.workers:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p, conn in self.workers:
            p.join(20)
            if p.is_alive():
                p.kill()
        if hasattr(self.sender, "close"):
            self.sender.close()


def expected(
    hashes: list[str], strip=frozenset(), scale: float = 1.0, mrope: bool = False
) -> list[str | None]:
    """What each worker must report for each item (see ``worker_main``)."""
    out = []
    for i, h in enumerate(hashes):
        if i not in strip:
            out.append(digest(make_item(h, scale=scale)))
        elif mrope:
            out.append(digest(make_item(h, scale=scale), keep_on_cpu_only=True))
        else:
            out.append(None)
    return out


def random_stream(seed: int, n_requests: int, pool: int, *, oversize_every: int = 0):
    """Requests of 1 to 4 items over a pool of hashes, hot items more often (so items are
    hit, evicted and re-sent), now and then an oversize one."""
    rng = random.Random(seed)
    hot = [f"h{seed}-{i}" for i in range(pool)]
    for r in range(n_requests):
        n = rng.randint(1, 4)
        hashes = [hot[min(int(rng.paretovariate(1.2)) - 1, pool - 1)] if rng.random() < 0.7
                  else rng.choice(hot) for _ in range(n)]
        if oversize_every and r % oversize_every == oversize_every - 1:
            hashes.append(f"big{seed}-{r}!")
        strip = {i for i in range(len(hashes)) if rng.random() < 0.1}
        yield hashes, strip


def now() -> float:
    return time.perf_counter()
