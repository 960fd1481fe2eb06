//! Idempotent repeats: a request sent again with the same
//! `Idempotency-Key` is not charged again.

use http::header::HeaderName;
use http::Request;

use super::rule::DynRule;
use crate::key::KeyBuf;
use crate::observe::Metrics;

/// The header that names a request's idempotency key (IETF
/// draft-ietf-httpapi-idempotency-key-header).
pub(crate) static IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// A policy's memory of the idempotency keys it has charged: a marker per
/// (client key, idempotency key), a GCRA rule of one unit per TTL in the
/// policy's store, so that every instance sharing the store agrees and
/// concurrent duplicates race on one atomic decision.
pub(crate) struct Idempotency<B, L> {
    /// The client key (`Cost` unused).
    pub(crate) client: Box<dyn DynRule<B>>,
    pub(crate) limiter: L,
    pub(crate) metrics: Metrics,
    pub(crate) name: std::sync::Arc<str>,
}

impl<B, L> Idempotency<B, L> {
    /// The marker's key: the client's key and the idempotency key, or
    /// `None` when the request has either missing (it is charged as
    /// usual).
    pub(crate) fn marker(&self, req: &Request<B>) -> Option<KeyBuf> {
        let idem = req.headers().get(&IDEMPOTENCY_KEY)?;
        if idem.is_empty() {
            return None;
        }
        let mut key = KeyBuf::new();
        self.client.key(req, &mut key)?;
        key.push(idem.as_bytes());
        Some(key)
    }
}
