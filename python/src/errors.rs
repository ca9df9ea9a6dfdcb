//! Errors: one Python exception class per `shmstore::Error` kind, all derived from
//! `ShmstoreError`, carrying the Rust message (which says what to do).

use pyo3::exceptions::PyException;
use pyo3::prelude::*;

pyo3::create_exception!(
    _native,
    ShmstoreError,
    PyException,
    "Base class of every shmstore error."
);
pyo3::create_exception!(
    _native,
    Full,
    ShmstoreError,
    "No block is free for the object (and nothing could be evicted)."
);
pyo3::create_exception!(
    _native,
    TooLarge,
    ShmstoreError,
    "The object can never fit in this store."
);
pyo3::create_exception!(
    _native,
    Timeout,
    ShmstoreError,
    "The object was not sealed within the timeout."
);
pyo3::create_exception!(
    _native,
    AlreadyExists,
    ShmstoreError,
    "An object with this id exists (or is being created)."
);
pyo3::create_exception!(_native, NotFound, ShmstoreError, "No object with this id.");
pyo3::create_exception!(
    _native,
    NotSealed,
    ShmstoreError,
    "The object is still being created."
);
pyo3::create_exception!(
    _native,
    CreatorDied,
    ShmstoreError,
    "The process creating the object died before sealing it."
);
pyo3::create_exception!(
    _native,
    ReadOnly,
    ShmstoreError,
    "The store was attached read-only."
);
pyo3::create_exception!(
    _native,
    Corrupted,
    ShmstoreError,
    "Shared memory holds a value no correct writer produces."
);
pyo3::create_exception!(
    _native,
    StoreExists,
    ShmstoreError,
    "A store with this name exists."
);
pyo3::create_exception!(
    _native,
    StoreNotFound,
    ShmstoreError,
    "No store with this name."
);
pyo3::create_exception!(
    _native,
    InsufficientSpace,
    ShmstoreError,
    "The file system has too little space for the store."
);
pyo3::create_exception!(
    _native,
    MemoryLimit,
    InsufficientSpace,
    "The memory limit of the creating process's cgroup (a container's) leaves too little room for the store."
);
pyo3::create_exception!(
    _native,
    TooManyClients,
    ShmstoreError,
    "Every client slot of the store is taken."
);
pyo3::create_exception!(
    _native,
    TooManyPins,
    ShmstoreError,
    "This process holds too many views of one object."
);
pyo3::create_exception!(
    _native,
    TableFull,
    ShmstoreError,
    "The object table has no free slot for this id."
);
pyo3::create_exception!(
    _native,
    InvalidConfig,
    ShmstoreError,
    "The store configuration is out of range."
);
pyo3::create_exception!(
    _native,
    Forked,
    ShmstoreError,
    "A handle inherited across fork() was used for what only its maker may do."
);
pyo3::create_exception!(
    _native,
    BadItem,
    ShmstoreError,
    "The object is not a valid tensor item."
);

/// The Python exception for a store error, carrying its message.
pub(crate) fn err(e: shmstore::Error) -> PyErr {
    use shmstore::Error as E;
    let msg = e.to_string();
    match e {
        E::Full { .. } => Full::new_err(msg),
        E::TooLarge { .. } | E::MetadataTooLarge { .. } => TooLarge::new_err(msg),
        E::Timeout { .. } => Timeout::new_err(msg),
        E::AlreadyExists { .. } => AlreadyExists::new_err(msg),
        E::NotFound { .. } => NotFound::new_err(msg),
        E::NotSealed { .. } => NotSealed::new_err(msg),
        E::CreatorDied { .. } => CreatorDied::new_err(msg),
        E::ReadOnly { .. } => ReadOnly::new_err(msg),
        E::Corrupted { .. }
        | E::NotAStore { .. }
        | E::Truncated { .. }
        | E::VersionMismatch { .. } => Corrupted::new_err(msg),
        E::StoreExists { .. } => StoreExists::new_err(msg),
        E::StoreNotFound { .. } => StoreNotFound::new_err(msg),
        E::MemoryLimit { .. } => MemoryLimit::new_err(msg),
        E::InsufficientSpace { .. } | E::HugePagesUnavailable { .. } => {
            InsufficientSpace::new_err(msg)
        }
        E::TooManyClients { .. } => TooManyClients::new_err(msg),
        E::TooManyPins { .. } => TooManyPins::new_err(msg),
        E::TableFull { .. } => TableFull::new_err(msg),
        E::InvalidConfig { .. } => InvalidConfig::new_err(msg),
        E::BadItem { .. } => BadItem::new_err(msg),
        E::Forked { .. } => Forked::new_err(msg),
        _ => ShmstoreError::new_err(msg),
    }
}

/// Adds every exception class to the module.
pub(crate) fn add_to(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    for (name, ty) in [
        ("ShmstoreError", py.get_type::<ShmstoreError>()),
        ("Full", py.get_type::<Full>()),
        ("TooLarge", py.get_type::<TooLarge>()),
        ("Timeout", py.get_type::<Timeout>()),
        ("AlreadyExists", py.get_type::<AlreadyExists>()),
        ("NotFound", py.get_type::<NotFound>()),
        ("NotSealed", py.get_type::<NotSealed>()),
        ("CreatorDied", py.get_type::<CreatorDied>()),
        ("ReadOnly", py.get_type::<ReadOnly>()),
        ("Corrupted", py.get_type::<Corrupted>()),
        ("StoreExists", py.get_type::<StoreExists>()),
        ("StoreNotFound", py.get_type::<StoreNotFound>()),
        ("InsufficientSpace", py.get_type::<InsufficientSpace>()),
        ("MemoryLimit", py.get_type::<MemoryLimit>()),
        ("TooManyClients", py.get_type::<TooManyClients>()),
        ("TooManyPins", py.get_type::<TooManyPins>()),
        ("TableFull", py.get_type::<TableFull>()),
        ("InvalidConfig", py.get_type::<InvalidConfig>()),
        ("BadItem", py.get_type::<BadItem>()),
        ("Forked", py.get_type::<Forked>()),
    ] {
        m.add(name, ty)?;
    }
    Ok(())
}
