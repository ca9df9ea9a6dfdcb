"""Processes made by fork (multiprocessing's "fork", vLLM's forked workers) and by spawn;
Ctrl-C during a blocking get; buffer flags of a creation."""

import ctypes
import gc
import multiprocessing as mp
import os
import select
import signal
import time

import numpy as np
import pytest

import shmstore
from conftest import spawn_python


# With "fork" the child uses the parent's handle (inherited through this global); with
# "spawn" it starts fresh and opens the store by name.
_inherited: dict[str, shmstore.Store | None] = {}


def _child(store_name, key, expect_sum, q, go):
    store = _inherited.get("store") or shmstore.Store.open(store_name)
    arr = np.frombuffer(store.get(key, 5.0), dtype=np.int64)
    q.put(("pinned", int(arr.sum()) == expect_sum, store.stats()["clients"]))
    # Wait until the parent has deleted the object and tried to reuse its space.
    assert go.get(timeout=30) == "go"
    q.put(("reread", int(arr.sum()) == expect_sum))


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_multiprocessing_children_pin_in_their_own_name(store_name, method):
    store = shmstore.Store.create(store_name, 3 << 20, max_objects=64)
    data = np.arange(1 << 17, dtype=np.int64)  # 1 MiB
    store.put("big", data)
    held = store.get("big", 1.0)  # the parent holds a view across the fork too
    _inherited["store"] = store if method == "fork" else None
    try:
        ctx = mp.get_context(method)
        q, go = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=_child, args=(store_name, "big", int(data.sum()), q, go))
        p.start()
        tag, ok, clients = q.get(timeout=30)
        assert (tag, ok) == ("pinned", True)
        assert clients == 2, "the child attached as a client of its own"
        # The parent lets go of the object and fills the store: the child's pin must keep
        # its bytes where they are.
        del held
        gc.collect()
        store.delete("big")
        store.put("filler", np.zeros(1 << 17, dtype=np.int64))
        with pytest.raises(shmstore.Full):
            store.put("more", np.zeros(1 << 18, dtype=np.int64))
        go.put("go")
        assert q.get(timeout=30) == ("reread", True)
        p.join(30)
        assert p.exitcode == 0
        store.recover()
        st = store.stats()
        assert (st["draining"], st["pins"], st["dead_clients"]) == (0, 0, 0), st
        assert st["clients"] == 1
    finally:
        _inherited.clear()


def test_a_forked_child_leaves_the_parents_views_and_creations_alone(store):
    store.put("a", b"x" * 4096)
    view = store.get("a", 1.0)
    arr = np.frombuffer(view, dtype=np.uint8)
    c = store.create_object("pending", 100)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        code = 0
        try:
            os.close(r)
            # The inherited view and array still read the object (pinned by the child now).
            assert arr[0] == ord("x") and bytes(view[:1]) == b"x"
            assert store.stats()["pins"] == 2, "the fork hook pinned it in the child's name"
            # The parent's creation is not the child's to write or seal.
            for act in (lambda: c.buffer, c.seal, c.abort):
                try:
                    act()
                    code = 3
                except shmstore.Forked:
                    pass
            del view, arr, c
            gc.collect()
            store.put("from-child", b"hi")
        except BaseException:
            code = 2
        os.write(w, bytes([code]))
        os._exit(code)
    os.close(w)
    assert os.read(r, 1) == b"\x00"
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    st = store.stats()
    assert (st["pins"], st["creating"]) == (1, 1), st
    with c.buffer as b:
        b[:] = b"y" * 100
    c.seal()
    assert bytes(store.get("pending", 1.0)) == b"y" * 100
    assert store.contains("from-child")
    del view, arr


def test_ctrl_c_interrupts_a_get_that_waits_forever(store_name):
    shmstore.Store.create(store_name, 1 << 20)
    p = spawn_python(
        """
        import signal, sys, shmstore
        # What an interactive Python has. A Python started from a background job
        # (`cmd &` in a script, as CI runners may do) inherits SIGINT ignored and then
        # installs no handler at all.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        s = shmstore.Store.open(sys.argv[1])
        try:
            print("waiting", flush=True)
            s.get("never", timeout=None)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        """,
        store_name,
    )
    assert p.stdout.readline().strip() == "waiting"
    _wait_until_asleep_in_futex(p.pid)  # inside the get's wait, not before it
    sent = time.monotonic()
    p.send_signal(signal.SIGINT)
    ready, _, _ = select.select([p.stdout], [], [], 5.0)
    assert ready, "SIGINT was not honoured within 5 s"
    line = p.stdout.readline().strip()
    took = time.monotonic() - sent
    assert line == "interrupted", line
    assert took < 0.1 + 0.05, f"KeyboardInterrupt came {took:.3f} s after SIGINT"
    assert p.wait(10) == 0


def _wait_until_asleep_in_futex(pid, limit=10.0):
    """Waits until a thread of `pid` sleeps in futex(2) (read from /proc, no guessing)."""
    futex = {"x86_64": "202", "aarch64": "98"}[os.uname().machine]
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/syscall") as f:
                    nr = f.read().split()[0]
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if nr == futex and state == "S":
                return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} never slept in futex")


class _PyBuffer(ctypes.Structure):
    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.POINTER(ctypes.c_ssize_t)),
        ("strides", ctypes.POINTER(ctypes.c_ssize_t)),
        ("suboffsets", ctypes.POINTER(ctypes.c_ssize_t)),
        ("internal", ctypes.c_void_p),
    ]


def test_a_creation_fills_in_what_the_buffer_consumer_asks_for(store):
    get = ctypes.pythonapi.PyObject_GetBuffer
    get.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
    release = ctypes.pythonapi.PyBuffer_Release
    release.argtypes = [ctypes.POINTER(_PyBuffer)]
    PyBUF_WRITABLE, PyBUF_FORMAT, PyBUF_ND = 0x1, 0x4, 0x8
    c = store.create_object("flags", 16)
    b = _PyBuffer()
    assert get(c, ctypes.byref(b), PyBUF_ND | PyBUF_FORMAT | PyBUF_WRITABLE) == 0
    try:
        assert b.len == 16 and b.readonly == 0
        assert b.format == b"B", "asked for the format"
        assert bool(b.shape) and b.shape[0] == 16, "asked for the shape"
    finally:
        release(ctypes.byref(b))
    assert get(c, ctypes.byref(b), 0) == 0  # a simple buffer: no format, no shape
    try:
        assert b.format is None and not b.shape
    finally:
        release(ctypes.byref(b))
    c.abort()


def test_leave_all_at_exit_lets_the_last_process_remove_a_store_it_still_holds(store_name):
    # A process whose handles outlive its interpreter (a cycle, a thread, a global) still
    # counts as attached until it is gone; an exit hook that leaves first lets it remove
    # the store itself. The child reads through its view after leaving: still mapped.
    child = spawn_python(
        """
        import sys, shmstore
        s = shmstore.Store.create(sys.argv[1], 1 << 20)
        s.put("k", b"pixels")
        view = s.get("k")
        keep = [s, view]; keep.append(keep)
        path = s.path
        print(shmstore.Store.remove_if_unused(path), flush=True)
        shmstore.leave_all_at_exit()
        print(shmstore.Store.remove_if_unused(path), bytes(view), flush=True)
        sys.stdin.readline()
        """,
        store_name,
    )
    try:
        assert child.stdout.readline().split() == ["False"]
        assert child.stdout.readline().split() == ["True", "b'pixels'"]
        assert not os.path.exists(f"/dev/shm/{store_name}")
    finally:
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(60) == 0
