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
pub(crate) struct Buf {
    bytes: [u8; 160],
    len: usize,
}

impl Buf {
    pub(crate) fn new() -> Self {
        Self {
            bytes: [0; 160],
            len: 0,
        }
    }

    pub(crate) fn push(&mut self, s: &[u8]) {
        let end = self.len.saturating_add(s.len());
        if let Some(dst) = self.bytes.get_mut(self.len..end) {
            dst.copy_from_slice(s);
            self.len = end;
        }
    }

    /// Appends `n` in decimal, without the formatting machinery.
    pub(crate) fn push_u64(&mut self, mut n: u64) {
        let mut digits = [0u8; 20];
        let mut i = digits.len();
        loop {
            i = i.saturating_sub(1);
            if let Some(d) = digits.get_mut(i) {
                *d = b'0'.saturating_add((n % 10) as u8);
            }
            n /= 10;
            if n == 0 {
                break;
            }
        }
        self.push(digits.get(i..).unwrap_or_default());
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        self.bytes.get(..self.len).unwrap_or_default()
    }

    pub(crate) fn value(&self) -> Option<HeaderValue> {
        HeaderValue::from_bytes(self.as_bytes()).ok()
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

/// Header values for the numbers most responses carry (`Retry-After`,
/// the legacy headers), built once per process: sending one is a copy of a
/// static reference, not an allocation.
const SMALL_NUMBERS: u64 = 1_024;

fn number(n: u64) -> Option<HeaderValue> {
    static TABLE: std::sync::OnceLock<Box<[HeaderValue]>> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        (0..SMALL_NUMBERS)
            .map(|i| HeaderValue::from_static(Box::leak(i.to_string().into_boxed_str())))
            .collect()
    });
    if let Some(v) = usize::try_from(n).ok().and_then(|i| table.get(i)) {
        return Some(v.clone());
    }
    let mut b = Buf::new();
    b.push_u64(n);
    b.value()
}

/// Which headers to send, precomputed per layer.
#[derive(Debug, Clone)]
pub(crate) struct Headers {
    /// `"name";r=`, the start of every `RateLimit` value.
    prefix: Box<[u8]>,
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
            prefix: format!("\"{}\";r=", rule.name()).into_bytes().into(),
            policy,
            limit: number(rule.capacity()),
            standard,
            legacy,
        }
    }

    /// Adds the headers for `d`, and `Retry-After` when `rejected` and the
    /// decision is a denial for now (never on a response the inner service
    /// produced, e.g. in shadow mode).
    pub(crate) fn apply(&self, headers: &mut HeaderMap, d: &Decision, rejected: bool) {
        let t = t_secs(d);
        if let (true, Outcome::Deny { retry_after }) = (rejected, d.outcome) {
            if let Some(v) = number(retry_after_secs(retry_after)) {
                headers.insert(RETRY_AFTER, v);
            }
        }
        if self.standard {
            if let Some(p) = &self.policy {
                headers.insert(RATELIMIT_POLICY.clone(), p.clone());
            }
            let mut b = Buf::new();
            b.push(&self.prefix);
            b.push_u64(d.remaining);
            b.push(b";t=");
            b.push_u64(t);
            if let Some(v) = b.value() {
                headers.insert(RATELIMIT.clone(), v);
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
            true,
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
            false,
        );
        assert_eq!(m["ratelimit"], "\"per-key\";r=17;t=1");
        assert!(m.get("retry-after").is_none());

        // A denial let through (shadow mode) reports but does not tell the
        // client to retry later.
        let mut m = HeaderMap::new();
        h.apply(
            &mut m,
            &decision(Outcome::Deny { retry_after: 1 }, 0, 1),
            false,
        );
        assert_eq!(m["ratelimit"], "\"per-key\";r=0;t=1");
        assert!(m.get("retry-after").is_none());
    }

    #[test]
    fn numbers_format_like_display() {
        for n in [0, 1, 9, 10, 99, 100, 1_023, 1_024, 12_345, u64::MAX] {
            let mut b = Buf::new();
            b.push_u64(n);
            assert_eq!(b.as_bytes(), n.to_string().as_bytes());
            assert_eq!(number(n).unwrap(), n.to_string().as_str());
        }
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
        h.apply(&mut m, &decision(Outcome::Allow { delay: 0 }, 4, 0), false);
        assert_eq!(m["ratelimit-policy"], "\"w\";q=5;w=2");
        assert!(m.get("x-ratelimit-limit").is_none());
    }
}
