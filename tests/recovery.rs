//! Crash recovery with real processes killed by SIGKILL: pins and unfinished creations of
//! the dead come back, getters of a dead creator fail fast with `CreatorDied`, a full
//! store reclaims what the dead held, a new process takes over a dead client's slot, and
//! a store can remove itself when its last client leaves, a store whose processes all
//! died is removed by `remove_if_unused` (of any layout version), and a recoverer killed
//! midway is finished by the next one.

mod common;

use common::{child, child_role, hear, say, shmstore_cli, Cleanup, Proc};
use shmstore::{Error, ObjectId, Store, StoreConfig};
use std::path::Path;
use std::time::{Duration, Instant};

fn new_store(tag: &str, cfg: StoreConfig) -> (Store, Cleanup) {
    common::store_with(tag, &cfg)
}

fn kill(mut p: Proc) {
    p.child.kill().unwrap(); // SIGKILL
    p.child.wait().unwrap();
}

/// Child processes: dispatched on `SHMSTORE_CHILD`. Runs only when started by a test below.
#[test]
#[ignore = "child process entry point, started by the other tests"]
fn child_entry() {
    let (role, args) = child_role().expect("child_entry runs only as a child process");
    if role == "build-and-stop" {
        // A creator stopped where a kill while it reserves a large store would leave it.
        let tmp = shmstore::testing::build_store_and_stop(
            Path::new(&args[0]),
            &args[1],
            args[2].parse().unwrap(),
        )
        .unwrap();
        say(tmp.display());
        let _ = hear();
        return;
    }
    // Roles that die in the middle of attaching: they must not attach first.
    if let Some(take_dead) = match role.as_str() {
        "claim-free-and-stall" => Some(false),
        "move-into-dead-and-stall" => Some(true),
        _ => None,
    } {
        let slot = shmstore::testing::claim_slot_and_stop(Path::new(&args[0]), take_dead).unwrap();
        say(format!("claimed {slot}"));
        let _ = hear();
        return;
    }
    if role == "join-and-leave" {
        // A process of a pool (Ray's workers on a node store): attach to the pool's
        // store, creating it if there is none, and leave, over and over. While attached,
        // the store's name must lead to the store this process is attached to.
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::MetadataExt;
        let path = Path::new(&args[0]);
        let cfg = StoreConfig {
            dir: path.parent().unwrap().to_path_buf(),
            remove_when_unused: true,
            populate_in_background: false,
            huge_pages: shmstore::HugePages::Off,
            ..StoreConfig::with_capacity(1 << 20)
        };
        let name = path.file_name().unwrap().to_str().unwrap();
        let identity = |p: &Path| std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
        let mut stranded = 0;
        for _ in 0..args[1].parse::<u32>().unwrap() {
            let store = loop {
                match Store::open_path(path) {
                    Ok(s) => break s,
                    Err(Error::StoreNotFound { .. }) => {}
                    Err(e) => panic!("open: {e}"),
                }
                match Store::create(name, &cfg) {
                    Ok(s) => break s,
                    Err(Error::StoreExists { .. }) => {}
                    Err(e) => panic!("create: {e}"),
                }
            };
            let mine = format!("/proc/self/fd/{}", store.fd().as_raw_fd());
            if identity(Path::new(&mine)) != identity(path) {
                stranded += 1;
            }
        }
        say(format!("stranded {stranded}"));
        return;
    }
    if role == "create-and-drop" {
        // Creators sharing a directory: each create first sweeps the directory for the
        // temporary files of killed creators, while the others' are being made.
        let dir = Path::new(&args[0]);
        let cfg = StoreConfig {
            dir: dir.to_path_buf(),
            remove_when_unused: true,
            populate_in_background: false,
            huge_pages: shmstore::HugePages::Off,
            ..StoreConfig::with_capacity(1 << 20)
        };
        let mut failed = Vec::new();
        for i in 0..args[1].parse::<u32>().unwrap() {
            if let Err(e) = Store::create(&format!("s-{}-{i}", std::process::id()), &cfg) {
                failed.push(e.to_string());
            }
        }
        say(format!("failed {}: {:?}", failed.len(), failed.first()));
        return;
    }
    if role == "failed-attaches" {
        // In a process of its own (one test thread), so that nothing else opens files or
        // maps memory while it counts.
        let fds = || std::fs::read_dir("/proc/self/fd").unwrap().count();
        // Mappings of the store's file only: a sanitizer runtime maps memory of its own
        // while the process runs, so the total count is not the store's to keep.
        let name = Path::new(&args[0])
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let maps = || {
            std::fs::read_to_string("/proc/self/maps")
                .unwrap()
                .lines()
                .filter(|l| l.contains(name.as_str()))
                .count()
        };
        let (f0, m0) = (fds(), maps());
        for _ in 0..200 {
            let r = Store::open_path(Path::new(&args[0]));
            assert!(matches!(r, Err(Error::TooManyClients { max: 1 })), "{r:?}");
        }
        say(format!(
            "fds {f0} -> {}, mappings {m0} -> {}",
            fds(),
            maps()
        ));
        return;
    }
    let opts = shmstore::AttachOptions {
        recover_on_attach: false,
        ..Default::default()
    };
    let store = Store::open_with(Path::new(&args[0]), &opts).unwrap();
    let id = |s: &str| s.parse::<ObjectId>().unwrap();
    match role.as_str() {
        // Pin args[1] three times, start creating args[2] (never sealed), then wait to die.
        "hold-and-create" => {
            let v = store.try_get(&id(&args[1])).unwrap();
            let more = (v.try_clone().unwrap(), v.try_clone().unwrap());
            let mut c = store.create_object(&id(&args[2]), 300_000).unwrap();
            c.fill(7);
            say("holding");
            let _ = hear(); // killed before the parent says anything
            drop((v, more, c));
        }
        // Start creating args[1] of args[2] bytes, never seal.
        "create-only" => {
            let len: u64 = args[2].parse().unwrap();
            let c = store.create_object(&id(&args[1]), len).unwrap();
            say("creating");
            let _ = hear();
            drop(c);
        }
        // Start recovering the dead and stop halfway; wait to be killed.
        "recover-and-stall" => {
            let n = shmstore::testing::interrupted_recovery(&store);
            say(format!("claimed {n}"));
            let _ = hear();
        }
        // Die inside an allocator step: a block claimed that no entry names.
        "leak-and-stall" => {
            let size: u64 = args[1].parse().unwrap();
            shmstore::testing::leak_inside_allocator_step(&store, size).unwrap();
            say("leaked");
            let _ = hear();
        }
        // Take the leak sweep's token (owing a sweep) and wait to die.
        "hold-sweep-token" => {
            shmstore::testing::hold_sweep_token(&store).unwrap();
            say("holding token");
            let _ = hear();
        }
        // Die inside new-slab setup.
        "die-in-slab-setup" => {
            shmstore::testing::die_in_slab_setup(&store).unwrap();
            say("setting up");
            let _ = hear();
        }
        // Hold a raw block (no table entry) until told, then free it.
        "raw-and-hold" => {
            let b = store.raw_alloc(64 << 10).unwrap();
            say("holding raw");
            let _ = hear();
            store.raw_free(b).unwrap();
            say("freed raw");
            let _ = hear();
        }
        // Pin args[1], leave every store as at exit when told, then read the pinned bytes,
        // drop every handle (which must neither unpin nor detach any more) and exit.
        "pin-then-leave" => {
            let v = store.try_get(&id(&args[1])).unwrap();
            say("pinned");
            let _ = hear();
            shmstore::leave_all_at_exit();
            say("left");
            let _ = hear();
            say(format!("still reads {}", v.len()));
            drop((v, store));
            say("dropped");
            let _ = hear();
        }
        // Attach and exit cleanly when told.
        "attach" => {
            say("attached");
            let _ = hear();
        }
        other => panic!("unknown role {other}"),
    }
}

