use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Response;
use tollgate_core::adaptive::AdaptiveLimit;
use tollgate_core::{ConcurrencyLimiter, ConcurrencyRule, ConfigError, Store, StoreError};
use tollgate_memory::MemoryStore;
use tower_layer::Layer;

use super::adaptive::{non_critical_ceiling, Adaptive, DropFn, ReadOnly};
use super::critical::AllCritical;
use super::limits::{Limits, PlanLimit, ServiceLimit, StoreLimit, SERVICE_KEY};
use super::queue::Queue;
use super::respond::{RejectFn, Responder};
use super::service::ConcurrencyService;
use crate::cost::Fixed;
use crate::headers::ConcurrencyHeaders;
use crate::key::PeerIp;
use crate::key::{KeyExtractor, Keying, MissingKey};
use crate::observe::ConcurrencyMetrics;
use crate::outcome::Completion;
use crate::policy::access::Listed;
use crate::policy::plan::{Named, PlanSet};
use crate::policy::AccessList;
use crate::rejection::{LimitKind, OnStoreError, Rejected, Rendered};

/// Limits requests in flight per key (and, optionally, for the whole
/// service); see the [module docs](super).
///
/// Cheap to clone; all clones (and so all connections) share one state.
///
/// ```
/// use axum::{routing::get, Router};
/// use tollgate::{concurrency::ConcurrencyLayer, key::Header};
///
/// // At most 2 downloads in flight per API key, 100 for the service.
/// let downloads = ConcurrencyLayer::builder("downloads", 2)
///     .key(Header::named("x-api-key")?)
///     .service_limit("service", 100)
///     .build()?;
/// let app: Router = Router::new().route("/download", get(|| async { "..." })).layer(downloads);
/// # Ok::<(), tollgate::ConfigError>(())
/// ```
pub struct ConcurrencyLayer<K = PeerIp, C = Fixed, P = AllCritical, St: Store = MemoryStore> {
    shared: Arc<Limits<K, C, P, St::ConcurrencyLimiter>>,
}

impl<K, C, P, St: Store> Clone for ConcurrencyLayer<K, C, P, St> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<K, C, P, St: Store> fmt::Debug for ConcurrencyLayer<K, C, P, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConcurrencyLayer")
            .field("rule", &self.shared.per_key.name)
            .field("shadow", &self.shared.shadow)
            .finish_non_exhaustive()
    }
}

impl<S, K, C, P, St: Store> Layer<S> for ConcurrencyLayer<K, C, P, St> {
    type Service = ConcurrencyService<S, K, C, P, St>;

    fn layer(&self, inner: S) -> Self::Service {
        ConcurrencyService::new(inner, Arc::clone(&self.shared))
    }
}

impl<K, C, P, St: Store> ConcurrencyLayer<K, C, P, St> {
    /// The per-key rule's name.
    pub fn rule_name(&self) -> &str {
        &self.shared.per_key.name
    }

    /// The current value of the adaptive service limit, if there is one.
    pub fn adaptive_limit(&self) -> Option<u32> {
        match &self.shared.service {
            Some(ServiceLimit::Adaptive(a)) => Some(a.limit()),
            _ => None,
        }
    }

    /// The per-key limiter. Its keys are the layer's encoding of a
    /// request's key, not the raw header value: to read what a client
    /// holds, use [`held_for`](Self::held_for).
    pub fn limiter(&self) -> &St::ConcurrencyLimiter {
        &self.shared.per_key.limiter
    }

    /// Whether the per-key limit's key is pinned at the store (`None`
    /// before the first request, and for a key that is not fixed).
    #[cfg(test)]
    pub(crate) fn pinned(&self) -> Option<bool> {
        self.shared.per_key.pinned.get().map(Option::is_some)
    }

    /// Whether the fixed service limit's key is pinned at the store.
    #[cfg(test)]
    pub(crate) fn service_pinned(&self) -> bool {
        matches!(&self.shared.service, Some(super::limits::ServiceLimit::Fixed(l))
            if matches!(l.pinned.get(), Some(Some(_))))
    }

