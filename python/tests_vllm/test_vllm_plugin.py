"""Activation through vLLM's plugin entry point and factories, lifecycle of the store,
CUDA registration skipped cleanly without a GPU."""

import importlib.metadata
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from types import SimpleNamespace

import pytest
from harness import make_config

import shmstore
from shmstore import vllm as sv


def run(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
        cwd=os.path.dirname(__file__),
    )


def test_the_entry_point_is_registered():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert any(ep.value == "shmstore.vllm:register" for ep in eps)


def test_vllms_factories_return_shmstores_caches_also_where_vllm_switches_ipc_off(store_env):
    r = run(
        """
        from harness import make_config, setup_process
        setup_process()
        from vllm.plugins import load_general_plugins
        load_general_plugins(); load_general_plugins()            # loaded more than once
        import shmstore.vllm as sv; sv.register()
        from vllm.multimodal import cache
        from vllm.multimodal.cache import factories
        hooked = factories.processor_cache_from_config
        sv.register()
        assert factories.processor_cache_from_config is hooked   # hooked once, not twice
        for dp, api in ((1, 1), (2, 1), (1, 3)):                  # DP and several API servers
            c = make_config(data_parallel=dp, api_servers=api)
            s = cache.processor_cache_from_config(c)
            assert type(s).__name__ == "ShmstoreSenderCache", (dp, api, s)
            e = factories.engine_receiver_cache_from_config(c)   # the engine core's gate
            assert type(e).__name__ == "ShmstoreEngineGate", e
            w = factories.worker_receiver_cache_from_config(c, None)
            assert type(w).__name__ == "ShmstoreReceiverCache"
            s.close()
        # The switch alone is enough: vLLM's default cache type (lru) is taken over too.
        c = make_config(); c.model_config.get_multimodal_config().mm_processor_cache_type = "lru"
        s = factories.processor_cache_from_config(c)
        assert type(s).__name__ == "ShmstoreSenderCache", s
        assert type(factories.engine_receiver_cache_from_config(c)).__name__ == "ShmstoreEngineGate"
        assert type(factories.worker_receiver_cache_from_config(c, None)).__name__ == "ShmstoreReceiverCache"
        s.close()
        # A cache size of 0 keeps vLLM's multimodal cache off, whatever the switch says.
        c = make_config(); c.model_config.get_multimodal_config().mm_processor_cache_gb = 0
        assert factories.processor_cache_from_config(c) is None
        assert factories.engine_receiver_cache_from_config(c) is None
        assert factories.worker_receiver_cache_from_config(c, None) is None
        # Where shmstore does not apply (here: the switch turned off after the hooks
        # went in), each hooked factory hands over to vLLM's own.
        import multiprocessing, os
        os.environ["SHMSTORE_VLLM"] = "0"
        c = make_config()
        s = factories.processor_cache_from_config(c)
        assert type(s).__name__ == "ShmObjectStoreSenderCache", s
        w = factories.worker_receiver_cache_from_config(c, multiprocessing.Lock())
        assert type(w).__name__ == "ShmObjectStoreReceiverCache", w
        s.close()
        c.model_config.get_multimodal_config().mm_processor_cache_type = "lru"
        e = factories.engine_receiver_cache_from_config(c)
        assert type(e).__name__ == "LruKeyReplicatedReceiverCache", e
        print("ok")
        """,
        store_env,
    )
    assert r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_without_the_switch_vllm_keeps_its_own_cache(store_env):
    env = {**store_env, "SHMSTORE_VLLM": ""}
    r = run(
        """
        from harness import make_config, setup_process
        setup_process()
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.multimodal.cache import factories
        s = factories.processor_cache_from_config(make_config())
        print(type(s).__name__)
        s.close()
        """,
        env,
    )
    assert r.stdout.strip().endswith("ShmObjectStoreSenderCache"), r.stderr[-3000:]


def test_the_entry_point_imports_nothing_heavy_while_the_switch_is_off(store_env):
    # vLLM loads every plugin in every process: with the switch off, the plugin costs an
    # environment lookup, and imports neither vLLM, torch nor its own modules.
    r = run(
        """
        import sys
        import shmstore.vllm as sv
        sv.register()
        heavy = sorted(m for m in sys.modules
                       if m.split(".")[0] in ("vllm", "torch") or m.startswith("shmstore.vllm."))
        print(heavy)
        """,
        {**store_env, "SHMSTORE_VLLM": ""},
    )
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr[-3000:])


