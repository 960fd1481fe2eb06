use std::time::Duration;

use super::{mul, sat64, RateAlgorithm};
use crate::clock::duration_to_nanos;
use crate::{ConfigError, Decision, Outcome};

/// Sliding window of `buckets` counters: the window is cut into `buckets`
/// aligned buckets (`[k × b, (k + 1) × b)`, `b = window / buckets`), each
/// counts what it admitted, and a request is admitted when the last
/// `buckets` buckets (now's included) hold at most `limit − cost`. A
/// bucket's count is dropped whole once it is `buckets` buckets old: the
/// rotation is exact, and memory is `buckets` counters per key whatever
/// the limit.
///
/// **Error against a sliding log** (stated by a property test): the
/// buckets counted at `now` cover at least `window − b` of the past (the
/// current bucket is partly elapsed), never more than `window`. So on any
/// interval of `window − b` the limit holds exactly, and on any interval
/// of `window` a key holds at most `limit` plus what the one bucket at
/// the interval's start held. With traffic spread over the window that is
/// `limit / buckets` more; a client that spends its whole limit at the
/// very end of a bucket and again `window − b` later can reach twice the
/// limit in one window, as with a fixed window — more buckets narrow how
/// often that can happen, not its size. One bucket is a fixed window.
/// [`SlidingWindowCounter`](super::SlidingWindowCounter) weighs the
/// oldest window instead (two counters, no edge); the
/// [`SlidingWindowLog`](super::SlidingWindowLog) is exact.
///
/// A refund comes off the newest bucket, if it is now's: one that lands
/// a bucket after its charge frees up to its cost beyond the bound above,
/// as a fixed window's does at its edge (refunds follow their charge
/// within one request; `HotKeys`, whose leases go back later, does not
/// lease this algorithm).
///
/// A clock that goes back by fewer than 2¹⁶ buckets counts in the newest
/// bucket written (never grants more); a state further ahead of the clock
/// than that reads as fresh, as the fixed window's does, so that one
/// instance whose clock ran far ahead cannot lock a key for as long.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlidingWindowBuckets {
    limit: u32,
    bucket: u64,
    buckets: u32,
}

/// Per-key state of [`SlidingWindowBuckets`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct SlidingWindowBucketsState {
    /// The newest bucket written: its number since the clock's origin
    /// (`now / bucket`).
    pub index: u64,
    /// Units admitted per bucket, newest first: `counts[k]` is bucket
    /// `index − k`'s. Empty for a fresh key; missing entries count 0.
    pub counts: Vec<u32>,
}

/// The shortest bucket allowed.
const MIN_BUCKET: u64 = 1_000_000;

/// How far back (in buckets) a clock may step and still count in the
/// newest bucket written.
const BACKWARD_SLACK: u64 = 1 << 16;

impl SlidingWindowBuckets {
    /// The most buckets a window may have (a key's state is one `u32` per
    /// bucket: 400 bytes at most).
    pub const MAX_BUCKETS: u32 = 100;

    /// The parameters a stored state's meaning depends on: a rule whose
    /// parameters change keeps its keys' states when these stay the same.
    pub(crate) fn state_shape(&self) -> (u64, u64) {
        (self.bucket, u64::from(self.buckets))
    }

    /// Validates `limit` (at least 1), `buckets` (1 to
    /// [`Self::MAX_BUCKETS`]) and `window` (at least 1 ms a bucket). A
    /// bucket is `window / buckets` rounded down to a whole nanosecond.
    pub fn new(limit: u32, window: Duration, buckets: u32) -> Result<Self, ConfigError> {
        if limit == 0 {
            return Err(ConfigError::new("limit", "must be at least 1"));
        }
        if buckets == 0 || buckets > Self::MAX_BUCKETS {
            return Err(ConfigError::new(
                "buckets",
                format!("must be 1 to {}", Self::MAX_BUCKETS),
            ));
        }
        let bucket = duration_to_nanos(window)
            .checked_div(u64::from(buckets))
            .unwrap_or(0);
        if bucket < MIN_BUCKET {
            return Err(ConfigError::new(
                "window",
                "must be at least 1 ms for each bucket",
            ));
        }
        Ok(Self {
            limit,
            bucket,
            buckets,
        })
    }

    /// The length of one bucket, in ns.
    pub fn bucket(&self) -> u64 {
        self.bucket
    }

    /// The number of buckets in the window.
    pub fn buckets(&self) -> u32 {
        self.buckets
    }

