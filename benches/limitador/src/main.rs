//! One hot key, 64 concurrent tasks, one local Redis: decisions a second,
//! latency and what was admitted against the limit's ideal, for
//! `RedisStore` (a script call per decision), `HotKeys` over it, and
//! limitador's `AsyncRedisStorage` and `CachedRedisStorage` (defaults).
//! Rounds of 3 s in a rotating order; medians over the rounds.
//!
//! `cargo run --release --manifest-path benches/limitador/Cargo.toml [rounds]`
//! (Redis from `TOLLGATE_REDIS_URL`, else one started on a free port;
//! `LIMITS=10000,2000:10` for other limits, each `rate[:burst]`.)

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use limitador::limit::Limit as LimitadorLimit;
use limitador::storage::redis::{AsyncRedisStorage, CachedRedisStorage};
use limitador::AsyncRateLimiter;
use tollgate_core::{Limit, Limiter, Rate, Rule, Store};
use tollgate_limitador_bench::{decide_until, limitador_admits, median, percentile};
use tollgate_redis::testing::{unique_prefix, Server};
use tollgate_redis::{HotKeys, HotLimiter, RedisLimiter, RedisStore};

const TASKS: usize = 64;
const ROUND: Duration = Duration::from_secs(3);

/// A limit as both sides state it: `per_second`, with a burst (tollgate's
/// GCRA; one second's worth unless given) or a one-second window
/// (limitador) of `per_second`.
#[derive(Clone)]
struct Case {
    name: String,
    per_second: u32,
    burst: u32,
}

impl Case {
    /// `rate` or `rate:burst`.
    fn parse(s: &str) -> Self {
        let (rate, burst) = s.split_once(':').unwrap_or((s, ""));
        let per_second: u32 = rate.trim().parse().expect("LIMITS: a rate a second");
        let burst = if burst.is_empty() {
            per_second
        } else {
            burst.trim().parse().expect("LIMITS: a burst")
        };
        Self {
            name: format!("{per_second}/s, burst {burst}"),
            per_second,
            burst,
        }
    }
}

enum Contender {
    Redis(RedisLimiter),
    Hot(HotLimiter<RedisLimiter>),
    Limitador(Arc<AsyncRateLimiter>),
}

impl Contender {
    fn name(&self, cached: bool) -> &'static str {
        match self {
            Self::Redis(_) => "RedisStore per decision",
            Self::Hot(_) => "HotKeys",
            Self::Limitador(_) if cached => "limitador CachedRedisStorage",
            Self::Limitador(_) => "limitador AsyncRedisStorage",
        }
    }

    async fn decide(&self, key: &str) -> bool {
        match self {
            Self::Redis(l) => l.decide(key.as_bytes(), 1).await.unwrap().is_allowed(),
            Self::Hot(l) => l.decide(key.as_bytes(), 1).await.unwrap().is_allowed(),
            Self::Limitador(l) => limitador_admits(l, "k", key).await,
        }
    }
}

struct Round {
    per_second: f64,
    admitted: u64,
    /// What the limit admits over the round.
    ideal: f64,
    latencies: Vec<Duration>,
}

