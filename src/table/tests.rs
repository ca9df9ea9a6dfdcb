//! Unit tests of the object table: neighbourhoods and bins, the slot life cycle, pins
//! of live and dead clients, and eviction against pins.

use super::slot::TAG_MASK;
use super::testing::HeapTable;
use super::*;
use crate::alloc::{BlockKind, CLASS_SIZES};
use crate::layout::{MAX_META, PAGE};
use std::time::{Duration, Instant};

fn e(offset: u64) -> Entry {
    Entry {
        offset,
        len: 10,
        meta_len: 0,
        kind: 1,
        creator: 3,
    }
}

#[test]
fn a_neighbourhood_is_two_distinct_bins_and_distance_inverts_slot() {
    // 1024 slots would take half a minute under miri; 32 and 64 cover the same rules.
    let sizes: &[usize] = if cfg!(miri) {
        &[32, 64]
    } else {
        &[32, 64, 1024]
    };
    for &slots in sizes {
        let h = HeapTable::new(slots);
        let t = h.get();
        for home in 0..slots as u64 {
            let (first, second) = t.bins(home);
            assert_eq!(first, home / BIN);
            assert_ne!(first, second, "home {home} of {slots}");
            assert!(second < slots as u64 / BIN);
            let mut seen = vec![false; slots];
            for d in 0..NEIGHBORHOOD {
                let (i, _) = t.slot(home, d);
                assert!(
                    !std::mem::replace(&mut seen[i], true),
                    "home {home}: slot {i} twice"
                );
                assert_eq!(t.distance(home, i), Some(d));
            }
            if let Some(outside) = (0..slots).find(|&i| !seen[i]) {
                assert_eq!(t.distance(home, outside), None);
            }
        }
    }
}

/// Inserts and seals `id` through `t`.
fn sealed(t: &Table<'_>, id: &ObjectId, entry: &Entry) -> SlotRef {
    let r = t.insert(id, entry).unwrap();
    t.seal(id, r).unwrap();
    r
}

/// Pins the sealed object `id` through `t`.
fn pinned(t: &Table<'_>, id: &ObjectId) -> SlotRef {
    match t.pin(id).unwrap() {
        Pin::Pinned(r, _) => r,
        other => panic!("{id:?} not pinned: {other:?}"),
    }
}

/// `n` ids that share one home in `t`, and that home. Built from counters, not hashed
/// keys: cheap enough for miri.
fn ids_of_one_home(t: &Table<'_>, n: usize) -> (u64, Vec<ObjectId>) {
    let id_of = |k: u64| {
        let mut b = [0u8; 32];
        b[..8].copy_from_slice(&k.to_le_bytes());
        ObjectId::from_bytes(b)
    };
    let home = t.home(&id_of(0));
    let same: Vec<ObjectId> = (0..100_000)
        .map(id_of)
        .filter(|id| t.home(id) == home)
        .take(n)
        .collect();
    assert_eq!(same.len(), n);
    (home, same)
}

#[test]
fn inserts_move_to_the_second_bin_when_the_first_fills() {
    let h = HeapTable::new(64);
    let t = h.get();
    // Ids sharing one home, until its neighbourhood (both bins) is full.
    let (home, same) = ids_of_one_home(&t, NEIGHBORHOOD as usize + 1);
    for id in &same[..NEIGHBORHOOD as usize] {
        t.insert(id, &e(0)).unwrap();
    }
    let b = t.buckets[home as usize].load(Ordering::Relaxed) as u32;
    assert_eq!(b, u32::MAX, "every slot of both bins is this home's");
    assert!(matches!(
        t.insert(&same[NEIGHBORHOOD as usize], &e(0)),
        Err(Error::TableFull {
            objects: 32,
            slots: 64
        })
    ));
}

