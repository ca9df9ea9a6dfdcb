//! One attachment of this process to a store: the validated sections of the mapping, and
//! the client slot this process holds in it.
//!
//! [`Inner`] owns the mapping and the views of its sections (every one bounds- and
//! alignment-checked once, at attach). The client slot is per *process*, not per
//! `Inner`: after `fork()` the child shares the parent's `Inner` (the mapping is the same
//! at the same address), but it must never pin, create or release in the parent's name.
//! So the slot lives in a [`Binding`] stamped with the fork generation it was made in
//! ([`crate::liveness`]). [`Inner::binding`] returns the binding of the calling process,
//! claiming a slot of its own on first use in a forked child; an inherited binding is
//! never used, released or freed by the child (docs/design.md, "Fork").
//!
//! [`Actor`] is "this process, acting through its binding": it builds the table view that
//! pins in its own column, brackets ownership-changing steps in its own slot, and runs
//! recovery as its own client.
//!
//! It also owns this process's population of the mapping: which 2 MiB chunks of the heap
//! it has populated (a process-local bitmap), the background thread that populates the
//! rest, and, in the creator of a `HugePages::Auto` store, the rebuild of heap and
//! metadata as 2 MiB pages (`MADV_COLLAPSE`), which changes how the kernel holds the
//! pages and never their contents (docs/design.md, "Huge pages").

use crate::alloc::{Allocator, Block, Padded, SlabDesc};
use crate::capacity::{self, Globals, PageOwners};
use crate::client::{self, Claimed, ClientHeader, Clients, Liveness, SlotLocks};
use crate::error::{Error, Result};
use crate::layout::{
    summary_words, Superblock, CLASSES, FLAG_EVICT, FLAG_REMOVE_WHEN_UNUSED, GLOBALS_SIZE, HINTS,
    WAIT_BUCKETS,
};
use crate::liveness::{self, LockFile};
use crate::recovery::{RecoveryReport, World, MAINTENANCE_PERIOD};
use crate::region::Mapping;
use crate::sync::{AtomicPtr, AtomicU16, AtomicU32, AtomicU64, Ordering};
use crate::table::{Entry, Event, Reclaimer, Sections, Slot, SlotRef, Table, WaitBucket};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::AttachOptions;

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
// SAFETY: atomics of u32 are valid for every bit pattern.
unsafe impl SharedPod for AtomicU32 {}
// SAFETY: Padded is repr(C) around an AtomicU64 plus alignment padding.
unsafe impl SharedPod for Padded<AtomicU64> {}
// SAFETY: repr(C) of AtomicU64s.
unsafe impl SharedPod for SlabDesc {}
// SAFETY: repr(C) of AtomicU64s.
unsafe impl SharedPod for Slot {}
// SAFETY: repr(C) of AtomicU32s.
unsafe impl SharedPod for WaitBucket {}
// SAFETY: repr(C) of AtomicU64s and plain u64s.
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
        || (base as usize).wrapping_add(off as usize) % std::mem::align_of::<T>() != 0
    {
        return Err(Error::Corrupted {
            what: format!("section at {off} ({count} items) does not fit the mapping"),
        });
    }
    // SAFETY: in bounds and aligned (checked above); T is valid for any bytes (SharedPod);
    // lifetime per this function's contract. All access is through atomics.
    Ok(unsafe { std::slice::from_raw_parts(base.add(off as usize) as *const T, count as usize) })
}

/// Slot locks on the store file: slot `i` is held while the first byte of its client
/// header is locked by the holder's lock descriptor (see [`crate::liveness`]).
pub(super) struct SlotLockFile {
    file: LockFile,
    base: u64,
    stride: u64,
}

impl SlotLockFile {
    fn offset(&self, i: u64) -> u64 {
        self.base + i * self.stride
    }
}

impl SlotLocks for SlotLockFile {
    fn try_lock(&self, i: u64) -> bool {
        self.file.try_lock(self.offset(i))
    }
    fn unlock(&self, i: u64) {
        self.file.unlock(self.offset(i))
    }
    fn locked_elsewhere(&self, i: u64) -> bool {
        self.file.locked_elsewhere(self.offset(i))
    }
}

/// The client slot this process holds, with the lock that proves it alive.
pub(super) struct Binding {
    /// The fork generation it belongs to: usable only where it equals the process's own.
    pub generation: u64,
    /// Client slot index.
    pub index: u16,
    locks: SlotLockFile,
}

impl Binding {
    fn current(&self) -> bool {
        self.generation == liveness::generation()
    }
}