    /// The permits the key of `req` holds now, under the per-key limit:
    /// the key the layer would extract from `req` (for a dashboard, a
    /// support tool, a test), `Ok(0)` for a request it finds no key in.
    pub async fn held_for<B>(&self, req: &http::Request<B>) -> Result<u64, StoreError>
    where
        K: KeyExtractor<B>,
    {
        let mut key = crate::key::KeyBuf::new();
        if self.shared.key.extract(req, &mut key).is_none() {
            return Ok(0);
        }
        self.shared.per_key.limiter.held(key.as_bytes()).await
    }
}

impl ConcurrencyLayer<PeerIp, Fixed, AllCritical, MemoryStore> {
    /// Starts a layer allowing `max_in_flight` permits per key under the
    /// rule name `name` (used in headers, store keys and metrics).
    /// Defaults: keyed by peer IP, one permit per request, in-memory
    /// store, every request critical, no queue, standard headers on,
    /// keyless requests refused (400).
    pub fn builder(
        name: &str,
        max_in_flight: u32,
    ) -> ConcurrencyLayerBuilder<PeerIp, Fixed, AllCritical, MemoryStore> {
        ConcurrencyLayerBuilder {
            key: PeerIp::new(),
            cost: Fixed(1),
            critical: AllCritical,
            store: MemoryStore::new(),
            cfg: Config {
                name: name.to_owned(),
                max: max_in_flight,
                lease_ttl: Duration::from_secs(30),
                retry_after: Duration::from_secs(1),
                shadow: false,
                headers: true,
                missing: MissingKey::default(),
                on_store_error: OnStoreError::default(),
                rejection: None,
                share: None,
                queue: None,
                service: None,
                read_only: None,
                read_only_min_requests: None,
                is_drop: None,
                conflict: false,
                upgrades: false,
                max_lifetime: None,
                route_label: false,
                plans: Vec::new(),
                plan_source: None,
                access: None,
                routes: None,
            },
        }
    }
}

/// An error in the service limit's own settings, reported under its field
/// (the per-key rule's errors name `max`, `name`, ...).
fn service_error(e: ConfigError) -> ConfigError {
    ConfigError::new("service_limit", format!("{}: {}", e.field(), e.message()))
}

enum ServiceConfig {
    Fixed(String, u32),
    Adaptive(String, AdaptiveLimit),
}

struct Config {
    name: String,
    max: u32,
    lease_ttl: Duration,
    retry_after: Duration,
    shadow: bool,
    headers: bool,
    missing: MissingKey,
    on_store_error: OnStoreError,
    rejection: Option<RejectFn>,
    share: Option<f64>,
    queue: Option<(usize, Duration)>,
    service: Option<ServiceConfig>,
    read_only: Option<ReadOnly>,
    read_only_min_requests: Option<u32>,
    is_drop: Option<DropFn>,
    /// A fixed and an adaptive service limit were both asked for.
    conflict: bool,
    upgrades: bool,
    max_lifetime: Option<Duration>,
    route_label: bool,
    plans: Vec<(String, u32)>,
    plan_source: Option<Named>,
    access: Option<AccessList>,
    routes: Option<crate::Routes>,
}

/// Builds a [`ConcurrencyLayer`]; see [`ConcurrencyLayer::builder`].
pub struct ConcurrencyLayerBuilder<K, C, P, St> {
    key: K,
    cost: C,
    critical: P,
    store: St,
    cfg: Config,
}

impl<K: fmt::Debug, C: fmt::Debug, P, St> fmt::Debug for ConcurrencyLayerBuilder<K, C, P, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConcurrencyLayerBuilder")
            .field("name", &self.cfg.name)
            .field("max", &self.cfg.max)
            .field("key", &self.key)
            .field("cost", &self.cost)
            .finish_non_exhaustive()
    }
}

impl<K, C, P, St> ConcurrencyLayerBuilder<K, C, P, St> {
    /// Who a request counts against (default: [`PeerIp`]).
    pub fn key<K2>(self, key: K2) -> ConcurrencyLayerBuilder<K2, C, P, St> {
        ConcurrencyLayerBuilder {
            key,
            cost: self.cost,
            critical: self.critical,
            store: self.store,
            cfg: self.cfg,
        }
    }

