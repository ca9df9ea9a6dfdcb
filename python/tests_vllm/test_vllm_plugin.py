"""Activation through vLLM's plugin entry point and factories, lifecycle of the store,
CUDA registration skipped cleanly without a GPU."""

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
from harness import make_config

import shmstore
from shmstore import vllm as sv


def run(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
        cwd=os.path.dirname(__file__),
    )


def test_the_entry_point_is_registered():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert any(ep.value == "shmstore.vllm:register" for ep in eps)


def test_vllms_factories_return_shmstores_caches_also_where_vllm_switches_ipc_off(store_env):
    r = run(
        """
        from harness import make_config, setup_process
        setup_process()
        from vllm.plugins import load_general_plugins
        load_general_plugins(); load_general_plugins()            # loaded more than once
        import shmstore.vllm as sv; sv.register(); sv.register()
        from vllm.multimodal import cache
        from vllm.multimodal.cache import factories
        for dp, api in ((1, 1), (2, 1), (1, 3)):                  # DP and several API servers
            c = make_config(data_parallel=dp, api_servers=api)
            s = cache.processor_cache_from_config(c)
            assert type(s).__name__ == "ShmstoreSenderCache", (dp, api, s)
            assert factories.engine_receiver_cache_from_config(c) is None
            w = factories.worker_receiver_cache_from_config(c, None)
            assert type(w).__name__ == "ShmstoreReceiverCache"
            s.close()
        c = make_config(); c.model_config.get_multimodal_config().mm_processor_cache_type = "lru"
        assert type(factories.processor_cache_from_config(c)).__name__ == "LruKeyReplicatedSenderCache"
        print("ok")
        """,
        store_env,
    )
    assert r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_without_the_switch_vllm_keeps_its_own_cache(store_env):
    env = {**store_env, "SHMSTORE_VLLM": ""}
    r = run(
        """
        from harness import make_config, setup_process
        setup_process()
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.multimodal.cache import factories
        s = factories.processor_cache_from_config(make_config())
        print(type(s).__name__)
        s.close()
        """,
        env,
    )
    assert r.stdout.strip().endswith("ShmObjectStoreSenderCache"), r.stderr[-3000:]


def test_multi_node_setups_without_ray_keep_vllms_cache_unless_forced(store_env, monkeypatch):
    c = make_config()
    c.parallel_config.nnodes = 2
    assert not sv.applies(c)
    monkeypatch.setenv("SHMSTORE_VLLM", "force")
    assert sv.applies(c)
    monkeypatch.setenv("SHMSTORE_VLLM", "1")
    c.parallel_config.nnodes = 1
    # Ray's executor: workers on other nodes fetch through shmstore.ray, if Ray is there
    # (python/tests_ray runs them); without Ray, vLLM's own cache.
    c.parallel_config.distributed_executor_backend = "ray"
    assert sv.applies(c) == (importlib.util.find_spec("ray") is not None)
    monkeypatch.setattr(sv.importlib.util, "find_spec", lambda name: None)
    assert not sv.applies(c)


def test_the_store_is_named_once_per_instance_and_removed_at_clean_shutdown(monkeypatch):
    monkeypatch.delenv("SHMSTORE_VLLM_STORE", raising=False)
    name = sv.store_name()
    assert name.startswith(f"shmstore-vllm-{os.getpid()}-")
    assert sv.store_name() == name == os.environ["SHMSTORE_VLLM_STORE"]  # children inherit it
    sender = sv.ShmstoreSenderCache(make_config())
    receiver = sv.ShmstoreReceiverCache(make_config())
    assert os.path.exists(f"/dev/shm/{name}")
    sender.close()
    del sender, receiver
    import gc

    gc.collect()
    assert not os.path.exists(f"/dev/shm/{name}"), "removed when its last process left"


def test_a_store_left_by_a_crashed_instance_is_removed_at_the_next_start(store_env):
    # Two crashed instances: one of this shmstore, one of an older version (after an
    # upgrade, its store cannot be opened any more, but must not leak either).
    crashed = f"shmstore-vllm-999999-{os.getpid()}"
    older = f"shmstore-vllm-999998-{os.getpid()}"
    for name in (crashed, older):
        r = run(
            """
            import os, shmstore
            s = shmstore.Store.create(os.environ["CRASHED"], 1 << 20)
            s.put("x", b"y")
            os._exit(0)   # no cleanup: as if killed
            """,
            {"CRASHED": name},
        )
        assert r.returncode == 0, r.stderr
        assert os.path.exists(f"/dev/shm/{name}")
    with open(f"/dev/shm/{older}", "r+b") as f:
        f.seek(8)
        f.write((3).to_bytes(4, "little"))  # the layout version field
    with pytest.raises(shmstore.Corrupted, match="version"):
        shmstore.Store.open(older)
    live = sv.open_store(make_config())  # this test's store, in use: must stay
    removed = sv.remove_stale_stores()
    assert {crashed, older} <= set(removed)
    assert not os.path.exists(f"/dev/shm/{crashed}")
    assert not os.path.exists(f"/dev/shm/{older}")
    assert os.path.exists(f"/dev/shm/{store_env['SHMSTORE_VLLM_STORE']}")
    del live


def test_cuda_registration_is_skipped_cleanly_without_a_gpu(store_env, monkeypatch, caplog):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: see the device benchmark in docs/vllm.md")
    for mode in ("auto", "1", "0"):
        monkeypatch.setenv("SHMSTORE_VLLM_CUDA_REGISTER", mode)
        r = sv.ShmstoreReceiverCache(make_config())
        assert r.cuda_registered is False
        del r
    assert any("no GPU is visible" in rec.message for rec in caplog.records)


def test_the_store_figures_appear_in_the_registry_vllm_serves(store_env):
    from prometheus_client import REGISTRY, generate_latest

    sender = sv.ShmstoreSenderCache(make_config())
    text = generate_latest(REGISTRY).decode()
    name = store_env["SHMSTORE_VLLM_STORE"]
    assert f'shmstore_capacity_bytes{{store="{name}"}}' in text, text[:2000]
    # A second cache in the same process replaces the first one's collector: no
    # duplicate-series error, one series per name.
    sender2 = sv.ShmstoreSenderCache(make_config())
    text = generate_latest(REGISTRY).decode()
    assert text.count(f'shmstore_objects{{store="{name}"}}') == 1
    del sender, sender2
