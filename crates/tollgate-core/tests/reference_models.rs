//! Every algorithm against a reference model written independently of it:
//! the most literal, slow implementation of what its docs promise. On random
//! traces (small parameters, clock moves that hit boundaries and retry times
//! exactly, costs up to capacity + 2, refunds) the outcome kind, the pacing
//! delay and `remaining` must match the model at every step.
//!
//! Time only moves forward here; clocks going backwards are covered by
//! `properties.rs`.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects,
    missing_docs
)]

mod support;

use std::collections::{BTreeMap, HashMap};

use proptest::prelude::*;
use support::{Action, Jump, SemOp};
use tollgate_core::{Decision, Outcome, RateAlgorithm, SemaphoreState};

/// Kind of outcome, without the numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Allow,
    Deny,
    Never,
}

fn kind(d: &Decision) -> Kind {
    match d.outcome {
        Outcome::Allow { .. } => Kind::Allow,
        Outcome::Deny { .. } => Kind::Deny,
        Outcome::Never => Kind::Never,
    }
}

/// What a model expects of one decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Expect {
    kind: Kind,
    remaining: u64,
    /// The pacing delay, for the models that know it (the leaky bucket).
    delay: Option<u64>,
}

fn expect(kind: Kind, remaining: u64) -> Expect {
    Expect {
        kind,
        remaining,
        delay: None,
    }
}

trait Model {
    fn decide(&mut self, now: u64, cost: u64) -> Expect;
    fn refund(&mut self, now: u64, cost: u64);
}

