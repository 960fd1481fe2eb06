//! Properties every algorithm must have, checked on random traces:
//!
//! - (a) `retry_after` is exact: one nanosecond earlier the same request is
//!   still denied, at `retry_after` it goes (for the semaphore, an upper
//!   bound: at `retry_after` it goes if nothing is released meanwhile);
//! - (b) cost 0 is allowed and changes nothing;
//! - (c) a denial changes nothing;
//! - (d) `Never` if and only if the cost exceeds the capacity;
//! - (e) a clock that moves backwards never yields more than at the latest
//!   time seen, and a decision made at such an earlier time never gives
//!   back budget at the latest time;
//! - (f) over a trace, the units admitted in any interval stay within what
//!   the algorithm promises (and the leaky bucket spaces departures);
//! - (g) no panic, and sane numbers, for any parameters, costs and times,
//!   including `u64::MAX` and `u32::MAX`;
//! - an idle state decides exactly as a fresh one.
//!
//! Only the clock of the trace is used; nothing reads real time.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects,
    missing_docs
)]

mod support;

use std::time::Duration;

use proptest::prelude::*;
use support::{Action, Jump, SemOp};
use tollgate_core::{
    Decision, FixedWindow, Gcra, LeakyBucket, Outcome, Rate, RateAlgorithm, Semaphore,
    SemaphoreState, SlidingWindowBuckets, SlidingWindowCounter, SlidingWindowLog,
    SlidingWindowLogState, TokenBucket,
};

const CASES: u32 = 256;
const STEPS: usize = 200;

/// How many steps after an idle state are replayed on a fresh state.
const IDLE_SUFFIX: usize = 12;

trait Subject: RateAlgorithm {
    /// Whether `after` decides exactly as `before` at `now` and later. The
    /// default is equality; an algorithm that keeps a log may drop what has
    /// expired by `now`.
    fn unchanged(&self, before: &Self::State, after: &Self::State, _now: u64) -> bool {
        before == after
    }
}

impl Subject for Gcra {}
impl Subject for TokenBucket {}
impl Subject for FixedWindow {}
impl Subject for SlidingWindowCounter {}
impl Subject for SlidingWindowBuckets {}
impl Subject for LeakyBucket {}

impl Subject for SlidingWindowLog {
    fn unchanged(
        &self,
        before: &SlidingWindowLogState,
        after: &SlidingWindowLogState,
        now: u64,
    ) -> bool {
        // `after` is `before` less a prefix of entries that have left the
        // window at `now`.
        let b: Vec<_> = before.entries().collect();
        let a: Vec<_> = after.entries().collect();
        let Some(dropped) = b.len().checked_sub(a.len()) else {
            return false;
        };
        b[dropped..] == a[..]
            && b[..dropped]
                .iter()
                .all(|(at, _)| at.saturating_add(self.window()) <= now)
    }
}

fn peek<A: RateAlgorithm>(alg: &A, state: &A::State, now: u64) -> Decision {
    let mut s = state.clone();
    alg.decide(&mut s, now, 0)
}

/// The most units a trace may admit with timestamps in `[a, b]`.
type Bound<'a> = &'a dyn Fn(u64, u64) -> u64;

/// One admitted request: when, how much, and its pacing delay.
#[derive(Debug, Clone, Copy)]
struct Admit {
    at: u64,
    cost: u64,
    delay: u64,
}

/// Checks that no interval between two admissions holds more than `bound`.
fn check_bound(admitted: &[Admit], bound: Bound<'_>) -> Result<(), TestCaseError> {
    let mut sorted: Vec<_> = admitted.iter().map(|a| (a.at, a.cost)).collect();
    sorted.sort_unstable();
    for i in 0..sorted.len() {
        let mut sum = 0;
        for j in i..sorted.len() {
            sum += sorted[j].1;
            // All admissions at the same instant as `j` belong in too.
            if sorted.get(j + 1).is_some_and(|n| n.0 == sorted[j].0) {
                continue;
            }
            let (a, b) = (sorted[i].0, sorted[j].0);
            prop_assert!(
                sum <= bound(a, b),
                "{} units admitted in [{}, {}] (length {}), bound {}",
                sum,
                a,
                b,
                b - a,
                bound(a, b)
            );
        }
    }
    Ok(())
}

