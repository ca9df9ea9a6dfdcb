//! [`Creation`]: the unique writer handle of an object until it is sealed.
//!
//! Only the process that created an object may write, seal or abort it. After `fork()`
//! the child's copy of a creation is inert: writing through it panics, sealing it returns
//! [`Error::Forked`], and dropping it does nothing (the parent's copy decides the object's
//! fate; docs/design.md, "Fork").

use super::attachment::Inner;
use crate::error::{Error, Result};
use crate::liveness;
use crate::sync::Ordering;
use crate::table::SlotRef;
use crate::ObjectId;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

/// A writer handle: `&mut [u8]` over an object's memory until [`seal`](Self::seal).
/// Dropping it without sealing aborts the creation and frees the memory.
///
/// ```
/// use shmstore::{ObjectId, Store, StoreConfig};
/// let store = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20))?;
/// let id = ObjectId::of_key("x");
/// let c = store.create_object(&id, 100)?;
/// drop(c); // aborted
/// assert!(!store.contains(&id));
/// assert_eq!(store.stats().used, 0);
/// # Ok::<(), shmstore::Error>(())
/// ```
pub struct Creation {
    pub(super) inner: Arc<Inner>,
    pub(super) id: ObjectId,
    pub(super) slot: SlotRef,
    pub(super) data: *mut u8,
    pub(super) len: usize,
    pub(super) done: bool,
    /// Counted in `Inner::large_writes` until dropped.
    pub(super) large: bool,
    /// The fork generation of the process that created it.
    pub(super) made_in: u64,
}

// SAFETY: the handle is the unique writer of its block; moving it to another thread moves
// that exclusivity with it.
unsafe impl Send for Creation {}
// SAFETY: `&Creation` only gives shared reads of the block.
unsafe impl Sync for Creation {}

impl Creation {
    /// The object's id.
    ///
    /// ```
    /// # let store = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(1 << 20))?;
    /// let id = shmstore::ObjectId::of_key("a");
    /// assert_eq!(store.create_object(&id, 1)?.id(), id);
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn id(&self) -> ObjectId {
        self.id
    }

    /// `Ok` in the process that started the creation; [`Error::Forked`] in a child made
    /// by `fork()` since, where writing, sealing and aborting are the parent's to do.
    ///
    /// ```
    /// # let store = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(1 << 20))?;
    /// let c = store.create_object(&shmstore::ObjectId::of_key("a"), 1)?;
    /// assert!(c.writable_here().is_ok());
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn writable_here(&self) -> Result<()> {
        self.ours()
    }

    fn ours(&self) -> Result<()> {
        if self.made_in == liveness::generation() {
            return Ok(());
        }
        Err(Error::Forked {
            what: "Creation",
            detail: format!(
                "object {} is being written by the process that forked this one; only its \
                 creator can write, seal or abort it (create objects after fork())",
                self.id
            ),
        })
    }

    /// Copies `bytes` into the object at `offset`: the way to fill an object from a
    /// buffer. Copies of 2 MiB and more bypass this core's caches (non-temporal stores on
    /// x86-64): the object is for other processes, and streaming it to memory is about
    /// 1.4x faster than `copy_from_slice` for an image-sized copy while leaving the caches
    /// to the producer's other work (docs/benchmarks.md, "Large puts").
    ///
    /// # Panics
    /// If `offset + bytes.len()` exceeds the object's length, as slice indexing does, and
    /// in a child made by `fork()`, as every write through the handle does.
    ///
    /// ```
    /// # let store = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(4 << 20))?;
    /// let id = shmstore::ObjectId::of_key("a");
    /// let image = vec![7u8; 1 << 20];
    /// let mut c = store.create_object(&id, 4 + image.len() as u64)?;
    /// c.write_at(0, b"img1");
    /// c.write_at(4, &image);
    /// c.seal()?;
    /// assert_eq!(&store.try_get(&id)?[..6], &[b'i', b'm', b'g', b'1', 7, 7]);
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn write_at(&mut self, offset: usize, bytes: &[u8]) {
        let end = offset
            .checked_add(bytes.len())
            .filter(|&end| end <= self.len)
            .unwrap_or_else(|| {
                panic!(
                    "write_at: {} bytes at offset {offset} do not fit the object's {} bytes",
                    bytes.len(),
                    self.len
                )
            });
        crate::copy::copy_into_object(&mut self[offset..end], bytes);
    }

