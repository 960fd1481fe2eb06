use std::time::Duration;

use super::{mul, sat64, RateAlgorithm};
use crate::clock::duration_to_nanos;
use crate::{ConfigError, Decision, Outcome, Rate};

/// Leaky bucket as a pacer (a queue that drains at `rate`): instead of
/// rejecting, it tells each request how long to wait for its turn, so the
/// protected service sees a smooth flow. A request whose wait would exceed
/// `max_delay` is denied; one whose cost alone takes longer than
/// `max_delay` to drain can never go.
///
/// A request of cost `n` is `n` unit requests in a row: it goes when its
/// last unit's turn comes, `max(now, tat) + (n − 1) × interval`, and moves
/// the queue's tail (`tat`) by `n × interval`. The state is one `u64`.
/// With `max_delay = 0` requests are spaced exactly one interval apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeakyBucket {
    interval: u64,
    max_delay: u64,
}

impl LeakyBucket {
    /// What a refund's meaning depends on: the interval between requests.
    pub(crate) fn refund_shape(&self) -> u64 {
        self.interval
    }

    /// The parameters a stored state's meaning depends on: a rule whose
    /// parameters change keeps its keys' states when these stay the same.
    pub(crate) fn state_shape(&self) -> (u64, u64) {
        (0, 0)
    }

    /// Validates `rate` (field `rate`); `max_delay` may be zero.
    pub fn new(rate: Rate, max_delay: Duration) -> Result<Self, ConfigError> {
        let interval = rate.interval_nanos("rate")?;
        Ok(Self {
            interval,
            max_delay: duration_to_nanos(max_delay),
        })
    }

    /// Nanoseconds between units.
    pub fn interval(&self) -> u64 {
        self.interval
    }

    /// The longest a request may wait, in nanoseconds.
    pub fn max_delay(&self) -> u64 {
        self.max_delay
    }

    /// Unit requests that could be admitted now with a queue ending at `tat`.
    fn remaining(&self, tat: u64, now: u64) -> u64 {
        let queued = tat.saturating_sub(now);
        match self.max_delay.checked_sub(queued) {
            Some(slack) => slack
                .checked_div(self.interval)
                .unwrap_or(0)
                .saturating_add(1),
            None => 0,
        }
    }
}

impl RateAlgorithm for LeakyBucket {
    type State = u64;

    fn decide(&self, tat: &mut u64, now: u64, cost: u64) -> Decision {
        let limit = self.capacity();
        let start = (*tat).max(now);
        let reset = start.saturating_sub(now);
        if cost == 0 {
            return Decision::allow(limit, self.remaining(start, now), reset);
        }
        let own = mul(self.interval, cost.saturating_sub(1));
        if own > u128::from(self.max_delay) {
            return Decision::with(Outcome::Never, limit, self.remaining(start, now), reset);
        }
        let delay = u128::from(reset).saturating_add(own);
        let next = u128::from(start).saturating_add(mul(self.interval, cost));
        if delay > u128::from(self.max_delay) || next > u128::from(u64::MAX) {
            let retry_after = if next > u128::from(u64::MAX) {
                u64::MAX
            } else {
                sat64(delay.saturating_sub(u128::from(self.max_delay)))
            };
            return Decision::with(
                Outcome::Deny { retry_after },
                limit,
                self.remaining(start, now),
                reset,
            );
        }
        let next = sat64(next);
        *tat = next;
        Decision::with(
            Outcome::Allow {
                delay: sat64(delay),
            },
            limit,
            self.remaining(next, now),
            next.saturating_sub(now),
        )
    }

    fn refund(&self, tat: &mut u64, now: u64, cost: u64) {
        if *tat > now {
            let back = sat64(mul(self.interval, cost));
            *tat = tat.saturating_sub(back).max(now);
        }
    }

    fn is_idle(&self, tat: &u64, now: u64) -> bool {
        *tat <= now
    }

    fn capacity(&self) -> u64 {
        self.max_delay
            .checked_div(self.interval)
            .unwrap_or(0)
            .saturating_add(1)
    }

    fn window(&self) -> u64 {
        sat64(mul(self.capacity(), self.interval))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn paces_requests_and_denies_past_max_delay() {
        // 10 per second: one every 100 ms; wait at most 250 ms.
        let b = LeakyBucket::new(Rate::per_second(10), Duration::from_millis(250)).unwrap();
        assert_eq!(b.capacity(), 3);
        let mut s = 0;
        let now = 1_000 * MS;
        let delays: Vec<_> = (0..3)
            .map(|_| b.decide(&mut s, now, 1).delay().unwrap().as_millis())
            .collect();
        assert_eq!(delays, vec![0, 100, 200]);
        let d = b.decide(&mut s, now, 1);
        assert_eq!(
            d.outcome,
            Outcome::Deny {
                retry_after: 50 * MS
            }
        );
        assert!(!b.decide(&mut s, now + 50 * MS - 1, 1).is_allowed());
        assert_eq!(
            b.decide(&mut s, now + 50 * MS, 1).outcome,
            Outcome::Allow { delay: 250 * MS }
        );
    }

    #[test]
    fn cost_waits_for_its_last_unit() {
        let b = LeakyBucket::new(Rate::per_second(10), Duration::from_millis(250)).unwrap();
        let mut s = 0;
        assert_eq!(
            b.decide(&mut s, 0, 3).outcome,
            Outcome::Allow { delay: 200 * MS }
        );
        let mut fresh = 0;
        assert_eq!(b.decide(&mut fresh, 0, 4).outcome, Outcome::Never);
    }

    #[test]
    fn zero_max_delay_spaces_exactly() {
        let b = LeakyBucket::new(Rate::per_second(10), Duration::ZERO).unwrap();
        let mut s = 0;
        assert!(b.decide(&mut s, 0, 1).is_allowed());
        assert!(!b.decide(&mut s, 100 * MS - 1, 1).is_allowed());
        assert!(b.decide(&mut s, 100 * MS, 1).is_allowed());
    }
}