/// Runs a trace, checking (a)–(e) at every step, and returns what was
/// admitted. `forward` says the trace never moves the clock back.
fn run_trace<A: Subject>(
    alg: &A,
    unit: u64,
    start: u64,
    steps: &[(Jump, Action)],
    forward: bool,
) -> Result<Vec<Admit>, TestCaseError> {
    let cap = alg.capacity();
    let mut state = A::State::default();
    let mut now = start;
    let mut latest = start;
    let mut hint = 0;
    let mut admitted = Vec::new();
    for (i, &(jump, action)) in steps.iter().enumerate() {
        now = jump.apply(now, unit, hint);
        latest = latest.max(now);
        let ctx = format!("step {i} at {now} (latest {latest}, start {start})");
        if forward {
            prop_assert_eq!(now, latest);
        }
        // (e) from the same state, the earlier time sees no more.
        if now < latest {
            let back = peek(alg, &state, now).remaining;
            let ahead = peek(alg, &state, latest).remaining;
            prop_assert!(
                back <= ahead,
                "{}: {} remaining back, {} at latest",
                ctx,
                back,
                ahead
            );
        }
        match action {
            Action::Refund(c) => {
                alg.refund(&mut state, now, c.resolve(cap));
                let d = peek(alg, &state, now);
                prop_assert!(d.remaining <= cap, "{}: refund overfilled: {:?}", ctx, d);
            }
            Action::Decide(c) => {
                let cost = c.resolve(cap);
                let before = state.clone();
                let d = alg.decide(&mut state, now, cost);
                let ctx = format!("{ctx}: cost {cost} -> {d:?}");
                prop_assert_eq!(d.limit, cap, "{}", ctx);
                prop_assert!(d.remaining <= cap, "{}", ctx);
                // (d)
                prop_assert_eq!(d.outcome == Outcome::Never, cost > cap, "{}", ctx);
                // (b)
                if cost == 0 {
                    prop_assert!(d.is_allowed(), "{}", ctx);
                    prop_assert!(
                        alg.unchanged(&before, &state, now),
                        "{}: peek changed state",
                        ctx
                    );
                }
                // (c)
                if !d.is_allowed() {
                    prop_assert!(
                        alg.unchanged(&before, &state, now),
                        "{}: denial changed state from {:?} to {:?}",
                        ctx,
                        before,
                        state
                    );
                }
                if let Outcome::Deny { retry_after } = d.outcome {
                    prop_assert!(retry_after >= 1, "{}", ctx);
                    // (a)
                    if forward {
                        if let Some(at) = now.checked_add(retry_after) {
                            let mut early = state.clone();
                            let e = alg.decide(&mut early, at - 1, cost);
                            prop_assert!(!e.is_allowed(), "{}: allowed 1 ns early: {:?}", ctx, e);
                            let mut on_time = state.clone();
                            let o = alg.decide(&mut on_time, at, cost);
                            prop_assert!(o.is_allowed(), "{}: denied at retry time: {:?}", ctx, o);
                        }
                    }
                }
                // (e) a decision back in time gives nothing back at the latest time.
                if now < latest && cost > 0 {
                    for u in [
                        latest,
                        latest.saturating_add(unit / 2),
                        latest.saturating_add(unit),
                    ] {
                        let was = peek(alg, &before, u).remaining;
                        let is = peek(alg, &state, u).remaining;
                        prop_assert!(
                            is <= was,
                            "{}: at {} remaining went from {} to {} ({:?} -> {:?})",
                            ctx,
                            u,
                            was,
                            is,
                            before,
                            state
                        );
                    }
                }
                if let Outcome::Allow { delay } = d.outcome {
                    if cost > 0 {
                        admitted.push(Admit {
                            at: now,
                            cost,
                            delay,
                        });
                    }
                }
                hint = match d.outcome {
                    Outcome::Deny { retry_after } => retry_after,
                    _ => d.reset_after,
                };
            }
        }
    }
    Ok(admitted)
}

