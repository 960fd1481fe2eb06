//! The servers behind the runnable examples, as functions so the end-to-end
//! tests exercise exactly what the binaries serve.
//!
//! Run the quickstart with `cargo run -p tollgate-examples --bin quickstart`.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::http::Method;
use axum::routing::{get, post};
use axum::Router;
use tollgate::concurrency::{AdaptiveLimit, ConcurrencyLayer, Gradient};
use tollgate::cost::ByRoute;
use tollgate::key::{ClientIp, Header, KeyExtractorExt};
use tollgate::{ConfigError, Limit, Rate, RateLimitLayer, Store};

/// The size of `GET /api/download`'s body.
pub const DOWNLOAD_BYTES: usize = 1 << 20;
/// The size of its chunks.
pub const DOWNLOAD_CHUNK: usize = 16 << 10;
/// How often a chunk is sent: 256 KiB/s, so a download takes 4 s and two
/// of them are easy to catch in flight.
pub const DOWNLOAD_EVERY: std::time::Duration = std::time::Duration::from_micros(62_500);

/// The quickstart's API:
///
/// - one budget per client of 10 requests per second with bursts of 20,
///   where an order costs 3 and a report 10;
/// - `GET /api/download` streams 1 MiB in 16 KiB chunks at 256 KiB/s, at
///   most 2 at once per client: a third is refused at once while two
///   bodies are still being sent;
/// - every `/api/*` route sits behind at most 64 requests in flight per
///   client and an adaptive whole-service limit (a gradient of latencies,
///   between 16 and 512) that follows the service's latency and errors;
/// - `/healthz` is not limited.
///
/// The client is its `x-api-key`, else its IP: the peer's, or — when the
/// peer is one of `trusted_proxies` (CIDRs) — the address those proxies
/// report in `X-Forwarded-For`.
pub fn quickstart_app<S: Store>(
    store: S,
    trusted_proxies: &[String],
) -> Result<Router, ConfigError> {
    let client = Header::named("x-api-key")?.or(ClientIp::trusting(trusted_proxies)?);
    let downloads = ConcurrencyLayer::builder("downloads", 2)
        .key(client.clone())
        .store(store.clone())
        .build()?;
    let in_flight = ConcurrencyLayer::builder("per-client", 64)
        .key(client.clone())
        .store(store.clone())
        .adaptive_service_limit(
            "service",
            AdaptiveLimit::Gradient(Gradient::new(16, 64, 512)?),
        )
        .build()?;
    let limit = RateLimitLayer::builder("per-key", Limit::gcra(Rate::per_second(10), 20))
        .key(client)
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
        .route(
            "/api/download",
            get(|| async { Body::new(Chunks::new(DOWNLOAD_BYTES)) }).route_layer(downloads),
        )
        // route_layer: only matched routes are limited; a 404 costs nothing.
        .route_layer(limit)
        .route_layer(in_flight);
    Ok(Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .merge(api))
}

/// A body of `n` bytes in 16 KiB chunks, one every [`DOWNLOAD_EVERY`].
struct Chunks {
    left: usize,
    next: Pin<Box<tokio::time::Sleep>>,
}

impl Chunks {
    fn new(n: usize) -> Self {
        Self {
            left: n,
            next: Box::pin(tokio::time::sleep(std::time::Duration::ZERO)),
        }
    }
}

impl http_body::Body for Chunks {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        if self.left == 0 {
            return Poll::Ready(None);
        }
        std::task::ready!(self.next.as_mut().poll(cx));
        let at = self.next.deadline();
        self.next
            .as_mut()
            .reset(at.checked_add(DOWNLOAD_EVERY).unwrap_or(at));
        let n = self.left.min(DOWNLOAD_CHUNK);
        self.left = self.left.saturating_sub(n);
        static CHUNK: [u8; DOWNLOAD_CHUNK] = [b'x'; DOWNLOAD_CHUNK];
        let chunk = Bytes::from_static(CHUNK.get(..n).unwrap_or_default());
        Poll::Ready(Some(Ok(http_body::Frame::data(chunk))))
    }

    fn is_end_stream(&self) -> bool {
        self.left == 0
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.left as u64)
    }
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
