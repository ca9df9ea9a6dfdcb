"""An engine process and 2 worker processes (standing in for tensor-parallel ranks) hand
multimodal items over, the way vLLM does, two ways in one run:

* pickle over a socket (what vLLM does without its shm cache): the engine pickles each
  item and sends it to every worker over a multiprocessing Pipe; each worker unpickles;
* shmstore: the engine puts each item once (SenderCache); only its hash crosses the Pipe;
  each worker maps the arrays in place (ReceiverCache);
* shmstore, cache hit: the same item again: the store already holds it, nothing is copied.

Items are realistic: a 3x1024x1024 float32 image (12 MiB) and a 16x3x448x448 float16
video clip (18.4 MiB). Every worker reads every byte of every array, so no path can cheat.

    scripts/python.sh example        # or: python/.venv/bin/python examples/vllm_like.py
"""

import multiprocessing as mp
import os
import statistics
import sys
import time

import numpy as np

import shmstore

REPS = int(os.environ.get("VLLM_LIKE_REPS", "5"))


def touch(a: np.ndarray) -> int:
    """Reads every byte (a checksum over 8-byte words)."""
    flat = np.frombuffer(memoryview(np.ascontiguousarray(a)).cast("B"), dtype=np.uint8)
    n = flat.size // 8 * 8
    return int(flat[:n].view(np.uint64).sum(dtype=np.uint64)) + int(flat[n:].sum())


def worker(rank: int, store_name: str, conn) -> None:
    store = shmstore.Store.open(store_name)
    receiver = shmstore.ReceiverCache(store)
    while True:
        msg = conn.recv_bytes()
        if msg == b"stop":
            break
        kind, payload = msg[:1], msg[1:]
        if kind == b"P":  # pickled item
            import pickle

            item = pickle.loads(payload)
        else:  # a hash: look it up in the store
            item = receiver.get(payload.decode())
        total = sum(touch(a) for k, a in item.items() if k != "__meta__")
        del item
        conn.send_bytes(str(total).encode())


def make_item(kind: str, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    if kind == "image":
        return {"pixel_values": rng.random((3, 1024, 1024), dtype=np.float32)}
    return {"pixel_values_videos": rng.random((16, 3, 448, 448), dtype=np.float32).astype(np.float16)}


def main() -> None:
    import pickle

    ctx = mp.get_context("spawn")
    name = f"vllm-like-{os.getpid()}"
    store = shmstore.Store.create(name, 1 << 30, evict=True, remove_when_unused=True)
    sender = shmstore.SenderCache(store)
    pipes, procs = [], []
    for rank in range(2):
        a, b = ctx.Pipe()
        p = ctx.Process(target=worker, args=(rank, name, b), daemon=True)
        p.start()
        pipes.append(a)
        procs.append(p)

    def round_trip(messages) -> float:
        t = time.perf_counter()
        for conn, msg in zip(pipes, messages):
            conn.send_bytes(msg)
        answers = [conn.recv_bytes() for conn in pipes]
        dt = time.perf_counter() - t
        assert answers[0] == answers[1], "workers read different bytes"
        return dt

    results = {}
    for kind in ("image", "video"):
        pick, miss, hit = [], [], []
        for rep in range(REPS):
            item = make_item(kind, rep)
            # pickle over the socket: serialize once, send to each worker.
            t = time.perf_counter()
            blob = b"P" + pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)
            pick.append(time.perf_counter() - t + round_trip([blob, blob]))
            # shmstore, first time: put once, send the hash.
            h = f"{kind}-{rep}-{os.getpid()}"
            t = time.perf_counter()
            sender.send(h, item)
            miss.append(time.perf_counter() - t + round_trip([b"H" + h.encode()] * 2))
            # shmstore, cache hit: the engine only checks the store.
            t = time.perf_counter()
            sender.send(h, item)
            hit.append(time.perf_counter() - t + round_trip([b"H" + h.encode()] * 2))
        mib = sum(a.nbytes for a in item.values()) / (1 << 20)
        results[kind] = (mib, statistics.median(pick), statistics.median(miss), statistics.median(hit))

    for conn in pipes:
        conn.send_bytes(b"stop")
    for p in procs:
        p.join()

    print(f"engine -> 2 workers, each reading every byte; median of {REPS} items\n")
    print("| item | size | pickle over socket | shmstore (first time) | shmstore (cache hit) | speedup (first / hit) |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind, (mib, pickled, miss_s, hit_s) in results.items():
        print(
            f"| {kind} | {mib:.1f} MiB | {pickled * 1e3:.1f} ms | {miss_s * 1e3:.1f} ms "
            f"| {hit_s * 1e3:.1f} ms | {pickled / miss_s:.1f}x / {pickled / hit_s:.1f}x |"
        )
    st = store.stats()
    print(f"\nstore: {st['objects']} items, {st['used'] / (1 << 20):.0f} MiB used, {st['evictions']} evictions")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
