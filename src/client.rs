//! Client slots: one per attached process, so that everything a process holds is
//! attributable to it.
//!
//! A process attaching to a store claims a free client slot with one CAS and records its
//! pid and the kernel's start time for that pid (field 22 of `/proc/PID/stat`), which a
//! recycled pid cannot reproduce. Every pin and every unfinished creation the process holds
//! is written to a *hold record* in its slot, so a later recovery pass (docs/design.md,
//! "Crashes") can find exactly what a dead process held: release its pins, free its
//! unfinished creations.
//!
//! Hold record encoding (one `u64`, 0 = empty):
//! `kind << 63 | (slot_index + 1) << 32 | generation`, kind 0 = pin, 1 = creation.
//!
//! Only the owning process writes its records (threads claim entries with CAS, starting
//! from a process-local cursor), so no process ever contends with another here.

use crate::error::{Error, Result};
use crate::layout::CLIENT_HEADER;
use crate::sync::{AtomicU64, Ordering};
use crate::table::SlotRef;

/// Client slot states (low byte of `ctl`).
pub(crate) const CLIENT_FREE: u64 = 0;
pub(crate) const CLIENT_ALIVE: u64 = 1;

/// The fixed part of a client slot.
#[repr(C)]
#[derive(Default)]
pub(crate) struct ClientHeader {
    /// `generation << 8 | state`.
    pub ctl: AtomicU64,
    /// Process id of the holder.
    pub pid: AtomicU64,
    /// Kernel start time of that pid, in clock ticks since boot.
    pub start_time: AtomicU64,
    /// Wall-clock attach time, ns since the epoch.
    pub attached_unix_ns: AtomicU64,
}

const _: () = assert!(std::mem::size_of::<ClientHeader>() as u64 <= CLIENT_HEADER);

/// What a hold record stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HoldKind {
    /// A pin held by a view.
    Pin,
    /// An unfinished creation.
    Creation,
}

/// Encodes a hold record.
pub(crate) fn encode_hold(kind: HoldKind, r: SlotRef) -> u64 {
    let k = matches!(kind, HoldKind::Creation) as u64;
    k << 63 | (r.index as u64 + 1) << 32 | r.gen as u64
}

/// Decodes a hold record; `None` for an empty one or one no writer produces.
pub(crate) fn decode_hold(v: u64) -> Option<(HoldKind, SlotRef)> {
    let idx = (v >> 32) & 0x7fff_ffff;
    if idx == 0 {
        return None;
    }
    let kind = if v >> 63 == 1 {
        HoldKind::Creation
    } else {
        HoldKind::Pin
    };
    Some((
        kind,
        SlotRef {
            index: (idx - 1) as u32,
            gen: v as u32,
        },
    ))
}

/// One client's header and hold records.
pub(crate) struct Client<'a> {
    pub header: &'a ClientHeader,
    pub holds: &'a [AtomicU64],
}

