//! Shared pieces of the property tests: random parameters for every
//! algorithm, and random traces (clock moves and actions) that are resolved
//! against each algorithm's natural time unit so that they hit its edges.
#![allow(dead_code)] // each test binary uses a part of this module

use std::time::Duration;

use proptest::prelude::*;
use tollgate_core::{
    FixedWindow, Gcra, LeakyBucket, Rate, Semaphore, SlidingWindowBuckets, SlidingWindowCounter,
    SlidingWindowLog, TokenBucket,
};

/// One millisecond in nanoseconds.
pub(crate) const MS: u64 = 1_000_000;

/// How the clock moves before a step. Resolved against the algorithm's
/// natural unit (GCRA or leaky interval, refill interval, window, lease
/// TTL) so that boundaries are hit exactly, not by luck.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Jump {
    /// The clock stands still.
    Stay,
    /// A few nanoseconds (1 to 3).
    Nanos(u64),
    /// `f / 1000` of four units: anywhere in the next four units.
    Fraction(u32),
    /// `k` whole units, plus `delta` nanoseconds (-1, 0 or 1).
    Units(u32, i8),
    /// To the next multiple of the unit (counted from zero), plus `delta`.
    Boundary(i8),
    /// By the hint (the last denial's `retry_after`, or the last
    /// `reset_after`), plus `delta`: exactly where budgets come back.
    Hint(i8),
    /// A long idle period: a hundred units.
    Idle,
    /// Backwards by `f / 1000` of four units (saturating at zero).
    Back(u32),
    /// Backwards by `k` whole units plus `delta`.
    BackUnits(u32, i8),
}

impl Jump {
    /// The time after this jump from `now`.
    pub(crate) fn apply(self, now: u64, unit: u64, hint: u64) -> u64 {
        let unit = unit.max(1);
        let fraction = |f: u32| -> u64 {
            let v = u128::from(unit) * 4 * u128::from(f) / 1000;
            u64::try_from(v).unwrap_or(u64::MAX)
        };
        let plus = |t: u64, delta: i8| -> u64 {
            if delta >= 0 {
                t.saturating_add(delta.unsigned_abs().into())
            } else {
                t.saturating_sub(delta.unsigned_abs().into())
            }
        };
        match self {
            Self::Stay => now,
            Self::Nanos(n) => now.saturating_add(n),
            Self::Fraction(f) => now.saturating_add(fraction(f)),
            Self::Units(k, delta) => {
                let t = now.saturating_add(unit.saturating_mul(u64::from(k)));
                plus(t, delta).max(now)
            }
            Self::Boundary(delta) => {
                let next = (now / unit).saturating_add(1).saturating_mul(unit);
                plus(next, delta).max(now)
            }
            Self::Hint(delta) => plus(now.saturating_add(hint), delta).max(now),
            Self::Idle => now.saturating_add(unit.saturating_mul(100)),
            Self::Back(f) => now.saturating_sub(fraction(f)),
            Self::BackUnits(k, delta) => {
                plus(now.saturating_sub(unit.saturating_mul(u64::from(k))), delta).min(now)
            }
        }
    }
}

/// Clock moves that never go backwards.
pub(crate) fn forward_jump() -> impl Strategy<Value = Jump> {
    prop_oneof![
        3 => Just(Jump::Stay),
        2 => (1u64..=3).prop_map(Jump::Nanos),
        4 => (0u32..=4000).prop_map(Jump::Fraction),
        2 => (1u32..=3, -1i8..=1).prop_map(|(k, d)| Jump::Units(k, d)),
        2 => (-1i8..=1).prop_map(Jump::Boundary),
        3 => (-1i8..=1).prop_map(Jump::Hint),
        1 => Just(Jump::Idle),
    ]
}

/// Clock moves that also go backwards, now and then by a lot.
pub(crate) fn any_jump() -> impl Strategy<Value = Jump> {
    prop_oneof![
        6 => forward_jump(),
        2 => (0u32..=4000).prop_map(Jump::Back),
        1 => (1u32..=5, -1i8..=1).prop_map(|(k, d)| Jump::BackUnits(k, d)),
    ]
}

