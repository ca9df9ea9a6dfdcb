"""The front-end's cache (``ShmstoreSenderCache``) as vLLM's processor drives it: what it
reports cached, what it pins and for how long, what it forgets, and its bookkeeping's
bounds."""

import logging

import pytest
import torch
from harness import float_item, make_config, make_item, make_updates, same_updates
from vllm.multimodal.inputs import MultiModalBatchedField, MultiModalFieldElem, MultiModalKwargsItem

import shmstore
from shmstore import vllm as sv
from shmstore.vllm import sender as sender_module


@pytest.fixture
def narrow_sender(store_env):
    """A front-end whose window of recent sends holds only the latest request's items
    (or, outside a merge, the latest send): the window's budget is next to nothing."""
    sender = sv.ShmstoreSenderCache(make_config(), inflight_fraction=1e-9)
    yield sender
    sender.close()


def merge(sender, hashes):
    """One request's items through the sender as vLLM's processor merges them: every
    hash touched, each item sent (processed, as on a first send), then the touches
    released."""
    for h in hashes:
        sender.touch_sender_cache_item(h)
    try:
        return [sender.get_and_update_item((make_item(h), make_updates(h)), h) for h in hashes]
    finally:
        sender.release_sender_touches()


def test_a_second_front_end_reports_an_item_another_stored_as_cached_with_its_updates(store_env):
    config = make_config()
    first, second = sv.ShmstoreSenderCache(config), sv.ShmstoreSenderCache(config)
    try:
        for h in ("p", "q~"):
            out, updates = first.get_and_update_item((make_item(h), make_updates(h)), h)
            assert sv.is_marker(out)
        first.store.put("foreign", b"not an item")  # another program's object, same key space
        assert second.is_cached(["p", "q~", "never", "foreign"]) == [True, False, False, False]
        out, updates = second.get_and_update_item(None, "p")
        second.release_sender_touches()
        assert sv.is_marker(out) and same_updates(updates, make_updates("p"))
        assert second.make_stats().hits == 1
        # An item whose updates are not shared is processed again; the first put won.
        out, updates = second.get_and_update_item((make_item("q~"), make_updates("q~")), "q~")
        assert sv.is_marker(out) and same_updates(updates, make_updates("q~"))
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("api_servers", [1, 4])
def test_the_front_ends_windows_of_recent_sends_pin_a_quarter_of_the_store_together(store_env, api_servers):
    # Each API server's front-end keeps its recent sends pinned; with four of them, each
    # keeps a quarter of what one alone would, so that together they still leave 3/4 of
    # the store evictable.
    sender = sv.ShmstoreSenderCache(make_config(cache_mb=64, api_servers=api_servers))
    store = sender.store
    try:
        pinned = []
        for i in range(40):  # images of 1.2 MiB: 48 MiB in all, under the capacity
            h = f"win-{i}"
            sender.get_and_update_item((make_item(h, kind="image"), []), h)
            sender.release_sender_touches()
            pinned.append(store.stats()["pins"] * len(store.get(h)))
        budget = (64 << 20) // 4 // api_servers
        size = len(store.get("win-0"))
        assert max(pinned) <= budget, (max(pinned), budget)
        assert max(pinned) > budget - 2 * size, "the window fills its share"
    finally:
        sender.close()