#[test]
fn pins_and_creations_of_a_killed_process_are_reclaimed() {
    let (store, _c) = new_store("reclaim", StoreConfig::with_capacity(8 << 20));
    let held = ObjectId::of_key("held");
    store.put(&held, &vec![1u8; 500_000]).unwrap();
    let pending = ObjectId::of_key("pending");
    let mut p = child(
        "hold-and-create",
        &store,
        &[held.to_string(), pending.to_string()],
    );
    assert_eq!(p.recv(), "holding");
    kill(p);
    let st = store.stats();
    assert_eq!((st.dead_clients, st.pins, st.creating), (1, 3, 1), "{st:?}");
    // Deleting the pinned object only unlinks it: the dead process's pins hold the block.
    store.delete(&held).unwrap();
    assert_eq!(store.stats().draining, 1);
    let r = store.recover().unwrap();
    assert_eq!(r.clients_recovered, 1, "{r:?}");
    assert_eq!(r.pins_released, 3, "{r:?}");
    assert_eq!(r.creations_aborted, 1, "{r:?}");
    assert_eq!(
        r.bytes_reclaimed,
        500_000u64.div_ceil(4096) * 4096 + 300_000u64.div_ceil(4096) * 4096
    );
    let st = store.stats();
    assert_eq!(
        (
            st.used,
            st.objects,
            st.draining,
            st.creating,
            st.pins,
            st.dead_clients
        ),
        (0, 0, 0, 0, 0, 0),
        "{st:?}"
    );
    assert_eq!(
        (st.recovered_clients, st.reclaimed_bytes),
        (1, r.bytes_reclaimed)
    );
    assert_eq!(store.largest_free(), st.capacity);
    store.check_invariants().unwrap();
    // The aborted id can be created again.
    store.put(&pending, b"again").unwrap();
    // Recovery is idempotent: nothing left to do.
    assert_eq!(store.recover().unwrap().clients_recovered, 0);
}

