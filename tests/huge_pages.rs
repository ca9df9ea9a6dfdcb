//! Stores on explicit huge pages (hugetlb): an anonymous store in a `MFD_HUGETLB` memfd and
//! a named store in a hugetlbfs directory, shared with another process, read-only attach,
//! and the errors when huge pages are missing.
//!
//! Huge pages must be reserved by the administrator. Where none are free (or no hugetlbfs
//! is mounted), the tests that need them say so on stderr and pass without running;
//! `scripts/hugepages.sh` (run by CI) reserves some and mounts a hugetlbfs for them, and
//! `SHMSTORE_HUGETLBFS` names the directory to use.

mod common;

use common::{bytes, child_role, say, spawn, Cleanup, CHILD_ENTRY};
use shmstore::{AttachOptions, Error, HugePages, ObjectId, Store, StoreConfig};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

const HUGE: u64 = 2 << 20;

/// The tests share the machine's few huge pages (64 from `scripts/hugepages.sh`) and run
/// on parallel threads: one that takes most of them on purpose made another fail its
/// reservation. Each test holds this lock while it uses huge pages.
static POOL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn pool() -> std::sync::MutexGuard<'static, ()> {
    POOL.lock().unwrap_or_else(|e| e.into_inner())
}

/// (free huge pages, their size).
fn free_huge_pages() -> (u64, u64) {
    HugePages::free_pages().unwrap_or((0, 0))
}

/// (reserved huge pages, free ones, their size): the reserved count from sysfs.
fn huge_pages() -> (u64, u64, u64) {
    let (free, size) = free_huge_pages();
    let total = std::fs::read_to_string(format!(
        "/sys/kernel/mm/hugepages/hugepages-{}kB/nr_hugepages",
        size >> 10
    ))
    .ok()
    .and_then(|s| s.trim().parse().ok())
    .unwrap_or(0);
    (total, free, size)
}

/// Whether `pages` huge pages of 2 MiB are free; if not, says why the test is skipped.
fn have_huge_pages(pages: u64, test: &str) -> bool {
    let (free, size) = free_huge_pages();
    if size != HUGE || free < pages {
        eprintln!(
            "{test}: skipped: needs {pages} free 2 MiB huge pages, the kernel has {free} of \
             {} KiB (reserve some with `scripts/hugepages.sh` or `sysctl -w vm.nr_hugepages=64`)",
            size >> 10
        );
        return false;
    }
    true
}

/// A writable hugetlbfs directory: `SHMSTORE_HUGETLBFS`, else the first hugetlbfs mount
/// in /proc/mounts.
fn hugetlbfs_dir(test: &str) -> Option<PathBuf> {
    let dir = std::env::var_os("SHMSTORE_HUGETLBFS")
        .map(PathBuf::from)
        .or_else(|| {
            std::fs::read_to_string("/proc/mounts")
                .ok()?
                .lines()
                .map(|l| l.split_whitespace().collect::<Vec<_>>())
                .find(|f| f.len() > 3 && f[2] == "hugetlbfs" && f[3].contains("pagesize=2M"))
                .map(|f| PathBuf::from(f[1]))
        });
    if dir.is_none() {
        eprintln!(
            "{test}: skipped: no 2 MiB hugetlbfs is mounted (mount one with \
             `scripts/hugepages.sh`, or set SHMSTORE_HUGETLBFS to one)"
        );
    }
    dir
}

fn huge_cfg(capacity: u64) -> StoreConfig {
    StoreConfig {
        huge_pages: HugePages::Hugetlb,
        // Keep the table small: every page of the store is a reserved huge page.
        max_objects: 256,
        max_clients: 4,
        ..StoreConfig::with_capacity(capacity)
    }
}

/// Child processes: dispatched on `SHMSTORE_CHILD`.
#[test]
#[ignore = "child process entry point, started by the other tests"]
fn child_entry() {
    let (role, args) = child_role().expect("child_entry runs only as a child process");
    let opts = AttachOptions {
        read_only: role == "read-only",
        ..Default::default()
    };
    let store = Store::open_with(Path::new(&args[0]), &opts).unwrap();
    let id: ObjectId = args[1].parse().unwrap();
    let v = store.get(&id, Duration::from_secs(30)).unwrap();
    say(format!(
        "{} {}",
        store.stats().page_size,
        blake3::hash(&v).to_hex()
    ));
}

