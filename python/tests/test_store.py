"""The raw store from Python: buffers, pins, zero-copy, errors, the GIL, processes."""

import gc
import os
import signal
import threading
import time

import numpy as np
import pytest

import shmstore
from conftest import run_python, spawn_python


def test_put_get_round_trip_with_keys_and_ids(store):
    store.put("key", b"hello")
    assert bytes(store.get("key", 1.0)) == b"hello"
    data = np.arange(1000, dtype=np.float32)
    cid = shmstore.content_id(data)
    assert len(cid) == 32
    store.put(cid, data)
    got = np.frombuffer(store.get(cid, 1.0), dtype=np.float32)
    assert np.array_equal(got, data)
    assert store.contains(cid) and store.contains("key")
    assert shmstore.key_id("key") != shmstore.key_id("other")
    assert store.get(shmstore.key_id("key"), 0).obj.id == shmstore.key_id("key")


def test_ids_numbered_by_the_caller_fill_the_store_like_hashed_keys(store):
    # 32 id bytes from a counter, as Python writes it (big-endian: only the last bytes
    # differ). Before layout version 7 these all hashed to one home, and the 33rd put
    # raised TableFull.
    ids = [i.to_bytes(32, "big") for i in range(1000)]
    for i, oid in enumerate(ids):
        store.put(oid, i.to_bytes(4, "little"))
    assert store.stats()["objects"] == 1000
    assert all(bytes(store.get(oid, 0)) == i.to_bytes(4, "little") for i, oid in enumerate(ids))


def test_get_returns_a_read_only_view_that_pins(store):
    store.put("a", b"x" * 100)
    mv = store.get("a", 1.0)
    assert mv.readonly
    with pytest.raises(TypeError):
        mv[0] = 1
    assert store.stats()["pins"] == 1
    del mv
    gc.collect()
    assert store.stats()["pins"] == 0


def test_numpy_arrays_share_memory_and_keep_the_pin(store):
    data = np.arange(1 << 16, dtype=np.int64)
    store.put("arr", data)
    mv = store.get("arr", 1.0)
    view_obj = mv.obj
    arr = np.frombuffer(mv, dtype=np.int64)
    # Zero-copy: the array's data is the object's bytes in shared memory.
    assert arr.ctypes.data == view_obj.address
    assert store.get("arr", 0).obj.address == view_obj.address
    assert not arr.flags.writeable
    # Deleting the object hides it, but the array keeps it pinned and intact.
    del mv, view_obj
    gc.collect()
    store.delete("arr")
    assert not store.contains("arr")
    st = store.stats()
    assert (st["draining"], st["pins"]) == (1, 1)
    assert np.array_equal(arr, data)
    used = st["used"]
    del arr
    gc.collect()
    st = store.stats()
    assert (st["draining"], st["pins"]) == (0, 0)
    assert st["used"] < used


def test_create_seals_on_exit_and_aborts_on_exception(store):
    with store.create_object("c", 4) as c:
        c.buffer[:] = b"abcd"
    assert bytes(store.get("c", 0)) == b"abcd"
    used = store.stats()["used"]
    with pytest.raises(RuntimeError):
        with store.create_object("d", 1 << 20) as c:
            mv = c.buffer
            mv[:3] = b"xyz"
            mv.release()
            raise RuntimeError("producer failed")
    assert not store.contains("d")
    assert store.stats()["used"] == used, "the aborted object's memory is back"
    # The id is free again.
    store.put("d", b"ok")


def test_write_copies_any_buffer_at_an_offset_and_refuses_what_does_not_fit(store):
    big = np.random.default_rng(1).integers(0, 255, 3 << 20, dtype=np.uint8)  # streamed
    c = store.create_object("wr", 16 + big.nbytes)
    c.write(b"head")
    c.write(np.arange(3, dtype=np.int32), offset=4)  # 12 bytes, any format
    c.write(big, offset=16)
    with pytest.raises(ValueError, match="do not fit"):
        c.write(b"x" * 17, offset=len(c) - 16)
    with pytest.raises(ValueError, match="own memory"):
        c.write(c.buffer[16:32], offset=0)
    gc.collect()
    c.seal()
    v = store.get("wr", 0)
    assert bytes(v[:4]) == b"head"
    assert np.frombuffer(v[4:16], np.int32).tolist() == [0, 1, 2]
    assert np.array_equal(np.frombuffer(v[16:], np.uint8), big)
    with pytest.raises(ValueError, match="already sealed"):
        c.write(b"late")


def test_seal_refuses_while_a_writable_buffer_is_alive(store):
    c = store.create_object("w", 16)
    arr = np.frombuffer(c.buffer, dtype=np.uint8)
    arr[:] = 7
    with pytest.raises(BufferError, match="still alive"):
        c.seal()
    del arr
    gc.collect()
    c.seal()
    assert bytes(store.get("w", 0)) == b"\x07" * 16
    with pytest.raises(BufferError):
        c.buffer  # sealed: no longer writable


