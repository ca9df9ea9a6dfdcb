//! [`View`]: an immutable, zero-copy, pinned reader handle.
//!
//! A view holds one pin on its object, in the pin column of the process that holds the
//! view. After `fork()` the child's copy of a view was pinned in the *parent's* column:
//! the parent may drop its copy at any time, so the child does not rely on that pin. On
//! its first use in the child (any deref, [`View::meta`], [`View::as_ptr`],
//! [`View::try_clone`], or an explicit [`View::adopt`]) the view takes a pin of the
//! child's own, if the object is still there; dropping an inherited view never touches the
//! parent's counters (docs/design.md, "Fork").

use super::attachment::Inner;
use crate::error::{Error, Result};
use crate::liveness;
use crate::sync::{AtomicU64, Ordering};
use crate::table::SlotRef;
use crate::ObjectId;
use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

/// An immutable, zero-copy view of a sealed object. Pins the object until dropped: its
/// bytes stay valid and unchanged even if the object is deleted meanwhile.
///
/// ```
/// use shmstore::{ObjectId, Store, StoreConfig};
/// let store = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20))?;
/// let id = ObjectId::of_key("v");
/// store.put(&id, b"hello")?;
/// let v = store.try_get(&id)?;
/// let v2 = v.try_clone()?; // another pin
/// std::thread::spawn(move || assert_eq!(&*v2, b"hello")).join().unwrap();
/// assert_eq!(v.len(), 5);
/// # Ok::<(), shmstore::Error>(())
/// ```
///
/// # Fork
/// A view is safe to use in a child made by `fork()`: there it pins the object again in
/// the child's own name on first use. If the object was deleted and freed between the
/// fork and that first use (the parent dropped its copy meanwhile), the bytes are gone:
/// deref panics, and [`adopt`](Self::adopt) returns [`Error::Forked`]. Call `adopt` right
/// after fork to find out without a panic.
pub struct View {
    pub(super) inner: Arc<Inner>,
    pub(super) id: ObjectId,
    pub(super) slot: SlotRef,
    pub(super) meta: *const u8,
    pub(super) meta_len: usize,
    pub(super) data: *const u8,
    pub(super) len: usize,
    /// The fork generation whose binding holds this view's pin.
    pub(super) pinned_in: AtomicU64,
}

// SAFETY: a view only reads immutable (sealed, pinned) bytes; unpinning is atomic.
unsafe impl Send for View {}
// SAFETY: as above.
unsafe impl Sync for View {}

impl View {
    /// A `pinned_in` for a pin taken now, by this process.
    pub(super) fn pinned_now() -> AtomicU64 {
        AtomicU64::new(liveness::generation())
    }

    /// The object's id.
    ///
    /// ```
    /// # let store = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(1 << 20))?;
    /// # let id = shmstore::ObjectId::of_key("a"); store.put(&id, b"")?;
    /// assert_eq!(store.try_get(&id)?.id(), id);
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn id(&self) -> ObjectId {
        self.id
    }

    /// The object's length in bytes.
    ///
    /// ```
    /// # let store = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(1 << 20))?;
    /// # let id = shmstore::ObjectId::of_key("a"); store.put(&id, b"abc")?;
    /// assert_eq!(store.try_get(&id)?.len(), 3);
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    #[allow(clippy::len_without_is_empty)] // `is_empty` comes with the slice
    pub fn len(&self) -> usize {
        self.len
    }

    /// The object's metadata blob (empty if none was given).
    ///
    /// ```
    /// # let store = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(1 << 20))?;
    /// # let id = shmstore::ObjectId::of_key("a"); store.put(&id, b"")?;
    /// assert!(store.try_get(&id)?.meta().is_empty());
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    ///
    /// # Panics
    /// In a forked child, if the object was freed since the fork (see [`View`]).
    pub fn meta(&self) -> &[u8] {
        self.pinned_here();
        // SAFETY: within the pinned block (checked by `resolve`); immutable after seal.
        unsafe { std::slice::from_raw_parts(self.meta, self.meta_len) }
    }

