use std::time::Duration;

use super::{mul, sat64, RateAlgorithm};
use crate::clock::duration_to_nanos;
use crate::{ConfigError, Decision, Outcome};

/// Fixed window: at most `limit` per window; windows are aligned to the
/// clock's origin (`[k × window, (k + 1) × window)`).
///
/// Simple and cheap, but a client may spend up to twice the limit across a
/// window boundary; prefer GCRA or a sliding window where that matters.
/// Also the algorithm behind quotas (per day, per month).
///
/// The state is one `u64`: the window number (low 32 bits) and the count
/// (32 bits), so a store updates it with one compare-and-swap. Window
/// numbers compare modulo 2³²: a clock that moves back by fewer than 2¹⁶
/// windows keeps the current count (never grants more); any other change
/// of window starts a fresh count. With windows of at least 1 ms, 2³² − 2¹⁶
/// windows are more than 49 days, and stores drop a key long before it
/// sits idle that long.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FixedWindow {
    limit: u32,
    window: u64,
}

/// How far back (in windows) a clock may step and still be seen as "back"
/// rather than as a wrapped window number.
const BACKWARD_SLACK: u32 = 1 << 16;

/// The shortest window allowed.
const MIN_WINDOW: u64 = 1_000_000;

impl FixedWindow {
    /// The parameters a stored state's meaning depends on: a rule whose
    /// parameters change keeps its keys' states when these stay the same.
    pub(crate) fn state_shape(&self) -> (u64, u64) {
        (self.window, 0)
    }

    /// Validates `limit` (at least 1) and `window` (at least 1 ms).
    pub fn new(limit: u32, window: Duration) -> Result<Self, ConfigError> {
        if limit == 0 {
            return Err(ConfigError::new("limit", "must be at least 1"));
        }
        let window = duration_to_nanos(window);
        if window < MIN_WINDOW {
            return Err(ConfigError::new("window", "must be at least 1 ms"));
        }
        Ok(Self { limit, window })
    }

    fn index(&self, now: u64) -> u64 {
        now.checked_div(self.window).unwrap_or(0)
    }

    /// The window a request at `now` counts in: `now`'s own, or the stored
    /// window when the clock went back (within the slack) from a window
    /// that holds a count. Units taken with the clock back must count
    /// against that window, or it would start afresh when the clock
    /// returns to it.
    fn window_of(&self, state: u64, now: u64) -> u64 {
        let index = self.index(now);
        let back = ((state >> 32) as u32).wrapping_sub(index as u32);
        if state as u32 != 0 && back != 0 && back <= BACKWARD_SLACK {
            index.saturating_add(u64::from(back))
        } else {
            index
        }
    }

    /// The count that applies at window `index` (truncated to 32 bits).
    fn count(state: u64, index: u32) -> u32 {
        let stored = (state >> 32) as u32;
        let count = state as u32;
        let ahead = index.wrapping_sub(stored);
        if ahead == 0 || ahead > u32::MAX - BACKWARD_SLACK {
            count
        } else {
            0
        }
    }

    fn until_next_window(&self, index: u64, now: u64) -> u64 {
        let end = mul(index.saturating_add(1), self.window);
        sat64(end.saturating_sub(u128::from(now)))
    }
}

impl RateAlgorithm for FixedWindow {
    type State = u64;

    #[inline]
    fn decide(&self, state: &mut u64, now: u64, cost: u64) -> Decision {
        let limit = u64::from(self.limit);
        let index = self.window_of(*state, now);
        let count = Self::count(*state, index as u32);
        let remaining = u64::from(self.limit.saturating_sub(count));
        let reset = if count == 0 {
            0
        } else {
            self.until_next_window(index, now)
        };
        if cost == 0 {
            return Decision::allow(limit, remaining, reset);
        }
        // Above the limit (a u32) never fits; below it, the cost is a u32.
        let Some(cost) = u32::try_from(cost).ok().filter(|c| *c <= self.limit) else {
            return Decision::with(Outcome::Never, limit, remaining, reset);
        };
        match count.checked_add(cost).filter(|c| *c <= self.limit) {
            Some(next) => {
                *state = (u64::from(index as u32) << 32) | u64::from(next);
                Decision::allow(
                    limit,
                    u64::from(self.limit.saturating_sub(next)),
                    self.until_next_window(index, now),
                )
            }
            None => Decision::with(
                Outcome::Deny {
                    retry_after: self.until_next_window(index, now),
                },
                limit,
                remaining,
                reset,
            ),
        }
    }

