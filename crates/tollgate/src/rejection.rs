//! What a turned-away request gets.
//!
//! HTTP: `429 Too Many Requests` with `Retry-After`, the `RateLimit`
//! headers and an `application/problem+json` body (RFC 9457) naming the
//! rule; a cost that can never fit is a 429 without `Retry-After`; a
//! request with no key (when the layer is told to reject those) is a 400;
//! a write turned away while the service is read-only (the concurrency
//! layer's degraded mode) is a 503 with `Retry-After`.
//!
//! gRPC (`content-type: application/grpc*`): a trailers-only response,
//! status `RESOURCE_EXHAUSTED` (8) with `grpc-message` and
//! `grpc-retry-pushback-ms` (negative when retrying cannot help, which
//! tells gRPC clients not to retry), `INVALID_ARGUMENT` (3) for a missing
//! key, or `UNAVAILABLE` (14) when read-only.
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
    /// The service is degraded (its error rate is high) and only safe
    /// methods (GET, HEAD, OPTIONS) go through; retry after the decision's
    /// `retry_after`.
    ReadOnly,
    /// A deny list holds the request's key or network, or the route is
    /// deny-by-default and no allow list holds it: HTTP 403, gRPC
    /// `PERMISSION_DENIED`. Retrying cannot help.
    Denied,
    /// Blocked by an escalation ladder after repeated violations; retry
    /// after the decision's `retry_after` (the block's end).
    Blocked,
    /// The request's permit outlived the concurrency limit's
    /// `max_lifetime` before its handler answered: HTTP 503, gRPC
    /// `UNAVAILABLE` (a client reconnects at once).
    Expired,
}

/// What a layer does with a request when its store answers with an error
/// instead of a decision. A store with a failure policy of its own (the
/// Redis store's `FailurePolicy`: open, closed, or in-memory fallback)
/// answers its faults with decisions and rarely reaches this; an error
/// gets here when a store has no such policy (a store of your own), or
/// when its policy could not answer either (its task was lost). The same
/// option on every layer that decides through a store: rate, policy,
/// quota and concurrency.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnStoreError {
    /// Let the request through, unlimited by this layer, counted in the
    /// layer's `store_error` outcome and logged (availability first: a
    /// limiter's outage never takes the service down). The default.
    #[default]
    Admit,
    /// Refuse it as a store that fails closed does: 429 (gRPC
    /// `RESOURCE_EXHAUSTED`) with `Retry-After: 1`, counted and logged
    /// (protection first: for limits that guard something that must not
    /// be overrun, such as a costly upstream or a billing quota).
    Refuse,
}

impl OnStoreError {
    /// What the layer decides for a store error: `None` to admit, else a
    /// fail-closed denial under a rule of `capacity`.
    pub(crate) fn answer(self, capacity: u64) -> Option<tollgate_core::Decision> {
        match self {
            Self::Admit => None,
            Self::Refuse => Some(tollgate_core::Decision::closed(capacity)),
        }
    }
}

/// What kind of limit turned a request away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LimitKind {
    /// A rate limit: units per window.
    Rate,
    /// A concurrency limit: requests in flight.
    Concurrency,
    /// A calendar quota: units per day, month, ...
    Quota,
    /// A bandwidth limit: bytes per second (it paces, and refuses only a
    /// request it cannot key).
    Bandwidth,
}

/// The response extension every tollgate layer puts on the refusals it
/// answers (its own, or the custom ones a `rejection` closure builds), so
/// that an outer layer can tell them from the service's answers: a quota
/// gives back what a request an inner limit refused was charged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Refusal;

/// Marks `res` as a tollgate refusal ([`Refusal`]).
pub(crate) fn mark<B>(mut res: Response<B>) -> Response<B> {
    res.extensions_mut().insert(Refusal);
    res
}

