"""The store of one vLLM instance: its name (inherited by every process the instance
starts), its directory, creating or attaching to it, removing stores that crashed
instances left, and exporting its figures to vLLM's ``/metrics``.

Invariants: one store per instance, named with the launcher's pid and a random part (no
clash between instances); a store some live process is attached to is never removed.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from typing import Any

from .. import _native

logger = logging.getLogger("shmstore.vllm")  # one logger for the whole plugin

_PREFIX = "shmstore-vllm-"


def store_name() -> str:
    """This vLLM instance's store name: ``SHMSTORE_VLLM_STORE``, set by the first process
    that asks (the launcher, when the plugin loads) and inherited by every process it
    starts, forked or spawned."""
    name = os.environ.get("SHMSTORE_VLLM_STORE")
    if not name:
        name = f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.environ["SHMSTORE_VLLM_STORE"] = name
    return name


def store_dir() -> str:
    """The directory of this instance's store: ``SHMSTORE_VLLM_DIR``, default /dev/shm."""
    return os.environ.get("SHMSTORE_VLLM_DIR") or "/dev/shm"


def store_path() -> str:
    """The path of this instance's store (``store_dir()`` / ``store_name()``)."""
    return os.path.join(store_dir(), store_name())


def remove_stale_stores(directory: str | None = None) -> list[str]:
    """Removes stores left by vLLM instances that crashed: every ``shmstore-vllm-*``
    store no live process is attached to, including stores of an older shmstore version
    (after an upgrade they cannot be opened, only removed). Returns the names removed. A
    store in use is never touched: every attached process holds a lock on a byte of the
    file, which the kernel drops when it dies (``Store.remove_if_unused``).
    """
    directory = directory or store_dir()
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        current = os.environ.get("SHMSTORE_VLLM_STORE")
        if not name.startswith(_PREFIX) or (
            current and (name == current or name.startswith(f"{current}-node-"))
        ):
            continue  # not ours, or this instance's (its store, or a node store of it)
        try:
            if _native.Store.remove_if_unused(os.path.join(directory, name)):
                removed.append(name)
        except (_native.ShmstoreError, OSError):
            continue  # not a store, or just removed by another instance
    if removed:
        logger.info("shmstore: removed %d store(s) left by crashed vLLM instances: %s",
                    len(removed), ", ".join(removed))
    return removed


def _page_kind(stats: dict) -> str:
    """How the store's pages are backed, for the log: "4 KiB", "2 MiB transparent
    huge", "2 MiB hugetlb"."""
    size = stats["page_size"]
    label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
    if stats["huge_pages"]:
        return f"{label} transparent huge"
    return f"{label} hugetlb" if size > 4096 else label


def _capacity(vllm_config) -> int:
    mm_config = vllm_config.model_config.get_multimodal_config()
    return int(mm_config.mm_processor_cache_gb * (1 << 30))


def open_store(vllm_config, *, read_only: bool = False) -> _native.Store:
    """Attaches to this instance's store, creating it (evicting, removed when its last
    process leaves) if this process is the first."""
    name = store_path()
    capacity = _capacity(vllm_config)
    for _ in range(3):
        try:
            # Front-ends and workers attach long before they use most of the store: map
            # it in the background so that their first accesses run warm.
            return _native.Store.open(name, read_only=read_only, populate_in_background=True)
        except _native.StoreNotFound:
            pass
        try:
            try:
                s = _native.Store.create(
                    name,
                    capacity,
                    max_objects=max(1 << 16, capacity >> 16),
                    max_clients=256,
                    evict=True,
                    remove_when_unused=True,
                    prefault=False,
                    huge_pages="off" if os.environ.get("SHMSTORE_VLLM_HUGE_PAGES") == "off" else "auto",
                )
            except _native.InsufficientSpace as e:
                # The capacity is vLLM's setting: say which one, and the usual fixes.
                gb = vllm_config.model_config.get_multimodal_config().mm_processor_cache_gb
                raise _native.InsufficientSpace(
                    f"{e}. vLLM sets the capacity: --mm-processor-cache-gb={gb:g}. Lower "
                    "it, run the container with --shm-size=<size> or --ipc=host, or set "
                    "SHMSTORE_VLLM_DIR to a tmpfs with room"
                ) from None
            st = s.stats()
            logger.info(
                "shmstore: multimodal cache in %s (%.1f GiB, %s pages, shared by every "
                "front-end and worker of this vLLM instance)", name, capacity / (1 << 30),
                _page_kind(st))
            if st["page_size"] <= 4096:
                logger.info(
                    "shmstore: this process rebuilds the store's pages as 2 MiB pages in "
                    "the background where the kernel allows it (Linux 6.1 and later): "
                    "workers then map 512x fewer page-table entries. `shmstore stat %s` "
                    "shows how far it got; on older kernels mount a tmpfs with "
                    "huge=within_size and set SHMSTORE_VLLM_DIR to it (docs/vllm.md, "
                    "\"Huge pages\")", name)
            if not read_only:
                return s
            ro = _native.Store.open(name, read_only=True, populate_in_background=True)
            # A worker created the store: its writable handle goes once it has finished
            # rebuilding the pages (which only the creator does; `prefault` finishes it
            # now), on a thread, so this worker starts at once. It goes after the
            # read-only attach: the store is removed when unused.
            threading.Thread(target=_finish_rebuild_and_drop, args=([s],),
                             name="shmstore-rebuild").start()
            del s
            return ro
        except _native.StoreExists:
            pass
    return _native.Store.open(name, read_only=read_only, populate_in_background=True)


def _finish_rebuild_and_drop(holder: list) -> None:
    holder[0].prefault()
    holder.clear()


_logged: set[str] = set()
_metrics: Any = None  # the collector registered by _export_metrics


def _export_metrics(store: _native.Store) -> None:
    """Adds the store's figures to prometheus_client's default registry, which vLLM serves
    at ``/metrics`` (names in docs/metrics.md). One collector per process: a new sender
    cache replaces the previous one's. The collector holds the store weakly."""
    global _metrics
    try:
        from prometheus_client import REGISTRY

        from .. import prometheus
    except ImportError:
        _log_once("metrics", "shmstore: prometheus_client is not installed; no metrics")
        return
    if _metrics is not None:
        try:
            REGISTRY.unregister(_metrics)
        except KeyError:
            pass
    try:
        _metrics = prometheus.register(store)
    except ValueError as e:  # the names are taken by a collector of someone else's
        _metrics = None
        _log_once("metrics", f"shmstore: metrics not exported: {e}")


def _log_once(key: str, msg: str) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.info(msg)
