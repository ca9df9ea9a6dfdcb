"""shmstore as vLLM's shared-memory multimodal cache (vLLM 0.34).

Turn it on with ``--mm-processor-cache-type shm`` and ``SHMSTORE_VLLM=1`` in the
environment of ``vllm serve`` (the package registers a ``vllm.general_plugins`` entry
point; see docs/vllm.md). vLLM's three cache factories then return:

* ``ShmstoreSenderCache`` in every front-end process (P0): it puts each processed
  ``MultiModalKwargsItem`` once into one store per vLLM instance, as one shmstore item
  (every tensor copied once, straight into shared memory; no pickle, no msgpack), and
  sends the workers only a marker: the ``mm_hash`` the request already carries is the key.
* ``ShmstoreReceiverCache`` in every worker (P1): it maps the item back as the same
  ``MultiModalKwargsItem`` with torch tensors over the shared bytes (zero-copy, pinned
  while they live), or raises vLLM's ``MultiModalCacheMissError`` with every missing hash
  of the request, so that vLLM's retry path resends the data.
* no cache in the engine-core process (as for vLLM's own ``shm`` cache), except with
  Ray's executor on several nodes: there ``ShmstorePrefetcher`` starts moving each
  request's new items to the other nodes' stores as the request arrives.

It also takes the place of vLLM's ``processor_only`` fallback with data parallelism or
several API servers: every front-end writes the one store; the first put of an item wins.

Settings (environment):

* ``SHMSTORE_VLLM=1``: use shmstore where vLLM would use its ``shm`` cache (``force``:
  also where it looks multi-node, see below).
* ``SHMSTORE_VLLM_STORE``: the store's name in its directory. Default
  ``shmstore-vllm-<launcher pid>-<random>``, chosen by the first process of the instance
  and inherited by the others; set it yourself to share one store between instances.
* ``SHMSTORE_VLLM_DIR``: the store's directory (default ``/dev/shm``). On kernels before
  6.1, point it at a tmpfs mounted with ``huge=within_size`` for transparent huge pages,
  nothing reserved (docs/vllm.md, "Huge pages").
* ``SHMSTORE_VLLM_HUGE_PAGES=auto|off``: ``auto`` (default) has the store's creator
  rebuild its heap as 2 MiB pages in the background where the kernel allows it (Linux
  6.1+): each worker maps a 64 MiB item with 32 page-table entries instead of 16,384,
  so its first read runs at warm speed, and page tables per process shrink 128x.
  ``off`` keeps 4 KiB pages (no rebuild work in the creating process).
* ``SHMSTORE_VLLM_READ_ONLY=0``: workers attach read-write (default: read-only, so a
  write to a cached tensor faults instead of changing it for everyone).
* ``SHMSTORE_VLLM_CUDA_REGISTER=auto|1|0``: register the store's heap with CUDA in each
  worker (``cudaHostRegister``), so ``.to("cuda", non_blocking=True)`` from a view is a
  direct DMA instead of a staged copy. ``auto`` (default) registers when a GPU is there.
* ``SHMSTORE_VLLM_SOURCE_NODE``: with Ray's executor (``--distributed-executor-backend
  ray``, several nodes), the Ray node id of the front-end's machine (default: Ray's head
  node, where ``vllm serve`` runs). Workers on other nodes read items from their node's
  store, which fetches each item once from the front-end's (``shmstore.ray``,
  docs/multinode.md).
* ``SHMSTORE_VLLM_PREFETCH=0``: with Ray's executor on several nodes, the engine core
  does not prefetch items to the other nodes (default: it does); workers then fetch on
  their first read.
* ``SHMSTORE_VLLM_WORKER_KEEP``: the fraction of the store's bytes the workers keep
  mapped as ready items for cache hits (default ``0.125``, divided among data-parallel
  ranks; ``0`` turns it off). A hit on a kept item costs the worker a dictionary lookup,
  as in vLLM's ``lru`` receiver, instead of a lookup in the store and new tensor views;
  the kept items stay pinned (not evictable) until the worker drops them, least recently
  used first.
"""

from __future__ import annotations

import collections
import functools
import importlib.util
import json
import logging
import os
import sys
import threading
import uuid
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from typing_extensions import override

from vllm.multimodal.cache.base import (
    BaseMultiModalProcessorCache,
    BaseMultiModalReceiverCache,
    MultiModalCacheMissError,
    MultiModalProcessorCacheInItem,
    MultiModalProcessorCacheOutItem,
)
from vllm.multimodal.inputs import (
    MultiModalBatchedField,
    MultiModalFeatureSpec,
    MultiModalFieldConfig,
    MultiModalFieldElem,
    MultiModalKwargsItem,
)
from vllm.utils.cache import CacheInfo

from . import _native, cuda
from .cuda import wait_for_huge_pages
from .items import put_described, torch_spec

logger = logging.getLogger("shmstore.vllm")

#: The one key of the item the workers receive instead of the data (its value: the
#: format version). The ``mm_hash`` the request carries for the item is the store key.
#:
#: The key is named ``address`` because that is how vLLM 0.34 recognises an item that
#: its workers resolve themselves (vLLM's own ``shm`` cache sends one), and it must
#: treat a marker the same way: ``strip_covered_mm_data`` keeps it whole when the prefix
#: cache covers the item (for an M-RoPE model such as Qwen2-VL the workers compute
#: positions from the item's ``image_grid_thw``), and the scheduler never replays it to
#: the model runner as a payload for re-encoding (``_get_encoder_input_updates``),
#: which would bypass the receiver cache. Its value is the format number, no address.
MARKER = "address"
FORMAT = 1
_STRUCTURE = "vllm"

