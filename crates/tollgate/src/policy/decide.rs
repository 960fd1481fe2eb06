//! Judging the rules' decisions together, and refunds.

use std::sync::Arc;
use std::time::Duration;

use tollgate_core::{Decision, Limiter, Outcome, StoreError};

use super::shared::{Bound, Shared, MAX_RULES};
use crate::key::KeyBytes;
use crate::rate_limit::RefundFn;
use crate::rejection::Reason;

/// What each rule decided for one request: its decision and the cost it
/// charged, or nothing (no key and skipped, or the store failed).
#[derive(Debug, Clone, Copy)]
pub(super) struct Report {
    pub(super) decided: [Option<(Decision, u64)>; MAX_RULES],
    /// Bit `i`: rule `i` only watches this request (shadow, or a canary
    /// that leaves its key out).
    pub(super) shadow: u16,
    /// Bit `i`: rule `i` admitted without consuming its cost (a joint
    /// decision that another rule denied wrote nothing, or a failure
    /// policy counted nothing), so there is nothing to refund.
    unconsumed: u16,
    /// Bit `i`: a solution to rule `i`'s challenge passed the request
    /// past it (the challenge's pass is given back if it is refused).
    cleared: u16,
    /// Bit `i`: rule `i`'s decision is a failure policy's (the store did
    /// not answer): a denial of it is no strike toward a block.
    faulted: u16,
    /// The request's plan (0: the default).
    pub(super) plan: u8,
    /// The step rule `i`'s slowing ladder has the key on (0: none): its
    /// cost was raised to match, and its headers state the lowered limit.
    pub(super) slowed: [u8; MAX_RULES],
    /// Who asked (a digest of the policy's challenge requester key, the
    /// client's address by default): a challenge is issued to, and passes,
    /// its requester only. Zero where the policy has no challenges.
    pub(super) requester: [u8; 16],
}

/// Rule `i`'s bit in a [`Report`]'s masks and the audit mask (none past
/// the 16th).
pub(super) fn bit(i: usize) -> u16 {
    1u16.checked_shl(u32::try_from(i).unwrap_or(u32::MAX))
        .unwrap_or(0)
}

impl Report {
    pub(super) fn new() -> Self {
        Self {
            decided: [None; MAX_RULES],
            shadow: 0,
            unconsumed: 0,
            cleared: 0,
            faulted: 0,
            plan: 0,
            slowed: [0; MAX_RULES],
            requester: [0; 16],
        }
    }

    /// Rule `i`'s decision is a failure policy's answer.
    pub(super) fn set_faulted(&mut self, i: usize) {
        self.faulted |= bit(i);
    }

    /// Whether rule `i`'s decision is a failure policy's answer.
    pub(super) fn faulted(&self, i: usize) -> bool {
        self.faulted & bit(i) != 0
    }

    /// Rule `i` decided `d` at `cost`, enforced or watching.
    pub(super) fn set(&mut self, i: usize, d: Decision, cost: u64, shadow: bool) {
        if let Some(slot) = self.decided.get_mut(i) {
            *slot = Some((d, cost));
        }
        if shadow {
            self.shadow |= bit(i);
        }
    }

    /// Rule `i`'s admitting decision consumed nothing.
    pub(super) fn set_unconsumed(&mut self, i: usize) {
        self.unconsumed |= bit(i);
    }

    /// A solution to rule `i`'s challenge passed the request past it.
    pub(super) fn set_cleared(&mut self, i: usize) {
        self.cleared |= bit(i);
    }

    /// Whether a solution passed the request past rule `i`.
    pub(super) fn cleared(&self, i: usize) -> bool {
        self.cleared & bit(i) != 0
    }

    /// Whether rule `i` only watches this request.
    pub(super) fn shadows(&self, i: usize) -> bool {
        self.shadow & bit(i) != 0
    }

    /// The step rule `i`'s slowing ladder has the key on (0: none).
    pub(super) fn slowed(&self, i: usize) -> u8 {
        self.slowed.get(i).copied().unwrap_or(0)
    }

    /// Rule `i`'s decision as the client is shown it (see
    /// [`Bound::shown`]).
    pub(super) fn shown<B, L>(&self, rule: &Bound<B, L>, i: usize) -> Option<Decision> {
        let (d, _) = (*self.decided.get(i)?)?;
        Some(rule.shown(self.plan, self.slowed(i), d).1)
    }

