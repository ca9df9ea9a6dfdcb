"""Tensor items: one object per item, zero-copy arrays, every dtype, hostile headers."""

import gc
import importlib.util
import os
from typing import Any

import numpy as np
import pytest

import shmstore
from shmstore import _native

HAS_TORCH = importlib.util.find_spec("torch") is not None


def test_round_trip_of_every_numpy_dtype_and_shape(store):
    rng = np.random.default_rng(7)
    arrays: dict[str, Any] = {
        "f32": rng.random((3, 17, 5), dtype=np.float32),
        "f16": rng.random((16, 3, 8, 8)).astype(np.float16),
        "f64": rng.random(9),
        "i64": rng.integers(-(1 << 40), 1 << 40, (4, 4)),
        "i32": rng.integers(-1000, 1000, 11, dtype=np.int32),
        "i16": rng.integers(-1000, 1000, 3, dtype=np.int16),
        "i8": rng.integers(-100, 100, 5, dtype=np.int8),
        "u8": rng.integers(0, 255, (2, 224, 224, 3), dtype=np.uint8),
        "mask": rng.random(13) > 0.5,
        "scalar": np.array(42, dtype=np.int64),
        "empty": np.zeros((0, 4), dtype=np.float32),
        "strided": np.arange(100, dtype=np.int32).reshape(10, 10)[::2, 1::3],
    }
    meta = {"fps": 30, "scale": 0.5, "rgb": True, "fmt": "chw", "raw": b"\x00\x01"}
    shmstore.put_item(store, "item", arrays, meta)
    got = shmstore.get_item(store, "item", 1.0)
    assert got.pop("__meta__") == meta
    assert list(got) == list(arrays)
    for k, a in arrays.items():
        assert got[k].dtype == a.dtype, k
        assert got[k].shape == a.shape, k
        assert np.array_equal(got[k], a), k
        assert not got[k].flags.writeable
        if got[k].size:
            assert got[k].ctypes.data % 64 == 0, f"{k} is not 64-byte aligned"


def test_bfloat16_through_a_uint16_view_without_numpy_support(store):
    bits = np.array([0x3F80, 0x4000, 0xC040], dtype=np.uint16)  # 1.0, 2.0, -3.0
    plan = _native.plan_item([("w", "bfloat16", (3,))], {})
    header, [(offset, nbytes)], total = plan
    with store.create_object("bf16", total) as c:
        mv = c.buffer
        mv[: len(header)] = header
        mv[offset : offset + nbytes] = bits.tobytes()
        mv.release()
    got = shmstore.get_item(store, "bf16", 1.0)["w"]
    raw = got.view(np.uint16) if got.dtype != np.uint16 else got
    assert np.array_equal(raw, bits)
    as_f32 = (raw.astype(np.uint32) << 16).view(np.float32)
    assert list(as_f32) == [1.0, 2.0, -3.0]


def test_arrays_share_memory_and_pin_the_item(store):
    img = np.ones((3, 64, 64), dtype=np.float32)
    shmstore.put_item(store, "img", {"pixel_values": img})
    a = shmstore.get_item(store, "img", 1.0)["pixel_values"]
    b = shmstore.get_item(store, "img", 1.0)["pixel_values"]
    assert a.ctypes.data == b.ctypes.data, "two gets map the same bytes"
    gc.collect()
    assert store.stats()["pins"] == 2
    store.delete("img")
    assert float(a.sum()) == img.size  # still readable while pinned
    del a, b
    gc.collect()
    assert store.stats()["pins"] == 0 and store.stats()["draining"] == 0


