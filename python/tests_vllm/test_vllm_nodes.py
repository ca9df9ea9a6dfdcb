"""Workers on other machines, without Ray: which cache the engine core gets where, how
the node stores are asked for, what the prefetcher sends to the other nodes
(``shmstore.vllm.nodes``), and how a worker on another node reads a request's items
through its node's store or past it (the Ray path of ``ShmstoreReceiverCache``). Ray and
``shmstore.ray`` are stand-ins here; python/tests_ray runs the same code on a real
3-node Ray cluster (scripts/ray.sh test)."""

import logging
import os
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


# ----- a worker on another node (the receiver's Ray path) -----------------------------


class FetchFailed(Exception):
    def __init__(self, keys):
        super().__init__(f"no room for {len(keys)} item(s)")
        self.keys = keys


class ItemsMissing(Exception):
    def __init__(self, keys):
        super().__init__(f"{len(keys)} item(s) missing")
        self.keys = keys


class RemoteNodes:
    """``NodeStores`` on a node other than the front-end's: ``node`` plays this node's
    store, ``source`` the front-end's; ``fail`` lists what each ``ensure_local`` raises
    (None: it brings the keys it is asked for from ``source``)."""

    def __init__(self, node, source, fail=()):
        self.node, self.source_store, self.fail = node, source, list(fail)
        self.ensured: list[list[str]] = []
        self.read: list[list[str]] = []

    def this_node(self):
        return "node-b-0123456789abcdef"

    def source(self):
        return "node-a-fedcba9876543210"

    def store(self):
        return self.node

    def store_name(self):
        return "the-node-store"

    def ensure_local(self, keys):
        self.ensured.append(list(keys))
        error = self.fail.pop(0) if self.fail else None
        if error is not None:
            raise error
        for k in keys:
            if not self.node.contains(k):
                self.node.put(k, bytes(self.source_store.get(k)))

    def read_private(self, keys):
        self.read.append(list(keys))
        return [self.source_store.try_get(k) for k in keys]


@pytest.fixture
def remote_worker(store_env, monkeypatch, shm_stores, caplog):
    """A worker on node-b: its cache, the stand-in node stores, the source's store."""
    from shmstore.vllm import receiver as receiver_module

    source, node = shm_stores
    bridge = types.ModuleType("shmstore.ray")
    bridge.FetchFailed, bridge.ItemsMissing = FetchFailed, ItemsMissing
    monkeypatch.setitem(sys.modules, "shmstore.ray", bridge)
    nodes = RemoteNodes(node, source)
    monkeypatch.setattr(receiver_module, "_remote_node_stores", lambda config: nodes)
    for key in ("node-store-full", "node-copy-lost"):
        instance._logged.discard(key)
    caplog.set_level(logging.INFO, logger="shmstore.vllm")
    # A store a crashed instance left on this node: the worker's start removes it.
    crashed = f"/dev/shm/shmstore-vllm-999995-{os.getpid()}"
    shmstore.Store.create(crashed, 1 << 20)  # dropped at once: no process attached
    worker = receiver_module.ShmstoreReceiverCache(make_config(), keep_fraction=0)
    assert not os.path.exists(crashed), "the crashed instance's store outlived the start"
    return worker, nodes


@pytest.fixture
def shm_stores():
    import uuid

    paths = [f"/dev/shm/shmstore-test-nodes-{uuid.uuid4().hex[:8]}-{n}" for n in ("a", "b")]
    yield [shmstore.Store.create(p, 16 << 20, remove_when_unused=True) for p in paths]
    for p in paths:
        if os.path.exists(p):
            os.unlink(p)


def at_source(source, *hashes):
    for h in hashes:
        shmstore.put_item(source, h, *sv.encode_item(make_item(h)))


