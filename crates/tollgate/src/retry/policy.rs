//! Which outcomes are retried, what the server says about when, and the
//! backoff between attempts.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use http::header::HeaderName;
use http::{HeaderMap, Method, StatusCode};

use super::{DeadlineExceeded, Throttled};
use crate::outcome::Completion;
use crate::BoxError;

/// Header names read on every answer, parsed once.
static GRPC_PUSHBACK: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");
static IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// How an attempt ended, as a retry classifier sees it.
#[derive(Debug)]
#[non_exhaustive]
pub enum Attempt<'a> {
    /// The upstream answered.
    Response {
        /// Its status.
        status: StatusCode,
        /// Its headers (`grpc-status` is here for a trailers-only gRPC answer).
        headers: &'a HeaderMap,
    },
    /// The call failed: a connect error, a timeout, ...
    Error(&'a BoxError),
}

impl Attempt<'_> {
    /// The default classification: errors of the inner service (connect
    /// errors, timeouts, ...), 502, 503, 504 and 429, and gRPC
    /// `UNAVAILABLE` and `RESOURCE_EXHAUSTED`, are worth a retry; anything
    /// else is an answer. Errors that say retrying cannot help are not
    /// retried: a nested retry layer's [`Throttled`] and
    /// [`DeadlineExceeded`], anywhere in the error's source chain.
    pub fn is_retryable_by_default(&self) -> bool {
        match self {
            Attempt::Error(error) => {
                let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&***error);
                while let Some(e) = source {
                    if e.is::<Throttled>() || e.is::<DeadlineExceeded>() {
                        return false;
                    }
                    source = e.source();
                }
                true
            }
            Attempt::Response { status, headers } => {
                Completion::from_parts(*status, headers).is_refusal()
            }
        }
    }
}

/// What an answer says about retrying: how long to wait at least, or
/// `None` when it says retrying cannot help — a negative (or unreadable)
/// `grpc-retry-pushback-ms` (gRFC A6), a 429 without `Retry-After` (a
/// server that wants a retry says when; tollgate's own "this request can
/// never fit" answers have none), or a `Retry-After` that is neither
/// whole seconds nor an HTTP date (negative, fractional, past `u64`,
/// garbage): a server whose hint cannot be read is not retried early.
pub(crate) fn server_hint(status: StatusCode, headers: &HeaderMap) -> Option<Duration> {
    if let Some(v) = headers.get(&GRPC_PUSHBACK) {
        let ms = std::str::from_utf8(v.as_bytes())
            .ok()
            .and_then(|s| s.trim().parse::<i64>().ok())?;
        return u64::try_from(ms).ok().map(Duration::from_millis);
    }
    match headers.get(http::header::RETRY_AFTER) {
        Some(v) => retry_after(v.as_bytes()),
        None if status == StatusCode::TOO_MANY_REQUESTS => None,
        None => Some(Duration::ZERO),
    }
}

/// A `Retry-After` value: whole seconds, or an HTTP date (the time left
/// until then; none if past); `None` for anything else.
fn retry_after(value: &[u8]) -> Option<Duration> {
    let s = std::str::from_utf8(value).ok()?.trim();
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
        return s.parse::<u64>().ok().map(Duration::from_secs);
    }
    httpdate::parse_http_date(s)
        .ok()
        .map(|at| at.duration_since(SystemTime::now()).unwrap_or_default())
}

/// Whether a request may be sent twice: idempotent by method (GET, HEAD,
/// OPTIONS, TRACE, PUT, DELETE), or carrying an `Idempotency-Key`.
pub(crate) fn is_idempotent(method: &Method, headers: &HeaderMap) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    ) || headers.contains_key(&IDEMPOTENCY_KEY)
}

/// Exponential backoff with full jitter: a random wait from zero to
/// `min(cap, base × 2^retry)`, so a crowd of clients that failed together
/// does not come back together.
#[derive(Debug)]
pub(crate) struct Backoff {
    pub(crate) base: Duration,
    pub(crate) cap: Duration,
    seed: std::collections::hash_map::RandomState,
    counter: AtomicU64,
}

