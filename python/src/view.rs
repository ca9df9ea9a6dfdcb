//! [`PyView`]: a sealed object, pinned while it lives, exporting its bytes read-only; and
//! the fork handler that pins every live view again in a forked child; leaving every
//! store at exit.

use crate::errors::err;
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use shmstore::View;
use std::collections::HashSet;
use std::os::raw::{c_int, c_void};
use std::sync::Mutex;

/// The live `View`s of this process (addresses of the Rust `View` inside each `PyView`),
/// for [`_after_fork_in_child`]. Changed only with the GIL held; `fork()` runs with the
/// GIL held, so no thread is inside this mutex when a process forks.
pub(crate) static LIVE_VIEWS: Mutex<Option<HashSet<usize>>> = Mutex::new(None);

pub(crate) fn live_views() -> std::sync::MutexGuard<'static, Option<HashSet<usize>>> {
    LIVE_VIEWS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Called in a child right after `os.fork()` (registered by `shmstore/__init__.py`): tells
/// the store the process forked, then pins every live view again in the child's own name,
/// so that arrays made from them before the fork keep their bytes while the child holds
/// them. A view whose object is already gone stays unpinned here and refuses new buffers
/// (`Forked`).
#[pyfunction]
pub(crate) fn _after_fork_in_child() {
    shmstore::after_fork_in_child();
    let live = live_views();
    for &addr in live.iter().flatten() {
        // SAFETY: every address in LIVE_VIEWS is the `view` field of a live PyView (added
        // on creation, removed in its Drop, both with the GIL held, which we hold now).
        let v = unsafe { &*(addr as *const View) };
        let _ = v.adopt();
    }
}

/// Leaves every store this process attached as an exiting process leaves them, now
/// (`shmstore::leave_all_at_exit`): other processes see it as gone, so the last one out
/// can remove a store while handles of this process are still alive. For exit hooks only:
/// views already made keep their bytes mapped, but no longer pin them.
#[pyfunction]
pub(crate) fn leave_all_at_exit() {
    shmstore::leave_all_at_exit();
}

/// A sealed object, pinned for as long as this object lives. Exports its bytes read-only
/// through the buffer protocol; `Store.get` returns `memoryview(view)`, whose `.obj` is
/// this object.
#[pyclass(module = "shmstore._native", name = "View", frozen)]
pub(crate) struct PyView {
    pub(crate) view: View,
}

impl PyView {
    /// Wraps a view and lists it for the fork handler.
    pub(crate) fn wrap(py: Python<'_>, view: View) -> PyResult<Bound<'_, PyView>> {
        let obj = Bound::new(py, PyView { view })?;
        let addr = &obj.get().view as *const View as usize;
        live_views().get_or_insert_with(HashSet::new).insert(addr);
        Ok(obj)
    }
}

impl Drop for PyView {
    fn drop(&mut self) {
        if let Some(live) = live_views().as_mut() {
            live.remove(&(&self.view as *const View as usize));
        }
    }
}

#[pymethods]
impl PyView {
    /// # Safety
    /// Called by CPython with a valid `Py_buffer` to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if flags & ffi::PyBUF_WRITABLE == ffi::PyBUF_WRITABLE {
            return Err(PyBufferError::new_err(
                "objects are immutable once sealed: this buffer is read-only (copy it to modify)",
            ));
        }
        let v = &slf.get().view;
        // In a forked child: pin again in this process's name (or refuse, if it is gone).
        v.adopt().map_err(err)?;
        // SAFETY: `view` is valid per the caller; the bytes stay valid while the exporter
        // (this object, INCREF'd into view->obj by FillInfo) lives, because it pins them.
        let rc = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                v.as_ptr() as *mut c_void,
                v.len() as ffi::Py_ssize_t,
                1,
                flags,
            )
        };
        if rc == -1 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    /// # Safety
    /// Called by CPython; nothing to release (the pin goes with this object).
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}

    /// The object's 32-byte id.
    #[getter]
    fn id<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, self.view.id().as_bytes())
    }

    /// The object's metadata blob.
    #[getter]
    fn meta<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        self.view.adopt().map_err(err)?;
        Ok(PyBytes::new(py, self.view.meta()))
    }

    /// Address of the first byte in this process (for zero-copy checks).
    #[getter]
    fn address(&self) -> PyResult<usize> {
        self.view.adopt().map_err(err)?;
        Ok(self.view.as_ptr() as usize)
    }

    /// Whether the store still answers this view's id with this very object (false once
    /// it was deleted, or its id stored again as a new object); a lookup, no pin.
    fn is_current(&self) -> bool {
        self.view.is_current()
    }

    fn __len__(&self) -> usize {
        self.view.len()
    }
}
