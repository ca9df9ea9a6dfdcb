"""The engine core's gate (``ShmstoreEngineGate``): it pins every item of a request it
admits, one pin per object, until the request is done, and turns a missing item into
vLLM's ``MultiModalCacheMissError`` naming every missing key."""

import gc

import pytest
from harness import make_config, make_item

import shmstore
from shmstore import vllm as sv


def test_the_gate_holds_one_pin_per_object_for_as_long_as_a_request_names_it(store):
    from vllm.multimodal.cache.base import MultiModalCacheMissError
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    for h in ("a", "b"):
        shmstore.put_item(store, h, *sv.encode_item(make_item(h)))
    gate = sv.ShmstoreEngineGate(store=store)

    def request(*keys):
        return [
            MultiModalFeatureSpec(data=sv.marker_item(), modality="image", identifier=k,
                                  mm_position=PlaceholderRange(offset=0, length=1), mm_hash=k)
            for k in keys
        ]

    r1, r2 = request("a", "b"), request("a")
    assert gate.get_and_update_features(r1) is r1 and gate.get_and_update_features(r2) is r2
    assert gate.pins.objects() == 2 and store.stats()["pins"] == 2  # one per object
    del r1
    assert gate.pins.objects() == 1 and store.stats()["pins"] == 1  # "a": r2 names it
    del r2
    assert gate.pins.objects() == 0 and store.stats()["pins"] == 0
    # A miss names every missing key; what the request's other markers pinned goes
    # with the request.
    with pytest.raises(MultiModalCacheMissError) as miss:
        gate.get_and_update_features(request("gone", "a", "also-gone"))
    assert miss.value.mm_hashes == ["gone", "also-gone"]
    del miss
    gc.collect()  # the traceback held the request's frame
    assert gate.pins.objects() == 0 and store.stats()["pins"] == 0
    # Items sent inline and items the prefix cache covered are not looked up.
    inline = request("not-in-store")
    inline[0].data = make_item("not-in-store")
    covered = request("nor-this")
    covered[0].data = None
    gate.get_and_update_features(inline + covered)
    assert gate.pins.objects() == 0
    # The key is the item's mm_hash, which the front-end stored it under; the feature's
    # identifier carries a LoRA prefix where the request has an adapter.
    lora = request("a")
    lora[0].identifier = "lora-1:a"
    gate.get_and_update_features(lora)
    assert gate.pins.objects() == 1
    # vLLM's per-item entry hands the item on unchanged.
    marker = sv.marker_item()
    assert gate.get_and_update_item(marker, "a") is marker


def test_the_engine_core_attaches_read_only(store_env):
    # It only pins what the front-ends wrote: a stray write from its process faults, and
    # creating or deleting objects is refused.
    sv.open_store(make_config()).put("x", b"front-end's")
    gate = sv.ShmstoreEngineGate(make_config())
    with pytest.raises(shmstore.ReadOnly):
        gate.store.put("y", b"engine core's")
    with pytest.raises(shmstore.ReadOnly):
        gate.store.delete("x")


def test_a_pin_released_while_the_gate_takes_another_is_released_on_its_next_call(store):
    # vLLM frees requests on its busy loop while its input thread admits new ones, and a
    # garbage collection can free one inside ``pin`` on the same thread: the release
    # never waits for the lock, and is done by the next call.
    from shmstore.vllm.gate import RequestPins

    store.put("k", b"x")
    pins = RequestPins(store)
    ident = pins.pin("k")
    with pins._lock:  # as if the release came while a pin is being taken
        pins.unpin(ident)
        assert len(pins._held) == 1
    assert pins.objects() == 0 and store.stats()["pins"] == 0
    # The same, the next call being a pin for another request.
    ident = pins.pin("k")
    with pins._lock:
        pins.unpin(ident)
    store.put("next", b"y")
    pins.pin("next")
    assert store.stats()["pins"] == 1  # the next request's; "k" went as that call began
    assert pins.objects() == 1


def test_the_gate_pins_objects_not_keys(store):
    # A key deleted and stored again names another object: a request admitted before
    # holds the old one (draining until the request goes), one admitted after holds the
    # new one, each with a pin of its own.
    from shmstore.vllm.gate import RequestPins

    store.put("k", b"old")
    pins = RequestPins(store)
    old = pins.pin("k")
    store.delete("k")
    store.put("k", b"new")
    new = pins.pin("k")
    assert old != new and pins.objects() == 2
    assert (store.stats()["pins"], store.stats()["draining"]) == (2, 1)
    pins.unpin(old)
    assert pins.objects() == 1
    assert (store.stats()["pins"], store.stats()["draining"]) == (1, 0)
    assert bytes(store.try_get("k")) == b"new"
    pins.unpin(new)
    assert pins.objects() == 0 and store.stats()["pins"] == 0
