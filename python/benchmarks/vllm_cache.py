"""vLLM's multimodal caches beside shmstore's, same run, same items, through vLLM 0.34's own
classes (run: scripts/vllm.sh bench; figures in docs/vllm.md).

Topology, as in vLLM: a front-end (P0, this process) runs the processor cache; what it
returns is encoded with vLLM's MsgpackEncoder and sent once to an engine-core process,
which forwards it to every worker (vLLM broadcasts the scheduler output the same way);
each worker decodes it with MsgpackDecoder, runs its receiver cache, and holds the items
as torch tensors. Latency is from the front-end's first cache call until every worker
holds every item of the request; CPU times are per item. The front-end's CPU is given
whole and as its part in the cache calls and vLLM's codec (this thread's CPU time around
them): the rest is the harness's transport, the same for every cache.

* ``vllm-shm``: vLLM's ShmObjectStoreSenderCache / ReceiverCache (msgpack into a ring in
  /dev/shm, a copy out on every read);
* ``vllm-lru``: vLLM's mirrored LruKeyReplicatedSenderCache; the receiver (in vLLM, one
  in the engine core) keeps full items on the other side, so a first send carries the
  tensors through the RPC and a hit carries nothing;
* ``shmstore``: shmstore.vllm (one copy into shared memory; a marker on the wire; the
  engine core's gate pins each item until the request is done; zero copy in the
  workers).

Items: a Qwen2-VL-style image (``pixel_values`` float32 [2560, 1176], 12 MiB, and
``image_grid_thw``), a video (bfloat16 [8192, 1176], 18.4 MiB) and a burst of 64 small
images in one request (float32 [16, 1176], 73.5 KiB each), built the way vLLM's
processor builds them (``make_items``). First send: new hashes every round; hit: the
same hashes again.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import pickle
import resource
import statistics
import sys
import time
import uuid

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests_vllm"))
from harness import (  # noqa: E402
    child_env,
    make_config,
    make_engine_cache,
    send_request,
    setup_process,
    worker_main,
)


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def make_items(kind: str, tag: str):
    """One request's items, built as vLLM's processor builds Qwen2-VL's
    (``MultiModalKwargsItems.from_hf_inputs`` with ``flat_from_sizes``): the items of a
    request share their field objects, and each item's flat field lists the slices of
    every item of the request, which both caches write with every item."""
    from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItems

    def request(n, rows, dtype, key, grid, modality):
        sizes = torch.full((n,), rows)
        hf = {
            key: torch.randn(n * rows, 1176).to(dtype),
            grid: torch.tensor([[1, rows // 40, 40]] * n),
        }
        config = {
            key: MultiModalFieldConfig.flat_from_sizes(modality, sizes),
            grid: MultiModalFieldConfig.batched(modality, keep_on_cpu=True),
        }
        return list(MultiModalKwargsItems.from_hf_inputs(hf, config)[modality])

    if kind == "image":
        return {f"{tag}-img": request(1, 2560, torch.float32, "pixel_values", "image_grid_thw", "image")[0]}
    if kind == "video":
        (video,) = request(1, 8192, torch.bfloat16, "pixel_values_videos", "video_grid_thw", "video")
        return {f"{tag}-vid": video}
    items = request(64, 16, torch.float32, "pixel_values", "image_grid_thw", "image")
    return {f"{tag}-s{i}": item for i, item in enumerate(items)}


class _Marker:
    """Stands for a decoded marker in the engine-core stand-in (which forwards requests
    without decoding them, for every cache alike): the gate's pin lives as long as it."""


def engine_main(kind, config, conn, n_workers, env, method):
    """The engine-core stand-in: receives each request once, admits it through the
    engine-core cache vLLM runs for the kind (shmstore's gate: each item pinned until the
    request is done), forwards it to every worker."""
    setup_process(env)
    gate = make_engine_cache(kind, config)
    ctx = mp.get_context(method)
    lock = ctx.Lock()
    workers = []
    for _ in range(n_workers):
        a, b = ctx.Pipe()
        p = ctx.Process(target=worker_main, args=(kind, config, b, lock, child_env(env)))
        p.start()
        assert a.recv()[0] == "ready"
        workers.append((p, a))
    conn.send("ready")
    while True:
        raw = conn.recv_bytes()
        msg = pickle.loads(raw)
        if msg is None:
            break
        if msg == "cpu":
            cpus = []
            for _, w in workers:
                w.send("cpu")
                cpus.append(w.recv()[1])
            conn.send((cpu_s(), cpus))
            continue
        # Forwarded as received: the request's one message, then its large frames.
        large = [conn.recv_bytes() for n in msg[1] if n < 0]
        held = []
        if gate is not None:  # every item of the benchmark is a marker for shmstore
            held = [_Marker() for _ in msg[0][1]]
            gate.hold((m, h) for m, (h, _, _) in zip(held, msg[0][1]))
        for _, w in workers:
            w.send_bytes(raw)
            for frame in large:
                w.send_bytes(frame)
        replies = [w.recv() for _, w in workers]
        del held  # the request is done: the gate's pins go
        conn.send(replies)
    for p, w in workers:
        w.send(None)
        p.join(30)


