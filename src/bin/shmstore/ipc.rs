//! Plumbing for the benchmark's processes: line pipes to children, a small shared control
//! page with raw futex words (the *floor* the store's own wake-up is compared against), and
//! percentile helpers.

// The futex floor deliberately bypasses the store (and its sync shim): it is the bare
// kernel primitive our seal -> wake path is measured against.
#![allow(clippy::disallowed_types)]

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
pub use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// A child process of the benchmark, spoken to in lines.
pub struct Worker {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Worker {
    /// Starts `shmstore __child ROLE ARGS...`.
    pub fn spawn(role: &str, args: &[String]) -> std::io::Result<Worker> {
        let mut child = Command::new(std::env::current_exe()?)
            .arg(crate::child::ENTRY)
            .arg(role)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let stdin = child.stdin.take().expect("piped");
        let stdout = BufReader::new(child.stdout.take().expect("piped"));
        Ok(Worker {
            child,
            stdin,
            stdout,
        })
    }

    /// Sends a line.
    pub fn send(&mut self, line: &str) {
        let _ = writeln!(self.stdin, "{line}");
        let _ = self.stdin.flush();
    }

    /// Receives a line; an error if the child died.
    pub fn recv(&mut self) -> Result<String, String> {
        let mut s = String::new();
        match self.stdout.read_line(&mut s) {
            Ok(n) if n > 0 => Ok(s.trim_end().to_string()),
            _ => {
                let status = self.child.wait().map(|s| s.to_string()).unwrap_or_default();
                Err(format!("benchmark child exited unexpectedly ({status})"))
            }
        }
    }

    /// Receives a line of whitespace-separated numbers.
    pub fn recv_numbers(&mut self) -> Result<Vec<f64>, String> {
        let line = self.recv()?;
        line.split_whitespace()
            .map(|x| x.parse::<f64>().map_err(|_| format!("child said {line:?}")))
            .collect()
    }

    /// Tells the child to stop and waits for it.
    pub fn finish(mut self) {
        self.send("quit");
        let _ = self.child.wait();
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One shared 4 KiB page holding futex words for the floor measurements.
pub struct ControlPage {
    map: memmap2::MmapRaw,
    path: PathBuf,
    owner: bool,
}

impl ControlPage {
    /// Creates the page at `path`.
    pub fn create(path: &Path) -> std::io::Result<ControlPage> {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)?;
        f.set_len(4096)?;
        Ok(ControlPage {
            map: memmap2::MmapRaw::map_raw(&f)?,
            path: path.to_path_buf(),
            owner: true,
        })
    }

    /// Opens the page created by the parent.
    pub fn open(path: &Path) -> std::io::Result<ControlPage> {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)?;
        Ok(ControlPage {
            map: memmap2::MmapRaw::map_raw(&f)?,
            path: path.to_path_buf(),
            owner: false,
        })
    }

    /// A 64-bit word in cache line `i` (0..64), at byte 8 of the line.
    pub fn word64(&self, i: usize) -> &AtomicU64 {
        assert!(i < 64);
        // SAFETY: as in `word`; offset i * 64 + 8 is 8-aligned and inside the page.
        unsafe { &*(self.map.as_mut_ptr().add(i * 64 + 8) as *const AtomicU64) }
    }

