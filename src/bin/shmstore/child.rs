//! The benchmark's child processes (`shmstore __child ROLE ...`): workers, producers and
//! echo peers. Each reads commands and writes results as lines on stdin/stdout.

use crate::ipc::{
    futex_await, futex_await_at_least, futex_wake, now_ns, p50_p99, touch_all, CacheEmptier,
    ControlPage, Ordering,
};
use shmstore::AttachOptions;
use shmstore::{ObjectId, Store};
use std::io::{BufRead, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// The hidden subcommand that starts a child.
pub const ENTRY: &str = "__child";

const LONG: Duration = Duration::from_secs(60);

fn line() -> String {
    let mut s = String::new();
    std::io::stdin().lock().read_line(&mut s).unwrap_or(0);
    s.trim_end().to_string()
}

fn say(s: impl std::fmt::Display) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{s}");
    let _ = out.flush();
}

/// Ids `prefix-0 .. prefix-(n-1)`, computed before any timing starts.
pub fn ids(prefix: &str, n: usize) -> Vec<ObjectId> {
    (0..n)
        .map(|i| ObjectId::of_key(format!("{prefix}-{i}")))
        .collect()
}

pub fn main(args: &[String]) -> ExitCode {
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("shmstore bench child {args:?}: {e}");
            ExitCode::FAILURE
        }
    }
}

fn arg<T: std::str::FromStr>(args: &[String], i: usize) -> Result<T, String> {
    args.get(i)
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| format!("missing or bad argument {i}"))
}

