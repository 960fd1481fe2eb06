use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use http::Response;
use tollgate_core::calendar::{Offset, Period, Zone};
use tollgate_core::{ConfigError, QuotaRule, QuotaStore};
use tollgate_memory::MemoryStore;
use tower_layer::Layer;

use super::service::{QuotaService, Responder, Shared};
use crate::cost::Fixed;
use crate::headers::QuotaHeaders;
use crate::key::PeerIp;
use crate::key::{Keying, MissingKey};
use crate::observe::Metrics;
use crate::policy::access::Listed;
use crate::policy::plan::{Named, PlanSet};
use crate::policy::AccessList;
use crate::rejection::{LimitKind, OnStoreError, Rejected, Rendered};

type RejectFn = Arc<dyn Fn(&Rejected) -> Response<Bytes> + Send + Sync>;

/// Charges requests to calendar quotas per key; see the
/// [module docs](super).
///
/// Cheap to clone; all clones (and so all connections) share one state.
pub struct QuotaLayer<K = PeerIp, C = Fixed, St: QuotaStore = MemoryStore> {
    shared: Arc<Shared<K, C, St::QuotaLimiter>>,
}

impl<K, C, St: QuotaStore> Clone for QuotaLayer<K, C, St> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<K, C, St: QuotaStore> fmt::Debug for QuotaLayer<K, C, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QuotaLayer")
            .field("rule", &self.shared.responder().rule)
            .finish_non_exhaustive()
    }
}

impl<S, K, C, St: QuotaStore> Layer<S> for QuotaLayer<K, C, St> {
    type Service = QuotaService<S, K, C, St>;

    fn layer(&self, inner: S) -> Self::Service {
        QuotaService::new(inner, Arc::clone(&self.shared))
    }
}

impl<K, C, St: QuotaStore> QuotaLayer<K, C, St> {
    /// The quota's name.
    pub fn rule_name(&self) -> &str {
        &self.shared.responder().rule
    }

    /// The store's handle of this quota, for administration: read a key's
    /// `usage`, `reset` it, `grant` extra units. Its keys are the layer's
    /// encoding of a request's key ([`KeyBuf`](crate::key::KeyBuf): each
    /// part behind its length), not the raw header value — a bare
    /// `b"acme"` names a key no request has, with whole budgets. Take them
    /// from [`key_for`](Self::key_for), or read with
    /// [`usage_for`](Self::usage_for).
    pub fn limiter(&self) -> &St::QuotaLimiter {
        &self.shared.plans.default.0
    }

    /// The store key of `req`'s client, as the layer would extract it
    /// (build a request with the client's header to name a customer);
    /// `None` when it has none.
    pub fn key_for<B>(&self, req: &http::Request<B>) -> Option<Vec<u8>>
    where
        K: crate::key::KeyExtractor<B>,
    {
        let mut key = crate::key::KeyBuf::new();
        self.shared.key.extract(req, &mut key)?;
        Some(key.as_bytes().to_vec())
    }

    /// What `req`'s client has used of the quota (its default plan's),
    /// as the store holds it: an error when the store does not answer,
    /// never a failure policy's whole budgets; `Ok(None)` for a request
    /// with no key.
    pub async fn usage_for<B>(
        &self,
        req: &http::Request<B>,
    ) -> Result<Option<tollgate_core::QuotaDecision>, tollgate_core::StoreError>
    where
        K: crate::key::KeyExtractor<B>,
    {
        match self.key_for(req) {
            Some(key) => tollgate_core::QuotaLimiter::usage(self.limiter(), &key)
                .await
                .map(Some),
            None => Ok(None),
        }
    }

    /// The store's handle of plan `plan`'s quota (its own usage, under
    /// the store name `<quota>:<plan>`), for administration as with
    /// [`limiter`](Self::limiter); `None` for a plan the layer does not
    /// know.
    pub fn plan_limiter(&self, plan: &str) -> Option<&St::QuotaLimiter> {
        let plans = &self.shared.plans;
        let i = plans.names.iter().position(|n| **n == *plan)?;
        plans.plans.get(i).map(|(l, _)| l)
    }
}

