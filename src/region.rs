//! The shared-memory region: creating, opening and mapping the backing file.
//!
//! Owns the file descriptor and the mapping. A named store is a file under a directory
//! (default `/dev/shm`); an anonymous store is a memfd whose descriptor a child inherits or
//! receives. Invariants this module guarantees to everything above it:
//!
//! * the memory is **reserved up front** (`posix_fallocate`), so a too-small `/dev/shm`
//!   fails at create time with [`Error::InsufficientSpace`], never with a SIGBUS later, and
//!   a store over the memory limit of its creator's cgroup with [`Error::MemoryLimit`],
//!   never with the kernel's OOM kill during the reservation;
//! * a named store appears under its final name only when fully initialised (it is built
//!   under a temporary name and hard-linked into place, which also refuses to clobber);
//! * `open` reads and validates the superblock with `pread` *before* mapping, and maps only
//!   a file at least as long as the validated layout, so a foreign, truncated, wrong-version
//!   or corrupted file is a typed error, never UB or a SIGBUS;
//! * every mapping places file offset 0 on a 2 MiB boundary of the address space
//!   (hugetlbfs: on its own page size, which the kernel enforces), so 2 MiB pages of the
//!   file can be mapped whole ([`HugePages::Auto`]); the 2 MiB of address space around it
//!   is reserved and inaccessible;
//! * memfd stores are sealed against shrinking and growing (`F_SEAL_SHRINK | F_SEAL_GROW`).
//!   A named file can still be truncated by a process with write access to it; see
//!   docs/security.md.

use crate::error::{Error, Result};
use crate::layout::{Superblock, PAGE};
use crate::liveness::LockFile;
use memmap2::{MmapOptions, MmapRaw};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

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
fn fs_of(file: &File) -> Option<(bool, u64)> {
    let st = rustix::fs::fstatfs(file).ok()?;
    let block = u64::try_from(st.f_bsize).ok().filter(|&b| b > 0)?;
    Some((st.f_type == HUGETLBFS_MAGIC, block))
}