#[test]
fn a_get_waiting_on_a_killed_creator_fails_fast_with_creator_died() {
    let (store, _c) = new_store("creator-died", StoreConfig::with_capacity(4 << 20));
    let id = ObjectId::of_key("never-sealed");
    let mut p = child("create-only", &store, &[id.to_string(), "1000".into()]);
    assert_eq!(p.recv(), "creating");
    let pid = p.child.id() as u64;
    let s2 = store.clone();
    let waiter = std::thread::spawn(move || {
        let t = Instant::now();
        (s2.get(&id, Duration::from_secs(60)), t.elapsed())
    });
    // Whether the getter is already asleep on the unsealed object when the creator dies
    // or only meets it afterwards, it must give up well before its 60 s timeout.
    kill(p);
    let (res, waited) = waiter.join().unwrap();
    match res {
        Err(e @ Error::CreatorDied { pid: got, .. }) => {
            assert_eq!(got, pid);
            assert!(e.to_string().contains("died"), "{e}");
        }
        other => panic!("expected CreatorDied, got {other:?}"),
    }
    assert!(waited < Duration::from_secs(5), "waited {waited:?}");
    // The getter recovered the creator on its way out.
    let st = store.stats();
    assert_eq!((st.used, st.creating, st.dead_clients), (0, 0, 0), "{st:?}");
}

#[test]
fn a_full_store_reclaims_what_a_killed_process_held() {
    let cap = 4 << 20;
    let (store, _c) = new_store("full", StoreConfig::with_capacity(cap));
    let big = ObjectId::of_key("hog");
    let mut p = child("create-only", &store, &[big.to_string(), cap.to_string()]);
    assert_eq!(p.recv(), "creating");
    kill(p);
    // The whole heap is held by the dead creator's unsealed object; the allocation finds
    // the store full, recovers the dead client and succeeds.
    store
        .put(&ObjectId::of_key("next"), &vec![3u8; cap as usize])
        .unwrap();
    let st = store.stats();
    assert_eq!((st.recovered_clients, st.objects), (1, 1), "{st:?}");
}

#[test]
fn a_new_process_takes_over_a_dead_clients_slot_when_none_is_free() {
    let cfg = StoreConfig {
        max_clients: 2,
        ..StoreConfig::with_capacity(1 << 20)
    };
    let (store, c) = new_store("takeover", cfg);
    let id = ObjectId::of_key("x");
    store.put(&id, b"abc").unwrap();
    let mut p = child(
        "hold-and-create",
        &store,
        &[id.to_string(), ObjectId::of_key("y").to_string()],
    );
    assert_eq!(p.recv(), "holding");
    kill(p);
    // Both client slots are taken (us and the dead child): attaching takes over the dead
    // one, after returning what it held.
    let again = Store::open_path(&c.0).unwrap();
    let st = again.stats();
    assert_eq!(
        (st.clients, st.dead_clients, st.pins, st.creating),
        (2, 0, 0, 0),
        "{st:?}"
    );
    assert_eq!(&*again.try_get(&id).unwrap(), b"abc");
    again.check_invariants().unwrap();
}

/// A store that removes itself when unused, and a child process attached to it.
fn self_removing_store_and_a_child(tag: &str) -> (Store, Cleanup, Proc) {
    let cfg = StoreConfig {
        remove_when_unused: true,
        ..StoreConfig::with_capacity(1 << 20)
    };
    let (store, c) = new_store(tag, cfg);
    let mut p = child("attach", &store, &[]);
    assert_eq!(p.recv(), "attached");
    (store, c, p)
}

#[test]
fn a_store_can_remove_itself_when_its_last_client_leaves() {
    let (store, c, p) = self_removing_store_and_a_child("autoremove");
    drop(store);
    assert!(c.0.exists(), "another client is still attached");
    kill(p);
    // The last live client is now whoever attaches and leaves: it recovers the dead
    // child, sees nobody left, and removes the file.
    drop(Store::open_path(&c.0).unwrap());
    assert!(!c.0.exists(), "the store should be gone");
}

/// The last live client of a self-removing store removes it as it leaves even when a
/// dead client was never recovered (nobody attached since it died): it recovers the dead
/// one first.
#[test]
fn a_self_removing_store_goes_with_its_last_live_client_though_a_dead_one_was_never_recovered() {
    let (store, c, p) = self_removing_store_and_a_child("autoremove-dead");
    kill(p);
    assert_eq!(store.stats().dead_clients, 1);
    drop(store);
    assert!(!c.0.exists(), "the store should be gone");
}

#[test]
fn a_process_that_leaves_at_exit_no_longer_keeps_the_store_in_use() {
    // vLLM kills its workers at shutdown and its front-end exits with its handle still
    // alive: the front-end's exit hook leaves, and then the last one out removes the file.
    let (store, c) = new_store("leave-at-exit", StoreConfig::with_capacity(1 << 20));
    let id = ObjectId::of_key("pinned");
    store.put(&id, b"abcd").unwrap();
    let mut p = child("pin-then-leave", &store, &[id.to_string()]);
    assert_eq!(p.recv(), "pinned");
    assert_eq!(store.stats().pins, 1);
    drop(store);
    assert!(
        !Store::remove_if_unused(&c.0).unwrap(),
        "the child is attached"
    );
    p.send("leave");
    assert_eq!(p.recv(), "left");
    // The child still runs, but no longer counts as attached.
    assert!(p.child.try_wait().unwrap().is_none());
    let again = Store::open_path(&c.0).unwrap();
    let st = again.stats();
    assert_eq!(
        (st.clients, st.pins),
        (1, 0),
        "the child's pin was reclaimed: {st:?}"
    );
    // Its handles still map the memory, and dropping them changes nothing here.
    p.send("read");
    assert_eq!(p.recv(), "still reads 4");
    assert_eq!(p.recv(), "dropped");
    let st = again.stats();
    assert_eq!((st.clients, st.pins), (1, 0), "{st:?}");
    again.check_invariants().unwrap();
    drop(again);
    assert!(Store::remove_if_unused(&c.0).unwrap());
    assert!(!c.0.exists());
    p.send("exit");
    p.finish();
}

