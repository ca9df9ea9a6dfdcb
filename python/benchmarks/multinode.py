"""Items across Ray nodes: shmstore.ray (each item crosses to a node once) against
sending the item inline to every remote rank (what vLLM does without a store), in the
same run (docs/multinode.md).

A ``ray.cluster_utils.Cluster`` of 3 raylets on this machine: node0 (the source, where
the driver puts items) and 2 remote nodes with R ranks each (R = 1, 2, 4). Per item:

* shmstore: the driver puts the item into node0's store and sends each rank its key;
  each rank reads it from its node's store (fetched through the node's bridge on the
  first ask) and sums it (touches every byte);
* inline: the driver sends each rank the item itself as a call argument (Ray copies it
  per call, as vLLM's RPC serializes it per rank); each rank sums it;
* shmstore, prefetched one step ahead: the driver puts the item, calls
  ``NodeStores.prefetch`` (every remote node's bridge starts fetching it), and sends the
  ranks the key one engine step later (``--step-ms``, default 25 ms). That is what vLLM's
  engine core does with the plugin: it prefetches when a request arrives, and the
  workers read the request's items when it is scheduled, after the step running then.
  Timed from the send on (the ranks' part), beside inline sending, which has no earlier
  part. Also in the JSON: prefetched with no head start (the ranks asked at once);
* one Ray ref: the driver ``ray.put``s the item once and sends every rank the ref (Ray
  moves it once per node). A reference point: vLLM's RPC does not carry Ray refs.

Every timed part starts after the same quiet pause (``--step-ms``), as a send after an
engine step does: a process that idled wakes slower than one that just worked, and each
figure pays that alike.

Reports the end-to-end time per item (median; until every rank has summed it), the time
of a second read of the same item (a hit: every node holds it; inline sending pays its
full time again), one empty call to every rank (Ray's floor for any of them), and the
bytes moved between nodes: measured by the bridges for shmstore, by construction for the
others (each call argument is one object, pulled by its rank's node), beside a memcpy of
the item in the same run. On one machine "between nodes" is a copy between raylets'
object stores over loopback, not a network: the bytes are the portable figure.

    scripts/ray.sh bench [--items N] [--step-ms MS] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid

import numpy as np
import ray
from ray.cluster_utils import Cluster

from shmstore.ray import NodeStores

KiB, MiB = 1 << 10, 1 << 20


def checksum(buf) -> int:
    a = np.frombuffer(buf, dtype=np.uint8)
    n = a.size // 8 * 8
    return int(a[:n].view(np.uint64).sum(dtype=np.uint64)) + int(a[n:].sum())


class _Rank:
    def __init__(self, nodes: NodeStores) -> None:
        self.nodes = nodes

    def read(self, key: str) -> int:
        return checksum(self.nodes.get(key))

    def read_inline(self, arr: np.ndarray) -> int:
        return checksum(arr)

    def noop(self) -> int:
        return 0


Rank = ray.remote(num_cpus=0)(_Rank)


def median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def run(per_node: int, size: int, items: int, nodes: NodeStores, remote: list[str], step: float) -> dict:
    ranks = [Rank.options(resources={n: 1}).remote(nodes) for n in remote for _ in range(per_node)]
    ray.get([r.read_inline.remote(np.zeros(8, np.uint8)) for r in ranks])  # started
    rng = np.random.default_rng(size + per_node)
    store = nodes.store()
    modes = ("shmstore", "hit", "prefetched_now", "prefetched", "inline", "ray_ref", "call")
    times: dict[str, list[float]] = {m: [] for m in modes}
    moved = {"shmstore": 0, "prefetched_now": 0, "prefetched": 0}

    def fetched_bytes() -> int:
        return sum(s["fetched_bytes"] for s in nodes.bridge_stats().values())

    for i in range(items + 1):  # the first item of each mode warms up
        arr = rng.integers(0, 255, size, dtype=np.uint8)
        want = checksum(arr)
        key = f"{per_node}-{size}-{i}-{uuid.uuid4().hex[:6]}"
        pkey, skey = key + "-p", key + "-s"
        b0 = fetched_bytes()
        time.sleep(step)  # every timed part starts from the same quiet step (see run's doc)
        tc = time.perf_counter()
        ray.get([r.noop.remote() for r in ranks])  # the floor: one call to every rank
        tc1 = time.perf_counter()
        time.sleep(step)
        t0 = time.perf_counter()
        store.put(key, arr)
        got = ray.get([r.read.remote(key) for r in ranks])
        t1 = time.perf_counter()
        time.sleep(step)
        th0 = time.perf_counter()
        got += ray.get([r.read.remote(key) for r in ranks])  # again: a hit on every node
        th = time.perf_counter()
        b1 = fetched_bytes()
        time.sleep(step)
        tp0 = time.perf_counter()
        # The same item under a new key, prefetched: the driver tells every node whose
        # bridge runs to fetch it, and sends the ranks the key at once.
        store.put(pkey, arr)
        nodes.prefetch([pkey])
        got += ray.get([r.read.remote(pkey) for r in ranks])
        tp1 = time.perf_counter()
        b2 = fetched_bytes()
        # ... and one engine step ahead, as in vLLM: the engine core prefetches when a
        # request arrives and the workers read it when the request is scheduled, after
        # the step running now (the sleep stands for that step's GPU time). Timed: the
        # ranks' part, from the send on, which is what inline sending costs in full.
        store.put(skey, arr)
        nodes.prefetch([skey])
        time.sleep(step)
        ts0 = time.perf_counter()
        got += ray.get([r.read.remote(skey) for r in ranks])
        ts1 = time.perf_counter()
        b3 = fetched_bytes()
        time.sleep(step)
        t2a = time.perf_counter()
        got += ray.get([r.read_inline.remote(arr) for r in ranks])
        t2 = time.perf_counter()
        time.sleep(step)
        t2b = time.perf_counter()
        ref = ray.put(arr)
        got += ray.get([r.read_inline.remote(ref) for r in ranks])
        t3 = time.perf_counter()
        del ref
        assert got == [want] * len(got), "a rank read different bytes"
        store.delete(key)
        store.delete(pkey)
        store.delete(skey)
        if i:
            times["call"].append(tc1 - tc)
            times["shmstore"].append(t1 - t0)
            times["hit"].append(th - th0)
            times["prefetched_now"].append(tp1 - tp0)
            times["prefetched"].append(ts1 - ts0)
            times["inline"].append(t2 - t2a)
            times["ray_ref"].append(t3 - t2b)
            moved["shmstore"] += b1 - b0
            moved["prefetched_now"] += b2 - b1
            moved["prefetched"] += b3 - b2
    for r in ranks:
        ray.kill(r)
    x = np.ones(size, np.uint8)
    y = np.empty_like(x)
    t = []
    for _ in range(20):
        t0 = time.perf_counter()
        np.copyto(y, x)
        t.append(time.perf_counter() - t0)
    return {
        "ranks_per_node": per_node,
        "remote_nodes": len(remote),
        "item_bytes": size,
        "items": items,
        "shmstore_ms": median_ms(times["shmstore"]),
        "shmstore_hit_ms": median_ms(times["hit"]),
        "shmstore_prefetched_now_ms": median_ms(times["prefetched_now"]),
        "shmstore_prefetched_step_ahead_ms": median_ms(times["prefetched"]),
        "step_ms": step * 1e3,
        "call_ms": median_ms(times["call"]),
        "inline_ms": median_ms(times["inline"]),
        "ray_ref_ms": median_ms(times["ray_ref"]),
        "memcpy_ms": median_ms(t),
        "shmstore_bytes_between_nodes_per_item": moved["shmstore"] / items,
        "shmstore_prefetched_now_bytes_between_nodes_per_item": moved["prefetched_now"] / items,
        "shmstore_prefetched_bytes_between_nodes_per_item": moved["prefetched"] / items,
        "inline_bytes_between_nodes_per_item": size * per_node * len(remote),
        "ray_ref_bytes_between_nodes_per_item": size * len(remote),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=8, help="items per row (after one warm-up)")
    ap.add_argument("--ranks", default="1,2,4", help="ranks per remote node, one row each")
    ap.add_argument("--step-ms", type=float, default=25.0,
                    help="how long before the ranks ask the prefetch starts (an engine step)")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node0": 100}})
    remote = ["node1", "node2"]
    for n in remote:
        cluster.add_node(num_cpus=2, resources={n: 100}, object_store_memory=512 * MiB)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    nodes = NodeStores(f"shmstore-multinode-bench-{os.getpid()}", 512 * MiB)
    rows = []
    try:
        nodes.start_bridges()
        print(f"{'item':>8} {'ranks':>9} | {'shmstore':>9} {'prefetched':>10} {'inline':>9} "
              f"{'speedup':>15} {'hit':>7} {'1 ray ref':>9} {'1 call':>7} {'memcpy':>7} | "
              f"{'MiB between nodes per item':^45}")
        print(f"{'':>8} {'per node':>9} | {'ms/item':>9} {'ms/item':>10} {'ms/item':>9} "
              f"{'miss / pref.':>15} {'ms':>7} {'ms/item':>9} {'ms':>7} {'ms':>7} | "
              f"{'shmstore':>10} {'prefetched':>10} {'inline':>10} {'1 ray ref':>10}")
        for size in (12 * MiB, 64 * KiB):
            for per_node in [int(x) for x in args.ranks.split(",")]:
                r = run(per_node, size, args.items, nodes, remote, args.step_ms / 1e3)
                rows.append(r)
                label = f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"
                speedups = (f"{r['inline_ms'] / r['shmstore_ms']:.2f}x / "
                            f"{r['inline_ms'] / r['shmstore_prefetched_step_ahead_ms']:.2f}x")
                print(f"{label:>8} {per_node:>9} | {r['shmstore_ms']:>9.2f} "
                      f"{r['shmstore_prefetched_step_ahead_ms']:>10.2f} {r['inline_ms']:>9.2f} "
                      f"{speedups:>15} {r['shmstore_hit_ms']:>7.2f} "
                      f"{r['ray_ref_ms']:>9.2f} {r['call_ms']:>7.2f} {r['memcpy_ms']:>7.3f} | "
                      f"{r['shmstore_bytes_between_nodes_per_item'] / MiB:>10.3f} "
                      f"{r['shmstore_prefetched_bytes_between_nodes_per_item'] / MiB:>10.3f} "
                      f"{r['inline_bytes_between_nodes_per_item'] / MiB:>10.3f} "
                      f"{r['ray_ref_bytes_between_nodes_per_item'] / MiB:>10.3f}", flush=True)
    finally:
        nodes.shutdown()
        ray.shutdown()
        cluster.shutdown()
        for leftover in os.listdir("/dev/shm"):
            if leftover.startswith(nodes.name):
                os.unlink(f"/dev/shm/{leftover}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "python": sys.version.split()[0], "ray": ray.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
