//! The region's unit tests: what the kernel says about the files and mappings it makes
//! (/proc/self/maps, pagemap, smaps, seals, statfs), and the pure parts fed by hand.

use super::creation::{creation_name, is_creation_name};
use super::pages::{huge_option_in, shmem_enabled, thp_policy_gives_huge, tmpfs_huge_option};
use super::*;
use crate::layout::Params;

#[test]
fn creation_names_are_recognised_and_nothing_else_is() {
    let n = creation_name("mm-cache.v2", 1234, 1_796_436_389_842_196_940);
    assert_eq!(n, ".mm-cache.v2.1234.1796436389842196940.shmstore-creating");
    assert!(is_creation_name(&n));
    for other in [
        "mm-cache",
        ".mm-cache.1234.56.tmp",
        "..1234.56.shmstore-creating",
        ".x.12a.56.shmstore-creating",
        ".x.12..shmstore-creating",
        ".1234.56.shmstore-creating",
        ".shmstore-creating",
    ] {
        assert!(!is_creation_name(other), "{other}");
    }
}

#[test]
fn a_creator_starts_over_when_a_sweep_took_its_new_file() {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = Path::new("/dev/shm").join(format!("shmstore-sweep-race-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let _removed = crate::testing::RemovedAtEnd(dir.clone());
    let tmp = dir.join(creation_name("race", std::process::id(), 1));
    let new_file = || {
        OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .unwrap()
    };
    // The sweep found the file first, removed it and let go before the creator
    // locked it: the creator's lock succeeds, on a file that can never be published.
    let file = new_file();
    let creating = LockFile::open(&file, Some(&tmp)).unwrap();
    assert_eq!(sweep_abandoned_creations(&dir), 1);
    assert!(!locked_and_linked(&file, &creating));
    // The sweep still holds the file's lock: the creator's fails.
    let file = new_file();
    let creating = LockFile::open(&file, Some(&tmp)).unwrap();
    let sweeper = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&tmp)
        .unwrap();
    assert!(crate::liveness::try_lock_whole_file(&sweeper));
    assert!(!locked_and_linked(&file, &creating));
    drop(sweeper);
    // Nobody interfered: the creator has its file, and sweeps leave it alone.
    assert!(locked_and_linked(&file, &creating));
    assert_eq!(sweep_abandoned_creations(&dir), 0);
    assert!(tmp.exists());
}

/// A sweep removes only regular files named like an abandoned creation: not a symbolic
/// link with such a name (nor the file it leads to), nor a directory.
#[test]
fn a_sweep_follows_no_link_and_removes_no_directory() {
    let dir = Path::new("/dev/shm").join(format!("shmstore-sweep-link-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let _removed = crate::testing::RemovedAtEnd(dir.clone());
    let target = dir.join("precious");
    std::fs::write(&target, b"data").unwrap();
    let link = dir.join(creation_name("link", std::process::id(), 1));
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let subdir = dir.join(creation_name("dir", std::process::id(), 2));
    std::fs::create_dir(&subdir).unwrap();
    assert_eq!(sweep_abandoned_creations(&dir), 0);
    assert!(link.symlink_metadata().is_ok() && subdir.is_dir());
    assert_eq!(std::fs::read(&target).unwrap(), b"data");
    // An abandoned regular file beside them goes.
    let abandoned = dir.join(creation_name("gone", std::process::id(), 3));
    std::fs::write(&abandoned, b"").unwrap();
    assert_eq!(sweep_abandoned_creations(&dir), 1);
    assert!(!abandoned.exists() && link.symlink_metadata().is_ok());
}

#[test]
fn a_new_name_is_locked_until_its_creator_lets_go() {
    // `remove_if_unused` must not take a store whose creator has published its name
    // but not attached yet: the name appears with byte 0 locked.
    let sb = small_superblock(1 << 20);
    let dir = Path::new("/dev/shm");
    let name = format!("shmstore-region-lock-{}", std::process::id());
    let (m, creating) =
        Mapping::create_named(dir, &name, &sb, 0o600, HugePages::Off, false, false).unwrap();
    let path = dir.join(&name);
    let _removed = crate::testing::RemovedAtEnd(path.clone());
    assert!(!crate::Store::remove_if_unused(&path).unwrap());
    drop(creating);
    assert!(crate::Store::remove_if_unused(&path).unwrap());
    assert!(!path.exists());
    drop(m);
}

/// `HugePages::free_pages` is the kernel's own figures: the free huge pages and the
/// default huge page size in bytes, as /proc/meminfo gives them (where it does).
#[test]
fn free_huge_pages_are_the_kernels_figures() {
    let info = std::fs::read_to_string("/proc/meminfo").unwrap();
    let field = |name: &str| {
        let line = info.lines().find_map(|l| l.strip_prefix(name))?;
        Some(
            line.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .unwrap(),
        )
    };
    let want = field("HugePages_Free:").zip(field("Hugepagesize:").map(|kib| kib << 10));
    assert_eq!(HugePages::free_pages(), want);
    if let Some((_, size)) = want {
        assert!(size.is_power_of_two() && size >= 2 << 20, "{size}");
    }
}

/// A mounted hugetlbfs of 2 MiB pages (scripts/hugepages.sh mounts one), or `None`
/// with a line saying what `test` skips.
fn hugetlbfs_mount(test: &str) -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    let found = mounts.lines().find_map(|line| {
        let f: Vec<&str> = line.split(' ').collect();
        (f.len() > 3 && f[2] == "hugetlbfs" && f[3].contains("pagesize=2M"))
            .then(|| PathBuf::from(f[1]))
    });
    if found.is_none() {
        eprintln!("{test}: hugetlbfs part skipped: none mounted (scripts/hugepages.sh)");
    }
    found
}

#[test]
fn the_file_system_of_a_store_is_told_apart() {
    let dir = Path::new("/dev/shm");
    let path = dir.join(format!("shmstore-region-fs-{}", std::process::id()));
    let _removed = crate::testing::RemovedAtEnd(path.clone());
    let file = File::create(&path).unwrap();
    assert_eq!(fs_of(&file), Some((false, PAGE)));
    assert!(!is_hugetlbfs(dir));
    assert!(!is_hugetlbfs(Path::new("/no/such/dir")));
    let Some(mount) = hugetlbfs_mount("the_file_system_of_a_store_is_told_apart") else {
        return;
    };
    let path = mount.join(format!("shmstore-region-fs-{}", std::process::id()));
    let _removed = crate::testing::RemovedAtEnd(path.clone());
    let file = File::create(&path).unwrap();
    assert_eq!(fs_of(&file), Some((true, 2 << 20)));
    assert!(is_hugetlbfs(&mount));
}

/// A reservation of more than one 256 MiB step ends exactly at the store's last page,
/// named or anonymous, and the store can be opened again whole.
#[test]
fn a_store_is_reserved_to_its_last_page_and_no_further() {
    let sb = small_superblock(300 << 20);
    let want = sb.total_size.div_ceil(PAGE) * PAGE;
    assert!(want > 256 << 20 && want % (256 << 20) != 0, "{want}");
    let m = Mapping::create_memfd(&sb, HugePages::Off, false, false).unwrap();
    assert_eq!(m.file().metadata().unwrap().len(), want);
    assert_eq!(m.len() as u64, want);
    let dir = Path::new("/dev/shm");
    let name = format!("shmstore-region-reserve-{}", std::process::id());
    let path = dir.join(&name);
    let _removed = crate::testing::RemovedAtEnd(path.clone());
    let (m, creating) =
        Mapping::create_named(dir, &name, &sb, 0o600, HugePages::Off, false, false).unwrap();
    drop(creating);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), want);
    let (again, sb_again) = Mapping::open(&path, HugePages::Off, false).unwrap();
    assert_eq!(sb_again, sb);
    assert_eq!(again.len(), m.len());
}

