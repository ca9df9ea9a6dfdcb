"""The store of one vLLM instance: its name (inherited by every process the instance
starts), its directory, creating or attaching to it, removing it when the instance's
launcher exits and removing stores that crashed instances left, exporting its figures to
vLLM's ``/metrics``, and sending the plugin's log lines where vLLM sends its own.

Invariants: one store per instance, named with the launcher's pid and a random part (no
clash between instances) unless the operator names it; the launcher, and only it, removes
the store at exit; a store some live process is attached to is never removed.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import uuid
from typing import Any, Literal

from .. import _native

logger = logging.getLogger("shmstore.vllm")  # one logger for the whole plugin

_PREFIX = "shmstore-vllm-"
#: Set by the launcher (its pid) and inherited by every process of the instance.
_LAUNCHER_ENV = "SHMSTORE_VLLM_LAUNCHER"


def mark_launcher() -> bool:
    """Whether this process is the instance's launcher, the first process of the instance
    to load the plugin (``vllm serve`` itself): no launcher is marked in the environment
    yet. It marks itself, so that every process it starts, forked or spawned, knows it is
    not. Separate from the store's name, which an operator may set
    (``SHMSTORE_VLLM_STORE``): such a store is the instance's all the same, and is
    removed with it when no other instance uses it."""
    if os.environ.get(_LAUNCHER_ENV):
        return False
    os.environ[_LAUNCHER_ENV] = str(os.getpid())
    return True


def is_launcher() -> bool:
    """Whether this process is the instance's launcher (``mark_launcher`` marked it): the
    one that says what holds for the whole instance, once."""
    return os.environ.get(_LAUNCHER_ENV) == str(os.getpid())


def store_name() -> str:
    """This vLLM instance's store name: ``SHMSTORE_VLLM_STORE``, set by the first process
    that asks (the launcher, when the plugin loads) and inherited by every process it
    starts, forked or spawned."""
    name = os.environ.get("SHMSTORE_VLLM_STORE")
    if not name:
        name = f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.environ["SHMSTORE_VLLM_STORE"] = name
    return name


def store_dir() -> str:
    """The directory of this instance's store: ``SHMSTORE_VLLM_DIR``, default /dev/shm."""
    return os.environ.get("SHMSTORE_VLLM_DIR") or "/dev/shm"


def store_path() -> str:
    """The path of this instance's store (``store_dir()`` / ``store_name()``)."""
    return os.path.join(store_dir(), store_name())


def remove_stale_stores(directory: str | None = None) -> list[str]:
    """Removes stores left by vLLM instances that crashed: every ``shmstore-vllm-*``
    store no live process is attached to, including stores of an older shmstore version
    (after an upgrade they cannot be opened, only removed). Returns the names removed. A
    store in use is never touched: every attached process holds a lock on a byte of the
    file, which the kernel drops when it dies (``Store.remove_if_unused``).
    """
    directory = directory or store_dir()
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        current = os.environ.get("SHMSTORE_VLLM_STORE")
        if not name.startswith(_PREFIX) or (
            current and (name == current or name.startswith(f"{current}-node-"))
        ):
            continue  # not ours, or this instance's (its store, or a node store of it)
        try:
            if _native.Store.remove_if_unused(os.path.join(directory, name)):
                removed.append(name)
        except (_native.ShmstoreError, OSError):
            continue  # not a store, or just removed by another instance
    if removed:
        logger.info("shmstore: removed %d store(s) left by crashed vLLM instances: %s",
                    len(removed), ", ".join(removed))
    return removed


# How long the launcher's exit hook waits for the instance's other processes to be gone:
# vLLM kills its engine and workers at shutdown (SIGKILL, without waiting for the
# workers), and the kernel drops a killed process's locks only once it has exited.
EXIT_WAIT_S = 3.0


def remove_at_exit() -> None:
    """Registers the launcher's exit hook (``_remove_instance_stores``): when the
    instance's launcher exits, the instance's stores go with it. vLLM never drops the
    front-end's handle and kills its workers at shutdown, so the store's own "remove when
    the last process leaves" never runs there."""
    atexit.register(_remove_instance_stores, os.getpid())


