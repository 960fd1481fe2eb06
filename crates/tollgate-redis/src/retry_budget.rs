//! Retry budgets on Redis: deposits counted in the process and carried to
//! Redis in batches, one script call per withdrawal (`retry_budget.lua`),
//! one hash per rule and client key holding the window's ten slots, so
//! every instance on the Redis shares one budget.
//!
//! Why share it: a retry budget bounds what retries add to an upstream's
//! load — `ratio` of the calls, plus a floor. Kept per process, the floor
//! is granted once per instance; kept in Redis, the whole fleet retries
//! at most `ratio` of the fleet's calls plus one floor.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

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
/// Deposits are batched: [`deposit_sync`](RetryBudgetLimiter::deposit_sync)
/// counts the call in the process, and what a key has counted goes to
/// Redis in one script call every 10 ms (a flush round: each key's
/// batches in order, the keys side by side, at most 64 script calls at
/// once), or just before the key's next withdrawal, so that a withdrawal
/// sees every deposit this instance counted. A client making 50,000 calls
/// a second to one upstream makes about 100 script calls a second for
/// them, not 50,000 (and no task per call); the test
/// `deposits_are_batched_and_withdrawals_see_them` counts them. A deposit
/// is made at its call's time, and normally reaches Redis within 10 ms.
/// A withdrawal waits for a round under way at most the store's call
/// timeout: a slow Redis may let it miss the newest deposits (fewer
/// retries), never hold it longer. Past 4,096 keys counted at once, a new
/// key's deposit is a script call of its own, on a task of the store's
/// runtime (the one it was built in); past 16,384 batches of earlier
/// slots waiting, the oldest is dropped. What is counted and not yet sent
/// when the budget is dropped is lost (at most 10 ms of calls).
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

/// How often the calls each key counted go to Redis.
pub(crate) const FLUSH_EVERY: Duration = Duration::from_millis(10);

/// Keys counted at once; a new key past them deposits on its own call.
pub(crate) const MAX_PENDING_KEYS: usize = 4_096;

/// The retry budgets a store bound, by rule name.
#[derive(Default)]
pub(crate) struct Bindings(Mutex<HashMap<String, Weak<BoundBudget>>>);

pub(crate) struct BoundBudget {
    backend: Arc<Backend>,
    runtime: Handle,
    rule: RetryBudgetRule,
    /// `ARGV[5..]`: the slot's length, the deposit per call, the floor.
    params: [String; 3],
    ttl: String,
    on_failure: RetryBudgetOnFailure,
    /// The slot's length in ns, to batch only calls of one slot.
    slot_ns: u64,
    /// Calls counted and not yet deposited in Redis.
    pending: Mutex<Pending>,
    /// The flusher's rounds started (counted under the `pending` lock as
    /// a round takes its batches) and ended, and a wake-up when one ends:
    /// a withdrawal or a read waits for the round that was under way when
    /// it took its key's batches, so that it sees every deposit counted
    /// before it (and in the order they were counted). A round takes at
    /// most the store's timeout per call.
    rounds: std::sync::atomic::AtomicU64,
    rounds_done: std::sync::atomic::AtomicU64,
    flushed: tokio::sync::Notify,
}

/// The calls counted by key: each key's batch of now's slot, and batches
/// of earlier slots, to be sent first and in order (a slot's position in
/// the window is reused a window later, so two slots' deposits do not
/// commute).
#[derive(Default)]
struct Pending {
    batches: HashMap<Vec<u8>, Batch>,
    due: std::collections::VecDeque<(Vec<u8>, Batch)>,
}

