//! The public store: [`Store`], [`Creation`] (writer handle), [`View`] (pinned reader
//! handle).
//!
//! This module wires the region, the allocator, the table and the client slot together and
//! owns the rules that span them: a block is allocated before its table entry is inserted
//! and freed only by the one process that moved its slot to FREEING; every step that
//! changes who owns a block runs inside the client's `ops` bracket (for the leak sweep);
//! every value read back from a table slot is range-checked against the heap before it
//! becomes a pointer; dead clients are recovered on attach, on `Full`, when a get meets a
//! dead creator, and on a bounded schedule (see [`crate::recovery`]).
//!
//! Files: `config` (what a store is made with and reports), `attachment` (the mapped
//! sections and this process's client slot, fork-aware), `lifecycle` (create, open,
//! remove), `observe` (stats, listings, recovery on demand, invariant checks), `view` and
//! `creation` (the two handles); this file holds the object operations (create, put, get,
//! delete). Handles hold an `Arc` of the attachment, so they are `'static + Send` and may
//! outlive the `Store` value they came from.
//!
//! # Fork
//! Every handle works across `fork()`: a child that uses an inherited `Store` attaches as
//! a client of its own on first use, views it inherited pin again in its name, and
//! creations it inherited stay the parent's. Nothing the child drops touches the parent's
//! slot or counters (docs/design.md, "Fork").

mod attachment;
mod config;
mod creation;
mod lifecycle;
mod observe;
#[cfg(test)]
mod tests;
mod view;

pub use config::{
    AttachOptions, ObjectInfo, ObjectState, Stats, StoreConfig, CREATOR_CHECK_PERIOD,
    DEFAULT_GET_SPIN,
};
pub use creation::Creation;
pub use observe::Objects;
pub use view::View;

use crate::alloc::Block;
use crate::capacity::{self, WhenFull};
use crate::client::{state_of, Liveness, CLIENT_ALIVE, CLIENT_FREE};
use crate::error::{Error, Result};
use crate::layout::{Superblock, FLAG_EVICT, FLAG_REMOVE_WHEN_UNUSED, MAX_META};
use crate::liveness;
use crate::recovery::RecoveryReport;
use crate::region::Mapping;
use crate::sync::Ordering;
use crate::table::{Entry, Event, Pin, Reclaimer, SlotRef, CREATING, DELETED, FREEING, RESERVED};
use crate::ObjectId;
use attachment::{Actor, Inner};
use std::fmt;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn pad64(x: u64) -> u64 {
    x.div_ceil(64) * 64
}

/// Fuzz hook: runs the entry validation on raw slot words.
pub(crate) fn resolve_untrusted(offset: u64, len: u64, info: u64) {
    let _ = Entry::from_parts(offset, len, info).block(1 << 30);
}

/// Whether a create may run slow work (recovery, eviction) on the way.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Work {
    Any,
    QuickOnly,
}

/// `start + timeout`, or a far future if that overflows.
fn deadline_after(start: Instant, timeout: Duration) -> Instant {
    start
        .checked_add(timeout)
        .or_else(|| start.checked_add(Duration::from_secs(1 << 32)))
        .unwrap_or(start)
}

/// A handle to an attached store. Cheap to clone; every clone shares one attachment.
///
/// ```
/// use shmstore::{ObjectId, Store, StoreConfig};
/// use std::time::Duration;
///
/// let store = Store::create_anonymous(&StoreConfig::with_capacity(16 << 20))?;
/// let id = ObjectId::of_content(b"pixels");
/// store.put(&id, b"pixels")?;
/// let view = store.get(&id, Duration::from_secs(1))?;
/// assert_eq!(&*view, b"pixels");
/// # Ok::<(), shmstore::Error>(())
/// ```
#[derive(Clone)]
pub struct Store {
    inner: Arc<Inner>,
}

impl fmt::Debug for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Store")
            .field("path", &self.inner.map.path())
            .field("capacity", &self.inner.sb.heap_size)
            .field("client", &self.inner.binding().map(|b| b.index).ok())
            .finish()
    }
}

