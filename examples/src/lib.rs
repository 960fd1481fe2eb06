//! The servers behind the runnable examples, as functions so the end-to-end
//! tests exercise exactly what the binaries serve.
//!
//! Run the quickstart with `cargo run -p tollgate-examples --bin quickstart`.

pub mod grpc;
pub mod login;

use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::routing::{get, post};
use axum::Router;
use tollgate::config::{FileError, PolicyFile, Tollgate};
use tollgate::core::QuotaStore;
use tollgate::key::ClientIp;
use tollgate::ConfigError;

/// The size of `GET /api/download`'s body.
pub const DOWNLOAD_BYTES: usize = 1 << 20;
/// The size of its chunks.
pub const DOWNLOAD_CHUNK: usize = 16 << 10;
/// How many times a client's limit one address gets, for every limit
/// keyed by API key: rotating keys from one address buys at most this.
pub const PER_ADDRESS: u32 = 4;

/// The quickstart's API, with the limits of the built-in policy file
/// (`examples/quickstart.toml`, which a file of one's own replaces):
///
/// - one budget per client of 10 requests per second with bursts of 20,
///   where an order costs 3 and a report 10 (`x-plan: pro`: 100 a second
///   with bursts of 200 — a demo; in production the plan comes from
///   authentication), and one per client address
///   of 100 a second with bursts of 400 (so rotating API keys from one
///   address buys no fresh budgets), decided as one policy;
/// - `GET /api/download` streams 1 MiB in 16 KiB chunks, paced to
///   256 KiB/s per client (bursts of at most 64 KiB), at most 2 at once
///   per client: a third is refused at once while two bodies are still
///   being sent;
/// - every `/api/*` route sits behind at most 64 requests in flight per
///   client and an adaptive whole-service limit (a gradient of latencies,
///   between 16 and 512) that follows the service's latency and errors;
/// - every `/api/*` route draws on a daily quota of 1,000 cost units per
///   client (UTC days; a `RateLimit-Policy` item with `w=86400`);
/// - every limit above that is keyed by API key is also bounded per
///   client address, at [`PER_ADDRESS`] times the client's (the day's
///   quota at 10 times, the rate at 10 times in the policy file), so
///   rotating `x-api-key` from one address buys nothing past the
///   address's budget: `daily-address`, `per-address` in flight,
///   `downloads-address`, `download-rate-address`;
/// - `POST /login` (JSON `{"user": ..., "password": ...}`; the password
///   `demo` succeeds, anything else is a 401) allows 5 failed logins per
///   account and 20 per address in any 15 minutes; past either, logins
///   of that account or address answer 429 with `Retry-After`, the right
///   password included (see [`login::routes`]);
/// - `/healthz` is not limited.
///
/// The client is its `x-api-key`, else its IP: the peer's, or — when the
/// peer is one of `trusted_proxies` (CIDRs) — the address those proxies
/// report in `X-Forwarded-For`.
pub fn quickstart_app<S: QuotaStore>(
    store: S,
    trusted_proxies: &[String],
) -> Result<Router, Error> {
    let policy = quickstart_policy(None, trusted_proxies)?;
    Ok(quickstart_app_with(store, trusted_proxies, &policy)?.0)
}

/// Why a quickstart app was not built: a policy file that did not load,
/// or a layer's configuration error.
pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// The quickstart's built-in policy file, `examples/quickstart.toml`:
/// every limit of [`quickstart_app`].
pub const QUICKSTART_POLICY: &str = include_str!("../quickstart.toml");

/// The quickstart's policy: the file at `path`, else the built-in one;
/// `trusted_proxies` apply where the file names none.
pub fn quickstart_policy(
    path: Option<&std::path::Path>,
    trusted_proxies: &[String],
) -> Result<PolicyFile, FileError> {
    let file = match path {
        Some(path) => PolicyFile::read(path)?,
        None => PolicyFile::parse(QUICKSTART_POLICY)?,
    };
    file.default_trusted_proxies(trusted_proxies)
}

/// [`quickstart_app`] with its limits from `policy`; also returns
/// the layer that holds them, for its [`Tollgate::reloader`].
pub fn quickstart_app_with<S: QuotaStore>(
    store: S,
    trusted_proxies: &[String],
    policy: &PolicyFile,
) -> Result<(Router, Tollgate<S>), Error> {
    let store_for_login = store.clone();
    // Every limit as `quickstart.toml` declares it, in one layer: rates,
    // then requests in flight, then quotas, then pacing (the download's
    // in-flight limits and pacing apply to its route alone, as the file
    // says). Plans: `x-plan: pro` (a demo; in production the plan comes
    // from authentication, as a `Plan` extension) gets more of every
    // limit.
    let gate = Tollgate::new(policy, &store)?;
    let api = Router::new()
        .route(
            "/api/hello",
            get(|| async { "Hello from behind the tollgate.\n" }),
        )
        .route("/api/orders", post(|| async { "Order placed.\n" }))
        .route("/api/reports", post(|| async { "Report generated.\n" }))
        .route(
            "/api/download",
            get(|| async { Body::new(Chunks(DOWNLOAD_BYTES)) }),
        )
        // route_layer: only matched routes are limited; a 404 costs nothing.
        .route_layer(gate.clone());
    let router = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .merge(api)
        .merge(login::routes(
            store_for_login,
            ClientIp::trusting(trusted_proxies)?,
            &challenge_secret()?,
        )?);
    Ok((router, gate))
}

/// The secret the login challenges are signed with:
/// `TOLLGATE_CHALLENGE_SECRET` (16 to 64 bytes; what every instance of a
/// fleet must share), else one made for this process. A secret of
/// another length is an error, not a silent per-process one.
fn challenge_secret() -> Result<Vec<u8>, ConfigError> {
    use std::hash::BuildHasher;
    match std::env::var("TOLLGATE_CHALLENGE_SECRET") {
        Ok(s) if (16..=64).contains(&s.len()) => Ok(s.into_bytes()),
        Ok(_) => Err(ConfigError::new(
            "TOLLGATE_CHALLENGE_SECRET",
            "must be 16 to 64 bytes",
        )),
        Err(_) => {
            let seed = std::collections::hash_map::RandomState::new();
            Ok((0u64..4)
                .flat_map(|i| seed.hash_one(i).to_le_bytes())
                .collect())
        }
    }
}

/// Logs to stderr (see [`tollgate_server::init_logs`]).
pub use tollgate_server::init_logs;
pub use tollgate_server::metrics::{
    metrics_route, prometheus, HISTOGRAM_BUCKETS, METRICS_UPKEEP, RATIO_BUCKETS,
};
/// Serves an app with peer addresses until ctrl-c or SIGTERM (see
/// [`tollgate_server::serve`]).
pub use tollgate_server::serve;

/// A body of `n` bytes in 16 KiB chunks, as fast as it is read (the
/// bandwidth layer paces it).
struct Chunks(usize);

impl http_body::Body for Chunks {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        if self.0 == 0 {
            return Poll::Ready(None);
        }
        let n = self.0.min(DOWNLOAD_CHUNK);
        self.0 = self.0.saturating_sub(n);
        static CHUNK: [u8; DOWNLOAD_CHUNK] = [b'x'; DOWNLOAD_CHUNK];
        let chunk = Bytes::from_static(CHUNK.get(..n).unwrap_or_default());
        Poll::Ready(Some(Ok(http_body::Frame::data(chunk))))
    }

    fn is_end_stream(&self) -> bool {
        self.0 == 0
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.0 as u64)
    }
}
