//! The policy's response future: deciding, pacing, calling, rejecting.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tokio::time::Sleep;
use tollgate_core::{Decision, Limiter, Outcome};
use tower_service::Service;

use super::decide::{pacing_refund, release_marker, settle_response, Report, Verdict};
use super::shared::{Shared, MAX_RULES};
use super::walk::Walk;
use crate::body::RejectionBody;
use crate::headers::apply_set;
use crate::key::KeyBytes;
use crate::outcome::Completion;
use crate::rate_limit::{poll_paced, Inner, MessageBudget, Refund, Settle};
use crate::rejection::{LimitKind, Reason, Rejected};

/// A walk waiting for its store.
pub(super) type Deciding = Pin<Box<dyn Future<Output = Walk> + Send>>;

pin_project! {
    #[project = StateProj]
    pub(super) enum State<S, B>
    where
        S: Service<Request<B>>,
    {
        Deciding {
            decide: Deciding,
            waiting: Option<Box<(Request<B>, S)>>,
        },
        Pacing {
            sleep: Pin<Box<Sleep>>,
            waiting: Option<Box<(Request<B>, S)>>,
            refund: Refund,
        },
        Calling {
            #[pin]
            future: S::Future,
        },
        Rejected {
            verdict: Verdict,
        },
    }
}

pin_project! {
    /// Response future of [`PolicyService`](super::PolicyService).
    pub struct PolicyFuture<S, B, L>
    where
        S: Service<Request<B>>,
        L: Limiter,
    {
        #[pin]
        pub(super) state: State<S, B>,
        pub(super) report: Report,
        pub(super) grpc: bool,
        pub(super) shared: Arc<Shared<B, L>>,
        // The keys of response-aware rules, and a taken idempotency
        // marker's, kept until the response.
        pub(super) after: Option<Vec<(usize, KeyBytes)>>,
        // A refusal's challenge, for the rule's key.
        pub(super) challenge: Option<http::HeaderValue>,
        // The settlements of the rules that charge what the request
        // really cost, once its response is known (dropped without one,
        // each settles as `Settle` says).
        pub(super) settles: Vec<(usize, Settle)>,
    }

    impl<S, B, L> PinnedDrop for PolicyFuture<S, B, L>
    where
        S: Service<Request<B>>,
        L: Limiter,
    {
        fn drop(this: Pin<&mut Self>) {
            // Dropped before its response (the client went away): the
            // request was not served, so a taken marker goes back and a
            // retry with its key is charged, not a free repeat.
            let this = this.project();
            if let Some(keys) = this.after.take() {
                release_marker(this.shared, &keys);
            }
        }
    }
}

impl<S, B, L> fmt::Debug for PolicyFuture<S, B, L>
where
    S: Service<Request<B>>,
    L: Limiter,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PolicyFuture").finish_non_exhaustive()
    }
}

impl<S, B, L> PolicyFuture<S, B, L>
where
    S: Service<Request<B>>,
    L: Limiter,
{
    pub(super) fn new(
        shared: Arc<Shared<B, L>>,
        state: State<S, B>,
        report: Report,
        grpc: bool,
    ) -> Self {
        Self {
            state,
            report,
            grpc,
            shared,
            after: None,
            challenge: None,
            settles: Vec::new(),
        }
    }

    /// Takes on what `walk` leaves to the response (before the future is
    /// pinned): the keys kept until then ([`Walk::after`]), a refusal's
    /// challenge, the settlements.
    pub(super) fn follow(&mut self, walk: &mut Walk) {
        let shared = &*self.shared;
        self.after = walk.after(shared);
        self.challenge = walk.challenge(shared);
        self.settles = std::mem::take(&mut walk.settles);
    }
}

