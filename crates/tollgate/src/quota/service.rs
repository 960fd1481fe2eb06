use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use metrics::{Counter, Histogram};
use pin_project_lite::pin_project;
use tollgate_core::{Outcome, QuotaDecision, QuotaLimiter, QuotaStore, StoreError};
use tower_service::Service;

use crate::body::RejectionBody;
use crate::cost::Cost;
use crate::headers::{field, Buf, QuotaHeaders};
use crate::key::{KeyBuf, KeyBytes, KeyExtractor, Keyed, Keying};
use crate::observe::Metrics;
use crate::policy::access::Listed;
use crate::policy::plan::PlanSet;
use crate::policy::Access;
use crate::rate_limit::RefundFn;
use crate::rejection::{is_grpc, LimitKind, Reason, Rejected, Rendered};

type RejectFn = Arc<dyn Fn(&Rejected) -> Response<Bytes> + Send + Sync>;

/// Everything a response future needs after the decision.
pub(crate) struct Responder {
    pub(crate) rule: Arc<str>,
    pub(crate) headers: QuotaHeaders,
    /// Each period's item name.
    pub(crate) items: Vec<Arc<str>>,
    pub(crate) shadow: bool,
    pub(crate) rejection: Option<RejectFn>,
    pub(crate) rendered: Rendered,
    pub(crate) soft: Option<f64>,
    pub(crate) metrics: Metrics,
    pub(crate) warnings: Counter,
    /// Each period's used share at decision.
    pub(crate) used: Vec<Histogram>,
    /// Refuse on a store error (else admit): a fail-closed denial, its
    /// periods unknown.
    pub(crate) refuse_on_store_error: bool,
    /// Whether decisions are also counted by route.
    #[cfg_attr(not(feature = "axum"), allow(dead_code))]
    pub(crate) route_label: bool,
}

impl Responder {
    fn reject(&self, rejected: &Rejected, d: Option<&QuotaDecision>) -> Response<Bytes> {
        let mut res = match &self.rejection {
            Some(f) if !rejected.grpc => f(rejected),
            _ => self.rendered.render(rejected),
        };
        if let Some(secs) = rejected.retry_after_secs() {
            let _ = res
                .headers_mut()
                .try_insert(http::header::RETRY_AFTER, http::HeaderValue::from(secs));
        }
        if let Some(d) = d {
            self.headers.apply(res.headers_mut(), d);
        }
        crate::rejection::mark(res)
    }

    /// Headers of an admitted response, and the soft limit's warning.
    fn admitted(&self, headers: &mut http::HeaderMap, d: &QuotaDecision) {
        self.headers.apply(headers, d);
        let Some(soft) = self.soft else { return };
        let used = |p: &tollgate_core::PeriodStatus| p.limit.saturating_sub(p.remaining);
        // Most responses warn of nothing: no buffer to clear for them.
        if !d
            .periods()
            .iter()
            .any(|p| crate::headers::is_past(used(p), p.limit, soft))
        {
            return;
        }
        let mut warn = Buf::<1024>::empty();
        for (name, p) in self.items.iter().zip(d.periods()) {
            crate::headers::push_warning(&mut warn, name, used(p), p.limit, soft);
        }
        if !warn.as_bytes().is_empty() {
            self.warnings.increment(1);
            if let Some(v) = warn.value() {
                let _ = headers.try_insert(field::quota_warning(), v);
            }
        }
    }
}

pub(crate) struct Shared<K, C, L> {
    pub(crate) key: K,
    pub(crate) cost: C,
    /// Each plan's limiter and responder (the default's when no plans).
    pub(crate) plans: PlanSet<(L, Arc<Responder>)>,
    pub(crate) keying: Keying,
    pub(crate) access: Option<Listed>,
    /// Whether a charge goes back when the request is not served.
    pub(crate) refund_unserved: bool,
}

impl<K, C, L> Shared<K, C, L> {
    /// The default plan's responder.
    pub(crate) fn responder(&self) -> &Arc<Responder> {
        &self.plans.default.1
    }
}

/// The service of [`QuotaLayer`](super::QuotaLayer).
pub struct QuotaService<S, K, C, St: QuotaStore> {
    inner: S,
    shared: Arc<Shared<K, C, St::QuotaLimiter>>,
}

impl<S: Clone, K, C, St: QuotaStore> Clone for QuotaService<S, K, C, St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S: std::fmt::Debug, K, C, St: QuotaStore> std::fmt::Debug for QuotaService<S, K, C, St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuotaService")
            .field("inner", &self.inner)
            .field("rule", &self.shared.responder().rule)
            .finish_non_exhaustive()
    }
}

