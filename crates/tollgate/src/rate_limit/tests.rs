use std::convert::Infallible;
use std::future::{ready, Ready};
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use tollgate_core::{
    Decision, Limit, Limiter, ManualClock, Rate, Rule, StoreError, StoreErrorKind,
};
use tower::{service_fn, Layer, Service, ServiceExt};

use super::*;
use crate::cost::{ByRoute, Fixed};
use crate::key::{Header, KeyExtractorExt, PeerIp};
use crate::rate_limit::{ActualCost, Measure};
use crate::MemoryStore;

type Req = Request<String>;

async fn ok(_req: Req) -> Result<Response<String>, Infallible> {
    Ok(Response::new("ok".to_owned()))
}

fn store(clock: &ManualClock) -> MemoryStore<ManualClock> {
    MemoryStore::builder().clock(clock.clone()).build().unwrap()
}

fn req(key: &str) -> Req {
    Request::builder()
        .uri("/hello")
        .header("x-api-key", key)
        .body(String::new())
        .unwrap()
}

async fn body(res: Response<String>) -> String {
    let bytes = res.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(bytes.to_vec()).unwrap()
}

fn per_key(
    clock: &ManualClock,
    limit: Limit,
) -> RateLimitLayerBuilder<Header, Fixed, MemoryStore<ManualClock>> {
    RateLimitLayer::builder("per-key", limit)
        .key(Header::named("x-api-key").unwrap())
        .store(store(clock))
}

#[tokio::test]
async fn burst_then_429_with_headers_then_recovery() {
    let clock = ManualClock::starting_at(1);
    let layer = per_key(&clock, Limit::gcra(Rate::per_second(10), 20))
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(ok));
    for i in 0..20u64 {
        let res = svc.clone().oneshot(req("a")).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK, "request {i}");
        assert_eq!(res.headers()["ratelimit-policy"], "\"per-key\";q=20;w=2");
        assert_eq!(
            res.headers()["ratelimit"],
            format!("\"per-key\";r={};t={}", 19 - i, if i < 10 { 1 } else { 2 }).as_str()
        );
        assert!(res.headers().get("retry-after").is_none());
    }
    let res = svc.clone().oneshot(req("a")).await.unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(res.headers()["retry-after"], "1");
    assert_eq!(res.headers()["ratelimit"], "\"per-key\";r=0;t=1");
    assert_eq!(res.headers()["content-type"], "application/problem+json");
    let text = body(res).await;
    assert!(text.contains("\"rule\":\"per-key\""), "{text}");

    // Another key is untouched.
    let res = svc.clone().oneshot(req("b")).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);

    clock.advance(Duration::from_millis(100));
    let res = svc.clone().oneshot(req("a")).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
}

#[tokio::test]
async fn costs_drain_one_budget_and_too_costly_is_never_with_no_retry_after() {
    let clock = ManualClock::starting_at(1);
    let layer = per_key(&clock, Limit::gcra(Rate::per_second(10), 20))
        .cost(
            ByRoute::new(1)
                .route(Some(Method::POST), "/orders", 3)
                .route(Some(Method::POST), "/reports", 10)
                .route(Some(Method::POST), "/huge", 21),
        )
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(ok));
    let post = |path: &str| {
        Request::post(path)
            .header("x-api-key", "k")
            .body(String::new())
            .unwrap()
    };
    let res = svc.clone().oneshot(post("/reports")).await.unwrap();
    assert_eq!(res.headers()["ratelimit"], "\"per-key\";r=10;t=1");
    let res = svc.clone().oneshot(post("/orders")).await.unwrap();
    assert_eq!(res.headers()["ratelimit"], "\"per-key\";r=7;t=2");
    let res = svc.clone().oneshot(post("/reports")).await.unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(res.headers()["retry-after"], "1");

    let res = svc.clone().oneshot(post("/huge")).await.unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(res.headers().get("retry-after").is_none());
    assert!(body(res).await.contains("never succeed"));
}

#[tokio::test]
async fn shadow_mode_never_blocks_but_reports() {
    let clock = ManualClock::starting_at(1);
    let layer = per_key(&clock, Limit::fixed_window(2, Duration::from_secs(60)))
        .shadow(true)
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(ok));
    for i in 0..10 {
        let res = svc.clone().oneshot(req("a")).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK, "request {i}");
        assert!(res.headers().get("ratelimit").is_none(), "request {i}");
        assert!(res.headers().get("retry-after").is_none(), "request {i}");
    }
    // It decided all along: the key's budget is spent.
    let mut key = crate::key::KeyBuf::new();
    crate::key::KeyExtractor::extract(&Header::named("x-api-key").unwrap(), &req("a"), &mut key)
        .unwrap();
    let d = layer.limiter().decide(key.as_bytes(), 0).await.unwrap();
    assert_eq!(d.remaining, 0);
}

