//! The typed errors of every shmstore operation.
//!
//! Each variant carries the numbers a user needs to act, and its message says what to do
//! next. Nothing in the crate panics on bad input or on hostile shared memory: it returns one
//! of these.

use crate::ObjectId;
use std::fmt;
use std::io;
use std::path::PathBuf;
use std::time::Duration;

/// Everything that can go wrong in shmstore.
///
/// ```
/// use shmstore::{Error, ObjectId, Store, StoreConfig};
/// let store = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20)).unwrap();
/// match store.try_get(&ObjectId::of_key("missing")) {
///     Err(Error::NotFound { .. }) => {}
///     other => panic!("unexpected {other:?}"),
/// }
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// A system call on the store's backing file failed.
    Io {
        /// What we were doing.
        op: &'static str,
        /// The file involved (empty for anonymous stores).
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// The file system holding the store has too little free space for it.
    InsufficientSpace {
        /// Where the store was to be created.
        path: PathBuf,
        /// Bytes the store needs.
        needed: u64,
        /// Bytes the file system has free.
        available: u64,
    },
    /// The memory limit of the creating process's cgroup (a container's memory limit)
    /// leaves too little room for the store. Shared memory counts against that limit,
    /// and the kernel kills a process that goes over it rather than failing the
    /// allocation, so the store checks first.
    MemoryLimit {
        /// The cgroup directory whose limit is short.
        cgroup: PathBuf,
        /// Its limit in bytes.
        limit: u64,
        /// Bytes the store needs.
        needed: u64,
        /// Bytes still free under the limit, reclaimable page cache included.
        available: u64,
    },
    /// Too few huge pages are free for a store created with
    /// [`HugePages::Hugetlb`](crate::HugePages::Hugetlb).
    HugePagesUnavailable {
        /// Huge page size in bytes.
        page_size: u64,
        /// Pages the store needs.
        needed: u64,
        /// Pages free now.
        free: u64,
    },
    /// A store with this name already exists.
    StoreExists {
        /// The existing file.
        path: PathBuf,
    },
    /// No store with this name exists.
    StoreNotFound {
        /// The missing file.
        path: PathBuf,
    },
    /// The file is not a shmstore region (wrong magic bytes).
    NotAStore {
        /// The file.
        path: PathBuf,
    },
    /// The file is shorter than its header says, or too short to hold a header.
    Truncated {
        /// The file.
        path: PathBuf,
        /// Bytes the header says the file must have.
        expected: u64,
        /// Bytes it has.
        actual: u64,
    },
    /// The store was written by an incompatible version of shmstore.
    VersionMismatch {
        /// The file.
        path: PathBuf,
        /// Layout version found in the file.
        found: u32,
        /// Layout version this build reads.
        supported: u32,
    },
    /// A field in shared memory holds a value that no correct writer produces.
    Corrupted {
        /// Which field, and what was wrong with it.
        what: String,
    },
    /// The configuration cannot describe a store.
    InvalidConfig {
        /// What is wrong with it.
        reason: String,
    },
    /// `create` of an id that is already being created or is sealed.
    AlreadyExists {
        /// The id.
        id: ObjectId,
    },
    /// The id is not in the store (or not sealed yet, for a non-blocking get).
    NotFound {
        /// The id.
        id: ObjectId,
    },
    /// `delete` of an object that is still being written: abort it instead.
    NotSealed {
        /// The id.
        id: ObjectId,
    },
    /// A blocking get did not see the object sealed in time.
    Timeout {
        /// The id.
        id: ObjectId,
        /// How long we waited.
        waited: Duration,
    },
    /// No free block is large enough for the request.
    Full {
        /// Bytes requested (payload plus metadata).
        requested: u64,
        /// Bytes free in the whole store.
        free: u64,
        /// The largest block that could be allocated right now.
        largest_free: u64,
    },
    /// The request can never fit, however empty the store.
    TooLarge {
        /// Bytes requested.
        requested: u64,
        /// The largest object this store can ever hold.
        max: u64,
    },
    /// The object table has no free slot near this id's home bucket.
    TableFull {
        /// Objects in the store now.
        objects: u64,
        /// Table slots in the store.
        slots: u64,
    },
    /// Every client slot is taken by an attached process.
    TooManyClients {
        /// Client slots in the store.
        max: u32,
    },
    /// This process holds the maximum number of pins on one object.
    TooManyPins {
        /// The per-process, per-object limit.
        limit: u32,
    },
    /// A tensor item's header is malformed (see [`crate::item`]).
    BadItem {
        /// What is wrong.
        reason: String,
    },
    /// The process creating the object died (or detached) before sealing it; a get
    /// waiting for it gives up instead of waiting out its timeout.
    CreatorDied {
        /// The object.
        id: ObjectId,
        /// Process id of the creator.
        pid: u64,
    },
    /// The store was attached read-only; this operation writes objects.
    ReadOnly {
        /// The operation refused.
        op: &'static str,
    },
    /// A handle made by another process (this one's parent, before `fork()`) was used
    /// for something only its maker may do.
    Forked {
        /// The handle: `View` or `Creation`.
        what: &'static str,
        /// What happened and what to do instead.
        detail: String,
    },
    /// Per-object metadata is larger than the store allows.
    MetadataTooLarge {
        /// Bytes given.
        len: usize,
        /// Bytes allowed.
        max: usize,
    },
}

