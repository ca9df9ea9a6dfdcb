//! Fragmentation, measured against a reference: the same allocation traces (same seed,
//! sizes and delete policy) run through the store and through rlsf, a TLSF allocator
//! (two-level segregated fit, the usual choice for bounded-time allocation over a fixed
//! arena) managing an arena of the same size, in the same run.
//!
//! Occupancy is payload bytes of live objects over capacity, for both: what a user can
//! actually keep in the store, whatever each allocator rounds or adds per block.
//!
//! The vLLM-mix rows run [`FILL_SEEDS`] traces each and report the mean and the worst:
//! where the first `Full` falls depends on the size of the one request that met it, which
//! moves a single trace's figure by a few points either way.

use crate::report::Report;
use shmstore::{Error, ObjectId, Store, StoreConfig, WhenFull};
use std::alloc::Layout;
use std::collections::VecDeque;
use std::mem::MaybeUninit;
use std::ptr::NonNull;

/// Something that places blocks in a fixed arena.
trait Arena {
    /// A handle for `size` bytes, or `None` when the arena cannot place it now.
    fn alloc(&mut self, size: u64) -> Result<Option<usize>, String>;
    fn free(&mut self, handle: usize) -> Result<(), String>;
}

/// The store itself: create + seal, delete (the path every user takes).
struct StoreArena<'a> {
    store: &'a Store,
    ids: Vec<Option<ObjectId>>,
}

impl Arena for StoreArena<'_> {
    fn alloc(&mut self, size: u64) -> Result<Option<usize>, String> {
        let id = ObjectId::of_key(format!("frag-{}", self.ids.len()));
        match self.store.create_object(&id, size) {
            Ok(c) => {
                c.seal().map_err(|e| e.to_string())?;
                self.ids.push(Some(id));
                Ok(Some(self.ids.len() - 1))
            }
            Err(Error::Full { .. }) => Ok(None),
            Err(e) => Err(e.to_string()),
        }
    }

    fn free(&mut self, handle: usize) -> Result<(), String> {
        let id = self.ids[handle].take().ok_or("freed twice")?;
        self.store.delete(&id).map_err(|e| e.to_string())
    }
}

/// rlsf's TLSF over a private arena of the same size (64-byte alignment, like the
/// store's blocks).
struct TlsfArena<'p> {
    tlsf: rlsf::Tlsf<'p, u32, u32, 28, 16>,
    blocks: Vec<Option<NonNull<u8>>>,
}

const ALIGN: usize = 64;

impl<'p> TlsfArena<'p> {
    fn new(pool: &'p mut [MaybeUninit<u8>]) -> Self {
        let mut tlsf = rlsf::Tlsf::new();
        tlsf.insert_free_block(pool);
        TlsfArena {
            tlsf,
            blocks: Vec::new(),
        }
    }
}

impl Arena for TlsfArena<'_> {
    fn alloc(&mut self, size: u64) -> Result<Option<usize>, String> {
        let layout = Layout::from_size_align(size as usize, ALIGN).map_err(|e| e.to_string())?;
        Ok(self.tlsf.allocate(layout).map(|p| {
            self.blocks.push(Some(p));
            self.blocks.len() - 1
        }))
    }

    fn free(&mut self, handle: usize) -> Result<(), String> {
        let p = self.blocks[handle].take().ok_or("freed twice")?;
        // SAFETY: `p` came from this allocator's `allocate` with alignment ALIGN and is
        // freed once (its slot is taken above).
        unsafe { self.tlsf.deallocate(p, ALIGN) };
        Ok(())
    }
}

/// xorshift64: the same sequence for both allocators.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Live objects: (handle, payload bytes).
#[derive(Default)]
struct Live {
    objects: Vec<(usize, u64)>,
    bytes: u64,
}

impl Live {
    fn add(&mut self, h: usize, size: u64) {
        self.objects.push((h, size));
        self.bytes += size;
    }

    fn remove_random(&mut self, a: &mut dyn Arena, rng: &mut Rng) -> Result<(), String> {
        let k = (rng.next() % self.objects.len() as u64) as usize;
        let (h, size) = self.objects.swap_remove(k);
        self.bytes -= size;
        a.free(h)
    }

    fn clear(&mut self, a: &mut dyn Arena) -> Result<(), String> {
        for (h, _) in self.objects.drain(..) {
            a.free(h)?;
        }
        self.bytes = 0;
        Ok(())
    }
}

struct Churn {
    full_events: u64,
    /// `Full` while the free bytes in total were enough.
    frag_failures: u64,
    end_occupancy: f64,
    /// Occupancy when a request met `Full`, averaged over those events: steadier than the
    /// end's snapshot, which one 256 MiB object moves by a quarter.
    mean_occupancy_at_full: f64,
}

