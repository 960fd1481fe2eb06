//! The file's shape, as serde reads it, and its small languages: rates,
//! durations, keys.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

/// A value and where it is in the file (`toml::Spanned`), which the
/// schema describes as the value itself.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(transparent)]
pub(super) struct Spanned<T>(toml::Spanned<T>);

impl<T> Spanned<T> {
    pub(super) fn new(span: std::ops::Range<usize>, value: T) -> Self {
        Self(toml::Spanned::new(span, value))
    }

    pub(super) fn get_ref(&self) -> &T {
        self.0.get_ref()
    }

    pub(super) fn span(&self) -> std::ops::Range<usize> {
        self.0.span()
    }

    pub(super) fn get_mut(&mut self) -> &mut T {
        self.0.get_mut()
    }
}

#[cfg(feature = "schema")]
impl<T: schemars::JsonSchema> schemars::JsonSchema for Spanned<T> {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        T::schema_name()
    }

    fn schema_id() -> std::borrow::Cow<'static, str> {
        T::schema_id()
    }

    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        T::json_schema(generator)
    }

    fn inline_schema() -> bool {
        T::inline_schema()
    }
}

/// What the schema says of the fields the file reads as TOML values and
/// sorts out itself.
#[cfg(feature = "schema")]
mod values {
    /// A cost: a number, a `[costs.NAME]` by name, or a cost table.
    #[derive(schemars::JsonSchema)]
    #[schemars(untagged)]
    #[allow(dead_code)]
    pub(super) enum Cost {
        Units(u64),
        Named(String),
        Table(super::CostSpec),
    }

    /// A number of bytes, or text such as `"64 KiB"` (`"256 KiB/s"`).
    #[derive(schemars::JsonSchema)]
    #[schemars(untagged)]
    #[allow(dead_code)]
    pub(super) enum Bytes {
        Count(u64),
        Text(String),
    }

    /// What a store's error does.
    #[derive(schemars::JsonSchema)]
    #[schemars(rename_all = "lowercase")]
    #[allow(dead_code)]
    pub(super) enum OnStoreError {
        /// Let the request through (the default).
        Admit,
        /// Refuse it: 429 with `Retry-After: 1`.
        Refuse,
    }

    /// How a rule measures what a request really cost.
    #[derive(schemars::JsonSchema)]
    #[schemars(rename_all = "snake_case")]
    #[allow(dead_code)]
    pub(super) enum Measure {
        /// The handler's time: one unit per `per` (a duration).
        Elapsed,
        /// The response's declared length: one unit per `per` bytes.
        ResponseBytes,
        /// Only what the handler reports (`ActualCost`).
        Reported,
    }

    /// `"error"`, an HTTP status, or a gRPC code by name.
    #[derive(schemars::JsonSchema)]
    #[schemars(untagged)]
    #[allow(dead_code)]
    pub(super) enum RetryOn {
        Status(u16),
        Name(String),
    }
}