impl Store {
    /// The largest object this store can ever hold.
    ///
    /// ```
    /// let s = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(1 << 20))?;
    /// assert_eq!(s.max_object_size(), 1 << 20);
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn max_object_size(&self) -> u64 {
        self.inner.alloc().max_object()
    }

    /// Starts creating object `id` of `len` bytes. Write through the returned handle, then
    /// [`Creation::seal`]; dropping it unsealed aborts and frees the memory.
    ///
    /// ```
    /// use shmstore::{Error, ObjectId, Store, StoreConfig};
    /// let store = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20))?;
    /// let id = ObjectId::of_key("frame-0");
    /// let mut c = store.create_object(&id, 4)?;
    /// c.copy_from_slice(&[1, 2, 3, 4]);
    /// assert!(matches!(store.create_object(&id, 4), Err(Error::AlreadyExists { .. })));
    /// c.seal()?;
    /// assert!(store.contains(&id));
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn create_object(&self, id: &ObjectId, len: u64) -> Result<Creation> {
        self.create_object_with_meta(id, len, &[])
    }

    /// Like [`create_object`](Self::create_object), with a small metadata blob (at most
    /// 4 KiB, e.g. a dtype/shape header) stored in the same block, readable through
    /// [`View::meta`].
    ///
    /// ```
    /// use shmstore::{ObjectId, Store, StoreConfig};
    /// let store = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20))?;
    /// let id = ObjectId::of_key("t");
    /// let mut c = store.create_object_with_meta(&id, 8, b"f32[2]")?;
    /// c.copy_from_slice(&[0; 8]);
    /// c.seal()?;
    /// assert_eq!(store.try_get(&id)?.meta(), b"f32[2]");
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn create_object_with_meta(
        &self,
        id: &ObjectId,
        len: u64,
        meta: &[u8],
    ) -> Result<Creation> {
        self.start_object(id, len, meta, Work::Any)
            .map(|c| c.expect("creates that may work never decline"))
    }

    /// [`put_with_meta`](Self::put_with_meta) that declines (`Ok(false)`, nothing done)
    /// instead of running slow work: scheduled recovery, or recovery and eviction in a
    /// full store. For callers that hold a lock others wait on while they call (Python's
    /// GIL): try this first, and on `false` release the lock and call `put_with_meta`.
    #[doc(hidden)]
    pub fn put_without_slow_work(&self, id: &ObjectId, bytes: &[u8], meta: &[u8]) -> Result<bool> {
        match self.start_object(id, bytes.len() as u64, meta, Work::QuickOnly)? {
            Some(mut c) => {
                c.write_at(0, bytes);
                c.seal().map(|()| true)
            }
            None => Ok(false),
        }
    }

