use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tokio::time::Instant;
use tower::{service_fn, Layer, Service, ServiceExt};

use super::*;
use crate::{MemoryStore, TokioClock};

/// An upstream that answers `status` (with `headers`) while `failing`,
/// 200 otherwise; it counts attempts and keeps each request's body and
/// arrival time.
#[derive(Clone)]
struct Flaky {
    failing: Arc<AtomicBool>,
    status: StatusCode,
    headers: Vec<(&'static str, &'static str)>,
    attempts: Arc<AtomicU32>,
    seen: Arc<Mutex<Vec<(Instant, Bytes)>>>,
}

impl Flaky {
    fn new(status: u16, headers: &[(&'static str, &'static str)]) -> Self {
        Self {
            failing: Arc::new(AtomicBool::new(true)),
            status: StatusCode::from_u16(status).unwrap(),
            headers: headers.to_vec(),
            attempts: Arc::new(AtomicU32::new(0)),
            seen: Arc::new(Mutex::new(Vec::new())),
        }
    }

    fn service<B>(
        &self,
    ) -> impl Service<
        Request<ReplayBody<B>>,
        Response = Response<String>,
        Error = Infallible,
        Future = impl Send,
    > + Clone
           + Send
           + 'static
    where
        B: http_body::Body<Data = Bytes> + Send + 'static,
        B::Error: std::fmt::Debug,
    {
        let this = self.clone();
        service_fn(move |req: Request<ReplayBody<B>>| {
            let this = this.clone();
            async move {
                this.attempts.fetch_add(1, Ordering::Relaxed);
                let body = req.into_body().collect().await.unwrap().to_bytes();
                this.seen.lock().unwrap().push((Instant::now(), body));
                let mut res = Response::new(String::new());
                if this.failing.load(Ordering::Relaxed) {
                    *res.status_mut() = this.status;
                    for (k, v) in &this.headers {
                        res.headers_mut().insert(*k, v.parse().unwrap());
                    }
                }
                Ok::<_, Infallible>(res)
            }
        })
    }

    fn attempts(&self) -> u32 {
        self.attempts.load(Ordering::Relaxed)
    }
}

fn get() -> Request<String> {
    Request::get("http://upstream.test/items")
        .body(String::new())
        .unwrap()
}

fn store() -> MemoryStore<TokioClock> {
    MemoryStore::builder()
        .clock(TokioClock::new())
        .build()
        .unwrap()
}

async fn calls<S>(client: &S, n: u32) -> u32
where
    S: Service<Request<String>, Response = Response<String>, Error = crate::BoxError> + Clone,
{
    let mut ok = 0;
    for _ in 0..n {
        let res = client.clone().oneshot(get()).await.unwrap();
        ok += u32::from(res.status() == StatusCode::OK);
    }
    ok
}

#[tokio::test(start_paused = true)]
async fn a_budget_keeps_amplification_near_its_ratio_and_recovers() {
    // No budget to speak of (every call buys a thousand retries): each of
    // 200 calls to a dead upstream is tried three times.
    let dead = Flaky::new(503, &[]);
    let unbudgeted = RetryBudgetLayer::builder("none")
        .budget(1_000.0, 0, Duration::from_secs(10))
        .store(store())
        .build()
        .unwrap()
        .layer(dead.service());
    assert_eq!(calls(&unbudgeted, 200).await, 0);
    assert_eq!(dead.attempts(), 600, "amplification 3.0");

    // 20 % and no floor: at most 1.2 attempts per call.
    let dead = Flaky::new(503, &[]);
    let budgeted = RetryBudgetLayer::builder("twenty")
        .budget(0.2, 0, Duration::from_secs(10))
        .store(store())
        .build()
        .unwrap()
        .layer(dead.service());
    assert_eq!(calls(&budgeted, 200).await, 0);
    let attempts = dead.attempts();
    assert!(
        (220..=240).contains(&attempts),
        "{attempts} attempts for 200 calls"
    );
    // The upstream recovers: one attempt per call again.
    dead.failing.store(false, Ordering::Relaxed);
    assert_eq!(calls(&budgeted, 100).await, 100);
    assert_eq!(dead.attempts(), attempts + 100);
}

