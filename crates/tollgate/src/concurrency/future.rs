use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use http::{Request, Response};
use pin_project_lite::pin_project;
use tokio::time::Sleep;
use tower_service::Service;

use super::adaptive::Adaptive;
use super::admission::{Admission, Admitted};
use super::limits::BoxFuture;
use super::permit::{Lifetime, PermitBody, Sampling};
use super::respond::{Items, Responder};
use crate::body::RejectionBody;
use crate::outcome::Completion;
use crate::rejection::{LimitKind, Reason, Rejected};

pin_project! {
    /// `Admitting -> Calling`, or `Rejected`. On the in-memory fast path a
    /// request starts in `Calling`: no box, no clone of the inner service.
    #[project = StateProj]
    pub(crate) enum State<S, ReqB>
    where
        S: Service<Request<ReqB>>,
    {
        // Waiting for the store, or for a turn in the queue. The inner
        // service waits unready (its reservation released), to be polled
        // ready once admitted.
        Admitting {
            admit: BoxFuture<Admission>,
            waiting: Option<Box<(Request<ReqB>, S)>>,
        },
        // Admitted: now the inner service may reserve.
        Readying {
            admitted: Option<Admitted>,
            waiting: Option<Box<(Request<ReqB>, S)>>,
        },
        Calling {
            #[pin]
            future: S::Future,
            admitted: Option<Admitted>,
            // The permit's capped lifetime, which ends the wait for the
            // handler too; and whether the request is gRPC (its answer
            // then).
            expires: Option<Box<(Pin<Box<Sleep>>, bool)>>,
        },
        Rejected {
            rejected: Option<(Rejected, Items)>,
        },
    }
}

impl<S, ReqB> State<S, ReqB>
where
    S: Service<Request<ReqB>>,
{
    /// Calls `inner` with `req`: the request's handler, bounded by its
    /// permit's lifetime where the layer caps it (`capped`).
    #[inline]
    pub(crate) fn calling(
        inner: &mut S,
        req: Request<ReqB>,
        admitted: Option<Admitted>,
        capped: bool,
    ) -> Self {
        // (The content type is read only where a lifetime is capped.)
        let expires = admitted
            .as_ref()
            .filter(|_| capped)
            .and_then(Admitted::expires_at)
            .map(|until| {
                let grpc = crate::rejection::is_grpc(&req);
                Box::new((Box::pin(tokio::time::sleep_until(until)), grpc))
            });
        State::Calling {
            future: inner.call(req),
            admitted,
            expires,
        }
    }
}

pin_project! {
    /// Response future of [`ConcurrencyService`](super::ConcurrencyLimit).
    /// Dropping it (the client went away, a timeout above gave up) releases
    /// the request's permit at once.
    pub struct ResponseFuture<S, ReqB>
    where
        S: Service<Request<ReqB>>,
    {
        #[pin]
        state: State<S, ReqB>,
        responder: Arc<Responder>,
    }
}

impl<S, ReqB> ResponseFuture<S, ReqB>
where
    S: Service<Request<ReqB>>,
{
    pub(crate) fn new(state: State<S, ReqB>, responder: Arc<Responder>) -> Self {
        Self { state, responder }
    }
}

impl<S, ReqB> std::fmt::Debug for ResponseFuture<S, ReqB>
where
    S: Service<Request<ReqB>>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("rule", &self.responder.name)
            .finish_non_exhaustive()
    }
}