    /// A create; with [`Work::QuickOnly`], `None` where slow work would be needed.
    fn start_object(
        &self,
        id: &ObjectId,
        len: u64,
        meta: &[u8],
        work: Work,
    ) -> Result<Option<Creation>> {
        if meta.len() as u64 > MAX_META {
            return Err(Error::MetadataTooLarge {
                len: meta.len(),
                max: MAX_META as usize,
            });
        }
        let inner = &self.inner;
        if inner.read_only {
            return Err(Error::ReadOnly { op: "create" });
        }
        let actor = inner.actor()?;
        let table = actor.table();
        // Cheap early answer (the insert below re-checks atomically): an existing id is
        // AlreadyExists even when the store is full.
        if table.contains_live(id) {
            return Err(Error::AlreadyExists { id: *id });
        }
        let need = pad64(meta.len() as u64)
            .checked_add(len)
            .ok_or(Error::TooLarge {
                requested: u64::MAX,
                max: self.max_object_size(),
            })?;
        // Every few creates, see whether scheduled recovery is due.
        if actor.maintenance_check() {
            if work == Work::QuickOnly && actor.maintenance_due() {
                return Ok(None);
            }
            actor.maintain();
        }
        // From the allocation until the entry names the block, a death here leaves
        // bits no entry names: the bracket tells recovery to owe a leak sweep.
        let op = actor.op();
        let block = match work {
            Work::Any => actor.alloc_block(need)?,
            Work::QuickOnly => match inner.alloc().alloc(need) {
                Ok(b) => b,
                Err(Error::Full { .. }) => return Ok(None),
                Err(e) => return Err(e),
            },
        };
        let entry = Entry {
            offset: block.offset,
            len,
            meta_len: meta.len() as u16,
            kind: block.kind.encode(),
            creator: actor.index,
        };
        let slot = match table.insert(id, &entry) {
            Ok(s) => s,
            Err(e) => {
                let _ = inner.alloc().free(block);
                return Err(e);
            }
        };
        drop(op);
        // Eviction finds objects by address through this (see `PageOwners`).
        inner.page_owners().record(&block, slot.index as usize);
        let res = match inner.resolve(&entry) {
            Ok(r) => r,
            Err(e) => {
                let _ = table.abort(id, slot);
                return Err(e);
            }
        };
        // SAFETY: the block is ours alone until sealed (fresh allocation, entry CREATING,
        // unsealed objects cannot be pinned); meta fits before the data (resolve checked).
        unsafe { std::ptr::copy_nonoverlapping(meta.as_ptr(), res.meta, meta.len()) };
        // A large write is announced before its pages are populated, so that the
        // creator's background zeroing pauses for the populate too (two threads zeroing
        // shmem pages at once contend in the kernel).
        let large = len >= attachment::POPULATE_MIN;
        if large {
            inner.large_writes.fetch_add(1, Ordering::Relaxed);
        }
        // A large block: map its pages for writing in one call, not one fault per page.
        inner.populate(res.data, len, true);
        Ok(Some(Creation {
            inner: Arc::clone(&self.inner),
            id: *id,
            slot,
            data: res.data,
            len: len as usize,
            done: false,
            large,
            made_in: liveness::generation(),
        }))
    }

    /// Like [`create_object`](Self::create_object), but when the store is full it waits up
    /// to `timeout` for space (another process deleting, a pin dropping in an evicting
    /// store) instead of failing at once. Ends with [`Error::Full`], with the numbers, if
    /// no space came in time; a request that can never fit fails at once with
    /// [`Error::TooLarge`].
    ///
    /// ```
    /// use shmstore::{Error, ObjectId, Store, StoreConfig};
    /// use std::time::Duration;
    /// let store = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20))?;
    /// store.put(&ObjectId::of_key("big"), &vec![0; 1 << 20])?;
    /// let s2 = store.clone();
    /// let t = std::thread::spawn(move || s2.create_object_wait(&ObjectId::of_key("next"), 1000, Duration::from_secs(10)).map(|c| c.seal()));
    /// store.delete(&ObjectId::of_key("big"))?; // frees the space; the waiter proceeds
    /// t.join().unwrap()??;
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn create_object_wait(
        &self,
        id: &ObjectId,
        len: u64,
        timeout: Duration,
    ) -> Result<Creation> {
        let deadline = deadline_after(Instant::now(), timeout);
        capacity::wait_for_space(self.inner.globals, deadline, || self.create_object(id, len))
    }

    /// Creates, copies and seals in one call.
    ///
    /// ```
    /// use shmstore::{ObjectId, Store, StoreConfig};
    /// let store = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20))?;
    /// let bytes = vec![7u8; 10_000];
    /// let id = ObjectId::of_content(&bytes);
    /// store.put(&id, &bytes)?;
    /// assert_eq!(&*store.try_get(&id)?, &bytes[..]);
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn put(&self, id: &ObjectId, bytes: &[u8]) -> Result<()> {
        self.put_with_meta(id, bytes, &[])
    }

    /// [`put`](Self::put) with per-object metadata.
    ///
    /// ```
    /// use shmstore::{ObjectId, Store, StoreConfig};
    /// let store = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20))?;
    /// store.put_with_meta(&ObjectId::of_key("a"), b"xy", b"u8[2]")?;
    /// assert_eq!(store.try_get(&ObjectId::of_key("a"))?.meta(), b"u8[2]");
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn put_with_meta(&self, id: &ObjectId, bytes: &[u8], meta: &[u8]) -> Result<()> {
        let mut c = self.create_object_with_meta(id, bytes.len() as u64, meta)?;
        c.write_at(0, bytes);
        c.seal()
    }

