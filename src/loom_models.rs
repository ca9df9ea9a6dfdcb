//! Loom models of every lock-free protocol, over the same code production runs.
//!
//! The allocator and the table are built on the heap (`HeapAllocator`, `HeapTable`) from the
//! same `#[repr(C)]` structs the region holds, with loom's atomics (through `crate::sync`),
//! and 2 or 3 threads race through one protocol each. Run them with `scripts/loom.sh`
//! (CI: `LOOM_MAX_PREEMPTIONS=2`; deeper: `scripts/loom.sh 3`). Each model is known to
//! catch at least one deliberate bug, switched on with `SHMSTORE_MUTATION=...`
//! (`scripts/loom.sh --mutations`; see docs/verification.md).

use crate::alloc::testing::HeapAllocator;
use crate::alloc::Block;
use crate::client::testing::MemLocks;
use crate::client::{Claimed, ClientHeader, Clients};
use crate::error::Error;
use crate::layout::PAGE;
use crate::sync::UnsafeCell;
use crate::sync::{AtomicU64, Ordering};
use crate::table::testing::HeapTable;
use crate::table::{Entry, Pin, SlotRef, Table};
use crate::ObjectId;
use loom::sync::Arc;
use loom::thread;
use std::time::{Duration, Instant};

fn entry(offset: u64) -> Entry {
    Entry {
        offset,
        len: 8,
        meta_len: 0,
        kind: 1,
        creator: 0,
    }
}

fn disjoint(mut blocks: Vec<Block>) {
    blocks.sort_by_key(|b| b.offset);
    for w in blocks.windows(2) {
        assert!(
            w[0].offset + w[0].size <= w[1].offset,
            "blocks overlap: {w:?}"
        );
    }
}

/// Two page-run claims race over two bitmap words, one of them multi-word, with a
/// rollback whenever the other got there first. Blocks never overlap and, after freeing
/// everything, no page is left claimed (a missing rollback leaks bits).
#[test]
fn loom_page_runs_claim_and_roll_back() {
    loom::model(|| {
        let h = Arc::new(HeapAllocator::new(128 * PAGE));
        let pre = h.get().alloc(40 * PAGE).unwrap();
        let ts: Vec<_> = [50u64, 30]
            .into_iter()
            .map(|n| {
                let h = h.clone();
                thread::spawn(move || h.get().alloc(n * PAGE).ok())
            })
            .collect();
        let got: Vec<Block> = ts.into_iter().filter_map(|t| t.join().unwrap()).collect();
        assert!(
            !got.is_empty(),
            "88 free pages fit at least one of 50 and 30"
        );
        let a = h.get();
        let mut all = got.clone();
        all.push(pre);
        disjoint(all.clone());
        a.audit().unwrap();
        for b in all {
            a.free(b).unwrap();
        }
        assert_eq!(a.usage().used, 0, "pages left claimed");
        assert_eq!(a.usage().largest_free, 128 * PAGE);
    });
}

/// A slab's last block is freed (retiring the slab) while another thread claims from it
/// through the partial bitmap. The claimer gets a block that overlaps nothing, and the
/// slab's pages are returned exactly once.
#[test]
fn loom_slab_retire_races_claim() {
    loom::model(|| {
        let h = Arc::new(HeapAllocator::new(4 * crate::layout::SLAB));
        let a = h.get();
        // Slab A full, slab B full (B is the class's current slab); then A down to one block.
        let blocks: Vec<Block> = (0..8).map(|_| a.alloc(16384).unwrap()).collect();
        for b in &blocks[1..4] {
            a.free(*b).unwrap();
        }
        let last_of_a = blocks[0];
        let t1 = {
            let h = h.clone();
            thread::spawn(move || h.get().free(last_of_a).unwrap())
        };
        let t2 = {
            let h = h.clone();
            thread::spawn(move || h.get().alloc(16384).unwrap())
        };
        t1.join().unwrap();
        let got = t2.join().unwrap();
        let mut live = blocks[4..].to_vec();
        live.push(got);
        disjoint(live.clone());
        let a = h.get();
        a.audit().unwrap();
        for b in live {
            a.free(b).unwrap();
        }
        assert_eq!(a.usage().used, 0);
    });
}

