//! The lock-free segregated-fit allocator that lives inside the region.
//!
//! Two layers, both made of bitmaps in shared memory and changed only by single-word
//! atomic read-modify-writes, so a process stopped or killed at any instruction never blocks
//! another (see docs/design.md, "Allocator"):
//!
//! * **Page runs.** The heap is cut into 4 KiB pages with one bit each in the page bitmap.
//!   An allocation of `n` pages finds a run of `n` clear bits (best fit from 1 MiB, where
//!   classes' empty current slabs count as free and give way; first fit from a low-water
//!   mark below) and claims it word by word, in ascending order, with CAS. If a word turns
//!   out to be taken, the words already claimed are rolled back and the search moves past
//!   the conflict. Freeing clears the bits, so neighbouring free runs coalesce by construction:
//!   there is no free list to fragment and no merge step to race.
//! * **Slabs.** Requests up to 16 KiB use one of 32 size classes (64 B steps to 1 KiB, then
//!   four classes per doubling). A slab is a 64 KiB-aligned run of 16 pages dedicated to one
//!   class; its descriptor holds `state = (class + 1) << 16 | live` and a block bitmap. A
//!   claimer first reserves a block by incrementing `live` with CAS (which fails if the slab
//!   changed class or is full), then sets one clear bit. A freer clears the bit, marks the
//!   slab in its class's *partial* bitmap, then decrements `live`; whoever takes `live` to
//!   zero may retire the slab with one CAS (`state` -> 0) and free its pages.
//!
//! Invariants (checked by [`Allocator::audit`] in tests):
//! * bits set in a slab's bitmap <= its `live` count (claimers reserve before setting, freers
//!   clear before releasing);
//! * a slab unit whose `state` is 0 has an all-zero block bitmap;
//! * every handed-out block lies inside the heap, is 64-byte aligned, and page runs are
//!   page-aligned.
//!
//! A zeroed region is a valid empty allocator. Every value read back from shared memory is
//! range-checked before use: a corrupted word yields [`Error::Corrupted`], never a panic or
//! an out-of-bounds access.

use crate::error::{Error, Result};
use crate::layout::{CLASSES, HINTS, PAGE, PAGES_PER_SLAB, SLAB};
use crate::sync::{fence, AtomicU64, Ordering};

/// Pads `T` to its own cache line.
#[repr(C, align(64))]
#[derive(Default)]
pub(crate) struct Padded<T>(pub T);

/// Slab size classes in bytes (all multiples of 64).
pub(crate) const CLASS_SIZES: [u64; CLASSES as usize] = [
    64, 128, 192, 256, 320, 384, 448, 512, 576, 640, 704, 768, 832, 896, 960, 1024, 1280, 1536,
    1792, 2048, 2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192, 10240, 12288, 14336, 16384,
];
/// The ordering of the read-modify-writes that give a block back (page bits cleared;
/// slab bit cleared, slab marked partial, reservation dropped): Release, so the next
/// owner's Acquire claim sees everything the previous owner did with the memory. The
/// mutations weaken them, for docs/verification.md.
const PAGE_FREE: Ordering = if crate::sync::mutation("free_relaxed") {
    Ordering::Relaxed
} else {
    Ordering::AcqRel
};
const SLAB_FREE: Ordering = if crate::sync::mutation("slab_free_relaxed") {
    Ordering::Relaxed
} else {
    Ordering::AcqRel
};
const SLAB_FREE_FAIL: Ordering = if crate::sync::mutation("slab_free_relaxed") {
    Ordering::Relaxed
} else {
    Ordering::Acquire
};

/// Searches before a page-run allocation reports the store full while claims by others
/// were in flight (see `Allocator::alloc_pages`).
const FULL_RETRIES: u32 = if cfg!(loom) { 4 } else { 64 };
/// Page runs at least this long (1 MiB: image and video tensors) are placed best-fit:
/// the smallest free run that holds them among the runs that start within
/// [`FIT_WINDOW`] pages of the first run that does, searched from the low-water mark.
/// Large holes stay whole for large objects (measured against TLSF in `shmstore bench`,
/// docs/benchmarks.md); the search reads one bitmap word per 256 KiB from the mark to
/// the end of the window, most of them eight at a time.
const BEST_FIT_PAGES: u64 = 256;
/// The best-fit window: 1 GiB of heap (the whole heap of a store up to 1 GiB).
const FIT_WINDOW: u64 = 1 << 18;
/// Largest request served from slabs.
pub(crate) const MAX_SMALL: u64 = 16384;
const BITMAP_WORDS: usize = 16;

/// Per-64-KiB-unit slab descriptor (136 bytes).
#[repr(C)]
#[derive(Default)]
pub(crate) struct SlabDesc {
    /// `(class + 1) << 16 | live`; 0 means "not a slab".
    state: AtomicU64,
    /// One bit per block; bit set = block in use.
    bits: [AtomicU64; BITMAP_WORDS],
}

const _: () = assert!(std::mem::size_of::<SlabDesc>() as u64 == crate::layout::SLAB_DESC_SIZE);

/// Which allocator layer a block came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BlockKind {
    /// A run of pages.
    Pages,
    /// A block of the given slab class.
    Slab(u8),
}

/// A block handed out by the allocator: a heap offset and its kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Block {
    /// Byte offset from the start of the heap.
    pub offset: u64,
    /// Usable bytes (class size, or whole pages).
    pub size: u64,
    /// Slab class or page run.
    pub kind: BlockKind,
}

impl BlockKind {
    /// Compact encoding stored in table slots: 0 = pages, c + 1 = slab class c.
    pub(crate) fn encode(self) -> u8 {
        match self {
            BlockKind::Pages => 0,
            BlockKind::Slab(c) => c + 1,
        }
    }
    /// Inverse of [`encode`](Self::encode); `None` for values no writer produces.
    pub(crate) fn decode(v: u8) -> Option<Self> {
        match v {
            0 => Some(BlockKind::Pages),
            v if (v as u64) <= CLASSES => Some(BlockKind::Slab(v - 1)),
            _ => None,
        }
    }
}

/// Size class for `size` bytes, if it is served by slabs.
pub(crate) fn class_of(size: u64) -> Option<usize> {
    if size == 0 || size > MAX_SMALL {
        return None;
    }
    if size <= 1024 {
        return Some((size.div_ceil(64) - 1) as usize);
    }
    CLASS_SIZES.iter().position(|&c| c >= size)
}

