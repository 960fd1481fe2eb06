//! Redis keys: `<prefix>:{<format>|<rule>|<client key>}`.

use sha2::{Digest, Sha256};
use tollgate_core::Algorithm;

/// What a key holds: the algorithm whose state it is, in which layout.
/// Its tag in the key is the algorithm's short name and the layout's
/// version, so that rules of different algorithms — or one rule whose
/// algorithm changes during a rolling deploy — and instances that store
/// different layouts never read each other's state: each starts from a
/// fresh key, and the other's keys expire with their TTL. Bump a version
/// whenever a script changes what it stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    /// `gcra.lua`: the TAT.
    Gcra,
    /// `token_bucket.lua`: a tick's start and its tokens.
    TokenBucket,
    /// `fixed_window.lua`: the window number and its count.
    FixedWindow,
    /// `sliding_window_counter.lua`: a hash of the window and two counts.
    SlidingWindowCounter,
    /// `sliding_window_buckets.lua`: the newest bucket's number and the
    /// buckets' counts.
    SlidingWindowBuckets,
    /// `sliding_window_log.lua`: a list of the admitted entries.
    SlidingWindowLog,
    /// `leaky_bucket.lua`: the queue's tail.
    LeakyBucket,
    /// `semaphore.lua`: a sorted set of leases under ids the client
    /// chose and, at `<key>:meta`, a hash of the permits held. (Version 1
    /// counted ids in the hash.)
    Semaphore,
    /// `quota.lua`: a hash of one window per period.
    Quota,
    /// `retry_budget.lua`: a hash of the window's ten slots.
    RetryBudget,
    /// `escalation.lua`: a string of strikes, level and two times.
    Escalation,
}

impl Format {
    /// The format of a rate rule's state.
    pub(crate) fn of(algorithm: &Algorithm) -> Self {
        match algorithm {
            Algorithm::Gcra(_) => Self::Gcra,
            Algorithm::TokenBucket(_) => Self::TokenBucket,
            Algorithm::FixedWindow(_) => Self::FixedWindow,
            Algorithm::SlidingWindowCounter(_) => Self::SlidingWindowCounter,
            Algorithm::SlidingWindowBuckets(_) => Self::SlidingWindowBuckets,
            Algorithm::SlidingWindowLog(_) => Self::SlidingWindowLog,
            Algorithm::LeakyBucket(_) => Self::LeakyBucket,
        }
    }

    /// The algorithm's tag and the layout's version, as keys carry them.
    pub(crate) fn tag(self) -> &'static str {
        match self {
            Self::Gcra => "gcra1",
            Self::TokenBucket => "tb1",
            Self::FixedWindow => "fw1",
            Self::SlidingWindowCounter => "swc1",
            Self::SlidingWindowBuckets => "swb1",
            Self::SlidingWindowLog => "swl1",
            Self::LeakyBucket => "lb1",
            Self::Semaphore => "sem2",
            Self::Quota => "q1",
            Self::RetryBudget => "rb1",
            Self::Escalation => "esc1",
        }
    }
}

/// How a store names its keys: `<prefix>:{<format>|<rule>|h:<digest>}`,
/// where the digest is the first 16 bytes (32 hex digits) of HMAC-SHA-256
/// of the client key under the store's
/// [`key_secret`](crate::RedisStoreBuilder::key_secret) — or, without one,
/// of SHA-256 of the prefix and the client key. No client key is ever
/// kept as it is: an API key in a key name would be in `SCAN`, `MONITOR`,
/// `SLOWLOG`, every RDB and AOF file and every replica. Under a secret the
/// names cannot be reversed, not even by enumerating a small key space
/// (every IPv4 address is 2^32 guesses).
#[derive(Clone)]
pub(crate) struct KeyNames {
    prefix: std::sync::Arc<str>,
    /// The secret, zero-padded to SHA-256's block: XORed with the HMAC
    /// pads.
    secret: Option<[u8; 64]>,
}

impl std::fmt::Debug for KeyNames {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyNames")
            .field("prefix", &self.prefix)
            .field("keyed", &self.secret.is_some())
            .finish()
    }
}

impl KeyNames {
    /// Names under `prefix`, keyed by `secret` (at most 64 bytes, which
    /// the builder checks) if any.
    pub(crate) fn new(prefix: std::sync::Arc<str>, secret: Option<&[u8]>) -> Self {
        let secret = secret.map(|s| {
            let mut padded = [0u8; 64];
            for (p, b) in padded.iter_mut().zip(s) {
                *p = *b;
            }
            padded
        });
        Self { prefix, secret }
    }

    /// The Redis key for `rule` and the client `key`. `|` appears in no
    /// rule name and no digest, so the parts cannot run into each other;
    /// every key a script touches shares the `{...}` hash tag, so it lands
    /// in one Cluster slot; and nothing a client sends reaches the name,
    /// so it can inject no command, break out of no hash tag and grow no
    /// key.
    pub(crate) fn name(&self, format: Format, rule: &str, key: &[u8]) -> String {
        self.name_tagged(format.tag(), rule, key)
    }

