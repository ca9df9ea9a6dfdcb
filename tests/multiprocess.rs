//! Multi-process behaviour, with real processes: blocked readers woken by a seal in another
//! process, exact bytes, delete while pinned, abort, duplicates, timeouts, a full store,
//! racing producers, a memfd store shared through /proc, and reads of an object deleted
//! while another process pins it.

mod common;

use common::{bytes, child, child_role, hear, say, spawn, Cleanup, Proc, CHILD_ENTRY};
use shmstore::{Error, ObjectId, Store, StoreConfig};
use std::path::Path;
use std::time::{Duration, Instant};

fn new_store(tag: &str, capacity: u64) -> (Store, Cleanup) {
    common::store_with(tag, &StoreConfig::with_capacity(capacity))
}

/// Child processes: dispatched on `SHMSTORE_CHILD`. Runs only when started by a test below.
#[test]
#[ignore = "child process entry point, started by the other tests"]
fn child_entry() {
    let (role, args) = child_role().expect("child_entry runs only as a child process");
    let store = Store::open_path(Path::new(&args[0])).unwrap();
    let id = |s: &str| s.parse::<ObjectId>().unwrap();
    match role.as_str() {
        // get(id) with a long timeout; report the blake3 of what was read.
        "get-hash" => {
            say("attached");
            let v = store.get(&id(&args[1]), Duration::from_secs(30)).unwrap();
            say(blake3::hash(&v).to_hex());
        }
        // Pin, report, wait for the parent, then read every byte again and report.
        "pin-and-hold" => {
            let v = store.get(&id(&args[1]), Duration::from_secs(30)).unwrap();
            say(format!("pinned {}", v.len()));
            assert_eq!(hear(), "read");
            say(blake3::hash(&v).to_hex());
            assert_eq!(hear(), "drop");
            drop(v);
            say("dropped");
        }
        // On "get": get_draining(id) (the object may be deleted by then), report the
        // blake3 of what was read; read it again on "read", drop it on "drop".
        "get-draining" => {
            say("attached");
            assert_eq!(hear(), "get");
            let v = store.get_draining(&id(&args[1])).unwrap();
            say(blake3::hash(&v).to_hex());
            assert_eq!(hear(), "read");
            say(blake3::hash(&v).to_hex());
            assert_eq!(hear(), "drop");
            drop(v);
            say("dropped");
        }
        // Create, write, then abort (by drop) without sealing.
        "create-abort" => {
            let mut c = store.create_object(&id(&args[1]), 100_000).unwrap();
            c.fill(0xab);
            say("created");
            assert_eq!(hear(), "abort");
            drop(c);
            say("aborted");
        }
        "create-dup" => match store.create_object(&id(&args[1]), 10) {
            Err(Error::AlreadyExists { id: got }) => say(format!("already-exists {got}")),
            other => say(format!("unexpected {other:?}")),
        },
        "get-timeout" => {
            let t = Instant::now();
            match store.get(&id(&args[1]), Duration::from_millis(200)) {
                Err(Error::Timeout { waited, .. }) => say(format!(
                    "timeout {} {}",
                    waited.as_millis(),
                    t.elapsed().as_millis()
                )),
                other => say(format!("unexpected {other:?}")),
            }
        }
        "fill" => {
            let mut n = 0u64;
            loop {
                let data = bytes(n, 256 << 10);
                match store.put(&ObjectId::of_content(&data), &data) {
                    Ok(()) => n += 1,
                    Err(Error::Full {
                        requested,
                        free,
                        largest_free,
                    }) => {
                        say(format!("full {n} {requested} {free} {largest_free}"));
                        break;
                    }
                    Err(e) => {
                        say(format!("unexpected {e:?}"));
                        break;
                    }
                }
            }
        }
        // Race to create the same ids as a sibling; report how many this process won.
        "race-create" => {
            let n: u64 = args[1].parse().unwrap();
            say("ready");
            assert_eq!(hear(), "go");
            let mut won = 0;
            for i in 0..n {
                let id = ObjectId::of_key(format!("race-{i}"));
                if let Ok(mut c) = store.create_object(&id, 64) {
                    c.fill(std::process::id() as u8);
                    c.seal().unwrap();
                    won += 1;
                }
            }
            say(format!("won {won}"));
        }
        // Fill rounds: on each "go", put args[2] objects of args[1] bytes under this
        // process's own keys; report how many failed with Full; delete them on "clear".
        "fill-share" => {
            let size: usize = args[1].parse().unwrap();
            let n: usize = args[2].parse().unwrap();
            let data = vec![7u8; size];
            let me = std::process::id();
            say("ready");
            while hear() == "go" {
                let mut full = 0;
                for i in 0..n {
                    match store.put(&ObjectId::of_key(format!("{me}-{i}")), &data) {
                        Ok(()) => {}
                        Err(Error::Full { .. }) => full += 1,
                        Err(e) => panic!("{e}"),
                    }
                }
                say(format!("full {full}"));
                assert_eq!(hear(), "clear");
                for i in 0..n {
                    let _ = store.delete(&ObjectId::of_key(format!("{me}-{i}")));
                }
                say("cleared");
            }
        }
        // Wait for space in a full store, then create.
        "create-wait" => {
            say("attached");
            let c = store
                .create_object_wait(&id(&args[1]), 256 << 10, Duration::from_secs(30))
                .unwrap();
            c.seal().unwrap();
            say("created");
        }
        // Attach read-only: creating is refused, and writing through a view faults.
        "write-readonly" => {
            drop(store);
            let opts = shmstore::AttachOptions {
                read_only: true,
                ..Default::default()
            };
            let ro = Store::open_with(Path::new(&args[0]), &opts).unwrap();
            match ro.create_object(&ObjectId::of_key("ro"), 1) {
                Err(Error::ReadOnly { .. }) => say("create refused"),
                other => say(format!("unexpected {other:?}")),
            }
            let v = ro.try_get(&id(&args[1])).unwrap();
            say(format!("read {}", v[0]));
            // SAFETY: deliberately writes through a read-only view to prove the kernel stops it;
            // the process is expected to die with SIGSEGV right here.
            unsafe { std::ptr::write_volatile(v.as_ptr() as *mut u8, 0xee) };
            say("wrote");
        }
        other => panic!("unknown role {other}"),
    }
}

