//! tollgate-server's Envoy RLS handler beside limitador's `RateLimiter`
//! (the crate), on the same descriptors and limits: decisions a second,
//! latency, and what a hot key admitted against its limit. Memory against
//! limitador's in-memory storage; one Redis: the plain store against its
//! `AsyncRedisStorage`, and the store behind `HotKeys` against its
//! `CachedRedisStorage`. Rounds of 3 s in a rotating order, 64 tasks;
//! medians over the rounds.
//!
//! `cargo run --release --manifest-path benches/limitador/Cargo.toml --bin rls [rounds]`
//! (Redis from `TOLLGATE_REDIS_URL`, else one started on a free port.)

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use limitador::limit::Limit as LimitadorLimit;
use limitador::storage::redis::{AsyncRedisStorage, CachedRedisStorage, CachedRedisStorageBuilder};
use limitador::{AsyncRateLimiter, RateLimiter};
use tollgate::store::AnyLimiter;
use tollgate::{AnyStore, MemoryStore, RedisStore};
use tollgate_limitador_bench::{context, decide_until, limitador_admits, median, percentile};
use tollgate_redis::testing::{unique_prefix, Server};
use tollgate_redis::HotKeys;
use tollgate_server::envoy::Domains;
use tollgate_server::rls::Rls;

const TASKS: usize = 64;
const ROUND: Duration = Duration::from_secs(3);
/// Keys of the many-keys case: each task walks all of them.
const KEYS: usize = 10_000;
/// A decision with no answer after this long has stalled.
const STALL: Duration = Duration::from_secs(2);

#[derive(Clone, Copy)]
struct Case {
    name: &'static str,
    /// The limit a key has, a second (a fixed window of one second on
    /// both sides: Envoy's own semantics, and limitador's).
    per_second: u64,
    /// One hot key (`true`), or `KEYS` keys.
    hot: bool,
    /// Instances deciding the hot key side by side (Redis only): each
    /// with its own store handle (or storage), half the tasks each.
    instances: usize,
}

enum Side {
    Rls(Rls<AnyLimiter>),
    Memory(RateLimiter),
    Async(AsyncRateLimiter),
}

struct Contender {
    name: &'static str,
    /// One per instance.
    sides: Vec<Side>,
    /// Tasks deciding side by side.
    tasks: usize,
    /// The runtime its tasks run on, if not the bench's own.
    runtime: Option<tokio::runtime::Handle>,
}

impl Side {
    async fn decide(&self, key: &str) -> bool {
        match self {
            Self::Rls(rls) => {
                let req = RateLimitRequest {
                    domain: "bench".to_owned(),
                    descriptors: vec![RateLimitDescriptor {
                        entries: vec![Entry {
                            key: "user".to_owned(),
                            value: key.to_owned(),
                        }],
                        ..RateLimitDescriptor::default()
                    }],
                    hits_addend: 0,
                };
                let r = rls
                    .should_rate_limit(tonic::Request::new(req))
                    .await
                    .unwrap();
                r.into_inner().overall_code == Code::Ok as i32
            }
            Self::Memory(l) => {
                !l.check_rate_limited_and_update(&"bench".into(), &context("user", key), 1)
                    .unwrap()
                    .limited
            }
            Self::Async(l) => limitador_admits(l, "user", key).await,
        }
    }
}

struct Round {
    per_second: f64,
    admitted: u64,
    /// Decisions with no answer within `STALL` (each stops its task).
    stalled: u64,
    took: f64,
    latencies: Vec<Duration>,
}

async fn round(c: Arc<Contender>, case: Case, tag: String) -> Round {
    let admitted = Arc::new(AtomicU64::new(0));
    let stalled = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let deadline = start + ROUND;
    let tasks: Vec<_> = (0..c.tasks)
        .map(|t| {
            let (c, tag, admitted) = (Arc::clone(&c), tag.clone(), Arc::clone(&admitted));
            let stalled = Arc::clone(&stalled);
            let rt = c
                .runtime
                .clone()
                .unwrap_or_else(tokio::runtime::Handle::current);
            rt.spawn(async move {
                let side = &c.sides[t % c.sides.len()];
                let mut i = t * 7919;
                decide_until(deadline, &admitted, || {
                    let key = if case.hot {
                        tag.clone()
                    } else {
                        i = (i + 1) % KEYS;
                        format!("{tag}-{i}")
                    };
                    let stalled = &stalled;
                    async move {
                        match tokio::time::timeout(STALL, side.decide(&key)).await {
                            Ok(admitted) => Some(admitted),
                            // No answer within STALL: counted, and this
                            // task stops (its decision may never come back).
                            Err(_) => {
                                stalled.fetch_add(1, Ordering::Relaxed);
                                None
                            }
                        }
                    }
                })
                .await
            })
        })
        .collect();
    let mut latencies = Vec::new();
    for t in tasks {
        latencies.extend(t.await.unwrap());
    }
    let took = start.elapsed().as_secs_f64();
    Round {
        per_second: latencies.len() as f64 / took,
        admitted: admitted.load(Ordering::Relaxed),
        stalled: stalled.load(Ordering::Relaxed),
        took,
        latencies,
    }
}

