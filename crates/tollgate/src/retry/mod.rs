//! Retry budgets: client retries that cannot turn into a storm.
//!
//! [`RetryBudgetLayer`] wraps a *client* service — calls to an upstream —
//! where the other layers protect a server. It retries failed calls (by
//! default: errors of the inner service, such as connect errors and
//! timeouts; 502, 503, 504 and 429; gRPC `UNAVAILABLE` and
//! `RESOURCE_EXHAUSTED`) with exponential backoff and full jitter, never
//! sooner than the server's `Retry-After` or `grpc-retry-pushback-ms` asks
//! (the jitter comes on top of what it asks, so clients told to come back
//! in a second do not all come back at once; nor when it asks for longer
//! than
//! [`max_server_wait`](RetryBudgetLayerBuilder::max_server_wait)), up to a
//! number of attempts and an overall
//! [`deadline`](RetryBudgetLayerBuilder::deadline) — but only while a
//! **retry budget** allows.
//!
//! # Why a budget, not a retry count
//!
//! "Retry three times" is harmless while one call in a thousand fails, and
//! a disaster when the upstream is down: every caller then sends three
//! times its normal load, at the very moment the upstream can least take
//! it, and the outage feeds itself. A budget bounds retries by a share of
//! recent calls — 20 % by default, plus a floor of 10 a second for quiet
//! clients — so a busy client's failing upstream sees at most about 1.2
//! times its normal load from it, whatever the failure rate. Retries still
//! smooth over the odd failure; they just cannot multiply an outage. The
//! budget is a first-class algorithm in the core
//! ([`RetryBudget`](tollgate_core::RetryBudget)), kept per upstream in a
//! store: in memory per process, or in Redis so a whole fleet of clients
//! shares one.
//!
//! # The floor is a reserve
//!
//! The floor of `min_per_second` retries a second is not spread out: it is
//! a reserve of `min_per_second × window` retries (100 with the defaults,
//! 10 a second over 10 s) that any burst of failures may draw on at once,
//! before the 20 % share. So the 1.2× bound holds for traffic that is
//! large beside the reserve, and a small burst is amplified more. Worked
//! example, an upstream failing half its calls, 3 attempts, defaults:
//!
//! | calls in the window | retries allowed | attempts sent | amplification |
//! |---:|---:|---:|---:|
//! | 200 | 100 + 20 % × 200 = 140 | 340 | 1.70× |
//! | 2,000 | 100 + 20 % × 2,000 = 500 | 2,500 | 1.25× |
//! | 20,000 | 100 + 20 % × 20,000 = 4,100 | 24,100 | 1.21× |
//!
//! A client whose calls are few and costly (a batch job, a login burst)
//! should lower the floor, down to `0` (`.budget(0.2, 0, window)`), where
//! the bound is 1.2× from the first call; the README's retry demo does so.
//!
//! # What is retried
//!
//! Only requests that are safe to send twice: idempotent methods, any
//! request with an `Idempotency-Key`, and requests the application marks
//! ([`Idempotent`] in its extensions, or its path named with
//! [`idempotent_path`](RetryBudgetLayerBuilder::idempotent_path): a gRPC
//! client's idempotent unary methods, since every gRPC call is a `POST`);
//! [`retry_any_method`](RetryBudgetLayerBuilder::retry_any_method) drops
//! the rule. A Tower error cannot tell a connect error, where nothing was
//! sent, from a failure after the request reached the upstream. A body is
//! buffered, up to [`buffer_limit`](RetryBudgetLayerBuilder::buffer_limit)
//! (64 KiB; at most [`MAX_BUFFER_LIMIT`]) and only for a request that may
//! be retried, so that every attempt sends the same bytes and trailers
//! ([`ReplayBody`]): a body of unknown length (a gRPC message) is read up
//! to the limit, and replayed if it ended there; a longer body is sent
//! once, as it streams, and not retried. A server that says retrying
//! cannot help — a negative `grpc-retry-pushback-ms` (gRFC A6), a 429
//! without `Retry-After`, or a `Retry-After` that is neither seconds nor
//! an HTTP date — is not retried. gRPC `UNAVAILABLE` and
//! `RESOURCE_EXHAUSTED` are retried by default when answered trailers-only
//! (as a server, a proxy or a limiter fails a call before any message); a
//! status in trailers after messages comes too late to retry the call.
//!
//! # Hedged requests
//!
//! Off by default: [`hedge`](RetryBudgetLayerBuilder::hedge) sends a call
//! that may be retried again, side by side, when it is still unanswered
//! after a fixed delay or a percentile of recent attempt latencies
//! ([`Hedge`]). The first answer not worth a retry wins; the other
//! attempt is dropped (its request cancelled). Each hedge is a
//! withdrawal from the budget and an attempt, so hedges and retries
//! together stay within the budget and `max_attempts`: a slow upstream
//! never gets twice its load (`tollgate_retry_hedges_total` counts them).
//!
//! # Adaptive throttling
//!
//! Off by default: [`adaptive_throttling`](RetryBudgetLayerBuilder::adaptive_throttling)
//! refuses calls locally when the upstream rejects most of them, so a
//! fleet backs off from an overloaded upstream without waiting for its
//! timeouts.
//!
//! ```
//! use std::convert::Infallible;
//! use std::sync::atomic::{AtomicU32, Ordering};
//! use std::sync::Arc;
//! use http::{Request, Response, StatusCode};
//! use tower::{service_fn, Layer, ServiceExt};
//! use tollgate::retry::RetryBudgetLayer;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! // An upstream that fails its first call.
//! let calls = Arc::new(AtomicU32::new(0));
//! let seen = Arc::clone(&calls);
//! let upstream = service_fn(move |_req: Request<_>| {
//!     let n = seen.fetch_add(1, Ordering::Relaxed);
//!     async move {
//!         let mut res = Response::new(());
//!         if n == 0 {
//!             *res.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
//!         }
//!         Ok::<_, Infallible>(res)
//!     }
//! });
//! let client = RetryBudgetLayer::builder("inventory").build()?.layer(upstream);
//! let req = Request::get("http://inventory.internal/items").body(String::new())?;
//! let res = client.oneshot(req).await?;
//! assert_eq!(res.status(), StatusCode::OK);
//! assert_eq!(calls.load(Ordering::Relaxed), 2);
//! # Ok(())
//! # }
//! ```

