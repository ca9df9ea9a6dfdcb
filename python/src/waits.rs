//! Timeouts from Python and blocking waits: a wait runs without the GIL in slices of
//! [`SIGNAL_SLICE`], checking for signals between them, so Ctrl-C interrupts a
//! `get(timeout=None)`.

use crate::errors::err;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::time::{Duration, Instant};

/// The longest a blocking call runs without the GIL before checking for signals.
pub(crate) const SIGNAL_SLICE: Duration = Duration::from_millis(50);

pub(crate) fn timeout_of(t: Option<f64>) -> PyResult<Duration> {
    match t {
        None => Ok(Duration::from_secs(u32::MAX as u64)),
        Some(s) if s.is_finite() && s >= 0.0 => Ok(Duration::from_secs_f64(s)),
        Some(s) => Err(PyValueError::new_err(format!(
            "timeout {s} must be >= 0 seconds"
        ))),
    }
}

/// Runs `op` (a wait of at most the duration it is given) without the GIL, in slices of
/// at most [`SIGNAL_SLICE`], until it returns something `again` does not match or
/// `timeout` has passed; between slices, pending signals run (Ctrl-C raises
/// `KeyboardInterrupt`). A final `Timeout` reports the whole wait.
pub(crate) fn sliced<T: Send>(
    py: Python<'_>,
    timeout: Duration,
    op: &(dyn Fn(Duration) -> shmstore::Result<T> + Sync),
    again: fn(&shmstore::Error) -> bool,
) -> PyResult<T> {
    let start = Instant::now();
    loop {
        let slice = timeout.saturating_sub(start.elapsed()).min(SIGNAL_SLICE);
        match py.detach(|| op(slice)) {
            Err(e) if again(&e) && start.elapsed() < timeout => py.check_signals()?,
            Err(shmstore::Error::Timeout { id, .. }) => {
                return Err(err(shmstore::Error::Timeout {
                    id,
                    waited: start.elapsed(),
                }))
            }
            other => return other.map_err(err),
        }
    }
}