/// An idle state decides as a fresh one: at every step where the state is
/// idle, the next steps are replayed on a clone and on a fresh state.
fn idle_is_fresh<A: RateAlgorithm>(
    alg: &A,
    unit: u64,
    start: u64,
    steps: &[(Jump, Action)],
) -> Result<(), TestCaseError> {
    let cap = alg.capacity();
    let mut state = A::State::default();
    let mut now = start;
    let mut hint = 0;
    let mut idle_checks = 0;
    for (i, &(jump, action)) in steps.iter().enumerate() {
        now = jump.apply(now, unit, hint);
        if alg.is_idle(&state, now) && idle_checks < 20 {
            idle_checks += 1;
            let mut old = state.clone();
            let mut fresh = A::State::default();
            let mut t = now;
            let mut h = hint;
            for (k, &(j, a)) in steps[i..].iter().take(IDLE_SUFFIX).enumerate() {
                if k > 0 {
                    t = j.apply(t, unit, h);
                }
                match a {
                    Action::Refund(c) => {
                        alg.refund(&mut old, t, c.resolve(cap));
                        alg.refund(&mut fresh, t, c.resolve(cap));
                    }
                    Action::Decide(c) => {
                        let cost = c.resolve(cap);
                        let x = alg.decide(&mut old, t, cost);
                        let y = alg.decide(&mut fresh, t, cost);
                        prop_assert_eq!(
                            x,
                            y,
                            "idle at step {} ({}; state {:?}), differs {} steps later at {}",
                            i,
                            now,
                            state,
                            k,
                            t
                        );
                        h = match x.outcome {
                            Outcome::Deny { retry_after } => retry_after,
                            _ => x.reset_after,
                        };
                    }
                }
            }
        }
        match action {
            Action::Refund(c) => alg.refund(&mut state, now, c.resolve(cap)),
            Action::Decide(c) => {
                let d = alg.decide(&mut state, now, c.resolve(cap));
                hint = match d.outcome {
                    Outcome::Deny { retry_after } => retry_after,
                    _ => d.reset_after,
                };
            }
        }
    }
    Ok(())
}

/// (g): any parameters, times and costs. No panic, `Never` iff over
/// capacity, `remaining` within the limit, peeks and denials change nothing.
fn wide_trace<A: Subject>(alg: &A, steps: &[(WideTime, u64, bool)]) -> Result<(), TestCaseError> {
    let cap = alg.capacity();
    let _ = alg.window();
    let unit = alg.window().max(1);
    let mut state = A::State::default();
    let mut now = 0u64;
    for &(time, cost, refund) in steps {
        now = time.apply(now, unit);
        let _ = alg.is_idle(&state, now);
        if refund {
            alg.refund(&mut state, now, cost);
            continue;
        }
        let before = state.clone();
        let d = alg.decide(&mut state, now, cost);
        prop_assert_eq!(d.limit, cap);
        prop_assert!(d.remaining <= cap, "at {} cost {}: {:?}", now, cost, d);
        prop_assert_eq!(
            d.outcome == Outcome::Never,
            cost > cap,
            "at {} cost {}: {:?}",
            now,
            cost,
            d
        );
        if cost == 0 {
            prop_assert!(d.is_allowed());
        }
        if cost == 0 || !d.is_allowed() {
            prop_assert!(
                alg.unchanged(&before, &state, now),
                "at {} cost {}: {:?}",
                now,
                cost,
                d
            );
        }
        if let Outcome::Deny { retry_after } = d.outcome {
            prop_assert!(retry_after >= 1);
        }
    }
    Ok(())
}

/// A time for the wide traces.
#[derive(Debug, Clone, Copy)]
enum WideTime {
    /// Anywhere.
    Abs(u64),
    /// Within a million nanoseconds of the end of time.
    NearEnd(u64),
    /// A trace move from the previous time.
    Move(Jump),
}

