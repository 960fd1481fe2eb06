//! Runs `retry_overhead`'s calls N times, for instruction counts:
//! `valgrind --tool=callgrind target/release/examples/retry_instructions tollgate 30000`
//! (`bare`, `tollgate` or `tower`). Subtract a run of 10,000 from one of
//! 30,000 and divide by 20,000; less `bare`'s, what the layer adds.
#![allow(missing_docs, clippy::unwrap_used, clippy::panic)]
use std::convert::Infallible;
use std::future::{ready, Ready};
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use tollgate::retry::{ReplayBody, RetryBudgetLayer};
use tower::retry::budget::{Budget, TpsBudget};
use tower::retry::{Policy, RetryLayer};
use tower::{service_fn, Layer, ServiceExt};

/// tower's retry policy, as in the bench.
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

fn main() {
    let which = std::env::args().nth(1).unwrap();
    let n: usize = std::env::args().nth(2).unwrap().parse().unwrap();
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
    rt.block_on(async {
        match which.as_str() {
            "bare" => {
                for _ in 0..n {
                    let res = ok.oneshot(request()).await.unwrap();
                    assert_eq!(res.status(), StatusCode::OK);
                }
            }
            "tollgate" => {
                let svc = RetryBudgetLayer::builder("bench")
                    .build()
                    .unwrap()
                    .layer(replayed);
                for _ in 0..n {
                    let res = svc.clone().oneshot(request()).await.unwrap();
                    assert_eq!(res.status(), StatusCode::OK);
                }
            }
            "tower" => {
                let budget = Arc::new(TpsBudget::new(Duration::from_secs(10), 10, 0.2));
                let svc = RetryLayer::new(Tps(budget)).layer(ok);
                for _ in 0..n {
                    let res = svc.clone().oneshot(request()).await.unwrap();
                    assert_eq!(res.status(), StatusCode::OK);
                }
            }
            other => panic!("unknown stack {other:?}"),
        }
    });
}
