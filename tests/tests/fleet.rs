//! Two quickstart servers sharing one Redis enforce one combined budget per
//! client key, through real HTTP.
#![allow(missing_docs, clippy::unwrap_used, clippy::arithmetic_side_effects)]

mod common;

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use tollgate::core::ManualClock;
use tollgate::RedisStore;
use tollgate_redis::testing::{unique_prefix, Server};
use tollgate_tests::send;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_quickstarts_on_one_redis_share_each_clients_budget() {
    let Some(redis) = Server::start() else { return };
    // Both instances read one manual clock, so the test is exact.
    let clock = ManualClock::starting_at(1_000_000_000_000_000);
    let prefix = unique_prefix();
    let instance = || {
        let store = RedisStore::builder(&redis.url())
            .prefix(&prefix)
            .client_time(clock.clone())
            .timeout(Duration::from_secs(2))
            .build()
            .unwrap();
        tollgate_examples::quickstart_app(store, &[]).unwrap()
    };
    let (a, b) = (
        common::spawn(instance()).await,
        common::spawn(instance()).await,
    );
    let hello = |key: &str| {
        Request::get("/api/hello")
            .header("x-api-key", key)
            .body(Bytes::new())
            .unwrap()
    };
    // Twenty requests, alternating between the two instances...
    for i in 0..20 {
        let server = if i % 2 == 0 { a } else { b };
        let r = send(server, hello("shared")).await.unwrap();
        assert_eq!(r.status, 200, "request {i}");
    }
    // ...spend the one budget: both instances now refuse this client.
    for server in [a, b] {
        let r = send(server, hello("shared")).await.unwrap();
        assert_eq!(r.status, 429);
        assert_eq!(r.header("retry-after"), "1");
    }
    // Another client is unaffected; a report from it costs 10 on both.
    let r = send(
        a,
        Request::post("/api/reports")
            .header("x-api-key", "other")
            .body(Bytes::new())
            .unwrap(),
    )
    .await
    .unwrap();
    assert!(r.header("ratelimit").contains("r=10;"), "{r:?}");
    let r = send(b, hello("other")).await.unwrap();
    assert!(r.header("ratelimit").contains("r=9;"), "{r:?}");
    // Time passes for the whole fleet at once.
    clock.advance(Duration::from_millis(100));
    assert_eq!(send(b, hello("shared")).await.unwrap().status, 200);
    assert_eq!(send(a, hello("shared")).await.unwrap().status, 429);
}