/// Random creates with sizes log-uniform in `lo..hi`, kept near full: on `Full`, delete
/// random objects until the request fits.
fn churn(a: &mut dyn Arena, capacity: u64, ops: usize, lo: u64, hi: u64) -> Result<Churn, String> {
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let mut live = Live::default();
    let (mut full_events, mut frag_failures) = (0, 0);
    let mut occupancy_at_full = 0.0;
    for _ in 0..ops {
        let size = (lo as f64 * (hi as f64 / lo as f64).powf(rng.unit())) as u64;
        loop {
            if let Some(h) = a.alloc(size)? {
                live.add(h, size);
                break;
            }
            full_events += 1;
            occupancy_at_full += live.bytes as f64 / capacity as f64;
            if capacity - live.bytes >= size {
                frag_failures += 1;
            }
            if live.objects.is_empty() {
                return Err(format!("{size} B does not fit in an empty arena"));
            }
            live.remove_random(a, &mut rng)?;
        }
    }
    let end_occupancy = live.bytes as f64 / capacity as f64;
    live.clear(a)?;
    Ok(Churn {
        full_events,
        frag_failures,
        end_occupancy,
        mean_occupancy_at_full: occupancy_at_full / full_events.max(1) as f64,
    })
}

/// A vLLM-like size mix: processed images of 1-4 MiB, and with `videos`, one item in ten
/// a video of 10-30 MiB.
fn item_size(rng: &mut Rng, videos: bool) -> u64 {
    let (lo, hi) = if videos && rng.next() % 10 == 0 {
        (10u64 << 20, 30u64 << 20)
    } else {
        (1u64 << 20, 4u64 << 20)
    };
    lo + (rng.unit() * (hi - lo) as f64) as u64
}

/// Seeds of the vLLM-mix traces: the first is the one the rows used alone before.
const FILL_SEEDS: [u64; 8] = [
    0x9e37_79b9_7f4a_7c15,
    0x2545_f491_4f6c_dd1d,
    0x5851_f42d_4c95_7f2d,
    0x1405_7b7e_f767_814f,
    0xd1b5_4a32_d192_ed03,
    0xa076_1d64_78bd_642f,
    0xe703_7ed1_a0b4_28db,
    0x8ebc_6af0_9c88_c6e3,
];

/// Fills the empty arena until the first `Full` and returns the occupancy then; then
/// `rounds` times deletes a random quarter and fills again, and returns the lowest
/// occupancy at those later `Full`s.
fn fill_until_full(
    a: &mut dyn Arena,
    capacity: u64,
    videos: bool,
    rounds: usize,
    seed: u64,
) -> Result<(f64, f64), String> {
    let mut rng = Rng(seed);
    let mut live = Live::default();
    let mut at_full = Vec::new();
    for _ in 0..=rounds {
        loop {
            let size = item_size(&mut rng, videos);
            match a.alloc(size)? {
                Some(h) => live.add(h, size),
                None => break,
            }
        }
        at_full.push(live.bytes as f64 / capacity as f64);
        for _ in 0..live.objects.len() / 4 {
            live.remove_random(a, &mut rng)?;
        }
    }
    live.clear(a)?;
    let later = at_full[1..].iter().copied().fold(1.0, f64::min);
    Ok((at_full[0], later))
}