/// The whole file.
#[derive(Clone, Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub(super) struct FileSpec {
    #[serde(default)]
    pub(super) headers: Option<bool>,
    #[serde(default)]
    pub(super) legacy_headers: Option<bool>,
    #[serde(default)]
    pub(super) route_label: Option<Spanned<bool>>,
    #[serde(default)]
    pub(super) trusted_proxies: Option<Spanned<Vec<String>>>,
    #[serde(default)]
    pub(super) forwarded_header: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) ipv6_prefix: Option<Spanned<u8>>,
    #[serde(default)]
    pub(super) plan_from: Option<Spanned<String>>,
    /// What a store's error (not a decision: a store that fails open or
    /// closed answers with decisions) does to a request: `admit` (the
    /// default) or `refuse`. For the rules, and for every quota and
    /// in-flight limit without its own.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(with = "Option<values::OnStoreError>"))]
    pub(super) on_store_error: Option<Spanned<String>>,
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(with = "BTreeMap<String, CostSpec>"))]
    pub(super) costs: BTreeMap<String, Spanned<toml::Value>>,
    #[serde(default)]
    pub(super) rules: Vec<Spanned<RuleSpec>>,
    #[serde(default)]
    pub(super) quotas: Vec<Spanned<QuotaSpec>>,
    #[serde(default)]
    pub(super) concurrency: Vec<Spanned<ConcurrencySpec>>,
    #[serde(default)]
    pub(super) bandwidth: Vec<Spanned<BandwidthSpec>>,
    #[serde(default)]
    pub(super) access: Option<Spanned<AccessSpec>>,
    /// MaxMind-format databases for the key parts `asn` and `country`.
    #[serde(default)]
    pub(super) geoip: Option<Spanned<GeoIpSpec>>,
    #[serde(default)]
    pub(super) idempotency: Option<Spanned<IdempotencySpec>>,
    #[serde(default)]
    pub(super) decision_log: Option<Spanned<LogSpec>>,
    #[serde(default)]
    pub(super) store: Option<Spanned<StoreSpec>>,
    #[serde(default)]
    pub(super) retry_budgets: Vec<Spanned<RetrySpec>>,
    /// Read by `tollgate-server` only.
    #[serde(default)]
    pub(super) server: Option<Spanned<ServerSpec>>,
    #[serde(default)]
    pub(super) challenge: Option<Spanned<ChallengeSpec>>,
    #[serde(default)]
    pub(super) audit: Option<Spanned<AuditSpec>>,
}

/// `[audit]`: which refusals are recorded, as log events.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub(super) struct AuditSpec {
    /// The rules and access lists whose refusals are recorded.
    pub(super) rules: Spanned<Vec<String>>,
    /// At most this many records a second per rule (default 1,000).
    #[serde(default)]
    pub(super) per_second: Option<Spanned<i64>>,
    /// The environment variable that holds the secret key fingerprints
    /// are made with (16 to 64 bytes, the same on every instance).
    #[serde(default)]
    pub(super) secret_env: Option<Spanned<String>>,
    /// The file that holds it.
    #[serde(default)]
    pub(super) secret_file: Option<Spanned<String>>,
    /// A Redis stream the records are appended to (under the store's
    /// prefix), where they are log events without it. Needs a Redis
    /// store.
    #[serde(default)]
    pub(super) stream: Option<Spanned<String>>,
    /// About how many records the stream keeps (`MAXLEN ~`; default
    /// 100,000; 1 to 10,000,000).
    #[serde(default)]
    pub(super) maxlen: Option<Spanned<i64>>,
    /// Records waiting for Redis at most (default 10,000; 1 to 2^20):
    /// past that, records are dropped and counted, never waited for.
    #[serde(default)]
    pub(super) queue: Option<Spanned<i64>>,
}

/// `[challenge]`: what every rule's proof-of-work challenge shares.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub(super) struct ChallengeSpec {
    /// The environment variable that holds the secret challenges are
    /// signed with (16 to 64 bytes, the same on every instance).
    #[serde(default)]
    pub(super) secret_env: Option<Spanned<String>>,
    /// The file that holds it.
    #[serde(default)]
    pub(super) secret_file: Option<Spanned<String>>,
    /// Whose challenge it is: a key (default: the peer's address).
    #[serde(default)]
    pub(super) requester: Option<Spanned<String>>,
}

/// A rule's `challenge`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub(super) struct RuleChallengeSpec {
    /// Leading zero bits a solution's SHA-256 needs (1 to 32).
    pub(super) difficulty: Spanned<i64>,
    /// How long a challenge holds: `"5m"` (1 s to 1 h).
    pub(super) window: Spanned<String>,
}

/// A rule's `charge_after`: how it measures what a request cost.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub(super) struct ChargeAfterSpec {
    /// `elapsed` (the handler's time), `response_bytes` (the response's
    /// `Content-Length`) or `reported` (only what the handler reports).
    #[cfg_attr(feature = "schema", schemars(with = "values::Measure"))]
    pub(super) measure: Spanned<String>,
    /// What one unit buys: a duration for `elapsed` (`"100ms"`), bytes
    /// for `response_bytes` (`1024`, `"64 KiB"`); none for `reported`.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(with = "Option<values::Bytes>"))]
    pub(super) per: Option<Spanned<toml::Value>>,
}