    /// Whether rule `i` admitted the request and charged its store (not
    /// a failure policy's admission, nor a joint decision that wrote
    /// nothing).
    pub(super) fn charged(&self, i: usize) -> bool {
        matches!(self.decided.get(i), Some(Some((d, _))) if d.is_allowed())
            && self.unconsumed & bit(i) == 0
    }

    /// Rule `i`'s decision and cost, if it consumed a cost to refund.
    fn consumed(&self, i: usize) -> Option<(Decision, u64)> {
        let (d, cost) = (*self.decided.get(i)?)?;
        (d.is_allowed() && cost > 0 && self.unconsumed & bit(i) == 0).then_some((d, cost))
    }
}

/// What the rules, together, say about a request.
#[derive(Debug, Clone, Copy)]
pub(super) enum Verdict {
    /// Every enforced rule admits it, after the longest pacing delay.
    Pass { delay: u64 },
    /// Rule `rule` holds it back: the one that can never admit it, else
    /// the one that asks for the longest wait.
    Deny { rule: usize, reason: Reason },
    /// An access list refuses it.
    Denied,
    /// An idempotent repeat within the TTL: served, charged nothing.
    Repeat,
    /// Rule `rule`'s escalation ladder blocks the key for `for_ns`.
    Blocked { rule: usize, for_ns: u64 },
    /// Rule `rule` found no key and refuses keyless requests.
    MissingKey { rule: usize },
}

/// Records a store failure, counted and logged, and returns what it
/// stands for: `None`, the rule admits (the default: a store fault never
/// fails the request), or the fail-closed denial of
/// [`OnStoreError::Refuse`](crate::OnStoreError::Refuse), which the
/// caller records as the rule's decision (consuming nothing).
pub(super) fn store_failed<B, L>(rule: &Bound<B, L>, error: &StoreError) -> Option<Decision> {
    rule.responder.metrics.store_error.increment(1);
    crate::observe::store_fault("rate", &rule.responder.rule, error);
    rule.responder.on_store_error
}

/// Judges the rules' decisions together, counts them, and turns the
/// refunded rules' `remaining` into what they hold after the refund.
/// Whoever holds the keys refunds the consumed rules on a denial.
pub(super) fn settle<B, L>(shared: &Shared<B, L>, report: &mut Report) -> Verdict {
    let mut never: Option<usize> = None;
    let mut longest: Option<(usize, u64)> = None;
    let mut delay = 0u64;
    for (i, (rule, slot)) in shared.rules.iter().zip(&report.decided).enumerate() {
        let Some((d, _)) = slot else { continue };
        let shadow = report.shadows(i);
        // The plan's series (a plan the rule does not name: the rule's).
        let m = &rule.at(report.plan).1.metrics;
        m.record_remaining(d);
        if report.slowed(i) > 0 {
            m.slowed.increment(1);
        }
        match d.outcome {
            Outcome::Allow { delay: wait } if !shadow => delay = delay.max(wait),
            Outcome::Allow { .. } => {}
            Outcome::Deny { .. } | Outcome::Never if shadow => {
                m.shadow_limited.increment(1);
            }
            Outcome::Never => {
                m.too_costly.increment(1);
                never = never.or(Some(i));
            }
            Outcome::Deny { retry_after } => {
                m.limited.increment(1);
                m.retry_after
                    .record(Duration::from_nanos(retry_after).as_secs_f64());
                if longest.is_none_or(|(_, r)| retry_after > r) {
                    longest = Some((i, retry_after));
                }
            }
        }
    }
    let verdict = match (never, longest) {
        (Some(rule), _) => Verdict::Deny {
            rule,
            reason: Reason::TooCostly,
        },
        (None, Some((rule, _))) => Verdict::Deny {
            rule,
            reason: Reason::Limited,
        },
        (None, None) => Verdict::Pass { delay },
    };
    for (rule, slot) in shared.rules.iter().zip(&mut report.decided) {
        let Some((d, cost)) = slot else { continue };
        match verdict {
            Verdict::Pass { .. } if d.is_allowed() => {
                rule.at(report.plan).1.metrics.allowed.increment(1);
            }
            // Refunded: the budget is as it was before the request.
            Verdict::Deny { .. } if d.is_allowed() => {
                shown_refunded(d, *cost);
            }
            _ => {}
        }
    }
    verdict
}

