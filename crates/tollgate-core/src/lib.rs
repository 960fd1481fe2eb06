//! The decision engine of [tollgate]: rate-limiting algorithms as pure
//! functions, the [`Decision`] they return, the [`Clock`] they are given,
//! validated rule configuration, and the [`Store`] contract that the
//! in-memory and Redis stores implement.
//!
//! This crate does no I/O and knows nothing of tokio, HTTP or Redis. Every
//! algorithm is `(params, &mut state, now, cost) -> Decision`:
//!
//! | algorithm | state | use it for |
//! |---|---|---|
//! | [`Gcra`] | one `u64` | smooth rate with bursts (the default) |
//! | [`TokenBucket`] | one `u64` | Envoy-style discrete refills |
//! | [`FixedWindow`] | one `u64` | cheap counters, quotas per day/month |
//! | [`SlidingWindowCounter`] | three integers | sliding windows at any limit |
//! | [`SlidingWindowBuckets`] | one counter a bucket | sliding windows of N buckets, rotated exactly |
//! | [`SlidingWindowLog`] | ≤ `limit` entries | exact sliding windows, small limits |
//! | [`LeakyBucket`] | one `u64` | pacing: delay instead of reject |
//! | [`Semaphore`] | ≤ `max` leases | concurrency across a fleet, with lease expiry |
//! | [`InFlight`] | one `u64` | concurrency in one process |
//! | [`adaptive::Controller`] | a few numbers | a concurrency limit that follows the backend |
//!
//! ```
//! use tollgate_core::{Limit, Outcome, Rate, RateAlgorithm, Rule, Algorithm};
//!
//! // 10 per second, bursts of 20.
//! let rule = Rule::new("per-key", Limit::gcra(Rate::per_second(10), 20))?;
//! let Algorithm::Gcra(gcra) = rule.algorithm() else { unreachable!() };
//!
//! let mut state = 0; // a fresh key
//! let now = 1_000_000_000;
//! let report = gcra.decide(&mut state, now, 15); // a report costs 15
//! assert!(report.is_allowed());
//! assert_eq!(report.remaining, 5);
//!
//! let another = gcra.decide(&mut state, now, 15);
//! assert_eq!(another.outcome, Outcome::Deny { retry_after: 1_000_000_000 });
//! assert_eq!(gcra.decide(&mut state, now, 21).outcome, Outcome::Never);
//! # Ok::<(), tollgate_core::ConfigError>(())
//! ```
//!
//! # Features
//!
//! | feature | what it adds |
//! |---|---|
//! | `testing` | [`testing`]: the conformance suite every store must pass |
//!
//! [tollgate]: https://docs.rs/tollgate

#![forbid(unsafe_code)]
// The crate README, so that its example is compiled and run as a test.
#![cfg_attr(doctest, doc = include_str!("../README.md"))]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![cfg_attr(
    test,
    allow(
        clippy::unwrap_used,
        clippy::panic,
        clippy::indexing_slicing,
        clippy::arithmetic_side_effects
    )
)]

pub mod adaptive;
pub mod algorithm;
pub mod calendar;
mod clock;
mod config;
mod decision;
mod store;
#[cfg(feature = "testing")]
pub mod testing;

pub use algorithm::{
    update_word, FixedWindow, Gcra, InFlight, LeakyBucket, PeriodStatus, PinnedPermits, Quota,
    QuotaDecision, QuotaState, RateAlgorithm, RetryBudget, RetryBudgetState, Semaphore,
    SemaphoreState, SlidingWindowBuckets, SlidingWindowBucketsState, SlidingWindowCounter,
    SlidingWindowCounterState, SlidingWindowLog, SlidingWindowLogState, TokenBucket,
};
pub use clock::{duration_to_nanos, Clock, ManualClock, SystemClock};
pub use config::{
    Algorithm, ConcurrencyRule, ConfigError, EscalationRule, Limit, QuotaRule, Rate,
    RetryBudgetRule, Rule, MAX_RULE_NAME_LEN,
};
pub use decision::{Acquire, Decision, Lease, Outcome, Withdrawal, CLOSED_RETRY_NS};
pub use store::{
    decide_parts, give_back_if_denied, join_all, BoxFuture, ConcurrencyLimiter, EscalationLimiter,
    JointDecision, JointPart, Limiter, QuotaLimiter, QuotaStore, RetryBudgetLimiter,
    RetryBudgetStore, Store, StoreError, StoreErrorKind,
};
