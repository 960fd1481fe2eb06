use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use tokio::sync::mpsc;
use tollgate_core::adaptive::{AdaptiveLimit, Aimd};
use tollgate_core::Store;
use tower::{service_fn, Layer, Service, ServiceExt};

use super::*;
use crate::cost::ByMethod;
use crate::key::{Header, KeyExtractor};
use crate::rate_limit::MissingKey;
use crate::{MemoryStore, ResponseBody};

type Req = Request<String>;

/// A streaming body fed by the test: frames, an error, or the end.
struct Chan(mpsc::UnboundedReceiver<Result<Bytes, std::io::Error>>);

impl Body for Chan {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        self.0.poll_recv(cx).map(|f| f.map(|r| r.map(Frame::data)))
    }
}

type Feed = mpsc::UnboundedSender<Result<Bytes, std::io::Error>>;

/// A service whose responses stream from channels the test holds.
fn streaming() -> (
    impl Service<
            Req,
            Response = Response<ResponseBody<Chan>>,
            Error = Infallible,
            Future = impl Send,
        > + Clone,
    mpsc::UnboundedReceiver<Feed>,
) {
    let (feeds, rx) = mpsc::unbounded_channel();
    let svc = service_fn(move |_req: Req| {
        let (tx, body) = mpsc::unbounded_channel();
        let _ = feeds.send(tx);
        // A body type of the test's own: wrapped, as a user's would be.
        async move { Ok::<_, Infallible>(Response::new(ResponseBody::wrap(Chan(body)))) }
    });
    (svc, rx)
}

async fn ok(_req: Req) -> Result<Response<String>, Infallible> {
    Ok(Response::new("ok".to_owned()))
}

fn req(key: &str) -> Req {
    Request::builder()
        .uri("/download")
        .header("x-api-key", key)
        .body(String::new())
        .unwrap()
}

fn builder(
    max: u32,
) -> ConcurrencyLayerBuilder<Header, crate::cost::Fixed, AllCritical, MemoryStore> {
    ConcurrencyLayer::builder("per-key", max).key(Header::named("x-api-key").unwrap())
}

/// What `key` (an `x-api-key`) holds: read as the layer keys a request.
async fn held<K: KeyExtractor<String>, C, P, St: Store>(
    layer: &ConcurrencyLayer<K, C, P, St>,
    key: &str,
) -> u64 {
    layer.held_for(&req(key)).await.unwrap()
}