def test_every_public_name_resolves_from_its_module():
    for name in sv.__all__:
        assert getattr(sv, name) is not None, name
    assert set(sv.__all__) <= set(dir(sv))
    with pytest.raises(AttributeError):
        sv.no_such_name  # noqa: B018


def test_a_vllm_without_the_hooks_keeps_its_own_cache_and_the_log_says_why(store_env):
    r = run(
        """
        import logging
        logging.basicConfig(level=logging.INFO)
        from harness import make_config, setup_process
        setup_process()
        from vllm.multimodal.cache import factories
        del factories.worker_receiver_cache_from_config      # as if a release renamed it
        import shmstore.vllm as sv
        sv.register()
        assert factories.processor_cache_from_config.__module__ == factories.__name__
        s = factories.processor_cache_from_config(make_config())
        print(type(s).__name__)
        s.close()
        """,
        store_env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("ShmObjectStoreSenderCache"), r.stdout
    assert "cannot hook into vLLM 0.34.0" in r.stderr, r.stderr[-3000:]
    assert "worker_receiver_cache_from_config" in r.stderr, r.stderr[-3000:]


def test_another_vllm_release_is_hooked_with_a_warning(store_env):
    r = run(
        """
        import logging
        logging.basicConfig(level=logging.INFO)
        from harness import make_config, setup_process
        setup_process()
        import shmstore.vllm as sv
        sv.vllm_version = lambda: "0.35.1"                    # what the metadata would say
        sv.register()
        from vllm.multimodal.cache import factories
        s = factories.processor_cache_from_config(make_config())
        print(type(s).__name__)
        s.close()
        """,
        {**store_env, "SHMSTORE_VLLM_STORE": "", "SHMSTORE_VLLM_LAUNCHER": ""},  # the launcher
    )
    assert r.stdout.strip().endswith("ShmstoreSenderCache"), r.stderr[-3000:]
    warning = f"this is vLLM 0.35.1; the plugin is written and tested for vLLM {sv.TESTED_VLLM}"
    assert warning in r.stderr, r.stderr[-3000:]
    # The processes it starts (which inherit the store's name) do not repeat it.
    r = run(
        """
        import logging
        logging.basicConfig(level=logging.INFO)
        import shmstore.vllm as sv
        sv.vllm_version = lambda: "0.35.1"
        sv.register()
        """,
        store_env,
    )
    assert r.returncode == 0 and warning not in r.stderr, r.stderr[-3000:]


def test_multi_node_setups_without_ray_keep_vllms_cache_unless_forced(
        store_env, monkeypatch, caplog):
    from shmstore.vllm import instance

    caplog.set_level(logging.INFO, logger="shmstore.vllm")
    for key in ("multinode", "ray"):
        instance._logged.discard(key)
    c = make_config()
    c.parallel_config.nnodes = 2
    assert sv.applies(c) is False
    assert [r.getMessage() for r in caplog.records] == [
        "shmstore: workers may run on other machines (nnodes or remote data-parallel ranks "
        "without Ray); using vLLM's own cache. SHMSTORE_VLLM=force overrides."]
    caplog.clear()
    monkeypatch.setenv("SHMSTORE_VLLM", "force")
    assert sv.applies(c)
    monkeypatch.setenv("SHMSTORE_VLLM", "1")
    c.parallel_config.nnodes = 1
    # Ray's executor: workers on other nodes fetch through shmstore.ray, if Ray is there
    # (python/tests_ray runs them); without Ray, vLLM's own cache.
    c.parallel_config.distributed_executor_backend = "ray"
    real_find_spec = importlib.util.find_spec
    for ray_there in (True, False):
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
            object() if ray_there else None) if name == "ray" else real_find_spec(name, *a))
        instance._logged.discard("ray")
        assert sv.applies(c) is ray_there
        said = [r.getMessage() for r in caplog.records]
        assert said == [
            "shmstore: Ray executor: workers on other nodes read items through their "
            "node's store, fetched once per node (shmstore.ray)" if ray_there else
            "shmstore: Ray executor but ray is not importable; using vLLM's own cache"], said
        caplog.clear()
    for key in ("multinode", "ray"):
        instance._logged.discard(key)


