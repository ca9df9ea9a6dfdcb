//! Model-based checking, shared by the property tests (`tests/model.rs`), the fuzz targets
//! (`fuzz/fuzz_targets/`) and their regression tests: one [`Op`] type, one model, one
//! [`Harness::apply`] that runs an op on a real store and checks it against the model.
//!
//! Not part of the stable API (hidden from the docs); public only so that the fuzz crate
//! and integration tests can drive it.
//!
//! ```
//! use shmstore::testing::{Harness, Op};
//! let mut h = Harness::new();
//! h.apply(&Op::Put { key: 1, len: 100, fill: 7 }).unwrap();
//! h.apply(&Op::Get { key: 1 }).unwrap();
//! h.apply(&Op::Delete { key: 1 }).unwrap();
//! ```

use crate::{Creation, Error, ObjectId, Store, StoreConfig, View, WhenFull};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

/// Distinct ids the ops use (small, so that ops collide often).
pub const KEYS: u8 = 8;
/// Views and creations the harness keeps alive at most.
pub const MAX_HANDLES: usize = 12;
/// Capacity of the harness's store: small, so that `Full` is common.
pub const CAPACITY: u64 = 256 << 10;

/// One step of a random workload.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub enum Op {
    /// Start creating `key` with `len` bytes (kept open as a handle).
    Create { key: u8, len: u16, fill: u8 },
    /// Write and seal an open creation.
    Seal { handle: u8 },
    /// Abort an open creation.
    Abort { handle: u8 },
    /// Create, write and seal in one call.
    Put { key: u8, len: u16, fill: u8 },
    /// `try_get`, keeping the view.
    Get { key: u8 },
    /// `get` with a zero timeout, keeping the view.
    GetZeroTimeout { key: u8 },
    /// Another pin of a held view.
    CloneView { view: u8 },
    /// Drop a held view.
    DropView { view: u8 },
    /// Delete `key`.
    Delete { key: u8 },
    /// `contains(key)`.
    Contains { key: u8 },
    /// `delete_unpinned(key)`: deletes only if no held view pins it.
    DeleteUnpinned { key: u8 },
    /// `get_draining(key)`, keeping the view: the sealed object, or else one deleted
    /// while a held view pins it.
    GetDraining { key: u8 },
}

/// The id of `key`, every `key` its own (the model wraps its keys to [`KEYS`] before;
/// the fuzz harnesses use keys past it for objects the model does not hold).
fn id(key: u8) -> ObjectId {
    ObjectId::of_key([key])
}

fn content(len: u16, fill: u8) -> Vec<u8> {
    (0..len as usize).map(|i| fill ^ (i as u8)).collect()
}

/// A store plus the model it must agree with.
pub struct Harness {
    store: Store,
    creations: Vec<(u8, Creation, Vec<u8>)>,
    /// Held views: the view, its expected bytes, and which incarnation of its key it pins.
    views: Vec<(View, Vec<u8>, u64)>,
    /// Sealed objects: bytes and incarnation (a counter bumped per successful create).
    sealed: BTreeMap<u8, (Vec<u8>, u64)>,
    creating: BTreeSet<u8>,
    incarnation: u64,
    evicts: bool,
    evicted: u64,
    /// Payload bytes of those objects.
    evicted_bytes: u64,
}

impl Default for Harness {
    fn default() -> Self {
        Self::new()
    }
}

impl Harness {
    /// A fresh anonymous store of [`CAPACITY`] bytes that fails when full.
    pub fn new() -> Self {
        Self::with_policy(WhenFull::Fail)
    }

    /// A fresh anonymous store of [`CAPACITY`] bytes with the given full-store policy.
    /// With [`WhenFull::Evict`], objects may vanish between steps; the harness then checks
    /// that each one was sealed, unpinned and evictable, and counts it.
    pub fn with_policy(when_full: WhenFull) -> Self {
        let cfg = StoreConfig {
            max_objects: 32,
            max_clients: 4,
            prefault: false,
            when_full,
            ..StoreConfig::with_capacity(CAPACITY)
        };
        Harness {
            store: Store::create_anonymous(&cfg).expect("anonymous store"),
            creations: Vec::new(),
            views: Vec::new(),
            sealed: BTreeMap::new(),
            creating: BTreeSet::new(),
            incarnation: 0,
            evicts: when_full == WhenFull::Evict,
            evicted: 0,
            evicted_bytes: 0,
        }
    }

