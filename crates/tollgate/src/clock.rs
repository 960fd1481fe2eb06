//! A clock on Tokio's time.

use tollgate_core::{duration_to_nanos, Clock, SystemClock};

/// A [`Clock`] that reads Tokio's time: under `tokio::time::pause()` it
/// stands still, and moves exactly as the paused runtime advances. For
/// tests of whatever waits — pacing, bandwidth limits, queues — so that a
/// store's decisions and the layer's timers agree on one virtual time. It
/// is monotonic, so rate limits work on it in production too
/// ([`SystemClock`] is faster).
///
/// Its wall-clock time is the system's when it was made, plus Tokio's time
/// elapsed since: it never follows the system clock again (an NTP step,
/// a monotonic clock that stood still while the machine slept), so in a
/// long-running process calendar quotas' days and months drift from the
/// wall clock's. Use [`SystemClock`] for quotas in production.
///
/// ```
/// use tollgate::{MemoryStore, TokioClock};
///
/// let store = MemoryStore::builder().clock(TokioClock::new()).build()?;
/// # Ok::<(), tollgate::ConfigError>(())
/// ```
#[derive(Debug, Clone, Copy)]
pub struct TokioClock {
    base: tokio::time::Instant,
    unix_base: u64,
}

impl TokioClock {
    /// A clock starting now.
    pub fn new() -> Self {
        Self {
            base: tokio::time::Instant::now(),
            unix_base: SystemClock.unix_now(),
        }
    }

    fn elapsed(&self) -> u64 {
        duration_to_nanos(self.base.elapsed())
    }
}

impl Default for TokioClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for TokioClock {
    fn now(&self) -> u64 {
        // Never zero: zero is the "fresh" state of several algorithms.
        self.elapsed().saturating_add(1)
    }

    fn unix_now(&self) -> u64 {
        self.unix_base.saturating_add(self.elapsed())
    }
}
