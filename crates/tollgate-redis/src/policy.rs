//! What a limiter answers when Redis does not: the failure policy, bound
//! to a rate rule ([`RateOnFailure`]), a concurrency rule
//! ([`ConcurrencyOnFailure`]), a quota rule ([`QuotaOnFailure`]) or a
//! retry budget ([`RetryBudgetOnFailure`]).

use tollgate_core::{
    Acquire, ConcurrencyRule, ConfigError, Decision, Lease, Outcome, PeriodStatus, QuotaDecision,
    QuotaRule, QuotaStore as _, RetryBudgetRule, RetryBudgetStore as _, Rule, Store as _,
    StoreError, Withdrawal,
};
use tollgate_memory::{
    MemoryConcurrencyLimiter, MemoryLimiter, MemoryQuotaLimiter, MemoryRetryBudget, MemoryStore,
};

/// What a limiter answers when Redis does not.
///
/// For a retry budget ([`RedisRetryBudget`](crate::RedisRetryBudget)),
/// where a withdrawal is a retry asked for: `Open` grants it, `Closed`
/// refuses it, `Fallback` answers from the memory store's budget.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum FailurePolicy {
    /// Admit every request (availability first). The default. A retry
    /// budget grants every retry, as if there were none: no more retries
    /// than the retry policy alone makes.
    Open,
    /// Deny every request, retry after a second (protection first). A
    /// retry budget grants no retry.
    Closed,
    /// Decide in this process's memory: each instance enforces the whole
    /// limit on its own until Redis is back, so a fleet of N instances
    /// admits up to N times each rate and burst, N times each in-flight
    /// limit, and a fresh quota each (see
    /// [`FallbackShare`](Self::FallbackShare) for a fleet). The one to
    /// choose for retry budgets (see
    /// [`RedisRetryBudget`](crate::RedisRetryBudget)).
    Fallback(MemoryStore),
    /// [`Fallback`](Self::Fallback) for a fleet of `instances`: each
    /// instance decides in memory with its share of every limit — rates,
    /// bursts, window limits, in-flight maximums and quota budgets divided
    /// by `instances`, rounded down, never below one unit — so that during
    /// an outage the fleet admits about the limit, not `instances` times
    /// it ([`Rule::divided`](tollgate_core::Rule::divided)). Name the
    /// usual fleet size: fewer instances than that admit less than the
    /// limit, more admit more. Retry budgets and escalation ladders are
    /// not divided: each instance's budget already follows its own
    /// traffic, and a strike counts against the client wherever it lands.
    /// A request that costs more than a share (but not more than the
    /// whole limit) is refused as too costly until Redis is back; a
    /// non-critical ceiling keeps its proportion of the share, so the
    /// critical reserve stays.
    FallbackShare {
        /// The memory the shares are kept in.
        memory: MemoryStore,
        /// How many instances share each limit (at least 1).
        instances: u32,
    },
}

impl FailurePolicy {
    /// [`FailurePolicy::Fallback`] with a fresh default [`MemoryStore`].
    pub fn fallback() -> Self {
        Self::Fallback(MemoryStore::new())
    }

    /// [`FailurePolicy::FallbackShare`] for `instances` instances, with a
    /// fresh default [`MemoryStore`]. Zero is refused when the store is
    /// built (field `instances`).
    pub fn fallback_share(instances: u32) -> Self {
        Self::FallbackShare {
            memory: MemoryStore::new(),
            instances,
        }
    }

    /// The memory a fallback decides in, and how many instances share
    /// each limit; `None` for `Open` and `Closed`.
    pub(crate) fn memory(&self) -> Option<(&MemoryStore, u32)> {
        match self {
            Self::Fallback(m) => Some((m, 1)),
            Self::FallbackShare { memory, instances } => Some((memory, *instances)),
            Self::Open | Self::Closed => None,
        }
    }

    /// Refuses a share among no instances.
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        match self.memory() {
            Some((_, 0)) => Err(ConfigError::new(
                "instances",
                "FailurePolicy::fallback_share needs at least 1 instance",
            )),
            _ => Ok(()),
        }
    }
}

/// The failure policy of one rate rule.
pub(crate) enum RateOnFailure {
    Open,
    Closed,
    Memory(MemoryLimiter),
}

/// How a Redis store handle binds its fallback memory store: as it is,
/// rebinding ([`Store::rebinding`](tollgate_core::Store::rebinding)) or
/// checking ([`Store::checking`](tollgate_core::Store::checking)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rebind {
    No,
    Yes,
    Check,
}

/// What fail-open answers: admitted, the whole budget reported left.
fn open_decision(limit: u64) -> Decision {
    Decision {
        outcome: Outcome::Allow { delay: 0 },
        limit,
        remaining: limit,
        reset_after: 0,
    }
}

