use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use pin_project_lite::pin_project;
use tokio::time::Sleep;
use tollgate_core::{Decision, Outcome, StoreError};
use tower_service::Service;

use super::error::RateLimited;
use super::shared::Responder;
use super::Settle;
use crate::body::RejectionBody;
use crate::key::Fingerprint;
use crate::rejection::{is_grpc, LimitKind, Reason, Rejected};

pin_project! {
    /// The state machine shared by both modes:
    /// `Deciding -> (Pacing ->) Calling`, or `Rejected`.
    #[project = StateProj]
    pub(crate) enum State<S, ReqB, D>
    where
        S: Service<Request<ReqB>>,
    {
        // The request and service wait in a box on the asynchronous
        // paths, so the future stays small on the synchronous one.
        Deciding {
            #[pin]
            decide: D,
            waiting: Option<Box<(Request<ReqB>, S)>>,
            key: Option<Fingerprint>,
            refund: Option<RefundFn>,
            settle: Option<Box<Settle>>,
        },
        Pacing {
            sleep: Pin<Box<Sleep>>,
            waiting: Option<Box<(Request<ReqB>, S)>>,
            decision: Decision,
            // Gives the cost back if the request is cancelled while it
            // waits its turn; defused once it goes.
            refund: Refund,
            settle: Option<Box<Settle>>,
        },
        Calling {
            #[pin]
            future: S::Future,
            decision: Option<Decision>,
            // What it really cost, settled once its response is known.
            settle: Option<Box<Settle>>,
        },
        Rejected {
            rejected: Option<Rejected>,
        },
    }
}

/// The service a decided request goes to: the caller's (when deciding
/// synchronously in `call`) or the swapped-out clone (after an async
/// decision).
pub(crate) enum Inner<'a, S> {
    Borrowed(&'a mut S),
    Owned(S),
}

impl<S: Clone> Inner<'_, S> {
    pub(crate) fn call<ReqB>(self, request: Request<ReqB>) -> S::Future
    where
        S: Service<Request<ReqB>>,
    {
        match self {
            Inner::Borrowed(s) => s.call(request),
            Inner::Owned(mut s) => s.call(request),
        }
    }

    /// A clone to call after a wait, polled ready only then. The ready
    /// service is dropped, so whatever it reserved (a permit, a buffer
    /// slot) is free while the request waits its turn; the caller keeps an
    /// unready clone, to poll ready before its next call as Tower requires.
    pub(crate) fn clone_for_later(self) -> S {
        match self {
            Inner::Borrowed(s) => {
                let later = s.clone();
                drop(std::mem::replace(s, later.clone()));
                later
            }
            Inner::Owned(s) => s.clone(),
        }
    }
}

/// A paced request's wait: once `sleep` is over (a finished sleep stays
/// ready when polled again), its cost stays spent even if the inner
/// service keeps it waiting; then the inner service is polled ready and
/// called. Shared by the rate-limit and policy futures.
pub(crate) fn poll_paced<S, ReqB>(
    cx: &mut Context<'_>,
    sleep: &mut Pin<Box<Sleep>>,
    waiting: &mut Option<Box<(Request<ReqB>, S)>>,
    refund: &mut Refund,
) -> Poll<Result<S::Future, S::Error>>
where
    S: Service<Request<ReqB>>,
{
    ready!(sleep.as_mut().poll(cx));
    refund.defuse();
    let Some(w) = waiting.as_mut() else {
        return Poll::Pending;
    };
    ready!(w.1.poll_ready(cx))?;
    let Some(waiting) = waiting.take() else {
        return Poll::Pending;
    };
    let (request, mut inner) = *waiting;
    Poll::Ready(Ok(inner.call(request)))
}

/// Gives a paced request's cost back to the store; built only for pacing
/// rules (the leaky bucket).
pub(crate) type RefundFn = Box<dyn FnOnce() + Send>;

/// Runs its refund when dropped, unless defused: a paced request that is
/// cancelled during its delay gives its slot in the queue back.
pub(crate) struct Refund(pub(crate) Option<RefundFn>);

impl Refund {
    pub(crate) fn defuse(&mut self) {
        self.0 = None;
    }

    /// Whether the cost stays spent whatever happens now (defused, or
    /// nothing to give back).
    pub(crate) fn is_defused(&self) -> bool {
        self.0.is_none()
    }
}

impl Drop for Refund {
    fn drop(&mut self) {
        if let Some(refund) = self.0.take() {
            refund();
        }
    }
}

