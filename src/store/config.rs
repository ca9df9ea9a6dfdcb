//! How a store is configured and what it reports: [`StoreConfig`], [`AttachOptions`],
//! [`Stats`], [`ObjectInfo`]. Plain values, no shared memory.

use crate::capacity::WhenFull;
use crate::layout::Params;
use crate::region::HugePages;
use crate::ObjectId;
use std::path::PathBuf;
use std::time::Duration;

/// How to create a store.
///
/// ```
/// use shmstore::StoreConfig;
/// let cfg = StoreConfig { max_objects: 1024, ..StoreConfig::with_capacity(64 << 20) };
/// assert_eq!(cfg.capacity, 64 << 20);
/// ```
#[derive(Clone, Debug)]
pub struct StoreConfig {
    /// Payload bytes (rounded up to a multiple of 64 KiB). Metadata comes on top.
    pub capacity: u64,
    /// Objects the table is sized for; 0 (the default) chooses one object per 32 KiB of
    /// capacity, at least 4096 ([`StoreConfig::objects_for`]). The table gets a power of
    /// two of slots, at least 3/2 as many as this (docs/design.md, "Table sizing"). Each
    /// slot costs 72 B plus 2 B per client slot.
    pub max_objects: u64,
    /// Processes that may be attached at once; 0 (the default) chooses 32 below 4 GiB of
    /// capacity and 64 from 4 GiB ([`StoreConfig::clients_for`]). Each costs one 16-bit
    /// pin counter per table slot (rows are padded to multiples of 32 clients).
    pub max_clients: u32,
    /// Directory for named stores.
    pub dir: PathBuf,
    /// File mode of a named store.
    pub mode: u32,
    /// Populate this process's page tables for the whole store at creation (seconds per
    /// tens of GiB). Off by default: every process populates what it touches, one object
    /// at a time, when it first creates or gets an object of 256 KiB or more (see
    /// docs/design.md, "Prefaulting").
    pub prefault: bool,
    /// Print a progress line on stderr while reserving the store's memory takes longer
    /// than a second (large stores).
    pub progress: bool,
    /// After creating the store, a background thread of the creating process touches
    /// every page of the heap once (the kernel zeroes a tmpfs page at its first touch, not
    /// at reservation, and this way puts do not pay for it): with [`HugePages::Auto`] it
    /// rebuilds each 2 MiB chunk as one 2 MiB page, then the metadata; chunks the kernel
    /// does not rebuild it populates in 4 KiB pages. The first 66 MiB of the heap, where
    /// the first objects go, are populated before `create` returns and rebuilt last. The
    /// thread stops when the store is dropped.
    pub populate_in_background: bool,
    /// Transparent huge pages.
    pub huge_pages: HugePages,
    /// How long a blocking get in this process spins before it sleeps on the futex.
    pub get_spin: Duration,
    /// Fail or evict when full (a property of the store, the same for every process).
    pub when_full: WhenFull,
    /// Remove the store's file when the last attached process detaches (or dies and is
    /// recovered by a process that then detaches). Off by default: a store normally
    /// outlives its processes until [`Store::unlink`](crate::Store::unlink) or `shmstore rm`.
    pub remove_when_unused: bool,
}

/// Default spin before a blocking get sleeps: long enough to catch a producer that is
/// about to seal, short enough to cost little CPU when it is not.
///
/// ```
/// use shmstore::{StoreConfig, DEFAULT_GET_SPIN};
/// assert_eq!(StoreConfig::default().get_spin, DEFAULT_GET_SPIN);
/// ```
pub const DEFAULT_GET_SPIN: Duration = Duration::from_micros(50);

/// Table slots per object of `max_objects`, as a fraction (at least; rounded up to a
/// power of two).
const SLOTS_PER_OBJECT: (u64, u64) = (3, 2);

/// How often a get blocked on an unsealed object checks that its creator still runs: a
/// creator killed mid-write is noticed within about this long (`Error::CreatorDied`).
///
/// ```
/// assert!(shmstore::CREATOR_CHECK_PERIOD <= std::time::Duration::from_millis(100));
/// ```
pub const CREATOR_CHECK_PERIOD: Duration = Duration::from_millis(20);

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            capacity: 256 << 20,
            max_objects: 0,
            max_clients: 0,
            dir: PathBuf::from("/dev/shm"),
            mode: 0o600,
            prefault: false,
            progress: true,
            populate_in_background: true,
            huge_pages: HugePages::Auto,
            get_spin: DEFAULT_GET_SPIN,
            when_full: WhenFull::Fail,
            remove_when_unused: false,
        }
    }
}

