//! How big the table is, and how full it gets: defaults chosen for the capacity, a table
//! that takes objects well past half its slots, and a 4 GiB store of multimodal-sized
//! items whose bytes run out before its table does.

use shmstore::{Error, ObjectId, Store, StoreConfig};

/// A small deterministic generator (xorshift64*), so every run replays the same trace.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Log-uniform in `lo..hi`: as many items per octave of size.
    fn log_uniform(&mut self, lo: u64, hi: u64) -> u64 {
        let (a, b) = ((lo as f64).ln(), (hi as f64).ln());
        let u = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        ((a + u * (b - a)).exp() as u64).clamp(lo, hi)
    }
}

#[test]
fn defaults_are_chosen_for_the_capacity() {
    for (capacity, objects, clients) in [
        (1u64 << 20, 4096u64, 32u64),
        (1 << 30, 32_768, 32),
        (4 << 30, 131_072, 64),
        (100 << 30, 3_276_800, 64),
    ] {
        assert_eq!(StoreConfig::objects_for(capacity), objects);
        assert_eq!(StoreConfig::clients_for(capacity) as u64, clients);
    }
    // A real store: the table holds max_objects in no more than 2/3 of its slots.
    let s = Store::create_anonymous(&StoreConfig::with_capacity(1 << 30)).unwrap();
    let st = s.stats();
    assert_eq!((st.table_slots, st.max_clients), (65_536, 32), "{st:?}");
    assert!(32_768 * 3 <= st.table_slots * 2);
    // Explicit settings win.
    let cfg = StoreConfig {
        max_objects: 1000,
        max_clients: 5,
        ..StoreConfig::with_capacity(1 << 30)
    };
    let st = Store::create_anonymous(&cfg).unwrap().stats();
    assert_eq!((st.table_slots, st.max_clients), (2048, 5), "{st:?}");
}

/// Puts 1-byte objects named by `key(0)`, `key(1)`, ... until the table refuses one, and
/// checks that it refused past 80% of its slots.
fn fill_the_table(what: &str, key: impl Fn(u64) -> ObjectId) {
    let max_objects = 100_000;
    let s = Store::create_anonymous(&StoreConfig {
        max_objects,
        ..StoreConfig::with_capacity(64 << 20)
    })
    .unwrap();
    let slots = s.stats().table_slots;
    let mut n = 0u64;
    let err = loop {
        match s.put(&key(n), b"x") {
            Ok(()) => n += 1,
            Err(e) => break e,
        }
    };
    let Error::TableFull { objects, slots: s2 } = err else {
        panic!("{what}: expected TableFull after {n} objects, got {err}");
    };
    assert_eq!((objects, s2), (n, slots));
    assert!(
        n >= max_objects,
        "{what}: {n} objects < max_objects {max_objects}"
    );
    let fill = n as f64 / slots as f64;
    assert!(
        fill >= 0.8,
        "{what}: TableFull at {n} of {slots} slots ({fill:.3})"
    );
    s.check_invariants().unwrap();
}

#[test]
fn the_table_takes_objects_past_80_percent_of_its_slots() {
    fill_the_table("hashed keys", |n| ObjectId::of_key(format!("tiny-{n}")));
}

/// Ids a caller makes itself with `from_bytes` are not random: here a counter written into
/// the first or the last 8 bytes, in either byte order. Such ids must spread over the
/// table like hashed ones. (Until layout version 7, a big-endian counter in the last bytes
/// gave every id one home, and the 33rd object was refused.)
#[test]
fn ids_numbered_by_the_caller_fill_the_table_like_hashed_ones() {
    let counter_at = |at: usize, big_endian: bool| {
        move |n: u64| {
            let mut b = [0u8; 32];
            let bytes = if big_endian {
                n.to_be_bytes()
            } else {
                n.to_le_bytes()
            };
            b[at..at + 8].copy_from_slice(&bytes);
            ObjectId::from_bytes(b)
        }
    };
    fill_the_table("big-endian counter at the end", counter_at(24, true));
    fill_the_table("little-endian counter at the start", counter_at(0, false));
}