#[tokio::test(start_paused = true)]
async fn fractional_ratios_and_the_floor() {
    // 0.6 and no floor: three retries for every five calls (tower's
    // TpsBudget allowed one per call, tower#857).
    let dead = Flaky::new(503, &[]);
    let client = RetryBudgetLayer::builder("sixty")
        .budget(0.6, 0, Duration::from_secs(10))
        .max_attempts(2)
        .store(store())
        .build()
        .unwrap()
        .layer(dead.service());
    calls(&client, 100).await;
    assert_eq!(dead.attempts(), 160);
    // A floor of 10 a second lets a quiet client retry all the same.
    let dead = Flaky::new(503, &[]);
    let client = RetryBudgetLayer::builder("floor")
        .budget(0.0, 10, Duration::from_secs(10))
        .max_attempts(2)
        .store(store())
        .build()
        .unwrap()
        .layer(dead.service());
    calls(&client, 5).await;
    assert_eq!(dead.attempts(), 10);
}

#[tokio::test(start_paused = true)]
async fn servers_are_heard_on_when_and_whether_to_retry() {
    // Retry-After: 2 — no retry comes sooner.
    let slow = Flaky::new(503, &[("retry-after", "2")]);
    let client = RetryBudgetLayer::builder("after")
        .max_attempts(2)
        .store(store())
        .build()
        .unwrap()
        .layer(slow.service());
    client.oneshot(get()).await.unwrap();
    let seen = slow.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2);
    assert!(seen[1].0 - seen[0].0 >= Duration::from_secs(2));
    // gRPC pushback −1, or a 429 without Retry-After: retrying cannot help.
    for headers in [&[("grpc-retry-pushback-ms", "-1")][..], &[][..]] {
        let never = Flaky::new(429, headers);
        let client = RetryBudgetLayer::builder("never")
            .store(store())
            .build()
            .unwrap()
            .layer(never.service());
        let res = client.oneshot(get()).await.unwrap();
        assert_eq!(res.status(), 429);
        assert_eq!(never.attempts(), 1, "{headers:?}");
    }
    // A 404 is an answer, not a failure.
    let gone = Flaky::new(404, &[]);
    let client = RetryBudgetLayer::builder("answer")
        .store(store())
        .build()
        .unwrap()
        .layer(gone.service());
    client.oneshot(get()).await.unwrap();
    assert_eq!(gone.attempts(), 1);
}

/// The first attempt goes to the service that was polled ready, and each
/// retry polls it ready again: tower's `ConcurrencyLimit` (one permit)
/// panics on a call that was not. With a deadline (the boxed path) too,
/// where a POST is sent once.
#[tokio::test(start_paused = true)]
async fn attempts_go_to_a_ready_service() {
    for deadline in [None, Some(Duration::from_secs(60))] {
        let flaky = Flaky::new(503, &[]);
        let mut builder = RetryBudgetLayer::builder("ready")
            .max_attempts(3)
            .store(store());
        if let Some(d) = deadline {
            builder = builder.deadline(d);
        }
        let layer = builder.build().unwrap();
        let limited = tower::limit::ConcurrencyLimitLayer::new(1).layer(flaky.service());
        let client = layer.layer(limited);
        let res = client.clone().oneshot(get()).await.unwrap();
        assert_eq!(res.status(), 503);
        assert_eq!(flaky.attempts(), 3, "{deadline:?}");
        let post = Request::post("http://upstream.test/orders")
            .body(String::new())
            .unwrap();
        client.oneshot(post).await.unwrap();
        assert_eq!(flaky.attempts(), 4, "a POST is sent once ({deadline:?})");
    }
}

