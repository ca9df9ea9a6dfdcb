//! Slabs: the upper layer of the allocator, for requests up to 16 KiB.
//!
//! 32 size classes (64 B steps to 1 KiB, then four classes per doubling). A slab is a
//! 64 KiB-aligned run of 16 pages, taken from the page layer and dedicated to one class;
//! its descriptor ([`SlabDesc`]) holds `state = (class + 1) << 16 | live` and a block
//! bitmap. A claimer first reserves a block by incrementing `live` with CAS (which fails
//! if the slab changed class or is full), then sets one clear bit. A freer clears the
//! bit, marks the slab in its class's *partial* bitmap, then decrements `live`; whoever
//! takes `live` to zero may retire the slab with one CAS (`state` -> 0) and free its
//! pages. Each class keeps a *current* slab (a hint); an empty current slab stays
//! (an [`IdleSlab`]) to avoid churn until the page layer needs its pages.
//!
//! Invariants: bits set in a slab's bitmap <= its `live` count; a unit whose `state` is
//! 0 has an all-zero bitmap; a slab is retired only by the CAS that finds it empty, so a
//! claimer that reserved in it first keeps it alive.

use super::*;

/// An empty slab kept as its class's current slab.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct IdleSlab {
    pub(super) slab: usize,
    pub(super) class: usize,
}

impl IdleSlab {
    pub(super) fn first_page(&self) -> u64 {
        self.slab as u64 * PAGES_PER_SLAB
    }

    /// The page-bitmap word holding the slab's 16 pages (a slab never straddles words).
    pub(super) fn word(&self) -> usize {
        self.slab * PAGES_PER_SLAB as usize / 64
    }

    /// The slab's pages within [`word`](Self::word).
    pub(super) fn mask(&self) -> u64 {
        let first = self.slab as u64 * PAGES_PER_SLAB % 64;
        range_mask(first, first + PAGES_PER_SLAB)
    }
}

/// At most one idle slab per class, without allocating.
#[derive(Default)]
pub(super) struct IdleSlabs {
    slabs: [IdleSlab; CLASSES as usize],
    len: usize,
}

impl IdleSlabs {
    pub(super) fn push(&mut self, slab: IdleSlab) {
        if self.len < self.slabs.len() {
            self.slabs[self.len] = slab;
            self.len += 1;
        }
    }

    pub(super) fn sort(&mut self) {
        self.slabs[..self.len].sort_unstable();
    }

    pub(super) fn as_slice(&self) -> &[IdleSlab] {
        &self.slabs[..self.len]
    }
}

