#[cfg(test)]
use crate::calendar::Offset;
use crate::calendar::{Period, Zone};
use crate::{ConfigError, Decision, Outcome};

/// The most periods one quota counts at once (one of each kind).
pub const MAX_PERIODS: usize = 6;

/// A calendar quota: budgets per period — e.g. 1,000 a day and 20,000 a
/// month — that reset at calendar boundaries (UTC or a fixed offset), not
/// on a rolling window. A request is charged to every period at once, or,
/// when one of them has no room, to none.
///
/// Time is Unix time (nanoseconds): a store passes
/// [`Clock::unix_now`](crate::Clock::unix_now), or Redis's `TIME`.
///
/// - A cost above a period's whole budget is [`Outcome::Never`].
/// - A denial's `retry_after` is when every period that has no room has
///   rolled over (possibly days away).
/// - Support staff can [`grant`](Self::grant) extra units for the current
///   periods and [`reset`](QuotaState::default) a key.
/// - A clock set back into an earlier period keeps counting in the later
///   one it already saw, so going back never hands out a fresh budget.
///
/// ```
/// use tollgate_core::calendar::{unix_nanos, Offset, Period};
/// use tollgate_core::{Outcome, Quota, QuotaState};
///
/// let quota = Quota::new(&[(Period::Day, 1_000), (Period::Month, 20_000)], Offset::UTC)?;
/// let mut state = QuotaState::default();
/// let noon = unix_nanos(2026, 12, 2, 12, 0, 0);
/// let d = quota.decide(&mut state, noon, 990);
/// assert!(d.is_allowed());
/// assert_eq!(d.periods()[0].remaining, 10);
/// assert_eq!(d.periods()[1].remaining, 19_010);
/// // Twenty more do not fit today: retry at midnight, twelve hours away.
/// let d = quota.decide(&mut state, noon, 20);
/// assert_eq!(d.outcome, Outcome::Deny { retry_after: 12 * 3_600 * 1_000_000_000 });
/// // Tomorrow the day is whole again; the month remembers.
/// let d = quota.decide(&mut state, unix_nanos(2026, 12, 3, 0, 0, 0), 20);
/// assert_eq!((d.periods()[0].remaining, d.periods()[1].remaining), (980, 18_990));
/// # Ok::<(), tollgate_core::ConfigError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Quota {
    periods: [Option<(Period, u64)>; MAX_PERIODS],
    len: usize,
    zone: Zone,
}

/// One period's count in a [`QuotaState`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Window {
    /// Where the counted period starts (Unix ns).
    pub start: u64,
    /// Where it ends (kept so that a decision inside the period needs no
    /// calendar arithmetic); 0 when the window was never used (a period
    /// may start at 0, in January 1970; none ends there).
    pub end: u64,
    /// Units consumed in it.
    pub used: u64,
    /// Units granted on top of the budget for it.
    pub bonus: u64,
}

/// Per-key state of a [`Quota`]: one window per period, in the quota's
/// order.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct QuotaState {
    /// The windows, one per period of the quota.
    pub windows: [Window; MAX_PERIODS],
}

/// Where one period of a quota stands after a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PeriodStatus {
    /// The period.
    pub period: Period,
    /// Its budget: the configured limit plus any grant.
    pub limit: u64,
    /// Units left in it.
    pub remaining: u64,
    /// Nanoseconds until it ends (and the next period starts whole).
    pub reset_after: u64,
    /// Its length in nanoseconds (a month's depends on the month).
    pub length: u64,
}

/// A quota's answer: the outcome, and where each period stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QuotaDecision {
    /// Allowed, denied until `retry_after`, or never.
    pub outcome: Outcome,
    periods: [PeriodStatus; MAX_PERIODS],
    len: usize,
}

