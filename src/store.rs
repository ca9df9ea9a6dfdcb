//! The public store: `Store`, `Creation` (writer handle), `View` (pinned reader handle).
//!
//! This module wires the region, the allocator, the table and the client slot together and
//! owns the rules that span them: a block is allocated before its table entry is inserted
//! and freed only by the one process that moved its slot to FREEING; every step that
//! changes who owns a block runs inside the client's `ops` bracket (for the leak sweep);
//! every value read back from a table slot is range-checked against the heap before it
//! becomes a pointer; dead clients are recovered on attach, on `Full`, when a get meets a
//! dead creator, and on a bounded schedule (see [`crate::recovery`]).
//!
//! Handles (`Creation`, `View`) hold an `Arc` of the attached store, so they are
//! `'static + Send` and may outlive the `Store` value they came from.

use crate::alloc::{Allocator, Block, Padded, SlabDesc};
use crate::capacity::{self, Globals, WhenFull};
use crate::client::{Client, ClientHeader, Identity, Liveness};
use crate::error::{Error, Result};
use crate::layout::{
    Params, Superblock, FLAG_EVICT, FLAG_REMOVE_WHEN_UNUSED, GLOBALS_SIZE, MAX_META, WAIT_BUCKETS,
};
use crate::recovery::{RecoveryReport, World, MAINTENANCE_PERIOD};
use crate::region::{HugePages, Mapping};
use crate::sync::{AtomicU16, AtomicU64, Ordering};
use crate::table::{
    Entry, Pin, Reclaimer, Sections, Slot, SlotRef, Table, WaitBucket, CREATING, DELETED, FREEING,
    RESERVED,
};
use crate::ObjectId;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::os::fd::{AsFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    /// Objects the table is sized for; the table has at least twice as many slots.
    pub max_objects: u64,
    /// Processes that may be attached at once. Each costs one 16-bit pin counter per
    /// table slot (up to 32 clients fit one 64-byte row per slot).
    pub max_clients: u32,
    /// Directory for named stores.
    pub dir: PathBuf,
    /// File mode of a named store.
    pub mode: u32,
    /// Populate page tables at attach so first writes run at warm speed.
    pub prefault: bool,
    /// Transparent huge pages.
    pub huge_pages: HugePages,
    /// How long a blocking get in this process spins before it sleeps on the futex.
    pub get_spin: Duration,
    /// Fail or evict when full (a property of the store, the same for every process).
    pub when_full: WhenFull,
    /// Remove the store's file when the last attached process detaches (or dies and is
    /// recovered by a process that then detaches). Off by default: a store normally
    /// outlives its processes until [`Store::unlink`] or `shmstore rm`.
    pub remove_when_unused: bool,
}

/// Default spin before a blocking get sleeps: long enough to catch a producer that is
/// about to seal, short enough to cost little CPU when it is not.
pub const DEFAULT_GET_SPIN: Duration = Duration::from_micros(50);

/// How often a get blocked on an unsealed object checks that its creator still runs.
pub const CREATOR_CHECK_PERIOD: Duration = Duration::from_millis(20);

/// Creates between two looks at the maintenance clock (see [`crate::recovery`]).
const MAINTENANCE_CHECK: u64 = 256;

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            capacity: 256 << 20,
            max_objects: 1 << 16,
            max_clients: 32,
            dir: PathBuf::from("/dev/shm"),
            mode: 0o600,
            prefault: true,
            huge_pages: HugePages::Off,
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
    fn attach_options(&self) -> AttachOptions {
        AttachOptions {
            prefault: self.prefault,
            huge_pages: self.huge_pages,
            get_spin: self.get_spin,
            read_only: false,
            recover_on_attach: false, // a new store has no dead clients
        }
    }

    fn params(&self) -> Params {
        let slab = crate::layout::SLAB;
        let slots = (self.max_objects.max(16) * 2)
            .checked_next_power_of_two()
            .unwrap_or(u64::MAX);
        Params {
            heap_size: self.capacity.div_ceil(slab).saturating_mul(slab),
            table_slots: slots,
            max_clients: self.max_clients as u64,
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
    /// Populate page tables at attach.
    pub prefault: bool,
    /// Transparent huge pages.
    pub huge_pages: HugePages,
    /// How long a blocking get in this process spins before it sleeps on the futex
    /// (`Duration::ZERO`: sleep at once).
    pub get_spin: Duration,
    /// Attach for reading only: the payload pages are mapped read-only in this process, so
    /// the kernel faults any write to them; creating and deleting objects is refused.
    /// Pins still work (they live in the metadata, which stays writable).
    pub read_only: bool,
    /// Recover dead clients while attaching (the default). Off, dead clients are left
    /// until this process's first maintenance or an explicit [`Store::recover`], whose
    /// report then covers them (what `shmstore recover` does).
    pub recover_on_attach: bool,
}

impl Default for AttachOptions {
    fn default() -> Self {
        AttachOptions {
            prefault: true,
            huge_pages: HugePages::Off,
            get_spin: DEFAULT_GET_SPIN,
            read_only: false,
            recover_on_attach: true,
        }
    }
}

/// A snapshot of a store's occupancy.
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
    /// The largest block that could be allocated now.
    pub largest_free: u64,
    /// Sealed objects.
    pub objects: u64,
    /// Objects being written.
    pub creating: u64,
    /// Objects (sealed or deleted-but-draining) with at least one pin.
    pub pinned: u64,
    /// Total pins held.
    pub pins: u64,
    /// Deleted objects whose memory waits for the last pin.
    pub draining: u64,
    /// Processes attached and alive.
    pub clients: u64,
    /// Client slots still held by processes that have died (their pins and unfinished
    /// creations are not reclaimed yet; any live process reclaims them within
    /// moments, or at once with [`Store::recover`]).
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
    /// Object table slots.
    pub table_slots: u64,
    /// Whether transparent huge pages are in effect for this process's mapping.
    pub huge_pages: bool,
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

/// One object as [`Store::list`] reports it.
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

/// Types that may be viewed in place over shared memory: every bit pattern is a valid
/// value (atomics and plain integers only), and all-zero is their empty state.
///
/// # Safety
/// Implementors must be `repr(C)` aggregates of atomics and integers, valid for any bytes.
unsafe trait SharedPod {}
// SAFETY: atomics of u64 are valid for every bit pattern.
unsafe impl SharedPod for AtomicU64 {}
// SAFETY: atomics of u16 are valid for every bit pattern.
unsafe impl SharedPod for AtomicU16 {}
// SAFETY: Padded is repr(C) around an AtomicU64 plus alignment padding.
unsafe impl SharedPod for Padded<AtomicU64> {}
// SAFETY: repr(C) of AtomicU64s.
unsafe impl SharedPod for SlabDesc {}
// SAFETY: repr(C) of AtomicU64s.
unsafe impl SharedPod for Slot {}
// SAFETY: repr(C) of AtomicU32s.
unsafe impl SharedPod for WaitBucket {}
// SAFETY: repr(C) of AtomicU64s.
unsafe impl SharedPod for ClientHeader {}
// SAFETY: repr(C) of AtomicU64s, plain u64 padding and a WaitBucket.
unsafe impl SharedPod for Globals {}

/// Views `count` values of `T` at byte offset `off` of the mapping.
///
/// # Safety
/// `base` must point to a mapping of `total` bytes that stays mapped for `'static` as far
/// as the returned slice's users can tell (the caller ties it to the `Inner` that owns the
/// mapping and never lets the slice escape it).
unsafe fn section<T: SharedPod>(
    base: *mut u8,
    total: usize,
    off: u64,
    count: u64,
) -> Result<&'static [T]> {
    let bytes = count.checked_mul(std::mem::size_of::<T>() as u64);
    let end = bytes.and_then(|b| b.checked_add(off));
    if end.is_none_or(|e| e > total as u64)
        || (base as usize + off as usize) % std::mem::align_of::<T>() != 0
    {
        return Err(Error::Corrupted {
            what: format!("section at {off} ({count} items) does not fit the mapping"),
        });
    }
    // SAFETY: in bounds and aligned (checked above); T is valid for any bytes (SharedPod);
    // lifetime per this function's contract. All access is through atomics.
    Ok(unsafe { std::slice::from_raw_parts(base.add(off as usize) as *const T, count as usize) })
}