def test_the_store_is_named_once_per_instance_and_removed_at_clean_shutdown(monkeypatch):
    monkeypatch.delenv("SHMSTORE_VLLM_STORE", raising=False)
    name = sv.store_name()
    assert name.startswith(f"shmstore-vllm-{os.getpid()}-")
    assert sv.store_name() == name == os.environ["SHMSTORE_VLLM_STORE"]  # children inherit it
    sender = sv.ShmstoreSenderCache(make_config())
    receiver = sv.ShmstoreReceiverCache(make_config())
    assert os.path.exists(f"/dev/shm/{name}")
    sender.close()
    del sender, receiver
    import gc

    gc.collect()
    assert not os.path.exists(f"/dev/shm/{name}"), "removed when its last process left"


_LAUNCHER = """
    import logging, os, signal, subprocess, sys
    from harness import make_config, setup_process
    setup_process()
    logging.basicConfig()              # INFO lines to stderr (vLLM's logging is not set up)
    import shmstore.vllm as sv
    from shmstore.vllm import instance
    instance.EXIT_WAIT_S = float(os.environ.get("EXIT_WAIT", instance.EXIT_WAIT_S))
    sv.register()                      # the launcher: names the store, hooks its exit
    path = instance.store_path()
    print(path, flush=True)
    sender = sv.ShmstoreSenderCache(make_config())
    sender.store.put("item", b"pixels")
    # A worker attaches read-only and reads the item, as vLLM's do.
    worker = subprocess.Popen([sys.executable, "-c", (
        "import shmstore, sys; s = shmstore.Store.open(sys.argv[1], read_only=True); "
        "v = s.get('item'); print('read', flush=True); sys.stdin.readline()"), path],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert worker.stdout.readline().strip() == "read"
    outsider = None
    if os.environ.get("OUTSIDER"):
        # A process outside the instance (an operator's tool, say) still attached.
        outsider = subprocess.Popen([sys.executable, "-c", (
            "import shmstore, signal, sys; s = shmstore.Store.open(sys.argv[1], read_only=True); "
            "print('attached', flush=True); signal.pause()"), path],  # outlives the launcher
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True)
        assert outsider.stdout.readline().strip() == "attached"
        print(outsider.pid, flush=True)
    # vLLM's shutdown: the engine and its workers are killed (SIGKILL, without waiting
    # for the workers), and the front-end's cache is never dropped: a cycle keeps it.
    worker.send_signal(signal.SIGKILL)
    keep = [sender]
    keep.append(keep)
    sys.exit(0)
"""


