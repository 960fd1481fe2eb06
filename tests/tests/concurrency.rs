//! The concurrency layer through real HTTP on loopback: permits live as
//! long as the response body, and none leaks — whatever the client or the
//! handler does — on the in-memory store and on Redis.
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::arithmetic_side_effects,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use http::Request;
use http_body::Frame;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::Sleep;
use tollgate::concurrency::ConcurrencyLayer;
use tollgate::core::{ConcurrencyLimiter, ConcurrencyRule, Store};
use tollgate::key::Header;
use tollgate::{MemoryStore, RedisStore};
use tollgate_redis::testing::{unique_prefix, Server};
use tower_http::catch_panic::CatchPanicLayer;

const KEYS: usize = 8;

/// `frames` frames of 1 KiB, one every `every`, then the end — or an
/// error in place of the last frame.
struct Slow {
    frames: u32,
    every: Duration,
    sleep: Pin<Box<Sleep>>,
    fail: bool,
}

impl Slow {
    fn new(frames: u32, every: Duration, fail: bool) -> Self {
        Self {
            frames,
            every,
            sleep: Box::pin(tokio::time::sleep(every)),
            fail,
        }
    }
}

impl http_body::Body for Slow {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        if self.frames == 0 {
            return Poll::Ready(None);
        }
        std::task::ready!(self.sleep.as_mut().poll(cx));
        let next = tokio::time::Instant::now() + self.every;
        self.sleep.as_mut().reset(next);
        self.frames -= 1;
        if self.frames == 0 && self.fail {
            return Poll::Ready(Some(Err(std::io::Error::other("the body failed"))));
        }
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(vec![b'x'; 1024])))))
    }
}

use std::future::Future as _;

/// `n` frames of 64 KiB, as fast as the client takes them.
struct Big(u32);

impl http_body::Body for Big {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        static CHUNK: [u8; 64 << 10] = [b'x'; 64 << 10];
        if self.0 == 0 {
            return Poll::Ready(None);
        }
        self.0 -= 1;
        Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(&CHUNK)))))
    }
}

/// Per-key 4 permits and 32 for the whole service, in `store`, over
/// routes that stream, stall, fail and panic (behind `CatchPanicLayer`,
/// outside the limiter, so a panic unwinds through its future).
fn app<S: Store>(store: S) -> Router {
    app_queued(store, None)
}

/// [`app`], with requests that find their key full waiting in a queue of
/// `queue` (length, longest wait) if given.
fn app_queued<S: Store>(store: S, queue: Option<(usize, Duration)>) -> Router {
    let mut builder = ConcurrencyLayer::builder("per-key", 4)
        .key(Header::named("x-api-key").unwrap())
        .service_limit("service", 32)
        .store(store);
    if let Some((len, wait)) = queue {
        builder = builder.queue(len, wait);
    }
    let layer = builder.build().unwrap();
    Router::new()
        .route(
            "/stream",
            get(|| async { Body::new(Slow::new(8, Duration::from_millis(1), false)) }),
        )
        .route("/big", get(|| async { Body::new(Big(512)) }))
        .route(
            "/slow",
            get(|| async {
                tokio::time::sleep(Duration::from_millis(30)).await;
                "late"
            }),
        )
        .route(
            "/fail",
            get(|| async { Body::new(Slow::new(3, Duration::from_millis(1), true)) }),
        )
        .route(
            "/panic",
            get(|| async {
                if true {
                    panic!("the handler panicked");
                }
                ""
            }),
        )
        .layer(layer)
        .layer(CatchPanicLayer::new())
}

type Sender = hyper::client::conn::http1::SendRequest<Empty<Bytes>>;

async fn connect(addr: SocketAddr) -> (Sender, tokio::task::JoinHandle<()>) {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    (
        sender,
        tokio::spawn(async move {
            let _ = conn.await;
        }),
    )
}

fn get_req(path: &str, key: usize) -> Request<Empty<Bytes>> {
    Request::get(path)
        .header("x-api-key", format!("k{key}"))
        .header("host", "localhost")
        .body(Empty::new())
        .unwrap()
}

