//! The one door to atomics and to futex waits.
//!
//! Every atomic that lives in shared memory, and every wait/wake on one, goes through this
//! module. Under `cfg(loom)` the same names resolve to loom's model-checked types, so the
//! protocol code in [`crate::alloc`], [`crate::table`] and [`crate::client`] runs unchanged
//! inside loom models. Direct use of `std::sync::atomic` elsewhere is rejected by clippy
//! (`disallowed-types` in `clippy.toml`).
//!
//! # Futexes: shared, never private
//! A waiter in one process must be woken by a sealer in another. `atomic-wait` (and std's own
//! parking) always passes `FUTEX_PRIVATE_FLAG`, which keys the wait queue on the *virtual*
//! address inside one process: a waker in another process never finds it. We therefore call
//! `futex(2)` without the private flag (rustix's safe wrapper, empty flags), so the kernel keys the queue on
//! the shared page itself (inode + offset); this works even when the processes map the region
//! at different addresses. Every wait has a timeout, so a lost wake-up (or a dead waker) can
//! only ever cost the caller its own timeout. See docs/design.md, "Waiting".
//!
//! # Kill points
//! Because every write of shared state passes through here, so does every point at which
//! a process's death can leave shared memory in a state of its own. With the
//! `kill-points` feature (tests only) a test can SIGKILL its process just before any one
//! of them (`kill_points`); tests/kill_points.rs kills a process at each, operation by
//! operation. Without the feature the hook compiles to nothing.
//!
//! Under loom a futex is modelled as one global `Mutex` + `Condvar`: the waiter checks the
//! word under the mutex, the waker takes the mutex after its store and notifies everyone.
//! Loom has no clock, so timeouts are ignored in models (a model that could only finish by
//! timing out shows up as a deadlock, which is what we want to hear about).

#![allow(clippy::disallowed_types)]

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicU16, AtomicU32, AtomicU64, Ordering};
/// Process-local pointers only (never in shared memory, where offsets are the rule).
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::AtomicPtr;
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, Ordering};

/// Std atomics behind `repr(transparent)` newtypes: the same layout (so shared memory can
/// be viewed as them, and all-zero bytes are a valid value), but distinct types, so that
/// clippy's `disallowed-types` catches any direct use of `std::sync::atomic` elsewhere.
#[cfg(not(loom))]
macro_rules! atomic_newtype {
    ($name:ident, $std:ty, $int:ty) => {
        #[doc = concat!("`", stringify!($std), "` for shared memory, switchable to loom.")]
        #[repr(transparent)]
        #[derive(Default, Debug)]
        pub(crate) struct $name($std);

        #[allow(dead_code)]
        impl $name {
            pub(crate) const fn new(v: $int) -> Self {
                Self(<$std>::new(v))
            }
            #[inline]
            pub(crate) fn load(&self, o: Ordering) -> $int {
                self.0.load(o)
            }
            #[inline]
            pub(crate) fn store(&self, v: $int, o: Ordering) {
                kill_point();
                self.0.store(v, o)
            }
            #[inline]
            pub(crate) fn compare_exchange(
                &self,
                cur: $int,
                new: $int,
                ok: Ordering,
                fail: Ordering,
            ) -> Result<$int, $int> {
                kill_point();
                self.0.compare_exchange(cur, new, ok, fail)
            }
            #[inline]
            pub(crate) fn compare_exchange_weak(
                &self,
                cur: $int,
                new: $int,
                ok: Ordering,
                fail: Ordering,
            ) -> Result<$int, $int> {
                kill_point();
                self.0.compare_exchange_weak(cur, new, ok, fail)
            }
            #[inline]
            pub(crate) fn fetch_add(&self, v: $int, o: Ordering) -> $int {
                kill_point();
                self.0.fetch_add(v, o)
            }
            #[inline]
            pub(crate) fn fetch_sub(&self, v: $int, o: Ordering) -> $int {
                kill_point();
                self.0.fetch_sub(v, o)
            }
            #[inline]
            pub(crate) fn swap(&self, v: $int, o: Ordering) -> $int {
                kill_point();
                self.0.swap(v, o)
            }
            #[inline]
            pub(crate) fn fetch_and(&self, v: $int, o: Ordering) -> $int {
                kill_point();
                self.0.fetch_and(v, o)
            }
            #[inline]
            pub(crate) fn fetch_or(&self, v: $int, o: Ordering) -> $int {
                kill_point();
                self.0.fetch_or(v, o)
            }
        }
    };
}

