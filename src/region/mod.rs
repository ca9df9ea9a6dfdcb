//! The shared-memory region: creating, opening and mapping the backing file. What pages
//! back it is [`pages`]' to tell; the temporary names a store is built under, and the
//! sweep of abandoned ones, [`creation`]'s.
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

mod creation;
mod pages;
#[cfg(all(test, not(miri)))]
mod tests;

pub(crate) use creation::sweep_abandoned_creations;
use creation::{creation_name, locked_and_linked};
pub use pages::HugePages;
pub(crate) use pages::{free_huge_pages, HUGE_PAGE};
use pages::{fs_of, is_hugetlbfs, thp_backed, thp_size, whole_pages, TMPFS_MAGIC};

use crate::error::{Error, Result};
use crate::layout::{Superblock, PAGE};
use crate::liveness::LockFile;
use memmap2::{MmapOptions, MmapRaw};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

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
