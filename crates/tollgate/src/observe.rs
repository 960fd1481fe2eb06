//! Metrics, through the [`metrics`](https://docs.rs/metrics) facade: install a recorder (Prometheus,
//! StatsD, ...) **before** building layers; each layer registers its
//! handles once, when it is built, so a decision costs one atomic add.
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | `tollgate_requests_total` | counter | `rule`, `outcome`: `allowed`, `limited`, `too_costly`, `shadow_limited` (denied but let through), `missing_key` (rejected), `unkeyed` (let through unlimited), `store_error` (let through); for an access list: `listed_allowed` (on an allow list, unlimited), `denied` (403); for an idempotency marker: `idempotent_repeat`; for a rule with an escalation ladder: `strike`, `blocked`, and with a slowing ladder `slowed` (a request of a key on a lower step, also counted as `allowed` or `limited`); for a rule with a challenge: `challenge_passed` (a solution let the request past the rule), `challenge_failed` (a solution that was wrong, expired or used before); past a rule's warning share: `warned`; for a rate limit's messages of upgraded connections: `message_allowed`, `message_limited` |
//! | `tollgate_route_requests_total` | counter | `rule`, `route` (axum's matched route, a template), `outcome`: `allowed`, `limited`, `too_costly`, `shadow_limited`; a rate limit's, quota's, concurrency limit's (`allowed`, `limited` — a full queue or an expired wait included — and `too_costly`; requests let through holding nothing are not counted) or policy's, when its `route_label` is on (e.g. [`PolicyLayerBuilder::route_label`](crate::policy::PolicyLayerBuilder::route_label)) |
//! | `tollgate_config_reloads_total` | counter | `outcome`: `applied`, `unchanged`, `rejected` (a policy file's reloads) |
//! | `tollgate_retry_after_seconds` | histogram | `rule` (and `plan`, as above) |
//! | `tollgate_remaining_ratio` | histogram | `rule` (and `plan`): what each rate decision left of the rule's limit, from 0 (spent, or refused for now) to 1 (untouched; a request refused as too costly records what its key still had), before any refund a policy makes when another rule refuses; a low quantile near 0 means some clients run at their limit |
//! | `tollgate_quota_requests_total` | counter | `rule`, `outcome`: as `tollgate_requests_total` (an access list's `listed_allowed` and `denied` under its name) |
//! | `tollgate_quota_warnings_total` | counter | `rule`: responses past the quota's soft limit |
//! | `tollgate_quota_used_ratio` | histogram | `rule`, `period` (`minute` ... `year`): what the key had used of the period's budget at each decision, from 0 to 1; a high quantile near 1 means some clients are about to exhaust it |
//! | `tollgate_retry_calls_total` | counter | `rule`: calls through a retry budget layer (first attempts) |
//! | `tollgate_retries_total` | counter | `rule`: retries made |
//! | `tollgate_retry_budget_exhausted_total` | counter | `rule`: retries the budget refused |
//! | `tollgate_retry_throttled_total` | counter | `rule`: calls refused locally by adaptive throttling |
//! | `tollgate_retry_hedges_total` | counter | `rule`: hedged attempts sent (each a withdrawal from the budget) |
//! | `tollgate_retry_budget_remaining` | histogram | `rule`: the retries the budget still held after each withdrawal (granted or refused; not recorded when a store's failure policy answered) |
//! | `tollgate_concurrency_requests_total` | counter | `rule`, `outcome`: `allowed`, `limited`, `too_costly`, `queued` (waited, then allowed), `queue_full`, `queue_timeout`, `shadow_limited`, `missing_key`, `unkeyed`, `store_error`, `read_only` (a write refused while degraded), `lifetime_ended` (a response body ended at the layer's `max_lifetime`); for an access list (its name as `rule`): `listed_allowed`, `denied` |
//! | `tollgate_concurrency_in_flight` | gauge | `rule`: permits held through this layer |
//! | `tollgate_concurrency_limit` | gauge | `rule`: an adaptive limit's current value |
//! | `tollgate_concurrency_queue_depth` | gauge | `rule`: requests waiting in the layer's queue now (a cancelled or timed-out waiter leaves it) |
//! | `tollgate_concurrency_queue_rechecks_total` | counter | `rule`: acquires a queued request made on its own timer, for releases this process does not see (each is a store call on Redis; at most about `1 + log2(max_wait / recheck)` per queued request) |
//! | `tollgate_bandwidth_bytes_total` | counter | `rule`, `direction` (`request`, `response`): body bytes let out through a bandwidth layer's pacer |
//! | `tollgate_bandwidth_wait_seconds` | histogram | `rule`, `direction`: each wait of a paced body for its byte budget (the sum: time spent throttled) |
//! | `tollgate_bandwidth_unpaced_total` | counter | `rule`, `direction`: bodies let through unpaced from some point on, because the store failed (or a chunk could never fit the budget) |
//! | `tollgate_bandwidth_requests_total` | counter | `rule`, `outcome`: `missing_key` (refused: no key), `unkeyed` (let through unpaced by `MissingKey::Skip`) |
//! | `tollgate_store_calls_total` | counter | `store="redis"`, `name` (the store's name, default its prefix), `result`: `ok`, `error`, `timeout`, `skipped` (breaker open) |
//! | `tollgate_store_call_seconds` | histogram | `store="redis"`, `name`: each call's time |
//! | `tollgate_store_node_calls_total`, `tollgate_store_node_call_seconds` | counter, histogram | `store="redis"`, `name`, `node`, and for calls `result`: the same per node, for shard balance: a Cluster master's address (`unmapped` for calls made before the slot map named their master), `server` for a standalone or Sentinel store; alert when one node takes over twice the median node's calls (`examples/prometheus/alerts.yml`). A call counts under the master the store's slot map names, as last read (on connecting, and when a node hangs): after a reshard, moved slots count under their old master until the connection is replaced; past 64 addresses seen (masters and their successors), groups are shared, under the first address of each |
//! | `tollgate_store_breaker_open` | gauge | `store="redis"`, `name`, `prefix`: the share of the store's circuit breakers that are open: 1 while a standalone or Sentinel store's breaker is open; on a Cluster, the share of its per-master breakers (and the fixed slot ranges used before the slot map is read) that are open (alert on `> 0`) |
//! | `tollgate_hot_decisions_total`, `tollgate_hot_store_calls_total`, `tollgate_hot_waits_total` | counter | `name` (the front's, `HotKeys::name`, default `hot`), `rule`: a rule leased by `HotKeys`: its decisions, the store calls they took, and those that waited for the store (`HotLimiter::stats` has the same counts) |
//! | `tollgate_audit_dropped_total` | counter | `stream`: audit records a Redis audit stream could not take |
//! | `tollgate_lease_releases_dropped_total` | counter | `store="redis"`: concurrency lease releases dropped because the lease task's queue was full (65,536 waiting); the leases lapse within their TTL |
//!
//! `examples/grafana/tollgate.json` is a Grafana dashboard of these, and
//! `examples/prometheus/alerts.yml` alerting rules (a test checks that
//! every metric they use is exported).
//!
//! A policy whose rules name plans adds a `plan` label to its rules'
//! `tollgate_requests_total`, `tollgate_retry_after_seconds` and
//! `tollgate_remaining_ratio` series:
//! the plan whose limit applied (`default` for the rule's own limit).
//!
//! Labels carry the rule's name, its plan and route, never a client key.

