//! A process killed at *every* point of an operation: the exhaustive side of the chaos
//! test, which kills at random moments.
//!
//! Built with the `kill-points` feature (`cargo test --features kill-points --test
//! kill_points`; `scripts/test.sh` runs it). A kill point is each write of shared state
//! (an atomic store, compare-exchange or read-modify-write, or a futex wake); a process
//! that dies anywhere between two of them leaves what a kill just before the second
//! leaves, because loads change nothing another process can see. For each operation
//! below, a victim process first counts the kill points it passes (`N`), then, for every
//! `k` in `1..=N`, a new victim on a new store, set up the same way, is SIGKILLed just
//! before its `k`th. After each death the test process, attached all along, checks what
//! the product promises of any crash:
//!
//! 0. (first) the test process takes every free page as page runs, so that whatever
//!    the victim left half-freed meets an owner before recovery runs;
//! 1. `recover` leaves no dead client and no owed sweep, and `check_invariants` passes;
//! 2. nothing is left half-created; every object the victim did not touch still holds
//!    its exact bytes, and the one it touched holds its exact bytes or is gone;
//! 3. a getter blocked on the victim's object returns (the object, or `CreatorDied`),
//!    never waiting out its timeout;
//! 4. deleting everything leaves zero bytes used and the whole heap one free run;
//! 5. the store still works: a put, a get and a new attachment.
//!
//! In the rival mode (`SHMSTORE_KILL_POINTS_RIVAL=1`; `scripts/test.sh` runs both) a
//! second process reads, checks and pins the scenario's objects, and puts and deletes
//! its own, throughout each victim's operation, so the deaths happen under contention.

mod common;

use common::{bytes, child, child_role, hear, say, store_with, Cleanup, Proc};
use shmstore::testing::kill_points;
use shmstore::{
    AttachOptions, Error, HugePages, ObjectId, ObjectState, Store, StoreConfig, View, WhenFull,
};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::time::Duration;

const CAPACITY: u64 = 1 << 20;
/// An object every scenario starts with (pages, not a slab: over the largest class).
const BIG: (u8, usize) = (1, 200_000);
/// The object a victim creates (`len` per scenario).
const SUBJECT: u8 = 9;
/// Another object of a holder (`recover`): created, never sealed.
const UNSEALED: u8 = 10;
/// `DeleteEmptiesSlab`: the last object left in a slab that is not its class's current
/// one (which holds `LAST_IN_SLAB + 1`).
const LAST_IN_SLAB: u8 = 5;
/// Objects of this size sit four to a 64 KiB slab.
const SLAB_OBJECT: usize = 16_000;

fn id(key: u8) -> ObjectId {
    ObjectId::of_key([key])
}

/// What a victim does, armed; and how the store is set up before it starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    /// Attach to the store.
    Attach,
    /// Attach to a store whose only free client slot is a dead process's (which held a
    /// pin and an unsealed object): move into it, recovering it first.
    AttachIntoDead,
    /// Drop a pin and leave the store (the victim put an object and pinned `BIG` first).
    Detach,
    /// Put 100 bytes, the first object of its size class: a new slab.
    PutFirstSmall,
    /// Put 100 bytes into a slab that holds two objects already.
    PutSmall,
    /// The same with `put_without_slow_work` and 8 bytes of metadata (the Python
    /// binding's fast path for small puts, run holding the GIL).
    PutQuick,
    /// Put 300,000 bytes (pages), with a getter of another process waiting for it.
    PutLarge,
    /// Create 5,000 bytes, write them and abort.
    CreateAbort,
    /// Get `BIG`, read it and drop the view.
    GetDrop,
    /// Drop the last pin of `BIG`, which the test process deleted meanwhile: the drop
    /// frees its block.
    UnpinDeleted,
    /// Delete `BIG`.
    Delete,
    /// Delete `BIG` while the test process pins it.
    DeletePinned,
    /// Put 300,000 bytes into a full store that evicts (`WhenFull::Evict`).
    PutEvicting,
    /// Put 300,000 bytes into a store full of 16,000-byte objects in slabs, which
    /// evicts: whole slabs must empty before a page run fits.
    PutEvictingSlabs,
    /// Recover a dead process that held a pin and an unsealed object.
    Recover,
    /// Recover a process that died inside allocator steps (a page run and a slab block
    /// taken, a new slab half set up, none of them named by an entry): the recovery owes
    /// the leak sweep, which the victim runs.
    RecoverAndSweep,
    /// Delete `BIG` unless a pin holds it (`delete_unpinned`: the eviction step for one
    /// id), while the test process does not pin it.
    DeleteUnpinned,
    /// Allocate a block outside the table (`raw_alloc`, 5,000 bytes) and free it.
    RawAllocFree,
    /// In a child forked from a process that pins `BIG`: use the inherited store (which
    /// attaches the child as a client of its own and pins the inherited view again in
    /// its name), put 5,000 bytes and read the view. The child is the one killed.
    ForkedChild,
    /// Put 300,000 bytes into a full evicting store where the test process pins `BIG`
    /// and the first object put after it: the hand marks pinned objects EVICTING, sees
    /// their pins and moves them back, and must never evict them.
    PutEvictingPinned,
    /// Delete the last object of a slab that is not its class's current one: the free
    /// empties the slab and retires it.
    DeleteEmptiesSlab,
    /// Get `BIG` with `get_draining` after the test process pinned and deleted it (vLLM's
    /// workers read the items of admitted requests this way), read it and drop the view.
    GetDraining,
}

