"""P0, the front-end: ``ShmstoreSenderCache``, which puts each item into the store once
and sends the workers a marker.

Invariants: an item reported cached, or sent, is pinned until the request is merged
(vLLM's touch protocol) and then while it is in the window of recent sends; an item
that cannot be stored goes inline, never lost.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from typing import Any, cast

from typing_extensions import override

from vllm.multimodal.cache.base import (
    BaseMultiModalProcessorCache,
    MultiModalCacheMissError,
    MultiModalProcessorCacheInItem,
    MultiModalProcessorCacheOutItem,
)
from vllm.multimodal.inputs import MultiModalKwargsItem
from vllm.utils.cache import CacheInfo

from .. import _native
from ..items import put_described
from .instance import _capacity, _export_metrics, open_store, store_path
from .item_format import _MiB, Unsupported, describe_item, is_marker, marker_item
from .nodes import _ray_backend
from .prompt_updates import META_KEY, decode_updates, encode_updates

logger = logging.getLogger("shmstore.vllm")  # one logger for the whole plugin

#: Most sends kept pinned on their way to the workers (the byte budget usually binds).
_MAX_INFLIGHT = 4096
#: Prompt updates kept per front-end (items it can report cached without reprocessing).
_MAX_UPDATES = 1 << 16


def _is_current(pin: memoryview) -> bool:
    """Whether the store still answers the pinned object's key with that very object."""
    return cast(_native.View, pin.obj).is_current()