/// What fail-closed answers: denied, retry in a second.
impl FailurePolicy {
    /// The policy to bind a rule's fallback with: through the memory
    /// store's rebinding (or checking) handle when the Redis store's is.
    pub(crate) fn binding(&self, mode: Rebind) -> FailurePolicy {
        let handle = |m: &tollgate_memory::MemoryStore| match mode {
            Rebind::No => m.clone(),
            Rebind::Yes => tollgate_core::Store::rebinding(m),
            Rebind::Check => tollgate_core::Store::checking(m),
        };
        match self {
            FailurePolicy::Fallback(m) => FailurePolicy::Fallback(handle(m)),
            FailurePolicy::FallbackShare { memory, instances } => FailurePolicy::FallbackShare {
                memory: handle(memory),
                instances: *instances,
            },
            other => other.clone(),
        }
    }
}

impl RateOnFailure {
    pub(crate) fn new(policy: &FailurePolicy, rule: &Rule) -> Result<Self, ConfigError> {
        Ok(match policy {
            FailurePolicy::Open => Self::Open,
            FailurePolicy::Closed => Self::Closed,
            FailurePolicy::Fallback(m) => Self::Memory(m.limiter(rule)?),
            FailurePolicy::FallbackShare { memory, instances } => {
                Self::Memory(memory.limiter(&rule.divided(*instances)?)?)
            }
        })
    }

    pub(crate) fn decide(&self, rule: &Rule, key: &[u8], cost: u64) -> Decision {
        match self {
            Self::Open => open_decision(rule.capacity()),
            Self::Closed => Decision::closed(rule.capacity()),
            Self::Memory(m) => m.decide_now(key, cost),
        }
    }

    /// Whether an admitting answer consumed anything: only memory counts.
    pub(crate) fn consumes(&self) -> bool {
        matches!(self, Self::Memory(_))
    }

    /// Refunds in memory; `false` if there is no memory to refund to.
    pub(crate) fn refund(&self, key: &[u8], cost: u64) -> bool {
        match self {
            Self::Memory(m) => {
                m.refund_now(key, cost);
                true
            }
            Self::Open | Self::Closed => false,
        }
    }
}

/// Leases not granted by Redis carry this bit — the in-memory fallback's,
/// and fail-open's lease that holds nothing — so their release goes to
/// whoever granted them, even after Redis is back. The ids of Redis
/// leases are below 2⁶² ([`LeaseIds`](crate::leases::LeaseIds)) and never
/// carry it.
pub(crate) const LOCAL_LEASE: u64 = 1 << 63;

/// The failure policy of one concurrency rule. Open answers as if the key
/// held nothing, Closed as if it were full (in both, permits above the
/// ceiling are `Never` and 0 peeks), Memory acquires in process memory.
pub(crate) enum ConcurrencyOnFailure {
    Open,
    Closed,
    Memory(MemoryConcurrencyLimiter),
}

impl ConcurrencyOnFailure {
    pub(crate) fn new(policy: &FailurePolicy, rule: &ConcurrencyRule) -> Result<Self, ConfigError> {
        Ok(match policy {
            FailurePolicy::Open => Self::Open,
            FailurePolicy::Closed => Self::Closed,
            FailurePolicy::Fallback(m) => Self::Memory(m.concurrency_limiter(rule)?),
            FailurePolicy::FallbackShare { memory, instances } => {
                Self::Memory(memory.concurrency_limiter(&rule.divided(*instances)?)?)
            }
        })
    }

    pub(crate) fn acquire(
        &self,
        rule: &ConcurrencyRule,
        key: &[u8],
        permits: u32,
        ceiling: u32,
    ) -> Acquire {
        let counter = rule.semaphore().in_flight();
        let (mut held, local_id) = match self {
            Self::Memory(m) => {
                // A ceiling under the rule's max (non-critical traffic held
                // to a share) keeps its proportion of a fleet share's max,
                // so the critical reserve outlives the division.
                let (max, share) = (
                    rule.semaphore().max(),
                    tollgate_core::ConcurrencyLimiter::rule(m).semaphore().max(),
                );
                let ceiling = if ceiling < max && share < max {
                    let scaled = u64::from(ceiling)
                        .saturating_mul(u64::from(share))
                        .checked_div(u64::from(max))
                        .unwrap_or(0);
                    u32::try_from(scaled).unwrap_or(u32::MAX).max(1)
                } else {
                    ceiling
                };
                let mut got = m.acquire_now(key, permits, ceiling);
                if let Some(lease) = &mut got.lease {
                    lease.id |= LOCAL_LEASE;
                }
                return got;
            }
            Self::Open => (0, Some(LOCAL_LEASE)),
            Self::Closed => (u64::from(counter.max()), None),
        };
        let decision = counter.acquire(&mut held, permits, ceiling);
        Acquire {
            decision,
            lease: local_id
                .filter(|_| decision.is_allowed() && permits > 0)
                .map(|id| Lease { id, permits }),
        }
    }

    /// Releases a lease carrying [`LOCAL_LEASE`].
    pub(crate) fn release(&self, key: &[u8], lease: Lease) {
        if let Self::Memory(m) = self {
            m.release_now(
                key,
                Lease {
                    id: lease.id & !LOCAL_LEASE,
                    permits: lease.permits,
                },
            );
        }
    }