impl Op {
    const ALL: [Op; 22] = [
        Op::Attach,
        Op::AttachIntoDead,
        Op::Detach,
        Op::PutFirstSmall,
        Op::PutSmall,
        Op::PutQuick,
        Op::PutLarge,
        Op::CreateAbort,
        Op::GetDrop,
        Op::UnpinDeleted,
        Op::Delete,
        Op::DeletePinned,
        Op::PutEvicting,
        Op::PutEvictingSlabs,
        Op::Recover,
        Op::RecoverAndSweep,
        Op::DeleteUnpinned,
        Op::RawAllocFree,
        Op::ForkedChild,
        Op::PutEvictingPinned,
        Op::DeleteEmptiesSlab,
        Op::GetDraining,
    ];

    fn name(self) -> String {
        format!("{self:?}")
    }

    fn parse(s: &str) -> Op {
        *Op::ALL.iter().find(|o| o.name() == s).unwrap()
    }

    /// Whether the victim's put evicts.
    fn evicts(self) -> bool {
        matches!(
            self,
            Op::PutEvicting | Op::PutEvictingSlabs | Op::PutEvictingPinned
        )
    }

    /// Whether a getter of another process waits for the subject meanwhile.
    fn waiter(self) -> bool {
        matches!(self, Op::PutSmall | Op::PutLarge | Op::CreateAbort)
    }

    /// Whether the setup leaves a dead process (`holder`) behind.
    fn dead_holder(self) -> bool {
        matches!(self, Op::Recover | Op::AttachIntoDead | Op::RecoverAndSweep)
    }

    /// The subject's length, if the victim creates it.
    fn subject_len(self) -> Option<usize> {
        match self {
            Op::PutFirstSmall | Op::PutSmall | Op::PutQuick => Some(100),
            Op::PutLarge | Op::PutEvicting | Op::PutEvictingSlabs | Op::PutEvictingPinned => {
                Some(300_000)
            }
            Op::CreateAbort | Op::Detach | Op::ForkedChild => Some(5_000),
            _ => None,
        }
    }
}

/// Child processes: dispatched on `SHMSTORE_CHILD`. Runs only when started by a test below.
#[test]
#[ignore = "child process entry point, started by the other tests"]
fn child_entry() {
    let (role, args) = child_role().expect("child_entry runs only as a child process");
    let path = Path::new(&args[0]);
    match role.as_str() {
        "victim" => {
            let op = Op::parse(&args[1]);
            let kill_at = args[2].parse::<u64>().ok().filter(|&k| k > 0);
            let rival = args[3] == "rival";
            if op == Op::ForkedChild {
                forked_victim(path, kill_at);
            } else {
                let passed = victim(path, op, kill_at, rival);
                say(format!("passed {passed}"));
            }
        }
        // Recovers whatever the victim left, armed (the nested mode).
        "recoverer" => {
            let opts = AttachOptions {
                recover_on_attach: false,
                populate_in_background: false,
                ..AttachOptions::default()
            };
            let store = Store::open_with(path, &opts).unwrap();
            kill_points::arm(args[1].parse::<u64>().ok().filter(|&k| k > 0));
            store.recover().unwrap();
            say(format!("passed {}", kill_points::disarm()));
        }
        // Reads while the victim runs, until the stop file appears (the rival mode).
        "rival" => rival(path, Path::new(&args[1])),
        // Waits for the subject; reports how the get ended.
        "waiter" => {
            let store = Store::open_path(path).unwrap();
            let len: usize = args[1].parse().unwrap();
            match store.get(&id(SUBJECT), Duration::from_secs(30)) {
                Ok(v) => {
                    assert_eq!(&*v, &bytes(u64::from(SUBJECT), len)[..], "wrong bytes");
                    say("got");
                }
                Err(Error::CreatorDied { .. }) => say("creator died"),
                Err(e) => say(format!("error {e}")),
            }
        }
        // Pins `BIG`, starts an object it never seals, and waits to be killed.
        "holder" => {
            let store = Store::open_path(path).unwrap();
            if args[1] == "inside-steps" {
                // Each of these begins an allocator step and never ends it.
                shmstore::testing::leak_inside_allocator_step(&store, 100_000).unwrap();
                shmstore::testing::leak_inside_allocator_step(&store, 3_000).unwrap();
                shmstore::testing::die_in_slab_setup(&store).unwrap();
                say("holding");
                let _ = hear();
                return;
            }
            let pin = store.try_get(&id(BIG.0)).unwrap();
            let mut c = store.create_object(&id(UNSEALED), 5_000).unwrap();
            c.write_at(0, &[7; 5_000]);
            say("holding");
            let _ = hear();
            drop((pin, c));
        }
        other => panic!("unknown role {other}"),
    }
}

