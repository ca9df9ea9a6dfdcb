//! Tensor items from Python: planning, writing (one native call per item, without the GIL
//! while it copies) and decoding the item format of `shmstore::item`, and item metadata.

use crate::buffers::RawBuf;
use crate::errors::err;
use crate::ids::object_id;
use crate::store::PyStore;
use crate::view::PyView;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{
    PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyMemoryView, PyString, PyTuple,
};
use shmstore::item::{self, ArraySpec, DType, MetaValue};
use shmstore::View;
use std::time::Duration;

pub(crate) fn meta_value(v: &Bound<'_, PyAny>) -> PyResult<MetaValue> {
    if v.is_instance_of::<PyBool>() {
        return Ok(MetaValue::Bool(v.extract()?));
    }
    if v.is_instance_of::<PyInt>() {
        return Ok(MetaValue::Int(v.extract()?));
    }
    if v.is_instance_of::<PyFloat>() {
        return Ok(MetaValue::Float(v.extract()?));
    }
    if let Ok(s) = v.cast::<PyString>() {
        return Ok(MetaValue::Str(s.to_str()?.to_owned()));
    }
    if let Ok(b) = v.cast::<PyBytes>() {
        return Ok(MetaValue::Bytes(b.as_bytes().to_vec()));
    }
    Err(PyTypeError::new_err(format!(
        "item metadata values are int, float, bool, str or bytes, not {}",
        v.get_type().name()?
    )))
}

/// An item's metadata from a Python dict of str keys.
fn item_meta(meta: &Bound<'_, PyDict>) -> PyResult<Vec<(String, MetaValue)>> {
    let mut m = Vec::with_capacity(meta.len());
    for (k, v) in meta.iter() {
        let k: String = k
            .extract()
            .map_err(|_| PyTypeError::new_err("item metadata keys are str"))?;
        m.push((k, meta_value(&v)?));
    }
    Ok(m)
}

pub(crate) fn meta_object(py: Python<'_>, v: &MetaValue) -> PyResult<Py<PyAny>> {
    Ok(match v {
        MetaValue::Int(i) => i.into_pyobject(py)?.into_any().unbind(),
        MetaValue::Float(f) => f.into_pyobject(py)?.into_any().unbind(),
        MetaValue::Bool(b) => PyBool::new(py, *b).to_owned().into_any().unbind(),
        MetaValue::Str(s) => PyString::new(py, s).into_any().unbind(),
        MetaValue::Bytes(b) => PyBytes::new(py, b).into_any().unbind(),
    })
}

pub(crate) fn dtype(name: &str) -> PyResult<DType> {
    DType::from_name(name).ok_or_else(|| {
        PyTypeError::new_err(format!(
            "dtype {name} is not supported in items (float32, float16, bfloat16, float64, \
             int64, int32, int16, int8, uint8, bool)"
        ))
    })
}