impl QuotaLayer<PeerIp, Fixed, MemoryStore> {
    /// Starts a quota named `name` (used in headers, store keys and
    /// metrics). Add at least one [`period`](QuotaLayerBuilder::period).
    /// Defaults: keyed by peer IP, cost 1, in-memory store, UTC, standard
    /// headers on, no soft limit, keyless requests refused (400).
    pub fn builder(name: &str) -> QuotaLayerBuilder<PeerIp, Fixed, MemoryStore> {
        QuotaLayerBuilder {
            key: PeerIp::new(),
            cost: Fixed(1),
            store: MemoryStore::new(),
            cfg: Config {
                name: name.to_owned(),
                periods: Vec::new(),
                zone: Zone::UTC,
                soft: None,
                shadow: false,
                headers: true,
                refund_unserved: true,
                missing: MissingKey::default(),
                on_store_error: OnStoreError::default(),
                rejection: None,
                route_label: false,
                plans: Vec::new(),
                plan_source: None,
                access: None,
                routes: None,
            },
        }
    }
}

struct Config {
    name: String,
    periods: Vec<(Period, u64)>,
    zone: Zone,
    soft: Option<f64>,
    shadow: bool,
    headers: bool,
    refund_unserved: bool,
    missing: MissingKey,
    on_store_error: OnStoreError,
    rejection: Option<RejectFn>,
    route_label: bool,
    plans: Vec<(String, Vec<(Period, u64)>)>,
    plan_source: Option<Named>,
    access: Option<AccessList>,
    routes: Option<crate::Routes>,
}

/// Builds a [`QuotaLayer`]; see [`QuotaLayer::builder`].
pub struct QuotaLayerBuilder<K, C, St> {
    key: K,
    cost: C,
    store: St,
    cfg: Config,
}

impl<K: fmt::Debug, C: fmt::Debug, St> fmt::Debug for QuotaLayerBuilder<K, C, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QuotaLayerBuilder")
            .field("name", &self.cfg.name)
            .field("periods", &self.cfg.periods)
            .field("key", &self.key)
            .field("cost", &self.cost)
            .finish_non_exhaustive()
    }
}

impl<K, C, St> QuotaLayerBuilder<K, C, St> {
    /// Who a request counts against (default: [`PeerIp`]).
    pub fn key<K2>(self, key: K2) -> QuotaLayerBuilder<K2, C, St> {
        QuotaLayerBuilder {
            key,
            cost: self.cost,
            store: self.store,
            cfg: self.cfg,
        }
    }

    /// What a request costs (default: [`Fixed(1)`](Fixed)).
    pub fn cost<C2>(self, cost: C2) -> QuotaLayerBuilder<K, C2, St> {
        QuotaLayerBuilder {
            key: self.key,
            cost,
            store: self.store,
            cfg: self.cfg,
        }
    }

    /// Where usage lives (default: a new [`MemoryStore`], per process); a
    /// Redis store keeps it across restarts and shares it across a fleet.
    pub fn store<St2: QuotaStore>(self, store: St2) -> QuotaLayerBuilder<K, C, St2> {
        QuotaLayerBuilder {
            key: self.key,
            cost: self.cost,
            store,
            cfg: self.cfg,
        }
    }

    /// Adds a budget of `limit` units per `period` (at most one per kind
    /// of period).
    pub fn period(mut self, period: Period, limit: u64) -> Self {
        self.cfg.periods.push((period, limit));
        self
    }

