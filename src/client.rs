//! Client slots: one per attachment, so that everything a process holds is attributable
//! to it, and so that a dead process can be told from a live one.
//!
//! An attachment holds client slot `i` while it holds slot `i`'s *lock* ([`SlotLocks`]; in
//! a real store an OFD lock on one byte of the store file, see [`crate::liveness`]). The
//! kernel drops the lock when the process dies, however it dies, so "`ctl` says ALIVE but
//! nobody holds the lock" means the holder is dead. The rules that make this exact:
//!
//! * the lock is taken **before** the slot's `ctl` leaves FREE, and dropped only **after**
//!   it is FREE again: an ALIVE slot whose lock is free has a dead holder, and there is no
//!   window in which a slot is taken but its holder cannot be judged;
//! * `ctl = generation << 24 | (recoverer + 1) << 8 | state`, states [`CLIENT_FREE`],
//!   [`CLIENT_ALIVE`], [`CLIENT_RECOVERING`]. RECOVERING names the slot whose *lock holder*
//!   is doing the recovery: an attached recoverer names its own slot; a process attaching
//!   into a dead client's slot names that slot itself, whose lock it took first;
//! * the generation changes on every move to ALIVE, so a getter that remembered an
//!   object's creator's `ctl` can tell whether that creator is still the same attachment.
//!
//! The index of a slot marks everything its holder has in hand: its column of pin
//! counters, the `creator` of its unfinished objects, the `owner` of table slots it is
//! part-way through changing. Recovery (see [`crate::recovery`]) finds exactly what a dead
//! client held from those marks.
//!
//! `ops_started` / `ops_finished` bracket every step of this client that changes who owns
//! a block (allocate + insert, free + release). They let the leak sweep prove that no
//! live client was inside such a step while it looked (docs/design.md, "Crashes").
//! `raw_blocks` counts blocks handed out without a table entry (`Store::raw_alloc`), which
//! the sweep must not mistake for leaks.

use crate::layout::CLIENT_HEADER;
use crate::sync::{AtomicU64, Ordering};

/// Client slot states (low byte of `ctl`).
pub(crate) const CLIENT_FREE: u64 = 0;
pub(crate) const CLIENT_ALIVE: u64 = 1;
pub(crate) const CLIENT_RECOVERING: u64 = 2;

/// What one client has done, counted as it goes (its own cache lines: no counter on a
/// hot path is shared between processes). `stats()` adds these up over the clients plus
/// the totals of clients that have left (folded into the store's globals when a slot is
/// released), so it costs O(clients), not O(table). Object and byte counts change only
/// inside ownership-changing steps, and the fold into the totals is one too, so a client
/// killed mid-way owes a leak sweep, which corrects any count it left off (see
/// `crate::recovery`; tests/kill_points.rs kills a process at each write to check it).
#[repr(C)]
#[derive(Default)]
pub(crate) struct Counters {
    /// Objects inserted (CREATING).
    pub inserted: AtomicU64,
    /// Objects sealed.
    pub sealed: AtomicU64,
    /// Creations aborted (by their creator, or by recovery).
    pub aborted: AtomicU64,
    /// Sealed objects deleted or evicted.
    pub deleted: AtomicU64,
    /// Objects whose block was freed.
    pub freed: AtomicU64,
    /// Bytes of blocks named by inserted objects.
    pub bytes_in: AtomicU64,
    /// Bytes of blocks freed with their objects.
    pub bytes_out: AtomicU64,
    /// Payload bytes of inserted objects (what creators write).
    pub payload_in: AtomicU64,
    /// Gets that found the object sealed at once.
    pub gets_hit: AtomicU64,
    /// Gets that ended without the object (absent, timed out, creator died).
    pub gets_miss: AtomicU64,
    /// Gets that had to wait for a seal.
    pub gets_waited: AtomicU64,
    /// Allocations that failed with `Full`.
    pub full: AtomicU64,
    /// Objects this client's allocations evicted.
    pub evicted: AtomicU64,
    /// Payload bytes of those objects.
    pub evicted_bytes: AtomicU64,
    /// Pins this client holds now (not folded: a client that leaves holds none).
    pub pins_held: AtomicU64,
}