/// `[server]`: where `tollgate-server` listens.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub(super) struct ServerSpec {
    /// The decision endpoints' address, e.g. `"127.0.0.1:8081"`.
    #[serde(default)]
    pub(super) listen: Option<Spanned<String>>,
    /// Where `/metrics` is served, e.g. `"127.0.0.1:9091"` (on `listen`
    /// if absent).
    #[serde(default)]
    pub(super) metrics: Option<Spanned<String>>,
    /// Where Envoy's rate limit service (gRPC) listens, e.g.
    /// `"127.0.0.1:8082"`.
    #[serde(default)]
    pub(super) grpc: Option<Spanned<String>>,
    /// Envoy ratelimit configuration files (YAML, one domain each) the
    /// gRPC service decides by.
    #[serde(default)]
    pub(super) envoy: Vec<String>,
    /// TLS on `listen` and `grpc` (not on a `metrics` address of its own).
    #[serde(default)]
    pub(super) tls: Option<Spanned<TlsSpec>>,
}

/// `[server.tls]`: the server's certificate, and whose clients it admits.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub(super) struct TlsSpec {
    /// The certificate chain (PEM), the server's own first.
    pub(super) cert_file: Spanned<String>,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub(super) key_file: Spanned<String>,
    /// CA certificates (PEM): when given, only clients with a certificate
    /// one of them signed are served (mutual TLS).
    #[serde(default)]
    pub(super) client_ca_file: Option<Spanned<String>>,
}

/// One `[[retry_budgets]]` entry: a client's retries under a budget (a
/// `RetryBudgetLayer`).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub(super) struct RetrySpec {
    pub(super) name: Spanned<String>,
    /// `upstream` (the default: the upstream's host), or a key as the
    /// other entries write it.
    #[serde(default)]
    pub(super) key: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) ratio: Option<Spanned<f64>>,
    #[serde(default)]
    pub(super) min_per_second: Option<Spanned<i64>>,
    #[serde(default)]
    pub(super) window: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) max_attempts: Option<Spanned<i64>>,
    #[serde(default)]
    pub(super) backoff: Option<Spanned<BackoffSpec>>,
    #[serde(default)]
    pub(super) max_server_wait: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) deadline: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) retry_any_method: Option<bool>,
    #[serde(default)]
    pub(super) idempotent_paths: Vec<String>,
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(with = "Option<values::Bytes>"))]
    pub(super) buffer_limit: Option<Spanned<toml::Value>>,
    #[serde(default)]
    pub(super) adaptive_throttling: Option<Spanned<f64>>,
    /// Which outcomes are retried: `"error"`, HTTP statuses, gRPC codes
    /// by name (`"UNAVAILABLE"`).
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(with = "Option<Vec<values::RetryOn>>"))]
    pub(super) retry_on: Option<Spanned<Vec<Spanned<toml::Value>>>>,
}

/// A retry budget's backoff.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub(super) struct BackoffSpec {
    pub(super) base: Spanned<String>,
    pub(super) cap: Spanned<String>,
}

/// `[store]`: where the limits keep their state.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub(super) struct StoreSpec {
    /// `memory` or `redis`.
    pub(super) kind: Spanned<String>,
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(range(min = 1)))]
    pub(super) max_keys: Option<Spanned<i64>>,
    #[serde(default)]
    pub(super) sweep_idle_every: Option<Spanned<String>>,
    /// A Redis URL without a password.
    #[serde(default)]
    pub(super) url: Option<Spanned<String>>,
    /// The environment variable that holds the Redis URL.
    #[serde(default)]
    pub(super) url_env: Option<Spanned<String>>,
    /// The file that holds the Redis URL.
    #[serde(default)]
    pub(super) url_file: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) prefix: Option<Spanned<String>>,
    /// `open`, `closed`, `fallback` or `fallback/N`.
    #[serde(default)]
    pub(super) failure_policy: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) timeout: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) connect_timeout: Option<Spanned<String>>,
    /// The environment variable that holds the key secret.
    #[serde(default)]
    pub(super) key_secret_env: Option<Spanned<String>>,
    /// The file that holds the key secret.
    #[serde(default)]
    pub(super) key_secret_file: Option<Spanned<String>>,
    /// Local leases for hot keys in front of Redis (`HotKeys`).
    #[serde(default)]
    pub(super) hot_keys: Option<Spanned<HotKeysSpec>>,
}

