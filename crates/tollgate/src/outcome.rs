//! How a response ended: one classification that every layer reading
//! outcomes shares — the adaptive limit and read-only mode of the
//! [`ConcurrencyLayer`](crate::ConcurrencyLayer), response-aware rules
//! ([`RateRule::count_if`](crate::policy::RateRule::count_if)), and the
//! retry budget's classifier and throttle.
//!
//! A gRPC failure is an HTTP `200` whose `grpc-status` says otherwise: in
//! the headers of a *trailers-only* answer (what tonic sends for a unary
//! call that returns a `Status`), or in the trailers after a streamed
//! body. Reading only the HTTP status, every layer would see a failing
//! gRPC backend as healthy. [`Completion`] reads both, and
//! [`Completion::status`] maps a gRPC code to the HTTP status that
//! `google.rpc.Code` names for it (`UNAVAILABLE` is 503, `UNAUTHENTICATED`
//! 401, ...), so one classifier — `|s| s == 401` for failed logins — serves
//! HTTP and gRPC alike.
//!
//! ```
//! use http::{Response, StatusCode};
//! use tollgate::outcome::{Completion, GrpcCode};
//!
//! let failed = Response::builder()
//!     .header("content-type", "application/grpc")
//!     .header("grpc-status", "14")
//!     .body(())
//!     .unwrap();
//! let c = Completion::of(&failed);
//! assert_eq!(c, Completion::Grpc(GrpcCode::UNAVAILABLE));
//! assert_eq!(c.status(), Some(StatusCode::SERVICE_UNAVAILABLE));
//! assert!(c.is_overload());
//! ```

use http::header::{HeaderName, CONTENT_TYPE};
use http::{HeaderMap, Response, StatusCode};

static GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");

/// A gRPC status code, as `grpc-status` carries it (0 to 16; other values
/// are kept as they came, and read as `UNKNOWN` by the mappings).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GrpcCode(pub u16);

impl GrpcCode {
    /// `OK` (0).
    pub const OK: Self = Self(0);
    /// `CANCELLED` (1).
    pub const CANCELLED: Self = Self(1);
    /// `UNKNOWN` (2).
    pub const UNKNOWN: Self = Self(2);
    /// `INVALID_ARGUMENT` (3).
    pub const INVALID_ARGUMENT: Self = Self(3);
    /// `DEADLINE_EXCEEDED` (4).
    pub const DEADLINE_EXCEEDED: Self = Self(4);
    /// `NOT_FOUND` (5).
    pub const NOT_FOUND: Self = Self(5);
    /// `ALREADY_EXISTS` (6).
    pub const ALREADY_EXISTS: Self = Self(6);
    /// `PERMISSION_DENIED` (7).
    pub const PERMISSION_DENIED: Self = Self(7);
    /// `RESOURCE_EXHAUSTED` (8).
    pub const RESOURCE_EXHAUSTED: Self = Self(8);
    /// `FAILED_PRECONDITION` (9).
    pub const FAILED_PRECONDITION: Self = Self(9);
    /// `ABORTED` (10).
    pub const ABORTED: Self = Self(10);
    /// `OUT_OF_RANGE` (11).
    pub const OUT_OF_RANGE: Self = Self(11);
    /// `UNIMPLEMENTED` (12).
    pub const UNIMPLEMENTED: Self = Self(12);
    /// `INTERNAL` (13).
    pub const INTERNAL: Self = Self(13);
    /// `UNAVAILABLE` (14).
    pub const UNAVAILABLE: Self = Self(14);
    /// `DATA_LOSS` (15).
    pub const DATA_LOSS: Self = Self(15);
    /// `UNAUTHENTICATED` (16).
    pub const UNAUTHENTICATED: Self = Self(16);

    /// Reads a `grpc-status` value: ASCII digits, surrounding whitespace
    /// allowed; anything else (or a value past `u16`) is `UNKNOWN`.
    pub fn parse(value: &[u8]) -> Self {
        let digits = value.trim_ascii();
        if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
            return Self::UNKNOWN;
        }
        std::str::from_utf8(digits)
            .ok()
            .and_then(|s| s.parse().ok())
            .map_or(Self::UNKNOWN, Self)
    }

    /// The HTTP status `google.rpc.Code` maps this code to (`OK` 200,
    /// `UNAVAILABLE` 503, `UNAUTHENTICATED` 401, ...; `CANCELLED` 499, an
    /// unknown code 500).
    pub fn http_status(self) -> StatusCode {
        let code = match self.0 {
            0 => 200,
            1 => 499,
            3 | 9 | 11 => 400,
            4 => 504,
            5 => 404,
            6 | 10 => 409,
            7 => 403,
            8 => 429,
            12 => 501,
            14 => 503,
            16 => 401,
            _ => 500,
        };
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }
}

