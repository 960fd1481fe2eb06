//! The layer's side of an adaptive service limit: the in-flight count, the
//! controller from [`tollgate_core::adaptive`](https://docs.rs/tollgate-core/latest/tollgate_core/adaptive/) fed with each response, and
//! the error rate behind read-only mode.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;
use tollgate_core::adaptive::{AdaptiveLimit, Controller, ErrorRate, Sample};
use tollgate_core::{duration_to_nanos, Decision, Outcome};

use crate::outcome::Completion;

pub(crate) type DropFn = Arc<dyn Fn(Completion) -> bool + Send + Sync>;

/// How often refused acquires let the controller see time pass.
const TICK_NS: u64 = 100_000_000;

/// Read-only mode: while the error rate over `window` is above
/// `threshold`, only safe methods go through.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ReadOnly {
    pub(crate) threshold: f64,
    pub(crate) window: Duration,
    pub(crate) min_requests: u32,
}

pub(crate) struct Adaptive {
    pub(crate) name: Arc<str>,
    config: AdaptiveLimit,
    controller: Mutex<Controller>,
    limit: AtomicU32,
    in_flight: AtomicU32,
    /// When the controller last saw time pass without a sample (see
    /// `tick`), in the controller's nanoseconds.
    ticked: AtomicU64,
    base: Instant,
    errors: Option<(Mutex<ErrorRate>, f64)>,
    degraded: AtomicBool,
    is_drop: DropFn,
    retry_after: u64,
    gauge: metrics::Gauge,
}

impl std::fmt::Debug for Adaptive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Adaptive")
            .field("name", &self.name)
            .field("limit", &self.limit)
            .field("in_flight", &self.in_flight)
            .finish_non_exhaustive()
    }
}

impl Adaptive {
    pub(crate) fn new(
        name: Arc<str>,
        config: AdaptiveLimit,
        read_only: Option<ReadOnly>,
        is_drop: DropFn,
        retry_after: Duration,
    ) -> Result<Self, tollgate_core::ConfigError> {
        let errors = match read_only {
            Some(r) => Some((
                Mutex::new(ErrorRate::new(r.window, r.min_requests)?),
                r.threshold,
            )),
            None => None,
        };
        // A seed per instance, so a fleet's re-probes do not fall in step.
        let seed = {
            use std::hash::BuildHasher;
            std::collections::hash_map::RandomState::new().hash_one(&*name)
        };
        let controller = Controller::new(&config, seed);
        let gauge = crate::observe::ConcurrencyMetrics::limit(&name);
        gauge.set(f64::from(controller.limit()));
        Ok(Self {
            name,
            limit: AtomicU32::new(controller.limit()),
            controller: Mutex::new(controller),
            config,
            in_flight: AtomicU32::new(0),
            ticked: AtomicU64::new(0),
            base: Instant::now(),
            errors,
            degraded: AtomicBool::new(false),
            is_drop,
            retry_after: duration_to_nanos(retry_after),
            gauge,
        })
    }

    fn now(&self) -> u64 {
        duration_to_nanos(Instant::now().saturating_duration_since(self.base))
    }

    /// The current limit.
    pub(crate) fn limit(&self) -> u32 {
        self.limit.load(Ordering::Relaxed)
    }