/// `[store.hot_keys]`: `HotKeys`'s settings, each optional (its defaults).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub(super) struct HotKeysSpec {
    /// How long a lease lasts: `"50ms"` (1 ms to 10 s).
    #[serde(default)]
    pub(super) ttl: Option<Spanned<String>>,
    /// The most units one lease takes (at least 1; default 512).
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = u32::MAX)))]
    pub(super) max_batch: Option<Spanned<i64>>,
    /// The fewest units a lease asks for (1 to max_batch; default 1).
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = u32::MAX)))]
    pub(super) min_batch: Option<Spanned<i64>>,
    /// The most of a rule's capacity one lease takes (above 0, at most 1;
    /// default 0.1).
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("exclusiveMinimum" = 0, "maximum" = 1)))]
    pub(super) max_share: Option<Spanned<f64>>,
    /// The longest a store's refusal is answered here: `"1s"`.
    #[serde(default)]
    pub(super) max_denial: Option<Spanned<String>>,
    /// The most keys leased per rule (default 100,000).
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(range(min = 1)))]
    pub(super) max_keys: Option<Spanned<i64>>,
    /// Take a hot key's next lease before the current one runs out.
    #[serde(default)]
    pub(super) refill_ahead: Option<Spanned<bool>>,
    /// The `[[rules]]` leased (default: every rule that can be).
    #[serde(default)]
    pub(super) rules: Option<Spanned<Vec<String>>>,
}

impl StoreSpec {
    /// The names of the optional fields given.
    pub(super) fn fields_set(&self) -> Vec<&'static str> {
        [
            ("max_keys", self.max_keys.is_some()),
            ("sweep_idle_every", self.sweep_idle_every.is_some()),
            ("url", self.url.is_some()),
            ("url_env", self.url_env.is_some()),
            ("url_file", self.url_file.is_some()),
            ("prefix", self.prefix.is_some()),
            ("failure_policy", self.failure_policy.is_some()),
            ("timeout", self.timeout.is_some()),
            ("connect_timeout", self.connect_timeout.is_some()),
            ("key_secret_env", self.key_secret_env.is_some()),
            ("key_secret_file", self.key_secret_file.is_some()),
            ("hot_keys", self.hot_keys.is_some()),
        ]
        .into_iter()
        .filter_map(|(name, set)| set.then_some(name))
        .collect()
    }
}

