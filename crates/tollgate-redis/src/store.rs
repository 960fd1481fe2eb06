//! The store and its builder.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tollgate_core::{
    Clock, ConcurrencyRule, ConfigError, QuotaRule, QuotaStore, RetryBudgetRule, RetryBudgetStore,
    Rule, Store,
};

use crate::backend::{Backend, BackendConfig, RedisStats, SharedClock};
use crate::breaker::Breaker;
use crate::concurrency::RedisConcurrencyLimiter;
use crate::conn::Conn;
use crate::keeper::LeaseKeeper;
use crate::leases::LeaseIds;
use crate::policy::FailurePolicy;
use crate::quota::RedisQuotaLimiter;
use crate::rate::RedisLimiter;
use crate::retry_budget::RedisRetryBudget;

/// The longest audit stream a store keeps (entries): a few gigabytes of
/// Redis memory at most.
const MAX_AUDIT_LEN: usize = 10_000_000;

/// The Redis store. Cheap to clone; clones share connections and the
/// lease task.
#[derive(Clone)]
pub struct RedisStore {
    backend: Arc<Backend>,
    keeper: LeaseKeeper,
    ids: Arc<LeaseIds>,
    /// The runtime the store was built in: retry budgets' deposits run
    /// there as tasks, whoever calls them.
    runtime: tokio::runtime::Handle,
    /// Binding through [`Store::rebinding`] or [`Store::checking`]: the
    /// fallback memory store (if any) binds that way too.
    rebinding: crate::policy::Rebind,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.backend.prefix)
            .field("timeout", &self.backend.timeout)
            .field("policy", &self.backend.policy)
            .field("breaker_open", &self.backend.breaker_open())
            .finish_non_exhaustive()
    }
}

/// Builds a [`RedisStore`]; see [`RedisStore::builder`].
pub struct RedisStoreBuilder {
    url: String,
    prefix: Option<String>,
    name: Option<String>,
    timeout: Duration,
    connect_timeout: Duration,
    policy: FailurePolicy,
    client_time: Option<SharedClock>,
    breaker_threshold: u32,
    breaker_cooldown: Duration,
    lease_renewal: bool,
    tls_root: Option<Vec<u8>>,
    key_secret: Option<Vec<u8>>,
}

impl fmt::Debug for RedisStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStoreBuilder")
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("lease_renewal", &self.lease_renewal)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// A builder for the Redis (or Redis Cluster) at `url`. Name your
    /// service with [`prefix`](RedisStoreBuilder::prefix): there is no
    /// default, so that two services never share keys — and budgets.
    pub fn builder(url: &str) -> RedisStoreBuilder {
        RedisStoreBuilder {
            url: url.to_owned(),
            prefix: None,
            name: None,
            key_secret: None,
            timeout: Duration::from_millis(50),
            connect_timeout: Duration::from_secs(2),
            policy: FailurePolicy::Open,
            client_time: None,
            breaker_threshold: 3,
            breaker_cooldown: Duration::from_millis(500),
            lease_renewal: true,
            tls_root: None,
        }
    }

    /// Fault counters since the store was built.
    pub fn stats(&self) -> RedisStats {
        self.backend.stats()
    }

    /// An audit stream named `name` under this store's prefix, kept to
    /// about `maxlen` entries (`XADD ... MAXLEN ~`; 1 to 10^7), fed through
    /// a queue of `capacity` records (1 to 2^20); see
    /// [`RedisAudit`](crate::RedisAudit). Errors name `maxlen` or
    /// `capacity` (a `maxlen` of 0 would keep nothing, a huge one would
    /// let the stream grow without bound). Asked again for the same
    /// stream (a reloaded policy) while a sink of it lives, it gives that
    /// sink: one queue and one task, not one per reload.
    pub fn audit_stream(
        &self,
        name: &str,
        maxlen: usize,
        capacity: usize,
    ) -> Result<crate::RedisAudit, ConfigError> {
        if !(1..=MAX_AUDIT_LEN).contains(&maxlen) {
            return Err(ConfigError::new(
                "maxlen",
                "must be 1 to 10,000,000 entries",
            ));
        }
        if !(1..=1 << 20).contains(&capacity) {
            return Err(ConfigError::new("capacity", "must be 1 to 2^20 records"));
        }
        let mut kept = self
            .backend
            .audits
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let key = (name.to_owned(), maxlen, capacity);
        if let Some(live) = kept.get(&key).and_then(crate::audit::Kept::upgrade) {
            return Ok(live);
        }
        // Streams no sink holds any more are forgotten.
        kept.retain(|_, k| k.upgrade().is_some());
        let audit = crate::RedisAudit::spawn(
            Arc::clone(&self.backend),
            &self.runtime,
            name.to_owned(),
            maxlen,
            capacity,
        );
        kept.insert(key, audit.keep());
        Ok(audit)
    }

    /// Whether a breaker is open (Redis is being skipped for some keys: on
    /// a Cluster, those of one or more masters).
    pub fn breaker_open(&self) -> bool {
        self.backend.breaker_open()
    }

    /// Waits until every concurrency release handed to this store before
    /// the call is done (or has failed: its lease then lapses after its
    /// TTL). Releases run in the background — a guard releases from
    /// `Drop` — so this is the way to know they ran: before a graceful
    /// shutdown, or in tests.
    pub async fn flush(&self) {
        self.keeper.flush().await;
    }

    /// Renews now every lease this store granted and has not released, as
    /// its lease task does on its own every third of a rule's lease TTL
    /// (unless [turned off](RedisStoreBuilder::lease_renewal)); returns
    /// when done. A renewal never brings back a lease that lapsed.
    pub async fn renew_leases(&self) {
        self.keeper.renew_now().await;
    }
}