/// Keys from 1 up to this one a rival reads: every object a scenario puts, and some it
/// never does. It also reads its own ([`RIVAL_OWN`]).
const SCENARIO_KEYS: u8 = 100;
/// Keys the rival puts and deletes itself (no scenario uses them).
const RIVAL_OWN: std::ops::RangeInclusive<u8> = 200..=207;
/// Lengths of the rival's objects: two slab classes and a page run.
const RIVAL_LENS: [usize; 3] = [100, 3_000, 20_000];

/// The rival mode's second process: until `stop` exists, looks up random keys with
/// `try_get` or `get_draining`, checks the bytes of every view it gets, and holds up to
/// two of them for a while (pins the victim's eviction must step around); and puts and
/// deletes objects of its own keys (100 B to 20 kB: slabs and page runs), so that the
/// victim's allocator and table steps race with another writer's. Whatever it meets of
/// the victim's half-done steps must look like a valid object or none. Now and then it
/// runs `recover` too.
fn rival(path: &Path, stop: &Path) {
    let opts = AttachOptions {
        recover_on_attach: false, // a dead holder is the victim's to recover
        populate_in_background: false,
        ..AttachOptions::default()
    };
    let store = Store::open_with(path, &opts).unwrap();
    let mut x = u64::from(std::process::id()) | 1;
    let mut held: Vec<View> = vec![];
    let (mut looks, mut reads, mut recovered) = (0u64, 0u64, 0u64);
    let mut said = false;
    // A test that failed never writes the stop file: then stop when orphaned.
    let parent = std::os::unix::process::parent_id();
    while !stop.exists() && std::os::unix::process::parent_id() == parent {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        // Half the looks at a scenario's keys, half at the rival's own.
        let key = if x & 0x80 == 0 {
            1 + (x % u64::from(SCENARIO_KEYS)) as u8
        } else {
            RIVAL_OWN.start() + (x % RIVAL_OWN.count() as u64) as u8
        };
        if x & 0x1_f000 == 0 {
            // Now and then, recover: a dead victim may be met by two recoverers at once,
            // and its recovery race the victim's own steps while it still runs.
            recovered += store.recover().unwrap().clients_recovered;
        }
        if RIVAL_OWN.contains(&key) && x & 0x4000 == 0 {
            // Its own key: replace the object (delete it, if there, then put it anew at
            // a random length; a full store, or an evicting one that took it, are
            // answers too).
            match store.delete(&id(key)) {
                Ok(()) | Err(Error::NotFound { .. }) => {}
                Err(e) => panic!("the rival's delete of key {key} failed: {e}"),
            }
            let len = RIVAL_LENS[(x >> 20) as usize % RIVAL_LENS.len()];
            match store.put(&id(key), &bytes(u64::from(key), len)) {
                Ok(()) | Err(Error::Full { .. } | Error::TableFull { .. }) => {}
                Err(e) => panic!("the rival's put of key {key} failed: {e}"),
            }
            continue;
        }
        let got = if x & 0x100 == 0 {
            store.try_get(&id(key))
        } else {
            store.get_draining(&id(key))
        };
        looks += 1;
        match got {
            Ok(v) => {
                assert_eq!(
                    &*v,
                    &bytes(u64::from(key), v.len())[..],
                    "the rival read wrong bytes for key {key}"
                );
                reads += 1;
                if held.len() < 2 && x & 0x600 == 0 {
                    held.push(v);
                }
            }
            Err(Error::NotFound { .. } | Error::CreatorDied { .. }) => {}
            Err(e) => panic!("the rival's read of key {key} failed: {e}"),
        }
        if x & 0x3800 == 0 {
            held.clear();
        }
        if !said {
            say("reading");
            said = true;
        }
    }
    drop(held);
    say(format!("read {reads} of {looks}, recovered {recovered}"));
}

