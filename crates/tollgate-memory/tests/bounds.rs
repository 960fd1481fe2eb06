//! What the memory store does with idle keys and when it is full.
#![allow(missing_docs, clippy::unwrap_used, clippy::arithmetic_side_effects)]

use std::time::Duration;

use tollgate_core::{
    ConcurrencyLimiter, ConcurrencyRule, Limit, Limiter, ManualClock, Rate, Rule, Store,
};
use tollgate_memory::{MemoryConcurrencyLimiter, MemoryStore};

fn store(clock: &ManualClock, max_keys: usize, shards: usize) -> MemoryStore<ManualClock> {
    MemoryStore::builder()
        .clock(clock.clone())
        .max_keys(max_keys)
        .shards(shards)
        .build()
        .unwrap()
}

/// Concurrency rule "conc" of `max` permits, bound to `s`.
fn semaphore(s: &MemoryStore<ManualClock>, max: u32) -> MemoryConcurrencyLimiter<ManualClock> {
    s.concurrency_limiter(&ConcurrencyRule::new("conc", max, Duration::from_secs(30)).unwrap())
        .unwrap()
}

fn gcra() -> Rule {
    Rule::new("per-ip", Limit::gcra(Rate::per_second(1), 3)).unwrap()
}

#[test]
fn builder_rejects_bad_bounds_naming_the_field() {
    let err = MemoryStore::builder().max_keys(0).build().unwrap_err();
    assert_eq!(err.field(), "max_keys");
    for shards in [0, 3, 8192] {
        let err = MemoryStore::builder().shards(shards).build().unwrap_err();
        assert_eq!(err.field(), "shards");
    }
}

#[test]
fn rebinding_goes_on_from_states_that_keep_their_meaning() {
    let clock = ManualClock::new();
    let s = store(&clock, 1_000, 4);
    let old = s.limiter(&gcra()).unwrap();
    for _ in 0..3 {
        assert!(old.decide_now(b"k", 1).is_allowed());
    }
    assert!(!old.decide_now(b"k", 1).is_allowed());
    // Through a rebinding handle, new parameters replace the binding and
    // go on from the key's state: the time at which its budget is whole
    // again (3 s), so a reload is never a fresh burst...
    let re = s.rebinding();
    let faster = Rule::new("per-ip", Limit::gcra(Rate::per_second(10), 3)).unwrap();
    let new = re.limiter(&faster).unwrap();
    assert!(!new.decide_now(b"k", 1).is_allowed());
    clock.advance(Duration::from_millis(2_700));
    assert!(!new.decide_now(b"k", 1).is_allowed());
    // ...and then runs at the new rate: 3 s less its burst's 200 ms.
    clock.advance(Duration::from_millis(100));
    assert!(new.decide_now(b"k", 1).is_allowed());
    // The old limiter (a request decided before the reload) shares the
    // states: what the new one spent is spent for it too (a fresh state
    // would show 3).
    assert_eq!(old.decide_now(b"k", 0).remaining, 2);
    // The plain store binds the new parameters now, and still refuses
    // yet others.
    assert!(s.limiter(&faster).is_ok());
    let third = Rule::new("per-ip", Limit::gcra(Rate::per_second(5), 3)).unwrap();
    assert_eq!(s.limiter(&third).unwrap_err().field(), "name");
    // A state whose meaning changes starts fresh: another algorithm...
    let window = Rule::new("per-ip", Limit::fixed_window(1, Duration::from_secs(60))).unwrap();
    let w = re.limiter(&window).unwrap();
    assert!(w.decide_now(b"k", 1).is_allowed());
    assert!(!w.decide_now(b"k", 1).is_allowed());
    // ...or a window of another length; the same length keeps its count.
    let same = Rule::new("per-ip", Limit::fixed_window(5, Duration::from_secs(60))).unwrap();
    let same = re.limiter(&same).unwrap();
    assert_eq!(same.decide_now(b"k", 0).remaining, 4);
    let longer = Rule::new("per-ip", Limit::fixed_window(5, Duration::from_secs(120))).unwrap();
    let longer = re.limiter(&longer).unwrap();
    assert_eq!(longer.decide_now(b"k", 0).remaining, 5);
    // A name bound to a rate rule is not rebound to another kind.
    let conc = ConcurrencyRule::new("per-ip", 1, Duration::from_secs(1)).unwrap();
    assert_eq!(re.concurrency_limiter(&conc).unwrap_err().field(), "name");
}