def _remove_instance_stores(launcher: int) -> list[str]:
    """The launcher's exit hook: leaves every store this process attached (as an exiting
    process does), then removes this instance's store and its node stores once no other
    process is attached, waiting up to ``EXIT_WAIT_S`` for the killed ones to be gone.
    A store some other live process still uses is left to it (and to the next start's
    ``remove_stale_stores``). Returns the names removed."""
    if os.getpid() != launcher:
        return []  # a forked child inherited the hook: the store is the launcher's
    _native.leave_all_at_exit()
    name = os.environ.get("SHMSTORE_VLLM_STORE")
    directory = store_dir()
    if not name:
        return []
    try:
        names = [n for n in os.listdir(directory)
                 if n == name or n.startswith(f"{name}-node-")]
    except OSError:
        return []
    removed: list[str] = []
    deadline = time.monotonic() + EXIT_WAIT_S
    while names:
        for n in list(names):
            try:
                gone = _native.Store.remove_if_unused(os.path.join(directory, n))
            except (_native.ShmstoreError, OSError):
                gone = False  # removed meanwhile, or not a store: nothing to wait for
                names.remove(n)
            if gone:
                removed.append(n)
                names.remove(n)
        if not names or time.monotonic() >= deadline:
            break
        time.sleep(0.01)  # the kernel gives no signal when a killed process's locks go
    if removed:
        logger.info("shmstore: removed this instance's store(s) at exit: %s", ", ".join(removed))
    for n in names:
        if not n.startswith(_PREFIX):
            # Named by the operator (SHMSTORE_VLLM_STORE), perhaps to share it with other
            # instances: one of them still uses it, and the last to exit removes it.
            logger.info(
                "shmstore: %s is still in use by another process (another vLLM instance "
                "sharing it?); left to it (the last instance using it removes it at exit; "
                "`shmstore rm %s` removes it by hand)", os.path.join(directory, n),
                os.path.join(directory, n))
            continue
        logger.warning(
            "shmstore: %s is still in use by a process outside this vLLM instance (or "
            "one of its own still exiting) %.0f s after it shut down; left in place (the "
            "next vLLM start removes it once unused)", os.path.join(directory, n),
            EXIT_WAIT_S)
    return removed


def _page_kind(stats: dict) -> str:
    """How the store's pages are backed, for the log: "4 KiB", "2 MiB transparent
    huge", "2 MiB hugetlb"."""
    size = stats["page_size"]
    label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
    if stats["huge_pages"]:
        return f"{label} transparent huge"
    return f"{label} hugetlb" if size > 4096 else label


def _size(n: int) -> str:
    """A capacity as an operator reads it: GiB from 1 GiB up, MiB below (a store of
    ``--mm-processor-cache-gb 0.004`` is "4.1 MiB", not "0.0 GiB")."""
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def _capacity(vllm_config) -> int:
    mm_config = vllm_config.model_config.get_multimodal_config()
    return int(mm_config.mm_processor_cache_gb * (1 << 30))


def open_store(vllm_config, *, read_only: bool = False) -> _native.Store:
    """Attaches to this instance's store, creating it (evicting, removed when its last
    process leaves) if this process is the first."""
    name = store_path()
    capacity = _capacity(vllm_config)
    huge_pages: Literal["auto", "off"] = (
        "off" if os.environ.get("SHMSTORE_VLLM_HUGE_PAGES") == "off" else "auto")
    for _ in range(3):
        try:
            # Front-ends and workers attach long before they use most of the store: map
            # it in the background so that their first accesses run warm.
            return _opened(_native.Store.open(name, read_only=read_only,
                                              populate_in_background=True),
                           vllm_config, read_only)
        except _native.StoreNotFound:
            pass
        try:
            try:
                s = _native.Store.create(
                    name,
                    capacity,
                    max_objects=max(1 << 16, capacity >> 16),
                    max_clients=256,
                    evict=True,
                    remove_when_unused=True,
                    prefault=False,
                    huge_pages=huge_pages,
                )
            except _native.MemoryLimit as e:
                gb = vllm_config.model_config.get_multimodal_config().mm_processor_cache_gb
                raise _native.MemoryLimit(
                    f"{e}. vLLM sets the capacity: --mm-processor-cache-gb={gb:g}. Lower "
                    "it, or raise the container's memory limit by as much"
                ) from None
            except _native.InsufficientSpace as e:
                # The capacity is vLLM's setting: say which one, and the usual fixes.
                gb = vllm_config.model_config.get_multimodal_config().mm_processor_cache_gb
                raise _native.InsufficientSpace(
                    f"{e}. vLLM sets the capacity: --mm-processor-cache-gb={gb:g}. Lower "
                    "it, run the container with --shm-size=<size> or --ipc=host, or set "
                    "SHMSTORE_VLLM_DIR to a tmpfs with room"
                ) from None
            st = s.stats()
            logger.info(
                "shmstore: multimodal cache in %s (%s, %s pages, shared by every "
                "front-end and worker of this vLLM instance; `shmstore stat %s` and "
                "`shmstore check %s` look into it)", name, _size(capacity),
                _page_kind(st), name, name)
            if st["page_size"] <= 4096 and huge_pages == "auto":  # not when turned off
                logger.info(
                    "shmstore: this process rebuilds the store's pages as 2 MiB pages in "
                    "the background where the kernel allows it (Linux 6.1 and later): "
                    "workers then map 512x fewer page-table entries. `shmstore stat %s` "
                    "shows how far it got; on older kernels mount a tmpfs with "
                    "huge=within_size and set SHMSTORE_VLLM_DIR to it (docs/vllm.md, "
                    "\"Huge pages\")", name)
            if not read_only:
                return s
            ro = _native.Store.open(name, read_only=True, populate_in_background=True)
            # A worker created the store: its writable handle goes once it has finished
            # rebuilding the pages (which only the creator does; `prefault` finishes it
            # now), on a thread, so this worker starts at once. It goes after the
            # read-only attach: the store is removed when unused.
            threading.Thread(target=_finish_rebuild_and_drop, args=([s],),
                             name="shmstore-rebuild").start()
            del s
            return ro
        except _native.StoreExists:
            pass
    return _opened(_native.Store.open(name, read_only=read_only, populate_in_background=True),
                   vllm_config, read_only)