use metrics::{Counter, Histogram};

#[derive(Debug, Clone)]
pub(crate) struct Metrics {
    pub(crate) allowed: Counter,
    pub(crate) limited: Counter,
    pub(crate) too_costly: Counter,
    pub(crate) shadow_limited: Counter,
    pub(crate) missing_key: Counter,
    pub(crate) unkeyed: Counter,
    pub(crate) store_error: Counter,
    pub(crate) retry_after: Histogram,
    /// What a decision left, as a share of the limit (a rate rule's; a
    /// no-op for quotas, which count by period).
    remaining: Histogram,
    /// An idempotent repeat let through uncharged.
    pub(crate) repeat: Counter,
    /// An escalation ladder's steps: a strike counted, a request refused
    /// because its key is blocked (a block starting included).
    pub(crate) strike: Counter,
    pub(crate) blocked: Counter,
    /// A slowing ladder's: a request of a key on a lower step (decided at
    /// a raised cost; also counted as allowed or limited).
    pub(crate) slowed: Counter,
    /// A challenge step: a request a solution let past the rule, and a
    /// solution that did not (wrong, expired, or used before).
    pub(crate) challenge_passed: Counter,
    pub(crate) challenge_failed: Counter,
    /// An admitted response past the rule's warning share.
    pub(crate) warned: Counter,
    /// A message of an upgraded connection, admitted or refused (see
    /// [`MessageBudget`](crate::rate_limit::MessageBudget)).
    pub(crate) message_allowed: Counter,
    pub(crate) message_limited: Counter,
}

pub(crate) const REQUESTS: &str = "tollgate_requests_total";
const RETRY_AFTER: &str = "tollgate_retry_after_seconds";
const REMAINING: &str = "tollgate_remaining_ratio";
pub(crate) const QUOTA_REQUESTS: &str = "tollgate_quota_requests_total";
const QUOTA_WARNINGS: &str = "tollgate_quota_warnings_total";
const QUOTA_USED: &str = "tollgate_quota_used_ratio";

impl Metrics {
    /// Registers the handles of `rule` with the current recorder.
    pub(crate) fn register(rule: &str) -> Self {
        Self::register_as(REQUESTS, rule)
    }

    /// The handles of policy rule `rule` for requests on `plan` (`None`: a
    /// policy without plans, whose series carry no `plan` label).
    pub(crate) fn register_plan(rule: &str, plan: Option<&str>) -> Self {
        match plan {
            None => Self::register(rule),
            Some(plan) => Self::register_labels(REQUESTS, rule, Some(plan)),
        }
    }

