use super::{mul, sat64, RateAlgorithm};
use crate::{ConfigError, Decision, Outcome, Rate};

/// The generic cell rate algorithm (GCRA), as governor implements it.
///
/// The state is one `u64`: the theoretical arrival time (TAT), the instant
/// at which the budget will be whole again. A request of cost `n` moves it
/// `n × interval` later; it is admitted if the new TAT is at most
/// `burst × interval` ahead of now. Equivalent to a continuously refilled
/// token bucket of `burst` tokens, without a refill timer or a second word,
/// so a store can update it with one compare-and-swap. `0` is fresh.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Gcra {
    interval: u64,
    burst: u32,
    tau: u64,
}

impl Gcra {
    /// What a refund's meaning depends on: the emission interval.
    pub(crate) fn refund_shape(&self) -> u64 {
        self.interval
    }

    /// The parameters a stored state's meaning depends on: a rule whose
    /// parameters change keeps its keys' states when these stay the same.
    pub(crate) fn state_shape(&self) -> (u64, u64) {
        (0, 0)
    }

    /// Validates `rate` (field `rate`) and `burst` (field `burst`).
    pub fn new(rate: Rate, burst: u32) -> Result<Self, ConfigError> {
        let interval = rate.interval_nanos("rate")?;
        if burst == 0 {
            return Err(ConfigError::new("burst", "must be at least 1"));
        }
        let tau = u64::try_from(mul(interval, u64::from(burst)))
            .map_err(|_| ConfigError::new("burst", "burst × rate interval overflows 584 years"))?;
        Ok(Self {
            interval,
            burst,
            tau,
        })
    }

    /// Nanoseconds per unit.
    pub fn interval(&self) -> u64 {
        self.interval
    }

    /// How much fits at `now` given a TAT already clamped to `>= now`.
    fn remaining(&self, tat: u64, now: u64) -> u64 {
        let used = tat.saturating_sub(now);
        self.tau
            .saturating_sub(used)
            .checked_div(self.interval)
            .unwrap_or(0)
    }
}

impl RateAlgorithm for Gcra {
    type State = u64;

    #[inline]
    fn decide(&self, tat: &mut u64, now: u64, cost: u64) -> Decision {
        let limit = u64::from(self.burst);
        let start = (*tat).max(now);
        if cost == 0 {
            let reset = start.saturating_sub(now);
            return Decision::allow(limit, self.remaining(start, now), reset);
        }
        if cost > u64::from(self.burst) {
            let reset = start.saturating_sub(now);
            return Decision::with(Outcome::Never, limit, self.remaining(start, now), reset);
        }
        // cost <= burst and interval × burst fits in u64.
        let next = u128::from(start).saturating_add(mul(self.interval, cost));
        let ahead = next.saturating_sub(u128::from(now));
        if ahead > u128::from(self.tau) || next > u128::from(u64::MAX) {
            let retry_after = if next > u128::from(u64::MAX) {
                u64::MAX
            } else {
                sat64(ahead.saturating_sub(u128::from(self.tau)))
            };
            return Decision::with(
                Outcome::Deny { retry_after },
                limit,
                self.remaining(start, now),
                start.saturating_sub(now),
            );
        }
        let next = sat64(next);
        *tat = next;
        Decision::allow(limit, self.remaining(next, now), next.saturating_sub(now))
    }

    fn refund(&self, tat: &mut u64, now: u64, cost: u64) {
        if *tat > now {
            let back = sat64(mul(self.interval, cost));
            *tat = tat.saturating_sub(back).max(now);
        }
    }

    #[inline]
    fn is_idle(&self, tat: &u64, now: u64) -> bool {
        *tat <= now
    }

    fn capacity(&self) -> u64 {
        u64::from(self.burst)
    }

    fn window(&self) -> u64 {
        self.tau
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn ten_per_second_burst_20() -> Gcra {
        Gcra::new(Rate::per_second(10), 20).unwrap()
    }

    #[test]
    fn burst_then_one_per_interval() {
        let g = ten_per_second_burst_20();
        let mut s = 0;
        let now = 1_000 * MS;
        for i in 0..20 {
            let d = g.decide(&mut s, now, 1);
            assert!(d.is_allowed(), "request {i}");
            assert_eq!(d.remaining, 19 - i);
        }
        let d = g.decide(&mut s, now, 1);
        assert_eq!(
            d.outcome,
            Outcome::Deny {
                retry_after: 100 * MS
            }
        );
        assert_eq!(d.remaining, 0);
        assert_eq!(d.reset_after, 2_000 * MS);
        // Exactly at the retry time it fits, one nanosecond earlier it does not.
        let mut probe = s;
        assert!(!g.decide(&mut probe, now + 100 * MS - 1, 1).is_allowed());
        assert!(g.decide(&mut s, now + 100 * MS, 1).is_allowed());
    }

    #[test]
    fn cost_equal_to_capacity_fits_only_when_whole() {
        let g = ten_per_second_burst_20();
        let mut s = 0;
        assert!(g.decide(&mut s, 5 * MS, 20).is_allowed());
        let d = g.decide(&mut s, 5 * MS, 20);
        assert_eq!(
            d.outcome,
            Outcome::Deny {
                retry_after: 2_000 * MS
            }
        );
        assert_eq!(g.decide(&mut s, 5 * MS, 21).outcome, Outcome::Never);
        assert_eq!(g.decide(&mut s, 5 * MS, u64::MAX).outcome, Outcome::Never);
    }

    #[test]
    fn cost_zero_peeks() {
        let g = ten_per_second_burst_20();
        let mut s = 0;
        g.decide(&mut s, 0, 5);
        let before = s;
        let d = g.decide(&mut s, 0, 0);
        assert!(d.is_allowed());
        assert_eq!(d.remaining, 15);
        assert_eq!(s, before);
    }

    #[test]
    fn clock_backwards_never_grants_more() {
        let g = ten_per_second_burst_20();
        let mut s = 0;
        let now = 10_000 * MS;
        for _ in 0..20 {
            assert!(g.decide(&mut s, now, 1).is_allowed());
        }
        assert!(!g.decide(&mut s, now - 5_000 * MS, 1).is_allowed());
        assert!(!g.decide(&mut s, 0, 1).is_allowed());
    }

    #[test]
    fn end_of_time_denies_instead_of_wrapping() {
        let g = Gcra::new(Rate::per_day(1), 2).unwrap();
        let mut s = 0;
        let now = u64::MAX - 10;
        let d = g.decide(&mut s, now, 1);
        assert!(!d.is_allowed());
        assert_eq!(s, 0);
    }

    #[test]
    fn refund_restores_but_not_beyond_whole() {
        let g = ten_per_second_burst_20();
        let mut s = 0;
        g.decide(&mut s, 0, 20);
        g.refund(&mut s, 0, 5);
        assert_eq!(g.decide(&mut s, 0, 0).remaining, 5);
        g.refund(&mut s, 0, 1_000);
        assert_eq!(s, 0);
        assert!(g.is_idle(&s, 0));
    }
}
