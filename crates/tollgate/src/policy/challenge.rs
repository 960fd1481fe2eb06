//! Challenges: the step of an escalation between a refusal and a block.
//! Past a rule's limit, the refusal carries a challenge bound to the
//! rule, the client's key and a time window; a request that carries a
//! solution passes that rule (each solution once), and one that does not
//! is refused — and, on a rule with a ladder, strikes toward a block.

use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};
use tollgate_core::{Clock, ConfigError, SystemClock};

/// The header a refusal carries a challenge in.
pub const CHALLENGE_HEADER: &str = "tollgate-challenge";

/// The header a client sends a solution back in.
pub const SOLUTION_HEADER: &str = "tollgate-solution";

/// A challenge a client must solve to pass a rule it is over. Issued for
/// a scope — the rule's name and the client's key — and checked against
/// it, so a solution is good for one rule and one client only.
/// Implementations should be stateless, so that any instance of a fleet
/// checks what another issued; the policy makes each solution good once
/// (see [`RateRule::challenge`](super::RateRule::challenge)).
pub trait Challenge: Send + Sync + 'static {
    /// The challenge for `scope` now, as the refusal's
    /// `Tollgate-Challenge` header carries it (visible ASCII).
    fn issue(&self, scope: &[u8]) -> String;

    /// Whether `solution` (a `Tollgate-Solution` header of the client's)
    /// solves a challenge issued for `scope` that is still good: an id of
    /// the challenge it solves — the same for every solution of one
    /// challenge, so that the policy lets each challenge pass once, however
    /// many solutions a client finds — or `None`.
    fn verify(&self, scope: &[u8], solution: &[u8]) -> Option<[u8; 16]>;

    /// How long a challenge can stay good, clocks' skew included: the
    /// policy remembers a used one this long.
    fn lifetime(&self) -> Duration;
}

/// A proof of work: a hash puzzle of tunable difficulty, stateless.
///
/// The challenge is `pow1.<window>.<difficulty>.<mac>`: the number of the
/// current time window, the difficulty in bits, and a MAC (HMAC-SHA-256,
/// truncated to 128 bits, under a secret every instance shares) of the
/// scope, the window and the difficulty. A solution is the challenge, a
/// dot and a nonce of 1 to 64 characters `A-Z a-z 0-9 - _`, whose
/// SHA-256 starts with `difficulty` zero bits; a client finds one by
/// trying nonces, about 2^difficulty hashes on average (16 bits: ~65,000
/// hashes, some milliseconds in a browser's WebCrypto; each bit doubles
/// it).
///
/// How strong that is: a GPU computes 10^9 to 10^10 SHA-256 a second, so
/// 16 bits cost it some tens of microseconds, 24 bits (~16.8 million
/// hashes, about 1-3 s in a browser) some milliseconds, 28 bits (~268
/// million, too slow for a phone) a tenth of a second. Work alone does not
/// stop a script with a GPU; what bounds it is that a pass is good once
/// per rule, key, requester address and window: more guesses need more
/// addresses, which the policy's per-address rules count. Choose the
/// difficulty (1 to 32 bits) for the slowest device your users solve on. A challenge is good in its window and the next, and passes once
/// (a policy remembers it): one pass per rule, key and window, however
/// many nonces a client finds.
///
/// ```
/// use std::time::Duration;
/// use tollgate::policy::{Challenge, ProofOfWork};
///
/// let pow = ProofOfWork::new(b"a secret every instance shares!!", 8, Duration::from_secs(60))?;
/// let challenge = pow.issue(b"login\0alice");
/// // The client's work:
/// let solution = ProofOfWork::solve(&challenge, 20).unwrap();
/// assert!(pow.verify(b"login\0alice", solution.as_bytes()).is_some());
/// assert!(pow.verify(b"login\0mallory", solution.as_bytes()).is_none());
/// # Ok::<(), tollgate::core::ConfigError>(())
/// ```
#[derive(Clone)]
pub struct ProofOfWork {
    key: [u8; 64],
    difficulty: u8,
    window: u64,
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for ProofOfWork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProofOfWork")
            .field("difficulty", &self.difficulty)
            .field("window_secs", &self.window)
            .finish_non_exhaustive()
    }
}

