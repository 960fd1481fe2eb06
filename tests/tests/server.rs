//! `tollgate-server`'s decision endpoints through real HTTP, as a gateway
//! calls them: NGINX's `auth_request` (X-Original-*), Traefik's and
//! Caddy's forward auth (X-Forwarded-*).
#![allow(missing_docs, clippy::unwrap_used, clippy::arithmetic_side_effects)]

use bytes::Bytes;
use http::Request;
use tollgate::config::{PolicyFile, Tollgate};
use tollgate::MemoryStore;
use tollgate_tests::{send, Reply};

const POLICY: &str = r#"
trusted_proxies = ["127.0.0.1/32"]

[costs.api]
default = 1
routes = [{ method = "POST", path = "/api/reports", cost = 2 }]

[[rules]]
name = "per-key"
key = "header:x-api-key | client-ip"
rate = "1/h"
burst = 3
cost = "api"

[[quotas]]
name = "exports"
key = "client-ip"
limits = { day = 1 }
routes = ["GET /api/export"]

# Left out by a decision server (it never sees a response): said in the
# log, not an error.
[[concurrency]]
name = "in-flight"
key = "client-ip"
max = 1
"#;

async fn server() -> std::net::SocketAddr {
    let file = PolicyFile::parse(POLICY).unwrap();
    let gate = Tollgate::for_decisions(&file, &MemoryStore::new()).unwrap();
    assert_eq!(gate.limit_names(), ["exports"]);
    let app = tollgate_server::decisions(gate);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(tollgate_server::serve(listener, app));
    addr
}

/// A subrequest as NGINX sends it to `/auth_request` (`X-Original-*`),
/// or as Traefik and Caddy send it to `/check` (`X-Forwarded-*`).
fn ask(endpoint: &str, method: &str, uri: &str, headers: &[(&str, &str)]) -> Request<Bytes> {
    let (m, u) = if endpoint == "/auth_request" {
        ("x-original-method", "x-original-uri")
    } else {
        ("x-forwarded-method", "x-forwarded-uri")
    };
    let mut req = Request::get(endpoint).header(m, method).header(u, uri);
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    req.body(Bytes::new()).unwrap()
}

/// What `rule`'s `RateLimit` item says is left.
fn left(reply: &Reply, rule: &str) -> Option<u64> {
    reply
        .item("ratelimit", rule)
        .split(';')
        .find_map(|p| p.strip_prefix("r="))?
        .parse()
        .ok()
}

/// `Retry-After`, in seconds.
fn retry_after(reply: &Reply) -> u64 {
    reply.header("retry-after").parse().unwrap()
}

#[tokio::test]
async fn a_gateway_gets_each_original_requests_decision() {
    let addr = server().await;
    let key = [("x-api-key", "k1")];
    // Three units a key: a read costs 1 (its fields to copy come back
    // with the 200), a report 2.
    let r = send(addr, ask("/check", "GET", "/api/hello?x=1", &key))
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(left(&r, "per-key"), Some(2));
    assert!(r.header("ratelimit-policy").contains("\"per-key\";q=3"));
    let r = send(addr, ask("/check", "POST", "/api/reports", &key))
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(left(&r, "per-key"), Some(0));
    // The next is refused as the layer refuses it: 429, Retry-After, the
    // fields, a problem document.
    let r = send(addr, ask("/check", "GET", "/api/hello", &key))
        .await
        .unwrap();
    assert_eq!(r.status, 429);
    // A unit comes back an hour after the first was spent.
    assert!((3590..=3600).contains(&retry_after(&r)), "{r:?}");
    assert!(r.body.contains("\"rule\":\"per-key\""), "{}", r.body);
    // On /auth_request a refusal is a 403 NGINX passes on, with the
    // limiter's status and the same fields.
    let r = send(addr, ask("/auth_request", "GET", "/api/hello", &key))
        .await
        .unwrap();
    assert_eq!(r.status, 403);
    assert_eq!(r.header("tollgate-status"), "429");
    assert!((3590..=3600).contains(&retry_after(&r)), "{r:?}");
    assert_eq!(left(&r, "per-key"), Some(0));
    // Another key is another budget.
    let r = send(
        addr,
        ask("/auth_request", "GET", "/api/hello", &[("x-api-key", "k2")]),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200);
}

