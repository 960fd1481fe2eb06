//! The policy service: the access lists, then a request's walk through
//! the rules ([`Walk`]).

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tollgate_core::Store;
use tower_service::Service;

use super::access::Access;
use super::decide::{audit_denied, Report, Verdict};
use super::future::{next, PolicyFuture, State};
use super::shared::Current;
use super::walk::Walk;
use crate::body::RejectionBody;
use crate::rate_limit::Inner;
use crate::rejection::is_grpc;

/// The service of [`PolicyLayer`](super::PolicyLayer).
pub struct PolicyService<S, B, St: Store> {
    pub(super) inner: S,
    /// The policy now (read once per request; a reload swaps it).
    pub(super) current: Arc<Current<B, St::Limiter>>,
}

impl<S: Clone, B, St: Store> Clone for PolicyService<S, B, St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            current: Arc::clone(&self.current),
        }
    }
}

impl<S: fmt::Debug, B, St: Store> fmt::Debug for PolicyService<S, B, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PolicyService")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, B, St: Store, ResB> Service<Request<B>> for PolicyService<S, B, St>
where
    S: Service<Request<B>, Response = Response<ResB>> + Clone + Send + 'static,
    B: Send + 'static,
    ResB: RejectionBody,
{
    type Response = Response<ResB>;
    type Error = S::Error;
    type Future = PolicyFuture<S, B, St::Limiter>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    /// One request, top to bottom: the access lists, then the walk
    /// through the rules (keys extracted once; ladders,
    /// idempotency, challenges, rules, escalation), at once where the
    /// store answers at once, else in the future.
    fn call(&mut self, req: Request<B>) -> Self::Future {
        // The policy now: a request decided by it finishes on it, whatever
        // a reload does meanwhile.
        let shared = self.current.load();
        let grpc = is_grpc(&req);
        if let Some(listed) = &shared.access {
            match listed.check(&req) {
                Access::Unlisted => {}
                Access::Denied => {
                    audit_denied(&shared, &req);
                    let state = State::Rejected {
                        verdict: Verdict::Denied,
                    };
                    return PolicyFuture::new(shared, state, Report::new(), grpc);
                }
                Access::Allowed => {
                    let future = self.inner.call(req);
                    let state = State::Calling { future };
                    return PolicyFuture::new(shared, state, Report::new(), grpc);
                }
            }
        }
        let mut walk = Walk::start(&shared, &req);
        match walk.advance(&shared) {
            None => {
                let state = next(&shared, &mut walk, req, Inner::Borrowed(&mut self.inner));
                let mut future = PolicyFuture::new(shared, state, walk.report, grpc);
                future.follow(&mut walk);
                future
            }
            Some(io) => {
                let decide = Box::pin(walk.decide(Arc::clone(&shared), io));
                // The clone-and-swap dance: the service that was polled
                // ready serves this request; a fresh clone waits for the
                // next poll_ready.
                let clone = self.inner.clone();
                let ready = std::mem::replace(&mut self.inner, clone);
                let state = State::Deciding {
                    decide,
                    waiting: Some(Box::new((req, ready))),
                };
                PolicyFuture::new(shared, state, Report::new(), grpc)
            }
        }
    }
}
