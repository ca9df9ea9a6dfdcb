"""The store of one vLLM instance (``shmstore.vllm.instance``): who the launcher is, the
store's name and directory, creating and attaching it as vLLM's processes do, the
sweep of stores that crashed instances left, the launcher's exit hook, the figures
exported to vLLM's ``/metrics``, and the plugin's log lines going where vLLM's go.

What needs a whole vLLM process (``vllm.plugins``, vLLM's own logging set up, a
launcher whose workers vLLM kills) is in test_vllm_plugin.py; these tests call the
module's functions, in this process or in a small one that imports only shmstore.
"""

import logging
import os
import subprocess
import sys
import tempfile
import textwrap
import threading

import pytest
from harness import make_config

import shmstore
from shmstore.vllm import instance


def run(code: str, env: dict) -> subprocess.CompletedProcess:
    """``code`` in a fresh Python that imports shmstore, not vLLM (a second or so)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
        timeout=120, env={**os.environ, **env})


@pytest.fixture
def shm_dir():
    """A directory of its own in /dev/shm (a tmpfs, as the stores' usual home)."""
    d = tempfile.mkdtemp(dir="/dev/shm", prefix="shmstore-test-instance-")
    yield d
    for name in os.listdir(d):
        os.unlink(os.path.join(d, name))
    os.rmdir(d)


def make_store(path: str, *, keep: bool = False):
    """A store at ``path`` that no process is attached to (``keep``: this one is)."""
    s = shmstore.Store.create(path, 1 << 20)
    return s if keep else None


def test_the_first_process_to_ask_is_the_launcher_and_the_processes_it_starts_are_not(
        monkeypatch):
    monkeypatch.delenv("SHMSTORE_VLLM_LAUNCHER", raising=False)
    assert not instance.is_launcher()
    assert instance.mark_launcher() is True
    assert os.environ["SHMSTORE_VLLM_LAUNCHER"] == str(os.getpid())  # inherited by children
    assert instance.is_launcher()
    assert instance.mark_launcher() is False  # the plugin loads again: still the launcher
    assert instance.is_launcher()
    # A process the launcher started inherits the mark, with the launcher's pid.
    monkeypatch.setenv("SHMSTORE_VLLM_LAUNCHER", str(os.getpid() + 1))
    assert instance.mark_launcher() is False and not instance.is_launcher()


def test_the_store_lives_in_dev_shm_unless_shmstore_vllm_dir_names_another_directory(
        store_env, monkeypatch):
    name = store_env["SHMSTORE_VLLM_STORE"]
    monkeypatch.delenv("SHMSTORE_VLLM_DIR", raising=False)
    assert instance.store_dir() == "/dev/shm"
    assert instance.store_path() == f"/dev/shm/{name}"
    monkeypatch.setenv("SHMSTORE_VLLM_DIR", "")  # set but empty, as a blank in a unit file
    assert instance.store_path() == f"/dev/shm/{name}"
    monkeypatch.setenv("SHMSTORE_VLLM_DIR", "/mnt/thp")
    assert instance.store_path() == f"/mnt/thp/{name}"
    monkeypatch.setenv("SHMSTORE_VLLM_STORE", "")  # blank: the instance names it
    generated = instance.store_name()
    assert generated.startswith(f"shmstore-vllm-{os.getpid()}-") and len(generated) == len(
        f"shmstore-vllm-{os.getpid()}-") + 8
    assert instance.store_name() == generated == os.environ["SHMSTORE_VLLM_STORE"]


def test_the_sweep_removes_only_unused_stores_of_crashed_instances(shm_dir, monkeypatch, caplog):
    current = "shmstore-vllm-1-current"
    monkeypatch.setenv("SHMSTORE_VLLM_STORE", current)
    for name in ("shmstore-vllm-2-crashed", "shmstore-vllm-3-crashed",
                 current, f"{current}-node-abc",     # this instance's, unused for now
                 "shmstore-vllm-1-currentish",        # another instance's: a longer name
                 "someone-elses"):                    # not the plugin's
        make_store(os.path.join(shm_dir, name))
    live = make_store(os.path.join(shm_dir, "shmstore-vllm-4-live"), keep=True)
    with open(os.path.join(shm_dir, "shmstore-vllm-5-not-a-store"), "wb") as f:
        f.write(b"\0" * 4096)
    os.mkdir(os.path.join(shm_dir, "shmstore-vllm-6-a-directory"))
    caplog.set_level(logging.INFO, logger="shmstore.vllm")
    try:
        removed = instance.remove_stale_stores(shm_dir)
    finally:
        os.rmdir(os.path.join(shm_dir, "shmstore-vllm-6-a-directory"))
    assert sorted(removed) == ["shmstore-vllm-1-currentish", "shmstore-vllm-2-crashed",
                               "shmstore-vllm-3-crashed"]
    assert sorted(os.listdir(shm_dir)) == sorted([
        current, f"{current}-node-abc", "someone-elses", "shmstore-vllm-4-live",
        "shmstore-vllm-5-not-a-store"])
    said = [r.getMessage() for r in caplog.records]
    assert said == [f"shmstore: removed 3 store(s) left by crashed vLLM instances: "
                    f"{', '.join(removed)}"], said
    # Nothing to remove: no line. A directory that is not there: nothing, no error.
    caplog.clear()
    assert instance.remove_stale_stores(shm_dir) == []
    assert instance.remove_stale_stores(os.path.join(shm_dir, "gone")) == []
    assert not caplog.records
    # Without a store name of its own (a process that never named one), every unused
    # store of the plugin's goes, and the default directory is SHMSTORE_VLLM_DIR's.
    monkeypatch.delenv("SHMSTORE_VLLM_STORE")
    monkeypatch.setenv("SHMSTORE_VLLM_DIR", shm_dir)
    assert sorted(instance.remove_stale_stores()) == [current, f"{current}-node-abc"]
    del live


# The launcher's exit hook, in a process of its own: it leaves every store the process
# attached, as an exiting process does, which would leave this test process's too.
_EXIT_HOOK = """
    import json, logging, os, subprocess, sys
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    import shmstore
    from shmstore.vllm import instance
    instance.EXIT_WAIT_S = float(os.environ["EXIT_WAIT"])
    directory, name = instance.store_dir(), instance.store_name()
    for n in (name, name + "-node-a", name + "-node-b", name + "x", "shmstore-vllm-9-other"):
        shmstore.Store.create(os.path.join(directory, n), 1 << 20)
    with open(os.path.join(directory, name + "-node-junk"), "wb") as f:
        f.write(bytes(4096))  # not a store: nothing to remove, nor to wait for
    mine = shmstore.Store.open(os.path.join(directory, name))  # left by the hook
    holder = None
    if os.environ.get("HOLDER"):
        # Another process attached to a node store, leaving after HOLDER seconds (or
        # never: a process outside the instance).
        holder = subprocess.Popen([sys.executable, "-c", (
            "import shmstore, sys, time; s = shmstore.Store.open(sys.argv[1]); "
            "print('attached', flush=True); time.sleep(float(sys.argv[2]))"),
            os.path.join(directory, name + "-node-b"), os.environ["HOLDER"]],
            stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "attached"
    pid = int(os.environ.get("AS_PID") or os.getpid())
    removed = instance._remove_instance_stores(pid)
    if holder is not None:
        holder.kill()
    print(json.dumps([sorted(removed), sorted(os.listdir(directory))]))
"""


def _exit_hook(shm_dir: str, name: str, **env: str) -> tuple[list, list, str]:
    import json

    for f in os.listdir(shm_dir):  # what an earlier call left
        os.unlink(os.path.join(shm_dir, f))
    r = run(_EXIT_HOOK, {"SHMSTORE_VLLM_DIR": shm_dir, "SHMSTORE_VLLM_STORE": name,
                         "EXIT_WAIT": "10", **env})
    assert r.returncode == 0, r.stderr[-3000:]
    removed, left = json.loads(r.stdout.splitlines()[-1])
    return removed, left, r.stderr


def test_the_launchers_exit_hook_removes_its_store_and_node_stores_and_nothing_else(shm_dir):
    name = "shmstore-vllm-7-mine"
    removed, left, said = _exit_hook(shm_dir, name)
    assert removed == [name, f"{name}-node-a", f"{name}-node-b"]
    assert left == [f"{name}-node-junk", f"{name}x", "shmstore-vllm-9-other"]
    line = "INFO shmstore: removed this instance's store(s) at exit: "
    assert said.count(line) == 1, said
    assert sorted(said.split(line)[1].splitlines()[0].split(", ")) == removed, said
    assert "WARNING" not in said, said


def test_a_forked_child_that_inherited_the_exit_hook_removes_nothing(shm_dir):
    name = "shmstore-vllm-7-mine"
    removed, left, said = _exit_hook(shm_dir, name, AS_PID="1")
    assert removed == []
    assert name in left and f"{name}-node-a" in left, left
    assert "removed" not in said, said


def test_the_exit_hook_waits_for_a_process_still_leaving_and_no_longer(shm_dir):
    # vLLM kills its workers at shutdown without waiting: their locks go once they have
    # exited. One still attached for a moment is waited for...
    name = "shmstore-vllm-7-mine"
    removed, left, said = _exit_hook(shm_dir, name, HOLDER="0.5")
    assert removed == [name, f"{name}-node-a", f"{name}-node-b"], said
    assert "WARNING" not in said, said
    # ...one that stays past EXIT_WAIT_S is left to it, with a warning naming the store.
    removed, left, said = _exit_hook(shm_dir, name, HOLDER="60", EXIT_WAIT="0.3")
    assert removed == [name, f"{name}-node-a"], said
    assert f"{name}-node-b" in left
    path = os.path.join(shm_dir, f"{name}-node-b")
    assert (f"WARNING shmstore: {path} is still in use by a process outside this vLLM "
            "instance (or one of its own still exiting) 0 s after it shut down") in said, said
    # A store the operator named (no plugin prefix) may be shared by another instance:
    # said at INFO, with how to remove it by hand.
    removed, left, said = _exit_hook(shm_dir, "by-the-operator", HOLDER="60", EXIT_WAIT="0.3")
    path = os.path.join(shm_dir, "by-the-operator-node-b")
    assert removed == ["by-the-operator", "by-the-operator-node-a"], said
    assert (f"INFO shmstore: {path} is still in use by another process (another vLLM "
            f"instance sharing it?); left to it (the last instance using it removes it at "
            f"exit; `shmstore rm {path}` removes it by hand)") in said, said
    assert "WARNING" not in said, said


def test_the_exit_hook_of_an_instance_that_never_named_a_store_removes_nothing(shm_dir):
    code = """
        import os, shmstore
        from shmstore.vllm import instance
        shmstore.Store.create(os.path.join(os.environ["SHMSTORE_VLLM_DIR"], "shmstore-vllm-8-x"), 1 << 20)
        print(instance._remove_instance_stores(os.getpid()), os.listdir(os.environ["SHMSTORE_VLLM_DIR"]))
        """
    env = {k: v for k, v in os.environ.items() if k != "SHMSTORE_VLLM_STORE"}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, timeout=120, env={**env, "SHMSTORE_VLLM_DIR": shm_dir})
    assert r.stdout.split() == ["[]", "['shmstore-vllm-8-x']"], r.stderr[-3000:]
    # A directory that is gone: nothing to do, no error.
    r = run("from shmstore.vllm import instance; import os; "
            "print(instance._remove_instance_stores(os.getpid()))",
            {"SHMSTORE_VLLM_DIR": os.path.join(shm_dir, "gone"),
             "SHMSTORE_VLLM_STORE": "shmstore-vllm-8-x"})
    assert r.stdout.split() == ["[]"], r.stderr[-3000:]


