//! A table over sections on the heap, for unit tests, miri and loom: [`HeapTable`] owns
//! what a [`Table`] borrows and records the blocks it frees.

use super::*;

/// Pin counters per slot in heap tables (clients 0..32).
pub(crate) const HEAP_STRIDE: usize = 32;

/// Owns the sections a [`Table`] borrows, and records the blocks it frees.
pub(crate) struct HeapTable {
    pub slots: Vec<Slot>,
    pub buckets: Vec<AtomicU64>,
    pub waits: Vec<WaitBucket>,
    pub pins: Vec<AtomicU16>,
    freed: std::sync::Mutex<Vec<(SlotRef, Entry)>>,
    /// Written by every free, as the allocator's next owner of the block would: a
    /// reader that reads it while pinned races with that write unless the pin really
    /// kept the block (loom reports the race).
    pub poison: crate::sync::UnsafeCell<u64>,
}

// SAFETY: everything but `poison` is atomics. `poison` is written only by `reclaim`,
// which the table calls once per freed slot, and read only by holders of a pin; the
// protocol under test orders the two (loom checks exactly that).
unsafe impl Sync for HeapTable {}

impl Reclaimer for HeapTable {
    fn reclaim(&self, table: &Table<'_>, r: SlotRef, e: Entry) {
        // SAFETY: loom checks this write against readers holding pins.
        self.poison.with_mut(|p| unsafe { *p += 1 });
        self.freed.lock().unwrap().push((r, e));
        table.release(r);
    }
}

impl HeapTable {
    /// An empty table of `n` slots (a power of two >= 32).
    pub(crate) fn new(n: usize) -> Self {
        HeapTable {
            slots: (0..n).map(|_| Slot::default()).collect(),
            buckets: (0..n).map(|_| AtomicU64::new(0)).collect(),
            waits: (0..WAIT_BUCKETS).map(|_| WaitBucket::default()).collect(),
            pins: (0..n * HEAP_STRIDE).map(|_| AtomicU16::new(0)).collect(),
            freed: Default::default(),
            poison: crate::sync::UnsafeCell::new(0),
        }
    }

    /// Borrows it as a [`Table`] for client 0.
    pub(crate) fn get(&self) -> Table<'_> {
        self.as_client(0)
    }

    /// Borrows it as a [`Table`] for client `me` (< 32).
    pub(crate) fn as_client(&self, me: u16) -> Table<'_> {
        let sections = Sections {
            slots: &self.slots,
            buckets: &self.buckets,
            waits: &self.waits,
            pins: &self.pins,
            stride: HEAP_STRIDE,
        };
        Table::new(sections, me, self)
    }

    /// Writes slot `i`'s control word as a process stopped mid-step would leave it.
    pub(crate) fn set_ctl(&self, i: usize, c: Ctl) {
        self.slots[i].ctl.store(c.0, Ordering::SeqCst);
    }

    /// The blocks freed so far (each slot was released to FREE after its push).
    pub(crate) fn freed(&self) -> Vec<(SlotRef, Entry)> {
        self.freed.lock().unwrap().clone()
    }

    /// Writes the poison cell as the next owner of a freed slot (or block) would.
    #[cfg(loom)]
    pub(crate) fn touch_as_new_owner(&self) {
        // SAFETY: loom checks this write against the previous owner's free.
        self.poison.with_mut(|p| unsafe { *p += 1 });
    }

    /// Reads the poison cell: call only while holding a pin; it must still be 0.
    pub(crate) fn read_while_pinned(&self) -> u64 {
        // SAFETY: loom checks this read against frees.
        self.poison.with(|p| unsafe { *p })
    }
}