impl Backoff {
    pub(crate) fn new(base: Duration, cap: Duration) -> Self {
        Self {
            base,
            cap,
            seed: std::collections::hash_map::RandomState::new(),
            counter: AtomicU64::new(0),
        }
    }

    /// A random `u64` (for jitter and throttling; not for secrets).
    pub(crate) fn random(&self) -> u64 {
        self.seed
            .hash_one(self.counter.fetch_add(1, Ordering::Relaxed))
    }

    /// The wait before retry number `retry` (0 for the first retry).
    pub(crate) fn wait(&self, retry: u32) -> Duration {
        let ceiling = self
            .base
            .saturating_mul(1u32.checked_shl(retry.min(31)).unwrap_or(u32::MAX))
            .min(self.cap);
        let random = self.random();
        // A uniform fraction of the ceiling, in nanoseconds.
        let nanos = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
        let scaled = u128::from(random).saturating_mul(u128::from(nanos)) >> 64;
        Duration::from_nanos(u64::try_from(scaled).unwrap_or(nanos))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn servers_say_when_or_that_retrying_cannot_help() {
        let s503 = StatusCode::SERVICE_UNAVAILABLE;
        assert_eq!(server_hint(s503, &headers(&[])), Some(Duration::ZERO));
        assert_eq!(
            server_hint(s503, &headers(&[("retry-after", "3")])),
            Some(Duration::from_secs(3))
        );
        let soon = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(120));
        let hint = server_hint(s503, &headers(&[("retry-after", &soon)])).unwrap();
        assert!(
            hint > Duration::from_secs(100) && hint <= Duration::from_secs(120),
            "{hint:?}"
        );
        let past = httpdate::fmt_http_date(SystemTime::now() - Duration::from_secs(120));
        assert_eq!(
            server_hint(s503, &headers(&[("retry-after", &past)])),
            Some(Duration::ZERO)
        );
        let ok = StatusCode::OK;
        assert_eq!(
            server_hint(ok, &headers(&[("grpc-retry-pushback-ms", "250")])),
            Some(Duration::from_millis(250))
        );
        assert_eq!(
            server_hint(ok, &headers(&[("grpc-retry-pushback-ms", "-1")])),
            None
        );
        assert_eq!(
            server_hint(ok, &headers(&[("grpc-retry-pushback-ms", "x")])),
            None
        );
        // A hint that cannot be read is no invitation to retry at once.
        for garbage in ["-5", "1.5", "99999999999999999999", "soon", "", "0x10"] {
            assert_eq!(
                server_hint(s503, &headers(&[("retry-after", garbage)])),
                None,
                "{garbage:?}"
            );
        }
        assert_eq!(
            server_hint(s503, &headers(&[("retry-after", " 7 ")])),
            Some(Duration::from_secs(7))
        );
        let s429 = StatusCode::TOO_MANY_REQUESTS;
        assert_eq!(server_hint(s429, &headers(&[])), None);
        assert_eq!(
            server_hint(s429, &headers(&[("retry-after", "1")])),
            Some(Duration::from_secs(1))
        );
    }

    #[test]
    fn backoff_is_jittered_under_an_exponential_cap() {
        let b = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        for retry in 0..40 {
            let ceiling = Duration::from_millis(100 << retry.min(4)).min(Duration::from_secs(1));
            let waits: Vec<_> = (0..50).map(|_| b.wait(retry)).collect();
            assert!(
                waits.iter().all(|w| *w <= ceiling),
                "retry {retry}: {waits:?}"
            );
            assert!(waits.iter().any(|w| *w != waits[0]), "no jitter");
        }
    }

    #[test]
    fn idempotency() {
        let none = HeaderMap::new();
        assert!(is_idempotent(&Method::GET, &none));
        assert!(is_idempotent(&Method::PUT, &none));
        assert!(!is_idempotent(&Method::POST, &none));
        assert!(is_idempotent(
            &Method::POST,
            &headers(&[("idempotency-key", "k1")])
        ));
    }
}
