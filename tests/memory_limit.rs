//! A store larger than the room its creator's memory cgroup has left (a container's memory
//! limit) fails to create with `Error::MemoryLimit`, in a real child process moved into a
//! real memory cgroup, where the kernel would otherwise kill the process in the middle of
//! its reservation. Needs a memory cgroup this process may make children in (root, a
//! writable cgroup file system, no swap); skipped with a message otherwise.

mod common;

use common::{child_role, hear, say, spawn, Proc, CHILD_ENTRY};
use shmstore::{Error, Store, StoreConfig};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};

const MIB: u64 = 1 << 20;

/// Child processes: wait until the parent has moved them into the cgroup, then reserve.
#[test]
#[ignore = "child process entry point, started by the other tests"]
fn child_entry() {
    let (role, args) = child_role().expect("child_entry runs only as a child process");
    let (path, bytes): (PathBuf, u64) = (PathBuf::from(&args[0]), args[1].parse().unwrap());
    say("ready");
    assert_eq!(hear(), "go");
    if role == "fallocate" {
        // The kernel's own behaviour, without the store: what the check saves a creator from.
        let f = std::fs::File::create(&path).unwrap();
        let r = rustix::fs::fallocate(&f, rustix::fs::FallocateFlags::empty(), 0, bytes);
        say(format!("fallocate returned {r:?}"));
        return;
    }
    let dir = path.parent().unwrap();
    let name = path.file_name().unwrap().to_str().unwrap();
    let cfg = StoreConfig {
        dir: dir.to_path_buf(),
        ..StoreConfig::with_capacity(bytes)
    };
    match Store::create(name, &cfg) {
        Ok(s) => say(format!("created {}", s.stats().capacity)),
        Err(e @ Error::MemoryLimit { .. }) => say(format!("memory-limit {e}")),
        Err(e) => say(format!("error {e:?}")),
    }
}

/// A child memory cgroup with a limit, removed when dropped.
struct MemCg(PathBuf);

impl MemCg {
    fn new(limit: u64) -> Result<MemCg, String> {
        let swap = std::fs::read_to_string("/proc/meminfo").map_err(|e| e.to_string())?;
        if swap
            .lines()
            .any(|l| l.starts_with("SwapTotal:") && !l.ends_with(" 0 kB"))
        {
            return Err("this machine has swap, so the store does not check the limit".into());
        }
        let (own, limit_file) =
            shmstore::testing::memory_cgroup().ok_or("no memory cgroup found")?;
        let dir = own.join(format!("shmstore-test-{}", std::process::id()));
        std::fs::create_dir(&dir).map_err(|e| format!("mkdir {}: {e}", dir.display()))?;
        let cg = MemCg(dir);
        std::fs::write(cg.0.join(limit_file), limit.to_string())
            .map_err(|e| format!("{limit_file} in {}: {e}", cg.0.display()))?;
        Ok(cg)
    }

    /// Starts a child in `role` and moves it into the cgroup before it does anything.
    fn child(&self, role: &str, path: &Path, bytes: u64) -> Proc {
        let mut p = spawn(
            CHILD_ENTRY,
            role,
            &[path.display().to_string(), bytes.to_string()],
        );
        assert_eq!(p.recv(), "ready");
        std::fs::write(self.0.join("cgroup.procs"), p.child.id().to_string()).unwrap();
        p.send("go");
        p
    }
}

impl Drop for MemCg {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

#[test]
fn a_store_over_the_cgroup_memory_limit_is_a_typed_error_not_a_kill() {
    let limit = 256 * MIB;
    let cg = match MemCg::new(limit) {
        Ok(cg) => cg,
        Err(why) => {
            eprintln!("skipped: cannot make a memory cgroup with a limit here ({why})");
            return;
        }
    };
    let path = |tag: &str| {
        PathBuf::from(format!(
            "/dev/shm/shmstore-test-memcg-{tag}-{}",
            std::process::id()
        ))
    };
    let _cleanup: Vec<common::Cleanup> = ["raw", "big", "small"]
        .map(|t| common::Cleanup(path(t)))
        .into();

    // The premise: past the limit, the kernel kills the reserving process.
    let mut raw = cg.child("fallocate", &path("raw"), 512 * MIB);
    let status = raw.child.wait().unwrap();
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    std::fs::remove_file(path("raw")).unwrap();

    // A store of twice the limit: refused before reserving, naming the cgroup and the sizes.
    let mut big = cg.child("store", &path("big"), 512 * MIB);
    let said = big.recv();
    assert!(said.starts_with("memory-limit "), "{said}");
    assert!(
        said.contains(&format!("({}: 256.0 MiB)", cg.0.display())),
        "{said}"
    );
    assert!(said.contains("--memory"), "{said}");
    assert!(big.child.wait().unwrap().success());
    assert!(!path("big").exists(), "a refused store leaves no file");

    // One that fits is created as before.
    let mut small = cg.child("store", &path("small"), 64 * MIB);
    assert_eq!(small.recv(), format!("created {}", 64 * MIB));
    assert!(small.child.wait().unwrap().success());
}
