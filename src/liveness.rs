//! Liveness: how an attached process proves to the others that it still runs, and how a
//! process made by `fork()` tells the handles it inherited from the handles it made.
//!
//! # A client slot is held while one byte of the store file is locked
//! Each attachment opens its own *open file description* (OFD) of the store file and takes
//! an OFD write lock (`F_OFD_SETLK`) on the byte at its client slot's offset before it
//! writes anything into the slot, and drops it only after the slot reads FREE again. The
//! kernel releases an OFD lock when the last descriptor of that OFD closes, which happens
//! when the process exits or is killed, at whatever instruction. Another process asks the
//! kernel (`F_OFD_GETLK`) whether the byte is locked: locked means the holder runs.
//!
//! This replaces "pid + start time from /proc": a lock cannot be fooled by pid reuse or
//! by a zombie waiting to be reaped, works across pid namespaces (two containers sharing
//! one `/dev/shm` file share its locks), and there is no window in which a slot is taken
//! but its owner not yet known, because the lock is taken first. iceoryx2 detects dead
//! processes the same way. Nobody ever waits on these locks: `F_OFD_SETLK` either takes a
//! free byte at once or fails, and `F_OFD_GETLK` only looks.
//!
//! # Removing a store's name
//! Removing an unused store (`Store::remove_if_unused`, or the last process of a
//! `remove_when_unused` store leaving) takes a read lock on the whole file through a
//! description of its own ([`LockFile::try_lock_all_shared`]) and unlinks the name while it
//! holds it. The read lock conflicts with every slot's write lock, so a process attaching
//! at that moment has either locked its slot first (the lock fails and nothing is
//! removed), fails to lock any slot while the lock is held ([`removal_in_progress`] tells
//! it so; it waits for the lock to go), or locks its slot after the name is gone;
//! `Store::open_path` then finds the name no longer leads to the file it attached and
//! opens the name again (`StoreNotFound` if nothing is there). Without the
//! lock, a look (`F_OFD_GETLK`) then an unlink left a moment in which a process attached
//! to a store whose name was then removed: it worked on alone, and every later process
//! made a new store under the name (two stores where the users meant one).
//!
//! # Fork
//! A child made by `fork()` inherits the parent's descriptors, and with them a reference
//! to every lock OFD: left alone, the parent's slots would look alive for as long as the
//! child lives. So the first attachment in a process registers a `pthread_atfork` child
//! handler that, in the child, closes every lock descriptor this library opened (they are
//! listed in [`LOCK_FDS`], a fixed table of atomics, so the handler neither allocates nor
//! takes a lock) and bumps the process's fork [`generation`]. Every handle records the
//! generation it was made in: a handle whose generation differs from the process's own
//! was inherited, and the store code neither releases nor unpins through it (see
//! `docs/design.md`, "Fork"). The child attaches as a client of its own on first use.
//!
//! Lock descriptors are `O_CLOEXEC`, so a process that `exec`s drops them too.

use crate::error::{Error, Result};
use crate::sync::{AtomicU32, AtomicU64, Ordering};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::Once;

/// Lock descriptors opened by this process, as `fd + 1` (0: empty entry). The fork handler
/// closes them in the child.
static LOCK_FDS: [AtomicU32; MAX_LOCK_FDS] = [const { AtomicU32::new(0) }; MAX_LOCK_FDS];
/// Most stores one process can have attached at once.
const MAX_LOCK_FDS: usize = 4096;
/// Bumped in every child by the fork handler.
static GENERATION: AtomicU64 = AtomicU64::new(0);
static REGISTER: Once = Once::new();

/// The process's fork generation: 0 in a process that was not forked since it started
/// using shmstore, then one more in each child. Two handles of one process compare equal
/// exactly when both were made in this process (not inherited).
#[inline]
pub(crate) fn generation() -> u64 {
    GENERATION.load(Ordering::Relaxed)
}

/// Runs in the child right after `fork()`, before `fork()` returns there. Only
/// async-signal-safe work: atomics and `close`.
extern "C" fn after_fork_in_child() {
    GENERATION.fetch_add(1, Ordering::Relaxed);
    for entry in &LOCK_FDS {
        let v = entry.swap(0, Ordering::Relaxed);
        if v != 0 {
            // SAFETY: the descriptor was opened by `LockFile::open` and is owned by the
            // table entry we just emptied: nothing else in this process closes it.
            unsafe { libc::close(v as i32 - 1) };
        }
    }
}

/// Registers the fork handler once per process.
fn register_fork_handler() {
    REGISTER.call_once(|| {
        // SAFETY: the handler is a plain `extern "C" fn` that lives for the whole program.
        let rc = unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
        debug_assert_eq!(rc, 0, "pthread_atfork failed");
    });
}

/// Tells the library that the process has just forked (for runtimes that fork without
/// running `pthread_atfork` handlers). Idempotent enough: an extra bump only makes
/// handles made before it count as inherited.
pub(crate) fn note_fork() {
    after_fork_in_child();
}

