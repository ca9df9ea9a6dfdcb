//! The temporary names a named store is built under, and the sweep of the ones whose
//! creator was killed before publishing the store. Invariant: a creator locks byte 0 of its
//! file before anything else and keeps a lock until its name is published, so a file with
//! a creation name that no process holds a lock on has no live creator (docs/design.md,
//! "The region", Create).

use crate::liveness::LockFile;
use std::fs::{File, OpenOptions};
use std::path::Path;

/// The end of the temporary name a store is built under before its name is published.
const CREATION_SUFFIX: &str = ".shmstore-creating";

/// The temporary name a store `name` is built under: `.NAME.PID.NONCE.shmstore-creating`
/// (hidden, and never a valid store name, which cannot start with '.').
pub(super) fn creation_name(name: &str, pid: u32, nonce: u128) -> String {
    format!(".{name}.{pid}.{nonce}{CREATION_SUFFIX}")
}

/// Whether `file_name` has the shape of [`creation_name`].
pub(super) fn is_creation_name(file_name: &str) -> bool {
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
pub(super) fn locked_and_linked(file: &File, creating: &LockFile) -> bool {
    use std::os::unix::fs::MetadataExt;
    creating.try_lock(0) && file.metadata().is_ok_and(|m| m.nlink() > 0)
}
