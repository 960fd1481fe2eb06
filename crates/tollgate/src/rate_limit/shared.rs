//! What every clone of a rate-limit layer shares, and what its response
//! futures need: its own module, so that layer → service → future depend
//! one way (as in tower's `limit/`).

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use bytes::Bytes;
use http::Response;

use crate::headers::Headers;
use crate::key::KeyBuf;
use crate::observe::Metrics;
use crate::rejection::{Rejected, Rendered};

/// What to do with a request whose key cannot be extracted (no API key
/// header, no peer address).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MissingKey {
    /// Let it through unlimited.
    Skip,
    /// Count it against this shared key: every keyless request shares one
    /// budget.
    Fallback(Bytes),
    /// Reject it: HTTP 400 (gRPC `INVALID_ARGUMENT`), with a problem body.
    /// The default.
    Reject,
}

impl MissingKey {
    /// The key every keyless request of `Fallback(fallback)` shares
    /// (tagged, so no client key can be the same), and — once per layer,
    /// loudly, since it is usually a setup mistake (no `ConnectInfo` for
    /// `PeerIp`, a header a proxy strips) — a warning.
    pub(crate) fn fallback_key(fallback: &[u8], warned: &AtomicBool, rule: &str) -> KeyBuf {
        if !warned.swap(true, std::sync::atomic::Ordering::Relaxed) {
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

/// The default is [`MissingKey::Reject`]: a request the layer cannot key
/// is usually a setup mistake (no `ConnectInfo` for `PeerIp`, a header a
/// proxy strips), and silently sharing one budget among all such requests
/// hides it until that budget throttles everyone.
impl Default for MissingKey {
    fn default() -> Self {
        Self::Reject
    }
}

pub(crate) type RejectFn = Arc<dyn Fn(&Rejected) -> Response<Bytes> + Send + Sync>;

/// Everything a response future needs after the decision.
pub(crate) struct Responder {
    pub(crate) rule: Arc<str>,
    pub(crate) headers: Headers,
    pub(crate) shadow: bool,
    pub(crate) rejection: Option<RejectFn>,
    pub(crate) rendered: Rendered,
    pub(crate) metrics: Metrics,
    /// Whether decisions are also counted by route.
    #[cfg_attr(not(feature = "axum"), allow(dead_code))]
    pub(crate) route_label: bool,
}

impl Responder {
    pub(crate) fn reject(&self, rejected: &Rejected) -> Response<Bytes> {
        let mut res = match &self.rejection {
            Some(f) if !rejected.grpc => f(rejected),
            _ => self.rendered.render(rejected),
        };
        if let Some(d) = &rejected.decision {
            self.headers.apply(res.headers_mut(), d, true);
        }
        res
    }
}

pub(crate) struct Shared<K, C, L> {
    pub(crate) key: K,
    pub(crate) cost: C,
    pub(crate) limiter: L,
    pub(crate) missing: MissingKey,
    pub(crate) responder: Arc<Responder>,
    /// Whether the first keyless request was reported yet.
    pub(crate) warned_missing: std::sync::atomic::AtomicBool,
}