def test_an_item_another_front_end_is_still_writing_goes_inline_this_once(store_env):
    # Two front-ends got the same new image at once; the other one is still writing it
    # (or stopped while writing). A marker would name an object no one can read yet, and
    # the engine core's gate would turn it into a failed request: the item goes inline.
    sender = sv.ShmstoreSenderCache(make_config())
    try:
        item = make_item("racing")
        writing = sender.store.create_object("racing", 1 << 10)
        out, updates = sender.get_and_update_item((item, make_updates("racing")), "racing")
        assert out is item and same_updates(updates, make_updates("racing"))
        # When the other writer gives up (or dies, and recovery takes its object), the
        # next send stores the item, and it is a hit from then on.
        writing.abort()
        out, _ = sender.get_and_update_item((item, make_updates("racing")), "racing")
        assert sv.is_marker(out)
        assert sender.is_cached(["racing"]) == [True]
        sender.release_sender_touches()
        # When the other writer seals it, it is a hit at once, with this front-end's
        # prompt updates (vLLM skips the processor for it).
        writing = sender.store.create_object("sealed-later", 1 << 10)
        item = make_item("sealed-later")
        out, _ = sender.get_and_update_item((item, make_updates("sealed-later")), "sealed-later")
        assert out is item
        writing.seal()
        assert sender.is_cached(["sealed-later"]) == [True]
        out, updates = sender.get_and_update_item(None, "sealed-later")
        assert sv.is_marker(out) and same_updates(updates, make_updates("sealed-later"))
        sender.release_sender_touches()
    finally:
        sender.close()


def test_touched_items_stay_pinned_until_the_request_is_merged(narrow_sender):
    # vLLM touches every item of a request before merging it: an item stored long ago
    # (out of the window) must not be evicted between the touch and the send.
    sender = narrow_sender
    merge(sender, ["old"])
    merge(sender, ["new"])  # the window (the newest alone here) moved past "old"

    def pins():
        return sender.store.stats()["pins"]

    window = pins()
    assert list(sender._inflight) == ["new"]
    sender.touch_sender_cache_item("old")
    assert pins() == window + 1
    sender.touch_sender_cache_item("old")  # touched twice: still one pin
    sender.touch_sender_cache_item("never-stored")  # nothing to pin
    assert pins() == window + 1
    sender.release_sender_touches()
    assert pins() == window


def test_an_item_larger_than_the_store_goes_inline(store_env):
    # Under vLLM's object-size limit, over the store's capacity: inline, as vLLM would.
    sender = sv.ShmstoreSenderCache(make_config(cache_mb=16, max_object_mb=64))
    try:
        item = MultiModalKwargsItem({"x": MultiModalFieldElem(
            data=torch.zeros(5 << 20), field=MultiModalBatchedField())})  # 20 MiB
        out, _ = sender.get_and_update_item((item, ["u"]), "too-large")
        assert out is item and not sender.store.contains("too-large")
    finally:
        sender.close()


def test_a_miss_on_an_item_stored_again_since_is_not_taken_for_a_store_the_workers_cannot_see(
    store_env,
):
    # The front-end sent "x" and let go of it (its window moved on); the store evicted
    # it; another front-end stored it again; then the miss comes back. The store holds
    # "x", but not the object this front-end sent: an ordinary miss. (Taking it for
    # "the engine core cannot see the store" switched the cache off for good.)
    config = make_config(cache_mb=16)
    sender, other = sv.ShmstoreSenderCache(config), sv.ShmstoreSenderCache(config)
    try:
        sender.get_and_update_item((make_item("x"), make_updates("x")), "x")
        for i in range(12):  # images of 1.2 MiB: the window (4 MiB) moves past "x"
            h = f"after-{i}"
            sender.get_and_update_item((make_item(h, kind="image"), []), h)
        sender.store.delete("x")  # evicted: no one pinned it any more
        assert sender.store.stats()["draining"] == 0
        out, _ = other.get_and_update_item((make_item("x"), make_updates("x")), "x")
        assert sv.is_marker(out) and sender.store.contains("x")
        sender.invalidate("x")
        assert not sender.inline_only
        # The object the front-end sent, still pinned by it and still the store's: the
        # process that missed it cannot see this store.
        sender.get_and_update_item((make_item("y"), make_updates("y")), "y")
        sender.invalidate("y")
        assert sender.inline_only
        # From then on nothing is reported cached, not even what the store holds: vLLM
        # processes every item and sends it inline.
        assert sender.store.contains("x") and sender.is_cached(["x"]) == [False]
        sender.release_sender_touches()
        z = make_item("z")
        assert sender.get_and_update_item((z, []), "z")[0] is z
    finally:
        sender.close()
        other.close()


