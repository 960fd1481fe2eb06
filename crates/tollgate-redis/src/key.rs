//! Redis keys: `<prefix>:{<rule>:<client key>}`.

use sha2::{Digest, Sha256};

/// Longest client key used verbatim.
const MAX_VERBATIM: usize = 64;

/// The Redis key for `rule` and `key`. Every key a script touches shares
/// the `{...}` hash tag, so it lands in one Cluster slot. A client key of
/// at most 64 bytes of safe printable characters is kept readable
/// (`k:` + key); any other — long, binary, with braces, spaces or control
/// bytes — is hashed to a fixed length (`h:` + 32 hex digits of SHA-256),
/// so nothing a client sends can inject a command, break out of the hash
/// tag or grow Redis's memory.
pub(crate) fn redis_key(prefix: &str, rule: &str, key: &[u8]) -> String {
    let safe = key.len() <= MAX_VERBATIM
        && key.iter().all(|b| {
            b.is_ascii_alphanumeric()
                || matches!(b, b'-' | b'_' | b'.' | b':' | b'@' | b'/' | b'+' | b'=')
        });
    let mut out = String::with_capacity(prefix.len().saturating_add(rule.len()).saturating_add(40));
    out.push_str(prefix);
    out.push_str(":{");
    out.push_str(rule);
    if safe {
        out.push_str(":k:");
        out.extend(key.iter().map(|&b| char::from(b)));
    } else {
        out.push_str(":h:");
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
        assert_eq!(redis_key("tg", "per-key", b"alice"), "tg:{per-key:k:alice}");
        for hostile in [
            &b"{slot}"[..],
            b"a b",
            b"\r\nSET x 1\r\n",
            b"\0",
            &[b'x'; 65][..],
            &[0xff, 0xfe][..],
        ] {
            let k = redis_key("tg", "r", hostile);
            assert!(k.starts_with("tg:{r:h:"), "{k}");
            assert_eq!(k.len(), "tg:{r:h:".len() + 32 + 1);
            assert_eq!(k.matches('{').count(), 1);
            assert_eq!(k.matches('}').count(), 1);
        }
        assert_ne!(redis_key("tg", "r", b"{a}"), redis_key("tg", "r", b"{b}"));
        assert_eq!(redis_key("tg", "r", b""), "tg:{r:k:}");
    }
}
