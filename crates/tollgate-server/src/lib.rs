//! tollgate's limits as a decision server, for gateways that ask another
//! service whether a request may pass: NGINX `auth_request`, Traefik
//! `ForwardAuth`, Caddy `forward_auth`. Services in any language behind
//! them get the same rates and quotas, from the same policy file and
//! store, as the Tower layers give Rust services.
//!
//! The gateway sends each request's method, URI, client address and
//! headers; the server decides that request with the file's `[[rules]]`
//! and `[[quotas]]` and answers:
//!
//! - `/check`, for Traefik's `ForwardAuth` and Caddy's `forward_auth`: the
//!   original method and URI from `X-Forwarded-Method` and
//!   `X-Forwarded-Uri` (which those gateways set, over any the client
//!   sent); `200` with the `RateLimit` and `RateLimit-Policy` fields (the
//!   gateway's `authResponseHeaders` / `copy_headers` put them on the
//!   request to the upstream), or the limiter's refusal as it is — `429`
//!   with `Retry-After`, the fields and a problem document, which both
//!   gateways hand to the client;
//! - `/auth_request`, for NGINX's `auth_request`: the original method and
//!   URI from `X-Original-Method` and `X-Original-URI` (which its config
//!   sets); a refusal is `403` with the limiter's status in
//!   `Tollgate-Status`, since `auth_request` passes only `401` and `403`
//!   on: `examples/nginx/tollgate.conf` answers the client with that
//!   status, `Retry-After` and the fields;
//! - `/healthz`: `200 ok`.
//!
//! Envoy's `ratelimit` filter asks over gRPC instead: [`rls`] serves
//! `envoy.service.ratelimit.v3.RateLimitService` by the descriptors of
//! Envoy's own ratelimit configuration files ([`envoy`]). Both serve TLS
//! with `[server.tls]` ([`tls`], [`serve_tls`], [`rls::serve_with`]).
//!
//! Each endpoint reads only its gateway's headers: the other family comes
//! from the client, through a gateway that passes it on.
//!
//! In-flight limits and pacing need to see the response's lifetime, which
//! a decision never does: a file's `[[concurrency]]` and `[[bandwidth]]`
//! entries are left out (and said so in the log). What needs the response
//! or the body is refused at start, naming its field: a rule's
//! `count_if`, `[idempotency]`, costs by `bytes_per_unit`. A quota is
//! charged when the request is allowed; the server does not see whether
//! the upstream served it.
//!
//! The client address is `X-Forwarded-For`'s, read as `client-ip` keys
//! read it: the file's `trusted_proxies` must name the gateway's
//! addresses, or every request is keyed by the gateway's own address.
//! `peer-ip` is always the gateway's; `forwarded_header = "forwarded"`
//! reads a header none of these gateways sets (the client's, then);
//! `plan_from = "extension"` has no extension to read, and a
//! `"header:..."` plan must be a header the gateway sets.
//!
//! ```
//! use tollgate::config::{PolicyFile, Tollgate};
//! use tollgate::MemoryStore;
//! use tower::ServiceExt;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let file = PolicyFile::parse(
//!     r#"
//!     [[rules]]
//!     name = "per-key"
//!     key = "header:x-api-key"
//!     rate = "10/s"
//!     burst = 2
//!     "#,
//! )?;
//! let app = tollgate_server::decisions(Tollgate::for_decisions(&file, &MemoryStore::new())?);
//! let check = || {
//!     http::Request::get("/check")
//!         .header("x-forwarded-method", "GET")
//!         .header("x-forwarded-uri", "/api/hello")
//!         .header("x-api-key", "demo")
//!         .body(axum::body::Body::empty())
//! };
//! assert_eq!(app.clone().oneshot(check()?).await?.status(), 200);
//! assert_eq!(app.clone().oneshot(check()?).await?.status(), 200);
//! let refused = app.oneshot(check()?).await?;
//! assert_eq!(refused.status(), 429);
//! assert!(refused.headers().contains_key("retry-after"));
//! # Ok(())
//! # }
//! ```

use std::convert::Infallible;
use std::net::SocketAddr;

use axum::body::Body;
use axum::extract::{ConnectInfo, State};
use axum::routing::{any, get};
use axum::Router;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode, Uri};
use tollgate::config::Tollgate;
use tollgate::core::QuotaStore;
use tower::ServiceExt;

