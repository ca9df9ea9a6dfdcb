//! `shmstore._native`: the Python bindings of the Rust store (built by maturin, abi3 for
//! CPython >= 3.11). The public Python API is in `python/shmstore/__init__.py`, which
//! re-exports these classes and adds tensor items and the engine/worker caches.
//!
//! What this layer owns:
//! * **Buffers.** A `view::PyView` exports its object's bytes read-only through the buffer
//!   protocol; the memoryview `get` returns (and every numpy array or tensor made from it)
//!   keeps the `PyView` alive, and the `PyView` keeps the object pinned. A
//!   `creation::PyCreation`
//!   exports its bytes writable and counts its exports: it refuses to seal or abort while
//!   one is alive, so no Python object can write to an object after it is published.
//! * **The GIL.** Blocking gets, waits for space, copies of 64 KiB or more, and any call
//!   that may run recovery or eviction run without it; a small put keeps it only on its
//!   fast path (`put_without_slow_work`), where releasing would cost more than the call.
//!   Blocking waits run in slices of `waits::SIGNAL_SLICE` and check for signals between them,
//!   so Ctrl-C interrupts a `get(timeout=None)`.
//! * **Fork.** `shmstore/__init__.py` registers
//!   `view::_after_fork_in_child` with
//!   `os.register_at_fork`: in a child, every live `View` is pinned again in the child's
//!   own name (so arrays made before the fork stay valid while the child holds them), and
//!   creations inherited from the parent refuse to be written, sealed or aborted.
//! * **Errors.** Every `shmstore::Error` becomes an exception class of its own, all derived
//!   from `shmstore.ShmstoreError`, with the Rust message (which says what to do).
//!
//! One module per concept: `errors` (the exception classes), `ids` (ids from Python),
//! `waits` (timeouts and signal-checked blocking waits), `buffers` (holding a Python
//! buffer's bytes, counting exports), `view` (`View`, the fork handler, leaving at exit), `creation`
//! (`Creation`), `store` (`Store` and its operations), `items` (tensor items and their
//! metadata).

mod buffers;
mod creation;
mod errors;
mod ids;
mod items;
mod store;
mod view;
mod waits;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // The one version of crate, bindings and package (the workspace's, in Cargo.toml).
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<store::PyStore>()?;
    m.add_class::<view::PyView>()?;
    m.add_class::<creation::PyCreation>()?;
    m.add_function(wrap_pyfunction!(items::plan_item, m)?)?;
    m.add_function(wrap_pyfunction!(items::put_item_buffers, m)?)?;
    m.add_function(wrap_pyfunction!(items::decode_item, m)?)?;
    m.add_function(wrap_pyfunction!(ids::content_id, m)?)?;
    m.add_function(wrap_pyfunction!(ids::key_id, m)?)?;
    m.add_function(wrap_pyfunction!(view::_after_fork_in_child, m)?)?;
    m.add_function(wrap_pyfunction!(view::leave_all_at_exit, m)?)?;
    errors::add_to(m)?;
    Ok(())
}