#[test]
fn seal_wakes_two_readers_blocked_in_other_processes_and_they_read_exact_bytes() {
    let (store, _c) = new_store("wake", 64 << 20);
    for (round, len) in [1usize, 4096, (3 << 20) + 17].into_iter().enumerate() {
        let data = bytes(round as u64, len);
        let id = ObjectId::of_content(&data);
        let mut readers: Vec<Proc> = (0..2)
            .map(|_| child("get-hash", &store, &[id.to_string()]))
            .collect();
        for r in &mut readers {
            assert_eq!(r.recv(), "attached");
            r.wait_until_blocked_in_futex(Duration::from_secs(20));
        }
        assert!(!store.contains(&id));
        let mut c = store.create_object(&id, len as u64).unwrap();
        c.copy_from_slice(&data);
        c.seal().unwrap();
        for mut r in readers {
            // Content-derived id: the reader's hash of what it saw must be the id itself.
            assert_eq!(r.recv(), id.to_string());
            r.finish();
        }
    }
    store.check_invariants().unwrap();
    // The readers have exited; what they did lives on in the store's counters.
    let st = store.stats();
    assert_eq!(
        (st.creates, st.gets_waited, st.gets_hit, st.gets_missed),
        (3, 6, 0, 0),
        "{st:?}"
    );
}