/// The number of counters in [`Counters`].
pub(crate) const COUNTERS: usize = 15;

impl Counters {
    /// The counters in declaration order.
    pub(crate) fn all(&self) -> [&AtomicU64; COUNTERS] {
        [
            &self.inserted,
            &self.sealed,
            &self.aborted,
            &self.deleted,
            &self.freed,
            &self.bytes_in,
            &self.bytes_out,
            &self.payload_in,
            &self.gets_hit,
            &self.gets_miss,
            &self.gets_waited,
            &self.full,
            &self.evicted,
            &self.evicted_bytes,
            &self.pins_held,
        ]
    }

    /// Adds this client's counters into `totals` and zeroes them (a slot being released).
    /// Pins are not carried over: whoever releases a slot has dropped or recovered them.
    pub(crate) fn fold_into(&self, totals: &Counters) {
        let (mine, theirs) = (self.all(), totals.all());
        for (m, t) in mine.iter().zip(theirs).take(COUNTERS - 1) {
            let v = m.swap(0, Ordering::Relaxed);
            if v != 0 {
                t.fetch_add(v, Ordering::Relaxed);
            }
        }
        self.pins_held.store(0, Ordering::Relaxed);
    }
}

/// One client slot (256 bytes in the region).
#[repr(C)]
#[derive(Default)]
pub(crate) struct ClientHeader {
    /// `generation << 24 | (recoverer + 1) << 8 | state`.
    pub ctl: AtomicU64,
    /// Process id of the holder, for messages and tools only (liveness is the lock).
    pub pid: AtomicU64,
    /// Wall-clock attach time, ns since the epoch.
    pub attached_unix_ns: AtomicU64,
    /// Ownership-changing steps begun.
    pub ops_started: AtomicU64,
    /// Ownership-changing steps finished.
    pub ops_finished: AtomicU64,
    /// Blocks from `raw_alloc` not yet given back.
    pub raw_blocks: AtomicU64,
    _pad: [u64; 2],
    /// What this client has done (from the second cache line on).
    pub counters: Counters,
    _reserved: [u64; 9],
}

#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<ClientHeader>() as u64 == CLIENT_HEADER);

/// The state byte of a client `ctl` word.
pub(crate) fn state_of(ctl: u64) -> u64 {
    ctl & 0xff
}

/// The recovering slot named in a RECOVERING `ctl` word.
pub(crate) fn recoverer_of(ctl: u64) -> Option<u64> {
    ((ctl >> 8) & 0xffff).checked_sub(1)
}

fn generation_of(ctl: u64) -> u64 {
    ctl >> 24
}

/// `ctl` moved to ALIVE at the next generation.
fn alive_after(ctl: u64) -> u64 {
    (generation_of(ctl).wrapping_add(1) << 24) | CLIENT_ALIVE
}

/// `ctl` moved to RECOVERING by slot `by`, same generation.
fn recovering_by(ctl: u64, by: u64) -> u64 {
    (generation_of(ctl) << 24) | (by + 1) << 8 | CLIENT_RECOVERING
}

/// `ctl` moved to FREE, same generation.
fn free_after(ctl: u64) -> u64 {
    generation_of(ctl) << 24 | CLIENT_FREE
}

/// The liveness locks of the client slots, as one attachment holds and sees them.
pub(crate) trait SlotLocks {
    /// Takes slot `i`'s lock for this attachment (it may hold it already); `false` if
    /// another attachment holds it.
    fn try_lock(&self, i: u64) -> bool;
    /// Drops this attachment's lock on slot `i`.
    fn unlock(&self, i: u64);
    /// Whether another attachment, in any process, holds slot `i`'s lock (if in doubt:
    /// `true`).
    fn locked_elsewhere(&self, i: u64) -> bool;
}

