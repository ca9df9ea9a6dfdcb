//! What pages back a store's file: the [`HugePages`] choice, and what the kernel really
//! gives. hugetlbfs is told by `statfs`; transparent huge pages on tmpfs by the kernel's
//! policy for its internal mount (`shmem_enabled`) and the `huge=` option of the file's
//! mount; lengths are mapped and reserved in whole pages of the file system's size. It
//! only reads (`statfs`, /proc/meminfo, /proc/self/mountinfo, sysfs) and changes nothing.

use crate::layout::PAGE;
use std::fs::File;
use std::path::Path;

/// Huge pages for the store's memory: one page-table entry per 2 MiB instead of per
/// 4 KiB (a 100 GiB store costs each attached process ~200 MiB of page tables with 4 KiB
/// pages, ~0.4 MiB with 2 MiB pages; docs/design.md, "Prefaulting and page tables").
///
/// ```
/// let cfg = shmstore::StoreConfig { huge_pages: shmstore::HugePages::Off, ..Default::default() };
/// assert_eq!(shmstore::StoreConfig::default().huge_pages, shmstore::HugePages::Auto);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum HugePages {
    /// 2 MiB pages wherever the kernel lets an unprivileged process have them, with no
    /// setup: on a default tmpfs such as /dev/shm (or a memfd), the creator's background
    /// population ([`crate::StoreConfig::populate_in_background`], or
    /// [`crate::Store::prefault`]) asks the kernel to rebuild each 2 MiB of the heap as
    /// one 2 MiB page (`MADV_COLLAPSE`, Linux 6.1 and later; allowed under every
    /// `shmem_enabled` policy but `deny`), and every process maps the store on a 2 MiB
    /// boundary, so it maps such a page with one page-table entry at its first touch
    /// instead of 512. Where the kernel cannot (older, `deny`, no free 2 MiB block of
    /// memory), pages stay 4 KiB and everything works the same; otherwise as `Off`.
    /// [`crate::Stats::huge_page_bytes`] says how much of the heap is on 2 MiB pages.
    #[default]
    Auto,
    /// Whatever the file system gives: 4 KiB pages on a default tmpfs such as /dev/shm.
    /// A named store in a hugetlbfs directory gets that file system's huge pages, and one
    /// in a tmpfs mounted with `huge=within_size` (or `huge=always`) gets transparent huge
    /// pages of 2 MiB wherever the kernel finds them free, with no reservation
    /// (docs/design.md, "Huge pages"). [`crate::Stats::huge_pages`] and
    /// [`crate::Stats::page_size`] say what is in effect.
    Off,
    /// `Auto`, and also advise transparent huge pages on the mapping (`MADV_HUGEPAGE`). The kernel
    /// decides at allocation time: an anonymous store (a memfd) gets them where
    /// `shmem_enabled` is `within_size` or `always`, a named one where its tmpfs is
    /// mounted so (as with `Off`). `advise` policies do not take effect, because the
    /// creator reserves the pages with `fallocate`, outside any mapping.
    Try,
    /// Explicit huge pages (hugetlb), reserved by the administrator
    /// (`sysctl vm.nr_hugepages`): an anonymous store is a `memfd` with `MFD_HUGETLB`; a
    /// named store must be created in a hugetlbfs mount ([`crate::StoreConfig::dir`]).
    /// Creation fails with [`crate::Error::HugePagesUnavailable`] when too few are free,
    /// never later. [`crate::Stats::page_size`] reports the page size in use.
    Hugetlb,
}

impl HugePages {
    /// Huge pages of the kernel's default size free now, and that size in bytes, from
    /// /proc/meminfo (`None` where it says nothing): how large a
    /// [`HugePages::Hugetlb`] store can be created.
    ///
    /// ```
    /// if let Some((free, size)) = shmstore::HugePages::free_pages() {
    ///     println!("{free} huge pages of {size} bytes free");
    /// }
    /// ```
    pub fn free_pages() -> Option<(u64, u64)> {
        free_huge_pages()
    }
}

/// `statfs` magic of hugetlbfs.
const HUGETLBFS_MAGIC: rustix::fs::FsWord = 0x9584_58f6;

/// What `fstatfs` says about the file system of `fd`: (is it hugetlbfs, its block size).
pub(super) fn fs_of(file: &File) -> Option<(bool, u64)> {
    let st = rustix::fs::fstatfs(file).ok()?;
    let block = u64::try_from(st.f_bsize).ok().filter(|&b| b > 0)?;
    Some((st.f_type == HUGETLBFS_MAGIC, block))
}

/// Whether `dir` is on hugetlbfs.
pub(super) fn is_hugetlbfs(dir: &Path) -> bool {
    rustix::fs::statfs(dir).is_ok_and(|st| st.f_type == HUGETLBFS_MAGIC)
}

