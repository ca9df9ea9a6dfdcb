//! The allocator's entry points and what it reports: size classes, alignment, `Full`
//! and `TooLarge`, refused frees (each bad shape alone), `slab_live`, `usage` against a
//! page-by-page look, `audit` (each bad slab state alone), and threads allocating at
//! once with audits after.

use super::super::testing::HeapAllocator;
use super::super::*;
use super::xorshift;

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
