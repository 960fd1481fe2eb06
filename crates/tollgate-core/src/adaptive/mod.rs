//! Adaptive concurrency: a limit on requests in flight that finds itself.
//!
//! # Why adapt
//!
//! A fixed concurrency limit is a guess about the backend, and the guess is
//! wrong most of the time. Little's law says a server that answers in `rtt`
//! with `n` requests in flight serves `n / rtt` requests a second. Below the
//! point where the backend's workers are all busy (its *knee*), more
//! concurrency buys more throughput at the same latency. Past the knee the
//! extra requests only queue: throughput stays flat and every request waits
//! longer, until clients time out, retry, and the queue grows faster than it
//! drains. A limit set below the knee wastes capacity; set above it, it
//! protects nothing. And the knee moves: a deploy, a cold cache, a noisy
//! neighbour or a slow database halve it without telling anyone.
//!
//! So the limit is measured instead of configured. Every completed request
//! is a [`Sample`] (its latency, whether it failed for overload, how many
//! requests were in flight), and a [`Controller`] turns samples into the
//! current limit, the way TCP turns acknowledgements into a congestion
//! window. The caller admits a request while fewer than
//! [`Controller::limit`] are in flight and rejects (or sheds) the rest.
//! Everything here is pure: no clock reads, no I/O, no tasks; time is a
//! caller-supplied monotonic `u64` of nanoseconds.
//!
//! # Two controllers
//!
//! - [`Aimd`] (additive increase, multiplicative decrease; Netflix
//!   concurrency-limits' `AIMDLimit`): grow by one on a success while the
//!   limit is in use, shrink by a factor on a drop. It reacts only to
//!   failures, so it needs the backend (or a timeout) to fail before it
//!   backs off; [`Aimd::latency_threshold`] makes "too slow" count as a
//!   failure too.
//! - [`Gradient`] (Envoy's adaptive-concurrency filter, after Netflix
//!   `Gradient2`): compare the latency now with the latency the backend has
//!   when it is not loaded, and scale the limit by that ratio. It backs off
//!   as soon as queueing shows up in latency, before anything fails.
//!
//! [`ErrorRate`] is not a limit: it is the error ratio over a trailing
//! window, for the layer's "read-only mode" when a backend fails often.
//!
//! # Known failure modes, and what is done about them
//!
//! *Limit creep under steady overload.* A controller that learns its idea
//! of "normal" latency from the traffic it is limiting drifts with it: under
//! steady overload `Gradient2`'s long-term average RTT converges on the
//! overloaded RTT, the ratio returns to 1 and the limit creeps up (Netflix
//! concurrency-limits issues #134 and #137). [`Gradient`] never learns its
//! baseline from loaded traffic: the baseline is measured only in a
//! *probe*, during which the limit is pinned to `min` and only requests
//! that started after the backlog drained count. Between probes nothing
//! moves the baseline. What remains: a backend overloaded by *other*
//! clients (or a `min` above the backend's knee) is slow even at `min`
//! concurrency, so a probe then measures a loaded baseline and the limit
//! settles higher until a probe sees the backend unloaded again; and for a
//! probe's duration (about `probe_samples / min` round trips) throughput
//! is capped at `min`. By design the gradient settles *above* the knee,
//! where the RTT is `1 + buffer` times the baseline less the headroom
//! (about 1.5 × the knee in the tests' simulation, with the defaults).
//!
//! `AIMD` grows on every success whatever the latency, so with a backend
//! that queues instead of failing it grows until clients time out. Its
//! `latency_threshold` counts slow answers as drops. What remains: the
//! threshold is absolute, so a backend that becomes uniformly slower (not
//! overloaded) turns every answer into a drop and pins the limit at `min`;
//! and because growth is per success (doubling per round trip, like TCP's
//! slow start) while a drop only arrives one round trip later, the limit
//! overshoots and saws: in the tests' simulation its time average is the
//! knee, but it swings from `min` to over four times the knee.
//!
//! *Baseline shifts.* When the backend truly becomes slower, the old
//! baseline makes every window look congested; when it becomes faster, the
//! old baseline lets the limit overshoot the knee (to 4 × the knee in the
//! tests' simulation of a backend three times faster). [`Gradient`]
//! re-probes every `min_rtt_interval` (jittered so a fleet does not probe
//! in step), and early after five windows in a row that show the baseline
//! stale: a limit unable to fall as far as the latency asks (at `min`, or
//! at the floor where the gradient's headroom balances its halving), or a
//! latency far below the baseline (under 62.5 % of it). What
//! remains: a faster backend is usually caught only by the periodic probe,
//! because the overshooting limit's queueing hides the speed-up within a
//! few windows; shorten `min_rtt_interval` where backends change speed
//! often.
//!
//! # Example
//!
//! ```
//! use tollgate_core::adaptive::{AdaptiveLimit, Aimd, Controller, Sample};
//!
//! let aimd = Aimd::new(1, 10, 100)?.backoff(0.5)?;
//! let mut controller = Controller::new(&AdaptiveLimit::Aimd(aimd), 7);
//! assert_eq!(controller.limit(), 10);
//!
//! // A success while the limit is in use grows it by one...
//! let ok = Sample { rtt: 5_000_000, dropped: false, in_flight: 8 };
//! assert_eq!(controller.on_sample(1_000, ok), 11);
//! // ...a drop halves it.
//! let dropped = Sample { dropped: true, ..ok };
//! assert_eq!(controller.on_sample(2_000, dropped), 5);
//! # Ok::<(), tollgate_core::ConfigError>(())
//! ```

