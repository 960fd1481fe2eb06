//! Tower middleware that keeps APIs available and affordable under floods,
//! retry storms, credential stuffing and expensive calls.
//!
//! [`RateLimitLayer`] limits requests per client key (API key, user, IP
//! behind trusted proxies, route, or any mix), weighted per request (a
//! report costs more than a read), with every classic algorithm
//! (GCRA, token bucket, fixed and sliding windows, leaky-bucket pacing),
//! in process or across a fleet. [`ConcurrencyLayer`] limits requests in
//! flight per key and for the whole service (fixed or adaptive), holding
//! each permit until the response body is done. [`QuotaLayer`] keeps
//! calendar quotas (per day, month, ...), [`bandwidth::BandwidthLayer`]
//! paces bodies to bytes per second, and — on the client side —
//! [`RetryBudgetLayer`] retries failed calls only while a retry budget
//! allows. [`PolicyLayer`] decides several rate rules as one — per key,
//! per address, global — refunding what the others charged when one
//! refuses, with plans, allow and deny lists, canaries, idempotent
//! repeats and response-aware rules (failed logins). They work with any
//! `http::Request` service: axum routers (`.layer`, `.route_layer`),
//! tonic servers (feature `tonic`), and plain Tower stacks. Responses
//! pass through in the inner service's own body type, in which a
//! rejection is made too ([`RejectionBody`]: axum's and tonic's bodies,
//! `String`, `Full`, boxed bodies; any other with
//! [`ResponseBody::wrap`]).
//!
//! ```
//! use axum::{routing::{get, post}, Router};
//! use http::{Method, Request, StatusCode};
//! use tower::ServiceExt;
//! use tollgate::{cost::ByRoute, key::{Header, KeyExtractorExt, PeerIp}, Limit, Rate, RateLimitLayer};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // 10 requests per second per client, bursts of 20; writes cost 3.
//! let limit = RateLimitLayer::builder("per-key", Limit::gcra(Rate::per_second(10), 20))
//!     .key(Header::named("x-api-key")?.or(PeerIp::new()))
//!     .cost(ByRoute::new(1).route(Some(Method::POST), "/orders", 3))
//!     .build()?;
//! let app = Router::new()
//!     .route("/hello", get(|| async { "hello" }))
//!     .route("/orders", post(|| async { "ordered" }))
//!     .layer(limit);
//!
//! let order = || Request::post("/orders").header("x-api-key", "k1").body(String::new()).unwrap();
//! for _ in 0..6 {
//!     let res = app.clone().oneshot(order()).await?;
//!     assert_eq!(res.status(), StatusCode::OK);
//! }
//! // 6 orders × 3 = 18 of 20: a seventh does not fit.
//! let res = app.clone().oneshot(order()).await?;
//! assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
//! assert_eq!(res.headers()["retry-after"], "1");
//! assert_eq!(res.headers()["ratelimit"], "\"per-key\";r=2;t=1");
//! # Ok(())
//! # }
//! ```
//!
//! # Modules
//!
//! - [`key`]: who a request counts against;
//! - [`cost`]: what it costs;
//! - [`rate_limit`]: the rate layer, and why it decides in `call`;
//! - [`policy`]: several rules as one decision, plans, lists;
//! - [`concurrency`]: the concurrency layer, and why its permits live as
//!   long as the response body;
//! - [`quota`]: calendar quotas; [`bandwidth`]: byte rates;
//! - [`retry`]: retry budgets for clients, and why a budget beats a count;
//! - [`headers`] and [`rejection`]: what clients see;
//! - [`observe`]: the metrics every layer exports;
//! - [`outcome`]: how a response ended (HTTP status or `grpc-status`), as
//!   every layer that reads outcomes classifies it.
//!
//! - [`store`]: [`AnyStore`], the memory or Redis store chosen at run
//!   time.
//!
//! The decision engine (`tollgate-core`, as `tollgate::core`) and the in-memory
//! store (`tollgate-memory`, as `tollgate::memory`) are re-exported, and so are the
//! store traits a signature names ([`Store`], [`QuotaStore`],
//! [`RetryBudgetStore`], [`Limiter`], ...).
//!
//! # Stacking layers
//!
//! Put what is cheap to refuse outside and what charges a lasting budget
//! inside:
//!
//! ```text
//! PolicyLayer (per address)  ->  auth  ->  PolicyLayer (per key, plans)
//!     ->  ConcurrencyLayer  ->  QuotaLayer  ->  handler
//! ```
//!
//! - **Rates count attempts.** A rate limit outside another limit is
//!   charged for a request the inner limit then refuses: the attempt was
//!   made, and a client that retries into a full concurrency limit is
//!   exactly the load a rate limit is for. Only the quota gives back what
//!   it did not serve.
//! - **Quotas innermost.** A quota bills, so it should charge only served
//!   requests. It gives back what an inner tollgate layer refused and what
//!   the service failed with (`QuotaLayerBuilder::refund_unserved`, on by
//!   default, and its `RateLimit` field then shows the units after the
//!   refund), so the order is safe either way, but innermost it has
//!   nothing to give back.
//! - **Rates before concurrency.** A flood is refused by its rate before
//!   it can hold a permit.
//! - **Several rate rules in one [`PolicyLayer`]**, not one layer each: the
//!   policy decides them as one and refunds the others when one refuses
//!   (per key and per address, so rotating API keys buys nothing).
//! - **Authentication between them.** A limit keyed by address goes
//!   outside authentication, so that it protects the authentication itself
//!   (credential stuffing, costly password hashing); a limit keyed by
//!   user, API key or plan goes inside it, so that its keys and plans come
//!   from verified identities (`plan_from_extension`), not from whatever a
//!   client sends.
//! - **One decision, or the address first: a choice.** Per-key and
//!   per-address rules in one policy are one decision (a refusal by
//!   either charges neither) and sit inside authentication, with it. A
//!   per-address policy outside authentication protects the authentication
//!   too, but is a decision of its own: it is charged for requests the
//!   inner policy refuses. The quickstart takes the first (its
//!   authentication is cheap); a login endpoint wants the second.
//! - **Order in axum.** `ServiceBuilder::new().layer(a).layer(b)` puts `a`
//!   outside `b`, as the diagram reads; `Router::layer(a).layer(b)` puts
//!   `b` outside `a` (each call wraps what is there). Use one
//!   `ServiceBuilder` in `Router::layer` to read the order top down.
//!
//! # Memory in development, Redis in production
//!
//! Build on an [`AnyStore`]: `MemoryStore::new().into()` or
//! `RedisStore::builder(url)...build()?.into()`. Every layer built on it has
//! one type whichever store it holds, so an axum router and a tonic
//! `Server::builder()` chain are written once.
//!
//! # Features
//!
//! Types that need a feature say so in their docs (on docs.rs, with a
//! badge).
//!
//! | feature | default | what it adds |
//! |---|---|---|
//! | `axum` | yes | peer IPs from axum's `ConnectInfo`, [`key::Route`] from `MatchedPath`; rejections in axum's `Body` |
//! | `tonic` | no | rejections in tonic's `Body`, so the layers wrap a tonic server's routes |
//! | `redis` | no | `RedisStore` (standalone, Cluster, Sentinel), re-exported from `tollgate-redis` as `tollgate::redis`; `AnyStore` can hold it |
//! | `redis-tls` | no | `rediss://` URLs (TLS to Redis), through the system's OpenSSL; implies `redis` |
//! | `config` | no | `tollgate::config`: every limit declared in a TOML policy file — one `Tollgate` layer (with `axum`) or each layer by name — validated with line and field, reloaded on SIGHUP and on change |
//! | `schema` | no | `config::json_schema`: a JSON Schema of the policy file (shipped as `policy.schema.json`); implies `config` |
//! | `tz` | no | IANA time zones for quotas (`calendar::Zone::iana`, through `jiff`): days from local midnight to local midnight across daylight saving time |
//! | `geoip` | no | coarse network keys from a MaxMind-format database (`key::GeoIp`: the client's autonomous system or country; in policy files `[geoip]` and the key parts `asn`, `country`), through `maxminddb` |

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