    /// Drops evicted objects from the model, after checking that none was pinned.
    fn reconcile_evictions(&mut self) -> Result<(), String> {
        let gone: Vec<u8> = self
            .sealed
            .keys()
            .copied()
            .filter(|k| !self.store.contains(&id(*k)))
            .collect();
        for k in gone {
            if !self.evicts {
                return Err(format!(
                    "object {k} vanished from a store that does not evict"
                ));
            }
            let inc = self.sealed[&k].1;
            if self.views.iter().any(|v| v.0.id() == id(k) && v.2 == inc) {
                return Err(format!("object {k} was evicted while a view pinned it"));
            }
            if let Some((bytes, _)) = self.sealed.remove(&k) {
                self.evicted_bytes += bytes.len() as u64;
            }
            self.evicted += 1;
        }
        Ok(())
    }

    /// The store under test.
    pub fn store(&self) -> &Store {
        &self.store
    }

    fn exists(&self, key: u8) -> bool {
        self.sealed.contains_key(&key) || self.creating.contains(&key)
    }

    /// `Full` is right only if no free run could hold the request.
    fn check_full(&self, err: &Error) -> Result<(), String> {
        match err {
            Error::Full {
                requested,
                largest_free,
                ..
            } => {
                let need = requested.div_ceil(crate::layout::PAGE) * crate::layout::PAGE;
                if *largest_free >= need {
                    return Err(format!(
                        "Full although a {largest_free}-byte run is free: {err}"
                    ));
                }
                Ok(())
            }
            other => Err(format!("unexpected error {other:?}")),
        }
    }

    fn keep_view(&mut self, v: View, expect: Vec<u8>, incarnation: u64) {
        if self.views.len() < MAX_HANDLES {
            self.views.push((v, expect, incarnation));
        }
    }

    /// Runs `op` on the store, compares the outcome with the model, then checks every
    /// invariant. An `Err` describes the first disagreement.
    pub fn apply(&mut self, op: &Op) -> Result<(), String> {
        self.step(op).map_err(|e| format!("{op:?}: {e}"))?;
        self.reconcile_evictions()
            .map_err(|e| format!("after {op:?}: {e}"))?;
        self.check().map_err(|e| format!("after {op:?}: {e}"))
    }

