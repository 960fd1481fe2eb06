//! Policies as contract tables: given these rules and this sequence of
//! requests, these answers and headers — the same on the in-memory store,
//! Redis and Redis Cluster (each on one manual clock, so exact).
#![allow(missing_docs, clippy::unwrap_used, clippy::arithmetic_side_effects)]

use std::convert::Infallible;
use std::time::Duration;

use http::{Request, Response};
use tollgate::core::{Limiter, ManualClock, Store};
use tollgate::cost::HeaderCost;
use tollgate::key::{Global, Header};
use tollgate::policy::{PolicyLayer, RateRule};
use tollgate::{Limit, MemoryStore, Rate, RedisStore};
use tollgate_redis::testing::{unique_prefix, Cluster, Server};
use tower::{service_fn, Layer, ServiceExt};

/// One request and what must come back.
struct Row {
    key: &'static str,
    ip: &'static str,
    cost: u64,
    /// Advance the clock by this many ms first.
    after_ms: u64,
    status: u16,
    ratelimit: &'static str,
    retry_after: Option<&'static str>,
}

const fn row(
    key: &'static str,
    ip: &'static str,
    cost: u64,
    after_ms: u64,
    status: u16,
    ratelimit: &'static str,
    retry_after: Option<&'static str>,
) -> Row {
    Row {
        key,
        ip,
        cost,
        after_ms,
        status,
        ratelimit,
        retry_after,
    }
}

const POLICY: &str = "\"per-key\";q=10;w=60, \"per-ip\";q=3;w=60, \"global\";q=20;w=2";

/// per-key: 10 a minute (fixed window); per-ip: 3 a minute (sliding log);
/// global: 10/s with bursts of 20 (GCRA). Costs from `x-cost`.
const TABLE: &[Row] = &[
    row(
        "a",
        "1.1.1.1",
        1,
        0,
        200,
        "\"per-key\";r=9;t=60, \"per-ip\";r=2;t=60, \"global\";r=19;t=1",
        None,
    ),
    row(
        "b",
        "1.1.1.1",
        1,
        0,
        200,
        "\"per-key\";r=9;t=60, \"per-ip\";r=1;t=60, \"global\";r=18;t=1",
        None,
    ),
    // A cost of 2 does not fit the address's last unit: refused, and the
    // key and global rules give their 2 back.
    row(
        "c",
        "1.1.1.1",
        2,
        0,
        429,
        "\"per-key\";r=10;t=0, \"per-ip\";r=1;t=60, \"global\";r=18;t=1",
        Some("60"),
    ),
    row(
        "c",
        "1.1.1.1",
        1,
        0,
        200,
        "\"per-key\";r=9;t=60, \"per-ip\";r=0;t=60, \"global\";r=17;t=1",
        None,
    ),
    // Another address: 8 can never fit its 3 a minute, so no Retry-After;
    // the key and global rules are refunded. (A refunded rule's t is the
    // one it answered before its refund: an upper bound, here 1.1 s
    // rounded up where 0.3 s would be exact.)
    row(
        "a",
        "2.2.2.2",
        8,
        0,
        429,
        "\"per-key\";r=9;t=60, \"per-ip\";r=3;t=0, \"global\";r=17;t=2",
        None,
    ),
    row(
        "a",
        "2.2.2.2",
        3,
        0,
        200,
        "\"per-key\";r=6;t=60, \"per-ip\";r=0;t=60, \"global\";r=14;t=1",
        None,
    ),
    // A cost above the global burst can never pass: no Retry-After.
    row(
        "d",
        "3.3.3.3",
        21,
        0,
        429,
        "\"per-key\";r=10;t=0, \"per-ip\";r=3;t=0, \"global\";r=14;t=1",
        None,
    ),
    // The key's window holds across addresses.
    row(
        "a",
        "4.4.4.4",
        3,
        0,
        200,
        "\"per-key\";r=3;t=60, \"per-ip\";r=0;t=60, \"global\";r=11;t=1",
        None,
    ),
    row(
        "a",
        "5.5.5.5",
        3,
        0,
        200,
        "\"per-key\";r=0;t=60, \"per-ip\";r=0;t=60, \"global\";r=8;t=2",
        None,
    ),
    row(
        "a",
        "6.6.6.6",
        1,
        0,
        429,
        "\"per-key\";r=0;t=60, \"per-ip\";r=3;t=0, \"global\";r=8;t=2",
        Some("60"),
    ),
    // A minute later every window has turned.
    row(
        "a",
        "1.1.1.1",
        1,
        60_000,
        200,
        "\"per-key\";r=9;t=60, \"per-ip\";r=2;t=60, \"global\";r=19;t=1",
        None,
    ),
];