impl RedisStore {
    /// The name this store gives the key of client `key` under the rule
    /// `rule` of the format tagged `tag` (`gcra1`, `sem2`, `q1`, ...): for
    /// tests that plant a value where a script will read it.
    #[cfg(feature = "testing")]
    pub fn key_name(&self, tag: &str, rule: &str, key: &[u8]) -> String {
        self.backend.names.name_of(tag, rule, key)
    }
}

impl RedisStoreBuilder {
    /// The prefix of every key this store writes: name your service (and
    /// environment) here, e.g. `billing-prod`. Required: services that
    /// share a prefix share every budget of the rules they both name.
    /// 1 to 64 ASCII letters, digits, `-_.:`.
    pub fn prefix(mut self, prefix: &str) -> Self {
        self.prefix = Some(prefix.to_owned());
        self
    }

    /// The store's name in its metrics (the `name` label of
    /// `tollgate_store_calls_total`, `tollgate_store_call_seconds` and
    /// `tollgate_store_breaker_open`); default: the prefix. Give each of
    /// two stores on one prefix a name of its own (a [`Tiered`](crate::Tiered)
    /// pair: `regional`, `global`), so that their faults read apart. 1 to 64
    /// ASCII letters, digits, `-_.:`.
    pub fn name(mut self, name: &str) -> Self {
        self.name = Some(name.to_owned());
        self
    }

    /// The secret that key names are keyed by (16 to 64 bytes; the same on
    /// every instance of the fleet, or they do not share budgets): a
    /// client key reaches Redis only as the first 16 bytes of
    /// HMAC-SHA-256 under it, which nobody without the secret can reverse
    /// — not even by trying every IPv4 address. Without one, names are
    /// SHA-256 of the prefix and the key: no key is stored as it is, but a
    /// small key space (addresses) can be enumerated. Changing the secret
    /// renames every key: budgets start afresh.
    pub fn key_secret(mut self, secret: impl Into<Vec<u8>>) -> Self {
        self.key_secret = Some(secret.into());
        self
    }

    /// Timeout of every store call (default 50 ms): how long a decision
    /// may wait for Redis before the failure policy answers.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Trusts the CA certificate `pem` (PEM) for `rediss://` URLs, instead
    /// of the system's roots (feature `tls`): a private CA, or a test's
    /// self-signed one. For a standalone `rediss://` URL only: building a
    /// store with it and a cluster or Sentinel URL is an error naming
    /// `tls_root_cert` (their connections use the system's roots, or
    /// `SSL_CERT_FILE`: `rediss+sentinel://` too).
    #[cfg(feature = "tls")]
    pub fn tls_root_cert(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls_root = Some(pem.into());
        self
    }

