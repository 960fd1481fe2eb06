//! The servers behind the runnable examples, as functions so the end-to-end
//! tests exercise exactly what the binaries serve.
//!
//! Run the quickstart with `cargo run -p tollgate-examples --bin quickstart`.

use std::net::SocketAddr;

use axum::http::Method;
use axum::routing::{get, post};
use axum::Router;
use tollgate::cost::ByRoute;
use tollgate::key::{ClientIp, Header, KeyExtractorExt};
use tollgate::{ConfigError, Limit, Rate, RateLimitLayer, Store};

/// The quickstart's API: one budget per client of 10 requests per second
/// with bursts of 20, where an order costs 3 and a report 10;
/// `/healthz` is not limited.
///
/// The client is its `x-api-key`, else its IP: the peer's, or — when the
/// peer is one of `trusted_proxies` (CIDRs) — the address those proxies
/// report in `X-Forwarded-For`.
pub fn quickstart_app<S: Store>(
    store: S,
    trusted_proxies: &[String],
) -> Result<Router, ConfigError> {
    let limit = RateLimitLayer::builder("per-key", Limit::gcra(Rate::per_second(10), 20))
        .key(Header::named("x-api-key")?.or(ClientIp::trusting(trusted_proxies)?))
        .cost(
            ByRoute::new(1)
                .route(Some(Method::POST), "/api/orders", 3)
                .route(Some(Method::POST), "/api/reports", 10),
        )
        .store(store)
        .build()?;
    let api = Router::new()
        .route(
            "/api/hello",
            get(|| async { "Hello from behind the tollgate.\n" }),
        )
        .route("/api/orders", post(|| async { "Order placed.\n" }))
        .route("/api/reports", post(|| async { "Report generated.\n" }))
        // route_layer: only matched routes are limited; a 404 costs nothing.
        .route_layer(limit);
    Ok(Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .merge(api))
}

/// Serves `app` on `listener` with peer addresses available to the key
/// extractors, until ctrl-c.
pub async fn serve(listener: tokio::net::TcpListener, app: Router) -> std::io::Result<()> {
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await
}
