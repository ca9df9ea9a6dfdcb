//! Buffers: [`RawBuf`] holds the bytes of any C-contiguous buffer-protocol object while
//! Rust reads them (with or without the GIL), and [`ExportCount`] counts the buffers a
//! view or creation has exported.

use pyo3::ffi;
use pyo3::prelude::*;
use std::mem::MaybeUninit;

// A process-local count of Python buffer exports, never in shared memory: the crate's
// rule (every shared atomic through `shmstore`'s loom shim) does not apply.
#[allow(clippy::disallowed_types)]
pub(crate) type ExportCount = std::sync::atomic::AtomicUsize;
pub(crate) const RELAXED: std::sync::atomic::Ordering = std::sync::atomic::Ordering::Relaxed;

/// Copies at or above this size run without the GIL.
pub(crate) const RELEASE_GIL_AT: usize = 64 << 10;

/// The bytes of any C-contiguous buffer-protocol object, held (so the exporter cannot
/// resize or free them) until dropped.
pub(crate) struct RawBuf {
    pub(crate) view: Box<ffi::Py_buffer>,
}

// SAFETY: the buffer's memory stays valid and unmoved while the export is held, whichever
// thread reads it; the export is released in `Drop` with the GIL held.
unsafe impl Send for RawBuf {}
// SAFETY: as above; `as_slice` only reads.
unsafe impl Sync for RawBuf {}

impl RawBuf {
    pub(crate) fn get(obj: &Bound<'_, PyAny>) -> PyResult<RawBuf> {
        let mut view: Box<MaybeUninit<ffi::Py_buffer>> = Box::new(MaybeUninit::uninit());
        // SAFETY: `obj` is a live object (we hold the GIL) and `view` points to writable
        // memory for one Py_buffer. PyBUF_SIMPLE asks for contiguous bytes; exporters
        // that cannot provide them fail with BufferError.
        let rc =
            unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), view.as_mut_ptr(), ffi::PyBUF_SIMPLE) };
        if rc != 0 {
            return Err(PyErr::fetch(obj.py()));
        }
        // SAFETY: PyObject_GetBuffer returned 0, so it filled the whole struct.
        let view = unsafe { Box::from_raw(Box::into_raw(view) as *mut ffi::Py_buffer) };
        Ok(RawBuf { view })
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        let len = self.view.len.max(0) as usize;
        if len == 0 || self.view.buf.is_null() {
            return &[];
        }
        // SAFETY: the exporter guarantees `len` readable bytes at `buf` while the export
        // is held (until our Drop).
        unsafe { std::slice::from_raw_parts(self.view.buf as *const u8, len) }
    }
}

impl Drop for RawBuf {
    fn drop(&mut self) {
        // SAFETY: the view was filled by a successful PyObject_GetBuffer and is released
        // exactly once, with the GIL held.
        Python::attach(|_| unsafe { ffi::PyBuffer_Release(&mut *self.view) });
    }
}
