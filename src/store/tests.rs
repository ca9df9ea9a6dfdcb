//! Unit tests of the object operations (`mod.rs`) and of what `observe.rs` reports, where
//! they need the store's insides: the wait buckets' sleepers, the process-local count of
//! large writes, the shared count of rebuilt huge pages.

use super::*;
use crate::region::HUGE_PAGE;
use crate::table::Ctl;
use std::thread;

fn store(capacity: u64) -> Store {
    Store::create_anonymous(&StoreConfig::with_capacity(capacity)).unwrap()
}

/// Returns once a getter sleeps on `id`'s wait bucket, and then once it has slept through
/// a few slices of [`CREATOR_CHECK_PERIOD`], so that it has seen the object's creator.
fn wait_until_a_getter_watched_the_creator(s: &Store, id: &ObjectId) {
    let table = s.inner.lookup_table();
    while table.sleepers(id) == 0 {
        thread::yield_now();
    }
    // Not a race papered over: the getter notes the creator at the end of a slice, and
    // each of these periods ends at least one (the test passes without it, and then
    // checks less).
    thread::sleep(CREATOR_CHECK_PERIOD * 3);
}

#[test]
fn a_deadline_past_the_clocks_range_is_far_in_the_future() {
    let now = Instant::now();
    assert_eq!(
        deadline_after(now, Duration::from_secs(5)),
        now + Duration::from_secs(5)
    );
    let far = deadline_after(now, Duration::MAX);
    assert!(
        far >= now + Duration::from_secs(1 << 31),
        "an unbounded wait must not end at once: {:?}",
        far - now
    );
}

/// An unbounded get waits instead of timing out at once (its deadline cannot be computed
/// by adding the timeout).
#[test]
fn a_get_with_an_unbounded_timeout_waits_for_the_seal() {
    let s = store(1 << 20);
    let id = ObjectId::of_key("later");
    let c = s.create_object(&id, 3).unwrap();
    let getter = {
        let s = s.clone();
        thread::spawn(move || s.get(&id, Duration::MAX).map(|v| v.to_vec()))
    };
    while s.inner.lookup_table().sleepers(&id) == 0 {
        thread::yield_now();
    }
    let mut c = c;
    c.copy_from_slice(b"abc");
    c.seal().unwrap();
    assert_eq!(getter.join().unwrap().unwrap(), b"abc");
}

#[test]
fn a_store_debug_prints_its_path_capacity_and_client() {
    let s = store(1 << 20);
    assert_eq!(
        format!("{s:?}"),
        "Store { path: None, capacity: 1048576, client: Some(0) }"
    );
}

/// The largest object fits, one byte more is `TooLarge` with the same figure.
#[test]
fn max_object_size_is_the_largest_object_that_fits() {
    for capacity in [1 << 20, 16 << 20] {
        let s = store(capacity);
        let max = s.max_object_size();
        assert_eq!(max, capacity, "an empty store's largest object is the heap");
        match s.create_object(&ObjectId::of_key("over"), max + 1) {
            Err(Error::TooLarge { requested, max: m }) => {
                assert_eq!((requested, m), (max + 1, max));
            }
            other => panic!("expected TooLarge, got {other:?}"),
        }
        s.put(&ObjectId::of_key("all"), &vec![7; max as usize])
            .unwrap();
    }
}

/// Metadata of exactly 4 KiB is kept; one byte more is refused with both figures.
#[test]
fn metadata_is_limited_to_4_kib_exactly() {
    let s = store(1 << 20);
    let meta: Vec<u8> = (0..MAX_META).map(|i| i as u8).collect();
    let id = ObjectId::of_key("at the limit");
    s.put_with_meta(&id, b"x", &meta).unwrap();
    assert_eq!(s.try_get(&id).unwrap().meta(), &meta[..]);
    let over = vec![1; MAX_META as usize + 1];
    match s.put_with_meta(&ObjectId::of_key("over"), b"x", &over) {
        Err(Error::MetadataTooLarge { len, max }) => {
            assert_eq!((len, max), (4097, 4096));
        }
        other => panic!("expected MetadataTooLarge, got {other:?}"),
    }
}

