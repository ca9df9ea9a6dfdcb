"""Actors of the Ray tests, importable by Ray's workers (conftest puts this directory on
their PYTHONPATH)."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import numpy as np
import ray

import shmstore
from shmstore.ray import NodeStores


def wait_until(what, cond, timeout: float = 30.0):
    """Polls ``cond()`` (a state another process reaches) until it is truthy."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def digest(item: dict[str, Any]) -> str:
    """Names, dtypes, shapes and bytes of an item's arrays, and its metadata."""
    h = hashlib.sha256()
    for name in sorted(item):
        v = item[name]
        if name == "__meta__":
            h.update(repr(sorted(v.items())).encode())
            continue
        a = np.asarray(v)
        h.update(f"{name}:{a.dtype}:{a.shape}".encode())
        h.update(np.ascontiguousarray(a).view(np.uint8).tobytes())
    return h.hexdigest()


def make_item(seed: int, nbytes: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    n = max(1, nbytes // 4)
    return {
        "pixel_values": rng.standard_normal(n, dtype=np.float32).reshape(-1, 1),
        "grid": np.array([seed, 2, 3], dtype=np.int64),
        "__meta__": {"seed": seed},
    }


def put(nodes: NodeStores, key: str, item: dict[str, Any]) -> None:
    arrays = {k: v for k, v in item.items() if k != "__meta__"}
    shmstore.put_item(nodes.store(), key, arrays, item.get("__meta__"))


@ray.remote(num_cpus=0, max_concurrency=4)
class Rank:
    """A worker rank: reads items through its node's store. ``phase()`` (answered while
    a read runs) says where the last ``try_read`` is."""

    def __init__(self, nodes: NodeStores) -> None:
        self.nodes = nodes
        self._phase = "idle"

    def phase(self) -> str:
        return self._phase

    def node(self) -> str:
        return self.nodes.this_node()

    def read(self, keys: list[str], timeout: float | None = None) -> dict[str, str]:
        return {k: digest(self.nodes.get_item(k, timeout)) for k in keys}

    def try_read(self, keys: list[str], timeout: float | None = None) -> tuple[str, Any]:
        """("ok", digests) or (error class name, the keys it names or its message)."""
        try:
            self._phase = "fetching"
            self.nodes.ensure_local(keys)
            self._phase = "reading"  # the fetch returned: the items exist here
            return "ok", {k: digest(self.nodes.get_item(k, timeout)) for k in keys}
        except shmstore.ShmstoreError as e:
            return type(e).__name__, getattr(e, "keys", str(e))
        finally:
            self._phase = "idle"


@ray.remote(num_cpus=0)
class Producer:
    """Puts items on the node it runs on (the source node)."""

    def __init__(self, nodes: NodeStores) -> None:
        self.nodes = nodes

    def node(self) -> str:
        return self.nodes.this_node()

    def put(self, key: str, seed: int, nbytes: int) -> str:
        item = make_item(seed, nbytes)
        put(self.nodes, key, item)
        return digest(item)

    def stored_bytes(self, key: str) -> int:
        return self.nodes.store().get(key).nbytes

    def delete(self, key: str) -> None:
        self.nodes.store().delete(key)
