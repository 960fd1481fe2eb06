//! Redis dies mid-run: each failure policy answers as it promises, no call
//! waits past the timeout, and decisions return to Redis soon after it
//! comes back.
#![allow(missing_docs, clippy::unwrap_used, clippy::arithmetic_side_effects)]

use std::time::{Duration, Instant};

use tollgate_core::{Limit, Limiter, Rate, Rule, Store};
use tollgate_redis::testing::{unique_prefix, Server};
use tollgate_redis::{FailurePolicy, RedisStore};

const TIMEOUT: Duration = Duration::from_millis(50);
/// Scheduling slack on a loaded 2-core CI machine: a call may overrun the
/// store timeout by this much and still count as "within the timeout".
const SLACK: Duration = Duration::from_millis(250);

fn rule() -> Rule {
    Rule::new("faults", Limit::gcra(Rate::per_second(1), 3)).unwrap()
}

fn store(server: &Server, policy: FailurePolicy) -> RedisStore {
    RedisStore::builder(&server.url())
        .prefix(&unique_prefix())
        .timeout(TIMEOUT)
        .failure_policy(policy)
        .breaker(3, Duration::from_millis(200))
        .build()
        .unwrap()
}

/// Decides `n` times for `key`; returns how many were admitted and the
/// slowest call.
async fn burst(l: &impl Limiter, key: &[u8], n: usize) -> (usize, Duration) {
    let mut admitted = 0;
    let mut slowest = Duration::ZERO;
    for _ in 0..n {
        let start = Instant::now();
        let d = l
            .decide(key, 1)
            .await
            .expect("policies answer, never error");
        slowest = slowest.max(start.elapsed());
        admitted += usize::from(d.is_allowed());
    }
    (admitted, slowest)
}

/// Waits until `store` has had a successful Redis call again, driving it
/// with decisions; returns how long that took.
async fn recovery(store: &RedisStore, l: &impl Limiter) -> Duration {
    let start = Instant::now();
    let ok_before = store.stats().ok;
    while store.stats().ok == ok_before {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "never recovered: {:?}",
            store.stats()
        );
        l.decide(b"probe", 0).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    start.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_admits_fail_closed_denies_fallback_limits_locally() {
    let Some(mut server) = Server::start() else {
        return;
    };
    let open = store(&server, FailurePolicy::Open);
    let closed = store(&server, FailurePolicy::Closed);
    let fallback = store(&server, FailurePolicy::fallback());
    let (lo, lc, lf) = (
        open.limiter(&rule()).unwrap(),
        closed.limiter(&rule()).unwrap(),
        fallback.limiter(&rule()).unwrap(),
    );
    // With Redis up, all three enforce the shared limit of 3.
    for l in [&lo, &lc, &lf] {
        assert_eq!(burst(l, b"k", 5).await.0, 3);
    }

    server.kill();
    let (admitted, slowest) = burst(&lo, b"k", 20).await;
    assert_eq!(admitted, 20, "fail open admits everything");
    assert!(slowest < TIMEOUT + SLACK, "slowest call {slowest:?}");
    let (admitted, slowest) = burst(&lc, b"k", 20).await;
    assert_eq!(admitted, 0, "fail closed admits nothing");
    assert!(slowest < TIMEOUT + SLACK, "slowest call {slowest:?}");
    let (admitted, slowest) = burst(&lf, b"k", 20).await;
    assert_eq!(admitted, 3, "fallback enforces the limit in memory");
    assert!(slowest < TIMEOUT + SLACK, "slowest call {slowest:?}");
    assert!(
        open.breaker_open(),
        "the breaker stops calling a dead Redis"
    );
    assert!(open.stats().skipped > 0, "{:?}", open.stats());

    server.restart();
    for (s, l) in [(&open, &lo), (&closed, &lc), (&fallback, &lf)] {
        let took = recovery(s, l).await;
        assert!(
            took < Duration::from_secs(3),
            "back on Redis after {took:?}"
        );
    }
    // Back on Redis (fresh: the restarted server kept nothing).
    assert_eq!(burst(&lc, b"k2", 5).await.0, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_redis_costs_at_most_the_timeout() {
    let Some(server) = Server::start() else {
        return;
    };
    let open = store(&server, FailurePolicy::Open);
    let l = open.limiter(&rule()).unwrap();
    assert_eq!(burst(&l, b"h", 4).await.0, 3);
    server.pause(true);
    let (admitted, slowest) = burst(&l, b"h", 10).await;
    server.pause(false);
    assert_eq!(admitted, 10);
    assert!(slowest < TIMEOUT + SLACK, "slowest call {slowest:?}");
    assert!(open.stats().timeouts >= 1, "{:?}", open.stats());
    let took = recovery(&open, &l).await;
    assert!(
        took < Duration::from_secs(3),
        "back on Redis after {took:?}"
    );
    // The limit state survived the pause.
    assert_eq!(burst(&l, b"h", 1).await.0, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_built_while_redis_is_down_follows_its_policy() {
    let Some(mut server) = Server::start() else {
        return;
    };
    server.kill();
    let closed = store(&server, FailurePolicy::Closed);
    let l = closed.limiter(&rule()).unwrap();
    let (admitted, slowest) = burst(&l, b"d", 5).await;
    assert_eq!(admitted, 0);
    assert!(slowest < TIMEOUT + SLACK, "slowest call {slowest:?}");
    server.restart();
    recovery(&closed, &l).await;
    assert_eq!(burst(&l, b"d", 5).await.0, 3);
}
