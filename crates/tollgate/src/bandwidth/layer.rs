use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use pin_project_lite::pin_project;
use tollgate_core::{ConfigError, Limit, Limiter, Rule, Store};
use tollgate_memory::MemoryStore;
use tower_layer::Layer;
use tower_service::Service;

use super::body::{PacedBody, Pacer};
use crate::body::RejectionBody;
use crate::key::{KeyBuf, KeyBytes, KeyExtractor, Keyed, Keying, MissingKey, PeerIp};
use crate::observe::BandwidthMetrics;
use crate::rejection::{is_grpc, LimitKind, Reason, Rejected};

/// Which bodies a [`BandwidthLayer`] paces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Direction {
    /// Response bodies: downloads (the default).
    #[default]
    Responses,
    /// Request bodies: uploads.
    Requests,
    /// Both, against one budget per key.
    Both,
}

struct Shared<K, L> {
    key: K,
    limiter: L,
    chunk: u32,
    direction: Direction,
    keying: Keying,
    /// Request bodies' handles, and response bodies'.
    metrics: (Arc<BandwidthMetrics>, Arc<BandwidthMetrics>),
    /// Keyless requests: `(unkeyed, missing_key)`.
    keyless: (metrics::Counter, metrics::Counter),
}

/// Paces request and/or response bodies to a byte rate per key; see the
/// [module docs](super).
pub struct BandwidthLayer<K = PeerIp, St: Store = MemoryStore> {
    shared: Arc<Shared<K, St::Limiter>>,
}

impl<K, St: Store> Clone for BandwidthLayer<K, St> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<K, St: Store> fmt::Debug for BandwidthLayer<K, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BandwidthLayer")
            .field("rule", &self.shared.limiter.rule().name())
            .field("direction", &self.shared.direction)
            .finish_non_exhaustive()
    }
}

impl<S, K, St: Store> Layer<S> for BandwidthLayer<K, St> {
    type Service = BandwidthService<S, K, St>;

    fn layer(&self, inner: S) -> Self::Service {
        BandwidthService {
            inner,
            shared: Arc::clone(&self.shared),
        }
    }
}

impl BandwidthLayer<PeerIp, MemoryStore> {
    /// Starts a layer pacing each key to `bytes_per_second`, with bursts
    /// of up to `burst` bytes, under the rule name `name`. Defaults: keyed
    /// by peer IP, responses paced, in-memory store, chunks of a quarter of
    /// the burst (at most 1 MiB), keyless requests refused (400).
    pub fn builder(
        name: &str,
        bytes_per_second: u32,
        burst: u32,
    ) -> BandwidthLayerBuilder<PeerIp, MemoryStore> {
        BandwidthLayerBuilder {
            name: name.to_owned(),
            rate: bytes_per_second,
            burst,
            chunk: None,
            key: PeerIp::new(),
            store: MemoryStore::new(),
            direction: Direction::default(),
            missing: MissingKey::default(),
            routes: None,
        }
    }
}

/// Builds a [`BandwidthLayer`]; see [`BandwidthLayer::builder`].
pub struct BandwidthLayerBuilder<K, St> {
    name: String,
    rate: u32,
    burst: u32,
    chunk: Option<u32>,
    key: K,
    store: St,
    direction: Direction,
    missing: MissingKey,
    routes: Option<crate::Routes>,
}

impl<K: fmt::Debug, St> fmt::Debug for BandwidthLayerBuilder<K, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BandwidthLayerBuilder")
            .field("name", &self.name)
            .field("rate", &self.rate)
            .field("burst", &self.burst)
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

/// `a` and `b`'s greatest common divisor.
fn gcd(mut a: u64, mut b: u64) -> u64 {
    while let Some(r) = a.checked_rem(b) {
        a = b;
        b = r;
    }
    a
}

/// The token bucket for `rate` bytes a second with `burst`: `refill`
/// bytes every `interval` ns. Exact — `rate / g` bytes every `1 s / g`,
/// for g the greatest common divisor of the rate and 10⁹ — when that
/// refill fits the burst; otherwise the longest tick whose refill does,
/// rounded so that the rate is never exceeded (a refill above the burst
/// would be thrown away, pacing far below the rate).
pub(crate) fn bucket(rate: u32, burst: u32) -> (u32, u64) {
    let (rate64, burst64) = (u64::from(rate).max(1), u64::from(burst).max(1));
    let g = gcd(rate64, 1_000_000_000);
    let refill = rate64.checked_div(g).unwrap_or(1);
    if refill <= burst64 {
        let interval = 1_000_000_000u64.checked_div(g).unwrap_or(1);
        return (u32::try_from(refill).unwrap_or(burst), interval);
    }
    // The whole burst every ⌈burst × 10⁹ / rate⌉ ns: never faster than
    // the rate, slower by less than a nanosecond per tick.
    let nanos = u128::from(burst64).saturating_mul(1_000_000_000);
    let interval = nanos.checked_div(u128::from(rate64)).map_or(1, |q| {
        if q.saturating_mul(u128::from(rate64)) < nanos {
            q.saturating_add(1)
        } else {
            q
        }
    });
    (burst, u64::try_from(interval.max(1)).unwrap_or(u64::MAX))
}

