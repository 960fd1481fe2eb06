//! Keys as the table stores them: a 128-bit keyed hash of the client key.

use std::hash::{BuildHasher, Hasher};

use siphasher::sip::SipHasher13;

/// A client key as stored: SipHash-1-3 (64-bit) under a per-store random
/// secret, so keys of any length cost 8 bytes, raw keys (personal data)
/// are never kept, and without the secret nobody can aim a key at
/// another's slot. Two keys share a slot only by accident (about n² / 2⁶³
/// for n live keys, a slot being 62 bits of the hash: one in 9 million
/// for a million keys), and then they
/// share one budget: stricter, never looser.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KeyHash {
    /// Picks the shard: bits 40 and up of the hash, which the table uses
    /// neither for its bucket index (low bits) nor its tag (top 7 bits).
    pub(crate) shard: u64,
    /// The key within the shard's table: the hash with bits 38 and 39
    /// clear, bits that neither the bucket index of a shard's table (fewer
    /// than 2³⁸ buckets) nor the shard nor the tag (the top 7 bits) reads,
    /// so a concurrency lease's id can say where its key is, and more
    /// ([`lease_id`](Self::lease_id)).
    pub(crate) slot: u64,
}

/// The bits of a [`KeyHash::slot`] that are always clear.
const FREE: u64 = 0b11 << 38;

impl KeyHash {
    /// The hash whose slot is `slot` (with the free bits cleared).
    fn from_slot(slot: u64) -> Self {
        let slot = slot & !FREE;
        Self {
            shard: slot >> 40,
            slot,
        }
    }

    /// A lease id that says where this key is kept and whether the
    /// permits were counted in the shard's overflow state; its top bit is
    /// always clear (free for a wrapping store's own mark).
    pub(crate) fn lease_id(self, overflow: bool) -> u64 {
        (self.slot & !(1 << 63)) | ((self.slot >> 63) << 39) | (u64::from(overflow) << 38)
    }

    /// The key and the overflow flag of a [`lease_id`](Self::lease_id).
    pub(crate) fn from_lease_id(id: u64) -> (Self, bool) {
        let slot = (id & !FREE & !(1 << 63)) | (((id >> 39) & 1) << 63);
        (Self::from_slot(slot), id & (1 << 38) != 0)
    }
}

#[derive(Debug, Clone)]
pub(crate) struct KeyHasher {
    hasher: SipHasher13,
    /// Tells this hasher's remembered hashes from another's
    /// ([`hash_few`](Self::hash_few)); unique in the process.
    id: u64,
}

/// How many hashes a thread remembers for [`KeyHasher::hash_few`].
const FEW: usize = 4;

/// The longest key whose hash is remembered.
const FEW_LEN: usize = 64;

/// A remembered hash: which hasher, the key, its hash.
#[derive(Clone, Copy)]
struct Remembered {
    hasher: u64,
    len: u8,
    key: [u8; FEW_LEN],
    hash: KeyHash,
}

impl KeyHasher {
    /// A hasher with a fresh random secret (from the standard library's
    /// per-process random hash keys).
    pub(crate) fn random() -> Self {
        static IDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let seed = std::collections::hash_map::RandomState::new();
        Self {
            hasher: SipHasher13::new_with_keys(
                seed.hash_one(0x746f_6c6c_u64),
                seed.hash_one(0x6761_7465_u64),
            ),
            id: IDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        }
    }