fn run(args: &[String]) -> Result<(), String> {
    let role = args.first().ok_or("no role")?.as_str();
    let open = || Store::open_path(Path::new(&args[1])).map_err(|e| e.to_string());
    match role {
        // A process that attaches for the first time: open (timed), then read one object
        // twice, every byte, each read with nothing of it in the CPU caches (see
        // `CacheEmptier`); reports "open_ms first_read_ms second_read_ms".
        "fresh-attach" => {
            let t = Instant::now();
            let store = open()?;
            let open_ms = t.elapsed().as_secs_f64() * 1e3;
            let id: ObjectId = args[2].parse().map_err(|e| format!("{e:?}"))?;
            let caches = CacheEmptier::new();
            let mut reads = [0.0f64; 2];
            for r in &mut reads {
                caches.empty();
                let t = Instant::now();
                let v = store.get(&id, LONG).map_err(|e| e.to_string())?;
                std::hint::black_box(touch_all(&v));
                drop(v);
                *r = t.elapsed().as_secs_f64() * 1e3;
            }
            say(format!("{open_ms} {} {}", reads[0], reads[1]));
            line();
        }
        // get (hit) + drop of pre-sealed objects; reports p50 and p99 in ns, then the p50
        // of the same get without its stats counter (the binding's uncounted slice), in
        // alternating passes so that both see the same cache and frequency state.
        "get-hit" => {
            let store = open()?;
            let ids = ids(&args[2], arg(args, 3)?);
            let reps: usize = arg(args, 4)?;
            say("ready");
            let mut counted = Vec::with_capacity(ids.len() * reps);
            let mut uncounted = Vec::with_capacity(ids.len() * reps);
            for rep in 0..reps * 2 {
                let count = rep % 2 == 0;
                for id in &ids {
                    let t = Instant::now();
                    if count {
                        drop(store.try_get(id).map_err(|e| e.to_string())?);
                    } else {
                        let (v, _) = store
                            .get_slice(id, Duration::ZERO, false)
                            .map_err(|e| e.to_string())?;
                        drop(v.map_err(|e| e.to_string())?);
                    }
                    let ns = t.elapsed().as_nanos() as u64;
                    if count {
                        counted.push(ns)
                    } else {
                        uncounted.push(ns)
                    }
                }
            }
            let (p50, p99) = p50_p99(&mut counted);
            let (p50_off, _) = p50_p99(&mut uncounted);
            say(format!("{p50} {p99} {p50_off}"));
        }
        // Tiny create + seal as fast as possible; reports elapsed ns.
        "producer" => {
            let store = open()?;
            let ids = ids(&args[2], arg(args, 3)?);
            let size: u64 = arg(args, 4)?;
            say("ready");
            if line() != "go" {
                return Err("expected go".into());
            }
            let t = Instant::now();
            for id in &ids {
                let mut c = store.create_object(id, size).map_err(|e| e.to_string())?;
                c[0] = 1;
                c.seal().map_err(|e| e.to_string())?;
            }
            say(t.elapsed().as_nanos());
        }
        // The worker half of the seal -> wake ping-pong through the store.
        "pong-store" => {
            let store = open()?;
            let n: usize = arg(args, 2)?;
            let (ping, pong) = (ids("ping", n), ids("pong", n));
            say("ready");
            for i in 0..n {
                drop(store.get(&ping[i], LONG).map_err(|e| e.to_string())?);
                store.put(&pong[i], &[1; 8]).map_err(|e| e.to_string())?;
            }
            say("done");
        }
        // A getter that is asleep in the futex (no spin) when the seal comes; the payload
        // carries the sealer's CLOCK_MONOTONIC timestamp. Reports one-way p50 and p99 ns.
        "wake-store" => {
            let opts = AttachOptions {
                get_spin: Duration::ZERO,
                ..Default::default()
            };
            let store = Store::open_with(Path::new(&args[1]), &opts).map_err(|e| e.to_string())?;
            let ids = ids("wake", arg(args, 2)?);
            say("ready");
            let mut lat = Vec::with_capacity(ids.len());
            for id in &ids {
                let v = store.get(id, LONG).map_err(|e| e.to_string())?;
                let now = now_ns();
                let sent = u64::from_le_bytes(v[..8].try_into().map_err(|_| "short payload")?);
                lat.push(now.saturating_sub(sent));
            }
            let (p50, p99) = p50_p99(&mut lat);
            say(format!("{p50} {p99}"));
        }
        // The same shape on a bare futex word: the floor for the measurement above.
        "wake-futex" => {
            let ctl = ControlPage::open(Path::new(&args[1])).map_err(|e| e.to_string())?;
            let n: u32 = arg(args, 2)?;
            let (w, ts) = (ctl.word(1), ctl.word64(2));
            say("ready");
            let mut lat = Vec::with_capacity(n as usize);
            let mut i = 0;
            while i < n {
                let got = futex_await_at_least(w, i + 1);
                let now = now_ns();
                if got == i + 1 {
                    lat.push(now.saturating_sub(ts.load(Ordering::Acquire)));
                }
                i = got;
            }
            let (p50, p99) = p50_p99(&mut lat);
            say(format!("{p50} {p99}"));
        }
        // The worker half of the bare futex ping-pong (the floor).
        "pong-futex" => {
            let ctl = ControlPage::open(Path::new(&args[1])).map_err(|e| e.to_string())?;
            let n: u32 = arg(args, 2)?;
            let w = ctl.word(0);
            say("ready");
            for i in 0..n {
                futex_await(w, 2 * i + 1);
                w.store(2 * i + 2, Ordering::Release);
                futex_wake(w);
            }
            say("done");
        }
        // Echo one byte per round trip over a unix socket (the socket floor).
        "echo" => {
            let mut s = UnixStream::connect(&args[1]).map_err(|e| e.to_string())?;
            let mut b = [0u8; 1];
            while s.read_exact(&mut b).is_ok() {
                if s.write_all(&b).is_err() {
                    break;
                }
            }
        }
        // End-to-end worker: gets items by id (or reads them from a socket), reads every
        // byte, and reports a checksum.
        "e2e" => {
            let store = open()?;
            let mut sock: Option<UnixStream> = None;
            let mut buf: Vec<u8> = Vec::new();
            say("ready");
            loop {
                let l = line();
                let mut parts = l.split_whitespace();
                match parts.next() {
                    Some("get") => {
                        let id: ObjectId = parts.next().ok_or("id")?.parse().map_err(|_| "id")?;
                        let v = store.get(&id, LONG).map_err(|e| e.to_string())?;
                        let sum = touch_all(&v);
                        drop(v);
                        say(format!("done {sum}"));
                    }
                    Some("connect") => {
                        sock = Some(
                            UnixStream::connect(parts.next().ok_or("path")?)
                                .map_err(|e| e.to_string())?,
                        );
                        say("connected");
                    }
                    Some("recv") => {
                        let len: usize = parts.next().ok_or("len")?.parse().map_err(|_| "len")?;
                        if buf.len() != len {
                            buf = vec![1u8; len]; // touched: the socket side gets warm pages
                        }
                        let s = sock.as_mut().ok_or("not connected")?;
                        s.read_exact(&mut buf).map_err(|e| e.to_string())?;
                        say(format!("done {}", touch_all(&buf)));
                    }
                    _ => break,
                }
            }
        }
        other => return Err(format!("unknown role {other}")),
    }
    Ok(())
}