    /// How many permits a request takes (default: [`Fixed(1)`](Fixed)): a
    /// report may hold 4 of a key's 8. A request needing more than the
    /// limit is refused without `Retry-After` (it can never fit); 0 takes
    /// no permit.
    pub fn cost<C2>(self, cost: C2) -> ConcurrencyLayerBuilder<K, C2, P, St> {
        ConcurrencyLayerBuilder {
            key: self.key,
            cost,
            critical: self.critical,
            store: self.store,
            cfg: self.cfg,
        }
    }

    /// Where the counts live (default: a new [`MemoryStore`]); a Redis
    /// store shares the limit across a fleet, with leases that lapse if an
    /// instance dies.
    pub fn store<St2: Store>(self, store: St2) -> ConcurrencyLayerBuilder<K, C, P, St2> {
        ConcurrencyLayerBuilder {
            key: self.key,
            cost: self.cost,
            critical: self.critical,
            store,
            cfg: self.cfg,
        }
    }

    /// A critical reserve: requests `classifier` deems critical may use
    /// every permit; the rest at most `non_critical_share` (0 to 1) of each
    /// limit (at least one permit), so critical requests still get through
    /// when a key or the whole service is saturated.
    pub fn critical<P2>(
        self,
        classifier: P2,
        non_critical_share: f64,
    ) -> ConcurrencyLayerBuilder<K, C, P2, St> {
        let mut cfg = self.cfg;
        cfg.share = Some(non_critical_share);
        ConcurrencyLayerBuilder {
            key: self.key,
            cost: self.cost,
            critical: classifier,
            store: self.store,
            cfg,
        }
    }

    /// Gives plan `plan` (pro, enterprise, ...) a per-key limit of its own,
    /// `max_in_flight` permits in place of the builder's, which is the
    /// default plan's. A key's permits count against the plan of each
    /// request as it comes (a plan change takes effect at the key's next
    /// request), and the headers and rejections show the plan's limit.
    /// A request on no plan, or one the layer does not know, is on the
    /// default plan. The service limit and the non-critical share apply
    /// as before (the share of each plan's own max). Set where plans come
    /// from with [`plan_from_extension`](Self::plan_from_extension) or
    /// [`plan_from_header`](Self::plan_from_header); errors name the field
    /// `plans`.
    pub fn plan(mut self, plan: &str, max_in_flight: u32) -> Self {
        self.cfg.plans.push((plan.to_owned(), max_in_flight));
        self
    }

    crate::policy::plan::plan_source_methods!();

    /// Allow and deny lists, as a policy's
    /// ([`PolicyLayerBuilder::access`](crate::policy::PolicyLayerBuilder::access)):
    /// a listed-allowed key or network skips the per-key limit (the
    /// service-wide limit and read-only mode still apply: they protect the
    /// service), a denied one gets 403 at once (gRPC
    /// `PERMISSION_DENIED`), in shadow mode too. Errors name the field
    /// `access`.
    pub fn access(mut self, list: AccessList) -> Self {
        self.cfg.access = Some(list);
        self
    }

    /// Lets a request that finds its key's limit full wait for a permit
    /// in a FIFO queue of at most `max_len` requests per key, for at most
    /// `max_wait`; a full queue or an expired wait answers 429 as if there
    /// were no queue. The wait happens in the response future, never in
    /// `poll_ready`. At most 100,000 requests wait across all keys of one
    /// layer (past that, a key whose own queue has room is refused too, so
    /// a flood of keys cannot grow the queues). A release in this process
    /// wakes the key's head and its first critical waiter at once (a critical
    /// request tries wherever it stands in line; see
    /// [`critical`](Self::critical)); for releases elsewhere (another
    /// instance on Redis) the head looks again after a tenth of `max_wait`
    /// (5 to 100 ms), then twice as long each time: at most about
    /// `1 + log2(max_wait / recheck)` store calls per queued request
    /// (`tollgate_concurrency_queue_rechecks_total`).
    pub fn queue(mut self, max_len: usize, max_wait: Duration) -> Self {
        self.cfg.queue = Some((max_len, max_wait));
        self
    }

