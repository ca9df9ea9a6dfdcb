//! The memory limit a new store's memory counts against: that of the memory cgroup of the
//! process creating it (a container's `--memory`, a Kubernetes pod's
//! `resources.limits.memory`, a systemd unit's `MemoryMax=`).
//!
//! Shared memory is charged to the cgroup of the process that allocates it, and a store
//! allocates all of its memory when it is created (`fallocate`). Past the limit the kernel
//! does not fail that allocation: it reclaims what it can and then kills a process of the
//! cgroup (measured on Linux 6.18: a 1 GiB `fallocate` on /dev/shm from a cgroup limited to
//! 512 MiB ends in SIGKILL, with nothing on stderr). So before reserving, the creator reads
//! the limit of its cgroup and of every ancestor it can see, and refuses with
//! [`crate::Error::MemoryLimit`] when the tightest leaves less room than the store needs.
//!
//! Invariants:
//! * the estimate errs towards room: page cache the kernel may reclaim (`active_file` and
//!   `inactive_file`; tmpfs pages are not among them) counts as free, and where the machine
//!   has swap there is no check at all (tmpfs pages may then go to swap instead of over the
//!   limit). A refusal means the store cannot fit; a pass can still lose a race with other
//!   allocations in the cgroup, as the free-space check of the directory can;
//! * anything missing, unreadable or malformed means "no limit known" (`None`), never an
//!   error or a panic: the check is a diagnosis, the kernel enforces the limit anyway;
//! * cgroup v2 (`memory.max`, `memory.current`, `memory.stat`) and v1
//!   (`memory.limit_in_bytes`, `memory.usage_in_bytes`, `memory.stat`) are both read; the
//!   directory is found through `/proc/self/cgroup` and `/proc/self/mountinfo`, so that a
//!   cgroup namespace (a container's view) maps to the right one.

use std::path::{Path, PathBuf};

/// The tightest memory limit on this process, and the room left under it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct MemoryRoom {
    /// The cgroup directory whose limit leaves the least room.
    pub cgroup: PathBuf,
    /// Its limit in bytes.
    pub limit: u64,
    /// Bytes that can still be charged to it: the limit less the usage, plus reclaimable
    /// page cache.
    pub available: u64,
}

impl MemoryRoom {
    /// Whether `needed` bytes can still be charged: a store that fills the room exactly
    /// fits.
    pub(crate) fn fits(&self, needed: u64) -> bool {
        needed <= self.available
    }
}

/// Which cgroup interface holds the memory controller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Version {
    V1,
    V2,
}

/// A v1 limit at or above this means "no limit" (the kernel shows `PAGE_COUNTER_MAX`
/// pages, 2^63 bytes less a page).
const V1_UNLIMITED: u64 = 1 << 62;

/// The tightest memory limit on this process when it leaves less room than `needed`
/// bytes; `None` where it leaves enough, no limit applies, the machine has swap, or the
/// cgroup files cannot be read. (Swap is looked up last: `/proc/meminfo` is the slowest
/// file to read, and a store that fits needs no answer.)
pub(crate) fn memory_shortfall(needed: u64) -> Option<MemoryRoom> {
    let (dir, mount, version) = memory_cgroup()?;
    let room = room_from(&dir, &mount, version).filter(|r| !r.fits(needed))?;
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    (swap_total(&meminfo)? == 0).then_some(room)
}

/// This process's memory cgroup: its directory, the mount point of its hierarchy, and the
/// interface.
pub(crate) fn memory_cgroup() -> Option<(PathBuf, PathBuf, Version)> {
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    memory_cgroup_in(&cgroup, &mountinfo)
}

