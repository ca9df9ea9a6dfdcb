"""The item format: every vLLM field kind and parameter, dtypes (bfloat16 exact), nesting,
zero-copy on the way back; the marker through vLLM's msgpack; the inline fallback."""

import gc
import os
import subprocess
import sys

import pytest
import torch
from harness import digest, make_config, make_item, make_updates, same_updates
from vllm.multimodal.inputs import (
    MultiModalBatchedField,
    MultiModalFieldElem,
    MultiModalFlatField,
    MultiModalKwargsItem,
    MultiModalSharedField,
)
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

import shmstore
from shmstore import vllm as sv
from shmstore.vllm.prompt_updates import decode_updates, encode_updates
from shmstore.vllm.receiver import _get_torch_item


def roundtrip(store, item, key="k"):
    arrays, meta = sv.encode_item(item)
    shmstore.put_item(store, key, arrays, meta)
    arrays, _ = _get_torch_item(store, key, 1.0)
    return sv.decode_item(arrays)


@pytest.mark.parametrize("kind", ["image", "video", "nested", "shared", "request"])
def test_every_item_shape_comes_back_equal_field_by_field(store, kind):
    item = make_item(f"x-{kind}", kind=kind)
    back = roundtrip(store, item, kind)
    assert digest(back) == digest(item)
    for k in item:
        assert back[k].field == item[k].field  # kind and every parameter
        assert back[k] == item[k]


def test_field_parameters_slices_dims_and_keep_on_cpu_survive(store):
    t = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    item = MultiModalKwargsItem(
        {
            "flat2": MultiModalFieldElem(
                data=t, field=MultiModalFlatField(slices=[[slice(0, 3), slice(2, 5)]], dim=1)
            ),
            "flat": MultiModalFieldElem(
                data=t[:, :4], field=MultiModalFlatField(slices=[slice(1, None, 2)], dim=-1)
            ),
            "shared": MultiModalFieldElem(
                data=torch.ones(3, dtype=torch.bool),
                field=MultiModalSharedField(batch_size=7, keep_on_cpu=True),
            ),
            "num": MultiModalFieldElem(data=3, field=MultiModalBatchedField()),
            "tup": MultiModalFieldElem(
                data=(torch.zeros(2, dtype=torch.int8), torch.ones((), dtype=torch.float64)),
                field=MultiModalBatchedField(),
            ),
            "empty": MultiModalFieldElem(data=torch.empty(0, 5), field=MultiModalBatchedField()),
            "text": MultiModalFieldElem(data=["caption: ünïcode ✓", ""], field=MultiModalBatchedField()),
            "flags": MultiModalFieldElem(data=[True, False, 0.25, 7, None], field=MultiModalBatchedField()),
        }
    )
    back = roundtrip(store, item)
    assert back["text"].data == ["caption: ünïcode ✓", ""]
    # Booleans stay booleans (not the integers they also are), floats floats.
    assert back["flags"].data == [True, False, 0.25, 7, None]
    assert [type(v) for v in back["flags"].data] == [bool, bool, float, int, type(None)]
    assert digest(back) == digest(item)
    assert back["flat2"].field.slices == [[slice(0, 3), slice(2, 5)]]
    assert back["flat"].field.dim == -1 and back["shared"].field.batch_size == 7
    assert back["shared"].field.keep_on_cpu
    assert isinstance(back["tup"].data, tuple) and back["num"].data == 3