#[tokio::test]
async fn the_permit_lives_until_the_last_frame() {
    let layer = builder(2).build().unwrap();
    let (inner, mut feeds) = streaming();
    let svc = layer.layer(inner);
    let a = svc.clone().oneshot(req("k")).await.unwrap();
    let b = svc.clone().oneshot(req("k")).await.unwrap();
    assert_eq!((a.status(), b.status()), (StatusCode::OK, StatusCode::OK));
    assert_eq!(a.headers()["ratelimit"], "\"per-key\";r=1");
    assert_eq!(b.headers()["ratelimit"], "\"per-key\";r=0");
    let (fa, fb) = (feeds.recv().await.unwrap(), feeds.recv().await.unwrap());
    // Both bodies are still streaming: a third is refused at once.
    let c = svc.clone().oneshot(req("k")).await.unwrap();
    assert_eq!(c.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(c.headers()["retry-after"], "1");
    assert_eq!(c.headers()["ratelimit"], "\"per-key\";r=0;t=1");
    assert_eq!(
        c.headers()["ratelimit-policy"],
        "\"per-key\";q=2;qu=\"concurrent-requests\""
    );
    // Another key is independent.
    let other = svc.clone().oneshot(req("other")).await.unwrap();
    assert_eq!(other.status(), 200);
    assert_eq!(held(&layer, "other").await, 1, "its body is not read yet");

    // A frame read is not the end...
    let mut body_a = a.into_body();
    fa.send(Ok(Bytes::from_static(b"chunk"))).unwrap();
    let frame = body_a.frame().await.unwrap().unwrap();
    assert_eq!(frame.into_data().unwrap(), "chunk");
    assert_eq!(held(&layer, "k").await, 2);
    // ...the end of the stream is.
    drop(fa);
    assert!(body_a.frame().await.is_none());
    assert_eq!(held(&layer, "k").await, 1);
    // A body that fails releases too.
    let mut body_b = b.into_body();
    fb.send(Err(std::io::Error::other("reset"))).unwrap();
    assert!(body_b.frame().await.unwrap().is_err());
    assert_eq!(held(&layer, "k").await, 0);
    drop(body_b);
    assert_eq!(held(&layer, "k").await, 0, "released exactly once");
}

#[tokio::test]
async fn dropped_bodies_and_cancelled_requests_release() {
    let layer = builder(1).build().unwrap();
    let (inner, _feeds) = streaming();
    let svc = layer.layer(inner);
    let res = svc.clone().oneshot(req("k")).await.unwrap();
    assert_eq!(held(&layer, "k").await, 1);
    drop(res);
    assert_eq!(held(&layer, "k").await, 0);

    // A request cancelled before its response (the handler never answers).
    let never =
        service_fn(|_req: Req| std::future::pending::<Result<Response<String>, Infallible>>());
    let mut svc = layer.layer(never);
    let fut = svc.ready().await.unwrap().call(req("k"));
    assert_eq!(held(&layer, "k").await, 1);
    drop(fut);
    assert_eq!(held(&layer, "k").await, 0);
    // A timeout above gives up: the same.
    let res = tokio::time::timeout(Duration::from_millis(5), svc.clone().oneshot(req("k"))).await;
    assert!(res.is_err());
    assert_eq!(held(&layer, "k").await, 0);
}

#[tokio::test]
async fn weighted_permits_and_never() {
    let layer = builder(4)
        .cost(
            ByMethod::new(1)
                .method(Method::POST, 3)
                .method(Method::PUT, 5),
        )
        .build()
        .unwrap();
    let (inner, _feeds) = streaming();
    let svc = layer.layer(inner);
    let post = || {
        Request::post("/r")
            .header("x-api-key", "k")
            .body(String::new())
            .unwrap()
    };
    let a = svc.clone().oneshot(post()).await.unwrap();
    assert_eq!(a.status(), 200);
    assert_eq!(held(&layer, "k").await, 3);
    assert_eq!(svc.clone().oneshot(post()).await.unwrap().status(), 429);
    assert_eq!(svc.clone().oneshot(req("k")).await.unwrap().status(), 200);
    // Five permits of four can never be had: no Retry-After.
    let put = Request::put("/r")
        .header("x-api-key", "k")
        .body(String::new())
        .unwrap();
    let never = svc.clone().oneshot(put).await.unwrap();
    assert_eq!(never.status(), 429);
    assert!(never.headers().get("retry-after").is_none());
    let body = never.into_body().collect().await.unwrap().to_bytes();
    assert!(std::str::from_utf8(&body)
        .unwrap()
        .contains("never succeed"));
}

#[tokio::test]
async fn a_service_limit_sheds_load_and_gives_back_the_per_key_permit() {
    let layer = builder(2).service_limit("service", 3).build().unwrap();
    let (inner, _feeds) = streaming();
    let svc = layer.layer(inner);
    let mut bodies = Vec::new();
    for key in ["a", "a", "b"] {
        let res = svc.clone().oneshot(req(key)).await.unwrap();
        assert_eq!(res.status(), 200);
        bodies.push(res);
    }
    assert_eq!(
        bodies[2].headers()["ratelimit"],
        "\"per-key\";r=1, \"service\";r=0"
    );
    let shed = svc.clone().oneshot(req("c")).await.unwrap();
    assert_eq!(shed.status(), 429);
    assert_eq!(
        shed.headers()["ratelimit"],
        "\"per-key\";r=1, \"service\";r=0;t=1"
    );
    assert_eq!(
        shed.headers()["ratelimit-policy"],
        "\"per-key\";q=2;qu=\"concurrent-requests\", \"service\";q=3;qu=\"concurrent-requests\""
    );
    let body = shed.into_body().collect().await.unwrap().to_bytes();
    assert!(std::str::from_utf8(&body)
        .unwrap()
        .contains(r#""rule":"service""#));
    assert_eq!(
        held(&layer, "c").await,
        0,
        "the per-key permit was given back"
    );
    bodies.clear();
    assert_eq!(svc.clone().oneshot(req("c")).await.unwrap().status(), 200);
}

#[tokio::test]
async fn a_service_wide_key_is_counted_apart_and_the_same_for_every_caller() {
    // A layer keyed `Global` pins its key at the store (one word, no
    // lookup); a layer of the same rule whose key is written by a
    // closure is not pinned, and goes through the store's table: both
    // count the same permits.
    let store = MemoryStore::new();
    let global = ConcurrencyLayer::builder("service", 2)
        .key(crate::key::Global)
        .store(store.clone())
        .build()
        .unwrap();
    let closure = |_: &Req, key: &mut crate::key::KeyBuf| {
        key.push(b"global");
        Some(())
    };
    let same = ConcurrencyLayer::builder("service", 2)
        .key(closure)
        .store(store.clone())
        .build()
        .unwrap();
    let (inner, _feeds) = streaming();
    let (pinned, table) = (global.layer(inner.clone()), same.layer(inner));
    let a = pinned.clone().oneshot(req("a")).await.unwrap();
    assert_eq!(global.pinned(), Some(true));
    let b = table.clone().oneshot(req("b")).await.unwrap();
    assert_ne!(same.pinned(), Some(true), "a closure's key is read");
    assert_eq!((a.status(), b.status()), (StatusCode::OK, StatusCode::OK));
    assert_eq!(
        pinned.clone().oneshot(req("c")).await.unwrap().status(),
        429
    );
    assert_eq!(table.clone().oneshot(req("c")).await.unwrap().status(), 429);
    assert_eq!(held(&global, "x").await, 2);
    assert_eq!(global.limiter().held_now(b"\x06global"), 2);
    drop(a);
    assert_eq!(held(&same, "x").await, 1);
    drop(b);
    assert_eq!(held(&global, "x").await, 0);
    assert_eq!(pinned.oneshot(req("d")).await.unwrap().status(), 200);
}

#[tokio::test]
async fn a_request_refused_per_key_takes_nothing_from_the_service() {
    let store = MemoryStore::new();
    let layer = builder(1)
        .service_limit("service", 10)
        .store(store.clone())
        .build()
        .unwrap();
    let service = store
        .concurrency_limiter(
            &tollgate_core::ConcurrencyRule::new("service", 10, Duration::from_secs(30)).unwrap(),
        )
        .unwrap();
    let (inner, _feeds) = streaming();
    let svc = layer.layer(inner);
    let first = svc.clone().oneshot(req("k")).await.unwrap();
    for _ in 0..5 {
        assert_eq!(svc.clone().oneshot(req("k")).await.unwrap().status(), 429);
    }
    assert_eq!(service.held_now(super::limits::SERVICE_KEY), 1);
    // The service limit's one key is counted apart (pinned), not in the
    // store's table, where only the client's key is.
    assert!(layer.service_pinned());
    assert_eq!(store.key_count(), 1);
    drop(first);
    assert_eq!(service.held_now(super::limits::SERVICE_KEY), 0);
}

#[tokio::test]
async fn non_critical_requests_leave_a_reserve() {
    let critical = |r: &Req| r.headers().contains_key("x-critical");
    let layer = builder(10).critical(critical, 0.8).build().unwrap();
    let (inner, _feeds) = streaming();
    let svc = layer.layer(inner);
    let mut held_bodies = Vec::new();
    for _ in 0..8 {
        let res = svc.clone().oneshot(req("k")).await.unwrap();
        assert_eq!(res.status(), 200);
        held_bodies.push(res);
    }
    assert_eq!(svc.clone().oneshot(req("k")).await.unwrap().status(), 429);
    let crit = || {
        let mut r = req("k");
        r.headers_mut().insert("x-critical", "1".parse().unwrap());
        r
    };
    for _ in 0..2 {
        let res = svc.clone().oneshot(crit()).await.unwrap();
        assert_eq!(res.status(), 200);
        held_bodies.push(res);
    }
    assert_eq!(svc.clone().oneshot(crit()).await.unwrap().status(), 429);
}

#[tokio::test(start_paused = true)]
async fn the_queue_is_fifo_and_bounded_in_length_and_time() {
    let recorder = crate::rate_limit::tests::Recorded::default();
    let layer = metrics::with_local_recorder(&recorder, || {
        builder(1).queue(2, Duration::from_secs(5)).build().unwrap()
    });
    let depth = || recorder.gauge("tollgate_concurrency_queue_depth{rule=per-key}");
    let (inner, mut feeds) = streaming();
    let svc = layer.layer(inner);
    let first = svc.clone().oneshot(req("k")).await.unwrap();
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for i in 0..2 {
        let (svc, order) = (svc.clone(), Arc::clone(&order));
        waiters.push(tokio::spawn(async move {
            let res = svc.oneshot(req("k")).await.unwrap();
            order.lock().unwrap().push(i);
            res
        }));
        // Let it join the queue before the next one comes.
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // The queue holds two (the gauge says so): a third is refused at once.
    assert_eq!(depth(), 2.0);
    let full = svc.clone().oneshot(req("k")).await.unwrap();
    assert_eq!(full.status(), 429);
    assert_eq!(full.headers()["retry-after"], "1");
    let _f0 = feeds.recv().await.unwrap();
    drop(first);
    let second = waiters.remove(0).await.unwrap();
    assert_eq!(second.status(), 200);
    drop(second);
    let third = waiters.remove(0).await.unwrap();
    assert_eq!(third.status(), 200);
    assert_eq!(*order.lock().unwrap(), vec![0, 1]);
    assert_eq!(depth(), 0.0);
    // A wait longer than max_wait ends in a 429, at max_wait.
    let start = tokio::time::Instant::now();
    let late = svc.clone().oneshot(req("k")).await.unwrap();
    assert_eq!(late.status(), 429);
    assert_eq!(start.elapsed(), Duration::from_secs(5));
    assert_eq!(depth(), 0.0, "a waiter that timed out left the queue");
    drop(third);
    assert_eq!(svc.clone().oneshot(req("k")).await.unwrap().status(), 200);
}

/// Review M3: a queued request re-checked every `recheck` (here 100 ms)
/// for releases it cannot see, a store call each on Redis, so a full
/// queue multiplied a busy store's load. The re-checks back off: over a
/// 5 s wait, about log2(5 s / 100 ms) of them, not 50.
#[tokio::test(start_paused = true)]
async fn a_queued_request_rechecks_on_a_backing_off_timer() {
    let recorder = crate::rate_limit::tests::Recorded::default();
    let layer = metrics::with_local_recorder(&recorder, || {
        builder(1).queue(2, Duration::from_secs(5)).build().unwrap()
    });
    let (inner, _feeds) = streaming();
    let svc = layer.layer(inner);
    let held = svc.clone().oneshot(req("k")).await.unwrap();
    let waited = svc.clone().oneshot(req("k")).await.unwrap();
    assert_eq!(waited.status(), 429);
    let rechecks = recorder.get("tollgate_concurrency_queue_rechecks_total{rule=per-key}");
    assert!(
        (1..=7).contains(&rechecks),
        "{rechecks} re-checks in a 5 s wait"
    );
    drop(held);
}

#[tokio::test]
async fn shadow_mode_never_refuses() {
    let layer = builder(1).shadow(true).build().unwrap();
    let (inner, _feeds) = streaming();
    let svc = layer.layer(inner);
    let a = svc.clone().oneshot(req("k")).await.unwrap();
    let b = svc.clone().oneshot(req("k")).await.unwrap();
    assert_eq!((a.status(), b.status()), (StatusCode::OK, StatusCode::OK));
    assert!(b.headers().get("ratelimit").is_none(), "shadow headers");
    assert!(b.headers().get("retry-after").is_none());
    drop((a, b));
    assert_eq!(held(&layer, "k").await, 0);
}

#[tokio::test]
async fn missing_keys_and_grpc() {
    let layer = builder(1)
        .on_missing_key(MissingKey::Reject)
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(ok));
    let res = svc
        .clone()
        .oneshot(Request::new(String::new()))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);

    let layer = builder(1).build().unwrap();
    let (inner, _feeds) = streaming();
    let svc = layer.layer(inner);
    let grpc = || {
        Request::post("/svc/Method")
            .header("x-api-key", "g")
            .header("content-type", "application/grpc")
            .body(String::new())
            .unwrap()
    };
    let _held = svc.clone().oneshot(grpc()).await.unwrap();
    let res = svc.clone().oneshot(grpc()).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.headers()["grpc-status"], "8");
    assert_eq!(res.headers()["grpc-retry-pushback-ms"], "1000");
}

#[tokio::test]
async fn an_upgrade_handler_can_keep_the_permit() {
    let layer = builder(1).upgrades(true).build().unwrap();
    let kept = Arc::new(std::sync::Mutex::new(None));
    let k2 = Arc::clone(&kept);
    let svc = layer.layer(service_fn(move |req: Req| {
        let slot = req.extensions().get::<UpgradePermit>().cloned();
        *k2.lock().unwrap() = slot.and_then(|s| s.take());
        async { Ok::<_, Infallible>(Response::new(String::new())) }
    }));
    let upgrade = Request::get("/ws")
        .header("x-api-key", "k")
        .header("upgrade", "websocket")
        .body(String::new())
        .unwrap();
    let res = svc.clone().oneshot(upgrade).await.unwrap();
    res.into_body().collect().await.unwrap();
    assert_eq!(held(&layer, "k").await, 1, "the connection still counts");
    kept.lock().unwrap().take();
    assert_eq!(held(&layer, "k").await, 0);
}

/// Review m4: a handler that keeps the request's `UpgradePermit` without
/// taking it held the permit for as long as it kept the slot: the `101`
/// body that hyper drops unread gave only a clone back.
#[tokio::test]
async fn an_upgrade_permit_not_taken_goes_with_the_unread_101_body() {
    let layer = builder(1).upgrades(true).build().unwrap();
    let kept = Arc::new(std::sync::Mutex::new(None));
    let k2 = Arc::clone(&kept);
    let svc = layer.layer(service_fn(move |req: Req| {
        // Kept, not taken (say, moved into a task that never upgrades).
        *k2.lock().unwrap() = req.extensions().get::<UpgradePermit>().cloned();
        async {
            let mut res = Response::new(String::new());
            *res.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
            Ok::<_, Infallible>(res)
        }
    }));
    let upgrade = Request::get("/ws")
        .header("x-api-key", "k")
        .header("upgrade", "websocket")
        .body(String::new())
        .unwrap();
    let res = svc.clone().oneshot(upgrade).await.unwrap();
    assert_eq!(held(&layer, "k").await, 1);
    drop(res);
    assert_eq!(held(&layer, "k").await, 0, "the unread 101 body let it go");
    assert!(kept.lock().unwrap().as_ref().unwrap().take().is_none());
}

/// Channel lifetimes (000 §12): a response still streaming at the
/// layer's `max_lifetime` ends there, cleanly, and its permit goes back;
/// one that ends sooner is untouched.
#[tokio::test(start_paused = true)]
async fn a_stream_ends_at_its_permits_lifetime_and_frees_the_permit() {
    let layer = builder(1)
        .max_lifetime(Duration::from_secs(60))
        .build()
        .unwrap();
    let (inner, mut feeds) = streaming();
    let svc = layer.layer(inner);
    let mut sse = svc.clone().oneshot(req("k")).await.unwrap().into_body();
    let feed = feeds.recv().await.unwrap();
    feed.send(Ok(Bytes::from_static(b"data: 1\n\n"))).unwrap();
    let first = sse.frame().await.unwrap().unwrap();
    assert_eq!(first.into_data().unwrap(), "data: 1\n\n");
    // A second stream of the key waits for the first's permit.
    let refused = svc.clone().oneshot(req("k")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    tokio::time::advance(Duration::from_secs(59)).await;
    assert_eq!(held(&layer, "k").await, 1);
    // At 60 s the stream ends (no error), though its feed is still open.
    let end = tokio::time::timeout(Duration::from_secs(2), sse.frame())
        .await
        .expect("the body ends at the cap");
    assert!(end.is_none(), "a clean end, not an error");
    assert!(sse.is_end_stream());
    assert_eq!(held(&layer, "k").await, 0);
    assert!(feed.send(Ok(Bytes::from_static(b"late"))).is_ok());
    // A later response that ends in time is not cut.
    let next = svc.clone().oneshot(req("k")).await.unwrap();
    assert_eq!(next.status(), StatusCode::OK);
    let feed = feeds.recv().await.unwrap();
    feed.send(Ok(Bytes::from_static(b"whole"))).unwrap();
    drop(feed);
    let body = next.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "whole");
    assert_eq!(held(&layer, "k").await, 0);
}

/// A long poll whose handler has not answered by the cap is given up:
/// the permit goes back then, and the client is told to come again (503;
/// gRPC `UNAVAILABLE`, retried at once), not answered with a body cut
/// before its first byte.
#[tokio::test(start_paused = true)]
async fn a_handler_slower_than_the_lifetime_is_given_up_at_the_cap() {
    let layer = builder(1)
        .max_lifetime(Duration::from_secs(30))
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(|_req: Req| async {
        tokio::time::sleep(Duration::from_secs(3_600)).await;
        Ok::<_, Infallible>(Response::new("late".to_owned()))
    }));
    let poll = tokio::spawn(svc.clone().oneshot(req("k")));
    tokio::time::sleep(Duration::from_secs(29)).await;
    assert_eq!(held(&layer, "k").await, 1);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(held(&layer, "k").await, 0, "released at the cap");
    let res = poll.await.unwrap().unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(!res.headers().contains_key("retry-after"));
    let mut grpc = req("k");
    grpc.headers_mut()
        .insert("content-type", "application/grpc".parse().unwrap());
    let res = svc.oneshot(grpc).await.unwrap();
    assert_eq!(res.headers()["grpc-status"], "14");
    assert!(!res.headers().contains_key("grpc-retry-pushback-ms"));
}

