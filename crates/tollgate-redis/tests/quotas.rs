//! Calendar quotas on Redis: shared by a fleet, kept across instance
//! restarts until their longest period ends, on Redis's own `TIME`.
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects
)]

use std::time::Duration;

use tollgate_core::calendar::{unix_nanos, Offset, Period};
use tollgate_core::{ManualClock, Outcome, QuotaLimiter, QuotaRule, QuotaStore};
use tollgate_redis::testing::{unique_prefix, Server};
use tollgate_redis::RedisStore;

const SECOND: u64 = 1_000_000_000;

fn instance(server: &Server, prefix: &str, clock: &ManualClock) -> RedisStore {
    RedisStore::builder(&server.url())
        .prefix(prefix)
        .client_time(clock.clone())
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap()
}

fn plan() -> QuotaRule {
    QuotaRule::new(
        "plan",
        &[(Period::Day, 100), (Period::Month, 1_000)],
        Offset::UTC,
    )
    .unwrap()
}

fn remaining(d: &tollgate_core::QuotaDecision) -> (u64, u64) {
    (d.periods()[0].remaining, d.periods()[1].remaining)
}

/// Two instances share a quota on one Redis; one restarts at noon (its
/// store dropped, a new one built — what a deploy does) and finds the
/// day's and the month's spending as they were; so does a third instance
/// started after both are gone. (The test server keeps nothing on disk, so
/// a restart of Redis itself would lose everything: persistence is
/// Redis's to configure.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarting_an_instance_mid_day_keeps_the_quota_already_spent() {
    let Some(server) = Server::start() else {
        return;
    };
    let prefix = unique_prefix();
    let clock = ManualClock::at_unix(unix_nanos(2026, 12, 2, 11, 0, 0));
    let a = instance(&server, &prefix, &clock);
    let b = instance(&server, &prefix, &clock);
    let (qa, qb) = (
        a.quota_limiter(&plan()).unwrap(),
        b.quota_limiter(&plan()).unwrap(),
    );
    assert!(qa.consume(b"acme", 30).await.unwrap().is_allowed());
    assert!(qb.consume(b"acme", 20).await.unwrap().is_allowed());
    assert_eq!(remaining(&qa.consume(b"acme", 0).await.unwrap()), (50, 950));
    // A restarts at noon.
    drop((qa, a));
    clock.set(unix_nanos(2026, 12, 2, 12, 0, 0));
    let a = instance(&server, &prefix, &clock);
    let qa = a.quota_limiter(&plan()).unwrap();
    assert_eq!(remaining(&qa.consume(b"acme", 0).await.unwrap()), (50, 950));
    assert!(qa.consume(b"acme", 45).await.unwrap().is_allowed());
    let d = qb.consume(b"acme", 10).await.unwrap();
    assert_eq!(
        d.outcome,
        Outcome::Deny {
            retry_after: 12 * 3_600 * SECOND
        }
    );
    // Every instance gone; a new one the next day: a whole day, the
    // month's spending kept.
    drop((qa, qb, a, b));
    clock.set(unix_nanos(2026, 12, 3, 8, 0, 0));
    let c = instance(&server, &prefix, &clock);
    let qc = c.quota_limiter(&plan()).unwrap();
    assert_eq!(
        remaining(&qc.consume(b"acme", 0).await.unwrap()),
        (100, 905)
    );
    assert_eq!(c.stats().errors + c.stats().timeouts, 0, "{:?}", c.stats());
}

