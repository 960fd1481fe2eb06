//! The whole middleware: `RateLimitLayer`, `ConcurrencyLayer`,
//! `QuotaLayer` and all three stacked, around a service that answers 200,
//! driven by a sequence of arbitrary requests (methods, URIs, API keys,
//! forwarding headers, gRPC content types, cost headers, queries) and an
//! arbitrary (valid or not) configuration. The bar: no panic, no 5xx, and
//! the rejections and rate-limit headers are well formed.
#![no_main]

use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::OnceLock;
use std::time::Duration;

use arbitrary::Arbitrary;
use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{Method, Request, Response, StatusCode, Uri};
use http_body_util::BodyExt;
use libfuzzer_sys::fuzz_target;
use tollgate::calendar::Period;
use tollgate::concurrency::ConcurrencyLayer;
use tollgate::core::ManualClock;
use tollgate::cost::{BodyLength, ByMethod, ByRoute, Cost, HeaderCost, QueryCost};
use tollgate::key::{ClientIp, ForwardedHeader, Header, KeyExtractorExt, Path};
use tollgate::{Limit, MemoryStore, MissingKey, QuotaLayer, Rate, RateLimitLayer};
use tower::{service_fn, Layer, Service, ServiceExt};

type Req = Request<String>;

const NAMES: [&str; 12] = [
    "x-api-key",
    "x-forwarded-for",
    "forwarded",
    "content-type",
    "x-cost",
    "content-length",
    "x-inner-ratelimit",
    "x-inner-policy",
    "x-inner-retry-after",
    "te",
    "grpc-timeout",
    "x-user",
];

#[derive(Debug, Arbitrary)]
enum Name {
    Known(u8),
    Other(Vec<u8>),
}

#[derive(Debug, Arbitrary)]
enum Peer {
    Proxy(u16),
    Ip(IpAddr, u16),
}

#[derive(Debug, Arbitrary)]
struct Req_ {
    method: Vec<u8>,
    uri: Vec<u8>,
    headers: Vec<(Name, Vec<u8>)>,
    grpc: bool,
    peer: Option<Peer>,
    /// Time that passes before this request, in ms.
    advance_ms: u32,
    /// Keep the response (and so a concurrency permit) until the end.
    hold: bool,
}

#[derive(Debug, Arbitrary)]
struct Config {
    mode: u8,
    /// Rule name: one repeated valid character, 1 to 70 bytes (names up
    /// to the 64-byte limit must render; longer ones are config errors).
    name_len: u8,
    name_char: u8,
    algorithm: u8,
    amount: u32,
    period_ms: u32,
    burst: u32,
    cost: u8,
    cap: u64,
    fixed_cost: u64,
    missing: u8,
    headers: bool,
    legacy_headers: bool,
    shadow: bool,
    custom_rejection: bool,
    forwarded: bool,
    max_in_flight: u32,
    service_limit: Option<u32>,
    periods: Vec<(u8, u32)>,
}

#[derive(Debug, Arbitrary)]
struct Input {
    config: Config,
    requests: Vec<Req_>,
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap()
    })
}

/// Answers 200; echoes `x-inner-*` request headers as the rate-limit
/// headers of an inner limiter, so the layers must join theirs with them.
async fn ok(req: Req) -> Result<Response<String>, Infallible> {
    let mut res = Response::new("ok".to_owned());
    for (from, to) in [
        ("x-inner-ratelimit", "ratelimit"),
        ("x-inner-policy", "ratelimit-policy"),
        ("x-inner-retry-after", "retry-after"),
    ] {
        // An inner limiter never sends an empty list.
        for v in req.headers().get_all(from).iter().filter(|v| !v.is_empty()) {
            res.headers_mut().append(to, v.clone());
        }
    }
    Ok(res)
}

fn name(c: &Config) -> String {
    let alphabet = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:";
    let ch = alphabet[usize::from(c.name_char) % alphabet.len()] as char;
    let mut n = String::from("r");
    n.extend(std::iter::repeat_n(ch, usize::from(c.name_len % 70)));
    n
}

fn limit(c: &Config) -> Limit {
    let period = Duration::from_millis(u64::from(c.period_ms));
    let rate = Rate::new(c.amount, period);
    match c.algorithm % 6 {
        0 => Limit::gcra(rate, c.burst),
        1 => Limit::token_bucket(c.burst, c.amount, period),
        2 => Limit::fixed_window(c.burst, period),
        3 => Limit::sliding_window_counter(c.burst, period),
        // The log keeps one entry per unit: keep it small.
        4 => Limit::sliding_window_log(c.burst % 4096, period),
        _ => Limit::leaky_bucket(rate, Duration::from_millis(u64::from(c.burst % 10_000))),
    }
}

