//! Redis decisions: a GCRA decision through `RedisStore` against the floor
//! a scripted limiter can reach (`EVALSHA` of a script that only returns)
//! and a plain `INCR`, on the Redis named by `TOLLGATE_REDIS_URL` (else one
//! this bench starts on a free port). Each sequentially and with 64
//! concurrent tasks on one connection; ids `name/tasks`; time per decision.
//! Also hot keys, batching, and three rules decided jointly
//! (`redis_multi_rule`).
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::arithmetic_side_effects,
    clippy::indexing_slicing
)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use redis::aio::ConnectionManager;
use tollgate_core::{JointPart, Limit, Limiter, Rate, Rule, Store};
use tollgate_redis::testing::Server;
use tollgate_redis::{HotKeys, RedisLimiter, RedisStore};

/// Runs `op` `iters` times split over `tasks` concurrent tasks; returns the
/// wall time.
fn run<F, Fut>(rt: &tokio::runtime::Runtime, iters: u64, tasks: u64, op: F) -> Duration
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let op = Arc::new(op);
    rt.block_on(async {
        let start = Instant::now();
        let per_task = iters.div_ceil(tasks);
        let handles: Vec<_> = (0..tasks)
            .map(|_| {
                let op = Arc::clone(&op);
                tokio::spawn(async move {
                    for _ in 0..per_task {
                        op().await;
                    }
                })
            })
            .collect();
        for h in handles {
            h.await.unwrap();
        }
        start.elapsed()
    })
}

/// `iters` decisions of cost 1 on `key` through `l` over `tasks` tasks,
/// every one admitted.
fn decisions<L: Limiter>(
    rt: &tokio::runtime::Runtime,
    iters: u64,
    tasks: u64,
    l: &L,
    key: &'static [u8],
) -> Duration {
    let l = l.clone();
    run(rt, iters, tasks, move || {
        let l = l.clone();
        async move {
            assert!(l.decide(key, 1).await.unwrap().is_allowed());
        }
    })
}

/// `iters` `EVALSHA`s of the no-op script over `tasks` tasks.
fn noop_calls(
    rt: &tokio::runtime::Runtime,
    iters: u64,
    tasks: u64,
    conn: &ConnectionManager,
    script: &Arc<redis::Script>,
) -> Duration {
    let (conn, script) = (conn.clone(), Arc::clone(script));
    run(rt, iters, tasks, move || {
        let (mut c, s) = (conn.clone(), Arc::clone(&script));
        async move {
            let one: i64 = s.key("bench:{noop}").invoke_async(&mut c).await.unwrap();
            assert_eq!(one, 1);
        }
    })
}