mod hedge;
mod layer;
mod policy;
#[cfg(test)]
mod tests;
mod throttle;

pub use hedge::Hedge;
pub use layer::{
    DeadlineExceeded, ResponseFuture, RetryBudgetLayer, RetryBudgetLayerBuilder,
    RetryBudgetService, Throttled, Upstream,
};
pub use policy::Attempt;

pin_project_lite::pin_project! {
    /// A request body as the retry layer sends it: the whole body, buffered
    /// so that every attempt sends the same bytes (and trailers), or — for a
    /// body too large or of unknown length to buffer — the original stream,
    /// sent once (such a request is not retried). The client the layer wraps
    /// takes `Request<ReplayBody<B>>`, e.g. hyper-util's
    /// `Client<HttpConnector, ReplayBody<Full<Bytes>>>`.
    #[derive(Debug)]
    pub struct ReplayBody<B> {
        // Bytes read ahead of `rest` (a body of unknown length that turned
        // out longer than the buffer limit), sent first, then the rest.
        prefix: Option<bytes::Bytes>,
        rest: Option<std::pin::Pin<Box<B>>>,
        #[pin]
        body: crate::ResponseBody<B>,
    }
}

impl<B> ReplayBody<B> {
    /// The caller's own body, sent once.
    pub(crate) fn inner(body: B) -> Self {
        Self {
            prefix: None,
            rest: None,
            body: crate::ResponseBody::inner(body),
        }
    }

    /// `prefix`, read from the caller's body already, then the rest of
    /// it: sent once.
    pub(crate) fn prefixed(prefix: bytes::Bytes, rest: std::pin::Pin<Box<B>>) -> Self {
        Self {
            prefix: (!prefix.is_empty()).then_some(prefix),
            rest: Some(rest),
            body: crate::ResponseBody::replay(bytes::Bytes::new(), None),
        }
    }

    /// `data`, then `trailers` if any: a buffered body sent again.
    pub(crate) fn replay(data: bytes::Bytes, trailers: Option<http::HeaderMap>) -> Self {
        Self {
            prefix: None,
            rest: None,
            body: crate::ResponseBody::replay(data, trailers),
        }
    }
}

impl<B: http_body::Body<Data = bytes::Bytes>> http_body::Body for ReplayBody<B> {
    type Data = bytes::Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, B::Error>>> {
        let this = self.project();
        if let Some(prefix) = this.prefix.take() {
            return std::task::Poll::Ready(Some(Ok(http_body::Frame::data(prefix))));
        }
        if let Some(rest) = this.rest {
            return rest.as_mut().poll_frame(cx);
        }
        this.body.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_none()
            && match &self.rest {
                Some(rest) => rest.is_end_stream(),
                None => self.body.is_end_stream(),
            }
    }

    fn size_hint(&self) -> http_body::SizeHint {
        let ahead = self.prefix.as_ref().map_or(0, |p| p.len() as u64);
        let rest = match &self.rest {
            Some(rest) => rest.size_hint(),
            None => self.body.size_hint(),
        };
        let mut hint = http_body::SizeHint::new();
        hint.set_lower(rest.lower().saturating_add(ahead));
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper.saturating_add(ahead));
        }
        hint
    }
}

/// The largest [`buffer_limit`](RetryBudgetLayerBuilder::buffer_limit): 16
/// MiB. Each retryable request in flight may hold its body this long.
pub const MAX_BUFFER_LIMIT: u64 = 16 << 20;

/// Marks a request as safe to send again (a request extension), whatever
/// its method: what a gRPC client needs, where every call is a `POST`.
/// Mark only unary calls that are idempotent (a read, a write keyed by a
/// request id): the layer buffers a marked body of unknown length (up to
/// [`buffer_limit`](RetryBudgetLayerBuilder::buffer_limit)) before the
/// first attempt, so a streaming call marked so would wait for data the
/// server has not asked for yet.
///
/// ```
/// let mut req = http::Request::post("/grpc.health.v1.Health/Check").body(()).unwrap();
/// req.extensions_mut().insert(tollgate::retry::Idempotent);
/// ```
///
/// With tonic, insert it in the `tonic::Request`'s extensions (or with an
/// interceptor), or name the methods once with
/// [`idempotent_path`](RetryBudgetLayerBuilder::idempotent_path).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Idempotent;
