use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use http::Response;
use tollgate_core::{ConfigError, Limit, Rule, Store};
use tollgate_memory::MemoryStore;
use tower_layer::Layer;

use super::service::{RateLimitErrorService, RateLimitService};
use super::shared::{RejectFn, Responder, Shared};
use crate::cost::Fixed;
use crate::headers::Headers;
use crate::key::PeerIp;
use crate::key::{Keying, MissingKey};
use crate::observe::Metrics;
use crate::rejection::{LimitKind, OnStoreError, Rejected, Rendered};

/// Rate-limits requests per key; see the [module docs](super).
///
/// Cheap to clone; all clones (and so all connections) share one state.
///
/// ```
/// use std::time::Duration;
/// use axum::{routing::get, Router};
/// use tollgate::{cost::Fixed, key::Header, Limit, Rate, RateLimitLayer};
///
/// let limit = RateLimitLayer::builder("per-key", Limit::gcra(Rate::per_second(10), 20))
///     .key(Header::named("x-api-key")?)
///     .cost(Fixed(1))
///     .build()?;
/// let app: Router = Router::new().route("/", get(|| async { "hi" })).layer(limit);
/// # Ok::<(), tollgate::ConfigError>(())
/// ```
pub struct RateLimitLayer<K = PeerIp, C = Fixed, St: Store = MemoryStore> {
    shared: Arc<Shared<K, C, St::Limiter>>,
}

impl<K, C, St: Store> Clone for RateLimitLayer<K, C, St> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<K, C, St: Store> fmt::Debug for RateLimitLayer<K, C, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("rule", &self.shared.responder.rule)
            .field("shadow", &self.shared.responder.shadow)
            .finish_non_exhaustive()
    }
}

impl RateLimitLayer<PeerIp, Fixed, MemoryStore> {
    /// Starts a layer enforcing `limit` under the rule name `name` (used in
    /// headers, store keys and metrics). Defaults: keyed by peer IP, cost
    /// 1, in-memory store, standard headers on, keyless requests refused
    /// (400; serve with `into_make_service_with_connect_info` so peer IPs
    /// are known, or choose [`MissingKey`]).
    pub fn builder(name: &str, limit: Limit) -> RateLimitLayerBuilder<PeerIp, Fixed, MemoryStore> {
        RateLimitLayerBuilder {
            key: PeerIp::new(),
            cost: Fixed(1),
            store: MemoryStore::new(),
            cfg: Config {
                name: name.to_owned(),
                limit,
                shadow: false,
                headers: true,
                legacy_headers: false,
                missing: MissingKey::default(),
                on_store_error: OnStoreError::default(),
                rejection: None,
                route_label: false,
                routes: None,
                messages: false,
                charge_after: None,
            },
        }
    }
}

impl<K, C, St: Store> RateLimitLayer<K, C, St> {
    /// The same limiter, but a rejection is returned as an error
    /// ([`RateLimited`](super::RateLimited), boxed) instead of a response,
    /// for stacks that handle errors with `HandleErrorLayer`. The error
    /// carries the response the layer would have sent, headers included.
    ///
    /// Only the rate layer has an error mode: the policy, quota,
    /// concurrency and bandwidth layers always answer with a response
    /// (marked with the [`Refusal`](crate::rejection::Refusal) extension, so
    /// outer middleware can still tell it apart), and take a custom
    /// rejection through their builders' `rejection`.
    pub fn into_errors(self) -> RateLimitErrorLayer<K, C, St> {
        RateLimitErrorLayer {
            shared: self.shared,
        }
    }

    /// The rule's name.
    pub fn rule_name(&self) -> &str {
        &self.shared.responder.rule
    }

    /// The store's handle of the rule (e.g. to read a key's budget in a
    /// test or a dashboard, with a cost-0 `decide`).
    pub fn limiter(&self) -> &St::Limiter {
        &self.shared.limiter
    }

    #[cfg(test)]
    pub(crate) fn responder(&self) -> Arc<Responder> {
        Arc::clone(&self.shared.responder)
    }
}

