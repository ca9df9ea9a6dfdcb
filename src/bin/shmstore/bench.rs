//! `shmstore bench`: one engine process (this one) and worker processes on a temporary
//! store in /dev/shm, each figure measured beside its floor or peer in the same run.
//!
//! Sections (keys in docs/benchmarks.md):
//! 1. get (hit) from another process          beside a unix-socket round trip
//! 2. create + write + seal, 64 B and 4 KiB   beside two socket round trips (a socket store's create + seal)
//! 3. tiny create + seal, 1 and 2 producers   beside socket round trips per second
//! 4. seal -> wake across processes           beside a bare futex ping-pong
//! 5. put at 1/16/64 MiB                       beside memcpy into a warm buffer
//! 6. engine -> 2 workers, 16 and 64 MiB       beside the same bytes over unix sockets
//! 7. allocator alloc + free                   beside glibc malloc + free
//! 8. fragmentation: churn and vLLM-like mixes beside rlsf (TLSF) on the same traces

use crate::child::ids;
use crate::ipc::{
    filler, futex_await, futex_wake, median, now_ns, p50_p99, percentile, spin_until, ControlPage,
    Ordering, Worker,
};
use crate::report::{ns, ratio, Report};
use shmstore::{ObjectId, Store, StoreConfig};
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Default)]
pub struct Options {
    pub quick: bool,
    pub json: bool,
    /// Run the scaling rows (`crate::scale`) instead of the per-operation ones.
    pub scale: bool,
}

struct Plan {
    socket_rtts: usize,
    get_objects: usize,
    get_reps: usize,
    create_reps: usize,
    tiny_per_producer: usize,
    pings: u32,
    put_reps: usize,
    e2e_reps: usize,
    alloc_reps: usize,
    churn_ops: usize,
}

impl Plan {
    fn new(quick: bool) -> Plan {
        if quick {
            Plan {
                socket_rtts: 5_000,
                get_objects: 1000,
                get_reps: 20,
                create_reps: 20_000,
                tiny_per_producer: 100_000,
                pings: 2_000,
                put_reps: 5,
                e2e_reps: 5,
                alloc_reps: 20_000,
                churn_ops: 4_000,
            }
        } else {
            Plan {
                socket_rtts: 50_000,
                get_objects: 4000,
                get_reps: 50,
                create_reps: 200_000,
                tiny_per_producer: 400_000,
                pings: 20_000,
                put_reps: 21,
                e2e_reps: 21,
                alloc_reps: 200_000,
                churn_ops: 40_000,
            }
        }
    }
}