def test_errors_are_typed_with_actionable_messages(store, store_name):
    store.put("dup", b"1")
    with pytest.raises(shmstore.AlreadyExists):
        store.put("dup", b"2")
    with pytest.raises(shmstore.NotFound):
        store.delete("nope")
    with pytest.raises(shmstore.Timeout, match="not sealed within"):
        store.get("nope", 0.01)
    with pytest.raises(shmstore.TooLarge, match="never fit"):
        store.create_object("huge", 1 << 40)
    with pytest.raises(shmstore.StoreNotFound):
        shmstore.Store.open(store_name + "-missing")
    with pytest.raises(shmstore.StoreExists):
        shmstore.Store.create(store_name, 1 << 20)
    with pytest.raises(ValueError, match="32 bytes"):
        store.get(b"short", 0)
    assert issubclass(shmstore.Full, shmstore.ShmstoreError)
    assert store.try_get("nope") is None


def test_full_store_raises_full_then_waits_for_space(store_name):
    s = shmstore.Store.create(store_name + "-full", 1 << 20)
    try:
        s.put("big", bytes(1 << 20))
        with pytest.raises(shmstore.Full, match="free"):
            s.put("more", bytes(1000))
        # create with a timeout waits for space; another thread frees it.
        t = threading.Timer(0.05, lambda: s.delete("big"))
        t.start()
        with s.create_object("more", 1000, timeout=5.0) as c:
            c.buffer[:4] = b"done"
        t.join()
    finally:
        s.unlink()


def test_a_blocking_get_releases_the_gil(store):
    started = threading.Event()
    result = {}

    def getter():
        started.set()
        try:
            store.get("late", 1.0)
        except shmstore.Timeout:
            result["timeout"] = True

    t = threading.Thread(target=getter)
    t.start()
    started.wait()
    # If the get held the GIL while blocked, this loop would stall for its whole second.
    t0 = time.monotonic()
    for _ in range(20):
        time.sleep(0.005)
    assert time.monotonic() - t0 < 0.5
    t.join()
    assert result == {"timeout": True}


def test_a_small_put_recovers_a_dead_process_on_its_slow_path(store_name):
    # The put finds the store full of a dead process's object. Its GIL-holding fast path
    # (Store::put_without_slow_work, tested in Rust to decline such work) declines, and
    # the put recovers the dead process without the GIL.
    s = shmstore.Store.create(store_name, 1 << 20)
    p = spawn_python(
        """
        import sys, shmstore
        s = shmstore.Store.open(sys.argv[1])
        c = s.create_object("hog", 1 << 20)
        print("holding", flush=True)
        sys.stdin.readline()
        """,
        store_name,
    )
    assert p.stdout.readline().strip() == "holding"
    p.send_signal(signal.SIGKILL)
    p.wait()
    s.put("small", b"x" * 100)
    st = s.stats()
    assert (st["recovered_clients"], st["objects"]) == (1, 1), st


def test_stats_count_what_this_and_other_processes_did(store, store_name):
    store.put("a", b"x" * 1000)
    store.put("b", b"y" * 10)
    store.get("a", 1.0).release()  # a hit
    with pytest.raises(shmstore.Timeout):
        store.get("gone", 0)  # a miss
    store.delete("b")
    run_python(
        """
        import sys, shmstore
        s = shmstore.Store.open(sys.argv[1])
        s.put("c", b"z" * 5)
        s.get("c", 1.0).release()
        """,
        store_name,
    )
    st = store.stats()
    # The other process has detached: its counts live on in the store's totals.
    assert (st["creates"], st["bytes_created"], st["deletes"]) == (3, 1015, 1), st
    assert (st["gets_hit"], st["gets_missed"], st["objects"]) == (2, 1, 2), st
    assert store.pinned_objects() == 0


def test_another_process_reads_the_same_bytes(store, store_name):
    data = np.random.default_rng(1).integers(0, 255, 1 << 20, dtype=np.uint8)
    store.put("shared", data)
    out = run_python(
        """
        import sys, shmstore
        s = shmstore.Store.open(sys.argv[1])
        print(shmstore.content_id(s.get("shared", 5.0)).hex())
        """,
        store_name,
    )
    assert out.stdout.strip() == shmstore.content_id(data).hex()


def test_delete_unpinned_leaves_what_another_process_reads(store, store_name):
    store.put("read", b"r" * 100)
    store.put("idle", b"i" * 100)
    reader = spawn_python(
        """
        import sys, shmstore
        s = shmstore.Store.open(sys.argv[1])
        v = s.get("read", 5.0)
        print("holding", flush=True)
        sys.stdin.readline()
        print(bytes(v[:4]).decode(), flush=True)
        """,
        store_name,
    )
    try:
        assert reader.stdout.readline().strip() == "holding"
        assert store.delete_unpinned("read") is False
        assert store.delete_unpinned("idle") is True
        assert store.contains("read") and not store.contains("idle")
        with pytest.raises(shmstore.NotFound):
            store.delete_unpinned("idle")
        reader.stdin.write("\n")
        reader.stdin.flush()
        assert reader.stdout.readline().strip() == "rrrr"
    finally:
        reader.stdin.close()
        reader.wait(30)
    # The reader is gone, and its pin with it.
    assert store.delete_unpinned("read") is True
    assert store.stats()["objects"] == 0
    with store.create_object("new", 10) as c:
        with pytest.raises(shmstore.NotSealed):
            store.delete_unpinned("new")
        c.buffer[:] = b"0123456789"


