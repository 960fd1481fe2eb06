//! Quotas: calendar periods on a manual clock set to dates.

use super::*;

/// The pure [`Quota`](crate::Quota), applied to per-key states kept here:
/// what a [`QuotaStore`] must answer. A refund answers the usage after it,
/// a reset whole budgets (grants forgotten), as [`QuotaLimiter`] says.
#[derive(Debug)]
pub struct QuotaReference {
    quota: crate::Quota,
    states: HashMap<Vec<u8>, crate::QuotaState>,
}

/// One call to a [`QuotaLimiter`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuotaOp {
    /// [`consume`](QuotaLimiter::consume) this cost (0 reads).
    Consume(u64),
    /// [`refund`](QuotaLimiter::refund) this cost.
    Refund(u64),
    /// [`reset`](QuotaLimiter::reset) the key.
    Reset,
    /// [`grant`](QuotaLimiter::grant) this many units.
    Grant(u64),
}

impl QuotaReference {
    /// A reference for `rule`, every key fresh.
    pub fn new(rule: &QuotaRule) -> Self {
        Self {
            quota: rule.quota().clone(),
            states: HashMap::new(),
        }
    }

    /// What the pure quota answers `op` for `key` at `now` (Unix ns).
    pub fn apply(&mut self, key: &[u8], now: u64, op: QuotaOp) -> QuotaDecision {
        let q = &self.quota;
        let s = self.states.entry(key.to_vec()).or_default();
        match op {
            QuotaOp::Consume(cost) => q.decide(s, now, cost),
            QuotaOp::Refund(cost) => {
                q.refund(s, now, cost);
                q.decide(s, now, 0)
            }
            QuotaOp::Reset => {
                *s = crate::QuotaState::default();
                q.decide(s, now, 0)
            }
            QuotaOp::Grant(units) => q.grant(s, now, units),
        }
    }
}

/// Runs `op` for `key` on `limiter`.
pub async fn quota_call<L: QuotaLimiter>(limiter: &L, key: &[u8], op: QuotaOp) -> QuotaDecision {
    let answer = match op {
        QuotaOp::Consume(cost) => limiter.consume(key, cost).await,
        QuotaOp::Refund(cost) => limiter.refund(key, cost).await,
        QuotaOp::Reset => limiter.reset(key).await,
        QuotaOp::Grant(units) => limiter.grant(key, units).await,
    };
    answer.unwrap_or_else(|e| panic!("{op:?} for {key:?}: {e}"))
}

/// Runs `op` for `key` on `limiter` and on `reference` at the clock's
/// time, and asserts they answer alike; `at` says where in a trace.
pub async fn quota_check<L: QuotaLimiter>(
    limiter: &L,
    reference: &mut QuotaReference,
    clock: &ManualClock,
    key: &[u8],
    op: QuotaOp,
    at: &str,
) -> QuotaDecision {
    let now = crate::Clock::unix_now(clock);
    let got = quota_call(limiter, key, op).await;
    let want = reference.apply(key, now, op);
    assert_eq!(
        got,
        want,
        "quota {} {at}: {op:?} for {:?} at {}",
        limiter.rule().name(),
        String::from_utf8_lossy(key),
        civil(now)
    );
    got
}

/// `now` as a readable UTC date and time, for messages.
fn civil(now: u64) -> String {
    let secs = now / 1_000_000_000;
    let (y, m, d) = crate::calendar::civil_from_days((secs / 86_400) as i64);
    let s = secs % 86_400;
    format!(
        "{y}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:09}Z",
        s / 3_600,
        s / 60 % 60,
        s % 60,
        now % 1_000_000_000
    )
}

fn quota_rule(name: &str, periods: &[(Period, u64)], zone: impl Into<Zone>) -> QuotaRule {
    QuotaRule::new(name, periods, zone).unwrap()
}

