//! Client-side adaptive throttling (Google SRE book, "Handling Overload"),
//! per upstream: one dead host must not make the client refuse calls to a
//! healthy one.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::time::Instant;

/// Slots of the minute over which requests and accepts are counted.
const SLOTS: usize = 12;
/// Slots before the current one still in the minute.
const SPAN: u64 = SLOTS as u64 - 1;
/// Each slot's length: five seconds.
const SLOT_NANOS: u64 = 5_000_000_000;

/// The most upstreams whose throttles are kept apart; past it, upstreams
/// with no call in the last minute are forgotten, and if all are busy the
/// new one shares one throttle with every other newcomer.
const MAX_UPSTREAMS: usize = 1_024;

/// One [`Throttle`] per upstream (the retry budget's key), made on first
/// use.
#[derive(Debug)]
pub(crate) struct Throttles {
    k: f64,
    map: Mutex<HashMap<Box<[u8]>, Arc<Throttle>>>,
    /// Shared by upstreams that found the map full of busy ones.
    overflow: Arc<Throttle>,
}

impl Throttles {
    pub(crate) fn new(k: f64) -> Self {
        Self {
            k,
            map: Mutex::new(HashMap::new()),
            overflow: Arc::new(Throttle::new(k)),
        }
    }

    /// The throttle of `upstream`.
    pub(crate) fn of(&self, upstream: &[u8]) -> Arc<Throttle> {
        let mut map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(t) = map.get(upstream) {
            return Arc::clone(t);
        }
        if map.len() >= MAX_UPSTREAMS {
            map.retain(|_, t| !t.is_idle());
            if map.len() >= MAX_UPSTREAMS {
                return Arc::clone(&self.overflow);
            }
        }
        let t = Arc::new(Throttle::new(self.k));
        map.insert(upstream.into(), Arc::clone(&t));
        t
    }
}

/// Counts requests and accepts over the last minute and refuses locally
/// with probability `max(0, (requests − k·accepts) / (requests + 1))`.
#[derive(Debug)]
pub(crate) struct Throttle {
    k: f64,
    base: Instant,
    /// (slot index + 1, requests, accepts) per slot.
    slots: Mutex<[(u64, u64, u64); SLOTS]>,
}

impl Throttle {
    pub(crate) fn new(k: f64) -> Self {
        Self {
            k,
            base: Instant::now(),
            slots: Mutex::new([(0, 0, 0); SLOTS]),
        }
    }

    fn index(&self) -> u64 {
        let elapsed = u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX);
        elapsed
            .checked_div(SLOT_NANOS)
            .unwrap_or(0)
            .saturating_add(1)
    }

    /// Counts one attempt, accepted by the upstream or not.
    pub(crate) fn record(&self, accepted: bool) {
        let index = self.index();
        let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        let at = usize::try_from(index.checked_rem(SLOTS as u64).unwrap_or(0)).unwrap_or(0);
        if let Some(slot) = slots.get_mut(at) {
            if slot.0 != index {
                *slot = (index, 0, 0);
            }
            slot.1 = slot.1.saturating_add(1);
            slot.2 = slot.2.saturating_add(u64::from(accepted));
        }
    }

    /// Whether no call was counted in the last minute.
    fn is_idle(&self) -> bool {
        let oldest = self.index().saturating_sub(SPAN);
        let slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        slots.iter().all(|s| s.0 < oldest || s.0 == 0)
    }

    /// The probability of refusing a call now.
    pub(crate) fn probability(&self) -> f64 {
        let index = self.index();
        let oldest = index.saturating_sub(SPAN);
        let slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        let (requests, accepts) = slots
            .iter()
            .filter(|s| s.0 >= oldest && s.0 != 0)
            .fold((0u64, 0u64), |(r, a), s| {
                (r.saturating_add(s.1), a.saturating_add(s.2))
            });
        #[allow(clippy::cast_precision_loss)]
        let p = (requests as f64 - self.k * accepts as f64) / (requests as f64 + 1.0);
        p.clamp(0.0, 1.0)
    }

    /// Whether to refuse a call, given a uniform random `u64`.
    pub(crate) fn refuse(&self, random: u64) -> bool {
        #[allow(clippy::cast_precision_loss)]
        let draw = random as f64 / u64::MAX as f64;
        draw < self.probability()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_in_proportion_to_rejections() {
        let t = Throttle::new(2.0);
        assert_eq!(t.probability(), 0.0);
        // 100 requests, 10 accepted: (100 − 20) / 101.
        for i in 0..100 {
            t.record(i < 10);
        }
        assert!((t.probability() - 80.0 / 101.0).abs() < 1e-9);
        assert!(t.refuse(0));
        assert!(!t.refuse(u64::MAX));
        // Half accepted: k·accepts covers the requests; nothing refused.
        let t = Throttle::new(2.0);
        for i in 0..100 {
            t.record(i % 2 == 0);
        }
        assert_eq!(t.probability(), 0.0);
    }

    #[test]
    fn each_upstream_has_its_own_throttle() {
        let all = Throttles::new(2.0);
        let dead = all.of(b"dead");
        for _ in 0..100 {
            dead.record(false);
        }
        assert!(all.of(b"dead").probability() > 0.9);
        assert_eq!(all.of(b"healthy").probability(), 0.0);
    }
}