#[test]
fn a_replaced_binding_gives_its_keys_back_when_its_last_limiter_goes() {
    let clock = ManualClock::new();
    let s = store(&clock, 1_000, 4);
    let old = s.limiter(&gcra()).unwrap();
    for k in 0..10u32 {
        old.decide_now(&k.to_be_bytes(), 1);
    }
    assert_eq!(s.key_count(), 10);
    // Another algorithm: a fresh table; the old one lives on with `old`.
    let window = Rule::new("per-ip", Limit::fixed_window(1, Duration::from_secs(60))).unwrap();
    let new = s.rebinding().limiter(&window).unwrap();
    new.decide_now(b"x", 1);
    assert_eq!(s.key_count(), 11);
    drop(old);
    assert_eq!(s.key_count(), 1);
    // A table sharing its shards keeps them counted until the last goes.
    let wider = Rule::new("per-ip", Limit::fixed_window(5, Duration::from_secs(60))).unwrap();
    let shared = s.rebinding().limiter(&wider).unwrap();
    drop(new);
    assert_eq!(s.key_count(), 1);
    assert_eq!(shared.decide_now(b"x", 0).remaining, 4);
}

#[test]
fn a_rule_name_cannot_be_rebound_with_other_parameters() {
    let s = MemoryStore::new();
    s.limiter(&gcra()).unwrap();
    let other = Rule::new("per-ip", Limit::gcra(Rate::per_second(2), 3)).unwrap();
    assert_eq!(s.limiter(&other).unwrap_err().field(), "name");
    let conc = ConcurrencyRule::new("per-ip", 1, Duration::from_secs(1)).unwrap();
    assert_eq!(s.concurrency_limiter(&conc).unwrap_err().field(), "name");
}

#[test]
fn denials_and_peeks_of_unknown_keys_store_nothing() {
    let clock = ManualClock::starting_at(1);
    let s = store(&clock, 100, 1);
    let l = s.limiter(&gcra()).unwrap();
    for i in 0..50u32 {
        l.decide_now(&i.to_be_bytes(), 0); // peek
        l.decide_now(&i.to_be_bytes(), 4); // never
        l.refund_now(&i.to_be_bytes(), 1);
    }
    assert_eq!(s.key_count(), 0);
}

#[test]
fn idle_keys_are_reclaimed_without_any_call() {
    let clock = ManualClock::starting_at(1);
    let s = store(&clock, 1_000_000, 4);
    let l = s.limiter(&gcra()).unwrap();
    // A flood of one-off keys...
    for i in 0..100_000u32 {
        assert!(l.decide_now(&i.to_be_bytes(), 1).is_allowed());
    }
    // Growth sweeps find nothing idle yet (the clock has not moved).
    assert_eq!(s.key_count(), 100_000);
    // ...then the flood stops; time passes; ordinary traffic from a few
    // clients continues. Their decisions sweep the flood away.
    clock.advance(Duration::from_secs(120));
    for round in 0..200_000u32 {
        l.decide_now(&(round % 7).to_be_bytes(), 1);
        if round % 1_000 == 0 {
            clock.advance(Duration::from_millis(100));
        }
    }
    assert!(
        s.key_count() <= 7,
        "{} keys still held after the flood went idle",
        s.key_count()
    );
    // Reclaiming idle keys changed no decision: a reclaimed key is fresh.
    let d = l.decide_now(&5u32.to_be_bytes(), 0);
    assert!(d.remaining <= 3);
    let d = l.decide_now(&99_999u32.to_be_bytes(), 0);
    assert_eq!(d.remaining, 3);
}