fn rls(config: &std::path::Path, store: AnyStore) -> Side {
    Side::Rls(Rls::new(
        Domains::load(&[config.to_path_buf()], &store).unwrap(),
    ))
}

fn limit(per_second: u64) -> LimitadorLimit {
    LimitadorLimit::new(
        "bench",
        per_second,
        1,
        Vec::new(),
        vec!["user".try_into().unwrap()],
    )
}

#[tokio::main]
async fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .map_or(5, |r| r.parse().expect("rounds"));
    let server = match std::env::var("TOLLGATE_REDIS_URL") {
        Ok(_) => None,
        Err(_) => Some(Server::start().expect("redis-server on PATH")),
    };
    let url = std::env::var("TOLLGATE_REDIS_URL")
        .unwrap_or_else(|_| server.as_ref().map(Server::url).unwrap_or_default());
    let dir = std::env::temp_dir().join(format!("tollgate-rls-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cases = [
        Case {
            name: "10,000 keys, 100/s each",
            per_second: 100,
            hot: false,
            instances: 1,
        },
        Case {
            name: "one key, 10,000/s",
            per_second: 10_000,
            hot: true,
            instances: 1,
        },
        Case {
            name: "one key, 10,000/s, two instances",
            per_second: 10_000,
            hot: true,
            instances: 2,
        },
    ];
    println!("| case | contender | decisions/s (median) | p50 / p99 (median round) | admitted a second | over the limit |");
    println!("|---|---|---:|---|---:|---:|");
    // `CASES=1,2`: only those (numbered from 0).
    let only: Option<Vec<usize>> = std::env::var("CASES")
        .ok()
        .map(|v| v.split(',').filter_map(|n| n.trim().parse().ok()).collect());
    for (n, case) in cases.into_iter().enumerate() {
        if only.as_ref().is_some_and(|o| !o.contains(&n)) {
            continue;
        }
        let config = dir.join(format!("{}.yaml", case.per_second));
        std::fs::write(
            &config,
            format!(
                "domain: bench\ndescriptors:\n  - key: user\n    rate_limit: {{ unit: second, requests_per_unit: {} }}\n",
                case.per_second
            ),
        )
        .unwrap();
        let mut contenders: Vec<Contender> = Vec::new();
        let prefix = unique_prefix();
        let redis = || RedisStore::builder(&url).prefix(&prefix).build().unwrap();
        if case.instances == 1 {
            contenders.push(Contender {
                name: "tollgate RLS, memory",
                sides: vec![rls(&config, MemoryStore::new().into())],
                tasks: TASKS,
                runtime: None,
            });
            let memory = RateLimiter::new(100_000);
            memory.add_limit(limit(case.per_second));
            contenders.push(Contender {
                name: "limitador, memory",
                sides: vec![Side::Memory(memory)],
                tasks: TASKS,
                runtime: None,
            });
        }
        let mut plain = Vec::new();
        let mut hot = Vec::new();
        let mut lim_plain = Vec::new();
        let mut lim_cached = Vec::new();
        for _ in 0..case.instances {
            plain.push(rls(&config, redis().into()));
            hot.push(rls(&config, HotKeys::new().over(redis()).unwrap().into()));
            let l = AsyncRateLimiter::new_with_storage(Box::new(
                AsyncRedisStorage::new(&url).await.unwrap(),
            ));
            l.add_limit(limit(case.per_second));
            lim_plain.push(Side::Async(l));
            let l = AsyncRateLimiter::new_with_storage(Box::new(
                CachedRedisStorage::new(&url).await.unwrap(),
            ));
            l.add_limit(limit(case.per_second));
            lim_cached.push(Side::Async(l));
        }
        contenders.push(Contender {
            name: "tollgate RLS, RedisStore",
            sides: plain,
            tasks: TASKS,
            runtime: None,
        });
        contenders.push(Contender {
            name: "limitador, AsyncRedisStorage",
            sides: lim_plain,
            tasks: TASKS,
            runtime: None,
        });
        contenders.push(Contender {
            name: "tollgate RLS, HotKeys over RedisStore",
            sides: hot,
            tasks: TASKS,
            runtime: None,
        });
        if case.hot {
            contenders.push(Contender {
                name: "limitador, CachedRedisStorage",
                sides: lim_cached,
                tasks: TASKS,
                runtime: None,
            });
        } else {
            // limitador 0.14's batcher holds a DashMap entry across an
            // await (`Batcher::add`, on a semaphore): with many keys, a
            // task that yields there leaves its shard locked, and every
            // worker thread that next touches the shard (other tasks,
            // the flusher) blocks; on the bench's two worker threads the
            // runtime stalls for good (seen at 2 and 64 tasks, 1,000 and
            // 10,000 keys). It runs on a runtime of its own with 64
            // worker threads, so that a blocked thread leaves others to
            // resume the holder.
            drop(lim_cached);
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(64)
                .enable_all()
                .build()
                .unwrap();
            let handle = rt.handle().clone();
            std::mem::forget(rt);
            let mut sides = Vec::new();
            for _ in 0..case.instances {
                let (url, per_second) = (url.clone(), case.per_second);
                let l = handle
                    .spawn(async move {
                        // Room for every key of the case: at its default
                        // (10,000 counters) the semaphore runs out while
                        // a shard is held, and the flush that would give
                        // permits back waits on that shard.
                        let storage = CachedRedisStorageBuilder::new(&url)
                            .max_cached_counters(1_000_000)
                            .build()
                            .await
                            .unwrap();
                        let l = AsyncRateLimiter::new_with_storage(Box::new(storage));
                        l.add_limit(limit(per_second));
                        l
                    })
                    .await
                    .unwrap();
                sides.push(Side::Async(l));
            }
            contenders.push(Contender {
                name: "limitador, CachedRedisStorage (64 worker threads)",
                sides,
                tasks: TASKS,
                runtime: Some(handle),
            });
        }
        let contenders: Vec<Arc<Contender>> = contenders.into_iter().map(Arc::new).collect();
        let mut results: Vec<Vec<Round>> = contenders.iter().map(|_| Vec::new()).collect();
        for r in 0..rounds {
            for i in 0..contenders.len() {
                let which = (i + r) % contenders.len();
                let tag = format!("k{r}-{which}-{}", unique_prefix());
                // A contender whose round does not end (its decisions hang
                // in its own runtime) is recorded as stalled, and left.
                let limit = ROUND + Duration::from_secs(10);
                let c = Arc::clone(&contenders[which]);
                let r = match tokio::time::timeout(limit, round(c, case, tag)).await {
                    Ok(r) => r,
                    Err(_) => Round {
                        per_second: 0.0,
                        admitted: 0,
                        stalled: u64::MAX,
                        took: limit.as_secs_f64(),
                        latencies: Vec::new(),
                    },
                };
                results[which].push(r);
                // Let background work (leases, cached counters) settle.
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }
        for (c, rounds) in contenders.iter().zip(results) {
            let rate = median(rounds.iter().map(|r| r.per_second).collect());
            let mid = rounds
                .iter()
                .min_by(|a, b| {
                    (a.per_second - rate)
                        .abs()
                        .total_cmp(&(b.per_second - rate).abs())
                })
                .unwrap();
            let mut lat = mid.latencies.clone();
            lat.sort();
            let (admitted, over) = if case.hot {
                let limit = case.per_second as f64;
                // Fixed windows of a second: a round of `took` seconds
                // touches at most ceil(took) + 1 windows.
                let admitted = median(rounds.iter().map(|r| r.admitted as f64 / r.took).collect());
                let over = median(
                    rounds
                        .iter()
                        .map(|r| {
                            let windows = r.took.ceil() + 1.0;
                            (r.admitted as f64 / (limit * windows) - 1.0).max(0.0) * 100.0
                        })
                        .collect(),
                );
                (
                    format!("{:.1} k", admitted / 1_000.0),
                    format!("{over:+.1} %"),
                )
            } else {
                ("—".to_owned(), "—".to_owned())
            };
            let hung = rounds.iter().filter(|r| r.stalled == u64::MAX).count();
            let stalled: u64 = rounds
                .iter()
                .filter(|r| r.stalled != u64::MAX)
                .map(|r| r.stalled)
                .sum();
            if hung > 0 {
                println!(
                    "| {} | {} | — ({hung} of {} rounds never ended) | — | — | — |",
                    case.name,
                    c.name,
                    rounds.len()
                );
                continue;
            }
            let name = if stalled > 0 {
                format!("{} ({stalled} decisions stalled > 2 s)", c.name)
            } else {
                c.name.to_owned()
            };
            println!(
                "| {} | {} | {:.1} k | {:?} / {:?} | {} | {} |",
                case.name,
                name,
                rate / 1_000.0,
                percentile(&lat, 0.5),
                percentile(&lat, 0.99),
                admitted,
                over,
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