/// Review: a request that says `Upgrade` but is served as any other (the
/// handler never takes its offered permit) held it in the slot with no
/// cap: its body ends at the cap like any other.
#[tokio::test(start_paused = true)]
async fn an_upgrade_header_does_not_escape_the_lifetime() {
    let layer = builder(1)
        .upgrades(true)
        .max_lifetime(Duration::from_secs(60))
        .build()
        .unwrap();
    let (inner, mut feeds) = streaming();
    let svc = layer.layer(inner);
    let mut sneaky = req("k");
    sneaky.headers_mut().insert("upgrade", "x".parse().unwrap());
    let mut body = svc.oneshot(sneaky).await.unwrap().into_body();
    let _feed = feeds.recv().await.unwrap();
    tokio::time::advance(Duration::from_secs(60)).await;
    let end = tokio::time::timeout(Duration::from_secs(2), body.frame())
        .await
        .expect("the body ends at the cap");
    assert!(end.is_none());
    assert_eq!(held(&layer, "k").await, 0);
}

/// Shadow mode changes no request: a stream past the cap goes on.
#[tokio::test(start_paused = true)]
async fn a_shadow_layer_cuts_nothing() {
    let layer = builder(1)
        .shadow(true)
        .max_lifetime(Duration::from_secs(60))
        .build()
        .unwrap();
    let (inner, mut feeds) = streaming();
    let svc = layer.layer(inner);
    let mut body = svc.oneshot(req("k")).await.unwrap().into_body();
    let feed = feeds.recv().await.unwrap();
    tokio::time::advance(Duration::from_secs(120)).await;
    feed.send(Ok(Bytes::from_static(b"still here"))).unwrap();
    let frame = body.frame().await.unwrap().unwrap();
    assert_eq!(frame.into_data().unwrap(), "still here");
}

