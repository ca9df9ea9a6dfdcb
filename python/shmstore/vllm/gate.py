"""The engine core: ``ShmstoreEngineGate``, which admits a request only if every item it
names is in the store, and keeps those items pinned for as long as the engine core
holds the request.

Why it exists: vLLM (0.32 to 0.34) recovers from a cache miss only where the engine core
raises it, in ``EngineCore.preprocess_add_request`` (the request ends with a retryable
error, the front-end drops the item, the client sends it again). A miss raised in a
worker, inside ``execute_model``, is a fatal error: the engine core dies and ``vllm
serve`` with it (measured: ``EngineDeadError``, HTTP 500, the server shuts down). So the
workers must never miss, and the gate is what makes that true: an item it admitted
cannot be evicted before every worker has read it.

Invariants: a marker is admitted only with a pin on the object the store holds under its
key; the pin lives until the engine core drops the last reference to that marker (its
``Request``, and any scheduler output in flight that carries it), then goes; one pin
per object, counted, however many requests name it.
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Iterable
from typing import Any, cast

from typing_extensions import override

from vllm.multimodal.cache.base import BaseMultiModalReceiverCache, MultiModalCacheMissError
from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem

from .. import _native
from .item_format import is_marker

#: What identifies one object: its key and where it lies (no other object can lie there
#: while the gate pins it).
Ident = tuple[str, int]


def object_address(view: memoryview) -> int:
    """Where the object a pinned view (``Store.get``, ``try_get``) shows lies in this
    process: the same address is the same object for as long as a pin holds it."""
    return cast(_native.View, view.obj).address


class RequestPins:
    """The pins the engine core holds for its requests: one store pin per object, with a
    count of the requests that need it.

    Thread-safe: requests are admitted on vLLM's input thread and freed on its busy
    loop. ``unpin`` may run inside a garbage collection that interrupts ``pin`` on the
    same thread, so it never waits for the lock: what it cannot release at once waits
    in a queue that the next call drains."""

    def __init__(self, store) -> None:
        self.store = store
        self._held: dict[Ident, list] = {}  # ident -> [view, requests]
        self._lock = threading.Lock()
        self._pending: collections.deque[Ident] = collections.deque()

    def pin(self, key: str) -> Ident | None:
        """Pins the sealed object under ``key`` for one more request; None if the store
        does not hold it (absent, or not sealed yet)."""
        view = self.store.try_get(key)
        if view is None:
            return None
        ident = (key, object_address(view))
        with self._lock:
            self._drain()
            held = self._held.get(ident)
            if held is None:
                self._held[ident] = [view, 1]
            else:
                held[1] += 1  # this view goes when the function returns: one pin per object
        return ident

    def unpin(self, ident: Ident) -> None:
        """One request that needed the object is gone; the last one takes the pin."""
        self._pending.append(ident)
        if self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def _drain(self) -> None:
        while self._pending:
            ident = self._pending.popleft()
            held = self._held.get(ident)
            if held is None:
                continue
            held[1] -= 1
            if held[1] == 0:
                del self._held[ident]

    def objects(self) -> int:
        """Objects pinned now (for tests and tools)."""
        with self._lock:
            self._drain()
            return len(self._held)


class PassThroughCache(BaseMultiModalReceiverCache):
    """An engine-core cache that hands every item on as it came: the workers read it
    (the gate and the Ray prefetcher add their work in ``get_and_update_features``)."""

    @override
    def get_and_update_item(
        self, mm_item: MultiModalKwargsItem | None, mm_hash: str
    ) -> MultiModalKwargsItem:
        assert mm_item is not None, f"Expected an item for {mm_hash=}"
        return mm_item  # unchanged: the workers read it

    @override
    def touch_receiver_cache_item(
        self, mm_hash: str, mm_item: MultiModalKwargsItem | None = None
    ) -> None:
        pass


class ShmstoreEngineGate(PassThroughCache):
    """The engine-core cache (vLLM's engine-side receiver slot, which vLLM's ``shm``
    cache leaves empty): passes every feature on unchanged, after pinning each marker's
    object until the engine core lets go of the marker. A request naming an item the
    store no longer holds (deleted, or evicted before the request arrived) raises vLLM's
    ``MultiModalCacheMissError`` with every such hash, here, where vLLM turns it into a
    retryable error and the front-end drops the items; it never reaches a worker."""

    def __init__(self, vllm_config=None, *, store=None) -> None:
        super().__init__()
        if store is None:
            from .instance import open_store

            store = open_store(vllm_config, read_only=True)
        self.store = store
        self.pins = RequestPins(store)

    @override
    def get_and_update_features(
        self, mm_features: list[MultiModalFeatureSpec]
    ) -> list[MultiModalFeatureSpec]:
        self.admit(mm_features)
        return mm_features

    def admit(self, mm_features: list[MultiModalFeatureSpec]) -> None:
        """Pins every marker's object for as long as its marker lives, or raises the
        miss error naming every marker whose object is gone."""
        self.hold(
            (f.data, f.mm_hash or f.identifier)
            for f in mm_features
            if f.data is not None and is_marker(f.data)  # else prefix-cached, or inline
        )

    def hold(self, owners: Iterable[tuple[Any, str]]) -> None:
        """For each ``(owner, key)``: pins the object under ``key`` until ``owner`` (an
        object that supports weak references: the marker) is gone. Raises the miss
        error naming every key the store does not hold; the pins taken go with their
        owners."""
        missing = []
        for owner, key in owners:
            ident = self.pins.pin(key)
            if ident is None:
                missing.append(key)
            else:
                # Not at interpreter exit: a process that leaves drops its pins anyway.
                weakref.finalize(owner, self.pins.unpin, ident).atexit = False
        if missing:
            raise MultiModalCacheMissError(missing)

    @override
    def clear_cache(self) -> None:
        pass  # the pins belong to requests, and go with them