/// One attachment's own open file description of the store file, for slot locks.
#[derive(Debug)]
pub(crate) struct LockFile {
    fd: i32,
    entry: usize,
    /// The fork generation it was opened in: an inherited one is not ours to close.
    opened_in: u64,
}

impl LockFile {
    /// Opens a new OFD of the file behind `file` (through `/proc/self/fd`, which works for
    /// memfds too; `path` is the fallback where /proc is not mounted).
    pub(crate) fn open(file: &File, path: Option<&Path>) -> Result<LockFile> {
        Self::open_description(file, path, true)
    }

    /// [`open`](Self::open) for removing the store ([`try_lock_all_shared`]): read-write
    /// where the file allows it, read-only otherwise (a read lock needs no more).
    ///
    /// [`try_lock_all_shared`]: Self::try_lock_all_shared
    pub(crate) fn open_for_removal(file: &File, path: Option<&Path>) -> Result<LockFile> {
        Self::open_description(file, path, true)
            .or_else(|_| Self::open_description(file, path, false))
    }

    fn open_description(file: &File, path: Option<&Path>, write: bool) -> Result<LockFile> {
        use std::os::unix::fs::OpenOptionsExt;
        register_fork_handler();
        let proc_path = format!("/proc/self/fd/{}", file.as_raw_fd());
        let open = |p: &Path| {
            std::fs::OpenOptions::new()
                .read(true)
                .write(write)
                .custom_flags(libc::O_CLOEXEC)
                .open(p)
        };
        let f = open(Path::new(&proc_path))
            .or_else(|e| path.map_or(Err(e), open))
            .map_err(|source| Error::Io {
                op: "open a lock descriptor",
                path: path.map(Path::to_path_buf).unwrap_or_default(),
                source,
            })?;
        let fd = std::os::fd::IntoRawFd::into_raw_fd(f);
        for (entry, e) in LOCK_FDS.iter().enumerate() {
            if e.compare_exchange(0, fd as u32 + 1, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
            {
                return Ok(LockFile {
                    fd,
                    entry,
                    opened_in: generation(),
                });
            }
        }
        // SAFETY: `fd` came from `into_raw_fd` above and was never shared.
        unsafe { libc::close(fd) };
        Err(Error::InvalidConfig {
            reason: format!(
                "this process already has {MAX_LOCK_FDS} stores attached: drop some first"
            ),
        })
    }

    fn flock(&self, cmd: libc::c_int, ty: libc::c_short, offset: u64) -> io::Result<libc::flock> {
        // `fd` is our open descriptor: the entry in LOCK_FDS is ours until Drop.
        ofd_lock(self.fd, cmd, ty, offset, 1)
    }

    /// Takes the lock on byte `offset` for this attachment; `false` if another OFD holds it.
    pub(crate) fn try_lock(&self, offset: u64) -> bool {
        self.flock(libc::F_OFD_SETLK, libc::F_WRLCK as libc::c_short, offset)
            .is_ok()
    }

    /// Takes a read lock on every byte of the file: `false` if any other description holds
    /// a lock on any byte, as every attached client does on its slot's byte and a creator
    /// on byte 0. Held while a store's name is removed, so that a process attaching at
    /// that moment either locked its slot first (and the store is not removed) or locks it
    /// after the name is gone, which it then checks (`Store::open_path`). Removers do not
    /// exclude each other: each checks the name still leads to its file before unlinking.
    pub(crate) fn try_lock_all_shared(&self) -> bool {
        ofd_lock(
            self.fd,
            libc::F_OFD_SETLK,
            libc::F_RDLCK as libc::c_short,
            0,
            0,
        )
        .is_ok()
    }

    /// Drops this attachment's lock on byte `offset`.
    pub(crate) fn unlock(&self, offset: u64) {
        let _ = self.flock(libc::F_OFD_SETLK, libc::F_UNLCK as libc::c_short, offset);
    }

    /// Whether another OFD (another process, or another attachment of this one) holds the
    /// lock on byte `offset`. If the kernel cannot tell, it counts as held: treating a live
    /// client as dead would free memory it still reads, so doubt means "alive".
    pub(crate) fn locked_elsewhere(&self, offset: u64) -> bool {
        match self.flock(libc::F_OFD_GETLK, libc::F_WRLCK as libc::c_short, offset) {
            Ok(fl) => fl.l_type != libc::F_UNLCK as libc::c_short,
            Err(_) => true,
        }
    }
}

/// An OFD lock request `cmd` (`F_OFD_SETLK` or `F_OFD_GETLK`) of type `ty` on `len` bytes
/// from `offset` (`len` 0: to the end of the file, however far it grows) through the open
/// descriptor `fd`: the `flock` the kernel filled in, or why it refused.
fn ofd_lock(
    fd: i32,
    cmd: libc::c_int,
    ty: libc::c_short,
    offset: u64,
    len: u64,
) -> io::Result<libc::flock> {
    // SAFETY: flock is plain old data; all-zero is a valid value (l_pid must be 0 for OFD
    // locks).
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = ty;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = offset as libc::off_t;
    fl.l_len = len as libc::off_t;
    // SAFETY: every caller passes a descriptor it keeps open for the duration of the call;
    // `fl` is a valid flock the kernel reads and, for GETLK, writes.
    if unsafe { libc::fcntl(fd, cmd, &mut fl) } == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(fl)
    }
}

