//! Loom models of every lock-free protocol, over the same code production runs.
//!
//! The allocator and the table are built on the heap (`HeapAllocator`, `HeapTable`) from the
//! same `#[repr(C)]` structs the region holds, with loom's atomics (through `crate::sync`),
//! and 2 or 3 threads race through one protocol each. Run them with `scripts/loom.sh`
//! (CI: `LOOM_MAX_PREEMPTIONS=2`; deeper: `scripts/loom.sh 3`). Each model is known to
//! catch at least one deliberate bug, switched on with `--cfg shmstore_mutation="..."`
//! (`scripts/loom.sh --mutations`; see docs/verification.md).

use crate::alloc::testing::HeapAllocator;
use crate::alloc::Block;
use crate::error::Error;
use crate::layout::PAGE;
use crate::sync::UnsafeCell;
use crate::table::testing::HeapTable;
use crate::table::{Entry, Pin};
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

/// The CLOCK hand races a get of its victim: an object is never evicted while pinned
/// (either the get pins first and the eviction backs off, or the get finds it gone).
#[test]
fn loom_eviction_races_pin() {
    loom::model(|| {
        let h = Arc::new(HeapTable::new(32));
        let id = ObjectId::of_key("victim");
        let t = h.get();
        let r = t.insert(&id, &entry(0)).unwrap();
        t.seal(&id, r).unwrap();
        // First pass of the hand: clears the referenced bit.
        assert!(!t.clock_step(r.index as usize).unwrap());
        let hand = {
            let h = h.clone();
            thread::spawn(move || h.get().clock_step(r.index as usize).unwrap())
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
