//! What a retry layer adds to a call that succeeds (the common case): a
//! service answering 200 at once, driven by `oneshot` with a small GET,
//! bare, behind tollgate's `RetryBudgetLayer` (memory store, default
//! budget) and behind tower's `Retry` with a `TpsBudget` (the same
//! budget: 20 % over 10 s, 10 retries a second), and behind tollgate's
//! layer with the budget on Redis (`tollgate_redis`: a redis-server of its
//! own, or `TOLLGATE_REDIS_URL`), after which it prints the script calls
//! Redis ran per client call. One run, group `retry_overhead`.
#![allow(missing_docs, clippy::unwrap_used)]

use criterion::{criterion_group, criterion_main, Criterion};
use http::StatusCode;
use tollgate_benches::retry::{self, request};
use tower::ServiceExt;

fn retry_overhead(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
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
    // The budget on Redis: deposits are counted in the process and go in
    // batches (every 10 ms), so the calls per client call are few.
    let own;
    let url = match std::env::var("TOLLGATE_REDIS_URL") {
        Ok(u) if !u.is_empty() => u,
        _ => {
            own = tollgate_redis::testing::Server::start()
                .expect("redis-server is needed for this bench");
            own.url()
        }
    };
    let store = rt.block_on(async {
        tollgate_redis::RedisStore::builder(&url)
            .prefix(&tollgate_redis::testing::unique_prefix())
            .build()
            .unwrap()
    });
    let on_redis = rt.block_on(async { retry::tollgate_on(store) });
    let calls = std::sync::atomic::AtomicU64::new(0);
    let scripts_before = script_calls(&url);
    g.bench_function("tollgate_redis", |b| {
        b.to_async(&rt).iter(|| {
            calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let svc = on_redis.clone();
            async move {
                let res = svc.oneshot(request()).await.unwrap();
                assert_eq!(res.status(), StatusCode::OK);
            }
        })
    });
    // What the last flush sends is in by now.
    rt.block_on(async { tokio::time::sleep(std::time::Duration::from_millis(50)).await });
    let scripts = script_calls(&url).saturating_sub(scripts_before);
    let calls = calls.load(std::sync::atomic::Ordering::Relaxed);
    println!(
        "retry_overhead/tollgate_redis: {scripts} script calls for {calls} client calls ({:.2e} per call)",
        scripts as f64 / calls.max(1) as f64
    );
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

/// Script calls Redis at `url` has run (`INFO commandstats`: `evalsha`
/// and `eval`).
fn script_calls(url: &str) -> u64 {
    let client = redis::Client::open(url).unwrap();
    let mut conn = client.get_connection().unwrap();
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut conn)
        .unwrap();
    tollgate_redis::testing::script_calls_in(&info)
}

criterion_group!(benches, retry_overhead);
criterion_main!(benches);
