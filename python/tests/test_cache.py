"""The engine/worker cache: hashes on the RPC, several engines, restarts, stalled readers."""

import gc
import signal

import numpy as np

import shmstore
from conftest import run_python, spawn_python


def item(seed, n=1 << 16):
    rng = np.random.default_rng(seed)
    return {"pixel_values": rng.random(n, dtype=np.float32), "grid": np.array([1, 16, 16])}


def test_sender_puts_once_and_sends_only_the_hash(store):
    sender = shmstore.SenderCache(store)
    receiver = shmstore.ReceiverCache(store)
    built = []

    def build():
        built.append(1)
        return item(1)

    assert sender.send("mm-1", build) == "mm-1"
    assert sender.send("mm-1", build) == "mm-1"
    assert (sender.misses, sender.hits, len(built)) == (1, 1, 1)
    # Each send keeps the item pinned while its RPC is in flight (the first one from its
    # own put, the second from the lookup that found it).
    assert store.stats()["pins"] == 2
    got = receiver.get("mm-1")
    assert np.array_equal(got["pixel_values"], item(1)["pixel_values"])


def test_two_engine_processes_writing_the_same_items(store, store_name):
    code = """
        import sys, numpy as np, shmstore
        s = shmstore.Store.open(sys.argv[1])
        sender = shmstore.SenderCache(s)
        for i in range(50):
            rng = np.random.default_rng(i)
            sender.send(f"mm-{i}", {"x": rng.random(4096, dtype=np.float32)})
        print(sender.misses, sender.hits)
        """
    procs = [spawn_python(code, store_name) for _ in range(2)]
    counts = [tuple(map(int, p.communicate(timeout=60)[0].split())) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sum(m for m, _ in counts) == 50, counts  # each item written exactly once
    receiver = shmstore.ReceiverCache(store)
    for i in range(50):
        rng = np.random.default_rng(i)
        assert np.array_equal(receiver.get(f"mm-{i}")["x"], rng.random(4096, dtype=np.float32))


def test_a_worker_that_restarts_reattaches_and_finds_everything(store, store_name):
    shmstore.SenderCache(store).send("mm-r", item(5))
    worker = """
        import sys, shmstore
        s = shmstore.Store.open(sys.argv[1])
        r = shmstore.ReceiverCache(s)
        x = r.get("mm-r")["pixel_values"]
        print(float(x.sum()), flush=True)
        sys.stdin.readline()
        """
    first = spawn_python(worker, store_name)
    total = first.stdout.readline().strip()
    first.send_signal(signal.SIGKILL)  # crashes while holding the item's pin
    first.wait()
    second = run_python(worker, store_name, input="\n")
    assert second.stdout.strip() == total
    # The killed worker's pin is reclaimed (the second worker already did it on attach).
    store.recover()
    st = store.stats()
    assert (st["pins"], st["dead_clients"]) == (0, 0), st


def test_a_stalled_reader_does_not_block_eviction(store_name):
    s = shmstore.Store.create(store_name + "-lru", 4 << 20, evict=True)
    try:
        sender = shmstore.SenderCache(s, inflight=1)
        receiver = shmstore.ReceiverCache(s)
        sender.send("stuck", item(0))
        held = receiver.get("stuck")  # a reader that never lets go
        for i in range(1, 200):  # ~50 MiB through a 4 MiB store
            sender.send(f"mm-{i}", item(i))
            receiver.get(f"mm-{i}")
        st = s.stats()
        assert st["evictions"] > 0
        # Every item is the same size: the bytes evicted are that many items' worth.
        one = len(s.get("mm-199"))
        assert st["bytes_evicted"] == st["evictions"] * one, st
        assert s.contains("stuck"), "the pinned item must not be evicted"
        assert np.array_equal(held["pixel_values"], item(0)["pixel_values"])
        del held
        gc.collect()
    finally:
        s.unlink()