    /// Gets a sealed object, waiting up to `timeout` for it to be created and sealed. The
    /// returned view pins the object until dropped.
    ///
    /// ```
    /// use shmstore::{Error, ObjectId, Store, StoreConfig};
    /// use std::time::Duration;
    /// let store = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20))?;
    /// let id = ObjectId::of_key("late");
    /// assert!(matches!(store.get(&id, Duration::from_millis(5)), Err(Error::Timeout { .. })));
    /// let s2 = store.clone();
    /// let t = std::thread::spawn(move || s2.get(&id, Duration::from_secs(10)).map(|v| v.to_vec()));
    /// store.put(&id, b"ok")?;
    /// assert_eq!(t.join().unwrap()?, b"ok");
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    ///
    /// If the process creating the object dies before sealing it, the get fails with
    /// [`Error::CreatorDied`] within about [`CREATOR_CHECK_PERIOD`] instead of waiting out
    /// its timeout (and the dead creator's memory is reclaimed on the way).
    pub fn get(&self, id: &ObjectId, timeout: Duration) -> Result<View> {
        self.get_waiting(id, timeout, true)
    }

    /// Like [`get`](Self::get), but waits only for an object that is being created: if
    /// nobody holds `id` (never created, deleted, evicted), fails at once with
    /// [`Error::NotFound`] instead of waiting for someone to create it. For readers
    /// that were told the object exists (a cache keyed by content), for which an absent
    /// object is a miss to report, not a wait.
    ///
    /// ```
    /// use shmstore::{Error, ObjectId, Store, StoreConfig};
    /// use std::time::Duration;
    /// let store = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20))?;
    /// let id = ObjectId::of_key("gone");
    /// assert!(matches!(store.get_existing(&id, Duration::from_secs(60)), Err(Error::NotFound { .. })));
    /// store.put(&id, b"here")?;
    /// assert_eq!(&*store.get_existing(&id, Duration::from_secs(60))?, b"here");
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn get_existing(&self, id: &ObjectId, timeout: Duration) -> Result<View> {
        self.get_waiting(id, timeout, false)
    }

    fn get_waiting(&self, id: &ObjectId, timeout: Duration, wait_if_absent: bool) -> Result<View> {
        let (got, at_once) = self.get_uncounted(id, timeout, wait_if_absent)?;
        self.count_get(at_once, got.is_ok());
        got
    }

    /// A get that `stats` does not count, and whether it found the object sealed at once.
    fn get_uncounted(
        &self,
        id: &ObjectId,
        timeout: Duration,
        wait_if_absent: bool,
    ) -> Result<(Result<View>, bool)> {
        let actor = self.inner.actor()?;
        // The common case first: sealed already, no clock read.
        if let Pin::Pinned(r, e) = actor.table().pin_wait(id, None, Duration::ZERO)? {
            return Ok((self.view(id, r, e), true));
        }
        Ok((self.wait_for(&actor, id, timeout, wait_if_absent), false))
    }

    /// For bindings that wait in slices (to run signal handlers between them): one slice
    /// of a get, which `stats` does not count; the binding reports the whole get once
    /// with [`count_get`](Self::count_get). Returns whether the object was sealed at once.
    #[doc(hidden)]
    pub fn get_slice(
        &self,
        id: &ObjectId,
        slice: Duration,
        wait_if_absent: bool,
    ) -> Result<(Result<View>, bool)> {
        self.get_uncounted(id, slice, wait_if_absent)
    }

    /// Counts one get in `stats`: found at once (a hit), found after waiting, or not
    /// found. For bindings that wait with [`get_slice`](Self::get_slice).
    #[doc(hidden)]
    pub fn count_get(&self, at_once: bool, found: bool) {
        if let Ok(actor) = self.inner.actor() {
            actor.count(match (found, at_once) {
                (true, true) => Event::GetHit,
                (true, false) => Event::GetWaited,
                (false, _) => Event::GetMissed,
            });
        }
    }

