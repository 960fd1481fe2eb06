use std::collections::VecDeque;
use std::time::Duration;

use super::RateAlgorithm;
use crate::clock::duration_to_nanos;
use crate::{ConfigError, Decision, Outcome};

/// Sliding window log: exact. Admits a request if the units admitted in the
/// last `window` (the half-open interval `(now − window, now]`) plus its
/// cost are at most `limit`.
///
/// **Memory bound.** Each admitted request is one 16-byte entry (entries at
/// the same instant are merged), and since every entry holds at least one
/// unit, a key never holds more than `limit` entries: at most
/// `16 × limit` bytes, and `limit` is capped at [`Self::MAX_LIMIT`]
/// (160 KB per key). Above that, use [`SlidingWindowCounter`](super::SlidingWindowCounter),
/// whose memory does not grow with the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlidingWindowLog {
    limit: u32,
    window: u64,
}

/// Per-key state of [`SlidingWindowLog`]: the admitted requests of the
/// current window, oldest first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlidingWindowLogState {
    entries: VecDeque<Entry>,
    total: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    at: u64,
    cost: u64,
}

impl SlidingWindowLogState {
    /// Number of entries held (at most the rule's limit).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The admitted entries, oldest first, as `(instant, cost)`.
    pub fn entries(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.entries.iter().map(|e| (e.at, e.cost))
    }
}

impl SlidingWindowLog {
    /// The parameters a stored state's meaning depends on: a rule whose
    /// parameters change keeps its keys' states when these stay the same.
    pub(crate) fn state_shape(&self) -> (u64, u64) {
        (self.window, 0)
    }

    /// The largest `limit` a log accepts.
    pub const MAX_LIMIT: u32 = 10_000;

    /// Validates `limit` (1 to [`Self::MAX_LIMIT`]) and `window` (longer
    /// than zero).
    pub fn new(limit: u32, window: Duration) -> Result<Self, ConfigError> {
        if limit == 0 || limit > Self::MAX_LIMIT {
            return Err(ConfigError::new(
                "limit",
                format!(
                    "must be 1 to {} for a sliding window log (use the sliding window counter above that)",
                    Self::MAX_LIMIT
                ),
            ));
        }
        let window = duration_to_nanos(window);
        if window == 0 {
            return Err(ConfigError::new("window", "must be longer than zero"));
        }
        Ok(Self { limit, window })
    }

    /// Drops entries that left the window. Entries from the future (the
    /// clock went back) stay.
    fn expire(&self, s: &mut SlidingWindowLogState, now: u64) {
        while let Some(front) = s.entries.front() {
            if front.at.saturating_add(self.window) > now {
                break;
            }
            s.total = s.total.saturating_sub(front.cost);
            s.entries.pop_front();
        }
    }

    fn reset_after(&self, s: &SlidingWindowLogState, now: u64) -> u64 {
        s.entries
            .back()
            .map_or(0, |e| e.at.saturating_add(self.window).saturating_sub(now))
    }
}

impl RateAlgorithm for SlidingWindowLog {
    type State = SlidingWindowLogState;

    fn decide(&self, s: &mut Self::State, now: u64, cost: u64) -> Decision {
        let limit = u64::from(self.limit);
        self.expire(s, now);
        let remaining = limit.saturating_sub(s.total);
        if cost == 0 {
            return Decision::allow(limit, remaining, self.reset_after(s, now));
        }
        if cost > u64::from(self.limit) {
            return Decision::with(Outcome::Never, limit, remaining, self.reset_after(s, now));
        }
        if s.total.saturating_add(cost) <= limit {
            // A request made while the clock reads earlier than the newest
            // entry (it went back, or a thread read it before another
            // wrote) joins that entry: entries stay in time order, so the
            // newest decides when the key is idle, and the units expire
            // later rather than sooner.
            match s.entries.back_mut() {
                Some(last) if last.at >= now => last.cost = last.cost.saturating_add(cost),
                _ => s.entries.push_back(Entry { at: now, cost }),
            }
            s.total = s.total.saturating_add(cost);
            return Decision::allow(
                limit,
                remaining.saturating_sub(cost),
                self.reset_after(s, now),
            );
        }
        // Wait until enough of the oldest entries leave the window.
        let excess = s.total.saturating_add(cost).saturating_sub(limit);
        let mut freed = 0u64;
        let mut retry_after = u64::MAX;
        for e in &s.entries {
            freed = freed.saturating_add(e.cost);
            if freed >= excess {
                retry_after = e.at.saturating_add(self.window).saturating_sub(now);
                break;
            }
        }
        Decision::with(
            Outcome::Deny {
                retry_after: retry_after.max(1),
            },
            limit,
            remaining,
            self.reset_after(s, now),
        )
    }

