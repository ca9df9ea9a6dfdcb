"""shmstore.ray: one store per node; each item crosses to a node once (docs/multinode.md)."""

from __future__ import annotations

import os
import signal

import ray

import shmstore
from ranks import Producer, Rank, wait_until
from shmstore.ray import NodeStores

KiB, MiB = 1 << 10, 1 << 20


def ranks_on(nodes: NodeStores, node: str, n: int) -> list:
    return [Rank.options(resources={node: 1}).remote(nodes) for _ in range(n)]


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
    pending = [r.try_read.remote(["video"]) for r in ranks]
    # One rank's fetch creates the object; every other rank finds it being written,
    # in the bridge's table (a rank that asked before it existed) or in the store.
    wait_until("4 ranks reading", lambda: ray.get([r.phase.remote() for r in ranks]) == ["reading"] * 4)
    assert ray.get(bridge.stats.remote())["unsealed"] == 1
    ready, _ = ray.wait(pending, timeout=0.5)
    assert ready == []  # all 4 block on the seal
    ray.get(bridge.hold_transfers.remote(False))
    assert ray.get(pending) == [("ok", {"video": want})] * 4
    s = ray.get(bridge.stats.remote())
    assert s["fetched"] == 1 and 1 <= s["fetch_calls"] <= 4, s
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


def test_prefetch_brings_items_to_the_nodes_whose_bridge_runs_before_ranks_ask(nodes, cluster):
    producer = Producer.options(resources={"node0": 1}).remote(nodes)
    sizes = [64 * KiB, 3 * MiB]
    keys = ["small", "large"]
    expected = dict(zip(keys, ray.get([producer.put.remote(k, i, n) for i, (k, n) in enumerate(zip(keys, sizes))])))
    # node1's bridge runs (a rank of node1 read through this store: here, started by
    # hand); node2 has none, so no process of node2 needs the store: not a target.
    ray.get(nodes.bridge(cluster["node1"]).ready.remote())
    refs = nodes.prefetch(keys)
    assert len(refs) == 1  # node1 only: never the source, never a node without a bridge
    assert ray.get(refs) == [([], [], "")]
    bridge = nodes.bridge(cluster["node1"])
    wait_until("the large item sealed", lambda: ray.get(bridge.stats.remote())["unsealed"] == 0)
    ranks = ranks_on(nodes, "node1", 2)
    assert ray.get([r.read.remote(keys) for r in ranks]) == [expected] * 2
    stats = nodes.bridge_stats()
    s1 = stats[cluster["node1"]]
    assert (s1["prefetch_calls"], s1["fetch_calls"], s1["fetched"]) == (1, 0, 2), s1  # ranks never asked
    assert cluster["node2"] not in stats
    assert stats[cluster["node0"]]["served"] == 2
    # Prefetching what a node holds moves nothing; an explicit target gets its bridge
    # started.
    ray.get(nodes.prefetch(keys, to=[cluster["node1"], cluster["node2"], cluster["node0"]]))
    wait_until("node2's large item sealed", lambda: nodes.bridge_stats()[cluster["node2"]]["unsealed"] == 0)
    stats = nodes.bridge_stats()
    assert stats[cluster["node1"]]["fetched"] == 2
    assert stats[cluster["node2"]]["fetched"] == 2
    assert stats[cluster["node0"]]["served"] == 4  # node2's two, once
    # A key the source lacks: the prefetch reports it (to whoever waits on it), and a
    # rank's read is the usual miss naming it.
    assert ray.get(nodes.prefetch(["never-put"], to=[cluster["node1"]])) == [(["never-put"], [], "")]
    assert ray.get(ranks[0].try_read.remote(["never-put"])) == ("ItemsMissing", ["never-put"])


def test_a_prefetch_and_a_rank_asking_at_once_make_one_fetch(nodes, cluster):
    producer = Producer.options(resources={"node0": 1}).remote(nodes)
    first = ray.get(producer.put.remote("prefetched-first", 1, 12 * MiB))
    second = ray.get(producer.put.remote("asked-first", 2, 12 * MiB))
    node1 = cluster["node1"]
    bridge = nodes.bridge(node1)
    ray.get(bridge.hold_transfers.remote(True))  # objects stay unsealed until released
    rank, other = ranks_on(nodes, "node1", 2)
    # The prefetch creates the object; the rank that asks then finds it being written.
    ray.get(nodes.prefetch(["prefetched-first"], to=[node1]))
    reading = rank.try_read.remote(["prefetched-first"])
    wait_until("the rank reading", lambda: ray.get(rank.phase.remote()) == "reading")
    # The rank's fetch creates the object; a prefetch that comes later leaves it be.
    asking = other.try_read.remote(["asked-first"])
    wait_until("the other rank reading", lambda: ray.get(other.phase.remote()) == "reading")
    ray.get(nodes.prefetch(["asked-first"], to=[node1]))
    assert ray.get(bridge.stats.remote())["unsealed"] == 2
    ray.get(bridge.hold_transfers.remote(False))
    assert ray.get(reading) == ("ok", {"prefetched-first": first})
    assert ray.get(asking) == ("ok", {"asked-first": second})
    s = ray.get(bridge.stats.remote())
    # The rank that asked after the prefetch found the object being written and made
    # no call; the one that asked first made one; the bytes crossed once per item.
    assert (s["prefetch_calls"], s["fetch_calls"], s["fetched"]) == (2, 1, 2), s
    assert nodes.bridge_stats()[cluster["node0"]]["served"] == 2  # each crossed once