/// Free huge pages of the default size, from /proc/meminfo: (free pages, page size).
pub(crate) fn free_huge_pages() -> Option<(u64, u64)> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |name: &str| {
        info.lines()
            .find(|l| l.starts_with(name))?
            .split_whitespace()
            .nth(1)?
            .parse::<u64>()
            .ok()
    };
    Some((field("HugePages_Free:")?, field("Hugepagesize:")? << 10))
}

/// The length to map and reserve for a layout of `total` bytes on a file system with
/// pages of `page` bytes: whole pages (hugetlbfs maps and allocates whole huge pages).
pub(super) fn whole_pages(total: u64, page: u64) -> u64 {
    total.div_ceil(page.max(PAGE)) * page.max(PAGE)
}

/// The transparent huge page size the mapping is placed for (the PMD size on x86-64 and
/// arm64 with 4 KiB pages).
pub(crate) const HUGE_PAGE: u64 = 2 << 20;

/// `statfs` magic of tmpfs (also of memfds and the kernel's internal shared-memory mount).
pub(super) const TMPFS_MAGIC: rustix::fs::FsWord = 0x0102_1994;

/// The kernel's transparent-huge-page policy for its internal shared-memory mount (memfds),
/// the bracketed word of `/sys/kernel/mm/transparent_hugepage/shmem_enabled`; `deny` and
/// `force` there override every tmpfs mount too.
pub(super) fn shmem_enabled() -> Option<String> {
    let s = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled").ok()?;
    let start = s.find('[')? + 1;
    let end = start + s[start..].find(']')?;
    Some(s[start..end].to_string())
}

/// The `huge=` option of the tmpfs mounted as device `major:minor`, from
/// `/proc/self/mountinfo`: `None` when no such mount is listed (a memfd lives on the
/// kernel's internal mount), `Some(None)` for a tmpfs mounted without the option.
pub(super) fn tmpfs_huge_option(major: u32, minor: u32) -> Option<Option<String>> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    huge_option_in(&info, &format!("{major}:{minor}"))
}

/// [`tmpfs_huge_option`] on the text of a mountinfo file, for device `dev` ("major:minor").
pub(super) fn huge_option_in(info: &str, dev: &str) -> Option<Option<String>> {
    info.lines().find_map(|line| {
        let mut fields = line.split(' ');
        if fields.nth(2) != Some(dev) {
            return None;
        }
        // After the optional fields, " - " then: fstype, source, super options.
        let (_, tail) = line.split_once(" - ")?;
        let mut tail = tail.split(' ');
        if tail.next() != Some("tmpfs") {
            return None;
        }
        let opts = tail.nth(1).unwrap_or("");
        Some(
            opts.split(',')
                .find_map(|o| o.strip_prefix("huge="))
                .map(str::to_string),
        )
    })
}

/// Whether the kernel gives `file` transparent huge pages (2 MiB, where it can find them
/// free) when its pages are allocated: a tmpfs mounted with `huge=within_size` or
/// `huge=always`, or a memfd under `shmem_enabled` `within_size` or `always` (`force`
/// anywhere). `advise` does not count: the creator reserves the store's pages with
/// `fallocate`, which has no mapping whose advice the kernel could consult, so it
/// allocates normal pages (measured: 0 huge pages for a 64 MiB store under `advise`,
/// with or without `MADV_HUGEPAGE`; docs/design.md, "Huge pages").
pub(super) fn thp_backed(file: &File) -> bool {
    if rustix::fs::fstatfs(file).map_or(true, |st| st.f_type != TMPFS_MAGIC) {
        return false;
    }
    let Ok(st) = rustix::fs::fstat(file) else {
        return false;
    };
    let dev = st.st_dev;
    let mount = tmpfs_huge_option(rustix::fs::major(dev), rustix::fs::minor(dev));
    thp_policy_gives_huge(
        shmem_enabled().as_deref(),
        mount.as_ref().map(Option::as_deref),
    )
}

/// Whether tmpfs pages come as transparent huge pages under the kernel's policy for its
/// internal mount (`global`, [`shmem_enabled`]) and the `huge=` option of the file's
/// mount (`mount`, [`tmpfs_huge_option`]: `None` for a memfd, which has no mount of its
/// own and follows `global`). `deny` and `force` in `global` override every mount.
pub(super) fn thp_policy_gives_huge(global: Option<&str>, mount: Option<Option<&str>>) -> bool {
    match global {
        Some("deny") => return false,
        Some("force") => return true,
        _ => {}
    }
    let policy = mount.unwrap_or(global);
    matches!(policy, Some("always" | "within_size"))
}

/// The size of a transparent huge page (the PMD size), 2 MiB where sysfs does not say.
pub(super) fn thp_size() -> u64 {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(2 << 20)
}