impl<S, K, C, St: QuotaStore> QuotaService<S, K, C, St> {
    pub(crate) fn new(inner: S, shared: Arc<Shared<K, C, St::QuotaLimiter>>) -> Self {
        Self { inner, shared }
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, ReqB, D>
    where
        S: Service<Request<ReqB>>,
    {
        Deciding {
            #[pin]
            decide: D,
            waiting: Option<Box<(Request<ReqB>, S)>>,
            refund: Option<(RefundFn, u64)>,
        },
        Calling {
            #[pin]
            future: S::Future,
            decision: Option<QuotaDecision>,
            // Gives the charge (its cost) back if the request turns out
            // not to have been served (see `QuotaLayerBuilder::refund_unserved`).
            refund: Option<(RefundFn, u64)>,
        },
        Rejected {
            rejected: Option<(Rejected, Option<QuotaDecision>)>,
        },
    }
}

pin_project! {
    /// Response future of [`QuotaService`].
    pub struct ResponseFuture<S, ReqB, D>
    where
        S: Service<Request<ReqB>>,
    {
        #[pin]
        state: State<S, ReqB, D>,
        responder: Arc<Responder>,
    }
}

impl<S, ReqB, D> std::fmt::Debug for ResponseFuture<S, ReqB, D>
where
    S: Service<Request<ReqB>>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("rule", &self.responder.rule)
            .finish_non_exhaustive()
    }
}

impl<S, ReqB, D> State<S, ReqB, D>
where
    S: Service<Request<ReqB>>,
{
    /// Calling the inner service with no decision of this quota's (a
    /// store fault, a listed or keyless request let through).
    fn calling(future: S::Future) -> Self {
        Self::Calling {
            future,
            decision: None,
            refund: None,
        }
    }
}

/// `d` after `cost` was given back to each of its periods (at most to
/// the period's limit).
fn given_back(d: &QuotaDecision, cost: u64) -> QuotaDecision {
    let periods: Vec<_> = d
        .periods()
        .iter()
        .map(|p| tollgate_core::PeriodStatus {
            remaining: p.remaining.saturating_add(cost).min(p.limit),
            ..*p
        })
        .collect();
    QuotaDecision::new(d.outcome, &periods)
}

/// Whether a response says its request was not served: an inner limit
/// refused it (a tollgate [`Refusal`](crate::rejection::Refusal)), or the
/// service failed (a 5xx, or a gRPC status that maps to one).
fn unserved<B>(response: &Response<B>) -> bool {
    response
        .extensions()
        .get::<crate::rejection::Refusal>()
        .is_some()
        || crate::outcome::Completion::of(response)
            .status()
            .is_some_and(|s| s.is_server_error())
}

/// What follows a decision (or a store fault): call the inner service, or
/// refuse. `refund` gives an admitted request's charge back, if it is not
/// served.
fn decided<S, ReqB, D>(
    result: Result<QuotaDecision, StoreError>,
    request: Request<ReqB>,
    inner: &mut S,
    responder: &Responder,
    refund: impl FnOnce() -> Option<(RefundFn, u64)>,
) -> State<S, ReqB, D>
where
    S: Service<Request<ReqB>>,
{
    let m = &responder.metrics;
    let d = match result {
        Ok(d) => d,
        Err(error) => {
            m.store_error.increment(1);
            crate::observe::store_fault("quota", &responder.rule, &error);
            if !responder.refuse_on_store_error {
                return State::calling(inner.call(request));
            }
            // As a closed store answers: retry in a second. The periods'
            // state is unknown, so no `RateLimit` item is sent for them.
            QuotaDecision::new(
                Outcome::Deny {
                    retry_after: tollgate_core::CLOSED_RETRY_NS,
                },
                &[],
            )
        }
    };
    for (used, p) in responder.used.iter().zip(d.periods()) {
        if p.limit > 0 {
            #[allow(clippy::cast_precision_loss)] // a metric's value
            used.record(p.limit.saturating_sub(p.remaining) as f64 / p.limit as f64);
        }
    }
    #[cfg(feature = "axum")]
    if responder.route_label {
        let outcome = crate::observe::route_outcome(d.outcome, responder.shadow);
        crate::observe::count_route(&responder.rule, &request, outcome);
    }
    let reason = match d.outcome {
        Outcome::Allow { .. } => {
            m.allowed.increment(1);
            None
        }
        Outcome::Deny { .. } | Outcome::Never if responder.shadow => {
            m.shadow_limited.increment(1);
            None
        }
        Outcome::Deny { retry_after } => {
            m.limited.increment(1);
            m.retry_after
                .record(std::time::Duration::from_nanos(retry_after).as_secs_f64());
            Some(Reason::Limited)
        }
        Outcome::Never => {
            m.too_costly.increment(1);
            Some(Reason::TooCostly)
        }
    };
    match reason {
        None => State::Calling {
            future: inner.call(request),
            // A shadow quota charged nothing it enforces.
            refund: if d.is_allowed() { refund() } else { None },
            decision: Some(d),
        },
        Some(reason) => State::Rejected {
            rejected: Some((
                Rejected {
                    rule: Arc::clone(&responder.rule),
                    kind: LimitKind::Quota,
                    reason,
                    decision: Some(d.binding()),
                    grpc: is_grpc(&request),
                },
                Some(d),
            )),
        },
    }
}