def test_sizes_and_page_kinds_read_as_an_operator_reads_them():
    assert instance._size(1 << 30) == "1.0 GiB"
    assert instance._size((1 << 30) - (1 << 20)) == "1023.0 MiB"
    assert instance._size(int(0.004 * (1 << 30))) == "4.1 MiB"
    assert instance._size(100 << 30) == "100.0 GiB"
    assert instance._page_kind({"page_size": 4096, "huge_pages": False}) == "4 KiB"
    assert instance._page_kind({"page_size": 2 << 20, "huge_pages": True}) == (
        "2 MiB transparent huge")
    assert instance._page_kind({"page_size": 2 << 20, "huge_pages": False}) == "2 MiB hugetlb"
    assert instance._page_kind({"page_size": 1 << 20, "huge_pages": False}) == (
        "1 MiB hugetlb")  # s390x's
    assert instance._page_kind({"page_size": 1 << 30, "huge_pages": False}) == "1024 MiB hugetlb"
    assert instance._page_kind({"page_size": 64 << 10, "huge_pages": False}) == (
        "64 KiB hugetlb")  # an arm64 kernel's huge page
    assert instance._capacity(make_config(cache_mb=24)) == 24 << 20


def test_the_store_is_created_as_vllm_needs_it_and_says_where_it_is(store_env, monkeypatch, caplog):
    monkeypatch.setenv("SHMSTORE_VLLM_HUGE_PAGES", "off")
    caplog.set_level(logging.INFO, logger="shmstore.vllm")
    s = instance.open_store(make_config(cache_mb=16))
    st = s.stats()
    assert st["capacity"] == 16 << 20 and st["max_clients"] == 256
    assert st["page_size"] == 4096 and not st["huge_pages"]  # as SHMSTORE_VLLM_HUGE_PAGES asks
    assert st["table_slots"] >= 2 * (1 << 16)  # room for 64 Ki items, whatever the size
    path = instance.store_path()
    said = [r.getMessage() for r in caplog.records]
    assert said[0] == (
        f"shmstore: multimodal cache in {path} (16.0 MiB, 4 KiB pages, shared by every "
        f"front-end and worker of this vLLM instance; `shmstore stat {path}` and "
        f"`shmstore check {path}` look into it)"), said
    assert len(said) == 1, said  # no word of a rebuild that was turned off
    # Evicting: a store full of unpinned items makes room for the next.
    for i in range(20):
        s.put(f"item-{i}", b"x" * (1 << 20))
    assert s.stats()["evictions"] > 0
    # Removed when its last process leaves.
    del s
    import gc

    gc.collect()
    assert not os.path.exists(path)


