"""shmstore.cuda: what it does on a machine without a GPU (this suite's machines), what it
does with one (those tests skip here, and run on a lent GPU machine through
scripts/gpu.sh), and waiting for the creator's 2 MiB pages. The GPU side is measured by
python/benchmarks/gpu_copy.py (docs/vllm.md, "GPU copies")."""

import importlib.util
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import shmstore
import shmstore.cuda as sc

from conftest import run_python


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


needs_gpu = pytest.mark.skipif(not sc.gpu_visible(), reason="no GPU is visible to torch")


def _tensor(n: int, seed: int):
    import torch

    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@needs_gpu
def test_with_a_gpu_registered_views_are_pinned_and_reach_the_gpu_exactly(store):
    import torch

    src = _tensor(3 << 18, 1)  # 3 MiB
    shmstore.put_item(store, "x", {"t": src})
    view = shmstore.get_item(store, "x", 1.0, as_torch=True)["t"]
    assert not view.is_pinned()
    sc.register(store)
    try:
        assert view.is_pinned(), "a registered heap's views count as pinned"
        got = view.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(got.cpu(), src)
    finally:
        sc.unregister(store)
    assert not view.is_pinned()


@needs_gpu
def test_with_a_gpu_registering_twice_names_the_cause_and_keeps_the_first(store):
    shmstore.put_item(store, "x", {"t": _tensor(1024, 2)})
    view = shmstore.get_item(store, "x", 1.0, as_torch=True)["t"]
    sc.register(store)
    try:
        with pytest.raises(sc.RegistrationFailed, match="already registered"):
            sc.register(store)
        assert view.is_pinned()
    finally:
        sc.unregister(store)
    with pytest.raises(sc.RegistrationFailed, match="has not registered"):
        sc.unregister(store)


@needs_gpu
def test_with_a_gpu_a_read_only_attach_registers_from_a_thread_on_the_given_device(
    store_name,
):
    # A worker's store is read-only, and the plugin registers from a background thread,
    # whose current device is 0 until set: register(device=...) runs in that device.
    creator = shmstore.Store.create(store_name, 32 << 20)
    src = _tensor(1 << 20, 3)
    shmstore.put_item(creator, "x", {"t": src})
    code = f"""
        import threading, torch, shmstore, shmstore.cuda as sc
        s = shmstore.Store.open({store_name!r}, read_only=True)
        view = shmstore.get_item(s, "x", 1.0, as_torch=True)["t"]
        dev = torch.cuda.device_count() - 1
        torch.cuda.set_device(dev)
        seen = []
        def run():
            sc.register(s, device=dev)
            seen.append(torch.cuda.current_device())
        t = threading.Thread(target=run); t.start(); t.join()
        got = view.to(dev, non_blocking=True); torch.cuda.synchronize()
        want = torch.randn(1 << 20, generator=torch.Generator().manual_seed(3))
        print(view.is_pinned(), torch.equal(got.cpu(), want), seen == [0])
    """
    out = run_python(code, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    # The thread's own current device stays its default: the registration ran in the
    # given device's context only for its own duration.
    assert out.stdout.split() == ["True", "True", "True"], out.stdout
    del creator


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


_BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu_copy.py")
# The wheel check (scripts/python.sh wheel) runs a copy of these tests alone, against the
# installed wheel: the benchmark, which is not part of the package, is not beside them.
needs_bench = pytest.mark.skipif(not os.path.exists(_BENCH), reason="python/benchmarks is not beside the tests")


@needs_bench
def test_the_gpu_benchmark_says_it_needs_a_gpu_and_measures_nothing_without_one():
    if sc.gpu_visible():
        pytest.skip("a GPU is visible: run the benchmark itself")
    out = subprocess.run([sys.executable, _BENCH], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "no GPU is visible to torch: nothing measured" in out.stdout


@needs_bench
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_the_gpu_benchmark_runs_through_with_cuda_faked_on_the_cpu(tmp_path):
    # Lent GPU machines are rare and their time short: this keeps the script from
    # breaking unseen. CUDA is faked with CPU stand-ins (a copy for pinning, the CPU
    # for the device); the figures mean nothing, the flow and the checks do.
    fake = f"""
import runpy, sys, torch
sys.path.insert(0, {os.path.join(os.path.dirname(__file__), "..")!r})
import shmstore.cuda as sc
sc.gpu_visible = lambda: True
sc.register = lambda store, read_only=True: None
sc.unregister = lambda store: None
torch.cuda.synchronize = lambda: None
torch.cuda.get_device_name = lambda i=0: "fake"
torch.Tensor.pin_memory = lambda self: self.clone()
torch.Tensor.is_pinned = lambda self: False
_device = torch.device
torch.device = lambda s: _device("cpu")
_new_empty = torch.Tensor.new_empty
torch.Tensor.new_empty = lambda self, *a, pin_memory=False, **k: _new_empty(self, *a, **k)
sys.argv = ["gpu_copy.py", "--reps", "2", "--register-gib", "0.0625", "--json", {str(tmp_path / "gpu.json")!r}]
runpy.run_path({_BENCH!r}, run_name="__main__")
"""
    out = subprocess.run([sys.executable, "-c", fake], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-2000:])
    assert "every copy equals its source" in out.stdout, out.stdout
    figures = json.loads((tmp_path / "gpu.json").read_text())
    assert set(figures["rows"]) == {"image", "video", "large"}
    for row in figures["rows"].values():
        assert {"floor", "vllm_shm", "view", "view_staged", "registered"} <= set(row)
    assert [r["gib"] for r in figures["registration"]] == [0.0625]
