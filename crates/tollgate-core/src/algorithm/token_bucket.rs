use std::time::Duration;

use super::{div_ceil, mul, sat64, RateAlgorithm};
use crate::clock::duration_to_nanos;
use crate::{ConfigError, Decision, Outcome};

/// Token bucket with discrete refills, as Envoy's local rate limit has it:
/// up to `capacity` tokens; `refill` tokens are added at every multiple of
/// `interval` (aligned to the clock's origin); a request takes `cost`
/// tokens or is denied.
///
/// (For a continuously refilled bucket use [`Gcra`](super::Gcra): it is the
/// same algorithm.)
///
/// The state is one `u64`, `debt = capacity + tick × refill − tokens`,
/// where `tick = now / interval`. The tokens at any later tick follow from
/// it (`min(capacity, capacity + tick × refill − debt)`), so the bucket
/// refills without a timer or a stored timestamp, and a store can update
/// it with one compare-and-swap. `0` is a full bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TokenBucket {
    capacity: u32,
    refill: u32,
    interval: u64,
}

impl TokenBucket {
    /// The parameters a stored state's meaning depends on: a rule whose
    /// parameters change keeps its keys' states when these stay the same.
    pub(crate) fn state_shape(&self) -> (u64, u64) {
        (self.interval, u64::from(self.refill))
    }

    /// Validates `capacity`, `refill` and `interval` (each error names its
    /// field). At most one token per nanosecond may be added.
    pub fn new(capacity: u32, refill: u32, interval: Duration) -> Result<Self, ConfigError> {
        if capacity == 0 {
            return Err(ConfigError::new("capacity", "must be at least 1"));
        }
        if refill == 0 {
            return Err(ConfigError::new("refill", "must be at least 1"));
        }
        let interval = duration_to_nanos(interval);
        if interval == 0 {
            return Err(ConfigError::new("interval", "must be longer than zero"));
        }
        if u64::from(refill) > interval {
            return Err(ConfigError::new(
                "refill",
                "more than one token per nanosecond is not supported",
            ));
        }
        Ok(Self {
            capacity,
            refill,
            interval,
        })
    }

    /// Tokens added at each refill.
    pub fn refill(&self) -> u32 {
        self.refill
    }

    /// Nanoseconds between refills.
    pub fn interval(&self) -> u64 {
        self.interval
    }

    fn tick(&self, now: u64) -> u64 {
        now.checked_div(self.interval).unwrap_or(0)
    }

    /// `capacity + tick × refill`: the debt at which the bucket is empty.
    fn ceiling(&self, tick: u64) -> u128 {
        u128::from(self.capacity).saturating_add(mul(tick, u64::from(self.refill)))
    }

    fn tokens(&self, debt: u64, tick: u64) -> u64 {
        sat64(
            self.ceiling(tick)
                .saturating_sub(u128::from(debt))
                .min(u128::from(self.capacity)),
        )
    }

    /// Nanoseconds from `now` until the tick at which `debt` leaves at least
    /// `want` tokens.
    fn wait_for(&self, debt: u64, want: u64, now: u64) -> u64 {
        // capacity + t × refill − debt ≥ want  ⇔  t ≥ (want + debt − capacity) / refill
        let need = u128::from(want)
            .saturating_add(u128::from(debt))
            .saturating_sub(u128::from(self.capacity));
        let tick = div_ceil(need, u128::from(self.refill));
        sat64(
            tick.saturating_mul(u128::from(self.interval))
                .saturating_sub(u128::from(now)),
        )
    }
}

impl RateAlgorithm for TokenBucket {
    type State = u64;

    #[inline]
    fn decide(&self, debt: &mut u64, now: u64, cost: u64) -> Decision {
        let limit = u64::from(self.capacity);
        let tick = self.tick(now);
        let tokens = self.tokens(*debt, tick);
        if cost == 0 {
            return Decision::allow(limit, tokens, self.wait_for(*debt, limit, now));
        }
        let reset = self.wait_for(*debt, limit, now);
        if cost > u64::from(self.capacity) {
            return Decision::with(Outcome::Never, limit, tokens, reset);
        }
        let left = tokens.checked_sub(cost);
        let next = left.and_then(|left| {
            u64::try_from(self.ceiling(tick).saturating_sub(u128::from(left))).ok()
        });
        match (left, next) {
            (Some(left), Some(next)) => {
                *debt = next;
                Decision::allow(limit, left, self.wait_for(next, limit, now))
            }
            (None, _) => Decision::with(
                Outcome::Deny {
                    retry_after: self.wait_for(*debt, cost, now),
                },
                limit,
                tokens,
                reset,
            ),
            // Past the end of u64 time: deny rather than wrap.
            (Some(_), None) => Decision::with(
                Outcome::Deny {
                    retry_after: u64::MAX,
                },
                limit,
                tokens,
                reset,
            ),
        }
    }