/// A lifetime too long to name is no cap (and no panic).
#[tokio::test]
async fn an_endless_lifetime_is_no_cap() {
    let layer = builder(1).max_lifetime(Duration::MAX).build().unwrap();
    let svc = layer.layer(service_fn(ok));
    let res = svc.oneshot(req("k")).await.unwrap();
    assert_eq!(res.into_body().collect().await.unwrap().to_bytes(), "ok");
    assert_eq!(held(&layer, "k").await, 0);
}

/// A gRPC stream cut at its permit's lifetime ends with trailers, so the
/// client reads a status (`UNAVAILABLE`: reconnect), not a broken stream.
#[tokio::test(start_paused = true)]
async fn a_grpc_stream_ends_at_its_lifetime_with_a_status() {
    let layer = builder(1)
        .max_lifetime(Duration::from_secs(30))
        .build()
        .unwrap();
    let (inner, mut feeds) = streaming();
    let inner = inner.map_response(|mut res| {
        res.headers_mut()
            .insert("content-type", "application/grpc".parse().unwrap());
        res
    });
    let svc = layer.layer(inner);
    let mut stream = svc.oneshot(req("g")).await.unwrap().into_body();
    let _feed = feeds.recv().await.unwrap();
    tokio::time::advance(Duration::from_secs(30)).await;
    let last = tokio::time::timeout(Duration::from_secs(2), stream.frame())
        .await
        .expect("the stream ends at the cap")
        .unwrap()
        .unwrap();
    let trailers = last.into_trailers().unwrap();
    assert_eq!(trailers["grpc-status"], "14");
    assert!(stream.frame().await.is_none());
    assert_eq!(held(&layer, "g").await, 0);
}

/// An upgraded connection's permit carries the cap: its task learns when
/// to close the connection.
#[tokio::test(start_paused = true)]
async fn an_upgrade_permit_tells_when_its_lifetime_ends() {
    let layer = builder(1)
        .upgrades(true)
        .max_lifetime(Duration::from_secs(600))
        .build()
        .unwrap();
    let kept = Arc::new(std::sync::Mutex::new(None));
    let k2 = Arc::clone(&kept);
    let svc = layer.layer(service_fn(move |req: Req| {
        let slot = req.extensions().get::<UpgradePermit>().cloned();
        *k2.lock().unwrap() = slot.and_then(|s| s.take());
        async { Ok::<_, Infallible>(Response::new(String::new())) }
    }));
    let upgrade = Request::get("/ws")
        .header("x-api-key", "k")
        .header("upgrade", "websocket")
        .body(String::new())
        .unwrap();
    let admitted = tokio::time::Instant::now();
    drop(svc.oneshot(upgrade).await.unwrap());
    let permit = kept.lock().unwrap().take().unwrap();
    assert_eq!(
        permit.expires_at(),
        Some(admitted + Duration::from_secs(600))
    );
    let expired = tokio::time::timeout(Duration::from_secs(599), permit.expired()).await;
    assert!(expired.is_err(), "not before the cap");
    tokio::time::timeout(Duration::from_secs(2), permit.expired())
        .await
        .expect("at the cap");
    assert_eq!(held(&layer, "k").await, 1, "the task lets it go");
    drop(permit);
    assert_eq!(held(&layer, "k").await, 0);
}

#[tokio::test]
async fn config_errors_name_the_field() {
    let cases: Vec<(Result<_, _>, &str)> = vec![
        (builder(0).build().map(drop), "max"),
        (
            builder(1).max_lifetime(Duration::ZERO).build().map(drop),
            "max_lifetime",
        ),
        (builder(2_000_000).build().map(drop), "max"),
        // Options that conflict, or that nothing reads (review m13).
        (
            builder(1)
                .service_limit("s", 4)
                .adaptive_service_limit("a", AdaptiveLimit::Aimd(Aimd::new(1, 2, 4).unwrap()))
                .build()
                .map(drop),
            "service_limit",
        ),
        (
            builder(1)
                .adaptive_service_limit("a", AdaptiveLimit::Aimd(Aimd::new(1, 2, 4).unwrap()))
                .service_limit("s", 4)
                .build()
                .map(drop),
            "service_limit",
        ),
        (
            builder(1)
                .drop_classifier(|c: crate::outcome::Completion| c.is_overload())
                .build()
                .map(drop),
            "drop_classifier",
        ),
        (
            builder(1).critical(AllCritical, 0.0).build().map(drop),
            "non_critical_share",
        ),
        (
            builder(1).critical(AllCritical, f64::NAN).build().map(drop),
            "non_critical_share",
        ),
        (
            builder(1)
                .queue(0, Duration::from_secs(1))
                .build()
                .map(drop),
            "queue",
        ),
        (
            builder(1).queue(1, Duration::ZERO).build().map(drop),
            "queue",
        ),
        (
            builder(1).service_limit("per-key", 5).build().map(drop),
            "service_limit",
        ),
        (
            builder(1).service_limit("service", 0).build().map(drop),
            "service_limit",
        ),
        (
            builder(1).service_limit("bad name", 1).build().map(drop),
            "service_limit",
        ),
        (
            builder(1).retry_after(Duration::ZERO).build().map(drop),
            "retry_after",
        ),
        (
            builder(1).lease_ttl(Duration::ZERO).build().map(drop),
            "lease_ttl",
        ),
        (
            builder(1)
                .read_only_above(0.5, Duration::from_secs(10))
                .build()
                .map(drop),
            "read_only",
        ),
        // Read-only mode's errors name it, not its window (review m13).
        (
            builder(1)
                .adaptive_service_limit("a", AdaptiveLimit::Aimd(Aimd::new(1, 2, 4).unwrap()))
                .read_only_above(0.5, Duration::ZERO)
                .build()
                .map(drop),
            "read_only",
        ),
        (
            builder(1)
                .adaptive_service_limit("a", AdaptiveLimit::Aimd(Aimd::new(1, 2, 4).unwrap()))
                .read_only_min_requests(0)
                .read_only_above(0.5, Duration::from_secs(10))
                .build()
                .map(drop),
            "read_only",
        ),
        (
            builder(1)
                .adaptive_service_limit("a", AdaptiveLimit::Aimd(Aimd::new(1, 2, 4).unwrap()))
                .read_only_min_requests(5)
                .build()
                .map(drop),
            "read_only",
        ),
        // A service limit bound in the store with another maximum.
        (
            {
                let store = MemoryStore::new();
                builder(1)
                    .service_limit("s", 4)
                    .store(store.clone())
                    .build()
                    .unwrap();
                builder(1)
                    .service_limit("s", 8)
                    .store(store)
                    .build()
                    .map(drop)
            },
            "service_limit",
        ),
        (
            ConcurrencyLayer::builder("bad name", 1).build().map(drop),
            "name",
        ),
        (builder(1).plan("pro", 3).build().map(drop), "plans"),
        (
            builder(1)
                .plan("pro", 0)
                .plan_from_extension()
                .build()
                .map(drop),
            "plans",
        ),
        (
            builder(1)
                .plan("pro", 3)
                .plan("pro", 4)
                .plan_from_extension()
                .build()
                .map(drop),
            "plans",
        ),
        (
            builder(0)
                .plan("pro", 3)
                .plan_from_extension()
                .build()
                .map(drop),
            "max",
        ),
        (
            builder(1)
                .plan("pro", 2_000_000)
                .plan_from_extension()
                .build()
                .map(drop),
            "plans",
        ),
    ];
    for (result, field) in cases {
        assert_eq!(result.unwrap_err().field(), field);
    }
}