impl ProofOfWork {
    /// Puzzles of `difficulty` bits (1 to 32), bound to windows of
    /// `window` (whole seconds, 1 s to 1 h), signed with `secret` (16 to
    /// 64 bytes; the same on every instance, so that any of them checks
    /// what another issued). Errors name the field.
    pub fn new(secret: &[u8], difficulty: u8, window: Duration) -> Result<Self, ConfigError> {
        if !(16..=64).contains(&secret.len()) {
            return Err(ConfigError::new("secret", "must be 16 to 64 bytes"));
        }
        if !(1..=32).contains(&difficulty) {
            return Err(ConfigError::new("difficulty", "must be 1 to 32 bits"));
        }
        let secs = window.as_secs();
        if !(1..=3_600).contains(&secs) || window.subsec_nanos() != 0 {
            return Err(ConfigError::new(
                "window",
                "must be whole seconds from 1 s to 1 h",
            ));
        }
        let mut key = [0u8; 64];
        for (k, s) in key.iter_mut().zip(secret) {
            *k = *s;
        }
        Ok(Self {
            key,
            difficulty,
            window: secs,
            clock: Arc::new(SystemClock),
        })
    }

    /// Reads the time from `clock` (its Unix time) instead of the
    /// system's: for tests.
    #[must_use]
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Solves a `pow1` challenge as a client does — for Rust clients and
    /// tests: tries nonces until SHA-256 of the solution starts with the
    /// challenge's difficulty in zero bits (about 2^difficulty hashes) and
    /// returns the solution, the `Tollgate-Solution` header's value.
    /// `None` for a challenge that is not one, or one harder than
    /// `max_bits` (the server chooses the difficulty: bound the work you
    /// accept). It blocks while it works: in async code, run it with
    /// `tokio::task::spawn_blocking`.
    pub fn solve(challenge: &str, max_bits: u32) -> Option<String> {
        let bits: u32 = challenge.split('.').nth(2)?.parse().ok()?;
        if !challenge.starts_with("pow1.") || bits > max_bits.min(32) {
            return None;
        }
        let mut prefix = Sha256::new();
        prefix.update(challenge.as_bytes());
        prefix.update(b".");
        (0u64..).map(|n| n.to_string()).find_map(|nonce| {
            let digest = prefix.clone().chain_update(nonce.as_bytes()).finalize();
            (zero_bits(&digest) >= bits).then(|| format!("{challenge}.{nonce}"))
        })
    }

    /// How many zero bits SHA-256 of `bytes` starts with: what a solution
    /// must reach.
    pub fn leading_zero_bits(bytes: &[u8]) -> u32 {
        zero_bits(&Sha256::digest(bytes))
    }

    fn window_now(&self) -> u64 {
        (self.clock.unix_now() / 1_000_000_000)
            .checked_div(self.window)
            .unwrap_or(0)
    }

    /// HMAC-SHA-256 of the scope, window and difficulty, as 32 hex digits.
    fn mac(&self, scope: &[u8], window: u64) -> String {
        let pad = |byte: u8| self.key.map(|k| k ^ byte);
        let mut inner = Sha256::new();
        inner.update(pad(0x36));
        inner.update((scope.len() as u64).to_be_bytes());
        inner.update(scope);
        inner.update(window.to_be_bytes());
        inner.update([self.difficulty]);
        let mut outer = Sha256::new();
        outer.update(pad(0x5c));
        outer.update(inner.finalize());
        let mut hex = String::with_capacity(32);
        for b in outer.finalize().iter().take(16) {
            for nibble in [b >> 4, b & 0xf] {
                hex.push(char::from_digit(u32::from(nibble), 16).unwrap_or('0'));
            }
        }
        hex
    }

    fn challenge_at(&self, scope: &[u8], window: u64) -> String {
        format!(
            "pow1.{window}.{}.{}",
            self.difficulty,
            self.mac(scope, window)
        )
    }
}

impl Challenge for ProofOfWork {
    fn issue(&self, scope: &[u8]) -> String {
        self.challenge_at(scope, self.window_now())
    }

    fn verify(&self, scope: &[u8], solution: &[u8]) -> Option<[u8; 16]> {
        if solution.len() > 200 {
            return None;
        }
        let text = std::str::from_utf8(solution).ok()?;
        let (challenge, nonce) = text.rsplit_once('.')?;
        let nonce_ok = !nonce.is_empty()
            && nonce.len() <= 64
            && nonce
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !nonce_ok {
            return None;
        }
        let mut parts = challenge.split('.');
        let (Some("pow1"), Some(window), Some(_), Some(_), None) = (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) else {
            return None;
        };
        let window: u64 = window.parse().ok()?;
        let now = self.window_now();
        if window != now && Some(window) != now.checked_sub(1) {
            return None;
        }
        // The whole challenge as this instance would issue it: scope,
        // window and difficulty, under the secret.
        let expected = self.challenge_at(scope, window);
        let same = expected.len() == challenge.len()
            && expected
                .bytes()
                .zip(challenge.bytes())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0;
        if !same || Self::leading_zero_bits(solution) < u32::from(self.difficulty) {
            return None;
        }
        // The challenge's id: one pass per challenge, not per nonce.
        let digest = Sha256::digest(challenge.as_bytes());
        let mut id = [0u8; 16];
        for (i, b) in id.iter_mut().zip(digest.iter()) {
            *i = *b;
        }
        Some(id)
    }