/// The permissions `/proc/self/maps` gives the mapping that holds `addr`.
fn perms_at(addr: usize) -> String {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .find_map(|line| {
            let (range, rest) = line.split_once(' ')?;
            let (lo, hi) = range.split_once('-')?;
            let lo = usize::from_str_radix(lo, 16).ok()?;
            let hi = usize::from_str_radix(hi, 16).ok()?;
            (lo <= addr && addr < hi).then(|| rest[..4].to_string())
        })
        .unwrap_or_else(|| panic!("{addr:#x} is not mapped"))
}

/// The store starts on a 2 MiB boundary, and the address space memmap2 reserved
/// around it (before it when the boundary is not memmap2's start, after it always)
/// faults on any access.
#[test]
fn the_slack_around_a_mapping_is_inaccessible() {
    let sb = small_superblock(1 << 20);
    let mut before = 0;
    // Each store is its own mmap; keep them so that the kernel places the next
    // elsewhere, and look at several: one at least starts past memmap2's start.
    let stores: Vec<Mapping> = (0..8)
        .map(|_| Mapping::create_memfd(&sb, HugePages::Off, false, false).unwrap())
        .collect();
    for m in &stores {
        let base = m.base() as usize;
        let start = m.map.as_mut_ptr() as usize;
        assert_eq!(base % HUGE_PAGE as usize, 0);
        assert_eq!(base - start, m.offset);
        assert!(m.offset < HUGE_PAGE as usize);
        assert_eq!(perms_at(base), "rw-s");
        assert_eq!(perms_at(base + m.len() - 1), "rw-s");
        assert_eq!(perms_at(base + m.len()), "---s");
        assert_eq!(perms_at(start + m.map.len() - 1), "---s");
        if m.offset > 0 {
            before += 1;
            assert_eq!(perms_at(start), "---s");
            assert_eq!(perms_at(base - 1), "---s");
        }
    }
    assert!(before > 0, "no store was placed past memmap2's start");
}