fn blocks_per_slab(class: usize) -> u64 {
    SLAB / CLASS_SIZES[class]
}

/// What the allocator holds, computed by a scan (for stats and tests).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Usage {
    /// Heap bytes.
    pub capacity: u64,
    /// Bytes in blocks handed out (slab blocks at class size, page runs at page size).
    pub used: u64,
    /// `capacity - used`.
    pub free: u64,
    /// Bytes in pages not claimed at all (usable by any size).
    pub free_pages_bytes: u64,
    /// The largest page run free right now.
    pub largest_free: u64,
    /// Slabs currently assigned to a class.
    pub slabs: u64,
}

/// The allocator's ownership words at one moment (see [`Allocator::snapshot`]).
pub(crate) struct Snapshot {
    /// Page bitmap words.
    pub pages: Vec<u64>,
    /// Per 64 KiB unit: `state` and block bitmap.
    pub slabs: Vec<(u64, [u64; BITMAP_WORDS])>,
    /// Heap pages.
    pub npages: u64,
}

/// Blocks per slab of `class` (for the sweep).
pub(crate) fn blocks_in_slab(class: usize) -> u64 {
    blocks_per_slab(class)
}

/// The allocator over its shared sections. Cheap to build; holds only borrows.
pub(crate) struct Allocator<'a> {
    pages: &'a [AtomicU64],
    npages: u64,
    slabs: &'a [SlabDesc],
    partial: &'a [AtomicU64],
    partial_words: usize,
    /// `CLASSES` hint slots (current slab + 1 per class), then the first-fit low-water
    /// mark, then the claims-begun and claims-ended counters.
    hints: &'a [Padded<AtomicU64>],
}

/// An empty slab kept as its class's current slab.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
struct IdleSlab {
    slab: usize,
    class: usize,
}

impl IdleSlab {
    fn first_page(&self) -> u64 {
        self.slab as u64 * PAGES_PER_SLAB
    }

    /// The page-bitmap word holding the slab's 16 pages (a slab never straddles words).
    fn word(&self) -> usize {
        self.slab * PAGES_PER_SLAB as usize / 64
    }

    /// The slab's pages within [`word`](Self::word).
    fn mask(&self) -> u64 {
        let first = self.slab as u64 * PAGES_PER_SLAB % 64;
        range_mask(first, first + PAGES_PER_SLAB)
    }
}

/// At most one idle slab per class, without allocating.
#[derive(Default)]
struct IdleSlabs {
    slabs: [IdleSlab; CLASSES as usize],
    len: usize,
}

impl IdleSlabs {
    fn push(&mut self, slab: IdleSlab) {
        if self.len < self.slabs.len() {
            self.slabs[self.len] = slab;
            self.len += 1;
        }
    }

    fn sort(&mut self) {
        self.slabs[..self.len].sort_unstable();
    }

    fn as_slice(&self) -> &[IdleSlab] {
        &self.slabs[..self.len]
    }
}

fn corrupted(what: impl Into<String>) -> Error {
    Error::Corrupted { what: what.into() }
}

/// Mask of bits `[lo, hi)` within one word (`0 <= lo < hi <= 64`).
fn range_mask(lo: u64, hi: u64) -> u64 {
    let upper = if hi >= 64 { u64::MAX } else { (1u64 << hi) - 1 };
    upper & !((1u64 << lo) - 1)
}

impl<'a> Allocator<'a> {
    /// Wraps the sections. Lengths must match the layout (the caller validated it).
    pub(crate) fn new(
        pages: &'a [AtomicU64],
        npages: u64,
        slabs: &'a [SlabDesc],
        partial: &'a [AtomicU64],
        hints: &'a [Padded<AtomicU64>],
    ) -> Self {
        debug_assert!(pages.len() as u64 * 64 >= npages);
        debug_assert_eq!(slabs.len() as u64, npages / PAGES_PER_SLAB);
        debug_assert_eq!(hints.len() as u64, HINTS);
        let partial_words = slabs.len().div_ceil(64);
        debug_assert_eq!(partial.len(), partial_words * CLASSES as usize);
        Self {
            pages,
            npages,
            slabs,
            partial,
            partial_words,
            hints,
        }
    }

    /// Heap bytes managed.
    pub(crate) fn capacity(&self) -> u64 {
        self.npages * PAGE
    }

    /// The largest request that could ever succeed.
    pub(crate) fn max_object(&self) -> u64 {
        self.capacity()
    }

    /// Allocates a block of at least `size` bytes (64-byte aligned; page-aligned above 16 KiB).
    pub(crate) fn alloc(&self, size: u64) -> Result<Block> {
        self.try_alloc(size)?.ok_or_else(|| self.full(size))
    }

    /// The `Full` error for a request of `size` bytes, with the free bytes in whole pages
    /// and the largest free run: a scan of the page bitmap (not of every slab), done
    /// only when `Full` is reported, never while an allocation is still being tried.
    pub(crate) fn full(&self, size: u64) -> Error {
        let u = self.usage_with(false);
        Error::Full {
            requested: size.max(1),
            free: u.free,
            largest_free: u.largest_free,
        }
    }

    /// Like [`alloc`](Self::alloc), but `None` when the store is full, without the
    /// numbers (so that retry loops, e.g. eviction, cost no scan per attempt).
    pub(crate) fn try_alloc(&self, size: u64) -> Result<Option<Block>> {
        let size = size.max(1);
        if size > self.max_object() {
            return Err(Error::TooLarge {
                requested: size,
                max: self.max_object(),
            });
        }
        let pages = || {
            let n = size.div_ceil(PAGE);
            self.alloc_pages(n, 1).map(|p| Block {
                offset: p * PAGE,
                size: n * PAGE,
                kind: BlockKind::Pages,
            })
        };
        // A small request whose class has no room and no free 64 KiB-aligned unit for a
        // new slab falls back to a page run: `Full` only when no run can hold it at all.
        let attempt = || match class_of(size) {
            Some(c) => Ok(self.alloc_small(c)?.or_else(pages)),
            None => Ok(pages()),
        };
        let mut got = attempt()?;
        if got.is_none() && self.flush_idle_slabs() {
            got = attempt()?;
        }
        Ok(got)
    }