    /// The handles of a quota layer's `rule`: its decisions, its soft
    /// limit's warnings, and each of its `periods`' used share.
    pub(crate) fn register_quota<'a>(
        rule: &str,
        periods: impl Iterator<Item = &'a str>,
    ) -> (Self, Counter, Vec<Histogram>) {
        metrics::describe_counter!(
            QUOTA_WARNINGS,
            "Responses of a tollgate quota past its soft limit, by rule"
        );
        metrics::describe_histogram!(
            QUOTA_USED,
            "What a key had used of a tollgate quota's period at each decision, from 0 to 1"
        );
        let used = periods
            .map(|p| metrics::histogram!(QUOTA_USED, "rule" => rule.to_owned(), "period" => p.to_owned()))
            .collect();
        (
            Self::register_as(QUOTA_REQUESTS, rule),
            metrics::counter!(QUOTA_WARNINGS, "rule" => rule.to_owned()),
            used,
        )
    }

    fn register_as(name: &'static str, rule: &str) -> Self {
        Self::register_labels(name, rule, None)
    }

    fn register_labels(name: &'static str, rule: &str, plan: Option<&str>) -> Self {
        metrics::describe_counter!(
            name,
            "Requests decided by a tollgate limit, by rule and outcome"
        );
        metrics::describe_histogram!(
            RETRY_AFTER,
            metrics::Unit::Seconds,
            "Retry-After of requests denied for now"
        );
        if name == REQUESTS {
            metrics::describe_histogram!(
                REMAINING,
                "What a tollgate rate limit left of its limit at each decision, from 0 to 1"
            );
        }
        let mut labels = vec![metrics::Label::new("rule", rule.to_owned())];
        if let Some(plan) = plan {
            labels.push(metrics::Label::new("plan", plan.to_owned()));
        }
        let counter = |outcome: &'static str| {
            let mut labels = labels.clone();
            labels.push(metrics::Label::new("outcome", outcome));
            metrics::counter!(name, labels)
        };
        Self {
            allowed: counter("allowed"),
            limited: counter("limited"),
            too_costly: counter("too_costly"),
            shadow_limited: counter("shadow_limited"),
            missing_key: counter("missing_key"),
            unkeyed: counter("unkeyed"),
            store_error: counter("store_error"),
            remaining: if name == REQUESTS {
                metrics::histogram!(REMAINING, labels.clone())
            } else {
                Histogram::noop()
            },
            retry_after: metrics::histogram!(RETRY_AFTER, labels.clone()),
            repeat: counter("idempotent_repeat"),
            strike: counter("strike"),
            blocked: counter("blocked"),
            slowed: counter("slowed"),
            challenge_passed: counter("challenge_passed"),
            challenge_failed: counter("challenge_failed"),
            warned: counter("warned"),
            message_allowed: counter("message_allowed"),
            message_limited: counter("message_limited"),
        }
    }
}

impl Metrics {
    /// Records what `d` left of its limit, as a share (a decision
    /// without a limit records nothing).
    pub(crate) fn record_remaining(&self, d: &tollgate_core::Decision) {
        if d.limit > 0 {
            #[allow(clippy::cast_precision_loss)] // a metric's value
            self.remaining
                .record(d.remaining.min(d.limit) as f64 / d.limit as f64);
        }
    }
}

/// The `outcome` of a decision in `tollgate_route_requests_total` (an
/// admitted request: `allowed`).
#[cfg(feature = "axum")]
pub(crate) fn route_outcome(outcome: tollgate_core::Outcome, shadow: bool) -> &'static str {
    match outcome {
        tollgate_core::Outcome::Allow { .. } => "allowed",
        _ if shadow => "shadow_limited",
        tollgate_core::Outcome::Never => "too_costly",
        tollgate_core::Outcome::Deny { .. } => "limited",
    }
}

/// Counts one decision of `rule` on `req` under axum's matched route (a
/// layer's `route_label`). The label is a route template, or `unmatched`
/// — always, for a layer outside the `Router` (use `route_layer`), which
/// sees no matched route. The route is only known per request, so each
/// (rule, route, outcome) counter is kept in a per-thread cache
/// ([`RouteCounters`]): a counter found there is a pointer comparison and
/// a short string comparison, where a registry lookup hashed and compared
/// every label and allocated the route's. A kept counter is looked up in
/// the registry again after [`RouteCounters::REFRESH`] counts on its
/// thread, so that a series an exporter dropped while idle, or a recorder
/// installed late, is found again.
#[cfg(feature = "axum")]
pub(crate) fn count_route<B>(
    rule: &std::sync::Arc<str>,
    req: &http::Request<B>,
    outcome: &'static str,
) {
    let route = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or("unmatched", axum::extract::MatchedPath::as_str);
    RouteCounters::increment(rule, route, outcome);
}

/// A counter of [`count_route`] and what it counts.
#[cfg(feature = "axum")]
struct RouteCounter {
    /// Held, so that no other rule's name can take its address while the
    /// entry lives.
    rule: std::sync::Arc<str>,
    route: Box<str>,
    outcome: &'static str,
    /// The labels' hash.
    hash: u64,
    counter: Counter,
    /// The thread's count when the counter was looked up in the registry.
    registered: u64,
}

/// The route counters a thread used lately, in sets of ways picked by a
/// hash of (rule, route, outcome) ([`Ways`](crate::ways::Ways): any
/// [`RouteCounters::WAYS`] counters are kept together whatever their
/// hashes; a direct-mapped cache let two hot counters evict each other on
/// every request, on some process starts).
#[cfg(feature = "axum")]
struct RouteCounters;

