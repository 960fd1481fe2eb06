//! Redis dies mid-run: each failure policy answers as it promises, no call
//! waits past the timeout, and decisions return to Redis soon after it
//! comes back.
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects
)]

use std::time::{Duration, Instant};

use tollgate_core::calendar::{Offset, Period};
use tollgate_core::{
    ConcurrencyLimiter, ConcurrencyRule, JointPart, Limit, Limiter, Outcome, QuotaLimiter,
    QuotaRule, QuotaStore, Rate, Rule, Store,
};
use tollgate_memory::MemoryStore;
use tollgate_redis::testing::{unique_prefix, Server};
use tollgate_redis::{FailurePolicy, RedisLimiter, RedisStore};

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
    // Rules decided together follow the same policies, and say what they
    // consumed (what a denial elsewhere refunds): fail open and fail
    // closed nothing, the fallback its memory's units.
    let joint = |limiter: &RedisLimiter| {
        let parts = [b"j1", b"j2"].map(|key| JointPart {
            limiter,
            key,
            cost: 1,
            enforced: true,
        });
        RedisLimiter::decide_joint(&parts).unwrap()
    };
    for (limiter, allowed, consumed) in [(&lo, true, false), (&lc, false, false), (&lf, true, true)]
    {
        for answer in joint(limiter).await {
            assert_eq!(answer.decision.unwrap().is_allowed(), allowed);
            assert_eq!(answer.consumed, consumed);
        }
    }
    // When one rule denies, what the fallback's memory charged for the
    // others goes back to that memory (a refund sent to Redis later would
    // credit a store that never saw the charge).
    let parts = [&b"fresh"[..], &b"k"[..]].map(|key| JointPart {
        limiter: &lf,
        key,
        cost: 1,
        enforced: true,
    });
    let answers = RedisLimiter::decide_joint(&parts).unwrap().await;
    assert!(answers[0].decision.as_ref().unwrap().is_allowed());
    assert!(
        !answers[1].decision.as_ref().unwrap().is_allowed(),
        "k is spent"
    );
    assert!(answers.iter().all(|a| !a.consumed), "{answers:?}");
    let left = lf.decide(b"fresh", 0).await.unwrap().remaining;
    assert_eq!(left, 3, "refunded in memory");

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

/// A fleet of four on `fallback_share(4)` admits about the limit during
/// an outage, where `fallback()` gives each of them the whole of it: the
/// rate's burst, the in-flight maximum and the quota, each divided.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_s_fallback_share_admits_about_the_limit_not_n_times_it() {
    let Some(mut server) = Server::start() else {
        return;
    };
    server.kill();
    let rate = Rule::new("share", Limit::gcra(Rate::per_minute(40), 40)).unwrap();
    let conc = ConcurrencyRule::new("share-c", 8, Duration::from_secs(30)).unwrap();
    let quota = QuotaRule::new("share-q", &[(Period::Day, 100)], Offset::UTC).unwrap();
    // Four instances, each with a store (and memory) of its own.
    let fleet = |policy: fn() -> FailurePolicy| -> Vec<RedisStore> {
        (0..4).map(|_| store(&server, policy())).collect()
    };
    for (policy, per_instance) in [
        (
            FailurePolicy::fallback as fn() -> FailurePolicy,
            [40, 8, 100],
        ),
        (|| FailurePolicy::fallback_share(4), [10, 2, 25]),
    ] {
        let mut totals = [0; 3];
        for instance in fleet(policy) {
            let l = instance.limiter(&rate).unwrap();
            totals[0] += burst(&l, b"k", 60).await.0;
            let c = instance.concurrency_limiter(&conc).unwrap();
            let mut held = Vec::new();
            for _ in 0..12 {
                let got = c.acquire(b"k", 1, u32::MAX).await.unwrap();
                if let Some(lease) = got.lease {
                    held.push(lease);
                }
            }
            totals[1] += held.len();
            let q = instance.quota_limiter(&quota).unwrap();
            for _ in 0..150 {
                totals[2] += usize::from(q.consume(b"k", 1).await.unwrap().is_allowed());
            }
        }
        assert_eq!(totals, per_instance.map(|n| n * 4), "{per_instance:?} each");
    }
    let err = RedisStore::builder(&server.url())
        .prefix(&unique_prefix())
        .failure_policy(FailurePolicy::fallback_share(0))
        .build()
        .unwrap_err();
    assert_eq!(err.field(), "instances");
}

