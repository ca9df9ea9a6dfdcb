//! A store's life: creating one (named or anonymous), attaching to one, removing its
//! name, and the handles on its mapping (path, descriptor, heap, prefault).
//!
//! Invariants: a named store's name appears only once its superblock is written and a
//! lock shows it in use (its creator's, until the creator holds its slot's); the
//! superblock read from a file is validated before anything else of the file is used
//! ([`crate::layout`]); `remove_if_unused` removes only files with the store magic that
//! no live process has locked.

use super::*;
use crate::HugePages;

/// Whether a removal of the store held its lock on `file`; if so, returns once it has let
/// go (it holds the lock only while it unlinks the name), or after [`REMOVAL_WAIT`] at
/// most (a remover stopped mid-way, say): the caller then opens the name again.
fn waited_out_removal(file: &std::fs::File) -> bool {
    if !crate::liveness::removal_in_progress(file) {
        return false;
    }
    let deadline = std::time::Instant::now() + REMOVAL_WAIT;
    while crate::liveness::removal_in_progress(file) && std::time::Instant::now() < deadline {
        std::thread::yield_now();
    }
    true
}

/// How long [`Store::open_path`] waits at most for a removal's lock to go.
const REMOVAL_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// How many times [`Store::open_path`] opens a name whose store was removed while it
/// attached, before it gives up (a name removed and re-created that often is not a store
/// anyone can use).
const OPEN_TRIES: u32 = 3;

impl Store {
    /// Creates a named store `dir/name` (default dir `/dev/shm`) and attaches to it.
    ///
    /// Fails with [`Error::StoreExists`] if the name is taken, with
    /// [`Error::InsufficientSpace`] if the file system cannot hold it, and with
    /// [`Error::MemoryLimit`] if the memory limit of this process's cgroup (a container's)
    /// has no room for it.
    ///
    /// ```
    /// use shmstore::{Store, StoreConfig};
    /// let name = format!("doc-create-{}", std::process::id());
    /// let store = Store::create(&name, &StoreConfig::with_capacity(1 << 20))?;
    /// assert!(store.path().unwrap().ends_with(&name));
    /// store.unlink()?;
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn create(name: &str, cfg: &StoreConfig) -> Result<Store> {
        let sb = Self::superblock_for(cfg)?;
        let (map, creating) = Mapping::create_named(
            &cfg.dir,
            name,
            &sb,
            cfg.mode,
            cfg.huge_pages,
            cfg.prefault,
            cfg.progress,
        )?;
        let store = Self::attach_created(map, sb, cfg);
        drop(creating); // we hold our slot's lock now (or failed, and the name goes)
        store
    }

    /// Creates an anonymous store in a memfd. Share it with [`Store::fd`] (a child opens
    /// `/proc/<pid>/fd/<fd>` with [`Store::open_path`], or receives the descriptor).
    /// Fails with [`Error::MemoryLimit`] if the memory limit of this process's cgroup has
    /// no room for it.
    ///
    /// ```
    /// let store = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(1 << 20))?;
    /// assert!(store.path().is_none());
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn create_anonymous(cfg: &StoreConfig) -> Result<Store> {
        let sb = Self::superblock_for(cfg)?;
        let map = Mapping::create_memfd(&sb, cfg.huge_pages, cfg.prefault, cfg.progress)?;
        Self::attach_created(map, sb, cfg)
    }

    /// The creator attaches, and starts populating the heap in the background.
    fn attach_created(map: Mapping, sb: Superblock, cfg: &StoreConfig) -> Result<Store> {
        let store = Self::attach(map, sb, &cfg.attach_options())?;
        if cfg.huge_pages != HugePages::Off && cfg.huge_pages != HugePages::Hugetlb {
            store.inner.rebuild_as_huge_pages();
        }
        if cfg.prefault {
            store.inner.collapse_rest();
        } else if cfg.populate_in_background {
            store.inner.populate_in_background(true);
        }
        Ok(store)
    }

