//! Concurrency limits: requests in flight per client key, and for the
//! whole service, with permits that live as long as the response body.
//!
//! [`ConcurrencyLayer`] caps how many requests each key (API key, user, IP,
//! route, ...) has in flight at once, weighted per request, in a shared
//! store: in process by default, in Redis when a fleet must share one
//! limit. Optionally it also caps the whole service — at a fixed number,
//! or at an adaptive limit that follows the service's latency and errors.
//!
//! # Why the permit lives as long as the body
//!
//! A request is in flight until its response has been sent, not until the
//! handler returns: a download, a stream of server-sent events or a slow
//! client reading a large report keeps the server's resources (a file
//! handle, a database cursor, a socket buffer) for as long as the body is
//! being read. tower's `ConcurrencyLimit` releases its permit when the
//! response *headers* are ready, so it counts none of that (tower-http
//! PR #447 asks for exactly this). Here the permit is an owned guard moved
//! into the response body ([`PermitBody`]): it is released, exactly once,
//! when the last frame is read, when the body fails, or when the body is
//! dropped — and at once when the request is cancelled before it has a
//! response (the client went away, a timeout layer above gave up).
//!
//! # Why answer at once
//!
//! Over the limit the layer answers 429 with `Retry-After` and
//! `RateLimit-Policy: "<name>";q=<max>;qu="concurrent-requests"`
//! (gRPC: `RESOURCE_EXHAUSTED`), in `call`: it never parks callers in
//! `poll_ready`, which would hold a connection for every client and cannot
//! tell one client from another. Requests may instead wait in a bounded
//! FIFO queue per key with a maximum wait ([`queue`](ConcurrencyLayerBuilder::queue)),
//! in the response future.
//!
//! # Critical reserve
//!
//! With [`critical`](ConcurrencyLayerBuilder::critical), non-critical
//! requests may hold at most a share of each limit (say 80 %), so health
//! checks, payments or an operator's requests still get through when a key
//! or the service is saturated (Stripe's "critical reserve").
//!
//! # Adaptive service limit and read-only mode
//!
//! [`adaptive_service_limit`](ConcurrencyLayerBuilder::adaptive_service_limit)
//! caps the whole process at a limit that follows the protected service's
//! latency and errors ([`tollgate_core::adaptive`](https://docs.rs/tollgate-core/latest/tollgate_core/adaptive/): AIMD or a gradient of
//! RTTs). Each response is a sample: its latency to the response headers,
//! and whether it was a drop — by default an error (a timeout layer
//! inside, say), a 5xx (but 501) or a 408, or a gRPC `DEADLINE_EXCEEDED`,
//! `INTERNAL` or `UNAVAILABLE` (read from a
//! trailers-only answer's head, or from the trailers at the end of a
//! streamed one: [`Completion`]);
//! [`drop_classifier`](ConcurrencyLayerBuilder::drop_classifier) changes
//! that. A cancelled request gives no sample. The adaptive limit counts a
//! request from its admission to its response's head, the same interval
//! its latency measures: a long body (a download, server-sent events, an
//! upgraded connection) holds its per-key and fixed service permits to
//! the end, but not the adaptive one, so long-lived responses can never
//! fill the adaptive limit and freeze the service. The current limit is
//! the gauge `tollgate_concurrency_limit`. With
//! [`read_only_above`](ConcurrencyLayerBuilder::read_only_above), while the
//! error rate is high only GET, HEAD and OPTIONS go through and other
//! methods get 503 with `Retry-After`: a struggling service keeps serving
//! reads instead of failing everything. gRPC calls are all POSTs, so in
//! read-only mode every gRPC call is refused (`UNAVAILABLE`, which gRPC
//! clients retry with backoff); put read-only mode in front of HTTP
//! routes only if that is not what you want.
//!
//! # WebSockets and other upgrades
//!
//! An upgraded connection outlives its (empty) response body, so its
//! permit ends with the `101` response's body. To count it until the
//! connection closes, take the [`Permit`] out of the request's
//! [`UpgradePermit`] extension in the upgrade handler and move it into the
//! connection's task (see [`UpgradePermit`]).
//!
//! ```
//! use std::time::Duration;
//! use axum::{routing::get, Router};
//! use http::{Request, StatusCode};
//! use tower::ServiceExt;
//! use tollgate::{concurrency::ConcurrencyLayer, key::Header};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let layer = ConcurrencyLayer::builder("downloads", 1)
//!     .key(Header::named("x-api-key")?)
//!     .build()?;
//! let app = Router::new().route("/dl", get(|| async { "a large body" })).layer(layer);
//! let get = || Request::get("/dl").header("x-api-key", "k1").body(String::new()).unwrap();
//!
//! // The first download holds the key's only permit while its body is unread...
//! let first = app.clone().oneshot(get()).await?;
//! assert_eq!(first.status(), StatusCode::OK);
//! let second = app.clone().oneshot(get()).await?;
//! assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
//! assert_eq!(second.headers()["retry-after"], "1");
//! assert_eq!(
//!     second.headers()["ratelimit-policy"],
//!     "\"downloads\";q=1;qu=\"concurrent-requests\""
//! );
//! // ...and gives it back when the body is done with.
//! drop(first);
//! assert_eq!(app.clone().oneshot(get()).await?.status(), StatusCode::OK);
//! # Ok(())
//! # }
//! ```

mod adaptive;
mod admission;
mod critical;
mod future;
mod layer;
mod limits;
mod permit;
mod queue;
mod respond;
mod service;
mod stamp;
#[cfg(test)]
mod tests;
mod wait;

pub use crate::outcome::Completion;
pub use critical::{AllCritical, Critical};
pub use future::ResponseFuture;
pub use layer::{ConcurrencyLayer, ConcurrencyLayerBuilder};
pub use permit::{Permit, PermitBody, UpgradePermit};
pub use service::ConcurrencyService;
pub use tollgate_core::adaptive::{AdaptiveLimit, Aimd, Gradient};
