//! Adaptive concurrency against a simulated backend, and the bounds
//! property on random samples.
//!
//! The simulation is a discrete-event loop on a virtual nanosecond clock
//! (no real time, no runtime): a backend with `knee` workers answers in
//! `base` while at most `knee` requests are in flight, and in
//! `base × in_flight / knee` beyond that (the excess queues). 200 closed-loop
//! clients each send again as soon as their previous request ends, or 1 ms
//! after a rejection; a request is admitted only while fewer than
//! `controller.limit()` are in flight. The limit a controller settles on is
//! measured as its time average over the second half of each phase.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects,
    missing_docs
)]

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

use proptest::prelude::*;
use tollgate_core::adaptive::{AdaptiveLimit, Aimd, Controller, ErrorRate, Gradient, Sample};

const MS: u64 = 1_000_000;
const SECOND: u64 = 1_000 * MS;
const CLIENTS: u32 = 200;
const BASE: u64 = 10 * MS;
const KNEE: u32 = 20;
const PHASE: u64 = 4 * SECOND;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// A client tries to send.
    Send,
    /// A request admitted at `started` ends.
    Done { started: u64 },
}

struct Simulation {
    controller: Controller,
    base: u64,
    knee: u32,
    now: u64,
    in_flight: u32,
    seq: u64,
    events: BinaryHeap<Reverse<(u64, u64, Event)>>,
}

impl Simulation {
    fn new(limit: &AdaptiveLimit) -> Self {
        let mut sim = Self {
            controller: Controller::new(limit, 42),
            base: BASE,
            knee: KNEE,
            now: 0,
            in_flight: 0,
            seq: 0,
            events: BinaryHeap::new(),
        };
        for _ in 0..CLIENTS {
            sim.push(0, Event::Send);
        }
        sim
    }

    fn push(&mut self, at: u64, event: Event) {
        self.seq += 1;
        self.events.push(Reverse((at, self.seq, event)));
    }

    fn latency(&self, in_flight: u32) -> u64 {
        if in_flight <= self.knee {
            self.base
        } else {
            self.base * u64::from(in_flight) / u64::from(self.knee)
        }
    }

