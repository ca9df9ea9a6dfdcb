//! Tensor items: several named arrays plus small scalar metadata in **one** object, with no
//! serialization of the array data.
//!
//! An item object is a header followed by each array's bytes, every array starting on a
//! 64-byte boundary (so a reader maps each one in place, aligned for any dtype and for
//! SIMD):
//!
//! ```text
//! 0    magic "SHMITEM1" | u32 header_len | u32 n_arrays | u32 n_meta | u32 0
//! 24   per array: u16 name_len, name (UTF-8), u8 dtype, u8 ndim, u64 shape[ndim],
//!                 u64 offset, u64 nbytes
//!      per meta:  u16 key_len, key (UTF-8), u8 kind, value
//!                 (kind 0 int: i64, 1 float: f64, 2 bool: u8, 3 str / 4 bytes: u32 len + bytes)
//!      zero padding to header_len (a multiple of 64)
//! header_len  array 0 bytes, padded to 64; array 1 bytes; ...
//! ```
//!
//! All integers are little-endian. Arrays are C-contiguous. [`decode`] treats its input as
//! hostile (it is read from shared memory another process wrote): every count, length,
//! offset and size is checked, with overflow checks, against the object's length, and
//! names must be UTF-8. It returns [`Error::BadItem`] on anything inconsistent, never
//! panics (a fuzz target checks this).
//!
//! ```
//! use shmstore::item::{self, ArraySpec, DType, MetaValue};
//! let specs = [ArraySpec { name: "pixels".into(), dtype: DType::Float32, shape: vec![3, 4] }];
//! let plan = item::plan(&specs, &[("fps".into(), MetaValue::Int(30))])?;
//! let mut object = vec![0u8; plan.total_len as usize];
//! object[..plan.header.len()].copy_from_slice(&plan.header);
//! let decoded = item::decode(&object)?;
//! assert_eq!(decoded.arrays[0].spec, specs[0]);
//! assert_eq!(decoded.arrays[0].offset % 64, 0);
//! assert_eq!(decoded.arrays[0].nbytes, 48);
//! assert_eq!(decoded.meta[0], ("fps".to_string(), MetaValue::Int(30)));
//! # Ok::<(), shmstore::Error>(())
//! ```

use crate::error::{Error, Result};

/// Magic bytes at the start of every item object.
///
/// ```
/// let plan = shmstore::item::plan(&[], &[])?;
/// assert_eq!(&plan.header[..8], shmstore::item::MAGIC);
/// # Ok::<(), shmstore::Error>(())
/// ```
pub const MAGIC: &[u8; 8] = b"SHMITEM1";
/// Most arrays in one item.
///
/// ```
/// use shmstore::item::{self, ArraySpec, DType, MAX_ARRAYS};
/// let one = ArraySpec { name: "x".into(), dtype: DType::UInt8, shape: vec![1] };
/// assert!(item::plan(&vec![one; MAX_ARRAYS + 1], &[]).is_err());
/// ```
pub const MAX_ARRAYS: usize = 4096;
/// Most metadata entries in one item.
///
/// ```
/// use shmstore::item::{self, MetaValue, MAX_META};
/// let meta: Vec<_> = (0..=MAX_META).map(|i| (format!("k{i}"), MetaValue::Int(0))).collect();
/// assert!(item::plan(&[], &meta).is_err());
/// ```
pub const MAX_META: usize = 4096;
/// Most dimensions of one array.
///
/// ```
/// use shmstore::item::{self, ArraySpec, DType, MAX_NDIM};
/// let deep = ArraySpec { name: "x".into(), dtype: DType::UInt8, shape: vec![1; MAX_NDIM + 1] };
/// assert!(item::plan(&[deep], &[]).is_err());
/// ```
pub const MAX_NDIM: usize = 32;
/// Alignment of every array's first byte, from the start of the object.
///
/// ```
/// use shmstore::item::{self, ArraySpec, DType, ALIGN};
/// let a = ArraySpec { name: "a".into(), dtype: DType::UInt8, shape: vec![3] };
/// let plan = item::plan(&[a.clone(), a], &[])?;
/// assert!(plan.placements.iter().all(|&(offset, _)| offset % ALIGN == 0));
/// # Ok::<(), shmstore::Error>(())
/// ```
pub const ALIGN: u64 = 64;

