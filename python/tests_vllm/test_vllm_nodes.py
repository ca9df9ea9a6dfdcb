"""Workers on other machines (``shmstore.vllm.nodes``), without Ray: which cache the
engine core gets where, how the node stores are asked for, and what the prefetcher
sends to the other nodes. Ray here is a stand-in module; python/tests_ray runs the same
code on a real 3-node Ray cluster (scripts/ray.sh test)."""

import logging
import sys
import types

import pytest
from harness import make_config, make_item

import shmstore
from shmstore import vllm as sv
from shmstore.vllm import instance
from shmstore.vllm import nodes as nodes_module


class FakeNodes:
    """``shmstore.ray.NodeStores`` as the prefetcher and the caches use it."""

    def __init__(self, this="node-a", source="node-a", fail=None):
        self.this, self.src, self.fail = this, source, fail
        self.prefetched: list[list[str]] = []

    def this_node(self):
        return self.this

    def source(self):
        return self.src

    def prefetch(self, keys):
        if self.fail:
            raise self.fail
        self.prefetched.append(list(keys))


class FakeGate:
    def __init__(self, miss=None):
        self.admitted, self.miss = [], miss

    def admit(self, features):
        if self.miss:
            raise self.miss
        self.admitted.append(features)


def feature(key, data="marker", *, mm_hash=True):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    if isinstance(data, str):
        data = sv.marker_item() if data == "marker" else make_item(key)
    return MultiModalFeatureSpec(data=data, modality="image", identifier=f"id-{key}",
                                 mm_position=PlaceholderRange(offset=0, length=1),
                                 mm_hash=key if mm_hash else None)


def ray_config():
    config = make_config()
    config.parallel_config.distributed_executor_backend = "ray"
    return config


@pytest.fixture
def fake_ray(monkeypatch):
    """A Ray stand-in in ``sys.modules``: up, with the nodes ``alive`` lists."""
    ray = types.ModuleType("ray")
    ray.up = True
    ray.alive = [True, True]
    ray.is_initialized = lambda: ray.up
    ray.nodes = lambda: [{"Alive": a} for a in ray.alive]
    monkeypatch.setitem(sys.modules, "ray", ray)
    made = []

    class NodeStores:
        def __init__(self, name, capacity, **kwargs):
            made.append((name, capacity, kwargs))

        def this_node(self):
            return "node-a"

        def source(self):
            return "node-a"

    bridge = types.ModuleType("shmstore.ray")
    bridge.NodeStores = NodeStores
    monkeypatch.setitem(sys.modules, "shmstore.ray", bridge)
    ray.made = made
    return ray


def test_the_prefetcher_asks_once_per_request_for_the_new_items_it_stores(caplog):
    fake = FakeNodes()
    p = sv.ShmstorePrefetcher(fake, remember=3)
    request = [feature("a"), feature("b"), feature("inline", data="item"),
               feature("covered", data=None), feature("a")]
    assert p.get_and_update_features(request) is request  # passed on as it came
    assert [f.mm_hash for f in request] == ["a", "b", "inline", "covered", "a"]
    assert sv.is_marker(request[0].data) and request[3].data is None
    # Only the markers (not inline items, not the prefix cache's), each once, in order.
    assert fake.prefetched == [["a", "b"]]
    # A cache hit in the front-end sends the same markers again: no call.
    p.get_and_update_features([feature("b"), feature("a")])
    assert fake.prefetched == [["a", "b"]]
    # Without an mm_hash the key is the feature's identifier.
    p.get_and_update_features([feature("c", mm_hash=False)])
    assert fake.prefetched[-1] == ["id-c"]
    # It remembers the last `remember` keys, least recently seen forgotten first: "a"
    # was seen after "b", so "b" goes.
    p.get_and_update_features([feature("d")])
    assert list(p.seen) == ["a", "id-c", "d"]
    p.get_and_update_features([feature("b"), feature("a")])
    assert fake.prefetched[-1] == ["b"] and list(p.seen) == ["d", "b", "a"]
    assert len(fake.prefetched) == 4
    # vLLM clears the engine core's cache with the front-end's: everything is new again.
    p.clear_cache()
    p.get_and_update_features([feature("a")])
    assert fake.prefetched[-1] == ["a"]


def test_a_failed_prefetch_costs_the_request_nothing_and_is_said_once(caplog):
    caplog.set_level(logging.INFO, logger="shmstore.vllm")
    instance._logged.discard("prefetch")
    p = sv.ShmstorePrefetcher(FakeNodes(fail=RuntimeError("bridge on node-b is gone")))
    request = [feature("a")]
    assert p.get_and_update_features(request) is request
    assert p.get_and_update_features([feature("b")])[0].mm_hash == "b"
    said = [r.getMessage() for r in caplog.records]
    assert said == ["shmstore: prefetch failed (bridge on node-b is gone); workers fetch "
                    "items themselves"], said
    instance._logged.discard("prefetch")


