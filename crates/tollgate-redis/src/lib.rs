//! The Redis store of [tollgate]: one limit across a fleet, on standalone
//! Redis or Redis Cluster, calm when Redis dies.
//!
//! - **One round trip per decision.** Every algorithm of
//!   [`tollgate_core`] runs as one Lua script (`EVALSHA`, reloaded on
//!   `NOSCRIPT`), a port of the same math; the core's conformance suite
//!   runs against this store unchanged.
//! - **Redis's clock.** Scripts read `TIME`, so instances whose clocks
//!   disagree still decide alike. For hosted Redis variants that forbid
//!   `TIME` in scripts, [`RedisStoreBuilder::client_time`] passes the time
//!   as an argument instead.
//! - **Keys** are `<prefix>:{<kind>|<rule>|<client key>}`: one hash tag per key so
//!   a script's keys share a Cluster slot; a TTL of the rule's window plus
//!   a margin on every write so idle keys vanish; long, binary or odd keys
//!   hashed to a fixed length.
//! - **Failure policy**, per store: [`FailurePolicy::Open`] admits,
//!   [`FailurePolicy::Closed`] denies, [`FailurePolicy::Fallback`] limits
//!   in process memory. Every call has a short timeout (default 50 ms),
//!   and a circuit breaker stops calling a dead Redis — probing it every
//!   half second — so an outage adds neither seconds of latency nor 5xx
//!   to the protected service. Faults are logged at most once a second and
//!   counted, in [`RedisStore::stats`] and as the metric
//!   `tollgate_store_calls_total{store="redis", result=ok|error|timeout|skipped}`
//!   (registered when the store is built: install the recorder first).
//!
//! ```no_run
//! use tollgate_core::{Limit, Limiter, Rate, Rule, Store};
//! use tollgate_redis::{FailurePolicy, RedisStore};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let store = RedisStore::builder("redis://127.0.0.1:6379")
//!     .prefix("myapp")
//!     .failure_policy(FailurePolicy::fallback())
//!     .build()?;
//! let limiter = store.limiter(&Rule::new("per-key", Limit::gcra(Rate::per_second(10), 20))?)?;
//! let decision = limiter.decide(b"api-key-1", 1).await?;
//! assert!(decision.is_allowed());
//! # Ok(())
//! # }
//! ```
//!
//! Connection strings: one `redis://` (or `rediss://`) URL is a standalone
//! server (auto-reconnecting, multiplexed); several, comma-separated, or
//! one with the scheme `redis+cluster://`, are the seed nodes of a Redis
//! Cluster.
//!
//! # Features
//!
//! | feature | what it adds |
//! |---|---|
//! | `testing` | [`testing`]: start `redis-server` processes (standalone, cluster) for tests |
//!
//! [tollgate]: https://docs.rs/tollgate

#![forbid(unsafe_code)]
#![cfg_attr(
    test,
    allow(
        clippy::unwrap_used,
        clippy::panic,
        clippy::indexing_slicing,
        clippy::arithmetic_side_effects
    )
)]

mod breaker;
mod conn;
mod key;
mod scripts;
#[cfg(feature = "testing")]
pub mod testing;

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tollgate_core::{
    Acquire, Clock, ConcurrencyLimiter, ConcurrencyRule, ConfigError, Decision, Lease, Limiter,
    Outcome, Rule, Store, StoreError, StoreErrorKind,
};
use tollgate_memory::{MemoryConcurrencyLimiter, MemoryLimiter, MemoryStore};

use crate::breaker::{now_nanos, Breaker, Pass};
use crate::conn::Conn;
use crate::scripts::{Reply, Script};

/// A boxed future (the Redis path: network-bound, so one box is noise).
pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// What a limiter answers when Redis does not.
#[derive(Debug, Clone)]
pub enum FailurePolicy {
    /// Admit every request (availability first). The default.
    Open,
    /// Deny every request, retry after a second (protection first).
    Closed,
    /// Decide in this process's memory: each instance enforces the limit
    /// on its own until Redis is back.
    Fallback(MemoryStore),
}

impl FailurePolicy {
    /// [`FailurePolicy::Fallback`] with a fresh default [`MemoryStore`].
    pub fn fallback() -> Self {
        Self::Fallback(MemoryStore::new())
    }
}