def test_the_launcher_removes_the_store_when_it_exits_after_vllm_kills_the_workers(store_env):
    # What `vllm serve` does at Ctrl-C: before the exit hook, the store stayed in
    # /dev/shm until the next start (python/serve/check_serve.py found it).
    env = {**store_env, "SHMSTORE_VLLM_STORE": "", "SHMSTORE_VLLM_LAUNCHER": ""}
    # An instance that crashed before: its store goes when this one starts.
    crashed = f"/dev/shm/shmstore-vllm-999996-{os.getpid()}"
    shmstore.Store.create(crashed, 1 << 20)  # dropped at once: no process attached
    r = run(_LAUNCHER, env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not os.path.exists(crashed), "the crashed instance's store outlived the start"
    assert "store(s) left by crashed vLLM instances:" in r.stderr, r.stderr[-3000:]
    path = r.stdout.split()[0]
    assert os.path.basename(path).startswith("shmstore-vllm-")
    assert not os.path.exists(path), "the store outlived its instance"
    assert "removed this instance's store(s) at exit" in r.stderr, r.stderr[-3000:]


def test_a_store_the_operator_named_is_removed_with_its_instance_unless_another_uses_it(store_env):
    # SHMSTORE_VLLM_STORE set by the operator (to watch it with `shmstore stat`, or to
    # share it between instances): the launcher still removes it at exit. Before, only a
    # launcher that named the store itself did, and such a store stayed in /dev/shm.
    name = f"operator-named-{uuid.uuid4().hex[:6]}"
    env = {**store_env, "SHMSTORE_VLLM_STORE": name, "SHMSTORE_VLLM_LAUNCHER": ""}
    try:
        r = run(_LAUNCHER, env)
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.split()[0] == f"/dev/shm/{name}"
        assert not os.path.exists(f"/dev/shm/{name}"), "the named store outlived its instance"
        assert "removed this instance's store(s) at exit" in r.stderr, r.stderr[-3000:]
        # Another instance shares it: the first to exit leaves it, saying so, no warning.
        r = run(_LAUNCHER, {**env, "OUTSIDER": "1", "EXIT_WAIT": "0.3"})
        assert r.returncode == 0, r.stderr[-3000:]
        os.kill(int(r.stdout.split()[1]), signal.SIGKILL)
        assert os.path.exists(f"/dev/shm/{name}"), "removed under another instance"
        assert "another vLLM instance sharing it?" in r.stderr, r.stderr[-3000:]
        assert "outside this vLLM instance" not in r.stderr, r.stderr[-3000:]  # no warning
    finally:
        if os.path.exists(f"/dev/shm/{name}"):
            os.unlink(f"/dev/shm/{name}")


def test_a_cache_size_of_0_is_said_once_by_the_launcher_only(store_env):
    # With --mm-processor-cache-gb 0 the plugin's "active" line alone would send an
    # operator looking for a store that is never made.
    code = """
        import logging
        import shmstore.vllm as sv
        from harness import make_config
        said = []
        h = logging.Handler(); h.emit = lambda rec: said.append(rec.getMessage())
        logging.getLogger("shmstore.vllm").addHandler(h)
        sv.register()
        c = make_config(); c.model_config.get_multimodal_config().mm_processor_cache_gb = 0
        assert not sv.applies(c) and not sv.applies(c)
        print(sum("--mm-processor-cache-gb 0 turns" in m for m in said))
        """
    launcher = run(code, {**store_env, "SHMSTORE_VLLM_LAUNCHER": ""})
    assert launcher.stdout.split()[-1:] == ["1"], launcher.stderr[-3000:]
    other = run(code, store_env)  # a process the launcher started
    assert other.stdout.split()[-1:] == ["0"], other.stderr[-3000:]


def test_the_plugins_lines_go_where_vllms_go_in_vllms_format(store_env):
    # vLLM sets up its `vllm` logger only (and late: after plugins load); before the fix,
    # the plugin's INFO lines, the store's name among them, went nowhere in `vllm serve`.
    r = run(
        """
        import logging
        import shmstore.vllm as sv
        sv.register()
        log = logging.getLogger("shmstore.vllm")
        log.info("shmstore: a line before vLLM set up its logging")
        from vllm import logger as vlog
        vlog._configure_vllm_root_logger()   # what vLLM does once its config is read
        log.info("shmstore: a line of the plugin")
        log.debug("shmstore: below vLLM's level")
        """,
        {**store_env, "VLLM_LOGGING_STREAM": "ext://sys.stdout", "VLLM_LOGGING_COLOR": "0"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line for line in r.stdout.splitlines() if "shmstore: " in line]
    # Lines logged before vLLM set up its logging (register's own among them) are kept
    # and sent, in order, with the first line after; DEBUG stays below vLLM's level.
    assert len(lines) == 3, r.stdout[-3000:]
    assert "plugin active" in lines[0] and "[instance.py:" in lines[0], lines
    assert "a line before vLLM set up its logging" in lines[1], lines
    assert "a line of the plugin" in lines[2] and "[<string>:" in lines[2], lines
    # vLLM's format: process, pid, level, the file and line that logged.
    assert all("pid=" in line and " INFO " in line for line in lines), lines


def test_a_front_end_attaching_a_store_of_another_size_says_so_once(store_env, caplog):
    # A store the operator named outlives a crashed instance with its old capacity: the
    # next instance uses it as it is, and its front-end says so (workers, which attach
    # read-only, do not repeat it); one of the size asked for gets no word.
    from shmstore.vllm.instance import open_store, store_path

    small = make_config(cache_mb=16)
    first = open_store(small)  # the crashed instance's store
    first.put("warm", b"x")
    caplog.set_level(logging.INFO, logger="shmstore.vllm")
    bigger = make_config(cache_mb=64)
    stores = [open_store(bigger), open_store(bigger), open_store(bigger, read_only=True)]
    said = [r.getMessage() for r in caplog.records if "already exists" in r.getMessage()]
    assert len(said) == 1, said
    assert store_path() in said[0] and "16.0 MiB" in said[0] and "64.0 MiB" in said[0]
    assert all(s.contains("warm") for s in [first, *stores])
    caplog.clear()
    open_store(small)
    assert not [r for r in caplog.records if "already exists" in r.getMessage()]


def test_at_exit_a_store_another_live_process_uses_is_left_to_it(store_env):
    env = {**store_env, "SHMSTORE_VLLM_STORE": "", "SHMSTORE_VLLM_LAUNCHER": "",
           "OUTSIDER": "1", "EXIT_WAIT": "0.3"}
    r = run(_LAUNCHER, env)
    assert r.returncode == 0, r.stderr[-3000:]
    path, outsider = r.stdout.split()[:2]
    try:
        assert os.path.exists(path), "removed under a live process"
        assert "is still in use by a process outside this vLLM instance" in r.stderr, (
            r.stderr[-3000:])
        assert sv.remove_stale_stores(os.path.dirname(path)) == []
    finally:
        os.kill(int(outsider), signal.SIGKILL)
    # Once that process is gone too, the next start's sweep removes the store. The kernel
    # drops a killed process's lock when it has exited, with no event to wait on: poll.
    deadline = time.monotonic() + 30
    while os.path.basename(path) not in sv.remove_stale_stores(os.path.dirname(path)):
        assert time.monotonic() < deadline, "the outsider's lock outlived it"
        time.sleep(0.01)
    assert not os.path.exists(path)


def test_a_store_left_by_a_crashed_instance_is_removed_at_the_next_start(store_env):
    # Two crashed instances: one of this shmstore, one of an older version (after an
    # upgrade, its store cannot be opened any more, but must not leak either).
    crashed = f"shmstore-vllm-999999-{os.getpid()}"
    older = f"shmstore-vllm-999998-{os.getpid()}"
    for name in (crashed, older):
        r = run(
            """
            import os, shmstore
            s = shmstore.Store.create(os.environ["CRASHED"], 1 << 20)
            s.put("x", b"y")
            os._exit(0)   # no cleanup: as if killed
            """,
            {"CRASHED": name},
        )
        assert r.returncode == 0, r.stderr
        assert os.path.exists(f"/dev/shm/{name}")
    with open(f"/dev/shm/{older}", "r+b") as f:
        f.seek(8)
        f.write((3).to_bytes(4, "little"))  # the layout version field
    with pytest.raises(shmstore.Corrupted, match="version"):
        shmstore.Store.open(older)
    live = sv.open_store(make_config())  # this test's store, in use: must stay
    removed = sv.remove_stale_stores()
    assert {crashed, older} <= set(removed)
    assert not os.path.exists(f"/dev/shm/{crashed}")
    assert not os.path.exists(f"/dev/shm/{older}")
    assert os.path.exists(f"/dev/shm/{store_env['SHMSTORE_VLLM_STORE']}")
    del live


def _thp_dir() -> str | None:
    """A tmpfs mounted with transparent huge pages (``SHMSTORE_THP_DIR``, else the first
    one in /proc/mounts; scripts/hugepages.sh mounts one at /tmp/shmstore-thp)."""
    if os.environ.get("SHMSTORE_THP_DIR"):
        return os.environ["SHMSTORE_THP_DIR"]
    with open("/proc/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 3 and fields[2] == "tmpfs" and any(
                    o in ("huge=within_size", "huge=always") for o in fields[3].split(",")):
                return fields[1]
    return None


def test_shmstore_vllm_dir_moves_the_store_its_workers_and_its_cleanup(
        store_env, monkeypatch, caplog):
    # On a tmpfs with transparent huge pages when one is mounted (the point of the
    # setting), else in a plain directory of /dev/shm: the placement is tested either way.
    thp = _thp_dir()
    directory = thp or tempfile.mkdtemp(dir="/dev/shm", prefix="shmstore-test-dir-")
    if thp is None:
        print("no THP tmpfs mounted (scripts/hugepages.sh): testing a plain directory")
    monkeypatch.setenv("SHMSTORE_VLLM_DIR", directory)
    name = store_env["SHMSTORE_VLLM_STORE"]
    path = os.path.join(directory, name)
    # A store left there by a crashed instance is removed at start, as in /dev/shm.
    crashed = f"shmstore-vllm-999997-{os.getpid()}"
    r = run(
        """
        import os, shmstore
        s = shmstore.Store.create(os.environ["CRASHED"], 1 << 20)
        os._exit(0)   # no cleanup: as if killed
        """,
        {"CRASHED": os.path.join(directory, crashed)},
    )
    assert r.returncode == 0, r.stderr
    try:
        assert crashed in sv.remove_stale_stores()
        assert not os.path.exists(os.path.join(directory, crashed))
        with caplog.at_level(logging.INFO, logger="shmstore.vllm"):
            sender = sv.ShmstoreSenderCache(make_config())
        assert os.path.exists(path) and not os.path.exists(f"/dev/shm/{name}")
        assert path in caplog.text, caplog.text
        if thp:
            assert sender.store.stats()["huge_pages"]
            assert "2 MiB transparent huge pages" in caplog.text, caplog.text
        # On 4 KiB pages the log says how to get huge ones; on huge pages it does not. In
        # a plain directory the pages are huge too once the creator has rebuilt them
        # (Linux 6.1+, where the kernel finds free 2 MiB blocks: a 64 MiB store is
        # rebuilt whole inside `create`), so the hint follows the page size the log
        # line reports, not the mount.
        small_pages = "4 KiB pages" in caplog.text
        assert small_pages != ("2 MiB transparent huge pages" in caplog.text), caplog.text
        assert not (thp and small_pages), caplog.text
        assert ("mount a tmpfs with huge=within_size" in caplog.text) == small_pages, caplog.text
        # A worker process finds the store through the inherited setting and reads an
        # item the front-end put.
        sender.store.put("item", b"pixels" * 1000)
        r = run(
            """
            from harness import make_config, setup_process
            setup_process()
            import shmstore.vllm as sv
            w = sv.ShmstoreReceiverCache(make_config())
            print(sv.store_path(), bytes(w.store.get("item", 5.0))[:6].decode(),
                  w.store.stats()["huge_pages"])
            """,
            {**store_env, "SHMSTORE_VLLM_DIR": directory},
        )
        # On a THP tmpfs its pages are huge from the start; on a plain directory they are
        # once the front-end's background rebuild got to them (Linux 6.1+), or not yet.
        expected = ["True"] if thp else ["True", "False"]
        assert r.stdout.split()[:2] == [path, "pixels"], r.stderr[-3000:]
        assert r.stdout.split()[2] in expected, r.stdout
        sender.close()
        del sender
        import gc

        gc.collect()
        assert not os.path.exists(path), "removed when its last process left"
    finally:
        for f in (path, os.path.join(directory, crashed)):
            if os.path.exists(f):
                os.unlink(f)
        if thp is None:
            os.rmdir(directory)


def test_a_cache_larger_than_dev_shm_fails_at_start_naming_vllms_setting(store_env):
    # Docker's default /dev/shm is 64 MiB: the operator must learn at start which vLLM
    # setting to lower or which container option to raise, not from a SIGBUS later.
    st = os.statvfs("/dev/shm")
    free_gb = st.f_bavail * st.f_frsize / (1 << 30)
    cfg = make_config(cache_mb=(free_gb * 2 + 1) * 1024)
    with pytest.raises(shmstore.InsufficientSpace) as e:
        sv.ShmstoreSenderCache(cfg)
    msg = str(e.value)
    gb = cfg.model_config.get_multimodal_config().mm_processor_cache_gb
    assert f"--mm-processor-cache-gb={gb:g}" in msg, msg
    assert "/dev/shm" in msg and "--shm-size" in msg and "SHMSTORE_VLLM_DIR" in msg, msg
    assert not os.path.exists(sv.store_path()), "nothing is left behind"


def test_a_cache_over_the_containers_memory_limit_fails_at_start_naming_vllms_setting(
    store_env,
):
    # Shared memory counts against the container's memory limit, and past it the kernel
    # kills the process that reserves it (the API server, with nothing in the log). The
    # operator must instead learn at start which setting to lower or which limit to raise.
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "serve"))
    import memcg

    try:
        cg = memcg.child_memory_cgroup(256 << 20, "shmstore-vllm-test")
    except memcg.Unavailable as e:
        pytest.skip(str(e))
    try:
        r = run(
            f"""
            import os
            from harness import make_config
            import shmstore
            from shmstore import vllm as sv
            cfg = make_config(cache_mb=512)
            # From here on, what this process allocates is charged to the limited cgroup.
            with open({os.path.join(cg, "cgroup.procs")!r}, "w") as f:
                f.write(str(os.getpid()))
            try:
                sv.ShmstoreSenderCache(cfg)
                print("created")
            except shmstore.MemoryLimit as e:
                assert isinstance(e, shmstore.InsufficientSpace)
                print("MemoryLimit:", e)
            print("left:", os.path.exists(sv.store_path()))
            """,
            store_env,
        )
        assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
        assert "MemoryLimit:" in r.stdout, r.stdout
        assert f"({cg}: 256.0 MiB)" in r.stdout, r.stdout
        assert "--mm-processor-cache-gb=0.5" in r.stdout and "memory limit" in r.stdout, r.stdout
        assert "left: False" in r.stdout, "nothing is left behind"
        assert memcg.oom_kills(cg) == 0, "the kernel killed nothing"
    finally:
        os.rmdir(cg)


