//! The lock-free object table: id -> slot, with per-slot state and generation, and the
//! per-client pin counters that keep a slot's block alive.
//!
//! Open addressing with hopscotch-style neighbourhoods. An id's *home* is `mix(id) & mask`;
//! its entry lives in one of the [`NEIGHBORHOOD`] slots of the home's neighbourhood: two
//! aligned bins of 16 slots, the home's own and a second chosen by a hash of the home
//! (two choices: the table fills ~85% of its slots before a neighbourhood runs out, where
//! one window after the home gave out at ~45%). Entries never move once placed (pins name
//! slots). Each home has a bucket word `version << 32 | bitmap`, whose bit `d` says "slot
//! `d` of this home's neighbourhood holds an entry whose home is this bucket". That word
//! is the linearisation point of inserts and unlinks: an insert
//! publishes with one CAS that also proves no live entry with the same id was published
//! since it last looked, so two racing creates of one id can never both succeed.
//!
//! Each slot is one cache line: `ctl = gen << 32 | owner << 3 | state`, the id, and the
//! block it owns. Slot life cycle (docs/design.md, "Object state machine"):
//!
//! ```text
//! FREE(g) --claim--> RESERVED(g, owner) --fields written--> CREATING(g) --bucket CAS-->
//!   CREATING --seal--> SEALED(g) <--cancel-- EVICTING(g) (CLOCK hand, no pins seen)
//!   CREATING --abort--> DELETED(g)      SEALED/EVICTING --delete/evict--> DELETED(g)
//!   DELETED --no pin counter left, one CAS--> FREEING(g, owner) --block freed--> FREE(g+1)
//!   DELETED --a child adopts a view, or a draining get (counter up, one CAS)--> DELETED (tag + 1)
//!   (an abort's DELETED carries a never-sealed flag: draining gets skip it)
//! ```
//!
//! # Pins are per-client counters, hazard-pointer style
//! A pin is not a count in `ctl`: each slot has one 16-bit counter per client (a row of
//! `stride` counters), and a process only ever changes its own. To pin, a reader raises its
//! counter and then re-reads `ctl`: if the slot is still SEALED at the generation it looked
//! up, the pin holds. To free, whoever sees a DELETED slot reads every counter of its row
//! and, only if all are zero, wins `DELETED -> FREEING` with one CAS. The raise/re-read and
//! the DELETED/scan pairs are SeqCst operations separated by SeqCst fences (a Dekker
//! handshake), so either the freer sees the reader's counter or the reader sees DELETED.
//! The block is freed exactly once, by the FREEING owner, never while a counter is raised.
//!
//! Why counters and not one shared count: a process killed between "count +1" and
//! "record that I hold it" leaves a shared count that nobody can correct. A counter is a
//! fact about one client alone, so recovery simply zeroes a dead client's counters and
//! retries the free (see [`crate::recovery`]). Slots a client was in the middle of changing
//! carry its index (`owner` in RESERVED and FREEING, `creator` in CREATING entries).
//!
//! Readers use a seqlock-style check: read `ctl`, read the id, then re-read `ctl`; a slot
//! reused in between has a new generation and is skipped.
//!
//! Blocked getters sleep on one of [`WAIT_BUCKETS`] futex words chosen by id hash; seals
//! bump it and wake only when its waiter count is non-zero (no syscall otherwise): see
//! [`wait`].

mod evict;
mod slot;
mod wait;

pub(crate) use slot::{
    Ctl, Entry, Slot, CREATING, DELETED, EVICTING, FREE, FREEING, INFO_NO_EVICT, INFO_REFERENCED,
    RESERVED, SEALED,
};
pub(crate) use wait::WaitBucket;

use crate::error::{Error, Result};
use crate::layout::{NEIGHBORHOOD, WAIT_BUCKETS};

/// Slots per bin: a neighbourhood is two bins.
const BIN: u64 = NEIGHBORHOOD / 2;

/// An insert stays in its home's first bin while that has at least this many free slots,
/// and otherwise takes the emptier bin. Simulated: the same ~85% fill at the first full
/// neighbourhood as always comparing both bins, reading 8 slots instead of 32 while the
/// table is emptier (docs/design.md, "Table sizing").
const ROOM_TO_SPARE: u32 = 8;
use crate::sync::{fence, AtomicU16, AtomicU64, Ordering};
use crate::ObjectId;

/// Most pins one process may hold on one object (its counter is 16 bits; the margin
/// leaves room for threads that raise it at the same instant).
pub(crate) const PIN_LIMIT: u16 = 60_000;

/// SeqCst, except under the `pin_acqrel` mutation (a deliberate bug for
/// docs/verification.md: the pin/free handshake with acquire/release only).
#[inline(always)]
fn sc() -> Ordering {
    crate::sync::weakened_by("pin_acqrel", Ordering::SeqCst, Ordering::AcqRel)
}
#[inline(always)]
fn sc_load() -> Ordering {
    crate::sync::weakened_by("pin_acqrel", Ordering::SeqCst, Ordering::Acquire)
}

