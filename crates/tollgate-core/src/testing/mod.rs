//! The store conformance suite: the same scenarios, the same expected
//! decisions, for every [`Store`].
//!
//! A store passes if, driven by a shared [`ManualClock`], it answers every
//! request exactly as the pure algorithm in this crate does on the same
//! trace, keeps keys and rules apart, treats hostile keys (empty, binary,
//! 1 MiB) as ordinary distinct keys, and keeps its concurrency leases.
//!
//! The scenarios assume nothing of the clock's reading: [`run`] starts
//! them at [`START`], [`run_at`] at any time — such as [`UNIX_2026`], a
//! Unix time of today in ns, far above 2⁵³, where a store that computes
//! in doubles (Lua's numbers) rounds to 256 ns unless it takes care.
//!
//! Calendar quotas have their own suite, for every [`QuotaStore`]:
//! [`run_quota`] sets the clock to dates around the ends of days, weeks,
//! months and years (in UTC and at fixed offsets) and compares every
//! answer with the pure [`Quota`](crate::Quota)'s ([`QuotaReference`]);
//! [`run_quota_at`] runs the scenarios that hold from any time.
//!
//! Retry budgets have theirs, for every [`RetryBudgetStore`]:
//! [`run_retry_budget`] compares every withdrawal with the pure
//! [`RetryBudget`](crate::RetryBudget)'s ([`RetryBudgetReference`]) on
//! random traces and on the edges — fractional ratios, the floor, the
//! lapse a slot at a time, the clock going back — at [`START`] and at
//! [`UNIX_2026`].
//!
//! ```
//! # #[derive(Clone)] struct MyStore;
//! # async fn check<S: tollgate_core::Store>(make: impl Fn(tollgate_core::ManualClock) -> S) {
//! // In a store's tests: `make` builds a store that reads the given clock.
//! tollgate_core::testing::run(&make).await;
//! tollgate_core::testing::run_at(&make, tollgate_core::testing::UNIX_2026).await;
//! # }
//! # async fn check_quotas<S: tollgate_core::QuotaStore>(make: impl Fn(tollgate_core::ManualClock) -> S) {
//! // A store that keeps quotas runs their suite too.
//! tollgate_core::testing::run_quota(&make).await;
//! # }
//! # async fn check_retry_budgets<S: tollgate_core::RetryBudgetStore>(make: impl Fn(tollgate_core::ManualClock) -> S) {
//! // And one that keeps retry budgets, theirs.
//! tollgate_core::testing::run_retry_budget(&make).await;
//! # }
//! ```
#![allow(
    clippy::panic,
    clippy::unwrap_used,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects
)]

use std::collections::HashMap;
use std::time::Duration;

use crate::calendar::{Offset, Period, Zone};
use crate::{
    Algorithm, ConcurrencyLimiter, ConcurrencyRule, Limit, Limiter, ManualClock, Outcome,
    QuotaDecision, QuotaLimiter, QuotaRule, QuotaStore, Rate, RateAlgorithm, RetryBudgetLimiter,
    RetryBudgetRule, RetryBudgetStore, Rule, Store,
};

/// Where the suite's clock starts: 10⁶ s, far from zero so that windows and
/// TATs are not at the origin, and far below 2⁵³ ns.
pub const START: u64 = 1_000_000_000_000_000;

/// A Unix time of today in ns, 2026-09-01T12:34:56.123456789Z: about
/// 2⁶⁰·⁶, where a double's step is 256 ns, and on no whole second, so
/// that windows and ticks since the epoch do not line up with it. For
/// [`run_at`] and a store's own traces, with a clock whose reading is the
/// Unix time (as [`ManualClock`]'s is).
pub const UNIX_2026: u64 = 1_788_266_096_123_456_789;

const MS: u64 = 1_000_000;
const SECOND: u64 = 1_000_000_000;
const DAY: u64 = 86_400 * SECOND;

/// One rule of every algorithm, with parameters small enough for short
/// traces to hit every edge.
pub fn rules() -> Vec<Rule> {
    let ms = Duration::from_millis;
    [
        ("gcra", Limit::gcra(Rate::new(5, ms(1_000)), 4)),
        ("token-bucket", Limit::token_bucket(5, 2, ms(300))),
        ("fixed-window", Limit::fixed_window(5, ms(1_000))),
        (
            "sliding-counter",
            Limit::sliding_window_counter(6, ms(1_000)),
        ),
        ("sliding-log", Limit::sliding_window_log(5, ms(1_000))),
        (
            "sliding-buckets",
            Limit::sliding_window_buckets(6, ms(1_000), 4),
        ),
        (
            "leaky-bucket",
            Limit::leaky_bucket(Rate::new(5, ms(1_000)), ms(500)),
        ),
    ]
    .into_iter()
    .map(|(name, limit)| Rule::new(name, limit).unwrap())
    .collect()
}