class ShmstoreSenderCache(BaseMultiModalProcessorCache):
    """The front-end (P0) cache: each item goes into the store once; only a marker
    crosses the RPC.

    Eviction is the store's CLOCK (least recently used first), never FIFO, and skips
    pinned items. vLLM's touch protocol maps to pins: ``is_cached`` and
    ``touch_sender_cache_item`` pin an item until ``release_sender_touches`` (the end of
    the request's merge), and every item sent stays pinned in a window of recent sends
    (at most ``inflight_fraction`` of the store's bytes for all the instance's
    front-ends together, divided among its API servers, and always the latest send) so
    that it is not evicted while its request is on the way to the workers. An item that is gone
    anyway is a miss on the worker, which vLLM's retry path turns into a resend.

    The item's prompt updates (its placeholder tokens) are stored with it when they are
    plain data, as they are for the models vLLM ships with token-list targets
    (``prompt_updates``): a front-end then reports an item that another front-end (or
    an earlier life of this one) stored as cached, and vLLM skips the HF processor for
    it. Updates that are not plain data stay in the front-end that made them.
    """

    def __init__(self, vllm_config, *, inflight_fraction: float = 0.25) -> None:
        super().__init__()
        mm_config = vllm_config.model_config.get_multimodal_config()
        self.store = open_store(vllm_config)  # populated in the background (Rust thread)
        _export_metrics(self.store)
        self.max_object_size = int(mm_config.mm_shm_cache_max_object_size_mb * _MiB)
        self._updates: collections.OrderedDict[str, Sequence[Any]] = collections.OrderedDict()
        self._touched: dict[str, memoryview] = {}
        #: The items this front-end stored, newest last (bounded as ``_updates``): what
        #: its ``clear_cache`` deletes. A store may be shared (other front-ends, other
        #: instances, a crashed instance's warm items), and vLLM clears its cache at
        #: every start.
        self._stored: collections.OrderedDict[str, None] = collections.OrderedDict()
        #: The window of recent sends: mm_hash -> (pin, bytes), oldest first.
        self._inflight: collections.OrderedDict[str, tuple[memoryview, int]] = (
            collections.OrderedDict())
        self._inflight_bytes = 0
        #: Whether vLLM is merging a request's items (from its first touch to its
        #: release), and how many it sent so far: the newest entries of the window,
        #: which stay there while the request is merged, whatever the window's budget.
        self._merging = False
        self._request_sends = 0
        # Each API server runs a front-end with a window of its own: together they pin
        # at most ``inflight_fraction`` of the store, as one front-end does alone.
        front_ends = max(1, int(getattr(vllm_config.parallel_config, "_api_process_count", 1) or 1))
        self._inflight_budget = int(_capacity(vllm_config) * inflight_fraction / front_ends)
        #: What the window holds at most, a large request's items included.
        self._inflight_cap = max(self._inflight_budget, _capacity(vllm_config) // (2 * front_ends))
        self._hits = 0
        self._total = 0
        self._last_info = CacheInfo(hits=0, total=0)
        self._warned: set[str] = set()
        self.inline_only = False  # set when workers turn out not to see the store
        # With Ray's executor, workers on other nodes fetch through shmstore.ray: a miss
        # there means the item is gone, never that they cannot see a store.
        self.bridged = _ray_backend(vllm_config)

    # -- what vLLM asks ---------------------------------------------------------------

    @override
    def is_cached_item(self, mm_hash: str) -> bool:
        if self.inline_only:
            return False
        if mm_hash not in self._updates:
            return self._adopt(mm_hash)
        if mm_hash in self._touched:
            return True
        v = self._pin(mm_hash)
        if v is None:
            del self._updates[mm_hash]
            return False
        self._touched[mm_hash] = v  # protected until the request is merged
        return True

    @override
    def touch_sender_cache_item(self, mm_hash: str) -> None:
        # vLLM touches every item of a request before it merges them (and releases
        # after): the window keeps what the request sends until then.
        self._merging = True
        if mm_hash in self._touched or mm_hash not in self._updates:
            return
        v = self._pin(mm_hash)
        if v is not None:
            self._touched[mm_hash] = v

    @override
    def release_sender_touches(self) -> None:
        # vLLM releases once a request's items are merged (in a ``finally``): the next
        # request's sends may push this one's out of the window, not its own.
        self._touched.clear()
        self._merging = False
        self._request_sends = 0

    @override
    def get_and_update_item(
        self,
        mm_item: MultiModalProcessorCacheInItem,
        mm_hash: str,
    ) -> MultiModalProcessorCacheOutItem:
        self._total += 1
        if mm_item is None:
            # vLLM found the item cached (is_cached) and skipped processing it.
            updates = self._updates.get(mm_hash)
            if updates is None:
                raise MultiModalCacheMissError([mm_hash])
            self._hits += 1
            self._updates.move_to_end(mm_hash)
            self._send(mm_hash, self._touched.pop(mm_hash, None))
            return marker_item(), updates

        item, updates = mm_item
        if self.inline_only:
            return mm_item
        try:
            try:
                out, meta = describe_item(item)
            except Unsupported:
                raise
            except (TypeError, ValueError, OverflowError) as e:
                # A value the item format does not know (a newer vLLM's field, say): the
                # item goes inline, as vLLM would send it, rather than failing the request.
                raise Unsupported("describe", f"{type(e).__name__}: {e}") from None
            if out.nbytes > self.max_object_size:
                raise Unsupported(
                    "size",
                    f"{out.nbytes / _MiB:.1f} MiB is over --mm-shm-cache-max-object-size-mb="
                    f"{self.max_object_size // _MiB}",
                )
            shared = encode_updates(updates)
            if shared is not None:
                meta[META_KEY] = shared
            # Pinned as it is sealed: the send below needs no second lookup.
            pin = put_described(self.store, mm_hash, out.specs, out.tensors, meta, None, pin=True)
        except Unsupported as e:
            self._warn_once(e.reason, f"shmstore: an item goes inline ({e}); said once per reason")
            return mm_item
        except _native.AlreadyExists:
            # Another front-end put it first (the first put wins), or is writing it now.
            pin = self.store.try_get(mm_hash)
            if pin is None:
                # Not sealed yet (or on its way out): no one can read it now, and a marker
                # would be a miss in the engine core's gate, a failed request. This once
                # the item goes inline; its next hit finds it sealed (or stores it).
                self._updates[mm_hash] = updates
                self._updates.move_to_end(mm_hash)
                return mm_item
        except (_native.Full, _native.TooLarge, _native.TableFull) as e:
            logger.debug("shmstore: item %s not cached (%s)", mm_hash, e)
            return mm_item
        self._updates[mm_hash] = updates
        self._updates.move_to_end(mm_hash)
        self._stored[mm_hash] = None
        if len(self._stored) > _MAX_UPDATES:
            self._stored.popitem(last=False)
        self._forget_sent(mm_hash)  # a pin from an earlier send may be of a deleted object
        self._send(mm_hash, pin)
        return marker_item(), updates

    @override
    def validate_input_item(self, mm_item: MultiModalKwargsItem, mm_hash: str) -> None:
        if is_marker(mm_item) and not self.store.contains(mm_hash):
            raise ValueError(f"multimodal item {mm_hash} is not in the shmstore cache")

    @override
    def invalidate(self, mm_hash: str) -> None:
        # The engine core's gate (or a worker) missed the item. If this front-end still
        # pins the very object it sent, and the store still holds that object under the
        # key, the process that missed it cannot see this store (it runs on another
        # machine): from now on, items go inline. Any other miss is an ordinary one: the
        # item was deleted, or evicted once no one pinned it, and perhaps stored again
        # since by another front-end; then only this item is dropped.
        if not self.inline_only and not self.bridged and self._holds_what_it_sent(mm_hash):
            self.inline_only = True
            logger.warning(
                "shmstore: vLLM's engine core could not find item %s in %s although "
                "the store holds the very object this front-end sent: an engine core on "
                "another machine? Sending items inline from now on (see docs/vllm.md, "
                "multi-node).", mm_hash, store_path())
        self._updates.pop(mm_hash, None)
        self._touched.pop(mm_hash, None)
        self._forget_sent(mm_hash)

    @override
    def clear_cache(self) -> None:
        # vLLM calls this at start (after profiling with a dummy item) and on
        # ``reset_mm_cache``. The front-end forgets every item, and deletes those it
        # stored itself: other front-ends' items (another API server, another instance
        # sharing the store, the warm items of a crashed one) are theirs to clear.
        self._touched.clear()
        self._updates.clear()
        # Items some process pins stay: a request the engine core admitted (its gate
        # pins the request's items), one still on its way there (this front-end's window
        # of recent sends, which stays for that reason), or a worker still reads them.
        # Deleting one would fail a request (vLLM warns if requests are in flight).
        # ``delete_unpinned`` decides that in one atomic step against the gate's pin: a
        # request admitted while the clear runs keeps its items (a look at the pins,
        # then a delete, could take an item pinned in between). Items kept stay on the
        # list, for the next clear; they are evictable once unpinned. One lookup per
        # item this front-end stored, whatever else the store holds.
        kept = []
        for h in self._stored:
            try:
                if not self.store.delete_unpinned(h):
                    kept.append(h)
            except _native.NotSealed:
                kept.append(h)  # being stored again (by another front-end)
            except _native.ShmstoreError:
                pass  # gone already: evicted or deleted meanwhile
        self._stored = collections.OrderedDict.fromkeys(kept)
        self._hits = self._total = 0
        self._last_info = CacheInfo(hits=0, total=0)

    @override
    def make_stats(self, *, delta: bool = False) -> CacheInfo:
        info = CacheInfo(hits=self._hits, total=self._total)
        if delta:
            info, self._last_info = info - self._last_info, info
        return info

    @override
    def close(self) -> None:
        self._touched.clear()
        self._inflight.clear()
        self._inflight_bytes = 0
        self._merging = False
        self._request_sends = 0

    # -- internals --------------------------------------------------------------------

    def _adopt(self, mm_hash: str) -> bool:
        """Whether the store holds the item with prompt updates this front-end can use
        (another front-end stored it): if so, they join this front-end's own and the
        item is pinned until the request is merged, as a local hit is."""
        v = self.store.try_get(mm_hash)
        if v is None:
            return False
        try:
            _arrays, meta = _native.decode_item(v)
        except _native.ShmstoreError:
            return False  # not an item of this format: another program's object
        updates = decode_updates(meta.get(META_KEY))
        if updates is None:
            return False  # stored without shareable updates: process it here
        self._updates[mm_hash] = updates
        self._touched[mm_hash] = v
        return True

    def _holds_what_it_sent(self, mm_hash: str) -> bool:
        """Whether this front-end pins the object it sent for ``mm_hash`` and the store
        still answers the key with that object."""
        sent = self._inflight.get(mm_hash)
        pin = sent[0] if sent is not None else self._touched.get(mm_hash)
        return pin is not None and _is_current(pin)

    def _pin(self, mm_hash: str) -> memoryview | None:
        """A pin on the object the store holds under ``mm_hash`` now, or None if it is
        gone. A recent send's pin answers only while its object is still the one the key
        names (``View.is_current``: 0.1 us, no key to hash, a fraction of a new pin's
        cost): a pin keeps its object's bytes, not its key, and after a delete (another
        front-end's ``clear_cache``, or by hand) the key may name nothing, or a new
        object stored since, which nothing of this front-end's would keep from eviction
        before the engine core admits the request. Such a stale pin goes."""
        sent = self._inflight.get(mm_hash)
        if sent is None:
            return self.store.try_get(mm_hash)
        if _is_current(sent[0]):
            return sent[0]
        self._forget_sent(mm_hash)
        return self.store.try_get(mm_hash)

    def _forget_sent(self, mm_hash: str) -> None:
        sent = self._inflight.pop(mm_hash, None)
        if sent is not None:
            self._inflight_bytes -= sent[1]

    def _send(self, mm_hash: str, pin: memoryview | None) -> None:
        """Keeps the item pinned while its request is on the way to the workers: it
        joins (or, sent again, moves to the end of) the window of recent sends."""
        sent = self._inflight.get(mm_hash)
        if sent is not None:
            self._inflight.move_to_end(mm_hash)
            self._request_sends += self._merging
            return
        if pin is None:
            pin = self.store.try_get(mm_hash)
            if pin is None:
                return  # evicted already: the engine core's gate refuses, vLLM resends
        self._inflight[mm_hash] = (pin, pin.nbytes)
        self._inflight_bytes += pin.nbytes
        self._request_sends += self._merging
        # The request's own items stay, even when they alone are over the budget (up
        # to half the store): a request larger than the window must not unpin its
        # first items before it leaves for the engine core. Sends outside a merge
        # (vLLM's ``inject_into_mm_cache``) keep only the newest.
        keep = max(1, self._request_sends)
        while len(self._inflight) > 1 and (
            (len(self._inflight) > keep and self._inflight_bytes > self._inflight_budget)
            or self._inflight_bytes > self._inflight_cap
            or len(self._inflight) > _MAX_INFLIGHT
        ):
            _, (_, n) = self._inflight.popitem(last=False)
            self._inflight_bytes -= n
        # Bounded bookkeeping: forget prompt updates of items the store no longer holds
        # (then the oldest), once there are twice as many as the limit allows.
        if len(self._updates) > 2 * _MAX_UPDATES:
            for h in [h for h in self._updates if not self.store.contains(h)]:
                del self._updates[h]
            while len(self._updates) > _MAX_UPDATES:
                self._updates.popitem(last=False)

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(msg)
