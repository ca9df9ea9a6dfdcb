"""Python call overhead of shmstore on small objects, beside the same calls made from Rust
in the same run (Store.bench_native), and vLLM's measured fixed Python cost per object
(~130 us, ../shared/ANCHORS.md).

    scripts/python.sh bench            # or: python/.venv/bin/python python/benchmarks/overhead.py
"""

import gc
import os
import statistics
import time

import numpy as np

import shmstore

N = int(os.environ.get("SHMSTORE_BENCH_N", "100000"))
ROUNDS = 5


def per_call_ns(fn, n=N):
    best = []
    for _ in range(ROUNDS):
        t = time.perf_counter_ns()
        fn()
        best.append((time.perf_counter_ns() - t) / n)
    return statistics.median(best)


def main():
    name = f"shmstore-bench-py-{os.getpid()}"
    s = shmstore.Store.create(name, 256 << 20, max_objects=2 * N)
    try:
        data = b"x" * 64
        ids = [shmstore.key_id(f"py-{i}") for i in range(N)]
        keys = [f"py-{i}" for i in range(N)]

        def put():
            for i in ids:
                s.put(i, data)

        def delete():
            for i in ids:
                s.delete(i)

        def get():
            for i in ids:
                s.get(i, 0)

        def try_get():
            for i in ids:
                s.try_get(i)

        def contains():
            for i in ids:
                s.contains(i)

        def contains_str():
            for k in keys:
                s.contains(k)

        rows = []
        times = []
        for _ in range(ROUNDS):
            t = time.perf_counter_ns()
            put()
            times.append((time.perf_counter_ns() - t) / N)
            delete()
        rows.append(("put 64 B (fresh id)", statistics.median(times), "put_ns"))
        put()
        gc.disable()
        rows.append(("get + drop (hit)", per_call_ns(get), "get_ns"))
        rows.append(("try_get + drop (hit)", per_call_ns(try_get), "get_ns"))
        rows.append(("contains (32-byte id)", per_call_ns(contains), "contains_ns"))
        rows.append(("contains (str key, hashed)", per_call_ns(contains_str), "contains_ns"))
        gc.enable()
        delete()
        native = [s.bench_native(N) for _ in range(ROUNDS)]
        nat = {k: statistics.median(d[k] for d in native) for k in native[0]}

        # A small tensor item end to end in one process: put_item + get_item + read.
        arr = np.arange(1024, dtype=np.float32)  # 4 KiB
        m = 2000
        t = time.perf_counter_ns()
        for i in range(m):
            shmstore.put_item(s, f"item-{i}", {"x": arr})
        put_item_ns = (time.perf_counter_ns() - t) / m
        t = time.perf_counter_ns()
        for i in range(m):
            float(shmstore.get_item(s, f"item-{i}", 0)["x"][0])
        get_item_ns = (time.perf_counter_ns() - t) / m

        print(f"shmstore Python overhead, {N} calls per figure, median of {ROUNDS} rounds\n")
        print(f"| {'call':<28} | {'Python':>10} | {'Rust, same run':>14} | {'Python cost':>11} |")
        print(f"|{'-' * 30}|{'-' * 11}:|{'-' * 15}:|{'-' * 12}:|")
        for what, py_ns, key in rows:
            r = nat[key]
            print(f"| {what:<28} | {py_ns / 1000:>7.2f} us | {r / 1000:>11.2f} us | {(py_ns - r) / 1000:>8.2f} us |")
        print(
            f"\nput_item 4 KiB float32: {put_item_ns / 1000:.1f} us; get_item + read: "
            f"{get_item_ns / 1000:.1f} us (vLLM's shm store: ~130 us fixed Python cost per object)"
        )
    finally:
        s.unlink()


if __name__ == "__main__":
    main()