/// A hash of a counter's labels, by their bytes (not their addresses,
/// which vary from run to run), eight at a time (a multiply carries each
/// word into the top bits, which pick its cache entry's set), each label
/// ended by its length.
#[cfg(feature = "axum")]
fn labels_hash(parts: [&[u8]; 3]) -> u64 {
    const K: u64 = 0x517c_c1b7_2722_0a95;
    let mix = |h: u64, w: u64| (h.rotate_left(5) ^ w).wrapping_mul(K);
    let mut h = 0u64;
    for part in parts {
        let mut words = part.chunks_exact(8);
        for w in &mut words {
            h = mix(h, w.try_into().map_or(0, u64::from_le_bytes));
        }
        let rest = words.remainder();
        if !rest.is_empty() {
            let mut tail = [0u8; 8];
            if let Some(t) = tail.get_mut(..rest.len()) {
                t.copy_from_slice(rest);
            }
            h = mix(h, u64::from_le_bytes(tail));
        }
        h = mix(h, part.len() as u64);
    }
    h
}

#[cfg(feature = "axum")]
impl RouteCounters {
    const WAYS: usize = 8;
    /// Counts on a thread after which a kept counter is looked up again.
    pub(crate) const REFRESH: u64 = 4_096;

    fn increment(rule: &std::sync::Arc<str>, route: &str, outcome: &'static str) {
        type Kept = crate::ways::Ways<RouteCounter, 64, { RouteCounters::WAYS }>;
        thread_local! {
            // Allocated on the thread's first count; its tick counts the
            // thread's counts.
            static COUNTERS: std::cell::RefCell<Option<Box<Kept>>> =
                const { std::cell::RefCell::new(None) };
        }
        let h = labels_hash([rule.as_bytes(), route.as_bytes(), outcome.as_bytes()]);
        let set = Kept::set_of(h);
        let this = |e: &RouteCounter| {
            e.hash == h
                && std::sync::Arc::ptr_eq(&e.rule, rule)
                && e.outcome == outcome
                && *e.route == *route
        };
        let counted = COUNTERS.try_with(|counters| {
            let mut counters = counters.try_borrow_mut().ok()?;
            let kept = counters.get_or_insert_with(|| Box::new(Kept::new()));
            let counts = kept.tick();
            if let Some(e) = kept.find(set, this) {
                if counts.wrapping_sub(e.registered) < Self::REFRESH {
                    e.counter.increment(1);
                    return Some(());
                }
            }
            let fresh = RouteCounter {
                rule: std::sync::Arc::clone(rule),
                route: route.into(),
                outcome,
                hash: h,
                counter: Self::register(rule, route, outcome),
                registered: counts,
            };
            kept.put(set, this, fresh).map(|e| e.counter.increment(1))
        });
        // A thread being torn down (or a re-entrant call) counts through
        // the registry.
        if !matches!(counted, Ok(Some(()))) {
            Self::register(rule, route, outcome).increment(1);
        }
    }

    #[cfg(test)]
    pub(crate) fn hash_of(rule: &str, route: &str, outcome: &str) -> u64 {
        labels_hash([rule.as_bytes(), route.as_bytes(), outcome.as_bytes()])
    }

    fn register(rule: &std::sync::Arc<str>, route: &str, outcome: &'static str) -> Counter {
        #[cfg(test)]
        route_counter_tests::REGISTERED.with(|n| n.set(n.get().saturating_add(1)));
        metrics::counter!(
            "tollgate_route_requests_total",
            "rule" => std::sync::Arc::clone(rule),
            "route" => route.to_owned(),
            "outcome" => outcome
        )
    }
}

pub(crate) const CONCURRENCY: &str = "tollgate_concurrency_requests_total";
const IN_FLIGHT: &str = "tollgate_concurrency_in_flight";
const LIMIT: &str = "tollgate_concurrency_limit";
const RECHECKS: &str = "tollgate_concurrency_queue_rechecks_total";

/// The handles of one concurrency layer.
#[derive(Debug, Clone)]
pub(crate) struct ConcurrencyMetrics {
    pub(crate) allowed: Counter,
    pub(crate) limited: Counter,
    pub(crate) too_costly: Counter,
    pub(crate) queued: Counter,
    pub(crate) queue_full: Counter,
    pub(crate) queue_timeout: Counter,
    pub(crate) shadow_limited: Counter,
    pub(crate) missing_key: Counter,
    pub(crate) unkeyed: Counter,
    pub(crate) store_error: Counter,
    pub(crate) read_only: Counter,
    pub(crate) in_flight: metrics::Gauge,
    /// Acquires a queued request made on its own timer (not woken by a
    /// release this process saw): each is a store call on Redis.
    pub(crate) rechecks: Counter,
    /// A response body ended at the layer's `max_lifetime`.
    pub(crate) lifetime_ended: Counter,
}

impl ConcurrencyMetrics {
    /// Registers the handles of the layer named `rule`.
    pub(crate) fn register(rule: &str) -> Self {
        metrics::describe_counter!(
            CONCURRENCY,
            "Requests decided by a tollgate concurrency limit, by rule and outcome"
        );
        metrics::describe_gauge!(
            IN_FLIGHT,
            "Permits held through a tollgate concurrency layer"
        );
        metrics::describe_gauge!(
            LIMIT,
            "The current value of a tollgate adaptive concurrency limit"
        );
        metrics::describe_counter!(
            RECHECKS,
            "Acquires a queued request made on its own timer (store calls on Redis)"
        );
        let counter = |outcome: &'static str| metrics::counter!(CONCURRENCY, "rule" => rule.to_owned(), "outcome" => outcome);
        Self {
            allowed: counter("allowed"),
            limited: counter("limited"),
            too_costly: counter("too_costly"),
            queued: counter("queued"),
            queue_full: counter("queue_full"),
            queue_timeout: counter("queue_timeout"),
            shadow_limited: counter("shadow_limited"),
            missing_key: counter("missing_key"),
            unkeyed: counter("unkeyed"),
            store_error: counter("store_error"),
            read_only: counter("read_only"),
            in_flight: metrics::gauge!(IN_FLIGHT, "rule" => rule.to_owned()),
            rechecks: metrics::counter!(RECHECKS, "rule" => rule.to_owned()),
            lifetime_ended: counter("lifetime_ended"),
        }
    }