/// Element types of the arrays vLLM's multimodal inputs use, and a few more.
///
/// ```
/// use shmstore::item::DType;
/// assert_eq!(DType::from_name("bfloat16"), Some(DType::BFloat16));
/// assert_eq!(DType::BFloat16.itemsize(), 2);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    /// IEEE 754 binary32.
    Float32,
    /// IEEE 754 binary16.
    Float16,
    /// bfloat16 (the upper half of a binary32).
    BFloat16,
    /// IEEE 754 binary64.
    Float64,
    /// Signed 64-bit.
    Int64,
    /// Signed 32-bit.
    Int32,
    /// Signed 16-bit.
    Int16,
    /// Signed 8-bit.
    Int8,
    /// Unsigned 8-bit.
    UInt8,
    /// One byte, 0 or 1.
    Bool,
}

const DTYPES: [(DType, u8, &str, u64); 10] = [
    (DType::Float32, 1, "float32", 4),
    (DType::Float16, 2, "float16", 2),
    (DType::BFloat16, 3, "bfloat16", 2),
    (DType::Float64, 4, "float64", 8),
    (DType::Int64, 5, "int64", 8),
    (DType::Int32, 6, "int32", 4),
    (DType::Int16, 7, "int16", 2),
    (DType::Int8, 8, "int8", 1),
    (DType::UInt8, 9, "uint8", 1),
    (DType::Bool, 10, "bool", 1),
];

impl DType {
    fn row(self) -> (DType, u8, &'static str, u64) {
        *DTYPES
            .iter()
            .find(|r| r.0 == self)
            .expect("every dtype has a row")
    }
    /// Bytes per element.
    ///
    /// ```
    /// assert_eq!(shmstore::item::DType::Int64.itemsize(), 8);
    /// ```
    pub fn itemsize(self) -> u64 {
        self.row().3
    }
    /// The numpy / torch name (`"float32"`, `"bfloat16"`, ...).
    ///
    /// ```
    /// assert_eq!(shmstore::item::DType::UInt8.name(), "uint8");
    /// ```
    pub fn name(self) -> &'static str {
        self.row().2
    }
    /// Parses a numpy / torch name.
    ///
    /// ```
    /// assert!(shmstore::item::DType::from_name("complex64").is_none());
    /// ```
    pub fn from_name(name: &str) -> Option<DType> {
        DTYPES.iter().find(|r| r.2 == name).map(|r| r.0)
    }
    fn code(self) -> u8 {
        self.row().1
    }
    fn from_code(c: u8) -> Option<DType> {
        DTYPES.iter().find(|r| r.1 == c).map(|r| r.0)
    }
}

/// One array's name, element type and shape.
///
/// ```
/// use shmstore::item::{ArraySpec, DType};
/// let a = ArraySpec { name: "video".into(), dtype: DType::Float16, shape: vec![16, 3, 448, 448] };
/// assert_eq!(a.nbytes(), Some(16 * 3 * 448 * 448 * 2));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArraySpec {
    /// Key in the item.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Dimensions (C order).
    pub shape: Vec<u64>,
}

impl ArraySpec {
    /// Bytes of the array's data, or `None` on overflow.
    ///
    /// ```
    /// use shmstore::item::{ArraySpec, DType};
    /// let huge = ArraySpec { name: "x".into(), dtype: DType::Int64, shape: vec![u64::MAX, 2] };
    /// assert_eq!(huge.nbytes(), None);
    /// ```
    pub fn nbytes(&self) -> Option<u64> {
        self.shape
            .iter()
            .try_fold(self.dtype.itemsize(), |acc, &d| acc.checked_mul(d))
    }
}

