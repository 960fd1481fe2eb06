//! Hot keys without a store round trip per request: local leases of
//! units and a denial cache, in front of any store (see [`HotKeys`]).

mod keys;
mod limiter;
mod local;
mod through;

pub use limiter::{HotFuture, HotLimiter, HotStats};

use std::fmt;
use std::hash::RandomState;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use keys::{Keys, SHARDS};
use local::{Count, Local};
use tollgate_core::{
    duration_to_nanos, Algorithm, Clock, ConcurrencyRule, ConfigError, EscalationLimiter,
    EscalationRule, Limiter, QuotaRule, QuotaStore, RetryBudgetRule, RetryBudgetStore, Rule, Store,
    SystemClock,
};

/// Local leases for hot keys, in front of a shared store (Redis): an
/// instance takes a batch of a key's units from the store in one call
/// and spends them locally, with no I/O, until they run out or the lease
/// ends; and when the store says a key is over its limit until time T, the
/// instance answers that key itself until T (a denial cache).
///
/// **The batch adapts per key.** A key starts at a batch of 1 — each
/// decision is one store call, exact — and its batch doubles each time a
/// lease is spent before it ends (the key is hot), up to
/// [`max_batch`](Self::max_batch) and to [`max_share`](Self::max_share)
/// of the rule's capacity, and halves when a lease ends with units left.
/// Units a lease still holds when the key's next lease is taken before it
/// ends (a decision that costs more than it holds) go back to the store
/// with that lease (a refund); units left when a lease ends lapse, since a
/// refund after its end could credit capacity the store's budget has
/// already regained with time.
/// With [`refill_ahead`](Self::refill_ahead), what a lease still holds
/// when the lease taken ahead replaces it lapses. A holder that dies
/// mid-lease simply
/// spent its units: the budget recovers from them at its rate, so nothing
/// is lost or gained for good.
///
/// **The bound.** Units are counted in the store when they are leased, and
/// spent locally within the lease's TTL, so leases never let the fleet
/// take more units than the store counted. What moves is *when* they are
/// admitted: up to one TTL after they were counted. Over any window, a
/// rule admits at most what it would admit over that window lengthened by
/// the TTL:
///
/// - GCRA and the token bucket: at most `rate × ttl` units beyond the
///   rule's own bound, however many instances share it (e.g. 1,000/s with
///   a 50-ms TTL: 50 units, 0.5 % of a 10-s window's 10,000);
/// - fixed window: a lease ends with the store's window (its `reset_after`,
///   counted from when the lease was asked for), so leased units are spent
///   in the window that counted them;
/// - sliding window counter: as GCRA, `limit × ttl / window`;
/// - sliding window log, sliding window of buckets and leaky bucket: not
///   leased — the log's exactness, the buckets' refunds (taken off the
///   newest bucket: units given back a bucket after they were counted
///   would free another bucket's) and the leaky bucket's pacing are per
///   request; building such a rule through `HotKeys` is an error naming
///   `hot_keys`.
///
/// The price is under-admission while leases are outstanding: units one
/// instance leased and has not spent are not available to the others
/// (bounded by `max_share` per instance), and a cached denial may outlast
/// a refund by another instance (bounded by
/// [`max_denial`](Self::max_denial)). Cap the error by the TTL (how late
/// units may be spent) and the share (how much one instance may hold).
///
/// Concurrent decisions for one key on one instance share one store call
/// (single flight): while a lease is being taken, the others wait for it.
/// A key at a limit that refuses for less than a round trip (its cached
/// denials are over before they land: thousands a second against a
/// distant Redis) gains nothing from leases of one unit taken in turn:
/// its decisions go to the store side by side, until the store admits
/// one again — as many at once per instance as take, between them, all
/// that the key's rate frees (twice its rate times the key's last round
/// trip, at least 16 and at most 256), and the excess is refused here at
/// once with the store's last refusal, not queued behind them. A flood
/// of one key so reaches the store a bounded number of calls at once per
/// instance, never one per request, and waits for no more than one call.
/// (Figures with 64 tasks on one key at 1,000 to 20,000 a second beside
/// limitador are in `benches/README.md`.)
///
/// **When the store fails.** Leases already taken keep answering until
/// they end; then the store's failure policy answers, per request. A
/// denial the policy gives (fail-closed: "retry in a second") is cached
/// like one Redis gave, so after an outage a key may stay refused for up
/// to [`max_denial`](Self::max_denial) once Redis answers again; with
/// `FailurePolicy::Fallback`, the memory store's denials are cached the
/// same way. Tested on a Cluster whose hot key's master hangs: a cached
/// denial made no store call, the key admitted only what its lease held
/// (4 of 160 requests), and after the shard resumed it admitted no more
/// than its rebuilt burst, its rate and one TTL's worth.
///
/// ```
/// use std::time::Duration;
/// use tollgate_redis::{HotKeys, RedisStore};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), tollgate_core::ConfigError> {
/// let redis = RedisStore::builder("redis://127.0.0.1:6379").prefix("my-api").build()?;
/// // Only the per-key rule is leased; others decide per request.
/// let store = HotKeys::new()
///     .ttl(Duration::from_millis(50))
///     .max_batch(64)
///     .rules(["per-key"])
///     .over(redis)?;
/// # let _ = store;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct HotKeys {
    ttl: Duration,
    max_batch: u32,
    min_batch: u32,
    max_share: f64,
    max_denial: Duration,
    max_keys: usize,
    rules: Option<Vec<String>>,
    ahead: bool,
    name: Arc<str>,
}

