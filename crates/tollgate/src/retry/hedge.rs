//! Hedged requests: a second copy of a slow call, paid for by the retry
//! budget.
//!
//! A call still unanswered after the hedge delay is sent again, side by
//! side with the first, if the budget grants a retry for it (the same
//! withdrawal a retry makes, so hedges and retries together stay within
//! the budget: a storm of slow calls does not double the upstream's
//! load). The first answer that is not worth a retry wins and the other
//! attempt is dropped (its request cancelled); an answer worth a retry
//! waits for the other one. The delay is fixed
//! ([`Hedge::after`]) or a percentile of the layer's recent attempt
//! latencies ([`Hedge::percentile`]), as "The Tail at Scale" suggests
//! (hedge at the 95th percentile: about 5 % more calls).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::Poll;
use std::time::Duration;

use tollgate_core::ConfigError;

/// When a hedge is sent; see [`RetryBudgetLayerBuilder::hedge`](super::RetryBudgetLayerBuilder::hedge).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hedge {
    kind: Kind,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    After(Duration),
    Percentile { share: f64, min: Duration },
}

impl Hedge {
    /// A hedge for every call unanswered after `delay` (at least 1 ms).
    pub fn after(delay: Duration) -> Self {
        Self {
            kind: Kind::After(delay),
        }
    }

    /// A hedge for calls slower than the `p`th percentile of the layer's
    /// recent attempts (`p` from 50 to 99.9, e.g. 95), never sooner than
    /// `min` (at least 1 ms). Until it has seen 100 attempts it waits
    /// `min`.
    pub fn percentile(p: f64, min: Duration) -> Self {
        Self {
            kind: Kind::Percentile {
                share: p / 100.0,
                min,
            },
        }
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let least = |d: Duration| {
            if d < Duration::from_millis(1) {
                return Err(ConfigError::new("hedge", "the delay must be at least 1 ms"));
            }
            Ok(())
        };
        match self.kind {
            Kind::After(d) => least(d),
            Kind::Percentile { share, min } => {
                if !(0.5..=0.999).contains(&share) {
                    return Err(ConfigError::new(
                        "hedge",
                        "the percentile must be from 50 to 99.9",
                    ));
                }
                least(min)
            }
        }
    }
}

/// Buckets of attempt latency: bucket `i` counts latencies up to
/// `2^(i/4)` µs (four per doubling, 128 of them: up to about an hour; the
/// last takes anything longer).
const BUCKETS: usize = 128;

/// Samples between halvings of every count, so the percentile follows
/// the upstream as it changes.
const DECAY_EVERY: u64 = 4_096;

/// A hedge's delay, and the latencies a percentile is read from.
#[derive(Debug)]
pub(super) struct Hedger {
    hedge: Hedge,
    counts: [AtomicU64; BUCKETS],
    seen: AtomicU64,
}

impl Hedger {
    pub(super) fn new(hedge: Hedge) -> Self {
        Self {
            hedge,
            counts: std::array::from_fn(|_| AtomicU64::new(0)),
            seen: AtomicU64::new(0),
        }
    }

    /// The wait before a call's hedge.
    pub(super) fn delay(&self) -> Duration {
        let (share, min) = match self.hedge.kind {
            Kind::After(d) => return d,
            Kind::Percentile { share, min } => (share, min),
        };
        // Read once, on the stack: this runs for every call hedged.
        let counts: [u64; BUCKETS] =
            std::array::from_fn(|i| self.counts.get(i).map_or(0, |c| c.load(Ordering::Relaxed)));
        let total: u64 = counts.iter().sum();
        if total < 100 {
            return min;
        }
        #[allow(
            clippy::cast_precision_loss,
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss
        )]
        let rank = ((total as f64) * share).ceil() as u64;
        let mut below = 0u64;
        for (i, c) in counts.iter().enumerate() {
            below = below.saturating_add(*c);
            if below >= rank {
                return upper_bound(i).max(min);
            }
        }
        min
    }

    /// Records an attempt that answered after `took`.
    pub(super) fn record(&self, took: Duration) {
        if matches!(self.hedge.kind, Kind::After(_)) {
            return;
        }
        let micros = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        if let Some(c) = self.counts.get(bucket(micros)) {
            c.fetch_add(1, Ordering::Relaxed);
        }
        if self.seen.fetch_add(1, Ordering::Relaxed) % DECAY_EVERY == DECAY_EVERY - 1 {
            for c in &self.counts {
                let _ = c.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| Some(v / 2));
            }
        }
    }
}

