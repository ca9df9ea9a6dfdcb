//! Client slots: one per attached process, so that everything a process holds is
//! attributable to it, and so that a dead process can be told from a live one.
//!
//! A process attaching to a store claims a free client slot with one CAS and records its
//! pid and the kernel's start time for that pid (field 22 of `/proc/PID/stat`), which a
//! recycled pid cannot reproduce. Its client index then marks everything it holds: its
//! column of pin counters, the `creator` of its unfinished objects, the `owner` of table
//! slots it is part-way through changing. Recovery (see [`crate::recovery`]) finds exactly
//! what a dead client held from those marks.
//!
//! `ctl = generation << 24 | (recoverer + 1) << 8 | state`, states [`CLIENT_FREE`],
//! [`CLIENT_ALIVE`], [`CLIENT_RECOVERING`]. The generation changes on every claim, so a
//! getter that remembered `ctl` of an object's creator can tell whether that creator is
//! still the same attachment.
//!
//! `ops_started` / `ops_finished` bracket every step of this client that changes who owns
//! a block (allocate + insert, free + release). They let the leak sweep prove that no
//! live client was inside such a step while it looked (docs/design.md, "Crashes").

use crate::layout::CLIENT_HEADER;
use crate::sync::{AtomicU64, Ordering};

/// Client slot states (low byte of `ctl`).
pub(crate) const CLIENT_FREE: u64 = 0;
pub(crate) const CLIENT_ALIVE: u64 = 1;
pub(crate) const CLIENT_RECOVERING: u64 = 2;

/// One client slot (256 bytes in the region).
#[repr(C)]
#[derive(Default)]
pub(crate) struct ClientHeader {
    /// `generation << 24 | (recoverer + 1) << 8 | state`.
    pub ctl: AtomicU64,
    /// Process id of the holder.
    pub pid: AtomicU64,
    /// Kernel start time of that pid, in clock ticks since boot.
    pub start_time: AtomicU64,
    /// Wall-clock attach time, ns since the epoch.
    pub attached_unix_ns: AtomicU64,
    /// Ownership-changing steps begun.
    pub ops_started: AtomicU64,
    /// Ownership-changing steps finished.
    pub ops_finished: AtomicU64,
    /// Inode of the holder's pid namespace: pids are only compared within one.
    pub pid_ns: AtomicU64,
}

const _: () = assert!(std::mem::size_of::<ClientHeader>() as u64 <= CLIENT_HEADER);

/// The state byte of a client `ctl` word.
pub(crate) fn state_of(ctl: u64) -> u64 {
    ctl & 0xff
}

/// The recovering client named in a RECOVERING `ctl` word.
pub(crate) fn recoverer_of(ctl: u64) -> Option<u64> {
    ((ctl >> 8) & 0xffff).checked_sub(1)
}

/// One client's slot.
pub(crate) struct Client<'a> {
    pub header: &'a ClientHeader,
}