/// Runs every trace on the (empty) store and on TLSF over an arena of its capacity.
pub fn compare(store: &Store, churn_ops: usize, r: &mut Report) -> Result<(), String> {
    let capacity = store.stats().capacity;
    let mut pool: Vec<MaybeUninit<u8>> = Vec::with_capacity(capacity as usize);
    // SAFETY: MaybeUninit<u8> needs no initialisation; the capacity was just reserved.
    // (The pages stay untouched until TLSF writes a block header into them.)
    unsafe { pool.set_len(capacity as usize) };
    let mut ours = StoreArena {
        store,
        ids: Vec::new(),
    };
    let mut reference = TlsfArena::new(&mut pool);
    let (lo, hi) = (1u64 << 10, 256u64 << 20);
    let a = churn(&mut ours, capacity, churn_ops, lo, hi)?;
    let b = churn(&mut reference, capacity, churn_ops, lo, hi)?;
    r.fig("churn_ops", churn_ops as f64);
    r.fig("churn_full_events", a.full_events as f64);
    r.fig("churn_frag_failures", a.frag_failures as f64);
    r.fig("churn_end_occupancy", a.end_occupancy);
    r.fig("churn_mean_occupancy_at_full", a.mean_occupancy_at_full);
    r.fig("tlsf_churn_full_events", b.full_events as f64);
    r.fig("tlsf_churn_frag_failures", b.frag_failures as f64);
    r.fig("tlsf_churn_end_occupancy", b.end_occupancy);
    r.fig(
        "tlsf_churn_mean_occupancy_at_full",
        b.mean_occupancy_at_full,
    );
    let say = |c: &Churn| {
        format!(
            "{:.1}% full when 'full' (mean), {:.1}% at end, {} of {} 'full' had the bytes",
            c.mean_occupancy_at_full * 100.0,
            c.end_occupancy * 100.0,
            c.frag_failures,
            c.full_events
        )
    };
    r.row(
        format!("churn {churn_ops} ops, 1 KiB..256 MiB, near full"),
        say(&a),
        format!("rlsf (TLSF), same trace: {}", say(&b)),
        format!(
            "{:.2}x",
            a.mean_occupancy_at_full / b.mean_occupancy_at_full
        ),
        "occupancy >= TLSF",
    );
    // Per mix, the keys: first `Full` (ours, TLSF), lowest refill (ours, TLSF), each as
    // the mean and then the worst over the traces, and how many traces refill below TLSF.
    for (videos, label, keys) in [
        (
            false,
            "vLLM mix: images 1-4 MiB",
            [
                "images_first_full_occupancy",
                "tlsf_images_first_full_occupancy",
                "images_refill_full_occupancy",
                "tlsf_images_refill_full_occupancy",
                "images_first_full_occupancy_min",
                "tlsf_images_first_full_occupancy_min",
                "images_refill_full_occupancy_min",
                "tlsf_images_refill_full_occupancy_min",
                "images_refill_traces_below_tlsf",
            ],
        ),
        (
            true,
            "vLLM mix: images + 10% videos 10-30 MiB",
            [
                "videos_first_full_occupancy",
                "tlsf_videos_first_full_occupancy",
                "videos_refill_full_occupancy",
                "tlsf_videos_refill_full_occupancy",
                "videos_first_full_occupancy_min",
                "tlsf_videos_first_full_occupancy_min",
                "videos_refill_full_occupancy_min",
                "tlsf_videos_refill_full_occupancy_min",
                "videos_refill_traces_below_tlsf",
            ],
        ),
    ] {
        let (mut ours_runs, mut tlsf_runs) = (Vec::new(), Vec::new());
        for seed in FILL_SEEDS {
            ours_runs.push(fill_until_full(&mut ours, capacity, videos, 3, seed)?);
            tlsf_runs.push(fill_until_full(&mut reference, capacity, videos, 3, seed)?);
        }
        let (o, t) = (Spread::of(&ours_runs), Spread::of(&tlsf_runs));
        let figures = [
            o.first_mean,
            t.first_mean,
            o.later_mean,
            t.later_mean,
            o.first_min,
            t.first_min,
            o.later_min,
            t.later_min,
        ];
        for (key, value) in keys.iter().zip(figures) {
            r.fig(key, value);
        }
        let as_tlsf = |o: f64, t: f64| if o >= t { "" } else { " (below TLSF)" };
        r.row(
            format!(
                "{label}: full at, first / lowest refill after deleting 1/4, mean (worst) of {} traces",
                FILL_SEEDS.len()
            ),
            o.show(),
            format!("rlsf (TLSF) {}", t.show()),
            format!(
                "{:.2}x / {:.2}x{}",
                o.first_mean / t.first_mean,
                o.later_mean / t.later_mean,
                as_tlsf(o.later_mean, t.later_mean)
            ),
            ">= 90%, >= TLSF",
        );
        let behind = ours_runs
            .iter()
            .zip(&tlsf_runs)
            .filter(|(a, b)| a.1 < b.1)
            .count();
        r.fig(keys[8], behind as f64);
    }
    Ok(())
}

/// Mean and worst of (first `Full`, lowest refill) over several traces.
struct Spread {
    first_mean: f64,
    first_min: f64,
    later_mean: f64,
    later_min: f64,
}

impl Spread {
    fn of(runs: &[(f64, f64)]) -> Spread {
        let n = runs.len().max(1) as f64;
        Spread {
            first_mean: runs.iter().map(|r| r.0).sum::<f64>() / n,
            first_min: runs.iter().map(|r| r.0).fold(1.0, f64::min),
            later_mean: runs.iter().map(|r| r.1).sum::<f64>() / n,
            later_min: runs.iter().map(|r| r.1).fold(1.0, f64::min),
        }
    }

    fn show(&self) -> String {
        format!(
            "{:.1}% ({:.1}%) / {:.1}% ({:.1}%)",
            self.first_mean * 100.0,
            self.first_min * 100.0,
            self.later_mean * 100.0,
            self.later_min * 100.0
        )
    }
}

/// Videos put into the full cache in [`eviction`].
const EVICTION_VIDEOS: usize = 40;