/// One round of `ROUND` on a fresh key.
async fn round(c: Arc<Contender>, case: &Case, key: String, rt: &tokio::runtime::Handle) -> Round {
    let admitted = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let deadline = start + ROUND;
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let (c, key, admitted) = (Arc::clone(&c), key.clone(), Arc::clone(&admitted));
            rt.spawn(async move {
                decide_until(deadline, &admitted, || async { Some(c.decide(&key).await) }).await
            })
        })
        .collect();
    let mut latencies = Vec::new();
    for t in tasks {
        latencies.extend(t.await.unwrap());
    }
    let took = start.elapsed().as_secs_f64();
    let rate = f64::from(case.per_second);
    Round {
        per_second: latencies.len() as f64 / took,
        admitted: admitted.load(Ordering::Relaxed),
        // GCRA: its burst and its rate; limitador's fixed windows of a
        // second: about its limit each second.
        ideal: match &*c {
            Contender::Limitador(_) => rate * took,
            _ => f64::from(case.burst) + rate * took,
        },
        latencies,
    }
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
    // `LIMITS=1000,2000:10,10000`: rates a second, each with its burst
    // after a colon (one second's worth when left out). By default, all
    // admitted, then the fleet review's sweep (burst = one second) and its
    // small burst.
    let limits = std::env::var("LIMITS")
        .unwrap_or_else(|_| "1000000000,1000,2000,5000,10000,20000,2000:10".to_owned());
    let cases: Vec<Case> = limits.split(',').map(Case::parse).collect();
    // Never dropped (a runtime cannot be dropped inside another).
    let cached_runtime: &'static tokio::runtime::Runtime = Box::leak(Box::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(64)
            .enable_all()
            .build()
            .unwrap(),
    ));
    println!("| limit | contender | decisions/s (median) | latency p50 / p99 / max (median round) | admitted a second | admitted vs the limit's own bound |");
    println!("|---|---|---:|---|---:|---:|");
    for case in &cases {
        let rule = Rule::new(
            "hot",
            Limit::gcra(Rate::per_second(case.per_second), case.burst),
        )
        .unwrap();
        let store = RedisStore::builder(&url)
            .prefix(&unique_prefix())
            .build()
            .unwrap();
        let hot = HotKeys::new().over(store.clone()).unwrap();
        let limit = LimitadorLimit::new(
            "bench",
            u64::from(case.per_second),
            1,
            Vec::new(),
            vec!["k".try_into().unwrap()],
        );
        let plain = AsyncRateLimiter::new_with_storage(Box::new(
            AsyncRedisStorage::new(&url).await.unwrap(),
        ));
        plain.add_limit(limit.clone());
        let cached = AsyncRateLimiter::new_with_storage(Box::new(
            CachedRedisStorage::new(&url).await.unwrap(),
        ));
        cached.add_limit(limit);
        let contenders = [
            (
                Arc::new(Contender::Redis(store.limiter(&rule).unwrap())),
                false,
            ),
            (Arc::new(Contender::Hot(hot.limiter(&rule).unwrap())), false),
            (Arc::new(Contender::Limitador(Arc::new(plain))), false),
            (Arc::new(Contender::Limitador(Arc::new(cached))), true),
        ];
        let mut results: Vec<Vec<Round>> = contenders.iter().map(|_| Vec::new()).collect();
        let here = tokio::runtime::Handle::current();
        // limitador 0.14's cached storage holds a DashMap entry across an
        // await (its batcher's semaphore): a task that yields there (its
        // coop budget spent, as in a server) leaves the shard locked, and
        // the worker threads that touch it next block; on the bench's two
        // threads the runtime stalls for good. It runs on a runtime of its
        // own with 64 worker threads, so that a blocked thread leaves
        // others to resume the holder (as `--bin rls` does).
        let own = cached_runtime.handle().clone();
        for r in 0..rounds {
            for i in 0..contenders.len() {
                let which = (i + r) % contenders.len();
                let (c, cached) = &contenders[which];
                let key = format!("k{r}-{which}-{}", unique_prefix());
                let rt = if *cached { &own } else { &here };
                results[which].push(round(Arc::clone(c), case, key, rt).await);
                // Let the previous round's background work (leases given
                // back, cached counters flushed) settle.
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }
        for ((c, cached), rounds) in contenders.iter().zip(results) {
            let rate = median(rounds.iter().map(|r| r.per_second).collect());
            let over = median(
                rounds
                    .iter()
                    .map(|r| (r.admitted as f64 / r.ideal - 1.0) * 100.0)
                    .collect(),
            );
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
            let admitted_per_second = median(
                rounds
                    .iter()
                    .map(|r| r.admitted as f64 * r.per_second / r.latencies.len().max(1) as f64)
                    .collect(),
            );
            let (per_second, over) = if case.per_second >= 1_000_000_000 {
                ("—".to_owned(), "—".to_owned())
            } else {
                (
                    format!("{:.1} k", admitted_per_second / 1_000.0),
                    format!("{over:+.2} %"),
                )
            };
            println!(
                "| {} | {} | {:.1} k | {:?} / {:?} / {:?} | {} | {} |",
                case.name,
                c.name(*cached),
                rate / 1_000.0,
                percentile(&lat, 0.5),
                percentile(&lat, 0.99),
                lat.last().copied().unwrap_or_default(),
                per_second,
                over,
            );
        }
    }
}