/// A small scalar stored beside the arrays.
///
/// ```
/// let v = shmstore::item::MetaValue::Str("rgb".into());
/// assert_ne!(v, shmstore::item::MetaValue::Bool(true));
/// ```
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    /// Signed integer.
    Int(i64),
    /// Floating point.
    Float(f64),
    /// Boolean.
    Bool(bool),
    /// UTF-8 text.
    Str(String),
    /// Raw bytes.
    Bytes(Vec<u8>),
}

/// Where each array goes in an item object, and the header to write first.
///
/// ```
/// use shmstore::item::{self, ArraySpec, DType};
/// let a = ArraySpec { name: "grid".into(), dtype: DType::Int64, shape: vec![1, 3] };
/// let plan = item::plan(&[a], &[])?;
/// let (offset, len) = plan.placements[0];
/// assert_eq!((offset, len), (plan.header.len() as u64, 24));
/// assert_eq!(plan.total_len, offset + 64); // the array's bytes, padded to 64
/// # Ok::<(), shmstore::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The header bytes (already padded to a multiple of 64).
    pub header: Vec<u8>,
    /// Per array, in order: byte offset from the object start, and byte length.
    pub placements: Vec<(u64, u64)>,
    /// Length of the whole object.
    pub total_len: u64,
}

/// One decoded array: its spec and where its bytes are in the object.
///
/// ```
/// use shmstore::item::{self, ArraySpec, DType};
/// let a = ArraySpec { name: "grid".into(), dtype: DType::Int64, shape: vec![1, 3] };
/// let plan = item::plan(&[a.clone()], &[])?;
/// let mut object = vec![0u8; plan.total_len as usize];
/// object[..plan.header.len()].copy_from_slice(&plan.header);
/// let array = &item::decode(&object)?.arrays[0];
/// assert_eq!((&array.spec, array.offset, array.nbytes), (&a, plan.placements[0].0, 24));
/// # Ok::<(), shmstore::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArrayRef {
    /// Name, dtype, shape.
    pub spec: ArraySpec,
    /// Byte offset from the object start (a multiple of 64).
    pub offset: u64,
    /// Byte length (`nbytes` of the spec).
    pub nbytes: u64,
}

/// A decoded item header.
///
/// ```
/// use shmstore::item::{self, MetaValue};
/// let plan = item::plan(&[], &[("fps".into(), MetaValue::Float(29.97))])?;
/// let decoded = item::decode(&plan.header)?;
/// assert!(decoded.arrays.is_empty());
/// assert_eq!(decoded.meta, [("fps".to_string(), MetaValue::Float(29.97))]);
/// # Ok::<(), shmstore::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Decoded {
    /// The arrays, in the order they were planned.
    pub arrays: Vec<ArrayRef>,
    /// The metadata entries, in order.
    pub meta: Vec<(String, MetaValue)>,
}

fn bad(reason: impl Into<String>) -> Error {
    Error::BadItem {
        reason: reason.into(),
    }
}

fn align(x: u64) -> Option<u64> {
    x.checked_add(ALIGN - 1).map(|v| v / ALIGN * ALIGN)
}

fn put_str(out: &mut Vec<u8>, s: &str, what: &str) -> Result<()> {
    let n = u16::try_from(s.len()).map_err(|_| bad(format!("{what} {s:?} is over 65535 bytes")))?;
    out.extend_from_slice(&n.to_le_bytes());
    out.extend_from_slice(s.as_bytes());
    Ok(())
}

/// A metadata value's bytes after their u32 length.
fn put_bytes32(out: &mut Vec<u8>, b: &[u8], key: &str) -> Result<()> {
    let n = u32::try_from(b.len())
        .map_err(|_| bad(format!("metadata {key:?}: {} bytes, over 4 GiB", b.len())))?;
    out.extend_from_slice(&n.to_le_bytes());
    out.extend_from_slice(b);
    Ok(())
}

