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

/// Issue 32: one policy file names the store too. Two instances loaded
/// from it (`Tollgate::from_file`, `[store] kind = "redis"`, the URL
/// from the environment) share each limit — a quota and an in-flight
/// limit here — and a reload of the file applies on both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_from_one_file_share_its_redis_limits() {
    let Some(redis) = Server::start() else { return };
    let var = format!("TOLLGATE_TEST_REDIS_URL_{}", std::process::id());
    std::env::set_var(&var, redis.url());
    let dir = std::env::temp_dir().join(format!("tollgate-fleet-file-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("policy.toml");
    let policy = |day: u32| {
        format!(
            r#"
[store]
kind = "redis"
url_env = "{var}"
prefix = "{prefix}"
failure_policy = "closed"
timeout = "2s"

[[rules]]
name = "rate"
key = "header:x-api-key"
rate = "1000/s"
burst = 1000

[[quotas]]
name = "daily"
key = "header:x-api-key"
limits = {{ day = {day} }}
"#,
            prefix = "file-fleet"
        )
    };
    std::fs::write(&path, policy(4)).unwrap();
    let (gate_a, reload_a) = tollgate::config::Tollgate::from_file(&path).unwrap();
    let (gate_b, reload_b) = tollgate::config::Tollgate::from_file(&path).unwrap();
    let app = |gate| {
        axum::Router::new()
            .route("/api/hello", axum::routing::get(|| async { "hi" }))
            .route_layer(gate)
    };
    let (a, b) = (
        common::spawn(app(gate_a)).await,
        common::spawn(app(gate_b)).await,
    );
    let hello = || {
        Request::get("/api/hello")
            .header("x-api-key", unique_prefix())
            .body(Bytes::new())
            .unwrap()
    };
    let key = unique_prefix();
    let same = || {
        Request::get("/api/hello")
            .header("x-api-key", key.as_str())
            .body(Bytes::new())
            .unwrap()
    };
    // Four a day, alternating instances: the fifth is refused on both.
    for i in 0..4 {
        let r = send(if i % 2 == 0 { a } else { b }, same()).await.unwrap();
        assert_eq!(r.status, 200, "request {i}");
    }
    for server in [a, b] {
        assert_eq!(send(server, same()).await.unwrap().status, 429);
    }
    assert_eq!(send(a, hello()).await.unwrap().status, 200);
    // Six a day from now, on both: two more.
    std::fs::write(&path, policy(6)).unwrap();
    for r in [&reload_a, &reload_b] {
        assert_eq!(r.reload().unwrap(), tollgate::config::Reloaded::Applied);
    }
    assert_eq!(send(a, same()).await.unwrap().status, 200);
    assert_eq!(send(b, same()).await.unwrap().status, 200);
    assert_eq!(send(a, same()).await.unwrap().status, 429);
    std::fs::remove_dir_all(&dir).unwrap();
}
