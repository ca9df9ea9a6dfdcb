//! [`PyCreation`]: an object being written. Exports its bytes writable and counts the
//! exports: it refuses to seal or abort while one is alive, so no Python object can write
//! to an object after it is published.

use crate::buffers::{ExportCount, RawBuf, RELAXED};
use crate::errors::err;
use pyo3::exceptions::{PyBufferError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyMemoryView};
use shmstore::{Creation, ObjectId};
use std::os::raw::{c_int, c_void};

/// An object being written. Exports its bytes writable (`.buffer`, or `memoryview(c)`);
/// `seal()` publishes it, `abort()` (or dropping it) frees it. As a context manager it
/// seals on a normal exit and aborts on an exception.
#[pyclass(module = "shmstore._native", name = "Creation")]
pub(crate) struct PyCreation {
    pub(crate) c: Option<Creation>,
    pub(crate) id: ObjectId,
    pub(crate) len: usize,
    pub(crate) exports: ExportCount,
}

impl PyCreation {
    pub(crate) fn finish(&mut self, seal: bool) -> PyResult<()> {
        if let Some(c) = &self.c {
            c.writable_here().map_err(err)?; // a forked child's copy is the parent's
        }
        let n = self.exports.load(RELAXED);
        if n > 0 {
            return Err(PyBufferError::new_err(format!(
                "{n} buffer(s) exported from this creation are still alive: delete the arrays \
                 and memoryviews made from it (or call .release() on the memoryviews) before \
                 seal() or abort(), so that nothing can write to the object once it is published"
            )));
        }
        match self.c.take() {
            Some(c) if seal => c.seal().map_err(err),
            Some(c) => {
                c.abort();
                Ok(())
            }
            None => Err(PyValueError::new_err(
                "this creation was already sealed or aborted",
            )),
        }
    }
}

#[pymethods]
impl PyCreation {
    /// # Safety
    /// Called by CPython with a valid `Py_buffer` to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let ptr = {
            let mut this = slf.borrow_mut();
            match this.c.as_mut() {
                Some(c) => {
                    c.writable_here().map_err(err)?;
                    c.as_mut_ptr()
                }
                None => {
                    return Err(PyBufferError::new_err(
                        "this creation was sealed or aborted; its memory is no longer writable",
                    ))
                }
            }
        };
        let len = slf.borrow().len;
        // SAFETY: `view` is valid per the caller; the block is ours alone until sealed,
        // and seal/abort refuse while an export is alive, so the bytes outlive it.
        let rc = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                ptr as *mut c_void,
                len as ffi::Py_ssize_t,
                0,
                flags,
            )
        };
        if rc == -1 {
            return Err(PyErr::fetch(slf.py()));
        }
        slf.borrow().exports.fetch_add(1, RELAXED);
        Ok(())
    }

    /// # Safety
    /// Called by CPython once per successful `__getbuffer__`.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {
        self.exports.fetch_sub(1, RELAXED);
    }

    /// A writable memoryview of the object's bytes.
    #[getter]
    fn buffer<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyMemoryView>> {
        PyMemoryView::from(slf.as_any())
    }

    /// The object's 32-byte id.
    #[getter]
    fn id<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, self.id.as_bytes())
    }

    /// Copies `data` (any C-contiguous buffer: bytes, a numpy array, a memoryview) into
    /// the object at byte `offset`, without the GIL. Copies of 2 MiB and more stream past
    /// this core's caches: the object is for other processes. ValueError if it does not
    /// fit, or if `data` is the object's own memory.
    #[pyo3(signature = (data, offset=0))]
    fn write(&mut self, py: Python<'_>, data: &Bound<'_, PyAny>, offset: usize) -> PyResult<()> {
        let buf = RawBuf::get(data)?;
        let src = buf.as_slice();
        let len = self.len;
        if offset.checked_add(src.len()).is_none_or(|end| end > len) {
            return Err(PyValueError::new_err(format!(
                "{} bytes at offset {offset} do not fit the object's {len} bytes",
                src.len()
            )));
        }
        let c = self
            .c
            .as_mut()
            .ok_or_else(|| PyValueError::new_err("this creation was already sealed or aborted"))?;
        c.writable_here().map_err(err)?;
        let (obj, from) = (c.as_ptr() as usize, src.as_ptr() as usize);
        if !src.is_empty() && from < obj + len && obj < from + src.len() {
            return Err(PyValueError::new_err(
                "the data to write is the object's own memory: copy it elsewhere first",
            ));
        }
        py.detach(|| c.write_at(offset, src));
        Ok(())
    }

    /// Publishes the object (getters blocked on it wake up).
    fn seal(&mut self) -> PyResult<()> {
        self.finish(true)
    }

    /// Abandons the object and frees its memory.
    fn abort(&mut self) -> PyResult<()> {
        self.finish(false)
    }

    /// Never evict this object (stores created with `evict=True`). Call before sealing.
    fn set_evictable(&mut self, evictable: bool) -> PyResult<()> {
        // (`Creation::set_evictable` refuses in a forked child by itself.)
        match self.c.as_mut() {
            Some(c) => c.set_evictable(evictable).map_err(err),
            None => Err(PyValueError::new_err(
                "this creation was already sealed or aborted",
            )),
        }
    }

    fn __len__(&self) -> usize {
        self.len
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (exc_type, _exc=None, _tb=None))]
    fn __exit__(
        &mut self,
        exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        if self.c.is_none() {
            return Ok(false);
        }
        if exc_type.is_some_and(|t| !t.is_none()) {
            // Abort even if buffers are still alive: they would keep the exception from
            // being seen. The block stays allocated until the last of them is released.
            if self.exports.load(RELAXED) == 0 {
                let _ = self.finish(false);
            }
            return Ok(false);
        }
        self.finish(true)?;
        Ok(false)
    }
}