    /// [`hash`](Self::hash) for tables of few keys each used over and over
    /// (a retry budget's upstreams, deposited into on every call): the
    /// last [`FEW`] keys hashed on this thread are remembered, so a key
    /// found there costs a comparison of its bytes instead of a keyed
    /// SipHash. Keys over [`FEW_LEN`] bytes are hashed every time.
    #[inline]
    pub(crate) fn hash_few(&self, key: &[u8]) -> KeyHash {
        thread_local! {
            static RECENT: std::cell::RefCell<([Option<Remembered>; FEW], usize)> =
                const { std::cell::RefCell::new(([None; FEW], 0)) };
        }
        let Some(len) = u8::try_from(key.len())
            .ok()
            .filter(|&len| usize::from(len) <= FEW_LEN)
        else {
            return self.hash(key);
        };
        let found = RECENT.try_with(|recent| {
            let recent = recent.try_borrow().ok()?;
            recent.0.iter().flatten().find_map(|e| {
                (e.hasher == self.id && e.len == len && e.key.get(..key.len()) == Some(key))
                    .then_some(e.hash)
            })
        });
        if let Ok(Some(hash)) = found {
            return hash;
        }
        let hash = self.hash(key);
        let _ = RECENT.try_with(|recent| {
            let Ok(mut recent) = recent.try_borrow_mut() else {
                return;
            };
            let (entries, next) = &mut *recent;
            let mut bytes = [0; FEW_LEN];
            if let Some(dst) = bytes.get_mut(..key.len()) {
                dst.copy_from_slice(key);
            }
            if let Some(slot) = entries.get_mut(*next % FEW) {
                *slot = Some(Remembered {
                    hasher: self.id,
                    len,
                    key: bytes,
                    hash,
                });
            }
            *next = next.wrapping_add(1);
        });
        hash
    }

    #[inline]
    pub(crate) fn hash(&self, key: &[u8]) -> KeyHash {
        KeyHash::from_slot(self.hasher.hash(key))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembered_hashes_are_each_hashers_own() {
        // Two stores' hashers (other secrets), keys short and long, more
        // keys than a thread remembers, each asked for again and again:
        // always the hasher's own hash of that key.
        let (a, b) = (KeyHasher::random(), KeyHasher::random());
        let keys: Vec<Vec<u8>> = (0..3 * FEW)
            .map(|i| vec![b'k'; 1 + i * 9])
            .chain([
                Vec::new(),
                vec![b'x'; FEW_LEN],
                vec![b'x'; FEW_LEN + 1],
                vec![b'y'; 300],
            ])
            .collect();
        for _ in 0..3 {
            for key in &keys {
                for h in [&a, &b] {
                    assert_eq!(h.hash_few(key), h.hash(key));
                }
                // The same key twice in a row: found, and still right.
                assert_eq!(a.hash_few(key), a.hash(key));
            }
        }
        // Keys that share a prefix, or differ only in length.
        for key in [&b"upstream"[..], b"upstream:80", b"upstrea", b"upstream\0"] {
            assert_eq!(a.hash_few(key), a.hash(key));
        }
    }

    #[test]
    fn a_lease_id_says_where_its_key_is_and_nothing_else() {
        // Hashes with every one of the bits the encoding moves (63, 39,
        // 38) set or clear, and a store's hashes of real keys.
        let h = KeyHasher::random();
        let mut slots: Vec<u64> = (0..1_000u32)
            .map(|i| h.hash(&i.to_le_bytes()).slot)
            .collect();
        slots.extend([
            0,
            u64::MAX,
            1 << 63,
            1 << 39,
            1 << 38,
            0x8000_00c0_0000_0001,
        ]);
        for raw in slots {
            let hash = KeyHash::from_slot(raw);
            assert_eq!(hash.slot & FREE, 0, "a slot's free bits are clear");
            assert_eq!(hash.shard, hash.slot >> 40);
            for overflow in [false, true] {
                let id = hash.lease_id(overflow);
                assert_eq!(id >> 63, 0, "the top bit is left to a wrapping store");
                assert_eq!(KeyHash::from_lease_id(id), (hash, overflow));
            }
        }
        // Slots that differ only in bit 63 give different ids.
        let (a, b) = (KeyHash::from_slot(5), KeyHash::from_slot(5 | 1 << 63));
        assert_ne!(a.lease_id(false), b.lease_id(false));
    }
}
