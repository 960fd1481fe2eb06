//! What a retry layer adds to a call that succeeds (the common case): a
//! service answering 200 at once, driven by `oneshot` with a small GET,
//! bare, behind tollgate's `RetryBudgetLayer` (memory store, default
//! budget) and behind tower's `Retry` with a `TpsBudget` (the same
//! budget: 20 % over 10 s, 10 retries a second). One run, group
//! `retry_overhead`.
#![allow(missing_docs, clippy::unwrap_used)]

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use http::{Request, Response, StatusCode};
use tollgate::retry::{ReplayBody, RetryBudgetLayer};
use tollgate_benches::retry::{request, Tps};
use tower::retry::budget::TpsBudget;
use tower::retry::RetryLayer;
use tower::{service_fn, Layer, ServiceExt};

fn retry_overhead(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let ok = service_fn(|_req: Request<String>| async {
        Ok::<_, Infallible>(Response::new(String::new()))
    });
    let replayed = service_fn(|_req: Request<ReplayBody<String>>| async {
        Ok::<_, Infallible>(Response::new(String::new()))
    });
    let tollgate = RetryBudgetLayer::builder("bench")
        .build()
        .unwrap()
        .layer(replayed);
    let budget = Arc::new(TpsBudget::new(Duration::from_secs(10), 10, 0.2));
    let tower_retry = RetryLayer::new(Tps(budget)).layer(ok);
    let bare = ok;
    let mut g = c.benchmark_group("retry_overhead");
    g.bench_function("bare", |b| {
        b.to_async(&rt).iter(|| async {
            let res = bare.oneshot(request()).await.unwrap();
            assert_eq!(res.status(), StatusCode::OK);
        })
    });
    g.bench_function("tollgate", |b| {
        b.to_async(&rt).iter(|| {
            let svc = tollgate.clone();
            async move {
                let res = svc.oneshot(request()).await.unwrap();
                assert_eq!(res.status(), StatusCode::OK);
            }
        })
    });
    g.bench_function("tower_retry", |b| {
        b.to_async(&rt).iter(|| {
            let svc = tower_retry.clone();
            async move {
                let res = svc.oneshot(request()).await.unwrap();
                assert_eq!(res.status(), StatusCode::OK);
            }
        })
    });
    g.finish();
}

criterion_group!(benches, retry_overhead);
criterion_main!(benches);