/// `SwapTotal` from `/proc/meminfo`, in bytes.
fn swap_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("SwapTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The memory cgroup named in `cgroup` (the text of `/proc/self/cgroup`), found among the
/// mounts of `mountinfo` (the text of `/proc/self/mountinfo`). A v1 hierarchy with the
/// memory controller wins over the v2 one, which holds it only where no v1 hierarchy does.
pub(crate) fn memory_cgroup_in(
    cgroup: &str,
    mountinfo: &str,
) -> Option<(PathBuf, PathBuf, Version)> {
    let (mut v1, mut v2) = (None, None);
    for line in cgroup.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        if controllers.split(',').any(|c| c == "memory") {
            v1 = Some(path);
        } else if controllers.is_empty() {
            v2 = Some(path);
        }
    }
    let (path, version) = match (v1, v2) {
        (Some(p), _) => (p, Version::V1),
        (None, Some(p)) => (p, Version::V2),
        (None, None) => return None,
    };
    for line in mountinfo.lines() {
        let Some((before, after)) = line.split_once(" - ") else {
            continue;
        };
        let before: Vec<&str> = before.split(' ').collect();
        let after: Vec<&str> = after.split(' ').collect();
        let (Some(root), Some(point), Some(fstype)) = (before.get(3), before.get(4), after.first())
        else {
            continue;
        };
        let ours = match version {
            Version::V1 => {
                *fstype == "cgroup"
                    && after
                        .get(2)
                        .is_some_and(|opts| opts.split(',').any(|o| o == "memory"))
            }
            Version::V2 => *fstype == "cgroup2",
        };
        if !ours {
            continue;
        }
        // The cgroup's path is relative to the hierarchy's root; the mount shows the
        // subtree under `root` (all of it, or a container's part).
        let Ok(rel) = Path::new(path).strip_prefix(unescape(root)) else {
            continue;
        };
        let point = PathBuf::from(unescape(point));
        return Some((point.join(rel), point, version));
    }
    None
}