impl Client<'_> {
    /// Tries to take this slot for the current process.
    pub(crate) fn try_claim(&self, me: &Identity, now_ns: u64) -> bool {
        let c = self.header.ctl.load(Ordering::Relaxed);
        if state_of(c) != CLIENT_FREE {
            return false;
        }
        let next = ((c >> 24).wrapping_add(1) << 24) | CLIENT_ALIVE;
        if self
            .header
            .ctl
            .compare_exchange(c, next, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            return false;
        }
        self.settle_ops();
        // The slot reads "start time 0" (unknown, never judged dead) until all is written.
        self.header.pid_ns.store(me.pid_ns, Ordering::Relaxed);
        self.header.pid.store(me.pid, Ordering::Relaxed);
        self.header
            .attached_unix_ns
            .store(now_ns, Ordering::Relaxed);
        self.header
            .start_time
            .store(me.start_time, Ordering::Release);
        true
    }

    /// The `ctl` word now.
    pub(crate) fn ctl(&self) -> u64 {
        self.header.ctl.load(Ordering::Acquire)
    }

    /// Releases the slot (the process detaches, or recovery finished with it).
    pub(crate) fn release(&self) {
        let c = self.header.ctl.load(Ordering::Relaxed);
        // A holder that died inside a step left `started > finished`; recovery has owed a
        // sweep for it. Settle the counters so the next holder starts quiet.
        self.settle_ops();
        self.header.start_time.store(0, Ordering::Relaxed);
        self.header.pid.store(0, Ordering::Relaxed);
        self.header
            .ctl
            .store((c >> 24) << 24 | CLIENT_FREE, Ordering::Release);
    }

    /// Whether a process (or a recoverer on its behalf) holds this slot.
    pub(crate) fn is_attached(&self) -> bool {
        state_of(self.ctl()) != CLIENT_FREE
    }

    /// Makes `ops_finished` equal `ops_started` (only for a slot nobody else uses).
    fn settle_ops(&self) {
        let started = self.header.ops_started.load(Ordering::Acquire);
        self.header.ops_finished.store(started, Ordering::Release);
    }

    /// Starts an ownership-changing step.
    pub(crate) fn begin_op(&self) {
        self.header.ops_started.fetch_add(1, Ordering::SeqCst);
    }

    /// Ends it.
    pub(crate) fn end_op(&self) {
        self.header.ops_finished.fetch_add(1, Ordering::Release);
    }

    /// `(started, finished)`: equal when the client is outside every such step.
    pub(crate) fn ops(&self) -> (u64, u64) {
        (
            self.header.ops_started.load(Ordering::Acquire),
            self.header.ops_finished.load(Ordering::Acquire),
        )
    }

    /// Moves into the slot of a dead client: one CAS to RECOVERING by our own index `me`
    /// (so others see the slot in hand), then our identity. The caller cleans up what
    /// the dead client held, then calls [`finish_inherit`](Self::finish_inherit).
    pub(crate) fn try_inherit(&self, id: &Identity, now_ns: u64, me: u64) -> bool {
        let seen = self.ctl();
        if state_of(seen) != CLIENT_ALIVE || self.process_alive(id) {
            return false;
        }
        if self.claim_for_recovery(seen, me).is_none() {
            return false;
        }
        // Start time 0 ("unknown", so never judged dead) while the other fields change.
        self.header.start_time.store(0, Ordering::Release);
        self.header.pid_ns.store(id.pid_ns, Ordering::Relaxed);
        self.header.pid.store(id.pid, Ordering::Relaxed);
        self.header
            .attached_unix_ns
            .store(now_ns, Ordering::Relaxed);
        self.header
            .start_time
            .store(id.start_time, Ordering::Release);
        true
    }

    /// Completes [`try_inherit`](Self::try_inherit): RECOVERING(by us) -> ALIVE at a new
    /// generation. `false` if a recoverer took the slot meanwhile.
    pub(crate) fn finish_inherit(&self, me: u64) -> bool {
        let c = self.ctl();
        if state_of(c) != CLIENT_RECOVERING || recoverer_of(c) != Some(me) {
            return false;
        }
        let next = ((c >> 24).wrapping_add(1) << 24) | CLIENT_ALIVE;
        self.header
            .ctl
            .compare_exchange(c, next, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
    }

    /// Takes over the slot of a dead client (or of a dead recoverer) for recovery by
    /// client `me`: one CAS from the `ctl` value `seen`. Returns the new `ctl`.
    pub(crate) fn claim_for_recovery(&self, seen: u64, me: u64) -> Option<u64> {
        let next = (seen >> 24) << 24 | (me + 1) << 8 | CLIENT_RECOVERING;
        self.header
            .ctl
            .compare_exchange(seen, next, Ordering::AcqRel, Ordering::Relaxed)
            .ok()
            .map(|_| next)
    }
}

/// Whether the process that holds a client slot still runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Liveness {
    /// No process holds the slot.
    Free,
    /// The recorded pid runs and started at the recorded time.
    Alive,
    /// The recorded pid is gone, or was reused by a process that started later.
    Dead,
    /// A recoverer is returning what the dead holder left.
    Recovering,
}

