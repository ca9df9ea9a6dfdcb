//! `ObjectId`: the 32-byte name of an object.
//!
//! Ids are content hashes (blake3 of the bytes) or key hashes (blake3 of a key such as vLLM's
//! `mm_hash`), so they are uniformly distributed; the table still mixes all 32 bytes when it
//! hashes one, so structured ids chosen by hand spread just as well.

use std::fmt;
use std::str::FromStr;

/// A 32-byte object id. Displays and parses as 64 lowercase hex digits.
///
/// ```
/// use shmstore::ObjectId;
/// let a = ObjectId::of_content(b"pixels");
/// assert_eq!(a, ObjectId::of_content(b"pixels"));
/// let parsed: ObjectId = a.to_string().parse().unwrap();
/// assert_eq!(parsed, a);
/// assert_ne!(ObjectId::of_key("img-1"), ObjectId::of_key("img-2"));
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectId([u8; 32]);

impl ObjectId {
    /// Wraps 32 raw bytes.
    ///
    /// ```
    /// let id = shmstore::ObjectId::from_bytes([7; 32]);
    /// assert_eq!(id.as_bytes(), &[7; 32]);
    /// ```
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The blake3 hash of `content`: the same bytes always get the same id.
    ///
    /// ```
    /// let id = shmstore::ObjectId::of_content(&[1, 2, 3]);
    /// assert_eq!(id.as_bytes(), blake3::hash(&[1, 2, 3]).as_bytes());
    /// ```
    pub fn of_content(content: &[u8]) -> Self {
        Self(*blake3::hash(content).as_bytes())
    }

    /// The blake3 hash of a key, such as vLLM's `mm_hash` string. Domain-separated from
    /// [`of_content`](Self::of_content), so a key never collides with content that spells it.
    ///
    /// ```
    /// use shmstore::ObjectId;
    /// assert_ne!(ObjectId::of_key("abc"), ObjectId::of_content(b"abc"));
    /// ```
    pub fn of_key(key: impl AsRef<[u8]>) -> Self {
        let mut h = blake3::Hasher::new_derive_key("shmstore 2026 object key");
        h.update(key.as_ref());
        Self(*h.finalize().as_bytes())
    }

    /// The raw bytes.
    ///
    /// ```
    /// assert_eq!(shmstore::ObjectId::from_bytes([0; 32]).as_bytes().len(), 32);
    /// ```
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The id as four little-endian words, as the table stores it.
    pub(crate) fn words(&self) -> [u64; 4] {
        let mut w = [0u64; 4];
        for (i, chunk) in self.0.chunks_exact(8).enumerate() {
            w[i] = u64::from_le_bytes(chunk.try_into().expect("8-byte chunk"));
        }
        w
    }

    /// Rebuilds an id from the table's four words.
    pub(crate) fn from_words(w: [u64; 4]) -> Self {
        let mut b = [0u8; 32];
        for (i, word) in w.iter().enumerate() {
            b[i * 8..i * 8 + 8].copy_from_slice(&word.to_le_bytes());
        }
        Self(b)
    }

    /// A 64-bit hash mixing all 32 bytes (table home bucket and wait bucket).
    ///
    /// Every bit of every byte must reach the low bits, which pick the home: ids are often
    /// blake3 output, but [`from_bytes`](Self::from_bytes) takes any bytes, such as a counter
    /// written big-endian into the last bytes. A multiply only carries bits upwards, so each
    /// word is folded in and then the whole state goes through splitmix64's finaliser
    /// (shift-xor, multiply, shift-xor, multiply, shift-xor), which brings every input bit to
    /// every output bit. The home is part of the file format: changing this function needs a
    /// new `LAYOUT_VERSION`.
    pub(crate) fn mix(&self) -> u64 {
        let w = self.words();
        let mut h = 0x9e37_79b9_7f4a_7c15u64;
        for x in w {
            h = (h ^ x).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            h ^= h >> 31;
        }
        h ^= h >> 30;
        h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
        h ^= h >> 27;
        h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
        h ^ (h >> 31)
    }
}

impl fmt::Display for ObjectId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for ObjectId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ObjectId({self})")
    }
}

/// Why a string is not an [`ObjectId`].
///
/// ```
/// assert!("xyz".parse::<shmstore::ObjectId>().is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseObjectIdError {
    /// The length of the rejected string.
    pub len: usize,
}

impl fmt::Display for ParseObjectIdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "an object id is 64 hex digits; got {} characters that are not all hex",
            self.len
        )
    }
}

impl std::error::Error for ParseObjectIdError {}