/// Small-block ABA: a block is freed and reclaimed while another thread claims from the
/// same slab. Two live blocks are never the same block.
#[test]
fn loom_small_blocks_free_and_reclaim() {
    loom::model(|| {
        let h = Arc::new(HeapAllocator::new(crate::layout::SLAB * 2));
        let keep = h.get().alloc(64).unwrap();
        let t1 = {
            let h = h.clone();
            thread::spawn(move || {
                let a = h.get();
                let x = a.alloc(64).unwrap();
                a.free(x).unwrap();
                a.alloc(64).unwrap()
            })
        };
        let t2 = {
            let h = h.clone();
            thread::spawn(move || h.get().alloc(64).unwrap())
        };
        let (b, c) = (t1.join().unwrap(), t2.join().unwrap());
        disjoint(vec![keep, b, c]);
        h.get().audit().unwrap();
    });
}

/// Three creates of one id race: exactly one succeeds.
#[test]
fn loom_racing_creates_of_one_id() {
    loom::model(|| {
        let h = Arc::new(HeapTable::new(32));
        let id = ObjectId::of_key("same");
        let ts: Vec<_> = (0..3u64)
            .map(|k| {
                let h = h.clone();
                thread::spawn(move || h.get().insert(&id, &entry(64 * k)))
            })
            .collect();
        let results: Vec<_> = ts.into_iter().map(|t| t.join().unwrap()).collect();
        let ok = results.iter().filter(|r| r.is_ok()).count();
        assert_eq!(ok, 1, "{results:?}");
        assert!(results
            .iter()
            .any(|r| matches!(r, Err(Error::AlreadyExists { .. }))));
        assert_eq!(h.get().count_live(), 1);
    });
}

/// A create of `x` races a delete of `y`, an object of the same home, followed by a
/// create of `x` that takes `y`'s freed slot. The first create may have checked the
/// bucket while `y` was there and CAS its bit in after the second create: the bitmap is
/// the same again, and only the bucket's version tells it changed. One create wins.
#[test]
fn loom_create_races_delete_and_recreate() {
    let y = ObjectId::of_key("y");
    let x = id_with_home(y.mix() & 31, "x");
    loom::model(move || {
        let h = Arc::new(HeapTable::new(32));
        let t = h.get();
        let r = t.insert(&y, &entry(64)).unwrap();
        t.seal(&y, r).unwrap();
        let creator = {
            let h = h.clone();
            thread::spawn(move || h.as_client(1).insert(&x, &entry(2 * 64)).is_ok())
        };
        let recreator = {
            let h = h.clone();
            thread::spawn(move || {
                let t = h.get();
                t.delete(&y).unwrap();
                t.insert(&x, &entry(3 * 64)).is_ok()
            })
        };
        let created = [creator.join().unwrap(), recreator.join().unwrap()];
        assert_eq!(created.iter().filter(|&&ok| ok).count(), 1, "{created:?}");
        assert_eq!(h.get().count_live(), 1);
    });
}

/// An id whose home slot is `home` in a 32-slot table.
fn id_with_home(home: u64, prefix: &str) -> ObjectId {
    (0..)
        .map(|k| ObjectId::of_key(format!("{prefix}{k}")))
        .find(|id| id.mix() & 31 == home)
        .expect("some key hashes there")
}

/// A lookup races the delete of its object and the reuse of the slot by another object.
/// A reader holding the old generation never pins or reads the new object.
#[test]
fn loom_lookup_races_delete_and_reuse() {
    let a = ObjectId::of_key("old");
    let b = id_with_home(a.mix() & 31, "new");
    loom::model(move || {
        let h = Arc::new(HeapTable::new(32));
        let t = h.get();
        let r = t.insert(&a, &entry(100 * 64)).unwrap();
        t.seal(&a, r).unwrap();
        let reader = {
            let h = h.clone();
            thread::spawn(move || {
                let t = h.as_client(1);
                if let Pin::Pinned(r, e) = t.pin(&a).unwrap() {
                    assert_eq!(e.offset, 100 * 64, "pinned someone else's object");
                    t.unpin(r).unwrap();
                }
            })
        };
        let writer = {
            let h = h.clone();
            thread::spawn(move || {
                let t = h.get();
                t.delete(&a).unwrap();
                if let Ok(r2) = t.insert(&b, &entry(200 * 64)) {
                    t.seal(&b, r2).unwrap();
                }
            })
        };
        reader.join().unwrap();
        writer.join().unwrap();
        assert_eq!(h.freed().len(), 1);
        assert_eq!(h.freed()[0].1.offset, 100 * 64);
    });
}