    /// Returns a block. Fails with `Corrupted` if the block was not allocated (double free
    /// or a forged descriptor); nothing is changed in that case.
    pub(crate) fn free(&self, block: Block) -> Result<()> {
        match block.kind {
            BlockKind::Pages => {
                if block.offset % PAGE != 0 || block.size == 0 || block.size % PAGE != 0 {
                    return Err(corrupted(format!("page block {block:?} misaligned")));
                }
                let first = block.offset / PAGE;
                let n = block.size / PAGE;
                if first.checked_add(n).is_none_or(|end| end > self.npages) {
                    return Err(corrupted(format!("page block {block:?} out of bounds")));
                }
                self.free_pages(first, n)
            }
            BlockKind::Slab(c) => self.free_small(c as usize, block.offset),
        }
    }

    // ----- page runs -------------------------------------------------------------------

    fn cursor(&self) -> &AtomicU64 {
        &self.hints[CLASSES as usize].0
    }

    /// Page-run claims begun (see [`alloc_pages`](Self::alloc_pages)).
    fn claims_begun(&self) -> &AtomicU64 {
        &self.hints[CLASSES as usize + 1].0
    }

    /// Page-run claims ended, by success or rollback.
    fn claims_ended(&self) -> &AtomicU64 {
        &self.hints[CLASSES as usize + 2].0
    }

    /// Index of the first clear page bit in `[p, end)`.
    fn next_free(&self, mut p: u64, end: u64) -> Option<u64> {
        while p < end {
            let w = (p / 64) as usize;
            let bits = !self.pages[w].load(Ordering::Relaxed) & range_mask(p % 64, 64);
            if bits != 0 {
                let q = (w as u64) * 64 + bits.trailing_zeros() as u64;
                return (q < end).then_some(q);
            }
            p = (w as u64 + 1) * 64;
        }
        None
    }

    /// Index of the first set page bit in `[p, end)`.
    fn next_used(&self, mut p: u64, end: u64) -> Option<u64> {
        while p < end {
            let w = (p / 64) as usize;
            let hi = (end - (w as u64) * 64).min(64);
            let bits = self.pages[w].load(Ordering::Relaxed) & range_mask(p % 64, hi);
            if bits != 0 {
                return Some((w as u64) * 64 + bits.trailing_zeros() as u64);
            }
            p = (w as u64 + 1) * 64;
        }
        None
    }

    /// Claims `[first, first + n)` word by word in ascending order. On conflict, rolls back
    /// and returns the page index that was found taken. Counted in the claims-begun /
    /// claims-ended counters, so that a searcher can tell whether bits it skipped may
    /// have been a claim in flight.
    fn claim_run(&self, first: u64, n: u64) -> std::result::Result<(), u64> {
        self.claims_begun().fetch_add(1, Ordering::AcqRel);
        let r = self.claim_run_uncounted(first, n);
        self.claims_ended().fetch_add(1, Ordering::AcqRel);
        r
    }

    fn claim_run_uncounted(&self, first: u64, n: u64) -> std::result::Result<(), u64> {
        let end = first + n;
        let mut p = first;
        while p < end {
            let w = (p / 64) as usize;
            let hi = (end - (w as u64) * 64).min(64);
            let mask = range_mask(p % 64, hi);
            let mut cur = self.pages[w].load(Ordering::Relaxed);
            loop {
                if cur & mask != 0 {
                    let taken = (w as u64) * 64 + (cur & mask).trailing_zeros() as u64;
                    if !crate::sync::mutation("no_rollback") {
                        self.release_range(first, p);
                    }
                    return Err(taken);
                }
                match self.pages[w].compare_exchange_weak(
                    cur,
                    cur | mask,
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => break,
                    Err(now) => cur = now,
                }
            }
            p = (w as u64 + 1) * 64;
        }
        Ok(())
    }

    /// Clears bits `[first, end)` that this thread set (rollback of a partial claim).
    fn release_range(&self, first: u64, end: u64) {
        let mut p = first;
        while p < end {
            let w = (p / 64) as usize;
            let hi = (end - (w as u64) * 64).min(64);
            self.pages[w].fetch_and(!range_mask(p % 64, hi), PAGE_FREE);
            p = (w as u64 + 1) * 64;
        }
    }

    /// Finds and claims `n` pages whose first index is a multiple of `align`.
    ///
    /// Runs of [`BEST_FIT_PAGES`] or more use best fit (the smallest free run that holds
    /// them, lowest address on ties): a pass over the page bitmap from the low-water
    /// mark, cheap beside copying 1 MiB (see [`best_run`](Self::best_run)), and it keeps
    /// the large runs whole. Smaller runs use address-ordered first fit from the
    /// low-water mark, which reuses recently freed (cache-warm) memory first. Both raise
    /// the mark past the taken pages below the run they claim.
    ///
    /// A searcher cannot tell a page another process has claimed for good from one it
    /// holds for a moment in a claim that is about to roll back, so a search can come up
    /// empty while space exists. `None` ("full") is therefore only returned after a
    /// search during which no page-run claim began, ended or was in flight (at most
    /// [`FULL_RETRIES`] searches; a claimer killed mid-claim leaves its claim "in flight"
    /// for good, which costs later full searches their retries, nothing else).
    fn alloc_pages(&self, n: u64, align: u64) -> Option<u64> {
        if n == 0 || n > self.npages {
            return None;
        }
        for _ in 0..FULL_RETRIES {
            let ended_before = self.claims_ended().load(Ordering::Acquire);
            if let Some(p) = self.search_and_claim(n, align) {
                return Some(p);
            }
            // Every bit this search read was loaded before these counters (a claim whose
            // bits we saw had counted itself as begun first: its CAS released that).
            fence(Ordering::Acquire);
            let begun = self.claims_begun().load(Ordering::Acquire);
            let ended = self.claims_ended().load(Ordering::Acquire);
            let quiet = begun == ended && ended == ended_before;
            if quiet || crate::sync::mutation("full_without_retry") {
                return None;
            }
            crate::sync::spin_hint();
        }
        None
    }