#[derive(Clone)]
struct Costs {
    which: u8,
    header: HeaderCost,
    query: QueryCost,
    body: BodyLength,
    route: ByRoute,
    method: ByMethod,
    fixed: u64,
}

impl Costs {
    fn new(c: &Config) -> Option<Self> {
        let cap = c.cap.max(1);
        Some(Self {
            which: c.cost,
            header: HeaderCost::named("x-cost", 1, cap).ok()?,
            query: QueryCost::named("count", 1, cap).ok()?,
            body: BodyLength::new(1024, 1, cap).ok()?,
            route: ByRoute::new(1)
                .route(Some(Method::POST), "/orders", 3)
                .route(None, "/reports", c.fixed_cost),
            method: ByMethod::new(1).method(Method::DELETE, c.fixed_cost),
            fixed: c.fixed_cost,
        })
    }

    fn cost(&self, req: &Req) -> u64 {
        match self.which % 6 {
            0 => self.header.cost(req),
            1 => self.query.cost(req),
            2 => self.body.cost(req),
            3 => self.route.cost(req),
            4 => self.method.cost(req),
            _ => self.fixed,
        }
    }
}

fn missing(c: &Config) -> MissingKey {
    match c.missing % 3 {
        0 => MissingKey::default(),
        1 => MissingKey::Skip,
        _ => MissingKey::Reject,
    }
}

fn request(r: &Req_) -> Req {
    let mut req = Request::new(String::new());
    if let Ok(m) = Method::from_bytes(&r.method) {
        *req.method_mut() = m;
    }
    if let Ok(u) = Uri::try_from(r.uri.as_slice()) {
        *req.uri_mut() = u;
    }
    for (n, v) in &r.headers {
        let n = match n {
            Name::Known(i) => HeaderName::from_static(NAMES[usize::from(*i) % NAMES.len()]),
            Name::Other(b) => match HeaderName::from_bytes(b) {
                Ok(n) => n,
                Err(_) => continue,
            },
        };
        if let Ok(v) = HeaderValue::from_bytes(v) {
            req.headers_mut().append(n, v);
        }
    }
    if r.grpc {
        req.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/grpc+proto"),
        );
    }
    match r.peer {
        None => {}
        Some(Peer::Proxy(port)) => {
            req.extensions_mut()
                .insert(SocketAddr::from(([10, 0, 0, 1], port)));
        }
        Some(Peer::Ip(ip, port)) => {
            req.extensions_mut().insert(SocketAddr::new(ip, port));
        }
    }
    req
}

fn is_grpc(req: &Req) -> bool {
    req.headers()
        .get(CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

/// Whether a `RateLimit` / `RateLimit-Policy` value is a list of items
/// `"name";key=value...`, values being integers or `"concurrent-requests"`.
fn well_formed(v: &[u8]) -> bool {
    let Ok(v) = std::str::from_utf8(v) else {
        return false;
    };
    v.split(", ").all(|item| {
        let mut params = item.split(';');
        let name = params.next().unwrap_or("");
        let name_ok = name.len() > 2
            && name.starts_with('"')
            && name.ends_with('"')
            && name[1..name.len() - 1]
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b));
        name_ok
            && params.all(|p| match p.split_once('=') {
                Some((k, v)) => {
                    !k.is_empty()
                        && k.bytes().all(|b| b.is_ascii_lowercase())
                        && ((!v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
                            || v == "\"concurrent-requests\"")
                }
                None => false,
            })
    })
}

/// Sends every request in order; checks each response.
async fn drive<S, B>(svc: S, clock: &ManualClock, requests: &[Req_])
where
    S: Service<Req, Response = Response<B>, Error = Infallible> + Clone,
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let mut held = Vec::new();
    for r in requests.iter().take(32) {
        clock.advance(Duration::from_millis(u64::from(r.advance_ms)));
        let req = request(r);
        let grpc = is_grpc(&req);
        let echoed = req
            .headers()
            .keys()
            .any(|n| n.as_str().starts_with("x-inner-"));
        let res = svc.clone().oneshot(req).await.unwrap();
        let status = res.status();
        assert!(!status.is_server_error(), "{status}");
        assert!(
            [
                StatusCode::OK,
                StatusCode::TOO_MANY_REQUESTS,
                StatusCode::BAD_REQUEST
            ]
            .contains(&status),
            "{status}"
        );
        if grpc {
            // gRPC rejections are trailers-only responses with HTTP 200.
            assert_eq!(status, StatusCode::OK);
        }
        if status != StatusCode::OK {
            assert_eq!(res.headers()[CONTENT_TYPE], "application/problem+json");
        }
        if status == StatusCode::TOO_MANY_REQUESTS {
            if let Some(v) = res.headers().get(RETRY_AFTER) {
                let secs: u64 = v.to_str().unwrap().parse().unwrap();
                assert!(secs >= 1);
            }
        }
        for h in ["ratelimit", "ratelimit-policy"] {
            for v in res.headers().get_all(h) {
                assert!(!v.is_empty(), "empty {h}");
                if !echoed {
                    assert!(well_formed(v.as_bytes()), "{h}: {v:?}");
                }
            }
        }
        if r.hold {
            held.push(res);
        } else {
            let body = res.into_body().collect().await.unwrap().to_bytes();
            if status != StatusCode::OK {
                let text = std::str::from_utf8(&body).unwrap();
                assert!(
                    text.contains(&format!("\"status\":{}", status.as_u16())),
                    "{text}"
                );
            }
        }
    }
    drop(held);
}