/// Runs the table; with `script_calls` (a standalone Redis's count), also
/// checks that each request after the first (which loads the script) is
/// one script call for all three rules: no call per rule, and no refund
/// call after a denial, since the joint decision wrote nothing.
async fn run_table<S: Store>(
    store: S,
    clock: &ManualClock,
    script_calls: Option<&dyn Fn() -> u64>,
) {
    let layer = PolicyLayer::builder()
        .rule(
            RateRule::new(
                "per-key",
                Limit::fixed_window(10, Duration::from_secs(60)),
                Header::named("x-api-key").unwrap(),
            )
            .cost(HeaderCost::named("x-cost", 1, 1_000).unwrap()),
        )
        .rule(
            RateRule::new(
                "per-ip",
                Limit::sliding_window_log(3, Duration::from_secs(60)),
                Header::named("x-ip").unwrap(),
            )
            .cost(HeaderCost::named("x-cost", 1, 1_000).unwrap()),
        )
        .rule(
            RateRule::new("global", Limit::gcra(Rate::per_second(10), 20), Global)
                .cost(HeaderCost::named("x-cost", 1, 1_000).unwrap()),
        )
        .store(store)
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(|_req: Request<String>| async {
        Ok::<_, Infallible>(Response::new(String::new()))
    }));
    for (i, r) in TABLE.iter().enumerate() {
        clock.advance(Duration::from_millis(r.after_ms));
        let req = Request::get("/")
            .header("x-api-key", r.key)
            .header("x-ip", r.ip)
            .header("x-cost", r.cost.to_string())
            .body(String::new())
            .unwrap();
        let before = script_calls.map(|calls| calls());
        let res = svc.clone().oneshot(req).await.unwrap();
        if let (Some(calls), Some(before), true) = (script_calls, before, i > 0) {
            assert_eq!(calls() - before, 1, "row {i}: script calls");
        }
        assert_eq!(res.status(), r.status, "row {i}");
        assert_eq!(res.headers()["ratelimit-policy"], POLICY, "row {i}");
        assert_eq!(res.headers()["ratelimit"], r.ratelimit, "row {i}");
        assert_eq!(
            res.headers()
                .get("retry-after")
                .map(|v| v.to_str().unwrap()),
            r.retry_after,
            "row {i}"
        );
    }
}

#[tokio::test]
async fn memory() {
    let clock = ManualClock::starting_at(60_000_000_000); // a whole minute: windows align
    let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    run_table(store, &clock, None).await;
}

fn redis_store(url: &str, clock: &ManualClock) -> RedisStore {
    redis_store_in(url, clock, &unique_prefix())
}

/// A store on `clock` under `prefix` (two of them share state).
fn redis_store_in(url: &str, clock: &ManualClock, prefix: &str) -> RedisStore {
    RedisStore::builder(url)
        .prefix(prefix)
        .client_time(clock.clone())
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap()
}

#[tokio::test]
async fn redis() {
    let Some(redis) = Server::start() else { return };
    let clock = ManualClock::starting_at(1_796_000_040_000_000_000); // a whole minute
    let calls = || redis.script_calls();
    run_table(redis_store(&redis.url(), &clock), &clock, Some(&calls)).await;
}

/// The same table through an [`AnyStore`](tollgate::AnyStore) holding the
/// Redis store: its decisions, joint steps (the script-call count) and
/// refunds are the Redis store's own.
#[tokio::test]
async fn redis_through_any_store() {
    let Some(redis) = Server::start() else { return };
    let clock = ManualClock::starting_at(1_796_000_040_000_000_000); // a whole minute
    let calls = || redis.script_calls();
    let store = tollgate::AnyStore::from(redis_store(&redis.url(), &clock));
    assert_eq!(store.kind(), "redis");
    run_table(store, &clock, Some(&calls)).await;
}