    /// The window as the state holds it at `now`: the newest bucket's
    /// number (now's, or the stored one when the clock went back) and how
    /// many buckets the stored counts must shift to line up with it.
    fn view(&self, s: &SlidingWindowBucketsState, now: u64) -> (u64, u64) {
        let index = now.checked_div(self.bucket).unwrap_or(0);
        if s.counts.iter().all(|c| *c == 0) || s.index.saturating_sub(index) > BACKWARD_SLACK {
            // Nothing held, or held far ahead of the clock: a fresh key.
            (index, u64::from(self.buckets))
        } else if index <= s.index {
            (s.index, 0)
        } else {
            (index, index.saturating_sub(s.index))
        }
    }

    /// Bucket `newest − k`'s count, with the stored counts shifted by
    /// `shift` buckets.
    fn count(s: &SlidingWindowBucketsState, shift: u64, k: u64) -> u64 {
        k.checked_sub(shift)
            .and_then(|i| usize::try_from(i).ok())
            .and_then(|i| s.counts.get(i))
            .map_or(0, |c| u64::from(*c))
    }

    /// Nanoseconds from `now` until bucket `newest − k` leaves the window.
    fn leaves(&self, newest: u64, k: u64, now: u64) -> u64 {
        let at = mul(
            newest
                .saturating_add(u64::from(self.buckets))
                .saturating_sub(k),
            self.bucket,
        );
        sat64(at.saturating_sub(u128::from(now)))
    }
}

impl RateAlgorithm for SlidingWindowBuckets {
    type State = SlidingWindowBucketsState;

    fn decide(&self, state: &mut Self::State, now: u64, cost: u64) -> Decision {
        let limit = u64::from(self.limit);
        let n = u64::from(self.buckets);
        let (newest, shift) = self.view(state, now);
        let used: u64 = (0..n).map(|k| Self::count(state, shift, k)).sum();
        let remaining = limit.saturating_sub(used);
        let reset = (0..n)
            .find(|&k| Self::count(state, shift, k) > 0)
            .map_or(0, |k| self.leaves(newest, k, now));
        if cost == 0 {
            return Decision::allow(limit, remaining, reset);
        }
        if cost > limit {
            return Decision::with(Outcome::Never, limit, remaining, reset);
        }
        if used.saturating_add(cost) <= limit {
            // Lined up with `newest` in place: the counts shift by
            // `shift` buckets, those that left read 0 (a fresh key's
            // counts are made once, here).
            let len = usize::try_from(n).unwrap_or(usize::MAX);
            let shift = usize::try_from(shift).unwrap_or(usize::MAX).min(len);
            state.counts.resize(len, 0);
            state.counts.rotate_right(shift);
            state.counts.iter_mut().take(shift).for_each(|c| *c = 0);
            if let Some(c) = state.counts.first_mut() {
                // Below the limit, a u32.
                *c = c.saturating_add(u32::try_from(cost).unwrap_or(u32::MAX));
            }
            state.index = newest;
            return Decision::allow(
                limit,
                remaining.saturating_sub(cost),
                self.leaves(newest, 0, now),
            );
        }
        // Wait until the oldest buckets have left enough room.
        let mut left = used;
        let mut retry_after = 1;
        for k in (0..n).rev() {
            left = left.saturating_sub(Self::count(state, shift, k));
            if left.saturating_add(cost) <= limit {
                retry_after = self.leaves(newest, k, now).max(1);
                break;
            }
        }
        Decision::with(Outcome::Deny { retry_after }, limit, remaining, reset)
    }

    fn refund(&self, state: &mut Self::State, now: u64, cost: u64) {
        let (_, shift) = self.view(state, now);
        if shift == 0 {
            if let Some(c) = state.counts.first_mut() {
                *c = c.saturating_sub(u32::try_from(cost).unwrap_or(u32::MAX));
            }
        }
    }

    fn is_idle(&self, state: &Self::State, now: u64) -> bool {
        let (_, shift) = self.view(state, now);
        shift >= u64::from(self.buckets) || state.counts.iter().all(|c| *c == 0)
    }

    fn capacity(&self) -> u64 {
        u64::from(self.limit)
    }