#[test]
fn delete_while_pinned_by_another_process_keeps_bytes_until_last_unpin() {
    let (store, _c) = new_store("pinned", 16 << 20);
    let data = bytes(7, 1 << 20);
    let id = ObjectId::of_content(&data);
    store.put(&id, &data).unwrap();
    let used = store.stats().used;
    let mut p = child("pin-and-hold", &store, &[id.to_string()]);
    assert_eq!(p.recv(), format!("pinned {}", 1 << 20));
    store.delete(&id).unwrap();
    assert!(!store.contains(&id));
    assert!(matches!(store.try_get(&id), Err(Error::NotFound { .. })));
    let st = store.stats();
    assert_eq!((st.used, st.draining, st.pins), (used, 1, 1), "{st:?}");
    // A new object may not reuse the pinned memory.
    let other = bytes(8, 1 << 20);
    store.put(&ObjectId::of_content(&other), &other).unwrap();
    p.send("read");
    assert_eq!(p.recv(), id.to_string());
    p.send("drop");
    assert_eq!(p.recv(), "dropped");
    p.finish();
    let st = store.stats();
    assert_eq!((st.draining, st.pins, st.objects), (0, 0, 1), "{st:?}");
    store.check_invariants().unwrap();
}

#[test]
fn a_deleted_object_is_found_draining_in_another_process_while_a_pin_holds_it() {
    // vLLM's shape: one process (the engine core) pins an object and passes its id to
    // another (a worker); the object is deleted by hand in between.
    let (store, _c) = new_store("draining", 16 << 20);
    let data = bytes(9, 1 << 20);
    let id = ObjectId::of_content(&data);
    store.put(&id, &data).unwrap();
    let held = store.try_get(&id).unwrap();
    let mut p = child("get-draining", &store, &[id.to_string()]);
    assert_eq!(p.recv(), "attached");
    store.delete(&id).unwrap();
    assert!(matches!(store.try_get(&id), Err(Error::NotFound { .. })));
    p.send("get");
    assert_eq!(p.recv(), id.to_string(), "the exact bytes, draining");
    // The first pin goes; the other process's pin keeps the bytes.
    drop(held);
    let other = bytes(10, 1 << 20);
    store.put(&ObjectId::of_content(&other), &other).unwrap();
    p.send("read");
    assert_eq!(p.recv(), id.to_string());
    assert_eq!(store.stats().draining, 1);
    p.send("drop");
    assert_eq!(p.recv(), "dropped");
    p.finish();
    // Freed with its last pin: nothing to find now.
    let st = store.stats();
    assert_eq!((st.draining, st.pins, st.objects), (0, 0, 1), "{st:?}");
    assert!(matches!(
        store.get_draining(&id),
        Err(Error::NotFound { .. })
    ));
    store.check_invariants().unwrap();
}

#[test]
fn get_draining_finds_the_live_object_first_and_never_another_id() {
    let (store, _c) = new_store("draining-ids", 4 << 20);
    let (a, b) = (ObjectId::of_key("a"), ObjectId::of_key("b"));
    store.put(&a, b"first").unwrap();
    store.put(&b, b"other").unwrap();
    let old = store.try_get(&a).unwrap();
    store.delete(&a).unwrap();
    assert_eq!(&*store.get_draining(&a).unwrap(), b"first");
    assert!(matches!(
        store.get_draining(&ObjectId::of_key("c")),
        Err(Error::NotFound { .. })
    ));
    // Put again under the same id: the live object comes first.
    store.put(&a, b"again").unwrap();
    let again = store.get_draining(&a).unwrap();
    assert_eq!(&*again, b"again");
    // Deleted too, while pinned: two draining objects with the id, either may be found.
    store.delete(&a).unwrap();
    let found = store.get_draining(&a).unwrap();
    assert!(&*found == b"first" || &*found == b"again", "{:?}", &*found);
    drop((found, old));
    assert_eq!(&*store.get_draining(&a).unwrap(), b"again");
    drop(again);
    assert!(matches!(
        store.get_draining(&a),
        Err(Error::NotFound { .. })
    ));
    assert_eq!(&*store.get_draining(&b).unwrap(), b"other");
    let st = store.stats();
    assert_eq!((st.pins, st.draining, st.objects), (0, 0, 1), "{st:?}");
    store.check_invariants().unwrap();
}