impl WideTime {
    fn apply(self, now: u64, unit: u64) -> u64 {
        match self {
            Self::Abs(t) => t,
            Self::NearEnd(k) => u64::MAX - k,
            Self::Move(j) => j.apply(now, unit, 1),
        }
    }
}

fn wide_steps() -> impl Strategy<Value = Vec<(WideTime, u64, bool)>> {
    let time = prop_oneof![
        2 => any::<u64>().prop_map(WideTime::Abs),
        2 => (0u64..=1_000_000).prop_map(WideTime::NearEnd),
        1 => Just(WideTime::NearEnd(0)),
        3 => support::any_jump().prop_map(WideTime::Move),
    ];
    let cost = prop_oneof![
        3 => 0u64..=3,
        2 => any::<u32>().prop_map(u64::from),
        1 => any::<u64>(),
        1 => Just(u64::from(u32::MAX)),
        1 => Just(u64::from(u32::MAX) + 1),
        1 => Just(u64::MAX),
    ];
    proptest::collection::vec((time, cost, proptest::bool::weighted(0.1)), 1..=60)
}

fn wide_nanos() -> impl Strategy<Value = u64> {
    prop_oneof![
        any::<u64>(),
        Just(u64::MAX),
        Just(1u64),
        1u64..=1_000,
        1_000_000u64..=1_000_000_000_000,
        (0u64..=1_000).prop_map(|k| u64::MAX - k),
    ]
}

fn wide_u32() -> impl Strategy<Value = u32> {
    prop_oneof![any::<u32>(), Just(u32::MAX), Just(1u32), 0u32..=100]
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: CASES,
        ..ProptestConfig::default()
    }
}

/// Forward, backward and idle traces for one rate algorithm.
macro_rules! rate_properties {
    ($name:ident, $params:expr, |$p:pat_param| ($alg:expr, $unit:expr), $bound:expr) => {
        mod $name {
            use super::*;

            proptest! {
                #![proptest_config(config())]

                /// (a)–(d) and (f) with the clock only moving forward.
                #[test]
                fn forward_traces(
                    $p in $params,
                    start in support::start(),
                    refunds in any::<bool>(),
                    steps in support::trace(support::forward_jump(), true, STEPS),
                ) {
                    let alg = $alg;
                    let steps: Vec<_> = steps
                        .into_iter()
                        .map(|(j, a)| match a {
                            Action::Refund(c) if !refunds => (j, Action::Decide(c)),
                            a => (j, a),
                        })
                        .collect();
                    let admitted = run_trace(&alg, $unit, start, &steps, true)?;
                    if !refunds {
                        let bound: Bound<'_> = &$bound;
                        check_bound(&admitted, bound)?;
                    }
                }

                /// (b)–(e) with the clock jumping back and forth.
                #[test]
                fn backward_traces(
                    $p in $params,
                    start in support::start(),
                    steps in support::trace(support::any_jump(), true, STEPS),
                ) {
                    let alg = $alg;
                    run_trace(&alg, $unit, start, &steps, false)?;
                }

                #[test]
                fn idle_state_decides_as_fresh(
                    $p in $params,
                    start in support::start(),
                    steps in support::trace(support::forward_jump(), true, STEPS / 2),
                ) {
                    let alg = $alg;
                    idle_is_fresh(&alg, $unit, start, &steps)?;
                }
            }
        }
    };
}

rate_properties!(
    gcra,
    support::gcra(),
    |(alg, interval)| (alg, interval),
    |a: u64, b: u64| alg.capacity() + (b - a) / alg.interval()
);

rate_properties!(
    token_bucket,
    support::token_bucket_params(),
    |(cap, refill, interval)| (
        TokenBucket::new(cap, refill, Duration::from_nanos(interval)).unwrap(),
        interval
    ),
    |a: u64, b: u64| u64::from(cap) + u64::from(refill) * (b / interval - a / interval)
);

rate_properties!(
    fixed_window,
    support::fixed_window(),
    |(alg, window)| (alg, window),
    |a: u64, b: u64| if a / window == b / window {
        alg.capacity()
    } else {
        u64::MAX
    }
);

