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

use std::fmt::{self, Write as _};

use http::header::{HeaderName, HeaderValue, RETRY_AFTER};
use http::HeaderMap;
use tollgate_core::{Decision, Outcome, Rule};

pub(crate) static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
pub(crate) static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
pub(crate) static X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
pub(crate) static X_RATELIMIT_REMAINING: HeaderName =
    HeaderName::from_static("x-ratelimit-remaining");
pub(crate) static X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

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

/// A small stack buffer for formatting header values.
struct Buf {
    bytes: [u8; 96],
    len: usize,
}

impl Buf {
    fn new() -> Self {
        Self {
            bytes: [0; 96],
            len: 0,
        }
    }

    fn value(&self) -> Option<HeaderValue> {
        HeaderValue::from_bytes(self.bytes.get(..self.len)?).ok()
    }
}

impl fmt::Write for Buf {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let end = self.len.checked_add(s.len()).ok_or(fmt::Error)?;
        self.bytes
            .get_mut(self.len..end)
            .ok_or(fmt::Error)?
            .copy_from_slice(s.as_bytes());
        self.len = end;
        Ok(())
    }
}

fn number(n: u64) -> Option<HeaderValue> {
    let mut b = Buf::new();
    write!(b, "{n}").ok()?;
    b.value()
}

/// Which headers to send, precomputed per layer.
#[derive(Debug, Clone)]
pub(crate) struct Headers {
    name: Box<str>,
    policy: Option<HeaderValue>,
    limit: Option<HeaderValue>,
    pub(crate) standard: bool,
    pub(crate) legacy: bool,
}

impl Headers {
    pub(crate) fn new(rule: &Rule, standard: bool, legacy: bool) -> Self {
        let w = ceil_secs(rule.window()).max(1);
        let mut policy = Buf::new();
        let policy = write!(policy, "\"{}\";q={};w={w}", rule.name(), rule.capacity())
            .ok()
            .and_then(|()| policy.value());
        Self {
            name: rule.name().into(),
            policy,
            limit: number(rule.capacity()),
            standard,
            legacy,
        }
    }

    /// Adds the headers for `d` (and `Retry-After` if it is a denial).
    pub(crate) fn apply(&self, headers: &mut HeaderMap, d: &Decision) {
        let t = t_secs(d);
        if let Outcome::Deny { retry_after } = d.outcome {
            if let Some(v) = number(retry_after_secs(retry_after)) {
                headers.insert(RETRY_AFTER, v);
            }
        }
        if self.standard {
            if let Some(p) = &self.policy {
                headers.insert(RATELIMIT_POLICY.clone(), p.clone());
            }
            let mut b = Buf::new();
            if write!(b, "\"{}\";r={};t={t}", self.name, d.remaining).is_ok() {
                if let Some(v) = b.value() {
                    headers.insert(RATELIMIT.clone(), v);
                }
            }
        }
        if self.legacy {
            if let Some(l) = &self.limit {
                headers.insert(X_RATELIMIT_LIMIT.clone(), l.clone());
            }
            if let Some(v) = number(d.remaining) {
                headers.insert(X_RATELIMIT_REMAINING.clone(), v);
            }
            if let Some(v) = number(t) {
                headers.insert(X_RATELIMIT_RESET.clone(), v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tollgate_core::{Limit, Rate};

    fn decision(outcome: Outcome, remaining: u64, reset: u64) -> Decision {
        Decision {
            outcome,
            limit: 20,
            remaining,
            reset_after: reset,
        }
    }

    #[test]
    fn structured_fields_and_retry_after() {
        let rule = Rule::new("per-key", Limit::gcra(Rate::per_second(10), 20)).unwrap();
        let h = Headers::new(&rule, true, true);
        let mut m = HeaderMap::new();
        h.apply(
            &mut m,
            &decision(
                Outcome::Deny {
                    retry_after: 100_000_000,
                },
                0,
                2_000_000_000,
            ),
        );
        assert_eq!(m["ratelimit-policy"], "\"per-key\";q=20;w=2");
        assert_eq!(m["ratelimit"], "\"per-key\";r=0;t=1");
        assert_eq!(m["retry-after"], "1");
        assert_eq!(m["x-ratelimit-limit"], "20");
        assert_eq!(m["x-ratelimit-remaining"], "0");
        assert_eq!(m["x-ratelimit-reset"], "1");

        let mut m = HeaderMap::new();
        h.apply(
            &mut m,
            &decision(Outcome::Allow { delay: 0 }, 17, 300_000_000),
        );
        assert_eq!(m["ratelimit"], "\"per-key\";r=17;t=1");
        assert!(m.get("retry-after").is_none());
    }

    #[test]
    fn retry_after_rounds_up_and_is_never_zero() {
        assert_eq!(retry_after_secs(0), 1);
        assert_eq!(retry_after_secs(1), 1);
        assert_eq!(retry_after_secs(1_000_000_000), 1);
        assert_eq!(retry_after_secs(1_000_000_001), 2);
        assert_eq!(retry_after_secs(u64::MAX), 18_446_744_074);
    }

    #[test]
    fn policy_window_is_whole_seconds() {
        let rule = Rule::new("w", Limit::fixed_window(5, Duration::from_millis(1_500))).unwrap();
        let h = Headers::new(&rule, true, false);
        let mut m = HeaderMap::new();
        h.apply(&mut m, &decision(Outcome::Allow { delay: 0 }, 4, 0));
        assert_eq!(m["ratelimit-policy"], "\"w\";q=5;w=2");
        assert!(m.get("x-ratelimit-limit").is_none());
    }
}