impl Default for HotKeys {
    fn default() -> Self {
        Self::new()
    }
}

impl HotKeys {
    /// Leases of 50 ms, batches up to 512 units and 10 % of a rule's
    /// capacity, denials cached up to 1 s, up to 100,000 keys per rule,
    /// for every rule.
    pub fn new() -> Self {
        Self {
            ttl: Duration::from_millis(50),
            max_batch: 512,
            min_batch: 1,
            max_share: 0.1,
            max_denial: Duration::from_secs(1),
            max_keys: 100_000,
            rules: None,
            ahead: false,
            name: "hot".into(),
        }
    }

    /// How long a lease lasts: how late a leased unit may be spent (the
    /// bound above scales with it). From 1 ms to 10 s. Keep it well above
    /// the store's round trip and call timeout (a Redis store's default
    /// timeout is 50 ms, as is this TTL's default): a lease's TTL counts
    /// from when it was asked for, so a lease whose answer takes longer
    /// than the TTL has ended when it lands, and every decision costs a
    /// store call again.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// The most units one lease takes (at least 1; 1 turns leasing off and
    /// keeps only the denial cache and the single flight).
    pub fn max_batch(mut self, units: u32) -> Self {
        self.max_batch = units;
        self
    }

    /// The batch every key starts from, and never goes below (default 1:
    /// a cold key decides per request, exactly). Above 1 — for a distant
    /// store, e.g. a global tier 100 ms away (see
    /// [`Tiered`](crate::Tiered)) — even a key's first request takes a
    /// lease, so most decisions skip the round trip; the bound above is
    /// the same (`rate × ttl`), and a cold key holds up to this many units
    /// it may not spend. Capped by `max_batch` and `max_share`.
    pub fn min_batch(mut self, units: u32) -> Self {
        self.min_batch = units;
        self
    }

    /// The most of a rule's capacity one lease takes (above 0, at most 1).
    pub fn max_share(mut self, share: f64) -> Self {
        self.max_share = share;
        self
    }

    /// The longest a denial is answered locally (0: no denial cache).
    pub fn max_denial(mut self, max: Duration) -> Self {
        self.max_denial = max;
        self
    }

    /// Takes a key's next lease before the current one runs out (default
    /// off): once a hot key's lease is half spent, one background call
    /// takes the next, and decisions go on
    /// spending the current one meanwhile. For a distant store (another
    /// region, a global tier), so that a hot key's decisions do not wait
    /// a round trip each time a lease runs out: with a batch that lasts
    /// longer than two round trips and a TTL well above one, nearly every
    /// decision is local. The bound is unchanged (each lease's units are
    /// spent within its own TTL); an instance may hold two leases of a
    /// key at once, so up to twice [`max_share`](Self::max_share).
    pub fn refill_ahead(mut self, on: bool) -> Self {
        self.ahead = on;
        self
    }

    /// The most keys one rule keeps leases for (a key beyond decides per
    /// request, through the store). Keys longer than 64 bytes are never
    /// leased (they decide through the store), so the table of one rule
    /// holds at most `max_keys` × 64 bytes of keys; the tower layers'
    /// keys are at most 64 bytes.
    pub fn max_keys(mut self, keys: usize) -> Self {
        self.max_keys = keys;
        self
    }

