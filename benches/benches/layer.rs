//! What the layer adds to a request: an axum `Router` with one handler,
//! driven by `oneshot`, bare and behind each limiter (in-memory GCRA, key
//! from the `x-api-key` header, headers on), for allowed requests and for a
//! key that is over its limit (every call a 429). One run, group
//! `layer_overhead`.
#![allow(missing_docs, clippy::unwrap_used)]

use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderValue, Request, StatusCode};
use axum::routing::get;
use axum::Router;
use criterion::{criterion_group, criterion_main, Criterion};
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

fn layer_overhead(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let mut g = c.benchmark_group("layer_overhead");
    let run =
        |g: &mut criterion::BenchmarkGroup<'_, _>, name: &str, app: Router, want: StatusCode| {
            // Prime: the over-limit stacks spend their single unit here.
            rt.block_on(app.clone().oneshot(request())).unwrap();
            g.bench_function(name, |b| {
                b.to_async(&rt).iter(|| {
                    let app = app.clone();
                    async move {
                        let res = app.oneshot(request()).await.unwrap();
                        assert_eq!(res.status(), want);
                    }
                })
            });
        };
    run(&mut g, "bare", router(), StatusCode::OK);
    run(
        &mut g,
        "tollgate",
        tollgate_router(Limit::gcra(Rate::per_second(1_000_000_000), 1_000_000_000)),
        StatusCode::OK,
    );
    run(
        &mut g,
        "tower_governor",
        governor_router(Duration::from_nanos(1), 1_000_000_000),
        StatusCode::OK,
    );
    run(
        &mut g,
        "tollgate_denied",
        tollgate_router(Limit::gcra(Rate::per_day(1), 1)),
        StatusCode::TOO_MANY_REQUESTS,
    );
    run(
        &mut g,
        "tower_governor_denied",
        governor_router(Duration::from_secs(86_400), 1),
        StatusCode::TOO_MANY_REQUESTS,
    );
    g.finish();
}

criterion_group!(benches, layer_overhead);
criterion_main!(benches);