/// A creation of at least `POPULATE_MIN` bytes is counted as a large write (the creator's
/// background zeroing pauses for it) until it ends; a smaller one is not.
#[test]
fn large_creations_are_counted_while_they_are_written() {
    let s = store(4 << 20);
    let large = &s.inner.large_writes;
    let big = s
        .create_object(&ObjectId::of_key("big"), attachment::POPULATE_MIN)
        .unwrap();
    assert_eq!(large.load(Ordering::Relaxed), 1);
    let small = s
        .create_object(&ObjectId::of_key("small"), attachment::POPULATE_MIN - 1)
        .unwrap();
    assert_eq!(large.load(Ordering::Relaxed), 1);
    big.seal().unwrap();
    assert_eq!(large.load(Ordering::Relaxed), 0);
    drop(small);
    assert_eq!(large.load(Ordering::Relaxed), 0);
}

/// A creator that is alive but slow is waited for: the get times out, it does not report
/// the creator dead however many check periods pass.
#[test]
fn a_get_waits_out_a_live_creator_that_does_not_seal() {
    let s = store(1 << 20);
    let id = ObjectId::of_key("slow");
    let _c = s.create_object(&id, 10).unwrap();
    let timeout = CREATOR_CHECK_PERIOD * 6;
    match s.get(&id, timeout) {
        Err(Error::Timeout { waited, .. }) => assert!(waited >= timeout, "{waited:?}"),
        other => panic!("expected Timeout, got {other:?}"),
    }
}

/// A live creator that aborts while a getter waits: `get_existing` reports the object
/// absent, `get` goes on waiting and finds the object someone puts next. Neither says
/// the creator died.
#[test]
fn a_live_creators_abort_is_a_miss_not_a_death() {
    for wait_if_absent in [false, true] {
        let s = store(1 << 20);
        let id = ObjectId::of_key("aborted");
        let c = s.create_object(&id, 10).unwrap();
        let getter = {
            let s = s.clone();
            thread::spawn(move || {
                let timeout = Duration::from_secs(60);
                let got = if wait_if_absent {
                    s.get(&id, timeout)
                } else {
                    s.get_existing(&id, timeout)
                };
                got.map(|v| v.to_vec())
            })
        };
        wait_until_a_getter_watched_the_creator(&s, &id);
        c.abort();
        if wait_if_absent {
            // Time for the getter to wake to the abort before the put (without it the
            // getter may find the new object first, and the test checks less).
            thread::sleep(CREATOR_CHECK_PERIOD);
            s.put(&id, b"second try").unwrap();
            assert_eq!(getter.join().unwrap().unwrap(), b"second try");
        } else {
            match getter.join().unwrap() {
                Err(Error::NotFound { id: got }) => assert_eq!(got, id),
                other => panic!("expected NotFound, got {other:?}"),
            }
        }
    }
}

/// `get_many` returns one view per id, in order; a missing id ends it with a timeout.
#[test]
fn get_many_returns_each_object_in_order() {
    let s = store(1 << 20);
    let ids: Vec<ObjectId> = (0..4).map(|i| ObjectId::of_key(format!("{i}"))).collect();
    for (i, id) in ids.iter().enumerate() {
        s.put(id, &vec![i as u8; 10 + i]).unwrap();
    }
    let views = s.get_many(&ids, Duration::from_secs(5)).unwrap();
    let got: Vec<Vec<u8>> = views.iter().map(|v| v.to_vec()).collect();
    let want: Vec<Vec<u8>> = (0..4).map(|i| vec![i as u8; 10 + i]).collect();
    assert_eq!(got, want);
    let mut with_missing = ids.clone();
    with_missing.insert(2, ObjectId::of_key("missing"));
    assert!(matches!(
        s.get_many(&with_missing, Duration::from_millis(20)),
        Err(Error::Timeout { .. })
    ));
}

