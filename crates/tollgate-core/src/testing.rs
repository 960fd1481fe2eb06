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

use crate::calendar::{Offset, Period};
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
    pub fn decide(&mut self, key: &[u8], now: u64, cost: u32) -> crate::Decision {
        let s = self.states.entry(key.to_vec()).or_default();
        match &self.algorithm {
            Algorithm::Gcra(a) => a.decide(&mut s.word, now, cost),
            Algorithm::TokenBucket(a) => a.decide(&mut s.word, now, cost),
            Algorithm::FixedWindow(a) => a.decide(&mut s.word, now, cost),
            Algorithm::LeakyBucket(a) => a.decide(&mut s.word, now, cost),
            Algorithm::SlidingWindowCounter(a) => a.decide(&mut s.counter, now, cost),
            Algorithm::SlidingWindowLog(a) => a.decide(&mut s.log, now, cost),
        }
    }

    /// What the pure algorithm's refund does to `key` at `now`.
    pub fn refund(&mut self, key: &[u8], now: u64, cost: u32) {
        let s = self.states.entry(key.to_vec()).or_default();
        match &self.algorithm {
            Algorithm::Gcra(a) => a.refund(&mut s.word, now, cost),
            Algorithm::TokenBucket(a) => a.refund(&mut s.word, now, cost),
            Algorithm::FixedWindow(a) => a.refund(&mut s.word, now, cost),
            Algorithm::LeakyBucket(a) => a.refund(&mut s.word, now, cost),
            Algorithm::SlidingWindowCounter(a) => a.refund(&mut s.counter, now, cost),
            Algorithm::SlidingWindowLog(a) => a.refund(&mut s.log, now, cost),
        }
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
            let cost = rng.below(4) as u32;
            limiter.refund(key, cost).await.unwrap();
            reference.refund(key, now, cost);
            continue;
        }
        let cost = rng.below(capacity + 2) as u32;
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
    for cost in [capacity + 1, u64::from(u32::MAX)] {
        let d = limiter.decide(key, cost as u32).await.unwrap();
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

/// Permits: up to `max` per key, then denied with the rule's retry hint;
/// a ceiling holds a class of traffic to a share (critical reserve);
/// permits above the ceiling are `Never`; release frees; `held` counts;
/// keys are independent; hostile keys are ordinary keys. What every store
/// does, whether its permits lapse or not (see [`lease_expiry`]).
pub async fn concurrency_permits<S: Store>(store: &S, clock: &ManualClock) {
    let rule = ConcurrencyRule::new("conc", 3, Duration::from_secs(10))
        .unwrap()
        .with_retry_after(Duration::from_millis(1_500))
        .unwrap();
    let sem = store.concurrency_limiter(&rule).unwrap();
    let key = b"tenant";
    let all = u32::MAX;
    let a = sem.acquire(key, 2, all).await.unwrap();
    let lease_a = a.lease.expect("first acquire");
    assert_eq!((a.decision.limit, a.decision.remaining), (3, 1));
    assert_eq!(lease_a.permits, 2);
    clock.advance(Duration::from_secs(4));
    // Held to 2 of 3: a second class of traffic gets no more.
    let shared = sem.acquire(key, 1, 2).await.unwrap();
    assert!(shared.lease.is_none(), "{shared:?}");
    assert_eq!(
        shared.decision.outcome,
        Outcome::Deny {
            retry_after: 1_500 * MS
        }
    );
    assert_eq!(
        sem.acquire(key, 3, 2).await.unwrap().decision.outcome,
        Outcome::Never
    );
    let b = sem.acquire(key, 1, all).await.unwrap();
    let lease_b = b.lease.expect("second acquire");
    assert_eq!(lease_b.permits, 1);
    assert_eq!(b.decision.remaining, 0);
    let c = sem.acquire(key, 1, all).await.unwrap();
    assert!(c.lease.is_none());
    assert_eq!(
        c.decision.outcome,
        Outcome::Deny {
            retry_after: 1_500 * MS
        }
    );
    assert_eq!(
        sem.acquire(key, 4, all).await.unwrap().decision.outcome,
        Outcome::Never
    );
    let peek = sem.acquire(key, 0, all).await.unwrap();
    assert!(peek.decision.is_allowed() && peek.lease.is_none());
    assert_eq!(sem.held(key).await.unwrap(), 3);
    // Another key, hostile ones included, is untouched.
    for other in [&b"other"[..], b"", b"{slot}\r\n", &[0xff; 300][..]] {
        let o = sem.acquire(other, 3, all).await.unwrap();
        let lease = o.lease.expect("independent key");
        assert_eq!(sem.held(other).await.unwrap(), 3);
        sem.release(other, lease).await.unwrap();
        assert_eq!(sem.held(other).await.unwrap(), 0);
    }
    sem.release(key, lease_b).await.unwrap();
    assert_eq!(sem.held(key).await.unwrap(), 2);
    let d = sem.acquire(key, 1, all).await.unwrap();
    let lease_d = d.lease.expect("after release");
    sem.release(key, lease_a).await.unwrap();
    sem.release(key, lease_d).await.unwrap();
    assert_eq!(sem.held(key).await.unwrap(), 0);
    assert_eq!(sem.held(b"never-seen").await.unwrap(), 0);
    // A release whose future is dropped unpolled still happens (this is
    // how a guard releases from `Drop`).
    let e = sem
        .acquire(key, 3, all)
        .await
        .unwrap()
        .lease
        .expect("whole");
    drop(sem.release(key, e));
    let mut freed = false;
    for _ in 0..2_000 {
        if sem.held(key).await.unwrap() == 0 {
            freed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(freed, "a dropped release future cancelled the release");
}

/// For stores whose permits are leases that lapse (networked stores): a
/// lease that is never released lapses after the rule's lease TTL, and
/// frees its permits. A store that renews the leases of live holders must
/// have its renewal off for this scenario, which moves the clock past the
/// TTL while the lease is still held.
pub async fn lease_expiry<S: Store>(store: &S, clock: &ManualClock) {
    let rule = ConcurrencyRule::new("lapse", 2, Duration::from_secs(10)).unwrap();
    let sem = store.concurrency_limiter(&rule).unwrap();
    let key = b"crashed";
    let lease = sem.acquire(key, 2, u32::MAX).await.unwrap().lease;
    assert!(lease.is_some());
    clock.advance(Duration::from_millis(9_999));
    assert_eq!(sem.held(key).await.unwrap(), 2);
    assert!(sem.acquire(key, 1, u32::MAX).await.unwrap().lease.is_none());
    clock.advance(Duration::from_millis(1));
    assert_eq!(sem.held(key).await.unwrap(), 0, "the lease should lapse");
    let again = sem.acquire(key, 2, u32::MAX).await.unwrap();
    assert!(again.lease.is_some(), "{again:?}");
}

// Quotas: calendar periods on a manual clock set to dates.

/// The pure [`Quota`](crate::Quota), applied to per-key states kept here:
/// what a [`QuotaStore`] must answer. A refund answers the usage after it,
/// a reset whole budgets (grants forgotten), as [`QuotaLimiter`] says.
#[derive(Debug)]
pub struct QuotaReference {
    quota: crate::Quota,
    states: HashMap<Vec<u8>, crate::QuotaState>,
}

/// One call to a [`QuotaLimiter`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuotaOp {
    /// [`consume`](QuotaLimiter::consume) this cost (0 reads).
    Consume(u32),
    /// [`refund`](QuotaLimiter::refund) this cost.
    Refund(u32),
    /// [`reset`](QuotaLimiter::reset) the key.
    Reset,
    /// [`grant`](QuotaLimiter::grant) this many units.
    Grant(u64),
}

impl QuotaReference {
    /// A reference for `rule`, every key fresh.
    pub fn new(rule: &QuotaRule) -> Self {
        Self {
            quota: rule.quota().clone(),
            states: HashMap::new(),
        }
    }

    /// What the pure quota answers `op` for `key` at `now` (Unix ns).
    pub fn apply(&mut self, key: &[u8], now: u64, op: QuotaOp) -> QuotaDecision {
        let q = &self.quota;
        let s = self.states.entry(key.to_vec()).or_default();
        match op {
            QuotaOp::Consume(cost) => q.decide(s, now, cost),
            QuotaOp::Refund(cost) => {
                q.refund(s, now, cost);
                q.decide(s, now, 0)
            }
            QuotaOp::Reset => {
                *s = crate::QuotaState::default();
                q.decide(s, now, 0)
            }
            QuotaOp::Grant(units) => q.grant(s, now, units),
        }
    }
}

/// Runs `op` for `key` on `limiter`.
pub async fn quota_call<L: QuotaLimiter>(limiter: &L, key: &[u8], op: QuotaOp) -> QuotaDecision {
    let answer = match op {
        QuotaOp::Consume(cost) => limiter.consume(key, cost).await,
        QuotaOp::Refund(cost) => limiter.refund(key, cost).await,
        QuotaOp::Reset => limiter.reset(key).await,
        QuotaOp::Grant(units) => limiter.grant(key, units).await,
    };
    answer.unwrap_or_else(|e| panic!("{op:?} for {key:?}: {e}"))
}

/// Runs `op` for `key` on `limiter` and on `reference` at the clock's
/// time, and asserts they answer alike; `at` says where in a trace.
pub async fn quota_check<L: QuotaLimiter>(
    limiter: &L,
    reference: &mut QuotaReference,
    clock: &ManualClock,
    key: &[u8],
    op: QuotaOp,
    at: &str,
) -> QuotaDecision {
    let now = crate::Clock::unix_now(clock);
    let got = quota_call(limiter, key, op).await;
    let want = reference.apply(key, now, op);
    assert_eq!(
        got,
        want,
        "quota {} {at}: {op:?} for {:?} at {}",
        limiter.rule().name(),
        String::from_utf8_lossy(key),
        civil(now)
    );
    got
}

/// `now` as a readable UTC date and time, for messages.
fn civil(now: u64) -> String {
    let secs = now / 1_000_000_000;
    let (y, m, d) = crate::calendar::civil_from_days((secs / 86_400) as i64);
    let s = secs % 86_400;
    format!(
        "{y}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:09}Z",
        s / 3_600,
        s / 60 % 60,
        s % 60,
        now % 1_000_000_000
    )
}

fn quota_rule(name: &str, periods: &[(Period, u64)], offset: Offset) -> QuotaRule {
    QuotaRule::new(name, periods, offset).unwrap()
}

/// Every quota scenario: traces across the ends of a day, an ISO week,
/// months of 28, 29, 30 and 31 days, a leap day and years, in UTC and at
/// +09:00 and −05:00; the periods' lengths as the calendar has them; a
/// trace over two years; and [`run_quota_at`] at [`UNIX_2026`] and just
/// after the epoch. Each
/// scenario gets a fresh store built by `make` around a manual clock set
/// to its date (the Unix time, in ns).
pub async fn run_quota<S: QuotaStore>(make: impl Fn(ManualClock) -> S) {
    for (label, boundary, offset) in quota_boundaries() {
        let clock = ManualClock::at_unix(boundary - 3_600 * SECOND);
        quota_across_a_boundary(&make(clock.clone()), &clock, label, offset).await;
    }
    let clock = ManualClock::at_unix(crate::calendar::unix_nanos(2023, 12, 20, 9, 30, 0));
    quota_over_two_years(&make(clock.clone()), &clock).await;
    let clock = ManualClock::at_unix(UNIX_2026);
    quota_periods_follow_the_calendar(&make(clock.clone()), &clock).await;
    run_quota_at(&make, UNIX_2026).await;
    run_quota_at(make, 1_000_000_000).await;
}

/// The quota scenarios that hold from any Unix time `start` (such as
/// [`UNIX_2026`], or the epoch itself): refunds, grants and resets; costs
/// above a budget; budgets of 2⁵² and grants as large; independent keys and rules; a
/// random trace in steps of seconds, the clock also going back.
pub async fn run_quota_at<S: QuotaStore>(make: impl Fn(ManualClock) -> S, start: u64) {
    let clock = ManualClock::at_unix(start);
    quota_refund_grant_reset_and_never(&make(clock.clone()), &clock).await;
    let clock = ManualClock::at_unix(start);
    quota_large_budgets(&make(clock.clone()), &clock).await;
    let clock = ManualClock::at_unix(start);
    quota_keys_and_rules_are_independent(&make(clock.clone()), &clock).await;
    let clock = ManualClock::at_unix(start);
    let rule = quota_rule(
        "quota-trace",
        &[(Period::Minute, 7), (Period::Hour, 40), (Period::Day, 90)],
        Offset::UTC,
    );
    let trace = Trace {
        seed: 0x9007a,
        steps: 300,
        unit: SECOND,
        backwards: true,
    };
    quota_random_trace(&make(clock.clone()), &clock, &rule, trace).await;
}

const SECOND: u64 = 1_000_000_000;
const DAY: u64 = 86_400 * SECOND;

/// The boundaries the suite crosses: a label, the instant (Unix ns) a
/// period ends at, and the offset of the quota's periods.
fn quota_boundaries() -> Vec<(&'static str, u64, Offset)> {
    use crate::calendar::unix_nanos as at;
    let tokyo = Offset::from_hours_minutes(9, 0).unwrap();
    let new_york = Offset::from_hours_minutes(-5, 0).unwrap();
    let utc = Offset::UTC;
    let h = 3_600 * SECOND;
    vec![
        ("the end of a day", at(2026, 12, 2, 24, 0, 0), utc),
        ("the end of an ISO week", at(2026, 12, 7, 0, 0, 0), utc),
        ("the end of a 31-day month", at(2026, 2, 1, 0, 0, 0), utc),
        ("the end of a 28-day month", at(2026, 3, 1, 0, 0, 0), utc),
        ("the start of a leap day", at(2024, 2, 29, 0, 0, 0), utc),
        ("the end of a 29-day month", at(2024, 3, 1, 0, 0, 0), utc),
        ("the end of a 30-day month", at(2026, 5, 1, 0, 0, 0), utc),
        ("the end of a leap year", at(2025, 1, 1, 0, 0, 0), utc),
        ("the end of a year", at(2027, 1, 1, 0, 0, 0), utc),
        // Local midnight at +09:00 is 15:00 UTC the day before.
        (
            "a month's end at +09:00",
            at(2026, 5, 1, 0, 0, 0) - 9 * h,
            tokyo,
        ),
        (
            "a week's end at +09:00",
            at(2026, 12, 7, 0, 0, 0) - 9 * h,
            tokyo,
        ),
        (
            "a leap day's end at +09:00",
            at(2024, 3, 1, 0, 0, 0) - 9 * h,
            tokyo,
        ),
        // Local midnight at −05:00 is 05:00 UTC.
        (
            "a year's end at -05:00",
            at(2027, 1, 1, 0, 0, 0) + 5 * h,
            new_york,
        ),
        (
            "a day's end at -05:00",
            at(2026, 12, 3, 0, 0, 0) + 5 * h,
            new_york,
        ),
        (
            "a 28-day month's end at -05:00",
            at(2026, 3, 1, 0, 0, 0) + 5 * h,
            new_york,
        ),
    ]
}

/// Random steps over two keys — costs from 0 to a few above the smallest
/// budget, refunds, grants, resets and reads — with the clock moving
/// forward by multiples of `trace.unit` (up to 400, 37 on average) plus
/// up to 999 ns, and with `trace.backwards` sometimes back by up to 100
/// units (never before where it started): every answer is the pure
/// quota's.
pub async fn quota_random_trace<S: QuotaStore>(
    store: &S,
    clock: &ManualClock,
    rule: &QuotaRule,
    trace: Trace,
) {
    let limiter = store.quota_limiter(rule).unwrap();
    let mut reference = QuotaReference::new(rule);
    let mut rng = Lcg(trace.seed);
    let keys: [&[u8]; 2] = [b"alice", b"bob"];
    let smallest = rule.quota().periods().map(|(_, l)| l).min().unwrap();
    let origin = crate::Clock::now(clock);
    let unit = trace.unit;
    // (admitted, denied, never) among consumes that cost something
    let mut seen = (0, 0, 0);
    for step in 0..trace.steps {
        match rng.below(8) {
            0 => {}
            1 => clock.advance_nanos(rng.below(400) * unit),
            2 if trace.backwards => {
                let back = rng.below(100) * unit + rng.below(1_000);
                clock.set(crate::Clock::now(clock).saturating_sub(back).max(origin));
            }
            _ => clock.advance_nanos(rng.below(60) * unit + rng.below(1_000)),
        }
        let key = keys[rng.below(2) as usize];
        let op = match rng.below(20) {
            0..=10 => QuotaOp::Consume(rng.below(smallest + 4) as u32),
            11 | 12 => QuotaOp::Refund(rng.below(6) as u32),
            13 => QuotaOp::Grant(rng.below(8)),
            14 => QuotaOp::Reset,
            _ => QuotaOp::Consume(0),
        };
        let at = format!("step {step} ({trace:?})");
        let d = quota_check(&limiter, &mut reference, clock, key, op, &at).await;
        if matches!(op, QuotaOp::Consume(c) if c > 0) {
            match d.outcome {
                Outcome::Allow { .. } => seen.0 += 1,
                Outcome::Deny { .. } => seen.1 += 1,
                Outcome::Never => seen.2 += 1,
            }
        }
    }
    // A trace that never fills a period, or never asks too much, proves
    // little.
    if trace.steps >= 100 {
        assert!(
            seen.0 > 0 && seen.1 > 0 && seen.2 > 0,
            "quota {}: (admitted, denied, never) = {seen:?}",
            rule.name()
        );
    }
}

/// Around `label`'s boundary (the clock an hour before it), for a quota
/// of every period at `offset`: steps a second before, at, a nanosecond
/// before (the clock behind the window it saw) and after the boundary,
/// then a random trace of about two hours in steps of seconds,
/// sometimes back.
pub async fn quota_across_a_boundary<S: QuotaStore>(
    store: &S,
    clock: &ManualClock,
    label: &str,
    offset: Offset,
) {
    let rule = quota_rule(
        "calendar",
        &[
            (Period::Minute, 6),
            (Period::Hour, 30),
            (Period::Day, 60),
            (Period::Week, 150),
            (Period::Month, 400),
            (Period::Year, 3_000),
        ],
        offset,
    );
    let start = crate::Clock::now(clock);
    let boundary = start + 3_600 * SECOND;
    let limiter = store.quota_limiter(&rule).unwrap();
    let mut reference = QuotaReference::new(&rule);
    for (at, op) in [
        (start, QuotaOp::Consume(5)),
        (start, QuotaOp::Grant(3)),
        (boundary - SECOND, QuotaOp::Consume(4)),
        (boundary, QuotaOp::Consume(0)),
        (boundary, QuotaOp::Consume(6)),
        (boundary - 1, QuotaOp::Consume(2)),
        (boundary - 1, QuotaOp::Refund(1)),
        (boundary - 1, QuotaOp::Grant(2)),
        (boundary + 59 * SECOND, QuotaOp::Consume(3)),
        (boundary + 61 * SECOND, QuotaOp::Consume(7)),
    ] {
        clock.set(at);
        let step = format!("{label}, {op:?} at {}", civil(at));
        quota_check(&limiter, &mut reference, clock, b"carol", op, &step).await;
    }
    clock.set(start);
    let trace = Trace {
        seed: label.bytes().fold(0xca1e, |h: u64, b| {
            h.wrapping_mul(31).wrapping_add(u64::from(b))
        }),
        steps: 200,
        unit: SECOND,
        backwards: true,
    };
    quota_random_trace(store, clock, &rule, trace).await;
}

/// Two years in steps of hours and days (sometimes weeks, sometimes back
/// by weeks), over every month of 2024 and 2025 — leap day, both year
/// ends — with budgets small enough to fill.
pub async fn quota_over_two_years<S: QuotaStore>(store: &S, clock: &ManualClock) {
    let rule = quota_rule(
        "two-years",
        &[
            (Period::Day, 12),
            (Period::Week, 40),
            (Period::Month, 120),
            (Period::Year, 900),
        ],
        Offset::from_hours_minutes(9, 0).unwrap(),
    );
    let trace = Trace {
        seed: 0x2024,
        steps: 500,
        unit: 3_600 * SECOND,
        backwards: true,
    };
    quota_random_trace(store, clock, &rule, trace).await;
    assert!(
        crate::Clock::now(clock) > crate::calendar::unix_nanos(2025, 3, 1, 0, 0, 0),
        "the trace should reach past 2025's February, not {}",
        civil(crate::Clock::now(clock))
    );
}

/// Reads at known dates report each period's length and time to its end
/// as the calendar has them: months of 28, 29, 30 and 31 days, years of
/// 365 and 366, weeks from Monday, days at +09:00 and −05:00.
pub async fn quota_periods_follow_the_calendar<S: QuotaStore>(store: &S, clock: &ManualClock) {
    use crate::calendar::unix_nanos as at;
    let h = 3_600 * SECOND;
    let tokyo = Offset::from_hours_minutes(9, 0).unwrap();
    let new_york = Offset::from_hours_minutes(-5, 0).unwrap();
    let periods = [
        (Period::Day, 10),
        (Period::Week, 10),
        (Period::Month, 10),
        (Period::Year, 10),
    ];
    // (now, offset, then for day, week, month and year: (length, end))
    let cases = [
        (
            at(2024, 2, 29, 12, 0, 0),
            Offset::UTC,
            [
                (DAY, at(2024, 3, 1, 0, 0, 0)),
                (7 * DAY, at(2024, 3, 4, 0, 0, 0)),
                (29 * DAY, at(2024, 3, 1, 0, 0, 0)),
                (366 * DAY, at(2025, 1, 1, 0, 0, 0)),
            ],
        ),
        (
            at(2026, 2, 15, 8, 30, 0),
            Offset::UTC,
            [
                (DAY, at(2026, 2, 16, 0, 0, 0)),
                (7 * DAY, at(2026, 2, 16, 0, 0, 0)),
                (28 * DAY, at(2026, 3, 1, 0, 0, 0)),
                (365 * DAY, at(2027, 1, 1, 0, 0, 0)),
            ],
        ),
        (
            at(2026, 4, 30, 23, 59, 59) + 999_999_999,
            Offset::UTC,
            [
                (DAY, at(2026, 5, 1, 0, 0, 0)),
                (7 * DAY, at(2026, 5, 4, 0, 0, 0)),
                (30 * DAY, at(2026, 5, 1, 0, 0, 0)),
                (365 * DAY, at(2027, 1, 1, 0, 0, 0)),
            ],
        ),
        // 20:00 UTC on April 30th is 05:00 on May 1st in Tokyo.
        (
            at(2026, 4, 30, 20, 0, 0),
            tokyo,
            [
                (DAY, at(2026, 5, 2, 0, 0, 0) - 9 * h),
                (7 * DAY, at(2026, 5, 4, 0, 0, 0) - 9 * h),
                (31 * DAY, at(2026, 6, 1, 0, 0, 0) - 9 * h),
                (365 * DAY, at(2027, 1, 1, 0, 0, 0) - 9 * h),
            ],
        ),
        // 03:00 UTC on New Year's Day is 22:00 on December 31st in New York.
        (
            at(2027, 1, 1, 3, 0, 0),
            new_york,
            [
                (DAY, at(2027, 1, 1, 0, 0, 0) + 5 * h),
                (7 * DAY, at(2027, 1, 4, 0, 0, 0) + 5 * h),
                (31 * DAY, at(2027, 1, 1, 0, 0, 0) + 5 * h),
                (365 * DAY, at(2027, 1, 1, 0, 0, 0) + 5 * h),
            ],
        ),
    ];
    for (i, (now, offset, want)) in cases.into_iter().enumerate() {
        clock.set(now);
        let rule = quota_rule(&format!("calendar-{i}"), &periods, offset);
        let limiter = store.quota_limiter(&rule).unwrap();
        let d = limiter.consume(b"k", 1).await.unwrap();
        assert!(d.is_allowed(), "{}: {d:?}", civil(now));
        for (p, (length, end)) in d.periods().iter().zip(want) {
            let at = format!("{} at {} ({offset:?})", p.period, civil(now));
            assert_eq!(p.length, length, "{at}: length");
            assert_eq!(p.reset_after, end - now, "{at}: reset_after");
            assert_eq!((p.limit, p.remaining), (10, 9), "{at}");
        }
        // A nanosecond before the year's end, a cost the year cannot take
        // waits until then; there the year is whole again.
        let year = quota_rule(&format!("calendar-{i}-year"), &[(Period::Year, 10)], offset);
        let year = store.quota_limiter(&year).unwrap();
        assert!(year.consume(b"k", 1).await.unwrap().is_allowed());
        let last = want[3].1 - 1;
        clock.set(last);
        let d = year.consume(b"k", 10).await.unwrap();
        assert_eq!(
            d.outcome,
            Outcome::Deny { retry_after: 1 },
            "{}",
            civil(last)
        );
        clock.set(last + 1);
        let d = year.consume(b"k", 10).await.unwrap();
        assert!(d.is_allowed(), "{}: {d:?}", civil(last + 1));
    }
}

/// Refunds, grants and resets, a denial's wait and costs above a
/// budget, step by step, each answer checked against the pure quota and
/// the telling ones spelled out.
pub async fn quota_refund_grant_reset_and_never<S: QuotaStore>(store: &S, clock: &ManualClock) {
    let rule = quota_rule(
        "admin",
        &[(Period::Day, 10), (Period::Month, 25)],
        Offset::UTC,
    );
    let limiter = store.quota_limiter(&rule).unwrap();
    let mut reference = QuotaReference::new(&rule);
    let key = b"customer";
    let now = crate::Clock::unix_now(clock);
    let midnight = Period::Day.bounds(now, Offset::UTC).1;
    let mut check = async |op: QuotaOp, at: &str| {
        quota_check(&limiter, &mut reference, clock, key, op, at).await
    };
    let remaining = |d: &QuotaDecision| (d.periods()[0].remaining, d.periods()[1].remaining);
    let limits = |d: &QuotaDecision| (d.periods()[0].limit, d.periods()[1].limit);

    let d = check(QuotaOp::Consume(4), "first").await;
    assert_eq!(remaining(&d), (6, 21));
    let d = check(QuotaOp::Consume(7), "too many for the day").await;
    assert_eq!(
        d.outcome,
        Outcome::Deny {
            retry_after: midnight - now
        }
    );
    assert_eq!(remaining(&d), (6, 21), "a denial charged");
    for cost in [11, 26, u32::MAX] {
        let d = check(QuotaOp::Consume(cost), "above the day's budget").await;
        assert_eq!(d.outcome, Outcome::Never);
        assert_eq!(remaining(&d), (6, 21), "a Never charged");
    }
    let d = check(QuotaOp::Refund(3), "refund").await;
    assert_eq!(remaining(&d), (9, 24));
    let d = check(QuotaOp::Refund(100), "refund more than used").await;
    assert_eq!(remaining(&d), (10, 25));
    let d = check(QuotaOp::Grant(5), "grant").await;
    assert_eq!((limits(&d), remaining(&d)), ((15, 30), (15, 30)));
    // With the grant, 11 is no longer above the day's budget.
    let d = check(QuotaOp::Consume(11), "within the grant").await;
    assert_eq!(remaining(&d), (4, 19));
    let d = check(QuotaOp::Reset, "reset").await;
    assert_eq!((limits(&d), remaining(&d)), ((10, 25), (10, 25)));
    check(QuotaOp::Consume(0), "after the reset").await;
    // A grant lapses with its period; usage of the day before is not
    // refunded to today, while the month's still is.
    check(QuotaOp::Grant(5), "grant again").await;
    check(QuotaOp::Consume(8), "spend").await;
    clock.set(midnight);
    let d = check(QuotaOp::Consume(0), "the next day").await;
    if Period::Month.bounds(midnight, Offset::UTC).0 != midnight {
        assert_eq!((limits(&d), remaining(&d)), ((10, 30), (10, 22)));
        let d = check(QuotaOp::Refund(3), "refund yesterday's").await;
        assert_eq!(remaining(&d), (10, 25));
    }
    check(QuotaOp::Consume(10), "a whole day").await;
    check(QuotaOp::Consume(1), "past it").await;
    // A grant of more than 2^52 is 2^52.
    let d = check(QuotaOp::Grant(u64::MAX), "a huge grant").await;
    assert_eq!(d.periods()[0].limit, 10 + crate::Quota::MAX_LIMIT);
    check(QuotaOp::Grant(0), "a grant of nothing").await;
    check(QuotaOp::Refund(0), "a refund of nothing").await;
}

/// Budgets of 2⁵² and grants as large: counts stay exact to the unit.
pub async fn quota_large_budgets<S: QuotaStore>(store: &S, clock: &ManualClock) {
    let max = crate::Quota::MAX_LIMIT;
    let rule = quota_rule(
        "large",
        &[(Period::Day, max), (Period::Year, max - 1)],
        Offset::UTC,
    );
    let limiter = store.quota_limiter(&rule).unwrap();
    let mut reference = QuotaReference::new(&rule);
    let key = b"big";
    for i in 0..3 {
        let d = quota_check(
            &limiter,
            &mut reference,
            clock,
            key,
            QuotaOp::Consume(u32::MAX),
            "spend",
        )
        .await;
        assert_eq!(
            d.periods()[0].remaining,
            max - (i + 1) * u64::from(u32::MAX)
        );
        clock.advance_nanos(SECOND + 7);
    }
    let d = quota_check(
        &limiter,
        &mut reference,
        clock,
        key,
        QuotaOp::Grant(max),
        "grant",
    )
    .await;
    assert_eq!(d.periods()[0].limit, 2 * max);
    assert_eq!(d.periods()[1].limit, 2 * max - 1);
    for (op, at) in [
        (QuotaOp::Consume(u32::MAX), "spend on the grant"),
        (QuotaOp::Refund(1), "refund one"),
        (QuotaOp::Consume(1), "spend one"),
        (QuotaOp::Grant(3), "grant past 2^52"),
        (QuotaOp::Consume(0), "read"),
    ] {
        quota_check(&limiter, &mut reference, clock, key, op, at).await;
    }
}

/// One key's usage does not touch another's, two rules keep separate
/// usage of one key, the same rule bound twice shares it, and hostile
/// keys (empty, binary, braces, CRLF, 1 MiB) are ordinary keys.
pub async fn quota_keys_and_rules_are_independent<S: QuotaStore>(store: &S, _clock: &ManualClock) {
    let day = [(Period::Day, 2)];
    let a = store
        .quota_limiter(&quota_rule("quota-a", &day, Offset::UTC))
        .unwrap();
    let b = store
        .quota_limiter(&quota_rule("quota-b", &day, Offset::UTC))
        .unwrap();
    assert!(a.consume(b"k1", 2).await.unwrap().is_allowed());
    assert!(!a.consume(b"k1", 1).await.unwrap().is_allowed());
    assert!(a.consume(b"k2", 2).await.unwrap().is_allowed());
    assert!(b.consume(b"k1", 2).await.unwrap().is_allowed());
    let a2 = store
        .quota_limiter(&quota_rule("quota-a", &day, Offset::UTC))
        .unwrap();
    assert!(!a2.consume(b"k1", 1).await.unwrap().is_allowed());
    let hostile = store
        .quota_limiter(&quota_rule(
            "quota-hostile",
            &[(Period::Month, 1)],
            Offset::UTC,
        ))
        .unwrap();
    let mut big = vec![b'x'; 1 << 20];
    let mut keys: Vec<Vec<u8>> = vec![
        Vec::new(),
        b"\0".to_vec(),
        b"\r\nSET evil 1\r\n".to_vec(),
        b"{slot}".to_vec(),
        vec![0xff, 0xfe, 0x00, 0x80],
        big.clone(),
    ];
    big[(1 << 20) - 1] = b'y';
    keys.push(big);
    for key in &keys {
        let d = hostile.consume(key, 1).await.unwrap();
        assert!(d.is_allowed(), "key of {} bytes collided", key.len());
    }
    for key in &keys {
        let d = hostile.consume(key, 1).await.unwrap();
        assert!(!d.is_allowed(), "key of {} bytes lost its usage", key.len());
    }
}

// Retry budgets: deposits and withdrawals on a manual clock.

/// The pure [`RetryBudget`](crate::RetryBudget), applied to per-key
/// states kept here: what a [`RetryBudgetStore`] must answer.
#[derive(Debug)]
pub struct RetryBudgetReference {
    budget: crate::RetryBudget,
    states: HashMap<Vec<u8>, crate::RetryBudgetState>,
}

impl RetryBudgetReference {
    /// A reference for `rule`, every key fresh.
    pub fn new(rule: &RetryBudgetRule) -> Self {
        Self {
            budget: *rule.budget(),
            states: HashMap::new(),
        }
    }

    /// What a deposit for `key` at `now` does.
    pub fn deposit(&mut self, key: &[u8], now: u64) {
        let s = self.states.entry(key.to_vec()).or_default();
        self.budget.deposit(s, now);
    }

    /// What the pure budget answers a withdrawal for `key` at `now`.
    pub fn withdraw(&mut self, key: &[u8], now: u64) -> bool {
        let s = self.states.entry(key.to_vec()).or_default();
        self.budget.withdraw(s, now)
    }

    /// The balance of `key` at `now`, in thousandths of a retry.
    pub fn balance(&self, key: &[u8], now: u64) -> u64 {
        self.states
            .get(key)
            .map_or(self.budget.reserve_units(), |s| self.budget.balance(s, now))
    }
}

/// One retry budget of each shape the suite traces, with a clock unit
/// that crosses their slots and windows often: exact fractional ratios
/// (0.6, 0.25, 0.333), a floor, a window that is no round number of
/// seconds, and one of 10 ms (slots of 1 ms, the shortest).
pub fn retry_budget_rules() -> Vec<(RetryBudgetRule, u64)> {
    let secs = Duration::from_secs;
    [
        ("retry-0.6", 0.6, 0, secs(10), 10 * MS),
        ("retry-0.25", 0.25, 0, secs(10), 10 * MS),
        (
            "retry-0.333-floor",
            0.333,
            1,
            Duration::from_nanos(12_345_678_901),
            10 * MS,
        ),
        ("retry-floor", 0.2, 3, secs(2), 2 * MS),
        (
            "retry-short",
            0.5,
            0,
            Duration::from_nanos(10_000_007),
            10_000,
        ),
    ]
    .into_iter()
    .map(|(name, ratio, floor, window, unit)| {
        (
            RetryBudgetRule::new(name, ratio, floor, window).unwrap(),
            unit,
        )
    })
    .collect()
}

/// Runs every retry budget scenario at [`START`] and at [`UNIX_2026`]
/// (see [`run_retry_budget_at`]).
pub async fn run_retry_budget<S: RetryBudgetStore>(make: impl Fn(ManualClock) -> S) {
    run_retry_budget_at(&make, START).await;
    run_retry_budget_at(make, UNIX_2026).await;
}

/// Runs every retry budget scenario, each on a fresh store built by
/// `make` around a fresh manual clock set to `start`: a random trace
/// per rule of [`retry_budget_rules`], the clock also going back; exact
/// fractional ratios; the floor, and deposits lapsing a slot at a time;
/// the clock going back; independent keys and rules, hostile keys; and a
/// deposit whose future is dropped.
pub async fn run_retry_budget_at<S: RetryBudgetStore>(make: impl Fn(ManualClock) -> S, start: u64) {
    for (rule, unit) in retry_budget_rules() {
        let clock = ManualClock::starting_at(start);
        let trace = Trace {
            seed: 0xb0d6e7,
            steps: 400,
            unit,
            backwards: true,
        };
        retry_budget_random_trace(&make(clock.clone()), &clock, &rule, trace).await;
    }
    let clock = ManualClock::starting_at(start);
    retry_budget_fractional_ratios(&make(clock.clone()), &clock).await;
    let clock = ManualClock::starting_at(start);
    retry_budget_floor_and_lapse(&make(clock.clone()), &clock).await;
    let clock = ManualClock::starting_at(start);
    retry_budget_clock_going_back(&make(clock.clone()), &clock).await;
    let clock = ManualClock::starting_at(start);
    retry_budget_keys_are_independent(&make(clock.clone()), &clock).await;
    let clock = ManualClock::starting_at(start);
    retry_budget_deposit_survives_its_future(&make(clock.clone()), &clock).await;
}

/// Deposits `key` on `limiter` and on `reference` at the clock's time.
pub async fn retry_deposit<L: RetryBudgetLimiter>(
    limiter: &L,
    reference: &mut RetryBudgetReference,
    clock: &ManualClock,
    key: &[u8],
) {
    let now = crate::Clock::now(clock);
    limiter
        .deposit(key)
        .await
        .unwrap_or_else(|e| panic!("deposit for {key:?}: {e}"));
    reference.deposit(key, now);
}

/// Withdraws for `key` on `limiter` and on `reference` at the clock's
/// time, asserts they answer alike (`at` says where), and returns the
/// answer.
pub async fn retry_withdraw<L: RetryBudgetLimiter>(
    limiter: &L,
    reference: &mut RetryBudgetReference,
    clock: &ManualClock,
    key: &[u8],
    at: &str,
) -> bool {
    let now = crate::Clock::now(clock);
    let got = limiter
        .withdraw(key)
        .await
        .unwrap_or_else(|e| panic!("withdraw for {key:?}: {e}"));
    let want = reference.withdraw(key, now);
    assert_eq!(
        got,
        want,
        "retry budget {} {at}: withdraw for {:?} at {now} (balance before: {})",
        limiter.rule().name(),
        String::from_utf8_lossy(key),
        reference.balance(key, now)
            + if want {
                crate::algorithm::RETRY_UNIT
            } else {
                0
            },
    );
    got
}

/// Random deposits and withdrawals over three keys (a withdrawal for
/// every two deposits, in bursts), the clock moving per `trace`: every
/// withdrawal answered as the pure budget answers it. A trace of 100
/// steps or more must see withdrawals both granted and refused.
pub async fn retry_budget_random_trace<S: RetryBudgetStore>(
    store: &S,
    clock: &ManualClock,
    rule: &RetryBudgetRule,
    trace: Trace,
) {
    let limiter = store.retry_budget(rule).unwrap();
    let mut reference = RetryBudgetReference::new(rule);
    let mut rng = Lcg(trace.seed);
    let keys: [&[u8]; 3] = [b"alice", b"bob", b"carol"];
    let origin = crate::Clock::now(clock);
    let (mut granted, mut refused) = (0, 0);
    for step in 0..trace.steps {
        move_clock(
            clock,
            &mut rng,
            trace.unit,
            trace.backwards.then_some(origin),
        );
        let key = keys[rng.below(3) as usize];
        // Bursts of either, so that balances both fill and run dry.
        let times = 1 + rng.below(4);
        if rng.below(3) == 0 {
            for _ in 0..times {
                let at = format!(
                    "step {step} ({trace:?}) at +{} ns",
                    crate::Clock::now(clock) - origin
                );
                match retry_withdraw(&limiter, &mut reference, clock, key, &at).await {
                    true => granted += 1,
                    false => refused += 1,
                }
            }
        } else {
            for _ in 0..times {
                retry_deposit(&limiter, &mut reference, clock, key).await;
            }
        }
    }
    if trace.steps >= 100 {
        assert!(
            granted > 0 && refused > 0,
            "retry budget {}: (granted, refused) = ({granted}, {refused})",
            rule.name()
        );
    }
}

/// Ratios are exact to the thousandth: 0.6 buys three retries per five
/// calls (not one per call, tower#857), 0.25 one per four, 0.333 none
/// for three calls and one for four.
pub async fn retry_budget_fractional_ratios<S: RetryBudgetStore>(store: &S, clock: &ManualClock) {
    let ten = Duration::from_secs(10);
    for (name, ratio, calls, retries) in [
        ("ratio-0.6", 0.6, 5, 3),
        ("ratio-0.6-more", 0.6, 10, 6),
        ("ratio-0.25", 0.25, 7, 1),
        ("ratio-0.25-even", 0.25, 8, 2),
        ("ratio-0.333", 0.333, 3, 0),
        ("ratio-0.333-four", 0.333, 4, 1),
        ("ratio-0.333-many", 0.333, 301, 100),
        ("ratio-1.5", 1.5, 3, 4),
    ] {
        let rule = RetryBudgetRule::new(name, ratio, 0, ten).unwrap();
        let limiter = store.retry_budget(&rule).unwrap();
        let mut reference = RetryBudgetReference::new(&rule);
        for _ in 0..calls {
            retry_deposit(&limiter, &mut reference, clock, b"k").await;
        }
        let mut granted = 0;
        for i in 0..retries + 3 {
            let at = format!("after {calls} calls, retry {i}");
            granted +=
                usize::from(retry_withdraw(&limiter, &mut reference, clock, b"k", &at).await);
        }
        assert_eq!(granted, retries, "{name}: {calls} calls");
    }
}

/// With no calls, the floor alone: `min_per_second × window` retries,
/// then none. Deposits lapse a slot at a time: a deposit counts until
/// the start of the tenth slot after its own — a nanosecond before, it
/// does; at it, it does not — and so do withdrawals, which give the
/// floor back as they lapse.
pub async fn retry_budget_floor_and_lapse<S: RetryBudgetStore>(store: &S, clock: &ManualClock) {
    let rule = RetryBudgetRule::new("floor", 0.2, 10, Duration::from_secs(2)).unwrap();
    let limiter = store.retry_budget(&rule).unwrap();
    let mut reference = RetryBudgetReference::new(&rule);
    let key = b"quiet";
    let mut granted = 0;
    for i in 0..25 {
        let at = format!("floor, retry {i}");
        granted += usize::from(retry_withdraw(&limiter, &mut reference, clock, key, &at).await);
    }
    assert_eq!(granted, 20, "10 a second over 2 s");
    // Ten calls buy two more.
    for _ in 0..10 {
        retry_deposit(&limiter, &mut reference, clock, key).await;
    }
    for i in 0..3 {
        let at = format!("after ten calls, retry {i}");
        retry_withdraw(&limiter, &mut reference, clock, key, &at).await;
    }
    // A window on, all of it has lapsed: the floor is whole again.
    clock.advance(Duration::from_secs(2));
    let mut granted = 0;
    for i in 0..25 {
        let at = format!("a window on, retry {i}");
        granted += usize::from(retry_withdraw(&limiter, &mut reference, clock, key, &at).await);
    }
    assert_eq!(granted, 20);

    // Exactly when a deposit lapses: one call buys one retry.
    let rule = RetryBudgetRule::new("lapse", 1.0, 0, Duration::from_secs(1)).unwrap();
    let limiter = store.retry_budget(&rule).unwrap();
    let mut reference = RetryBudgetReference::new(&rule);
    let slot = rule.budget().window() / crate::algorithm::RETRY_SLOTS as u64;
    clock.advance_nanos(slot / 3 + 17);
    let at_deposit = crate::Clock::now(clock);
    for key in [&b"before"[..], b"at"] {
        retry_deposit(&limiter, &mut reference, clock, key).await;
    }
    let lapse = (at_deposit / slot + 10) * slot;
    clock.set(lapse - 1);
    assert!(
        retry_withdraw(
            &limiter,
            &mut reference,
            clock,
            b"before",
            "1 ns before the lapse"
        )
        .await
    );
    clock.set(lapse);
    assert!(!retry_withdraw(&limiter, &mut reference, clock, b"at", "at the lapse").await);
}

/// The clock going back keeps what was spent: slots from later count
/// until they lapse, and deposits made meanwhile go to now's slot or,
/// where it holds a later one, to that.
pub async fn retry_budget_clock_going_back<S: RetryBudgetStore>(store: &S, clock: &ManualClock) {
    let rule = RetryBudgetRule::new("back", 1.0, 0, Duration::from_secs(10)).unwrap();
    let limiter = store.retry_budget(&rule).unwrap();
    let mut reference = RetryBudgetReference::new(&rule);
    let start = crate::Clock::now(clock);
    let key = b"k";
    clock.set(start + 20 * SECOND);
    retry_deposit(&limiter, &mut reference, clock, key).await;
    assert!(retry_withdraw(&limiter, &mut reference, clock, key, "at 20 s").await);
    // Back 5 s: the later slot's withdrawal still counts.
    clock.set(start + 15 * SECOND);
    assert!(!retry_withdraw(&limiter, &mut reference, clock, key, "back at 15 s").await);
    retry_deposit(&limiter, &mut reference, clock, key).await;
    assert!(retry_withdraw(&limiter, &mut reference, clock, key, "a call at 15 s").await);
    // Back 10 s, to the position of the 20 s slot a window earlier: the
    // deposit joins the later slot.
    clock.set(start + 10 * SECOND);
    retry_deposit(&limiter, &mut reference, clock, key).await;
    retry_deposit(&limiter, &mut reference, clock, key).await;
    for i in 0..3 {
        let at = format!("back at 10 s, retry {i}");
        retry_withdraw(&limiter, &mut reference, clock, key, &at).await;
    }
    for t in [24, 29, 30, 31, 35, 40] {
        clock.set(start + t * SECOND);
        let at = format!("forward again at {t} s");
        retry_withdraw(&limiter, &mut reference, clock, key, &at).await;
        retry_deposit(&limiter, &mut reference, clock, key).await;
    }
}

/// One key's budget is not another's, two rules keep separate budgets
/// for one key, the same rule bound twice shares one, and hostile keys
/// (empty, binary, braces, CRLF, 1 MiB) are ordinary keys.
pub async fn retry_budget_keys_are_independent<S: RetryBudgetStore>(
    store: &S,
    _clock: &ManualClock,
) {
    let ten = Duration::from_secs(10);
    let a = store
        .retry_budget(&RetryBudgetRule::new("retry-a", 1.0, 0, ten).unwrap())
        .unwrap();
    let b = store
        .retry_budget(&RetryBudgetRule::new("retry-b", 1.0, 0, ten).unwrap())
        .unwrap();
    a.deposit(b"k1").await.unwrap();
    assert!(!a.withdraw(b"k2").await.unwrap(), "k2 spent k1's budget");
    assert!(!b.withdraw(b"k1").await.unwrap(), "rule b spent rule a's");
    let a2 = store
        .retry_budget(&RetryBudgetRule::new("retry-a", 1.0, 0, ten).unwrap())
        .unwrap();
    assert!(a2.withdraw(b"k1").await.unwrap(), "the rule bound twice");
    assert!(!a.withdraw(b"k1").await.unwrap());

    let hostile = store
        .retry_budget(&RetryBudgetRule::new("retry-hostile", 1.0, 0, ten).unwrap())
        .unwrap();
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
        hostile.deposit(key).await.unwrap();
    }
    // Each key's one retry, and no more: keys that shared a budget would
    // grant a second.
    for key in &keys {
        let n = key.len();
        assert!(
            hostile.withdraw(key).await.unwrap(),
            "key of {n} bytes lost its deposit"
        );
        assert!(
            !hostile.withdraw(key).await.unwrap(),
            "key of {n} bytes collided"
        );
    }
}

/// A deposit whose future is dropped unpolled still happens (a caller
/// need not wait for it).
pub async fn retry_budget_deposit_survives_its_future<S: RetryBudgetStore>(
    store: &S,
    _clock: &ManualClock,
) {
    let rule = RetryBudgetRule::new("dropped", 1.0, 0, Duration::from_secs(10)).unwrap();
    let limiter = store.retry_budget(&rule).unwrap();
    drop(limiter.deposit(b"k"));
    let mut deposited = false;
    for _ in 0..2_000 {
        // A refused withdrawal changes nothing.
        if limiter.withdraw(b"k").await.unwrap() {
            deposited = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(deposited, "a dropped deposit future cancelled the deposit");
    assert!(!limiter.withdraw(b"k").await.unwrap());
}