/// Lays out an item: its header, where each array goes, and the object's total length.
///
/// ```
/// use shmstore::item::{plan, ArraySpec, DType};
/// let p = plan(&[ArraySpec { name: "a".into(), dtype: DType::UInt8, shape: vec![1] }], &[])?;
/// assert_eq!(p.placements[0], (p.header.len() as u64, 1));
/// # Ok::<(), shmstore::Error>(())
/// ```
pub fn plan(arrays: &[ArraySpec], meta: &[(String, MetaValue)]) -> Result<Plan> {
    if arrays.len() > MAX_ARRAYS || meta.len() > MAX_META {
        return Err(bad(format!(
            "{} arrays and {} metadata entries; at most {MAX_ARRAYS} and {MAX_META}",
            arrays.len(),
            meta.len()
        )));
    }
    let mut h = Vec::with_capacity(256);
    h.extend_from_slice(MAGIC);
    h.extend_from_slice(&[0; 4]); // header_len, patched below
    h.extend_from_slice(&(arrays.len() as u32).to_le_bytes());
    h.extend_from_slice(&(meta.len() as u32).to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    let mut sizes = Vec::with_capacity(arrays.len());
    let mut offset_at = Vec::with_capacity(arrays.len());
    for a in arrays {
        if a.shape.len() > MAX_NDIM {
            return Err(bad(format!(
                "array {:?} has {} dimensions; at most {MAX_NDIM}",
                a.name,
                a.shape.len()
            )));
        }
        let nbytes = a.nbytes().ok_or_else(|| {
            bad(format!(
                "array {:?} of shape {:?} overflows",
                a.name, a.shape
            ))
        })?;
        put_str(&mut h, &a.name, "array name")?;
        h.push(a.dtype.code());
        h.push(a.shape.len() as u8);
        for d in &a.shape {
            h.extend_from_slice(&d.to_le_bytes());
        }
        offset_at.push(h.len());
        h.extend_from_slice(&[0; 16]); // offset, nbytes: patched below
        sizes.push(nbytes);
    }
    for (k, v) in meta {
        put_str(&mut h, k, "metadata key")?;
        match v {
            MetaValue::Int(i) => {
                h.push(0);
                h.extend_from_slice(&i.to_le_bytes());
            }
            MetaValue::Float(f) => {
                h.push(1);
                h.extend_from_slice(&f.to_le_bytes());
            }
            MetaValue::Bool(b) => {
                h.push(2);
                h.push(*b as u8);
            }
            MetaValue::Str(s) => {
                h.push(3);
                put_bytes32(&mut h, s.as_bytes(), k)?;
            }
            MetaValue::Bytes(b) => {
                h.push(4);
                put_bytes32(&mut h, b, k)?;
            }
        }
    }
    let header_len = align(h.len() as u64).ok_or_else(|| bad("header too large"))?;
    let header_len32 = u32::try_from(header_len)
        .map_err(|_| bad(format!("header of {header_len} bytes is over 4 GiB")))?;
    h.resize(header_len as usize, 0);
    h[8..12].copy_from_slice(&header_len32.to_le_bytes());
    let mut at = header_len;
    let mut placements = Vec::with_capacity(arrays.len());
    for (&pos, &n) in offset_at.iter().zip(&sizes) {
        h[pos..pos + 8].copy_from_slice(&at.to_le_bytes());
        h[pos + 8..pos + 16].copy_from_slice(&n.to_le_bytes());
        placements.push((at, n));
        at = at
            .checked_add(n)
            .and_then(align)
            .ok_or_else(|| bad("item larger than 2^64 bytes"))?;
    }
    Ok(Plan {
        header: h,
        placements,
        total_len: at,
    })
}

/// A bounds-checked little-endian reader over untrusted bytes.
struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .ok_or_else(|| bad(format!("header ends early at byte {}", self.at)))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    fn str16(&mut self, what: &str) -> Result<String> {
        let n = self.u16()? as usize;
        let s = self.take(n)?;
        std::str::from_utf8(s)
            .map(str::to_owned)
            .map_err(|_| bad(format!("{what} is not UTF-8")))
    }
}

