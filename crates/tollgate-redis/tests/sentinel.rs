//! Redis Sentinel: the store finds the master through the sentinels and
//! follows a failover to the promoted replica, with no error reaching a
//! caller and the replicated state going on.
#![allow(missing_docs, clippy::unwrap_used, clippy::arithmetic_side_effects)]

use std::time::{Duration, Instant};

use tollgate_core::{Limit, Limiter, Rate, Rule, Store};
use tollgate_redis::testing::{unique_prefix, Sentinels};
use tollgate_redis::{FailurePolicy, RedisStore};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_follows_a_master_switch() {
    let Some(set) = tokio::task::spawn_blocking(Sentinels::start).await.unwrap() else {
        return;
    };
    let store = RedisStore::builder(&set.url())
        .prefix(&unique_prefix())
        .timeout(Duration::from_millis(500))
        .connect_timeout(Duration::from_secs(2))
        .failure_policy(FailurePolicy::fallback())
        .build()
        .unwrap();
    let rule = Rule::new("per-key", Limit::gcra(Rate::per_minute(1), 10)).unwrap();
    let l = store.limiter(&rule).unwrap();
    // Through the sentinel to the master: 3 of 10 spent there.
    for left in [9, 8, 7] {
        assert_eq!(l.decide(b"k", 1).await.unwrap().remaining, left);
    }
    assert!(set.master.script_calls() >= 3);
    let before = set.replica.script_calls();
    let set = tokio::task::spawn_blocking(move || {
        set.failover();
        set
    })
    .await
    .unwrap();
    // Every call answers (Redis's, or the fallback's while it switches);
    // soon the store runs its scripts on the promoted replica, where the
    // replicated state goes on.
    let deadline = Instant::now() + Duration::from_secs(20);
    for i in 0.. {
        let d = l.decide(format!("other-{i}").as_bytes(), 1).await.unwrap();
        assert!(d.is_allowed());
        if set.replica.script_calls() > before {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the store never reached the new master"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let d = l.decide(b"k", 1).await.unwrap();
    assert_eq!(d.remaining, 6, "the replicated state went on");
}