#[test]
fn a_store_left_by_a_crashed_run_is_detected_and_reused() {
    let (store, c) = new_store("stale", StoreConfig::with_capacity(1 << 20));
    let id = ObjectId::of_key("survivor");
    store.put(&id, b"kept").unwrap();
    let mut p = child("attach", &store, &[]);
    assert_eq!(p.recv(), "attached");
    // Our run ends; the child's crashes: the file is left with one dead client in it.
    drop(store);
    kill(p);
    let reopened = Store::open_path(&c.0).unwrap();
    let st = reopened.stats();
    assert_eq!(st.recovered_clients, 1, "{st:?}");
    assert_eq!(&*reopened.try_get(&id).unwrap(), b"kept");
}

/// Bytes of memory a file holds (its allocated blocks).
fn held_bytes(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).unwrap().blocks() * 512
}

#[test]
fn a_creator_killed_before_publishing_its_store_leaves_nothing_for_long() {
    // A directory of its own: what is in it at the end is this test's doing.
    let dir = std::env::temp_dir().join(format!("shmstore-test-creations-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir(&dir).unwrap();
    struct RemoveDir(std::path::PathBuf);
    impl Drop for RemoveDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _guard = RemoveDir(dir.clone());
    let cfg = StoreConfig {
        dir: dir.clone(),
        ..StoreConfig::with_capacity(1 << 20)
    };
    let capacity = 64u64 << 20;
    let mut p = common::spawn(
        common::CHILD_ENTRY,
        "build-and-stop",
        &[
            dir.display().to_string(),
            "big".into(),
            capacity.to_string(),
        ],
    );
    let tmp = std::path::PathBuf::from(p.recv());
    assert!(tmp.starts_with(&dir), "{tmp:?}");
    assert!(
        held_bytes(&tmp) >= capacity,
        "the creator reserved its memory"
    );
    assert!(!dir.join("big").exists(), "not published");

    // While its creator lives, another creation in the directory leaves its file alone.
    let other = Store::create("other", &cfg).unwrap();
    assert!(tmp.exists(), "a live creator's file was removed");
    other.unlink().unwrap();
    drop(other);

    // Killed: the next creation in the directory removes the file, and with it the
    // memory it held; the name it was building is free.
    kill(p);
    assert!(tmp.exists(), "nothing removes it before a sweep");
    let next = Store::create("next", &cfg).unwrap();
    assert!(!tmp.exists(), "the killed creator's file is still there");
    let mut left: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["next"]);
    let big = Store::create("big", &cfg).unwrap();
    big.unlink().unwrap();
    next.unlink().unwrap();
}

#[test]
fn a_store_whose_processes_all_died_is_removed_and_one_in_use_is_not() {
    let (store, c) = new_store("remove-unused", StoreConfig::with_capacity(1 << 20));
    let mut p = child("attach", &store, &[]);
    assert_eq!(p.recv(), "attached");
    drop(store);
    // The child is attached (and alive): the store stays.
    assert!(!Store::remove_if_unused(&c.0).unwrap());
    assert!(c.0.exists());
    kill(p);
    // It died with its slot taken (the table still names it); the kernel dropped its
    // lock, and that is what counts.
    assert!(Store::remove_if_unused(&c.0).unwrap());
    assert!(!c.0.exists());
}

#[test]
fn a_process_attaching_as_the_store_is_removed_is_never_left_alone_with_it() {
    // The name goes between the moment a process opens the file and the moment it locks
    // its client slot. Attaching to the removed file would leave that process working on
    // a store nobody else can find, while every later process makes a new one under the
    // name. It opens the name again instead.
    let (store, c) = new_store(
        "removed-while-attaching",
        StoreConfig::with_capacity(1 << 20),
    );
    drop(store);
    let opened = shmstore::testing::open_path_after(&c.0, || {
        assert!(Store::remove_if_unused(&c.0).unwrap());
    });
    assert!(
        matches!(opened, Err(Error::StoreNotFound { .. })),
        "attached to a store whose name was removed: {:?}",
        opened.map(|s| s.stats().clients)
    );

    // A new store took the name meanwhile: the process attaches to that one, which
    // everyone else uses.
    let cfg = StoreConfig::with_capacity(1 << 20);
    let name = c.0.file_name().unwrap().to_str().unwrap().to_string();
    drop(Store::create(&name, &cfg).unwrap());
    let mut successor = None;
    let opened = shmstore::testing::open_path_after(&c.0, || {
        assert!(Store::remove_if_unused(&c.0).unwrap());
        let s = Store::create(&name, &cfg).unwrap();
        s.put(&ObjectId::of_key(b"successor"), b"here").unwrap();
        successor = Some(s);
    })
    .unwrap();
    assert_eq!(
        &*opened.try_get(&ObjectId::of_key(b"successor")).unwrap(),
        b"here"
    );
    assert_eq!(opened.stats().clients, 2);
}

#[test]
fn processes_joining_and_leaving_a_self_removing_store_always_share_one() {
    // Real processes racing: each attaches to the pool's store (creating it when there is
    // none) and leaves, so the store is removed and made again all the time, with the
    // last process leaving while the next attaches.
    let path = Path::new("/dev/shm").join(common::unique_name("join-and-leave"));
    let _c = Cleanup(path.clone());
    let args = [path.display().to_string(), "1500".to_string()];
    let mut pool: Vec<Proc> = (0..3)
        .map(|_| common::spawn(common::CHILD_ENTRY, "join-and-leave", &args))
        .collect();
    for p in &mut pool {
        assert_eq!(
            p.recv(),
            "stranded 0",
            "a process was attached to a store without a name"
        );
        p.child.wait().unwrap();
    }
}

#[test]
fn creators_sharing_a_directory_never_sweep_each_others_stores_away() {
    // Every create sweeps its directory for files killed creators left; the others'
    // creations in progress must survive it, whenever the sweep looks.
    let dir = Path::new("/dev/shm").join(common::unique_name("creators"));
    std::fs::create_dir_all(&dir).unwrap();
    let args = [dir.display().to_string(), "1000".to_string()];
    let mut creators: Vec<Proc> = (0..3)
        .map(|_| common::spawn(common::CHILD_ENTRY, "create-and-drop", &args))
        .collect();
    for p in &mut creators {
        assert_eq!(p.recv(), "failed 0: None");
        p.child.wait().unwrap();
    }
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    std::fs::remove_dir(&dir).unwrap();
}

#[test]
fn a_process_attaching_as_the_last_one_leaves_is_never_left_alone_with_the_store() {
    // The same with a store that removes itself when its last process leaves.
    let cfg = StoreConfig {
        remove_when_unused: true,
        ..StoreConfig::with_capacity(1 << 20)
    };
    let (store, c) = new_store("last-leaves-while-attaching", cfg);
    let mut last = Some(store);
    let opened = shmstore::testing::open_path_after(&c.0, || drop(last.take()));
    assert!(!c.0.exists(), "the last process to leave removes the store");
    assert!(
        matches!(opened, Err(Error::StoreNotFound { .. })),
        "attached to a store whose name was removed: {:?}",
        opened.map(|s| s.stats().clients)
    );
}

#[test]
fn a_process_attaching_while_a_removal_holds_its_lock_opens_the_name_again() {
    // A remover holds a read lock on the whole file while it unlinks the name; every
    // slot's lock fails meanwhile. Here it has unlinked the name and not let go yet.
    use std::os::fd::AsRawFd;
    let (store, c) = new_store("removal-lock", StoreConfig::with_capacity(1 << 20));
    drop(store);
    let mut remover = None;
    let opened = shmstore::testing::open_path_after(&c.0, || {
        let f = std::fs::File::open(&c.0).unwrap();
        // SAFETY: flock is plain old data; all-zero is valid (whole file, l_pid 0).
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = libc::F_RDLCK as libc::c_short;
        fl.l_whence = libc::SEEK_SET as libc::c_short;
        // SAFETY: `f` is open; `fl` is a valid flock.
        let rc = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_OFD_SETLK, &mut fl) };
        assert_eq!(rc, 0);
        std::fs::remove_file(&c.0).unwrap();
        remover = Some(f);
    });
    assert!(
        matches!(opened, Err(Error::StoreNotFound { .. })),
        "expected StoreNotFound, got {:?}",
        opened.map(|s| s.stats().clients)
    );
    drop(remover);
}

