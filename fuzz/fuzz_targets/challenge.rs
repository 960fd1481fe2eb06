//! `ProofOfWork::verify` on arbitrary solutions: never a panic, never an
//! acceptance of something that is not a solution of this scope's current
//! (or previous) challenge with enough work — checked by rebuilding what
//! an accepted solution must be. Also mutated real solutions: another
//! scope, a changed challenge, a stripped nonce.
#![no_main]

use std::time::Duration;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use tollgate::core::ManualClock;
use tollgate::policy::{Challenge, ProofOfWork};

#[derive(Debug, Arbitrary)]
struct Input {
    secret: [u8; 16],
    bits: u8,
    window: u16,
    at: u64,
    scope: Vec<u8>,
    other_scope: Vec<u8>,
    solution: Vec<u8>,
    flip: (u8, u8),
}

fuzz_target!(|input: Input| {
    let bits = input.bits % 6 + 1; // cheap enough to solve here
    let window = Duration::from_secs(u64::from(input.window % 3_600) + 1);
    let clock = ManualClock::at_unix(input.at % (1 << 62));
    let Ok(pow) = ProofOfWork::new(&input.secret, bits, window) else {
        return;
    };
    let pow = pow.clock(clock);
    // Arbitrary bytes: accepted only if they are a solution of this
    // scope's challenge, with enough work.
    if let Some(id) = pow.verify(&input.scope, &input.solution) {
        let text = std::str::from_utf8(&input.solution).expect("accepted as text");
        let (challenge, nonce) = text.rsplit_once('.').expect("a nonce");
        assert!(!nonce.is_empty() && nonce.len() <= 64);
        assert!(ProofOfWork::leading_zero_bits(&input.solution) >= u32::from(bits));
        assert!(challenge.starts_with("pow1."));
        assert_eq!(pow.verify(&input.scope, &input.solution), Some(id));
    }
    // A real solution: accepted for its scope, its id stable; never for
    // another scope; a flipped byte is either refused or still a valid
    // solution of the same challenge (a nonce byte), never another one's.
    let challenge = pow.issue(&input.scope);
    let solution = ProofOfWork::solve(&challenge, 8).expect("solvable");
    let id = pow
        .verify(&input.scope, solution.as_bytes())
        .expect("its own solution");
    if input.other_scope != input.scope {
        assert!(pow
            .verify(&input.other_scope, solution.as_bytes())
            .is_none());
    }
    let mut flipped = solution.clone().into_bytes();
    let at = usize::from(input.flip.0) % flipped.len();
    flipped[at] ^= input.flip.1 | 1;
    if let Some(other) = pow.verify(&input.scope, &flipped) {
        assert_eq!(other, id, "a changed challenge must not verify");
        assert!(at > challenge.len(), "only the nonce may change");
    }
    // The challenge alone is no solution.
    assert!(pow.verify(&input.scope, challenge.as_bytes()).is_none());
});