/// The attached store, shared by every handle of this process (and, after a fork, by
/// the child's inherited handles).
pub(super) struct Inner {
    // Field order: the sections borrow from `map`, which must drop last.
    pages: &'static [AtomicU64],
    summary: &'static [AtomicU64],
    slabs: &'static [SlabDesc],
    partial: &'static [AtomicU64],
    hints: &'static [Padded<AtomicU64>],
    slots: &'static [Slot],
    buckets: &'static [AtomicU64],
    waits: &'static [WaitBucket],
    pins: &'static [AtomicU16],
    /// Slot + 1 at each page run's first and last page ([`PageOwners`]).
    owners: &'static [AtomicU32],
    pub(super) globals: &'static Globals,
    clients: &'static [ClientHeader],
    /// This process's [`Binding`] (a leaked box; null until bound). Replaced only in a
    /// forked child, whose old pointer is the parent's and is left alone.
    binding: AtomicPtr<Binding>,
    /// Process-local clock for the maintenance schedule.
    epoch: Instant,
    /// `epoch`-relative ns before which no scheduled maintenance runs.
    next_maintenance_ns: AtomicU64,
    pub(super) get_spin: Duration,
    pub(super) read_only: bool,
    /// Process-local: which [`POPULATE_CHUNK`]s of the heap this process has populated
    /// (one bit each), so that populating on use costs one madvise per chunk, once.
    pub(super) populated: Box<[AtomicU64]>,
    /// Process-local: objects of at least [`POPULATE_MIN`] bytes this process is writing
    /// now. The background populate thread waits while there are any, so that a large
    /// put does not share memory bandwidth (and the kernel's page zeroing) with it.
    pub(super) large_writes: AtomicU64,
    /// Process-local, the creator's only: non-zero while it rebuilds the heap as 2 MiB
    /// pages (`HugePages::Auto`, see [`Inner::collapse_chunk`]): 1 plus the chunks the
    /// kernel failed in a row; 0 otherwise, or once the kernel said it cannot.
    collapse: AtomicU64,
    /// Process-local: how many heap chunks were offered to the kernel to rebuild, bottom
    /// up (`prefault` and the background thread go on from here).
    collapse_from: AtomicU64,
    /// The fork generation of the process that rebuilds (a forked child does not).
    collapse_generation: AtomicU64,
    /// Process-local: 1 once [`Inner::collapse_metadata`] ran.
    metadata_collapsed: AtomicU64,
    /// Process-local: heap chunks the kernel failed to rebuild for a reason that may pass
    /// (a page in use for a moment, no free 2 MiB of memory just then), to offer again.
    collapse_retry: std::sync::Mutex<Vec<u64>>,
    /// The background populate thread: its stop flag, handle and fork generation.
    #[allow(clippy::type_complexity)]
    populator: std::sync::Mutex<Option<(Arc<AtomicU64>, std::thread::JoinHandle<()>, u64)>>,
    heap: *mut u8,
    pub(super) sb: Superblock,
    pub(super) map: Mapping,
}

// SAFETY: `heap` points into the shared mapping owned by `map`; all shared state is accessed
// through atomics, and payload bytes are written only through a `Creation` (unique writer)
// and read only after seal (immutable thereafter while pinned). The binding pointer is
// only ever read (the box it names lives until `Inner` drops).
unsafe impl Send for Inner {}
// SAFETY: as above.
unsafe impl Sync for Inner {}

/// Creates between two looks at the maintenance clock (see [`crate::recovery`]).
const MAINTENANCE_CHECK: u64 = 256;
/// Objects at least this large are populated on first use (docs/design.md, "Prefaulting").
pub(super) const POPULATE_MIN: u64 = 256 << 10;
/// The heap's population is tracked per chunk of this many bytes.
pub(super) const POPULATE_CHUNK: u64 = 2 << 20;
/// What the background population does between two looks at this process's large
/// writes (and at its stop flag).
const POPULATE_PIECE: u64 = 256 << 10;
/// Chunks in a row the kernel may fail to rebuild before the creator stops asking.
const GIVE_UP_AFTER: u64 = 8;
/// The pauses before each round of offering the chunks the kernel failed to rebuild
/// again ([`Inner::retry_collapses`]).
const RETRY_PAUSES: [Duration; 3] = [
    Duration::from_millis(20),
    Duration::from_millis(200),
    Duration::from_millis(1000),
];
/// Heap bytes the creator populates before `create` returns (the rest in background):
/// room for a 64 MiB object with its header, which spills one page past 64 MiB (without
/// the extra chunk, a first 64 MiB put zeroed that chunk's 2 MiB itself).
pub(super) const FIRST_POPULATED: u64 = (64 << 20) + POPULATE_CHUNK;

/// Waits `pause`, or less when `stop` says so: `false` if it stopped. Looks every
/// [`STOP_POLL`]: the pauses before collapse retries last up to a second, and dropping
/// the store (which stops the thread and waits for it) must not wait them out. A poll, not
/// a wait for an event: the thread only warms pages ahead of use, so stopping a few
/// milliseconds late changes no result.
pub(super) fn pause_unless_stopped(pause: Duration, stop: &impl Fn() -> bool) -> bool {
    let deadline = std::time::Instant::now() + pause;
    loop {
        if stop() {
            return false;
        }
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return true;
        }
        std::thread::sleep(left.min(STOP_POLL));
    }
}

/// How often a pause of the background thread looks at its stop flag.
const STOP_POLL: Duration = Duration::from_millis(5);

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop_populating();
        let p = self.binding.load(Ordering::Acquire);
        if p.is_null() {
            return;
        }
        // SAFETY: a published binding stays allocated until this drop.
        let b = unsafe { &*p };
        if !b.current() {
            // Inherited from the parent and never rebound here, or left at exit
            // (`leave_all_at_exit`): the slot is not ours to release. Our copy of the box
            // is ours to free: no handle remains, so no thread holds a reference into it,
            // and its lock file closes nothing from another generation.
            // SAFETY: the box was leaked by `bind` (here or in the parent, whose heap this
            // process copied) and is freed only here.
            drop(unsafe { Box::from_raw(p) });
            return;
        }
        let remove = self.sb.flags & FLAG_REMOVE_WHEN_UNUSED != 0;
        let actor = Actor {
            inner: self,
            index: b.index,
            locks: &b.locks,
        };
        if remove && !self.read_only {
            // Dead clients would keep the store "in use" forever: recover them first.
            actor.recover();
        }
        // Every handle holds an Arc<Inner>, so no pins or creations remain: leave the slot.
        let clients = actor.clients();
        clients.release(b.index as u64);
        let others = remove && (0..clients.len()).any(|c| clients.liveness(c) != Liveness::Free);
        clients.detach(b.index as u64);
        if remove && !others {
            self.remove_file();
        }
        // SAFETY: the box was leaked by `bind` in this process and is freed only here.
        drop(unsafe { Box::from_raw(p) });
    }
}

