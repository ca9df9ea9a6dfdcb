//! What happens when the store is full: CLOCK eviction and back-pressure.
//!
//! Owns the store-wide globals (the clock hand, the eviction count, the "space freed" wait
//! bucket). Invariants:
//!
//! * eviction only ever removes a **sealed, unpinned, evictable** object, through the same
//!   DELETED -> last unpin -> free path as `delete` (see [`crate::table::Table::evict_step`]),
//!   so a pinned object is skipped, never waited for: no head-of-line blocking;
//! * the hand sweeps the table at most twice per allocation (once to clear referenced
//!   bits, once to evict), so a store whose objects are all pinned fails with `Full`
//!   after a bounded amount of work; a request for a page run adds, per victim, the
//!   widening of its hole by address (work in proportion to the request, through the
//!   [`PageOwners`] hints) and, once, a scan of the table for the cheapest window
//!   ([`evict_window`]), so that it evicts about its own size, not the whole store;
//! * every freed block bumps the space bucket, so a creator waiting for space wakes at
//!   once; a pin dropped in an evicting store nudges it too (best effort, and waiters
//!   re-check at least every [`SPACE_RECHECK`] regardless).

use crate::alloc::{class_of, Allocator, Block, BlockKind};
use crate::client::{ClientHeader, Counters, COUNTERS};
use crate::error::{Error, Result};
use crate::layout::{PAGE, PAGES_PER_SLAB, SLAB};
use crate::sync::{AtomicU32, AtomicU64, Ordering};
use crate::table::{Entry, Table, WaitBucket, SEALED};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// How often a creator waiting for space re-checks even without a wake.
pub(crate) const SPACE_RECHECK: Duration = Duration::from_millis(10);

/// What `create` does when no block is free.
///
/// ```
/// use shmstore::{StoreConfig, WhenFull};
/// let cache = StoreConfig { when_full: WhenFull::Evict, ..StoreConfig::with_capacity(1 << 20) };
/// assert_eq!(cache.when_full, WhenFull::Evict);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WhenFull {
    /// Return [`Error::Full`] (or wait, with `create_object_wait`).
    #[default]
    Fail,
    /// Evict sealed, unpinned objects in least-recently-used order (CLOCK) until the
    /// request fits; objects marked with [`crate::Creation::set_evictable`]`(false)` stay.
    Evict,
}

/// Store-wide mutable globals (512 bytes at `Superblock::globals_offset`).
#[repr(C)]
#[derive(Default)]
pub(crate) struct Globals {
    /// Next table slot the CLOCK hand looks at.
    pub clock_hand: AtomicU64,
    /// Unused (evictions are counted per client, `Counters::evicted`).
    pub evictions: AtomicU64,
    /// Dead clients whose slots recovery returned.
    pub recovered_clients: AtomicU64,
    /// Bytes recovery and the leak sweep gave back to the allocator.
    pub reclaimed_bytes: AtomicU64,
    /// Recoveries that found a client dead inside an allocator step: the leak sweep owes
    /// them a pass (see `crate::recovery`).
    pub sweeps_owed: AtomicU64,
    /// `client + 1` of the process running the leak sweep, 0 if none.
    pub sweeper: AtomicU64,
    /// Blocks the leak sweep found belonging to no one and freed.
    pub leaked_blocks_freed: AtomicU64,
    _pad: [u64; 1],
    /// Bumped whenever a block is freed; creators waiting for space sleep on it.
    pub space: WaitBucket,
    /// The counters of every client that has left (folded in when its slot is released).
    pub totals: Counters,
    _pad2: [u64; 1],
    /// Corrections the leak sweep found, as wrapping deltas: used bytes, sealed objects,
    /// objects being created, objects draining (see `crate::recovery`).
    pub correction: [AtomicU64; 4],
    /// Heap bytes the creator rebuilt as 2 MiB pages (`HugePages::Auto`): a count that only
    /// grows, read for `Stats::huge_page_bytes` (clamped to the heap; it informs, nothing
    /// depends on it).
    pub huge_bytes: AtomicU64,
    _pad3: [u64; 27],
}

const _: () = assert!(std::mem::size_of::<Globals>() as u64 == crate::layout::GLOBALS_SIZE);

/// What the counters say the store holds (see `crate::client::Counters`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Census {
    /// Bytes in blocks named by objects (creating, sealed or draining).
    pub used: u64,
    /// Sealed objects.
    pub objects: u64,
    /// Objects being created.
    pub creating: u64,
    /// Deleted objects whose blocks wait for their last pin.
    pub draining: u64,
    /// Pins held.
    pub pins: u64,
    /// Every counter summed (totals of departed clients plus every slot's), in
    /// `Counters::all` order.
    pub sums: [u64; COUNTERS],
    /// `used`, `objects`, `creating` and `draining` before they are clamped at zero
    /// (wrapping): what a correction must start from. A count a dead client left off
    /// can take a difference below zero (recovery counts the abort and the free of a
    /// creation whose insert its dead creator never counted), and correcting the clamped
    /// figure would leave the counters off by just that much.
    pub raw: [u64; 4],
}