#[tokio::test(start_paused = true)]
async fn only_idempotent_requests_are_retried_and_bodies_replay_exactly() {
    let dead = Flaky::new(503, &[]);
    let layer = RetryBudgetLayer::builder("bodies")
        .buffer_limit(1_024)
        .store(store())
        .build()
        .unwrap();
    let client = layer.clone().layer(dead.service::<String>());
    let post = |key: Option<&str>| {
        let mut b = Request::post("http://upstream.test/orders");
        if let Some(k) = key {
            b = b.header("idempotency-key", k);
        }
        b.body("order #1 ✓".to_owned()).unwrap()
    };
    client.clone().oneshot(post(None)).await.unwrap();
    assert_eq!(dead.attempts(), 1, "a plain POST is sent once");
    client.clone().oneshot(post(Some("k1"))).await.unwrap();
    assert_eq!(dead.attempts(), 4);
    let seen = dead.seen.lock().unwrap().clone();
    for (_, body) in &seen[1..] {
        assert_eq!(body, "order #1 ✓".as_bytes(), "replayed byte for byte");
    }
    // A body over the bound: sent once.
    let dead = Flaky::new(503, &[]);
    let client = layer.clone().layer(dead.service::<Full<Bytes>>());
    let big = Request::put("http://upstream.test/blob")
        .body(Full::new(Bytes::from(vec![b'x'; 2_048])))
        .unwrap();
    client.oneshot(big).await.unwrap();
    assert_eq!(dead.attempts(), 1);
    let dead = Flaky::new(503, &[]);
    let client = layer.layer(dead.service::<Chunked>());
    let stream = Request::put("http://upstream.test/blob")
        .body(Chunked::of(&[b"a"]))
        .unwrap();
    client.oneshot(stream).await.unwrap();
    // A stream of unknown length that ends within the bound is read,
    // then replayed like any other (a gRPC message is such a body).
    assert_eq!(dead.attempts(), 3);
    assert!(dead.seen.lock().unwrap().iter().all(|s| s.1 == "a"));
}

#[tokio::test(start_paused = true)]
async fn a_deadline_bounds_the_whole_call() {
    let slow = Flaky::new(503, &[("retry-after", "5")]);
    let client = RetryBudgetLayer::builder("deadline")
        .max_attempts(5)
        .deadline(Duration::from_secs(3))
        .store(store())
        .build()
        .unwrap()
        .layer(slow.service());
    let start = Instant::now();
    client.oneshot(get()).await.unwrap();
    assert_eq!(
        slow.attempts(),
        1,
        "a retry 5 s away would pass the 3 s deadline"
    );
    assert!(start.elapsed() < Duration::from_secs(3));
}

#[tokio::test(start_paused = true)]
async fn a_deadline_cuts_off_an_attempt_in_flight() {
    // The first attempt fails at once; the retry hangs for a minute.
    let attempts = Arc::new(AtomicU32::new(0));
    let seen = Arc::clone(&attempts);
    let upstream = service_fn(move |_req: Request<ReplayBody<String>>| {
        let n = seen.fetch_add(1, Ordering::Relaxed);
        async move {
            let mut res = Response::new(String::new());
            if n == 0 {
                *res.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            } else {
                tokio::time::sleep(Duration::from_secs(60)).await;
            }
            Ok::<_, Infallible>(res)
        }
    });
    let client = RetryBudgetLayer::builder("cutoff")
        .deadline(Duration::from_secs(2))
        .store(store())
        .build()
        .unwrap()
        .layer(upstream);
    let start = Instant::now();
    let err = client.oneshot(get()).await.unwrap_err();
    assert!(err.is::<DeadlineExceeded>(), "{err}");
    assert_eq!(attempts.load(Ordering::Relaxed), 2);
    assert_eq!(start.elapsed(), Duration::from_secs(2));
}

#[tokio::test(start_paused = true)]
async fn a_server_asking_for_a_long_wait_gets_its_answer_back_at_once() {
    // A maintenance page: come back tomorrow. Not a call to hold for a day.
    let down = Flaky::new(503, &[("retry-after", "86400")]);
    let client = RetryBudgetLayer::builder("maintenance")
        .store(store())
        .build()
        .unwrap()
        .layer(down.service());
    let start = Instant::now();
    let res = client.oneshot(get()).await.unwrap();
    assert_eq!(res.status(), 503);
    assert_eq!(down.attempts(), 1);
    assert_eq!(start.elapsed(), Duration::ZERO);
    // Up to max_server_wait, the wait is honoured.
    let down = Flaky::new(503, &[("retry-after", "30")]);
    let client = RetryBudgetLayer::builder("patient")
        .max_attempts(2)
        .max_server_wait(Duration::from_secs(30))
        .store(store())
        .build()
        .unwrap()
        .layer(down.service());
    client.oneshot(get()).await.unwrap();
    let seen = down.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2);
    assert!(seen[1].0 - seen[0].0 >= Duration::from_secs(30));
}