/// One request of a random kind; returns what happened, for the tally.
async fn one(addr: SocketAddr, kind: u64, key: usize) -> &'static str {
    let (mut sender, conn) = connect(addr).await;
    let outcome = match kind {
        // Read a streamed body to its end.
        0 => {
            let res = sender.send_request(get_req("/stream", key)).await.unwrap();
            let status = res.status();
            res.into_body().collect().await.unwrap();
            if status == 200 {
                "streamed"
            } else {
                "refused"
            }
        }
        // Give up before the response (a client timeout).
        1 => {
            let res = tokio::time::timeout(
                Duration::from_millis(5),
                sender.send_request(get_req("/slow", key)),
            )
            .await;
            match res {
                Err(_) => "cancelled before the response",
                Ok(r) if r.as_ref().unwrap().status() == 429 => "refused",
                Ok(_) => "answered",
            }
        }
        // Read one frame, then hang up mid-body.
        2 => {
            let res = sender.send_request(get_req("/stream", key)).await.unwrap();
            if res.status() != 200 {
                "refused"
            } else {
                let mut body = res.into_body();
                let _ = body.frame().await;
                "cancelled mid-body"
            }
        }
        // A body that fails after two frames.
        3 => {
            let res = sender.send_request(get_req("/fail", key)).await.unwrap();
            if res.status() != 200 {
                "refused"
            } else if res.into_body().collect().await.is_err() {
                "body failed"
            } else {
                panic!("a failing body ended cleanly")
            }
        }
        // A handler that panics.
        _ => {
            let res = sender.send_request(get_req("/panic", key)).await.unwrap();
            match res.status().as_u16() {
                500 => "panicked",
                429 => "refused",
                s => panic!("a panic answered {s}"),
            }
        }
    };
    drop(sender);
    conn.abort();
    outcome
}

/// Sends `total` requests of random kinds from 40 concurrent clients.
async fn storm(addr: SocketAddr, total: usize) -> HashMap<&'static str, usize> {
    // The handler's panics are expected: keep them out of the output.
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let expected = info
            .payload()
            .downcast_ref::<&str>()
            .is_some_and(|m| *m == "the handler panicked");
        if !expected {
            default(info);
        }
    }));
    let tally = Arc::new(Mutex::new(HashMap::new()));
    let mut clients = Vec::new();
    let per_client = total / 40;
    for c in 0..40u64 {
        let tally = Arc::clone(&tally);
        clients.push(tokio::spawn(async move {
            let mut rng = c.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            for _ in 0..per_client {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let outcome = one(addr, rng % 5, (rng >> 8) as usize % KEYS).await;
                *tally.lock().unwrap().entry(outcome).or_insert(0) += 1;
            }
        }));
    }
    for c in clients {
        c.await.unwrap();
    }
    Arc::try_unwrap(tally).unwrap().into_inner().unwrap()
}

/// The store key of `x-api-key: k{k}`, as the layer makes it: one
/// length-prefixed part.
fn layer_key(k: usize) -> Vec<u8> {
    let raw = format!("k{k}");
    let mut key = vec![raw.len() as u8];
    key.extend_from_slice(raw.as_bytes());
    key
}

