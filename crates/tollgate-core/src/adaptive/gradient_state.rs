//! The running state of a [`Gradient`] limit: probes, windows, updates.

use super::{Bounds, Gradient, Sample};

/// The gradient is clamped to this range per window (Envoy's bounds): at
/// most halve, at most double.
const MIN_GRADIENT: f64 = 0.5;
const MAX_GRADIENT: f64 = 2.0;
/// After this many windows in a row whose RTT says the baseline is stale,
/// the baseline is re-probed at once (Envoy's "consecutive windows at min
/// concurrency" rule, widened to both directions).
const STALE_WINDOWS_BEFORE_PROBE: u32 = 5;
/// A window whose mean RTT is under the baseline divided by this (62.5 %)
/// says the baseline is stale: the backend became faster.
const FAST_RATIO: f64 = 1.6;
/// The longest a probe lasts, in nanoseconds, however few samples come (a
/// service whose every request is a long stream, or no traffic at all):
/// then it ends with what it measured, or the baseline it had.
pub(crate) const MAX_PROBE_NS: u64 = 10_000_000_000;

/// A running mean of RTTs; `u128` so no sum of `u32::MAX` `u64`s overflows.
#[derive(Debug, Clone, Copy, Default)]
struct Mean {
    sum: u128,
    count: u32,
}

impl Mean {
    fn add(&mut self, rtt: u64) {
        self.sum = self.sum.saturating_add(u128::from(rtt));
        self.count = self.count.saturating_add(1);
    }

    fn get(&self) -> Option<u64> {
        let mean = self.sum.checked_div(u128::from(self.count))?;
        Some(u64::try_from(mean).unwrap_or(u64::MAX))
    }
}

#[derive(Debug, Clone, Copy)]
struct Probe {
    /// When a sample first showed the backlog drained; requests that
    /// started at or after it ran under the pinned limit.
    drained_at: Option<u64>,
    clean: Mean,
    any: Mean,
    seen: u64,
    /// A probe whose backlog never seems to drain (the caller's `in_flight`
    /// counts something else) ends after this many samples.
    give_up_after: u64,
    /// When it began (or was first seen running): it ends by time too.
    started_at: Option<u64>,
}

impl Probe {
    fn new(drained_at: Option<u64>, backlog: u32, probe_samples: u32) -> Self {
        Self {
            drained_at,
            clean: Mean::default(),
            any: Mean::default(),
            seen: 0,
            give_up_after: u64::from(backlog)
                .saturating_add(u64::from(probe_samples).saturating_mul(4)),
            started_at: drained_at,
        }
    }

    /// Whether the probe has run its longest at `now`.
    fn timed_out(&mut self, now: u64) -> bool {
        let started = *self.started_at.get_or_insert(now);
        now.saturating_sub(started) >= MAX_PROBE_NS
    }

    /// Takes a sample; true when the probe is over.
    fn observe(&mut self, now: u64, sample: Sample, min: u32, probe_samples: u32) -> bool {
        self.seen = self.seen.saturating_add(1);
        let timed_out = self.timed_out(now);
        if self.drained_at.is_none() && sample.in_flight <= min {
            self.drained_at = Some(now);
        }
        if !sample.dropped {
            self.any.add(sample.rtt);
            let started = now.saturating_sub(sample.rtt);
            if self.drained_at.is_some_and(|drained| started >= drained) {
                self.clean.add(sample.rtt);
            }
        }
        self.clean.count >= probe_samples || self.seen >= self.give_up_after || timed_out
    }
}

#[derive(Debug, Clone, Copy)]
enum Phase {
    Probing(Probe),
    Tracking,
}

#[derive(Debug, Clone, Copy, Default)]
struct Window {
    rtt: Mean,
    samples: u32,
    drops: u32,
    max_in_flight: u32,
}

/// A running gradient limit.
#[derive(Debug, Clone)]
pub(crate) struct GradientState {
    config: Gradient,
    /// The limit outside probes, finite and within `[min, max]`.
    estimate: f64,
    baseline: Option<u64>,
    phase: Phase,
    window: Window,
    next_probe_at: u64,
    stale_windows: u32,
    rng: u64,
}

