"""The item format of the vLLM plugin: a ``MultiModalKwargsItem`` as one shmstore item
(its tensors as arrays, its structure as a small JSON string), and the marker that crosses
vLLM's RPC in its place.

Invariants: ``decode_item(encode_item(x))`` equals ``x`` for every item vLLM 0.34 builds
(field kinds and parameters, nesting, bfloat16, strings up to ``MAX_STRING``); anything
else raises ``Unsupported`` (or the JSON encoder's ``TypeError``, which the sender treats
alike) before a byte is written, and the item goes inline. A structure read back is validated
(format number, field kinds) before use: another process wrote it.
"""

from __future__ import annotations

import functools
import json
import operator
import warnings
from typing import Any

import msgspec
import torch

from vllm.multimodal.inputs import (
    MultiModalBatchedField,
    MultiModalFieldConfig,
    MultiModalFieldElem,
    MultiModalKwargsItem,
)

from ..items import torch_spec

#: The one key of the item the workers receive instead of the data (its value: the
#: format version). The ``mm_hash`` the request carries for the item is the store key.
#:
#: The key is named ``address`` because that is how vLLM 0.34 recognises an item that
#: its workers resolve themselves (vLLM's own ``shm`` cache sends one), and it must
#: treat a marker the same way: ``strip_covered_mm_data`` keeps it whole when the prefix
#: cache covers the item (for an M-RoPE model such as Qwen2-VL the workers compute
#: positions from the item's ``image_grid_thw``), and the scheduler never replays it to
#: the model runner as a payload for re-encoding (``_get_encoder_input_updates``),
#: which would bypass the receiver cache. Its value is the format number, no address.
MARKER = "address"
FORMAT = 1
_STRUCTURE = "vllm"

_FIELD_KINDS = {"batched", "flat", "shared"}
#: The torch dtypes an item may hold, and their names in the item format.
_TORCH_DTYPES = {
    t: str(t).removeprefix("torch.")
    for t in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
_MiB = 1 << 20
_ITEMSIZE = {name: torch.empty((), dtype=t).element_size() for t, name in _TORCH_DTYPES.items()}
# Views of read-only shared memory: torch warns that the buffer is not writable (by design:
# a write faults in a read-only attach). Said once in docs/security.md instead of per tensor.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
#: The longest string an item holds (in characters); an item with a longer one goes inline.
MAX_STRING = 4096


class Unsupported(ValueError):
    """An item that cannot be a shmstore item; it goes inline instead. ``reason`` groups
    the cases for the log (one line per reason)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason



@functools.cache
def _field_layout(cls) -> tuple[str, tuple[tuple[str, bool], ...]] | None:
    """A field class's factory name (vLLM's own table) and its parameters, each with
    whether it holds slices; None for a class we do not store. Once per class: the
    front-end asks for every element of every item."""
    import dataclasses

    from vllm.v1.serial_utils import MMF_CLASS_TO_FACTORY

    name = MMF_CLASS_TO_FACTORY.get(cls)
    if name not in _FIELD_KINDS:
        return None
    return name, tuple((f.name, f.name == "slices") for f in dataclasses.fields(cls))


def _field_kind(field) -> list[Any]:
    """``[factory name, parameters]`` of a field, as the item's structure records it."""
    layout = _field_layout(type(field))  # type: ignore[arg-type]  # vLLM untyped here
    if layout is None:
        raise Unsupported("field", f"field type {type(field).__name__}")
    name, params = layout
    return [name, {p: _slices_out(getattr(field, p)) if sl else getattr(field, p) for p, sl in params}]


def _slices_out(v):
    """A flat field's ``slices`` as JSON: lists, tuples (``flat_from_sizes`` makes a tuple
    per item, ``(slice(None),) * dim + (slice(a, b),)``) and slices, whose bounds it
    makes from 0-d tensors (``flat_from_sizes`` sums the sizes with ``accumulate``)."""
    if isinstance(v, slice):
        return {"s": [_bound(v.start), _bound(v.stop), _bound(v.step)]}
    if isinstance(v, list):
        return [_slices_out(x) for x in v]
    if isinstance(v, tuple):
        return {"u": [_slices_out(x) for x in v]}
    raise Unsupported("field", f"flat field slices of type {type(v).__name__}")