fn concurrency_rule() -> ConcurrencyRule {
    ConcurrencyRule::new("faults-c", 2, Duration::from_secs(30))
        .unwrap()
        .with_retry_after(Duration::from_millis(250))
        .unwrap()
}

/// Runs `call` and checks it answered within the timeout (plus slack).
async fn timed<T>(what: &str, call: impl std::future::Future<Output = T>) -> T {
    let start = Instant::now();
    let out = call.await;
    let took = start.elapsed();
    assert!(took < TIMEOUT + SLACK, "{what} took {took:?}");
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_follows_the_failure_policy_when_redis_dies() {
    let Some(mut server) = Server::start() else {
        return;
    };
    let all = u32::MAX;
    let memory = MemoryStore::new();
    let open = store(&server, FailurePolicy::Open);
    let closed = store(&server, FailurePolicy::Closed);
    let fallback = store(&server, FailurePolicy::Fallback(memory.clone()));
    let rule = concurrency_rule();
    let (co, cc, cf) = (
        open.concurrency_limiter(&rule).unwrap(),
        closed.concurrency_limiter(&rule).unwrap(),
        fallback.concurrency_limiter(&rule).unwrap(),
    );
    // With Redis up, all three hold the shared limit of 2.
    let mut redis_leases = Vec::new();
    for l in [&co, &cc, &cf] {
        redis_leases.push(l.acquire(b"k", 2, all).await.unwrap().lease.unwrap());
        assert!(l.acquire(b"k", 1, all).await.unwrap().lease.is_none());
    }

    server.kill();
    // Open: as if the key held nothing, under a lease nobody needs.
    let got = timed("open acquire", co.acquire(b"k", 2, all))
        .await
        .unwrap();
    let lease = got.lease.expect("fail open admits");
    assert_eq!(got.decision.remaining, 0);
    timed("open release", co.release(b"k", lease))
        .await
        .unwrap();
    let never = timed("open acquire", co.acquire(b"k", 3, all))
        .await
        .unwrap();
    assert_eq!(
        (never.decision.outcome, never.lease),
        (Outcome::Never, None)
    );
    assert!(timed("open held", co.held(b"k")).await.is_err());
    // Closed: as if the key were full, with the rule's retry hint.
    let got = timed("closed acquire", cc.acquire(b"k", 1, all))
        .await
        .unwrap();
    assert_eq!(
        (got.decision.outcome, got.lease),
        (
            Outcome::Deny {
                retry_after: 250_000_000
            },
            None
        )
    );
    assert!(timed("closed peek", cc.acquire(b"k", 0, all))
        .await
        .unwrap()
        .decision
        .is_allowed());
    assert!(timed("closed held", cc.held(b"k")).await.is_err());
    // Fallback: the limit, in this process's memory.
    let a = timed("fallback acquire", cf.acquire(b"k", 1, all))
        .await
        .unwrap();
    let b = timed("fallback acquire", cf.acquire(b"k", 1, all))
        .await
        .unwrap();
    let (a, b) = (a.lease.expect("in memory"), b.lease.expect("in memory"));
    let c = timed("fallback acquire", cf.acquire(b"k", 1, all))
        .await
        .unwrap();
    assert_eq!(
        c.decision.outcome,
        Outcome::Deny {
            retry_after: 250_000_000
        }
    );
    assert_eq!(timed("fallback held", cf.held(b"k")).await.unwrap(), 2);
    timed("fallback release", cf.release(b"k", a))
        .await
        .unwrap();
    assert_eq!(timed("fallback held", cf.held(b"k")).await.unwrap(), 1);
    // A Redis lease cannot be released now: it fails, fast, and will lapse.
    let redis_lease = redis_leases.pop().unwrap();
    assert!(
        timed("release on a dead Redis", cf.release(b"k", redis_lease))
            .await
            .is_err()
    );
    timed("flush", fallback.flush()).await;

    server.restart();
    let start = Instant::now();
    let ok_before = fallback.stats().ok;
    while fallback.stats().ok == ok_before {
        assert!(start.elapsed() < Duration::from_secs(10), "never recovered");
        cf.acquire(b"probe", 0, all).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Back on Redis (fresh: the restarted server kept nothing); the lease
    // granted in memory is released in memory.
    assert_eq!(cf.held(b"k").await.unwrap(), 0);
    let local = memory.concurrency_limiter(&rule).unwrap();
    assert_eq!(local.held_now(b"k"), 1);
    cf.release(b"k", b).await.unwrap();
    assert_eq!(local.held_now(b"k"), 0);
    let again = cf
        .acquire(b"k", 2, all)
        .await
        .unwrap()
        .lease
        .expect("on Redis");
    assert_eq!(cf.held(b"k").await.unwrap(), 2);
    cf.release(b"k", again).await.unwrap();
    assert_eq!(cf.held(b"k").await.unwrap(), 0);
}

/// Quotas when Redis dies: a consume (or a read) gets the policy's answer
/// within the timeout — Open admits and reports whole budgets, Closed
/// denies for a second, Fallback counts in memory — with the periods'
/// real lengths; a reset or a grant that did not happen is an error, and
/// a refund too unless there is memory to refund to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quotas_follow_the_failure_policy_when_redis_dies() {
    let Some(mut server) = Server::start() else {
        return;
    };
    let memory = MemoryStore::new();
    let open = store(&server, FailurePolicy::Open);
    let closed = store(&server, FailurePolicy::Closed);
    let fallback = store(&server, FailurePolicy::Fallback(memory.clone()));
    let rule = QuotaRule::new(
        "faults-q",
        &[(Period::Hour, 3), (Period::Week, 10)],
        Offset::UTC,
    )
    .unwrap();
    let (qo, qc, qf) = (
        open.quota_limiter(&rule).unwrap(),
        closed.quota_limiter(&rule).unwrap(),
        fallback.quota_limiter(&rule).unwrap(),
    );
    for q in [&qo, &qc, &qf] {
        assert!(q.consume(b"k", 1).await.unwrap().is_allowed());
    }
    assert_eq!(qo.consume(b"k", 0).await.unwrap().periods()[0].remaining, 2);

    server.kill();
    let week = 7 * 86_400 * 1_000_000_000;
    let d = timed("open consume", qo.consume(b"k", 2)).await.unwrap();
    assert!(d.is_allowed());
    for (p, limit) in d.periods().iter().zip([3, 10]) {
        assert_eq!((p.limit, p.remaining), (limit, limit), "{}", p.period);
    }
    assert_eq!(d.periods()[1].length, week);
    assert!(d.periods()[1].reset_after <= week && d.periods()[1].reset_after > 0);
    let d = timed("closed consume", qc.consume(b"k", 1)).await.unwrap();
    assert_eq!(
        d.outcome,
        Outcome::Deny {
            retry_after: 1_000_000_000
        }
    );
    assert_eq!(d.periods()[0].remaining, 0);
    assert_eq!(d.periods()[1].length, week);
    // Its t says what its Retry-After says: a second.
    assert_eq!(d.periods()[0].reset_after, 1_000_000_000);
    // Fallback: the quota, in this process's memory.
    let mut admitted = 0;
    for _ in 0..5 {
        let d = timed("fallback consume", qf.consume(b"k", 1))
            .await
            .unwrap();
        admitted += usize::from(d.is_allowed());
    }
    assert_eq!(admitted, 3);
    // A refund is not made in memory, which may not have seen the charge.
    assert!(timed("fallback refund", qf.refund(b"k", 1)).await.is_err());
    let d = timed("fallback read", qf.consume(b"k", 0)).await.unwrap();
    assert_eq!(d.periods()[0].remaining, 0);
    // What did not reach Redis says so.
    assert!(timed("open refund", qo.refund(b"k", 1)).await.is_err());
    assert!(timed("open reset", qo.reset(b"k")).await.is_err());
    assert!(timed("closed grant", qc.grant(b"k", 5)).await.is_err());
    assert!(timed("fallback grant", qf.grant(b"k", 5)).await.is_err());

    server.restart();
    let start = Instant::now();
    let ok_before = open.stats().ok;
    while open.stats().ok == ok_before {
        assert!(start.elapsed() < Duration::from_secs(10), "never recovered");
        qo.consume(b"probe", 0).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Back on Redis (fresh: the restarted server kept nothing).
    let d = qo.consume(b"k", 3).await.unwrap();
    assert!(d.is_allowed());
    assert!(!qo.consume(b"k", 1).await.unwrap().is_allowed());
    assert_eq!(qo.reset(b"k").await.unwrap().periods()[0].remaining, 3);
}

/// A 3-master Cluster, a store on it that fails closed (calls of 300 ms at
/// most), and rule `name` (1,000 an hour, a fixed window) bound to it;
/// `None` without redis-server.
async fn closed_cluster(
    name: &str,
) -> Option<(tollgate_redis::testing::Cluster, RedisStore, RedisLimiter)> {
    closed_cluster_from(tollgate_redis::testing::Cluster::start, name).await
}

/// [`closed_cluster`] on the Cluster `start` makes (one with replicas).
async fn closed_cluster_from(
    start: fn() -> Option<tollgate_redis::testing::Cluster>,
    name: &str,
) -> Option<(tollgate_redis::testing::Cluster, RedisStore, RedisLimiter)> {
    let cluster = tokio::task::spawn_blocking(start).await.unwrap()?;
    let store = RedisStore::builder(&cluster.url())
        .prefix(&unique_prefix())
        .timeout(Duration::from_millis(300))
        .failure_policy(FailurePolicy::Closed)
        .build()
        .unwrap();
    let rule = Rule::new(name, Limit::fixed_window(1_000, Duration::from_secs(3_600))).unwrap();
    let l = store.limiter(&rule).unwrap();
    Some((cluster, store, l))
}

/// Fleet review H1: one Cluster master stopped (SIGSTOP) opens the breakers
/// of its own slot ranges only. Keys on the other masters go on deciding
/// on Redis (each decision is Redis's count, never the failure policy's),
/// while the stopped master's keys get the policy's answer (`Closed`: a
/// denial). With one breaker for the whole store, the stopped master's
/// timeouts opened it for every key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_stopped_master_takes_out_only_its_own_keys() {
    let Some((cluster, store, l)) = closed_cluster("shards").await else {
        return;
    };
    // Keys by master: one on master 0 (to be stopped), three elsewhere.
    let (mut stopped, mut healthy) = (None, Vec::new());
    for i in 0..200 {
        if stopped.is_some() && healthy.len() >= 3 {
            break;
        }
        let key = format!("shard-key-{i}");
        let on = cluster
            .master_holding(|| async {
                assert!(l.decide(key.as_bytes(), 1).await.unwrap().is_allowed());
            })
            .await
            .unwrap();
        if on == 0 && stopped.is_none() {
            stopped = Some(key);
        } else if on != 0 && healthy.len() < 3 {
            healthy.push(key);
        }
    }
    let stopped = stopped.expect("no key on master 0");
    assert_eq!(healthy.len(), 3, "not enough keys on masters 1 and 2");
    let connects = store.stats().connects;
    cluster.nodes[0].pause(true);
    // Rounds: four decisions on the stopped master's key at once (they
    // time out together, back to back: its range's breaker opens), then
    // the healthy keys, which must each be Redis's own count: allowed, one
    // less left each time.
    let mut used = vec![1u64; healthy.len()];
    for round in 0..8 {
        let lost = (0..4).map(|_| l.decide(stopped.as_bytes(), 1)).collect();
        for d in tollgate_core::join_all(lost).await {
            let d = d.unwrap();
            assert!(
                matches!(d.outcome, Outcome::Deny { .. }),
                "round {round}: the stopped master's key got {d:?}, want the Closed denial"
            );
        }
        let fine = healthy.iter().map(|k| l.decide(k.as_bytes(), 1)).collect();
        for (i, d) in tollgate_core::join_all(fine).await.into_iter().enumerate() {
            let d = d.unwrap();
            used[i] += 1;
            assert!(
                d.is_allowed() && d.remaining == 1_000 - used[i],
                "round {round}: healthy key {i} got {d:?}, want Redis's count ({} left)",
                1_000 - used[i]
            );
        }
    }
    // The stopped master's ranges are open; most are not.
    assert!(store.breaker_open());
    // Fleet review M6: its stall never replaced the whole Cluster
    // connection (seeds, slot map, every node), which a fleet that saw
    // the same stall did in step. (A replacement would have started by
    // now: at most 1.25 s after the last connect, plus 250 ms of jitter.)
    tokio::time::sleep(Duration::from_millis(1_600)).await;
    assert_eq!(
        store.stats().connects,
        connects,
        "one master's stall replaced the Cluster connection"
    );
    cluster.nodes[0].pause(false);
}

/// Fleet review M4: a plain `redis://` store behind a DNS name or a
/// virtual IP. The master is demoted (its writes answer `READONLY`) and
/// the address moves to the new master: the store replaces its
/// connection and decides on the new master within a few seconds, where
/// it used to keep the demoted server's connection (and the failure
/// policy's answers) for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standalone_store_follows_its_address_to_a_new_master() {
    use tollgate_redis::testing::Delayed;
    let Some(old) = Server::start() else { return };
    let Some(new) = Server::start() else { return };
    let vip = Delayed::start(old.port, Duration::ZERO).await;
    let store = RedisStore::builder(&vip.url())
        .prefix(&unique_prefix())
        .timeout(Duration::from_millis(300))
        .failure_policy(FailurePolicy::Closed)
        .build()
        .unwrap();
    let rule = Rule::new("vip", Limit::fixed_window(100, Duration::from_secs(3_600))).unwrap();
    let l = store.limiter(&rule).unwrap();
    let d = l.decide(b"k", 1).await.unwrap();
    assert!(d.is_allowed() && d.remaining == 99, "{d:?}");
    // Failover: the old master follows the new one (its writes now answer
    // READONLY), and the address leads to the new master.
    old.cli(&["REPLICAOF", "127.0.0.1", &new.port.to_string()]);
    vip.retarget(new.port);
    let start = Instant::now();
    let mut answer = None;
    while start.elapsed() < Duration::from_secs(5) {
        let d = l.decide(b"k", 1).await.unwrap();
        if d.is_allowed() {
            answer = Some(d);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let d = answer.expect("still on the demoted master after 5 s");
    // The new master's count: it never saw the old one's (a replica
    // that follows it, not the reverse).
    assert_eq!(d.remaining, 99, "{d:?}");
}

/// Fleet review H1, finer: breakers follow the slot map, not fixed ranges
/// of slots. Keys on either side of the first master's last slot (5,460)
/// fell in one fixed range of 256 slots, so a stopped first master took
/// out some of the second master's keys too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_master_takes_out_none_of_its_neighbour_s_slots() {
    use tollgate_redis::testing::hash_slot;
    let Some((cluster, store, l)) = closed_cluster("neighbours").await else {
        return;
    };
    // A client key whose Redis key's slot is in `slots`.
    let key_in = |slots: std::ops::RangeInclusive<u16>| {
        (0..1_000_000)
            .map(|i| format!("n{i}"))
            .find(|k| {
                slots.contains(&hash_slot(&store.key_name(
                    "fw1",
                    "neighbours",
                    k.as_bytes(),
                )))
            })
            .unwrap()
    };
    let (lost, near) = (key_in(5_376..=5_460), key_in(5_461..=5_631));
    for (key, master) in [(&lost, 0), (&near, 1)] {
        let on = cluster
            .master_holding(|| async {
                assert!(l.decide(key.as_bytes(), 1).await.unwrap().is_allowed());
            })
            .await;
        assert_eq!(
            on,
            Some(master),
            "slots 0-5460 on node 0, 5461-10922 on node 1"
        );
    }
    cluster.nodes[0].pause(true);
    for round in 0..6u64 {
        let lost_calls = (0..4).map(|_| l.decide(lost.as_bytes(), 1)).collect();
        for d in tollgate_core::join_all(lost_calls).await {
            assert!(
                matches!(d.unwrap().outcome, Outcome::Deny { .. }),
                "round {round}"
            );
        }
        let d = l.decide(near.as_bytes(), 1).await.unwrap();
        assert!(
            d.is_allowed() && d.remaining == 1_000 - 2 - round,
            "round {round}: the neighbour's key got {d:?}"
        );
    }
    cluster.nodes[0].pause(false);
}

/// Fleet review L1: a store built in one runtime (a set-up runtime, a
/// test's) and used from another after the first is gone reconnected on
/// the dead runtime: never, silently, and every call got the failure
/// policy. Connects run on the caller's runtime.
#[test]
fn a_store_outlives_the_runtime_it_was_built_on() {
    let Some(server) = Server::start() else {
        return;
    };
    let setup = tokio::runtime::Runtime::new().unwrap();
    let store = setup.block_on(async {
        RedisStore::builder(&server.url())
            .prefix(&unique_prefix())
            .failure_policy(FailurePolicy::Closed)
            .timeout(Duration::from_secs(1))
            .build()
            .unwrap()
    });
    let l = store.limiter(&rule()).unwrap();
    let c = store
        .concurrency_limiter(
            &tollgate_core::ConcurrencyRule::new("c", 1, Duration::from_secs(30)).unwrap(),
        )
        .unwrap();
    drop(setup);
    let serving = tokio::runtime::Runtime::new().unwrap();
    serving.block_on(async {
        let start = Instant::now();
        loop {
            let d = l.decide(b"k", 1).await.unwrap();
            // Redis's answer: allowed, 2 of 3 left (Closed would deny).
            if d.is_allowed() {
                assert_eq!(d.remaining, 2);
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "still on the failure policy: {d:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // The lease task ran on the runtime that ended (documented on
        // `build`): a lease is granted, and its release says it cannot
        // be done (logged once), rather than pretending it was.
        use tollgate_core::ConcurrencyLimiter as _;
        let lease = c.acquire(b"k", 1, u32::MAX).await.unwrap().lease.unwrap();
        let err = c.release(b"k", lease).await.unwrap_err();
        assert!(err.to_string().contains("lease task has stopped"), "{err}");
    });
}

/// A `HotKeys` lease the failure policy granted (fail-open: nothing was
/// charged anywhere) is never given back to Redis once it is back: Redis
/// would credit units it never counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_the_failure_policy_granted_is_never_given_back_to_redis() {
    let Some(server) = Server::start() else {
        return;
    };
    let store = store(&server, FailurePolicy::Open);
    // One a minute: what Redis has left moves only by what is charged.
    let rule = Rule::new("given", Limit::gcra(Rate::per_minute(1), 100)).unwrap();
    let plain = store.limiter(&rule).unwrap();
    let hot = hot_eight(&store, &rule);
    server.pause(true);
    // Leases of 1, 2, 4 and 8 from fail-open; the last holds 7.
    for _ in 0..8 {
        assert!(hot.decide(b"k", 1).await.unwrap().is_allowed());
    }
    server.pause(false);
    recovery(&store, &plain).await;
    assert_eq!(plain.decide(b"k", 50).await.unwrap().remaining, 50);
    // A cost the lease cannot cover takes a lease of 10 on Redis; the 7
    // fail-open granted are not Redis's to take back.
    assert!(hot.decide(b"k", 10).await.unwrap().is_allowed());
    assert_eq!(plain.decide(b"k", 0).await.unwrap().remaining, 40);
}

/// A `HotKeys` decision that gives units back, takes a lease and would ask
/// for what is left costs a hung Redis no more than two calls side by side
/// (the give-back on its own task, the lease), not three in a row: the
/// failure policy's denial asks for nothing more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_decision_on_a_hung_redis_makes_no_call_after_the_policy_answered() {
    let Some(server) = Server::start() else {
        return;
    };
    let store = RedisStore::builder(&server.url())
        .prefix(&unique_prefix())
        .timeout(TIMEOUT)
        .failure_policy(FailurePolicy::Closed)
        // The breaker stays shut: every call reaches the hung server.
        .breaker(100, Duration::from_millis(200))
        .build()
        .unwrap();
    let rule = Rule::new("hung", Limit::gcra(Rate::per_minute(1), 100)).unwrap();
    let hot = hot_eight(&store, &rule);
    // Leases of 1, 2, 4 and 8 from Redis; the last holds 2 after 13.
    for _ in 0..13 {
        assert!(hot.decide(b"k", 1).await.unwrap().is_allowed());
    }
    server.pause(true);
    let before = store.stats();
    let start = Instant::now();
    // More than the lease holds: give the 2 back, lease 8; fail-closed
    // denies it, and there is no asking for the 3 alone after that.
    let d = hot.decide(b"k", 3).await.unwrap();
    let took = start.elapsed();
    assert!(!d.is_allowed());
    // The closed policy's refusal is cached: the next decision makes no
    // store call.
    let calls = hot.stats().store_calls;
    assert!(!hot.decide(b"k", 3).await.unwrap().is_allowed());
    assert_eq!(hot.stats().store_calls, calls, "a cached refusal");
    // The give-back runs on its own: wait for it (a loaded machine may
    // run it late), then count.
    let deadline = Instant::now() + Duration::from_secs(5);
    while store.stats().timeouts - before.timeouts < 2 && Instant::now() < deadline {
        tokio::time::sleep(TIMEOUT).await;
    }
    tokio::time::sleep(TIMEOUT * 2).await;
    let after = store.stats();
    server.pause(false);
    assert_eq!(after.timeouts - before.timeouts, 2, "{after:?}");
    assert!(took < TIMEOUT + SLACK, "{took:?}");
}

/// A Cluster master that lost its scripts (restarted, or promoted) gets
/// them back while another node hangs: `EVAL` on the key's master, not a
/// `SCRIPT LOAD` that every connected node must answer (fleet review L4).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_that_lost_its_scripts_gets_them_back_while_another_hangs() {
    let Some(cluster) = tokio::task::spawn_blocking(tollgate_redis::testing::Cluster::start)
        .await
        .unwrap()
    else {
        return;
    };
    let store = RedisStore::builder(&cluster.url())
        .prefix(&unique_prefix())
        .timeout(Duration::from_millis(500))
        .failure_policy(FailurePolicy::Closed)
        .build()
        .unwrap();
    let rule = Rule::new("noscript", Limit::gcra(Rate::per_minute(1), 100)).unwrap();
    let l = store.limiter(&rule).unwrap();
    let master = cluster
        .master_holding(|| async {
            assert_eq!(l.decide(b"k", 1).await.unwrap().remaining, 99);
        })
        .await
        .unwrap();
    // Every master has a connection (the first decision read the slot
    // map and connected): one of the others hangs.
    for key in [&b"a"[..], b"b", b"c", b"d", b"e", b"f"] {
        l.decide(key, 0).await.unwrap();
    }
    let other = (master + 1) % 3;
    cluster.nodes[other].pause(true);
    cluster.nodes[master].cli(&["SCRIPT", "FLUSH"]);
    // Redis's own count, not fail-closed's denial.
    let d = l.decide(b"k", 1).await.unwrap();
    assert!(d.is_allowed(), "{d:?}");
    assert_eq!(d.remaining, 98);
    // And the script is cached there again.
    let info = cluster.nodes[master].cli(&["INFO", "memory"]);
    cluster.nodes[other].pause(false);
    assert!(info.contains("number_of_cached_scripts:1"), "{info}");
}

