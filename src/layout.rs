//! The region's memory layout: the superblock and where every section lives.
//!
//! A store is one contiguous region (a /dev/shm file or a memfd). Its first 256 bytes are the
//! [`Superblock`], a `Pod` struct written once by the creator and never changed afterwards.
//! Every other section's offset and size is a pure function of four parameters
//! ([`Params`]), so [`Layout::validate`] can check a superblock read from an untrusted file by
//! recomputing the whole layout and comparing field by field, then checking a blake3
//! checksum. Nothing in the region is a pointer; everything is an offset from the start.
//!
//! ```text
//! 0        superblock (256 B, immutable after creation, checksummed)
//! 4 KiB    globals           512 B                 clock hand, space waiters, totals
//!          wait buckets      WAIT_BUCKETS x 64 B   futex words for blocked gets
//!          alloc hints       (CLASSES + 3) x 64 B  current slab per class, cursor, claims
//!          page bitmap       pages / 64 words      1 bit per 4 KiB heap page
//!          page summary      pages / 4096 words    1 bit per bitmap word: "holds a taken page",
//!                            + 1/64 of that        then 1 bit per summary word: "all ones"
//!          page owners       pages x 4 B           slot + 1 at each page run's first and last
//!                                                  page (a hint for eviction, validated)
//!          slab descriptors  slabs x 136 B         state + block bitmap per 64 KiB unit
//!          partial bitmaps   CLASSES x slabs/64    "slab of class c may have a free block"
//!          table buckets     slots x 8 B           neighbourhood bitmaps (two bins each)
//!          table slots       slots x 64 B          one cache line per object
//!          pin counters      slots x stride x 2 B  one u16 per (slot, client), slot-major
//!          clients           max_clients x 256 B   liveness, recovery state, counters
//! 64 KiB-aligned (2 MiB-aligned from a 2 MiB heap: whole huge pages)
//!          heap              capacity bytes        payloads (slabs and page runs)
//!          (padding to a whole huge page on hugetlbfs; not part of the layout)
//! ```
//! See docs/design.md, "Memory layout".

use crate::error::{Error, Result};
use bytemuck::{Pod, Zeroable};
use std::path::Path;

/// Magic bytes at offset 0.
pub(crate) const MAGIC: [u8; 8] = *b"SHMSTORE";
/// Layout version; bump on any incompatible change.
pub(crate) const LAYOUT_VERSION: u32 = 7;
/// Heap page size: large objects are page-aligned runs of these.
pub(crate) const PAGE: u64 = 4096;
/// Slab unit: small objects live in 64 KiB slabs aligned to 64 KiB.
pub(crate) const SLAB: u64 = 64 * 1024;
/// Pages per slab.
pub(crate) const PAGES_PER_SLAB: u64 = SLAB / PAGE;
/// Number of futex wait buckets.
pub(crate) const WAIT_BUCKETS: u64 = 256;
/// Neighbourhood: an object lives in one of this many slots (two bins of 16) chosen by its
/// home (see `crate::table`).
pub(crate) const NEIGHBORHOOD: u64 = 32;
/// Heaps of at least this size start on a 2 MiB boundary (a huge page), so that a store
/// on huge pages has whole pages to protect (read-only attach) and populate.
pub(crate) const HUGE_ALIGN_FROM: u64 = 2 << 20;
/// Size of the store-wide globals (clock hand, counters of clients that left, space
/// waiters, corrections).
pub(crate) const GLOBALS_SIZE: u64 = 512;
/// Superblock flag: evict least-recently-used objects when full instead of failing.
pub(crate) const FLAG_EVICT: u64 = 1;
/// Superblock flag: remove the store's file when its last client detaches.
pub(crate) const FLAG_REMOVE_WHEN_UNUSED: u64 = 2;
/// Size of one client slot.
pub(crate) const CLIENT_HEADER: u64 = 256;
/// Largest per-object metadata blob.
pub(crate) const MAX_META: u64 = 4096;
/// Smallest heap we accept.
pub(crate) const MIN_CAPACITY: u64 = SLAB;
/// Size classes handled by slabs; see [`crate::alloc`].
pub(crate) const CLASSES: u64 = 32;
/// Allocator hint words (one cache line each): a current slab per class, then the
/// page-run cursor and the claims-begun / claims-ended counters.
pub(crate) const HINTS: u64 = CLASSES + 3;
/// Bytes per slab descriptor.
pub(crate) const SLAB_DESC_SIZE: u64 = 136;