    fn wait_for(
        &self,
        actor: &Actor<'_>,
        id: &ObjectId,
        timeout: Duration,
        wait_if_absent: bool,
    ) -> Result<View> {
        let start = Instant::now();
        let deadline = deadline_after(start, timeout);
        let table = actor.table();
        let mut spin = self.inner.get_spin;
        // The creator we saw working on the id: (client index, its ctl then, its pid).
        let mut creator: Option<(u16, u64, u64)> = None;
        loop {
            let slice = deadline.min(Instant::now() + CREATOR_CHECK_PERIOD);
            let found = table.pin_wait(id, Some(slice), spin)?;
            spin = Duration::ZERO;
            match found {
                Pin::Pinned(r, e) => return self.view(id, r, e),
                Pin::Creating { creator: c, .. } => {
                    let (ctl, alive, pid) = actor.creator(c)?;
                    if creator.is_some_and(|was| was.0 == c && was.1 == ctl)
                        && alive == Liveness::Dead
                    {
                        // Still the same attachment, and its process is gone.
                        actor.recover();
                        return Err(Error::CreatorDied { id: *id, pid });
                    }
                    creator = Some((c, ctl, pid));
                }
                Pin::Absent => {
                    // An abort woke us: if the creator we saw is no longer the same
                    // attachment, or is dead, it will not come back to seal.
                    if let Some((c, ctl, pid)) = creator.take() {
                        let (now, alive, _) = actor.creator(c)?;
                        if now != ctl || alive != Liveness::Alive {
                            return Err(Error::CreatorDied { id: *id, pid });
                        }
                    }
                    if !wait_if_absent {
                        return Err(Error::NotFound { id: *id });
                    }
                }
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    id: *id,
                    waited: start.elapsed(),
                });
            }
        }
    }

    /// Gets a sealed object without waiting; [`Error::NotFound`] if it is absent or not
    /// sealed yet.
    ///
    /// ```
    /// use shmstore::{ObjectId, Store, StoreConfig};
    /// let store = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20))?;
    /// assert!(store.try_get(&ObjectId::of_key("nope")).is_err());
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn try_get(&self, id: &ObjectId) -> Result<View> {
        let actor = self.inner.actor()?;
        match actor.table().pin_wait(id, None, Duration::ZERO)? {
            Pin::Pinned(r, e) => {
                actor.count(Event::GetHit);
                self.view(id, r, e)
            }
            _ => {
                actor.count(Event::GetMissed);
                Err(Error::NotFound { id: *id })
            }
        }
    }

    /// Like [`try_get`](Self::try_get), but also finds an object that was **deleted while
    /// a process still pins it** (draining), which lookups by id no longer find. For a
    /// process that pins objects and hands their ids to others who must not miss them,
    /// whatever happens to the ids meanwhile: vLLM's engine core pins the items of every
    /// request it admits, and its workers read them with this, so an item deleted by
    /// hand in between still reaches them. Objects evicted or deleted with
    /// [`delete_unpinned`](Self::delete_unpinned) are never draining (nobody pinned them).
    /// [`Error::NotFound`] if the store holds no such object, live or draining.
    ///
    /// ```
    /// use shmstore::{ObjectId, Store, StoreConfig};
    /// let store = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20))?;
    /// let id = ObjectId::of_key("frame");
    /// store.put(&id, b"pixels")?;
    /// let held = store.try_get(&id)?; // say, in another process
    /// store.delete(&id)?;
    /// assert!(store.try_get(&id).is_err()); // gone by id...
    /// assert_eq!(&*store.get_draining(&id)?, b"pixels"); // ...not while pinned
    /// drop(held);
    /// assert!(store.get_draining(&id).is_err()); // freed with its last pin
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn get_draining(&self, id: &ObjectId) -> Result<View> {
        let actor = self.inner.actor()?;
        let table = actor.table();
        let found = match table.pin_wait(id, None, Duration::ZERO)? {
            Pin::Pinned(r, e) => Some((r, e)),
            _ => table.pin_draining(id)?,
        };
        match found {
            Some((r, e)) => {
                actor.count(Event::GetHit);
                self.view(id, r, e)
            }
            None => {
                actor.count(Event::GetMissed);
                Err(Error::NotFound { id: *id })
            }
        }
    }

    /// Gets several objects, all within one overall `timeout`.
    ///
    /// ```
    /// use shmstore::{ObjectId, Store, StoreConfig};
    /// use std::time::Duration;
    /// let store = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20))?;
    /// let ids: Vec<_> = (0..3).map(|i| ObjectId::of_key(format!("{i}"))).collect();
    /// for id in &ids { store.put(id, b"x")?; }
    /// assert_eq!(store.get_many(&ids, Duration::from_secs(1))?.len(), 3);
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn get_many(&self, ids: &[ObjectId], timeout: Duration) -> Result<Vec<View>> {
        let deadline = deadline_after(Instant::now(), timeout);
        ids.iter()
            .map(|id| self.get(id, deadline.saturating_duration_since(Instant::now())))
            .collect()
    }

    fn view(&self, id: &ObjectId, r: SlotRef, e: Entry) -> Result<View> {
        let inner = &self.inner;
        let res = match inner.resolve(&e) {
            Ok(res) => res,
            Err(err) => {
                let _ = inner.actor()?.table().unpin(r);
                return Err(err);
            }
        };
        Ok(View {
            inner: Arc::clone(inner),
            id: *id,
            slot: r,
            meta: res.meta,
            meta_len: e.meta_len as usize,
            data: res.data,
            len: e.len as usize,
            pinned_in: View::pinned_now(),
        })
    }

    /// Is `id` present and sealed?
    ///
    /// ```
    /// use shmstore::{ObjectId, Store, StoreConfig};
    /// let store = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20))?;
    /// assert!(!store.contains(&ObjectId::of_key("x")));
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn contains(&self, id: &ObjectId) -> bool {
        self.inner.lookup_table().contains_sealed(id)
    }

    /// Deletes a sealed object. New gets stop finding it at once; its memory is freed when
    /// the last view of it drops.
    ///
    /// ```
    /// use shmstore::{ObjectId, Store, StoreConfig};
    /// let store = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20))?;
    /// let id = ObjectId::of_key("x");
    /// store.put(&id, b"abc")?;
    /// let view = store.try_get(&id)?;
    /// store.delete(&id)?;
    /// assert!(!store.contains(&id));
    /// assert_eq!(&*view, b"abc"); // still readable while pinned
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn delete(&self, id: &ObjectId) -> Result<()> {
        if self.inner.read_only {
            return Err(Error::ReadOnly { op: "delete" });
        }
        match self.inner.actor()?.table().delete(id)? {
            // Freed here: say so if the entry could not be (its slot is returned anyway).
            Some(e) => e.block(self.inner.sb.heap_size).map(|_| ()),
            None => Ok(()),
        }
    }

    /// Deletes a sealed object unless a process holds a view of it (this one included),
    /// as one atomic step: a [`get`](Self::get) racing it either pins the object first,
    /// and the object stays, or finds it gone. Returns whether it deleted.
    ///
    /// For a cache that clears what it put while other processes read: where
    /// [`delete`](Self::delete) would take an object from under a reader that found it
    /// (its view stays readable, but a process that looks the id up again misses), this
    /// leaves pinned objects in place. It is the CLOCK hand's eviction step, for one id.
    ///
    /// ```
    /// use shmstore::{ObjectId, Store, StoreConfig};
    /// let store = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20))?;
    /// let (a, b) = (ObjectId::of_key("a"), ObjectId::of_key("b"));
    /// store.put(&a, b"read")?;
    /// store.put(&b, b"idle")?;
    /// let view = store.try_get(&a)?;
    /// assert!(!store.delete_unpinned(&a)?); // pinned: kept
    /// assert!(store.delete_unpinned(&b)?);
    /// assert!(store.contains(&a) && !store.contains(&b));
    /// drop(view);
    /// assert!(store.delete_unpinned(&a)?);
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn delete_unpinned(&self, id: &ObjectId) -> Result<bool> {
        if self.inner.read_only {
            return Err(Error::ReadOnly {
                op: "delete_unpinned",
            });
        }
        match self.inner.actor()?.table().delete_unpinned(id)? {
            // Freed here (no pin was raised): say so if the entry could not be.
            Some(e) => e.block(self.inner.sb.heap_size).map(|_| true),
            None => Ok(false),
        }
    }
}

