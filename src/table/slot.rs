//! The shared-memory words of one table slot: the control word [`Ctl`] (state, owner or
//! tag, generation), the slot's cache line [`Slot`], and the [`Entry`] it holds (which block
//! of the heap, how much metadata, who created it).
//!
//! Invariants: a slot is exactly one 64-byte cache line, all zeroes is a FREE slot at
//! generation 0, and everything read from a slot is untrusted (another process may be
//! buggy): [`Entry::block`] validates an entry against the heap before the store uses it.
//! The state machine these words move through is in the parent module's header and
//! docs/design.md, "Object state machine".

use crate::alloc::{Block, BlockKind, CLASS_SIZES};
use crate::error::{Error, Result};
use crate::layout::{MAX_META, PAGE};
use crate::sync::AtomicU64;

/// Slot states (low 3 bits of `ctl`).
pub(crate) const FREE: u64 = 0;
pub(crate) const RESERVED: u64 = 1;
pub(crate) const CREATING: u64 = 2;
pub(crate) const SEALED: u64 = 3;
pub(crate) const DELETED: u64 = 4;
pub(crate) const EVICTING: u64 = 5;
pub(crate) const FREEING: u64 = 6;

/// `ctl` word helpers: `gen << 32 | owner << 3 | state`, `owner` = client index + 1 in
/// RESERVED and FREEING; in DELETED a never-sealed flag (bit 28 of the field: an
/// aborted creation) and a tag that adoptions move on ([`Ctl::retagged`]); 0 otherwise.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Ctl(pub u64);

/// The 29-bit middle field of a `ctl` word.
pub(super) const OWNER_MASK: u64 = (1 << 29) - 1;
/// In a DELETED word's middle field: the entry was never sealed (an aborted creation).
/// Draining lookups skip it ([`super::Table::pin_draining`]).
pub(super) const NEVER_SEALED: u64 = 1 << 28;
/// The rest of a DELETED word's middle field: the adoption tag.
pub(super) const TAG_MASK: u64 = NEVER_SEALED - 1;

impl Ctl {
    pub(crate) fn new(state: u64, owner: Option<u16>, gen: u32) -> Self {
        let o = owner.map_or(0, |c| c as u64 + 1);
        Ctl((gen as u64) << 32 | o << 3 | state)
    }
    pub(crate) fn state(self) -> u64 {
        self.0 & 7
    }
    /// The client in the middle of changing this slot (RESERVED or FREEING).
    pub(crate) fn owner(self) -> Option<u64> {
        let o = (self.0 >> 3) & OWNER_MASK;
        o.checked_sub(1)
    }
    /// The same word with DELETED's tag moved on by one, wrapping: what an adoption
    /// writes so that a freer's CAS on the word it read fails ([`super::Table::repin`]). State,
    /// generation and the never-sealed flag are unchanged.
    pub(crate) fn retagged(self) -> Ctl {
        let tag = ((self.0 >> 3) + 1) & TAG_MASK;
        Ctl(self.0 & !(TAG_MASK << 3) | tag << 3)
    }
    /// The DELETED word of an entry at `gen`; `sealed`: whether it ever was (a delete or
    /// an eviction), or not (an abort).
    pub(super) fn deleted(gen: u32, sealed: bool) -> Ctl {
        let c = Ctl::new(DELETED, None, gen);
        if sealed {
            c
        } else {
            Ctl(c.0 | NEVER_SEALED << 3)
        }
    }
    /// In a DELETED word: the entry was never sealed (an aborted creation).
    pub(crate) fn never_sealed(self) -> bool {
        (self.0 >> 3) & NEVER_SEALED != 0
    }
    pub(crate) fn gen(self) -> u32 {
        (self.0 >> 32) as u32
    }
    /// Found by lookups: being created or readable.
    pub(super) fn live(self) -> bool {
        matches!(self.state(), CREATING | SEALED | EVICTING)
    }
    /// Readable (EVICTING is SEALED with an eviction attempt in flight).
    pub(crate) fn sealed(self) -> bool {
        matches!(self.state(), SEALED | EVICTING)
    }
}

/// One table entry (one cache line).
#[repr(C, align(64))]
#[derive(Default)]
pub(crate) struct Slot {
    pub(super) ctl: AtomicU64,
    pub(super) id: [AtomicU64; 4],
    pub(super) offset: AtomicU64,
    pub(super) len: AtomicU64,
    pub(super) info: AtomicU64,
}

const _: () = assert!(std::mem::size_of::<Slot>() == 64);

/// `info` flag: the object was used since the clock hand last passed (CLOCK's second chance).
pub(crate) const INFO_REFERENCED: u64 = 1 << 40;
/// `info` flag: never evict this object.
pub(crate) const INFO_NO_EVICT: u64 = 1 << 41;

/// What a slot says about the block it owns. Untrusted: validated by the store before use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub(crate) struct Entry {
    /// Heap offset of the block.
    pub offset: u64,
    /// Payload length.
    pub len: u64,
    /// Metadata length (stored before the payload, padded to 64).
    pub meta_len: u16,
    /// Allocator block kind, encoded.
    pub kind: u8,
    /// Client slot of the creator.
    pub creator: u16,
}

impl Entry {
    /// Validates an entry read from shared memory against a heap of `heap_size` bytes and
    /// returns its block and the padded metadata length. Pure arithmetic, all checked.
    pub(crate) fn block(&self, heap_size: u64) -> Result<(Block, u64)> {
        let bad = || Error::Corrupted {
            what: format!("table entry {self:?} does not describe a block in the heap"),
        };
        let kind = BlockKind::decode(self.kind).ok_or_else(bad)?;
        if self.meta_len as u64 > MAX_META || self.offset % 64 != 0 {
            return Err(bad());
        }
        let meta_pad = (self.meta_len as u64).div_ceil(64) * 64;
        let need = meta_pad.checked_add(self.len).ok_or_else(bad)?.max(1);
        let size = match kind {
            BlockKind::Pages => need.div_ceil(PAGE).checked_mul(PAGE).ok_or_else(bad)?,
            BlockKind::Slab(c) => CLASS_SIZES[c as usize],
        };
        if need > size
            || self
                .offset
                .checked_add(size)
                .is_none_or(|end| end > heap_size)
        {
            return Err(bad());
        }
        let block = Block {
            offset: self.offset,
            size,
            kind,
        };
        Ok((block, meta_pad))
    }

    pub(super) fn info(&self) -> u64 {
        self.meta_len as u64 | (self.kind as u64) << 16 | (self.creator as u64) << 24
    }
    pub(crate) fn from_parts(offset: u64, len: u64, info: u64) -> Self {
        Entry {
            offset,
            len,
            meta_len: info as u16,
            kind: (info >> 16) as u8,
            creator: (info >> 24) as u16,
        }
    }
}
