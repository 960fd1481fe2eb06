//! What a layer does with a request that has no key: one policy,
//! [`MissingKey`], applied in one place ([`Keying::resolve`]) by every
//! layer, so that a keyless request meets the same rule on each.

use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use metrics::Counter;

use super::KeyBuf;

/// What to do with a request whose key cannot be extracted (no API key
/// header, an empty or blank one, no peer address). Every layer —
/// rate, policy rule, quota, concurrency, bandwidth — takes the same
/// policy and has the same default, [`MissingKey::Reject`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum MissingKey {
    /// Let it through unlimited (counted as `unkeyed`).
    Skip,
    /// Count it against this shared key: every keyless request shares one
    /// budget.
    Fallback(Bytes),
    /// Reject it: HTTP 400 (gRPC `INVALID_ARGUMENT`), with a problem body.
    /// The default.
    Reject,
}

/// The default is [`MissingKey::Reject`]: a request the layer cannot key
/// is usually a setup mistake (no `ConnectInfo` for `PeerIp`, a header a
/// proxy strips), and silently sharing one budget among all such requests
/// — or letting them through unlimited — hides it until an attacker finds
/// it.
impl Default for MissingKey {
    fn default() -> Self {
        Self::Reject
    }
}

/// What a layer does with a request, by its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Keyed {
    /// The key buffer holds its key (its own, or the shared fallback).
    Key,
    /// Let through unlimited by this layer.
    Skip,
    /// Refuse it: 400 / `INVALID_ARGUMENT`.
    Reject,
}

/// A layer's [`MissingKey`] policy, and whether it has warned yet.
#[derive(Debug, Default)]
pub(crate) struct Keying {
    missing: MissingKey,
    warned: AtomicBool,
    /// The routes the layer or rule applies to (`None`: every request).
    routes: Option<crate::Routes>,
}

impl Keying {
    pub(crate) fn new(missing: MissingKey) -> Self {
        Self {
            missing,
            warned: AtomicBool::new(false),
            routes: None,
        }
    }

    /// Scoped to `routes`, if any.
    pub(crate) fn scoped(mut self, routes: Option<crate::Routes>) -> Self {
        self.routes = routes;
        self
    }

    /// Whether `req` is in the scope of the layer or rule: a request to
    /// another route passes it untouched (no key read, nothing counted).
    #[inline]
    pub(crate) fn applies<B>(&self, req: &http::Request<B>) -> bool {
        crate::Routes::applies(self.routes.as_ref(), req)
    }

    /// What to do with a request whose key extraction gave `extracted`
    /// into `key`. Keyless, the policy decides: `Skip` counts `unkeyed`,
    /// `Reject` counts `missing_key`, `Fallback` writes the shared key
    /// into `key` (and warns, once per layer: it is usually a setup
    /// mistake). `counters` are the layer's `(unkeyed, missing_key)`, or
    /// `None` for a second look at a request already counted.
    #[inline]
    pub(crate) fn resolve(
        &self,
        extracted: Option<()>,
        key: &mut KeyBuf,
        rule: &str,
        counters: Option<(&Counter, &Counter)>,
    ) -> Keyed {
        if extracted.is_some() {
            return Keyed::Key;
        }
        match &self.missing {
            MissingKey::Skip => {
                if let Some((unkeyed, _)) = counters {
                    unkeyed.increment(1);
                }
                Keyed::Skip
            }
            MissingKey::Reject => {
                if let Some((_, missing)) = counters {
                    missing.increment(1);
                }
                Keyed::Reject
            }
            MissingKey::Fallback(fallback) => {
                *key = self.fallback_key(fallback, rule);
                Keyed::Key
            }
        }
    }

    /// The key every keyless request of `Fallback(fallback)` shares
    /// (tagged, so no client key can be the same), and — once per layer,
    /// loudly, since it is usually a setup mistake (no `ConnectInfo` for
    /// `PeerIp`, a header a proxy strips) — a warning.
    fn fallback_key(&self, fallback: &[u8], rule: &str) -> KeyBuf {
        if !self.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                target: "tollgate",
                rule = %rule,
                "a request had no key; keyless requests share one fallback budget \
                 (for PeerIp, serve with into_make_service_with_connect_info)"
            );
        }
        let mut key = KeyBuf::new();
        key.push(b"\x02fallback");
        key.push(fallback);
        key
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_policy_resolves_a_keyless_request_once() {
        let (unkeyed, missing) = (Counter::noop(), Counter::noop());
        let mut key = KeyBuf::new();
        let skip = Keying::new(MissingKey::Skip);
        assert_eq!(
            skip.resolve(None, &mut key, "r", Some((&unkeyed, &missing))),
            Keyed::Skip
        );
        let reject = Keying::new(MissingKey::default());
        assert_eq!(reject.resolve(None, &mut key, "r", None), Keyed::Reject);
        let shared = Keying::new(MissingKey::Fallback(Bytes::from_static(b"anon")));
        assert_eq!(shared.resolve(None, &mut key, "r", None), Keyed::Key);
        let mut again = KeyBuf::new();
        shared.resolve(None, &mut again, "r", None);
        assert_eq!(key.as_bytes(), again.as_bytes());
        // A client's own key never equals the fallback.
        let mut own = KeyBuf::new();
        own.push(b"\x02fallback");
        assert_ne!(own.as_bytes(), key.as_bytes());
        // A key that was extracted is kept.
        let mut k = KeyBuf::new();
        k.push(b"abc");
        assert_eq!(skip.resolve(Some(()), &mut k, "r", None), Keyed::Key);
        assert_eq!(
            k.as_bytes(),
            {
                let mut e = KeyBuf::new();
                e.push(b"abc");
                e
            }
            .as_bytes()
        );
    }
}