impl Inner {
    /// Maps the sections of a validated superblock and claims a client slot.
    pub(super) fn attach(map: Mapping, sb: Superblock, opts: &AttachOptions) -> Result<Arc<Inner>> {
        let inner = Self::map_sections(map, sb, opts)?;
        // On failure `inner` drops here with no binding: the mapping and file close.
        let actor = inner.actor()?;
        if opts.recover_on_attach {
            // Reclaim what dead processes left, now rather than at the first full store.
            actor.maintain();
        } else {
            inner
                .next_maintenance_ns
                .store(MAINTENANCE_PERIOD.as_nanos() as u64, Ordering::Relaxed);
        }
        Ok(inner)
    }

    /// Checks and maps every section; no client slot yet.
    fn map_sections(map: Mapping, sb: Superblock, opts: &AttachOptions) -> Result<Arc<Inner>> {
        if opts.read_only {
            // To the end of the mapping: the heap is the last section, and a huge-page
            // mapping can only change protection in whole pages (the tail past the heap
            // is padding to a whole page).
            let to_end = (map.len() as u64).saturating_sub(sb.heap_offset);
            map.protect_read_only(sb.heap_offset, to_end.max(sb.heap_size))?;
        }
        let base = map.base();
        let total = map.len();
        const _: () = assert!(std::mem::size_of::<Globals>() as u64 == GLOBALS_SIZE);
        if sb.pin_stride < sb.max_clients
            || sb.client_stride != std::mem::size_of::<ClientHeader>() as u64
        {
            return Err(Error::Corrupted {
                what: "pin rows narrower than the client count, or a foreign client size".into(),
            });
        }
        // SAFETY: `base`/`total` describe `map`, which `Inner` owns and drops after these
        // slices (field order); the slices never leave `Inner`.
        let (
            globals,
            pages,
            summary,
            owners,
            slabs,
            partial,
            hints,
            slots,
            buckets,
            waits,
            pins,
            clients,
        ) = unsafe {
            (
                &section::<Globals>(base, total, sb.globals_offset, 1)?[0],
                section(base, total, sb.page_bitmap_offset, sb.pages.div_ceil(64))?,
                section(base, total, sb.page_summary_offset, summary_words(sb.pages))?,
                section(base, total, sb.page_owners_offset, sb.pages)?,
                section(base, total, sb.slab_desc_offset, sb.slabs)?,
                section(base, total, sb.partial_offset, sb.partial_words * CLASSES)?,
                section(base, total, sb.hints_offset, HINTS)?,
                section(base, total, sb.slots_offset, sb.table_slots)?,
                section(base, total, sb.buckets_offset, sb.table_slots)?,
                section(base, total, sb.wait_offset, WAIT_BUCKETS)?,
                section(
                    base,
                    total,
                    sb.pins_offset,
                    sb.table_slots.saturating_mul(sb.pin_stride),
                )?,
                section(base, total, sb.clients_offset, sb.max_clients)?,
            )
        };
        if sb.heap_offset + sb.heap_size > total as u64 {
            return Err(Error::Corrupted {
                what: "heap extends past the mapping".into(),
            });
        }
        let inner = Arc::new(Inner {
            globals,
            pages,
            summary,
            owners,
            slabs,
            partial,
            hints,
            slots,
            buckets,
            waits,
            pins,
            clients,
            binding: AtomicPtr::new(std::ptr::null_mut()),
            epoch: Instant::now(),
            next_maintenance_ns: AtomicU64::new(0),
            get_spin: opts.get_spin,
            read_only: opts.read_only,
            populated: (0..sb.heap_size.div_ceil(POPULATE_CHUNK).div_ceil(64))
                .map(|_| AtomicU64::new(if opts.prefault { u64::MAX } else { 0 }))
                .collect(),
            large_writes: AtomicU64::new(0),
            collapse: AtomicU64::new(0),
            collapse_from: AtomicU64::new(0),
            collapse_generation: AtomicU64::new(0),
            metadata_collapsed: AtomicU64::new(0),
            collapse_retry: std::sync::Mutex::new(Vec::new()),
            populator: std::sync::Mutex::new(None),
            // SAFETY: heap_offset + heap_size <= total (checked above).
            heap: unsafe { base.add(sb.heap_offset as usize) },
            sb,
            map,
        });
        Ok(inner)
    }

    /// Test hook: what a process killed right after claiming a client slot leaves (the
    /// slot taken, nothing else done; a dead client's slot only if `take_dead`). The lock
    /// descriptor and the mapping stay open until the process dies. Returns the slot.
    pub(super) fn claim_and_stop(map: Mapping, sb: Superblock, take_dead: bool) -> Result<u64> {
        let inner = Self::map_sections(map, sb, &AttachOptions::default())?;
        let locks = SlotLockFile {
            file: LockFile::open(inner.map.file(), inner.map.path())?,
            base: inner.sb.clients_offset,
            stride: inner.sb.client_stride,
        };
        let clients = Clients::new(inner.clients, &locks, None);
        let claimed = (0..clients.len()).find(|&i| match clients.try_claim(i, take_dead) {
            Some(Claimed::Dead) => true,
            Some(Claimed::Fresh) => !take_dead,
            None => false,
        });
        std::mem::forget((locks, inner));
        claimed.ok_or(Error::TooManyClients {
            max: sb.max_clients as u32,
        })
    }

