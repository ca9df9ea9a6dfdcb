//! Eviction in the object table: the CLOCK hand's step, the eviction of one generation
//! (a neighbour taken to widen a hole, [`crate::capacity`]), and `delete_unpinned`, the
//! same step for one id. Also the never-evict flag and the racy look that plans evictions.
//!
//! # Invariant: nothing is evicted while pinned
//! Every path here goes through [`Table::retire_unpinned`]: SEALED -> EVICTING (one CAS on
//! `ctl`), a SeqCst fence, a read of every pin counter of the slot's row, then
//! EVICTING -> DELETED only if all were zero, or back to SEALED. A pinner raises its
//! counter before it re-reads `ctl`, and cancels an EVICTING step it meets (CAS back to
//! SEALED), so either the hand sees its counter or the pinner sees the object gone (the
//! Dekker handshake of the module above). An EVICTING step left by a hand that died is
//! cancelled by the next pinner, hand or `delete_unpinned` that meets it. Pinned slots are
//! skipped, never waited for. Loom: `loom_eviction_races_pin`,
//! `loom_neighbour_eviction_races_pin`, `loom_delete_unpinned_races_pin`.

use super::{corrupted, CREATING, EVICTING, INFO_NO_EVICT, INFO_REFERENCED, SEALED};
use super::{dekker_fence, sc, sc_load, Ctl, Entry, SlotRef, Table};
use crate::error::Result;
use crate::sync::Ordering;
use crate::ObjectId;

/// What [`Table::retire_unpinned`] did.
enum Unpinned {
    /// Deleted; the entry it had.
    Retired(Entry),
    /// A pin counter was raised: the object stays.
    Pinned,
    /// The slot was no longer SEALED at the generation read, or the step was cancelled
    /// before it retired the slot: nothing done.
    Changed,
}