/// The two-choice rule ([`ROOM_TO_SPARE`]): an insert stays in its home's first bin while
/// that has room to spare, then takes whichever bin has more free slots (the first on a
/// tie). The table's fill at its first full neighbourhood rests on it (tests/sizing.rs).
#[test]
fn an_insert_takes_the_first_bin_while_it_has_room_to_spare_then_the_emptier() {
    let h = HeapTable::new(64);
    let t = h.get();
    let (home, same) = ids_of_one_home(&t, NEIGHBORHOOD as usize);
    let (mut first_free, mut second_free) = (BIN as u32, BIN as u32);
    let mut landed = String::new();
    let mut expected = String::new();
    for id in &same {
        let to_second = first_free < ROOM_TO_SPARE && second_free > first_free;
        expected.push(if to_second { '2' } else { '1' });
        let r = t.insert(id, &e(0)).unwrap();
        let d = t.distance(home, r.index as usize).unwrap();
        if d < BIN {
            first_free -= 1;
            landed.push('1');
        } else {
            second_free -= 1;
            landed.push('2');
        }
    }
    // Nine in the first bin (16 free down to 8), nine in the second (down to 7), then
    // turn about.
    assert!(expected.starts_with("111111111222222222121"), "{expected}");
    assert_eq!(landed, expected);
}

/// A draining lookup scans the whole neighbourhood, where deleted entries of other ids of
/// the same home lie too: it adopts only an entry with its own id.
#[test]
fn a_draining_lookup_adopts_only_its_own_id_among_deleted_neighbours() {
    let h = HeapTable::new(64);
    let t = h.get();
    let (_, ids) = ids_of_one_home(&t, 3);
    let mut pins = Vec::new();
    for (k, id) in ids[..2].iter().enumerate() {
        let r = t.insert(id, &e(64 * k as u64)).unwrap();
        t.seal(id, r).unwrap();
        let Pin::Pinned(p, _) = t.pin(id).unwrap() else {
            panic!("sealed object not pinned")
        };
        assert_eq!(t.delete(id).unwrap(), None, "pinned: draining, not freed");
        pins.push(p);
    }
    for (k, id) in ids[..2].iter().enumerate() {
        let (r, entry) = t.pin_draining(id).unwrap().expect("its deleted entry");
        assert_eq!((r, entry), (pins[k], e(64 * k as u64)));
        t.unpin(r).unwrap();
    }
    assert_eq!(t.pin_draining(&ids[2]).unwrap(), None, "never stored");
    t.unpin(pins[0]).unwrap();
    assert_eq!(
        t.pin_draining(&ids[0]).unwrap(),
        None,
        "freed with its last pin"
    );
    assert!(t.pin_draining(&ids[1]).unwrap().is_some());
}

#[test]
fn insert_seal_pin_delete_release() {
    let h = HeapTable::new(64);
    let t = h.get();
    let id = ObjectId::of_key("a");
    let r = t.insert(&id, &e(640)).unwrap();
    assert!(matches!(t.pin(&id).unwrap(), Pin::Creating { creator: 3 }));
    assert!(matches!(
        t.insert(&id, &e(0)),
        Err(Error::AlreadyExists { .. })
    ));
    assert!(matches!(t.delete(&id), Err(Error::NotSealed { .. })));
    assert!(!t.names(&id, r), "not sealed yet");
    t.seal(&id, r).unwrap();
    assert!(t.contains_sealed(&id));
    assert!(t.names(&id, r));
    assert!(!t.names(&ObjectId::of_key("b"), r), "another id");
    let Pin::Pinned(p, entry) = t.pin(&id).unwrap() else {
        panic!()
    };
    assert_eq!(p, r);
    assert_eq!(entry, e(640));
    // Delete while pinned: lookups stop at once, the block is not freed yet.
    assert_eq!(t.delete(&id).unwrap(), None);
    assert!(h.freed().is_empty());
    assert!(matches!(t.pin(&id).unwrap(), Pin::Absent));
    assert!(
        !t.names(&id, r),
        "deleted: the pin keeps the slot, not the key"
    );
    assert!(matches!(t.delete(&id), Err(Error::NotFound { .. })));
    // The same id can be created again while the old one drains.
    let r2 = t.insert(&id, &e(1280)).unwrap();
    assert_ne!(r2.index, r.index);
    assert!(
        !t.names(&id, r2) && !t.names(&id, r),
        "the new one is not sealed yet"
    );
    // The last unpin frees the old entry and returns its slot.
    t.unpin(p).unwrap();
    assert_eq!(h.freed(), vec![(r, e(640))]);
    assert_eq!(t.ctl(r.index as usize), Ctl::new(FREE, None, r.gen + 1));
    assert!(t.unpin(p).is_err(), "an unpin without a pin must fail");
    t.abort(&id, r2).unwrap();
    assert_eq!(h.freed()[1], (r2, e(1280)));
    assert_eq!(t.count_live(), 0);
}

