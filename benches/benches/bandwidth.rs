//! What pacing costs a body when the rate does not bind: a 1 MiB body in
//! 16 KiB frames, served through `oneshot` and read in full (collected),
//! bare and through `BandwidthLayer` at 1 GB/s per key with a 4 MiB burst
//! (memory store, system clock). Requests rotate over 1,024 keys, so each
//! key's budget is whole again when its turn comes (no body waits: the
//! rate does not bind, as the group intends). One run, group
//! `bandwidth_body`.
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::arithmetic_side_effects,
    clippy::indexing_slicing
)]

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::Bytes;
use criterion::{criterion_group, criterion_main, Criterion};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use tollgate::bandwidth::BandwidthLayer;
use tollgate::key::Header;
use tower::{service_fn, Layer, ServiceExt};

/// 1 MiB in 16 KiB frames of one static buffer (no allocation per frame).
struct Chunks(usize);

static CHUNK: [u8; 16 << 10] = [b'x'; 16 << 10];

impl Body for Chunks {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.0 == 0 {
            return Poll::Ready(None);
        }
        self.0 -= 1;
        Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(&CHUNK)))))
    }
}

fn bandwidth_body(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let layer = BandwidthLayer::builder("bench", 1_000_000_000, 4 << 20)
        .key(Header::named("x-api-key").unwrap())
        .build()
        .unwrap();
    let bare = service_fn(|_req: http::Request<String>| async {
        Ok::<_, Infallible>(http::Response::new(Chunks(64)))
    });
    // The body type a layer can also refuse in (a keyless request is
    // answered 400); every bench request has a key.
    let paced = layer.layer(service_fn(|_req: http::Request<_>| async {
        Ok::<_, Infallible>(http::Response::new(tollgate::ResponseBody::wrap(Chunks(
            64,
        ))))
    }));
    let keys: Vec<http::HeaderValue> = (0..1_024)
        .map(|i| http::HeaderValue::from_str(&format!("bench-key-{i:04}")).unwrap())
        .collect();
    let mut next = 0usize;
    let mut request = move || {
        next = (next + 1) % keys.len();
        let mut req = http::Request::new(String::new());
        req.headers_mut().insert("x-api-key", keys[next].clone());
        req
    };
    let mut g = c.benchmark_group("bandwidth_body");
    g.bench_function("bare", |b| {
        b.to_async(&rt).iter(|| {
            let req = request();
            async move {
                let res = bare.oneshot(req).await.unwrap();
                let body = res.into_body().collect().await.unwrap().to_bytes();
                assert_eq!(body.len(), 1 << 20);
            }
        })
    });
    g.bench_function("paced", |b| {
        b.to_async(&rt).iter(|| {
            let (paced, req) = (paced.clone(), request());
            async move {
                let res = paced.oneshot(req).await.unwrap();
                let body = res.into_body().collect().await.unwrap().to_bytes();
                assert_eq!(body.len(), 1 << 20);
            }
        })
    });
    g.finish();
}

criterion_group!(benches, bandwidth_body);
criterion_main!(benches);