@pytest.mark.parametrize("contiguous", [True, False])
def test_put_described_with_pin_returns_the_sealed_item_pinned(store, contiguous):
    from shmstore.items import _spec, put_described

    a = np.arange(40_000, dtype=np.float32).reshape(200, 200)
    if not contiguous:  # the element-wise path (plan, create, copy, seal) in Python
        a = a[:, ::2]
    full = [_spec("x", a)]
    assert (full[0][3] is not None) == contiguous
    pin = put_described(store, "pinned", full, [a], {"k": 1}, None, pin=True)
    assert pin is not None
    assert store.stats()["pins"] == 1
    assert bytes(pin) == bytes(store.get("pinned", 1.0)), "the view is the sealed item"
    got = shmstore.get_item(store, "pinned", 1.0)
    assert np.array_equal(got["x"], a) and got["__meta__"] == {"k": 1}
    del got
    store.delete("pinned")
    assert store.stats()["draining"] == 1, "the returned pin keeps the deleted item"
    pin.release()
    gc.collect()
    assert store.stats()["pins"] == 0 and store.stats()["draining"] == 0
    assert put_described(store, "unpinned", full, [a], None, None) is None
    assert store.stats()["pins"] == 0


def test_a_failed_put_item_leaves_nothing(store):
    class Boom:
        def __array__(self, dtype=None, copy=None):
            raise RuntimeError("cannot convert")

    used = store.stats()["used"]
    with pytest.raises(RuntimeError):
        shmstore.put_item(store, "bad", {"ok": np.zeros(10), "bad": Boom()})
    assert not store.contains("bad")
    assert store.stats()["used"] == used
    with pytest.raises(TypeError, match="not supported"):
        shmstore.put_item(store, "c64", {"z": np.zeros(3, dtype=np.complex64)})


def test_hostile_headers_are_bad_item_errors_never_crashes(store):
    arrays = {"a": np.arange(10, dtype=np.float32), "b": np.zeros((2, 3), dtype=np.uint8)}
    shmstore.put_item(store, "good", arrays, {"k": "v"})
    good = bytes(store.get("good", 0))
    rng = np.random.default_rng(3)
    bad = 0
    for _ in range(3000):
        b = bytearray(good)
        for _ in range(rng.integers(1, 4)):
            b[rng.integers(0, 128)] = rng.integers(0, 256)
        try:
            specs, _ = _native.decode_item(bytes(b))
        except shmstore.BadItem:
            bad += 1
            continue
        for _, dt, shape, offset, nbytes in specs:
            assert offset + nbytes <= len(b)
    assert bad > 0
    with pytest.raises(shmstore.BadItem, match="magic"):
        _native.decode_item(os.urandom(256))
    store.put("plain", b"just bytes, not an item")
    with pytest.raises(shmstore.BadItem):
        shmstore.get_item(store, "plain", 0)


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_torch_tensors_in_and_out_including_bfloat16(store):
    import torch

    t = {
        "video": torch.rand(4, 3, 8, 8, dtype=torch.float16),
        "w": torch.rand(5, dtype=torch.float32).to(torch.bfloat16),
        "ids": torch.arange(6).reshape(2, 3).t(),  # non-contiguous
    }
    shmstore.put_item(store, "t", t)
    got = shmstore.get_item(store, "t", 1.0, as_torch=True)
    for k, v in t.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v.contiguous()), k


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_torch_tensors_share_memory_pin_and_fault_on_write_when_read_only(store, store_name):
    import torch

    from conftest import run_python

    shmstore.put_item(store, "img", {"x": torch.ones(3, 32, 32)})
    a = shmstore.get_item(store, "img", 1.0, as_torch=True)["x"]
    b = shmstore.get_item(store, "img", 1.0, as_torch=True)["x"]
    assert a.data_ptr() == b.data_ptr(), "two gets map the same bytes"
    gc.collect()
    assert store.stats()["pins"] == 2
    del a, b
    gc.collect()
    assert store.stats()["pins"] == 0
    # PyTorch has no read-only tensors; a read-only attach makes the kernel refuse writes.
    out = run_python(
        """
        import sys, shmstore
        s = shmstore.Store.open(sys.argv[1], read_only=True)
        x = shmstore.get_item(s, "img", 5.0, as_torch=True)["x"]
        print("attached", flush=True)
        x.add_(1)   # looks legal to torch
        print("wrote")
        """,
        store_name,
        check=False,
    )
    assert "attached" in out.stdout and "wrote" not in out.stdout
    assert out.returncode == -11
    assert float(shmstore.get_item(store, "img", 0, as_torch=True)["x"].sum()) == 3 * 32 * 32