    /// The `name` label of this front's metrics (`tollgate_hot_*`;
    /// default `hot`): give each `HotKeys` its own where two fronts lease
    /// rules of the same name (a regional and a global tier, two stores),
    /// so their counts do not add up as one.
    pub fn name(mut self, name: &str) -> Self {
        self.name = name.into();
        self
    }

    /// Leases only the rules named (default: every rule bound through it
    /// that can be leased — a sliding window log or a leaky bucket is
    /// decided per request, through the store). Naming one of those is an
    /// error when it is bound. A name that matches no rule is not an
    /// error (the rule may be bound later, or elsewhere): check a bound
    /// limiter with [`HotLimiter::is_leased`].
    pub fn rules<I, S>(mut self, names: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        self.rules = Some(names.into_iter().map(|n| n.as_ref().to_owned()).collect());
        self
    }

    /// Puts hot-key leases in front of `store`, on the system clock.
    /// Errors name `hot_keys`.
    pub fn over<S: Store>(self, store: S) -> Result<Hot<S>, ConfigError> {
        self.over_with_clock(store, SystemClock)
    }

    /// [`over`](Self::over), on `clock` (tests pass a manual clock — the
    /// same one the store reads, e.g. Redis's `client_time`).
    pub fn over_with_clock<S: Store, C: Clock>(
        self,
        store: S,
        clock: C,
    ) -> Result<Hot<S, C>, ConfigError> {
        self.check()?;
        // Fleet review L13: a lease asked for is over once its TTL has
        // passed since it was asked, so a store slower than the TTL makes
        // every lease end on arrival (and halves the batch toward 1).
        if let Some(timeout) = store.call_timeout().filter(|t| self.ttl < *t) {
            tracing::warn!(
                target: "tollgate",
                ttl_ms = self.ttl.as_millis(),
                timeout_ms = timeout.as_millis(),
                "hot_keys: the lease TTL is shorter than the store's call timeout: a lease whose \
                 answer takes longer than the TTL has ended when it lands; keep the TTL above \
                 the store's round trip"
            );
        }
        Ok(Hot {
            inner: store,
            config: Arc::new(self),
            clock: Arc::new(clock),
            leased: Arc::default(),
        })
    }

    /// Checks the settings as [`over`](Self::over) does, without a store
    /// (e.g. a policy file's before anything is connected). The error
    /// names `hot_keys`; its message starts with the setting.
    pub fn check(&self) -> Result<(), ConfigError> {
        let ttl = duration_to_nanos(self.ttl);
        if !(1_000_000..=10_000_000_000).contains(&ttl) {
            return Err(ConfigError::new(
                "hot_keys",
                "ttl must be from 1 ms to 10 s",
            ));
        }
        if self.max_batch == 0 {
            return Err(ConfigError::new("hot_keys", "max_batch must be at least 1"));
        }
        if self.min_batch == 0 || self.min_batch > self.max_batch {
            return Err(ConfigError::new(
                "hot_keys",
                "min_batch must be from 1 to max_batch",
            ));
        }
        if !(self.max_share > 0.0 && self.max_share <= 1.0) {
            return Err(ConfigError::new(
                "hot_keys",
                "max_share must be above 0 and at most 1",
            ));
        }
        if self.max_keys == 0 {
            return Err(ConfigError::new("hot_keys", "max_keys must be at least 1"));
        }
        if !crate::store::plain_name(&self.name) {
            return Err(ConfigError::new(
                "hot_keys",
                format!("name {}", crate::store::PLAIN_NAME),
            ));
        }
        Ok(())
    }
}

/// A store with hot-key leases in front (see [`HotKeys`]). Concurrency
/// rules and escalation ladders go to the store as they are.
pub struct Hot<S: Store, C = SystemClock> {
    inner: S,
    config: Arc<HotKeys>,
    clock: Arc<C>,
    /// The leased rules bound through it (and its clones), for
    /// [`give_back`](Hot::give_back).
    leased: Leased<S::Limiter, C>,
}

/// Each leased rule's limiter on the store and its lease table; a table
/// no `HotLimiter` holds any more (a reload replaced it) is given back
/// and forgotten when the next rule is bound, or at `give_back`.
type Leased<L, C> = Arc<Mutex<Vec<Table<L, C>>>>;

