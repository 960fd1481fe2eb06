//! Redis keys: `<prefix>:{<kind>|<rule>|<client key>}`.

use sha2::{Digest, Sha256};

/// Longest client key used verbatim.
const MAX_VERBATIM: usize = 64;

/// What a key holds: rate state or concurrency leases (so a rate rule and a
/// concurrency rule of the same name never share keys). Concurrency keys
/// are `c2`: the second layout of leases (a sorted set and, at
/// `<key>:meta`, a hash of the permits held and the last lease id), so
/// instances of the first layout never read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Rate,
    Concurrency,
}

/// The Redis key `<prefix>:{<kind>|<rule>|<client key>}` for `rule` and
/// `key`; `|` appears in neither rule names nor verbatim keys, so the parts
/// cannot run into each other. Every key a script touches shares
/// the `{...}` hash tag, so it lands in one Cluster slot. A client key of
/// at most 64 bytes of safe printable characters is kept readable
/// (`k:` + key); any other — long, binary, with braces, spaces or control
/// bytes — is hashed to a fixed length (`h:` + 32 hex digits of SHA-256),
/// so nothing a client sends can inject a command, break out of the hash
/// tag or grow Redis's memory.
pub(crate) fn redis_key(prefix: &str, kind: Kind, rule: &str, key: &[u8]) -> String {
    let safe = key.len() <= MAX_VERBATIM
        && key.iter().all(|b| {
            b.is_ascii_alphanumeric()
                || matches!(b, b'-' | b'_' | b'.' | b':' | b'@' | b'/' | b'+' | b'=')
        });
    let mut out = String::with_capacity(prefix.len().saturating_add(rule.len()).saturating_add(40));
    out.push_str(prefix);
    out.push_str(match kind {
        Kind::Rate => ":{r|",
        Kind::Concurrency => ":{c2|",
    });
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
        let rate = |rule: &str, key: &[u8]| redis_key("tg", Kind::Rate, rule, key);
        assert_eq!(rate("per-key", b"alice"), "tg:{r|per-key|k:alice}");
        assert_ne!(rate("a", b"k:x"), rate("a:k", b"x"));
        assert_ne!(
            rate("r", b"x"),
            redis_key("tg", Kind::Concurrency, "r", b"x")
        );
        for hostile in [
            &b"{slot}"[..],
            b"a b",
            b"\r\nSET x 1\r\n",
            b"\0",
            &[b'x'; 65][..],
            &[0xff, 0xfe][..],
        ] {
            let k = rate("r", hostile);
            assert!(k.starts_with("tg:{r|r|h:"), "{k}");
            assert_eq!(k.len(), "tg:{r|r|h:".len() + 32 + 1);
            assert_eq!(k.matches('{').count(), 1);
            assert_eq!(k.matches('}').count(), 1);
        }
        assert_ne!(rate("r", b"{a}"), rate("r", b"{b}"));
        assert_eq!(rate("r", b""), "tg:{r|r|k:}");
    }
}
