//! [`PyStore`]: a handle to an attached store, and every store operation from Python.

use crate::buffers::{ExportCount, RawBuf, RELEASE_GIL_AT};
use crate::creation::PyCreation;
use crate::errors::err;
use crate::ids::object_id;
use crate::view::PyView;
use crate::waits::{sliced, timeout_of};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyMemoryView};
use shmstore::{AttachOptions, HugePages, ObjectId, Store, StoreConfig, WhenFull};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// A handle to an attached store.
#[pyclass(module = "shmstore._native", name = "Store", frozen, weakref)]
pub(crate) struct PyStore {
    pub(crate) s: Store,
}

pub(crate) fn dir_and_name(name: &str) -> (PathBuf, String) {
    let p = PathBuf::from(name);
    match (p.parent(), p.file_name()) {
        (Some(d), Some(f)) if name.contains('/') => {
            (d.to_path_buf(), f.to_string_lossy().into_owned())
        }
        _ => (PathBuf::from("/dev/shm"), name.to_string()),
    }
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
    ///
    /// Raises `InsufficientSpace` when the directory cannot hold the store, and its kind
    /// `MemoryLimit` when this process's cgroup (a container's memory limit) has no room
    /// for it.
    #[staticmethod]
    #[pyo3(signature = (name, capacity, *, max_objects=0, max_clients=0, evict=false,
                        remove_when_unused=false, prefault=false, huge_pages="auto"))]
    #[allow(clippy::too_many_arguments)]
    fn create(
        py: Python<'_>,
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
        // Reserving a large store takes seconds (0.25 s per GiB): other threads run.
        Ok(PyStore {
            s: py.detach(|| Store::create(&file, &cfg)).map_err(err)?,
        })
    }

    /// Opens an existing store by name (in /dev/shm) or path.
    #[staticmethod]
    #[pyo3(signature = (name, *, read_only=false, prefault=false, populate_in_background=false))]
    fn open(
        py: Python<'_>,
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
        // Prefaulting a large store, or waiting out a removal, takes a while: other
        // threads run.
        Ok(PyStore {
            s: py
                .detach(|| Store::open_with(dir.join(file), &opts))
                .map_err(err)?,
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
        view_or_none(py, self.s.try_get(&object_id(id)?))
    }

    /// Like `try_get`, but also finds an object deleted while a process still pins it
    /// (draining), which lookups by id no longer find: for processes that read what
    /// another pinned for them (vLLM's workers read what the engine core admitted).
    /// None if the store holds no such object, live or draining.
    fn get_draining<'py>(
        &self,
        py: Python<'py>,
        id: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyMemoryView>>> {
        view_or_none(py, self.s.get_draining(&object_id(id)?))
    }

    /// Is the object present and sealed?
    fn contains(&self, id: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self.s.contains(&object_id(id)?))
    }

    /// Deletes a sealed object (its memory is freed when the last view drops).
    fn delete(&self, id: &Bound<'_, PyAny>) -> PyResult<()> {
        self.s.delete(&object_id(id)?).map_err(err)
    }

    /// Deletes a sealed object unless a process holds a view of it (this one included),
    /// in one atomic step: a get racing it pins first (kept) or finds it gone. Returns
    /// whether it deleted; raises ``NotFound``/``NotSealed`` as ``delete`` does.
    fn delete_unpinned(&self, id: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.s.delete_unpinned(&object_id(id)?).map_err(err)
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

/// A found object as a memoryview over its `View`, None for `NotFound`, any other error
/// raised.
fn view_or_none(
    py: Python<'_>,
    found: shmstore::Result<shmstore::View>,
) -> PyResult<Option<Bound<'_, PyMemoryView>>> {
    match found {
        Ok(v) => Ok(Some(PyMemoryView::from(PyView::wrap(py, v)?.as_any())?)),
        Err(shmstore::Error::NotFound { .. }) => Ok(None),
        Err(e) => Err(err(e)),
    }
}