/// A leased rule's limiter on the store, and its lease table.
type Table<L, C> = (L, Arc<Local<C>>);

/// Takes out of `leased` the tables no limiter holds any more.
fn orphans<L, C>(leased: &Mutex<Vec<Table<L, C>>>) -> Vec<Table<L, C>> {
    let mut leased = leased.lock().unwrap_or_else(PoisonError::into_inner);
    let (orphans, held) = leased
        .drain(..)
        .partition(|(_, local)| Arc::strong_count(local) == 1);
    *leased = held;
    orphans
}

/// Surrenders each table's leases: the refunds that give their units
/// back, and the units.
fn surrender<L: Limiter, C: Clock>(tables: &[(L, Arc<Local<C>>)]) -> (Vec<L::RefundFuture>, u64) {
    let mut refunds = Vec::new();
    let mut units = 0u64;
    for (limiter, local) in tables {
        for (key, n) in local.surrender() {
            units = units.saturating_add(n);
            local.store_calls.add();
            refunds.push(limiter.refund(&key, n));
        }
    }
    (refunds, units)
}

impl<S: Store, C> Clone for Hot<S, C> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            config: Arc::clone(&self.config),
            clock: Arc::clone(&self.clock),
            leased: Arc::clone(&self.leased),
        }
    }
}

impl<S: Store, C> Hot<S, C> {
    /// The store the leases are taken from.
    pub fn store(&self) -> &S {
        &self.inner
    }
}

impl<S: Store, C: Clock> Hot<S, C> {
    /// Gives back to the store what every lease still holds, and ends the
    /// leases: for an instance that stops (graceful shutdown), so the
    /// units it leased and did not spend are the fleet's again at once
    /// rather than lapsing with their TTL. Only what a lease may return
    /// goes back (a lease still on; a window's lease within its window;
    /// never what the failure policy granted). Returns the units given
    /// back (refunds the store failed lapse, as they would have).
    ///
    /// Keys still deciding afterwards take new leases: call it once no
    /// more requests are served. Refunds go to the store 256 at a time;
    /// bound the whole with a timeout where shutdown must not wait on a
    /// slow store. A store with a fallback policy that is down at that
    /// moment credits the refunds to its fallback memory (as every refund
    /// it cannot deliver), which the stopping instance no longer uses.
    pub async fn give_back(&self) -> u64 {
        let mut tables = orphans(&self.leased);
        tables.extend(
            self.leased
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .iter()
                .map(|(limiter, local)| (limiter.clone(), Arc::clone(local))),
        );
        let (refunds, units) = surrender(&tables);
        // At most 256 refunds in flight at once (one per key leased, and
        // a table may hold 100,000 keys).
        let mut failed = 0usize;
        let mut refunds = refunds.into_iter().map(Box::pin).peekable();
        while refunds.peek().is_some() {
            let chunk: Vec<_> = refunds.by_ref().take(256).collect();
            failed = failed.saturating_add(
                tollgate_core::join_all(chunk)
                    .await
                    .into_iter()
                    .filter(Result::is_err)
                    .count(),
            );
        }
        if failed > 0 {
            tracing::warn!(
                target: "tollgate",
                failed,
                "hot_keys: leased units not given back (the store failed); they lapse with their lease"
            );
        }
        units
    }
}

