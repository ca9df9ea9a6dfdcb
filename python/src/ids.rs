//! Object ids from Python: `str` keys (blake3 of the key, e.g. vLLM's `mm_hash`) or 32 raw
//! id bytes, and the functions that make them.

use crate::buffers::{RawBuf, RELEASE_GIL_AT};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};
use shmstore::ObjectId;

/// An id from Python: a `str` key (hashed with blake3, e.g. vLLM's `mm_hash`), or 32 raw
/// id bytes (from `content_id` / `key_id`).
pub(crate) fn object_id(obj: &Bound<'_, PyAny>) -> PyResult<ObjectId> {
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(ObjectId::of_key(s.to_str()?));
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        let raw: [u8; 32] = b.as_bytes().try_into().map_err(|_| {
            PyValueError::new_err(
                "an id given as bytes must be exactly 32 bytes (use a str key, or \
                 shmstore.content_id(data))",
            )
        })?;
        return Ok(ObjectId::from_bytes(raw));
    }
    Err(PyTypeError::new_err("an id is a str key or 32 id bytes"))
}

/// The 32-byte id of some content (blake3), from any buffer.
#[pyfunction]
pub(crate) fn content_id<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    let buf = RawBuf::get(data)?;
    let id = if buf.as_slice().len() >= RELEASE_GIL_AT {
        py.detach(|| ObjectId::of_content(buf.as_slice()))
    } else {
        ObjectId::of_content(buf.as_slice())
    };
    Ok(PyBytes::new(py, id.as_bytes()))
}

/// The 32-byte id a str key maps to (what every method does with a str id).
#[pyfunction]
pub(crate) fn key_id<'py>(py: Python<'py>, key: &str) -> Bound<'py, PyBytes> {
    PyBytes::new(py, ObjectId::of_key(key).as_bytes())
}