def test_a_store_on_huge_pages_does_not_say_how_to_get_them(store_env, monkeypatch, caplog):
    monkeypatch.delenv("SHMSTORE_VLLM_HUGE_PAGES", raising=False)
    caplog.set_level(logging.INFO, logger="shmstore.vllm")
    s = instance.open_store(make_config(cache_mb=16))
    page = s.stats()["page_size"]
    said = [r.getMessage() for r in caplog.records]
    assert ("2 MiB transparent huge pages" in said[0]) == (page == 2 << 20), said
    assert (len(said) == 1) == (page == 2 << 20), said
    del s


def test_a_worker_that_creates_the_store_keeps_only_a_read_only_handle(store_env):
    s = instance.open_store(make_config(cache_mb=16), read_only=True)
    with pytest.raises(shmstore.ReadOnly):
        s.put("x", b"a worker's")
    # Its writable handle goes once the rebuild is done, on a thread of its own: then
    # only the read-only attach is left, and the store goes with it.
    for t in threading.enumerate():
        if t.name == "shmstore-rebuild":
            t.join(60)
    assert s.stats()["clients"] == 1
    path = instance.store_path()
    del s
    import gc

    gc.collect()
    assert not os.path.exists(path), "the store outlived its last process"


def test_an_attach_that_races_other_creators_retries_as_an_open(store_env, monkeypatch):
    # Processes find no store and all create it: the losers open the winner's. (Here
    # the store is found missing three times, and is there at each create.)
    winner = instance.open_store(make_config(cache_mb=16))
    winner.put("winner's", b"x")
    real_open = shmstore._native.Store.open
    calls = []

    def open_once_missing(*args, **kwargs):
        calls.append((args, kwargs))
        if len(calls) <= 3:
            raise shmstore._native.StoreNotFound("not yet")
        return real_open(*args, **kwargs)

    monkeypatch.setattr(shmstore._native.Store, "open", open_once_missing)
    loser = instance.open_store(make_config(cache_mb=16))
    assert loser.contains("winner's") and len(calls) == 4
    assert calls[-1][1] == {"read_only": False, "populate_in_background": True}