#[test]
fn abort_in_another_process_frees_memory_and_the_id() {
    let (store, _c) = new_store("abort", 16 << 20);
    let id = ObjectId::of_key("abort-me");
    let mut p = child("create-abort", &store, &[id.to_string()]);
    assert_eq!(p.recv(), "created");
    let st = store.stats();
    assert_eq!((st.creating, st.used), (1, 25 * 4096), "{st:?}");
    assert!(matches!(store.try_get(&id), Err(Error::NotFound { .. })));
    p.send("abort");
    assert_eq!(p.recv(), "aborted");
    p.finish();
    let st = store.stats();
    assert_eq!((st.creating, st.used, st.objects), (0, 0, 0), "{st:?}");
    store.put(&id, b"second try").unwrap();
    store.check_invariants().unwrap();
}

#[test]
fn duplicate_id_from_another_process_is_already_exists() {
    let (store, _c) = new_store("dup", 1 << 20);
    let id = ObjectId::of_key("dup");
    let unsealed = store.create_object(&id, 10).unwrap();
    let mut p = child("create-dup", &store, &[id.to_string()]);
    assert_eq!(p.recv(), format!("already-exists {id}"));
    p.finish();
    unsealed.seal().unwrap();
    let mut p = child("create-dup", &store, &[id.to_string()]);
    assert_eq!(p.recv(), format!("already-exists {id}"));
    p.finish();
}

#[test]
fn get_times_out_in_another_process() {
    let (store, _c) = new_store("timeout", 1 << 20);
    let id = ObjectId::of_key("never");
    let _unsealed = store.create_object(&id, 10).unwrap();
    let mut p = child("get-timeout", &store, &[id.to_string()]);
    let msg = p.recv();
    let parts: Vec<&str> = msg.split(' ').collect();
    assert_eq!(parts[0], "timeout", "{msg}");
    let waited: u64 = parts[1].parse().unwrap();
    let elapsed: u64 = parts[2].parse().unwrap();
    assert!(waited >= 200 && elapsed >= 200, "{msg}");
    assert!(elapsed < 5000, "{msg}");
    p.finish();
    let st = store.stats();
    assert_eq!(
        (st.gets_missed, st.gets_waited, st.creating),
        (1, 0, 1),
        "{st:?}"
    );
}

#[test]
fn full_store_reports_numbers_and_recovers_after_deletes() {
    let (store, _c) = new_store("full", 4 << 20);
    let mut p = child("fill", &store, &[]);
    let msg = p.recv();
    p.finish();
    let f: Vec<u64> = msg.split(' ').skip(1).map(|x| x.parse().unwrap()).collect();
    assert!(msg.starts_with("full "), "{msg}");
    let (n, requested, free, largest) = (f[0], f[1], f[2], f[3]);
    assert_eq!(n, 16, "4 MiB holds sixteen 256 KiB objects: {msg}");
    assert_eq!(requested, 256 << 10);
    assert!(largest < requested && free < requested, "{msg}");
    let st = store.stats();
    assert_eq!(st.objects, 16);
    // Delete one and the next put fits again.
    let first = bytes(0, 256 << 10);
    store.delete(&ObjectId::of_content(&first)).unwrap();
    let again = bytes(99, 256 << 10);
    store.put(&ObjectId::of_content(&again), &again).unwrap();
    store.check_invariants().unwrap();
}

#[test]
fn racing_producers_in_two_processes_create_each_id_once() {
    let (store, _c) = new_store("race", 16 << 20);
    let n = 2000u64;
    let mut ps: Vec<Proc> = (0..2)
        .map(|_| child("race-create", &store, &[n.to_string()]))
        .collect();
    for p in &mut ps {
        assert_eq!(p.recv(), "ready");
    }
    for p in &mut ps {
        p.send("go");
    }
    let mut total = 0;
    for mut p in ps {
        let msg = p.recv();
        total += msg.strip_prefix("won ").unwrap().parse::<u64>().unwrap();
        p.finish();
    }
    assert_eq!(total, n);
    assert_eq!(store.stats().objects, n);
    for i in 0..n {
        let v = store
            .try_get(&ObjectId::of_key(format!("race-{i}")))
            .unwrap();
        assert!(
            v.iter().all(|&b| b == v[0]),
            "object {i} was written by two processes"
        );
    }
    store.check_invariants().unwrap();
}

