"""The worker's cache (``ShmstoreReceiverCache``) as vLLM's model runner drives it: markers
become the stored items, zero-copy; hits on recent items are answered from the items it
keeps, within their budget; misses are vLLM's ``MultiModalCacheMissError``."""

import logging
import re

import pytest
import torch
from harness import digest, float_item, make_config, make_item
from vllm.multimodal.inputs import MultiModalBatchedField, MultiModalFieldElem, MultiModalKwargsItem

import shmstore
from shmstore import vllm as sv


def test_a_worker_attaches_read_only_unless_told_otherwise(store_env, monkeypatch):
    # Workers only read: a worker's bug (or an attacker in it) cannot write the store's
    # objects or delete them. SHMSTORE_VLLM_READ_ONLY=0 attaches them read-write.
    sender = sv.ShmstoreSenderCache(make_config())
    try:
        worker = sv.ShmstoreReceiverCache(make_config())
        with pytest.raises(shmstore.ReadOnly):
            worker.store.put("from a worker", b"x")
        monkeypatch.setenv("SHMSTORE_VLLM_READ_ONLY", "0")
        writer = sv.ShmstoreReceiverCache(make_config())
        writer.store.put("from a worker", b"x")
        assert sender.store.contains("from a worker")
    finally:
        sender.close()


def test_a_worker_answers_hits_from_the_items_it_keeps_within_its_budget(store_env):
    cfg = make_config()  # a 64 MiB store: each worker keeps up to 1/8, 8 MiB, by default
    sender = sv.ShmstoreSenderCache(cfg)
    worker = sv.ShmstoreReceiverCache(cfg)
    hashes = [f"keep-{i}" for i in range(10)]  # images of 1.2 MiB
    for h in hashes:
        sender.get_and_update_item((make_item(h, kind="image"), []), h)
    sender.close()  # its window of recent sends lets go of their pins
    store = sender.store
    size = len(store.get(hashes[-1]))
    marker = sv.marker_item()
    first = {h: worker.get_and_update_item(marker, h) for h in hashes}
    # A hit on a recent item is the very same item: no lookup in the store.
    lookups = store.stats()["gets_hit"]
    again = worker.get_and_update_item(marker, hashes[-1])
    assert again is first[hashes[-1]]
    assert store.stats()["gets_hit"] == lookups
    assert digest(again) == digest(make_item(hashes[-1], kind="image"))
    # Once vLLM drops the items, only the kept ones stay pinned: within the budget, the
    # most recent ones, and fewer than all of them.
    del first, again
    pins = store.stats()["pins"]
    assert 1 <= pins < len(hashes) and pins * size <= (64 << 20) // 8, (pins, size)
    lookups = store.stats()["gets_hit"]
    worker.get_and_update_item(marker, hashes[0])  # the oldest was let go: looked up again
    assert store.stats()["gets_hit"] == lookups + 1
    # clear_cache lets go of every kept item; keep_fraction=0 keeps none.
    worker.clear_cache()
    assert store.stats()["pins"] == 0
    plain = sv.ShmstoreReceiverCache(cfg, keep_fraction=0.0)
    got = plain.get_and_update_item(marker, hashes[-1])
    assert store.stats()["pins"] == 1
    del got
    assert store.stats()["pins"] == 0
    # Data-parallel ranks read different requests: they share the fraction.
    ranked = sv.ShmstoreReceiverCache(make_config(data_parallel=2))
    got = [ranked.get_and_update_item(marker, h) for h in hashes]
    del got
    pins = store.stats()["pins"]
    assert 1 <= pins and pins * size <= (64 << 20) // 16, (pins, size)