#[test]
fn reused_slot_never_matches_old_generation() {
    let h = HeapTable::new(32);
    let t = h.get();
    let a = ObjectId::of_key("a");
    let r = sealed(&t, &a, &e(0));
    assert_eq!(t.delete(&a).unwrap(), Some(e(0)));
    assert_eq!(h.freed(), vec![(r, e(0))]);
    // Every new insert lands somewhere; none may be pinned through the old ref.
    for k in 0..20 {
        let id = ObjectId::of_key(format!("b{k}"));
        let r2 = sealed(&t, &id, &e(64));
        if r2.index == r.index {
            assert_ne!(r2.gen, r.gen);
            assert!(
                t.names(&id, r2) && !t.names(&id, r),
                "an old generation names nothing"
            );
        }
    }
    assert!(t.add_pin(r).is_err());
    assert!(t.unpin(r).is_err());
}

#[test]
fn pins_of_other_clients_keep_the_block_and_dead_ones_are_dropped() {
    let h = HeapTable::new(32);
    let (me, other) = (h.as_client(0), h.as_client(5));
    let id = ObjectId::of_key("shared");
    let r = sealed(&me, &id, &e(0));
    let p = pinned(&other, &id);
    other.add_pin(p).unwrap();
    assert_eq!(me.pins_of(r.index as usize), 2);
    assert_eq!(me.delete(&id).unwrap(), None);
    assert!(h.freed().is_empty(), "freed under another client's pins");
    assert_eq!(h.read_while_pinned(), 0);
    // Client 5 dies holding both pins: dropping its counter frees the block once.
    assert_eq!(me.drop_dead_pins(r.index as usize, 5), Some(e(0)));
    assert_eq!(me.drop_dead_pins(r.index as usize, 5), None);
    assert_eq!(h.freed().len(), 1);
}

#[test]
fn an_adoption_holds_a_deleted_object_until_it_lets_go_and_fails_once_it_is_freed() {
    let h = HeapTable::new(32);
    let (parent, child, late) = (h.as_client(1), h.as_client(2), h.as_client(3));
    let id = ObjectId::of_key("inherited");
    let r = sealed(&parent, &id, &e(0));
    let view = pinned(&parent, &id);
    parent.delete(&id).unwrap();
    let deleted = parent.ctl(r.index as usize);
    assert!(
        child.repin(view).unwrap(),
        "the parent's pin keeps the block"
    );
    let after = parent.ctl(r.index as usize);
    assert_ne!(
        after, deleted,
        "a freer's CAS on the word it read must fail"
    );
    assert_eq!(after, deleted.retagged(), "the adoption moved the tag on");
    assert_eq!((after.state(), after.gen()), (DELETED, r.gen));
    parent.unpin(view).unwrap();
    assert!(h.freed().is_empty(), "freed under the child's pin");
    child.unpin(view).unwrap();
    assert_eq!(h.freed().len(), 1);
    assert!(!late.repin(view).unwrap(), "freed: the adoption must fail");
    assert_eq!(
        late.pins_of(r.index as usize),
        0,
        "a failed adoption leaves no pin"
    );
    // The tag wraps inside its field: state, generation and the never-sealed flag never
    // change.
    let tagged = |tag: u64| Ctl(Ctl::new(DELETED, None, 7).0 | tag << 3);
    assert_eq!(tagged(5).retagged(), tagged(6));
    assert_eq!(tagged(TAG_MASK).retagged(), tagged(0));
    let aborted = Ctl::deleted(7, false);
    assert!(aborted.never_sealed() && !Ctl::deleted(7, true).never_sealed());
    assert!(Ctl(aborted.0 | TAG_MASK << 3).retagged() == aborted);
    assert_eq!((aborted.state(), aborted.gen()), (DELETED, 7));
}