    fn refund(&self, s: &mut Self::State, now: u64, cost: u64) {
        // A refund cannot tell which entries were the refunded request's.
        // It gives back the oldest units still in the window: the units
        // kept are then those that leave the window last, so a refund
        // never lets in more than giving back the request's own units
        // would. (Giving back the newest let in more whenever the refunded
        // request was not the newest.)
        self.expire(s, now);
        let mut left = cost;
        while left > 0 {
            let Some(first) = s.entries.front_mut() else {
                break;
            };
            let take = left.min(first.cost);
            first.cost = first.cost.saturating_sub(take);
            s.total = s.total.saturating_sub(take);
            left = left.saturating_sub(take);
            if first.cost == 0 {
                s.entries.pop_front();
            }
        }
    }

    fn is_idle(&self, s: &Self::State, now: u64) -> bool {
        s.entries
            .back()
            .is_none_or(|e| e.at.saturating_add(self.window) <= now)
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
    fn exact_window_and_bounded_entries() {
        let l = SlidingWindowLog::new(3, Duration::from_secs(10)).unwrap();
        let mut s = SlidingWindowLogState::default();
        assert!(l.decide(&mut s, S, 1).is_allowed());
        assert!(l.decide(&mut s, 2 * S, 1).is_allowed());
        assert!(l.decide(&mut s, 2 * S, 1).is_allowed());
        assert_eq!(s.len(), 2, "same-instant entries merge");
        let d = l.decide(&mut s, 5 * S, 1);
        // The entry at 1 s leaves the window at 11 s exactly.
        assert_eq!(d.outcome, Outcome::Deny { retry_after: 6 * S });
        assert!(!l.decide(&mut s, 11 * S - 1, 1).is_allowed());
        assert!(l.decide(&mut s, 11 * S, 1).is_allowed());
        // Cost 2 needs both entries at 2 s gone: 12 s.
        let d = l.decide(&mut s, 11 * S, 2);
        assert_eq!(d.outcome, Outcome::Deny { retry_after: S });
        assert_eq!(l.decide(&mut s, 11 * S, 4).outcome, Outcome::Never);
        assert!(s.len() <= 3);
    }

    #[test]
    fn entries_stay_in_time_order_when_the_clock_goes_back() {
        let l = SlidingWindowLog::new(2, Duration::from_secs(100)).unwrap();
        let mut s = SlidingWindowLogState::default();
        assert!(l.decide(&mut s, 100 * S, 1).is_allowed());
        assert!(l.decide(&mut s, 50 * S, 1).is_allowed());
        assert_eq!(s.entries().collect::<Vec<_>>(), vec![(100 * S, 2)]);
        // At 155 s both units are still in the window, and the key is not
        // idle (so no sweep can drop them).
        assert!(!l.decide(&mut s, 155 * S, 1).is_allowed());
        assert!(!l.is_idle(&s, 155 * S));
        assert!(l.is_idle(&s, 200 * S));
    }

    #[test]
    fn refund_gives_back_the_oldest_units_and_never_lets_in_more() {
        let second = 1_000_000_000;
        let l = SlidingWindowLog::new(5, Duration::from_secs(1)).unwrap();
        let mut s = SlidingWindowLogState::default();
        assert!(l.decide(&mut s, 0, 2).is_allowed()); // A
        assert!(l.decide(&mut s, 10, 3).is_allowed()); // B
                                                       // A's 2 units are refunded: the 3 units kept leave the window at
                                                       // B's time, 1 s + 10 ns, as B's own would.
        l.refund(&mut s, 10, 2);
        assert_eq!(s.entries().collect::<Vec<_>>(), vec![(10, 3)]);
        assert!(!l.decide(&mut s, second, 3).is_allowed());
        assert!(l.decide(&mut s, second + 10, 3).is_allowed());
        // Refunding more than is held empties the log; expired entries are
        // dropped first, not refunded.
        let mut s = SlidingWindowLogState::default();
        l.decide(&mut s, 0, 2);
        l.decide(&mut s, second / 2, 1);
        l.refund(&mut s, second, 1);
        assert_eq!(s.entries().count(), 0);
        assert_eq!(l.decide(&mut s, second, 0).remaining, 5);
    }

    #[test]
    fn rejects_limits_that_would_bloat_memory() {
        assert_eq!(
            SlidingWindowLog::new(SlidingWindowLog::MAX_LIMIT + 1, Duration::from_secs(1))
                .unwrap_err()
                .field(),
            "limit"
        );
    }
}