impl StoreConfig {
    /// The defaults with the given payload capacity.
    ///
    /// ```
    /// assert_eq!(shmstore::StoreConfig::with_capacity(1 << 30).capacity, 1 << 30);
    /// ```
    pub fn with_capacity(capacity: u64) -> Self {
        StoreConfig {
            capacity,
            ..Default::default()
        }
    }

    /// How the creator itself attaches.
    pub(super) fn attach_options(&self) -> AttachOptions {
        AttachOptions {
            prefault: self.prefault,
            populate_in_background: false, // the creator's is started by create
            huge_pages: self.huge_pages,
            get_spin: self.get_spin,
            read_only: false,
            recover_on_attach: false, // a new store has no dead clients
        }
    }

    /// The `max_objects` a store of `capacity` bytes gets by default: one object per
    /// 32 KiB, at least 4096 and at most 2^29. Multimodal items (images, audio, video
    /// frames) are 100 KiB to tens of MiB, so the bytes run out long before the table;
    /// a store of mostly smaller objects should set `max_objects` itself.
    ///
    /// ```
    /// use shmstore::StoreConfig;
    /// assert_eq!(StoreConfig::objects_for(4 << 30), 131_072);
    /// assert_eq!(StoreConfig::objects_for(1 << 20), 4096);
    /// ```
    pub fn objects_for(capacity: u64) -> u64 {
        (capacity / (32 << 10)).clamp(4096, 1 << 29)
    }

    /// The `max_clients` a store of `capacity` bytes gets by default: 32 below 4 GiB,
    /// 64 from 4 GiB (a large store is usually shared by more engines and workers).
    ///
    /// ```
    /// use shmstore::StoreConfig;
    /// assert_eq!((StoreConfig::clients_for(1 << 30), StoreConfig::clients_for(4 << 30)), (32, 64));
    /// ```
    pub fn clients_for(capacity: u64) -> u32 {
        if capacity < 4 << 30 {
            32
        } else {
            64
        }
    }

    pub(super) fn params(&self) -> Params {
        let slab = crate::layout::SLAB;
        let objects = match self.max_objects {
            0 => Self::objects_for(self.capacity),
            n => n,
        };
        let clients = match self.max_clients {
            0 => Self::clients_for(self.capacity),
            n => n,
        };
        // At most 2/3 of the slots hold objects at max_objects: a table turning over
        // objects refuses none below ~70% (docs/design.md, "Table sizing").
        // Saturating: an absurd `max_objects` becomes a table too large to lay out, which
        // `Params::check` reports as a configuration error (not an overflow panic).
        let slots = objects
            .max(16)
            .saturating_mul(SLOTS_PER_OBJECT.0)
            .div_ceil(SLOTS_PER_OBJECT.1)
            .checked_next_power_of_two()
            .unwrap_or(u64::MAX);
        Params {
            heap_size: self.capacity.div_ceil(slab).saturating_mul(slab),
            table_slots: slots,
            max_clients: clients as u64,
        }
    }
}

/// How to attach to an existing store.
///
/// ```
/// let opts = shmstore::AttachOptions { prefault: false, ..Default::default() };
/// assert!(!opts.prefault);
/// ```
#[derive(Clone, Debug)]
pub struct AttachOptions {
    /// Populate this process's page tables for the whole store at attach (off by default:
    /// objects are populated as they are first used; see [`StoreConfig::prefault`]).
    pub prefault: bool,
    /// Transparent huge pages.
    pub huge_pages: HugePages,
    /// How long a blocking get in this process spins before it sleeps on the futex
    /// (`Duration::ZERO`: sleep at once).
    pub get_spin: Duration,
    /// Map the whole heap into this process on a background thread after attaching (for
    /// processes that attach long before they read: their first reads then run warm).
    /// Costs, per process, about 2 MiB of page tables per GiB of store.
    pub populate_in_background: bool,
    /// Attach for reading only: the payload pages are mapped read-only in this process, so
    /// the kernel faults any write to them; creating and deleting objects is refused.
    /// Pins still work (they live in the metadata, which stays writable).
    pub read_only: bool,
    /// Recover dead clients while attaching (the default). Off, dead clients are left
    /// until this process's first maintenance or an explicit [`Store::recover`](crate::Store::recover), whose
    /// report then covers them (what `shmstore recover` does).
    pub recover_on_attach: bool,
}

impl Default for AttachOptions {
    fn default() -> Self {
        AttachOptions {
            prefault: false,
            populate_in_background: false,
            huge_pages: HugePages::Auto,
            get_spin: DEFAULT_GET_SPIN,
            read_only: false,
            recover_on_attach: true,
        }
    }
}