/// Counters of store faults, for dashboards and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RedisStats {
    /// Calls that reached Redis and got an answer.
    pub ok: u64,
    /// Calls that failed: error or unreadable reply.
    pub errors: u64,
    /// Calls that took longer than the timeout.
    pub timeouts: u64,
    /// Calls not made because the breaker was open.
    pub skipped: u64,
}

/// One outcome of a store call: counted for [`RedisStore::stats`] and
/// exported as `tollgate_store_calls_total{store="redis", result=...}`.
#[derive(Debug)]
struct Tally {
    count: AtomicU64,
    metric: metrics::Counter,
}

impl Tally {
    fn new(result: &'static str) -> Self {
        Self {
            count: AtomicU64::new(0),
            metric: metrics::counter!(
                "tollgate_store_calls_total",
                "store" => "redis",
                "result" => result
            ),
        }
    }

    fn add(&self) {
        self.count.fetch_add(1, Ordering::Relaxed);
        self.metric.increment(1);
    }

    fn get(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }
}

#[derive(Debug)]
struct Counters {
    ok: Tally,
    errors: Tally,
    timeouts: Tally,
    skipped: Tally,
    last_log: AtomicU64,
}

impl Counters {
    fn register() -> Self {
        metrics::describe_counter!(
            "tollgate_store_calls_total",
            "Calls to the Redis store by result: ok, error, timeout, skipped (breaker open)"
        );
        Self {
            ok: Tally::new("ok"),
            errors: Tally::new("error"),
            timeouts: Tally::new("timeout"),
            skipped: Tally::new("skipped"),
            last_log: AtomicU64::new(0),
        }
    }
}

type SharedClock = Arc<dyn Clock>;

struct Inner {
    conn: Conn,
    prefix: Arc<str>,
    timeout: Duration,
    policy: FailurePolicy,
    client_time: Option<SharedClock>,
    breaker: Breaker,
    counters: Counters,
}

/// The Redis store. Cheap to clone; clones share connections.
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.inner.prefix)
            .field("timeout", &self.inner.timeout)
            .field("policy", &self.inner.policy)
            .field("breaker_open", &self.inner.breaker.is_open())
            .finish_non_exhaustive()
    }
}

/// Builds a [`RedisStore`]; see [`RedisStore::builder`].
pub struct RedisStoreBuilder {
    url: String,
    prefix: String,
    timeout: Duration,
    policy: FailurePolicy,
    client_time: Option<SharedClock>,
    breaker_threshold: u32,
    breaker_cooldown: Duration,
}

impl fmt::Debug for RedisStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStoreBuilder")
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// A builder for the Redis (or Redis Cluster) at `url`.
    pub fn builder(url: &str) -> RedisStoreBuilder {
        RedisStoreBuilder {
            url: url.to_owned(),
            prefix: "tollgate".to_owned(),
            timeout: Duration::from_millis(50),
            policy: FailurePolicy::Open,
            client_time: None,
            breaker_threshold: 3,
            breaker_cooldown: Duration::from_millis(500),
        }
    }

    /// Fault counters since the store was built.
    pub fn stats(&self) -> RedisStats {
        let c = &self.inner.counters;
        RedisStats {
            ok: c.ok.get(),
            errors: c.errors.get(),
            timeouts: c.timeouts.get(),
            skipped: c.skipped.get(),
        }
    }

    /// Whether the breaker is open (Redis is being skipped).
    pub fn breaker_open(&self) -> bool {
        self.inner.breaker.is_open()
    }
}

impl RedisStoreBuilder {
    /// Key prefix (default `tollgate`); ASCII letters, digits, `-_.:`.
    pub fn prefix(mut self, prefix: &str) -> Self {
        self.prefix = prefix.to_owned();
        self
    }