impl Globals {
    /// Adds up the totals of departed clients and every slot's counters, plus the
    /// sweep's corrections: O(clients). A racy snapshot, like every figure of a store
    /// others are changing; exact whenever nobody is.
    pub(crate) fn census(&self, headers: &[ClientHeader]) -> Census {
        let mut sums = [0u64; COUNTERS];
        let mut add = |c: &Counters| {
            for (s, a) in sums.iter_mut().zip(c.all()) {
                *s = s.wrapping_add(a.load(Ordering::Relaxed));
            }
        };
        add(&self.totals);
        for h in headers {
            add(&h.counters);
        }
        let [inserted, sealed, aborted, deleted, freed, bytes_in, bytes_out, .., pins] = sums;
        let corr = |k: usize| self.correction[k].load(Ordering::Relaxed);
        let clamp = |v: u64| if (v as i64) < 0 { 0 } else { v };
        let raw = [
            bytes_in.wrapping_sub(bytes_out).wrapping_add(corr(0)),
            sealed.wrapping_sub(deleted).wrapping_add(corr(1)),
            inserted
                .wrapping_sub(sealed)
                .wrapping_sub(aborted)
                .wrapping_add(corr(2)),
            aborted
                .wrapping_add(deleted)
                .wrapping_sub(freed)
                .wrapping_add(corr(3)),
        ];
        Census {
            used: clamp(raw[0]),
            objects: clamp(raw[1]),
            creating: clamp(raw[2]),
            draining: clamp(raw[3]),
            pins: clamp(pins),
            sums,
            raw,
        }
    }

    /// Makes the census say `exact` (what a quiet snapshot found): adds the differences
    /// to the corrections. Only for a moment when no count can change (the leak sweep's).
    pub(crate) fn correct(&self, found: &Census, exact: &Census) {
        let exact = [exact.used, exact.objects, exact.creating, exact.draining];
        for (k, (f, e)) in found.raw.into_iter().zip(exact).enumerate() {
            if f != e {
                self.correction[k].fetch_add(e.wrapping_sub(f), Ordering::Relaxed);
            }
        }
    }
}

/// Which table slot owns each page run, recorded at the run's first and last page as
/// `slot + 1` (0: none recorded). The creator writes both after its entry is in the table;
/// nothing clears them. Only a hint, so that eviction can find an object by address: a
/// reader acts on a slot only if that slot's entry, read at one generation, is a page run
/// that starts (or ends) exactly there.
pub(crate) struct PageOwners<'a>(pub &'a [AtomicU32]);

impl PageOwners<'_> {
    /// Records `slot` as the owner of page run `block` (slab blocks are not recorded).
    pub(crate) fn record(&self, block: &Block, slot: usize) {
        if block.kind != BlockKind::Pages || block.size == 0 {
            return;
        }
        let first = block.offset / PAGE;
        let last = (block.offset + block.size) / PAGE - 1;
        let v = u32::try_from(slot + 1).unwrap_or(0);
        for p in [first, last] {
            if let Some(w) = self.0.get(p as usize) {
                w.store(v, Ordering::Relaxed);
            }
        }
    }

    /// The slot recorded at `page`, if any.
    fn at(&self, page: u64) -> Option<usize> {
        let v = self
            .0
            .get(usize::try_from(page).ok()?)?
            .load(Ordering::Relaxed);
        (v != 0).then(|| v as usize - 1)
    }
}