/// A cache turns over: at `max_objects` live objects, every new object replaces a random
/// old one. Deleted slots are wherever the old ids were and each new id has only its two
/// bins, so a table run near its first-fill limit would refuse some; sized for
/// `max_objects` at no more than 2/3 of its slots, it refuses none.
#[test]
fn a_table_at_max_objects_keeps_taking_new_objects_as_old_ones_go() {
    let max_objects = 43_690u64; // the most a 65,536-slot table is sized for
    let s = Store::create_anonymous(&StoreConfig {
        max_objects,
        ..StoreConfig::with_capacity(64 << 20)
    })
    .unwrap();
    assert!(max_objects * 3 <= s.stats().table_slots * 2);
    let key = |i: u64| ObjectId::of_key(format!("turnover-{i}"));
    let mut live: Vec<u64> = (0..max_objects).collect();
    for &i in &live {
        s.put(&key(i), b"x").unwrap();
    }
    let mut rng = Rng(7);
    for next in max_objects..max_objects * 6 {
        let k = (rng.next() % max_objects) as usize;
        s.delete(&key(live[k])).unwrap();
        live[k] = next;
        if let Err(e) = s.put(&key(next), b"x") {
            panic!("after {} replacements: {e}", next - max_objects);
        }
    }
    assert_eq!(s.stats().objects, max_objects);
    s.check_invariants().unwrap();
}

/// Fills a default 4 GiB store with items of 1 KiB to 64 MiB until it is full, frees a
/// random quarter, and fills it again, three times: the bytes run out (`Full`, with most
/// of the store in use) and the table never does.
#[test]
fn a_default_4_gib_store_of_1kib_to_64mib_items_runs_out_of_bytes_not_table() {
    let capacity = 4u64 << 30;
    let free = nix_free_shm();
    if free < capacity + (1 << 30) {
        eprintln!(
            "skipped: /dev/shm has {} MiB free, this test needs {} MiB",
            free >> 20,
            (capacity + (1 << 30)) >> 20
        );
        return;
    }
    let cfg = StoreConfig {
        populate_in_background: false,
        ..StoreConfig::with_capacity(capacity)
    };
    let s = Store::create_anonymous(&cfg).unwrap();
    let mut rng = Rng(0x5eed_1234);
    let mut live: Vec<ObjectId> = Vec::new();
    let mut next = 0u64;
    for round in 0..3 {
        let used_at_full = loop {
            let size = rng.log_uniform(1 << 10, 64 << 20);
            let id = ObjectId::of_key(format!("item-{next}"));
            next += 1;
            match s.create_object(&id, size) {
                Ok(c) => {
                    c.seal().unwrap();
                    live.push(id);
                }
                Err(Error::Full { .. }) => break s.stats().used,
                Err(e) => panic!("round {round}, {} objects: {e}", live.len()),
            }
        };
        // The first Full comes with at least 90% of the bytes in use; after random
        // deletes the holes are wherever the deleted items were, and a 64 MiB item needs
        // one of 64 MiB (`shmstore bench --scale` compares this with a reference
        // allocator replaying the same trace).
        let occupancy = used_at_full as f64 / capacity as f64;
        let floor = if round == 0 { 0.9 } else { 0.8 };
        assert!(
            occupancy >= floor,
            "round {round}: Full at {occupancy:.3} occupancy, {} objects",
            live.len()
        );
        for _ in 0..live.len() / 4 {
            let k = (rng.next() % live.len() as u64) as usize;
            s.delete(&live.swap_remove(k)).unwrap();
        }
    }
    s.check_invariants().unwrap();
}

/// Free bytes of /dev/shm.
fn nix_free_shm() -> u64 {
    let path = std::ffi::CString::new("/dev/shm").unwrap();
    // SAFETY: statvfs writes into the zeroed struct we own; the path is NUL-terminated.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
        return 0;
    }
    st.f_bavail as u64 * st.f_frsize as u64
}