#[tokio::test(start_paused = true)]
async fn trailers_are_replayed_with_the_body() {
    let trailers = Arc::new(Mutex::new(Vec::new()));
    let kept = Arc::clone(&trailers);
    let attempts = Arc::new(AtomicU32::new(0));
    let counted = Arc::clone(&attempts);
    let upstream = service_fn(move |req: Request<ReplayBody<WithTrailers>>| {
        let kept = Arc::clone(&kept);
        let n = counted.fetch_add(1, Ordering::Relaxed);
        async move {
            let collected = req.into_body().collect().await.unwrap();
            let t = collected.trailers().cloned();
            kept.lock().unwrap().push((t, collected.to_bytes()));
            let mut res = Response::new(String::new());
            if n == 0 {
                *res.status_mut() = StatusCode::BAD_GATEWAY;
            }
            Ok::<_, Infallible>(res)
        }
    });
    let client = RetryBudgetLayer::builder("trailers")
        .store(store())
        .build()
        .unwrap()
        .layer(upstream);
    let req = Request::put("http://upstream.test/blob")
        .body(WithTrailers(Some(Bytes::from_static(b"data")), true))
        .unwrap();
    let res = client.oneshot(req).await.unwrap();
    assert_eq!(res.status(), 200);
    let seen = trailers.lock().unwrap().clone();
    assert_eq!(seen.len(), 2);
    for (t, body) in seen {
        assert_eq!(body, "data");
        assert_eq!(t.unwrap()["checksum"], "abc", "trailers lost");
    }
}

/// A body of one data frame and a trailers frame, of known length.
struct WithTrailers(Option<Bytes>, bool);

impl http_body::Body for WithTrailers {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        if let Some(d) = self.0.take() {
            return std::task::Poll::Ready(Some(Ok(http_body::Frame::data(d))));
        }
        if std::mem::take(&mut self.1) {
            let mut t = http::HeaderMap::new();
            t.insert("checksum", "abc".parse().unwrap());
            return std::task::Poll::Ready(Some(Ok(http_body::Frame::trailers(t))));
        }
        std::task::Poll::Ready(None)
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.0.as_ref().map_or(0, |d| d.len() as u64))
    }
}

#[tokio::test(start_paused = true)]
async fn errors_that_say_retrying_cannot_help_are_not_retried() {
    for (error, retried) in [
        (Box::new(Throttled) as crate::BoxError, false),
        (Box::new(DeadlineExceeded), false),
        ("connection refused".into(), true),
    ] {
        let text = error.to_string();
        let error = Arc::new(Mutex::new(Some(error)));
        let attempts = Arc::new(AtomicU32::new(0));
        let counted = Arc::clone(&attempts);
        let upstream = service_fn(move |_req: Request<ReplayBody<String>>| {
            counted.fetch_add(1, Ordering::Relaxed);
            let e = error.lock().unwrap().take();
            async move {
                match e {
                    Some(e) => Err(e),
                    None => Ok(Response::new(String::new())),
                }
            }
        });
        let client = RetryBudgetLayer::builder("errors")
            .store(store())
            .build()
            .unwrap()
            .layer(upstream);
        let result = client.oneshot(get()).await;
        assert_eq!(result.is_ok(), retried, "{text}");
        let expected = if retried { 2 } else { 1 };
        assert_eq!(attempts.load(Ordering::Relaxed), expected, "{text}");
    }
}

#[tokio::test(start_paused = true)]
async fn adaptive_throttling_refuses_locally_when_the_upstream_rejects_most() {
    let dead = Flaky::new(503, &[]);
    let client = RetryBudgetLayer::builder("throttle")
        .max_attempts(1)
        .adaptive_throttling(2.0)
        .store(store())
        .build()
        .unwrap()
        .layer(dead.service());
    let mut throttled = 0;
    for _ in 0..200 {
        match client.clone().oneshot(get()).await {
            Ok(res) => assert_eq!(res.status(), 503),
            Err(e) => {
                assert!(e.is::<Throttled>());
                throttled += 1;
            }
        }
    }
    // Nearly every call is refused once the rejections pile up.
    assert!(throttled > 150, "{throttled} throttled of 200");
    assert_eq!(dead.attempts() + throttled, 200);
}

