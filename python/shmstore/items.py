"""Tensor items: a dict of named arrays (numpy arrays or torch tensors) plus small scalar
metadata, written as ONE store object with no pickle on the data path.

Layout (decoded and bounds-checked in Rust, ``shmstore::item``): a header with each
array's name, dtype, shape, byte offset and size, then each array's bytes, C-contiguous,
starting on a 64-byte boundary. ``put_item`` copies each array exactly once, straight into
shared memory; ``get_item`` returns arrays that *are* the shared memory (zero-copy,
read-only), pinned for as long as any of them is alive.

dtypes: float32, float16, bfloat16, float64, int64, int32, int16, int8, uint8, bool.
numpy has no bfloat16: ``get_item`` returns bfloat16 arrays as ``ml_dtypes.bfloat16`` if
that package is installed, else as a ``uint16`` view of the same bits (the upper halves
of float32s; ``x.astype(np.uint32) << 16`` viewed as float32 recovers the values). With
``as_torch=True`` arrays come back as torch tensors (bfloat16 included) via
``torch.frombuffer``. PyTorch has no read-only tensors: writing to such a tensor writes
to the shared object. Attach with ``Store.open(name, read_only=True)`` in workers that
only read, and the kernel turns such a write into a segmentation fault instead.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

from . import _native

try:  # numpy is needed for items, not for the raw store.
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]

_NP_NAMES = {
    "float32": "float32",
    "float16": "float16",
    "float64": "float64",
    "int64": "int64",
    "int32": "int32",
    "int16": "int16",
    "int8": "int8",
    "uint8": "uint8",
    "bool": "bool",
}


def _bf16_numpy_dtype():
    try:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    except ImportError:
        return np.dtype("uint16")


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


_TORCH_NAMES: dict[Any, str] = {}  # torch.dtype -> our dtype name, filled on first use


def _torch_names() -> dict[Any, str]:
    if not _TORCH_NAMES:
        import torch

        for name in (*_NP_NAMES, "bfloat16"):
            _TORCH_NAMES[getattr(torch, name)] = name
    return _TORCH_NAMES


def _spec(name: str, value) -> tuple[str, str, tuple[int, ...], Any]:
    """``(name, dtype, shape, bytes)`` of one array: ``bytes`` is a buffer of its bytes
    without copying if it is C-contiguous (and on the CPU), else None (then ``put_item``
    copies it element-wise, strides and all). One pass: this runs for every array of
    every item (the vLLM plugin's front-end pays it per item)."""
    if np is not None and type(value) is np.ndarray:
        dt = value.dtype.name
        if dt not in _NP_NAMES and dt != "bfloat16":
            raise TypeError(f"array {name!r}: dtype {value.dtype} is not supported in items")
        return name, dt, value.shape, value if value.flags.c_contiguous else None
    if _is_torch(value):
        dt = _torch_names().get(value.dtype)
        if dt is None:
            raise TypeError(f"array {name!r}: torch dtype {value.dtype} is not supported in items")
        if not value.is_cpu:
            raise TypeError(f"array {name!r} is on {value.device}: move it to the CPU first")
        return torch_spec(name, dt, value)
    if np is None:
        raise ImportError("put_item needs numpy (pip install numpy)")
    a = np.asarray(value)
    dt = a.dtype.name
    if dt not in _NP_NAMES and dt != "bfloat16":
        raise TypeError(f"array {name!r}: dtype {a.dtype} is not supported in items")
    return name, dt, tuple(int(d) for d in a.shape), a if a.flags.c_contiguous else None


def torch_spec(name: str, dt: str, value) -> tuple[str, str, tuple[int, ...], Any]:
    """``_spec`` of a CPU torch tensor whose dtype name ``dt`` the caller checked (the
    vLLM plugin checks while it walks an item, and calls this directly)."""
    buf = None
    if value.is_contiguous():
        t = value.detach() if value.requires_grad else value
        if dt == "bfloat16":  # numpy has no bfloat16: the same bytes as int16
            import torch

            t = t.view(torch.int16)
        buf = t.numpy()
    return name, dt, tuple(value.shape), buf


def _write(dst_mv: memoryview, offset: int, nbytes: int, dt: str, shape, value) -> None:
    if nbytes == 0:
        return
    if _is_torch(value):
        import torch

        tdt = getattr(torch, dt)
        dst = torch.frombuffer(dst_mv, dtype=tdt, count=nbytes // value.element_size(), offset=offset)
        dst.view(value.shape).copy_(value)  # one copy, strided source allowed
        del dst
        return
    a = value if isinstance(value, np.ndarray) else np.asarray(value)
    dst = np.frombuffer(dst_mv, dtype=a.dtype, count=a.size, offset=offset).reshape(a.shape)
    np.copyto(dst, a)  # one copy, strided source allowed
    del dst


def put_item(
    store: _native.Store,
    key,
    arrays: Mapping[str, Any],
    meta: Mapping[str, Any] | None = None,
    *,
    timeout: float | None = None,
) -> None:
    """Writes ``arrays`` (name -> numpy array or CPU torch tensor) and ``meta`` (name ->
    int, float, bool, str or bytes) as one object under ``key``.

    Each array is copied once, from wherever it is (strided is fine) into shared memory.
    With ``timeout``, waits for space when the store is full. Raises ``AlreadyExists`` if
    the key is present (items are immutable; delete first to replace).
    """
    put_arrays(store, key, arrays, meta, timeout)


def put_arrays(
    store: _native.Store,
    key,
    arrays: Mapping[str, Any],
    meta: Mapping[str, Any] | None,
    timeout: float | None,
    *,
    pin: bool = False,
) -> memoryview | None:
    """``put_item``; with ``pin``, returns the sealed item pinned, as ``put_described``
    does."""
    full: list[tuple[str, str, Any, Any]] = [
        _spec(k if type(k) is str else str(k), v) for k, v in arrays.items()
    ]
    return put_described(store, key, full, list(arrays.values()), meta, timeout, pin=pin)


def put_described(
    store: _native.Store,
    key,
    full: list[tuple[str, str, Any, Any]],
    values: list[Any],
    meta: Mapping[str, Any] | None,
    timeout: float | None,
    *,
    pin: bool = False,
) -> memoryview | None:
    """``put_item`` of arrays already described by ``_spec`` (``full``), ``values``
    being the arrays themselves in the same order. With ``pin``, returns the sealed item
    pinned (what ``store.try_get(key)`` returns, without its lookup), or None if another
    process deleted or evicted it in between."""
    if all(f[3] is not None for f in full):
        # Every array is C-contiguous: one native call plans, creates, copies and seals.
        return _native.put_item_buffers(store, key, full, dict(meta) if meta else {}, timeout, pin)
    specs = [f[:3] for f in full]
    header, placements, total = _native.plan_item(list(specs), dict(meta or {}))
    c = store.create_object(key, total, timeout=timeout)
    try:
        mv = c.buffer
        try:
            mv[: len(header)] = header
            for (name, dt, shape), (offset, nbytes), value in zip(specs, placements, values):
                _write(mv, offset, nbytes, dt, shape, value)
        finally:
            mv.release()
        c.seal()
    except BaseException:
        try:
            c.abort()
        except Exception:
            pass  # a buffer still alive keeps the block until it goes; then it is freed
        raise
    return store.try_get(key) if pin else None


def get_item(
    store: _native.Store,
    key,
    timeout: float | None = None,
    *,
    as_torch: bool = False,
    wait_if_absent: bool = True,
) -> dict[str, Any]:
    """Returns the item under ``key`` as a dict of zero-copy, read-only arrays (numpy, or
    torch tensors with ``as_torch=True``), plus its metadata under the key ``"__meta__"``
    if it has any. Waits up to ``timeout`` seconds (None: forever) for the item to be
    sealed; with ``wait_if_absent=False`` only for an item being written, and raises
    ``NotFound`` at once for an absent one. The object stays pinned while any returned
    array is alive.
    """
    mv = store.get(key, timeout, wait_if_absent=wait_if_absent)
    arrays, meta = _native.decode_item(mv)
    out: dict[str, Any] = {}
    if as_torch:
        import torch

        with warnings.catch_warnings():
            # torch warns that the buffer is read-only: it is, by design (see module doc).
            warnings.simplefilter("ignore", UserWarning)
            for name, dt, shape, offset, nbytes in arrays:
                tdt = getattr(torch, dt)
                itemsize = torch.empty((), dtype=tdt).element_size()
                if nbytes == 0:
                    out[name] = torch.empty(shape, dtype=tdt)
                    continue
                t = torch.frombuffer(mv, dtype=tdt, count=nbytes // itemsize, offset=offset)
                out[name] = t.view(shape)
    else:
        if np is None:
            raise ImportError("get_item needs numpy (pip install numpy), or as_torch=True")
        for name, dt, shape, offset, nbytes in arrays:
            npdt = _bf16_numpy_dtype() if dt == "bfloat16" else np.dtype(_NP_NAMES[dt])
            a = np.frombuffer(mv, dtype=npdt, count=nbytes // npdt.itemsize, offset=offset)
            out[name] = a.reshape(shape)
    if meta:
        out["__meta__"] = meta
    return out
