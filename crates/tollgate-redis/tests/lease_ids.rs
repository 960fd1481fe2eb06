//! Lease ids are the client's: a lease is renewed and released only by
//! the holder that took it, even after Redis lost its state, and an
//! acquire whose answer came too late leaves no lease behind. Lease TTLs
//! under a second are refused.
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects
)]

use std::time::{Duration, Instant};

use tollgate_core::testing::UNIX_2026;
use tollgate_core::{ConcurrencyLimiter, ConcurrencyRule, ManualClock, Store};
use tollgate_redis::testing::{unique_prefix, Server};
use tollgate_redis::{FailurePolicy, RedisStore};

const ALL: u32 = u32::MAX;

fn instance(server: &Server, prefix: &str, clock: &ManualClock) -> RedisStore {
    RedisStore::builder(&server.url())
        .prefix(prefix)
        .client_time(clock.clone())
        .timeout(Duration::from_secs(2))
        .lease_renewal(false)
        .build()
        .unwrap()
}

/// Redis loses every key (a restart without persistence, a failover to a
/// replica that had not caught up, a flush) while instance A holds a
/// lease; instance B then takes one. B's lease has an id of its own, so
/// A's renewals do not keep B's alive and A's release does not free it.
/// (With ids counted in Redis, both were lease 1: A released B's lease.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_id_is_never_given_twice_after_redis_loses_its_state() {
    let Some(server) = Server::start() else {
        return;
    };
    let prefix = unique_prefix();
    let clock = ManualClock::at_unix(UNIX_2026);
    let (a, b) = (
        instance(&server, &prefix, &clock),
        instance(&server, &prefix, &clock),
    );
    let rule = ConcurrencyRule::new("ids", 2, Duration::from_secs(10)).unwrap();
    let (la, lb) = (
        a.concurrency_limiter(&rule).unwrap(),
        b.concurrency_limiter(&rule).unwrap(),
    );
    let held_by_a = la.acquire(b"k", 1, ALL).await.unwrap().lease.unwrap();
    server.cli(&["flushall"]);
    let held_by_b = lb.acquire(b"k", 1, ALL).await.unwrap().lease.unwrap();
    assert_ne!(held_by_a.id, held_by_b.id);
    // A renews what it thinks it holds, late in B's lease...
    clock.advance(Duration::from_secs(9));
    a.renew_leases().await;
    // ...which does not make B's outlive its TTL.
    clock.advance(Duration::from_secs(1));
    assert_eq!(
        lb.held(b"k").await.unwrap(),
        0,
        "A's renewal kept B's lease"
    );
    // And A's release leaves B's lease alone.
    clock.set(UNIX_2026 + 20_000_000_000);
    let held_by_b = lb.acquire(b"k", 1, ALL).await.unwrap().lease.unwrap();
    let again_a = la.acquire(b"k", 1, ALL).await.unwrap().lease.unwrap();
    server.cli(&["flushall"]);
    let b2 = lb.acquire(b"k", 1, ALL).await.unwrap().lease.unwrap();
    la.release(b"k", again_a).await.unwrap();
    la.release(b"k", held_by_a).await.unwrap();
    assert_eq!(
        lb.held(b"k").await.unwrap(),
        1,
        "A's release freed B's lease"
    );
    lb.release(b"k", b2).await.unwrap();
    lb.release(b"k", held_by_b).await.unwrap();
    assert_eq!(lb.held(b"k").await.unwrap(), 0);
}

