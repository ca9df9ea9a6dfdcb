//! Looking at a store without changing it: stats (from counters, O(clients)), the scans
//! tools use (allocated bytes, largest free run, pinned objects, the object listing),
//! recovery on demand, and the full invariant check tests run.
//!
//! Invariant: nothing here takes a lock or changes ownership, except `recover`, which runs
//! the same recovery pass attaching does ([`crate::recovery`]).

use super::*;
use crate::layout::PAGE;
use crate::region::HUGE_PAGE;

impl Store {
    /// Occupancy and activity figures, added up from every client slot's counters:
    /// O(clients), whatever the number of objects (no scan of the table or the heap).
    ///
    /// ```
    /// let s = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(1 << 20))?;
    /// assert_eq!(s.stats().used, 0);
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn stats(&self) -> Stats {
        let inner = &self.inner;
        let census = inner.globals.census(inner.client_headers());
        let [inserted, _, _, deleted, _, _, _, payload_in, hit, miss, waited, full, evicted, evicted_bytes, _] =
            census.sums;
        let capacity = inner.sb.heap_size;
        let huge_page_bytes = inner
            .globals
            .huge_bytes
            .load(Ordering::Relaxed)
            .min(capacity);
        let rebuilt_whole =
            huge_page_bytes > 0 && huge_page_bytes >= capacity / HUGE_PAGE * HUGE_PAGE;
        let mut st = Stats {
            capacity,
            used: census.used.min(capacity),
            free: capacity.saturating_sub(census.used),
            objects: census.objects,
            creating: census.creating,
            pins: census.pins,
            draining: census.draining,
            table_slots: inner.sb.table_slots,
            evictions: evicted,
            bytes_evicted: evicted_bytes,
            huge_pages: inner.map.huge_pages() || huge_page_bytes > 0,
            page_size: if inner.map.page_size() == PAGE && rebuilt_whole {
                HUGE_PAGE
            } else {
                inner.map.page_size()
            },
            huge_page_bytes,
            max_clients: inner.sb.max_clients,
            creates: inserted,
            bytes_created: payload_in,
            deletes: deleted.saturating_sub(evicted),
            gets_hit: hit,
            gets_waited: waited,
            gets_missed: miss,
            full_events: full,
            ..Default::default()
        };
        match inner.actor() {
            Ok(actor) => {
                let clients = actor.clients();
                for c in 0..clients.len() {
                    match clients.liveness(c) {
                        Liveness::Alive => st.clients += 1,
                        Liveness::Dead | Liveness::Recovering => st.dead_clients += 1,
                        Liveness::Free => {}
                    }
                }
            }
            // No slot for this process (a forked child, every slot taken): count what
            // the slots say, without judging who is dead.
            Err(_) => {
                st.clients = inner
                    .client_headers()
                    .iter()
                    .filter(|h| state_of(h.ctl.load(Ordering::Relaxed)) == CLIENT_ALIVE)
                    .count() as u64;
            }
        }
        let g = inner.globals;
        st.recovered_clients = g.recovered_clients.load(Ordering::Relaxed);
        st.reclaimed_bytes = g.reclaimed_bytes.load(Ordering::Relaxed);
        st.sweep_pending = g.sweeps_owed.load(Ordering::Relaxed) != 0;
        st.leaked_blocks_freed = g.leaked_blocks_freed.load(Ordering::Relaxed);
        st
    }

    /// Bytes the allocator has handed out, by a scan of its bitmaps (O(capacity)). Equal
    /// to [`Stats::used`] except for blocks a process killed inside an allocation left
    /// behind, until the leak sweep frees them.
    ///
    /// ```
    /// let s = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(1 << 20))?;
    /// s.put(&shmstore::ObjectId::of_key("a"), &[0; 5000])?;
    /// assert_eq!(s.allocated_bytes(), s.stats().used);
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn allocated_bytes(&self) -> u64 {
        self.inner.alloc().usage().used
    }

    /// The largest object that could be created now: a scan of the allocator's page
    /// bitmap (one word per 256 KiB of capacity), for tools and `Full` diagnostics;
    /// [`stats`](Self::stats) does not scan.
    ///
    /// ```
    /// use shmstore::{Store, StoreConfig};
    /// let s = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20))?;
    /// assert_eq!(s.largest_free(), s.stats().capacity);
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn largest_free(&self) -> u64 {
        self.inner.alloc().largest_free()
    }

    /// Objects (sealed or draining) that at least one process pins now: a scan of the
    /// table (O(objects)), for tools.
    ///
    /// ```
    /// use shmstore::{ObjectId, Store, StoreConfig};
    /// let s = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20))?;
    /// s.put(&ObjectId::of_key("a"), b"x")?;
    /// let v = s.try_get(&ObjectId::of_key("a"))?;
    /// assert_eq!(s.pinned_objects(), 1);
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn pinned_objects(&self) -> u64 {
        let table = self.inner.lookup_table();
        let mut n = 0;
        table.scan(|i, c, _, _| {
            if (c.sealed() || c.state() == DELETED) && table.pins_of(i) > 0 {
                n += 1;
            }
        });
        n
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
        self.recover_backing_off(50)
    }

