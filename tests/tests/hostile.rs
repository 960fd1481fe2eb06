//! Hostile and odd inputs get a 4xx or pass — never a 500, never a panic —
//! and gRPC and shadow mode behave end to end.
#![allow(missing_docs, clippy::unwrap_used, clippy::arithmetic_side_effects)]

mod common;

use std::time::Duration;

use axum::routing::{get, post};
use axum::Router;
use bytes::Bytes;
use http::Request;
use tollgate::core::ManualClock;
use tollgate::cost::HeaderCost;
use tollgate::key::{Header, KeyExtractorExt, PeerIp};
use tollgate::{Limit, MemoryStore, Rate, RateLimitLayer};
use tollgate_tests::{send, send_raw};

fn store(clock: &ManualClock) -> MemoryStore<ManualClock> {
    MemoryStore::builder().clock(clock.clone()).build().unwrap()
}

async fn batch_app(clock: &ManualClock, shadow: bool) -> std::net::SocketAddr {
    let limit = RateLimitLayer::builder("batch", Limit::gcra(Rate::per_second(5), 10))
        .key(Header::named("x-api-key").unwrap().or(PeerIp::new()))
        .cost(HeaderCost::named("x-batch-size", 1, 1_000_000).unwrap())
        .store(store(clock))
        .shadow(shadow)
        .build()
        .unwrap();
    let app = Router::new()
        .route("/batch", post(|| async { "done" }))
        .route("/hello", get(|| async { "hi" }))
        .layer(limit);
    common::spawn(app).await
}

#[tokio::test]
async fn hostile_keys_and_costs_never_get_a_5xx() {
    let clock = ManualClock::starting_at(1);
    let addr = batch_app(&clock, false).await;
    // Non-UTF-8 and control-ish header values, as raw bytes.
    for value in [&b"\xff\xfe\xfd"[..], b"\x80", b"{slot}\t", b"%00%0d%0a"] {
        let mut raw = b"GET /hello HTTP/1.1\r\nHost: x\r\nx-api-key: ".to_vec();
        raw.extend_from_slice(value);
        raw.extend_from_slice(b"\r\nConnection: close\r\n\r\n");
        let status = send_raw(addr, &raw).await.unwrap();
        assert!((200..500).contains(&status), "value {value:?} got {status}");
    }
    // A 64 KiB key is hashed like any other and limited like any other.
    let big = "k".repeat(64 * 1024);
    for i in 0..10 {
        let req = Request::get("/hello")
            .header("x-api-key", &big)
            .body(Bytes::new())
            .unwrap();
        assert_eq!(send(addr, req).await.unwrap().status, 200, "request {i}");
    }
    let req = Request::get("/hello")
        .header("x-api-key", &big)
        .body(Bytes::new())
        .unwrap();
    assert_eq!(send(addr, req).await.unwrap().status, 429);
    // Absurd and malformed costs: a 429 that says it can never succeed.
    for cost in ["4294967295", "99999999999999999999", "-5", "ten", "1e9"] {
        let req = Request::post("/batch")
            .header("x-api-key", "costly")
            .header("x-batch-size", cost)
            .body(Bytes::new())
            .unwrap();
        let r = send(addr, req).await.unwrap();
        assert_eq!(r.status, 429, "cost {cost}");
        assert!(r.headers.get("retry-after").is_none(), "cost {cost}");
        assert!(r.body.contains("never succeed"), "{}", r.body);
    }
    // A claimed zero is not a free pass: it costs one.
    let zero = || {
        Request::post("/batch")
            .header("x-api-key", "zero")
            .header("x-batch-size", "0")
            .body(Bytes::new())
            .unwrap()
    };
    for i in 0..10 {
        assert_eq!(send(addr, zero()).await.unwrap().status, 200, "request {i}");
    }
    assert_eq!(send(addr, zero()).await.unwrap().status, 429);
    // A cost that fits is charged.
    let req = Request::post("/batch")
        .header("x-api-key", "costly")
        .header("x-batch-size", "10")
        .body(Bytes::new())
        .unwrap();
    assert_eq!(send(addr, req).await.unwrap().status, 200);
    // Garbage request lines are hyper's to refuse (4xx), not ours to crash on.
    let status = send_raw(addr, b"\x00\x01\x02 / HTTP/1.1\r\n\r\n")
        .await
        .unwrap();
    assert!(status == 0 || (400..500).contains(&status), "{status}");
}

#[tokio::test]
async fn grpc_clients_get_resource_exhausted_with_pushback() {
    let clock = ManualClock::starting_at(1);
    let addr = batch_app(&clock, false).await;
    let grpc = || {
        Request::post("/batch")
            .header("x-api-key", "grpc-client")
            .header("content-type", "application/grpc")
            .header("x-batch-size", "10")
            .body(Bytes::new())
            .unwrap()
    };
    assert_eq!(send(addr, grpc()).await.unwrap().status, 200);
    let r = send(addr, grpc()).await.unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("grpc-status"), "8");
    assert_eq!(r.header("grpc-retry-pushback-ms"), "2000");
    assert!(r.header("grpc-message").contains("exceeded"));
}

#[tokio::test]
async fn shadow_mode_never_blocks() {
    let clock = ManualClock::starting_at(1);
    let addr = batch_app(&clock, true).await;
    for i in 0..40 {
        let req = Request::post("/batch")
            .header("x-api-key", "shadowed")
            .header("x-batch-size", "5")
            .body(Bytes::new())
            .unwrap();
        let r = send(addr, req).await.unwrap();
        assert_eq!(r.status, 200, "request {i}");
        // No headers that would make the client back off from a limit
        // that is not enforced.
        assert!(r.headers.get("ratelimit").is_none(), "{r:?}");
        assert!(r.headers.get("retry-after").is_none(), "{r:?}");
    }
    clock.advance(Duration::from_secs(2));
}