impl Client<'_> {
    /// Checks the holder's pid and start time against `/proc` (see
    /// [`process_alive`](Self::process_alive)).
    pub(crate) fn liveness(&self, observer: &Identity) -> Liveness {
        match state_of(self.ctl()) {
            CLIENT_ALIVE => {}
            CLIENT_RECOVERING => return Liveness::Recovering,
            _ => return Liveness::Free,
        }
        if self.process_alive(observer) {
            Liveness::Alive
        } else {
            Liveness::Dead
        }
    }

    /// Whether the recorded pid runs with the recorded start time, as far as `observer`
    /// can tell. A holder whose identity cannot be checked from here (unknown start time,
    /// another pid namespace, or an observer without /proc) counts as alive: recovering a
    /// live client would free memory it still reads, so doubt always means "alive".
    pub(crate) fn process_alive(&self, observer: &Identity) -> bool {
        let start = self.header.start_time.load(Ordering::Acquire);
        let pid = self.header.pid.load(Ordering::Relaxed);
        let ns = self.header.pid_ns.load(Ordering::Relaxed);
        if start == 0 || observer.start_time == 0 || ns == 0 || ns != observer.pid_ns {
            return true;
        }
        matches!(u32::try_from(pid).ok().and_then(process_start_time), Some(t) if t == start)
    }
}

/// Who a process is, in the terms client slots record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Identity {
    /// Process id.
    pub pid: u64,
    /// Kernel start time (0 if /proc is unreadable).
    pub start_time: u64,
    /// Pid namespace inode (0 if unknown).
    pub pid_ns: u64,
}

impl Identity {
    /// The calling process.
    pub(crate) fn current() -> Self {
        let pid = std::process::id();
        Identity {
            pid: pid as u64,
            start_time: process_start_time(pid).unwrap_or(0),
            pid_ns: pid_namespace().unwrap_or(0),
        }
    }
}

/// Inode of this process's pid namespace (`/proc/self/ns/pid` -> `pid:[N]`).
fn pid_namespace() -> Option<u64> {
    let link = std::fs::read_link("/proc/self/ns/pid").ok()?;
    let s = link.to_str()?;
    s.strip_prefix("pid:[")?.strip_suffix(']')?.parse().ok()
}

/// Kernel start time of `pid` (clock ticks since boot), from `/proc/PID/stat`.
pub(crate) fn process_start_time(pid: u32) -> Option<u64> {
    if pid == 0 {
        return None;
    }
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parens: fields resume after the last ')'.
    let rest = &s[s.rfind(')')? + 2..];
    rest.split(' ').nth(19)?.parse().ok()
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    #[cfg_attr(miri, ignore = "reads /proc, which miri's isolation hides")]
    fn start_time_is_stable_and_known_for_self() {
        let me = std::process::id();
        let a = process_start_time(me).unwrap();
        assert_eq!(process_start_time(me), Some(a));
        assert_eq!(process_start_time(u32::MAX - 1), None);
        assert_eq!(process_start_time(0), None);
    }

    #[test]
    #[cfg_attr(miri, ignore = "reads /proc, which miri's isolation hides")]
    fn claims_liveness_and_recovery_takeover() {
        let header = ClientHeader::default();
        let c = Client { header: &header };
        let me = Identity::current();
        assert_ne!(me.pid_ns, 0);
        assert_eq!(c.liveness(&me), Liveness::Free);
        assert!(c.try_claim(&me, 3));
        assert!(!c.try_claim(&me, 3));
        assert_eq!(c.liveness(&me), Liveness::Alive);
        // Another pid namespace: pids mean nothing here, so never judged dead.
        header.pid_ns.store(me.pid_ns + 1, Ordering::Relaxed);
        header.start_time.store(1, Ordering::Relaxed);
        assert_eq!(c.liveness(&me), Liveness::Alive);
        // Same pid, different start time: a recycled pid is not the holder.
        header.pid_ns.store(me.pid_ns, Ordering::Relaxed);
        assert_eq!(c.liveness(&me), Liveness::Dead);
        let seen = c.ctl();
        let rec = c.claim_for_recovery(seen, 4).unwrap();
        assert_eq!(c.claim_for_recovery(seen, 5), None, "one recoverer wins");
        assert_eq!(
            (state_of(rec), recoverer_of(rec)),
            (CLIENT_RECOVERING, Some(4))
        );
        assert_eq!(c.liveness(&me), Liveness::Recovering);
        c.release();
        assert!(!c.is_attached());
        assert!(c.try_claim(&me, 3));
        assert_ne!(
            c.ctl() >> 24,
            seen >> 24,
            "a new attachment has a new generation"
        );
        c.begin_op();
        assert_eq!(c.ops(), (1, 0));
        c.end_op();
        assert_eq!(c.ops(), (1, 1));
    }
}
