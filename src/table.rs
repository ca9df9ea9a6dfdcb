//! The lock-free object table: id -> slot, with per-slot state, pins and generation.
//!
//! Open addressing with hopscotch neighbourhoods. An id's *home* is `mix(id) & mask`; its
//! entry lives in one of the [`NEIGHBORHOOD`] slots after the home. Each home has a bucket
//! word `version << 32 | bitmap`, whose bit `d` says "slot home + d holds an entry whose home
//! is this bucket". That word is the linearisation point of inserts and unlinks: an insert
//! publishes with one CAS that also proves no live entry with the same id was published
//! since it last looked, so two racing creates of one id can never both succeed.
//!
//! Each slot is one cache line: `ctl` (state, pins, generation), the id, and the block it
//! owns. Slot life cycle (docs/design.md, "Object state machine"):
//!
//! ```text
//! FREE(g) --claim--> RESERVED(g) --fields written--> CREATING(g) --publish in bucket-->
//!   CREATING --seal--> SEALED(g, pins) --delete--> DELETED(g, pins+1) --unlink, last unpin-->
//!   [block freed] --> FREE(g+1)
//! CREATING --abort--> DELETED --> ... --> FREE(g+1)
//! ```
//!
//! Readers use a seqlock-style check: read `ctl`, read the id, then re-read `ctl`; a slot
//! reused in between has a new generation and is skipped. Pinning is a CAS on `ctl` that
//! requires state SEALED and the same generation, so a view can never pin a reused slot,
//! and the last unpin of a DELETED slot is the one place its block is freed (exactly once).
//!
//! Blocked getters sleep on one of [`WAIT_BUCKETS`] futex words chosen by id hash; seals
//! bump it and wake only when its waiter count is non-zero (no syscall otherwise).

use crate::error::{Error, Result};
use crate::layout::{NEIGHBORHOOD, WAIT_BUCKETS};
use crate::sync::{fence, futex, AtomicU32, AtomicU64, Ordering};
use crate::ObjectId;
use std::time::{Duration, Instant};

/// Slot states (low 3 bits of `ctl`).
pub(crate) const FREE: u64 = 0;
pub(crate) const RESERVED: u64 = 1;
pub(crate) const CREATING: u64 = 2;
pub(crate) const SEALED: u64 = 3;
pub(crate) const DELETED: u64 = 4;

const PIN_SHIFT: u32 = 3;
const PIN_ONE: u64 = 1 << PIN_SHIFT;
/// Most pins one object can carry.
pub(crate) const MAX_PINS: u64 = (1 << 29) - 1;

/// `ctl` word helpers: `gen << 32 | pins << 3 | state`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Ctl(pub u64);

impl Ctl {
    pub(crate) fn new(state: u64, pins: u64, gen: u32) -> Self {
        Ctl((gen as u64) << 32 | pins << PIN_SHIFT | state)
    }
    pub(crate) fn state(self) -> u64 {
        self.0 & 7
    }
    pub(crate) fn pins(self) -> u64 {
        (self.0 >> PIN_SHIFT) & MAX_PINS
    }
    pub(crate) fn gen(self) -> u32 {
        (self.0 >> 32) as u32
    }
    fn live(self) -> bool {
        matches!(self.state(), CREATING | SEALED)
    }
}

/// One table entry (one cache line).
#[repr(C, align(64))]
#[derive(Default)]
pub(crate) struct Slot {
    ctl: AtomicU64,
    id: [AtomicU64; 4],
    offset: AtomicU64,
    len: AtomicU64,
    info: AtomicU64,
}

const _: () = assert!(std::mem::size_of::<Slot>() == 64);

/// A futex word plus the number of sleepers on it.
#[repr(C, align(64))]
#[derive(Default)]
pub(crate) struct WaitBucket {
    seq: AtomicU32,
    waiters: AtomicU32,
}

/// `info` flag: the object was used since the clock hand last passed (CLOCK's second chance).
pub(crate) const INFO_REFERENCED: u64 = 1 << 40;
/// `info` flag: never evict this object.
pub(crate) const INFO_NO_EVICT: u64 = 1 << 41;