/// Runs every scenario, each on a fresh store built by `make` around a
/// fresh manual clock set to [`START`]: [`run_at`] at [`START`].
pub async fn run<S: Store>(make: impl Fn(ManualClock) -> S) {
    run_at(make, START).await;
}

/// Runs every scenario, each on a fresh store built by `make` around a
/// fresh manual clock set to `start` (which the scenarios move forward by
/// at most a few hours, and back by less than they moved it forward).
pub async fn run_at<S: Store>(make: impl Fn(ManualClock) -> S, start: u64) {
    for rule in rules() {
        let clock = ManualClock::starting_at(start);
        matches_reference_on_random_trace(&make(clock.clone()), &clock, &rule, 0x5eed).await;
        let clock = ManualClock::starting_at(start);
        burst_deny_recover(&make(clock.clone()), &clock, &rule).await;
        let clock = ManualClock::starting_at(start);
        peek_refund_and_never(&make(clock.clone()), &clock, &rule).await;
    }
    let clock = ManualClock::starting_at(start);
    keys_and_rules_are_independent(&make(clock.clone()), &clock).await;
    let clock = ManualClock::starting_at(start);
    hostile_keys_are_ordinary_keys(&make(clock.clone()), &clock).await;
    let clock = ManualClock::starting_at(start);
    concurrency_permits(&make(clock.clone()), &clock).await;
}

/// The pure algorithm, applied to per-key states kept here: the expected
/// answers, for a store's own traces too.
#[derive(Debug)]
pub struct Reference {
    algorithm: Algorithm,
    states: HashMap<Vec<u8>, RefState>,
}

#[derive(Debug, Clone, Default)]
struct RefState {
    word: u64,
    counter: crate::SlidingWindowCounterState,
    log: crate::SlidingWindowLogState,
    buckets: crate::SlidingWindowBucketsState,
}

impl Reference {
    /// A reference for `rule`, every key fresh.
    pub fn new(rule: &Rule) -> Self {
        Self {
            algorithm: rule.algorithm().clone(),
            states: HashMap::new(),
        }
    }

    /// What the pure algorithm decides for `key` at `now`.
    pub fn decide(&mut self, key: &[u8], now: u64, cost: u64) -> crate::Decision {
        let s = self.states.entry(key.to_vec()).or_default();
        decide_on(&self.algorithm, s, now, cost)
    }

    /// What the pure algorithm would decide for `key` at `now`, changing
    /// nothing.
    pub fn peek(&self, key: &[u8], now: u64, cost: u64) -> crate::Decision {
        let mut s = self.states.get(key).cloned().unwrap_or_default();
        decide_on(&self.algorithm, &mut s, now, cost)
    }

    /// What the pure algorithm's refund does to `key` at `now`.
    pub fn refund(&mut self, key: &[u8], now: u64, cost: u64) {
        let s = self.states.entry(key.to_vec()).or_default();
        match &self.algorithm {
            Algorithm::Gcra(a) => a.refund(&mut s.word, now, cost),
            Algorithm::TokenBucket(a) => a.refund(&mut s.word, now, cost),
            Algorithm::FixedWindow(a) => a.refund(&mut s.word, now, cost),
            Algorithm::LeakyBucket(a) => a.refund(&mut s.word, now, cost),
            Algorithm::SlidingWindowCounter(a) => a.refund(&mut s.counter, now, cost),
            Algorithm::SlidingWindowLog(a) => a.refund(&mut s.log, now, cost),
            Algorithm::SlidingWindowBuckets(a) => a.refund(&mut s.buckets, now, cost),
        }
    }
}

/// `algorithm`'s decision on the state `s`.
fn decide_on(algorithm: &Algorithm, s: &mut RefState, now: u64, cost: u64) -> crate::Decision {
    match algorithm {
        Algorithm::Gcra(a) => a.decide(&mut s.word, now, cost),
        Algorithm::TokenBucket(a) => a.decide(&mut s.word, now, cost),
        Algorithm::FixedWindow(a) => a.decide(&mut s.word, now, cost),
        Algorithm::LeakyBucket(a) => a.decide(&mut s.word, now, cost),
        Algorithm::SlidingWindowCounter(a) => a.decide(&mut s.counter, now, cost),
        Algorithm::SlidingWindowLog(a) => a.decide(&mut s.log, now, cost),
        Algorithm::SlidingWindowBuckets(a) => a.decide(&mut s.buckets, now, cost),
    }
}