#[cfg(not(loom))]
atomic_newtype!(AtomicU16, std::sync::atomic::AtomicU16, u16);
#[cfg(not(loom))]
atomic_newtype!(AtomicU32, std::sync::atomic::AtomicU32, u32);
#[cfg(not(loom))]
atomic_newtype!(AtomicU64, std::sync::atomic::AtomicU64, u64);

/// A point where this process's death would leave shared memory in a state of its own:
/// just before each store, compare-exchange and read-modify-write of an atomic, and
/// each futex wake. With the `kill-points` feature a test can kill the process at any
/// one of them (`kill_points`); otherwise this compiles to nothing.
#[cfg(not(loom))]
#[inline(always)]
fn kill_point() {
    #[cfg(feature = "kill-points")]
    kill_points::reached();
}

/// Crash injection at every kill point (feature `kill-points`, for tests only; see
/// tests/kill_points.rs and docs/verification.md, "Kill points").
///
/// A thread [`arm`](kill_points::arm)s a count of the kill points it passes from then on,
/// and, if it chose one, the process is SIGKILLed just before that write: the state the
/// other processes then find is the one a kill at any instruction between the previous
/// write and this one would leave (loads change nothing they can see). Only the arming
/// thread counts, so background threads (page-table population) cannot shift the count.
#[cfg(all(feature = "kill-points", not(loom)))]
pub(crate) mod kill_points {
    use std::cell::Cell;

    thread_local! {
        static ARMED: Cell<bool> = const { Cell::new(false) };
        static PASSED: Cell<u64> = const { Cell::new(0) };
        static KILL_AT: Cell<u64> = const { Cell::new(0) };
    }

    /// Counts one kill point of this thread, and dies if it is the chosen one.
    #[inline]
    pub(crate) fn reached() {
        if !ARMED.get() {
            return;
        }
        let n = PASSED.get() + 1;
        PASSED.set(n);
        if n == KILL_AT.get() {
            if std::env::var_os("SHMSTORE_KILL_POINT_BACKTRACE").is_some() {
                eprintln!(
                    "kill point {n}:\n{}",
                    std::backtrace::Backtrace::force_capture()
                );
            }
            // SAFETY: getpid and kill take no pointers and have no preconditions.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
            // A SIGKILL sent to oneself is delivered before kill(2) returns; should it
            // not be, the process still must not go on past the chosen point.
            std::process::abort();
        }
    }

    /// Starts counting this thread's kill points from zero; `kill_at = Some(n)`: die
    /// just before the `n`th (1-based).
    pub(crate) fn arm(kill_at: Option<u64>) {
        PASSED.set(0);
        KILL_AT.set(kill_at.unwrap_or(0));
        ARMED.set(true);
    }

    /// Stops counting; returns how many kill points this thread passed since [`arm`].
    pub(crate) fn disarm() -> u64 {
        ARMED.set(false);
        PASSED.get()
    }
}

/// `UnsafeCell` with loom's closure API (`with`, `with_mut`), so that loom can check every
/// access for data races. Protocol code that hands out plain memory (payload bytes) is
/// modelled with it in the loom models.
#[cfg(loom)]
#[allow(unused_imports)]
pub(crate) use loom::cell::UnsafeCell;

/// Std twin of loom's `UnsafeCell`.
#[cfg(not(loom))]
#[derive(Debug, Default)]
#[allow(dead_code)]
pub(crate) struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

#[cfg(not(loom))]
#[allow(dead_code)]
impl<T> UnsafeCell<T> {
    pub(crate) const fn new(v: T) -> Self {
        Self(std::cell::UnsafeCell::new(v))
    }
    /// Calls `f` with a shared raw pointer to the value.
    pub(crate) fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
        f(self.0.get())
    }
    /// Calls `f` with a unique raw pointer to the value.
    pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}

/// The deliberate bug this process carries, if any: loom builds read it from the
/// `SHMSTORE_MUTATION` environment variable when a model first asks (`scripts/loom.sh
/// --mutations` runs each model with its mutation and checks that it fails;
/// docs/verification.md). Every other build carries none, whatever the environment says,
/// and folds [`mutation`] to `false` at compile time.
#[cfg(loom)]
fn carried_mutation() -> Option<&'static str> {
    static MUTATION: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    MUTATION
        .get_or_init(|| {
            std::env::var("SHMSTORE_MUTATION")
                .ok()
                .filter(|m| !m.is_empty())
        })
        .as_deref()
}
#[cfg(not(loom))]
#[inline(always)]
const fn carried_mutation() -> Option<&'static str> {
    None
}

