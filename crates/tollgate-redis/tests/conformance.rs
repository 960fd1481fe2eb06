//! The core's conformance suite against Redis: standalone and a 3-master
//! cluster, with the time passed from the suite's manual clock — at the
//! suite's small start and at today's Unix time in ns (far above 2^53,
//! where the scripts must not round).
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects
)]

use tollgate_redis::testing as support;

use std::collections::HashMap;
use std::time::Duration;

use tollgate_core::{
    testing, Clock, ConcurrencyLimiter, ConcurrencyRule, Lease, Limit, ManualClock, Rate, Rule,
    SemaphoreState, Store,
};
use tollgate_core::{JointPart, Limiter};
use tollgate_redis::{RedisLimiter, RedisStore};

fn factory(url: String) -> impl Fn(ManualClock) -> RedisStore {
    renewing_factory(url, true)
}

/// Stores on the manual clock; `renew` says whether their lease task
/// renews on real time (off where a scenario watches leases lapse).
fn renewing_factory(url: String, renew: bool) -> impl Fn(ManualClock) -> RedisStore {
    move |clock| {
        RedisStore::builder(&url)
            .prefix(&support::unique_prefix())
            .client_time(clock)
            .timeout(std::time::Duration::from_secs(2))
            .lease_renewal(renew)
            .build()
            .unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_redis_passes_the_conformance_suite() {
    let Some(server) = support::Server::start() else {
        return;
    };
    testing::run(factory(server.url())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_redis_passes_the_conformance_suite_at_todays_unix_time() {
    let Some(server) = support::Server::start() else {
        return;
    };
    testing::run_at(factory(server.url()), UNIX_2026).await;
}

/// Rules decided together: on one server, one script call that writes
/// for all of them or for none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn joint_decisions_match_the_reference() {
    let Some(server) = support::Server::start() else {
        return;
    };
    for (start, seed) in [(START, 1), (UNIX_2026, 2), (UNIX_2026, 3)] {
        let clock = ManualClock::starting_at(start);
        let store = factory(server.url())(clock.clone());
        testing::joint_random_trace(&store, &clock, seed, true).await;
    }
    // One rule asked twice for one key: two calls (a joint call reads
    // each key once, before any write), so both count against the key.
    let clock = ManualClock::starting_at(START);
    let store = factory(server.url())(clock.clone());
    let hourly = Rule::new("once", Limit::fixed_window(1, Duration::from_secs(3_600)));
    let limiter = store.limiter(&hourly.unwrap()).unwrap();
    let part = JointPart {
        limiter: &limiter,
        key: b"k",
        cost: 1,
        enforced: false,
    };
    let answers = RedisLimiter::decide_joint(&[part, part]).unwrap().await;
    let admitted = answers.iter().filter(|a| a.consumed).count();
    assert_eq!(admitted, 1, "{answers:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_passes_the_conformance_suite() {
    let Some(cluster) = support::Cluster::start() else {
        return;
    };
    // Leases lapse on the manual clock; real-time renewal stays out of it.
    let make = renewing_factory(cluster.url(), false);
    for start in [START, UNIX_2026] {
        testing::run_at(factory(cluster.url()), start).await;
        let clock = ManualClock::starting_at(start);
        testing::lease_expiry(&make(clock.clone()), &clock).await;
        // Rules in different slots: one call each, side by side.
        let clock = ManualClock::starting_at(start);
        let store = factory(cluster.url())(clock.clone());
        testing::joint_random_trace(&store, &clock, 4, false).await;
    }
    rules_sharing_a_slot_share_a_call(&cluster).await;
}

/// On Cluster, rules whose keys share a hash slot are decided in one
/// script call, all or nothing; a rule in another slot in a call of its
/// own, whose charge the caller refunds when the request is denied.
async fn rules_sharing_a_slot_share_a_call(cluster: &support::Cluster) {
    let prefix = support::unique_prefix();
    let store = RedisStore::builder(&cluster.url())
        .prefix(&prefix)
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    // The keys' format is checked in the store's own tests.
    let slot =
        |name: &str| redis::cluster_routing::Slot::for_key(store.key_name("fw1", name, b"k"));
    let names = (0..).map(|i| format!("r{i}"));
    let mate = names.clone().find(|n| slot(n) == slot("first")).unwrap();
    let other = names.clone().find(|n| slot(n) != slot("first")).unwrap();
    let hourly = |name: &str, limit| {
        let rule = Rule::new(name, Limit::fixed_window(limit, Duration::from_secs(3_600)));
        store.limiter(&rule.unwrap()).unwrap()
    };
    let limiters = [hourly("first", 1), hourly(&mate, 10), hourly(&other, 10)];
    let decide = |cost: u64| {
        let parts: Vec<JointPart<'_, RedisLimiter>> = limiters
            .iter()
            .map(|limiter| JointPart {
                limiter,
                key: b"k",
                cost,
                enforced: true,
            })
            .collect();
        RedisLimiter::decide_joint(&parts).unwrap()
    };
    let calls = || {
        cluster
            .nodes
            .iter()
            .map(support::Server::script_calls)
            .sum::<u64>()
    };
    // Peeks load the scripts where they run, and consume nothing.
    decide(0).await;
    let before = calls();
    let first = decide(1).await;
    assert_eq!(
        calls() - before,
        2,
        "one call for the shared slot, one for the other"
    );
    assert!(first.iter().all(|a| a.consumed), "{first:?}");
    // "first" is spent: its slot's call writes nothing; the other slot's
    // call consumed, for the caller to refund.
    let second = decide(1).await;
    let consumed: Vec<bool> = second.iter().map(|a| a.consumed).collect();
    assert_eq!(consumed, [false, false, true], "{second:?}");
    assert!(!second[0].decision.as_ref().unwrap().is_allowed());
    let left: Vec<u64> = decide(0)
        .await
        .iter()
        .map(|a| a.decision.as_ref().unwrap().remaining)
        .collect();
    assert_eq!(left, [0, 9, 8]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_redis_passes_the_quota_suite() {
    let Some(server) = support::Server::start() else {
        return;
    };
    testing::run_quota(factory(server.url())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_passes_the_quota_suite() {
    let Some(cluster) = support::Cluster::start() else {
        return;
    };
    testing::run_quota(factory(cluster.url())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_leases_lapse_after_their_ttl() {
    let Some(server) = support::Server::start() else {
        return;
    };
    let make = renewing_factory(server.url(), false);
    for start in [START, UNIX_2026] {
        let clock = ManualClock::starting_at(start);
        testing::lease_expiry(&make(clock.clone()), &clock).await;
    }
}

/// The suite's three per-rule scenarios for the rule named `name`, on a
/// standalone server, at the suite's start and at today's Unix time; then
/// traces of our own at today's Unix time, in steps of a millisecond and
/// of a microsecond (plus up to 999 ns): the first mismatch names the
/// step, key, cost and time.
async fn matches_the_reference(name: &str) {
    let Some(server) = support::Server::start() else {
        return;
    };
    let make = factory(server.url());
    let rule = testing::rules()
        .into_iter()
        .find(|r| r.name() == name)
        .unwrap();
    for start in [START, UNIX_2026] {
        let clock = ManualClock::starting_at(start);
        testing::matches_reference_on_random_trace(&make(clock.clone()), &clock, &rule, 7).await;
        let clock = ManualClock::starting_at(start);
        testing::matches_reference_on_random_trace(&make(clock.clone()), &clock, &rule, 0x5eed)
            .await;
        let clock = ManualClock::starting_at(start);
        testing::burst_deny_recover(&make(clock.clone()), &clock, &rule).await;
        let clock = ManualClock::starting_at(start);
        testing::peek_refund_and_never(&make(clock.clone()), &clock, &rule).await;
    }
    trace_matches_the_reference(&make, &rule, START, MS).await;
    trace_matches_the_reference(&make, &rule, UNIX_2026, MS).await;
    trace_matches_the_reference(&make, &rule, UNIX_2026, 1_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gcra_matches_the_reference() {
    matches_the_reference("gcra").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_bucket_matches_the_reference() {
    matches_the_reference("token-bucket").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fixed_window_matches_the_reference() {
    matches_the_reference("fixed-window").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sliding_counter_matches_the_reference() {
    matches_the_reference("sliding-counter").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sliding_log_matches_the_reference() {
    matches_the_reference("sliding-log").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sliding_buckets_matches_the_reference() {
    matches_the_reference("sliding-buckets").await;
}

/// A window of buckets whose state is far ahead of the clock (an
/// instance whose clock ran ahead): within 2^16 buckets it still counts,
/// beyond that it reads as fresh, on Redis as in the core.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sliding_buckets_far_ahead_of_the_clock_match_the_reference() {
    let Some(server) = support::Server::start() else {
        return;
    };
    let make = factory(server.url());
    let rule = Rule::new(
        "far",
        Limit::sliding_window_buckets(3, Duration::from_millis(3), 3),
    )
    .unwrap();
    let ms = 1_000_000;
    for start in [START, UNIX_2026] {
        let clock = ManualClock::starting_at(start);
        let store = make(clock.clone());
        let limiter = store.limiter(&rule).unwrap();
        let mut reference = testing::Reference::new(&rule);
        for (at, cost) in [
            (start, 3),
            (start - 65_536 * ms, 1),
            (start - 65_538 * ms, 2),
            (start - 65_538 * ms, 2),
            (start, 1),
        ] {
            clock.set(at);
            let got = limiter.decide(b"k", cost).await.unwrap();
            assert_eq!(
                got,
                reference.decide(b"k", at, cost),
                "at {at}, cost {cost}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaky_bucket_matches_the_reference() {
    matches_the_reference("leaky-bucket").await;
}

/// Parameters whose products pass 2^53 (a large limit over a long
/// window), and the shortest and longest spans the store takes, at the
/// suite's start and at today's Unix time: the scripts must stay exact
/// where the core computes in u128.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_parameters_match_the_reference() {
    let Some(server) = support::Server::start() else {
        return;
    };
    let make = factory(server.url());
    let day = Duration::from_secs(86_400);
    let hour = Duration::from_secs(3_600);
    for (name, limit) in [
        ("counter-day", Limit::sliding_window_counter(1_000_000, day)),
        (
            "counter-week",
            Limit::sliding_window_counter(u32::MAX, 7 * day),
        ),
        (
            "counter-odd",
            Limit::sliding_window_counter(999_983, Duration::from_nanos(86_399_999_999_971)),
        ),
        ("fixed-day", Limit::fixed_window(1_000_000, day)),
        (
            "bucket-big",
            Limit::token_bucket(u32::MAX, 100_000_000, hour),
        ),
        ("bucket-day", Limit::token_bucket(1_000, 70, day)),
        ("log-day", Limit::sliding_window_log(10_000, day)),
        (
            "buckets-week",
            Limit::sliding_window_buckets(u32::MAX, 7 * day, 100),
        ),
        (
            "buckets-odd",
            Limit::sliding_window_buckets(999_983, Duration::from_nanos(86_399_999_999_971), 7),
        ),
        (
            "leaky-day",
            Limit::leaky_bucket(Rate::new(1_000, day), hour),
        ),
        ("gcra-day", Limit::gcra(Rate::new(1_000, day), 10_000)),
        // 2^51 ns, the longest span the store takes.
        (
            "gcra-longest",
            Limit::gcra(Rate::new(1, Duration::from_nanos(1 << 41)), 1 << 10),
        ),
        (
            "log-longest",
            Limit::sliding_window_log(100, Duration::from_nanos(1 << 51)),
        ),
        (
            "buckets-longest",
            Limit::sliding_window_buckets(u32::MAX, Duration::from_nanos(1 << 51), 100),
        ),
        (
            "counter-longest",
            Limit::sliding_window_counter(u32::MAX, Duration::from_nanos(1 << 51)),
        ),
        // One unit per nanosecond, and windows of a few.
        (
            "gcra-ns",
            Limit::gcra(Rate::new(1, Duration::from_nanos(1)), 1_000),
        ),
        (
            "bucket-ns",
            Limit::token_bucket(7, 3, Duration::from_nanos(3)),
        ),
        (
            "counter-ns",
            Limit::sliding_window_counter(5, Duration::from_nanos(7)),
        ),
        (
            "leaky-ns",
            Limit::leaky_bucket(
                Rate::new(1, Duration::from_nanos(3)),
                Duration::from_nanos(10),
            ),
        ),
    ] {
        let rule = Rule::new(name, limit).unwrap();
        let window = rule.window();
        for origin in [START, UNIX_2026] {
            // Start a third of a window before a boundary (if that is not
            // far off); move by 1/1000 windows, at most 20 s.
            let boundary = (origin / window + 1) * window - window / 3;
            let start = if boundary < origin + START {
                boundary.max(origin)
            } else {
                origin
            };
            let unit = (window / 1_000).clamp(1, 20_000_000_000);
            trace_matches_the_reference(&make, &rule, start, unit).await;
        }
    }
}

/// A random trace of acquires (ceilings included), releases, renewals of
/// every held lease and counts, with the clock also going back, against
/// the pure semaphore.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn semaphore_matches_the_reference() {
    let Some(server) = support::Server::start() else {
        return;
    };
    // Renewals only when the trace says so.
    let make = renewing_factory(server.url(), false);
    for (seed, ttl_ms, start) in [
        (0xc0ffee, 2_000, START),
        (0x5eed, 1_000, START),
        (0xc0ffee, 2_000, UNIX_2026),
        (0x5eed, 1_000, UNIX_2026),
    ] {
        let clock = ManualClock::starting_at(start);
        let store = make(clock.clone());
        let rule = ConcurrencyRule::new("sem", 4, Duration::from_millis(ttl_ms))
            .unwrap()
            .with_retry_after(Duration::from_millis(700))
            .unwrap();
        let sem = store.concurrency_limiter(&rule).unwrap();
        let reference = rule.semaphore();
        let mut states: HashMap<&[u8], SemaphoreState> = HashMap::new();
        // Granted and not released yet.
        let mut held: Vec<(&[u8], Lease)> = Vec::new();
        let mut rng = Lcg(seed);
        let keys: [&[u8]; 2] = [b"a", b"b"];
        for step in 0..600 {
            testing::move_clock(&clock, &mut rng, MS, Some(start));
            let now = clock.now();
            let key = keys[rng.below(2) as usize];
            let at = format!("seed {seed:#x} step {step} at {start}+{}", now - start);
            match rng.below(8) {
                0..=3 => {
                    let state = states.entry(key).or_default();
                    let permits = rng.below(6) as u32;
                    let ceiling = match rng.below(3) {
                        0 => rng.below(6) as u32,
                        _ => u32::MAX,
                    };
                    let got = sem.acquire(key, permits, ceiling).await.unwrap();
                    let id = got.lease.map_or(u64::MAX, |l| l.id);
                    let want = reference.acquire(state, now, permits, ceiling, id);
                    assert_eq!(got, want, "{at}: acquire {permits} under {ceiling}");
                    if let Some(lease) = got.lease {
                        held.push((key, lease));
                    }
                }
                4 | 5 if !held.is_empty() => {
                    let (k, lease) = held.swap_remove(rng.below(held.len() as u64) as usize);
                    sem.release(k, lease).await.unwrap();
                    reference.release(states.entry(k).or_default(), now, lease.id);
                }
                6 => {
                    store.renew_leases().await;
                    for (k, lease) in &held {
                        reference.renew(states.entry(k).or_default(), now, lease.id);
                    }
                }
                _ => {
                    // A count drops lapsed leases, as every call does, so
                    // that they stay lapsed should the clock go back; in
                    // the reference, that is releasing no lease.
                    let state = states.entry(key).or_default();
                    reference.release(state, now, u64::MAX);
                    let want = state.held(now);
                    assert_eq!(sem.held(key).await.unwrap(), want, "{at}: held");
                }
            }
        }
    }
}

/// Leases renewed for months, the clock once stepping back a month: the
/// lease set's scores count from a base second that moves with the clock
/// (once more than 26 days off), and every answer stays exactly the pure
/// semaphore's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_renewed_for_months_match_the_reference() {
    let Some(server) = support::Server::start() else {
        return;
    };
    let make = renewing_factory(server.url(), false);
    let clock = ManualClock::starting_at(UNIX_2026);
    let store = make(clock.clone());
    const DAY: u64 = 86_400_000_000_000;
    let rule = ConcurrencyRule::new("months", 3, Duration::from_nanos(20 * DAY + 7)).unwrap();
    let sem = store.concurrency_limiter(&rule).unwrap();
    let reference = rule.semaphore();
    let mut state = SemaphoreState::default();
    let mut held = Vec::new();
    let acquire = async |state: &mut SemaphoreState, permits: u32, at: &str| {
        let got = sem.acquire(b"k", permits, u32::MAX).await.unwrap();
        let id = got.lease.map_or(u64::MAX, |l| l.id);
        let want = reference.acquire(state, clock.now(), permits, u32::MAX, id);
        assert_eq!(got, want, "{at}: acquire {permits}");
        got.lease
    };
    held.extend(acquire(&mut state, 1, "start").await);
    for i in 0..14 {
        if i == 9 {
            clock.set(clock.now() - 30 * DAY);
        } else {
            clock.advance_nanos(9 * DAY + 1_234);
        }
        let at = format!("step {i} at +{} ns", clock.now() - UNIX_2026);
        store.renew_leases().await;
        for lease in &held {
            reference.renew(&mut state, clock.now(), lease.id);
        }
        assert_eq!(
            sem.held(b"k").await.unwrap(),
            state.held(clock.now()),
            "{at}"
        );
        acquire(&mut state, 0, &at).await;
        if i == 6 {
            held.extend(acquire(&mut state, 2, &at).await);
        }
    }
    // No more renewals: the leases lapse 20 days and 7 ns after the last.
    clock.advance_nanos(20 * DAY + 6);
    assert_eq!(sem.held(b"k").await.unwrap(), 3);
    acquire(&mut state, 0, "before the lapse").await;
    clock.advance_nanos(1);
    assert_eq!(sem.held(b"k").await.unwrap(), 0);
    acquire(&mut state, 0, "after the lapse").await;
    assert_eq!(store.stats().errors, 0, "{:?}", store.stats());
}

const START: u64 = testing::START;
const UNIX_2026: u64 = testing::UNIX_2026;
const MS: u64 = 1_000_000;

/// The suite's generator, for traces of our own.
use testing::Lcg;

/// 600 steps from `start` in steps of `unit` ns, the clock also going back:
/// the store must answer exactly as the pure algorithm does.
async fn trace_matches_the_reference(
    make: &impl Fn(ManualClock) -> RedisStore,
    rule: &Rule,
    start: u64,
    unit: u64,
) {
    let clock = ManualClock::starting_at(start);
    let trace = testing::Trace {
        seed: 0xbac4,
        steps: 600,
        unit,
        backwards: true,
    };
    testing::random_trace(&make(clock.clone()), &clock, rule, trace).await;
}