    fn refund(&self, debt: &mut u64, now: u64, cost: u64) {
        let tick = self.tick(now);
        let tokens = self
            .tokens(*debt, tick)
            .saturating_add(cost)
            .min(u64::from(self.capacity));
        if let Ok(next) = u64::try_from(self.ceiling(tick).saturating_sub(u128::from(tokens))) {
            // A refund never adds debt (the clock may have gone backwards).
            *debt = next.min(*debt);
        }
    }

    #[inline]
    fn is_idle(&self, debt: &u64, now: u64) -> bool {
        u128::from(*debt) <= mul(self.tick(now), u64::from(self.refill))
    }

    fn capacity(&self) -> u64 {
        u64::from(self.capacity)
    }

    fn window(&self) -> u64 {
        // Refills needed to fill an empty bucket, times the interval.
        sat64(
            div_ceil(u128::from(self.capacity), u128::from(self.refill))
                .saturating_mul(u128::from(self.interval)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn refills_in_steps() {
        // 10 tokens, 5 more at every whole second.
        let b = TokenBucket::new(10, 5, Duration::from_secs(1)).unwrap();
        let mut s = 0;
        let now = 3 * S + S / 2;
        assert!(b.decide(&mut s, now, 10).is_allowed());
        let d = b.decide(&mut s, now, 1);
        assert_eq!(d.outcome, Outcome::Deny { retry_after: S / 2 });
        assert_eq!(d.reset_after, S / 2 + S);
        // Just before the tick: still empty; at the tick: 5 tokens.
        assert!(!b.decide(&mut s, 4 * S - 1, 1).is_allowed());
        let d = b.decide(&mut s, 4 * S, 5);
        assert!(d.is_allowed());
        assert_eq!(d.remaining, 0);
        // A cost of 7 must wait two refills.
        let d = b.decide(&mut s, 4 * S, 7);
        assert_eq!(d.outcome, Outcome::Deny { retry_after: 2 * S });
        // Long idle: full again, never more than capacity.
        let d = b.decide(&mut s, 1_000 * S, 0);
        assert_eq!(d.remaining, 10);
        assert!(b.is_idle(&s, 1_000 * S));
    }

    #[test]
    fn never_and_peek_and_refund() {
        let b = TokenBucket::new(3, 1, Duration::from_millis(100)).unwrap();
        let mut s = 0;
        assert_eq!(b.decide(&mut s, 0, 4).outcome, Outcome::Never);
        assert!(b.decide(&mut s, 0, 3).is_allowed());
        assert_eq!(b.decide(&mut s, 0, 0).remaining, 0);
        b.refund(&mut s, 0, 2);
        assert_eq!(b.decide(&mut s, 0, 0).remaining, 2);
        b.refund(&mut s, 0, 100);
        assert_eq!(b.decide(&mut s, 0, 0).remaining, 3);
    }

    #[test]
    fn clock_backwards_never_grants_more() {
        let b = TokenBucket::new(5, 5, Duration::from_secs(1)).unwrap();
        let mut s = 0;
        assert!(b.decide(&mut s, 10 * S, 5).is_allowed());
        for t in [0, S, 9 * S, 10 * S + 1] {
            assert!(!b.decide(&mut s, t, 1).is_allowed(), "at {t}");
        }
    }

    #[test]
    fn end_of_time_does_not_panic() {
        let b = TokenBucket::new(u32::MAX, 1, Duration::from_nanos(1)).unwrap();
        let mut s = 0;
        for now in [u64::MAX - 1, u64::MAX] {
            let d = b.decide(&mut s, now, u64::MAX);
            assert!(d.remaining <= u64::from(u32::MAX));
        }
    }
}