/// How a request ended, as every outcome classifier sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Completion {
    /// An HTTP answer with this status (for gRPC: one whose `grpc-status`
    /// is not known yet, or a non-200 answer).
    Response(StatusCode),
    /// A gRPC answer with this `grpc-status` (trailers-only, or read from
    /// the trailers at the body's end).
    Grpc(GrpcCode),
    /// The inner service failed (e.g. a timeout layer inside gave up, a
    /// connection was refused).
    Error,
}

impl Completion {
    /// The completion a response's head tells: its status, or — for an
    /// HTTP 200 that carries `grpc-status` (a trailers-only gRPC answer) —
    /// that gRPC code.
    pub fn of<B>(response: &Response<B>) -> Self {
        Self::from_parts(response.status(), response.headers())
    }

    /// [`Completion::of`] from a status and headers.
    pub fn from_parts(status: StatusCode, headers: &HeaderMap) -> Self {
        match headers.get(&GRPC_STATUS) {
            Some(v) if status == StatusCode::OK => Self::Grpc(GrpcCode::parse(v.as_bytes())),
            _ => Self::Response(status),
        }
    }

    /// Whether the outcome is only known at the body's end: a gRPC answer
    /// (HTTP 200, `application/grpc`, `application/grpc+proto`, ...) whose
    /// head carries no `grpc-status` — its status comes in the trailers.
    /// (gRPC-Web carries its trailers inside the body, where a layer does
    /// not look: its answers are classified by their head.)
    pub fn awaits_trailers(&self, headers: &HeaderMap) -> bool {
        *self == Self::Response(StatusCode::OK)
            && headers.get(CONTENT_TYPE).is_some_and(|v| {
                let v = v.as_bytes();
                v.strip_prefix(b"application/grpc")
                    .is_some_and(|rest| rest.first().is_none_or(|c| matches!(c, b'+' | b';')))
            })
    }

    /// The completion of a gRPC answer whose body ended with `trailers`
    /// (or without any: `None`). A stream that ends without a
    /// `grpc-status` is broken: `UNKNOWN`, as gRPC clients read it.
    pub fn from_trailers(trailers: Option<&HeaderMap>) -> Self {
        match trailers.and_then(|t| t.get(&GRPC_STATUS)) {
            Some(v) => Self::Grpc(GrpcCode::parse(v.as_bytes())),
            None => Self::Grpc(GrpcCode::UNKNOWN),
        }
    }

    /// The HTTP status this completion stands for: the status itself, or
    /// the gRPC code's mapping ([`GrpcCode::http_status`]); `None` for an
    /// error.
    pub fn status(&self) -> Option<StatusCode> {
        match self {
            Self::Response(s) => Some(*s),
            Self::Grpc(c) => Some(c.http_status()),
            Self::Error => None,
        }
    }

    /// The gRPC code, if this is a gRPC answer.
    pub fn grpc(&self) -> Option<GrpcCode> {
        match self {
            Self::Grpc(c) => Some(*c),
            _ => None,
        }
    }

    /// A sign of overload (the default drop of adaptive limits, and an
    /// error for read-only mode): an error, a 5xx other than 501, a 408
    /// (what tower-http's `TimeoutLayer` answers), and gRPC
    /// `DEADLINE_EXCEEDED`, `INTERNAL`, `UNAVAILABLE` (and `UNKNOWN`,
    /// `DATA_LOSS`, which map to 500).
    ///
    /// Not overload: a 429 or gRPC `RESOURCE_EXHAUSTED` — what a rate
    /// limiter or quota answers a client over its own budget (tollgate's
    /// own layers among them), so counting it would let any client drive
    /// the whole service's limit down by exceeding its own; and a 501 or
    /// `UNIMPLEMENTED`, which any client gets by calling a method that
    /// does not exist. An overloaded backend says `UNAVAILABLE` (503).
    pub fn is_overload(&self) -> bool {
        match self {
            Self::Error => true,
            _ => self.status().is_some_and(|s| {
                (s.is_server_error() && s != StatusCode::NOT_IMPLEMENTED)
                    || s == StatusCode::REQUEST_TIMEOUT
            }),
        }
    }