def _request_items(n: int, *, dim: int = 0):
    """The items of one request of ``n`` images as vLLM's processor builds them for
    Qwen2-VL (``MultiModalKwargsItems.from_hf_inputs``): every item's field is one shared
    object, and the flat field lists every item's slice, a tuple per item with bounds
    that ``flat_from_sizes`` sums into 0-d tensors."""
    from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItems

    sizes = torch.tensor([4 + i for i in range(n)])
    pix = torch.randn(int(sizes.sum()), 24) if dim == 0 else torch.randn(3, int(sizes.sum()))
    config = {
        "pixel_values": MultiModalFieldConfig.flat_from_sizes("image", sizes, dim=dim),
        "image_grid_thw": MultiModalFieldConfig.batched("image", keep_on_cpu=True),
    }
    hf = {"pixel_values": pix, "image_grid_thw": torch.tensor([[1, 2, int(s) // 2] for s in sizes])}
    return list(MultiModalKwargsItems.from_hf_inputs(hf, config)["image"])


@pytest.mark.parametrize("dim", [0, 1])
def test_the_items_of_a_request_as_vllms_processor_builds_them_come_back_equal(store, dim):
    items = _request_items(5, dim=dim)
    assert items[0]["pixel_values"].field is items[4]["pixel_values"].field  # shared
    bound = items[0]["pixel_values"].field.slices[1][dim].stop
    assert isinstance(bound, torch.Tensor), "flat_from_sizes makes 0-d tensor bounds"
    for i, item in enumerate(items):
        back = roundtrip(store, item, f"req-{dim}-{i}")
        for k in item:
            assert back[k].field == item[k].field, k  # every item's slice, as tuples
            assert torch.equal(back[k].data, item[k].data), k
        slices = back["pixel_values"].field.slices
        assert all(type(s) is tuple for s in slices) and type(slices[i][dim].stop) is int
        assert torch.equal(back["pixel_values"].data, item["pixel_values"].data)


def test_items_sharing_fields_are_described_once_per_request_and_the_same_as_alone(store):
    from shmstore.vllm import item_format

    items = _request_items(8)
    item_format._STRUCTURES.clear()
    structures = {sv.describe_item(item)[1]["vllm"] for item in items}
    assert len(structures) == 1 and len(item_format._STRUCTURES) == 1
    # The same text as describing the item key by key, without the cache.
    elems = items[3].data
    alone = item_format._to_json({"v": sv.FORMAT, "keys": [
        {"k": k, "field": item_format._field_kind(e.field), "data": {"t": f"t{i}"}}
        for i, (k, e) in enumerate(elems.items())]})
    assert structures == {alone}
    # A request with fields of its own gets an entry of its own.
    sv.describe_item(_request_items(2)[0])
    assert len(item_format._STRUCTURES) == 2


def test_the_structures_kept_for_requests_stay_bounded(store):
    # A server runs for weeks: one entry per request's fields must not grow for ever.
    from shmstore.vllm import item_format

    item_format._STRUCTURES.clear()
    bound = item_format._MAX_STRUCTURES
    for _ in range(bound + 10):
        item = _request_items(1)[0]  # fields of its own, as each request has
        sv.describe_item(item)
        assert 1 <= len(item_format._STRUCTURES) <= bound
    # Past the bound it starts afresh, and what it describes after is still right.
    assert len(item_format._STRUCTURES) == 10
    assert torch.equal(roundtrip(store, item, "after")["pixel_values"].data, item["pixel_values"].data)


def test_bfloat16_is_exact_and_tensors_are_zero_copy_and_pinned(store):
    bf = torch.randn(64, 33).to(torch.bfloat16)
    item = MultiModalKwargsItem({"v": MultiModalFieldElem(data=bf, field=MultiModalBatchedField())})
    back = roundtrip(store, item, "bf")
    assert back["v"].data.dtype == torch.bfloat16
    assert torch.equal(back["v"].data.view(torch.int16), bf.view(torch.int16))
    addr, length = store.heap_region
    assert addr <= back["v"].data.data_ptr() < addr + length, "the tensor is the shared bytes"
    assert store.stats()["pins"] == 1
    store.delete("bf")
    assert store.stats()["draining"] == 1  # the tensor keeps the object
    del back
    gc.collect()
    assert store.stats()["draining"] == 0


def test_the_marker_is_the_key_alone_and_survives_vllms_msgpack():
    m = sv.marker_item()
    assert set(m) == {sv.MARKER} and m[sv.MARKER].data == sv.FORMAT
    bufs = MsgpackEncoder().encode(m)
    assert sum(len(b) for b in bufs) < 64, "no address, no signature, no data"
    back = MsgpackDecoder(MultiModalKwargsItem).decode(bufs)
    assert back == m and sv.is_marker(back)


def test_only_the_marker_is_taken_for_a_marker():
    batched = MultiModalBatchedField()
    assert not sv.is_marker(None)  # prefix caching sends items with no data
    # A model's own key of that name, holding data, or beside other keys.
    assert not sv.is_marker(MultiModalKwargsItem({sv.MARKER: MultiModalFieldElem(torch.zeros(1), batched)}))
    assert not sv.is_marker(MultiModalKwargsItem({
        sv.MARKER: MultiModalFieldElem(sv.FORMAT, batched),
        "pixel_values": MultiModalFieldElem(torch.zeros(1), batched),
    }))
    assert not sv.is_marker(MultiModalKwargsItem({"other": MultiModalFieldElem(sv.FORMAT, batched)}))
    assert sv.is_marker(MultiModalKwargsItem({sv.MARKER: MultiModalFieldElem(sv.FORMAT, batched)}))


def _scheduler_replays(data):
    """What vLLM 0.34's scheduler sends the model runner for a request's item as the
    request is encoded, consumed, then rolled back (a failed KV load) and encoded again:
    ``encoder_input_updates``, which go to the model runner without the receiver cache.
    Runs the scheduler's own method on a stand-in for its state."""
    from types import SimpleNamespace

    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.core.sched.scheduler import Scheduler

    spec = MultiModalFeatureSpec(data=data, modality="image", identifier="h",
                                 mm_position=PlaceholderRange(offset=0, length=4), mm_hash="h")
    req = SimpleNamespace(mm_features=[spec], num_computed_tokens=0,
                          num_output_placeholders=0, num_in_flight_tokens=0)
    sched = SimpleNamespace(_pending_encoder_input_ids={}, requests={"r": req},
                            is_encoder_decoder=False)
    updates = Scheduler._get_encoder_input_updates
    out = [updates(sched, {"r": 4}, [SimpleNamespace(req_id="r", mm_features=[spec])], {"r": [0]})]
    req.num_computed_tokens = 8  # past the item: consumed
    out.append(updates(sched, {"r": 1}, [], {}))
    req.num_computed_tokens = 0  # rolled back: the item is encoded again
    out.append(updates(sched, {"r": 4}, [], {"r": [0]}))
    return [p for u in out for p in u.get("r", {}).values() if p is not None]


def test_vllms_scheduler_keeps_a_marker_whole_and_never_replays_it_past_the_receiver():
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.multimodal.utils import strip_covered_mm_data

    marker = sv.marker_item()
    # Covered by the prefix cache: kept whole, with or without M-RoPE (Qwen2-VL's workers
    # compute positions from image_grid_thw, which the worker then reads from the store).
    spec = MultiModalFeatureSpec(data=marker, modality="image", identifier="h",
                                 mm_position=PlaceholderRange(offset=0, length=4), mm_hash="h")
    for mrope in (False, True):
        (kept,) = strip_covered_mm_data([spec], num_computed_tokens=8, uses_mrope=mrope)
        assert kept.data is marker
    # A rollback replays an inline item's data to the model runner (the stand-in drives
    # the real path), never a marker: the model would get it in place of tensors.
    inline = make_item("replayed", kind="image")
    assert _scheduler_replays(inline) == [inline]
    assert _scheduler_replays(marker) == []


def test_items_it_cannot_hold_go_inline_with_one_log_line(store_env, caplog):
    sender = sv.ShmstoreSenderCache(make_config(max_object_mb=1))
    odd = MultiModalKwargsItem(
        {"c": MultiModalFieldElem(data=torch.zeros(2, dtype=torch.complex64), field=MultiModalBatchedField())}
    )
    for h in ("a", "b"):
        out, updates = sender.get_and_update_item((odd, ["u"]), f"odd-{h}")
        assert out is odd and updates == ["u"]
    big = make_item("big!")  # 12 MiB > 1 MiB
    out, _ = sender.get_and_update_item((big, ["u"]), "big!")
    assert out is big
    # A field parameter the format cannot write (a newer vLLM's, say): inline too.
    strange = MultiModalKwargsItem(
        {"x": MultiModalFieldElem(data=torch.zeros(2), field=MultiModalSharedField(batch_size=object()))}
    )
    out, _ = sender.get_and_update_item((strange, ["u"]), "strange")
    assert out is strange and not sender.store.contains("strange")
    assert sum("goes inline" in r.message for r in caplog.records) == 3
    big_mib = sum(e.data.nbytes for e in big.values()) / (1 << 20)
    assert f"({big_mib:.1f} MiB is over --mm-shm-cache-max-object-size-mb=1)" in caplog.text
    # The limit is vLLM's setting in MiB, and an item of exactly that size is stored.
    def floats(n):
        return MultiModalKwargsItem({"x": MultiModalFieldElem(data=torch.zeros(n), field=MultiModalBatchedField())})
    assert sv.is_marker(sender.get_and_update_item((floats(1 << 18), ["u"]), "1-mib")[0])
    over = floats((1 << 18) + 1)
    assert sender.get_and_update_item((over, ["u"]), "1-mib-and-4-bytes")[0] is over
    # Strings are stored up to 4096 characters (docs/vllm.md); longer ones go inline,
    # and the log line says why.
    assert sv.MAX_STRING == 4096
    short = MultiModalKwargsItem(
        {"s": MultiModalFieldElem(data="x" * sv.MAX_STRING, field=MultiModalBatchedField())})
    long = MultiModalKwargsItem(
        {"s": MultiModalFieldElem(data="x" * (sv.MAX_STRING + 1), field=MultiModalBatchedField())})
    assert sv.is_marker(sender.get_and_update_item((short, ["u"]), "short")[0])
    assert sender.get_and_update_item((long, ["u"]), "long")[0] is long
    assert "a string of 4097 characters (at most 4096 are stored)" in caplog.text
    assert not sender.is_cached_item("odd-a")
    sender.close()


def test_a_process_reading_items_prints_no_warning_about_read_only_buffers(store_env):
    # Torch warns, once per process, that a tensor over a buffer that is not writable can
    # be written through: true of every view of the store (by design; a write faults in a
    # read-only attach). Said once in docs/security.md, not on every worker's stderr. Run in a
    # process of its own: pytest's warning capture would undo the package's filter.
    code = """
import harness
harness.setup_process()
import shmstore
from shmstore import vllm as sv
from shmstore.vllm.receiver import _get_torch_item
store = sv.open_store(harness.make_config())
item = harness.make_item("w")
arrays, meta = sv.encode_item(item)
shmstore.put_item(store, "w", arrays, meta)
arrays, _ = _get_torch_item(store, "w", 1.0)
assert harness.digest(sv.decode_item(arrays)) == harness.digest(item)
print("read")
"""
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), capture_output=True,
                         text=True, timeout=120, cwd=os.path.dirname(__file__))
    assert out.returncode == 0 and out.stdout.strip() == "read", out.stderr[-2000:]
    assert "not writable" not in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("kind", ["image", "nested"])
def test_a_dropped_item_unpins_at_once_without_the_garbage_collector(store, kind):
    # A worker drops a request's items when the request ends: the pins must go with the
    # last reference, not at the next garbage collection (a reference cycle in the
    # decoder once kept them, so the store could not evict them and filled up).
    gc.disable()
    try:
        back = roundtrip(store, make_item(f"drop-{kind}", kind=kind), kind)
        assert store.stats()["pins"] > 0
        del back
        assert store.stats()["pins"] == 0
    finally:
        gc.enable()


def test_a_video_into_a_cache_full_of_small_items_evicts_about_its_own_size(store_env):
    # Image tiles fill the cache, then videos arrive. Eviction used to go on in table
    # order until two holes touched, which took most of the cache for one video; it now
    # widens a cold item's hole by address. The sender's window of recent sends (a
    # quarter of the store, pinned) stays where it is.
    def item(nbytes):
        return MultiModalKwargsItem({"pixel_values": MultiModalFieldElem(
            data=torch.zeros(nbytes // 4), field=MultiModalBatchedField())})

    sender = sv.ShmstoreSenderCache(make_config(cache_mb=128, max_object_mb=32))
    store = sender.store
    small = []
    while store.stats()["evictions"] == 0:
        h = f"tile-{len(small)}"
        sender.get_and_update_item((item(256 << 10), []), h)
        sender.release_sender_touches()
        small.append(h)
    per_video = (16 << 20) // (256 << 10)  # 64 tiles make room for one
    for j in range(3):
        before = store.stats()["evictions"]
        out, _ = sender.get_and_update_item((item(16 << 20), []), f"video-{j}")
        assert sv.is_marker(out), "the video went into the store"
        took = store.stats()["evictions"] - before
        assert took <= per_video + 8, f"video {j} evicted {took} tiles (needs {per_video})"
    left = sum(store.contains(h) for h in small)
    assert left >= len(small) - 3 * (per_video + 8), (left, len(small))
    sender.close()


# ----- prompt updates, stored with the item -------------------------------------------


@pytest.mark.parametrize("h", ["a", "b", "c", "d", "e", "f", "g"])
def test_prompt_updates_come_back_doing_the_same(h):
    updates = make_updates(h)
    text = encode_updates(updates)
    assert text is not None
    back = decode_updates(text)
    assert same_updates(back, updates)
    assert [type(u) for u in back] == [type(u) for u in updates]


def test_every_style_of_prompt_update_is_covered():
    # The parametrized hashes above reach all three styles of make_updates.
    styles = {(len(u := make_updates(h)), u[0].content.is_embed is None) for h in "abcdefg"}
    assert styles == {(1, True), (1, False), (2, False)}


def test_prompt_updates_that_are_not_plain_data_are_not_shared():
    from vllm.multimodal.processing.processor import (
        PromptUpdateDetails,
        ResolvedPromptUpdate,
        UpdateMode,
    )

    def update(target=(1,), content=None):
        content = content or PromptUpdateDetails.from_seq([5, 5])
        return ResolvedPromptUpdate("image", 0, UpdateMode.REPLACE, list(target) if isinstance(target, tuple)
                                    else target, content)

    class Details(PromptUpdateDetails):
        pass

    assert encode_updates(make_updates("x~")) is None  # a PromptIndex target
    assert encode_updates([update(content=PromptUpdateDetails([5], is_embed=lambda f: torch.ones(1)))]) is None
    assert encode_updates([update(content=Details([5]))]) is None
    assert encode_updates(["a string"]) is None
    assert encode_updates(make_updates("a") + [object()]) is None
    assert encode_updates(iter(make_updates("a"))) is None
    assert decode_updates(encode_updates([])) == []
    # Token lists are lists, the modality a string.
    assert encode_updates([update(content=PromptUpdateDetails.from_seq((5, 5)))]) is None
    assert encode_updates([ResolvedPromptUpdate(7, 0, UpdateMode.REPLACE, [1], PromptUpdateDetails.from_seq([5]))]) is None
    # Only vLLM's own two helpers, with the types they are written for: a function of
    # vLLM's module closing over a variable of the same name is not one of them, nor is
    # select_token_id given a float or a list, nor select_token_ids given a tuple.

    def closure_over(embed_token_id):
        def is_embed(tokens):
            return tokens == embed_token_id

        return is_embed

    lookalike = closure_over(5)
    lookalike.__module__ = PromptUpdateDetails.__module__
    assert encode_updates([update(content=PromptUpdateDetails([5], is_embed=lookalike))]) is None
    for odd in (5.0, [5, 6]):
        assert encode_updates([update(content=PromptUpdateDetails.select_token_id([5], odd))]) is None
    assert encode_updates([update(content=PromptUpdateDetails.select_token_ids([5], (5, 6)))]) is None


@pytest.mark.parametrize("text", [
    None, 7, "", "not json", "[1]", "[2,[]]", '[1,[["image",0,"bogus",[1],[1],null]]]',
    '[1,[["image",0,"replace",[1],["a"],null]]]', '[1,[["image",0,"replace",[1.5],[1],null]]]',
    '[1,[["image",0,"replace",[1],[1],"x"]]]', '[1,[["image",0,"replace",[1],[1]]]]',
    '{"v":1}', '[1,[["image",0,"replace",[true],[1],null]]]',
])
def test_prompt_updates_another_process_wrote_badly_are_ignored(text):
    assert decode_updates(text) is None
