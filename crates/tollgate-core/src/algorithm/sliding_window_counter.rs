use std::time::Duration;

use super::{div_ceil, mul, sat64, RateAlgorithm};
use crate::clock::duration_to_nanos;
use crate::{ConfigError, Decision, Outcome};

/// Sliding window counter (Cloudflare's approximation of a sliding window):
/// the count of the current aligned window plus the previous window's
/// count weighted by the part of it the sliding window still covers,
/// `ceil(previous × (window − elapsed) / window) + current`. Rounding up
/// keeps it on the safe side: it never admits more than a true sliding
/// window would if the previous window's requests were spread evenly.
///
/// Memory is three integers per key, whatever the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlidingWindowCounter {
    limit: u32,
    window: u64,
}

/// Per-key state of [`SlidingWindowCounter`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct SlidingWindowCounterState {
    /// The current window's number (`now / window`).
    pub index: u64,
    /// Units admitted in the current window.
    pub current: u64,
    /// Units admitted in the window before it.
    pub previous: u64,
}

impl SlidingWindowCounter {
    /// The parameters a stored state's meaning depends on: a rule whose
    /// parameters change keeps its keys' states when these stay the same.
    pub(crate) fn state_shape(&self) -> (u64, u64) {
        (self.window, 0)
    }

    /// Validates `limit` (at least 1) and `window` (longer than zero).
    pub fn new(limit: u32, window: Duration) -> Result<Self, ConfigError> {
        if limit == 0 {
            return Err(ConfigError::new("limit", "must be at least 1"));
        }
        let window = duration_to_nanos(window);
        if window == 0 {
            return Err(ConfigError::new("window", "must be longer than zero"));
        }
        Ok(Self { limit, window })
    }

    /// Rolls `state` forward to `now`; returns the nanoseconds elapsed in
    /// the current window. A clock that went back reads as the start of
    /// the stored window (the previous window then weighs fully).
    fn roll(&self, s: &mut SlidingWindowCounterState, now: u64) -> u64 {
        let index = now.checked_div(self.window).unwrap_or(0);
        if index > s.index || (s.current == 0 && s.previous == 0) {
            s.previous = if index == s.index.saturating_add(1) {
                s.current
            } else {
                0
            };
            s.current = 0;
            s.index = index;
        }
        if index < s.index {
            0
        } else {
            sat64(u128::from(now).saturating_sub(mul(index, self.window)))
        }
    }

    fn weighted(&self, previous: u64, elapsed: u64) -> u64 {
        let left = self.window.saturating_sub(elapsed);
        sat64(div_ceil(mul(previous, left), u128::from(self.window)))
    }

    /// Elapsed time in a window at which `ceil(count × (w − e) / w) <= room`.
    fn elapsed_for(&self, count: u64, room: u64) -> u64 {
        if count == 0 {
            return 0;
        }
        let keep = mul(room, self.window)
            .checked_div(u128::from(count))
            .unwrap_or(0);
        sat64(u128::from(self.window).saturating_sub(keep))
    }

    fn reset_after(&self, s: &SlidingWindowCounterState, elapsed: u64) -> u64 {
        let left = self.window.saturating_sub(elapsed);
        if s.current > 0 {
            left.saturating_add(self.window)
        } else if s.previous > 0 {
            left
        } else {
            0
        }
    }
}

impl RateAlgorithm for SlidingWindowCounter {
    type State = SlidingWindowCounterState;

    fn decide(&self, state: &mut Self::State, now: u64, cost: u64) -> Decision {
        let limit = u64::from(self.limit);
        let mut s = *state;
        let elapsed = self.roll(&mut s, now);
        let used = self.weighted(s.previous, elapsed).saturating_add(s.current);
        let remaining = limit.saturating_sub(used);
        let reset = self.reset_after(&s, elapsed);
        if cost == 0 {
            return Decision::allow(limit, remaining, reset);
        }
        if cost > u64::from(self.limit) {
            return Decision::with(Outcome::Never, limit, remaining, reset);
        }
        if used.saturating_add(cost) <= limit {
            s.current = s.current.saturating_add(cost);
            *state = s;
            let remaining = remaining.saturating_sub(cost);
            return Decision::allow(limit, remaining, self.reset_after(&s, elapsed));
        }
        let retry_after = match limit.checked_sub(s.current.saturating_add(cost)) {
            // The current window has room; wait for the previous to fade.
            Some(room) => self.elapsed_for(s.previous, room).saturating_sub(elapsed),
            // Wait for the next window, where the current count fades in turn.
            None => self
                .window
                .saturating_sub(elapsed)
                .saturating_add(self.elapsed_for(s.current, limit.saturating_sub(cost))),
        };
        Decision::with(
            Outcome::Deny {
                retry_after: retry_after.max(1),
            },
            limit,
            remaining,
            reset,
        )
    }

    fn refund(&self, state: &mut Self::State, now: u64, cost: u64) {
        let index = now.checked_div(self.window).unwrap_or(0);
        if index == state.index {
            state.current = state.current.saturating_sub(cost);
        }
    }

    fn is_idle(&self, state: &Self::State, now: u64) -> bool {
        let index = now.checked_div(self.window).unwrap_or(0);
        (state.current == 0 && state.previous == 0)
            || (index > state.index.saturating_add(1))
            || (index == state.index.saturating_add(1) && state.current == 0)
    }

    fn capacity(&self) -> u64 {
        u64::from(self.limit)
    }

    fn window(&self) -> u64 {
        self.window
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn previous_window_fades_linearly() {
        let w = SlidingWindowCounter::new(10, Duration::from_secs(10)).unwrap();
        let mut s = SlidingWindowCounterState::default();
        assert!(w.decide(&mut s, 5 * S, 10).is_allowed());
        let d = w.decide(&mut s, 9 * S, 1);
        // Must wait for the next window and for 1/10 of the previous to fade.
        assert_eq!(d.outcome, Outcome::Deny { retry_after: S + S });
        // 11 s: previous = 10, weight 9/10 -> 9 used, 1 left.
        let d = w.decide(&mut s, 11 * S, 0);
        assert_eq!(d.remaining, 1);
        assert!(w.decide(&mut s, 11 * S, 1).is_allowed());
        let d = w.decide(&mut s, 11 * S, 2);
        // current 1 + 2 = 3 <= 10: room 7, previous must weigh <= 7 -> elapsed >= 3 s.
        assert_eq!(d.outcome, Outcome::Deny { retry_after: 2 * S });
        assert!(!w.decide(&mut s, 13 * S - 1, 2).is_allowed());
        assert!(w.decide(&mut s, 13 * S, 2).is_allowed());
    }

    #[test]
    fn long_gap_forgets_everything() {
        let w = SlidingWindowCounter::new(3, Duration::from_secs(1)).unwrap();
        let mut s = SlidingWindowCounterState::default();
        assert!(w.decide(&mut s, 0, 3).is_allowed());
        assert!(!w.is_idle(&s, S));
        assert!(w.is_idle(&s, 2 * S));
        assert_eq!(w.decide(&mut s, 2 * S, 0).remaining, 3);
    }

    #[test]
    fn clock_backwards_never_grants_more() {
        let w = SlidingWindowCounter::new(3, Duration::from_secs(1)).unwrap();
        let mut s = SlidingWindowCounterState::default();
        assert!(w.decide(&mut s, 10 * S, 3).is_allowed());
        assert!(!w.decide(&mut s, 9 * S, 1).is_allowed());
        assert!(!w.decide(&mut s, 0, 1).is_allowed());
    }
}
