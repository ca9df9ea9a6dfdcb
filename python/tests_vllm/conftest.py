"""Tests of shmstore.vllm against vLLM 0.34's own classes (run by scripts/vllm.sh test)."""

import os
import sys
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
    for f in (name, f"vllm-ring-{name}"):
        try:
            os.unlink(f"/dev/shm/{f}")
        except FileNotFoundError:
            pass
