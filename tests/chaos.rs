//! The chaos test: worker processes create / write / seal / get / read every byte /
//! delete objects with content-derived ids, while a supervisor SIGKILLs random workers at
//! random moments and starts replacements. Afterwards, with everything recovered:
//!
//! 1. every sealed object's bytes hash to its id;
//! 2. `check_invariants` passes (the allocator and the table agree, nothing is owned by a
//!    detached client), and deleting every object leaves `used == 0` with the whole
//!    capacity one free run: zero leaked bytes;
//! 3. no living worker was ever blocked beyond its timeout (plus scheduling slack);
//! 4. a new client can still put and get.
//!
//! Workers also read objects they pin with `get_draining`, which must find them even after
//! another worker deleted their id (and with bytes that still hash to it).
//!
//! Workers also fork now and then: the child uses the store it inherited (re-reads the
//! views its parent holds, finds each of them with `get_draining`, gets, puts) and ends with `_exit`, leaving its slot to
//! recovery; a child whose parent is killed is killed with it (`PR_SET_PDEATHSIG`).
//!
//! Short variant (CI): `cargo test --test chaos` runs 20 s with 8 workers.
//! Long mode: `SHMSTORE_CHAOS_SECS=600 SHMSTORE_CHAOS_WORKERS=8 cargo test --release
//! --test chaos -- --nocapture` (figures in docs/reliability.md).

mod common;

