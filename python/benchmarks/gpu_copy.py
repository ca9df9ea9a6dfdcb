"""Host-to-GPU copies of items read from a shmstore store, the ways a vLLM worker can make
them, beside the DMA floor, in one run (figures in docs/vllm.md, "GPU copies").

Needs torch with a visible GPU, and neither vLLM nor a network: run it with the package on
``PYTHONPATH`` (``PYTHONPATH=python python3 python/benchmarks/gpu_copy.py``). Without a
GPU it says so and measures nothing.

For each item (a Qwen2-VL image: float32 [2560, 1176], 12 MiB; a video: bfloat16
[8192, 1176], 18.4 MiB; 64 MiB of float32), from a worker holding the item's CPU tensor
until the tensor is on the GPU (``torch.cuda.synchronize``):

* ``floor``: the tensor already in pinned memory (``cudaHostAlloc``), one
  ``.to("cuda", non_blocking=True)``: the DMA alone;
* ``vllm_shm``: vLLM's ``shm`` cache. Its decoder copies the bytes out of the ring into
  pinned memory (``pin_memory()``, serial_utils' ``_decode_tensor``), then the model
  runner's copy is the DMA. Timed from a view of the ring's bytes;
* ``view``: a zero-copy view of the shmstore item, not registered, through what vLLM
  0.34's model runner does with it (``_nested_tensors_h2d(pin_memory=True)``: a tensor
  that is not pinned is copied into a new pinned one, then the DMA);
* ``view_staged``: the same view, ``.to("cuda", non_blocking=True)`` straight from pageable
  memory (what runs with ``pin_memory=False``): the driver stages it, synchronously;
* ``registered``: the view after ``shmstore.cuda.register(store)``: it counts as pinned,
  so the model runner's copy is the DMA, from the shared pages.

Each row also gives the time until the copy call returns (``call``): how long the worker
thread is held, against an asynchronous DMA that lets it go on. Then the cost of
registering and unregistering a whole heap, per GiB, at each ``--register-gib`` size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import shmstore  # noqa: E402
import shmstore.cuda as sc  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30


def items(torch) -> dict:
    return {
        "image": torch.randn(2560, 1176, dtype=torch.float32),
        "video": torch.randn(8192, 1176).to(torch.bfloat16),
        "large": torch.randn(16384, 1024, dtype=torch.float32),
    }


def timed(torch, fn, reps: int) -> tuple[float, float]:
    """Median (seconds) of the call alone and of the call until the GPU is done."""
    calls, totals = [], []
    for i in range(reps + 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        del out
        if i >= 3:  # warm-up: the caching allocators fill, the driver maps its buffers
            calls.append(t1 - t0)
            totals.append(t2 - t0)
    return statistics.median(calls), statistics.median(totals)


def model_runner_h2d(x, dev):
    """vLLM 0.34's ``_nested_tensors_h2d(pin_memory=True)`` for one tensor."""
    if not (x.is_pinned() and x.is_contiguous()):
        x = x.new_empty(x.shape, pin_memory=True).copy_(x)
    return x.to(device=dev, non_blocking=True)


def measure_copies(torch, store, reps: int) -> tuple[dict, dict]:
    dev = torch.device("cuda")
    src = items(torch)
    for name, t in src.items():
        shmstore.put_item(store, name, {"x": t})
    views = {n: shmstore.get_item(store, n, 1.0, as_torch=True)["x"] for n in src}
    # vLLM's ring holds the msgpack'd bytes in a SharedMemory segment: a pageable view of
    # the same bytes stands in for it (the shmstore view, read as raw bytes).
    rows: dict = {}
    ways = {
        "floor": lambda v, p: p.to(dev, non_blocking=True),
        "vllm_shm": lambda v, p: (
            v.view(torch.uint8).reshape(-1).pin_memory().view(v.dtype).view(v.shape)
            .to(dev, non_blocking=True)),
        "view": lambda v, p: model_runner_h2d(v, dev),
        "view_staged": lambda v, p: v.to(dev, non_blocking=True),
    }
    checks: dict = {}
    for name, v in views.items():
        pinned = src[name].pin_memory()
        rows[name] = {"bytes": v.numel() * v.element_size()}
        for way, fn in ways.items():
            got = fn(v, pinned)
            torch.cuda.synchronize()
            checks[f"{name}/{way}"] = bool(torch.equal(got.cpu(), src[name]))
            rows[name][way] = timed(torch, lambda: fn(v, pinned), reps)
    reg_s = time.perf_counter()
    registered = True
    try:
        sc.register(store)
    except sc.RegistrationFailed as e:
        registered = False
        print(f"registration failed: {e}")
    reg_s = time.perf_counter() - reg_s
    for name, v in views.items():
        rows[name]["registered_is_pinned"] = bool(v.is_pinned()) if registered else None
        if registered:
            got = model_runner_h2d(v, dev)
            torch.cuda.synchronize()
            checks[f"{name}/registered"] = bool(torch.equal(got.cpu(), src[name]))
            rows[name]["registered"] = timed(torch, lambda: model_runner_h2d(v, dev), reps)
    if registered:
        sc.unregister(store)
    return rows, {"checks": checks, "register_s": reg_s if registered else None}