/// A hot key's lease larger than a fleet share's whole capacity: the
/// fallback memory answers the batch "never", which says nothing of a
/// cost of 1. The decision asks again for its own cost, and the key's
/// next decisions go through the store one by one (each answered by the
/// share at its own cost) until Redis answers again: the key is not
/// refused for the whole outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_key_s_batch_larger_than_the_fallback_share_refuses_nobody() {
    let Some(mut server) = Server::start() else {
        return;
    };
    let store = store(&server, FailurePolicy::fallback_share(20));
    // Leases of up to 100 (a tenth of 1,000); the share holds 50.
    let rule = Rule::new("share-hot", Limit::gcra(Rate::per_second(1_000), 1_000)).unwrap();
    let hot = tollgate_redis::HotKeys::new()
        .ttl(Duration::from_secs(10))
        .over(store.clone())
        .unwrap()
        .limiter(&rule)
        .unwrap();
    // Leases of 1, 2, ..., 64, all spent: the next one asks for 64.
    for _ in 0..127 {
        assert!(hot.decide(b"k", 1).await.unwrap().is_allowed());
    }
    server.kill();
    let mut admitted = 0;
    for _ in 0..60 {
        admitted += usize::from(hot.decide(b"k", 1).await.unwrap().is_allowed());
    }
    // The share's 50 (its burst; its rate, 50 a second, adds a few).
    assert!((50..=55).contains(&admitted), "{admitted} of 60 admitted");
}

