//! Runs `retry_overhead`'s calls N times, for instruction counts:
//! `valgrind --tool=callgrind target/release/examples/retry_instructions tollgate 30000`
//! (`bare`, `tollgate` or `tower`). Subtract a run of 10,000 from one of
//! 30,000 and divide by 20,000; less `bare`'s, what the layer adds.
#![allow(missing_docs, clippy::unwrap_used, clippy::panic)]
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use tollgate::retry::{ReplayBody, RetryBudgetLayer};
use tollgate_benches::retry::{request, Tps};
use tower::retry::budget::TpsBudget;
use tower::retry::RetryLayer;
use tower::{service_fn, Layer, ServiceExt};

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