rate_properties!(
    sliding_window_counter,
    support::sliding_window_counter(),
    |(alg, window)| (alg, window),
    // The current window's count alone never exceeds the limit.
    |a: u64, b: u64| if a / window == b / window {
        alg.capacity()
    } else {
        u64::MAX
    }
);

rate_properties!(
    sliding_window_log,
    support::sliding_window_log(),
    |(alg, window)| (alg, window),
    // [a, b] with b − a < W lies inside the window (b − W, b].
    |a: u64, b: u64| if b - a < window {
        alg.capacity()
    } else {
        u64::MAX
    }
);

rate_properties!(
    sliding_window_buckets,
    support::sliding_window_buckets(),
    |(alg, bucket)| (alg, bucket),
    // The buckets counted at b reach back to the start of the bucket
    // buckets − 1 before b's: an interval that starts there holds no more
    // than the limit.
    |a: u64, b: u64| if b / bucket - a / bucket < u64::from(alg.buckets()) {
        alg.capacity()
    } else {
        u64::MAX
    }
);

rate_properties!(
    leaky_bucket,
    support::leaky_bucket(),
    |(alg, interval, _max_delay)| (alg, interval),
    // A unit goes every interval, after a queue of at most max_delay.
    |a: u64, b: u64| (_max_delay + (b - a)) / interval + 1
);

