//! Keys as the table stores them: a 128-bit keyed hash of the client key.

use std::hash::{BuildHasher, Hash, Hasher};

use siphasher::sip128::SipHasher13;

/// A client key as stored: SipHash-1-3 (128-bit) under a per-store random
/// secret. Keys of any length cost 16 bytes, raw keys (personal data) are
/// never kept, and without the secret an attacker cannot aim two keys at
/// one slot. Two `u64`s rather than a `u128` so an entry is 24 bytes
/// (8-byte aligned), not 32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KeyHash {
    /// Picks the shard.
    pub(crate) shard: u64,
    /// Feeds the table's hasher.
    pub(crate) slot: u64,
}

impl Hash for KeyHash {
    #[inline]
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.slot);
    }
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
            shard: h.h1,
            slot: h.h2,
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
        // Only `write_u64` is used by `KeyHash`; fold anything else in.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
}

pub(crate) type BuildIdentity = std::hash::BuildHasherDefault<Identity>;