/// Whether the holder of a client slot still runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Liveness {
    /// No process holds the slot.
    Free,
    /// Its holder runs.
    Alive,
    /// Its holder died; nobody has recovered it yet.
    Dead,
    /// A recoverer is returning what the dead holder left.
    Recovering,
}

/// What an attaching process found in the slot whose lock it took.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Claimed {
    /// The slot was FREE and is now ALIVE, ours.
    Fresh,
    /// The slot belonged to a dead client and is now RECOVERING in our hands (named by
    /// itself): recover it as client `i`, then [`Clients::finish_claim`].
    Dead,
}

/// Every client slot, as seen by one attachment (`me`: the slot it holds, if any).
pub(crate) struct Clients<'a> {
    headers: &'a [ClientHeader],
    locks: &'a dyn SlotLocks,
    me: Option<u64>,
    /// Where a released slot's counters go (the store's totals).
    totals: Option<&'a Counters>,
}

impl<'a> Clients<'a> {
    pub(crate) fn new(
        headers: &'a [ClientHeader],
        locks: &'a dyn SlotLocks,
        me: Option<u64>,
    ) -> Self {
        Clients {
            headers,
            locks,
            me,
            totals: None,
        }
    }

    /// Folds the counters of slots this view releases into `totals`.
    pub(crate) fn folding_into(mut self, totals: &'a Counters) -> Self {
        self.totals = Some(totals);
        self
    }

