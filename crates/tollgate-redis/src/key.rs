//! Redis keys: `<prefix>:{<format>|<rule>|<client key>}`.

use sha2::{Digest, Sha256};
use tollgate_core::Algorithm;

/// Longest client key used verbatim.
const MAX_VERBATIM: usize = 64;

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
            Self::SlidingWindowLog => "swl1",
            Self::LeakyBucket => "lb1",
            Self::Semaphore => "sem2",
            Self::Quota => "q1",
            Self::RetryBudget => "rb1",
            Self::Escalation => "esc1",
        }
    }
}

/// The Redis key `<prefix>:{<format>|<rule>|<client key>}` for `rule` and
/// `key`; `|` appears in neither rule names nor verbatim keys, so the parts
/// cannot run into each other. Every key a script touches shares
/// the `{...}` hash tag, so it lands in one Cluster slot. A client key of
/// at most 64 bytes of safe printable characters is kept readable
/// (`k:` + key); any other — long, binary, with braces, spaces or control
/// bytes — is hashed to a fixed length (`h:` + 32 hex digits of SHA-256),
/// so nothing a client sends can inject a command, break out of the hash
/// tag or grow Redis's memory.
pub(crate) fn redis_key(prefix: &str, format: Format, rule: &str, key: &[u8]) -> String {
    let safe = key.len() <= MAX_VERBATIM
        && key.iter().all(|b| {
            b.is_ascii_alphanumeric()
                || matches!(b, b'-' | b'_' | b'.' | b':' | b'@' | b'/' | b'+' | b'=')
        });
    let mut out = String::with_capacity(prefix.len().saturating_add(rule.len()).saturating_add(44));
    out.push_str(prefix);
    out.push_str(":{");
    out.push_str(format.tag());
    out.push('|');
    out.push_str(rule);
    if safe {
        out.push_str("|k:");
        out.extend(key.iter().map(|&b| char::from(b)));
    } else {
        out.push_str("|h:");
        let digest = Sha256::digest(key);
        for b in digest.iter().take(16) {
            for nibble in [b >> 4, b & 0xf] {
                out.push(char::from_digit(u32::from(nibble), 16).unwrap_or('0'));
            }
        }
    }
    out.push('}');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn safe_keys_stay_readable_and_the_rest_are_hashed() {
        let rate = |rule: &str, key: &[u8]| redis_key("tg", Format::Gcra, rule, key);
        assert_eq!(rate("per-key", b"alice"), "tg:{gcra1|per-key|k:alice}");
        assert_ne!(rate("a", b"k:x"), rate("a:k", b"x"));
        for hostile in [
            &b"{slot}"[..],
            b"a b",
            b"\r\nSET x 1\r\n",
            b"\0",
            &[b'x'; 65][..],
            &[0xff, 0xfe][..],
        ] {
            let k = rate("r", hostile);
            assert!(k.starts_with("tg:{gcra1|r|h:"), "{k}");
            assert_eq!(k.len(), "tg:{gcra1|r|h:".len() + 32 + 1);
            assert_eq!(k.matches('{').count(), 1);
            assert_eq!(k.matches('}').count(), 1);
        }
        assert_ne!(rate("r", b"{a}"), rate("r", b"{b}"));
        assert_eq!(rate("r", b""), "tg:{gcra1|r|k:}");
    }

    #[test]
    fn every_format_has_a_key_of_its_own() {
        let formats = [
            Format::Gcra,
            Format::TokenBucket,
            Format::FixedWindow,
            Format::SlidingWindowCounter,
            Format::SlidingWindowLog,
            Format::LeakyBucket,
            Format::Semaphore,
            Format::Quota,
            Format::RetryBudget,
        ];
        let keys: std::collections::HashSet<String> = formats
            .iter()
            .map(|&f| redis_key("tg", f, "r", b"x"))
            .collect();
        assert_eq!(keys.len(), formats.len());
        for f in formats {
            let tag = f.tag();
            // An algorithm's name, then its layout's version.
            assert!(tag.ends_with(|c: char| c.is_ascii_digit()), "{tag}");
            assert!(!tag.contains(['|', '{', '}']), "{tag}");
        }
        assert_eq!(
            redis_key("tg", Format::Semaphore, "conc", b"tenant"),
            "tg:{sem2|conc|k:tenant}"
        );
    }
}
