"""A child memory cgroup with a limit, for the checks that run vLLM (or a process of it)
as if in a container with a memory limit: ``check_serve.py``'s ``shmstore-memory-limit``
and ``tests_vllm/test_vllm_plugin.py``. Root on a writable cgroup file system (v1 or v2)
only; elsewhere ``Unavailable`` says why."""

from __future__ import annotations

import os


class Unavailable(Exception):
    """No memory cgroup with a limit can be made here (the reason is the message)."""


def child_memory_cgroup(limit: int, tag: str) -> str:
    """A new child of this process's memory cgroup, limited to ``limit`` bytes; its path.

    Raises ``Unavailable`` where it cannot be made, or where the machine has swap (the
    store then skips its check: tmpfs pages may go to swap instead of over the limit)."""
    with open("/proc/meminfo") as f:
        if any(line.startswith("SwapTotal:") and line.split()[1] != "0" for line in f):
            raise Unavailable("this machine has swap, so the store does not check the limit")
    with open("/proc/self/cgroup") as f:
        lines = [line.rstrip("\n").split(":", 2) for line in f]
    v1 = [path for _, controllers, path in lines if "memory" in controllers.split(",")]
    v2 = [path for _, controllers, path in lines if controllers == ""]
    base, path, limit_file = (
        ("/sys/fs/cgroup/memory", v1[0], "memory.limit_in_bytes") if v1
        else ("/sys/fs/cgroup", v2[0] if v2 else "/", "memory.max")
    )
    cg = os.path.join(base + path, f"{tag}-{os.getpid()}")
    try:
        os.mkdir(cg)
        with open(os.path.join(cg, limit_file), "w") as f:
            f.write(str(limit))
    except OSError as e:
        if os.path.isdir(cg):
            os.rmdir(cg)
        raise Unavailable(f"cannot make a memory cgroup with a limit here ({e})") from None
    return cg


def oom_kills(cg: str) -> int:
    """How many processes the kernel killed in ``cg`` for going over its limit."""
    for name in ("memory.events", "memory.oom_control"):  # v2, v1
        try:
            with open(os.path.join(cg, name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except FileNotFoundError:
            continue
    return 0