def test_an_item_reported_cached_is_pinned_even_when_its_window_pin_is_of_an_older_object(
    store_env,
):
    # The front-end sent "x" and still holds it in its window of recent sends. "x" is
    # deleted by hand (the window's pin keeps the old bytes, draining), and another
    # front-end stores it again: a new object under the same key. When the next request
    # names "x", the front-end reports it cached, and that item must be pinned until
    # the request is merged: a pin on the old bytes protects nothing the workers will
    # read, and the new object could be evicted before the engine core admits the
    # request.
    config = make_config()
    sender, other = sv.ShmstoreSenderCache(config), sv.ShmstoreSenderCache(config)
    store = sender.store
    try:
        sender.get_and_update_item((make_item("x"), make_updates("x")), "x")
        store.delete("x")
        assert store.stats()["draining"] == 1  # the window's pin holds the old bytes
        out, _ = other.get_and_update_item((make_item("x"), make_updates("x")), "x")
        assert sv.is_marker(out)
        other.close()  # its window lets go of the new object
        assert sender.is_cached(["x"]) == [True]
        assert store.stats()["draining"] == 0, "the stale pin on the old bytes is dropped"
        assert not store.delete_unpinned("x"), "the item reported cached is not pinned"
        out, _ = sender.get_and_update_item(None, "x")
        sender.release_sender_touches()
        assert sv.is_marker(out)
        # Once merged, the item stays pinned in the window of recent sends.
        assert not store.delete_unpinned("x")
    finally:
        sender.close()
        other.close()


def test_the_hit_rate_vllm_logs_counts_every_item_from_zero(store_env):
    # vLLM logs the cache's hit rate from make_stats (delta=True: since its last look).
    sender = sv.ShmstoreSenderCache(make_config())

    def stats(**kw):
        info = sender.make_stats(**kw)
        return info.hits, info.total

    assert stats() == (0, 0) and stats(delta=True) == (0, 0)
    merge(sender, ["s1", "s2"])  # processed: two misses
    assert stats() == (0, 2)
    assert sender.is_cached_item("s1")
    sender.get_and_update_item(None, "s1")  # vLLM skipped processing it: a hit
    sender.release_sender_touches()
    assert stats() == (1, 3)
    assert stats(delta=True) == (1, 3) and stats(delta=True) == (0, 0)
    merge(sender, ["s3"])
    assert stats(delta=True) == (0, 1) and stats() == (1, 4)
    sender.close()


def test_is_cached_for_an_item_named_twice_and_not_for_one_gone_since(store_env):
    sender = sv.ShmstoreSenderCache(make_config())
    try:
        merge(sender, ["x", "y"])
        # A request naming an item twice asks twice: cached both times (the first look
        # pinned it until the request is merged).
        assert sender.is_cached(["x", "x"]) == [True, True]
        sender.release_sender_touches()
        # Deleted from the store since (by another process, or evicted): not cached, so
        # vLLM processes it again, and the new send stores it again.
        sender.store.delete("y")
        assert sender.is_cached(["y"]) == [False]
        sender.release_sender_touches()
        (out, _), = merge(sender, ["y"])
        assert sv.is_marker(out) and sender.is_cached(["y"]) == [True]
        sender.release_sender_touches()
    finally:
        sender.close()


