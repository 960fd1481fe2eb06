//! What a retry layer adds to a call that succeeds (the common case): a
//! service answering 200 at once, driven by `oneshot` with a small GET,
//! bare, behind tollgate's `RetryBudgetLayer` (memory store, default
//! budget) and behind tower's `Retry` with a `TpsBudget` (the same
//! budget: 20 % over 10 s, 10 retries a second). One run, group
//! `retry_overhead`.
#![allow(missing_docs, clippy::unwrap_used)]

use std::convert::Infallible;
use std::future::{ready, Ready};
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use http::{Request, Response, StatusCode};
use tollgate::retry::{ReplayBody, RetryBudgetLayer};
use tower::retry::budget::{Budget, TpsBudget};
use tower::retry::{Policy, RetryLayer};
use tower::{service_fn, Layer, ServiceExt};

/// tower's retry policy: retry 5xx while the budget allows.
#[derive(Clone)]
struct Tps(Arc<TpsBudget>);

impl<E> Policy<Request<String>, Response<String>, E> for Tps {
    type Future = Ready<()>;

    fn retry(
        &mut self,
        _req: &mut Request<String>,
        result: &mut Result<Response<String>, E>,
    ) -> Option<Self::Future> {
        match result {
            Ok(res) if !res.status().is_server_error() => {
                self.0.deposit();
                None
            }
            _ => self.0.withdraw().then(|| ready(())),
        }
    }

    fn clone_request(&mut self, req: &Request<String>) -> Option<Request<String>> {
        let mut clone = Request::new(req.body().clone());
        *clone.method_mut() = req.method().clone();
        *clone.uri_mut() = req.uri().clone();
        *clone.headers_mut() = req.headers().clone();
        Some(clone)
    }
}

fn request() -> Request<String> {
    Request::get("http://upstream.bench/items")
        .body(String::new())
        .unwrap()
}

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