    /// Gives plan `plan` (pro, enterprise, ...) budgets of its own, in
    /// place of the [`period`](Self::period)s, which are the default
    /// plan's: a request on this plan is charged to the plan's budgets,
    /// kept under the store name `<quota>:<plan>`, and its headers show
    /// them. A request on no plan, or one the layer does not know, is on
    /// the default plan; a key's plan change takes effect at its next
    /// request. Set where plans come from with
    /// [`plan_from_extension`](Self::plan_from_extension) or
    /// [`plan_from_header`](Self::plan_from_header); errors name the field
    /// `plans`.
    pub fn plan(mut self, plan: &str, periods: &[(Period, u64)]) -> Self {
        self.cfg.plans.push((plan.to_owned(), periods.to_vec()));
        self
    }

    crate::policy::plan::plan_source_methods!();

    /// Allow and deny lists, as a policy's
    /// ([`PolicyLayerBuilder::access`](crate::policy::PolicyLayerBuilder::access)):
    /// a listed-allowed key or network is not charged, a denied one gets
    /// 403 at once (gRPC `PERMISSION_DENIED`), in shadow mode too. Errors
    /// name the field `access`.
    pub fn access(mut self, list: AccessList) -> Self {
        self.cfg.access = Some(list);
        self
    }

    /// Aligns periods to `offset` from UTC (default UTC): with +09:00 a
    /// day starts at midnight in Tokyo. A fixed offset does not follow
    /// daylight saving time; [`zone`](Self::zone) does.
    pub fn offset(mut self, offset: Offset) -> Self {
        self.cfg.zone = offset.into();
        self
    }

    /// Aligns periods to `zone`: a fixed offset, or (feature `tz`) an IANA
    /// time zone (`Zone::iana("Europe/Berlin")?`), where a day runs from
    /// local midnight to local midnight across daylight saving time.
    /// Changing it on a running quota (a reload) keeps each key's usage: a
    /// window counted in the old zone holds until its end, then counts on
    /// through the period it falls in.
    pub fn zone(mut self, zone: Zone) -> Self {
        self.cfg.zone = zone;
        self
    }

    /// Past this share of any period's budget (0 to 1, e.g. 0.8),
    /// responses carry `Quota-Warning` and `tollgate_quota_warnings_total`
    /// counts them.
    pub fn soft_limit(mut self, share: f64) -> Self {
        self.cfg.soft = Some(share);
        self
    }

    /// Shadow mode: count and warn (`Quota-Warning`, the metric), but
    /// never refuse, and send no `RateLimit` headers (a client would back
    /// off from a quota that is not enforced).
    pub fn shadow(mut self, shadow: bool) -> Self {
        self.cfg.shadow = shadow;
        self
    }

    /// Send `RateLimit-Policy` and `RateLimit` (default: on).
    pub fn headers(mut self, on: bool) -> Self {
        self.cfg.headers = on;
        self
    }

    /// Give a request's charge back when it turns out not to have been
    /// served (default: on): a limit inside this layer refused it (any
    /// tollgate layer's refusal carries a
    /// [`Refusal`](crate::rejection::Refusal) extension), the service
    /// answered 5xx (or a gRPC status that maps to one), or it failed.
    /// A request cancelled after it was charged keeps its charge: the
    /// service may have done the work. The trade-off: a client that can
    /// make the service fail (a 500 on bad input, a slow path an inner
    /// timeout turns into a 504) gets that work free of the quota — the
    /// rate limits in front still bound it. Off, every admitted request
    /// is charged, as a metered API that bills attempts does. The
    /// response's `RateLimit` item shows the units after the refund; the
    /// refund itself runs in the background, so on a store that cannot
    /// make it just then (Redis away) the item is one refund ahead.
    pub fn refund_unserved(mut self, on: bool) -> Self {
        self.cfg.refund_unserved = on;
        self
    }

    /// Also counts decisions by route: `tollgate_route_requests_total{rule,
    /// route, outcome}`, as
    /// [`PolicyLayerBuilder::route_label`](crate::policy::PolicyLayerBuilder::route_label)
    /// does (default off).
    #[cfg(feature = "axum")]
    pub fn route_label(mut self, on: bool) -> Self {
        self.cfg.route_label = on;
        self
    }

