//! Escalation ladders on Redis: the core's suite on standalone and
//! cluster, a ladder a fleet climbs together, and the failure policy.
#![allow(missing_docs, clippy::unwrap_used, clippy::arithmetic_side_effects)]

use std::time::Duration;

use tollgate_core::algorithm::Strike;
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
    assert_eq!(b.blocked(b"k").await.unwrap(), Some(5_000_000_000));
    clock.advance(d(5));
    assert_eq!(a.blocked(b"k").await.unwrap(), None);
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
    assert_eq!(open.blocked(b"k").await.unwrap(), None);
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
    assert!(fallback.blocked(b"k").await.unwrap().is_some());
}
