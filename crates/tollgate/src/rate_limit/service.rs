use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tollgate_core::{Algorithm, Limiter, Store};
use tower_service::Service;

use super::future::{decided, ErrorFuture, Inner, RefundFn, ResponseFuture, State};
use super::shared::Shared;
use crate::body::RejectionBody;
use crate::cost::Cost;
use crate::key::{KeyBuf, KeyBytes, KeyExtractor, Keyed};
use crate::rejection::{is_grpc, LimitKind, Reason, Rejected};

/// The service of [`RateLimitLayer`](super::RateLimitLayer).
pub struct RateLimitService<S, K, C, St: Store> {
    inner: S,
    shared: Arc<Shared<K, C, St::Limiter>>,
}

impl<S: Clone, K, C, St: Store> Clone for RateLimitService<S, K, C, St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S: std::fmt::Debug, K, C, St: Store> std::fmt::Debug for RateLimitService<S, K, C, St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimitService")
            .field("inner", &self.inner)
            .field("rule", &self.shared.responder.rule)
            .finish_non_exhaustive()
    }
}

impl<S, K, C, St: Store> RateLimitService<S, K, C, St> {
    pub(crate) fn new(inner: S, shared: Arc<Shared<K, C, St::Limiter>>) -> Self {
        Self { inner, shared }
    }
}

/// Starts the decision for `req`: the first state of the response future.
fn start<S, K, C, L, ReqB>(
    inner: &mut S,
    shared: &Shared<K, C, L>,
    mut req: Request<ReqB>,
) -> State<S, ReqB, L::DecideFuture>
where
    S: Service<Request<ReqB>> + Clone,
    K: KeyExtractor<ReqB>,
    C: Cost<ReqB>,
    L: Limiter,
{
    if !shared.keying.applies(&req) {
        return State::calling(inner.call(req));
    }
    let mut key = KeyBuf::new();
    let m = &shared.responder.metrics;
    let extracted = shared.key.extract(&req, &mut key);
    match (shared.keying).resolve(
        extracted,
        &mut key,
        &shared.responder.rule,
        Some((&m.unkeyed, &m.missing_key)),
    ) {
        Keyed::Key => {}
        Keyed::Skip => return State::calling(inner.call(req)),
        Keyed::Reject => {
            return State::Rejected {
                rejected: Some(Rejected {
                    rule: Arc::clone(&shared.responder.rule),
                    kind: LimitKind::Rate,
                    reason: Reason::MissingKey,
                    decision: None,
                    grpc: is_grpc(&req),
                }),
            };
        }
    }
    let estimate = shared.cost.cost(&req);
    // Where the rule charges what requests really cost, the key pays what
    // it owes on top of this request's estimate, as far as the rule's
    // capacity allows.
    let (cost, settle) = match &shared.debts {
        Some(debts) => {
            let mut settle = Box::new(super::Settle::new(
                Arc::clone(debts),
                KeyBytes::new(&mut key.clone()),
                estimate,
                0,
                req.method() == http::Method::HEAD,
            ));
            match settle.take_owed(shared.limiter.rule().capacity(), estimate) {
                Ok(paid) => (estimate.saturating_add(paid), Some(settle)),
                // More owed than the rule can charge with this request:
                // refused until enough of it is freed.
                Err(owing) => {
                    return decided(
                        Ok(owing),
                        req,
                        Inner::Borrowed(inner),
                        &shared.responder,
                        None,
                        || None,
                        None,
                    );
                }
            }
        }
        None => (estimate, None),
    };
    if shared.messages && crate::rejection::is_upgrade(&req) {
        let budget = super::MessageBudget::new(
            shared.limiter.clone(),
            KeyBytes::new(&mut key.clone()),
            Arc::clone(&shared.responder),
        );
        // An outer rate layer's budget stays: messages spend on both.
        let budget = match req.extensions_mut().remove::<super::MessageBudget>() {
            Some(outer) => outer.and(&budget),
            None => budget,
        };
        req.extensions_mut().insert(budget);
    }
    let fingerprint =
        tracing::enabled!(target: "tollgate", tracing::Level::DEBUG).then(|| key.fingerprint());
    // Only a pacing rule makes requests wait; one cancelled while it
    // waits gives its cost back.
    let refund = |key: &mut KeyBuf| -> Option<RefundFn> {
        if !matches!(shared.limiter.rule().algorithm(), Algorithm::LeakyBucket(_)) {
            return None;
        }
        let (limiter, key) = (shared.limiter.clone(), KeyBytes::new(key));
        Some(Box::new(move || {
            crate::task::finish(limiter.refund(key.as_bytes(), cost));
        }))
    };
    // Stores that decide without I/O answer here, and the ready inner
    // service is called directly: no clone, no second state.
    if let Some(result) = shared.limiter.decide_sync(key.as_bytes(), cost) {
        return decided(
            result,
            req,
            Inner::Borrowed(inner),
            &shared.responder,
            fingerprint,
            || refund(&mut key),
            settle,
        );
    }
    let decide = shared.limiter.decide(key.as_bytes(), cost);
    // The clone-and-swap dance: the service that was polled ready serves
    // this request; a fresh clone waits for the next poll_ready.
    let clone = inner.clone();
    let ready = std::mem::replace(inner, clone);
    State::Deciding {
        decide,
        waiting: Some(Box::new((req, ready))),
        key: fingerprint,
        refund: refund(&mut key),
        settle,
    }
}

impl<S, K, C, St: Store, ReqB, ResB> Service<Request<ReqB>> for RateLimitService<S, K, C, St>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone,
    K: KeyExtractor<ReqB>,
    C: Cost<ReqB>,
    ResB: RejectionBody,
{
    type Response = Response<ResB>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqB, <St::Limiter as Limiter>::DecideFuture>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let state = start(&mut self.inner, &self.shared, req);
        ResponseFuture::new(state, Arc::clone(&self.shared.responder))
    }
}

/// The service of [`RateLimitErrorLayer`](super::RateLimitErrorLayer):
/// rejections are errors ([`RateLimited`](super::RateLimited)).
pub struct RateLimitErrorService<S, K, C, St: Store> {
    inner: S,
    shared: Arc<Shared<K, C, St::Limiter>>,
}

impl<S: Clone, K, C, St: Store> Clone for RateLimitErrorService<S, K, C, St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S: std::fmt::Debug, K, C, St: Store> std::fmt::Debug for RateLimitErrorService<S, K, C, St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimitErrorService")
            .field("inner", &self.inner)
            .field("rule", &self.shared.responder.rule)
            .finish_non_exhaustive()
    }
}

impl<S, K, C, St: Store> RateLimitErrorService<S, K, C, St> {
    pub(crate) fn new(inner: S, shared: Arc<Shared<K, C, St::Limiter>>) -> Self {
        Self { inner, shared }
    }
}

impl<S, K, C, St: Store, ReqB, ResB> Service<Request<ReqB>> for RateLimitErrorService<S, K, C, St>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone,
    S::Error: Into<crate::BoxError>,
    K: KeyExtractor<ReqB>,
    C: Cost<ReqB>,
{
    type Response = Response<ResB>;
    type Error = crate::BoxError;
    type Future = ErrorFuture<S, ReqB, <St::Limiter as Limiter>::DecideFuture>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let state = start(&mut self.inner, &self.shared, req);
        ErrorFuture::new(state, Arc::clone(&self.shared.responder))
    }
}
