//! What a limiter answers.

use std::time::Duration;

/// How long a fail-closed answer ([`Decision::closed`]) asks a client to
/// wait: one second.
pub const CLOSED_RETRY_NS: u64 = 1_000_000_000;

/// Whether a request may go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Admitted. `delay` is zero except for the leaky-bucket pacer, which
    /// admits a request on condition that it waits `delay` nanoseconds
    /// for its turn.
    Allow {
        /// Nanoseconds the request must wait before it proceeds.
        delay: u64,
    },
    /// Not now: the budget is spent. The same request fits after
    /// `retry_after` nanoseconds, if nothing else consumes first.
    Deny {
        /// Nanoseconds until the same request would be admitted.
        retry_after: u64,
    },
    /// Never: the cost is larger than the rule's whole capacity, so
    /// retrying cannot help.
    Never,
}

/// A limiter's answer to one request: the outcome and the numbers a client
/// needs to pace itself (these become the `RateLimit` headers).
///
/// Times are nanoseconds; the `*_duration` accessors give [`Duration`]s.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Decision {
    /// Allowed, denied for now, or never.
    pub outcome: Outcome,
    /// The rule's capacity: the most that may be consumed at once.
    pub limit: u64,
    /// How much could still be consumed right now, after this request.
    pub remaining: u64,
    /// Nanoseconds until the budget is whole again if nothing else is
    /// consumed (zero when it is whole now).
    pub reset_after: u64,
}

impl Decision {
    /// Whether the request was admitted (possibly after a pacing delay).
    #[inline]
    pub fn is_allowed(&self) -> bool {
        matches!(self.outcome, Outcome::Allow { .. })
    }

    /// How long a denied request should wait before retrying; `None` when
    /// it was admitted or can never be admitted.
    #[inline]
    pub fn retry_after(&self) -> Option<Duration> {
        match self.outcome {
            Outcome::Deny { retry_after } => Some(Duration::from_nanos(retry_after)),
            _ => None,
        }
    }

    /// The pacing delay of an admitted request (zero for every algorithm
    /// but the leaky-bucket pacer); `None` when it was not admitted.
    #[inline]
    pub fn delay(&self) -> Option<Duration> {
        match self.outcome {
            Outcome::Allow { delay } => Some(Duration::from_nanos(delay)),
            _ => None,
        }
    }

    /// [`reset_after`](Self::reset_after) as a [`Duration`].
    #[inline]
    pub fn reset_after_duration(&self) -> Duration {
        Duration::from_nanos(self.reset_after)
    }

    /// What a limiter answers when its store cannot, failing closed:
    /// denied for now, retry in a second (`limit` is the rule's capacity).
    /// The Redis store's `FailurePolicy::Closed` and the layers'
    /// "refuse on a store error" answer this.
    pub fn closed(limit: u64) -> Self {
        Self::with(
            Outcome::Deny {
                retry_after: CLOSED_RETRY_NS,
            },
            limit,
            0,
            CLOSED_RETRY_NS,
        )
    }

    pub(crate) fn allow(limit: u64, remaining: u64, reset_after: u64) -> Self {
        Self::with(Outcome::Allow { delay: 0 }, limit, remaining, reset_after)
    }

    pub(crate) fn with(outcome: Outcome, limit: u64, remaining: u64, reset_after: u64) -> Self {
        Self {
            outcome,
            limit,
            remaining,
            reset_after,
        }
    }
}

/// The answer to a concurrency acquire: the decision and, when admitted,
/// the lease to release later.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Acquire {
    /// Admitted or not; `limit` is the maximum concurrency, `remaining`
    /// the permits still free under the acquire's ceiling. A denial's
    /// `retry_after` is the rule's retry hint (when a permit frees depends
    /// on other requests).
    pub decision: Decision,
    /// The lease to release when the work ends; `None` when denied.
    pub lease: Option<Lease>,
}

/// A held concurrency lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Lease {
    /// The lease's identifier, chosen by the store: within its key, or
    /// (a store that [releases by lease](crate::ConcurrencyLimiter::releases_by_lease))
    /// saying where its key is kept.
    pub id: u64,
    /// How many permits it holds.
    pub permits: u32,
}

/// A retry budget's answer to a withdrawal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Withdrawal {
    /// Whether a retry may go (one retry was withdrawn).
    pub granted: bool,
    /// The budget's balance after the withdrawal, in thousandths of a
    /// retry; `None` when the store could not say (its failure policy
    /// answered).
    pub balance: Option<u64>,
}

impl Withdrawal {
    /// An answer the store computed: `granted`, leaving `balance`.
    pub fn new(granted: bool, balance: u64) -> Self {
        Self {
            granted,
            balance: Some(balance),
        }
    }

    /// An answer without a balance (a failure policy's).
    pub fn blind(granted: bool) -> Self {
        Self {
            granted,
            balance: None,
        }
    }
}