#[tokio::test]
async fn clients_are_told_apart_by_the_gateways_forwarded_for() {
    let addr = server().await;
    // No API key: the client's address, from X-Forwarded-For (the file
    // trusts the gateway, here on loopback).
    let from = |ip: &str| [("x-forwarded-for", ip.to_owned())];
    for ip in ["203.0.113.7", "203.0.113.8"] {
        let h = from(ip);
        let headers: Vec<(&str, &str)> = h.iter().map(|(n, v)| (*n, v.as_str())).collect();
        // The export quota (one a day per address) applies to its route
        // only.
        let r = send(addr, ask("/check", "GET", "/api/export", &headers))
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{ip}");
        assert_eq!(left(&r, "exports"), Some(0), "{ip}: {r:?}");
        let r = send(addr, ask("/check", "GET", "/api/export", &headers))
            .await
            .unwrap();
        assert_eq!(r.status, 429, "{ip}");
        let r = send(addr, ask("/check", "GET", "/api/other", &headers))
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{ip}");
        assert!(r.header("ratelimit").find("exports").is_none(), "{r:?}");
    }
}

/// Review of the server: each endpoint reads only the headers its
/// gateway sets. Through Traefik or Caddy (which overwrite
/// `X-Forwarded-*` and pass the client's other headers on), a client's
/// own `X-Original-*` names nothing; through NGINX, its
/// `X-Forwarded-Method` names nothing.
#[tokio::test]
async fn a_client_cannot_name_the_request_it_is_charged_for() {
    let addr = server().await;
    // A report (2 of the key's 3) with a forged cheap read beside it.
    let forged = [
        ("x-api-key", "forger"),
        ("x-original-method", "GET"),
        ("x-original-uri", "/x"),
    ];
    let r = send(addr, ask("/check", "POST", "/api/reports", &forged))
        .await
        .unwrap();
    assert_eq!(left(&r, "per-key"), Some(1), "charged as a report: {r:?}");
    let forged = [("x-api-key", "forger2"), ("x-forwarded-method", "GET")];
    let mut req = ask("/auth_request", "POST", "/api/reports", &forged);
    req.headers_mut().remove("x-original-method");
    *req.method_mut() = http::Method::POST;
    let r = send(addr, req).await.unwrap();
    assert_eq!(left(&r, "per-key"), Some(1), "charged as a report: {r:?}");
    // A URI NGINX passes on but `http` refuses is decided, not a 400
    // (which NGINX would turn into a 500).
    let r = send(
        addr,
        ask(
            "/auth_request",
            "GET",
            "/s?q=<b>\"x\"",
            &[("x-api-key", "odd")],
        ),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200, "{r:?}");
}

#[tokio::test]
async fn a_subrequest_without_the_original_uri_is_a_clear_400() {
    let addr = server().await;
    let req = Request::get("/check")
        .header("x-api-key", "k")
        .body(Bytes::new())
        .unwrap();
    let r = send(addr, req).await.unwrap();
    assert_eq!(r.status, 400);
    assert!(r.body.contains("X-Forwarded-Uri"), "{}", r.body);
    let req = Request::get("/auth_request").body(Bytes::new()).unwrap();
    let r = send(addr, req).await.unwrap();
    assert_eq!(r.status, 400);
    assert!(r.body.contains("X-Original-URI $request_uri"), "{}", r.body);
    let r = send(addr, ask("/check", "G E T", "/x", &[])).await.unwrap();
    assert_eq!(r.status, 400);
    let r = send(addr, ask("/check", "GET", "http://[bad", &[]))
        .await
        .unwrap();
    assert_eq!(r.status, 400);
    let r = send(addr, Request::get("/healthz").body(Bytes::new()).unwrap())
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.body, "ok\n");
}