#[test]
fn a_long_reservation_says_how_far_it_is_once_a_second() {
    let path = Path::new("/dev/shm/big");
    let s = std::time::Duration::from_secs_f64;
    let mut lines = ProgressLines::new(path, 4 << 30);
    // Nothing in the first second, or when it ends within one.
    assert_eq!(lines.after(1 << 30, s(0.9)), None);
    assert_eq!(lines.done(s(0.95)), None);
    assert_eq!(
        lines.after(2 << 30, s(1.2)).as_deref(),
        Some("shmstore: reserving 4.0 GiB for /dev/shm/big: 2.0 GiB done after 1.2 s")
    );
    // One line a second at most.
    assert_eq!(lines.after(3 << 30, s(1.9)), None);
    assert!(lines.after(3 << 30, s(2.0)).is_some());
    assert_eq!(lines.after(3 << 30, s(2.5)), None);
    // Not for the last step: the closing line says it.
    assert_eq!(lines.after(4 << 30, s(3.1)), None);
    assert_eq!(
        lines.done(s(3.1)).as_deref(),
        Some("shmstore: reserved 4.0 GiB for /dev/shm/big in 3.1 s")
    );
}

/// The kernel's policy for memfds is the bracketed word of its sysfs file.
#[test]
fn the_shmem_policy_is_read_from_sysfs() {
    let file = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";
    let Ok(text) = std::fs::read_to_string(file) else {
        assert_eq!(shmem_enabled(), None);
        return;
    };
    let policy = shmem_enabled().unwrap_or_else(|| panic!("{file}: {text}"));
    assert!(
        ["always", "within_size", "advise", "never", "deny", "force"].contains(&policy.as_str()),
        "{policy}"
    );
    assert!(text.contains(&format!("[{policy}]")), "{text}");
}

#[test]
fn the_kernels_policy_and_the_mounts_option_decide_transparent_huge_pages() {
    /// (`shmem_enabled`, the mount's `huge=` option, huge pages or not).
    type Case = (Option<&'static str>, Option<Option<&'static str>>, bool);
    let cases: &[Case] = &[
        // A memfd follows the global policy.
        (Some("always"), None, true),
        (Some("within_size"), None, true),
        (Some("advise"), None, false),
        (Some("never"), None, false),
        (None, None, false),
        // A tmpfs mount has its own option, `never` without one.
        (Some("never"), Some(Some("within_size")), true),
        (Some("never"), Some(Some("always")), true),
        (Some("always"), Some(None), false),
        (Some("always"), Some(Some("advise")), false),
        (Some("always"), Some(Some("never")), false),
        // `deny` and `force` override every mount.
        (Some("deny"), Some(Some("always")), false),
        (Some("deny"), None, false),
        (Some("force"), Some(None), true),
        (Some("force"), Some(Some("never")), true),
        (Some("force"), None, true),
    ];
    for &(global, mount, want) in cases {
        assert_eq!(
            thp_policy_gives_huge(global, mount),
            want,
            "{global:?} {mount:?}"
        );
    }
}