/// Undoes mountinfo's octal escapes (`\040` for a space, and so on).
fn unescape(field: &str) -> String {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let oct = b
            .get(i + 1..i + 4)
            .filter(|d| b[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match oct {
            Some(d) => {
                out.push(
                    d.iter()
                        .fold(0u8, |n, c| n.wrapping_mul(8).wrapping_add(c - b'0')),
                );
                i += 4;
            }
            None => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The tightest limit from `dir` up to `mount` (both included), and the room under it.
pub(crate) fn room_from(dir: &Path, mount: &Path, version: Version) -> Option<MemoryRoom> {
    let mut tightest: Option<MemoryRoom> = None;
    let mut level = Some(dir);
    while let Some(d) = level.filter(|d| d.starts_with(mount)) {
        if let Some(room) = room_at(d, version) {
            if tightest
                .as_ref()
                .is_none_or(|t| room.available < t.available)
            {
                tightest = Some(room);
            }
        }
        level = d.parent();
    }
    tightest
}

/// The limit of one cgroup directory and its room, if it has a limit.
fn room_at(dir: &Path, version: Version) -> Option<MemoryRoom> {
    let (limit, usage, active, inactive) = match version {
        Version::V1 => (
            "memory.limit_in_bytes",
            "memory.usage_in_bytes",
            "total_active_file",
            "total_inactive_file",
        ),
        Version::V2 => (
            "memory.max",
            "memory.current",
            "active_file",
            "inactive_file",
        ),
    };
    let limit: u64 = read_number(&dir.join(limit))?;
    if version == Version::V1 && limit >= V1_UNLIMITED {
        return None;
    }
    let usage: u64 = read_number(&dir.join(usage))?;
    let stat = std::fs::read_to_string(dir.join("memory.stat")).unwrap_or_default();
    let counter = |key: &str| {
        stat.lines()
            .filter_map(|l| l.split_once(' '))
            .find(|(k, _)| *k == key)
            .and_then(|(_, v)| v.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    let reclaimable = counter(active).saturating_add(counter(inactive));
    Some(MemoryRoom {
        cgroup: dir.to_path_buf(),
        limit,
        available: limit
            .saturating_sub(usage)
            .saturating_add(reclaimable)
            .min(limit),
    })
}

/// A file holding one number (`max`, v2's "no limit", reads as `None`).
fn read_number(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    const MOUNTS_V1: &str = "\
25 1 0:23 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
30 25 0:27 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
31 25 0:28 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
35 25 0:32 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    #[test]
    fn finds_the_v1_memory_hierarchy_over_the_v2_one() {
        let cgroup = "4:memory:/process_api/abc\n1:cpu:/\n0::/\n";
        let (dir, mount, v) = memory_cgroup_in(cgroup, MOUNTS_V1).unwrap();
        assert_eq!(dir, Path::new("/sys/fs/cgroup/memory/process_api/abc"));
        assert_eq!(mount, Path::new("/sys/fs/cgroup/memory"));
        assert_eq!(v, Version::V1);
    }

    #[test]
    fn finds_the_v2_cgroup_through_a_namespaced_mount() {
        // A container: the mount shows the subtree of its cgroup, whose path it names.
        let mounts = "40 30 0:35 /kubepods/pod1/c1 /sys/fs/cgroup ro,nosuid - cgroup2 cgroup rw\n";
        let (dir, mount, v) = memory_cgroup_in("0::/kubepods/pod1/c1/sub\n", mounts).unwrap();
        assert_eq!(dir, Path::new("/sys/fs/cgroup/sub"));
        assert_eq!(mount, Path::new("/sys/fs/cgroup"));
        assert_eq!(v, Version::V2);
        // A cgroup namespace: the process sees itself at the root of the mount.
        let ns = "40 30 0:35 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        let (dir, _, _) = memory_cgroup_in("0::/\n", ns).unwrap();
        assert_eq!(dir, Path::new("/sys/fs/cgroup"));
        // Escaped spaces in the mount point.
        let esc = "40 30 0:35 / /mnt/cg\\040two rw - cgroup2 cgroup2 rw\n";
        let (dir, _, _) = memory_cgroup_in("0::/a\n", esc).unwrap();
        assert_eq!(dir, Path::new("/mnt/cg two/a"));
    }

    #[test]
    fn malformed_or_missing_text_means_no_cgroup() {
        assert_eq!(memory_cgroup_in("", MOUNTS_V1), None);
        assert_eq!(memory_cgroup_in("garbage\n::\n", ""), None);
        assert_eq!(
            memory_cgroup_in("4:memory:/a\n", "no separator here\n1 2\n"),
            None
        );
        // The cgroup is outside what the mount shows.
        let mounts = "40 30 0:35 /other /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        assert_eq!(memory_cgroup_in("0::/mine\n", mounts), None);
        assert_eq!(swap_total("MemTotal: 1 kB\n"), None);
        assert_eq!(swap_total("SwapTotal:  2 kB\n"), Some(2048));
    }

    #[test]
    fn digits_in_a_mount_point_are_not_an_escape() {
        // Only a backslash and three octal digits are an escape: a path with digits of
        // its own, or a backslash before fewer than three, stays as it is.
        let mounts = "40 30 0:35 / /mnt/cg123/v2\\04 rw - cgroup2 cgroup2 rw\n";
        let (dir, mount, _) = memory_cgroup_in("0::/a777\n", mounts).unwrap();
        assert_eq!(mount, Path::new("/mnt/cg123/v2\\04"));
        assert_eq!(dir, Path::new("/mnt/cg123/v2\\04/a777"));
        assert_eq!(unescape("\\134\\011x\\08"), "\\\tx\\08");
    }

    #[test]
    fn a_store_that_fills_the_room_exactly_fits() {
        let room = MemoryRoom {
            cgroup: PathBuf::from("/sys/fs/cgroup/x"),
            limit: 1 << 30,
            available: 256 << 20,
        };
        assert!(room.fits(0));
        assert!(room.fits(256 << 20));
        assert!(!room.fits((256 << 20) + 1));
    }

    /// This process's own cgroup is found where the machine mounts cgroups, and it is the
    /// one the kernel lists this process in. (Skipped where no cgroup file system is
    /// mounted, as in some containers.)
    #[test]
    fn this_process_finds_the_memory_cgroup_it_is_in() {
        let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap();
        if !mountinfo.lines().any(|l| {
            l.contains(" - cgroup2 ") || (l.contains(" - cgroup ") && l.contains("memory"))
        }) {
            eprintln!("skipped: no memory cgroup hierarchy is mounted here");
            return;
        }
        let (dir, mount, _) = memory_cgroup().expect("the memory cgroup of this process");
        assert!(
            dir.starts_with(&mount),
            "{} under {}",
            dir.display(),
            mount.display()
        );
        let procs = fs::read_to_string(dir.join("cgroup.procs")).unwrap();
        let me = std::process::id().to_string();
        assert!(
            procs.lines().any(|p| p == me),
            "pid {me} not in {}/cgroup.procs",
            dir.display()
        );
    }

    fn write(dir: &Path, files: &[(&str, &str)]) {
        fs::create_dir_all(dir).unwrap();
        for (name, text) in files {
            fs::write(dir.join(name), text).unwrap();
        }
    }

    #[test]
    fn the_tightest_level_wins_and_page_cache_counts_as_room() {
        let root = std::env::temp_dir().join(format!("shmstore-cgroup-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let pod = root.join("pod");
        let c = pod.join("c");
        // The root of the mount has no limit files, as on a real v2 hierarchy.
        write(&root, &[("cgroup.procs", "")]);
        write(
            &pod,
            &[
                ("memory.max", "8589934592\n"),
                ("memory.current", "7516192768\n"),
                (
                    "memory.stat",
                    "anon 1\nactive_file 268435456\ninactive_file 268435456\nshmem 9\n",
                ),
            ],
        );
        write(&c, &[("memory.max", "max\n"), ("memory.current", "100\n")]);
        let r = room_from(&c, &root, Version::V2).unwrap();
        assert_eq!(r.cgroup, pod);
        assert_eq!(r.limit, 8 << 30);
        assert_eq!(r.available, (1 << 30) + (512 << 20));
        // A tighter limit lower down wins.
        write(
            &c,
            &[
                ("memory.max", "1073741824\n"),
                ("memory.current", "805306368\n"),
            ],
        );
        let r = room_from(&c, &root, Version::V2).unwrap();
        assert_eq!((r.cgroup.as_path(), r.available), (c.as_path(), 256 << 20));
        // Usage over the limit (possible for a moment) leaves no room, without underflow.
        write(&c, &[("memory.current", "2147483648\n")]);
        assert_eq!(room_from(&c, &root, Version::V2).unwrap().available, 0);
        // Garbage in a file means no limit known at that level, not a panic.
        write(&c, &[("memory.max", "lots\n")]);
        assert_eq!(room_from(&c, &root, Version::V2).unwrap().cgroup, pod);
        write(&pod, &[("memory.max", "max\n")]);
        assert_eq!(room_from(&c, &root, Version::V2), None);
        // v1: the hierarchical counters, and its "unlimited".
        write(
            &c,
            &[
                ("memory.limit_in_bytes", "536870912\n"),
                ("memory.usage_in_bytes", "268435456\n"),
                (
                    "memory.stat",
                    "cache 5\ninactive_file 7\ntotal_inactive_file 1048576\n",
                ),
            ],
        );
        write(
            &pod,
            &[
                ("memory.limit_in_bytes", "9223372036854771712\n"),
                ("memory.usage_in_bytes", "1\n"),
            ],
        );
        let r = room_from(&c, &root, Version::V1).unwrap();
        assert_eq!((r.limit, r.available), (512 << 20, (256 << 20) + (1 << 20)));
        // v1's "unlimited" at every level: no limit at all.
        write(&c, &[("memory.limit_in_bytes", "9223372036854771712\n")]);
        assert_eq!(room_from(&c, &root, Version::V1), None);
        // A 2^62-byte limit is a limit in v2, where "max" says unlimited.
        write(
            &c,
            &[
                ("memory.max", "4611686018427387904\n"),
                ("memory.current", "0\n"),
            ],
        );
        fs::remove_file(pod.join("memory.max")).unwrap();
        assert_eq!(room_from(&c, &root, Version::V2).unwrap().limit, 1 << 62);
        fs::remove_dir_all(&root).unwrap();
    }

    /// The tightest level is the one with the least room, wherever it is: a looser limit
    /// below a tighter one does not hide it, and on a tie the nearest level is named.
    #[test]
    fn the_level_with_least_room_wins_wherever_it_is() {
        let root = std::env::temp_dir().join(format!("shmstore-cgroup-l-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let pod = root.join("pod");
        let c = pod.join("c");
        write(
            &pod,
            &[
                ("memory.max", "1073741824\n"),
                ("memory.current", "805306368\n"),
            ],
        );
        write(
            &c,
            &[("memory.max", "2147483648\n"), ("memory.current", "0\n")],
        );
        let r = room_from(&c, &root, Version::V2).unwrap();
        assert_eq!(
            (r.cgroup.as_path(), r.available),
            (pod.as_path(), 256 << 20)
        );
        write(&c, &[("memory.max", "268435456\n")]);
        let r = room_from(&c, &root, Version::V2).unwrap();
        assert_eq!((r.cgroup.as_path(), r.available), (c.as_path(), 256 << 20));
        fs::remove_dir_all(&root).unwrap();
    }
}