    /// Opens the named store `/dev/shm/name`.
    ///
    /// ```no_run
    /// let store = shmstore::Store::open("vllm-mm-cache")?;
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn open(name: &str) -> Result<Store> {
        Self::open_path(Path::new("/dev/shm").join(name))
    }

    /// Opens a store by path (a named store in any directory, or `/proc/PID/fd/N`).
    ///
    /// ```
    /// use shmstore::{Store, StoreConfig};
    /// let name = format!("doc-open-{}", std::process::id());
    /// let a = Store::create(&name, &StoreConfig::with_capacity(1 << 20))?;
    /// let b = Store::open_path(a.path().unwrap())?;
    /// assert_eq!(b.stats().capacity, a.stats().capacity);
    /// a.unlink()?;
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn open_path(path: impl AsRef<Path>) -> Result<Store> {
        Self::open_with(path, &AttachOptions::default())
    }

    /// [`open_path`](Self::open_path) with explicit attach options.
    ///
    /// ```no_run
    /// let opts = shmstore::AttachOptions { prefault: false, ..Default::default() };
    /// let store = shmstore::Store::open_with("/dev/shm/big", &opts)?;
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn open_with(path: impl AsRef<Path>, opts: &AttachOptions) -> Result<Store> {
        Self::open_attaching(path.as_ref(), opts, &mut || {})
    }

    /// [`open_with`](Self::open_with), running `before_attach` on the first try once the
    /// file is mapped and checked, before a client slot is claimed (a test hook).
    ///
    /// The store's name may be removed while we attach, by [`remove_if_unused`] or by the
    /// last process of a `remove_when_unused` store leaving. Removal holds a lock that
    /// every slot's lock conflicts with (`liveness`, "Removing a store's name"), so once
    /// our slot is locked the name is either still the file's, and stays so while we are
    /// attached, or already gone: then the attachment is dropped and the name opened
    /// again, which finds a store created there since, or none (`StoreNotFound`). If no
    /// slot could be locked because a removal held its lock, the name is opened again
    /// once it lets go.
    /// Attaching to the removed file would leave this process alone with it, while every
    /// process after it made a new store under the name.
    ///
    /// [`remove_if_unused`]: Self::remove_if_unused
    pub(crate) fn open_attaching(
        path: &Path,
        opts: &AttachOptions,
        before_attach: &mut dyn FnMut(),
    ) -> Result<Store> {
        let mut tries = 0;
        loop {
            tries += 1;
            let (map, sb) = Mapping::open(path, opts.huge_pages, opts.prefault)?;
            if tries == 1 {
                before_attach();
            }
            // The same description as the mapping's, which holds no lock.
            let probe = map.file().try_clone().ok();
            let attached = Self::attach(map, sb, opts);
            let still_named = match (&attached, probe) {
                (Ok(store), _) => store.inner.map.same_file_as(path),
                // Every slot's lock failed: maybe while a removal held its lock, which
                // may be gone by now, with the name.
                (Err(Error::TooManyClients { .. }), Some(file)) => {
                    !waited_out_removal(&file) && crate::region::same_file(&file, path)
                }
                _ => true,
            };
            if still_named || tries == OPEN_TRIES {
                let store = attached?;
                if !still_named {
                    // Removed under us each time: the name holds no store for us.
                    return Err(Error::StoreNotFound {
                        path: path.to_path_buf(),
                    });
                }
                if opts.populate_in_background && !opts.prefault {
                    store.inner.populate_in_background(false);
                }
                return Ok(store);
            }
            // A store whose name is gone: leave it (its drop removes nothing, the name
            // no longer being its file's) and open the name again.
        }
    }