impl FromStr for ObjectId {
    type Err = ParseObjectIdError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = ParseObjectIdError { len: s.len() };
        let s = s.as_bytes();
        if s.len() != 64 {
            return Err(err);
        }
        let nib = |c: u8| match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            b'A'..=b'F' => Some(c - b'A' + 10),
            _ => None,
        };
        let mut out = [0u8; 32];
        for (i, o) in out.iter_mut().enumerate() {
            let hi = nib(s[2 * i]).ok_or(err.clone())?;
            let lo = nib(s[2 * i + 1]).ok_or(err.clone())?;
            *o = hi << 4 | lo;
        }
        Ok(Self(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip_and_errors() {
        let id = ObjectId::of_key("mm_hash:1234");
        let s = id.to_string();
        assert_eq!(s.len(), 64);
        assert_eq!(s.parse::<ObjectId>().unwrap(), id);
        assert_eq!(s.to_uppercase().parse::<ObjectId>().unwrap(), id);
        assert!(s[..63].parse::<ObjectId>().is_err());
        let mut bad = s.clone();
        bad.replace_range(10..11, "g");
        assert!(bad.parse::<ObjectId>().is_err());
    }

    #[test]
    fn words_round_trip() {
        let id = ObjectId::of_content(b"x");
        assert_eq!(ObjectId::from_words(id.words()), id);
    }

    /// Distinct homes in a table of 2^16 slots for 2^16 ids that carry a counter `i` written
    /// by `place`. Random homes would give 1 - 1/e of the table: about 41,400.
    fn homes_of(place: impl Fn(&mut [u8; 32], u64)) -> usize {
        let mut hit = vec![false; 1 << 16];
        for i in 0u64..1 << 16 {
            let mut b = [0u8; 32];
            place(&mut b, i);
            hit[(ObjectId::from_bytes(b).mix() & 0xffff) as usize] = true;
        }
        hit.iter().filter(|h| **h).count()
    }

    #[test]
    #[cfg_attr(
        miri,
        ignore = "half a million hashes, no unsafe code: minutes under miri, nothing to find"
    )]
    fn mix_spreads_structured_ids() {
        // A counter anywhere in the id, in either byte order, must spread like random
        // homes. Until layout version 7, a big-endian counter in the last bytes (so only
        // the top bits of the last word changed) gave every id the same home, and the 33rd
        // such object found its neighbourhood full.
        for word in 0..4 {
            let at = word * 8;
            for (order, homes) in [
                (
                    "little-endian",
                    homes_of(|b, i| b[at..at + 8].copy_from_slice(&i.to_le_bytes())),
                ),
                (
                    "big-endian",
                    homes_of(|b, i| b[at..at + 8].copy_from_slice(&i.to_be_bytes())),
                ),
            ] {
                assert!(
                    homes > 40_000,
                    "{order} counter in bytes {at}..: only {homes} homes"
                );
            }
        }
        // The top byte of each word alone: 256 ids must not share a few homes.
        for word in 0..4 {
            let mut hit = std::collections::HashSet::new();
            for v in 0..=255u8 {
                let mut b = [0u8; 32];
                b[word * 8 + 7] = v;
                hit.insert(ObjectId::from_bytes(b).mix() & 0xffff);
            }
            assert!(
                hit.len() > 250,
                "top byte of word {word}: {} homes",
                hit.len()
            );
        }
    }

    /// An id's home is part of the file format (a store made by one build is read by
    /// another), so `mix` must give the same value in every build of one layout version.
    /// If this changes, bump `LAYOUT_VERSION`, then update the values.
    #[test]
    fn mix_of_this_layout_version_does_not_change() {
        for (id, mixed) in [
            (ObjectId::from_bytes([0; 32]), 0x54f0_b270_b71d_ae50),
            (ObjectId::from_bytes([0xff; 32]), 0x5075_d0c2_05c7_b232),
            (ObjectId::of_key("mm_hash:1234"), 0xf265_099b_7580_6d15),
        ] {
            assert_eq!(id.mix(), mixed, "{id}");
        }
        assert_eq!(crate::layout::LAYOUT_VERSION, 7);
    }

    #[test]
    fn debug_and_parse_error_say_what_they_are() {
        let id = ObjectId::of_key("k");
        assert_eq!(format!("{id:?}"), format!("ObjectId({id})"));
        let err = "abc".parse::<ObjectId>().unwrap_err();
        assert_eq!(err, ParseObjectIdError { len: 3 });
        assert_eq!(
            err.to_string(),
            "an object id is 64 hex digits; got 3 characters that are not all hex"
        );
    }

    #[test]
    fn every_hex_digit_parses_to_its_value() {
        // Each byte is two digits, high then low, in every case the parser accepts.
        let digits = "0123456789abcdef";
        for hi in 0..16 {
            let s: String = (0..32)
                .flat_map(|lo| {
                    let d = |n: usize| digits.as_bytes()[n % 16] as char;
                    [d(hi), d(lo)]
                })
                .collect();
            let id: ObjectId = s.parse().unwrap();
            for (lo, b) in id.as_bytes().iter().enumerate() {
                assert_eq!(*b as usize, hi * 16 + lo % 16, "{s}");
            }
            assert_eq!(s.to_uppercase().parse::<ObjectId>().unwrap(), id);
        }
    }
}