#[test]
fn full_store_decides_new_keys_against_a_shared_overflow_state() {
    let clock = ManualClock::starting_at(1);
    let s = store(&clock, 10, 1);
    let l = s.limiter(&gcra()).unwrap();
    for i in 0..10u32 {
        assert!(l.decide_now(&i.to_be_bytes(), 1).is_allowed());
    }
    assert_eq!(s.key_count(), 10);
    // The store is full and nothing is idle: new keys share one budget of 3.
    let admitted = (10..1_010u32)
        .filter(|i| l.decide_now(&i.to_be_bytes(), 1).is_allowed())
        .count();
    assert_eq!(
        admitted, 3,
        "the overflow group got more than one key's limit"
    );
    assert_eq!(s.key_count(), 10, "the bound was exceeded");
    assert_eq!(s.overflowed(), 1_000);
    // Keys already held keep their own budgets.
    assert_eq!(l.decide_now(&0u32.to_be_bytes(), 0).remaining, 2);
    assert!(l.decide_now(&0u32.to_be_bytes(), 2).is_allowed());
    // Once held keys go idle, a new key gets its own slot again.
    clock.advance(Duration::from_secs(10));
    assert!(l.decide_now(b"newcomer", 3).is_allowed());
    assert!(s.key_count() <= 10);
    assert!(!l.decide_now(b"newcomer", 1).is_allowed());
    assert_eq!(s.overflowed(), 1_000);
}

#[test]
fn the_bound_is_shared_by_all_rules_of_a_store() {
    let clock = ManualClock::starting_at(1);
    let s = store(&clock, 5, 1);
    let a = s.limiter(&gcra()).unwrap();
    let b = s
        .limiter(&Rule::new("per-user", Limit::fixed_window(3, Duration::from_secs(1))).unwrap())
        .unwrap();
    for i in 0..5u32 {
        a.decide_now(&i.to_be_bytes(), 1);
        b.decide_now(&i.to_be_bytes(), 1);
    }
    assert_eq!(s.key_count(), 5);
    assert!(s.overflowed() >= 5);
}

#[test]
fn purge_idle_drops_exactly_the_idle_keys() {
    let clock = ManualClock::starting_at(1);
    let s = store(&clock, 100, 2);
    let l = s.limiter(&gcra()).unwrap();
    l.decide_now(b"short", 1);
    clock.advance(Duration::from_millis(500));
    l.decide_now(b"long", 3);
    clock.advance(Duration::from_millis(600));
    // "short" refilled at 1 s; "long" needs until 3.5 s.
    assert_eq!(s.purge_idle(), 1);
    assert_eq!(s.key_count(), 1);
    assert!(!l.decide_now(b"long", 3).is_allowed());
}

#[test]
fn leases_granted_while_full_can_be_released() {
    let clock = ManualClock::starting_at(1);
    let s = store(&clock, 1, 1);
    let sem = semaphore(&s, 2);
    let held = sem.acquire_now(b"a", 1, u32::MAX).lease.unwrap();
    let over = sem.acquire_now(b"b", 2, u32::MAX).lease.unwrap();
    assert_eq!(s.key_count(), 1);
    // "c" shares the overflow state with "b": nothing left.
    assert!(sem.acquire_now(b"c", 1, u32::MAX).lease.is_none());
    sem.release_now(b"b", over);
    assert!(sem.acquire_now(b"c", 1, u32::MAX).lease.is_some());
    sem.release_now(b"a", held);
}

