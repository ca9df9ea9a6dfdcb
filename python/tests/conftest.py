import os
import subprocess
import sys
import sysconfig
import textwrap
import uuid
from typing import IO

import pytest

import shmstore


@pytest.fixture
def store_name():
    name = f"shmstore-py-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield name
    try:
        os.unlink(f"/dev/shm/{name}")
    except FileNotFoundError:
        pass


@pytest.fixture
def store(store_name):
    s = shmstore.Store.create(store_name, 32 << 20, max_objects=1024)
    yield s


def shmstore_command() -> str:
    """The `shmstore` command the package installs beside this interpreter (its console
    script, which runs the tool the wheel carries)."""
    exe = os.path.join(sysconfig.get_path("scripts"), "shmstore")
    assert os.access(exe, os.X_OK), f"{exe}: the package did not install its command"
    return exe


def run_python(code: str, *args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter (another process attached to the store)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        check=check,
        timeout=60,
        **kw,
    )


class Child(subprocess.Popen[str]):
    """A child interpreter whose stdin and stdout are pipes (never None)."""

    stdin: IO[str]
    stdout: IO[str]


def spawn_python(code: str, *args: str) -> Child:
    """Starts `code` in a fresh interpreter, talking over line pipes."""
    return Child(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