/// An adoption of an object that was not deleted is a plain pin: the slot's word is left
/// as it is (only DELETED words carry a tag).
#[test]
fn an_adoption_of_a_live_object_is_a_pin_that_leaves_its_word_alone() {
    let h = HeapTable::new(32);
    let (parent, child) = (h.as_client(1), h.as_client(2));
    let id = ObjectId::of_key("live");
    let r = sealed(&parent, &id, &e(0));
    let view = pinned(&parent, &id);
    let sealed = parent.ctl(r.index as usize);
    assert!(child.repin(view).unwrap());
    assert_eq!(parent.ctl(r.index as usize), sealed);
    assert_eq!(parent.pins_of(r.index as usize), 2);
    assert!(parent.names(&id, view), "still the object its key names");
}

/// `add_pin` is for a process that already pins the slot (a cloned view): without a pin
/// it is a bug of the caller, at the limit a refusal; both leave the counter as it was.
#[test]
fn add_pin_without_a_pin_is_corrupted_and_at_the_limit_too_many_pins() {
    let h = HeapTable::new(32);
    let t = h.get();
    let id = ObjectId::of_key("cloned");
    let r = sealed(&t, &id, &e(0));
    let i = r.index as usize;
    assert!(matches!(t.add_pin(r), Err(Error::Corrupted { .. })));
    assert_eq!(t.pins_of(i), 0);
    let p = pinned(&t, &id);
    // 60 000 atomic adds would take minutes under miri; the counter is raised directly.
    t.counter(i, t.me).store(PIN_LIMIT, Ordering::SeqCst);
    assert!(matches!(
        t.add_pin(p),
        Err(Error::TooManyPins { limit }) if limit == PIN_LIMIT as u32
    ));
    assert_eq!(t.pins_of(i), PIN_LIMIT as u64);
    t.counter(i, t.me).store(1, Ordering::SeqCst);
    t.add_pin(p).unwrap();
    assert_eq!(t.pins_of(i), 2);
}

/// Recovery reads slot and client indices out of shared memory: out of range, they
/// name nothing.
#[test]
fn recovery_lookups_out_of_range_name_nothing() {
    let h = HeapTable::new(32);
    let t = h.get();
    let id = ObjectId::of_key("pinned");
    let r = sealed(&t, &id, &e(0));
    let _ = pinned(&t, &id);
    let (i, me) = (r.index as usize, t.me as u64);
    assert_eq!(t.counter_of(i, me), 1);
    assert_eq!(t.counter_of(t.slots.len(), me), 0);
    assert_eq!(t.counter_of(i, t.stride as u64), 0);
    assert_eq!(t.drop_dead_pins(t.slots.len(), me), None);
    assert_eq!(t.drop_dead_pins(i, t.stride as u64), None);
    assert_eq!(t.counter_of(i, me), 1, "left as it was");
}

#[test]
fn eviction_skips_pins_and_a_pin_cancels_an_eviction_in_flight() {
    let h = HeapTable::new(32);
    let t = h.get();
    let id = ObjectId::of_key("lru");
    let r = sealed(&t, &id, &e(0));
    let i = r.index as usize;
    assert!(!t.clock_step(i).unwrap(), "first pass only clears the bit");
    let Pin::Pinned(p, _) = h.as_client(1).pin(&id).unwrap() else {
        panic!()
    };
    assert!(!t.clock_step(i).unwrap(), "the get set the bit again");
    assert!(!t.clock_step(i).unwrap(), "pinned objects are skipped");
    assert_eq!(t.ctl(i).state(), SEALED);
    // An eviction in flight (a hand that died after SEALED -> EVICTING) is cancelled
    // by the next pin, and stays readable meanwhile.
    h.slots[i]
        .ctl
        .store(Ctl::new(EVICTING, None, r.gen).0, Ordering::SeqCst);
    assert!(t.contains_sealed(&id));
    let q = pinned(&t, &id);
    assert_eq!(t.ctl(i).state(), SEALED);
    t.unpin(q).unwrap();
    h.as_client(1).unpin(p).unwrap();
    assert!(!t.clock_step(i).unwrap());
    assert!(t.clock_step(i).unwrap());
    assert_eq!(h.freed(), vec![(r, e(0))]);
}