/// `Result` with [`Error`].
///
/// ```
/// fn size_of(store: &shmstore::Store, key: &str) -> shmstore::Result<usize> {
///     Ok(store.try_get(&shmstore::ObjectId::of_key(key))?.len())
/// }
/// # let store = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(1 << 20))?;
/// # store.put(&shmstore::ObjectId::of_key("k"), b"abc")?;
/// # assert_eq!(size_of(&store, "k")?, 3);
/// # Ok::<(), shmstore::Error>(())
/// ```
pub type Result<T> = std::result::Result<T, Error>;

fn mib(b: u64) -> String {
    if b >= 1 << 30 {
        format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
    } else if b >= 1 << 20 {
        format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
    } else if b >= 1 << 10 {
        format!("{:.1} KiB", b as f64 / 1024.0)
    } else {
        format!("{b} B")
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Io { op, path, source } => {
                write!(f, "{op} failed for {}: {source}", path.display())
            }
            Error::InsufficientSpace { path, needed, available } => write!(
                f,
                "{} has {} free, the store needs {}: free space there, choose a smaller capacity, \
                 or run the container with a larger --shm-size (Docker's default is 64 MiB)",
                path.parent().unwrap_or(path).display(),
                mib(*available),
                mib(*needed)
            ),
            Error::MemoryLimit { cgroup, limit, needed, available } => write!(
                f,
                "the memory limit of this process's cgroup ({}: {}) has {} left, the store \
                 needs {}, and shared memory counts against that limit (past it the kernel \
                 kills a process instead of failing): raise the container's memory limit \
                 (`docker run --memory`, Kubernetes `resources.limits.memory`) by the \
                 store's capacity, or choose a smaller capacity",
                cgroup.display(),
                mib(*limit),
                mib(*available),
                mib(*needed)
            ),
            Error::HugePagesUnavailable { page_size, needed, free } => write!(
                f,
                "the store needs {needed} huge pages of {}, {free} are free: reserve more \
                 (`sysctl -w vm.nr_hugepages=N`, or hugepages=N on the kernel command line), \
                 or create the store without HugePages::Hugetlb",
                mib(*page_size)
            ),
            Error::StoreExists { path } => write!(
                f,
                "a store already exists at {}: open it, choose another name, or remove it \
                 (`shmstore rm`) if it was left by a crashed run",
                path.display()
            ),
            Error::StoreNotFound { path } => write!(
                f,
                "no store at {}: check the name and directory, or create it first",
                path.display()
            ),
            Error::NotAStore { path } => write!(
                f,
                "{} is not a shmstore region (bad magic bytes): check the name; refusing to touch it",
                path.display()
            ),
            Error::Truncated { path, expected, actual } => write!(
                f,
                "{} is truncated: its header needs {expected} bytes but the file has {actual}; \
                 the store is damaged, remove it and create it again",
                path.display()
            ),
            Error::VersionMismatch { path, found, supported } => write!(
                f,
                "{} has layout version {found} but this shmstore reads version {supported}: \
                 use the same shmstore version in every process, or recreate the store",
                path.display()
            ),
            Error::Corrupted { what } => write!(
                f,
                "shared memory is corrupted ({what}): some process wrote garbage into the store; \
                 recreate it"
            ),
            Error::InvalidConfig { reason } => write!(f, "invalid store configuration: {reason}"),
            Error::AlreadyExists { id } => write!(
                f,
                "object {id} already exists (sealed or being created): get it instead, or delete it first"
            ),
            Error::NotFound { id } => write!(f, "object {id} is not in the store"),
            Error::NotSealed { id } => write!(
                f,
                "object {id} is still being written: its creator must seal or abort it"
            ),
            Error::Timeout { id, waited } => write!(
                f,
                "object {id} was not sealed within {waited:?}: its producer may be slow or gone; \
                 retry with a longer timeout"
            ),
            Error::Full { requested, free, largest_free } => write!(
                f,
                "store full: {} requested, {} free, largest free block {}: delete objects, \
                 drop views that pin them, or create a larger store",
                mib(*requested),
                mib(*free),
                mib(*largest_free)
            ),
            Error::TooLarge { requested, max } => write!(
                f,
                "an object of {} can never fit: this store holds at most {} per object; \
                 create a larger store",
                mib(*requested),
                mib(*max)
            ),
            Error::TableFull { objects, slots } => write!(
                f,
                "object table full near this id ({objects} objects in {slots} slots): delete \
                 objects or create the store with more max_objects"
            ),
            Error::TooManyClients { max } => write!(
                f,
                "all {max} client slots are taken: detach idle processes or create the store \
                 with more max_clients"
            ),
            Error::TooManyPins { limit } => write!(
                f,
                "this process already holds {limit} views of one object: drop views you no \
                 longer need (a clone of a view is another pin)"
            ),
            Error::BadItem { reason } => write!(
                f,
                "not a valid tensor item: {reason} (was it written by shmstore's put_item?)"
            ),
            Error::CreatorDied { id, pid } => write!(
                f,
                "object {id} will never be sealed: the process creating it (pid {pid}) died \
                 or detached first; its memory has been reclaimed, so create it again"
            ),
            Error::ReadOnly { op } => write!(
                f,
                "{op} refused: this process attached the store read-only (AttachOptions::read_only); \
                 attach read-write to create or delete objects"
            ),
            Error::Forked { what, detail } => write!(f, "{what} inherited across fork(): {detail}"),
            Error::MetadataTooLarge { len, max } => write!(
                f,
                "object metadata is {len} bytes, at most {max} are allowed: put large \
                 metadata in the payload"
            ),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_carry_numbers_and_a_fix() {
        let e = Error::InsufficientSpace {
            path: PathBuf::from("/dev/shm/x"),
            needed: 4 << 30,
            available: 64 << 20,
        };
        let m = e.to_string();
        assert!(m.contains("/dev/shm has 64.0 MiB free"), "{m}");
        assert!(m.contains("needs 4.0 GiB"), "{m}");
        assert!(m.contains("--shm-size"), "{m}");
        let m = Error::MemoryLimit {
            cgroup: PathBuf::from("/sys/fs/cgroup/pod"),
            limit: 8 << 30,
            needed: 4 << 30,
            available: 3 << 29,
        }
        .to_string();
        assert!(
            m.contains("(/sys/fs/cgroup/pod: 8.0 GiB) has 1.5 GiB left"),
            "{m}"
        );
        assert!(m.contains("needs 4.0 GiB") && m.contains("--memory"), "{m}");
        let full = Error::Full {
            requested: 2048,
            free: 1024,
            largest_free: 512,
        }
        .to_string();
        assert!(full.contains("2.0 KiB requested"), "{full}");
        assert!(
            full.contains("1.0 KiB free") && full.contains("512 B"),
            "{full}"
        );
    }

    /// An I/O failure keeps the OS error as its source, for callers that walk the chain
    /// (anyhow, `?` into `Box<dyn Error>`); other variants have none.
    #[test]
    fn an_io_error_keeps_the_os_error_as_its_source() {
        use std::error::Error as _;
        let e = Error::Io {
            op: "open",
            path: PathBuf::from("/dev/shm/x"),
            source: io::Error::from_raw_os_error(libc::EACCES),
        };
        let source = e.source().expect("the OS error");
        let os = source.downcast_ref::<io::Error>().expect("an io::Error");
        assert_eq!(os.raw_os_error(), Some(libc::EACCES));
        let full = Error::Full {
            requested: 1,
            free: 0,
            largest_free: 0,
        };
        assert!(full.source().is_none());
    }
}