def test_the_items_a_worker_keeps_fill_their_budget_exactly(store_env):
    sender = sv.ShmstoreSenderCache(make_config(cache_mb=64))
    try:
        for i in range(4):
            sender.get_and_update_item((float_item(1 << 18, float(i)), []), f"k{i}")
        sender.close()  # the window lets go of its pins
        store = sender.store
        n = len(store.get("k0"))
        assert all(len(store.get(f"k{i}")) == n for i in range(4))
        worker = sv.ShmstoreReceiverCache(make_config(cache_mb=64), keep_fraction=3 * n / (64 << 20))
        marker = sv.marker_item()
        for i in range(3):
            worker.get_and_update_item(marker, f"k{i}")
        assert store.stats()["pins"] == 3, "three fill the budget exactly: all kept"
        hits = store.stats()["gets_hit"]
        worker.get_and_update_item(marker, "k0")  # a hit: the most recent now
        worker.get_and_update_item(marker, "k3")
        assert store.stats()["pins"] == 3, "a fourth lets go of the least recent"
        assert store.stats()["gets_hit"] == hits + 1
        for h in ("k0", "k2", "k3"):
            worker.get_and_update_item(marker, h)
        assert store.stats()["gets_hit"] == hits + 1, "k1 was let go, no other"
        worker.get_and_update_item(marker, "k1")
        assert store.stats()["gets_hit"] == hits + 2
        # vLLM's reset_mm_cache: every kept item goes, and the budget is whole again.
        worker.clear_cache()
        assert store.stats()["pins"] == 0
        for i in range(3):
            worker.get_and_update_item(marker, f"k{i}")
        assert store.stats()["pins"] == 3
    finally:
        sender.close()


def feature(h: str, data):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return MultiModalFeatureSpec(data=data, modality="image", identifier=h,
                                 mm_position=PlaceholderRange(offset=0, length=1), mm_hash=h)


def test_a_request_reads_its_markers_keeps_inline_items_and_skips_what_the_prefix_cache_covered(
    store_env,
):
    sender = sv.ShmstoreSenderCache(make_config())
    try:
        sender.get_and_update_item((float_item(16, 7.0), []), "stored")
        worker = sv.ShmstoreReceiverCache(make_config())
        inline = float_item(4, 3.0)
        features = [feature("stored", sv.marker_item()), feature("inline", inline),
                    feature("covered", None)]
        assert worker.get_and_update_features(features) is features
        assert torch.equal(features[0].data["x"].data, torch.full((16,), 7.0))
        assert features[1].data is inline and features[2].data is None
        # vLLM never hands a worker an item that is neither a marker nor data.
        with pytest.raises(AssertionError, match="Expected an item"):
            worker.get_and_update_item(None, "nothing")
    finally:
        sender.close()


def test_a_miss_names_every_missing_item_of_the_request_and_says_why_it_should_not_happen(
    store_env, caplog
):
    from vllm.multimodal.cache.base import MultiModalCacheMissError

    sender = sv.ShmstoreSenderCache(make_config())
    try:
        sender.get_and_update_item((float_item(16), []), "here")
        worker = sv.ShmstoreReceiverCache(make_config())
        request = [feature(h, sv.marker_item()) for h in ("gone", "here", "also gone")]
        with pytest.raises(MultiModalCacheMissError) as miss:
            worker.get_and_update_features(request)
        assert miss.value.mm_hashes == ["gone", "also gone"]
        assert "cannot find items ['gone', 'also gone']" in caplog.text
        assert "vLLM stops on a miss in a worker" in caplog.text
    finally:
        sender.close()


def test_an_item_whose_writer_never_seals_it_is_a_miss_after_the_timeout(store_env):
    from vllm.multimodal.cache.base import MultiModalCacheMissError

    sender = sv.ShmstoreSenderCache(make_config())
    try:
        writing = sender.store.create_object("unsealed", 1 << 10)
        worker = sv.ShmstoreReceiverCache(make_config(), timeout=0.05)
        with pytest.raises(MultiModalCacheMissError) as miss:
            worker.get_and_update_item(sv.marker_item(), "unsealed")
        assert miss.value.mm_hashes == ["unsealed"]
        writing.abort()
    finally:
        sender.close()


