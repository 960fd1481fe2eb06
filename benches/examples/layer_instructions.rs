//! Runs one `layer_overhead` stack N times, for instruction counts that do
//! not depend on the machine's noise:
//! `valgrind --tool=callgrind target/release/examples/layer_instructions tollgate 3000`
//! (stacks: bare, tollgate, governor, tollgate_denied, governor_denied;
//! and the `concurrency_overhead` stacks, which also read the body:
//! conc_bare, conc_tollgate, conc_tollgate_no_headers, conc_tollgate_global,
//! conc_tower_body, conc_tower).
//! Subtract a run of 1000 from a run of 3000 and divide by 2000.
#![allow(missing_docs, clippy::unwrap_used, clippy::panic)]
use axum::http::StatusCode;
use http_body_util::BodyExt;
use tollgate_benches::concurrency;
use tollgate_benches::layer::{self, request, router};
use tower::ServiceExt;

fn main() {
    let which = std::env::args().nth(1).unwrap();
    let n: usize = std::env::args().nth(2).unwrap().parse().unwrap();
    let (app, want) = match which.as_str() {
        "bare" => (router(), StatusCode::OK),
        "tollgate" => (layer::tollgate_allowing(), StatusCode::OK),
        "governor" => (layer::governor_allowing(), StatusCode::OK),
        "tollgate_denied" => (layer::tollgate_denying(), StatusCode::TOO_MANY_REQUESTS),
        "governor_denied" => (layer::governor_denying(), StatusCode::TOO_MANY_REQUESTS),
        "conc_bare" => (router(), StatusCode::OK),
        "conc_tollgate" => (concurrency::tollgate(64, true), StatusCode::OK),
        "conc_tollgate_no_headers" => (concurrency::tollgate(64, false), StatusCode::OK),
        "conc_tollgate_global" => (concurrency::tollgate_global(64), StatusCode::OK),
        "conc_tower_body" => (concurrency::tower_body(64), StatusCode::OK),
        "conc_tower" => (concurrency::tower(64), StatusCode::OK),
        other => panic!("unknown stack {other:?}"),
    };
    // Routes made once, as `axum::serve` does for each connection.
    let app = app.with_state(());
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async {
        app.clone().oneshot(request()).await.unwrap();
        for _ in 0..n {
            let res = app.clone().oneshot(request()).await.unwrap();
            assert_eq!(res.status(), want);
            if which.starts_with("conc_") {
                res.into_body().collect().await.unwrap();
            }
        }
    });
}