/// Removes the benchmark's files however the run ends.
struct Cleanup(Vec<PathBuf>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

fn spawn_ready(role: &str, args: &[String]) -> Result<Worker, String> {
    let mut w = Worker::spawn(role, args).map_err(err)?;
    let hello = w.recv()?;
    if hello != "ready" {
        return Err(format!("child {role} said {hello:?}"));
    }
    Ok(w)
}

fn delete_all(store: &Store, ids: &[ObjectId]) {
    for id in ids {
        let _ = store.delete(id);
    }
}

/// Prints the report as a table, or as JSON.
fn print(opts: &Options, r: &Report, started: Instant) {
    let machine = machine();
    if opts.json {
        println!("{}", r.json(&machine));
    } else {
        let header = format!(
            "shmstore bench{}{} on {} ({} s)",
            if opts.scale { " --scale" } else { "" },
            if opts.quick { " --quick" } else { "" },
            machine
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(", "),
            started.elapsed().as_secs()
        );
        print!("{}", r.table(&header));
    }
}

pub fn run(opts: &Options) -> Result<(), String> {
    if opts.scale {
        let started = Instant::now();
        let mut r = Report::default();
        let progress = |what: &str| {
            if !opts.json {
                eprintln!("[{:>5.1}s] {what}", started.elapsed().as_secs_f64());
            }
        };
        crate::scale::run(opts.quick, &mut r, &progress)?;
        print(opts, &r, started);
        return Ok(());
    }
    let plan = Plan::new(opts.quick);
    let pid = std::process::id();
    let name = format!("shmstore-bench-{pid}");
    let cfg = StoreConfig {
        max_objects: (plan.tiny_per_producer as u64 * 2).max(1 << 16),
        ..StoreConfig::with_capacity(1 << 30)
    };
    let started = Instant::now();
    let store = Store::create(&name, &cfg).map_err(err)?;
    let store_path = store.path().expect("named").to_path_buf();
    let ctl_path = PathBuf::from(format!("/dev/shm/shmstore-bench-{pid}.ctl"));
    let sock_path = std::env::temp_dir().join(format!("shmstore-bench-{pid}.sock"));
    let _cleanup = Cleanup(vec![
        store_path.clone(),
        ctl_path.clone(),
        sock_path.clone(),
    ]);
    let sp = store_path.display().to_string();
    let mut r = Report::default();
    let progress = |what: &str| {
        if !opts.json {
            eprintln!("[{:>5.1}s] {what}", started.elapsed().as_secs_f64());
        }
    };

    // ---- floor: unix socket round trip -------------------------------------------------
    progress("socket round trip (floor)");
    let listener = UnixListener::bind(&sock_path).map_err(err)?;
    let echo = Worker::spawn("echo", &[sock_path.display().to_string()]).map_err(err)?;
    let (mut s, _) = listener.accept().map_err(err)?;
    let mut rtts = Vec::with_capacity(plan.socket_rtts);
    let mut b = [7u8; 1];
    for _ in 0..plan.socket_rtts {
        let t = Instant::now();
        s.write_all(&b).map_err(err)?;
        s.read_exact(&mut b).map_err(err)?;
        rtts.push(t.elapsed().as_nanos() as u64);
    }
    drop(s);
    drop(echo);
    let rtt = r.fig("socket_rtt_p50_ns", percentile(&mut rtts, 50.0) as f64);

    // ---- 1. get hit from another process -------------------------------------------
    progress("get (hit) from another process");
    let get_ids = ids("get", plan.get_objects);
    for id in &get_ids {
        store.put(id, &[3u8; 4096]).map_err(err)?;
    }
    let mut w = spawn_ready(
        "get-hit",
        &[
            sp.clone(),
            "get".into(),
            plan.get_objects.to_string(),
            plan.get_reps.to_string(),
        ],
    )?;
    let v = w.recv_numbers()?;
    w.finish();
    delete_all(&store, &get_ids);
    let (g50, g99) = (r.fig("get_hit_p50_ns", v[0]), r.fig("get_hit_p99_ns", v[1]));
    r.row(
        "get hit, other process, p50 (p99)",
        format!("{} ({})", ns(g50), ns(g99)),
        format!("socket round trip {}", ns(rtt)),
        ratio(g50, rtt),
        "<= 500 ns (Plasma 40 us)",
    );
    // What counting costs: each get adds to this process's own counters (no cache line
    // shared with other processes); the same get without it, in the same worker.
    let off = r.fig("get_hit_uncounted_p50_ns", v[2]);
    r.row(
        "get hit with stats counters, p50",
        ns(g50),
        format!("same get, uncounted {}", ns(off)),
        ratio(g50, off),
        "<= 1.1x",
    );

    // ---- 2. create + write + seal ------------------------------------------------------
    progress("create + write + seal");
    for (size, key, label) in [
        (64usize, "create_seal_64_p50_ns", "64 B"),
        (4096, "create_seal_4k_p50_ns", "4 KiB"),
    ] {
        let ids = ids(&format!("cs{size}"), plan.create_reps);
        let data = vec![5u8; size];
        let mut t = Vec::with_capacity(ids.len());
        for id in &ids {
            let t0 = Instant::now();
            store.put(id, &data).map_err(err)?;
            t.push(t0.elapsed().as_nanos() as u64);
        }
        delete_all(&store, &ids);
        let p50 = r.fig(key, percentile(&mut t, 50.0) as f64);
        r.row(
            format!("create + write + seal {label}, p50"),
            ns(p50),
            format!("2 socket round trips {}", ns(2.0 * rtt)),
            ratio(p50, 2.0 * rtt),
            if size == 64 {
                "-"
            } else {
                "<= 1 us (Plasma 85 us)"
            },
        );
    }

    // ---- 3. tiny create + seal throughput ---------------------------------------------
    for producers in [1usize, 2] {
        progress(&format!("tiny create + seal, {producers} producer(s)"));
        let mut ws = Vec::new();
        for p in 0..producers {
            ws.push(spawn_ready(
                "producer",
                &[
                    sp.clone(),
                    format!("tiny{p}"),
                    plan.tiny_per_producer.to_string(),
                    "64".into(),
                ],
            )?);
        }
        for w in &mut ws {
            w.send("go");
        }
        let mut rates = Vec::new();
        for mut w in ws {
            let ns_elapsed = w.recv_numbers()?[0];
            rates.push(plan.tiny_per_producer as f64 / (ns_elapsed / 1e9));
            w.finish();
        }
        for p in 0..producers {
            delete_all(&store, &ids(&format!("tiny{p}"), plan.tiny_per_producer));
        }
        let per = rates.iter().sum::<f64>() / rates.len() as f64;
        let socket_rate = 1e9 / rtt;
        if producers == 1 {
            r.fig("tiny_ops_per_s_1p", per);
        } else {
            r.fig("tiny_ops_per_s_2p_per_producer", per);
            r.fig("tiny_ops_per_s_2p_total", rates.iter().sum());
        }
        r.row(
            format!("tiny create + seal, {producers} producer(s), per producer"),
            format!("{:.2} M/s", per / 1e6),
            format!("socket round trips {:.3} M/s", socket_rate / 1e6),
            ratio(per, socket_rate),
            ">= 2 M/s (Plasma 19 k/s)",
        );
    }

    // ---- 4. seal -> wake ----------------------------------------------------------------
    // (a) The getter is asleep in the futex when the seal comes (no spin, 200 us between
    // seals so its CPU has gone idle), one way, timestamps from CLOCK_MONOTONIC; beside a
    // bare futex wake of the same shape.
    progress("seal -> wake of a sleeping getter");
    let n = plan.pings as usize;
    let ctl = ControlPage::create(&ctl_path).map_err(err)?;
    let gap = 200_000;
    let mut w = spawn_ready("wake-store", &[sp.clone(), n.to_string()])?;
    let wake_ids = ids("wake", n);
    for id in &wake_ids {
        spin_until(now_ns() + gap);
        let mut c = store.create_object(id, 8).map_err(err)?;
        c.copy_from_slice(&now_ns().to_le_bytes());
        c.seal().map_err(err)?;
    }
    let ours = w.recv_numbers()?;
    w.finish();
    delete_all(&store, &wake_ids);
    let mut w = spawn_ready(
        "wake-futex",
        &[ctl_path.display().to_string(), n.to_string()],
    )?;
    let (word, ts) = (ctl.word(1), ctl.word64(2));
    for i in 0..plan.pings {
        spin_until(now_ns() + gap);
        ts.store(now_ns(), Ordering::Release);
        word.store(i + 1, Ordering::Release);
        futex_wake(word);
    }
    let floor = w.recv_numbers()?;
    w.finish();
    let (s50, s99) = (
        r.fig("seal_wake_p50_us", ours[0] / 1e3),
        r.fig("seal_wake_p99_us", ours[1] / 1e3),
    );
    let (f50, f99) = (
        r.fig("futex_wake_p50_us", floor[0] / 1e3),
        r.fig("futex_wake_p99_us", floor[1] / 1e3),
    );
    r.row(
        "seal -> wake of a getter asleep in futex, p50 (p99)",
        format!("{s50:.1} us ({s99:.1} us)"),
        format!("bare futex wake {f50:.1} us ({f99:.1} us)"),
        ratio(s50, f50),
        "<= 1.5x futex (Plasma 106 us)",
    );

    // (b) Ping-pong through the store with the default get (spins up to 50 us before it
    // sleeps), beside a tight bare-futex ping-pong.
    progress("seal -> get ping-pong");
    let mut w = spawn_ready("pong-store", &[sp.clone(), n.to_string()])?;
    let (ping, pong) = (ids("ping", n), ids("pong", n));
    let mut one_way = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        store.put(&ping[i], &[1; 8]).map_err(err)?;
        drop(store.get(&pong[i], Duration::from_secs(60)).map_err(err)?);
        one_way.push(t.elapsed().as_nanos() as u64 / 2);
    }
    if w.recv()? != "done" {
        return Err("pong-store failed".into());
    }
    w.finish();
    delete_all(&store, &ping);
    delete_all(&store, &pong);
    let mut w = spawn_ready(
        "pong-futex",
        &[ctl_path.display().to_string(), n.to_string()],
    )?;
    let word = ctl.word(0);
    let mut floor = Vec::with_capacity(n);
    for i in 0..plan.pings {
        let t = Instant::now();
        word.store(2 * i + 1, Ordering::Release);
        futex_wake(word);
        futex_await(word, 2 * i + 2);
        floor.push(t.elapsed().as_nanos() as u64 / 2);
    }
    if w.recv()? != "done" {
        return Err("pong-futex failed".into());
    }
    w.finish();
    let (o50, o99) = p50_p99(&mut one_way);
    let (l50, l99) = p50_p99(&mut floor);
    let p50 = r.fig("pingpong_p50_us", o50 as f64 / 1e3);
    let p99 = r.fig("pingpong_p99_us", o99 as f64 / 1e3);
    let f50 = r.fig("futex_pingpong_p50_us", l50 as f64 / 1e3);
    let f99 = r.fig("futex_pingpong_p99_us", l99 as f64 / 1e3);
    r.row(
        "put -> get ping-pong, one way, p50 (p99)",
        format!("{p50:.2} us ({p99:.2} us)"),
        format!("bare futex ping-pong {f50:.1} us ({f99:.1} us)"),
        ratio(p50, f50),
        "-",
    );

    // ---- 5. put throughput ------------------------------------------------------------
    for (mib, kp, km) in [
        (1usize, "put_gbps_1m", "memcpy_gbps_1m"),
        (16, "put_gbps_16m", "memcpy_gbps_16m"),
        (64, "put_gbps_64m", "memcpy_gbps_64m"),
    ] {
        progress(&format!("put {mib} MiB"));
        let len = mib << 20;
        let src = filler(mib as u64, len);
        let mut dst = vec![1u8; len];
        let (mut put, mut cpy) = (Vec::new(), Vec::new());
        for rep in 0..plan.put_reps {
            let id = ObjectId::of_key(format!("put-{mib}-{rep}"));
            let t = Instant::now();
            store.put(&id, &src).map_err(err)?;
            put.push(len as f64 / t.elapsed().as_secs_f64() / 1e9);
            store.delete(&id).map_err(err)?;
            let t = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&dst);
            cpy.push(len as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
        let (p, m) = (r.fig(kp, median(&mut put)), r.fig(km, median(&mut cpy)));
        r.row(
            format!("put {mib} MiB"),
            format!("{p:.2} GB/s"),
            format!("memcpy, warm buffer {m:.2} GB/s"),
            ratio(p, m),
            ">= 0.9x memcpy",
        );
    }

    // ---- 6. engine -> 2 workers end to end ----------------------------------------------
    progress("engine -> 2 workers");
    let mut workers = vec![
        spawn_ready("e2e", std::slice::from_ref(&sp))?,
        spawn_ready("e2e", std::slice::from_ref(&sp))?,
    ];
    let _ = std::fs::remove_file(&sock_path);
    let listener = UnixListener::bind(&sock_path).map_err(err)?;
    let mut streams: Vec<UnixStream> = Vec::new();
    for w in &mut workers {
        w.send(&format!("connect {}", sock_path.display()));
        let (s, _) = listener.accept().map_err(err)?;
        if w.recv()? != "connected" {
            return Err("worker failed to connect".into());
        }
        streams.push(s);
    }
    for (mib, ks, kk) in [
        (16usize, "e2e_16m_ms", "socket_16m_ms"),
        (64, "e2e_64m_ms", "socket_64m_ms"),
    ] {
        let len = mib << 20;
        let (mut shm, mut sock) = (Vec::new(), Vec::new());
        for rep in 0..plan.e2e_reps {
            let data = filler(rep as u64 + 100, len);
            let id = ObjectId::of_key(format!("e2e-{mib}-{rep}"));
            let t = Instant::now();
            store.put(&id, &data).map_err(err)?;
            for w in &mut workers {
                w.send(&format!("get {id}"));
            }
            let sums: Vec<String> = workers
                .iter_mut()
                .map(|w| w.recv())
                .collect::<Result<_, _>>()?;
            shm.push(t.elapsed().as_secs_f64() * 1e3);
            store.delete(&id).map_err(err)?;
            let t = Instant::now();
            for w in &mut workers {
                w.send(&format!("recv {len}"));
            }
            std::thread::scope(|sc| {
                for s in &mut streams {
                    let d = &data;
                    sc.spawn(move || s.write_all(d));
                }
            });
            let sums2: Vec<String> = workers
                .iter_mut()
                .map(|w| w.recv())
                .collect::<Result<_, _>>()?;
            sock.push(t.elapsed().as_secs_f64() * 1e3);
            if sums != sums2 || sums[0] != sums[1] {
                return Err(format!(
                    "workers read different bytes: {sums:?} vs {sums2:?}"
                ));
            }
        }
        let (a, b) = (r.fig(ks, median(&mut shm)), r.fig(kk, median(&mut sock)));
        r.row(
            format!("engine -> 2 workers, {mib} MiB, read every byte"),
            format!("{a:.2} ms"),
            format!("unix sockets {b:.2} ms"),
            format!("{:.2}x faster", b / a),
            if mib == 64 {
                ">= 2x faster (vLLM store 39 ms)"
            } else {
                "-"
            },
        );
    }
    drop(streams);
    for w in workers {
        w.finish();
    }

    // ---- 7. allocator -----------------------------------------------------------------
    progress("allocator");
    for (size, ko, km, label) in [
        (
            64u64,
            "alloc_free_small_p50_ns",
            "malloc_free_small_p50_ns",
            "64 B",
        ),
        (
            1 << 20,
            "alloc_free_large_p50_ns",
            "malloc_free_large_p50_ns",
            "1 MiB",
        ),
    ] {
        let (mut ours, mut libc_t) = (Vec::new(), Vec::new());
        for _ in 0..plan.alloc_reps {
            let t = Instant::now();
            let b = store.raw_alloc(size).map_err(err)?;
            store.raw_free(b).map_err(err)?;
            ours.push(t.elapsed().as_nanos() as u64);
            let t = Instant::now();
            // SAFETY: plain malloc/free pair of a non-zero size; the pointer is not used.
            unsafe { libc::free(std::hint::black_box(libc::malloc(size as usize))) };
            libc_t.push(t.elapsed().as_nanos() as u64);
        }
        let (o, m) = (
            r.fig(ko, percentile(&mut ours, 50.0) as f64),
            r.fig(km, percentile(&mut libc_t, 50.0) as f64),
        );
        r.row(
            format!("alloc + free {label}, p50"),
            ns(o),
            format!("glibc malloc + free {}", ns(m)),
            ratio(o, m),
            "-",
        );
    }
    alloc_in_holes(&store, plan.alloc_reps, &mut r)?;
    churn(&store, plan.churn_ops, &mut r)?;

    let st = store.stats();
    if st.objects != 0 || st.used != 0 {
        return Err(format!("benchmark left objects behind: {st:?}"));
    }
    store.check_invariants().map_err(err)?;
    print(opts, &r, started);
    Ok(())
}

/// Best fit's search where it is longest: the heap cut into 64 KiB holes (every other
/// 64 KiB run freed) up to a free top of 64 MiB, so a 1 MiB run is found only at the top;
/// beside copying the 1 MiB, which is what the allocation is for.
fn alloc_in_holes(store: &Store, reps: usize, r: &mut Report) -> Result<(), String> {
    let (o, c) = alloc_in_holes_ns(store, reps)?;
    let (o, c) = (
        r.fig("alloc_free_large_in_holes_p50_ns", o),
        r.fig("memcpy_1m_p50_ns", c),
    );
    r.row(
        "alloc + free 1 MiB, heap in 64 KiB holes, p50",
        ns(o),
        format!("memcpy of the 1 MiB {}", ns(c)),
        ratio(o, c),
        "-",
    );
    Ok(())
}

/// Cuts the heap of `store` into 64 KiB holes below a free top of 64 MiB, then times
/// `reps` allocations + frees of 1 MiB beside copies of 1 MiB: (p50 ns, p50 ns). The
/// store is as it was afterwards.
pub(crate) fn alloc_in_holes_ns(store: &Store, reps: usize) -> Result<(f64, f64), String> {
    let st = store.stats();
    // (Raw blocks are not objects: `used` does not count them.)
    let room = st.capacity.saturating_sub(st.used + (64 << 20));
    let mut runs = Vec::new();
    while (runs.len() as u64 + 1) * (64 << 10) <= room {
        match store.raw_alloc(64 << 10) {
            Ok(b) => runs.push(Some(b)),
            Err(_) => break,
        }
    }
    for b in runs.iter_mut().step_by(2) {
        store
            .raw_free(b.take().expect("every other run"))
            .map_err(err)?;
    }
    let timed = alloc_beside_copy(store, reps.min(2000));
    for b in runs.into_iter().flatten() {
        store.raw_free(b).map_err(err)?;
    }
    timed
}

/// p50 of `reps` allocations + frees of 1 MiB, and of copying 1 MiB (warm buffers), in
/// turns, in ns.
pub(crate) fn alloc_beside_copy(store: &Store, reps: usize) -> Result<(f64, f64), String> {
    let (src, mut dst) = (vec![1u8; 1 << 20], vec![0u8; 1 << 20]);
    let (mut ours, mut copy) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        let t = Instant::now();
        let b = store.raw_alloc(1 << 20).map_err(err)?;
        store.raw_free(b).map_err(err)?;
        ours.push(t.elapsed().as_nanos() as u64);
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        copy.push(t.elapsed().as_nanos() as u64);
    }
    Ok((
        percentile(&mut ours, 50.0) as f64,
        percentile(&mut copy, 50.0) as f64,
    ))
}