proptest! {
    #![proptest_config(config())]

    /// GCRA and the token bucket keep their rate even when the clock jumps
    /// back and forth: counting by the timestamps they were given.
    #[test]
    fn gcra_rate_holds_on_any_clock(
        (alg, interval) in support::gcra(),
        start in support::start(),
        steps in support::trace(support::any_jump(), false, STEPS),
    ) {
        let admitted = run_trace(&alg, interval, start, &steps, false)?;
        check_bound(&admitted, &|a, b| alg.capacity() + (b - a) / interval)?;
    }

    #[test]
    fn token_bucket_rate_holds_on_any_clock(
        (cap, refill, interval) in support::token_bucket_params(),
        start in support::start(),
        steps in support::trace(support::any_jump(), false, STEPS),
    ) {
        let alg = TokenBucket::new(cap, refill, Duration::from_nanos(interval)).unwrap();
        let admitted = run_trace(&alg, interval, start, &steps, false)?;
        check_bound(&admitted, &|a, b| {
            u64::from(cap) + u64::from(refill) * (b / interval - a / interval)
        })?;
    }

    /// The leaky bucket is a pacer: the last unit of each admitted request
    /// leaves at `now + delay`, at most `max_delay` from now, and a request
    /// of n units leaves at least n intervals after the one before it.
    #[test]
    fn leaky_bucket_spaces_departures(
        (alg, interval, max_delay) in support::leaky_bucket(),
        start in support::start(),
        steps in support::trace(support::forward_jump(), false, STEPS),
    ) {
        let admitted = run_trace(&alg, interval, start, &steps, true)?;
        let mut last: Option<u64> = None;
        for a in &admitted {
            prop_assert!(a.delay <= max_delay, "{:?}", a);
            let departs = a.at + a.delay;
            if let Some(prev) = last {
                prop_assert!(departs >= prev + a.cost * interval, "{:?} after {}", a, prev);
            }
            last = Some(departs);
        }
    }

    // (g) for every algorithm.

    #[test]
    fn gcra_wide(amount in wide_u32(), period in wide_nanos(), burst in wide_u32(), steps in wide_steps()) {
        match Gcra::new(Rate::new(amount, Duration::from_nanos(period)), burst) {
            Ok(alg) => wide_trace(&alg, &steps)?,
            Err(e) => prop_assert!(["rate", "burst"].contains(&e.field())),
        }
    }

    #[test]
    fn token_bucket_wide(cap in wide_u32(), refill in wide_u32(), interval in wide_nanos(), steps in wide_steps()) {
        match TokenBucket::new(cap, refill, Duration::from_nanos(interval)) {
            Ok(alg) => wide_trace(&alg, &steps)?,
            Err(e) => prop_assert!(["capacity", "refill", "interval"].contains(&e.field())),
        }
    }

    #[test]
    fn fixed_window_wide(limit in wide_u32(), window in wide_nanos(), steps in wide_steps()) {
        match FixedWindow::new(limit, Duration::from_nanos(window)) {
            Ok(alg) => wide_trace(&alg, &steps)?,
            Err(e) => prop_assert!(["limit", "window"].contains(&e.field())),
        }
    }

    #[test]
    fn sliding_window_counter_wide(limit in wide_u32(), window in wide_nanos(), steps in wide_steps()) {
        match SlidingWindowCounter::new(limit, Duration::from_nanos(window)) {
            Ok(alg) => wide_trace(&alg, &steps)?,
            Err(e) => prop_assert!(["limit", "window"].contains(&e.field())),
        }
    }

    #[test]
    fn sliding_window_buckets_wide(limit in wide_u32(), window in wide_nanos(), buckets in 0u32..=101, steps in wide_steps()) {
        match SlidingWindowBuckets::new(limit, Duration::from_nanos(window), buckets) {
            Ok(alg) => wide_trace(&alg, &steps)?,
            Err(e) => prop_assert!(["limit", "window", "buckets"].contains(&e.field())),
        }
    }

    /// The error of a sliding window of buckets against the sliding log,
    /// on the history the buckets admitted: never stricter than the log
    /// (what they refuse, the log refuses too), and at each admission the
    /// log's window `(t − W, t]` holds at most the limit plus what the one
    /// bucket leaving the window (the bucket of `t − W`) admitted.
    #[test]
    fn sliding_window_buckets_against_the_log(
        (alg, bucket) in support::sliding_window_buckets(),
        start in support::start(),
        steps in prop::collection::vec((0u64..=3_000, 1u64..=3), 1..STEPS),
    ) {
        let window = alg.window();
        let limit = alg.capacity();
        let mut state = Default::default();
        let mut admitted: Vec<(u64, u64)> = Vec::new();
        let mut now = start;
        // What the history admitted in (from, to].
        let held = |admitted: &[(u64, u64)], from: u64, to: u64| -> u64 {
            admitted.iter().filter(|(at, _)| *at > from && *at <= to).map(|(_, c)| c).sum()
        };
        for (gap, cost) in steps {
            // Gaps of up to three buckets, in thousandths of a bucket.
            now += bucket * gap / 1_000;
            let log = held(&admitted, now.saturating_sub(window), now);
            let d = alg.decide(&mut state, now, cost);
            if d.is_allowed() {
                admitted.push((now, cost));
                let log = log + cost;
                let leaving = now.saturating_sub(window) / bucket;
                let one_bucket: u64 = admitted
                    .iter()
                    .filter(|(at, _)| at / bucket == leaving)
                    .map(|(_, c)| c)
                    .sum();
                prop_assert!(
                    log <= limit + one_bucket,
                    "at {}: {} in the log's window, limit {} + {} in the leaving bucket",
                    now, log, limit, one_bucket
                );
            } else {
                prop_assert!(
                    log + cost > limit,
                    "at {}: refused {} with {} in the log's window (limit {})",
                    now, cost, log, limit
                );
            }
        }
    }

    #[test]
    fn sliding_window_log_wide(limit in 0u32..=SlidingWindowLog::MAX_LIMIT + 1, window in wide_nanos(), steps in wide_steps()) {
        match SlidingWindowLog::new(limit, Duration::from_nanos(window)) {
            Ok(alg) => wide_trace(&alg, &steps)?,
            Err(e) => prop_assert!(["limit", "window"].contains(&e.field())),
        }
    }

    #[test]
    fn leaky_bucket_wide(amount in wide_u32(), period in wide_nanos(), max_delay in wide_nanos(), steps in wide_steps()) {
        match LeakyBucket::new(Rate::new(amount, Duration::from_nanos(period)), Duration::from_nanos(max_delay)) {
            Ok(alg) => wide_trace(&alg, &steps)?,
            Err(e) => prop_assert_eq!(e.field(), "rate"),
        }
    }
}

