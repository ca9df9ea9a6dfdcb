"""The engine/worker multimodal cache, with only hashes on the RPC.

vLLM's ``mm_processor_cache_type="shm"`` pairs a sender in the engine (which decides, per
multimodal item hash, whether the workers already have the item) with a receiver in each
worker (which looks the item up by hash). With one shared store both sides see the same
truth, so the sender needs no mirror of the receivers' state:

* ``SenderCache.send(mm_hash, item)`` puts the item unless the store already holds it,
  and returns what the RPC carries: the hash alone.
* ``ReceiverCache.get(mm_hash)`` maps the item's arrays in place, zero-copy.

What this adds over vLLM's shm cache: several engine processes may write (data parallel:
the first put wins, the others see ``AlreadyExists`` or a hit); a worker that restarts just
reattaches (``Store.open``) and finds everything; and a reader that stalls holding an item
pins only that item: eviction (stores created with ``evict=True``) skips it and takes
others, so nobody behind it is blocked.

An item the sender reports as present could be evicted before the workers read it. The
sender therefore keeps the last ``inflight`` items it sent pinned (a view each), which
keeps them in the store while their RPCs are in flight; raise ``inflight`` if workers may
lag further behind.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Mapping

from . import _native
from .items import get_item, put_arrays


class SenderCache:
    """Engine side: put each item once, send only its hash."""

    def __init__(self, store: _native.Store, inflight: int = 64, timeout: float = 10.0):
        self.store = store
        self.timeout = timeout
        self._held: collections.deque = collections.deque(maxlen=max(1, inflight))
        self.hits = 0
        self.misses = 0

    def send(
        self,
        mm_hash: str,
        item: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
        meta: Mapping[str, Any] | None = None,
    ) -> str:
        """Makes sure the store holds ``item`` under ``mm_hash`` and returns ``mm_hash``.

        ``item`` may be a callable that builds the arrays: it runs only on a miss.
        """
        # A hit is pinned by the lookup that finds it: asking first and pinning after
        # would leave a moment in which the store could evict it.
        held = self.store.try_get(mm_hash)
        if held is not None:
            self.hits += 1
        else:
            arrays = item() if callable(item) else item
            try:
                # Pinned as it is sealed: no moment in which it could be evicted unpinned.
                held = put_arrays(self.store, mm_hash, arrays, meta, self.timeout, pin=True)
                self.misses += 1
            except _native.AlreadyExists:
                self.hits += 1  # another engine process is putting (or put) it
            if held is None:
                # Another engine is still writing it (waits for its seal), or it was put
                # and deleted at once.
                held = self.store.get(mm_hash, self.timeout)
        # Kept pinned while the RPC is in flight.
        self._held.append(held)
        return mm_hash

    def release(self) -> None:
        """Drops every pin this sender holds."""
        self._held.clear()


class ReceiverCache:
    """Worker side: items by hash, zero-copy."""

    def __init__(self, store: _native.Store, timeout: float = 10.0, as_torch: bool = False):
        self.store = store
        self.timeout = timeout
        self.as_torch = as_torch

    def get(self, mm_hash: str) -> dict[str, Any]:
        """The item's arrays (pinned while any of them is alive)."""
        return get_item(self.store, mm_hash, self.timeout, as_torch=self.as_torch)