impl GradientState {
    pub(crate) fn new(config: &Gradient, seed: u64) -> Self {
        let bounds = config.bounds;
        Self {
            config: *config,
            estimate: f64::from(bounds.initial),
            baseline: None,
            // Pinned to `min` since construction: every request started
            // under the pinned limit, so all of them count.
            phase: Phase::Probing(Probe::new(Some(0), bounds.initial, config.probe_samples)),
            window: Window::default(),
            next_probe_at: u64::MAX,
            stale_windows: 0,
            rng: seed,
        }
    }

    pub(crate) fn limit(&self) -> u32 {
        let Bounds { min, max, .. } = self.config.bounds;
        match self.phase {
            Phase::Probing(_) => min,
            // `as` saturates; the clamp keeps the promise whatever happened.
            Phase::Tracking => (self.estimate as u32).clamp(min, max),
        }
    }

    pub(crate) fn on_sample(&mut self, now: u64, sample: Sample) -> u32 {
        let Gradient {
            bounds,
            probe_samples,
            sample_window,
            ..
        } = self.config;
        match &mut self.phase {
            Phase::Probing(probe) => {
                if probe.observe(now, sample, bounds.min, probe_samples) {
                    let measured = probe.clean.get().or(probe.any.get());
                    self.finish_probe(now, measured, sample.in_flight);
                }
            }
            Phase::Tracking if now >= self.next_probe_at => self.start_probe(sample.in_flight),
            Phase::Tracking => {
                let size = sample_window.max(self.limit());
                let w = &mut self.window;
                w.samples = w.samples.saturating_add(1);
                w.max_in_flight = w.max_in_flight.max(sample.in_flight);
                if sample.dropped {
                    w.drops = w.drops.saturating_add(1);
                } else {
                    w.rtt.add(sample.rtt);
                }
                if w.samples >= size || (w.drops > 0 && w.samples >= sample_window) {
                    self.close_window(sample.in_flight);
                }
            }
        }
        self.limit()
    }

    /// Time passing with no sample: a probe that has run its longest
    /// ([`MAX_PROBE_NS`]) ends with what it measured, or the baseline it
    /// had, so that a service whose requests give no samples is not held
    /// at `min`. Returns the limit.
    pub(crate) fn on_tick(&mut self, now: u64) -> u32 {
        if let Phase::Probing(probe) = &mut self.phase {
            if probe.timed_out(now) {
                let measured = probe.clean.get().or(probe.any.get());
                self.finish_probe(now, measured, 0);
                if self.baseline.is_none() {
                    // Nothing measured, ever: go on at `initial` rather
                    // than probe again at once.
                    self.phase = Phase::Tracking;
                }
            }
        }
        self.limit()
    }

    /// Pins the limit to `min` until a new baseline is measured. `backlog`
    /// (requests still in flight, bounded by `max` against a caller's
    /// nonsense) bounds how long the probe waits for them to drain.
    fn start_probe(&mut self, backlog: u32) {
        let backlog = backlog.min(self.config.bounds.max).max(self.limit());
        self.phase = Phase::Probing(Probe::new(None, backlog, self.config.probe_samples));
        self.window = Window::default();
        self.stale_windows = 0;
    }

    fn finish_probe(&mut self, now: u64, measured: Option<u64>, backlog: u32) {
        self.baseline = measured.or(self.baseline);
        self.window = Window::default();
        self.stale_windows = 0;
        self.phase = Phase::Tracking;
        let pause = self.jittered_interval();
        self.next_probe_at = now.saturating_add(pause);
        if self.baseline.is_none() {
            // Every probe sample was a drop: nothing to compare with yet.
            self.start_probe(backlog);
        }
    }

