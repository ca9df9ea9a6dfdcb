//! Waiting for a seal: per-bucket futex words shared by every process.
//!
//! Ids hash onto a fixed array of wait buckets (a futex word `seq` and a count of
//! sleepers). A sealer bumps its id's bucket sequence and wakes sleepers only if the
//! count says there are some; a getter spins briefly on the sequence, then registers,
//! re-checks, and sleeps on the futex until the sequence moves or its deadline passes.
//!
//! Invariant (no lost wake-up): both sides use read-modify-writes on the two words in
//! opposite orders (sealer: `seq += 1`, then `waiters += 0`; sleeper: `waiters += 1`, then
//! `seq += 0`, then the re-check), so either the sealer sees the sleeper registered or
//! the sleeper sees the new sequence and the seal before it. Model-checked in
//! `loom_models`, with a deliberate bug (`lost_wakeup`) that the model catches. Buckets
//! are shared by unrelated ids: a wake can be spurious, never missing.

use super::*;
use crate::sync::{futex, AtomicU32};
use std::time::{Duration, Instant};

/// A futex word plus the number of sleepers on it.
#[repr(C, align(64))]
#[derive(Default)]
pub(crate) struct WaitBucket {
    seq: AtomicU32,
    waiters: AtomicU32,
}

impl WaitBucket {
    /// Bumps the sequence and wakes sleepers, if any (see [`Table::notify`]).
    pub(crate) fn notify(&self) {
        self.seq.fetch_add(1, Ordering::AcqRel);
        if self.waiters.fetch_add(0, Ordering::AcqRel) != 0 {
            futex::wake_all(&self.seq);
        }
    }

    /// Like [`notify`](Self::notify), but only if someone looks asleep (a plain load, so
    /// a sleeper registering at this instant may miss it; callers' sleepers re-check on a
    /// short period). For hot paths.
    pub(crate) fn nudge(&self) {
        if self.waiters.load(Ordering::Relaxed) != 0 {
            self.notify();
        }
    }

    /// Registers as a sleeper; returns the sequence to sleep on. Re-check the condition
    /// after this, then [`sleep`](Self::sleep), then [`unregister`](Self::unregister).
    pub(crate) fn register(&self) -> u32 {
        self.waiters.fetch_add(1, Ordering::AcqRel);
        self.seq.fetch_add(0, Ordering::AcqRel)
    }

    /// The current sequence (for a sleeper already registered).
    pub(crate) fn sequence(&self) -> u32 {
        self.seq.fetch_add(0, Ordering::AcqRel)
    }

    /// Sleeps while the sequence is `seq`, at most `timeout`.
    pub(crate) fn sleep(&self, seq: u32, timeout: Duration) {
        futex::wait(&self.seq, seq, Some(timeout));
    }

    /// Stops being a sleeper.
    pub(crate) fn unregister(&self) {
        self.waiters.fetch_sub(1, Ordering::AcqRel);
    }

    /// How many sleepers are registered now (tests).
    #[cfg(test)]
    pub(crate) fn registered(&self) -> u32 {
        self.waiters.load(Ordering::Acquire)
    }
}

impl Table<'_> {
    /// The wait bucket for `id`.
    pub(super) fn wait_bucket(&self, id: &ObjectId) -> &WaitBucket {
        &self.waits[((id.mix() >> 40) % WAIT_BUCKETS) as usize]
    }

    /// How many getters sleep on `id`'s bucket now (tests: to act once a getter waits).
    #[cfg(test)]
    pub(crate) fn sleepers(&self, id: &ObjectId) -> u32 {
        self.wait_bucket(id).registered()
    }

    /// Wakes getters sleeping on `id`'s bucket (no syscall when nobody sleeps).
    ///
    /// Both sides of the sleeper/waker handshake use read-modify-writes (`seq += 1` then
    /// `waiters += 0` here; `waiters += 1` then `seq += 0` in [`pin_wait`](Self::pin_wait)).
    /// An RMW always reads the latest value of its location, so whichever of the two `seq`
    /// RMWs comes second synchronises with the first: either the waker sees the waiter
    /// registered, or the waiter sees the new `seq` (and the seal before it). This needs
    /// only acquire/release, which loom models exactly (it treats SeqCst as AcqRel).
    pub(crate) fn notify(&self, id: &ObjectId) {
        self.wait_bucket(id).notify();
    }

    /// Pins `id`, waiting until it is sealed or `deadline` passes (`None`: try once).
    ///
    /// Waiting first spins for up to `spin` watching the id's wait-bucket sequence (a seal
    /// that lands in that window is seen in a cache-line transfer, with no syscall on
    /// either side), then sleeps on the bucket's futex. Sleepers register in `waiters`
    /// before their final check, so a sealer that sees no waiter can skip the wake.
    pub(crate) fn pin_wait(
        &self,
        id: &ObjectId,
        deadline: Option<Instant>,
        spin: Duration,
    ) -> Result<Pin> {
        let first = self.pin(id)?;
        let Some(deadline) = deadline else {
            return Ok(first);
        };
        if matches!(first, Pin::Pinned(..)) {
            return Ok(first);
        }
        let wb = self.wait_bucket(id);
        if !spin.is_zero() {
            // Checked: a huge `spin` (a user setting) just means "spin until the deadline".
            let spin_end = Instant::now()
                .checked_add(spin)
                .map_or(deadline, |end| deadline.min(end));
            loop {
                let seq = wb.seq.load(Ordering::Acquire);
                if let p @ Pin::Pinned(..) = self.pin(id)? {
                    return Ok(p);
                }
                loop {
                    if Instant::now() >= spin_end {
                        break;
                    }
                    if wb.seq.load(Ordering::Relaxed) != seq {
                        break;
                    }
                    crate::sync::spin_hint();
                }
                if Instant::now() >= spin_end {
                    break;
                }
            }
        }
        wb.waiters.fetch_add(1, Ordering::AcqRel);
        let result = loop {
            // Read the futex word *before* the re-check: a seal after this read changes it,
            // so the wait below returns at once instead of missing the wake.
            let mut seq = 0;
            if !crate::sync::mutation("lost_wakeup") {
                seq = wb.seq.fetch_add(0, Ordering::AcqRel);
            }
            let found = self.pin(id);
            if crate::sync::mutation("lost_wakeup") {
                // Deliberate bug, for docs/verification.md: re-check before reading the word.
                seq = wb.seq.fetch_add(0, Ordering::AcqRel);
            }
            match found {
                Ok(Pin::Pinned(r, e)) => break Ok(Pin::Pinned(r, e)),
                Err(e) => break Err(e),
                Ok(other) => {
                    let now = Instant::now();
                    if now >= deadline {
                        break Ok(other);
                    }
                    futex::wait(&wb.seq, seq, Some(deadline - now));
                }
            }
        };
        wb.waiters.fetch_sub(1, Ordering::AcqRel);
        result
    }
}
