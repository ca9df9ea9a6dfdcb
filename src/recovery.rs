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

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::alloc::testing::HeapAllocator;
    use crate::client::testing::MemLocks;
    use crate::client::{begin_op, Claimed, ClientHeader};
    use crate::sync::AtomicU64;
    use crate::table::testing::HeapTable;
    use crate::table::{Ctl, Entry};
    use crate::ObjectId;

    const HEAP: u64 = 1 << 20;
    const CLIENTS: usize = 4;

    /// What a [`World`] borrows: a table, an allocator, the globals and `CLIENTS` client
    /// slots, each attached (slot `i`'s lock held by attachment id `i`).
    struct Parts {
        headers: Vec<ClientHeader>,
        held: Vec<AtomicU64>,
        table: HeapTable,
        alloc: HeapAllocator,
        globals: Globals,
    }

    impl Parts {
        fn new() -> Self {
            let p = Parts {
                headers: (0..CLIENTS).map(|_| ClientHeader::default()).collect(),
                held: (0..CLIENTS).map(|_| AtomicU64::new(0)).collect(),
                table: HeapTable::new(32),
                alloc: HeapAllocator::new(HEAP),
                globals: Globals::default(),
            };
            for i in 0..CLIENTS as u64 {
                let lk = p.locks(i);
                assert_eq!(
                    Clients::new(&p.headers, &lk, None).try_claim(i, true),
                    Some(Claimed::Fresh)
                );
            }
            p
        }

        fn locks(&self, id: u64) -> MemLocks<'_> {
            MemLocks {
                holders: &self.held,
                id,
            }
        }

        /// The world as the client whose `locks` these are sees it.
        fn world<'a>(&'a self, locks: &'a MemLocks<'a>) -> World<'a> {
            World {
                table: self.table.as_client(locks.id as u16),
                alloc: self.alloc.get(),
                globals: &self.globals,
                clients: Clients::new(&self.headers, locks, Some(locks.id)),
                me: locks.id,
                heap_size: HEAP,
                ops: &self.table,
            }
        }

        /// Client `i`'s process dies: its lock goes.
        fn kill(&self, i: usize) {
            self.held[i].store(0, Ordering::SeqCst);
        }

        /// Claims dead client `d` and recovers it, as `recover_dead` does for each.
        fn recover(&self, w: &World<'_>, d: u64, report: &mut RecoveryReport) {
            assert!(w.clients.claim_for_recovery(d).is_some(), "client {d} dead");
            w.recover_client(d, report);
            w.clients.release(d);
        }
    }

    /// An entry of `pages` pages at `offset`, created by `creator`: its block's size is
    /// `pages * PAGE`, so that the bytes a recovery reports say which entries it freed.
    fn entry(offset: u64, pages: u64, creator: u16) -> Entry {
        Entry {
            offset,
            len: pages * PAGE,
            meta_len: 0,
            kind: BlockKind::Pages.encode(),
            creator,
        }
    }

    #[test]
    fn recovering_a_dead_client_returns_exactly_what_it_held_and_nothing_of_the_living() {
        let p = Parts::new();
        let locks = p.locks(0);
        let w = p.world(&locks);
        let (ht, g) = (&p.table, &p.globals);
        let (dead, live) = (ht.as_client(1), ht.as_client(2));
        let id = |k: &str| ObjectId::of_key(k);
        // Client 1's creation (1 page) is aborted; client 2's (8 pages) is left alone.
        dead.insert(&id("a"), &entry(0, 1, 1)).unwrap();
        live.insert(&id("b"), &entry(64 << 10, 8, 2)).unwrap();
        // Client 1 pins two sealed objects: one deleted meanwhile (2 pages, freed with
        // the dead pin), one live (16 pages, kept).
        for (k, off, pages) in [("c", 128 << 10, 2), ("e", 256 << 10, 16)] {
            let r = live.insert(&id(k), &entry(off, pages, 2)).unwrap();
            live.seal(&id(k), r).unwrap();
            assert!(matches!(
                dead.pin(&id(k)).unwrap(),
                crate::table::Pin::Pinned(..)
            ));
        }
        assert_eq!(live.delete(&id("c")).unwrap(), None, "pinned: it drains");
        // A DELETED entry nobody pins (4 pages): its retirer died before freeing it.
        let r = live.insert(&id("d"), &entry(512 << 10, 4, 2)).unwrap();
        live.seal(&id("d"), r).unwrap();
        ht.set_ctl(r.index as usize, Ctl::new(DELETED, None, r.gen));
        // Two table slots half-way through a step: client 1's goes back, client 2's stays.
        let free: Vec<usize> = (0..32)
            .filter(|&i| w.table.ctl(i).state() == FREE)
            .collect();
        let (orphan, busy) = (free[0], free[1]);
        let (oc, bc) = (
            Ctl::new(RESERVED, Some(1), 7),
            Ctl::new(RESERVED, Some(2), 7),
        );
        ht.set_ctl(orphan, oc);
        ht.set_ctl(busy, bc);

        p.kill(1);
        let mut report = RecoveryReport::default();
        p.recover(&w, 1, &mut report);
        let want = RecoveryReport {
            clients_recovered: 1,
            pins_released: 2,
            creations_aborted: 1,
            slots_returned: 1,
            leaked_blocks_freed: 0,
            bytes_reclaimed: (1 + 2 + 4) * PAGE,
            sweep_pending: false,
        };
        assert_eq!(report, want);
        let freed: Vec<u64> = ht.freed().iter().map(|(_, e)| e.len / PAGE).collect();
        assert_eq!(
            freed,
            vec![2, 1, 4],
            "the drained, the aborted, the deleted"
        );
        assert!(
            w.table.contains_sealed(&id("e")),
            "a pinned live object stays"
        );
        assert!(
            w.table.contains_live(&id("b")),
            "a live client's creation stays"
        );
        assert_eq!(w.table.ctl(orphan), Ctl::new(FREE, None, 8));
        assert_eq!(w.table.ctl(busy), bc, "a live client's step is its own");
        assert_eq!(g.recovered_clients.load(Ordering::SeqCst), 1);
        assert_eq!(g.reclaimed_bytes.load(Ordering::SeqCst), 7 * PAGE);
        assert_eq!(
            g.sweeps_owed.load(Ordering::SeqCst),
            1,
            "a half-done step may have left its block claimed"
        );

        // Client 2 dies inside an allocator step (nothing else): a sweep is owed.
        // Client 3 dies quiet: nothing is owed, and the totals grow by what each returned.
        begin_op(&p.headers[2]);
        ht.set_ctl(busy, Ctl::new(FREE, None, 8));
        assert_eq!(
            w.table.delete(&id("e")).unwrap(),
            Some(entry(256 << 10, 16, 2)),
            "its dead pin is gone: freed at once"
        );
        p.kill(2);
        p.kill(3);
        let mut report = RecoveryReport::default();
        for d in [2, 3] {
            p.recover(&w, d, &mut report);
            assert_eq!(g.sweeps_owed.load(Ordering::SeqCst), 2, "after client {d}");
        }
        assert_eq!(report.clients_recovered, 2);
        assert_eq!(report.creations_aborted, 1, "client 2's creation");
        assert_eq!(report.bytes_reclaimed, 8 * PAGE);
        assert_eq!(g.recovered_clients.load(Ordering::SeqCst), 3);
        assert_eq!(g.reclaimed_bytes.load(Ordering::SeqCst), 15 * PAGE);
    }

    #[test]
    fn an_interrupted_recovery_claims_every_dead_client_and_leaves_them_recovering() {
        let p = Parts::new();
        let locks = p.locks(0);
        let w = p.world(&locks);
        p.kill(1);
        p.kill(3);
        assert_eq!(w.recover_dead_interrupted(), 2);
        for d in [1, 3] {
            assert_eq!(w.clients.liveness(d), Liveness::Recovering);
        }
        assert_eq!(w.clients.liveness(2), Liveness::Alive);
        assert_eq!(w.recover_dead_interrupted(), 0, "in hand already");
    }

    #[test]
    fn the_sweep_frees_only_unnamed_blocks_waits_for_a_live_sweeper_and_counts_exactly() {
        let p = Parts::new();
        let locks = p.locks(0);
        let w = p.world(&locks);
        let g = &p.globals;
        let live = p.table.as_client(2);
        let largest = CLASS_SIZES[CLASSES as usize - 1];
        // Named by entries: a sealed 60-page run (pages 0-59), a sealed 200-byte block,
        // a 5-page run being created, and a block of the largest class deleted while
        // pinned (draining). Leaked, named by no entry (their owner died inside a step):
        // an 8-page run across the first two bitmap words (pages 60-67), and the next
        // block of each of the two slab classes. (Runs of up to 16 KiB are slab blocks.)
        let low = w.alloc.alloc(60 * PAGE).unwrap();
        let leaked_run = w.alloc.alloc(8 * PAGE).unwrap();
        assert_eq!((low.offset, leaked_run.offset), (0, 60 * PAGE));
        let named = [
            ("run", low, 60 * PAGE),
            ("small", w.alloc.alloc(200).unwrap(), 200),
            ("creating", w.alloc.alloc(5 * PAGE).unwrap(), 5 * PAGE),
            ("draining", w.alloc.alloc(largest).unwrap(), largest),
        ];
        let leaked = [
            leaked_run,
            w.alloc.alloc(200).unwrap(),
            w.alloc.alloc(largest).unwrap(),
        ];
        assert_eq!(named[2].1.kind, BlockKind::Pages);
        for b in &leaked[1..] {
            assert!(
                b.offset / SLAB > 0 && b.offset % SLAB > 0,
                "{b:?}: not the first slab, not its first block"
            );
        }
        for (k, b, len) in named {
            let id = ObjectId::of_key(k);
            let e = Entry {
                offset: b.offset,
                len,
                meta_len: 0,
                kind: b.kind.encode(),
                creator: 2,
            };
            let r = live.insert(&id, &e).unwrap();
            if k != "creating" {
                live.seal(&id, r).unwrap();
            }
        }
        assert!(matches!(
            live.pin(&ObjectId::of_key("draining")).unwrap(),
            crate::table::Pin::Pinned(..)
        ));
        assert_eq!(live.delete(&ObjectId::of_key("draining")).unwrap(), None);
        g.sweeps_owed.store(1, Ordering::SeqCst);
        // Client 3 holds the sweep token and runs: nobody else sweeps.
        g.sweeper.store(3 + 1, Ordering::SeqCst);
        let mut report = RecoveryReport::default();
        assert!(!w.sweep(&mut report));
        assert!(report.sweep_pending);
        assert_eq!(report.leaked_blocks_freed, 0);
        // Client 3 dies: recovering it drops its token.
        p.kill(3);
        let mut report = RecoveryReport::default();
        p.recover(&w, 3, &mut report);
        assert_eq!(g.sweeper.load(Ordering::SeqCst), 0);
        // What the recovery found before the sweep stays in the report; the store-wide
        // counts grow by what the sweep alone found.
        let before = RecoveryReport {
            leaked_blocks_freed: 3,
            bytes_reclaimed: 5 * PAGE,
            ..report
        };
        let mut report = before;
        assert!(w.sweep(&mut report));
        let swept: u64 = leaked.iter().map(|b| b.size).sum();
        assert_eq!(report.leaked_blocks_freed, 3 + 3);
        assert_eq!(report.bytes_reclaimed, 5 * PAGE + swept);
        assert!(!report.sweep_pending);
        assert_eq!(g.leaked_blocks_freed.load(Ordering::SeqCst), 3);
        assert_eq!(g.reclaimed_bytes.load(Ordering::SeqCst), swept);
        assert_eq!(g.sweeps_owed.load(Ordering::SeqCst), 0);
        assert_eq!(
            g.sweeper.load(Ordering::SeqCst),
            0,
            "the token is given back"
        );
        // The counts (nobody counted these entries) now say what the table holds.
        let c = g.census(&p.headers);
        let used: u64 = named.iter().map(|(_, b, _)| b.size).sum();
        assert_eq!((c.used, c.objects, c.creating, c.draining), (used, 2, 1, 1));
        // The leaked blocks are free (freeing them again is refused); the named are not.
        for b in leaked {
            assert!(w.alloc.free(b).is_err(), "{b:?} still held");
        }
        for (_, b, _) in named {
            assert!(w.alloc.free(b).is_ok(), "{b:?} freed by the sweep");
        }
        // Nothing owed: the sweep does nothing.
        let mut report = RecoveryReport::default();
        assert!(w.sweep(&mut report));
        assert_eq!(report, RecoveryReport::default());
    }

    #[test]
    fn the_sweep_tells_named_from_leaked_blocks_anywhere_in_a_slabs_bitmap() {
        let p = Parts::new();
        let locks = p.locks(0);
        let w = p.world(&locks);
        // A page run first (leaked too), so that the slab is not the heap's first unit.
        let run = w.alloc.alloc(5 * PAGE).unwrap();
        // 67 blocks of the smallest class in one slab. Named by entries: blocks 1 and 64
        // (the second bitmap word); leaked: blocks 0, 65 and 66; the rest freed again.
        let mut held: Vec<Block> = (0..67).map(|_| w.alloc.alloc(1).unwrap()).collect();
        held.sort_by_key(|b| b.offset);
        let slab = held[0].offset / SLAB;
        assert!(slab > 0 && held[0].offset % SLAB == 0, "{:?}", held[0]);
        assert!(held.iter().all(|b| b.offset / SLAB == slab));
        let named = [held[1], held[64]];
        let leaked = [run, held[0], held[65], held[66]];
        let live = p.table.as_client(2);
        for (k, b) in named.iter().enumerate() {
            let id = ObjectId::of_key(format!("named {k}"));
            let e = Entry {
                offset: b.offset,
                len: 1,
                meta_len: 0,
                kind: b.kind.encode(),
                creator: 2,
            };
            let r = live.insert(&id, &e).unwrap();
            live.seal(&id, r).unwrap();
        }
        for (i, b) in held.iter().enumerate() {
            if ![0, 1, 64, 65, 66].contains(&i) {
                w.alloc.free(*b).unwrap();
            }
        }
        p.globals.sweeps_owed.store(1, Ordering::SeqCst);
        let mut report = RecoveryReport::default();
        assert!(w.sweep(&mut report));
        assert_eq!(report.leaked_blocks_freed, 4);
        assert_eq!(report.bytes_reclaimed, 5 * PAGE + 3 * CLASS_SIZES[0]);
        for b in leaked {
            assert!(w.alloc.free(b).is_err(), "{b:?} still held");
        }
        for b in named {
            assert!(w.alloc.free(b).is_ok(), "{b:?} freed by the sweep");
        }
    }

    #[test]
    fn the_sweep_drops_a_dead_claimers_reservation_and_retires_the_slab_a_dead_freer_left() {
        let p = Parts::new();
        let locks = p.locks(0);
        let w = p.world(&locks);
        let class = CLASSES as usize - 1;
        let (size, tag) = (CLASS_SIZES[class], (class as u64 + 1) << 16);
        let per = blocks_in_slab(class) as usize;
        // Three full slabs of the largest class; the last is the class's current one.
        let mut held: Vec<Block> = (0..3 * per).map(|_| w.alloc.alloc(size).unwrap()).collect();
        held.sort_by_key(|b| b.offset);
        let slab_of = |b: &Block| (b.offset / SLAB) as usize;
        let (first, middle, current) = (
            slab_of(&held[0]),
            slab_of(&held[per]),
            slab_of(&held[2 * per]),
        );
        let mut slabs = held.chunks(per).map(|c| c.to_vec());
        let (in_first, in_middle, in_current) = (
            slabs.next().unwrap(),
            slabs.next().unwrap(),
            slabs.next().unwrap(),
        );
        // The first slab keeps one block, named by an entry, and gets a reservation a
        // dead claimer left without its bit.
        let kept = in_first[0];
        let e = Entry {
            offset: kept.offset,
            len: size,
            meta_len: 0,
            kind: kept.kind.encode(),
            creator: 2,
        };
        let id = ObjectId::of_key("kept");
        let live = p.table.as_client(2);
        let r = live.insert(&id, &e).unwrap();
        live.seal(&id, r).unwrap();
        for b in in_first[1..].iter().chain(&in_middle).chain(&in_current) {
            w.alloc.free(*b).unwrap();
        }
        p.alloc.leave_dead_reservation(first);
        assert_eq!(p.alloc.slab_state(first), tag | 2);
        // The middle slab: its last free retired it; put it back as a freer killed
        // before that retiring CAS leaves it. The current slab, empty, stays a slab.
        assert_eq!(p.alloc.slab_state(middle), 0);
        p.alloc.leave_unretired(middle, class);
        assert_eq!(p.alloc.slab_state(middle), tag, "the class's, nothing live");
        assert_eq!(p.alloc.slab_state(current), tag);
        let slabs_before = w.alloc.usage().slabs;
        p.globals.sweeps_owed.store(1, Ordering::SeqCst);
        let mut report = RecoveryReport::default();
        assert!(w.sweep(&mut report));
        assert_eq!(report.leaked_blocks_freed, 0, "neither is a leaked block");
        assert_eq!(
            p.alloc.slab_state(first),
            tag | 1,
            "the dead reservation dropped"
        );
        assert_eq!(p.alloc.slab_state(middle), 0, "retired");
        assert_eq!(p.alloc.slab_state(current), tag, "the current slab stays");
        assert_eq!(w.alloc.usage().slabs, slabs_before - 1);
        w.alloc.audit().unwrap();
        // The kept block's free now retires its slab: nothing holds it up.
        assert_eq!(live.delete(&id).unwrap(), Some(e));
        w.alloc.free(kept).unwrap();
        assert_eq!(p.alloc.slab_state(first), 0);
    }

    #[test]
    fn the_sweep_clears_the_bits_a_dead_setup_left_on_a_free_unit() {
        let p = Parts::new();
        let locks = p.locks(0);
        let w = p.world(&locks);
        let unit = (HEAP / SLAB) as usize - 1;
        p.alloc.leave_stray_bits(unit);
        assert!(w.alloc.audit().is_err(), "bits on a unit that is no slab");
        p.globals.sweeps_owed.store(1, Ordering::SeqCst);
        let mut report = RecoveryReport::default();
        assert!(w.sweep(&mut report));
        w.alloc.audit().unwrap();
        assert_eq!(report, RecoveryReport::default(), "nothing was leaked");
    }

    #[test]
    fn the_sweep_waits_while_a_client_is_inside_a_step_or_holds_raw_blocks() {
        let p = Parts::new();
        let locks = p.locks(2); // client 2 sweeps
        let w = p.world(&locks);
        let g = &p.globals;
        let leak = w.alloc.alloc(5 * PAGE).unwrap();
        assert_eq!(leak.kind, BlockKind::Pages);
        g.sweeps_owed.store(1, Ordering::SeqCst);
        let stays_owed = |why: &str| {
            let mut report = RecoveryReport::default();
            assert!(!w.sweep(&mut report), "{why}");
            assert!(report.sweep_pending, "{why}");
            assert_eq!(report.leaked_blocks_freed, 0, "{why}");
            assert_eq!(g.sweeps_owed.load(Ordering::SeqCst), 1, "{why}");
            assert_eq!(g.sweeper.load(Ordering::SeqCst), 0, "{why}: token back");
        };
        begin_op(&p.headers[1]);
        stays_owed("client 1 is inside a step: the leak may be its claim");
        crate::client::end_op(&p.headers[1]);
        p.headers[1].raw_blocks.store(1, Ordering::SeqCst);
        stays_owed("client 1 holds a block no entry names");
        p.headers[1].raw_blocks.store(0, Ordering::SeqCst);
        let mut report = RecoveryReport::default();
        assert!(w.sweep(&mut report));
        assert_eq!(report.leaked_blocks_freed, 1);
        assert!(w.alloc.free(leak).is_err(), "freed by the sweep");
        assert_eq!(g.sweeps_owed.load(Ordering::SeqCst), 0);
        assert_eq!(
            g.sweeper.load(Ordering::SeqCst),
            0,
            "the token is given back"
        );
    }

    #[test]
    fn the_sweep_frees_a_leaked_run_that_ends_at_the_heaps_end() {
        let p = Parts::new();
        let locks = p.locks(0);
        let w = p.world(&locks);
        let runs: Vec<Block> = (0..HEAP / (16 * PAGE))
            .map(|_| w.alloc.alloc(16 * PAGE).unwrap())
            .collect();
        let top = *runs.iter().max_by_key(|b| b.offset).unwrap();
        assert_eq!(top.offset + top.size, HEAP);
        for b in runs.into_iter().filter(|b| *b != top) {
            w.alloc.free(b).unwrap();
        }
        p.globals.sweeps_owed.store(1, Ordering::SeqCst);
        let mut report = RecoveryReport::default();
        assert!(w.sweep(&mut report));
        assert_eq!(
            (report.leaked_blocks_freed, report.bytes_reclaimed),
            (1, 16 * PAGE)
        );
        assert!(w.alloc.free(top).is_err(), "freed by the sweep");
    }
}