/// Runs `op` in this (victim) process, armed with `kill_at`; returns the kill points
/// passed. With a `rival` at work meanwhile, its pins and objects may leave a put no
/// room, its pins keep an object from `delete_unpinned`, and its recovery may come
/// first: those are answers, not failures, then.
fn victim(path: &Path, op: Op, kill_at: Option<u64>, rival: bool) -> u64 {
    let subject = || bytes(u64::from(SUBJECT), op.subject_len().unwrap());
    if matches!(op, Op::Attach | Op::AttachIntoDead) {
        kill_points::arm(kill_at);
        let store = Store::open_path(path).unwrap();
        let passed = kill_points::disarm();
        drop(store);
        return passed;
    }
    // Recovery is the operation under test in `Recover`: not on attach there.
    let opts = AttachOptions {
        recover_on_attach: !matches!(op, Op::Recover | Op::RecoverAndSweep),
        ..AttachOptions::default()
    };
    let store = Store::open_with(path, &opts).unwrap();
    let mut held: Option<View> = None;
    if op == Op::Detach {
        store.put(&id(SUBJECT), &subject()).unwrap();
        held = Some(store.try_get(&id(BIG.0)).unwrap());
    }
    if op == Op::UnpinDeleted {
        held = Some(store.try_get(&id(BIG.0)).unwrap());
        say("pinned");
        assert_eq!(hear(), "deleted");
    }
    kill_points::arm(kill_at);
    match op {
        Op::Attach | Op::AttachIntoDead | Op::ForkedChild => unreachable!(),
        Op::Detach => {
            drop(held.take());
            drop(store);
            return kill_points::disarm();
        }
        Op::PutFirstSmall
        | Op::PutSmall
        | Op::PutLarge
        | Op::PutEvicting
        | Op::PutEvictingSlabs
        | Op::PutEvictingPinned => match store.put(&id(SUBJECT), &subject()) {
            Ok(()) => {}
            // The rival's pins and objects may leave no room.
            Err(Error::Full { .. } | Error::TableFull { .. }) if rival => {}
            Err(e) => panic!("put: {e}"),
        },
        Op::PutQuick => {
            let done = store.put_without_slow_work(&id(SUBJECT), &subject(), b"metadata");
            assert!(done.unwrap(), "a store with room declined the quick put");
        }
        Op::CreateAbort => {
            let mut c = store.create_object(&id(SUBJECT), 5_000).unwrap();
            c.write_at(0, &subject());
            c.abort();
        }
        Op::GetDrop => {
            let v = store.get(&id(BIG.0), Duration::from_secs(1)).unwrap();
            assert_eq!(&*v, &bytes(u64::from(BIG.0), BIG.1)[..]);
            drop(v);
        }
        Op::GetDraining => {
            let v = store.get_draining(&id(BIG.0)).unwrap();
            assert_eq!(&*v, &bytes(u64::from(BIG.0), BIG.1)[..]);
            drop(v);
        }
        Op::DeleteEmptiesSlab => store.delete(&id(LAST_IN_SLAB)).unwrap(),
        Op::UnpinDeleted => drop(held.take()),
        Op::Delete | Op::DeletePinned => store.delete(&id(BIG.0)).unwrap(),
        Op::Recover | Op::RecoverAndSweep => {
            let report = store.recover().unwrap();
            if rival && report.clients_recovered == 0 {
                // The rival met the dead process first (it recovers now and then)
                // and recovered it: its work is checked after the victim's.
                assert!(!report.sweep_pending, "{report:?}");
                return kill_points::disarm();
            }
            assert_eq!(report.clients_recovered, 1, "{report:?}");
            if op == Op::RecoverAndSweep {
                assert!(!report.sweep_pending, "{report:?}");
                // (A rival's recovery may run the sweep this one owes first.)
                assert!(report.leaked_blocks_freed >= 2 || rival, "{report:?}");
            }
        }
        Op::DeleteUnpinned => {
            let deleted = store.delete_unpinned(&id(BIG.0)).unwrap();
            assert!(deleted || rival, "nothing pins BIG, yet it was not deleted");
        }
        Op::RawAllocFree => {
            let block = store.raw_alloc(5_000).unwrap();
            store.raw_free(block).unwrap();
        }
    }
    kill_points::disarm()
}

/// `Op::ForkedChild`: pins `BIG`, forks, and has the child run the operation armed. Says
/// what the child says (`passed N`) if it finished, `killed` if it died at its kill point.
fn forked_victim(path: &Path, kill_at: Option<u64>) {
    let opts = AttachOptions {
        populate_in_background: false, // one thread at the fork
        ..AttachOptions::default()
    };
    let store = Store::open_with(path, &opts).unwrap();
    let held = store.try_get(&id(BIG.0)).unwrap();
    // SAFETY: this process (a test child run with --test-threads=1, without a population
    // thread) has no other thread holding a lock the child needs; the child ends with
    // `_exit`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let run = std::panic::catch_unwind(|| {
            kill_points::arm(kill_at);
            let subject = bytes(u64::from(SUBJECT), 5_000);
            store.put(&id(SUBJECT), &subject).unwrap();
            assert_eq!(&*held, &bytes(u64::from(BIG.0), BIG.1)[..]);
            kill_points::disarm()
        });
        let code = match run {
            Ok(passed) => {
                say(format!("passed {passed}"));
                0
            }
            Err(_) => 101,
        };
        // SAFETY: ends the child without running the parent's exit handlers twice.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: `pid` is our child; `status` is a valid place for its status.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    if libc::WIFSIGNALED(status) {
        assert_eq!(
            libc::WTERMSIG(status),
            libc::SIGKILL,
            "the forked child crashed"
        );
        say("killed");
    } else {
        assert_eq!(libc::WEXITSTATUS(status), 0, "the forked child failed");
    }
    drop((held, store));
}

/// The store of one run, set up for `op`: what the test process holds, and what it knows.
struct Setup {
    store: Store,
    _cleanup: Cleanup,
    /// Objects put before the victim started (and not deleted), with their bytes.
    known: Vec<(ObjectId, Vec<u8>)>,
    /// Pins the test process holds while the victim runs, with their objects' bytes.
    pinned: Vec<(View, Vec<u8>)>,
}

