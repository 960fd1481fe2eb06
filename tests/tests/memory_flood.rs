//! A key flood cannot grow the process: the quickstart's whole stack —
//! policy (per key and per address), daily quota, in-flight limits with
//! an adaptive service limit, metrics with the Prometheus recorder — is
//! flooded in process with twice `max_keys` distinct clients (a new
//! `x-api-key` and a new `X-Forwarded-For` address per request), and the
//! heap, counted by this binary's allocator, stops growing once the store
//! is full and stays under the bound the README states.
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
use tollgate::MemoryStore;
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

/// What the README states per key of `max_keys` once the store is full
/// (heap, not RSS), for the quickstart's stack.
const BYTES_PER_KEY: isize = 560;

/// Sends `n` requests from new clients; returns how many were refused
/// (a full store decides new keys in a shared overflow state, whose
/// budget a flood spends).
async fn flood(app: &axum::Router, from: u32, n: u32) -> u32 {
    let mut refused = 0;
    let peer: SocketAddr = "127.0.0.1:9".parse().unwrap();
    for i in from..from + n {
        let mut req = Request::get("/api/hello")
            .header("x-api-key", format!("flood-{i}"))
            .header(
                "x-forwarded-for",
                format!("10.{}.{}.{}", i >> 16 & 255, i >> 8 & 255, i & 255),
            )
            .body(Body::empty())
            .unwrap();
        req.extensions_mut().insert(ConnectInfo(peer));
        let res = app.clone().oneshot(req).await.unwrap();
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
    let store = MemoryStore::builder().max_keys(MAX_KEYS).build().unwrap();
    let trusted = ["127.0.0.1/32".to_owned()];
    let app = tollgate_examples::quickstart_app(store, &trusted).unwrap();
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
         after {} more {twice} B. Refused (the full store's shared overflow): {refused}, then {refused_after}",
        n
    );
    assert!(
        full - start < BYTES_PER_KEY * MAX_KEYS as isize,
        "{per_key:.0} B per key of max_keys, above the stated {BYTES_PER_KEY}"
    );
    // Past the store's bound, more clients cost nothing more (within 2 %
    // of what the first ones took: allocator and table noise).
    let growth = twice - full;
    assert!(
        growth < (full - start) / 50,
        "{n} more clients grew the heap by {growth} B"
    );
}