fn redis_decide(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let _runtime = rt.enter();
    let own;
    let url = match std::env::var("TOLLGATE_REDIS_URL") {
        Ok(u) if !u.is_empty() => u,
        _ => {
            own = Server::start().expect("redis-server is needed for this bench");
            own.url()
        }
    };
    let store = RedisStore::builder(&url)
        .prefix("bench")
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let rule = Rule::new(
        "bench",
        Limit::gcra(Rate::per_second(1_000_000), 1_000_000_000),
    )
    .unwrap();
    let limiter = store.limiter(&rule).unwrap();
    let conn: ConnectionManager = rt.block_on(async {
        ConnectionManager::new(redis::Client::open(url.as_str()).unwrap())
            .await
            .unwrap()
    });
    let noop = Arc::new(redis::Script::new("return 1"));

    let mut g = c.benchmark_group("redis_decide");
    for tasks in [1u64, 64] {
        g.bench_function(BenchmarkId::new("tollgate_gcra", tasks), |b| {
            b.iter_custom(|iters| decisions(&rt, iters, tasks, &limiter, b"bench-key"))
        });
        g.bench_function(BenchmarkId::new("raw_evalsha_noop", tasks), |b| {
            b.iter_custom(|iters| noop_calls(&rt, iters, tasks, &conn, &noop))
        });
        let c2 = conn.clone();
        g.bench_function(BenchmarkId::new("raw_incr", tasks), |b| {
            b.iter_custom(|iters| {
                let c2 = c2.clone();
                run(&rt, iters, tasks, move || {
                    let mut c = c2.clone();
                    async move {
                        let _: i64 = redis::cmd("INCR")
                            .arg("bench:{incr}")
                            .query_async(&mut c)
                            .await
                            .unwrap();
                    }
                })
            })
        });
    }
    g.finish();

    // Hot keys: 64 tasks on one connection and one key, a limit that
    // admits nearly all: a store call per decision against local leases.
    let hot_store = HotKeys::new().over(store.clone()).unwrap();
    let hot_rule = Rule::new(
        "bench-hot",
        Limit::gcra(Rate::per_second(1_000_000_000), 1_000_000_000),
    )
    .unwrap();
    let hot = hot_store.limiter(&hot_rule).unwrap();
    let plain = store.limiter(&hot_rule).unwrap();
    let mut g = c.benchmark_group("redis_hot_key");
    let tasks = 64;
    g.bench_function("per_decision", |b| {
        b.iter_custom(|iters| decisions(&rt, iters, tasks, &plain, b"hot-key"))
    });
    g.bench_function("leased", |b| {
        b.iter_custom(|iters| decisions(&rt, iters, tasks, &hot, b"hot-key"))
    });
    g.bench_function("raw_evalsha_noop", |b| {
        b.iter_custom(|iters| noop_calls(&rt, iters, tasks, &conn, &noop))
    });
    g.finish();
    let stats = hot.stats();
    #[allow(clippy::cast_precision_loss)]
    let per = stats.store_calls as f64 / stats.decisions.max(1) as f64;
    println!(
        "redis_hot_key/leased: {} Redis calls for {} decisions ({per:.4} per decision)",
        stats.store_calls, stats.decisions
    );
    over_admission(&rt, &store);

    // Batching different keys into one pipeline: does it pay? 64 calls
    // in flight on one multiplexed connection (what the store does: the
    // connection already writes what is queued in one go) against
    // pipelines of 64 sent one after another (what explicit batching
    // would do), both of the no-op script, so only the transport differs;
    // and tollgate's GCRA over 64 keys, for scale.
    let mut g = c.benchmark_group("redis_batching");
    g.bench_function("concurrent_64", |b| {
        b.iter_custom(|iters| noop_calls(&rt, iters, 64, &conn, &noop))
    });
    g.bench_function("pipelined_64", |b| {
        b.iter_custom(|iters| {
            let mut c = conn.clone();
            let noop = Arc::clone(&noop);
            rt.block_on(async move {
                let start = Instant::now();
                for _ in 0..iters.div_ceil(64) {
                    let mut pipe = redis::pipe();
                    for k in 0..64 {
                        pipe.cmd("EVALSHA")
                            .arg(noop.get_hash())
                            .arg(1)
                            .arg(format!("bench:{{noop{k}}}"));
                    }
                    let ones: Vec<i64> = match pipe.query_async(&mut c).await {
                        Ok(ones) => ones,
                        // NOSCRIPT: load it once, then again.
                        Err(_) => {
                            let _: i64 =
                                noop.key("bench:{noop}").invoke_async(&mut c).await.unwrap();
                            pipe.query_async(&mut c).await.unwrap()
                        }
                    };
                    assert_eq!(ones.len(), 64);
                }
                start.elapsed()
            })
        })
    });
    let keys: Arc<Vec<Vec<u8>>> =
        Arc::new((0..64).map(|k| format!("key-{k}").into_bytes()).collect());
    g.bench_function("tollgate_gcra_64_keys", |b| {
        b.iter_custom(|iters| {
            let (l, keys) = (limiter.clone(), Arc::clone(&keys));
            let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
            run(&rt, iters, 64, move || {
                let (l, keys, next) = (l.clone(), Arc::clone(&keys), Arc::clone(&next));
                async move {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 64;
                    assert!(l.decide(&keys[i], 1).await.unwrap().is_allowed());
                }
            })
        })
    });
    g.finish();

    multi_rule(c, &rt, &store, &conn, &noop);
}