/// One `[[rules]]` entry.
#[derive(Clone, Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub(super) struct RuleSpec {
    pub(super) name: Spanned<String>,
    pub(super) key: Spanned<String>,
    #[serde(default)]
    pub(super) algorithm: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) rate: Option<Spanned<String>>,
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = u32::MAX)))]
    pub(super) burst: Option<Spanned<i64>>,
    #[serde(default)]
    pub(super) max_delay: Option<Spanned<String>>,
    /// `sliding_buckets`: how many buckets the window is cut into.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = tollgate_core::SlidingWindowBuckets::MAX_BUCKETS)))]
    pub(super) buckets: Option<Spanned<i64>>,
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(with = "Option<values::Cost>"))]
    pub(super) cost: Option<Spanned<toml::Value>>,
    #[serde(default)]
    pub(super) missing_key: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) shadow: Option<bool>,
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(range(min = 0.0, max = 1.0)))]
    pub(super) canary: Option<Spanned<f64>>,
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("exclusiveMinimum" = 0, "maximum" = 1)))]
    pub(super) warn_at: Option<Spanned<f64>>,
    #[serde(default)]
    pub(super) count_if: Option<Spanned<Vec<u16>>>,
    #[serde(default)]
    pub(super) escalate: Option<Spanned<EscalateSpec>>,
    /// A slowing ladder: repeated refusals lower the key's rate step by
    /// step (instead of `escalate`'s block).
    #[serde(default)]
    pub(super) slow_down: Option<Spanned<SlowDownSpec>>,
    /// A proof-of-work challenge in this rule's refusals.
    #[serde(default)]
    pub(super) challenge: Option<Spanned<RuleChallengeSpec>>,
    /// Charge what a request really cost once its response is known:
    /// the difference to its estimate given back, or owed by the key's
    /// next request.
    #[serde(default)]
    pub(super) charge_after: Option<Spanned<ChargeAfterSpec>>,
    /// Count the messages of upgraded connections (WebSockets) in this
    /// rule's budget too.
    #[serde(default)]
    pub(super) messages: Option<Spanned<bool>>,
    #[serde(default)]
    pub(super) plans: BTreeMap<String, Spanned<LimitSpec>>,
    /// The routes the limit applies to (`"GET /api/download"`,
    /// `"/files/{*path}"`); every route if absent.
    #[serde(default)]
    pub(super) routes: Option<Spanned<Vec<Spanned<String>>>>,
}

/// One `[[quotas]]` entry: a calendar quota (a `QuotaLayer`).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub(super) struct QuotaSpec {
    pub(super) name: Spanned<String>,
    pub(super) key: Spanned<String>,
    /// Each period's limit: `{ day = 1000, month = 20000 }`.
    pub(super) limits: Spanned<BTreeMap<String, Spanned<i64>>>,
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(with = "Option<values::Cost>"))]
    pub(super) cost: Option<Spanned<toml::Value>>,
    #[serde(default)]
    pub(super) missing_key: Option<Spanned<String>>,
    /// What a store's error does here: `admit` or `refuse` (the file's
    /// `on_store_error` when absent).
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(with = "Option<values::OnStoreError>"))]
    pub(super) on_store_error: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) soft_limit: Option<Spanned<f64>>,
    /// Where periods start: `UTC` (the default), an offset (`+05:30`,
    /// `-04:00`), or an IANA name (feature `tz`).
    #[serde(default)]
    pub(super) zone: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) shadow: Option<bool>,
    /// Each plan's limits, as `limits`.
    #[serde(default)]
    pub(super) plans: BTreeMap<String, Spanned<BTreeMap<String, Spanned<i64>>>>,
    /// The routes the limit applies to (`"GET /api/download"`,
    /// `"/files/{*path}"`); every route if absent.
    #[serde(default)]
    pub(super) routes: Option<Spanned<Vec<Spanned<String>>>>,
}

/// One `[[concurrency]]` entry: in-flight limits (a `ConcurrencyLayer`).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub(super) struct ConcurrencySpec {
    pub(super) name: Spanned<String>,
    pub(super) key: Spanned<String>,
    /// Permits in flight per key.
    pub(super) max: Spanned<i64>,
    /// Permits a request holds (a cost), 1 by default.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(with = "Option<values::Cost>"))]
    pub(super) cost: Option<Spanned<toml::Value>>,
    /// Each plan's own `max`.
    #[serde(default)]
    pub(super) plans: BTreeMap<String, Spanned<i64>>,
    #[serde(default)]
    pub(super) queue: Option<Spanned<QueueSpec>>,
    /// A fixed service-wide limit.
    #[serde(default)]
    pub(super) service: Option<Spanned<ServiceSpec>>,
    /// An adaptive service-wide limit.
    #[serde(default)]
    pub(super) adaptive: Option<Spanned<AdaptiveSpec>>,
    #[serde(default)]
    pub(super) read_only: Option<Spanned<ReadOnlySpec>>,
    #[serde(default)]
    pub(super) missing_key: Option<Spanned<String>>,
    /// What a store's error does here: `admit` or `refuse` (the file's
    /// `on_store_error` when absent).
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(with = "Option<values::OnStoreError>"))]
    pub(super) on_store_error: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) shadow: Option<bool>,
    #[serde(default)]
    pub(super) lease_ttl: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) retry_after: Option<Spanned<String>>,
    /// The longest a permit lives (a stream still running then ends).
    #[serde(default)]
    pub(super) max_lifetime: Option<Spanned<String>>,
    /// The routes the limit applies to (`"GET /api/download"`,
    /// `"/files/{*path}"`); every route if absent.
    #[serde(default)]
    pub(super) routes: Option<Spanned<Vec<Spanned<String>>>>,
}