    fn step(&mut self, op: &Op) -> Result<(), String> {
        let s = self.store.clone();
        match *op {
            Op::Create { key, len, fill } | Op::Put { key, len, fill } => {
                let key = key % KEYS;
                let exists = self.exists(key);
                let is_put = matches!(op, Op::Put { .. });
                if !is_put && self.creations.len() >= MAX_HANDLES {
                    return Ok(());
                }
                let data = content(len, fill);
                let r = if is_put {
                    s.put(&id(key), &data).map(|()| None)
                } else {
                    s.create_object(&id(key), len as u64).map(Some)
                };
                match (r, exists) {
                    (Err(Error::AlreadyExists { .. }), true) => {}
                    (Err(e), true) => return Err(format!("expected AlreadyExists, got {e:?}")),
                    (Ok(_), true) => return Err("created an id that exists".into()),
                    (Err(e), false) => self.check_full(&e)?,
                    (Ok(None), false) => {
                        self.incarnation += 1;
                        self.sealed.insert(key, (data, self.incarnation));
                    }
                    (Ok(Some(c)), false) => {
                        self.creating.insert(key);
                        self.creations.push((key, c, data));
                    }
                }
            }
            Op::Seal { handle } | Op::Abort { handle } => {
                if self.creations.is_empty() {
                    return Ok(());
                }
                let (key, mut c, data) = self
                    .creations
                    .remove(handle as usize % self.creations.len());
                self.creating.remove(&key);
                if matches!(op, Op::Seal { .. }) {
                    c.copy_from_slice(&data);
                    c.seal().map_err(|e| format!("seal: {e:?}"))?;
                    self.incarnation += 1;
                    self.sealed.insert(key, (data, self.incarnation));
                } else {
                    c.abort();
                }
            }
            Op::Get { key } | Op::GetZeroTimeout { key } => {
                let key = key % KEYS;
                let r = if matches!(op, Op::Get { .. }) {
                    s.try_get(&id(key))
                } else {
                    s.get(&id(key), Duration::ZERO)
                };
                match (r, self.sealed.get(&key)) {
                    (Ok(v), Some((want, inc))) => {
                        if &v[..] != want.as_slice() {
                            return Err("view bytes differ from what was sealed".into());
                        }
                        let (want, inc) = (want.clone(), *inc);
                        self.keep_view(v, want, inc);
                    }
                    (Ok(_), None) => return Err("got an object that is not sealed".into()),
                    (Err(Error::NotFound { .. }), None) if matches!(op, Op::Get { .. }) => {}
                    (Err(Error::Timeout { .. }), None)
                        if matches!(op, Op::GetZeroTimeout { .. }) => {}
                    (Err(e), _) => return Err(format!("get: {e:?}")),
                }
            }
            Op::CloneView { view } => {
                if self.views.is_empty() {
                    return Ok(());
                }
                let k = view as usize % self.views.len();
                let v = self.views[k]
                    .0
                    .try_clone()
                    .map_err(|e| format!("try_clone: {e:?}"))?;
                let (want, inc) = (self.views[k].1.clone(), self.views[k].2);
                self.keep_view(v, want, inc);
            }
            Op::DropView { view } => {
                if !self.views.is_empty() {
                    let k = view as usize % self.views.len();
                    self.views.remove(k);
                }
            }
            Op::Delete { key } => {
                let key = key % KEYS;
                match (
                    s.delete(&id(key)),
                    self.sealed.contains_key(&key),
                    self.creating.contains(&key),
                ) {
                    (Ok(()), true, _) => {
                        self.sealed.remove(&key);
                    }
                    (Err(Error::NotSealed { .. }), false, true) => {}
                    (Err(Error::NotFound { .. }), false, false) => {}
                    (r, sealed, creating) => {
                        return Err(format!(
                            "delete gave {r:?} (sealed {sealed}, creating {creating})"
                        ))
                    }
                }
            }
            Op::DeleteUnpinned { key } => {
                let key = key % KEYS;
                let pinned = self.sealed.get(&key).is_some_and(|(_, inc)| {
                    self.views
                        .iter()
                        .any(|(v, _, i)| v.id() == id(key) && i == inc)
                });
                match (
                    s.delete_unpinned(&id(key)),
                    self.sealed.contains_key(&key),
                    self.creating.contains(&key),
                ) {
                    (Ok(true), true, _) if !pinned => {
                        self.sealed.remove(&key);
                    }
                    (Ok(false), true, _) if pinned => {}
                    (Err(Error::NotSealed { .. }), false, true) => {}
                    (Err(Error::NotFound { .. }), false, false) => {}
                    (r, sealed, creating) => {
                        return Err(format!(
                            "delete_unpinned gave {r:?} (sealed {sealed}, pinned {pinned}, \
                             creating {creating})"
                        ))
                    }
                }
            }
            Op::GetDraining { key } => {
                let key = key % KEYS;
                // Deleted incarnations of the key that a held view still pins.
                let current = self.sealed.get(&key).map(|(_, inc)| *inc);
                let draining: Vec<(Vec<u8>, u64)> = self
                    .views
                    .iter()
                    .filter(|(v, _, inc)| v.id() == id(key) && Some(*inc) != current)
                    .map(|(_, want, inc)| (want.clone(), *inc))
                    .collect();
                match (s.get_draining(&id(key)), self.sealed.get(&key)) {
                    (Ok(v), Some((want, inc))) => {
                        if &v[..] != want.as_slice() {
                            return Err("get_draining did not give the sealed object".into());
                        }
                        let (want, inc) = (want.clone(), *inc);
                        self.keep_view(v, want, inc);
                    }
                    (Ok(v), None) => {
                        let Some((want, inc)) = draining
                            .into_iter()
                            .find(|(want, _)| &v[..] == want.as_slice())
                        else {
                            return Err(
                                "get_draining gave bytes no pinned deleted object has".into()
                            );
                        };
                        self.keep_view(v, want, inc);
                    }
                    (Err(Error::NotFound { .. }), None) if draining.is_empty() => {}
                    (r, sealed) => {
                        return Err(format!(
                            "get_draining gave {r:?} (sealed {}, {} draining views)",
                            sealed.is_some(),
                            draining.len()
                        ))
                    }
                }
            }
            Op::Contains { key } => {
                let key = key % KEYS;
                if s.contains(&id(key)) != self.sealed.contains_key(&key) {
                    return Err("contains disagrees with the model".into());
                }
            }
        }
        Ok(())
    }