_FIELD_KINDS = {"batched", "flat", "shared"}
#: The torch dtypes an item may hold, and their names in the item format.
_TORCH_DTYPES = {
    t: str(t).removeprefix("torch.")
    for t in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
_MiB = 1 << 20
_ITEMSIZE = {name: torch.empty((), dtype=t).element_size() for t, name in _TORCH_DTYPES.items()}
# Views of read-only shared memory: torch warns that the buffer is not writable (by design:
# a write faults in a read-only attach). Said once in the docs instead of per tensor.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
#: Most sends kept pinned on their way to the workers (the byte budget usually binds).
_MAX_INFLIGHT = 4096
#: Prompt updates kept per front-end (items it can report cached without reprocessing).
_MAX_UPDATES = 1 << 16


class Unsupported(ValueError):
    """An item that cannot be a shmstore item; it goes inline instead. ``reason`` groups
    the cases for the log (one line per reason)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


# ----- the item format ---------------------------------------------------------------


@functools.cache
def _field_layout(cls) -> tuple[str, tuple[tuple[str, bool], ...]] | None:
    """A field class's factory name (vLLM's own table) and its parameters, each with
    whether it holds slices; None for a class we do not store. Once per class: the
    front-end asks for every element of every item."""
    import dataclasses

    from vllm.v1.serial_utils import MMF_CLASS_TO_FACTORY

    name = MMF_CLASS_TO_FACTORY.get(cls)
    if name not in _FIELD_KINDS:
        return None
    return name, tuple((f.name, f.name == "slices") for f in dataclasses.fields(cls))


def _field_kind(field) -> list[Any]:
    """``[factory name, parameters]`` of a field, as the item's structure records it."""
    layout = _field_layout(type(field))  # type: ignore[arg-type]  # vLLM untyped here
    if layout is None:
        raise Unsupported("field", f"field type {type(field).__name__}")
    name, params = layout
    return [name, {p: _slices_out(getattr(field, p)) if sl else getattr(field, p) for p, sl in params}]


def _slices_out(v):
    if isinstance(v, slice):
        return {"s": [v.start, v.stop, v.step]}
    if isinstance(v, (list, tuple)):
        return [_slices_out(x) for x in v]
    raise Unsupported("field", f"flat field slices of type {type(v).__name__}")


def _slices_in(v):
    if isinstance(v, dict):
        return slice(*v["s"])
    return [_slices_in(x) for x in v]


try:  # vLLM depends on msgspec: its JSON encoder is ~15x faster than json.dumps here
    import msgspec

    _json_encoder = msgspec.json.Encoder()

    def _to_json(obj: Any) -> str:
        return _json_encoder.encode(obj).decode()

except ImportError:  # pragma: no cover

    def _to_json(obj: Any) -> str:
        return json.dumps(obj, separators=(",", ":"))


class _Described:
    """An item's tensors as ``_data_out`` finds them: each one's spec for ``put_item``
    (``(name, dtype, shape, buffer)``), the tensor, and their total bytes. Walking the
    item once for all three is what the front-end pays per item, so it is one pass."""

    __slots__ = ("specs", "tensors", "nbytes")

    def __init__(self) -> None:
        self.specs: list[tuple[str, str, tuple[int, ...], Any]] = []
        self.tensors: list[torch.Tensor] = []
        self.nbytes = 0


def _data_out(x, out: _Described):
    """``x`` as JSON, its tensors moved to ``out``. A module-level function, not a
    closure: a recursive closure is a reference cycle, which would keep the tensors (and
    on the worker side, the pins of its tensors) alive until the garbage collector runs."""
    if isinstance(x, torch.Tensor):
        if not x.is_cpu:
            raise Unsupported("device", f"a tensor on {x.device}")
        dt = _TORCH_DTYPES.get(x.dtype)
        if dt is None:
            raise Unsupported("dtype", f"dtype {x.dtype}")
        name = f"t{len(out.tensors)}"
        out.tensors.append(x)
        out.specs.append(torch_spec(name, dt, x))
        out.nbytes += x.nbytes
        return {"t": name}
    if isinstance(x, bool):
        return {"b": x}
    if isinstance(x, int):
        return {"i": x}
    if isinstance(x, float):
        return {"f": x}
    if x is None:
        return None
    if isinstance(x, list):
        return {"l": [_data_out(e, out) for e in x]}
    if isinstance(x, tuple):
        return {"u": [_data_out(e, out) for e in x]}
    raise Unsupported("type", f"a value of type {type(x).__name__}")


def _data_in(x, arrays: dict[str, Any]):
    """The value ``_data_out`` encoded, its tensors taken from ``arrays`` (see there why
    this is not a closure)."""
    if x is None:
        return None
    ((tag, v),) = x.items()
    if tag == "t":
        return arrays[v]
    if tag in ("i", "f", "b"):
        return v
    if tag == "l":
        return [_data_in(e, arrays) for e in v]
    if tag == "u":
        return tuple(_data_in(e, arrays) for e in v)
    raise ValueError(f"unknown tag {tag!r} in a shmstore item")


