//! Runs `retry_overhead`'s calls N times, for instruction counts:
//! `valgrind --tool=callgrind target/release/examples/retry_instructions tollgate 30000`
//! (`bare`, `tollgate`, `tollgate_global` or `tower`). Subtract a run of 10,000 from one of
//! 30,000 and divide by 20,000; less `bare`'s, what the layer adds.
#![allow(missing_docs, clippy::unwrap_used, clippy::panic)]
use http::{Request, Response, StatusCode};
use tollgate_benches::retry::{self, request};
use tower::{Service, ServiceExt};

fn main() {
    let which = std::env::args().nth(1).unwrap();
    let n: usize = std::env::args().nth(2).unwrap().parse().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    rt.block_on(async {
        match which.as_str() {
            "bare" => run(retry::bare(), n).await,
            "tollgate" => run(retry::tollgate(), n).await,
            "tollgate_global" => run(retry::tollgate_global(), n).await,
            "tower" => run(retry::tower(), n).await,
            other => panic!("unknown stack {other:?}"),
        }
    });
}

/// Calls `svc` `n` times, as the bench does.
async fn run<S>(svc: S, n: usize)
where
    S: Service<Request<String>, Response = Response<String>> + Clone,
    S::Error: std::fmt::Debug,
{
    for _ in 0..n {
        let res = svc.clone().oneshot(request()).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
    }
}