/// A fleet share keeps the critical reserve: non-critical traffic held to
/// half of 8 (a ceiling of 4) is held to half of the share's 2 during an
/// outage, so a critical request still finds its permit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_share_keeps_the_critical_reserve() {
    let Some(mut server) = Server::start() else {
        return;
    };
    server.kill();
    let store = store(&server, FailurePolicy::fallback_share(4));
    let rule = ConcurrencyRule::new("reserve", 8, Duration::from_secs(30)).unwrap();
    let c = store.concurrency_limiter(&rule).unwrap();
    let non_critical = 4;
    assert!(c
        .acquire(b"k", 1, non_critical)
        .await
        .unwrap()
        .lease
        .is_some());
    assert!(
        c.acquire(b"k", 1, non_critical)
            .await
            .unwrap()
            .lease
            .is_none(),
        "non-critical traffic takes the whole share"
    );
    assert!(
        c.acquire(b"k", 1, u32::MAX).await.unwrap().lease.is_some(),
        "no reserve left for a critical request"
    );
}

/// `rule` on `store` through `HotKeys`: leases of ten seconds, at most 8
/// units.
fn hot_eight(
    store: &RedisStore,
    rule: &Rule,
) -> tollgate_redis::HotLimiter<tollgate_redis::RedisLimiter> {
    tollgate_redis::HotKeys::new()
        .ttl(Duration::from_secs(10))
        .max_batch(8)
        .over(store.clone())
        .unwrap()
        .limiter(rule)
        .unwrap()
}