impl<S, K, C, St: Store> Layer<S> for RateLimitLayer<K, C, St> {
    type Service = RateLimitService<S, K, C, St>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimitService::new(inner, Arc::clone(&self.shared))
    }
}

/// [`RateLimitLayer`] in error mode; see [`RateLimitLayer::into_errors`].
pub struct RateLimitErrorLayer<K = PeerIp, C = Fixed, St: Store = MemoryStore> {
    shared: Arc<Shared<K, C, St::Limiter>>,
}

impl<K, C, St: Store> Clone for RateLimitErrorLayer<K, C, St> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<K, C, St: Store> fmt::Debug for RateLimitErrorLayer<K, C, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitErrorLayer")
            .field("rule", &self.shared.responder.rule)
            .finish_non_exhaustive()
    }
}

impl<S, K, C, St: Store> Layer<S> for RateLimitErrorLayer<K, C, St> {
    type Service = RateLimitErrorService<S, K, C, St>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimitErrorService::new(inner, Arc::clone(&self.shared))
    }
}

/// Builds a [`RateLimitLayer`]; see [`RateLimitLayer::builder`].
pub struct RateLimitLayerBuilder<K, C, St> {
    key: K,
    cost: C,
    store: St,
    cfg: Config,
}

/// A builder's settings that do not change its type.
struct Config {
    name: String,
    limit: Limit,
    shadow: bool,
    headers: bool,
    legacy_headers: bool,
    missing: MissingKey,
    on_store_error: OnStoreError,
    rejection: Option<RejectFn>,
    route_label: bool,
    routes: Option<crate::Routes>,
    messages: bool,
    charge_after: Option<super::Measure>,
}

impl<K: fmt::Debug, C: fmt::Debug, St> fmt::Debug for RateLimitLayerBuilder<K, C, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayerBuilder")
            .field("name", &self.cfg.name)
            .field("limit", &self.cfg.limit)
            .field("key", &self.key)
            .field("cost", &self.cost)
            .field("shadow", &self.cfg.shadow)
            .finish_non_exhaustive()
    }
}

impl<K, C, St> RateLimitLayerBuilder<K, C, St> {
    /// Who a request counts against (default: [`PeerIp`]).
    pub fn key<K2>(self, key: K2) -> RateLimitLayerBuilder<K2, C, St> {
        RateLimitLayerBuilder {
            key,
            cost: self.cost,
            store: self.store,
            cfg: self.cfg,
        }
    }

    /// What a request costs (default: [`Fixed(1)`](Fixed)).
    pub fn cost<C2>(self, cost: C2) -> RateLimitLayerBuilder<K, C2, St> {
        RateLimitLayerBuilder {
            key: self.key,
            cost,
            store: self.store,
            cfg: self.cfg,
        }
    }

    /// Where state lives (default: a new [`MemoryStore`]). Pass one store
    /// to several layers to share its key bound; pass a Redis store to
    /// share limits across a fleet.
    pub fn store<St2: Store>(self, store: St2) -> RateLimitLayerBuilder<K, C, St2> {
        RateLimitLayerBuilder {
            key: self.key,
            cost: self.cost,
            store,
            cfg: self.cfg,
        }
    }

    /// Shadow mode: decide, log and count (`outcome="shadow_limited"`),
    /// but never block, and send no rate-limit headers (a client that
    /// honours them would back off from a limit that is not enforced). For
    /// trying a limit on live traffic before enforcing it.
    pub fn shadow(mut self, shadow: bool) -> Self {
        self.cfg.shadow = shadow;
        self
    }

    /// Send `RateLimit-Policy` and `RateLimit` on every limited response
    /// (default: on).
    pub fn headers(mut self, on: bool) -> Self {
        self.cfg.headers = on;
        self
    }

    /// Also send `X-RateLimit-Limit`, `X-RateLimit-Remaining` and
    /// `X-RateLimit-Reset` (default: off).
    pub fn legacy_headers(mut self, on: bool) -> Self {
        self.cfg.legacy_headers = on;
        self
    }

    /// What to do with a request when the store answers with an error
    /// (default: [`OnStoreError::Admit`]).
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