impl WaitBucket {
    /// Bumps the sequence and wakes sleepers, if any (see [`Table::notify`]).
    pub(crate) fn notify(&self) {
        self.seq.fetch_add(1, Ordering::AcqRel);
        if self.waiters.fetch_add(0, Ordering::AcqRel) != 0 {
            futex::wake_all(&self.seq);
        }
    }

    /// Like [`notify`](Self::notify), but only if someone looks asleep (a plain load, so
    /// a sleeper registering at this instant may miss it; callers' sleepers re-check on a
    /// short period). For hot paths.
    pub(crate) fn nudge(&self) {
        if self.waiters.load(Ordering::Relaxed) != 0 {
            self.notify();
        }
    }

    /// Registers as a sleeper; returns the sequence to sleep on. Re-check the condition
    /// after this, then [`sleep`](Self::sleep), then [`unregister`](Self::unregister).
    pub(crate) fn register(&self) -> u32 {
        self.waiters.fetch_add(1, Ordering::AcqRel);
        self.seq.fetch_add(0, Ordering::AcqRel)
    }

    /// The current sequence (for a sleeper already registered).
    pub(crate) fn sequence(&self) -> u32 {
        self.seq.fetch_add(0, Ordering::AcqRel)
    }

    /// Sleeps while the sequence is `seq`, at most `timeout`.
    pub(crate) fn sleep(&self, seq: u32, timeout: Duration) {
        futex::wait(&self.seq, seq, Some(timeout));
    }

    /// Stops being a sleeper.
    pub(crate) fn unregister(&self) {
        self.waiters.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What a slot says about the block it owns. Untrusted: validated by the store before use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub(crate) struct Entry {
    /// Heap offset of the block.
    pub offset: u64,
    /// Payload length.
    pub len: u64,
    /// Metadata length (stored before the payload, padded to 64).
    pub meta_len: u16,
    /// Allocator block kind, encoded.
    pub kind: u8,
    /// Client slot of the creator.
    pub creator: u16,
}

impl Entry {
    fn info(&self) -> u64 {
        self.meta_len as u64 | (self.kind as u64) << 16 | (self.creator as u64) << 24
    }
    pub(crate) fn from_parts(offset: u64, len: u64, info: u64) -> Self {
        Entry {
            offset,
            len,
            meta_len: info as u16,
            kind: (info >> 16) as u8,
            creator: (info >> 24) as u16,
        }
    }
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
    /// The id is being created; not sealed yet.
    Creating,
    /// No live entry for the id.
    Absent,
}

/// The table over its shared sections.
pub(crate) struct Table<'a> {
    slots: &'a [Slot],
    buckets: &'a [AtomicU64],
    waits: &'a [WaitBucket],
    mask: u64,
}

fn corrupted(what: String) -> Error {
    Error::Corrupted { what }
}

impl<'a> Table<'a> {
    /// Wraps the sections; `slots.len()` is a power of two >= NEIGHBORHOOD.
    pub(crate) fn new(
        slots: &'a [Slot],
        buckets: &'a [AtomicU64],
        waits: &'a [WaitBucket],
    ) -> Self {
        debug_assert!(slots.len().is_power_of_two() && slots.len() as u64 >= NEIGHBORHOOD);
        debug_assert_eq!(slots.len(), buckets.len());
        debug_assert_eq!(waits.len() as u64, WAIT_BUCKETS);
        Table {
            slots,
            buckets,
            waits,
            mask: slots.len() as u64 - 1,
        }
    }

    /// Number of slots.
    pub(crate) fn capacity(&self) -> u64 {
        self.slots.len() as u64
    }

    fn home(&self, id: &ObjectId) -> u64 {
        id.mix() & self.mask
    }

    fn slot(&self, home: u64, d: u64) -> (usize, &Slot) {
        let i = ((home + d) & self.mask) as usize;
        (i, &self.slots[i])
    }

