"""Tests of shmstore.vllm against vLLM 0.34's own classes (run by scripts/vllm.sh test)."""

import json
import os
import subprocess
import sys
import sysconfig
import uuid

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from harness import setup_process  # noqa: E402

setup_process()


@pytest.fixture
def store_env(monkeypatch):
    """A fresh store name (and vLLM ring-buffer name) for one test; removed afterwards."""
    name = f"shmstore-vllm-test-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    monkeypatch.setenv("SHMSTORE_VLLM_STORE", name)
    monkeypatch.setenv("VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME", f"vllm-ring-{name}")
    monkeypatch.setenv("SHMSTORE_VLLM", "1")
    # The test's processes are processes of an instance whose launcher is elsewhere.
    monkeypatch.setenv("SHMSTORE_VLLM_LAUNCHER", "test")
    yield {
        "SHMSTORE_VLLM_STORE": name,
        "VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME": f"vllm-ring-{name}",
        "SHMSTORE_VLLM": "1",
        "SHMSTORE_VLLM_LAUNCHER": "test",
    }
    _assert_left_sound(f"/dev/shm/{name}")
    for f in (name, f"vllm-ring-{name}"):
        try:
            os.unlink(f"/dev/shm/{f}")
        except FileNotFoundError:
            pass


@pytest.fixture
def store(store_env):
    """The test instance's store, opened as vLLM's processes open it."""
    from harness import make_config

    from shmstore import vllm as sv

    return sv.open_store(make_config())


def _assert_left_sound(path: str) -> None:
    """Whatever a test did to its store (workers killed mid-request, front-ends killed and
    restarted, eviction around stalled readers, items deleted under readers), what it
    leaves must be sound once the dead are recovered: `shmstore recover` then `shmstore
    check`, the command the package installs (every invariant of the allocator and the
    table, and the counters against a full scan)."""
    cli = os.path.join(sysconfig.get_path("scripts"), "shmstore")
    for command in (["recover", path], ["check", path, "--json"]):
        out = subprocess.run([cli, *command], capture_output=True, text=True, timeout=60)
        if "no store at" in out.stderr:
            return  # the last process to leave removed it (remove_when_unused)
        assert out.returncode == 0, f"{path} after the test: {out.stdout} {out.stderr}"
    assert json.loads(out.stdout)["verdict"] == "sound", out.stdout