impl<S: Store + fmt::Debug, C> fmt::Debug for Hot<S, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Hot")
            .field("inner", &self.inner)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl<S: Store, C: Clock> Store for Hot<S, C> {
    type Limiter = HotLimiter<S::Limiter, C>;
    type ConcurrencyLimiter = S::ConcurrencyLimiter;

    fn call_timeout(&self) -> Option<Duration> {
        self.inner.call_timeout()
    }

    fn limiter(&self, rule: &Rule) -> Result<Self::Limiter, ConfigError> {
        let named = self
            .config
            .rules
            .as_ref()
            .map(|names| names.iter().any(|n| n == rule.name()));
        let unleasable = matches!(
            rule.algorithm(),
            Algorithm::SlidingWindowLog(_)
                | Algorithm::SlidingWindowBuckets(_)
                | Algorithm::LeakyBucket(_)
        );
        // Every rule (no names given) leases those that can be; a rule not
        // named is not leased.
        if named == Some(false) || (named.is_none() && unleasable) {
            return Ok(HotLimiter {
                inner: self.inner.limiter(rule)?,
                local: None,
            });
        }
        let windowed = match rule.algorithm() {
            // Named, yet cannot be leased.
            Algorithm::SlidingWindowLog(_)
            | Algorithm::SlidingWindowBuckets(_)
            | Algorithm::LeakyBucket(_) => {
                return Err(ConfigError::new(
                    "hot_keys",
                    format!(
                        "rule {:?}: a sliding window log is exact per request, a window of buckets takes a refund off its newest bucket (a lease given back a bucket later would credit units another bucket counted), and a leaky bucket paces each request; none can be leased (leave it out of HotKeys::rules)",
                        rule.name()
                    ),
                ))
            }
            Algorithm::FixedWindow(_) => true,
            _ => false,
        };
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss
        )]
        let share_cap = ((rule.capacity() as f64) * self.config.max_share).floor() as u64;
        let max_batch = u64::from(self.config.max_batch)
            .min(share_cap.max(1))
            .max(1);
        let shards: Box<[_]> = (0..SHARDS).map(|_| Mutex::new(Keys::default())).collect();
        let inner = self.inner.limiter(rule)?;
        let local = Arc::new(Local {
            clock: Arc::clone(&self.clock),
            ttl: duration_to_nanos(self.config.ttl),
            max_denial: duration_to_nanos(self.config.max_denial),
            max_batch,
            min_batch: u64::from(self.config.min_batch).min(max_batch),
            windowed,
            window: rule.window(),
            per_shard: self.config.max_keys.div_ceil(SHARDS).max(1),
            hasher: RandomState::new(),
            shards,
            decisions: Count::new(
                "tollgate_hot_decisions_total",
                &self.config.name,
                rule.name(),
            ),
            store_calls: Count::new(
                "tollgate_hot_store_calls_total",
                &self.config.name,
                rule.name(),
            ),
            waits: Count::new("tollgate_hot_waits_total", &self.config.name, rule.name()),
            ahead: self.config.ahead,
        });
        // Tables no limiter holds any more (a reload replaced them) give
        // back what they still hold, in the background.
        let replaced = orphans(&self.leased);
        self.leased
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((inner.clone(), Arc::clone(&local)));
        let (refunds, _) = surrender(&replaced);
        if let (false, Ok(rt)) = (refunds.is_empty(), tokio::runtime::Handle::try_current()) {
            drop(rt.spawn(tollgate_core::join_all(
                refunds.into_iter().map(Box::pin).collect(),
            )));
        }
        Ok(HotLimiter {
            inner,
            local: Some(local),
        })
    }

    fn concurrency_limiter(
        &self,
        rule: &ConcurrencyRule,
    ) -> Result<Self::ConcurrencyLimiter, ConfigError> {
        self.inner.concurrency_limiter(rule)
    }

    fn escalation(&self, rule: &EscalationRule) -> Result<Arc<dyn EscalationLimiter>, ConfigError> {
        self.inner.escalation(rule)
    }

    fn rebinding(&self) -> Self {
        Self {
            inner: self.inner.rebinding(),
            config: Arc::clone(&self.config),
            clock: Arc::clone(&self.clock),
            leased: Arc::clone(&self.leased),
        }
    }

    /// A handle whose leases are its own (what it binds is checked and
    /// dropped, never given back for).
    fn checking(&self) -> Self {
        Self {
            inner: self.inner.checking(),
            config: Arc::clone(&self.config),
            clock: Arc::clone(&self.clock),
            leased: Arc::default(),
        }
    }
}

/// Quotas go to the store as they are: a quota counts each unit of a
/// period, which a lease would only move.
impl<S: QuotaStore, C: Clock> QuotaStore for Hot<S, C> {
    type QuotaLimiter = S::QuotaLimiter;

    fn quota_limiter(&self, rule: &QuotaRule) -> Result<Self::QuotaLimiter, ConfigError> {
        self.inner.quota_limiter(rule)
    }
}

/// Retry budgets go to the store as they are.
impl<S: RetryBudgetStore, C: Clock> RetryBudgetStore for Hot<S, C> {
    type RetryBudgetLimiter = S::RetryBudgetLimiter;

    fn retry_budget(
        &self,
        rule: &RetryBudgetRule,
    ) -> Result<Self::RetryBudgetLimiter, ConfigError> {
        self.inner.retry_budget(rule)
    }
}
