use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use tokio::time::Instant;
use tower::{service_fn, Layer, ServiceExt};

use super::*;
use crate::key::{Header, KeyBytes};
use crate::{MemoryStore, TokioClock};

/// A store on Tokio's clock, which these paused-time tests move.
fn store() -> MemoryStore<TokioClock> {
    MemoryStore::builder()
        .clock(TokioClock::new())
        .build()
        .unwrap()
}

/// `n` bytes in frames of `frame` bytes, as fast as they are read.
struct Chunks {
    left: usize,
    frame: usize,
}

impl Body for Chunks {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.left == 0 {
            return Poll::Ready(None);
        }
        let n = self.left.min(self.frame);
        self.left -= n;
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(vec![b'x'; n])))))
    }
}

/// A refusal's body (the layer refuses a keyless request): its length in
/// `x`s, enough for the tests.
impl crate::RejectionBody for Chunks {
    fn rejection(bytes: Bytes) -> Self {
        Self {
            left: bytes.len(),
            frame: bytes.len().max(1),
        }
    }
}

const KIB: usize = 1 << 10;

fn req(body: Chunks) -> Request<Chunks> {
    Request::builder()
        .header("x-api-key", "k")
        .body(body)
        .unwrap()
}

/// Reads `body` to its end, checking at every frame that what was let out
/// so far fits `burst + rate × elapsed`; returns the bytes and the time.
async fn drain<B>(body: B, rate: u64, burst: u64) -> (usize, Duration)
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Debug,
{
    let start = Instant::now();
    let mut body = body;
    let mut total = 0u64;
    while let Some(frame) = body.frame().await {
        let data = frame.unwrap().into_data().unwrap();
        assert!(data.len() as u64 <= burst, "a frame above the burst");
        total += data.len() as u64;
        let elapsed = start.elapsed().as_nanos() as u64;
        let allowed = burst + rate * elapsed / 1_000_000_000;
        assert!(
            total <= allowed,
            "{total} bytes out after {elapsed} ns; budget {allowed}"
        );
    }
    (total as usize, start.elapsed())
}

/// A response of `len` bytes in frames of `frame`, through a layer of
/// 100 KiB/s with 24-KiB bursts named `rule`, its metrics recorded.
async fn download(
    rule: &str,
    len: usize,
    frame: usize,
) -> (
    crate::rate_limit::tests::Recorded,
    Response<PacedBody<Chunks, impl tollgate_core::Limiter>>,
) {
    let recorder = crate::rate_limit::tests::Recorded::default();
    let layer = metrics::with_local_recorder(&recorder, || {
        BandwidthLayer::builder(rule, 100 << 10, 24 << 10)
            .key(Header::named("x-api-key").unwrap())
            .store(store())
            .build()
            .unwrap()
    });
    let svc = layer.layer(service_fn(
        move |_req: Request<PacedBody<String, _>>| async move {
            Ok::<_, Infallible>(Response::new(Chunks { left: len, frame }))
        },
    ));
    let req = Request::builder()
        .header("x-api-key", "k")
        .body(String::new())
        .unwrap();
    (recorder, svc.oneshot(req).await.unwrap())
}

#[tokio::test(start_paused = true)]
async fn a_download_is_paced_to_the_rate_and_never_runs_ahead() {
    // 1 MiB at 100 KiB/s with a 24 KiB burst: 1,000 KiB at the rate, 10 s.
    // Frames of 64 KiB: larger than the burst, so they are split.
    let (recorder, res) = download("down", 1 << 20, 64 * KIB).await;
    let (bytes, took) = drain(res.into_body(), 100 << 10, 24 << 10).await;
    assert_eq!(bytes, 1 << 20);
    assert!(took >= Duration::from_secs(10), "{took:?}");
    // The last tick may wait for a partly used chunk: within a tick.
    assert!(took <= Duration::from_millis(10_100), "{took:?}");
    // Counted: every byte, by direction, and the waits add up to the
    // time spent throttled.
    let series = |name: &str, direction: &str| format!("{name}{{rule=down,direction={direction}}}");
    assert_eq!(
        recorder.get(&series("tollgate_bandwidth_bytes_total", "response")),
        1 << 20
    );
    assert_eq!(
        recorder.get(&series("tollgate_bandwidth_bytes_total", "request")),
        0
    );
    assert_eq!(
        recorder.get(&series("tollgate_bandwidth_unpaced_total", "response")),
        0
    );
    let waited: f64 = recorder
        .samples(&series("tollgate_bandwidth_wait_seconds", "response"))
        .iter()
        .sum();
    assert!((9.9..=10.1).contains(&waited), "{waited}");
}