/// A snapshot of a store's occupancy and activity. Costs O(clients), not O(objects): it
/// adds up per-client counters kept as operations run (see docs/design.md, "Stats").
///
/// ```
/// use shmstore::{ObjectId, Store, StoreConfig};
/// let s = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20)).unwrap();
/// s.put(&ObjectId::of_key("k"), b"v").unwrap();
/// let st = s.stats();
/// assert_eq!((st.objects, st.used + st.free), (1, st.capacity));
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Payload capacity in bytes.
    pub capacity: u64,
    /// Bytes in allocated blocks.
    pub used: u64,
    /// `capacity - used`.
    pub free: u64,
    /// Sealed objects.
    pub objects: u64,
    /// Objects being written.
    pub creating: u64,
    /// Total pins held.
    pub pins: u64,
    /// Deleted objects whose memory waits for the last pin.
    pub draining: u64,
    /// Processes attached and alive.
    pub clients: u64,
    /// Client slots still held by processes that have died (their pins and unfinished
    /// creations are not reclaimed yet; any live process reclaims them within
    /// moments, or at once with [`Store::recover`](crate::Store::recover)).
    pub dead_clients: u64,
    /// Dead clients recovered since the store was created.
    pub recovered_clients: u64,
    /// Bytes recovery gave back since the store was created.
    pub reclaimed_bytes: u64,
    /// A leak sweep is owed (a client died inside an allocator step) and waits for a
    /// moment when no live client is allocating.
    pub sweep_pending: bool,
    /// Blocks the leak sweep found owned by no one (left by clients killed inside an
    /// allocator step) and freed, since the store was created.
    pub leaked_blocks_freed: u64,
    /// Objects evicted to make room since the store was created.
    pub evictions: u64,
    /// Payload bytes of those objects: compared with
    /// [`bytes_created`](Self::bytes_created), how much of what was written eviction
    /// took back (a cache too small for its working set evicts most of it).
    pub bytes_evicted: u64,
    /// Object table slots.
    pub table_slots: u64,
    /// Whether the store is on transparent huge pages: it lives in a tmpfs mounted with
    /// `huge=within_size` or `huge=always`, or is an anonymous store under that
    /// `shmem_enabled` policy (pages come as 2 MiB where the kernel finds them free and
    /// as 4 KiB otherwise), or its creator rebuilt some of its heap as 2 MiB pages
    /// ([`HugePages::Auto`], then [`huge_page_bytes`](Self::huge_page_bytes) says how much).
    pub huge_pages: bool,
    /// The page size backing the store: the huge page size on hugetlbfs or for a
    /// huge-page memfd; the transparent huge page size (2 MiB) on a tmpfs that gives
    /// them, or once the creator has rebuilt the whole heap as 2 MiB pages; else 4096.
    pub page_size: u64,
    /// Heap bytes the creator rebuilt as 2 MiB pages ([`HugePages::Auto`]): it grows from
    /// 0 while the creator's background population runs (about 0.1-0.5 s per GiB), and
    /// stays 0 where the kernel cannot (before Linux 6.1, `shmem_enabled` `deny`), for a
    /// store created with [`HugePages::Off`], and on file systems with huge pages of
    /// their own.
    pub huge_page_bytes: u64,
    /// Client slots (processes that may be attached at once).
    pub max_clients: u64,
    /// Objects created since the store was created.
    pub creates: u64,
    /// Payload bytes of those objects.
    pub bytes_created: u64,
    /// Objects deleted (not counting evictions).
    pub deletes: u64,
    /// Gets that found their object sealed at once.
    pub gets_hit: u64,
    /// Gets that had to wait for a seal.
    pub gets_waited: u64,
    /// Gets that ended without their object (absent, timed out, creator died).
    pub gets_missed: u64,
    /// Creates that failed because the store was full.
    pub full_events: u64,
}

/// Where an object is in its life cycle.
///
/// ```
/// assert_ne!(shmstore::ObjectState::Sealed, shmstore::ObjectState::Creating);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ObjectState {
    /// Being written by its creator; not visible to gets.
    Creating,
    /// Published and immutable.
    Sealed,
    /// Deleted; its memory is freed when the last pin drops.
    Draining,
}

/// One object as [`Store::list`](crate::Store::list) reports it.
///
/// ```
/// # let s = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(1 << 20))?;
/// # s.put(&shmstore::ObjectId::of_key("a"), b"x")?;
/// let info = &s.list()[0];
/// assert_eq!(info.id, shmstore::ObjectId::of_key("a"));
/// # Ok::<(), shmstore::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectInfo {
    /// The id.
    pub id: ObjectId,
    /// Payload bytes.
    pub len: u64,
    /// Metadata bytes.
    pub meta_len: u16,
    /// Life-cycle state.
    pub state: ObjectState,
    /// Pins held now.
    pub pins: u64,
}