impl<K, St> BandwidthLayerBuilder<K, St> {
    /// Whose budget a body draws on (default: [`PeerIp`]).
    pub fn key<K2>(self, key: K2) -> BandwidthLayerBuilder<K2, St> {
        BandwidthLayerBuilder {
            name: self.name,
            rate: self.rate,
            burst: self.burst,
            chunk: self.chunk,
            key,
            store: self.store,
            direction: self.direction,
            missing: self.missing,
            routes: self.routes,
        }
    }

    /// Where the byte budgets live (default: a new [`MemoryStore`]); a
    /// Redis store shares them across a fleet.
    pub fn store<St2: Store>(self, store: St2) -> BandwidthLayerBuilder<K, St2> {
        BandwidthLayerBuilder {
            name: self.name,
            rate: self.rate,
            burst: self.burst,
            chunk: self.chunk,
            key: self.key,
            store,
            direction: self.direction,
            missing: self.missing,
            routes: self.routes,
        }
    }

    /// Which bodies to pace (default: [`Direction::Responses`]).
    pub fn direction(mut self, direction: Direction) -> Self {
        self.direction = direction;
        self
    }

    /// How many bytes a body takes from the store at once (default: a
    /// quarter of the burst, at most 1 MiB; from 1 to the burst). Larger
    /// chunks mean fewer store calls; smaller ones, a finer share of a
    /// budget that many bodies draw on at once. A body known to be shorter
    /// than a chunk (by its size hint) takes only what it holds, so a short
    /// answer waits for its own bytes, not a chunk's.
    ///
    /// Tokens are taken when a chunk is granted, not when its bytes reach
    /// the client: bodies whose readers are slow hold their chunks' credit
    /// while the budget refills, and then send together. Over a short
    /// window a key can send up to its burst plus one chunk per body in
    /// flight; the chunk is the knob for that bound. Bodies refused
    /// together wait up to an eighth longer than told, at random, so that
    /// they do not all wake at once.
    pub fn chunk(mut self, bytes: u32) -> Self {
        self.chunk = Some(bytes);
        self
    }

    /// What to do with requests that have no key (default, as on every
    /// layer: [`MissingKey::Reject`], a 400 before the inner service is
    /// called; `Skip` lets them through unpaced, counted as `unkeyed` in
    /// `tollgate_bandwidth_requests_total`; `Fallback` paces every keyless
    /// request on one shared budget).
    pub fn on_missing_key(mut self, missing: MissingKey) -> Self {
        self.missing = missing;
        self
    }

    /// Only requests to `routes` are limited by this layer; others pass
    /// it untouched (not counted, no headers from it). An empty set is a
    /// build error.
    pub fn routes(mut self, routes: crate::Routes) -> Self {
        self.routes = Some(routes);
        self
    }
}

impl<K, St: Store> BandwidthLayerBuilder<K, St> {
    /// Validates and binds the byte budget to the store; every error names
    /// its field.
    pub fn build(self) -> Result<BandwidthLayer<K, St>, ConfigError> {
        if self.rate == 0 || self.rate > 1_000_000_000 {
            return Err(ConfigError::new(
                "bytes_per_second",
                "must be from 1 to 1,000,000,000 (a byte per nanosecond)",
            ));
        }
        if self.burst == 0 {
            return Err(ConfigError::new("burst", "must be at least 1"));
        }
        crate::Routes::check(self.routes.as_ref())?;
        let (refill, interval) = bucket(self.rate, self.burst);
        let rule = Rule::new(
            &self.name,
            Limit::token_bucket(self.burst, refill, Duration::from_nanos(interval)),
        )?;
        let chunk = self
            .chunk
            .unwrap_or_else(|| (self.burst / 4).clamp(1, 1 << 20));
        if chunk == 0 || chunk > self.burst {
            return Err(ConfigError::new("chunk", "must be from 1 to the burst"));
        }
        Ok(BandwidthLayer {
            shared: Arc::new(Shared {
                key: self.key,
                limiter: self.store.limiter(&rule)?,
                chunk,
                direction: self.direction,
                keying: Keying::new(self.missing).scoped(self.routes),
                metrics: (
                    Arc::new(BandwidthMetrics::register(&self.name, "request")),
                    Arc::new(BandwidthMetrics::register(&self.name, "response")),
                ),
                keyless: BandwidthMetrics::keyless(&self.name),
            }),
        })
    }
}