    /// Takes `permits` if they fit under the current limit (or, for
    /// non-critical traffic, under `share` of it).
    pub(crate) fn try_acquire(&self, permits: u32, share: Option<f64>) -> Decision {
        let limit = self.limit();
        let ceiling = match share {
            Some(share) => non_critical_ceiling(limit, share),
            None => limit,
        };
        let max = u64::from(self.config.max());
        let decision = |outcome, held: u32| Decision {
            outcome,
            limit: u64::from(limit),
            remaining: u64::from(ceiling.saturating_sub(held)),
            reset_after: 0,
        };
        let mut held = self.in_flight.load(Ordering::Acquire);
        if permits == 0 {
            return decision(Outcome::Allow { delay: 0 }, held);
        }
        if u64::from(permits) > max {
            return decision(Outcome::Never, held);
        }
        loop {
            let next = held.saturating_add(permits);
            if next > ceiling {
                // Full: time passing may end a probe that gets no samples.
                self.tick();
                return decision(
                    Outcome::Deny {
                        retry_after: self.retry_after,
                    },
                    held,
                );
            }
            match self.in_flight.compare_exchange_weak(
                held,
                next,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return decision(Outcome::Allow { delay: 0 }, next),
                Err(actual) => held = actual,
            }
        }
    }

    /// Lets the controller see time pass (a probe that got no samples
    /// ends by time): at most every 100 ms, from refused acquires.
    fn tick(&self) {
        let now = self.now();
        let last = self.ticked.load(Ordering::Relaxed);
        if now.saturating_sub(last) < TICK_NS
            || self
                .ticked
                .compare_exchange(last, now, Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        let mut controller = self
            .controller
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let limit = controller.on_tick(now);
        if self.limit.swap(limit, Ordering::AcqRel) != limit {
            self.gauge.set(f64::from(limit));
        }
    }

    pub(crate) fn release(&self, permits: u32) {
        let _ = self
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                Some(held.saturating_sub(permits))
            });
    }

    /// The round-trip time of a request admitted at `started`, up to now
    /// (its response's head): what its sample measures.
    pub(crate) fn rtt_since(started: Instant) -> u64 {
        duration_to_nanos(Instant::now().saturating_duration_since(started))
    }

    /// Feeds one finished request: its round-trip time to the response's
    /// head, and how it ended (known at the head, or — for a gRPC answer
    /// with trailing status — at the body's end). Cancelled requests never
    /// get here: they give no sample.
    pub(crate) fn complete(&self, rtt: u64, completion: Completion) {
        let dropped = (self.is_drop)(completion);
        let now = self.now();
        let sample = Sample {
            rtt,
            dropped,
            in_flight: self.in_flight.load(Ordering::Acquire),
        };
        {
            // Published under the controller's lock, so that a sample
            // computed before a probe started cannot overwrite the probe's
            // limit after it.
            let mut controller = self
                .controller
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let limit = controller.on_sample(now, sample);
            if self.limit.swap(limit, Ordering::AcqRel) != limit {
                self.gauge.set(f64::from(limit));
            }
        }
        if let Some((errors, threshold)) = &self.errors {
            let mut errors = errors.lock().unwrap_or_else(PoisonError::into_inner);
            errors.record(now, dropped);
            let degraded = errors.rate(now).is_some_and(|r| r > *threshold);
            self.degraded.store(degraded, Ordering::Release);
        }
    }

    /// Whether the service is degraded: its error rate is above the
    /// read-only threshold.
    pub(crate) fn degraded(&self) -> bool {
        if !self.degraded.load(Ordering::Acquire) {
            return false;
        }
        // Errors age out of the window even when no request completes
        // (every write refused, reads rare): look again.
        let Some((errors, threshold)) = &self.errors else {
            return false;
        };
        let now = self.now();
        let degraded = errors
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .rate(now)
            .is_some_and(|r| r > *threshold);
        self.degraded.store(degraded, Ordering::Release);
        degraded
    }

    /// The retry hint of refusals.
    pub(crate) fn retry_after(&self) -> u64 {
        self.retry_after
    }
}

/// The ceiling of non-critical traffic: `share` of `max`, at least 1.
pub(crate) fn non_critical_ceiling(max: u32, share: f64) -> u32 {
    let scaled = (f64::from(max) * share).floor();
    if scaled >= f64::from(max) {
        max
    } else if scaled >= 1.0 {
        // In range: below `max`, so it fits a u32.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let v = scaled as u32;
        v
    } else {
        1
    }
}