impl Allocator<'_> {
    pub(super) fn hint(&self, class: usize) -> &AtomicU64 {
        &self.hints[class].0
    }

    pub(super) fn partial_word(&self, class: usize, slab: usize) -> &AtomicU64 {
        &self.partial[class * self.partial_words + slab / 64]
    }

    pub(super) fn alloc_small(&self, class: usize) -> Result<Option<Block>> {
        let size = CLASS_SIZES[class];
        let block = |slab: usize, idx: u64| Block {
            offset: slab as u64 * SLAB + idx * size,
            size,
            kind: BlockKind::Slab(class as u8),
        };
        // 1. The class's current slab.
        let h = self.hint(class).load(Ordering::Acquire);
        if h != 0 && h <= self.slabs.len() as u64 {
            let s = (h - 1) as usize;
            if let Some(i) = self.claim_in_slab(s, class) {
                return Ok(Some(block(s, i)));
            }
        }
        // 2. A slab of this class with a freed block.
        if let Some((s, i)) = self.claim_from_partial(class) {
            self.hint(class).store(s as u64 + 1, Ordering::Release);
            return Ok(Some(block(s, i)));
        }
        // 3. A fresh slab.
        let Some(first) = self.alloc_pages(PAGES_PER_SLAB, PAGES_PER_SLAB) else {
            return Ok(None);
        };
        let s = (first / PAGES_PER_SLAB) as usize;
        let d = &self.slabs[s];
        // We own the unit exclusively (its pages are ours, its state is 0); a previous
        // incarnation left its bits clear, but do not trust shared memory for that.
        for w in &d.bits[1..] {
            w.store(0, Ordering::Relaxed);
        }
        d.bits[0].store(1, Ordering::Relaxed);
        d.state
            .store(((class as u64 + 1) << 16) | 1, Ordering::Release);
        self.hint(class).store(s as u64 + 1, Ordering::Release);
        Ok(Some(block(s, 0)))
    }

    /// Reserves and claims one block of `class` in slab `s`; `None` if the slab is not of
    /// that class or is full.
    pub(super) fn claim_in_slab(&self, s: usize, class: usize) -> Option<u64> {
        let d = &self.slabs[s];
        let cap = blocks_per_slab(class);
        let tag = (class as u64 + 1) << 16;
        let mut st = d.state.load(Ordering::Acquire);
        loop {
            if st & !0xffff != tag || st & 0xffff >= cap {
                return None;
            }
            match d
                .state
                .compare_exchange_weak(st, st + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break,
                Err(now) => st = now,
            }
        }
        // A reservation guarantees a clear bit unless shared memory is corrupt; bound the
        // passes so corruption degrades to "slab full" instead of a hang.
        let words = cap.div_ceil(64) as usize;
        let start = ((st & 0xffff) / 64) as usize % words;
        for _pass in 0..64 {
            for k in 0..words {
                let w = (start + k) % words;
                let valid = range_mask(0, (cap - w as u64 * 64).min(64));
                let cur = d.bits[w].load(Ordering::Relaxed);
                let free = !cur & valid;
                if free != 0 {
                    let b = free.trailing_zeros() as u64;
                    let prev = d.bits[w].fetch_or(1 << b, Ordering::AcqRel);
                    if prev & (1 << b) == 0 {
                        return Some(w as u64 * 64 + b);
                    }
                }
            }
            crate::sync::spin_hint();
        }
        self.release_reservation(s, class);
        None
    }

    /// The classes' current slabs that hold no block right now, by address (a snapshot:
    /// any of them may be used again, or retired, at once).
    pub(super) fn idle_slabs(&self) -> IdleSlabs {
        let mut out = IdleSlabs::default();
        for class in 0..CLASSES as usize {
            let h = self.hint(class).load(Ordering::Acquire);
            if h == 0 || h > self.slabs.len() as u64 {
                continue;
            }
            let s = (h - 1) as usize;
            if self.slabs[s].state.load(Ordering::Acquire) == (class as u64 + 1) << 16 {
                out.push(IdleSlab { slab: s, class });
            }
        }
        out.sort();
        out
    }

    /// Retires `slab` if it is still `class`'s current slab and still empty. Returns
    /// whether it did.
    pub(super) fn retire_idle(&self, slab: IdleSlab) -> bool {
        let IdleSlab { slab: s, class } = slab;
        let h = s as u64 + 1;
        if self.hint(class).load(Ordering::Acquire) != h
            || self.slabs[s].state.load(Ordering::Acquire) != (class as u64 + 1) << 16
        {
            return false;
        }
        // Drop the hint first so that a concurrent free does not keep the slab alive,
        // then retire it if it is still empty.
        let _ = self
            .hint(class)
            .compare_exchange(h, 0, Ordering::AcqRel, Ordering::Relaxed);
        self.try_retire(s, class)
    }

    /// Retires the idle slabs among `idle` that lie within pages `[first, first + n)`.
    pub(super) fn retire_idle_within(&self, first: u64, n: u64, idle: &[IdleSlab]) {
        for &slab in idle {
            let p = slab.first_page();
            if p < first + n && first < p + PAGES_PER_SLAB {
                self.retire_idle(slab);
            }
        }
    }

    /// Retires every class's current slab that holds no block, so its pages can join a
    /// larger run. Called when an allocation fails. Returns whether anything was freed.
    pub(super) fn flush_idle_slabs(&self) -> bool {
        let mut freed = false;
        for &slab in self.idle_slabs().as_slice() {
            freed |= self.retire_idle(slab);
        }
        freed
    }

    pub(super) fn claim_from_partial(&self, class: usize) -> Option<(usize, u64)> {
        let pw = self.partial_words;
        for k in 0..pw {
            let word = &self.partial[class * pw + k];
            let mut bits = word.load(Ordering::Acquire);
            while bits != 0 {
                let b = bits.trailing_zeros() as usize;
                bits &= bits - 1;
                let s = k * 64 + b;
                if s >= self.slabs.len() {
                    break;
                }
                if let Some(i) = self.claim_in_slab(s, class) {
                    return Some((s, i));
                }
                // Full or no longer this class: drop the mark, then look once more in case
                // a block was freed between our claim attempt and the clear.
                word.fetch_and(!(1u64 << b), Ordering::AcqRel);
                if let Some(i) = self.claim_in_slab(s, class) {
                    return Some((s, i));
                }
            }
        }
        None
    }

    /// Decrements `live`; retires the slab when it reaches zero (unless it is the class's
    /// current slab, which stays to avoid churn).
    pub(super) fn release_reservation(&self, s: usize, class: usize) {
        let d = &self.slabs[s];
        let tag = (class as u64 + 1) << 16;
        let mut st = d.state.load(Ordering::Acquire);
        loop {
            if st & !0xffff != tag || st & 0xffff == 0 {
                return; // corrupted; leave it for recovery rather than underflow
            }
            match d
                .state
                .compare_exchange_weak(st, st - 1, slab_free(), slab_free_fail())
            {
                Ok(_) => break,
                Err(now) => st = now,
            }
        }
        if st - 1 != tag || self.hint(class).load(Ordering::Relaxed) == s as u64 + 1 {
            return;
        }
        self.try_retire(s, class);
    }

    /// Retires slab `s` of `class` if its `live` count is zero: one CAS to state 0 (after
    /// which no claimer can reserve in it), then its pages go back. Returns whether it did.
    pub(super) fn try_retire(&self, s: usize, class: usize) -> bool {
        let tag = (class as u64 + 1) << 16;
        if self.slabs[s]
            .state
            .compare_exchange(tag, 0, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            return false;
        }
        self.partial_word(class, s)
            .fetch_and(!(1u64 << (s % 64)), Ordering::AcqRel);
        let first = s as u64 * PAGES_PER_SLAB;
        self.release_range(first, first + PAGES_PER_SLAB);
        self.lower_hint(first);
        true
    }

    pub(super) fn free_small(&self, class: usize, offset: u64) -> Result<()> {
        if class >= CLASSES as usize {
            return Err(corrupted(format!("slab class {class} out of range")));
        }
        let size = CLASS_SIZES[class];
        let s = (offset / SLAB) as usize;
        let within = offset % SLAB;
        if s >= self.slabs.len() || within % size != 0 || within / size >= blocks_per_slab(class) {
            return Err(corrupted(format!(
                "block at heap offset {offset} is not a class-{class} block"
            )));
        }
        let d = &self.slabs[s];
        let st = d.state.load(Ordering::Acquire);
        if st >> 16 != class as u64 + 1 {
            return Err(corrupted(format!(
                "slab {s} has state {st:#x}, expected class {class}"
            )));
        }
        let idx = within / size;
        let bit = 1u64 << (idx % 64);
        let prev = d.bits[(idx / 64) as usize].fetch_and(!bit, slab_free());
        if prev & bit == 0 {
            return Err(corrupted(format!("double free of heap offset {offset}")));
        }
        self.partial_word(class, s)
            .fetch_or(1u64 << (s % 64), slab_free());
        self.release_reservation(s, class);
        Ok(())
    }

    // ----- inspection ------------------------------------------------------------------

    /// Clears the block bitmap of 64 KiB unit `s` if it is not a slab (state 0) but has
    /// bits set: left by a process killed inside new-slab setup, after the sweep freed
    /// the unit's pages. Takes the unit's pages first, as a new slab would, so that no
    /// setup in progress can be disturbed; skips the unit if they are taken.
    pub(crate) fn scrub_unit(&self, s: usize) -> bool {
        let Some(d) = self.slabs.get(s) else {
            return false;
        };
        let first = s as u64 * PAGES_PER_SLAB;
        let clear = || d.bits.iter().all(|w| w.load(Ordering::Relaxed) == 0);
        // (Bits already clear: scrubbed with its leaked run, after the sweep's snapshot.)
        if d.state.load(Ordering::Acquire) != 0
            || clear()
            || self.claim_run(first, PAGES_PER_SLAB).is_err()
        {
            return false;
        }
        let mut scrubbed = false;
        if d.state.load(Ordering::Acquire) == 0 {
            for w in &d.bits {
                scrubbed |= w.swap(0, Ordering::AcqRel) != 0;
            }
        }
        self.release_range(first, first + PAGES_PER_SLAB);
        self.lower_hint(first);
        scrubbed
    }

    /// Clears the block bitmaps of the units wholly inside leaked page run `[first, end)`
    /// that are no slab (state 0) but have bits set: a setup killed midway, whose pages
    /// the sweep is about to free. Done *before* the pages are freed, while nobody else
    /// can take them (they are claimed, and nothing names them): a sweeper killed
    /// between the two then leaves the pages leaked and the bits clear, which the next
    /// sweep finishes; the other order left bits on a free unit that anyone could take as
    /// a page run, after which no sweep could clear them (they are not its to touch
    /// while others own the pages), and `check_invariants` called the store corrupted.
    pub(crate) fn scrub_units_of_leaked_run(&self, first: u64, end: u64) {
        let units = first.div_ceil(PAGES_PER_SLAB)..end / PAGES_PER_SLAB;
        for s in units {
            let Some(d) = self.slabs.get(s as usize) else {
                return;
            };
            if d.state.load(Ordering::Acquire) == 0 {
                for w in &d.bits {
                    if w.load(Ordering::Relaxed) != 0 {
                        w.store(0, Ordering::Relaxed);
                    }
                }
            }
        }
    }

    /// Test hook: what a process killed inside new-slab setup leaves (pages claimed, bit 0
    /// set, state never published). Returns whether it found pages for a slab.
    pub(crate) fn begin_slab_setup_only(&self) -> bool {
        let Some(first) = self.alloc_pages(PAGES_PER_SLAB, PAGES_PER_SLAB) else {
            return false;
        };
        self.slabs[(first / PAGES_PER_SLAB) as usize].bits[0].store(1, Ordering::Relaxed);
        true
    }

    /// Retires slab `s` of `class` if nothing is reserved in it and it is not the class's
    /// hint (which stays, empty, for the next claim): what the last free in a slab does,
    /// for a freer killed just before its retiring CAS (the leak sweep calls this). The
    /// same single CAS as that free's, so it is safe at any moment: a claimer that
    /// reserved first makes it fail; one that comes after finds no slab. Returns whether
    /// it retired the slab.
    pub(crate) fn retire_if_empty(&self, s: usize, class: usize) -> bool {
        s < self.slabs.len()
            && class < CLASSES as usize
            && self.hint(class).load(Ordering::Relaxed) != s as u64 + 1
            && self.try_retire(s, class)
    }

    /// Drops `k` reservations of slab `s` that no block bit stands for (a claimer died
    /// between reserving and setting its bit); the slab may retire.
    pub(crate) fn drop_leaked_reservations(&self, s: usize, class: usize, k: u64) {
        if s < self.slabs.len() && class < CLASSES as usize {
            for _ in 0..k {
                self.release_reservation(s, class);
            }
        }
    }
}
