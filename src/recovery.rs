//! Recovery: what a dead client held goes back, run by whichever live process meets it.
//!
//! There is no daemon. A live process recovers dead clients when it attaches, when an
//! allocation finds the store full, when a get finds the creator of the object it waits
//! for dead, on a bounded schedule during creates (at most every
//! [`MAINTENANCE_PERIOD`]), and on demand (`Store::recover`, `shmstore recover`).
//!
//! # Recovering one client (`World::recover_dead`)
//! 1. **Claim** the dead client's slot (ALIVE, its liveness lock free) with one CAS,
//!    `ALIVE -> RECOVERING(by me)`. A slot left RECOVERING by a recoverer that died too
//!    (its own lock free) is taken over the same way. Claims the dead client itself held
//!    on other slots are taken over too, and a sweep token it held is cleared, so that
//!    nothing names its slot once that slot is free and claimed again.
//! 2. **Pins:** zero its column of pin counters (every slot, FREE ones included: a pin
//!    attempt may have raised a counter on a slot that changed meanwhile), and free each
//!    DELETED slot whose last counter that was.
//! 3. **Creations:** abort every CREATING entry whose `creator` is the dead client; the
//!    abort wakes its getters, which report `CreatorDied`.
//! 4. **Half-done table steps:** a RESERVED or FREEING slot whose `owner` is the dead
//!    client goes back to FREE at the next generation. Its block (claimed, or part-freed)
//!    is left to the sweep, because the owner may have died inside the allocator.
//! 5. If the client's `ops_started != ops_finished`, it died inside an allocator step, and
//!    if it held raw blocks (`raw_alloc`), they are named by no entry: `sweeps_owed += 1`.
//! 6. Release the slot (`FREE`, new generation on the next claim).
//!
//! Every step is a CAS from a state only the dead client could have left, or a counter
//! swap, so running it twice does nothing the second time: a recoverer killed midway
//! leaves the slot RECOVERING, and the next recoverer takes it over and redoes the steps.
//!
//! # The leak sweep (`World::sweep`)
//! An allocator step that dies between two of its word CASes leaves bits that no table
//! entry names and that cannot be told apart from another process's claim by looking at
//! the words alone. The sweep settles them by comparing the whole allocator with the whole
//! table at a moment when provably no live client was inside an ownership-changing step:
//! it reads every attached client's `(ops_started, ops_finished)` (its own included: other
//! threads of its process share its slot), requires them equal, scans
//! the table and the allocator, and reads the counters again; unchanged counters mean
//! nothing changed owner in between (every such step bumps `ops_started` before its first
//! write). Then:
//! * a block bit set in a live slab that no entry names is freed;
//! * a slab `live` count above its set bits has its extra reservations dropped;
//! * a page bit that no page-run entry and no live slab covers is freed;
//! * a slab with nothing reserved in it, not its class's hint, whose last freer died
//!   before retiring it, is retired (its pages go back, as that free would have done);
//! * (first, at any moment) a page word left empty with its summary bit set, by a freer
//!   that died between the two, has the bit cleared.
//!
//! * a unit that is no slab but has block bits set (a setup killed midway) has them
//!   cleared: before its leaked pages are freed, while nobody else can take them (a
//!   unit whose pages are already free: after taking them as a new slab would).
//!
//! All are safe to do after the snapshot while others run: nobody else can touch a
//! bit that is set and unnamed (claimers only take clear bits; freers only free what an
//! entry names). A client holding raw blocks makes the moment not quiet. Only one process
//! sweeps at a time (`Globals::sweeper`, taken over if its holder died, cleared when its
//! holder is recovered); a sweep that finds no quiet moment leaves `sweeps_owed` for the
//! next try. Sweeping never blocks anyone: it is the only thing that waits for a quiet
//! moment.

use crate::alloc::{blocks_in_slab, Allocator, Block, BlockKind, CLASS_SIZES};
use crate::capacity::{Census, Globals};
use crate::client::{state_of, Clients, Liveness, CLIENT_FREE};
use crate::layout::{CLASSES, PAGE, PAGES_PER_SLAB, SLAB};
use crate::sync::Ordering;
use crate::table::{Entry, Reclaimer, Table, CREATING, DELETED, FREE, FREEING, RESERVED};
use std::collections::HashMap;
use std::time::Duration;

/// The bounded schedule: a process creating objects checks for dead clients at most this
/// often.
pub(crate) const MAINTENANCE_PERIOD: Duration = Duration::from_millis(200);