    /// Timeout of each attempt to establish a connection (default 2 s).
    /// Connecting may take longer than a call may wait (TLS, a cluster's
    /// slot map); calls made meanwhile follow the failure policy after
    /// their own [`timeout`](Self::timeout), and the attempt goes on.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// What to answer when Redis does not (default [`FailurePolicy::Open`]).
    pub fn failure_policy(mut self, policy: FailurePolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Pass this clock's Unix time ([`Clock::unix_now`], ns since
    /// 1970-01-01T00:00:00Z) to the scripts instead of reading Redis's
    /// `TIME`: for hosted variants that forbid `TIME` in scripts, and for
    /// tests on a manual clock. The clock must read Unix time, and every
    /// instance's must agree: decisions then follow each instance's clock,
    /// so skew between instances (or a clock stepped back) changes them.
    /// [`SystemClock`](tollgate_core::SystemClock) qualifies — its
    /// `unix_now` is the operating system's wall clock — on hosts kept in
    /// sync (NTP); a [`ManualClock`](tollgate_core::ManualClock) set to a
    /// date ([`at_unix`](tollgate_core::ManualClock::at_unix)) does for
    /// tests.
    pub fn client_time(mut self, clock: impl Clock) -> Self {
        self.client_time = Some(Arc::new(clock));
        self
    }

    /// Consecutive failures that open the breaker (default 3), and how long
    /// it stays open before one probe (default 500 ms). On a Cluster each
    /// master has a breaker of its own (by the slot map).
    pub fn breaker(mut self, threshold: u32, cooldown: Duration) -> Self {
        self.breaker_threshold = threshold;
        self.breaker_cooldown = cooldown;
        self
    }

    /// Whether the store renews, on its own, the concurrency leases it
    /// granted and has not released: every third of the rule's lease TTL,
    /// on the Tokio clock (default `true`). Off, a lease lapses after its
    /// TTL unless released first — work that may run longer than the TTL
    /// then loses its permits — and [`RedisStore::renew_leases`] renews on
    /// demand. Tests on a manual clock turn it off, so that real time does
    /// not renew leases whose expiry they are watching.
    pub fn lease_renewal(mut self, on: bool) -> Self {
        self.lease_renewal = on;
        self
    }

    /// Validates the settings and prepares the connection. Does not wait
    /// for Redis: a store built while Redis is down follows its failure
    /// policy until Redis answers. Must be called inside a Tokio runtime
    /// (the connection and the lease task run as tasks); outside one it
    /// returns an error, as it does without a [`prefix`](Self::prefix).
    ///
    /// Build it on the runtime that serves: the lease task (concurrency
    /// leases' releases and renewals) runs on the runtime the store was
    /// built on, and if that runtime ends the store goes on deciding, but
    /// its leases are neither released nor renewed — each holds its
    /// permits for its lease TTL after its request ends — and a warning
    /// says so once. (Connections are made on the caller's runtime and
    /// survive it.)
    pub fn build(self) -> Result<RedisStore, ConfigError> {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return Err(ConfigError::new(
                "runtime",
                "build the Redis store inside a Tokio runtime",
            ));
        };
        let Some(prefix) = self.prefix else {
            return Err(ConfigError::new(
                "prefix",
                "name your service: call .prefix(\"my-service\") so that its keys, \
                 and budgets, are not shared with other services on this Redis",
            ));
        };
        for (field, value) in [("prefix", Some(&prefix)), ("name", self.name.as_ref())] {
            if value.is_some_and(|v| !plain_name(v)) {
                return Err(ConfigError::new(field, PLAIN_NAME));
            }
        }
        if self
            .key_secret
            .as_ref()
            .is_some_and(|s| !(16..=64).contains(&s.len()))
        {
            return Err(ConfigError::new("key_secret", "must be 16 to 64 bytes"));
        }
        if self.timeout.is_zero() {
            return Err(ConfigError::new("timeout", "must be longer than zero"));
        }
        if self.connect_timeout.is_zero() {
            return Err(ConfigError::new(
                "connect_timeout",
                "must be longer than zero",
            ));
        }
        self.policy.validate()?;
        if self.breaker_threshold == 0 {
            return Err(ConfigError::new("breaker_threshold", "must be at least 1"));
        }
        let backend = Arc::new(Backend::new(BackendConfig {
            conn: Conn::new(
                &self.url,
                self.connect_timeout,
                self.timeout,
                self.tls_root.as_deref(),
            )?,
            names: crate::key::KeyNames::new(prefix.as_str().into(), self.key_secret.as_deref()),
            name: self.name.unwrap_or_else(|| prefix.clone()).into(),
            prefix: prefix.into(),
            timeout: self.timeout,
            policy: self.policy,
            client_time: self.client_time,
            breaker: {
                let (threshold, cooldown) = (self.breaker_threshold, self.breaker_cooldown);
                Box::new(move || Breaker::new(threshold, cooldown))
            },
        }));
        let keeper = LeaseKeeper::spawn(Arc::clone(&backend), self.lease_renewal);
        Ok(RedisStore {
            backend,
            keeper,
            ids: Arc::new(LeaseIds::new()),
            runtime,
            rebinding: crate::policy::Rebind::No,
        })
    }
}