/// The attached store, shared by every handle of this process.
struct Inner {
    // Field order: the sections borrow from `map`, which must drop last.
    pages: &'static [AtomicU64],
    slabs: &'static [SlabDesc],
    partial: &'static [AtomicU64],
    hints: &'static [Padded<AtomicU64>],
    slots: &'static [Slot],
    buckets: &'static [AtomicU64],
    waits: &'static [WaitBucket],
    pins: &'static [AtomicU16],
    globals: &'static Globals,
    client_header: &'static ClientHeader,
    client_index: u16,
    identity: Identity,
    /// Process-local clock for the maintenance schedule.
    epoch: Instant,
    /// `epoch`-relative ns before which no scheduled maintenance runs.
    next_maintenance_ns: AtomicU64,
    get_spin: Duration,
    read_only: bool,
    heap: *mut u8,
    sb: Superblock,
    map: Mapping,
}

// SAFETY: `heap` points into the shared mapping owned by `map`; all shared state is accessed
// through atomics, and payload bytes are written only through a `Creation` (unique writer)
// and read only after seal (immutable thereafter while pinned).
unsafe impl Send for Inner {}
// SAFETY: as above.
unsafe impl Sync for Inner {}

impl Drop for Inner {
    fn drop(&mut self) {
        let remove = self.sb.flags & FLAG_REMOVE_WHEN_UNUSED != 0;
        if remove && !self.read_only {
            // Dead clients would keep the store "in use" forever: recover them first.
            self.recover();
        }
        // Every handle holds an Arc<Inner>, so no pins or creations remain: leave the slot.
        self.client().release();
        if remove {
            self.remove_if_unused();
        }
    }
}

/// Brackets one ownership-changing step of this client (see [`crate::recovery`]).
struct OpGuard<'a>(&'a ClientHeader);

impl<'a> OpGuard<'a> {
    fn new(h: &'a ClientHeader) -> Self {
        Client { header: h }.begin_op();
        OpGuard(h)
    }
}

impl Drop for OpGuard<'_> {
    fn drop(&mut self) {
        Client { header: self.0 }.end_op();
    }
}

impl Reclaimer for Inner {
    fn reclaim(&self, table: &Table<'_>, r: SlotRef, e: Entry) {
        // Release the slot even if the entry was corrupt: never strand a table slot.
        if let Ok(res) = self.resolve(&e) {
            let _ = self.alloc().free(res.block);
        }
        table.release(r);
        self.globals.space.notify();
    }
    fn begin_op(&self) {
        self.client().begin_op();
    }
    fn end_op(&self) {
        self.client().end_op();
    }
}