#[tokio::test]
async fn missing_keys_follow_the_chosen_policy() {
    let clock = ManualClock::starting_at(1);
    let no_key = || Request::get("/").body(String::new()).unwrap();

    let skip = per_key(&clock, Limit::fixed_window(1, Duration::from_secs(60)))
        .on_missing_key(MissingKey::Skip)
        .build()
        .unwrap()
        .layer(service_fn(ok));
    for _ in 0..3 {
        let res = skip.clone().oneshot(no_key()).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        assert!(res.headers().get("ratelimit").is_none());
    }

    // By default, a keyless request is refused, not pooled.
    let default =
        RateLimitLayer::builder("default", Limit::fixed_window(1, Duration::from_secs(60)))
            .key(Header::named("x-api-key").unwrap())
            .store(store(&clock))
            .build()
            .unwrap()
            .layer(service_fn(ok));
    assert_eq!(
        default.clone().oneshot(no_key()).await.unwrap().status(),
        400
    );

    let fallback =
        RateLimitLayer::builder("fallback", Limit::fixed_window(1, Duration::from_secs(60)))
            .key(Header::named("x-api-key").unwrap())
            .on_missing_key(MissingKey::Fallback(Bytes::from_static(b"unkeyed")))
            .store(store(&clock))
            .build()
            .unwrap()
            .layer(service_fn(ok));
    assert_eq!(
        fallback.clone().oneshot(no_key()).await.unwrap().status(),
        200
    );
    assert_eq!(
        fallback.clone().oneshot(no_key()).await.unwrap().status(),
        429
    );
    // A client whose key happens to be "unkeyed" does not share the fallback budget.
    assert_eq!(
        fallback
            .clone()
            .oneshot(req("unkeyed"))
            .await
            .unwrap()
            .status(),
        200
    );

    let reject = per_key(&clock, Limit::fixed_window(1, Duration::from_secs(60)))
        .on_missing_key(MissingKey::Reject)
        .build()
        .unwrap()
        .layer(service_fn(ok));
    let res = reject.clone().oneshot(no_key()).await.unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert!(body(res).await.contains("no client key"));
}

#[tokio::test]
async fn grpc_requests_get_resource_exhausted() {
    let clock = ManualClock::starting_at(1);
    let svc = per_key(&clock, Limit::fixed_window(1, Duration::from_secs(60)))
        .build()
        .unwrap()
        .layer(service_fn(ok));
    let grpc = || {
        Request::post("/pkg.Service/Method")
            .header("x-api-key", "g")
            .header("content-type", "application/grpc+proto")
            .body(String::new())
            .unwrap()
    };
    assert_eq!(svc.clone().oneshot(grpc()).await.unwrap().status(), 200);
    let res = svc.clone().oneshot(grpc()).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.headers()["grpc-status"], "8");
    assert_eq!(res.headers()["content-type"], "application/grpc");
    let pushback: u64 = res.headers()["grpc-retry-pushback-ms"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(pushback > 0 && pushback <= 60_000);
    assert_eq!(body(res).await, "");
}

#[tokio::test]
async fn error_mode_returns_rate_limited() {
    let clock = ManualClock::starting_at(1);
    let svc = per_key(&clock, Limit::fixed_window(1, Duration::from_secs(60)))
        .build()
        .unwrap()
        .into_errors()
        .layer(service_fn(ok));
    let res = svc.clone().oneshot(req("e")).await.unwrap();
    assert_eq!(res.headers()["ratelimit"], "\"per-key\";r=0;t=60");
    let err = svc.clone().oneshot(req("e")).await.unwrap_err();
    let limited = err.downcast_ref::<RateLimited>().unwrap();
    assert_eq!(limited.rejected().reason, crate::rejection::Reason::Limited);
    assert_eq!(err.to_string(), "rate limit \"per-key\" exceeded");
    // The error keeps the headers the response mode sends.
    assert_eq!(limited.headers()["retry-after"], "60");
    assert_eq!(limited.headers()["ratelimit"], "\"per-key\";r=0;t=60");
    assert_eq!(
        limited.headers()["ratelimit-policy"],
        "\"per-key\";q=1;w=60"
    );
    let res = limited.to_response();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(res.headers()["content-type"], "application/problem+json");
    assert!(res
        .extensions()
        .get::<crate::rejection::Refusal>()
        .is_some());
    #[cfg(feature = "axum")]
    {
        use axum::response::IntoResponse;
        let res = limited.clone().into_response();
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(res.headers()["ratelimit"], "\"per-key\";r=0;t=60");
        assert_eq!(res.headers()["retry-after"], "60");
    }
}

#[tokio::test]
async fn legacy_headers_and_custom_rejection() {
    let clock = ManualClock::starting_at(1);
    let svc = per_key(&clock, Limit::fixed_window(1, Duration::from_secs(30)))
        .legacy_headers(true)
        .rejection(|r| {
            let mut res = Response::new(Bytes::from(format!("slow down ({})", r.rule)));
            *res.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            res
        })
        .build()
        .unwrap()
        .layer(service_fn(ok));
    let res = svc.clone().oneshot(req("l")).await.unwrap();
    assert_eq!(res.headers()["x-ratelimit-limit"], "1");
    assert_eq!(res.headers()["x-ratelimit-remaining"], "0");
    assert_eq!(res.headers()["x-ratelimit-reset"], "30");
    let res = svc.clone().oneshot(req("l")).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.headers()["retry-after"], "30");
    assert_eq!(body(res).await, "slow down (per-key)");
}