/// The first bucket whose bound holds `micros`: one of the five from
/// 4·⌊log2(µs)⌋ (every bucket below ends under 2^⌊log2(µs)⌋).
fn bucket(micros: u64) -> usize {
    let micros = micros.max(1);
    let floor_log2 = usize::try_from(micros.ilog2()).unwrap_or(0);
    (floor_log2.saturating_mul(4)..BUCKETS)
        .find(|&i| upper_bound_micros(i) >= micros)
        .unwrap_or(BUCKETS - 1)
}

/// The upper bound of bucket `i`, in µs: 2^(i/4).
fn upper_bound_micros(i: usize) -> u64 {
    let whole = 1u64 << (i / 4).min(40);
    // 2^(1/4), 2^(2/4), 2^(3/4) in thousandths.
    let frac = match i % 4 {
        0 => 1_000u64,
        1 => 1_189,
        2 => 1_414,
        _ => 1_682,
    };
    whole.saturating_mul(frac) / 1_000
}

fn upper_bound(i: usize) -> Duration {
    Duration::from_micros(upper_bound_micros(i))
}

/// Which of two futures raced by [`race`] answered first.
pub(super) enum Raced<A> {
    /// The first (the second still runs).
    First(A),
    /// The second (the first still runs).
    Second(A),
}

/// Polls both until one is ready (the first first); the other stays where
/// it is, to be awaited or dropped.
pub(super) async fn race<A, F1, F2>(mut first: Pin<&mut F1>, mut second: Pin<&mut F2>) -> Raced<A>
where
    F1: Future<Output = A>,
    F2: Future<Output = A>,
{
    std::future::poll_fn(|cx| {
        if let Poll::Ready(a) = first.as_mut().poll(cx) {
            return Poll::Ready(Raced::First(a));
        }
        if let Poll::Ready(a) = second.as_mut().poll(cx) {
            return Poll::Ready(Raced::Second(a));
        }
        Poll::Pending
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_percentile_follows_the_latencies_seen() {
        let h = Hedger::new(Hedge::percentile(95.0, Duration::from_millis(1)));
        // Too few samples: the floor.
        assert_eq!(h.delay(), Duration::from_millis(1));
        for i in 0..1_000u64 {
            // 95 % at 10 ms, 5 % at 500 ms.
            let ms = if i % 20 == 0 { 500 } else { 10 };
            h.record(Duration::from_millis(ms));
        }
        let d = h.delay();
        assert!(
            d >= Duration::from_millis(10) && d <= Duration::from_millis(12),
            "{d:?}"
        );
        // Slow upstreams too: a 95th percentile of 400 ms is read as such
        // (the buckets once ended at 55 ms, and every slower call fell in
        // the last).
        let slow = Hedger::new(Hedge::percentile(95.0, Duration::from_millis(1)));
        for i in 0..1_000u64 {
            let ms = if i % 20 == 0 { 5_000 } else { 400 };
            slow.record(Duration::from_millis(ms));
        }
        let d = slow.delay();
        assert!(
            d >= Duration::from_millis(400) && d <= Duration::from_millis(480),
            "{d:?}"
        );
        let fixed = Hedger::new(Hedge::after(Duration::from_millis(30)));
        fixed.record(Duration::from_secs(1));
        assert_eq!(fixed.delay(), Duration::from_millis(30));
    }

    #[test]
    fn a_latency_lands_in_the_first_bucket_that_holds_it() {
        let full_scan = |micros: u64| {
            (0..BUCKETS)
                .find(|&i| upper_bound_micros(i) >= micros.max(1))
                .unwrap_or(BUCKETS - 1)
        };
        for micros in (0..5_000u64).chain([65_536, 400_000, 3_600_000_000, u64::MAX]) {
            assert_eq!(bucket(micros), full_scan(micros), "{micros} µs");
        }
    }

    #[test]
    fn bad_hedges_name_the_field() {
        for bad in [
            Hedge::after(Duration::ZERO),
            Hedge::percentile(40.0, Duration::from_millis(5)),
            Hedge::percentile(f64::NAN, Duration::from_millis(5)),
            Hedge::percentile(99.0, Duration::ZERO),
        ] {
            assert_eq!(bad.validate().unwrap_err().field(), "hedge", "{bad:?}");
        }
    }
}