/// Waits until `key` holds nothing in `limiter` (a release runs on the
/// server's or the store's own time), failing with `what` after `within`.
async fn until_released<L: ConcurrencyLimiter>(
    limiter: &L,
    key: &[u8],
    within: Duration,
    what: &dyn Fn() -> String,
) {
    let deadline = tokio::time::Instant::now() + within;
    while limiter.held(key).await.unwrap() != 0 {
        assert!(tokio::time::Instant::now() < deadline, "{}", what());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Every key's permits, and the service's, come back to zero (the server
/// notices hung-up clients on its own time: wait for it, boundedly).
async fn assert_all_released<S: Store>(store: &S) {
    let per_key = store
        .concurrency_limiter(&ConcurrencyRule::new("per-key", 4, Duration::from_secs(30)).unwrap())
        .unwrap();
    let service = store
        .concurrency_limiter(&ConcurrencyRule::new("service", 32, Duration::from_secs(30)).unwrap())
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let mut held = Vec::new();
        for k in 0..KEYS {
            held.push(per_key.held(&layer_key(k)).await.unwrap());
        }
        held.push(service.held(b"\x00service").await.unwrap());
        if held.iter().all(|&h| h == 0) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "permits leaked: {held:?} (per key, then the service)"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn assert_every_path_ran(tally: &HashMap<&'static str, usize>) {
    for outcome in [
        "streamed",
        "refused",
        "cancelled before the response",
        "cancelled mid-body",
        "body failed",
        "panicked",
    ] {
        assert!(
            tally.get(outcome).copied().unwrap_or(0) > 0,
            "{outcome} never happened: {tally:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_requests_leak_no_permit_in_memory() {
    let store = MemoryStore::new();
    let addr = common::spawn(app(store.clone())).await;
    let tally = storm(addr, 10_000).await;
    assert_every_path_ran(&tally);
    assert_all_released(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_requests_leak_no_permit_in_redis() {
    let Some(redis) = Server::start() else { return };
    let store = RedisStore::builder(&redis.url())
        .prefix(&unique_prefix())
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let addr = common::spawn(app(store.clone())).await;
    let tally = storm(addr, 10_000).await;
    store.flush().await;
    assert_every_path_ran(&tally);
    assert_all_released(&store).await;
}

/// Concurrency review, missing test 4: the storm with a queue, on the
/// memory store and on Redis: requests that wait in a key's queue — and
/// are cancelled there, time out there, or get their turn — leave no
/// permit and no queue place behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_through_a_queue_leaks_no_permit() {
    let queue = Some((8, Duration::from_millis(20)));
    let store = MemoryStore::new();
    let addr = common::spawn(app_queued(store.clone(), queue)).await;
    let tally = storm(addr, 2_000).await;
    assert_every_path_ran(&tally);
    assert_all_released(&store).await;
    let Some(redis) = Server::start() else { return };
    let store = RedisStore::builder(&redis.url())
        .prefix(&unique_prefix())
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let addr = common::spawn(app_queued(store.clone(), queue)).await;
    let tally = storm(addr, 2_000).await;
    store.flush().await;
    assert_every_path_ran(&tally);
    assert_all_released(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_reader_keeps_its_permit_until_the_last_frame() {
    let store = MemoryStore::new();
    let addr = common::spawn(app(store.clone())).await;
    let per_key = store
        .concurrency_limiter(&ConcurrencyRule::new("per-key", 4, Duration::from_secs(30)).unwrap())
        .unwrap();
    let key = &layer_key(0)[..];
    let (mut sender, _conn) = connect(addr).await;
    let res = sender.send_request(get_req("/big", 0)).await.unwrap();
    assert_eq!(res.status(), 200);
    let mut body = res.into_body();
    // 32 MiB is more than loopback's socket buffers hold: while the client
    // reads slowly, the server's body is still being sent.
    for frame in 0..10 {
        body.frame().await.unwrap().unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(per_key.held(key).await.unwrap(), 1, "frame {frame}");
    }
    let rest = body.collect().await.unwrap().to_bytes();
    assert!(rest.len() > 16 << 20);
    until_released(&per_key, key, Duration::from_secs(5), &|| {
        "not released after the last frame".to_owned()
    })
    .await;
}

/// Concurrency review M2, at the layer: behind a Redis 20 ms and 200 ms
/// away (each way), a client that sends its next request as soon as the
/// last response ended is never refused by its own earlier lease (a
/// release still on its way), a request held for three lease TTLs keeps
/// its lease the whole time while hundreds of releases queue behind the
/// latency, and no lease is left held afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_redis_gives_no_false_refusal_no_lapse_and_no_leak() {
    use tollgate_redis::testing::Delayed;
    let Some(redis) = Server::start() else { return };
    const TTL: Duration = Duration::from_secs(1);
    for delay in [Duration::from_millis(20), Duration::from_millis(200)] {
        let proxy = Delayed::start(redis.port, delay).await;
        let prefix = unique_prefix();
        let slow = RedisStore::builder(&proxy.url())
            .prefix(&prefix)
            .timeout(Duration::from_secs(3))
            .build()
            .unwrap();
        let near = RedisStore::builder(&redis.url())
            .prefix(&prefix)
            .build()
            .unwrap();
        let layer = ConcurrencyLayer::builder("one", 1)
            .key(Header::named("x-api-key").unwrap())
            .lease_ttl(TTL)
            .store(slow.clone())
            .build()
            .unwrap();
        let app = Router::new()
            .route("/short", get(|| async { "ok" }))
            // Three lease TTLs of streaming.
            .route(
                "/long",
                get(|| async { Body::new(Slow::new(30, Duration::from_millis(100), false)) }),
            )
            .layer(layer);
        let addr = common::spawn(app).await;
        let rule = ConcurrencyRule::new("one", 1, TTL).unwrap();
        let held = near.concurrency_limiter(&rule).unwrap();
        let key = layer_key;

        // The long request on key 0: its head back, its body streaming.
        let (mut long_sender, _long_conn) = connect(addr).await;
        let long = long_sender.send_request(get_req("/long", 0)).await.unwrap();
        assert_eq!(long.status(), 200, "{delay:?}");
        let reading = tokio::spawn(long.into_body().collect());

        // 16 clients (keys 1..=16), each 8 requests back to back.
        let mut clients = tokio::task::JoinSet::new();
        for k in 1..=16 {
            clients.spawn(async move {
                let mut refused = 0;
                for _ in 0..8 {
                    let (mut sender, conn) = connect(addr).await;
                    let res = sender.send_request(get_req("/short", k)).await.unwrap();
                    if res.status() == 429 {
                        refused += 1;
                    }
                    res.into_body().collect().await.unwrap();
                    conn.abort();
                }
                refused
            });
        }
        // Meanwhile, key 0's lease is held in Redis at every look.
        let mut looks = 0;
        while !reading.is_finished() {
            let now = held.held(&key(0)).await.unwrap();
            if reading.is_finished() {
                break;
            }
            assert_eq!(now, 1, "{delay:?}: the long request's lease lapsed");
            looks += 1;
            tokio::time::sleep(TTL / 4).await;
        }
        assert!(looks >= 8, "{delay:?}: looked {looks} times");
        reading.await.unwrap().unwrap();
        let mut refused = 0;
        while let Some(r) = clients.join_next().await {
            refused += r.unwrap();
        }
        assert_eq!(
            refused, 0,
            "{delay:?}: requests refused by their own released leases"
        );

        // Nothing stays held.
        slow.flush().await;
        // Ten seconds for all of them.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        for k in 0..=16 {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            until_released(&held, &key(k), left, &|| {
                format!("{delay:?}: key {k}'s lease leaked")
            })
            .await;
        }
    }
}

/// Concurrency review M3, on Redis: a request queued on one instance for
/// a permit another instance holds gets it once that one is released —
/// this instance never sees the release, so its head looks again on a
/// timer that backs off (a tenth of the wait, at most 100 ms, then twice
/// as long each time), not one store call every few milliseconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_request_gets_a_permit_another_instance_released() {
    let Some(redis) = Server::start() else { return };
    let prefix = unique_prefix();
    let layer = || {
        let store = RedisStore::builder(&redis.url())
            .prefix(&prefix)
            .timeout(Duration::from_secs(2))
            .build()
            .unwrap();
        ConcurrencyLayer::builder("one", 1)
            .key(Header::named("x-api-key").unwrap())
            .queue(4, Duration::from_secs(4))
            .store(store)
            .build()
            .unwrap()
    };
    // Instance A streams for about half a second; instance B answers at once.
    let a = common::spawn(
        Router::new()
            .route(
                "/long",
                get(|| async { Body::new(Slow::new(5, Duration::from_millis(100), false)) }),
            )
            .layer(layer()),
    )
    .await;
    let b = common::spawn(
        Router::new()
            .route("/short", get(|| async { "ok" }))
            .layer(layer()),
    )
    .await;
    let (mut on_a, _conn_a) = connect(a).await;
    let long = on_a.send_request(get_req("/long", 0)).await.unwrap();
    assert_eq!(long.status(), 200);
    let reading = tokio::spawn(long.into_body().collect());
    let calls_before = redis.script_calls();
    let started = tokio::time::Instant::now();
    let (mut on_b, _conn_b) = connect(b).await;
    let res = on_b.send_request(get_req("/short", 0)).await.unwrap();
    let waited = started.elapsed();
    assert_eq!(res.status(), 200, "queued on B while A held the permit");
    reading.await.unwrap().unwrap();
    assert!(
        waited >= Duration::from_millis(400),
        "admitted before A's stream ended: {waited:?}"
    );
    // The first acquire, re-checks 0.1, 0.3 and 0.7 s in (a tenth of the
    // wait, at most 100 ms, then doubling), A's release: a handful of
    // script calls, where a fixed 5 ms re-check made a hundred.
    let calls = redis.script_calls() - calls_before;
    assert!(calls <= 8, "{calls} script calls for one queued request");
}

/// Concurrency review, missing test 7: a fixed service limit on a Redis
/// Cluster whose master for the service's key is stopped. The per-key
/// lease comes from Redis (its key lives on a live master) and the
/// service's from the fallback memory store; through the layer, each goes
/// back to the store that granted it when the response ends — Redis never
/// sees the memory lease, the memory store never sees Redis's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_cluster_failure_sends_each_lease_back_to_its_own_store() {
    use tokio::sync::Semaphore;
    use tollgate::FailurePolicy;
    let Some(cluster) = tokio::task::spawn_blocking(tollgate_redis::testing::Cluster::start)
        .await
        .unwrap()
    else {
        return;
    };
    let memory = MemoryStore::new();
    let store = RedisStore::builder(&cluster.url())
        .prefix(&unique_prefix())
        .timeout(Duration::from_millis(300))
        .failure_policy(FailurePolicy::Fallback(memory.clone()))
        .build()
        .unwrap();
    let rule = |name, max| ConcurrencyRule::new(name, max, Duration::from_secs(30)).unwrap();
    let (redis_key, redis_service) = (
        store.concurrency_limiter(&rule("per-key", 4)).unwrap(),
        store.concurrency_limiter(&rule("service", 32)).unwrap(),
    );
    let (memory_key, memory_service) = (
        memory.concurrency_limiter(&rule("per-key", 4)).unwrap(),
        memory.concurrency_limiter(&rule("service", 32)).unwrap(),
    );
    let service_on = master_of(&cluster, &redis_service, b"\x00service").await;
    let mut client = None;
    for k in 0..64 {
        if master_of(&cluster, &redis_key, &layer_key(k)).await != service_on {
            client = Some(k);
            break;
        }
    }
    let client = client.expect("every client key on the service's master");

    // A handler that says it runs, then waits to be let go.
    let (entered, go) = (Arc::new(Semaphore::new(0)), Arc::new(Semaphore::new(0)));
    let layer = ConcurrencyLayer::builder("per-key", 4)
        .key(Header::named("x-api-key").unwrap())
        .service_limit("service", 32)
        .store(store.clone())
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/hold",
            get({
                let (entered, go) = (entered.clone(), go.clone());
                || async move {
                    entered.add_permits(1);
                    go.acquire().await.unwrap().forget();
                    "done"
                }
            }),
        )
        .layer(layer);
    let addr = common::spawn(app).await;

    cluster.nodes[service_on].pause(true);
    let (mut sender, _conn) = connect(addr).await;
    let request = tokio::spawn(async move {
        let res = sender.send_request(get_req("/hold", client)).await.unwrap();
        let status = res.status();
        res.into_body().collect().await.unwrap();
        status
    });
    entered.acquire().await.unwrap().forget();
    // Mid-request: the per-key lease on Redis, the service's in memory.
    assert_eq!(redis_key.held(&layer_key(client)).await.unwrap(), 1);
    assert_eq!(memory_key.held(&layer_key(client)).await.unwrap(), 0);
    assert_eq!(memory_service.held(b"\x00service").await.unwrap(), 1);
    go.add_permits(1);
    assert_eq!(request.await.unwrap(), 200);
    until_released(
        &redis_key,
        &layer_key(client),
        Duration::from_secs(5),
        &|| "the per-key lease stayed on Redis".into(),
    )
    .await;
    until_released(
        &memory_service,
        b"\x00service",
        Duration::from_secs(5),
        &|| "the service's lease stayed in the fallback memory".into(),
    )
    .await;
    cluster.nodes[service_on].pause(false);
    // Redis never counted the memory's lease.
    cluster.wait_until_ok();
    assert_eq!(redis_service.held(b"\x00service").await.unwrap(), 0);
}

/// The Cluster master (of the first three nodes) that holds `key` of
/// `limiter`: a lease taken there, and given back.
async fn master_of(
    cluster: &tollgate_redis::testing::Cluster,
    limiter: &tollgate::redis::RedisConcurrencyLimiter,
    key: &[u8],
) -> usize {
    let mut lease = None;
    let on = cluster
        .master_holding(|| {
            let lease = &mut lease;
            async move { *lease = limiter.acquire(key, 1, u32::MAX).await.unwrap().lease }
        })
        .await
        .expect("the acquire wrote no key");
    limiter.release(key, lease.unwrap()).await.unwrap();
    on
}