impl Inner {
    fn attach(map: Mapping, sb: Superblock, opts: &AttachOptions) -> Result<Arc<Inner>> {
        let (get_spin, read_only) = (opts.get_spin, opts.read_only);
        if read_only {
            map.protect_read_only(sb.heap_offset, sb.heap_size)?;
        }
        let base = map.base();
        let total = map.len();
        const _: () = assert!(std::mem::size_of::<Globals>() as u64 == GLOBALS_SIZE);
        if sb.pin_stride < sb.max_clients {
            return Err(Error::Corrupted {
                what: "pin rows narrower than the client count".into(),
            });
        }
        // SAFETY: `base`/`total` describe `map`, which `Inner` owns and drops after these
        // slices (field order); the slices never leave `Inner`.
        let (globals, pages, slabs, partial, hints, slots, buckets, waits, pins) = unsafe {
            (
                &section::<Globals>(base, total, sb.globals_offset, 1)?[0],
                section(base, total, sb.page_bitmap_offset, sb.pages.div_ceil(64))?,
                section(base, total, sb.slab_desc_offset, sb.slabs)?,
                section(
                    base,
                    total,
                    sb.partial_offset,
                    sb.partial_words * crate::layout::CLASSES,
                )?,
                section(base, total, sb.hints_offset, crate::layout::CLASSES + 1)?,
                section(base, total, sb.slots_offset, sb.table_slots)?,
                section(base, total, sb.buckets_offset, sb.table_slots)?,
                section(base, total, sb.wait_offset, WAIT_BUCKETS)?,
                section(
                    base,
                    total,
                    sb.pins_offset,
                    sb.table_slots.saturating_mul(sb.pin_stride),
                )?,
            )
        };
        if sb.heap_offset + sb.heap_size > total as u64 {
            return Err(Error::Corrupted {
                what: "heap extends past the mapping".into(),
            });
        }
        let identity = Identity::current();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let mut claimed = None;
        // A free slot first; if none, a dead client's slot, cleaned up by us (below).
        for pass in 0..3 {
            for i in 0..sb.max_clients {
                // SAFETY: as above.
                let header = unsafe { client_section(base, total, &sb, i)? };
                let c = Client { header };
                if pass == 0 && c.try_claim(&identity, now) {
                    claimed = Some((i as u16, header, false));
                    break;
                }
                if pass > 0 && c.try_inherit(&identity, now, i) {
                    claimed = Some((i as u16, header, true));
                    break;
                }
            }
            if claimed.is_some() {
                break;
            }
        }
        let Some((client_index, client_header, inherited)) = claimed else {
            return Err(Error::TooManyClients {
                max: sb.max_clients as u32,
            });
        };
        let inner = Arc::new(Inner {
            globals,
            pages,
            slabs,
            partial,
            hints,
            slots,
            buckets,
            waits,
            pins,
            client_header,
            client_index,
            identity,
            epoch: Instant::now(),
            next_maintenance_ns: AtomicU64::new(0),
            get_spin,
            read_only,
            // SAFETY: heap_offset + heap_size <= total (checked above).
            heap: unsafe { base.add(sb.heap_offset as usize) },
            sb,
            map,
        });
        if inherited {
            // We took over a dead client's slot: return what it held before we use it.
            let mut report = RecoveryReport::default();
            inner.world().recover_own_slot(&mut report);
            if !inner.client().finish_inherit(client_index as u64) {
                // A recoverer judged the slot dead while we moved in and took it back;
                // `inner` now holds nothing (its drop releases nothing of ours).
                std::mem::forget(inner);
                return Err(Error::TooManyClients {
                    max: sb.max_clients as u32,
                });
            }
        }
        if opts.recover_on_attach {
            // Reclaim what dead processes left, now rather than at the first full store.
            inner.maintain();
        } else {
            inner
                .next_maintenance_ns
                .store(MAINTENANCE_PERIOD.as_nanos() as u64, Ordering::Relaxed);
        }
        Ok(inner)
    }

    fn alloc(&self) -> Allocator<'_> {
        Allocator::new(
            self.pages,
            self.sb.pages,
            self.slabs,
            self.partial,
            self.hints,
        )
    }

    fn table(&self) -> Table<'_> {
        let sections = Sections {
            slots: self.slots,
            buckets: self.buckets,
            waits: self.waits,
            pins: self.pins,
            stride: self.sb.pin_stride as usize,
        };
        Table::new(sections, self.client_index, self)
    }

    fn client(&self) -> Client<'_> {
        Client {
            header: self.client_header,
        }
    }

    /// Client slot `i` (any process's), for stats, audits and recovery.
    fn client_at(&self, i: u64) -> Result<Client<'_>> {
        // SAFETY: `map` is the mapping these sections were validated against and `self`
        // owns it; the returned borrows do not outlive `self`.
        let header = unsafe { client_section(self.map.base(), self.map.len(), &self.sb, i)? };
        Ok(Client { header })
    }

    fn clients(&self) -> Vec<Client<'_>> {
        (0..self.sb.max_clients)
            .filter_map(|i| self.client_at(i).ok())
            .collect()
    }

    fn op(&self) -> OpGuard<'_> {
        OpGuard::new(self.client_header)
    }

    /// What recovery works on, as this client.
    fn world(&self) -> World<'_> {
        World {
            table: self.table(),
            alloc: self.alloc(),
            globals: self.globals,
            clients: self.clients(),
            me: self.client_index as u64,
            identity: self.identity,
            heap_size: self.sb.heap_size,
            ops: self,
        }
    }

    /// Recovers dead clients and runs an owed leak sweep (see [`crate::recovery`]).
    fn recover(&self) -> RecoveryReport {
        self.world().recover_dead()
    }

    /// Scheduled maintenance: recovery, at most every [`MAINTENANCE_PERIOD`] per process.
    fn maintain(&self) {
        let now = self.epoch.elapsed().as_nanos() as u64;
        let next = self.next_maintenance_ns.load(Ordering::Relaxed);
        if now < next
            || self
                .next_maintenance_ns
                .compare_exchange(
                    next,
                    now + MAINTENANCE_PERIOD.as_nanos() as u64,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_err()
        {
            return;
        }
        if self.read_only {
            return; // a read-only attach cannot free memory; others will
        }
        self.recover();
    }

    /// Removes the store's file if no client is attached any more (dead ones recovered
    /// first). Best effort: a process attaching at this instant keeps its mapping.
    fn remove_if_unused(&self) {
        let Some(path) = self.map.path() else { return };
        let me = self.identity;
        let others = self
            .clients()
            .iter()
            .any(|c| c.liveness(&me) != Liveness::Free);
        if !others && self.map.same_file_as(path) {
            let _ = std::fs::remove_file(path);
        }
    }

    /// Checks an entry read from shared memory and turns it into a block and pointers.
    fn resolve(&self, e: &Entry) -> Result<Resolved> {
        let (block, meta_pad) = e.block(self.sb.heap_size)?;
        // SAFETY: offset + size <= heap_size (checked by Entry::block), so both pointers
        // stay inside the heap.
        let (meta, data) = unsafe {
            let m = self.heap.add(e.offset as usize);
            (m, m.add(meta_pad as usize))
        };
        Ok(Resolved { block, meta, data })
    }

    /// Test hook: overwrites metadata bytes (before the heap) of the region. Only for the
    /// hostile-region fuzz target, which owns the store and runs single-threaded.
    fn scribble_metadata(&self, offset: u64, bytes: &[u8]) {
        let end = self.sb.heap_offset as usize;
        let at = (offset as usize) % end;
        let n = bytes.len().min(end - at);
        // SAFETY: `at + n <= heap_offset <= mapping length`; no other thread or process
        // touches this store while the fuzz target runs (a plain write cannot race).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.map.base().add(at), n) };
    }

    fn evicts(&self) -> bool {
        self.sb.flags & FLAG_EVICT != 0
    }

    /// Allocates `need` bytes; when full, first recovers what dead clients hold, then
    /// evicts by CLOCK if the store says so.
    fn alloc_block(&self, need: u64) -> Result<Block> {
        let first = self.alloc().alloc(need);
        let first = match first {
            Err(Error::Full { .. }) if !self.read_only => {
                let r = self.recover();
                if r.bytes_reclaimed > 0 {
                    self.alloc().alloc(need)
                } else {
                    first
                }
            }
            other => other,
        };
        match first {
            Err(Error::Full { .. }) if self.evicts() => {
                capacity::evict_until_fits(self.globals, &self.table(), &self.alloc(), need)
            }
            other => other,
        }
    }
}