/// An allocator block handed out by [`Store::raw_alloc`]; benchmarks only.
#[doc(hidden)]
#[derive(Debug)]
pub struct RawBlock(Block);

impl Store {
    /// Test hook for the hostile-region fuzz target; see [`crate::testing`].
    pub(crate) fn scribble_metadata(&self, offset: u64, bytes: &[u8]) {
        self.inner.scribble_metadata(offset, bytes)
    }

    /// Test hook: starts an ownership-changing step and allocates a block that no entry
    /// will ever name, as a process killed inside `create_object` leaves.
    pub(crate) fn leak_inside_allocator_step(&self, size: u64) -> Result<()> {
        let actor = self.inner.actor()?;
        std::mem::forget(actor.op()); // the step never ends
        self.inner.alloc().alloc(size).map(|_| ())
    }

    /// Test hook: takes the leak sweep's token and owes a sweep, as a sweeper killed
    /// midway leaves (call it in a process that is then killed).
    pub(crate) fn hold_sweep_token(&self) -> Result<()> {
        let actor = self.inner.actor()?;
        let g = self.inner.globals;
        g.sweeps_owed.fetch_add(1, Ordering::AcqRel);
        g.sweeper.store(actor.index as u64 + 1, Ordering::Release);
        Ok(())
    }