def test_clearing_the_cache_leaves_the_items_of_requests_in_flight(store_env):
    # vLLM's reset_mm_cache while requests run (vLLM warns about it): the items the
    # engine core admitted stay, and so do those the front-end just sent (still on their
    # way to the engine core), or their requests would fail. Items other front-ends
    # stored (another API server, another instance sharing the store) are theirs.
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    config = make_config()
    # A window of recent sends that holds only the latest request's items.
    sender = sv.ShmstoreSenderCache(config, inflight_fraction=1e-9)
    gate = sv.ShmstoreEngineGate(config)
    try:
        store = sender.store
        merge(sender, ["running"])
        request = [MultiModalFeatureSpec(data=sv.marker_item(), modality="image", identifier="running",
                                         mm_position=PlaceholderRange(offset=0, length=1), mm_hash="running")]
        gate.get_and_update_features(request)
        merge(sender, ["done"])
        merge(sender, ["on its way"])  # pushes "done" and "running" out of the window
        store.put("someone else's", b"x")
        other = sv.ShmstoreSenderCache(config)
        merge(other, ["another front-end's"])
        other.close()
        sender.clear_cache()
        assert store.contains("running") and store.contains("on its way")
        assert not store.contains("done")
        assert store.contains("someone else's") and store.contains("another front-end's")
        # The front-end forgot every item; those still stored are hits (their prompt
        # updates are stored with them), the others are processed again.
        assert sender.is_cached(["running", "on its way", "done"]) == [True, True, False]
        sender.release_sender_touches()
        del request  # the request is done
        merge(sender, ["next"])
        sender.clear_cache()
        assert not store.contains("running") and not store.contains("on its way")
    finally:
        sender.close()


def test_the_window_of_sends_keeps_every_item_of_the_request_being_merged(narrow_sender):
    # A request whose items alone are over the window's budget: none of them may be
    # unpinned before the request leaves for the engine core (the store could evict it
    # before the engine core's gate admits the request, which would fail). The next
    # request pushes them out; items sent outside a merge (vLLM's inject_into_mm_cache)
    # keep only the newest.
    sender = narrow_sender
    first = ["a", "b", "c"]
    merge(sender, first)
    assert list(sender._inflight) == first
    assert sender.store.stats()["pins"] == 3
    merge(sender, ["d", "e"])
    assert list(sender._inflight) == ["d", "e"]
    for h in ("f", "g"):  # as inject_into_mm_cache sends: no touch, no release
        sender.get_and_update_item((make_item(h), []), h)
    assert list(sender._inflight) == ["g"]
    assert sender.store.stats()["pins"] == 1


def test_the_window_holds_a_large_request_up_to_half_the_store_and_injected_sends_alone(store_env):
    # Sends before any request is merged are injected ones too: the newest alone stays.
    sender = sv.ShmstoreSenderCache(make_config(cache_mb=64), inflight_fraction=1e-9)
    try:
        for h in ("i1", "i2"):
            sender.get_and_update_item((make_item(h), []), h)
        assert list(sender._inflight) == ["i2"]
        # A request of 40 MiB in a 64 MiB store: its items stay pinned up to half the
        # store (the rest of the store must still take other front-ends' items).
        def mib(h):
            return MultiModalKwargsItem({"x": MultiModalFieldElem(
                data=torch.full((1 << 18,), float(len(h))), field=MultiModalBatchedField())})
        hashes = [f"big-{i}" for i in range(40)]
        for h in hashes:
            sender.touch_sender_cache_item(h)
        for h in hashes:
            sender.get_and_update_item((mib(h), []), h)
        one = sender._inflight[hashes[-1]][1]
        held = sender._inflight_bytes
        assert (32 << 20) - one < held <= 32 << 20, (held, one)
        assert list(sender._inflight) == hashes[-len(sender._inflight):]  # the newest
        sender.release_sender_touches()
    finally:
        sender.close()


def test_clearing_the_cache_starts_the_hit_rate_from_zero_as_vllms_shm_cache_does(store_env):
    # vLLM clears the cache after profiling with a dummy item and on reset_mm_cache; its
    # own shm cache counts its hit rate from zero again, with and without delta.
    sender = sv.ShmstoreSenderCache(make_config())

    def stats(**kw):
        info = sender.make_stats(**kw)
        return info.hits, info.total

    try:
        merge(sender, ["c1", "c2"])
        assert sender.is_cached_item("c1")
        sender.get_and_update_item(None, "c1")
        sender.release_sender_touches()
        assert stats() == (1, 3)
        sender.clear_cache()
        assert stats() == (0, 0) and stats(delta=True) == (0, 0)
        merge(sender, ["c3"])
        assert stats(delta=True) == (0, 1) and stats() == (0, 1)
    finally:
        sender.close()