    /// Finds a live (CREATING or SEALED) entry for `words` among the bits of bucket word `b`.
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
            let mut w = [0u64; 4];
            for (k, x) in w.iter_mut().enumerate() {
                *x = s.id[k].load(Ordering::Relaxed);
            }
            fence(Ordering::Acquire);
            let c2 = Ctl(s.ctl.load(Ordering::Relaxed));
            if c2.gen() == c1.gen() && c2.live() && &w == words {
                return Some((i, c2));
            }
        }
        None
    }

    fn entry(&self, i: usize) -> Entry {
        let s = &self.slots[i];
        Entry::from_parts(
            s.offset.load(Ordering::Relaxed),
            s.len.load(Ordering::Relaxed),
            s.info.load(Ordering::Relaxed),
        )
    }

    /// Inserts `id` in state CREATING. The caller owns the returned slot until it seals or
    /// aborts it.
    pub(crate) fn insert(&self, id: &ObjectId, e: &Entry) -> Result<SlotRef> {
        let words = id.words();
        let home = self.home(id);
        // Claim a free slot in the neighbourhood (not yet visible to lookups).
        let mut mine = None;
        for d in 0..NEIGHBORHOOD {
            let (i, s) = self.slot(home, d);
            let c = Ctl(s.ctl.load(Ordering::Relaxed));
            if c.state() == FREE
                && s.ctl
                    .compare_exchange(
                        c.0,
                        Ctl::new(RESERVED, 0, c.gen()).0,
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
        s.ctl.store(Ctl::new(CREATING, 0, gen).0, Ordering::Release);
        let bucket = &self.buckets[home as usize];
        let mut b = bucket.load(Ordering::Acquire);
        loop {
            if self.find_in(home, b, &words).is_some() {
                s.ctl
                    .store(Ctl::new(FREE, 0, gen.wrapping_add(1)).0, Ordering::Release);
                return Err(Error::AlreadyExists { id: *id });
            }
            let nb = ((b >> 32).wrapping_add(1) << 32) | (b as u32 as u64) | (1 << d);
            match bucket.compare_exchange(b, nb, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    return Ok(SlotRef {
                        index: i as u32,
                        gen,
                    })
                }
                Err(now) => b = now,
            }
        }
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
            if c.state() == CREATING {
                return Ok(Pin::Creating);
            }
            if c.pins() >= MAX_PINS {
                return Err(corrupted(format!("slot {i} pin count overflow")));
            }
            if self.slots[i]
                .ctl
                .compare_exchange(c.0, c.0 + PIN_ONE, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                let r = SlotRef {
                    index: i as u32,
                    gen: c.gen(),
                };
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
        let s = self.slot_checked(r)?;
        let mut c = Ctl(s.ctl.load(Ordering::Relaxed));
        loop {
            if c.gen() != r.gen || c.pins() == 0 || c.pins() >= MAX_PINS {
                return Err(corrupted(format!("add_pin on slot {} in {c:?}", r.index)));
            }
            match s.ctl.compare_exchange_weak(
                c.0,
                c.0 + PIN_ONE,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Ok(()),
                Err(now) => c = Ctl(now),
            }
        }
    }

    /// Is `id` present, sealed or being created?
    pub(crate) fn contains_live(&self, id: &ObjectId) -> bool {
        let home = self.home(id);
        let b = self.buckets[home as usize].load(Ordering::Acquire);
        self.find_in(home, b, &id.words()).is_some()
    }

    /// Is `id` present and sealed?
    pub(crate) fn contains_sealed(&self, id: &ObjectId) -> bool {
        let home = self.home(id);
        let b = self.buckets[home as usize].load(Ordering::Acquire);
        matches!(self.find_in(home, b, &id.words()), Some((_, c)) if c.state() == SEALED)
    }

    fn slot_checked(&self, r: SlotRef) -> Result<&Slot> {
        self.slots
            .get(r.index as usize)
            .ok_or_else(|| corrupted(format!("slot index {} out of range", r.index)))
    }

    /// Drops one pin. Returns the entry when this was the last reference to a deleted
    /// object: the caller must then free its block and call [`release`](Self::release).
    pub(crate) fn unpin(&self, r: SlotRef) -> Result<Option<Entry>> {
        let s = self.slot_checked(r)?;
        let mut c = Ctl(s.ctl.load(Ordering::Relaxed));
        loop {
            if c.gen() != r.gen || c.pins() == 0 || !matches!(c.state(), SEALED | DELETED) {
                return Err(corrupted(format!("unpin of slot {} in {c:?}", r.index)));
            }
            let n = Ctl(c.0 - PIN_ONE);
            match s
                .ctl
                .compare_exchange_weak(c.0, n.0, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => {
                    return Ok((n.state() == DELETED && n.pins() == 0)
                        .then(|| self.entry(r.index as usize)));
                }
                Err(now) => c = Ctl(now),
            }
        }
    }

    /// Returns a slot whose block has been freed to FREE at the next generation.
    pub(crate) fn release(&self, r: SlotRef) {
        let next = if cfg!(shmstore_mutation = "no_gen_bump") {
            r.gen // deliberate bug, for docs/verification.md
        } else {
            r.gen.wrapping_add(1)
        };
        if let Ok(s) = self.slot_checked(r) {
            s.ctl.store(Ctl::new(FREE, 0, next).0, Ordering::Release);
        }
    }

    /// CREATING -> SEALED, then wakes getters waiting on this id.
    pub(crate) fn seal(&self, id: &ObjectId, r: SlotRef) -> Result<()> {
        let s = self.slot_checked(r)?;
        let c = Ctl(s.ctl.load(Ordering::Relaxed));
        if c.state() != CREATING || c.gen() != r.gen {
            return Err(corrupted(format!("seal of slot {} in {c:?}", r.index)));
        }
        // Release: every payload byte written before this store is visible to whoever pins.
        let publish = if cfg!(shmstore_mutation = "seal_relaxed") {
            Ordering::Relaxed // deliberate bug, for docs/verification.md
        } else {
            Ordering::Release
        };
        s.ctl
            .compare_exchange(
                c.0,
                Ctl::new(SEALED, c.pins(), c.gen()).0,
                publish,
                Ordering::Relaxed,
            )
            .map_err(|now| {
                corrupted(format!(
                    "slot {} changed under its creator: {:?}",
                    r.index,
                    Ctl(now)
                ))
            })?;
        self.notify(id);
        Ok(())
    }

    /// Moves a live entry to DELETED holding one reference for the caller, then unlinks it
    /// from its bucket. `expect` is CREATING (abort) or SEALED (delete).
    fn retire(&self, id: &ObjectId, r: SlotRef, expect: u64) -> Result<bool> {
        let s = self.slot_checked(r)?;
        let mut c = Ctl(s.ctl.load(Ordering::Relaxed));
        loop {
            if c.gen() != r.gen || c.state() != expect {
                return Ok(false);
            }
            let extra = if cfg!(shmstore_mutation = "delete_without_ref") {
                0
            } else {
                1
            };
            let n = Ctl::new(DELETED, c.pins() + extra, c.gen());
            match s
                .ctl
                .compare_exchange_weak(c.0, n.0, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => break,
                Err(now) => c = Ctl(now),
            }
        }
        self.unlink(id, r)?;
        Ok(true)
    }

    /// Clears a DELETED slot's bit from its home bucket (new lookups stop finding it).
    fn unlink(&self, id: &ObjectId, r: SlotRef) -> Result<()> {
        let home = self.home(id);
        let d = (r.index as u64).wrapping_sub(home) & self.mask;
        let bucket = &self.buckets[home as usize];
        let mut b = bucket.load(Ordering::Relaxed);
        loop {
            if d >= NEIGHBORHOOD || b & (1 << d) == 0 {
                return Err(corrupted(format!(
                    "slot {} missing from its bucket",
                    r.index
                )));
            }
            let nb = ((b >> 32).wrapping_add(1) << 32) | (b as u32 as u64 & !(1 << d));
            match bucket.compare_exchange_weak(b, nb, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return Ok(()),
                Err(now) => b = now,
            }
        }
    }

    /// Aborts an unsealed creation. Returns the entry to free (the creator held the only
    /// reference, since unsealed objects cannot be pinned).
    pub(crate) fn abort(&self, id: &ObjectId, r: SlotRef) -> Result<Option<Entry>> {
        if !self.retire(id, r, CREATING)? {
            return Err(corrupted(format!(
                "abort of slot {} not in CREATING",
                r.index
            )));
        }
        // Wake getters so they re-check (the id may be created again).
        self.notify(id);
        self.unpin(r)
    }

    /// Deletes a sealed object: new lookups stop finding it at once; the block is freed by
    /// whoever drops the last pin. Returns the slot and entry if the caller must free it now.
    pub(crate) fn delete(&self, id: &ObjectId) -> Result<Option<(SlotRef, Entry)>> {
        let words = id.words();
        let home = self.home(id);
        loop {
            let b = self.buckets[home as usize].load(Ordering::Acquire);
            let Some((i, c)) = self.find_in(home, b, &words) else {
                return Err(Error::NotFound { id: *id });
            };
            if c.state() == CREATING {
                return Err(Error::NotSealed { id: *id });
            }
            let r = SlotRef {
                index: i as u32,
                gen: c.gen(),
            };
            if self.retire(id, r, SEALED)? {
                return Ok(self.unpin(r)?.map(|e| (r, e)));
            }
        }
    }

    /// The wait bucket for `id`.
    fn wait_bucket(&self, id: &ObjectId) -> &WaitBucket {
        &self.waits[((id.mix() >> 40) % WAIT_BUCKETS) as usize]
    }

    /// Wakes getters sleeping on `id`'s bucket (no syscall when nobody sleeps).
    ///
    /// Both sides of the sleeper/waker handshake use read-modify-writes (`seq += 1` then
    /// `waiters += 0` here; `waiters += 1` then `seq += 0` in [`pin_wait`](Self::pin_wait)).
    /// An RMW always reads the latest value of its location, so whichever of the two `seq`
    /// RMWs comes second synchronises with the first: either the waker sees the waiter
    /// registered, or the waiter sees the new `seq` (and the seal before it). This needs
    /// only acquire/release, which loom models exactly (it treats SeqCst as AcqRel).
    pub(crate) fn notify(&self, id: &ObjectId) {
        self.wait_bucket(id).notify();
    }

    /// Marks an object its creator still holds (CREATING) as never evictable.
    pub(crate) fn set_no_evict(&self, r: SlotRef) -> Result<()> {
        let s = self.slot_checked(r)?;
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
    /// was not used since the last pass is deleted (as by [`delete`](Self::delete)) and its
    /// slot and entry returned for freeing; a used one loses its referenced bit instead.
    /// Pinned objects are skipped, never waited for.
    pub(crate) fn clock_step(&self, i: usize) -> Result<Option<(SlotRef, Entry)>> {
        let Some(s) = self.slots.get(i) else {
            return Ok(None);
        };
        let c = Ctl(s.ctl.load(Ordering::Acquire));
        if c.state() != SEALED || c.pins() != 0 {
            return Ok(None);
        }
        let info = s.info.load(Ordering::Relaxed);
        if info & INFO_NO_EVICT != 0 {
            return Ok(None);
        }
        if info & INFO_REFERENCED != 0 {
            s.info.fetch_and(!INFO_REFERENCED, Ordering::Relaxed);
            return Ok(None);
        }
        // Read the id while the generation is known; retire re-checks ctl exactly.
        let mut w = [0u64; 4];
        for (k, x) in w.iter_mut().enumerate() {
            *x = s.id[k].load(Ordering::Relaxed);
        }
        fence(Ordering::Acquire);
        if s.ctl.load(Ordering::Relaxed) != c.0 {
            return Ok(None);
        }
        let id = ObjectId::from_words(w);
        let r = SlotRef {
            index: i as u32,
            gen: c.gen(),
        };
        // Only an unpinned object may go: a pin taken meanwhile makes the CAS fail.
        let mut expect = c;
        if cfg!(shmstore_mutation = "evict_pinned") {
            // Deliberate bug, for docs/verification.md: evict whatever the pins are now.
            expect = Ctl(s.ctl.load(Ordering::Acquire));
        }
        let n = Ctl::new(DELETED, expect.pins() + 1, c.gen());
        if s.ctl
            .compare_exchange(expect.0, n.0, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            return Ok(None);
        }
        self.unlink(&id, r)?;
        Ok(self.unpin(r)?.map(|e| (r, e)))
    }

    /// Pins `id`, waiting until it is sealed or `deadline` passes (`None`: try once).
    ///
    /// Waiting first spins for up to `spin` watching the id's wait-bucket sequence (a seal
    /// that lands in that window is seen in a cache-line transfer, with no syscall on
    /// either side), then sleeps on the bucket's futex. Sleepers register in `waiters`
    /// before their final check, so a sealer that sees no waiter can skip the wake.
    pub(crate) fn pin_wait(
        &self,
        id: &ObjectId,
        deadline: Option<Instant>,
        spin: Duration,
    ) -> Result<Pin> {
        let first = self.pin(id)?;
        let Some(deadline) = deadline else {
            return Ok(first);
        };
        if matches!(first, Pin::Pinned(..)) {
            return Ok(first);
        }
        let wb = self.wait_bucket(id);
        if !spin.is_zero() {
            let spin_end = deadline.min(Instant::now() + spin);
            loop {
                let seq = wb.seq.load(Ordering::Acquire);
                if let p @ Pin::Pinned(..) = self.pin(id)? {
                    return Ok(p);
                }
                loop {
                    if Instant::now() >= spin_end {
                        break;
                    }
                    if wb.seq.load(Ordering::Relaxed) != seq {
                        break;
                    }
                    crate::sync::spin_hint();
                }
                if Instant::now() >= spin_end {
                    break;
                }
            }
        }
        wb.waiters.fetch_add(1, Ordering::AcqRel);
        let result = loop {
            // Read the futex word *before* the re-check: a seal after this read changes it,
            // so the wait below returns at once instead of missing the wake.
            let mut seq = 0;
            if !cfg!(shmstore_mutation = "lost_wakeup") {
                seq = wb.seq.fetch_add(0, Ordering::AcqRel);
            }
            let found = self.pin(id);
            if cfg!(shmstore_mutation = "lost_wakeup") {
                // Deliberate bug, for docs/verification.md: re-check before reading the word.
                seq = wb.seq.fetch_add(0, Ordering::AcqRel);
            }
            match found {
                Ok(Pin::Pinned(r, e)) => break Ok(Pin::Pinned(r, e)),
                Err(e) => break Err(e),
                Ok(other) => {
                    let now = Instant::now();
                    if now >= deadline {
                        break Ok(other);
                    }
                    futex::wait(&wb.seq, seq, Some(deadline - now));
                }
            }
        };
        wb.waiters.fetch_sub(1, Ordering::AcqRel);
        result
    }

    /// Live entries (CREATING or SEALED) by a full scan.
    pub(crate) fn count_live(&self) -> u64 {
        self.slots
            .iter()
            .filter(|s| Ctl(s.ctl.load(Ordering::Relaxed)).live())
            .count() as u64
    }

    /// Visits every slot's (index, ctl, id, entry); for stats, audits and listings.
    pub(crate) fn scan(&self, mut f: impl FnMut(usize, Ctl, ObjectId, Entry)) {
        for (i, s) in self.slots.iter().enumerate() {
            let c = Ctl(s.ctl.load(Ordering::Acquire));
            if c.state() == FREE {
                continue;
            }
            let mut w = [0u64; 4];
            for (k, x) in w.iter_mut().enumerate() {
                *x = s.id[k].load(Ordering::Relaxed);
            }
            f(i, c, ObjectId::from_words(w), self.entry(i));
        }
    }
}

/// A table over sections on the heap: for unit tests, miri and loom.
#[cfg(any(test, loom))]
pub(crate) mod testing {
    use super::*;

    /// Owns the sections a [`Table`] borrows.
    pub(crate) struct HeapTable {
        pub slots: Vec<Slot>,
        pub buckets: Vec<AtomicU64>,
        pub waits: Vec<WaitBucket>,
    }

    impl HeapTable {
        /// An empty table of `n` slots (a power of two >= 32).
        pub(crate) fn new(n: usize) -> Self {
            HeapTable {
                slots: (0..n).map(|_| Slot::default()).collect(),
                buckets: (0..n).map(|_| AtomicU64::new(0)).collect(),
                waits: (0..WAIT_BUCKETS).map(|_| WaitBucket::default()).collect(),
            }
        }

        /// Borrows it as a [`Table`].
        pub(crate) fn get(&self) -> Table<'_> {
            Table::new(&self.slots, &self.buckets, &self.waits)
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::testing::HeapTable;
    use super::*;

    fn e(offset: u64) -> Entry {
        Entry {
            offset,
            len: 10,
            meta_len: 0,
            kind: 1,
            creator: 3,
        }
    }

    #[test]
    fn insert_seal_pin_delete_release() {
        let h = HeapTable::new(64);
        let t = h.get();
        let id = ObjectId::of_key("a");
        let r = t.insert(&id, &e(640)).unwrap();
        assert!(matches!(t.pin(&id).unwrap(), Pin::Creating));
        assert!(matches!(
            t.insert(&id, &e(0)),
            Err(Error::AlreadyExists { .. })
        ));
        assert!(matches!(t.delete(&id), Err(Error::NotSealed { .. })));
        t.seal(&id, r).unwrap();
        assert!(t.contains_sealed(&id));
        let Pin::Pinned(p, entry) = t.pin(&id).unwrap() else {
            panic!()
        };
        assert_eq!(p, r);
        assert_eq!(entry, e(640));
        // Delete while pinned: lookups stop at once, the block is not freed yet.
        assert_eq!(t.delete(&id).unwrap(), None);
        assert!(matches!(t.pin(&id).unwrap(), Pin::Absent));
        assert!(matches!(t.delete(&id), Err(Error::NotFound { .. })));
        // The same id can be created again while the old one drains.
        let r2 = t.insert(&id, &e(1280)).unwrap();
        assert_ne!(r2.index, r.index);
        // Last unpin hands the old entry back for freeing.
        assert_eq!(t.unpin(p).unwrap(), Some(e(640)));
        t.release(p);
        assert!(t.unpin(p).is_err(), "stale ref must not unpin");
        assert_eq!(t.abort(&id, r2).unwrap(), Some(e(1280)));
        t.release(r2);
        assert_eq!(t.count_live(), 0);
    }

    #[test]
    fn reused_slot_never_matches_old_generation() {
        let h = HeapTable::new(32);
        let t = h.get();
        let a = ObjectId::of_key("a");
        let r = t.insert(&a, &e(0)).unwrap();
        t.seal(&a, r).unwrap();
        assert_eq!(t.delete(&a).unwrap(), Some((r, e(0))));
        t.release(r);
        // Every new insert lands somewhere; none may be pinned through the old ref.
        for k in 0..20 {
            let id = ObjectId::of_key(format!("b{k}"));
            let r2 = t.insert(&id, &e(64)).unwrap();
            t.seal(&id, r2).unwrap();
            if r2.index == r.index {
                assert_ne!(r2.gen, r.gen);
            }
        }
        assert!(t.add_pin(r).is_err());
        assert!(t.unpin(r).is_err());
    }

    #[test]
    fn neighbourhood_full_is_table_full() {
        let h = HeapTable::new(32);
        let t = h.get();
        let mut n = 0;
        let err = loop {
            match t.insert(&ObjectId::of_key(format!("{n}")), &e(0)) {
                Ok(_) => n += 1,
                Err(e) => break e,
            }
        };
        assert_eq!(n, 32);
        assert!(matches!(
            err,
            Error::TableFull {
                objects: 32,
                slots: 32
            }
        ));
    }

    #[test]
    fn racing_creates_of_one_id_admit_exactly_one() {
        for round in 0..if cfg!(miri) { 4 } else { 200 } {
            let h = std::sync::Arc::new(HeapTable::new(64));
            let id = ObjectId::of_key(format!("race{round}"));
            let wins: usize = (0..3)
                .map(|_| {
                    let h = h.clone();
                    std::thread::spawn(move || h.get().insert(&id, &e(0)).is_ok() as usize)
                })
                .collect::<Vec<_>>()
                .into_iter()
                .map(|t| t.join().unwrap())
                .sum();
            assert_eq!(wins, 1);
        }
    }

    #[test]
    fn pin_wait_wakes_on_seal_and_times_out() {
        for spin in [0, 50, if cfg!(miri) { 500 } else { 1_000_000 }] {
            pin_wait_case(spin);
        }
    }

    fn pin_wait_case(spin: u64) {
        let h = std::sync::Arc::new(HeapTable::new(64));
        let id = ObjectId::of_key("w");
        let t = h.get();
        let start = Instant::now();
        let p = t
            .pin_wait(&id, Some(start + Duration::from_millis(30)), Duration::ZERO)
            .unwrap();
        assert!(matches!(p, Pin::Absent));
        assert!(start.elapsed() >= Duration::from_millis(29));
        let h2 = h.clone();
        let waiter = std::thread::spawn(move || {
            let t = h2.get();
            matches!(
                t.pin_wait(
                    &id,
                    Some(Instant::now() + Duration::from_secs(20)),
                    Duration::from_micros(spin)
                )
                .unwrap(),
                Pin::Pinned(..)
            )
        });
        let r = t.insert(&id, &e(0)).unwrap();
        t.seal(&id, r).unwrap();
        assert!(waiter.join().unwrap());
    }
}