    /// One search of [`alloc_pages`](Self::alloc_pages).
    fn search_and_claim(&self, n: u64, align: u64) -> Option<u64> {
        let hint_word = self.cursor();
        let hint = hint_word.load(Ordering::Relaxed).min(self.npages);
        if n >= BEST_FIT_PAGES && align == 1 {
            for _ in 0..4 {
                // From the low-water mark (below it everything is taken), then from page
                // 0 (the mark can be stale).
                // Empty slabs kept as their class's current slab count as free space
                // here, and give way to the run: left in place, they would split the
                // free space into holes no large object fits once they are retired.
                let idle = self.idle_slabs();
                let idle = idle.as_slice();
                // (The low-water mark counts them as taken: search from the lowest.)
                let from = idle.first().map_or(hint, |x| hint.min(x.first_page()));
                let (p, above_mark) = match self.best_run(n, from, idle) {
                    Some(p) => (p, p >= hint),
                    None => (self.best_run(n, 0, idle)?, false),
                };
                self.retire_idle_within(p, n, idle);
                if self.claim_run(p, n).is_ok() {
                    if above_mark {
                        // Raise the low-water mark past the pages below the run that are
                        // taken, as first fit does: a store filled with large objects is
                        // then searched from where its free space begins, not from its
                        // first page (one word per 256 KiB below the run, once). As there,
                        // a free racing with this may leave the mark too high, which costs
                        // fit quality (the search from page 0 still finds every run),
                        // never memory.
                        let mark = self.next_free(hint, p).unwrap_or(p + n);
                        if mark > hint {
                            let _ = hint_word.compare_exchange(
                                hint,
                                mark,
                                Ordering::Relaxed,
                                Ordering::Relaxed,
                            );
                        }
                    }
                    return Some(p);
                }
            }
        }
        // First fit from the hint, then (the hint may be stale) from page 0.
        for (pass, lo) in [(0, hint), (1, 0)] {
            let mut p = lo;
            let mut first_free = None;
            while let Some(f) = self.next_free(p, self.npages) {
                first_free.get_or_insert(f);
                let cand = f.div_ceil(align) * align;
                if cand + n > self.npages {
                    break;
                }
                if let Some(u) = self.next_used(cand, cand + n) {
                    p = u + 1;
                    continue;
                }
                match self.claim_run(cand, n) {
                    Ok(()) => {
                        if let (0, Some(f0)) = (pass, first_free) {
                            // Raise the low-water mark past pages that were taken. A free
                            // racing with this may leave it too high: that costs fit quality
                            // (pass 1 still finds everything), never memory.
                            let f0 = if f0 == cand { cand + n } else { f0 };
                            let _ = hint_word.compare_exchange(
                                hint,
                                f0,
                                Ordering::Relaxed,
                                Ordering::Relaxed,
                            );
                        }
                        return Some(cand);
                    }
                    Err(taken) => p = taken + 1,
                }
            }
        }
        None
    }

    /// The start of the smallest free run of at least `n` pages at or after page `from`,
    /// among the runs that start within [`FIT_WINDOW`] pages of the first one that fits
    /// (lowest address on ties). One pass over the page bitmap, one load per word and a
    /// few instructions: `n` is at least 127 pages, so a run that fits holds a whole free
    /// word, and a word with taken pages can only end a run (its free low pages) or start
    /// one (its free high pages); the runs inside it are too short to matter.
    fn best_run(&self, n: u64, from: u64, idle: &[IdleSlab]) -> Option<u64> {
        debug_assert!(n >= 127, "best fit serves runs of BEST_FIT_PAGES or more");
        let words = self.npages.div_ceil(64) as usize;
        // The next idle slab at or after word `w` (they are sorted by address).
        let mut next_idle = 0;
        let mut stop = words;
        let mut best: Option<(u64, u64)> = None;
        let mut start: Option<u64> = None;
        // A free run `[s, e)` ended: keep it if it fits better. True on an exact fit.
        let mut consider = |s: u64, e: u64, stop: &mut usize| {
            let len = e - s;
            if len < n {
                return false;
            }
            if best.is_none() {
                *stop = (s.saturating_add(FIT_WINDOW).div_ceil(64) as usize).min(words);
            }
            if best.is_none_or(|(_, l)| len < l) {
                best = Some((s, len));
            }
            len == n
        };
        let first = (from / 64) as usize;
        let mut w = first;
        // Words entirely inside the heap, for the fast paths below.
        let whole = (self.npages / 64) as usize;
        while w < stop {
            while next_idle < idle.len() && idle[next_idle].word() < w {
                next_idle += 1;
            }
            let base = w as u64 * 64;
            let mut used = self.pages[w].load(Ordering::Relaxed);
            for slab in idle[next_idle..].iter().take_while(|x| x.word() == w) {
                used &= !slab.mask();
            }
            if w >= whole {
                used |= !range_mask(0, self.npages - base); // past the heap: taken
            }
            if w == first {
                used |= range_mask(0, from % 64); // before `from`: not ours to search
            }
            if used != 0 {
                // The word's free low pages end the run in progress; its free high pages
                // start the next one.
                if let Some(s) = start.take() {
                    if consider(s, base + used.trailing_zeros() as u64, &mut stop) {
                        break;
                    }
                }
                let high_free = used.leading_zeros() as u64;
                if high_free > 0 {
                    start = Some(base + 64 - high_free);
                }
            } else {
                start.get_or_insert(base);
            }
            w += 1;
            // Inside a free run, or between runs: skip the words that follow 8 at a time
            // while they are all free (resp. all taken): most of a large heap is one or
            // the other. A word that holds an idle slab is never skipped: its bits read
            // taken but are not.
            let skippable = used == 0 || used == u64::MAX;
            if skippable || start.is_none() {
                let idle_word = idle[next_idle..]
                    .iter()
                    .map(IdleSlab::word)
                    .find(|&x| x >= w)
                    .unwrap_or(usize::MAX);
                let bound = stop.min(whole).min(idle_word);
                if skippable {
                    while w + 8 <= bound
                        && self.pages[w..w + 8]
                            .iter()
                            .all(|x| x.load(Ordering::Relaxed) == used)
                    {
                        w += 8;
                    }
                } else {
                    // Between runs, among words that each hold a taken page (a heap cut
                    // into small holes): a run that starts and ends in such words is at
                    // most 126 pages, too short. Skip 7 of every 8 of them; the 8th may
                    // start a run with its free high pages.
                    while w + 8 <= bound
                        && self.pages[w..w + 8]
                            .iter()
                            .all(|x| x.load(Ordering::Relaxed) != 0)
                    {
                        w += 7;
                    }
                }
            }
        }
        if let Some(s) = start {
            consider(s, (w as u64 * 64).min(self.npages), &mut stop);
        }
        best.map(|(f, _)| f)
    }

