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

from ._native import (
    AlreadyExists,
    BadItem,
    Corrupted,
    Creation,
    CreatorDied,
    Full,
    InsufficientSpace,
    InvalidConfig,
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
    content_id,
    key_id,
)
from .items import get_item, put_item
from .cache import ReceiverCache, SenderCache

__all__ = [
    "AlreadyExists",
    "BadItem",
    "Corrupted",
    "Creation",
    "CreatorDied",
    "Full",
    "InsufficientSpace",
    "InvalidConfig",
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
    "put_item",
]