def test_clearing_the_cache_lets_go_of_touches_and_forgets_updates_the_store_cannot_give(narrow_sender):
    # An item a reader still holds stays in the store through a clear; the front-end lets
    # go of its touch on it, and forgets its prompt updates: updates that are not plain
    # data are not in the store, so the item is processed again, as after vLLM's clear.
    sender = narrow_sender
    store = sender.store
    merge(sender, ["kept~"])
    merge(sender, ["newer"])  # the window (the newest alone) moved past "kept~"
    reader = store.get("kept~")
    assert sender.is_cached(["kept~"]) == [True]  # touched: pinned until released
    pins = store.stats()["pins"]
    sender.clear_cache()
    assert store.contains("kept~"), "a reader holds it"
    assert store.stats()["pins"] == pins - 1, "the touch is let go"
    assert sender.is_cached(["kept~"]) == [False]
    sender.release_sender_touches()
    del reader


def test_touching_an_item_this_front_end_never_stored_pins_nothing(store_env):
    # vLLM touches every item of a request; an item in the store that this front-end did
    # not report cached (another front-end's, another program's) is processed and sent
    # anew, and a touch of it must not pin it.
    sender = sv.ShmstoreSenderCache(make_config())
    store = sender.store
    try:
        store.put("foreign", b"another program's object")
        pins = store.stats()["pins"]
        sender.touch_sender_cache_item("foreign")
        assert store.stats()["pins"] == pins
        sender.release_sender_touches()
    finally:
        sender.close()


def test_a_marker_validates_only_while_the_store_holds_its_item(store_env):
    # vLLM validates the items of a request before it sends them: a marker names an item
    # the workers must find; an item with its data needs nothing from the store.
    sender = sv.ShmstoreSenderCache(make_config())
    try:
        (out, _), = merge(sender, ["v"])
        assert sv.is_marker(out)
        sender.validate_input_item(out, "v")
        sender.validate_input_item(make_item("absent"), "absent")
        sender.store.delete("v")
        with pytest.raises(ValueError, match="v is not in the shmstore cache"):
            sender.validate_input_item(out, "v")
    finally:
        sender.close()


def test_a_miss_lets_go_of_the_item_and_its_updates(store_env, caplog):
    # The engine core missed "m~": deleted by hand while the window pinned it, and
    # stored again since by another front-end. The front-end lets go of its pins on it
    # (the window's and a touch's), and forgets its updates: the request vLLM retries
    # processes the item again.
    config = make_config()
    sender, other = sv.ShmstoreSenderCache(config), sv.ShmstoreSenderCache(config)
    store = sender.store
    try:
        merge(sender, ["m~"])
        assert sender.is_cached(["m~"]) == [True]  # touched, and in the window
        store.delete("m~")
        merge(other, ["m~"])
        other.close()
        before = store.stats()
        assert before["draining"] == 1  # the old object, held by the window's pin
        with caplog.at_level(logging.WARNING, logger="shmstore.vllm"):
            sender.invalidate("m~")
        assert not sender.inline_only and "inline" not in caplog.text
        after = store.stats()
        assert after["draining"] == 0 and after["pins"] == before["pins"] - 1
        assert sender.is_cached(["m~"]) == [False]
        sender.release_sender_touches()
        # A miss on the very object this front-end sent and still pins, the store's
        # still: the engine core cannot see the store, which the log says once.
        merge(sender, ["n"])
        with caplog.at_level(logging.WARNING, logger="shmstore.vllm"):
            sender.invalidate("n")
        assert sender.inline_only
        assert caplog.text.count("Sending items inline from now on") == 1, caplog.text
    finally:
        sender.close()
        other.close()


