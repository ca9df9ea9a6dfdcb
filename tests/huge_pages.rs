//! Stores on huge pages. Explicit ones (hugetlb): an anonymous store in a `MFD_HUGETLB`
//! memfd and a named store in a hugetlbfs directory, shared with another process,
//! read-only attach, and the errors when huge pages are missing. Transparent ones: a store
//! in a tmpfs mounted with `huge=within_size`, whose fresh attach maps 2 MiB pages, and
//! `Stats::huge_pages` agreeing with the page tables wherever a store lives.
//!
//! Huge pages must be reserved by the administrator, and a THP tmpfs mounted. Where they
//! are missing, the tests that need them say so on stderr and pass without running;
//! `scripts/hugepages.sh` (run by CI) reserves some, mounts a hugetlbfs and a THP tmpfs,
//! and `SHMSTORE_HUGETLBFS` / `SHMSTORE_THP_DIR` name the directories to use.

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
    if role == "no-descriptors" {
        // Every descriptor number this process may have is taken: memfd_create fails with
        // EMFILE, whatever pages the store asks for.
        let lowest_free =
            std::os::fd::AsRawFd::as_raw_fd(&std::fs::File::open("/dev/null").unwrap());
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit and setrlimit only read and write the struct passed.
        unsafe {
            assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit), 0);
            limit.rlim_cur = lowest_free as libc::rlim_t;
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &limit), 0);
        }
        for huge in [HugePages::Hugetlb, HugePages::Off] {
            let cfg = StoreConfig {
                huge_pages: huge,
                ..huge_cfg(4 << 20)
            };
            match Store::create_anonymous(&cfg) {
                Err(e) => say(format!("{huge:?}: {e:?} | {e}")),
                Ok(_) => say(format!("{huge:?}: created")),
            }
        }
        return;
    }
    let opts = AttachOptions {
        read_only: role == "read-only",
        ..Default::default()
    };
    let store = Store::open_with(Path::new(&args[0]), &opts).unwrap();
    let id: ObjectId = args[1].parse().unwrap();
    let v = store.get(&id, Duration::from_secs(30)).unwrap();
    let hash = blake3::hash(&v).to_hex();
    if role == "thp" {
        // A fresh attach that has just read the object: how much of its mapping of the
        // store is made of 2 MiB entries.
        let pmd = pmd_mapped_kib(Path::new(&args[0]));
        say(format!("{} {} {hash}", store.stats().huge_pages, pmd));
        return;
    }
    say(format!("{} {hash}", store.stats().page_size));
}

/// KiB of the mappings of the file at `path` in this process that the page tables map
/// with 2 MiB entries (`ShmemPmdMapped` in /proc/self/smaps). Mappings are matched by
/// inode: smaps names a file by the name it was created under, and a store is created
/// under a temporary name and then linked to its own.
fn pmd_mapped_kib(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let inode = std::fs::metadata(path).unwrap().ino().to_string();
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut inside = false;
    let mut kib = 0;
    for line in smaps.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        // A mapping's header: "start-end perms offset dev inode [path]".
        let header = f.len() >= 5
            && f[0].contains('-')
            && f[0].chars().all(|c| c.is_ascii_hexdigit() || c == '-');
        if header {
            inside = f[4] == inode;
        } else if inside {
            if let Some(v) = line.strip_prefix("ShmemPmdMapped:") {
                kib += v
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<u64>()
                    .unwrap();
            }
        }
    }
    kib
}

