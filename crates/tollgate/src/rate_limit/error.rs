use std::fmt;

use bytes::Bytes;
use http::{HeaderMap, Response};

use crate::rejection::{LimitKind, Reason, Rejected};

/// The error of [`RateLimitErrorService`](super::RateLimitErrorService): the
/// request was rejected. Carries everything the HTTP rejection would have
/// said: why ([`rejected`](Self::rejected)) and the response itself, headers
/// included ([`headers`](Self::headers), [`to_response`](Self::to_response),
/// and with the `axum` feature `IntoResponse`), so an error handler loses
/// nothing by going through `HandleErrorLayer`.
///
/// ```
/// use axum::{error_handling::HandleErrorLayer, response::IntoResponse, routing::get, Router};
/// use tollgate::{BoxError, Limit, Rate, RateLimitLayer, RateLimited};
/// use tower::ServiceBuilder;
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// async fn handle(err: BoxError) -> axum::response::Response {
///     match err.downcast::<RateLimited>() {
///         // The layer's own 429: status, problem body, `Retry-After`,
///         // `RateLimit` and `RateLimit-Policy`.
///         Ok(limited) => limited.into_response(),
///         Err(other) => (http::StatusCode::INTERNAL_SERVER_ERROR, other.to_string()).into_response(),
///     }
/// }
/// let limit = RateLimitLayer::builder("api", Limit::gcra(Rate::per_second(10), 20)).build()?;
/// let app: Router = Router::new().route("/", get(|| async { "hi" })).layer(
///     ServiceBuilder::new()
///         .layer(HandleErrorLayer::new(handle))
///         .layer(limit.into_errors()),
/// );
/// # let _ = app;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct RateLimited {
    rejected: Rejected,
    response: Response<Bytes>,
}

impl Clone for RateLimited {
    fn clone(&self) -> Self {
        Self {
            rejected: self.rejected.clone(),
            response: self.to_response(),
        }
    }
}

impl RateLimited {
    pub(crate) fn new(rejected: Rejected, response: Response<Bytes>) -> Self {
        Self { rejected, response }
    }

    /// Why the request was rejected: rule, reason, decision.
    pub fn rejected(&self) -> &Rejected {
        &self.rejected
    }

    /// The headers the layer would have sent with the rejection:
    /// `Retry-After`, `RateLimit`, `RateLimit-Policy` (and the legacy
    /// `X-RateLimit-*` when enabled), `Content-Type`, or the gRPC status.
    pub fn headers(&self) -> &HeaderMap {
        self.response.headers()
    }

    /// The response the layer sends in response mode (its custom rejection,
    /// if one was set), with every header.
    pub fn to_response(&self) -> Response<Bytes> {
        let mut res = Response::new(self.response.body().clone());
        *res.status_mut() = self.response.status();
        *res.headers_mut() = self.response.headers().clone();
        res.extensions_mut().insert(crate::rejection::Refusal);
        res
    }
}

/// The rejection as axum's response (feature `axum`): what the layer sends
/// in response mode, headers and all.
#[cfg(feature = "axum")]
impl axum::response::IntoResponse for RateLimited {
    fn into_response(self) -> axum::response::Response {
        self.response.map(axum::body::Body::from)
    }
}

impl fmt::Display for RateLimited {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.rejected.reason {
            Reason::Limited => match self.rejected.kind {
                LimitKind::Concurrency => {
                    write!(f, "concurrency limit \"{}\" reached", self.rejected.rule)
                }
                _ => write!(f, "rate limit \"{}\" exceeded", self.rejected.rule),
            },
            Reason::TooCostly => write!(
                f,
                "request costs more than rule \"{}\" allows at once",
                self.rejected.rule
            ),
            Reason::MissingKey => {
                write!(f, "request has no key for rule \"{}\"", self.rejected.rule)
            }
            Reason::Denied => write!(f, "access denied by list \"{}\"", self.rejected.rule),
            Reason::Blocked => write!(
                f,
                "blocked by \"{}\" after repeated violations",
                self.rejected.rule
            ),
            Reason::ReadOnly => {
                write!(
                    f,
                    "service is read-only for now (rule \"{}\")",
                    self.rejected.rule
                )
            }
            Reason::Expired => write!(
                f,
                "request outlived the lifetime rule \"{}\" allows",
                self.rejected.rule
            ),
        }
    }
}

impl std::error::Error for RateLimited {}