/// Runs the CLOCK hand until `alloc` succeeds (`Some`) or two sweeps found nothing to
/// evict (`None`: still full).
///
/// An evicted object's block is freed by the table (through the store's reclaimer) as
/// soon as no pin counter holds it, which is at once unless a get raced the hand.
///
/// A request for a page run that still does not fit after a victim left its hole does
/// not go on evicting cold objects all over the heap until two of their holes happen to
/// touch (a 12 MiB put into a store full of 75 KiB items took 6,633 of 6,830 of them that
/// way): it widens the victim's hole instead, evicting the objects next to it by address
/// until the hole fits the request ([`widen`]). Victims in slabs, which widening cannot
/// start from, lead once per request to a scan for the cheapest window
/// ([`evict_window`]). Those neighbours go whether or not they were used lately, which is
/// the price of evicting about `need` bytes rather than the whole store.
pub(crate) fn evict_until_fits(
    globals: &Globals,
    table: &Table<'_>,
    alloc: &Allocator<'_>,
    owners: &PageOwners<'_>,
    need: u64,
    counters: &Counters,
) -> Result<Option<Block>> {
    let n = table.capacity();
    // A page-run request, as the allocator sees it (it serves 0 bytes from the 64-byte
    // class).
    let runs = class_of(need.max(1)).is_none();
    // Bytes the hand took for this request; past `need` without a fit, one scan of the
    // table looks for the cheapest window instead ([`evict_window`]).
    let (mut taken, mut scanned) = (0u64, false);
    for _ in 0..2 * n {
        let i = globals.clock_hand.fetch_add(1, Ordering::Relaxed) % n;
        let Some(victim) = table.evict_step(i as usize, None)? else {
            continue;
        };
        count_eviction(counters, &victim);
        // No numbers per attempt: a scan each would make eviction O(capacity).
        if let Some(b) = alloc.try_alloc(need)? {
            return Ok(Some(b));
        }
        if !runs {
            continue;
        }
        let Ok((block, _)) = victim.block(alloc.capacity()) else {
            continue; // a corrupted entry: its hole is not ours to reason about
        };
        taken = taken.saturating_add(block.size);
        let widened =
            block.kind == BlockKind::Pages && widen(table, alloc, owners, block, need, counters)?;
        let windowed = !widened && !scanned && taken >= need && {
            scanned = true;
            evict_window(table, alloc, need, counters)?
        };
        if widened || windowed {
            if let Some(b) = alloc.try_alloc(need)? {
                return Ok(Some(b));
            }
        }
    }
    alloc.try_alloc(need)
}

/// Counts one evicted object, and its payload bytes, in this client's counters.
fn count_eviction(counters: &Counters, gone: &Entry) {
    counters.evicted.fetch_add(1, Ordering::Relaxed);
    counters
        .evicted_bytes
        .fetch_add(gone.len, Ordering::Relaxed);
}

/// A stretch of the heap in address order, for [`evict_window`]: pages `[first, end)`,
/// the bytes of the objects in it and their slots and generations, or `blocked` if it
/// cannot be freed now.
struct Stretch {
    first: u64,
    end: u64,
    bytes: u64,
    blocked: bool,
    objects: Vec<(usize, u32)>,
}

impl Stretch {
    fn free(first: u64, end: u64, blocked: bool) -> Stretch {
        Stretch {
            first,
            end,
            bytes: 0,
            blocked,
            objects: Vec::new(),
        }
    }
}

/// The last resort of a page-run request that CLOCK and widening did not make room for,
/// once the hand has taken `need` bytes: typically a store full of small objects, whose
/// slabs the page owners do not describe. One scan of the table lays the heap out in
/// address order (page runs; slabs, freeable only if every live block in them is a
/// sealed object eviction may take now; free pages between them), finds the contiguous
/// window of at least `need` bytes that evicts the fewest bytes (the lowest on a tie),
/// and evicts it. Costs one pass over the table's slots, at most once per request,
/// against evicting the whole store. Returns whether it evicted the whole window.
fn evict_window(
    table: &Table<'_>,
    alloc: &Allocator<'_>,
    need: u64,
    counters: &Counters,
) -> Result<bool> {
    let heap = alloc.capacity();
    let pages = heap / PAGE;
    let mut stretches: Vec<Stretch> = Vec::new();
    let mut slabs: BTreeMap<u64, Stretch> = BTreeMap::new();
    table.scan(|i, ctl, _, entry| {
        let Ok((block, _)) = entry.block(heap) else {
            return;
        };
        let ok = ctl.state() == SEALED && table.evictable_now(i, ctl.gen());
        let st = match block.kind {
            BlockKind::Pages => {
                stretches.push(Stretch::free(
                    block.offset / PAGE,
                    (block.offset + block.size) / PAGE,
                    false,
                ));
                stretches.last_mut().expect("just pushed")
            }
            BlockKind::Slab(_) => {
                let s = block.offset / SLAB;
                slabs.entry(s).or_insert_with(|| {
                    Stretch::free(s * PAGES_PER_SLAB, (s + 1) * PAGES_PER_SLAB, false)
                })
            }
        };
        st.bytes += block.size;
        st.blocked |= !ok;
        st.objects.push((i, ctl.gen()));
    });
    for (s, mut st) in slabs {
        // Every live block must be one of those found (claims in flight count as live).
        st.blocked |= alloc.slab_live(s) != Some(st.objects.len() as u64);
        stretches.push(st);
    }
    stretches.sort_unstable_by_key(|s| s.first);
    // Tile the heap: pages between two stretches are free, or blocks the table does not
    // name (being set up, leaked, idle slabs), which are a barrier.
    let mut tiles: Vec<Stretch> = Vec::with_capacity(stretches.len() * 2 + 1);
    let mut at = 0;
    for st in stretches {
        if st.first < at || st.end > pages {
            return Ok(false); // overlapping entries: the table changed under the scan
        }
        if st.first > at {
            let free = alloc.free_extent(at, at).1 >= st.first;
            tiles.push(Stretch::free(at, st.first, !free));
        }
        at = st.end;
        tiles.push(st);
    }
    if at < pages {
        tiles.push(Stretch::free(
            at,
            pages,
            alloc.free_extent(at, at).1 < pages,
        ));
    }
    // The cheapest run of unblocked tiles spanning `need` bytes (two pointers).
    let need_pages = need.div_ceil(PAGE).max(1);
    let (mut lo, mut span, mut cost) = (0, 0u64, 0u64);
    let mut best: Option<(u64, usize, usize)> = None;
    for hi in 0..tiles.len() {
        if tiles[hi].blocked {
            (lo, span, cost) = (hi + 1, 0, 0);
            continue;
        }
        span += tiles[hi].end - tiles[hi].first;
        cost += tiles[hi].bytes;
        while lo <= hi && span >= need_pages {
            if best.is_none_or(|(c, _, _)| cost < c) {
                best = Some((cost, lo, hi));
            }
            span -= tiles[lo].end - tiles[lo].first;
            cost -= tiles[lo].bytes;
            lo += 1;
        }
    }
    let Some((_, lo, hi)) = best else {
        return Ok(false);
    };
    for tile in &tiles[lo..=hi] {
        for &(slot, gen) in &tile.objects {
            let Some(gone) = table.evict_step(slot, Some(gen))? else {
                return Ok(false);
            };
            count_eviction(counters, &gone);
        }
    }
    Ok(true)
}