    /// Also counts decisions by route: `tollgate_route_requests_total{rule,
    /// route, outcome}`, as
    /// [`PolicyLayerBuilder::route_label`](crate::policy::PolicyLayerBuilder::route_label)
    /// does (default off).
    #[cfg(feature = "axum")]
    pub fn route_label(mut self, on: bool) -> Self {
        self.cfg.route_label = on;
        self
    }
}

impl<K, C, St: Store> RateLimitLayerBuilder<K, C, St> {
    /// Counts the messages of upgraded connections (WebSockets) too
    /// (default off): an admitted upgrade request carries a
    /// [`MessageBudget`](super::MessageBudget) in its extensions, bound to
    /// this rule and the request's key, which the connection's task spends
    /// per message, at the message's cost.
    pub fn messages(mut self, on: bool) -> Self {
        self.cfg.messages = on;
        self
    }

    /// Charges what a request really cost once its response is known
    /// (000 §12: expensive business logic), measured by `measure` — the
    /// handler's time, the response's length, or what the handler
    /// reports in an [`ActualCost`](super::ActualCost) extension. The
    /// request is admitted on its estimate (the layer's cost function);
    /// once the response's head is known a cost below the estimate is
    /// given back (an admitted request costs at least one unit), and one
    /// above it is owed: the rule frees a debt at its steady rate, as it
    /// would have freed the units had they been charged, and the key's
    /// next request pays what is left of it on top of its own cost — or,
    /// when more is owed than the rule's capacity leaves room for, is
    /// refused (`Retry-After`: until enough of it is freed). So a key's
    /// costly calls wait as long as their real cost takes to free, and a
    /// cheap call does not pay for the worst case. A request that ends
    /// without a response (its service failed, its future was dropped:
    /// a timeout above) is charged the handler's time so far with
    /// [`Measure::Elapsed`](super::Measure::Elapsed), its estimate
    /// otherwise; the time counts from the handler's call, not from the
    /// store's answer or a pacing wait. A request the rule refuses pays
    /// none of a debt. The response of the request that incurs a debt
    /// states the budget before it. Debts are kept by this process (up to
    /// 100,000 keys, each up to 100 times the rule's capacity; with the
    /// table full of debts not yet freed, a new one is charged at once if
    /// the key's budget holds it, forgiven if not): in a fleet a key pays
    /// its debt on the instance it incurred it on, and a restart forgets
    /// them. Every `charge_after` layer a response passes reads its
    /// [`ActualCost`](super::ActualCost), in its own rule's units. In
    /// shadow mode nothing is measured. A `per` of zero is a build error
    /// naming `charge_after`.
    pub fn charge_after(mut self, measure: super::Measure) -> Self {
        self.cfg.charge_after = Some(measure);
        self
    }

    /// Validates the rule and binds it to the store. Registers the layer's
    /// [metrics](crate::observe) with the recorder installed now.
    pub fn build(self) -> Result<RateLimitLayer<K, C, St>, ConfigError> {
        let cfg = self.cfg;
        let rule = Rule::new(&cfg.name, cfg.limit)?;
        crate::Routes::check(cfg.routes.as_ref())?;
        let limiter = self.store.limiter(&rule)?;
        let debts = match cfg.charge_after {
            Some(measure) => {
                measure.check()?;
                // Shadow mode changes nothing: no debts.
                (!cfg.shadow).then(|| super::Debts::of(measure, &limiter, None))
            }
            None => None,
        };
        Ok(RateLimitLayer {
            shared: Arc::new(Shared {
                key: self.key,
                cost: self.cost,
                limiter,
                keying: Keying::new(cfg.missing).scoped(cfg.routes),
                messages: cfg.messages,
                debts,
                responder: Arc::new(Responder {
                    rule: rule.name().into(),
                    headers: Headers::new(&rule, cfg.headers, cfg.legacy_headers),
                    shadow: cfg.shadow,
                    rejection: cfg.rejection,
                    route_label: cfg.route_label,
                    rendered: Rendered::new(LimitKind::Rate, rule.name()),
                    metrics: Metrics::register(rule.name()),
                    on_store_error: cfg.on_store_error.answer(rule.capacity()),
                }),
            }),
        })
    }
}
