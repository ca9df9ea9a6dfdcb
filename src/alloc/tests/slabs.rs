//! The slab layer: blocks handed out and found again, partial marks, stale hints, forged
//! and double frees, retiring, and the leak sweep's slab repairs and scrubs.

use super::super::testing::HeapAllocator;
use super::super::*;

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