def test_cuda_registration_is_skipped_cleanly_without_a_gpu(store_env, monkeypatch, caplog):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: see the device benchmark in docs/vllm.md")
    for mode in ("auto", "1", "0"):
        monkeypatch.setenv("SHMSTORE_VLLM_CUDA_REGISTER", mode)
        r = sv.ShmstoreReceiverCache(make_config())
        assert r.cuda_registered is False
        del r
    assert any("no GPU is visible" in rec.message for rec in caplog.records)


def test_workers_register_with_cuda_only_after_the_store_is_on_2_mib_pages(store_env):
    # Registration pins every page, and the kernel cannot rebuild a pinned page: workers
    # wait for the creator's rebuild (or for it to stall: kernel cannot, creator gone).
    name = store_env["SHMSTORE_VLLM_STORE"]
    sender = sv.ShmstoreSenderCache(make_config(cache_mb=64))  # creates the store
    done = sv.wait_for_huge_pages(sender.store, limit_s=30)
    st = sender.store.stats()
    assert done == (st["page_size"] == 2 << 20), st
    if done:
        assert st["huge_page_bytes"] == st["capacity"] // (2 << 20) * (2 << 20)
    # A worker that creates the store (it starts first) hands it over read-only at once,
    # and its rebuild still finishes.
    worker_env = dict(os.environ, SHMSTORE_VLLM_STORE=name + "-w")
    code = (
        "import harness, sys; harness.setup_process(); from shmstore import vllm as sv; "
        "r = sv.ShmstoreReceiverCache(harness.make_config(cache_mb=64)); "
        "print(sv.wait_for_huge_pages(r.store, limit_s=30), r.store.stats()['page_size'])"
    )
    out = subprocess.run([sys.executable, "-c", code], env=worker_env, text=True,
                         capture_output=True, timeout=120,
                         cwd=os.path.dirname(__file__))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(done), str(st["page_size"])], out.stdout
    # A store that is never rebuilt: python/tests/test_cuda.py.
    sender.close()