def measure_registration(torch, directory: str, sizes_gib: list[float]) -> list[dict]:
    out = []
    for gib in sizes_gib:
        need = int(gib * GIB)
        st = os.statvfs(directory)
        if st.f_bavail * st.f_frsize < need * 1.05:
            print(f"registration at {gib:g} GiB skipped: {directory} has "
                  f"{st.f_bavail * st.f_frsize / GIB:.1f} GiB free")
            continue
        name = f"shmstore-gpu-bench-{uuid.uuid4().hex[:8]}"
        s = shmstore.Store.create(os.path.join(directory, name), need)
        try:
            huge = sc.wait_for_huge_pages(s, limit_s=120, stalled_s=3)
            t0 = time.perf_counter()
            try:
                sc.register(s)
            except sc.RegistrationFailed as e:
                print(f"registration at {gib:g} GiB failed: {e}")
                continue
            t1 = time.perf_counter()
            sc.unregister(s)
            t2 = time.perf_counter()
            out.append({"gib": gib, "page_size": s.stats()["page_size"], "huge": huge,
                        "register_s": t1 - t0, "unregister_s": t2 - t1})
        finally:
            del s
            os.unlink(os.path.join(directory, name))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--register-gib", default="1,4", help="heap sizes to register, GiB")
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    if not sc.gpu_visible():
        print("no GPU is visible to torch: nothing measured (this benchmark needs one)")
        return 0
    import torch

    info = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "kernel": platform.release(), "cpu": platform.processor() or platform.machine()}
    print(" ".join(f"{k}={v}" for k, v in info.items()))
    name = f"shmstore-gpu-bench-{uuid.uuid4().hex[:8]}"
    store = shmstore.Store.create(os.path.join(args.dir, name), 512 * MIB)
    try:
        huge = sc.wait_for_huge_pages(store, limit_s=60, stalled_s=3)
        info["page_size"] = store.stats()["page_size"]
        print(f"store: 512 MiB in {args.dir}, {info['page_size'] // 1024} KiB pages "
              f"({'rebuilt as 2 MiB' if huge else 'not rebuilt'})")
        rows, extra = measure_copies(torch, store, args.reps)
    finally:
        del store
        os.unlink(os.path.join(args.dir, name))
    ways = ("floor", "vllm_shm", "view", "view_staged", "registered")
    print(f"\nH2D per item, median of {args.reps}: until on the GPU; until the copy call "
          "returns (the worker thread held); rate; against the floor")
    for name, r in rows.items():
        floor = r["floor"][1]
        for w in ways:
            if w not in r:
                print(f"{name:<6} {r['bytes'] / MIB:5.1f} MiB  {w:<12} -")
                continue
            call, total = r[w]
            print(f"{name:<6} {r['bytes'] / MIB:5.1f} MiB  {w:<12} {total * 1e3:8.3f} ms  "
                  f"call {call * 1e3:8.3f} ms  {r['bytes'] / total / 1e9:6.1f} GB/s  "
                  f"{total / floor:5.2f}x floor")
    print(f"registered views count as pinned: "
          f"{ {n: r['registered_is_pinned'] for n, r in rows.items()} }")
    bad = [k for k, ok in extra["checks"].items() if not ok]
    print("every copy equals its source" if not bad else f"COPIES DIFFER: {bad}")
    reg = measure_registration(torch, args.dir, [float(g) for g in args.register_gib.split(",") if g])
    for r in reg:
        print(f"register {r['gib']:g} GiB heap ({r['page_size'] // 1024} KiB pages): "
              f"{r['register_s']:.3f} s ({r['register_s'] / r['gib']:.3f} s/GiB), "
              f"unregister {r['unregister_s']:.3f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows, **extra, "registration": reg}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