/// A small store's superblock, checksummed as `open` wants it.
fn small_superblock(heap_size: u64) -> Superblock {
    let mut sb = Params {
        heap_size,
        table_slots: 64,
        max_clients: 4,
    }
    .layout()
    .unwrap();
    sb.checksum = sb.compute_checksum();
    sb
}

/// Whether this process's page tables map the page at `addr` (/proc/self/pagemap's
/// "present" bit, which it gives every process).
fn mapped_in(addr: usize) -> bool {
    let pagemap = File::open("/proc/self/pagemap").unwrap();
    let mut entry = [0u8; 8];
    pagemap
        .read_exact_at(&mut entry, (addr / PAGE as usize * 8) as u64)
        .unwrap();
    u64::from_le_bytes(entry) >> 63 == 1
}

#[test]
fn populating_maps_the_pages_of_its_range_and_no_others() {
    let m =
        Mapping::create_memfd(&small_superblock(1 << 20), HugePages::Off, false, false).unwrap();
    let page = PAGE as usize;
    let at = |n: usize| m.base() as usize + n * page;
    assert!((1..m.len() / page).all(|n| !mapped_in(at(n))));
    // From inside page 5 to inside page 8: pages 5 to 8, whole.
    m.populate(5 * page + 100, 3 * page, true);
    let mapped: Vec<usize> = (1..m.len() / page).filter(|&n| mapped_in(at(n))).collect();
    assert_eq!(mapped, [5, 6, 7, 8]);
    // Past the end: clamped to the mapping.
    let last = m.len() / page - 1;
    m.populate(last * page, 64 * page, true);
    assert!(mapped_in(at(last)) && !mapped_in(at(last - 1)));
    m.populate(m.len(), page, true);
    m.populate(usize::MAX - 10, 100, true);
    // For reading (the kernel may map neighbours already in memory with it).
    m.populate(100 * page, 1, false);
    assert!(mapped_in(at(100)));
}

#[test]
fn an_anonymous_store_can_neither_shrink_nor_grow() {
    use rustix::fs::SealFlags;
    let m =
        Mapping::create_memfd(&small_superblock(1 << 20), HugePages::Off, false, false).unwrap();
    let seals = rustix::fs::fcntl_get_seals(m.file()).unwrap();
    assert!(seals.contains(SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL));
    let len = m.len() as u64;
    for wrong in [len / 2, len * 2] {
        let e = m.file().set_len(wrong).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{wrong}: {e}");
    }
    assert_eq!(m.file().metadata().unwrap().len(), len);
}

#[test]
fn only_whole_pages_inside_the_mapping_are_made_read_only() {
    let m =
        Mapping::create_memfd(&small_superblock(1 << 20), HugePages::Off, false, false).unwrap();
    let len = m.len() as u64;
    for (offset, n) in [(100, PAGE), (PAGE, len), (len, 1), (PAGE, u64::MAX)] {
        assert!(
            matches!(m.protect_read_only(offset, n), Err(Error::Corrupted { .. })),
            "{offset}+{n}"
        );
    }
    assert_eq!(perms_at(m.base() as usize + PAGE as usize), "rw-s");
    m.protect_read_only(PAGE, len - PAGE).unwrap();
    assert_eq!(perms_at(m.base() as usize), "rw-s");
    assert_eq!(perms_at(m.base() as usize + PAGE as usize), "r--s");
    assert_eq!(perms_at(m.base() as usize + m.len() - 1), "r--s");
}

#[test]
fn prefaulting_maps_the_whole_store() {
    let sb = small_superblock(1 << 20);
    let m = Mapping::create_memfd(&sb, HugePages::Off, true, false).unwrap();
    let page = PAGE as usize;
    assert!((0..m.len() / page).all(|n| mapped_in(m.base() as usize + n * page)));
    let m = Mapping::create_memfd(&sb, HugePages::Off, false, false).unwrap();
    assert!(!mapped_in(m.base() as usize + m.len() / 2));
}