    /// Also limits the whole service to `max` permits in flight (load
    /// shedding), in the same store, named `name` in the headers. A
    /// layer has one service limit: with
    /// [`adaptive_service_limit`](Self::adaptive_service_limit) too,
    /// `build` fails naming both. ("The whole service" is what this
    /// layer's store holds under `name`: layers on one store share it;
    /// each `builder` makes a new memory store.)
    pub fn service_limit(mut self, name: &str, max: u32) -> Self {
        if matches!(self.cfg.service, Some(ServiceConfig::Adaptive(..))) {
            self.cfg.conflict = true;
        }
        self.cfg.service = Some(ServiceConfig::Fixed(name.to_owned(), max));
        self
    }

    /// Also limits the whole service, in this process, to a limit that
    /// follows its latency and errors (see [`tollgate_core::adaptive`](https://docs.rs/tollgate-core/latest/tollgate_core/adaptive/)).
    /// Per layer: each layer with one has its own. A request holds its
    /// share of it until its response's head (a long body holds only its
    /// per-key permit). A request weighing more than the limit's `max` is
    /// refused as too costly; one weighing more than the limit *now* is
    /// refused with `Retry-After` until the limit grows past its weight,
    /// so while the backend struggles heavy requests wait longest: keep
    /// weights well below the limit's minimum.
    pub fn adaptive_service_limit(mut self, name: &str, limit: AdaptiveLimit) -> Self {
        if matches!(self.cfg.service, Some(ServiceConfig::Fixed(..))) {
            self.cfg.conflict = true;
        }
        self.cfg.service = Some(ServiceConfig::Adaptive(name.to_owned(), limit));
        self
    }

    /// What counts as a drop for the adaptive limit and as an error for
    /// read-only mode (default: [`Completion::is_overload`]: errors, 5xx
    /// but 501, 408, and gRPC `DEADLINE_EXCEEDED`, `INTERNAL`,
    /// `UNAVAILABLE`, whether in a trailers-only answer or the trailers).
    /// Without an adaptive service limit, `build` fails naming both.
    pub fn drop_classifier<F>(mut self, f: F) -> Self
    where
        F: Fn(Completion) -> bool + Send + Sync + 'static,
    {
        self.cfg.is_drop = Some(Arc::new(f));
        self
    }

    /// Read-only mode, with an adaptive service limit: while more than
    /// `error_rate` (0 to 1) of the requests over the last `window` (at
    /// least 1 ms) were drops, and at least
    /// [`read_only_min_requests`](Self::read_only_min_requests) were seen
    /// (default 20), only GET, HEAD and OPTIONS go through; other methods
    /// get 503 with `Retry-After` at once. Errors name `read_only`.
    pub fn read_only_above(mut self, error_rate: f64, window: Duration) -> Self {
        let min_requests = self.cfg.read_only.as_ref().map_or(20, |r| r.min_requests);
        self.cfg.read_only = Some(ReadOnly {
            threshold: error_rate,
            window,
            min_requests,
        });
        self
    }

    /// How many requests the read-only window must have seen before its
    /// error rate counts (default 20; at least 1): fewer, and one failure
    /// of a quiet service would turn it read-only. Needs
    /// [`read_only_above`](Self::read_only_above) (called before or
    /// after). Errors name `read_only`.
    pub fn read_only_min_requests(mut self, n: u32) -> Self {
        self.cfg.read_only_min_requests = Some(n);
        self
    }

    /// Offers the permit of an upgrade request (a WebSocket) to its
    /// handler as an [`UpgradePermit`](super::UpgradePermit) extension, so
    /// the upgraded connection can count until it closes (default: off;
    /// the permit ends with the `101` response).
    pub fn upgrades(mut self, on: bool) -> Self {
        self.cfg.upgrades = on;
        self
    }