    /// Test hook: claims a slab's pages and starts setting it up, but never publishes it,
    /// as a process killed inside new-slab setup leaves.
    pub(crate) fn die_in_slab_setup(&self) -> Result<()> {
        let actor = self.inner.actor()?;
        std::mem::forget(actor.op()); // the step never ends
        if self.inner.alloc().begin_slab_setup_only() {
            Ok(())
        } else {
            Err(Error::Full {
                requested: crate::layout::SLAB,
                free: 0,
                largest_free: 0,
            })
        }
    }

    /// Test hook: overwrites the `creator` of `id`'s table entry (a buggy or hostile
    /// process's write).
    pub(crate) fn corrupt_creator(&self, id: &ObjectId, creator: u16) -> Result<()> {
        self.inner.lookup_table().set_creator(id, creator)
    }

    /// Test hook: a recovery that stops halfway (see `testing::interrupted_recovery`).
    pub(crate) fn recover_interrupted(&self) -> Result<u64> {
        Ok(self.inner.actor()?.world().recover_dead_interrupted())
    }

    /// Allocates a raw block with no table entry. For the allocator benchmark only: the
    /// block is not attributed to any object (the leak sweep waits while any is out);
    /// free it with [`Store::raw_free`].
    #[doc(hidden)]
    pub fn raw_alloc(&self, size: u64) -> Result<RawBlock> {
        if self.inner.read_only {
            return Err(Error::ReadOnly { op: "raw_alloc" });
        }
        let actor = self.inner.actor()?;
        // Counted before the allocation, inside the step: at no moment is the block out
        // while a sweep could think this client quiet and without raw blocks.
        let _op = actor.op();
        let raw = &actor.header().raw_blocks;
        raw.fetch_add(1, Ordering::AcqRel);
        self.inner
            .alloc()
            .alloc(size)
            .map(RawBlock)
            .inspect_err(|_| {
                raw.fetch_sub(1, Ordering::AcqRel);
            })
    }

    /// Frees a block from [`Store::raw_alloc`].
    #[doc(hidden)]
    pub fn raw_free(&self, block: RawBlock) -> Result<()> {
        let actor = self.inner.actor()?;
        let _op = actor.op();
        self.inner.alloc().free(block.0)?;
        actor.header().raw_blocks.fetch_sub(1, Ordering::AcqRel);
        Ok(())
    }
}