/// The metadata's padding is counted once: an object whose metadata and payload fill the
/// heap exactly fits.
#[test]
fn metadata_and_payload_may_fill_the_heap_exactly() {
    let s = store(1 << 20);
    let max = s.max_object_size();
    let mut c = s
        .create_object_with_meta(&ObjectId::of_key("full"), max - 64, b"m")
        .unwrap();
    c.fill(5);
    c.seal().unwrap();
    assert_eq!(s.stats().free, 0);
}

/// Every operation shows in `stats`, by its documented meaning.
#[test]
fn stats_count_every_kind_of_operation() {
    let s = store(1 << 20);
    let (a, b, c, late) = (
        ObjectId::of_key("a"),
        ObjectId::of_key("b"),
        ObjectId::of_key("c"),
        ObjectId::of_key("late"),
    );
    s.put(&a, &[1; 1000]).unwrap();
    s.put(&b, &[2; 3000]).unwrap();
    let _creating = s.create_object(&c, 10).unwrap();
    let view = s.try_get(&a).unwrap();
    assert!(s.try_get(&ObjectId::of_key("never")).is_err());
    let waiter = {
        let s = s.clone();
        thread::spawn(move || s.get(&late, Duration::from_secs(60)).map(|v| v.len()))
    };
    while s.inner.lookup_table().sleepers(&late) == 0 {
        thread::yield_now();
    }
    s.put(&late, &[3; 10]).unwrap();
    assert_eq!(waiter.join().unwrap().unwrap(), 10);
    s.delete(&b).unwrap();
    s.delete(&a).unwrap(); // draining: `view` pins it
    assert!(matches!(
        s.put(&ObjectId::of_key("too much"), &vec![0; (1 << 20) - 1000]),
        Err(Error::Full { .. })
    ));
    let st = s.stats();
    let want = Stats {
        capacity: 1 << 20,
        used: s.allocated_bytes(),
        free: (1 << 20) - s.allocated_bytes(),
        objects: 1,  // late
        creating: 1, // c
        pins: 1,     // view of a
        draining: 1, // a
        clients: 1,
        table_slots: s.inner.sb.table_slots,
        page_size: crate::layout::PAGE,
        max_clients: s.inner.sb.max_clients,
        creates: 4,
        bytes_created: 1000 + 3000 + 10 + 10,
        deletes: 2,
        gets_hit: 1,
        gets_waited: 1,
        gets_missed: 1,
        full_events: 1,
        ..Default::default()
    };
    assert_eq!(st, want);
    assert!(st.used >= 1000 + 10 + 10, "{st:?}");
    drop(view);
    assert_eq!((s.stats().pins, s.stats().draining), (0, 0));
}

/// Evictions count apart from deletes, with the payload bytes they took back.
#[test]
fn stats_count_evictions_apart_from_deletes() {
    let cfg = StoreConfig {
        when_full: WhenFull::Evict,
        ..StoreConfig::with_capacity(1 << 20)
    };
    let s = Store::create_anonymous(&cfg).unwrap();
    let (x, y, z) = (
        ObjectId::of_key("x"),
        ObjectId::of_key("y"),
        ObjectId::of_key("z"),
    );
    s.put(&x, &vec![1; 600 << 10]).unwrap();
    s.put(&y, &vec![2; 600 << 10]).unwrap(); // evicts x
    assert!(!s.contains(&x) && s.contains(&y));
    let pinned = s.try_get(&y).unwrap();
    assert!(matches!(
        s.put(&z, &vec![3; 600 << 10]),
        Err(Error::Full { .. })
    ));
    let st = s.stats();
    assert_eq!(
        (
            st.creates,
            st.bytes_created,
            st.evictions,
            st.bytes_evicted,
            st.deletes,
            st.full_events
        ),
        (2, 1200 << 10, 1, 600 << 10, 0, 1),
        "{st:?}"
    );
    drop(pinned);
}