#[test]
fn the_upstream_key_is_the_host_without_credentials() {
    let key = |uri: &str| {
        let mut k = crate::key::KeyBuf::new();
        crate::key::KeyExtractor::extract(&Upstream, &Request::get(uri).body(()).unwrap(), &mut k)
            .unwrap();
        k.as_bytes().to_vec()
    };
    let plain = key("http://api.internal:8080/x");
    assert_eq!(key("http://user:secret@api.internal:8080/x"), plain);
    assert_eq!(key("http://API.Internal:8080/y"), plain);
    assert_ne!(key("http://api.internal:8081/x"), plain);
}

/// One dead host must not make the client refuse calls to a healthy one:
/// the throttle is kept per upstream, like the budget.
#[tokio::test(start_paused = true)]
async fn adaptive_throttling_is_per_upstream() {
    // `dead.internal` answers 503, `healthy.internal` 200; gRPC's
    // UNAVAILABLE counts as a rejection too (`grpc.internal`).
    let upstream = tower::service_fn(|req: Request<ReplayBody<String>>| {
        let host = req.uri().host().unwrap_or("").to_owned();
        async move {
            let mut res = Response::new(String::new());
            match host.as_str() {
                "dead.internal" => *res.status_mut() = StatusCode::SERVICE_UNAVAILABLE,
                "grpc.internal" => {
                    res.headers_mut()
                        .insert("content-type", "application/grpc".parse().unwrap());
                    res.headers_mut()
                        .insert("grpc-status", "14".parse().unwrap());
                }
                _ => {}
            }
            Ok::<_, std::convert::Infallible>(res)
        }
    });
    let client = RetryBudgetLayer::builder("hosts")
        .max_attempts(1)
        .adaptive_throttling(2.0)
        .store(store())
        .build()
        .unwrap()
        .layer(upstream);
    let to = |host: &str| {
        Request::get(format!("http://{host}/items"))
            .body(String::new())
            .unwrap()
    };
    for host in ["dead.internal", "grpc.internal"] {
        let mut throttled = 0;
        for _ in 0..200 {
            if client.clone().oneshot(to(host)).await.is_err() {
                throttled += 1;
            }
        }
        assert!(throttled > 150, "{host}: {throttled} throttled of 200");
    }
    for i in 0..200 {
        let res = client.clone().oneshot(to("healthy.internal")).await;
        assert_eq!(res.unwrap().status(), 200, "call {i} to the healthy host");
    }
}

#[test]
fn configuration_errors_name_the_field() {
    let e = |b: RetryBudgetLayerBuilder<Upstream, MemoryStore>| {
        b.build().map(drop).unwrap_err().field()
    };
    let b = || RetryBudgetLayer::builder("r");
    assert_eq!(e(b().max_attempts(0)), "max_attempts");
    assert_eq!(e(b().max_attempts(11)), "max_attempts");
    assert_eq!(e(b().budget(-1.0, 0, Duration::from_secs(1))), "ratio");
    assert_eq!(e(b().budget(0.2, 0, Duration::ZERO)), "window");
    assert_eq!(
        e(b().backoff(Duration::ZERO, Duration::from_secs(1))),
        "backoff"
    );
    assert_eq!(
        e(b().backoff(Duration::from_secs(2), Duration::from_secs(1))),
        "backoff"
    );
    assert_eq!(e(b().deadline(Duration::ZERO)), "deadline");
    assert_eq!(
        e(b().max_server_wait(Duration::from_secs(3_601))),
        "max_server_wait"
    );
    assert_eq!(e(b().adaptive_throttling(0.5)), "adaptive_throttling");
    assert_eq!(e(RetryBudgetLayer::builder("bad name")), "name");
}

/// What the budget holds after each withdrawal is recorded, in retries.
#[tokio::test(start_paused = true)]
async fn the_budget_left_after_each_withdrawal_is_recorded() {
    let recorder = crate::rate_limit::tests::Recorded::default();
    let dead = Flaky::new(503, &[]);
    // Each call deposits half a retry; no floor.
    let client = metrics::with_local_recorder(&recorder, || {
        RetryBudgetLayer::builder("half")
            .budget(0.5, 0, Duration::from_secs(10))
            .max_attempts(2)
            .store(store())
            .build()
            .unwrap()
    })
    .layer(dead.service());
    calls(&client, 4).await;
    // Half a retry: refused; one: granted, none left; and again.
    assert_eq!(
        recorder.samples("tollgate_retry_budget_remaining{rule=half}"),
        [0.5, 0.0, 0.5, 0.0]
    );
    assert_eq!(dead.attempts(), 6);
}