/// Access lists, as a policy's: an allowed key takes no permit, a denied
/// one is refused at once with 403.
#[tokio::test]
async fn access_lists_skip_or_refuse_before_the_limit() {
    let list = crate::policy::AccessList::new("access")
        .keys_from("x-api-key")
        .unwrap()
        .allow_keys(["internal"])
        .deny_keys(["banned"]);
    let layer = builder(1).access(list).build().unwrap();
    let (svc, mut feeds) = streaming();
    let svc = layer.layer(svc);
    let mut open = Vec::new();
    for _ in 0..3 {
        let res = svc.clone().oneshot(req("internal")).await.unwrap();
        assert_eq!(res.status(), 200);
        open.push((res, feeds.recv().await.unwrap()));
    }
    assert_eq!(held(&layer, "internal").await, 0);
    let res = svc.clone().oneshot(req("banned")).await.unwrap();
    assert_eq!(res.status(), 403);
    let res = svc.clone().oneshot(req("a")).await.unwrap();
    assert_eq!(res.status(), 200);
    open.push((res, feeds.recv().await.unwrap()));
    assert_eq!(svc.clone().oneshot(req("a")).await.unwrap().status(), 429);
}

/// Each plan has its own number of permits per key, shown in its headers;
/// a key's permits count against the plan of each request as it comes,
/// and an unknown plan is the default.
#[tokio::test]
async fn each_plan_has_its_own_limit() {
    let layer = builder(1)
        .plan("pro", 3)
        .plan_from_header("x-plan")
        .unwrap()
        .build()
        .unwrap();
    let (svc, mut feeds) = streaming();
    let svc = layer.layer(svc);
    let on = |plan: Option<&str>| {
        let mut r = req("a");
        if let Some(p) = plan {
            r.headers_mut().insert("x-plan", p.parse().unwrap());
        }
        r
    };
    let mut bodies = Vec::new();
    // Free: one at a time.
    let res = svc.clone().oneshot(on(None)).await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(
        res.headers()["ratelimit-policy"],
        "\"per-key\";q=1;qu=\"concurrent-requests\""
    );
    bodies.push((res, feeds.recv().await.unwrap()));
    let res = svc.clone().oneshot(on(Some("gold"))).await.unwrap();
    assert_eq!(res.status(), 429, "an unknown plan is the default");
    // Pro: three, counting the one free already holds.
    for _ in 0..2 {
        let res = svc.clone().oneshot(on(Some("pro"))).await.unwrap();
        assert_eq!(res.status(), 200);
        bodies.push((res, feeds.recv().await.unwrap()));
    }
    let res = svc.clone().oneshot(on(Some("pro"))).await.unwrap();
    assert_eq!(res.status(), 429);
    assert_eq!(
        res.headers()["ratelimit-policy"],
        "\"per-key\";q=3;qu=\"concurrent-requests\""
    );
    assert_eq!(res.headers()["ratelimit"], "\"per-key\";r=0;t=1");
    assert_eq!(held(&layer, "a").await, 3);
    // Finished downloads give their permits back, whatever the plan.
    for (res, feed) in bodies.drain(..) {
        drop(feed);
        res.into_body().collect().await.unwrap();
    }
    assert_eq!(held(&layer, "a").await, 0);
    let res = svc.clone().oneshot(on(None)).await.unwrap();
    assert_eq!(res.status(), 200);
}

#[tokio::test(start_paused = true)]
async fn a_degraded_service_turns_read_only() {
    let limit = AdaptiveLimit::Aimd(Aimd::new(1, 10, 100).unwrap());
    let layer = builder(100)
        .adaptive_service_limit("adaptive", limit)
        .read_only_above(0.5, Duration::from_secs(10))
        .build()
        .unwrap();
    // (`read_only_min_requests` says how many failures are enough; see
    // the next test.)
    let failing = Arc::new(AtomicU32::new(1));
    let f2 = Arc::clone(&failing);
    let svc = layer.layer(service_fn(move |_req: Req| {
        let status = if f2.load(Ordering::Relaxed) == 1 {
            503
        } else {
            200
        };
        async move {
            let mut res = Response::new(String::new());
            *res.status_mut() = StatusCode::from_u16(status).unwrap();
            Ok::<_, Infallible>(res)
        }
    }));
    for _ in 0..30 {
        let res = svc.clone().oneshot(req("k")).await.unwrap();
        assert_eq!(res.status(), 503);
    }
    // Every sample was a drop: the limit backed off to its minimum.
    assert_eq!(layer.adaptive_limit(), Some(1));
    let post = || {
        Request::post("/w")
            .header("x-api-key", "k")
            .body(String::new())
            .unwrap()
    };
    let refused = svc.clone().oneshot(post()).await.unwrap();
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(refused.headers()["retry-after"], "1");
    // Reads still go through; once the errors age out, writes do too.
    failing.store(0, Ordering::Relaxed);
    assert_eq!(svc.clone().oneshot(req("k")).await.unwrap().status(), 200);
    tokio::time::sleep(Duration::from_secs(11)).await;
    assert_eq!(svc.clone().oneshot(post()).await.unwrap().status(), 200);
}

#[tokio::test(start_paused = true)]
async fn a_critical_request_does_not_wait_behind_queued_non_critical_ones() {
    let critical = |r: &Req| r.headers().contains_key("x-critical");
    let layer = builder(10)
        .critical(critical, 0.8)
        .queue(100, Duration::from_secs(1))
        .build()
        .unwrap();
    let (inner, _feeds) = streaming();
    let svc = layer.layer(inner);
    let mut held_bodies = Vec::new();
    for _ in 0..8 {
        held_bodies.push(svc.clone().oneshot(req("k")).await.unwrap());
    }
    // A ninth non-critical request waits at the head of the queue...
    let waiting = tokio::spawn(svc.clone().oneshot(req("k")));
    tokio::time::sleep(Duration::from_millis(1)).await;
    // ...and a critical one takes a reserve permit at once.
    let start = tokio::time::Instant::now();
    let mut crit = req("k");
    crit.headers_mut()
        .insert("x-critical", "1".parse().unwrap());
    let res = svc.clone().oneshot(crit).await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(start.elapsed(), Duration::ZERO);
    // The non-critical one times out at its share.
    assert_eq!(waiting.await.unwrap().unwrap().status(), 429);
}