    /// Timeout of every store call (default 50 ms).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// What to answer when Redis does not (default [`FailurePolicy::Open`]).
    pub fn failure_policy(mut self, policy: FailurePolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Pass this clock's time to the scripts instead of reading Redis's
    /// `TIME`: for hosted variants that forbid `TIME` in scripts, and for
    /// tests on a manual clock. Every instance must then read the same
    /// time on the same origin — nanoseconds since 2023-11-14T22:13:20Z
    /// (Unix 1,700,000,000), as the scripts count — and keep its clock in
    /// sync. [`SystemClock`](tollgate_core::SystemClock) does not qualify:
    /// its origin is per process.
    pub fn client_time(mut self, clock: impl Clock) -> Self {
        self.client_time = Some(Arc::new(clock));
        self
    }

    /// Consecutive failures that open the breaker (default 3), and how long
    /// it stays open before one probe (default 500 ms).
    pub fn breaker(mut self, threshold: u32, cooldown: Duration) -> Self {
        self.breaker_threshold = threshold;
        self.breaker_cooldown = cooldown;
        self
    }

    /// Validates the settings and prepares the connection. Does not wait
    /// for Redis: a store built while Redis is down follows its failure
    /// policy until Redis answers. Must be called inside a Tokio runtime
    /// (the connection runs as a task); outside one it returns an error.
    pub fn build(self) -> Result<RedisStore, ConfigError> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(ConfigError::new(
                "runtime",
                "build the Redis store inside a Tokio runtime",
            ));
        }
        if self.prefix.is_empty()
            || self.prefix.len() > 64
            || !self
                .prefix
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
        {
            return Err(ConfigError::new(
                "prefix",
                "must be 1 to 64 ASCII letters, digits, '-', '_', '.' or ':'",
            ));
        }
        if self.timeout.is_zero() {
            return Err(ConfigError::new("timeout", "must be longer than zero"));
        }
        if self.breaker_threshold == 0 {
            return Err(ConfigError::new("breaker_threshold", "must be at least 1"));
        }
        let conn = Conn::new(&self.url, self.timeout)?;
        Ok(RedisStore {
            inner: Arc::new(Inner {
                conn,
                prefix: self.prefix.into(),
                timeout: self.timeout,
                policy: self.policy,
                client_time: self.client_time,
                breaker: Breaker::new(self.breaker_threshold, self.breaker_cooldown),
                counters: Counters::register(),
            }),
        })
    }
}

/// TTL margin on every key beyond its rule's window.
const TTL_MARGIN_MS: u64 = 1_000;

fn ttl_ms(window_nanos: u64) -> u64 {
    window_nanos
        .div_ceil(1_000_000)
        .saturating_add(TTL_MARGIN_MS)
}

impl Inner {
    fn now_arg(&self) -> String {
        self.client_time
            .as_ref()
            .map(|c| c.now().to_string())
            .unwrap_or_default()
    }

    /// Runs `script` with the breaker and the timeout; `Err` if Redis did
    /// not answer (the caller applies the failure policy).
    async fn run(
        &self,
        script: &Script,
        keys: &[&str],
        args: &[&str],
    ) -> Result<Reply, StoreError> {
        let attempt = self.breaker.enter(now_nanos());
        if attempt.pass() == Pass::Skip {
            self.counters.skipped.add();
            return Err(StoreError::new(
                StoreErrorKind::Unavailable,
                "circuit breaker open",
            ));
        }
        let result =
            match tokio::time::timeout(self.timeout, self.conn.invoke(script, keys, args)).await {
                Ok(Ok(reply)) => Ok(reply),
                Ok(Err(e)) if e.is_timeout() => {
                    self.counters.timeouts.add();
                    Err(StoreError::new(StoreErrorKind::Timeout, e.to_string()))
                }
                Ok(Err(e)) => {
                    self.counters.errors.add();
                    Err(StoreError::new(StoreErrorKind::Unavailable, e.to_string()))
                }
                Err(_) => {
                    self.counters.timeouts.add();
                    Err(StoreError::new(
                        StoreErrorKind::Timeout,
                        format!("no answer within {:?}", self.timeout),
                    ))
                }
            };
        match &result {
            Ok(_) => {
                self.counters.ok.add();
                attempt.success();
            }
            Err(e) => {
                let opened = attempt.failure(now_nanos());
                self.log_fault(e, opened);
            }
        }
        result
    }

    /// Logs a fault at most once a second (an outage fails every call).
    fn log_fault(&self, error: &StoreError, opened: bool) {
        let second = now_nanos() / 1_000_000_000;
        let last = self.counters.last_log.swap(second, Ordering::Relaxed);
        if last != second || opened {
            tracing::warn!(
                target: "tollgate::redis",
                %error,
                breaker_open = self.breaker.is_open(),
                policy = ?self.policy,
                "redis store call failed; applying the failure policy"
            );
        }
    }
}