/// One hash per rule and key, `<prefix>:{q1|rule|h:<digest>}`, a field per
/// period holding "start used bonus" (start in Unix seconds); it lives
/// until its longest period ends plus a minute. Reads and denials write
/// nothing; a reset deletes the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quota_keys_live_until_their_longest_period_ends() {
    let Some(server) = Server::start() else {
        return;
    };
    let prefix = unique_prefix();
    let now = unix_nanos(2026, 12, 2, 12, 0, 0) + 250_000_000;
    let clock = ManualClock::at_unix(now);
    let store = instance(&server, &prefix, &clock);
    let quota = store.quota_limiter(&plan()).unwrap();
    let key = store.key_name("q1", "plan", b"acme");
    let exists = || server.cli(&["exists", &key]).trim().to_owned();
    quota.consume(b"acme", 0).await.unwrap();
    quota.consume(b"acme", 101).await.unwrap();
    assert_eq!(exists(), "0", "a read or a denial wrote");
    quota.consume(b"acme", 7).await.unwrap();
    quota.grant(b"acme", 3).await.unwrap();
    let day_start = (unix_nanos(2026, 12, 2, 0, 0, 0) / SECOND).to_string();
    let day_end = (unix_nanos(2026, 12, 3, 0, 0, 0) / SECOND).to_string();
    let month_start = (unix_nanos(2026, 12, 1, 0, 0, 0) / SECOND).to_string();
    let month_end = (unix_nanos(2027, 1, 1, 0, 0, 0) / SECOND).to_string();
    // "start used bonus end".
    assert_eq!(
        server.cli(&["hget", &key, "day"]).trim(),
        format!("{day_start} 7 3 {day_end}")
    );
    assert_eq!(
        server.cli(&["hget", &key, "month"]).trim(),
        format!("{month_start} 7 3 {month_end}")
    );
    // A field written before ends were stored still reads: its end is its
    // start's period's.
    server.cli(&["hset", &key, "month", &format!("{month_start} 9 0")]);
    let d = quota.consume(b"acme", 0).await.unwrap();
    assert_eq!(d.periods()[1].remaining, 1_000 - 9);
    // Until 2027-01-01T00:00Z plus a minute.
    let want = (unix_nanos(2027, 1, 1, 0, 0, 0) - now) / 1_000_000 + 60_000;
    let ttl: u64 = server.cli(&["pttl", &key]).trim().parse().unwrap();
    assert!(
        ttl <= want && ttl + 5_000 > want,
        "TTL {ttl} ms, want about {want}"
    );
    quota.reset(b"acme").await.unwrap();
    assert_eq!(exists(), "0", "a reset left the key");
    // A refund of a key that has nothing writes nothing either.
    quota.refund(b"acme", 3).await.unwrap();
    assert_eq!(exists(), "0", "a refund of nothing wrote");
}

/// On Redis's own `TIME` (no client time): periods are where the core's
/// calendar puts them at Redis's time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quotas_follow_redis_time() {
    let Some(server) = Server::start() else {
        return;
    };
    let store = RedisStore::builder(&server.url())
        .prefix(&unique_prefix())
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let rule = QuotaRule::new(
        "clock",
        &[
            (Period::Minute, 5),
            (Period::Month, 50),
            (Period::Year, 500),
        ],
        Offset::from_hours_minutes(9, 0).unwrap(),
    )
    .unwrap();
    let quota = store.quota_limiter(&rule).unwrap();
    let time: Vec<u64> = server
        .cli(&["time"])
        .lines()
        .map(|l| l.trim().parse().unwrap())
        .collect();
    let before = time[0] * SECOND + time[1] * 1_000;
    let d = quota.consume(b"k", 2).await.unwrap();
    assert!(d.is_allowed());
    for p in d.periods() {
        let (start, end) = p.period.bounds_in(before, rule.quota().zone());
        // Unless a period ended between the two readings (a minute may).
        if end - before > 2 * SECOND {
            assert_eq!(p.length, end - start, "{}", p.period);
            let drift = (end - before) - p.reset_after;
            assert!(drift < 2 * SECOND, "{}: {drift} ns off", p.period);
        }
        assert_eq!(p.limit - p.remaining, 2, "{}", p.period);
    }
}