    /// The gauge of an adaptive limit's current value.
    pub(crate) fn limit(rule: &str) -> metrics::Gauge {
        metrics::gauge!(LIMIT, "rule" => rule.to_owned())
    }
}

/// The handles of one direction (`request` or `response` bodies) of a
/// bandwidth layer.
#[derive(Debug)]
pub(crate) struct BandwidthMetrics {
    /// Bytes let out through a pacer.
    pub(crate) bytes: Counter,
    /// Each wait for the byte budget.
    pub(crate) wait: Histogram,
    /// Bodies no longer paced: the store failed, or a chunk could never
    /// fit.
    pub(crate) unpaced: Counter,
}

impl BandwidthMetrics {
    /// Registers the handles of `rule`'s `direction`.
    pub(crate) fn register(rule: &str, direction: &'static str) -> Self {
        metrics::describe_counter!(
            "tollgate_bandwidth_bytes_total",
            metrics::Unit::Bytes,
            "Body bytes let out through a tollgate bandwidth limit"
        );
        metrics::describe_histogram!(
            "tollgate_bandwidth_wait_seconds",
            metrics::Unit::Seconds,
            "Each wait of a paced body for its byte budget"
        );
        metrics::describe_counter!(
            "tollgate_bandwidth_unpaced_total",
            "Bodies a tollgate bandwidth limit stopped pacing (store failed, or a chunk never fits)"
        );
        let labels = [
            metrics::Label::new("rule", rule.to_owned()),
            metrics::Label::new("direction", direction),
        ];
        Self {
            bytes: metrics::counter!("tollgate_bandwidth_bytes_total", labels.iter()),
            wait: metrics::histogram!("tollgate_bandwidth_wait_seconds", labels.iter()),
            unpaced: metrics::counter!("tollgate_bandwidth_unpaced_total", labels.iter()),
        }
    }
}

impl BandwidthMetrics {
    /// A bandwidth layer's keyless requests: `(unkeyed, missing_key)`.
    pub(crate) fn keyless(rule: &str) -> (Counter, Counter) {
        metrics::describe_counter!(
            "tollgate_bandwidth_requests_total",
            "Requests a tollgate bandwidth limit could not key: refused, or let through unpaced"
        );
        let counter = |outcome: &'static str| {
            metrics::counter!(
                "tollgate_bandwidth_requests_total",
                "rule" => rule.to_owned(),
                "outcome" => outcome
            )
        };
        (counter("unkeyed"), counter("missing_key"))
    }
}

/// When a store fault was last logged (seconds since the Unix epoch).
static LAST_FAULT_LOG: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Logs that a layer's store failed and the request was let through — at
/// most once a second across the process, not once a request: an outage
/// fails every call, and a log line per request would drown the logs (the
/// metric counts every one).
pub(crate) fn store_fault(layer: &'static str, rule: &str, error: &tollgate_core::StoreError) {
    let second = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    if LAST_FAULT_LOG.swap(second, std::sync::atomic::Ordering::Relaxed) != second {
        tracing::warn!(
            target: "tollgate",
            layer,
            rule = %rule,
            %error,
            "limiter store failed; letting requests through (logged at most once a second)"
        );
    }
}

const RETRY_BUDGET: &str = "tollgate_retry_budget_remaining";

/// The handles of one retry budget layer (labelled by the budget's name,
/// which names the upstream).
#[derive(Debug, Clone)]
pub(crate) struct RetryMetrics {
    pub(crate) calls: Counter,
    pub(crate) retries: Counter,
    pub(crate) exhausted: Counter,
    pub(crate) throttled: Counter,
    pub(crate) hedges: Counter,
    /// The budget's balance (in retries) after each withdrawal.
    pub(crate) budget: Histogram,
}

impl RetryMetrics {
    pub(crate) fn register(rule: &str) -> Self {
        metrics::describe_counter!(
            "tollgate_retry_calls_total",
            "Calls through a tollgate retry budget layer"
        );
        metrics::describe_counter!(
            "tollgate_retries_total",
            "Retries made by a tollgate retry budget layer"
        );
        metrics::describe_counter!(
            "tollgate_retry_budget_exhausted_total",
            "Retries a tollgate retry budget refused"
        );
        metrics::describe_counter!(
            "tollgate_retry_throttled_total",
            "Calls refused locally by tollgate's adaptive throttling"
        );
        metrics::describe_counter!(
            "tollgate_retry_hedges_total",
            "Hedged attempts sent by a tollgate retry budget layer"
        );
        metrics::describe_histogram!(
            RETRY_BUDGET,
            "Retries a tollgate retry budget still held after each withdrawal"
        );
        Self {
            calls: metrics::counter!("tollgate_retry_calls_total", "rule" => rule.to_owned()),
            retries: metrics::counter!("tollgate_retries_total", "rule" => rule.to_owned()),
            exhausted: metrics::counter!("tollgate_retry_budget_exhausted_total", "rule" => rule.to_owned()),
            throttled: metrics::counter!("tollgate_retry_throttled_total", "rule" => rule.to_owned()),
            hedges: metrics::counter!("tollgate_retry_hedges_total", "rule" => rule.to_owned()),
            budget: metrics::histogram!(RETRY_BUDGET, "rule" => rule.to_owned()),
        }
    }
}