use common::{child_role, spawn, unique_name, Cleanup, Proc};
use shmstore::{Error, ObjectId, ObjectState, Store, StoreConfig, View, WhenFull};
use std::io::{BufRead, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const ENTRY: &str = "worker_entry";
/// How long a worker's get waits for an object.
const GET_TIMEOUT: Duration = Duration::from_millis(100);
/// Scheduling slack allowed on top of an operation's own timeout (a loaded 2-core VM
/// running a supervisor, several workers and fresh process starts).
const SLACK: Duration = Duration::from_secs(1);

fn env_u64(key: &str, default: u64) -> u64 {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// xorshift64*: cheap per-process randomness.
struct Rng(u64);

impl Rng {
    fn seeded() -> Self {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64;
        Rng((t ^ (std::process::id() as u64) << 32) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// `len` bytes derived from `seed` (fast: one word per 8 bytes).
fn content(seed: u64, len: usize) -> Vec<u8> {
    let mut r = Rng(seed | 1);
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        v.extend_from_slice(&r.next().to_le_bytes());
    }
    v.truncate(len);
    v
}

/// What a worker reports, cumulatively, every few operations.
#[derive(Clone, Copy, Debug, Default)]
struct Report {
    ops: u64,
    puts: u64,
    gets: u64,
    deletes: u64,
    creator_died: u64,
    timeouts: u64,
    full: u64,
    /// Children forked (each checked what it inherited and exited 0).
    forks: u64,
    /// Draining reads of an object this worker pins (`get_draining`), and how many of
    /// them found it deleted (a lookup by id missed just before).
    drains: u64,
    drained_deleted: u64,
    /// Longest time any operation took beyond its own timeout (µs).
    max_stall_us: u64,
    /// Longest operation overall (µs).
    max_op_us: u64,
}

impl Report {
    fn line(&self) -> String {
        format!(
            "report {} {} {} {} {} {} {} {} {} {} {} {}",
            self.ops,
            self.puts,
            self.gets,
            self.deletes,
            self.creator_died,
            self.timeouts,
            self.full,
            self.forks,
            self.drains,
            self.drained_deleted,
            self.max_stall_us,
            self.max_op_us
        )
    }
    fn parse(s: &str) -> Option<Report> {
        let v: Vec<u64> = s
            .strip_prefix("report ")?
            .split(' ')
            .filter_map(|x| x.parse().ok())
            .collect();
        (v.len() == 12).then(|| Report {
            ops: v[0],
            puts: v[1],
            gets: v[2],
            deletes: v[3],
            creator_died: v[4],
            timeouts: v[5],
            full: v[6],
            forks: v[7],
            drains: v[8],
            drained_deleted: v[9],
            max_stall_us: v[10],
            max_op_us: v[11],
        })
    }
}

/// In a forked child of a worker: checks what it inherited and uses the store as a client
/// of its own. Returns the exit code (0: every check held).
fn forked_child(store: &Store, known: &[ObjectId], held: &[View], rng: &mut Rng) -> i32 {
    let parent = std::os::unix::process::parent_id();
    // SAFETY: prctl(PR_SET_PDEATHSIG) only sets this process's parent-death signal.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    if std::os::unix::process::parent_id() != parent {
        return 0; // the parent died before the line above: nothing to check against
    }
    // Views the parent holds (some deleted since, draining): pinned again here, bytes
    // unchanged.
    for v in held {
        if v.adopt().is_err() {
            return 6;
        }
        if ObjectId::of_content(v) != v.id() {
            return 2;
        }
        // The parent, waiting for this child, pins every one of them: found by id, or
        // draining if its id was deleted since, never freed under the pin.
        match store.get_draining(&v.id()) {
            Ok(d) if ObjectId::of_content(&d) == v.id() => {}
            Ok(_) => return 7,
            Err(_) => return 8,
        }
    }
    for id in known.iter().take(4) {
        match store.get(id, GET_TIMEOUT) {
            Ok(v) if ObjectId::of_content(&v) == *id => {}
            Ok(_) => return 3,
            Err(Error::Timeout { .. }) => {}
            Err(_) => return 4,
        }
    }
    let data = content(rng.next(), 1 + rng.below(50_000) as usize);
    match store.put(&ObjectId::of_content(&data), &data) {
        Ok(()) | Err(Error::AlreadyExists { .. }) | Err(Error::Full { .. }) => 0,
        Err(_) => 5,
    }
}

/// A worker process: random operations until the stop file appears.
#[test]
#[ignore = "chaos worker, started by the chaos test"]
fn worker_entry() {
    let (_, args) = child_role().expect("worker_entry runs only as a child process");
    // Report any failed check on the protocol pipe too: a worker the supervisor kills
    // while it is still unwinding must not pass for a worker killed at random.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        println!("@failed {info}");
        default_hook(info);
    }));
    let store = Store::open_path(Path::new(&args[0])).unwrap();
    let stop = PathBuf::from(&args[1]);
    let mut rng = Rng::seeded();
    let mut rep = Report::default();
    let mut known: Vec<ObjectId> = Vec::new();
    let mut held: Vec<View> = Vec::new();
    loop {
        if rep.ops % 64 == 0 {
            if stop.exists() {
                break;
            }
            // Sample ids others made.
            known.clear();
            for o in store.list() {
                if o.state == ObjectState::Sealed && known.len() < 256 {
                    known.push(o.id);
                }
            }
            println!("@{}", rep.line());
        }
        let started = Instant::now();
        let mut allowance = Duration::ZERO;
        match rng.below(10) {
            // put: create, write, (sometimes dawdle), seal; now and then abort instead.
            0..=3 => {
                let len = 1usize << rng.below(19); // 1 B .. 256 KiB
                let len = len + rng.below(len as u64) as usize;
                let data = content(rng.next(), len);
                let id = ObjectId::of_content(&data);
                match store.create_object(&id, len as u64) {
                    Ok(mut c) => {
                        c.copy_from_slice(&data);
                        if rng.below(4) == 0 {
                            // Dawdle so getters block on it (and kills land mid-creation):
                            // the sleep is the scenario, not a wait for anything, and it is
                            // counted in this operation's allowance.
                            let nap = Duration::from_millis(rng.below(50));
                            std::thread::sleep(nap);
                            allowance += nap;
                        }
                        if rng.below(50) == 0 {
                            c.abort();
                        } else {
                            c.seal().unwrap();
                            rep.puts += 1;
                        }
                    }
                    Err(Error::AlreadyExists { .. }) => {}
                    Err(Error::Full { .. }) => rep.full += 1,
                    Err(e) => panic!("create failed: {e}"),
                }
            }
            // A draining read of an object this worker pins: it is found whatever
            // happened to its id since (deleted by another worker, created again), and
            // its bytes still hash to its id.
            4 if !held.is_empty() && rng.below(2) == 0 => {
                let id = held[rng.below(held.len() as u64) as usize].id();
                let deleted = store.try_get(&id).is_err();
                let v = store
                    .get_draining(&id)
                    .unwrap_or_else(|e| panic!("a pinned object is not found draining: {e}"));
                assert_eq!(
                    ObjectId::of_content(&v),
                    id,
                    "draining bytes do not match id"
                );
                rep.drains += 1;
                rep.drained_deleted += u64::from(deleted);
            }
            // get a sealed object, read every byte, check it hashes to its id.
            4..=6 if !known.is_empty() => {
                let id = known[rng.below(known.len() as u64) as usize];
                allowance = GET_TIMEOUT;
                match store.get(&id, GET_TIMEOUT) {
                    Ok(v) => {
                        assert_eq!(ObjectId::of_content(&v), id, "bytes do not match id");
                        rep.gets += 1;
                        if held.len() < 8 && rng.below(4) == 0 {
                            held.push(v); // keep pins across operations (and kills)
                        }
                    }
                    Err(Error::Timeout { .. }) => rep.timeouts += 1, // deleted/evicted
                    Err(e) => panic!("get failed: {e}"),
                }
            }
            // get an object that is still being written: blocks until sealed, or until
            // its creator is found dead.
            7 => {
                // A fresh look: objects still being written right now.
                let creating: Vec<ObjectId> = store
                    .list()
                    .into_iter()
                    .filter(|o| o.state == ObjectState::Creating)
                    .map(|o| o.id)
                    .collect();
                if creating.is_empty() {
                    continue;
                }
                let id = creating[rng.below(creating.len() as u64) as usize];
                allowance = GET_TIMEOUT;
                match store.get(&id, GET_TIMEOUT) {
                    Ok(v) => {
                        assert_eq!(ObjectId::of_content(&v), id, "bytes do not match id");
                        rep.gets += 1;
                    }
                    Err(Error::CreatorDied { .. }) => rep.creator_died += 1,
                    Err(Error::Timeout { .. }) => rep.timeouts += 1,
                    Err(e) => panic!("get failed: {e}"),
                }
            }
            8 if !known.is_empty() => {
                let id = known[rng.below(known.len() as u64) as usize];
                match store.delete(&id) {
                    Ok(()) => rep.deletes += 1,
                    Err(Error::NotFound { .. }) => {}
                    // Content ids of tiny objects repeat across workers: the sealed object
                    // this worker saw may have been deleted and is being created again.
                    Err(Error::NotSealed { .. }) => {}
                    Err(e) => panic!("delete failed: {e}"),
                }
            }
            // Now and then: fork a child that uses everything it inherited.
            9 if rng.below(40) == 0 => {
                // SAFETY: this process runs one test thread; the child only uses the store,
                // allocates and ends with `_exit`.
                let pid = unsafe { libc::fork() };
                assert!(pid >= 0, "fork failed");
                if pid == 0 {
                    let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        forked_child(&store, &known, &held, &mut rng)
                    }))
                    .unwrap_or(101);
                    // SAFETY: ends the child without unwinding into the test harness.
                    unsafe { libc::_exit(code) };
                }
                let mut status = 0;
                // SAFETY: `pid` is our child; `status` is a valid out-pointer.
                assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
                assert!(
                    libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
                    "a forked child failed its checks: status {status:#x}"
                );
                rep.forks += 1;
                allowance = GET_TIMEOUT * 4 + SLACK;
            }
            _ => {
                if !held.is_empty() {
                    held.swap_remove(rng.below(held.len() as u64) as usize);
                }
            }
        }
        let took = started.elapsed();
        rep.max_op_us = rep.max_op_us.max(took.as_micros() as u64);
        rep.max_stall_us = rep
            .max_stall_us
            .max(took.saturating_sub(allowance).as_micros() as u64);
        rep.ops += 1;
    }
    drop(held);
    println!("@{}", rep.line());
    println!("@done");
}