/// Widens the hole `victim` left to a run of free pages of at least `need` bytes, if the
/// objects around it allow: plans first (free pages, and page-run objects that are
/// sealed, evictable and unpinned now, found through [`PageOwners`] and checked against
/// their entries), taking at each step the neighbour above or below that completes the
/// hole, or else the smaller one, and evicts the planned objects only if the plan reaches
/// `need`. Returns whether it evicted them all; an object pinned or deleted
/// between plan and eviction ends it early (the caller's allocation then finds what it
/// finds). A plan blocked on both sides (a pinned, unevictable or still-being-written
/// neighbour, or a slab) evicts nothing.
fn widen(
    table: &Table<'_>,
    alloc: &Allocator<'_>,
    owners: &PageOwners<'_>,
    victim: Block,
    need: u64,
    counters: &Counters,
) -> Result<bool> {
    let heap_pages = alloc.capacity() / PAGE;
    let need_pages = need.div_ceil(PAGE).max(1);
    let first = victim.offset / PAGE;
    let (mut lo, mut hi) = alloc.free_extent(first, first + victim.size / PAGE);
    // The neighbour that ends the free run at `hi` (above) or starts it at `lo` (below),
    // if eviction may take it now: its slot, generation, pages, and the edge of the free
    // run once it is gone (free pages beyond it included).
    let above = |hi: u64| -> Option<Step> {
        let s = Step::of(
            table,
            owners,
            alloc.capacity(),
            (hi < heap_pages).then_some(hi)?,
        )?;
        (s.first == hi).then(|| Step {
            edge: alloc.free_extent(s.end, s.end).1,
            ..s
        })
    };
    let below = |lo: u64| -> Option<Step> {
        let s = Step::of(table, owners, alloc.capacity(), lo.checked_sub(1)?)?;
        (s.end == lo).then(|| Step {
            edge: alloc.free_extent(s.first, s.first).0,
            ..s
        })
    };
    let (mut up, mut down) = (above(hi), below(lo));
    let mut plan = Vec::new();
    while hi - lo < need_pages {
        // The side that completes the hole with fewer pages; else the smaller neighbour:
        // a large neighbour taken to gain a few pages is data lost for nothing.
        let go_up = match (&up, &down) {
            (None, None) => return Ok(false),
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (Some(u), Some(d)) => {
                let (u_done, d_done) = (u.edge - lo >= need_pages, hi - d.edge >= need_pages);
                if u_done != d_done {
                    u_done
                } else {
                    u.end - u.first <= d.end - d.first
                }
            }
        };
        if go_up {
            let s = up.take().expect("chosen side has a step");
            plan.push((s.slot, s.gen));
            hi = s.edge;
            up = above(hi);
        } else {
            let s = down.take().expect("chosen side has a step");
            plan.push((s.slot, s.gen));
            lo = s.edge;
            down = below(lo);
        }
    }
    for (slot, gen) in plan {
        let Some(gone) = table.evict_step(slot, Some(gen))? else {
            return Ok(false);
        };
        count_eviction(counters, &gone);
    }
    Ok(true)
}

