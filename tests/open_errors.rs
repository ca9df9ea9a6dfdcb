//! Opening files that are not healthy stores gives typed errors, never a crash.

mod common;

use common::{unique_name, Cleanup};
use shmstore::{Error, ObjectId, Store, StoreConfig};
use std::io::{Seek, SeekFrom, Write};
use std::path::PathBuf;

fn write_file(tag: &str, bytes: &[u8]) -> Cleanup {
    let path = PathBuf::from("/dev/shm").join(unique_name(tag));
    std::fs::write(&path, bytes).unwrap();
    Cleanup(path)
}

fn healthy(tag: &str) -> (Store, Cleanup) {
    let s = Store::create(&unique_name(tag), &StoreConfig::with_capacity(1 << 20)).unwrap();
    let p = s.path().unwrap().to_path_buf();
    (s, Cleanup(p))
}

#[test]
fn garbage_is_not_a_store() {
    let f = write_file("garbage", &[0x5a; 8192]);
    assert!(matches!(
        Store::open_path(&f.0),
        Err(Error::NotAStore { .. })
    ));
    let f = write_file("empty", &[]);
    assert!(matches!(
        Store::open_path(&f.0),
        Err(Error::Truncated { actual: 0, .. })
    ));
}

#[test]
fn truncated_store_is_truncated() {
    let (s, c) = healthy("trunc");
    let full = std::fs::metadata(&c.0).unwrap().len();
    drop(s);
    let f = std::fs::OpenOptions::new().write(true).open(&c.0).unwrap();
    f.set_len(full / 2).unwrap();
    match Store::open_path(&c.0) {
        Err(Error::Truncated {
            expected, actual, ..
        }) => {
            assert_eq!((expected, actual), (full, full / 2));
        }
        other => panic!("{other:?}"),
    }
    f.set_len(100).unwrap();
    assert!(matches!(
        Store::open_path(&c.0),
        Err(Error::Truncated { actual: 100, .. })
    ));
}