// ---------------------------------------------------------------------------
// The semaphore.

/// An id no trace hands out.
const STRANGER: u64 = u64::MAX / 2;

/// `state` with the leases lapsed at `now` dropped, and nothing else
/// changed (releasing an unknown id only prunes).
fn pruned(sem: &Semaphore, state: &SemaphoreState, now: u64) -> SemaphoreState {
    let mut s = state.clone();
    assert!(!sem.release(&mut s, now, STRANGER));
    s
}

fn sem_peek(sem: &Semaphore, state: &SemaphoreState, now: u64) -> Decision {
    let mut s = state.clone();
    sem.acquire(&mut s, now, 0, u32::MAX, STRANGER).decision
}

fn sem_trace(
    sem: &Semaphore,
    ttl: u64,
    start: u64,
    steps: &[(Jump, SemOp)],
) -> Result<(), TestCaseError> {
    let max = u64::from(sem.max());
    let mut state = SemaphoreState::default();
    let mut now = start;
    let mut latest = start;
    let mut hint = 0;
    let mut issued = Vec::new();
    let mut next_id = 0;
    for (i, &(jump, op)) in steps.iter().enumerate() {
        now = jump.apply(now, ttl, hint);
        latest = latest.max(now);
        let ctx = format!("step {i} at {now} (latest {latest})");
        if now < latest {
            let back = sem_peek(sem, &state, now).remaining;
            let ahead = sem_peek(sem, &state, latest).remaining;
            prop_assert!(
                back <= ahead,
                "{}: {} free back, {} at latest",
                ctx,
                back,
                ahead
            );
        }
        let before = state.clone();
        match op {
            SemOp::Acquire(c, share) => {
                let permits = c.permits(max);
                let ceiling = support::ceiling(max, share);
                let cap = u64::from(ceiling).min(max);
                let id = next_id;
                next_id += 1;
                let a = sem.acquire(&mut state, now, permits, ceiling, id);
                let d = a.decision;
                let ctx = format!("{ctx}: acquire {permits} under {ceiling} -> {d:?}");
                prop_assert_eq!(d.limit, max);
                prop_assert!(d.remaining <= cap, "{}", ctx);
                prop_assert_eq!(
                    d.outcome == Outcome::Never,
                    u64::from(permits) > cap,
                    "{}",
                    ctx
                );
                if d.is_allowed() && permits > 0 {
                    prop_assert!(state.held(now) <= cap, "{}", ctx);
                }
                prop_assert_eq!(a.lease.is_some(), d.is_allowed() && permits > 0, "{}", ctx);
                if permits == 0 || !d.is_allowed() {
                    prop_assert_eq!(&state, &pruned(sem, &before, now), "{}", ctx);
                }
                if let Some(lease) = a.lease {
                    issued.push(lease.id);
                }
                if let Outcome::Deny { retry_after } = d.outcome {
                    // The rule's hint: when a permit frees is up to others.
                    prop_assert_eq!(retry_after, sem.retry_after(), "{}", ctx);
                    // Denied only when the permits do not fit under the
                    // ceiling beside what is held.
                    prop_assert!(state.held(now) + u64::from(permits) > cap, "{}", ctx);
                }
                hint = match d.outcome {
                    Outcome::Deny { retry_after } => retry_after,
                    _ => d.reset_after,
                };
            }
            SemOp::Release(seed) => {
                let id = support::pick_id(&issued, seed);
                let released = sem.release(&mut state, now, id);
                if !released {
                    prop_assert_eq!(
                        &state,
                        &pruned(sem, &before, now),
                        "{}: release {}",
                        ctx,
                        id
                    );
                }
            }
            SemOp::Renew(seed) => {
                let id = support::pick_id(&issued, seed);
                if !sem.renew(&mut state, now, id) {
                    prop_assert_eq!(&state, &pruned(sem, &before, now), "{}: renew {}", ctx, id);
                }
            }
        }
        prop_assert!(state.held(now) <= max, "{}", ctx);
        // (e) an acquire or renewal back in time gives nothing back at the
        // latest time or after it.
        if now < latest && !matches!(op, SemOp::Release(_)) {
            for k in 0..=4 {
                let u = latest.saturating_add(ttl / 4 * k);
                let was = sem_peek(sem, &before, u).remaining;
                let is = sem_peek(sem, &state, u).remaining;
                prop_assert!(
                    is <= was,
                    "{}: {:?}: at {} free went from {} to {}",
                    ctx,
                    op,
                    u,
                    was,
                    is
                );
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn semaphore_forward_traces(
        (sem, ttl) in support::semaphore(),
        start in support::start(),
        steps in proptest::collection::vec((support::forward_jump(), support::sem_op()), 1..=STEPS),
    ) {
        sem_trace(&sem, ttl, start, &steps)?;
    }

    #[test]
    fn semaphore_backward_traces(
        (sem, ttl) in support::semaphore(),
        start in support::start(),
        steps in proptest::collection::vec((support::any_jump(), support::sem_op()), 1..=STEPS),
    ) {
        sem_trace(&sem, ttl, start, &steps)?;
    }

    #[test]
    fn semaphore_idle_state_acquires_as_fresh(
        (sem, ttl) in support::semaphore(),
        start in support::start(),
        steps in proptest::collection::vec((support::forward_jump(), support::sem_op()), 1..=STEPS / 2),
        probe in proptest::collection::vec((support::forward_jump(), support::cost()), 1..=IDLE_SUFFIX),
    ) {
        let max = u64::from(sem.max());
        let mut state = SemaphoreState::default();
        let mut now = start;
        let mut issued = Vec::new();
        for (i, &(jump, op)) in steps.iter().enumerate() {
            now = jump.apply(now, ttl, ttl);
            match op {
                SemOp::Acquire(c, share) => {
                    if let Some(l) = sem.acquire(&mut state, now, c.permits(max), support::ceiling(max, share), i as u64).lease {
                        issued.push(l.id);
                    }
                }
                SemOp::Release(seed) => { sem.release(&mut state, now, support::pick_id(&issued, seed)); }
                SemOp::Renew(seed) => { sem.renew(&mut state, now, support::pick_id(&issued, seed)); }
            }
        }
        if sem.is_idle(&state, now) {
            let mut fresh = SemaphoreState::default();
            let mut t = now;
            for (k, &(jump, c)) in probe.iter().enumerate() {
                t = jump.apply(t, ttl, ttl);
                let id = 1_000_000 + k as u64;
                let p = c.permits(max);
                prop_assert_eq!(sem.acquire(&mut state, t, p, u32::MAX, id), sem.acquire(&mut fresh, t, p, u32::MAX, id));
                for &old in &issued {
                    prop_assert!(!sem.renew(&mut state, t, old));
                }
            }
        }
    }

    #[test]
    fn semaphore_wide(
        max in prop_oneof![1u32..=10, Just(Semaphore::MAX_PERMITS), 0u32..=Semaphore::MAX_PERMITS + 1],
        ttl in wide_nanos(),
        steps in proptest::collection::vec((wide_nanos(), wide_u32(), 0u8..3), 1..=60),
    ) {
        let sem = match Semaphore::new(max, Duration::from_nanos(ttl)) {
            Ok(sem) => sem,
            Err(e) => {
                prop_assert!(["max", "lease_ttl"].contains(&e.field()));
                return Ok(());
            }
        };
        let limit = u64::from(sem.max());
        let mut state = SemaphoreState::default();
        for (i, &(now, permits, op)) in steps.iter().enumerate() {
            let _ = sem.is_idle(&state, now);
            match op {
                0 => {
                    let a = sem.acquire(&mut state, now, permits, u32::MAX, i as u64);
                    prop_assert!(a.decision.remaining <= limit);
                    prop_assert_eq!(a.decision.outcome == Outcome::Never, u64::from(permits) > limit);
                }
                1 => { sem.release(&mut state, now, u64::from(permits) % 64); }
                _ => { sem.renew(&mut state, now, u64::from(permits) % 64); }
            }
            prop_assert!(state.held(now) <= limit);
        }
    }
}