def test_only_a_front_end_on_a_store_of_another_size_is_told(store_env, caplog):
    class Attached:
        path = "/dev/shm/example"

        def __init__(self, capacity):
            self.capacity = capacity

        def stats(self):
            return {"capacity": self.capacity}

    want = 64 << 20
    caplog.set_level(logging.INFO, logger="shmstore.vllm")
    config = make_config(cache_mb=64)
    # The allocator rounds a capacity up by up to 2% plus 4 MiB: not another size.
    for have in (want, want + want // 50 + (4 << 20)):
        assert instance._opened(Attached(have), config, False).capacity == have
    assert not caplog.records
    for have in (want - 1, want + want // 50 + (4 << 20) + 1):
        instance._logged.discard(f"capacity:{Attached.path}")
        instance._opened(Attached(have), config, False)
        assert len(caplog.records) == 1 and caplog.records[0].levelno == logging.WARNING
        assert "64.0 MiB (--mm-processor-cache-gb=0.0625)" in caplog.text, caplog.text
        caplog.clear()
    # A worker (read-only) is never told: the front-end said it.
    instance._logged.discard(f"capacity:{Attached.path}")
    attached = Attached(1 << 20)
    assert instance._opened(attached, config, True) is attached
    assert not caplog.records
    instance._logged.discard(f"capacity:{Attached.path}")


def test_the_metrics_collector_is_replaced_not_added_and_a_name_clash_is_said(
        store_env, monkeypatch, caplog):
    from prometheus_client import REGISTRY, generate_latest

    from shmstore import prometheus

    store = instance.open_store(make_config(cache_mb=16))
    instance._export_metrics(store)
    first = instance._metrics
    caplog.set_level(logging.INFO, logger="shmstore.vllm")
    instance._logged.discard("metrics")
    instance._export_metrics(store)
    assert instance._metrics is not None and instance._metrics is not first
    assert not caplog.records, caplog.text
    name = store_env["SHMSTORE_VLLM_STORE"]
    assert generate_latest(REGISTRY).decode().count(f'shmstore_capacity_bytes{{store="{name}"}}') == 1
    # Names another collector holds: no metrics, said once, and the next export works.
    monkeypatch.setattr(prometheus, "register", lambda s: (_ for _ in ()).throw(
        ValueError("Duplicated timeseries in CollectorRegistry")))
    instance._export_metrics(store)
    assert instance._metrics is None
    assert [r.getMessage() for r in caplog.records] == [
        "shmstore: metrics not exported: Duplicated timeseries in CollectorRegistry"]
    assert f'store="{name}"' not in generate_latest(REGISTRY).decode()
    monkeypatch.undo()
    instance._export_metrics(store)
    assert f'store="{name}"' in generate_latest(REGISTRY).decode()
    # Without prometheus_client (an optional extra): said once; the collector stays.
    collector = instance._metrics
    caplog.clear()
    instance._logged.discard("metrics")
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails
    instance._export_metrics(store)
    assert [r.getMessage() for r in caplog.records] == [
        "shmstore: prometheus_client is not installed; no metrics"]
    assert instance._metrics is collector
    monkeypatch.undo()
    REGISTRY.unregister(instance._metrics)
    instance._metrics = None
    instance._logged.discard("metrics")


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_lines_before_vllm_set_up_its_logging_wait_for_it_and_warnings_do_not(monkeypatch):
    vllm_logger = logging.getLogger("vllm")
    monkeypatch.setattr(vllm_logger, "handlers", [])
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # pytest's own, for now
    last_resort = _Collect()
    monkeypatch.setattr(logging, "lastResort", last_resort)
    handler = instance._ToVllmLogging()
    log = logging.getLogger("shmstore.vllm.test")
    monkeypatch.setattr(log, "handlers", [handler])
    monkeypatch.setattr(log, "propagate", False)
    monkeypatch.setattr(log, "level", logging.DEBUG)
    for i in range(instance._ToVllmLogging._PENDING_MAX + 5):
        log.info("early %d", i)
    log.warning("a warning before vLLM's logging")
    assert [r.getMessage() for r in last_resort.records] == ["a warning before vLLM's logging"]
    # vLLM sets up its logger, with a record factory that adds its own fields: the lines
    # that waited go first, in order, remade by that factory, up to the bound.
    theirs = _Collect()
    vllm_logger.handlers = [theirs]
    old_factory = logging.getLogRecordFactory()

    def factory(*args, **kwargs):
        record = old_factory(*args, **kwargs)
        record.vllm_field = True
        return record

    logging.setLogRecordFactory(factory)
    try:
        log.info("first after")
        log.warning("second after")
    finally:
        logging.setLogRecordFactory(old_factory)
    got = [r.getMessage() for r in theirs.records]
    assert got == [f"early {i}" for i in range(64)] + ["first after", "second after"], got
    assert all(getattr(r, "vllm_field", False) for r in theirs.records[:64])
    # Remade with where it was logged: this file, this test, the line above the warning.
    early = theirs.records[0]
    assert (early.pathname, early.funcName) == (__file__, sys._getframe().f_code.co_name)
    assert early.lineno == last_resort.records[0].lineno - 1
    assert len(last_resort.records) == 1
    # With a root handler (the application's), a warning goes there by propagation:
    # not also to the last resort.
    vllm_logger.handlers = []
    monkeypatch.setattr(logging.getLogger(), "handlers", [_Collect()])
    log.warning("another")
    assert len(last_resort.records) == 1


def test_the_plugins_level_follows_vllms_unless_the_application_set_its_own(monkeypatch):
    ours = logging.getLogger("shmstore")
    monkeypatch.setattr(ours, "handlers", [])
    monkeypatch.setattr(ours, "level", logging.NOTSET)
    for setting, level in (("DEBUG", logging.DEBUG), ("warning", logging.WARNING),
                           ("no-such-level", logging.INFO), (None, logging.INFO)):
        ours.handlers, ours.level = [], logging.NOTSET
        if setting is None:
            monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
        else:
            monkeypatch.setenv("VLLM_LOGGING_LEVEL", setting)
        instance.use_vllm_logging()
        assert ours.level == level, setting
        assert [type(h).__name__ for h in ours.handlers] == ["_ToVllmLogging"]
    # The application set a level: kept. Handlers of its own: nothing added.
    ours.handlers, ours.level = [], logging.ERROR
    instance.use_vllm_logging()
    assert ours.level == logging.ERROR and len(ours.handlers) == 1
    mine = logging.NullHandler()
    ours.handlers, ours.level = [mine], logging.NOTSET
    instance.use_vllm_logging()
    assert ours.handlers == [mine] and ours.level == logging.NOTSET
    # vLLM's logging turned off: the plugin's too.
    ours.handlers = []
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")
    instance.use_vllm_logging()
    assert ours.handlers == [] and ours.level == logging.NOTSET


def test_a_repeated_condition_is_logged_once_per_process_at_its_level(caplog):
    caplog.set_level(logging.DEBUG, logger="shmstore.vllm")
    key = f"test-{id(caplog)}"
    instance._log_once(key, "said once", logging.WARNING)
    instance._log_once(key, "said once", logging.WARNING)
    instance._log_once(key + "-other", "another")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "said once"), (logging.INFO, "another")]