    fn lifetime(&self) -> Duration {
        // Good in its window and the next; one more for the skew between
        // the instances' clocks and the store's.
        Duration::from_secs(self.window.saturating_mul(3))
    }
}

/// How many zero bits `digest` starts with.
fn zero_bits(digest: &[u8]) -> u32 {
    let mut bits: u32 = 0;
    for b in digest {
        if *b == 0 {
            bits = bits.saturating_add(8);
        } else {
            return bits.saturating_add(b.leading_zeros());
        }
    }
    bits
}

/// The header names, parsed once.
static SOLUTION: http::HeaderName = http::HeaderName::from_static(SOLUTION_HEADER);
static CHALLENGE: http::HeaderName = http::HeaderName::from_static(CHALLENGE_HEADER);

/// What rule `rule`'s challenge makes of a request of `key`: `Some(id)`
/// when it carries a solution that verifies (not yet known to be unused);
/// `None` without a challenge or a solution. A solution that does not
/// verify is counted.
pub(super) fn solved<B, L>(
    rule: &super::shared::Bound<B, L>,
    req: &http::Request<B>,
    key: &[u8],
    requester: &[u8; 16],
) -> Option<[u8; 16]> {
    rule.challenge.as_ref()?;
    req.headers().get(&SOLUTION)?;
    let id = verified(rule, req, key, requester);
    if id.is_none() {
        rule.responder.metrics.challenge_failed.increment(1);
        tracing::debug!(
            target: "tollgate",
            rule = %rule.responder.rule,
            "a challenge's solution did not verify (wrong, expired, or for another key or requester)"
        );
    }
    id
}

/// The id of the challenge a solution of `req`'s solves for rule `rule`
/// and `key`, if one does. (A client over two challenged rules sends a
/// solution for each.)
pub(super) fn verified<B, L>(
    rule: &super::shared::Bound<B, L>,
    req: &http::Request<B>,
    key: &[u8],
    requester: &[u8; 16],
) -> Option<[u8; 16]> {
    let (challenge, _) = rule.challenge.as_ref()?;
    let scope = scope(&rule.responder.rule, key, requester);
    // A few solutions at most (one per challenged rule a client is over):
    // each costs a MAC and a hash to check, and a request of a hundred
    // such headers would cost a hundred of each.
    req.headers()
        .get_all(&SOLUTION)
        .iter()
        .take(MAX_SOLUTIONS)
        .find_map(|answer| challenge.verify(&scope, answer.as_bytes()))
}

/// The most `Tollgate-Solution` headers of one request that are checked.
pub(super) const MAX_SOLUTIONS: usize = 4;

/// The digest of who asked, by the policy's requester key (`[0; 16]`
/// where the policy has no challenges, or the requester has no key).
pub(super) fn requester_of<B, L>(
    shared: &super::shared::Shared<B, L>,
    req: &http::Request<B>,
) -> [u8; 16] {
    let mut id = [0u8; 16];
    let Some(requester) = &shared.requester else {
        return id;
    };
    let mut key = crate::key::KeyBuf::new();
    if requester.key(req, &mut key).is_some() {
        let digest = Sha256::digest(key.as_bytes());
        for (i, b) in id.iter_mut().zip(digest.iter()) {
            *i = *b;
        }
    }
    id
}

/// Whether a verified solution `id` is used for the first time, by the
/// store's answer to taking its mark (`None`: the store failed, and the
/// rule decides as if there were no solution). Counted.
pub(super) fn first_use<B, L>(
    rule: &super::shared::Bound<B, L>,
    answer: Result<tollgate_core::Decision, tollgate_core::StoreError>,
) -> bool {
    let first = answer.is_ok_and(|d| d.is_allowed());
    let m = &rule.responder.metrics;
    if first {
        m.challenge_passed.increment(1);
    } else {
        m.challenge_failed.increment(1);
    }
    tracing::debug!(
        target: "tollgate",
        rule = %rule.responder.rule,
        passed = first,
        "a solved challenge (passed: its first use)"
    );
    first
}

/// The `Tollgate-Challenge` header of a refusal: when `verdict` is a
/// rule's refusal for now (not "never", not a block) and the rule has a
/// challenge, one for the rule's key (`key(i, f)` hands rule `i`'s key to
/// `f`).
pub(super) fn for_verdict<B, L>(
    shared: &super::shared::Shared<B, L>,
    verdict: super::decide::Verdict,
    key: impl super::decide::KeyOf,
    requester: &[u8; 16],
) -> Option<http::HeaderValue> {
    let super::decide::Verdict::Deny {
        rule: i,
        reason: crate::rejection::Reason::Limited,
    } = verdict
    else {
        return None;
    };
    let rule = shared.rules.get(i)?;
    let (challenge, _) = rule.challenge.as_ref()?;
    let mut value = None;
    key(i, &mut |k| {
        let issued = challenge.issue(&scope(&rule.responder.rule, k, requester));
        value = http::HeaderValue::from_str(&issued).ok();
    });
    value
}