/// A small deterministic generator, so traces are the same for every store
/// (and a store's own tests can build traces of their own the same way).
#[derive(Debug, Clone)]
pub struct Lcg(pub u64);

impl Lcg {
    /// The next number in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % n
    }
}

/// The shape of a random trace: how many steps, the clock's step unit in
/// ns, and whether the clock also goes back.
#[derive(Debug, Clone, Copy)]
pub struct Trace {
    /// Seed of the trace's [`Lcg`].
    pub seed: u64,
    /// Decisions and refunds to make.
    pub steps: u32,
    /// The clock moves by multiples of this many ns (plus up to 999 ns).
    pub unit: u64,
    /// Whether the clock also moves back, by up to 1,500 units (never
    /// before where the trace started).
    pub backwards: bool,
}

/// Moves `clock` one random step: forward by multiples of `unit` ns (plus
/// up to 999 ns), or, when `back_to` is given, sometimes back by up to
/// 1,500 units, never before `back_to`.
pub fn move_clock(clock: &ManualClock, rng: &mut Lcg, unit: u64, back_to: Option<u64>) {
    match (rng.below(6), back_to) {
        (0, _) => {}
        (1, _) => clock.advance_nanos(rng.below(400) * unit),
        (2, Some(floor)) => {
            let back = rng.below(1_500) * unit + rng.below(1_000);
            clock.set(crate::Clock::now(clock).saturating_sub(back).max(floor));
        }
        _ => clock.advance_nanos(rng.below(60) * unit + rng.below(1_000)),
    }
}

/// Random steps over three keys — clock moves per `trace`, costs 0 to
/// capacity + 1, occasional refunds — answered exactly as the pure
/// algorithm answers them.
pub async fn random_trace<S: Store>(store: &S, clock: &ManualClock, rule: &Rule, trace: Trace) {
    let limiter = store.limiter(rule).unwrap();
    let mut reference = Reference::new(rule);
    let mut rng = Lcg(trace.seed);
    let keys: [&[u8]; 3] = [b"alice", b"bob", b"carol"];
    let capacity = rule.capacity();
    let origin = crate::Clock::now(clock);
    let unit = trace.unit;
    for step in 0..trace.steps {
        move_clock(clock, &mut rng, unit, trace.backwards.then_some(origin));
        let key = keys[rng.below(3) as usize];
        let now = crate::Clock::now(clock);
        if rng.below(8) == 0 {
            let cost = rng.below(4);
            limiter.refund(key, cost).await.unwrap();
            reference.refund(key, now, cost);
            continue;
        }
        let cost = rng.below(capacity + 2);
        let got = limiter.decide(key, cost).await.unwrap();
        let want = reference.decide(key, now, cost);
        assert_eq!(
            got,
            want,
            "rule {} step {step} ({trace:?}): key {:?} cost {cost} at +{} ns",
            rule.name(),
            String::from_utf8_lossy(key),
            now - origin
        );
    }
}