/// A rejected request, as the rejection builder sees it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Rejected {
    /// The rule's name.
    pub rule: std::sync::Arc<str>,
    /// What kind of limit the rule is.
    pub kind: LimitKind,
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
            Reason::ReadOnly | Reason::Expired => StatusCode::SERVICE_UNAVAILABLE,
            Reason::Denied => StatusCode::FORBIDDEN,
            _ => StatusCode::TOO_MANY_REQUESTS,
        }
    }

    /// Seconds a client should wait (the `Retry-After` value), when waiting
    /// helps.
    pub fn retry_after_secs(&self) -> Option<u64> {
        match (self.reason, self.decision) {
            (Reason::Limited | Reason::ReadOnly | Reason::Blocked, Some(d)) => d
                .retry_after()
                .map(|r| retry_after_secs(u64::try_from(r.as_nanos()).unwrap_or(u64::MAX))),
            _ => None,
        }
    }

    /// The default HTTP response: status, `application/problem+json` body,
    /// and nothing else. A layer in response mode adds `Retry-After` and
    /// the `RateLimit` fields to it (and to a custom rejection); in the rate
    /// layer's error mode, [`RateLimited`](crate::RateLimited) carries the
    /// whole response, headers included.
    pub fn to_problem_response(&self) -> Response<Bytes> {
        let secs = self.retry_after_secs().map(|s| s.to_string());
        let limit = self.decision.map_or(0, |d| d.limit);
        let body = problem_json(
            self.status(),
            &detail(self.kind, self.reason, &self.rule, secs.as_deref(), limit),
            &self.rule,
        );
        problem_response(self.status(), Bytes::from(body))
    }

    /// The gRPC response: trailers-only, HTTP 200.
    pub fn to_grpc_response(&self) -> Response<Bytes> {
        let limit = self.decision.map_or(0, |d| d.limit);
        let message = grpc_message(self.kind, self.reason, &self.rule, limit);
        let pushback = match (self.reason, self.decision.and_then(|d| d.retry_after())) {
            (Reason::Limited | Reason::ReadOnly | Reason::Blocked, Some(r)) => Some(pushback_ms(r)),
            _ => None,
        };
        grpc_response(self.reason, message, pushback)
    }
}

/// Milliseconds a gRPC client should wait: rounded up, at least 1.
fn pushback_ms(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_nanos().div_ceil(1_000_000))
        .unwrap_or(u64::MAX)
        .max(1)
}

/// The human-readable explanation. `secs` is the retry delay as text.
fn detail(kind: LimitKind, reason: Reason, rule: &str, secs: Option<&str>, limit: u64) -> String {
    match (reason, secs) {
        (Reason::Limited, Some(secs)) => match kind {
            LimitKind::Concurrency => format!(
                "Concurrency limit \"{rule}\" reached: too many requests in flight; retry after {secs} s."
            ),
            LimitKind::Rate => format!("Rate limit \"{rule}\" exceeded; retry after {secs} s."),
            LimitKind::Quota => format!(
                "Quota \"{rule}\" is used up for this period; it renews in {secs} s."
            ),
            LimitKind::Bandwidth => {
                format!("Bandwidth limit \"{rule}\" exceeded; retry after {secs} s.")
            }
        },
        (Reason::ReadOnly, secs) => format!(
            "The service is degraded and accepts only GET, HEAD and OPTIONS for now (rule \"{rule}\"); retry after {} s.",
            secs.unwrap_or("1")
        ),
        (Reason::TooCostly, _) | (Reason::Limited, None) => format!(
            "This request costs more than rule \"{rule}\" allows at once ({limit}); it can never succeed."
        ),
        (Reason::MissingKey, _) => {
            format!("The request carries no client key, which rule \"{rule}\" requires.")
        }
        (Reason::Denied, _) => format!("Access is denied by the list \"{rule}\"."),
        (Reason::Blocked, secs) => format!(
            "Blocked by \"{rule}\" after repeated violations; retry after {} s.",
            secs.unwrap_or("1")
        ),
        (Reason::Expired, _) => {
            format!("The request outlived the longest a request may last under \"{rule}\".")
        }
    }
}

fn problem_json(status: StatusCode, detail: &str, rule: &str) -> String {
    format!(
        r#"{{"type":"about:blank","title":"{}","status":{},"detail":"{}","rule":"{}"}}"#,
        status.canonical_reason().unwrap_or(""),
        status.as_u16(),
        json_escape(detail),
        json_escape(rule),
    )
}

/// A problem document (RFC 9457) that no rule answers for — a request the
/// limiter cannot read, such as a gateway's subrequest without the
/// original URI: `status`, `application/problem+json`, `detail`.
pub fn problem(status: StatusCode, detail: &str) -> Response<Bytes> {
    let body = format!(
        r#"{{"type":"about:blank","title":"{}","status":{},"detail":"{}"}}"#,
        status.canonical_reason().unwrap_or(""),
        status.as_u16(),
        json_escape(detail),
    );
    problem_response(status, Bytes::from(body))
}

fn problem_response(status: StatusCode, body: Bytes) -> Response<Bytes> {
    let mut res = Response::new(body);
    *res.status_mut() = status;
    res.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    res
}

fn grpc_message(kind: LimitKind, reason: Reason, rule: &str, limit: u64) -> HeaderValue {
    let text = match (kind, reason) {
        (LimitKind::Rate, Reason::Limited) => format!("Rate limit \"{rule}\" exceeded."),
        (LimitKind::Quota, Reason::Limited) => format!("Quota \"{rule}\" used up."),
        (LimitKind::Concurrency, Reason::Limited) => {
            format!("Concurrency limit \"{rule}\" reached.")
        }
        (_, Reason::ReadOnly) => format!("Service degraded (rule \"{rule}\"): read-only."),
        _ => detail(kind, reason, rule, None, limit),
    };
    HeaderValue::from_str(&percent_encode(&text))
        .unwrap_or_else(|_| HeaderValue::from_static("rate limited"))
}