    /// Every invariant: held views unchanged (even after their object was deleted) and
    /// current exactly while their key names their object (`View::is_current`), the
    /// allocator and table consistent (`check_invariants`), and stats equal to the model.
    pub fn check(&self) -> Result<(), String> {
        for (v, want, inc) in &self.views {
            if &v[..] != want.as_slice() {
                return Err(format!("a pinned view of {} changed", v.id()));
            }
            // Incarnations are unique across keys: the view's object is the one its key
            // names while the model still holds that incarnation as sealed.
            let current = self.sealed.values().any(|s| s.1 == *inc);
            if v.is_current() != current {
                return Err(format!(
                    "a view of {} says is_current {}, the model {current}",
                    v.id(),
                    v.is_current()
                ));
            }
        }
        self.store
            .check_invariants()
            .map_err(|e| format!("invariants: {e}"))?;
        let st = self.store.stats();
        if st.used + st.free != st.capacity {
            return Err(format!("used + free != capacity: {st:?}"));
        }
        let want = (
            self.sealed.len() as u64,
            self.creating.len() as u64,
            self.views.len() as u64,
        );
        if (st.evictions, st.bytes_evicted) != (self.evicted, self.evicted_bytes) {
            return Err(format!(
                "stats count {} evictions of {} bytes, the model saw {} of {}",
                st.evictions, st.bytes_evicted, self.evicted, self.evicted_bytes
            ));
        }
        if (st.objects, st.creating, st.pins) != want {
            return Err(format!(
                "stats {st:?} disagree with model (objects, creating, pins) = {want:?}"
            ));
        }
        let live: u64 = self
            .sealed
            .values()
            .map(|d| &d.0)
            .chain(self.creations.iter().map(|c| &c.2))
            .map(|d| d.len() as u64)
            .sum();
        if st.used < live {
            return Err(format!("used {} < live payload {live}", st.used));
        }
        Ok(())
    }

    /// Drops every handle and deletes every object; the store must then be empty.
    pub fn drain(&mut self) -> Result<(), String> {
        self.views.clear();
        self.creations.clear();
        self.creating.clear();
        for key in std::mem::take(&mut self.sealed).into_keys() {
            self.store
                .delete(&id(key))
                .map_err(|e| format!("drain: {e:?}"))?;
        }
        self.check()?;
        let st = self.store.stats();
        if st.used != 0 || self.store.largest_free() != st.capacity {
            return Err(format!("memory stranded after draining: {st:?}"));
        }
        Ok(())
    }
}