    /// Runs `duration` of virtual time; returns the limit's time average,
    /// lowest and highest over its second half.
    fn run(&mut self, duration: u64) -> Settled {
        let end = self.now + duration;
        let measure_from = self.now + duration / 2;
        let mut area = 0.0;
        let mut last = measure_from;
        let (mut low, mut high) = (u32::MAX, 0);
        while let Some(&Reverse((at, _, event))) = self.events.peek() {
            if at > end {
                break;
            }
            self.events.pop();
            if at > last {
                let limit = self.controller.limit();
                area += f64::from(limit) * (at - last) as f64;
                (low, high) = (low.min(limit), high.max(limit));
                last = at;
            }
            self.now = at;
            match event {
                Event::Send if self.in_flight < self.controller.limit() => {
                    self.in_flight += 1;
                    let rtt = self.latency(self.in_flight);
                    self.push(at + rtt, Event::Done { started: at });
                }
                Event::Send => self.push(at + MS, Event::Send),
                Event::Done { started } => {
                    let sample = Sample {
                        rtt: at - started,
                        dropped: false,
                        in_flight: self.in_flight,
                    };
                    self.in_flight -= 1;
                    let limit = self.controller.on_sample(at, sample);
                    assert!(limit >= 1);
                    self.push(at, Event::Send);
                }
            }
        }
        area += f64::from(self.controller.limit()) * (end - last) as f64;
        self.now = end;
        Settled {
            mean: area / (end - measure_from) as f64,
            low,
            high,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Settled {
    mean: f64,
    low: u32,
    high: u32,
}

/// Healthy, then the knee halves, then it comes back: returns the three
/// phases' average limits.
fn three_phases(limit: &AdaptiveLimit) -> [f64; 3] {
    let mut sim = Simulation::new(limit);
    let healthy = sim.run(PHASE);
    sim.knee = KNEE / 2;
    let degraded = sim.run(PHASE);
    sim.knee = KNEE;
    let recovered = sim.run(PHASE);
    println!("{limit:?}:\n  {healthy:?}\n  {degraded:?}\n  {recovered:?}");
    [healthy.mean, degraded.mean, recovered.mean]
}

// Measured (deterministic): time-averaged limit 19.6 (0.98 × knee) while
// healthy, 12.7 (0.65 × that) with the knee halved, 19.5 after. The mean is
// near the knee but the limit saws between `min` (2) and 87: growth is one
// per success (doubling per round trip) and the drops that stop it arrive
// one round trip late, each taking 10 %.
#[test]
fn aimd_with_latency_threshold_settles_near_the_knee() {
    let aimd = Aimd::new(2, 10, 1_000)
        .unwrap()
        .latency_threshold(Duration::from_nanos(2 * BASE))
        .unwrap();
    let [healthy, degraded, recovered] = three_phases(&AdaptiveLimit::Aimd(aimd));
    let knee = f64::from(KNEE);
    assert!((0.75 * knee..=1.25 * knee).contains(&healthy), "{healthy}");
    assert!(degraded < 0.75 * healthy, "{degraded} vs {healthy}");
    assert!(recovered > 0.9 * healthy, "{recovered} vs {healthy}");
}

// Measured: 30.5 (1.52 × knee; steady between 30 and 31) while healthy,
// 16.5 (0.54 × that) with the knee halved, 30.5 after. Above the knee by
// design: the buffer lets the RTT reach 1.25 × baseline, and the sqrt
// headroom balances a gradient below 1, so the fixed point solves
// `L = 25 + sqrt(L)` (knee 20) and `L = 12.5 + sqrt(L)` (knee 10).
#[test]
fn gradient_settles_near_the_knee() {
    let gradient = Gradient::new(2, 10, 1_000).unwrap();
    let [healthy, degraded, recovered] = three_phases(&AdaptiveLimit::Gradient(gradient));
    let knee = f64::from(KNEE);
    assert!((1.25 * knee..=1.75 * knee).contains(&healthy), "{healthy}");
    assert!(degraded < 0.65 * healthy, "{degraded} vs {healthy}");
    assert!(recovered > 0.9 * healthy, "{recovered} vs {healthy}");
}

/// Healthy, then every answer three times slower (same knee), then healthy.
fn uniform_slowdown(limit: &AdaptiveLimit) -> [Settled; 3] {
    let mut sim = Simulation::new(limit);
    let healthy = sim.run(PHASE);
    sim.base = 3 * BASE;
    let slow = sim.run(PHASE);
    sim.base = BASE;
    let fast = sim.run(PHASE);
    println!("{limit:?}:\n  {healthy:?}\n  {slow:?}\n  {fast:?}");
    [healthy, slow, fast]
}

// A backend that becomes slower, or faster, but not more loaded: the
// gradient's baseline is stale until a probe refreshes it.
//
// Slower (measured: 28.4 vs 30.5 healthy): the stale baseline reads as
// congestion, the limit falls to the floor of 4, five stuck windows trigger
// a probe, and the limit climbs back (still climbing early in the measured
// half, hence the low of 11).
//
// Faster again (measured: 84.2, 4.2 × knee): the baseline is now too high,
// so the limit overshoots until the next periodic probe, which with the
// default 60 s interval is not in this run. With a 2 s interval the probes
// fix it (measured: 28.6, 24.7, 28.6; lows of 2 are the probes).
#[test]
fn gradient_baseline_follows_a_uniform_slowdown_and_speedup() {
    let limit = |interval| {
        let gradient = Gradient::new(2, 10, 1_000).unwrap();
        let gradient = gradient.min_rtt_interval(Duration::from_secs(interval));
        AdaptiveLimit::Gradient(gradient.unwrap())
    };
    let [healthy, slow, fast] = uniform_slowdown(&limit(60));
    assert!(slow.mean > 0.85 * healthy.mean, "{slow:?} vs {healthy:?}");
    assert!(slow.high <= healthy.high, "{slow:?} vs {healthy:?}");
    assert!(fast.mean > 2.5 * healthy.mean, "{fast:?} vs {healthy:?}");

    let [healthy, slow, fast] = uniform_slowdown(&limit(2));
    let knee = f64::from(KNEE);
    for phase in [healthy, slow, fast] {
        assert!(
            (1.0 * knee..=1.75 * knee).contains(&phase.mean),
            "{phase:?}"
        );
    }
}

// AIMD's threshold is absolute: with every answer slower than it, every
// answer is a drop and the limit stays at `min` (measured: 2 throughout)
// until the backend is fast again.
#[test]
fn uniform_slowdown_pins_aimd_at_min() {
    let aimd = Aimd::new(2, 10, 1_000)
        .unwrap()
        .latency_threshold(Duration::from_nanos(2 * BASE))
        .unwrap();
    let [healthy, slow, fast] = uniform_slowdown(&AdaptiveLimit::Aimd(aimd));
    assert_eq!((slow.low, slow.high), (2, 2));
    assert!(fast.mean > 0.9 * healthy.mean, "{fast:?} vs {healthy:?}");
}

#[test]
fn error_rate_tracks_a_failing_backend() {
    let mut rate = ErrorRate::new(Duration::from_secs(1), 10).unwrap();
    for i in 0..100 {
        rate.record(i * 10 * MS, i % 4 == 0);
    }
    assert_eq!(rate.rate(990 * MS), Some(0.25));
    for i in 100..200 {
        rate.record(i * 10 * MS, false);
    }
    assert_eq!(rate.rate(1_990 * MS), Some(0.0));
    assert_eq!(rate.rate(10 * SECOND), None);
}

fn any_bounds() -> impl Strategy<Value = (u32, u32, u32)> {
    let value = prop_oneof![1_u32..=8, 1_u32..=1_000, Just(1_000_000)];
    (value.clone(), value.clone(), value).prop_map(|(a, b, c)| {
        let mut v = [a, b, c];
        v.sort_unstable();
        (v[0], v[1], v[2])
    })
}

fn any_limit() -> impl Strategy<Value = AdaptiveLimit> {
    let aimd = (
        any_bounds(),
        0.5_f64..0.9999,
        prop::option::of(1_u64..=u64::MAX),
    )
        .prop_map(|((min, initial, max), backoff, threshold)| {
            let mut aimd = Aimd::new(min, initial, max)
                .unwrap()
                .backoff(backoff)
                .unwrap();
            if let Some(t) = threshold {
                aimd = aimd.latency_threshold(Duration::from_nanos(t)).unwrap();
            }
            AdaptiveLimit::Aimd(aimd)
        });
    let gradient = (
        any_bounds(),
        (0.0_f64..=4.0, 0.01_f64..=1.0, 0.0_f64..=0.5),
        (1_u32..=30, 1_u32..=50, 1_u64..=100),
    )
        .prop_map(
            |((min, initial, max), (buffer, smoothing, jitter), (probe, window, ms))| {
                let gradient = Gradient::new(min, initial, max)
                    .unwrap()
                    .buffer(buffer)
                    .unwrap()
                    .smoothing(smoothing)
                    .unwrap()
                    .jitter(jitter)
                    .unwrap()
                    .probe_samples(probe)
                    .unwrap()
                    .sample_window(window)
                    .unwrap()
                    .min_rtt_interval(Duration::from_millis(ms))
                    .unwrap();
                AdaptiveLimit::Gradient(gradient)
            },
        );
    prop_oneof![aimd, gradient]
}

fn any_step() -> impl Strategy<Value = (i64, Sample)> {
    let jump = prop_oneof![
        Just(0_i64),
        0_i64..=20 * MS as i64,
        -(20 * MS as i64)..0,
        Just(i64::MAX),
        Just(i64::MIN),
    ];
    let rtt = prop_oneof![Just(0_u64), 0_u64..=100 * MS, Just(u64::MAX), any::<u64>()];
    let in_flight = prop_oneof![0_u32..=40, Just(u32::MAX), any::<u32>()];
    (jump, rtt, any::<bool>(), in_flight).prop_map(|(jump, rtt, dropped, in_flight)| {
        (
            jump,
            Sample {
                rtt,
                dropped,
                in_flight,
            },
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn limit_stays_within_bounds(
        limit in any_limit(),
        seed in any::<u64>(),
        start in prop_oneof![Just(0_u64), any::<u64>()],
        steps in prop::collection::vec(any_step(), 0..400),
    ) {
        let (min, max) = (limit.min(), limit.max());
        let mut controller = Controller::new(&limit, seed);
        prop_assert!((min..=max).contains(&controller.limit()));
        let mut now = start;
        for (jump, sample) in steps {
            now = now.saturating_add_signed(jump);
            let new = controller.on_sample(now, sample);
            prop_assert!((min..=max).contains(&new), "{new} outside {min}..={max}");
            prop_assert_eq!(new, controller.limit());
        }
    }

    #[test]
    fn error_rate_is_a_ratio(
        window_ms in 1_u64..=10_000,
        min_requests in 0_u32..=5,
        steps in prop::collection::vec((any::<i64>(), any::<bool>()), 0..200),
    ) {
        let mut rate = ErrorRate::new(Duration::from_millis(window_ms), min_requests).unwrap();
        let mut now = 0_u64;
        for (jump, error) in steps {
            now = now.saturating_add_signed(jump % (2 * window_ms as i64 * MS as i64));
            rate.record(now, error);
            if let Some(r) = rate.rate(now) {
                prop_assert!((0.0..=1.0).contains(&r));
            }
            prop_assert!(rate.rate(now).is_some() || min_requests > 1);
        }
    }
}
