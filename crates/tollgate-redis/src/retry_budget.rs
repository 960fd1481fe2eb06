//! Retry budgets on Redis: one script call per deposit and per withdrawal
//! (`retry_budget.lua`), one hash per rule and client key holding the
//! window's ten slots, so every instance on the Redis shares one budget.
//!
//! Why share it: a retry budget bounds what retries add to an upstream's
//! load — `ratio` of the calls, plus a floor. Kept per process, the floor
//! is granted once per instance; kept in Redis, the whole fleet retries
//! at most `ratio` of the fleet's calls plus one floor.

use std::fmt;
use std::sync::Arc;

use tokio::runtime::Handle;
use tollgate_core::{
    ConfigError, RetryBudgetLimiter, RetryBudgetRule, StoreError, StoreErrorKind, Withdrawal,
};

use crate::backend::Backend;
use crate::key;
use crate::policy::RetryBudgetOnFailure;
use crate::scripts::{RetryBudgetMode, RETRY_BUDGET};
use crate::BoxFuture;

/// A retry budget bound to a [`RedisStore`](crate::RedisStore), shared by
/// every instance that binds the same rule under the same prefix. Cheap
/// to clone.
///
/// The script does the core's [`RetryBudget`](tollgate_core::RetryBudget)
/// arithmetic exactly, on Redis's `TIME` (or the client's Unix time, with
/// [`client_time`](crate::RedisStoreBuilder::client_time)); the key's TTL
/// is the rule's window plus a second, renewed on every write, so a budget
/// nobody uses vanishes with its window.
///
/// [`deposit`](RetryBudgetLimiter::deposit) runs as a task on the store's
/// runtime (the one it was built in), started before `deposit` returns:
/// the call's time is taken then, and dropping the future — a caller that
/// does not wait for a deposit — cancels nothing. The future says how it
/// went.
///
/// When Redis does not answer, the store's
/// [`FailurePolicy`](crate::FailurePolicy) does:
/// - [`Open`](crate::FailurePolicy::Open) grants every withdrawal: the
///   retry layer retries as it would with no budget — never more than
///   its own attempts allow — and so loses its protection against retry
///   storms while Redis is away;
/// - [`Closed`](crate::FailurePolicy::Closed) grants none: no retries
///   while Redis is away;
/// - [`Fallback`](crate::FailurePolicy::Fallback) withdraws from, and
///   deposits to, the process's own budget in that memory store. For
///   retry budgets this is the one to choose: an outage of Redis often
///   comes with trouble on the network, which is when retries pile up,
///   and a per-process budget loses little — each instance's deposits
///   follow its own calls; only the floor is granted once per instance.
///
/// A deposit or a [`balance`](Self::balance) read that did not reach
/// Redis goes to that memory if there is one; otherwise it is an error.
#[derive(Clone)]
pub struct RedisRetryBudget {
    bound: Arc<BoundBudget>,
}

struct BoundBudget {
    backend: Arc<Backend>,
    runtime: Handle,
    rule: RetryBudgetRule,
    /// `ARGV[5..]`: the slot's length, the deposit per call, the floor.
    params: [String; 3],
    ttl: String,
    on_failure: RetryBudgetOnFailure,
}

impl fmt::Debug for RedisRetryBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisRetryBudget")
            .field("rule", &self.bound.rule)
            .finish_non_exhaustive()
    }
}

impl RedisRetryBudget {
    pub(crate) fn new(
        backend: Arc<Backend>,
        runtime: Handle,
        rule: &RetryBudgetRule,
    ) -> Result<Self, ConfigError> {
        let budget = rule.budget();
        let window = budget.window();
        crate::scripts::check_span("window", window)?;
        let slot = window
            .checked_div(tollgate_core::algorithm::RETRY_SLOTS as u64)
            .unwrap_or(1);
        let on_failure = RetryBudgetOnFailure::new(&backend.policy, rule)?;
        Ok(Self {
            bound: Arc::new(BoundBudget {
                backend,
                runtime,
                rule: rule.clone(),
                params: [
                    slot.to_string(),
                    budget.deposit_units().to_string(),
                    budget.reserve_units().to_string(),
                ],
                ttl: crate::scripts::ttl_ms(window).to_string(),
                on_failure,
            }),
        })
    }

    /// The balance of `key`, in thousandths of a retry
    /// ([`RETRY_UNIT`](tollgate_core::algorithm::RETRY_UNIT)): the floor
    /// plus what the window's calls deposited, less what its retries
    /// withdrew. For dashboards and tests; writes nothing. When Redis
    /// does not answer: the fallback memory's balance, or the error.
    pub fn balance(&self, key: &[u8]) -> BoxFuture<Result<u64, StoreError>> {
        let this = Arc::clone(&self.bound);
        let key = key.to_vec();
        let now = this.backend.now_arg();
        Box::pin(async move {
            match this.call(RetryBudgetMode::Balance, &key, &now).await {
                Ok((_, balance)) => Ok(balance),
                Err(e) => this.on_failure.balance(&key, e),
            }
        })
    }
}

impl BoundBudget {
    /// Runs the script in `mode` for `key` at `now` (the time argument):
    /// whether it granted, and the balance after; or why there is no
    /// answer.
    async fn call(
        &self,
        mode: RetryBudgetMode,
        key: &[u8],
        now: &str,
    ) -> Result<(bool, u64), StoreError> {
        let rkey = self
            .backend
            .names
            .name(key::Format::RetryBudget, self.rule.name(), key);
        let [slot, deposit, reserve] = &self.params;
        let args = [mode.arg(), "0", now, &self.ttl, slot, deposit, reserve];
        let reply = self.backend.run(&RETRY_BUDGET, &[&rkey], &args).await?;
        reply.retry_budget().ok_or_else(|| {
            StoreError::new(
                StoreErrorKind::Protocol,
                "unreadable reply to a retry budget call",
            )
        })
    }
}

fn task_gone() -> StoreError {
    StoreError::new(
        StoreErrorKind::Unavailable,
        "the deposit task did not run (the Redis store's runtime shut down)",
    )
}

impl RetryBudgetLimiter for RedisRetryBudget {
    type DepositFuture = BoxFuture<Result<(), StoreError>>;
    type WithdrawFuture = BoxFuture<Result<Withdrawal, StoreError>>;

    fn rule(&self) -> &RetryBudgetRule {
        &self.bound.rule
    }

    fn deposit(&self, key: &[u8]) -> Self::DepositFuture {
        let this = Arc::clone(&self.bound);
        let key = key.to_vec();
        let now = this.backend.now_arg();
        // A task of its own, on the store's runtime: under way now,
        // whether or not the caller polls (or keeps) the future.
        let task = self.bound.runtime.spawn(async move {
            match this.call(RetryBudgetMode::Deposit, &key, &now).await {
                Ok(_) => Ok(()),
                Err(_) if this.on_failure.deposit(&key) => Ok(()),
                Err(e) => Err(e),
            }
        });
        Box::pin(async move { task.await.unwrap_or_else(|_| Err(task_gone())) })
    }

    fn withdraw(&self, key: &[u8]) -> Self::WithdrawFuture {
        let this = Arc::clone(&self.bound);
        let key = key.to_vec();
        let now = this.backend.now_arg();
        Box::pin(async move {
            // A fault or an unreadable reply: the failure policy answers.
            Ok(
                match this.call(RetryBudgetMode::Withdraw, &key, &now).await {
                    Ok((granted, balance)) => Withdrawal::new(granted, balance),
                    Err(_) => this.on_failure.withdraw(&key),
                },
            )
        })
    }
}