def test_an_item_that_finds_the_store_full_of_pinned_items_goes_inline(store_env):
    # Readers pin every byte of the store: nothing can be evicted, and the item goes
    # inline (as vLLM would send it) rather than failing the request.
    sender = sv.ShmstoreSenderCache(make_config(cache_mb=16, max_object_mb=16))
    store = sender.store
    try:
        held = []
        for i in range(64):
            try:
                store.put(f"held-{i}", bytes(1 << 20))
            except shmstore.ShmstoreError:
                break
            held.append(store.get(f"held-{i}"))
        item = MultiModalKwargsItem({"x": MultiModalFieldElem(
            data=torch.ones(1 << 19), field=MultiModalBatchedField())})  # 2 MiB
        out, updates = sender.get_and_update_item((item, ["u"]), "no room")
        assert out is item and updates == ["u"]
        assert not store.contains("no room") and all(store.contains(f"held-{i}") for i in range(len(held)))
        assert sender.is_cached(["no room"]) == [False]
        sender.release_sender_touches()
    finally:
        sender.close()


def test_the_bookkeeping_stays_bounded_oldest_first_and_recent_hits_last(store_env, monkeypatch):
    # A front-end runs for months: what it remembers is bounded (small bounds here). The
    # window holds at most _MAX_INFLIGHT sends; the list of items it stored (what its
    # clear deletes) keeps the newest _MAX_UPDATES; prompt updates, once twice that many,
    # drop those of items the store no longer holds first, then the least recently used.
    monkeypatch.setattr(sender_module, "_MAX_UPDATES", 4)
    monkeypatch.setattr(sender_module, "_MAX_INFLIGHT", 2)
    sender = sv.ShmstoreSenderCache(make_config(), inflight_fraction=1.0)
    store = sender.store
    try:
        hashes = [f"h{i}" for i in range(8)]
        for h in hashes:
            merge(sender, [h])
        assert list(sender._inflight) == ["h6", "h7"]
        assert list(sender._updates) == hashes, "under twice the bound: all kept"
        store.delete("h1")
        assert sender.is_cached(["h0"]) == [True]
        sender.get_and_update_item(None, "h0")  # a hit: h0 is the most recently used
        sender.release_sender_touches()
        merge(sender, ["h8"])
        assert list(sender._updates) == ["h6", "h7", "h0", "h8"]
        # The clear deletes what this front-end stored last (but the window's pins).
        sender.clear_cache()
        assert [h for h in hashes + ["h8"] if store.contains(h)] == ["h0", "h2", "h3", "h4", "h8"]
    finally:
        sender.close()


def test_an_item_stored_again_is_pinned_in_the_window_not_the_object_it_replaces(store_env):
    # "r" was sent (the window pins it) and deleted by hand; sent again with its data (as
    # vLLM's inject_into_mm_cache sends, no touch first), it is a new object: the window
    # must pin that one, not keep its pin on the old bytes.
    sender = sv.ShmstoreSenderCache(make_config())
    store = sender.store
    try:
        sender.get_and_update_item((make_item("r"), make_updates("r")), "r")
        store.delete("r")
        assert store.stats()["draining"] == 1
        out, _ = sender.get_and_update_item((make_item("r"), make_updates("r")), "r")
        assert sv.is_marker(out)
        assert store.stats()["draining"] == 0, "the old object's pin is let go"
        assert not store.delete_unpinned("r"), "the new object is pinned"
    finally:
        sender.close()


def test_closing_lets_go_of_every_pin_touches_included(store_env):
    # vLLM closes the cache at shutdown, perhaps mid-request (touched, not released):
    # nothing of this front-end's may stay pinned in a store other processes go on using.
    sender = sv.ShmstoreSenderCache(make_config(), inflight_fraction=1e-9)
    store = sender.store
    merge(sender, ["t1"])
    merge(sender, ["t2"])  # the window moved past t1
    assert sender.is_cached(["t1", "t2"]) == [True, True]
    assert store.stats()["pins"] == 2
    sender.close()
    assert store.stats()["pins"] == 0


def window_bytes_add_up(sender) -> bool:
    """Whether the window's byte count is the sum of its sends' sizes (its budget's
    base)."""
    return sender._inflight_bytes == sum(n for _, n in sender._inflight.values())