/// Seal races a getter blocked on the futex: no lost wake-up (loom reports a deadlock),
/// and the getter sees every byte written before the seal (loom reports a causality
/// violation on the payload cell otherwise).
#[test]
fn loom_seal_wakes_blocked_get_and_publishes_payload() {
    loom::model(|| {
        let h = Arc::new(HeapTable::new(32));
        let payload = Arc::new(UnsafeCell::new(0u64));
        let id = ObjectId::of_key("wake");
        let getter = {
            let (h, payload) = (h.clone(), payload.clone());
            thread::spawn(move || {
                let t = h.as_client(1);
                let far = Instant::now() + Duration::from_secs(3600);
                match t.pin_wait(&id, Some(far), Duration::ZERO).unwrap() {
                    Pin::Pinned(..) => payload.with(|p| {
                        // SAFETY: loom checks this read against the writer's write.
                        assert_eq!(unsafe { *p }, 42)
                    }),
                    other => panic!("woke without the object: {other:?}"),
                }
            })
        };
        let t = h.get();
        let r = t.insert(&id, &entry(0)).unwrap();
        // SAFETY: loom checks this write against the getter's read.
        payload.with_mut(|p| unsafe { *p = 42 });
        t.seal(&id, r).unwrap();
        getter.join().unwrap();
    });
}

/// Two pins (two clients) race the delete of their object: the last counter down frees
/// the block exactly once, never twice and never while a pin is held (a pinned reader
/// reads the block; a free writes it, and loom reports the race if they can overlap).
#[test]
fn loom_pin_races_delete_frees_once() {
    loom::model(|| {
        let h = Arc::new(HeapTable::new(32));
        let id = ObjectId::of_key("pinned");
        let t = h.get();
        let r = t.insert(&id, &entry(0)).unwrap();
        t.seal(&id, r).unwrap();
        let pinners: Vec<_> = (1..3)
            .map(|c| {
                let h = h.clone();
                thread::spawn(move || {
                    let t = h.as_client(c);
                    if let Pin::Pinned(r, _) = t.pin(&id).unwrap() {
                        assert_eq!(h.read_while_pinned(), 0, "freed while pinned");
                        t.unpin(r).unwrap();
                    }
                })
            })
            .collect();
        h.get().delete(&id).unwrap();
        for p in pinners {
            p.join().unwrap();
        }
        assert_eq!(h.freed().len(), 1, "the block must be freed exactly once");
        assert_eq!(h.get().count_live(), 0);
    });
}

/// A dead client's pins are dropped by a recoverer while the object is deleted and a
/// live client pins it: freed exactly once, never under the live pin.
#[test]
fn loom_recovery_drops_dead_pins_under_live_ones() {
    loom::model(|| {
        let h = Arc::new(HeapTable::new(32));
        let id = ObjectId::of_key("held-by-the-dead");
        let t = h.get();
        let r = t.insert(&id, &entry(0)).unwrap();
        t.seal(&id, r).unwrap();
        // Client 5 pins twice, then "dies".
        let Pin::Pinned(dead, _) = h.as_client(5).pin(&id).unwrap() else {
            panic!()
        };
        h.as_client(5).add_pin(dead).unwrap();
        let live = {
            let h = h.clone();
            thread::spawn(move || {
                let t = h.as_client(1);
                if let Pin::Pinned(r, _) = t.pin(&id).unwrap() {
                    assert_eq!(h.read_while_pinned(), 0, "freed while pinned");
                    t.unpin(r).unwrap();
                }
            })
        };
        let recoverer = {
            let h = h.clone();
            thread::spawn(move || {
                h.as_client(2).drop_dead_pins(r.index as usize, 5);
            })
        };
        t.delete(&id).unwrap();
        live.join().unwrap();
        recoverer.join().unwrap();
        assert_eq!(h.freed().len(), 1, "the block must be freed exactly once");
    });
}