/// The fence of the Dekker handshake between pinners and freers.
fn dekker_fence() {
    if !crate::sync::mutation("pin_acqrel") {
        fence(Ordering::SeqCst);
    }
}

/// The version half of bucket word `b` after one more change. It is what fails an insert's
/// CAS when the bitmap it checked went and came back: a delete, then an insert of the same
/// id into the freed slot, between the insert's check and its CAS. The bitmap alone reads
/// the same, and the id would be in the table twice (`loom_create_races_delete_and_recreate`;
/// mutation `bucket_no_version`).
#[inline(always)]
fn next_version(b: u64) -> u64 {
    let bump = u64::from(!crate::sync::mutation("bucket_no_version"));
    ((b >> 32).wrapping_add(bump)) << 32
}

/// A slot at a given generation: what handles hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SlotRef {
    pub index: u32,
    pub gen: u32,
}

/// Result of a pin attempt.
#[derive(Debug)]
pub(crate) enum Pin {
    /// Pinned a sealed object.
    Pinned(SlotRef, Entry),
    /// The id is being created by client `creator`; not sealed yet.
    Creating {
        /// Client index of the creator (from shared memory: validate before use).
        creator: u16,
    },
    /// No live entry for the id.
    Absent,
}

/// What a client just did to the table, for its counters (`crate::client::Counters`).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Event {
    /// An object was published CREATING with this entry.
    Inserted(Entry),
    /// An object was sealed.
    Sealed,
    /// A creation was aborted (CREATING -> DELETED).
    Aborted,
    /// A sealed object was deleted or evicted.
    Deleted,
    /// An object's block is being freed (this entry's).
    Freed(Entry),
    /// A pin was taken.
    Pinned,
    /// A pin was dropped.
    Unpinned,
    /// A get found its object sealed at once.
    GetHit,
    /// A get found its object after waiting for the seal.
    GetWaited,
    /// A get ended without its object.
    GetMissed,
}

/// What the table calls to give a block back: the store frees it in the allocator, then
/// returns the slot with [`Table::release`]. Also brackets every step that changes who
/// owns a block or what a count says, so the leak sweep can tell a quiet moment (see
/// [`crate::recovery`]), and counts what the client did.
pub(crate) trait Reclaimer {
    /// Frees the block of slot `r`, which this process has moved to FREEING, then
    /// releases the slot.
    fn reclaim(&self, table: &Table<'_>, r: SlotRef, e: Entry);
    /// An ownership-changing step starts.
    fn begin_op(&self) {}
    /// It ended.
    fn end_op(&self) {}
    /// Counts an event of this client.
    fn count(&self, _event: Event) {}
}

/// The table over its shared sections, as seen by client `me`.
pub(crate) struct Table<'a> {
    slots: &'a [Slot],
    buckets: &'a [AtomicU64],
    waits: &'a [WaitBucket],
    pins: &'a [AtomicU16],
    stride: usize,
    me: u16,
    reclaimer: &'a dyn Reclaimer,
    mask: u64,
}

fn corrupted(what: String) -> Error {
    Error::Corrupted { what }
}

/// Where a table lives and who is looking at it (see [`Table::new`]).
pub(crate) struct Sections<'a> {
    pub slots: &'a [Slot],
    pub buckets: &'a [AtomicU64],
    pub waits: &'a [WaitBucket],
    /// `slots.len() * stride` pin counters, slot-major.
    pub pins: &'a [AtomicU16],
    pub stride: usize,
}

impl<'a> Table<'a> {
    /// Wraps the sections for client `me` (< `stride`); `slots.len()` is a power of two
    /// >= NEIGHBORHOOD. The caller (the layout) guarantees the section lengths.
    pub(crate) fn new(s: Sections<'a>, me: u16, reclaimer: &'a dyn Reclaimer) -> Self {
        debug_assert!(s.slots.len().is_power_of_two() && s.slots.len() as u64 >= NEIGHBORHOOD);
        debug_assert_eq!(s.slots.len(), s.buckets.len());
        debug_assert_eq!(s.waits.len() as u64, WAIT_BUCKETS);
        debug_assert_eq!(s.pins.len(), s.slots.len() * s.stride);
        debug_assert!((me as usize) < s.stride);
        Table {
            slots: s.slots,
            buckets: s.buckets,
            waits: s.waits,
            pins: s.pins,
            stride: s.stride,
            me,
            reclaimer,
            mask: s.slots.len() as u64 - 1,
        }
    }

    /// Number of slots.
    pub(crate) fn capacity(&self) -> u64 {
        self.slots.len() as u64
    }

    fn home(&self, id: &ObjectId) -> u64 {
        id.mix() & self.mask
    }