/// What a recovery pass did.
///
/// ```
/// let s = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(1 << 20))?;
/// let report = s.recover()?;
/// assert_eq!(report.clients_recovered, 0); // nobody died
/// # Ok::<(), shmstore::Error>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Dead clients whose slots were returned.
    pub clients_recovered: u64,
    /// Pins the dead still held, now dropped.
    pub pins_released: u64,
    /// Unsealed objects of dead creators, aborted.
    pub creations_aborted: u64,
    /// Table slots a dead client was part-way through changing, returned.
    pub slots_returned: u64,
    /// Blocks the leak sweep found belonging to no one, freed.
    pub leaked_blocks_freed: u64,
    /// Bytes given back to the allocator by all of the above.
    pub bytes_reclaimed: u64,
    /// A leak sweep is still owed: it needs a moment when no live client is inside an
    /// allocator step, and none came (it is retried on the schedule).
    pub sweep_pending: bool,
}

/// Everything recovery touches, as seen by client `me`.
pub(crate) struct World<'a> {
    pub table: Table<'a>,
    pub alloc: Allocator<'a>,
    pub globals: &'a Globals,
    /// Every client slot, seen by us (`me`).
    pub clients: Clients<'a>,
    pub me: u64,
    pub heap_size: u64,
    /// Brackets this process's own ownership-changing steps.
    pub ops: &'a dyn Reclaimer,
}

