//! A rule against a regional and a global store: both must admit, a
//! refusal by one is refunded to the other, and when the global store is
//! away the regional limit alone holds.
#![allow(missing_docs, clippy::unwrap_used, clippy::arithmetic_side_effects)]

use std::future::Ready;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tollgate_core::{
    ConcurrencyRule, ConfigError, Decision, Limit, Limiter, ManualClock, Rate, Rule, Store,
    StoreError, StoreErrorKind,
};
use tollgate_memory::{MemoryLimiter, MemoryStore};
use tollgate_redis::{HotKeys, Tiered};

/// A memory store that can be switched off (every call fails).
#[derive(Clone)]
struct Far {
    memory: MemoryStore<ManualClock>,
    down: Arc<AtomicBool>,
}

#[derive(Clone, Debug)]
struct FarLimiter {
    inner: MemoryLimiter<ManualClock>,
    down: Arc<AtomicBool>,
}

impl Limiter for FarLimiter {
    type DecideFuture = Ready<Result<Decision, StoreError>>;
    type RefundFuture = Ready<Result<(), StoreError>>;

    fn rule(&self) -> &Rule {
        self.inner.rule()
    }

    fn decide(&self, key: &[u8], cost: u64) -> Self::DecideFuture {
        if self.down.load(Ordering::Relaxed) {
            return std::future::ready(Err(StoreError::new(StoreErrorKind::Timeout, "far away")));
        }
        std::future::ready(Ok(self.inner.decide_now(key, cost)))
    }

    fn refund(&self, key: &[u8], cost: u64) -> Self::RefundFuture {
        self.inner.refund_now(key, cost);
        std::future::ready(Ok(()))
    }
}

impl Store for Far {
    type Limiter = FarLimiter;
    type ConcurrencyLimiter = <MemoryStore<ManualClock> as Store>::ConcurrencyLimiter;

    fn limiter(&self, rule: &Rule) -> Result<FarLimiter, ConfigError> {
        Ok(FarLimiter {
            inner: self.memory.limiter(rule)?,
            down: Arc::clone(&self.down),
        })
    }

    fn concurrency_limiter(
        &self,
        rule: &ConcurrencyRule,
    ) -> Result<Self::ConcurrencyLimiter, ConfigError> {
        self.memory.concurrency_limiter(rule)
    }
}

fn mem(clock: &ManualClock) -> MemoryStore<ManualClock> {
    MemoryStore::builder().clock(clock.clone()).build().unwrap()
}

/// A far store on `clock`, up or `down`.
fn far(clock: &ManualClock, down: bool) -> Far {
    Far {
        memory: mem(clock),
        down: Arc::new(AtomicBool::new(down)),
    }
}

/// 10 a minute, a burst of 10: no refill during the test.
fn rule() -> Rule {
    Rule::new("per-org", Limit::gcra(Rate::per_minute(10), 10)).unwrap()
}

#[tokio::test]
async fn both_tiers_must_admit_and_a_refusal_is_refunded() {
    let clock = ManualClock::starting_at(1);
    let global = far(&clock, false);
    // Two regions, each its own regional store, one global store whose
    // limit (the same rule: 10) caps them together.
    let eu = Tiered::new(mem(&clock), global.clone())
        .limiter(&rule())
        .unwrap();
    let us = Tiered::new(mem(&clock), global.clone())
        .limiter(&rule())
        .unwrap();
    for _ in 0..6 {
        assert!(eu.decide(b"acme", 1).await.unwrap().is_allowed());
    }
    for _ in 0..4 {
        assert!(us.decide(b"acme", 1).await.unwrap().is_allowed());
    }
    // The global budget is spent: both regions refuse, with its wait.
    let refused = us.decide(b"acme", 1).await.unwrap();
    assert!(!refused.is_allowed());
    assert_eq!(refused.remaining, 0);
    // The US region's own budget was refunded: it still has 6.
    assert_eq!(us.regional().decide(b"acme", 0).await.unwrap().remaining, 6);
    // A cost above capacity is never admitted, in either tier.
    assert!(matches!(
        eu.decide(b"acme", 11).await.unwrap().outcome,
        tollgate_core::Outcome::Never
    ));
}