fn set_up(op: Op, run: &str) -> Setup {
    let cfg = StoreConfig {
        prefault: false,
        populate_in_background: false,
        huge_pages: HugePages::Off,
        when_full: if op.evicts() {
            WhenFull::Evict
        } else {
            WhenFull::Fail
        },
        // A small table: the CLOCK hand steps through every slot (one write each) on
        // its way to a victim, and each of those is a kill point.
        max_objects: 64,
        // Moving into a dead client's slot happens only when no slot is free.
        max_clients: if op == Op::AttachIntoDead { 2 } else { 16 },
        ..StoreConfig::with_capacity(CAPACITY)
    };
    let (store, cleanup) = store_with(&format!("kp-{run}"), &cfg);
    let mut known = vec![];
    let mut put = |key: u8, len: usize| {
        let data = bytes(u64::from(key), len);
        store.put(&id(key), &data).unwrap();
        known.push((id(key), data));
    };
    put(BIG.0, BIG.1);
    match op {
        Op::PutSmall | Op::PutQuick => {
            put(2, 100);
            put(3, 100);
        }
        Op::DeleteEmptiesSlab => {
            // Keys 2-5 fill one slab, 6 starts the next (now the class's current one).
            for key in 2..=LAST_IN_SLAB + 1 {
                put(key, SLAB_OBJECT);
            }
        }
        Op::PutEvicting | Op::PutEvictingPinned => {
            // Fill the store: 200,000-byte objects until one does not fit.
            let mut key = 20;
            while store.largest_free() >= 200_000 + 4096 {
                put(key, 200_000);
                key += 1;
            }
            assert!(
                store.largest_free() < 300_000,
                "the victim's put must evict"
            );
        }
        Op::PutEvictingSlabs => {
            // Slabs of 64 KiB, four objects each, until no new slab fits.
            let mut key = 20;
            while store.largest_free() >= 64 << 10 {
                put(key, SLAB_OBJECT);
                key += 1;
            }
            let st = store.stats();
            assert_eq!(st.evictions, 0, "the setup must not evict");
            assert!(st.objects > 40, "{st:?}");
        }
        _ => {}
    }
    let mut pinned = vec![];
    let mut pin = |key: u8| {
        let data = known.iter().find(|(i, _)| *i == id(key)).unwrap().1.clone();
        pinned.push((store.try_get(&id(key)).unwrap(), data));
    };
    match op {
        Op::DeletePinned => pin(BIG.0),
        Op::PutEvictingPinned => {
            // `BIG` and the object after it by address: the hand meets pinned objects
            // and widening has a pinned neighbour.
            pin(BIG.0);
            pin(20);
        }
        Op::GetDraining => {
            pin(BIG.0);
            store.delete(&id(BIG.0)).unwrap();
            known.retain(|(i, _)| *i != id(BIG.0));
        }
        Op::DeleteEmptiesSlab => {
            for key in 2..LAST_IN_SLAB {
                store.delete(&id(key)).unwrap();
            }
            known.retain(|(i, _)| !(2..LAST_IN_SLAB).any(|k| *i == id(k)));
        }
        _ => {}
    }
    if op.dead_holder() {
        let kind = if op == Op::RecoverAndSweep {
            "inside-steps"
        } else {
            "pin-and-create"
        };
        let mut holder = child("holder", &store, &[kind.to_string()]);
        assert_eq!(holder.recv(), "holding");
        holder.child.kill().unwrap();
        holder.child.wait().unwrap();
    }
    Setup {
        store,
        _cleanup: cleanup,
        known,
        pinned,
    }
}

