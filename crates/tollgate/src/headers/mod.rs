//! The standard rate-limit headers.
//!
//! - `RateLimit-Policy: "per-key";q=20;w=2` and `RateLimit: "per-key";r=17;t=1`
//!   (IETF httpapi RateLimit draft, structured-field syntax): the rule's
//!   capacity `q` over `w` seconds; `r` units remaining and `t` seconds
//!   until the budget is whole (on a denial: until the request may be
//!   retried).
//! - `Retry-After` on a denial: whole seconds, rounded up, never 0, equal to
//!   `t`, so a client honouring either header waits long enough.
//! - Optionally the legacy `X-RateLimit-Limit`, `X-RateLimit-Remaining`,
//!   `X-RateLimit-Reset` (seconds).
//!
//! By role: `render` writes values, `merge` joins ours with an inner
//! limiter's fields (or, inside a composed layer, holds them back to be
//! joined once as the response leaves), `cache` remembers rendered values
//! per thread; one module per kind of header set (`rate`, `concurrency`,
//! `quota`).

use tollgate_core::{Decision, Outcome};

mod cache;
mod concurrency;
mod merge;
mod quota;
mod rate;
mod render;
#[cfg(test)]
mod tests;

pub(crate) use concurrency::{ConcurrencyHeaders, Item};
pub(crate) use merge::add_items;
#[cfg(all(feature = "axum", feature = "config"))]
pub(crate) use merge::{AtOnce, Deferred};
pub(crate) use quota::QuotaHeaders;
pub(crate) use rate::{apply_set, set_policy, Headers};
pub(crate) use render::{push_warning, Buf};

/// Our field names. Each is made where a map takes it, from a constant:
/// a clone of a static custom name calls through its bytes' vtable and
/// copies the result twice, each copy stalled on stores just made (perf
/// over `concurrency_overhead`: ~33 ns a response with two fields).
pub(crate) mod field {
    use http::header::HeaderName;

    macro_rules! names {
        ($($(#[$doc:meta])* $f:ident = $s:literal;)*) => {$(
            $(#[$doc])*
            #[inline]
            pub(crate) fn $f() -> HeaderName {
                const { HeaderName::from_static($s) }
            }
        )*};
    }

    names! {
        ratelimit = "ratelimit";
        ratelimit_policy = "ratelimit-policy";
        x_ratelimit_limit = "x-ratelimit-limit";
        x_ratelimit_remaining = "x-ratelimit-remaining";
        x_ratelimit_reset = "x-ratelimit-reset";
        /// Past a quota's soft limit: `Quota-Warning: "daily";used=85`,
        /// one item (the percentage used) per period past it.
        quota_warning = "quota-warning";
        /// Past a policy rule's warning share:
        /// `RateLimit-Warning: "per-key";used=85`, one item (the
        /// percentage used) per rule past it.
        ratelimit_warning = "ratelimit-warning";
    }
}

/// Whether `used` of `limit` is at least `share` of it: a warning is due.
/// In integers, the share in millionths: `0.56 × 100` is 56.00000000000001
/// in floats, and 56 used would not warn.
pub(crate) fn is_past(used: u64, limit: u64, share: f64) -> bool {
    // The share (validated: above 0, at most 1) in parts per million.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let ppm = (share * 1_000_000.0).round().clamp(0.0, 1_000_000.0) as u128;
    limit > 0 && u128::from(used).saturating_mul(1_000_000) >= ppm.saturating_mul(u128::from(limit))
}

const NANOS_PER_SEC: u64 = 1_000_000_000;

/// Whole seconds, rounded up.
pub(crate) fn ceil_secs(nanos: u64) -> u64 {
    nanos.div_ceil(NANOS_PER_SEC)
}

/// `Retry-After` seconds for a denial: rounded up, at least 1.
pub fn retry_after_secs(retry_after_nanos: u64) -> u64 {
    ceil_secs(retry_after_nanos).max(1)
}

/// The `t` a decision reports: seconds until the budget is whole, or until
/// a denied request may be retried.
pub(crate) fn t_secs(d: &Decision) -> u64 {
    match d.outcome {
        Outcome::Deny { retry_after } => retry_after_secs(retry_after),
        _ => ceil_secs(d.reset_after),
    }
}