struct Resolved {
    block: Block,
    meta: *mut u8,
    data: *mut u8,
}

fn pad64(x: u64) -> u64 {
    x.div_ceil(64) * 64
}

/// Fuzz hook: runs the entry validation on raw slot words.
pub(crate) fn resolve_untrusted(offset: u64, len: u64, info: u64) {
    let _ = Entry::from_parts(offset, len, info).block(1 << 30);
}

/// Client `i`'s slot.
///
/// # Safety
/// Same contract as [`section`].
unsafe fn client_section(
    base: *mut u8,
    total: usize,
    sb: &Superblock,
    i: u64,
) -> Result<&'static ClientHeader> {
    let off = sb.clients_offset + i * sb.client_stride;
    // SAFETY: forwarded contract; bounds and alignment are checked inside `section`.
    let h: &'static [ClientHeader] = unsafe { section(base, total, off, 1)? };
    Ok(&h[0])
}

/// A handle to an attached store. Cheap to clone; every clone shares one attachment.
///
/// ```
/// use shmstore::{ObjectId, Store, StoreConfig};
/// use std::time::Duration;
///
/// let store = Store::create_anonymous(&StoreConfig::with_capacity(16 << 20))?;
/// let id = ObjectId::of_content(b"pixels");
/// store.put(&id, b"pixels")?;
/// let view = store.get(&id, Duration::from_secs(1))?;
/// assert_eq!(&*view, b"pixels");
/// # Ok::<(), shmstore::Error>(())
/// ```
#[derive(Clone)]
pub struct Store {
    inner: Arc<Inner>,
}

impl fmt::Debug for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Store")
            .field("path", &self.inner.map.path())
            .field("capacity", &self.inner.sb.heap_size)
            .field("client", &self.inner.client_index)
            .finish()
    }
}