#[test]
fn anonymous_store_is_shared_through_proc_fd() {
    use std::os::fd::AsRawFd;
    let store = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20)).unwrap();
    let path = format!("/proc/{}/fd/{}", std::process::id(), store.fd().as_raw_fd());
    let data = bytes(3, 5000);
    let id = ObjectId::of_content(&data);
    let mut p = spawn(CHILD_ENTRY, "get-hash", &[path, id.to_string()]);
    assert_eq!(p.recv(), "attached");
    store.put(&id, &data).unwrap();
    assert_eq!(p.recv(), id.to_string());
    p.finish();
}

#[test]
fn read_only_attach_refuses_creates_and_the_kernel_faults_writes() {
    use std::os::unix::process::ExitStatusExt;
    let (store, _c) = new_store("readonly", 1 << 20);
    let id = ObjectId::of_key("guarded");
    store.put(&id, &[42; 4096]).unwrap();
    let mut p = child("write-readonly", &store, &[id.to_string()]);
    assert_eq!(p.recv(), "create refused");
    assert_eq!(p.recv(), "read 42");
    let status = p.child.wait().unwrap();
    assert_eq!(status.signal(), Some(libc::SIGSEGV), "{status:?}");
    assert!(store.try_get(&id).unwrap().iter().all(|&b| b == 42));
}

#[test]
fn creator_blocked_on_a_full_store_in_another_process_wakes_when_space_is_freed() {
    let (store, _c) = new_store("backpressure", 1 << 20);
    let blocks: Vec<ObjectId> = (0..4u64)
        .map(|k| {
            let data = bytes(k, 256 << 10);
            let id = ObjectId::of_content(&data);
            store.put(&id, &data).unwrap();
            id
        })
        .collect();
    let want = ObjectId::of_key("waiting");
    let mut p = child("create-wait", &store, &[want.to_string()]);
    assert_eq!(p.recv(), "attached");
    p.wait_until_blocked_in_futex(Duration::from_secs(20));
    assert!(!store.contains(&want));
    store.delete(&blocks[2]).unwrap();
    assert_eq!(p.recv(), "created");
    p.finish();
    assert!(store.contains(&want));
    store.check_invariants().unwrap();
}

#[test]
fn producers_filling_a_store_to_just_under_capacity_never_see_a_spurious_full() {
    // 8 producers put 70-page objects (runs straddle bitmap words) into a store that holds
    // exactly as many as they put. Free space only shrinks during a round, so a run still
    // free at its end was free all along: a producer that reported Full while the round
    // ends with such a run gave up on space another producer held only for a moment.
    // (A Full with no run left at the end is the honest kind: racing placements can leave
    // gaps smaller than an object.)
    let size = 70 * 4096;
    let per = [30, 30, 29, 29, 29, 29, 29, 29];
    let (store, _c) = new_store("fill-share", 64 << 20);
    let mut kids: Vec<Proc> = per
        .iter()
        .map(|n| child("fill-share", &store, &[size.to_string(), n.to_string()]))
        .collect();
    for k in &mut kids {
        assert_eq!(k.recv(), "ready");
    }
    let rounds = 60;
    let (mut spurious, mut honest) = (0, 0);
    for _ in 0..rounds {
        for k in &mut kids {
            k.send("go");
        }
        let mut full = 0;
        for k in &mut kids {
            full += k
                .recv()
                .strip_prefix("full ")
                .unwrap()
                .parse::<u64>()
                .unwrap();
        }
        if full > 0 {
            if store.largest_free() >= size as u64 {
                spurious += full;
            } else {
                honest += full;
            }
        }
        store.check_invariants().unwrap();
        for k in &mut kids {
            k.send("clear");
        }
        for k in &mut kids {
            assert_eq!(k.recv(), "cleared");
        }
        assert_eq!(store.stats().used, 0);
    }
    for mut k in kids {
        k.send("done");
        k.finish();
    }
    println!("{rounds} rounds: {spurious} spurious Full, {honest} with no room left");
    assert_eq!(
        spurious, 0,
        "puts failed with Full while a run of their size stayed free"
    );
}