#[tokio::test(start_paused = true)]
async fn an_upload_is_paced_the_same_way_and_keys_share_nothing() {
    let layer = BandwidthLayer::builder("up", 100 << 10, 24 << 10)
        .key(Header::named("x-api-key").unwrap())
        .direction(Direction::Requests)
        .store(store())
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(
        |req: Request<PacedBody<Chunks, _>>| async move {
            let (bytes, took) = drain(req.into_body(), 100 << 10, 24 << 10).await;
            Ok::<_, Infallible>(Response::new(format!("{bytes} {}", took.as_millis())))
        },
    ));
    let res = svc
        .clone()
        .oneshot(req(Chunks {
            left: 224 * KIB,
            frame: 16 * KIB,
        }))
        .await
        .unwrap();
    // 200 KiB past the burst at 100 KiB/s: two seconds, plus at most the
    // wait for the last chunk's unspent part (6 KiB: 60 ms).
    let body = res.into_body().collect().await.unwrap().to_bytes();
    let body = String::from_utf8(body.to_vec()).unwrap();
    let (bytes, ms) = body.split_once(' ').unwrap();
    assert_eq!(bytes.parse::<usize>().unwrap(), 224 * KIB);
    let ms: u64 = ms.parse().unwrap();
    assert!((2_000..=2_060).contains(&ms), "{ms} ms");
}

#[tokio::test(start_paused = true)]
async fn a_dropped_body_gives_its_unspent_tokens_back() {
    // 1 KiB/s, a 32 KiB burst taken 16 KiB at a time.
    let layer = BandwidthLayer::builder("down", 1 << 10, 32 * KIB as u32)
        .key(Header::named("x-api-key").unwrap())
        .chunk(16 * KIB as u32)
        .store(store())
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(|_req: Request<PacedBody<String, _>>| async {
        Ok::<_, Infallible>(Response::new(Chunks {
            left: 1 << 20,
            frame: KIB,
        }))
    }));
    let get = || {
        Request::builder()
            .header("x-api-key", "k")
            .body(String::new())
            .unwrap()
    };
    let res = svc.clone().oneshot(get()).await.unwrap();
    let mut body = res.into_body();
    // One 1 KiB frame read on a 16 KiB chunk, then the client goes away.
    body.frame().await.unwrap().unwrap();
    drop(body);
    // 15 KiB came back, so 31 KiB are left: a second body reads 32 KiB
    // after one second (1 KiB at the rate), and up to an eighth of it of
    // jitter. Without the refund it would wait 16 seconds.
    let res = svc.clone().oneshot(get()).await.unwrap();
    let start = Instant::now();
    let mut body = res.into_body();
    let mut got = 0;
    while got < 32 * KIB {
        got += body
            .frame()
            .await
            .unwrap()
            .unwrap()
            .into_data()
            .unwrap()
            .len();
    }
    let took = start.elapsed();
    assert!(
        (Duration::from_secs(1)..=Duration::from_millis(1_125)).contains(&took),
        "{took:?}"
    );
}

/// Quota-bandwidth-retry review #10: a short answer on a key whose
/// budget was spent waited for a whole chunk's tokens (16 KiB at
/// 100 KiB/s: 160 ms) though it needed 100 bytes' (1 ms). A body known to
/// be shorter than a chunk asks for what it holds.
#[tokio::test(start_paused = true)]
async fn a_short_answer_waits_for_its_own_bytes_not_a_chunk() {
    let layer = BandwidthLayer::builder("down", 100 << 10, 24 << 10)
        .key(Header::named("x-api-key").unwrap())
        .chunk(16 * KIB as u32)
        .store(store())
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(
        |req: Request<PacedBody<String, _>>| async move {
            let body = if req.uri().path() == "/big" {
                "x".repeat(24 * KIB)
            } else {
                "y".repeat(100)
            };
            Ok::<_, Infallible>(Response::new(body))
        },
    ));
    let get = |path: &str| {
        Request::get(path)
            .header("x-api-key", "k")
            .body(String::new())
            .unwrap()
    };
    // The burst spent.
    let big = svc.clone().oneshot(get("/big")).await.unwrap();
    big.into_body().collect().await.unwrap();
    let start = Instant::now();
    let small = svc.clone().oneshot(get("/small")).await.unwrap();
    let bytes = small.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(bytes.len(), 100);
    let took = start.elapsed();
    assert!(took <= Duration::from_millis(5), "{took:?} for 100 bytes");
}

