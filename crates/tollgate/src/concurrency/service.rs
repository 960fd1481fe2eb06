use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tollgate_core::Store;
use tower_service::Service;

use super::admission::Admission;
use super::critical::Critical;
use super::future::{ResponseFuture, State};
use super::limits::Limits;
use super::permit::PermitBody;
use crate::body::RejectionBody;
use crate::cost::Cost;
use crate::key::KeyExtractor;

/// The service of [`ConcurrencyLayer`](super::ConcurrencyLayer).
pub struct ConcurrencyService<S, K, C, P, St: Store> {
    inner: S,
    shared: Arc<Limits<K, C, P, St::ConcurrencyLimiter>>,
}

impl<S: Clone, K, C, P, St: Store> Clone for ConcurrencyService<S, K, C, P, St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S: std::fmt::Debug, K, C, P, St: Store> std::fmt::Debug
    for ConcurrencyService<S, K, C, P, St>
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConcurrencyService")
            .field("inner", &self.inner)
            .field("rule", &self.shared.per_key.name)
            .finish_non_exhaustive()
    }
}

impl<S, K, C, P, St: Store> ConcurrencyService<S, K, C, P, St> {
    pub(crate) fn new(inner: S, shared: Arc<Limits<K, C, P, St::ConcurrencyLimiter>>) -> Self {
        Self { inner, shared }
    }
}

impl<S, K, C, P, St: Store, ReqB, ResB> Service<Request<ReqB>>
    for ConcurrencyService<S, K, C, P, St>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone,
    K: KeyExtractor<ReqB>,
    C: Cost<ReqB>,
    P: Critical<ReqB>,
    ResB: RejectionBody,
{
    type Response = Response<PermitBody<ResB>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqB>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<ReqB>) -> Self::Future {
        let plan = self.shared.plans.index(&req);
        let responder = Arc::clone(&self.shared.plans.get(plan).responder);
        if !self.shared.keying.applies(&req) {
            let state = State::calling(&mut self.inner, req, None, false);
            return ResponseFuture::new(state, responder);
        }
        let admission = self.shared.start(&req, plan);
        responder.count_route(&req, &admission);
        let state = match admission {
            Admission::Go(mut admitted) => {
                admitted.cap(&responder);
                admitted.offer(&responder, &mut req);
                let capped = responder.lifetime.is_some();
                State::calling(&mut self.inner, req, Some(admitted), capped)
            }
            Admission::Reject(rejected, items) => State::Rejected {
                rejected: Some((rejected, items)),
            },
            Admission::Defer(deferred) => {
                // The ready service is dropped, so whatever it reserved (a
                // permit, a buffer slot) is free while this request waits
                // for the store or its turn; a clone is polled ready once
                // the request is admitted.
                let waiting = self.inner.clone();
                drop(std::mem::replace(&mut self.inner, waiting.clone()));
                State::Admitting {
                    admit: Box::pin(Arc::clone(&self.shared).admit(deferred)),
                    waiting: Some(Box::new((req, waiting))),
                }
            }
        };
        ResponseFuture::new(state, responder)
    }
}