def _bound(x):
    if x is None or type(x) is int:
        return x
    try:
        return operator.index(x)  # an int, or an integer tensor of one element
    except TypeError:
        raise Unsupported("field", f"a slice bound of type {type(x).__name__}") from None


def _slices_in(v):
    if isinstance(v, dict):
        if "u" in v:
            return tuple(_slices_in(x) for x in v["u"])
        return slice(*v["s"])
    return [_slices_in(x) for x in v]


# msgspec's JSON encoder is ~15x faster than json.dumps here, and vLLM depends on it (its
# engine RPC is msgspec), so wherever this module can be imported, so can msgspec.
_json_encoder = msgspec.json.Encoder()


def _to_json(obj: Any) -> str:
    return _json_encoder.encode(obj).decode()


class _Described:
    """An item's tensors as ``_data_out`` finds them: each one's spec for ``put_item``
    (``(name, dtype, shape, buffer)``), the tensor, and their total bytes. Walking the
    item once for all three is what the front-end pays per item, so it is one pass."""

    __slots__ = ("specs", "tensors", "nbytes")

    def __init__(self) -> None:
        self.specs: list[tuple[str, str, tuple[int, ...], Any]] = []
        self.tensors: list[torch.Tensor] = []
        self.nbytes = 0


def _data_out(x, out: _Described):
    """``x`` as JSON, its tensors moved to ``out``. A module-level function, not a
    closure: a recursive closure is a reference cycle, which would keep the tensors (and
    on the worker side, the pins of its tensors) alive until the garbage collector runs."""
    if isinstance(x, torch.Tensor):
        if not x.is_cpu:
            raise Unsupported("device", f"a tensor on {x.device}")
        dt = _TORCH_DTYPES.get(x.dtype)
        if dt is None:
            raise Unsupported("dtype", f"dtype {x.dtype}")
        name = f"t{len(out.tensors)}"
        out.tensors.append(x)
        out.specs.append(torch_spec(name, dt, x))
        out.nbytes += x.nbytes
        return {"t": name}
    if isinstance(x, bool):
        return {"b": x}
    if isinstance(x, int):
        return {"i": x}
    if isinstance(x, float):
        return {"f": x}
    if x is None:
        return None
    if isinstance(x, str):
        if len(x) > MAX_STRING:
            raise Unsupported("type", f"a string of {len(x)} characters (at most {MAX_STRING} are stored)")
        return {"z": x}
    if isinstance(x, list):
        return {"l": [_data_out(e, out) for e in x]}
    if isinstance(x, tuple):
        return {"u": [_data_out(e, out) for e in x]}
    raise Unsupported("type", f"a value of type {type(x).__name__}")


def _data_in(x, arrays: dict[str, Any]):
    """The value ``_data_out`` encoded, its tensors taken from ``arrays`` (see there why
    this is not a closure)."""
    if x is None:
        return None
    ((tag, v),) = x.items()
    if tag == "t":
        return arrays[v]
    if tag in ("i", "f", "b", "z"):
        return v
    if tag == "l":
        return [_data_in(e, arrays) for e in v]
    if tag == "u":
        return tuple(_data_in(e, arrays) for e in v)
    raise ValueError(f"unknown tag {tag!r} in a shmstore item")