#[tokio::test(start_paused = true)]
async fn leaky_bucket_paces_instead_of_rejecting() {
    // The memory store reads the manual clock, tokio's paused clock drives
    // the pacing sleep: both are under the test's control.
    let clock = ManualClock::starting_at(1);
    let svc = per_key(
        &clock,
        Limit::leaky_bucket(Rate::per_second(10), Duration::from_millis(250)),
    )
    .build()
    .unwrap()
    .layer(service_fn(ok));
    let start = tokio::time::Instant::now();
    let mut delays = Vec::new();
    for _ in 0..3 {
        let res = svc.clone().oneshot(req("p")).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        delays.push(start.elapsed());
    }
    // Each request waited for its turn: 0, 100 ms, 200 ms (the manual clock
    // did not move, so each one queued behind the previous).
    assert_eq!(
        delays,
        vec![
            Duration::ZERO,
            Duration::from_millis(100),
            Duration::from_millis(300)
        ]
    );
    // The fourth would wait 300 ms > 250 ms: rejected at once.
    let res = svc.clone().oneshot(req("p")).await.unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(start.elapsed(), Duration::from_millis(300));
}

#[tokio::test(start_paused = true)]
async fn a_paced_request_cancelled_while_it_waits_gives_its_slot_back() {
    let clock = ManualClock::starting_at(1);
    let layer = per_key(
        &clock,
        Limit::leaky_bucket(Rate::per_second(10), Duration::from_millis(250)),
    )
    .build()
    .unwrap();
    let svc = layer.layer(service_fn(ok));
    assert_eq!(svc.clone().oneshot(req("c")).await.unwrap().status(), 200);
    // The second waits 100 ms for its turn; its client gives up at 50.
    let waiting = tokio::time::timeout(Duration::from_millis(50), svc.clone().oneshot(req("c")));
    assert!(waiting.await.is_err());
    // Its slot came back, so the third takes it: 100 ms, not 200 (the
    // store's manual clock stood still).
    let start = tokio::time::Instant::now();
    assert_eq!(svc.clone().oneshot(req("c")).await.unwrap().status(), 200);
    assert_eq!(start.elapsed(), Duration::from_millis(100));
}

#[tokio::test(start_paused = true)]
async fn shadow_mode_never_holds_a_paced_request_back() {
    let clock = ManualClock::starting_at(1);
    let svc = per_key(
        &clock,
        Limit::leaky_bucket(Rate::per_second(10), Duration::from_millis(250)),
    )
    .shadow(true)
    .build()
    .unwrap()
    .layer(service_fn(ok));
    let start = tokio::time::Instant::now();
    for _ in 0..10 {
        let res = svc.clone().oneshot(req("s")).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        assert!(res.headers().get("retry-after").is_none());
    }
    assert_eq!(start.elapsed(), Duration::ZERO);
}

#[tokio::test(start_paused = true)]
async fn a_paced_request_does_not_hold_the_inner_services_permit_while_it_waits() {
    let clock = ManualClock::starting_at(1);
    let layer = per_key(
        &clock,
        Limit::leaky_bucket(Rate::per_second(10), Duration::from_secs(1)),
    )
    .build()
    .unwrap();
    // The inner service admits one request at a time.
    let mut svc = layer.layer(tower::limit::ConcurrencyLimit::new(service_fn(ok), 1));
    let first = svc.ready().await.unwrap().call(req("p")).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    // The second waits 100 ms for its turn...
    let second = svc.ready().await.unwrap().call(req("p"));
    // ...and meanwhile the permit is free for other work.
    let ready = tokio::time::timeout(Duration::from_millis(1), svc.ready()).await;
    assert!(ready.is_ok(), "the waiting request holds the inner permit");
    // Done with it: the caller's ready service gives its permit back.
    drop(svc);
    let start = tokio::time::Instant::now();
    assert_eq!(second.await.unwrap().status(), StatusCode::OK);
    assert!(start.elapsed() >= Duration::from_millis(99));
}

/// A store that always fails.
#[derive(Clone)]
struct Broken(Rule);

impl Limiter for Broken {
    type DecideFuture = Ready<Result<Decision, StoreError>>;
    type RefundFuture = Ready<Result<(), StoreError>>;
    fn rule(&self) -> &Rule {
        &self.0
    }
    fn decide(&self, _key: &[u8], _cost: u64) -> Self::DecideFuture {
        ready(Err(StoreError::new(StoreErrorKind::Unavailable, "down")))
    }
    fn refund(&self, _key: &[u8], _cost: u64) -> Self::RefundFuture {
        ready(Ok(()))
    }
}