/// Gives back what each rule that admitted the request consumed;
/// `key(i)` is rule `i`'s key.
pub(super) fn refund_consumed<B, L: Limiter>(
    shared: &Shared<B, L>,
    report: &Report,
    mut key: impl FnMut(usize, &mut dyn FnMut(&[u8])),
) {
    for (i, rule) in shared.rules.iter().enumerate() {
        if rule.retired() {
            continue;
        }
        if let Some((_, cost)) = report.consumed(i) {
            key(i, &mut |k| {
                crate::task::finish(rule.at(report.plan).0.refund(k, cost));
            });
        }
    }
}

/// Every consumed rule's key, owned, for a refund that may come later (a
/// paced request cancelled while it waits).
pub(super) fn pacing_refund<B, L: Limiter>(
    shared: &Arc<Shared<B, L>>,
    report: &Report,
    keys: Vec<(usize, KeyBytes)>,
) -> RefundFn
where
    B: 'static,
{
    let (shared, report) = (Arc::clone(shared), *report);
    Box::new(move || {
        refund_consumed(&shared, &report, listed_key(&keys));
        // (A taken idempotency marker goes back with the dropped future.)
    })
}

/// Gives back the idempotency marker among `keys`, if one was taken: the
/// request was not served (cancelled, failed), so a retry with its
/// `Idempotency-Key` is a first request, charged as one — not a free
/// repeat of an answer the service may never have stored.
pub(super) fn release_marker<B, L: Limiter>(shared: &Shared<B, L>, keys: &[(usize, KeyBytes)]) {
    let marker = keys.iter().find(|(j, _)| *j == MARKER);
    if let (Some(idem), Some((_, k))) = (&shared.idempotency, marker) {
        crate::task::finish(idem.limiter.refund(k.as_bytes(), 1));
    }
}

/// A decision as shown after its `cost` was refunded: what remains is back
/// (at most the whole budget), and a whole budget resets now.
fn shown_refunded(d: &mut Decision, cost: u64) {
    d.remaining = d.remaining.saturating_add(cost).min(d.limit);
    if d.remaining == d.limit {
        d.reset_after = 0;
    }
}

/// Where refunds, logs and audits get rule `i`'s key: they call it with
/// `i` and a callback that receives the key's bytes (not called when the
/// rule has no key).
pub(super) trait KeyOf: Fn(usize, &mut dyn FnMut(&[u8])) + Copy {}

impl<F: Fn(usize, &mut dyn FnMut(&[u8])) + Copy> KeyOf for F {}

/// Rule `i`'s key, from owned keys kept with their rule's index.
pub(super) fn listed_key(keys: &[(usize, KeyBytes)]) -> impl KeyOf + '_ {
    move |i, f| {
        if let Some((_, k)) = keys.iter().find(|(j, _)| *j == i) {
            f(k.as_bytes());
        }
    }
}

/// The index under which a taken idempotency marker's key travels with
/// the rules' keys (no rule has it).
pub(super) const MARKER: usize = usize::MAX;

/// After the response: gives back the cost of each response-aware rule
/// whose test the response fails (it does not count), and shows that
/// rule's budget as it is after the refund.
pub(super) fn settle_response<B, L: Limiter>(
    shared: &Shared<B, L>,
    report: &mut Report,
    status: Option<http::StatusCode>,
    keys: &[(usize, KeyBytes)],
) {
    let plan = report.plan;
    for (i, key) in keys {
        let Some(rule) = shared.rules.get(*i) else {
            continue;
        };
        let Some(count_if) = &rule.count_if else {
            continue;
        };
        if rule.retired() {
            continue;
        }
        if report.consumed(*i).is_none() || status.is_none_or(|s| count_if(s)) {
            continue;
        }
        let Some(Some((d, cost))) = report.decided.get_mut(*i) else {
            continue;
        };
        crate::task::finish(rule.at(plan).0.refund(key.as_bytes(), *cost));
        shown_refunded(d, *cost);
    }
}

/// Now, in Unix milliseconds (0 before 1970).
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// An audit record's fingerprint of `key`: under the fleet's secret where
/// the policy has one, else per process.
fn fingerprint<B, L>(shared: &Shared<B, L>, key: &[u8]) -> crate::key::Fingerprint {
    match &shared.audit_secret {
        Some(secret) => crate::key::Fingerprint::keyed(secret, key),
        None => crate::key::Fingerprint::of(key),
    }
}

/// A deny list refused `req`: recorded where the audit names the list.
pub(super) fn audit_denied<B, L>(shared: &Shared<B, L>, req: &http::Request<B>) {
    let (Some((sink, _, true)), Some(listed)) = (&shared.audit, &shared.access) else {
        return;
    };
    let mut who = listed.who(req);
    sink.record(&crate::observe::AuditRecord {
        rule: Arc::clone(listed.name()),
        reason: reason_name(Reason::Denied),
        key: fingerprint(shared, who.as_bytes()),
        retry_after_ms: 0,
        unix_ms: unix_ms(),
    });
}