/// Decodes the header of an item object (`object` is the whole object). Hostile input
/// gives [`Error::BadItem`], never a panic.
///
/// ```
/// assert!(shmstore::item::decode(b"not an item").is_err());
/// ```
pub fn decode(object: &[u8]) -> Result<Decoded> {
    let len = object.len() as u64;
    let mut r = Reader { b: object, at: 0 };
    if r.take(8)? != MAGIC {
        return Err(bad("not an item (bad magic)"));
    }
    let header_len = r.u32()? as u64;
    let n_arrays = r.u32()? as usize;
    let n_meta = r.u32()? as usize;
    let _reserved = r.u32()?;
    if header_len > len || header_len % ALIGN != 0 {
        return Err(bad(format!(
            "header length {header_len} does not fit an object of {len} bytes"
        )));
    }
    if n_arrays > MAX_ARRAYS || n_meta > MAX_META {
        return Err(bad(format!(
            "{n_arrays} arrays, {n_meta} metadata entries: too many"
        )));
    }
    // Only the header's bytes may be read as header.
    let mut r = Reader {
        b: &object[..header_len as usize],
        at: r.at,
    };
    let mut arrays = Vec::with_capacity(n_arrays.min(64));
    for _ in 0..n_arrays {
        let name = r.str16("array name")?;
        let dtype = DType::from_code(r.u8()?)
            .ok_or_else(|| bad(format!("array {name:?}: unknown dtype")))?;
        let ndim = r.u8()? as usize;
        if ndim > MAX_NDIM {
            return Err(bad(format!("array {name:?}: {ndim} dimensions")));
        }
        let shape = (0..ndim).map(|_| r.u64()).collect::<Result<Vec<u64>>>()?;
        let offset = r.u64()?;
        let nbytes = r.u64()?;
        let spec = ArraySpec { name, dtype, shape };
        if spec.nbytes() != Some(nbytes) {
            return Err(bad(format!(
                "array {:?}: {nbytes} bytes for shape {:?} of {}",
                spec.name,
                spec.shape,
                dtype.name()
            )));
        }
        if offset % ALIGN != 0
            || offset < header_len
            || offset.checked_add(nbytes).is_none_or(|e| e > len)
        {
            return Err(bad(format!(
                "array {:?}: bytes {offset}..+{nbytes} are not inside the object's {len} bytes after its header",
                spec.name
            )));
        }
        arrays.push(ArrayRef {
            spec,
            offset,
            nbytes,
        });
    }
    let mut meta = Vec::with_capacity(n_meta.min(64));
    for _ in 0..n_meta {
        let key = r.str16("metadata key")?;
        let v = match r.u8()? {
            0 => MetaValue::Int(r.u64()? as i64),
            1 => MetaValue::Float(f64::from_bits(r.u64()?)),
            2 => MetaValue::Bool(r.u8()? != 0),
            3 => {
                let n = r.u32()? as usize;
                let s = r.take(n)?;
                MetaValue::Str(
                    std::str::from_utf8(s)
                        .map_err(|_| bad(format!("metadata {key:?} is not UTF-8")))?
                        .to_owned(),
                )
            }
            4 => {
                let n = r.u32()? as usize;
                MetaValue::Bytes(r.take(n)?.to_vec())
            }
            k => return Err(bad(format!("metadata {key:?}: unknown kind {k}"))),
        };
        meta.push((key, v));
    }
    Ok(Decoded { arrays, meta })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn specs() -> Vec<ArraySpec> {
        vec![
            ArraySpec {
                name: "image".into(),
                dtype: DType::Float32,
                shape: vec![3, 5, 7],
            },
            ArraySpec {
                name: "mask".into(),
                dtype: DType::Bool,
                shape: vec![0],
            },
            ArraySpec {
                name: "video".into(),
                dtype: DType::BFloat16,
                shape: vec![2, 3],
            },
            ArraySpec {
                name: "scalar".into(),
                dtype: DType::Int64,
                shape: vec![],
            },
        ]
    }

    #[test]
    fn plan_and_decode_round_trip() {
        let meta = vec![
            ("n".to_string(), MetaValue::Int(-3)),
            ("x".to_string(), MetaValue::Float(0.5)),
            ("ok".to_string(), MetaValue::Bool(true)),
            ("fmt".to_string(), MetaValue::Str("rgb".into())),
            ("raw".to_string(), MetaValue::Bytes(vec![1, 2])),
        ];
        let p = plan(&specs(), &meta).unwrap();
        assert_eq!(p.header.len() % 64, 0);
        let mut obj = vec![0u8; p.total_len as usize];
        obj[..p.header.len()].copy_from_slice(&p.header);
        let d = decode(&obj).unwrap();
        assert_eq!(d.meta, meta);
        let mut end = p.header.len() as u64;
        for ((a, s), (off, n)) in d.arrays.iter().zip(specs()).zip(&p.placements) {
            assert_eq!((&a.spec, a.offset, a.nbytes), (&s, *off, *n));
            assert_eq!(a.offset % 64, 0);
            assert!(a.offset >= end, "arrays overlap");
            end = a.offset + a.nbytes;
        }
        assert_eq!(d.arrays[0].nbytes, 3 * 5 * 7 * 4);
        assert_eq!(d.arrays[3].nbytes, 8);
    }

    #[test]
    fn hostile_headers_are_errors() {
        let p = plan(&specs(), &[]).unwrap();
        let mut obj = vec![0u8; p.total_len as usize];
        obj[..p.header.len()].copy_from_slice(&p.header);
        // Truncated object: the last array no longer fits.
        assert!(decode(&obj[..obj.len() - 64]).is_err());
        // Every single-byte corruption of the header is an error or a consistent decode.
        for i in 0..p.header.len() {
            for x in [0u8, 0xff, 0x41] {
                let mut o = obj.clone();
                o[i] = x;
                if let Ok(d) = decode(&o) {
                    for a in d.arrays {
                        assert!(a.offset + a.nbytes <= o.len() as u64);
                        assert_eq!(a.spec.nbytes(), Some(a.nbytes));
                    }
                }
            }
        }
        assert!(decode(b"").is_err());
        assert!(matches!(decode(b"SHMITEM1"), Err(Error::BadItem { .. })));
    }

    #[test]
    fn limits_are_errors() {
        let deep = ArraySpec {
            name: "d".into(),
            dtype: DType::UInt8,
            shape: vec![1; 33],
        };
        assert!(plan(&[deep], &[]).is_err());
        let long = ArraySpec {
            name: "n".repeat(70_000),
            dtype: DType::UInt8,
            shape: vec![1],
        };
        assert!(plan(&[long], &[]).is_err());
        let huge = ArraySpec {
            name: "h".into(),
            dtype: DType::Float64,
            shape: vec![1 << 62, 4],
        };
        assert!(plan(&[huge], &[]).is_err());
    }

    #[test]
    fn every_dtype_has_one_name_and_one_code() {
        for &(d, code, name, size) in &DTYPES {
            assert_eq!(d.name(), name);
            assert_eq!(DType::from_name(name), Some(d));
            assert_eq!(DType::from_code(code), Some(d));
            assert_eq!((d.code(), d.itemsize()), (code, size));
        }
        assert_eq!(DType::Float32.name(), "float32");
        assert_eq!(DType::from_name("bfloat16"), Some(DType::BFloat16));
        for other in ["", "float", "Float32", "bfloat16 ", "complex64"] {
            assert_eq!(DType::from_name(other), None, "{other:?}");
        }
        assert_eq!(DType::from_code(0), None);
        assert_eq!(DType::from_code(11), None);
    }

    /// Where everything goes, to the byte: the header padded to 64, each array on the next
    /// multiple of 64 (an array of 64 bytes takes exactly 64), the total likewise.
    #[test]
    fn the_layout_is_exact() {
        let a = |name: &str, n| ArraySpec {
            name: name.into(),
            dtype: DType::UInt8,
            shape: vec![n],
        };
        // 24 + (2 + 1 + 1 + 1 + 8 + 16) * 2 = 82 header bytes: 128 with padding.
        let p = plan(&[a("a", 64), a("b", 65)], &[]).unwrap();
        assert_eq!(p.header.len(), 128);
        assert_eq!(p.placements, [(128, 64), (192, 65)]);
        assert_eq!(p.total_len, 320);
        // 24 + 29 = 53 header bytes: 64.
        let p = plan(&[a("c", 128)], &[]).unwrap();
        assert_eq!(
            (p.header.len(), p.placements[0], p.total_len),
            (64, (64, 128), 192)
        );
        // A header of exactly 64 bytes (24, then key length, key, kind, value length,
        // value: 2 + 10 + 1 + 4 + 23): no padding.
        let key = "k".repeat(10);
        let p = plan(&[], &[(key, MetaValue::Bytes(vec![1; 23]))]).unwrap();
        assert_eq!((p.header.len(), p.total_len), (64, 64));
        // The last array may end exactly at the object's end.
        let p = plan(&[a("a", 64)], &[]).unwrap();
        let mut obj = vec![0u8; p.total_len as usize];
        obj[..p.header.len()].copy_from_slice(&p.header);
        assert_eq!(
            decode(&obj).unwrap().arrays[0].offset + 64,
            obj.len() as u64
        );
    }

    /// A header written by hand: `n_arrays` and `n_meta` as claimed, then `body`, padded
    /// to 64; the object is `extra` zero bytes longer than the header.
    fn raw_item(n_arrays: u32, n_meta: u32, body: &[u8], extra: usize) -> Vec<u8> {
        let header_len = (24 + body.len()).div_ceil(64) * 64;
        let mut o = MAGIC.to_vec();
        for word in [header_len as u32, n_arrays, n_meta, 0] {
            o.extend_from_slice(&word.to_le_bytes());
        }
        o.extend_from_slice(body);
        o.resize(header_len + extra, 0);
        o
    }

    /// One array's record: an unnamed uint8 array of `shape` at `offset`.
    fn array_record(shape: &[u64], offset: u64) -> Vec<u8> {
        let mut r = vec![0, 0, DType::UInt8.code(), shape.len() as u8];
        for d in shape {
            r.extend_from_slice(&d.to_le_bytes());
        }
        r.extend_from_slice(&offset.to_le_bytes());
        r.extend_from_slice(&shape.iter().product::<u64>().to_le_bytes());
        r
    }

    /// One metadata record: an unnamed int.
    fn int_record() -> Vec<u8> {
        vec![0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0]
    }

    /// The limits hold at their values and one past them, each alone, in `plan` and, for
    /// headers written by hand, in `decode`.
    #[test]
    fn limits_hold_at_their_edges() {
        let one = ArraySpec {
            name: String::new(),
            dtype: DType::UInt8,
            shape: vec![],
        };
        let int = (String::new(), MetaValue::Int(1));
        let arrays = vec![one.clone(); MAX_ARRAYS];
        let meta = vec![int.clone(); MAX_META];
        let p = plan(&arrays, &meta).unwrap();
        let mut obj = vec![0u8; p.total_len as usize];
        obj[..p.header.len()].copy_from_slice(&p.header);
        let d = decode(&obj).unwrap();
        assert_eq!((d.arrays.len(), d.meta.len()), (MAX_ARRAYS, MAX_META));
        let more_arrays = vec![one.clone(); MAX_ARRAYS + 1];
        let more_meta = vec![int; MAX_META + 1];
        assert!(plan(&more_arrays, &[]).is_err());
        assert!(plan(&[], &more_meta).is_err());
        let deepest = ArraySpec {
            shape: vec![1; MAX_NDIM],
            ..one.clone()
        };
        let p = plan(&[deepest], &[]).unwrap();
        let mut obj = vec![0u8; p.total_len as usize];
        obj[..p.header.len()].copy_from_slice(&p.header);
        assert_eq!(decode(&obj).unwrap().arrays[0].spec.shape.len(), MAX_NDIM);

        // By hand, one past each limit, in a header that holds every record.
        let at = |n_records: usize, record_len: usize| {
            ((24 + n_records * record_len).div_ceil(64) * 64) as u64
        };
        let n = MAX_ARRAYS + 1;
        let body = array_record(&[], at(n, 20)).repeat(n);
        let o = raw_item(n as u32, 0, &body, 64);
        assert!(
            matches!(decode(&o), Err(Error::BadItem { reason }) if reason.contains("too many"))
        );
        let body = array_record(&[], at(MAX_ARRAYS, 20)).repeat(MAX_ARRAYS);
        assert!(decode(&raw_item(MAX_ARRAYS as u32, 0, &body, 64)).is_ok());
        let n = MAX_META + 1;
        let o = raw_item(0, n as u32, &int_record().repeat(n), 0);
        assert!(
            matches!(decode(&o), Err(Error::BadItem { reason }) if reason.contains("too many"))
        );
        assert!(decode(&raw_item(
            0,
            MAX_META as u32,
            &int_record().repeat(MAX_META),
            0
        ))
        .is_ok());
        let deep = array_record(&[1; MAX_NDIM + 1], 320);
        let o = raw_item(1, 0, &deep, 64);
        assert!(
            matches!(decode(&o), Err(Error::BadItem { reason }) if reason.contains("33 dimensions"))
        );
    }

    /// Each of the checks that an array lies inside the object after its header, alone.
    #[test]
    fn an_array_must_lie_after_the_header_and_inside_the_object() {
        // One record: header 64 bytes; the object 64 more.
        let item = |offset: u64, n: u64| raw_item(1, 0, &array_record(&[n], offset), 64);
        assert!(decode(&item(64, 64)).is_ok());
        for (offset, n, why) in [
            (65, 1, "not on a 64-byte boundary"),
            (0, 1, "inside the header"),
            (64, 65, "past the end"),
            (128, 1, "past the end"),
            (u64::MAX - 63, 64, "overflowing"),
        ] {
            assert!(
                matches!(decode(&item(offset, n)), Err(Error::BadItem { .. })),
                "{offset}+{n}: {why}"
            );
        }
    }

    /// A metadata value's length is a u32 in the header: a longer one is refused, not
    /// written with its length wrapped (the reader would take its bytes for what follows).
    #[test]
    #[cfg_attr(miri, ignore = "allocates 4 GiB of address space")]
    fn metadata_over_4_gib_is_refused() {
        // calloc'ed and never touched: 4 GiB of address space, not of memory.
        let big = vec![0u8; (1 << 32) + 1];
        match plan(&[], &[("blob".into(), MetaValue::Bytes(big))]) {
            Err(Error::BadItem { reason }) => assert!(reason.contains("over 4 GiB"), "{reason}"),
            other => panic!("{other:?}"),
        }
        let fits = vec![7u8; 1000];
        let p = plan(&[], &[("blob".into(), MetaValue::Bytes(fits.clone()))]).unwrap();
        let d = decode(&p.header).unwrap();
        assert_eq!(d.meta, [("blob".to_string(), MetaValue::Bytes(fits))]);
    }
}
