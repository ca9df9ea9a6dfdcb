//! `shmstore._native`: the Python bindings of the Rust store (built by maturin, abi3 for
//! CPython >= 3.11). The public Python API is in `python/shmstore/__init__.py`, which
//! re-exports these classes and adds tensor items and the engine/worker caches.
//!
//! What this layer owns:
//! * **Buffers.** A [`PyView`] exports its object's bytes read-only through the buffer
//!   protocol; the memoryview `get` returns (and every numpy array or tensor made from it)
//!   keeps the `PyView` alive, and the `PyView` keeps the object pinned. A [`PyCreation`]
//!   exports its bytes writable and counts its exports: it refuses to seal or abort while
//!   one is alive, so no Python object can write to an object after it is published.
//! * **The GIL.** Blocking gets, waits for space, copies of 64 KiB or more, and any call
//!   that may run recovery or eviction run without it; a small put keeps it only on its
//!   fast path (`put_without_slow_work`), where releasing would cost more than the call.
//!   Blocking waits run in slices of [`SIGNAL_SLICE`] and check for signals between them,
//!   so Ctrl-C interrupts a `get(timeout=None)`.
//! * **Fork.** `shmstore/__init__.py` registers [`_after_fork_in_child`] with
//!   `os.register_at_fork`: in a child, every live `View` is pinned again in the child's
//!   own name (so arrays made before the fork stay valid while the child holds them), and
//!   creations inherited from the parent refuse to be written, sealed or aborted.
//! * **Errors.** Every `shmstore::Error` becomes an exception class of its own, all derived
//!   from `shmstore.ShmstoreError`, with the Rust message (which says what to do).

use pyo3::exceptions::{PyBufferError, PyException, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{
    PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyMemoryView, PyString, PyTuple,
};
use shmstore::item::{self, ArraySpec, DType, MetaValue};
use shmstore::{AttachOptions, Creation, HugePages, ObjectId, Store, StoreConfig, View, WhenFull};
use std::collections::HashSet;
use std::mem::MaybeUninit;
use std::os::raw::{c_int, c_void};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The longest a blocking call runs without the GIL before checking for signals.
const SIGNAL_SLICE: Duration = Duration::from_millis(50);

/// The live `View`s of this process (addresses of the Rust `View` inside each `PyView`),
/// for [`_after_fork_in_child`]. Changed only with the GIL held; `fork()` runs with the
/// GIL held, so no thread is inside this mutex when a process forks.
static LIVE_VIEWS: Mutex<Option<HashSet<usize>>> = Mutex::new(None);

fn live_views() -> std::sync::MutexGuard<'static, Option<HashSet<usize>>> {
    LIVE_VIEWS.lock().unwrap_or_else(|e| e.into_inner())
}

// A process-local count of Python buffer exports, never in shared memory: the crate's
// rule (every shared atomic through `shmstore`'s loom shim) does not apply.
#[allow(clippy::disallowed_types)]
type ExportCount = std::sync::atomic::AtomicUsize;
const RELAXED: std::sync::atomic::Ordering = std::sync::atomic::Ordering::Relaxed;

