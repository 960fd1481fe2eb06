//! The policy service: keys, costs and decisions in `call`.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tollgate_core::{Decision, JointDecision, JointPart, Limiter, Store, StoreError};
use tower_service::Service;

use super::access::Access;
use super::challenge;
use super::decide::{
    audit, listed_key, log_decisions, refund_consumed, settle, store_failed, strike_sync, KeyOf,
    Report, Verdict, MARKER,
};
use super::future::{next, PolicyFuture, State};
use super::shared::{Current, Keyed, Shared};
use crate::body::RejectionBody;
use crate::key::{KeyBuf, KeyBytes};
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

/// Rule `i`'s key extracted again from `req` (the synchronous path keeps
/// no keys), for the callbacks of refunds, logs and audits.
fn request_key<'a, B, L>(shared: &'a Shared<B, L>, req: &'a Request<B>) -> impl KeyOf + 'a {
    move |j, f| {
        let mut k = KeyBuf::new();
        if shared
            .rules
            .get(j)
            .is_some_and(|r| r.key_again(req, &mut k))
        {
            f(k.as_bytes());
        }
    }
}

/// Refunds the rules that consumed, their keys extracted from `req` again.
fn refund_by_request<B, L: Limiter>(shared: &Shared<B, L>, report: &Report, req: &Request<B>) {
    refund_consumed(shared, report, request_key(shared, req));
}

/// The decision log and the audit trail of a decided request, the keys
/// extracted again from `req` (only when either is on).
fn observe_by_request<B, L>(
    shared: &Shared<B, L>,
    report: &Report,
    verdict: Verdict,
    req: &Request<B>,
) {
    if shared.log.is_none() && shared.audit.is_none() {
        return;
    }
    let key = request_key(shared, req);
    log_decisions(shared, report, verdict, key);
    audit(shared, report, verdict, key);
}