/// Whether `dir` is on hugetlbfs.
fn is_hugetlbfs(dir: &Path) -> bool {
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
fn whole_pages(total: u64, page: u64) -> u64 {
    total.div_ceil(page.max(PAGE)) * page.max(PAGE)
}

/// The transparent huge page size the mapping is placed for (the PMD size on x86-64 and
/// arm64 with 4 KiB pages).
pub(crate) const HUGE_PAGE: u64 = 2 << 20;

/// A mapped region plus the file that backs it.
pub(crate) struct Mapping {
    /// memmap2's mapping, which owns the address range (unmapped on drop). On a file
    /// system without huge pages of its own it is [`HUGE_PAGE`] longer than the store and
    /// the store is mapped again at its first 2 MiB boundary (see [`map`]).
    map: MmapRaw,
    /// Where the store starts inside `map`.
    offset: usize,
    /// The store's mapped length.
    len: usize,
    file: File,
    path: Option<PathBuf>,
    /// Whether the kernel gives the file transparent huge pages: found on first ask
    /// (`stats()`), not at every create and open, because it reads /proc/self/mountinfo.
    huge: OnceLock<bool>,
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> Error + 'a {
    move |source| Error::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// Free bytes on the file system holding `dir`.
pub(crate) fn free_space(dir: &Path) -> Option<u64> {
    let st = rustix::fs::statvfs(dir).ok()?;
    Some(st.f_bavail.saturating_mul(st.f_frsize))
}

/// Reserves `len` bytes for `file` (the kernel allocates and zeroes every page once: the
/// floor of creating a store). In 256 MiB steps, so that a reservation that takes more
/// than a second prints a progress line on stderr (when `progress` is set).
fn reserve(file: &File, len: u64, path: &Path, progress: bool) -> Result<()> {
    const STEP: u64 = 256 << 20;
    if let Some((true, page)) = fs_of(file) {
        return reserve_huge(file, len, page);
    }
    // Past its cgroup's memory limit the kernel would kill this process in the middle
    // of the reservation: say so first (see crate::cgroup).
    if let Some(room) = crate::cgroup::memory_shortfall(len) {
        return Err(Error::MemoryLimit {
            cgroup: room.cgroup,
            limit: room.limit,
            needed: len,
            available: room.available,
        });
    }
    let start = std::time::Instant::now();
    let mut lines = ProgressLines::new(path, len);
    let mut at = 0;
    while at < len {
        let n = STEP.min(len - at);
        reserve_range(file, at, n, len, path)?;
        at += n;
        if let Some(line) = lines.after(at, start.elapsed()).filter(|_| progress) {
            eprintln!("{line}");
        }
    }
    if let Some(line) = lines.done(start.elapsed()).filter(|_| progress) {
        eprintln!("{line}");
    }
    Ok(())
}

/// The progress lines of a reservation of `len` bytes: one at each new whole second while
/// it runs (none in its first second), and a last one when it is done if any came before.
struct ProgressLines<'a> {
    path: &'a Path,
    len: u64,
    /// When the last line came (zero: none yet).
    said: std::time::Duration,
}

impl<'a> ProgressLines<'a> {
    fn new(path: &'a Path, len: u64) -> Self {
        ProgressLines {
            path,
            len,
            said: std::time::Duration::ZERO,
        }
    }

    /// The line due once `at` bytes are reserved, `elapsed` after the start, if any.
    fn after(&mut self, at: u64, elapsed: std::time::Duration) -> Option<String> {
        if elapsed.as_secs() <= self.said.as_secs() || at >= self.len {
            return None;
        }
        self.said = elapsed;
        Some(format!(
            "shmstore: reserving {:.1} GiB for {}: {:.1} GiB done after {:.1} s",
            gib(self.len),
            self.path.display(),
            gib(at),
            elapsed.as_secs_f64()
        ))
    }

    /// The last line, `elapsed` after the start, if any came before it.
    fn done(&self, elapsed: std::time::Duration) -> Option<String> {
        (self.said > std::time::Duration::ZERO).then(|| {
            format!(
                "shmstore: reserved {:.1} GiB for {} in {:.1} s",
                gib(self.len),
                self.path.display(),
                elapsed.as_secs_f64()
            )
        })
    }
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// Reserves `len` bytes of huge pages of `page` bytes in one call: the kernel takes and
/// zeroes every huge page now, so a shortage is an error here and never a SIGBUS later.
fn reserve_huge(file: &File, len: u64, page: u64) -> Result<()> {
    match rustix::fs::fallocate(file, rustix::fs::FallocateFlags::empty(), 0, len) {
        Ok(()) => Ok(()),
        Err(rustix::io::Errno::NOSPC | rustix::io::Errno::NOMEM) => {
            Err(Error::HugePagesUnavailable {
                page_size: page,
                needed: len / page,
                free: free_huge_pages().map_or(0, |(free, _)| free),
            })
        }
        Err(e) => Err(Error::Io {
            op: "fallocate (huge pages)",
            path: PathBuf::from("<hugetlb>"),
            source: e.into(),
        }),
    }
}

fn reserve_range(file: &File, at: u64, n: u64, len: u64, path: &Path) -> Result<()> {
    // fallocate(2) itself, not glibc's posix_fallocate, which would fall back to writing
    // zeros on a file system without it: tmpfs and hugetlbfs both have it.
    match rustix::fs::fallocate(file, rustix::fs::FallocateFlags::empty(), at, n) {
        Ok(()) => Ok(()),
        Err(rustix::io::Errno::NOSPC) => {
            let dir = path.parent().unwrap_or(Path::new("/"));
            Err(Error::InsufficientSpace {
                path: path.to_path_buf(),
                needed: len,
                available: free_space(dir).unwrap_or(0),
            })
        }
        Err(e) => Err(Error::Io {
            op: "fallocate",
            path: path.to_path_buf(),
            source: e.into(),
        }),
    }
}

/// Maps `len` bytes of `file` for reading and writing. Unless the file is on hugetlbfs
/// (whose mappings the kernel aligns to its page size), file offset 0 is placed on a
/// 2 MiB boundary of the address space: a default tmpfs gets no such alignment from the
/// kernel, and without it no 2 MiB page of the file could be mapped with one entry
/// (`HugePages::Auto` builds such pages). memmap2 maps 2 MiB more than asked (past the
/// end of the file, which reserves address space and nothing else), then the file is
/// mapped again over that range at the boundary; the slack around it is made
/// inaccessible. Returns the mapping and where the store starts in it.
fn map(file: &File, len: u64, path: &Path) -> Result<(MmapRaw, usize)> {
    let len = usize::try_from(len).map_err(|_| Error::InvalidConfig {
        reason: format!("a store of {len} bytes does not fit this address space"),
    })?;
    if matches!(fs_of(file), Some((true, _))) {
        let raw = MmapOptions::new()
            .len(len)
            .map_raw(file)
            .map_err(io_err("mmap", path))?;
        return Ok((raw, 0));
    }
    let huge = HUGE_PAGE as usize;
    let raw = MmapOptions::new()
        .len(len + huge)
        .map_raw(file)
        .map_err(io_err("mmap", path))?;
    let at = raw.as_mut_ptr() as usize;
    let offset = at.next_multiple_of(huge) - at;
    if offset != 0 {
        use std::os::fd::AsRawFd;
        // SAFETY: `[at + offset, at + offset + len)` lies inside `raw` (offset < 2 MiB),
        // which this function alone holds and nothing has accessed; MAP_FIXED replaces
        // those pages of our own mapping with the same file's pages from offset 0.
        let p = unsafe {
            libc::mmap(
                (at + offset) as *mut libc::c_void,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io_err("mmap (2 MiB aligned)", path)(
                io::Error::last_os_error(),
            ));
        }
    }
    for (start, n) in [(at, offset), (at + offset + len, huge - offset)] {
        if n > 0 {
            // SAFETY: the range is slack of our own mapping, never handed out; PROT_NONE
            // only makes a stray access fault.
            unsafe { libc::mprotect(start as *mut libc::c_void, n, libc::PROT_NONE) };
        }
    }
    Ok((raw, offset))
}

/// `statfs` magic of tmpfs (also of memfds and the kernel's internal shared-memory mount).
const TMPFS_MAGIC: rustix::fs::FsWord = 0x0102_1994;

/// The kernel's transparent-huge-page policy for its internal shared-memory mount (memfds),
/// the bracketed word of `/sys/kernel/mm/transparent_hugepage/shmem_enabled`; `deny` and
/// `force` there override every tmpfs mount too.
fn shmem_enabled() -> Option<String> {
    let s = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled").ok()?;
    let start = s.find('[')? + 1;
    let end = start + s[start..].find(']')?;
    Some(s[start..end].to_string())
}

/// The `huge=` option of the tmpfs mounted as device `major:minor`, from
/// `/proc/self/mountinfo`: `None` when no such mount is listed (a memfd lives on the
/// kernel's internal mount), `Some(None)` for a tmpfs mounted without the option.
fn tmpfs_huge_option(major: u32, minor: u32) -> Option<Option<String>> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    huge_option_in(&info, &format!("{major}:{minor}"))
}

/// [`tmpfs_huge_option`] on the text of a mountinfo file, for device `dev` ("major:minor").
fn huge_option_in(info: &str, dev: &str) -> Option<Option<String>> {
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
fn thp_backed(file: &File) -> bool {
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
fn thp_policy_gives_huge(global: Option<&str>, mount: Option<Option<&str>>) -> bool {
    match global {
        Some("deny") => return false,
        Some("force") => return true,
        _ => {}
    }
    let policy = mount.unwrap_or(global);
    matches!(policy, Some("always" | "within_size"))
}

/// The size of a transparent huge page (the PMD size), 2 MiB where sysfs does not say.
fn thp_size() -> u64 {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(2 << 20)
}

impl Mapping {
    fn finish(
        (map, offset): (MmapRaw, usize),
        len: u64,
        file: File,
        path: Option<PathBuf>,
        huge: HugePages,
        prefault: bool,
    ) -> Self {
        if huge == HugePages::Try {
            // SAFETY: the range is exactly our live mapping; MADV_HUGEPAGE is advisory and
            // does not change its contents.
            unsafe {
                libc::madvise(
                    map.as_mut_ptr().add(offset).cast(),
                    len as usize,
                    libc::MADV_HUGEPAGE,
                )
            };
        }
        let m = Mapping {
            map,
            offset,
            len: len as usize,
            file,
            path,
            huge: OnceLock::new(),
        };
        if prefault {
            m.prefault();
        }
        m
    }

    /// Populates this process's page tables for `[offset, offset + len)` of the mapping
    /// (rounded out to pages) in one call, for reading or for writing: what the first
    /// access would fault in page by page, at a fraction of the cost. Best effort (kernels
    /// before 5.14 lack it; contents never change).
    pub(crate) fn populate(&self, offset: usize, len: usize, write: bool) {
        const MADV_POPULATE_READ: libc::c_int = 22;
        const MADV_POPULATE_WRITE: libc::c_int = 23;
        let page = PAGE as usize;
        let start = offset / page * page;
        // Clamped before rounding up, so that no range, however hostile, overflows (the
        // mapping's length is whole pages).
        let end = offset.saturating_add(len).min(self.len).div_ceil(page) * page;
        if start >= end {
            return;
        }
        let advice = if write {
            MADV_POPULATE_WRITE
        } else {
            MADV_POPULATE_READ
        };
        // SAFETY: `[start, end)` lies inside our live mapping (clamped above) and starts on
        // a page boundary; POPULATE_* only fills page tables, never changes contents.
        unsafe { libc::madvise(self.base().add(start).cast(), end - start, advice) };
    }

    /// Asks the kernel to rebuild the file's pages in `[offset, offset + len)` (whole,
    /// 2 MiB aligned huge pages of the file) as 2 MiB pages (`MADV_COLLAPSE`, Linux 6.1 and
    /// later): it allocates a huge page, copies the small pages in (zeroes the ones never
    /// touched), and swaps it into the file, for every process. Contents never change;
    /// a process touching the range meanwhile waits in its page fault. It needs no
    /// privilege, and the kernel allows it on tmpfs unless `shmem_enabled` is `deny`.
    /// `EINVAL` means the kernel cannot (too old, denied, not aligned); `EAGAIN` or
    /// `ENOMEM` that it could not this time (no free 2 MiB block, a page pinned).
    pub(crate) fn collapse(&self, offset: usize, len: usize) -> std::result::Result<(), io::Error> {
        const MADV_COLLAPSE: libc::c_int = 25;
        if offset.checked_add(len).is_none_or(|e| e > self.len) {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        // SAFETY: the range lies inside our live mapping (checked above); MADV_COLLAPSE
        // changes how the file's pages are held, never their contents.
        let rc = unsafe { libc::madvise(self.base().add(offset).cast(), len, MADV_COLLAPSE) };
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    /// Whether [`Mapping::collapse`] can give this store 2 MiB pages: a tmpfs file (named
    /// or memfd) not already on huge pages of its own, mapped on a 2 MiB boundary.
    pub(crate) fn can_collapse(&self) -> bool {
        let tmpfs = rustix::fs::fstatfs(&self.file).is_ok_and(|st| st.f_type == TMPFS_MAGIC);
        tmpfs && (self.base() as usize) % HUGE_PAGE as usize == 0 && !self.huge_pages()
    }

    /// Populates this process's page tables for the whole region, so first writes run at
    /// warm speed. Contents are unchanged (MADV_POPULATE_WRITE does not write data).
    pub(crate) fn prefault(&self) {
        const MADV_POPULATE_WRITE: libc::c_int = 23;
        // SAFETY: range is our live mapping. POPULATE_WRITE faults pages in as if written
        // but leaves their contents alone; on kernels without it this fails with EINVAL and
        // we fall back to WILLNEED, which is purely advisory.
        let rc = unsafe { libc::madvise(self.base().cast(), self.len, MADV_POPULATE_WRITE) };
        if rc != 0 {
            // SAFETY: as above; advisory only.
            unsafe { libc::madvise(self.base().cast(), self.len, libc::MADV_WILLNEED) };
        }
    }

    /// Creates a named store file: lock byte 0, reserve, map, write the superblock, then
    /// publish the name. The lock (returned) shows the store in use until its creator
    /// has attached and holds a slot lock of its own: drop it after that.
    pub(crate) fn create_named(
        dir: &Path,
        name: &str,
        sb: &Superblock,
        mode: u32,
        huge: HugePages,
        prefault: bool,
        progress: bool,
    ) -> Result<(Mapping, LockFile)> {
        let (m, creating, tmp) = Self::build_named(dir, name, sb, mode, huge, prefault, progress)?;
        let path = dir.join(name);
        let cleanup = |e: Error| {
            let _ = std::fs::remove_file(&tmp);
            e
        };
        match std::fs::hard_link(&tmp, &path) {
            Ok(()) => {
                let _ = std::fs::remove_file(&tmp);
                Ok((m, creating))
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                Err(cleanup(Error::StoreExists { path }))
            }
            Err(e) => Err(cleanup(Error::Io {
                op: "link",
                path,
                source: e,
            })),
        }
    }

    /// Everything [`Mapping::create_named`] does but publishing the name: the store, built
    /// under a temporary name ([`creation_name`]) whose byte 0 it locks before anything
    /// else, so that [`sweep_abandoned_creations`] can tell a creation in progress from
    /// one whose creator was killed. Returns the temporary path with the mapping and lock.
    pub(crate) fn build_named(
        dir: &Path,
        name: &str,
        sb: &Superblock,
        mode: u32,
        huge: HugePages,
        prefault: bool,
        progress: bool,
    ) -> Result<(Mapping, LockFile, PathBuf)> {
        check_name(name)?;
        let path = dir.join(name);
        if path.exists() {
            return Err(Error::StoreExists { path });
        }
        // What creators killed mid-way left here holds memory: return it first.
        sweep_abandoned_creations(dir);
        // hugetlbfs reports no free space without a size= limit; its fallocate says.
        let free = free_space(dir).filter(|_| !is_hugetlbfs(dir));
        if let Some(avail) = free {
            if avail < sb.total_size {
                return Err(Error::InsufficientSpace {
                    path,
                    needed: sb.total_size,
                    available: avail,
                });
            }
        }
        let mut attempts = 0;
        let (file, tmp, creating) = loop {
            let nonce = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0);
            let tmp = dir.join(creation_name(name, std::process::id(), nonce));
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .mode(mode)
                .open(&tmp)
                .map_err(io_err("create", &tmp))?;
            let creating = LockFile::open(&file, Some(&tmp)).inspect_err(|_| {
                let _ = std::fs::remove_file(&tmp);
            })?;
            if locked_and_linked(&file, &creating) {
                break (file, tmp, creating);
            }
            // A sweep in another process locked the new file first, taking it for an
            // abandoned creation: it removes it, or has. Start over under another name.
            attempts += 1;
            if attempts == 3 {
                return Err(Error::Io {
                    op: "lock",
                    path: tmp,
                    source: io::Error::from(io::ErrorKind::WouldBlock),
                });
            }
        };
        let cleanup = |e: Error| {
            let _ = std::fs::remove_file(&tmp);
            e
        };
        let (hugetlbfs, page) = fs_of(&file).unwrap_or((false, PAGE));
        if huge == HugePages::Hugetlb && !hugetlbfs {
            return Err(cleanup(Error::InvalidConfig {
                reason: format!(
                    "HugePages::Hugetlb needs a hugetlbfs directory, and {} is not one: \
                     mount one (`mount -t hugetlbfs none /dev/hugepages`) and create the \
                     store there, or create an anonymous store",
                    dir.display()
                ),
            }));
        }
        let len = whole_pages(sb.total_size, page);
        reserve(&file, len, &path, progress).map_err(cleanup)?;
        let map = map(&file, len, &tmp).map_err(cleanup)?;
        let m = Mapping::finish(map, len, file, Some(path.clone()), huge, prefault);
        m.write_superblock(sb);
        Ok((m, creating, tmp))
    }

    /// Creates an anonymous store in a sealed memfd.
    pub(crate) fn create_memfd(
        sb: &Superblock,
        huge: HugePages,
        prefault: bool,
        progress: bool,
    ) -> Result<Mapping> {
        let label = Path::new("memfd:shmstore");
        use rustix::fs::{MemfdFlags, SealFlags};
        let mut flags = MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING;
        if huge == HugePages::Hugetlb {
            flags |= MemfdFlags::HUGETLB;
        }
        let fd = rustix::fs::memfd_create(c"shmstore", flags);
        let fd = fd.map_err(|errno| {
            let e = io::Error::from(errno);
            // EINVAL: the kernel knows no MFD_HUGETLB. Anything else (out of descriptors,
            // of memory) is no fault of the configuration.
            if huge == HugePages::Hugetlb && errno == rustix::io::Errno::INVAL {
                Error::InvalidConfig {
                    reason: format!(
                        "memfd_create(MFD_HUGETLB) failed ({e}): this kernel offers no \
                         huge-page memfd; create the store without HugePages::Hugetlb"
                    ),
                }
            } else {
                io_err("memfd_create", label)(e)
            }
        })?;
        let file = File::from(fd);
        let page = fs_of(&file).map_or(PAGE, |(_, page)| page);
        let len = whole_pages(sb.total_size, page);
        reserve(&file, len, Path::new("/dev/shm/memfd"), progress)?;
        rustix::fs::fcntl_add_seals(&file, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
            .map_err(|e| io_err("fcntl(F_ADD_SEALS)", label)(e.into()))?;
        let map = map(&file, len, label)?;
        let m = Mapping::finish(map, len, file, None, huge, prefault);
        m.write_superblock(sb);
        Ok(m)
    }

    /// Opens and validates an existing store file (a named store, or a memfd reached
    /// through `/proc/PID/fd/N`).
    pub(crate) fn open(
        path: &Path,
        huge: HugePages,
        prefault: bool,
    ) -> Result<(Mapping, Superblock)> {
        let file = match OpenOptions::new().read(true).write(true).open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(Error::StoreNotFound {
                    path: path.to_path_buf(),
                })
            }
            Err(e) => return Err(io_err("open", path)(e)),
        };
        Self::open_file(file, Some(path.to_path_buf()), huge, prefault)
    }

    /// Validates and maps an already-open store file.
    pub(crate) fn open_file(
        file: File,
        path: Option<PathBuf>,
        huge: HugePages,
        prefault: bool,
    ) -> Result<(Mapping, Superblock)> {
        let shown = path.clone().unwrap_or_else(|| PathBuf::from("<fd>"));
        let len = file.metadata().map_err(io_err("fstat", &shown))?.len();
        let mut head = vec![0u8; 256.min(len as usize)];
        file.read_exact_at(&mut head, 0)
            .map_err(io_err("read superblock", &shown))?;
        let sb = Superblock::validate(&head, len, &shown)?;
        // Whole pages where the file system has huge ones (the file was reserved so).
        let page = fs_of(&file).map_or(PAGE, |(_, page)| page);
        let mapped_len = whole_pages(sb.total_size, page).min(len);
        let map = map(&file, mapped_len, &shown)?;
        let m = Mapping::finish(map, mapped_len, file, path, huge, prefault);
        // The file could have been rewritten between our pread and the mmap; check again
        // through the mapping (its length is already pinned by `total_size <= len`).
        let mapped = Superblock::validate(m.bytes_prefix(), sb.total_size, &shown)?;
        if mapped != sb {
            return Err(Error::Corrupted {
                what: format!("superblock of {} changed while opening", shown.display()),
            });
        }
        Ok((m, sb))
    }

    fn write_superblock(&self, sb: &Superblock) {
        let bytes = bytemuck::bytes_of(sb);
        // SAFETY: the mapping is at least `total_size >= 256` bytes long, freshly created,
        // and not yet visible to any other process (named: not yet linked; memfd: fd not
        // yet shared), so no one else reads or writes these bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.base(), bytes.len());
        }
    }

    fn bytes_prefix(&self) -> &[u8] {
        // SAFETY: the superblock is immutable after creation, the mapping is at least 256
        // bytes long, and lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.base().cast_const(), 256) }
    }

    /// Makes `[offset, offset + len)` of the mapping read-only in this process: the
    /// kernel then faults any write there (read-only attach mode).
    pub(crate) fn protect_read_only(&self, offset: u64, len: u64) -> Result<()> {
        if offset % PAGE != 0 || offset.checked_add(len).is_none_or(|e| e > self.len as u64) {
            return Err(Error::Corrupted {
                what: format!("read-only range {offset}+{len} is not inside the mapping"),
            });
        }
        // SAFETY: the range lies inside our live mapping (checked above) and starts on a
        // page boundary; PROT_READ only removes write access from this process.
        let rc = unsafe {
            libc::mprotect(
                self.base().add(offset as usize).cast(),
                len as usize,
                libc::PROT_READ,
            )
        };
        if rc != 0 {
            return Err(Error::Io {
                op: "mprotect(PROT_READ)",
                path: self.path.clone().unwrap_or_default(),
                source: io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    /// Start of the mapping.
    pub(crate) fn base(&self) -> *mut u8 {
        // SAFETY: `offset` < 2 MiB, and `map` is `offset + len` bytes or longer (see `map`).
        unsafe { self.map.as_mut_ptr().add(self.offset) }
    }

    /// Mapped length.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The backing file's path (None for anonymous stores).
    pub(crate) fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Whether `path` still names the file this mapping was made from (same device and
    /// inode): a store removed and re-created under the same name is another file.
    pub(crate) fn same_file_as(&self, path: &Path) -> bool {
        same_file(&self.file, path)
    }

    /// The backing file.
    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    /// Whether the kernel gives this store's file transparent huge pages (see
    /// `thp_backed`).
    pub(crate) fn huge_pages(&self) -> bool {
        *self.huge.get_or_init(|| thp_backed(&self.file))
    }

    /// The page size backing the store: the huge page size on hugetlbfs (`fstatfs`'s
    /// block size), the transparent huge page size where the kernel gives the file those
    /// ([`Mapping::huge_pages`]), else 4096.
    pub(crate) fn page_size(&self) -> u64 {
        match fs_of(&self.file) {
            Some((true, page)) => page,
            _ if self.huge_pages() => thp_size(),
            _ => PAGE,
        }
    }
}

/// Whether `path` (followed through symbolic links, as opening it does) leads to the
/// file `file` is open on.
pub(crate) fn same_file(file: &File, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (file.metadata(), std::fs::metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// The end of the temporary name a store is built under before its name is published.
const CREATION_SUFFIX: &str = ".shmstore-creating";

/// The temporary name a store `name` is built under: `.NAME.PID.NONCE.shmstore-creating`
/// (hidden, and never a valid store name, which cannot start with '.').
fn creation_name(name: &str, pid: u32, nonce: u128) -> String {
    format!(".{name}.{pid}.{nonce}{CREATION_SUFFIX}")
}

/// Whether `file_name` has the shape of [`creation_name`].
fn is_creation_name(file_name: &str) -> bool {
    let Some(stem) = file_name
        .strip_prefix('.')
        .and_then(|s| s.strip_suffix(CREATION_SUFFIX))
    else {
        return false;
    };
    let mut parts = stem.rsplitn(3, '.');
    let digits =
        |s: Option<&str>| s.is_some_and(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()));
    digits(parts.next()) && digits(parts.next()) && parts.next().is_some_and(|n| !n.is_empty())
}

/// Removes from `dir` the stores whose creator was killed before publishing them (while
/// reserving a large store, say): files named like a creation in progress on which no
/// process holds any lock. A creator locks its file's byte 0 before anything else and
/// keeps a lock until its name is published, so an unlocked one has no live creator; the
/// sweep takes the whole file's lock before removing it, so that a creator which has just
/// made its file and not locked it yet fails to, and starts over under another name. Files
/// that cannot be opened read-write (another user's) or are not regular files are left
/// alone. Returns how many were removed.
pub(crate) fn sweep_abandoned_creations(dir: &Path) -> usize {
    use std::os::unix::fs::OpenOptionsExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        if !entry.file_name().to_str().is_some_and(is_creation_name) {
            continue;
        }
        let path = entry.path();
        let Ok(file) = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&path)
        else {
            continue;
        };
        if file.metadata().is_ok_and(|m| m.is_file())
            && crate::liveness::try_lock_whole_file(&file)
            && std::fs::remove_file(&path).is_ok()
        {
            removed += 1;
        }
        // The lock goes with `file`.
    }
    removed
}

/// Locks byte 0 of a creator's new temporary file and checks that its name is still
/// there. A sweep ([`sweep_abandoned_creations`]) in another process may have found the
/// file before the creator locked it: it removes the name while it holds the whole file's
/// lock, so the creator's lock either fails, or succeeds after the name is gone (the file
/// then has no link left, and a store built in it could never be published).
fn locked_and_linked(file: &File, creating: &LockFile) -> bool {
    use std::os::unix::fs::MetadataExt;
    creating.try_lock(0) && file.metadata().is_ok_and(|m| m.nlink() > 0)
}

fn check_name(name: &str) -> Result<()> {
    if name.is_empty() || name.len() > 200 || name.contains('/') || name.starts_with('.') {
        return Err(Error::InvalidConfig {
            reason: format!(
                "store name {name:?} must be 1-200 characters, without '/' and not starting with '.'"
            ),
        });
    }
    Ok(())
}

const _: () = assert!(PAGE == 4096);

#[cfg(all(test, not(miri)))]
mod tests {
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
            ["always", "within_size", "advise", "never", "deny", "force"]
                .contains(&policy.as_str()),
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
        let m = Mapping::create_memfd(&small_superblock(1 << 20), HugePages::Off, false, false)
            .unwrap();
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
        let m = Mapping::create_memfd(&small_superblock(1 << 20), HugePages::Off, false, false)
            .unwrap();
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
        let m = Mapping::create_memfd(&small_superblock(1 << 20), HugePages::Off, false, false)
            .unwrap();
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
                if let (Ok(lo), Ok(hi)) =
                    (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
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
        if huge_option_in(
            &std::fs::read_to_string("/proc/self/mountinfo").unwrap(),
            &{
                let st = rustix::fs::stat(thp);
                st.map(|st| {
                    format!(
                        "{}:{}",
                        rustix::fs::major(st.st_dev),
                        rustix::fs::minor(st.st_dev)
                    )
                })
                .unwrap_or_default()
            },
        ) == Some(Some("within_size".into()))
        {
            let _removed = crate::testing::RemovedAtEnd(thp.join(&name));
            let (m, _creating) =
                Mapping::create_named(thp, &name, &sb, 0o600, HugePages::Off, false, false)
                    .unwrap();
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
}
