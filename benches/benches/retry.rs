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

/// Deposits into one upstream's budget from one thread and from two at
/// once (this VM has two cores): tollgate's memory budget (`deposit_now`:
/// the key's lookup and its slot under the shard's lock) against tower's
/// `TpsBudget` (atomics). Time per deposit per thread; with two threads,
/// what contention costs each. Group `retry_deposits`.
fn retry_deposits(c: &mut Criterion) {
    use std::sync::{Arc, Barrier};
    use std::time::{Duration, Instant};
    use tollgate_core::{RetryBudgetRule, RetryBudgetStore};
    use tower::retry::budget::{Budget, TpsBudget};

    /// `iters` calls of `deposit` on each of `threads` threads started
    /// together; the slowest thread's time.
    fn run(threads: usize, iters: u64, deposit: Arc<dyn Fn() + Send + Sync>) -> Duration {
        let barrier = Arc::new(Barrier::new(threads));
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let (barrier, deposit) = (Arc::clone(&barrier), Arc::clone(&deposit));
                std::thread::spawn(move || {
                    barrier.wait();
                    let start = Instant::now();
                    for _ in 0..iters {
                        deposit();
                    }
                    start.elapsed()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .max()
            .unwrap_or_default()
    }

    let store = tollgate_memory::MemoryStore::builder().build().unwrap();
    let rule = RetryBudgetRule::new("deposits", 0.2, 10, Duration::from_secs(10)).unwrap();
    let budget = store.retry_budget(&rule).unwrap();
    let tollgate: Arc<dyn Fn() + Send + Sync> = Arc::new(move || budget.deposit_now(b"upstream"));
    let tps = TpsBudget::new(Duration::from_secs(10), 10, 0.2);
    let tower: Arc<dyn Fn() + Send + Sync> = Arc::new(move || tps.deposit());
    let mut g = c.benchmark_group("retry_deposits");
    for threads in [1, 2] {
        for (name, deposit) in [("tollgate", &tollgate), ("tower", &tower)] {
            g.bench_function(format!("{name}_{threads}t"), |b| {
                b.iter_custom(|iters| run(threads, iters, Arc::clone(deposit)))
            });
        }
    }
    g.finish();
}

criterion_group!(benches, retry_overhead, retry_deposits);
criterion_main!(benches);