/// Issue 32/33: `[store.hot_keys]` puts leases in front of Redis for the
/// rules it names, and the store gives back what they hold when asked
/// (a stopping instance).
#[tokio::test]
async fn the_file_s_hot_keys_lease_and_give_back() {
    let Some(redis) = Server::start() else { return };
    let prefix = unique_prefix();
    let file = tollgate::config::PolicyFile::parse(&format!(
        "[[rules]]\nname = \"leased\"\nkey = \"global\"\nrate = \"1/s\"\nburst = 100\n\n[store]\nkind = \"redis\"\nurl = \"{}\"\nprefix = \"{prefix}\"\n\n[store.hot_keys]\nttl = \"10s\"\nmax_batch = 8\nrules = [\"leased\"]\n",
        redis.url()
    ))
    .unwrap();
    let store = file.store().unwrap();
    assert!(store.is_leased());
    assert_eq!(store.kind(), "redis");
    let plain = RedisStore::builder(&redis.url())
        .prefix(&prefix)
        .build()
        .unwrap();
    let rule = |name: &str| {
        tollgate::core::Rule::new(name, Limit::gcra(Rate::per_second(1), 100)).unwrap()
    };
    for name in ["leased", "plain"] {
        let l = store.limiter(&rule(name)).unwrap();
        for _ in 0..8 {
            assert!(l.decide(b"k", 1).await.unwrap().is_allowed());
        }
        // Leased: leases of 1, 2, 4 and 8 units counted; else 8.
        let counted = if name == "leased" { 15 } else { 8 };
        let peek = plain.limiter(&rule(name)).unwrap().decide(b"k", 0).await;
        let left = peek.unwrap().remaining;
        assert!(
            (100 - counted..=100 - counted + 1).contains(&left),
            "{name}: {left}"
        );
    }
    // The 7 units the live lease holds go back.
    let given = store.give_back().await;
    assert_eq!(given, 7);
    let peek = plain
        .limiter(&rule("leased"))
        .unwrap()
        .decide(b"k", 0)
        .await;
    assert!(peek.unwrap().remaining >= 92);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster() {
    let Some(cluster) = Cluster::start() else {
        return;
    };
    let clock = ManualClock::starting_at(1_796_000_040_000_000_000); // a whole minute
    run_table(redis_store(&cluster.url(), &clock), &clock, None).await;
}

/// A policy of one per-key fixed window of `limit` an hour, with
/// idempotency by the same key, over a service that answers 200.
fn idempotent_policy<S: Store>(
    store: S,
    limit: u32,
) -> (
    impl tower::Service<
            Request<String>,
            Response = Response<String>,
            Error = Infallible,
            Future = impl Send,
        > + Clone
        + Send
        + 'static,
    S::Limiter,
) {
    let layer = PolicyLayer::builder()
        .rule(RateRule::new(
            "per-key",
            Limit::fixed_window(limit, Duration::from_secs(3_600)),
            Header::named("x-api-key").unwrap(),
        ))
        .idempotency(
            "idem",
            Header::named("x-api-key").unwrap(),
            Duration::from_secs(60),
        )
        .store(store)
        .build()
        .unwrap();
    let limiter = layer.limiters().into_iter().next().unwrap();
    let svc = layer.layer(service_fn(|_req: Request<String>| async {
        Ok::<_, Infallible>(Response::new(String::new()))
    }));
    (svc, limiter)
}

fn order(key: &str, idem: &str) -> Request<String> {
    Request::post("/orders")
        .header("x-api-key", key)
        .header("idempotency-key", idem)
        .body(String::new())
        .unwrap()
}

/// 64 copies of one request with one `Idempotency-Key`, raced from 64
/// tasks on several threads: charged once.
async fn idempotent_duplicates_race<S: Store>(store: S) {
    let (svc, limiter) = idempotent_policy(store, 100);
    let tasks: Vec<_> = (0..64)
        .map(|_| tokio::spawn(svc.clone().oneshot(order("racer", "order-77"))))
        .collect();
    for t in tasks {
        assert_eq!(t.await.unwrap().unwrap().status(), 200);
    }
    // The key's budget moved by one.
    let mut key = tollgate::key::KeyBuf::new();
    tollgate::key::KeyExtractor::extract(
        &Header::named("x-api-key").unwrap(),
        &order("racer", "order-77"),
        &mut key,
    )
    .unwrap();
    // A duplicate that lost the race for the marker refunds what it was
    // charged on a task of its own (on Redis, a script call that may land
    // after the responses): wait for it, boundedly.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let d = tollgate::core::Limiter::decide(&limiter, key.as_bytes(), 0)
            .await
            .unwrap();
        if d.remaining == 99 || tokio::time::Instant::now() > deadline {
            assert_eq!(d.remaining, 99);
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idempotent_duplicates_race_in_memory() {
    idempotent_duplicates_race(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idempotent_duplicates_race_on_redis() {
    let Some(redis) = Server::start() else { return };
    let clock = ManualClock::starting_at(1_796_000_040_000_000_000);
    idempotent_duplicates_race(redis_store(&redis.url(), &clock)).await;
}

/// 64 copies of a request whose key is over its limit, raced: every one
/// refused — a refused first request leaves no marker for its duplicates
/// to pass on uncharged.
async fn refused_duplicates_race<S: Store>(store: S) {
    let (svc, _) = idempotent_policy(store, 1);
    assert_eq!(
        svc.clone()
            .oneshot(order("spent", "first"))
            .await
            .unwrap()
            .status(),
        200
    );
    let tasks: Vec<_> = (0..64)
        .map(|_| tokio::spawn(svc.clone().oneshot(order("spent", "second"))))
        .collect();
    for t in tasks {
        assert_eq!(t.await.unwrap().unwrap().status(), 429);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refused_duplicates_race_in_memory() {
    refused_duplicates_race(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refused_duplicates_race_on_redis() {
    let Some(redis) = Server::start() else { return };
    let clock = ManualClock::starting_at(1_796_000_040_000_000_000);
    refused_duplicates_race(redis_store(&redis.url(), &clock)).await;
}

/// Refusals of an audited rule land in a Redis stream, never the raw
/// key; a dead Redis delays nothing and the lost records are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_of_audited_rules_land_in_a_redis_stream() {
    let Some(mut redis) = Server::start() else {
        return;
    };
    let prefix = unique_prefix();
    let store = RedisStore::builder(&redis.url())
        .prefix(&prefix)
        .timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let audit = store.audit_stream("audit", 1_000, 4).unwrap();
    let layer = PolicyLayer::builder()
        .rule(RateRule::new(
            "per-key",
            Limit::fixed_window(1, Duration::from_secs(3_600)),
            Header::named("x-api-key").unwrap(),
        ))
        .rule(RateRule::new(
            "global",
            Limit::fixed_window(1_000_000, Duration::from_secs(3_600)),
            tollgate::key::Global,
        ))
        .audit(audit.clone(), &["per-key"])
        .store(MemoryStore::new())
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(|_req: Request<String>| async {
        Ok::<_, Infallible>(Response::new(String::new()))
    }));
    let req = |key: &str| {
        Request::get("/")
            .header("x-api-key", key)
            .body(String::new())
            .unwrap()
    };
    // Two clients refused (a client's repeats within a second are folded
    // into its one record).
    for key in ["the-raw-key", "another-raw-key"] {
        assert_eq!(svc.clone().oneshot(req(key)).await.unwrap().status(), 200);
        assert_eq!(svc.clone().oneshot(req(key)).await.unwrap().status(), 429);
    }
    let stream = format!("{prefix}:audit");
    assert_eq!(stream_len(&redis, &stream, 2).await, 2);
    let entries = redis.cli(&["XRANGE", &stream, "-", "+"]);
    assert!(
        entries.contains("per-key") && entries.contains("limited"),
        "{entries}"
    );
    assert!(
        !entries.contains("the-raw-key"),
        "a raw key in the audit: {entries}"
    );
    // Redis dies: requests are still answered (a record is queued, never
    // waited for), and what cannot be written is counted as dropped.
    redis.kill();
    for i in 0..50 {
        let key = format!("client-{i}");
        assert_eq!(svc.clone().oneshot(req(&key)).await.unwrap().status(), 200);
        assert_eq!(svc.clone().oneshot(req(&key)).await.unwrap().status(), 429);
    }
    for _ in 0..200 {
        if audit.dropped() >= 46 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(audit.dropped() >= 46, "{} dropped", audit.dropped());
}

/// The length of Redis stream `stream` once it is `want` (waiting up to
/// 2 s for an audit sink's batches), or as it is then.
async fn stream_len(redis: &Server, stream: &str, want: usize) -> usize {
    let mut len = 0;
    for _ in 0..100 {
        len = redis.cli(&["XLEN", stream]).trim().parse().unwrap_or(0);
        if len == want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    len
}

/// Asking a store for the same audit stream again (a reloaded policy
/// does) gives the sink already running: one queue, one task, one count
/// of what was dropped, not a new one per reload.
#[tokio::test]
async fn the_same_audit_stream_asked_again_is_the_same_sink() {
    let Some(redis) = Server::start() else {
        return;
    };
    let store = RedisStore::builder(&redis.url())
        .prefix(&unique_prefix())
        .build()
        .unwrap();
    let first = store.audit_stream("audit", 100, 1).unwrap();
    // The queue holds one record; its task has not run yet (nothing here
    // yields), so the next two are dropped.
    let record = || vec![("rule", "r".to_owned())];
    assert!(first.record(record()));
    assert!(!first.record(record()));
    assert!(!first.record(record()));
    let again = store.audit_stream("audit", 100, 1).unwrap();
    assert_eq!(
        again.dropped(),
        2,
        "a new queue and task for the same stream"
    );
    assert!(!again.record(record()), "the same queue, still full");
    // Another stream, or the same with other bounds, is its own.
    assert_eq!(store.audit_stream("audit", 100, 2).unwrap().dropped(), 0);
    assert_eq!(store.audit_stream("other", 100, 1).unwrap().dropped(), 0);
}

/// `[audit] stream` in a policy file: the refusals of its rules land in
/// that Redis stream of the store the `Tollgate` runs on; on the memory
/// store the file is refused, naming `audit.stream`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_files_audit_stream_is_a_redis_stream_of_its_store() {
    use tollgate::config::{PolicyFile, Tollgate};
    let Some(redis) = Server::start() else {
        return;
    };
    let text = r#"
[[rules]]
name = "per-key"
key = "header:x-api-key"
rate = "1/h"
burst = 1

[audit]
rules = ["per-key"]
stream = "refusals"
maxlen = 1000
queue = 16
"#;
    let file = PolicyFile::parse(text).unwrap();
    let e = Tollgate::new(&file, &MemoryStore::new()).unwrap_err();
    assert_eq!(e.field(), "audit.stream", "{e}");
    let prefix = unique_prefix();
    let store = RedisStore::builder(&redis.url())
        .prefix(&prefix)
        .build()
        .unwrap();
    let gate = Tollgate::new(&file, &store).unwrap();
    let svc = gate.layer(service_fn(|_req: Request<axum::body::Body>| async {
        Ok::<_, Infallible>(Response::new(axum::body::Body::empty()))
    }));
    let req = |key: &str| {
        Request::get("/")
            .header("x-api-key", key)
            .body(axum::body::Body::empty())
            .unwrap()
    };
    for key in ["one-raw-key", "two-raw-key"] {
        assert_eq!(svc.clone().oneshot(req(key)).await.unwrap().status(), 200);
        assert_eq!(svc.clone().oneshot(req(key)).await.unwrap().status(), 429);
    }
    let stream = format!("{prefix}:refusals");
    assert_eq!(stream_len(&redis, &stream, 2).await, 2);
    let entries = redis.cli(&["XRANGE", &stream, "-", "+"]);
    assert!(entries.contains("per-key"), "{entries}");
    assert!(
        !entries.contains("raw-key"),
        "a raw key in the audit: {entries}"
    );
    // A sink set in code stays: the file's stream does not replace it.
    struct Counted(std::sync::Arc<std::sync::atomic::AtomicUsize>);
    impl tollgate::observe::AuditSink for Counted {
        fn record(&self, _: &tollgate::observe::AuditRecord) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
    let counted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let sink = Counted(std::sync::Arc::clone(&counted));
    let gate = Tollgate::with(&file, &store, move |b| {
        b.audit(Counted(std::sync::Arc::clone(&sink.0)), &["per-key"])
    })
    .unwrap();
    let svc = gate.layer(service_fn(|_req: Request<axum::body::Body>| async {
        Ok::<_, Infallible>(Response::new(axum::body::Body::empty()))
    }));
    assert_eq!(
        svc.clone().oneshot(req("three")).await.unwrap().status(),
        200
    );
    assert_eq!(
        svc.clone().oneshot(req("three")).await.unwrap().status(),
        429
    );
    assert_eq!(counted.load(std::sync::atomic::Ordering::SeqCst), 1);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        redis.cli(&["XLEN", &stream]).trim(),
        "2",
        "the stream got the code sink's record"
    );
    // Bounds are the store's own, checked at load.
    let e = PolicyFile::parse(&text.replace("maxlen = 1000", "maxlen = 0")).unwrap_err();
    assert_eq!(e.field(), "audit.maxlen", "{e}");
    let e = PolicyFile::parse(&text.replace("stream = \"refusals\"\n", "")).unwrap_err();
    assert_eq!(e.field(), "audit.maxlen", "{e}");
}

/// A reload on a store: `v1`'s per-key GCRA (burst 2) and fixed window
/// (3 a minute) spent by one key, then `v2` with a bigger burst and limit
/// and a window of another length. The GCRA goes on from its state, the
/// window of the same length would too, the one of another length starts
/// fresh — the same on every store.
async fn reload_on<S: Store>(store: S, clock: &ManualClock) {
    use tollgate::config::PolicyFile;
    let v1 = r#"
[[rules]]
name = "gcra"
key = "header:x-api-key"
rate = "1/min"
burst = 2

[[rules]]
name = "window"
key = "header:x-api-key"
algorithm = "fixed_window"
rate = "3/min"
"#;
    let layer = PolicyFile::parse(v1)
        .unwrap()
        .layer::<String, _>(&store)
        .unwrap();
    let svc = layer.layer(service_fn(|_r: Request<String>| async {
        Ok::<_, Infallible>(Response::new(String::new()))
    }));
    let call = |svc: &_| {
        let svc: &tollgate::policy::PolicyService<_, String, S> = svc;
        let svc = svc.clone();
        async move {
            let req = Request::get("/")
                .header("x-api-key", "k")
                .body(String::new())
                .unwrap();
            let res = svc.oneshot(req).await.unwrap();
            let rl = res
                .headers()
                .get("ratelimit")
                .map(|v| v.to_str().unwrap().to_owned())
                .unwrap_or_default();
            (res.status().as_u16(), rl)
        }
    };
    assert_eq!(
        call(&svc).await,
        (200, "\"gcra\";r=1;t=60, \"window\";r=2;t=60".to_owned())
    );
    assert_eq!(
        call(&svc).await,
        (200, "\"gcra\";r=0;t=120, \"window\";r=1;t=60".to_owned())
    );
    assert_eq!(call(&svc).await.0, 429);
    // v2: burst 4 (2 spent: 2 left), and the window 5 a minute (2 spent).
    let v2 = v1
        .replace("burst = 2", "burst = 4")
        .replace("3/min", "5/min");
    let next = PolicyFile::parse(&v2)
        .unwrap()
        .layer::<String, _>(&store.rebinding())
        .unwrap();
    layer.replace(&next);
    assert_eq!(
        call(&svc).await,
        (200, "\"gcra\";r=1;t=180, \"window\";r=2;t=60".to_owned())
    );
    // v3: the window 5 every 2 minutes: a fresh count.
    let v3 = v2.replace("5/min", "5/2m");
    let next = PolicyFile::parse(&v3)
        .unwrap()
        .layer::<String, _>(&store.rebinding())
        .unwrap();
    layer.replace(&next);
    let (status, rl) = call(&svc).await;
    assert_eq!(status, 200);
    assert!(
        rl.starts_with("\"gcra\";r=0;t=240, \"window\";r=4;"),
        "{rl}"
    );
    // The GCRA recovers at its rate: one unit a minute on.
    clock.advance(Duration::from_secs(60));
    assert_eq!(call(&svc).await.0, 200);
}

#[tokio::test]
async fn a_reload_goes_on_from_state_in_memory() {
    let clock = ManualClock::starting_at(1_796_000_040_000_000_000); // a whole minute
    let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    reload_on(store, &clock).await;
}

#[tokio::test]
async fn a_reload_goes_on_from_state_on_redis() {
    let Some(redis) = Server::start() else { return };
    let clock = ManualClock::starting_at(1_796_000_040_000_000_000);
    reload_on(redis_store(&redis.url(), &clock), &clock).await;
}

#[tokio::test]
async fn a_reload_goes_on_from_state_on_redis_with_a_fallback() {
    // The fallback memory store binds every rule too: it must rebind.
    let Some(redis) = Server::start() else { return };
    let clock = ManualClock::starting_at(1_796_000_040_000_000_000);
    let store = RedisStore::builder(&redis.url())
        .prefix(&unique_prefix())
        .client_time(clock.clone())
        .timeout(Duration::from_secs(2))
        .failure_policy(tollgate::FailurePolicy::fallback())
        .build()
        .unwrap();
    reload_on(store, &clock).await;
}

/// The challenge step across a fleet: two instances on one Redis (the
/// same prefix and secret): a challenge one issues, the other accepts,
/// and a solution used on one is refused on the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_solved_challenge_passes_once_across_a_fleet() {
    use tollgate::policy::{ProofOfWork, CHALLENGE_HEADER, SOLUTION_HEADER};
    let Some(redis) = Server::start() else { return };
    let clock = ManualClock::starting_at(1_796_000_040_000_000_000);
    let prefix = unique_prefix();
    let instance = || {
        let store = redis_store_in(&redis.url(), &clock, &prefix);
        let pow = ProofOfWork::new(
            b"one secret, every instance.....",
            8,
            Duration::from_secs(60),
        )
        .unwrap()
        .clock(clock.clone());
        let layer = PolicyLayer::builder()
            .rule(
                RateRule::new(
                    "login",
                    Limit::fixed_window(1, Duration::from_secs(60)),
                    Header::named("x-api-key").unwrap(),
                )
                .challenge(pow),
            )
            .store(store)
            .build()
            .unwrap();
        layer.layer(service_fn(|_req: Request<String>| async {
            Ok::<_, Infallible>(Response::new(String::new()))
        }))
    };
    let (a, b) = (instance(), instance());
    let req = |solution: Option<&str>| {
        let mut r = Request::get("/login")
            .header("x-api-key", "alice")
            .body(String::new())
            .unwrap();
        if let Some(s) = solution {
            r.headers_mut().insert(SOLUTION_HEADER, s.parse().unwrap());
        }
        r
    };
    assert_eq!(a.clone().oneshot(req(None)).await.unwrap().status(), 200);
    let res = b.clone().oneshot(req(None)).await.unwrap();
    assert_eq!(res.status(), 429);
    let challenge = res.headers()[CHALLENGE_HEADER].to_str().unwrap().to_owned();
    let solution = tollgate::policy::ProofOfWork::solve(&challenge, 20).unwrap();
    // Issued by b, accepted by a; then refused by b as a replay.
    let res = a.clone().oneshot(req(Some(&solution))).await.unwrap();
    assert_eq!(res.status(), 200);
    let res = b.clone().oneshot(req(Some(&solution))).await.unwrap();
    assert_eq!(res.status(), 429);
    assert!(res.headers().contains_key(CHALLENGE_HEADER));
}

/// Policy-security review #14: on the one-call-per-rule path (here a
/// one-rule policy) a fail-open answer was marked consumed, so a response
/// the rule does not count refunded Redis, once back, for a charge it
/// never made: the client gained a unit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fail_open_admission_is_never_refunded_to_redis() {
    let Some(redis) = Server::start() else {
        return;
    };
    let store = fail_open(&redis);
    never_refunded(redis, store).await;
}

/// The same through `HotKeys` with nothing leased (a rule left out of its
/// list, or keys longer than it leases): its joint decision passed every
/// admission on as consumed, the failure policy's too (the review of
/// `HotLimiter::decide_joint`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fail_open_admission_through_hot_keys_is_never_refunded_to_redis() {
    let Some(redis) = Server::start() else {
        return;
    };
    let store = tollgate_redis::HotKeys::new()
        .rules(Vec::<String>::new())
        .over(fail_open(&redis))
        .unwrap();
    never_refunded(redis, store).await;
}

/// A store on `redis` that fails open.
fn fail_open(redis: &Server) -> RedisStore {
    RedisStore::builder(&redis.url())
        .prefix(&unique_prefix())
        .timeout(Duration::from_millis(50))
        .failure_policy(tollgate::FailurePolicy::Open)
        .build()
        .unwrap()
}

/// A fail-open admission's 500 (its `count_if` refunds what was counted)
/// gives nothing back to a Redis that is back: it never counted it.
async fn never_refunded<St: Store>(mut redis: Server, store: St) {
    let rule = RateRule::new(
        "one",
        Limit::gcra(Rate::per_minute(1), 100),
        Header::named("x-api-key").unwrap(),
    )
    .count_if(|status| !status.is_server_error());
    let layer = PolicyLayer::builder()
        .rule(rule)
        .store(store)
        .build()
        .unwrap();
    // A request with `x-slow` is answered 500 once the test says so.
    let (go, wait) = tokio::sync::watch::channel(false);
    let svc = layer.layer(service_fn(move |req: Request<String>| {
        let mut wait = wait.clone();
        async move {
            if req.headers().contains_key("x-slow") {
                wait.wait_for(|go| *go).await.unwrap();
                let mut res = Response::new(String::new());
                *res.status_mut() = http::StatusCode::INTERNAL_SERVER_ERROR;
                return Ok::<_, Infallible>(res);
            }
            Ok(Response::new(String::new()))
        }
    }));
    let send = |slow: bool| {
        let svc = svc.clone();
        async move {
            let mut req = Request::get("/").header("x-api-key", "k");
            if slow {
                req = req.header("x-slow", "1");
            }
            let res = svc.oneshot(req.body(String::new()).unwrap()).await.unwrap();
            let r = res.headers()["ratelimit"].to_str().unwrap().to_owned();
            (res.status(), r)
        }
    };
    // Redis is gone: fail-open admits, nothing is charged anywhere.
    redis.kill();
    let slow = tokio::spawn(send(true));
    tokio::time::sleep(Duration::from_millis(200)).await;
    redis.restart();
    // Back on Redis (a fresh one): five charged there.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never back on Redis"
        );
        let (status, r) = send(false).await;
        assert_eq!(status, 200);
        if r.starts_with("\"one\";r=99;") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for _ in 0..4 {
        send(false).await;
    }
    // The fail-open request's 500 is not counted: nothing to give back.
    go.send(true).unwrap();
    assert_eq!(slow.await.unwrap().0, 500);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (_, r) = send(false).await;
    assert!(r.starts_with("\"one\";r=94;"), "{r}");
}

/// Fleet review F2 (the review of HotKeys under a failure policy): a
/// policy on `HotKeys` over a Redis that is down struck its escalation
/// ladder (kept in the fallback memory meanwhile) on every refusal the
/// failure policy gave — they say nothing about the client, as the plain
/// Redis store already tells the policy — so an outage blocked clients
/// for an hour. `HotLimiter` now says which answers the policy gave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_keys_over_a_redis_that_is_down_strike_no_ladder() {
    // Nothing listens there: every call fails at once.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        drop(l);
        format!("redis://127.0.0.1:{port}")
    };
    let redis = RedisStore::builder(&dead)
        .prefix(&unique_prefix())
        .failure_policy(tollgate::FailurePolicy::fallback())
        .timeout(Duration::from_millis(100))
        .build()
        .unwrap();
    let store = tollgate_redis::HotKeys::new()
        .rules(["per-key"])
        .over(redis)
        .unwrap();
    let svc = PolicyLayer::builder()
        .rule(
            RateRule::new(
                "per-key",
                Limit::gcra(Rate::per_minute(1), 1),
                Header::named("x-api-key").unwrap(),
            )
            .escalate(
                1,
                Duration::from_secs(60),
                Duration::from_secs(3_600),
                Duration::from_secs(3_600),
            ),
        )
        .store(store)
        .build()
        .unwrap()
        .layer(service_fn(|_req: Request<String>| async {
            Ok::<_, Infallible>(Response::new(String::new()))
        }));
    let send = || {
        let req = Request::get("/")
            .header("x-api-key", "k")
            .body(String::new())
            .unwrap();
        svc.clone().oneshot(req)
    };
    // The fallback memory's one unit, then its refusals.
    assert_eq!(send().await.unwrap().status(), 200);
    for n in 0..3 {
        let res = send().await.unwrap();
        assert_eq!(res.status(), 429, "request {n}");
        let wait: u64 = res.headers()["retry-after"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!(
            wait <= 60,
            "request {n}: the fallback's wait, not an hour's block: {wait} s"
        );
    }
}

/// Issue 32: a change of `[store]` is a reload too. A store that cannot
/// be built refuses the reload (the running policy stays, on its store);
/// one that can takes every limit, rules and quotas alike, from nothing.
#[tokio::test]
async fn a_changed_store_section_moves_every_limit_to_the_new_store() {
    use axum::body::Body;
    use tollgate::config::{Reloaded, Tollgate};
    let Some(redis) = Server::start() else { return };
    let dir = std::env::temp_dir().join(format!("tollgate-restore-{}", unique_prefix()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("policy.toml");
    let base = "[[rules]]\nname = \"all\"\nkey = \"global\"\nrate = \"2/h\"\nburst = 2\n\n\
                [[quotas]]\nname = \"daily\"\nkey = \"global\"\nlimits = { day = 5 }\n\n";
    std::fs::write(&path, format!("{base}[store]\nkind = \"memory\"\n")).unwrap();
    let (gate, reloader) = Tollgate::from_file(&path).unwrap();
    let app = axum::Router::new()
        .route("/", axum::routing::get(|| async { "ok" }))
        .route_layer(gate);
    let status = || {
        let app = app.clone();
        async move {
            app.oneshot(Request::get("/").body(Body::empty()).unwrap())
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    assert_eq!(status().await, 200);
    assert_eq!(status().await, 200);
    assert_eq!(status().await, 429);
    // The same store written otherwise (the section left out: memory,
    // its defaults) is no change: the counts stay.
    std::fs::write(&path, base).unwrap();
    assert_eq!(reloader.reload().unwrap(), Reloaded::Applied);
    assert_eq!(status().await, 429);
    // Its URL's variable is not set: refused, and memory still refuses.
    std::fs::write(
        &path,
        format!("{base}[store]\nkind = \"redis\"\nurl_env = \"TOLLGATE_TEST_UNSET_URL\"\nprefix = \"t\"\n"),
    )
    .unwrap();
    let e = reloader.reload().unwrap_err();
    assert_eq!(e.field(), "store.url_env", "{e}");
    assert_eq!(status().await, 429);
    // Redis: applied; the limits count there, from nothing.
    let prefix = unique_prefix();
    std::fs::write(
        &path,
        format!(
            "{base}[store]\nkind = \"redis\"\nurl = \"{}\"\nprefix = \"{prefix}\"\n",
            redis.url()
        ),
    )
    .unwrap();
    assert_eq!(reloader.reload().unwrap(), Reloaded::Applied);
    assert_eq!(status().await, 200);
    assert_eq!(status().await, 200);
    assert_eq!(status().await, 429);
    let keys = redis.cli(&["--scan", "--pattern", &format!("{prefix}*")]);
    assert!(
        keys.lines().count() >= 2,
        "rule and quota keys on Redis: {keys:?}"
    );
    // And back to memory: from nothing again.
    std::fs::write(&path, format!("{base}[store]\nkind = \"memory\"\n")).unwrap();
    assert_eq!(reloader.reload().unwrap(), Reloaded::Applied);
    assert_eq!(status().await, 200);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A `Tollgate` takes requests of any body: here tonic's, as the first
/// layer of a tonic `Server::builder()`, in front of a real health
/// service and client. Its rule refuses the third call of a key with
/// `RESOURCE_EXHAUSTED` and a `retry-after`; its in-flight limit holds a
/// key's watch streams.
#[tokio::test]
async fn a_tollgate_is_a_layer_of_a_tonic_server() {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;

    let file = tollgate::config::PolicyFile::parse(
        r#"
[[rules]]
name = "per-key"
key = "header:x-api-key"
rate = "1/h"
burst = 3

[[concurrency]]
name = "streams"
key = "header:x-api-key"
max = 1
"#,
    )
    .unwrap();
    let gate = tollgate::config::Tollgate::new(&file, &MemoryStore::new()).unwrap();
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .layer(gate)
            .add_service(health)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let keyed = |key: &str| {
        let mut r = tonic::Request::new(HealthCheckRequest {
            service: String::new(),
        });
        r.metadata_mut().insert("x-api-key", key.parse().unwrap());
        r
    };
    let mut client = HealthClient::new(channel);
    // A watch stream holds key a's one permit: its next call is refused
    // by the in-flight limit, and a check of key b goes through.
    let stream = client.watch(keyed("a")).await.unwrap();
    let held = client.check(keyed("a")).await.unwrap_err();
    assert_eq!(held.code(), tonic::Code::ResourceExhausted, "{held:?}");
    drop(stream);
    let mut back = false;
    for _ in 0..100 {
        match client.check(keyed("a")).await {
            Ok(_) => {
                back = true;
                break;
            }
            Err(s) => assert_eq!(s.code(), tonic::Code::ResourceExhausted, "{s:?}"),
        }
        tokio::task::yield_now().await;
    }
    assert!(back, "the stream's permit did not come back");
    // Key b: three calls (its burst), then refused by the rule.
    for i in 0..3 {
        client
            .check(keyed("b"))
            .await
            .map_err(|s| format!("call {i}: {s:?}"))
            .unwrap();
    }
    let refused = client.check(keyed("b")).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
    assert!(
        refused.metadata().get("retry-after").is_some(),
        "{:?}",
        refused.metadata()
    );
}
