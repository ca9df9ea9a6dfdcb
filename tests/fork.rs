//! Handles across `fork()`: a child that inherits a `Store`, `View`s and `Creation`s
//! attaches as a client of its own, pins in its own column, and never touches the
//! parent's slot or counters, whether it exits normally or its parent is SIGKILLed.
//!
//! Each test runs its forking process as a child of the test (started with
//! `--test-threads=1`), so that `fork()` happens in a process with one busy thread.

mod common;

use common::{child, child_role, hear, say, Cleanup, Proc};
use shmstore::{AttachOptions, Error, ObjectId, Store, StoreConfig};
use std::path::Path;
use std::time::Duration;

fn new_store(tag: &str, cfg: StoreConfig) -> (Store, Cleanup) {
    common::store_with(tag, &cfg)
}

/// Forks; runs `child` in the child and `_exit`s with its result (never returns there).
/// Returns the child's pid in the parent.
fn fork_and(child: impl FnOnce() -> i32) -> libc::pid_t {
    // SAFETY: the calling process (a test child run with --test-threads=1) has no other
    // thread holding a lock the child needs; the child ends with `_exit`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(child)).unwrap_or(101);
        // SAFETY: ends the child without running the parent's exit handlers twice.
        unsafe { libc::_exit(code) };
    }
    pid
}

fn wait_exit(pid: libc::pid_t) -> i32 {
    let mut status = 0;
    // SAFETY: `pid` is our child; `status` is a valid out-pointer.
    let rc = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(rc, pid);
    assert!(
        libc::WIFEXITED(status),
        "child did not exit normally: {status:#x}"
    );
    libc::WEXITSTATUS(status)
}

fn content(seed: u8, len: usize) -> Vec<u8> {
    common::bytes(seed as u64, len)
}

/// Child processes: dispatched on `SHMSTORE_CHILD`.
#[test]
#[ignore = "child process entry point, started by the other tests"]
fn child_entry() {
    let (role, args) = child_role().expect("child_entry runs only as a child process");
    let opts = AttachOptions {
        recover_on_attach: false,
        ..Default::default()
    };
    let store = Store::open_with(Path::new(&args[0]), &opts).unwrap();
    match role.as_str() {
        // Holds a view and an unsealed creation, forks a child that uses and drops
        // everything it inherited (and makes objects of its own), then checks that its
        // own pin, creation and slot are untouched.
        "fork-and-exit" => {
            let kept = ObjectId::of_key("kept");
            let view = store.try_get(&kept).unwrap();
            // Deleted but still pinned (draining) when the child starts: still readable.
            let gone = ObjectId::of_key("deleted-but-held");
            let draining = store.try_get(&gone).unwrap();
            store.delete(&gone).unwrap();
            let pending = ObjectId::of_key("pending");
            let mut c = store.create_object(&pending, 1000).unwrap();
            c.fill(3);
            let before = store.stats();
            // Everything the child inherits, so that it can drop all of it.
            let mut inherited = Some((store, view, c, draining));
            let pid = fork_and(|| {
                let (store, view, mut c, draining) = inherited.take().unwrap();
                // The inherited views are adopted (pinned in the child's own column).
                if view[..] != content(1, 300_000)[..] || draining[..] != content(2, 50_000)[..] {
                    return 2;
                }
                let mine = store.try_get(&kept).unwrap();
                if mine.as_ptr() != view.as_ptr() {
                    return 3;
                }
                // The inherited creation is the parent's: refused, and inert on drop.
                if !matches!(c.set_evictable(false), Err(Error::Forked { .. })) {
                    return 4;
                }
                if !matches!(c.writable_here(), Err(Error::Forked { .. })) {
                    return 6;
                }
                // Reading or writing through it panics with that error's message.
                let quiet = std::panic::take_hook();
                std::panic::set_hook(Box::new(|_| {}));
                let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c[0]));
                let write = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c[0] = 9));
                std::panic::set_hook(quiet);
                if read.is_ok() || write.is_ok() {
                    return 7;
                }
                store.put(&ObjectId::of_key("from-child"), b"hi").unwrap();
                if store.stats().clients != 3 {
                    return 5; // parent, test process and this child
                }
                drop((view, mine, c, store, draining));
                0
            });
            let (store, view, c, draining) = inherited.take().unwrap();
            say(format!("child exited {}", wait_exit(pid)));
            drop(draining); // kept until the child has adopted it
            let after = store.stats();
            say(format!(
                "pins {} -> {}, creating {} -> {}, clients {} -> {}",
                before.pins,
                after.pins,
                before.creating,
                after.creating,
                before.clients,
                after.clients
            ));
            store.check_invariants().unwrap();
            // The parent's creation survived the child's drop, bytes and all.
            c.writable_here().unwrap();
            assert!(c.len() == 1000 && c.iter().all(|&b| b == 3));
            c.seal().unwrap();
            drop(view);
            say(format!("pins now {}", store.stats().pins));
            let _ = hear();
        }
        // Forks a child that pins `args[1]` and reports; the parent (this process) waits
        // to be killed. The child then waits for `args[2]` to appear, and reports whether
        // its view's bytes changed. With `args[3]` "inherit", the parent takes the view
        // before it forks, and the child's pin is the one its first read of the inherited
        // view takes (adoption).
        "fork-pin-and-outlive" => {
            let target: ObjectId = args[1].parse().unwrap();
            let go: ObjectId = args[2].parse().unwrap();
            let mut inherited = (args.get(3).map(String::as_str) == Some("inherit"))
                .then(|| store.try_get(&target).unwrap());
            let _pid = fork_and(|| {
                let v = inherited
                    .take()
                    .unwrap_or_else(|| store.try_get(&target).unwrap());
                let expect = v.to_vec();
                say("child pinned");
                // Wait (on the store's own futex) until the test says the block has
                // been pressured; then compare every byte.
                let _ = store.get(&go, Duration::from_secs(30)).unwrap();
                let changed = v.iter().zip(&expect).filter(|(a, b)| a != b).count();
                say(format!("child changed {changed}"));
                drop(v);
                0
            });
            say("parent holding");
            let _ = hear(); // killed before the test says anything
        }
        // Forks a child while every client slot is taken: the child cannot attach, but
        // its `stats` still counts the clients the slots show, and its writes say why
        // they fail.
        "fork-without-a-slot" => {
            let pid = fork_and(|| {
                let st = store.stats();
                if st.clients != 2 || st.dead_clients != 0 {
                    return 2; // the test process and this child's parent
                }
                match store.put(&ObjectId::of_key("no slot"), b"x") {
                    Err(Error::TooManyClients { max: 2 }) => 0,
                    _ => 3,
                }
            });
            say(format!("child exited {}", wait_exit(pid)));
            let _ = hear();
        }
        other => panic!("unknown role {other}"),
    }
}

