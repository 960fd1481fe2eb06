//! What a response needs of its limits: header items, and the refusal.

use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response};
use tollgate_core::Decision;

use super::adaptive::Adaptive;
use super::admission::Admission;
use crate::headers::{ConcurrencyHeaders, Item};
#[cfg(feature = "axum")]
use crate::rejection::Reason;
use crate::rejection::{Rejected, Rendered};

pub(crate) type RejectFn = Arc<dyn Fn(&Rejected) -> Response<Bytes> + Send + Sync>;

/// Everything a response future needs after admission.
pub(crate) struct Responder {
    pub(crate) headers: ConcurrencyHeaders,
    pub(crate) rejection: Option<RejectFn>,
    /// The default rejections of the per-key and the service limit.
    pub(crate) rendered: [Rendered; 2],
    pub(crate) adaptive: Option<Arc<Adaptive>>,
    pub(crate) name: Arc<str>,
    /// Offer upgrade requests' permits to their handlers.
    pub(crate) upgrades: bool,
    /// The longest a permit lives, and the count of bodies ended there.
    pub(crate) lifetime: Option<(std::time::Duration, metrics::Counter)>,
    /// Whether decisions are also counted by route.
    #[cfg_attr(not(feature = "axum"), allow(dead_code))]
    pub(crate) route_label: bool,
}

impl Responder {
    /// Counts `admission` of `req` by route, when the layer does: what was
    /// decided (a deferred admission is counted when it resolves).
    pub(crate) fn count_route<B>(&self, req: &Request<B>, admission: &Admission) {
        #[cfg(feature = "axum")]
        if self.route_label {
            let outcome = match admission {
                // Let through holding nothing (shadow mode, a store fault,
                // no key): not the limit's admission.
                Admission::Go(a) if a.permit.is_none() => return,
                Admission::Go(_) => "allowed",
                Admission::Reject(r, _) => match r.reason {
                    Reason::Limited => "limited",
                    Reason::TooCostly => "too_costly",
                    // Not a limit's decision.
                    _ => return,
                },
                Admission::Defer(..) => return,
            };
            crate::observe::count_route(&self.name, req, outcome);
        }
        #[cfg(not(feature = "axum"))]
        let _ = (req, admission);
    }

    pub(crate) fn reject(&self, rejected: &Rejected, items: &Items) -> Response<Bytes> {
        let mut res = match &self.rejection {
            Some(f) if !rejected.grpc => f(rejected),
            _ => {
                let which = usize::from(*rejected.rule != *self.name);
                match self.rendered.get(which) {
                    Some(r) => r.render(rejected),
                    None => rejected.to_problem_response(),
                }
            }
        };
        // The refusing limit's hint (a read-only refusal has no item).
        if let Some(secs) = rejected.retry_after_secs() {
            let _ = res
                .headers_mut()
                .try_insert(http::header::RETRY_AFTER, http::HeaderValue::from(secs));
        }
        self.headers.apply(res.headers_mut(), items.as_slice());
        crate::rejection::mark(res)
    }
}

/// The header items of one request: the per-key limit, then the service's.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Items {
    items: [Item; 2],
    len: u8,
}

impl Items {
    #[inline]
    pub(super) fn new(len: usize) -> Self {
        Self {
            items: [Item::default(); 2],
            len: u8::try_from(len).unwrap_or(2).min(2),
        }
    }

    pub(super) fn set(&mut self, i: usize, q: u64, decision: Option<Decision>) {
        if let Some(item) = self.items.get_mut(i) {
            *item = Item::new(q, decision);
        }
    }

    pub(crate) fn as_slice(&self) -> &[Item] {
        self.items.get(..usize::from(self.len)).unwrap_or_default()
    }
}