def encode_item(item: MultiModalKwargsItem) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The arrays and metadata of a shmstore item holding ``item``: every tensor becomes
    one array (copied once by ``put_item``); the structure (keys, field kinds and their
    parameters, nesting of lists and tuples, plain numbers) is one small JSON string.
    Raises ``Unsupported`` for anything else (a GPU tensor, an exotic dtype, a string)."""
    out, meta = describe_item(item)
    return {spec[0]: t for spec, t in zip(out.specs, out.tensors)}, meta


def describe_item(item: MultiModalKwargsItem) -> tuple[_Described, dict[str, Any]]:
    """``encode_item``'s work in the form ``put_described`` takes: the front-end's path."""
    out = _Described()
    # `.data`: the item's own dict (a UserDict's documented attribute), iterated without
    # the Mapping mixin's per-element calls.
    elems = item.data
    if all(type(e.data) is torch.Tensor for e in elems.values()):
        # The common case, one tensor per key: the structure depends on the keys and the
        # field objects alone (see _structure_of).
        for e in elems.values():
            _data_out(e.data, out)
        return out, {_STRUCTURE: _structure_of(elems)}
    keys = [
        {"k": key, "field": _field_kind(elem.field), "data": _data_out(elem.data, out)}
        for key, elem in elems.items()
    ]
    return out, {_STRUCTURE: _to_json({"v": FORMAT, "keys": keys})}


#: Structures of items whose every key holds one tensor, by their keys and the identity of
#: their field objects: (key, id(field)) per key -> (the fields, the JSON text). vLLM's
#: processor builds the items of one request around shared field objects (one per key,
#: ``MultiModalKwargsItems.from_hf_inputs``), and a flat field lists the slices of every
#: item of the request: describing its fields for each item anew would cost the
#: request's item count squared. Holding the fields keeps their ids from being reused
#: while the entry lives. Fields are frozen dataclasses that vLLM does not change after
#: building them.
_STRUCTURES: dict[tuple[tuple[str, int], ...], tuple[tuple[Any, ...], str]] = {}
_MAX_STRUCTURES = 256


def _structure_of(elems: dict[str, MultiModalFieldElem]) -> str:
    key = tuple((k, id(e.field)) for k, e in elems.items())
    hit = _STRUCTURES.get(key)
    if hit is not None:
        return hit[1]
    text = _to_json({
        "v": FORMAT,
        "keys": [
            {"k": k, "field": _field_kind(e.field), "data": {"t": f"t{i}"}}
            for i, (k, e) in enumerate(elems.items())
        ],
    })
    if len(_STRUCTURES) >= _MAX_STRUCTURES:
        _STRUCTURES.clear()  # requests rarely share fields with old ones: start afresh
    _STRUCTURES[key] = (tuple(e.field for e in elems.values()), text)
    return text


@functools.lru_cache(maxsize=4096)
def _structure(text: str):
    """A parsed item structure, with its fields built: items of one model repeat a
    handful of structures, so parsing them once per worker is enough (fields are frozen
    dataclasses, safe to share)."""
    structure = json.loads(text)
    if structure.get("v") != FORMAT:
        raise ValueError(f"shmstore item format {structure.get('v')}, expected {FORMAT}")
    keys = []
    for k in structure["keys"]:
        kind, kw = k["field"]
        if kind not in _FIELD_KINDS:
            raise ValueError(f"unknown field kind {kind!r} in a shmstore item")
        kw = dict(kw)
        if "slices" in kw:
            kw["slices"] = _slices_in(kw["slices"])
        keys.append((k["k"], getattr(MultiModalFieldConfig, kind)("", **kw).field, k["data"]))
    return keys


def decode_item(arrays: dict[str, Any]) -> MultiModalKwargsItem:
    """The ``MultiModalKwargsItem`` an item holds, its tensors being ``arrays``'s
    (zero-copy views of the shared object, as ``get_item(..., as_torch=True)`` returns)."""
    meta = arrays.get("__meta__") or {}
    return MultiModalKwargsItem(
        {key: MultiModalFieldElem(data=_data_in(d, arrays), field=field) for key, field, d in _structure(meta[_STRUCTURE])}
    )


def marker_item() -> MultiModalKwargsItem:
    """What crosses vLLM's RPC for an item in the store: no data, no address, no
    signature. The receiver looks the item up by the request's ``mm_hash``.

    A new item each time (vLLM's items are mutable), built around ``UserDict.__init__``,
    whose generic ``update`` costs more than the rest of a hit in the sender."""
    item = _new_item(MultiModalKwargsItem)
    item.data = {MARKER: MultiModalFieldElem(FORMAT, _MARKER_FIELD)}
    return item


_new_item = MultiModalKwargsItem.__new__


#: The marker's field (frozen, so one instance serves every marker).
_MARKER_FIELD = MultiModalBatchedField()


def is_marker(item: MultiModalKwargsItem | None) -> bool:
    """Whether ``item`` is a marker: the item is in the store under the request's
    ``mm_hash``."""
    return item is not None and len(item) == 1 and MARKER in item and item[MARKER].data == FORMAT