enum Fallback {
    Open,
    Closed,
    Memory(MemoryLimiter),
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
fn closed_decision(limit: u64) -> Decision {
    Decision {
        outcome: Outcome::Deny {
            retry_after: 1_000_000_000,
        },
        limit,
        remaining: 0,
        reset_after: 1_000_000_000,
    }
}

impl Fallback {
    fn decide(&self, rule: &Rule, key: &[u8], cost: u32) -> Decision {
        match self {
            Fallback::Open => open_decision(rule.capacity()),
            Fallback::Closed => closed_decision(rule.capacity()),
            Fallback::Memory(m) => m.decide_now(key, cost),
        }
    }
}

/// A rate rule bound to a [`RedisStore`]. Cheap to clone.
#[derive(Clone)]
pub struct RedisLimiter {
    inner: Arc<LimiterInner>,
}

struct LimiterInner {
    store: Arc<Inner>,
    rule: Rule,
    script: &'static Script,
    params: Vec<String>,
    ttl: String,
    fallback: Fallback,
}

impl fmt::Debug for RedisLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLimiter")
            .field("rule", &self.inner.rule)
            .finish_non_exhaustive()
    }
}

impl LimiterInner {
    /// Runs this rule's script in `mode` for `key`.
    async fn call(&self, mode: &str, key: &[u8], cost: u32) -> Result<Reply, StoreError> {
        let rkey = key::redis_key(&self.store.prefix, key::Kind::Rate, self.rule.name(), key);
        let cost = cost.to_string();
        let now = self.store.now_arg();
        let mut args: Vec<&str> = Vec::with_capacity(self.params.len().saturating_add(4));
        args.extend([mode, cost.as_str(), now.as_str(), self.ttl.as_str()]);
        args.extend(self.params.iter().map(String::as_str));
        self.store.run(self.script, &[&rkey], &args).await
    }
}

impl Limiter for RedisLimiter {
    type DecideFuture = BoxFuture<Result<Decision, StoreError>>;
    type RefundFuture = BoxFuture<Result<(), StoreError>>;

    fn rule(&self) -> &Rule {
        &self.inner.rule
    }

    fn decide(&self, key: &[u8], cost: u32) -> Self::DecideFuture {
        let this = Arc::clone(&self.inner);
        let key = key.to_vec();
        Box::pin(async move {
            let reply = this.call("d", &key, cost).await;
            // A fault or an unreadable reply: the failure policy answers.
            Ok(reply
                .ok()
                .and_then(|r| r.decision())
                .unwrap_or_else(|| this.fallback.decide(&this.rule, &key, cost)))
        })
    }

    fn refund(&self, key: &[u8], cost: u32) -> Self::RefundFuture {
        let this = Arc::clone(&self.inner);
        let key = key.to_vec();
        Box::pin(async move {
            match this.call("r", &key, cost).await {
                Ok(_) => Ok(()),
                Err(e) => {
                    if let Fallback::Memory(m) = &this.fallback {
                        m.refund_now(&key, cost);
                        return Ok(());
                    }
                    Err(e)
                }
            }
        })
    }
}

/// A concurrency rule bound to a [`RedisStore`]: leases in a sorted set.
#[derive(Clone)]
pub struct RedisConcurrencyLimiter {
    store: Arc<Inner>,
    rule: ConcurrencyRule,
    params: Arc<[String]>,
    ttl: String,
    fallback: Option<MemoryConcurrencyLimiter>,
}

impl fmt::Debug for RedisConcurrencyLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisConcurrencyLimiter")
            .field("rule", &self.rule)
            .finish_non_exhaustive()
    }
}

/// Leases granted by the in-memory fallback carry this bit, so releasing
/// one after Redis comes back goes to the store that granted it.
const FALLBACK_LEASE: u64 = 1 << 63;

impl RedisConcurrencyLimiter {
    fn keys(&self, key: &[u8]) -> (String, String) {
        let k = key::redis_key(
            &self.store.prefix,
            key::Kind::Concurrency,
            self.rule.name(),
            key,
        );
        let ids = format!("{k}:ids");
        (k, ids)
    }

    async fn call(&self, mode: &str, key: &[u8], arg: &str) -> Result<Reply, StoreError> {
        let (k, ids) = self.keys(key);
        let now = self.store.now_arg();
        let mut args: Vec<&str> = Vec::with_capacity(self.params.len().saturating_add(4));
        args.extend([mode, arg, now.as_str(), self.ttl.as_str()]);
        args.extend(self.params.iter().map(String::as_str));
        self.store
            .run(&scripts::SEMAPHORE, &[&k, &ids], &args)
            .await
    }