/// The state that follows a decision (or a store failure). `refund`
/// gives the cost back, for a paced request that is cancelled while it
/// waits.
#[allow(clippy::too_many_arguments)]
pub(crate) fn decided<S, ReqB, D>(
    result: Result<Decision, StoreError>,
    request: Request<ReqB>,
    inner: Inner<'_, S>,
    responder: &Responder,
    key: Option<Fingerprint>,
    refund: impl FnOnce() -> Option<RefundFn>,
    settle: Option<Box<Settle>>,
) -> State<S, ReqB, D>
where
    S: Service<Request<ReqB>> + Clone,
{
    let decision = match result {
        Ok(decision) => decision,
        Err(error) => {
            responder.metrics.store_error.increment(1);
            crate::observe::store_fault("rate", &responder.rule, &error);
            // Admitted (the default), or refused as a closed store would
            // (below). Either way nothing was charged.
            match responder.on_store_error {
                Some(closed) => closed,
                None => {
                    if let Some(s) = settle {
                        s.unpaid();
                    }
                    return State::calling(inner.call(request));
                }
            }
        }
    };
    // A refusal charged nothing either.
    let settle = match (decision.is_allowed(), settle) {
        (true, settle) => settle,
        (false, Some(s)) => {
            s.unpaid();
            None
        }
        (false, None) => None,
    };
    let m = &responder.metrics;
    m.record_remaining(&decision);
    match decision.outcome {
        Outcome::Allow { .. } => m.allowed.increment(1),
        Outcome::Deny { .. } | Outcome::Never if responder.shadow => m.shadow_limited.increment(1),
        Outcome::Deny { retry_after } => {
            m.limited.increment(1);
            m.retry_after
                .record(Duration::from_nanos(retry_after).as_secs_f64());
        }
        Outcome::Never => m.too_costly.increment(1),
    }
    #[cfg(feature = "axum")]
    if responder.route_label {
        let outcome = crate::observe::route_outcome(decision.outcome, responder.shadow);
        crate::observe::count_route(&responder.rule, &request, outcome);
    }
    match decision.outcome {
        // Shadow mode decides but never holds a request back, and sends no
        // headers that would make a client back off.
        Outcome::Allow { .. } if responder.shadow => State::Calling {
            future: inner.call(request),
            decision: None,
            settle: settle.map(Settle::calling),
        },
        Outcome::Allow { delay: 0 } => State::Calling {
            future: inner.call(request),
            decision: Some(decision),
            settle: settle.map(Settle::calling),
        },
        // Needs tokio's timer (a runtime with time enabled, as axum's and
        // tonic's servers have).
        Outcome::Allow { delay } => State::Pacing {
            sleep: Box::pin(tokio::time::sleep(Duration::from_nanos(delay))),
            waiting: Some(Box::new((request, inner.clone_for_later()))),
            decision,
            refund: Refund(refund()),
            settle,
        },
        Outcome::Deny { .. } | Outcome::Never => {
            let reason = if decision.outcome == Outcome::Never {
                Reason::TooCostly
            } else {
                Reason::Limited
            };
            if let Some(key) = key {
                tracing::debug!(
                    target: "tollgate",
                    rule = %responder.rule,
                    key = %key,
                    ?reason,
                    shadow = responder.shadow,
                    "request over its limit"
                );
            }
            if responder.shadow {
                State::calling(inner.call(request))
            } else {
                State::Rejected {
                    rejected: Some(Rejected {
                        rule: Arc::clone(&responder.rule),
                        kind: LimitKind::Rate,
                        reason,
                        decision: Some(decision),
                        // Read only for a rejection: the allowed path
                        // never looks at the content type.
                        grpc: is_grpc(&request),
                    }),
                }
            }
        }
    }
}

pub(crate) enum Finished<R> {
    Response(R, Option<Decision>, Option<Box<Settle>>),
    Rejected(Rejected),
}