fn grpc_response(
    reason: Reason,
    message: HeaderValue,
    pushback_ms: Option<u64>,
) -> Response<Bytes> {
    let mut res = Response::new(Bytes::new());
    let h = res.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    let code = match reason {
        Reason::MissingKey => "3",
        Reason::ReadOnly | Reason::Expired => "14",
        Reason::Denied => "7",
        _ => "8",
    };
    h.insert("grpc-status", HeaderValue::from_static(code));
    h.insert("grpc-message", message);
    // (An expired request is retried at once: no pushback.)
    if !matches!(
        reason,
        Reason::MissingKey | Reason::Denied | Reason::Expired
    ) {
        // A negative pushback tells gRPC clients not to retry at all.
        let pushback = pushback_ms.map_or(HeaderValue::from_static("-1"), HeaderValue::from);
        h.insert("grpc-retry-pushback-ms", pushback);
    }
    res
}

/// The default rejections of one rule, rendered once when the layer is
/// built so that a 429 costs a number's formatting and one allocation.
#[derive(Debug)]
pub(crate) struct Rendered {
    kind: LimitKind,
    limited: (Box<[u8]>, Box<[u8]>),
    missing_key: Bytes,
    grpc: [HeaderValue; 2],
}

const MARK: &str = "\u{1}";

impl Rendered {
    pub(crate) fn new(kind: LimitKind, rule: &str) -> Self {
        // (Neither detail names a limit.)
        let limited = problem_json(
            StatusCode::TOO_MANY_REQUESTS,
            &detail(kind, Reason::Limited, rule, Some(MARK), 0),
            rule,
        );
        // `MARK` survives JSON escaping as `\u0001`: split around it.
        let marker = "\\u0001";
        let (before, after) = limited.split_once(marker).unwrap_or((&limited, ""));
        let missing_key = problem_json(
            StatusCode::BAD_REQUEST,
            &detail(kind, Reason::MissingKey, rule, None, 0),
            rule,
        );
        Self {
            kind,
            limited: (before.as_bytes().into(), after.as_bytes().into()),
            missing_key: Bytes::from(missing_key),
            grpc: [
                grpc_message(kind, Reason::Limited, rule, 0),
                grpc_message(kind, Reason::MissingKey, rule, 0),
            ],
        }
    }

    /// Exactly what [`Rejected::to_problem_response`] or
    /// [`Rejected::to_grpc_response`] would return.
    pub(crate) fn render(&self, r: &Rejected) -> Response<Bytes> {
        // Rare (a degraded service, a request no budget can ever hold — its
        // decision names the budget it exceeds — or another layer's
        // rejection): built on the spot.
        if matches!(
            r.reason,
            Reason::ReadOnly
                | Reason::Denied
                | Reason::Blocked
                | Reason::TooCostly
                | Reason::Expired
        ) || r.kind != self.kind
        {
            return if r.grpc {
                r.to_grpc_response()
            } else {
                r.to_problem_response()
            };
        }
        if r.grpc {
            let i = match r.reason {
                // (The others are built on the spot, above.)
                Reason::MissingKey => 1,
                _ => 0,
            };
            let pushback = match (r.reason, r.decision.and_then(|d| d.retry_after())) {
                (Reason::Limited, Some(d)) => Some(pushback_ms(d)),
                _ => None,
            };
            let message = self
                .grpc
                .get(i)
                .cloned()
                .unwrap_or_else(|| HeaderValue::from_static(""));
            return grpc_response(r.reason, message, pushback);
        }
        let body = match (r.reason, r.retry_after_secs()) {
            (Reason::Limited, Some(secs)) => {
                let mut digits = crate::headers::Buf::new();
                digits.push_u64(secs);
                let (before, after) = &self.limited;
                let mut v =
                    Vec::with_capacity(before.len().saturating_add(after.len()).saturating_add(20));
                v.extend_from_slice(before);
                v.extend_from_slice(digits.as_bytes());
                v.extend_from_slice(after);
                Bytes::from(v)
            }
            (Reason::MissingKey, _) => self.missing_key.clone(),
            // Limited without a wait: can never succeed, as TooCostly.
            _ => return r.to_problem_response(),
        };
        problem_response(r.status(), body)
    }
}

/// Whether `req` asks for a protocol upgrade (a WebSocket, an HTTP/2
/// extended CONNECT).
pub(crate) fn is_upgrade<B>(req: &Request<B>) -> bool {
    req.headers().contains_key(http::header::UPGRADE) || req.method() == http::Method::CONNECT
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
            kind: LimitKind::Rate,
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
