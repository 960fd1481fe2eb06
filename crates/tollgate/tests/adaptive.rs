//! The adaptive service limit through the layer, on tokio's paused clock,
//! against a simulated backend whose latency grows with load: it settles
//! near the backend's knee, backs off when the backend slows down, and
//! recovers when it speeds up again.
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::arithmetic_side_effects,
    clippy::cast_precision_loss,
    clippy::indexing_slicing
)]

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use tokio::time::{sleep, Instant};
use tollgate::concurrency::{AdaptiveLimit, Aimd, ConcurrencyLayer, Gradient};
use tollgate::key::Global;
use tower::{service_fn, Layer, ServiceExt};

const BASE: Duration = Duration::from_millis(10);
const CLIENTS: usize = 60;

/// Up to `knee` requests are served in `BASE`; beyond it they queue:
/// latency grows in proportion to the load.
#[derive(Clone)]
struct Backend {
    in_flight: Arc<AtomicU32>,
    knee: Arc<AtomicU32>,
}

impl Backend {
    fn new(knee: u32) -> Self {
        Self {
            in_flight: Arc::new(AtomicU32::new(0)),
            knee: Arc::new(AtomicU32::new(knee)),
        }
    }

    async fn serve(&self) -> Response<String> {
        let n = self.in_flight.fetch_add(1, Ordering::AcqRel) + 1;
        let knee = self.knee.load(Ordering::Acquire);
        let factor = f64::from(n.max(knee)) / f64::from(knee);
        sleep(BASE.mul_f64(factor)).await;
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
        Response::new(String::new())
    }
}

/// Runs `CLIENTS` closed-loop clients through `limit` against a backend
/// with knee 20, in three phases of `phase` each — knee 20, knee 10, knee
/// 20 — and returns the time-averaged limit over the second half of each.
async fn run(limit: AdaptiveLimit, phase: Duration) -> [f64; 3] {
    let backend = Backend::new(20);
    let layer = ConcurrencyLayer::builder("clients", 100_000)
        .key(Global)
        .adaptive_service_limit("service", limit)
        .build()
        .unwrap();
    let b = backend.clone();
    let svc = layer.layer(service_fn(move |_req: Request<String>| {
        let b = b.clone();
        async move { Ok::<_, Infallible>(b.serve().await) }
    }));
    let stop = Arc::new(AtomicBool::new(false));
    let refused = Arc::new(AtomicUsize::new(0));
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        let (svc, stop, refused) = (svc.clone(), Arc::clone(&stop), Arc::clone(&refused));
        clients.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let res = svc
                    .clone()
                    .oneshot(Request::new(String::new()))
                    .await
                    .unwrap();
                if res.status() == StatusCode::TOO_MANY_REQUESTS {
                    refused.fetch_add(1, Ordering::Relaxed);
                    sleep(Duration::from_millis(1)).await;
                }
                res.into_body().collect().await.unwrap();
            }
        }));
    }
    let mut averages = [0.0; 3];
    for (i, knee) in [20, 10, 20].into_iter().enumerate() {
        backend.knee.store(knee, Ordering::Release);
        let start = Instant::now();
        let (mut sum, mut n) = (0.0, 0.0);
        while start.elapsed() < phase {
            sleep(Duration::from_millis(10)).await;
            if start.elapsed() >= phase / 2 {
                sum += f64::from(layer.adaptive_limit().unwrap());
                n += 1.0;
            }
        }
        averages[i] = sum / n;
    }
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.await.unwrap();
    }
    assert!(refused.load(Ordering::Relaxed) > 0, "the limit never bound");
    eprintln!("time-averaged limit per phase: {averages:?}");
    averages
}

#[tokio::test(start_paused = true)]
async fn gradient_settles_near_the_knee_backs_off_and_recovers() {
    let limit = Gradient::new(4, 20, 1_000)
        .unwrap()
        .min_rtt_interval(Duration::from_secs(2))
        .unwrap();
    let [healthy, slow, recovered] =
        run(AdaptiveLimit::Gradient(limit), Duration::from_secs(3)).await;
    // Measured: 28.8, 16.6, 28.8 — 1.44×, 1.66× and 1.44× the knee: the
    // gradient keeps √limit of headroom above what the RTTs call for.
    assert_near_the_knee([healthy, slow, recovered]);
}

#[tokio::test(start_paused = true)]
async fn aimd_settles_near_the_knee_backs_off_and_recovers() {
    // Slower than twice the base latency counts as a drop.
    let limit = Aimd::new(2, 20, 1_000)
        .unwrap()
        .latency_threshold(BASE * 2)
        .unwrap();
    let [healthy, slow, recovered] = run(AdaptiveLimit::Aimd(limit), Duration::from_secs(3)).await;
    // Measured: 22.6, 12.5, 22.5 — 1.13×, 1.25× and 1.13× the knee.
    assert_near_the_knee([healthy, slow, recovered]);
}

/// Within 0.75× to 1.7× of the knee in every phase (20, 10, 20).
fn assert_near_the_knee(averages: [f64; 3]) {
    for (avg, knee) in averages.into_iter().zip([20.0, 10.0, 20.0]) {
        assert!(
            (0.75 * knee..=1.7 * knee).contains(&avg),
            "{averages:?}: {avg} is not near the knee {knee}"
        );
    }
}