#[tokio::test]
async fn a_failing_store_lets_requests_through() {
    let rule = Rule::new("broken", Limit::fixed_window(1, Duration::from_secs(1))).unwrap();
    let layer = RateLimitLayer::builder("broken", Limit::fixed_window(1, Duration::from_secs(1)))
        .build()
        .unwrap();
    // Swap the bound limiter for the broken one, keeping everything else.
    let shared = std::sync::Arc::new(super::shared::Shared {
        key: crate::key::Global,
        cost: Fixed(1),
        limiter: Broken(rule),
        keying: crate::key::Keying::new(MissingKey::default()),
        responder: layer.responder(),
        messages: false,
        debts: None,
    });
    /// A store whose rate limiters are `Broken`.
    #[derive(Clone)]
    struct BrokenStore;
    impl tollgate_core::Store for BrokenStore {
        type Limiter = Broken;
        type ConcurrencyLimiter = <MemoryStore as tollgate_core::Store>::ConcurrencyLimiter;
        fn limiter(&self, rule: &Rule) -> Result<Broken, tollgate_core::ConfigError> {
            Ok(Broken(rule.clone()))
        }
        fn concurrency_limiter(
            &self,
            rule: &tollgate_core::ConcurrencyRule,
        ) -> Result<Self::ConcurrencyLimiter, tollgate_core::ConfigError> {
            MemoryStore::new().concurrency_limiter(rule)
        }
    }
    let mut svc = RateLimitService::<_, _, _, BrokenStore>::new(service_fn(ok), shared);
    for _ in 0..5 {
        let res = svc.ready().await.unwrap().call(req("x")).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
    }
}

#[tokio::test]
async fn peer_ip_with_api_key_fallback() {
    let clock = ManualClock::starting_at(1);
    let svc = RateLimitLayer::builder("ip", Limit::fixed_window(1, Duration::from_secs(60)))
        .key(Header::named("x-api-key").unwrap().or(PeerIp::new()))
        .store(store(&clock))
        .build()
        .unwrap()
        .layer(service_fn(ok));
    let from = |ip: &str| {
        let mut r = Request::get("/").body(String::new()).unwrap();
        r.extensions_mut().insert(ip.parse::<SocketAddr>().unwrap());
        r
    };
    assert_eq!(
        svc.clone()
            .oneshot(from("1.1.1.1:1"))
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        svc.clone()
            .oneshot(from("1.1.1.1:2"))
            .await
            .unwrap()
            .status(),
        429
    );
    assert_eq!(
        svc.clone()
            .oneshot(from("2.2.2.2:1"))
            .await
            .unwrap()
            .status(),
        200
    );
}

#[test]
fn build_errors_name_the_field() {
    let err = RateLimitLayer::builder("bad name", Limit::gcra(Rate::per_second(1), 1))
        .build()
        .unwrap_err();
    assert_eq!(err.field(), "name");
    let err = RateLimitLayer::builder("ok", Limit::gcra(Rate::per_second(1), 0))
        .build()
        .unwrap_err();
    assert_eq!(err.field(), "burst");
}

/// A recorder that keeps counters, gauges and histograms by
/// `name{label=value,...}`.
#[derive(Default)]
pub(crate) struct Recorded(
    pub(crate) std::sync::Mutex<Vec<(String, std::sync::Arc<std::sync::atomic::AtomicU64>)>>,
    std::sync::Mutex<Vec<(String, std::sync::Arc<Samples>)>>,
);

/// A histogram's samples, in the order recorded.
#[derive(Default)]
struct Samples(std::sync::Mutex<Vec<f64>>);

impl metrics::HistogramFn for Samples {
    fn record(&self, value: f64) {
        self.0.lock().unwrap().push(value);
    }
}

/// The handle of `key`'s series in `all`: a series registered again (a
/// per-request lookup) shares its value, as a real registry's does.
fn shared<T: Default>(
    all: &std::sync::Mutex<Vec<(String, std::sync::Arc<T>)>>,
    key: &metrics::Key,
) -> std::sync::Arc<T> {
    let labels: Vec<String> = key
        .labels()
        .map(|l| format!("{}={}", l.key(), l.value()))
        .collect();
    let name = format!("{}{{{}}}", key.name(), labels.join(","));
    let mut all = all.lock().unwrap();
    if let Some((_, v)) = all.iter().find(|(n, _)| *n == name) {
        return std::sync::Arc::clone(v);
    }
    let v = std::sync::Arc::new(T::default());
    all.push((name, std::sync::Arc::clone(&v)));
    v
}

impl Recorded {
    /// A histogram's samples (none if it was never registered).
    pub(crate) fn samples(&self, name: &str) -> Vec<f64> {
        self.1
            .lock()
            .unwrap()
            .iter()
            .find(|(n, _)| n == name)
            .map_or_else(Vec::new, |(_, s)| s.0.lock().unwrap().clone())
    }

    /// A gauge's value.
    pub(crate) fn gauge(&self, name: &str) -> f64 {
        f64::from_bits(self.get(name))
    }

    pub(crate) fn get(&self, name: &str) -> u64 {
        self.0
            .lock()
            .unwrap()
            .iter()
            .find(|(n, _)| n == name)
            .map_or(0, |(_, c)| c.load(std::sync::atomic::Ordering::Relaxed))
    }
}

impl metrics::Recorder for Recorded {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        metrics::Counter::from_arc(shared(&self.0, key))
    }
    /// Gauges are kept too, their `f64` as bits (read with `gauge`).
    fn register_gauge(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::from_arc(shared(&self.0, key))
    }
    fn register_histogram(
        &self,
        key: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        metrics::Histogram::from_arc(shared(&self.1, key))
    }
}