fuzz_target!(|input: Input| {
    let c = &input.config;
    let Some(costs) = Costs::new(c) else { return };
    let cost = move |req: &Req| costs.cost(req);
    let header = if c.forwarded {
        ForwardedHeader::Forwarded
    } else {
        ForwardedHeader::XForwardedFor
    };
    let client_ip = ClientIp::trusting(["10.0.0.0/8", "::1"])
        .unwrap()
        .header(header);
    let key = Header::named("x-api-key").unwrap().or(client_ip);
    let clock = ManualClock::at_unix(1_767_225_600_000_000_000); // 2026-01-01
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .max_keys(64)
        .build()
        .unwrap();
    let name = name(c);

    let rate = || {
        let b = RateLimitLayer::builder(&name, limit(c))
            .key(key.clone())
            .cost(cost.clone())
            .store(store.clone())
            .headers(c.headers)
            .legacy_headers(c.legacy_headers)
            .shadow(c.shadow)
            .on_missing_key(missing(c));
        if c.custom_rejection {
            b.rejection(|r| r.to_problem_response()).build().ok()
        } else {
            b.build().ok()
        }
    };
    let concurrency = || {
        let mut b = ConcurrencyLayer::builder(&format!("{name}-c"), c.max_in_flight % 64)
            .key((key.clone(), Path))
            .cost(cost.clone())
            .store(store.clone())
            .headers(c.headers)
            .shadow(c.shadow)
            .on_missing_key(missing(c));
        if let Some(max) = c.service_limit {
            b = b.service_limit("service", max % 64);
        }
        b.build().ok()
    };
    let quota = || {
        let mut b = QuotaLayer::builder(&format!("{name}-q"))
            .key(key.clone())
            .cost(cost.clone())
            .store(store.clone())
            .headers(c.headers)
            .shadow(c.shadow)
            .on_missing_key(missing(c));
        for (p, l) in c.periods.iter().take(6) {
            let p = match p % 6 {
                0 => Period::Minute,
                1 => Period::Hour,
                2 => Period::Day,
                3 => Period::Week,
                4 => Period::Month,
                _ => Period::Year,
            };
            b = b.period(p, u64::from(*l));
        }
        b.build().ok()
    };

    let reqs = &input.requests;
    let fut: std::pin::Pin<Box<dyn Future<Output = ()>>> = match c.mode % 4 {
        0 => {
            let Some(l) = rate() else { return };
            Box::pin(drive(l.layer(service_fn(ok)), &clock, reqs))
        }
        1 => {
            let Some(l) = concurrency() else { return };
            Box::pin(drive(l.layer(service_fn(ok)), &clock, reqs))
        }
        2 => {
            let Some(l) = quota() else { return };
            Box::pin(drive(l.layer(service_fn(ok)), &clock, reqs))
        }
        _ => {
            let (Some(r), Some(cc), Some(q)) = (rate(), concurrency(), quota()) else {
                return;
            };
            let svc = r.layer(cc.layer(q.layer(service_fn(ok))));
            Box::pin(drive(svc, &clock, reqs))
        }
    };
    runtime().block_on(fut);
});
