use std::time::Duration;

use super::{check_f64, Bounds, MAX_LIMIT};
use crate::{duration_to_nanos, ConfigError};

/// A latency gradient against a probed baseline, after Envoy's adaptive
/// concurrency filter and Netflix `Gradient2`.
///
/// The design, with its defaults:
///
/// - **Baseline**: the mean RTT of [`probe_samples`](Self::probe_samples)
///   (25) requests that ran while the limit was pinned to `min`. A probe
///   waits for the backlog to drain (a sample reporting `in_flight <= min`)
///   and only counts requests that started after that, so no request that
///   queued behind the old limit pollutes the baseline. Nothing but a probe
///   moves the baseline, which is what keeps it from creeping up under
///   steady overload (see the module docs). It is a mean, not a minimum,
///   because the short-term figure it is compared with is a mean too: with
///   a bimodal backend (cache hits and misses) a minimum would read as
///   permanent congestion.
/// - **Probes**: a new controller probes first; then every
///   [`min_rtt_interval`](Self::min_rtt_interval) (60 s) ±
///   [`jitter`](Self::jitter) (15 %); and at once after five windows in a
///   row whose RTT says the baseline is stale: a limit that cannot fall
///   although the RTT asks it to (at `min` with a gradient below 1, or at
///   the congestion floor, where `limit × 0.5 + sqrt(limit) = limit`, i.e.
///   4, with the gradient clamped at 0.5: the backend became slower), or
///   an RTT under 62.5 % of the baseline (the backend became faster).
/// - **Short-term RTT**: the mean RTT of the successes in a window. A
///   window closes after `max(sample_window, limit)` samples (at least 10
///   by [`sample_window`](Self::sample_window)): about one round trip of
///   everything in flight, so each update sees the effect of the last.
/// - **Update** per window: `gradient = clamp(baseline × (1 + buffer) /
///   short_rtt, 0.5, 2.0)` with [`buffer`](Self::buffer) 0.25; `target =
///   limit × gradient + sqrt(limit)` (the square root is headroom that
///   keeps probing for capacity); `limit += smoothing × (target − limit)`
///   with [`smoothing`](Self::smoothing) 0.2; then clamp to `[min, max]`.
///   The limit is kept as a real number and read rounded down, so small
///   steps accumulate. Unloaded, the RTT is the baseline and the gradient
///   `1 + buffer`: the limit grows by about 5 % plus `0.2 × sqrt(limit)`
///   per window, that is per round trip.
/// - **App-limited**: if no sample in the window saw `in_flight × 2 >=
///   limit`, the target may lower the limit but not raise it.
/// - **Drops**: a window with a drop closes as soon as it holds
///   `sample_window` samples and uses a target of `limit × 0.5` (no
///   headroom), so with the default smoothing one drop costs 10 % of the
///   limit, at most once per `sample_window` samples. Dropped requests'
///   RTTs are not averaged (a timeout's RTT is the timeout).
///
/// ```
/// use std::time::Duration;
/// use tollgate_core::adaptive::Gradient;
///
/// let gradient = Gradient::new(2, 20, 1_000)?
///     .buffer(0.5)?
///     .min_rtt_interval(Duration::from_secs(30))?;
/// assert_eq!(gradient.min(), 2);
/// assert_eq!(gradient.buffer(-1.0).unwrap_err().field(), "buffer");
/// # Ok::<(), tollgate_core::ConfigError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gradient {
    pub(super) bounds: Bounds,
    pub(super) buffer: f64,
    pub(super) smoothing: f64,
    pub(super) min_rtt_interval: u64,
    pub(super) jitter: f64,
    pub(super) probe_samples: u32,
    pub(super) sample_window: u32,
}

impl Gradient {
    /// Bounds of the limit: `min >= 1`, `min <= initial <= max`,
    /// `max <= 1_000_000`. Errors name `"min"`, `"max"` or `"initial"`.
    pub fn new(min: u32, initial: u32, max: u32) -> Result<Self, ConfigError> {
        Ok(Self {
            bounds: Bounds::new(min, initial, max)?,
            buffer: 0.25,
            smoothing: 0.2,
            min_rtt_interval: 60_000_000_000,
            jitter: 0.15,
            probe_samples: 25,
            sample_window: 10,
        })
    }

