//! # shmstore
//!
//! A lock-free shared-memory object store for handing large buffers (tensors, images,
//! video frames) between processes on one machine without serialising or copying them,
//! in the style of Plasma, built for LLM inference engines such as vLLM.
//!
//! One region per store (a `/dev/shm` file or a memfd) holds a lock-free segregated-fit
//! allocator, a lock-free object table and one slot per attached process. Producers
//! **create -> write -> seal**; any attached process **gets** an immutable zero-copy
//! [`View`] that pins the object until dropped. A get blocks until the object is sealed,
//! woken by a futex shared across processes. No process ever waits on a lock another
//! process holds.
//!
//! ```
//! use shmstore::{ObjectId, Store, StoreConfig};
//! use std::time::Duration;
//!
//! // Engine process: create the store and put an item.
//! let store = Store::create_anonymous(&StoreConfig::with_capacity(64 << 20))?;
//! let pixels = vec![0u8; 3 * 224 * 224 * 4];
//! let id = ObjectId::of_content(&pixels);
//! store.put(&id, &pixels)?;
//!
//! // Worker process (here: the same one): only the id travels; the bytes are mapped.
//! let view = store.get(&id, Duration::from_secs(1))?;
//! assert_eq!(view.len(), pixels.len());
//! # Ok::<(), shmstore::Error>(())
//! ```
//!
//! Module map, lowest layer first (each depends only on those above it in this list):
//! `sync` (atomics and futexes, loom-switchable) -> `layout` (superblock,
//! section offsets) -> `region` (file, memfd, mapping) -> `alloc` (allocator) -> `table`
//! (object table) -> `client` (per-process slots) -> `capacity` (eviction, back-pressure)
//! -> `recovery` (dead clients, leak sweep) -> `store` (public API); [`item`] (tensor
//! items: one object of named arrays) stands apart, on `error` alone.
//! The design is in `docs/design.md`.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]
#![cfg(target_os = "linux")]
// Under loom only the protocol modules are built (over heap sections); the mapping and the
// public API need real memory.
#![cfg_attr(loom, allow(dead_code, unused_imports))]

mod alloc;
#[cfg(not(loom))]
mod capacity;
#[cfg(not(loom))]
mod cgroup;
mod client;
#[cfg(not(loom))]
mod copy;
mod error;
mod id;
pub mod item;
mod layout;
#[cfg(not(loom))]
mod liveness;
#[cfg(all(test, loom))]
mod loom_models;
#[cfg(not(loom))]
mod recovery;
#[cfg(not(loom))]
mod region;
#[cfg(not(loom))]
mod store;
pub(crate) mod sync;
mod table;
#[cfg(not(loom))]
#[doc(hidden)]
pub mod testing;

#[cfg(not(loom))]
pub use capacity::WhenFull;
pub use error::{Error, Result};
pub use id::{ObjectId, ParseObjectIdError};
#[cfg(not(loom))]
pub use recovery::RecoveryReport;
#[cfg(not(loom))]
pub use region::HugePages;
#[cfg(not(loom))]
#[doc(hidden)]
pub use store::RawBlock;
#[cfg(not(loom))]
pub use store::{
    AttachOptions, Creation, ObjectInfo, ObjectState, Objects, Stats, Store, StoreConfig, View,
    CREATOR_CHECK_PERIOD, DEFAULT_GET_SPIN,
};

/// Tells shmstore that this process was just made by `fork()`, for runtimes that fork
/// without running `pthread_atfork` handlers (glibc's and musl's `fork()` run them, and
/// shmstore registers one, so most programs never need this). Call it in the child before
/// it uses any handle it inherited. Harmless if called needlessly right after a fork.
///
/// ```
/// // In a child, right after a raw clone(2) that skipped the fork handlers:
/// shmstore::after_fork_in_child();
/// ```
#[cfg(not(loom))]
pub fn after_fork_in_child() {
    liveness::note_fork();
}

/// Leaves every store this process has attached the way an exiting process leaves them,
/// now: the locks that show other processes this one is alive are released, so they see it
/// as gone (and reclaim its pins at their next recovery), and [`Store::remove_if_unused`]
/// can remove a store nobody else uses, even while handles of this process are still
/// alive somewhere (held by a cycle, a global, or a thread that outlives the interpreter).
///
/// Call it only when the process is about to exit (an exit hook): its handles stay
/// mapped, but this process no longer pins or unpins through them, and using one again
/// attaches this process anew as a new client. The vLLM plugin's exit hook calls it before
/// removing the instance's store, because vLLM kills its workers at shutdown and never
/// drops the front-end's handle.
///
/// ```
/// use shmstore::{Store, StoreConfig};
/// let s = Store::create(&format!("doc-leave-{}", std::process::id()), &StoreConfig::with_capacity(1 << 20))?;
/// let path = s.path().unwrap().to_path_buf();
/// std::mem::forget(s); // a handle that is never dropped keeps the store in use
/// assert!(!Store::remove_if_unused(&path)?);
/// shmstore::leave_all_at_exit();
/// assert!(Store::remove_if_unused(&path)?);
/// # Ok::<(), shmstore::Error>(())
/// ```
#[cfg(not(loom))]
pub fn leave_all_at_exit() {
    liveness::note_fork();
}