/// Sampled decision logs: a `tracing` event (target `tollgate::decision`,
/// level INFO) for a share of decisions, set per outcome, with the rule,
/// the outcome, what remains, why a request was refused, and a keyed hash
/// of the client key (never the key: it is personal data). Off by
/// default; a policy takes one with
/// [`decision_log`](crate::policy::PolicyLayerBuilder::decision_log).
///
/// ```
/// use tollgate::observe::DecisionLog;
/// // Every refusal, and one admitted request in a hundred.
/// let log = DecisionLog::new().limited(1.0).allowed(0.01);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DecisionLog {
    allowed: f64,
    limited: f64,
}

impl DecisionLog {
    /// Logs nothing until told to.
    pub fn new() -> Self {
        Self::default()
    }

    /// The share (0.0 to 1.0) of admitted requests logged.
    pub fn allowed(mut self, share: f64) -> Self {
        self.allowed = share;
        self
    }

    /// The share (0.0 to 1.0) of refused requests logged.
    pub fn limited(mut self, share: f64) -> Self {
        self.limited = share;
        self
    }

    /// Whether the shares are from 0 to 1.
    pub(crate) fn is_valid(&self) -> bool {
        (0.0..=1.0).contains(&self.allowed) && (0.0..=1.0).contains(&self.limited)
    }

    /// Whether to log this decision (`refused` or admitted).
    pub(crate) fn sample(&self, refused: bool) -> bool {
        let share = if refused { self.limited } else { self.allowed };
        if share <= 0.0 {
            return false;
        }
        if share >= 1.0 {
            return true;
        }
        random_unit() < share
    }
}

/// A number in [0, 1) from a per-thread xorshift64*: cheap, and good
/// enough to sample logs with and to spread wake-ups (not for secrets).
pub(crate) fn random_unit() -> f64 {
    thread_local! {
        static STATE: std::cell::Cell<u64> = std::cell::Cell::new({
            use std::hash::BuildHasher;
            std::collections::hash_map::RandomState::new().hash_one(0u8) | 1
        });
    }
    let draw = STATE.with(|s| {
        let mut x = s.get();
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        s.set(x);
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    });
    #[allow(clippy::cast_precision_loss)]
    let unit = (draw >> 11) as f64 / (1u64 << 53) as f64;
    unit
}

/// One refusal on an audited rule, for an audit trail: never the client
/// key, a keyed hash of it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct AuditRecord {
    /// The rule that refused.
    pub rule: std::sync::Arc<str>,
    /// Why: `limited`, `too_costly`, `blocked`, `missing_key`, `denied`
    /// (an access list).
    pub reason: &'static str,
    /// A keyed hash of the client key (stable within a process).
    pub key: crate::key::Fingerprint,
    /// The wait given, in milliseconds rounded up (0: none).
    pub retry_after_ms: u64,
    /// When, in Unix milliseconds.
    pub unix_ms: u64,
}

/// Where a policy's audit records go (see
/// [`audit`](crate::policy::PolicyLayerBuilder::audit)). `record` is
/// called on the request's path: it must not wait (queue and return).
pub trait AuditSink: Send + Sync + 'static {
    /// Takes one record.
    fn record(&self, record: &AuditRecord);
}

/// An audit sink that writes each record as a `tracing` event (target
/// `tollgate::audit`, level INFO, fields `rule`, `reason`, `key` — a
/// keyed fingerprint, never the key —, `retry_after_ms`, `unix_ms`):
/// what a policy file's `[audit]` records with. The policy's gate keeps
/// it to one record per client, rule and reason a second, and at most
/// `audit_per_second` records a second per rule.
#[derive(Debug, Clone, Copy, Default)]
pub struct LogAudit;

impl AuditSink for LogAudit {
    fn record(&self, r: &AuditRecord) {
        tracing::info!(
            target: "tollgate::audit",
            rule = %r.rule,
            reason = r.reason,
            key = %r.key,
            retry_after_ms = r.retry_after_ms,
            unix_ms = r.unix_ms,
            "refused"
        );
    }
}

/// What a policy hands its audit sink: at most one record per rule,
/// client fingerprint and reason in each wall-clock second (the repeats of
/// a client that floods refused requests are folded, and counted in
/// `tollgate_audit_folded_total{rule}`), and at most `per_second` records
/// a second for each audited rule (the rest counted in
/// `tollgate_audit_suppressed_total{rule}`): a flood of refused requests,
/// each cheap to refuse, cannot make the audit trail — on Redis, writes
/// on the decisions' own connection — the flood's amplifier, and a flood
/// on one rule cannot crowd out another rule's records.
pub(crate) struct AuditGate {
    sink: std::sync::Arc<dyn AuditSink>,
    per_second: u32,
    /// A record's tag (its rule, key, reason and second, hashed) in the
    /// slot its tag picks: a repeat finds itself there. Lossy (two
    /// records may share a slot, and then both are sent), never unbounded.
    seen: Box<[std::sync::atomic::AtomicU64]>,
    /// Per audited rule (by name): the current second (high 32 bits) and
    /// the records sent in it, and its counters.
    rules: Vec<GateRule>,
}