    fn fail(&self, key: &[u8], permits: u32) -> Acquire {
        let limit = u64::from(self.rule.semaphore().max());
        match (&self.fallback, &self.store.policy) {
            (Some(m), _) => {
                let mut a = m.acquire_now(key, permits);
                if let Some(lease) = &mut a.lease {
                    lease.id |= FALLBACK_LEASE;
                }
                a
            }
            (None, FailurePolicy::Closed) => Acquire {
                decision: closed_decision(limit),
                lease: None,
            },
            // Fail open: admit under a lease nobody needs to release.
            (None, _) => Acquire {
                decision: open_decision(limit),
                lease: Some(Lease {
                    id: FALLBACK_LEASE,
                    permits,
                }),
            },
        }
    }

    fn lease_op(
        &self,
        key: &[u8],
        lease: Lease,
        mode: &'static str,
    ) -> BoxFuture<Result<bool, StoreError>> {
        let this = self.clone();
        let key = key.to_vec();
        Box::pin(async move {
            if lease.id & FALLBACK_LEASE != 0 {
                let local = Lease {
                    id: lease.id & !FALLBACK_LEASE,
                    permits: lease.permits,
                };
                return Ok(match (&this.fallback, mode) {
                    (Some(m), "x") => m.release_now(&key, local),
                    (Some(m), _) => m.renew_now(&key, local),
                    (None, _) => true,
                });
            }
            let member = format!("{}:{}", lease.id, lease.permits);
            Ok(this.call(mode, &key, &member).await?.flag())
        })
    }
}

impl ConcurrencyLimiter for RedisConcurrencyLimiter {
    type AcquireFuture = BoxFuture<Result<Acquire, StoreError>>;
    type ReleaseFuture = BoxFuture<Result<bool, StoreError>>;

    fn rule(&self) -> &ConcurrencyRule {
        &self.rule
    }

    fn acquire(&self, key: &[u8], permits: u32) -> Self::AcquireFuture {
        let this = self.clone();
        let key = key.to_vec();
        Box::pin(async move {
            match this.call("a", &key, &permits.to_string()).await {
                Ok(reply) => Ok(reply
                    .acquire(permits)
                    .unwrap_or_else(|| this.fail(&key, permits))),
                Err(_) => Ok(this.fail(&key, permits)),
            }
        })
    }

    fn release(&self, key: &[u8], lease: Lease) -> Self::ReleaseFuture {
        self.lease_op(key, lease, "x")
    }

    fn renew(&self, key: &[u8], lease: Lease) -> Self::ReleaseFuture {
        self.lease_op(key, lease, "n")
    }
}

impl Store for RedisStore {
    type Limiter = RedisLimiter;
    type ConcurrencyLimiter = RedisConcurrencyLimiter;

    fn limiter(&self, rule: &Rule) -> Result<RedisLimiter, ConfigError> {
        scripts::check_precision(rule.algorithm())?;
        let (script, params) = scripts::for_algorithm(rule.algorithm());
        let fallback = match &self.inner.policy {
            FailurePolicy::Open => Fallback::Open,
            FailurePolicy::Closed => Fallback::Closed,
            FailurePolicy::Fallback(m) => Fallback::Memory(m.limiter(rule)?),
        };
        Ok(RedisLimiter {
            inner: Arc::new(LimiterInner {
                store: Arc::clone(&self.inner),
                rule: rule.clone(),
                script,
                params,
                ttl: ttl_ms(scripts::state_lifetime(rule.algorithm())).to_string(),
                fallback,
            }),
        })
    }

    fn concurrency_limiter(
        &self,
        rule: &ConcurrencyRule,
    ) -> Result<RedisConcurrencyLimiter, ConfigError> {
        let sem = rule.semaphore();
        let fallback = match &self.inner.policy {
            FailurePolicy::Fallback(m) => Some(m.concurrency_limiter(rule)?),
            _ => None,
        };
        Ok(RedisConcurrencyLimiter {
            store: Arc::clone(&self.inner),
            rule: rule.clone(),
            params: vec![sem.max().to_string(), sem.lease_ttl().to_string()].into(),
            ttl: ttl_ms(sem.lease_ttl()).to_string(),
            fallback,
        })
    }
}
