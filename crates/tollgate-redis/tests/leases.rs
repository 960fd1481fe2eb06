//! Leases on real time: the store's lease task renews what live holders
//! hold, a dead instance's leases lapse, releases whose futures were
//! dropped still happen, and renewals reach every slot of a cluster.
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects
)]

use std::time::{Duration, Instant};

use tollgate_core::testing::{Lcg, START};
use tollgate_core::{ConcurrencyLimiter, ConcurrencyRule, ManualClock, Store};
use tollgate_redis::testing::{unique_prefix, Cluster, Server};
use tollgate_redis::RedisStore;

const ALL: u32 = u32::MAX;
/// The shortest the store takes: quick tests, and a loaded 2-core
/// machine renews in time (every 333 ms).
const TTL: Duration = Duration::from_secs(1);

fn store(url: &str, prefix: &str) -> RedisStore {
    RedisStore::builder(url)
        .prefix(prefix)
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap()
}

fn rule(ttl: Duration) -> ConcurrencyRule {
    ConcurrencyRule::new("leases", 2, ttl).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_keep_a_long_request_alive() {
    let Some(server) = Server::start() else {
        return;
    };
    let prefix = unique_prefix();
    let (a, b) = (store(&server.url(), &prefix), store(&server.url(), &prefix));
    let (la, lb) = (
        a.concurrency_limiter(&rule(TTL)).unwrap(),
        b.concurrency_limiter(&rule(TTL)).unwrap(),
    );
    let lease = la.acquire(b"job", 2, ALL).await.unwrap().lease.unwrap();
    // Three lease TTLs of work: A's task renews, B stays out.
    tokio::time::sleep(3 * TTL).await;
    assert_eq!(lb.held(b"job").await.unwrap(), 2);
    assert!(lb.acquire(b"job", 1, ALL).await.unwrap().lease.is_none());
    la.release(b"job", lease).await.unwrap();
    assert_eq!(lb.held(b"job").await.unwrap(), 0);
    assert!(lb.acquire(b"job", 2, ALL).await.unwrap().lease.is_some());
}

/// Review M2: the lease task released in lock-step — a drain of releases
/// awaited in full before it looked at its timer again — so behind a
/// slow Redis a backlog of releases held renewals back and a long
/// request's lease lapsed. Now releases run on their own, and the long
/// lease is renewed in time while a thousand releases go through a Redis
/// 200 ms away; none of them is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_go_on_while_releases_back_up_on_a_slow_redis() {
    use tollgate_redis::testing::Delayed;
    let Some(server) = Server::start() else {
        return;
    };
    let proxy = Delayed::start(server.port, Duration::from_millis(100)).await;
    let prefix = unique_prefix();
    let (slow, near) = (store(&proxy.url(), &prefix), store(&server.url(), &prefix));
    let (ls, ln) = (
        slow.concurrency_limiter(&rule(TTL)).unwrap(),
        near.concurrency_limiter(&rule(TTL)).unwrap(),
    );
    let long = ls.acquire(b"long", 2, ALL).await.unwrap().lease.unwrap();
    let keys: Vec<Vec<u8>> = (0..1_000)
        .map(|i| format!("short-{i}").into_bytes())
        .collect();
    let mut acquired = tokio::task::JoinSet::new();
    for key in keys.clone() {
        let ls = ls.clone();
        acquired
            .spawn(async move { (ls.acquire(&key, 1, ALL).await.unwrap().lease.unwrap(), key) });
    }
    let mut leases = Vec::new();
    while let Some(r) = acquired.join_next().await {
        leases.push(r.unwrap());
    }
    // A thousand releases at once, none awaited.
    for (lease, key) in leases {
        drop(ls.release(&key, lease));
    }
    // Three TTLs: the long lease is renewed every third of one meanwhile.
    for _ in 0..6 {
        tokio::time::sleep(TTL / 2).await;
        assert_eq!(ln.held(b"long").await.unwrap(), 2, "the long lease lapsed");
    }
    slow.flush().await;
    for key in keys.iter().step_by(50) {
        assert_eq!(ln.held(key).await.unwrap(), 0, "a release was lost");
    }
    ls.release(b"long", long).await.unwrap();
    assert_eq!(ln.held(b"long").await.unwrap(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_instances_leases_lapse_within_their_ttl() {
    let Some(server) = Server::start() else {
        return;
    };
    let prefix = unique_prefix();
    let a = store(&server.url(), &prefix);
    let b = store(&server.url(), &prefix);
    let la = a.concurrency_limiter(&rule(TTL)).unwrap();
    let lb = b.concurrency_limiter(&rule(TTL)).unwrap();
    let lease = la.acquire(b"job", 2, ALL).await.unwrap().lease;
    assert!(lease.is_some());
    assert!(lb.acquire(b"job", 1, ALL).await.unwrap().lease.is_none());
    // A dies holding its lease: no release, and its task stops.
    drop((la, a, lease));
    let died = Instant::now();
    while lb.held(b"job").await.unwrap() != 0 {
        assert!(
            died.elapsed() < TTL + Duration::from_secs(5),
            "a dead instance's lease outlived its TTL"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(lb.acquire(b"job", 2, ALL).await.unwrap().lease.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_cycles_with_dropped_releases_leave_nothing_held() {
    let Some(server) = Server::start() else {
        return;
    };
    let s = store(&server.url(), &unique_prefix());
    let limit = ConcurrencyRule::new("cycles", 8, Duration::from_secs(30)).unwrap();
    let l = s.concurrency_limiter(&limit).unwrap();
    let keys: [&[u8]; 3] = [b"a", b"b", b"c"];
    // Four tasks of 250 cycles, sharing the limiter.
    let mut tasks = Vec::new();
    for seed in 1..=4u64 {
        let l = l.clone();
        tasks.push(tokio::spawn(async move {
            let mut rng = Lcg(seed);
            let (mut granted, mut dropped) = (0, 0);
            for _ in 0..250 {
                let key = keys[rng.below(3) as usize];
                let permits = 1 + rng.below(3) as u32;
                let Some(lease) = l.acquire(key, permits, ALL).await.unwrap().lease else {
                    continue;
                };
                granted += 1;
                let release = l.release(key, lease);
                if rng.below(2) == 0 {
                    // As a guard's `Drop` does.
                    drop(release);
                    dropped += 1;
                } else {
                    release.await.unwrap();
                }
            }
            (granted, dropped)
        }));
    }
    let (mut granted, mut dropped) = (0, 0);
    for t in tasks {
        let (g, d) = t.await.unwrap();
        granted += g;
        dropped += d;
    }
    assert!(
        granted > 300 && dropped > 100,
        "{granted} granted, {dropped} dropped"
    );
    s.flush().await;
    for key in keys {
        assert_eq!(l.held(key).await.unwrap(), 0, "{key:?}");
    }
    // Nothing released comes back with a renewal.
    s.renew_leases().await;
    for key in keys {
        assert_eq!(l.held(key).await.unwrap(), 0, "{key:?}");
    }
    assert_eq!(s.stats().errors + s.stats().timeouts, 0, "{:?}", s.stats());
}

/// Lease keys carry the lease TTL (plus the margin), both of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_keys_expire_with_their_leases() {
    let Some(server) = Server::start() else {
        return;
    };
    let prefix = unique_prefix();
    let s = store(&server.url(), &prefix);
    let l = s.concurrency_limiter(&rule(TTL)).unwrap();
    let lease = l.acquire(b"k", 1, ALL).await.unwrap().lease.unwrap();
    let listed = server.cli(&["--scan", "--pattern", &format!("{prefix}:*")]);
    let mut names: Vec<&str> = listed.lines().filter(|n| !n.is_empty()).collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            s.key_name("sem2", "leases", b"k"),
            format!("{}:meta", s.key_name("sem2", "leases", b"k"))
        ]
    );
    for name in names {
        let ttl: i64 = server.cli(&["pttl", name]).trim().parse().unwrap();
        assert!(ttl > 0 && ttl <= 2_000, "{name} has TTL {ttl}");
    }
    l.release(b"k", lease).await.unwrap();
}

/// Should Redis evict one of a key's two lease keys, the script mends the
/// count: it never admits past `max`, and new leases get ids of their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_count_is_recounted_from_the_leases() {
    let Some(server) = Server::start() else {
        return;
    };
    let prefix = unique_prefix();
    let s = store(&server.url(), &prefix);
    let l = s
        .concurrency_limiter(&ConcurrencyRule::new("mend", 4, Duration::from_secs(30)).unwrap())
        .unwrap();
    let a = l.acquire(b"k", 1, ALL).await.unwrap().lease.unwrap();
    let b = l.acquire(b"k", 2, ALL).await.unwrap().lease.unwrap();
    let leases = s.key_name("sem2", "mend", b"k");
    server.cli(&["del", &format!("{leases}:meta")]);
    assert_eq!(l.held(b"k").await.unwrap(), 3);
    assert!(l.acquire(b"k", 2, ALL).await.unwrap().lease.is_none());
    let c = l.acquire(b"k", 1, ALL).await.unwrap().lease.unwrap();
    assert!(c.id != a.id && c.id != b.id, "{c:?} after {a:?}, {b:?}");
    // The leases gone: nothing is held, whatever the count said.
    server.cli(&["del", &leases]);
    assert_eq!(l.held(b"k").await.unwrap(), 0);
    assert!(l.acquire(b"k", 4, ALL).await.unwrap().lease.is_some());
}

/// Renewals on a cluster: one call per key, each to its own slot; on the
/// manual clock, so that only the explicit renewals count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_reach_every_slot_of_a_cluster() {
    let Some(cluster) = Cluster::start() else {
        return;
    };
    let clock = ManualClock::starting_at(START);
    let s = RedisStore::builder(&cluster.url())
        .prefix(&unique_prefix())
        .client_time(clock.clone())
        .timeout(Duration::from_secs(2))
        .lease_renewal(false)
        .build()
        .unwrap();
    let l = s
        .concurrency_limiter(&rule(Duration::from_secs(10)))
        .unwrap();
    let keys: Vec<Vec<u8>> = (0..12)
        .map(|i| format!("tenant-{i}").into_bytes())
        .collect();
    let mut leases = Vec::new();
    for key in &keys {
        leases.push(l.acquire(key, 1, ALL).await.unwrap().lease.unwrap());
        leases.push(l.acquire(key, 1, ALL).await.unwrap().lease.unwrap());
    }
    for _ in 0..3 {
        clock.advance(Duration::from_secs(9));
        s.renew_leases().await;
    }
    clock.advance(Duration::from_secs(9));
    for key in &keys {
        assert_eq!(l.held(key).await.unwrap(), 2, "{key:?}");
    }
    for (key, lease) in keys.iter().flat_map(|k| [k, k]).zip(leases) {
        l.release(key, lease).await.unwrap();
    }
    for key in &keys {
        assert_eq!(l.held(key).await.unwrap(), 0, "{key:?}");
    }
    assert_eq!(s.stats().errors + s.stats().timeouts, 0, "{:?}", s.stats());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_whose_caller_gave_up_strands_no_lease() {
    let Some(server) = Server::start() else {
        return;
    };
    let s = store(&server.url(), &unique_prefix());
    // A long TTL: a stranded lease would stay for the whole test.
    let sem = s
        .concurrency_limiter(
            &ConcurrencyRule::new("given-up", 1_000, Duration::from_secs(60)).unwrap(),
        )
        .unwrap();
    for i in 0..300u32 {
        let acquire = sem.acquire(b"k", 1, ALL);
        if i % 2 == 0 {
            // Dropped unpolled: the caller went away before the call.
            drop(acquire);
        } else {
            // Dropped mid-call: the caller went away while Redis answered
            // (or, if it answered in time, the caller releases as usual).
            let got = tokio::time::timeout(Duration::from_micros(50), acquire).await;
            if let Ok(Ok(got)) = got {
                sem.release(b"k", got.lease.unwrap()).await.unwrap();
            }
        }
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        s.flush().await;
        let held = sem.held(b"k").await.unwrap();
        if held == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "{held} permits stranded");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Concurrency review m9: two bindings of one rule with different lease
/// TTLs (a rolling deploy) share a key; the one with the shorter TTL set
/// the key's expiry to its own, below the other's live lease, so the key
/// (and that permit) could vanish while its request ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shorter_ttl_never_cuts_a_longer_lease_short() {
    let Some(server) = Server::start() else {
        return;
    };
    let prefix = unique_prefix();
    let (long, short) = (store(&server.url(), &prefix), store(&server.url(), &prefix));
    let a = long
        .concurrency_limiter(&ConcurrencyRule::new("deploy", 4, Duration::from_secs(60)).unwrap())
        .unwrap();
    let b = short
        .concurrency_limiter(&ConcurrencyRule::new("deploy", 4, Duration::from_secs(2)).unwrap())
        .unwrap();
    assert!(a.acquire(b"k", 1, ALL).await.unwrap().lease.is_some());
    assert!(b.acquire(b"k", 1, ALL).await.unwrap().lease.is_some());
    let name = long.key_name("sem2", "deploy", b"k");
    let pttl: i64 = server.cli(&["PTTL", &name]).trim().parse().unwrap();
    assert!(
        pttl > 55_000,
        "the key expires in {pttl} ms, before the 60 s lease it holds"
    );
}

/// Fleet review M7: a lease Redis lost (a failover, a restart without
/// persistence) was never counted again while its work ran, so new
/// acquires took its permits: up to twice `max` in flight. The holder's
/// renewal now counts it again where it fits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_counts_a_lease_redis_lost_again() {
    let Some(server) = Server::start() else {
        return;
    };
    let prefix = unique_prefix();
    let (a, b) = (store(&server.url(), &prefix), store(&server.url(), &prefix));
    let (la, lb) = (
        a.concurrency_limiter(&rule(TTL)).unwrap(),
        b.concurrency_limiter(&rule(TTL)).unwrap(),
    );
    let _lease = la.acquire(b"lost", 2, ALL).await.unwrap().lease.unwrap();
    // Redis loses the key (as a failover that lost the write would).
    server.cli(&["DEL", &a.key_name("sem2", "leases", b"lost")]);
    assert_eq!(lb.held(b"lost").await.unwrap(), 0, "lost");
    // Within a renewal (every third of the TTL), it is counted again, and
    // B is kept out.
    tokio::time::sleep(TTL).await;
    assert_eq!(lb.held(b"lost").await.unwrap(), 2);
    assert!(lb.acquire(b"lost", 1, ALL).await.unwrap().lease.is_none());
}

/// Concurrency review, missing test 8: a renewal round that fails (Redis
/// stopped, the call times out and opens the breaker) leaves the task
/// running and the leases watched; once Redis answers again the next
/// round, the breaker's probe, renews them, and a long request keeps its
/// permits past the TTL it was granted with. (A failed round that forgot
/// its leases, or a task that ended on it, lets the lease lapse at one
/// TTL and B take the permits.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_recover_after_a_failed_round_opened_the_breaker() {
    let Some(server) = Server::start() else {
        return;
    };
    let prefix = unique_prefix();
    // Renewals every second; one failed round is what a TTL can spare.
    let ttl = Duration::from_secs(3);
    let a = RedisStore::builder(&server.url())
        .prefix(&prefix)
        .timeout(Duration::from_millis(200))
        .breaker(1, Duration::from_millis(300))
        .build()
        .unwrap();
    let b = store(&server.url(), &prefix);
    let (la, lb) = (
        a.concurrency_limiter(&rule(ttl)).unwrap(),
        b.concurrency_limiter(&rule(ttl)).unwrap(),
    );
    let lease = la.acquire(b"job", 2, ALL).await.unwrap().lease.unwrap();
    let granted = Instant::now();
    // Redis stops until the first round has failed and opened A's breaker.
    server.pause(true);
    let deadline = Instant::now() + ttl;
    while !a.breaker_open() {
        assert!(Instant::now() < deadline, "no renewal round failed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    server.pause(false);
    // Two TTLs past the grant: only renewed leases are still held.
    while granted.elapsed() < 2 * ttl {
        assert_eq!(lb.held(b"job").await.unwrap(), 2, "the lease lapsed");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(!a.breaker_open(), "the probe did not close the breaker");
    assert!(lb.acquire(b"job", 1, ALL).await.unwrap().lease.is_none());
    la.release(b"job", lease).await.unwrap();
    assert_eq!(lb.held(b"job").await.unwrap(), 0);
}