pub mod envoy;
mod loaded;
pub mod metrics;
pub mod rls;
pub mod tls;

pub use loaded::{Envoy, Loaded};

/// What loading a server's configuration can fail with.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The header that carries the limiter's own status on
/// `/auth_request`'s refusals (which answer `403`).
pub const TOLLGATE_STATUS: HeaderName = HeaderName::from_static("tollgate-status");

/// Request headers of the subrequest itself, not the original request's:
/// not handed to the limits.
const OWN: [&str; 6] = [
    "x-original-method",
    "x-original-uri",
    "x-forwarded-method",
    "x-forwarded-uri",
    "content-length",
    "transfer-encoding",
];

/// The decision endpoints (`/check`, `/auth_request`, `/healthz`) over
/// `gate`'s limits (build it with
/// [`Tollgate::for_decisions`](tollgate::config::Tollgate::for_decisions)).
/// Serve it with the peer's address
/// (`into_make_service_with_connect_info::<SocketAddr>()`, as [`serve`]
/// does): `client-ip` keys fall back to it.
pub fn decisions<St: QuotaStore + Send + Sync + 'static>(gate: Tollgate<St>) -> Router
where
    St::Limiter: Send + Sync,
{
    Router::new()
        .route(
            "/check",
            any(|State(gate): State<Tollgate<St>>, req: Request<Body>| {
                decide(gate, req, Refusal::AsIs)
            }),
        )
        .route(
            "/auth_request",
            any(|State(gate): State<Tollgate<St>>, req: Request<Body>| {
                decide(gate, req, Refusal::Forbidden)
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .with_state(gate)
}

/// Which gateway an endpoint answers: where it reads the original
/// request, and how it answers a refusal.
#[derive(Debug, Clone, Copy)]
enum Refusal {
    /// `/check` (Traefik, Caddy): `X-Forwarded-Method` and
    /// `X-Forwarded-Uri`, which those gateways set (and overwrite); a
    /// refusal as the limiter answers it (429, 400).
    AsIs,
    /// `/auth_request` (NGINX): `X-Original-Method` and `X-Original-URI`,
    /// which its config sets; a refusal is `403`, the limiter's status in
    /// [`TOLLGATE_STATUS`].
    Forbidden,
}

impl Refusal {
    /// The headers this gateway sets for the original method and URI.
    /// Only these are read: the other family would come from the client,
    /// through a gateway that passes it on unchanged.
    fn headers(self) -> [&'static str; 2] {
        match self {
            Self::AsIs => ["x-forwarded-method", "x-forwarded-uri"],
            Self::Forbidden => ["x-original-method", "x-original-uri"],
        }
    }
}

/// Decides the request `req` describes.
async fn decide<St: QuotaStore>(
    gate: Tollgate<St>,
    req: Request<Body>,
    refusal: Refusal,
) -> Response<Body> {
    let peer = req.extensions().get::<ConnectInfo<SocketAddr>>().copied();
    let original = match original(req.headers(), req.method(), refusal) {
        Ok(original) => original,
        Err(why) => {
            return tollgate::rejection::problem(StatusCode::BAD_REQUEST, why).map(Body::from)
        }
    };
    let (method, uri) = original;
    let mut decided = Request::new(Body::empty());
    *decided.method_mut() = method;
    *decided.uri_mut() = uri;
    for (name, value) in req.headers() {
        if !OWN.contains(&name.as_str()) {
            decided.headers_mut().append(name, value.clone());
        }
    }
    if let Some(peer) = peer {
        decided.extensions_mut().insert(peer);
    }
    let allow = tower::service_fn(|_req: Request<Body>| async {
        Ok::<_, Infallible>(Response::new(Body::empty()))
    });
    let answer = match tower::Layer::layer(&gate, allow).oneshot(decided).await {
        Ok(answer) => answer,
        Err(never) => match never {},
    };
    if answer.status().is_success() {
        // Allowed: the fields to copy, no body.
        let (parts, _) = answer.into_parts();
        return Response::from_parts(parts, Body::empty());
    }
    match refusal {
        Refusal::AsIs => answer,
        Refusal::Forbidden => {
            let (mut parts, body) = answer.into_parts();
            let status = parts.status;
            parts
                .headers
                .insert(TOLLGATE_STATUS, HeaderValue::from(status.as_u16()));
            parts.status = StatusCode::FORBIDDEN;
            Response::from_parts(parts, body)
        }
    }
}

/// The original request's method and URI, from the headers the
/// endpoint's gateway sets. Without a method header the subrequest's own
/// is the original's (NGINX's `auth_request` keeps it).
fn original(
    headers: &HeaderMap,
    own: &Method,
    refusal: Refusal,
) -> Result<(Method, Uri), &'static str> {
    let [method, uri] = refusal.headers();
    let method = match headers.get(method) {
        Some(m) => Method::from_bytes(m.as_bytes()).map_err(|_| {
            "the original method (X-Original-Method, X-Forwarded-Method) is not a method"
        })?,
        None => own.clone(),
    };
    let uri = headers.get(uri).ok_or(match refusal {
        Refusal::Forbidden => "no original URI: NGINX sends it with proxy_set_header X-Original-URI $request_uri",
        Refusal::AsIs => "no original URI: the gateway sends it as X-Forwarded-Uri (Traefik ForwardAuth, Caddy forward_auth)",
    })?;
    let uri = lenient_uri(uri.as_bytes())
        .filter(|u| u.path().starts_with('/'))
        .ok_or("the original URI is not a path like /api/hello?x=1")?;
    Ok((method, uri))
}

/// `raw` as a URI, the bytes a gateway passes on but `http` refuses
/// (`<`, `"`, a space, non-ASCII, ...) percent-encoded first: a request
/// the gateway accepted is decided, not answered with an error.
fn lenient_uri(raw: &[u8]) -> Option<Uri> {
    const REFUSED: &[u8] = b"\"<>\\^`{|} ";
    let plain = |b: &u8| b.is_ascii_graphic() && !REFUSED.contains(b);
    if raw.iter().all(plain) {
        return Uri::try_from(raw).ok();
    }
    let mut encoded = String::with_capacity(raw.len().saturating_mul(3));
    for b in raw {
        if plain(b) {
            encoded.push(char::from(*b));
        } else {
            encoded.push_str(&format!("%{b:02X}"));
        }
    }
    Uri::try_from(encoded).ok()
}

/// Serves `app` on `listener` with the peer's address, until ctrl-c or
/// SIGTERM; requests under way finish first.
pub async fn serve(listener: tokio::net::TcpListener, app: Router) -> std::io::Result<()> {
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown())
    .await
}

/// [`serve`] over TLS (`[server.tls]`, read by [`tls::load`]).
pub async fn serve_tls(
    listener: tokio::net::TcpListener,
    tls: &tls::Tls,
    app: Router,
) -> std::io::Result<()> {
    use axum::serve::ListenerExt;
    // (`tap_io` gives the connections the peer's address as connect info.)
    let listener = tls::listener(listener, tls)?.tap_io(|_| {});
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown())
    .await
}

