"""P1, the workers: ``ShmstoreReceiverCache``, which turns markers back into the stored
items as zero-copy torch tensors, and registers the store with CUDA when a GPU is there.

Invariants: a returned tensor pins its object while it lives; a missing item raises
vLLM's ``MultiModalCacheMissError``, never a wrong item (the engine core's gate pinned
every item a worker is asked for, so none can be missing on the front-end's machine:
an item deleted by hand while its request runs is read as draining,
``Store.get_draining``; vLLM treats a worker's miss as a failed step); the items kept
for hits stay within their byte budget.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Any

import torch
from typing_extensions import override

from vllm.multimodal.cache.base import BaseMultiModalReceiverCache, MultiModalCacheMissError
from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem

from .. import _native, cuda
from ..cuda import wait_for_huge_pages
from .instance import _log_once, open_store, remove_stale_stores
from .item_format import _ITEMSIZE, decode_item, is_marker
from .nodes import _remote_node_stores

logger = logging.getLogger("shmstore.vllm")  # one logger for the whole plugin

class ShmstoreReceiverCache(BaseMultiModalReceiverCache):
    """The worker (P1) cache: markers become the stored items, zero-copy.

    The returned tensors are views of the shared object and keep it pinned while they
    live. vLLM keeps a request's ``mm_features`` until the request finishes (and the
    encoder cache holds the encoder's outputs, not these tensors), so an item is pinned
    by a worker while a request that uses it is running there.

    The worker also keeps the items it read most recently, up to ``keep_fraction`` of the
    store's bytes (``SHMSTORE_VLLM_WORKER_KEEP``), and answers a cache hit on one of them
    with the same ``MultiModalKwargsItem`` (as vLLM's ``lru`` receiver does with its
    mirrored items): no lookup, no new views. Kept items stay pinned, so the store cannot
    evict them; the bound keeps the rest of the store evictable, and the least recently
    used item is let go first.
    """

    def __init__(
        self,
        vllm_config,
        shared_worker_lock=None,
        *,
        timeout: float = 10.0,
        keep_fraction: float | None = None,
    ) -> None:
        super().__init__()
        read_only = os.environ.get("SHMSTORE_VLLM_READ_ONLY", "1") != "0"
        #: With Ray's executor on a node other than the front-end's: this node's stores
        #: and bridge (shmstore.ray); None otherwise.
        self.nodes = _remote_node_stores(vllm_config)
        if self.nodes is not None:
            remove_stale_stores()  # left on this node by crashed instances
            self.store = self.nodes.store()
            logger.info(
                "shmstore: worker on Ray node %s, not the front-end's (%s): items come "
                "through this node's store /dev/shm/%s, fetched once per node",
                self.nodes.this_node()[:12], self.nodes.source()[:12], self.nodes.store_name())
        else:
            self.store = open_store(vllm_config, read_only=read_only)
        self.timeout = timeout
        #: Whether this worker registered the store's heap with CUDA (set by a background
        #: thread once the store's pages are rebuilt; see ``register_with_cuda_later``).
        self.cuda_registered = False
        #: Set once this worker's first read found CUDA initialised; the device it uses.
        self.cuda_device_known: threading.Event | None = None
        self.cuda_device: int | None = None
        register_with_cuda_later(self)
        if keep_fraction is None:
            keep_fraction = float(os.environ.get("SHMSTORE_VLLM_WORKER_KEEP", "0.125"))
        #: Items of the request being read that this node's store could not take
        #: (Ray, another node than the front-end's): read past it (``_read``).
        self._past_node: set[str] = set()
        #: Items kept ready for hits: mm_hash -> (item, its bytes), least recent first.
        self._kept: collections.OrderedDict[str, tuple[MultiModalKwargsItem, int]] = (
            collections.OrderedDict())
        self._kept_bytes = 0
        # Workers of one data-parallel rank read the same items and mostly keep the same
        # ones; ranks read different requests: the fraction is shared among the ranks.
        ranks = max(1, int(getattr(vllm_config.parallel_config, "data_parallel_size", 1) or 1))
        self._keep_budget = int(
            self.store.stats()["capacity"] * max(0.0, keep_fraction) / ranks)

    @override
    def get_and_update_features(
        self, mm_features: list[MultiModalFeatureSpec]
    ) -> list[MultiModalFeatureSpec]:
        # data=None: prefix caching covered the item; there is nothing to read.
        present = [f for f in mm_features if f.data is not None]
        if self.nodes is not None:
            self._past_node.clear()
            self._bring_to_node([f.mm_hash or f.identifier for f in present if is_marker(f.data)])
        try:
            super().get_and_update_features(present)
        except MultiModalCacheMissError as e:
            logger.error(
                "shmstore: this worker cannot find items %s in %s, neither stored nor "
                "deleted while pinned, although the engine core's gate pins every item "
                "of a request it admits: does this worker run on a machine other than "
                "the front-end's (SHMSTORE_VLLM=force without Ray), or did the engine "
                "core not run shmstore's gate (a vLLM that skips its engine-side cache)? "
                "vLLM stops on a miss in a worker", e.mm_hashes, self.store.path)
            raise
        return mm_features

    @override
    def get_and_update_item(
        self, mm_item: MultiModalKwargsItem | None, mm_hash: str
    ) -> MultiModalKwargsItem:
        if not is_marker(mm_item):
            assert mm_item is not None, f"Expected an item for {mm_hash=}"
            return mm_item  # sent inline
        kept = self._kept.get(mm_hash)
        if kept is not None:
            self._kept.move_to_end(mm_hash)
            return kept[0]
        try:
            arrays, nbytes = self._read(mm_hash)
        except (_native.NotFound, _native.CreatorDied, _native.Timeout):
            raise MultiModalCacheMissError([mm_hash]) from None
        item = decode_item(arrays)
        self._keep(mm_hash, item, nbytes)
        if self.cuda_device_known is not None and not self.cuda_device_known.is_set():
            note_cuda_device(self)
        return item

    def _bring_to_node(self, keys: list[str]) -> None:
        """On a Ray node other than the front-end's: brings a request's items into this
        node's store, in one round trip. What the node's store cannot take now (full of
        pinned items) is read past it, into this worker's memory (``_read``): a miss in
        a worker would stop vLLM, and the engine core's gate keeps the items at the
        source until the request is done. Only items the source lacks are a miss."""
        from ..ray import FetchFailed, ItemsMissing

        try:
            self.nodes.ensure_local(keys)
        except FetchFailed as e:
            self._past_node.update(str(k) for k in e.keys)
            _log_once("node-store-full", (
                f"shmstore: this node's store cannot take items now ({e}); this worker "
                "reads them from the front-end's node into its own memory instead"),
                logging.WARNING)
            try:
                self.nodes.ensure_local([k for k in keys if k not in self._past_node])
            except ItemsMissing as missing:
                raise MultiModalCacheMissError([str(k) for k in missing.keys]) from None
            except FetchFailed as again:
                self._past_node.update(str(k) for k in again.keys)
        except ItemsMissing as e:
            raise MultiModalCacheMissError([str(k) for k in e.keys]) from None

    def _read(self, mm_hash: str) -> tuple[dict[str, Any], int]:
        """The item's tensors and size: zero-copy from the store, or, on a Ray node
        other than the front-end's where this node's copy cannot be had (its store full
        of pinned items, the copy evicted between fetch and read, or its bridge killed
        mid-fetch), a private copy read from the front-end's node."""
        if self.nodes is None:
            try:
                return _get_torch_item(self.store, mm_hash, self.timeout)
            except _native.NotFound:
                # Deleted since the engine core admitted the request (by hand: the
                # plugin's own deletes spare pinned items), but its gate still pins it.
                mv = self.store.get_draining(mm_hash)
                if mv is None:
                    raise
                _log_once("read-draining", (
                    f"shmstore: item {mm_hash} was deleted from {self.store.path} while a "
                    "request using it ran; this worker read it all the same (the engine "
                    "core pins it until the request is done). Delete items of a running "
                    "instance with Store.delete_unpinned, which leaves those in use"),
                    logging.WARNING)
                return _torch_item(mv), mv.nbytes
        if mm_hash not in self._past_node:
            try:
                return _get_torch_item(self.store, mm_hash, self.timeout)
            except (_native.NotFound, _native.CreatorDied, _native.Timeout) as e:
                _log_once("node-copy-lost", (
                    f"shmstore: this node's copy of an item was lost before this worker "
                    f"read it ({e}); reading it from the front-end's node instead"),
                    logging.WARNING)
        self._past_node.discard(mm_hash)
        (data,) = self.nodes.read_private([mm_hash])
        if data is None:
            raise _native.NotFound(f"item {mm_hash} is not at its source either")
        return _torch_item(data), data.nbytes

    def _keep(self, mm_hash: str, item: MultiModalKwargsItem, nbytes: int) -> None:
        """Keeps ``item`` ready for hits if it fits the budget, letting go of the least
        recently used kept items (and, unless vLLM still holds them, their pins)."""
        if nbytes > self._keep_budget:
            return
        self._kept[mm_hash] = (item, nbytes)
        self._kept_bytes += nbytes
        while self._kept_bytes > self._keep_budget:
            _, (_, n) = self._kept.popitem(last=False)
            self._kept_bytes -= n

    @override
    def touch_receiver_cache_item(
        self, mm_hash: str, mm_item: MultiModalKwargsItem | None = None
    ) -> None:
        # Lookups are by key; there is no handle to validate. An item vLLM touches (its
        # request hit the prefix cache) is recent again.
        if mm_hash in self._kept:
            self._kept.move_to_end(mm_hash)

    @override
    def clear_cache(self) -> None:
        # The front-end's clear_cache deletes the items it stored; the kept items' pins
        # go, so that those can be deleted (or evicted).
        self._kept.clear()
        self._kept_bytes = 0