#[test]
fn evicting_one_generation_ignores_the_referenced_bit_but_never_a_pin_or_another_object() {
    let h = HeapTable::new(32);
    let t = h.get();
    let id = ObjectId::of_key("neighbour");
    let r = sealed(&t, &id, &e(0));
    let i = r.index as usize;
    assert!(t.evictable_now(i, r.gen));
    // Another generation: not this object, left alone.
    assert!(!t.evictable_now(i, r.gen + 1));
    assert_eq!(t.evict_step(i, Some(r.gen + 1)).unwrap(), None);
    // Pinned: skipped, and the racy look says so too.
    let Pin::Pinned(p, _) = h.as_client(1).pin(&id).unwrap() else {
        panic!()
    };
    assert!(!t.evictable_now(i, r.gen));
    assert_eq!(t.evict_step(i, Some(r.gen)).unwrap(), None);
    h.as_client(1).unpin(p).unwrap();
    // Just used (referenced bit set by the pin): a CLOCK step would spare it once; this
    // step takes it, and returns its entry.
    assert_eq!(t.evict_step(i, Some(r.gen)).unwrap(), Some(e(0)));
    assert_eq!(h.freed(), vec![(r, e(0))]);
    assert!(!t.evictable_now(i, r.gen));
}

#[test]
fn delete_unpinned_keeps_a_pinned_object_and_takes_an_unpinned_one_whatever_its_flags() {
    let h = HeapTable::new(32);
    let t = h.get();
    let id = ObjectId::of_key("cleared");
    assert!(matches!(
        t.delete_unpinned(&id),
        Err(Error::NotFound { .. })
    ));
    let r = t.insert(&id, &e(0)).unwrap();
    assert!(matches!(
        t.delete_unpinned(&id),
        Err(Error::NotSealed { .. })
    ));
    t.set_no_evict(r).unwrap(); // never evicted, but an explicit delete still applies
    t.seal(&id, r).unwrap();
    let i = r.index as usize;
    // Pinned by another client, and by this one: kept, sealed, nothing freed.
    let Pin::Pinned(p, _) = h.as_client(1).pin(&id).unwrap() else {
        panic!()
    };
    assert_eq!(t.delete_unpinned(&id).unwrap(), None);
    assert_eq!(t.ctl(i).state(), SEALED);
    h.as_client(1).unpin(p).unwrap();
    let q = pinned(&t, &id);
    assert_eq!(t.delete_unpinned(&id).unwrap(), None);
    t.unpin(q).unwrap();
    assert!(h.freed().is_empty());
    // A step another hand left half done (SEALED -> EVICTING, then died) is cancelled,
    // not mistaken for a pin.
    h.slots[i]
        .ctl
        .store(Ctl::new(EVICTING, None, r.gen).0, Ordering::SeqCst);
    assert_eq!(t.delete_unpinned(&id).unwrap(), Some(e(0)));
    assert!(!t.contains_live(&id));
    assert_eq!(h.freed(), vec![(r, e(0))]);
    assert!(matches!(
        t.delete_unpinned(&id),
        Err(Error::NotFound { .. })
    ));
}

#[test]
fn orphans_of_a_dead_client_are_returned() {
    let h = HeapTable::new(32);
    let dead = h.as_client(7);
    let t = h.get();
    let id = ObjectId::of_key("half-made");
    let r = dead.insert(&id, &e(64)).unwrap();
    assert_eq!(t.abort_orphan(r.index as usize, r.gen), (true, Some(e(64))));
    assert_eq!(
        t.abort_orphan(r.index as usize, r.gen),
        (false, None),
        "idempotent"
    );
    assert_eq!(h.freed(), vec![(r, e(64))]);
    assert!(matches!(t.pin(&id).unwrap(), Pin::Absent));
    // A slot left FREEING by a dead freer may still be linked (the freer unlinks after
    // its CAS): returning it to FREE unlinks it.
    let id = ObjectId::of_key("freeing");
    let r = sealed(&t, &id, &e(0));
    let home = t.home(&id);
    assert_ne!(t.buckets[home as usize].load(Ordering::SeqCst) as u32, 0);
    let c = Ctl::new(FREEING, Some(7), r.gen);
    h.slots[r.index as usize].ctl.store(c.0, Ordering::SeqCst);
    assert!(t.reset_orphan(r.index as usize, c));
    assert_eq!(t.buckets[home as usize].load(Ordering::SeqCst) as u32, 0);
    // A slot left RESERVED or FREEING by a dead owner goes back to FREE.
    let s = &h.slots[3];
    for state in [RESERVED, FREEING] {
        let c = Ctl::new(state, Some(7), 9);
        s.ctl.store(c.0, Ordering::SeqCst);
        assert_eq!(c.owner(), Some(7));
        assert!(t.reset_orphan(3, c));
        assert_eq!(t.ctl(3), Ctl::new(FREE, None, 10));
    }
}

