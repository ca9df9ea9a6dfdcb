//! Full stores: CLOCK eviction without head-of-line blocking, objects that must stay, and
//! creators that wait for space.

use shmstore::{Error, ObjectId, Store, StoreConfig, WhenFull};
use std::time::{Duration, Instant};

const OBJ: usize = 64 << 10;

fn evicting(capacity: u64) -> Store {
    Store::create_anonymous(&StoreConfig {
        when_full: WhenFull::Evict,
        ..StoreConfig::with_capacity(capacity)
    })
    .unwrap()
}

fn key(i: usize) -> ObjectId {
    ObjectId::of_key(format!("obj-{i}"))
}

fn fill(s: &Store, n: usize) {
    for i in 0..n {
        s.put(&key(i), &vec![i as u8; OBJ]).unwrap();
    }
}

#[test]
fn evicts_unpinned_objects_and_skips_pinned_ones_anywhere() {
    let s = evicting(1 << 20);
    fill(&s, 16);
    assert_eq!(s.stats().free, 0);
    // Pin every object but one in the middle: eviction must take that one, not stop at
    // the first pinned object (no head-of-line blocking).
    let pins: Vec<_> = (0..16)
        .filter(|&i| i != 7)
        .map(|i| s.try_get(&key(i)).unwrap())
        .collect();
    s.put(&ObjectId::of_key("new"), &vec![99; OBJ]).unwrap();
    assert!(!s.contains(&key(7)));
    assert_eq!(s.stats().evictions, 1);
    for v in &pins {
        assert!(v.iter().all(|&b| b == v[0]), "a pinned object changed");
    }
    // Everything pinned: nothing can go, the put fails with the numbers after bounded work.
    let newest = s.try_get(&ObjectId::of_key("new")).unwrap();
    match s.put(&ObjectId::of_key("no-room"), &vec![1; OBJ]) {
        Err(Error::Full { requested, .. }) => assert_eq!(requested, OBJ as u64),
        other => panic!("{other:?}"),
    }
    drop((pins, newest));
    s.check_invariants().unwrap();
}

#[test]
fn least_recently_used_goes_first_and_gets_refresh_recency() {
    let s = evicting(1 << 20);
    fill(&s, 16);
    // The first eviction sweeps once (clearing every referenced bit), then evicts.
    s.put(&ObjectId::of_key("x"), &vec![0; OBJ]).unwrap();
    let survivors: Vec<usize> = (0..16).filter(|&i| s.contains(&key(i))).collect();
    assert_eq!(survivors.len(), 15);
    // Use every survivor but one: that one is now the least recently used.
    let victim = survivors[survivors.len() / 2];
    for &i in &survivors {
        if i != victim {
            drop(s.try_get(&key(i)).unwrap());
        }
    }
    drop(s.try_get(&ObjectId::of_key("x")).unwrap());
    s.put(&ObjectId::of_key("y"), &vec![0; OBJ]).unwrap();
    assert!(
        !s.contains(&key(victim)),
        "the unused object should have gone"
    );
    for &i in &survivors {
        if i != victim {
            assert!(s.contains(&key(i)), "recently used object {i} was evicted");
        }
    }
    assert_eq!(s.stats().evictions, 2);
    s.check_invariants().unwrap();
}

#[test]
fn objects_marked_not_evictable_stay() {
    let s = evicting(1 << 20);
    for i in 0..16 {
        let mut c = s.create_object(&key(i), OBJ as u64).unwrap();
        c.set_evictable(i % 2 == 1).unwrap();
        c.seal().unwrap();
    }
    for j in 0..8 {
        s.put(&ObjectId::of_key(format!("new-{j}")), &vec![0; OBJ])
            .unwrap();
    }
    for i in (0..16).step_by(2) {
        assert!(s.contains(&key(i)), "object {i} was marked not evictable");
    }
    assert!(matches!(
        s.put(&ObjectId::of_key("more"), &vec![0; OBJ]),
        Ok(())
    ));
    s.check_invariants().unwrap();
}

#[test]
fn failing_store_fails_and_a_waiting_create_gets_space_when_it_is_freed() {
    let s = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20)).unwrap();
    fill(&s, 16);
    assert!(matches!(
        s.put(&key(100), &[0; 10]),
        Err(Error::Full { .. })
    ));
    assert_eq!(s.stats().evictions, 0);

    // Times out with the numbers.
    let t = Instant::now();
    match s.create_object_wait(&key(100), OBJ as u64, Duration::from_millis(50)) {
        Err(Error::Full { requested, .. }) => assert_eq!(requested, OBJ as u64),
        other => panic!("{other:?}"),
    }
    assert!(t.elapsed() >= Duration::from_millis(50));

    // Woken when another thread frees space.
    let s2 = s.clone();
    let waiter = std::thread::spawn(move || {
        s2.create_object_wait(&key(100), OBJ as u64, Duration::from_secs(30))
            .and_then(|c| c.seal())
    });
    // No sleep needed: the waiter either finds the space or is woken by the free.
    s.delete(&key(3)).unwrap();
    waiter.join().unwrap().unwrap();
    assert!(s.contains(&key(100)));
    // Never-fits is immediate, not a wait.
    let t = Instant::now();
    assert!(matches!(
        s.create_object_wait(&key(101), 2 << 20, Duration::from_secs(30)),
        Err(Error::TooLarge { .. })
    ));
    assert!(t.elapsed() < Duration::from_secs(5));
}