    /// An upstream that refused to serve: 429, 502, 503, 504, and gRPC
    /// `RESOURCE_EXHAUSTED` and `UNAVAILABLE` — what a retry may help
    /// with, and what client-side throttling counts as not accepted.
    pub fn is_refusal(&self) -> bool {
        match self {
            Self::Error => true,
            Self::Grpc(c) => matches!(*c, GrpcCode::RESOURCE_EXHAUSTED | GrpcCode::UNAVAILABLE),
            Self::Response(s) => matches!(s.as_u16(), 429 | 502 | 503 | 504),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grpc(status: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(CONTENT_TYPE, "application/grpc".parse().unwrap());
        if let Some(s) = status {
            h.insert(&GRPC_STATUS, s.parse().unwrap());
        }
        h
    }

    #[test]
    fn trailers_only_answers_carry_their_code() {
        for (code, overload) in [
            ("14", true),
            ("4", true),
            ("13", true),
            ("8", false),
            ("12", false),
        ] {
            let c = Completion::from_parts(StatusCode::OK, &grpc(Some(code)));
            assert!(matches!(c, Completion::Grpc(_)));
            assert_eq!(c.is_overload(), overload, "{code}");
        }
        let ok = Completion::from_parts(StatusCode::OK, &grpc(Some("0")));
        assert_eq!(ok, Completion::Grpc(GrpcCode::OK));
        assert!(!ok.is_overload() && !ok.is_refusal());
        let denied = Completion::from_parts(StatusCode::OK, &grpc(Some("16")));
        assert_eq!(denied.status(), Some(StatusCode::UNAUTHORIZED));
        assert!(!denied.is_overload());
    }

    #[test]
    fn a_streamed_answer_is_classified_by_its_trailers() {
        let head = grpc(None);
        let c = Completion::from_parts(StatusCode::OK, &head);
        assert!(c.awaits_trailers(&head));
        assert_eq!(
            Completion::from_trailers(Some(&grpc(Some("14")))),
            Completion::Grpc(GrpcCode::UNAVAILABLE)
        );
        // No status at all: a broken stream.
        assert!(Completion::from_trailers(None).is_overload());
        let plain = HeaderMap::new();
        assert!(!Completion::from_parts(StatusCode::OK, &plain).awaits_trailers(&plain));
        for (ct, awaits) in [
            ("application/grpc+proto", true),
            ("application/grpc;charset=utf-8", true),
            ("application/grpc-web", false),
            ("application/grpc-web+proto", false),
            ("application/grpcx", false),
        ] {
            let mut h = HeaderMap::new();
            h.insert(CONTENT_TYPE, ct.parse().unwrap());
            assert_eq!(c.awaits_trailers(&h), awaits, "{ct}");
        }
    }

    #[test]
    fn http_statuses_keep_their_meaning() {
        let h = HeaderMap::new();
        let of = |s: u16| Completion::from_parts(StatusCode::from_u16(s).unwrap(), &h);
        assert!(of(503).is_overload() && of(503).is_refusal());
        assert!(of(408).is_overload() && !of(408).is_refusal());
        assert!(!of(429).is_overload() && of(429).is_refusal());
        assert!(!of(501).is_overload());
        assert!(!of(404).is_overload() && !of(200).is_refusal());
        assert!(Completion::Error.is_overload());
        // A grpc-status on a non-200 answer is not gRPC's.
        let c = Completion::from_parts(StatusCode::BAD_GATEWAY, &grpc(Some("0")));
        assert_eq!(c, Completion::Response(StatusCode::BAD_GATEWAY));
    }

    #[test]
    fn garbage_codes_are_unknown() {
        for v in [&b""[..], b"x", b"-1", b"99999999", b"1 4", b"\xff"] {
            assert_eq!(GrpcCode::parse(v), GrpcCode::UNKNOWN, "{v:?}");
        }
        assert_eq!(GrpcCode::parse(b" 14 "), GrpcCode::UNAVAILABLE);
        assert_eq!(
            GrpcCode(77).http_status(),
            StatusCode::INTERNAL_SERVER_ERROR
        );
    }
}
