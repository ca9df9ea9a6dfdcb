//! The page layer: best fit against a page-by-page reference scan, the low-water mark,
//! idle slabs giving way to large runs, the page summary and its repair, coalescing,
//! the bitmap scans, and the leak sweep's free of a run.

use super::super::slab::{IdleSlab, IdleSlabs};
use super::super::testing::HeapAllocator;
use super::super::*;
use super::xorshift;

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

/// The leak sweep's free of a run nothing names: a run that ends at the top of the
/// heap is freed; an empty run, one past the end and one whose end overflows are
/// refused with `Corrupted` and change nothing.
#[test]
fn a_leaked_run_up_to_the_heaps_end_is_freed_and_one_past_it_refused() {
    let h = HeapAllocator::new(1 << 20);
    let a = h.get();
    let npages = (1 << 20) / PAGE;
    // A process died holding the top 10 pages, with nothing naming them.
    a.claim_run(npages - 10, 10).unwrap();
    for (first, n) in [(npages - 10, 11), (npages - 10, 0), (u64::MAX - 4, 10)] {
        assert!(
            matches!(a.free_leaked_pages(first, n), Err(Error::Corrupted { .. })),
            "run {first}+{n}"
        );
    }
    assert_eq!(a.usage().free, (npages - 10) * PAGE);
    a.free_leaked_pages(npages - 10, 10).unwrap();
    assert_eq!(a.usage().free, npages * PAGE);
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
    // random free and taken runs from 1 page to 100 000, idle slabs among them, and a
    // page summary (both levels) that lags behind on one word in eight.
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
    h.summary = (0..crate::layout::summary_words(npages))
        .map(|_| AtomicU64::new(0))
        .collect();
    let a = h.get();
    let mut rng = xorshift(0x9e37_79b9_7f4a_7c15);
    let mut next = move |m: u64| rng() % m;
    for round in 0..if cfg!(miri) { 1 } else { 12 } {
        for w in a.pages.iter().chain(a.summary).chain(a.groups) {
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
        // The page summary as claims and frees leave it: a bit for every word with a
        // taken page, except that a claim racing with the free that emptied its word
        // may leave some clear (which costs the search a load, never a run).
        for (w, word) in a.pages.iter().enumerate() {
            if word.load(Ordering::Relaxed) != 0 && next(8) != 0 {
                a.summary[w / 64].fetch_or(1 << (w % 64), Ordering::Relaxed);
            }
        }
        // Its second level likewise: a bit for every full summary word, but one in eight.
        for (g, word) in a.summary.iter().enumerate() {
            if word.load(Ordering::Relaxed) == u64::MAX && next(8) != 0 {
                a.groups[g / 64].fetch_or(1 << (g % 64), Ordering::Relaxed);
            }
        }
        // Some wholly taken slab units count as idle (free for best fit): 8 anywhere,
        // and up to 16 at the edge of a free run, where they lengthen it.
        let mut idle = IdleSlabs::default();
        let (mut inside, mut edges) = (0, 0);
        for _ in 0..4000 {
            let s = next(npages / PAGES_PER_SLAB) as usize;
            let unit = s as u64 * PAGES_PER_SLAB..(s as u64 + 1) * PAGES_PER_SLAB;
            let edge = (unit.start > 0 && free[unit.start as usize - 1])
                || (unit.end < npages && free[unit.end as usize]);
            if unit.clone().all(|q| !free[q as usize])
                && !idle.as_slice().iter().any(|x| x.slab == s)
                && (if edge { edges < 16 } else { inside < 8 })
            {
                *(if edge { &mut edges } else { &mut inside }) += 1;
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

/// First fit raises the low-water mark past the pages it finds taken and the run it
/// claims, and never past a free page: an aligned run (a slab) that leaves free pages
/// below it stops the mark at them, so the next small run takes the lowest free pages.
#[test]
fn first_fit_never_raises_the_low_water_mark_past_a_free_page() {
    let h = HeapAllocator::new(1 << 20);
    let a = h.get();
    let mark = || a.cursor().load(Ordering::Relaxed);
    assert_eq!(a.alloc_pages(3, 1), Some(0));
    assert_eq!(mark(), 3);
    // A slab's 16 pages start at a multiple of 16: pages 3-15 stay free, and the mark
    // stays at the first of them.
    assert_eq!(a.alloc_pages(PAGES_PER_SLAB, PAGES_PER_SLAB), Some(16));
    assert_eq!(mark(), 3);
    assert_eq!(a.alloc_pages(2, 1), Some(3));
    assert_eq!(mark(), 5);
    assert_eq!(a.alloc_pages(4, 1), Some(5));
    assert_eq!(mark(), 9);
    assert_eq!(a.alloc_pages(1, 1), Some(9));
    // A run that does not fit the hole at the mark goes above the slab; the mark stays
    // at the hole.
    assert_eq!(a.alloc_pages(8, 1), Some(32));
    assert_eq!(mark(), 10);
    assert_eq!(a.alloc_pages(6, 1), Some(10));
    assert_eq!(mark(), 16);
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

/// A large run retires the idle slabs inside the pages it takes and keeps the others:
/// best fit counts both idle slabs below as free, picks the hole between them, and only
/// the slab at the hole's start gives way.
#[test]
fn a_large_run_retires_only_the_idle_slabs_it_covers() {
    let h = HeapAllocator::new(16 << 20);
    let a = h.get();
    let pages = |b: &Block| (b.offset / PAGE, (b.offset + b.size) / PAGE);
    let r0 = a.alloc(1 << 20).unwrap();
    let s0 = a.alloc(64).unwrap();
    let r1 = a.alloc(1 << 20).unwrap();
    let s1 = a.alloc(1024).unwrap();
    let r2 = a.alloc(1 << 20).unwrap();
    assert_eq!(
        [&r0, &s0, &r1, &s1, &r2].map(|b| pages(b).0),
        [0, 256, 272, 528, 544]
    );
    // Pages 256-271 and 528-543: two idle slabs (current, empty); 272-527 free.
    a.free(s0).unwrap();
    a.free(s1).unwrap();
    a.free(r1).unwrap();
    assert_eq!(a.usage().slabs, 2);
    // 272 pages: the hole with the first idle slab (256-527) holds them, the smallest
    // run that does with both idle slabs counted free (256-543).
    let run = a.alloc(272 * PAGE).unwrap();
    assert_eq!(pages(&run), (256, 528));
    assert_eq!(a.usage().slabs, 1, "the slab at 528 stays, idle");
    for b in [run, r0, r2] {
        a.free(b).unwrap();
    }
    a.audit().unwrap();
}

#[test]
fn best_fit_reads_the_words_of_idle_slabs_the_summary_marks_taken() {
    // A 16 MiB heap, every page taken (and the summary says so) but word 11; words 9 and
    // 10 are eight idle slabs. The only run of 192 pages is words 9-11: the search must
    // not pass over words 9 and 10 on the summary's word.
    let h = HeapAllocator::new(16 << 20);
    let a = h.get();
    for (w, word) in a.pages.iter().enumerate() {
        if w != 11 {
            word.store(u64::MAX, Ordering::Relaxed);
            a.summary[w / 64].fetch_or(1 << (w % 64), Ordering::Relaxed);
        }
    }
    // (Word 11 is empty, so the one summary word is not full.)
    assert_eq!(a.groups[0].load(Ordering::Relaxed), 0);
    let mut idle = IdleSlabs::default();
    for slab in 36..44 {
        idle.push(IdleSlab { slab, class: 0 });
    }
    assert_eq!(a.best_run(192, 0, idle.as_slice()), Some(9 * 64));
    assert_eq!(a.best_run(193, 0, idle.as_slice()), None);
}

#[test]
fn best_fit_searches_to_the_end_of_a_heap_whose_summary_fills_its_last_group_word() {
    // 1 GiB (16 MiB under miri): the summary's words end exactly at the end of a
    // second-level word, the edge where a search that runs off the end must stop. The
    // heap is cut into 256 KiB runs (one page word each), all taken but the first word
    // of the last 16 MiB: the search passes over the full groups, finds that word too
    // short, and must end there.
    let size: u64 = if cfg!(miri) { 16 << 20 } else { 1 << 30 };
    let h = HeapAllocator::new(size);
    let a = h.get();
    let mut runs: Vec<_> = (0..size / (256 << 10))
        .map(|_| a.alloc(256 << 10).unwrap())
        .collect();
    let last_group = runs.len() - 64;
    a.free(runs.remove(last_group)).unwrap();
    assert_eq!(a.try_alloc(1 << 20).unwrap(), None);
    // Free the next three words too: now 1 MiB fits there, and nowhere else.
    for _ in 0..3 {
        a.free(runs.remove(last_group)).unwrap();
    }
    let got = a.alloc(1 << 20).unwrap();
    assert_eq!(got.offset, size - (16 << 20));
    a.free(got).unwrap();
    runs.into_iter().for_each(|b| a.free(b).unwrap());
    a.audit().unwrap();
}

#[test]
fn the_page_summary_follows_claims_frees_and_a_dead_freer() {
    let h = HeapAllocator::new(16 << 20);
    let a = h.get();
    let word_bit = |w: usize| a.summary[w / 64].load(Ordering::Relaxed) >> (w % 64) & 1;
    // A run over words 0-4 (the last one partly), then one that shares word 4.
    let big = a.alloc(300 * PAGE).unwrap();
    let small = a.alloc(20 * PAGE).unwrap();
    assert_eq!(big.offset, 0);
    assert_eq!(small.offset, 300 * PAGE);
    assert_eq!((0..6).map(word_bit).collect::<Vec<_>>(), [1, 1, 1, 1, 1, 0]);
    // Freeing the first leaves word 4 held by the second.
    a.free(big).unwrap();
    assert_eq!((0..6).map(word_bit).collect::<Vec<_>>(), [0, 0, 0, 0, 1, 0]);
    a.free(small).unwrap();
    assert_eq!(word_bit(4), 0);
    a.audit().unwrap();
    // A freer killed between emptying words and clearing their bits hides them from
    // best fit: here all but the first, which a small block holds, so 15 MiB do not
    // fit. The audit names the first hidden word, and the repair (run by the leak sweep
    // owed for that death) gives them back.
    let first = a.alloc(256 << 10).unwrap();
    let rest = a.alloc((16 << 20) - (256 << 10)).unwrap();
    // Every word holds a taken page: the summary word is full, and marked so.
    assert_eq!(a.summary[0].load(Ordering::Relaxed), u64::MAX);
    assert_eq!(a.groups[0].load(Ordering::Relaxed), 1);
    a.free(rest).unwrap();
    assert_eq!(a.groups[0].load(Ordering::Relaxed), 0);
    // (The freer died before it lowered the low-water mark, too.)
    a.summary[0].store(u64::MAX, Ordering::Relaxed);
    a.groups[0].store(1, Ordering::Relaxed);
    a.cursor().store(4096, Ordering::Relaxed);
    assert!(a.audit().unwrap_err().to_string().contains("page word 1 "));
    assert_eq!(a.try_alloc(15 << 20).unwrap(), None);
    assert_eq!(a.repair_summary(), 63);
    a.audit().unwrap();
    a.free(a.alloc(15 << 20).unwrap()).unwrap();
    a.free(first).unwrap();
    a.free(a.alloc(16 << 20).unwrap()).unwrap();
}

/// The summary's second level: a freer killed after clearing a bit of a full summary
/// word but before clearing that word's group bit leaves the group marked full. The
/// audit names it; the repair clears that group bit and no other (a group marked full
/// that is full stays marked).
#[test]
fn the_repair_clears_a_group_bit_a_dead_freer_left_and_no_other() {
    // 40 MiB: summary words 0 and 1 whole (16 MiB each), word 2 half.
    let h = HeapAllocator::new(40 << 20);
    let a = h.get();
    let low = a.alloc(16 << 20).unwrap();
    let high = a.alloc(16 << 20).unwrap();
    assert_eq!((low.offset, high.offset), (0, 16 << 20));
    assert!(a.group_full(0) && a.group_full(1) && !a.group_full(2));
    a.free(high).unwrap();
    assert!(a.group_full(0) && !a.group_full(1));
    // The dead freer's leftover: summary word 1 is empty, its group bit still set.
    a.groups[0].fetch_or(1 << 1, Ordering::Relaxed);
    assert_eq!(
        a.summary_hides().as_deref(),
        Some("summary word 1 is marked full but is not")
    );
    assert!(a.audit().is_err());
    assert_eq!(a.repair_summary(), 1);
    assert!(a.group_full(0) && !a.group_full(1) && !a.group_full(2));
    assert_eq!(a.summary_hides(), None);
    a.audit().unwrap();
    let again = a.alloc(16 << 20).unwrap();
    assert_eq!(again.offset, 16 << 20);
    // Nothing hidden: a second repair finds nothing to clear.
    assert_eq!(a.repair_summary(), 0);
    a.free(again).unwrap();
    a.free(low).unwrap();
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
fn free_extent_reaches_across_free_pages_on_both_sides_and_stops_at_taken_ones() {
    // 200 pages: four runs of 50; free the 2nd and 3rd: one free extent of 100 pages,
    // crossing the bitmap words 64 and 128 apart.
    let h = HeapAllocator::new(200 * PAGE);
    let a = h.get();
    let runs: Vec<Block> = (0..4).map(|_| a.alloc(50 * PAGE).unwrap()).collect();
    let mut offsets: Vec<u64> = runs.iter().map(|b| b.offset / PAGE).collect();
    offsets.sort_unstable();
    assert_eq!(offsets, [0, 50, 100, 150]);
    let at = |p: u64| *runs.iter().find(|b| b.offset == p * PAGE).unwrap();
    a.free(at(50)).unwrap();
    a.free(at(100)).unwrap();
    assert_eq!(a.free_extent(50, 100), (50, 150));
    assert_eq!(a.free_extent(100, 150), (50, 150));
    assert_eq!(a.free_extent(70, 70), (50, 150));
    // Taken pages stop it: from the start of the run at 150 (free below), and at the
    // bottom of the run at 0 (taken above).
    assert_eq!(a.free_extent(150, 150), (50, 150));
    assert_eq!(a.free_extent(0, 0), (0, 0));
    a.free(at(0)).unwrap();
    assert_eq!(
        a.free_extent(60, 61),
        (0, 150),
        "down to the bottom of the heap"
    );
    a.free(at(150)).unwrap();
    assert_eq!(
        a.free_extent(199, 200),
        (0, 200),
        "up to the top of the heap"
    );
    // Out-of-range questions are clamped, never a panic.
    assert_eq!(a.free_extent(500, 900), (0, 200));
}

/// The bitmap scans under best fit and `free_extent`, against a page-by-page look at
/// the same bits, for ranges that start and end anywhere in a word, with taken pages
/// just outside them (what a scan that reads a word whole must mask away).
#[test]
fn next_used_and_prev_used_see_what_a_page_by_page_look_sees() {
    let npages = 5 * 64 - 20;
    let h = HeapAllocator::new(npages * PAGE);
    let a = h.get();
    let mut rng = xorshift(0x9e37_79b9_7f4a_7c15);
    let mut taken = vec![false; npages as usize];
    for (w, word) in a.pages.iter().enumerate() {
        let x = rng();
        // Sparse words, so that most ranges hold a taken page only near their edges.
        let bits = x & (x >> 3) & (x >> 5);
        word.store(bits, Ordering::Relaxed);
        for b in 0..64 {
            if let Some(t) = taken.get_mut(w * 64 + b) {
                *t = bits >> b & 1 == 1;
            }
        }
    }
    let step = if cfg!(miri) { 13 } else { 1 };
    for lo in (0..=npages).step_by(step) {
        for hi in (lo..=npages).step_by(step) {
            let used = |p: &u64| taken[*p as usize];
            assert_eq!(
                a.next_used(lo, hi),
                (lo..hi).find(used),
                "next_used({lo}, {hi})"
            );
            assert_eq!(
                a.prev_used(lo, hi),
                (lo..hi).rev().find(used),
                "prev_used({lo}, {hi})"
            );
            let free = |p: &u64| !taken[*p as usize];
            assert_eq!(
                a.next_free(lo, hi),
                (lo..hi).find(free),
                "next_free({lo}, {hi})"
            );
        }
    }
}

/// A claim that meets a taken page says which one (the search goes on past it) and
/// gives back the pages it had claimed below it.
#[test]
fn a_claim_that_meets_a_taken_page_names_it_and_rolls_back() {
    let h = HeapAllocator::new(256 * PAGE);
    let a = h.get();
    for taken in [70, 64, 127, 200] {
        a.pages[(taken / 64) as usize].store(1 << (taken % 64), Ordering::Relaxed);
        assert_eq!(a.claim_run(10, 240), Err(taken));
        for (w, word) in a.pages.iter().enumerate() {
            let expect = if w as u64 == taken / 64 {
                1 << (taken % 64)
            } else {
                0
            };
            assert_eq!(
                word.load(Ordering::Relaxed),
                expect,
                "word {w}, taken {taken}"
            );
        }
        a.pages[(taken / 64) as usize].store(0, Ordering::Relaxed);
    }
    assert_eq!(a.claim_run(10, 240), Ok(()));
}

/// Where nothing races and nobody dies, the page summary is exact: a word's bit is set
/// exactly while the word holds a taken page, a summary word's group bit exactly while
/// all its bits are set. (Lagging bits would still be correct, only slower to search,
/// which no other test sees.)
#[test]
fn the_page_summary_is_exact_when_nothing_races() {
    // 40 MiB: two whole summary words (16 MiB each) and half of a third.
    let h = HeapAllocator::new(40 << 20);
    let a = h.get();
    let mut rng = xorshift(0x2545_f491_4f6c_dd1d);
    let mut rand = move |n: u64| rng() % n;
    let mut held: Vec<Block> = Vec::new();
    let steps = if cfg!(miri) { 60 } else { 3000 };
    for step in 0..steps {
        if rand(3) > 0 {
            // Sizes from slab blocks to 4 MiB runs, the larger ones more often.
            let size = PAGE << rand(11);
            if let Ok(b) = a.alloc(size - rand(PAGE)) {
                held.push(b);
            }
        } else if !held.is_empty() {
            let b = held.swap_remove(rand(held.len() as u64) as usize);
            a.free(b).unwrap();
        }
        for (w, word) in a.pages.iter().enumerate() {
            let taken = word.load(Ordering::Relaxed) != 0;
            assert_eq!(!a.maybe_empty(w), taken, "step {step}: page word {w}");
        }
        for (g, word) in a.summary.iter().enumerate() {
            let full = word.load(Ordering::Relaxed) == u64::MAX;
            assert_eq!(a.group_full(g), full, "step {step}: summary word {g}");
        }
    }
    // Miri's 60 steps are too few to fill 16 MiB; the full run's 3000 must.
    assert!(
        cfg!(miri) || (0..a.summary.len()).any(|g| a.group_full(g)),
        "the trace never filled a summary word: it checks less than it says"
    );
}

/// The summary's two searches, against a word-by-word look, over summary words full and
/// marked so, full and not marked yet (a claim about to mark it), and partly set; over
/// more than one group word.
#[test]
fn the_summary_searches_find_what_a_word_by_word_look_finds() {
    // 1.25 GiB: 80 summary words, two group words.
    let h = HeapAllocator::new(1280 << 20);
    let a = h.get();
    let n = a.summary.len();
    assert_eq!(n, 80);
    for (g, word) in a.summary.iter().enumerate() {
        let (bits, marked) = match g % 5 {
            0 | 1 | 3 => (u64::MAX, true),
            2 => (u64::MAX, false),
            _ => (!(1u64 << (g * 7 % 64)), false),
        };
        word.store(bits, Ordering::Relaxed);
        if marked {
            a.groups[g / 64].fetch_or(1 << (g % 64), Ordering::Relaxed);
        }
    }
    let words = n * 64;
    let step = if cfg!(miri) { 97 } else { 7 };
    for from in (0..=words).step_by(step) {
        for end in (from..=words).step_by(step * 3) {
            let open = (from.div_ceil(64)..end.div_ceil(64)).find(|&g| !a.group_full(g));
            let (gf, ge) = (from.div_ceil(64), end.div_ceil(64));
            assert_eq!(
                a.next_open_group(gf, ge),
                open.unwrap_or(ge),
                "groups [{gf}, {ge})"
            );
            let look = (from..end).find(|&w| a.maybe_empty(w));
            assert_eq!(
                a.next_maybe_empty(from, end),
                look.unwrap_or(end),
                "words [{from}, {end})"
            );
        }
    }
}

/// A heap whose last bitmap word is partly past its end: best fit counts the pages past
/// the end as taken, so a run reaches the top of the heap and no further.
#[test]
fn best_fit_ends_runs_at_the_top_of_a_heap_that_ends_inside_a_word() {
    let npages = 16 * 64 + 16; // 16 whole words and 16 pages of a 17th
    let h = HeapAllocator::new(npages * PAGE);
    let a = h.get();
    let low: Vec<Block> = (0..3).map(|_| a.alloc(256 * PAGE).unwrap()).collect();
    let low_end = low.iter().map(|b| b.offset + b.size).max().unwrap() / PAGE;
    assert_eq!(low_end, 768);
    let rest = npages - low_end;
    assert_eq!(
        rest, 272,
        "one free run of 272 pages, 16 of them in the last word"
    );
    assert!(matches!(
        a.alloc((rest + 1) * PAGE),
        Err(Error::Full { .. })
    ));
    let top = a.alloc(rest * PAGE).unwrap();
    assert_eq!((top.offset / PAGE, top.size / PAGE), (low_end, rest));
    assert_eq!(a.next_free(0, npages), None);
}
