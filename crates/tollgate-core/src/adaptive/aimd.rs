use std::time::Duration;

use super::{check_f64, Bounds, Sample};
use crate::{duration_to_nanos, ConfigError};

/// Additive increase, multiplicative decrease, as Netflix
/// concurrency-limits' `AIMDLimit`.
///
/// On a drop (the sample says `dropped`, or its RTT is above
/// [`latency_threshold`](Self::latency_threshold) when one is set) the
/// limit becomes `max(min, floor(limit × backoff))`, once per dropped
/// sample: a hundred requests in flight that fail together in one blip of
/// the backend cut the limit by 0.9¹⁰⁰, to its minimum, from where it
/// grows back by one per success that uses it. (Cutting once per window
/// of requests in flight instead, as TCP does once per round trip, was
/// tried and kept the limit at 2.6× a queueing backend's knee against
/// 1.13× with a cut per drop, in the layer's `adaptive` test.) On a
/// success it grows
/// by one, up to `max`, if the limit is in use (`in_flight × 2 >= limit`);
/// an app-limited success leaves it alone, since a limit nobody reaches says
/// nothing about the backend and would only let a later burst through.
///
/// ```
/// use std::time::Duration;
/// use tollgate_core::adaptive::Aimd;
///
/// let aimd = Aimd::new(1, 20, 500)?
///     .backoff(0.8)?
///     .latency_threshold(Duration::from_millis(250))?;
/// assert_eq!(aimd.initial(), 20);
/// assert_eq!(Aimd::new(1, 20, 500)?.backoff(1.0).unwrap_err().field(), "backoff");
/// # Ok::<(), tollgate_core::ConfigError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Aimd {
    bounds: Bounds,
    backoff: f64,
    latency_threshold: Option<u64>,
}

impl Aimd {
    /// Bounds of the limit: `min >= 1`, `min <= initial <= max`,
    /// `max <= 1_000_000`. Errors name `"min"`, `"max"` or `"initial"`.
    pub fn new(min: u32, initial: u32, max: u32) -> Result<Self, ConfigError> {
        Ok(Self {
            bounds: Bounds::new(min, initial, max)?,
            backoff: 0.9,
            latency_threshold: None,
        })
    }

    /// The factor the limit is multiplied by on a drop: from 0.5 (halve, as
    /// TCP Reno) up to but excluding 1.0 (which would never back off).
    /// Default 0.9. Errors name `"backoff"`.
    pub fn backoff(self, factor: f64) -> Result<Self, ConfigError> {
        let backoff = check_f64("backoff", factor, 0.5..=1.0, "must be in [0.5, 1.0)")?;
        if backoff >= 1.0 {
            return Err(ConfigError::new("backoff", "must be in [0.5, 1.0)"));
        }
        Ok(Self { backoff, ..self })
    }

    /// Counts a success slower than `threshold` as a drop, so that a backend
    /// which queues instead of failing still makes the limit back off (see
    /// the module docs on limit creep). Unset by default. Must be longer
    /// than zero; errors name `"latency_threshold"`.
    pub fn latency_threshold(self, threshold: Duration) -> Result<Self, ConfigError> {
        if threshold.is_zero() {
            return Err(ConfigError::new(
                "latency_threshold",
                "must be longer than zero",
            ));
        }
        Ok(Self {
            latency_threshold: Some(duration_to_nanos(threshold)),
            ..self
        })
    }

    /// The lowest the limit goes.
    pub fn min(&self) -> u32 {
        self.bounds.min
    }

    /// The highest the limit goes.
    pub fn max(&self) -> u32 {
        self.bounds.max
    }

    /// The limit before any sample.
    pub fn initial(&self) -> u32 {
        self.bounds.initial
    }
}

/// A running AIMD limit.
#[derive(Debug, Clone)]
pub(crate) struct AimdState {
    config: Aimd,
    limit: u32,
}