fn share_with_child(store: &Store, path: &str, role: &str, seed: u64) {
    let data = bytes(seed, (5 << 20) + 3);
    let id = ObjectId::of_content(&data);
    store.put(&id, &data).unwrap();
    let mut p = spawn(CHILD_ENTRY, role, &[path.to_string(), id.to_string()]);
    assert_eq!(p.recv(), format!("{HUGE} {id}"));
    p.finish();
}

#[test]
fn an_anonymous_store_on_huge_pages_works_across_processes() {
    let _pool = pool();
    const T: &str = "an_anonymous_store_on_huge_pages_works_across_processes";
    if !have_huge_pages(16, T) {
        return;
    }
    let store = Store::create_anonymous(&huge_cfg(16 << 20)).unwrap();
    assert_eq!(store.stats().page_size, HUGE);
    let path = format!("/proc/{}/fd/{}", std::process::id(), store.fd().as_raw_fd());
    share_with_child(&store, &path, "read-write", 1);
    share_with_child(&store, &path, "read-only", 2);
    store.check_invariants().unwrap();
}

#[test]
fn a_named_store_in_a_hugetlbfs_directory_works_across_processes() {
    let _pool = pool();
    const T: &str = "a_named_store_in_a_hugetlbfs_directory_works_across_processes";
    let Some(dir) = hugetlbfs_dir(T) else {
        return;
    };
    if !have_huge_pages(16, T) {
        return;
    }
    let cfg = StoreConfig {
        dir: dir.clone(),
        ..huge_cfg(16 << 20)
    };
    let name = format!("shmstore-test-huge-{}", std::process::id());
    let store = Store::create(&name, &cfg).unwrap();
    let path = store.path().unwrap().to_path_buf();
    let _cleanup = Cleanup(path.clone());
    assert_eq!(store.stats().page_size, HUGE);
    let shown = path.display().to_string();
    share_with_child(&store, &shown, "read-write", 3);
    share_with_child(&store, &shown, "read-only", 4);
    // Without asking for huge pages, a store in hugetlbfs still gets them.
    let plain = StoreConfig {
        dir,
        huge_pages: HugePages::Off,
        ..huge_cfg(4 << 20)
    };
    let other = Store::create(&format!("{name}-plain"), &plain).unwrap();
    let _cleanup2 = Cleanup(other.path().unwrap().to_path_buf());
    assert_eq!(other.stats().page_size, HUGE);
}

#[test]
fn hugetlb_outside_a_hugetlbfs_directory_is_a_config_error() {
    let _pool = pool();
    let cfg = StoreConfig {
        dir: std::env::temp_dir(),
        ..huge_cfg(4 << 20)
    };
    let name = format!("shmstore-test-not-huge-{}", std::process::id());
    match Store::create(&name, &cfg) {
        Err(e @ Error::InvalidConfig { .. }) => {
            assert!(e.to_string().contains("hugetlbfs"), "{e}");
        }
        other => panic!("{other:?}"),
    }
    assert!(!std::env::temp_dir().join(&name).exists());
}

#[test]
fn too_few_free_huge_pages_fail_at_creation_with_the_numbers() {
    let _pool = pool();
    let (total, free, size) = huge_pages();
    if size != HUGE {
        eprintln!("skipped: the default huge page size is {size} B, not 2 MiB");
        return;
    }
    // More pages than exist (other tests may free theirs meanwhile): creation must fail
    // now, not SIGBUS on a later touch.
    let capacity = (total + 8) * HUGE;
    match Store::create_anonymous(&huge_cfg(capacity)) {
        Err(e @ Error::HugePagesUnavailable { .. }) => {
            let Error::HugePagesUnavailable {
                page_size, needed, ..
            } = e
            else {
                unreachable!()
            };
            assert_eq!(page_size, HUGE);
            assert!(needed > free, "{e}");
            assert!(e.to_string().contains("nr_hugepages"), "{e}");
        }
        Err(Error::InvalidConfig { reason }) if reason.contains("MFD_HUGETLB") => {
            eprintln!("skipped: {reason}");
        }
        other => panic!("{other:?}"),
    }
}