def test_an_item_reported_cached_from_the_window_stays_pinned_when_the_window_moves_on(narrow_sender):
    # "b" is cached and in the window (the newest send alone, here). The next request
    # names "b" (reported cached) and a new item "c", which pushes "b" out of the
    # window: "b" must stay pinned by the request's touch until the request is merged.
    sender = narrow_sender
    store = sender.store
    merge(sender, ["a"])
    merge(sender, ["b"])
    assert sender.is_cached(["b", "c"]) == [True, False]
    sender.get_and_update_item((make_item("c"), make_updates("c")), "c")
    assert list(sender._inflight) == ["c"] and window_bytes_add_up(sender)
    assert not store.delete_unpinned("b"), "touched: pinned until merged"
    sender.get_and_update_item(None, "b")
    sender.release_sender_touches()
    assert not store.delete_unpinned("b"), "sent: in the window"


def test_an_item_sent_again_is_the_newest_of_the_window(store_env, monkeypatch):
    # The window lets go of its oldest sends first; an item sent again (a hit) is the
    # newest.
    monkeypatch.setattr(sender_module, "_MAX_INFLIGHT", 2)
    sender = sv.ShmstoreSenderCache(make_config(), inflight_fraction=1.0)
    try:
        for h in ("a", "b"):
            merge(sender, [h])
        assert sender.is_cached(["a"]) == [True]
        sender.get_and_update_item(None, "a")
        sender.release_sender_touches()
        merge(sender, ["c"])
        assert list(sender._inflight) == ["a", "c"] and window_bytes_add_up(sender)
    finally:
        sender.close()


def test_a_request_keeps_its_items_sent_again_in_the_window_as_its_new_ones(narrow_sender):
    # A request's items all stay in the window until it is merged, however small its
    # budget: those sent again (hits) as much as those sent for the first time.
    sender = narrow_sender
    merge(sender, ["x"])
    for h in ("x", "y", "z"):
        sender.touch_sender_cache_item(h)
    assert sender.is_cached(["x", "y", "z"]) == [True, False, False]
    sender.get_and_update_item(None, "x")
    for h in ("y", "z"):
        sender.get_and_update_item((make_item(h), make_updates(h)), h)
    assert list(sender._inflight) == ["x", "y", "z"]
    sender.release_sender_touches()
    merge(sender, ["next"])
    assert list(sender._inflight) == ["next"] and window_bytes_add_up(sender)


def test_the_windows_byte_count_follows_what_it_lets_go(store_env):
    # A send the window lets go of because its object was deleted (and stored again)
    # leaves the byte count that the window's budget is measured against.
    config = make_config()
    sender, other = sv.ShmstoreSenderCache(config), sv.ShmstoreSenderCache(config)
    try:
        merge(sender, ["w1", "w2"])
        sender.store.delete("w1")
        merge(other, ["w1"])
        assert sender.is_cached(["w1"]) == [True]  # the stale pin goes, a new one is taken
        assert list(sender._inflight) == ["w2"] and window_bytes_add_up(sender)
        sender.release_sender_touches()
        sender.invalidate("w2")
        assert list(sender._inflight) == [] and sender._inflight_bytes == 0
    finally:
        sender.close()
        other.close()


def test_a_hit_sent_without_a_touch_is_looked_up_and_pinned_in_the_window(narrow_sender):
    # vLLM reports an item cached (is_cached pins it) before it sends it; a caller that
    # sends a hit without asking first still gets it pinned in the window.
    sender = narrow_sender
    merge(sender, ["old"])
    merge(sender, ["new"])
    out, _ = sender.get_and_update_item(None, "old")
    assert sv.is_marker(out) and list(sender._inflight) == ["old"]
    assert not sender.store.delete_unpinned("old")


