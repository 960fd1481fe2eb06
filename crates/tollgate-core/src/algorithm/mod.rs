//! The algorithms: pure functions over a small state.
//!
//! Each algorithm is a validated parameter struct implementing
//! [`RateAlgorithm`]: `decide(&params, &mut state, now, cost) -> Decision`.
//! No I/O, no clock reads, no allocation (but for the sliding-window log's
//! entries). Stores own the state and call these functions; the Redis store
//! runs the same math in Lua, and the conformance suite checks that both
//! agree.
//!
//! Common rules, true of every algorithm:
//! - cost 0 is a peek: it is allowed and changes nothing;
//! - a cost above the capacity is [`Outcome::Never`](crate::Outcome::Never);
//! - a denial changes nothing;
//! - a clock that moves backwards never yields more than the state already
//!   held (it may yield less);
//! - arithmetic saturates or is done in `u128`; near the end of `u64` time
//!   an algorithm denies rather than wraps.

mod escalation;
mod fixed_window;
mod gcra;
mod in_flight;
mod leaky_bucket;
mod quota;
mod retry_budget;
mod semaphore;
mod sliding_window_buckets;
mod sliding_window_counter;
mod sliding_window_log;
mod token_bucket;

pub use escalation::{Escalation, EscalationState, Standing, Strike};
pub use fixed_window::FixedWindow;
pub use gcra::Gcra;
pub use in_flight::{update_word, InFlight, PinnedPermits};
pub use leaky_bucket::LeakyBucket;
pub use quota::{PeriodStatus, Quota, QuotaDecision, QuotaState, Window, MAX_PERIODS};
pub use retry_budget::{RetryBudget, RetryBudgetState, RetrySlot, RETRY_SLOTS, UNIT as RETRY_UNIT};
pub use semaphore::{Semaphore, SemaphoreState};
pub use sliding_window_buckets::{SlidingWindowBuckets, SlidingWindowBucketsState};
pub use sliding_window_counter::{SlidingWindowCounter, SlidingWindowCounterState};
pub use sliding_window_log::{SlidingWindowLog, SlidingWindowLogState};
pub use token_bucket::TokenBucket;

use crate::Decision;

/// A rate algorithm: validated parameters and the pure decision function.
pub trait RateAlgorithm: Clone + std::fmt::Debug + Send + Sync + 'static {
    /// Per-key state. `Default` is a fresh key with a whole budget.
    type State: Clone + Default + PartialEq + std::fmt::Debug + Send + Sync + 'static;

    /// Decides a request of `cost` at `now` and updates `state` if admitted.
    fn decide(&self, state: &mut Self::State, now: u64, cost: u64) -> Decision;

    /// Gives back `cost` consumed earlier (when a later rule in a chain
    /// denies the request). Never raises the budget above whole; a refund
    /// that arrives after its window has passed is dropped.
    fn refund(&self, state: &mut Self::State, now: u64, cost: u64);

    /// Whether `state` carries no information at `now`: it decides exactly
    /// as a fresh state would, now and later, so it may be dropped.
    fn is_idle(&self, state: &Self::State, now: u64) -> bool;

    /// The most that may be consumed at once.
    fn capacity(&self) -> u64;

    /// Nanoseconds over which `capacity` is granted (the policy window).
    fn window(&self) -> u64;
}

/// `a * b` in `u128`: cannot overflow for `u64` operands.
#[inline]
pub(crate) fn mul(a: u64, b: u64) -> u128 {
    u128::from(a).saturating_mul(u128::from(b))
}

/// `ceil(a / b)` for `b > 0`; zero when `b == 0` (callers never pass it).
#[inline]
pub(crate) fn div_ceil(a: u128, b: u128) -> u128 {
    match a.checked_div(b) {
        Some(q) if q.saturating_mul(b) == a => q,
        Some(q) => q.saturating_add(1),
        None => 0,
    }
}

/// Narrows to `u64`, saturating.
#[inline]
pub(crate) fn sat64(x: u128) -> u64 {
    u64::try_from(x).unwrap_or(u64::MAX)
}