pub mod bandwidth;
mod body;
mod clock;
pub mod concurrency;
#[cfg(feature = "config")]
pub mod config;
pub mod cost;
pub mod headers;
mod ip;
pub mod key;
#[cfg(test)]
mod late;
pub mod observe;
pub mod outcome;
pub mod policy;
pub mod quota;
pub mod rate_limit;
pub mod rejection;
pub mod retry;
pub(crate) mod routes;
pub mod store;
mod task;
mod ways;

pub use body::{RejectionBody, ResponseBody};
pub use clock::TokioClock;
pub use concurrency::{ConcurrencyLayer, ConcurrencyService};
pub use policy::{PolicyLayer, PolicyService};
pub use quota::{QuotaLayer, QuotaService};
pub use rate_limit::{
    MissingKey, RateLimitLayer, RateLimitLayerBuilder, RateLimitService, RateLimited,
};
pub use rejection::OnStoreError;
pub use retry::{RetryBudgetLayer, RetryBudgetService};
pub use routes::Routes;
pub use store::AnyStore;
pub use tollgate_core::{
    self as core, calendar, Algorithm, Clock, ConcurrencyLimiter, ConfigError, Decision, Limit,
    Limiter, ManualClock, Outcome, QuotaLimiter, QuotaStore, Rate, RetryBudgetLimiter,
    RetryBudgetStore, Rule, Store, StoreError, StoreErrorKind, SystemClock,
};
pub use tollgate_memory::{self as memory, MemoryStore, MemoryStoreBuilder};
#[cfg(feature = "redis")]
pub use tollgate_redis::{self as redis, FailurePolicy, RedisStore, RedisStoreBuilder};

/// The boxed error of error-mode services.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
