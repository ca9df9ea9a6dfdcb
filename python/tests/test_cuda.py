"""shmstore.cuda: what it does on a machine without a GPU (this suite's machines), and
waiting for the creator's 2 MiB pages. The GPU side is measured by
python/benchmarks/gpu_copy.py on a machine with one (docs/vllm.md, "GPU copies")."""

import time

import numpy as np
import pytest

import shmstore
import shmstore.cuda as sc


def test_without_a_gpu_registration_raises_a_typed_error_and_changes_nothing(store):
    if sc.gpu_visible():
        pytest.skip("a GPU is visible: python/benchmarks/gpu_copy.py exercises registration")
    shmstore.put_item(store, "x", {"a": np.full(4096, 1, np.uint8)})
    before = store.stats()
    with pytest.raises(sc.CudaUnavailable, match="no GPU is visible"):
        sc.register(store)
    with pytest.raises(sc.CudaUnavailable):
        sc.unregister(store)
    after = store.stats()
    assert (after["objects"], after["pins"]) == (before["objects"], before["pins"])
    assert (shmstore.get_item(store, "x", 1.0)["a"] == 1).all()


def test_waiting_for_huge_pages_returns_what_the_store_reports(store_name):
    s = shmstore.Store.create(store_name, 16 << 20)
    done = sc.wait_for_huge_pages(s, limit_s=30)
    st = s.stats()
    assert done == (st["page_size"] == 2 << 20), st
    if done:
        assert st["huge_page_bytes"] == st["capacity"] // (2 << 20) * (2 << 20)


def test_a_store_never_rebuilt_is_not_waited_for_past_the_stall(store_name):
    s = shmstore.Store.create(store_name, 8 << 20, huge_pages="off")
    t = time.monotonic()
    assert sc.wait_for_huge_pages(s, stalled_s=0.2) is False
    assert time.monotonic() - t < 5