def test_the_launcher_hooks_its_exit_and_its_store_goes_with_it(shm_dir):
    # What `vllm serve` does at a clean exit, short of vLLM: mark, hook, attach, exit.
    r = run("""
        import os, shmstore
        from shmstore.vllm import instance
        assert instance.mark_launcher()
        instance.remove_at_exit()
        s = shmstore.Store.create(instance.store_path(), 1 << 20)   # never dropped
        keep = [s]
        keep.append(keep)
        """, {"SHMSTORE_VLLM_DIR": shm_dir, "SHMSTORE_VLLM_STORE": "shmstore-vllm-7-mine",
              "SHMSTORE_VLLM_LAUNCHER": ""})
    assert r.returncode == 0, r.stderr[-3000:]
    assert os.listdir(shm_dir) == [], "the store outlived its launcher"


class _Recorded(Exception):
    pass


def test_the_store_is_created_with_the_settings_vllm_needs_at_any_size(store_env, monkeypatch):
    # Recorded, not made: an 8 GiB store would take 8 GiB of /dev/shm.
    calls = []

    def record_open(path, **kwargs):
        calls.append(("open", path, kwargs))
        raise shmstore._native.StoreNotFound("no store yet")

    def record_create(path, capacity, **kwargs):
        calls.append(("create", path, capacity, kwargs))
        raise _Recorded

    monkeypatch.setattr(shmstore._native.Store, "open", record_open)
    monkeypatch.setattr(shmstore._native.Store, "create", record_create)
    monkeypatch.delenv("SHMSTORE_VLLM_HUGE_PAGES", raising=False)
    path = instance.store_path()
    for cache_mb, max_objects in ((16, 1 << 16), (8 << 10, (8 << 30) >> 16)):
        calls.clear()
        with pytest.raises(_Recorded):
            instance.open_store(make_config(cache_mb=cache_mb), read_only=True)
        # Attached in the background: the process starts at once, its first reads warm.
        assert calls == [
            ("open", path, {"read_only": True, "populate_in_background": True}),
            ("create", path, cache_mb << 20, {
                "max_objects": max_objects, "max_clients": 256, "evict": True,
                "remove_when_unused": True, "prefault": False, "huge_pages": "auto"})], calls
    monkeypatch.setenv("SHMSTORE_VLLM_HUGE_PAGES", "off")
    with pytest.raises(_Recorded):
        instance.open_store(make_config(cache_mb=16))
    assert calls[-1][3]["huge_pages"] == "off"