#[test]
fn buckets_never_pace_faster_and_never_waste_their_refill() {
    for (rate, burst) in [
        (100 << 10, 24 << 10),
        (1_000_001, 65_536),
        (1_000_000_000, 1),
        (3, 1),
        (999_999_937, 4_096),
        (1, u32::MAX),
    ] {
        let (refill, interval) = super::layer::bucket(rate, burst);
        assert!(
            refill >= 1 && refill <= burst,
            "{rate}/{burst}: refill {refill}"
        );
        // Never faster than the rate...
        let paced = u128::from(refill) * 1_000_000_000;
        assert!(
            paced <= u128::from(rate) * u128::from(interval),
            "{rate}/{burst}"
        );
        // ...and within 0.1 % of it, or a byte per tick.
        let floor = u128::from(rate) * u128::from(interval) - paced;
        assert!(
            floor * 1000 <= u128::from(rate) * u128::from(interval) || floor <= 1_000_000_000,
            "{rate}/{burst}: {refill} every {interval} ns"
        );
    }
}

#[test]
fn a_size_hint_with_a_split_frame_pending_does_not_panic() {
    use http_body_util::Full;
    use tollgate_core::{Limit, Rule, Store};
    let rule = Rule::new(
        "h",
        Limit::token_bucket(1 << 10, 1 << 10, Duration::from_secs(1)),
    );
    let limiter = MemoryStore::new().limiter(&rule.unwrap()).unwrap();
    let mut key = crate::key::KeyBuf::new();
    key.push(b"k");
    let metrics = std::sync::Arc::new(crate::observe::BandwidthMetrics::register("h", "response"));
    let pacer = super::body::Pacer::new(limiter, metrics, KeyBytes::new(&mut key), 1 << 10);
    let mut body = PacedBody::new(Full::new(Bytes::from(vec![b'x'; 4 << 10])), Some(pacer));
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async {
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(first.len(), 1 << 10);
    });
    let hint = body.size_hint();
    assert_eq!((hint.lower(), hint.upper()), (3 << 10, Some(3 << 10)));
}

#[test]
fn configuration_errors_name_the_field() {
    let e = |b: BandwidthLayerBuilder<_, MemoryStore>| b.build().map(drop).unwrap_err().field();
    assert_eq!(e(BandwidthLayer::builder("b", 0, 1)), "bytes_per_second");
    assert_eq!(e(BandwidthLayer::builder("b", 1, 0)), "burst");
    assert_eq!(e(BandwidthLayer::builder("b", 1, 10).chunk(11)), "chunk");
    assert_eq!(e(BandwidthLayer::builder("b", 1, 10).chunk(0)), "chunk");
    assert_eq!(e(BandwidthLayer::builder("b c", 1, 10)), "name");
    // Rates that do not divide a second evenly are exact too.
    assert!(BandwidthLayer::builder("b", 3, 10).build().is_ok());
    assert!(BandwidthLayer::builder("b", 1_000_000_000, u32::MAX)
        .build()
        .is_ok());
    assert_eq!(
        e(BandwidthLayer::builder("b", u32::MAX, 1)),
        "bytes_per_second"
    );
}

/// Frames the credit in hand covers go out as they came, and count too.
#[tokio::test(start_paused = true)]
async fn small_frames_are_counted_as_they_go_out() {
    // 100 frames of 100 bytes: each fits the 6-KiB chunk's credit.
    let (recorder, res) = download("small", 10_000, 100).await;
    let body = res.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body.len(), 10_000);
    assert_eq!(
        recorder.get("tollgate_bandwidth_bytes_total{rule=small,direction=response}"),
        10_000
    );
}