/// The state a decided walk leads to. The settlements of a request that
/// is not served are dropped (what each took of a debt is owed again);
/// those of one called now start its time.
pub(super) fn next<S, B, L>(
    shared: &Arc<Shared<B, L>>,
    walk: &mut Walk,
    mut req: Request<B>,
    inner: Inner<'_, S>,
) -> State<S, B>
where
    S: Service<Request<B>> + Clone,
    B: 'static,
    L: Limiter,
{
    let (report, verdict) = (&walk.report, walk.verdict);
    #[cfg(feature = "axum")]
    if shared.route_label {
        count_by_route(shared, report, verdict, &req);
    }
    if matches!(verdict, Verdict::Pass { .. }) {
        if shared.messages && crate::rejection::is_upgrade(&req) {
            offer_messages(shared, walk, &mut req);
        }
    } else {
        walk.settles.clear();
    }
    match verdict {
        Verdict::Pass { delay: 0 } | Verdict::Repeat => {
            for (_, settle) in &mut walk.settles {
                settle.call();
            }
            State::Calling {
                future: inner.call(req),
            }
        }
        // Needs tokio's timer (a runtime with time enabled, as axum's and
        // tonic's servers have).
        Verdict::Pass { delay } => {
            let refund = pacing_refund(shared, report, walk.owned_keys(shared, false));
            State::Pacing {
                sleep: Box::pin(tokio::time::sleep(Duration::from_nanos(delay))),
                waiting: Some(Box::new((req, inner.clone_for_later()))),
                refund: Refund(Some(refund)),
            }
        }
        Verdict::Deny { .. }
        | Verdict::MissingKey { .. }
        | Verdict::Denied
        | Verdict::Blocked { .. } => State::Rejected { verdict },
    }
}

/// Offers an admitted upgrade request the message budget of every rule
/// that counts messages and enforces its key, at the request's plan (an
/// outer layer's budget first) — whether or not the rule decided the
/// request itself: a solved challenge passes a request past its rule, not
/// its messages, and a store that failed decides each message anew.
fn offer_messages<B, L: Limiter>(shared: &Shared<B, L>, walk: &Walk, req: &mut Request<B>) {
    let plan = walk.report.plan;
    let mut budget = req.extensions_mut().remove::<MessageBudget>();
    for (i, rule) in shared.rules.iter().enumerate() {
        if !rule.messages || walk.report.shadows(i) {
            continue;
        }
        let Some(key) = walk.owned_key(i) else {
            continue;
        };
        let (limiter, responder) = rule.at(plan);
        let ours = MessageBudget::new(limiter.clone(), key.clone(), Arc::clone(responder));
        budget = Some(match budget {
            Some(outer) => outer.and(&ours),
            None => ours,
        });
    }
    if let Some(budget) = budget {
        req.extensions_mut().insert(budget);
    }
}

/// Counts each rule's decision of `req` under its matched route (see
/// `PolicyLayerBuilder::route_label`).
#[cfg(feature = "axum")]
fn count_by_route<B, L>(
    shared: &Shared<B, L>,
    report: &Report,
    verdict: Verdict,
    req: &Request<B>,
) {
    let passed = matches!(verdict, Verdict::Pass { .. });
    for (i, (rule, slot)) in shared.rules.iter().zip(&report.decided).enumerate() {
        let Some((d, _)) = slot else { continue };
        // Refunded: another rule refused the request.
        if d.is_allowed() && !passed {
            continue;
        }
        let outcome = crate::observe::route_outcome(d.outcome, report.shadows(i));
        crate::observe::count_route(&rule.responder.rule, req, outcome);
    }
}