/// One worker and the latest report it sent.
struct Worker {
    proc: Proc,
    latest: Arc<Mutex<Report>>,
    /// Joins to (finished cleanly, failed a check).
    reader: std::thread::JoinHandle<(bool, Option<String>)>,
}

fn start_worker(store_path: &Path, stop: &Path) -> Worker {
    let mut proc = spawn(
        ENTRY,
        "worker",
        &[store_path.display().to_string(), stop.display().to_string()],
    );
    let out = proc.take_stdout();
    let latest = Arc::new(Mutex::new(Report::default()));
    let l2 = latest.clone();
    let reader = std::thread::spawn(move || {
        let (mut done, mut failed) = (false, None);
        for line in out.lines() {
            let Ok(line) = line else { break };
            if let Some(r) = line.strip_prefix('@').and_then(Report::parse) {
                *l2.lock().unwrap() = r;
            }
            if let Some(why) = line.strip_prefix("@failed ") {
                failed.get_or_insert_with(|| why.to_string());
            }
            done |= line == "@done";
        }
        (done, failed)
    });
    Worker {
        proc,
        latest,
        reader,
    }
}

#[test]
fn chaos_kills_lose_nothing_and_block_no_one() {
    let secs = env_u64("SHMSTORE_CHAOS_SECS", 20);
    let nworkers = env_u64("SHMSTORE_CHAOS_WORKERS", 8) as usize;
    let cfg = StoreConfig {
        max_objects: 4096,
        max_clients: 32,
        when_full: WhenFull::Evict,
        ..StoreConfig::with_capacity(32 << 20)
    };
    let name = unique_name("chaos");
    let store = Store::create(&name, &cfg).unwrap();
    let path = store.path().unwrap().to_path_buf();
    let _cleanup = Cleanup(path.clone());
    let stop = PathBuf::from(format!("/tmp/{name}.stop"));
    let _stop_cleanup = Cleanup(stop.clone());
    let mut workers: Vec<Worker> = (0..nworkers).map(|_| start_worker(&path, &stop)).collect();
    let mut finished: Vec<Report> = Vec::new();
    let mut rng = Rng::seeded();
    let mut kills = 0u64;
    let start = Instant::now();
    // The timeline (kills, recoveries, bytes reclaimed) for scripts/plot.py: one JSON
    // object per line, sampled after every kill.
    let timeline_path = std::env::var_os("SHMSTORE_CHAOS_TIMELINE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("chaos-timeline.jsonl"));
    let mut timeline = std::io::BufWriter::new(std::fs::File::create(&timeline_path).unwrap());
    let mut sample = |kills: u64| {
        let st = store.stats();
        let line = serde_json::json!({
            "t_s": start.elapsed().as_secs_f64(),
            "kills": kills,
            "recovered_clients": st.recovered_clients,
            "dead_clients": st.dead_clients,
            "reclaimed_bytes": st.reclaimed_bytes,
            "used_bytes": st.used,
            "objects": st.objects,
        });
        writeln!(timeline, "{line}").unwrap();
    };
    sample(0);
    while start.elapsed() < Duration::from_secs(secs) {
        // The kill schedule: a random moment, whatever the workers are doing (no race to
        // wait out; the checks at the end hold for every interleaving).
        std::thread::sleep(Duration::from_millis(20 + rng.below(300)));
        let k = rng.below(workers.len() as u64) as usize;
        let mut w = workers.swap_remove(k);
        w.proc.child.kill().unwrap(); // SIGKILL, at whatever instruction it is on
        let status = w.proc.child.wait().unwrap();
        // A worker only ever ends by this kill: any other end is a failed check in it.
        assert_eq!(
            status.signal(),
            Some(9),
            "a worker failed before its kill: {status}"
        );
        let (_, failed) = w.reader.join().unwrap();
        assert_eq!(failed, None, "a worker failed a check before its kill");
        finished.push(*w.latest.lock().unwrap());
        kills += 1;
        sample(kills);
        workers.push(start_worker(&path, &stop));
    }
    std::fs::write(&stop, b"stop").unwrap();
    for w in workers {
        let status = {
            let mut p = w.proc;
            p.child.wait().unwrap()
        };
        let (done, failed) = w.reader.join().unwrap();
        assert_eq!(failed, None, "a worker failed a check");
        assert!(done, "a worker did not finish cleanly");
        assert!(status.success(), "a worker failed: {status}");
        finished.push(*w.latest.lock().unwrap());
    }

    // After recovery...
    let rec = store.recover().unwrap();
    sample(kills);
    timeline.flush().unwrap();
    drop(timeline);
    let st = store.stats();
    assert_eq!((st.dead_clients, st.clients), (0, 1), "{st:?}");
    assert!(!st.sweep_pending, "{st:?} {rec:?}");
    // 1. every sealed object's bytes match its id.
    let objects = store.list();
    let mut sealed = 0;
    for o in &objects {
        assert_ne!(
            o.state,
            ObjectState::Creating,
            "creation left behind: {o:?}"
        );
        if o.state == ObjectState::Sealed {
            let v = store.try_get(&o.id).unwrap();
            assert_eq!(ObjectId::of_content(&v), o.id, "bytes do not match id");
            sealed += 1;
        }
    }
    // 2. allocator and table agree; deleting everything leaves nothing allocated.
    store.check_invariants().unwrap();
    for o in &objects {
        if o.state == ObjectState::Sealed {
            store.delete(&o.id).unwrap();
        }
    }
    let empty = store.stats();
    assert_eq!(
        (empty.used, empty.objects, empty.draining),
        (0, 0, 0),
        "leaked: {empty:?}"
    );
    assert_eq!(
        store.largest_free(),
        empty.capacity,
        "fragments left: {empty:?}"
    );
    // 3. nobody was blocked beyond its timeout.
    let total = finished.iter().fold(Report::default(), |a, r| Report {
        ops: a.ops + r.ops,
        puts: a.puts + r.puts,
        gets: a.gets + r.gets,
        deletes: a.deletes + r.deletes,
        creator_died: a.creator_died + r.creator_died,
        timeouts: a.timeouts + r.timeouts,
        full: a.full + r.full,
        forks: a.forks + r.forks,
        drains: a.drains + r.drains,
        drained_deleted: a.drained_deleted + r.drained_deleted,
        max_stall_us: a.max_stall_us.max(r.max_stall_us),
        max_op_us: a.max_op_us.max(r.max_op_us),
    });
    // 4. a new client works.
    let fresh = Store::open_path(&path).unwrap();
    let data = content(42, 100_000);
    let id = ObjectId::of_content(&data);
    fresh.put(&id, &data).unwrap();
    assert_eq!(&*store.get(&id, Duration::from_secs(1)).unwrap(), &data[..]);

    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    println!(
        "chaos: {secs} s, {nworkers} workers, {} ops ({} puts, {} gets, {} deletes), {kills} kills, \
         {} clients recovered, {:.1} MiB reclaimed ({} leaked blocks freed by the sweep), \
         {} gets saw CreatorDied, {} timeouts, \
         {} full, {} forked children, {} draining reads ({} of them after a delete), {} evictions, {sealed} objects verified at the end, longest stall beyond \
         timeout {:.1} ms, longest op {:.1} ms",
        total.ops,
        total.puts,
        total.gets,
        total.deletes,
        st.recovered_clients,
        mib(st.reclaimed_bytes),
        st.leaked_blocks_freed,
        total.creator_died,
        total.timeouts,
        total.full,
        total.forks,
        total.drains,
        total.drained_deleted,
        st.evictions,
        total.max_stall_us as f64 / 1000.0,
        total.max_op_us as f64 / 1000.0,
    );
    assert!(kills > 0 && total.ops > 0 && total.forks > 0);
    assert!(
        total.drained_deleted > 0,
        "no draining read met a deleted object: the scenario was not exercised"
    );
    assert!(
        st.recovered_clients >= kills,
        "{} < {kills}",
        st.recovered_clients
    );
    assert!(
        Duration::from_micros(total.max_stall_us) < SLACK,
        "an operation was blocked {} ms beyond its timeout",
        total.max_stall_us / 1000
    );
}