/// Review m5(b): a release woke only the head of the queue; a critical
/// waiter behind a non-critical head held to its share waited for its own
/// timer though the freed permit was its to take. A release now wakes the
/// critical waiters too.
#[tokio::test(start_paused = true)]
async fn a_release_wakes_a_critical_waiter_behind_a_head_held_to_its_share() {
    let critical = |r: &Req| r.headers().contains_key("x-critical");
    let layer = builder(4)
        .critical(critical, 0.5)
        .queue(10, Duration::from_secs(5))
        .build()
        .unwrap();
    let (inner, mut feeds) = streaming();
    let svc = layer.layer(inner);
    let crit = || {
        let mut r = req("k");
        r.headers_mut().insert("x-critical", "1".parse().unwrap());
        r
    };
    // Two non-critical permits (their share) and two critical: all four.
    let mut bodies = Vec::new();
    for r in [req("k"), req("k"), crit(), crit()] {
        let res = svc.clone().oneshot(r).await.unwrap();
        assert_eq!(res.status(), 200);
        bodies.push(res);
    }
    let mut feeds_held = Vec::new();
    for _ in 0..4 {
        feeds_held.push(feeds.recv().await.unwrap());
    }
    // A non-critical request heads the queue; a critical one waits behind.
    let head = tokio::spawn(svc.clone().oneshot(req("k")));
    tokio::time::sleep(Duration::from_millis(1)).await;
    let behind = tokio::spawn(svc.clone().oneshot(crit()));
    // Past its first re-check (100 ms), so its own timer is 200 ms away.
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(!behind.is_finished());
    // A critical body ends: the head cannot use the permit (held to 2),
    // the critical waiter can, at once.
    let released = tokio::time::Instant::now();
    drop(feeds_held.pop());
    drop(bodies.pop());
    let res = behind.await.unwrap().unwrap();
    assert_eq!(res.status(), 200);
    assert!(
        released.elapsed() < Duration::from_millis(10),
        "admitted {:?} after the release",
        released.elapsed()
    );
    assert_eq!(head.await.unwrap().unwrap().status(), 429);
}