fn finish(mut p: Proc) {
    p.send("bye");
    p.finish();
}

#[test]
fn a_forked_child_that_exits_normally_leaves_the_parents_slot_pins_and_creations_alone() {
    let (store, _c) = new_store("fork-exit", StoreConfig::with_capacity(8 << 20));
    store
        .put(&ObjectId::of_key("kept"), &content(1, 300_000))
        .unwrap();
    store
        .put(&ObjectId::of_key("deleted-but-held"), &content(2, 50_000))
        .unwrap();
    let mut p = child("fork-and-exit", &store, &[]);
    assert_eq!(p.recv(), "child exited 0");
    assert_eq!(p.recv(), "pins 2 -> 1, creating 1 -> 1, clients 2 -> 2");
    assert_eq!(p.recv(), "pins now 0");
    // The child's own object stays; its slot is free again.
    assert!(store.contains(&ObjectId::of_key("from-child")));
    assert!(store.contains(&ObjectId::of_key("pending")));
    let st = store.stats();
    assert_eq!((st.clients, st.dead_clients), (2, 0), "{st:?}");
    finish(p);
    store.check_invariants().unwrap();
}

#[test]
fn a_forked_child_finding_every_slot_taken_still_reads_the_stats() {
    let cfg = StoreConfig {
        max_clients: 2,
        ..StoreConfig::with_capacity(1 << 20)
    };
    let (store, _c) = new_store("fork-no-slot", cfg);
    let mut p = child("fork-without-a-slot", &store, &[]);
    assert_eq!(p.recv(), "child exited 0");
    finish(p);
    assert!(!store.contains(&ObjectId::of_key("no slot")));
}

#[test]
fn a_childs_pin_holds_when_its_parent_is_killed_and_the_space_is_reused() {
    a_childs_pin_outlives_its_parent(false);
}

/// The same with a view the child inherited: the pin its first read of it took in its own
/// name holds the object once the parent, whose view it was, is gone.
#[test]
fn an_inherited_view_holds_when_its_parent_is_killed_and_the_space_is_reused() {
    a_childs_pin_outlives_its_parent(true);
}

fn a_childs_pin_outlives_its_parent(inherit: bool) {
    // Room for the target, one more object of its size (not two), and small ones.
    let size = 1 << 20;
    let cap = 2 * size as u64 + (64 << 10);
    let tag = if inherit {
        "fork-kill-inherit"
    } else {
        "fork-kill"
    };
    let (store, _c) = new_store(tag, StoreConfig::with_capacity(cap));
    let target = ObjectId::of_key("target");
    store.put(&target, &content(7, size)).unwrap();
    let go = ObjectId::of_key("go");
    let mut args = vec![target.to_string(), go.to_string()];
    if inherit {
        args.push("inherit".into());
    }
    let mut p = child("fork-pin-and-outlive", &store, &args);
    let mut got = vec![p.recv(), p.recv()];
    got.sort();
    assert_eq!(got, ["child pinned", "parent holding"]);
    p.child.kill().unwrap(); // SIGKILL the parent; its child lives on
    p.child.wait().unwrap();
    let r = store.recover().unwrap();
    assert_eq!(r.clients_recovered, 1, "{r:?}");
    // Delete the target and fill the store: its block may be reused only if no pin holds it.
    store.delete(&target).unwrap();
    let filler = ObjectId::of_key("filler");
    store.put(&filler, &content(9, size)).unwrap();
    assert!(
        matches!(
            store.put(&ObjectId::of_key("more"), &content(9, size)),
            Err(Error::Full { .. })
        ),
        "the child's pin must keep the target's block"
    );
    store.put(&go, b"go").unwrap();
    assert_eq!(p.recv(), "child changed 0");
    // The child unpins and exits normally: the block comes back, and so does the child's
    // slot once its process is gone (its unpin comes before its exit, so the test
    // waits for both).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while store.stats().draining != 0 || store.stats().clients != 1 {
        assert!(std::time::Instant::now() < deadline, "{:?}", store.stats());
        store.recover().unwrap();
        std::thread::yield_now();
    }
    store.check_invariants().unwrap();
}