struct GateRule {
    name: std::sync::Arc<str>,
    window: std::sync::atomic::AtomicU64,
    folded: metrics::Counter,
    suppressed: metrics::Counter,
}

impl AuditGate {
    const SLOTS: usize = 4_096;
    /// The low bits of a tag that pick its slot (`SLOTS` is a power of two).
    const MASK: u64 = 4_095;

    /// A gate for the audited `rules` (and access list), each with
    /// `per_second` records a second.
    pub(crate) fn new(
        sink: std::sync::Arc<dyn AuditSink>,
        per_second: u32,
        rules: &[std::sync::Arc<str>],
    ) -> Self {
        metrics::describe_counter!(
            "tollgate_audit_folded_total",
            "Audit records folded: a rule's refusal of a client it already recorded this second"
        );
        metrics::describe_counter!(
            "tollgate_audit_suppressed_total",
            "Audit records not sent: more than the policy's audit records a second for the rule"
        );
        Self {
            sink,
            per_second,
            seen: (0..Self::SLOTS)
                .map(|_| std::sync::atomic::AtomicU64::new(0))
                .collect(),
            rules: rules
                .iter()
                .map(|name| GateRule {
                    name: std::sync::Arc::clone(name),
                    window: std::sync::atomic::AtomicU64::new(0),
                    folded: metrics::counter!("tollgate_audit_folded_total", "rule" => name.to_string()),
                    suppressed: metrics::counter!("tollgate_audit_suppressed_total", "rule" => name.to_string()),
                })
                .collect(),
        }
    }
}

impl AuditSink for AuditGate {
    fn record(&self, r: &AuditRecord) {
        use std::hash::BuildHasher;
        use std::sync::atomic::Ordering;
        // Only the rules it was made for reach a gate.
        let Some(rule) = self.rules.iter().find(|g| *g.name == *r.rule) else {
            return;
        };
        let second = r.unix_ms / 1_000;
        let tag =
            std::hash::BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default()
                .hash_one((&*r.rule, r.reason, r.key.0, second))
                | 1;
        let slot = usize::try_from(tag & Self::MASK).unwrap_or(0);
        if let Some(seen) = self.seen.get(slot) {
            if seen.swap(tag, Ordering::Relaxed) == tag {
                rule.folded.increment(1);
                return;
            }
        }
        let second = second & u64::from(u32::MAX);
        let sent = rule
            .window
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |w| {
                let (s, n) = (w >> 32, w & u64::from(u32::MAX));
                if s != second {
                    Some(second << 32 | 1)
                } else if n < u64::from(self.per_second) {
                    Some(w.saturating_add(1))
                } else {
                    None
                }
            });
        if sent.is_err() {
            rule.suppressed.increment(1);
            return;
        }
        self.sink.record(r);
    }
}

#[cfg(feature = "redis")]
impl AuditSink for tollgate_redis::RedisAudit {
    fn record(&self, r: &AuditRecord) {
        tollgate_redis::RedisAudit::record(
            self,
            vec![
                ("rule", r.rule.to_string()),
                ("reason", r.reason.to_owned()),
                ("key", r.key.to_string()),
                ("retry_after_ms", r.retry_after_ms.to_string()),
                ("unix_ms", r.unix_ms.to_string()),
            ],
        );
    }
}

#[cfg(test)]
mod audit_gate_tests {
    use std::sync::{Arc, Mutex};

    use super::{AuditGate, AuditRecord, AuditSink};

    #[derive(Default)]
    struct Kept(Mutex<Vec<(String, u64)>>);

    impl AuditSink for Kept {
        fn record(&self, r: &AuditRecord) {
            self.0.lock().unwrap().push((r.rule.to_string(), r.key.0));
        }
    }

    fn record(rule: &str, key: u64, unix_ms: u64) -> AuditRecord {
        AuditRecord {
            rule: rule.into(),
            reason: "limited",
            key: crate::key::Fingerprint(key),
            retry_after_ms: 0,
            unix_ms,
        }
    }

    /// Policy-security review #10: a client flooding refused requests
    /// made one audit write per request. Now: one per rule, client and
    /// second, and at most `per_second` in all.
    #[test]
    fn a_flood_of_refusals_is_one_record_per_client_and_second() {
        let kept = Arc::new(Kept::default());
        let rules: Vec<Arc<str>> = vec!["per-key".into(), "per-ip".into()];
        let gate = AuditGate::new(Arc::clone(&kept) as Arc<dyn AuditSink>, 100, &rules);
        for ms in 0..1_000 {
            gate.record(&record("per-key", 7, 5_000 + ms));
        }
        assert_eq!(kept.0.lock().unwrap().len(), 1, "one record in a second");
        // The next second, and another rule, are records of their own.
        gate.record(&record("per-key", 7, 6_000));
        gate.record(&record("per-ip", 7, 6_000));
        assert_eq!(kept.0.lock().unwrap().len(), 3);
        // Distinct clients: at most 100 a second for the rule (one sent in
        // it already).
        for key in 0..1_000 {
            gate.record(&record("per-key", 1_000 + key, 6_500));
        }
        assert_eq!(kept.0.lock().unwrap().len(), 1 + 1 + 100);
        // Another rule has a budget of its own that second.
        for key in 0..50 {
            gate.record(&record("per-ip", 5_000 + key, 6_700));
        }
        assert_eq!(kept.0.lock().unwrap().len(), 102 + 50);
        // A new second opens the window again.
        gate.record(&record("per-key", 42, 7_000));
        assert_eq!(kept.0.lock().unwrap().len(), 153);
    }
}