/// Owned keys of the rules that consumed (`response_aware`: of those that
/// are response-aware only), extracted again.
fn owned_keys<B, L>(
    shared: &Shared<B, L>,
    report: &Report,
    req: &Request<B>,
    response_aware: bool,
) -> Vec<(usize, KeyBytes)> {
    let mut keys = Vec::new();
    for (i, (rule, slot)) in shared.rules.iter().zip(&report.decided).enumerate() {
        if slot.is_some() && (!response_aware || rule.count_if.is_some()) {
            let mut key = KeyBuf::new();
            if rule.key_again(req, &mut key) {
                keys.push((i, KeyBytes::new(&mut key)));
            }
        }
    }
    keys
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

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // The policy now: a request decided by it finishes on it, whatever
        // a reload does meanwhile.
        let shared_now = self.current.load();
        let shared = &shared_now;
        let grpc = is_grpc(&req);
        let mut report = Report::new();
        report.plan = shared.plans.of(&req);
        report.requester = challenge::requester_of(shared, &req);
        if let Some(listed) = &shared.access {
            match listed.check(&req) {
                Access::Unlisted => {}
                Access::Denied => {
                    super::decide::audit_denied(shared, &req);
                    let state = State::Rejected {
                        verdict: Verdict::Denied,
                    };
                    return Self::finish(Arc::clone(shared), state, report, grpc);
                }
                Access::Allowed => {
                    let future = self.inner.call(req);
                    return Self::finish(
                        Arc::clone(shared),
                        State::Calling { future },
                        report,
                        grpc,
                    );
                }
            }
        }
        // A key a ladder blocks is refused before anything else is asked
        // (an idempotent repeat included).
        if shared.laddered {
            match blocked_sync(shared, &req) {
                Some(Some(verdict)) => {
                    observe_by_request(shared, &report, verdict, &req);
                    return Self::finish(
                        Arc::clone(shared),
                        State::Rejected { verdict },
                        report,
                        grpc,
                    );
                }
                Some(None) => {}
                None => {
                    return self.decide_async(
                        Arc::clone(shared),
                        req,
                        report,
                        0,
                        grpc,
                        Marker::Ladders,
                    )
                }
            }
        }
        // An idempotent repeat goes uncharged. A first request takes its
        // marker only once the rules admit it, so a refused one leaves no
        // trace for a concurrent duplicate to ride on.
        let mut marker = Marker::None;
        if let Some(idem) = &shared.idempotency {
            if let Some(mut key) = idem.marker(&req) {
                match idem.limiter.decide_exact_sync(key.as_bytes(), 0) {
                    Some(Ok(d)) if d.remaining == 0 => {
                        idem.metrics.repeat.increment(1);
                        let future = self.inner.call(req);
                        return Self::finish(
                            Arc::clone(shared),
                            State::Calling { future },
                            report,
                            grpc,
                        );
                    }
                    Some(Ok(_)) => marker = Marker::Fresh(KeyBytes::new(&mut key)),
                    // The store failed: charge the request as usual.
                    Some(Err(e)) => crate::observe::store_fault("rate", &idem.name, &e),
                    None => marker = Marker::Pending(KeyBytes::new(&mut key)),
                }
            }
        }
        if let Marker::Pending(_) = marker {
            return self.decide_async(Arc::clone(shared), req, report, 0, grpc, marker);
        }
        for (i, rule) in shared.rules.iter().enumerate() {
            let mut key = KeyBuf::new();
            match rule.key(&req, &mut key) {
                Keyed::Key => {}
                Keyed::Skip => continue,
                Keyed::Reject => {
                    refund_by_request(shared, &report, &req);
                    challenge::give_back(shared, &report, &req, request_key(shared, &req));
                    observe_by_request(shared, &report, Verdict::MissingKey { rule: i }, &req);
                    return Self::finish(
                        Arc::clone(shared),
                        State::Rejected {
                            verdict: Verdict::MissingKey { rule: i },
                        },
                        report,
                        grpc,
                    );
                }
            }
            // A solution to the rule's challenge, used for the first
            // time, passes the rule.
            if let (Some(id), Some((_, used))) = (
                challenge::solved(rule, &req, key.as_bytes(), &report.requester),
                &rule.challenge,
            ) {
                match used.decide_exact_sync(&id, 1) {
                    Some(answer) => {
                        if challenge::first_use(rule, answer) {
                            report.set_cleared(i);
                            continue;
                        }
                    }
                    None => {
                        return self.decide_async(Arc::clone(shared), req, report, i, grpc, marker)
                    }
                }
            }
            // Its challenge is settled: the asynchronous path, should the
            // rate's store hand over, neither counts the solution again nor
            // asks again whether it was used.
            if rule.challenge.is_some() {
                report.set_checked(i);
            }
            let cost = rule.rule.cost(&req);
            match rule.at(report.plan).0.decide_sync(key.as_bytes(), cost) {
                Some(Ok(d)) => report.set(i, d, cost, rule.shadows(key.as_bytes())),
                Some(Err(e)) => {
                    if let Some(d) = store_failed(rule, &e) {
                        report.set(i, d, cost, rule.shadows(key.as_bytes()));
                        report.set_unconsumed(i);
                        report.set_faulted(i);
                    }
                }
                None => return self.decide_async(Arc::clone(shared), req, report, i, grpc, marker),
            }
        }
        let mut verdict = settle(shared, &mut report);
        let mut taken = None;
        match verdict {
            Verdict::Deny { .. } => {
                refund_by_request(shared, &report, &req);
                // Each refusal is a strike on the refusing rules' ladders.
                // (Never on a shared fallback key: one keyless client's
                // strikes would block them all.)
                let struck = strike_sync(shared, &report, |j, f| {
                    let mut k = KeyBuf::new();
                    let rule = shared.rules.get(j);
                    if rule.is_some_and(|r| r.rule.key(&req, &mut k).is_some()) {
                        f(k.as_bytes());
                    }
                });
                if let Some(blocked) = struck.and_then(|b| escalate(&report, verdict, b)) {
                    verdict = blocked;
                }
            }
            Verdict::Pass { .. } => {
                if let (Marker::Fresh(key), Some(idem)) = (marker, &shared.idempotency) {
                    let won = idem.limiter.decide_exact_sync(key.as_bytes(), 1);
                    let held = || idem.limiter.decide_exact_sync(key.as_bytes(), 0);
                    match take(won, held) {
                        Take::Taken => taken = Some(key),
                        Take::Repeat => {
                            idem.metrics.repeat.increment(1);
                            refund_by_request(shared, &report, &req);
                            verdict = Verdict::Repeat;
                        }
                        Take::Unrecorded => {}
                    }
                }
            }
            _ => {}
        }
        observe_by_request(shared, &report, verdict, &req);
        if !matches!(verdict, Verdict::Pass { .. } | Verdict::Repeat) {
            challenge::give_back(shared, &report, &req, request_key(shared, &req));
        }
        let challenge = challenge::for_verdict(
            shared,
            verdict,
            request_key(shared, &req),
            &report.requester,
        );
        // Response-aware rules, and a taken marker, need their keys once
        // the response is in.
        let after = (matches!(verdict, Verdict::Pass { .. })
            && (shared.response_aware || taken.is_some()))
        .then(|| {
            let mut keys = if shared.response_aware {
                owned_keys(shared, &report, &req, true)
            } else {
                Vec::new()
            };
            keys.extend(taken.clone().map(|k| (MARKER, k)));
            keys
        });
        let state = next(
            shared,
            &report,
            verdict,
            req,
            Inner::Borrowed(&mut self.inner),
            |req| {
                let mut keys = owned_keys(shared, &report, req, false);
                keys.extend(taken.map(|k| (MARKER, k)));
                keys
            },
        );
        let mut future = Self::finish(Arc::clone(shared), state, report, grpc);
        future.after = after;
        future.challenge = challenge;
        future
    }
}