def test_a_deleted_object_is_read_draining_in_another_process_while_it_is_pinned(store, store_name):
    store.put("frame", b"f" * 100)
    held = store.get("frame")  # what vLLM's engine core holds for an admitted request
    store.delete("frame")  # by hand
    assert store.try_get("frame") is None
    out = run_python(
        """
        import sys, shmstore
        s = shmstore.Store.open(sys.argv[1])
        assert s.try_get("frame") is None
        print(bytes(s.get_draining("frame")[:4]).decode())
        print(s.get_draining("other"))
        """,
        store_name,
    )
    assert out.stdout.split("\n")[:2] == ["ffff", "None"]
    del held
    gc.collect()
    assert store.get_draining("frame") is None  # freed with its last pin
    assert store.stats()["objects"] == 0


def test_a_view_is_current_while_its_key_names_its_object(store):
    store.put("frame", b"old")
    old = store.get("frame")
    assert old.obj.is_current()
    store.delete("frame")
    assert not old.obj.is_current()  # its bytes stay, its key is gone
    store.put("frame", b"new")
    new = store.get("frame")
    assert new.obj.is_current() and not old.obj.is_current()
    assert bytes(old) == b"old"
    assert store.stats()["pins"] == 2  # asking took no pin


def test_a_get_waiting_on_a_killed_creator_raises_creator_died(store, store_name):
    p = spawn_python(
        """
        import sys, shmstore
        s = shmstore.Store.open(sys.argv[1])
        c = s.create_object("never", 100)
        print("creating", flush=True)
        sys.stdin.readline()
        """,
        store_name,
    )
    assert p.stdout.readline().strip() == "creating"
    p.send_signal(signal.SIGKILL)
    p.wait()
    t0 = time.monotonic()
    with pytest.raises(shmstore.CreatorDied, match="died"):
        store.get("never", 30.0)
    assert time.monotonic() - t0 < 5.0
    assert store.stats()["creating"] == 0


def test_read_only_attach_faults_on_write(store, store_name):
    store.put("ro", b"\x01" * 4096)
    out = run_python(
        """
        import ctypes, sys, shmstore
        s = shmstore.Store.open(sys.argv[1], read_only=True)
        v = s.get("ro", 5.0)
        print("attached", flush=True)
        ctypes.memset(v.obj.address, 0, 1)   # the kernel must stop this
        print("wrote")
        """,
        store_name,
        check=False,
    )
    assert "attached" in out.stdout and "wrote" not in out.stdout
    assert out.returncode == -signal.SIGSEGV
    assert bytes(store.get("ro", 0))[:1] == b"\x01"


def test_the_version_comes_from_one_place():
    import importlib.metadata
    import re

    # The installed distribution's version (pyproject.toml takes it from Cargo.toml), the
    # module's and the Rust crate's are one number.
    assert shmstore.__version__ == importlib.metadata.version("shmstore")
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", shmstore.__version__)


def _kernel_rebuilds_shmem_pages() -> str | None:
    """Why this kernel cannot rebuild tmpfs pages as 2 MiB pages (None if it can)."""
    release = os.uname().release
    nums = [int(n) for n in release.replace("-", ".").split(".")[:2] if n.isdigit()]
    if tuple(nums) < (6, 1):
        return f"kernel {release} is older than 6.1 (no MADV_COLLAPSE)"
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            if "[deny]" in f.read():
                return "shmem_enabled is deny"
    except OSError:
        return "no transparent huge page support"
    return None


def test_huge_pages_are_rebuilt_by_default_and_off_keeps_4_kib(store_name):
    s = shmstore.Store.create(store_name, 16 << 20, max_objects=1024)
    s.put(b"k" * 32, bytes(range(256)) * 8192)  # 2 MiB, written while the rebuild runs
    s.prefault()  # finishes the rebuild in this thread
    st = s.stats()
    assert bytes(s.get(b"k" * 32)) == bytes(range(256)) * 8192
    off = shmstore.Store.create(store_name + "-off", 16 << 20, max_objects=1024, huge_pages="off")
    off.prefault()
    st_off = off.stats()
    os.unlink(f"/dev/shm/{store_name}-off")
    assert (st_off["huge_page_bytes"], st_off["page_size"], st_off["huge_pages"]) == (0, 4096, False)
    with pytest.raises(ValueError, match="huge_pages"):
        shmstore.Store.create(store_name + "-bad", 1 << 20, huge_pages="yes")  # type: ignore[arg-type]
    why = _kernel_rebuilds_shmem_pages()
    if why:
        pytest.skip(f"the default's 2 MiB pages: {why}")
    assert (st["huge_page_bytes"], st["page_size"], st["huge_pages"]) == (16 << 20, 2 << 20, True)
