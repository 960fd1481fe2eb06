use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use http::{Request, Response};
use pin_project_lite::pin_project;
use tokio::time::Sleep;
use tollgate_core::{Decision, Outcome, StoreError};
use tower_service::Service;

use super::error::RateLimited;
use super::layer::Responder;
use crate::body::ResponseBody;
use crate::key::Fingerprint;
use crate::rejection::{Reason, Rejected};

pin_project! {
    /// The state machine shared by both modes:
    /// `Deciding -> (Pacing ->) Calling`, or `Rejected`.
    #[project = StateProj]
    pub(crate) enum State<S, ReqB, D>
    where
        S: Service<Request<ReqB>>,
    {
        Deciding {
            #[pin]
            decide: D,
            request: Option<Request<ReqB>>,
            inner: Option<S>,
            grpc: bool,
            key: Option<Fingerprint>,
        },
        Pacing {
            sleep: Pin<Box<Sleep>>,
            request: Option<Request<ReqB>>,
            inner: Option<S>,
            decision: Decision,
        },
        Calling {
            #[pin]
            future: S::Future,
            decision: Option<Decision>,
        },
        Rejected {
            rejected: Option<Rejected>,
        },
    }
}

pub(crate) enum Finished<R> {
    Response(R, Option<Decision>),
    Rejected(Rejected),
}

impl<S, ReqB, D> State<S, ReqB, D>
where
    S: Service<Request<ReqB>>,
{
    pub(crate) fn calling(future: S::Future) -> Self {
        Self::Calling {
            future,
            decision: None,
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
                    request,
                    inner,
                    grpc,
                    key,
                } => {
                    let result = ready!(decide.poll(cx));
                    let (Some(request), Some(mut inner)) = (request.take(), inner.take()) else {
                        return Poll::Pending;
                    };
                    match result {
                        Err(error) => {
                            // Never let a store fault fail the request.
                            tracing::warn!(
                                target: "tollgate",
                                rule = %responder.rule,
                                %error,
                                "rate limit store failed; letting the request through"
                            );
                            State::calling(inner.call(request))
                        }
                        Ok(decision) => match decision.outcome {
                            Outcome::Allow { delay: 0 } => State::Calling {
                                future: inner.call(request),
                                decision: Some(decision),
                            },
                            Outcome::Allow { delay } => State::Pacing {
                                sleep: Box::pin(tokio::time::sleep(
                                    std::time::Duration::from_nanos(delay),
                                )),
                                request: Some(request),
                                inner: Some(inner),
                                decision,
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
                                    State::Calling {
                                        future: inner.call(request),
                                        decision: Some(decision),
                                    }
                                } else {
                                    State::Rejected {
                                        rejected: Some(Rejected {
                                            rule: Arc::clone(&responder.rule),
                                            reason,
                                            decision: Some(decision),
                                            grpc: *grpc,
                                        }),
                                    }
                                }
                            }
                        },
                    }
                }
                StateProj::Pacing {
                    sleep,
                    request,
                    inner,
                    decision,
                } => {
                    ready!(sleep.as_mut().poll(cx));
                    let (Some(request), Some(mut inner)) = (request.take(), inner.take()) else {
                        return Poll::Pending;
                    };
                    State::Calling {
                        future: inner.call(request),
                        decision: Some(*decision),
                    }
                }
                StateProj::Calling { future, decision } => {
                    let response = ready!(future.poll(cx))?;
                    return Poll::Ready(Ok(Finished::Response(response, *decision)));
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
    /// Response future of [`RateLimit`](super::RateLimit).
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
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    D: Future<Output = Result<Decision, StoreError>>,
{
    type Output = Result<Response<ResponseBody<ResB>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let responder: &Responder = this.responder;
        Poll::Ready(Ok(match ready!(this.state.poll_state(cx, responder))? {
            Finished::Response(response, decision) => {
                let mut response = response.map(ResponseBody::inner);
                if let Some(d) = decision {
                    responder.headers.apply(response.headers_mut(), &d);
                }
                response
            }
            Finished::Rejected(rejected) => responder.reject(&rejected).map(ResponseBody::full),
        }))
    }
}

pin_project! {
    /// Response future of [`RateLimitErrors`](super::RateLimitErrors).
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
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    S::Error: Into<crate::BoxError>,
    D: Future<Output = Result<Decision, StoreError>>,
{
    type Output = Result<Response<ResB>, crate::BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let responder: &Responder = this.responder;
        match ready!(this.state.poll_state(cx, responder)).map_err(Into::into)? {
            Finished::Response(mut response, decision) => {
                if let Some(d) = decision {
                    responder.headers.apply(response.headers_mut(), &d);
                }
                Poll::Ready(Ok(response))
            }
            Finished::Rejected(rejected) => Poll::Ready(Err(Box::new(RateLimited(rejected)))),
        }
    }
}