#[test]
fn unlinking_a_store_whose_name_was_taken_since_leaves_the_new_store_alone() {
    let (old, c) = new_store("unlink-successor", StoreConfig::with_capacity(1 << 20));
    old.unlink().unwrap();
    let name = c.0.file_name().unwrap().to_str().unwrap().to_string();
    let new = Store::create(&name, &StoreConfig::with_capacity(1 << 20)).unwrap();
    old.unlink().unwrap();
    assert!(
        c.0.exists(),
        "the old store's unlink removed the new store's name"
    );
    new.unlink().unwrap();
    assert!(!c.0.exists());
}

#[test]
fn a_store_of_another_layout_version_is_removed_once_unused() {
    // Stores made by an older shmstore cannot be opened after an upgrade; left by a
    // crashed instance, they are still found unused and removed.
    let (store, c) = new_store("remove-old", StoreConfig::with_capacity(1 << 20));
    let mut p = child("attach", &store, &[]);
    assert_eq!(p.recv(), "attached");
    drop(store);
    {
        use std::io::{Seek, SeekFrom, Write};
        let mut f = std::fs::OpenOptions::new().write(true).open(&c.0).unwrap();
        f.seek(SeekFrom::Start(8)).unwrap();
        f.write_all(&4u32.to_le_bytes()).unwrap();
    }
    assert!(matches!(
        Store::open_path(&c.0),
        Err(Error::VersionMismatch { found: 4, .. })
    ));
    assert!(
        !Store::remove_if_unused(&c.0).unwrap(),
        "the child is attached"
    );
    kill(p);
    assert!(Store::remove_if_unused(&c.0).unwrap());
    assert!(!c.0.exists());
}

