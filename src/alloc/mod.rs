//! The lock-free segregated-fit allocator that lives inside the region.
//!
//! Two layers, both made of bitmaps in shared memory and changed only by single-word
//! atomic read-modify-writes, so a process stopped or killed at any instruction never blocks
//! another (see docs/design.md, "Allocator"):
//!
//! * [`pages`]: the heap cut into 4 KiB pages, one bit each; runs of pages for objects
//!   over 16 KiB (first fit, best fit from 1 MiB) and for slabs;
//! * [`slab`]: 32 size classes up to 16 KiB, each served from 64 KiB slabs with a block
//!   bitmap and a `live` count per slab.
//!
//! This file holds what both share: the [`Allocator`] over its shared sections, the
//! [`Block`] it hands out, the entry points ([`Allocator::try_alloc`],
//! [`Allocator::free`]), and observation ([`Allocator::usage`], [`Allocator::snapshot`],
//! [`Allocator::audit`]).
//!
//! Invariants (checked by [`Allocator::audit`] in tests):
//! * a page word with no taken page has its summary bit clear, and a summary word marked
//!   full (second level) is all ones, once no free is in progress (see [`pages`]);
//! * bits set in a slab's bitmap <= its `live` count (claimers reserve before setting, freers
//!   clear before releasing);
//! * a slab unit whose `state` is 0 has an all-zero block bitmap;
//! * every handed-out block lies inside the heap, is 64-byte aligned, and page runs are
//!   page-aligned.
//!
//! A zeroed region is a valid empty allocator. Every value read back from shared memory is
//! range-checked before use: a corrupted word yields [`Error::Corrupted`], never a panic or
//! an out-of-bounds access.

mod pages;
mod slab;

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
#[inline(always)]
fn page_free() -> Ordering {
    crate::sync::weakened_by("free_relaxed", Ordering::AcqRel, Ordering::Relaxed)
}
/// The ordering of the page summary's second-level RMWs: a claim that fills a summary word
/// must see, after marking it full, a free that emptied a word of it and cleared the mark
/// just before (mutation `group_relaxed`, docs/verification.md).
#[inline(always)]
fn group_mark() -> Ordering {
    crate::sync::weakened_by("group_relaxed", Ordering::AcqRel, Ordering::Relaxed)
}
#[inline(always)]
fn slab_free() -> Ordering {
    crate::sync::weakened_by("slab_free_relaxed", Ordering::AcqRel, Ordering::Relaxed)
}
#[inline(always)]
fn slab_free_fail() -> Ordering {
    crate::sync::weakened_by("slab_free_relaxed", Ordering::Acquire, Ordering::Relaxed)
}

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
    /// The page summary: one bit per page-bitmap word, set while that word holds a
    /// taken page (see [`pages`] for when it may lag).
    summary: &'a [AtomicU64],
    /// Its second level: one bit per summary word, set while that word is all ones.
    groups: &'a [AtomicU64],
    npages: u64,
    slabs: &'a [SlabDesc],
    partial: &'a [AtomicU64],
    partial_words: usize,
    /// `CLASSES` hint slots (current slab + 1 per class), then the first-fit low-water
    /// mark, then the claims-begun and claims-ended counters.
    hints: &'a [Padded<AtomicU64>],
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
        summary: &'a [AtomicU64],
        npages: u64,
        slabs: &'a [SlabDesc],
        partial: &'a [AtomicU64],
        hints: &'a [Padded<AtomicU64>],
    ) -> Self {
        debug_assert!(pages.len() as u64 * 64 >= npages);
        debug_assert_eq!(
            summary.len() as u64,
            crate::layout::summary_words(pages.len() as u64 * 64)
        );
        let (summary, groups) = summary.split_at(pages.len().div_ceil(64));
        debug_assert_eq!(slabs.len() as u64, npages / PAGES_PER_SLAB);
        debug_assert_eq!(hints.len() as u64, HINTS);
        let partial_words = slabs.len().div_ceil(64);
        debug_assert_eq!(partial.len(), partial_words * CLASSES as usize);
        Self {
            pages,
            summary,
            groups,
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

    /// The `live` count of the slab in 64 KiB unit `s` (blocks taken or reserved), or
    /// `None` if the unit is not a slab now. A racy look, for planning.
    pub(crate) fn slab_live(&self, s: u64) -> Option<u64> {
        let st = self
            .slabs
            .get(usize::try_from(s).ok()?)?
            .state
            .load(Ordering::Relaxed);
        (st >> 16 != 0).then_some(st & 0xffff)
    }

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

    /// Checks the allocator's invariants; for tests and `shmstore` diagnostics.
    pub(crate) fn audit(&self) -> Result<()> {
        if let Some(what) = self.summary_hides() {
            return Err(corrupted(what));
        }
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
        pub summary: Vec<AtomicU64>,
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
                summary: zeros(crate::layout::summary_words(npages) as usize),
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
                &self.summary,
                self.npages,
                &self.slabs,
                &self.partial,
                &self.hints,
            )
        }

        /// Slab `s`'s state word, `(class + 1) << 16 | live` (0: not a slab).
        pub(crate) fn slab_state(&self, s: usize) -> u64 {
            self.slabs[s].state.load(Ordering::SeqCst)
        }

        /// Leaves slab `s` (retired, its pages free) as a freer of class `class` killed
        /// just before its retiring CAS would have: its pages held, its state the
        /// class's, nothing live in it.
        pub(crate) fn leave_unretired(&self, s: usize, class: usize) {
            let a = self.get();
            a.claim_run(s as u64 * PAGES_PER_SLAB, PAGES_PER_SLAB)
                .expect("the slab's pages are free");
            self.slabs[s]
                .state
                .store((class as u64 + 1) << 16, Ordering::SeqCst);
        }

        /// Sets every block bit of unit `s`, which is no slab: what a process killed inside
        /// new-slab setup leaves (with a sweeper of an earlier version killed after
        /// freeing the unit's pages, before clearing them).
        pub(crate) fn leave_stray_bits(&self, s: usize) {
            for w in &self.slabs[s].bits {
                w.store(!0, Ordering::SeqCst);
            }
        }

        /// Adds a reservation to slab `s` that no bit stands for, as a claimer killed
        /// between reserving and setting its bit leaves.
        pub(crate) fn leave_dead_reservation(&self, s: usize) {
            self.slabs[s].state.fetch_add(1, Ordering::SeqCst);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests;
