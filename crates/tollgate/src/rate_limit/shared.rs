//! What every clone of a rate-limit layer shares, and what its response
//! futures need: its own module, so that layer → service → future depend
//! one way (as in tower's `limit/`).

use std::sync::Arc;

use bytes::Bytes;
use http::Response;

use crate::headers::Headers;
use crate::key::Keying;
use crate::observe::Metrics;
use crate::rejection::{Rejected, Rendered};

pub(crate) type RejectFn = Arc<dyn Fn(&Rejected) -> Response<Bytes> + Send + Sync>;

/// Everything a response future needs after the decision.
pub(crate) struct Responder {
    pub(crate) rule: Arc<str>,
    pub(crate) headers: Headers,
    pub(crate) shadow: bool,
    pub(crate) rejection: Option<RejectFn>,
    pub(crate) rendered: Rendered,
    pub(crate) metrics: Metrics,
    /// The decision a store error stands for (`None`: admit).
    pub(crate) on_store_error: Option<tollgate_core::Decision>,
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
        crate::rejection::mark(res)
    }
}

pub(crate) struct Shared<K, C, L> {
    pub(crate) key: K,
    pub(crate) cost: C,
    pub(crate) limiter: L,
    pub(crate) keying: Keying,
    pub(crate) responder: Arc<Responder>,
    /// Offer upgrade requests' handlers a [`MessageBudget`](super::MessageBudget).
    pub(crate) messages: bool,
    /// What keys owe, where the rule charges what a request really cost
    /// once its response is known.
    pub(crate) debts: Option<Arc<super::Debts>>,
}