pyo3::create_exception!(
    _native,
    ShmstoreError,
    PyException,
    "Base class of every shmstore error."
);
pyo3::create_exception!(
    _native,
    Full,
    ShmstoreError,
    "No block is free for the object (and nothing could be evicted)."
);
pyo3::create_exception!(
    _native,
    TooLarge,
    ShmstoreError,
    "The object can never fit in this store."
);
pyo3::create_exception!(
    _native,
    Timeout,
    ShmstoreError,
    "The object was not sealed within the timeout."
);
pyo3::create_exception!(
    _native,
    AlreadyExists,
    ShmstoreError,
    "An object with this id exists (or is being created)."
);
pyo3::create_exception!(_native, NotFound, ShmstoreError, "No object with this id.");
pyo3::create_exception!(
    _native,
    NotSealed,
    ShmstoreError,
    "The object is still being created."
);
pyo3::create_exception!(
    _native,
    CreatorDied,
    ShmstoreError,
    "The process creating the object died before sealing it."
);
pyo3::create_exception!(
    _native,
    ReadOnly,
    ShmstoreError,
    "The store was attached read-only."
);
pyo3::create_exception!(
    _native,
    Corrupted,
    ShmstoreError,
    "Shared memory holds a value no correct writer produces."
);
pyo3::create_exception!(
    _native,
    StoreExists,
    ShmstoreError,
    "A store with this name exists."
);
pyo3::create_exception!(
    _native,
    StoreNotFound,
    ShmstoreError,
    "No store with this name."
);
pyo3::create_exception!(
    _native,
    InsufficientSpace,
    ShmstoreError,
    "The file system has too little space for the store."
);
pyo3::create_exception!(
    _native,
    TooManyClients,
    ShmstoreError,
    "Every client slot of the store is taken."
);
pyo3::create_exception!(
    _native,
    TooManyPins,
    ShmstoreError,
    "This process holds too many views of one object."
);
pyo3::create_exception!(
    _native,
    TableFull,
    ShmstoreError,
    "The object table has no free slot for this id."
);
pyo3::create_exception!(
    _native,
    InvalidConfig,
    ShmstoreError,
    "The store configuration is out of range."
);
pyo3::create_exception!(
    _native,
    Forked,
    ShmstoreError,
    "A handle inherited across fork() was used for what only its maker may do."
);
pyo3::create_exception!(
    _native,
    BadItem,
    ShmstoreError,
    "The object is not a valid tensor item."
);

/// The Python exception for a store error, carrying its message.
fn err(e: shmstore::Error) -> PyErr {
    use shmstore::Error as E;
    let msg = e.to_string();
    match e {
        E::Full { .. } => Full::new_err(msg),
        E::TooLarge { .. } | E::MetadataTooLarge { .. } => TooLarge::new_err(msg),
        E::Timeout { .. } => Timeout::new_err(msg),
        E::AlreadyExists { .. } => AlreadyExists::new_err(msg),
        E::NotFound { .. } => NotFound::new_err(msg),
        E::NotSealed { .. } => NotSealed::new_err(msg),
        E::CreatorDied { .. } => CreatorDied::new_err(msg),
        E::ReadOnly { .. } => ReadOnly::new_err(msg),
        E::Corrupted { .. }
        | E::NotAStore { .. }
        | E::Truncated { .. }
        | E::VersionMismatch { .. } => Corrupted::new_err(msg),
        E::StoreExists { .. } => StoreExists::new_err(msg),
        E::StoreNotFound { .. } => StoreNotFound::new_err(msg),
        E::InsufficientSpace { .. } | E::HugePagesUnavailable { .. } => {
            InsufficientSpace::new_err(msg)
        }
        E::TooManyClients { .. } => TooManyClients::new_err(msg),
        E::TooManyPins { .. } => TooManyPins::new_err(msg),
        E::TableFull { .. } => TableFull::new_err(msg),
        E::InvalidConfig { .. } => InvalidConfig::new_err(msg),
        E::BadItem { .. } => BadItem::new_err(msg),
        E::Forked { .. } => Forked::new_err(msg),
        _ => ShmstoreError::new_err(msg),
    }
}