/// A concurrency limit's queue.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub(super) struct QueueSpec {
    pub(super) max_len: Spanned<i64>,
    pub(super) max_wait: Spanned<String>,
}

/// A fixed service-wide limit.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub(super) struct ServiceSpec {
    pub(super) name: Spanned<String>,
    pub(super) max: Spanned<i64>,
}

/// An adaptive service-wide limit.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub(super) struct AdaptiveSpec {
    pub(super) name: Spanned<String>,
    /// `gradient` or `aimd`.
    pub(super) algorithm: Spanned<String>,
    pub(super) min: Spanned<i64>,
    pub(super) initial: Spanned<i64>,
    pub(super) max: Spanned<i64>,
}

/// Read-only mode above an error rate.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub(super) struct ReadOnlySpec {
    pub(super) above: Spanned<f64>,
    pub(super) window: Spanned<String>,
    #[serde(default)]
    pub(super) min_requests: Option<Spanned<i64>>,
}

/// One `[[bandwidth]]` entry: bodies paced per key (a `BandwidthLayer`).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub(super) struct BandwidthSpec {
    pub(super) name: Spanned<String>,
    pub(super) key: Spanned<String>,
    /// Bytes a second: a number, or `"256 KiB/s"`.
    #[cfg_attr(feature = "schema", schemars(with = "values::Bytes"))]
    pub(super) rate: Spanned<toml::Value>,
    /// Bytes at once: a number, or `"64 KiB"`.
    #[cfg_attr(feature = "schema", schemars(with = "values::Bytes"))]
    pub(super) burst: Spanned<toml::Value>,
    /// `responses` (default), `requests` or `both`.
    #[serde(default)]
    pub(super) direction: Option<Spanned<String>>,
    /// Bytes a body takes from the store at once.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(with = "Option<values::Bytes>"))]
    pub(super) chunk: Option<Spanned<toml::Value>>,
    #[serde(default)]
    pub(super) missing_key: Option<Spanned<String>>,
    /// The routes the limit applies to (`"GET /api/download"`,
    /// `"/files/{*path}"`); every route if absent.
    #[serde(default)]
    pub(super) routes: Option<Spanned<Vec<Spanned<String>>>>,
}

/// A plan's numbers; which apply depends on the rule's algorithm.
#[derive(Clone, Debug, Default, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub(super) struct LimitSpec {
    #[serde(default)]
    pub(super) rate: Option<Spanned<String>>,
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = u32::MAX)))]
    pub(super) burst: Option<Spanned<i64>>,
    #[serde(default)]
    pub(super) max_delay: Option<Spanned<String>>,
    /// `sliding_buckets`: the plan's own number of buckets (the rule's
    /// when absent).
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = tollgate_core::SlidingWindowBuckets::MAX_BUCKETS)))]
    pub(super) buckets: Option<Spanned<i64>>,
}

/// A cost function.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub(super) struct CostSpec {
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(range(min = 1)))]
    pub(super) default: Option<i64>,
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(range(min = 1)))]
    pub(super) max: Option<i64>,
    #[serde(default)]
    pub(super) header: Option<String>,
    #[serde(default)]
    pub(super) query: Option<String>,
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(range(min = 1)))]
    pub(super) bytes_per_unit: Option<i64>,
    #[serde(default)]
    pub(super) methods: BTreeMap<String, i64>,
    #[serde(default)]
    pub(super) routes: Vec<RouteCost>,
}