    /// This process's binding; claims a client slot on first use in a forked child.
    pub(super) fn binding(&self) -> Result<&Binding> {
        let p = self.binding.load(Ordering::Acquire);
        if !p.is_null() {
            // SAFETY: a published binding stays allocated until `Inner` drops.
            let b = unsafe { &*p };
            if b.current() {
                return Ok(b);
            }
        }
        self.bind(p)
    }

    /// Slow path of [`binding`](Self::binding): claims a slot and publishes it in place of
    /// `seen` (null, or a binding inherited from the parent).
    #[cold]
    fn bind(&self, mut seen: *mut Binding) -> Result<&Binding> {
        let locks = SlotLockFile {
            file: LockFile::open(self.map.file(), self.map.path())?,
            base: self.sb.clients_offset,
            stride: self.sb.client_stride,
        };
        let index = self.claim_slot(&locks)?;
        let mine = Box::into_raw(Box::new(Binding {
            generation: liveness::generation(),
            index,
            locks,
        }));
        loop {
            match self
                .binding
                .compare_exchange(seen, mine, Ordering::AcqRel, Ordering::Acquire)
            {
                // SAFETY: just published; it lives until `Inner` drops.
                Ok(_) => return Ok(unsafe { &*mine }),
                Err(now) => {
                    // SAFETY: `now` was published, so it is a live binding.
                    if unsafe { &*now }.current() {
                        // Another thread of this process bound first: use its slot.
                        // SAFETY: `mine` was never published; we own it.
                        let mine = unsafe { Box::from_raw(mine) };
                        Clients::new(self.clients, &mine.locks, Some(index as u64))
                            .folding_into(&self.globals.totals)
                            .detach(index as u64);
                        // SAFETY: as above.
                        return Ok(unsafe { &*now });
                    }
                    seen = now;
                }
            }
        }
    }

    /// Claims a client slot with `locks`: a free one, or a dead client's, recovered first.
    fn claim_slot(&self, locks: &SlotLockFile) -> Result<u16> {
        let clients = Clients::new(self.clients, locks, None).folding_into(&self.globals.totals);
        let pid = std::process::id() as u64;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        // Free slots first; then dead clients' slots. A slot may be briefly busy (a
        // recoverer about to release it): look a few times.
        for pass in 0..4 {
            for i in 0..clients.len() {
                let ok = match clients.try_claim(i, pass > 0) {
                    Some(Claimed::Fresh) => true,
                    Some(Claimed::Dead) => {
                        // Return what the dead client held, as that client, then move in.
                        let actor = Actor {
                            inner: self,
                            index: i as u16,
                            locks,
                        };
                        actor
                            .world()
                            .recover_own_slot(&mut RecoveryReport::default());
                        clients.finish_claim(i)
                    }
                    None => false,
                };
                if ok {
                    clients.describe(i, pid, now);
                    return Ok(i as u16);
                }
            }
            std::thread::yield_now();
        }
        Err(Error::TooManyClients {
            max: self.sb.max_clients as u32,
        })
    }