impl<S, ReqB, D> State<S, ReqB, D>
where
    S: Service<Request<ReqB>> + Clone,
{
    pub(crate) fn calling(future: S::Future) -> Self {
        Self::Calling {
            future,
            decision: None,
            settle: None,
        }
    }

    fn poll_state(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        responder: &Responder,
    ) -> Poll<Result<Finished<S::Response>, S::Error>>
    where
        D: Future<Output = Result<Decision, StoreError>>,
    {
        loop {
            let next = match self.as_mut().project() {
                StateProj::Deciding {
                    decide,
                    waiting,
                    key,
                    refund,
                    settle,
                } => {
                    let result = ready!(decide.poll(cx));
                    let Some(waiting) = waiting.take() else {
                        return Poll::Pending;
                    };
                    let (request, inner) = *waiting;
                    let refund = refund.take();
                    decided(
                        result,
                        request,
                        Inner::Owned(inner),
                        responder,
                        *key,
                        || refund,
                        settle.take(),
                    )
                }
                StateProj::Pacing {
                    sleep,
                    waiting,
                    decision,
                    refund,
                    settle,
                } => {
                    let called = poll_paced(cx, sleep, waiting, refund);
                    // Its wait is over: the charge stands, the debt paid
                    // with it too (even if the service is never ready).
                    if let (true, Some(s)) = (refund.is_defused(), settle.as_mut()) {
                        s.keep();
                    }
                    State::Calling {
                        future: ready!(called)?,
                        decision: Some(*decision),
                        settle: settle.take().map(Settle::calling),
                    }
                }
                StateProj::Calling {
                    future,
                    decision,
                    settle,
                } => {
                    let response = ready!(future.poll(cx))?;
                    return Poll::Ready(Ok(Finished::Response(response, *decision, settle.take())));
                }
                StateProj::Rejected { rejected } => {
                    return match rejected.take() {
                        Some(r) => Poll::Ready(Ok(Finished::Rejected(r))),
                        None => Poll::Pending,
                    };
                }
            };
            self.set(next);
        }
    }
}

pin_project! {
    /// Response future of [`RateLimitService`](super::RateLimit).
    pub struct ResponseFuture<S, ReqB, D>
    where
        S: Service<Request<ReqB>>,
    {
        #[pin]
        state: State<S, ReqB, D>,
        responder: Arc<Responder>,
    }
}

impl<S, ReqB, D> ResponseFuture<S, ReqB, D>
where
    S: Service<Request<ReqB>>,
{
    pub(crate) fn new(state: State<S, ReqB, D>, responder: Arc<Responder>) -> Self {
        Self { state, responder }
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

impl<S, ReqB, ResB, D> Future for ResponseFuture<S, ReqB, D>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone,
    D: Future<Output = Result<Decision, StoreError>>,
    ResB: RejectionBody,
{
    type Output = Result<Response<ResB>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let responder: &Responder = this.responder;
        Poll::Ready(Ok(match ready!(this.state.poll_state(cx, responder))? {
            Finished::Response(response, decision, settle) => {
                let mut response = response;
                if let Some(s) = settle {
                    s.finish(&response);
                }
                if let Some(d) = decision {
                    responder.headers.apply(response.headers_mut(), &d, false);
                }
                response
            }
            Finished::Rejected(rejected) => responder.reject(&rejected).map(ResB::rejection),
        }))
    }
}

pin_project! {
    /// Response future of [`RateLimitErrorService`](super::RateLimitErrorService).
    pub struct ErrorFuture<S, ReqB, D>
    where
        S: Service<Request<ReqB>>,
    {
        #[pin]
        state: State<S, ReqB, D>,
        responder: Arc<Responder>,
    }
}

impl<S, ReqB, D> ErrorFuture<S, ReqB, D>
where
    S: Service<Request<ReqB>>,
{
    pub(crate) fn new(state: State<S, ReqB, D>, responder: Arc<Responder>) -> Self {
        Self { state, responder }
    }
}

impl<S, ReqB, D> std::fmt::Debug for ErrorFuture<S, ReqB, D>
where
    S: Service<Request<ReqB>>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ErrorFuture")
            .field("rule", &self.responder.rule)
            .finish_non_exhaustive()
    }
}

impl<S, ReqB, ResB, D> Future for ErrorFuture<S, ReqB, D>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone,
    S::Error: Into<crate::BoxError>,
    D: Future<Output = Result<Decision, StoreError>>,
{
    type Output = Result<Response<ResB>, crate::BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let responder: &Responder = this.responder;
        match ready!(this.state.poll_state(cx, responder)).map_err(Into::into)? {
            Finished::Response(mut response, decision, settle) => {
                if let Some(s) = settle {
                    s.finish(&response);
                }
                if let Some(d) = decision {
                    responder.headers.apply(response.headers_mut(), &d, false);
                }
                Poll::Ready(Ok(response))
            }
            Finished::Rejected(rejected) => {
                let response = responder.reject(&rejected);
                Poll::Ready(Err(Box::new(RateLimited::new(rejected, response))))
            }
        }
    }
}