impl Store {
    /// Creates a named store `dir/name` (default dir `/dev/shm`) and attaches to it.
    ///
    /// Fails with [`Error::StoreExists`] if the name is taken and with
    /// [`Error::InsufficientSpace`] if the file system cannot hold it.
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
        let map =
            Mapping::create_named(&cfg.dir, name, &sb, cfg.mode, cfg.huge_pages, cfg.prefault)?;
        Self::attach(map, sb, &cfg.attach_options())
    }

    /// Creates an anonymous store in a memfd. Share it with [`Store::fd`] (a child opens
    /// `/proc/<pid>/fd/<fd>` with [`Store::open_path`], or receives the descriptor).
    ///
    /// ```
    /// let store = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(1 << 20))?;
    /// assert!(store.path().is_none());
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn create_anonymous(cfg: &StoreConfig) -> Result<Store> {
        let sb = Self::superblock_for(cfg)?;
        let map = Mapping::create_memfd(&sb, cfg.huge_pages, cfg.prefault)?;
        Self::attach(map, sb, &cfg.attach_options())
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
        let (map, sb) = Mapping::open(path.as_ref(), opts.huge_pages, opts.prefault)?;
        Self::attach(map, sb, opts)
    }

    /// Removes the store's name; attached processes keep working, and the memory is
    /// returned when the last one detaches. No-op for anonymous stores.
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
            Some(p) => std::fs::remove_file(p).map_err(|source| Error::Io {
                op: "unlink",
                path: p.to_path_buf(),
                source,
            }),
            None => Ok(()),
        }
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

    /// The largest object this store can ever hold.
    ///
    /// ```
    /// let s = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(1 << 20))?;
    /// assert_eq!(s.max_object_size(), 1 << 20);
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn max_object_size(&self) -> u64 {
        self.inner.alloc().max_object()
    }

    /// Starts creating object `id` of `len` bytes. Write through the returned handle, then
    /// [`Creation::seal`]; dropping it unsealed aborts and frees the memory.
    ///
    /// ```
    /// use shmstore::{Error, ObjectId, Store, StoreConfig};
    /// let store = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20))?;
    /// let id = ObjectId::of_key("frame-0");
    /// let mut c = store.create_object(&id, 4)?;
    /// c.copy_from_slice(&[1, 2, 3, 4]);
    /// assert!(matches!(store.create_object(&id, 4), Err(Error::AlreadyExists { .. })));
    /// c.seal()?;
    /// assert!(store.contains(&id));
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn create_object(&self, id: &ObjectId, len: u64) -> Result<Creation> {
        self.create_object_with_meta(id, len, &[])
    }

    /// Like [`create_object`](Self::create_object), with a small metadata blob (at most
    /// 4 KiB, e.g. a dtype/shape header) stored in the same block, readable through
    /// [`View::meta`].
    ///
    /// ```
    /// use shmstore::{ObjectId, Store, StoreConfig};
    /// let store = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20))?;
    /// let id = ObjectId::of_key("t");
    /// let mut c = store.create_object_with_meta(&id, 8, b"f32[2]")?;
    /// c.copy_from_slice(&[0; 8]);
    /// c.seal()?;
    /// assert_eq!(store.try_get(&id)?.meta(), b"f32[2]");
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn create_object_with_meta(
        &self,
        id: &ObjectId,
        len: u64,
        meta: &[u8],
    ) -> Result<Creation> {
        if meta.len() as u64 > MAX_META {
            return Err(Error::MetadataTooLarge {
                len: meta.len(),
                max: MAX_META as usize,
            });
        }
        let inner = &self.inner;
        if inner.read_only {
            return Err(Error::ReadOnly { op: "create" });
        }
        // Cheap early answer (the insert below re-checks atomically): an existing id is
        // AlreadyExists even when the store is full.
        if inner.table().contains_live(id) {
            return Err(Error::AlreadyExists { id: *id });
        }
        let need = pad64(meta.len() as u64)
            .checked_add(len)
            .ok_or(Error::TooLarge {
                requested: u64::MAX,
                max: self.max_object_size(),
            })?;
        // Every `MAINTENANCE_CHECK` creates, see whether scheduled recovery is due.
        if inner.client().ops().0 % MAINTENANCE_CHECK == 0 {
            inner.maintain();
        }
        // From the allocation until the entry names the block, a death here leaves
        // bits no entry names: the bracket tells recovery to owe a leak sweep.
        let op = inner.op();
        let block = inner.alloc_block(need)?;
        let entry = Entry {
            offset: block.offset,
            len,
            meta_len: meta.len() as u16,
            kind: block.kind.encode(),
            creator: inner.client_index,
        };
        let slot = match inner.table().insert(id, &entry) {
            Ok(s) => s,
            Err(e) => {
                let _ = inner.alloc().free(block);
                return Err(e);
            }
        };
        drop(op);
        let res = match inner.resolve(&entry) {
            Ok(r) => r,
            Err(e) => {
                let _ = inner.table().abort(id, slot);
                return Err(e);
            }
        };
        // SAFETY: the block is ours alone until sealed (fresh allocation, entry CREATING,
        // unsealed objects cannot be pinned); meta fits before the data (resolve checked).
        unsafe { std::ptr::copy_nonoverlapping(meta.as_ptr(), res.meta, meta.len()) };
        Ok(Creation {
            inner: Arc::clone(&self.inner),
            id: *id,
            slot,
            data: res.data,
            len: len as usize,
            done: false,
        })
    }

    /// Like [`create_object`](Self::create_object), but when the store is full it waits up
    /// to `timeout` for space (another process deleting, a pin dropping in an evicting
    /// store) instead of failing at once. Ends with [`Error::Full`], with the numbers, if
    /// no space came in time; a request that can never fit fails at once with
    /// [`Error::TooLarge`].
    ///
    /// ```
    /// use shmstore::{Error, ObjectId, Store, StoreConfig};
    /// use std::time::Duration;
    /// let store = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20))?;
    /// store.put(&ObjectId::of_key("big"), &vec![0; 1 << 20])?;
    /// let s2 = store.clone();
    /// let t = std::thread::spawn(move || s2.create_object_wait(&ObjectId::of_key("next"), 1000, Duration::from_secs(10)).map(|c| c.seal()));
    /// store.delete(&ObjectId::of_key("big"))?; // frees the space; the waiter proceeds
    /// t.join().unwrap()??;
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn create_object_wait(
        &self,
        id: &ObjectId,
        len: u64,
        timeout: Duration,
    ) -> Result<Creation> {
        let start = Instant::now();
        let deadline = start
            .checked_add(timeout)
            .unwrap_or(start + Duration::from_secs(1 << 32));
        capacity::wait_for_space(self.inner.globals, deadline, || self.create_object(id, len))
    }

    /// Creates, copies and seals in one call.
    ///
    /// ```
    /// use shmstore::{ObjectId, Store, StoreConfig};
    /// let store = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20))?;
    /// let bytes = vec![7u8; 10_000];
    /// let id = ObjectId::of_content(&bytes);
    /// store.put(&id, &bytes)?;
    /// assert_eq!(&*store.try_get(&id)?, &bytes[..]);
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn put(&self, id: &ObjectId, bytes: &[u8]) -> Result<()> {
        self.put_with_meta(id, bytes, &[])
    }

    /// [`put`](Self::put) with per-object metadata.
    ///
    /// ```
    /// use shmstore::{ObjectId, Store, StoreConfig};
    /// let store = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20))?;
    /// store.put_with_meta(&ObjectId::of_key("a"), b"xy", b"u8[2]")?;
    /// assert_eq!(store.try_get(&ObjectId::of_key("a"))?.meta(), b"u8[2]");
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn put_with_meta(&self, id: &ObjectId, bytes: &[u8], meta: &[u8]) -> Result<()> {
        let mut c = self.create_object_with_meta(id, bytes.len() as u64, meta)?;
        c.copy_from_slice(bytes);
        c.seal()
    }

    /// Gets a sealed object, waiting up to `timeout` for it to be created and sealed. The
    /// returned view pins the object until dropped.
    ///
    /// ```
    /// use shmstore::{Error, ObjectId, Store, StoreConfig};
    /// use std::time::Duration;
    /// let store = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20))?;
    /// let id = ObjectId::of_key("late");
    /// assert!(matches!(store.get(&id, Duration::from_millis(5)), Err(Error::Timeout { .. })));
    /// let s2 = store.clone();
    /// let t = std::thread::spawn(move || s2.get(&id, Duration::from_secs(10)).map(|v| v.to_vec()));
    /// store.put(&id, b"ok")?;
    /// assert_eq!(t.join().unwrap()?, b"ok");
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    ///
    /// If the process creating the object dies before sealing it, the get fails with
    /// [`Error::CreatorDied`] within about [`CREATOR_CHECK_PERIOD`] instead of waiting out
    /// its timeout (and the dead creator's memory is reclaimed on the way).
    pub fn get(&self, id: &ObjectId, timeout: Duration) -> Result<View> {
        let start = Instant::now();
        let deadline = start
            .checked_add(timeout)
            .unwrap_or(start + Duration::from_secs(1 << 32));
        let inner = &self.inner;
        let mut spin = inner.get_spin;
        // The creator we saw working on the id: (client index, its ctl then, its pid).
        let mut creator: Option<(u16, u64, u64)> = None;
        loop {
            let slice = deadline.min(Instant::now() + CREATOR_CHECK_PERIOD);
            let found = inner.table().pin_wait(id, Some(slice), spin)?;
            spin = Duration::ZERO;
            match found {
                Pin::Pinned(r, e) => return self.view(id, r, e),
                Pin::Creating { creator: c, .. } => {
                    if let Ok(cl) = inner.client_at(c as u64) {
                        let now = (c, cl.ctl(), cl.header.pid.load(Ordering::Relaxed));
                        if creator.is_some_and(|was| was.0 == c && was.1 == now.1)
                            && !cl.process_alive(&inner.identity)
                        {
                            // Still the same attachment, and its process is gone.
                            inner.recover();
                            return Err(Error::CreatorDied {
                                id: *id,
                                pid: now.2,
                            });
                        }
                        creator = Some(now);
                    }
                }
                Pin::Absent => {
                    // An abort woke us: if the creator we saw is no longer the same
                    // attachment, or is dead, it will not come back to seal.
                    if let Some((c, ctl, pid)) = creator.take() {
                        if let Ok(cl) = inner.client_at(c as u64) {
                            if cl.ctl() != ctl || !cl.process_alive(&inner.identity) {
                                return Err(Error::CreatorDied { id: *id, pid });
                            }
                        }
                    }
                }
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    id: *id,
                    waited: start.elapsed(),
                });
            }
        }
    }

    /// Gets a sealed object without waiting; [`Error::NotFound`] if it is absent or not
    /// sealed yet.
    ///
    /// ```
    /// use shmstore::{ObjectId, Store, StoreConfig};
    /// let store = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20))?;
    /// assert!(store.try_get(&ObjectId::of_key("nope")).is_err());
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn try_get(&self, id: &ObjectId) -> Result<View> {
        match self.inner.table().pin_wait(id, None, Duration::ZERO)? {
            Pin::Pinned(r, e) => self.view(id, r, e),
            _ => Err(Error::NotFound { id: *id }),
        }
    }

    /// Gets several objects, all within one overall `timeout`.
    ///
    /// ```
    /// use shmstore::{ObjectId, Store, StoreConfig};
    /// use std::time::Duration;
    /// let store = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20))?;
    /// let ids: Vec<_> = (0..3).map(|i| ObjectId::of_key(format!("{i}"))).collect();
    /// for id in &ids { store.put(id, b"x")?; }
    /// assert_eq!(store.get_many(&ids, Duration::from_secs(1))?.len(), 3);
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn get_many(&self, ids: &[ObjectId], timeout: Duration) -> Result<Vec<View>> {
        let start = Instant::now();
        let deadline = start
            .checked_add(timeout)
            .unwrap_or(start + Duration::from_secs(1 << 32));
        ids.iter()
            .map(|id| self.get(id, deadline.saturating_duration_since(Instant::now())))
            .collect()
    }

    fn view(&self, id: &ObjectId, r: SlotRef, e: Entry) -> Result<View> {
        let inner = &self.inner;
        let res = match inner.resolve(&e) {
            Ok(res) => res,
            Err(err) => {
                let _ = inner.table().unpin(r);
                return Err(err);
            }
        };
        Ok(View {
            inner: Arc::clone(inner),
            id: *id,
            slot: r,
            meta: res.meta,
            meta_len: e.meta_len as usize,
            data: res.data,
            len: e.len as usize,
        })
    }

    /// Is `id` present and sealed?
    ///
    /// ```
    /// use shmstore::{ObjectId, Store, StoreConfig};
    /// let store = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20))?;
    /// assert!(!store.contains(&ObjectId::of_key("x")));
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn contains(&self, id: &ObjectId) -> bool {
        self.inner.table().contains_sealed(id)
    }

    /// Deletes a sealed object. New gets stop finding it at once; its memory is freed when
    /// the last view of it drops.
    ///
    /// ```
    /// use shmstore::{ObjectId, Store, StoreConfig};
    /// let store = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20))?;
    /// let id = ObjectId::of_key("x");
    /// store.put(&id, b"abc")?;
    /// let view = store.try_get(&id)?;
    /// store.delete(&id)?;
    /// assert!(!store.contains(&id));
    /// assert_eq!(&*view, b"abc"); // still readable while pinned
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn delete(&self, id: &ObjectId) -> Result<()> {
        if self.inner.read_only {
            return Err(Error::ReadOnly { op: "delete" });
        }
        match self.inner.table().delete(id)? {
            // Freed here: say so if the entry could not be (its slot is returned anyway).
            Some(e) => e.block(self.inner.sb.heap_size).map(|_| ()),
            None => Ok(()),
        }
    }

    /// Occupancy figures (scans the allocator and the table: microseconds to milliseconds).
    ///
    /// ```
    /// let s = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(1 << 20))?;
    /// assert_eq!(s.stats().used, 0);
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn stats(&self) -> Stats {
        let u = self.inner.alloc().usage();
        let mut st = Stats {
            capacity: u.capacity,
            used: u.used,
            free: u.free,
            largest_free: u.largest_free,
            table_slots: self.inner.sb.table_slots,
            evictions: self
                .inner
                .globals
                .evictions
                .load(crate::sync::Ordering::Relaxed),
            huge_pages: self.inner.map.huge_pages(),
            ..Default::default()
        };
        let table = self.inner.table();
        table.scan(|i, c, _, _| {
            match c.state() {
                _ if c.sealed() => st.objects += 1,
                CREATING => st.creating += 1,
                DELETED => st.draining += 1,
                _ => {}
            }
            let pins = table.pins_of(i);
            if pins > 0 && (c.sealed() || c.state() == DELETED) {
                st.pinned += 1;
                st.pins += pins;
            }
        });
        let inner = &self.inner;
        for c in inner.clients() {
            match c.liveness(&inner.identity) {
                Liveness::Alive => st.clients += 1,
                Liveness::Dead | Liveness::Recovering => st.dead_clients += 1,
                Liveness::Free => {}
            }
        }
        let g = inner.globals;
        st.recovered_clients = g.recovered_clients.load(Ordering::Relaxed);
        st.reclaimed_bytes = g.reclaimed_bytes.load(Ordering::Relaxed);
        st.sweep_pending = g.sweeps_owed.load(Ordering::Relaxed) != 0;
        st.leaked_blocks_freed = g.leaked_blocks_freed.load(Ordering::Relaxed);
        st
    }

    /// Recovers every client whose process died: drops its pins, aborts its unsealed
    /// objects (their getters fail with [`Error::CreatorDied`]), returns table slots it
    /// was part-way through changing, and runs the leak sweep if one is owed. Live
    /// processes do this by themselves when they meet a dead client's state and on a
    /// bounded schedule; call it to do it now (`shmstore recover NAME` does).
    ///
    /// ```
    /// let s = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(1 << 20))?;
    /// let r = s.recover()?;
    /// assert_eq!((r.clients_recovered, r.bytes_reclaimed, r.sweep_pending), (0, 0, false));
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn recover(&self) -> Result<RecoveryReport> {
        if self.inner.read_only {
            return Err(Error::ReadOnly { op: "recover" });
        }
        let world = self.inner.world();
        let mut report = world.recover_dead();
        // The sweep needs a moment when no attached process is inside an allocator step.
        // No event marks such a moment (steps end without a wake-up), so back off briefly
        // and look again, ~0.1 s at most; if none comes it stays owed for the schedule.
        for _ in 0..50 {
            if !report.sweep_pending {
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
            report.sweep_pending = false;
            world.sweep(&mut report);
        }
        Ok(report)
    }

    /// Every object in the table with its state, size and pins (a scan; for tools).
    ///
    /// ```
    /// use shmstore::{ObjectId, ObjectState, Store, StoreConfig};
    /// let s = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20))?;
    /// s.put(&ObjectId::of_key("a"), b"abc")?;
    /// let list = s.list();
    /// assert_eq!((list[0].len, list[0].state, list[0].pins), (3, ObjectState::Sealed, 0));
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn list(&self) -> Vec<ObjectInfo> {
        let mut out = Vec::new();
        let table = self.inner.table();
        table.scan(|i, c, id, e| {
            let state = match c.state() {
                CREATING => ObjectState::Creating,
                _ if c.sealed() => ObjectState::Sealed,
                DELETED => ObjectState::Draining,
                _ => return,
            };
            out.push(ObjectInfo {
                id,
                len: e.len,
                meta_len: e.meta_len,
                state,
                pins: table.pins_of(i),
            });
        });
        out
    }

    /// Checks every internal invariant: allocator bitmaps agree with their counts, every
    /// table entry describes an allocated block inside the heap, no two blocks overlap, and
    /// `used` equals the sum of the live blocks. Expensive (a full scan); meant for tests
    /// and diagnostics when nothing else is running.
    ///
    /// ```
    /// let s = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(1 << 20))?;
    /// s.put(&shmstore::ObjectId::of_key("a"), &[1; 100])?;
    /// s.check_invariants()?;
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn check_invariants(&self) -> Result<()> {
        let inner = &self.inner;
        inner.alloc().audit()?;
        let mut blocks = Vec::new();
        let mut err = None;
        inner.table().scan(|i, c, _, e| {
            if c.state() == crate::table::RESERVED || err.is_some() {
                return;
            }
            match inner.resolve(&e) {
                Ok(r) => blocks.push((r.block.offset, r.block.size, i)),
                Err(e) => err = Some(e),
            }
        });
        if let Some(e) = err {
            return Err(e);
        }
        blocks.sort_unstable();
        for w in blocks.windows(2) {
            if w[0].0 + w[0].1 > w[1].0 {
                return Err(Error::Corrupted {
                    what: format!("blocks of slots {} and {} overlap", w[0].2, w[1].2),
                });
            }
        }
        // Everything a client marks must belong to an attached client: pin counters,
        // creators of unsealed objects, owners of half-changed slots.
        let clients = inner.clients();
        let attached: Vec<bool> = clients.iter().map(|c| c.is_attached()).collect();
        let table = inner.table();
        for i in 0..table.capacity() as usize {
            for (c, &on) in attached.iter().enumerate() {
                if !on && table.counter_of(i, c as u64) != 0 {
                    return Err(Error::Corrupted {
                        what: format!("slot {i} is pinned by detached client {c}"),
                    });
                }
            }
        }
        let mut bad = None;
        table.scan(|i, c, _, e| {
            let marker = match c.state() {
                CREATING => Some(e.creator as u64),
                RESERVED | FREEING => c.owner(),
                _ => None,
            };
            if let Some(m) = marker {
                if !attached.get(m as usize).copied().unwrap_or(false) {
                    bad = Some(format!("slot {i} ({c:?}) belongs to detached client {m}"));
                }
            }
        });
        if let Some(what) = bad {
            return Err(Error::Corrupted { what });
        }
        let sum: u64 = blocks.iter().map(|b| b.1).sum();
        let used = inner.alloc().usage().used;
        if sum != used {
            return Err(Error::Corrupted {
                what: format!("allocator says {used} bytes used, table entries own {sum}"),
            });
        }
        Ok(())
    }
}

