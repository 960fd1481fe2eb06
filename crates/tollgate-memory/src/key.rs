//! Keys as the table stores them: a 128-bit keyed hash of the client key.

use std::hash::{BuildHasher, Hasher};

use siphasher::sip::SipHasher13;

/// A client key as stored: SipHash-1-3 (64-bit) under a per-store random
/// secret, so keys of any length cost 8 bytes, raw keys (personal data)
/// are never kept, and without the secret nobody can aim a key at
/// another's slot. Two keys share a slot only by accident (about n² / 2⁶⁵
/// for n live keys: one in 37 million for a million keys), and then they
/// share one budget: stricter, never looser.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KeyHash {
    /// Picks the shard: bits 40 and up of the hash, which the table uses
    /// neither for its bucket index (low bits) nor its tag (top 7 bits).
    pub(crate) shard: u64,
    /// The key within the shard's table.
    pub(crate) slot: u64,
}

#[derive(Debug, Clone)]
pub(crate) struct KeyHasher(SipHasher13);

impl KeyHasher {
    /// A hasher with a fresh random secret (from the standard library's
    /// per-process random hash keys).
    pub(crate) fn random() -> Self {
        let seed = std::collections::hash_map::RandomState::new();
        Self(SipHasher13::new_with_keys(
            seed.hash_one(0x746f_6c6c_u64),
            seed.hash_one(0x6761_7465_u64),
        ))
    }

    #[inline]
    pub(crate) fn hash(&self, key: &[u8]) -> KeyHash {
        let h = self.0.hash(key);
        KeyHash {
            shard: h >> 40,
            slot: h,
        }
    }
}

/// The table's hasher: the key is already a uniform hash, so pass it on.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Identity(u64);

impl Hasher for Identity {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }

    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is used (the keys are `u64`); fold anything else in.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
}

pub(crate) type BuildIdentity = std::hash::BuildHasherDefault<Identity>;