    /// [`Store::recover`], looking again up to `tries` times, 2 ms apart, for a moment to
    /// run the leak sweep.
    pub(crate) fn recover_backing_off(&self, tries: u32) -> Result<RecoveryReport> {
        if self.inner.read_only {
            return Err(Error::ReadOnly { op: "recover" });
        }
        let actor = self.inner.actor()?;
        let world = actor.world();
        let mut report = world.recover_dead();
        // The sweep needs a moment when no attached process is inside an allocator step.
        // No event marks such a moment (steps end without a wake-up), so back off briefly
        // and look again (`recover`: ~0.1 s at most); if none comes it stays owed for the
        // schedule.
        for _ in 0..tries {
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
        self.objects().collect()
    }

    /// Every object in the table, read one slot at a time as the iterator advances (in
    /// table order, not sorted): a listing of millions of objects starts at once, holds
    /// one entry in memory, and can stop early (`shmstore ls --limit` does). Objects
    /// created or deleted meanwhile may or may not appear; each one shown was in the
    /// state shown when its slot was read.
    ///
    /// ```
    /// use shmstore::{ObjectId, Store, StoreConfig};
    /// let s = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20))?;
    /// for k in ["a", "b", "c"] {
    ///     s.put(&ObjectId::of_key(k), k.as_bytes())?;
    /// }
    /// assert_eq!(s.objects().take(2).count(), 2);
    /// assert_eq!(s.objects().map(|o| o.len).sum::<u64>(), 3);
    /// # Ok::<(), shmstore::Error>(())
    /// ```
    pub fn objects(&self) -> Objects<'_> {
        Objects {
            table: self.inner.lookup_table(),
            next: 0,
        }
    }

    /// Checks every internal invariant: allocator bitmaps agree with their counts, every
    /// table entry describes an allocated block inside the heap, no two blocks overlap,
    /// `used` equals the sum of the live blocks, and the counters [`stats`](Self::stats)
    /// reads agree with the table. Expensive (a full scan); meant for tests
    /// and diagnostics when nothing else is running: it reads the store as it is, so a
    /// step another process has in flight, or a dead process's step not yet recovered,
    /// reads as [`Error::Corrupted`]. `shmstore check NAME` runs it and tells those apart
    /// from damage (several looks while the store's figures stay put, dead processes named).
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
        let table = inner.lookup_table();
        table.scan(|i, c, _, e| {
            if c.state() == RESERVED || err.is_some() {
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
        let attached: Vec<bool> = inner
            .client_headers()
            .iter()
            .map(|h| state_of(h.ctl.load(Ordering::Acquire)) != CLIENT_FREE)
            .collect();
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
        // The counters `stats` adds up must say what the scan says, unless a client died
        // inside a counted step and the sweep that sets the counts right is still owed.
        if inner.globals.sweeps_owed.load(Ordering::Acquire) == 0 {
            let census = inner.globals.census(inner.client_headers());
            let (mut objects, mut creating, mut draining, mut pins) = (0, 0, 0, 0);
            table.scan(|i, c, _, _| {
                match c.state() {
                    CREATING => creating += 1,
                    DELETED => draining += 1,
                    _ if c.sealed() => objects += 1,
                    _ => {}
                }
                pins += table.pins_of(i);
            });
            let scanned = (sum, objects, creating, draining, pins);
            let counted = (
                census.used,
                census.objects,
                census.creating,
                census.draining,
                census.pins,
            );
            if scanned != counted {
                return Err(Error::Corrupted {
                    what: format!(
                        "counters say (used, objects, creating, draining, pins) = \
                         {counted:?}, the table says {scanned:?}"
                    ),
                });
            }
        }
        Ok(())
    }
}

/// The objects of a store, read lazily from its table: see [`Store::objects`].
///
/// ```
/// use shmstore::{ObjectId, ObjectState, Store, StoreConfig};
/// let s = Store::create_anonymous(&StoreConfig::with_capacity(1 << 20))?;
/// s.put(&ObjectId::of_key("a"), b"abc")?;
/// let mut objects = s.objects();
/// assert_eq!(objects.next().map(|o| o.state), Some(ObjectState::Sealed));
/// assert!(objects.next().is_none());
/// # Ok::<(), shmstore::Error>(())
/// ```
pub struct Objects<'a> {
    table: crate::table::Table<'a>,
    next: usize,
}

impl Iterator for Objects<'_> {
    type Item = ObjectInfo;

    fn next(&mut self) -> Option<ObjectInfo> {
        while (self.next as u64) < self.table.capacity() {
            let i = self.next;
            self.next += 1;
            let Some((c, id, e)) = self.table.read_slot(i) else {
                continue;
            };
            let state = match c.state() {
                CREATING => ObjectState::Creating,
                _ if c.sealed() => ObjectState::Sealed,
                DELETED => ObjectState::Draining,
                _ => continue,
            };
            return Some(ObjectInfo {
                id,
                len: e.len,
                meta_len: e.meta_len,
                state,
                pins: self.table.pins_of(i),
            });
        }
        None
    }
}

impl fmt::Debug for Objects<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Objects").field("next", &self.next).finish()
    }
}