    /// Caps how long a permit lives (000 §12: long polls, server-sent
    /// events and WebSockets need limits on how long a channel lives, not
    /// only on how many), from the request's admission:
    /// - a handler that has not answered by then (a long poll) is given
    ///   up and the client told to come again: 503 without `Retry-After`
    ///   (gRPC `UNAVAILABLE`, no pushback), [`Reason::Expired`](crate::rejection::Reason::Expired);
    /// - a response still streaming then is ended there — a streamed or
    ///   chunked body ends cleanly (a body of declared length ends short,
    ///   which the server reports as a broken response), a gRPC stream
    ///   ends with trailers `grpc-status: 14` (`UNAVAILABLE`, "stream
    ///   lifetime reached", so clients reconnect; a layer outside that
    ///   reads statuses sees an `UNAVAILABLE` too);
    ///
    /// either way its permit goes back then, and the outcome
    /// `lifetime_ended` counts it. An upgraded connection's permit (see
    /// [`upgrades`](Self::upgrades)) carries the cap too:
    /// [`Permit::expired`](super::Permit::expired) tells its task when to
    /// close the connection (a request that says `Upgrade` but is served
    /// as any other is capped as any other). In shadow mode nothing is
    /// cut. Default: none. Zero is a build error naming `max_lifetime`.
    pub fn max_lifetime(mut self, max: Duration) -> Self {
        self.cfg.max_lifetime = Some(max);
        self
    }

    /// Also counts decisions by route: `tollgate_route_requests_total{rule,
    /// route, outcome}` (outcomes `allowed`, `limited` — a full queue or
    /// an expired wait included — and `too_costly`), as
    /// [`PolicyLayerBuilder::route_label`](crate::policy::PolicyLayerBuilder::route_label)
    /// does (default off).
    #[cfg(feature = "axum")]
    pub fn route_label(mut self, on: bool) -> Self {
        self.cfg.route_label = on;
        self
    }

    /// How long a Redis lease lives unless renewed (default 30 s; the
    /// store renews leases of live requests). A crashed instance's
    /// permits come back after at most this long.
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.cfg.lease_ttl = ttl;
        self
    }

    /// The `Retry-After` of a refusal (default 1 s): when a permit frees
    /// depends on other requests, so this is a hint.
    pub fn retry_after(mut self, retry_after: Duration) -> Self {
        self.cfg.retry_after = retry_after;
        self
    }

    /// Shadow mode: decide and count, but never refuse, and send no
    /// rate-limit headers (a client would back off from a limit that is
    /// not enforced). A request the limit would refuse passes at once: it
    /// does not wait in a [`queue`](Self::queue), so with a queue the
    /// shadow count of refusals (`outcome="shadow_limited"`)
    /// includes requests the queue would have served after a wait; read it
    /// as an upper bound.
    pub fn shadow(mut self, shadow: bool) -> Self {
        self.cfg.shadow = shadow;
        self
    }

    /// Send `RateLimit-Policy` and `RateLimit` (default: on).
    pub fn headers(mut self, on: bool) -> Self {
        self.cfg.headers = on;
        self
    }

    /// What to do with a request when the store answers with an error
    /// (default: [`OnStoreError::Admit`], without a permit; `Refuse`: a
    /// 429 with `Retry-After: 1`, as a closed store answers).
    pub fn on_store_error(mut self, on: OnStoreError) -> Self {
        self.cfg.on_store_error = on;
        self
    }

    /// What to do with requests that have no key. The default, as on every
    /// layer, is [`MissingKey::Reject`]: a 400 problem document before the
    /// inner service is called. [`MissingKey::Fallback`] puts every keyless
    /// request on one shared budget; [`MissingKey::Skip`] lets them through
    /// unlimited.
    pub fn on_missing_key(mut self, missing: MissingKey) -> Self {
        self.cfg.missing = missing;
        self
    }

    /// Only requests to `routes` are limited by this layer; others pass
    /// it untouched (no permit of any limit here, service-wide and read-only mode
    /// included; not counted; no headers from it). An empty set is a
    /// build error.
    pub fn routes(mut self, routes: crate::Routes) -> Self {
        self.cfg.routes = Some(routes);
        self
    }

    /// Replaces the HTTP rejection (gRPC requests keep the gRPC one). The
    /// layer still adds `Retry-After` and the `RateLimit` headers.
    pub fn rejection<F>(mut self, f: F) -> Self
    where
        F: Fn(&Rejected) -> Response<Bytes> + Send + Sync + 'static,
    {
        self.cfg.rejection = Some(Arc::new(f));
        self
    }
}

