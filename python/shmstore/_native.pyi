"""Type information for shmstore's Rust core (``shmstore._native``, built by maturin).

Kept beside python/src/lib.rs: every class, method, function and exception it defines.
``mypy --strict`` runs over this package, its tests and examples in CI.
"""

import sys
from types import TracebackType
from typing import Any, Literal, final

from typing_extensions import Buffer

__all__ = [
    "AlreadyExists",
    "BadItem",
    "Corrupted",
    "Creation",
    "CreatorDied",
    "Forked",
    "Full",
    "InsufficientSpace",
    "InvalidConfig",
    "MemoryLimit",
    "NotFound",
    "NotSealed",
    "ReadOnly",
    "ShmstoreError",
    "Store",
    "StoreExists",
    "StoreNotFound",
    "TableFull",
    "Timeout",
    "TooLarge",
    "TooManyClients",
    "TooManyPins",
    "View",
    "__version__",
    "_after_fork_in_child",
    "content_id",
    "decode_item",
    "key_id",
    "leave_all_at_exit",
    "plan_item",
    "put_item_buffers",
]

#: The version of the package, the bindings and the Rust crate (one number, Cargo.toml).
__version__: str

#: An object id: a str key (hashed with blake3, e.g. vLLM's ``mm_hash``) or 32 id bytes.
_ObjectIdLike = str | bytes
#: Tensor-item metadata values.
_MetaValue = int | float | bool | str | bytes

class ShmstoreError(Exception):
    """Base class of every shmstore error."""

class Full(ShmstoreError):
    """No block is free for the object (and nothing could be evicted)."""

class TooLarge(ShmstoreError):
    """The object can never fit in this store."""

class Timeout(ShmstoreError):
    """The object was not sealed within the timeout."""

class AlreadyExists(ShmstoreError):
    """An object with this id exists (or is being created)."""

class NotFound(ShmstoreError):
    """No object with this id."""

class NotSealed(ShmstoreError):
    """The object is still being created."""

class CreatorDied(ShmstoreError):
    """The process creating the object died before sealing it."""

class ReadOnly(ShmstoreError):
    """The store was attached read-only."""

class Corrupted(ShmstoreError):
    """Shared memory holds a value no correct writer produces."""

class StoreExists(ShmstoreError):
    """A store with this name exists."""

class StoreNotFound(ShmstoreError):
    """No store with this name."""

class InsufficientSpace(ShmstoreError):
    """The file system has too little space for the store."""

class MemoryLimit(InsufficientSpace):
    """The memory limit of the creating process's cgroup (a container's) leaves too little room for the store."""

class TooManyClients(ShmstoreError):
    """Every client slot of the store is taken."""

class TooManyPins(ShmstoreError):
    """This process holds too many views of one object."""

class TableFull(ShmstoreError):
    """The object table has no free slot for this id."""

class InvalidConfig(ShmstoreError):
    """The store configuration is out of range."""

class Forked(ShmstoreError):
    """A handle inherited across fork() was used for what only its maker may do."""

class BadItem(ShmstoreError):
    """The object is not a valid tensor item."""

@final
class View:
    """A pinned, read-only view of a sealed object; exports its bytes through the buffer
    protocol. ``Store.get`` returns ``memoryview(view)``, whose ``.obj`` is this object."""

    # The buffer protocol (a C slot; a Python-level method from 3.12).
    if sys.version_info >= (3, 12):
        def __buffer__(self, flags: int, /) -> memoryview: ...

    @property
    def id(self) -> bytes:
        """The object's 32-byte id."""
    @property
    def meta(self) -> bytes:
        """The object's metadata blob."""
    @property
    def address(self) -> int:
        """Address of the first byte in this process (for zero-copy checks)."""
    def is_current(self) -> bool:
        """Whether the store still answers this view's id with this very object: False
        once the object was deleted (the view keeps its bytes, not its key) or its id was
        stored again since, as a new object. A lookup; takes no pin."""
    def __len__(self) -> int: ...

@final
class Creation:
    """An object being written: seal() publishes it, abort() (or dropping it) frees it. As
    a context manager it seals on a normal exit and aborts on an exception."""

    # The buffer protocol (C slots; Python-level methods from 3.12).
    if sys.version_info >= (3, 12):
        def __buffer__(self, flags: int, /) -> memoryview: ...
        def __release_buffer__(self, view: memoryview, /) -> None: ...

    @property
    def buffer(self) -> memoryview:
        """A writable memoryview of the object's bytes."""
    @property
    def id(self) -> bytes:
        """The object's 32-byte id."""
    def write(self, data: Buffer, offset: int = 0) -> None:
        """Copies ``data`` (any C-contiguous buffer) into the object at byte ``offset``,
        without the GIL; copies of 2 MiB and more stream past this core's caches.
        ValueError if it does not fit, or if ``data`` is the object's own memory."""
    def seal(self) -> None:
        """Publishes the object (getters blocked on it wake up)."""
    def abort(self) -> None:
        """Abandons the object and frees its memory."""
    def set_evictable(self, evictable: bool) -> None:
        """Never evict this object (stores created with ``evict=True``); before sealing."""
    def __len__(self) -> int: ...
    def __enter__(self) -> Creation: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        _exc: BaseException | None = None,
        _tb: TracebackType | None = None,
    ) -> None: ...

