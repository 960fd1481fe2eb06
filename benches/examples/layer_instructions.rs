//! Runs one `layer_overhead` stack N times, for instruction counts that do
//! not depend on the machine's noise:
//! `valgrind --tool=callgrind target/release/examples/layer_instructions tollgate 3000`
//! (stacks: bare, tollgate, governor, tollgate_denied, governor_denied).
//! Subtract a run of 1000 from a run of 3000 and divide by 2000.
#![allow(missing_docs, clippy::unwrap_used, clippy::panic)]
use axum::body::Body;
use axum::http::{HeaderValue, Request, StatusCode};
use axum::routing::get;
use axum::Router;
use std::time::Duration;
use tollgate::key::Header;
use tollgate::{Limit, Rate, RateLimitLayer};
use tower::ServiceExt;
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::key_extractor::KeyExtractor;
use tower_governor::{GovernorError, GovernorLayer};
fn router() -> Router {
    Router::new().route("/", get(|| async { "ok" }))
}

fn request() -> Request<Body> {
    Request::get("/")
        .header("x-api-key", "bench-key-0123456789")
        .body(Body::empty())
        .unwrap()
}

/// tower_governor's key from the `x-api-key` header (`HeaderValue`: a
/// cheap clone, the fairest owned key it allows).
#[derive(Clone)]
struct ApiKey;

impl KeyExtractor for ApiKey {
    type Key = HeaderValue;

    fn extract<T>(&self, req: &Request<T>) -> Result<Self::Key, GovernorError> {
        req.headers()
            .get("x-api-key")
            .cloned()
            .ok_or(GovernorError::UnableToExtractKey)
    }
}

/// Allowed: one unit per nanosecond, a burst worth a second.
fn tollgate_router(limit: Limit) -> Router {
    let layer = RateLimitLayer::builder("bench", limit)
        .key(Header::named("x-api-key").unwrap())
        .build()
        .unwrap();
    router().layer(layer)
}

fn governor_router(period: Duration, burst: u32) -> Router {
    let config = GovernorConfigBuilder::default()
        .period(period)
        .burst_size(burst)
        .key_extractor(ApiKey)
        .use_headers()
        .finish()
        .unwrap();
    router().layer(GovernorLayer::new(config))
}

fn main() {
    let which = std::env::args().nth(1).unwrap();
    let n: usize = std::env::args().nth(2).unwrap().parse().unwrap();
    let (app, want) = match which.as_str() {
        "bare" => (router(), StatusCode::OK),
        "tollgate" => (
            tollgate_router(Limit::gcra(Rate::per_second(1_000_000_000), 1_000_000_000)),
            StatusCode::OK,
        ),
        "governor" => (
            governor_router(Duration::from_nanos(1), 1_000_000_000),
            StatusCode::OK,
        ),
        "tollgate_denied" => (
            tollgate_router(Limit::gcra(Rate::per_day(1), 1)),
            StatusCode::TOO_MANY_REQUESTS,
        ),
        "governor_denied" => (
            governor_router(Duration::from_secs(86_400), 1),
            StatusCode::TOO_MANY_REQUESTS,
        ),
        other => panic!("unknown stack {other:?}"),
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async {
        app.clone().oneshot(request()).await.unwrap();
        for _ in 0..n {
            let res = app.clone().oneshot(request()).await.unwrap();
            assert_eq!(res.status(), want);
        }
    });
}