#[tokio::test]
async fn without_the_global_store_the_regional_limit_holds() {
    let clock = ManualClock::starting_at(1);
    let global = far(&clock, false);
    let eu = Tiered::new(mem(&clock), global.clone())
        .limiter(&rule())
        .unwrap();
    global.down.store(true, Ordering::Relaxed);
    let mut admitted = 0;
    for _ in 0..20 {
        if eu.decide(b"acme", 1).await.unwrap().is_allowed() {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 10);
}

#[tokio::test]
async fn a_leased_global_tier_decides_mostly_locally() {
    let clock = ManualClock::starting_at(1);
    let global = far(&clock, false);
    let rule = Rule::new("per-org", Limit::gcra(Rate::per_second(1_000), 1_000)).unwrap();
    let leased = HotKeys::new()
        .min_batch(16)
        .max_batch(64)
        .over_with_clock(global, clock.clone())
        .unwrap();
    let eu = Tiered::new(mem(&clock), leased).limiter(&rule).unwrap();
    for _ in 0..100 {
        assert!(eu.decide(b"acme", 1).await.unwrap().is_allowed());
    }
    // A first lease of 16, then 32, 64: the far store was asked 3 times.
    assert_eq!(eu.global().stats().store_calls, 3);
    // The regional store counted every request exactly.
    assert_eq!(
        eu.regional().decide(b"acme", 0).await.unwrap().remaining,
        900
    );
}

#[tokio::test]
async fn a_regional_failure_gives_the_global_units_back() {
    let clock = ManualClock::starting_at(1);
    let regional = far(&clock, true);
    let global = mem(&clock);
    let eu = Tiered::new(regional, global.clone())
        .limiter(&rule())
        .unwrap();
    assert!(eu.decide(b"acme", 1).await.is_err());
    assert_eq!(eu.global().decide(b"acme", 0).await.unwrap().remaining, 10);
}

/// Fleet review M1: both tiers bound the same rule, so "regional limits
/// plus a coarse global limit" could not be said: the global limit always
/// equalled a region's. `global_rule` gives the global tier its own.
#[tokio::test]
async fn the_global_tier_can_have_a_limit_of_its_own() {
    let clock = ManualClock::starting_at(1);
    let global = far(&clock, false);
    // 10 per region, 15 across both.
    let tiered = |regional| {
        Tiered::new(regional, global.clone())
            .global_rule(|r: &Rule| Rule::new(r.name(), Limit::gcra(Rate::per_minute(15), 15)))
    };
    let eu = tiered(mem(&clock)).limiter(&rule()).unwrap();
    let us = tiered(mem(&clock)).limiter(&rule()).unwrap();
    let admitted = |l: &tollgate_redis::TieredLimiter<_, _>| {
        let l = l.clone();
        async move {
            let mut n = 0;
            for _ in 0..20 {
                n += u32::from(l.decide(b"acme", 1).await.unwrap().is_allowed());
            }
            n
        }
    };
    assert_eq!(admitted(&eu).await, 10, "a region's own limit");
    assert_eq!(admitted(&us).await, 5, "what the global limit has left");
    // A global rule that renames the rule is refused when it is bound.
    let err = Tiered::new(mem(&clock), global.clone())
        .global_rule(|_r: &Rule| Rule::new("other", Limit::gcra(Rate::per_minute(1), 1)))
        .limiter(&rule())
        .err()
        .unwrap();
    assert_eq!(err.field(), "global_rule");
}

/// Fleet review M1, on Redis: two regions, each with a regional Redis (a
/// prefix of its own here) and the one global Redis 50 ms away (the
/// delaying proxy), leased through `HotKeys` per region. A region's limit
/// (100 an hour) and the global one (150 across both) each hold, and
/// most decisions do not wait for the global round trip.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regional_and_global_limits_hold_with_the_global_tier_far_and_leased() {
    use std::time::Duration;
    use tollgate_redis::testing::{unique_prefix, Delayed, Server};
    use tollgate_redis::RedisStore;
    let Some(server) = Server::start() else {
        return;
    };
    let far = Delayed::start(server.port, Duration::from_millis(50)).await;
    let global_prefix = unique_prefix();
    let store = |url: &str, prefix: &str| {
        RedisStore::builder(url)
            .prefix(prefix)
            .timeout(Duration::from_secs(1))
            .build()
            .unwrap()
    };
    let region = |name: &str| {
        let regional = store(&server.url(), &format!("{global_prefix}-{name}"));
        // Leases of a second, 10 units at least: the far tier's round
        // trip (100 ms) is paid once a lease, not once a decision.
        let global = HotKeys::new()
            .ttl(Duration::from_secs(1))
            .min_batch(10)
            .max_share(0.1)
            .over(store(&far.url(), &global_prefix))
            .unwrap();
        Tiered::new(regional, global)
            .global_rule(|r: &Rule| Rule::new(r.name(), Limit::gcra(Rate::per_hour(150), 150)))
            .limiter(&Rule::new("per-key", Limit::gcra(Rate::per_hour(100), 100)).unwrap())
            .unwrap()
    };
    let (eu, us) = (region("eu"), region("us"));
    let mut admitted = Vec::new();
    for l in [&eu, &us] {
        let mut n = 0u32;
        for _ in 0..120 {
            n += u32::from(l.decide(b"acme", 1).await.unwrap().is_allowed());
        }
        admitted.push(n);
    }
    let admitted = [
        admitted.first().copied().unwrap(),
        admitted.last().copied().unwrap(),
    ];
    // EU: its region's 100. US: what the global limit has left (50), less
    // what EU's last lease still holds unspent (at most 10% of 150).
    assert_eq!(admitted[0], 100, "the regional limit");
    assert!(
        (35..=50).contains(&admitted[1]),
        "US got {} of the global limit's last 50",
        admitted[1]
    );
    assert!(
        admitted[0] + admitted[1] <= 150,
        "{admitted:?} past the global limit"
    );
    // Most decisions answered from the global lease, not its round trip.
    for (name, l) in [("eu", &eu), ("us", &us)] {
        let stats = l.global().stats();
        eprintln!("{name}: {stats:?}");
        assert!(
            stats.waits * 4 <= stats.decisions,
            "{name}: {stats:?}: a quarter of decisions or more waited for the far tier"
        );
    }
}