#[tokio::test]
async fn keyless_requests_skip_only_the_per_key_limit() {
    let layer = builder(1)
        .on_missing_key(MissingKey::Skip)
        .service_limit("service", 2)
        .build()
        .unwrap();
    let (inner, _feeds) = streaming();
    let svc = layer.layer(inner);
    let keyless = || Request::new(String::new());
    let a = svc.clone().oneshot(keyless()).await.unwrap();
    let b = svc.clone().oneshot(keyless()).await.unwrap();
    assert_eq!((a.status(), b.status()), (StatusCode::OK, StatusCode::OK));
    assert_eq!(b.headers()["ratelimit"], "\"service\";r=0");
    let c = svc.clone().oneshot(keyless()).await.unwrap();
    assert_eq!(
        c.status(),
        429,
        "the service limit applies to keyless requests"
    );
    assert!(
        std::str::from_utf8(&c.into_body().collect().await.unwrap().to_bytes())
            .unwrap()
            .contains(r#""rule":"service""#)
    );
}

#[tokio::test]
async fn an_adaptive_limit_is_in_the_policy_even_when_a_key_is_refused_first() {
    let limit = AdaptiveLimit::Aimd(Aimd::new(5, 10, 100).unwrap());
    let layer = builder(1)
        .adaptive_service_limit("adaptive", limit)
        .build()
        .unwrap();
    let (inner, _feeds) = streaming();
    let svc = layer.layer(inner);
    let _first = svc.clone().oneshot(req("k")).await.unwrap();
    let refused = svc.clone().oneshot(req("k")).await.unwrap();
    assert_eq!(refused.status(), 429);
    assert_eq!(
        refused.headers()["ratelimit-policy"],
        "\"per-key\";q=1;qu=\"concurrent-requests\", \"adaptive\";q=10;qu=\"concurrent-requests\""
    );
    assert_eq!(refused.headers()["ratelimit"], "\"per-key\";r=0;t=1");
}

/// Concurrency review C1: a gradient probe ends on samples; a service
/// whose requests give none (their answers never come, or come as
/// streams that never end) held the limit at `min` for good. Refused
/// requests now let the controller see time pass, and the probe ends
/// after 10 s.
#[tokio::test(start_paused = true)]
async fn a_probe_without_samples_ends_by_time() {
    use tollgate_core::adaptive::Gradient;
    let limit = AdaptiveLimit::Gradient(Gradient::new(2, 20, 100).unwrap());
    let layer = adaptive_layer(limit);
    // Answers that never come: no sample ever.
    let svc = layer.layer(never_answers());
    let mut stuck = Vec::new();
    for i in 0..2 {
        let mut call = Box::pin(svc.clone().oneshot(req(&format!("k{i}"))));
        assert!(futures_poll(&mut call).await.is_none(), "admitted, waiting");
        stuck.push(call);
    }
    // The probe holds the limit at 2: the third is refused.
    let res = svc.clone().oneshot(req("k9")).await.unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(layer.adaptive_limit(), Some(2));
    tokio::time::sleep(Duration::from_secs(11)).await;
    // A refusal lets time pass; the probe ends: `initial`.
    let _ = svc.clone().oneshot(req("k9")).await.unwrap();
    assert_eq!(layer.adaptive_limit(), Some(20));
    let mut admitted = Box::pin(svc.clone().oneshot(req("k10")));
    assert!(futures_poll(&mut admitted).await.is_none(), "admitted now");
}

/// Polls `f` once: `Some` if it is ready.
async fn futures_poll<F: std::future::Future + Unpin>(f: &mut F) -> Option<F::Output> {
    std::future::poll_fn(|cx| match std::pin::Pin::new(&mut *f).poll(cx) {
        std::task::Poll::Ready(v) => std::task::Poll::Ready(Some(v)),
        std::task::Poll::Pending => std::task::Poll::Ready(None),
    })
    .await
}

/// Concurrency review m7: a queued request's `max_wait` began after its
/// first acquire, and an acquire in flight at the deadline ran on past
/// it. Now the wait is counted from the request's arrival and an acquire
/// still in flight at the deadline is given up: with acquires 300 ms
/// away and a wait of 500 ms, the refusal comes at 500 ms, not at 900.
#[tokio::test(start_paused = true)]
async fn a_queued_wait_ends_max_wait_after_arrival_whatever_is_in_flight() {
    let store = crate::late::Late(MemoryStore::new(), Duration::from_millis(300));
    let layer = builder(1)
        .store(store)
        .queue(4, Duration::from_millis(500))
        .build()
        .unwrap();
    let (inner, _feeds) = streaming();
    let svc = layer.layer(inner);
    let held = svc.clone().oneshot(req("k")).await.unwrap();
    assert_eq!(held.status(), 200);
    let arrived = tokio::time::Instant::now();
    let refused = svc.clone().oneshot(req("k")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(arrived.elapsed(), Duration::from_millis(500));
    assert!(refused.headers().contains_key("retry-after"));
    drop(held);
    // A store slower than the whole wait: the first acquire is answered
    // (an idle key is not refused for a slow store), and no acquire is
    // sent once the wait has run out.
    let store = crate::late::Late(MemoryStore::new(), Duration::from_millis(700));
    let layer = builder(1)
        .store(store)
        .queue(4, Duration::from_millis(500))
        .build()
        .unwrap();
    let (inner, _feeds) = streaming();
    let svc = layer.layer(inner);
    let arrived = tokio::time::Instant::now();
    let held = svc.clone().oneshot(req("k")).await.unwrap();
    assert_eq!(held.status(), 200);
    assert_eq!(arrived.elapsed(), Duration::from_millis(700));
    let arrived = tokio::time::Instant::now();
    let refused = svc.clone().oneshot(req("k")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        arrived.elapsed(),
        Duration::from_millis(700),
        "no acquire after the wait ran out"
    );
}

/// Review m13: read-only mode needed 20 requests in its window, fixed. A
/// service that sees few requests sets its own number: with 3, three
/// failing reads turn it read-only, and two do not.
#[tokio::test(start_paused = true)]
async fn read_only_mode_counts_after_the_requests_it_is_told() {
    let layer = read_only_layer(3);
    let svc = layer.layer(unavailable_when(|req| req.method() == Method::GET));
    let post = || {
        Request::post("/w")
            .header("x-api-key", "k")
            .body(String::new())
            .unwrap()
    };
    for _ in 0..2 {
        assert_eq!(svc.clone().oneshot(req("k")).await.unwrap().status(), 503);
    }
    assert_eq!(svc.clone().oneshot(post()).await.unwrap().status(), 200);
    // Three failures of four: over the threshold, with at least 3 seen.
    assert_eq!(svc.clone().oneshot(req("k")).await.unwrap().status(), 503);
    let refused = svc.clone().oneshot(post()).await.unwrap();
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(refused.headers().contains_key("retry-after"));
}

/// Concurrency review C1, for AIMD: pushed to its minimum (2) by
/// failures, with sixteen event streams then held open, new requests are
/// still admitted and the limit still moves: each stream's share of the
/// adaptive limit ended with its response's head.
#[tokio::test(start_paused = true)]
async fn aimd_at_its_minimum_with_streams_open_keeps_admitting_and_moving() {
    let limit = AdaptiveLimit::Aimd(Aimd::new(2, 16, 64).unwrap());
    let layer = adaptive_layer(limit);
    let (feeds_tx, mut feeds) = mpsc::unbounded_channel::<Feed>();
    let svc = layer.layer(service_fn(move |req: Req| {
        let feeds_tx = feeds_tx.clone();
        async move {
            let path = req.uri().path().to_owned();
            let res = match path.as_str() {
                "/fail" => {
                    let mut res =
                        Response::new(ResponseBody::wrap(Chan(mpsc::unbounded_channel().1)));
                    *res.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
                    res
                }
                "/stream" => {
                    let (tx, body) = mpsc::unbounded_channel();
                    let _ = feeds_tx.send(tx);
                    Response::new(ResponseBody::wrap(Chan(body)))
                }
                _ => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    let (tx, body) = mpsc::unbounded_channel();
                    drop(tx);
                    Response::new(ResponseBody::wrap(Chan(body)))
                }
            };
            Ok::<_, Infallible>(res)
        }
    }));
    let on = |path: &str, key: &str| {
        Request::get(path)
            .header("x-api-key", key)
            .body(String::new())
            .unwrap()
    };
    for _ in 0..40 {
        let res = svc.clone().oneshot(on("/fail", "f")).await.unwrap();
        assert_eq!(res.status(), 503);
    }
    assert_eq!(layer.adaptive_limit(), Some(2), "pushed to its minimum");
    // Sixteen streams, each held open.
    let mut streams = Vec::new();
    for i in 0..16 {
        let res = svc
            .clone()
            .oneshot(on("/stream", &format!("s{i}")))
            .await
            .unwrap();
        assert_eq!(res.status(), 200, "stream {i}");
        streams.push((res, feeds.recv().await.unwrap()));
    }
    // Batches of four at once: the limit grows, and soon admits them all.
    let mut last_admitted = 0;
    for batch in 0..30 {
        let calls: Vec<_> = (0..4)
            .map(|i| tokio::spawn(svc.clone().oneshot(on("/ok", &format!("b{batch}-{i}")))))
            .collect();
        last_admitted = 0;
        for c in calls {
            let res = c.await.unwrap().unwrap();
            if res.status() == 200 {
                last_admitted += 1;
            }
            res.into_body().collect().await.unwrap();
        }
    }
    assert_eq!(last_admitted, 4, "the last batch was admitted whole");
    let now = layer.adaptive_limit().unwrap();
    assert!(now >= 4, "the limit moved from its minimum: {now}");
    assert_eq!(streams.len(), 16, "the streams are still open");
}

/// Concurrency review, missing test 1: a request cancelled while the
/// service works on it gives the adaptive limit no sample, and its share
/// of the limit comes back.
#[tokio::test(start_paused = true)]
async fn a_cancelled_request_gives_no_sample_and_its_share_back() {
    let limit = AdaptiveLimit::Aimd(Aimd::new(1, 2, 100).unwrap());
    let layer = adaptive_layer(limit);
    let svc = layer.layer(never_answers());
    for round in 0..3 {
        let mut calls = Vec::new();
        for i in 0..2 {
            let mut call = Box::pin(svc.clone().oneshot(req(&format!("k{round}-{i}"))));
            assert!(futures_poll(&mut call).await.is_none(), "admitted, waiting");
            calls.push(call);
        }
        // The limit (2) is held: a third is refused.
        let res = svc.clone().oneshot(req("other")).await.unwrap();
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
        // Cancelled: no sample (a drop would lower the limit, a success
        // could raise it), and both shares back for the next round.
        drop(calls);
        assert_eq!(layer.adaptive_limit(), Some(2), "round {round}");
    }
}

/// Missing test 2: an inner service's error is a drop for the adaptive
/// limit, through the layer (the unit tests used a 503).
#[tokio::test(start_paused = true)]
async fn an_inner_error_is_a_drop() {
    let limit = AdaptiveLimit::Aimd(Aimd::new(1, 10, 100).unwrap());
    let layer = adaptive_layer(limit);
    let svc = layer.layer(service_fn(|_req: Req| async {
        Err::<Response<String>, _>(std::io::Error::other("the backend went away"))
    }));
    assert!(svc.clone().oneshot(req("k")).await.is_err());
    assert_eq!(layer.adaptive_limit(), Some(9));
    assert_eq!(held(&layer, "k").await, 0, "the permit went back");
}

/// Missing test 5: an inner service that is not ready at once (a buffer
/// or limit inside), then fails `poll_ready`: the request's permit goes
/// back, and the error reaches the caller.
#[tokio::test]
async fn a_permit_goes_back_when_the_inner_service_fails_to_get_ready() {
    #[derive(Clone)]
    struct NotReady(Arc<AtomicU32>);
    impl Service<Req> for NotReady {
        type Response = Response<String>;
        type Error = std::io::Error;
        type Future = std::future::Ready<Result<Response<String>, std::io::Error>>;
        fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), std::io::Error>> {
            // Pending once (waking at once), then an error.
            if self.0.fetch_add(1, Ordering::SeqCst).is_multiple_of(2) {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            Poll::Ready(Err(std::io::Error::other("not ready")))
        }
        fn call(&mut self, _req: Req) -> Self::Future {
            std::future::ready(Ok(Response::new(String::new())))
        }
    }
    let layer = builder(1).build().unwrap();
    let svc = layer.layer(NotReady(Arc::new(AtomicU32::new(0))));
    for _ in 0..3 {
        assert!(svc.clone().oneshot(req("k")).await.is_err());
        assert_eq!(
            held(&layer, "k").await,
            0,
            "a permit kept after poll_ready failed"
        );
    }
}

/// Missing test 9: read-only mode lets HEAD and OPTIONS through as it
/// does GET, and refuses a gRPC call with `UNAVAILABLE`.
#[tokio::test(start_paused = true)]
async fn read_only_mode_passes_safe_methods_and_answers_grpc_as_grpc() {
    let layer = read_only_layer(1);
    let svc = layer.layer(unavailable_when(|req| req.uri().path() == "/fail"));
    let on = |method: Method, path: &str| {
        Request::builder()
            .method(method)
            .uri(path)
            .header("x-api-key", "k")
            .body(String::new())
            .unwrap()
    };
    // Eight failures: still above half once the three reads below pass.
    for _ in 0..8 {
        let res = svc.clone().oneshot(on(Method::GET, "/fail")).await.unwrap();
        assert_eq!(res.status(), 503);
    }
    for method in [Method::GET, Method::HEAD, Method::OPTIONS] {
        let res = svc.clone().oneshot(on(method.clone(), "/r")).await.unwrap();
        assert_eq!(res.status(), 200, "{method}");
    }
    assert_eq!(
        svc.clone()
            .oneshot(on(Method::PUT, "/r"))
            .await
            .unwrap()
            .status(),
        503
    );
    let mut grpc = on(Method::POST, "/svc/Write");
    grpc.headers_mut()
        .insert("content-type", "application/grpc".parse().unwrap());
    let res = svc.clone().oneshot(grpc).await.unwrap();
    assert_eq!(res.status(), 200, "gRPC refusals are HTTP 200");
    assert_eq!(res.headers()["grpc-status"], "14", "UNAVAILABLE");
}

/// A per-key limit of 100 with an AIMD service limit (10 to start) and
/// read-only mode above half failures over 10 s, after `min` requests.
fn read_only_layer(
    min: u32,
) -> ConcurrencyLayer<Header, crate::cost::Fixed, AllCritical, MemoryStore> {
    let limit = AdaptiveLimit::Aimd(Aimd::new(1, 10, 100).unwrap());
    builder(100)
        .adaptive_service_limit("adaptive", limit)
        .read_only_min_requests(min)
        .read_only_above(0.5, Duration::from_secs(10))
        .build()
        .unwrap()
}

/// A service that answers 503 to the requests `fails` picks, 200 to the
/// rest.
fn unavailable_when(
    fails: fn(&Req) -> bool,
) -> impl Service<Req, Response = Response<String>, Error = Infallible, Future = impl Send> + Clone
{
    service_fn(move |req: Req| async move {
        let mut res = Response::new(String::new());
        if fails(&req) {
            *res.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
        }
        Ok::<_, Infallible>(res)
    })
}

/// A per-key limit of 100 with `limit` as the service's adaptive limit.
fn adaptive_layer(
    limit: AdaptiveLimit,
) -> ConcurrencyLayer<Header, crate::cost::Fixed, AllCritical, MemoryStore> {
    builder(100)
        .adaptive_service_limit("adaptive", limit)
        .build()
        .unwrap()
}

/// A service whose answers never come.
fn never_answers(
) -> impl Service<Req, Response = Response<String>, Error = Infallible, Future = impl Send> + Clone
{
    service_fn(|_req: Req| async {
        std::future::pending::<()>().await;
        Ok::<_, Infallible>(Response::new(String::new()))
    })
}

/// A memory store whose service-wide limit answers only through its
/// future (as if it were kept elsewhere), counting the per-key acquires
/// and releases.
#[derive(Clone)]
struct SlowService {
    memory: MemoryStore,
    acquires: Arc<AtomicU32>,
    releases: Arc<AtomicU32>,
}

#[derive(Clone)]
struct SlowServiceLimiter {
    inner: <MemoryStore as Store>::ConcurrencyLimiter,
    acquires: Arc<AtomicU32>,
    releases: Arc<AtomicU32>,
}

impl tollgate_core::ConcurrencyLimiter for SlowServiceLimiter {
    type AcquireFuture = <<MemoryStore as Store>::ConcurrencyLimiter as tollgate_core::ConcurrencyLimiter>::AcquireFuture;
    type ReleaseFuture = <<MemoryStore as Store>::ConcurrencyLimiter as tollgate_core::ConcurrencyLimiter>::ReleaseFuture;
    type HeldFuture = <<MemoryStore as Store>::ConcurrencyLimiter as tollgate_core::ConcurrencyLimiter>::HeldFuture;

    fn rule(&self) -> &tollgate_core::ConcurrencyRule {
        self.inner.rule()
    }

    fn acquire(&self, key: &[u8], permits: u32, ceiling: u32) -> Self::AcquireFuture {
        if key != super::limits::SERVICE_KEY {
            self.acquires.fetch_add(1, Ordering::SeqCst);
        }
        self.inner.acquire(key, permits, ceiling)
    }

    fn acquire_sync(
        &self,
        key: &[u8],
        permits: u32,
        ceiling: u32,
    ) -> Option<Result<tollgate_core::Acquire, tollgate_core::StoreError>> {
        if key == super::limits::SERVICE_KEY {
            return None;
        }
        self.acquires.fetch_add(1, Ordering::SeqCst);
        self.inner.acquire_sync(key, permits, ceiling)
    }

    fn release(&self, key: &[u8], lease: tollgate_core::Lease) -> Self::ReleaseFuture {
        if key != super::limits::SERVICE_KEY {
            self.releases.fetch_add(1, Ordering::SeqCst);
        }
        self.inner.release(key, lease)
    }

    fn held(&self, key: &[u8]) -> Self::HeldFuture {
        self.inner.held(key)
    }
}

impl Store for SlowService {
    type Limiter = <MemoryStore as Store>::Limiter;
    type ConcurrencyLimiter = SlowServiceLimiter;

    fn limiter(
        &self,
        rule: &tollgate_core::Rule,
    ) -> Result<Self::Limiter, tollgate_core::ConfigError> {
        self.memory.limiter(rule)
    }

    fn concurrency_limiter(
        &self,
        rule: &tollgate_core::ConcurrencyRule,
    ) -> Result<SlowServiceLimiter, tollgate_core::ConfigError> {
        Ok(SlowServiceLimiter {
            inner: self.memory.concurrency_limiter(rule)?,
            acquires: Arc::clone(&self.acquires),
            releases: Arc::clone(&self.releases),
        })
    }

    fn escalation(
        &self,
        rule: &tollgate_core::EscalationRule,
    ) -> Result<Arc<dyn tollgate_core::EscalationLimiter>, tollgate_core::ConfigError> {
        self.memory.escalation(rule)
    }
}

/// The concurrency review's design point (one admission path): a store
/// that answers the per-key limit at once and the service limit only
/// through its future used to have the per-key permit taken, given back,
/// and taken again through the other path (two acquires and a release
/// per request: another request could take the permit in between). The
/// admission now goes on from where it stopped: one acquire, and one
/// release when the response ends.
#[tokio::test]
async fn an_admission_that_waits_for_a_limit_goes_on_from_where_it_stopped() {
    let store = SlowService {
        memory: MemoryStore::new(),
        acquires: Arc::new(AtomicU32::new(0)),
        releases: Arc::new(AtomicU32::new(0)),
    };
    let layer = builder(2)
        .service_limit("service", 10)
        .store(store.clone())
        .build()
        .unwrap();
    let (inner, _feeds) = streaming();
    let svc = layer.layer(inner);
    let res = svc.clone().oneshot(req("k")).await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(
        (
            store.acquires.load(Ordering::SeqCst),
            store.releases.load(Ordering::SeqCst)
        ),
        (1, 0),
        "one per-key acquire, nothing given back while the response is out"
    );
    assert_eq!(held(&layer, "k").await, 1);
    drop(res);
    assert_eq!(store.releases.load(Ordering::SeqCst), 1);
    assert_eq!(held(&layer, "k").await, 0);
}