impl<K, C, P, St: Store> ConcurrencyLayerBuilder<K, C, P, St> {
    /// Validates everything and binds the rules to the store; every error
    /// names its field. Registers the layer's [metrics](crate::observe).
    pub fn build(self) -> Result<ConcurrencyLayer<K, C, P, St>, ConfigError> {
        let mut cfg = self.cfg;
        let rule = |name: &str, max| {
            ConcurrencyRule::new(name, max, cfg.lease_ttl)?.with_retry_after(cfg.retry_after)
        };
        let plan_names = crate::policy::plan::named_plans(
            cfg.plans.iter().map(|(plan, _)| plan.as_str()),
            cfg.plan_source.is_some(),
        )?;
        crate::Routes::check(cfg.routes.as_ref())?;
        // The default plan's max, and each plan's, as a rule's would be.
        rule(&cfg.name, cfg.max)?;
        for (plan, max) in &cfg.plans {
            rule(&cfg.name, *max)
                .map_err(|e| ConfigError::new("plans", format!("plan {plan:?}: {e}")))?;
        }
        // One store rule for every plan, as large as the largest; each
        // plan's max is a ceiling under it, so a key's permits count
        // against whatever plan its next request is on.
        let largest = cfg
            .plans
            .iter()
            .map(|(_, max)| *max)
            .fold(cfg.max, u32::max);
        let per_key_rule = rule(&cfg.name, largest)?;
        if let Some(share) = cfg.share {
            if !(share > 0.0 && share <= 1.0) {
                return Err(ConfigError::new(
                    "non_critical_share",
                    "must be more than 0 and at most 1",
                ));
            }
        }
        let share_of = |max: u32| cfg.share.map_or(u32::MAX, |s| non_critical_ceiling(max, s));
        let queue = match cfg.queue {
            None => None,
            Some((len, _)) if len == 0 || len > 10_000 => {
                return Err(ConfigError::new("queue", "max_len must be 1 to 10,000"))
            }
            Some((_, wait))
                if wait < Duration::from_millis(1) || wait > Duration::from_secs(60) =>
            {
                return Err(ConfigError::new(
                    "queue",
                    "max_wait must be from 1 ms to 60 s",
                ))
            }
            Some((len, wait)) => Some(Arc::new(Queue::new(len, wait, per_key_rule.name()))),
        };
        let name: Arc<str> = per_key_rule.name().into();
        // (Each plan has its own share.)
        let per_key = StoreLimit::new(
            self.store.concurrency_limiter(&per_key_rule)?,
            Arc::clone(&name),
            u32::MAX,
        );
        if cfg.conflict {
            return Err(ConfigError::new(
                "service_limit",
                "service_limit and adaptive_service_limit: a layer has one service limit, choose one",
            ));
        }
        if cfg.is_drop.is_some() && !matches!(cfg.service, Some(ServiceConfig::Adaptive(..))) {
            return Err(ConfigError::new(
                "drop_classifier",
                "drop_classifier needs an adaptive_service_limit, whose samples it judges",
            ));
        }
        if cfg.read_only.is_some() && !matches!(cfg.service, Some(ServiceConfig::Adaptive(..))) {
            return Err(ConfigError::new(
                "read_only",
                "needs an adaptive service limit, whose samples it reads",
            ));
        }
        match (cfg.read_only_min_requests, &mut cfg.read_only) {
            (Some(0), _) => {
                return Err(ConfigError::new(
                    "read_only",
                    "min_requests must be at least 1",
                ))
            }
            (Some(_), None) => {
                return Err(ConfigError::new(
                    "read_only",
                    "read_only_min_requests needs read_only_above",
                ))
            }
            (Some(n), Some(r)) => r.min_requests = n,
            (None, _) => {}
        }
        if let Some(r) = &cfg.read_only {
            if !(r.threshold > 0.0 && r.threshold < 1.0) {
                return Err(ConfigError::new(
                    "read_only",
                    "error_rate must be between 0 and 1",
                ));
            }
            if r.window < Duration::from_millis(1) {
                return Err(ConfigError::new(
                    "read_only",
                    "window must be at least 1 ms",
                ));
            }
        }
        let service = match cfg.service {
            None => None,
            Some(ServiceConfig::Fixed(n, _) | ServiceConfig::Adaptive(n, _)) if n == cfg.name => {
                return Err(ConfigError::new(
                    "service_limit",
                    "needs a name of its own, not the per-key rule's",
                ))
            }
            Some(ServiceConfig::Fixed(n, max)) => {
                let r = rule(&n, max).map_err(service_error)?;
                let limit = StoreLimit::new(
                    self.store.concurrency_limiter(&r).map_err(service_error)?,
                    r.name().into(),
                    share_of(max),
                );
                // Every request's key: counted apart where the store can.
                let pinned = limit.limiter.pin(SERVICE_KEY);
                limit.pinned.get_or_init(|| pinned);
                Some(ServiceLimit::Fixed(limit))
            }
            Some(ServiceConfig::Adaptive(n, limit)) => {
                // Checks the name as every rule's is checked.
                let r = rule(&n, limit.max()).map_err(service_error)?;
                let is_drop = cfg
                    .is_drop
                    .unwrap_or_else(|| Arc::new(|c: Completion| c.is_overload()));
                Some(ServiceLimit::Adaptive(Arc::new(Adaptive::new(
                    r.name().into(),
                    limit,
                    cfg.read_only,
                    is_drop,
                    cfg.retry_after,
                )?)))
            }
        };
        let adaptive = match &service {
            Some(ServiceLimit::Adaptive(a)) => Some(Arc::clone(a)),
            _ => None,
        };
        let (service_name, service_q) = match &service {
            Some(ServiceLimit::Fixed(s)) => {
                let max = s.limiter.rule().semaphore().max();
                (Some(Arc::clone(&s.name)), Some(u64::from(max)))
            }
            Some(ServiceLimit::Adaptive(a)) => (Some(Arc::clone(&a.name)), None),
            None => (None, None),
        };
        if cfg.max_lifetime.is_some_and(|m| m.is_zero()) {
            return Err(ConfigError::new("max_lifetime", "must be longer than zero"));
        }
        let metrics = ConcurrencyMetrics::register(&name);
        let responder = |max: u32| {
            let mut limits = vec![(&*name, Some(u64::from(max)))];
            if let Some(n) = &service_name {
                limits.push((n, service_q));
            }
            let service_rendered = Rendered::new(
                LimitKind::Concurrency,
                service_name.as_deref().unwrap_or(&name),
            );
            let responder = Responder {
                headers: ConcurrencyHeaders::new(&limits, cfg.headers && !cfg.shadow),
                rejection: cfg.rejection.clone(),
                rendered: [
                    Rendered::new(LimitKind::Concurrency, &name),
                    service_rendered,
                ],
                adaptive: adaptive.clone(),
                name: Arc::clone(&name),
                upgrades: cfg.upgrades,
                // Shadow mode changes no request: nothing is cut.
                lifetime: cfg
                    .max_lifetime
                    .filter(|_| !cfg.shadow)
                    .map(|max| (max, metrics.lifetime_ended.clone())),
                route_label: cfg.route_label,
            };
            PlanLimit {
                max,
                share: share_of(max),
                responder: Arc::new(responder),
            }
        };
        let plans = PlanSet {
            names: plan_names,
            source: cfg.plan_source.clone(),
            default: responder(cfg.max),
            plans: cfg.plans.iter().map(|(_, max)| responder(*max)).collect(),
        };
        Ok(ConcurrencyLayer {
            shared: Arc::new(Limits {
                key: self.key,
                cost: self.cost,
                critical: self.critical,
                per_key,
                plans,
                service,
                queue,
                keying: Keying::new(cfg.missing).scoped(cfg.routes),
                shadow: cfg.shadow,
                metrics,
                share: cfg.share,
                access: cfg
                    .access
                    .map(|l| Listed::new(l, crate::observe::CONCURRENCY))
                    .transpose()?,
                refuse_on_store_error: cfg.on_store_error == OnStoreError::Refuse,
            }),
        })
    }
}