#[cfg(test)]
mod decision_log_tests {
    use super::DecisionLog;

    #[test]
    fn a_share_of_decisions_is_logged_per_outcome() {
        let log = DecisionLog::new().allowed(0.25).limited(1.0);
        let n = 100_000;
        let sampled = (0..n).filter(|_| log.sample(false)).count();
        #[allow(clippy::cast_precision_loss)]
        let share = sampled as f64 / f64::from(n);
        assert!((share - 0.25).abs() < 0.01, "{share}");
        assert!((0..1_000).all(|_| log.sample(true)));
        assert!(!(0..1_000).any(|_| DecisionLog::new().sample(true)));
    }
}

#[cfg(all(test, feature = "axum"))]
mod route_counter_tests {
    use super::{count_route, RouteCounters};
    use crate::rate_limit::tests::Recorded;

    thread_local! {
        /// Registry lookups of route counters made on this thread.
        pub(super) static REGISTERED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    }

    #[test]
    fn a_few_hot_counters_are_kept_whatever_their_hashes() {
        // As many counters as a set has ways, counted in turn, many
        // times: each is looked up once, then again only every REFRESH
        // counts (a direct-mapped cache let two of them evict each other
        // on every count when their hashes met).
        let rules: Vec<std::sync::Arc<str>> = (0..RouteCounters::WAYS)
            .map(|i| format!("rule-{i}").into())
            .collect();
        let req = http::Request::new(());
        let rec = Recorded::default();
        let rounds = 2_000u64;
        let before = REGISTERED.with(std::cell::Cell::get);
        metrics::with_local_recorder(&rec, || {
            for _ in 0..rounds {
                for (i, rule) in rules.iter().enumerate() {
                    count_route(rule, &req, if i % 2 == 0 { "allowed" } else { "limited" });
                }
            }
        });
        let lookups = REGISTERED.with(std::cell::Cell::get) - before;
        let counts = rounds * rules.len() as u64;
        let most = rules.len() as u64 * (1 + counts / RouteCounters::REFRESH);
        assert!(lookups <= most, "{lookups} lookups for {counts} counts");
        for (i, rule) in rules.iter().enumerate() {
            let outcome = if i % 2 == 0 { "allowed" } else { "limited" };
            let series = format!(
                "tollgate_route_requests_total{{rule={rule},route=unmatched,outcome={outcome}}}"
            );
            assert_eq!(rec.get(&series), rounds, "{series}");
        }
    }

    #[test]
    fn labels_hash_apart_and_spread_over_the_sets() {
        let h = RouteCounters::hash_of;
        // Where one label ends is part of the hash.
        assert_ne!(h("ab", "c", "allowed"), h("a", "bc", "allowed"));
        assert_ne!(h("rule-1", "/a", "allowed"), h("rule-1", "/a", "limited"));
        assert_ne!(h("", "", "x"), h("", "x", ""));
        assert_eq!(
            h("per-key", "/api/hello", "allowed"),
            h("per-key", "/api/hello", "allowed")
        );
        // Rules and routes alike spread over the top bits (which pick
        // the cache's set): 512 counters take at least 56 of the 64
        // values of the top six.
        let mut used = [false; 64];
        for rule in 0..32 {
            for route in 0..16 {
                let top = h(&format!("rule-{rule}"), &format!("/r/{route}"), "allowed") >> 58;
                let set = usize::try_from(top).unwrap_or(0);
                if let Some(u) = used.get_mut(set) {
                    *u = true;
                }
            }
        }
        let sets = used.iter().filter(|u| **u).count();
        assert!(sets >= 56, "{sets} values of 64");
    }

    #[test]
    fn kept_counters_are_looked_up_again() {
        let rule: std::sync::Arc<str> = "late".into();
        let req = http::Request::new(());
        let series = "tollgate_route_requests_total{rule=late,route=unmatched,outcome=allowed}";
        let (first, second) = (Recorded::default(), Recorded::default());
        metrics::with_local_recorder(&first, || count_route(&rule, &req, "allowed"));
        assert_eq!(first.get(series), 1);
        // Another recorder on this thread (as when one is installed after
        // traffic began): the kept counter still counts into the first
        // until it is looked up again, then into the second.
        let n = RouteCounters::REFRESH + 100;
        metrics::with_local_recorder(&second, || {
            for _ in 0..n {
                count_route(&rule, &req, "allowed");
            }
        });
        let (a, b) = (first.get(series), second.get(series));
        assert_eq!(a + b, n + 1);
        assert!(b >= 100, "the second recorder got {b} of {n}");
        assert!(a <= RouteCounters::REFRESH, "the first kept {a}");
    }
}