/// Adds a refusal's challenge to its headers.
pub(super) fn attach(map: &mut http::HeaderMap, challenge: Option<&http::HeaderValue>) {
    if let Some(v) = challenge {
        map.insert(CHALLENGE.clone(), v.clone());
    }
}

/// The scope of rule `rule`'s challenge for `key` asked by `requester`:
/// the rule's name, a zero byte, the requester's digest (16 bytes), a zero
/// byte, the key.
pub(crate) fn scope(rule: &str, key: &[u8], requester: &[u8; 16]) -> Vec<u8> {
    let mut s = Vec::with_capacity(rule.len().saturating_add(key.len()).saturating_add(18));
    s.extend_from_slice(rule.as_bytes());
    s.push(0);
    s.extend_from_slice(requester);
    s.push(0);
    s.extend_from_slice(key);
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_core::ManualClock;

    #[test]
    fn a_solution_is_good_for_its_scope_and_two_windows() {
        let clock = ManualClock::at_unix(1_800_000_000_000_000_000);
        let pow = ProofOfWork::new(&[7; 32], 10, Duration::from_secs(60))
            .unwrap()
            .clock(clock.clone());
        let c = pow.issue(b"r\0k");
        assert!(c.starts_with("pow1.30000000.10."), "{c}");
        let s = ProofOfWork::solve(&c, 16).unwrap();
        assert!(ProofOfWork::solve("pow2.1.8.00", 16).is_none());
        assert!(
            ProofOfWork::solve(&c, 9).is_none(),
            "harder than the client accepts"
        );
        let id = pow.verify(b"r\0k", s.as_bytes()).unwrap();
        assert_eq!(pow.verify(b"r\0k", s.as_bytes()), Some(id));
        // Another nonce for the same challenge: the same challenge's id.
        let other_nonce = (0u64..)
            .map(|n| format!("{c}.x{n}"))
            .find(|s| ProofOfWork::leading_zero_bits(s.as_bytes()) >= 10)
            .unwrap();
        assert_eq!(pow.verify(b"r\0k", other_nonce.as_bytes()), Some(id));
        assert!(pow.verify(b"r\0x", s.as_bytes()).is_none(), "another key");
        // Not enough work: a nonce whose hash falls short.
        let weak = (0u64..)
            .map(|n| format!("{c}.{n}"))
            .find(|s| ProofOfWork::leading_zero_bits(s.as_bytes()) < 10)
            .unwrap();
        assert!(pow.verify(b"r\0k", weak.as_bytes()).is_none());
        // Another secret or difficulty does not accept it.
        let other = ProofOfWork::new(&[8; 32], 10, Duration::from_secs(60))
            .unwrap()
            .clock(clock.clone());
        assert!(other.verify(b"r\0k", s.as_bytes()).is_none());
        let easier = ProofOfWork::new(&[7; 32], 9, Duration::from_secs(60))
            .unwrap()
            .clock(clock.clone());
        assert!(easier.verify(b"r\0k", s.as_bytes()).is_none());
        // Good in the next window, not the one after.
        clock.advance(Duration::from_secs(60));
        assert!(pow.verify(b"r\0k", s.as_bytes()).is_some());
        clock.advance(Duration::from_secs(60));
        assert!(pow.verify(b"r\0k", s.as_bytes()).is_none());
        // Garbage never passes, nor panics.
        for junk in [
            &b""[..],
            b".",
            b"pow1",
            b"pow1.x.10.abc.1",
            b"pow1.30000002.10.00.1",
            &[0xff; 300][..],
            b"pow1.30000002.10.00000000000000000000000000000000.!!",
        ] {
            assert!(pow.verify(b"r\0k", junk).is_none());
        }
    }

    #[test]
    fn configuration_errors_name_the_field() {
        let e = |r: Result<ProofOfWork, ConfigError>| r.unwrap_err().field();
        let minute = Duration::from_secs(60);
        assert_eq!(e(ProofOfWork::new(b"short", 10, minute)), "secret");
        assert_eq!(e(ProofOfWork::new(&[1; 65], 10, minute)), "secret");
        assert_eq!(e(ProofOfWork::new(&[1; 16], 0, minute)), "difficulty");
        assert_eq!(e(ProofOfWork::new(&[1; 16], 33, minute)), "difficulty");
        assert_eq!(e(ProofOfWork::new(&[1; 16], 10, Duration::ZERO)), "window");
        let odd = Duration::from_millis(1_500);
        assert_eq!(e(ProofOfWork::new(&[1; 16], 10, odd)), "window");
    }
}
