"""Activation: the ``vllm.general_plugins`` entry point, which makes vLLM's three cache
factories return shmstore's caches when ``SHMSTORE_VLLM`` is set (whether the instance
asks for vLLM's ``shm`` cache type or keeps its default), and the checks of when that
applies.

Invariant: without the switch, or with the cache off (size 0), vLLM is unchanged;
loading the plugin again in a process changes nothing.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

from . import TESTED_VLLM, enabled, vllm_version
from .instance import (
    _log_once,
    is_launcher,
    mark_launcher,
    remove_at_exit,
    remove_stale_stores,
    store_name,
    use_vllm_logging,
)
from .nodes import _ray_backend, engine_cache
from .receiver import ShmstoreReceiverCache
from .sender import ShmstoreSenderCache

logger = logging.getLogger("shmstore.vllm")


#: The cache types shmstore takes the place of: vLLM's shared-memory cache, and its
#: default (``lru``), so that ``SHMSTORE_VLLM=1`` alone is the switch.
_TAKES_OVER = ("shm", "lru")


def applies(vllm_config) -> bool:
    """Whether shmstore takes this vLLM instance's multimodal cache: ``SHMSTORE_VLLM``
    set, a multimodal model, a cache size above 0 (``--mm-processor-cache-gb 0`` keeps
    vLLM's cache off), the ``shm`` cache type or vLLM's default, and every worker on
    this machine (unless ``SHMSTORE_VLLM=force``)."""
    if not enabled():
        return False
    model_config = vllm_config.model_config
    if model_config is None or not model_config.supports_multimodal_inputs:
        return False
    mm_config = model_config.get_multimodal_config()
    if mm_config.mm_processor_cache_gb <= 0:
        if is_launcher():
            _log_once("off", "shmstore: --mm-processor-cache-gb 0 turns vLLM's multimodal "
                      "cache off, and shmstore's with it: items go to the workers inline, "
                      "no store")
        return False
    if mm_config.mm_processor_cache_type not in _TAKES_OVER:
        return False
    if os.environ.get("SHMSTORE_VLLM", "").lower() == "force":
        return True
    pc = vllm_config.parallel_config
    if _ray_backend(vllm_config):
        if importlib.util.find_spec("ray") is not None:
            _log_once(
                "ray",
                "shmstore: Ray executor: workers on other nodes read items through their "
                "node's store, fetched once per node (shmstore.ray)",
            )
            return True
        _log_once("ray", "shmstore: Ray executor but ray is not importable; using vLLM's own cache")
        return False
    multi_node = getattr(pc, "nnodes", 1) > 1 or getattr(
        pc, "data_parallel_size_local", 1
    ) < getattr(pc, "data_parallel_size", 1)
    if multi_node:
        _log_once(
            "multinode",
            "shmstore: workers may run on other machines (nnodes or remote data-parallel "
            "ranks without Ray); using vLLM's own cache. SHMSTORE_VLLM=force overrides.",
        )
        return False
    return True


def register() -> None:
    """Makes vLLM's cache factories return shmstore's caches, with ``SHMSTORE_VLLM`` set
    (``shmstore.vllm.register``, the entry point, calls it). Safe to call any number of
    times, in any process (vLLM loads plugins in every one). Raises ``ImportError`` or
    ``AttributeError`` before changing anything if a hook is missing from this vLLM."""
    if not enabled():
        return
    import vllm.multimodal.cache as pkg
    import vllm.multimodal.cache.factories as factories

    if getattr(factories, "_shmstore_patched", False):
        return
    use_vllm_logging()
    # The first process of the instance (the launcher) speaks for the instance (the
    # processes it starts would repeat its warning) and owns its store's lifecycle.
    launcher = mark_launcher()
    version = vllm_version()
    if version != TESTED_VLLM and launcher:
        logger.warning(
            "shmstore: this is vLLM %s; the plugin is written and tested for vLLM %s. It "
            "hooks in the same way; if workers report missing items or vLLM fails, unset "
            "SHMSTORE_VLLM or install vllm==%s", version, TESTED_VLLM, TESTED_VLLM)
    if launcher:
        # Name the store for every process it starts (unless the operator named it),
        # clean up after instances that crashed, and remove this instance's store when
        # it exits.
        store_name()
        remove_stale_stores()
        remove_at_exit()
    orig_processor = factories.processor_cache_from_config
    orig_engine = factories.engine_receiver_cache_from_config
    orig_worker = factories.worker_receiver_cache_from_config

    def processor_cache_from_config(vllm_config):
        if applies(vllm_config):
            return ShmstoreSenderCache(vllm_config)
        return orig_processor(vllm_config)

    def engine_receiver_cache_from_config(vllm_config):
        if applies(vllm_config):
            return engine_cache(vllm_config)
        return orig_engine(vllm_config)

    def worker_receiver_cache_from_config(vllm_config, shared_worker_lock=None):
        if applies(vllm_config):
            return ShmstoreReceiverCache(vllm_config, shared_worker_lock)
        return orig_worker(vllm_config, shared_worker_lock)

    patched = {
        "processor_cache_from_config": processor_cache_from_config,
        "engine_receiver_cache_from_config": engine_receiver_cache_from_config,
        "worker_receiver_cache_from_config": worker_receiver_cache_from_config,
    }
    # The factories' module, the package that re-exports them, and every module that
    # imported them by name already (the others import the patched names later).
    for mod in (factories, pkg, *(sys.modules.get(m) for m in (
        "vllm.renderers.base", "vllm.v1.engine.core", "vllm.v1.worker.worker_base"))):
        if mod is None:
            continue
        for name, fn in patched.items():
            if hasattr(mod, name):
                setattr(mod, name, fn)
    factories._shmstore_patched = True
    _log_once("on", f"shmstore: vLLM multimodal cache plugin active (store {store_name()})")