/// One `routes` entry of a cost.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub(super) struct RouteCost {
    #[serde(default)]
    pub(super) method: Option<String>,
    pub(super) path: String,
    pub(super) cost: i64,
}

/// An escalation ladder.
#[derive(Clone, Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub(super) struct EscalateSpec {
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = tollgate_core::algorithm::Escalation::MAX_STRIKES)))]
    pub(super) strikes: Spanned<i64>,
    pub(super) period: Spanned<String>,
    pub(super) block: Spanned<String>,
    pub(super) max_block: Spanned<String>,
}

/// A slowing ladder: `strikes` refusals within `period` put the key one
/// step down `steps` (each the percent of the rate it keeps) for `hold`.
#[derive(Clone, Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub(super) struct SlowDownSpec {
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = tollgate_core::algorithm::Escalation::MAX_STRIKES)))]
    pub(super) strikes: Spanned<i64>,
    pub(super) period: Spanned<String>,
    pub(super) hold: Spanned<String>,
    #[cfg_attr(feature = "schema", schemars(length(min = 1, max = tollgate_core::algorithm::Escalation::MAX_STEPS), inner(range(min = 1, max = 99))))]
    pub(super) steps: Spanned<Vec<i64>>,
}

/// `[access]`.
#[derive(Clone, Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub(super) struct AccessSpec {
    #[serde(default)]
    pub(super) name: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) keys_from: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) allow_keys: Vec<String>,
    #[serde(default)]
    pub(super) deny_keys: Vec<String>,
    #[serde(default)]
    pub(super) allow_networks: Option<Spanned<Vec<String>>>,
    #[serde(default)]
    pub(super) deny_networks: Option<Spanned<Vec<String>>>,
    /// A file of networks to allow, one CIDR or address a line (`#`
    /// comments), relative to the policy file; reloaded with it.
    #[serde(default)]
    pub(super) allow_networks_file: Option<Spanned<String>>,
    /// A file of networks to refuse (a TOR exit list, a hosting
    /// provider's ranges), as `allow_networks_file`.
    #[serde(default)]
    pub(super) deny_networks_file: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) deny_by_default: Option<bool>,
    /// What the two files held when the policy file was read (allow,
    /// deny), or why they could not be read.
    #[serde(skip)]
    pub(super) loaded: [Option<Result<String, String>>; 2],
}

/// `[geoip]`: the databases the key parts `asn` and `country` read (paths
/// relative to the policy file; feature `geoip`).
#[derive(Clone, Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub(super) struct GeoIpSpec {
    /// An ASN database (GeoLite2-ASN).
    #[serde(default)]
    pub(super) asn: Option<Spanned<String>>,
    /// A country database (GeoIP2-Country, GeoLite2-Country, -City).
    #[serde(default)]
    pub(super) country: Option<Spanned<String>>,
    /// The databases as read (asn, country), or why they could not be.
    #[serde(skip)]
    pub(super) loaded: Geo,
}

/// The `[geoip]` databases as read: (asn, country).
#[cfg(feature = "geoip")]
pub(super) type Geo = [Option<Result<crate::key::GeoIp, String>>; 2];
/// Without the `geoip` feature no database is read.
#[cfg(not(feature = "geoip"))]
pub(super) type Geo = [Option<Result<(), String>>; 2];

/// No `[geoip]`.
pub(super) static NO_GEO: Geo = [None, None];

impl FileSpec {
    /// The `[geoip]` databases as read.
    pub(super) fn geo(&self) -> &Geo {
        self.geoip.as_ref().map_or(&NO_GEO, |g| &g.get_ref().loaded)
    }