/// Three rate rules (GCRA, fixed window, sliding window counter, limits
/// that admit every request) on one request: decided jointly, in one
/// script call (what a policy does now), against one call per rule side
/// by side (what it did before), one rule alone, and the no-op `EVALSHA`;
/// 1 and 64 concurrent requests; time per request.
fn multi_rule(
    c: &mut Criterion,
    rt: &tokio::runtime::Runtime,
    store: &RedisStore,
    conn: &ConnectionManager,
    noop: &Arc<redis::Script>,
) {
    let huge = 1_000_000_000;
    let limits = [
        Limit::gcra(Rate::per_second(huge), huge),
        Limit::fixed_window(huge, Duration::from_secs(60)),
        Limit::sliding_window_counter(huge, Duration::from_secs(60)),
    ];
    let limiters: Arc<Vec<_>> = Arc::new(
        limits
            .into_iter()
            .enumerate()
            .map(|(i, limit)| {
                let rule = Rule::new(format!("multi-{i}"), limit).unwrap();
                store.limiter(&rule).unwrap()
            })
            .collect(),
    );
    let mut g = c.benchmark_group("redis_multi_rule");
    for tasks in [1u64, 64] {
        let ls = Arc::clone(&limiters);
        g.bench_function(BenchmarkId::new("joint_3", tasks), |b| {
            b.iter_custom(|iters| {
                let ls = Arc::clone(&ls);
                run(rt, iters, tasks, move || {
                    let ls = Arc::clone(&ls);
                    async move {
                        let parts: Vec<JointPart<'_, RedisLimiter>> = ls
                            .iter()
                            .map(|limiter| JointPart {
                                limiter,
                                key: b"multi-key",
                                cost: 1,
                                enforced: true,
                            })
                            .collect();
                        let answers = RedisLimiter::decide_joint(&parts).unwrap().await;
                        assert!(answers.iter().all(|a| a.consumed));
                    }
                })
            })
        });
        let ls = Arc::clone(&limiters);
        g.bench_function(BenchmarkId::new("separate_3", tasks), |b| {
            b.iter_custom(|iters| {
                let ls = Arc::clone(&ls);
                run(rt, iters, tasks, move || {
                    let ls = Arc::clone(&ls);
                    async move {
                        let each = ls.iter().map(|l| l.decide(b"multi-key", 1)).collect();
                        let answers = tollgate_core::join_all(each).await;
                        assert!(answers.iter().all(|a| a.as_ref().unwrap().is_allowed()));
                    }
                })
            })
        });
        g.bench_function(BenchmarkId::new("one_rule", tasks), |b| {
            b.iter_custom(|iters| decisions(rt, iters, tasks, &limiters[0], b"multi-key"))
        });
        g.bench_function(BenchmarkId::new("raw_evalsha_noop", tasks), |b| {
            b.iter_custom(|iters| noop_calls(rt, iters, tasks, conn, noop))
        });
    }
    g.finish();
}

/// A 10-s run of 64 tasks on one hot key with a limit they exceed many
/// times over (2,000 a second, bursts of 100), through leases: what was admitted against
/// what exact GCRA admits over the run (burst + rate × elapsed).
fn over_admission(rt: &tokio::runtime::Runtime, store: &RedisStore) {
    let secs: u64 = std::env::var("TOLLGATE_HOT_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    let rule = Rule::new("bench-over", Limit::gcra(Rate::per_second(2_000), 100)).unwrap();
    let hot = HotKeys::new()
        .over(store.clone())
        .unwrap()
        .limiter(&rule)
        .unwrap();
    let admitted = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let elapsed = rt.block_on(async {
        let start = Instant::now();
        let end = start + Duration::from_secs(secs);
        let tasks: Vec<_> = (0..64)
            .map(|_| {
                let (l, admitted) = (hot.clone(), Arc::clone(&admitted));
                tokio::spawn(async move {
                    while Instant::now() < end {
                        if l.decide(b"over-key", 1).await.unwrap().is_allowed() {
                            admitted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                        tokio::task::yield_now().await;
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        start.elapsed()
    });
    let admitted = admitted.load(std::sync::atomic::Ordering::Relaxed);
    #[allow(clippy::cast_precision_loss)]
    let exact = 100.0 + 2_000.0 * elapsed.as_secs_f64();
    let stats = hot.stats();
    #[allow(clippy::cast_precision_loss)]
    let over = (admitted as f64 - exact) / exact * 100.0;
    #[allow(clippy::cast_precision_loss)]
    let per = stats.store_calls as f64 / stats.decisions.max(1) as f64;
    println!(
        "redis_hot_key/over_admission: {admitted} admitted in {:.2} s, exact GCRA {exact:.0}: {over:+.2} % of the limit; {} decisions, {per:.4} Redis calls per decision",
        elapsed.as_secs_f64(),
        stats.decisions
    );
}

criterion_group!(benches, redis_decide);
criterion_main!(benches);
