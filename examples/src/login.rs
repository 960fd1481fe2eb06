//! The quickstart's `POST /login`: failed logins limited per account and
//! per address, with response-aware policy rules.

use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde::Deserialize;
use tollgate::core::Store;
use tollgate::key::{ClientIp, KeyBuf};
use tollgate::policy::{PolicyLayer, ProofOfWork, RateRule};
use tollgate::{ConfigError, Limit, MissingKey};

/// Failed logins one account may have in [`LOGIN_WINDOW`].
pub const FAILED_PER_USER: u32 = 5;
/// Failed logins one address may have in [`LOGIN_WINDOW`].
pub const FAILED_PER_IP: u32 = 20;
/// The window failed logins are counted over: 15 minutes.
pub const LOGIN_WINDOW: Duration = Duration::from_secs(15 * 60);
/// Refused logins (while locked) within [`LOGIN_WINDOW`] that block the
/// account or address: the first block lasts [`LOGIN_WINDOW`], each next
/// one twice as long, up to a day.
pub const STRIKES: u32 = 3;
/// The longest block: a day.
pub const MAX_BLOCK: Duration = Duration::from_secs(24 * 60 * 60);
/// The challenge's difficulty: 16 bits, ~65,000 SHA-256 hashes on
/// average (milliseconds in a browser).
pub const CHALLENGE_BITS: u8 = 16;
/// The largest login body read.
const MAX_BODY: usize = 4 << 10;

#[derive(Deserialize)]
struct Credentials {
    user: String,
    password: String,
}

/// The account a login is for, read from its JSON body before the limits
/// decide (the policy keys by it).
#[derive(Clone)]
struct LoginUser(String);

/// Reads the body (at most 4 KiB) for its `user`, and hands the request on
/// with the body intact. The account key is the user as the account
/// lookup reads it (trimmed, lower case), so `Ann`, `aNN` and `ann ` are
/// one account's budget. A body the handler will refuse (not
/// `application/json`) names no account: it is refused with 415 without
/// being charged and given back, which would re-date the account's
/// failures for free.
async fn read_user(req: Request, next: Next) -> Response {
    let json = req
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("application/json"));
    if !json {
        return StatusCode::UNSUPPORTED_MEDIA_TYPE.into_response();
    }
    let (parts, body) = req.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, MAX_BODY).await else {
        return StatusCode::PAYLOAD_TOO_LARGE.into_response();
    };
    let user = Json::<Credentials>::from_bytes(&bytes)
        .ok()
        .map(|Json(c)| c.user.trim().to_lowercase());
    let mut req = Request::from_parts(parts, Body::from(bytes));
    if let Some(user) = user {
        req.extensions_mut().insert(LoginUser(user));
    }
    next.run(req).await
}

/// `demo` is the password of every account.
async fn login(Json(c): Json<Credentials>) -> (StatusCode, String) {
    if c.password == "demo" {
        (StatusCode::OK, format!("Welcome, {}.\n", c.user))
    } else {
        (
            StatusCode::UNAUTHORIZED,
            "Wrong user or password.\n".to_owned(),
        )
    }
}

/// `POST /login`: at most [`FAILED_PER_USER`] failed logins per account
/// and [`FAILED_PER_IP`] per address in any 15 minutes (sliding windows);
/// past either, every login of that account or address — the right
/// password included — answers 429 with `Retry-After` until the oldest
/// failure leaves the window. Successful logins count toward neither (each
/// is charged as it arrives and given back once it succeeds: a sliding log
/// gives back its oldest unit, so a success with the right password moves
/// the oldest failure of the window to now).
/// From the third failure, responses warn (`RateLimit-Warning:
/// "failed-logins-user";used=60`). Who keeps trying while locked climbs
/// an escalation ladder: [`STRIKES`]
/// refused logins within 15 minutes block the account (or address) for
/// 15 minutes, the next block 30, then an hour, ... up to a day. Before
/// the block, a locked account's 429 carries a proof-of-work challenge
/// ([`CHALLENGE_BITS`]): a login that sends its solution back passes the
/// per-account limit once (the per-address one still counts), so the
/// account's owner can still log in while someone else locked it.
/// `secret` signs the challenges: the same on every instance of a fleet.
pub fn routes<S: Store>(
    store: S,
    client_ip: ClientIp,
    secret: &[u8],
) -> Result<Router, ConfigError> {
    let challenge = ProofOfWork::new(secret, CHALLENGE_BITS, Duration::from_secs(300))?;
    let user = |req: &axum::http::Request<Body>, key: &mut KeyBuf| {
        key.push(req.extensions().get::<LoginUser>()?.0.as_bytes());
        Some(())
    };
    let failed = |s: StatusCode| s == StatusCode::UNAUTHORIZED;
    let limits = PolicyLayer::builder()
        .rule(
            RateRule::new(
                "failed-logins-user",
                Limit::sliding_window_log(FAILED_PER_USER, LOGIN_WINDOW),
                user,
            )
            .count_if(failed)
            // The ladder: a warning from the third failure, 429 past the
            // fifth, then blocks that grow.
            .warn_at(0.6)
            .escalate(STRIKES, LOGIN_WINDOW, LOGIN_WINDOW, MAX_BLOCK)
            .challenge(challenge)
            // A body without a user is the handler's to refuse.
            .on_missing_key(MissingKey::Skip),
        )
        .rule(
            RateRule::new(
                "failed-logins-ip",
                Limit::sliding_window_log(FAILED_PER_IP, LOGIN_WINDOW),
                client_ip.clone(),
            )
            .count_if(failed)
            .escalate(STRIKES, LOGIN_WINDOW, LOGIN_WINDOW, MAX_BLOCK),
        )
        // A challenge is the refused client's own (by its address behind
        // the trusted proxies): an attacker who locked an account and
        // solves its challenges first takes nothing from the owner's.
        .challenge_requester(client_ip)
        .store(store)
        .build()?;
    Ok(Router::new().route(
        "/login",
        post(login)
            .route_layer(limits)
            .route_layer(middleware::from_fn(read_user)),
    ))
}