    /// Lowers the first-fit low-water mark to `page`.
    fn lower_hint(&self, page: u64) {
        let h = self.cursor();
        let mut cur = h.load(Ordering::Relaxed);
        while page < cur {
            match h.compare_exchange_weak(cur, page, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => break,
                Err(now) => cur = now,
            }
        }
    }

    fn free_pages(&self, first: u64, n: u64) -> Result<()> {
        // Check first so that a bad free changes nothing.
        let end = first + n;
        let mut p = first;
        while p < end {
            let w = (p / 64) as usize;
            let hi = (end - (w as u64) * 64).min(64);
            let mask = range_mask(p % 64, hi);
            if self.pages[w].load(Ordering::Relaxed) & mask != mask {
                return Err(corrupted(format!(
                    "freeing pages {first}..{end} that are not all allocated"
                )));
            }
            p = (w as u64 + 1) * 64;
        }
        self.release_range(first, end);
        self.lower_hint(first);
        Ok(())
    }

    // ----- slabs -----------------------------------------------------------------------

    fn hint(&self, class: usize) -> &AtomicU64 {
        &self.hints[class].0
    }

    fn partial_word(&self, class: usize, slab: usize) -> &AtomicU64 {
        &self.partial[class * self.partial_words + slab / 64]
    }

