//! Bandwidth limits: bytes per second per key, for request and response
//! bodies.
//!
//! [`BandwidthLayer`] wraps bodies in a [`PacedBody`] that lets data frames
//! out no faster than the key's byte budget — a token bucket in bytes with
//! a burst — allows. The budget lives in the rate store, so a fleet on
//! Redis shares it; the body takes tokens a chunk at a time, not per
//! frame, and waits on Tokio's timer when the budget is empty. It holds at
//! most one frame, splitting one that is larger than what the budget
//! covers. A body that ends or is dropped gives its unspent tokens back
//! at once.
//!
//! Pacing is not refusing: a download over its rate is slowed, not
//! answered 429, so this layer sends no `RateLimit` headers. A store that
//! fails stops pacing that body rather than stalling it. With the Redis
//! store, choose [`FailurePolicy::Open`] or `Fallback` for the store a
//! bandwidth layer uses: under `Closed` the store answers every chunk
//! "not now" while Redis is down, and paced bodies would wait for it.
//!
//! Pacing waits on Tokio's timer: the runtime must have time enabled (as
//! axum's and tonic's servers do).
//!
//! [`FailurePolicy::Open`]: https://docs.rs/tollgate-redis
//!
//! ```
//! use axum::{routing::get, Router};
//! use tollgate::{bandwidth::{BandwidthLayer, Direction}, key::Header};
//!
//! // Downloads at 256 KiB/s per API key, in bursts of at most 64 KiB.
//! let paced = BandwidthLayer::builder("download-rate", 256 << 10, 64 << 10)
//!     .key(Header::named("x-api-key")?)
//!     .direction(Direction::Responses)
//!     .build()?;
//! let app: Router = Router::new().route("/download", get(|| async { "..." })).layer(paced);
//! # Ok::<(), tollgate::ConfigError>(())
//! ```

mod body;
mod layer;

pub use body::PacedBody;
pub use layer::{
    BandwidthLayer, BandwidthLayerBuilder, BandwidthService, Direction, ResponseFuture,
};

#[cfg(test)]
mod tests;