    /// Publishes the object: from now on its bytes never change while anyone pins it, and
    /// getters blocked on it wake up.
    ///
    /// ```
    /// # let store = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(1 << 20))?;
    /// let id = shmstore::ObjectId::of_key("a");
    /// let mut c = store.create_object(&id, 1)?;
    /// c[0] = 9;
    /// c.seal()?;
    /// assert_eq!(store.try_get(&id)?[0], 9);
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn seal(mut self) -> Result<()> {
        self.ours()?;
        self.done = true;
        // As this client: the seal is counted in its counters and bracketed for the sweep.
        self.inner.actor()?.table().seal(&self.id, self.slot)
    }

    /// Marks the object as never evicted (in a store created with
    /// [`WhenFull::Evict`](crate::WhenFull::Evict)); it stays until deleted. Call before
    /// sealing.
    ///
    /// ```
    /// use shmstore::{ObjectId, Store, StoreConfig, WhenFull};
    /// let cfg = StoreConfig { when_full: WhenFull::Evict, ..StoreConfig::with_capacity(1 << 20) };
    /// let store = Store::create_anonymous(&cfg)?;
    /// let mut c = store.create_object(&ObjectId::of_key("model-weights"), 100)?;
    /// c.set_evictable(false)?;
    /// c.seal()?;
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn set_evictable(&mut self, evictable: bool) -> Result<()> {
        self.ours()?;
        if evictable {
            return Ok(()); // objects are evictable unless marked otherwise
        }
        self.inner.lookup_table().set_no_evict(self.slot)
    }

    /// Abandons the object and frees its memory (the same as dropping the handle). In a
    /// forked child it does nothing: the object is the parent's.
    ///
    /// ```
    /// # let store = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(1 << 20))?;
    /// let id = shmstore::ObjectId::of_key("a");
    /// store.create_object(&id, 1)?.abort();
    /// assert!(store.create_object(&id, 1).is_ok());
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn abort(mut self) {
        self.do_abort();
    }

    fn do_abort(&mut self) {
        if self.done || self.ours().is_err() {
            return;
        }
        self.done = true;
        if let Ok(actor) = self.inner.actor() {
            let _ = actor.table().abort(&self.id, self.slot);
        }
    }

    /// Panics with [`Error::Forked`]'s message in a forked child.
    fn assert_writable_here(&self) {
        if let Err(e) = self.ours() {
            panic!("{e}");
        }
    }
}

impl Drop for Creation {
    fn drop(&mut self) {
        self.do_abort();
        if self.large {
            self.inner.large_writes.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Deref for Creation {
    type Target = [u8];
    /// # Panics
    /// In a process forked after the creation started (see [`Creation`]).
    fn deref(&self) -> &[u8] {
        self.assert_writable_here();
        // SAFETY: `data..data+len` lies in our block (checked by `resolve`), which stays
        // allocated while this handle lives and is written only through it.
        unsafe { std::slice::from_raw_parts(self.data, self.len) }
    }
}

impl DerefMut for Creation {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.assert_writable_here();
        // SAFETY: as in `deref`; `&mut self` makes this the only live reference.
        unsafe { std::slice::from_raw_parts_mut(self.data, self.len) }
    }
}

impl fmt::Debug for Creation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Creation")
            .field("id", &self.id)
            .field("len", &self.len)
            .finish()
    }
}