class _Created:
    """A store as `Store.create` returns it, on the pages given."""

    def __init__(self, page_size, huge_pages):
        self.page_size, self.huge_pages = page_size, huge_pages
        self.prefaulted = threading.Event()

    def stats(self):
        return {"page_size": self.page_size, "huge_pages": self.huge_pages}

    def prefault(self):
        self.prefaulted.set()


def test_a_store_left_on_4_kib_pages_says_how_to_get_huge_ones(store_env, monkeypatch, caplog):
    made = []

    def create(path, capacity, **kwargs):
        made.append(_Created(4096, False))
        return made[-1]

    def open_(path, read_only=False, **kwargs):
        if not made:
            raise shmstore._native.StoreNotFound("no store yet")
        return ("read-only attach", read_only, kwargs)

    monkeypatch.setattr(shmstore._native.Store, "create", create)
    monkeypatch.setattr(shmstore._native.Store, "open", open_)
    caplog.set_level(logging.INFO, logger="shmstore.vllm")
    assert instance.open_store(make_config(cache_mb=16)) is made[0]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "(16.0 MiB, 4 KiB pages," in said[0], said
    assert said[1].startswith("shmstore: this process rebuilds the store's pages as 2 MiB "
                              "pages in the background"), said
    # A worker that created it keeps a read-only attach (in the background too), and
    # its writable handle finishes the rebuild on a thread, then goes.
    made.clear()
    ro = instance.open_store(make_config(cache_mb=16), read_only=True)
    assert ro == ("read-only attach", True, {"populate_in_background": True})
    assert made[0].prefaulted.wait(30), "the creator's handle never finished the rebuild"
