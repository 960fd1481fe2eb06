//! What a concurrency limit adds to a request, body read included: an axum
//! `Router` with one handler, driven by `oneshot` and its response body
//! collected, bare, behind tollgate's per-key limit (memory store; also
//! without headers, and as one global limit without headers) and behind
//! tower's global `ConcurrencyLimitLayer` + `LoadShedLayer`, and behind
//! tokio's semaphore with the permit held to the body's end by hand
//! (`tower_body`, the like-for-like peer of `tollgate_global`). One run,
//! group `concurrency_overhead`.
#![allow(missing_docs, clippy::unwrap_used)]

use axum::http::StatusCode;
use axum::Router;
use criterion::{criterion_group, criterion_main, Criterion};
use http_body_util::BodyExt;
use tollgate_benches::concurrency;
use tollgate_benches::layer::{request, router};
use tower::ServiceExt;

fn concurrency_overhead(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let mut g = c.benchmark_group("concurrency_overhead");
    let mut run = |name: &str, app: Router| {
        // Routes made once, as `axum::serve` does for each connection
        // (`Router::with_state`); else axum would apply every layer again
        // on each request.
        let app = app.with_state(());
        g.bench_function(name, |b| {
            b.to_async(&rt).iter(|| {
                let app = app.clone();
                async move {
                    let res = app.oneshot(request()).await.unwrap();
                    assert_eq!(res.status(), StatusCode::OK);
                    res.into_body().collect().await.unwrap();
                }
            })
        });
    };
    run("bare", router());
    run("tollgate", concurrency::tollgate(64, true));
    // The same without the two standard headers (tower sends none).
    run("tollgate_no_headers", concurrency::tollgate(64, false));
    // One limit for the whole service and no headers: the work tower's
    // global semaphore does (plus the permit held to the body's end).
    run("tollgate_global", concurrency::tollgate_global(64));
    // The like-for-like peer of tollgate_global: tower's semaphore, its
    // permit held to the body's end by a hand-written wrapper.
    run("tower_body", concurrency::tower_body(64));
    run("tower_concurrency", concurrency::tower(64));
    g.finish();
}

criterion_group!(benches, concurrency_overhead);
criterion_main!(benches);