def _opened(store: _native.Store, vllm_config, read_only: bool) -> _native.Store:
    """A store this process attached rather than created. A front-end (the one writer)
    says so when its capacity is not what vLLM asks for: the store outlived the instance
    that created it (named by the operator, ``SHMSTORE_VLLM_STORE``, and that instance
    crashed, or another instance shares it), and it keeps the capacity it was created
    with."""
    if read_only:
        return store
    want = _capacity(vllm_config)
    have = store.stats()["capacity"]
    # A store's capacity is the request rounded up to its allocator's granularity.
    if have < want or have > want + want // 50 + (4 << 20):
        gb = vllm_config.model_config.get_multimodal_config().mm_processor_cache_gb
        _log_once(
            f"capacity:{store.path}",
            f"shmstore: {store.path} already exists, with {_size(have)}; this instance "
            f"asks for {_size(want)} (--mm-processor-cache-gb={gb:g}). It outlived the "
            "instance that created it (one that crashed, or another instance sharing "
            "it), and this instance uses it as it is. For the new size, stop every "
            f"instance using it and remove the file (`rm {store.path}`).",
            logging.WARNING)
    return store


def _finish_rebuild_and_drop(holder: list) -> None:
    holder[0].prefault()
    holder.clear()


_logged: set[str] = set()
_metrics: Any = None  # the collector registered by _export_metrics


def _export_metrics(store: _native.Store) -> None:
    """Adds the store's figures to prometheus_client's default registry, which vLLM serves
    at ``/metrics`` (names in docs/metrics.md). One collector per process: a new sender
    cache replaces the previous one's. The collector holds the store weakly."""
    global _metrics
    try:
        from prometheus_client import REGISTRY

        from .. import prometheus
    except ImportError:
        _log_once("metrics", "shmstore: prometheus_client is not installed; no metrics")
        return
    if _metrics is not None:
        try:
            REGISTRY.unregister(_metrics)
        except KeyError:
            pass
    try:
        _metrics = prometheus.register(store)
    except ValueError as e:  # the names are taken by a collector of someone else's
        _metrics = None
        _log_once("metrics", f"shmstore: metrics not exported: {e}")


class _ToVllmLogging(logging.Handler):
    """Hands each record to the ``vllm`` logger's handlers as they are when it is logged
    (vLLM configures them late, and again per process), so the plugin's lines look like
    vLLM's. Lines logged before vLLM has any (the launcher loads plugins, and removes
    stores of crashed instances, before vLLM sets up its logging) wait, up to
    ``_PENDING_MAX``, and go out with the next line after it has; a warning goes at once
    where Python's default would send it."""

    _PENDING_MAX = 64

    def __init__(self) -> None:
        super().__init__()
        self._pending: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        theirs = logging.getLogger("vllm")
        if theirs.handlers:
            pending, self._pending = self._pending, []
            for early in pending:
                theirs.handle(_rebuilt(early))
            theirs.handle(record)
        elif record.levelno >= logging.WARNING:
            if not logging.getLogger().handlers and logging.lastResort is not None:
                logging.lastResort.handle(record)
        elif len(self._pending) < self._PENDING_MAX:
            self._pending.append(record)


def _rebuilt(record: logging.LogRecord) -> logging.LogRecord:
    """The record made again by the current record factory, which vLLM replaces with one
    that adds the fields its format names (a record made before that lacks them)."""
    return logging.getLogRecordFactory()(
        record.name, record.levelno, record.pathname, record.lineno, record.msg,
        record.args, record.exc_info, record.funcName, record.stack_info)


def use_vllm_logging() -> None:
    """Sends the package's log lines (logger ``shmstore`` and below) where vLLM sends its
    own, at vLLM's level (``VLLM_LOGGING_LEVEL``, default INFO): vLLM configures only its
    ``vllm`` logger, so without this the plugin's INFO lines (the store's name and size,
    its removal) went nowhere. Does nothing if the application configured ``shmstore``
    itself, or turned vLLM's logging off (``VLLM_CONFIGURE_LOGGING=0``)."""
    ours = logging.getLogger("shmstore")
    if ours.handlers or os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0":
        return
    ours.addHandler(_ToVllmLogging())
    if ours.level == logging.NOTSET:
        level = logging.getLevelName(os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())
        ours.setLevel(level if isinstance(level, int) else logging.INFO)


def _log_once(key: str, msg: str, level: int = logging.INFO) -> None:
    """Logs ``msg`` once per process for ``key`` (a condition that repeats)."""
    if key not in _logged:
        _logged.add(key)
        logger.log(level, msg)
