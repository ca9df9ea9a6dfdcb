"""shmstore.vllm with vLLM's Ray executor: workers on other nodes read each item through
their node's store, fetched once per node; an item gone at the source is a miss in the
engine core (vLLM's retry path), and a node store that cannot hold an item, or lost its
copy mid-fetch, is read past, never a miss in a worker (which stops vLLM)."""

from __future__ import annotations

import gc
import os
import signal
import uuid

import pytest
import ray

import shmstore

pytest.importorskip("vllm")

from harness import digest, make_config, make_item, setup_process  # noqa: E402
from shmstore.ray import NodeStores  # noqa: E402
from ranks import wait_until  # noqa: E402
from vllm_ranks import VllmWorker  # noqa: E402


@pytest.fixture
def vllm_env(cluster, monkeypatch):
    name = f"shmstore-vllm-raytest-{uuid.uuid4().hex[:8]}"
    # This process and the workers are processes of an instance launched elsewhere.
    env = {"SHMSTORE_VLLM": "1", "SHMSTORE_VLLM_STORE": name, "SHMSTORE_VLLM_LAUNCHER": "test"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    setup_process()
    yield env
    for f in os.listdir("/dev/shm"):
        if f.startswith(name):
            os.unlink(f"/dev/shm/{f}")


def ray_config():
    config = make_config(cache_mb=64, max_object_mb=16, world_size=4)
    config.parallel_config.distributed_executor_backend = "ray"
    return config


def workers(config, env, placement: list[str]) -> list:
    return [
        VllmWorker.options(resources={node: 1}, runtime_env={"env_vars": env}).remote(config, env)
        for node in placement
    ]


def send(sender, encoder, hashes: list[str], fresh: set[str]) -> list[tuple[str, list[bytes]]]:
    """What vLLM's front-end sends for a request: each item through the sender cache,
    encoded with vLLM's msgpack encoder (for shmstore: a marker, the hash is the key)."""
    out = []
    for h in hashes:
        item, _ = sender.get_and_update_item((make_item(h), []) if h in fresh else None, h)
        out.append((h, list(encoder.encode(item))))
    return out


def test_workers_on_other_nodes_read_items_fetched_once_per_node(cluster, vllm_env):
    from vllm.v1.serial_utils import MsgpackEncoder

    from shmstore.vllm import ShmstoreSenderCache

    config = ray_config()
    sender = ShmstoreSenderCache(config)  # the front-end, on the head node
    encoder = MsgpackEncoder()
    ws = workers(config, vllm_env, ["node0", "node1", "node1", "node2"])
    infos = ray.get([w.info.remote() for w in ws])
    assert [i["bridged"] for i in infos] == [False, True, True, True]
    assert infos[0]["store"].endswith(vllm_env["SHMSTORE_VLLM_STORE"])
    assert infos[1]["store"] == infos[2]["store"] != infos[3]["store"]
    # Workers attach read-only on every node (SHMSTORE_VLLM_READ_ONLY's default); the
    # bridges write.
    assert [i["read_only"] for i in infos] == [True] * 4

    hashes = [f"img-{i}" for i in range(4)] + ["video-x"]
    entries = send(sender, encoder, hashes, set(hashes))
    for h, bufs in entries:
        assert sum(len(b) for b in bufs) < 200  # a marker crossed the RPC, not the data
    want = [digest(make_item(h)) for h in hashes]
    assert ray.get([w.request.remote(entries) for w in ws]) == [("ok", want)] * 4
    # Again (vLLM's cache hit): nothing crosses between nodes any more.
    entries = send(sender, encoder, hashes, set())
    assert ray.get([w.request.remote(entries) for w in ws]) == [("ok", want)] * 4

    stats = NodeStores(vllm_env["SHMSTORE_VLLM_STORE"], 0).bridge_stats()
    assert stats[cluster["node1"]]["fetched"] == len(hashes)  # 2 workers, one fetch each
    assert stats[cluster["node2"]]["fetched"] == len(hashes)
    assert stats[cluster["node0"]]["served"] == 2 * len(hashes)


def test_an_item_the_front_end_lost_is_a_miss_in_the_engine_core_and_the_retry_path_recovers(
    cluster, vllm_env
):
    # vLLM recovers from a miss only in the engine core (a miss in a worker stops vLLM):
    # the engine core, on the front-end's node, admits each request through the gate,
    # which pins the request's items at the source until the request is done, so that
    # no bridge finds them gone.
    from vllm.multimodal.cache.base import MultiModalCacheMissError
    from vllm.multimodal.inputs import MultiModalKwargsItem
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    import shmstore.vllm as sv

    config = ray_config()
    sender = sv.ShmstoreSenderCache(config)
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(MultiModalKwargsItem)
    engine = sv.engine_cache(config)  # this process is the engine core, on the head node
    assert isinstance(engine, sv.ShmstorePrefetcher) and engine.gate is not None
    (w,) = workers(config, vllm_env, ["node2"])
    hashes = ["a", "b", "c"]
    entries = send(sender, encoder, hashes, set(hashes))
    for h in ("a", "c"):  # gone from the front-end's store before the engine core sees them
        sender.store.delete(h)
    with pytest.raises(MultiModalCacheMissError) as miss:
        engine.get_and_update_features(engine_features(decoder, entries))
    assert miss.value.mm_hashes == ["a", "c"]
    del miss
    gc.collect()  # the traceback held the failed request, and the pin its "b" took
    assert engine.gate.pins.objects() == 0
    # vLLM's retry path: the front-end invalidates the hashes and sends the request again.
    for h in ("a", "c"):
        sender.invalidate(h)
    assert not sender.inline_only  # the store did not hold them: a plain miss
    assert sender.is_cached(hashes) == [False, True, False]
    entries = send(sender, encoder, hashes, {"a", "c"})
    features = engine_features(decoder, entries)
    engine.get_and_update_features(features)  # admitted: pinned at the source
    assert engine.gate.pins.objects() == 3
    assert ray.get(w.request.remote(entries)) == ("ok", [digest(make_item(h)) for h in hashes])
    del features  # the request is done
    assert engine.gate.pins.objects() == 0


def test_an_item_deleted_by_hand_after_the_engine_core_admitted_it_still_reaches_a_remote_worker(
    cluster, vllm_env
):
    # The gate pins the request's item at the source; then the item is deleted there by
    # hand (Store.delete) before node2's worker fetches it: the source's bridge serves
    # it as draining (NodeStores.fetch_draining), where a miss would stop vLLM.
    from vllm.multimodal.inputs import MultiModalKwargsItem
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    import shmstore.vllm as sv

    config = ray_config()
    sender = sv.ShmstoreSenderCache(config)
    engine = sv.engine_cache(config)
    (w,) = workers(config, vllm_env, ["node2"])
    entries = send(sender, MsgpackEncoder(), ["late"], {"late"})
    features = engine_features(MsgpackDecoder(MultiModalKwargsItem), entries)
    engine.gate.get_and_update_features(features)  # admitted (no prefetch: the gate alone)
    sender.store.delete("late")
    assert not sender.store.contains("late")
    assert ray.get(w.request.remote(entries)) == ("ok", [digest(make_item("late"))])
    del features  # the request is done
    assert engine.gate.pins.objects() == 0


def test_a_remote_worker_whose_node_lost_its_copy_mid_fetch_reads_the_item_from_the_source(
    cluster, vllm_env
):
    # node2's bridge dies while it writes the item into node2's store (Ray restarts it):
    # the worker waiting for that copy gets CreatorDied, and a miss in a worker would
    # stop vLLM. It reads the item from the front-end's node into its own memory.
    from vllm.v1.serial_utils import MsgpackEncoder

    import shmstore.vllm as sv

    config = ray_config()
    sender = sv.ShmstoreSenderCache(config)
    (w,) = workers(config, vllm_env, ["node2"])
    ray.get(w.info.remote())  # node2's bridge and store exist
    nodes = NodeStores(vllm_env["SHMSTORE_VLLM_STORE"], 0)
    bridge = nodes.bridge(cluster["node2"])
    ray.get(bridge.hold_transfers.remote(True))
    pid = ray.get(bridge.stats.remote())["pid"]
    image = make_item("held", kind="image")  # 1.2 MiB: it comes through Ray's object store
    marker, _ = sender.get_and_update_item((image, []), "held")
    reading = w.request.remote([("held", list(MsgpackEncoder().encode(marker)))])
    wait_until("node2's copy being written", lambda: ray.get(bridge.stats.remote())["unsealed"] == 1)
    os.kill(pid, signal.SIGKILL)
    assert ray.get(reading) == ("ok", [digest(image)])


def test_a_remote_worker_whose_node_store_is_full_of_pinned_items_reads_past_it(cluster, vllm_env):
    # Every byte of node2's store pinned (by readers there): its bridge cannot take the
    # item (FetchFailed). The worker reads it from the front-end's node instead.
    from vllm.v1.serial_utils import MsgpackEncoder

    import shmstore.vllm as sv

    config = ray_config()
    sender = sv.ShmstoreSenderCache(config)
    (w,) = workers(config, vllm_env, ["node2"])
    ray.get(w.info.remote())  # node2's store exists
    nodes = NodeStores(vllm_env["SHMSTORE_VLLM_STORE"], 0)
    node2 = shmstore.Store.open(nodes.store_name(cluster["node2"]))
    held = []
    with pytest.raises(shmstore.Full):
        for i in range(1 << 12):
            node2.put(f"pinned-{i}", bytes(1 << 20))
            held.append(node2.get(f"pinned-{i}"))
    hashes = ["p1", "p2"]
    entries = send(sender, MsgpackEncoder(), hashes, set(hashes))
    assert ray.get(w.request.remote(entries)) == ("ok", [digest(make_item(h)) for h in hashes])
    assert not any(node2.contains(h) for h in hashes), "read past the full store"
    del held


def engine_features(decoder, entries: list[tuple[str, list[bytes]]]) -> list:
    """A request's ``mm_features`` as vLLM's engine core receives them."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return [
        MultiModalFeatureSpec(
            data=decoder.decode(bufs), modality="image", identifier=h,
            mm_position=PlaceholderRange(offset=0, length=1), mm_hash=h,
        )
        for h, bufs in entries
    ]


def test_the_engine_core_prefetches_items_so_remote_workers_need_not_ask(cluster, vllm_env):
    from vllm.multimodal.cache import factories
    from vllm.multimodal.inputs import MultiModalKwargsItem
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    import shmstore.vllm as sv

    sv.register()
    config = ray_config()
    sender = sv.ShmstoreSenderCache(config)
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(MultiModalKwargsItem)
    # This process is the engine core: Ray's executor started Ray here, on 3 nodes.
    engine = factories.engine_receiver_cache_from_config(config)
    assert isinstance(engine, sv.ShmstorePrefetcher)
    ws = workers(config, vllm_env, ["node0", "node1", "node1", "node2"])
    ray.get([w.info.remote() for w in ws])  # started: node1's and node2's bridges run

    hashes = [f"img-{i}" for i in range(3)] + ["video-x"]
    features = engine_features(decoder, send(sender, encoder, hashes, set(hashes)))
    markers = [f.data for f in features]
    # The engine core passes the request on unchanged, markers and all.
    assert engine.get_and_update_features(features) is features
    assert [f.data for f in features] == markers and all(sv.is_marker(m) for m in markers)
    nodes = NodeStores(vllm_env["SHMSTORE_VLLM_STORE"], 0)
    remote = (cluster["node1"], cluster["node2"])
    wait_until("both remote nodes holding every item", lambda: all(
        (s := nodes.bridge_stats()[n])["fetched"] == len(hashes) and s["unsealed"] == 0 for n in remote
    ))

    entries = send(sender, encoder, hashes, set())  # what the workers get when scheduled
    want = [digest(make_item(h)) for h in hashes]
    assert ray.get([w.request.remote(entries) for w in ws]) == [("ok", want)] * 4
    stats = nodes.bridge_stats()
    for n in remote:
        s = stats[n]
        # One prefetch call per node for the whole request; the workers asked nothing.
        assert (s["prefetch_calls"], s["fetch_calls"], s["fetched"]) == (1, 0, len(hashes)), s
    # The front-end's cache hit sends the same markers again: no second prefetch.
    engine.get_and_update_features(engine_features(decoder, entries))
    assert all(nodes.bridge_stats()[n]["prefetch_calls"] == 1 for n in remote)