/// A tmpfs mounted with transparent huge pages (`huge=within_size` or `huge=always`):
/// `SHMSTORE_THP_DIR`, else the first such mount; `None` (and why, on stderr) if none.
fn thp_dir(test: &str) -> Option<PathBuf> {
    let dir = std::env::var_os("SHMSTORE_THP_DIR")
        .map(PathBuf::from)
        .or_else(|| {
            let mounts = std::fs::read_to_string("/proc/mounts").ok()?;
            mounts.lines().find_map(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                (f.len() > 3
                    && f[2] == "tmpfs"
                    && f[3]
                        .split(',')
                        .any(|o| o == "huge=within_size" || o == "huge=always"))
                .then(|| PathBuf::from(f[1]))
            })
        });
    if dir.is_none() {
        eprintln!(
            "{test}: skipped: no tmpfs with transparent huge pages is mounted (mount one \
             with `scripts/hugepages.sh`, or `mount -t tmpfs -o huge=within_size none DIR` \
             and set SHMSTORE_THP_DIR=DIR)"
        );
    }
    dir
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

/// A huge-page memfd that cannot be made for want of descriptors is an I/O error that says
/// so, not a claim that the kernel has no huge-page memfds.
#[test]
fn running_out_of_descriptors_is_not_a_missing_kernel_feature() {
    let mut child = spawn(CHILD_ENTRY, "no-descriptors", &[]);
    for want in ["Hugetlb", "Off"] {
        let line = child.recv();
        let (huge, error) = line.split_once(": ").unwrap();
        assert_eq!(huge, want, "{line}");
        assert!(error.starts_with("Io {"), "{line}");
        assert!(error.contains("memfd_create"), "{line}");
        assert!(error.contains("Too many open files"), "{line}");
    }
    child.finish();
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
            // In pages, for the whole store: its heap plus a little metadata.
            assert!(
                needed * HUGE >= capacity && needed * HUGE < capacity + capacity / 8,
                "{e}"
            );
            assert!(e.to_string().contains("nr_hugepages"), "{e}");
        }
        Err(Error::InvalidConfig { reason }) if reason.contains("MFD_HUGETLB") => {
            eprintln!("skipped: {reason}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_store_in_a_thp_tmpfs_maps_2_mib_pages_in_a_fresh_process() {
    const T: &str = "a_store_in_a_thp_tmpfs_maps_2_mib_pages_in_a_fresh_process";
    let Some(dir) = thp_dir(T) else {
        return;
    };
    // Nothing to reserve: the default config, placed in the THP tmpfs.
    let cfg = StoreConfig {
        dir,
        ..StoreConfig::with_capacity(64 << 20)
    };
    let name = format!("shmstore-test-thp-{}", std::process::id());
    let store = Store::create(&name, &cfg).unwrap();
    let path = store.path().unwrap().to_path_buf();
    let _cleanup = Cleanup(path.clone());
    let st = store.stats();
    assert!(
        st.huge_pages,
        "a store in a huge=within_size tmpfs reports normal pages"
    );
    assert_eq!(st.page_size, HUGE);
    let data = bytes(5, 16 << 20);
    let id = ObjectId::of_content(&data);
    store.put(&id, &data).unwrap();
    let shown = path.display().to_string();
    let mut p = spawn(CHILD_ENTRY, "thp", &[shown, id.to_string()]);
    let reply = p.recv();
    p.finish();
    let f: Vec<&str> = reply.split(' ').collect();
    assert_eq!(
        f[0], "true",
        "the attaching process reports normal pages: {reply}"
    );
    assert_eq!(f[2], blake3::hash(&data).to_hex().as_str());
    // Reading 16 MiB touched at least 14 MiB of whole, aligned 2 MiB pages: the fresh
    // process must map them with 2 MiB entries (one fault each), not 4 KiB ones.
    let pmd: u64 = f[1].parse().unwrap();
    assert!(
        pmd >= 14 << 10,
        "the fresh attach maps only {pmd} KiB with 2 MiB entries"
    );
}

#[test]
fn stats_huge_pages_agrees_with_the_page_tables_in_dev_shm() {
    // Whatever /dev/shm's mount options and kernel are on this machine, the report must
    // match what the kernel really maps (on a default /dev/shm: the 2 MiB pages the
    // creator rebuilt where the kernel lets it, Linux 6.1+, and `true`; else 4 KiB pages
    // and `false`).
    let cfg = StoreConfig {
        huge_pages: HugePages::Try,
        ..StoreConfig::with_capacity(32 << 20)
    };
    let name = format!("shmstore-test-thp-report-{}", std::process::id());
    let store = Store::create(&name, &cfg).unwrap();
    let path = store.path().unwrap().to_path_buf();
    let _cleanup = Cleanup(path.clone());
    store.prefault();
    let pmd = pmd_mapped_kib(&path);
    let file_kib = std::fs::metadata(&path).unwrap().len() >> 10;
    assert!(pmd <= file_kib, "{pmd} KiB mapped of a {file_kib} KiB file");
    let st = store.stats();
    assert_eq!(
        st.huge_pages,
        pmd > 0,
        "stats say huge_pages = {}, the page tables map {pmd} KiB with 2 MiB entries",
        st.huge_pages
    );
    // 2 MiB is the page size once the whole heap is on 2 MiB pages; a kernel that could
    // rebuild only part of it (memory without free 2 MiB blocks) reports 4 KiB.
    let whole = st.huge_page_bytes >= st.capacity / HUGE * HUGE;
    let expected = if st.huge_pages && (st.huge_page_bytes == 0 || whole) {
        HUGE
    } else {
        4096
    };
    assert_eq!(st.page_size, expected, "{st:?}");
}

/// Why this kernel cannot rebuild tmpfs pages as 2 MiB pages (`MADV_COLLAPSE` on shmem:
/// Linux 6.1 and later, unless `shmem_enabled` is `deny`), or `None` if it can.
fn cannot_rebuild_shmem_pages() -> Option<String> {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut v = release
        .trim()
        .split(|c: char| !c.is_ascii_digit())
        .map(|n| n.parse::<u32>().unwrap_or(0));
    if (v.next().unwrap_or(0), v.next().unwrap_or(0)) < (6, 1) {
        return Some(format!("kernel {} is older than 6.1", release.trim()));
    }
    let policy = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
        .unwrap_or_default();
    policy
        .contains("[deny]")
        .then(|| "shmem_enabled is deny".to_string())
}

#[test]
fn a_default_store_in_dev_shm_gets_2_mib_pages_that_a_fresh_process_maps_so() {
    const T: &str = "a_default_store_in_dev_shm_gets_2_mib_pages_that_a_fresh_process_maps_so";
    let name = format!("shmstore-test-rebuilt-{}", std::process::id());
    let store = Store::create(&name, &StoreConfig::with_capacity(64 << 20)).unwrap();
    let path = store.path().unwrap().to_path_buf();
    let _cleanup = Cleanup(path.clone());
    let data = bytes(6, 16 << 20);
    let id = ObjectId::of_content(&data);
    store.put(&id, &data).unwrap();
    store.prefault(); // the creator's rebuild, finished now
    let st = store.stats();
    let shown = path.display().to_string();
    let mut p = spawn(CHILD_ENTRY, "thp", &[shown, id.to_string()]);
    let reply = p.recv();
    p.finish();
    let f: Vec<&str> = reply.split(' ').collect();
    assert_eq!(f[2], blake3::hash(&data).to_hex().as_str(), "{reply}");
    if let Some(why) = cannot_rebuild_shmem_pages() {
        eprintln!("{T}: skipped the 2 MiB checks: {why}");
        return;
    }
    assert_eq!(
        (st.huge_page_bytes, st.page_size),
        (64 << 20, HUGE),
        "{st:?}"
    );
    assert_eq!(
        f[0], "true",
        "the attaching process reports normal pages: {reply}"
    );
    let pmd: u64 = f[1].parse().unwrap();
    assert!(
        pmd >= 16 << 10,
        "the fresh attach maps only {pmd} KiB of the 16 MiB it read with 2 MiB entries"
    );
}