def _get_torch_item(store, mm_hash: str, timeout: float) -> tuple[dict[str, Any], int]:
    """The item's tensors (views of the shared object, pinning it) and the object's
    size. Waits only if the item is being created (another front-end is writing it); an
    absent item is a miss at once."""
    mv = store.get(mm_hash, timeout, wait_if_absent=False)
    return _torch_item(mv), mv.nbytes


def _torch_item(mv: memoryview) -> dict[str, Any]:
    """The tensors of the item in ``mv`` (views of its bytes)."""
    arrays, meta = _native.decode_item(mv)
    out: dict[str, Any] = {}
    for name, dt, shape, offset, nbytes in arrays:
        tdt = getattr(torch, dt)
        if nbytes == 0:
            out[name] = torch.empty(shape, dtype=tdt)
            continue
        out[name] = torch.frombuffer(mv, dtype=tdt, count=nbytes // _ITEMSIZE[dt], offset=offset).view(shape)
    if meta:
        out["__meta__"] = meta
    return out


def register_with_cuda_later(receiver) -> None:
    """Registers the receiver's store with CUDA on a background thread, per
    ``SHMSTORE_VLLM_CUDA_REGISTER``, once two things are true:

    * the store's pages are rebuilt as 2 MiB pages: registration pins every page, and the
      kernel cannot rebuild a pinned page, so a worker that registered first would leave
      the store on 4 KiB pages for every process;
    * the worker has read its first item, with CUDA initialised: vLLM creates the
      receiver before it picks the worker's GPU (``init_device``), and CUDA's current
      device is per thread. The read tells which device the worker uses
      (``note_cuda_device``); registering earlier, or from this thread's default device,
      would initialise CUDA on GPU 0 in every worker.

    Until it is done, copies to the GPU are staged (correct, slower); on a machine
    without a GPU nothing happens."""
    if not _cuda_wanted():
        return
    receiver.cuda_device_known = threading.Event()

    def run() -> None:
        wait_for_huge_pages(receiver.store)
        receiver.cuda_device_known.wait()
        receiver.cuda_registered = register_with_cuda(receiver.store, receiver.cuda_device)

    threading.Thread(target=run, name="shmstore-cuda-register", daemon=True).start()


def note_cuda_device(receiver) -> None:
    """Called by the thread that reads items: once CUDA is initialised in the process,
    records that thread's current device for ``register_with_cuda_later``."""
    if torch.cuda.is_initialized():
        receiver.cuda_device = torch.cuda.current_device()
        receiver.cuda_device_known.set()


def _cuda_wanted() -> bool:
    mode = os.environ.get("SHMSTORE_VLLM_CUDA_REGISTER", "auto")
    if mode == "0":
        return False
    if not cuda.gpu_visible():
        if mode == "1":
            logger.warning("shmstore: SHMSTORE_VLLM_CUDA_REGISTER=1 but no GPU is visible; skipped")
        else:
            logger.debug("shmstore: no GPU visible; store not registered with CUDA")
        return False
    return True


def register_with_cuda(store, device: int | None = None) -> bool:
    """Registers the store's heap with CUDA in this process (``shmstore.cuda.register``,
    in ``device``'s context), per ``SHMSTORE_VLLM_CUDA_REGISTER`` (``auto``: when a GPU is
    there). Returns whether it did; never raises: a worker that cannot register copies
    staged, as without."""
    if not _cuda_wanted():
        return False
    read_only = os.environ.get("SHMSTORE_VLLM_READ_ONLY", "1") != "0"
    start = time.monotonic()
    try:
        cuda.register(store, read_only=read_only, device=device)
    except Exception as e:  # noqa: BLE001 - any failure means "not registered"
        logger.warning("shmstore: %s (see docs/vllm.md, \"GPU copies\")", e)
        return False
    logger.info(
        "shmstore: this worker registered the store's %.1f GiB heap with CUDA%s in %.2f s: "
        "its items go to the GPU by direct DMA", store.heap_region[1] / (1 << 30),
        "" if device is None else f" on cuda:{device}", time.monotonic() - start)
    return True