/// Whether a removal of the store holds its lock ([`LockFile::try_lock_all_shared`]) now,
/// asked through `file`'s description (which must hold no lock). Only removals take read
/// locks, and while one is held nobody can take a slot's write lock; so a read lock is
/// what the kernel reports then. If the kernel cannot tell: no.
pub(crate) fn removal_in_progress(file: &File) -> bool {
    let asked = ofd_lock(
        file.as_raw_fd(),
        libc::F_OFD_GETLK,
        libc::F_WRLCK as libc::c_short,
        0,
        0,
    );
    asked.is_ok_and(|fl| fl.l_type == libc::F_RDLCK as libc::c_short)
}

/// Takes an OFD write lock on the whole file through `file`'s own description: `true`
/// when no other description held a lock on any byte of it (and none can take one now).
/// The lock goes when `file` is closed.
pub(crate) fn try_lock_whole_file(file: &File) -> bool {
    ofd_lock(
        file.as_raw_fd(),
        libc::F_OFD_SETLK,
        libc::F_WRLCK as libc::c_short,
        0,
        0,
    )
    .is_ok()
}

impl Drop for LockFile {
    fn drop(&mut self) {
        // In a forked child the fork handler has closed the descriptor and emptied the
        // entry already (and the number may have been reused since): leave it alone.
        if self.opened_in == generation()
            && LOCK_FDS[self.entry]
                .compare_exchange(self.fd as u32 + 1, 0, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            // SAFETY: the entry was ours, so the descriptor is open and owned by us.
            unsafe { libc::close(self.fd) };
        }
    }
}

#[cfg(all(test, not(miri)))]
mod tests {
    use super::*;

    /// A file of this test's own (tests run in parallel threads of one process, and
    /// locks of one file would meet).
    fn temp(test: &str) -> (File, std::path::PathBuf) {
        let p = std::env::temp_dir().join(format!("shmstore-lock-{}-{test}", std::process::id()));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&p)
            .unwrap();
        (f, p)
    }

    #[test]
    fn two_descriptions_exclude_each_other_and_see_each_other() {
        let (f, p) = temp("exclude");
        let a = LockFile::open(&f, Some(&p)).unwrap();
        let b = LockFile::open(&f, Some(&p)).unwrap();
        assert!(!a.locked_elsewhere(7));
        assert!(a.try_lock(7));
        assert!(a.try_lock(7), "relocking one's own byte succeeds");
        assert!(!a.locked_elsewhere(7), "one's own lock does not count");
        assert!(b.locked_elsewhere(7));
        assert!(!b.try_lock(7));
        assert!(b.try_lock(8));
        a.unlock(7);
        assert!(!b.locked_elsewhere(7));
        drop(b);
        assert!(
            !a.locked_elsewhere(8),
            "closing the description drops its locks"
        );
        let _ = std::fs::remove_file(p);
    }

    /// A removal's whole-file read lock is what `removal_in_progress` reports, asked
    /// through a description that holds no lock; a client's slot lock is not a removal.
    #[test]
    fn a_removals_lock_is_seen_as_one_and_a_slot_lock_is_not() {
        let (f, p) = temp("removal");
        let client = LockFile::open(&f, Some(&p)).unwrap();
        assert!(!removal_in_progress(&f));
        assert!(client.try_lock(3));
        assert!(!removal_in_progress(&f), "a slot's lock");
        let remover = LockFile::open_for_removal(&f, Some(&p)).unwrap();
        assert!(!remover.try_lock_all_shared(), "the slot is locked");
        client.unlock(3);
        assert!(remover.try_lock_all_shared());
        assert!(removal_in_progress(&f));
        assert!(
            !client.try_lock(3),
            "no slot while a removal holds the file"
        );
        drop(remover);
        assert!(!removal_in_progress(&f));
        assert!(client.try_lock(3));
        let _ = std::fs::remove_file(p);
    }

    /// Dropping a lock description gives its entry in the fork handler's table back: a
    /// process attaches and detaches far more stores over its life than it can hold at
    /// once.
    #[test]
    fn a_dropped_description_gives_its_table_entry_back() {
        let (f, p) = temp("entries");
        for i in 0..MAX_LOCK_FDS + 100 {
            let l = LockFile::open(&f, Some(&p)).unwrap_or_else(|e| panic!("open {i}: {e}"));
            drop(l);
        }
        let _ = std::fs::remove_file(p);
    }
}