/// The immutable header at offset 0.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable, Debug, PartialEq, Eq)]
pub(crate) struct Superblock {
    pub magic: [u8; 8],
    pub version: u32,
    pub superblock_size: u32,
    pub total_size: u64,
    pub heap_offset: u64,
    pub heap_size: u64,
    pub wait_offset: u64,
    pub hints_offset: u64,
    pub page_bitmap_offset: u64,
    pub pages: u64,
    pub slab_desc_offset: u64,
    pub slabs: u64,
    pub partial_offset: u64,
    pub partial_words: u64,
    pub buckets_offset: u64,
    pub slots_offset: u64,
    pub table_slots: u64,
    pub clients_offset: u64,
    pub max_clients: u64,
    pub pins_offset: u64,
    pub client_stride: u64,
    pub globals_offset: u64,
    pub created_unix_ns: u64,
    pub flags: u64,
    pub pin_stride: u64,
    pub page_summary_offset: u64,
    pub page_owners_offset: u64,
    pub _reserved: [u64; 5],
    pub checksum: u64,
}

const _: () = assert!(std::mem::size_of::<Superblock>() == 256);

/// The three numbers every section's size derives from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Params {
    /// Heap bytes (a multiple of [`SLAB`]).
    pub heap_size: u64,
    /// Object table slots (a power of two, at least [`NEIGHBORHOOD`]).
    pub table_slots: u64,
    /// Client slots.
    pub max_clients: u64,
}

/// Section offsets computed from [`Params`].
pub(crate) type Layout = Superblock;

/// Words of the page summary for a heap of `pages` pages: one bit per page-bitmap word,
/// then its second level, one bit per summary word.
pub(crate) fn summary_words(pages: u64) -> u64 {
    let first = pages.div_ceil(64).div_ceil(64);
    first + first.div_ceil(64)
}

fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

impl Params {
    /// Checks ranges; every later computation relies on these bounds (no overflow).
    pub(crate) fn check(&self) -> Result<()> {
        let bad = |reason: String| Err(Error::InvalidConfig { reason });
        if self.heap_size < MIN_CAPACITY || self.heap_size % SLAB != 0 || self.heap_size > 1 << 46 {
            return bad(format!(
                "capacity {} must be a multiple of 64 KiB between 64 KiB and 64 TiB",
                self.heap_size
            ));
        }
        if !self.table_slots.is_power_of_two()
            || self.table_slots < NEIGHBORHOOD
            || self.table_slots > 1 << 31
        {
            return bad(format!(
                "table slots {} must be a power of two between 32 and 2^31",
                self.table_slots
            ));
        }
        if self.max_clients == 0 || self.max_clients > 4096 {
            return bad(format!("max_clients {} must be 1..=4096", self.max_clients));
        }
        Ok(())
    }

    /// Lays the sections out.
    pub(crate) fn layout(&self) -> Result<Layout> {
        self.check()?;
        let pages = self.heap_size / PAGE;
        let slabs = self.heap_size / SLAB;
        let partial_words = slabs.div_ceil(64);
        let client_stride = CLIENT_HEADER;
        // One 16-bit pin counter per client per slot, a row per slot padded to 64 bytes.
        let pin_stride = align_up(self.max_clients, 32);
        let mut off = PAGE;
        let mut take = |bytes: u64, align: u64| {
            off = align_up(off, align);
            let at = off;
            off += bytes;
            at
        };
        let globals_offset = take(GLOBALS_SIZE, 64);
        let wait_offset = take(WAIT_BUCKETS * 64, 64);
        let hints_offset = take(HINTS * 64, 64);
        let page_bitmap_offset = take(pages.div_ceil(64) * 8, 64);
        let page_summary_offset = take(summary_words(pages) * 8, 64);
        let page_owners_offset = take(pages * 4, 64);
        let slab_desc_offset = take(slabs * SLAB_DESC_SIZE, 64);
        let partial_offset = take(CLASSES * partial_words * 8, 64);
        let buckets_offset = take(self.table_slots * 8, 64);
        let slots_offset = take(self.table_slots * 64, 64);
        let pins_offset = take(self.table_slots * pin_stride * 2, 64);
        let clients_offset = take(self.max_clients * client_stride, 64);
        // A heap of 2 MiB or more starts on a 2 MiB boundary, so that with huge pages
        // its first page is whole (read-only attach protects it page by page).
        let heap_align = if self.heap_size >= HUGE_ALIGN_FROM {
            2 << 20
        } else {
            SLAB
        };
        let heap_offset = take(self.heap_size, heap_align);
        Ok(Superblock {
            magic: MAGIC,
            version: LAYOUT_VERSION,
            superblock_size: 256,
            total_size: off,
            heap_offset,
            heap_size: self.heap_size,
            wait_offset,
            hints_offset,
            page_bitmap_offset,
            pages,
            slab_desc_offset,
            slabs,
            partial_offset,
            partial_words,
            buckets_offset,
            slots_offset,
            table_slots: self.table_slots,
            clients_offset,
            max_clients: self.max_clients,
            pins_offset,
            client_stride,
            globals_offset,
            created_unix_ns: 0,
            flags: 0,
            pin_stride,
            page_summary_offset,
            page_owners_offset,
            _reserved: [0; 5],
            checksum: 0,
        })
    }
}

