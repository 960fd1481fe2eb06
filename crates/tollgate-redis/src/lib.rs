//! The Redis store of [tollgate]: one limit across a fleet, on standalone
//! Redis or Redis Cluster, calm when Redis dies.
//!
//! - **One round trip per decision.** Every algorithm of
//!   [`tollgate_core`] runs as one Lua script (`EVALSHA`, reloaded on
//!   `NOSCRIPT`), a port of the same math; the core's conformance suite
//!   runs against this store unchanged.
//! - **Redis's clock, exactly.** Scripts read `TIME`, so instances whose
//!   clocks disagree still decide alike. For hosted Redis variants that
//!   forbid `TIME` in scripts, [`RedisStoreBuilder::client_time`] passes
//!   the time as an argument instead. Either way the time is Unix time,
//!   and the scripts' arithmetic is exact to the nanosecond: Lua's
//!   numbers are doubles, which resolve only 256 ns at today's Unix times
//!   in ns, so the scripts never form one — they hold now as seconds and
//!   nanoseconds and compute with times relative to it, and store times
//!   as decimal nanoseconds. Hence the one limit on rules: every span of
//!   time a rule names (an interval, a window, a burst × interval, a
//!   lease TTL) is at most 2⁵¹ ns, about 26 days (budgets over months
//!   are calendar quotas).
//! - **Keys** are `<prefix>:{<format>|<rule>|<client key>}`: the prefix
//!   names the service ([`RedisStoreBuilder::prefix`] is required, so
//!   that two services never share budgets); the format is the
//!   algorithm and the version of its state's layout (`gcra1`, `tb1`,
//!   `fw1`, `swc1`, `swl1`, `lb1`, `sem2`, `q1`, `rb1`, `esc1`), so that a rule whose algorithm
//!   changes, or instances of two versions, start afresh instead of
//!   misreading each other's state — and a script that meets state it
//!   does not recognise (another type, another layout) treats it as
//!   absent rather than failing. One hash tag per key, so a script's keys
//!   share a Cluster slot; a TTL of the rule's window plus a margin on
//!   every write, so idle keys vanish; no client key in a name as it is:
//!   each is hashed to a fixed length — keyed (HMAC-SHA-256) under the
//!   fleet's [`key_secret`](RedisStoreBuilder::key_secret), so nobody can
//!   read an API key or an address back from `SCAN`, `MONITOR` or a dump.
//! - **Several rate rules on one request** (a policy) are decided in one
//!   script call per hash slot ([`Limiter::decide_joint`](tollgate_core::Limiter::decide_joint)):
//!   on a standalone or Sentinel store one call for all the rules, which
//!   charges every rule or — an enforced rule denies — none, so a denial
//!   needs no refund. On Cluster, rules in one slot share a call; since
//!   each rule's key has its own hash tag, that is seldom, and rules in
//!   other slots are decided side by side and refunded by the caller on a
//!   denial. Where the failure policy's memory answered, a denial's
//!   refund goes to that memory. (`HotKeys` and the tiered store decide
//!   rule by rule.)
//! - **Concurrency permits are leases** with an expiry (the core's
//!   [`Semaphore`](tollgate_core::Semaphore)): per client key, a sorted set
//!   of leases by expiry and a hash counting the permits they hold, so
//!   acquire, release and `held` cost O(log n) in the key's leases
//!   (amortised: a key never idle for 26 days is re-based once, and a
//!   count Redis evicted is recounted once, each O(n)), and a
//!   lapsed lease is dropped once. The store chooses lease ids (random,
//!   never repeated by one store, refused by the script if a live lease
//!   has one), so a lease is renewed and released only by its holder, even
//!   after Redis lost its state, and a lease whose grant arrived after the
//!   timeout is released rather than left to lapse. Lease TTLs are at
//!   least a second. One background task per store performs
//!   releases — [`release`](tollgate_core::ConcurrencyLimiter::release)
//!   hands the lease over at once, so a guard can release from `Drop` —
//!   and renews, every third of the rule's lease TTL, every lease the store
//!   granted and has not released, in one script call per key. Long work
//!   keeps its permits; the permits of an instance that died lapse within
//!   a lease TTL. When Redis loses a key whole (a failover that lost the
//!   write, a restart without persistence), the holders' next renewals
//!   count their leases again, as far as `max` allows; until then, and
//!   where another acquire came first, new requests may take permits
//!   that running work still holds (at most `max` more, for as long as
//!   that work runs). [`RedisStore::flush`] waits for queued releases;
//!   [`RedisStoreBuilder::lease_renewal`] turns renewal off (tests on a
//!   manual clock).
//! - **Calendar quotas** ([`QuotaStore`](tollgate_core::QuotaStore)): one
//!   hash per rule and key, a window per period; the script finds the
//!   periods' bounds on Redis's `TIME` exactly as
//!   [`calendar`](tollgate_core::calendar) does (calendar months and
//!   years, ISO weeks, fixed offsets), and the key lives until the end of
//!   its longest period plus a minute, so instances that restart lose
//!   nothing and idle keys vanish.
//! - **Retry budgets** ([`RetryBudgetStore`](tollgate_core::RetryBudgetStore)):
//!   one hash per rule and key holding the window's ten slots, one
//!   script call per deposit and per withdrawal, the core's
//!   [`RetryBudget`](tollgate_core::RetryBudget) arithmetic exactly; the
//!   whole fleet shares one budget. A deposit runs as a task on the
//!   store's runtime, so a caller need not wait for it; the key lives a
//!   window (plus a second) after its last write.
//! - **Failure policy**, per store: [`FailurePolicy::Open`] admits,
//!   [`FailurePolicy::Closed`] denies, [`FailurePolicy::Fallback`] limits
//!   in process memory (and releases there the leases it granted, even
//!   after Redis is back): each instance the whole limit, or its share of
//!   it with [`FailurePolicy::fallback_share`]. For a retry budget, Open grants every retry
//!   (as with no budget), Closed none, Fallback spends the process's own
//!   budget — the one to choose, see [`RedisRetryBudget`]. Every call has a short timeout (default 50 ms;
//!   connecting has its own, default 2 s), and a circuit breaker stops
//!   calling a dead Redis — probing it every half second — so an outage
//!   adds neither seconds of latency nor 5xx to the protected service; a
//!   lease that cannot be released or renewed lapses after its TTL. On a
//!   Cluster there is a breaker (and a count of hung calls) per master, by
//!   the slot map each connection reads (`CLUSTER SLOTS`; fixed ranges of
//!   256 slots until then): a lost or stalled master opens its own breaker
//!   only, and keys on the other masters go on deciding on Redis.
//!   Faults are logged at most once a second and counted, in
//!   [`RedisStore::stats`] and as the metric
//!   `tollgate_store_calls_total{store="redis", result=ok|error|timeout|skipped}`,
//!   with each call's time in `tollgate_store_call_seconds{store="redis"}`
//!   (both also per node, for shard balance:
//!   `tollgate_store_node_calls_total` and
//!   `tollgate_store_node_call_seconds`, `node` a Cluster master's
//!   address, registered at its first call),
//!   and `tollgate_store_breaker_open{store="redis"}` the share of
//!   breakers open (1 while the one breaker of a standalone or Sentinel
//!   store is open; on a Cluster the share of breakers open, by master and
//!   by the fixed slot ranges used before the slot map is read), registered when the store is built:
//!   install the recorder first. Each carries the store's `name`
//!   ([`RedisStoreBuilder::name`], default the prefix), so two stores
//!   (a [`Tiered`] pair) read apart.
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
//! Cluster. `redis[s]+sentinel://[user:password@]host:port[,host:port]/name`
//! finds the master `name` through Redis Sentinel (the user and password
//! are the master's) and follows a failover. **TLS**: `rediss://` on a
//! standalone server (with the system's roots, or a private CA by
//! [`RedisStoreBuilder::tls_root_cert`]) and on Cluster nodes (system
//! roots only); `rediss+sentinel://` for Sentinel over TLS, to the
//! sentinels and to the master they name (the master's password then
//! never crosses the network in clear; system roots only: a private CA
//! goes in the system's roots or `SSL_CERT_FILE`); no client
//! certificates (mTLS), and no password for the sentinels themselves. A
//! `redis+sentinel://` URL is plain TCP throughout: keep such deployments
//! on a private network. A `rediss://` or `rediss+sentinel://` URL ending
//! in `#insecure` (redis-rs's switch for not verifying the certificate)
//! is logged as a warning when the store is built. On a standalone server (a
//! DNS name or a virtual IP that a failover moves), Cluster and Sentinel alike,
//! a call that finds its node lost (the connection broke or was refused,
//! a demoted master refuses writes, or — three calls in a row to one
//! master — no answer came within the call's time) has the connection replaced in the
//! background: the sentinels are asked again, or the cluster's slot map
//! is read afresh (redis-rs follows `MOVED`, but would reconnect a dead
//! master's address forever). Calls go on meanwhile, and the failure
//! policy answers those that fail. Connects are one at a time: after one
//! that worked, no replacement for 1 to 1.25 s; while they fail, the next
//! waits 50 ms, doubling up to 2 s; a replacement for a node found hung
//! starts up to 250 ms after its third hung call (one found gone, at
//! once). Every wait is drawn at random within its span, so a fleet that
//! saw the same stall does not reconnect in step. They are started by calls (the
//! breaker's probes included), so a dead node never costs a connect per
//! call. A user and password in any URL authenticate (ACL users
//! included) and never appear in the store's errors or `Debug` output.
//!
//! **Failover and replication lag.** Redis replicates asynchronously, so a
//! failover loses the writes the replica had not received: the decisions
//! of the last moments before the switch, about the key's decision rate
//! times the replication lag (well under a millisecond on one network;
//! the test that crashes a Cluster master under 4 writers has lost none
//! of ~2,700 acknowledged units on loopback, and asserts at most a tenth
//! plus 16). Their units come back — a
//! client gets up to that much extra budget once; nothing is lost for
//! good. Between the crash and the promotion (the cluster's node timeout
//! plus an election: ~4 s with a 2-s node timeout) the failure policy
//! answers for the keys of the lost master's slots; the other slots are
//! decided by Redis throughout.
//!
//! **Run the limiter's Redis with `maxmemory-policy noeviction`** (or a
//! `volatile-*` policy on an instance that holds nothing else): every key
//! has a TTL, so nothing outlives its use, but an `allkeys-*` policy
//! that evicts a GCRA or window key under memory pressure hands that
//! client a whole fresh budget. With `noeviction`, a full Redis refuses
//! the write, and the failure policy answers.
//!
//! Redis 5.0 or later (or a compatible server): the scripts write after
//! reading `TIME`, which needs script effects replication, the default
//! since 5.0, and use no command newer than 4.0 (no `RPOP` with a count
//! nor `ZADD GT`, which need 6.2). The test suite passes on Redis 5.0.6,
//! 6.2.14 and 7.0 (`.ci/redis-versions` runs it on the older two).
//!
//! # Features
//!
//! | feature | what it adds |
//! |---|---|
//! | `testing` | [`testing`]: start `redis-server` processes (standalone, cluster) for tests |
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

mod audit;
mod backend;
mod breaker;
mod concurrency;
mod conn;
mod escalation;
mod hot;
mod keeper;
mod key;
mod leases;
mod policy;
mod quota;
mod rate;
mod retry_budget;
mod scripts;
mod store;
#[cfg(feature = "testing")]
pub mod testing;
mod tiered;

use std::future::Future;
use std::pin::Pin;

pub use audit::{AuditFields, RedisAudit};
pub use backend::RedisStats;
pub use concurrency::RedisConcurrencyLimiter;
pub use escalation::RedisEscalation;
pub use hot::{Hot, HotFuture, HotKeys, HotLimiter, HotStats};
pub use policy::FailurePolicy;
pub use quota::RedisQuotaLimiter;
pub use rate::RedisLimiter;
pub use retry_budget::RedisRetryBudget;
pub use store::{RedisStore, RedisStoreBuilder};
pub use tiered::{Tiered, TieredLimiter};

/// A boxed future (the Redis path: network-bound, so one box is noise).
pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;