def test_a_touched_item_is_the_last_a_worker_lets_go_of(store_env):
    # vLLM touches the items of a request that hit the prefix cache: they are recent.
    sender = sv.ShmstoreSenderCache(make_config(cache_mb=64))
    try:
        for i in range(3):
            sender.get_and_update_item((float_item(1 << 18, float(i)), []), f"t{i}")
        sender.close()
        store = sender.store
        n = len(store.get("t0"))
        worker = sv.ShmstoreReceiverCache(make_config(cache_mb=64), keep_fraction=2 * n / (64 << 20))
        marker = sv.marker_item()
        worker.get_and_update_item(marker, "t0")
        worker.get_and_update_item(marker, "t1")
        worker.touch_receiver_cache_item("t0")
        worker.touch_receiver_cache_item("never read")
        worker.get_and_update_item(marker, "t2")  # lets go of t1, the least recent
        hits = store.stats()["gets_hit"]
        worker.get_and_update_item(marker, "t0")
        assert store.stats()["gets_hit"] == hits
        worker.get_and_update_item(marker, "t1")
        assert store.stats()["gets_hit"] == hits + 1
    finally:
        sender.close()


def test_empty_tensors_and_plain_values_come_back(store_env):
    item = MultiModalKwargsItem({
        "empty": MultiModalFieldElem(data=torch.zeros((0, 3), dtype=torch.bfloat16),
                                     field=MultiModalBatchedField()),
        "n": MultiModalFieldElem(data=5, field=MultiModalBatchedField()),
    })
    sender = sv.ShmstoreSenderCache(make_config())
    try:
        assert sv.is_marker(sender.get_and_update_item((item, []), "odd")[0])
        got = sv.ShmstoreReceiverCache(make_config()).get_and_update_item(sv.marker_item(), "odd")
        assert got["empty"].data.shape == (0, 3) and got["empty"].data.dtype == torch.bfloat16
        assert got["n"].data == 5
    finally:
        sender.close()


def test_an_item_deleted_by_hand_while_its_request_runs_is_read_and_the_log_says_how_to_delete(
    store_env, caplog, monkeypatch
):
    from shmstore.vllm import instance

    monkeypatch.setattr(instance, "_logged", set())  # said once per process: this one
    sender = sv.ShmstoreSenderCache(make_config())
    try:
        for h in ("d1", "d2"):
            sender.get_and_update_item((float_item(16, 2.0), []), h)
        # The engine core's gate pins them (here: the sender's window); an operator
        # deletes them by hand.
        sender.store.delete("d1")
        sender.store.delete("d2")
        worker = sv.ShmstoreReceiverCache(make_config(), keep_fraction=0.0)
        for h in ("d1", "d2"):
            got = worker.get_and_update_item(sv.marker_item(), h)
            assert torch.equal(got["x"].data, torch.full((16,), 2.0))
        assert caplog.text.count("was deleted from") == 1, caplog.text
        assert "Store.delete_unpinned" in caplog.text
    finally:
        sender.close()


def test_an_item_of_exactly_the_budget_is_kept(store_env):
    sender = sv.ShmstoreSenderCache(make_config(cache_mb=64))
    try:
        sender.get_and_update_item((float_item(1 << 18), []), "one")
        sender.close()
        store = sender.store
        n = len(store.get("one"))
        worker = sv.ShmstoreReceiverCache(make_config(cache_mb=64), keep_fraction=n / (64 << 20))
        worker.get_and_update_item(sv.marker_item(), "one")
        assert store.stats()["pins"] == 1
        small = sv.ShmstoreReceiverCache(make_config(cache_mb=64), keep_fraction=(n - 1) / (64 << 20))
        small.get_and_update_item(sv.marker_item(), "one")
        assert store.stats()["pins"] == 1, "one byte over the budget: not kept"
    finally:
        sender.close()


