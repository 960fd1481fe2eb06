//! What a turned-away request gets.
//!
//! HTTP: `429 Too Many Requests` with `Retry-After`, the `RateLimit`
//! headers and an `application/problem+json` body (RFC 9457) naming the
//! rule; a cost that can never fit is a 429 without `Retry-After`; a
//! request with no key (when the layer is told to reject those) is a 400.
//!
//! gRPC (`content-type: application/grpc*`): a trailers-only response,
//! status `RESOURCE_EXHAUSTED` (8) with `grpc-message` and
//! `grpc-retry-pushback-ms` (negative when retrying cannot help, which
//! tells gRPC clients not to retry), or `INVALID_ARGUMENT` (3) for a
//! missing key.
//!
//! Replace the HTTP response with [`RateLimitLayerBuilder::rejection`](crate::RateLimitLayerBuilder::rejection).

use std::fmt::Write as _;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE};
use http::{HeaderMap, Request, Response, StatusCode};
use tollgate_core::Decision;

use crate::headers::retry_after_secs;

/// Why a request was turned away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Reason {
    /// The budget is spent for now; retry after the decision's
    /// `retry_after`.
    Limited,
    /// The request costs more than the rule's whole capacity: retrying
    /// cannot help.
    TooCostly,
    /// The request carried no key and the layer rejects keyless requests.
    MissingKey,
}

/// A rejected request, as the rejection builder sees it.
#[derive(Debug, Clone)]
pub struct Rejected {
    /// The rule's name.
    pub rule: std::sync::Arc<str>,
    /// Why.
    pub reason: Reason,
    /// The limiter's decision (absent for [`Reason::MissingKey`]).
    pub decision: Option<Decision>,
    /// Whether the request was gRPC.
    pub grpc: bool,
}

impl Rejected {
    /// The HTTP status the default rejection uses.
    pub fn status(&self) -> StatusCode {
        match self.reason {
            Reason::MissingKey => StatusCode::BAD_REQUEST,
            _ => StatusCode::TOO_MANY_REQUESTS,
        }
    }

    /// Seconds a client should wait (the `Retry-After` value), when waiting
    /// helps.
    pub fn retry_after_secs(&self) -> Option<u64> {
        match (self.reason, self.decision) {
            (Reason::Limited, Some(d)) => d
                .retry_after()
                .map(|r| retry_after_secs(u64::try_from(r.as_nanos()).unwrap_or(u64::MAX))),
            _ => None,
        }
    }

    fn detail(&self) -> String {
        let mut s = String::new();
        let _ = match (self.reason, self.retry_after_secs()) {
            (Reason::Limited, Some(secs)) => write!(
                s,
                "Rate limit \"{}\" exceeded; retry after {secs} s.",
                self.rule
            ),
            (Reason::TooCostly, _) | (Reason::Limited, None) => write!(
                s,
                "This request costs more than rule \"{}\" allows at once ({}); it can never succeed.",
                self.rule,
                self.decision.map_or(0, |d| d.limit)
            ),
            (Reason::MissingKey, _) => write!(
                s,
                "The request carries no client key, which rule \"{}\" requires.",
                self.rule
            ),
        };
        s
    }

    /// The default HTTP response: status, `application/problem+json` body.
    /// (The layer adds `Retry-After` and the `RateLimit` headers.)
    pub fn to_problem_response(&self) -> Response<Bytes> {
        let status = self.status();
        let mut body = String::with_capacity(200);
        let _ = write!(
            body,
            r#"{{"type":"about:blank","title":"{}","status":{},"detail":"{}","rule":"{}"}}"#,
            status.canonical_reason().unwrap_or(""),
            status.as_u16(),
            json_escape(&self.detail()),
            json_escape(&self.rule),
        );
        let mut res = Response::new(Bytes::from(body));
        *res.status_mut() = status;
        res.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        res
    }

    /// The gRPC response: trailers-only, HTTP 200.
    pub fn to_grpc_response(&self) -> Response<Bytes> {
        let mut res = Response::new(Bytes::new());
        let h = res.headers_mut();
        h.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        let code = match self.reason {
            Reason::MissingKey => "3",
            _ => "8",
        };
        h.insert("grpc-status", HeaderValue::from_static(code));
        if let Ok(v) = HeaderValue::from_str(&percent_encode(&self.detail())) {
            h.insert("grpc-message", v);
        }
        let pushback = match (self.reason, self.decision.and_then(|d| d.retry_after())) {
            (Reason::Limited, Some(r)) => {
                let ms = u64::try_from(r.as_millis()).unwrap_or(u64::MAX).max(1);
                HeaderValue::from(ms)
            }
            _ => HeaderValue::from_static("-1"),
        };
        if self.reason != Reason::MissingKey {
            h.insert("grpc-retry-pushback-ms", pushback);
        }
        res
    }
}

/// Whether a request is gRPC (its content type is `application/grpc*`).
pub fn is_grpc<B>(req: &Request<B>) -> bool {
    is_grpc_headers(req.headers())
}

pub(crate) fn is_grpc_headers(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

fn json_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out
}

/// gRPC's `grpc-message` encoding: percent-encode everything outside
/// printable ASCII, and `%` itself.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if (0x20..0x7f).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_core::Outcome;

    fn rejected(reason: Reason, outcome: Outcome) -> Rejected {
        Rejected {
            rule: "per-key".into(),
            reason,
            decision: Some(Decision {
                outcome,
                limit: 20,
                remaining: 0,
                reset_after: 2_000_000_000,
            }),
            grpc: false,
        }
    }

    #[test]
    fn problem_json_names_the_rule() {
        let r = rejected(
            Reason::Limited,
            Outcome::Deny {
                retry_after: 1_500_000_000,
            },
        );
        let res = r.to_problem_response();
        assert_eq!(res.status(), 429);
        assert_eq!(res.headers()[CONTENT_TYPE], "application/problem+json");
        let body = std::str::from_utf8(res.body()).unwrap();
        assert!(body.contains(r#""rule":"per-key""#), "{body}");
        assert!(body.contains("retry after 2 s"), "{body}");
        assert!(body.contains(r#""status":429"#));
    }

    #[test]
    fn grpc_pushback_is_negative_when_retrying_cannot_help() {
        let r = rejected(
            Reason::Limited,
            Outcome::Deny {
                retry_after: 1_500_000_000,
            },
        );
        let res = r.to_grpc_response();
        assert_eq!(res.headers()["grpc-status"], "8");
        assert_eq!(res.headers()["grpc-retry-pushback-ms"], "1500");
        let never = rejected(Reason::TooCostly, Outcome::Never).to_grpc_response();
        assert_eq!(never.headers()["grpc-retry-pushback-ms"], "-1");
        assert!(never.headers()["grpc-message"]
            .to_str()
            .unwrap()
            .contains("never succeed"));
    }

    #[test]
    fn escaping() {
        assert_eq!(json_escape("a\"b\\c\n"), "a\\\"b\\\\c\\u000a");
        assert_eq!(percent_encode("50% ñ"), "50%25 %C3%B1");
    }
}