/// Writes a whole tensor item in one call: `arrays` is a list of (name, dtype name,
/// shape, buffer) where each buffer is C-contiguous and holds exactly that array's bytes
/// (a numpy array, or a torch tensor's `.numpy()`; bfloat16 as any 2-byte view). Plans the
/// header, creates the object, copies header and arrays, seals: one copy per array, no
/// Python per array, and without the GIL while it creates and copies. With `pin=True`
/// it returns the sealed item pinned, as `Store.try_get` would, without a second lookup
/// (None if another process deleted or evicted it between the seal and the pin).
#[pyfunction]
#[pyo3(signature = (store, id, arrays, meta, timeout=None, pin=false))]
pub(crate) fn put_item_buffers<'py>(
    py: Python<'py>,
    store: &PyStore,
    id: &Bound<'py, PyAny>,
    arrays: &Bound<'py, PyList>,
    meta: &Bound<'py, PyDict>,
    timeout: Option<f64>,
    pin: bool,
) -> PyResult<Option<Bound<'py, PyMemoryView>>> {
    let id = object_id(id)?;
    let mut specs = Vec::with_capacity(arrays.len());
    let mut bufs = Vec::with_capacity(arrays.len());
    for a in arrays.iter() {
        let (name, dt, shape, obj): (String, String, Vec<u64>, Bound<'_, PyAny>) = a.extract()?;
        specs.push(ArraySpec {
            name,
            dtype: dtype(&dt)?,
            shape,
        });
        bufs.push(RawBuf::get(&obj)?);
    }
    let m = item_meta(meta)?;
    let plan = item::plan(&specs, &m).map_err(err)?;
    for ((spec, buf), (_, n)) in specs.iter().zip(&bufs).zip(&plan.placements) {
        if buf.as_slice().len() as u64 != *n {
            return Err(PyValueError::new_err(format!(
                "array {:?}: the buffer holds {} bytes, its dtype and shape need {n}",
                spec.name,
                buf.as_slice().len()
            )));
        }
    }
    let s = &store.s;
    let write = || -> shmstore::Result<Option<View>> {
        let mut c = match timeout {
            None => s.create_object(&id, plan.total_len)?,
            Some(t) => s.create_object_wait(&id, plan.total_len, Duration::from_secs_f64(t))?,
        };
        c.write_at(0, &plan.header);
        for (buf, &(off, n)) in bufs.iter().zip(&plan.placements) {
            debug_assert_eq!(buf.as_slice().len() as u64, n);
            c.write_at(off as usize, buf.as_slice());
        }
        c.seal()?;
        if !pin {
            return Ok(None);
        }
        match s.try_get(&id) {
            Ok(v) => Ok(Some(v)),
            Err(shmstore::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    };
    let r = py.detach(write);
    drop(bufs); // released with the GIL held
    match r.map_err(err)? {
        Some(v) => Ok(Some(PyMemoryView::from(PyView::wrap(py, v)?.as_any())?)),
        None => Ok(None),
    }
}

/// Lays out a tensor item: `arrays` is a list of (name, dtype name, shape); returns
/// (header bytes, [(offset, nbytes)], total length).
#[pyfunction]
pub(crate) fn plan_item<'py>(
    py: Python<'py>,
    arrays: &Bound<'py, PyList>,
    meta: &Bound<'py, PyDict>,
) -> PyResult<Bound<'py, PyTuple>> {
    let mut specs = Vec::with_capacity(arrays.len());
    for a in arrays.iter() {
        let (name, dt, shape): (String, String, Vec<u64>) = a.extract()?;
        specs.push(ArraySpec {
            name,
            dtype: dtype(&dt)?,
            shape,
        });
    }
    let m = item_meta(meta)?;
    let plan = item::plan(&specs, &m).map_err(err)?;
    let placements = PyList::empty(py);
    for (off, n) in &plan.placements {
        placements.append((off, n))?;
    }
    PyTuple::new(
        py,
        [
            PyBytes::new(py, &plan.header).into_any(),
            placements.into_any(),
            plan.total_len.into_pyobject(py)?.into_any(),
        ],
    )
}

/// Decodes a tensor item's header from any buffer (treated as hostile): returns
/// ([(name, dtype name, shape, offset, nbytes)], meta dict).
#[pyfunction]
pub(crate) fn decode_item<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyTuple>> {
    let buf = RawBuf::get(data)?;
    let d = item::decode(buf.as_slice()).map_err(err)?;
    let arrays = PyList::empty(py);
    for a in &d.arrays {
        let shape = PyTuple::new(py, &a.spec.shape)?;
        arrays.append((
            a.spec.name.as_str(),
            a.spec.dtype.name(),
            shape,
            a.offset,
            a.nbytes,
        ))?;
    }
    let meta = PyDict::new(py);
    for (k, v) in &d.meta {
        meta.set_item(k, meta_object(py, v)?)?;
    }
    PyTuple::new(py, [arrays.into_any(), meta.into_any()])
}