    /// Whether the store still answers this view's id with this very object: false once
    /// the object was deleted (the view keeps its bytes readable, not its key) or its id
    /// was stored again since, as a new object. Costs a lookup, takes no pin.
    ///
    /// ```
    /// # let store = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(1 << 20))?;
    /// # let id = shmstore::ObjectId::of_key("a");
    /// store.put(&id, b"old")?;
    /// let v = store.try_get(&id)?;
    /// assert!(v.is_current());
    /// store.delete(&id)?;
    /// store.put(&id, b"new")?;
    /// assert!(!v.is_current());
    /// assert!(store.try_get(&id)?.is_current());
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn is_current(&self) -> bool {
        self.inner.lookup_table().names(&self.id, self.slot)
    }

    /// Another view of the same object, with its own pin.
    ///
    /// ```
    /// # let store = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(1 << 20))?;
    /// # let id = shmstore::ObjectId::of_key("a"); store.put(&id, b"abc")?;
    /// let v = store.try_get(&id)?;
    /// let w = v.try_clone()?;
    /// drop(v);
    /// assert_eq!(&*w, b"abc");
    /// assert_eq!(store.stats().pins, 1);
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn try_clone(&self) -> Result<View> {
        self.adopt()?;
        let inner = &self.inner;
        inner.actor()?.table().add_pin(self.slot)?;
        Ok(View {
            inner: Arc::clone(inner),
            pinned_in: View::pinned_now(),
            ..*self
        })
    }

    /// The view's pointer into shared memory (stable for the view's lifetime).
    ///
    /// ```
    /// # let store = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(1 << 20))?;
    /// # let id = shmstore::ObjectId::of_key("a"); store.put(&id, b"abc")?;
    /// let v = store.try_get(&id)?;
    /// assert_eq!(v.as_ptr(), store.try_get(&id)?.as_ptr()); // zero-copy: same memory
    /// assert_eq!(v.as_ptr() as usize % 64, 0);
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    ///
    /// # Panics
    /// In a forked child, if the object was freed since the fork (see [`View`]).
    pub fn as_ptr(&self) -> *const u8 {
        self.pinned_here();
        self.data
    }

    /// Makes sure this process holds its own pin on the object. A no-op in the process
    /// that took the view; in a child made by `fork()` after it, pins the object in the
    /// child's name (deref does this by itself on first use). Fails with
    /// [`Error::Forked`] if the object was freed between the fork and now.
    ///
    /// ```
    /// # let store = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(1 << 20))?;
    /// # let id = shmstore::ObjectId::of_key("a"); store.put(&id, b"abc")?;
    /// let v = store.try_get(&id)?;
    /// v.adopt()?; // nothing to do: not forked
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn adopt(&self) -> Result<()> {
        let seen = self.pinned_in.load(Ordering::Acquire);
        let now = liveness::generation();
        if seen == now {
            return Ok(());
        }
        let actor = self.inner.actor()?;
        let table = actor.table();
        if !table.repin(self.slot)? {
            return Err(Error::Forked {
                what: "View",
                detail: format!(
                    "object {} was deleted and freed between fork() and this view's first use \
                     in the child; take views after fork(), or keep the parent's view alive \
                     until the child has used it",
                    self.id
                ),
            });
        }
        if self
            .pinned_in
            .compare_exchange(seen, now, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            // Another thread of this process adopted it first: one pin is enough.
            let _ = table.unpin(self.slot);
        }
        Ok(())
    }

    /// Panics unless this process holds a pin (adopting after fork).
    #[inline]
    fn pinned_here(&self) {
        if self.pinned_in.load(Ordering::Relaxed) != liveness::generation() {
            if let Err(e) = self.adopt() {
                panic!("{e}");
            }
        }
    }
}

impl Deref for View {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.pinned_here();
        // SAFETY: `data..data+len` lies in the block (checked by `resolve`), which stays
        // allocated and unchanged while our pin is held (`pinned_here`). See
        // docs/security.md for what a process that ignores the protocol can do to it.
        unsafe { std::slice::from_raw_parts(self.data, self.len) }
    }
}

impl AsRef<[u8]> for View {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl Drop for View {
    fn drop(&mut self) {
        if self.pinned_in.load(Ordering::Relaxed) != liveness::generation() {
            return; // inherited and never used here: the pin is the parent's
        }
        let inner = &self.inner;
        if let Ok(actor) = inner.actor() {
            let _ = actor.table().unpin(self.slot);
        }
        if inner.evicts() {
            // An unpinned object may now be evicted: nudge creators waiting for space.
            inner.globals.space.nudge();
        }
    }
}

impl fmt::Debug for View {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("View")
            .field("id", &self.id)
            .field("len", &self.len)
            .finish()
    }
}