def test_on_the_front_ends_node_the_gate_admits_the_request_before_anything_moves():
    from vllm.multimodal.cache.base import MultiModalCacheMissError

    fake, gate = FakeNodes(), FakeGate()
    p = sv.ShmstorePrefetcher(fake, gate=gate)
    request = [feature("a")]
    p.get_and_update_features(request)
    assert gate.admitted == [request] and fake.prefetched == [["a"]]
    # A miss is raised in the engine core (vLLM's retry path), and nothing is fetched.
    gate.miss = MultiModalCacheMissError(["b"])
    with pytest.raises(MultiModalCacheMissError):
        p.get_and_update_features([feature("b")])
    assert fake.prefetched == [["a"]] and "b" not in p.seen


def test_without_ray_the_engine_core_gets_the_gate_and_workers_read_their_own_store(store_env):
    config = make_config()
    assert not nodes_module._ray_backend(config)
    assert nodes_module._node_stores(config) is None
    assert nodes_module._remote_node_stores(config) is None
    engine = sv.engine_cache(config)
    assert type(engine) is sv.ShmstoreEngineGate
    assert sv.engine_prefetcher(config) is None
    # The gate attached the instance's store read-only.
    with pytest.raises(shmstore.ReadOnly):
        engine.store.put("x", b"y")


def test_the_node_stores_are_asked_for_only_where_rays_executor_started_ray(
        store_env, fake_ray, monkeypatch):
    config = ray_config()
    assert nodes_module._ray_backend(config)
    assert not nodes_module._ray_backend(types.SimpleNamespace())  # no parallel config
    fake_ray.up = False  # Ray's executor has not started Ray in this process (a front-end)
    assert nodes_module._node_stores(config) is None
    monkeypatch.delitem(sys.modules, "ray")  # nor imported it
    fake_ray.up = True
    assert nodes_module._node_stores(config) is None
    assert fake_ray.made == []
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    monkeypatch.delenv("SHMSTORE_VLLM_SOURCE_NODE", raising=False)
    monkeypatch.delenv("SHMSTORE_VLLM_READ_ONLY", raising=False)
    assert nodes_module._node_stores(config) is not None
    capacity = nodes_module._capacity(config)
    assert fake_ray.made[-1] == (store_env["SHMSTORE_VLLM_STORE"], capacity, {
        "source_node": None, "max_objects": 1 << 16, "read_only": True,
        "fetch_draining": True})
    # A larger store: a table for its size. The operator's source node; workers
    # read-write.
    monkeypatch.setenv("SHMSTORE_VLLM_SOURCE_NODE", "node-x")
    monkeypatch.setenv("SHMSTORE_VLLM_READ_ONLY", "0")
    big = make_config(cache_mb=8 << 10)
    big.parallel_config.distributed_executor_backend = "ray"
    nodes_module._node_stores(big)
    assert fake_ray.made[-1][1:] == (8 << 30, {
        "source_node": "node-x", "max_objects": (8 << 30) >> 16, "read_only": False,
        "fetch_draining": True})


def test_which_engine_core_cache_runs_on_which_node(store_env, fake_ray, monkeypatch, caplog):
    config = ray_config()
    here = FakeNodes(this="node-a", source="node-a")
    monkeypatch.setattr(nodes_module, "_node_stores", lambda c: here)
    caplog.set_level(logging.INFO, logger="shmstore.vllm")
    instance._logged.discard("prefetch")
    # The front-end's node, Ray on 2 nodes: the prefetcher around the gate, said once.
    engine = sv.engine_cache(config)
    assert type(engine) is sv.ShmstorePrefetcher and engine.nodes is here
    assert type(engine.gate) is sv.ShmstoreEngineGate
    sv.engine_cache(config)
    assert [r.getMessage() for r in caplog.records if "prefetch" in r.getMessage()] == [
        "shmstore: the engine core prefetches each request's items into the stores of the "
        "other nodes as the request arrives (SHMSTORE_VLLM_PREFETCH=0 turns it off)"]
    # Another node: the prefetcher alone (the gate pins at the source's store).
    here.this = "node-b"
    engine = sv.engine_cache(config)
    assert type(engine) is sv.ShmstorePrefetcher and engine.gate is None
    assert nodes_module._remote_node_stores(config) is here
    # Prefetching turned off: the gate on the front-end's node, nothing on another.
    monkeypatch.setenv("SHMSTORE_VLLM_PREFETCH", "0")
    assert sv.engine_cache(config) is None
    here.this = "node-a"
    assert type(sv.engine_cache(config)) is sv.ShmstoreEngineGate
    assert nodes_module._remote_node_stores(config) is None
    # One node alive (the others gone): nothing to prefetch to.
    monkeypatch.setenv("SHMSTORE_VLLM_PREFETCH", "1")
    fake_ray.alive = [True, False, False]
    assert type(sv.engine_cache(config)) is sv.ShmstoreEngineGate
    fake_ray.alive = [False, True, True]
    assert type(sv.engine_cache(config)) is sv.ShmstorePrefetcher
    # Given no node stores, it finds them itself.
    assert sv.engine_prefetcher(config).nodes is here
    instance._logged.discard("prefetch")