/// A refusal by an audited rule goes to the audit sink; `key(i)` gives
/// rule `i`'s key bytes (hashed before they leave).
pub(super) fn audit<B, L>(
    shared: &Shared<B, L>,
    report: &Report,
    verdict: Verdict,
    mut key: impl FnMut(usize, &mut dyn FnMut(&[u8])),
) {
    let Some((sink, mask, _)) = &shared.audit else {
        return;
    };
    if matches!(
        verdict,
        Verdict::Pass { .. } | Verdict::Repeat | Verdict::Denied
    ) {
        return;
    }
    let ms = |ns: u128| u64::try_from(ns.div_ceil(1_000_000)).unwrap_or(u64::MAX);
    let unix_ms = unix_ms();
    for (i, (rule, slot)) in shared.rules.iter().zip(&report.decided).enumerate() {
        if mask & bit(i) == 0 || report.shadows(i) {
            continue;
        }
        // Every audited rule that refused: the one the answer names (a
        // block, a missing key) and any other that said no.
        let (reason, wait) = match (verdict, slot) {
            (Verdict::Blocked { rule: r, for_ns }, _) if r == i => {
                (Reason::Blocked, ms(u128::from(for_ns)))
            }
            (Verdict::MissingKey { rule: r }, _) if r == i => (Reason::MissingKey, 0),
            (_, Some((d, _))) => match d.outcome {
                Outcome::Deny { retry_after } => (Reason::Limited, ms(u128::from(retry_after))),
                Outcome::Never => (Reason::TooCostly, 0),
                Outcome::Allow { .. } => continue,
            },
            _ => continue,
        };
        let mut print = crate::key::Fingerprint(0);
        key(i, &mut |k| print = fingerprint(shared, k));
        sink.record(&crate::observe::AuditRecord {
            rule: Arc::clone(&rule.responder.rule),
            reason: reason_name(reason),
            key: print,
            retry_after_ms: wait,
            unix_ms,
        });
    }
}

/// A sampled request's decision log: one event per rule that decided it,
/// `key(i)` giving rule `i`'s key bytes (hashed before they are logged).
pub(super) fn log_decisions<B, L>(
    shared: &Shared<B, L>,
    report: &Report,
    verdict: Verdict,
    mut key: impl FnMut(usize, &mut dyn FnMut(&[u8])),
) {
    let refused = !matches!(verdict, Verdict::Pass { .. } | Verdict::Repeat);
    if !shared.log.is_some_and(|l| l.sample(refused)) {
        return;
    }
    let named = match verdict {
        Verdict::Deny { rule, reason } => Some((rule, reason)),
        Verdict::Blocked { rule, .. } => Some((rule, Reason::Blocked)),
        Verdict::MissingKey { rule } => Some((rule, Reason::MissingKey)),
        _ => None,
    };
    for (i, (rule, slot)) in shared.rules.iter().zip(&report.decided).enumerate() {
        let decided = slot.map(|(d, _)| d);
        let reason = named.filter(|(r, _)| *r == i).map(|(_, reason)| reason);
        if decided.is_none() && reason.is_none() {
            continue;
        }
        let outcome = match (decided.map(|d| d.outcome), report.shadows(i)) {
            (Some(Outcome::Allow { .. }), _) => "allowed",
            (Some(_), true) => "shadow_limited",
            (Some(Outcome::Never), false) => "too_costly",
            (Some(_), false) => "limited",
            (None, _) => "refused",
        };
        let mut fingerprint = None;
        key(i, &mut |k| {
            fingerprint = Some(crate::key::Fingerprint::of(k))
        });
        tracing::info!(
            target: "tollgate::decision",
            rule = %rule.responder.rule,
            outcome,
            remaining = decided.map_or(0, |d| d.remaining),
            reason = reason.map_or("", reason_name),
            key = %fingerprint.map_or_else(String::new, |f| f.to_string()),
            "decision"
        );
    }
}

fn reason_name(reason: Reason) -> &'static str {
    match reason {
        Reason::Limited => "limited",
        Reason::TooCostly => "too_costly",
        Reason::MissingKey => "missing_key",
        Reason::Blocked => "blocked",
        Reason::Denied => "denied",
        Reason::ReadOnly => "read_only",
        Reason::Expired => "expired",
    }
}