impl<S, B, L, ResB> Future for PolicyFuture<S, B, L>
where
    S: Service<Request<B>, Response = Response<ResB>> + Clone,
    B: 'static,
    L: Limiter,
    ResB: RejectionBody,
{
    type Output = Result<Response<ResB>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            let next_state = match this.state.as_mut().project() {
                StateProj::Deciding { decide, waiting } => {
                    let walk = ready!(decide.as_mut().poll(cx));
                    let Some(waiting) = waiting.take() else {
                        return Poll::Pending;
                    };
                    let (req, inner) = *waiting;
                    let mut walk = walk;
                    let state = next(this.shared, &mut walk, req, Inner::Owned(inner));
                    *this.report = walk.report;
                    *this.after = walk.after(this.shared);
                    *this.challenge = walk.challenge(this.shared);
                    *this.settles = walk.settles;
                    state
                }
                StateProj::Pacing {
                    sleep,
                    waiting,
                    refund,
                } => {
                    let called = poll_paced(cx, sleep, waiting, refund);
                    // Its wait is over: the charges stand, the debts paid
                    // with them too (even if the service is never ready).
                    if refund.is_defused() {
                        for (_, settle) in this.settles.iter_mut() {
                            settle.keep();
                        }
                    }
                    let future = ready!(called)?;
                    for (_, settle) in this.settles.iter_mut() {
                        settle.call();
                    }
                    State::Calling { future }
                }
                StateProj::Calling { future } => {
                    let mut response = match ready!(future.poll(cx)) {
                        Ok(response) => response,
                        Err(e) => {
                            if let Some(keys) = this.after.take() {
                                release_marker(this.shared, &keys);
                            }
                            return Poll::Ready(Err(e));
                        }
                    };
                    for (_, settle) in this.settles.drain(..) {
                        settle.finish(&response);
                    }
                    if let Some(keys) = this.after.take() {
                        let status = Completion::of(&response).status();
                        settle_response(this.shared, this.report, status, &keys);
                        // A failed first request keeps no marker: its
                        // retry is charged (a service seldom stores a
                        // failure as the answer to repeat).
                        if status.is_some_and(|s| s.is_client_error() || s.is_server_error()) {
                            release_marker(this.shared, &keys);
                        }
                    }
                    headers(
                        this.shared,
                        this.report,
                        response.headers_mut(),
                        None,
                        None,
                        false,
                    );
                    if this.shared.warns {
                        warnings(this.shared, this.report, response.headers_mut());
                    }
                    return Poll::Ready(Ok(response));
                }
                StateProj::Rejected { verdict } => {
                    let mut response = reject(this.shared, this.report, *verdict, *this.grpc);
                    super::challenge::attach(response.headers_mut(), this.challenge.as_ref());
                    let response = crate::rejection::mark(response);
                    return Poll::Ready(Ok(response.map(ResB::rejection)));
                }
            };
            this.state.set(next_state);
        }
    }
}

/// Adds the headers of every enforced rule that decided.
/// `blocked`: the named rule's key is blocked for `retry_after` by its
/// escalation ladder — its item says so (`r=0`, `t` the block), so that a
/// client that follows `t` does not come back before `Retry-After`.
fn headers<B, L>(
    shared: &Shared<B, L>,
    report: &Report,
    map: &mut http::HeaderMap,
    retry_after: Option<u64>,
    named: Option<usize>,
    blocked: bool,
) {
    if !shared.standard && !shared.legacy && retry_after.is_none() {
        return;
    }
    let Some(first) = shared.rules.first() else {
        return;
    };
    let blank = Decision {
        outcome: Outcome::Never,
        limit: 0,
        remaining: 0,
        reset_after: 0,
    };
    let mut items = [(&first.responder.headers, blank); MAX_RULES];
    let mut n = 0;
    // The item of the rule a rejection names: the legacy headers tell its
    // numbers.
    let mut tightest = None;
    for (i, (rule, slot)) in shared.rules.iter().zip(&report.decided).enumerate() {
        if let (Some((d, _)), false) = (slot, report.shadows(i)) {
            if let Some(item) = items.get_mut(n) {
                let mut d = *d;
                if named == Some(i) {
                    tightest = Some(n);
                    if let (true, Some(block)) = (blocked, retry_after) {
                        let wait = match d.outcome {
                            Outcome::Deny { retry_after } => retry_after,
                            _ => 0,
                        };
                        d.outcome = Outcome::Deny {
                            retry_after: wait.max(block),
                        };
                        d.remaining = 0;
                        d.reset_after = d.reset_after.max(block);
                    }
                }
                *item = rule.shown(report.plan, report.slowed(i), d);
                n = n.saturating_add(1);
            }
        }
    }
    // Every enforced rule decided, at its whole limit (the usual case):
    // the policy is built.
    let policy = (n == shared.enforced && report.slowed == [0; MAX_RULES])
        .then(|| shared.policy.get(usize::from(report.plan)))
        .flatten()
        .and_then(Option::as_ref);
    apply_set(
        map,
        items.get(..n).unwrap_or_default(),
        policy,
        retry_after,
        shared.standard,
        shared.legacy,
        tightest,
    );
}