def test_prompt_updates_are_kept_most_recently_used_last(store_env):
    # The prompt updates a front-end keeps are trimmed least recently used first: an
    # item sent again with its data is the most recent, stored already or still being
    # written by another front-end (then it goes inline this once).
    sender = sv.ShmstoreSenderCache(make_config())
    store = sender.store
    try:
        merge(sender, ["u0", "u1", "u2"])
        sender.get_and_update_item((make_item("u0"), make_updates("u0")), "u0")
        assert list(sender._updates) == ["u1", "u2", "u0"]
        store.delete("u1")
        writing = store.create_object("u1", 1 << 10)
        item = make_item("u1")
        assert sender.get_and_update_item((item, make_updates("u1")), "u1")[0] is item
        assert list(sender._updates) == ["u2", "u0", "u1"]
        writing.abort()
    finally:
        sender.close()


def test_sends_before_the_first_request_are_not_counted_as_its_items(narrow_sender):
    # Items injected before any request is merged (no touch) are not the first
    # request's: that request keeps its own items in the window, not those.
    sender = narrow_sender
    sender.get_and_update_item((make_item("injected"), []), "injected")
    merge(sender, ["a", "b"])
    assert list(sender._inflight) == ["a", "b"]


def object_size(sender, h: str) -> int:
    return len(sender.store.get(h))


def test_the_windows_budget_and_cap_are_reached_not_passed(store_env):
    # Sends outside a merge: the window holds as many as fit its budget exactly.
    probe = sv.ShmstoreSenderCache(make_config(cache_mb=64, max_object_mb=16))
    probe.get_and_update_item((float_item(1 << 18), []), "probe")
    n = object_size(probe, "probe")  # every item below is this size
    probe.close()
    capacity = 64 << 20
    sender = sv.ShmstoreSenderCache(make_config(cache_mb=64, max_object_mb=16),
                                    inflight_fraction=2 * n / capacity)
    try:
        for i in range(3):
            sender.get_and_update_item((float_item(1 << 18, float(i + 1)), []), f"b{i}")
            assert object_size(sender, f"b{i}") == n
        assert list(sender._inflight) == ["b1", "b2"]
    finally:
        sender.close()
    # A request's items: all of them, up to the cap exactly (here the budget, over half
    # the store: items of 8 MiB and more, four of them).
    probe = sv.ShmstoreSenderCache(make_config(cache_mb=64, max_object_mb=16))
    probe.get_and_update_item((float_item(1 << 21), []), "probe8")
    n = object_size(probe, "probe8")
    probe.close()
    sender = sv.ShmstoreSenderCache(make_config(cache_mb=64, max_object_mb=16),
                                    inflight_fraction=4 * n / capacity)
    try:
        hashes = [f"c{i}" for i in range(5)]
        for h in hashes:
            sender.touch_sender_cache_item(h)
        for i, h in enumerate(hashes):
            sender.get_and_update_item((float_item(1 << 21, float(i + 1)), []), h)
            if i == 3:
                assert list(sender._inflight) == hashes[:4]
        assert list(sender._inflight) == hashes[1:]
        sender.release_sender_touches()
    finally:
        sender.close()


def test_the_latest_send_stays_pinned_even_when_over_half_the_store(store_env):
    # A send larger than everything the window may hold is still the latest: it stays
    # pinned until the next one, or the store could evict it before the engine core
    # admits its request.
    sender = sv.ShmstoreSenderCache(make_config(cache_mb=64, max_object_mb=64))
    try:
        sender.get_and_update_item((float_item(10 << 20), []), "40 MiB")
        assert list(sender._inflight) == ["40 MiB"]
        assert not sender.store.delete_unpinned("40 MiB")
    finally:
        sender.close()


def test_an_item_being_stored_again_during_a_clear_is_deleted_by_the_next_clear(narrow_sender):
    # The front-end stored "s"; it was deleted since, and another writer is storing it
    # again when this front-end's cache is cleared: the clear cannot delete an object
    # still being written, and keeps it on its list for the next clear.
    sender = narrow_sender
    store = sender.store
    merge(sender, ["s"])
    merge(sender, ["t"])  # the window moved past "s"
    store.delete("s")
    writing = store.create_object("s", 1 << 10)
    sender.clear_cache()
    writing.seal()
    assert store.contains("s")
    sender.clear_cache()
    assert not store.contains("s")