def test_a_worker_on_another_node_reads_through_its_nodes_store(remote_worker, caplog):
    from harness import digest

    caplog.set_level(logging.INFO, logger="shmstore.vllm")
    worker, nodes = remote_worker
    assert worker.store is nodes.node
    request = [feature("a"), feature("b"), feature("inline", data="item"),
               feature("covered", data=None)]
    at_source(nodes.source_store, "a", "b")
    assert worker.get_and_update_features(request) is request
    # One round trip for the request's markers; each read from the node's copy.
    assert nodes.ensured == [["a", "b"]] and nodes.read == []
    assert [digest(f.data) for f in request[:3]] == [
        digest(make_item(h)) for h in ("a", "b", "inline")]
    assert request[3].data is None
    assert nodes.node.stats()["gets_hit"] == 2
    # Without an mm_hash, the key is the feature's identifier.
    at_source(nodes.source_store, "id-c")
    worker.get_and_update_features([feature("c", mm_hash=False)])
    assert nodes.ensured[-1] == ["id-c"]
    said = [r.getMessage() for r in caplog.get_records("setup")
            if "worker on Ray node" in r.getMessage()]
    assert said == ["shmstore: worker on Ray node node-b-01234, not the front-end's "
                    "(node-a-fedcb): items come through this node's store "
                    "/dev/shm/the-node-store, fetched once per node"], said


def test_what_the_nodes_store_cannot_take_is_read_past_it(remote_worker, caplog):
    from harness import digest
    from vllm.multimodal.cache.base import MultiModalCacheMissError

    caplog.set_level(logging.INFO, logger="shmstore.vllm")
    worker, nodes = remote_worker
    at_source(nodes.source_store, "a", "big", "c")
    # The node's store is full of pinned items for "big": the rest is brought, "big" is
    # read from the source into the worker's memory.
    nodes.fail = [FetchFailed(["big"])]
    out = worker.get_and_update_features([feature("a"), feature("big"), feature("c")])
    assert nodes.ensured == [["a", "big", "c"], ["a", "c"]] and nodes.read == [["big"]]
    assert [digest(f.data) for f in out] == [digest(make_item(h)) for h in ("a", "big", "c")]
    assert not nodes.node.contains("big")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == ["shmstore: this node's store cannot take items now (no room for 1 "
                      "item(s)); this worker reads them from the front-end's node into its "
                      "own memory instead"], warned
    # The next request starts afresh: "big" is asked for again, and now fits.
    nodes.ensured.clear(), nodes.read.clear()
    out = worker.get_and_update_features([feature("big")])
    assert nodes.ensured == [["big"]] and nodes.read == [] and nodes.node.contains("big")
    # It fails twice: what the second attempt could not take is read past as well.
    at_source(nodes.source_store, "d", "e")
    nodes.ensured.clear()
    nodes.fail = [FetchFailed(["d"]), FetchFailed(["e"])]
    out = worker.get_and_update_features([feature("d"), feature("e")])
    assert nodes.ensured == [["d", "e"], ["e"]] and nodes.read == [["d"], ["e"]]
    assert [digest(f.data) for f in out] == [digest(make_item(h)) for h in ("d", "e")]
    # Read past the node's store at once, not looked for there first.
    assert not [r for r in caplog.records if "was lost" in r.getMessage()], caplog.text
    # Only items the source lacks are a miss, named with the request's others missing.
    for fail in ([ItemsMissing(["x", "y"])], [FetchFailed(["a"]), ItemsMissing(["x", "y"])]):
        nodes.fail = list(fail)
        with pytest.raises(MultiModalCacheMissError) as miss:
            worker.get_and_update_features([feature("a"), feature("x"), feature("y")])
        assert miss.value.mm_hashes == ["x", "y"]
    # The request that missed never read "a", which its node could not take then: the
    # next request reads it from the node's store, where it is now.
    nodes.read.clear()
    worker.get_and_update_features([feature("a")])
    assert nodes.read == [] and nodes.node.contains("a")


def test_a_copy_the_node_lost_before_the_read_is_read_from_the_source(remote_worker, caplog):
    from harness import digest
    from vllm.multimodal.cache.base import MultiModalCacheMissError

    caplog.set_level(logging.INFO, logger="shmstore.vllm")
    worker, nodes = remote_worker
    at_source(nodes.source_store, "a")
    nodes.ensure_local = lambda keys: nodes.ensured.append(list(keys))  # brings nothing
    out = worker.get_and_update_features([feature("a")])
    assert digest(out[0].data) == digest(make_item("a")) and nodes.read == [["a"]]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and warned[0].startswith(
        "shmstore: this node's copy of an item was lost before this worker read it ("), warned
    assert warned[0].endswith("); reading it from the front-end's node instead"), warned
    # Gone at the source too: a miss.
    with pytest.raises(MultiModalCacheMissError) as miss:
        worker.get_and_update_features([feature("gone")])
    assert miss.value.mm_hashes == ["gone"]
