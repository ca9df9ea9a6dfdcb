"""The `shmstore` command that the package installs: the Rust tool the wheel carries, run
through the console script, on stores this process uses."""

import json
import subprocess
import sys

import shmstore
from conftest import run_python, shmstore_command


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [shmstore_command(), *args], capture_output=True, text=True, timeout=60
    )


def test_the_command_is_installed_with_the_package_and_matches_its_version():
    out = _run("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"shmstore {shmstore.__version__}"
    out = _run("--help")
    assert out.returncode == 0 and "Usage: shmstore <COMMAND>" in out.stdout, out.stdout
    for sub in ("stores", "stat", "ls", "check", "recover", "rm", "metrics", "bench"):
        assert f"\n  {sub} " in out.stdout, (sub, out.stdout)


def test_python_dash_m_shmstore_is_the_same_command():
    out = subprocess.run(
        [sys.executable, "-m", "shmstore", "--version"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"shmstore {shmstore.__version__}"


def test_stat_ls_and_check_see_what_this_process_put(store_name, store):
    store.put("a", b"x" * 5000)
    view = store.get("a")
    stat = json.loads(_run("stat", store_name, "--json").stdout)
    assert (stat["objects"], stat["pins"], stat["clients_alive"]) == (1, 1, 1), stat
    listing = json.loads(_run("ls", store_name, "--json").stdout)
    assert [o["len"] for o in listing] == [5000], listing
    out = _run("check", store_name)
    assert out.returncode == 0 and "is sound: 1 object(s)" in out.stdout, out.stdout + out.stderr
    del view


def test_recover_reclaims_a_killed_process_pin(store_name, store):
    store.put("held", b"y" * 100)
    # Another interpreter pins the object and is killed holding the pin (SIGKILL).
    run_python(
        """
        import os, signal, sys, shmstore
        s = shmstore.Store.open(sys.argv[1])
        v = s.get("held")
        os.kill(os.getpid(), signal.SIGKILL)
        """,
        store_name,
        check=False,
    )
    out = _run("recover", store_name, "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["pins_released"] == 1, out.stdout
    assert _run("check", store_name).returncode == 0


def test_a_missing_store_is_a_clear_failure_with_exit_code_1(store_name):
    out = _run("check", store_name)
    assert out.returncode == 1
    assert "no store at" in out.stderr, out.stderr