/// `stats` reports 2 MiB pages once the creator has rebuilt the whole heap as such (the
/// shared count its background population keeps), the count clamped to the heap.
#[test]
fn the_page_size_shown_follows_the_heap_rebuilt_as_huge_pages() {
    use crate::layout::PAGE;
    for capacity in [1 << 20, 8 << 20] {
        let cfg = StoreConfig {
            huge_pages: crate::HugePages::Off,
            ..StoreConfig::with_capacity(capacity)
        };
        let s = Store::create_anonymous(&cfg).unwrap();
        assert_eq!(s.inner.map.page_size(), PAGE);
        let whole = capacity / HUGE_PAGE * HUGE_PAGE;
        let mut cases = vec![(0, PAGE, 0)];
        if whole > 0 {
            cases.extend([
                (HUGE_PAGE, PAGE, HUGE_PAGE),
                (whole - HUGE_PAGE, PAGE, whole - HUGE_PAGE),
                (whole, HUGE_PAGE, whole),
                (capacity + HUGE_PAGE, HUGE_PAGE, capacity),
            ]);
        }
        for (rebuilt, page_size, shown) in cases {
            s.inner.globals.huge_bytes.store(rebuilt, Ordering::Relaxed);
            let st = s.stats();
            assert_eq!(
                (st.page_size, st.huge_pages, st.huge_page_bytes),
                (page_size, s.inner.map.huge_pages() || shown > 0, shown),
                "capacity {capacity}, rebuilt {rebuilt}"
            );
        }
    }
}

/// `pinned_objects` counts sealed and draining objects with a pin, once each; the listing
/// shows every object with its state, sizes and pins.
#[test]
fn pinned_objects_and_the_listing_show_each_object_as_it_is() {
    let s = store(1 << 20);
    let ids: Vec<ObjectId> = ["once", "twice", "idle", "draining", "creating"]
        .iter()
        .map(ObjectId::of_key)
        .collect();
    for (i, id) in ids[..4].iter().enumerate() {
        s.put_with_meta(id, &vec![0; 100 + i], &vec![0; i]).unwrap();
    }
    let held = [
        s.try_get(&ids[0]).unwrap(),
        s.try_get(&ids[1]).unwrap(),
        s.try_get(&ids[1]).unwrap(),
        s.try_get(&ids[3]).unwrap(),
    ];
    s.delete(&ids[3]).unwrap();
    let _c = s.create_object_with_meta(&ids[4], 104, b"meta").unwrap();
    assert_eq!(s.pinned_objects(), 3);
    let mut listed: Vec<(ObjectId, u64, u16, ObjectState, u64)> = s
        .list()
        .into_iter()
        .map(|o| (o.id, o.len, o.meta_len, o.state, o.pins))
        .collect();
    listed.sort_by_key(|o| o.1);
    let want = vec![
        (ids[0], 100, 0, ObjectState::Sealed, 1),
        (ids[1], 101, 1, ObjectState::Sealed, 2),
        (ids[2], 102, 2, ObjectState::Sealed, 0),
        (ids[3], 103, 3, ObjectState::Draining, 1),
        (ids[4], 104, 4, ObjectState::Creating, 0),
    ];
    assert_eq!(listed, want);
    assert_eq!(s.objects().take(100).count(), 5, "each object once");
    let mut objects = s.objects();
    assert_eq!(format!("{objects:?}"), "Objects { next: 0 }");
    objects.next();
    assert_ne!(format!("{objects:?}"), "Objects { next: 0 }");
    drop(held);
    assert_eq!(s.pinned_objects(), 0);
}

