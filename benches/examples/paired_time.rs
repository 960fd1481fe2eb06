//! Paired timing of a bench group's stacks, for when criterion's separate
//! runs drift more than the difference being measured: every round times a
//! batch of each stack back to back (in a rotating order), so each round's
//! ratio compares stacks under the same conditions; the median over rounds
//! is printed.
//!
//! `target/release/examples/paired_time retry 41 20000` (groups: `retry`,
//! `layer`, `concurrency`; then rounds and calls per batch).
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects,
    clippy::cast_precision_loss
)]
use std::time::Instant;

use axum::http::StatusCode;
use http::Response;
use http_body_util::BodyExt;
use tollgate_benches::{concurrency, layer, retry};
use tower::{Service, ServiceExt};

fn main() {
    let group = std::env::args().nth(1).unwrap();
    let rounds: usize = std::env::args().nth(2).map_or(41, |s| s.parse().unwrap());
    let n: usize = std::env::args()
        .nth(3)
        .map_or(20_000, |s| s.parse().unwrap());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    // Stacks: the first is the bare service, the last the peer.
    let names: &[&str] = match group.as_str() {
        "retry" => &["bare", "tollgate", "tollgate_global", "tower_retry"],
        "layer" => &["bare", "tollgate", "governor"],
        "concurrency" => &["bare", "tollgate", "tollgate_global", "tower_body", "tower"],
        other => panic!("unknown group {other:?}"),
    };
    let body = group == "concurrency";
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
    rt.block_on(async {
        let (rb, rt_, rg, rw) = (
            retry::bare(),
            retry::tollgate(),
            retry::tollgate_global(),
            retry::tower(),
        );
        let (lb, lt, lg) = (
            layer::router().with_state(()),
            layer::tollgate_allowing().with_state(()),
            layer::governor_allowing().with_state(()),
        );
        let (cb, ct, cg, ch, cw) = (
            layer::router().with_state(()),
            concurrency::tollgate(64, true).with_state(()),
            concurrency::tollgate_global(64).with_state(()),
            concurrency::tower_body(64).with_state(()),
            concurrency::tower(64).with_state(()),
        );
        for round in 0..rounds {
            for k in 0..names.len() {
                let i = (k + round) % names.len();
                let t = match (group.as_str(), i) {
                    ("retry", 0) => calls(body, &rb, n, retry::request).await,
                    ("retry", 1) => calls(body, &rt_, n, retry::request).await,
                    ("retry", 2) => calls(body, &rg, n, retry::request).await,
                    ("retry", _) => calls(body, &rw, n, retry::request).await,
                    ("layer", 0) => calls(body, &lb, n, layer::request).await,
                    ("layer", 1) => calls(body, &lt, n, layer::request).await,
                    ("layer", _) => calls(body, &lg, n, layer::request).await,
                    (_, 0) => calls(body, &cb, n, layer::request).await,
                    (_, 1) => calls(body, &ct, n, layer::request).await,
                    (_, 2) => calls(body, &cg, n, layer::request).await,
                    (_, 3) => calls(body, &ch, n, layer::request).await,
                    _ => calls(body, &cw, n, layer::request).await,
                };
                // The first round warms up.
                if round > 0 {
                    times[i].push(t);
                }
            }
        }
    });
    // Each stack against the group's peer (the last), and, where the
    // group has one, against its like-for-like peer.
    let peer = names.len() - 1;
    let like = names.iter().position(|n| *n == "tower_body");
    let ratio = |i: usize, p: usize| {
        let ratios: Vec<f64> = (0..times[i].len())
            .map(|r| (times[i][r] - times[0][r]) / (times[p][r] - times[0][r]))
            .collect();
        median(&ratios)
    };
    for (i, name) in names.iter().enumerate() {
        print!(
            "{group}/{name}: {:.1} ns/call, added {:.1} ns, added/{}'s {:.3}",
            median(&times[i]),
            median(&times[i]) - median(&times[0]),
            names[peer],
            ratio(i, peer),
        );
        if let Some(l) = like {
            print!(", added/{}'s {:.3}", names[l], ratio(i, l));
        }
        println!(" (medians of {} paired rounds)", times[i].len());
    }
}

/// Calls `svc` `n` times (reading each response's body if `body`, as
/// `concurrency_overhead` does); ns per call.
async fn calls<S, Req, B>(body: bool, svc: &S, n: usize, request: fn() -> Req) -> f64
where
    S: Service<Req, Response = Response<B>> + Clone,
    S::Error: std::fmt::Debug,
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    let start = Instant::now();
    for _ in 0..n {
        let res = svc.clone().oneshot(request()).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        if body {
            res.into_body().collect().await.unwrap();
        }
    }
    start.elapsed().as_nanos() as f64 / n as f64
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}