/// Calls of one key counted in one slot of the window.
struct Batch {
    calls: u64,
    /// The slot (this process's clock's), and the time argument of the
    /// batch's first call, which its deposit is made at.
    slot: u64,
    at: String,
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
        // The same rule bound again: the same budget, counted deposits
        // and all.
        let registry = Arc::clone(&backend);
        let mut bound_before = registry
            .retry_budgets
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        bound_before.retain(|_, b| b.strong_count() > 0);
        if let Some(bound) = bound_before.get(rule.name()).and_then(Weak::upgrade) {
            if bound.rule == *rule {
                return Ok(Self { bound });
            }
        }
        let on_failure = RetryBudgetOnFailure::new(&backend.policy, rule)?;
        let bound = Arc::new(BoundBudget {
            backend,
            runtime: runtime.clone(),
            rule: rule.clone(),
            params: [
                slot.to_string(),
                budget.deposit_units().to_string(),
                budget.reserve_units().to_string(),
            ],
            ttl: crate::scripts::ttl_ms(window).to_string(),
            on_failure,
            slot_ns: slot.max(1),
            pending: Mutex::new(Pending::default()),
            rounds: std::sync::atomic::AtomicU64::new(0),
            rounds_done: std::sync::atomic::AtomicU64::new(0),
            flushed: tokio::sync::Notify::new(),
        });
        runtime.spawn(flush_every(Arc::downgrade(&bound)));
        bound_before.insert(rule.name().to_owned(), Arc::downgrade(&bound));
        Ok(Self { bound })
    }

    /// Sends every deposit this budget counted to Redis now, and waits
    /// until they are there (or failed): before a process stops, or where
    /// another instance must see them at once (tests). Deposits otherwise
    /// go within 10 ms.
    pub async fn flush(&self) {
        let (Pending { batches, due }, round) = {
            let mut pending = self.bound.lock_pending();
            (
                std::mem::take(&mut *pending),
                self.bound.rounds.load(Ordering::Acquire),
            )
        };
        self.bound.settled(round).await;
        for (key, batch) in due.into_iter().chain(batches) {
            let _ = self.bound.deposit_batch(&key, batch).await;
        }
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
        // What this instance counted is part of the balance.
        let counted = this.take(&key);
        Box::pin(async move {
            this.caught_up(&key, counted).await;
            match this.call(RetryBudgetMode::Balance, &key, &now, 0).await {
                Ok((_, balance)) => Ok(balance),
                Err(e) => this.on_failure.balance(&key, e),
            }
        })
    }
}

/// Sends what every key counted to Redis every `FLUSH_EVERY`, until the
/// budget is dropped: each key's batches in the order counted (earlier
/// slots first), the keys side by side.
async fn flush_every(budget: Weak<BoundBudget>) {
    loop {
        tokio::time::sleep(FLUSH_EVERY).await;
        let Some(budget) = budget.upgrade() else {
            return;
        };
        let Pending { batches, due } = {
            let mut pending = budget.lock_pending();
            if pending.batches.is_empty() && pending.due.is_empty() {
                continue;
            }
            budget.rounds.fetch_add(1, Ordering::AcqRel);
            std::mem::take(&mut *pending)
        };
        // Ended however it ends (the runtime may drop it mid-round).
        let _round = RoundDone(Arc::clone(&budget));
        // Each key's batches in the order counted (earlier slots first),
        // the keys side by side, at most `ROUND_CALLS` calls at once.
        let mut by_key: HashMap<Vec<u8>, Vec<Batch>> = HashMap::new();
        for (key, batch) in due.into_iter().chain(batches) {
            by_key.entry(key).or_default().push(batch);
        }
        let mut calls = tokio::task::JoinSet::new();
        for (key, batches) in by_key {
            if calls.len() >= ROUND_CALLS {
                calls.join_next().await;
            }
            let budget = Arc::clone(&budget);
            calls.spawn(async move {
                for batch in batches {
                    let _ = budget.deposit_batch(&key, batch).await;
                }
            });
        }
        while calls.join_next().await.is_some() {}
    }
}

/// Script calls one flush round has in flight at once.
const ROUND_CALLS: usize = 64;

/// Batches of earlier slots kept at once (past it, the oldest is lost:
/// the budget errs toward fewer retries).
const MAX_DUE: usize = 4 * MAX_PENDING_KEYS;

/// Counts a flusher's round ended when dropped, and wakes who waits.
struct RoundDone(Arc<BoundBudget>);

impl Drop for RoundDone {
    fn drop(&mut self) {
        self.0.rounds_done.fetch_add(1, Ordering::AcqRel);
        self.0.flushed.notify_waiters();
    }
}

