//! Calendar quotas: budgets per client key per minute, hour, day, ISO week,
//! month or year, that reset at calendar boundaries.
//!
//! [`QuotaLayer`] charges each request's cost (the same [`Cost`](crate::cost::Cost)
//! functions as the other layers) to every period of its key's quota at
//! once — 1,000 a day *and* 20,000 a month — or, when one of them has no
//! room, to none. Periods align to calendar boundaries in UTC, a fixed
//! offset ([`Offset`](tollgate_core::calendar::Offset)) or, with the `tz`
//! feature, an IANA time zone ([`Zone`](tollgate_core::calendar::Zone)),
//! where a day runs from local midnight to local midnight across daylight
//! saving time: a month is a calendar month of 28 to 31 days, a week
//! starts on Monday.
//!
//! # Why calendar periods, and why a separate layer
//!
//! A rate limit smooths traffic over seconds; a quota is a contract — "your
//! plan includes 1,000 reports a day" — that people read on an invoice and
//! support staff adjust by hand. So it resets when the calendar says, its
//! `Retry-After` may be hours or days away, it must survive restarts (the
//! Redis store keeps it until the period's end plus a margin; the
//! in-memory store keeps it per process), and it comes with
//! administration: read a key's usage, reset it, grant extra units
//! ([`QuotaLayer::limiter`] and [`QuotaLimiter`](tollgate_core::QuotaLimiter)).
//!
//! # What clients see
//!
//! Each period is one item of `RateLimit-Policy` and `RateLimit`, e.g.
//! `"daily";q=1000;w=86400` and `"daily";r=950;t=3600`, where `t` is the
//! seconds to the period's end (a month's `w` is the current month's
//! length). A quota that is used up answers 429 with `Retry-After` set to
//! the seconds until the next period starts, even if that is days away; a
//! cost above a period's whole budget is a 429 without `Retry-After`. Past
//! the soft limit ([`soft_limit`](QuotaLayerBuilder::soft_limit), e.g.
//! 80 %), responses carry `Quota-Warning` and the metric
//! `tollgate_quota_warnings_total` counts them, before the hard stop.
//!
//! ```
//! use axum::{routing::get, Router};
//! use http::{Request, StatusCode};
//! use tower::ServiceExt;
//! use tollgate::calendar::Period;
//! use tollgate::{key::Header, quota::QuotaLayer};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let quota = QuotaLayer::builder("daily")
//!     .period(Period::Day, 2)
//!     .key(Header::named("x-api-key")?)
//!     .build()?;
//! let app = Router::new().route("/report", get(|| async { "..." })).layer(quota);
//! let get = || Request::get("/report").header("x-api-key", "k1").body(String::new()).unwrap();
//!
//! let first = app.clone().oneshot(get()).await?;
//! assert_eq!(first.headers()["ratelimit"].to_str()?.split(";t=").next(), Some("\"daily\";r=1"));
//! app.clone().oneshot(get()).await?;
//! let third = app.clone().oneshot(get()).await?;
//! assert_eq!(third.status(), StatusCode::TOO_MANY_REQUESTS);
//! // Retry at midnight UTC: never 0, at most a day away.
//! let retry: u64 = third.headers()["retry-after"].to_str()?.parse()?;
//! assert!((1..=86_400).contains(&retry));
//! # Ok(())
//! # }
//! ```
//!
//! # Where it goes in a stack, and what an outage does
//!
//! Put the quota innermost, after rate and concurrency limits, so that a
//! request another limit refuses is never charged (what an inner tollgate
//! layer refuses, and what the service fails with, is refunded anyway:
//! [`refund_unserved`](QuotaLayerBuilder::refund_unserved)).
//!
//! On Redis, the store's failure policy decides what a quota does while
//! Redis is away: `Open` admits, `Closed` refuses, and `Fallback` decides
//! in each instance's memory, **from zero**: every key gets a fresh budget
//! on every instance for as long as the outage lasts, and what it spends
//! there is not added to its Redis count afterwards. For a quota that
//! bills, prefer `Closed` (or `Open`, if availability matters more than
//! the contract) over `Fallback`. The failure policy is the store's, so
//! a service whose rate limits fall back and whose quota fails closed
//! builds two Redis stores on the same URL, one per policy:
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
//! use tollgate::{FailurePolicy, RedisStore};
//!
//! let url = "redis://127.0.0.1:6379";
//! let rates = RedisStore::builder(url).prefix("my-app").failure_policy(FailurePolicy::fallback()).build()?;
//! let quotas = RedisStore::builder(url).prefix("my-app").failure_policy(FailurePolicy::Closed).build()?;
//! # let _ = (rates, quotas);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # })
//! # }
//! ```

mod layer;
mod service;
#[cfg(test)]
mod tests;

pub use layer::{QuotaLayer, QuotaLayerBuilder};
pub use service::{QuotaService, ResponseFuture};