/// Whether a ladder blocks `req`'s key (checked before anything else):
/// `Some(Some(verdict))` blocked, `Some(None)` not, `None` when a ladder
/// must be asked through its future. Keyless requests (a shared fallback
/// key) are never blocked.
fn blocked_sync<B, L>(shared: &Shared<B, L>, req: &Request<B>) -> Option<Option<Verdict>> {
    for (i, rule) in shared.rules.iter().enumerate() {
        let Some(ladder) = &rule.ladder else { continue };
        let mut key = KeyBuf::new();
        if rule.rule.key(req, &mut key).is_none() || rule.shadows(key.as_bytes()) {
            continue;
        }
        match ladder.blocked_sync(key.as_bytes())? {
            Ok(Some(for_ns)) => return Some(Some(Verdict::Blocked { rule: i, for_ns })),
            Ok(None) => {}
            Err(e) => ladder_fault(rule, &e),
        }
    }
    Some(None)
}

/// A ladder's store fault: counted and logged; the key is not blocked.
fn ladder_fault<B, L>(rule: &super::shared::Bound<B, L>, e: &StoreError) {
    rule.responder.metrics.store_error.increment(1);
    if let Some(ladder) = &rule.ladder {
        crate::observe::store_fault("rate", ladder.rule().name(), e);
    }
}

/// What a denial becomes when its strikes start (or find) a block of
/// `for_ns` on rule `rule`'s ladder: the block, unless the denial already
/// asks for a longer wait, or can never pass (both stay as they are).
fn escalate(report: &Report, verdict: Verdict, (rule, for_ns): (usize, u64)) -> Option<Verdict> {
    let Verdict::Deny {
        rule: denying,
        reason,
    } = verdict
    else {
        return None;
    };
    if reason != crate::rejection::Reason::Limited {
        return None;
    }
    let wait = report
        .decided
        .get(denying)
        .copied()
        .flatten()
        .and_then(|(d, _)| d.retry_after())
        .map_or(0, |w| u64::try_from(w.as_nanos()).unwrap_or(u64::MAX));
    (for_ns > wait).then_some(Verdict::Blocked { rule, for_ns })
}

/// What taking a first request's marker came to.
enum Take {
    /// Taken: this request is the one charged.
    Taken,
    /// A concurrent duplicate took it first: this one is a repeat.
    Repeat,
    /// The store could not record it (a full memory store decides a new
    /// key in a shared overflow state, which peeks do not read) or failed:
    /// charged as usual, and a later duplicate is charged too.
    Unrecorded,
}

/// Judges the answer `won` to taking a marker (cost 1), peeking at it
/// again (`held`, cost 0) when refused: held by another request means a
/// repeat; not held means the store could not record it.
fn take(
    won: Option<Result<tollgate_core::Decision, StoreError>>,
    held: impl FnOnce() -> Option<Result<tollgate_core::Decision, StoreError>>,
) -> Take {
    match won {
        Some(Ok(d)) if d.is_allowed() => Take::Taken,
        Some(Ok(_)) => match held() {
            Some(Ok(d)) if d.remaining == 0 => Take::Repeat,
            _ => Take::Unrecorded,
        },
        _ => Take::Unrecorded,
    }
}