/// Opens `bytes` as if it were a store file (through a memfd). Returns whether it opened;
/// it must never crash, and a store that opens must keep working.
pub fn open_bytes(bytes: &[u8]) -> bool {
    use std::io::Write;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    // SAFETY: plain memfd_create with a static name.
    let fd = unsafe { libc::memfd_create(c"shmstore-fuzz".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return false;
    }
    // SAFETY: fresh descriptor, owned only here.
    let mut f = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    if f.write_all(bytes).is_err() {
        return false;
    }
    let path = format!("/proc/self/fd/{}", f.as_raw_fd());
    let opts = crate::AttachOptions {
        prefault: false,
        ..Default::default()
    };
    match Store::open_with(&path, &opts) {
        Ok(s) => {
            exercise(&s);
            true
        }
        Err(_) => false,
    }
}

/// A valid superblock for the harness's geometry, with `patch` applied at `offset` and the
/// checksum recomputed, followed by `file_len` bytes of zeros in total: gets past the
/// checksum so that the layout validation itself is exercised.
pub fn forged_store_bytes(offset: u8, patch: &[u8], file_len: u32) -> Vec<u8> {
    let params = crate::layout::Params {
        heap_size: 64 << 10,
        table_slots: 32,
        max_clients: 2,
    };
    let mut sb = params.layout().expect("valid params");
    let mut raw = bytemuck::bytes_of(&sb).to_vec();
    let at = (offset as usize).min(248);
    let n = patch.len().min(248 - at);
    raw[at..at + n].copy_from_slice(&patch[..n]);
    sb = bytemuck::pod_read_unaligned(&raw);
    sb.checksum = sb.compute_checksum();
    let mut out = bytemuck::bytes_of(&sb).to_vec();
    out.resize((file_len as usize).clamp(256, 4 << 20), 0);
    out
}

/// Overwrites bytes of a live store's metadata (everything before the heap) and then runs
/// operations on it: they must fail with errors or work, never crash or hang. Returns each
/// store's figures at the end and its invariant check (failing store first, then
/// evicting), for the test that checks the harness does what it says.
pub fn scribble_and_exercise(writes: &[(u32, Vec<u8>)]) -> Vec<(crate::Stats, crate::Result<()>)> {
    let mut figures = Vec::new();
    // Both policies: an evicting store also runs the CLOCK hand and eviction by address,
    // which read the page owners, slots and pin rows of objects it did not create.
    for policy in [WhenFull::Fail, WhenFull::Evict] {
        let h = Harness::with_policy(policy);
        let s = h.store().clone();
        // Small objects of one size class: one slab (64 KiB, a quarter of the store).
        for k in 0..6u8 {
            let _ = s.put(&id(k), &content(1000, k));
        }
        // Page runs (over 16 KiB) that fill most of the rest, so that the puts of
        // `exercise` that need a slab of another class or a long run must evict (or fail).
        for k in 0..4u8 {
            let _ = s.put(&id(3 * KEYS + k), &vec![k; 40 << 10]);
        }
        // The setup must stand, or the scribbles meet a store emptier than intended (it
        // once did not: a key that wrapped made the page runs collide with the small
        // objects, whose sizes took a slab of 64 KiB each, and the store held 4 objects).
        let setup = s.stats();
        assert_eq!(setup.objects, 10, "the harness's setup: {setup:?}");
        let held = s.try_get(&id(1)).ok();
        for (offset, bytes) in writes {
            s.scribble_metadata(*offset as u64, bytes);
        }
        exercise(&s);
        drop(held);
        let sound = s.check_invariants();
        figures.push((s.stats(), sound));
    }
    figures
}

/// A fixed burst of every operation, ignoring results.
fn exercise(s: &Store) {
    let _ = s.stats();
    let _ = s.check_invariants();
    // What the tools read (`shmstore ls`, `stat`, `check`, the Prometheus exporter): every
    // table entry as it is, the page bitmap's longest run, the pins per slot.
    for o in s.objects() {
        let _ = (o.len, o.pins, o.state);
    }
    let _ = (s.list().len(), s.largest_free(), s.pinned_objects());
    // Recovery and the leak sweep read other clients' fields (liveness, counters, owners,
    // creators): scribbled ones must give errors or nothing, never a crash or a hang. One
    // look again for a moment to sweep, not `recover`'s fifty over ~0.1 s: scribbled
    // counters often show a client inside an allocator step for ever, and waiting for it
    // to leave made these inputs 100x slower to fuzz, for no code the first look missed.
    let _ = s.recover_backing_off(1);
    for k in 0..KEYS {
        let _ = s.contains(&id(k));
        if let Ok(v) = s.try_get(&id(k)) {
            let _ = v.iter().fold(0u8, |a, b| a ^ b);
            let _ = v.meta().len();
        }
        let _ = s.get(&id(k), Duration::ZERO);
        // The neighbourhood scan for deleted entries, and the adoption CAS, on whatever
        // the scribbles left in the slots.
        if let Ok(v) = s.get_draining(&id(k)) {
            let _ = v.iter().fold(0u8, |a, b| a ^ b);
        }
        let _ = s.put(&id(k + KEYS), &content(3000, k));
        if let Ok(mut c) = s.create_object(&id(k + 2 * KEYS), 100) {
            c.fill(k);
            if k % 2 == 0 {
                let _ = c.seal();
            }
        }
        let _ = s.delete(&id(k));
        let _ = s.delete(&id(k + KEYS));
        // Delete-if-unpinned reads the slot's pins, which the scribbles may have set.
        let _ = s.delete_unpinned(&id(k + 2 * KEYS));
    }
    // Several objects at once (all or nothing: the pins already taken must be let go
    // when a later one fails), and an object with metadata, read back.
    let all: Vec<ObjectId> = (0..KEYS).map(id).collect();
    let _ = s.get_many(&all, Duration::ZERO);
    if s.put_with_meta(&id(5 * KEYS), b"with meta", b"u8[9]")
        .is_ok()
    {
        if let Ok(v) = s.try_get(&id(5 * KEYS)) {
            let _ = (v.len(), v.meta().len());
        }
    }
    for k in 0..2u8 {
        let _ = s.put(&id(4 * KEYS + k), &vec![k; 96 << 10]);
    }
}

/// Feeds `bytes` to every decoder of values read from shared memory.
pub fn decode_everything(bytes: &[u8]) {
    let word = |i: usize| {
        let mut w = [0u8; 8];
        for (k, b) in w.iter_mut().enumerate() {
            *b = bytes.get(i * 8 + k).copied().unwrap_or(0);
        }
        u64::from_le_bytes(w)
    };
    let _ = crate::client::recoverer_of(word(0));
    let _ = crate::alloc::BlockKind::decode(bytes.first().copied().unwrap_or(0));
    let _ = crate::table::Ctl(word(1)).owner();
    let _ = crate::layout::Superblock::validate(
        bytes,
        bytes.len() as u64,
        std::path::Path::new("fuzz"),
    );
    let _ = crate::layout::Superblock::validate(bytes, word(2), std::path::Path::new("fuzz"));
    if let Ok(s) = std::str::from_utf8(bytes) {
        let _ = s.parse::<ObjectId>();
    }
    crate::store::resolve_untrusted(word(3), word(4), word(5));
    let _ = crate::item::decode(bytes);
}

/// Starts recovering every dead client and stops halfway, as a recoverer killed midway
/// would (slots claimed RECOVERING, pins dropped, creations not aborted, slots not
/// released). For the test that the next recoverer finishes the job. Returns the number
/// of clients it claimed.
pub fn interrupted_recovery(store: &Store) -> u64 {
    store.recover_interrupted().unwrap_or(0)
}

/// Fuzz hook for tensor item headers (`crate::item::decode`): decodes `data` as an object,
/// then a valid item whose header the fuzzer patches (pairs of position and byte), so that
/// mutations also start past the magic and length checks. Every decode that succeeds must
/// describe arrays inside the object with consistent sizes.
pub fn fuzz_item_header(data: &[u8]) {
    use crate::item::{self, ArraySpec, DType, MetaValue};
    fn check(object: &[u8]) {
        if let Ok(d) = item::decode(object) {
            for a in d.arrays {
                assert!(a.offset % item::ALIGN == 0);
                assert!(a.offset + a.nbytes <= object.len() as u64);
                assert_eq!(a.spec.nbytes(), Some(a.nbytes));
            }
        }
    }
    check(data);
    let specs = [
        ArraySpec {
            name: "pixel_values".into(),
            dtype: DType::Float32,
            shape: vec![3, 4, 4],
        },
        ArraySpec {
            name: "grid".into(),
            dtype: DType::Int64,
            shape: vec![3],
        },
        ArraySpec {
            name: "video".into(),
            dtype: DType::BFloat16,
            shape: vec![2, 0, 5],
        },
    ];
    let meta = [
        ("fps".to_string(), MetaValue::Float(29.97)),
        ("tag".to_string(), MetaValue::Str("clip".into())),
    ];
    let plan = item::plan(&specs, &meta).expect("valid plan");
    let mut object = vec![0u8; plan.total_len as usize];
    object[..plan.header.len()].copy_from_slice(&plan.header);
    for pair in data.chunks_exact(2) {
        let at = pair[0] as usize % plan.header.len();
        object[at] = pair[1];
    }
    check(&object);
    let cut = data.first().map_or(0, |&b| b as usize) % (object.len() + 1);
    check(&object[..cut]);
}

/// Allocates `size` bytes inside an ownership-changing step that never ends and that no
/// table entry names: what a process killed in the middle of `create_object` leaves. For
/// the test that the leak sweep returns it (call it in a process that is then killed).
pub fn leak_inside_allocator_step(store: &Store, size: u64) -> crate::Result<()> {
    store.leak_inside_allocator_step(size)
}

/// Takes the leak sweep's token and owes a sweep, as a sweeper killed midway leaves. For
/// the test that recovering the dead sweeper frees the token (call it in a process that
/// is then killed).
pub fn hold_sweep_token(store: &Store) -> crate::Result<()> {
    store.hold_sweep_token()
}

/// Claims a client slot of the store at `path` and stops: what a process killed right
/// after its claim leaves. With `take_dead`, claims a dead client's slot (moving in)
/// instead of a free one. Returns the slot; the process must then be killed.
pub fn claim_slot_and_stop(path: &std::path::Path, take_dead: bool) -> crate::Result<u64> {
    Store::claim_slot_and_stop(path, take_dead)
}

/// Starts a new slab and stops before publishing it, as a process killed inside new-slab
/// setup leaves (call it in a process that is then killed).
pub fn die_in_slab_setup(store: &Store) -> crate::Result<()> {
    store.die_in_slab_setup()
}

/// Overwrites the `creator` field of `id`'s table entry, as a buggy process could.
pub fn corrupt_creator(store: &Store, id: &ObjectId, creator: u16) -> crate::Result<()> {
    store.corrupt_creator(id, creator)
}

/// This process's memory cgroup directory and the name of its limit file there
/// (`memory.max` on cgroup v2, `memory.limit_in_bytes` on v1), as the store's check before
/// reserving memory finds them; `None` where there is none. For the test that makes a
/// child cgroup with a limit beside it.
pub fn memory_cgroup() -> Option<(std::path::PathBuf, &'static str)> {
    let (dir, _, version) = crate::cgroup::memory_cgroup()?;
    Some((
        dir,
        match version {
            crate::cgroup::Version::V1 => "memory.limit_in_bytes",
            crate::cgroup::Version::V2 => "memory.max",
        },
    ))
}

/// Builds the named store `dir/name` of `capacity` bytes up to the point where its name
/// would be published, and stops: what a creator killed during `Store::create` (while
/// reserving a large store, say) leaves. Returns the temporary file's path; the process
/// must then be killed.
pub fn build_store_and_stop(
    dir: &std::path::Path,
    name: &str,
    capacity: u64,
) -> crate::Result<std::path::PathBuf> {
    Store::build_and_stop(dir, name, capacity)
}

/// [`Store::open_path`], running `before_attach` once the file is mapped and checked and
/// before a client slot is claimed: for tests of what happens when the store's name is
/// removed (or taken by another store) in that moment.
pub fn open_path_after(
    path: impl AsRef<std::path::Path>,
    mut before_attach: impl FnMut(),
) -> crate::Result<Store> {
    Store::open_attaching(
        path.as_ref(),
        &crate::AttachOptions::default(),
        &mut before_attach,
    )
}

/// Crash injection (feature `kill-points`): SIGKILL this process just before the `n`th
/// write of shared state (an atomic store, compare-exchange or read-modify-write, or a
/// futex wake) that the calling thread makes after [`arm`](kill_points::arm). A test
/// counts an operation's kill points with `arm(None)` ... [`disarm`](kill_points::disarm),
/// then kills a fresh process at each one in turn (tests/kill_points.rs).
///
/// ```
/// # #[cfg(feature = "kill-points")] {
/// use shmstore::testing::kill_points;
/// let store = shmstore::Store::create_anonymous(&shmstore::StoreConfig::with_capacity(1 << 20))?;
/// kill_points::arm(None); // count only
/// store.put(&shmstore::ObjectId::of_key("a"), b"abc")?;
/// assert!(kill_points::disarm() > 0);
/// # }
/// # Ok::<(), shmstore::Error>(())
/// ```
#[cfg(feature = "kill-points")]
pub mod kill_points {
    /// Counts this thread's kill points from zero from now on; `Some(n)`: die just
    /// before the `n`th (1-based).
    pub fn arm(kill_at: Option<u64>) {
        crate::sync::kill_points::arm(kill_at);
    }

    /// Stops counting; returns the kill points this thread passed since [`arm`].
    pub fn disarm() -> u64 {
        crate::sync::kill_points::disarm()
    }
}

/// Removes a test's store file, or directory, when the test ends, passed or failed: a
/// failing test (under `cargo mutants` most fail, early) would otherwise leave it in
/// /dev/shm, and stores of 16-256 MiB once filled it with 20 GiB that way.
///
/// ```
/// let dir = std::env::temp_dir().join(format!("removed-at-end-{}", std::process::id()));
/// std::fs::create_dir_all(&dir).unwrap();
/// drop(shmstore::testing::RemovedAtEnd(dir.clone()));
/// assert!(!dir.exists());
/// ```
pub struct RemovedAtEnd(pub std::path::PathBuf);

impl RemovedAtEnd {
    /// Removes `store`'s file when dropped (a named store).
    pub fn of(store: &Store) -> Self {
        RemovedAtEnd(store.path().expect("a named store").to_path_buf())
    }
}

impl Drop for RemovedAtEnd {
    fn drop(&mut self) {
        if self.0.is_dir() {
            let _ = std::fs::remove_dir_all(&self.0);
        } else {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}