impl Superblock {
    /// blake3 over every byte before the checksum field.
    pub(crate) fn compute_checksum(&self) -> u64 {
        let bytes = bytemuck::bytes_of(self);
        let h = blake3::hash(&bytes[..bytes.len() - 8]);
        u64::from_le_bytes(h.as_bytes()[..8].try_into().expect("8 bytes"))
    }

    /// The parameters this superblock claims to be built from.
    pub(crate) fn params(&self) -> Params {
        Params {
            heap_size: self.heap_size,
            table_slots: self.table_slots,
            max_clients: self.max_clients,
        }
    }

    /// Validates a superblock read from an untrusted file of `file_len` bytes.
    ///
    /// Checks, in order: length, magic, version, checksum, then that every offset equals what
    /// the layout recomputed from the claimed parameters gives. After this passes, every
    /// section lies inside the file and no section overlaps another.
    pub(crate) fn validate(bytes: &[u8], file_len: u64, path: &Path) -> Result<Superblock> {
        let path = path.to_path_buf();
        if bytes.len() < 256 {
            if bytes.len() >= 8 && bytes[..8] != MAGIC {
                return Err(Error::NotAStore { path });
            }
            return Err(Error::Truncated {
                path,
                expected: 256,
                actual: bytes.len() as u64,
            });
        }
        let sb: Superblock = bytemuck::pod_read_unaligned(&bytes[..256]);
        if sb.magic != MAGIC {
            return Err(Error::NotAStore { path });
        }
        if sb.version != LAYOUT_VERSION {
            return Err(Error::VersionMismatch {
                path,
                found: sb.version,
                supported: LAYOUT_VERSION,
            });
        }
        if sb.checksum != sb.compute_checksum() {
            return Err(Error::Corrupted {
                what: format!("superblock checksum mismatch in {}", path.display()),
            });
        }
        let expect = sb.params().layout().map_err(|e| Error::Corrupted {
            what: format!("superblock parameters: {e}"),
        })?;
        let mut cmp = sb;
        cmp.created_unix_ns = 0;
        cmp.flags = 0;
        cmp.checksum = 0;
        if cmp != expect || sb.flags & !(FLAG_EVICT | FLAG_REMOVE_WHEN_UNUSED) != 0 {
            return Err(Error::Corrupted {
                what: "superblock section offsets disagree with its parameters".into(),
            });
        }
        if file_len < sb.total_size {
            return Err(Error::Truncated {
                path,
                expected: sb.total_size,
                actual: file_len,
            });
        }
        Ok(sb)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> Params {
        Params {
            heap_size: 1 << 24,
            table_slots: 1024,
            max_clients: 8,
        }
    }

    #[test]
    fn validate_rejects_tampering() {
        let mut sb = params().layout().unwrap();
        sb.checksum = sb.compute_checksum();
        let p = Path::new("/x");
        let ok = bytemuck::bytes_of(&sb).to_vec();
        assert!(Superblock::validate(&ok, sb.total_size, p).is_ok());
        assert!(matches!(
            Superblock::validate(&ok, sb.total_size - 1, p),
            Err(Error::Truncated { .. })
        ));
        let mut bad = ok.clone();
        bad[0] = b'X';
        assert!(matches!(
            Superblock::validate(&bad, sb.total_size, p),
            Err(Error::NotAStore { .. })
        ));
        let mut bad = ok.clone();
        bad[40] ^= 1;
        assert!(matches!(
            Superblock::validate(&bad, sb.total_size, p),
            Err(Error::Corrupted { .. })
        ));
        // Consistent checksum but inconsistent offsets.
        let mut forged = sb;
        forged.heap_offset += 64;
        forged.checksum = forged.compute_checksum();
        let forged = bytemuck::bytes_of(&forged).to_vec();
        assert!(matches!(
            Superblock::validate(&forged, sb.total_size, p),
            Err(Error::Corrupted { .. })
        ));
        let mut v = sb;
        v.version = 99;
        assert!(matches!(
            Superblock::validate(bytemuck::bytes_of(&v), sb.total_size, p),
            Err(Error::VersionMismatch { found: 99, .. })
        ));
        assert!(matches!(
            Superblock::validate(&ok[..100], 100, p),
            Err(Error::Truncated { .. })
        ));
    }

    #[test]
    fn params_out_of_range_are_config_errors() {
        let mut p = params();
        p.table_slots = 1000;
        assert!(matches!(p.layout(), Err(Error::InvalidConfig { .. })));
        let mut p = params();
        p.heap_size = 100;
        assert!(p.layout().is_err());
    }

    /// Each bound of [`Params::check`] at its edge and one step past it, with the other two
    /// parameters in range, so that every refusal is that bound's own.
    #[test]
    fn each_parameter_is_accepted_up_to_its_bound_and_refused_past_it() {
        let with = |heap_size: u64, table_slots: u64, max_clients: u64| Params {
            heap_size,
            table_slots,
            max_clients,
        };
        let (heap, slots, clients) = (1 << 24, 1024, 8);
        let accepted = [
            with(SLAB, slots, clients),
            with(1 << 46, slots, clients),
            with(heap, NEIGHBORHOOD, clients),
            with(heap, 1 << 31, clients),
            with(heap, slots, 1),
            with(heap, slots, 4096),
            // Every bound at once: the layout's arithmetic must not overflow.
            with(1 << 46, 1 << 31, 4096),
        ];
        for p in accepted {
            let l = p.layout().unwrap_or_else(|e| panic!("{p:?} refused: {e}"));
            assert_eq!(l.params(), p);
        }
        let refused = [
            (with(0, slots, clients), "capacity 0 must"),
            (with(SLAB - PAGE, slots, clients), "capacity 61440 must"),
            (with(SLAB + PAGE, slots, clients), "capacity 69632 must"),
            (
                with((1 << 46) + SLAB, slots, clients),
                "capacity 70368744243200 must",
            ),
            (with(heap, NEIGHBORHOOD / 2, clients), "table slots 16 must"),
            (with(heap, 1 << 32, clients), "table slots 4294967296 must"),
            (with(heap, 0, clients), "table slots 0 must"),
            (
                with(heap, slots + NEIGHBORHOOD, clients),
                "table slots 1056 must",
            ),
            (with(heap, slots, 0), "max_clients 0 must"),
            (with(heap, slots, 4097), "max_clients 4097 must"),
        ];
        for (p, says) in refused {
            match p.layout() {
                Err(Error::InvalidConfig { reason }) => {
                    assert!(reason.starts_with(says), "{p:?}: {reason}")
                }
                other => panic!("{p:?} must be refused, got {other:?}"),
            }
        }
    }

    /// Sections never overlap, whatever the parameters: the smallest and largest of each,
    /// heaps on either side of the 2 MiB alignment rule, and many clients (whose section
    /// is the last before the heap, so only alignment slack lies between them).
    #[test]
    fn sections_are_disjoint_for_every_shape_of_store() {
        for heap_size in [
            SLAB,
            HUGE_ALIGN_FROM - SLAB,
            HUGE_ALIGN_FROM,
            1 << 30,
            1 << 46,
        ] {
            for table_slots in [NEIGHBORHOOD, 1024, 1 << 20, 1 << 31] {
                for max_clients in [1, 33, 4096] {
                    let p = Params {
                        heap_size,
                        table_slots,
                        max_clients,
                    };
                    let l = p.layout().unwrap();
                    let mut sections = [
                        (l.globals_offset, GLOBALS_SIZE),
                        (l.wait_offset, WAIT_BUCKETS * 64),
                        (l.hints_offset, HINTS * 64),
                        (l.page_bitmap_offset, l.pages.div_ceil(64) * 8),
                        (l.page_summary_offset, summary_words(l.pages) * 8),
                        (l.page_owners_offset, l.pages * 4),
                        (l.slab_desc_offset, l.slabs * SLAB_DESC_SIZE),
                        (l.partial_offset, CLASSES * l.partial_words * 8),
                        (l.buckets_offset, table_slots * 8),
                        (l.slots_offset, table_slots * 64),
                        (l.pins_offset, table_slots * l.pin_stride * 2),
                        (l.clients_offset, max_clients * CLIENT_HEADER),
                        (l.heap_offset, heap_size),
                    ];
                    sections.sort();
                    let mut end = PAGE;
                    for (off, len) in sections {
                        assert!(
                            off >= end,
                            "{p:?}: section at {off} overlaps one ending at {end}"
                        );
                        assert_eq!(off % 64, 0, "{p:?}: a section starts mid cache line");
                        end = off + len;
                    }
                    assert_eq!(end, l.total_size, "{p:?}");
                    assert!(l.pin_stride >= max_clients, "{p:?}: a pin row per client");
                    let align = if heap_size >= HUGE_ALIGN_FROM {
                        2 << 20
                    } else {
                        SLAB
                    };
                    assert_eq!(l.heap_offset % align, 0, "{p:?}");
                }
            }
        }
    }

    /// The layout is the file format: a store made by one build is opened by another build
    /// of the same `LAYOUT_VERSION`, so the same parameters must give the same offsets and
    /// checksum in every build. If a change moves any of these numbers, it is an
    /// incompatible change: bump `LAYOUT_VERSION`, and then update them.
    #[test]
    fn the_layout_of_this_version_does_not_change() {
        let frozen = |p: Params, offsets: [u64; 14], total_size: u64, checksum: u64| {
            let mut l = p.layout().unwrap();
            l.checksum = l.compute_checksum();
            let got = [
                l.globals_offset,
                l.wait_offset,
                l.hints_offset,
                l.page_bitmap_offset,
                l.page_summary_offset,
                l.page_owners_offset,
                l.slab_desc_offset,
                l.partial_offset,
                l.buckets_offset,
                l.slots_offset,
                l.pins_offset,
                l.clients_offset,
                l.heap_offset,
                l.pin_stride,
            ];
            assert_eq!(got, offsets, "{p:?}");
            assert_eq!(l.total_size, total_size, "{p:?}");
            assert_eq!(l.checksum, checksum, "{p:?}");
            assert_eq!(LAYOUT_VERSION, 7);
        };
        frozen(
            params(),
            [
                4096, 4608, 20992, 23232, 23744, 23808, 40192, 75008, 76032, 84224, 149760, 215296,
                2097152, 32,
            ],
            18874368,
            15031520921986134105,
        );
        // The smallest store: its heap follows the sections on a 64 KiB boundary, so the
        // whole file is 128 KiB.
        frozen(
            Params {
                heap_size: SLAB,
                table_slots: NEIGHBORHOOD,
                max_clients: 1,
            },
            [
                4096, 4608, 20992, 23232, 23296, 23360, 23424, 23616, 23872, 24128, 26176, 28224,
                65536, 32,
            ],
            131072,
            5793638869628457085,
        );
    }

    /// The checksum covers every byte before it: changing any one of them (past the magic
    /// and version, which have their own errors) is refused as a checksum mismatch, even
    /// where the change is one the layout check alone would let through (creation time,
    /// flags, reserved words).
    #[test]
    fn a_change_to_any_checksummed_byte_is_refused_as_a_checksum_mismatch() {
        let mut sb = params().layout().unwrap();
        sb.created_unix_ns = 1_700_000_000_000_000_000;
        sb.flags = FLAG_EVICT;
        sb.checksum = sb.compute_checksum();
        let ok = bytemuck::bytes_of(&sb).to_vec();
        let p = Path::new("/x");
        assert!(Superblock::validate(&ok, sb.total_size, p).is_ok());
        for at in 12..248 {
            let mut bad = ok.clone();
            bad[at] ^= 0x10;
            match Superblock::validate(&bad, u64::MAX, p) {
                Err(Error::Corrupted { what }) => {
                    assert!(what.contains("checksum mismatch"), "byte {at}: {what}")
                }
                other => panic!("byte {at} changed: {other:?}"),
            }
        }
        // The same holds for a change the writer made and signed: a new flag bit is
        // refused by the flags check, not let through.
        let mut unknown_flag = sb;
        unknown_flag.flags |= 4;
        unknown_flag.checksum = unknown_flag.compute_checksum();
        assert!(matches!(
            Superblock::validate(bytemuck::bytes_of(&unknown_flag), sb.total_size, p),
            Err(Error::Corrupted { .. })
        ));
    }
}