/// A body of unknown length (as a gRPC message or a chunked upload is):
/// `chunks`, one frame each, then the end.
struct Chunked(std::collections::VecDeque<Bytes>);

impl Chunked {
    fn of(chunks: &[&'static [u8]]) -> Self {
        Self(chunks.iter().map(|c| Bytes::from_static(c)).collect())
    }
}

impl http_body::Body for Chunked {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        std::task::Poll::Ready(self.0.pop_front().map(|c| Ok(http_body::Frame::data(c))))
    }
}

/// Quota review (retries for gRPC): every gRPC call is a POST with a body
/// of unknown length. Marked idempotent (an extension, or its path), it is
/// buffered up to the limit and retried with the same bytes; longer, it is
/// sent once, whole; unmarked, it is not retried.
#[tokio::test(start_paused = true)]
async fn marked_posts_of_unknown_length_are_buffered_and_retried() {
    let client = |flaky: &Flaky, limit: u64| {
        RetryBudgetLayer::builder("grpc")
            .store(store())
            .buffer_limit(limit)
            .idempotent_path("/pkg.Svc/Get")
            .build()
            .unwrap()
            .layer(flaky.service::<Chunked>())
    };
    let post = |path: &str, marked: bool| {
        let mut req = Request::post(format!("http://upstream.test{path}"))
            .body(Chunked::of(&[b"\0\0\0\0\x03", b"abc"]))
            .unwrap();
        if marked {
            req.extensions_mut().insert(Idempotent);
        }
        req
    };
    // Marked by its extension: two attempts, the same bytes each time.
    // The upstream heals once the first attempt has failed: before the
    // retry's backoff ends (time, paused, does not move while this task
    // is busy), whatever the jitter drew. (A fixed 1 ms lost to a backoff
    // drawn below it, and the retry failed again.)
    let flaky = Flaky::new(503, &[]);
    let first = flaky.clone();
    tokio::spawn(async move {
        // `seen` is written in the same poll that answers (no await in
        // between): once it holds the first attempt, that one failed.
        while first.seen.lock().unwrap().is_empty() {
            tokio::task::yield_now().await;
        }
        first.failing.store(false, Ordering::Relaxed);
    });
    let res = client(&flaky, 1024)
        .oneshot(post("/pkg.Svc/Put", true))
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let seen: Vec<Bytes> = flaky
        .seen
        .lock()
        .unwrap()
        .iter()
        .map(|s| s.1.clone())
        .collect();
    assert_eq!(seen.len(), 2);
    assert!(
        seen.iter().all(|b| &b[..] == b"\0\0\0\0\x03abc"),
        "{seen:?}"
    );
    // Marked by its path: retried too.
    let flaky = Flaky::new(503, &[]);
    let res = client(&flaky, 1024)
        .oneshot(post("/pkg.Svc/Get", false))
        .await
        .unwrap();
    assert_eq!(res.status(), 503);
    assert_eq!(flaky.attempts(), 3);
    // Not marked: a POST, sent once.
    let flaky = Flaky::new(503, &[]);
    client(&flaky, 1024)
        .oneshot(post("/pkg.Svc/Put", false))
        .await
        .unwrap();
    assert_eq!(flaky.attempts(), 1);
    // Longer than the limit: sent once, every byte in order.
    let flaky = Flaky::new(503, &[]);
    client(&flaky, 4)
        .oneshot(post("/pkg.Svc/Get", false))
        .await
        .unwrap();
    assert_eq!(flaky.attempts(), 1);
    let seen = flaky.seen.lock().unwrap()[0].1.clone();
    assert_eq!(&seen[..], b"\0\0\0\0\x03abc");
}

#[test]
fn the_buffer_limit_is_bounded() {
    for bad in [0, MAX_BUFFER_LIMIT + 1] {
        let err = RetryBudgetLayer::builder("b")
            .buffer_limit(bad)
            .build()
            .unwrap_err();
        assert_eq!(err.field(), "buffer_limit");
    }
    let err = RetryBudgetLayer::builder("b")
        .idempotent_path("pkg.Svc/Get")
        .build()
        .unwrap_err();
    assert_eq!(err.field(), "idempotent_path");
    assert!(RetryBudgetLayer::builder("b")
        .buffer_limit(MAX_BUFFER_LIMIT)
        .build()
        .is_ok());
}