#[test]
fn a_release_finds_its_key_by_the_lease_alone() {
    // The concurrency layer passes no key when the store says it releases
    // by lease: each lease goes back to the key (or the overflow state)
    // that granted it, whatever key comes with it.
    let clock = ManualClock::starting_at(1);
    let s = store(&clock, 2, 1);
    let sem = semaphore(&s, 2);
    assert!(sem.releases_by_lease());
    let a = sem.acquire_now(b"a", 2, u32::MAX).lease.unwrap();
    let b = sem.acquire_now(b"b", 1, u32::MAX).lease.unwrap();
    // Full: "c" and "d" share the overflow state.
    let c = sem.acquire_now(b"c", 2, u32::MAX).lease.unwrap();
    assert!(sem.acquire_now(b"d", 1, u32::MAX).lease.is_none());
    assert_ne!(a.id, b.id);
    sem.release_now(b"", a);
    assert_eq!((sem.held_now(b"a"), sem.held_now(b"b")), (0, 1));
    sem.release_now(b"a", c);
    assert_eq!(sem.held_now(b"b"), 1);
    assert!(sem.acquire_now(b"d", 2, u32::MAX).lease.is_some());
    sem.release_now(b"c", b);
    assert_eq!(sem.held_now(b"b"), 0);
}

#[test]
fn idle_keys_of_a_quiet_rule_do_not_hold_the_budget_of_a_busy_one() {
    let clock = ManualClock::starting_at(1);
    let s = store(&clock, 1_000, 4);
    let quiet = s
        .limiter(&Rule::new("quiet", Limit::gcra(Rate::per_second(1), 3)).unwrap())
        .unwrap();
    let busy = s.limiter(&gcra()).unwrap();
    for i in 0..1_000u32 {
        quiet.decide_now(&i.to_be_bytes(), 1);
    }
    assert_eq!(s.key_count(), 1_000);
    // An hour later the quiet rule's keys are all idle; a crowd of new
    // clients of the busy rule each get their own budget.
    clock.advance(Duration::from_secs(3_600));
    for i in 0..1_000u32 {
        let key = (1_000_000 + i).to_be_bytes();
        assert!(busy.decide_now(&key, 1).is_allowed(), "client {i}");
    }
    assert_eq!(s.overflowed(), 0, "every new client got its own slot");
    assert_eq!(s.key_count(), 1_000);
}

#[test]
fn a_key_leaving_the_overflow_state_keeps_what_it_spent_there() {
    let clock = ManualClock::starting_at(1);
    let s = store(&clock, 1, 1);
    let l = s.limiter(&gcra()).unwrap(); // 1 per second, bursts of 3
    assert!(l.decide_now(b"a", 1).is_allowed()); // "a" holds the only slot
    assert!(l.decide_now(b"b", 3).is_allowed()); // "b" spends its burst in overflow
    assert_eq!(s.overflowed(), 1);
    // 1.5 s later "a" is idle and frees the slot; "b" moves into it but
    // carries its spending: 1.5 units have come back, not a whole burst.
    clock.advance(Duration::from_millis(1_500));
    assert!(!l.decide_now(b"b", 2).is_allowed());
    assert!(l.decide_now(b"b", 1).is_allowed());
    assert_eq!(s.key_count(), 1);
}

#[test]
fn only_keys_decided_in_the_overflow_state_carry_its_spending() {
    let clock = ManualClock::starting_at(1);
    let s = store(&clock, 1, 1);
    let l = s.limiter(&gcra()).unwrap(); // 1 per second, bursts of 3
    assert!(l.decide_now(b"a", 1).is_allowed());
    assert!(l.decide_now(b"b", 3).is_allowed()); // overflow, spent
    clock.advance(Duration::from_millis(1_500)); // "a" idle, slot free
                                                 // A key never seen before gets its whole burst, whatever "b" spent;
                                                 // peeking at unknown keys stores nothing.
    assert_eq!(l.decide_now(b"newcomer", 0).remaining, 3);
    assert_eq!(l.decide_now(b"someone", 0).remaining, 3);
    assert!(l.decide_now(b"newcomer", 3).is_allowed());
    assert_eq!(s.key_count(), 1);
}

