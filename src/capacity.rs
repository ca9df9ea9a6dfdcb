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
/// window of at least `need` bytes that evicts the fewest bytes, and evicts it. Costs
/// one pass over the table's slots, at most once per request, against evicting the
/// whole store. Returns whether it evicted the whole window.
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
    use crate::client::ClientHeader;

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