    /// What `held` answers when Redis does not: the fallback's count, or
    /// the error.
    pub(crate) fn held(&self, key: &[u8], error: StoreError) -> Result<u64, StoreError> {
        match self {
            Self::Memory(m) => Ok(m.held_now(key)),
            Self::Open | Self::Closed => Err(error),
        }
    }
}

/// The failure policy of one quota rule: Open admits and reports whole
/// budgets (with the periods' bounds at this process's Unix time), Closed
/// denies and reports none left, to be asked again in a second (its items'
/// `t` says the same as its `Retry-After`), and Memory counts in process
/// memory. Only the answer to a consume (or a read) comes from the policy;
/// a refund, a reset or a grant that did not reach Redis is an error — a
/// refund is not made in memory either, which never saw the charge it
/// would give back — so that whoever administers quotas knows it did not
/// happen.
pub(crate) enum QuotaOnFailure {
    Open,
    Closed,
    Memory(MemoryQuotaLimiter),
}

impl QuotaOnFailure {
    pub(crate) fn new(policy: &FailurePolicy, rule: &QuotaRule) -> Result<Self, ConfigError> {
        Ok(match policy {
            FailurePolicy::Open => Self::Open,
            FailurePolicy::Closed => Self::Closed,
            FailurePolicy::Fallback(m) => Self::Memory(m.quota_limiter(rule)?),
            FailurePolicy::FallbackShare { memory, instances } => {
                Self::Memory(memory.quota_limiter(&rule.divided(*instances)?)?)
            }
        })
    }

    /// What a consume of `cost` for `key` gets at `now` (Unix ns): `Err`
    /// where the fallback memory store is full and cannot hold `key`.
    pub(crate) fn consume(
        &self,
        rule: &QuotaRule,
        key: &[u8],
        cost: u64,
        now: u64,
    ) -> Result<QuotaDecision, StoreError> {
        let open = matches!(self, Self::Open);
        let outcome = match self {
            Self::Memory(m) => return m.consume_now(key, cost),
            Self::Open => Outcome::Allow { delay: 0 },
            Self::Closed => Outcome::Deny {
                retry_after: tollgate_core::CLOSED_RETRY_NS,
            },
        };
        let quota = rule.quota();
        let periods: Vec<PeriodStatus> = quota
            .periods()
            .map(|(period, limit)| {
                let (start, end) = period.bounds_in(now, quota.zone());
                PeriodStatus {
                    period,
                    limit,
                    remaining: if open { limit } else { 0 },
                    // Closed: "ask again in a second", as its Retry-After.
                    reset_after: if open {
                        end.saturating_sub(now)
                    } else {
                        tollgate_core::CLOSED_RETRY_NS
                    },
                    length: end.saturating_sub(start),
                }
            })
            .collect();
        Ok(QuotaDecision::new(outcome, &periods))
    }

    /// A refund that did not reach Redis: never made elsewhere (the
    /// memory fallback did not see the charge; giving it back there would
    /// admit more than the limit), so always `None`: the caller's error.
    pub(crate) fn refund(&self, _key: &[u8], _cost: u64) -> Option<QuotaDecision> {
        None
    }
}

/// The failure policy of one retry budget: Open grants every withdrawal
/// (retries as without a budget: bounded by the retry policy alone),
/// Closed grants none, Memory withdraws from (and deposits to) the
/// process's own budget. Deposits and reads that did not reach Redis
/// are errors unless there is memory to take them.
pub(crate) enum RetryBudgetOnFailure {
    Open,
    Closed,
    Memory(MemoryRetryBudget),
}

impl RetryBudgetOnFailure {
    pub(crate) fn new(policy: &FailurePolicy, rule: &RetryBudgetRule) -> Result<Self, ConfigError> {
        Ok(match policy {
            FailurePolicy::Open => Self::Open,
            FailurePolicy::Closed => Self::Closed,
            // Not divided: each instance's budget follows its own traffic.
            FailurePolicy::Fallback(m) | FailurePolicy::FallbackShare { memory: m, .. } => {
                Self::Memory(m.retry_budget(rule)?)
            }
        })
    }

    /// Deposits in memory; `false` if there is no memory to deposit to.
    pub(crate) fn deposit(&self, key: &[u8]) -> bool {
        match self {
            Self::Memory(m) => {
                m.deposit_now(key);
                true
            }
            Self::Open | Self::Closed => false,
        }
    }

    /// Whether a retry for `key` may go.
    pub(crate) fn withdraw(&self, key: &[u8]) -> Withdrawal {
        match self {
            Self::Open => Withdrawal::blind(true),
            Self::Closed => Withdrawal::blind(false),
            // The local budget's balance is not the shared one's.
            Self::Memory(m) => Withdrawal::blind(m.withdraw_now(key).granted),
        }
    }

    /// What a read of the balance answers when Redis does not: the
    /// memory's balance, or the error.
    pub(crate) fn balance(&self, key: &[u8], error: StoreError) -> Result<u64, StoreError> {
        match self {
            Self::Memory(m) => Ok(m.balance_now(key)),
            Self::Open | Self::Closed => Err(error),
        }
    }
}
