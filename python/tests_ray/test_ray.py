"""shmstore.ray: one store per node; each item crosses to a node once (docs/multinode.md)."""

from __future__ import annotations

import os
import signal
import time

import ray

import shmstore
from ranks import Producer, Rank
from shmstore.ray import NodeStores

KiB, MiB = 1 << 10, 1 << 20


def ranks_on(nodes: NodeStores, node: str, n: int) -> list:
    return [Rank.options(resources={node: 1}).remote(nodes) for _ in range(n)]


def wait_until(what, cond, timeout: float = 30.0):
    """Polls ``cond()`` (a state another process reaches) until it is truthy."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_every_rank_sees_equal_items_and_each_crosses_to_a_node_once(nodes, cluster):
    producer = Producer.options(resources={"node0": 1}).remote(nodes)
    sizes = [64 * KiB, 200 * KiB, 1 * MiB, 3 * MiB, 12 * MiB]
    keys = [f"item-{i}" for i in range(len(sizes))]
    expected = dict(zip(keys, ray.get([producer.put.remote(k, i, n) for i, (k, n) in enumerate(zip(keys, sizes))])))
    ranks = ranks_on(nodes, "node1", 3) + ranks_on(nodes, "node2", 3) + ranks_on(nodes, "node0", 1)
    # Every rank asks for every item at once, in its own order.
    results = ray.get([r.read.remote(keys[i % 2 :: 1] if i % 2 == 0 else keys[::-1]) for i, r in enumerate(ranks)])
    for got in results:
        assert got == expected
    stats = nodes.bridge_stats()
    stored = [ray.get(producer.stored_bytes.remote(k)) for k in keys]
    for name in ("node1", "node2"):
        s = stats[cluster[name]]
        assert s["fetched"] == len(keys), s  # once per node, for 3 ranks each
        assert s["fetched_bytes"] == sum(stored), s
        assert s["unsealed"] == 0
    src = stats[cluster["node0"]]
    assert src["served"] == 2 * len(keys), src  # to the two other nodes, once each
    assert src["served_bytes"] == 2 * sum(stored)
    assert src["fetch_calls"] == 0  # ranks on the source node read its store directly


def test_concurrent_gets_on_one_node_make_a_single_fetch(nodes, cluster):
    producer = Producer.options(resources={"node0": 1}).remote(nodes)
    want = ray.get(producer.put.remote("video", 7, 12 * MiB))
    bridge = nodes.bridge(cluster["node1"])
    ray.get(bridge.hold_transfers.remote(True))  # the bytes wait: the object stays unsealed
    ranks = ranks_on(nodes, "node1", 4)
    pending = [r.read.remote(["video"]) for r in ranks]
    # Each of the 4 ranks asks the bridge; one fetch creates the object and the others
    # find it being written.
    wait_until("4 fetch calls", lambda: ray.get(bridge.stats.remote())["fetches_done"] == 4)
    assert ray.get(bridge.stats.remote())["unsealed"] == 1
    ready, _ = ray.wait(pending, timeout=0.5)
    assert ready == []  # all 4 block on the seal
    ray.get(bridge.hold_transfers.remote(False))
    assert ray.get(pending) == [{"video": want}] * 4
    s = ray.get(bridge.stats.remote())
    assert (s["fetch_calls"], s["fetched"]) == (4, 1), s
    assert nodes.bridge_stats()[cluster["node0"]]["served"] == 1


def test_a_bridge_killed_mid_fetch_gives_creator_died_and_a_retry_succeeds(nodes, cluster):
    producer = Producer.options(resources={"node0": 1}).remote(nodes)
    want = ray.get(producer.put.remote("image", 3, 3 * MiB))
    bridge = nodes.bridge(cluster["node2"])
    ray.get(bridge.hold_transfers.remote(True))
    old_pid = ray.get(bridge.stats.remote())["pid"]
    rank, other = ranks_on(nodes, "node2", 2)
    waiting = [rank.try_read.remote(["image"]), other.try_read.remote(["image"])]
    # Both ranks' fetches returned (one created the object, the other found it being
    # written): both wait for its seal now.
    wait_until("both ranks reading", lambda: ray.get([rank.phase.remote(), other.phase.remote()]) == ["reading"] * 2)
    assert ray.get(bridge.stats.remote())["unsealed"] == 1
    os.kill(old_pid, signal.SIGKILL)  # the bridge dies holding an unsealed object
    for status, detail in ray.get(waiting):
        assert status == "CreatorDied", (status, detail)
    # Ray restarts the bridge; attaching recovers the dead bridge's object; a retry
    # fetches again.
    assert ray.get(rank.try_read.remote(["image"])) == ("ok", {"image": want})
    assert ray.get(other.try_read.remote(["image"])) == ("ok", {"image": want})
    s = ray.get(bridge.stats.remote())
    assert s["pid"] != old_pid
    assert s["fetched"] == 1, s


def test_the_source_losing_items_is_a_miss_naming_every_missing_key(nodes, cluster):
    producer = Producer.options(resources={"node0": 1}).remote(nodes)
    keys = ["kept", "gone-1", "gone-2"]
    digests = ray.get([producer.put.remote(k, i, 128 * KiB) for i, k in enumerate(keys)])
    ray.get([producer.delete.remote(k) for k in keys[1:]])
    rank = ranks_on(nodes, "node1", 1)[0]
    status, missing = ray.get(rank.try_read.remote(keys))
    assert status == "ItemsMissing"
    assert sorted(missing) == ["gone-1", "gone-2"]
    # The miss path: the items are put again, and the same request succeeds.
    ray.get([producer.put.remote(k, i, 128 * KiB) for i, k in enumerate(keys) if k != "kept"])
    assert ray.get(rank.try_read.remote(keys)) == ("ok", dict(zip(keys, digests)))
    # On the source node a missing item is a miss too (nothing to fetch from).
    local = ranks_on(nodes, "node0", 1)[0]
    assert ray.get(local.try_read.remote(["never-put"])) == ("ItemsMissing", ["never-put"])


def test_node_stores_are_distinct_and_named_after_their_node(nodes, cluster):
    names = {n: nodes.store_name(cluster[n]) for n in ("node0", "node1", "node2")}
    assert names["node0"] == nodes.name
    assert len(set(names.values())) == 3
    for n in ("node1", "node2"):
        assert cluster[n][:12] in names[n]
    # An item put on the source is in no other node's store until a rank there asks.
    producer = Producer.options(resources={"node0": 1}).remote(nodes)
    ray.get(producer.put.remote("x", 1, 64 * KiB))
    ray.get(ranks_on(nodes, "node1", 1)[0].read.remote(["x"]))
    s1 = shmstore.Store.open(names["node1"])
    assert s1.contains("x")
    try:
        s2 = shmstore.Store.open(names["node2"])
        assert not s2.contains("x")
    except shmstore.StoreNotFound:
        pass  # node2's store does not even exist yet


def test_a_bridge_that_died_with_its_owner_is_started_again(nodes, cluster):
    # A bridge lives as long as the process that started it (Ray's owner rule): here the
    # first rank of node1, which then exits, as a vLLM worker does at shutdown.
    producer = Producer.options(resources={"node0": 1}).remote(nodes)
    first, second = ranks_on(nodes, "node1", 2)
    want = ray.get(producer.put.remote("one", 1, 200 * KiB))
    assert ray.get(first.read.remote(["one"])) == {"one": want}  # starts node1's bridge
    assert ray.get(second.read.remote(["one"])) == {"one": want}  # a hit, no bridge call
    pid = nodes.bridge_stats()[cluster["node1"]]["pid"]
    ray.kill(first)
    wait_until("node1's bridge gone", lambda: cluster["node1"] not in nodes.bridge_stats())
    # The second rank's handle now names a dead actor: it starts the bridge again.
    want = ray.get(producer.put.remote("two", 2, 200 * KiB))
    assert ray.get(second.read.remote(["two"])) == {"two": want}
    assert nodes.bridge_stats()[cluster["node1"]]["pid"] != pid