    /// The two bins of `home`'s neighbourhood: its own (`home / BIN`) and a second one
    /// chosen by a hash of the home, never the same. Two choices per home let the table
    /// fill ~85% of its slots before a neighbourhood runs out (one window of 32 slots
    /// after the home gave out at ~45%: runs of full slots grow together).
    fn bins(&self, home: u64) -> (u64, u64) {
        let nbins = (self.mask + 1) / BIN; // a power of two, >= 2
        let first = home / BIN;
        let shift = 64 - nbins.trailing_zeros();
        let mut other = home.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> shift;
        if other == 0 {
            other = 1;
        }
        (first, first ^ other)
    }

    /// Slot `d` (`< NEIGHBORHOOD`) of `home`'s neighbourhood: bits 0..16 of a bucket
    /// name the slots of its first bin, bits 16..32 those of its second.
    fn slot(&self, home: u64, d: u64) -> (usize, &Slot) {
        let (first, second) = self.bins(home);
        let bin = if d < BIN { first } else { second };
        let i = (bin * BIN + d % BIN) as usize;
        (i, &self.slots[i])
    }

    /// Which `d` of `home`'s neighbourhood slot `i` is, if it is in it.
    fn distance(&self, home: u64, i: usize) -> Option<u64> {
        let (first, second) = self.bins(home);
        let (bin, at) = (i as u64 / BIN, i as u64 % BIN);
        if bin == first {
            Some(at)
        } else if bin == second {
            Some(BIN + at)
        } else {
            None
        }
    }

    /// Free slots among `home`'s first bin, counting no further than `enough`.
    fn free_in_first_bin(&self, home: u64, enough: u32) -> u32 {
        let mut free = 0;
        for d in 0..BIN {
            if Ctl(self.slot(home, d).1.ctl.load(Ordering::Relaxed)).state() == FREE {
                free += 1;
                if free >= enough {
                    break;
                }
            }
        }
        free
    }

    /// Free slots in `home`'s second bin.
    fn free_in_second_bin(&self, home: u64) -> u32 {
        (BIN..NEIGHBORHOOD)
            .filter(|&d| Ctl(self.slot(home, d).1.ctl.load(Ordering::Relaxed)).state() == FREE)
            .count() as u32
    }

    /// Slot `i`'s row of pin counters.
    fn row(&self, i: usize) -> &[AtomicU16] {
        &self.pins[i * self.stride..(i + 1) * self.stride]
    }

    /// Client `c`'s pin counter on slot `i` (`c < stride`, `i < slots`).
    fn counter(&self, i: usize, c: u16) -> &AtomicU16 {
        &self.pins[i * self.stride + c as usize]
    }

    /// Finds a live (CREATING, SEALED or EVICTING) entry for `words` among the bits of
    /// bucket word `b`.
    fn find_in(&self, home: u64, b: u64, words: &[u64; 4]) -> Option<(usize, Ctl)> {
        let mut bits = b as u32;
        while bits != 0 {
            let d = bits.trailing_zeros() as u64;
            bits &= bits - 1;
            let (i, s) = self.slot(home, d);
            let c1 = Ctl(s.ctl.load(Ordering::Acquire));
            if !c1.live() {
                continue;
            }
            let w = self.id_words(i);
            fence(Ordering::Acquire);
            let c2 = Ctl(s.ctl.load(Ordering::Relaxed));
            if c2.gen() == c1.gen() && c2.live() && &w == words {
                return Some((i, c2));
            }
        }
        None
    }

    fn id_words(&self, i: usize) -> [u64; 4] {
        let s = &self.slots[i];
        let mut w = [0u64; 4];
        for (k, x) in w.iter_mut().enumerate() {
            *x = s.id[k].load(Ordering::Relaxed);
        }
        w
    }

    fn entry(&self, i: usize) -> Entry {
        let s = &self.slots[i];
        Entry::from_parts(
            s.offset.load(Ordering::Relaxed),
            s.len.load(Ordering::Relaxed),
            s.info.load(Ordering::Relaxed),
        )
    }

    /// Slot `i`'s control word (for tests).
    #[cfg(test)]
    pub(crate) fn ctl(&self, i: usize) -> Ctl {
        Ctl(self.slots[i].ctl.load(Ordering::Acquire))
    }