impl Table<'_> {
    /// Marks an object its creator still holds (CREATING) as never evictable.
    pub(crate) fn set_no_evict(&self, r: SlotRef) -> Result<()> {
        let i = self.index_checked(r)?;
        let s = &self.slots[i];
        let c = Ctl(s.ctl.load(Ordering::Relaxed));
        if c.state() != CREATING || c.gen() != r.gen {
            return Err(corrupted(format!(
                "set_no_evict on slot {} in {c:?}",
                r.index
            )));
        }
        s.info.fetch_or(INFO_NO_EVICT, Ordering::Relaxed);
        Ok(())
    }

    /// One step of the CLOCK hand at slot `i`: a sealed, unpinned, evictable object that
    /// was not used since the last pass is deleted (as by [`delete`](Self::delete)); a used
    /// one loses its referenced bit instead. Pinned objects are skipped, never waited for.
    /// Returns whether it evicted.
    ///
    /// The hand first moves the slot SEALED -> EVICTING, then reads the pin counters: if
    /// any is raised it moves the slot back; a pinner that meets EVICTING cancels it
    /// itself. Only `EVICTING -> DELETED` evicts, so an object is never evicted while a
    /// pin the hand could not see is taken.
    #[cfg(any(test, loom))]
    pub(crate) fn clock_step(&self, i: usize) -> Result<bool> {
        Ok(self.evict_step(i, None)?.is_some())
    }

    /// The eviction step itself. With `only` = `Some(gen)` it evicts the object of that
    /// generation only, whatever its referenced bit says (a neighbour evicted to widen a
    /// hole, see [`crate::capacity`]); with `None` it is one CLOCK step. Returns the entry
    /// of the object it evicted: read after the slot was seen SEALED and confirmed by the
    /// CAS on the same generation, so it is that object's.
    pub(crate) fn evict_step(&self, i: usize, only: Option<u32>) -> Result<Option<Entry>> {
        let Some(s) = self.slots.get(i) else {
            return Ok(None);
        };
        let c = Ctl(s.ctl.load(Ordering::Acquire));
        if only.is_some_and(|gen| gen != c.gen()) {
            return Ok(None);
        }
        if c.state() == EVICTING {
            // A hand that died mid-step (or a slow one): cancel, the object stays.
            let _ = s.ctl.compare_exchange(
                c.0,
                Ctl::new(SEALED, None, c.gen()).0,
                sc(),
                Ordering::Relaxed,
            );
            return Ok(None);
        }
        if c.state() != SEALED {
            return Ok(None);
        }
        let info = s.info.load(Ordering::Relaxed);
        if info & INFO_NO_EVICT != 0 {
            return Ok(None);
        }
        if only.is_none() && info & INFO_REFERENCED != 0 {
            s.info.fetch_and(!INFO_REFERENCED, Ordering::Relaxed);
            return Ok(None);
        }
        Ok(match self.retire_unpinned(i, c) {
            Unpinned::Retired(entry) => Some(entry),
            Unpinned::Pinned | Unpinned::Changed => None,
        })
    }

    /// Deletes a sealed object unless some client pins it, as one step: the eviction
    /// protocol of [`evict_step`](Self::evict_step) (SEALED -> EVICTING, read every pin
    /// counter, -> DELETED), without its policy (referenced bit, never-evict flag). A get
    /// that pins the object either comes first, and the object stays, or finds it gone;
    /// a plain [`delete`](Self::delete) takes it from under a pin (whose holder keeps its
    /// bytes, but no longer finds it by id). Returns the entry of the object deleted, or
    /// `None` if a pin kept it.
    pub(crate) fn delete_unpinned(&self, id: &ObjectId) -> Result<Option<Entry>> {
        loop {
            let (i, c) = self.find_sealed(id)?;
            match c.state() {
                EVICTING => {
                    // Another hand's step (or a dead one's): cancel it, as a pinner
                    // does, and look again; that hand's own step then fails.
                    let _ = self.slots[i].ctl.compare_exchange(
                        c.0,
                        Ctl::new(SEALED, None, c.gen()).0,
                        sc(),
                        Ordering::Relaxed,
                    );
                }
                _ => match self.retire_unpinned(i, c) {
                    Unpinned::Retired(entry) => return Ok(Some(entry)),
                    Unpinned::Pinned => return Ok(None),
                    Unpinned::Changed => {} // sealed again, deleted or reused: look again
                },
            }
        }
    }

    /// The core of eviction: moves slot `i` from `c` (SEALED) to EVICTING, reads every
    /// pin counter of its row, and retires it if none is raised (a pinner that meets
    /// EVICTING cancels the step: then the retire fails).
    fn retire_unpinned(&self, i: usize, c: Ctl) -> Unpinned {
        let s = &self.slots[i];
        let entry = self.entry(i);
        let evicting = Ctl::new(EVICTING, None, c.gen());
        if c.state() != SEALED
            || s.ctl
                .compare_exchange(c.0, evicting.0, sc(), Ordering::Relaxed)
                .is_err()
        {
            return Unpinned::Changed;
        }
        dekker_fence();
        let pinned = !crate::sync::mutation("evict_pinned")
            && self.row(i).iter().any(|k| k.load(sc_load()) != 0);
        if pinned {
            let _ = s
                .ctl
                .compare_exchange(evicting.0, c.0, sc(), Ordering::Relaxed);
            return Unpinned::Pinned;
        }
        if self.retire(i, c.gen(), &[EVICTING]).0 {
            Unpinned::Retired(entry)
        } else {
            // Cancelled meanwhile: by a pinner (the next look finds its counter) or by
            // another hand that took this step for a dead one's.
            Unpinned::Changed
        }
    }

    /// Whether slot `i` holds, at generation `gen`, a sealed object that eviction may
    /// take now (evictable, no pin raised): a racy look, to plan before evicting.
    pub(crate) fn evictable_now(&self, i: usize, gen: u32) -> bool {
        let Some(s) = self.slots.get(i) else {
            return false;
        };
        let c = Ctl(s.ctl.load(Ordering::Acquire));
        c.state() == SEALED
            && c.gen() == gen
            && s.info.load(Ordering::Relaxed) & INFO_NO_EVICT == 0
            && self.row(i).iter().all(|k| k.load(Ordering::Relaxed) == 0)
    }
}
