"""An item's prompt updates as part of the item, so that every front-end of an instance
can reuse an item another front-end processed, without running the HF processor again.

vLLM's processor asks the cache for two things per item: the tensors (the item) and the
*prompt updates*, the placeholder tokens the item takes in the prompt
(``ResolvedPromptUpdate``: modality, mode, the target tokens to replace or insert at, the
new tokens, and which of them get embeddings). The tensors are in the store; the updates
are Python objects that each front-end used to keep to itself. Here they become a short
JSON text in the item's metadata, written with the item.

Invariants:

* Only data is written: token lists, the modality, the mode, and the two forms of
  ``is_embed`` that vLLM's own helpers build (``PromptUpdateDetails.select_token_id`` and
  ``select_token_ids``, recognised by their code and rebuilt with the same helper). Any
  other update (a ``PromptIndex`` target, a model's own ``is_embed`` function, a subclass,
  a field a newer vLLM adds) makes the whole list unshareable: ``encode_updates`` returns
  None, and other front-ends process that item themselves, as before.
* Nothing is unpickled: another process wrote the text, so ``decode_updates`` parses it
  against a fixed schema (format number, types of every field, known modes) and returns
  None for anything else; the caller then processes the item itself.
* ``decode_updates(encode_updates(u))`` equals ``u`` field for field, ``is_embed`` giving
  the same mask.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import msgspec

from vllm.multimodal.processing.processor import (
    PromptUpdateDetails,
    ResolvedPromptUpdate,
    UpdateMode,
)

#: The item metadata key that holds the updates.
META_KEY = "prompt_updates"
#: The format number, first in the text: a front-end of another format ignores it.
FORMAT = 1

#: The text: ``[FORMAT, [update, ...]]``, each update ``[modality, item index, mode,
#: target tokens, content tokens, is_embed]`` with ``is_embed`` None (every token), an
#: int (``select_token_id``) or a list of ints (``select_token_ids``).
_decoder = msgspec.json.Decoder(
    tuple[int, list[tuple[str, int, str, list[int], list[int], int | list[int] | None]]])
_encoder = msgspec.json.Encoder()

#: vLLM 0.34's fields; an update with any other set (a newer vLLM) is not shared.
_UPDATE_FIELDS = ("modality", "item_idx", "mode", "target", "content")
_DETAILS_FIELDS = ("full", "is_embed")
_MODES = {m.value: m for m in UpdateMode}

#: The ``is_embed`` closures of vLLM's helpers: (qualified name, its one free variable).
_SELECT_ONE = (f"{PromptUpdateDetails.__qualname__}.select_token_id.<locals>.is_embed", "embed_token_id")
_SELECT_MANY = (f"{PromptUpdateDetails.__qualname__}.select_token_ids.<locals>.is_embed", "embed_token_ids")


class _NotShareable(Exception):
    pass


def _fields_are(cls, names: tuple[str, ...]) -> bool:
    return tuple(f.name for f in dataclasses.fields(cls)) == names


_SHAREABLE_CLASSES = _fields_are(ResolvedPromptUpdate, _UPDATE_FIELDS) and _fields_are(
    PromptUpdateDetails, _DETAILS_FIELDS)


def _embed_out(fn) -> int | list[int] | None:
    """``is_embed`` as data: None, the token id of ``select_token_id`` or the ids of
    ``select_token_ids``; anything else is not shareable."""
    if fn is None:
        return None
    code = getattr(fn, "__code__", None)
    closure = getattr(fn, "__closure__", None)
    if code is None or not closure or getattr(fn, "__module__", None) != PromptUpdateDetails.__module__:
        raise _NotShareable
    for qualname, var in (_SELECT_ONE, _SELECT_MANY):
        if fn.__qualname__ == qualname and code.co_freevars == (var,):
            value = closure[0].cell_contents
            if var == "embed_token_id" and type(value) is int:
                return value
            if var == "embed_token_ids" and type(value) is list:
                return list(value)
    raise _NotShareable


def encode_updates(updates: Sequence[Any]) -> str | None:
    """The JSON text of an item's prompt updates, or None if they are not all plain
    data (see the module header). Costs a few microseconds plus about 5 ns per token."""
    if not _SHAREABLE_CLASSES or not isinstance(updates, (list, tuple)):
        return None
    out = []
    try:
        for u in updates:
            if type(u) is not ResolvedPromptUpdate:
                return None
            content = u.content
            if type(content) is not PromptUpdateDetails or type(u.target) is not list:
                return None
            if type(content.full) is not list or type(u.modality) is not str:
                return None
            if type(u.item_idx) is not int:
                return None
            out.append((u.modality, u.item_idx, str(u.mode.value), u.target, content.full,
                        _embed_out(content.is_embed)))
        # Token lists are checked on the way back (typed decoder): a value of another
        # type there makes the text unreadable, so other front-ends process the item.
        return _encoder.encode((FORMAT, out)).decode()
    except (_NotShareable, TypeError, AttributeError, ValueError):
        return None


def decode_updates(text: object) -> list[ResolvedPromptUpdate] | None:
    """The prompt updates ``encode_updates`` wrote, or None if ``text`` is missing,
    of another format, or not what it should be (another process wrote it)."""
    if not isinstance(text, str) or not _SHAREABLE_CLASSES:
        return None
    try:
        version, updates = _decoder.decode(text)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    if version != FORMAT:
        return None
    out = []
    for modality, item_idx, mode, target, full, embed in updates:
        m = _MODES.get(mode)
        if m is None:
            return None
        if embed is None:
            content = PromptUpdateDetails.from_seq(full)
        elif isinstance(embed, int):
            content = PromptUpdateDetails.select_token_id(full, embed)
        else:
            content = PromptUpdateDetails.select_token_ids(full, embed)
        # The processor sets the item's index in the request it serves anyway
        # (``_recompute_cached_prompt_update``), for updates cached locally too.
        out.append(ResolvedPromptUpdate(modality=modality, item_idx=item_idx, mode=m, target=target,
                                        content=content))
    return out