    fn window(&self) -> u64 {
        self.bucket.saturating_mul(u64::from(self.buckets))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn buckets_leave_the_window_whole() {
        // 10 in a 10-s window of five 2-s buckets.
        let w = SlidingWindowBuckets::new(10, Duration::from_secs(10), 5).unwrap();
        let mut s = SlidingWindowBucketsState::default();
        assert!(w.decide(&mut s, S, 4).is_allowed()); // bucket 0
        assert!(w.decide(&mut s, 5 * S, 6).is_allowed()); // bucket 2
        let d = w.decide(&mut s, 9 * S, 1);
        // Bucket 0 leaves when bucket 5 starts, at 10 s.
        assert_eq!(d.outcome, Outcome::Deny { retry_after: S });
        // Whole again when bucket 2 leaves, at 14 s.
        assert_eq!(d.reset_after, 5 * S);
        assert!(!w.decide(&mut s, 10 * S - 1, 1).is_allowed());
        let d = w.decide(&mut s, 10 * S, 0);
        assert_eq!(d.remaining, 4);
        // 5 more must wait for bucket 2 too, which leaves at 14 s.
        let d = w.decide(&mut s, 10 * S, 5);
        assert_eq!(d.outcome, Outcome::Deny { retry_after: 4 * S });
        assert!(w.decide(&mut s, 10 * S, 4).is_allowed());
        assert!(w.decide(&mut s, 14 * S, 6).is_allowed());
        assert!(!w.decide(&mut s, 14 * S, 1).is_allowed());
    }

    #[test]
    fn one_bucket_is_a_fixed_window() {
        let b = SlidingWindowBuckets::new(3, Duration::from_secs(1), 1).unwrap();
        let f = super::super::FixedWindow::new(3, Duration::from_secs(1)).unwrap();
        let (mut sb, mut sf) = (SlidingWindowBucketsState::default(), 0);
        for (i, now) in [0, S / 2, S / 2, S - 1, S, S + 3, 3 * S].iter().enumerate() {
            let cost = 1 + (i as u64 % 2);
            assert_eq!(b.decide(&mut sb, *now, cost), f.decide(&mut sf, *now, cost));
        }
    }

    #[test]
    fn idle_after_a_whole_window_and_refund_in_its_bucket_only() {
        let w = SlidingWindowBuckets::new(4, Duration::from_secs(4), 4).unwrap();
        let mut s = SlidingWindowBucketsState::default();
        assert!(w.is_idle(&s, 0));
        assert!(w.decide(&mut s, S, 3).is_allowed());
        assert!(!w.is_idle(&s, 4 * S));
        assert!(w.is_idle(&s, 5 * S));
        w.refund(&mut s, 2 * S, 3); // another bucket: dropped
        assert_eq!(w.decide(&mut s, 2 * S, 0).remaining, 1);
        w.refund(&mut s, S + 1, 2);
        assert_eq!(w.decide(&mut s, 2 * S, 0).remaining, 3);
    }

    #[test]
    fn clock_backwards_never_grants_more() {
        let w = SlidingWindowBuckets::new(3, Duration::from_secs(3), 3).unwrap();
        let mut s = SlidingWindowBucketsState::default();
        assert!(w.decide(&mut s, 10 * S, 3).is_allowed());
        assert!(!w.decide(&mut s, 9 * S, 1).is_allowed());
        assert!(!w.decide(&mut s, 0, 1).is_allowed());
        assert!(w.decide(&mut s, 13 * S, 3).is_allowed());
    }

    /// A state written by a clock more than 2^16 buckets ahead reads as
    /// fresh: it cannot lock the key until the clock catches up.
    #[test]
    fn a_state_far_ahead_of_the_clock_reads_as_fresh() {
        let ms = 1_000_000;
        let w = SlidingWindowBuckets::new(3, Duration::from_millis(3), 3).unwrap();
        let mut s = SlidingWindowBucketsState::default();
        let far = 1_000 * S;
        assert!(w.decide(&mut s, far, 3).is_allowed());
        assert!(!w.decide(&mut s, far - 65_536 * ms, 1).is_allowed());
        assert!(w.decide(&mut s, far - 65_538 * ms, 3).is_allowed());
    }

    #[test]
    fn parameters_are_checked() {
        let e = |r: Result<SlidingWindowBuckets, ConfigError>| r.unwrap_err().field().to_owned();
        assert_eq!(
            e(SlidingWindowBuckets::new(0, Duration::from_secs(1), 2)),
            "limit"
        );
        assert_eq!(
            e(SlidingWindowBuckets::new(1, Duration::from_secs(1), 0)),
            "buckets"
        );
        assert_eq!(
            e(SlidingWindowBuckets::new(1, Duration::from_secs(1), 101)),
            "buckets"
        );
        assert_eq!(
            e(SlidingWindowBuckets::new(1, Duration::from_millis(9), 10)),
            "window"
        );
        let w = SlidingWindowBuckets::new(u32::MAX, Duration::from_secs(1), 3).unwrap();
        assert_eq!(w.bucket(), 333_333_333);
        assert_eq!(w.window(), 999_999_999);
        let mut s = SlidingWindowBucketsState::default();
        assert!(w.decide(&mut s, u64::MAX, u64::from(u32::MAX)).is_allowed());
        assert_eq!(w.decide(&mut s, u64::MAX, 1).remaining, 0);
        assert_eq!(w.decide(&mut s, 0, u64::MAX).outcome, Outcome::Never);
    }
}
