//! Decisions on Redis's own `TIME` (no client time) at today's Unix
//! times, for a rule at the finest rate the store accepts: exact, and
//! never more than the rule admits.
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::panic,
    clippy::arithmetic_side_effects
)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tollgate_core::{Limit, Limiter, Outcome, Rate, Rule, Store};
use tollgate_redis::testing::{unique_prefix, Server};
use tollgate_redis::RedisStore;

const US: u64 = 1_000;

/// Redis's own time, in nanoseconds.
async fn redis_time(conn: &mut redis::aio::MultiplexedConnection) -> u64 {
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(conn).await.unwrap();
    secs * 1_000_000_000 + micros * 1_000
}

fn store(server: &Server) -> RedisStore {
    RedisStore::builder(&server.url())
        .prefix(&unique_prefix())
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap()
}

/// One unit per microsecond: every time, interval and window is a whole
/// number of microseconds, as is Redis's `TIME`, so every reply must be
/// one too — and is exactly what the pure GCRA answers. (Computed in
/// doubles on ns since 2023, a unit moved the TAT by 992 or 1,008 ns.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_on_redis_time_are_exact_at_one_per_microsecond() {
    let Some(server) = Server::start() else {
        return;
    };
    let store = store(&server);
    let rule = Rule::new(
        "fine",
        Limit::gcra(Rate::new(1, Duration::from_micros(1)), 1_000),
    )
    .unwrap();
    let limiter = store.limiter(&rule).unwrap();
    for i in 0..50u32 {
        let key = format!("fresh-{i}");
        let d = limiter.decide(key.as_bytes(), 1).await.unwrap();
        assert_eq!(d.outcome, Outcome::Allow { delay: 0 }, "{key}");
        assert_eq!((d.remaining, d.reset_after), (999, US), "{key}: {d:?}");
        let d = limiter.decide(key.as_bytes(), 1_000).await.unwrap();
        // The TAT is 1 µs ahead of the first request; a whole budget needs
        // it not ahead at all: retry in exactly 1 µs less the time since.
        match d.outcome {
            Outcome::Deny { retry_after } => {
                assert_eq!(retry_after % US, 0, "{key}: {d:?}");
                assert!(retry_after <= US, "{key}: {d:?}");
            }
            Outcome::Allow { .. } => assert_eq!(d.reset_after, 1_000 * US, "{key}: {d:?}"),
            Outcome::Never => panic!("{key}: {d:?}"),
        }
        assert_eq!(d.reset_after % US, 0, "{key}: {d:?}");
    }
    assert_eq!(store.stats().errors, 0, "{:?}", store.stats());
}

/// A key kept saturated at one unit per microsecond for two seconds, by
/// many tasks at once: the units admitted plus those left at the end are
/// at most the burst plus one per microsecond of Redis time that passed.
/// (In doubles, each admission moved the TAT 8 ns short — 0.8 % of a
/// unit — and the store admitted hundreds of units too many.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_time_never_over_admits_at_one_per_microsecond() {
    let Some(server) = Server::start() else {
        return;
    };
    let store = store(&server);
    let burst: u32 = 5_000_000;
    let rule = Rule::new(
        "saturated",
        Limit::gcra(Rate::new(1, Duration::from_micros(1)), burst),
    )
    .unwrap();
    let limiter = store.limiter(&rule).unwrap();
    let key = b"hot";
    // Connected beforehand, so that the bracket of Redis times is tight.
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    limiter.decide(b"warm-up", 1).await.unwrap();
    let start = redis_time(&mut conn).await;
    // Spend the whole burst: the TAT is then 5 s ahead, so every unit
    // request below moves it on from the TAT, never from now.
    assert!(limiter
        .decide(key, u64::from(burst))
        .await
        .unwrap()
        .is_allowed());
    let admitted = Arc::new(AtomicU64::new(u64::from(burst)));
    let calls = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + Duration::from_secs(2);
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let (limiter, admitted, calls) =
            (limiter.clone(), Arc::clone(&admitted), Arc::clone(&calls));
        tasks.push(tokio::spawn(async move {
            while Instant::now() < until {
                let d = limiter.decide(key, 1).await.unwrap();
                calls.fetch_add(1, Ordering::Relaxed);
                admitted.fetch_add(u64::from(d.is_allowed()), Ordering::Relaxed);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let left = limiter.decide(key, 0).await.unwrap().remaining;
    let end = redis_time(&mut conn).await;
    let admitted = admitted.load(Ordering::Relaxed);
    let bound = u64::from(burst) + (end - start) / US;
    let calls = calls.load(Ordering::Relaxed);
    assert!(
        admitted + left <= bound,
        "{admitted} admitted + {left} left > {bound}: {} too many in {calls} calls over {} µs",
        admitted + left - bound,
        (end - start) / US
    );
    assert!(calls > 1_000, "only {calls} calls");
    assert_eq!(store.stats().errors, 0, "{:?}", store.stats());
}
