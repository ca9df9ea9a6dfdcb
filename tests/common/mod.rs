//! Test support: real child processes that re-execute this test binary.
//!
//! A child is the same test executable started with `--ignored --exact <entry>` and the
//! role in `SHMSTORE_CHILD`; it talks to the parent over stdin/stdout lines. Waiting for a
//! child to be *blocked in the kernel* reads `/proc/PID/task/*/syscall` instead of sleeping.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

/// A running child process with line-based pipes.
pub struct Proc {
    pub child: Child,
    stdin: ChildStdin,
    stdout: Option<BufReader<ChildStdout>>,
}

/// Starts `entry` (an `#[ignore]`d test in the same binary) as a child with `role` and args.
pub fn spawn(entry: &str, role: &str, args: &[String]) -> Proc {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            entry,
            "--nocapture",
            "--test-threads=1",
            "-q",
        ])
        .env("SHMSTORE_CHILD", role)
        .env("SHMSTORE_ARGS", args.join("\u{1f}"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn child");
    let stdin = child.stdin.take().unwrap();
    let stdout = Some(BufReader::new(child.stdout.take().unwrap()));
    Proc {
        child,
        stdin,
        stdout,
    }
}

impl Proc {
    /// Next protocol line from the child (lines starting with `@`), skipping harness noise.
    pub fn recv(&mut self) -> String {
        loop {
            let mut line = String::new();
            let out = self.stdout.as_mut().expect("stdout was taken");
            let n = out.read_line(&mut line).expect("read child");
            assert!(n > 0, "child exited before answering");
            if let Some(msg) = line.trim_end().strip_prefix('@') {
                return msg.to_string();
            }
        }
    }

    /// Takes the child's stdout, to read it from another thread.
    pub fn take_stdout(&mut self) -> BufReader<ChildStdout> {
        self.stdout.take().expect("stdout was taken")
    }

    /// Sends one line to the child.
    pub fn send(&mut self, msg: &str) {
        writeln!(self.stdin, "{msg}").unwrap();
        self.stdin.flush().unwrap();
    }

    /// Waits for the child to exit successfully.
    pub fn finish(mut self) {
        drop(self.stdin);
        let status = self.child.wait().unwrap();
        assert!(status.success(), "child failed: {status}");
    }

    /// Waits until some thread of the child sleeps in `futex(2)`, or panics after `limit`.
    pub fn wait_until_blocked_in_futex(&self, limit: Duration) {
        let pid = self.child.id();
        let deadline = Instant::now() + limit;
        loop {
            if blocked_in_futex(pid) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "child {pid} never blocked in futex"
            );
            std::thread::yield_now();
        }
    }
}

/// Whether a thread of `pid` sleeps in a *shared* futex wait, the store's kind (threads
/// of the test harness itself sleep in private ones, e.g. the main thread joining the
/// test's thread).
fn blocked_in_futex(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    let shared_futex_wait = |syscall: &str| {
        // "<nr> <addr> <op> ...", hex arguments.
        let mut f = syscall.split_whitespace();
        let nr = f.next();
        let op = f
            .nth(1)
            .and_then(|op| i64::from_str_radix(op.trim_start_matches("0x"), 16).ok());
        nr == Some(&libc::SYS_futex.to_string())
            && op.is_some_and(|op| op & libc::FUTEX_PRIVATE_FLAG as i64 == 0)
    };
    tasks.flatten().any(|t| {
        std::fs::read_to_string(t.path().join("syscall")).is_ok_and(|s| shared_futex_wait(&s))
            && std::fs::read_to_string(t.path().join("stat")).is_ok_and(|s| {
                s.rsplit(')')
                    .next()
                    .is_some_and(|r| r.trim_start().starts_with('S'))
            })
    })
}

/// In a child: its role and args, if this process is a child.
pub fn child_role() -> Option<(String, Vec<String>)> {
    let role = std::env::var("SHMSTORE_CHILD").ok()?;
    let args = std::env::var("SHMSTORE_ARGS").unwrap_or_default();
    let args = if args.is_empty() {
        vec![]
    } else {
        args.split('\u{1f}').map(str::to_owned).collect()
    };
    Some((role, args))
}

/// In a child: sends a protocol line to the parent.
pub fn say(msg: impl std::fmt::Display) {
    println!("@{msg}");
}

/// In a child: reads one line from the parent.
pub fn hear() -> String {
    let mut s = String::new();
    std::io::stdin().read_line(&mut s).unwrap();
    s.trim_end().to_string()
}

/// The test entry point that child processes run (an `#[ignore]`d test in each binary).
pub const CHILD_ENTRY: &str = "child_entry";

/// A named store for one test, removed when the returned guard drops.
pub fn store_with(tag: &str, cfg: &shmstore::StoreConfig) -> (shmstore::Store, Cleanup) {
    let store = shmstore::Store::create(&unique_name(tag), cfg).unwrap();
    let path = store.path().unwrap().to_path_buf();
    (store, Cleanup(path))
}

/// Starts this binary's `child_entry` as a child in `role`, attached to `store`.
pub fn child(role: &str, store: &shmstore::Store, extra: &[String]) -> Proc {
    let mut args = vec![store.path().unwrap().display().to_string()];
    args.extend_from_slice(extra);
    spawn(CHILD_ENTRY, role, &args)
}

/// Runs the `shmstore` command-line tool: whether it exited 0, its stdout and its stderr.
pub fn shmstore_cli(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_shmstore"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A unique store name for this test run.
pub fn unique_name(tag: &str) -> String {
    // Tags are unique per test; the pid separates concurrent test binaries.
    format!("shmstore-test-{tag}-{}", std::process::id())
}

/// Removes a named store file when dropped (even if the test fails).
pub struct Cleanup(pub std::path::PathBuf);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Deterministic pseudo-random bytes.
pub fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}