/// An allocator block handed out by [`Store::raw_alloc`]; benchmarks only.
#[doc(hidden)]
#[derive(Debug)]
pub struct RawBlock(Block);

impl Store {
    /// Test hook for the hostile-region fuzz target; see [`crate::testing`].
    pub(crate) fn scribble_metadata(&self, offset: u64, bytes: &[u8]) {
        self.inner.scribble_metadata(offset, bytes)
    }

    /// Test hook: starts an ownership-changing step and allocates a block that no entry
    /// will ever name, as a process killed inside `create_object` leaves.
    pub(crate) fn leak_inside_allocator_step(&self, size: u64) -> Result<()> {
        self.inner.client().begin_op();
        self.inner.alloc().alloc(size).map(|_| ())
    }

    /// Test hook: a recovery that stops halfway (see `testing::interrupted_recovery`).
    pub(crate) fn recover_interrupted(&self) -> u64 {
        self.inner.world().recover_dead_interrupted()
    }

    /// Allocates a raw block with no table entry. For the allocator benchmark only: the
    /// block is not attributed to any object; free it with [`Store::raw_free`].
    #[doc(hidden)]
    pub fn raw_alloc(&self, size: u64) -> Result<RawBlock> {
        if self.inner.read_only {
            return Err(Error::ReadOnly { op: "raw_alloc" });
        }
        self.inner.alloc().alloc(size).map(RawBlock)
    }

