"""Real worker processes, vLLM's msgpack on the wire, vLLM's request flow: the same random
request stream through vLLM's shm cache and through shmstore's, the miss path, two
front-ends on one store, forked and spawned workers, workers and front-ends killed."""

import gc
import os
import signal

import pytest
from harness import (
    START_METHOD,
    Cluster,
    child_env,
    context,
    expected,
    make_config,
    make_item,
    random_stream,
    setup_process,
)

import shmstore
from shmstore import vllm as sv


def run_stream(kind, n_workers, env, *, method=START_METHOD, seed=7, n=50, mrope=False):
    config = make_config(cache_mb=24, max_object_mb=8, world_size=n_workers)
    c = Cluster(kind, config, n_workers, method=method, env=env, item_scale=2.0, mrope=mrope)
    try:
        for hashes, strip in random_stream(seed, n, pool=30, oversize_every=17):
            got = c.request(hashes, strip)
            want = expected(hashes, strip, scale=2.0, mrope=mrope)
            for w, digests in got.items():
                assert digests == want, f"{kind}: worker {w} saw other items for {hashes}"
        return c.processed, c.stripped, c.inline, c.retries
    finally:
        c.close()


@pytest.mark.parametrize("mrope", [False, True], ids=["plain", "mrope"])
def test_the_same_stream_through_vllms_shm_cache_and_shmstores_gives_every_worker_equal_items(
    store_env, mrope
):
    # With M-RoPE (Qwen2-VL), the scheduler keeps an item's keep_on_cpu fields when the
    # prefix cache covers it: the workers compute positions from them.
    ours = run_stream("shmstore", 2, store_env, mrope=mrope)
    theirs = run_stream("vllm-shm", 2, store_env, mrope=mrope)
    for processed, stripped, inline, _ in (ours, theirs):
        assert stripped > 0, "some items were covered by the prefix cache (stripped by vLLM)"
        assert inline > 0, "oversize items went inline"
    resent = [h for h, k in ours[0].items() if k > 1]
    assert resent, "some items were evicted and sent again"


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_forked_and_spawned_workers(store_env, method):
    processed, _, _, retries = run_stream("shmstore", 2, store_env, method=method, n=20)
    assert processed


def test_an_item_gone_before_the_engine_core_admits_its_request_is_a_miss_there_and_a_resend_recovers(
    store_env,
):
    # vLLM recovers from a miss only in the engine core (a retryable error; a miss in a
    # worker stops vLLM): the engine core's gate finds every missing item of the request
    # before any worker sees it.
    from vllm.multimodal.cache.base import MultiModalCacheMissError

    c = Cluster("shmstore", make_config(world_size=1), 1, env=store_env)
    try:
        hashes = ["m1", "m2", "m3"]
        assert c.request(["m2"])[0] == expected(["m2"])  # m2 is a hit below

        def gone():  # deleted by another process while the request is on its way
            for h in ("m1", "m3"):
                c.sender.store.delete(h)

        with pytest.raises(MultiModalCacheMissError) as miss:
            c.send(hashes, before_engine=gone)
        assert sorted(miss.value.mm_hashes) == ["m1", "m3"]  # all of them, in one error
        del miss
        gc.collect()  # the traceback held the request
        assert c.gate.pins.objects() == 0, "what the gate pinned for m2 went with the request"
        for h in ("m1", "m3"):
            c.sender.invalidate(h)
        assert not c.sender.inline_only, "the store did not hold them: a plain miss"
        # The front-end no longer pins the deleted objects (its window of recent sends
        # let go of them), so their memory is free now, and the resend below pins the
        # new objects, not the old ones.
        assert c.sender.store.stats()["draining"] == 0
        assert c.request(hashes)[0] == expected(hashes)  # no worker ever missed
        assert c.processed == {"m1": 2, "m2": 1, "m3": 2}
        assert c.gate.pins.objects() == 0
    finally:
        c.close()


def test_an_item_deleted_after_it_was_sent_is_processed_again_not_missed(store_env):
    # The front-end still pins the object it sent (its window of recent sends), but the
    # object was deleted since (another front-end's clear_cache, or by hand): the next
    # request must not be told it is cached, or its marker fails in the engine core.
    c = Cluster("shmstore", make_config(world_size=1), 1, env=store_env)
    try:
        assert c.request(["d"])[0] == expected(["d"])
        c.sender.store.delete("d")
        assert c.sender.is_cached(["d"]) == [False]
        assert c.request(["d"])[0] == expected(["d"])
        assert c.retries == 0 and c.processed == {"d": 2}
    finally:
        c.close()