# ----- registration with CUDA (faked: the real call runs in python/tests/test_cuda.py) ---


def test_the_switch_off_registers_nothing_even_with_a_gpu(store_env, monkeypatch):
    from shmstore.vllm import receiver as rv

    calls = []
    monkeypatch.setattr(rv.cuda, "gpu_visible", lambda: True)
    monkeypatch.setattr(rv.cuda, "register", lambda *a, **kw: calls.append(kw))
    monkeypatch.setenv("SHMSTORE_VLLM_CUDA_REGISTER", "0")
    worker = sv.ShmstoreReceiverCache(make_config())
    assert worker.cuda_device_known is None, "no registration thread"
    assert rv.register_with_cuda(worker.store, 0) is False and calls == []


@pytest.mark.parametrize("mode", ["auto", "1"])
def test_without_a_gpu_only_an_explicit_request_to_register_is_warned_about(
    store_env, monkeypatch, caplog, mode
):
    from shmstore.vllm import receiver as rv

    monkeypatch.setattr(rv.cuda, "gpu_visible", lambda: False)
    monkeypatch.setenv("SHMSTORE_VLLM_CUDA_REGISTER", mode)
    worker = sv.ShmstoreReceiverCache(make_config())
    assert worker.cuda_device_known is None
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "no GPU is visible" in r.message]
    assert len(warned) == (mode == "1"), caplog.text


def test_registration_waits_for_the_store_on_2_mib_pages(store_env, monkeypatch, caplog):
    # Registration pins every page, and the kernel cannot rebuild a pinned page.
    import threading

    from shmstore.vllm import receiver as rv

    rebuilt = threading.Event()
    calls = []
    monkeypatch.setattr(rv.cuda, "gpu_visible", lambda: True)
    monkeypatch.setattr(rv, "wait_for_huge_pages", lambda store: rebuilt.wait(60))
    monkeypatch.setattr(rv.cuda, "register", lambda store, **kw: calls.append(kw["device"]))
    monkeypatch.setenv("SHMSTORE_VLLM_CUDA_REGISTER", "auto")
    before = set(threading.enumerate())
    worker = sv.ShmstoreReceiverCache(make_config(cache_mb=512))  # 0.5 GiB: the log's figure
    worker.cuda_device = 1
    worker.cuda_device_known.set()  # as after the first read with CUDA initialised
    (thread,) = [t for t in set(threading.enumerate()) - before if t.name == "shmstore-cuda-register"]
    assert thread.daemon, "a worker exits without waiting for it"
    thread.join(0.2)
    assert thread.is_alive() and calls == [], "registered before the rebuild"
    caplog.set_level(logging.INFO, logger="shmstore.vllm")
    rebuilt.set()
    thread.join(60)
    assert calls == [1] and worker.cuda_registered
    said = re.search(r"registered the store's ([0-9.]+) GiB heap with CUDA on cuda:1 in ([0-9.]+) s",
                     caplog.text)
    assert said, caplog.text
    assert said[1] == f"{worker.store.heap_region[1] / (1 << 30):.1f}" and float(said[2]) < 30


def test_a_worker_that_cannot_register_says_why_and_copies_staged(store_env, monkeypatch, caplog):
    from shmstore.vllm import receiver as rv

    def refuse(store, **kw):
        raise RuntimeError("cudaHostRegister: out of memory (RLIMIT_MEMLOCK)")

    monkeypatch.setattr(rv.cuda, "gpu_visible", lambda: True)
    monkeypatch.setattr(rv.cuda, "register", refuse)
    monkeypatch.setenv("SHMSTORE_VLLM_CUDA_REGISTER", "auto")
    store = sv.open_store(make_config(cache_mb=512))
    assert rv.register_with_cuda(store, 0) is False
    assert "RLIMIT_MEMLOCK" in caplog.text and 'docs/vllm.md, "GPU copies"' in caplog.text