#[tokio::test]
async fn decisions_are_counted_by_rule_and_outcome_never_by_key() {
    let recorder = Recorded::default();
    let clock = ManualClock::starting_at(1);
    let layer = metrics::with_local_recorder(&recorder, || {
        per_key(&clock, Limit::fixed_window(2, Duration::from_secs(60)))
            .cost(|req: &Req| if req.uri().path() == "/huge" { 3 } else { 1 })
            .build()
            .unwrap()
    });
    let svc = layer.layer(service_fn(ok));
    for _ in 0..3 {
        svc.clone().oneshot(req("secret-api-key")).await.unwrap();
    }
    let huge = Request::get("/huge")
        .header("x-api-key", "other")
        .body(String::new())
        .unwrap();
    svc.clone().oneshot(huge).await.unwrap();
    let name = |outcome: &str| format!("tollgate_requests_total{{rule=per-key,outcome={outcome}}}");
    // What each decision left of the limit of 2: one, none, none (the
    // denial), and the other key's too-costly request spent nothing.
    assert_eq!(
        recorder.samples("tollgate_remaining_ratio{rule=per-key}"),
        [0.5, 0.0, 0.0, 1.0]
    );
    assert_eq!(recorder.get(&name("allowed")), 2);
    assert_eq!(recorder.get(&name("limited")), 1);
    assert_eq!(recorder.get(&name("too_costly")), 1);
    assert!(recorder
        .0
        .lock()
        .unwrap()
        .iter()
        .all(|(n, _)| !n.contains("secret")));
}

/// Each single-rule layer counts its decisions under axum's matched route
/// when asked, and only then.
#[cfg(feature = "axum")]
#[test]
fn single_rule_layers_count_decisions_by_route() {
    use axum::routing::get;
    let recorder = Recorded::default();
    let clock = ManualClock::at_unix(tollgate_core::calendar::unix_nanos(2026, 12, 3, 12, 0, 0));
    let key = || Header::named("x-api-key").unwrap();
    let (rate, quota, concurrency, quiet) = metrics::with_local_recorder(&recorder, || {
        (
            per_key(&clock, Limit::fixed_window(3, Duration::from_secs(60)))
                .route_label(true)
                .build()
                .unwrap(),
            crate::QuotaLayer::builder("daily")
                .period(tollgate_core::calendar::Period::Day, 2)
                .key(key())
                .store(MemoryStore::builder().clock(clock.clone()).build().unwrap())
                .route_label(true)
                .build()
                .unwrap(),
            crate::ConcurrencyLayer::builder("in-flight", 1)
                .key(key())
                .route_label(true)
                .build()
                .unwrap(),
            RateLimitLayer::builder("quiet", Limit::fixed_window(100, Duration::from_secs(1)))
                .key(key())
                .build()
                .unwrap(),
        )
    });
    let app = axum::Router::new()
        .route("/items/{id}", get(|| async { "item" }))
        .route("/other", get(|| async { "other" }))
        // Innermost first: the quota sees only what the rate admitted.
        .route_layer(quota)
        .route_layer(rate)
        .route_layer(concurrency)
        .route_layer(quiet);
    let send = |path: &str| {
        let req = Request::get(path)
            .header("x-api-key", "k")
            .body(axum::body::Body::empty())
            .unwrap();
        app.clone().oneshot(req)
    };
    // The route's counter is looked up when first counted on a thread,
    // so the requests run with the recorder: on a runtime of this thread.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        rt.block_on(async {
            for path in ["/items/1", "/items/2", "/other", "/items/3"] {
                send(path).await.unwrap();
            }
        });
    });
    let count = |rule: &str, route: &str, outcome: &str| {
        recorder.get(&format!(
            "tollgate_route_requests_total{{rule={rule},route={route},outcome={outcome}}}"
        ))
    };
    // The rate admits three and refuses the fourth; the quota admits two
    // of the three and refuses `/other`; the concurrency limit of 1 admits
    // all four, one after another.
    assert_eq!(count("per-key", "/items/{id}", "allowed"), 2);
    assert_eq!(count("per-key", "/other", "allowed"), 1);
    assert_eq!(count("per-key", "/items/{id}", "limited"), 1);
    assert_eq!(count("daily", "/items/{id}", "allowed"), 2);
    assert_eq!(count("daily", "/other", "limited"), 1);
    assert_eq!(count("in-flight", "/items/{id}", "allowed"), 3);
    assert_eq!(count("in-flight", "/other", "allowed"), 1);
    // A layer that was not asked counts nothing by route.
    assert!(recorder
        .0
        .lock()
        .unwrap()
        .iter()
        .all(|(n, _)| !(n.starts_with("tollgate_route") && n.contains("rule=quiet"))));
}