#[test]
fn leases_from_the_overflow_state_are_released_there_after_a_slot_frees() {
    let clock = ManualClock::starting_at(1);
    let s = store(&clock, 1, 1);
    let sem = semaphore(&s, 1);
    let a = sem.acquire_now(b"a", 1, u32::MAX).lease.unwrap();
    let b = sem.acquire_now(b"b", 1, u32::MAX).lease.unwrap(); // overflow
    sem.release_now(b"a", a); // "a" idle, its slot can go
    sem.release_now(b"b", b); // released where it was granted
    assert_eq!(s.key_count(), 1, "releasing stored nothing new");
    // Nothing is held any more: a new key gets its permit.
    assert!(sem.acquire_now(b"c", 1, u32::MAX).lease.is_some());
}

/// A clock whose wall time is far from its monotonic time, as
/// `SystemClock`'s is (process uptime vs Unix time).
#[derive(Clone)]
struct TwoClocks(ManualClock);

impl tollgate_core::Clock for TwoClocks {
    fn now(&self) -> u64 {
        self.0.now()
    }
    fn unix_now(&self) -> u64 {
        self.0.now() + 1_796_000_000_000_000_000
    }
}

#[test]
fn a_full_store_sweeping_for_a_quota_keeps_every_rate_key() {
    use tollgate_core::calendar::{Offset, Period};
    use tollgate_core::{QuotaRule, QuotaStore};
    let clock = ManualClock::starting_at(1_000_000_000);
    let s = MemoryStore::builder()
        .clock(TwoClocks(clock.clone()))
        .max_keys(2)
        .shards(1)
        .build()
        .unwrap();
    let rate = s.limiter(&gcra()).unwrap();
    let quota = s
        .quota_limiter(&QuotaRule::new("daily", &[(Period::Day, 5)], Offset::UTC).unwrap())
        .unwrap();
    // Two rate keys fill the store, each with budget spent.
    for key in [&b"a"[..], b"b"] {
        for _ in 0..3 {
            assert!(rate.decide_now(key, 1).is_allowed());
        }
    }
    // A quota key finds it full: the store-wide sweep runs, each table on
    // its own time. Seen on the wall clock (a 2026 date), the rate keys'
    // monotonic states would look decades old and be dropped as idle.
    // Nothing is idle, so the quota key is not held (and not decided).
    clock.advance(Duration::from_millis(200));
    assert!(quota.consume_now(b"q", 1).is_err());
    for key in [&b"a"[..], b"b"] {
        assert!(
            !rate.decide_now(key, 1).is_allowed(),
            "key {key:?} lost its state"
        );
    }
}

#[test]
fn refunds_and_peeks_of_unstored_keys_leave_a_flooded_overflow_state_alone() {
    let clock = ManualClock::starting_at(1);
    let s = store(&clock, 1, 1);
    let l = s.limiter(&gcra()).unwrap(); // 1 per second, bursts of 3
    assert!(l.decide_now(b"a", 1).is_allowed()); // "a" holds the only slot
    assert!(l.decide_now(b"b", 3).is_allowed()); // the overflow state is spent
    assert_eq!(s.overflowed(), 1);
    // During the flood, a refund for a key that is not stored (its slot
    // was swept while idle) must not credit the shared overflow state,
    // and a peek must neither read nor join it.
    for i in 0..20u32 {
        l.refund_now(&i.to_be_bytes(), 3);
        assert_eq!(l.decide_now(&(100 + i).to_be_bytes(), 0).remaining, 3);
    }
    assert_eq!(
        s.overflowed(),
        1,
        "refunds and peeks went to the overflow state"
    );
    assert!(
        !l.decide_now(b"c", 1).is_allowed(),
        "the flood got more than one key's limit"
    );
}