impl<S, ReqB, ResB> Future for ResponseFuture<S, ReqB>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    ResB: RejectionBody,
{
    type Output = Result<Response<PermitBody<ResB>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let responder: &Responder = this.responder;
        loop {
            let next = match this.state.as_mut().project() {
                StateProj::Admitting { admit, waiting } => {
                    let admission = ready!(admit.as_mut().poll(cx));
                    if let Some(w) = waiting.as_ref() {
                        responder.count_route(&w.0, &admission);
                    }
                    match admission {
                        Admission::Go(mut admitted) => {
                            // Its lifetime counts from now, not from when
                            // the inner service is ready.
                            admitted.cap(responder);
                            State::Readying {
                                admitted: Some(admitted),
                                waiting: waiting.take(),
                            }
                        }
                        Admission::Reject(rejected, items) => State::Rejected {
                            rejected: Some((rejected, items)),
                        },
                        // `admit` never defers again; let it through.
                        Admission::Defer(..) => State::Readying {
                            admitted: None,
                            waiting: waiting.take(),
                        },
                    }
                }
                StateProj::Readying { admitted, waiting } => {
                    let Some(w) = waiting.as_mut() else {
                        return Poll::Pending;
                    };
                    // An error is returned with the admission still in
                    // this state: its permit goes back when the caller
                    // drops the future (at once, in every server).
                    ready!(w.1.poll_ready(cx))?;
                    let Some(w) = waiting.take() else {
                        return Poll::Pending;
                    };
                    let (mut request, mut inner) = *w;
                    let mut admitted = admitted.take();
                    if let Some(a) = &mut admitted {
                        a.offer(responder, &mut request);
                    }
                    State::calling(&mut inner, request, admitted, responder.lifetime.is_some())
                }
                StateProj::Calling {
                    future,
                    admitted,
                    expires,
                } => {
                    let result = match future.poll(cx) {
                        Poll::Ready(result) => result,
                        Poll::Pending => {
                            let Some((sleep, grpc)) = expires.as_deref_mut() else {
                                return Poll::Pending;
                            };
                            ready!(sleep.as_mut().poll(cx));
                            // The permit's lifetime ended before the
                            // handler answered (a long poll): the handler
                            // is given up, the permit goes back now, and
                            // the client is told to come again.
                            drop(admitted.take());
                            if let Some((_, ended)) = &responder.lifetime {
                                ended.increment(1);
                            }
                            let expired = Rejected {
                                rule: Arc::clone(&responder.name),
                                kind: LimitKind::Concurrency,
                                reason: Reason::Expired,
                                decision: None,
                                grpc: *grpc,
                            };
                            let response = responder.reject(&expired, &Items::new(0));
                            return Poll::Ready(Ok(
                                response.map(|b| PermitBody::new(ResB::rejection(b), None, None))
                            ));
                        }
                    };
                    // Read in place: only the permit moves on, to the
                    // body (the rest goes with this future, dropped next).
                    let sampling = match (&responder.adaptive, admitted.as_mut()) {
                        (Some(adaptive), Some(a)) => sample_at_head(adaptive, a, &result),
                        _ => None,
                    };
                    let mut response = match result {
                        Ok(response) => response,
                        Err(e) => {
                            drop(admitted.take());
                            return Poll::Ready(Err(e));
                        }
                    };
                    let Some(admitted) = admitted.as_mut() else {
                        return Poll::Ready(Ok(response.map(|b| PermitBody::new(b, None, None))));
                    };
                    responder
                        .headers
                        .apply(response.headers_mut(), admitted.items.as_slice());
                    let lifetime = responder.lifetime.as_ref().and_then(|(_, ended)| {
                        let grpc = Completion::of(&response).awaits_trailers(response.headers());
                        Lifetime::of(admitted.permit.as_ref(), grpc, ended)
                    });
                    let holding = admitted.permit.take();
                    return Poll::Ready(Ok(
                        response.map(|b| PermitBody::new(b, holding, sampling).lasting(lifetime))
                    ));
                }
                StateProj::Rejected { rejected } => {
                    let Some((rejected, items)) = rejected.take() else {
                        return Poll::Pending;
                    };
                    let response = responder.reject(&rejected, &items);
                    return Poll::Ready(Ok(
                        response.map(|b| PermitBody::new(ResB::rejection(b), None, None))
                    ));
                }
            };
            this.state.set(next);
        }
    }
}

/// At the response's head, for an adaptive limit: gives the adaptive
/// permits back (the limit counts a request until its head, the interval
/// its latency measures, so long bodies cannot fill it), and feeds the
/// sample — now, or, for a gRPC answer whose status comes in the trailers,
/// at the body's end (what is returned, for the body to finish).
fn sample_at_head<B, E>(
    adaptive: &Arc<Adaptive>,
    admitted: &mut Admitted,
    result: &Result<Response<B>, E>,
) -> Option<Box<Sampling>> {
    release_adaptive(adaptive, admitted);
    let rtt = Adaptive::rtt_since(admitted.started.get()?);
    let completion = match result {
        Ok(res) => {
            let completion = Completion::of(res);
            if completion.awaits_trailers(res.headers()) {
                return Some(Box::new(Sampling::new(Arc::clone(adaptive), rtt)));
            }
            completion
        }
        Err(_) => Completion::Error,
    };
    adaptive.complete(rtt, completion);
    None
}

/// Gives the adaptive limit's permits of `admitted` back, if it holds any.
fn release_adaptive(adaptive: &Adaptive, admitted: &mut Admitted) {
    let permits = admitted.take_adaptive();
    if permits > 0 {
        adaptive.release(permits);
    }
    drop(admitted.adaptive.take());
}