    fn close_window(&mut self, backlog: u32) {
        let window = std::mem::take(&mut self.window);
        let before = self.limit();
        let limit = self.estimate;
        // baseline / short RTT, for RTT windows; `None` for drop windows.
        let mut speed = None;
        let target = if window.drops > 0 {
            limit * MIN_GRADIENT
        } else {
            let (Some(short), Some(baseline)) = (window.rtt.get(), self.baseline) else {
                return;
            };
            // Both at least 1 ns, so the ratios are finite and positive.
            let ratio = baseline.max(1) as f64 / short.max(1) as f64;
            speed = Some(ratio);
            let gradient = ratio * (1.0 + self.config.buffer);
            let target = limit * gradient.clamp(MIN_GRADIENT, MAX_GRADIENT) + limit.sqrt();
            if f64::from(window.max_in_flight) * 2.0 < limit {
                target.min(limit)
            } else {
                target
            }
        };
        let smoothing = self.config.smoothing;
        let next = limit * (1.0 - smoothing) + target * smoothing;
        let bounds = self.config.bounds;
        self.estimate = bounds.clamp_f64(next);
        let after = self.limit();
        let stale = speed.is_some_and(|ratio| {
            let gradient = ratio * (1.0 + self.config.buffer);
            let at_floor = gradient <= MIN_GRADIENT || (after <= bounds.min && gradient < 1.0);
            (after >= before && at_floor) || ratio >= FAST_RATIO
        });
        if stale {
            self.stale_windows = self.stale_windows.saturating_add(1);
            if self.stale_windows >= STALE_WINDOWS_BEFORE_PROBE {
                self.start_probe(backlog);
            }
        } else {
            self.stale_windows = 0;
        }
    }