/// Gives an idempotency marker back if dropped while `key` is set: the
/// future taking it was dropped before the request could be served (a
/// spurious give-back costs a duplicate its charge, never a free pass).
struct TakingMarker<'a, B, L: Limiter> {
    shared: &'a Shared<B, L>,
    key: Option<KeyBytes>,
}

impl<B, L: Limiter> Drop for TakingMarker<'_, B, L> {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            super::decide::release_marker(self.shared, &[(MARKER, key)]);
        }
    }
}

/// A request's idempotency marker.
enum Marker {
    /// None: no `Idempotency-Key`, or no idempotency in the policy.
    None,
    /// Not held (a first request): taken once the rules admit it.
    Fresh(KeyBytes),
    /// To look at in the store, before the rules decide.
    Pending(KeyBytes),
    /// Not looked at yet: the ladders are checked first, through their
    /// futures (the asynchronous path), then the marker.
    Ladders,
}

impl<S, B, St: Store, ResB> PolicyService<S, B, St>
where
    S: Service<Request<B>, Response = Response<ResB>> + Clone + Send + 'static,
    B: Send + 'static,
{
    fn finish(
        shared: Arc<Shared<B, St::Limiter>>,
        state: State<S, B>,
        report: Report,
        grpc: bool,
    ) -> PolicyFuture<S, B, St::Limiter> {
        PolicyFuture {
            state,
            report,
            grpc,
            shared,
            after: None,
            challenge: None,
        }
    }

    /// The path of a store that needs I/O: the idempotency marker if it is
    /// pending (a repeat decides nothing else), then rules `from` on,
    /// concurrently (the earlier ones, if any, answered at once), judged
    /// together; a denial refunds what the others consumed, and an
    /// admitted first request takes its marker.
    fn decide_async(
        &mut self,
        shared_now: Arc<Shared<B, St::Limiter>>,
        req: Request<B>,
        mut report: Report,
        from: usize,
        grpc: bool,
        marker: Marker,
    ) -> PolicyFuture<S, B, St::Limiter> {
        let shared = shared_now;
        // Coming straight from `call` with ladders to ask: they go first,
        // then the idempotency marker, then the rules.
        let check_ladders = matches!(marker, Marker::Ladders);
        let marker = match marker {
            Marker::Ladders => match shared.idempotency.as_ref().and_then(|i| i.marker(&req)) {
                Some(mut key) => Marker::Pending(KeyBytes::new(&mut key)),
                None => Marker::None,
            },
            other => other,
        };
        // The ladders' keys: the rules' own keys (never a shared fallback
        // key), for rules that enforce.
        let mut ladder_keys: Vec<(usize, KeyBytes)> = Vec::new();
        for (i, rule) in shared.rules.iter().enumerate() {
            let mut key = KeyBuf::new();
            if rule.ladder.is_some()
                && rule.rule.key(&req, &mut key).is_some()
                && !rule.shadows(key.as_bytes())
            {
                ladder_keys.push((i, KeyBytes::new(&mut key)));
            }
        }
        let pending_marker = matches!(marker, Marker::Pending(_));
        // Every rule's key first: a rule that refuses a keyless request
        // must do so before any store call is under way (after the marker,
        // when one is pending: a repeat is served as on the other path).
        let mut keys: Vec<(usize, KeyBytes)> = Vec::with_capacity(shared.rules.len());
        let mut missing = None;
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
                    Keyed::Reject if pending_marker => {
                        missing = Some(i);
                        break;
                    }
                    Keyed::Reject => {
                        // Refund the rules answered at once, and refuse.
                        refund_consumed(&shared, &report, listed_key(&keys));
                        challenge::give_back(&shared, &report, &req, listed_key(&keys));
                        observe_by_request(&shared, &report, Verdict::MissingKey { rule: i }, &req);
                        return Self::finish(
                            Arc::clone(&shared),
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
        // (rule, cost, shadowed, index into keys) of the rules to decide.
        let pending: Vec<_> = keys
            .iter()
            .enumerate()
            .filter(|(_, (i, _))| *i >= from)
            .filter_map(|(k, (i, key))| {
                let rule = shared.rules.get(*i)?;
                Some((*i, rule.rule.cost(&req), rule.shadows(key.as_bytes()), k))
            })
            .collect();
        // Solutions to rules' challenges, verified here (whether each is
        // used for the first time is the store's to say), and those of
        // rules a solution passed already, to give back on a refusal.
        let mut solutions: Vec<(usize, [u8; 16])> = pending
            .iter()
            .filter_map(|(i, _, _, k)| {
                let (_, key) = keys.get(*k)?;
                let rule = shared.rules.get(*i)?;
                // (A rule whose challenge the synchronous path settled is
                // neither counted nor asked about twice.)
                if report.checked(*i) {
                    return None;
                }
                Some((
                    *i,
                    challenge::solved(rule, &req, key.as_bytes(), &report.requester)?,
                ))
            })
            .collect();
        solutions.extend(challenge::cleared_ids(
            &shared,
            &report,
            &req,
            listed_key(&keys),
        ));
        let decide = Box::pin({
            let shared = Arc::clone(&shared);
            async move {
                let mut keys = keys;
                // A key a ladder blocks is refused before anything else.
                if check_ladders {
                    for (i, key) in &ladder_keys {
                        let Some(rule) = shared.rules.get(*i) else {
                            continue;
                        };
                        let Some(ladder) = &rule.ladder else { continue };
                        match ladder.blocked(key.as_bytes()).await {
                            Ok(Some(for_ns)) => {
                                let verdict = Verdict::Blocked { rule: *i, for_ns };
                                let key = listed_key(&ladder_keys);
                                log_decisions(&shared, &report, verdict, key);
                                audit(&shared, &report, verdict, key);
                                return (report, verdict, keys);
                            }
                            Ok(None) => {}
                            Err(e) => ladder_fault(rule, &e),
                        }
                    }
                }
                let mut fresh = match marker {
                    Marker::Fresh(key) => Some(key),
                    Marker::None | Marker::Ladders => None,
                    Marker::Pending(key) => match &shared.idempotency {
                        None => None,
                        Some(idem) => match idem.limiter.decide_exact(key.as_bytes(), 0).await {
                            Ok(d) if d.remaining == 0 => {
                                idem.metrics.repeat.increment(1);
                                return (report, Verdict::Repeat, keys);
                            }
                            Ok(_) => Some(key),
                            // The store failed: charge the request as usual.
                            Err(e) => {
                                crate::observe::store_fault("rate", &idem.name, &e);
                                None
                            }
                        },
                    },
                };
                if let Some(rule) = missing {
                    // Passes a solution won on the synchronous path go back.
                    challenge::give_back_cleared(&shared, &report, &solutions);
                    let verdict = Verdict::MissingKey { rule };
                    let key = listed_key(&keys);
                    log_decisions(&shared, &report, verdict, key);
                    audit(&shared, &report, verdict, key);
                    return (report, verdict, keys);
                }
                let refund = |report: &Report, keys: &[(usize, KeyBytes)]| {
                    refund_consumed(&shared, report, listed_key(keys));
                };
                // A solution used for the first time passes its rule.
                let mut pending = pending;
                for (i, id) in &solutions {
                    let Some(rule) = shared.rules.get(*i) else {
                        continue;
                    };
                    let Some((_, used)) = &rule.challenge else {
                        continue;
                    };
                    if report.cleared(*i) {
                        continue;
                    }
                    if challenge::first_use(rule, used.decide_exact(id, 1).await) {
                        report.set_cleared(*i);
                        pending.retain(|(j, ..)| j != i);
                    }
                }
                // Created here, after the marker: no rule is charged for a
                // repeat. Together where the store can (one call, all or
                // nothing), else one call per rule, side by side.
                // Each part's rule, and the parts (a shadow rule is one
                // not enforced).
                let (rules, joint): (Vec<usize>, Vec<_>) = pending
                    .iter()
                    .filter_map(|(i, cost, shadow, k)| {
                        let key = keys.get(*k).map_or(&[][..], |(_, key)| key.as_bytes());
                        let limiter = shared.rules.get(*i)?.at(report.plan).0;
                        let part = JointPart {
                            limiter,
                            key,
                            cost: *cost,
                            enforced: !*shadow,
                        };
                        Some((*i, part))
                    })
                    .unzip();
                let answers: Vec<JointDecision> =
                    match <St::Limiter as Limiter>::decide_joint(&joint) {
                        Some(together) => together.await,
                        None => {
                            let each = joint
                                .iter()
                                .map(|p| Box::pin(p.limiter.decide(p.key, p.cost)))
                                .collect();
                            tollgate_core::join_all(each)
                                .await
                                .into_iter()
                                .zip(&joint)
                                .map(|(decision, p)| JointDecision {
                                    consumed: p.cost > 0
                                        && decision.as_ref().is_ok_and(Decision::is_allowed),
                                    decision,
                                    failed: false,
                                })
                                .collect()
                        }
                    };
                for ((i, part), answer) in rules.iter().zip(&joint).zip(answers) {
                    let Some(rule) = shared.rules.get(*i) else {
                        continue;
                    };
                    match answer.decision {
                        Ok(d) => {
                            report.set(*i, d, part.cost, !part.enforced);
                            if !answer.consumed {
                                report.set_unconsumed(*i);
                            }
                            if answer.failed {
                                report.set_faulted(*i);
                            }
                        }
                        Err(e) => {
                            if let Some(d) = store_failed(rule, &e) {
                                report.set(*i, d, part.cost, !part.enforced);
                                report.set_unconsumed(*i);
                                report.set_faulted(*i);
                            }
                        }
                    }
                }
                let mut verdict = settle(&shared, &mut report);
                match verdict {
                    Verdict::Deny { .. } => {
                        refund(&report, &keys);
                        // Each refusal is a strike on the refusing rules'
                        // ladders; the longest block answers.
                        let mut longest: Option<(usize, u64)> = None;
                        for (i, key) in &ladder_keys {
                            let Some(rule) = shared.rules.get(*i) else {
                                continue;
                            };
                            let (Some(ladder), Some(Some((d, _)))) =
                                (&rule.ladder, report.decided.get(*i))
                            else {
                                continue;
                            };
                            // A failure policy's denial is no strike.
                            if report.shadows(*i)
                                || report.faulted(*i)
                                || !matches!(d.outcome, tollgate_core::Outcome::Deny { .. })
                            {
                                continue;
                            }
                            rule.responder.metrics.strike.increment(1);
                            match ladder.strike(key.as_bytes()).await {
                                Ok(tollgate_core::algorithm::Strike::Blocked {
                                    for_ns, ..
                                }) => {
                                    if longest.is_none_or(|(_, l)| for_ns > l) {
                                        longest = Some((*i, for_ns));
                                    }
                                }
                                Ok(_) => {}
                                Err(e) => ladder_fault(rule, &e),
                            }
                        }
                        if let Some(blocked) = longest.and_then(|b| escalate(&report, verdict, b)) {
                            verdict = blocked;
                        }
                    }
                    Verdict::Pass { .. } => {
                        if let (Some(key), Some(idem)) = (fresh.take(), &shared.idempotency) {
                            // Dropped while the take is under way (the
                            // client went away), the marker goes back:
                            // its resend is a first request, not a free
                            // repeat of an answer nobody stored.
                            let mut taking = TakingMarker {
                                shared: &shared,
                                key: Some(key.clone()),
                            };
                            let won = Some(idem.limiter.decide_exact(key.as_bytes(), 1).await);
                            let held = if matches!(&won, Some(Ok(d)) if !d.is_allowed()) {
                                Some(idem.limiter.decide_exact(key.as_bytes(), 0).await)
                            } else {
                                None
                            };
                            taking.key = None;
                            match take(won, || held) {
                                Take::Taken => keys.push((MARKER, key)),
                                Take::Repeat => {
                                    idem.metrics.repeat.increment(1);
                                    refund(&report, &keys);
                                    verdict = Verdict::Repeat;
                                }
                                Take::Unrecorded => {}
                            }
                        }
                    }
                    _ => {}
                }
                if shared.log.is_some() || shared.audit.is_some() {
                    let key = listed_key(&keys);
                    log_decisions(&shared, &report, verdict, key);
                    audit(&shared, &report, verdict, key);
                }
                if !matches!(verdict, Verdict::Pass { .. } | Verdict::Repeat) {
                    challenge::give_back_cleared(&shared, &report, &solutions);
                }
                (report, verdict, keys)
            }
        });
        // The clone-and-swap dance: the service that was polled ready
        // serves this request; a fresh clone waits for the next poll_ready.
        let clone = self.inner.clone();
        let ready = std::mem::replace(&mut self.inner, clone);
        Self::finish(
            Arc::clone(&shared),
            State::Deciding {
                decide,
                waiting: Some(Box::new((req, ready))),
            },
            report,
            grpc,
        )
    }
}