#[test]
fn remove_if_unused_leaves_files_that_are_not_stores_alone() {
    let path = std::path::PathBuf::from("/dev/shm").join(common::unique_name("not-a-store"));
    let _c = Cleanup(path.clone());
    std::fs::write(&path, b"SHMSTORX and then some bytes").unwrap();
    assert!(matches!(
        Store::remove_if_unused(&path),
        Err(Error::NotAStore { .. })
    ));
    std::fs::write(&path, b"SHMS").unwrap();
    assert!(matches!(
        Store::remove_if_unused(&path),
        Err(Error::NotAStore { .. })
    ));
    // The magic, and no version after it.
    std::fs::write(&path, b"SHMSTORE").unwrap();
    assert!(matches!(
        Store::remove_if_unused(&path),
        Err(Error::NotAStore { .. })
    ));
    assert!(path.exists());
}

/// Layout versions 0 and 1 took no liveness locks, so whether a process uses such a store
/// cannot be told: it is left alone. From version 2 on an unlocked store is removed.
#[test]
fn remove_if_unused_removes_only_stores_that_show_their_users() {
    let path = std::path::PathBuf::from("/dev/shm").join(common::unique_name("old-versions"));
    let _c = Cleanup(path.clone());
    let store_of = |version: u32| {
        let mut bytes = b"SHMSTORE".to_vec();
        bytes.extend_from_slice(&version.to_le_bytes());
        bytes.resize(4096, 0);
        std::fs::write(&path, bytes).unwrap();
    };
    for version in [0, 1] {
        store_of(version);
        assert!(
            !Store::remove_if_unused(&path).unwrap(),
            "version {version}"
        );
        assert!(path.exists());
    }
    store_of(2);
    assert!(Store::remove_if_unused(&path).unwrap());
    assert!(!path.exists());
}

#[test]
fn a_recoverer_killed_midway_is_finished_by_the_next_one() {
    let (store, _c) = new_store("recoverer-dies", StoreConfig::with_capacity(4 << 20));
    let held = ObjectId::of_key("held");
    store.put(&held, &vec![5u8; 100_000]).unwrap();
    let pending = ObjectId::of_key("pending");
    let mut a = child(
        "hold-and-create",
        &store,
        &[held.to_string(), pending.to_string()],
    );
    assert_eq!(a.recv(), "holding");
    kill(a);
    store.delete(&held).unwrap(); // drains: the dead child's pins hold it
    let mut b = child("recover-and-stall", &store, &[]);
    assert_eq!(b.recv(), "claimed 1");
    kill(b);
    // The dead child A is RECOVERING by the dead recoverer B; both count as dead.
    let st = store.stats();
    assert_eq!((st.dead_clients, st.creating), (2, 1), "{st:?}");
    let r = store.recover().unwrap();
    assert_eq!((r.clients_recovered, r.creations_aborted), (2, 1), "{r:?}");
    let st = store.stats();
    assert_eq!(
        (st.used, st.creating, st.draining, st.pins, st.dead_clients),
        (0, 0, 0, 0, 0),
        "{st:?}"
    );
    store.check_invariants().unwrap();
}