    /// Frees a block from [`Store::raw_alloc`].
    #[doc(hidden)]
    pub fn raw_free(&self, block: RawBlock) -> Result<()> {
        self.inner.alloc().free(block.0)
    }
}

/// A writer handle: `&mut [u8]` over an object's memory until [`seal`](Self::seal).
/// Dropping it without sealing aborts the creation and frees the memory.
///
/// ```
/// use shmstore::{ObjectId, Store, StoreConfig};
/// let store = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20))?;
/// let id = ObjectId::of_key("x");
/// let c = store.create_object(&id, 100)?;
/// drop(c); // aborted
/// assert!(!store.contains(&id));
/// assert_eq!(store.stats().used, 0);
/// # Ok::<(), shmstore::Error>(())
/// ```
pub struct Creation {
    inner: Arc<Inner>,
    id: ObjectId,
    slot: SlotRef,
    data: *mut u8,
    len: usize,
    done: bool,
}

// SAFETY: the handle is the unique writer of its block; moving it to another thread moves
// that exclusivity with it.
unsafe impl Send for Creation {}
// SAFETY: `&Creation` only gives shared reads of the block.
unsafe impl Sync for Creation {}

impl Creation {
    /// The object's id.
    ///
    /// ```
    /// # let store = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(1 << 20))?;
    /// let id = shmstore::ObjectId::of_key("a");
    /// assert_eq!(store.create_object(&id, 1)?.id(), id);
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn id(&self) -> ObjectId {
        self.id
    }