    /// What to do with a request when the store answers with an error
    /// (default: [`OnStoreError::Admit`]). `Refuse` suits a quota that
    /// bills: nothing is served that could not be counted. The Redis store
    /// answers its own faults with its failure policy (`Open` by default)
    /// and reaches this only when that policy cannot answer: for a billing
    /// quota on Redis, choose `FailurePolicy::Closed` on the store too.
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
    /// it untouched (not counted, no headers from it). An empty set is a
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

impl<K, C, St: QuotaStore> QuotaLayerBuilder<K, C, St> {
    /// Validates the quota and binds it to the store; every error names
    /// its field.
    pub fn build(self) -> Result<QuotaLayer<K, C, St>, ConfigError> {
        let cfg = self.cfg;
        crate::Routes::check(cfg.routes.as_ref())?;
        if let Some(soft) = cfg.soft {
            if !(soft > 0.0 && soft <= 1.0) {
                return Err(ConfigError::new(
                    "soft_limit",
                    "must be more than 0 and at most 1",
                ));
            }
        }
        // A plan's quota is a rule of its own in the store; its headers,
        // items and rejection show its budgets under the quota's name.
        let bind = |store_name: &str, periods: &[(Period, u64)]| {
            let rule = QuotaRule::new(store_name, periods, cfg.zone.clone())?;
            let limiter = self.store.quota_limiter(&rule)?;
            // One period: its item is the quota's name; several: name-period.
            let names: Vec<String> = if periods.len() == 1 {
                vec![cfg.name.clone()]
            } else {
                rule.quota()
                    .periods()
                    .map(|(p, _)| format!("{}-{}", cfg.name, p.name()))
                    .collect()
            };
            // The quota's series (every plan's decisions count under its
            // name), and each period's used share in the order decisions
            // list them.
            let (metrics, warnings, used) =
                Metrics::register_quota(&cfg.name, rule.quota().periods().map(|(p, _)| p.name()));
            let responder = Responder {
                rule: cfg.name.as_str().into(),
                headers: QuotaHeaders::new(&names, cfg.headers && !cfg.shadow),
                items: names.into_iter().map(Into::into).collect(),
                shadow: cfg.shadow,
                rejection: cfg.rejection.clone(),
                rendered: Rendered::new(LimitKind::Quota, &cfg.name),
                soft: cfg.soft,
                metrics,
                warnings,
                used,
                refuse_on_store_error: cfg.on_store_error == OnStoreError::Refuse,
                route_label: cfg.route_label,
            };
            Ok::<_, ConfigError>((limiter, Arc::new(responder)))
        };
        let default = bind(&cfg.name, &cfg.periods)?;
        let plans = crate::policy::plan::named_plans(
            cfg.plans.iter().map(|(plan, _)| plan.as_str()),
            cfg.plan_source.is_some(),
        )?;
        let mut bound = Vec::with_capacity(cfg.plans.len());
        for (plan, periods) in &cfg.plans {
            let store_name = format!("{}:{plan}", cfg.name);
            let b = bind(&store_name, periods)
                .map_err(|e| ConfigError::new("plans", format!("plan {plan:?}: {e}")))?;
            bound.push(b);
        }
        Ok(QuotaLayer {
            shared: Arc::new(Shared {
                key: self.key,
                cost: self.cost,
                plans: PlanSet {
                    names: plans,
                    source: cfg.plan_source,
                    default,
                    plans: bound,
                },
                keying: Keying::new(cfg.missing).scoped(cfg.routes),
                refund_unserved: cfg.refund_unserved,
                access: cfg
                    .access
                    .map(|l| Listed::new(l, crate::observe::QUOTA_REQUESTS))
                    .transpose()?,
            }),
        })
    }
}
