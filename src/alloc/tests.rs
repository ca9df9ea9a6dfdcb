//! Unit tests of the allocator: classes and alignment, placement (best fit against a
//! page-by-page reference scan, the low-water mark, idle slabs giving way), rejected
//! frees, coalescing, and threads allocating at once with audits after. The concurrent
//! protocols are model-checked in `loom_models`.

use super::slab::{IdleSlab, IdleSlabs};
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
    assert_eq!(class_of(0), None, "an empty request is no class's");
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
    // The page layer refuses an empty run (it would name a page it does not hold) and
    // one larger than the heap, whatever is free.
    assert_eq!(a.alloc_pages(0, 1), None);
    assert_eq!(a.alloc_pages(65, 1), None);
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

/// A xorshift64 generator from a nonzero seed: the tests' pseudo-random numbers, the
/// same on every run.
fn xorshift(mut x: u64) -> impl FnMut() -> u64 {
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
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

/// A slab hands out each of its blocks and only those, and finds a freed one wherever
/// it is: in every class, a full slab with its first block freed gives that block back
/// (the search starts at the word of the live count, here the last, which for classes
/// whose block count is not a multiple of 64 is partly past the slab's end); and a
/// 1024-block slab with 512 blocks freed across eight of its words gives exactly those
/// back, though the search starts at a word that is full.
#[test]
fn a_slab_hands_out_each_of_its_blocks_and_finds_every_freed_one() {
    let h = HeapAllocator::new(1 << 20);
    let a = h.get();
    // Under miri (a minute a class here), three: 85 blocks (a partial last word), 51
    // (one partial word) and 4; the second part below covers 1024.
    let classes: Vec<usize> = if cfg!(miri) {
        vec![11, 16, CLASSES as usize - 1]
    } else {
        (0..CLASSES as usize).collect()
    };
    for class in classes {
        let (size, cap) = (CLASS_SIZES[class], blocks_per_slab(class));
        let mut blocks: Vec<Block> = (0..cap).map(|_| a.alloc(size).unwrap()).collect();
        let slab = blocks[0].offset / SLAB;
        let mut offsets: Vec<u64> = blocks.iter().map(|b| b.offset - slab * SLAB).collect();
        offsets.sort_unstable();
        let every: Vec<u64> = (0..cap).map(|i| i * size).collect();
        assert_eq!(offsets, every, "class {class}: one slab, every block once");
        a.free(blocks[0]).unwrap();
        let again = a.alloc(size).unwrap();
        assert_eq!(again, blocks[0], "class {class}");
        blocks.drain(..).for_each(|b| a.free(b).unwrap());
        // Its current slab stays, empty: flush it so the next class starts clean.
        a.flush_idle_slabs();
        assert_eq!(a.usage().slabs, 0);
    }
    // Class 0: 16 words of 64 blocks. Free words 1-7 and 9: 512 live, so the search
    // starts at word 8, which is full, as is word 0.
    let mut blocks: Vec<Block> = (0..1024).map(|_| a.alloc(64).unwrap()).collect();
    blocks.sort_by_key(|b| b.offset);
    let base = blocks[0].offset;
    let word = |b: &Block| (b.offset - base) / 64 / 64;
    let (freed, kept): (Vec<Block>, Vec<Block>) = blocks
        .into_iter()
        .partition(|b| matches!(word(b), 1..=7 | 9));
    assert_eq!(freed.len(), 512);
    freed.iter().for_each(|&b| a.free(b).unwrap());
    let mut again: Vec<Block> = (0..512).map(|_| a.alloc(64).unwrap()).collect();
    // The search starts at the word of the live count (claimers that race spread over
    // the words instead of all meeting at word 0): with 512 live, word 8, so the first
    // block comes from word 9, the next word with a free block.
    assert_eq!(word(&again[0]), 9, "{:?}", again[0]);
    again.sort_by_key(|b| b.offset);
    assert_eq!(again, freed, "the freed blocks come back, no new slab");
    assert_eq!(a.usage().slabs, 1);
    again
        .into_iter()
        .chain(kept)
        .for_each(|b| a.free(b).unwrap());
    a.audit().unwrap();
}

/// A slab state that another process scribbled over is never underflowed or moved to
/// another class by a free: a block freed in a slab whose live count reads 0 leaves the
/// state as it was (a decrement would wrap into the class field), and so does a release
/// for a class the slab no longer has.
#[test]
fn a_free_never_underflows_or_retags_a_slab_state_it_did_not_expect() {
    let h = HeapAllocator::new(1 << 20);
    let a = h.get();
    let b = a.alloc(64).unwrap();
    let slab = (b.offset / SLAB) as usize;
    let state = &a.slabs[slab].state;
    // Class 0's tag, live count 0, though block 0's bit is set.
    state.store(1 << 16, Ordering::Relaxed);
    a.free(b).unwrap();
    assert_eq!(state.load(Ordering::Relaxed), 1 << 16);
    // A release for class 0 in a slab now tagged class 1 with 3 live.
    state.store((2 << 16) | 3, Ordering::Relaxed);
    a.release_reservation(slab, 0);
    assert_eq!(state.load(Ordering::Relaxed), (2 << 16) | 3);
}

/// A claimer that read its class's current slab just before that slab was retired and
/// taken by another class (or a hint another process scribbled over) finds the slab's
/// class changed and claims nothing in it: its block would overlap the other class's.
#[test]
fn a_stale_hint_naming_another_classes_slab_claims_nothing_there() {
    let h = HeapAllocator::new(1 << 20);
    let a = h.get();
    let other = a.alloc(128).unwrap();
    let slab = other.offset / SLAB;
    a.hint(0).store(slab + 1, Ordering::Relaxed);
    let mine = a.alloc(64).unwrap();
    assert_ne!(mine.offset / SLAB, slab, "{mine:?} is in class 1's slab");
    a.free(mine).unwrap();
    a.free(other).unwrap();
    a.audit().unwrap();
}

/// A block freed in a full slab that is not its class's current one is found again
/// through the class's partial bitmap: the next request of the class takes it once the
/// current slab is full, instead of a fresh slab. 8 MiB, so that each class has two
/// partial words (a class's words are not another's), and the slabs are put in the
/// second (64 KiB units 64 and up).
#[test]
fn a_block_freed_in_an_older_slab_is_reused_before_a_new_slab() {
    let h = HeapAllocator::new(8 << 20);
    let a = h.get();
    let low = a.alloc(4 << 20).unwrap();
    assert_eq!(low.offset, 0);
    // (Class 0's 2048 blocks take miri over a minute; the last class checks the same.)
    let classes: &[usize] = if cfg!(miri) {
        &[CLASSES as usize - 1]
    } else {
        &[0, CLASSES as usize - 1]
    };
    for &class in classes {
        let size = CLASS_SIZES[class];
        let per_slab = blocks_per_slab(class) as usize;
        // (An earlier class's current slab stays, empty.)
        let before = a.usage().slabs;
        // Two full slabs; the second is the current one.
        let mut held: Vec<Block> = (0..2 * per_slab).map(|_| a.alloc(size).unwrap()).collect();
        assert_eq!(a.usage().slabs, before + 2, "class {class}");
        let older = held[0].offset / SLAB;
        assert!(older >= 64, "class {class}: slab {older}");
        let freed = held.swap_remove(1);
        assert_eq!(freed.offset / SLAB, older);
        a.free(freed).unwrap();
        let again = a.alloc(size).unwrap();
        assert_eq!(
            again, freed,
            "class {class}: the freed block, not a new slab"
        );
        assert_eq!(a.usage().slabs, before + 2, "class {class}");
        held.push(again);
        held.into_iter().for_each(|b| a.free(b).unwrap());
    }
    a.free(low).unwrap();
    a.audit().unwrap();
}

/// A slab that retires (its last block freed, not its class's current slab) clears its
/// own partial mark and no other slab's: the first slab keeps the mark of its freed
/// block while the second, emptied, retires, and the next request takes that block.
#[test]
fn a_retiring_slab_clears_its_own_partial_mark_and_no_other() {
    let h = HeapAllocator::new(1 << 20);
    let a = h.get();
    let size = CLASS_SIZES[CLASSES as usize - 1];
    let mut held: Vec<Block> = (0..12).map(|_| a.alloc(size).unwrap()).collect();
    held.sort_by_key(|b| b.offset);
    assert_eq!(held[0].offset / SLAB, 0);
    assert_eq!(a.usage().slabs, 3);
    let freed = held[1];
    a.free(freed).unwrap();
    for &b in &held[4..8] {
        a.free(b).unwrap();
    }
    assert_eq!(a.usage().slabs, 2, "the second slab retired");
    assert_eq!(a.alloc(size).unwrap(), freed);
    for b in held[..4].iter().chain(&held[8..]) {
        a.free(*b).unwrap();
    }
    a.audit().unwrap();
}

/// A forged block that names a live block's slab and a misaligned offset inside it is
/// refused, and the live block stays allocated.
#[test]
fn a_misaligned_forged_block_frees_nothing() {
    let h = HeapAllocator::new(1 << 20);
    let a = h.get();
    let live = a.alloc(256).unwrap();
    let forged = Block {
        offset: live.offset + 3,
        ..live
    };
    assert!(matches!(a.free(forged), Err(Error::Corrupted { .. })));
    assert_eq!(a.usage().used, 256);
    a.free(live).unwrap();
    a.audit().unwrap();
}

/// A page block is refused, changing nothing, when any one of its three shapes is wrong:
/// an offset inside a page, no bytes, or bytes that are not whole pages. Each is tried
/// alone against a live 8-page run, so that no other check can refuse it in its place.
#[test]
fn a_page_block_misaligned_empty_or_not_whole_pages_is_refused_and_frees_nothing() {
    let h = HeapAllocator::new(1 << 20);
    let a = h.get();
    let live = a.alloc(8 * PAGE).unwrap();
    assert_eq!(live.kind, BlockKind::Pages);
    let before = a.usage();
    let low_water = a.hints[CLASSES as usize].0.load(Ordering::Relaxed);
    for forged in [
        Block {
            offset: live.offset + 64,
            ..live
        },
        Block { size: 0, ..live },
        Block {
            size: live.size - 64,
            ..live
        },
    ] {
        assert!(
            matches!(a.free(forged), Err(Error::Corrupted { .. })),
            "{forged:?}"
        );
        assert_eq!(a.usage(), before, "{forged:?} changed the heap");
        assert_eq!(
            a.hints[CLASSES as usize].0.load(Ordering::Relaxed),
            low_water,
            "{forged:?} moved the low-water mark"
        );
    }
    a.free(live).unwrap();
    a.audit().unwrap();
}

/// `slab_live` (eviction planning's look at a slab) is the `live` count of a unit that
/// is a slab, and `None` for a unit holding a page run, a free unit, a unit past the
/// heap, and a state word with live bits but no class.
#[test]
fn slab_live_counts_a_slabs_blocks_and_names_no_other_unit() {
    let h = HeapAllocator::new(1 << 20);
    let a = h.get();
    let blocks: Vec<Block> = (0..3).map(|_| a.alloc(192).unwrap()).collect();
    let s = blocks[0].offset / SLAB;
    assert!(blocks.iter().all(|b| b.offset / SLAB == s));
    let run = a.alloc(PAGES_PER_SLAB * PAGE).unwrap();
    assert_eq!(run.offset % SLAB, 0);
    let units = a.slabs.len() as u64;
    assert_eq!(a.slab_live(s), Some(3));
    assert_eq!(a.slab_live(run.offset / SLAB), None, "a page run");
    let free = (0..units)
        .find(|&u| {
            a.next_free(u * PAGES_PER_SLAB, (u + 1) * PAGES_PER_SLAB)
                .is_some()
        })
        .unwrap();
    assert_eq!(a.slab_live(free), None, "a free unit");
    assert_eq!(a.slab_live(units), None, "past the heap");
    assert_eq!(a.slab_live(u64::MAX), None);
    a.free(blocks[2]).unwrap();
    assert_eq!(a.slab_live(s), Some(2));
    a.slabs[free as usize].state.store(5, Ordering::Relaxed);
    assert_eq!(a.slab_live(free), None, "live bits, no class: no slab");
    a.slabs[free as usize].state.store(0, Ordering::Relaxed);
    blocks[..2].iter().for_each(|&b| a.free(b).unwrap());
    a.free(run).unwrap();
    a.audit().unwrap();
}

/// `usage` against a page-by-page look at the bitmaps, on a heap of 272 pages (its last
/// bitmap word holds 16), through a random mix of slab blocks and page runs: used bytes
/// are the blocks held; free pages are the clear bits; the largest free run counts the
/// classes' idle current slabs as free; `full` and `largest_free` report the same
/// figures. Bits past the heap's end (a scribble) count for nothing.
#[test]
fn usage_matches_a_page_by_page_look_on_a_heap_that_ends_inside_a_word() {
    let h = HeapAllocator::new((1 << 20) + SLAB);
    let a = h.get();
    let npages = a.npages;
    assert_eq!(npages % 64, 16);
    let check = |held: &[Block]| {
        let snap = a.snapshot();
        let taken = |p: u64| snap.pages[(p / 64) as usize] >> (p % 64) & 1 == 1;
        let idle: Vec<usize> = a.idle_slabs().as_slice().iter().map(|x| x.slab).collect();
        let idle_page = |p: u64| idle.contains(&((p / PAGES_PER_SLAB) as usize));
        let (mut largest, mut run) = (0, 0);
        for p in 0..npages {
            run = if taken(p) && !idle_page(p) {
                0
            } else {
                run + 1
            };
            largest = largest.max(run);
        }
        let free_pages = (0..npages).filter(|&p| !taken(p)).count() as u64;
        let slabs = snap
            .slabs
            .iter()
            .filter(|(st, _)| (1..=CLASSES).contains(&(st >> 16)))
            .count() as u64;
        let used: u64 = held.iter().map(|b| b.size).sum();
        let u = a.usage();
        let want = Usage {
            capacity: npages * PAGE,
            used,
            free: npages * PAGE - used,
            free_pages_bytes: free_pages * PAGE,
            largest_free: largest * PAGE,
            slabs,
        };
        assert_eq!(u, want, "held {held:?}");
        assert_eq!(a.largest_free(), want.largest_free);
        match a.full(7) {
            Error::Full {
                requested,
                free,
                largest_free,
            } => assert_eq!(
                (requested, largest_free),
                (7, want.largest_free),
                "free {free}"
            ),
            e => panic!("{e:?}"),
        }
        idle.len()
    };
    let mut next = xorshift(0x5eed);
    let mut held: Vec<Block> = Vec::new();
    let mut saw_idle = false;
    let steps = if cfg!(miri) { 20 } else { 3000 };
    for _ in 0..steps {
        if held.is_empty() || next() % 5 < 3 {
            let size = match next() % 4 {
                0 => 1 + next() % MAX_SMALL,
                1 => 64,
                2 => MAX_SMALL + 1 + next() % (4 * SLAB),
                _ => (1 + next() % 24) * PAGE,
            };
            if let Some(b) = a.try_alloc(size).unwrap() {
                held.push(b);
            }
        } else {
            let i = (next() % held.len() as u64) as usize;
            a.free(held.swap_remove(i)).unwrap();
        }
        saw_idle |= check(&held) > 0;
    }
    assert!(saw_idle, "the mix left no idle slab to count");
    // A scribble past the heap's end: the last word's 48 bits that name no page.
    let last = &a.pages[a.pages.len() - 1];
    let before = a.usage();
    last.fetch_or(!range_mask(0, 16), Ordering::Relaxed);
    assert_eq!(a.usage(), before);
    last.fetch_and(range_mask(0, 16), Ordering::Relaxed);
    held.into_iter().for_each(|b| a.free(b).unwrap());
    a.flush_idle_slabs();
    assert_eq!(a.usage().largest_free, npages * PAGE);
    a.audit().unwrap();
}

/// `audit` refuses each bad slab state alone: a class past the last, more block bits
/// than `live`, more `live` than the slab has blocks, live bits on a unit with no class,
/// and a class on a unit whose pages are free. A slab of the last class is a slab.
#[test]
fn audit_refuses_each_bad_slab_state_alone() {
    let h = HeapAllocator::new(1 << 20);
    let a = h.get();
    let class = CLASSES as usize - 1;
    let tag = (class as u64 + 1) << 16;
    let b = a.alloc(CLASS_SIZES[class]).unwrap();
    let s = (b.offset / SLAB) as usize;
    let state = &a.slabs[s].state;
    assert_eq!(state.load(Ordering::Relaxed), tag | 1);
    a.audit().unwrap();
    assert_eq!(blocks_per_slab(class), 4);
    for (st, why) in [
        ((CLASSES + 1) << 16 | 1, "a class past the last"),
        (tag, "one bit set, none live"),
        (tag | 5, "5 live in a slab of 4"),
    ] {
        state.store(st, Ordering::Relaxed);
        assert!(
            matches!(a.audit(), Err(Error::Corrupted { .. })),
            "{why} passed"
        );
    }
    state.store(tag | 4, Ordering::Relaxed);
    a.audit().unwrap();
    state.store(tag | 1, Ordering::Relaxed);
    let free = (s + 1) % a.slabs.len();
    for (st, why) in [(3, "live bits, no class"), (tag, "a class, its pages free")] {
        a.slabs[free].state.store(st, Ordering::Relaxed);
        assert!(
            matches!(a.audit(), Err(Error::Corrupted { .. })),
            "{why} passed"
        );
    }
    a.slabs[free].state.store(0, Ordering::Relaxed);
    a.audit().unwrap();
    a.free(b).unwrap();
}

/// Each slab keeps its partial mark while it has a freed block: a claimer that finds one
/// marked slab full again drops that slab's mark and no other's. Four full slabs of 4
/// blocks, one block freed in each of the first three: the next three requests take
/// exactly those three blocks (the third finds the first two slabs full again, the
/// second being the class's current slab by then).
#[test]
fn a_full_slabs_partial_mark_is_dropped_and_no_other() {
    let h = HeapAllocator::new(1 << 20);
    let a = h.get();
    let size = CLASS_SIZES[CLASSES as usize - 1];
    assert_eq!(blocks_per_slab(CLASSES as usize - 1), 4);
    let mut held: Vec<Block> = (0..16).map(|_| a.alloc(size).unwrap()).collect();
    held.sort_by_key(|b| b.offset);
    assert_eq!(a.usage().slabs, 4);
    let mut freed: Vec<Block> = [1, 5, 9].map(|i| held[i]).to_vec();
    freed.iter().for_each(|&b| a.free(b).unwrap());
    let mut again: Vec<Block> = (0..3).map(|_| a.alloc(size).unwrap()).collect();
    again.sort_by_key(|b| b.offset);
    freed.sort_by_key(|b| b.offset);
    assert_eq!(again, freed, "the freed blocks, not a new slab");
    assert_eq!(a.usage().slabs, 4);
    held.into_iter().for_each(|b| a.free(b).unwrap());
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

#[test]
fn threads_allocate_and_free_concurrently() {
    let h = std::sync::Arc::new(HeapAllocator::new(8 << 20));
    let threads: Vec<_> = (0..if cfg!(miri) { 2 } else { 4 })
        .map(|t| {
            let h = h.clone();
            std::thread::spawn(move || {
                let a = h.get();
                let mut live = Vec::new();
                let mut rng = xorshift(t as u64 + 1);
                let iters = if cfg!(miri) { 300 } else { 20_000u64 };
                for i in 0..iters {
                    let x = rng();
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

/// The leak sweep's two slab repairs, at the allocator. A freer killed just before its
/// retiring CAS leaves an empty slab that is not its class's current one: retired, its
/// pages back; the current slab, empty too, stays. A claimer killed between reserving
/// and setting its bit leaves the live count one too high, so the slab could never
/// retire: the reservation is dropped, and the last free retires the slab. Indices out
/// of range (read from shared memory) are refused, without a panic.
#[test]
fn the_sweeps_slab_repairs_retire_what_a_dead_freer_left_and_drop_dead_reservations() {
    let h = HeapAllocator::new(1 << 20);
    let a = h.get();
    let size = CLASS_SIZES[CLASSES as usize - 1];
    let class = CLASSES as usize - 1;
    let tag = (class as u64 + 1) << 16;
    // Two full slabs of 4; the second is the current one.
    let mut held: Vec<Block> = (0..8).map(|_| a.alloc(size).unwrap()).collect();
    held.sort_by_key(|b| b.offset);
    let (older, current) = (0, 1);
    assert_eq!(held[0].offset / SLAB, older as u64);
    assert_eq!(a.hint(class).load(Ordering::Relaxed), current as u64 + 1);
    // The dead freer: the older slab's blocks freed, its state back at `tag` (live 0)
    // as if its last free's retiring CAS never ran.
    for b in held.drain(..4) {
        a.free(b).unwrap();
    }
    assert_eq!(a.usage().slabs, 1, "the last free retired it");
    a.claim_run(0, PAGES_PER_SLAB).unwrap();
    a.slabs[older].state.store(tag, Ordering::Relaxed);
    assert_eq!(a.usage().slabs, 2);
    assert!(!a.retire_if_empty(a.slabs.len(), class));
    // A class past the last, even where a scribbled state names it.
    let beyond = CLASSES as usize;
    a.slabs[older]
        .state
        .store((beyond as u64 + 1) << 16 | 1, Ordering::Relaxed);
    a.drop_leaked_reservations(older, beyond, 1);
    a.slabs[older]
        .state
        .store((beyond as u64 + 1) << 16, Ordering::Relaxed);
    assert!(!a.retire_if_empty(older, beyond));
    a.slabs[older].state.store(tag, Ordering::Relaxed);
    assert!(
        !a.retire_if_empty(older, class - 1),
        "not that class's slab"
    );
    assert!(a.retire_if_empty(older, class));
    assert_eq!(a.usage().slabs, 1);
    assert_eq!(a.slabs[older].state.load(Ordering::Relaxed), 0);
    // The current slab, emptied, stays: it is the class's hint.
    for b in held.drain(..) {
        a.free(b).unwrap();
    }
    assert!(!a.retire_if_empty(current, class));
    assert_eq!(a.usage().slabs, 1);
    a.flush_idle_slabs();
    a.audit().unwrap();

    // The dead claimer: a slab (not the current one) with one block and one reservation
    // that no bit stands for.
    let mut held: Vec<Block> = (0..8).map(|_| a.alloc(size).unwrap()).collect();
    held.sort_by_key(|b| b.offset);
    let s = (held[0].offset / SLAB) as usize;
    assert_ne!(a.hint(class).load(Ordering::Relaxed), s as u64 + 1);
    let last = held.remove(0);
    for b in held.drain(..3) {
        a.free(b).unwrap();
    }
    a.slabs[s].state.fetch_add(1, Ordering::Relaxed);
    a.drop_leaked_reservations(a.slabs.len(), class, 1);
    a.drop_leaked_reservations(s, CLASSES as usize, 1);
    assert_eq!(a.slabs[s].state.load(Ordering::Relaxed), tag | 2);
    a.drop_leaked_reservations(s, class, 1);
    assert_eq!(a.slabs[s].state.load(Ordering::Relaxed), tag | 1);
    a.free(last).unwrap();
    assert_eq!(a.slabs[s].state.load(Ordering::Relaxed), 0, "retired");
    held.into_iter().for_each(|b| a.free(b).unwrap());
    a.flush_idle_slabs();
    assert_eq!(a.usage().slabs, 0);
    a.audit().unwrap();
}

/// The two scrubs touch only the unit they are given: two setups in progress (or dead)
/// at units 4 and 5, with free pages below them. Scrubbing unit 4's leaked run leaves
/// unit 5's bits; `scrub_unit` leaves a unit whose pages are held, and clears one whose
/// pages are free, reporting that it cleared something however many words were set.
#[test]
fn the_scrubs_touch_only_the_unit_they_are_given() {
    let h = HeapAllocator::new(4 << 20);
    let a = h.get();
    let below = a.alloc(64 * PAGE).unwrap();
    assert!(a.begin_slab_setup_only() && a.begin_slab_setup_only());
    a.free(below).unwrap();
    let bit = |s: usize| a.slabs[s].bits[0].load(Ordering::Relaxed);
    assert_eq!((bit(4), bit(5)), (1, 1));
    let unit = |s: u64| s * PAGES_PER_SLAB;
    a.scrub_units_of_leaked_run(unit(4), unit(5));
    assert_eq!((bit(4), bit(5)), (0, 1));
    assert!(
        !a.scrub_unit(5),
        "its pages are held: not the scrub's to touch"
    );
    assert_eq!(bit(5), 1);
    a.free_leaked_pages(unit(4), PAGES_PER_SLAB).unwrap();
    a.free_leaked_pages(unit(5), PAGES_PER_SLAB).unwrap();
    for w in &a.slabs[5].bits {
        w.store(u64::MAX, Ordering::Relaxed);
    }
    assert!(a.scrub_unit(5));
    assert!(a.slabs[5]
        .bits
        .iter()
        .all(|w| w.load(Ordering::Relaxed) == 0));
    a.audit().unwrap();
    assert_eq!(a.usage().used, 0);
}

#[test]
fn a_dead_setups_block_bits_are_cleared_while_its_pages_are_held_or_once_they_are_free() {
    let h = HeapAllocator::new(4 << 20);
    let a = h.get();
    // A setup killed midway: the unit's pages claimed, its first block bit set, no state.
    assert!(a.begin_slab_setup_only());
    let s = (0..a.slabs.len())
        .find(|&s| a.slabs[s].bits[0].load(Ordering::Relaxed) != 0)
        .unwrap();
    let first = s as u64 * PAGES_PER_SLAB;
    assert!(a.audit().is_err(), "bits on a unit that is no slab");
    // The sweep clears them while the pages are still the dead setup's...
    a.scrub_units_of_leaked_run(first, first + PAGES_PER_SLAB);
    assert_eq!(a.slabs[s].bits[0].load(Ordering::Relaxed), 0);
    assert_eq!(
        a.next_free(first, first + PAGES_PER_SLAB),
        None,
        "pages still held"
    );
    // ...and only then frees them.
    a.free_leaked_pages(first, PAGES_PER_SLAB).unwrap();
    a.audit().unwrap();
    // A unit of a run only partly leaked is not touched.
    a.slabs[s].bits[0].store(1, Ordering::Relaxed);
    a.scrub_units_of_leaked_run(first + 1, first + PAGES_PER_SLAB);
    assert_eq!(a.slabs[s].bits[0].load(Ordering::Relaxed), 1);
    // Bits left on a unit whose pages are free (by an earlier version's sweeper): taken
    // as a new slab would take the pages, cleared, and the pages given back.
    assert!(a.scrub_unit(s));
    a.audit().unwrap();
    assert!(!a.scrub_unit(s), "nothing left to clear, nothing claimed");
    // While someone else holds the pages, the bits are not the sweep's to touch.
    a.slabs[s].bits[0].store(1, Ordering::Relaxed);
    let run = a.alloc(PAGES_PER_SLAB * PAGE * 2).unwrap();
    // (First fit from the lowest free page: the run covers the unit.)
    assert!(run.offset / PAGE <= first && first < (run.offset + run.size) / PAGE);
    assert!(!a.scrub_unit(s));
    assert_eq!(a.slabs[s].bits[0].load(Ordering::Relaxed), 1);
    a.free(run).unwrap();
    assert!(a.scrub_unit(s));
    a.audit().unwrap();
    assert_eq!(a.usage().used, 0);
}