    /// `min_rtt_interval × (1 ± jitter)`, from a splitmix64 stream.
    fn jittered_interval(&mut self) -> u64 {
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        // 53 random bits as a fraction in [0, 1), then spread to [-1, 1).
        let unit = (z >> 11) as f64 / (1_u64 << 53) as f64;
        let factor = 1.0 + self.config.jitter * (2.0 * unit - 1.0);
        // At most 1.5 × `u64::MAX`: `as` saturates.
        (self.config.min_rtt_interval as f64 * factor) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const MS: u64 = 1_000_000;

    fn ok(rtt: u64, in_flight: u32) -> Sample {
        Sample {
            rtt,
            dropped: false,
            in_flight,
        }
    }

    /// A controller past its first probe, with a baseline of `baseline`.
    fn tracking(config: Gradient, baseline: u64) -> (GradientState, u64) {
        let mut s = GradientState::new(&config, 1);
        let mut now = 0;
        for _ in 0..config.probe_samples {
            now += baseline;
            s.on_sample(now, ok(baseline, config.min()));
        }
        assert!(matches!(s.phase, Phase::Tracking));
        assert_eq!(s.baseline, Some(baseline));
        (s, now)
    }

    #[test]
    fn first_probe_pins_min_then_resumes_initial() {
        let config = Gradient::new(2, 20, 100).unwrap().probe_samples(3).unwrap();
        let mut s = GradientState::new(&config, 1);
        assert_eq!(s.limit(), 2);
        assert_eq!(s.on_sample(10 * MS, ok(10 * MS, 2)), 2);
        assert_eq!(s.on_sample(20 * MS, ok(12 * MS, 2)), 2);
        assert_eq!(s.on_sample(30 * MS, ok(14 * MS, 1)), 20);
        assert_eq!(s.baseline, Some(12 * MS));
    }

    /// Concurrency review (C1): a probe that gets no samples (every
    /// request a long stream; no traffic) ended never, and held the limit
    /// at `min`. It ends by time.
    #[test]
    fn a_probe_without_samples_ends_by_time() {
        const S: u64 = 1_000_000_000;
        let config = Gradient::new(2, 20, 100).unwrap();
        // The first probe, from construction, with no sample at all.
        let mut s = GradientState::new(&config, 1);
        assert_eq!(s.on_tick(5 * S), 2);
        assert_eq!(s.on_tick(10 * S), 20, "resumes at `initial`");
        assert!(matches!(s.phase, Phase::Tracking));
        // A re-probe with one sample of 25: ends 10 s after it was first
        // seen running, with that sample as its baseline.
        let (mut s, now) = tracking(config.probe_samples(25).unwrap(), 10 * MS);
        s.start_probe(2);
        assert_eq!(s.on_sample(now + MS, ok(30 * MS, 1)), 2);
        assert_eq!(s.on_tick(now + 5 * S), 2);
        assert_eq!(s.on_tick(now + MS + 10 * S), 20);
        assert_eq!(s.baseline, Some(30 * MS));
    }

    #[test]
    fn probe_ignores_requests_that_queued_behind_the_old_limit() {
        let config = Gradient::new(2, 20, 100).unwrap().probe_samples(2).unwrap();
        let (mut s, mut now) = tracking(config, 10 * MS);
        s.start_probe(20);
        now += MS;
        // The backlog drains: 19 slow answers, the last one reports 2.
        for in_flight in (2..=20).rev() {
            now += MS;
            assert_eq!(s.on_sample(now, ok(50 * MS, in_flight)), 2);
        }
        // Started before the drain: ignored.
        assert_eq!(s.on_sample(now + MS, ok(40 * MS, 2)), 2);
        // Started after it.
        assert_eq!(s.on_sample(now + 10 * MS, ok(9 * MS, 2)), 2);
        assert_eq!(s.on_sample(now + 12 * MS, ok(11 * MS, 1)), 20);
        assert_eq!(s.baseline, Some(10 * MS));
    }

    #[test]
    fn probe_that_never_drains_gives_up() {
        let config = Gradient::new(2, 20, 100).unwrap().probe_samples(1).unwrap();
        let mut s = GradientState::new(&config, 1);
        s.phase = Phase::Probing(Probe::new(None, 20, 1));
        for i in 0..23 {
            assert_eq!(s.on_sample(i, ok(7 * MS, 50)), 2);
        }
        assert_eq!(s.on_sample(23, ok(7 * MS, 50)), 20);
        assert_eq!(s.baseline, Some(7 * MS));
    }

    #[test]
    fn window_applies_gradient_headroom_and_smoothing() {
        let config = Gradient::new(1, 16, 1_000).unwrap();
        let (mut s, mut now) = tracking(config, 10 * MS);
        // 16 samples at the baseline: gradient 1.25, target 16 × 1.25 + 4
        // = 24, new = 16 + 0.2 × (24 − 16) = 17.6.
        for _ in 0..16 {
            now += MS;
            s.on_sample(now, ok(10 * MS, 16));
        }
        assert!((s.estimate - 17.6).abs() < 1e-9, "{}", s.estimate);
        assert_eq!(s.limit(), 17);
    }

    #[test]
    fn congestion_is_clamped_to_halving_and_drops_cost_ten_percent() {
        let config = Gradient::new(1, 100, 1_000).unwrap();
        let (mut s, mut now) = tracking(config, 10 * MS);
        for _ in 0..100 {
            now += MS;
            s.on_sample(now, ok(1_000 * MS, 100));
        }
        // target = 100 × 0.5 + 10 = 60, new = 80 + 12 = 92.
        assert!((s.estimate - 92.0).abs() < 1e-9, "{}", s.estimate);
        for _ in 0..9 {
            now += MS;
            s.on_sample(now, ok(10 * MS, 92));
        }
        let dropped = Sample {
            dropped: true,
            ..ok(0, 92)
        };
        assert_eq!(s.on_sample(now + MS, dropped), 82, "92 × 0.9 = 82.8");
    }

    #[test]
    fn app_limited_windows_do_not_grow() {
        let config = Gradient::new(1, 40, 1_000).unwrap();
        let (mut s, mut now) = tracking(config, 10 * MS);
        for _ in 0..400 {
            now += MS;
            s.on_sample(now, ok(MS, 19));
        }
        assert_eq!(s.limit(), 40);
    }

    #[test]
    fn reprobes_after_the_jittered_interval() {
        let config = Gradient::new(1, 10, 1_000)
            .unwrap()
            .min_rtt_interval(Duration::from_secs(1))
            .unwrap();
        let (mut s, now) = tracking(config, 10 * MS);
        let due = s.next_probe_at;
        assert!((now + 850 * MS..=now + 1_150 * MS).contains(&due), "{due}");
        s.on_sample(due - 1, ok(10 * MS, 10));
        assert!(matches!(s.phase, Phase::Tracking));
        assert_eq!(s.on_sample(due, ok(10 * MS, 10)), 1);
    }

    #[test]
    fn jitter_differs_by_seed_and_stays_in_range() {
        let config = Gradient::new(1, 1, 1).unwrap();
        let mut seen = std::collections::HashSet::new();
        for seed in [0, 1, 2, u64::MAX] {
            let mut s = GradientState::new(&config, seed);
            for _ in 0..100 {
                let pause = s.jittered_interval();
                assert!((51_000 * MS..=69_000 * MS).contains(&pause), "{pause}");
                seen.insert(pause);
            }
        }
        assert!(seen.len() > 390);
    }

    /// Feeds `windows` windows of `window` samples at `rtt`, each sample
    /// seeing the limit in use; true if a probe started.
    fn feed(s: &mut GradientState, now: &mut u64, windows: u32, window: u32, rtt: u64) -> bool {
        for _ in 0..windows * window {
            *now += MS;
            s.on_sample(*now, ok(rtt, s.limit()));
            if matches!(s.phase, Phase::Probing(_)) {
                return true;
            }
        }
        false
    }

    #[test]
    fn reprobes_after_five_windows_stuck_at_min() {
        // Gradient 0.625: not clamped, but the limit cannot go below min.
        let config = Gradient::new(10, 10, 100).unwrap();
        let (mut s, mut now) = tracking(config, 10 * MS);
        assert!(!feed(&mut s, &mut now, 4, 10, 20 * MS));
        assert_eq!(s.limit(), 10);
        assert!(feed(&mut s, &mut now, 1, 10, 20 * MS));
    }

    #[test]
    fn reprobes_after_five_windows_stuck_at_the_congestion_floor() {
        let config = Gradient::new(1, 4, 100).unwrap();
        let (mut s, mut now) = tracking(config, 10 * MS);
        assert!(!feed(&mut s, &mut now, 4, 10, 100 * MS));
        assert_eq!(s.limit(), 4, "4 × 0.5 + sqrt(4) = 4");
        assert!(feed(&mut s, &mut now, 1, 10, 100 * MS));
    }

    #[test]
    fn reprobes_after_five_windows_far_below_the_baseline() {
        let config = Gradient::new(1, 10, 1_000).unwrap();
        let (mut s, mut now) = tracking(config, 10 * MS);
        // 6 ms < 62.5 % of 10 ms. Windows grow with the limit (10, 12, 15,
        // 18, 22 samples: the gradient is clamped at 2).
        assert!(!feed(&mut s, &mut now, 1, 77, 6 * MS));
        assert!(feed(&mut s, &mut now, 1, 22, 6 * MS));
    }

    #[test]
    fn a_falling_limit_or_a_settled_one_does_not_reprobe() {
        let config = Gradient::new(1, 1_000, 1_000).unwrap();
        let (mut s, mut now) = tracking(config, 10 * MS);
        // Clamped at 0.5 for ten windows, but the limit falls each time.
        for _ in 0..10 {
            let window = s.limit();
            assert!(!feed(&mut s, &mut now, 1, window, 100 * MS));
        }
        // At its equilibrium above min (gradient 1 - 1/sqrt(25) = 0.8 with
        // the RTT at 1.25 / 0.8 of the baseline): below 1, limit steady.
        let config = Gradient::new(1, 25, 1_000).unwrap();
        let (mut s, mut now) = tracking(config, 10 * MS);
        let rtt = 10 * MS * 125 / 80;
        assert!(!feed(&mut s, &mut now, 20, 25, rtt));
        assert_eq!(s.limit(), 25);
    }
}