/// Runs `steps` on the algorithm and on the model side by side.
fn compare<A: RateAlgorithm, M: Model + std::fmt::Debug>(
    alg: &A,
    mut model: M,
    unit: u64,
    start: u64,
    steps: &[(Jump, Action)],
) -> Result<(), TestCaseError> {
    let mut state = A::State::default();
    let mut now = start;
    let mut hint = 0;
    let cap = alg.capacity();
    for (i, &(jump, action)) in steps.iter().enumerate() {
        now = jump.apply(now, unit, hint);
        match action {
            Action::Decide(c) => {
                let cost = c.resolve(cap);
                let got = alg.decide(&mut state, now, cost);
                let want = model.decide(now, cost);
                let delay = match got.outcome {
                    Outcome::Allow { delay } => Some(delay),
                    _ => None,
                };
                let got_e = Expect {
                    kind: kind(&got),
                    remaining: got.remaining,
                    delay: want.delay.and(delay),
                };
                prop_assert_eq!(
                    got_e,
                    want,
                    "step {} at {} (start {} + {}): cost {}; decision {:?}; model {:?}",
                    i,
                    now,
                    start,
                    now - start,
                    cost,
                    got,
                    model
                );
                hint = match got.outcome {
                    Outcome::Deny { retry_after } => retry_after,
                    _ => got.reset_after,
                };
            }
            Action::Refund(c) => {
                let cost = c.resolve(cap);
                alg.refund(&mut state, now, cost);
                model.refund(now, cost);
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// GCRA: a continuously refilled bucket of credit, counted in nanoseconds.
// One unit costs `interval` ns of credit; credit grows by 1 per ns, up to
// `burst × interval`.

#[derive(Debug)]
struct GcraModel {
    interval: u128,
    burst: u128,
    credit: u128,
    last: Option<u64>,
}

impl GcraModel {
    fn new(interval: u64, burst: u64) -> Self {
        Self {
            interval: interval.into(),
            burst: burst.into(),
            credit: u128::from(interval) * u128::from(burst),
            last: None,
        }
    }

    fn catch_up(&mut self, now: u64) {
        if let Some(last) = self.last {
            assert!(now >= last, "models run forward only");
            let full = self.interval * self.burst;
            self.credit = (self.credit + u128::from(now - last)).min(full);
        }
        self.last = Some(now);
    }

    fn units(&self) -> u64 {
        (self.credit / self.interval) as u64
    }
}

impl Model for GcraModel {
    fn decide(&mut self, now: u64, cost: u64) -> Expect {
        self.catch_up(now);
        let cost = u128::from(cost);
        if cost > self.burst {
            return expect(Kind::Never, self.units());
        }
        let need = cost * self.interval;
        if self.credit >= need {
            self.credit -= need;
            expect(Kind::Allow, self.units())
        } else {
            expect(Kind::Deny, self.units())
        }
    }

    fn refund(&mut self, now: u64, cost: u64) {
        self.catch_up(now);
        let full = self.interval * self.burst;
        self.credit = (self.credit + u128::from(cost) * self.interval).min(full);
    }
}

// ---------------------------------------------------------------------------
// Token bucket: a literal simulation. `refill` tokens are added at every
// multiple of `interval` the clock crosses, one boundary at a time, capped
// at `capacity`.

#[derive(Debug)]
struct TokenBucketModel {
    capacity: u64,
    refill: u64,
    interval: u64,
    tokens: u64,
    tick: Option<u64>,
}

impl TokenBucketModel {
    fn catch_up(&mut self, now: u64) {
        let tick = now / self.interval;
        if let Some(mut t) = self.tick {
            assert!(tick >= t, "models run forward only");
            // A full bucket stays full: stop counting boundaries then.
            while t < tick && self.tokens < self.capacity {
                t += 1;
                self.tokens = (self.tokens + self.refill).min(self.capacity);
            }
        }
        self.tick = Some(tick);
    }
}

impl Model for TokenBucketModel {
    fn decide(&mut self, now: u64, cost: u64) -> Expect {
        self.catch_up(now);
        if cost > self.capacity {
            expect(Kind::Never, self.tokens)
        } else if cost <= self.tokens {
            self.tokens -= cost;
            expect(Kind::Allow, self.tokens)
        } else {
            expect(Kind::Deny, self.tokens)
        }
    }

    fn refund(&mut self, now: u64, cost: u64) {
        self.catch_up(now);
        self.tokens = (self.tokens + cost).min(self.capacity);
    }
}

// ---------------------------------------------------------------------------
// Fixed window: a map from window number to the units admitted in it.

#[derive(Debug)]
struct FixedWindowModel {
    limit: u64,
    window: u64,
    counts: HashMap<u64, u64>,
}

impl Model for FixedWindowModel {
    fn decide(&mut self, now: u64, cost: u64) -> Expect {
        let count = self.counts.entry(now / self.window).or_insert(0);
        if cost > self.limit {
            expect(Kind::Never, self.limit - *count)
        } else if *count + cost <= self.limit {
            *count += cost;
            expect(Kind::Allow, self.limit - *count)
        } else {
            expect(Kind::Deny, self.limit - *count)
        }
    }

    fn refund(&mut self, now: u64, cost: u64) {
        let count = self.counts.entry(now / self.window).or_insert(0);
        *count = count.saturating_sub(cost);
    }
}

// ---------------------------------------------------------------------------
// Sliding window counter: a map from window number to units, and the
// weighted formula `ceil(previous × (W − elapsed) / W) + current`.

#[derive(Debug)]
struct SlidingWindowCounterModel {
    limit: u64,
    window: u64,
    counts: HashMap<u64, u64>,
}

impl SlidingWindowCounterModel {
    fn used(&self, now: u64) -> u64 {
        let index = now / self.window;
        let elapsed = now % self.window;
        let current = self.counts.get(&index).copied().unwrap_or(0);
        let previous = match index.checked_sub(1) {
            Some(p) => self.counts.get(&p).copied().unwrap_or(0),
            None => 0,
        };
        let weighted = (u128::from(previous) * u128::from(self.window - elapsed))
            .div_ceil(u128::from(self.window));
        weighted as u64 + current
    }
}

impl Model for SlidingWindowCounterModel {
    fn decide(&mut self, now: u64, cost: u64) -> Expect {
        let used = self.used(now);
        let remaining = self.limit.saturating_sub(used);
        if cost > self.limit {
            expect(Kind::Never, remaining)
        } else if used + cost <= self.limit {
            *self.counts.entry(now / self.window).or_insert(0) += cost;
            expect(Kind::Allow, remaining - cost)
        } else {
            expect(Kind::Deny, remaining)
        }
    }

    fn refund(&mut self, now: u64, cost: u64) {
        let count = self.counts.entry(now / self.window).or_insert(0);
        *count = count.saturating_sub(cost);
    }
}

// ---------------------------------------------------------------------------
// Sliding window log: every admitted request ever, summed over
// `(now − W, now]`.

#[derive(Debug)]
struct SlidingWindowLogModel {
    limit: u64,
    window: u64,
    admitted: Vec<(u64, u64)>,
}

impl SlidingWindowLogModel {
    fn in_window(&self, at: u64, now: u64) -> bool {
        // at ∈ (now − W, now], written without underflow.
        at <= now && u128::from(at) + u128::from(self.window) > u128::from(now)
    }

    fn used(&self, now: u64) -> u64 {
        self.admitted
            .iter()
            .filter(|(at, _)| self.in_window(*at, now))
            .map(|(_, c)| c)
            .sum()
    }
}

impl Model for SlidingWindowLogModel {
    fn decide(&mut self, now: u64, cost: u64) -> Expect {
        let used = self.used(now);
        if cost > self.limit {
            expect(Kind::Never, self.limit - used)
        } else if used + cost <= self.limit {
            if cost > 0 {
                self.admitted.push((now, cost));
            }
            expect(Kind::Allow, self.limit - used - cost)
        } else {
            expect(Kind::Deny, self.limit - used)
        }
    }

    fn refund(&mut self, now: u64, cost: u64) {
        // The oldest units still in the window go back first (those that
        // stay leave the window last: never more admitted than an exact
        // refund of the request's own units would).
        let mut left = cost;
        for i in 0..self.admitted.len() {
            if left == 0 {
                break;
            }
            if !self.in_window(self.admitted[i].0, now) {
                continue;
            }
            let take = left.min(self.admitted[i].1);
            self.admitted[i].1 -= take;
            left -= take;
        }
        self.admitted.retain(|(_, c)| *c > 0);
    }
}

// ---------------------------------------------------------------------------
// Leaky bucket: a queue of unit departure times, one interval apart at
// least. A request of n units gets the next n slots; it waits for its last
// unit; it is refused if that wait exceeds max_delay.

#[derive(Debug)]
struct LeakyBucketModel {
    interval: u64,
    max_delay: u64,
    /// Departure time of every unit ever scheduled, in order.
    departures: Vec<u64>,
}

impl LeakyBucketModel {
    /// The earliest slot for the next unit.
    fn next_slot(&self, now: u64) -> u64 {
        match self.departures.last() {
            Some(&last) => now.max(last + self.interval),
            None => now,
        }
    }

    /// How many unit requests could go now, one after the other.
    fn room(&self, now: u64) -> u64 {
        let mut slot = self.next_slot(now);
        let mut n = 0;
        while slot - now <= self.max_delay {
            n += 1;
            slot += self.interval;
        }
        n
    }
}

impl Model for LeakyBucketModel {
    fn decide(&mut self, now: u64, cost: u64) -> Expect {
        if cost == 0 {
            return Expect {
                kind: Kind::Allow,
                remaining: self.room(now),
                delay: None,
            };
        }
        // Never: its own units alone span more than max_delay.
        if (cost - 1) * self.interval > self.max_delay {
            return expect(Kind::Never, self.room(now));
        }
        let first = self.next_slot(now);
        let last = first + (cost - 1) * self.interval;
        if last - now > self.max_delay {
            return expect(Kind::Deny, self.room(now));
        }
        for k in 0..cost {
            self.departures.push(first + k * self.interval);
        }
        Expect {
            kind: Kind::Allow,
            remaining: self.room(now),
            delay: Some(last - now),
        }
    }

    fn refund(&mut self, now: u64, cost: u64) {
        // Units still holding their slot (not yet a whole interval past
        // their departure) give it back, the latest first.
        for _ in 0..cost {
            match self.departures.last() {
                Some(&d) if d + self.interval > now => {
                    self.departures.pop();
                }
                _ => break,
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Semaphore: a map from lease id to (expiry, permits).

#[derive(Debug)]
struct SemaphoreModel {
    max: u64,
    ttl: u64,
    retry_after: u64,
    leases: BTreeMap<u64, (u64, u64)>,
}

impl SemaphoreModel {
    fn held(&self, at: u64) -> u64 {
        self.leases
            .values()
            .filter(|(expires, _)| *expires > at)
            .map(|(_, p)| p)
            .sum()
    }

    fn live(&self, id: u64, now: u64) -> bool {
        self.leases.get(&id).is_some_and(|(e, _)| *e > now)
    }
}

/// What the model expects of an acquire.
#[derive(Debug, PartialEq, Eq)]
struct SemExpect {
    kind: Kind,
    remaining: u64,
    lease: bool,
    /// For a denial: the rule's retry hint.
    retry_after: Option<u64>,
}

impl SemaphoreModel {
    fn acquire(&mut self, now: u64, permits: u32, ceiling: u32, id: u64) -> SemExpect {
        let held = self.held(now);
        let permits = u64::from(permits);
        let cap = u64::from(ceiling).min(self.max);
        let free = cap.saturating_sub(held);
        let answer = |kind, remaining, lease, retry_after| SemExpect {
            kind,
            remaining,
            lease,
            retry_after,
        };
        if permits == 0 {
            answer(Kind::Allow, free, false, None)
        } else if permits > cap {
            answer(Kind::Never, free, false, None)
        } else if held + permits > cap {
            answer(Kind::Deny, free, false, Some(self.retry_after))
        } else {
            self.leases.insert(id, (now + self.ttl, permits));
            answer(Kind::Allow, free - permits, true, None)
        }
    }

    fn release(&mut self, now: u64, id: u64) -> bool {
        let live = self.live(id, now);
        self.leases.remove(&id);
        live
    }

    fn renew(&mut self, now: u64, id: u64) -> bool {
        let live = self.live(id, now);
        if live {
            self.leases.get_mut(&id).unwrap().0 = now + self.ttl;
        }
        live
    }
}

const CASES: u32 = 256;
const STEPS: usize = 200;

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: CASES,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn gcra_matches_credit_bucket(
        (alg, interval) in support::gcra(),
        start in support::start(),
        steps in support::trace(support::forward_jump(), true, STEPS),
    ) {
        let model = GcraModel::new(interval, alg.capacity());
        compare(&alg, model, interval, start, &steps)?;
    }

    #[test]
    fn token_bucket_matches_tick_simulation(
        (cap, refill, interval) in support::token_bucket_params(),
        start in support::start(),
        steps in support::trace(support::forward_jump(), true, STEPS),
    ) {
        let alg = tollgate_core::TokenBucket::new(
            cap, refill, std::time::Duration::from_nanos(interval),
        ).unwrap();
        let model = TokenBucketModel {
            capacity: cap.into(),
            refill: refill.into(),
            interval,
            tokens: cap.into(),
            tick: None,
        };
        compare(&alg, model, interval, start, &steps)?;
    }

    #[test]
    fn fixed_window_matches_count_per_window(
        (alg, window) in support::fixed_window(),
        start in support::start(),
        steps in support::trace(support::forward_jump(), true, STEPS),
    ) {
        let model = FixedWindowModel { limit: alg.capacity(), window, counts: HashMap::new() };
        compare(&alg, model, window, start, &steps)?;
    }

    #[test]
    fn sliding_window_counter_matches_weighted_counts(
        (alg, window) in support::sliding_window_counter(),
        start in support::start(),
        steps in support::trace(support::forward_jump(), true, STEPS),
    ) {
        let model = SlidingWindowCounterModel {
            limit: alg.capacity(),
            window,
            counts: HashMap::new(),
        };
        compare(&alg, model, window, start, &steps)?;
    }

    #[test]
    fn sliding_window_log_matches_full_history(
        (alg, window) in support::sliding_window_log(),
        start in support::start(),
        steps in support::trace(support::forward_jump(), true, STEPS),
    ) {
        let model = SlidingWindowLogModel {
            limit: alg.capacity(),
            window,
            admitted: Vec::new(),
        };
        compare(&alg, model, window, start, &steps)?;
    }

    #[test]
    fn leaky_bucket_matches_departure_queue(
        (alg, interval, max_delay) in support::leaky_bucket(),
        start in support::start(),
        steps in support::trace(support::forward_jump(), true, STEPS),
    ) {
        let model = LeakyBucketModel { interval, max_delay, departures: Vec::new() };
        prop_assert_eq!(alg.capacity(), model.room(0));
        compare(&alg, model, interval, start, &steps)?;
    }

    #[test]
    fn semaphore_matches_lease_map(
        (sem, ttl) in support::semaphore(),
        start in support::start(),
        steps in proptest::collection::vec((support::forward_jump(), support::sem_op()), 1..=STEPS),
    ) {
        let mut model = SemaphoreModel {
            max: sem.max().into(),
            ttl,
            retry_after: sem.retry_after(),
            leases: BTreeMap::new(),
        };
        let mut state = SemaphoreState::default();
        let mut now = start;
        let mut hint = 0;
        let mut issued = Vec::new();
        let mut next_id = 0u64;
        for (i, &(jump, op)) in steps.iter().enumerate() {
            now = jump.apply(now, ttl, hint);
            match op {
                SemOp::Acquire(c, share) => {
                    let permits = c.permits(sem.max().into());
                    let ceiling = support::ceiling(sem.max().into(), share);
                    let id = next_id;
                    next_id += 1;
                    let got = sem.acquire(&mut state, now, permits, ceiling, id);
                    let want = model.acquire(now, permits, ceiling, id);
                    let got_e = SemExpect {
                        kind: kind(&got.decision),
                        remaining: got.decision.remaining,
                        lease: got.lease.is_some(),
                        retry_after: match got.decision.outcome {
                            Outcome::Deny { retry_after } => Some(retry_after),
                            _ => None,
                        },
                    };
                    prop_assert_eq!(&got_e, &want, "step {} at {}: acquire {}", i, now, permits);
                    if let Some(lease) = got.lease {
                        prop_assert_eq!(lease.id, id);
                        prop_assert_eq!(lease.permits, permits);
                        issued.push(id);
                    }
                    hint = want.retry_after.unwrap_or(got.decision.reset_after);
                }
                SemOp::Release(seed) => {
                    let id = support::pick_id(&issued, seed);
                    let got = sem.release(&mut state, now, id);
                    prop_assert_eq!(got, model.release(now, id), "step {} at {}: release {}", i, now, id);
                }
                SemOp::Renew(seed) => {
                    let id = support::pick_id(&issued, seed);
                    let got = sem.renew(&mut state, now, id);
                    prop_assert_eq!(got, model.renew(now, id), "step {} at {}: renew {}", i, now, id);
                }
            }
            prop_assert_eq!(state.held(now), model.held(now));
            prop_assert!(model.held(now) <= model.max);
            prop_assert!(state.len() <= sem.max() as usize);
        }
    }
}