/// For stores that decide rules jointly ([`Limiter::decide_joint`]
/// answers): 400 random requests, each decided by a random choice of the
/// rules of [`rules`] at once — random keys and costs, some rules only
/// watching, the clock moving in ms and now and then back. Every rule
/// answers as the pure algorithm does on the state before the request;
/// when no enforced rule denies, every admitting rule consumes. When one
/// does, an `atomic` store (one that decides all the rules in one step)
/// consumes nothing; any other may have consumed for some rules, which
/// the trace then refunds, as a caller does.
pub async fn joint_random_trace<S: Store>(store: &S, clock: &ManualClock, seed: u64, atomic: bool) {
    let rules = rules();
    let limiters: Vec<S::Limiter> = rules.iter().map(|r| store.limiter(r).unwrap()).collect();
    let mut references: Vec<Reference> = rules.iter().map(Reference::new).collect();
    let mut rng = Lcg(seed);
    let keys: [&[u8]; 3] = [b"alice", b"bob", b"carol"];
    let origin = crate::Clock::now(clock);
    for step in 0..400 {
        move_clock(clock, &mut rng, MS, Some(origin));
        let now = crate::Clock::now(clock);
        // Two or more rules, in a random order, each with its key and cost.
        let mut chosen: Vec<usize> = (0..rules.len()).filter(|_| rng.below(3) != 0).collect();
        while chosen.len() < 2 {
            chosen.push(rng.below(rules.len() as u64) as usize);
            chosen.dedup();
        }
        let shift = rng.below(chosen.len() as u64) as usize;
        chosen.rotate_left(shift);
        let asks: Vec<(usize, &[u8], u64, bool)> = chosen
            .iter()
            .map(|&r| {
                let cost = rng.below(rules[r].capacity() + 2);
                (r, keys[rng.below(3) as usize], cost, rng.below(5) != 0)
            })
            .collect();
        let parts: Vec<crate::JointPart<'_, S::Limiter>> = asks
            .iter()
            .map(|&(r, key, cost, enforced)| crate::JointPart {
                limiter: &limiters[r],
                key,
                cost,
                enforced,
            })
            .collect();
        let got = S::Limiter::decide_joint(&parts)
            .expect("the store decides rules jointly")
            .await;
        assert_eq!(got.len(), asks.len(), "step {step}");
        let want: Vec<crate::Decision> = asks
            .iter()
            .map(|&(r, key, cost, _)| references[r].peek(key, now, cost))
            .collect();
        let denied = asks
            .iter()
            .zip(&want)
            .any(|(&(.., enforced), d)| enforced && !d.is_allowed());
        for (i, ((&(r, key, cost, _), d), answer)) in asks.iter().zip(&want).zip(&got).enumerate() {
            let context = || {
                format!(
                    "step {step}, part {i}: rule {} key {:?} cost {cost} at +{} ns",
                    rules[r].name(),
                    String::from_utf8_lossy(key),
                    now - origin
                )
            };
            assert_eq!(answer.decision.as_ref().ok(), Some(d), "{}", context());
            let may_consume = d.is_allowed() && cost > 0;
            if !denied || atomic {
                assert_eq!(answer.consumed, may_consume && !denied, "{}", context());
            } else {
                assert!(!answer.consumed || may_consume, "{}", context());
            }
            if answer.consumed {
                references[r].decide(key, now, cost);
                if denied {
                    limiters[r].refund(key, cost).await.unwrap();
                    references[r].refund(key, now, cost);
                }
            } else {
                // Nothing consumed, yet the rule looked, as a peek does: a
                // sliding log drops the entries that left its window
                // (which counts once the clock goes back).
                references[r].decide(key, now, 0);
            }
        }
    }
}

/// 300 random steps in ms units, the clock going back now and then: see
/// [`random_trace`].
pub async fn matches_reference_on_random_trace<S: Store>(
    store: &S,
    clock: &ManualClock,
    rule: &Rule,
    seed: u64,
) {
    let trace = Trace {
        seed,
        steps: 300,
        unit: MS,
        backwards: true,
    };
    random_trace(store, clock, rule, trace).await;
}

/// A whole budget is spent at once, the next request is denied with a
/// `retry_after` that is exact: one nanosecond earlier is still denied, at
/// `retry_after` the request goes.
pub async fn burst_deny_recover<S: Store>(store: &S, clock: &ManualClock, rule: &Rule) {
    let limiter = store.limiter(rule).unwrap();
    let capacity = u32::try_from(rule.capacity()).unwrap();
    let key = b"burst";
    // The leaky bucket admits a full-capacity cost only if it fits its
    // max delay; every algorithm admits `capacity` unit requests.
    for i in 0..capacity {
        let d = limiter.decide(key, 1).await.unwrap();
        assert!(
            d.is_allowed(),
            "rule {}: request {i} of the burst: {d:?}",
            rule.name()
        );
        assert_eq!(d.limit, rule.capacity());
    }
    let denied = limiter.decide(key, 1).await.unwrap();
    let Outcome::Deny { retry_after } = denied.outcome else {
        panic!("rule {}: past the burst: {denied:?}", rule.name());
    };
    assert_eq!(denied.remaining, 0, "rule {}", rule.name());
    assert!(retry_after > 0);
    assert!(
        denied.reset_after >= retry_after,
        "rule {}: {denied:?}",
        rule.name()
    );
    clock.advance_nanos(retry_after - 1);
    assert!(
        !limiter.decide(key, 1).await.unwrap().is_allowed(),
        "rule {}: 1 ns before retry_after",
        rule.name()
    );
    clock.advance_nanos(1);
    assert!(
        limiter.decide(key, 1).await.unwrap().is_allowed(),
        "rule {}: at retry_after",
        rule.name()
    );
    // After a long idle gap the budget is whole again.
    clock.advance(Duration::from_secs(3_600));
    let d = limiter.decide(key, 0).await.unwrap();
    assert_eq!(d.remaining, rule.capacity(), "rule {}", rule.name());
    assert_eq!(d.reset_after, 0, "rule {}", rule.name());
}