    /// What a key's text means beyond itself, as a number: two keys of
    /// the same text read the same key of a request where this is the
    /// same (the client address by the same proxies and prefix, the same
    /// databases).
    pub(super) fn key_context(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.trusted_proxies
            .as_ref()
            .map(Spanned::get_ref)
            .hash(&mut h);
        self.forwarded_header
            .as_ref()
            .map(|f| f.get_ref().to_ascii_lowercase())
            .hash(&mut h);
        self.ipv6_prefix.as_ref().map(Spanned::get_ref).hash(&mut h);
        if let Some(g) = &self.geoip {
            let g = g.get_ref();
            g.asn.as_ref().map(Spanned::get_ref).hash(&mut h);
            g.country.as_ref().map(Spanned::get_ref).hash(&mut h);
        }
        h.finish()
    }
}

/// `[idempotency]`.
#[derive(Clone, Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub(super) struct IdempotencySpec {
    pub(super) name: Spanned<String>,
    pub(super) key: Spanned<String>,
    pub(super) ttl: Spanned<String>,
}

/// `[decision_log]`.
#[derive(Clone, Debug, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub(super) struct LogSpec {
    #[serde(default)]
    pub(super) allowed: Option<f64>,
    #[serde(default)]
    pub(super) limited: Option<f64>,
}

/// `"15m"`, `"100ms"`, `"1h"`, `"2d"`, `"30s"`: one whole number and a
/// unit.
pub(super) fn duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let n: u64 = digits.parse().map_err(|_| {
        format!("{text:?} is not a duration like \"100ms\", \"30s\", \"15m\", \"1h\" or \"1d\"")
    })?;
    let unit_secs = match unit.trim() {
        "ms" => return Ok(Duration::from_millis(n)),
        "s" | "sec" | "second" | "seconds" => 1,
        "m" | "min" | "minute" | "minutes" => 60,
        "h" | "hour" | "hours" => 3_600,
        "d" | "day" | "days" => 86_400,
        _ => {
            return Err(format!(
                "{text:?} is not a duration like \"100ms\", \"30s\", \"15m\", \"1h\" or \"1d\""
            ))
        }
    };
    n.checked_mul(unit_secs)
        .map(Duration::from_secs)
        .ok_or_else(|| format!("{text:?} is too long"))
}

/// `"10/s"`, `"600/min"`, `"5/15m"`, `"1000/day"`: an amount per period.
pub(super) fn rate(text: &str) -> Result<(u32, Duration), String> {
    let shape = || format!("{text:?} is not a rate like \"10/s\", \"600/min\" or \"5/15m\"");
    let (amount, per) = text.split_once('/').ok_or_else(shape)?;
    let amount: u32 = amount.trim().parse().map_err(|_| shape())?;
    let per = per.trim();
    // A bare unit is one of it: "10/s" is "10/1s".
    let period = if per.starts_with(|c: char| c.is_ascii_digit()) {
        duration(per)?
    } else {
        duration(&format!("1{per}")).map_err(|_| shape())?
    };
    Ok((amount, period))
}

/// A key: alternatives split by `|` (the first that finds a key wins),
/// each the parts joined by `+` (all of them, in order).
pub(super) fn key_parts(text: &str) -> Vec<Vec<&str>> {
    text.split('|')
        .map(|alt| alt.split('+').map(str::trim).collect())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_and_durations_read_as_people_write_them() {
        assert_eq!(rate("10/s").unwrap(), (10, Duration::from_secs(1)));
        assert_eq!(rate("600 / min").unwrap(), (600, Duration::from_secs(60)));
        assert_eq!(rate("5/15m").unwrap(), (5, Duration::from_secs(900)));
        assert_eq!(
            rate("1000/day").unwrap(),
            (1000, Duration::from_secs(86_400))
        );
        assert_eq!(rate("3/250ms").unwrap(), (3, Duration::from_millis(250)));
        for bad in ["10", "x/s", "10/fortnight", "-1/s", "10/", "99999999999/s"] {
            assert!(rate(bad).is_err(), "{bad}");
        }
        assert_eq!(duration("24h").unwrap(), Duration::from_secs(86_400));
        assert!(duration("18446744073709551615d").is_err());
        assert!(duration("").is_err());
        assert_eq!(
            key_parts("header:x-org + route | client-ip"),
            vec![vec!["header:x-org", "route"], vec!["client-ip"]]
        );
    }
}
