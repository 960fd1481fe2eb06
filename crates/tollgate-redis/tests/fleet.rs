//! Many instances, one limit: concurrency across connections, clock skew,
//! and what ends up in Redis.
#![allow(missing_docs, clippy::unwrap_used, clippy::arithmetic_side_effects)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tollgate_core::{Limit, Limiter, ManualClock, Rate, Rule, Store};
use tollgate_redis::testing::{unique_prefix, Server};
use tollgate_redis::RedisStore;

/// Redis's own time, in nanoseconds.
async fn redis_time(url: &str) -> u64 {
    let client = redis::Client::open(url).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
    secs * 1_000_000_000 + micros * 1_000
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_of_64_tasks_never_exceed_the_limit() {
    let Some(server) = Server::start() else {
        return;
    };
    // 200 per second (5 ms apart), bursts of 20.
    let rule = Rule::new("fleet", Limit::gcra(Rate::per_second(200), 20)).unwrap();
    let prefix = unique_prefix();
    let stores: Vec<RedisStore> = (0..3)
        .map(|_| {
            RedisStore::builder(&server.url())
                .prefix(&prefix)
                .timeout(Duration::from_secs(5))
                .build()
                .unwrap()
        })
        .collect();
    let admitted = Arc::new(AtomicU64::new(0));
    let decided = Arc::new(AtomicU64::new(0));
    let start = redis_time(&server.url()).await;
    let mut tasks = Vec::new();
    for store in &stores {
        let limiter = store.limiter(&rule).unwrap();
        for _ in 0..64 {
            let (limiter, admitted, decided) =
                (limiter.clone(), Arc::clone(&admitted), Arc::clone(&decided));
            tasks.push(tokio::spawn(async move {
                for _ in 0..25 {
                    let d = limiter.decide(b"shared-key", 1).await.unwrap();
                    decided.fetch_add(1, Ordering::Relaxed);
                    admitted.fetch_add(u64::from(d.is_allowed()), Ordering::Relaxed);
                }
            }));
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    let end = redis_time(&server.url()).await;
    let admitted = admitted.load(Ordering::Relaxed);
    // Every script ran at a Redis time in [start, end], so GCRA admits at
    // most the burst plus one unit per 5 ms of that span (+1 for the edge).
    let bound = 20 + (end - start) / 5_000_000 + 1;
    assert_eq!(decided.load(Ordering::Relaxed), 3 * 64 * 25);
    assert!(admitted <= bound, "admitted {admitted} > bound {bound}");
    assert!(admitted >= 20, "admitted {admitted}: not even the burst");
    for s in &stores {
        assert_eq!(s.stats().errors + s.stats().timeouts, 0, "{:?}", s.stats());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_time_makes_skewed_instances_agree() {
    let Some(server) = Server::start() else {
        return;
    };
    let rule = Rule::new("skew", Limit::gcra(Rate::per_minute(1), 5)).unwrap();

    // Two instances whose own clocks are five minutes apart. With Redis's
    // TIME (the default) their clocks are never consulted: together they
    // admit exactly one burst.
    let prefix = unique_prefix();
    let a_clock = ManualClock::starting_at(1_000_000_000_000_000);
    let b_clock = ManualClock::starting_at(1_000_000_000_000_000 + 300_000_000_000);
    let redis_timed = |_local: &ManualClock| {
        RedisStore::builder(&server.url())
            .prefix(&prefix)
            .build()
            .unwrap()
            .limiter(&rule)
            .unwrap()
    };
    let (a, b) = (redis_timed(&a_clock), redis_timed(&b_clock));
    let mut admitted = 0;
    for i in 0..20 {
        let l = if i % 2 == 0 { &a } else { &b };
        admitted += u32::from(l.decide(b"k", 1).await.unwrap().is_allowed());
    }
    assert_eq!(admitted, 5);

    // The control: the same two instances deciding on their own (skewed)
    // clocks disagree — B, five minutes "later", sees a refilled budget.
    let prefix = unique_prefix();
    let client_timed = |local: &ManualClock| {
        RedisStore::builder(&server.url())
            .prefix(&prefix)
            .client_time(local.clone())
            .build()
            .unwrap()
            .limiter(&rule)
            .unwrap()
    };
    let (a, b) = (client_timed(&a_clock), client_timed(&b_clock));
    let mut admitted = 0;
    for _ in 0..10 {
        admitted += u32::from(a.decide(b"k", 1).await.unwrap().is_allowed());
    }
    for _ in 0..10 {
        admitted += u32::from(b.decide(b"k", 1).await.unwrap().is_allowed());
    }
    assert_eq!(admitted, 10, "skewed client clocks admit twice the burst");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_keys_become_short_expiring_redis_keys() {
    let Some(server) = Server::start() else {
        return;
    };
    let store = RedisStore::builder(&server.url())
        .prefix("hyg")
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let limiter = store
        .limiter(&Rule::new("r", Limit::gcra(Rate::per_second(1), 2)).unwrap())
        .unwrap();
    let keys: Vec<Vec<u8>> = vec![
        b"\r\nFLUSHALL\r\n".to_vec(),
        b"{other-slot}".to_vec(),
        b"\0\0".to_vec(),
        vec![b'x'; 1 << 20],
        "ключ".as_bytes().to_vec(),
        b"plain-key".to_vec(),
    ];
    for k in &keys {
        assert!(limiter.decide(k, 1).await.unwrap().is_allowed());
    }
    let listed = server.cli(&["--scan", "--pattern", "hyg:*"]);
    let names: Vec<&str> = listed.lines().filter(|l| !l.is_empty()).collect();
    assert_eq!(names.len(), keys.len(), "{names:?}");
    for name in names {
        assert!(name.len() <= 64, "{name} is too long");
        let ttl: i64 = server.cli(&["pttl", name]).trim().parse().unwrap();
        assert!(ttl > 0 && ttl <= 3_000, "{name} has TTL {ttl}");
    }
    assert!(server.cli(&["dbsize"]).trim().parse::<u64>().unwrap() == keys.len() as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_live_as_long_as_their_state_matters() {
    let Some(server) = Server::start() else {
        return;
    };
    let store = RedisStore::builder(&server.url())
        .prefix("ttl")
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    // (rule, longest the state can matter, in ms)
    let cases = [
        // The current window's count still weighs in the next window.
        (
            Limit::sliding_window_counter(100, Duration::from_secs(4)),
            8_000,
        ),
        // The queue can reach max_delay plus one interval ahead.
        (
            Limit::leaky_bucket(Rate::new(1, Duration::from_secs(4)), Duration::from_secs(3)),
            7_000,
        ),
        (Limit::gcra(Rate::per_second(1), 5), 5_000),
    ];
    for (i, (limit, lifetime)) in cases.into_iter().enumerate() {
        let rule = Rule::new(format!("ttl-{i}"), limit).unwrap();
        let l = store.limiter(&rule).unwrap();
        l.decide(b"k", 1).await.unwrap();
        let name = server.cli(&["--scan", "--pattern", &format!("ttl:{{*|ttl-{i}|*")]);
        let ttl: i64 = server.cli(&["pttl", name.trim()]).trim().parse().unwrap();
        assert!(
            ttl >= lifetime && ttl <= lifetime + 1_000,
            "{limit:?}: TTL {ttl} ms for a state that matters {lifetime} ms"
        );
    }
}

/// The scripts count exactly up to 2^51 ns (about 26 days): a rule with a
/// longer span is refused when it is bound, naming the field; any rate
/// the core takes, down to one unit per nanosecond, is fine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_longer_than_the_scripts_count_exactly_are_refused_at_build() {
    let Some(server) = Server::start() else {
        return;
    };
    let store = RedisStore::builder(&server.url())
        .prefix(&unique_prefix())
        .build()
        .unwrap();
    let day = Duration::from_secs(86_400);
    let longest = Duration::from_nanos(1 << 51);
    let longer = Duration::from_nanos((1 << 51) + 1);
    for (limit, field) in [
        (Limit::gcra(Rate::per_day(1), 27), "burst"),
        (Limit::gcra(Rate::new(1, 30 * day), 1), "rate"),
        (Limit::token_bucket(27, 1, day), "interval"),
        (Limit::fixed_window(1, longer), "window"),
        (Limit::sliding_window_counter(1, longer), "window"),
        (Limit::sliding_window_log(1, longer), "window"),
        (
            Limit::leaky_bucket(Rate::new(1, longer), Duration::ZERO),
            "rate",
        ),
        (
            Limit::leaky_bucket(Rate::per_second(1), longer),
            "max_delay",
        ),
    ] {
        let rule = Rule::new("long", limit).unwrap();
        let err = store.limiter(&rule).unwrap_err();
        assert_eq!(err.field(), field, "{limit:?}: {err}");
    }
    let conc = tollgate_core::ConcurrencyRule::new("long", 1, longer).unwrap();
    assert_eq!(
        store.concurrency_limiter(&conc).unwrap_err().field(),
        "lease_ttl"
    );
    for limit in [
        Limit::gcra(Rate::per_day(1), 26),
        Limit::fixed_window(1, longest),
        Limit::leaky_bucket(Rate::per_second(1), longest),
        Limit::gcra(Rate::new(1, Duration::from_nanos(1)), 10),
        Limit::token_bucket(10, 1, Duration::from_nanos(1)),
        Limit::sliding_window_counter(10, Duration::from_nanos(1)),
    ] {
        let rule = Rule::new("ok", limit).unwrap();
        assert!(store.limiter(&rule).is_ok(), "{limit:?}");
    }
    let conc = tollgate_core::ConcurrencyRule::new("ok", 1, longest).unwrap();
    assert!(store.concurrency_limiter(&conc).is_ok());
}