def encode_item(item: MultiModalKwargsItem) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The arrays and metadata of a shmstore item holding ``item``: every tensor becomes
    one array (copied once by ``put_item``); the structure (keys, field kinds and their
    parameters, nesting of lists and tuples, plain numbers) is one small JSON string.
    Raises ``Unsupported`` for anything else (a GPU tensor, an exotic dtype, a string)."""
    out, meta = describe_item(item)
    return {spec[0]: t for spec, t in zip(out.specs, out.tensors)}, meta


def describe_item(item: MultiModalKwargsItem) -> tuple[_Described, dict[str, Any]]:
    """``encode_item``'s work in the form ``put_described`` takes: the front-end's path."""
    out = _Described()
    # `.data`: the item's own dict (a UserDict's documented attribute), iterated without
    # the Mapping mixin's per-element calls.
    keys = [
        {"k": key, "field": _field_kind(elem.field), "data": _data_out(elem.data, out)}
        for key, elem in item.data.items()
    ]
    return out, {_STRUCTURE: _to_json({"v": FORMAT, "keys": keys})}


@functools.lru_cache(maxsize=4096)
def _structure(text: str):
    """A parsed item structure, with its fields built: items of one model repeat a
    handful of structures, so parsing them once per worker is enough (fields are frozen
    dataclasses, safe to share)."""
    structure = json.loads(text)
    if structure.get("v") != FORMAT:
        raise ValueError(f"shmstore item format {structure.get('v')}, expected {FORMAT}")
    keys = []
    for k in structure["keys"]:
        kind, kw = k["field"]
        if kind not in _FIELD_KINDS:
            raise ValueError(f"unknown field kind {kind!r} in a shmstore item")
        kw = dict(kw)
        if "slices" in kw:
            kw["slices"] = _slices_in(kw["slices"])
        keys.append((k["k"], getattr(MultiModalFieldConfig, kind)("", **kw).field, k["data"]))
    return keys


def decode_item(arrays: dict[str, Any]) -> MultiModalKwargsItem:
    """The ``MultiModalKwargsItem`` an item holds, its tensors being ``arrays``'s
    (zero-copy views of the shared object, as ``get_item(..., as_torch=True)`` returns)."""
    meta = arrays.get("__meta__") or {}
    return MultiModalKwargsItem(
        {key: MultiModalFieldElem(data=_data_in(d, arrays), field=field) for key, field, d in _structure(meta[_STRUCTURE])}
    )


def marker_item() -> MultiModalKwargsItem:
    """What crosses vLLM's RPC for an item in the store: no data, no address, no
    signature. The receiver looks the item up by the request's ``mm_hash``.

    A new item each time (vLLM's items are mutable), built around ``UserDict.__init__``,
    whose generic ``update`` costs more than the rest of a hit in the sender."""
    item = _new_item(MultiModalKwargsItem)
    item.data = {MARKER: MultiModalFieldElem(FORMAT, _MARKER_FIELD)}
    return item


_new_item = MultiModalKwargsItem.__new__


#: The marker's field (frozen, so one instance serves every marker).
_MARKER_FIELD = MultiModalBatchedField()


def is_marker(item: MultiModalKwargsItem | None) -> bool:
    """Whether ``item`` is a marker: the item is in the store under the request's
    ``mm_hash``."""
    return item is not None and len(item) == 1 and MARKER in item and item[MARKER].data == FORMAT


# ----- the store of one vLLM instance ----------------------------------------------------

_PREFIX = "shmstore-vllm-"


def store_name() -> str:
    """This vLLM instance's store name: ``SHMSTORE_VLLM_STORE``, set by the first process
    that asks (the launcher, when the plugin loads) and inherited by every process it
    starts, forked or spawned."""
    name = os.environ.get("SHMSTORE_VLLM_STORE")
    if not name:
        name = f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.environ["SHMSTORE_VLLM_STORE"] = name
    return name


def store_dir() -> str:
    """The directory of this instance's store: ``SHMSTORE_VLLM_DIR``, default /dev/shm."""
    return os.environ.get("SHMSTORE_VLLM_DIR") or "/dev/shm"


def store_path() -> str:
    """The path of this instance's store (``store_dir()`` / ``store_name()``)."""
    return os.path.join(store_dir(), store_name())


def remove_stale_stores(directory: str | None = None) -> list[str]:
    """Removes stores left by vLLM instances that crashed: every ``shmstore-vllm-*``
    store no live process is attached to, including stores of an older shmstore version
    (after an upgrade they cannot be opened, only removed). Returns the names removed. A
    store in use is never touched: every attached process holds a lock on a byte of the
    file, which the kernel drops when it dies (``Store.remove_if_unused``).
    """
    directory = directory or store_dir()
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        current = os.environ.get("SHMSTORE_VLLM_STORE")
        if not name.startswith(_PREFIX) or (
            current and (name == current or name.startswith(f"{current}-node-"))
        ):
            continue  # not ours, or this instance's (its store, or a node store of it)
        try:
            if _native.Store.remove_if_unused(os.path.join(directory, name)):
                removed.append(name)
        except (_native.ShmstoreError, OSError):
            continue  # not a store, or just removed by another instance
    if removed:
        logger.info("shmstore: removed %d store(s) left by crashed vLLM instances: %s",
                    len(removed), ", ".join(removed))
    return removed


def _page_kind(stats: dict) -> str:
    """How the store's pages are backed, for the log: "4 KiB", "2 MiB transparent
    huge", "2 MiB hugetlb"."""
    size = stats["page_size"]
    label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
    if stats["huge_pages"]:
        return f"{label} transparent huge"
    return f"{label} hugetlb" if size > 4096 else label


def _capacity(vllm_config) -> int:
    mm_config = vllm_config.model_config.get_multimodal_config()
    return int(mm_config.mm_processor_cache_gb * (1 << 30))


def open_store(vllm_config, *, read_only: bool = False) -> _native.Store:
    """Attaches to this instance's store, creating it (evicting, removed when its last
    process leaves) if this process is the first."""
    name = store_path()
    capacity = _capacity(vllm_config)
    for _ in range(3):
        try:
            # Front-ends and workers attach long before they use most of the store: map
            # it in the background so that their first accesses run warm.
            return _native.Store.open(name, read_only=read_only, populate_in_background=True)
        except _native.StoreNotFound:
            pass
        try:
            try:
                s = _native.Store.create(
                    name,
                    capacity,
                    max_objects=max(1 << 16, capacity >> 16),
                    max_clients=256,
                    evict=True,
                    remove_when_unused=True,
                    prefault=False,
                    huge_pages="off" if os.environ.get("SHMSTORE_VLLM_HUGE_PAGES") == "off" else "auto",
                )
            except _native.InsufficientSpace as e:
                # The capacity is vLLM's setting: say which one, and the usual fixes.
                gb = vllm_config.model_config.get_multimodal_config().mm_processor_cache_gb
                raise _native.InsufficientSpace(
                    f"{e}. vLLM sets the capacity: --mm-processor-cache-gb={gb:g}. Lower "
                    "it, run the container with --shm-size=<size> or --ipc=host, or set "
                    "SHMSTORE_VLLM_DIR to a tmpfs with room"
                ) from None
            st = s.stats()
            logger.info(
                "shmstore: multimodal cache in %s (%.1f GiB, %s pages, shared by every "
                "front-end and worker of this vLLM instance)", name, capacity / (1 << 30),
                _page_kind(st))
            if st["page_size"] <= 4096:
                logger.info(
                    "shmstore: this process rebuilds the store's pages as 2 MiB pages in "
                    "the background where the kernel allows it (Linux 6.1 and later): "
                    "workers then map 512x fewer page-table entries. `shmstore stat %s` "
                    "shows how far it got; on older kernels mount a tmpfs with "
                    "huge=within_size and set SHMSTORE_VLLM_DIR to it (docs/vllm.md, "
                    "\"Huge pages\")", name)
            if not read_only:
                return s
            ro = _native.Store.open(name, read_only=True, populate_in_background=True)
            # A worker created the store: its writable handle goes once it has finished
            # rebuilding the pages (which only the creator does; `prefault` finishes it
            # now), on a thread, so this worker starts at once. It goes after the
            # read-only attach: the store is removed when unused.
            threading.Thread(target=_finish_rebuild_and_drop, args=([s],),
                             name="shmstore-rebuild").start()
            del s
            return ro
        except _native.StoreExists:
            pass
    return _native.Store.open(name, read_only=read_only, populate_in_background=True)


def _finish_rebuild_and_drop(holder: list) -> None:
    holder[0].prefault()
    holder.clear()


# ----- P0: the front-end ---------------------------------------------------------------


class ShmstoreSenderCache(BaseMultiModalProcessorCache):
    """The front-end (P0) cache: each item goes into the store once; only a marker
    crosses the RPC.

    Eviction is the store's CLOCK (least recently used first), never FIFO, and skips
    pinned items. vLLM's touch protocol maps to pins: ``is_cached`` and
    ``touch_sender_cache_item`` pin an item until ``release_sender_touches`` (the end of
    the request's merge), and every item sent stays pinned in a window of recent sends
    (at most ``inflight_fraction`` of the store's bytes, and always the latest send) so
    that it is not evicted while its request is on the way to the workers. An item that is gone
    anyway is a miss on the worker, which vLLM's retry path turns into a resend.

    Prompt updates (front-end Python objects, not shareable) stay in this process: a
    front-end runs the HF processor once for an item it has not seen, even if another
    front-end already stored the item's tensors.
    """

    def __init__(self, vllm_config, *, inflight_fraction: float = 0.25) -> None:
        super().__init__()
        mm_config = vllm_config.model_config.get_multimodal_config()
        self.store = open_store(vllm_config)  # populated in the background (Rust thread)
        _export_metrics(self.store)
        self.max_object_size = int(mm_config.mm_shm_cache_max_object_size_mb * _MiB)
        self._updates: collections.OrderedDict[str, Sequence[Any]] = collections.OrderedDict()
        self._touched: dict[str, memoryview] = {}
        #: The window of recent sends: mm_hash -> (pin, bytes), oldest first.
        self._inflight: collections.OrderedDict[str, tuple[memoryview, int]] = (
            collections.OrderedDict())
        self._inflight_bytes = 0
        self._inflight_budget = int(_capacity(vllm_config) * inflight_fraction)
        self._hits = 0
        self._total = 0
        self._last_info = CacheInfo(hits=0, total=0)
        self._warned: set[str] = set()
        self.inline_only = False  # set when workers turn out not to see the store
        # With Ray's executor, workers on other nodes fetch through shmstore.ray: a miss
        # there means the item is gone, never that they cannot see a store.
        self.bridged = _ray_backend(vllm_config)

    # -- what vLLM asks ---------------------------------------------------------------

    @override
    def is_cached_item(self, mm_hash: str) -> bool:
        if self.inline_only or mm_hash not in self._updates:
            return False
        if mm_hash in self._touched:
            return True
        v = self._pin(mm_hash)
        if v is None:
            del self._updates[mm_hash]
            return False
        self._touched[mm_hash] = v  # protected until the request is merged
        return True

    @override
    def touch_sender_cache_item(self, mm_hash: str) -> None:
        if mm_hash in self._touched or mm_hash not in self._updates:
            return
        v = self._pin(mm_hash)
        if v is not None:
            self._touched[mm_hash] = v

    @override
    def release_sender_touches(self) -> None:
        self._touched.clear()

    @override
    def get_and_update_item(
        self,
        mm_item: MultiModalProcessorCacheInItem,
        mm_hash: str,
    ) -> MultiModalProcessorCacheOutItem:
        self._total += 1
        if mm_item is None:
            # vLLM found the item cached (is_cached) and skipped processing it.
            updates = self._updates.get(mm_hash)
            if updates is None:
                raise MultiModalCacheMissError([mm_hash])
            self._hits += 1
            self._updates.move_to_end(mm_hash)
            self._send(mm_hash, self._touched.pop(mm_hash, None))
            return marker_item(), updates

        item, updates = mm_item
        if self.inline_only:
            return mm_item
        try:
            out, meta = describe_item(item)
            if out.nbytes > self.max_object_size:
                raise Unsupported(
                    "size",
                    f"{out.nbytes / _MiB:.1f} MiB is over --mm-shm-cache-max-object-size-mb="
                    f"{self.max_object_size // _MiB}",
                )
            # Pinned as it is sealed: the send below needs no second lookup.
            pin = put_described(self.store, mm_hash, out.specs, out.tensors, meta, None, pin=True)
        except Unsupported as e:
            self._warn_once(e.reason, f"shmstore: an item goes inline ({e}); said once per reason")
            return mm_item
        except _native.AlreadyExists:
            pin = None  # another front-end is putting (or put) it: the first put wins
        except (_native.Full, _native.TooLarge, _native.TableFull) as e:
            logger.debug("shmstore: item %s not cached (%s)", mm_hash, e)
            return mm_item
        self._updates[mm_hash] = updates
        self._updates.move_to_end(mm_hash)
        self._forget_sent(mm_hash)  # a pin from an earlier send may be of a deleted object
        self._send(mm_hash, pin)
        return marker_item(), updates

    @override
    def validate_input_item(self, mm_item: MultiModalKwargsItem, mm_hash: str) -> None:
        if is_marker(mm_item) and not self.store.contains(mm_hash):
            raise ValueError(f"multimodal item {mm_hash} is not in the shmstore cache")

    @override
    def invalidate(self, mm_hash: str) -> None:
        # A worker missed the item. If the store still holds it, the worker cannot see
        # the store (it runs on another machine): from now on, items go inline.
        if self.store.contains(mm_hash) and not self.inline_only and not self.bridged:
            self.inline_only = True
            logger.warning(
                "shmstore: a worker could not read item %s from %s although the "
                "store holds it; workers on another machine? Sending items inline from "
                "now on (see docs/vllm.md, multi-node).", mm_hash, store_path())
        self._updates.pop(mm_hash, None)
        self._touched.pop(mm_hash, None)
        self._forget_sent(mm_hash)

    @override
    def clear_cache(self) -> None:
        self._touched.clear()
        self._inflight.clear()
        self._inflight_bytes = 0
        self._updates.clear()
        for oid, _len, state, _pins in self.store.list():
            if state != "sealed":
                continue
            try:
                self.store.delete(oid)
            except _native.ShmstoreError:
                pass  # deleted by another front-end meanwhile
        self._hits = self._total = 0
        self._last_info = CacheInfo(hits=0, total=0)

    @override
    def make_stats(self, *, delta: bool = False) -> CacheInfo:
        info = CacheInfo(hits=self._hits, total=self._total)
        if delta:
            info, self._last_info = info - self._last_info, info
        return info

    @override
    def close(self) -> None:
        self._touched.clear()
        self._inflight.clear()
        self._inflight_bytes = 0

    # -- internals --------------------------------------------------------------------

    def _pin(self, mm_hash: str) -> memoryview | None:
        """A pin on the item: the one its recent send holds (a hit on an item sent
        recently costs no lookup in the store), else a new one; None if it is gone."""
        sent = self._inflight.get(mm_hash)
        if sent is not None:
            return sent[0]
        return self.store.try_get(mm_hash)

    def _forget_sent(self, mm_hash: str) -> None:
        sent = self._inflight.pop(mm_hash, None)
        if sent is not None:
            self._inflight_bytes -= sent[1]

    def _send(self, mm_hash: str, pin: memoryview | None) -> None:
        """Keeps the item pinned while its request is on the way to the workers: it
        joins (or, sent again, moves to the end of) the window of recent sends."""
        sent = self._inflight.get(mm_hash)
        if sent is not None:
            self._inflight.move_to_end(mm_hash)
            return
        if pin is None:
            pin = self.store.try_get(mm_hash)
            if pin is None:
                return  # evicted already: the worker will miss, vLLM resends
        self._inflight[mm_hash] = (pin, pin.nbytes)
        self._inflight_bytes += pin.nbytes
        while len(self._inflight) > 1 and (
            self._inflight_bytes > self._inflight_budget or len(self._inflight) > _MAX_INFLIGHT
        ):
            _, (_, n) = self._inflight.popitem(last=False)
            self._inflight_bytes -= n
        # Bounded bookkeeping: forget prompt updates of items the store no longer holds
        # (then the oldest), once there are twice as many as the limit allows.
        if len(self._updates) > 2 * _MAX_UPDATES:
            for h in [h for h in self._updates if not self.store.contains(h)]:
                del self._updates[h]
            while len(self._updates) > _MAX_UPDATES:
                self._updates.popitem(last=False)

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(msg)


# ----- P1: the workers -----------------------------------------------------------------


class ShmstoreReceiverCache(BaseMultiModalReceiverCache):
    """The worker (P1) cache: markers become the stored items, zero-copy.

    The returned tensors are views of the shared object and keep it pinned while they
    live. vLLM keeps a request's ``mm_features`` until the request finishes (and the
    encoder cache holds the encoder's outputs, not these tensors), so an item is pinned
    by a worker while a request that uses it is running there.

    The worker also keeps the items it read most recently, up to ``keep_fraction`` of the
    store's bytes (``SHMSTORE_VLLM_WORKER_KEEP``), and answers a cache hit on one of them
    with the same ``MultiModalKwargsItem`` (as vLLM's ``lru`` receiver does with its
    mirrored items): no lookup, no new views. Kept items stay pinned, so the store cannot
    evict them; the bound keeps the rest of the store evictable, and the least recently
    used item is let go first.
    """

    def __init__(
        self,
        vllm_config,
        shared_worker_lock=None,
        *,
        timeout: float = 10.0,
        keep_fraction: float | None = None,
    ) -> None:
        super().__init__()
        read_only = os.environ.get("SHMSTORE_VLLM_READ_ONLY", "1") != "0"
        #: With Ray's executor on a node other than the front-end's: this node's stores
        #: and bridge (shmstore.ray); None otherwise.
        self.nodes = _remote_node_stores(vllm_config)
        if self.nodes is not None:
            remove_stale_stores()  # left on this node by crashed instances
            self.store = self.nodes.store()
            logger.info(
                "shmstore: worker on Ray node %s, not the front-end's (%s): items come "
                "through this node's store /dev/shm/%s, fetched once per node",
                self.nodes.this_node()[:12], self.nodes.source()[:12], self.nodes.store_name())
        else:
            self.store = open_store(vllm_config, read_only=read_only)
        self.timeout = timeout
        #: Whether this worker registered the store's heap with CUDA (set by a background
        #: thread once the store's pages are rebuilt; see ``register_with_cuda_later``).
        self.cuda_registered = False
        register_with_cuda_later(self)
        if keep_fraction is None:
            keep_fraction = float(os.environ.get("SHMSTORE_VLLM_WORKER_KEEP", "0.125"))
        #: Items kept ready for hits: mm_hash -> (item, its bytes), least recent first.
        self._kept: collections.OrderedDict[str, tuple[MultiModalKwargsItem, int]] = (
            collections.OrderedDict())
        self._kept_bytes = 0
        # Workers of one data-parallel rank read the same items and mostly keep the same
        # ones; ranks read different requests: the fraction is shared among the ranks.
        ranks = max(1, int(getattr(vllm_config.parallel_config, "data_parallel_size", 1) or 1))
        self._keep_budget = int(
            self.store.stats()["capacity"] * max(0.0, keep_fraction) / ranks)

    @override
    def get_and_update_features(
        self, mm_features: list[MultiModalFeatureSpec]
    ) -> list[MultiModalFeatureSpec]:
        # data=None: prefix caching covered the item; there is nothing to read.
        present = [f for f in mm_features if f.data is not None]
        if self.nodes is not None:
            from .ray import FetchFailed, ItemsMissing

            keys = [f.mm_hash or f.identifier for f in present if is_marker(f.data)]
            try:
                self.nodes.ensure_local(keys)  # one round trip for the whole request
            except (ItemsMissing, FetchFailed) as e:
                raise MultiModalCacheMissError([str(k) for k in e.keys]) from None
        super().get_and_update_features(present)
        return mm_features

    @override
    def get_and_update_item(
        self, mm_item: MultiModalKwargsItem | None, mm_hash: str
    ) -> MultiModalKwargsItem:
        if not is_marker(mm_item):
            assert mm_item is not None, f"Expected an item for {mm_hash=}"
            return mm_item  # sent inline
        kept = self._kept.get(mm_hash)
        if kept is not None:
            self._kept.move_to_end(mm_hash)
            return kept[0]
        try:
            arrays, nbytes = _get_torch_item(self.store, mm_hash, self.timeout)
        except (_native.NotFound, _native.CreatorDied, _native.Timeout):
            raise MultiModalCacheMissError([mm_hash]) from None
        item = decode_item(arrays)
        self._keep(mm_hash, item, nbytes)
        return item

    def _keep(self, mm_hash: str, item: MultiModalKwargsItem, nbytes: int) -> None:
        """Keeps ``item`` ready for hits if it fits the budget, letting go of the least
        recently used kept items (and, unless vLLM still holds them, their pins)."""
        if nbytes > self._keep_budget:
            return
        self._kept[mm_hash] = (item, nbytes)
        self._kept_bytes += nbytes
        while self._kept_bytes > self._keep_budget:
            _, (_, n) = self._kept.popitem(last=False)
            self._kept_bytes -= n

    @override
    def touch_receiver_cache_item(
        self, mm_hash: str, mm_item: MultiModalKwargsItem | None = None
    ) -> None:
        # Lookups are by key; there is no handle to validate. An item vLLM touches (its
        # request hit the prefix cache) is recent again.
        if mm_hash in self._kept:
            self._kept.move_to_end(mm_hash)

    @override
    def clear_cache(self) -> None:
        # The front-end's clear_cache empties the one store; the kept items' pins go.
        self._kept.clear()
        self._kept_bytes = 0


# ----- the engine core, with Ray's executor across nodes ---------------------------------


class ShmstorePrefetcher(BaseMultiModalReceiverCache):
    """The engine-core cache with Ray's executor on several nodes. It passes every
    feature on unchanged; for each item it has not seen yet, it asks the bridges of the
    other nodes to fetch it now, as the request arrives (``NodeStores.prefetch``: one
    call per node for all of a request's new items, not waited for).

    vLLM's workers read a request's items when the request is scheduled, after the step
    running at the time: by then each item is in the worker's node store, or on its way
    (the worker then waits for its seal instead of asking its bridge), so a remote
    worker's first read costs about what a hit does (docs/multinode.md has the figures).
    A late or failed prefetch costs nothing but what it would have saved: the workers'
    own reads fetch what their node lacks, as without it. Items it has seen are
    remembered (the last ``remember``), so that a cache hit in the front-end, which
    sends the same marker again, costs no call.
    """

    def __init__(self, nodes: Any, *, remember: int = 1 << 16) -> None:
        super().__init__()
        self.nodes = nodes
        self.remember = remember
        self.seen: collections.OrderedDict[str, None] = collections.OrderedDict()

    @override
    def get_and_update_features(
        self, mm_features: list[MultiModalFeatureSpec]
    ) -> list[MultiModalFeatureSpec]:
        keys = []
        for f in mm_features:
            if f.data is None or not is_marker(f.data):
                continue  # covered by prefix caching, or sent inline
            key = f.mm_hash or f.identifier
            if key in self.seen:
                self.seen.move_to_end(key)
                continue
            self.seen[key] = None
            keys.append(key)
        while len(self.seen) > self.remember:
            self.seen.popitem(last=False)
        if keys:
            try:
                self.nodes.prefetch(keys)
            except Exception as e:  # noqa: BLE001 - an optimization: workers fetch anyway
                _log_once("prefetch", f"shmstore: prefetch failed ({e}); workers fetch items themselves")
        return mm_features

    @override
    def get_and_update_item(
        self, mm_item: MultiModalKwargsItem | None, mm_hash: str
    ) -> MultiModalKwargsItem:
        assert mm_item is not None, f"Expected an item for {mm_hash=}"
        return mm_item  # unchanged: the workers read it

    @override
    def touch_receiver_cache_item(
        self, mm_hash: str, mm_item: MultiModalKwargsItem | None = None
    ) -> None:
        pass

    @override
    def clear_cache(self) -> None:
        self.seen.clear()


def engine_prefetcher(vllm_config) -> ShmstorePrefetcher | None:
    """The engine core's prefetcher when Ray's executor spans several nodes (Ray is up
    in the engine core: the executor started it), unless ``SHMSTORE_VLLM_PREFETCH=0``;
    None otherwise (vLLM's own ``shm`` cache has no engine-core cache either)."""
    if os.environ.get("SHMSTORE_VLLM_PREFETCH", "1") == "0":
        return None
    nodes = _node_stores(vllm_config)
    if nodes is None:
        return None
    import ray

    if sum(1 for n in ray.nodes() if n["Alive"]) < 2:
        return None
    _log_once(
        "prefetch",
        "shmstore: the engine core prefetches each request's items into the stores of "
        "the other nodes as the request arrives (SHMSTORE_VLLM_PREFETCH=0 turns it off)",
    )
    return ShmstorePrefetcher(nodes)


def _get_torch_item(store, mm_hash: str, timeout: float) -> tuple[dict[str, Any], int]:
    """The item's tensors (views of the shared object, pinning it) and the object's
    size. Waits only if the item is being created (another front-end is writing it); an
    absent item is a miss at once."""
    mv = store.get(mm_hash, timeout, wait_if_absent=False)
    arrays, meta = _native.decode_item(mv)
    out: dict[str, Any] = {}
    for name, dt, shape, offset, nbytes in arrays:
        tdt = getattr(torch, dt)
        if nbytes == 0:
            out[name] = torch.empty(shape, dtype=tdt)
            continue
        out[name] = torch.frombuffer(mv, dtype=tdt, count=nbytes // _ITEMSIZE[dt], offset=offset).view(shape)
    if meta:
        out["__meta__"] = meta
    return out, mv.nbytes


def register_with_cuda_later(receiver) -> None:
    """Registers the receiver's store with CUDA on a background thread, per
    ``SHMSTORE_VLLM_CUDA_REGISTER``, after the store's pages are rebuilt as 2 MiB pages:
    registration pins every page, and the kernel cannot rebuild a pinned page, so a
    worker that registered first would leave the store on 4 KiB pages for every process.
    Until it is done, copies to the GPU are staged (correct, slower); on a machine
    without a GPU nothing happens."""
    if not _cuda_wanted():
        return

    def run() -> None:
        wait_for_huge_pages(receiver.store)
        receiver.cuda_registered = register_with_cuda(receiver.store)

    threading.Thread(target=run, name="shmstore-cuda-register", daemon=True).start()


def _cuda_wanted() -> bool:
    mode = os.environ.get("SHMSTORE_VLLM_CUDA_REGISTER", "auto")
    if mode == "0":
        return False
    if not cuda.gpu_visible():
        if mode == "1":
            logger.warning("shmstore: SHMSTORE_VLLM_CUDA_REGISTER=1 but no GPU is visible; skipped")
        else:
            logger.debug("shmstore: no GPU visible; store not registered with CUDA")
        return False
    return True


def register_with_cuda(store) -> bool:
    """Registers the store's heap with CUDA in this process (``shmstore.cuda.register``),
    per ``SHMSTORE_VLLM_CUDA_REGISTER`` (``auto``: when a GPU is there). Returns whether it
    did; never raises: a worker that cannot register copies staged, as without."""
    if not _cuda_wanted():
        return False
    read_only = os.environ.get("SHMSTORE_VLLM_READ_ONLY", "1") != "0"
    try:
        cuda.register(store, read_only=read_only)
    except Exception as e:  # noqa: BLE001 - any failure means "not registered"
        logger.warning("shmstore: %s (see docs/vllm.md, \"GPU copies\")", e)
        return False
    return True


# ----- activation --------------------------------------------------------------------


def enabled() -> bool:
    return os.environ.get("SHMSTORE_VLLM", "").lower() in ("1", "true", "yes", "force")


def applies(vllm_config) -> bool:
    """Whether shmstore takes this vLLM instance's multimodal cache: a multimodal model,
    a cache size above 0, ``mm_processor_cache_type == "shm"``, ``SHMSTORE_VLLM`` set,
    and every worker on this machine (unless ``SHMSTORE_VLLM=force``)."""
    if not enabled():
        return False
    model_config = vllm_config.model_config
    if model_config is None or not model_config.supports_multimodal_inputs:
        return False
    mm_config = model_config.get_multimodal_config()
    if mm_config.mm_processor_cache_gb <= 0 or mm_config.mm_processor_cache_type != "shm":
        return False
    if os.environ.get("SHMSTORE_VLLM", "").lower() == "force":
        return True
    pc = vllm_config.parallel_config
    if _ray_backend(vllm_config):
        if importlib.util.find_spec("ray") is not None:
            _log_once(
                "ray",
                "shmstore: Ray executor: workers on other nodes read items through their "
                "node's store, fetched once per node (shmstore.ray)",
            )
            return True
        _log_once("ray", "shmstore: Ray executor but ray is not importable; using vLLM's own cache")
        return False
    multi_node = getattr(pc, "nnodes", 1) > 1 or getattr(
        pc, "data_parallel_size_local", 1
    ) < getattr(pc, "data_parallel_size", 1)
    if multi_node:
        _log_once(
            "multinode",
            "shmstore: workers may run on other machines (nnodes or remote data-parallel "
            "ranks without Ray); using vLLM's own cache. SHMSTORE_VLLM=force overrides.",
        )
        return False
    return True


def _ray_backend(vllm_config) -> bool:
    pc = getattr(vllm_config, "parallel_config", None)
    return getattr(pc, "distributed_executor_backend", None) == "ray"


def _node_stores(vllm_config):
    """The instance's ``shmstore.ray.NodeStores`` in a process where Ray's executor
    started Ray (the engine core, the workers), else None."""
    if not _ray_backend(vllm_config) or "ray" not in sys.modules:
        return None
    import ray

    if not ray.is_initialized():
        return None
    from .ray import NodeStores

    capacity = _capacity(vllm_config)
    return NodeStores(
        store_name(),
        capacity,
        source_node=os.environ.get("SHMSTORE_VLLM_SOURCE_NODE") or None,
        max_objects=max(1 << 16, capacity >> 16),
        read_only=os.environ.get("SHMSTORE_VLLM_READ_ONLY", "1") != "0",
    )


def _remote_node_stores(vllm_config):
    """``shmstore.ray.NodeStores`` for a worker that Ray's executor runs on a node other
    than the front-end's, else None."""
    nodes = _node_stores(vllm_config)
    return None if nodes is None or nodes.this_node() == nodes.source() else nodes


_logged: set[str] = set()
_metrics: Any = None  # the collector registered by _export_metrics


def _export_metrics(store: _native.Store) -> None:
    """Adds the store's figures to prometheus_client's default registry, which vLLM serves
    at ``/metrics`` (names in docs/metrics.md). One collector per process: a new sender
    cache replaces the previous one's. The collector holds the store weakly."""
    global _metrics
    try:
        from prometheus_client import REGISTRY

        from . import prometheus
    except ImportError:
        _log_once("metrics", "shmstore: prometheus_client is not installed; no metrics")
        return
    if _metrics is not None:
        try:
            REGISTRY.unregister(_metrics)
        except KeyError:
            pass
    try:
        _metrics = prometheus.register(store)
    except ValueError as e:  # the names are taken by a collector of someone else's
        _metrics = None
        _log_once("metrics", f"shmstore: metrics not exported: {e}")


def _log_once(key: str, msg: str) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.info(msg)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: with ``SHMSTORE_VLLM`` set, makes vLLM's
    cache factories return shmstore's caches. Safe to call any number of times, in any
    process (vLLM loads plugins in every one)."""
    if not enabled():
        return
    import vllm.multimodal.cache as pkg
    import vllm.multimodal.cache.factories as factories

    if getattr(factories, "_shmstore_patched", False):
        return
    if "SHMSTORE_VLLM_STORE" not in os.environ:
        # The first process of the instance (the launcher): name the store for every
        # process it starts, and clean up after instances that crashed.
        store_name()
        remove_stale_stores()
    orig_processor = factories.processor_cache_from_config
    orig_engine = factories.engine_receiver_cache_from_config
    orig_worker = factories.worker_receiver_cache_from_config

    def processor_cache_from_config(vllm_config):
        if applies(vllm_config):
            return ShmstoreSenderCache(vllm_config)
        return orig_processor(vllm_config)

    def engine_receiver_cache_from_config(vllm_config):
        if applies(vllm_config):
            return engine_prefetcher(vllm_config)
        return orig_engine(vllm_config)

    def worker_receiver_cache_from_config(vllm_config, shared_worker_lock=None):
        if applies(vllm_config):
            return ShmstoreReceiverCache(vllm_config, shared_worker_lock)
        return orig_worker(vllm_config, shared_worker_lock)

    patched = {
        "processor_cache_from_config": processor_cache_from_config,
        "engine_receiver_cache_from_config": engine_receiver_cache_from_config,
        "worker_receiver_cache_from_config": worker_receiver_cache_from_config,
    }
    # The factories' module, the package that re-exports them, and every module that
    # imported them by name already (the others import the patched names later).
    for mod in (factories, pkg, *(sys.modules.get(m) for m in (
        "vllm.renderers.base", "vllm.v1.engine.core", "vllm.v1.worker.worker_base"))):
        if mod is None:
            continue
        for name, fn in patched.items():
            if hasattr(mod, name):
                setattr(mod, name, fn)
    factories._shmstore_patched = True
    _log_once("on", f"shmstore: vLLM multimodal cache plugin active (store {store_name()})")