def test_an_item_deleted_by_hand_while_its_request_runs_still_reaches_every_worker(store_env):
    # The engine core admitted the request (its gate pins the item), then someone deletes
    # the item from the store by hand (Store.delete, not delete_unpinned) before the
    # workers read it: a lookup by key misses, and a miss in a worker stops vLLM. The
    # workers read it as draining (Store.get_draining): the gate's pin keeps its bytes.
    c = Cluster("shmstore", make_config(world_size=2), 2, env=store_env)
    try:
        req, targets = c.send(["deleted"], mode="pause")
        assert [c.workers[w][1].recv()[0] for w in targets] == ["paused"] * 2
        c.sender.store.delete("deleted")
        assert not c.sender.store.contains("deleted")
        for w in targets:
            c.workers[w][1].send("go")
        assert all(d == ("ok", expected(["deleted"])) for d in c.collect(req, targets).values())
        assert c.gate.pins.objects() == 0, "the request is done: its pin went"
        # The next request for it: a miss in the engine core's gate (vLLM retries it),
        # the item is processed again, and every worker gets it.
        assert c.request(["deleted"])[0] == expected(["deleted"])
        assert c.retries <= 1 and c.processed["deleted"] == 2
    finally:
        c.close()


def test_the_engine_core_keeps_a_requests_items_until_every_worker_has_read_them(store_env):
    # A request waits in the engine core (its worker reads it late) while the front-end
    # stores far more than the store holds: the front-end's window of recent sends lets
    # go of the request's item, and the store evicts everything else, but not that item,
    # which the engine core's gate pinned when it admitted the request.
    c = Cluster("shmstore", make_config(cache_mb=16, world_size=2), 2, env=store_env, item_scale=2.0)
    try:
        req, targets = c.send(["waiting"], mode="pause")
        assert [c.workers[w][1].recv()[0] for w in targets] == ["paused"] * 2
        evictions = c.sender.store.stats()["evictions"]
        for i in range(60):
            h = f"later-{i}"
            c.sender.get_and_update_item((make_item(h, scale=2.0), []), h)
        assert c.sender.store.stats()["evictions"] - evictions > 20
        assert "waiting" not in c.sender._inflight, "the front-end let go of it"
        for w in targets:
            c.workers[w][1].send("go")
        assert all(d == ("ok", expected(["waiting"], scale=2.0)) for d in c.collect(req, targets).values())
        assert c.gate.pins.objects() == 0, "the request is done: its pin went"
    finally:
        c.close()


def test_a_front_end_whose_engine_core_cannot_see_its_store_sends_items_inline(store_env):
    # An engine core on another machine (a data-parallel rank there, with
    # SHMSTORE_VLLM=force) attaches a store of that machine, which is empty: its gate
    # misses every item. The front-end still pins the objects it sent, and the store
    # still holds them: whoever missed them cannot see this store. It sends items
    # inline from then on, and the retried request goes through.
    c = Cluster("shmstore", make_config(world_size=1), 1, env=store_env)
    elsewhere = shmstore.Store.create(
        f"/dev/shm/{store_env['SHMSTORE_VLLM_STORE']}-elsewhere", 16 << 20, remove_when_unused=True)
    try:
        c.gate = sv.ShmstoreEngineGate(store=elsewhere)
        hashes = ["x1", "x2"]
        assert c.request(hashes)[0] == expected(hashes)
        assert c.sender.inline_only and c.retries == 1 and c.inline == 2
        assert c.request(["x3"])[0] == expected(["x3"])
        assert c.retries == 1 and c.inline == 3
    finally:
        c.close()
        del elsewhere


def _frontend(env, seed, n, conn):
    """A second front-end process (data parallel): its own sender and 2 workers."""
    setup_process(env, whole=True)
    c = Cluster("shmstore", make_config(world_size=2, data_parallel=2), 2, env=env)
    ok = True
    try:
        for hashes, strip in random_stream(seed, n, pool=20):
            got = c.request(hashes, strip)
            ok &= all(d == expected(hashes, strip) for d in got.values())
    finally:
        c.close()
    conn.send((ok, c.processed))


def test_two_front_ends_with_four_workers_share_one_store_and_the_first_put_wins(store_env):
    ctx = context()
    parent, child = ctx.Pipe()
    # Both front-ends draw from the same pool of items (same seed), in different orders.
    other = ctx.Process(target=_frontend, args=(child_env(store_env), 3, 40, child))
    other.start()
    c = Cluster("shmstore", make_config(world_size=2, data_parallel=2), 2, env=store_env)
    try:
        for hashes, strip in reversed(list(random_stream(3, 40, pool=20))):
            got = c.request(hashes, strip)
            assert all(d == expected(hashes, strip) for d in got.values())
    finally:
        c.close()
    ok, their_processed = parent.recv()
    other.join(60)
    assert ok and other.exitcode == 0
    store = c.sender.store
    assert store.stats()["dead_clients"] == 0
    assert not any(state == "creating" for _, _, state, _ in store.list())