#[test]
fn a_full_store_never_lets_one_key_block_another_through_a_ladder() {
    use tollgate_core::algorithm::{Standing, Strike};
    use tollgate_core::EscalationRule;
    let clock = ManualClock::starting_at(1);
    let s = store(&clock, 1, 1);
    let d = Duration::from_secs;
    let ladder = s
        .escalation(&EscalationRule::new("ladder", 1, d(60), d(600), d(600)).unwrap())
        .unwrap();
    // "a" holds the only slot and gets itself blocked.
    assert!(matches!(
        ladder.strike_sync(b"a"),
        Some(Ok(Strike::Blocked { .. }))
    ));
    // Others, with no room to be stored, count nothing: no shared block.
    for k in [&b"abuser"[..], b"innocent", b"abuser"] {
        assert_eq!(
            ladder.strike_sync(k),
            Some(Ok(Strike::Counted { strikes: 0 }))
        );
        assert_eq!(ladder.standing_sync(k), Some(Ok(Standing::Clear)));
    }
    assert!(matches!(
        ladder.standing_sync(b"a"),
        Some(Ok(Standing::Blocked { .. }))
    ));
}

/// An exact answer (`decide_exact`) is never the full store's shared
/// overflow state's: a check whose answer must be true (an idempotency
/// marker, a used challenge) gets an error there, and is charged.
#[test]
fn a_full_store_gives_no_exact_answer_for_a_key_it_does_not_hold() {
    let clock = ManualClock::starting_at(1);
    let s = store(&clock, 2, 1);
    let l = s.limiter(&gcra()).unwrap();
    for k in [b"a", b"b"] {
        assert!(l.decide_exact_sync(k, 1).unwrap().unwrap().is_allowed());
    }
    let err = l.decide_exact_sync(b"c", 1).unwrap().unwrap_err();
    assert_eq!(err.kind(), tollgate_core::StoreErrorKind::Unavailable);
    // Keys it holds answer exactly, and a plain decision still answers.
    assert!(l.decide_exact_sync(b"a", 0).unwrap().is_ok());
    assert!(l.decide_sync(b"c", 1).unwrap().is_ok());
    // A store apart has keys of its own.
    let apart = s.apart(8);
    let m = apart.limiter(&gcra()).unwrap();
    assert!(m.decide_exact_sync(b"c", 1).unwrap().unwrap().is_allowed());
    assert_eq!(s.key_count(), 2);
}

/// Quota-bandwidth-retry review #19: a rebinding of a quota (a reload
/// that raises a daily budget) started every key's day afresh in memory,
/// where Redis keeps the usage. The same periods with other budgets now go
/// on from each key's usage; other periods start fresh.
#[test]
fn rebinding_a_quota_keeps_its_usage_when_only_budgets_change() {
    use tollgate_core::calendar::{Offset, Period};
    use tollgate_core::{QuotaRule, QuotaStore};
    let clock = ManualClock::starting_at(1_796_000_000_000_000_000);
    let s = MemoryStore::builder().clock(clock).build().unwrap();
    let daily = |budget| QuotaRule::new("daily", &[(Period::Day, budget)], Offset::UTC).unwrap();
    let old = s.quota_limiter(&daily(5)).unwrap();
    for _ in 0..4 {
        assert!(old.consume_now(b"k", 1).unwrap().is_allowed());
    }
    let re = s.rebinding();
    let raised = re.quota_limiter(&daily(8)).unwrap();
    // 4 of the day's 8 used: 4 left (a fresh day would leave 8).
    assert_eq!(
        raised
            .consume_now(b"k", 0)
            .unwrap()
            .periods()
            .first()
            .unwrap()
            .remaining,
        4
    );
    // Another period (a week) is another count: fresh.
    let weekly = QuotaRule::new("daily", &[(Period::Week, 8)], Offset::UTC).unwrap();
    let weekly = re.quota_limiter(&weekly).unwrap();
    assert_eq!(
        weekly
            .consume_now(b"k", 0)
            .unwrap()
            .periods()
            .first()
            .unwrap()
            .remaining,
        8
    );
}