impl AimdState {
    pub(crate) fn new(config: &Aimd) -> Self {
        Self {
            config: *config,
            limit: config.bounds.initial,
        }
    }

    pub(crate) fn limit(&self) -> u32 {
        self.limit
    }

    pub(crate) fn on_sample(&mut self, sample: Sample) -> u32 {
        let Bounds { min, max, .. } = self.config.bounds;
        let too_slow = self
            .config
            .latency_threshold
            .is_some_and(|threshold| sample.rtt > threshold);
        self.limit = if sample.dropped || too_slow {
            // `as` saturates and maps NaN to 0; the product of a limit of at
            // most a million and a factor below one is neither.
            let scaled = (f64::from(self.limit) * self.config.backoff).floor() as u32;
            scaled.max(min)
        } else if u64::from(sample.in_flight).saturating_mul(2) >= u64::from(self.limit) {
            self.limit.saturating_add(1).min(max)
        } else {
            self.limit
        };
        self.limit = self.limit.clamp(min, max);
        self.limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(in_flight: u32) -> Sample {
        Sample {
            rtt: 1_000,
            dropped: false,
            in_flight,
        }
    }

    fn drop_() -> Sample {
        Sample {
            dropped: true,
            ..ok(0)
        }
    }

    #[test]
    fn backoff_floors_the_product_and_stops_at_min() {
        let mut s = AimdState::new(&Aimd::new(3, 100, 200).unwrap());
        let expected = [
            90, 81, 72, 64, 57, 51, 45, 40, 36, 32, 28, 25, 22, 19, 17, 15,
        ];
        for want in expected {
            assert_eq!(s.on_sample(drop_()), want);
        }
        for want in [13, 11, 9, 8, 7, 6, 5, 4, 3, 3, 3] {
            assert_eq!(s.on_sample(drop_()), want);
        }
    }

    #[test]
    fn growth_needs_half_the_limit_in_flight() {
        let mut s = AimdState::new(&Aimd::new(1, 10, 12).unwrap());
        assert_eq!(s.on_sample(ok(4)), 10, "4 × 2 < 10: app-limited");
        assert_eq!(s.on_sample(ok(0)), 10);
        assert_eq!(s.on_sample(ok(5)), 11, "5 × 2 >= 10");
        assert_eq!(s.on_sample(ok(6)), 12);
        assert_eq!(s.on_sample(ok(u32::MAX)), 12, "capped at max");
    }

    #[test]
    fn latency_threshold_counts_slow_answers_as_drops() {
        let aimd = Aimd::new(1, 10, 20)
            .unwrap()
            .latency_threshold(Duration::from_nanos(1_000))
            .unwrap();
        let mut s = AimdState::new(&aimd);
        assert_eq!(s.on_sample(ok(10)), 11, "exactly at the threshold is fine");
        let slow = Sample {
            rtt: 1_001,
            ..ok(10)
        };
        assert_eq!(s.on_sample(slow), 9);
    }

    #[test]
    fn half_backoff_from_one_stays_at_min() {
        let mut s = AimdState::new(&Aimd::new(1, 1, 1).unwrap().backoff(0.5).unwrap());
        assert_eq!(s.on_sample(drop_()), 1);
        assert_eq!(s.on_sample(ok(u32::MAX)), 1);
    }

    #[test]
    fn errors_name_the_field() {
        let a = Aimd::new(1, 1, 1).unwrap();
        for bad in [0.49, 1.0, 1.5, f64::NAN, f64::INFINITY, -0.9] {
            assert_eq!(a.backoff(bad).unwrap_err().field(), "backoff", "{bad}");
        }
        assert!(a.backoff(0.5).is_ok());
        assert!(a.backoff(0.999).is_ok());
        assert_eq!(
            a.latency_threshold(Duration::ZERO).unwrap_err().field(),
            "latency_threshold"
        );
        assert!(a.latency_threshold(Duration::MAX).is_ok());
    }
}