    /// This process acting through its binding.
    pub(super) fn actor(&self) -> Result<Actor<'_>> {
        let b = self.binding()?;
        Ok(Actor {
            inner: self,
            index: b.index,
            locks: &b.locks,
        })
    }

    /// The table for lookups only (contains, list, stats): never pins, so it needs no
    /// client slot (and works in a forked child that has none yet).
    pub(super) fn lookup_table(&self) -> Table<'_> {
        Table::new(self.sections(), 0, &NoReclaim)
    }

    fn sections(&self) -> Sections<'_> {
        Sections {
            slots: self.slots,
            buckets: self.buckets,
            waits: self.waits,
            pins: self.pins,
            stride: self.sb.pin_stride as usize,
        }
    }

    /// The owner of each page run, by address (a hint for eviction).
    pub(super) fn page_owners(&self) -> PageOwners<'_> {
        PageOwners(self.owners)
    }

    pub(super) fn alloc(&self) -> Allocator<'_> {
        Allocator::new(
            self.pages,
            self.summary,
            self.sb.pages,
            self.slabs,
            self.partial,
            self.hints,
        )
    }

    /// Client headers, for tools and audits (no liveness).
    pub(super) fn client_headers(&self) -> &[ClientHeader] {
        self.clients
    }

    /// Checks an entry read from shared memory and turns it into a block and pointers.
    pub(super) fn resolve(&self, e: &Entry) -> Result<Resolved> {
        let (block, meta_pad) = e.block(self.sb.heap_size)?;
        // SAFETY: offset + size <= heap_size (checked by Entry::block), so both pointers
        // stay inside the heap.
        let (meta, data) = unsafe {
            let m = self.heap.add(e.offset as usize);
            (m, m.add(meta_pad as usize))
        };
        Ok(Resolved { block, meta, data })
    }

    /// Populates this process's page tables for an object's bytes `[data, data + len)`
    /// in the heap, for writing or reading, if it is large and its chunks are not
    /// populated here yet (see [`POPULATE_MIN`]).
    pub(super) fn populate(&self, data: *const u8, len: u64, write: bool) {
        if len >= POPULATE_MIN {
            self.populate_chunks(data, len, write);
        }
    }

    fn populate_chunks(&self, data: *const u8, len: u64, write: bool) {
        let off = (data as usize).wrapping_sub(self.heap as usize) as u64;
        if off.checked_add(len).is_none_or(|e| e > self.sb.heap_size) {
            return;
        }
        let (first, last) = (off / POPULATE_CHUNK, (off + len - 1) / POPULATE_CHUNK);
        let mut todo = None;
        for c in first..=last {
            if self.claim_chunk(c) {
                todo.get_or_insert(c);
            }
        }
        let Some(from) = todo else { return };
        let start = from * POPULATE_CHUNK;
        let end = ((last + 1) * POPULATE_CHUNK).min(self.sb.heap_size);
        // A read-only attach can only populate for reading.
        let write = write && !self.read_only;
        self.map.populate(
            (self.sb.heap_offset + start) as usize,
            (end - start) as usize,
            write,
        );
    }

    /// Marks chunk `c` of the heap populated in this process: true if it was not (the
    /// caller then populates it). Lock-free: one `fetch_or` on the chunk's bit.
    fn claim_chunk(&self, c: u64) -> bool {
        let bit = 1u64 << (c % 64);
        self.populated[(c / 64) as usize].fetch_or(bit, Ordering::Relaxed) & bit == 0
    }

    /// Populates the whole heap, chunk by chunk, on a background thread: in the creator
    /// for writing (the kernel zeroes each tmpfs page at its first touch, so this is where
    /// that happens, once), bottom up, rebuilding chunks as 2 MiB pages where asked to
    /// ([`Inner::collapse_chunk`]) and then the metadata; in others for reading (mapping
    /// only), bottom up. The thread holds no reference that keeps the store alive:
    /// dropping the store stops it (and waits for its current chunk, a few milliseconds).
    pub(super) fn populate_in_background(self: &Arc<Self>, write: bool) {
        if write {
            self.populate_head();
        }
        // The creator's thread goes on from the chunks rebuilt above (none where the
        // kernel rebuilds nothing: then the head's chunks are claimed, and skipped).
        let first = if write {
            self.collapse_from.load(Ordering::Relaxed)
        } else {
            0
        };
        let stop = Arc::new(AtomicU64::new(0));
        let this = Arc::as_ptr(self) as usize;
        let flag = Arc::clone(&stop);
        let spawned = std::thread::Builder::new()
            .name("shmstore-populate".into())
            .spawn(move || {
                // SAFETY: `Inner::drop` sets `flag` and joins this thread before any field
                // of the `Inner` is dropped, so the pointer stays valid while we run.
                let inner = unsafe { &*(this as *const Inner) };
                // A read-only attach can only populate for reading.
                let write = write && !inner.read_only;
                let heap = inner.sb.heap_size;
                for c in first..heap.div_ceil(POPULATE_CHUNK) {
                    let (off, end) = (c * POPULATE_CHUNK, ((c + 1) * POPULATE_CHUNK).min(heap));
                    // Rebuilding a chunk as one 2 MiB page also populates it (and zeroes
                    // it, the first time): nothing more to do for it then.
                    if inner.collapse.load(Ordering::Relaxed) != 0 {
                        // Not while this process writes a large object (a poll, as
                        // below, and for the same reason).
                        while inner.large_writes.load(Ordering::Relaxed) != 0 {
                            if flag.load(Ordering::Relaxed) != 0 {
                                return;
                            }
                            std::thread::sleep(std::time::Duration::from_millis(1));
                        }
                        if flag.load(Ordering::Relaxed) != 0 {
                            return;
                        }
                        if inner.collapse_chunk(c) {
                            inner.claim_chunk(c);
                            continue;
                        }
                    }
                    if !inner.claim_chunk(c) {
                        continue; // populated already (the head, or by a put here)
                    }
                    // A claimed chunk is populated in pieces of 256 KiB, so that a large
                    // write waits for at most one piece (0.05 ms of zeroing) before this
                    // thread pauses for it: a put that raced this thread for memory
                    // bandwidth took 1.5-2.6x its warm time. The sleep is a poll, not a
                    // wait for an event: this thread only warms pages ahead of use, so
                    // resuming a millisecond late changes no result. A chunk left half
                    // done when the store is dropped needs nothing: population never
                    // changes contents.
                    let mut at = off;
                    while at < end {
                        if flag.load(Ordering::Relaxed) != 0 {
                            return;
                        }
                        if inner.large_writes.load(Ordering::Relaxed) != 0 {
                            std::thread::sleep(std::time::Duration::from_millis(1));
                            continue;
                        }
                        let piece = POPULATE_PIECE.min(end - at);
                        inner.map.populate(
                            (inner.sb.heap_offset + at) as usize,
                            piece as usize,
                            write,
                        );
                        at += piece;
                    }
                }
                // The metadata after the heap: every operation reads some of it, and
                // waits while the kernel copies a chunk it reads.
                inner.retry_collapses(|| flag.load(Ordering::Relaxed) != 0);
                inner.collapse_metadata(|| flag.load(Ordering::Relaxed) != 0);
            });
        if let Ok(handle) = spawned {
            let mut slot = self.populator.lock().unwrap_or_else(|e| e.into_inner());
            *slot = Some((stop, handle, liveness::generation()));
        }
    }

    /// The creator makes the bottom of the heap ([`FIRST_POPULATED`] bytes) ready before
    /// `create` returns (where the first objects go): a put right after create then finds
    /// its pages ready instead of faulting them in while the background thread zeroes the
    /// same region (two threads zeroing shmem pages at once contend in the kernel: 170 ms
    /// for a first 64 MiB put measured that way, against 7 ms warm). Rebuilt as 2 MiB
    /// pages where the kernel can, which zeroes them as populating does: a process that
    /// then reads the first objects maps 32 entries per 64 MiB, not 16,384, and no rebuild
    /// copies these pages later under a put.
    pub(super) fn populate_head(&self) {
        let head = FIRST_POPULATED.min(self.sb.heap_size);
        for i in 0..head / POPULATE_CHUNK {
            if self.collapse_chunk(i) {
                self.claim_chunk(i);
            }
        }
        self.populate_chunks(self.heap, head, true);
    }

    /// Whether this process's background population ran to its end (tests).
    #[cfg(test)]
    pub(super) fn population_finished(&self) -> bool {
        self.populator
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .is_some_and(|(_, handle, _)| handle.is_finished())
    }

    /// Whether heap chunk `c` is marked populated in this process (tests).
    #[cfg(test)]
    pub(super) fn chunk_populated(&self, c: u64) -> bool {
        self.populated[(c / 64) as usize].load(Ordering::Relaxed) & (1 << (c % 64)) != 0
    }

    /// Stops this process's background population, if it runs one, and waits for its
    /// current chunk (a few milliseconds): from then on no thread works for this store.
    pub(super) fn stop_populating(&self) {
        let populator = self
            .populator
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some((stop, handle, generation)) = populator {
            if generation == liveness::generation() {
                stop.store(1, Ordering::Relaxed);
                let _ = handle.join();
            } else {
                // Inherited across fork: the thread does not exist in this process.
                std::mem::forget(handle);
            }
        }
    }

    /// Populates this process's page tables for the whole store now: the metadata for
    /// writing (it is writable in every attach), the heap for writing, or for reading in a
    /// read-only attach (whose heap pages are read-only; writing there would fail).
    pub(super) fn populate_everything(&self) {
        self.map.populate(0, self.sb.heap_offset as usize, true);
        self.collapse_rest();
        self.populate_chunks(self.heap, self.sb.heap_size, true);
    }

    /// Makes this process (the creator) rebuild the heap as 2 MiB pages as it populates
    /// it, where the kernel can (`HugePages::Auto`; docs/design.md, "Huge pages").
    pub(super) fn rebuild_as_huge_pages(&self) {
        if !self.read_only && self.map.can_collapse() {
            self.collapse_generation
                .store(liveness::generation(), Ordering::Relaxed);
            self.collapse.store(1, Ordering::Relaxed);
        }
    }

    /// Offers every heap chunk not offered yet to the kernel to rebuild, now.
    pub(super) fn collapse_rest(&self) {
        let chunks = self.sb.heap_size.div_ceil(POPULATE_CHUNK);
        while self.collapse.load(Ordering::Relaxed) != 0 {
            let i = self.collapse_from.load(Ordering::Relaxed);
            if i >= chunks {
                break;
            }
            if self.collapse_chunk(i) {
                self.claim_chunk(i);
            }
        }
        self.retry_collapses(|| false);
        self.collapse_metadata(|| false);
    }

    /// Asks the kernel to rebuild the `i`-th heap chunk (2 MiB, on a 2 MiB boundary of the
    /// file and of every process's mapping) as one 2 MiB page:
    /// true if it did. From then on each process maps the chunk with one page-table entry,
    /// at its first touch, instead of 512 (docs/design.md, "Huge pages"). Called by one
    /// thread at a time, for `i` in order (`create` for the head, then the background
    /// thread, or `prefault` after stopping it). A kernel that cannot (`EINVAL`), or that failed [`GIVE_UP_AFTER`]
    /// chunks in a row, is asked no more: the rest stays on 4 KiB pages, which work the
    /// same.
    pub(super) fn collapse_chunk(&self, i: u64) -> bool {
        self.collapse_from.store(i + 1, Ordering::Relaxed);
        let off = i * POPULATE_CHUNK;
        if off + POPULATE_CHUNK > self.sb.heap_size || !self.may_collapse() {
            return false;
        }
        match self.collapse_heap_chunk(off) {
            Ok(()) => true,
            Err(e) => {
                self.collapse_failed(&e);
                if self.may_collapse() {
                    self.collapse_retry
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(off);
                }
                false
            }
        }
    }

    /// Offers the heap chunks the kernel failed to rebuild once more, in up to
    /// [`RETRY_PAUSES`] rounds with a pause before each (its failures are often
    /// transient: a page another thread holds for a moment, memory being compacted).
    /// Stops early when `stop` says so or the rebuild was given up.
    pub(super) fn retry_collapses(&self, stop: impl Fn() -> bool) {
        for pause in RETRY_PAUSES {
            let chunks = std::mem::take(
                &mut *self
                    .collapse_retry
                    .lock()
                    .unwrap_or_else(|e| e.into_inner()),
            );
            if chunks.is_empty() {
                return;
            }
            if !pause_unless_stopped(pause, &stop) {
                return;
            }
            let mut failed = Vec::new();
            for off in chunks {
                if stop() || !self.may_collapse() {
                    return;
                }
                if let Err(e) = self.collapse_heap_chunk(off) {
                    self.collapse_failed(&e);
                    failed.push(off);
                }
            }
            self.collapse_retry
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend(failed);
        }
    }

    /// Asks the kernel to rebuild the heap chunk at `off` (bytes from the heap's start) as
    /// one 2 MiB page. On success counts it in `Stats::huge_page_bytes` and ends the run
    /// of failures [`Inner::collapse_failed`] counts.
    fn collapse_heap_chunk(&self, off: u64) -> std::io::Result<()> {
        self.map.collapse(
            (self.sb.heap_offset + off) as usize,
            POPULATE_CHUNK as usize,
        )?;
        self.globals
            .huge_bytes
            .fetch_add(POPULATE_CHUNK, Ordering::Relaxed);
        self.collapse.store(1, Ordering::Relaxed);
        Ok(())
    }

    /// Whether this process still rebuilds pages (see [`Inner::collapse_chunk`]).
    fn may_collapse(&self) -> bool {
        if self.collapse.load(Ordering::Relaxed) == 0 {
            return false;
        }
        if self.collapse_generation.load(Ordering::Relaxed) != liveness::generation() {
            // A forked child: the rebuild, and its count in the globals, is the parent's.
            self.collapse.store(0, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// Counts a chunk the kernel did not rebuild; gives up on `EINVAL` (it cannot) or
    /// after [`GIVE_UP_AFTER`] failures in a row.
    fn collapse_failed(&self, e: &std::io::Error) {
        // `collapse` counts failures in a row above 1: 1 + failures.
        let failed = self.collapse.load(Ordering::Relaxed);
        if e.raw_os_error() == Some(libc::EINVAL) || failed >= GIVE_UP_AFTER {
            self.collapse.store(0, Ordering::Relaxed);
        } else {
            self.collapse.store(failed + 1, Ordering::Relaxed);
        }
    }

    /// Asks the kernel to rebuild the metadata below the heap (the object table, its pin
    /// rows, the allocator's bitmaps: every operation reads a few random lines of them)
    /// as 2 MiB pages, once per creator. Not counted in `Stats::huge_page_bytes`, which
    /// is about the heap.
    pub(super) fn collapse_metadata(&self, stop: impl Fn() -> bool) {
        if !self.may_collapse() || self.metadata_collapsed.swap(1, Ordering::Relaxed) != 0 {
            return;
        }
        let end = self.sb.heap_offset / POPULATE_CHUNK * POPULATE_CHUNK;
        let mut off = 0;
        while off < end && self.may_collapse() && !stop() {
            if let Err(e) = self.map.collapse(off as usize, POPULATE_CHUNK as usize) {
                self.collapse_failed(&e);
            }
            off += POPULATE_CHUNK;
        }
    }

    /// Whether a background population thread is registered for this store (tests).
    #[cfg(test)]
    pub(super) fn populating(&self) -> bool {
        self.populator
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// The payload heap in this process: address and length.
    pub(super) fn heap_region(&self) -> (*const u8, usize) {
        (self.heap as *const u8, self.sb.heap_size as usize)
    }

    pub(super) fn evicts(&self) -> bool {
        self.sb.flags & FLAG_EVICT != 0
    }

    /// Removes the store's file if no process is attached (this one has left) and the
    /// name still leads to the file this mapping was made from. The name goes while a
    /// read lock on the whole file is held through a description of our own (the
    /// mapping's may be shared with a forked parent): see `liveness`, "Removing a store's
    /// name".
    fn remove_file(&self) {
        let Some(path) = self.map.path() else { return };
        let Ok(lock) = LockFile::open_for_removal(self.map.file(), Some(path)) else {
            return;
        };
        if lock.try_lock_all_shared() && self.map.same_file_as(path) {
            let _ = std::fs::remove_file(path);
        }
    }

    /// Test hook: overwrites metadata bytes (before the heap) of the region. Only for the
    /// hostile-region fuzz target, which owns the store and runs single-threaded.
    pub(super) fn scribble_metadata(&self, offset: u64, bytes: &[u8]) {
        let end = self.sb.heap_offset as usize;
        let at = (offset as usize) % end;
        let n = bytes.len().min(end - at);
        // SAFETY: `at + n <= heap_offset <= mapping length`; no other thread or process
        // touches this store while the fuzz target runs (a plain write cannot race).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.map.base().add(at), n) };
    }
}

/// A checked block and the pointers into it.
pub(super) struct Resolved {
    pub block: Block,
    pub meta: *mut u8,
    pub data: *mut u8,
}

/// The reclaimer of the lookup-only table, which never frees.
struct NoReclaim;

impl Reclaimer for NoReclaim {
    fn reclaim(&self, _: &Table<'_>, _: SlotRef, _: Entry) {
        debug_assert!(false, "the lookup table never frees");
    }
}

/// This process acting as client `index` (its binding, or a slot it is moving into).
pub(super) struct Actor<'a> {
    pub inner: &'a Inner,
    pub index: u16,
    locks: &'a SlotLockFile,
}

/// Brackets one ownership-changing step of a client (see [`crate::recovery`]).
pub(super) struct OpGuard<'a>(&'a ClientHeader);

impl Drop for OpGuard<'_> {
    fn drop(&mut self) {
        client::end_op(self.0);
    }
}

