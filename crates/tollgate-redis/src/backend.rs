//! The store's side of Redis: the connection with its timeout, circuit
//! breaker and fault counters. Every script call goes through
//! [`Backend::run`], so every call is bounded, counted and, when Redis is
//! dead, skipped.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tollgate_core::{Clock, StoreError, StoreErrorKind, SystemClock};

use crate::breaker::{now_nanos, Breaker, Pass};
use crate::conn::Conn;
use crate::policy::FailurePolicy;
use crate::scripts::{Reply, Script};

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
    /// Connects started (the first included; on a Cluster, each goes to
    /// the seeds and every node): more than one means the connection was
    /// replaced, or is being.
    pub connects: u64,
}

/// One outcome of a store call: counted for [`RedisStats`] and exported
/// as `tollgate_store_calls_total{store="redis", result=...}`.
#[derive(Debug)]
struct Tally {
    count: AtomicU64,
    metric: metrics::Counter,
}

impl Tally {
    fn new(result: &'static str, name: &str) -> Self {
        Self {
            count: AtomicU64::new(0),
            metric: metrics::counter!(
                "tollgate_store_calls_total",
                "store" => "redis",
                "name" => name.to_owned(),
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
    /// `tollgate_store_call_seconds{store="redis"}`: each call's time,
    /// answered or not (a skipped call is not timed).
    latency: metrics::Histogram,
    /// `tollgate_store_breaker_open{store="redis"}`: the share of the
    /// store's breakers that are open (1 or 0 on one server; on a Cluster
    /// the share of slot ranges whose calls are skipped); formerly 1 while the breaker
    /// is open.
    breaker: metrics::Gauge,
}

impl Counters {
    fn register(prefix: &str, name: &str) -> Self {
        metrics::describe_counter!(
            "tollgate_store_calls_total",
            "Calls to the Redis store by result: ok, error, timeout, skipped (breaker open)"
        );
        metrics::describe_histogram!(
            "tollgate_store_call_seconds",
            metrics::Unit::Seconds,
            "Time of each call to the Redis store, answered or not"
        );
        metrics::describe_gauge!(
            "tollgate_store_breaker_open",
            "1 while the Redis store's circuit breaker is open"
        );
        metrics::describe_counter!(
            "tollgate_store_node_calls_total",
            "Calls to the Redis store by node (a Cluster master's address; `server` \
             for one server) and result: for shard balance"
        );
        metrics::describe_histogram!(
            "tollgate_store_node_call_seconds",
            metrics::Unit::Seconds,
            "Time of each call to the Redis store, by node"
        );
        Self {
            ok: Tally::new("ok", name),
            errors: Tally::new("error", name),
            timeouts: Tally::new("timeout", name),
            skipped: Tally::new("skipped", name),
            last_log: AtomicU64::new(0),
            latency: metrics::histogram!(
                "tollgate_store_call_seconds",
                "store" => "redis",
                "name" => name.to_owned()
            ),
            breaker: metrics::gauge!(
                "tollgate_store_breaker_open",
                "store" => "redis",
                "name" => name.to_owned(),
                "prefix" => prefix.to_owned()
            ),
        }
    }
}

/// One Cluster node's calls (a master's, by address), for shard balance:
/// `tollgate_store_node_calls_total{store="redis", name, node, result}`
/// and `tollgate_store_node_call_seconds{store="redis", name, node}`.
#[derive(Debug)]
struct Node {
    ok: metrics::Counter,
    errors: metrics::Counter,
    timeouts: metrics::Counter,
    skipped: metrics::Counter,
    latency: metrics::Histogram,
}

impl Node {
    fn register(name: &str, node: String) -> Self {
        let calls = |result: &'static str| {
            metrics::counter!(
                "tollgate_store_node_calls_total",
                "store" => "redis",
                "name" => name.to_owned(),
                "node" => node.clone(),
                "result" => result
            )
        };
        Self {
            ok: calls("ok"),
            errors: calls("error"),
            timeouts: calls("timeout"),
            skipped: calls("skipped"),
            latency: metrics::histogram!(
                "tollgate_store_node_call_seconds",
                "store" => "redis",
                "name" => name.to_owned(),
                "node" => node
            ),
        }
    }
}

pub(crate) type SharedClock = Arc<dyn Clock>;

/// A call that got no answer, and whether it may have reached Redis
/// (only a call the breaker skipped surely did not).
#[derive(Debug)]
pub(crate) struct Fault {
    pub(crate) error: StoreError,
    pub(crate) maybe_sent: bool,
}

/// The connection and what guards it; shared by a store, its limiters and
/// its lease task.
pub(crate) struct Backend {
    conn: Conn,
    pub(crate) prefix: Arc<str>,
    /// How its keys are named.
    pub(crate) names: crate::key::KeyNames,
    pub(crate) timeout: Duration,
    pub(crate) policy: FailurePolicy,
    client_time: Option<SharedClock>,
    /// One breaker per Cluster master (by the slot map; per fixed slot
    /// range before it is read), one where every key is on one server: a
    /// lost master opens its own breaker only.
    breakers: Box<[Breaker]>,
    counters: Counters,
    /// The store's name in its metrics.
    name: Arc<str>,
    /// Per group (a Cluster master, see `breakers`), its node's metrics,
    /// registered at the group's first call (by then a master's address
    /// is known).
    nodes: Box<[std::sync::OnceLock<Node>]>,
    /// The retry budgets bound, by rule name: a rule bound twice shares
    /// its counted deposits (see [`crate::RedisRetryBudget`]).
    pub(crate) retry_budgets: crate::retry_budget::Bindings,
    /// The audit streams asked for, by (name, maxlen, capacity): one
    /// queue and task each however often they are asked for.
    pub(crate) audits:
        std::sync::Mutex<std::collections::HashMap<(String, usize, usize), crate::audit::Kept>>,
}

/// The settings a [`Backend`] is made of.
pub(crate) struct BackendConfig {
    pub(crate) conn: Conn,
    pub(crate) prefix: Arc<str>,
    /// The store's name in its metrics.
    pub(crate) name: Arc<str>,
    pub(crate) names: crate::key::KeyNames,
    pub(crate) timeout: Duration,
    pub(crate) policy: FailurePolicy,
    pub(crate) client_time: Option<SharedClock>,
    /// Makes each breaker (one per slot range).
    pub(crate) breaker: Box<dyn Fn() -> Breaker + Send>,
}

impl Backend {
    pub(crate) fn new(config: BackendConfig) -> Self {
        let counters = Counters::register(&config.prefix, &config.name);
        let breakers = (0..config.conn.ranges())
            .map(|_| (config.breaker)())
            .collect();
        let nodes: Box<[std::sync::OnceLock<Node>]> = (0..config.conn.ranges())
            .map(|_| std::sync::OnceLock::new())
            .collect();
        // One server: its node is known now, and exported with the rest.
        if let [one] = &*nodes {
            one.get_or_init(|| Node::register(&config.name, config.conn.group_name(0)));
        }
        Self {
            conn: config.conn,
            prefix: config.prefix,
            names: config.names,
            timeout: config.timeout,
            policy: config.policy,
            client_time: config.client_time,
            breakers,
            counters,
            name: config.name,
            nodes,
            retry_budgets: crate::retry_budget::Bindings::default(),
            audits: std::sync::Mutex::default(),
        }
    }

    pub(crate) fn stats(&self) -> RedisStats {
        let c = &self.counters;
        RedisStats {
            ok: c.ok.get(),
            errors: c.errors.get(),
            timeouts: c.timeouts.get(),
            skipped: c.skipped.get(),
            connects: self.conn.connects(),
        }
    }

    /// The connection, for what is not a script call (the audit stream).
    pub(crate) fn conn(&self) -> &Conn {
        &self.conn
    }

    pub(crate) fn breaker_open(&self) -> bool {
        self.breakers.iter().any(Breaker::is_open)
    }

    /// The share of the store's breakers that are open: 0 or 1 where every
    /// key is on one server; on a Cluster, of its groups (masters, and the
    /// fixed slot ranges used before the slot map is read).
    fn open_share(&self) -> f64 {
        let open = self.breakers.iter().filter(|b| b.is_open()).count();
        #[allow(clippy::cast_precision_loss)] // at most 64
        let share = open as f64 / self.breakers.len().max(1) as f64;
        share
    }

    /// The time argument of a script: the client clock's Unix time in
    /// ns, or `''` (the script reads Redis's `TIME`).
    pub(crate) fn now_arg(&self) -> String {
        self.client_time
            .as_ref()
            .map(|c| c.unix_now().to_string())
            .unwrap_or_default()
    }

    /// The Unix time in ns the scripts would read, as best this process
    /// knows it: the client clock's, or the system's (for answers of the
    /// failure policy that name calendar periods).
    pub(crate) fn unix_now(&self) -> u64 {
        self.client_time
            .as_ref()
            .map_or_else(|| SystemClock.unix_now(), |c| c.unix_now())
    }

    /// Runs `script` with the breaker and the timeout; `Err` if Redis did
    /// not answer (the caller applies the failure policy).
    pub(crate) async fn run(
        &self,
        script: &Script,
        keys: &[&str],
        args: &[&str],
    ) -> Result<Reply, StoreError> {
        self.call(script, keys, args).await.map_err(|f| f.error)
    }

    /// [`run`](Self::run), saying on failure whether the call may have
    /// reached Redis (and the script run, its reply lost or late).
    pub(crate) async fn call(
        &self,
        script: &Script,
        keys: &[&str],
        args: &[&str],
    ) -> Result<Reply, Fault> {
        let range = self.conn.range_of(keys);
        let breaker = self
            .breakers
            .get(range)
            .or_else(|| self.breakers.first())
            .ok_or_else(|| Fault {
                error: StoreError::new(StoreErrorKind::Unavailable, "no breaker"),
                maybe_sent: false,
            })?;
        let node = self.node(range);
        let count = |pick: fn(&Node) -> &metrics::Counter| {
            if let Some(n) = node {
                pick(n).increment(1);
            }
        };
        let attempt = breaker.enter(now_nanos());
        if attempt.pass() == Pass::Skip {
            self.counters.skipped.add();
            count(|n| &n.skipped);
            self.show_breaker();
            return Err(Fault {
                error: StoreError::new(StoreErrorKind::Unavailable, "circuit breaker open"),
                maybe_sent: false,
            });
        }
        let started = std::time::Instant::now();
        let answer = tokio::time::timeout(self.timeout, self.conn.invoke(script, keys, args)).await;
        let took = started.elapsed().as_secs_f64();
        self.counters.latency.record(took);
        if let Some(n) = node {
            n.latency.record(took);
        }
        let result = match answer {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(e)) if e.is_timeout() => {
                self.counters.timeouts.add();
                count(|n| &n.timeouts);
                Err(StoreError::new(StoreErrorKind::Timeout, e.to_string()))
            }
            Ok(Err(e)) => {
                self.counters.errors.add();
                count(|n| &n.errors);
                Err(StoreError::new(StoreErrorKind::Unavailable, e.to_string()))
            }
            Err(_) => {
                self.counters.timeouts.add();
                count(|n| &n.timeouts);
                Err(StoreError::new(
                    StoreErrorKind::Timeout,
                    format!("no answer within {:?}", self.timeout),
                ))
            }
        };
        match &result {
            Ok(_) => {
                self.counters.ok.add();
                count(|n| &n.ok);
                attempt.success();
                self.show_breaker();
            }
            Err(e) => {
                let opened = attempt.failure(now_nanos());
                self.show_breaker();
                self.log_fault(e, opened);
            }
        }
        result.map_err(|error| Fault {
            error,
            maybe_sent: true,
        })
    }

    /// Group `range`'s node metrics, registered at its first call (every
    /// group has its cell).
    fn node(&self, range: usize) -> Option<&Node> {
        let cell = self.nodes.get(range)?;
        Some(cell.get_or_init(|| Node::register(&self.name, self.conn.group_name(range))))
    }

    /// Sets the breaker gauge from the breaker's state now (read after the
    /// call that may have changed it, so the gauge follows the breaker
    /// rather than the last call's outcome).
    fn show_breaker(&self) {
        self.counters.breaker.set(self.open_share());
    }

    /// Logs a fault at most once a second (an outage fails every call).
    fn log_fault(&self, error: &StoreError, opened: bool) {
        let second = now_nanos() / 1_000_000_000;
        let last = self.counters.last_log.swap(second, Ordering::Relaxed);
        if last != second || opened {
            tracing::warn!(
                target: "tollgate::redis",
                %error,
                breakers_open = self.open_share(),
                policy = ?self.policy,
                "redis store call failed; applying the failure policy \
                 (a lease that could not be released or renewed lapses after its TTL)"
            );
        }
    }
}