class Instance:
    """One front-end, one engine core, ``n`` workers."""

    def __init__(self, kind: str, n: int, env: dict, cache_gb: float):
        from harness import make_sender
        from vllm.v1.serial_utils import MsgpackEncoder

        self.kind = kind
        self.config = make_config(cache_mb=cache_gb * 1024, max_object_mb=128, world_size=n)
        self.sender = make_sender(kind, self.config)
        self.encoder = MsgpackEncoder()
        self.cache_cpu = 0.0  # seconds of this thread's CPU in the cache and the codec
        self.reported_cached = 0  # items the sender's ``is_cached`` answered True for
        ctx = mp.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.engine = ctx.Process(target=engine_main, args=(kind, self.config, child, n, env, "fork"))
        self.engine.start()
        assert self.conn.recv() == "ready"

    def request(self, items: dict) -> float:
        hashes = list(items)
        s = self.sender
        t0 = time.thread_time()
        cached = s.is_cached(hashes)
        self.reported_cached += sum(cached)
        for h in hashes:
            s.touch_sender_cache_item(h)
        outs = []
        try:
            for h, c in zip(hashes, cached):
                out, _ = s.get_and_update_item(None if c else (items[h], []), h)
                outs.append(out)
        finally:
            s.release_sender_touches()
        bufs = [None if o is None else list(self.encoder.encode(o)) for o in outs]
        header = (0, [(h, 0 if b is None else len(b), None) for h, b in zip(hashes, bufs)], "fast")
        # The front-end's CPU in the cache and vLLM's codec alone: what the choice of cache
        # changes. The rest of the front-end's figure is this harness's transport.
        self.cache_cpu += time.thread_time() - t0
        send_request(self.conn, header, bufs)
        replies = self.conn.recv()
        assert all(r[0] == "ok" for r in replies), replies
        return max(r[2] for r in replies)  # the slowest worker's receiver time

    def cpu(self):
        self.conn.send("cpu")
        return self.conn.recv()

    def close(self):
        self.conn.send(None)
        self.engine.join(60)
        if hasattr(self.sender, "close"):
            self.sender.close()


def item_bytes(item) -> int:
    """The bytes of an item's tensors (what a first send must copy at least once)."""
    return sum(e.data.numel() * e.data.element_size() for e in item.values()
               if isinstance(e.data, torch.Tensor))