impl Reclaimer for Actor<'_> {
    fn reclaim(&self, table: &Table<'_>, r: SlotRef, e: Entry) {
        // Release the slot even if the entry was corrupt: never strand a table slot.
        if let Ok(res) = self.inner.resolve(&e) {
            let _ = self.inner.alloc().free(res.block);
        }
        table.release(r);
        self.inner.globals.space.notify();
    }
    fn begin_op(&self) {
        client::begin_op(self.header());
    }
    fn end_op(&self) {
        client::end_op(self.header());
    }
    fn count(&self, event: Event) {
        let c = &self.header().counters;
        let size = |e: &Entry| e.block(self.inner.sb.heap_size).map_or(0, |(b, _)| b.size);
        let add = |a: &AtomicU64, v: u64| {
            a.fetch_add(v, Ordering::Relaxed);
        };
        match event {
            Event::Inserted(e) => {
                add(&c.inserted, 1);
                add(&c.bytes_in, size(&e));
                add(&c.payload_in, e.len);
            }
            Event::Sealed => add(&c.sealed, 1),
            Event::Aborted => add(&c.aborted, 1),
            Event::Deleted => add(&c.deleted, 1),
            Event::Freed(e) => {
                add(&c.freed, 1);
                add(&c.bytes_out, size(&e));
            }
            Event::Pinned => add(&c.pins_held, 1),
            Event::Unpinned => {
                c.pins_held.fetch_sub(1, Ordering::Relaxed);
            }
            Event::GetHit => add(&c.gets_hit, 1),
            Event::GetWaited => add(&c.gets_waited, 1),
            Event::GetMissed => add(&c.gets_miss, 1),
        }
    }
}