impl Client<'_> {
    /// Tries to take this slot for the current process.
    pub(crate) fn try_claim(&self, pid: u64, start_time: u64, now_ns: u64) -> bool {
        let c = self.header.ctl.load(Ordering::Relaxed);
        if c & 0xff != CLIENT_FREE {
            return false;
        }
        let next = ((c >> 8).wrapping_add(1) << 8) | CLIENT_ALIVE;
        if self
            .header
            .ctl
            .compare_exchange(c, next, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            return false;
        }
        self.header.pid.store(pid, Ordering::Relaxed);
        self.header.start_time.store(start_time, Ordering::Relaxed);
        self.header
            .attached_unix_ns
            .store(now_ns, Ordering::Release);
        true
    }

    /// Records a hold, starting the search at `cursor`. Returns the record index.
    pub(crate) fn add_hold(&self, value: u64, cursor: &AtomicU64) -> Result<u32> {
        let n = self.holds.len();
        let start = cursor.load(Ordering::Relaxed) as usize % n;
        for k in 0..n {
            let i = (start + k) % n;
            if self.holds[i].load(Ordering::Relaxed) == 0
                && self.holds[i]
                    .compare_exchange(0, value, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
            {
                cursor.store(i as u64 + 1, Ordering::Relaxed);
                return Ok(i as u32);
            }
        }
        Err(Error::TooManyHolds { limit: n as u32 })
    }

    /// Clears a hold record.
    pub(crate) fn clear_hold(&self, i: u32) {
        if let Some(h) = self.holds.get(i as usize) {
            h.store(0, Ordering::Release);
        }
    }

    /// Live hold records.
    pub(crate) fn holds(&self) -> impl Iterator<Item = (HoldKind, SlotRef)> + '_ {
        self.holds
            .iter()
            .filter_map(|h| decode_hold(h.load(Ordering::Acquire)))
    }

    /// Releases the slot (the process detaches).
    pub(crate) fn release(&self) {
        let c = self.header.ctl.load(Ordering::Relaxed);
        self.header.pid.store(0, Ordering::Relaxed);
        self.header.ctl.store(c & !0xff, Ordering::Release);
    }

    /// Whether a process holds this slot.
    pub(crate) fn is_attached(&self) -> bool {
        self.header.ctl.load(Ordering::Acquire) & 0xff == CLIENT_ALIVE
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
}

impl Client<'_> {
    /// Checks the holder's pid and start time against `/proc` (same pid namespace).
    pub(crate) fn liveness(&self) -> Liveness {
        if !self.is_attached() {
            return Liveness::Free;
        }
        let pid = self.header.pid.load(Ordering::Relaxed);
        let start = self.header.start_time.load(Ordering::Relaxed);
        match u32::try_from(pid).ok().and_then(process_start_time) {
            Some(t) if t == start => Liveness::Alive,
            _ => Liveness::Dead,
        }
    }
}

/// Kernel start time of `pid` (clock ticks since boot), from `/proc/PID/stat`.
pub(crate) fn process_start_time(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parens: fields resume after the last ')'.
    let rest = &s[s.rfind(')')? + 2..];
    rest.split(' ').nth(19)?.parse().ok()
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn hold_records_round_trip() {
        for kind in [HoldKind::Pin, HoldKind::Creation] {
            let r = SlotRef {
                index: 123_456,
                gen: u32::MAX,
            };
            assert_eq!(decode_hold(encode_hold(kind, r)), Some((kind, r)));
        }
        assert_eq!(decode_hold(0), None);
    }

    #[test]
    #[cfg_attr(miri, ignore = "reads /proc, which miri's isolation hides")]
    fn start_time_is_stable_and_known_for_self() {
        let me = std::process::id();
        let a = process_start_time(me).unwrap();
        assert_eq!(process_start_time(me), Some(a));
        assert_eq!(process_start_time(u32::MAX - 1), None);
    }

    #[test]
    fn claims_and_holds() {
        let header = ClientHeader::default();
        let holds: Vec<AtomicU64> = (0..4).map(|_| AtomicU64::new(0)).collect();
        let c = Client {
            header: &header,
            holds: &holds,
        };
        assert!(c.try_claim(1, 2, 3));
        assert!(!c.try_claim(1, 2, 3));
        let cur = AtomicU64::new(0);
        let r = SlotRef { index: 5, gen: 6 };
        let idx: Vec<u32> = (0..4)
            .map(|_| c.add_hold(encode_hold(HoldKind::Pin, r), &cur).unwrap())
            .collect();
        assert!(matches!(
            c.add_hold(1 << 32, &cur),
            Err(Error::TooManyHolds { limit: 4 })
        ));
        assert_eq!(c.holds().count(), 4);
        idx.iter().for_each(|&i| c.clear_hold(i));
        assert_eq!(c.holds().count(), 0);
        c.release();
        assert!(!c.is_attached());
        assert!(c.try_claim(1, 2, 3));
    }
}