/// Fleet review M6, the other half: a Cluster store no longer replaces its
/// connection for a hung master, so it must still find that master's
/// replica once the Cluster promotes it. Hung calls ask a node for the
/// slot map; when a slot's master changed, the connection is replaced,
/// and the stopped master's keys decide on the promoted replica — with
/// the master still stopped (not gone: no refused connection says so).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_master_s_keys_move_to_its_promoted_replica() {
    let start = tollgate_redis::testing::Cluster::start_with_replicas;
    let Some((cluster, _store, l)) = closed_cluster_from(start, "promoted").await else {
        return;
    };
    let key = key_on_master_0(&cluster, &l, "promoted-key").await;
    let replica = cluster.replica_of(0).expect("master 0 has no replica");
    cluster.nodes[0].pause(true);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let d = l.decide(key.as_bytes(), 1).await.unwrap();
        if d.is_allowed() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the stopped master's key never reached its promoted replica"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(cluster.nodes[replica].cli(&["ROLE"]).starts_with("master"));
    cluster.nodes[0].pause(false);
}

/// Review of the M6 fix: a master whose calls keep hanging while the slot
/// map stays the same is a connection gone bad (half open, dropped by a
/// firewall or a load balancer's idle timeout) rather than a brief stall:
/// three topology checks in a row within 10 s that find no change replace
/// the connection (which a brief stall never reaches).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_hung_for_long_has_the_connection_replaced() {
    let Some((cluster, store, l)) = closed_cluster("long-hang").await else {
        return;
    };
    let stopped = key_on_master_0(&cluster, &l, "long-hang").await;
    let connects = store.stats().connects;
    cluster.nodes[0].pause(true);
    let deadline = Instant::now() + Duration::from_secs(30);
    while store.stats().connects == connects {
        assert!(
            Instant::now() < deadline,
            "a master hung for 30 s never had the connection replaced"
        );
        let _ = l.decide(stopped.as_bytes(), 1).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    cluster.nodes[0].pause(false);
}

/// A key `{name}-{i}` whose state lives on the Cluster's master 0 (each
/// one tried is decided once, allowed).
async fn key_on_master_0(
    cluster: &tollgate_redis::testing::Cluster,
    l: &RedisLimiter,
    name: &str,
) -> String {
    let mut found = None;
    for i in 0..200 {
        let key = format!("{name}-{i}");
        let on = cluster
            .master_holding(|| async {
                assert!(l.decide(key.as_bytes(), 1).await.unwrap().is_allowed());
            })
            .await;
        if on == Some(0) {
            found = Some(key);
            break;
        }
    }
    found.expect("no key on master 0")
}
