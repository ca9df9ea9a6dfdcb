"""shmstore: a lock-free shared-memory object store for handing tensors between processes.

One engine process puts an item once; only its id (a str key such as vLLM's ``mm_hash``,
or 32 id bytes) travels over RPC; every worker maps the bytes in place::

    import numpy as np, shmstore

    store = shmstore.Store.create("mm-cache", 4 << 30, evict=True)   # engine
    shmstore.put_item(store, mm_hash, {"pixel_values": pixels})

    store = shmstore.Store.open("mm-cache")                           # worker
    item = shmstore.get_item(store, mm_hash, timeout=5.0)              # zero-copy arrays

The Rust core (``shmstore._native``) owns the memory; this package adds tensor items
(``put_item`` / ``get_item``) and the engine/worker caches (``SenderCache`` /
``ReceiverCache``). See python/README.md.
"""

import os as _os

from ._native import (
    AlreadyExists,
    BadItem,
    Corrupted,
    Creation,
    CreatorDied,
    Forked,
    Full,
    InsufficientSpace,
    InvalidConfig,
    MemoryLimit,
    NotFound,
    NotSealed,
    ReadOnly,
    ShmstoreError,
    Store,
    StoreExists,
    StoreNotFound,
    TableFull,
    Timeout,
    TooLarge,
    TooManyClients,
    TooManyPins,
    View,
    __version__,
    content_id,
    key_id,
    leave_all_at_exit,
    _after_fork_in_child,
)
from .items import get_item, put_item
from .cache import ReceiverCache, SenderCache

# After os.fork() (multiprocessing's "fork" start method, vLLM's forked workers), a child
# attaches as a client of its own on first use, pins the views it inherited in its own
# name, and leaves the parent's unsealed objects to the parent. The Rust core notices the
# fork by itself (pthread_atfork); this hook also re-pins live views at once, so arrays
# made from them before the fork stay valid in the child.
_os.register_at_fork(after_in_child=_after_fork_in_child)

__all__ = [
    "__version__",
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
    "ReceiverCache",
    "SenderCache",
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
    "content_id",
    "get_item",
    "key_id",
    "leave_all_at_exit",
    "put_item",
]