/// An upgraded connection's messages draw on the rule's budget for the
/// key of its upgrade request (000 §12): a client cannot get round a
/// request limit on one long-lived socket.
#[tokio::test]
async fn an_upgraded_connections_messages_spend_the_keys_budget() {
    let clock = ManualClock::starting_at(1);
    let layer = per_key(&clock, Limit::gcra(Rate::per_second(1), 3))
        .messages(true)
        .build()
        .unwrap();
    let kept = std::sync::Arc::new(std::sync::Mutex::new(None));
    let k2 = std::sync::Arc::clone(&kept);
    let svc = layer.layer(service_fn(move |req: Req| {
        *k2.lock().unwrap() = req.extensions().get::<MessageBudget>().cloned();
        ok(req)
    }));
    // A plain request carries no budget.
    assert_eq!(svc.clone().oneshot(req("k")).await.unwrap().status(), 200);
    assert!(kept.lock().unwrap().is_none());
    let mut upgrade = req("k");
    upgrade
        .headers_mut()
        .insert("upgrade", "websocket".parse().unwrap());
    assert_eq!(svc.clone().oneshot(upgrade).await.unwrap().status(), 200);
    let budget = kept.lock().unwrap().take().expect("offered to the handler");
    assert_eq!(budget.rule(), "per-key");
    // One of 3 left after the two requests: one message, then refused.
    budget.spend(1).await.unwrap();
    let refused = budget.spend(1).await.unwrap_err();
    assert_eq!(refused.retry_after(), Some(Duration::from_secs(1)));
    assert_eq!(refused.rule(), "per-key");
    // The messages spent the key's budget: its requests are refused too.
    assert_eq!(svc.clone().oneshot(req("k")).await.unwrap().status(), 429);
    // A message above the whole capacity never fits.
    assert_eq!(budget.spend(4).await.unwrap_err().retry_after(), None);
    clock.advance(Duration::from_secs(1));
    budget.spend(1).await.unwrap();
}

#[tokio::test]
async fn without_messages_an_upgrade_carries_no_budget() {
    let clock = ManualClock::starting_at(1);
    let layer = per_key(&clock, Limit::gcra(Rate::per_second(1), 3))
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(|req: Req| {
        assert!(req.extensions().get::<MessageBudget>().is_none());
        ok(req)
    }));
    let mut upgrade = req("k");
    upgrade
        .headers_mut()
        .insert("upgrade", "websocket".parse().unwrap());
    assert_eq!(svc.oneshot(upgrade).await.unwrap().status(), 200);
}

/// A message's store fault answers as the rule's failure policy: admitted
/// by default, refused under `OnStoreError::Refuse`.
#[tokio::test]
async fn a_messages_store_fault_follows_the_failure_policy() {
    let rule = Rule::new("broken", Limit::fixed_window(1, Duration::from_secs(1))).unwrap();
    let key = || {
        let mut buf = crate::key::KeyBuf::new();
        buf.push(b"k");
        crate::key::KeyBytes::new(&mut buf)
    };
    for (on, admitted) in [
        (crate::OnStoreError::Admit, true),
        (crate::OnStoreError::Refuse, false),
    ] {
        let layer =
            RateLimitLayer::builder("broken", Limit::fixed_window(1, Duration::from_secs(1)))
                .on_store_error(on)
                .build()
                .unwrap();
        let budget = MessageBudget::new(Broken(rule.clone()), key(), layer.responder());
        assert_eq!(budget.spend(1).await.is_ok(), admitted, "{on:?}");
    }
}

/// Review: with two rate layers offering budgets, the inner one's replaced
/// the outer's, whose rule then never counted a message. One budget holds
/// both: a message spends on each, and one refused by either is given
/// back to the other.
#[tokio::test]
async fn stacked_layers_each_count_an_upgrades_messages() {
    let clock = ManualClock::starting_at(1);
    let shared = store(&clock);
    let outer = RateLimitLayer::builder("per-ip", Limit::fixed_window(10, Duration::from_secs(60)))
        .key(Header::named("x-ip").unwrap())
        .store(shared.clone())
        .messages(true)
        .build()
        .unwrap();
    let inner = RateLimitLayer::builder("per-key", Limit::fixed_window(3, Duration::from_secs(60)))
        .key(Header::named("x-api-key").unwrap())
        .store(shared.clone())
        .messages(true)
        .build()
        .unwrap();
    let kept = std::sync::Arc::new(std::sync::Mutex::new(None));
    let k2 = std::sync::Arc::clone(&kept);
    let svc = outer.layer(inner.layer(service_fn(move |req: Req| {
        *k2.lock().unwrap() = req.extensions().get::<MessageBudget>().cloned();
        ok(req)
    })));
    let mut upgrade = req("k");
    upgrade
        .headers_mut()
        .insert("x-ip", "1.2.3.4".parse().unwrap());
    upgrade
        .headers_mut()
        .insert("upgrade", "websocket".parse().unwrap());
    assert_eq!(svc.oneshot(upgrade).await.unwrap().status(), 200);
    let budget = kept.lock().unwrap().take().unwrap();
    assert_eq!(budget.rule(), "per-ip, per-key");
    budget.spend(1).await.unwrap();
    budget.spend(1).await.unwrap();
    // per-key (3 a minute) is spent by the upgrade and two messages.
    let refused = budget.spend(1).await.unwrap_err();
    assert_eq!(refused.rule(), "per-key");
    let left = |layer: &RateLimitLayer<Header, Fixed, MemoryStore<ManualClock>>, key: &str| {
        let mut buf = crate::key::KeyBuf::new();
        buf.push(key.as_bytes());
        layer.limiter().decide_now(buf.as_bytes(), 0).remaining
    };
    assert_eq!(left(&inner, "k"), 0);
    assert_eq!(
        left(&outer, "1.2.3.4"),
        10 - 3,
        "the refused message cost per-ip nothing"
    );
}