#: Items of both front-ends below; those ending in ``~`` have prompt updates that are not
#: plain data (a ``PromptIndex`` target), so they cannot be shared.
_SHARED_POOL = [f"s{i}" for i in range(10)] + ["odd1~", "odd2~"]


def _first_front_end(env, conn):
    """A front-end that processes and stores every item of the pool, then stays
    attached until told to go."""
    setup_process(env, whole=True)
    c = Cluster("shmstore", make_config(world_size=2, data_parallel=2), 1, env=env)
    try:
        for i in range(0, len(_SHARED_POOL), 3):
            hashes = _SHARED_POOL[i:i + 3]
            assert all(d == expected(hashes) for d in c.request(hashes).values())
        conn.send(c.processed)
        conn.recv()
    finally:
        c.close()


def test_a_front_end_serves_items_another_front_end_processed_without_processing_them(store_env):
    ctx = context()
    parent, child = ctx.Pipe()
    first = ctx.Process(target=_first_front_end, args=(child_env(store_env), child))
    first.start()
    try:
        assert parent.recv() == {h: 1 for h in _SHARED_POOL}
        c = Cluster("shmstore", make_config(world_size=2, data_parallel=2), 2, env=store_env)
        try:
            for hashes in (_SHARED_POOL[::2], _SHARED_POOL[1::2], _SHARED_POOL):
                got = c.request(hashes)
                assert all(d == expected(hashes) for d in got.values())
            # The item's prompt updates came with it (the driver checks them against
            # what the processor would make): only the two with a PromptIndex target
            # were processed again, once each.
            assert c.processed == {"odd1~": 1, "odd2~": 1}
            assert c.sender.make_stats().hits == 2 * len(_SHARED_POOL) - 2
            assert c.retries == 0
        finally:
            c.close()
    finally:
        parent.send("go")
        first.join(60)
    assert first.exitcode == 0


def test_a_worker_killed_mid_request_costs_only_its_own_pins(store_env):
    c = Cluster("shmstore", make_config(world_size=2), 2, env=store_env)
    try:
        hashes = ["k1", "k2"]
        req, _ = c.send(hashes, mode="hold", to=[0])
        tag, _, digests = c.workers[0][1].recv()
        assert tag == "holding" and digests == expected(hashes)
        store = c.sender.store
        pins_before = store.stats()["pins"]
        os.kill(c.workers[0][0].pid, signal.SIGKILL)
        c.replace_worker(0)
        store.recover()
        assert store.stats()["pins"] < pins_before, "the dead worker's pins are gone"
        assert store.stats()["dead_clients"] == 0
        # Both workers (the replacement too) keep going.
        for hashes, strip in random_stream(11, 15, pool=10):
            assert all(d == expected(hashes, strip) for d in c.request(hashes, strip).values())
    finally:
        c.close()


def _doomed_frontend(env, conn):
    """A front-end that stops forever in the middle of writing an item."""
    setup_process(env, whole=True)
    sender = sv.ShmstoreSenderCache(make_config())
    item = make_item("half-written")
    arrays, meta = sv.encode_item(item)
    plan = shmstore._native.plan_item(
        [(k, str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in arrays.items()], meta
    )
    creation = sender.store.create_object("half-written", plan[2])
    conn.send("writing")
    conn.recv()  # killed here
    del creation


def test_a_front_end_killed_mid_put_and_restarted(store_env):
    ctx = context()
    parent, child = ctx.Pipe()
    doomed = ctx.Process(target=_doomed_frontend, args=(child_env(store_env), child))
    doomed.start()
    assert parent.recv() == "writing"
    doomed.kill()
    doomed.join()
    # The restarted front-end (this process) recovers the dead one's unsealed object and
    # serves the same item; the workers read it.
    c = Cluster("shmstore", make_config(world_size=2), 2, env=store_env)
    try:
        store = c.sender.store
        store.recover()
        assert store.stats()["creating"] == 0
        for hashes in (["half-written", "other"], ["half-written"]):
            assert all(d == expected(hashes) for d in c.request(hashes).values())
    finally:
        c.close()


def test_stalled_worker_blocks_nothing_but_its_own_items(store_env):
    # A worker that holds an item forever; the front-end streams far more than the store
    # holds: everything else keeps being evicted and re-sent around the held item.
    c = Cluster("shmstore", make_config(cache_mb=16, world_size=2), 2, env=store_env, item_scale=2.0)
    try:
        req, _ = c.send(["stuck"], mode="hold", to=[0])
        assert c.workers[0][1].recv()[0] == "holding"
        stalled, _ = c.workers.pop(0)  # worker 0 stalls from now on
        for i in range(40):
            hashes = [f"flow-{i}-{j}" for j in range(2)]
            assert c.request(hashes)[0] == expected(hashes, scale=2.0)
        assert c.sender.store.stats()["evictions"] > 20
        assert c.sender.store.contains("stuck"), "the stalled worker's item stays"
    finally:
        stalled.kill()
        c.close()