/// Cost 0 consumes nothing; a refund restores; a cost above capacity is
/// `Never`, however large.
pub async fn peek_refund_and_never<S: Store>(store: &S, clock: &ManualClock, rule: &Rule) {
    let limiter = store.limiter(rule).unwrap();
    let key = b"peek";
    let capacity = rule.capacity();
    clock.advance_nanos(7 * MS);
    assert!(limiter.decide(key, 2).await.unwrap().is_allowed());
    let a = limiter.decide(key, 0).await.unwrap();
    let b = limiter.decide(key, 0).await.unwrap();
    assert!(a.is_allowed());
    assert_eq!(a, b, "rule {}: a peek consumed", rule.name());
    assert_eq!(a.remaining, capacity - 2, "rule {}", rule.name());
    limiter.refund(key, 2).await.unwrap();
    assert_eq!(
        limiter.decide(key, 0).await.unwrap().remaining,
        capacity,
        "rule {}: refund",
        rule.name()
    );
    for cost in [
        capacity + 1,
        u64::from(u32::MAX),
        u64::from(u32::MAX) + 1,
        u64::MAX,
    ] {
        let d = limiter.decide(key, cost).await.unwrap();
        assert_eq!(
            d.outcome,
            Outcome::Never,
            "rule {} cost {cost}",
            rule.name()
        );
        assert_eq!(
            d.remaining,
            capacity,
            "rule {}: Never consumed",
            rule.name()
        );
    }
}

/// One key's spending does not touch another's, and two rules on one
/// store keep separate state for the same key.
pub async fn keys_and_rules_are_independent<S: Store>(store: &S, _clock: &ManualClock) {
    let limit = Limit::fixed_window(2, Duration::from_secs(1));
    let a = store.limiter(&Rule::new("rule-a", limit).unwrap()).unwrap();
    let b = store.limiter(&Rule::new("rule-b", limit).unwrap()).unwrap();
    assert!(a.decide(b"k1", 2).await.unwrap().is_allowed());
    assert!(!a.decide(b"k1", 1).await.unwrap().is_allowed());
    assert!(a.decide(b"k2", 2).await.unwrap().is_allowed());
    assert!(b.decide(b"k1", 2).await.unwrap().is_allowed());
    // The same rule bound twice shares state.
    let a2 = store.limiter(&Rule::new("rule-a", limit).unwrap()).unwrap();
    assert!(!a2.decide(b"k1", 1).await.unwrap().is_allowed());
}

/// Empty, binary, brace, CRLF, NUL and 1 MiB keys are distinct ordinary
/// keys: no error, no collision with each other.
pub async fn hostile_keys_are_ordinary_keys<S: Store>(store: &S, _clock: &ManualClock) {
    let rule = Rule::new("hostile", Limit::fixed_window(1, Duration::from_secs(1))).unwrap();
    let limiter = store.limiter(&rule).unwrap();
    let mut big = vec![b'x'; 1 << 20];
    let mut keys: Vec<Vec<u8>> = vec![
        Vec::new(),
        b"\0".to_vec(),
        b"\r\nSET evil 1\r\n".to_vec(),
        b"{slot}".to_vec(),
        b"}{".to_vec(),
        vec![0xff, 0xfe, 0x00, 0x80],
        "ключ🔑".as_bytes().to_vec(),
        big.clone(),
    ];
    big[(1 << 20) - 1] = b'y';
    keys.push(big);
    for key in &keys {
        let d = limiter.decide(key, 1).await.unwrap();
        assert!(d.is_allowed(), "key of {} bytes collided", key.len());
    }
    for key in &keys {
        let d = limiter.decide(key, 1).await.unwrap();
        assert!(!d.is_allowed(), "key of {} bytes lost its state", key.len());
    }
}

mod concurrency;
mod escalation;
mod quota;
mod retry_budget;

pub use concurrency::*;
pub use escalation::*;
pub use quota::*;
pub use retry_budget::*;
