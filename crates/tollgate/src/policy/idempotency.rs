//! Idempotent repeats: a request sent again with the same
//! `Idempotency-Key` is not charged again — only the same request: the
//! same client, method and route, within the TTL.

use http::header::HeaderName;
use http::{Method, Request};

use super::rule::DynRule;
use crate::key::KeyBuf;
use crate::observe::Metrics;

/// The header that names a request's idempotency key (IETF
/// draft-ietf-httpapi-idempotency-key-header).
pub(crate) static IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The longest an idempotency marker may live: a day, the window in
/// which clients retry (Stripe keeps keys 24 hours). A marker pins one
/// key in the store for its whole TTL, so the TTL bounds what a client
/// that sends a new `Idempotency-Key` with every request can hold.
pub(crate) const MAX_TTL: std::time::Duration = std::time::Duration::from_secs(86_400);

/// The most idempotency markers a policy keeps in memory at once, in a
/// table of their own (the Redis store keeps each for its TTL). Past it,
/// a new marker cannot be recorded: its request is charged like any other
/// (never free), and no rule's state is pushed out. A marker takes about
/// 100 bytes of heap, so this bounds them near 10 MB.
pub(crate) const MAX_MARKERS: usize = 100_000;

/// A policy's memory of the idempotency keys it has charged: a marker per
/// (client key, method, route, idempotency key), a GCRA rule of one unit
/// per TTL in the policy's store, so that every instance sharing the store
/// agrees and concurrent duplicates race on one atomic decision.
pub(crate) struct Idempotency<B, L> {
    /// The client key (`Cost` unused).
    pub(crate) client: Box<dyn DynRule<B>>,
    pub(crate) limiter: L,
    pub(crate) metrics: Metrics,
    pub(crate) name: std::sync::Arc<str>,
}

/// The headers that describe a request's body, in every marker: its
/// length and type, and the digests of RFC 9530 (`Content-Digest`,
/// `Repr-Digest`) when the client sends them.
const REPRESENTATION: [http::header::HeaderName; 4] = [
    http::header::CONTENT_LENGTH,
    http::header::CONTENT_TYPE,
    http::header::HeaderName::from_static("content-digest"),
    http::header::HeaderName::from_static("repr-digest"),
];

impl<B, L> Idempotency<B, L> {
    /// The marker's key: the client's key, the method, the route (axum's
    /// matched route template, else the normalised path the client sent),
    /// the idempotency key and what the request says of its body (length,
    /// type, digests) — so a key repeated on another route or method, by
    /// another client or with another length, type or digest, is no
    /// repeat; and a request that gives neither a length nor a digest
    /// carries no marker. `None` (the request is
    /// charged as usual) for a method an `Idempotency-Key` does not apply
    /// to (only `POST` and `PATCH`: the others are idempotent already),
    /// and when the request has no client key or a blank idempotency key.
    pub(crate) fn marker(&self, req: &Request<B>) -> Option<KeyBuf> {
        if !matches!(*req.method(), Method::POST | Method::PATCH) {
            return None;
        }
        let idem = req.headers().get(&IDEMPOTENCY_KEY)?.as_bytes().trim_ascii();
        if idem.is_empty() {
            return None;
        }
        let mut key = KeyBuf::new();
        self.client.key(req, &mut key)?;
        key.push(req.method().as_str().as_bytes());
        push_route(req, &mut key);
        key.push(idem);
        // What the request says of its body: a repeat with another body
        // (another length, type or digest) is no repeat. A body that says
        // nothing of itself (no length, no digest: chunked, HTTP/2 without
        // `content-length`, most gRPC calls) could be any body: no marker,
        // charged as usual.
        let mut described = false;
        // HTTP/1 without a length or chunking: a body of none (RFC 9112,
        // 6.3), which is a length too.
        let empty = req.version() <= http::Version::HTTP_11
            && !req.headers().contains_key(http::header::TRANSFER_ENCODING);
        for (i, name) in REPRESENTATION.iter().enumerate() {
            let mut values = req.headers().get_all(name).iter();
            match (values.next(), values.next()) {
                (None, _) if i == 0 && empty => {
                    described = true;
                    key.push(b"0");
                }
                (None, _) => key.push(b""),
                (Some(v), None) => {
                    // Every one but the type tells bodies apart.
                    described |= i != 1;
                    key.push(v.as_bytes().trim_ascii());
                }
                // Sent twice: no repeat can be told apart from another.
                (Some(_), Some(_)) => return None,
            }
        }
        described.then_some(key)
    }
}

/// The request's route: axum's `MatchedPath` where the layer sits inside a
/// router, else the normalised path the client sent.
fn push_route<B>(req: &Request<B>, key: &mut KeyBuf) {
    #[cfg(feature = "axum")]
    if let Some(route) = req.extensions().get::<axum::extract::MatchedPath>() {
        key.push(route.as_str().as_bytes());
        return;
    }
    let path = crate::key::request::original_path(req);
    key.push(crate::key::normalize_path(path).as_bytes());
}