/// One run of `op` on a new store: count its kill points (`kill_at = None`) or die at
/// one; then every check. Returns the kill points the victim passed (when it finished).
///
/// With `recoverer = Some(r)`, a recoverer process then runs `recover` armed with `r`
/// (the nested mode of [`every_kill_point`]); the second value returned is the kill
/// points it passed, if it finished. With `rival`, a reader process runs throughout the
/// victim's operation and stops after its death (the rival mode).
fn run(
    op: Op,
    kill_at: Option<u64>,
    recoverer: Option<Option<u64>>,
    rival: bool,
) -> (Option<u64>, Option<u64>) {
    let mut tag = format!("{}-{}", op.name(), kill_at.unwrap_or(0));
    if let Some(r) = recoverer {
        tag += &format!("-recoverer-{}", r.unwrap_or(0));
    }
    if rival {
        tag += "-rival";
    }
    let Setup {
        store,
        _cleanup,
        known,
        pinned,
    } = set_up(op, &tag);
    let path = store.path().unwrap().to_path_buf();

    let waiter = op.waiter().then(|| {
        let len = op.subject_len().unwrap().to_string();
        let w = child("waiter", &store, &[len]);
        w.wait_until_blocked_in_futex(Duration::from_secs(30));
        w
    });
    let stop = path.with_extension("stop");
    let _stop_cleanup = Cleanup(stop.clone());
    let rival = rival.then(|| {
        let mut r = child("rival", &store, &[stop.display().to_string()]);
        assert_eq!(r.recv(), "reading");
        r
    });
    let mode = if rival.is_some() { "rival" } else { "alone" };
    let mut victim = child(
        "victim",
        &store,
        &[op.name(), kill_at.unwrap_or(0).to_string(), mode.into()],
    );
    if op == Op::UnpinDeleted {
        assert_eq!(victim.recv(), "pinned");
        store.delete(&id(BIG.0)).unwrap();
        victim.send("deleted");
    }
    let status = victim.child.wait().unwrap();
    // A forked victim's parent lives on and says whether its child was killed.
    let said = (status.signal() != Some(libc::SIGKILL)).then(|| {
        assert!(status.success(), "{tag}: victim failed: {status}");
        victim.recv()
    });
    let passed = if said.as_deref().is_none_or(|s| s == "killed") {
        assert!(kill_at.is_some(), "{tag}: killed though not armed to die");
        None
    } else {
        let said = said.unwrap();
        let passed: u64 = said.strip_prefix("passed ").unwrap().parse().unwrap();
        // A run may pass fewer kill points than the count (a wake skipped because the
        // waiter was between two sleeps): then it finished, and is checked as such.
        if let Some(k) = kill_at {
            assert!(
                passed < k,
                "{tag}: passed {passed} kill points without dying"
            );
        }
        Some(passed)
    };
    if let Some(mut r) = rival {
        std::fs::write(&stop, b"").unwrap();
        let said = r.recv();
        assert!(said.starts_with("read "), "{tag}: the rival said {said:?}");
        if std::env::var_os("SHMSTORE_KILL_POINTS_RIVAL_SAYS").is_some() {
            eprintln!("{tag}: the rival {said}");
        }
        r.finish();
    }
    let recoverer_passed = recoverer.and_then(|r| {
        let mut p = child("recoverer", &store, &[r.unwrap_or(0).to_string()]);
        let status = p.child.wait().unwrap();
        if status.signal() == Some(libc::SIGKILL) {
            assert!(
                r.is_some(),
                "{tag}: recoverer killed though not armed to die"
            );
            return None;
        }
        assert!(status.success(), "{tag}: recoverer failed: {status}");
        let said = p.recv();
        let n: u64 = said.strip_prefix("passed ").unwrap().parse().unwrap();
        assert!(
            r.is_none_or(|r| n < r),
            "{tag}: recoverer passed {n} without dying"
        );
        Some(n)
    });

    check(op, &tag, &store, &path, known, pinned, waiter);
    (passed, recoverer_passed)
}

/// The waiting getter's answer (it got the subject, or found its creator dead); then it
/// exits, dropping what it held.
fn hear_out(mut w: Proc, tag: &str) {
    let said = w.recv();
    assert!(
        said == "got" || said == "creator died",
        "{tag}: the waiting getter said {said:?}"
    );
    w.finish();
}