/// A cost, resolved against the capacity: `0..=capacity + 2`, with the
/// small costs and the edges (`capacity`, `capacity + 1`) well covered.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Cost {
    /// 0, 1 or 2.
    Small(u32),
    /// `capacity - k` (saturating), k in 0..=1.
    Full(u32),
    /// `capacity + k`, k in 1..=2: can never go.
    Over(u32),
    /// Uniform in `0..=capacity + 2`.
    Any(u32),
}

impl Cost {
    /// The cost for an algorithm of capacity `cap`.
    /// [`resolve`](Self::resolve) as semaphore permits (a `u32`; larger
    /// asks saturate, and are over any semaphore's capacity either way).
    pub(crate) fn permits(self, cap: u64) -> u32 {
        u32::try_from(self.resolve(cap)).unwrap_or(u32::MAX)
    }

    pub(crate) fn resolve(self, cap: u64) -> u64 {
        match self {
            Self::Small(c) => u64::from(c),
            Self::Full(k) => cap.saturating_sub(u64::from(k)),
            Self::Over(k) => cap.saturating_add(u64::from(k)),
            Self::Any(seed) => u64::from(seed) % cap.saturating_add(3),
        }
    }
}

/// Costs biased towards small values and the capacity's edges.
pub(crate) fn cost() -> impl Strategy<Value = Cost> {
    prop_oneof![
        4 => (0u32..=2).prop_map(Cost::Small),
        1 => (0u32..=1).prop_map(Cost::Full),
        1 => (1u32..=2).prop_map(Cost::Over),
        4 => any::<u32>().prop_map(Cost::Any),
    ]
}

/// One step of a rate-algorithm trace.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Action {
    /// Decide a request.
    Decide(Cost),
    /// Refund an earlier cost.
    Refund(Cost),
}

/// Actions: mostly decisions, some refunds.
pub(crate) fn action(refunds: bool) -> BoxedStrategy<Action> {
    if refunds {
        prop_oneof![
            9 => cost().prop_map(Action::Decide),
            1 => cost().prop_map(Action::Refund),
        ]
        .boxed()
    } else {
        cost().prop_map(Action::Decide).boxed()
    }
}

/// Where a trace starts: zero, near zero, or far from it.
pub(crate) fn start() -> impl Strategy<Value = u64> {
    prop_oneof![
        1 => Just(0u64),
        2 => 0u64..=10_000_000_000,
        2 => 1_000_000_000_000_000u64..=1_000_000_000_000_000_000,
    ]
}

/// A trace of up to `len` steps.
pub(crate) fn trace(
    jump: impl Strategy<Value = Jump>,
    refunds: bool,
    len: usize,
) -> impl Strategy<Value = Vec<(Jump, Action)>> {
    proptest::collection::vec((jump, action(refunds)), 1..=len)
}

/// Small, medium and large time scales in nanoseconds.
fn scale() -> impl Strategy<Value = u64> {
    prop_oneof![
        2 => 1u64..=10,
        3 => 10u64..=1_000,
        2 => 1_000_000u64..=1_000_000_000,
    ]
}

/// GCRA with small parameters, and its interval.
pub(crate) fn gcra() -> impl Strategy<Value = (Gcra, u64)> {
    (scale(), 1u32..=4, 1u32..=20).prop_map(|(period, amount, burst)| {
        let period = period.max(u64::from(amount));
        let g = Gcra::new(Rate::new(amount, Duration::from_nanos(period)), burst).unwrap();
        (g, g.interval())
    })
}

/// Parameters of a token bucket: capacity, refill, interval (ns).
pub(crate) fn token_bucket_params() -> impl Strategy<Value = (u32, u32, u64)> {
    (1u32..=20, 1u32..=25, scale())
        .prop_map(|(cap, refill, interval)| (cap, refill, interval.max(u64::from(refill))))
}

/// A token bucket with small parameters, and its refill interval.
pub(crate) fn token_bucket() -> impl Strategy<Value = (TokenBucket, u64)> {
    token_bucket_params().prop_map(|(cap, refill, interval)| {
        (
            TokenBucket::new(cap, refill, Duration::from_nanos(interval)).unwrap(),
            interval,
        )
    })
}

/// A fixed window with a small limit (windows of 1 ms and up), and its window.
pub(crate) fn fixed_window() -> impl Strategy<Value = (FixedWindow, u64)> {
    (
        1u32..=20,
        prop_oneof![Just(MS), MS..=5 * MS, Just(1_000 * MS)],
    )
        .prop_map(|(limit, window)| {
            (
                FixedWindow::new(limit, Duration::from_nanos(window)).unwrap(),
                window,
            )
        })
}