def test_workers_register_with_cuda_on_the_device_of_their_first_read_not_at_start(
    store_env, monkeypatch, caplog
):
    # vLLM creates the receiver before it picks the worker's GPU (init_device), and CUDA's
    # current device is per thread: registering at start, or from the background thread's
    # own device 0, would start CUDA on GPU 0 in every worker. CUDA is faked here; the
    # real call runs in python/tests/test_cuda.py on a GPU machine.
    import threading

    import torch
    from harness import make_item

    from shmstore.vllm import receiver as rv

    calls: list = []

    def fake_register(store, *, read_only=True, device=None):
        calls.append((read_only, device))

    initialised = [False]
    monkeypatch.setattr(rv.cuda, "gpu_visible", lambda: True)
    monkeypatch.setattr(rv.cuda, "register", fake_register)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialised[0])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setenv("SHMSTORE_VLLM_CUDA_REGISTER", "auto")
    caplog.set_level(logging.INFO, logger="shmstore.vllm")
    cfg = make_config(cache_mb=64)
    sender = sv.ShmstoreSenderCache(cfg)
    r = sv.ShmstoreReceiverCache(cfg)
    markers = {h: sender.get_and_update_item((make_item(h), []), h)[0] for h in ("a", "b")}
    assert r.cuda_device_known is not None and not r.cuda_device_known.is_set()
    r.get_and_update_item(markers["a"], "a")  # CUDA not initialised yet: not the device
    assert not r.cuda_device_known.is_set() and calls == []
    initialised[0] = True  # vLLM's init_device ran
    r.get_and_update_item(markers["b"], "b")
    assert r.cuda_device_known.is_set() and r.cuda_device == 3
    for t in threading.enumerate():
        if t.name == "shmstore-cuda-register":
            t.join(120)
    assert calls == [(True, 3)] and r.cuda_registered
    assert any("registered the store's" in m and "on cuda:3" in m for m in caplog.messages), (
        caplog.messages)
    sender.close()