impl<S, K, C, St: QuotaStore, ReqB, ResB> Service<Request<ReqB>> for QuotaService<S, K, C, St>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone,
    K: KeyExtractor<ReqB>,
    C: Cost<ReqB>,
    ResB: RejectionBody,
{
    type Response = Response<ResB>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqB, <St::QuotaLimiter as QuotaLimiter>::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let shared = &self.shared;
        let (limiter, responder) = shared.plans.of(&req);
        let responder = Arc::clone(responder);
        if !shared.keying.applies(&req) {
            let state = State::calling(self.inner.call(req));
            return ResponseFuture { state, responder };
        }
        if let Some(listed) = &shared.access {
            match listed.check(&req) {
                Access::Unlisted => {}
                Access::Allowed => {
                    let state = State::calling(self.inner.call(req));
                    return ResponseFuture { state, responder };
                }
                Access::Denied => {
                    let rejected = listed.denied(LimitKind::Quota, is_grpc(&req));
                    let state = State::Rejected {
                        rejected: Some((rejected, None)),
                    };
                    return ResponseFuture { state, responder };
                }
            }
        }
        let mut key = KeyBuf::new();
        let m = &responder.metrics;
        let extracted = shared.key.extract(&req, &mut key);
        match (shared.keying).resolve(
            extracted,
            &mut key,
            &responder.rule,
            Some((&m.unkeyed, &m.missing_key)),
        ) {
            Keyed::Key => {}
            Keyed::Skip => {
                let state = State::calling(self.inner.call(req));
                return ResponseFuture { state, responder };
            }
            Keyed::Reject => {
                let rejected = Rejected {
                    rule: Arc::clone(&responder.rule),
                    kind: LimitKind::Quota,
                    reason: Reason::MissingKey,
                    decision: None,
                    grpc: is_grpc(&req),
                };
                let state = State::Rejected {
                    rejected: Some((rejected, None)),
                };
                return ResponseFuture { state, responder };
            }
        }
        let cost = shared.cost.cost(&req);
        let refund = |key: &mut KeyBuf| -> Option<(RefundFn, u64)> {
            if !shared.refund_unserved || cost == 0 {
                return None;
            }
            let (limiter, key) = (limiter.clone(), KeyBytes::new(key));
            let run: RefundFn = Box::new(move || {
                crate::task::finish(limiter.refund(key.as_bytes(), cost));
            });
            Some((run, cost))
        };
        let state = match limiter.consume_sync(key.as_bytes(), cost) {
            Some(result) => decided(result, req, &mut self.inner, &responder, || {
                refund(&mut key)
            }),
            None => {
                // The clone-and-swap dance: the service polled ready serves
                // this request once the store has answered.
                let clone = self.inner.clone();
                let ready = std::mem::replace(&mut self.inner, clone);
                State::Deciding {
                    decide: limiter.consume(key.as_bytes(), cost),
                    waiting: Some(Box::new((req, ready))),
                    refund: refund(&mut key),
                }
            }
        };
        ResponseFuture { state, responder }
    }
}

impl<S, ReqB, ResB, D> Future for ResponseFuture<S, ReqB, D>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    D: Future<Output = Result<QuotaDecision, StoreError>>,
    ResB: RejectionBody,
{
    type Output = Result<Response<ResB>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let responder: &Responder = this.responder;
        loop {
            let next = match this.state.as_mut().project() {
                StateProj::Deciding {
                    decide,
                    waiting,
                    refund,
                } => {
                    let result = ready!(decide.poll(cx));
                    let Some(w) = waiting.take() else {
                        return Poll::Pending;
                    };
                    let (request, mut inner) = *w;
                    decided(result, request, &mut inner, responder, || refund.take())
                }
                StateProj::Calling {
                    future,
                    decision,
                    refund,
                } => {
                    let result = ready!(future.poll(cx));
                    let refund = refund.take();
                    let mut response = match result {
                        Ok(response) => response,
                        Err(e) => {
                            // Not served.
                            if let Some((refund, _)) = refund {
                                refund();
                            }
                            return Poll::Ready(Err(e));
                        }
                    };
                    let mut decision = decision.take();
                    if let Some((refund, cost)) = refund {
                        if unserved(&response) {
                            refund();
                            // The headers say what the key holds after it.
                            decision = decision.map(|d| given_back(&d, cost));
                        }
                    }
                    if let Some(d) = decision {
                        responder.admitted(response.headers_mut(), &d);
                    }
                    return Poll::Ready(Ok(response));
                }
                StateProj::Rejected { rejected } => {
                    let Some((rejected, d)) = rejected.take() else {
                        return Poll::Pending;
                    };
                    let response = responder.reject(&rejected, d.as_ref());
                    return Poll::Ready(Ok(response.map(ResB::rejection)));
                }
            };
            this.state.set(next);
        }
    }
}
