//! Retries with and without a budget: `cargo run -p tollgate-examples --bin retry-demo`.
//!
//! Runs a flaky upstream in this process — a route that fails half of its
//! calls with 503 — and calls it 2,000 times through a client stack that
//! retries up to 3 attempts: once with no budget to speak of, once with a
//! 20 % retry budget and no floor. Prints one line per mode:
//!
//! ```text
//! mode=no-budget calls=2000 attempts=3427 amplification=1.71 success=89.3
//! mode=budget calls=2000 attempts=2399 amplification=1.20 success=63.6
//! ```
//!
//! (The no-budget figures move a little from run to run: which attempt
//! fails depends on the order concurrent calls reach the upstream.)
//! Without a budget the upstream sees 1.7 times its load exactly when it
//! is failing — and three times with a failure rate near 100 %; with a
//! budget, at most 1.2 times, at some cost in successes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::get;
use axum::Router;
use tollgate::retry::RetryBudgetLayer;
use tower_service::Service;

const CALLS: u64 = 2_000;
const CONCURRENCY: u64 = 50;

/// The upstream: each call fails with 503 with probability ½ (a fixed
/// pseudo-random sequence of attempt numbers), and
/// counts its attempts.
fn upstream(attempts: Arc<AtomicU64>) -> Router {
    Router::new().route(
        "/items",
        get(move || {
            let n = attempts.fetch_add(1, Ordering::Relaxed);
            async move {
                // SplitMix64 of the attempt number: half fail.
                let mut z = n.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                if (z ^ (z >> 31)) & 1 == 0 {
                    StatusCode::SERVICE_UNAVAILABLE
                } else {
                    StatusCode::OK
                }
            }
        }),
    )
}

/// Sends `CALLS` calls, `CONCURRENCY` at a time, through a retry layer
/// with this budget; prints the mode's line.
async fn run(mode: &str, ratio: f64) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let attempts = Arc::new(AtomicU64::new(0));
    let layer = RetryBudgetLayer::builder(mode)
        .budget(ratio, 0, Duration::from_secs(10))
        .max_attempts(3)
        .backoff(Duration::from_millis(1), Duration::from_millis(10))
        .build()?;
    let client = tower_layer::Layer::layer(&layer, upstream(Arc::clone(&attempts)));
    let ok = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for w in 0..CONCURRENCY {
        let (mut client, ok) = (client.clone(), Arc::clone(&ok));
        workers.push(tokio::spawn(async move {
            let mut i = w;
            while i < CALLS {
                let req = Request::get("http://upstream.demo/items").body(Body::empty())?;
                std::future::poll_fn(|cx| Service::<Request<Body>>::poll_ready(&mut client, cx))
                    .await?;
                if client.call(req).await?.status() == StatusCode::OK {
                    ok.fetch_add(1, Ordering::Relaxed);
                }
                i = i.saturating_add(CONCURRENCY);
            }
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
        }));
    }
    for w in workers {
        w.await??;
    }
    let attempts = attempts.load(Ordering::Relaxed);
    let ok = ok.load(Ordering::Relaxed);
    #[allow(clippy::cast_precision_loss)]
    let (amplification, success) = (
        attempts as f64 / CALLS as f64,
        ok as f64 * 100.0 / CALLS as f64,
    );
    println!(
        "mode={mode} calls={CALLS} attempts={attempts} amplification={amplification:.2} success={success:.1}"
    );
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    // "No budget": a ratio so large that every call buys a thousand retries.
    run("no-budget", 1_000.0).await?;
    run("budget", 0.2).await?;
    Ok(())
}