@final
class Store:
    """A handle to an attached store."""

    @staticmethod
    def create(
        name: str,
        capacity: int,
        *,
        max_objects: int = 0,
        max_clients: int = 0,
        evict: bool = False,
        remove_when_unused: bool = False,
        prefault: bool = False,
        huge_pages: Literal["auto", "off", "try", "hugetlb"] = "auto",
    ) -> Store:
        """Creates a named store (``/dev/shm/NAME``, or a path) of ``capacity`` bytes.
        ``huge_pages="auto"`` (the default) rebuilds the heap as 2 MiB pages in the
        background where the kernel allows it; ``stats()["huge_page_bytes"]`` says how far.
        Raises ``InsufficientSpace`` when the directory cannot hold the store, and its kind
        ``MemoryLimit`` when this process's cgroup (a container's memory limit) has no room."""
    @staticmethod
    def open(
        name: str,
        *,
        read_only: bool = False,
        prefault: bool = False,
        populate_in_background: bool = False,
    ) -> Store:
        """Opens an existing store by name (in /dev/shm) or path."""
    @staticmethod
    def remove_if_unused(name: str) -> bool:
        """Removes the store (by name in /dev/shm, or path) if no live process is attached,
        whatever shmstore version made it; True if removed. ``Corrupted`` for other files."""
    def put(self, id: _ObjectIdLike, data: Buffer, meta: Buffer | None = None) -> None:
        """Copies any C-contiguous buffer into a new sealed object."""
    def create_object(
        self,
        id: _ObjectIdLike,
        n: int,
        meta: Buffer | None = None,
        timeout: float | None = None,
    ) -> Creation:
        """Starts an object of ``n`` bytes; write through ``.buffer``, then ``seal()``."""
    def get(
        self, id: _ObjectIdLike, timeout: float | None = None, *, wait_if_absent: bool = True
    ) -> memoryview:
        """A read-only memoryview of a sealed object, waiting up to ``timeout`` seconds
        (None: forever); pinned while the memoryview or any array made from it lives."""
    def try_get(self, id: _ObjectIdLike) -> memoryview | None:
        """Like ``get``, but never waits: None if absent or not sealed yet."""
    def get_draining(self, id: _ObjectIdLike) -> memoryview | None:
        """Like ``try_get``, but also finds an object deleted while a process still pins it
        (draining); None if there is no such object, live or draining."""
    def contains(self, id: _ObjectIdLike) -> bool:
        """Is the object present and sealed?"""
    def delete(self, id: _ObjectIdLike) -> None:
        """Deletes a sealed object (freed when the last view drops)."""
    def delete_unpinned(self, id: _ObjectIdLike) -> bool:
        """Deletes a sealed object unless a process holds a view of it (atomically
        against gets); whether it deleted."""
    def stats(self) -> dict[str, int | bool]:
        """Occupancy and activity figures, read from counters."""
    def largest_free(self) -> int:
        """The largest object that could be created now (a bitmap scan; for tools)."""
    def pinned_objects(self) -> int:
        """Objects at least one process pins now (a table scan; for tools)."""
    def list(self) -> list[tuple[bytes, int, Literal["sealed", "creating", "draining"], int]]:
        """Every object: ``(id, length, state, pins)`` (a scan; for tools)."""
    def recover(self) -> dict[str, int | bool]:
        """Reclaims what dead processes left now; returns what it did."""
    @property
    def path(self) -> str | None:
        """The store's file, or None for an anonymous store."""
    def prefault(self) -> None:
        """Populates this process's page tables for the whole store, without the GIL,
        after stopping the store's background population (whose work this does)."""
    @property
    def heap_region(self) -> tuple[int, int]:
        """``(address, length)`` of the payload heap in this process."""
    @property
    def max_object_size(self) -> int:
        """The largest object this store can ever hold."""
    def unlink(self) -> None:
        """Removes the store's name (attached processes keep working)."""
    def bench_native(self, n: int, size: int = 64) -> dict[str, float]:
        """Times the same small calls from Rust (ns per put, get + drop, contains)."""

def plan_item(
    arrays: list[tuple[str, str, list[int] | tuple[int, ...]]], meta: dict[str, _MetaValue]
) -> tuple[bytes, list[tuple[int, int]], int]:
    """Lays out a tensor item: ``(header, [(offset, nbytes)], total length)``."""

def put_item_buffers(
    store: Store,
    id: _ObjectIdLike,
    arrays: list[tuple[str, str, list[int] | tuple[int, ...], Buffer]],
    meta: dict[str, _MetaValue],
    timeout: float | None = None,
    pin: bool = False,
) -> memoryview | None:
    """Writes a whole tensor item in one call (one copy per array, without the GIL).
    With ``pin=True`` returns the sealed item pinned (as ``Store.try_get``, without a
    second lookup), or None if it was deleted or evicted in between."""

def decode_item(
    data: Buffer,
) -> tuple[list[tuple[str, str, tuple[int, ...], int, int]], dict[str, Any]]:
    """Decodes a tensor item's header: ``([(name, dtype, shape, offset, nbytes)], meta)``."""

def content_id(data: Buffer) -> bytes:
    """The 32-byte id of some content (blake3)."""

def key_id(key: str) -> bytes:
    """The 32-byte id a str key maps to."""

def _after_fork_in_child() -> None: ...
def leave_all_at_exit() -> None:
    """Leaves every store this process attached as an exiting process leaves them, now:
    other processes see it as gone, so ``Store.remove_if_unused`` can remove a store while
    handles of this process are still alive. For exit hooks only: views already made keep
    their bytes mapped but no longer pin them, and using a handle again attaches anew."""