/// The service of [`BandwidthLayer`].
pub struct BandwidthService<S, K, St: Store> {
    inner: S,
    shared: Arc<Shared<K, St::Limiter>>,
}

impl<S: Clone, K, St: Store> Clone for BandwidthService<S, K, St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S: fmt::Debug, K, St: Store> fmt::Debug for BandwidthService<S, K, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BandwidthService")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<K, L: Limiter> Shared<K, L> {
    /// A pacer for the request body (`response` false) or the response's,
    /// when the layer paces it and the request has a key.
    fn pacer(&self, key: &Option<KeyBytes>, on: bool, response: bool) -> Option<Pacer<L>> {
        match (key, on) {
            (Some(key), true) => Some(Pacer::new(
                self.limiter.clone(),
                Arc::clone(if response {
                    &self.metrics.1
                } else {
                    &self.metrics.0
                }),
                key.clone(),
                self.chunk,
            )),
            _ => None,
        }
    }
}

impl<S, K, St: Store, ReqB, ResB> Service<Request<ReqB>> for BandwidthService<S, K, St>
where
    S: Service<Request<PacedBody<ReqB, St::Limiter>>, Response = Response<ResB>>,
    K: KeyExtractor<ReqB>,
    ResB: RejectionBody,
{
    type Response = Response<PacedBody<ResB, St::Limiter>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, St::Limiter>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let shared = &self.shared;
        let mut buf = KeyBuf::new();
        let (unkeyed, missing) = &shared.keyless;
        let rule = shared.limiter.rule().name();
        let key = if !shared.keying.applies(&req) {
            None
        } else {
            let extracted = shared.key.extract(&req, &mut buf);
            match (shared.keying).resolve(extracted, &mut buf, rule, Some((unkeyed, missing))) {
                Keyed::Key => Some(KeyBytes::new(&mut buf)),
                Keyed::Skip => None,
                Keyed::Reject => {
                    let rejected = Rejected {
                        rule: Arc::from(rule),
                        kind: LimitKind::Bandwidth,
                        reason: Reason::MissingKey,
                        decision: None,
                        grpc: is_grpc(&req),
                    };
                    let response = crate::rejection::mark(if rejected.grpc {
                        rejected.to_grpc_response()
                    } else {
                        rejected.to_problem_response()
                    });
                    return ResponseFuture {
                        state: State::Rejected {
                            response: Some(response),
                        },
                        pacer: None,
                    };
                }
            }
        };
        let d = shared.direction;
        let upload = shared.pacer(
            &key,
            matches!(d, Direction::Requests | Direction::Both),
            false,
        );
        let req = req.map(|body| PacedBody::new(body, upload));
        let download = shared.pacer(
            &key,
            matches!(d, Direction::Responses | Direction::Both),
            true,
        );
        ResponseFuture {
            state: State::Calling {
                future: self.inner.call(req),
            },
            pacer: download,
        }
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F> {
        Calling {
            #[pin]
            future: F,
        },
        // A request the layer could not key, refused.
        Rejected {
            response: Option<Response<bytes::Bytes>>,
        },
    }
}

pin_project! {
    /// Response future of [`BandwidthService`]: wraps the response body.
    pub struct ResponseFuture<F, L: Limiter> {
        #[pin]
        state: State<F>,
        pacer: Option<Pacer<L>>,
    }
}

impl<F, L: Limiter> fmt::Debug for ResponseFuture<F, L> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<F, L, ResB, E> Future for ResponseFuture<F, L>
where
    F: Future<Output = Result<Response<ResB>, E>>,
    L: Limiter,
    ResB: RejectionBody,
{
    type Output = Result<Response<PacedBody<ResB, L>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        match this.state.project() {
            StateProj::Calling { future } => {
                let response = ready!(future.poll(cx))?;
                let pacer = this.pacer.take();
                Poll::Ready(Ok(response.map(|body| PacedBody::new(body, pacer))))
            }
            StateProj::Rejected { response } => match response.take() {
                Some(r) => Poll::Ready(Ok(r.map(|b| PacedBody::new(ResB::rejection(b), None)))),
                None => Poll::Pending,
            },
        }
    }
}