/// Quota-bandwidth-retry review #18: the deadline was checked before the
/// budget's withdrawal, and a withdrawal slow enough pushed the wait past
/// it: the caller got `DeadlineExceeded` and the answer in hand was lost.
/// Now the deadline is checked again once the withdrawal answers: the
/// 503 comes back.
#[tokio::test(start_paused = true)]
async fn a_slow_withdrawal_that_leaves_no_time_returns_the_answer_in_hand() {
    let down = Flaky::new(503, &[("retry-after", "2")]);
    let store = crate::late::Late(
        MemoryStore::builder()
            .clock(TokioClock::new())
            .build()
            .unwrap(),
        Duration::from_millis(1_500),
    );
    let client = RetryBudgetLayer::builder("slow-budget")
        .backoff(Duration::from_millis(1), Duration::from_millis(1))
        .deadline(Duration::from_secs(3))
        .store(store)
        .build()
        .unwrap()
        .layer(down.service());
    let start = Instant::now();
    let res = client.oneshot(get()).await.expect("the answer in hand");
    assert_eq!(res.status(), 503);
    assert_eq!(down.attempts(), 1);
    assert!(start.elapsed() < Duration::from_secs(3));
}

/// An upstream whose attempt `n` (from 0) answers 200 after `latency(n)`;
/// it counts attempts, and attempts dropped before they answered.
#[derive(Clone)]
struct Slow {
    latency: Arc<dyn Fn(u32) -> Duration + Send + Sync>,
    attempts: Arc<AtomicU32>,
    cancelled: Arc<AtomicU32>,
}

impl Slow {
    fn new(latency: impl Fn(u32) -> Duration + Send + Sync + 'static) -> Self {
        Self {
            latency: Arc::new(latency),
            attempts: Arc::new(AtomicU32::new(0)),
            cancelled: Arc::new(AtomicU32::new(0)),
        }
    }