/// An id from Python: a `str` key (hashed with blake3, e.g. vLLM's `mm_hash`), or 32 raw
/// id bytes (from `content_id` / `key_id`).
fn object_id(obj: &Bound<'_, PyAny>) -> PyResult<ObjectId> {
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

fn timeout_of(t: Option<f64>) -> PyResult<Duration> {
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
fn sliced<T: Send>(
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

/// Called in a child right after `os.fork()` (registered by `shmstore/__init__.py`): tells
/// the store the process forked, then pins every live view again in the child's own name,
/// so that arrays made from them before the fork keep their bytes while the child holds
/// them. A view whose object is already gone stays unpinned here and refuses new buffers
/// (`Forked`).
#[pyfunction]
fn _after_fork_in_child() {
    shmstore::after_fork_in_child();
    let live = live_views();
    for &addr in live.iter().flatten() {
        // SAFETY: every address in LIVE_VIEWS is the `view` field of a live PyView (added
        // on creation, removed in its Drop, both with the GIL held, which we hold now).
        let v = unsafe { &*(addr as *const View) };
        let _ = v.adopt();
    }
}

/// Copies at or above this size run without the GIL.
const RELEASE_GIL_AT: usize = 64 << 10;

/// The bytes of any C-contiguous buffer-protocol object, held (so the exporter cannot
/// resize or free them) until dropped.
struct RawBuf {
    view: Box<ffi::Py_buffer>,
}

// SAFETY: the buffer's memory stays valid and unmoved while the export is held, whichever
// thread reads it; the export is released in `Drop` with the GIL held.
unsafe impl Send for RawBuf {}
// SAFETY: as above; `as_slice` only reads.
unsafe impl Sync for RawBuf {}

impl RawBuf {
    fn get(obj: &Bound<'_, PyAny>) -> PyResult<RawBuf> {
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

    fn as_slice(&self) -> &[u8] {
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

/// A sealed object, pinned for as long as this object lives. Exports its bytes read-only
/// through the buffer protocol; `Store.get` returns `memoryview(view)`, whose `.obj` is
/// this object.
#[pyclass(module = "shmstore._native", name = "View", frozen)]
struct PyView {
    view: View,
}

impl PyView {
    /// Wraps a view and lists it for the fork handler.
    fn wrap(py: Python<'_>, view: View) -> PyResult<Bound<'_, PyView>> {
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

    fn __len__(&self) -> usize {
        self.view.len()
    }
}

/// An object being written. Exports its bytes writable (`.buffer`, or `memoryview(c)`);
/// `seal()` publishes it, `abort()` (or dropping it) frees it. As a context manager it
/// seals on a normal exit and aborts on an exception.
#[pyclass(module = "shmstore._native", name = "Creation")]
struct PyCreation {
    c: Option<Creation>,
    id: ObjectId,
    len: usize,
    exports: ExportCount,
}

impl PyCreation {
    fn finish(&mut self, seal: bool) -> PyResult<()> {
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
        let c = self.c.as_mut().ok_or_else(|| {
            PyValueError::new_err("this creation was already sealed or aborted")
        })?;
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

/// A handle to an attached store.
#[pyclass(module = "shmstore._native", name = "Store", frozen, weakref)]
struct PyStore {
    s: Store,
}

fn dir_and_name(name: &str) -> (PathBuf, String) {
    let p = PathBuf::from(name);
    match (p.parent(), p.file_name()) {
        (Some(d), Some(f)) if name.contains('/') => {
            (d.to_path_buf(), f.to_string_lossy().into_owned())
        }
        _ => (PathBuf::from("/dev/shm"), name.to_string()),
    }
}

fn meta_value(v: &Bound<'_, PyAny>) -> PyResult<MetaValue> {
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

fn meta_object(py: Python<'_>, v: &MetaValue) -> PyResult<Py<PyAny>> {
    Ok(match v {
        MetaValue::Int(i) => i.into_pyobject(py)?.into_any().unbind(),
        MetaValue::Float(f) => f.into_pyobject(py)?.into_any().unbind(),
        MetaValue::Bool(b) => PyBool::new(py, *b).to_owned().into_any().unbind(),
        MetaValue::Str(s) => PyString::new(py, s).into_any().unbind(),
        MetaValue::Bytes(b) => PyBytes::new(py, b).into_any().unbind(),
    })
}

#[pymethods]
impl PyStore {
    /// Creates a named store (`/dev/shm/NAME`, or a path) of `capacity` payload bytes.
    /// `max_objects` and `max_clients` of 0 are chosen for the capacity (one object per
    /// 32 KiB, at least 4096; 32 clients below 4 GiB, 64 from 4 GiB).
    ///
    /// `huge_pages`: "auto" (2 MiB pages rebuilt by this process in the background where
    /// the kernel allows it), "off" (4 KiB pages unless the file system gives huge ones),
    /// "try" ("auto" plus MADV_HUGEPAGE), "hugetlb" (explicit huge pages; the store must
    /// be in a hugetlbfs directory).
    #[staticmethod]
    #[pyo3(signature = (name, capacity, *, max_objects=0, max_clients=0, evict=false,
                        remove_when_unused=false, prefault=false, huge_pages="auto"))]
    #[allow(clippy::too_many_arguments)]
    fn create(
        name: &str,
        capacity: u64,
        max_objects: u64,
        max_clients: u32,
        evict: bool,
        remove_when_unused: bool,
        prefault: bool,
        huge_pages: &str,
    ) -> PyResult<Self> {
        let huge_pages = match huge_pages {
            "auto" => HugePages::Auto,
            "off" => HugePages::Off,
            "try" => HugePages::Try,
            "hugetlb" => HugePages::Hugetlb,
            other => {
                return Err(PyValueError::new_err(format!(
                    "huge_pages={other:?}: use \"auto\", \"off\", \"try\" or \"hugetlb\""
                )))
            }
        };
        let (dir, file) = dir_and_name(name);
        let cfg = StoreConfig {
            max_objects,
            max_clients,
            when_full: if evict {
                WhenFull::Evict
            } else {
                WhenFull::Fail
            },
            remove_when_unused,
            prefault,
            huge_pages,
            dir,
            ..StoreConfig::with_capacity(capacity)
        };
        Ok(PyStore {
            s: Store::create(&file, &cfg).map_err(err)?,
        })
    }

    /// Opens an existing store by name (in /dev/shm) or path.
    #[staticmethod]
    #[pyo3(signature = (name, *, read_only=false, prefault=false, populate_in_background=false))]
    fn open(
        name: &str,
        read_only: bool,
        prefault: bool,
        populate_in_background: bool,
    ) -> PyResult<Self> {
        let (dir, file) = dir_and_name(name);
        let opts = AttachOptions {
            read_only,
            prefault,
            populate_in_background,
            ..Default::default()
        };
        Ok(PyStore {
            s: Store::open_with(dir.join(file), &opts).map_err(err)?,
        })
    }

    /// Removes the store ``name`` (in /dev/shm, or a path) if no live process is attached,
    /// whatever shmstore version made it; True if removed. Raises ``Corrupted`` for a file
    /// that is not a store (left alone).
    #[staticmethod]
    fn remove_if_unused(name: &str) -> PyResult<bool> {
        let (dir, file) = dir_and_name(name);
        Store::remove_if_unused(dir.join(file)).map_err(err)
    }

    /// Copies any C-contiguous buffer (bytes, numpy array, memoryview...) into a new
    /// sealed object: exactly one copy, without the GIL for large buffers.
    #[pyo3(signature = (id, data, meta=None))]
    fn put(
        &self,
        py: Python<'_>,
        id: &Bound<'_, PyAny>,
        data: &Bound<'_, PyAny>,
        meta: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let id = object_id(id)?;
        let buf = RawBuf::get(data)?;
        let meta = meta.map(RawBuf::get).transpose()?;
        let m = meta.as_ref().map_or(&[][..], |m| m.as_slice());
        let bytes = buf.as_slice();
        let slow = || py.detach(|| self.s.put_with_meta(&id, bytes, m));
        if bytes.len() >= RELEASE_GIL_AT {
            return slow().map_err(err);
        }
        // Small: with the GIL on the fast path only; recovery or eviction run without it.
        match self.s.put_without_slow_work(&id, bytes, m) {
            Ok(true) => Ok(()),
            Ok(false) => slow().map_err(err),
            Err(e) => Err(err(e)),
        }
    }

    /// Starts an object of `n` bytes; write through `.buffer`, then `seal()`. With
    /// `timeout` (seconds), waits for space instead of failing when the store is full.
    #[pyo3(signature = (id, n, meta=None, timeout=None))]
    fn create_object(
        &self,
        py: Python<'_>,
        id: &Bound<'_, PyAny>,
        n: u64,
        meta: Option<&Bound<'_, PyAny>>,
        timeout: Option<f64>,
    ) -> PyResult<PyCreation> {
        let id = object_id(id)?;
        let meta = meta.map(RawBuf::get).transpose()?;
        let m = meta.as_ref().map_or(&[][..], |m| m.as_slice());
        // Without the GIL: a create may recover dead clients or evict (whole-table work).
        let c = match timeout {
            None => py
                .detach(|| self.s.create_object_with_meta(&id, n, m))
                .map_err(err)?,
            Some(t) => {
                let t = timeout_of(Some(t))?;
                if !m.is_empty() {
                    return Err(PyValueError::new_err(
                        "meta with a timeout is not supported; put meta in the object",
                    ));
                }
                let store = &self.s;
                sliced(
                    py,
                    t,
                    &|slice| store.create_object_wait(&id, n, slice),
                    |e| matches!(e, shmstore::Error::Full { .. }),
                )?
            }
        };
        Ok(PyCreation {
            len: c.len(),
            c: Some(c),
            id,
            exports: ExportCount::new(0),
        })
    }

    /// A read-only memoryview of a sealed object, waiting up to `timeout` seconds (None:
    /// forever) for it to be sealed. The object stays pinned while the memoryview, or any
    /// array made from it, is alive; `memoryview.obj` is the `View` (id, meta). With
    /// `wait_if_absent=False`, waits only for an object that is being created, and raises
    /// `NotFound` at once if nobody holds the id.
    #[pyo3(signature = (id, timeout=None, *, wait_if_absent=true))]
    fn get<'py>(
        &self,
        py: Python<'py>,
        id: &Bound<'py, PyAny>,
        timeout: Option<f64>,
        wait_if_absent: bool,
    ) -> PyResult<Bound<'py, PyMemoryView>> {
        let id = object_id(id)?;
        let store = &self.s;
        // The common case without releasing the GIL: sealed already.
        let (first, at_once) = store.get_slice(&id, Duration::ZERO, false).map_err(err)?;
        let got = match first {
            Err(shmstore::Error::NotFound { .. } | shmstore::Error::Timeout { .. }) => {
                let t = timeout_of(timeout)?;
                let wait = |slice| {
                    store
                        .get_slice(&id, slice, wait_if_absent)
                        .and_then(|(got, _)| got)
                };
                sliced(py, t, &wait, |e| {
                    matches!(e, shmstore::Error::Timeout { .. })
                })
            }
            other => other.map_err(err),
        };
        // Stats count the whole get once, however many slices it took.
        store.count_get(at_once, got.is_ok());
        PyMemoryView::from(PyView::wrap(py, got?)?.as_any())
    }

    /// Like `get`, but never waits: None if the object is absent or not sealed yet.
    fn try_get<'py>(
        &self,
        py: Python<'py>,
        id: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyMemoryView>>> {
        let id = object_id(id)?;
        match self.s.try_get(&id) {
            Ok(v) => Ok(Some(PyMemoryView::from(PyView::wrap(py, v)?.as_any())?)),
            Err(shmstore::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(err(e)),
        }
    }

    /// Is the object present and sealed?
    fn contains(&self, id: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self.s.contains(&object_id(id)?))
    }

    /// Deletes a sealed object (its memory is freed when the last view drops).
    fn delete(&self, id: &Bound<'_, PyAny>) -> PyResult<()> {
        self.s.delete(&object_id(id)?).map_err(err)
    }

    /// Occupancy and activity figures as a dict, read from counters (cheap at any store
    /// size). `pinned_objects()` counts pinned objects by a table scan.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let st = self.s.stats();
        let d = PyDict::new(py);
        d.set_item("capacity", st.capacity)?;
        d.set_item("used", st.used)?;
        d.set_item("free", st.free)?;
        d.set_item("objects", st.objects)?;
        d.set_item("creating", st.creating)?;
        d.set_item("pins", st.pins)?;
        d.set_item("draining", st.draining)?;
        d.set_item("clients", st.clients)?;
        d.set_item("dead_clients", st.dead_clients)?;
        d.set_item("recovered_clients", st.recovered_clients)?;
        d.set_item("reclaimed_bytes", st.reclaimed_bytes)?;
        d.set_item("evictions", st.evictions)?;
        d.set_item("bytes_evicted", st.bytes_evicted)?;
        d.set_item("table_slots", st.table_slots)?;
        d.set_item("max_clients", st.max_clients)?;
        d.set_item("page_size", st.page_size)?;
        d.set_item("huge_pages", st.huge_pages)?;
        d.set_item("huge_page_bytes", st.huge_page_bytes)?;
        d.set_item("sweep_pending", st.sweep_pending)?;
        d.set_item("leaked_blocks_freed", st.leaked_blocks_freed)?;
        d.set_item("creates", st.creates)?;
        d.set_item("bytes_created", st.bytes_created)?;
        d.set_item("deletes", st.deletes)?;
        d.set_item("gets_hit", st.gets_hit)?;
        d.set_item("gets_waited", st.gets_waited)?;
        d.set_item("gets_missed", st.gets_missed)?;
        d.set_item("full_events", st.full_events)?;
        Ok(d)
    }

    /// The largest object that could be created now (a scan of the allocator's page
    /// bitmap, one word per 256 KiB; for tools).
    fn largest_free(&self) -> u64 {
        self.s.largest_free()
    }

    /// Objects at least one process pins now (a table scan, O(objects); for tools).
    fn pinned_objects(&self) -> u64 {
        self.s.pinned_objects()
    }

    /// Every object in the store: a list of `(id, length, state, pins)` with `id` the 32
    /// id bytes and `state` one of "sealed", "creating", "draining" (a scan; for tools).
    fn list<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for o in self.s.list() {
            let state = match o.state {
                shmstore::ObjectState::Sealed => "sealed",
                shmstore::ObjectState::Creating => "creating",
                _ => "draining",
            };
            out.append((PyBytes::new(py, o.id.as_bytes()), o.len, state, o.pins))?;
        }
        Ok(out)
    }

    /// Reclaims what dead processes left now; returns what it did.
    fn recover<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let r = py.detach(|| self.s.recover()).map_err(err)?;
        let d = PyDict::new(py);
        d.set_item("clients_recovered", r.clients_recovered)?;
        d.set_item("pins_released", r.pins_released)?;
        d.set_item("creations_aborted", r.creations_aborted)?;
        d.set_item("bytes_reclaimed", r.bytes_reclaimed)?;
        d.set_item("sweep_pending", r.sweep_pending)?;
        Ok(d)
    }

    /// The store's file, or None for an anonymous store.
    #[getter]
    fn path(&self) -> Option<String> {
        self.s.path().map(|p| p.display().to_string())
    }

    /// Populates this process's page tables for the whole store, without the GIL (so that
    /// first writes into fresh blocks take no page faults); run it on a background thread
    /// for large stores. Stops the store's own background population first (its work is
    /// done here): when it returns, no thread works for this store in this process.
    fn prefault(&self, py: Python<'_>) {
        py.detach(|| self.s.prefault())
    }

    /// `(address, length)` of the store's payload heap in this process (for
    /// `cudaHostRegister`; read-only pages in a read-only attach).
    #[getter]
    fn heap_region(&self) -> (usize, usize) {
        let (addr, len) = self.s.heap_region();
        (addr as usize, len)
    }

    /// The largest object this store can ever hold.
    #[getter]
    fn max_object_size(&self) -> u64 {
        self.s.max_object_size()
    }

    /// Removes the store's name (attached processes keep working).
    fn unlink(&self) -> PyResult<()> {
        self.s.unlink().map_err(err)
    }

    /// Times the same small calls from Rust, without Python, for the overhead benchmark:
    /// ns per put of `size` bytes (fresh ids), per get + drop, per contains.
    #[pyo3(signature = (n, size=64))]
    fn bench_native<'py>(
        &self,
        py: Python<'py>,
        n: u32,
        size: usize,
    ) -> PyResult<Bound<'py, PyDict>> {
        let data = vec![7u8; size];
        let ids: Vec<ObjectId> = (0..n)
            .map(|i| ObjectId::of_key(format!("bench-native-{i}")))
            .collect();
        let per = |t: Instant| t.elapsed().as_nanos() as f64 / n as f64;
        let t = Instant::now();
        for id in &ids {
            self.s.put(id, &data).map_err(err)?;
        }
        let put = per(t);
        let t = Instant::now();
        for id in &ids {
            drop(self.s.try_get(id).map_err(err)?);
        }
        let get = per(t);
        let t = Instant::now();
        for id in &ids {
            std::hint::black_box(self.s.contains(id));
        }
        let contains = per(t);
        for id in &ids {
            self.s.delete(id).map_err(err)?;
        }
        let d = PyDict::new(py);
        d.set_item("put_ns", put)?;
        d.set_item("get_ns", get)?;
        d.set_item("contains_ns", contains)?;
        Ok(d)
    }
}

fn dtype(name: &str) -> PyResult<DType> {
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
fn put_item_buffers<'py>(
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
    let mut m = Vec::with_capacity(meta.len());
    for (k, v) in meta.iter() {
        let k: String = k
            .extract()
            .map_err(|_| PyTypeError::new_err("item metadata keys are str"))?;
        m.push((k, meta_value(&v)?));
    }
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
fn plan_item<'py>(
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
    let mut m = Vec::with_capacity(meta.len());
    for (k, v) in meta.iter() {
        let k: String = k
            .extract()
            .map_err(|_| PyTypeError::new_err("item metadata keys are str"))?;
        m.push((k, meta_value(&v)?));
    }
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
fn decode_item<'py>(py: Python<'py>, data: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyTuple>> {
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

/// The 32-byte id of some content (blake3), from any buffer.
#[pyfunction]
fn content_id<'py>(py: Python<'py>, data: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
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
fn key_id<'py>(py: Python<'py>, key: &str) -> Bound<'py, PyBytes> {
    PyBytes::new(py, ObjectId::of_key(key).as_bytes())
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    // The one version of crate, bindings and package (the workspace's, in Cargo.toml).
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<PyStore>()?;
    m.add_class::<PyView>()?;
    m.add_class::<PyCreation>()?;
    m.add_function(wrap_pyfunction!(plan_item, m)?)?;
    m.add_function(wrap_pyfunction!(put_item_buffers, m)?)?;
    m.add_function(wrap_pyfunction!(decode_item, m)?)?;
    m.add_function(wrap_pyfunction!(content_id, m)?)?;
    m.add_function(wrap_pyfunction!(key_id, m)?)?;
    m.add_function(wrap_pyfunction!(_after_fork_in_child, m)?)?;
    for (name, ty) in [
        ("ShmstoreError", py.get_type::<ShmstoreError>()),
        ("Full", py.get_type::<Full>()),
        ("TooLarge", py.get_type::<TooLarge>()),
        ("Timeout", py.get_type::<Timeout>()),
        ("AlreadyExists", py.get_type::<AlreadyExists>()),
        ("NotFound", py.get_type::<NotFound>()),
        ("NotSealed", py.get_type::<NotSealed>()),
        ("CreatorDied", py.get_type::<CreatorDied>()),
        ("ReadOnly", py.get_type::<ReadOnly>()),
        ("Corrupted", py.get_type::<Corrupted>()),
        ("StoreExists", py.get_type::<StoreExists>()),
        ("StoreNotFound", py.get_type::<StoreNotFound>()),
        ("InsufficientSpace", py.get_type::<InsufficientSpace>()),
        ("TooManyClients", py.get_type::<TooManyClients>()),
        ("TooManyPins", py.get_type::<TooManyPins>()),
        ("TableFull", py.get_type::<TableFull>()),
        ("InvalidConfig", py.get_type::<InvalidConfig>()),
        ("BadItem", py.get_type::<BadItem>()),
        ("Forked", py.get_type::<Forked>()),
    ] {
        m.add(name, ty)?;
    }
    Ok(())
}
