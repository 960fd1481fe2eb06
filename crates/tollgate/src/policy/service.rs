//! The policy service: keys, costs and decisions in `call`.

use std::fmt;
use std::future::{poll_fn, Future};
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tollgate_core::{Decision, Limiter, StoreError};
use tower_service::Service;

use super::access::Access;
use super::decide::{refund_consumed, settle, store_failed, Report, Verdict};
use super::future::{next, PolicyFuture, State};
use super::shared::{Keyed, Shared};
use crate::body::ResponseBody;
use crate::key::{KeyBuf, KeyBytes};
use crate::rate_limit::Inner;
use crate::rejection::is_grpc;

/// The service of [`PolicyLayer`](super::PolicyLayer).
pub struct Policy<S, B, L> {
    pub(super) inner: S,
    pub(super) shared: Arc<Shared<B, L>>,
}

impl<S: Clone, B, L> Clone for Policy<S, B, L> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S: fmt::Debug, B, L> fmt::Debug for Policy<S, B, L> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Policy")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

/// Owned keys of the response-aware rules that consumed.
fn response_keys<B, L>(
    shared: &Shared<B, L>,
    report: &Report,
    req: &Request<B>,
) -> Vec<(usize, KeyBytes)> {
    let mut keys = Vec::new();
    for (i, (rule, slot)) in shared.rules.iter().zip(&report.decided).enumerate() {
        if rule.count_if.is_some() && slot.is_some() {
            let mut key = KeyBuf::new();
            if rule.key_again(req, &mut key) {
                keys.push((i, KeyBytes::new(&mut key)));
            }
        }
    }
    keys
}

/// Owned keys of the rules that consumed, extracted again.
fn owned_keys<B, L>(
    shared: &Shared<B, L>,
    report: &Report,
    req: &Request<B>,
) -> Vec<(usize, KeyBytes)> {
    let mut keys = Vec::new();
    for (i, (rule, slot)) in shared.rules.iter().zip(&report.decided).enumerate() {
        if slot.is_some() {
            let mut key = KeyBuf::new();
            if rule.key_again(req, &mut key) {
                keys.push((i, KeyBytes::new(&mut key)));
            }
        }
    }
    keys
}

impl<S, B, L, ResB> Service<Request<B>> for Policy<S, B, L>
where
    S: Service<Request<B>, Response = Response<ResB>> + Clone + Send + 'static,
    B: Send + 'static,
    L: Limiter,
{
    type Response = Response<ResponseBody<ResB>>;
    type Error = S::Error;
    type Future = PolicyFuture<S, B, L>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let shared = &self.shared;
        let grpc = is_grpc(&req);
        let mut report = Report::new();
        report.plan = shared.plans.of(&req);
        if let Some((list, metrics, _)) = &shared.access {
            match list.check(&req) {
                Access::Unlisted => {}
                Access::Denied => {
                    metrics.denied.increment(1);
                    let state = State::Rejected {
                        verdict: Verdict::Denied,
                    };
                    return self.finish(state, report, grpc);
                }
                Access::Allowed => {
                    metrics.listed_allowed.increment(1);
                    let future = self.inner.call(req);
                    return self.finish(State::Calling { future }, report, grpc);
                }
            }
        }
        for (i, rule) in shared.rules.iter().enumerate() {
            let mut key = KeyBuf::new();
            match rule.key(&req, &mut key) {
                Keyed::Key => {}
                Keyed::Skip => continue,
                Keyed::Reject => {
                    refund_consumed(shared, &report, |j, f| {
                        let mut k = KeyBuf::new();
                        if shared
                            .rules
                            .get(j)
                            .is_some_and(|r| r.key_again(&req, &mut k))
                        {
                            f(k.as_bytes());
                        }
                    });
                    return self.finish(
                        State::Rejected {
                            verdict: Verdict::MissingKey { rule: i },
                        },
                        report,
                        grpc,
                    );
                }
            }
            let cost = rule.rule.cost(&req);
            match rule.at(report.plan).0.decide_sync(key.as_bytes(), cost) {
                Some(Ok(d)) => report.set(i, d, cost, rule.shadows(key.as_bytes())),
                Some(Err(e)) => store_failed(rule, &e),
                None => return self.decide_async(req, report, i, grpc),
            }
        }
        let verdict = settle(shared, &mut report);
        if let Verdict::Deny { .. } = verdict {
            refund_consumed(shared, &report, |j, f| {
                let mut k = KeyBuf::new();
                if shared
                    .rules
                    .get(j)
                    .is_some_and(|r| r.key_again(&req, &mut k))
                {
                    f(k.as_bytes());
                }
            });
        }
        // Response-aware rules need their keys once the response is in.
        let after = (shared.response_aware && matches!(verdict, Verdict::Pass { .. }))
            .then(|| response_keys(shared, &report, &req));
        let state = next(
            &self.shared,
            &report,
            verdict,
            req,
            Inner::Borrowed(&mut self.inner),
            |req| owned_keys(&self.shared, &report, req),
        );
        let mut future = self.finish(state, report, grpc);
        future.after = after;
        future
    }
}

