//! Escalation ladders on Redis: the core's suite on standalone and
//! cluster, a ladder a fleet climbs together, and the failure policy.
#![allow(missing_docs, clippy::unwrap_used, clippy::arithmetic_side_effects)]

use std::time::Duration;

use tollgate_core::algorithm::{Standing, Strike};
use tollgate_core::testing;
use tollgate_core::{EscalationRule, ManualClock, Store};
use tollgate_memory::MemoryStore;
use tollgate_redis::testing::{unique_prefix, Cluster, Server};
use tollgate_redis::{FailurePolicy, RedisStore};

fn store(url: &str, prefix: &str, clock: ManualClock) -> RedisStore {
    RedisStore::builder(url)
        .prefix(prefix)
        .client_time(clock)
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_redis_passes_the_escalation_suite() {
    let Some(server) = Server::start() else {
        return;
    };
    let url = server.url();
    testing::run_escalation(|clock| store(&url, &unique_prefix(), clock)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_passes_the_escalation_suite() {
    let Some(cluster) = Cluster::start() else {
        return;
    };
    let url = cluster.url();
    testing::run_escalation(|clock| store(&url, &unique_prefix(), clock)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_climbs_one_ladder() {
    let Some(server) = Server::start() else {
        return;
    };
    let clock = ManualClock::starting_at(testing::UNIX_2026);
    let prefix = unique_prefix();
    let d = Duration::from_secs;
    let rule = EscalationRule::new("ladder", 3, d(60), d(10), d(40)).unwrap();
    let a = store(&server.url(), &prefix, clock.clone())
        .escalation(&rule)
        .unwrap();
    let b = store(&server.url(), &prefix, clock.clone())
        .escalation(&rule)
        .unwrap();
    // Strikes from two instances count toward one block...
    assert_eq!(
        a.strike(b"k").await.unwrap(),
        Strike::Counted { strikes: 1 }
    );
    assert_eq!(
        b.strike(b"k").await.unwrap(),
        Strike::Counted { strikes: 2 }
    );
    assert!(matches!(
        a.strike(b"k").await.unwrap(),
        Strike::Blocked { level: 1, .. }
    ));
    // ...and the block holds on both.
    clock.advance(d(5));
    assert_eq!(
        b.standing(b"k").await.unwrap(),
        Standing::Blocked {
            for_ns: 5_000_000_000
        }
    );
    clock.advance(d(5));
    assert_eq!(a.standing(b"k").await.unwrap(), Standing::Clear);

    // A slowing ladder: a step taken on one instance holds on the other,
    // and the climb back is the same on both.
    let rule = EscalationRule::slow_down("slows", 2, d(60), d(10), &[50, 25]).unwrap();
    let a = store(&server.url(), &prefix, clock.clone())
        .escalation(&rule)
        .unwrap();
    let b = store(&server.url(), &prefix, clock.clone())
        .escalation(&rule)
        .unwrap();
    a.strike(b"k").await.unwrap();
    assert_eq!(
        b.strike(b"k").await.unwrap(),
        Strike::Slowed {
            for_ns: 10_000_000_000,
            level: 1
        }
    );
    a.strike(b"k").await.unwrap();
    b.strike(b"k").await.unwrap();
    clock.advance(d(12));
    assert_eq!(
        a.standing(b"k").await.unwrap(),
        Standing::Slowed {
            level: 1,
            for_ns: 8_000_000_000
        }
    );
    clock.advance(d(8));
    assert_eq!(b.standing(b"k").await.unwrap(), Standing::Clear);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_redis_a_ladder_falls_back_or_reports_the_fault() {
    let Some(server) = Server::start() else {
        return;
    };
    let url = server.url();
    let d = Duration::from_secs;
    let rule = EscalationRule::new("ladder", 1, d(60), d(10), d(40)).unwrap();
    let open = RedisStore::builder(&url)
        .prefix(&unique_prefix())
        .timeout(Duration::from_millis(200))
        .build()
        .unwrap()
        .escalation(&rule)
        .unwrap();
    let fallback = RedisStore::builder(&url)
        .prefix(&unique_prefix())
        .timeout(Duration::from_millis(200))
        .failure_policy(FailurePolicy::Fallback(MemoryStore::new()))
        .build()
        .unwrap()
        .escalation(&rule)
        .unwrap();
    assert_eq!(open.standing(b"k").await.unwrap(), Standing::Clear);
    drop(server);
    assert!(
        open.strike(b"k").await.is_err(),
        "the fault goes to the caller"
    );
    // The fallback's own ladder answers: one strike blocks.
    assert!(matches!(
        fallback.strike(b"k").await.unwrap(),
        Strike::Blocked { .. }
    ));
    assert!(matches!(
        fallback.standing(b"k").await.unwrap(),
        Standing::Blocked { .. }
    ));
}