def test_with_a_gpu_a_worker_registers_with_cuda_after_its_first_read_and_its_items_are_pinned(
    store_env,
):
    # The path above with real CUDA (skipped without a GPU; run by scripts/gpu.sh --vllm):
    # the receiver starts no CUDA before vLLM picks the device, registers once the first
    # read finds CUDA up, and the items it returns then count as pinned and reach the GPU
    # exactly. A fresh process, so that no earlier test has initialised CUDA.
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no GPU is visible to torch")
    r = run(
        """
        import threading, torch
        from harness import make_config, make_item, setup_process
        setup_process()
        from shmstore import vllm as sv
        cfg = make_config(cache_mb=64)
        sender = sv.ShmstoreSenderCache(cfg)
        items = {h: make_item(h) for h in ("a", "b")}
        markers = {h: sender.get_and_update_item((items[h], []), h)[0] for h in items}
        r = sv.ShmstoreReceiverCache(cfg)
        assert not torch.cuda.is_initialized(), "the receiver started CUDA"
        dev = torch.cuda.device_count() - 1
        torch.cuda.set_device(dev)      # vLLM's init_device
        torch.zeros(1, device="cuda")
        first = r.get_and_update_item(markers["a"], "a")
        assert r.cuda_device_known.is_set() and r.cuda_device == dev
        [t.join(120) for t in threading.enumerate() if t.name == "shmstore-cuda-register"]
        assert r.cuda_registered, "not registered"
        for h, got in (("a", first), ("b", r.get_and_update_item(markers["b"], "b"))):
            for key, elem in got.items():
                if isinstance(elem.data, torch.Tensor) and elem.data.numel():
                    assert elem.data.is_pinned(), (h, key)
                    on_gpu = elem.data.to("cuda", non_blocking=True)
                    torch.cuda.synchronize()
                    assert torch.equal(on_gpu.cpu(), items[h][key].data), (h, key)
        sender.close()
        print("ok")
        """,
        store_env,
    )
    assert r.stdout.strip().endswith("ok"), (r.stdout[-2000:], r.stderr[-3000:])