    fn name_tagged(&self, tag: &str, rule: &str, key: &[u8]) -> String {
        let digest = match &self.secret {
            Some(secret) => {
                let pad = |byte: u8| secret.map(|k| k ^ byte);
                let mut inner = Sha256::new();
                inner.update(pad(0x36));
                inner.update(key);
                let mut outer = Sha256::new();
                outer.update(pad(0x5c));
                outer.update(inner.finalize());
                outer.finalize()
            }
            None => {
                let mut plain = Sha256::new();
                plain.update(self.prefix.as_bytes());
                plain.update([0]);
                plain.update(key);
                plain.finalize()
            }
        };
        let mut out = String::with_capacity(
            self.prefix
                .len()
                .saturating_add(rule.len())
                .saturating_add(tag.len())
                .saturating_add(40),
        );
        out.push_str(&self.prefix);
        out.push_str(":{");
        out.push_str(tag);
        out.push('|');
        out.push_str(rule);
        out.push_str("|h:");
        for b in digest.iter().take(16) {
            for nibble in [b >> 4, b & 0xf] {
                out.push(char::from_digit(u32::from(nibble), 16).unwrap_or('0'));
            }
        }
        out.push('}');
        out
    }

    /// [`name`](Self::name) with the format given by its tag, for tests
    /// that plant a key where a script will read it.
    #[cfg(feature = "testing")]
    pub(crate) fn name_of(&self, tag: &str, rule: &str, key: &[u8]) -> String {
        self.name_tagged(tag, rule, key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(secret: Option<&[u8]>) -> KeyNames {
        KeyNames::new("tg".into(), secret)
    }

    #[test]
    fn no_client_key_is_kept_as_it_is() {
        let rate = |n: &KeyNames, rule: &str, key: &[u8]| n.name(Format::Gcra, rule, key);
        let plain = names(None);
        let keyed = names(Some(b"a secret of the fleet"));
        // A 43-character base64url token: the review's case.
        let token = b"Yx3kP0q9Zf7LmN2sT5vW8bC1dE4gH6jK9oR2uX5zA7c";
        for n in [&plain, &keyed] {
            let k = rate(n, "per-key", token);
            assert!(k.starts_with("tg:{gcra1|per-key|h:"), "{k}");
            assert!(!k.contains("Yx3kP0q9"), "{k}");
            assert_eq!(k.len(), "tg:{gcra1|per-key|h:".len() + 32 + 1);
            assert_eq!(k.matches('{').count(), 1);
            assert_eq!(k.matches('}').count(), 1);
        }
        // Keyed by the secret: another secret, another name.
        assert_ne!(
            rate(&keyed, "r", b"10.0.0.1"),
            rate(&plain, "r", b"10.0.0.1")
        );
        let other = names(Some(b"another secret"));
        assert_ne!(rate(&keyed, "r", b"k"), rate(&other, "r", b"k"));
        // The same everywhere the secret is the same.
        assert_eq!(
            rate(&keyed, "r", b"k"),
            rate(&names(Some(b"a secret of the fleet")), "r", b"k")
        );
        for hostile in [
            &b"{slot}"[..],
            b"a b",
            b"\r\nSET x 1\r\n",
            b"\0",
            &[0xff; 65][..],
        ] {
            let k = rate(&keyed, "r", hostile);
            assert_eq!(k.matches('{').count(), 1, "{k}");
            assert!(!k.contains(' ') && !k.contains('\r'), "{k}");
        }
        assert_ne!(rate(&plain, "r", b"{a}"), rate(&plain, "r", b"{b}"));
    }

    #[test]
    fn every_format_has_a_key_of_its_own() {
        let formats = [
            Format::Gcra,
            Format::TokenBucket,
            Format::FixedWindow,
            Format::SlidingWindowCounter,
            Format::SlidingWindowBuckets,
            Format::SlidingWindowLog,
            Format::LeakyBucket,
            Format::Semaphore,
            Format::Quota,
            Format::RetryBudget,
            Format::Escalation,
        ];
        let keys: std::collections::HashSet<String> = formats
            .iter()
            .map(|&f| names(None).name(f, "r", b"x"))
            .collect();
        assert_eq!(keys.len(), formats.len());
        for f in formats {
            let tag = f.tag();
            // An algorithm's name, then its layout's version.
            assert!(tag.ends_with(|c: char| c.is_ascii_digit()), "{tag}");
            assert!(!tag.contains(['|', '{', '}']), "{tag}");
        }
        assert!(names(None)
            .name(Format::Semaphore, "conc", b"tenant")
            .starts_with("tg:{sem2|conc|h:"));
    }
}