/// A sliding window counter with a small limit, and its window.
pub(crate) fn sliding_window_counter() -> impl Strategy<Value = (SlidingWindowCounter, u64)> {
    (1u32..=20, scale()).prop_map(|(limit, window)| {
        (
            SlidingWindowCounter::new(limit, Duration::from_nanos(window)).unwrap(),
            window,
        )
    })
}

/// A sliding window of 1 to 6 buckets of 1 to 5 ms or a second, with a
/// small limit, and its bucket's length.
pub(crate) fn sliding_window_buckets() -> impl Strategy<Value = (SlidingWindowBuckets, u64)> {
    (
        1u32..=20,
        1u32..=6,
        prop_oneof![Just(MS), MS..=5 * MS, Just(1_000 * MS)],
    )
        .prop_map(|(limit, buckets, bucket)| {
            let window = Duration::from_nanos(bucket * u64::from(buckets));
            let alg = SlidingWindowBuckets::new(limit, window, buckets).unwrap();
            (alg, bucket)
        })
}

/// A sliding window log with a small limit, and its window.
pub(crate) fn sliding_window_log() -> impl Strategy<Value = (SlidingWindowLog, u64)> {
    (1u32..=20, scale()).prop_map(|(limit, window)| {
        (
            SlidingWindowLog::new(limit, Duration::from_nanos(window)).unwrap(),
            window,
        )
    })
}

/// A leaky bucket with small parameters, its interval and its max delay.
pub(crate) fn leaky_bucket() -> impl Strategy<Value = (LeakyBucket, u64, u64)> {
    (scale(), 1u32..=4, 0u64..=12, 0u32..=1000).prop_map(|(period, amount, k, frac)| {
        let period = period.max(u64::from(amount));
        let rate = Rate::new(amount, Duration::from_nanos(period));
        let interval = period / u64::from(amount);
        // Often an exact multiple of the interval, sometimes between two.
        let extra = if frac < 500 {
            0
        } else {
            interval * u64::from(frac) / 1001
        };
        let max_delay = interval * k + extra;
        let b = LeakyBucket::new(rate, Duration::from_nanos(max_delay)).unwrap();
        assert_eq!(b.interval(), interval);
        (b, interval, max_delay)
    })
}

/// A semaphore with a small maximum and a TTL of a few milliseconds.
pub(crate) fn semaphore() -> impl Strategy<Value = (Semaphore, u64)> {
    (1u32..=10, MS..=5 * MS)
        .prop_map(|(max, ttl)| (Semaphore::new(max, Duration::from_nanos(ttl)).unwrap(), ttl))
}

/// A step of a semaphore trace.
#[derive(Debug, Clone, Copy)]
pub(crate) enum SemOp {
    /// Acquire permits under a fresh lease id, held to a ceiling (see
    /// [`ceiling`]).
    Acquire(Cost, u8),
    /// Release the lease picked by the seed among those handed out (or
    /// one never handed out).
    Release(u32),
    /// Renew the lease picked by the seed.
    Renew(u32),
}

/// Semaphore steps: mostly acquires, some releases and renewals.
pub(crate) fn sem_op() -> impl Strategy<Value = SemOp> {
    prop_oneof![
        5 => (cost(), any::<u8>()).prop_map(|(c, share)| SemOp::Acquire(c, share)),
        2 => any::<u32>().prop_map(SemOp::Release),
        2 => any::<u32>().prop_map(SemOp::Renew),
    ]
}

/// The ceiling of an acquire: the whole `max` (as `u32::MAX`) half the
/// time, else a share of it (`share`/128, possibly 0).
pub(crate) fn ceiling(max: u64, share: u8) -> u32 {
    if share >= 128 {
        u32::MAX
    } else {
        u32::try_from(max * u64::from(share) / 128).unwrap()
    }
}

/// Picks a lease id from the `issued` ones by `seed`; one time in a few an
/// id that was never issued.
pub(crate) fn pick_id(issued: &[u64], seed: u32) -> u64 {
    let n = u32::try_from(issued.len()).unwrap();
    if n == 0 || seed.is_multiple_of(5) {
        u64::MAX - u64::from(seed % 3)
    } else {
        issued[usize::try_from(seed / 5 % n).unwrap()]
    }
}
