//! One request's way through a policy, as a short sequence of named steps:
//!
//! 1. [`Walk::start`] reads everything the steps need from the request,
//!    once: the plan, the requester, each rule's key and cost, the
//!    solutions to the rules' challenges and the idempotency marker.
//! 2. **ladders**: a key an escalation ladder blocks is refused first;
//!    one a slowing ladder put on a lower step is charged more;
//! 3. **marker**: an idempotent repeat is served uncharged;
//! 4. **keys**: a rule that refuses keyless requests refuses one;
//! 5. **challenges**: a solution used for the first time passes its rule;
//! 6. **rules**: every other keyed rule decides (together, where the
//!    store can: one call, all or nothing);
//! 7. **settle**: the decisions judged together; a refusal refunds what
//!    the others consumed, then
//! 8. **strikes**: each refusal is a strike on its rule's ladder (the
//!    longest block answers); an admission
//! 9. **takes** the idempotency marker;
//! 10. **observe**: the decision log and the audit trail; a refusal gives
//!     back the challenges' passes it used.
//!
//! Each step asks the store once per rule. A store that answers at once
//! (memory) runs the whole walk inside `call` ([`Walk::advance`]); a step
//! whose store needs I/O stops the walk with the call it waits for
//! ([`Io`]), which [`Walk::decide`] makes, hands back to the same step,
//! and walks on. The steps, and what they make of an answer, are written
//! once for both.

use std::sync::Arc;

use http::Request;
use tollgate_core::algorithm::{Standing, Strike};
use tollgate_core::{Decision, JointDecision, JointPart, Limiter, Outcome, StoreError};

use super::challenge;
use super::decide::{
    audit, bit, log_decisions, refund_consumed, release_marker, settle, store_failed, KeyOf,
    Report, Verdict, MARKER,
};
use super::shared::{Keyed, Shared, MAX_RULES};
use crate::key::KeyBytes;
use crate::rate_limit::Settle;

/// The step a walk is at.
#[derive(Debug, Clone, Copy)]
enum Step {
    /// Asking rule `i` on's ladders whether the key is blocked.
    Ladders(usize),
    /// Asking whether the idempotency marker is held (a repeat).
    Marker,
    /// Refusing a request a rule found no key for.
    Keys,
    /// Asking whether rule `i` on's solutions are used for the first time.
    Challenges(usize),
    /// Deciding rule `i` on.
    Rules(usize),
    /// Judging the decisions together.
    Settle,
    /// Striking rule `i` on's ladders (a refusal).
    Strikes(usize),
    /// Taking the idempotency marker (an admitted first request).
    Take,
    /// The decision log, the audit, the challenges' passes back.
    Observe,
    Done,
}

/// The store call a step waits for, when the store needs I/O for it.
#[derive(Debug, Clone, Copy)]
pub(super) enum Io {
    /// Whether rule `i`'s ladder blocks the key.
    Ladder(usize),
    /// Whether the idempotency marker is held.
    Marker,
    /// Whether rule `i`'s solution is used for the first time.
    Challenge(usize),
    /// Rule `i` on's decisions, together.
    Rules(usize),
    /// A strike on rule `i`'s ladder.
    Strike(usize),
    /// Taking the idempotency marker.
    Take,
}

/// One request's decision: what [`start`](Self::start) read from the
/// request, and what the steps found so far.
pub(super) struct Walk {
    pub(super) report: Report,
    pub(super) verdict: Verdict,
    /// Rule `i`'s key: extracted once. `None`: the rule has none (skipped,
    /// or refusing keyless requests).
    keys: [Option<KeyBytes>; MAX_RULES],
    /// Bit `i`: rule `i`'s key is the request's own, not a shared
    /// fallback key (ladders block and strike only a client's own key).
    own: u16,
    /// Rule `i`'s cost for this request.
    costs: [u64; MAX_RULES],
    /// The verified solution to rule `i`'s challenge (whether it is used
    /// for the first time is the store's to say).
    solutions: [Option<[u8; 16]>; MAX_RULES],
    /// The first rule that refuses this request for want of a key.
    missing: Option<usize>,
    /// The idempotency marker's key: looked at, then taken (`taken`) if
    /// the rules admit the request.
    marker: Option<KeyBytes>,
    /// Whether this request took its marker (it is given back if the
    /// request is not served).
    taken: bool,
    /// The longest block the strikes started (rule, ns).
    longest: Option<(usize, u64)>,
    /// The settlements of the rules that charge what a request really
    /// cost (rule, settlement): each takes its key's debt before the
    /// rules decide, and owes it again unless the request is served.
    pub(super) settles: Vec<(usize, Settle)>,
    step: Step,
}

