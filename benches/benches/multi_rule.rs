//! What a policy of n rules costs per request against n times one rule:
//! an axum `Router` with one handler, driven by `oneshot`, bare and behind
//! a `PolicyLayer` of 1, 3 and 8 in-memory GCRA rules (each keyed by the
//! `x-api-key` header, each its own state, every request allowed), with
//! a single `RateLimitLayer` and 3 stacked `RateLimitLayer`s for
//! reference. The figure of merit is `(policy_n − bare) / (n ×
//! (policy_1 − bare))`. One run, group `multi_rule`.
#![allow(missing_docs, clippy::unwrap_used)]

use axum::body::Body;
use axum::http::StatusCode;
use axum::Router;
use criterion::{criterion_group, criterion_main, Criterion};
use tollgate::key::Header;
use tollgate::policy::{PolicyLayer, RateRule};
use tollgate::{Limit, MemoryStore, Rate, RateLimitLayer};
use tollgate_benches::layer::{request, router};
use tower::ServiceExt;

fn limit() -> Limit {
    Limit::gcra(Rate::per_second(1_000_000_000), 1_000_000_000)
}

fn policy(n: usize) -> Router {
    let mut b = PolicyLayer::<Body>::builder().store(MemoryStore::new());
    for i in 0..n {
        b = b.rule(RateRule::new(
            &format!("rule-{i}"),
            limit(),
            Header::named("x-api-key").unwrap(),
        ));
    }
    router().layer(b.build().unwrap())
}

fn stacked(n: usize) -> Router {
    let store = MemoryStore::new();
    let mut app = router();
    for i in 0..n {
        app = app.layer(
            RateLimitLayer::builder(&format!("rule-{i}"), limit())
                .key(Header::named("x-api-key").unwrap())
                .store(store.clone())
                .build()
                .unwrap(),
        );
    }
    app
}

fn multi_rule(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let mut g = c.benchmark_group("multi_rule");
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
                }
            })
        });
    };
    run("bare", router());
    run("single_layer", stacked(1));
    run("policy_1", policy(1));
    run("policy_3", policy(3));
    run("policy_8", policy(8));
    run("stacked_3", stacked(3));
    g.finish();
}

criterion_group!(benches, multi_rule);
criterion_main!(benches);