    /// Futex word `i` (0..64), one per cache line.
    pub fn word(&self, i: usize) -> &AtomicU32 {
        assert!(i < 64);
        // SAFETY: the mapping is 4096 bytes, page-aligned and lives as long as `self`;
        // offset i * 64 < 4096 is 4-aligned; AtomicU32 is valid for any bytes.
        unsafe { &*(self.map.as_mut_ptr().add(i * 64) as *const AtomicU32) }
    }
}

impl Drop for ControlPage {
    fn drop(&mut self) {
        if self.owner {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Sleeps while `*w == v` (shared futex, no timeout: the peer is our own child).
pub fn futex_wait(w: &AtomicU32, v: u32) {
    // Empty flags: shared, not private, so the child's wake finds us. Any error (EAGAIN,
    // EINTR) returns to the caller's loop, which re-checks.
    let _ = rustix::thread::futex::wait(w, rustix::thread::futex::Flags::empty(), v, None);
}

/// Wakes everyone sleeping on `w`.
pub fn futex_wake(w: &AtomicU32) {
    let _ = rustix::thread::futex::wake(w, rustix::thread::futex::Flags::empty(), u32::MAX);
}

/// Waits until `*w == target`.
pub fn futex_await(w: &AtomicU32, target: u32) {
    loop {
        let cur = w.load(Ordering::Acquire);
        if cur == target {
            return;
        }
        futex_wait(w, cur);
    }
}

/// Waits until `*w >= target` (the waker may have moved on already).
pub fn futex_await_at_least(w: &AtomicU32, target: u32) -> u32 {
    loop {
        let cur = w.load(Ordering::Acquire);
        if cur >= target {
            return cur;
        }
        futex_wait(w, cur);
    }
}

/// The `p`-th percentile (0..=100) of `v` (sorted in place).
pub fn percentile(v: &mut [u64], p: f64) -> u64 {
    if v.is_empty() {
        return 0;
    }
    v.sort_unstable();
    let i = ((p / 100.0) * (v.len() - 1) as f64).round() as usize;
    v[i.min(v.len() - 1)]
}

/// The p50 and p99 of `v` (sorted in place).
pub fn p50_p99(v: &mut [u64]) -> (u64, u64) {
    (percentile(v, 50.0), percentile(v, 99.0))
}

/// Median of floats.
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// The largest CPU cache of this machine in bytes (sysfs), or 256 MiB if it says none.
pub fn largest_cache_bytes() -> u64 {
    let mut largest = 0;
    for i in 0..8 {
        let path = format!("/sys/devices/system/cpu/cpu0/cache/index{i}/size");
        let Ok(text) = std::fs::read_to_string(path) else {
            continue;
        };
        let text = text.trim();
        let (digits, unit) = match text.strip_suffix('K') {
            Some(d) => (d, 1 << 10),
            None => match text.strip_suffix('M') {
                Some(d) => (d, 1 << 20),
                None => (text, 1),
            },
        };
        if let Ok(n) = digits.parse::<u64>() {
            largest = largest.max(n * unit);
        }
    }
    if largest == 0 {
        256 << 20
    } else {
        largest
    }
}

/// Twice the largest CPU cache's worth of memory, read to empty the caches before a
/// timing ([`CacheEmptier::empty`]).
///
/// The first put into a store and a first read from a fresh attach are compared with a
/// warm put and a second read of the same 64 MiB. A last-level cache can hold those
/// 64 MiB (the 2-core VM's holds 300 MiB): timed back to back, the warm operation then
/// copies from cache, and later ones faster still (8.6, 7.7, 6.4, 5.4 ... 4.9 ms for
/// 64 MiB puts into one store), so the ratio measured the cache, not the store's first
/// touch. With the caches emptied before each, the same puts took 7.4-7.8 ms the first
/// time and 6.9-7.4 ms after. Drop it before allocating gigabytes (a store, the
/// `posix_fallocate` floor): its memory would otherwise press them into reclaim.
pub struct CacheEmptier(Vec<u8>);

impl CacheEmptier {
    /// Allocates (and touches) the memory: twice [`largest_cache_bytes`], within
    /// 64 MiB..2 GiB.
    pub fn new() -> CacheEmptier {
        let size = (2 * largest_cache_bytes()).clamp(64 << 20, 2 << 30);
        CacheEmptier(vec![1u8; size as usize])
    }

    /// Reads one byte per cache line of the whole buffer, so that no byte of what is
    /// timed next is cached. Loads only: no dirty lines are left to write back during
    /// the timing.
    pub fn empty(&self) {
        let mut sum = 0u64;
        for line in self.0.chunks(64) {
            sum = sum.wrapping_add(line[0] as u64);
        }
        std::hint::black_box(sum);
    }
}

/// Sum of every byte of `b`, read as u64 words (touches each byte once).
pub fn touch_all(b: &[u8]) -> u64 {
    let (head, words, tail) = bytemuck::pod_align_to::<u8, u64>(b);
    let mut s = 0u64;
    for &x in head.iter().chain(tail) {
        s = s.wrapping_add(x as u64);
    }
    let mut acc = [0u64; 4];
    for c in words.chunks_exact(4) {
        for k in 0..4 {
            acc[k] = acc[k].wrapping_add(c[k]);
        }
    }
    for &x in words.chunks_exact(4).remainder() {
        s = s.wrapping_add(x);
    }
    acc.iter().fold(s, |a, &x| a.wrapping_add(x))
}

/// Deterministic filler bytes.
pub fn filler(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for c in v.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        c.copy_from_slice(&b[..c.len()]);
    }
    v
}

/// CLOCK_MONOTONIC in ns: one clock for every process on the machine, so a timestamp taken
/// in one process can be subtracted from one taken in another.
pub fn now_ns() -> u64 {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Busy-waits until `now_ns() >= until` (pacing for the asleep-waiter measurement).
pub fn spin_until(until: u64) {
    while now_ns() < until {
        std::hint::spin_loop();
    }
}