/// The script itself: an acquire under an id (and permits) a live lease of
/// the key already has takes nothing and answers kind 3; ids up to 2^62
/// are kept to the digit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_under_a_taken_id_takes_nothing() {
    let Some(server) = Server::start() else {
        return;
    };
    let script = redis::Script::new(concat!(
        include_str!("../src/scripts/prelude.lua"),
        include_str!("../src/scripts/semaphore.lua")
    ));
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let id = "4611686018427387903";
    let acquire = |id: &str| {
        let mut call = script.prepare_invoke();
        call.key("t:{sem2|ids|k:k}")
            .key("t:{sem2|ids|k:k}:meta")
            // mode, permits, now (Redis's), key TTL in ms, max, lease TTL
            // in ns, retry hint in ns, ceiling, id
            .arg("acquire")
            .arg("2")
            .arg("")
            .arg("11000")
            .arg("5")
            .arg("10000000000")
            .arg("1")
            .arg("5")
            .arg(id);
        call
    };
    let first: Vec<i64> = acquire(id).invoke_async(&mut conn).await.unwrap();
    assert_eq!(first[..4], [0, 0, 5, 3]);
    let taken: Vec<i64> = acquire(id).invoke_async(&mut conn).await.unwrap();
    assert_eq!(taken[..4], [3, 0, 5, 3], "a taken id was granted");
    let other: Vec<i64> = acquire("4611686018427387902")
        .invoke_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(other[..4], [0, 0, 5, 1]);
    let members = server.cli(&["zrange", "t:{sem2|ids|k:k}", "1", "-1"]);
    let mut members: Vec<&str> = members.lines().collect();
    members.sort_unstable();
    assert_eq!(
        members,
        ["4611686018427387902:2", "4611686018427387903:2"],
        "ids must be kept to the digit"
    );
    assert_eq!(
        server
            .cli(&["hget", "t:{sem2|ids|k:k}:meta", "held"])
            .trim(),
        "4"
    );
}

/// Redis hangs while an acquire is on its way: the acquire gets no answer
/// within the timeout (the failure policy answers), and the script runs
/// once Redis resumes, granting a lease nobody holds. The store releases
/// that lease itself (it chose its id), so its permits come back long
/// before its TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_whose_answer_came_too_late_leaves_no_lease() {
    let Some(server) = Server::start() else {
        return;
    };
    let store = RedisStore::builder(&server.url())
        .prefix(&unique_prefix())
        .timeout(Duration::from_millis(100))
        .failure_policy(FailurePolicy::Open)
        .build()
        .unwrap();
    let rule = ConcurrencyRule::new("late", 2, Duration::from_secs(60)).unwrap();
    let sem = store.concurrency_limiter(&rule).unwrap();
    // The script is loaded: a late EVALSHA would run it.
    let warm = sem.acquire(b"k", 1, ALL).await.unwrap().lease.unwrap();
    sem.release(b"k", warm).await.unwrap();
    server.pause(true);
    let got = sem.acquire(b"k", 2, ALL).await.unwrap();
    // Fail open: a lease that holds nothing in Redis.
    assert!(got.decision.is_allowed());
    tokio::time::sleep(Duration::from_millis(200)).await;
    server.pause(false);
    let start = Instant::now();
    loop {
        store.flush().await;
        if let Ok(0) = sem.held(b"k").await {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "a late grant held its permits: {:?}",
            store.stats()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(store.stats().timeouts >= 1, "{:?}", store.stats());
    sem.release(b"k", got.lease.unwrap()).await.unwrap();
    assert_eq!(sem.held(b"k").await.unwrap(), 0);
    assert!(sem.acquire(b"k", 2, ALL).await.unwrap().lease.is_some());
}

/// The lease task renews every third of a lease's TTL over the network: a
/// TTL under a second would lapse mid-request on a slow round trip, and is
/// refused when the rule is bound, naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_ttls_under_a_second_are_refused() {
    let store = RedisStore::builder("redis://127.0.0.1:1")
        .prefix("svc")
        .build()
        .unwrap();
    for ttl in [Duration::from_millis(1), Duration::from_millis(999)] {
        let rule = ConcurrencyRule::new("short", 1, ttl).unwrap();
        let err = store.concurrency_limiter(&rule).unwrap_err();
        assert_eq!(err.field(), "lease_ttl", "{ttl:?}");
        assert!(err.message().contains("at least 1 s"), "{err}");
    }
    let rule = ConcurrencyRule::new("second", 1, Duration::from_secs(1)).unwrap();
    assert!(store.concurrency_limiter(&rule).is_ok());
}