impl Walk {
    /// Reads what the steps need from `req`, once.
    #[inline]
    pub(super) fn start<B, L>(shared: &Shared<B, L>, req: &Request<B>) -> Self {
        let mut report = Report::new();
        report.plan = shared.plans.of(req);
        report.requester = challenge::requester_of(shared, req);
        let mut walk = Self {
            report,
            verdict: Verdict::Pass { delay: 0 },
            keys: Default::default(),
            own: 0,
            costs: [0; MAX_RULES],
            solutions: [None; MAX_RULES],
            missing: None,
            marker: None,
            taken: false,
            longest: None,
            settles: Vec::new(),
            step: if shared.laddered {
                Step::Ladders(0)
            } else {
                Step::Marker
            },
        };
        for (i, (rule, slot)) in shared.rules.iter().zip(&mut walk.keys).enumerate() {
            // Built where the walk keeps it.
            let keyed = KeyBytes::build_in(slot, |key| {
                let (keyed, own) = rule.key(req, key);
                (keyed == Keyed::Key, (keyed, own))
            });
            let owned = match (keyed, slot) {
                ((Keyed::Key, own), Some(key)) => {
                    if own {
                        walk.own |= bit(i);
                    }
                    &*key
                }
                ((Keyed::Reject, _), _) => {
                    walk.missing = walk.missing.or(Some(i));
                    continue;
                }
                _ => continue,
            };
            let key = owned.as_bytes();
            let shadows = rule.shadows(key);
            if shadows {
                walk.report.shadow |= bit(i);
            }
            if let (Some(cost), Some(solution)) = (walk.costs.get_mut(i), walk.solutions.get_mut(i))
            {
                *cost = rule.rule.cost(req);
                *solution = challenge::solved(rule, req, key, &walk.report.requester);
                // A key the rule only watches is measured by nothing.
                if let (Some(debts), false) = (rule.debts(walk.report.plan), shadows) {
                    let head = req.method() == http::Method::HEAD;
                    let settle = Settle::new(Arc::clone(debts), owned.clone(), *cost, 0, head);
                    walk.settles.push((i, settle));
                }
            }
        }
        if let Some(idem) = &shared.idempotency {
            walk.marker = idem.marker(req).map(|mut k| KeyBytes::new(&mut k));
        }
        walk
    }

    /// Rule `i`'s key, if it has one.
    #[inline]
    fn key(&self, i: usize) -> Option<&[u8]> {
        self.keys.get(i)?.as_ref().map(KeyBytes::as_bytes)
    }

    /// Rule `i`'s key, owned, if it has one.
    pub(super) fn owned_key(&self, i: usize) -> Option<&KeyBytes> {
        self.keys.get(i)?.as_ref()
    }