    fn service(
        &self,
    ) -> impl Service<
        Request<ReplayBody<String>>,
        Response = Response<String>,
        Error = Infallible,
        Future = impl Send,
    > + Clone
           + Send
           + 'static {
        let this = self.clone();
        service_fn(move |_req: Request<ReplayBody<String>>| {
            let this = this.clone();
            async move {
                let n = this.attempts.fetch_add(1, Ordering::Relaxed);
                // Counts a cancellation unless the answer is given.
                struct Guard(Arc<AtomicU32>, bool);
                impl Drop for Guard {
                    fn drop(&mut self) {
                        if !self.1 {
                            self.0.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                let mut guard = Guard(Arc::clone(&this.cancelled), false);
                tokio::time::sleep((this.latency)(n)).await;
                guard.1 = true;
                Ok::<_, Infallible>(Response::new(format!("attempt {n}")))
            }
        })
    }
}

/// Quota-bandwidth-retry issue, hedging: a call still unanswered after
/// the hedge's delay is sent again; the faster answer wins and the slow
/// attempt is dropped.
#[tokio::test(start_paused = true)]
async fn a_slow_call_is_hedged_and_the_slow_attempt_is_dropped() {
    // The first attempt hangs for a second; the hedge answers in 10 ms.
    let upstream = Slow::new(|n| Duration::from_millis(if n == 0 { 1_000 } else { 10 }));
    let client = RetryBudgetLayer::builder("hedged")
        .store(store())
        .hedge(Hedge::after(Duration::from_millis(50)))
        .build()
        .unwrap()
        .layer(upstream.service());
    let started = Instant::now();
    let res = client.oneshot(get()).await.unwrap();
    assert_eq!(res.into_body(), "attempt 1");
    assert_eq!(started.elapsed(), Duration::from_millis(60));
    assert_eq!(upstream.attempts.load(Ordering::Relaxed), 2);
    assert_eq!(
        upstream.cancelled.load(Ordering::Relaxed),
        1,
        "the loser runs on"
    );
}

/// Hedging counts: a hedge is a withdrawal from the same budget as a
/// retry, so with every call slow enough to be hedged, 200 calls make at
/// most the budget's 20 % more attempts, not twice as many; and a call
/// that may not be retried (a `POST`) is never hedged.
#[tokio::test(start_paused = true)]
async fn hedges_draw_on_the_retry_budget() {
    let upstream = Slow::new(|_| Duration::from_millis(100));
    let client = RetryBudgetLayer::builder("hedged")
        .budget(0.2, 0, Duration::from_secs(600))
        .store(store())
        .hedge(Hedge::after(Duration::from_millis(10)))
        .build()
        .unwrap()
        .layer(upstream.service());
    for _ in 0..200 {
        let res = client.clone().oneshot(get()).await.unwrap();
        assert_eq!(res.status(), 200);
    }
    let attempts = upstream.attempts.load(Ordering::Relaxed);
    assert!(
        (220..=240).contains(&attempts),
        "{attempts} attempts for 200 hedged calls"
    );
    let before = upstream.attempts.load(Ordering::Relaxed);
    let post = Request::post("http://upstream.test/orders")
        .body(String::new())
        .unwrap();
    client.oneshot(post).await.unwrap();
    assert_eq!(upstream.attempts.load(Ordering::Relaxed), before + 1);
}

/// A percentile hedge learns the upstream's latency: once it has seen
/// calls answer in about 20 ms, a call slower than its 90th percentile
/// (here, one of a second) is hedged at about 20 ms, not at the floor.
#[tokio::test(start_paused = true)]
async fn a_percentile_hedge_waits_for_the_latency_seen() {
    let slow_at = Arc::new(AtomicU32::new(u32::MAX));
    let slow = Arc::clone(&slow_at);
    let upstream = Slow::new(move |n| {
        Duration::from_millis(if n == slow.load(Ordering::Relaxed) {
            1_000
        } else {
            20
        })
    });
    let client = RetryBudgetLayer::builder("p90")
        .budget(0.5, 0, Duration::from_secs(600))
        .store(store())
        .hedge(Hedge::percentile(90.0, Duration::from_millis(5)))
        .build()
        .unwrap()
        .layer(upstream.service());
    for _ in 0..200 {
        client.clone().oneshot(get()).await.unwrap();
    }
    // The first hundred calls were hedged at the 5 ms floor as far as the
    // budget allowed (half a retry a call: every other one); then none,
    // as every call answers within the 90th percentile.
    let attempts = upstream.attempts.load(Ordering::Relaxed);
    assert!((245..=255).contains(&attempts), "{attempts} attempts");
    slow_at.store(attempts, Ordering::Relaxed);
    let started = Instant::now();
    let res = client.oneshot(get()).await.unwrap();
    assert_eq!(res.into_body(), format!("attempt {}", attempts + 1));
    // Hedged at 20 ms's bucket (up to 23.2 ms), answered 20 ms later.
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(40) && took <= Duration::from_millis(44),
        "{took:?}"
    );
}

/// Review of the hedging: an answer worth a retry (a 503) waited for the
/// hedge however long it took, so a hung hedge held the call with an
/// answer in hand. It now waits at most the hedge's delay, then the
/// retries go on: here the third attempt answers.
#[tokio::test(start_paused = true)]
async fn a_hung_hedge_does_not_hold_a_retryable_answer() {
    let attempts = Arc::new(AtomicU32::new(0));
    let upstream = {
        let attempts = Arc::clone(&attempts);
        service_fn(move |_req: Request<ReplayBody<String>>| {
            let n = attempts.fetch_add(1, Ordering::Relaxed);
            async move {
                let mut res = Response::new(format!("attempt {n}"));
                match n {
                    0 => {
                        tokio::time::sleep(Duration::from_millis(60)).await;
                        *res.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
                    }
                    1 => std::future::pending::<()>().await,
                    _ => {}
                }
                Ok::<_, Infallible>(res)
            }
        })
    };
    let client = RetryBudgetLayer::builder("hedged")
        .budget(1.0, 10, Duration::from_secs(10))
        .store(store())
        .backoff(Duration::from_millis(10), Duration::from_millis(20))
        .hedge(Hedge::after(Duration::from_millis(50)))
        .build()
        .unwrap()
        .layer(upstream);
    let started = Instant::now();
    let res = client.oneshot(get()).await.unwrap();
    assert_eq!(res.into_body(), "attempt 2");
    // 60 ms for the 503, at most 50 more for the hedge, the backoff.
    assert!(
        started.elapsed() <= Duration::from_millis(140),
        "{:?}",
        started.elapsed()
    );
}