    /// Inserts `id` in state CREATING. The caller owns the returned slot until it seals or
    /// aborts it.
    pub(crate) fn insert(&self, id: &ObjectId, e: &Entry) -> Result<SlotRef> {
        let words = id.words();
        let home = self.home(id);
        // Claim a free slot in the neighbourhood (not yet visible to lookups). RESERVED
        // carries our client index, so recovery can return the slot if we die here.
        // Two choices: the first bin while it has room to spare, else the emptier bin
        // (the counts are a snapshot; the claim below is what decides).
        // Under loom the counts are skipped: they only choose which bin is tried first
        // (every claim below is checked the same way either way), and each read would
        // multiply the interleavings loom explores without adding a case.
        let second_first = !cfg!(loom) && {
            let first_free = self.free_in_first_bin(home, ROOM_TO_SPARE);
            first_free < ROOM_TO_SPARE && self.free_in_second_bin(home) > first_free
        };
        let order = (0..NEIGHBORHOOD).map(|d| if second_first { d ^ BIN } else { d });
        let mut mine = None;
        for d in order {
            let (i, s) = self.slot(home, d);
            let c = Ctl(s.ctl.load(Ordering::Relaxed));
            if c.state() == FREE
                && s.ctl
                    .compare_exchange(
                        c.0,
                        Ctl::new(RESERVED, Some(self.me), c.gen()).0,
                        Ordering::Acquire,
                        Ordering::Relaxed,
                    )
                    .is_ok()
            {
                mine = Some((d, i, c.gen()));
                break;
            }
        }
        let Some((d, i, gen)) = mine else {
            return Err(Error::TableFull {
                objects: self.count_live(),
                slots: self.capacity(),
            });
        };
        let s = &self.slots[i];
        // Seqlock writer: the ctl change (RESERVED) is ordered before the new id words.
        fence(Ordering::Release);
        for (k, w) in words.iter().enumerate() {
            s.id[k].store(*w, Ordering::Relaxed);
        }
        s.offset.store(e.offset, Ordering::Relaxed);
        s.len.store(e.len, Ordering::Relaxed);
        s.info.store(e.info() | INFO_REFERENCED, Ordering::Relaxed);
        s.ctl
            .store(Ctl::new(CREATING, None, gen).0, Ordering::Release);
        let bucket = &self.buckets[home as usize];
        let mut b = bucket.load(Ordering::Acquire);
        loop {
            if self.find_in(home, b, &words).is_some() {
                s.ctl.store(
                    Ctl::new(FREE, None, gen.wrapping_add(1)).0,
                    Ordering::Release,
                );
                return Err(Error::AlreadyExists { id: *id });
            }
            let nb = next_version(b) | (b as u32 as u64) | (1 << d);
            match bucket.compare_exchange(b, nb, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    self.reclaimer.count(Event::Inserted(*e));
                    return Ok(SlotRef {
                        index: i as u32,
                        gen,
                    });
                }
                Err(now) => b = now,
            }
        }
    }

    /// Raises our counter on slot `i` (the reader's half of the Dekker handshake: the
    /// fence orders it before the caller's re-read of `ctl`). At the pin limit the
    /// counter is lowered again and the error returned.
    fn raise(&self, i: usize) -> Result<()> {
        if self.counter(i, self.me).fetch_add(1, sc()) >= PIN_LIMIT {
            self.drop_hold(i);
            return Err(Error::TooManyPins {
                limit: PIN_LIMIT as u32,
            });
        }
        dekker_fence();
        Ok(())
    }

    /// Raises our counter on slot `i` and checks that it is still readable at `gen`.
    /// On `false` the counter is back down (and any free that it delayed is done).
    fn try_hold(&self, i: usize, gen: u32) -> Result<bool> {
        self.raise(i)?;
        let s = &self.slots[i];
        let mut c = Ctl(s.ctl.load(sc_load()));
        loop {
            if c.gen() != gen || !c.sealed() {
                self.drop_hold(i);
                return Ok(false);
            }
            if c.state() == SEALED {
                return Ok(true);
            }
            // EVICTING: our counter is up, so cancel the eviction (the hand re-checks).
            match s
                .ctl
                .compare_exchange(c.0, Ctl::new(SEALED, None, gen).0, sc(), sc_load())
            {
                Ok(_) => return Ok(true),
                Err(now) => c = Ctl(now),
            }
        }
    }

    /// Lowers our counter on slot `i`; the last one down frees a DELETED slot (and
    /// returns its entry).
    fn drop_hold(&self, i: usize) -> Option<Entry> {
        let k = self.counter(i, self.me);
        if k.fetch_sub(1, sc()) == 1 {
            dekker_fence();
            return self.try_free(i);
        }
        None
    }

    /// Looks `id` up and, if sealed, pins it.
    pub(crate) fn pin(&self, id: &ObjectId) -> Result<Pin> {
        let words = id.words();
        let home = self.home(id);
        let bucket = &self.buckets[home as usize];
        loop {
            let b = bucket.load(Ordering::Acquire);
            let Some((i, c)) = self.find_in(home, b, &words) else {
                return Ok(Pin::Absent);
            };
            let r = SlotRef {
                index: i as u32,
                gen: c.gen(),
            };
            if c.state() == CREATING {
                let creator = self.entry(i).creator;
                if self.slots[i].ctl.load(Ordering::Acquire) != c.0 {
                    continue;
                }
                return Ok(Pin::Creating { creator });
            }
            if self.try_hold(i, c.gen())? {
                self.reclaimer.count(Event::Pinned);
                // A get refreshes recency (CLOCK); skip the write when already set.
                let info = &self.slots[i].info;
                if info.load(Ordering::Relaxed) & INFO_REFERENCED == 0 {
                    info.fetch_or(INFO_REFERENCED, Ordering::Relaxed);
                }
                return Ok(Pin::Pinned(r, self.entry(i)));
            }
            crate::sync::spin_hint();
        }
    }

    /// Adds one more pin to a slot the caller already pins (a cloned view).
    pub(crate) fn add_pin(&self, r: SlotRef) -> Result<()> {
        let i = self.index_checked(r)?;
        let k = self.counter(i, self.me);
        let old = k.fetch_add(1, sc());
        if old == 0 || old >= PIN_LIMIT {
            self.drop_hold(i);
            if old == 0 {
                return Err(corrupted(format!("add_pin on slot {i} without a pin")));
            }
            return Err(Error::TooManyPins {
                limit: PIN_LIMIT as u32,
            });
        }
        self.reclaimer.count(Event::Pinned);
        Ok(())
    }

    /// Pins slot `r` in our column if its block is still there at its generation: a view
    /// taken over by a forked child, whose parent's pin has kept the block since the view
    /// was taken, or a draining object found by id ([`pin_draining`](Self::pin_draining)).
    /// Unlike a fresh pin this also holds a DELETED (draining) slot.
    ///
    /// On a DELETED slot, raising our counter is not enough by itself: a freer (the
    /// parent dropping its view at this moment) may have read the row before our counter
    /// went up and not yet made its `DELETED -> FREEING` CAS, and re-reading DELETED
    /// cannot tell. So the pin is confirmed by a CAS of our own that changes the word
    /// (the DELETED tag, [`Ctl::retagged`]): the freer's CAS expects the word it read, so
    /// of the two CASes exactly one wins. Ours first: the freer fails, and every later
    /// freer reads the new word and then the row, with our counter up. The freer's
    /// first: we see FREEING and let go. (loom: `loom_adopt_races_last_unpin_of_deleted_object`;
    /// re-reading alone freed the block under the child's pin.) `Ok(false)`: the block
    /// was freed, or is being freed.
    pub(crate) fn repin(&self, r: SlotRef) -> Result<bool> {
        let i = self.index_checked(r)?;
        let s = &self.slots[i];
        self.raise(i)?;
        let mut c = Ctl(s.ctl.load(sc_load()));
        while c.gen() == r.gen && c.state() == DELETED {
            let confirm = if crate::sync::mutation("adopt_by_reread") {
                Ok(c.0)
            } else {
                s.ctl.compare_exchange(c.0, c.retagged().0, sc(), sc_load())
            };
            match confirm {
                Ok(_) => {
                    self.reclaimer.count(Event::Pinned);
                    return Ok(true);
                }
                // Another adoption retagged it (try again), or a freer won: below.
                Err(now) => c = Ctl(now),
            }
        }
        // Readable: as a fresh pin (our counter is up once more; drop the extra one).
        self.drop_hold(i);
        let held = self.try_hold(i, r.gen)?;
        if held {
            self.reclaimer.count(Event::Pinned);
        }
        Ok(held)
    }

    /// Pins an object `id` that was deleted while a process pins it (DELETED, draining,
    /// sealed before), and returns where it is; `None` if there is none. A deleted entry is unlinked from
    /// its bucket word but stays in its slot, in its home's neighbourhood, until freed:
    /// this scans the neighbourhood's slots (as `find_in` reads one, seqlock-style) and
    /// adopts the first DELETED one with the id ([`repin`](Self::repin): a CAS on its
    /// `ctl` confirms the pin against a racing free). The path of
    /// [`crate::Store::get_draining`].
    pub(crate) fn pin_draining(&self, id: &ObjectId) -> Result<Option<(SlotRef, Entry)>> {
        let home = self.home(id);
        let words = id.words();
        for d in 0..NEIGHBORHOOD {
            let (i, s) = self.slot(home, d);
            let c1 = Ctl(s.ctl.load(Ordering::Acquire));
            // An aborted creation is DELETED too (and held for a moment by its aborter's
            // counter), but it never held an object.
            let aborted = c1.never_sealed() && !crate::sync::mutation("draining_takes_aborted");
            if c1.state() != DELETED || aborted {
                continue;
            }
            let w = self.id_words(i);
            fence(Ordering::Acquire);
            let c2 = Ctl(s.ctl.load(Ordering::Relaxed));
            if c2.gen() != c1.gen() || c2.state() != DELETED || w != words {
                continue;
            }
            let r = SlotRef {
                index: i as u32,
                gen: c1.gen(),
            };
            if !self.repin(r)? {
                continue; // freed meanwhile
            }
            // Pinned at `r.gen`: the id and the entry stay as they were written before
            // the seal until the slot is freed, which our pin prevents.
            if self.id_words(i) != words {
                self.unpin(r)?;
                continue;
            }
            return Ok(Some((r, self.entry(i))));
        }
        Ok(None)
    }

    /// The live slot of `id` and its control word, if any.
    fn find(&self, id: &ObjectId) -> Option<(usize, Ctl)> {
        let home = self.home(id);
        let b = self.buckets[home as usize].load(Ordering::Acquire);
        self.find_in(home, b, &id.words())
    }

    /// Is `id` present, sealed or being created?
    pub(crate) fn contains_live(&self, id: &ObjectId) -> bool {
        self.find(id).is_some()
    }

    /// Is `id` present and sealed?
    pub(crate) fn contains_sealed(&self, id: &ObjectId) -> bool {
        matches!(self.find(id), Some((_, c)) if c.sealed())
    }

    /// Does `id` name the sealed object at `r` now? False once that object was deleted
    /// (a pin keeps its slot, not its key) or the key names another object.
    pub(crate) fn names(&self, id: &ObjectId, r: SlotRef) -> bool {
        matches!(self.find(id),
            Some((i, c)) if i == r.index as usize && c.gen() == r.gen && c.sealed())
    }

    fn index_checked(&self, r: SlotRef) -> Result<usize> {
        let i = r.index as usize;
        if i < self.slots.len() {
            Ok(i)
        } else {
            Err(corrupted(format!("slot index {} out of range", r.index)))
        }
    }

    /// Drops one pin taken by [`pin`](Self::pin) or [`add_pin`](Self::add_pin). If it
    /// was the last reference to a deleted object, the block is freed here.
    pub(crate) fn unpin(&self, r: SlotRef) -> Result<()> {
        let i = self.index_checked(r)?;
        let k = self.counter(i, self.me);
        let old = k.fetch_sub(1, sc());
        if old == 0 {
            k.fetch_add(1, sc());
            return Err(corrupted(format!("unpin of slot {i} without a pin")));
        }
        self.reclaimer.count(Event::Unpinned);
        if old == 1 {
            dekker_fence();
            self.try_free(i);
        }
        Ok(())
    }

    /// If slot `i` is DELETED and no client's counter is raised, moves it to FREEING (one
    /// CAS, so exactly one caller wins) and has the reclaimer free its block. Returns the
    /// entry it freed.
    pub(crate) fn try_free(&self, i: usize) -> Option<Entry> {
        let s = self.slots.get(i)?;
        let c = Ctl(s.ctl.load(sc_load()));
        if c.state() != DELETED {
            return None;
        }
        dekker_fence();
        if self.row(i).iter().any(|k| k.load(sc_load()) != 0) {
            return None;
        }
        self.reclaimer.begin_op();
        let won = s
            .ctl
            .compare_exchange(
                c.0,
                Ctl::new(FREEING, Some(self.me), c.gen()).0,
                sc(),
                Ordering::Relaxed,
            )
            .is_ok();
        let freed = won.then(|| {
            let e = self.entry(i);
            self.reclaimer.count(Event::Freed(e));
            // The retirer normally unlinked already; it may have died first.
            self.unlink(i);
            let r = SlotRef {
                index: i as u32,
                gen: c.gen(),
            };
            self.reclaimer.reclaim(self, r, e);
            e
        });
        self.reclaimer.end_op();
        freed
    }

    /// Returns a FREEING slot (its block already freed) to FREE at the next generation.
    /// Release: the next owner's claim (an Acquire CAS from FREE) sees everything the
    /// freer did with the slot first.
    pub(crate) fn release(&self, r: SlotRef) {
        let next = if crate::sync::mutation("no_gen_bump") {
            r.gen // deliberate bug, for docs/verification.md
        } else {
            r.gen.wrapping_add(1)
        };
        let order =
            crate::sync::weakened_by("slot_release_relaxed", Ordering::Release, Ordering::Relaxed);
        if let Some(s) = self.slots.get(r.index as usize) {
            s.ctl.store(Ctl::new(FREE, None, next).0, order);
        }
    }

    /// CREATING -> SEALED, then wakes getters waiting on this id.
    pub(crate) fn seal(&self, id: &ObjectId, r: SlotRef) -> Result<()> {
        let i = self.index_checked(r)?;
        let s = &self.slots[i];
        let c = Ctl(s.ctl.load(Ordering::Relaxed));
        if c.state() != CREATING || c.gen() != r.gen {
            return Err(corrupted(format!("seal of slot {} in {c:?}", r.index)));
        }
        // Release: every payload byte written before this store is visible to whoever pins.
        let publish =
            crate::sync::weakened_by("seal_relaxed", Ordering::Release, Ordering::Relaxed);
        // A step that changes a count: bracketed, so a death here owes a sweep.
        self.reclaimer.begin_op();
        let sealed = s
            .ctl
            .compare_exchange(
                c.0,
                Ctl::new(SEALED, None, c.gen()).0,
                publish,
                Ordering::Relaxed,
            )
            .map_err(|now| {
                corrupted(format!(
                    "slot {} changed under its creator: {:?} (was it recovered as dead?)",
                    r.index,
                    Ctl(now)
                ))
            });
        if sealed.is_ok() {
            self.reclaimer.count(Event::Sealed);
        }
        self.reclaimer.end_op();
        sealed?;
        self.notify(id);
        Ok(())
    }

    /// Moves slot `i` from one of `from` at `gen` to DELETED and unlinks it. A counter of
    /// ours is up across the unlink, so nobody frees (and reuses) the slot under us; the
    /// last counter down frees it. Returns whether this call retired it, and the entry if
    /// it also freed it.
    fn retire(&self, i: usize, gen: u32, from: &[u64]) -> (bool, Option<Entry>) {
        let s = &self.slots[i];
        let k = self.counter(i, self.me);
        // A step that changes a count: bracketed, so a death here owes a sweep.
        self.reclaimer.begin_op();
        k.fetch_add(1, sc());
        let mut c = Ctl(s.ctl.load(sc_load()));
        let retired = loop {
            if c.gen() != gen || !from.contains(&c.state()) {
                break false;
            }
            let deleted = Ctl::deleted(gen, c.state() != CREATING);
            match s.ctl.compare_exchange(c.0, deleted.0, sc(), sc_load()) {
                Ok(_) => break true,
                Err(now) => c = Ctl(now),
            }
        };
        if retired {
            self.reclaimer.count(if from == [CREATING] {
                Event::Aborted
            } else {
                Event::Deleted
            });
            self.unlink(i);
        }
        let freed = self.drop_hold(i);
        self.reclaimer.end_op();
        (retired, freed)
    }

    /// Clears slot `i`'s bit from its home bucket, if set (new lookups stop finding it).
    /// Only called by whoever holds the DELETED or FREEING slot, so its id is stable and
    /// the bit can only be this entry's.
    fn unlink(&self, i: usize) {
        let id = ObjectId::from_words(self.id_words(i));
        let home = self.home(&id);
        let Some(d) = self.distance(home, i) else {
            return;
        };
        let bucket = &self.buckets[home as usize];
        let mut b = bucket.load(Ordering::Relaxed);
        while b & (1 << d) != 0 {
            let nb = next_version(b) | (b as u32 as u64 & !(1 << d));
            match bucket.compare_exchange_weak(b, nb, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return,
                Err(now) => b = now,
            }
        }
    }

    /// Aborts an unsealed creation of ours; the block is freed (unsealed objects have no
    /// pins) and getters waiting on the id are woken.
    pub(crate) fn abort(&self, id: &ObjectId, r: SlotRef) -> Result<()> {
        let i = self.index_checked(r)?;
        if !self.retire(i, r.gen, &[CREATING]).0 {
            return Err(corrupted(format!(
                "abort of slot {} not in CREATING at generation {} (was it recovered as dead?)",
                r.index, r.gen
            )));
        }
        // Wake getters so they re-check (the id may be created again, or its creator died).
        self.notify(id);
        Ok(())
    }

    /// The slot and `ctl` of `id`'s sealed (or EVICTING) entry: `NotFound` if there is
    /// none, `NotSealed` while it is being created.
    fn find_sealed(&self, id: &ObjectId) -> Result<(usize, Ctl)> {
        match self.find(id) {
            None => Err(Error::NotFound { id: *id }),
            Some((_, c)) if c.state() == CREATING => Err(Error::NotSealed { id: *id }),
            Some(found) => Ok(found),
        }
    }

    /// Deletes a sealed object: new lookups stop finding it at once; the block is freed by
    /// whoever lowers the last pin counter (here, if none is raised: then its entry is
    /// returned).
    pub(crate) fn delete(&self, id: &ObjectId) -> Result<Option<Entry>> {
        loop {
            let (i, c) = self.find_sealed(id)?;
            if let (true, freed) = self.retire(i, c.gen(), &[SEALED, EVICTING]) {
                return Ok(freed);
            }
        }
    }

    /// Live entries (CREATING or SEALED) by a full scan.
    pub(crate) fn count_live(&self) -> u64 {
        self.slots
            .iter()
            .filter(|s| Ctl(s.ctl.load(Ordering::Relaxed)).live())
            .count() as u64
    }

    /// Sum of slot `i`'s pin counters (a racy snapshot, for stats and audits).
    pub(crate) fn pins_of(&self, i: usize) -> u64 {
        self.row(i)
            .iter()
            .map(|k| k.load(Ordering::Relaxed) as u64)
            .sum()
    }

    /// Client `c`'s counter on slot `i`, or 0 if out of range.
    pub(crate) fn counter_of(&self, i: usize, c: u64) -> u16 {
        if i >= self.slots.len() || c as usize >= self.stride {
            return 0;
        }
        self.counter(i, c as u16).load(Ordering::Relaxed)
    }

    /// Visits every non-FREE slot's (index, ctl, id, entry); for stats, audits, listings
    /// and recovery.
    pub(crate) fn scan(&self, mut f: impl FnMut(usize, Ctl, ObjectId, Entry)) {
        for (i, s) in self.slots.iter().enumerate() {
            let c = Ctl(s.ctl.load(Ordering::Acquire));
            if c.state() == FREE {
                continue;
            }
            f(i, c, ObjectId::from_words(self.id_words(i)), self.entry(i));
        }
    }

    /// Slot `i`'s (ctl, id, entry) if it is not FREE and did not change while read
    /// (seqlock-style, like lookups); for listings that walk the table lazily.
    pub(crate) fn read_slot(&self, i: usize) -> Option<(Ctl, ObjectId, Entry)> {
        let s = self.slots.get(i)?;
        let c1 = Ctl(s.ctl.load(Ordering::Acquire));
        if c1.state() == FREE {
            return None;
        }
        let (w, e) = (self.id_words(i), self.entry(i));
        fence(Ordering::Acquire);
        let c2 = Ctl(s.ctl.load(Ordering::Relaxed));
        (c2.0 == c1.0).then(|| (c1, ObjectId::from_words(w), e))
    }

    /// Test hook: overwrites the `creator` of `id`'s live entry.
    pub(crate) fn set_creator(&self, id: &ObjectId, creator: u16) -> Result<()> {
        let (i, _) = self.find(id).ok_or(Error::NotFound { id: *id })?;
        let mut e = self.entry(i);
        e.creator = creator;
        self.slots[i].info.store(e.info(), Ordering::Relaxed);
        Ok(())
    }

    /// Test hook: slot `i`'s index for `id`'s live entry.
    #[cfg(test)]
    pub(crate) fn index_of(&self, id: &ObjectId) -> Option<usize> {
        self.find(id).map(|(i, _)| i)
    }

    /// Test hook: writes slot `i` as a step in flight, or a buggy process, leaves it.
    #[cfg(test)]
    pub(crate) fn write_slot(&self, i: usize, c: Ctl, e: &Entry) {
        let s = &self.slots[i];
        s.offset.store(e.offset, Ordering::Relaxed);
        s.len.store(e.len, Ordering::Relaxed);
        s.info.store(e.info(), Ordering::Relaxed);
        s.ctl.store(c.0, Ordering::Release);
    }

    /// Test hook: sets client `c`'s pin counter on slot `i`, behind the counters' back.
    #[cfg(test)]
    pub(crate) fn set_counter(&self, i: usize, c: u16, pins: u16) {
        self.counter(i, c).store(pins, Ordering::Relaxed);
    }

    // ----- recovery of a dead client (see crate::recovery) -------------------------------

    /// Lowers dead client `dead`'s counter on slot `i` to zero and frees the slot if that
    /// was the last reference. Idempotent. Returns the entry freed, if any.
    pub(crate) fn drop_dead_pins(&self, i: usize, dead: u64) -> Option<Entry> {
        if i >= self.slots.len() || dead as usize >= self.stride {
            return None;
        }
        let k = self.counter(i, dead as u16);
        if k.swap(0, sc()) == 0 {
            return None;
        }
        dekker_fence();
        self.try_free(i)
    }

    /// Returns a RESERVED or FREEING slot whose owner died (`c` as read) to FREE at the
    /// next generation. Its block, if it had one, is left to the leak sweep: the owner may
    /// have been part-way through the allocator. Idempotent.
    pub(crate) fn reset_orphan(&self, i: usize, c: Ctl) -> bool {
        let Some(s) = self.slots.get(i) else {
            return false;
        };
        if !matches!(c.state(), RESERVED | FREEING) {
            return false;
        }
        if c.state() == FREEING {
            self.unlink(i);
        }
        s.ctl
            .compare_exchange(
                c.0,
                Ctl::new(FREE, None, c.gen().wrapping_add(1)).0,
                Ordering::AcqRel,
                Ordering::Relaxed,
            )
            .is_ok()
    }

    /// Aborts a CREATING entry whose creator died, waking its getters. Idempotent.
    /// Returns whether it aborted, and the entry if the block was freed here.
    pub(crate) fn abort_orphan(&self, i: usize, gen: u32) -> (bool, Option<Entry>) {
        if i >= self.slots.len() {
            return (false, None);
        }
        let id = ObjectId::from_words(self.id_words(i));
        let done = self.retire(i, gen, &[CREATING]);
        if done.0 {
            self.notify(&id);
        }
        done
    }
}

/// A table over sections on the heap: for unit tests, miri and loom.
#[cfg(any(test, loom))]
pub(crate) mod testing;

#[cfg(all(test, not(loom)))]
mod tests;
