//! What the layer adds to a request: an axum `Router` with one handler,
//! driven by `oneshot`, bare and behind each limiter (in-memory GCRA, key
//! from the `x-api-key` header, headers on), for allowed requests and for a
//! key that is over its limit (every call a 429), and the allowed stack
//! again with a Prometheus recorder installed. One run, group
//! `layer_overhead`.
#![allow(missing_docs, clippy::unwrap_used)]

use axum::http::StatusCode;
use axum::Router;
use criterion::{criterion_group, criterion_main, Criterion};
use tollgate_benches::layer::{self, request, router};
use tower::ServiceExt;

fn layer_overhead(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let mut g = c.benchmark_group("layer_overhead");
    let run =
        |g: &mut criterion::BenchmarkGroup<'_, _>, name: &str, app: Router, want: StatusCode| {
            // Routes made once, as `axum::serve` does for each connection
            // (`Router::with_state`); else axum would apply every layer again
            // on each request.
            let app = app.with_state(());
            // Prime: the over-limit stacks spend their single unit here.
            rt.block_on(app.clone().oneshot(request())).unwrap();
            g.bench_function(name, |b| {
                b.to_async(&rt).iter(|| {
                    let app = app.clone();
                    async move {
                        let res = app.oneshot(request()).await.unwrap();
                        assert_eq!(res.status(), want);
                    }
                })
            });
        };
    run(&mut g, "bare", router(), StatusCode::OK);
    run(
        &mut g,
        "tollgate",
        layer::tollgate_allowing(),
        StatusCode::OK,
    );
    run(
        &mut g,
        "tower_governor",
        layer::governor_allowing(),
        StatusCode::OK,
    );
    run(
        &mut g,
        "tollgate_denied",
        layer::tollgate_denying(),
        StatusCode::TOO_MANY_REQUESTS,
    );
    run(
        &mut g,
        "tower_governor_denied",
        layer::governor_denying(),
        StatusCode::TOO_MANY_REQUESTS,
    );
    // The same allowed stack with its metrics recorded by a Prometheus
    // recorder (the layers above were built before it was installed, so
    // theirs go nowhere): what the metrics cost per request.
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .unwrap();
    run(
        &mut g,
        "tollgate_prometheus",
        layer::tollgate_allowing(),
        StatusCode::OK,
    );
    assert!(handle.render().contains("tollgate_remaining_ratio"));
    g.finish();
}

criterion_group!(benches, layer_overhead);
criterion_main!(benches);