/// vLLM's `shm` cache on the same trace, simulated: a ring that writes each item after the
/// last (wrapping to the start when the item does not fit before the end) and evicts, oldest
/// first, every item the new one overlaps. Returns the payload bytes it evicted.
struct FifoRing {
    capacity: u64,
    head: u64,
    items: VecDeque<(u64, u64)>,
}

impl FifoRing {
    fn put(&mut self, size: u64) -> u64 {
        if self.head + size > self.capacity {
            self.head = 0;
        }
        let (lo, hi) = (self.head, self.head + size);
        let mut evicted = 0;
        while let Some(&(start, len)) = self.items.front() {
            if start < hi && lo < start + len {
                evicted += len;
                self.items.pop_front();
            } else {
                break;
            }
        }
        self.items.push_back((lo, size));
        self.head = hi;
        evicted
    }
}

/// The store as a cache (evicting), as vLLM's front-end uses it: full of small items
/// (64 KiB-1 MiB, log-uniform: image tiles, burst items), none of them pinned, then
/// [`EVICTION_VIDEOS`] videos of 10-30 MiB arrive. Reports the payload bytes evicted per
/// byte put, beside vLLM's FIFO ring on the same trace, which evicts the oldest span the
/// new item overlaps: as few bytes as a contiguous layout allows.
pub fn eviction(capacity: u64, r: &mut Report) -> Result<(), String> {
    let store = Store::create_anonymous(&StoreConfig {
        when_full: WhenFull::Evict,
        max_objects: (capacity >> 14).next_power_of_two(),
        ..StoreConfig::with_capacity(capacity)
    })
    .map_err(|e| e.to_string())?;
    let mut ring = FifoRing {
        capacity,
        head: 0,
        items: VecDeque::new(),
    };
    let mut rng = Rng(0x6a09_e667_f3bc_c908);
    let mut live: Vec<(ObjectId, u64)> = Vec::new();
    let put = |id: &ObjectId, size: u64| -> Result<(), String> {
        let c = store.create_object(id, size).map_err(|e| e.to_string())?;
        c.seal().map_err(|e| e.to_string())
    };
    let (lo, hi) = (64u64 << 10, 1u64 << 20);
    loop {
        let size = (lo as f64 * (hi as f64 / lo as f64).powf(rng.unit())) as u64;
        if store.stats().free < size.next_multiple_of(4096) {
            break;
        }
        let id = ObjectId::of_key(format!("small-{}", live.len()));
        put(&id, size)?;
        ring.put(size);
        live.push((id, size));
    }
    let small = live.len();
    let evictions_before = store.stats().evictions;
    let (mut put_bytes, mut ours, mut fifo) = (0u64, 0u64, 0u64);
    let mut first = (0.0, 0.0);
    for j in 0..EVICTION_VIDEOS {
        let size = (10u64 << 20) + (rng.unit() * (20u64 << 20) as f64) as u64;
        let id = ObjectId::of_key(format!("video-{j}"));
        put(&id, size)?;
        fifo += ring.put(size);
        put_bytes += size;
        live.retain(|(id, size)| {
            let kept = store.contains(id);
            if !kept {
                ours += size;
            }
            kept
        });
        live.push((id, size));
        if j == 0 {
            first = (ours as f64 / size as f64, fifo as f64 / size as f64);
        }
    }
    let evictions = store.stats().evictions - evictions_before;
    r.fig("first_video_evicted_bytes_per_byte", first.0);
    r.fig("fifo_first_video_evicted_bytes_per_byte", first.1);
    let per_byte = r.fig("evicted_bytes_per_byte_put", ours as f64 / put_bytes as f64);
    let fifo_per_byte = r.fig(
        "fifo_evicted_bytes_per_byte_put",
        fifo as f64 / put_bytes as f64,
    );
    r.fig("eviction_small_items", small as f64);
    r.fig("eviction_objects_evicted", evictions as f64);
    const MIB: f64 = (1u64 << 20) as f64;
    r.row(
        format!(
            "cache full of {small} items of 64 KiB-1 MiB, then {EVICTION_VIDEOS} videos of 10-30 MiB: bytes evicted per byte put"
        ),
        format!(
            "{per_byte:.2} ({:.0} MiB evicted, {evictions} objects, for {:.0} MiB put); first video {:.2}",
            ours as f64 / MIB,
            put_bytes as f64 / MIB,
            first.0
        ),
        format!(
            "vLLM's FIFO ring, same trace (simulated): {fifo_per_byte:.2} ({:.0} MiB); first video {:.2}",
            fifo as f64 / MIB,
            first.1
        ),
        format!("{:.2}x", per_byte / fifo_per_byte),
        "<= 1.1x FIFO",
    );
    Ok(())
}