/// A shadow rule refuses no message (and paces none).
#[tokio::test]
async fn a_shadow_rule_refuses_no_message() {
    let clock = ManualClock::starting_at(1);
    let layer = per_key(&clock, Limit::fixed_window(1, Duration::from_secs(60)))
        .shadow(true)
        .messages(true)
        .build()
        .unwrap();
    let budget = MessageBudget::new(
        layer.limiter().clone(),
        {
            let mut buf = crate::key::KeyBuf::new();
            buf.push(b"k");
            crate::key::KeyBytes::new(&mut buf)
        },
        layer.responder(),
    );
    for _ in 0..3 {
        budget.spend(1).await.unwrap();
    }
}

/// The key's remaining budget under `layer`'s rule (a peek).
fn left_of<C>(layer: &RateLimitLayer<Header, C, MemoryStore<ManualClock>>, key: &str) -> u64 {
    let mut buf = crate::key::KeyBuf::new();
    buf.push(key.as_bytes());
    layer.limiter().decide_now(buf.as_bytes(), 0).remaining
}

/// A handler that takes `x-sleep-ms` and reports `x-actual` (an
/// `ActualCost`) and `x-length` (a `Content-Length`) when asked.
async fn measured(req: Req) -> Result<Response<String>, Infallible> {
    let header = |name: &str| {
        req.headers()
            .get(name)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
    };
    if let Some(ms) = header("x-sleep-ms") {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let mut res = Response::new(String::new());
    if let Some(n) = header("x-actual") {
        res.extensions_mut().insert(ActualCost(n));
    }
    if let Some(n) = header("x-length") {
        res.headers_mut()
            .insert("content-length", n.to_string().parse().unwrap());
    }
    Ok(res)
}

fn asking(key: &str, headers: &[(&'static str, &str)]) -> Req {
    let mut r = req(key);
    for (name, value) in headers {
        r.headers_mut().insert(*name, value.parse().unwrap());
    }
    r
}

/// 10 a second per key in bursts of 10, each request charged its
/// handler's time at 100 ms a unit.
fn charged_by_time(clock: &ManualClock) -> RateLimitLayer<Header, Fixed, MemoryStore<ManualClock>> {
    per_key(clock, Limit::gcra(Rate::per_second(10), 10))
        .charge_after(Measure::Elapsed {
            per: Duration::from_millis(100),
        })
        .build()
        .unwrap()
}

/// Issue 34 item 5, the handler's time: a call that took 1 s at 100 ms a
/// unit owes 9 units beyond its estimate of 1, which the key's next
/// request pays (refused until the rule can hold both); a call that took
/// less than its estimate gets the difference back.
#[tokio::test(start_paused = true)]
async fn a_slow_call_is_paid_for_by_the_keys_next_request() {
    let clock = ManualClock::starting_at(1);
    let layer = charged_by_time(&clock);
    let svc = layer.layer(service_fn(measured));
    let send = |headers: &[(&'static str, &str)]| svc.clone().oneshot(asking("k", headers));
    assert_eq!(send(&[("x-sleep-ms", "1000")]).await.unwrap().status(), 200);
    assert_eq!(left_of(&layer, "k"), 9, "the estimate was charged");
    // It owes 9: its next request costs 10, more than the 9 left.
    let refused = send(&[("x-sleep-ms", "1")]).await.unwrap();
    assert_eq!(refused.status(), 429);
    assert_eq!(refused.headers()["retry-after"], "1");
    assert_eq!(left_of(&layer, "k"), 9, "a refusal pays nothing");
    clock.advance(Duration::from_millis(100));
    assert_eq!(send(&[("x-sleep-ms", "1")]).await.unwrap().status(), 200);
    assert_eq!(left_of(&layer, "k"), 0, "the debt and the estimate paid");
    // Another key owes nothing.
    assert_eq!(
        svc.clone()
            .oneshot(asking("other", &[]))
            .await
            .unwrap()
            .status(),
        200
    );
}

/// What the handler reports, and the response's length: a cost above the
/// estimate is owed, one below it given back.
#[tokio::test]
async fn a_reported_cost_or_length_settles_against_the_estimate() {
    let clock = ManualClock::starting_at(1);
    let layer = per_key(&clock, Limit::fixed_window(10, Duration::from_secs(60)))
        .charge_after(Measure::ResponseBytes { per: 1_000 })
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(measured));
    let send = |headers: &[(&'static str, &str)]| svc.clone().oneshot(asking("k", headers));
    // Reported: 6 where 1 was charged, 5 owed.
    send(&[("x-actual", "6")]).await.unwrap();
    assert_eq!(left_of(&layer, "k"), 9);
    // 2,500 bytes: 3 units; with the 5 owed, 8 more.
    send(&[("x-length", "2500")]).await.unwrap();
    assert_eq!(left_of(&layer, "k"), 9 - 1 - 5);
    // Reported 0: an admitted request costs at least 1, its estimate;
    // it paid the 2 owed.
    send(&[("x-actual", "0")]).await.unwrap();
    assert_eq!(left_of(&layer, "k"), 3 - 2 - 1);
    // A chunked response (no declared length) is not free either.
    clock.advance(Duration::from_secs(60));
    for _ in 0..10 {
        assert_eq!(send(&[]).await.unwrap().status(), 200);
    }
    assert_eq!(send(&[]).await.unwrap().status(), 429);
    let e = per_key(&clock, Limit::fixed_window(10, Duration::from_secs(60)))
        .charge_after(Measure::Elapsed {
            per: Duration::ZERO,
        })
        .build()
        .unwrap_err();
    assert_eq!(e.field(), "charge_after");
}

/// Review: a call given up by a timeout above (its future dropped) was
/// charged only its estimate — the slowest calls, the ones this is for,
/// were the cheapest. Its handler's time so far is what it cost; a debt
/// larger than the rule can charge with one request refuses the key until
/// enough of it is freed, at the rule's rate.
#[tokio::test(start_paused = true)]
async fn a_call_given_up_is_charged_its_time_and_a_large_debt_waits() {
    let clock = ManualClock::starting_at(1);
    let layer = charged_by_time(&clock);
    let svc = layer.layer(service_fn(measured));
    let send = |headers: &[(&'static str, &str)]| svc.clone().oneshot(asking("k", headers));
    let given_up =
        tokio::time::timeout(Duration::from_secs(2), send(&[("x-sleep-ms", "60000")])).await;
    assert!(given_up.is_err());
    // 2 s: 20 units, 19 owed; 9 fit with a request: refused for the time
    // the other 10 take to free (1 s), decided without the store.
    let refused = send(&[]).await.unwrap();
    assert_eq!(refused.status(), 429);
    assert_eq!(refused.headers()["retry-after"], "1");
    assert_eq!(left_of(&layer, "k"), 9, "only the estimate was charged");
    // A second later 9 are left to pay, and the store's budget is whole
    // again (its own clock moved 100 ms): the request pays them.
    tokio::time::advance(Duration::from_secs(1)).await;
    clock.advance(Duration::from_millis(100));
    assert_eq!(send(&[("x-sleep-ms", "1")]).await.unwrap().status(), 200);
    assert_eq!(left_of(&layer, "k"), 0);
}

/// Review: a paced request whose wait is over keeps its charge (the
/// refund is defused) even if its service never gets ready; given up
/// then, it owed its debt again as well, so the debt was paid twice.
#[tokio::test(start_paused = true)]
async fn a_paced_request_given_up_after_its_wait_keeps_the_debt_it_paid() {
    let clock = ManualClock::starting_at(1);
    let layer = per_key(
        &clock,
        Limit::leaky_bucket(Rate::per_second(10), Duration::from_secs(2)),
    )
    .charge_after(Measure::Reported)
    .build()
    .unwrap();
    let open = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let svc = layer.layer(crate::late::Gated {
        open: std::sync::Arc::clone(&open),
        inner: service_fn(measured),
    });
    // Reported 6 where 1 was charged: 5 owed.
    let first = svc.clone().oneshot(asking("k", &[("x-actual", "6")])).await;
    assert_eq!(first.unwrap().status(), 200);
    let before = left_of(&layer, "k");
    // The next pays 1 and the 5, waits its turn, and finds its service
    // not ready; given up then, its charge stands.
    let mut waiting = svc.clone();
    let fut = waiting.ready().await.unwrap().call(asking("k", &[]));
    open.store(false, std::sync::atomic::Ordering::Relaxed);
    assert!(tokio::time::timeout(Duration::from_secs(5), fut)
        .await
        .is_err());
    assert_eq!(left_of(&layer, "k"), before - 6, "the charge stands");
    open.store(true, std::sync::atomic::Ordering::Relaxed);
    // Paid once: the next request costs its estimate.
    clock.advance(Duration::from_secs(5));
    let whole = left_of(&layer, "k");
    let third = svc.clone().oneshot(asking("k", &[])).await;
    assert_eq!(third.unwrap().status(), 200);
    assert_eq!(left_of(&layer, "k"), whole - 1);
}

/// Review: a request that costs more than the rule can ever admit was
/// refused for a debt's wait (a Retry-After it could never keep) when its
/// key owed; it is told it never fits, and the debt stays.
#[tokio::test]
async fn a_request_too_costly_for_the_rule_is_never_told_to_wait_for_a_debt() {
    let clock = ManualClock::starting_at(1);
    let layer = per_key(&clock, Limit::fixed_window(20, Duration::from_secs(60)))
        .cost(crate::cost::HeaderCost::named("x-cost", 1, 1_000).unwrap())
        .charge_after(Measure::Reported)
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(measured));
    let send = |headers: &[(&'static str, &str)]| svc.clone().oneshot(asking("k", headers));
    assert_eq!(send(&[("x-actual", "5")]).await.unwrap().status(), 200);
    let res = send(&[("x-cost", "21")]).await.unwrap();
    assert_eq!(res.status(), 429);
    assert!(res.headers().get("retry-after").is_none(), "never fits");
    assert_eq!(send(&[]).await.unwrap().status(), 200);
    assert_eq!(left_of(&layer, "k"), 20 - 1 - 1 - 4);
}