/// Quota-bandwidth-retry review #7: a full store decided a new customer's
/// quota in its shard's overflow state, one window shared by every
/// newcomer of the shard for the rest of the period: X was charged for Y's
/// calls (429s with a `Retry-After` of days), and a key that later got its
/// own slot went on from their usage. A quota is a contract: a key the
/// store cannot hold gets an error (the layer's `on_store_error` answers
/// and counts it), never a shared window, and once a slot frees it starts
/// with its own whole budget.
#[test]
fn a_full_store_never_decides_a_quota_in_a_shared_window() {
    use tollgate_core::calendar::{Offset, Period};
    use tollgate_core::{QuotaLimiter, QuotaRule, QuotaStore, StoreErrorKind};
    let clock = ManualClock::starting_at(1_796_000_000_000_000_000);
    let s = store(&clock, 2, 1);
    let daily = QuotaRule::new("daily", &[(Period::Day, 5)], Offset::UTC).unwrap();
    let q = s.quota_limiter(&daily).unwrap();
    for k in [b"a", b"b"] {
        assert!(q.consume_sync(k, 1).unwrap().unwrap().is_allowed());
    }
    // Full: "c" spends nothing of anyone's, and "d" is not charged for it.
    for k in [b"c", b"d"] {
        let err = q.consume_sync(k, 5).unwrap().unwrap_err();
        assert_eq!(err.kind(), StoreErrorKind::Unavailable, "{k:?}");
    }
    assert!(s.overflowed() >= 2, "the refusals are counted");
    // "a" is reset (nothing used: idle), and its slot goes to "c" at the
    // next sweep, with a whole day's budget.
    q.reset_now(b"a");
    clock.advance(Duration::from_millis(200));
    let d = q.consume_sync(b"c", 5).unwrap().unwrap();
    assert!(d.is_allowed(), "{d:?}");
    assert_eq!(d.periods().first().unwrap().remaining, 0);
    // "b" kept its own count throughout.
    let b = q.consume_sync(b"b", 0).unwrap().unwrap();
    assert_eq!(b.periods().first().unwrap().remaining, 4);
}

/// Quota review #5, in memory: a reload that moves a quota's offset (for
/// daylight saving time) goes on from each key's usage, as Redis does,
/// where a rebinding used to start every key's month afresh.
#[test]
fn rebinding_a_quota_to_another_offset_keeps_its_usage() {
    use tollgate_core::calendar::{unix_nanos, Offset, Period};
    use tollgate_core::{QuotaRule, QuotaStore};
    let clock = ManualClock::at_unix(unix_nanos(2026, 11, 10, 12, 0, 0));
    let s = MemoryStore::builder().clock(clock).build().unwrap();
    let monthly = |hours| {
        let offset = Offset::from_hours_minutes(hours, 0).unwrap();
        QuotaRule::new("monthly", &[(Period::Month, 1_000)], offset).unwrap()
    };
    let summer = s.quota_limiter(&monthly(-4)).unwrap();
    assert!(summer.consume_now(b"k", 30).unwrap().is_allowed());
    let winter = s.rebinding().quota_limiter(&monthly(-5)).unwrap();
    let d = winter.consume_now(b"k", 0).unwrap();
    assert_eq!(d.periods().first().unwrap().remaining, 970);
}