/// A sweep owed while a step is in flight runs as soon as the step ends: `recover` looks
/// again for a quiet moment instead of leaving the sweep to the schedule.
#[test]
fn recover_runs_an_owed_sweep_once_the_step_in_its_way_ends() {
    let s = store(1 << 20);
    s.inner.globals.sweeps_owed.fetch_add(1, Ordering::AcqRel);
    let (entered, told) = std::sync::mpsc::channel();
    let stepping = {
        let s = s.clone();
        thread::spawn(move || {
            let actor = s.inner.actor().unwrap();
            let _step = actor.op();
            entered.send(()).unwrap();
            // A step that lasts a little: the first sweep finds it in flight.
            thread::sleep(Duration::from_millis(30));
        })
    };
    told.recv().unwrap();
    let r = s.recover().unwrap();
    stepping.join().unwrap();
    assert!(!r.sweep_pending, "{r:?}");
    assert_eq!(s.inner.globals.sweeps_owed.load(Ordering::Acquire), 0);
    assert!(!s.stats().sweep_pending);
}

fn corrupted(s: &Store) -> String {
    match s.check_invariants() {
        Err(Error::Corrupted { what }) => what,
        other => panic!("expected Corrupted, got {other:?}"),
    }
}

/// The first slot no object uses.
fn free_slot(s: &Store) -> usize {
    let table = s.inner.lookup_table();
    (0..table.capacity() as usize)
        .find(|&i| table.read_slot(i).is_none())
        .unwrap()
}

/// A slot an attached client is part-way through inserting (RESERVED, its entry not
/// written yet) is no damage: its entry is not read, and it is not an object.
#[test]
fn check_invariants_passes_an_attached_clients_step_in_flight() {
    let s = store(1 << 20);
    s.put(&ObjectId::of_key("a"), &[1; 100]).unwrap();
    let garbage = Entry {
        offset: u64::MAX / 2,
        len: u64::MAX / 2,
        ..Default::default()
    };
    let i = free_slot(&s);
    s.inner
        .lookup_table()
        .write_slot(i, Ctl::new(RESERVED, Some(0), 0), &garbage);
    s.check_invariants().unwrap();
}

/// What no attached client explains is damage: the creator, step owner or pin of a
/// detached client; counters that disagree with the table; blocks that overlap.
#[test]
fn check_invariants_reports_what_no_attached_client_explains() {
    let detached = 7u16;
    let setup = || {
        let s = store(1 << 20);
        let id = ObjectId::of_key("a");
        s.put(&id, &[1; 100]).unwrap();
        s.check_invariants().unwrap();
        let i = s.inner.lookup_table().index_of(&id).unwrap();
        (s, i)
    };

    let (s, _) = setup();
    let creating = ObjectId::of_key("creating");
    let _c = s.create_object(&creating, 10).unwrap();
    s.corrupt_creator(&creating, detached).unwrap();
    assert!(
        corrupted(&s).ends_with("belongs to detached client 7"),
        "{}",
        corrupted(&s)
    );

    let (s, _) = setup();
    let i = free_slot(&s);
    let c = Ctl::new(RESERVED, Some(detached), 0);
    s.inner.lookup_table().write_slot(i, c, &Entry::default());
    assert_eq!(
        corrupted(&s),
        format!("slot {i} ({c:?}) belongs to detached client 7")
    );

    let (s, i) = setup();
    s.inner.lookup_table().set_counter(i, detached, 1);
    assert_eq!(
        corrupted(&s),
        format!("slot {i} is pinned by detached client 7")
    );

    let (s, i) = setup();
    s.inner.lookup_table().set_counter(i, 0, 1);
    assert!(
        corrupted(&s).starts_with("counters say"),
        "{}",
        corrupted(&s)
    );

    let (s, i) = setup();
    let other = ObjectId::of_key("b");
    s.put(&other, &[2; 100]).unwrap();
    let table = s.inner.lookup_table();
    let j = table.index_of(&other).unwrap();
    let (c, _, mut e) = table.read_slot(j).unwrap();
    e.offset = table.read_slot(i).unwrap().2.offset;
    table.write_slot(j, c, &e);
    let what = corrupted(&s);
    assert!(what.contains("overlap"), "{what}");
}
