//! What a retry layer adds to a call that succeeds (the common case): a
//! service answering 200 at once, driven by `oneshot` with a small GET,
//! bare, behind tollgate's `RetryBudgetLayer` (memory store, default
//! budget) and behind tower's `Retry` with a `TpsBudget` (the same
//! budget: 20 % over 10 s, 10 retries a second). One run, group
//! `retry_overhead`.
#![allow(missing_docs, clippy::unwrap_used)]

use criterion::{criterion_group, criterion_main, Criterion};
use http::StatusCode;
use tollgate_benches::retry::{self, request};
use tower::ServiceExt;

fn retry_overhead(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let (bare, tollgate, tower_retry) = (retry::bare(), retry::tollgate(), retry::tower());
    let mut g = c.benchmark_group("retry_overhead");
    g.bench_function("bare", |b| {
        b.to_async(&rt).iter(|| async {
            let res = bare.clone().oneshot(request()).await.unwrap();
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