    fn alloc_small(&self, class: usize) -> Result<Option<Block>> {
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
    fn claim_in_slab(&self, s: usize, class: usize) -> Option<u64> {
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
    fn idle_slabs(&self) -> IdleSlabs {
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
    fn retire_idle(&self, slab: IdleSlab) -> bool {
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
    fn retire_idle_within(&self, first: u64, n: u64, idle: &[IdleSlab]) {
        for &slab in idle {
            let p = slab.first_page();
            if p < first + n && first < p + PAGES_PER_SLAB {
                self.retire_idle(slab);
            }
        }
    }

    /// Retires every class's current slab that holds no block, so its pages can join a
    /// larger run. Called when an allocation fails. Returns whether anything was freed.
    fn flush_idle_slabs(&self) -> bool {
        let mut freed = false;
        for &slab in self.idle_slabs().as_slice() {
            freed |= self.retire_idle(slab);
        }
        freed
    }

    fn claim_from_partial(&self, class: usize) -> Option<(usize, u64)> {
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
    fn release_reservation(&self, s: usize, class: usize) {
        let d = &self.slabs[s];
        let tag = (class as u64 + 1) << 16;
        let mut st = d.state.load(Ordering::Acquire);
        loop {
            if st & !0xffff != tag || st & 0xffff == 0 {
                return; // corrupted; leave it for recovery rather than underflow
            }
            match d
                .state
                .compare_exchange_weak(st, st - 1, SLAB_FREE, SLAB_FREE_FAIL)
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
    fn try_retire(&self, s: usize, class: usize) -> bool {
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

    fn free_small(&self, class: usize, offset: u64) -> Result<()> {
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
        let prev = d.bits[(idx / 64) as usize].fetch_and(!bit, SLAB_FREE);
        if prev & bit == 0 {
            return Err(corrupted(format!("double free of heap offset {offset}")));
        }
        self.partial_word(class, s)
            .fetch_or(1u64 << (s % 64), SLAB_FREE);
        self.release_reservation(s, class);
        Ok(())
    }

    // ----- inspection ------------------------------------------------------------------

    /// The largest page run that could be allocated now (idle current slabs count as
    /// free): a scan of the page bitmap only, 32 KiB per GiB of heap.
    pub(crate) fn largest_free(&self) -> u64 {
        self.usage_with(false).largest_free
    }

    /// Scans the bitmaps. Not atomic as a whole: exact only when no one allocates meanwhile.
    pub(crate) fn usage(&self) -> Usage {
        self.usage_with(true)
    }

    fn usage_with(&self, slabs_too: bool) -> Usage {
        // Empty slabs kept as a class's current slab are returned by any allocation that
        // needs their pages (`flush_idle_slabs`), so they count as free runs here.
        let idle = self.idle_slabs();
        let idle: Vec<(usize, u64)> = idle
            .as_slice()
            .iter()
            .map(|x| (x.word(), x.mask()))
            .collect();
        let mut page_bits = 0u64;
        let mut largest = 0u64;
        let mut run = 0u64;
        for (wi, word) in self.pages.iter().enumerate() {
            let base = wi as u64 * 64;
            if base >= self.npages {
                break;
            }
            let valid = (self.npages - base).min(64);
            let mut w = word.load(Ordering::Relaxed) & range_mask(0, valid);
            page_bits += w.count_ones() as u64;
            for &(iw, mask) in &idle {
                if iw == wi {
                    w &= !mask;
                }
            }
            if w == 0 {
                run += valid;
                largest = largest.max(run);
                continue;
            }
            for b in 0..valid {
                if w & (1 << b) != 0 {
                    run = 0;
                } else {
                    run += 1;
                    largest = largest.max(run);
                }
            }
        }
        let mut slabs = 0;
        let mut slab_used = 0;
        for d in self.slabs.iter().filter(|_| slabs_too) {
            let st = d.state.load(Ordering::Relaxed);
            let c = (st >> 16) as usize;
            if c == 0 || c > CLASSES as usize {
                continue;
            }
            slabs += 1;
            let ones: u64 = d
                .bits
                .iter()
                .map(|w| w.load(Ordering::Relaxed).count_ones() as u64)
                .sum();
            slab_used += ones * CLASS_SIZES[c - 1];
        }
        let capacity = self.capacity();
        let used = (page_bits * PAGE).saturating_sub(slabs * SLAB) + slab_used;
        Usage {
            capacity,
            used,
            free: capacity.saturating_sub(used),
            free_pages_bytes: capacity - page_bits * PAGE,
            largest_free: largest * PAGE,
            slabs,
        }
    }

    /// Copies the ownership words (page bitmap, slab states and block bitmaps) for the
    /// leak sweep. Not atomic as a whole: the sweep checks that nobody changed ownership
    /// while it copied (see [`crate::recovery`]).
    pub(crate) fn snapshot(&self) -> Snapshot {
        Snapshot {
            pages: self
                .pages
                .iter()
                .map(|w| w.load(Ordering::Acquire))
                .collect(),
            slabs: self
                .slabs
                .iter()
                .map(|d| {
                    let st = d.state.load(Ordering::Acquire);
                    let mut bits = [0u64; BITMAP_WORDS];
                    for (b, w) in bits.iter_mut().zip(&d.bits) {
                        *b = w.load(Ordering::Acquire);
                    }
                    (st, bits)
                })
                .collect(),
            npages: self.npages,
        }
    }

    /// Words in the page bitmap.
    pub(crate) fn page_words(&self) -> usize {
        self.pages.len()
    }

    /// Frees pages `[first, first + n)` that the leak sweep proved belong to no one.
    pub(crate) fn free_leaked_pages(&self, first: u64, n: u64) -> Result<()> {
        if first.checked_add(n).is_none_or(|end| end > self.npages) || n == 0 {
            return Err(corrupted(format!("leaked run {first}+{n} out of bounds")));
        }
        self.free_pages(first, n)
    }

    /// Clears the block bitmap of 64 KiB unit `s` if it is not a slab (state 0) but has
    /// bits set: left by a process killed inside new-slab setup, after the sweep freed
    /// the unit's pages. Takes the unit's pages first, as a new slab would, so that no
    /// setup in progress can be disturbed; skips the unit if they are taken.
    pub(crate) fn scrub_unit(&self, s: usize) -> bool {
        let Some(d) = self.slabs.get(s) else {
            return false;
        };
        let first = s as u64 * PAGES_PER_SLAB;
        if d.state.load(Ordering::Acquire) != 0 || self.claim_run(first, PAGES_PER_SLAB).is_err() {
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

    /// Test hook: what a process killed inside new-slab setup leaves (pages claimed, bit 0
    /// set, state never published). Returns whether it found pages for a slab.
    pub(crate) fn begin_slab_setup_only(&self) -> bool {
        let Some(first) = self.alloc_pages(PAGES_PER_SLAB, PAGES_PER_SLAB) else {
            return false;
        };
        self.slabs[(first / PAGES_PER_SLAB) as usize].bits[0].store(1, Ordering::Relaxed);
        true
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

    /// Checks the allocator's invariants; for tests and `shmstore` diagnostics.
    pub(crate) fn audit(&self) -> Result<()> {
        for (s, d) in self.slabs.iter().enumerate() {
            let st = d.state.load(Ordering::Relaxed);
            let c = (st >> 16) as usize;
            let ones: u64 = d
                .bits
                .iter()
                .map(|w| w.load(Ordering::Relaxed).count_ones() as u64)
                .sum();
            if c == 0 {
                if st != 0 || ones != 0 {
                    return Err(corrupted(format!(
                        "free slab unit {s} has state {st:#x}, {ones} bits"
                    )));
                }
                continue;
            }
            if c > CLASSES as usize || ones > st & 0xffff || st & 0xffff > blocks_per_slab(c - 1) {
                return Err(corrupted(format!(
                    "slab {s}: state {st:#x}, {ones} bits set"
                )));
            }
            let first = s as u64 * PAGES_PER_SLAB;
            if self.next_free(first, first + PAGES_PER_SLAB).is_some() {
                return Err(corrupted(format!(
                    "slab {s} is live but its pages are free"
                )));
            }
        }
        Ok(())
    }
}

/// An allocator over sections on the heap: for unit tests, miri and loom.
#[cfg(any(test, loom))]
pub(crate) mod testing {
    use super::*;

    /// Owns the sections an [`Allocator`] borrows.
    pub(crate) struct HeapAllocator {
        pub pages: Vec<AtomicU64>,
        pub npages: u64,
        pub slabs: Vec<SlabDesc>,
        pub partial: Vec<AtomicU64>,
        pub hints: Vec<Padded<AtomicU64>>,
    }

    impl HeapAllocator {
        /// An empty allocator over `heap_size` bytes (a multiple of 64 KiB).
        pub(crate) fn new(heap_size: u64) -> Self {
            let npages = heap_size / PAGE;
            let nslabs = (heap_size / SLAB) as usize;
            let zeros = |n: usize| (0..n).map(|_| AtomicU64::new(0)).collect::<Vec<_>>();
            Self {
                pages: zeros(npages.div_ceil(64) as usize),
                npages,
                slabs: (0..nslabs).map(|_| SlabDesc::default()).collect(),
                partial: zeros(nslabs.div_ceil(64) * CLASSES as usize),
                hints: (0..HINTS).map(|_| Padded(AtomicU64::new(0))).collect(),
            }
        }

        /// Borrows it as an [`Allocator`].
        pub(crate) fn get(&self) -> Allocator<'_> {
            Allocator::new(
                &self.pages,
                self.npages,
                &self.slabs,
                &self.partial,
                &self.hints,
            )
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::testing::HeapAllocator;
    use super::*;

    #[test]
    fn classes_are_sorted_and_aligned() {
        assert!(CLASS_SIZES.windows(2).all(|w| w[0] < w[1]));
        assert!(CLASS_SIZES.iter().all(|c| c % 64 == 0));
        // Every size natively; under miri, the sizes at and around each class boundary.
        let sizes: Vec<u64> = if cfg!(miri) {
            let edges = CLASS_SIZES.iter().flat_map(|&c| [c - 1, c, c + 1]);
            edges.filter(|&s| (1..=MAX_SMALL).contains(&s)).collect()
        } else {
            (1..=MAX_SMALL).collect()
        };
        for size in sizes {
            let c = class_of(size).unwrap();
            assert!(CLASS_SIZES[c] >= size);
            assert!(c == 0 || CLASS_SIZES[c - 1] < size);
        }
        assert_eq!(class_of(MAX_SMALL + 1), None);
    }

    #[test]
    fn small_and_large_blocks_are_aligned_and_disjoint() {
        let h = HeapAllocator::new(4 << 20);
        let a = h.get();
        let mut blocks = Vec::new();
        for size in [1, 64, 65, 1000, 4096, 16384, 16385, 100_000, 1 << 20] {
            let b = a.alloc(size).unwrap();
            assert!(b.size >= size);
            assert_eq!(b.offset % 64, 0);
            if size > MAX_SMALL {
                assert_eq!(b.offset % PAGE, 0);
            }
            assert!(b.offset + b.size <= a.capacity());
            blocks.push(b);
        }
        let mut sorted = blocks.clone();
        sorted.sort_by_key(|b| b.offset);
        for w in sorted.windows(2) {
            assert!(w[0].offset + w[0].size <= w[1].offset, "{w:?} overlap");
        }
        a.audit().unwrap();
        for b in blocks {
            a.free(b).unwrap();
        }
        a.audit().unwrap();
        let u = a.usage();
        assert_eq!(u.used, 0, "{u:?}");
    }

    #[test]
    fn large_runs_go_to_the_smallest_hole_that_holds_them() {
        let h = HeapAllocator::new(16 << 20);
        let a = h.get();
        let mib = |n: u64| n << 20;
        // Holes of 1.5, 1.1 and 2 MiB between kept blocks, then the free tail.
        let mut keep = Vec::new();
        let mut holes = Vec::new();
        for hole in [mib(3) / 2, mib(11) / 10, mib(2)] {
            keep.push(a.alloc(mib(1)).unwrap());
            holes.push(a.alloc(hole).unwrap());
        }
        keep.push(a.alloc(mib(1)).unwrap());
        let offsets: Vec<u64> = holes.iter().map(|b| b.offset).collect();
        for b in holes {
            a.free(b).unwrap();
        }
        // 1 MiB fits all three holes and the tail: the 1.1 MiB hole is the tightest.
        assert_eq!(a.alloc(mib(1)).unwrap().offset, offsets[1]);
        // 1.2 MiB: the 1.5 MiB hole; 1.8 MiB: the 2 MiB hole; 3 MiB: only the tail.
        assert_eq!(a.alloc(mib(6) / 5).unwrap().offset, offsets[0]);
        assert_eq!(a.alloc(mib(9) / 5).unwrap().offset, offsets[2]);
        let tail = a.alloc(mib(3)).unwrap();
        assert!(tail.offset > keep[3].offset, "{tail:?}");
        a.audit().unwrap();
    }

    #[test]
    fn full_reports_numbers_and_too_large_is_immediate() {
        let h = HeapAllocator::new(256 << 10);
        let a = h.get();
        let b = a.alloc(200 << 10).unwrap();
        match a.alloc(100 << 10) {
            Err(Error::Full {
                requested,
                free,
                largest_free,
            }) => {
                assert_eq!(requested, 100 << 10);
                assert_eq!(free, 56 << 10);
                assert_eq!(largest_free, 56 << 10);
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(a.alloc(1 << 20), Err(Error::TooLarge { .. })));
        a.free(b).unwrap();
        assert!(a.alloc(256 << 10).is_ok());
    }

    #[test]
    fn double_free_and_forged_blocks_are_rejected() {
        let h = HeapAllocator::new(1 << 20);
        let a = h.get();
        let b = a.alloc(100).unwrap();
        let keep = a.alloc(100).unwrap();
        a.free(b).unwrap();
        assert!(matches!(a.free(b), Err(Error::Corrupted { .. })));
        let p = a.alloc(50_000).unwrap();
        a.free(p).unwrap();
        assert!(a.free(p).is_err());
        let forged = Block {
            offset: 1 << 30,
            size: PAGE,
            kind: BlockKind::Pages,
        };
        assert!(a.free(forged).is_err());
        let forged = Block {
            offset: 3,
            size: 64,
            kind: BlockKind::Slab(0),
        };
        assert!(a.free(forged).is_err());
        a.free(keep).unwrap();
        a.audit().unwrap();
    }

    /// The rule `best_run` implements, page by page: scan from `from`; the first run of
    /// at least `n` pages ends the window at its start + `FIT_WINDOW`, rounded up to a
    /// whole word (a run still open there is cut there); the smallest run of at least `n`
    /// wins, the lowest on ties, and the first exact fit ends the search.
    fn best_run_page_by_page(free: &[bool], n: u64, from: u64) -> Option<u64> {
        let npages = free.len() as u64;
        let mut stop = npages;
        let mut best: Option<(u64, u64)> = None;
        let mut start = None;
        let mut p = from;
        while p < stop {
            if free[p as usize] {
                start.get_or_insert(p);
            } else if let Some(s) = start.take() {
                if p - s >= n {
                    if best.is_none() {
                        stop = ((s + FIT_WINDOW).div_ceil(64) * 64).min(npages);
                    }
                    if best.is_none_or(|(_, l)| p - s < l) {
                        best = Some((s, p - s));
                    }
                    if p - s == n {
                        return Some(s);
                    }
                }
            }
            p += 1;
        }
        if let Some(s) = start {
            let e = stop.min(npages);
            if e - s >= n && best.is_none_or(|(_, l)| e - s < l) {
                best = Some((s, e - s));
            }
        }
        best.map(|(s, _)| s)
    }

    #[test]
    fn best_fit_finds_the_run_a_page_by_page_scan_finds() {
        // A heap of 2 GiB and a bit (the window is 1 GiB, the last word partial), with
        // random free and taken runs from 1 page to 100 000, and idle slabs among them.
        // Under miri, which checks the accesses rather than the result, 16 MiB and one
        // round.
        let npages = if cfg!(miri) {
            4096 + 37
        } else {
            (1u64 << 19) + 37
        };
        let mut h = HeapAllocator::new(npages / PAGES_PER_SLAB * SLAB);
        h.npages = npages;
        h.pages = (0..npages.div_ceil(64))
            .map(|_| AtomicU64::new(0))
            .collect();
        let a = h.get();
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |m: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % m
        };
        for round in 0..if cfg!(miri) { 1 } else { 12 } {
            for w in a.pages {
                w.store(0, Ordering::Relaxed);
            }
            let mut free = vec![true; npages as usize];
            let mut p = 0;
            let mut taken = round % 2 == 0;
            while p < npages {
                let len = match next(100) {
                    0..=59 => 1 + next(100),
                    60..=94 => 100 + next(2000),
                    95..=98 => 2000 + next(20_000),
                    _ => 20_000 + next(100_000),
                };
                let end = (p + len).min(npages);
                if taken {
                    for q in p..end {
                        free[q as usize] = false;
                        a.pages[(q / 64) as usize].fetch_or(1 << (q % 64), Ordering::Relaxed);
                    }
                }
                taken = !taken;
                p = end;
            }
            // Some wholly taken slab units count as idle (free for best fit).
            let mut idle = IdleSlabs::default();
            for _ in 0..8 {
                let s = next(npages / PAGES_PER_SLAB) as usize;
                let unit = s as u64 * PAGES_PER_SLAB..(s as u64 + 1) * PAGES_PER_SLAB;
                if unit.clone().all(|q| !free[q as usize])
                    && !idle.as_slice().iter().any(|x| x.slab == s)
                {
                    idle.push(IdleSlab { slab: s, class: 0 });
                    unit.for_each(|q| free[q as usize] = true);
                }
            }
            idle.sort();
            let sizes: &[u64] = if cfg!(miri) {
                &[256, 1000]
            } else {
                &[127, 256, 257, 300, 1000, 4096, 70_000]
            };
            for &n in sizes {
                for from in [0, next(npages), next(npages / 4)] {
                    assert_eq!(
                        a.best_run(n, from, idle.as_slice()),
                        best_run_page_by_page(&free, n, from),
                        "round {round}, n {n}, from {from}"
                    );
                }
            }
        }
    }

    #[test]
    fn best_fit_raises_the_low_water_mark_as_it_fills() {
        let h = HeapAllocator::new(16 << 20);
        let a = h.get();
        let runs: Vec<_> = (0..12).map(|_| a.alloc(1 << 20).unwrap()).collect();
        // Packed from the bottom: the mark is where the free space begins.
        assert_eq!(runs[11].offset, 11 << 20);
        assert_eq!(a.cursor().load(Ordering::Relaxed), 12 << 8);
        // A free below it lowers it; the run that fills the hole raises it past itself.
        a.free(runs[3]).unwrap();
        assert_eq!(a.cursor().load(Ordering::Relaxed), 3 << 8);
        let again = a.alloc(1 << 20).unwrap();
        assert_eq!(again.offset, 3 << 20);
        assert_eq!(a.cursor().load(Ordering::Relaxed), 4 << 8);
        // With a hole below that the run does not fill, the mark stops at the hole.
        a.free(runs[6]).unwrap();
        let big = a.alloc(2 << 20).unwrap();
        assert_eq!(big.offset, 12 << 20);
        assert_eq!(a.cursor().load(Ordering::Relaxed), 6 << 8);
        a.audit().unwrap();
    }

    #[test]
    fn large_runs_take_the_place_of_idle_slabs() {
        // Small objects of four classes, spread over the bottom of the heap between
        // 1 MiB runs, then freed: each class keeps its (now empty) current slab there.
        let h = HeapAllocator::new(16 << 20);
        let a = h.get();
        let mut small = Vec::new();
        let mut spacers = Vec::new();
        for size in [64, 1024, 4096, 16384] {
            small.push(a.alloc(size).unwrap());
            spacers.push(a.alloc(1 << 20).unwrap());
        }
        small.drain(..).for_each(|b| a.free(b).unwrap());
        spacers.drain(..).for_each(|b| a.free(b).unwrap());
        assert_eq!(a.usage().slabs, 4, "the current slabs stay while empty");
        // Fill with 2 MiB runs: the idle slabs give way instead of splitting the heap
        // into holes no run fits, so all 8 fit (without that, 7).
        let runs: Vec<_> = (0..8)
            .map(|_| a.alloc(2 << 20))
            .collect::<Result<_>>()
            .unwrap();
        assert_eq!(a.usage().slabs, 0);
        assert_eq!(a.usage().free, 0);
        runs.into_iter().for_each(|b| a.free(b).unwrap());
        a.audit().unwrap();
    }

    #[test]
    fn empty_slabs_return_their_pages() {
        let h = HeapAllocator::new(1 << 20);
        let a = h.get();
        let mut v: Vec<_> = (0..2000).map(|_| a.alloc(64).unwrap()).collect();
        assert!(a.usage().slabs >= 2);
        v.drain(..).for_each(|b| a.free(b).unwrap());
        let u = a.usage();
        assert_eq!(u.used, 0);
        assert!(u.slabs <= 1, "only the current slab may stay: {u:?}");
        // A request that needs the retained slab's pages flushes it: no memory is stranded.
        let all = a.alloc(a.capacity()).unwrap();
        assert_eq!(a.usage().slabs, 0);
        a.free(all).unwrap();
        a.audit().unwrap();
    }

    #[test]
    fn page_runs_coalesce() {
        let h = HeapAllocator::new(1 << 20);
        let a = h.get();
        let blocks: Vec<_> = (0..16).map(|_| a.alloc(64 << 10).unwrap()).collect();
        assert!(a.alloc(PAGE).is_err());
        for b in blocks.iter().step_by(2) {
            a.free(*b).unwrap();
        }
        assert_eq!(a.usage().largest_free, 64 << 10);
        for b in blocks.iter().skip(1).step_by(2) {
            a.free(*b).unwrap();
        }
        assert_eq!(a.usage().largest_free, 1 << 20);
    }

    #[test]
    fn threads_allocate_and_free_concurrently() {
        let h = std::sync::Arc::new(HeapAllocator::new(8 << 20));
        let threads: Vec<_> = (0..if cfg!(miri) { 2 } else { 4 })
            .map(|t| {
                let h = h.clone();
                std::thread::spawn(move || {
                    let a = h.get();
                    let mut live = Vec::new();
                    let mut x = t as u64 + 1;
                    let iters = if cfg!(miri) { 300 } else { 20_000u64 };
                    for i in 0..iters {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let size = if i % 50 == 0 {
                            20_000 + x % 100_000
                        } else {
                            1 + x % 3000
                        };
                        if let Ok(b) = a.alloc(size) {
                            live.push(b);
                        }
                        if live.len() > 40 {
                            let k = (x as usize) % live.len();
                            a.free(live.swap_remove(k)).unwrap();
                        }
                    }
                    live
                })
            })
            .collect();
        let mut all: Vec<Block> = threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect();
        all.sort_by_key(|b| b.offset);
        for w in all.windows(2) {
            assert!(w[0].offset + w[0].size <= w[1].offset, "{w:?} overlap");
        }
        let a = h.get();
        a.audit().unwrap();
        let used: u64 = all.iter().map(|b| b.size).sum();
        assert_eq!(a.usage().used, used);
        for b in all {
            a.free(b).unwrap();
        }
        assert_eq!(a.usage().used, 0);
    }
}