/// Issue 35: a process that goes quiet after a flood kept every key it
/// held — sweeps ran only as decisions went on — so memory never came
/// back. With `sweep_idle_every`, the store's own thread drops idle keys
/// with no request at all, and stops when the store is gone.
#[test]
fn a_quiet_store_s_sweeper_drops_idle_keys_without_a_request() {
    let err = MemoryStore::builder()
        .sweep_idle_every(Duration::from_millis(500))
        .build()
        .unwrap_err();
    assert_eq!(err.field(), "sweep_idle_every");
    let clock = ManualClock::starting_at(1);
    let s = MemoryStore::builder()
        .clock(clock.clone())
        .sweep_idle_every(Duration::from_secs(1))
        .build()
        .unwrap();
    let l = s.limiter(&gcra()).unwrap();
    for i in 0..1_000u32 {
        assert!(l.decide_now(&i.to_be_bytes(), 1).is_allowed());
    }
    assert_eq!(s.key_count(), 1_000);
    // Not idle yet (a burst of 3 at 1 a second refills in 3 s): kept
    // through a sweep.
    std::thread::sleep(Duration::from_millis(1_300));
    assert_eq!(s.key_count(), 1_000);
    clock.advance(Duration::from_secs(5));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while s.key_count() != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "{} keys left",
            s.key_count()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_pinned_key_is_one_count_for_every_caller() {
    // A layer whose every request has one key pins it: the store then
    // counts the key in a word of its own, and every other caller of the
    // same binding (an acquire through the store, a release of either's
    // lease, a count) reads and writes that word.
    let clock = ManualClock::starting_at(1);
    let s = store(&clock, 2, 1);
    let sem = semaphore(&s, 3);
    // Held through the table before the pin: moved with it.
    let before = sem.acquire_now(b"global", 1, u32::MAX).lease.unwrap();
    assert_eq!(s.key_count(), 1);
    let pinned = sem.pin(b"global").unwrap();
    assert_eq!(pinned.held(), 1);
    assert_eq!(
        s.key_count(),
        0,
        "a pinned key is outside the table's bound"
    );
    // Another binding of the rule pins the same word.
    let again = semaphore(&s, 3).pin(b"global").unwrap();
    let through_pin = again.acquire(1, u32::MAX).lease.unwrap();
    let through_store = sem.acquire_now(b"global", 1, u32::MAX).lease.unwrap();
    assert_eq!((pinned.held(), sem.held_now(b"global")), (3, 3));
    assert!(!pinned.acquire(1, u32::MAX).decision.is_allowed());
    assert!(sem.acquire_now(b"global", 1, u32::MAX).lease.is_none());
    // Leases go back either way.
    sem.release_now(b"global", through_pin);
    pinned.release(through_store);
    sem.release_now(b"", before);
    assert_eq!((pinned.held(), sem.held_now(b"global")), (0, 0));
    // Other keys are kept as before, and a pinned key is never swept.
    let other = sem.acquire_now(b"other", 2, u32::MAX).lease.unwrap();
    assert_eq!(sem.held_now(b"other"), 2);
    sem.release_now(b"other", other);
    assert!(pinned.acquire(3, u32::MAX).lease.is_some());
    assert_eq!(s.purge_idle(), 1);
    assert_eq!(sem.held_now(b"global"), 3);
}

#[test]
fn a_rule_pins_a_bounded_number_of_keys_and_a_checking_handle_none() {
    // Pins are never swept and outside `max_keys`: a caller that pinned
    // a key a client sends would grow them without bound. Past 16 a key
    // stays in the table, counted as before.
    let clock = ManualClock::starting_at(1);
    let s = store(&clock, 100, 4);
    let sem = semaphore(&s, 2);
    for i in 0..16 {
        assert!(sem.pin(format!("k{i}").as_bytes()).is_some(), "{i}");
    }
    assert!(sem.pin(b"k0").is_some(), "a pinned key again is its pin");
    assert!(sem.pin(b"k16").is_none());
    let lease = sem.acquire_now(b"k16", 2, u32::MAX).lease.unwrap();
    assert!(sem.acquire_now(b"k16", 1, u32::MAX).lease.is_none());
    assert_eq!(s.key_count(), 1);
    sem.release_now(b"k16", lease);
    // A checking handle (a reload's trial build) changes nothing of the
    // store's: its binding pins nothing, and the key stays in the table.
    let other = s
        .concurrency_limiter(&ConcurrencyRule::new("other", 2, Duration::from_secs(30)).unwrap())
        .unwrap();
    let held = other.acquire_now(b"service", 1, u32::MAX).lease.unwrap();
    let checking = s.checking();
    let trial = checking
        .concurrency_limiter(&ConcurrencyRule::new("other", 2, Duration::from_secs(30)).unwrap())
        .unwrap();
    assert!(trial.pin(b"service").is_none());
    assert_eq!(s.key_count(), 2);
    other.release_now(b"service", held);
}
