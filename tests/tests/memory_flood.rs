//! A key flood cannot grow the process: the quickstart's whole stack —
//! policy (per key and per address), daily quota, in-flight limits with
//! an adaptive service limit, downloads' in-flight and bandwidth limits
//! (every fourth client starts one), metrics with the Prometheus
//! recorder — is
//! flooded in process with twice `max_keys` distinct clients (a new
//! `x-api-key` and a new `X-Forwarded-For` address per request), and the
//! heap, counted by this binary's allocator, stops growing once the store
//! is full; then days of churn (a manual clock) replace every client with
//! new ones, and the heap levels off under the bound the README states.
#![allow(
    missing_docs,
    unsafe_code,
    clippy::unwrap_used,
    clippy::panic,
    clippy::arithmetic_side_effects,
    clippy::cast_precision_loss
)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicIsize, Ordering};

use axum::body::Body;
use axum::extract::ConnectInfo;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tollgate::{ManualClock, MemoryStore};
use tower::ServiceExt;

/// Live heap bytes of this process.
static LIVE: AtomicIsize = AtomicIsize::new(0);

struct Counting;

// SAFETY: every call is forwarded to the system allocator with the same
// arguments; the counter only observes sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_add(
                new_size as isize - layout.size() as isize,
                Ordering::Relaxed,
            );
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

/// The store's key bound in this test (the default is 1,000,000; the
/// bound per key is what the README scales).
const MAX_KEYS: usize = 16_384;

/// Heap that other threads hold at a given moment (recorder buffers,
/// runtime scratch), which a measurement may or may not catch.
const NOISE: isize = 400_000;

/// What the README states per key of `max_keys` once the store is full
/// (heap, not RSS), for the quickstart's stack.
const BYTES_PER_KEY: isize = 560;
/// What a store that held a flood keeps once every key has lapsed and its
/// sweeper ran: nothing per client, only what the rules, shards and
/// runtime hold (measured 1.4 to 1.5 MB), plus `NOISE`.
const QUIET_REST: isize = 2_500_000;

/// Client `i`'s `GET path`: its own key and address, through a trusted
/// proxy.
fn client(i: u32, path: &str) -> Request<Body> {
    let mut req = Request::get(path)
        .header("x-api-key", format!("flood-{i}"))
        .header(
            "x-forwarded-for",
            format!("10.{}.{}.{}", i >> 16 & 255, i >> 8 & 255, i & 255),
        )
        .body(Body::empty())
        .unwrap();
    let peer: SocketAddr = "127.0.0.1:9".parse().unwrap();
    req.extensions_mut().insert(ConnectInfo(peer));
    req
}

/// Sends `n` requests from new clients; returns how many were refused
/// (a full store decides new keys in a shared overflow state, whose
/// budget a flood spends).
async fn flood(app: &axum::Router, from: u32, n: u32) -> u32 {
    let mut refused = 0;
    for i in from..from + n {
        // Every fourth client starts a download too (its bandwidth and
        // download limits' keys), takes what comes at once and goes away.
        if i % 4 == 0 {
            let res = app
                .clone()
                .oneshot(client(i, "/api/download"))
                .await
                .unwrap();
            match res.status() {
                StatusCode::OK => {
                    // Polled once: a frame within its burst comes at once;
                    // past a full store's shared budget it would wait on
                    // a clock that stands still.
                    let mut body = res.into_body();
                    std::future::poll_fn(|cx| {
                        let _ = http_body::Body::poll_frame(std::pin::Pin::new(&mut body), cx);
                        std::task::Poll::Ready(())
                    })
                    .await;
                }
                StatusCode::TOO_MANY_REQUESTS => refused += 1,
                other => panic!("download {i}: HTTP {other}"),
            }
        }
        let res = app.clone().oneshot(client(i, "/api/hello")).await.unwrap();
        match res.status() {
            StatusCode::OK => {}
            StatusCode::TOO_MANY_REQUESTS => refused += 1,
            other => panic!("request {i}: HTTP {other}"),
        }
        res.into_body().collect().await.unwrap();
    }
    refused
}