    /// Where refunds, logs and audits get each rule's key.
    pub(super) fn key_of(&self) -> impl KeyOf + '_ {
        move |i, f| {
            if let Some(k) = self.key(i) {
                f(k);
            }
        }
    }

    /// Rule `i`'s key, where its ladder counts it: the request's own key
    /// (never a shared fallback one), of a rule that enforces it.
    #[inline]
    fn ladder_key(&self, i: usize) -> Option<&[u8]> {
        (self.own & bit(i) != 0 && !self.report.shadows(i))
            .then(|| self.key(i))
            .flatten()
    }

    /// Rule `i`, its ladder and the key it strikes, if its refusal is a
    /// strike: a refusal for now, by an enforced rule with a ladder, of
    /// the request's own key. (A failure policy's denial says nothing
    /// about the client.)
    #[allow(clippy::type_complexity)]
    fn struck<'a, B, L>(
        &'a self,
        shared: &'a Shared<B, L>,
        i: usize,
    ) -> Option<(
        &'a super::shared::Bound<B, L>,
        &'a Arc<dyn tollgate_core::EscalationLimiter>,
        &'a [u8],
    )> {
        let rule = shared.rules.get(i)?;
        let ladder = rule.ladder.as_ref()?;
        let (d, _) = (*self.report.decided.get(i)?)?;
        if self.report.faulted(i) || !matches!(d.outcome, Outcome::Deny { .. }) {
            return None;
        }
        Some((rule, ladder, self.ladder_key(i)?))
    }

    /// Whether rule `i` is decided by its limit: it has a key, no
    /// solution passed the request past it, and its key's debt did not
    /// refuse it already.
    #[inline]
    fn decides(&self, i: usize) -> bool {
        self.key(i).is_some()
            && !self.report.cleared(i)
            && self.report.decided.get(i).is_some_and(Option::is_none)
    }

    /// Takes every step the store answers at once, in order; `Some(io)`
    /// when the next one needs I/O (see [`decide`](Self::decide)).
    pub(super) fn advance<B, L: Limiter>(&mut self, shared: &Shared<B, L>) -> Option<Io> {
        let n = shared.rules.len().min(MAX_RULES);
        loop {
            match self.step {
                Step::Ladders(from) => {
                    let next = (from..n).find_map(|i| {
                        let ladder = shared.rules.get(i)?.ladder.as_ref()?;
                        Some((i, ladder, self.ladder_key(i)?))
                    });
                    let Some((i, ladder, key)) = next else {
                        self.step = Step::Marker;
                        continue;
                    };
                    match ladder.standing_sync(key) {
                        Some(answer) => self.on_ladder(shared, i, answer),
                        None => return Some(Io::Ladder(i)),
                    }
                }
                Step::Marker => {
                    let (Some(idem), Some(key)) = (&shared.idempotency, &self.marker) else {
                        self.step = Step::Keys;
                        continue;
                    };
                    match idem.limiter.decide_exact_sync(key.as_bytes(), 0) {
                        Some(answer) => self.on_marker(shared, answer),
                        None => return Some(Io::Marker),
                    }
                }
                Step::Keys => {
                    self.step = match self.missing {
                        Some(rule) => {
                            self.verdict = Verdict::MissingKey { rule };
                            Step::Observe
                        }
                        None => Step::Challenges(0),
                    };
                }
                Step::Challenges(from) => {
                    let next = (from..n).find_map(|i| {
                        let (_, used) = shared.rules.get(i)?.challenge.as_ref()?;
                        Some((i, used, (*self.solutions.get(i)?)?))
                    });
                    let Some((i, used, id)) = next else {
                        self.take_debts(shared);
                        self.step = Step::Rules(0);
                        continue;
                    };
                    match used.decide_exact_sync(&id, 1) {
                        Some(answer) => self.on_challenge(shared, i, answer),
                        None => return Some(Io::Challenge(i)),
                    }
                }
                Step::Rules(from) => {
                    for i in from..n {
                        let (Some(rule), Some(&cost)) = (shared.rules.get(i), self.costs.get(i))
                        else {
                            break;
                        };
                        if !self.decides(i) {
                            continue;
                        }
                        let key = self.key(i).unwrap_or_default();
                        let Some(decision) = rule.at(self.report.plan).0.decide_sync(key, cost)
                        else {
                            self.step = Step::Rules(i);
                            return Some(Io::Rules(i));
                        };
                        self.on_rule(shared, i, JointDecision::alone(decision, cost));
                    }
                    self.step = Step::Settle;
                }
                Step::Settle => {
                    self.verdict = settle(shared, &mut self.report);
                    self.settled();
                    self.step = match self.verdict {
                        Verdict::Deny { .. } => {
                            refund_consumed(shared, &self.report, self.key_of());
                            Step::Strikes(0)
                        }
                        Verdict::Pass { .. } if self.marker.is_some() => Step::Take,
                        _ => Step::Observe,
                    };
                }
                Step::Strikes(from) => {
                    let Some(i) = (from..n).find(|&i| self.struck(shared, i).is_some()) else {
                        self.escalate();
                        self.step = Step::Observe;
                        continue;
                    };
                    self.step = Step::Strikes(i.saturating_add(1));
                    let Some((rule, ladder, key)) = self.struck(shared, i) else {
                        continue;
                    };
                    rule.responder.metrics.strike.increment(1);
                    match ladder.strike_sync(key) {
                        Some(answer) => self.on_strike(shared, i, answer),
                        None => return Some(Io::Strike(i)),
                    }
                }
                Step::Take => {
                    let (Some(idem), Some(key)) = (&shared.idempotency, &self.marker) else {
                        self.step = Step::Observe;
                        continue;
                    };
                    let Some(won) = idem.limiter.decide_exact_sync(key.as_bytes(), 1) else {
                        return Some(Io::Take);
                    };
                    let held = refused(&won)
                        .then(|| idem.limiter.decide_exact_sync(key.as_bytes(), 0))
                        .flatten();
                    self.on_take(shared, Some(won), held);
                }
                Step::Observe => {
                    self.observe(shared);
                    self.step = Step::Done;
                }
                Step::Done => return None,
            }
        }
    }

    /// The rest of the walk from the call `io` that stopped
    /// [`advance`](Self::advance): each call that needs I/O is made here,
    /// its answer handed back to its step, and the walk goes on.
    pub(super) async fn decide<B, L: Limiter>(mut self, shared: Arc<Shared<B, L>>, io: Io) -> Self {
        let mut io = Some(io);
        while let Some(call) = io {
            self.call(&shared, call).await;
            io = self.advance(&shared);
        }
        self
    }

    /// Makes the store call `io` and hands its answer to its step.
    async fn call<B, L: Limiter>(&mut self, shared: &Shared<B, L>, io: Io) {
        match io {
            Io::Ladder(i) => {
                let ladder = shared.rules.get(i).and_then(|r| r.ladder.as_ref());
                match (ladder, self.ladder_key(i)) {
                    (Some(ladder), Some(key)) => {
                        let answer = ladder.standing(key).await;
                        self.on_ladder(shared, i, answer);
                    }
                    _ => self.step = Step::Ladders(i.saturating_add(1)),
                }
            }
            Io::Marker => match (&shared.idempotency, &self.marker) {
                (Some(idem), Some(key)) => {
                    let answer = idem.limiter.decide_exact(key.as_bytes(), 0).await;
                    self.on_marker(shared, answer);
                }
                _ => self.step = Step::Keys,
            },
            Io::Challenge(i) => {
                let used = shared.rules.get(i).and_then(|r| r.challenge.as_ref());
                match (used, self.solutions.get(i).copied().flatten()) {
                    (Some((_, used)), Some(id)) => {
                        let answer = used.decide_exact(&id, 1).await;
                        self.on_challenge(shared, i, answer);
                    }
                    _ => self.step = Step::Challenges(i.saturating_add(1)),
                }
            }
            Io::Rules(from) => {
                let (rules, answers) = self.decide_together(shared, from).await;
                for (i, answer) in rules.into_iter().zip(answers) {
                    self.on_rule(shared, i, answer);
                }
                self.step = Step::Settle;
            }
            // (The step is the next rule's already.)
            Io::Strike(i) => {
                if let Some((_, ladder, key)) = self.struck(shared, i) {
                    let answer = ladder.strike(key).await;
                    self.on_strike(shared, i, answer);
                }
            }
            Io::Take => {
                let (Some(idem), Some(key)) = (&shared.idempotency, self.marker.clone()) else {
                    self.step = Step::Observe;
                    return;
                };
                // Dropped while the take is under way (the client went
                // away), the marker goes back: its resend is a first
                // request, not a free repeat of an answer nobody stored.
                let mut taking = TakingMarker {
                    shared,
                    key: Some(key.clone()),
                };
                let won = idem.limiter.decide_exact(key.as_bytes(), 1).await;
                let held = if refused(&won) {
                    Some(idem.limiter.decide_exact(key.as_bytes(), 0).await)
                } else {
                    None
                };
                taking.key = None;
                self.on_take(shared, Some(won), held);
            }
        }
    }

    /// Rule `from` on's decisions, together where the store can (one call,
    /// all or nothing), else one call per rule, side by side: each
    /// decided rule and its answer.
    async fn decide_together<B, L: Limiter>(
        &self,
        shared: &Shared<B, L>,
        from: usize,
    ) -> (Vec<usize>, Vec<JointDecision>) {
        let n = shared.rules.len().min(MAX_RULES);
        let (rules, joint): (Vec<usize>, Vec<JointPart<'_, L>>) = (from..n)
            .filter(|&i| self.decides(i))
            .filter_map(|i| {
                let part = JointPart {
                    limiter: shared.rules.get(i)?.at(self.report.plan).0,
                    key: self.key(i)?,
                    cost: *self.costs.get(i)?,
                    enforced: !self.report.shadows(i),
                };
                Some((i, part))
            })
            .unzip();
        // What an enforced denial leaves consumed is refunded when the
        // walk settles.
        (rules, tollgate_core::decide_parts(&joint).await)
    }

    /// Ladders: rule `i`'s answer. A blocked key is refused; a slowed
    /// one is charged its step's cost (see [`slowed`](Self::slowed)).
    fn on_ladder<B, L: Limiter>(
        &mut self,
        shared: &Shared<B, L>,
        i: usize,
        answer: Result<Standing, StoreError>,
    ) {
        self.step = Step::Ladders(i.saturating_add(1));
        match answer {
            Ok(Standing::Blocked { for_ns }) => {
                self.verdict = Verdict::Blocked { rule: i, for_ns };
                self.step = Step::Observe;
            }
            Ok(Standing::Slowed { level, .. }) => self.slowed(shared, i, level),
            Ok(Standing::Clear) => {}
            Err(e) => ladder_fault(shared, i, &e),
        }
    }

    /// Rule `i`'s slowing ladder has the key on step `level`: the
    /// request is charged what the step asks (`cost × 100 / percent`),
    /// but never more than the whole burst if its cost fits the burst (a
    /// request that fits unslowed is never refused for good: one costlier
    /// than the lowered burst pays the whole burst), and its headers will
    /// state the lowered limit.
    fn slowed<B, L: Limiter>(&mut self, shared: &Shared<B, L>, i: usize, level: u32) {
        let (Some(rule), Some(cost), Some(slot)) = (
            shared.rules.get(i),
            self.costs.get_mut(i),
            self.report.slowed.get_mut(i),
        ) else {
            return;
        };
        let Some(ladder) = &rule.ladder else {
            return;
        };
        let capacity = rule.at(self.report.plan).0.rule().capacity();
        let charged = ladder.rule().escalation().charge(*cost, level);
        *cost = if *cost <= capacity {
            charged.min(capacity)
        } else {
            charged
        };
        *slot = u8::try_from(level).unwrap_or(u8::MAX);
    }

    /// Marker: held (its count spent) means a repeat, served uncharged. A
    /// store that failed leaves the request charged as usual.
    fn on_marker<B, L>(&mut self, shared: &Shared<B, L>, answer: Result<Decision, StoreError>) {
        self.step = Step::Keys;
        let Some(idem) = &shared.idempotency else {
            return;
        };
        match answer {
            Ok(d) if d.remaining == 0 => {
                idem.metrics.repeat.increment(1);
                self.verdict = Verdict::Repeat;
                self.step = Step::Done;
            }
            Ok(_) => {}
            Err(e) => {
                crate::observe::store_fault("rate", &idem.name, &e);
                self.marker = None;
            }
        }
    }

    /// Challenges: a solution used for the first time passes its rule.
    fn on_challenge<B, L>(
        &mut self,
        shared: &Shared<B, L>,
        i: usize,
        answer: Result<Decision, StoreError>,
    ) {
        self.step = Step::Challenges(i.saturating_add(1));
        if let Some(rule) = shared.rules.get(i) {
            if challenge::first_use(rule, answer) {
                self.report.set_cleared(i);
            }
        }
    }

    /// Debts (before the rules decide): each rule that charges what
    /// requests really cost adds what the key owes to its cost, as far
    /// as the rule's limit leaves room; where more is owed, the rule
    /// refuses the request until enough of it is freed.
    fn take_debts<B, L: Limiter>(&mut self, shared: &Shared<B, L>) {
        for (i, settle) in &mut self.settles {
            let i = *i;
            let (Some(rule), Some(cost)) = (shared.rules.get(i), self.costs.get_mut(i)) else {
                continue;
            };
            if self.report.cleared(i) {
                continue;
            }
            let capacity = rule.at(self.report.plan).0.rule().capacity();
            // A slowed key settles at its step's price.
            let level = u32::from(self.report.slowed(i));
            if let (true, Some(ladder)) = (level > 0, &rule.ladder) {
                settle.slowed(*cost, ladder.rule().escalation().charge(1, level));
            }
            match settle.take_owed(capacity, *cost) {
                Ok(units) => *cost = cost.saturating_add(units),
                Err(owing) => {
                    self.report.set(i, owing, *cost, false);
                    self.report.set_unconsumed(i);
                }
            }
        }
    }

    /// Settle, for the debts. Each rule's charge stood from its answer
    /// (see [`on_rule`](Self::on_rule)). An admitted request keeps the
    /// settlements of the rules that charged it (a rule whose store failed
    /// charged nothing: the debt it took is owed again); a paced one's may
    /// yet be given back, while it waits. A refused request's charges are
    /// given back: each debt it paid is owed again.
    fn settled(&mut self) {
        if self.settles.is_empty() {
            return;
        }
        let report = self.report;
        match self.verdict {
            Verdict::Pass { delay } => {
                self.settles.retain(|(i, _)| report.charged(*i));
                if delay > 0 {
                    for (_, settle) in &mut self.settles {
                        settle.unkeep();
                    }
                }
            }
            _ => {
                for (_, settle) in self.settles.drain(..) {
                    settle.unpaid();
                }
            }
        }
    }

    /// Rules: rule `i`'s decision; a store's error is the rule's failure
    /// policy (admit, consuming nothing, or refuse).
    #[inline]
    fn on_rule<B, L>(&mut self, shared: &Shared<B, L>, i: usize, answer: JointDecision) {
        let (Some(rule), Some(&cost)) = (shared.rules.get(i), self.costs.get(i)) else {
            return;
        };
        let shadow = self.report.shadows(i);
        match answer.decision {
            Ok(d) => {
                self.report.set(i, d, cost, shadow);
                if !answer.consumed {
                    self.report.set_unconsumed(i);
                }
                if answer.failed {
                    self.report.set_faulted(i);
                }
                // Charged: the charge stands, and the debt paid with it,
                // unless the walk gives it back (a refusal, a repeat): a
                // request dropped now, waiting on another rule's store,
                // keeps it.
                if self.report.charged(i) {
                    if let Some((_, settle)) = self.settles.iter_mut().find(|(j, _)| *j == i) {
                        settle.keep();
                    }
                }
            }
            Err(e) => {
                if let Some(d) = store_failed(rule, &e) {
                    self.report.set(i, d, cost, shadow);
                    self.report.set_unconsumed(i);
                    self.report.set_faulted(i);
                }
            }
        }
    }

    /// Strikes: rule `i`'s strike; the longest block it starts (or finds
    /// running) is kept.
    fn on_strike<B, L: Limiter>(
        &mut self,
        shared: &Shared<B, L>,
        i: usize,
        answer: Result<Strike, StoreError>,
    ) {
        match answer {
            Ok(Strike::Blocked { for_ns, .. }) => {
                if self.longest.is_none_or(|(_, l)| for_ns > l) {
                    self.longest = Some((i, for_ns));
                }
            }
            Ok(Strike::Slowed { level, .. }) => self.stepped_down(shared, i, level),
            Ok(Strike::Counted { .. }) => {}
            Err(e) => ladder_fault(shared, i, &e),
        }
    }

    /// Rule `i`'s refusal put the key on step `level` of its slowing
    /// ladder. The refusal says so: its headers state the lowered limit,
    /// and its wait is one a request charged the step's cost can keep (the
    /// wait for the old cost would bring the client back to be refused
    /// again, a strike further down): the wait for the old cost plus the
    /// time the rule takes to free the difference at its steady rate, or
    /// — for a token bucket, which frees in steps — until its budget is
    /// whole; never longer than that. The longest wait names the refusal.
    fn stepped_down<B, L: Limiter>(&mut self, shared: &Shared<B, L>, i: usize, level: u32) {
        let was = u32::from(self.report.slowed(i));
        if let Some(slot) = self.report.slowed.get_mut(i) {
            *slot = u8::try_from(level).unwrap_or(u8::MAX);
        }
        let (Some(rule), Some(Some((d, cost)))) = (shared.rules.get(i), self.report.decided.get(i))
        else {
            return;
        };
        let (d, cost) = (*d, *cost);
        let (Outcome::Deny { retry_after }, Some(ladder)) = (d.outcome, &rule.ladder) else {
            return;
        };
        let limit = rule.at(self.report.plan).0.rule();
        // What the next request will be charged: this one's, from the
        // step it had to the step it has now (both exact multiples).
        let steps = ladder.rule().escalation();
        let next = cost
            .checked_div(steps.charge(1, was))
            .unwrap_or(cost)
            .saturating_mul(steps.charge(1, level))
            .min(limit.capacity());
        let more = next.saturating_sub(cost);
        let wait = match limit.algorithm() {
            _ if more == 0 => retry_after,
            tollgate_core::Algorithm::TokenBucket(_) => d.reset_after,
            _ => {
                // window × more / capacity, rounded up.
                let freed = u128::from(limit.window())
                    .saturating_mul(u128::from(more))
                    .div_ceil(u128::from(limit.capacity().max(1)));
                let freed = u64::try_from(freed).unwrap_or(u64::MAX);
                retry_after.saturating_add(freed).min(d.reset_after)
            }
        }
        .max(retry_after);
        if let Some(Some((d, _))) = self.report.decided.get_mut(i) {
            d.outcome = Outcome::Deny { retry_after: wait };
        }
        let wait_of = |report: &super::decide::Report, rule: usize| match report.decided.get(rule) {
            Some(Some((d, _))) => d.retry_after().map(|w| w.as_nanos()),
            _ => None,
        };
        if let Verdict::Deny {
            rule,
            reason: crate::rejection::Reason::Limited,
        } = self.verdict
        {
            if wait_of(&self.report, i) > wait_of(&self.report, rule) {
                self.verdict = Verdict::Deny {
                    rule: i,
                    reason: crate::rejection::Reason::Limited,
                };
            }
        }
    }

    /// What a denial becomes when its strikes start (or find) a block:
    /// the block, unless the denial already asks for a longer wait, or can
    /// never pass (both stay as they are).
    fn escalate(&mut self) {
        let (
            Some((rule, for_ns)),
            Verdict::Deny {
                rule: denying,
                reason: crate::rejection::Reason::Limited,
            },
        ) = (self.longest, self.verdict)
        else {
            return;
        };
        let wait = self
            .report
            .decided
            .get(denying)
            .copied()
            .flatten()
            .and_then(|(d, _)| d.retry_after())
            .map_or(0, |w| u64::try_from(w.as_nanos()).unwrap_or(u64::MAX));
        if for_ns > wait {
            self.verdict = Verdict::Blocked { rule, for_ns };
        }
    }

    /// Take: the answer `won` to taking the marker (cost 1), and `held`,
    /// peeking at it again when refused: held by another request means a
    /// repeat (refunded, served uncharged); not held, that the store could
    /// not record it (a full memory store decides a new key in a shared
    /// overflow state, which peeks do not read) or failed: charged as
    /// usual, and a later duplicate is charged too.
    fn on_take<B, L: Limiter>(
        &mut self,
        shared: &Shared<B, L>,
        won: Option<Result<Decision, StoreError>>,
        held: Option<Result<Decision, StoreError>>,
    ) {
        self.step = Step::Observe;
        match (won, held) {
            (Some(Ok(d)), _) if d.is_allowed() => self.taken = true,
            (Some(Ok(_)), Some(Ok(d))) if d.remaining == 0 => {
                if let Some(idem) = &shared.idempotency {
                    idem.metrics.repeat.increment(1);
                }
                refund_consumed(shared, &self.report, self.key_of());
                // Given back: so is each debt the request paid.
                for (_, settle) in self.settles.drain(..) {
                    settle.unpaid();
                }
                self.verdict = Verdict::Repeat;
            }
            _ => {}
        }
    }

    /// Observe: the decision log and the audit (when on); a refused
    /// request was not served, so the passes of the challenges it used go
    /// back, for the client to use again.
    fn observe<B, L: Limiter>(&self, shared: &Shared<B, L>) {
        if shared.log.is_some() || shared.audit.is_some() {
            log_decisions(shared, &self.report, self.verdict, self.key_of());
            audit(shared, &self.report, self.verdict, self.key_of());
        }
        if matches!(self.verdict, Verdict::Pass { .. } | Verdict::Repeat) {
            return;
        }
        for (i, rule) in shared.rules.iter().enumerate() {
            let (Some((_, used)), Some(Some(id))) = (&rule.challenge, self.solutions.get(i)) else {
                continue;
            };
            if self.report.cleared(i) {
                crate::task::finish(used.refund(id, 1));
            }
        }
    }

    /// The `Tollgate-Challenge` header of a refusal that has one.
    pub(super) fn challenge<B, L>(&self, shared: &Shared<B, L>) -> Option<http::HeaderValue> {
        challenge::for_verdict(shared, self.verdict, self.key_of(), &self.report.requester)
    }

    /// The keys of the rules that decided, and the taken marker's, owned:
    /// for a refund or a marker's release that comes later.
    /// `response_aware`: of the response-aware rules only.
    pub(super) fn owned_keys<B, L>(
        &self,
        shared: &Shared<B, L>,
        response_aware: bool,
    ) -> Vec<(usize, KeyBytes)> {
        let mut keys: Vec<(usize, KeyBytes)> = shared
            .rules
            .iter()
            .zip(&self.report.decided)
            .zip(&self.keys)
            .enumerate()
            .filter(|(_, ((rule, slot), _))| {
                slot.is_some() && (!response_aware || rule.count_if.is_some())
            })
            .filter_map(|(i, (_, key))| Some((i, key.clone()?)))
            .collect();
        if self.taken {
            keys.extend(self.marker.clone().map(|k| (MARKER, k)));
        }
        keys
    }

    /// The keys kept until the response of an admitted request: those of
    /// the response-aware rules (a response that does not count is given
    /// back) and a taken marker's (given back if the request fails).
    pub(super) fn after<B, L>(&self, shared: &Shared<B, L>) -> Option<Vec<(usize, KeyBytes)>> {
        (matches!(self.verdict, Verdict::Pass { .. }) && (shared.response_aware || self.taken))
            .then(|| self.owned_keys(shared, true))
    }
}

/// Whether taking a marker was refused (its count already spent).
fn refused(won: &Result<Decision, StoreError>) -> bool {
    matches!(won, Ok(d) if !d.is_allowed())
}

/// A ladder's store fault: counted and logged; the key is not blocked.
fn ladder_fault<B, L>(shared: &Shared<B, L>, i: usize, e: &StoreError) {
    let Some(rule) = shared.rules.get(i) else {
        return;
    };
    rule.responder.metrics.store_error.increment(1);
    if let Some(ladder) = &rule.ladder {
        crate::observe::store_fault("rate", ladder.rule().name(), e);
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
            release_marker(self.shared, &[(MARKER, key)]);
        }
    }
}