fn check(
    op: Op,
    tag: &str,
    store: &Store,
    path: &Path,
    known: Vec<(ObjectId, Vec<u8>)>,
    pinned: Vec<(View, Vec<u8>)>,
    waiter: Option<Proc>,
) {
    // The rival's own objects (rival mode): exact or gone; then out of the way.
    for key in RIVAL_OWN {
        match store.try_get(&id(key)) {
            Ok(v) => assert_eq!(
                &*v,
                &bytes(u64::from(key), v.len())[..],
                "{tag}: rival's {key}"
            ),
            Err(Error::NotFound { .. }) => continue,
            Err(e) => panic!("{tag}: the rival's {key}: {e}"),
        }
        store.delete(&id(key)).unwrap();
    }
    // 0. Another process takes every free page first, as page runs: what the victim left
    //    half-freed must not be in the way of anyone who takes its pages next.
    let fill = fill_free_pages(store);
    // 1. Recovery leaves nothing owed; the allocator and the table agree.
    let mut report = store.recover().unwrap();
    // The waiter (step 3) is a live process, and two things it may still be doing write
    // what `check_invariants` compares, which is exact only while nobody works:
    // * with the subject sealed, it gets it, raising the slot's pin counter before its
    //   process counts the pin (the rival mode found this: counters said 0 pins, the
    //   table 1, with the seal's wake late on a loaded machine);
    // * with the victim dead mid-creation, it recovers the victim itself once it sees
    //   that (a get that meets a dead creator does), and this process's `recover` passes
    //   over a client another live process is recovering: the victim then still counts
    //   as dead here.
    // Either way it answers on its own: hear it out and let it leave, then recover again.
    // (Otherwise it sleeps, holding nothing, until step 3 puts the subject.)
    let mut waiter = waiter;
    if store.contains(&id(SUBJECT)) || store.stats().dead_clients > 0 {
        if let Some(w) = waiter.take() {
            hear_out(w, tag);
            report = store.recover().unwrap();
        }
    }
    let stats = store.stats();
    assert!(!stats.sweep_pending, "{tag}: sweep owed {report:?}");
    store
        .check_invariants()
        .unwrap_or_else(|e| panic!("{tag}: {e}"));
    for (key, len) in fill {
        let v = store.try_get(&id(key)).unwrap();
        assert!(
            v.len() == len && v.iter().all(|&b| b == key),
            "{tag}: fill {key}"
        );
        drop(v);
        store.delete(&id(key)).unwrap();
    }

    // 2. Nothing half-created; exact bytes or gone.
    for o in store.list() {
        assert_ne!(o.state, ObjectState::Creating, "{tag}: left behind {o:?}");
    }
    let may_lose = |id: &ObjectId| {
        (matches!(
            op,
            Op::Delete | Op::DeletePinned | Op::UnpinDeleted | Op::DeleteUnpinned
        ) && *id == self::id(BIG.0))
            || (op == Op::DeleteEmptiesSlab && *id == self::id(LAST_IN_SLAB))
            || matches!(op, Op::PutEvicting | Op::PutEvictingSlabs)
            // Pinned objects are never evicted: only the others may go.
            || (op == Op::PutEvictingPinned && pinned.iter().all(|(v, _)| v.id() != *id))
    };
    for (id, data) in &known {
        match store.try_get(id) {
            Ok(v) => assert_eq!(&*v, &data[..], "{tag}: bytes of {id} changed"),
            Err(Error::NotFound { .. }) if may_lose(id) => {}
            Err(e) => panic!("{tag}: {id} lost: {e}"),
        }
    }
    for (v, data) in &pinned {
        assert_eq!(&**v, &data[..], "{tag}: pinned bytes of {}", v.id());
    }
    let subject = op.subject_len().map(|len| bytes(u64::from(SUBJECT), len));
    match (store.try_get(&id(SUBJECT)), &subject) {
        (Ok(v), Some(data)) => {
            assert_ne!(op, Op::CreateAbort, "{tag}: an aborted object is visible");
            assert_eq!(&*v, &data[..], "{tag}: subject's bytes");
        }
        (Err(Error::NotFound { .. }), _) => {
            assert_ne!(op, Op::Detach, "{tag}: the detaching victim's put was lost");
        }
        (r, _) => panic!("{tag}: subject: {:?}", r.map(|v| v.len())),
    }

    // 3. A getter waiting for the subject returns: put it if the victim died first.
    if let Some(w) = waiter {
        if !store.contains(&id(SUBJECT)) {
            store.put(&id(SUBJECT), subject.as_ref().unwrap()).unwrap();
        }
        hear_out(w, tag);
    }

    // 4. Deleting everything leaves nothing.
    drop(pinned);
    for o in store.list() {
        store.delete(&o.id).unwrap();
    }
    let empty = store.stats();
    assert_eq!(
        (
            empty.used,
            empty.objects,
            empty.draining,
            empty.pins,
            empty.clients,
            empty.dead_clients
        ),
        (0, 0, 0, 0, 1, 0),
        "{tag}: leaked {empty:?}"
    );
    assert_eq!(
        store.largest_free(),
        empty.capacity,
        "{tag}: fragments left"
    );

    // 5. The store still works, for this process and a new attachment.
    let other = Store::open_path(path).unwrap();
    let data = bytes(77, 300_000);
    other.put(&id(77), &data).unwrap();
    assert_eq!(
        &*store.get(&id(77), Duration::from_secs(1)).unwrap(),
        &data[..]
    );
    store.put(&id(78), &[5; 100]).unwrap();
    assert_eq!(&*other.try_get(&id(78)).unwrap(), &[5; 100]);
    store.check_invariants().unwrap();
}

/// Keys of [`fill_free_pages`]'s objects.
const FILL_KEYS: std::ops::RangeInclusive<u8> = 220..=250;

/// Puts page-run objects, each as large as the largest free run, until no run of more
/// than a slab object's size is left; returns their keys and lengths.
fn fill_free_pages(store: &Store) -> Vec<(u8, usize)> {
    let mut put = vec![];
    for key in FILL_KEYS {
        let len = store.largest_free() as usize;
        if len <= 16 << 10 {
            break;
        }
        store.put(&id(key), &vec![key; len]).unwrap();
        put.push((key, len));
    }
    put
}

/// Counts `op`'s kill points, then kills a victim at each one.
///
/// To look at one kill point: `SHMSTORE_KILL_POINT=k` runs only the `k`th, and
/// `SHMSTORE_KILL_POINT_BACKTRACE=1` makes the victim print where it dies.
///
/// Nested mode (`SHMSTORE_KILL_POINTS_NESTED=1`, a long run: minutes per operation): after
/// each death, a recoverer process runs `recover` and is itself killed at each of its own
/// kill points in turn, one run each, before the test process recovers and checks.
/// `SHMSTORE_RECOVERER_KILL_POINT=j` with `SHMSTORE_KILL_POINT=k` runs one such pair.
///
/// Rival mode (`SHMSTORE_KILL_POINTS_RIVAL=1`, every operation; the `..._with_a_rival`
/// tests run it for some in CI): see [`every_kill_point_with_a_rival`].
fn every_kill_point(op: Op) {
    let env = |name: &str| std::env::var(name).ok().and_then(|k| k.parse::<u64>().ok());
    let rival = std::env::var_os("SHMSTORE_KILL_POINTS_RIVAL").is_some()
        // The rival would take the one free slot the victim must not find.
        && op != Op::AttachIntoDead;
    if let Some(k) = env("SHMSTORE_KILL_POINT") {
        let recoverer = env("SHMSTORE_RECOVERER_KILL_POINT").map(Some);
        run(op, Some(k), recoverer, rival);
        return;
    }
    if rival {
        return every_kill_point_with_a_rival(op);
    }
    let nested = std::env::var_os("SHMSTORE_KILL_POINTS_NESTED").is_some();
    let n = run(op, None, None, false)
        .0
        .expect("the counting run finishes");
    assert!(n > 0, "{op:?} passed no kill point: is the feature on?");
    let (mut finished, mut pairs) = (0, 0);
    for k in 1..=n {
        if run(op, Some(k), None, false).0.is_some() {
            finished += 1;
        }
        if nested {
            let m = run(op, Some(k), Some(None), false).1.unwrap_or(0);
            for j in 1..=m {
                run(op, Some(k), Some(Some(j)), false);
            }
            pairs += m;
        }
    }
    // The count is every kill point: a run armed one past it finishes. Should the
    // counting run have skipped a wake (above), the one past it can die at a point the
    // count missed; then a second count must find more (with the count a constant, it
    // would not, and the kills above would have left points untried).
    if run(op, Some(n + 1), None, false).0.is_none() {
        let again = run(op, None, None, false)
            .0
            .expect("the counting run finishes");
        assert!(
            again > n,
            "{op:?}: a run armed at kill point {} died, past the {n} counted",
            n + 1
        );
    }
    if nested {
        eprintln!("{op:?}: killed the recoverer at each of its kill points after each death: {pairs} runs");
    }
    // Each kill point is deterministic but a skipped wake (see `run`): nearly all die.
    assert!(
        finished * 10 <= n,
        "{op:?}: {finished} of {n} runs did not reach their kill point"
    );
    eprintln!("{op:?}: killed at each of {n} kill points ({finished} finished early)");
}