/// Every quota scenario: traces across the ends of a day, an ISO week,
/// months of 28, 29, 30 and 31 days, a leap day and years, in UTC and at
/// +09:00 and −05:00; the periods' lengths as the calendar has them; a
/// trace over two years; and [`run_quota_at`] at [`UNIX_2026`] and just
/// after the epoch. Each
/// scenario gets a fresh store built by `make` around a manual clock set
/// to its date (the Unix time, in ns).
pub async fn run_quota<S: QuotaStore>(make: impl Fn(ManualClock) -> S) {
    for (label, boundary, zone) in quota_boundaries() {
        let clock = ManualClock::at_unix(boundary - 3_600 * SECOND);
        quota_across_a_boundary(&make(clock.clone()), &clock, label, zone).await;
    }
    let clock = ManualClock::at_unix(0);
    quota_zone_moves(&make(clock.clone()), &clock).await;
    let clock = ManualClock::at_unix(crate::calendar::unix_nanos(2023, 12, 20, 9, 30, 0));
    quota_over_two_years(&make(clock.clone()), &clock).await;
    let clock = ManualClock::at_unix(UNIX_2026);
    quota_periods_follow_the_calendar(&make(clock.clone()), &clock).await;
    run_quota_at(&make, UNIX_2026).await;
    run_quota_at(make, 1_000_000_000).await;
}

/// The quota scenarios that hold from any Unix time `start` (such as
/// [`UNIX_2026`], or the epoch itself): refunds, grants and resets; costs
/// above a budget; budgets of 2⁵² and grants as large; independent keys and rules; a
/// random trace in steps of seconds, the clock also going back.
pub async fn run_quota_at<S: QuotaStore>(make: impl Fn(ManualClock) -> S, start: u64) {
    let clock = ManualClock::at_unix(start);
    quota_refund_grant_reset_and_never(&make(clock.clone()), &clock).await;
    let clock = ManualClock::at_unix(start);
    quota_large_budgets(&make(clock.clone()), &clock).await;
    let clock = ManualClock::at_unix(start);
    quota_keys_and_rules_are_independent(&make(clock.clone()), &clock).await;
    let clock = ManualClock::at_unix(start);
    let rule = quota_rule(
        "quota-trace",
        &[(Period::Minute, 7), (Period::Hour, 40), (Period::Day, 90)],
        Offset::UTC,
    );
    let trace = Trace {
        seed: 0x9007a,
        steps: 300,
        unit: SECOND,
        backwards: true,
    };
    quota_random_trace(&make(clock.clone()), &clock, &rule, trace).await;
}