impl<'a> Actor<'a> {
    /// The table, pinning in our column.
    pub(super) fn table(&self) -> Table<'_> {
        Table::new(self.inner.sections(), self.index, self)
    }

    /// Every client slot, as we see them (a slot we release folds its counters into
    /// the store's totals).
    pub(super) fn clients(&self) -> Clients<'a> {
        Clients::new(self.inner.clients, self.locks, Some(self.index as u64))
            .folding_into(&self.inner.globals.totals)
    }

    pub(super) fn header(&self) -> &'a ClientHeader {
        &self.inner.clients[self.index as usize]
    }

    /// Starts an ownership-changing step; it ends when the guard drops.
    pub(super) fn op(&self) -> OpGuard<'a> {
        let h = self.header();
        client::begin_op(h);
        OpGuard(h)
    }

    /// What recovery works on, as this client.
    pub(super) fn world(&self) -> World<'_> {
        World {
            table: self.table(),
            alloc: self.inner.alloc(),
            globals: self.inner.globals,
            clients: self.clients(),
            me: self.index as u64,
            heap_size: self.inner.sb.heap_size,
            ops: self,
        }
    }

    /// Recovers dead clients and runs an owed leak sweep (see [`crate::recovery`]).
    pub(super) fn recover(&self) -> RecoveryReport {
        self.world().recover_dead()
    }

    /// Scheduled maintenance: recovery, at most every [`MAINTENANCE_PERIOD`] per process.
    pub(super) fn maintain(&self) {
        let inner = self.inner;
        let now = inner.epoch.elapsed().as_nanos() as u64;
        let next = inner.next_maintenance_ns.load(Ordering::Relaxed);
        if now < next
            || inner
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
        if inner.read_only {
            return; // a read-only attach cannot free memory; others will
        }
        self.recover();
    }

    /// Whether scheduled maintenance is due now (what [`maintain`](Self::maintain) would
    /// run, unless another thread takes it first).
    pub(super) fn maintenance_due(&self) -> bool {
        let inner = self.inner;
        !inner.read_only
            && inner.epoch.elapsed().as_nanos() as u64
                >= inner.next_maintenance_ns.load(Ordering::Relaxed)
    }

    /// Whether scheduled maintenance may be due on this create (every
    /// `MAINTENANCE_CHECK` ownership-changing steps of ours).
    pub(super) fn maintenance_check(&self) -> bool {
        self.header().ops_started.load(Ordering::Relaxed) % MAINTENANCE_CHECK == 0
    }

    /// Allocates `need` bytes; when full, first recovers what dead clients hold, then
    /// evicts by CLOCK if the store says so.
    pub(super) fn alloc_block(&self, need: u64) -> Result<Block> {
        let inner = self.inner;
        let alloc = inner.alloc();
        // Attempts report "full" as None, without numbers: the numbers cost a scan,
        // paid once below if the answer stays "full".
        let mut got = alloc.try_alloc(need)?;
        if got.is_none() && !inner.read_only && self.recover().bytes_reclaimed > 0 {
            got = alloc.try_alloc(need)?;
        }
        if got.is_none() && inner.evicts() {
            got = capacity::evict_until_fits(
                inner.globals,
                &self.table(),
                &alloc,
                &inner.page_owners(),
                need,
                &self.header().counters,
            )?;
        }
        if let Some(b) = got {
            return Ok(b);
        }
        self.header().counters.full.fetch_add(1, Ordering::Relaxed);
        let Error::Full {
            requested,
            largest_free,
            ..
        } = alloc.full(need)
        else {
            unreachable!("Allocator::full returns Full");
        };
        // Free bytes as `stats` counts them (blocks free inside slabs too), from the
        // counters rather than a scan of every slab.
        let used = inner.globals.census(inner.client_headers()).used;
        Err(Error::Full {
            requested,
            free: inner.sb.heap_size.saturating_sub(used),
            largest_free,
        })
    }

    /// Client `c` of an object's `creator` field (untrusted): its `ctl` and liveness.
    pub(super) fn creator(&self, c: u16) -> Result<(u64, Liveness, u64)> {
        let clients = self.clients();
        let Some(h) = clients.get(c as u64) else {
            return Err(Error::Corrupted {
                what: format!(
                    "creator {c} is not a client slot (the store has {})",
                    clients.len()
                ),
            });
        };
        Ok((
            clients.ctl(c as u64),
            clients.liveness(c as u64),
            h.pid.load(Ordering::Relaxed),
        ))
    }
}