/// An abort races a get: the getter never pins an unsealed object, and the block is
/// freed once.
#[test]
fn loom_abort_races_get() {
    loom::model(|| {
        let h = Arc::new(HeapTable::new(32));
        let id = ObjectId::of_key("aborted");
        let getter = {
            let h = h.clone();
            thread::spawn(move || {
                let p = h.as_client(1).pin(&id).unwrap();
                assert!(!matches!(p, Pin::Pinned(..)), "pinned an unsealed object");
            })
        };
        let t = h.get();
        let r = t.insert(&id, &entry(0)).unwrap();
        t.abort(&id, r).unwrap();
        getter.join().unwrap();
        assert_eq!(h.freed(), vec![(r, entry(0))]);
        assert_eq!(t.count_live(), 0);
    });
}

/// An eviction step races a get of its victim: an object is never evicted while pinned
/// (either the get pins first and the eviction backs off, or the get finds it gone).
/// With `first_pass`, one CLOCK step clears the referenced bit before the race.
fn eviction_races_pin(first_pass: bool, evict: fn(&Table<'_>, SlotRef) -> bool) {
    loom::model(move || {
        let h = Arc::new(HeapTable::new(32));
        let id = ObjectId::of_key("victim");
        let t = h.get();
        let r = t.insert(&id, &entry(0)).unwrap();
        t.seal(&id, r).unwrap();
        if first_pass {
            assert!(!t.clock_step(r.index as usize).unwrap());
        }
        let hand = {
            let h = h.clone();
            thread::spawn(move || evict(&h.get(), r))
        };
        // The getter keeps its pin until both are done.
        let getter = {
            let h = h.clone();
            thread::spawn(move || match h.as_client(1).pin(&id).unwrap() {
                Pin::Pinned(r, _) => Some(r),
                _ => None,
            })
        };
        let evicted = hand.join().unwrap();
        let pinned = getter.join().unwrap();
        assert!(
            !(evicted && pinned.is_some()),
            "evicted an object while it was pinned"
        );
        assert!(evicted || pinned.is_some());
        if let Some(r) = pinned {
            assert!(t.contains_sealed(&id));
            h.as_client(1).unpin(r).unwrap();
        }
    });
}

/// The CLOCK hand (after its first pass cleared the referenced bit) races a get.
#[test]
fn loom_eviction_races_pin() {
    eviction_races_pin(true, |t, r| t.clock_step(r.index as usize).unwrap());
}

/// Eviction of one generation (a neighbour taken to widen a hole, which ignores the
/// referenced bit) races a get the same way.
#[test]
fn loom_neighbour_eviction_races_pin() {
    eviction_races_pin(false, |t, r| {
        t.evict_step(r.index as usize, Some(r.gen))
            .unwrap()
            .is_some()
    });
}

/// A delete that spares pinned objects (`Store::delete_unpinned`, what the vLLM
/// front-end's cache clear runs) races a get the same way: it never takes an object
/// from under a pin that its get reported taken.
#[test]
fn loom_delete_unpinned_races_pin() {
    eviction_races_pin(false, |t, _| {
        t.delete_unpinned(&ObjectId::of_key("victim"))
            .unwrap()
            .is_some()
    });
}

/// Children made by `fork()` adopt a view of a deleted object, which their parent's pin
/// keeps, while the parent drops that view (`View::adopt` against `View::drop`): either a
/// child's pin keeps the block until that child lets go, or its adoption fails. The block
/// is freed exactly once, never under a child's pin. With `by_id`, the others find the
/// object by id instead, as draining (`Store::get_draining`, vLLM's workers after an item
/// was deleted by hand): the same adoption, after a scan of the neighbourhood.
fn adoptions_race_last_unpin(children: u16, by_id: bool) {
    loom::model(move || {
        let h = Arc::new(HeapTable::new(32));
        let id = ObjectId::of_key("inherited");
        let t = h.get();
        let r = t.insert(&id, &entry(0)).unwrap();
        t.seal(&id, r).unwrap();
        let Pin::Pinned(view, _) = h.as_client(1).pin(&id).unwrap() else {
            panic!()
        };
        t.delete(&id).unwrap();
        let children: Vec<_> = (2..2 + children)
            .map(|c| {
                let h = h.clone();
                thread::spawn(move || {
                    let child = h.as_client(c);
                    let pinned = if by_id {
                        child.pin_draining(&id).unwrap().map(|(r, e)| {
                            assert_eq!((r, e), (view, entry(0)));
                            r
                        })
                    } else {
                        child.repin(view).unwrap().then_some(view)
                    };
                    if let Some(r) = pinned {
                        assert_eq!(h.read_while_pinned(), 0, "freed under the child's pin");
                        child.unpin(r).unwrap();
                    }
                })
            })
            .collect();
        h.as_client(1).unpin(view).unwrap();
        for c in children {
            c.join().unwrap();
        }
        assert_eq!(h.freed().len(), 1, "the block must be freed exactly once");
    });
}

#[test]
fn loom_adopt_races_last_unpin_of_deleted_object() {
    adoptions_race_last_unpin(1, false);
}

/// Two children: an adoption's CAS can also lose to the other's (it tries again).
#[test]
fn loom_two_adoptions_race_last_unpin_of_deleted_object() {
    adoptions_race_last_unpin(2, false);
}

#[test]
fn loom_draining_get_races_last_unpin_of_deleted_object() {
    adoptions_race_last_unpin(1, true);
}

/// A draining get races the abort of a creation with the same id: the aborted entry is
/// DELETED too, and held for a moment by the aborter's own counter, but it was never
/// sealed, so the get must never return it.
#[test]
fn loom_draining_get_races_abort() {
    loom::model(|| {
        let h = Arc::new(HeapTable::new(32));
        let id = ObjectId::of_key("aborted");
        let t = h.get();
        let r = t.insert(&id, &entry(0)).unwrap();
        let getter = {
            let h = h.clone();
            thread::spawn(move || {
                let got = h.as_client(1).pin_draining(&id).unwrap();
                assert!(got.is_none(), "found an object that was never sealed");
            })
        };
        t.abort(&id, r).unwrap();
        getter.join().unwrap();
        assert_eq!(h.freed().len(), 1, "the block must be freed exactly once");
    });
}

/// A search that skipped pages another claimer held for a moment must not report the
/// store full. C claims all 80 pages word by word; B takes 10 pages in C's second word,
/// so C rolls back; A, wanting 40, may search while C holds the first word. If A reports
/// full, no run of 40 pages may be free once everyone is done.
#[test]
fn loom_full_only_when_no_run_is_free() {
    loom::model(|| {
        let h = Arc::new(HeapAllocator::new(80 * PAGE));
        let spawn = |pages: u64| {
            let h = h.clone();
            thread::spawn(move || h.get().alloc(pages * PAGE).ok())
        };
        let (c, b) = (spawn(80), spawn(10));
        let a = h.get().alloc(40 * PAGE).ok();
        let (c, b) = (c.join().unwrap(), b.join().unwrap());
        let mut all: Vec<Block> = [a, b, c].into_iter().flatten().collect();
        disjoint(all.clone());
        let left = h.get().usage().largest_free;
        if a.is_none() {
            assert!(
                left < 40 * PAGE,
                "reported full while {} pages stayed free in one run",
                left / PAGE
            );
        }
        for blk in all.drain(..) {
            h.get().free(blk).unwrap();
        }
        assert_eq!(h.get().usage().used, 0);
    });
}

/// A process moving into a dead client's slot races a recoverer of that slot and a
/// third process attaching. Whoever ends up holding the slot pins in its column (a
/// counter here); no recovery may zero that counter afterwards, and at most one process
/// holds the slot.
#[test]
fn loom_moving_into_a_dead_slot_races_its_recovery() {
    loom::model(|| {
        let headers: Arc<Vec<ClientHeader>> =
            Arc::new((0..2).map(|_| ClientHeader::default()).collect());
        let held: Arc<Vec<AtomicU64>> = Arc::new((0..2).map(|_| AtomicU64::new(0)).collect());
        let column = Arc::new(AtomicU64::new(0)); // slot 1's pin counters
        {
            // Slot 0: the recoverer, alive. Slot 1: a client that died holding 5 pins.
            let (r, dead) = (
                MemLocks {
                    holders: &held,
                    id: 0,
                },
                MemLocks {
                    holders: &held,
                    id: 1,
                },
            );
            assert_eq!(
                Clients::new(&headers, &r, None).try_claim(0, false),
                Some(Claimed::Fresh)
            );
            assert_eq!(
                Clients::new(&headers, &dead, None).try_claim(1, false),
                Some(Claimed::Fresh)
            );
            column.store(5, Ordering::SeqCst);
            held[1].store(0, Ordering::SeqCst); // it dies: its lock goes
        }
        let attach = |id: u64| {
            let (headers, held, column) = (headers.clone(), held.clone(), column.clone());
            thread::spawn(move || {
                let locks = MemLocks { holders: &held, id };
                let clients = Clients::new(&headers, &locks, None);
                let moved = match clients.try_claim(1, true) {
                    Some(Claimed::Fresh) => true,
                    Some(Claimed::Dead) => {
                        column.store(0, Ordering::SeqCst); // recover its own slot
                        clients.finish_claim(1)
                    }
                    None => false,
                };
                if moved {
                    column.fetch_add(1, Ordering::SeqCst); // pin in its column
                }
                moved
            })
        };
        let (p, n) = (attach(7), attach(9));
        {
            let locks = MemLocks {
                holders: &held,
                id: 0,
            };
            let clients = Clients::new(&headers, &locks, Some(0));
            if clients.claim_for_recovery(1).is_some() {
                column.store(0, Ordering::SeqCst);
                clients.release(1);
            }
        }
        let (p, n) = (p.join().unwrap(), n.join().unwrap());
        assert!(!(p && n), "two processes hold one client slot");
        assert_eq!(
            column.load(Ordering::SeqCst),
            (p || n) as u64,
            "a recovery zeroed the pins of the slot's new holder"
        );
    });
}

/// Two frees and a claim race in one bitmap word. The page summary's bit for the word is
/// cleared by whichever free leaves it empty (decided from that free's own RMW), so once
/// all are done no empty word is hidden from best fit.
#[test]
fn loom_page_summary_follows_racing_frees() {
    loom::model(|| {
        let h = Arc::new(HeapAllocator::new(128 * PAGE));
        let a = h.get().alloc(20 * PAGE).unwrap();
        let b = h.get().alloc(20 * PAGE).unwrap();
        let t = {
            let h = h.clone();
            thread::spawn(move || h.get().free(a).unwrap())
        };
        h.get().free(b).unwrap();
        let c = h.get().alloc(30 * PAGE).unwrap();
        h.get().free(c).unwrap();
        t.join().unwrap();
        h.get().audit().unwrap();
    });
}

/// The page summary's second level: a claim fills the last empty word of a 16 MiB group
/// (which marks the group full, then looks again) while a free empties another word of
/// it (which clears the mark if the group was full). Whatever the order, the group must
/// not end marked full with an empty word in it: best fit would pass over the group.
#[test]
fn loom_summary_group_mark_races_a_free() {
    // (A 16 MiB heap is some 4 500 atomics to create: more branches than the default.)
    let mut model = loom::model::Builder::new();
    model.max_branches = 1 << 16;
    model.check(|| {
        // 16 MiB: 64 page words, one summary word. Words 0-61 wholly taken, word 62 is
        // one 20-page block, word 63 empty; first fit starts at word 63.
        let h = Arc::new(HeapAllocator::new(4096 * PAGE));
        for w in &h.pages[..62] {
            w.store(u64::MAX, Ordering::Relaxed);
        }
        h.pages[62].store((1 << 20) - 1, Ordering::Relaxed);
        h.summary[0].store(u64::MAX >> 1, Ordering::Relaxed);
        h.hints[crate::layout::CLASSES as usize]
            .0
            .store(63 * 64, Ordering::Relaxed);
        let block = Block {
            offset: 62 * 64 * PAGE,
            size: 20 * PAGE,
            kind: crate::alloc::BlockKind::Pages,
        };
        let t = {
            let h = h.clone();
            thread::spawn(move || h.get().free(block).unwrap())
        };
        let got = h.get().alloc(10 * PAGE).unwrap();
        assert_eq!(got.offset, 63 * 64 * PAGE);
        t.join().unwrap();
        h.get().audit().unwrap();
    });
}

/// The next owner of a page run synchronises with its previous owner: what the previous
/// owner did with the memory (a loom cell here) happens before the next owner's first
/// access, through the free's Release and the claim's Acquire.
#[test]
fn loom_page_run_hand_off() {
    loom::model(|| {
        let h = Arc::new(HeapAllocator::new(16 * PAGE));
        let memory = Arc::new(UnsafeCell::new(0u64));
        let prev = {
            let (h, memory) = (h.clone(), memory.clone());
            thread::spawn(move || {
                if let Ok(b) = h.get().alloc(16 * PAGE) {
                    // SAFETY: loom checks this access against the next owner's.
                    memory.with_mut(|m| unsafe { *m = 1 });
                    h.get().free(b).unwrap();
                }
            })
        };
        if h.get().alloc(16 * PAGE).is_ok() {
            // SAFETY: loom checks this access against the previous owner's.
            memory.with_mut(|m| unsafe { *m = 2 });
        }
        prev.join().unwrap();
    });
}

/// The same hand-off for a slab block (the slab's last free block).
#[test]
fn loom_slab_block_hand_off() {
    loom::model(|| {
        let h = Arc::new(HeapAllocator::new(crate::layout::SLAB));
        let memory = Arc::new(UnsafeCell::new(0u64));
        let _others: Vec<Block> = (0..3).map(|_| h.get().alloc(16384).unwrap()).collect();
        let prev = {
            let (h, memory) = (h.clone(), memory.clone());
            thread::spawn(move || {
                if let Ok(b) = h.get().alloc(16384) {
                    // SAFETY: loom checks this access against the next owner's.
                    memory.with_mut(|m| unsafe { *m = 1 });
                    h.get().free(b).unwrap();
                }
            })
        };
        if h.get().alloc(16384).is_ok() {
            // SAFETY: loom checks this access against the previous owner's.
            memory.with_mut(|m| unsafe { *m = 2 });
        }
        prev.join().unwrap();
    });
}

/// The same hand-off for a table slot: the freer's last access (in `reclaim`, before
/// the slot is released) happens before the first access of the process that claims the
/// slot next.
#[test]
fn loom_table_slot_hand_off() {
    // Filling the table takes many atomic steps (one path, but each counts as a branch).
    let mut model = loom::model::Builder::new();
    model.max_branches = 100_000;
    model.check(|| {
        let h = Arc::new(HeapTable::new(32));
        // 31 of 32 slots taken: the two inserts below compete for the last one.
        for k in 0..31u64 {
            h.get()
                .insert(&ObjectId::of_key(format!("k{k}")), &entry(64 * k))
                .unwrap();
        }
        let prev = {
            let h = h.clone();
            thread::spawn(move || {
                let t = h.get();
                let x = ObjectId::of_key("x");
                if let Ok(r) = t.insert(&x, &entry(64 * 40)) {
                    t.seal(&x, r).unwrap();
                    t.delete(&x).unwrap(); // frees: reclaim touches the cell, then release
                }
            })
        };
        // The next owner: tries until the last slot is free (yielding lets the previous
        // owner finish; it creates no happens-before of its own).
        let t = h.as_client(1);
        for _ in 0..3 {
            match t.insert(&ObjectId::of_key("y"), &entry(64 * 41)) {
                Ok(_) => {
                    h.touch_as_new_owner();
                    break;
                }
                Err(Error::TableFull { .. }) => thread::yield_now(),
                Err(e) => panic!("{e}"),
            }
        }
        prev.join().unwrap();
    });
}