#[tokio::test(flavor = "current_thread")]
async fn a_key_flood_levels_off_below_the_stated_bound() {
    // The recorder and its upkeep, as the quickstart installs them.
    let _metrics = tollgate_examples::prometheus().unwrap();
    // The store on a manual clock: what expires, and when, is the test's
    // choice, not the machine's speed.
    let clock = ManualClock::starting_at(1_796_000_000_000_000_000);
    let store = MemoryStore::builder()
        .max_keys(MAX_KEYS)
        .clock(clock.clone())
        // The quickstart's sweeper, more often: time here is the manual
        // clock's, so it drops nothing until the test moves it.
        .sweep_idle_every(std::time::Duration::from_secs(1))
        .build()
        .unwrap();
    let trusted = ["127.0.0.1/32".to_owned()];
    let app = tollgate_examples::quickstart_app(store.clone(), &trusted).unwrap();
    let settle = || tokio::time::sleep(tollgate_examples::METRICS_UPKEEP * 2);

    settle().await;
    let start = live();
    // Twice the store's bound fills it for sure (each client is several
    // keys: its rate, its address's rate, its quota, its in-flight count).
    let n = u32::try_from(2 * MAX_KEYS).unwrap();
    let refused = flood(&app, 0, n).await;
    settle().await;
    let full = live();
    let refused_after = flood(&app, n, n).await;
    settle().await;
    let twice = live();

    let per_key = (full - start) as f64 / MAX_KEYS as f64;
    eprintln!(
        "heap: start {start} B; after {n} clients {full} B ({per_key:.0} B per key of max_keys); \
         after {n} more {twice} B. Refused (the full store's shared overflow): {refused}, then {refused_after}"
    );
    assert!(
        full - start < BYTES_PER_KEY * MAX_KEYS as isize,
        "{per_key:.0} B per key of max_keys, above the stated {BYTES_PER_KEY}"
    );
    // Past the store's bound, more clients cost nothing more: within 2 %
    // of what the first ones took, plus what other threads hold at the
    // moment of measuring (the recorder's sample buffers between upkeeps,
    // the runtime's scratch), which moves by up to a few hundred KB from
    // run to run. A leak of even 16 bytes a client (512 KB here) fails.
    let growth = twice - full;
    assert!(
        growth < (full - start) / 50 + NOISE,
        "{n} more clients grew the heap by {growth} B"
    );

    // Churn: a day later every key of the first floods has lapsed (rates
    // in seconds, the daily quotas at midnight), and new clients take
    // their places, flood after flood. The heap stays under the bound:
    // nothing outside the store keeps a trace of a client (metrics use
    // fixed buckets, not sketches that grow with what they see).
    let mut heaps = Vec::new();
    for round in 2..10u32 {
        clock.advance(std::time::Duration::from_secs(86_400));
        flood(&app, round * n, n).await;
        settle().await;
        heaps.push(live());
    }
    eprintln!("heap after each day of churn: {heaps:?}");
    for (day, heap) in heaps.iter().enumerate() {
        assert!(
            heap - start < BYTES_PER_KEY * MAX_KEYS as isize,
            "day {day} of churn: {} B per key of max_keys",
            (heap - start) / MAX_KEYS as isize
        );
    }
    // And it levels off: each rule's table grows to what churn asks of it
    // (about five days here), then stays. Over the last four days it moves
    // by less than a tenth of the stated bound, plus what other threads
    // may hold at one measurement and not at another (`NOISE`: a run read
    // a spread of 992 KB against the 918 KB bound, others 214 to 811 KB).
    // A leak of 16 bytes a client (512 KB a day here) still fails it.
    let last = heaps.get(heaps.len() - 4..).unwrap();
    let spread = last.iter().max().unwrap() - last.iter().min().unwrap();
    assert!(
        spread < BYTES_PER_KEY * MAX_KEYS as isize / 10 + NOISE,
        "the heap still moves by {spread} B a day after {} days of churn: {heaps:?}",
        heaps.len()
    );

    // The flood stops. A day later every key has lapsed, and with no
    // request at all the store's sweeper drops them and the tables
    // shrink: the heap comes back to where it started, but for what does
    // not grow with clients (1.4 to 1.5 MB here whether the store holds
    // 16 Ki or 32 Ki keys: buffers sized by rules and shards, the
    // runtime's), where the flood had taken 250 to 330 B per key.
    clock.advance(std::time::Duration::from_secs(2 * 86_400));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let quiet = loop {
        settle().await;
        let heap = live();
        if heap - start < QUIET_REST {
            break heap;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "a quiet day after the flood the heap still holds {} B per key of max_keys \
             ({} keys held)",
            (heap - start) / MAX_KEYS as isize,
            store.key_count()
        );
    };
    eprintln!("heap a quiet day later: {quiet} B");
}