def test_the_store_figures_appear_in_the_registry_vllm_serves(store_env):
    from prometheus_client import REGISTRY, generate_latest

    sender = sv.ShmstoreSenderCache(make_config())
    text = generate_latest(REGISTRY).decode()
    name = store_env["SHMSTORE_VLLM_STORE"]
    assert f'shmstore_capacity_bytes{{store="{name}"}}' in text, text[:2000]
    # A second cache in the same process replaces the first one's collector: no
    # duplicate-series error, one series per name.
    sender2 = sv.ShmstoreSenderCache(make_config())
    text = generate_latest(REGISTRY).decode()
    assert text.count(f'shmstore_objects{{store="{name}"}}') == 1
    del sender, sender2


def test_the_plugin_applies_with_the_switch_to_multimodal_models_and_the_caches_it_replaces(
        store_env, monkeypatch):
    c = make_config()
    assert sv.applies(c) is True
    for off in ("", "0", "no"):
        monkeypatch.setenv("SHMSTORE_VLLM", off)
        assert sv.applies(c) is False, off
    monkeypatch.setenv("SHMSTORE_VLLM", "1")

    class TextModelConfig:
        # vLLM's ModelConfig for a model without multimodal inputs: asked for its
        # multimodal config, it raises.
        supports_multimodal_inputs = False

        def get_multimodal_config(self):
            raise ValueError("The model is not multimodal.")

    for model_config in (TextModelConfig(), None):
        text = SimpleNamespace(model_config=model_config, parallel_config=c.parallel_config)
        assert sv.applies(text) is False
    # vLLM's other cache types are left to it; its default (lru) and shm are taken over.
    mm = c.model_config.get_multimodal_config()
    for cache_type, taken in (("processor_only", False), ("lru", True), ("shm", True)):
        mm.mm_processor_cache_type = cache_type
        assert sv.applies(c) is taken, cache_type
    mm.mm_processor_cache_gb = 0  # vLLM's cache off: shmstore's too
    assert sv.applies(c) is False
