use std::time::Duration;

use crate::{duration_to_nanos, ConfigError};

const BUCKETS: u64 = 10;

/// The share of requests that failed over a trailing window, for switching
/// a service into a degraded ("read-only") mode while its backend fails.
///
/// The window is cut into ten buckets of `window / 10` (rounded up to the
/// nanosecond): a request counts from the moment it is recorded until the
/// tenth bucket boundary after its own bucket's start, so for between
/// 90 % and 100 % of the window. Ten counters instead of a log of events
/// keep the state fixed in size whatever the traffic, at the price of that
/// granularity.
///
/// Below `min_requests` requests in the window the rate is `None`: one
/// failure out of two requests says little, and a mode switch on it would
/// flap. A clock that moves backwards is taken as standing still: the
/// request counts in the newest bucket seen, and `rate` reads the window
/// ending there.
///
/// ```
/// use std::time::Duration;
/// use tollgate_core::adaptive::ErrorRate;
///
/// let mut errors = ErrorRate::new(Duration::from_secs(10), 4)?;
/// let second = 1_000_000_000;
/// errors.record(0, true);
/// errors.record(second, false);
/// errors.record(second, false);
/// assert_eq!(errors.rate(second), None); // three requests: too few
/// errors.record(2 * second, true);
/// assert_eq!(errors.rate(2 * second), Some(0.5));
/// // Ten seconds on, the first request has left the window.
/// assert_eq!(errors.rate(10 * second), None);
/// # Ok::<(), tollgate_core::ConfigError>(())
/// ```
#[derive(Debug, Clone)]
pub struct ErrorRate {
    bucket_width: u64,
    min_requests: u32,
    buckets: [Bucket; BUCKETS as usize],
    /// The newest bucket index recorded.
    newest: u64,
}

#[derive(Debug, Clone, Copy, Default)]
struct Bucket {
    /// `time / bucket_width` of the requests counted here.
    index: u64,
    requests: u32,
    errors: u32,
}

impl ErrorRate {
    /// A rate over the trailing `window` (at least 1 ms; errors name
    /// `"window"`), which is `None` below `min_requests` requests (and
    /// always with none at all).
    pub fn new(window: Duration, min_requests: u32) -> Result<Self, ConfigError> {
        if window < Duration::from_millis(1) {
            return Err(ConfigError::new("window", "must be at least 1 ms"));
        }
        Ok(Self {
            bucket_width: duration_to_nanos(window).div_ceil(BUCKETS),
            min_requests,
            buckets: [Bucket::default(); BUCKETS as usize],
            newest: 0,
        })
    }

    /// Counts one request that ended at `now`, failed or not.
    pub fn record(&mut self, now: u64, error: bool) {
        let index = self.index(now);
        self.newest = index;
        let slot = index.checked_rem(BUCKETS).unwrap_or(0);
        let Some(bucket) = usize::try_from(slot)
            .ok()
            .and_then(|slot| self.buckets.get_mut(slot))
        else {
            return;
        };
        if bucket.index != index {
            *bucket = Bucket {
                index,
                ..Bucket::default()
            };
        }
        bucket.requests = bucket.requests.saturating_add(1);
        if error {
            bucket.errors = bucket.errors.saturating_add(1);
        }
    }

    /// Errors over requests in the window ending at `now`, or `None` with
    /// fewer than `min_requests` requests (or none).
    pub fn rate(&self, now: u64) -> Option<f64> {
        let index = self.index(now);
        let (requests, errors) = self
            .buckets
            .iter()
            .filter(|b| b.index <= index && index.saturating_sub(b.index) < BUCKETS)
            .fold((0_u64, 0_u64), |(r, e), b| {
                (
                    r.saturating_add(u64::from(b.requests)),
                    e.saturating_add(u64::from(b.errors)),
                )
            });
        if requests == 0 || requests < u64::from(self.min_requests) {
            return None;
        }
        Some(errors as f64 / requests as f64)
    }

    /// The bucket of `now`, never older than the newest recorded.
    fn index(&self, now: u64) -> u64 {
        now.checked_div(self.bucket_width)
            .unwrap_or(0)
            .max(self.newest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn buckets_expire_exactly() {
        let mut r = ErrorRate::new(Duration::from_secs(1), 1).unwrap();
        r.record(150 * MS, true); // bucket 1: [100 ms, 200 ms)
        assert_eq!(r.rate(150 * MS), Some(1.0));
        assert_eq!(r.rate(1_100 * MS - 1), Some(1.0));
        assert_eq!(r.rate(1_100 * MS), None);
    }

    #[test]
    fn a_reused_slot_forgets_its_old_bucket() {
        let mut r = ErrorRate::new(Duration::from_secs(1), 1).unwrap();
        r.record(0, true);
        r.record(1_000 * MS, false); // same slot, ten buckets later
        assert_eq!(r.rate(1_000 * MS), Some(0.0));
    }

    #[test]
    fn none_below_min_requests() {
        let mut r = ErrorRate::new(Duration::from_millis(1), 3).unwrap();
        assert_eq!(r.rate(0), None);
        r.record(0, true);
        r.record(1, false);
        assert_eq!(r.rate(2), None);
        r.record(2, false);
        let rate = r.rate(2).unwrap();
        assert!((rate - 1.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn clock_going_backwards_counts_in_the_newest_bucket() {
        let mut r = ErrorRate::new(Duration::from_secs(1), 1).unwrap();
        r.record(5_000 * MS, false);
        r.record(0, true);
        assert_eq!(r.rate(0), Some(0.5));
        assert_eq!(r.rate(5_999 * MS), Some(0.5));
        assert_eq!(r.rate(6_000 * MS), None);
    }

    #[test]
    fn extremes_do_not_panic() {
        let mut r = ErrorRate::new(Duration::MAX, u32::MAX).unwrap();
        r.record(u64::MAX, true);
        r.record(0, true);
        assert_eq!(r.rate(u64::MAX), None);
        let mut r = ErrorRate::new(Duration::from_millis(1), 0).unwrap();
        r.record(u64::MAX, true);
        assert_eq!(r.rate(u64::MAX), Some(1.0));
        assert_eq!(r.rate(0), Some(1.0));
    }

    #[test]
    fn window_below_a_millisecond_is_an_error() {
        let err = ErrorRate::new(Duration::from_micros(999), 1).unwrap_err();
        assert_eq!(err.field(), "window");
    }
}