impl World<'_> {
    /// Recovers every dead client (and every recovery left unfinished by a dead
    /// recoverer), then runs the leak sweep if one is owed.
    pub(crate) fn recover_dead(&self) -> RecoveryReport {
        let mut report = RecoveryReport::default();
        for d in 0..self.clients.len() {
            if self.clients.claim_for_recovery(d).is_some() {
                self.recover_client(d, &mut report);
                self.clients.release(d);
            }
        }
        self.sweep(&mut report);
        report
    }

    /// What a recoverer killed midway leaves (for tests): claims every dead client and
    /// drops its pins, but neither aborts its creations nor releases its slot. Returns the
    /// number of clients claimed.
    pub(crate) fn recover_dead_interrupted(&self) -> u64 {
        let mut n = 0;
        for d in 0..self.clients.len() {
            if self.clients.claim_for_recovery(d).is_some() {
                for i in 0..self.table.capacity() as usize {
                    self.table.drop_dead_pins(i, d);
                }
                n += 1;
            }
        }
        n
    }

    fn bytes(&self, e: &Entry) -> u64 {
        e.block(self.heap_size).map_or(0, |(b, _)| b.size)
    }

    /// Cleans up the slot this process is moving into (a dead client's, which we hold
    /// RECOVERING by itself, lock in hand), before we use it.
    pub(crate) fn recover_own_slot(&self, report: &mut RecoveryReport) {
        self.recover_client(self.me, report);
    }

    /// Steps 2-5 of the module docs for dead client `d` (whose slot we hold), counted in
    /// `report` and in the store-wide stats.
    fn recover_client(&self, d: u64, report: &mut RecoveryReport) {
        let bytes_before = report.bytes_reclaimed;
        // A recoverer that died midway named `d` on the slots it was recovering: finish
        // them now, so that no claim names `d` once its slot is free (and reused).
        for x in self.clients.take_over_recoveries_of(d) {
            self.recover_client(x, report);
            self.clients.release(x);
        }
        // So does a sweep token it held.
        let g = self.globals;
        let _ = g
            .sweeper
            .compare_exchange(d + 1, 0, Ordering::AcqRel, Ordering::Relaxed);
        let (started, finished, raw) = self.clients.ops(d);
        // Died inside an allocator step, or holding raw blocks no entry names: a sweep.
        let mut owe = started != finished || raw != 0;
        let t = &self.table;
        for i in 0..t.capacity() as usize {
            let k = t.counter_of(i, d);
            if k != 0 {
                report.pins_released += k as u64;
                if let Some(e) = t.drop_dead_pins(i, d) {
                    report.bytes_reclaimed += self.bytes(&e);
                }
            }
        }
        // Its pins are gone, so its count of them is too.
        if let Some(h) = self.clients.get(d) {
            h.counters.pins_held.store(0, Ordering::Relaxed);
        }
        let mut creating = Vec::new();
        let mut orphans = Vec::new();
        let mut deleted = Vec::new();
        t.scan(|i, c, _, e| match c.state() {
            RESERVED | FREEING if c.owner() == Some(d) => orphans.push((i, c)),
            CREATING if e.creator as u64 == d => creating.push((i, c.gen())),
            DELETED => deleted.push(i),
            _ => {}
        });
        for (i, c) in orphans {
            if t.reset_orphan(i, c) {
                report.slots_returned += 1;
                owe = true;
            }
        }
        for (i, gen) in creating {
            let (aborted, freed) = t.abort_orphan(i, gen);
            report.creations_aborted += aborted as u64;
            if let Some(e) = freed {
                report.bytes_reclaimed += self.bytes(&e);
            }
        }
        // A retirer that died between DELETED and its last counter left nobody to free.
        for i in deleted {
            if let Some(e) = t.try_free(i) {
                report.bytes_reclaimed += self.bytes(&e);
            }
        }
        if owe {
            g.sweeps_owed.fetch_add(1, Ordering::AcqRel);
        }
        report.clients_recovered += 1;
        g.recovered_clients.fetch_add(1, Ordering::Relaxed);
        g.reclaimed_bytes
            .fetch_add(report.bytes_reclaimed - bytes_before, Ordering::Relaxed);
    }

    /// Runs the leak sweep if one is owed and nobody else is sweeping, counted in `report`
    /// and in the store-wide stats. Returns whether no sweep is owed any more (and sets
    /// `report.sweep_pending` if one is).
    pub(crate) fn sweep(&self, report: &mut RecoveryReport) -> bool {
        let g = self.globals;
        let owed = g.sweeps_owed.load(Ordering::Acquire);
        if owed == 0 {
            return true;
        }
        let holder = g.sweeper.load(Ordering::Acquire);
        if let Some(h) = holder.checked_sub(1) {
            if self.clients.holder_alive(h) {
                report.sweep_pending = true;
                return false;
            }
        }
        if g.sweeper
            .compare_exchange(holder, self.me + 1, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            report.sweep_pending = true;
            return false;
        }
        let (blocks_before, bytes_before) = (report.leaked_blocks_freed, report.bytes_reclaimed);
        let done = self.sweep_owned(report);
        g.leaked_blocks_freed.fetch_add(
            report.leaked_blocks_freed - blocks_before,
            Ordering::Relaxed,
        );
        g.reclaimed_bytes
            .fetch_add(report.bytes_reclaimed - bytes_before, Ordering::Relaxed);
        let _ = g
            .sweeper
            .compare_exchange(self.me + 1, 0, Ordering::AcqRel, Ordering::Relaxed);
        if done {
            g.sweeps_owed.fetch_sub(owed, Ordering::AcqRel);
        } else {
            report.sweep_pending = true;
        }
        done
    }

    /// The sweep proper (we hold the sweeper token). `false`: no quiet moment, try later.
    fn sweep_owned(&self, report: &mut RecoveryReport) -> bool {
        // A client that died inside a free may have emptied a page word without clearing
        // its summary bit, hiding it from best fit. Clearing is safe at any moment.
        self.alloc.repair_summary();
        // Dead clients' marks must be settled first.
        for d in 0..self.clients.len() {
            if matches!(
                self.clients.liveness(d),
                Liveness::Dead | Liveness::Recovering
            ) {
                return false;
            }
        }
        // Only attached clients count: a free slot runs no steps (its counters are settled
        // when it is released or claimed, and a claim is seen as a `ctl` change below).
        // Our own slot counts too: other threads of this process share it. (So a sweep
        // called from inside one of our own steps finds no quiet moment and stays owed.)
        // Raw blocks (`Store::raw_alloc`) are named by no entry: none may be out.
        let ops = || -> Vec<(u64, (u64, u64, u64))> {
            (0..self.clients.len())
                .map(|c| {
                    let ctl = self.clients.ctl(c);
                    let ops = if state_of(ctl) == CLIENT_FREE {
                        (0, 0, 0)
                    } else {
                        self.clients.ops(c)
                    };
                    (ctl, ops)
                })
                .collect()
        };
        let before = ops();
        if before.iter().any(|(_, (s, f, raw))| s != f || *raw != 0) {
            return false;
        }
        // Everything the table names, and what the counts should say.
        let words = self.alloc.page_words();
        let mut page_owned = vec![0u64; words];
        let mut slab_named: HashMap<usize, [u64; 16]> = HashMap::new();
        let mut settled = true;
        let mut exact = Census::default();
        self.table.scan(|_, c, _, e| {
            if matches!(c.state(), RESERVED | FREEING) {
                settled = false; // a step in flight after all (or a dead client's)
                return;
            }
            if c.state() == FREE {
                return;
            }
            match e.block(self.heap_size) {
                Ok((b, _)) => {
                    mark(&mut page_owned, &mut slab_named, &b);
                    exact.used += b.size;
                    match c.state() {
                        CREATING => exact.creating += 1,
                        DELETED => exact.draining += 1,
                        _ => exact.objects += 1,
                    }
                }
                Err(_) => settled = false, // corrupt entry: do not guess around it
            }
        });
        if !settled {
            return false;
        }
        let snap = self.alloc.snapshot();
        // Read inside the quiet window: counts change only inside steps.
        let found = self.globals.census(self.clients.headers());
        if ops() != before {
            return false;
        }
        // A client that died inside a step may have left a count behind: set it right.
        self.globals.correct(&found, &exact);
        self.ops.begin_op();
        for (s, (st, bits)) in snap.slabs.iter().enumerate() {
            let c = (st >> 16) as usize;
            if c == 0 || c > CLASSES as usize {
                continue;
            }
            let class = c - 1;
            let first = s as u64 * PAGES_PER_SLAB;
            for p in first..first + PAGES_PER_SLAB {
                page_owned[(p / 64) as usize] |= 1 << (p % 64);
            }
            let named = slab_named.get(&s).copied().unwrap_or([0; 16]);
            let size = CLASS_SIZES[class];
            let mut ones = 0;
            for (w, (&b, &n)) in bits.iter().zip(&named).enumerate() {
                ones += b.count_ones() as u64;
                let mut leaked = b & !n;
                while leaked != 0 {
                    let idx = w as u64 * 64 + leaked.trailing_zeros() as u64;
                    leaked &= leaked - 1;
                    if idx >= blocks_in_slab(class) {
                        continue;
                    }
                    let block = Block {
                        offset: s as u64 * SLAB + idx * size,
                        size,
                        kind: BlockKind::Slab(class as u8),
                    };
                    if self.alloc.free(block).is_ok() {
                        report.leaked_blocks_freed += 1;
                        report.bytes_reclaimed += size;
                    }
                }
            }
            let live = st & 0xffff;
            if live > ones {
                self.alloc.drop_leaked_reservations(s, class, live - ones);
            } else if live == 0 {
                // Empty, and not the class's hint: its last freer died before retiring
                // it (or lost a race with the hint moving), and its pages stayed a slab's.
                // Not a leak (the class could still use it), so not counted as one.
                self.alloc.retire_if_empty(s, class);
            }
        }
        let mut p = 0;
        while p < snap.npages {
            let leaked = |q: u64| {
                let w = (q / 64) as usize;
                (snap.pages[w] & !page_owned[w]) >> (q % 64) & 1 == 1
            };
            if !leaked(p) {
                p += 1;
                continue;
            }
            let first = p;
            while p < snap.npages && leaked(p) {
                p += 1;
            }
            // A setup killed midway left block bits on a unit of these pages: clear them
            // while the pages are still held, never after they are free.
            self.alloc.scrub_units_of_leaked_run(first, p);
            if self.alloc.free_leaked_pages(first, p - first).is_ok() {
                report.leaked_blocks_freed += 1;
                report.bytes_reclaimed += (p - first) * PAGE;
            }
        }
        // A unit that is no slab but has block bits set and whose pages were free at the
        // snapshot (left so by a sweeper of an earlier version, killed between freeing
        // and clearing). Clear them so the bitmap says what the state says.
        for (s, (st, bits)) in snap.slabs.iter().enumerate() {
            if *st == 0 && bits.iter().any(|&b| b != 0) {
                self.alloc.scrub_unit(s);
            }
        }
        self.ops.end_op();
        true
    }
}

/// Marks block `b` as named by the table.
fn mark(page_owned: &mut [u64], slab_named: &mut HashMap<usize, [u64; 16]>, b: &Block) {
    match b.kind {
        BlockKind::Pages => {
            for p in b.offset / PAGE..(b.offset + b.size) / PAGE {
                if let Some(w) = page_owned.get_mut((p / 64) as usize) {
                    *w |= 1 << (p % 64);
                }
            }
        }
        BlockKind::Slab(c) => {
            let size = CLASS_SIZES[c as usize];
            let s = (b.offset / SLAB) as usize;
            let idx = (b.offset % SLAB) / size;
            let bits = slab_named.entry(s).or_insert([0; 16]);
            if let Some(w) = bits.get_mut((idx / 64) as usize) {
                *w |= 1 << (idx % 64);
            }
        }
    }
}