/// Fragmentation against a reference allocator (see `frag`), then: after everything is
/// deleted, does the whole capacity fit as one object again (nothing stranded)?
fn churn(store: &Store, ops: usize, r: &mut Report) -> Result<(), String> {
    crate::frag::compare(store, ops, r)?;
    crate::frag::eviction(store.stats().capacity, r)?;
    store.check_invariants().map_err(err)?;
    let after = store.stats();
    let fits = store
        .raw_alloc(after.capacity)
        .map(|b| store.raw_free(b))
        .is_ok();
    let recovered = r.fig(
        "after_churn_usable_fraction",
        store.largest_free() as f64 / after.capacity as f64,
    );
    r.fig(
        "after_churn_largest_object_bytes",
        if fits {
            after.capacity as f64
        } else {
            store.largest_free() as f64
        },
    );
    r.row(
        "after churn, all deleted: largest object",
        format!("{:.0}% of capacity", recovered * 100.0),
        format!("whole store fits again: {fits}"),
        "-".into(),
        "100%",
    );
    Ok(())
}

fn machine() -> Vec<(&'static str, String)> {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    vec![
        ("cpu", cpu),
        (
            "cores",
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(0)
                .to_string(),
        ),
        ("kernel", kernel.trim().to_string()),
    ]
}