impl<S, B, L, ResB> Policy<S, B, L>
where
    S: Service<Request<B>, Response = Response<ResB>> + Clone + Send + 'static,
    B: Send + 'static,
    L: Limiter,
{
    fn finish(&self, state: State<S, B>, report: Report, grpc: bool) -> PolicyFuture<S, B, L> {
        PolicyFuture {
            state,
            report,
            grpc,
            shared: Arc::clone(&self.shared),
            after: None,
        }
    }

    /// The path of a store that needs I/O: rules `from` on are decided
    /// concurrently (the earlier ones, if any, answered at once), then
    /// judged together; a denial refunds what the others consumed.
    fn decide_async(
        &mut self,
        req: Request<B>,
        mut report: Report,
        from: usize,
        grpc: bool,
    ) -> PolicyFuture<S, B, L> {
        let shared = Arc::clone(&self.shared);
        // Every rule's key first: a rule that refuses a keyless request
        // must do so before any store call is under way.
        let mut keys: Vec<(usize, KeyBytes)> = Vec::with_capacity(shared.rules.len());
        for (i, rule) in shared.rules.iter().enumerate() {
            let mut key = KeyBuf::new();
            // Rules before `from` were keyed once already: no second
            // missing-key count.
            let keyed = if i < from {
                rule.key_again(&req, &mut key)
            } else {
                match rule.key(&req, &mut key) {
                    Keyed::Key => true,
                    Keyed::Skip => false,
                    Keyed::Reject => {
                        // Refund the rules answered at once, and refuse.
                        refund_consumed(&shared, &report, |j, f| {
                            if let Some((_, k)) = keys.iter().find(|(x, _)| *x == j) {
                                f(k.as_bytes());
                            }
                        });
                        return self.finish(
                            State::Rejected {
                                verdict: Verdict::MissingKey { rule: i },
                            },
                            report,
                            grpc,
                        );
                    }
                }
            };
            if keyed {
                keys.push((i, KeyBytes::new(&mut key)));
            }
        }
        let pending: Vec<_> = keys
            .iter()
            .filter(|(i, _)| *i >= from)
            .filter_map(|(i, key)| {
                let rule = shared.rules.get(*i)?;
                let cost = rule.rule.cost(&req);
                Some((
                    *i,
                    cost,
                    rule.shadows(key.as_bytes()),
                    Box::pin(rule.at(report.plan).0.decide(key.as_bytes(), cost)),
                ))
            })
            .collect();
        let decide = Box::pin({
            let shared = Arc::clone(&shared);
            async move {
                let mut pending = pending;
                let mut results: Vec<Option<Result<Decision, StoreError>>> =
                    pending.iter().map(|_| None).collect();
                poll_fn(|cx| {
                    let mut waiting = false;
                    for ((_, _, _, fut), result) in pending.iter_mut().zip(results.iter_mut()) {
                        if result.is_none() {
                            match fut.as_mut().poll(cx) {
                                Poll::Ready(r) => *result = Some(r),
                                Poll::Pending => waiting = true,
                            }
                        }
                    }
                    if waiting {
                        Poll::Pending
                    } else {
                        Poll::Ready(())
                    }
                })
                .await;
                for ((i, cost, shadow, _), result) in pending.iter().zip(results) {
                    let Some(rule) = shared.rules.get(*i) else {
                        continue;
                    };
                    match result {
                        Some(Ok(d)) => report.set(*i, d, *cost, *shadow),
                        Some(Err(e)) => store_failed(rule, &e),
                        None => {}
                    }
                }
                let verdict = settle(&shared, &mut report);
                if let Verdict::Deny { .. } = verdict {
                    refund_consumed(&shared, &report, |j, f| {
                        if let Some((_, k)) = keys.iter().find(|(x, _)| *x == j) {
                            f(k.as_bytes());
                        }
                    });
                }
                (report, verdict, keys)
            }
        });
        // The clone-and-swap dance: the service that was polled ready
        // serves this request; a fresh clone waits for the next poll_ready.
        let clone = self.inner.clone();
        let ready = std::mem::replace(&mut self.inner, clone);
        self.finish(
            State::Deciding {
                decide,
                waiting: Some(Box::new((req, ready))),
            },
            report,
            grpc,
        )
    }
}