    /// Every client header (for summing counters).
    pub(crate) fn headers(&self) -> &'a [ClientHeader] {
        self.headers
    }

    /// Number of client slots.
    pub(crate) fn len(&self) -> u64 {
        self.headers.len() as u64
    }

    /// Slot `i`'s header; `None` out of range (indices read from shared memory are
    /// untrusted).
    pub(crate) fn get(&self, i: u64) -> Option<&'a ClientHeader> {
        self.headers.get(usize::try_from(i).ok()?)
    }

    /// Slot `i`'s `ctl` now (0, FREE, out of range).
    pub(crate) fn ctl(&self, i: u64) -> u64 {
        self.get(i).map_or(0, |h| h.ctl.load(Ordering::Acquire))
    }

    /// Whether slot `i`'s lock is held: by us (`me`), or by another attachment.
    pub(crate) fn holder_alive(&self, i: u64) -> bool {
        Some(i) == self.me || (i < self.len() && self.locks.locked_elsewhere(i))
    }

    /// Whether slot `i` is attached and its holder runs.
    pub(crate) fn liveness(&self, i: u64) -> Liveness {
        match state_of(self.ctl(i)) {
            CLIENT_ALIVE if self.holder_alive(i) => Liveness::Alive,
            CLIENT_ALIVE => Liveness::Dead,
            CLIENT_RECOVERING => Liveness::Recovering,
            _ => Liveness::Free,
        }
    }

    /// Attaching: tries to take slot `i` (see [`Claimed`]); a dead client's slot only if
    /// `take_dead` (attaching prefers free slots, leaving the dead to recovery, which
    /// counts them). `None`: another live attachment holds it, a live recoverer is working
    /// on it, or it is a dead client's and `!take_dead`; we hold no lock then.
    pub(crate) fn try_claim(&self, i: u64, take_dead: bool) -> Option<Claimed> {
        let h = self.get(i)?;
        if !self.locks.try_lock(i) {
            return None;
        }
        // The lock is ours: whoever held this slot before us is dead or gone.
        let mut c = h.ctl.load(Ordering::Acquire);
        loop {
            if state_of(c) != CLIENT_FREE && !take_dead {
                self.locks.unlock(i);
                return None;
            }
            let (next, found) = match state_of(c) {
                CLIENT_FREE => (alive_after(c), Claimed::Fresh),
                // Its holder died (its lock was free): recover it as itself.
                CLIENT_ALIVE => (recovering_by(c, i), Claimed::Dead),
                CLIENT_RECOVERING => match recoverer_of(c) {
                    // A process that was moving in died midway: take over its recovery.
                    Some(by) if by == i => return Some(Claimed::Dead),
                    // A live recoverer is at work: it will free the slot soon.
                    Some(by) if by < self.len() && self.locks.locked_elsewhere(by) => {
                        self.locks.unlock(i);
                        return None;
                    }
                    _ => (recovering_by(c, i), Claimed::Dead),
                },
                _ => {
                    self.locks.unlock(i); // corrupt: leave it alone
                    return None;
                }
            };
            match h
                .ctl
                .compare_exchange(c, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    if found == Claimed::Fresh {
                        settle(h);
                    } else if crate::sync::mutation("inherit_unlocked") {
                        // Deliberate bug, for docs/verification.md: move in without
                        // keeping the slot's lock (what "inherit" was before the locks).
                        self.locks.unlock(i);
                    }
                    return Some(found);
                }
                Err(now) => c = now,
            }
        }
    }

    /// After recovering a slot taken as [`Claimed::Dead`]: moves it to ALIVE, ours.
    /// `false` if a recoverer took it over meanwhile (it judged the slot by its lock
    /// before we locked it); the lock is dropped then, and the caller tries elsewhere.
    pub(crate) fn finish_claim(&self, i: u64) -> bool {
        let Some(h) = self.get(i) else { return false };
        let mut c = h.ctl.load(Ordering::Acquire);
        loop {
            let ours = match state_of(c) {
                CLIENT_RECOVERING => recoverer_of(c) == Some(i),
                CLIENT_FREE => true, // the other recoverer finished and released it
                _ => false,
            };
            if !ours {
                self.locks.unlock(i);
                return false;
            }
            match h
                .ctl
                .compare_exchange(c, alive_after(c), Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    settle(h);
                    return true;
                }
                Err(now) => c = now,
            }
        }
    }

    /// Records who holds slot `i` (informational: for messages and tools).
    pub(crate) fn describe(&self, i: u64, pid: u64, now_ns: u64) {
        if let Some(h) = self.get(i) {
            h.pid.store(pid, Ordering::Relaxed);
            h.attached_unix_ns.store(now_ns, Ordering::Relaxed);
        }
    }

    /// Returns slot `i` to FREE (its holder detaches, or recovery is done with it). Does
    /// not touch the lock: a detaching holder then calls [`detach`](Self::detach).
    pub(crate) fn release(&self, i: u64) {
        let Some(h) = self.get(i) else { return };
        // A holder that died inside a step left `started > finished` (and maybe raw
        // blocks): recovery has owed a sweep for it. Settle so the next holder starts quiet.
        settle(h);
        if let Some(totals) = self.totals {
            // Moving the counts is a step too: a death between a counter's swap and its
            // add loses that count, so the slot shows a step begun until the next claim
            // settles it, and the recovery of a death here owes the sweep that corrects
            // the counts.
            begin_op(h);
            h.counters.fold_into(totals);
        }
        h.pid.store(0, Ordering::Relaxed);
        let c = h.ctl.load(Ordering::Acquire);
        if state_of(c) != CLIENT_FREE {
            let _ = h
                .ctl
                .compare_exchange(c, free_after(c), Ordering::AcqRel, Ordering::Relaxed);
        }
    }

    /// Our own slot `i`: FREE first, then the lock goes.
    pub(crate) fn detach(&self, i: u64) {
        self.release(i);
        self.locks.unlock(i);
    }

    /// Takes slot `d` for recovery by us (`me`) if its holder, or the recoverer working on
    /// it, is dead: one CAS to RECOVERING(me). Returns the new `ctl`.
    pub(crate) fn claim_for_recovery(&self, d: u64) -> Option<u64> {
        let me = self.me?;
        let h = self.get(d)?;
        if d == me {
            return None;
        }
        let c = h.ctl.load(Ordering::Acquire);
        let dead = match state_of(c) {
            CLIENT_ALIVE => !self.holder_alive(d),
            CLIENT_RECOVERING => {
                let by = recoverer_of(c)?;
                // `by == me`: in hand (maybe by another thread of ours).
                by != me && !self.holder_alive(by)
            }
            _ => false,
        };
        if !dead {
            return None;
        }
        let next = recovering_by(c, me);
        h.ctl
            .compare_exchange(c, next, Ordering::AcqRel, Ordering::Relaxed)
            .ok()
            .map(|_| next)
    }

    /// Slots other than `d` left RECOVERING by `d` (a recoverer that died midway): the
    /// caller recovering `d` takes them over so that no claim names `d` once it is free.
    pub(crate) fn take_over_recoveries_of(&self, d: u64) -> Vec<u64> {
        let Some(me) = self.me else { return vec![] };
        (0..self.len())
            .filter(|&x| x != d && x != me)
            .filter(|&x| {
                let c = self.ctl(x);
                state_of(c) == CLIENT_RECOVERING
                    && recoverer_of(c) == Some(d)
                    && self.headers[x as usize]
                        .ctl
                        .compare_exchange(
                            c,
                            recovering_by(c, me),
                            Ordering::AcqRel,
                            Ordering::Relaxed,
                        )
                        .is_ok()
            })
            .collect()
    }

    /// `(started, finished, raw_blocks)` of slot `i`: the first two are equal when the
    /// client is outside every ownership-changing step.
    pub(crate) fn ops(&self, i: u64) -> (u64, u64, u64) {
        self.get(i).map_or((0, 0, 0), |h| {
            (
                h.ops_started.load(Ordering::Acquire),
                h.ops_finished.load(Ordering::Acquire),
                h.raw_blocks.load(Ordering::Acquire),
            )
        })
    }
}