/// One neighbour [`widen`] may evict.
struct Step {
    slot: usize,
    gen: u32,
    /// Its pages, `[first, end)`.
    first: u64,
    end: u64,
    /// The free run's edge on this side once it is gone.
    edge: u64,
}

impl Step {
    /// The page run recorded as owning `page` (its first or last page), if its slot's
    /// entry says so at the generation read and eviction may take it now.
    fn of(table: &Table<'_>, owners: &PageOwners<'_>, heap: u64, page: u64) -> Option<Step> {
        let slot = owners.at(page)?;
        let (ctl, _, entry) = table.read_slot(slot)?;
        let (block, _) = entry.block(heap).ok()?;
        let (first, end) = (block.offset / PAGE, (block.offset + block.size) / PAGE);
        let owns = block.kind == BlockKind::Pages && (first == page || end == page + 1);
        (owns && table.evictable_now(slot, ctl.gen())).then_some(Step {
            slot,
            gen: ctl.gen(),
            first,
            end,
            edge: 0,
        })
    }
}

/// Retries `attempt` while it fails with `Full`, sleeping on the space bucket between
/// tries, until `deadline`. Returns the last `Full` when time runs out.
pub(crate) fn wait_for_space<T>(
    globals: &Globals,
    deadline: Instant,
    mut attempt: impl FnMut() -> Result<T>,
) -> Result<T> {
    match attempt() {
        Err(Error::Full { .. }) => {}
        other => return other,
    }
    let space = &globals.space;
    let mut seq = space.register();
    let result = loop {
        match attempt() {
            Err(e @ Error::Full { .. }) => {
                let now = Instant::now();
                if now >= deadline {
                    break Err(e);
                }
                space.sleep(seq, (deadline - now).min(SPACE_RECHECK));
                seq = space.sequence();
            }
            other => break other,
        }
    };
    space.unregister();
    result
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::alloc::testing::HeapAllocator;
    use crate::client::ClientHeader;
    use crate::table::testing::{HeapTable, HEAP_STRIDE};
    use crate::table::{Pin, Reclaimer, Sections, SlotRef};
    use crate::ObjectId;
    use std::sync::Mutex;

    /// 64 pages: four 64 KiB units.
    const HEAP: u64 = 256 << 10;

    /// A heap-backed store core for eviction: a table whose reclaimer gives each freed
    /// block back to the allocator (as the store's does) and records it, the page
    /// owners, the globals and one client's counters.
    struct Heap {
        table: HeapTable,
        alloc: HeapAllocator,
        owners: Vec<AtomicU32>,
        globals: Globals,
        counters: Counters,
        freed: Mutex<Vec<Entry>>,
    }

    impl Reclaimer for Heap {
        fn reclaim(&self, table: &Table<'_>, r: SlotRef, e: Entry) {
            let (block, _) = e.block(HEAP).unwrap();
            self.alloc.get().free(block).unwrap();
            self.freed.lock().unwrap().push(e);
            table.release(r);
        }
    }

    impl Heap {
        fn new() -> Self {
            Heap {
                table: HeapTable::new(64),
                alloc: HeapAllocator::new(HEAP),
                owners: (0..HEAP / PAGE).map(|_| AtomicU32::new(0)).collect(),
                globals: Globals::default(),
                counters: Counters::default(),
                freed: Mutex::default(),
            }
        }

        fn table(&self) -> Table<'_> {
            let t = &self.table;
            let sections = Sections {
                slots: &t.slots,
                buckets: &t.buckets,
                waits: &t.waits,
                pins: &t.pins,
                stride: HEAP_STRIDE,
            };
            Table::new(sections, 0, self)
        }

        /// Allocates `size` bytes and seals object `k` over them, recording a page run's
        /// owner as the store does.
        fn put(&self, k: &str, size: u64) -> (Block, SlotRef) {
            let b = self.alloc.get().alloc(size).unwrap();
            let r = self.name(k, b);
            self.table().seal(&ObjectId::of_key(k), r).unwrap();
            (b, r)
        }

        /// Inserts an entry `k` naming block `b`, and records its owner; not sealed.
        fn name(&self, k: &str, b: Block) -> SlotRef {
            let e = Entry {
                offset: b.offset,
                len: b.size,
                meta_len: 0,
                kind: b.kind.encode(),
                creator: 0,
            };
            let r = self.table().insert(&ObjectId::of_key(k), &e).unwrap();
            PageOwners(&self.owners).record(&b, r.index as usize);
            r
        }

        fn pin(&self, k: &str) {
            let got = self.table().pin(&ObjectId::of_key(k)).unwrap();
            assert!(matches!(got, Pin::Pinned(..)), "{k}: {got:?}");
        }

        /// Takes `k` out as an earlier victim did: deleted and its block freed.
        fn evict_by_hand(&self, k: &str) -> Block {
            let e = self.table().delete(&ObjectId::of_key(k)).unwrap().unwrap();
            e.block(HEAP).unwrap().0
        }

        /// The offsets of the blocks freed so far, in page units, sorted.
        fn freed_pages(&self) -> Vec<u64> {
            let mut v: Vec<u64> = self
                .freed
                .lock()
                .unwrap()
                .iter()
                .map(|e| e.offset / PAGE)
                .collect();
            v.sort_unstable();
            v
        }

        fn widen(&self, victim: Block, need_pages: u64) -> bool {
            let before = self.freed.lock().unwrap().len();
            let t = self.table();
            let owners = PageOwners(&self.owners);
            let widened = widen(
                &t,
                &self.alloc.get(),
                &owners,
                victim,
                need_pages * PAGE,
                &self.counters,
            )
            .unwrap();
            assert_eq!(
                self.counters.evicted.load(Ordering::Relaxed),
                (self.freed.lock().unwrap().len() - before) as u64
            );
            widened
        }

        fn evict_window(&self, need_pages: u64) -> bool {
            evict_window(
                &self.table(),
                &self.alloc.get(),
                need_pages * PAGE,
                &self.counters,
            )
            .unwrap()
        }
    }

    /// Six page runs over the whole heap: R0 at pages 0..8, R1 8..16, R2 16..24, R3
    /// 24..40, R4 40..48, R5 48..64.
    fn six_runs() -> Heap {
        let h = Heap::new();
        for (k, pages) in [
            ("R0", 8),
            ("R1", 8),
            ("R2", 8),
            ("R3", 16),
            ("R4", 8),
            ("R5", 16),
        ] {
            h.put(k, pages * PAGE);
        }
        assert_eq!(h.alloc.get().usage().free, 0);
        h
    }

    /// Page owners record a run's slot at its first and last page and nowhere else; a
    /// slab block, an empty block and a page past the heap record nothing.
    #[test]
    fn page_owners_name_a_runs_slot_at_its_first_and_last_page() {
        let owners: Vec<AtomicU32> = (0..64).map(|_| AtomicU32::new(0)).collect();
        let o = PageOwners(&owners);
        let run = |first: u64, pages: u64| Block {
            offset: first * PAGE,
            size: pages * PAGE,
            kind: BlockKind::Pages,
        };
        o.record(&run(3, 5), 9);
        o.record(&run(20, 1), 4);
        o.record(
            &Block {
                size: 0,
                ..run(30, 1)
            },
            2,
        );
        o.record(
            &Block {
                kind: BlockKind::Slab(0),
                ..run(40, 1)
            },
            2,
        );
        o.record(&run(62, 4), 7);
        let named: Vec<(u64, usize)> = (0..70).filter_map(|p| Some((p, o.at(p)?))).collect();
        assert_eq!(named, [(3, 9), (7, 9), (20, 4), (62, 7)]);
    }

    /// Widening takes, at each step, the neighbour that completes the hole, or else the
    /// smaller one (the upper on a tie), and plans before it evicts.
    #[test]
    fn widening_takes_the_neighbour_that_completes_the_hole_else_the_smaller() {
        // (the victim, the pages needed, the pages of the runs evicted, victim included)
        let cases: [(&str, u64, &[u64], &str); 8] = [
            ("R1", 24, &[0, 8, 16], "R2 (8 = 8: up), then R0 (< R3)"),
            ("R2", 24, &[16, 24], "R3 completes it, R1 would not"),
            ("R0", 24, &[0, 8, 16], "at the heap's bottom, only upwards"),
            ("R5", 24, &[40, 48], "at the heap's top, only downwards"),
            ("R1", 16, &[8, 16], "both complete it, 8 = 8: up"),
            ("R2", 16, &[8, 16], "both complete it: R1, smaller than R3"),
            ("R2", 32, &[8, 16, 24], "neither does: R1, smaller, then R3"),
            ("R3", 16, &[24], "the hole fits already"),
        ];
        for (victim, need, freed, why) in cases {
            let h = six_runs();
            let hole = h.evict_by_hand(victim);
            assert!(h.widen(hole, need), "{victim}'s hole to {need}: {why}");
            assert_eq!(h.freed_pages(), freed, "{victim}'s hole to {need}: {why}");
        }
    }

    /// A pinned or never-evictable neighbour ends widening on its side; blocked on both
    /// sides short of the need, nothing is evicted.
    #[test]
    fn widening_blocked_on_both_sides_evicts_nothing() {
        let h = six_runs();
        h.pin("R2");
        let victim = h.evict_by_hand("R1");
        assert!(!h.widen(victim, 24), "R0 gives 16 pages, R2 is pinned");
        assert_eq!(h.freed_pages(), [8]);
        // Past the pinned R2 nothing is looked at: R1's hole plus R0 is all there is.
        assert!(h.widen(victim, 16));
        assert_eq!(h.freed_pages(), [0, 8]);
    }

    /// Page owners are hints nothing clears: one that names a slot whose entry is not a
    /// page run starting or ending at that page (the slot reused since, for a slab block
    /// or another run) is not a neighbour.
    #[test]
    fn widening_ignores_stale_page_owners() {
        // R0 0..8, R1 8..16, a slab at 16..32 (s1 at page 16, s2 at 18), R3 32..48,
        // R4 48..64.
        let h = Heap::new();
        h.put("R0", 8 * PAGE);
        h.put("R1", 8 * PAGE);
        let (s1, r1) = h.put("s1", 8 << 10);
        let (s2, r2) = h.put("s2", 8 << 10);
        assert_eq!((s1.offset / PAGE, s2.offset / PAGE), (16, 18));
        h.put("R3", 16 * PAGE);
        let (_, r4) = h.put("R4", 16 * PAGE);
        let victim = h.evict_by_hand("R1");
        // Stale hints above R1's hole, at page 16: the slab block after the one there, and
        // R4's run (which neither starts nor ends at 16). R0 alone cannot complete 24.
        for slot in [r2.index, r4.index] {
            h.owners[16].store(slot + 1, Ordering::Relaxed);
            assert!(!h.widen(victim, 24), "hint at 16 names slot {slot}");
            assert_eq!(h.freed_pages(), [8], "hint at 16 names slot {slot}");
        }
        // The slab block that starts at page 16: taken for a 2-page run, it would be the
        // smaller neighbour completing a hole of 10. R0 goes instead.
        h.owners[16].store(r1.index + 1, Ordering::Relaxed);
        assert!(h.widen(victim, 10));
        assert_eq!(h.freed_pages(), [0, 8]);
    }

    /// The hand's victim, then its hole widened, then the allocation: exactly the three
    /// objects the request needs go, and the run is where they were.
    #[test]
    fn eviction_widens_the_hands_first_victim_and_allocates_in_its_hole() {
        let h = six_runs();
        let t = h.table();
        // One pass of the hand clears every referenced bit; then it points at R1.
        for i in 0..64 {
            assert_eq!(t.evict_step(i, None).unwrap(), None);
        }
        let r1 = t.pin(&ObjectId::of_key("R1")).unwrap();
        let Pin::Pinned(r, _) = r1 else {
            panic!("{r1:?}")
        };
        t.unpin(r).unwrap();
        // (The pin set R1's referenced bit again; clear it with one more step there.)
        assert_eq!(t.evict_step(r.index as usize, None).unwrap(), None);
        h.globals
            .clock_hand
            .store(r.index as u64, Ordering::Relaxed);
        let owners = PageOwners(&h.owners);
        let got = evict_until_fits(
            &h.globals,
            &t,
            &h.alloc.get(),
            &owners,
            24 * PAGE,
            &h.counters,
        )
        .unwrap()
        .unwrap();
        assert_eq!((got.offset, got.size), (0, 24 * PAGE));
        assert_eq!(h.freed_pages(), [0, 8, 16]);
        assert_eq!(h.counters.evicted.load(Ordering::Relaxed), 3);
        assert_eq!(h.counters.evicted_bytes.load(Ordering::Relaxed), 24 * PAGE);
    }

    /// The heap `evict_window`'s tests lay out (pages): A 0..8, B 8..16 (pinned), a slab
    /// of two 8 KiB objects at 16..32, C 32..40, free 40..45, E 45..64.
    fn window_heap() -> Heap {
        let h = Heap::new();
        h.put("A", 8 * PAGE);
        h.put("B", 8 * PAGE);
        h.pin("B");
        let (s1, _) = h.put("s1", 8 << 10);
        let (s2, _) = h.put("s2", 8 << 10);
        assert_eq!((s1.offset / PAGE, s2.offset / PAGE), (16, 18));
        h.put("C", 8 * PAGE);
        let (gap, _) = h.put("gap", 5 * PAGE);
        let (e, _) = h.put("E", 19 * PAGE);
        assert_eq!((gap.offset / PAGE, e.offset / PAGE), (40, 45));
        h.evict_by_hand("gap");
        h.freed.lock().unwrap().clear();
        h
    }

    /// The window that evicts the fewest bytes, among runs of tiles no pinned object, no
    /// partly held slab and no unnamed block interrupts, with free pages counted in.
    #[test]
    fn the_window_evicted_is_the_cheapest_that_spans_the_request() {
        // 24 pages: the slab and C (48 KiB) rather than the free pages and E (76 KiB).
        let h = window_heap();
        assert!(h.evict_window(24));
        assert_eq!(h.freed_pages(), [16, 18, 32]);
        // 32 pages: C, the free pages and E (108 KiB) rather than the slab too.
        let h = window_heap();
        assert!(h.evict_window(32));
        assert_eq!(h.freed_pages(), [32, 45]);
        // A pinned block in the slab: the window starts past it, and shrinks from the
        // left to the free pages and E.
        let h = window_heap();
        h.pin("s1");
        assert!(h.evict_window(24));
        assert_eq!(h.freed_pages(), [45]);
        // A block of the slab that no entry names (a claim in flight): the same.
        let h = window_heap();
        let extra = h.alloc.get().alloc(8 << 10).unwrap();
        assert_eq!(extra.offset / SLAB, 1);
        assert!(h.evict_window(24));
        assert_eq!(h.freed_pages(), [45]);
        // Free pages at the top of the heap cost nothing: nothing is evicted.
        let h = window_heap();
        h.evict_by_hand("E");
        h.freed.lock().unwrap().clear();
        assert!(h.evict_window(24));
        assert_eq!(h.freed_pages(), []);
        // Unnamed pages at the top are a barrier too: the slab and C, not C and the top.
        let unnamed = h.alloc.get().alloc(20 * PAGE).unwrap();
        assert_eq!(unnamed.offset / PAGE, 40);
        assert!(h.evict_window(24));
        assert_eq!(h.freed_pages(), [16, 18, 32]);
    }

    /// Pages no entry names are a barrier; so are entries that overlap (the table
    /// changed under the scan); ties go to the lowest window.
    #[test]
    fn the_window_never_spans_unnamed_pages_or_overlapping_entries() {
        let h = window_heap();
        let unnamed = h.alloc.get().alloc(5 * PAGE).unwrap();
        assert_eq!(unnamed.offset / PAGE, 40);
        assert!(!h.evict_window(32), "C and E are only 27 pages");
        assert_eq!(h.freed_pages(), []);
        let h = window_heap();
        // An entry naming C's pages again: the scan's picture does not add up.
        let c = h.table().pin(&ObjectId::of_key("C")).unwrap();
        let Pin::Pinned(r, e) = c else {
            panic!("{c:?}")
        };
        h.table().unpin(r).unwrap();
        let twin = e.block(HEAP).unwrap().0;
        let tr = h.name("C twin", twin);
        h.table().seal(&ObjectId::of_key("C twin"), tr).unwrap();
        assert!(!h.evict_window(24));
        assert_eq!(h.freed_pages(), []);
        // Two windows of 32 KiB each: the lower goes.
        let h = Heap::new();
        h.put("X1", 8 * PAGE);
        h.put("P1", 8 * PAGE);
        h.put("X2", 8 * PAGE);
        h.put("P2", 40 * PAGE);
        h.pin("P1");
        h.pin("P2");
        assert!(h.evict_window(8));
        assert_eq!(h.freed_pages(), [0]);
    }

    /// A creator that died after inserting its object but before counting the insert:
    /// recovery counts the abort and the free, so the bytes freed exceed the bytes in.
    /// The sweep's correction must make the census exact, not just its clamped figure.
    #[test]
    fn a_correction_starts_from_counts_below_zero() {
        let g = Globals::default();
        let headers: Vec<ClientHeader> = (0..2).map(|_| ClientHeader::default()).collect();
        let live = &headers[0].counters;
        // One sealed object of 4096 bytes, counted in full.
        live.inserted.store(1, Ordering::Relaxed);
        live.sealed.store(1, Ordering::Relaxed);
        live.bytes_in.store(4096, Ordering::Relaxed);
        // The recoverer's counts of the dead creator's object: aborted and freed, never
        // counted in.
        let recoverer = &headers[1].counters;
        recoverer.aborted.store(1, Ordering::Relaxed);
        recoverer.freed.store(1, Ordering::Relaxed);
        recoverer.bytes_out.store(8192, Ordering::Relaxed);
        let found = g.census(&headers);
        assert_eq!((found.used, found.creating), (0, 0), "clamped for display");
        let exact = Census {
            used: 4096,
            objects: 1,
            ..Census::default()
        };
        g.correct(&found, &exact);
        let now = g.census(&headers);
        assert_eq!(
            (now.used, now.objects, now.creating, now.draining),
            (4096, 1, 0, 0)
        );
    }
}
