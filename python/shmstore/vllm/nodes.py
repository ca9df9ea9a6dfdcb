"""Workers on other machines, with vLLM's Ray executor: each node's store (through
``shmstore.ray``) and the engine core's ``ShmstorePrefetcher``, which starts moving a
request's new items to the other nodes as the request arrives.

Invariant: a prefetch is only ever an optimization; a worker's own read fetches what its
node lacks.
"""

from __future__ import annotations

import collections
import os
import sys
from typing import Any

from typing_extensions import override

from vllm.multimodal.cache.base import BaseMultiModalReceiverCache
from vllm.multimodal.inputs import MultiModalFeatureSpec

from .gate import PassThroughCache, ShmstoreEngineGate
from .instance import _capacity, _log_once, store_name
from .item_format import is_marker

def _ray_backend(vllm_config) -> bool:
    pc = getattr(vllm_config, "parallel_config", None)
    return getattr(pc, "distributed_executor_backend", None) == "ray"


def _node_stores(vllm_config):
    """The instance's ``shmstore.ray.NodeStores`` in a process where Ray's executor
    started Ray (the engine core, the workers), else None."""
    if not _ray_backend(vllm_config) or "ray" not in sys.modules:
        return None
    import ray

    if not ray.is_initialized():
        return None
    from ..ray import NodeStores

    capacity = _capacity(vllm_config)
    return NodeStores(
        store_name(),
        capacity,
        source_node=os.environ.get("SHMSTORE_VLLM_SOURCE_NODE") or None,
        max_objects=max(1 << 16, capacity >> 16),
        read_only=os.environ.get("SHMSTORE_VLLM_READ_ONLY", "1") != "0",
        # The engine core's gate pins every admitted request's items at the source: an
        # item deleted there by hand meanwhile still reaches workers on other nodes.
        fetch_draining=True,
    )


def _remote_node_stores(vllm_config):
    """``shmstore.ray.NodeStores`` for a worker that Ray's executor runs on a node other
    than the front-end's, else None."""
    nodes = _node_stores(vllm_config)
    return None if nodes is None or nodes.this_node() == nodes.source() else nodes


class ShmstorePrefetcher(PassThroughCache):
    """The engine-core cache with Ray's executor on several nodes. It passes every
    feature on unchanged; for each item it has not seen yet, it asks the bridges of the
    other nodes to fetch it now, as the request arrives (``NodeStores.prefetch``: one
    call per node for all of a request's new items, not waited for).

    vLLM's workers read a request's items when the request is scheduled, after the step
    running at the time: by then each item is in the worker's node store, or on its way
    (the worker then waits for its seal instead of asking its bridge), so a remote
    worker's first read costs about what a hit does (docs/multinode.md has the figures).
    A late or failed prefetch costs nothing but what it would have saved: the workers'
    own reads fetch what their node lacks, as without it. Items it has seen are
    remembered (the last ``remember``), so that a cache hit in the front-end, which
    sends the same marker again, costs no call.

    On the front-end's node it first admits the request through ``gate`` (the
    ``ShmstoreEngineGate``): an item the front-end's store no longer holds is a miss
    here, where vLLM recovers from it, and the items of admitted requests stay pinned
    at the source until the engine core drops the request, so that no bridge finds
    them gone.
    """

    def __init__(
        self, nodes: Any, *, remember: int = 1 << 16, gate: ShmstoreEngineGate | None = None
    ) -> None:
        super().__init__()
        self.nodes = nodes
        self.remember = remember
        self.gate = gate
        self.seen: collections.OrderedDict[str, None] = collections.OrderedDict()

    @override
    def get_and_update_features(
        self, mm_features: list[MultiModalFeatureSpec]
    ) -> list[MultiModalFeatureSpec]:
        if self.gate is not None:
            self.gate.admit(mm_features)
        keys = []
        for f in mm_features:
            if f.data is None or not is_marker(f.data):
                continue  # covered by prefix caching, or sent inline
            key = f.mm_hash or f.identifier
            if key in self.seen:
                self.seen.move_to_end(key)
                continue
            self.seen[key] = None
            keys.append(key)
        while len(self.seen) > self.remember:
            self.seen.popitem(last=False)
        if keys:
            try:
                self.nodes.prefetch(keys)
            except Exception as e:  # noqa: BLE001 - an optimization: workers fetch anyway
                _log_once("prefetch", f"shmstore: prefetch failed ({e}); workers fetch items themselves")
        return mm_features

    @override
    def clear_cache(self) -> None:
        self.seen.clear()


def engine_cache(vllm_config) -> BaseMultiModalReceiverCache | None:
    """The engine core's cache (vLLM's engine-side receiver slot): the
    ``ShmstoreEngineGate`` where the engine core runs on the front-end's machine (always,
    without Ray's executor), with Ray's executor on several nodes the
    ``ShmstorePrefetcher`` around it (``engine_prefetcher``), and None on another node
    without a prefetcher."""
    nodes = _node_stores(vllm_config)
    gate = None
    if nodes is None or nodes.this_node() == nodes.source():
        gate = ShmstoreEngineGate(vllm_config)
    prefetcher = engine_prefetcher(vllm_config, nodes=nodes, gate=gate)
    return prefetcher if prefetcher is not None else gate


def engine_prefetcher(
    vllm_config, *, nodes: Any = None, gate: ShmstoreEngineGate | None = None
) -> ShmstorePrefetcher | None:
    """The engine core's prefetcher when Ray's executor spans several nodes (Ray is up
    in the engine core: the executor started it), unless ``SHMSTORE_VLLM_PREFETCH=0``;
    None otherwise. ``gate`` admits each request first (on the front-end's node)."""
    if os.environ.get("SHMSTORE_VLLM_PREFETCH", "1") == "0":
        return None
    if nodes is None:
        nodes = _node_stores(vllm_config)
    if nodes is None:
        return None
    import ray

    if sum(1 for n in ray.nodes() if n["Alive"]) < 2:
        return None
    _log_once(
        "prefetch",
        "shmstore: the engine core prefetches each request's items into the stores of "
        "the other nodes as the request arrives (SHMSTORE_VLLM_PREFETCH=0 turns it off)",
    )
    return ShmstorePrefetcher(nodes, gate=gate)