#[test]
fn neighbourhood_full_is_table_full() {
    let h = HeapTable::new(32);
    let t = h.get();
    let mut n = 0;
    let err = loop {
        match t.insert(&ObjectId::of_key(format!("{n}")), &e(0)) {
            Ok(_) => n += 1,
            Err(e) => break e,
        }
    };
    assert_eq!(n, 32);
    assert!(matches!(
        err,
        Error::TableFull {
            objects: 32,
            slots: 32
        }
    ));
}

#[test]
fn racing_creates_of_one_id_admit_exactly_one() {
    for round in 0..if cfg!(miri) { 4 } else { 200 } {
        let h = std::sync::Arc::new(HeapTable::new(64));
        let id = ObjectId::of_key(format!("race{round}"));
        let wins: usize = (0..3)
            .map(|k| {
                let h = h.clone();
                std::thread::spawn(move || h.as_client(k).insert(&id, &e(0)).is_ok() as usize)
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap())
            .sum();
        assert_eq!(wins, 1);
    }
}

#[test]
fn pin_wait_wakes_on_seal_and_times_out() {
    for spin in [0, 50, if cfg!(miri) { 500 } else { 1_000_000 }] {
        pin_wait_case(spin);
    }
}

fn pin_wait_case(spin: u64) {
    let h = std::sync::Arc::new(HeapTable::new(64));
    let id = ObjectId::of_key("w");
    let t = h.get();
    let start = Instant::now();
    let p = t
        .pin_wait(&id, Some(start + Duration::from_millis(30)), Duration::ZERO)
        .unwrap();
    assert!(matches!(p, Pin::Absent));
    assert!(start.elapsed() >= Duration::from_millis(29));
    let h2 = h.clone();
    let waiter = std::thread::spawn(move || {
        let t = h2.as_client(1);
        let start = Instant::now();
        let pinned = matches!(
            t.pin_wait(
                &id,
                Some(Instant::now() + Duration::from_secs(60)),
                Duration::from_micros(spin)
            )
            .unwrap(),
            Pin::Pinned(..)
        );
        (pinned, start.elapsed())
    });
    if spin == 0 {
        // Seal only once the waiter sleeps on the futex: the seal's wake must end the
        // sleep, not the waiter's deadline (a lost wake-up shows only as a 60 s wait).
        while t.sleepers(&id) == 0 {
            std::thread::yield_now();
        }
    }
    sealed(&t, &id, &e(0));
    let (pinned, waited) = waiter.join().unwrap();
    assert!(pinned);
    assert!(
        waited < Duration::from_secs(30),
        "woken only by the deadline: {waited:?}"
    );
}

/// `Entry::block` is the one gate between a table entry another process wrote and the
/// heap: every bound it checks is checked here at the value where it starts to fail.
#[test]
fn an_entry_is_a_block_only_where_its_bytes_fit_its_kind_and_the_heap() {
    let heap = 16 * PAGE;
    let entry = |offset, len, meta_len, kind| Entry {
        offset,
        len,
        meta_len,
        kind,
        creator: 0,
    };
    let pages = BlockKind::Pages.encode();
    let block = |e: Entry| {
        e.block(heap)
            .map(|(b, pad)| (b.offset, b.size, b.kind, pad))
    };

    // Metadata is padded to 64 bytes before the payload; a run is whole pages.
    assert_eq!(
        block(entry(PAGE, 10, 100, pages)).unwrap(),
        (PAGE, PAGE, BlockKind::Pages, 128)
    );
    assert_eq!(
        block(entry(0, PAGE - 128 + 1, 100, pages)).unwrap(),
        (0, 2 * PAGE, BlockKind::Pages, 128)
    );
    // An empty object still takes a page.
    assert_eq!(block(entry(0, 0, 0, pages)).unwrap().1, PAGE);
    // Metadata up to its bound, not past it.
    assert!(block(entry(0, 1, MAX_META as u16, pages)).is_ok());
    assert!(block(entry(0, 1, MAX_META as u16 + 1, pages)).is_err());
    // Blocks start on 64 bytes.
    assert!(block(entry(64, 1, 0, pages)).is_ok());
    assert!(block(entry(32, 1, 0, pages)).is_err());
    // A run may end at the heap's end, not a byte past it, wherever it starts.
    assert!(block(entry(15 * PAGE, PAGE, 0, pages)).is_ok());
    assert!(block(entry(15 * PAGE, PAGE + 1, 0, pages)).is_err());
    assert!(block(entry(heap, 1, 0, pages)).is_err());
    assert!(block(entry(u64::MAX - 63, 1, 0, pages)).is_err());
    assert!(block(entry(0, u64::MAX - 63, 64, pages)).is_err());
    // A slab block holds what its class holds, no more.
    for (c, &size) in CLASS_SIZES.iter().enumerate() {
        let kind = BlockKind::Slab(c as u8).encode();
        assert_eq!(
            block(entry(0, size - 64, 1, kind)).unwrap(),
            (0, size, BlockKind::Slab(c as u8), 64)
        );
        assert!(block(entry(0, size - 63, 1, kind)).is_err(), "class {c}");
        assert!(block(entry(heap - size, size, 0, kind)).is_ok());
        assert!(block(entry(heap - size + 64, size, 0, kind)).is_err());
    }
    // Kinds no allocator writes.
    assert!(block(entry(0, 1, 0, CLASS_SIZES.len() as u8 + 1)).is_err());
    assert!(block(entry(0, 1, 0, u8::MAX)).is_err());
}

/// A notify wakes a registered sleeper at once, and so does a nudge: neither leaves it
/// to its timeout (every sleeper has one, so a lost wake-up shows only as a wait of its
/// whole length: 60 s here, against the few microseconds a wake takes). The sleeper
/// follows the protocol: register, check its condition, sleep on the sequence it
/// registered at (a notify between the registration and the sleep is then seen either
/// by the check or by the futex).
#[test]
fn notify_and_nudge_wake_a_registered_sleeper() {
    use crate::sync::AtomicU32;
    for nudge in [false, true] {
        let bucket = std::sync::Arc::new(WaitBucket::default());
        let done = std::sync::Arc::new(AtomicU32::new(0));
        let sleeper = {
            let (bucket, done) = (bucket.clone(), done.clone());
            std::thread::spawn(move || {
                let seq = bucket.register();
                let start = Instant::now();
                if done.load(Ordering::Acquire) == 0 {
                    bucket.sleep(seq, Duration::from_secs(60));
                }
                bucket.unregister();
                start.elapsed()
            })
        };
        while bucket.registered() == 0 {
            std::thread::yield_now();
        }
        done.store(1, Ordering::Release);
        if nudge {
            bucket.nudge();
        } else {
            bucket.notify();
        }
        let slept = sleeper.join().unwrap();
        assert!(
            slept < Duration::from_secs(30),
            "nudge {nudge}: the sleeper waited out its timeout ({slept:?})"
        );
    }
}

/// The never-evict flag is set only on the creation the reference names: not on a
/// later generation's, and not once it is sealed.
#[test]
fn never_evict_is_set_only_on_the_creation_it_names() {
    let h = HeapTable::new(64);
    let t = h.get();
    let id = ObjectId::of_key("kept");
    let r = t.insert(&id, &e(0)).unwrap();
    let stale = SlotRef {
        index: r.index,
        gen: r.gen.wrapping_add(1),
    };
    assert!(t.set_no_evict(stale).is_err());
    t.set_no_evict(r).unwrap();
    t.seal(&id, r).unwrap();
    assert!(t.set_no_evict(r).is_err());
}

/// A sleeper nobody wakes sleeps its whole timeout, on the sequence it registered at;
/// it counts as registered until it unregisters.
#[test]
fn a_sleeper_nobody_wakes_sleeps_its_timeout() {
    let bucket = WaitBucket::default();
    bucket.notify();
    bucket.notify();
    let seq = bucket.register();
    assert_eq!((seq, bucket.sequence(), bucket.registered()), (2, 2, 1));
    let start = Instant::now();
    bucket.sleep(seq, Duration::from_millis(30));
    assert!(start.elapsed() >= Duration::from_millis(30));
    bucket.unregister();
    assert_eq!(bucket.registered(), 0);
}