/// `strong`, or `weak` in a process that carries the deliberate bug `name`: how a
/// mutation weakens an ordering (see [`carried_mutation`]).
#[inline(always)]
pub(crate) fn weakened_by(name: &str, strong: Ordering, weak: Ordering) -> Ordering {
    if mutation(name) {
        weak
    } else {
        strong
    }
}

/// Whether this process carries the deliberate bug `name` (see [`carried_mutation`]).
#[inline(always)]
pub(crate) fn mutation(name: &str) -> bool {
    carried_mutation() == Some(name)
}

/// Back off inside a CAS retry loop (a pause instruction; a yield under loom).
#[inline]
pub(crate) fn spin_hint() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::hint::spin_loop();
}

/// Cross-process wait/wake on a 32-bit word in shared memory.
pub(crate) mod futex {
    use super::AtomicU32;
    use std::time::Duration;

    /// Sleeps while `*word == expected`, for at most `timeout` (`None`: no limit).
    ///
    /// Returns early on a wake, on a signal, or at once if the word no longer holds
    /// `expected`; callers always re-check their condition in a loop.
    #[cfg(not(loom))]
    pub(crate) fn wait(word: &AtomicU32, expected: u32, timeout: Option<Duration>) {
        let ts = timeout.map(|t| rustix::thread::futex::Timespec {
            tv_sec: t.as_secs().min(i64::MAX as u64) as i64,
            tv_nsec: i64::from(t.subsec_nanos()),
        });
        // Flags::empty(), not PRIVATE: the kernel keys the queue on the backing page, so
        // wakers in other processes find it. Errors (EAGAIN, EINTR, ETIMEDOUT) all mean
        // "return and re-check", which every caller does.
        let _ = rustix::thread::futex::wait(
            &word.0,
            rustix::thread::futex::Flags::empty(),
            expected,
            ts.as_ref(),
        );
    }

    /// Wakes every process and thread sleeping on `word`.
    #[cfg(not(loom))]
    pub(crate) fn wake_all(word: &AtomicU32) {
        super::kill_point();
        // Shared (non-private), to match `wait`.
        let _ =
            rustix::thread::futex::wake(&word.0, rustix::thread::futex::Flags::empty(), u32::MAX);
    }

    #[cfg(loom)]
    loom::lazy_static! {
        static ref PARK: (loom::sync::Mutex<()>, loom::sync::Condvar) =
            (loom::sync::Mutex::new(()), loom::sync::Condvar::new());
    }

    /// Loom stand-in: check under the model mutex, then sleep on the model condvar.
    #[cfg(loom)]
    pub(crate) fn wait(word: &AtomicU32, expected: u32, _timeout: Option<Duration>) {
        let guard = PARK.0.lock().unwrap();
        if word.load(super::Ordering::SeqCst) == expected {
            drop(PARK.1.wait(guard).unwrap());
        }
    }

    /// Loom stand-in: take the model mutex after the caller's store, then notify everyone.
    #[cfg(loom)]
    pub(crate) fn wake_all(_word: &AtomicU32) {
        drop(PARK.0.lock().unwrap());
        PARK.1.notify_all();
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    #[test]
    fn wait_returns_at_once_when_word_differs() {
        let w = AtomicU32::new(5);
        let t = Instant::now();
        futex::wait(&w, 4, Some(Duration::from_secs(5)));
        assert!(t.elapsed() < Duration::from_secs(1));
    }

    #[test]
    fn wait_times_out() {
        let w = AtomicU32::new(0);
        let t = Instant::now();
        futex::wait(&w, 0, Some(Duration::from_millis(20)));
        assert!(t.elapsed() >= Duration::from_millis(19));
    }

    #[test]
    fn wake_releases_a_waiter() {
        let w = Arc::new(AtomicU32::new(0));
        let w2 = Arc::clone(&w);
        let h = std::thread::spawn(move || {
            while w2.load(Ordering::Acquire) == 0 {
                futex::wait(&w2, 0, Some(Duration::from_secs(10)));
            }
        });
        w.store(1, Ordering::Release);
        futex::wake_all(&w);
        h.join().unwrap();
    }
}
