//! Envoy's rate limit service (`ShouldRateLimit`) of `tollgate-server`,
//! through a gRPC client built from the RLS protos: descriptors matched
//! as Envoy's ratelimit service documents, `hits_addend` charged,
//! `shadow_mode`, `unlimited` and `replaces`, the statuses' numbers and
//! the `RateLimit` fields to add.
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::panic,
    clippy::arithmetic_side_effects,
    clippy::indexing_slicing
)]

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tollgate::core::ManualClock;
use tollgate::MemoryStore;

const EDGE: &str = r#"
domain: edge
descriptors:
  # Each client address its own counter: 2 an hour.
  - key: remote_address
    rate_limit: { unit: hour, requests_per_unit: 2 }
  # One path exactly, and every path under /api/ (prefix).
  - key: path
    value: /api/reports
    rate_limit: { unit: hour, requests_per_unit: 1, name: reports }
  - key: path
    value: /api/*
    rate_limit: { unit: hour, requests_per_unit: 3, name: api }
  # Counted, never refused.
  - key: canary
    shadow_mode: true
    rate_limit: { unit: hour, requests_per_unit: 1, name: canary }
  - key: internal
    rate_limit: { unlimited: true }
  # Nested: per user within a tenant, with tollgate's extras.
  - key: tenant
    value: acme
    descriptors:
      - key: user
        rate_limit: { unit: hour, requests_per_unit: 2, algorithm: gcra, burst: 2, name: acme-user }
  # A plan's own limit replaces the generic one when both apply.
  - key: plan
    value: gold
    rate_limit: { unit: hour, requests_per_unit: 5, name: gold, replaces: [{ name: generic }] }
  - key: client
    rate_limit: { unit: hour, requests_per_unit: 1, name: generic }
"#;

async fn server() -> RateLimitServiceClient<tonic::transport::Channel> {
    let dir = std::env::temp_dir().join(format!(
        "tollgate-rls-{}-{}",
        std::process::id(),
        rand_suffix()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("edge.yaml");
    std::fs::write(&path, EDGE).unwrap();
    // Fixed windows of an hour from a whole hour: none ends in the test.
    let store = MemoryStore::with_clock(ManualClock::starting_at(1_796_472_000_000_000_000));
    let domains = tollgate_server::envoy::Domains::load(&[path], &store).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(tollgate_server::rls::serve(
        listener,
        tollgate_server::rls::Rls::new(domains),
    ));
    let _ = std::fs::remove_dir_all(&dir);
    for _ in 0..50 {
        if let Ok(c) = RateLimitServiceClient::connect(format!("http://{addr}")).await {
            return c;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("the rate limit service did not start");
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u8(0);
    h.finish()
}

fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: (*k).to_owned(),
                value: (*v).to_owned(),
            })
            .collect(),
        ..RateLimitDescriptor::default()
    }
}

async fn ask(
    c: &mut RateLimitServiceClient<tonic::transport::Channel>,
    hits: u32,
    descriptors: Vec<RateLimitDescriptor>,
) -> RateLimitResponse {
    c.should_rate_limit(RateLimitRequest {
        domain: "edge".to_owned(),
        descriptors,
        hits_addend: hits,
    })
    .await
    .unwrap()
    .into_inner()
}

fn code(r: &RateLimitResponse) -> Code {
    Code::try_from(r.overall_code).unwrap()
}

#[tokio::test]
async fn descriptors_are_matched_and_limited_as_envoys_service_does() {
    let mut c = server().await;
    let ip = |v: &str| descriptor(&[("remote_address", v)]);
    // Each address its own counter of 2.
    for _ in 0..2 {
        assert_eq!(code(&ask(&mut c, 0, vec![ip("10.0.0.1")]).await), Code::Ok);
    }
    let r = ask(&mut c, 0, vec![ip("10.0.0.1")]).await;
    assert_eq!(code(&r), Code::OverLimit);
    let s = &r.statuses[0];
    assert_eq!(Code::try_from(s.code).unwrap(), Code::OverLimit);
    let limit = s.current_limit.as_ref().unwrap();
    assert_eq!((limit.requests_per_unit, limit.unit), (2, 3), "2 an hour");
    assert_eq!(s.limit_remaining, 0);
    assert!(s.duration_until_reset.as_ref().unwrap().seconds > 0);
    let header = |r: &RateLimitResponse, k: &str| {
        r.response_headers_to_add
            .iter()
            .find(|h| h.key == k)
            .map(|h| h.value.clone())
            .unwrap_or_default()
    };
    assert!(
        header(&r, "RateLimit-Policy").contains(";q=2;w=3600"),
        "{r:?}"
    );
    assert!(header(&r, "RateLimit").contains(";r=0;"), "{r:?}");
    assert_eq!(code(&ask(&mut c, 0, vec![ip("10.0.0.2")]).await), Code::Ok);
    // hits_addend is the cost: the request's, or the descriptor's own.
    assert_eq!(code(&ask(&mut c, 2, vec![ip("10.0.0.3")]).await), Code::Ok);
    assert_eq!(
        code(&ask(&mut c, 1, vec![ip("10.0.0.3")]).await),
        Code::OverLimit
    );
    // An exact value before a prefix; a prefix for the rest of /api/.
    let path = |v: &str| descriptor(&[("path", v)]);
    assert_eq!(
        code(&ask(&mut c, 0, vec![path("/api/reports")]).await),
        Code::Ok
    );
    let r = ask(&mut c, 0, vec![path("/api/reports")]).await;
    assert_eq!(code(&r), Code::OverLimit);
    assert_eq!(
        r.statuses[0].current_limit.as_ref().unwrap().name,
        "reports"
    );
    let r = ask(&mut c, 0, vec![path("/api/orders")]).await;
    assert_eq!(r.statuses[0].current_limit.as_ref().unwrap().name, "api");
    // No node matches: no limit, OK.
    let r = ask(
        &mut c,
        0,
        vec![path("/public"), descriptor(&[("nothing", "x")])],
    )
    .await;
    assert_eq!(code(&r), Code::Ok);
    assert!(r.statuses.iter().all(|s| s.current_limit.is_none()));
}

#[tokio::test]
async fn shadow_unlimited_nested_and_replaced_limits() {
    let mut c = server().await;
    // Shadow: counted (its remaining falls), never refused.
    for left in [0, 0, 0] {
        let r = ask(&mut c, 0, vec![descriptor(&[("canary", "a")])]).await;
        assert_eq!(code(&r), Code::Ok);
        assert_eq!(r.statuses[0].limit_remaining, left);
    }
    // Unlimited: always OK.
    for _ in 0..5 {
        let r = ask(&mut c, 0, vec![descriptor(&[("internal", "x")])]).await;
        assert_eq!(code(&r), Code::Ok);
    }
    // Nested: the user's node under its tenant; another tenant has none.
    let user = |t: &str, u: &str| descriptor(&[("tenant", t), ("user", u)]);
    for _ in 0..2 {
        assert_eq!(
            code(&ask(&mut c, 0, vec![user("acme", "ann")]).await),
            Code::Ok
        );
    }
    assert_eq!(
        code(&ask(&mut c, 0, vec![user("acme", "ann")]).await),
        Code::OverLimit
    );
    assert_eq!(
        code(&ask(&mut c, 0, vec![user("acme", "bob")]).await),
        Code::Ok
    );
    let r = ask(&mut c, 0, vec![user("other", "ann")]).await;
    assert!(r.statuses[0].current_limit.is_none());
    // `replaces`: a gold plan's request skips the generic limit of 1.
    let both = || {
        vec![
            descriptor(&[("plan", "gold")]),
            descriptor(&[("client", "c1")]),
        ]
    };
    for _ in 0..3 {
        let r = ask(&mut c, 0, both()).await;
        assert_eq!(code(&r), Code::Ok, "{r:?}");
        assert!(r.statuses[1].current_limit.is_none(), "replaced");
    }
    // Alone, the generic limit applies.
    assert_eq!(
        code(&ask(&mut c, 0, vec![descriptor(&[("client", "c2")])]).await),
        Code::Ok
    );
    assert_eq!(
        code(&ask(&mut c, 0, vec![descriptor(&[("client", "c2")])]).await),
        Code::OverLimit
    );
}

#[tokio::test]
async fn a_refused_request_costs_its_other_descriptors_nothing() {
    let mut c = server().await;
    let ip = descriptor(&[("remote_address", "10.9.9.9")]);
    let reports = descriptor(&[("path", "/api/reports")]);
    // The path's single unit goes; then both together are refused by the
    // path, and the address's count is given back each time.
    assert_eq!(code(&ask(&mut c, 0, vec![reports.clone()]).await), Code::Ok);
    for _ in 0..3 {
        let r = ask(&mut c, 0, vec![ip.clone(), reports.clone()]).await;
        assert_eq!(code(&r), Code::OverLimit);
    }
    let r = ask(&mut c, 0, vec![ip.clone()]).await;
    assert_eq!(code(&r), Code::Ok);
    assert_eq!(r.statuses[0].limit_remaining, 1, "{r:?}");
}

/// Leases decide each descriptor on its own (`HotKeys` has no one-step
/// joint): what a refused request's other descriptors took goes back all
/// the same.
#[tokio::test]
async fn a_refused_request_costs_nothing_through_leases_either() {
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
    let dir = std::env::temp_dir().join(format!("tollgate-rls-hot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("edge.yaml");
    std::fs::write(&path, EDGE).unwrap();
    let clock = ManualClock::starting_at(1_796_472_000_000_000_000);
    let store = tollgate_redis::HotKeys::new()
        .over_with_clock(MemoryStore::with_clock(clock.clone()), clock)
        .unwrap();
    let rls = tollgate_server::rls::Rls::new(
        tollgate_server::envoy::Domains::load(&[path], &store).unwrap(),
    );
    let _ = std::fs::remove_dir_all(&dir);
    let ask = |descriptors: Vec<RateLimitDescriptor>| {
        let rls = rls.clone();
        async move {
            let req = RateLimitRequest {
                domain: "edge".to_owned(),
                descriptors,
                hits_addend: 0,
            };
            let r = rls.should_rate_limit(tonic::Request::new(req)).await;
            code(&r.unwrap().into_inner())
        }
    };
    let ip = descriptor(&[("remote_address", "10.9.9.9")]);
    let reports = descriptor(&[("path", "/api/reports")]);
    assert_eq!(ask(vec![reports.clone()]).await, Code::Ok);
    for _ in 0..3 {
        assert_eq!(
            ask(vec![ip.clone(), reports.clone()]).await,
            Code::OverLimit
        );
    }
    // The address's two an hour are whole.
    assert_eq!(ask(vec![ip.clone()]).await, Code::Ok);
    assert_eq!(ask(vec![ip.clone()]).await, Code::Ok);
    assert_eq!(ask(vec![ip.clone()]).await, Code::OverLimit);
}

/// Review of the service: names are free text (stored by the node's
/// place), an empty value is no value, an unlimited status says so, a
/// refused descriptor has nothing left, and values cannot pass for
/// others in the counters' keys.
#[tokio::test]
async fn names_values_and_statuses_as_envoys_service_gives_them() {
    let dir = std::env::temp_dir().join(format!("tollgate-rls-names-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("d.yaml");
    std::fs::write(
        &path,
        "domain: api.v1\ndescriptors:\n  - key: user\n    value: \"\"\n    rate_limit: { unit: hour, requests_per_unit: 3, name: \"per user \\\"quoted\\\"\" }\n  - key: tenant\n    descriptors:\n      - key: user\n        rate_limit: { unit: hour, requests_per_unit: 1, name: \"per user \\\"quoted\\\"\" }\n",
    )
    .unwrap();
    let store = MemoryStore::with_clock(ManualClock::starting_at(1_796_472_000_000_000_000));
    let domains = tollgate_server::envoy::Domains::load(&[path], &store).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    // Two nodes of one name are two limits; an empty value is any value.
    let a = domains.matched("api.v1", &[("user", "ann")]).unwrap();
    assert_eq!(a.bound.requests_per_unit, 3);
    let b = domains
        .matched("api.v1", &[("tenant", "t"), ("user", "ann")])
        .unwrap();
    assert_eq!(b.bound.requests_per_unit, 1);
    // No value can pass for two.
    let x = domains
        .matched(
            "api.v1",
            &[("tenant", "x\0\0\0\x04user\0\0\0\x01y"), ("user", "z")],
        )
        .unwrap();
    let y = domains.matched(
        "api.v1",
        &[("tenant", "x"), ("user", "y\0\0\0\x04user\0\0\0\x01z")],
    );
    assert!(y.is_none() || y.unwrap().key != x.key);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(tollgate_server::rls::serve(
        listener,
        tollgate_server::rls::Rls::new(domains),
    ));
    let mut c = loop {
        if let Ok(c) = RateLimitServiceClient::connect(format!("http://{addr}")).await {
            break c;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    let ask_d = |d: Vec<RateLimitDescriptor>, hits: u32| RateLimitRequest {
        domain: "api.v1".to_owned(),
        descriptors: d,
        hits_addend: hits,
    };
    // Over the limit: nothing left, whatever the cost asked.
    let r = c
        .should_rate_limit(ask_d(vec![descriptor(&[("user", "bo")])], 2))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.statuses[0].limit_remaining, 1);
    let r = c
        .should_rate_limit(ask_d(vec![descriptor(&[("user", "bo")])], 2))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(code(&r), Code::OverLimit);
    assert_eq!(r.statuses[0].limit_remaining, 0);
    // The name, escaped, in the fields.
    let policy = &r
        .response_headers_to_add
        .iter()
        .find(|h| h.key == "RateLimit-Policy")
        .unwrap()
        .value;
    assert!(
        policy.starts_with("\"per user \\\"quoted\\\"\";q=3"),
        "{policy}"
    );
}

#[tokio::test]
async fn an_unlimited_descriptor_says_so() {
    let mut c = server().await;
    let r = ask(&mut c, 0, vec![descriptor(&[("internal", "x")])]).await;
    assert_eq!(r.statuses[0].limit_remaining, u32::MAX);
}

#[test]
fn a_bad_configuration_names_its_file_and_descriptor() {
    let dir = std::env::temp_dir().join(format!("tollgate-rls-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let load = |yaml: &str| {
        let path = dir.join("bad.yaml");
        std::fs::write(&path, yaml).unwrap();
        tollgate_server::envoy::Domains::load(&[path], &MemoryStore::new())
            .unwrap_err()
            .to_string()
    };
    let e = load("domain: d\ndescriptors:\n  - key: a\n    descriptors:\n      - key: b\n        rate_limit: { unit: fortnight, requests_per_unit: 1 }\n");
    assert!(e.ends_with("descriptors[0].descriptors[0].rate_limit.unit: \"fortnight\" is not a unit: second, minute, hour, day, week, month or year"), "{e}");
    let e = load("domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: second, requests_per_unit: 0 }\n");
    assert!(
        e.contains("descriptors[0].rate_limit.requests_per_unit: must be at least 1"),
        "{e}"
    );
    let e = load("domain: d\ndescriptors:\n  - key: a\n    ratelimit: {}\n");
    assert!(e.contains("unknown field `ratelimit`"), "{e}");
    let e = load("domain: d\ndescriptors:\n  - key: a\n  - key: a\n");
    assert!(
        e.contains("descriptors[1]: another descriptor at this level has the same key and value"),
        "{e}"
    );
    let e = load("domain: d\ndescriptors:\n  - key: a\n    value: \"a*b\"\n");
    assert!(e.contains("a '*' may only end a value"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The example configuration loads as the README shows it.
#[test]
fn the_example_configuration_loads() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/envoy/ratelimit.yaml");
    let domains = tollgate_server::envoy::Domains::load(&[path], &MemoryStore::new()).unwrap();
    let addr = domains
        .matched("edge", &[("remote_address", "10.0.0.1")])
        .unwrap();
    assert_eq!(addr.bound.requests_per_unit, 10);
    let reports = domains
        .matched("edge", &[("header_match", "reports"), ("client_id", "c1")])
        .unwrap();
    assert_eq!(
        (reports.bound.requests_per_unit, reports.bound.window_secs),
        (5, 60)
    );
    assert!(domains
        .matched("edge", &[("header_match", "other"), ("client_id", "c1")])
        .is_none());
}

/// The configuration files reload when they change (two reads that
/// agree) and on SIGHUP; a set that does not load leaves the running one.
#[tokio::test(start_paused = true)]
async fn a_changed_configuration_applies_and_a_bad_one_is_refused() {
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
    let dir = std::env::temp_dir().join(format!("tollgate-rls-watch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("w.yaml");
    let config = |n: u32| {
        format!("domain: w\ndescriptors:\n  - key: k\n    rate_limit: {{ unit: hour, requests_per_unit: {n} }}\n")
    };
    std::fs::write(&path, config(1)).unwrap();
    let store = MemoryStore::with_clock(ManualClock::starting_at(1_796_472_000_000_000_000));
    let rls = tollgate_server::rls::Rls::new(
        tollgate_server::envoy::Domains::load(std::slice::from_ref(&path), &store).unwrap(),
    );
    let _watch = tollgate_server::rls::watch(
        vec![path.clone()],
        store,
        rls.clone(),
        std::time::Duration::from_secs(1),
    );
    let ask = || async {
        let req = RateLimitRequest {
            domain: "w".to_owned(),
            descriptors: vec![descriptor(&[("k", "v")])],
            hits_addend: 0,
        };
        let r = rls
            .should_rate_limit(tonic::Request::new(req))
            .await
            .unwrap();
        Code::try_from(r.into_inner().overall_code).unwrap()
    };
    assert_eq!(ask().await, Code::Ok);
    assert_eq!(ask().await, Code::OverLimit);
    // Three an hour: applied within two reads, the key's count going on.
    std::fs::write(&path, config(3)).unwrap();
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    assert_eq!(ask().await, Code::Ok);
    assert_eq!(ask().await, Code::Ok);
    assert_eq!(ask().await, Code::OverLimit);
    // A file that does not load: refused, the three an hour stay.
    std::fs::write(&path, "domain: w\ndescriptors:\n  - key: k\n    rate_limit: { unit: fortnight, requests_per_unit: 9 }\n").unwrap();
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    assert_eq!(ask().await, Code::OverLimit);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 33: a reload that changes `[store]` moves the decision endpoints
/// and Envoy's rate limit service together: both count on the new store
/// from what it holds (here, nothing), where the Envoy descriptors stayed
/// on the store the server started with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_store_moves_the_envoy_service_with_the_endpoints() {
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
    use tower::ServiceExt;
    let Some(redis) = tollgate_redis::testing::Server::start() else {
        return;
    };
    let dir = std::env::temp_dir().join(format!(
        "tollgate-rls-store-{}-{}",
        std::process::id(),
        rand_suffix()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let envoy = dir.join("e.yaml");
    std::fs::write(
        &envoy,
        "domain: e\ndescriptors:\n  - key: k\n    rate_limit: { unit: hour, requests_per_unit: 1 }\n",
    )
    .unwrap();
    let policy = dir.join("policy.toml");
    let base = format!(
        "[server]\nenvoy = [{:?}]\n\n[[rules]]\nname = \"per-key\"\nkey = \"header:x-api-key\"\nrate = \"1/h\"\nburst = 1\n",
        envoy.display().to_string()
    );
    std::fs::write(&policy, &base).unwrap();
    let loaded = tollgate_server::Loaded::load(&policy).unwrap();
    let rls = loaded.envoy.as_ref().unwrap().rls();
    let app = tollgate_server::decisions(loaded.gate.clone());
    let ask = || async {
        let req = RateLimitRequest {
            domain: "e".to_owned(),
            descriptors: vec![descriptor(&[("k", "v")])],
            hits_addend: 0,
        };
        let r = rls
            .should_rate_limit(tonic::Request::new(req))
            .await
            .unwrap();
        Code::try_from(r.into_inner().overall_code).unwrap()
    };
    let check = || async {
        let req = http::Request::get("/check")
            .header("x-forwarded-method", "GET")
            .header("x-forwarded-uri", "/")
            .header("x-api-key", "a")
            .extension(axum::extract::ConnectInfo(
                "127.0.0.1:9".parse::<std::net::SocketAddr>().unwrap(),
            ))
            .body(axum::body::Body::empty())
            .unwrap();
        app.clone().oneshot(req).await.unwrap().status().as_u16()
    };
    // On the in-memory store: one each, then refused.
    assert_eq!((ask().await, check().await), (Code::Ok, 200));
    assert_eq!((ask().await, check().await), (Code::OverLimit, 429));
    // To Redis: both start afresh there, and count there.
    std::fs::write(
        &policy,
        format!(
            "{base}\n[store]\nkind = \"redis\"\nurl = {:?}\nprefix = \"tg-moved-{}\"\n",
            redis.url(),
            rand_suffix()
        ),
    )
    .unwrap();
    assert_eq!(
        loaded.reloader.reload().unwrap(),
        tollgate::config::Reloaded::Applied
    );
    assert!(format!("{:?}", loaded.store()).contains("Redis"));
    assert_eq!((ask().await, check().await), (Code::Ok, 200));
    assert_eq!((ask().await, check().await), (Code::OverLimit, 429));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Review: a `[store]` the running Envoy configuration cannot be bound on
/// (Redis holds spans up to about 26 days; a month's window is longer)
/// refuses the reload, naming the store, before anything moved: the
/// endpoints and the Envoy service stay together on the old store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_the_envoy_service_cannot_move_to_refuses_the_reload() {
    let Some(redis) = tollgate_redis::testing::Server::start() else {
        return;
    };
    let dir = std::env::temp_dir().join(format!(
        "tollgate-rls-refuse-{}-{}",
        std::process::id(),
        rand_suffix()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let envoy = dir.join("e.yaml");
    std::fs::write(
        &envoy,
        "domain: e\ndescriptors:\n  - key: k\n    rate_limit: { unit: month, requests_per_unit: 1 }\n",
    )
    .unwrap();
    let policy = dir.join("policy.toml");
    let base = format!(
        "[server]\nenvoy = [{:?}]\n\n[[rules]]\nname = \"per-key\"\nkey = \"header:x-api-key\"\nrate = \"1/h\"\nburst = 1\n",
        envoy.display().to_string()
    );
    std::fs::write(&policy, &base).unwrap();
    let loaded = tollgate_server::Loaded::load(&policy).unwrap();
    std::fs::write(
        &policy,
        format!(
            "{base}\n[store]\nkind = \"redis\"\nurl = {:?}\nprefix = \"tg-refused-{}\"\n",
            redis.url(),
            rand_suffix()
        ),
    )
    .unwrap();
    let e = loaded.reloader.reload().unwrap_err().to_string();
    assert!(e.contains("store"), "{e}");
    assert!(e.contains("Envoy rate limit configuration"), "{e}");
    assert!(format!("{:?}", loaded.store()).contains("Memory"));
    let _ = std::fs::remove_dir_all(&dir);
}