impl QuotaDecision {
    /// A decision from its parts, for stores that compute it elsewhere
    /// (the Redis store's script): `periods` in the quota's order; past
    /// [`MAX_PERIODS`], the rest are ignored. Equal to the decision
    /// [`Quota::decide`] makes with the same outcome and periods.
    pub fn new(outcome: Outcome, periods: &[PeriodStatus]) -> Self {
        let mut all = [EMPTY; MAX_PERIODS];
        for (slot, status) in all.iter_mut().zip(periods) {
            *slot = *status;
        }
        Self {
            outcome,
            periods: all,
            len: periods.len().min(MAX_PERIODS),
        }
    }

    /// Whether the request was admitted.
    pub fn is_allowed(&self) -> bool {
        matches!(self.outcome, Outcome::Allow { .. })
    }

    /// Each period's status, in the quota's order.
    pub fn periods(&self) -> &[PeriodStatus] {
        self.periods.get(..self.len).unwrap_or_default()
    }

    /// The decision of the tightest period — the one with the fewest units
    /// left — as a plain [`Decision`], for code that reads one limit.
    pub fn binding(&self) -> Decision {
        let tightest = self
            .periods()
            .iter()
            .min_by_key(|p| (p.remaining, std::cmp::Reverse(p.reset_after)));
        match tightest {
            Some(p) => Decision::with(self.outcome, p.limit, p.remaining, p.reset_after),
            None => Decision::with(self.outcome, 0, 0, 0),
        }
    }
}

impl QuotaDecision {
    /// No periods, allowed: what [`Quota::decide_into`] writes over.
    pub const EMPTY: Self = Self {
        outcome: Outcome::Allow { delay: 0 },
        periods: [EMPTY; MAX_PERIODS],
        len: 0,
    };
}

const EMPTY: PeriodStatus = PeriodStatus {
    period: Period::Minute,
    limit: 0,
    remaining: 0,
    reset_after: 0,
    length: 0,
};

impl Quota {
    /// The largest budget of one period (so that counts stay exact in the
    /// Redis store's Lua doubles).
    pub const MAX_LIMIT: u64 = 1 << 52;

    /// Validates: 1 to [`MAX_PERIODS`] periods, each kind at most once,
    /// every budget from 1 to [`Self::MAX_LIMIT`]. Periods are kept in the
    /// order given.
    pub fn new(periods: &[(Period, u64)], zone: impl Into<Zone>) -> Result<Self, ConfigError> {
        if periods.is_empty() || periods.len() > MAX_PERIODS {
            return Err(ConfigError::new(
                "periods",
                "a quota needs 1 to 6 periods (at most one of each kind)",
            ));
        }
        let mut quota = Self {
            periods: [None; MAX_PERIODS],
            len: periods.len(),
            zone: zone.into(),
        };
        for (i, &(period, limit)) in periods.iter().enumerate() {
            if limit == 0 || limit > Self::MAX_LIMIT {
                return Err(ConfigError::new(
                    "limit",
                    "every period's budget must be from 1 to 2^52",
                ));
            }
            if periods.iter().take(i).any(|&(p, _)| p == period) {
                return Err(ConfigError::new(
                    "periods",
                    "each period may appear once (one budget per day, per month, ...)",
                ));
            }
            if let Some(slot) = quota.periods.get_mut(i) {
                *slot = Some((period, limit));
            }
        }
        Ok(quota)
    }