/// Review of this session's diff: Lua counts in doubles, exact to 2^53. A
/// budget of exactly 2^53 (the largest limit and the largest grant) and a
/// cost of 2^53 + 1, which rounds to 2^53, was admitted on Redis while
/// memory said "never". Costs past 2^53 are sent as 2^53 + 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cost_past_what_lua_counts_exactly_never_fits() {
    let Some(server) = Server::start() else {
        return;
    };
    let clock = ManualClock::at_unix(unix_nanos(2026, 12, 2, 11, 0, 0));
    let store = instance(&server, &unique_prefix(), &clock);
    let max = tollgate_core::Quota::MAX_LIMIT;
    let rule = QuotaRule::new("huge", &[(Period::Day, max)], Offset::UTC).unwrap();
    let quota = store.quota_limiter(&rule).unwrap();
    quota.grant(b"k", max).await.unwrap();
    for cost in [(1 << 53) + 1, (1 << 53) + 3, u64::MAX] {
        let d = quota.consume(b"k", cost).await.unwrap();
        assert_eq!(d.outcome, Outcome::Never, "cost {cost}");
    }
    let d = quota.consume(b"k", 1 << 53).await.unwrap();
    assert!(d.is_allowed(), "the whole budget fits: {d:?}");
}

/// Quota-bandwidth-retry review #6: reading a key's usage through
/// `consume(key, 0)` on a fail-open store that lost Redis reported whole
/// budgets — the failure policy's answer — to an admin's dashboard.
/// `usage` is the store's answer or an error.
#[tokio::test]
async fn usage_is_redis_s_answer_or_an_error_never_the_failure_policy_s() {
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        drop(l);
        format!("redis://127.0.0.1:{port}")
    };
    let store = RedisStore::builder(&dead)
        .prefix(&unique_prefix())
        .failure_policy(tollgate_redis::FailurePolicy::Open)
        .timeout(Duration::from_millis(100))
        .build()
        .unwrap();
    let l = store.quota_limiter(&plan()).unwrap();
    // The failure policy answers a decision: admitted, whole budgets...
    assert!(l.consume(b"k", 0).await.unwrap().is_allowed());
    // ...but not a read of the usage.
    assert!(l.usage(b"k").await.is_err());
}

/// Quota review #5: the script kept a stored window only if it started at
/// or after now's period at the rule's offset, so a quota whose offset
/// moved later (summer's −04:00 to winter's −05:00: the month starts at
/// 05:00Z, not 04:00Z) lost every key's month — and during a rolling
/// deploy the instances on each offset reset each other's counts. Now the
/// window stores its end and is read as the core reads it: counted on
/// through the period it falls in at the new offset, old and new
/// instances side by side, and December starts afresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offset_moved_for_daylight_saving_keeps_the_month_s_usage() {
    let Some(server) = Server::start() else {
        return;
    };
    let prefix = unique_prefix();
    let clock = ManualClock::at_unix(unix_nanos(2026, 11, 10, 12, 0, 0));
    let monthly = |hours| {
        let offset = Offset::from_hours_minutes(hours, 0).unwrap();
        QuotaRule::new("monthly", &[(Period::Month, 1_000)], offset).unwrap()
    };
    let (old, new) = (
        instance(&server, &prefix, &clock),
        instance(&server, &prefix, &clock),
    );
    let (summer, winter) = (
        old.quota_limiter(&monthly(-4)).unwrap(),
        new.quota_limiter(&monthly(-5)).unwrap(),
    );
    let left = |d: tollgate_core::QuotaDecision| d.periods()[0].remaining;
    assert_eq!(left(summer.consume(b"k", 30).await.unwrap()), 970);
    // A rolling deploy: both offsets at once, one count.
    assert_eq!(left(winter.consume(b"k", 5).await.unwrap()), 965);
    assert_eq!(left(summer.consume(b"k", 5).await.unwrap()), 960);
    assert_eq!(left(winter.consume(b"k", 0).await.unwrap()), 960);
    // Past the summer month's end (04:00Z), still November at −05:00.
    clock.set(unix_nanos(2026, 12, 1, 4, 30, 0));
    let d = winter.consume(b"k", 0).await.unwrap();
    assert_eq!(left(d), 960);
    assert_eq!(d.periods()[0].reset_after, 30 * 60 * SECOND);
    clock.set(unix_nanos(2026, 12, 1, 5, 0, 0));
    assert_eq!(left(winter.consume(b"k", 0).await.unwrap()), 1_000);
}