/// Makes `ops_finished` equal `ops_started` and forgets raw blocks (only for a slot nobody
/// else uses).
fn settle(h: &ClientHeader) {
    let started = h.ops_started.load(Ordering::Acquire);
    h.ops_finished.store(started, Ordering::Release);
    h.raw_blocks.store(0, Ordering::Release);
}

/// Starts an ownership-changing step.
pub(crate) fn begin_op(h: &ClientHeader) {
    h.ops_started.fetch_add(1, Ordering::SeqCst);
}

/// Ends it.
pub(crate) fn end_op(h: &ClientHeader) {
    h.ops_finished.fetch_add(1, Ordering::Release);
}

/// Slot locks kept in process memory, for unit tests and loom models: `holders[i]` is the
/// id (+1) of the attachment holding slot `i`'s lock, 0 if none.
#[cfg(any(test, loom))]
pub(crate) mod testing {
    use super::*;

    pub(crate) struct MemLocks<'a> {
        pub holders: &'a [AtomicU64],
        pub id: u64,
    }

    impl SlotLocks for MemLocks<'_> {
        fn try_lock(&self, i: u64) -> bool {
            let h = &self.holders[i as usize];
            match h.compare_exchange(0, self.id + 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => true,
                Err(v) => v == self.id + 1,
            }
        }
        fn unlock(&self, i: u64) {
            let _ = self.holders[i as usize].compare_exchange(
                self.id + 1,
                0,
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
        }
        fn locked_elsewhere(&self, i: u64) -> bool {
            let v = self.holders[i as usize].load(Ordering::Acquire);
            v != 0 && v != self.id + 1
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::testing::MemLocks;
    use super::*;

    fn slots(n: usize) -> (Vec<ClientHeader>, Vec<AtomicU64>) {
        (
            (0..n).map(|_| ClientHeader::default()).collect(),
            (0..n).map(|_| AtomicU64::new(0)).collect(),
        )
    }

    /// Attachment ids `0..n`, over `held`; the first `h.len()` each take their own slot.
    fn attach_each<'a>(h: &[ClientHeader], held: &'a [AtomicU64], n: u64) -> Vec<MemLocks<'a>> {
        let l: Vec<MemLocks> = (0..n).map(|id| MemLocks { holders: held, id }).collect();
        for (i, lk) in l.iter().enumerate().take(h.len()) {
            assert_eq!(
                Clients::new(h, lk, None).try_claim(i as u64, true),
                Some(Claimed::Fresh)
            );
        }
        l
    }

    #[test]
    fn claim_liveness_recovery_and_takeover() {
        let (h, held) = slots(3);
        let (a, b, c) = (
            MemLocks {
                holders: &held,
                id: 10,
            },
            MemLocks {
                holders: &held,
                id: 11,
            },
            MemLocks {
                holders: &held,
                id: 12,
            },
        );
        let attaching = Clients::new(&h, &a, None);
        assert_eq!(attaching.try_claim(0, true), Some(Claimed::Fresh));
        let ca = Clients::new(&h, &a, Some(0));
        let cb = Clients::new(&h, &b, None);
        assert_eq!(cb.try_claim(0, true), None, "a live holder's slot");
        assert_eq!(cb.try_claim(1, true), Some(Claimed::Fresh));
        let cb = Clients::new(&h, &b, Some(1));
        assert_eq!(ca.liveness(1), Liveness::Alive);
        assert_eq!(ca.liveness(0), Liveness::Alive, "our own slot");
        assert_eq!(ca.liveness(2), Liveness::Free);
        let g = ca.ctl(1) >> 24;
        // b dies: its lock goes with it.
        held[1].store(0, Ordering::Relaxed);
        assert_eq!(ca.liveness(1), Liveness::Dead);
        let rec = ca.claim_for_recovery(1).unwrap();
        assert_eq!(
            (state_of(rec), recoverer_of(rec)),
            (CLIENT_RECOVERING, Some(0))
        );
        assert_eq!(ca.claim_for_recovery(1), None, "already in hand");
        // An attaching process meets the slot under a live recoverer and leaves it.
        let cc = Clients::new(&h, &c, None);
        assert_eq!(cc.try_claim(1, true), None);
        assert_eq!(held[1].load(Ordering::Relaxed), 0, "it gave the lock back");
        ca.release(1);
        assert_eq!(ca.liveness(1), Liveness::Free);
        assert_eq!(cc.try_claim(1, true), Some(Claimed::Fresh));
        assert_ne!(ca.ctl(1) >> 24, g, "a new attachment has a new generation");
        assert_eq!(cb.liveness(0), Liveness::Alive);
    }

    #[test]
    fn moving_into_a_dead_slot_recovers_it_first_and_a_racing_recoverer_wins_or_loses_cleanly() {
        let (h, held) = slots(2);
        let (a, b, c) = (
            MemLocks {
                holders: &held,
                id: 1,
            },
            MemLocks {
                holders: &held,
                id: 2,
            },
            MemLocks {
                holders: &held,
                id: 3,
            },
        );
        assert_eq!(
            Clients::new(&h, &a, None).try_claim(0, true),
            Some(Claimed::Fresh)
        );
        assert_eq!(
            Clients::new(&h, &b, None).try_claim(1, true),
            Some(Claimed::Fresh)
        );
        held[1].store(0, Ordering::Relaxed); // b dies
                                             // c moves into b's slot: it takes the lock first, so a's recovery keeps off.
        let cc = Clients::new(&h, &c, None);
        assert_eq!(cc.try_claim(1, false), None, "free slots first");
        assert_eq!(
            held[1].load(Ordering::Relaxed),
            0,
            "the lock was given back"
        );
        assert_eq!(cc.try_claim(1, true), Some(Claimed::Dead));
        let ca = Clients::new(&h, &a, Some(0));
        assert_eq!(ca.liveness(1), Liveness::Recovering);
        assert_eq!(ca.claim_for_recovery(1), None, "the mover holds the lock");
        assert!(cc.finish_claim(1));
        assert_eq!(ca.liveness(1), Liveness::Alive);
        // Now the other order: a claims for recovery first; the mover backs off.
        held[1].store(0, Ordering::Relaxed); // c dies
        assert!(ca.claim_for_recovery(1).is_some());
        let b2 = MemLocks {
            holders: &held,
            id: 4,
        };
        assert_eq!(Clients::new(&h, &b2, None).try_claim(1, true), None);
        assert_eq!(
            held[1].load(Ordering::Relaxed),
            0,
            "the lock was given back"
        );
        // A mover that died midway is taken over by the next one.
        ca.release(1);
        let d = MemLocks {
            holders: &held,
            id: 5,
        };
        assert_eq!(
            Clients::new(&h, &d, None).try_claim(1, true),
            Some(Claimed::Fresh)
        );
        held[1].store(0, Ordering::Relaxed);
        let e = MemLocks {
            holders: &held,
            id: 6,
        };
        assert_eq!(
            Clients::new(&h, &e, None).try_claim(1, true),
            Some(Claimed::Dead)
        );
        held[1].store(0, Ordering::Relaxed); // e dies moving in
        let f = MemLocks {
            holders: &held,
            id: 7,
        };
        assert_eq!(
            Clients::new(&h, &f, None).try_claim(1, true),
            Some(Claimed::Dead)
        );
        assert!(Clients::new(&h, &f, None).finish_claim(1));
    }

    #[test]
    fn a_dead_recoverers_claims_are_taken_over_with_it() {
        let (h, held) = slots(3);
        let l = attach_each(&h, &held, 3);
        held[2].store(0, Ordering::Relaxed); // 2 dies
        assert!(Clients::new(&h, &l[1], Some(1))
            .claim_for_recovery(2)
            .is_some());
        held[1].store(0, Ordering::Relaxed); // its recoverer dies too
        let c0 = Clients::new(&h, &l[0], Some(0));
        assert!(c0.claim_for_recovery(1).is_some());
        assert_eq!(c0.take_over_recoveries_of(1), vec![2]);
        assert_eq!(recoverer_of(c0.ctl(2)), Some(0));
    }

    #[test]
    fn a_released_slot_adds_its_counts_to_the_totals_and_starts_from_zero() {
        let (h, held) = slots(1);
        let a = MemLocks {
            holders: &held,
            id: 0,
        };
        let totals = Counters::default();
        for (k, t) in totals.all().iter().enumerate() {
            t.store(100 * k as u64, Ordering::Relaxed);
        }
        let c = Clients::new(&h, &a, None).folding_into(&totals);
        assert_eq!(c.try_claim(0, true), Some(Claimed::Fresh));
        for (k, m) in h[0].counters.all().iter().enumerate() {
            m.store(k as u64 + 1, Ordering::Relaxed);
        }
        c.detach(0);
        let after: Vec<u64> = totals
            .all()
            .iter()
            .map(|t| t.load(Ordering::Relaxed))
            .collect();
        let want: Vec<u64> = (0..COUNTERS as u64)
            .map(|k| {
                if k + 1 == COUNTERS as u64 {
                    100 * k
                } else {
                    101 * k + 1
                }
            })
            .collect();
        assert_eq!(after, want, "every count but pins added, pins not carried");
        assert!(
            h[0].counters
                .all()
                .iter()
                .all(|m| m.load(Ordering::Relaxed) == 0),
            "the next holder starts from zero"
        );
        let (started, finished, _) = c.ops(0);
        assert_eq!(started, finished + 1, "the fold is a step, left begun");
        assert_eq!(c.try_claim(0, true), Some(Claimed::Fresh));
        let (started, finished, _) = c.ops(0);
        assert_eq!(started, finished, "a fresh claim starts quiet");
    }

    #[test]
    fn a_slot_whose_recoverer_died_is_taken_by_the_next_mover_and_a_forged_recoverer_is_dead() {
        let (h, held) = slots(3);
        let l = attach_each(&h, &held, 4);
        assert!(l[0].try_lock(0), "a lock we hold is ours again");
        held[2].store(0, Ordering::Relaxed); // 2 dies
        assert!(Clients::new(&h, &l[1], Some(1))
            .claim_for_recovery(2)
            .is_some());
        held[1].store(0, Ordering::Relaxed); // its recoverer dies too
                                             // A process attaching into slot 2 finds it RECOVERING by a dead slot: it takes
                                             // the recovery over (as itself) instead of waiting for a recoverer that is gone.
        let mover = Clients::new(&h, &l[3], None);
        assert_eq!(mover.try_claim(2, true), Some(Claimed::Dead));
        assert_eq!(recoverer_of(mover.ctl(2)), Some(2));
        assert!(mover.finish_claim(2));
        let c0 = Clients::new(&h, &l[0], Some(0));
        assert_eq!(c0.liveness(2), Liveness::Alive);
        // A recoverer index past the slots (a corrupt word) is nobody: the slot is free
        // to take, for a mover and for a recoverer, and nothing looks past the locks.
        let forged = (mover.ctl(1) >> 24) << 24 | 4 << 8 | CLIENT_RECOVERING;
        assert_eq!(recoverer_of(forged), Some(3));
        h[1].ctl.store(forged, Ordering::Relaxed);
        assert_eq!(c0.liveness(1), Liveness::Recovering);
        assert!(c0.claim_for_recovery(1).is_some());
        h[1].ctl.store(forged, Ordering::Relaxed);
        assert_eq!(
            Clients::new(&h, &l[1], None).try_claim(1, true),
            Some(Claimed::Dead)
        );
    }

    #[test]
    fn a_mover_finishes_a_claim_a_racing_recoverer_released_and_not_one_it_still_holds() {
        let (h, held) = slots(2);
        let l = attach_each(&h, &held, 3);
        held[1].store(0, Ordering::Relaxed); // 1 dies
        let mover = Clients::new(&h, &l[2], None);
        assert_eq!(mover.try_claim(1, true), Some(Claimed::Dead));
        // Recoverer 0 judged slot 1 dead before the mover locked it; its CAS lands now.
        let c = mover.ctl(1);
        let by0 = recovering_by(c, 0);
        h[1].ctl.store(by0, Ordering::Relaxed);
        assert!(!mover.finish_claim(1), "0 is still at work on it");
        assert_eq!(held[1].load(Ordering::Relaxed), 0, "the mover let go");
        assert_eq!(mover.ctl(1), by0, "and left 0's claim alone");
        // Again, but 0 is done and has released the slot before the mover finishes.
        assert_eq!(mover.try_claim(1, true), None, "a live recoverer's slot");
        h[1].ctl.store(c, Ordering::Relaxed);
        assert_eq!(mover.try_claim(1, true), Some(Claimed::Dead));
        h[1].ctl.store(by0, Ordering::Relaxed);
        Clients::new(&h, &l[0], Some(0)).release(1);
        assert!(
            mover.finish_claim(1),
            "a slot released under it is the mover's"
        );
        assert_eq!(state_of(mover.ctl(1)), CLIENT_ALIVE);
        assert!(!l[0].try_lock(1), "the mover holds the lock");
    }

    #[test]
    fn ops_counters_and_settling() {
        let (h, held) = slots(1);
        let a = MemLocks {
            holders: &held,
            id: 0,
        };
        let c = Clients::new(&h, &a, None);
        assert_eq!(c.try_claim(0, true), Some(Claimed::Fresh));
        begin_op(&h[0]);
        assert_eq!(c.ops(0), (1, 0, 0));
        end_op(&h[0]);
        assert_eq!(c.ops(0), (1, 1, 0));
        begin_op(&h[0]);
        h[0].raw_blocks.store(3, Ordering::Relaxed);
        c.detach(0);
        assert_eq!(c.ops(0), (2, 2, 0), "settled on release");
        assert_eq!(held[0].load(Ordering::Relaxed), 0);
    }
}