mod aimd;
mod controller;
mod error_rate;
mod gradient;
mod gradient_state;

pub use aimd::Aimd;
pub use controller::{Controller, Sample};
pub use error_rate::ErrorRate;
pub use gradient::Gradient;

use crate::ConfigError;

/// The largest `max` a limit may have: beyond a million requests in flight
/// a process has other problems, and the bound keeps every product of a
/// limit and a factor far from the ends of `u32` and `f64`'s exact range.
pub const MAX_LIMIT: u32 = 1_000_000;

/// Which controller, with its validated parameters.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum AdaptiveLimit {
    /// Additive increase, multiplicative decrease.
    Aimd(Aimd),
    /// Latency gradient against a probed baseline.
    Gradient(Gradient),
}

impl AdaptiveLimit {
    /// The lowest the limit goes.
    pub fn min(&self) -> u32 {
        match self {
            Self::Aimd(a) => a.min(),
            Self::Gradient(g) => g.min(),
        }
    }

    /// The highest the limit goes.
    pub fn max(&self) -> u32 {
        match self {
            Self::Aimd(a) => a.max(),
            Self::Gradient(g) => g.max(),
        }
    }

    /// The limit before any sample.
    pub fn initial(&self) -> u32 {
        match self {
            Self::Aimd(a) => a.initial(),
            Self::Gradient(g) => g.initial(),
        }
    }
}

/// The bounds shared by both controllers, checked in field order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Bounds {
    pub(crate) min: u32,
    pub(crate) initial: u32,
    pub(crate) max: u32,
}

impl Bounds {
    pub(crate) fn new(min: u32, initial: u32, max: u32) -> Result<Self, ConfigError> {
        if min == 0 {
            return Err(ConfigError::new("min", "must be at least 1"));
        }
        if max > MAX_LIMIT {
            return Err(ConfigError::new("max", "must be at most 1,000,000"));
        }
        if max < min {
            return Err(ConfigError::new("max", "must be at least `min`"));
        }
        if initial < min || initial > max {
            return Err(ConfigError::new("initial", "must lie within `min..=max`"));
        }
        Ok(Self { min, initial, max })
    }

    /// `x` as a limit: finite, within `[min, max]` (NaN becomes `min`).
    pub(crate) fn clamp_f64(&self, x: f64) -> f64 {
        if x.is_nan() {
            return f64::from(self.min);
        }
        x.clamp(f64::from(self.min), f64::from(self.max))
    }
}

/// A finite `f64` within `range`, or an error naming `field`.
pub(crate) fn check_f64(
    field: &'static str,
    value: f64,
    range: std::ops::RangeInclusive<f64>,
    message: &'static str,
) -> Result<f64, ConfigError> {
    if value.is_finite() && range.contains(&value) {
        Ok(value)
    } else {
        Err(ConfigError::new(field, message))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_errors_name_the_field() {
        assert_eq!(Bounds::new(0, 1, 2).unwrap_err().field(), "min");
        assert_eq!(Bounds::new(1, 1, MAX_LIMIT + 1).unwrap_err().field(), "max");
        assert_eq!(Bounds::new(5, 5, 4).unwrap_err().field(), "max");
        assert_eq!(Bounds::new(2, 1, 4).unwrap_err().field(), "initial");
        assert_eq!(Bounds::new(2, 5, 4).unwrap_err().field(), "initial");
        assert!(Bounds::new(1, 1, 1).is_ok());
        assert!(Bounds::new(1, MAX_LIMIT, MAX_LIMIT).is_ok());
    }

    #[test]
    fn clamp_never_leaks_nan_or_infinity() {
        let b = Bounds::new(2, 3, 9).unwrap();
        assert_eq!(b.clamp_f64(f64::NAN), 2.0);
        assert_eq!(b.clamp_f64(f64::INFINITY), 9.0);
        assert_eq!(b.clamp_f64(f64::NEG_INFINITY), 2.0);
        assert_eq!(b.clamp_f64(4.5), 4.5);
    }

    #[test]
    fn enum_reports_bounds() {
        let a = AdaptiveLimit::Aimd(Aimd::new(1, 2, 3).unwrap());
        let g = AdaptiveLimit::Gradient(Gradient::new(4, 5, 6).unwrap());
        assert_eq!((a.min(), a.initial(), a.max()), (1, 2, 3));
        assert_eq!((g.min(), g.initial(), g.max()), (4, 5, 6));
    }
}