    /// Removes the store at `path` if no live process is attached to it, whatever version
    /// of shmstore made it: the cleanup for stores left by programs that crashed, and for
    /// stores of an older layout after an upgrade (which [`open_path`](Self::open_path)
    /// refuses with [`Error::VersionMismatch`]). Returns `true` if it removed the name,
    /// `false` if a live process is attached (the store is left alone).
    ///
    /// Every attached process holds a lock on one byte of the file (its client slot's),
    /// which the kernel drops when the process dies, and a creator holds one from before
    /// the name appears until it is attached; this takes a read lock on the whole file,
    /// which fails if any byte is locked, and removes the name while holding it. So it
    /// attaches to nothing and reads only the first 12 bytes, and a process opening the
    /// store at that moment either keeps it from being removed or opens the name again
    /// once it is gone (see [`open_path`](Self::open_path)). A file that is not a store
    /// gives [`Error::NotAStore`] and is left alone, as are stores of layout version 1
    /// (which took no locks: `false`), and a name that another file took meanwhile.
    ///
    /// ```
    /// use shmstore::{Store, StoreConfig};
    /// let s = Store::create(&format!("doc-stale-{}", std::process::id()), &StoreConfig::with_capacity(1 << 20))?;
    /// let path = s.path().unwrap().to_path_buf();
    /// assert!(!Store::remove_if_unused(&path)?); // we are attached
    /// drop(s);
    /// assert!(Store::remove_if_unused(&path)?);
    /// assert!(!path.exists());
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn remove_if_unused(path: impl AsRef<Path>) -> Result<bool> {
        let path = path.as_ref();
        let io = |op: &'static str| {
            move |source| Error::Io {
                op,
                path: path.to_path_buf(),
                source,
            }
        };
        let file = std::fs::File::open(path).map_err(io("open"))?;
        let mut head = [0u8; 12];
        let n = std::os::unix::fs::FileExt::read_at(&file, &mut head, 0).map_err(io("read"))?;
        if n < head.len() || head[..8] != crate::layout::MAGIC {
            return Err(Error::NotAStore {
                path: path.to_path_buf(),
            });
        }
        let version = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes"));
        if version < 2 {
            return Ok(false);
        }
        // Held until the name is gone: see `liveness`, "Removing a store's name".
        let lock = crate::liveness::LockFile::open_for_removal(&file, Some(path))?;
        if !lock.try_lock_all_shared() || !crate::region::same_file(&file, path) {
            return Ok(false);
        }
        std::fs::remove_file(path).map_err(io("unlink"))?;
        Ok(true)
    }

    /// Removes the store's name; attached processes keep working, and the memory is
    /// returned when the last one detaches. No-op for anonymous stores, and for a name
    /// that another store has taken since this one's was removed (that store is left
    /// alone).
    ///
    /// ```
    /// use shmstore::{Store, StoreConfig};
    /// let s = Store::create(&format!("doc-unlink-{}", std::process::id()), &StoreConfig::with_capacity(1 << 20))?;
    /// s.unlink()?;
    /// assert!(!s.path().unwrap().exists());
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn unlink(&self) -> Result<()> {
        match self.inner.map.path() {
            Some(p) if p.exists() && !self.inner.map.same_file_as(p) => Ok(()),
            Some(p) => std::fs::remove_file(p).map_err(|source| Error::Io {
                op: "unlink",
                path: p.to_path_buf(),
                source,
            }),
            None => Ok(()),
        }
    }

    /// Test hook (see `testing::claim_slot_and_stop`).
    pub(crate) fn claim_slot_and_stop(path: &Path, take_dead: bool) -> Result<u64> {
        let (map, sb) = Mapping::open(path, Default::default(), false)?;
        Inner::claim_and_stop(map, sb, take_dead)
    }

    /// See [`crate::testing::build_store_and_stop`].
    pub(crate) fn build_and_stop(
        dir: &Path,
        name: &str,
        capacity: u64,
    ) -> Result<std::path::PathBuf> {
        let cfg = StoreConfig {
            dir: dir.to_path_buf(),
            ..StoreConfig::with_capacity(capacity)
        };
        let sb = Self::superblock_for(&cfg)?;
        let (map, creating, tmp) =
            Mapping::build_named(dir, name, &sb, cfg.mode, HugePages::Off, false, false)?;
        // Held until the process is killed, as a creator stopped there holds them.
        std::mem::forget((map, creating));
        Ok(tmp)
    }

    fn superblock_for(cfg: &StoreConfig) -> Result<Superblock> {
        let mut sb = cfg.params().layout()?;
        if cfg.when_full == WhenFull::Evict {
            sb.flags |= FLAG_EVICT;
        }
        if cfg.remove_when_unused {
            sb.flags |= FLAG_REMOVE_WHEN_UNUSED;
        }
        sb.created_unix_ns = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        sb.checksum = sb.compute_checksum();
        Ok(sb)
    }

    fn attach(map: Mapping, sb: Superblock, opts: &AttachOptions) -> Result<Store> {
        Ok(Store {
            inner: Inner::attach(map, sb, opts)?,
        })
    }

    /// The backing file, if the store is named.
    ///
    /// ```
    /// let s = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(1 << 20))?;
    /// assert_eq!(s.path(), None);
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn path(&self) -> Option<&Path> {
        self.inner.map.path()
    }

    /// The backing file descriptor (to hand an anonymous store to another process).
    ///
    /// ```
    /// use std::os::fd::AsRawFd;
    /// let s = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(1 << 20))?;
    /// let other = shmstore::Store::open_path(format!("/proc/self/fd/{}", s.fd().as_raw_fd()))?;
    /// assert_eq!(other.stats().clients, 2);
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.inner.map.file().as_fd()
    }

    /// Where this process maps the store's payload heap: `(address, length)`. For
    /// registering the memory with a device driver (CUDA's `cudaHostRegister`, so that
    /// copies from views to a GPU run as direct DMA); the range stays mapped while any
    /// handle of this store lives. In a read-only attach it is mapped read-only.
    /// Registering pins every page, and the kernel cannot rebuild a pinned page as a
    /// 2 MiB page ([`HugePages::Auto`]): register once
    /// [`Stats::huge_page_bytes`](crate::Stats::huge_page_bytes) stops growing (the
    /// creator's [`Store::prefault`] finishes the rebuild at once).
    ///
    /// ```
    /// let s = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(1 << 20))?;
    /// let (addr, len) = s.heap_region();
    /// assert_eq!((addr as usize % 4096, len), (0, 1 << 20));
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn heap_region(&self) -> (*const u8, usize) {
        self.inner.heap_region()
    }

    /// Populates this process's page tables for the whole store now (what
    /// [`AttachOptions::prefault`] does at attach), so that later first writes into fresh
    /// blocks take no page faults. Blocks the calling thread for as long as that takes
    /// (about 0.1-1 s per GiB); run it on a background thread to keep attach instant.
    ///
    /// The background population that create and open may start
    /// ([`StoreConfig::populate_in_background`]) is stopped first, since this does its
    /// work: when `prefault` returns, no thread is left working for this store in this
    /// process. In the creator of a [`HugePages::Auto`] store it also finishes rebuilding
    /// the heap as 2 MiB pages. In a read-only attach it maps the payload for reading.
    ///
    /// ```
    /// let s = shmstore::Store::create_anonymous(&shmstore::StoreConfig { prefault: false, ..shmstore::StoreConfig::with_capacity(1 << 20) })?;
    /// s.prefault();
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn prefault(&self) {
        self.inner.stop_populating();
        self.inner.populate_everything()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::RemovedAtEnd;

    /// The creator attaches with its config's settings: its spin before a get sleeps, and
    /// a prefaulted store known to be populated here (no chunk is populated again).
    #[test]
    fn the_creator_attaches_as_its_config_says() {
        use crate::sync::Ordering;
        let spin = std::time::Duration::from_micros(123);
        for prefault in [true, false] {
            let cfg = StoreConfig {
                get_spin: spin,
                prefault,
                populate_in_background: false,
                huge_pages: HugePages::Off,
                ..StoreConfig::with_capacity(16 << 20)
            };
            let s = Store::create_anonymous(&cfg).unwrap();
            assert_eq!(s.inner.get_spin, spin);
            assert!(!s.inner.read_only);
            let populated = &s.inner.populated;
            let want = if prefault { u64::MAX } else { 0 };
            assert!(populated.iter().all(|w| w.load(Ordering::Relaxed) == want));
        }
    }

    /// A view gives the object's bytes (as a slice, through `as_ref` and its pointer) and
    /// its metadata, each exactly as put, and debug-prints its id and length.
    #[test]
    fn a_view_gives_the_bytes_and_metadata_as_put() {
        let s = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20)).unwrap();
        let id = crate::ObjectId::of_key("seen");
        s.put_with_meta(&id, b"payload bytes", b"{\"fps\": 30}")
            .unwrap();
        let v = s.try_get(&id).unwrap();
        assert_eq!(&v[..], b"payload bytes");
        assert_eq!(v.as_ref(), b"payload bytes");
        assert_eq!(v.meta(), b"{\"fps\": 30}");
        assert_eq!(v.as_ptr(), v[..].as_ptr());
        assert!(!v.as_ptr().is_null());
        assert_eq!(format!("{v:?}"), format!("View {{ id: {id:?}, len: 13 }}"));
    }

    /// A creation shows its id and length when debug-printed (as in a failed assert).
    #[test]
    fn a_creation_debug_prints_its_id_and_length() {
        let s = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20)).unwrap();
        let id = crate::ObjectId::of_key("shown");
        let c = s.create_object(&id, 321).unwrap();
        assert_eq!(
            format!("{c:?}"),
            format!("Creation {{ id: {id:?}, len: 321 }}")
        );
    }

    #[test]
    fn a_pause_of_the_background_thread_ends_when_it_is_told_to_stop() {
        use crate::sync::{AtomicU32, Ordering};
        use std::sync::Arc;
        use std::time::{Duration, Instant};
        let flag = Arc::new(AtomicU32::new(0));
        let f = flag.clone();
        let t = Instant::now();
        let pausing = std::thread::spawn(move || {
            super::super::attachment::pause_unless_stopped(Duration::from_secs(60), &|| {
                f.load(Ordering::Relaxed) != 0
            })
        });
        flag.store(1, Ordering::Relaxed);
        assert!(!pausing.join().unwrap(), "a stopped pause says so");
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "it waited out {:?}",
            t.elapsed()
        );
        let t = Instant::now();
        assert!(super::super::attachment::pause_unless_stopped(
            Duration::from_millis(30),
            &|| false
        ));
        assert!(
            t.elapsed() >= Duration::from_millis(30),
            "a pause nobody stops lasts its length: {:?}",
            t.elapsed()
        );
    }

    /// The creator populates the heap's first 33 chunks of 2 MiB (a 64 MiB object and
    /// its header) before `create` returns, and no more: the rest is the background
    /// thread's.
    /// An anonymous store of 96 MiB on small pages, not prefaulted, populated in the
    /// background or not.
    fn store_of_96_mib(populate_in_background: bool) -> Store {
        let cfg = StoreConfig {
            prefault: false,
            populate_in_background,
            huge_pages: HugePages::Off,
            ..StoreConfig::with_capacity(96 << 20)
        };
        Store::create_anonymous(&cfg).unwrap()
    }

    #[test]
    fn the_creator_populates_the_head_of_the_heap_and_no_more() {
        let s = store_of_96_mib(false);
        let chunks = (96 << 20) / attachment::POPULATE_CHUNK;
        assert!((0..chunks).all(|c| !s.inner.chunk_populated(c)));
        let (heap, _) = s.inner.heap_region();
        let before = resident_kib_at(heap as usize);
        s.inner.populate_head();
        for c in 0..chunks {
            assert_eq!(s.inner.chunk_populated(c), c < 33, "chunk {c}");
        }
        let added = resident_kib_at(heap as usize) - before;
        assert!(
            (66 << 10..96 << 10).contains(&added),
            "{added} KiB populated"
        );
    }

    /// The background population goes through the whole heap past the head, and ends.
    #[test]
    fn the_background_population_reaches_the_end_of_the_heap() {
        use std::time::{Duration, Instant};
        let s = store_of_96_mib(true);
        let deadline = Instant::now() + Duration::from_secs(60);
        while !s.inner.population_finished() {
            assert!(Instant::now() < deadline, "the population never ended");
            // A poll for the thread's end (no event marks it), not a race papered over.
            std::thread::sleep(Duration::from_millis(1));
        }
        let chunks = (96 << 20) / attachment::POPULATE_CHUNK;
        assert!((0..chunks).all(|c| s.inner.chunk_populated(c)));
        let (heap, _) = s.inner.heap_region();
        assert!(resident_kib_at(heap as usize) >= 96 << 10);
    }

    /// A client slot is held by an OFD lock on the first byte of its client header, which
    /// any process can probe (`shmstore stat`, the removal check).
    #[test]
    fn a_client_slot_is_held_by_a_lock_on_the_first_byte_of_its_header() {
        let (creator, _removed) = unpopulated_store("slot-lock-byte");
        let other = Store::open_path(creator.path().unwrap()).unwrap();
        let inner = &creator.inner;
        let probe = crate::liveness::LockFile::open(inner.map.file(), inner.map.path()).unwrap();
        let sb = &inner.sb;
        for i in 0..sb.max_clients {
            let header = sb.clients_offset + i * sb.client_stride;
            assert_eq!(probe.locked_elsewhere(header), i < 2, "slot {i}");
        }
        drop(other);
    }

    #[test]
    fn prefault_stops_the_background_population_first() {
        let cfg = StoreConfig {
            prefault: false,
            populate_in_background: true,
            ..StoreConfig::with_capacity(64 << 20)
        };
        let s = Store::create_anonymous(&cfg).unwrap();
        assert!(
            s.inner.populating(),
            "create started a background population"
        );
        s.prefault();
        assert!(
            !s.inner.populating(),
            "prefault did its work: no thread is left"
        );
    }

    /// A named store of 16 MiB that nothing populates: not prefaulted, and no background
    /// population in its creator.
    fn unpopulated_store(tag: &str) -> (Store, RemovedAtEnd) {
        let cfg = StoreConfig {
            prefault: false,
            populate_in_background: false,
            ..StoreConfig::with_capacity(16 << 20)
        };
        let creator = Store::create(&format!("{tag}-{}", std::process::id()), &cfg).unwrap();
        let removed = RemovedAtEnd::of(&creator);
        (creator, removed)
    }

    /// An attach starts a background population only when asked to, and not when it
    /// prefaults (which populates everything at once).
    #[test]
    fn an_attach_populates_in_the_background_only_when_asked_and_not_prefaulting() {
        let (creator, _removed) = unpopulated_store("background-open");
        assert!(!creator.inner.populating());
        let path = creator.path().unwrap().to_path_buf();
        for (populate_in_background, prefault, want) in [
            (true, false, true),
            (false, false, false),
            (true, true, false),
        ] {
            let opts = AttachOptions {
                populate_in_background,
                prefault,
                ..Default::default()
            };
            let s = Store::open_with(&path, &opts).unwrap();
            assert_eq!(s.inner.populating(), want, "{opts:?}");
        }
    }

    /// Resident KiB of the mapping (VMA) of this process that holds `addr`.
    fn resident_kib_at(addr: usize) -> u64 {
        smaps_kib_at(addr, "Rss:")
    }

    /// A KiB field of /proc/self/smaps (`Rss:`, `ShmemPmdMapped:`) for the mapping (VMA)
    /// of this process that holds `addr`.
    fn smaps_kib_at(addr: usize, field: &str) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            let first = line.split(' ').next().unwrap_or("");
            if let Some((a, b)) = first.split_once('-') {
                if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
                {
                    inside = a <= addr && addr < b;
                    continue;
                }
            }
            if let Some(v) = line.strip_prefix(field).filter(|_| inside) {
                return v.trim().trim_end_matches("kB").trim().parse().unwrap();
            }
        }
        panic!("no mapping holds {addr:#x}");
    }

    #[test]
    fn prefault_maps_a_read_only_attach_for_reading() {
        let (creator, _removed) = unpopulated_store("prefault-ro");
        let opts = AttachOptions {
            read_only: true,
            ..AttachOptions::default()
        };
        let reader = Store::open_with(creator.path().unwrap(), &opts).unwrap();
        let (heap, len) = reader.heap_region();
        let heap_kib = len as u64 >> 10;
        assert!(
            resident_kib_at(heap as usize) < heap_kib / 4,
            "nothing mapped yet"
        );
        reader.prefault();
        let mapped = resident_kib_at(heap as usize);
        creator.unlink().unwrap();
        assert!(
            mapped >= heap_kib * 9 / 10,
            "{mapped} of {heap_kib} KiB of the heap mapped"
        );
    }

    /// Whether this kernel lets an unprivileged process rebuild tmpfs pages as 2 MiB pages
    /// (`MADV_COLLAPSE` on shmem: Linux 6.1 and later, unless `shmem_enabled` is `deny`).
    fn kernel_rebuilds_shmem_pages() -> std::result::Result<(), String> {
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let release = release.trim();
        let mut v = release
            .split(|c: char| !c.is_ascii_digit())
            .map(|n| n.parse::<u32>().unwrap_or(0));
        let (major, minor) = (v.next().unwrap_or(0), v.next().unwrap_or(0));
        if (major, minor) < (6, 1) {
            return Err(format!(
                "kernel {release} is older than 6.1 (no MADV_COLLAPSE)"
            ));
        }
        let policy = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
            .unwrap_or_default();
        if policy.contains("[deny]") {
            return Err("shmem_enabled is deny".into());
        }
        Ok(())
    }

    #[test]
    fn the_creator_rebuilds_the_heap_as_2_mib_pages_and_a_new_attach_maps_them_so() {
        let name = format!("rebuild-huge-{}", std::process::id());
        let cfg = StoreConfig {
            prefault: false,
            populate_in_background: true,
            ..StoreConfig::with_capacity(64 << 20)
        };
        let creator = Store::create(&name, &cfg).unwrap();
        let _removed = RemovedAtEnd::of(&creator);
        let (heap, _) = creator.heap_region();
        assert_eq!(
            heap as usize % (2 << 20),
            0,
            "the heap starts on a 2 MiB boundary"
        );
        // Objects written while the background thread rebuilds pages keep their bytes.
        let pattern: Vec<u8> = (0..(12u32 << 20)).map(|i| (i % 251) as u8).collect();
        let ids: Vec<ObjectId> = (0..3u8)
            .map(|k| {
                let id = ObjectId::of_key([k]);
                creator.put(&id, &pattern).unwrap();
                id
            })
            .collect();
        creator.prefault(); // finishes the rebuild in this thread
        let st = creator.stats();
        let reader = Store::open_path(creator.path().unwrap()).unwrap();
        let (rheap, _) = reader.heap_region();
        assert_eq!(
            rheap as usize % (2 << 20),
            0,
            "every attach maps on a 2 MiB boundary"
        );
        for id in &ids {
            let v = reader.get(id, Duration::ZERO).unwrap();
            assert!(v[..] == pattern[..], "bytes survive the rebuild");
        }
        let pmd_kib = smaps_kib_at(rheap as usize, "ShmemPmdMapped:");
        creator.unlink().unwrap();
        if let Err(why) = kernel_rebuilds_shmem_pages() {
            eprintln!("skipped the 2 MiB checks: {why}");
            assert_eq!(st.huge_page_bytes, 0);
            return;
        }
        assert_eq!(
            st.huge_page_bytes,
            64 << 20,
            "the whole heap is on 2 MiB pages"
        );
        assert!(st.huge_pages);
        assert_eq!(st.page_size, 2 << 20);
        assert!(
            pmd_kib >= 36 << 10,
            "reading 36 MiB mapped {pmd_kib} KiB with 2 MiB entries"
        );
    }

    /// The first objects go to the bottom of the heap, and a process that reads them
    /// right after create (vLLM's workers, the first request) must find them on 2 MiB
    /// pages: create rebuilds the heap's first 66 MiB itself, before it returns, instead
    /// of leaving them to the background thread's last step.
    #[test]
    fn create_returns_with_the_bottom_of_the_heap_on_2_mib_pages() {
        let name = format!("rebuild-head-{}", std::process::id());
        let creator = Store::create(&name, &StoreConfig::with_capacity(256 << 20)).unwrap();
        let _removed = RemovedAtEnd::of(&creator);
        let right_after = creator.stats().huge_page_bytes;
        let id = ObjectId::of_key("first");
        let pattern: Vec<u8> = (0..(16u32 << 20)).map(|i| (i % 251) as u8).collect();
        creator.put(&id, &pattern).unwrap();
        let reader = Store::open_path(creator.path().unwrap()).unwrap();
        let (rheap, _) = reader.heap_region();
        let v = reader.get(&id, Duration::ZERO).unwrap();
        assert!(v[..] == pattern[..]);
        let pmd_kib = smaps_kib_at(rheap as usize, "ShmemPmdMapped:");
        drop(v);
        creator.unlink().unwrap();
        if let Err(why) = kernel_rebuilds_shmem_pages() {
            eprintln!("skipped the 2 MiB checks: {why}");
            return;
        }
        assert!(
            right_after >= super::super::attachment::FIRST_POPULATED,
            "create returned with {right_after} bytes of the heap on 2 MiB pages"
        );
        assert!(
            pmd_kib >= 14 << 10,
            "a new attach read a 16 MiB object right after create and mapped {pmd_kib} KiB \
             of it with 2 MiB entries"
        );
    }

    #[test]
    fn the_creator_rebuilds_the_object_table_as_2_mib_pages_too() {
        let cfg = StoreConfig {
            max_objects: 200_000,
            prefault: false,
            populate_in_background: true,
            ..StoreConfig::with_capacity(16 << 20)
        };
        let name = format!("rebuild-meta-{}", std::process::id());
        let creator = Store::create(&name, &cfg).unwrap();
        let _removed = RemovedAtEnd::of(&creator);
        let ids: Vec<ObjectId> = (0..50_000u32)
            .map(|k| ObjectId::of_key(k.to_le_bytes()))
            .collect();
        for id in &ids {
            creator.put(id, b"small").unwrap();
        }
        creator.prefault(); // finishes the rebuild, metadata included
        let reader = Store::open_path(creator.path().unwrap()).unwrap();
        let meta = reader.inner.sb.heap_offset as usize;
        assert!(
            meta >= 32 << 20,
            "{meta} bytes of metadata: the test needs more"
        );
        // Gets read random lines all over the table (buckets, slots, pin rows) and only
        // the heap's first chunk (the objects share a few slabs).
        for id in &ids {
            assert_eq!(&reader.get(id, Duration::ZERO).unwrap()[..], b"small");
        }
        let pmd_kib = smaps_kib_at(reader.inner.map.base() as usize, "ShmemPmdMapped:");
        creator.unlink().unwrap();
        if let Err(why) = kernel_rebuilds_shmem_pages() {
            eprintln!("skipped the 2 MiB checks: {why}");
            return;
        }
        assert!(
            pmd_kib >= 24 << 10,
            "gets mapped only {pmd_kib} KiB of the store ({} KiB of it metadata) with 2 MiB \
             entries",
            meta >> 10
        );
    }

    #[test]
    fn huge_pages_off_keeps_4_kib_pages() {
        let cfg = StoreConfig {
            huge_pages: HugePages::Off,
            prefault: false,
            populate_in_background: true,
            ..StoreConfig::with_capacity(16 << 20)
        };
        let s = Store::create_anonymous(&cfg).unwrap();
        s.prefault();
        let st = s.stats();
        assert_eq!(
            (st.huge_page_bytes, st.page_size, st.huge_pages),
            (0, 4096, false)
        );
    }
}