impl Store for RedisStore {
    type Limiter = RedisLimiter;
    type ConcurrencyLimiter = RedisConcurrencyLimiter;

    fn limiter(&self, rule: &Rule) -> Result<RedisLimiter, ConfigError> {
        RedisLimiter::new(Arc::clone(&self.backend), rule, self.rebinding)
    }

    fn call_timeout(&self) -> Option<Duration> {
        Some(self.backend.timeout)
    }

    /// State in Redis is kept by rule name and algorithm, and the scripts
    /// read it under whatever parameters they are given: new parameters go
    /// on from it. The fallback memory store (`FailurePolicy::Fallback`)
    /// rebinds as [`MemoryStore`](tollgate_memory::MemoryStore) does.
    fn rebinding(&self) -> Self {
        Self {
            rebinding: crate::policy::Rebind::Yes,
            ..self.clone()
        }
    }

    /// Binding on Redis changes nothing; the fallback memory store binds
    /// through its checking handle.
    fn checking(&self) -> Self {
        Self {
            rebinding: crate::policy::Rebind::Check,
            ..self.clone()
        }
    }

    fn concurrency_limiter(
        &self,
        rule: &ConcurrencyRule,
    ) -> Result<RedisConcurrencyLimiter, ConfigError> {
        RedisConcurrencyLimiter::new(
            Arc::clone(&self.backend),
            self.keeper.clone(),
            Arc::clone(&self.ids),
            rule,
            self.rebinding,
        )
    }

    /// Binds an escalation ladder, shared by every instance on this Redis
    /// with the same prefix (see [`RedisEscalation`](crate::RedisEscalation)).
    fn escalation(
        &self,
        rule: &tollgate_core::EscalationRule,
    ) -> Result<Arc<dyn tollgate_core::EscalationLimiter>, ConfigError> {
        let ladder = crate::escalation::RedisEscalation::new(
            Arc::clone(&self.backend),
            rule,
            self.rebinding,
        )?;
        Ok(Arc::new(crate::escalation::Shared(Arc::new(ladder))))
    }
}

impl QuotaStore for RedisStore {
    type QuotaLimiter = RedisQuotaLimiter;

    /// Binds a quota `rule`. Its state is shared by every instance on this
    /// Redis with the same prefix, and outlives their restarts: each key
    /// lives until the end of its longest period (plus a margin).
    fn quota_limiter(&self, rule: &QuotaRule) -> Result<RedisQuotaLimiter, ConfigError> {
        RedisQuotaLimiter::new(Arc::clone(&self.backend), rule, self.rebinding)
    }
}

impl RetryBudgetStore for RedisStore {
    type RetryBudgetLimiter = RedisRetryBudget;

    /// Binds a retry budget `rule`. Its budget is shared by every
    /// instance on this Redis with the same prefix; each key lives a
    /// window (plus a second) after its last deposit or withdrawal. See
    /// `RedisRetryBudget` for deposits (tasks on the store's runtime)
    /// and the failure policy.
    fn retry_budget(&self, rule: &RetryBudgetRule) -> Result<RedisRetryBudget, ConfigError> {
        RedisRetryBudget::new(Arc::clone(&self.backend), self.runtime.clone(), rule)
    }
}

/// Whether `s` can name a prefix or a metrics label: 1 to 64 ASCII
/// letters, digits, `-`, `_`, `.` or `:`.
pub(crate) fn plain_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
}

/// What [`plain_name`] allows, for errors.
pub(crate) const PLAIN_NAME: &str = "must be 1 to 64 ASCII letters, digits, '-', '_', '.' or ':'";
