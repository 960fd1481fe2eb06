//! Shared helpers for tollgate's criterion benches (see `benches/`).
//!
//! Run them with `cargo bench -p tollgate-benches`; the figures and how to
//! read them are in this folder's README.

/// `n` distinct pseudo-random 16-byte keys (SplitMix64), the same on every
/// run so results compare run to run.
pub fn keys(n: usize, seed: u64) -> Vec<[u8; 16]> {
    let mut state = seed;
    let mut next = move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    (0..n)
        .map(|_| {
            let mut key = [0u8; 16];
            key[..8].copy_from_slice(&next().to_le_bytes());
            key[8..].copy_from_slice(&next().to_le_bytes());
            key
        })
        .collect()
}