/// Resolves on ctrl-c, or SIGTERM (Unix): what a process manager sends.
pub async fn shutdown() {
    #[cfg(unix)]
    {
        let term = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(_) => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            () = term => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Logs to stderr through `tracing` (reloads, rejected policy files, store
/// faults), without module paths: as text, or one JSON object a line with
/// `TOLLGATE_LOG_FORMAT=json` (for a log pipeline).
pub fn init_logs() {
    let json = std::env::var("TOLLGATE_LOG_FORMAT").is_ok_and(|f| f.eq_ignore_ascii_case("json"));
    let logs = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_target(false);
    let _ = if json {
        logs.json().try_init()
    } else {
        logs.try_init()
    };
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)]
mod tests {
    use super::lenient_uri;

    #[test]
    fn a_uri_a_gateway_passes_on_is_read() {
        for raw in [
            &b"/s?q=<b>\"x\""[..],
            b"/a b",
            b"/caf\xc3\xa9?x={1}|2",
            b"/`^\\",
        ] {
            let uri = lenient_uri(raw).unwrap_or_else(|| panic!("{raw:?}"));
            assert!(uri.path().starts_with('/'), "{uri}");
        }
        assert_eq!(lenient_uri(b"/plain?x=1").unwrap(), "/plain?x=1");
        assert_eq!(lenient_uri(b"/a b").unwrap().path(), "/a%20b");
        assert!(
            http::Uri::try_from(&b"/s?q=<b>"[..]).is_err(),
            "http refuses it"
        );
    }
}