impl BoundBudget {
    fn lock_pending(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits until the flusher's round `round` (and those before) ended.
    /// Waits at most the store's call timeout: a round slowed by a slow
    /// Redis never holds a withdrawal longer than one call would take.
    async fn settled(&self, round: u64) {
        let wait = async {
            loop {
                let flushed = self.flushed.notified();
                tokio::pin!(flushed);
                flushed.as_mut().enable();
                if self.rounds_done.load(Ordering::Acquire) >= round {
                    return;
                }
                flushed.await;
            }
        };
        let _ = tokio::time::timeout(self.backend.timeout, wait).await;
    }

    /// Counts a call of `key` now; `false` when too many keys are counted
    /// already.
    fn count(&self, key: &[u8]) -> bool {
        let slot = self
            .backend
            .unix_now()
            .checked_div(self.slot_ns)
            .unwrap_or(0);
        let mut guard = self.lock_pending();
        let pending = &mut *guard;
        if let Some(batch) = pending.batches.get_mut(key) {
            if batch.slot == slot {
                batch.calls = batch.calls.saturating_add(1);
            } else {
                // A new slot: the earlier one's calls go first, as they are.
                let fresh = Batch {
                    calls: 1,
                    slot,
                    at: self.backend.now_arg(),
                };
                let earlier = std::mem::replace(batch, fresh);
                if pending.due.len() >= MAX_DUE {
                    pending.due.pop_front();
                }
                pending.due.push_back((key.to_vec(), earlier));
            }
            return true;
        }
        if pending.batches.len() >= MAX_PENDING_KEYS || pending.due.len() >= MAX_PENDING_KEYS {
            return false;
        }
        let batch = Batch {
            calls: 1,
            slot,
            at: self.backend.now_arg(),
        };
        pending.batches.insert(key.to_vec(), batch);
        true
    }

    /// Takes what `key` counted, in the order it was counted, for a call
    /// of its own to send first, and the flusher's round under way (which
    /// may hold more of them).
    fn take(&self, key: &[u8]) -> (Vec<Batch>, u64) {
        let mut guard = self.lock_pending();
        let round = self.rounds.load(Ordering::Acquire);
        let pending = &mut *guard;
        let mut batches = Vec::new();
        if pending.due.iter().any(|(k, _)| k == key) {
            let due = std::mem::take(&mut pending.due);
            for (k, batch) in due {
                if k == key {
                    batches.push(batch);
                } else {
                    pending.due.push_back((k, batch));
                }
            }
        }
        batches.extend(pending.batches.remove(key));
        (batches, round)
    }

    /// Waits for the round `take` named, then sends the batches it gave,
    /// each at its own time: a call made next sees every deposit counted
    /// before it, in order, as if each had gone to Redis on its own.
    async fn caught_up(&self, key: &[u8], (batches, round): (Vec<Batch>, u64)) {
        self.settled(round).await;
        for batch in batches {
            let _ = self.deposit_batch(key, batch).await;
        }
    }

    /// Deposits for `batch` of `key` in one script call, at the time of
    /// its first call; where Redis does not answer, see
    /// [`not_deposited`](Self::not_deposited).
    async fn deposit_batch(&self, key: &[u8], batch: Batch) -> Result<(), StoreError> {
        match self
            .call(RetryBudgetMode::Deposit, key, &batch.at, batch.calls)
            .await
        {
            Ok(_) => Ok(()),
            Err(e) => {
                self.not_deposited(key, batch.calls);
                Err(e)
            }
        }
    }

    /// Deposits for `calls` calls of `key` that did not reach Redis: in the
    /// fallback memory (which the withdrawals then use too); with no
    /// memory to take them they are lost, as a deposit Redis did not
    /// answer always was (the budget errs toward fewer retries).
    fn not_deposited(&self, key: &[u8], calls: u64) {
        if calls > 0 && self.on_failure.deposit(key) {
            for _ in 1..calls {
                self.on_failure.deposit(key);
            }
        }
    }

    /// Runs the script in `mode` for `key` at `now` (the time argument),
    /// carrying the deposits of `calls` calls: whether it granted, and the
    /// balance after; or why there is no answer.
    async fn call(
        &self,
        mode: RetryBudgetMode,
        key: &[u8],
        now: &str,
        calls: u64,
    ) -> Result<(bool, u64), StoreError> {
        let rkey = self
            .backend
            .names
            .name(key::Format::RetryBudget, self.rule.name(), key);
        let [slot, deposit, reserve] = &self.params;
        let calls = calls.to_string();
        let args = [mode.arg(), &calls, now, &self.ttl, slot, deposit, reserve];
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
        if self.deposit_sync(key) {
            return Box::pin(std::future::ready(Ok(())));
        }
        // Too many keys counted: a script call of its own, as a task on
        // the store's runtime, under way whether or not the caller polls
        // (or keeps) the future.
        let this = Arc::clone(&self.bound);
        let key = key.to_vec();
        let batch = Batch {
            calls: 1,
            slot: 0,
            at: this.backend.now_arg(),
        };
        let task = self
            .bound
            .runtime
            .spawn(async move { this.deposit_batch(&key, batch).await });
        Box::pin(async move { task.await.unwrap_or_else(|_| Err(task_gone())) })
    }

    /// Counts the call in the process (see the type's docs): `false` only
    /// when 4,096 other keys are counted already.
    fn deposit_sync(&self, key: &[u8]) -> bool {
        self.bound.count(key)
    }

    fn withdraw(&self, key: &[u8]) -> Self::WithdrawFuture {
        let this = Arc::clone(&self.bound);
        let key = key.to_vec();
        let now = this.backend.now_arg();
        // The calls this key counted go just before it, at their times.
        let counted = this.take(&key);
        Box::pin(async move {
            this.caught_up(&key, counted).await;
            // A fault or an unreadable reply: the failure policy answers.
            Ok(
                match this.call(RetryBudgetMode::Withdraw, &key, &now, 0).await {
                    Ok((granted, balance)) => Withdrawal::new(granted, balance),
                    Err(_) => this.on_failure.withdraw(&key),
                },
            )
        })
    }
}