def copy_floor(item_kind: str, samples: int = 60) -> dict:
    """The physical floor of a first send: one copy of an item's bytes, from memory the
    caches have not touched into memory already mapped (as shmstore's prefaulted store),
    out of the CPU's caches: consecutive copies walk 512 MiB buffers. Median per item."""
    per = statistics.mean(item_bytes(i) for i in make_items(item_kind, "floor").values())
    size = max(512 << 20, 4 * int(per))
    src, dst = torch.randn(size // 4).view(torch.uint8), torch.ones(size, dtype=torch.uint8)
    n, times, off = int(per), [], 0
    for _ in range(samples):
        if off + n > size:
            off = 0
        t = time.perf_counter()
        dst[off:off + n].copy_(src[off:off + n])
        times.append(time.perf_counter() - t)
        off += n
    return {"item_mib": per / (1 << 20), "copy_ms_p50": 1e3 * statistics.median(times),
            "copy_gb_s": per / statistics.median(times) / 1e9}


def measure(kind, n, item_kind, rounds, env, cache_gb):
    inst = Instance(kind, n, env, cache_gb)
    try:
        per_item = len(make_items(item_kind, "warm"))
        if inst.kind == "shmstore":
            # What the background thread does at start, done now (and the thread stopped):
            # its CPU would otherwise count as the front-end's.
            inst.sender.store.prefault()
        inst.request(make_items(item_kind, "warm"))  # warm the paths (not measured)
        out = {}
        for phase in ("first", "hit"):
            n_sets = rounds if phase == "first" else 4 * rounds  # hits are cheap: more samples
            sets = [make_items(item_kind, f"r{r}-{uuid.uuid4().hex[:6]}") for r in range(rounds)]
            if phase == "hit":
                for items in sets:
                    inst.request(items)  # makes them cached
                sets = [sets[i % rounds] for i in range(n_sets)]
            lat, recv = [], []
            # A full collection now, so that none lands inside this phase: one of the
            # front-end's heap (vLLM, torch, transformers loaded) takes ~0.3 s, which is
            # as much CPU as 768 burst items, and fell on whichever cache ran at the time.
            gc.collect()
            p0, (e0, w0), c0 = cpu_s(), inst.cpu(), inst.cache_cpu
            cached0 = inst.reported_cached
            for items in sets:
                t = time.perf_counter()
                recv.append(inst.request(items) / per_item)
                lat.append((time.perf_counter() - t) / per_item)
            p1, (e1, w1), c1 = cpu_s(), inst.cpu(), inst.cache_cpu
            k = len(sets) * per_item
            # Each phase is what it says, or its figures are not printed: a first send of
            # items no cache holds, a hit on items every cache still holds (a cache that
            # evicted them would time resends under "hit").
            cached = inst.reported_cached - cached0
            if cached != (k if phase == "hit" else 0):
                raise RuntimeError(
                    f"{kind}, {item_kind}, {n} workers: the {phase} phase found {cached} of "
                    f"{k} items cached, not {k if phase == 'hit' else 0}")
            out[phase] = {
                "latency_ms_p50": 1e3 * statistics.median(lat),
                "receiver_ms_p50": 1e3 * statistics.median(recv),
                "frontend_cpu_ms": 1e3 * (p1 - p0) / k,
                "frontend_cache_cpu_ms": 1e3 * (c1 - c0) / k,
                "engine_cpu_ms": 1e3 * (e1 - e0) / k,
                "worker_cpu_ms": 1e3 * sum(b - a for a, b in zip(w0, w1)) / k / n,
            }
        return out
    finally:
        inst.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--items", default="image,video,burst")
    ap.add_argument("--kinds", default="vllm-shm,vllm-lru,shmstore")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--cache-gb", type=float, default=2.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    name = f"shmstore-vllm-bench-{os.getpid()}"
    env = {
        "SHMSTORE_VLLM_STORE": name,
        "VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME": f"vllm-bench-ring-{os.getpid()}",
        "SHMSTORE_VLLM": "1",
        "SHMSTORE_VLLM_CUDA_REGISTER": "0",
        # Workers map the store before measuring (harness.worker_main), as the front-end
        # populates it (measure): their background threads would otherwise still be at
        # it, taking CPU from the run.
        "SHMSTORE_HARNESS_PREFAULT": "1",
    }
    setup_process(env)
    results = []
    floors = {}
    try:
        for item in args.items.split(","):
            floors[item] = copy_floor(item)
            results.append({"item": item, "kind": "memcpy-floor", **floors[item]})
            if not args.json:
                c = floors[item]
                print(f"{item:6} floor: one copy of an item's {c['item_mib']:.2f} MiB out of the "
                      f"CPU's caches {c['copy_ms_p50']:8.3f} ms ({c['copy_gb_s']:.1f} GB/s)", flush=True)
            for n in map(int, args.workers.split(",")):
                for kind in args.kinds.split(","):
                    # A burst request is cheap and its per-item CPU figures are small: more
                    # requests (12 by default, 768 items) keep their ratios out of the noise.
                    rounds = args.rounds if item != "burst" else 2 * args.rounds
                    r = measure(kind, n, item, rounds, env, args.cache_gb)
                    for phase, m in r.items():
                        results.append({"item": item, "workers": n, "kind": kind, "phase": phase, **m})
                        if not args.json:
                            print(f"{item:6} {n} workers {kind:9} {phase:5} "
                                  f"latency {m['latency_ms_p50']:8.3f} ms/item  receiver "
                                  f"{m['receiver_ms_p50']:7.3f} ms  front-end CPU "
                                  f"{m['frontend_cpu_ms']:7.3f} ms (cache {m['frontend_cache_cpu_ms']:7.3f})  engine {m['engine_cpu_ms']:7.3f} ms  "
                                  f"worker {m['worker_cpu_ms']:7.3f} ms", flush=True)
    finally:
        for f in (name, env["VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME"]):
            try:
                os.unlink(f"/dev/shm/{f}")
            except FileNotFoundError:
                pass
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print("\nshmstore against vLLM's shm cache (same run): speed-up of end-to-end latency and of the"
          " receiver's own time, share of front-end CPU (all of it; in the cache and vLLM's codec alone)")
    key = {(r["item"], r["workers"], r["kind"], r["phase"]): r for r in results if "phase" in r}
    for item in args.items.split(","):
        for n in map(int, args.workers.split(",")):
            for phase in ("first", "hit"):
                a, b = key.get((item, n, "vllm-shm", phase)), key.get((item, n, "shmstore", phase))
                if a and b:
                    print(f"{item:6} {n} workers {phase:5}: {a['latency_ms_p50'] / b['latency_ms_p50']:6.1f}x "
                          f"faster end to end, receiver {a['receiver_ms_p50'] / max(b['receiver_ms_p50'], 1e-9):6.1f}x, "
                          f"front-end CPU {b['frontend_cpu_ms'] / max(a['frontend_cpu_ms'], 1e-9):5.2f} of vLLM's "
                          f"(in the cache and codec "
                          f"{b['frontend_cache_cpu_ms'] / max(a['frontend_cache_cpu_ms'], 1e-9):5.2f})")
    print("\nshmstore's first send against its floor (one copy of the item's bytes, same run): "
          "the front-end's CPU in the cache and codec, per item")
    for item in args.items.split(","):
        for n in map(int, args.workers.split(",")):
            b = key.get((item, n, "shmstore", "first"))
            if b:
                fl = floors[item]["copy_ms_p50"]
                print(f"{item:6} {n} workers: {b['frontend_cache_cpu_ms']:7.3f} ms, floor "
                      f"{fl:7.3f} ms: {b['frontend_cache_cpu_ms'] / fl:5.2f}x the floor")


if __name__ == "__main__":
    main()