    /// How much slower than the baseline the short-term RTT may be before
    /// the limit stops growing: 0.25 (the default) tolerates 25 % of
    /// queueing delay. From 0 to 4; errors name `"buffer"`.
    pub fn buffer(self, buffer: f64) -> Result<Self, ConfigError> {
        let buffer = check_f64("buffer", buffer, 0.0..=4.0, "must be from 0 to 4")?;
        Ok(Self { buffer, ..self })
    }

    /// The weight of each window's target in the new limit: above 0, at
    /// most 1 (no smoothing). Default 0.2; errors name `"smoothing"`.
    pub fn smoothing(self, smoothing: f64) -> Result<Self, ConfigError> {
        let smoothing = check_f64("smoothing", smoothing, 0.0..=1.0, "must be in (0, 1]")?;
        if smoothing <= 0.0 {
            return Err(ConfigError::new("smoothing", "must be in (0, 1]"));
        }
        Ok(Self { smoothing, ..self })
    }

    /// How often the baseline is re-probed, before jitter. Default 60 s;
    /// at least 1 ms. Errors name `"min_rtt_interval"`.
    pub fn min_rtt_interval(self, interval: Duration) -> Result<Self, ConfigError> {
        if interval < Duration::from_millis(1) {
            return Err(ConfigError::new(
                "min_rtt_interval",
                "must be at least 1 ms",
            ));
        }
        Ok(Self {
            min_rtt_interval: duration_to_nanos(interval),
            ..self
        })
    }

    /// The fraction by which each interval between probes is randomly
    /// lengthened or shortened. Default 0.15 (± 15 %); from 0 to 0.5.
    /// Errors name `"jitter"`.
    pub fn jitter(self, jitter: f64) -> Result<Self, ConfigError> {
        let jitter = check_f64("jitter", jitter, 0.0..=0.5, "must be from 0 to 0.5")?;
        Ok(Self { jitter, ..self })
    }

    /// How many requests a probe averages. Default 25; from 1 to 10,000.
    /// Errors name `"probe_samples"`.
    pub fn probe_samples(self, samples: u32) -> Result<Self, ConfigError> {
        if !(1..=10_000).contains(&samples) {
            return Err(ConfigError::new(
                "probe_samples",
                "must be from 1 to 10,000",
            ));
        }
        Ok(Self {
            probe_samples: samples,
            ..self
        })
    }

    /// The fewest samples in a window (a window holds `max(samples,
    /// limit)`). Default 10; from 1 to 1,000,000. Errors name
    /// `"sample_window"`.
    pub fn sample_window(self, samples: u32) -> Result<Self, ConfigError> {
        if !(1..=MAX_LIMIT).contains(&samples) {
            return Err(ConfigError::new(
                "sample_window",
                "must be from 1 to 1,000,000",
            ));
        }
        Ok(Self {
            sample_window: samples,
            ..self
        })
    }

    /// The lowest the limit goes, and the limit during a probe.
    pub fn min(&self) -> u32 {
        self.bounds.min
    }

    /// The highest the limit goes.
    pub fn max(&self) -> u32 {
        self.bounds.max
    }

    /// The limit after the first probe.
    pub fn initial(&self) -> u32 {
        self.bounds.initial
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_field() {
        let g = Gradient::new(1, 1, 1).unwrap();
        let nan = f64::NAN;
        assert_eq!(g.buffer(nan).unwrap_err().field(), "buffer");
        assert_eq!(g.buffer(4.1).unwrap_err().field(), "buffer");
        assert_eq!(g.smoothing(0.0).unwrap_err().field(), "smoothing");
        assert_eq!(g.smoothing(1.1).unwrap_err().field(), "smoothing");
        assert_eq!(g.jitter(0.6).unwrap_err().field(), "jitter");
        assert_eq!(g.jitter(nan).unwrap_err().field(), "jitter");
        assert_eq!(g.probe_samples(0).unwrap_err().field(), "probe_samples");
        assert_eq!(
            g.probe_samples(10_001).unwrap_err().field(),
            "probe_samples"
        );
        assert_eq!(g.sample_window(0).unwrap_err().field(), "sample_window");
        let tiny = Duration::from_micros(999);
        assert_eq!(
            g.min_rtt_interval(tiny).unwrap_err().field(),
            "min_rtt_interval"
        );
        assert!(g.min_rtt_interval(Duration::MAX).is_ok());
        assert!(g.buffer(0.0).and_then(|g| g.smoothing(1.0)).is_ok());
        assert!(g.jitter(0.0).and_then(|g| g.probe_samples(10_000)).is_ok());
    }
}