#[test]
fn wrong_version_is_version_mismatch() {
    let (s, c) = healthy("version");
    drop(s);
    let mut f = std::fs::OpenOptions::new().write(true).open(&c.0).unwrap();
    f.seek(SeekFrom::Start(8)).unwrap();
    f.write_all(&99u32.to_le_bytes()).unwrap();
    match Store::open_path(&c.0) {
        Err(
            e @ Error::VersionMismatch {
                found: 99,
                supported: 7,
                ..
            },
        ) => {
            assert!(e.to_string().contains("same shmstore version"), "{e}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn scribbled_superblock_is_corrupted() {
    let (s, c) = healthy("scribble");
    drop(s);
    for offset in [24u64, 64, 120, 200] {
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&c.0)
            .unwrap();
        f.seek(SeekFrom::Start(offset)).unwrap();
        f.write_all(&[0xff; 4]).unwrap();
        assert!(
            matches!(Store::open_path(&c.0), Err(Error::Corrupted { .. })),
            "offset {offset}"
        );
    }
}

#[test]
fn missing_and_existing_names() {
    assert!(matches!(
        Store::open(&unique_name("missing")),
        Err(Error::StoreNotFound { .. })
    ));
    let (s, _c) = healthy("exists");
    let name = s
        .path()
        .unwrap()
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .to_owned();
    assert!(matches!(
        Store::create(&name, &StoreConfig::with_capacity(1 << 20)),
        Err(Error::StoreExists { .. })
    ));
    assert!(matches!(
        Store::create("a/b", &StoreConfig::with_capacity(1 << 20)),
        Err(Error::InvalidConfig { .. })
    ));
}

/// A store's name is 1-200 characters, has no '/', and does not start with '.' (the names
/// stores are built under do): each rule on its own.
#[test]
fn store_names_follow_each_rule() {
    let cfg = StoreConfig::with_capacity(1 << 20);
    let tag = format!("{}", std::process::id());
    let longest = format!("{tag}-{}", "n".repeat(200 - tag.len() - 1));
    for bad in [
        String::new(),
        format!("{longest}n"),
        format!("{tag}/x"),
        format!(".{tag}"),
    ] {
        match Store::create(&bad, &cfg) {
            Err(e @ Error::InvalidConfig { .. }) => {
                assert!(e.to_string().contains("1-200 characters"), "{e}")
            }
            other => panic!("{bad:?}: {other:?}"),
        }
    }
    for good in [longest, format!("{tag}.with.dots.")] {
        let s = Store::create(&good, &cfg).unwrap();
        let _c = Cleanup(s.path().unwrap().to_path_buf());
        assert!(s.path().unwrap().ends_with(&good));
    }
}

/// Opening something that exists but cannot be opened as a store file (a directory) is
/// an I/O error that says what failed, not "no such store".
#[test]
fn a_directory_is_not_a_missing_store() {
    let dir = PathBuf::from("/dev/shm").join(unique_name("dir"));
    std::fs::create_dir(&dir).unwrap();
    let result = Store::open_path(&dir);
    std::fs::remove_dir(&dir).unwrap();
    match result {
        Err(e @ Error::Io { op: "open", .. }) => {
            assert!(e.to_string().contains("Is a directory"), "{e}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn undersized_filesystem_fails_at_create_with_the_numbers() {
    // A directory whose file system cannot hold the store: ask for more than /dev/shm has.
    let free = {
        let (s, _c) = healthy("probe");
        drop(s);
        let out = std::process::Command::new("df")
            .args(["-B1", "--output=avail", "/dev/shm"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .nth(1)
            .unwrap()
            .trim()
            .parse::<u64>()
            .unwrap()
    };
    let cfg = StoreConfig::with_capacity(free + (1 << 30));
    let name = unique_name("huge");
    match Store::create(&name, &cfg) {
        Err(
            ref e @ Error::InsufficientSpace {
                ref path,
                needed,
                available,
            },
        ) => {
            let m = e.to_string();
            assert!(m.contains("--shm-size"), "{m}");
            assert_eq!(path, &PathBuf::from("/dev/shm").join(&name));
            assert!(needed >= free + (1 << 30), "needed {needed}, free {free}");
            // Refused before reserving anything: the free space it reports is what df
            // said (other tests of this binary hold stores of 1 MiB meanwhile), not what
            // is left after filling /dev/shm up to the refusal.
            assert!(
                available.abs_diff(free) < 64 << 20,
                "available {available}, df said {free}"
            );
        }
        other => panic!("{other:?}"),
    }
    let left: Vec<_> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().contains(&name))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn file_mode_defaults_to_owner_only() {
    use std::os::unix::fs::PermissionsExt;
    let (_s, c) = healthy("mode");
    let mode = std::fs::metadata(&c.0).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
}

#[test]
fn scribbled_table_entry_is_an_error_not_ub() {
    let (s, c) = healthy("entry");
    let id = ObjectId::of_key("victim");
    s.put(&id, &[1; 1000]).unwrap();
    // Overwrite every table slot's offset field with a huge value (slots are 64-byte lines
    // holding ctl, id[4], offset, len, info); find the victim's line by its id bytes.
    let mut raw = std::fs::read(&c.0).unwrap();
    let needle = id.as_bytes();
    let at = raw
        .windows(32)
        .position(|w| w == needle)
        .expect("id in file");
    raw[at + 32..at + 40].copy_from_slice(&u64::MAX.to_le_bytes());
    let mut f = std::fs::OpenOptions::new().write(true).open(&c.0).unwrap();
    f.seek(SeekFrom::Start(at as u64 + 32)).unwrap();
    f.write_all(&u64::MAX.to_le_bytes()).unwrap();
    drop(f);
    assert!(matches!(s.try_get(&id), Err(Error::Corrupted { .. })));
    assert!(matches!(s.delete(&id), Err(Error::Corrupted { .. })));
}

#[test]
fn extreme_settings_are_errors_or_work_never_panics() {
    // A table too large to lay out is a configuration error, not an overflow.
    let huge = StoreConfig {
        max_objects: u64::MAX,
        ..StoreConfig::with_capacity(1 << 20)
    };
    assert!(matches!(
        Store::create_anonymous(&huge),
        Err(Error::InvalidConfig { .. })
    ));
    // A spin longer than any deadline just spins until the deadline.
    let cfg = StoreConfig {
        get_spin: std::time::Duration::MAX,
        ..StoreConfig::with_capacity(1 << 20)
    };
    let s = Store::create_anonymous(&cfg).unwrap();
    let id = ObjectId::of_key("absent");
    assert!(matches!(
        s.get(&id, std::time::Duration::from_millis(5)),
        Err(Error::Timeout { .. })
    ));
    // An endless timeout with the object already there returns at once.
    s.put(&id, b"here").unwrap();
    assert_eq!(&*s.get(&id, std::time::Duration::MAX).unwrap(), b"here");
}

/// The `hostile_region` fuzz target scribbles over a store the harness has filled, then
/// runs every operation on it. Without scribbles the harness must do what it says: a
/// store mostly full of page runs, whose large puts then meet `Full` (and evict, on the
/// evicting store), and which comes out sound.
#[test]
fn the_scribble_harness_fills_its_store_before_it_scribbles() {
    let figures = shmstore::testing::scribble_and_exercise(&[]);
    let ((failing, failing_sound), (evicting, evicting_sound)) = (&figures[0], &figures[1]);
    assert!(failing.full_events > 0, "{failing:?}");
    assert!(evicting.evictions > 0, "{evicting:?}");
    assert!(failing_sound.is_ok(), "{failing_sound:?}");
    assert!(evicting_sound.is_ok(), "{evicting_sound:?}");
    // Scribbles over the table and the allocator's words: errors or work, never a crash.
    for (at, byte) in [(4096u32, 0xffu8), (8192, 0x01), (12_288, 0x80), (300, 0x7f)] {
        let _ = shmstore::testing::scribble_and_exercise(&[(at, vec![byte; 64])]);
    }
}