/// The rival mode: the same kills, while a reader process (the rival) looks up, checks
/// and pins the scenario's objects throughout the victim's operation. The victim's
/// kill points then depend on the interleaving (a lost CAS retries; a pin changes what
/// the hand evicts), so this samples: it kills at each `k` up to the alone count, plus
/// as far again, and whatever the run, every check after the death holds, and the
/// rival itself never reads a wrong byte or an error other than "not found" or
/// `CreatorDied`.
fn every_kill_point_with_a_rival(op: Op) {
    let n = run(op, None, None, false)
        .0
        .expect("the counting run finishes");
    let (mut killed, mut finished) = (0, 0);
    for k in 1..=2 * n {
        match run(op, Some(k), None, true).0 {
            None => killed += 1,
            Some(_) => finished += 1,
        }
    }
    assert!(killed > 0, "{op:?}: no run with a rival died");
    eprintln!(
        "{op:?} with a rival: {killed} killed, {finished} finished first ({n} kill points alone)"
    );
}

#[test]
fn killed_while_attaching() {
    every_kill_point(Op::Attach);
}

#[test]
fn killed_while_moving_into_a_dead_processs_slot() {
    every_kill_point(Op::AttachIntoDead);
}

#[test]
fn killed_while_leaving() {
    every_kill_point(Op::Detach);
}

#[test]
fn killed_while_putting_the_first_object_of_a_slab() {
    every_kill_point(Op::PutFirstSmall);
}

#[test]
fn killed_while_putting_into_a_slab() {
    every_kill_point(Op::PutSmall);
}

#[test]
fn killed_while_putting_pages_a_getter_waits_for() {
    every_kill_point(Op::PutLarge);
}

#[test]
fn killed_while_creating_and_aborting() {
    every_kill_point(Op::CreateAbort);
}

#[test]
fn killed_while_getting_and_dropping() {
    every_kill_point(Op::GetDrop);
}

#[test]
fn killed_while_dropping_the_last_pin_of_a_deleted_object() {
    every_kill_point(Op::UnpinDeleted);
}

#[test]
fn killed_while_deleting() {
    every_kill_point(Op::Delete);
}

#[test]
fn killed_while_deleting_what_another_process_pins() {
    every_kill_point(Op::DeletePinned);
}

#[test]
fn killed_while_evicting() {
    every_kill_point(Op::PutEvicting);
}

#[test]
fn killed_while_evicting_slabs() {
    every_kill_point(Op::PutEvictingSlabs);
}

#[test]
fn killed_while_recovering_a_dead_process() {
    every_kill_point(Op::Recover);
}

#[test]
fn killed_while_allocating_and_freeing_a_raw_block() {
    every_kill_point(Op::RawAllocFree);
}

#[test]
fn killed_while_a_forked_child_uses_what_it_inherited() {
    every_kill_point(Op::ForkedChild);
}

#[test]
fn killed_while_recovering_and_sweeping_what_a_dead_process_left_inside_the_allocator() {
    every_kill_point(Op::RecoverAndSweep);
}

#[test]
fn killed_while_deleting_unless_pinned() {
    every_kill_point(Op::DeleteUnpinned);
}

#[test]
fn killed_while_putting_on_the_fast_path() {
    every_kill_point(Op::PutQuick);
}

#[test]
fn killed_while_evicting_around_pinned_objects() {
    every_kill_point(Op::PutEvictingPinned);
}

#[test]
fn killed_while_deleting_the_last_object_of_a_slab() {
    every_kill_point(Op::DeleteEmptiesSlab);
}

#[test]
fn killed_while_reading_a_deleted_object_another_process_pins() {
    every_kill_point(Op::GetDraining);
}