/// `RateLimit-Warning` on an admitted response: every enforced rule with
/// a warning share the request's key has used past.
fn warnings<B, L>(shared: &Shared<B, L>, report: &Report, map: &mut http::HeaderMap) {
    let mut list = crate::headers::Buf::<1024>::empty();
    for (i, (rule, slot)) in shared.rules.iter().zip(&report.decided).enumerate() {
        let (Some(share), Some((d, _))) = (rule.warn_at, slot) else {
            continue;
        };
        if report.shadows(i) || !d.is_allowed() {
            continue;
        }
        let used = d.limit.saturating_sub(d.remaining);
        if crate::headers::push_warning(&mut list, &rule.responder.rule, used, d.limit, share) {
            rule.responder.metrics.warned.increment(1);
        }
    }
    if let Some(v) = list.value() {
        crate::headers::add_items(map, crate::headers::field::ratelimit_warning(), v);
    }
}

/// The rejection for `verdict`, with every rule's headers.
fn reject<B, L>(
    shared: &Shared<B, L>,
    report: &Report,
    verdict: Verdict,
    grpc: bool,
) -> Response<Bytes> {
    let (rule, reason) = match verdict {
        Verdict::Blocked { rule, for_ns } => {
            let Some(bound) = shared.rules.get(rule) else {
                return Response::new(Bytes::new());
            };
            let (_, r) = bound.at(report.plan);
            r.metrics.blocked.increment(1);
            let decision = Decision {
                outcome: Outcome::Deny {
                    retry_after: for_ns,
                },
                limit: report
                    .decided
                    .get(rule)
                    .copied()
                    .flatten()
                    .map_or(0, |(d, _)| d.limit),
                remaining: 0,
                reset_after: for_ns,
            };
            let rejected = Rejected {
                rule: Arc::clone(&r.rule),
                kind: LimitKind::Rate,
                reason: Reason::Blocked,
                decision: Some(decision),
                grpc,
            };
            tracing::info!(
                target: "tollgate",
                rule = %r.rule,
                block_secs = for_ns / 1_000_000_000,
                "a key is blocked by an escalation ladder"
            );
            let mut res = match &r.rejection {
                Some(f) if !grpc => f(&rejected),
                _ if grpc => rejected.to_grpc_response(),
                _ => rejected.to_problem_response(),
            };
            headers(
                shared,
                report,
                res.headers_mut(),
                Some(for_ns),
                Some(rule),
                true,
            );
            return res;
        }
        Verdict::Deny { rule, reason } => (rule, reason),
        Verdict::MissingKey { rule } => (rule, Reason::MissingKey),
        Verdict::Pass { .. } | Verdict::Repeat => (0, Reason::Limited),
        Verdict::Denied => {
            let Some(listed) = &shared.access else {
                return Response::new(Bytes::new());
            };
            let rejected = listed.denied(LimitKind::Rate, grpc);
            return match shared.rules.first().map(|r| &r.responder.rejection) {
                Some(Some(f)) if !grpc => f(&rejected),
                _ if grpc => rejected.to_grpc_response(),
                _ => rejected.to_problem_response(),
            };
        }
    };
    let Some(bound) = shared.rules.get(rule) else {
        return Response::new(Bytes::new());
    };
    let decision = match reason {
        Reason::MissingKey => None,
        _ => report.shown(bound, rule),
    };
    let rejected = Rejected {
        rule: Arc::clone(&bound.responder.rule),
        kind: LimitKind::Rate,
        reason,
        decision,
        grpc,
    };
    tracing::debug!(
        target: "tollgate",
        rule = %bound.responder.rule,
        ?reason,
        "request over a policy rule"
    );
    let (_, r) = bound.at(report.plan);
    let mut res = match &r.rejection {
        Some(f) if !grpc => f(&rejected),
        _ => r.rendered.render(&rejected),
    };
    if reason != Reason::MissingKey {
        let retry_after = decision.and_then(|d| match d.outcome {
            Outcome::Deny { retry_after } => Some(retry_after),
            _ => None,
        });
        headers(
            shared,
            report,
            res.headers_mut(),
            retry_after,
            Some(rule),
            false,
        );
    }
    res
}