    /// The periods and their budgets, in order.
    pub fn periods(&self) -> impl Iterator<Item = (Period, u64)> + '_ {
        self.periods.iter().take(self.len).flatten().copied()
    }

    /// Where its periods begin: a fixed offset from UTC or an IANA time
    /// zone.
    pub fn zone(&self) -> &Zone {
        &self.zone
    }

    /// Whether a key's state under `old` means the same under this quota:
    /// the same periods in the same order — only the budgets or the offset
    /// differ. A rebinding (a reload that raises a plan's monthly budget,
    /// or moves the offset for daylight saving time) then goes on from
    /// each key's usage instead of a fresh period: a window counted at the
    /// old offset counts on through the period it falls in at the new one.
    pub fn keeps_state_of(&self, old: &Quota) -> bool {
        self.periods()
            .map(|(period, _)| period)
            .eq(old.periods().map(|(period, _)| period))
    }

    /// The window `w` counts in at `now`: its own if it is the current one
    /// (or a later one the clock has seen), now's period with `w`'s counts
    /// if `w` is that period counted at another offset (the quota moved
    /// its offset, as for daylight saving time: the stored window's middle
    /// falls in now's period), else a fresh one.
    fn current(&self, period: Period, w: Window, now: u64) -> Window {
        if w.end != 0 && w.start <= now && now < w.end {
            return w;
        }
        let (start, end) = period.bounds_in(now, &self.zone);
        let middle = w.start.saturating_add(w.end.saturating_sub(w.start) / 2);
        if w.end != 0 && w.start > now {
            // A later period than now's (the clock went back): keep it.
            w
        } else if w.end != 0 && start <= middle && middle < end {
            Window { start, end, ..w }
        } else {
            Window {
                start,
                end,
                used: 0,
                bonus: 0,
            }
        }
    }

    /// Decides a request of `cost` at `now` (Unix ns); charges every
    /// period if it fits them all. Cost 0 peeks: the usage, changing
    /// nothing.
    pub fn decide(&self, state: &mut QuotaState, now: u64, cost: u64) -> QuotaDecision {
        self.apply(state, now, 0, cost)
    }

    /// Gives `cost` back to every period that is still current (a later
    /// limit refused the request).
    pub fn refund(&self, state: &mut QuotaState, now: u64, cost: u64) {
        for (i, (period, _)) in self.periods().enumerate() {
            if let Some(w) = state.windows.get_mut(i) {
                // Only a window that is still current gets it back.
                if w.end != 0 && self.current(period, *w, now).start == w.start {
                    w.used = w.used.saturating_sub(cost);
                }
            }
        }
    }

    /// Grants `units` on top of every current period's budget (for
    /// support staff: "give this customer 500 more today"). Returns the
    /// usage after.
    pub fn grant(&self, state: &mut QuotaState, now: u64, units: u64) -> QuotaDecision {
        self.apply(state, now, units, 0)
    }

    /// Moves every window to the current period, adds `grant` to its
    /// bonus, then decides `cost`. The state changes only if something was
    /// consumed or granted: a peek or a denial leaves it as it was (its
    /// windows would roll over the same way on the next read).
    fn apply(&self, state: &mut QuotaState, now: u64, grant: u64, cost: u64) -> QuotaDecision {
        let mut out = QuotaDecision::EMPTY;
        self.apply_into(state, now, grant, cost, &mut out, true);
        out
    }

    /// [`decide`](Self::decide), writing the decision into `out` (a store
    /// that hands it back through a lock and a closure saves copying its
    /// ~260 bytes at each step).
    pub fn decide_into(
        &self,
        state: &mut QuotaState,
        now: u64,
        cost: u64,
        out: &mut QuotaDecision,
    ) {
        self.apply_into(state, now, 0, cost, out, true);
    }

    /// Decides into `out`: through [`decide_current`](Self::decide_current)
    /// when `shortcut` allows and every window is current, else by the
    /// general path below (windows that roll over, grants).
    fn apply_into(
        &self,
        state: &mut QuotaState,
        now: u64,
        grant: u64,
        cost: u64,
        out: &mut QuotaDecision,
        shortcut: bool,
    ) {
        if shortcut && grant == 0 && self.decide_current(state, now, cost, out) {
            return;
        }
        let mut windows = [Window::default(); MAX_PERIODS];
        // A decision written over one with more periods: none of its
        // periods may stay past ours (equality and hashing see them all).
        if out.len > self.len {
            for p in out.periods.iter_mut().skip(self.len) {
                *p = EMPTY;
            }
        }
        let periods = &mut out.periods;
        let (mut never, mut wait) = (false, None::<u64>);
        for (i, (period, limit)) in self.periods().enumerate() {
            let (Some(w), Some(cur), Some(status)) =
                (state.windows.get(i), windows.get_mut(i), periods.get_mut(i))
            else {
                continue;
            };
            *cur = self.current(period, *w, now);
            cur.bonus = cur.bonus.saturating_add(grant).min(Self::MAX_LIMIT);
            let budget = limit.saturating_add(cur.bonus);
            let remaining = budget.saturating_sub(cur.used);
            let reset_after = cur.end.saturating_sub(now);
            if cost > budget {
                never = true;
            } else if cost > remaining {
                let until = reset_after.max(1);
                wait = Some(wait.map_or(until, |w| w.max(until)));
            }
            *status = PeriodStatus {
                period,
                limit: budget,
                remaining,
                reset_after,
                length: cur.end.saturating_sub(cur.start),
            };
        }
        let outcome = if never {
            Outcome::Never
        } else if let Some(retry_after) = wait {
            Outcome::Deny { retry_after }
        } else {
            Outcome::Allow { delay: 0 }
        };
        let admitted = matches!(outcome, Outcome::Allow { .. });
        // A peek or a denial changes nothing (its windows would roll over
        // the same way on the next read); a charge or a grant writes.
        if (admitted && cost > 0) || grant > 0 {
            let charge = if admitted { cost } else { 0 };
            for ((w, cur), status) in state
                .windows
                .iter_mut()
                .zip(windows)
                .zip(periods.iter_mut())
                .take(self.len)
            {
                *w = Window {
                    used: cur.used.saturating_add(charge),
                    ..cur
                };
                status.remaining = status.remaining.saturating_sub(charge);
            }
        }
        out.outcome = outcome;
        out.len = self.len;
    }

    /// A decision when every window is the current one, which is all of
    /// them but once a period per key: in place, with no calendar
    /// arithmetic and no copy of the windows. Returns false, having
    /// changed no state, when a window must roll over (or was never used);
    /// the general path then decides (and writes all of `out` again). The same answer and the same writes
    /// as that path (a property test compares them).
    #[inline]
    fn decide_current(
        &self,
        state: &mut QuotaState,
        now: u64,
        cost: u64,
        out: &mut QuotaDecision,
    ) -> bool {
        let n = self.len;
        let (Some(config), Some(windows)) = (self.periods.get(..n), state.windows.get_mut(..n))
        else {
            return false;
        };
        if !windows
            .iter()
            .all(|w| w.end != 0 && w.start <= now && now < w.end)
        {
            return false;
        }
        if out.len > n {
            for p in out.periods.iter_mut().skip(n) {
                *p = EMPTY;
            }
        }
        let (mut never, mut wait) = (false, 0u64);
        for ((c, w), status) in config
            .iter()
            .zip(windows.iter())
            .zip(out.periods.iter_mut())
        {
            let Some((period, limit)) = *c else {
                return false;
            };
            let budget = limit.saturating_add(w.bonus.min(Self::MAX_LIMIT));
            let remaining = budget.saturating_sub(w.used);
            let reset_after = w.end.saturating_sub(now);
            if cost > budget {
                never = true;
            } else if cost > remaining {
                wait = wait.max(reset_after);
            }
            *status = PeriodStatus {
                period,
                limit: budget,
                remaining,
                reset_after,
                length: w.end.saturating_sub(w.start),
            };
        }
        out.len = n;
        out.outcome = if never {
            Outcome::Never
        } else if wait > 0 {
            Outcome::Deny { retry_after: wait }
        } else {
            if cost > 0 {
                for (w, status) in windows.iter_mut().zip(out.periods.iter_mut()) {
                    w.bonus = w.bonus.min(Self::MAX_LIMIT);
                    w.used = w.used.saturating_add(cost);
                    status.remaining = status.remaining.saturating_sub(cost);
                }
            }
            Outcome::Allow { delay: 0 }
        };
        true
    }

    /// Whether `state` counts nothing at `now`: every window is of a past
    /// period or holds neither usage nor a grant.
    pub fn is_idle(&self, state: &QuotaState, now: u64) -> bool {
        self.periods().enumerate().all(|(i, (period, _))| {
            state.windows.get(i).is_none_or(|w| {
                let cur = self.current(period, *w, now);
                cur.used == 0 && cur.bonus == 0
            })
        })
    }

    /// How long, in nanoseconds, a state written at `now` can still matter:
    /// until the end of its longest period.
    pub fn lifetime(&self, now: u64) -> u64 {
        self.periods()
            .map(|(p, _)| p.bounds_in(now, &self.zone).1.saturating_sub(now))
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calendar::unix_nanos;
    use proptest::prelude::*;

    const S: u64 = 1_000_000_000;

    proptest! {
        /// The shortcut for current windows answers and writes exactly what
        /// the general path does, on states made by random histories
        /// (grants, the clock going back, costs above the budget).
        #[test]
        fn the_shortcut_equals_the_general_path(
            kinds in proptest::sample::subsequence(
                vec![Period::Minute, Period::Hour, Period::Day, Period::Week, Period::Month, Period::Year],
                1..=4,
            ),
            limits in proptest::collection::vec(1u64..50, 4),
            steps in proptest::collection::vec((0u64..2 * 3_600 * S, any::<bool>(), 0u32..60, 0u64..8), 1..80),
        ) {
            let periods: Vec<(Period, u64)> = kinds.iter().copied().zip(limits).collect();
            let quota = Quota::new(&periods, Offset::from_seconds(9 * 3_600).unwrap()).unwrap();
            // Across a month's end and a leap-free February.
            let mut now = unix_nanos(2026, 2, 27, 23, 58, 0);
            let mut state = QuotaState::default();
            for (step, back, cost, op) in steps {
                let cost = u64::from(cost);
                // Mostly forward, sometimes back.
                now = if back && op == 0 { now - step / 4 } else { now + step / 64 };
                if op == 7 {
                    quota.grant(&mut state, now, cost * 1_000_000_000_000_000);
                    continue;
                }
                let (mut fast, mut general) = (state, state);
                // Both written over a decision of six periods, whose
                // surplus must not stay.
                let six = Quota::new(
                    &[(Period::Minute, 1), (Period::Hour, 2), (Period::Day, 3), (Period::Week, 4), (Period::Month, 5), (Period::Year, 6)],
                    Offset::UTC,
                )
                .unwrap()
                .decide(&mut QuotaState::default(), now, 1);
                let (mut a, mut b) = (six, six);
                if quota.decide_current(&mut fast, now, cost, &mut a) {
                    quota.apply_into(&mut general, now, 0, cost, &mut b, false);
                    prop_assert_eq!(a, b);
                    prop_assert_eq!(fast, general);
                } else {
                    prop_assert_eq!(fast, state);
                }
                quota.decide(&mut state, now, cost);
            }
        }
    }

    #[test]
    fn a_decision_in_current_windows_takes_the_shortcut() {
        let noon = unix_nanos(2026, 12, 3, 12, 0, 0);
        let q = Quota::new(&[(Period::Day, 10), (Period::Month, 100)], Offset::UTC).unwrap();
        let mut s = QuotaState::default();
        let mut out = QuotaDecision::EMPTY;
        // A fresh state has no windows yet; a peek does not make them.
        assert!(!q.decide_current(&mut s, noon, 0, &mut out));
        q.decide(&mut s, noon, 1);
        assert!(q.decide_current(&mut s, noon + S, 4, &mut out));
        assert_eq!(out.periods()[0].remaining, 5);
        assert_eq!(s.windows[1].used, 5);
        // Past midnight the day must roll over: the general path's job.
        assert!(!q.decide_current(&mut s, unix_nanos(2026, 12, 4, 0, 0, 0), 1, &mut out));
        assert_eq!(s.windows[0].used, 5);
    }

    /// Quota review #5: a quota that moves its offset (summer's −04:00 to
    /// winter's −05:00) goes on counting the period it is in. The stored
    /// month (from 04:00Z) ends an hour before the month at the new offset
    /// (05:00Z); in that hour it is still November at −05:00, and the
    /// usage stays. Then December starts afresh.
    #[test]
    fn an_offset_moved_later_keeps_counting_the_same_period() {
        let at = |h| Offset::from_hours_minutes(h, 0).unwrap();
        let summer = Quota::new(&[(Period::Month, 1_000)], at(-4)).unwrap();
        let winter = Quota::new(&[(Period::Month, 1_000)], at(-5)).unwrap();
        let mut s = QuotaState::default();
        summer.decide(&mut s, unix_nanos(2026, 11, 10, 12, 0, 0), 30);
        let left = |q: &Quota, s: &mut QuotaState, now| q.decide(s, now, 0).periods()[0].remaining;
        assert_eq!(
            left(&winter, &mut s, unix_nanos(2026, 11, 20, 12, 0, 0)),
            970
        );
        // Past the stored month's end (04:00Z), before winter's (05:00Z).
        let between = unix_nanos(2026, 12, 1, 4, 30, 0);
        assert_eq!(left(&winter, &mut s, between), 970);
        let d = winter.decide(&mut s, between, 5);
        assert_eq!(d.periods()[0].remaining, 965);
        assert_eq!(d.periods()[0].reset_after, 30 * 60 * S);
        assert_eq!(
            left(&winter, &mut s, unix_nanos(2026, 12, 1, 5, 0, 0)),
            1_000
        );
        // And the other way (back to −04:00 in March): the stored window
        // holds until its own end, then the next starts at the new offset.
        let mut s = QuotaState::default();
        winter.decide(&mut s, unix_nanos(2027, 3, 20, 12, 0, 0), 30);
        assert_eq!(
            left(&summer, &mut s, unix_nanos(2027, 3, 31, 12, 0, 0)),
            970
        );
        assert_eq!(left(&summer, &mut s, unix_nanos(2027, 4, 1, 4, 30, 0)), 970);
        assert_eq!(
            left(&summer, &mut s, unix_nanos(2027, 4, 1, 5, 0, 0)),
            1_000
        );
    }

    #[test]
    fn a_decision_written_in_place_equals_one_returned() {
        let noon = unix_nanos(2026, 12, 3, 12, 0, 0);
        let three = Quota::new(
            &[
                (Period::Hour, 10),
                (Period::Day, 100),
                (Period::Month, 1_000),
            ],
            Offset::UTC,
        )
        .unwrap();
        let one = Quota::new(&[(Period::Day, 5)], Offset::UTC).unwrap();
        // `out` held three periods; written over by a one-period quota it
        // keeps none of them.
        let mut out = QuotaDecision::EMPTY;
        three.decide_into(&mut QuotaState::default(), noon, 1, &mut out);
        assert_eq!(out.periods().len(), 3);
        one.decide_into(&mut QuotaState::default(), noon, 2, &mut out);
        assert_eq!(out, one.decide(&mut QuotaState::default(), noon, 2));
        assert_eq!(out.periods().len(), 1);
        assert_eq!(out.periods()[0].remaining, 3);
    }

    #[test]
    fn every_period_is_charged_or_none() {
        let q = Quota::new(&[(Period::Minute, 5), (Period::Hour, 8)], Offset::UTC).unwrap();
        let mut s = QuotaState::default();
        let t = unix_nanos(2026, 12, 2, 10, 0, 30);
        assert!(q.decide(&mut s, t, 4).is_allowed());
        // The minute has 1 left: 2 do not fit, and the hour is not charged.
        let d = q.decide(&mut s, t, 2);
        assert_eq!(
            d.outcome,
            Outcome::Deny {
                retry_after: 30 * S
            }
        );
        assert_eq!(d.periods()[1].remaining, 4);
        // Next minute: the hour has 4, so 5 do not fit until 11:00.
        let d = q.decide(&mut s, t + 30 * S, 5);
        assert_eq!(
            d.outcome,
            Outcome::Deny {
                retry_after: 59 * 60 * S
            }
        );
        assert!(q.decide(&mut s, t + 30 * S, 4).is_allowed());
        assert_eq!(q.decide(&mut s, t + 30 * S, 6).outcome, Outcome::Never);
        // A grant raises both budgets for their current periods.
        let g = q.grant(&mut s, t + 40 * S, 10);
        assert_eq!(
            (g.periods()[0].remaining, g.periods()[1].remaining),
            (11, 10)
        );
        assert!(q.decide(&mut s, t + 40 * S, 10).is_allowed());
        // ...and lapses with them.
        let d = q.decide(&mut s, unix_nanos(2026, 12, 2, 11, 0, 0), 0);
        assert_eq!((d.periods()[0].limit, d.periods()[1].remaining), (5, 8));
    }

    #[test]
    fn peeks_and_denials_change_nothing_and_refunds_give_back() {
        let q = Quota::new(&[(Period::Day, 10)], Offset::UTC).unwrap();
        let t = unix_nanos(2026, 12, 2, 10, 0, 0);
        let mut s = QuotaState::default();
        q.decide(&mut s, t, 0);
        assert_eq!(s, QuotaState::default());
        q.decide(&mut s, t, 11);
        assert_eq!(s, QuotaState::default());
        q.decide(&mut s, t, 7);
        let before = s;
        q.decide(&mut s, t, 4);
        assert_eq!(s, before);
        q.refund(&mut s, t, 5);
        assert_eq!(q.decide(&mut s, t, 0).periods()[0].remaining, 8);
        assert!(!q.is_idle(&s, t));
        assert!(q.is_idle(&s, unix_nanos(2026, 12, 3, 0, 0, 0)));
    }

    #[test]
    fn the_clock_going_back_never_hands_out_a_fresh_budget() {
        let q = Quota::new(&[(Period::Day, 10)], Offset::UTC).unwrap();
        let mut s = QuotaState::default();
        let tomorrow = unix_nanos(2026, 12, 3, 0, 0, 1);
        assert!(q.decide(&mut s, tomorrow, 10).is_allowed());
        // Back across midnight: the 3rd's count still holds.
        let d = q.decide(&mut s, tomorrow - 2 * S, 1);
        assert!(!d.is_allowed());
        assert_eq!(d.periods()[0].remaining, 0);
    }

    #[test]
    fn january_1970_counts_like_any_month() {
        let q = Quota::new(&[(Period::Month, 2)], Offset::UTC).unwrap();
        let mut s = QuotaState::default();
        for t in [S, 2 * S] {
            assert!(q.decide(&mut s, t, 1).is_allowed());
        }
        assert!(!q.decide(&mut s, 3 * S, 1).is_allowed());
    }

    #[test]
    fn configuration_errors_name_the_field() {
        let e = |p: &[(Period, u64)]| Quota::new(p, Offset::UTC).unwrap_err().field();
        assert_eq!(e(&[]), "periods");
        assert_eq!(e(&[(Period::Day, 0)]), "limit");
        assert_eq!(e(&[(Period::Day, u64::MAX)]), "limit");
        assert_eq!(e(&[(Period::Day, 1), (Period::Day, 2)]), "periods");
        let q = Quota::new(&[(Period::Year, 1)], Offset::UTC).unwrap();
        let mut s = QuotaState::default();
        for t in [0, 1, u64::MAX] {
            let _ = q.decide(&mut s, t, u64::MAX);
            let _ = q.grant(&mut s, t, u64::MAX);
        }
    }
}