    fn refund(&self, state: &mut u64, now: u64, cost: u64) {
        let index = self.window_of(*state, now) as u32;
        let stored = (*state >> 32) as u32;
        if stored == index {
            let count = (*state as u32).saturating_sub(u32::try_from(cost).unwrap_or(u32::MAX));
            *state = (u64::from(stored) << 32) | u64::from(count);
        }
    }

    #[inline]
    fn is_idle(&self, state: &u64, now: u64) -> bool {
        Self::count(*state, self.index(now) as u32) == 0
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
    fn counts_per_aligned_window() {
        let w = FixedWindow::new(3, Duration::from_secs(10)).unwrap();
        let mut s = 0;
        let now = 25 * S;
        for left in [2, 1, 0] {
            assert_eq!(w.decide(&mut s, now, 1).remaining, left);
        }
        let d = w.decide(&mut s, 29 * S, 1);
        assert_eq!(d.outcome, Outcome::Deny { retry_after: S });
        // Exact boundary: 30 s opens a new window.
        assert!(!w.decide(&mut s, 30 * S - 1, 1).is_allowed());
        assert!(w.decide(&mut s, 30 * S, 3).is_allowed());
        assert_eq!(w.decide(&mut s, 30 * S, 4).outcome, Outcome::Never);
    }

    #[test]
    fn clock_backwards_keeps_the_count() {
        let w = FixedWindow::new(2, Duration::from_secs(1)).unwrap();
        let mut s = 0;
        assert!(w.decide(&mut s, 100 * S, 2).is_allowed());
        assert!(!w.decide(&mut s, 99 * S, 1).is_allowed());
        assert!(!w.decide(&mut s, 50 * S, 1).is_allowed());
        assert!(!w.is_idle(&s, 50 * S));
        assert!(w.is_idle(&s, 101 * S));
    }

    #[test]
    fn units_taken_with_the_clock_back_count_when_it_returns() {
        // Found by the property tests: the unit taken at 99.996 ms, with
        // the clock back in window 99, used to be stored under window 99,
        // so window 100 started afresh when the clock returned to it and
        // admitted two more units: four in window 100 for a limit of 2.
        let w = FixedWindow::new(2, Duration::from_millis(1)).unwrap();
        let mut s = 0;
        let now = 100 * 1_000_000;
        assert!(w.decide(&mut s, now, 1).is_allowed());
        let back = w.decide(&mut s, now - 4_000, 1);
        assert!(back.is_allowed());
        assert_eq!(back.remaining, 0);
        // Its window is the stored one: it ends where window 100 ends.
        assert_eq!(back.reset_after, 1_000_000 + 4_000);
        let d = w.decide(&mut s, now, 1);
        assert_eq!(
            d.outcome,
            Outcome::Deny {
                retry_after: 1_000_000
            }
        );
        assert_eq!(d.remaining, 0);
        // A denial with the clock back waits for the end of window 100.
        let d = w.decide(&mut s, now - 4_000, 1);
        assert_eq!(
            d.outcome,
            Outcome::Deny {
                retry_after: 1_004_000
            }
        );
        assert!(w.decide(&mut s, now + 1_000_000, 2).is_allowed());
    }

    #[test]
    fn huge_counts_and_times_do_not_overflow() {
        let w = FixedWindow::new(u32::MAX, Duration::from_millis(1)).unwrap();
        let mut s = 0;
        assert!(w.decide(&mut s, u64::MAX, u64::from(u32::MAX)).is_allowed());
        assert!(!w.decide(&mut s, u64::MAX, 1).is_allowed());
        assert_eq!(w.decide(&mut s, u64::MAX, 0).remaining, 0);
    }
}