/// The boundaries the suite crosses: a label, the instant (Unix ns) a
/// period ends at, and the offset of the quota's periods.
fn quota_boundaries() -> Vec<(&'static str, u64, Zone)> {
    use crate::calendar::unix_nanos as at;
    let tokyo = Offset::from_hours_minutes(9, 0).unwrap();
    let new_york = Offset::from_hours_minutes(-5, 0).unwrap();
    let utc = Offset::UTC;
    let h = 3_600 * SECOND;
    let fixed = [
        ("the end of a day", at(2026, 12, 2, 24, 0, 0), utc),
        ("the end of an ISO week", at(2026, 12, 7, 0, 0, 0), utc),
        ("the end of a 31-day month", at(2026, 2, 1, 0, 0, 0), utc),
        ("the end of a 28-day month", at(2026, 3, 1, 0, 0, 0), utc),
        ("the start of a leap day", at(2024, 2, 29, 0, 0, 0), utc),
        ("the end of a 29-day month", at(2024, 3, 1, 0, 0, 0), utc),
        ("the end of a 30-day month", at(2026, 5, 1, 0, 0, 0), utc),
        ("the end of a leap year", at(2025, 1, 1, 0, 0, 0), utc),
        ("the end of a year", at(2027, 1, 1, 0, 0, 0), utc),
        // Local midnight at +09:00 is 15:00 UTC the day before.
        (
            "a month's end at +09:00",
            at(2026, 5, 1, 0, 0, 0) - 9 * h,
            tokyo,
        ),
        (
            "a week's end at +09:00",
            at(2026, 12, 7, 0, 0, 0) - 9 * h,
            tokyo,
        ),
        (
            "a leap day's end at +09:00",
            at(2024, 3, 1, 0, 0, 0) - 9 * h,
            tokyo,
        ),
        // Local midnight at −05:00 is 05:00 UTC.
        (
            "a year's end at -05:00",
            at(2027, 1, 1, 0, 0, 0) + 5 * h,
            new_york,
        ),
        (
            "a day's end at -05:00",
            at(2026, 12, 3, 0, 0, 0) + 5 * h,
            new_york,
        ),
        (
            "a 28-day month's end at -05:00",
            at(2026, 3, 1, 0, 0, 0) + 5 * h,
            new_york,
        ),
    ];
    // Without the `tz` feature, only the fixed offsets.
    #[cfg_attr(not(feature = "tz"), allow(unused_mut))]
    let mut all: Vec<(&'static str, u64, Zone)> = fixed
        .into_iter()
        .map(|(label, at, offset)| (label, at, offset.into()))
        .collect();
    // IANA zones on their transition days: local midnight after a
    // 23-hour day and a 25-hour one, and where midnight is skipped.
    #[cfg(feature = "tz")]
    for (label, end, zone) in [
        (
            "the end of Berlin's 23-hour day",
            at(2026, 3, 29, 22, 0, 0),
            "Europe/Berlin",
        ),
        (
            "the end of Berlin's 25-hour day",
            at(2026, 10, 25, 23, 0, 0),
            "Europe/Berlin",
        ),
        (
            "the end of New York's 25-hour day",
            at(2026, 11, 2, 5, 0, 0),
            "America/New_York",
        ),
        (
            "Havana's skipped midnight",
            at(2026, 3, 8, 5, 0, 0),
            "America/Havana",
        ),
        (
            "New York's repeated hour",
            at(2026, 11, 1, 6, 0, 0),
            "America/New_York",
        ),
        (
            "Havana's repeated midnight",
            at(2026, 11, 1, 5, 0, 0),
            "America/Havana",
        ),
    ] {
        all.push((label, end, Zone::iana(zone).unwrap()));
    }
    all
}

/// A quota whose zone moves — a reload from −04:00 to −05:00 for daylight
/// saving time — while a rolling deploy runs both: the instances on each
/// zone count one usage, a window counted at the old offset holds until
/// its end and then counts on through the period it falls in at the new
/// one; then December starts afresh. (The clock is set to dates here.)
pub async fn quota_zone_moves<S: QuotaStore>(store: &S, clock: &ManualClock) {
    use crate::calendar::unix_nanos as at;
    let rule = |hours| {
        let offset = Offset::from_hours_minutes(hours, 0).unwrap();
        quota_rule("moving", &[(Period::Day, 40), (Period::Month, 100)], offset)
    };
    let (summer, winter) = (rule(-4), rule(-5));
    let old = store.quota_limiter(&summer).unwrap();
    let new = store.rebinding().quota_limiter(&winter).unwrap();
    // One reference state, decided by whichever quota the call's is.
    let mut reference = QuotaReference::new(&summer);
    for (when, on_new, op) in [
        (at(2026, 11, 10, 12, 0, 0), false, QuotaOp::Consume(30)),
        (at(2026, 11, 10, 12, 0, 0), true, QuotaOp::Consume(5)),
        (at(2026, 11, 10, 12, 0, 1), false, QuotaOp::Consume(5)),
        (at(2026, 11, 10, 12, 0, 1), true, QuotaOp::Consume(0)),
        (at(2026, 11, 30, 20, 0, 0), true, QuotaOp::Consume(9)),
        (at(2026, 12, 1, 3, 59, 59), false, QuotaOp::Consume(1)),
        (at(2026, 12, 1, 4, 30, 0), true, QuotaOp::Consume(2)),
        (at(2026, 12, 1, 4, 30, 0), false, QuotaOp::Consume(1)),
        (at(2026, 12, 1, 4, 59, 59), true, QuotaOp::Refund(1)),
        (at(2026, 12, 1, 5, 0, 0), true, QuotaOp::Consume(3)),
        (at(2026, 12, 1, 5, 0, 0), false, QuotaOp::Consume(1)),
    ] {
        clock.set(when);
        reference.quota = if on_new { &winter } else { &summer }.quota().clone();
        let step = format!(
            "zone moved, {} {op:?} at {}",
            if on_new { "-05:00" } else { "-04:00" },
            civil(when)
        );
        if on_new {
            quota_check(&new, &mut reference, clock, b"dave", op, &step).await;
        } else {
            quota_check(&old, &mut reference, clock, b"dave", op, &step).await;
        }
    }
}

/// Random steps over two keys — costs from 0 to a few above the smallest
/// budget, refunds, grants, resets and reads — with the clock moving
/// forward by multiples of `trace.unit` (up to 400, 37 on average) plus
/// up to 999 ns, and with `trace.backwards` sometimes back by up to 100
/// units (never before where it started): every answer is the pure
/// quota's.
pub async fn quota_random_trace<S: QuotaStore>(
    store: &S,
    clock: &ManualClock,
    rule: &QuotaRule,
    trace: Trace,
) {
    let limiter = store.quota_limiter(rule).unwrap();
    let mut reference = QuotaReference::new(rule);
    let mut rng = Lcg(trace.seed);
    let keys: [&[u8]; 2] = [b"alice", b"bob"];
    let smallest = rule.quota().periods().map(|(_, l)| l).min().unwrap();
    let origin = crate::Clock::now(clock);
    let unit = trace.unit;
    // (admitted, denied, never) among consumes that cost something
    let mut seen = (0, 0, 0);
    for step in 0..trace.steps {
        match rng.below(8) {
            0 => {}
            1 => clock.advance_nanos(rng.below(400) * unit),
            2 if trace.backwards => {
                let back = rng.below(100) * unit + rng.below(1_000);
                clock.set(crate::Clock::now(clock).saturating_sub(back).max(origin));
            }
            _ => clock.advance_nanos(rng.below(60) * unit + rng.below(1_000)),
        }
        let key = keys[rng.below(2) as usize];
        let op = match rng.below(20) {
            0..=10 => QuotaOp::Consume(rng.below(smallest + 4)),
            11 | 12 => QuotaOp::Refund(rng.below(6)),
            13 => QuotaOp::Grant(rng.below(8)),
            14 => QuotaOp::Reset,
            _ => QuotaOp::Consume(0),
        };
        let at = format!("step {step} ({trace:?})");
        let d = quota_check(&limiter, &mut reference, clock, key, op, &at).await;
        if matches!(op, QuotaOp::Consume(c) if c > 0) {
            match d.outcome {
                Outcome::Allow { .. } => seen.0 += 1,
                Outcome::Deny { .. } => seen.1 += 1,
                Outcome::Never => seen.2 += 1,
            }
        }
    }
    // A trace that never fills a period, or never asks too much, proves
    // little.
    if trace.steps >= 100 {
        assert!(
            seen.0 > 0 && seen.1 > 0 && seen.2 > 0,
            "quota {}: (admitted, denied, never) = {seen:?}",
            rule.name()
        );
    }
}

/// Around `label`'s boundary (the clock an hour before it), for a quota
/// of every period at `offset`: steps a second before, at, a nanosecond
/// before (the clock behind the window it saw) and after the boundary,
/// then a random trace of about two hours in steps of seconds,
/// sometimes back.
pub async fn quota_across_a_boundary<S: QuotaStore>(
    store: &S,
    clock: &ManualClock,
    label: &str,
    zone: Zone,
) {
    let rule = quota_rule(
        "calendar",
        &[
            (Period::Minute, 6),
            (Period::Hour, 30),
            (Period::Day, 60),
            (Period::Week, 150),
            (Period::Month, 400),
            (Period::Year, 3_000),
        ],
        zone,
    );
    let start = crate::Clock::now(clock);
    let boundary = start + 3_600 * SECOND;
    let limiter = store.quota_limiter(&rule).unwrap();
    let mut reference = QuotaReference::new(&rule);
    for (at, op) in [
        (start, QuotaOp::Consume(5)),
        (start, QuotaOp::Grant(3)),
        (boundary - SECOND, QuotaOp::Consume(4)),
        (boundary, QuotaOp::Consume(0)),
        (boundary, QuotaOp::Consume(6)),
        (boundary - 1, QuotaOp::Consume(2)),
        (boundary - 1, QuotaOp::Refund(1)),
        (boundary - 1, QuotaOp::Grant(2)),
        (boundary + 59 * SECOND, QuotaOp::Consume(3)),
        (boundary + 61 * SECOND, QuotaOp::Consume(7)),
    ] {
        clock.set(at);
        let step = format!("{label}, {op:?} at {}", civil(at));
        quota_check(&limiter, &mut reference, clock, b"carol", op, &step).await;
    }
    clock.set(start);
    let trace = Trace {
        seed: label.bytes().fold(0xca1e, |h: u64, b| {
            h.wrapping_mul(31).wrapping_add(u64::from(b))
        }),
        steps: 200,
        unit: SECOND,
        backwards: true,
    };
    quota_random_trace(store, clock, &rule, trace).await;
}

/// Two years in steps of hours and days (sometimes weeks, sometimes back
/// by weeks), over every month of 2024 and 2025 — leap day, both year
/// ends — with budgets small enough to fill.
pub async fn quota_over_two_years<S: QuotaStore>(store: &S, clock: &ManualClock) {
    let rule = quota_rule(
        "two-years",
        &[
            (Period::Day, 12),
            (Period::Week, 40),
            (Period::Month, 120),
            (Period::Year, 900),
        ],
        Offset::from_hours_minutes(9, 0).unwrap(),
    );
    let trace = Trace {
        seed: 0x2024,
        steps: 500,
        unit: 3_600 * SECOND,
        backwards: true,
    };
    quota_random_trace(store, clock, &rule, trace).await;
    assert!(
        crate::Clock::now(clock) > crate::calendar::unix_nanos(2025, 3, 1, 0, 0, 0),
        "the trace should reach past 2025's February, not {}",
        civil(crate::Clock::now(clock))
    );
}

/// Reads at known dates report each period's length and time to its end
/// as the calendar has them: months of 28, 29, 30 and 31 days, years of
/// 365 and 366, weeks from Monday, days at +09:00 and −05:00.
pub async fn quota_periods_follow_the_calendar<S: QuotaStore>(store: &S, clock: &ManualClock) {
    use crate::calendar::unix_nanos as at;
    let h = 3_600 * SECOND;
    let tokyo = Offset::from_hours_minutes(9, 0).unwrap();
    let new_york = Offset::from_hours_minutes(-5, 0).unwrap();
    let periods = [
        (Period::Day, 10),
        (Period::Week, 10),
        (Period::Month, 10),
        (Period::Year, 10),
    ];
    // (now, offset, then for day, week, month and year: (length, end))
    let cases = [
        (
            at(2024, 2, 29, 12, 0, 0),
            Offset::UTC,
            [
                (DAY, at(2024, 3, 1, 0, 0, 0)),
                (7 * DAY, at(2024, 3, 4, 0, 0, 0)),
                (29 * DAY, at(2024, 3, 1, 0, 0, 0)),
                (366 * DAY, at(2025, 1, 1, 0, 0, 0)),
            ],
        ),
        (
            at(2026, 2, 15, 8, 30, 0),
            Offset::UTC,
            [
                (DAY, at(2026, 2, 16, 0, 0, 0)),
                (7 * DAY, at(2026, 2, 16, 0, 0, 0)),
                (28 * DAY, at(2026, 3, 1, 0, 0, 0)),
                (365 * DAY, at(2027, 1, 1, 0, 0, 0)),
            ],
        ),
        (
            at(2026, 4, 30, 23, 59, 59) + 999_999_999,
            Offset::UTC,
            [
                (DAY, at(2026, 5, 1, 0, 0, 0)),
                (7 * DAY, at(2026, 5, 4, 0, 0, 0)),
                (30 * DAY, at(2026, 5, 1, 0, 0, 0)),
                (365 * DAY, at(2027, 1, 1, 0, 0, 0)),
            ],
        ),
        // 20:00 UTC on April 30th is 05:00 on May 1st in Tokyo.
        (
            at(2026, 4, 30, 20, 0, 0),
            tokyo,
            [
                (DAY, at(2026, 5, 2, 0, 0, 0) - 9 * h),
                (7 * DAY, at(2026, 5, 4, 0, 0, 0) - 9 * h),
                (31 * DAY, at(2026, 6, 1, 0, 0, 0) - 9 * h),
                (365 * DAY, at(2027, 1, 1, 0, 0, 0) - 9 * h),
            ],
        ),
        // 03:00 UTC on New Year's Day is 22:00 on December 31st in New York.
        (
            at(2027, 1, 1, 3, 0, 0),
            new_york,
            [
                (DAY, at(2027, 1, 1, 0, 0, 0) + 5 * h),
                (7 * DAY, at(2027, 1, 4, 0, 0, 0) + 5 * h),
                (31 * DAY, at(2027, 1, 1, 0, 0, 0) + 5 * h),
                (365 * DAY, at(2027, 1, 1, 0, 0, 0) + 5 * h),
            ],
        ),
    ];
    for (i, (now, offset, want)) in cases.into_iter().enumerate() {
        clock.set(now);
        let rule = quota_rule(&format!("calendar-{i}"), &periods, offset);
        let limiter = store.quota_limiter(&rule).unwrap();
        let d = limiter.consume(b"k", 1).await.unwrap();
        assert!(d.is_allowed(), "{}: {d:?}", civil(now));
        for (p, (length, end)) in d.periods().iter().zip(want) {
            let at = format!("{} at {} ({offset:?})", p.period, civil(now));
            assert_eq!(p.length, length, "{at}: length");
            assert_eq!(p.reset_after, end - now, "{at}: reset_after");
            assert_eq!((p.limit, p.remaining), (10, 9), "{at}");
        }
        // A nanosecond before the year's end, a cost the year cannot take
        // waits until then; there the year is whole again.
        let year = quota_rule(&format!("calendar-{i}-year"), &[(Period::Year, 10)], offset);
        let year = store.quota_limiter(&year).unwrap();
        assert!(year.consume(b"k", 1).await.unwrap().is_allowed());
        let last = want[3].1 - 1;
        clock.set(last);
        let d = year.consume(b"k", 10).await.unwrap();
        assert_eq!(
            d.outcome,
            Outcome::Deny { retry_after: 1 },
            "{}",
            civil(last)
        );
        clock.set(last + 1);
        let d = year.consume(b"k", 10).await.unwrap();
        assert!(d.is_allowed(), "{}: {d:?}", civil(last + 1));
    }
}

/// Refunds, grants and resets, a denial's wait and costs above a
/// budget, step by step, each answer checked against the pure quota and
/// the telling ones spelled out.
pub async fn quota_refund_grant_reset_and_never<S: QuotaStore>(store: &S, clock: &ManualClock) {
    let rule = quota_rule(
        "admin",
        &[(Period::Day, 10), (Period::Month, 25)],
        Offset::UTC,
    );
    let limiter = store.quota_limiter(&rule).unwrap();
    let mut reference = QuotaReference::new(&rule);
    let key = b"customer";
    let now = crate::Clock::unix_now(clock);
    let midnight = Period::Day.bounds(now, Offset::UTC).1;
    let mut check = async |op: QuotaOp, at: &str| {
        quota_check(&limiter, &mut reference, clock, key, op, at).await
    };
    let remaining = |d: &QuotaDecision| (d.periods()[0].remaining, d.periods()[1].remaining);
    let limits = |d: &QuotaDecision| (d.periods()[0].limit, d.periods()[1].limit);

    let d = check(QuotaOp::Consume(4), "first").await;
    assert_eq!(remaining(&d), (6, 21));
    let d = check(QuotaOp::Consume(7), "too many for the day").await;
    assert_eq!(
        d.outcome,
        Outcome::Deny {
            retry_after: midnight - now
        }
    );
    assert_eq!(remaining(&d), (6, 21), "a denial charged");
    for cost in [11, 26, u64::from(u32::MAX), u64::MAX] {
        let d = check(QuotaOp::Consume(cost), "above the day's budget").await;
        assert_eq!(d.outcome, Outcome::Never);
        assert_eq!(remaining(&d), (6, 21), "a Never charged");
    }
    let d = check(QuotaOp::Refund(3), "refund").await;
    assert_eq!(remaining(&d), (9, 24));
    let d = check(QuotaOp::Refund(100), "refund more than used").await;
    assert_eq!(remaining(&d), (10, 25));
    let d = check(QuotaOp::Grant(5), "grant").await;
    assert_eq!((limits(&d), remaining(&d)), ((15, 30), (15, 30)));
    // With the grant, 11 is no longer above the day's budget.
    let d = check(QuotaOp::Consume(11), "within the grant").await;
    assert_eq!(remaining(&d), (4, 19));
    let d = check(QuotaOp::Reset, "reset").await;
    assert_eq!((limits(&d), remaining(&d)), ((10, 25), (10, 25)));
    check(QuotaOp::Consume(0), "after the reset").await;
    // A grant lapses with its period; usage of the day before is not
    // refunded to today, while the month's still is.
    check(QuotaOp::Grant(5), "grant again").await;
    check(QuotaOp::Consume(8), "spend").await;
    clock.set(midnight);
    let d = check(QuotaOp::Consume(0), "the next day").await;
    if Period::Month.bounds(midnight, Offset::UTC).0 != midnight {
        assert_eq!((limits(&d), remaining(&d)), ((10, 30), (10, 22)));
        let d = check(QuotaOp::Refund(3), "refund yesterday's").await;
        assert_eq!(remaining(&d), (10, 25));
    }
    check(QuotaOp::Consume(10), "a whole day").await;
    check(QuotaOp::Consume(1), "past it").await;
    // A grant of more than 2^52 is 2^52.
    let d = check(QuotaOp::Grant(u64::MAX), "a huge grant").await;
    assert_eq!(d.periods()[0].limit, 10 + crate::Quota::MAX_LIMIT);
    check(QuotaOp::Grant(0), "a grant of nothing").await;
    check(QuotaOp::Refund(0), "a refund of nothing").await;
}

/// Budgets of 2⁵² and grants as large: counts stay exact to the unit.
pub async fn quota_large_budgets<S: QuotaStore>(store: &S, clock: &ManualClock) {
    let max = crate::Quota::MAX_LIMIT;
    let rule = quota_rule(
        "large",
        &[(Period::Day, max), (Period::Year, max - 1)],
        Offset::UTC,
    );
    let limiter = store.quota_limiter(&rule).unwrap();
    let mut reference = QuotaReference::new(&rule);
    let key = b"big";
    for i in 0..3 {
        let d = quota_check(
            &limiter,
            &mut reference,
            clock,
            key,
            QuotaOp::Consume(u64::from(u32::MAX)),
            "spend",
        )
        .await;
        assert_eq!(
            d.periods()[0].remaining,
            max - (i + 1) * u64::from(u32::MAX)
        );
        clock.advance_nanos(SECOND + 7);
    }
    let d = quota_check(
        &limiter,
        &mut reference,
        clock,
        key,
        QuotaOp::Grant(max),
        "grant",
    )
    .await;
    assert_eq!(d.periods()[0].limit, 2 * max);
    assert_eq!(d.periods()[1].limit, 2 * max - 1);
    for (op, at) in [
        (QuotaOp::Consume(u64::from(u32::MAX)), "spend on the grant"),
        (QuotaOp::Refund(1), "refund one"),
        (QuotaOp::Consume(1), "spend one"),
        (QuotaOp::Grant(3), "grant past 2^52"),
        (QuotaOp::Consume(0), "read"),
    ] {
        quota_check(&limiter, &mut reference, clock, key, op, at).await;
    }
}

/// One key's usage does not touch another's, two rules keep separate
/// usage of one key, the same rule bound twice shares it, and hostile
/// keys (empty, binary, braces, CRLF, 1 MiB) are ordinary keys.
pub async fn quota_keys_and_rules_are_independent<S: QuotaStore>(store: &S, _clock: &ManualClock) {
    let day = [(Period::Day, 2)];
    let a = store
        .quota_limiter(&quota_rule("quota-a", &day, Offset::UTC))
        .unwrap();
    let b = store
        .quota_limiter(&quota_rule("quota-b", &day, Offset::UTC))
        .unwrap();
    assert!(a.consume(b"k1", 2).await.unwrap().is_allowed());
    assert!(!a.consume(b"k1", 1).await.unwrap().is_allowed());
    assert!(a.consume(b"k2", 2).await.unwrap().is_allowed());
    assert!(b.consume(b"k1", 2).await.unwrap().is_allowed());
    let a2 = store
        .quota_limiter(&quota_rule("quota-a", &day, Offset::UTC))
        .unwrap();
    assert!(!a2.consume(b"k1", 1).await.unwrap().is_allowed());
    let hostile = store
        .quota_limiter(&quota_rule(
            "quota-hostile",
            &[(Period::Month, 1)],
            Offset::UTC,
        ))
        .unwrap();
    let mut big = vec![b'x'; 1 << 20];
    let mut keys: Vec<Vec<u8>> = vec![
        Vec::new(),
        b"\0".to_vec(),
        b"\r\nSET evil 1\r\n".to_vec(),
        b"{slot}".to_vec(),
        vec![0xff, 0xfe, 0x00, 0x80],
        big.clone(),
    ];
    big[(1 << 20) - 1] = b'y';
    keys.push(big);
    for key in &keys {
        let d = hostile.consume(key, 1).await.unwrap();
        assert!(d.is_allowed(), "key of {} bytes collided", key.len());
    }
    for key in &keys {
        let d = hostile.consume(key, 1).await.unwrap();
        assert!(!d.is_allowed(), "key of {} bytes lost its usage", key.len());
    }
}