/// `shmstore check` reads a dead process's half-done step as damage, says that recovery
/// comes first, and finds the store sound once `shmstore recover` has run.
#[test]
fn shmstore_check_sends_an_operator_to_recover_a_dead_process_first() {
    let (store, _c) = new_store("check-dead", StoreConfig::with_capacity(4 << 20));
    store.put(&ObjectId::of_key("keep"), &[9u8; 1000]).unwrap();
    let mut p = child("leak-and-stall", &store, &["300000".to_string()]);
    assert_eq!(p.recv(), "leaked");
    kill(p);
    let path = store.path().unwrap().to_str().unwrap().to_owned();
    let (ok, _, err) = shmstore_cli(&["check", &path]);
    assert!(!ok);
    assert!(
        err.contains("holds what 1 dead process(es) left half-done")
            && err.contains("reads as damage until it is recovered (allocator says")
            && err.contains(&format!("run `shmstore recover {path}`, then check again")),
        "{err}"
    );
    let (ok, out, _) = shmstore_cli(&["check", &path, "--json"]);
    assert!(!ok && out.contains(r#""verdict":"unrecovered""#), "{out}");
    let (ok, out, err) = shmstore_cli(&["recover", &path]);
    assert!(ok && out.contains("1 leaked block(s) freed"), "{out} {err}");
    let (ok, out, err) = shmstore_cli(&["check", &path]);
    assert!(ok && out.contains("is sound: 1 object(s)"), "{out} {err}");
}

#[test]
fn a_process_killed_inside_the_allocator_leaks_nothing_for_long() {
    let (store, _c) = new_store("sweep", StoreConfig::with_capacity(4 << 20));
    let keep = ObjectId::of_key("keep");
    store.put(&keep, &[9u8; 1000]).unwrap();
    let used = store.stats().used;
    let leak_and_die = |size: u64| {
        let mut p = child("leak-and-stall", &store, &[size.to_string()]);
        assert_eq!(p.recv(), "leaked");
        kill(p);
        // The leaked block is named by no object, so only the allocator's bitmaps show it.
        assert!(store.allocated_bytes() > used, "the block is allocated");
        // Recovery owes a sweep; no live process is inside an allocator step, so it runs.
        let r = store.recover().unwrap();
        assert_eq!(
            (r.clients_recovered, r.leaked_blocks_freed),
            (1, 1),
            "{r:?}"
        );
        assert!(!r.sweep_pending, "{r:?}");
        let st = store.stats();
        assert_eq!((st.used, st.sweep_pending), (used, false), "{st:?}");
        assert_eq!(
            store.allocated_bytes(),
            used,
            "the sweep freed the leaked block"
        );
        store.check_invariants().unwrap();
    };
    leak_and_die(300_000);
    // A live process now holds the dead one's client slot: it must not look as if it were
    // inside the dead process's unfinished step, or no sweep could ever run again.
    let mut live = child("attach", &store, &[]);
    assert_eq!(live.recv(), "attached");
    leak_and_die(100);
    leak_and_die(1 << 20);
    live.send("bye");
    live.finish();
    assert_eq!(store.stats().leaked_blocks_freed, 3);
    assert_eq!(&store.try_get(&keep).unwrap()[..3], &[9, 9, 9]);
}

#[test]
fn a_sweep_never_frees_what_another_thread_of_the_sweeper_is_allocating() {
    let (store, _c) = new_store("sweep-threads", StoreConfig::with_capacity(16 << 20));
    let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
    let (running_tx, running_rx) = std::sync::mpsc::channel::<()>();
    // Another thread of this process keeps creating and deleting objects: at any moment it
    // may hold a block that no entry names yet (between its allocation and its insert).
    let worker = {
        let store = store.clone();
        std::thread::spawn(move || {
            let mut n = 0u64;
            while stop_rx.try_recv().is_err() {
                let id = ObjectId::of_key(format!("busy-{n}"));
                store.put(&id, &[n as u8; 3000]).unwrap();
                assert_eq!(store.try_get(&id).unwrap()[0], n as u8);
                store.delete(&id).unwrap();
                n += 1;
                if n == 1 {
                    let _ = running_tx.send(());
                }
            }
            n
        })
    };
    // The kills below must land while it runs: wait for its first round (on a loaded
    // machine it once had not finished one by the time they were done).
    running_rx.recv().unwrap();
    // Owe sweeps (processes killed inside allocator steps) and try them while it runs.
    for _ in 0..5 {
        let mut p = child("leak-and-stall", &store, &["5000".to_string()]);
        assert_eq!(p.recv(), "leaked");
        kill(p);
        for _ in 0..3 {
            let _ = store.recover().unwrap(); // each retries its sweep ~50 times
        }
    }
    stop_tx.send(()).unwrap();
    assert!(worker.join().unwrap() > 0);
    // Quiet now: whatever is still owed runs. Only the five dead processes' blocks may have
    // been freed as leaks, never one of the busy thread's.
    let r = store.recover().unwrap();
    assert!(!r.sweep_pending, "{r:?}");
    let st = store.stats();
    assert_eq!(st.leaked_blocks_freed, 5, "{st:?}");
    assert_eq!((st.used, st.objects), (0, 0), "{st:?}");
    store.check_invariants().unwrap();
}

fn two_client_store(tag: &str) -> (Store, Cleanup) {
    let cfg = StoreConfig {
        max_clients: 2,
        ..StoreConfig::with_capacity(4 << 20)
    };
    new_store(tag, cfg)
}

#[test]
fn a_sweep_token_left_by_a_killed_sweeper_is_freed_even_when_its_slot_is_reused_first() {
    let (store, c) = two_client_store("stale-token");
    let mut a = child("hold-sweep-token", &store, &[]);
    assert_eq!(a.recv(), "holding token");
    kill(a);
    assert!(
        store.stats().sweep_pending,
        "the killed sweeper owed a sweep"
    );
    // A new process moves into the dead sweeper's slot (the only one): the token named
    // that slot, which is alive again, but it must not count as the sweeper.
    let mut b = child("attach", &store, &[]);
    assert_eq!(b.recv(), "attached");
    let r = store.recover().unwrap();
    assert!(!r.sweep_pending, "the owed sweep must run: {r:?}");
    assert!(!store.stats().sweep_pending);
    b.send("bye");
    b.finish();
    drop(Store::open_path(&c.0).unwrap());
}

#[test]
fn a_process_killed_right_after_claiming_a_slot_costs_nobody_the_slot() {
    let (store, c) = two_client_store("claim-window");
    let mut p = child("claim-free-and-stall", &store, &[]);
    assert_eq!(p.recv(), "claimed 1");
    kill(p);
    // The slot reads "taken" but its holder is gone: a new process gets it.
    let again = Store::open_path(&c.0).expect("the dead claimer's slot is free again");
    assert_eq!(again.stats().clients, 2);
}

#[test]
fn a_process_killed_while_moving_into_a_dead_slot_blocks_neither_the_slot_nor_the_sweep() {
    let (store, c) = two_client_store("move-window");
    // A client dies inside an allocator step (a sweep is owed for it) ...
    let mut d = child("leak-and-stall", &store, &["20000".to_string()]);
    assert_eq!(d.recv(), "leaked");
    kill(d);
    // ... and a process moving into its slot dies halfway through.
    let mut m = child("move-into-dead-and-stall", &store, &[]);
    assert_eq!(m.recv(), "claimed 1");
    kill(m);
    let st = store.stats();
    assert_eq!(
        st.dead_clients, 1,
        "the slot is being recovered by a dead mover: {st:?}"
    );
    let r = store.recover().unwrap();
    assert_eq!(
        (r.clients_recovered, r.leaked_blocks_freed),
        (1, 1),
        "{r:?}"
    );
    assert!(!r.sweep_pending, "{r:?}");
    let st = store.stats();
    assert_eq!((st.used, st.dead_clients), (0, 0), "{st:?}");
    let again = Store::open_path(&c.0).expect("the slot is free again");
    again.check_invariants().unwrap();
}

#[test]
fn the_leak_sweep_never_frees_a_raw_block() {
    let (store, _c) = new_store("raw-sweep", StoreConfig::with_capacity(4 << 20));
    let mut raw = child("raw-and-hold", &store, &[]);
    assert_eq!(raw.recv(), "holding raw");
    let mut l = child("leak-and-stall", &store, &["3000".to_string()]);
    assert_eq!(l.recv(), "leaked");
    kill(l);
    // The raw block is named by no entry, like the leak: the sweep must wait for it.
    let r = store.recover().unwrap();
    assert_eq!((r.leaked_blocks_freed, r.sweep_pending), (0, true), "{r:?}");
    raw.send("free");
    assert_eq!(raw.recv(), "freed raw");
    let r = store.recover().unwrap();
    assert_eq!(
        (r.leaked_blocks_freed, r.sweep_pending),
        (1, false),
        "{r:?}"
    );
    raw.send("bye");
    raw.finish();
    assert_eq!((store.stats().used, store.allocated_bytes()), (0, 0));
    store.check_invariants().unwrap();
}

#[test]
fn a_process_killed_inside_new_slab_setup_leaves_a_consistent_allocator() {
    let (store, _c) = new_store("slab-setup", StoreConfig::with_capacity(4 << 20));
    let mut p = child("die-in-slab-setup", &store, &[]);
    assert_eq!(p.recv(), "setting up");
    kill(p);
    let r = store.recover().unwrap();
    assert_eq!(
        (r.leaked_blocks_freed, r.sweep_pending),
        (1, false),
        "{r:?}"
    );
    store.check_invariants().unwrap();
    let st = store.stats();
    assert_eq!((st.used, store.largest_free()), (0, st.capacity), "{st:?}");
}

#[test]
fn a_creator_index_out_of_range_is_reported_not_followed() {
    let (store, _c) = new_store("bad-creator", StoreConfig::with_capacity(1 << 20));
    let id = ObjectId::of_key("x");
    let _c = store.create_object(&id, 10).unwrap();
    shmstore::testing::corrupt_creator(&store, &id, 4000).unwrap();
    let t = Instant::now();
    match store.get(&id, Duration::from_secs(2)) {
        Err(Error::Corrupted { what }) => assert!(what.contains("4000"), "{what}"),
        other => panic!("expected Corrupted, got {other:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(1));
}

#[test]
fn failed_attaches_leave_no_descriptor_or_mapping_behind() {
    let cfg = StoreConfig {
        max_clients: 1,
        ..StoreConfig::with_capacity(1 << 20)
    };
    let (store, _c) = new_store("fd-hygiene", cfg);
    let mut p = child("failed-attaches", &store, &[]);
    let line = p.recv();
    let counts: Vec<&str> = line
        .split(|c: char| !c.is_ascii_digit())
        .filter(|w| !w.is_empty())
        .collect();
    assert_eq!((counts[0], counts[2]), (counts[1], counts[3]), "{line}");
    p.finish();
}

#[test]
fn the_fast_put_path_declines_slow_work_and_does_none_of_it() {
    // What the Python bindings hold the GIL for: a put that would have to recover a dead
    // process (or evict, or run scheduled maintenance) declines instead, untouched.
    let (store, _c) = new_store("fast-path", StoreConfig::with_capacity(1 << 20));
    let hog = ObjectId::of_key("hog");
    let mut p = child(
        "create-only",
        &store,
        &[hog.to_string(), (1u64 << 20).to_string()],
    );
    assert_eq!(p.recv(), "creating");
    kill(p);
    let small = ObjectId::of_key("small");
    assert!(!store.put_without_slow_work(&small, b"x", b"").unwrap());
    let st = store.stats();
    assert_eq!(
        (st.recovered_clients, st.dead_clients, st.objects),
        (0, 1, 0),
        "{st:?}"
    );
    store.put(&small, b"x").unwrap(); // the slow path recovers, then puts
    let st = store.stats();
    assert_eq!(
        (st.recovered_clients, st.dead_clients, st.objects),
        (1, 0, 1),
        "{st:?}"
    );
    // With room and nothing due, the fast path does the put itself.
    assert!(store
        .put_without_slow_work(&ObjectId::of_key("quick"), b"y", b"")
        .unwrap());
}