    /// Publishes the object: from now on its bytes never change while anyone pins it, and
    /// getters blocked on it wake up.
    ///
    /// ```
    /// # let store = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(1 << 20))?;
    /// let id = shmstore::ObjectId::of_key("a");
    /// let mut c = store.create_object(&id, 1)?;
    /// c[0] = 9;
    /// c.seal()?;
    /// assert_eq!(store.try_get(&id)?[0], 9);
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn seal(mut self) -> Result<()> {
        self.done = true;
        self.inner.table().seal(&self.id, self.slot)
    }

    /// Marks the object as never evicted (in a store created with [`WhenFull::Evict`]);
    /// it stays until deleted. Call before sealing.
    ///
    /// ```
    /// use shmstore::{ObjectId, Store, StoreConfig, WhenFull};
    /// let cfg = StoreConfig { when_full: WhenFull::Evict, ..StoreConfig::with_capacity(1 << 20) };
    /// let store = Store::create_anonymous(&cfg)?;
    /// let mut c = store.create_object(&ObjectId::of_key("model-weights"), 100)?;
    /// c.set_evictable(false)?;
    /// c.seal()?;
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn set_evictable(&mut self, evictable: bool) -> Result<()> {
        if evictable {
            return Ok(()); // objects are evictable unless marked otherwise
        }
        self.inner.table().set_no_evict(self.slot)
    }

    /// Abandons the object and frees its memory (the same as dropping the handle).
    ///
    /// ```
    /// # let store = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(1 << 20))?;
    /// let id = shmstore::ObjectId::of_key("a");
    /// store.create_object(&id, 1)?.abort();
    /// assert!(store.create_object(&id, 1).is_ok());
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn abort(mut self) {
        self.do_abort();
    }

    fn do_abort(&mut self) {
        if self.done {
            return;
        }
        self.done = true;
        let _ = self.inner.table().abort(&self.id, self.slot);
    }
}

impl Drop for Creation {
    fn drop(&mut self) {
        self.do_abort();
    }
}

impl Deref for Creation {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `data..data+len` lies in our block (checked by `resolve`), which stays
        // allocated while this handle lives and is written only through it.
        unsafe { std::slice::from_raw_parts(self.data, self.len) }
    }
}

impl DerefMut for Creation {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`; `&mut self` makes this the only live reference.
        unsafe { std::slice::from_raw_parts_mut(self.data, self.len) }
    }
}

impl fmt::Debug for Creation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Creation")
            .field("id", &self.id)
            .field("len", &self.len)
            .finish()
    }
}

/// An immutable, zero-copy view of a sealed object. Pins the object until dropped: its
/// bytes stay valid and unchanged even if the object is deleted meanwhile.
///
/// ```
/// use shmstore::{ObjectId, Store, StoreConfig};
/// let store = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20))?;
/// let id = ObjectId::of_key("v");
/// store.put(&id, b"hello")?;
/// let v = store.try_get(&id)?;
/// let v2 = v.try_clone()?; // another pin
/// std::thread::spawn(move || assert_eq!(&*v2, b"hello")).join().unwrap();
/// assert_eq!(v.len(), 5);
/// # Ok::<(), shmstore::Error>(())
/// ```
pub struct View {
    inner: Arc<Inner>,
    id: ObjectId,
    slot: SlotRef,
    meta: *const u8,
    meta_len: usize,
    data: *const u8,
    len: usize,
}

// SAFETY: a view only reads immutable (sealed, pinned) bytes; unpinning is atomic.
unsafe impl Send for View {}
// SAFETY: as above.
unsafe impl Sync for View {}

impl View {
    /// The object's id.
    ///
    /// ```
    /// # let store = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(1 << 20))?;
    /// # let id = shmstore::ObjectId::of_key("a"); store.put(&id, b"")?;
    /// assert_eq!(store.try_get(&id)?.id(), id);
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn id(&self) -> ObjectId {
        self.id
    }

    /// The object's metadata blob (empty if none was given).
    ///
    /// ```
    /// # let store = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(1 << 20))?;
    /// # let id = shmstore::ObjectId::of_key("a"); store.put(&id, b"")?;
    /// assert!(store.try_get(&id)?.meta().is_empty());
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn meta(&self) -> &[u8] {
        // SAFETY: within the pinned block (checked by `resolve`); immutable after seal.
        unsafe { std::slice::from_raw_parts(self.meta, self.meta_len) }
    }

    /// Another view of the same object, with its own pin.
    ///
    /// ```
    /// # let store = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(1 << 20))?;
    /// # let id = shmstore::ObjectId::of_key("a"); store.put(&id, b"abc")?;
    /// let v = store.try_get(&id)?;
    /// let w = v.try_clone()?;
    /// drop(v);
    /// assert_eq!(&*w, b"abc");
    /// assert_eq!(store.stats().pins, 1);
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn try_clone(&self) -> Result<View> {
        let inner = &self.inner;
        inner.table().add_pin(self.slot)?;
        Ok(View {
            inner: Arc::clone(inner),
            ..*self
        })
    }

    /// The view's pointer into shared memory (stable for the view's lifetime).
    ///
    /// ```
    /// # let store = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(1 << 20))?;
    /// # let id = shmstore::ObjectId::of_key("a"); store.put(&id, b"abc")?;
    /// let v = store.try_get(&id)?;
    /// assert_eq!(v.as_ptr(), store.try_get(&id)?.as_ptr()); // zero-copy: same memory
    /// assert_eq!(v.as_ptr() as usize % 64, 0);
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn as_ptr(&self) -> *const u8 {
        self.data
    }
}

impl Deref for View {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `data..data+len` lies in the block (checked by `resolve`), which stays
        // allocated and unchanged while our pin is held.
        unsafe { std::slice::from_raw_parts(self.data, self.len) }
    }
}

impl AsRef<[u8]> for View {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl Drop for View {
    fn drop(&mut self) {
        let inner = &self.inner;
        let _ = inner.table().unpin(self.slot);
        if inner.evicts() {
            // An unpinned object may now be evicted: nudge creators waiting for space.
            inner.globals.space.nudge();
        }
    }
}

impl fmt::Debug for View {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("View")
            .field("id", &self.id)
            .field("len", &self.len)
            .finish()
    }
}