/// The `VmFlags` /proc/self/smaps gives the mapping that holds `addr`.
fn vm_flags_at(addr: usize) -> String {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut inside = false;
    for line in smaps.lines() {
        if let Some((lo, hi)) = line.split(' ').next().and_then(|r| r.split_once('-')) {
            if let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
            {
                inside = lo <= addr && addr < hi;
                continue;
            }
        }
        if inside {
            if let Some(flags) = line.strip_prefix("VmFlags:") {
                return flags.trim().to_string();
            }
        }
    }
    panic!("{addr:#x} is not mapped")
}

#[test]
fn try_advises_huge_pages_and_nothing_else_does() {
    let sb = small_superblock(1 << 20);
    for huge in [HugePages::Auto, HugePages::Off, HugePages::Try] {
        let m = Mapping::create_memfd(&sb, huge, false, false).unwrap();
        let flags = vm_flags_at(m.base() as usize);
        assert_eq!(
            flags.split(' ').any(|f| f == "hg"),
            huge == HugePages::Try,
            "{huge:?}: {flags}"
        );
    }
}

#[test]
fn only_a_tmpfs_store_on_small_pages_can_be_collapsed() {
    let sb = small_superblock(4 << 20);
    let m = Mapping::create_memfd(&sb, HugePages::Off, false, false).unwrap();
    assert_eq!(m.can_collapse(), !m.huge_pages());
    let test = "only_a_tmpfs_store_on_small_pages_can_be_collapsed";
    let name = format!("shmstore-region-collapse-{}", std::process::id());
    let thp = Path::new("/tmp/shmstore-thp");
    // The tmpfs with transparent huge pages that scripts/hugepages.sh mounts.
    let thp_mounted = rustix::fs::stat(thp).is_ok_and(|st| {
        tmpfs_huge_option(rustix::fs::major(st.st_dev), rustix::fs::minor(st.st_dev))
            == Some(Some("within_size".into()))
    });
    if thp_mounted {
        let _removed = crate::testing::RemovedAtEnd(thp.join(&name));
        let (m, _creating) =
            Mapping::create_named(thp, &name, &sb, 0o600, HugePages::Off, false, false).unwrap();
        assert!(m.huge_pages() && !m.can_collapse());
    } else {
        eprintln!(
            "{test}: THP tmpfs part skipped: none at {} (scripts/hugepages.sh)",
            thp.display()
        );
    }
    if let Some(mount) = hugetlbfs_mount(test) {
        if free_huge_pages().is_some_and(|(free, _)| free >= 4) {
            let _removed = crate::testing::RemovedAtEnd(mount.join(&name));
            let (m, _creating) =
                Mapping::create_named(&mount, &name, &sb, 0o600, HugePages::Off, false, false)
                    .unwrap();
            assert!(!m.can_collapse());
        } else {
            eprintln!("{test}: hugetlbfs part skipped: fewer than 4 huge pages free");
        }
    }
}

#[test]
fn the_huge_option_of_a_tmpfs_is_read_from_mountinfo() {
    // Two tmpfs stacked on /dev/shm (the top one remounted with huge pages), a mount
    // with optional fields before the separator, and a hugetlbfs.
    let info = "\
25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=24683664k
30 25 0:27 / /dev/shm rw,relatime shared:7 master:1 - tmpfs tmpfs rw,size=1k,huge=within_size
45 27 0:40 / /tmp/h rw,relatime - hugetlbfs none rw,pagesize=2M
46 27 0:41 / /tmp/t rw,relatime - tmpfs none rw,huge=always,size=1048576k
";
    let opt = |dev| huge_option_in(info, dev);
    assert_eq!(opt("0:23"), Some(None), "a tmpfs without the option");
    assert_eq!(opt("0:27"), Some(Some("within_size".into())));
    assert_eq!(opt("0:41"), Some(Some("always".into())));
    assert_eq!(opt("0:40"), None, "not a tmpfs");
    assert_eq!(opt("0:2"), None, "not listed (a memfd's internal mount)");
    assert_eq!(huge_option_in("garbage\n\n1 2", "0:23"), None);
}
