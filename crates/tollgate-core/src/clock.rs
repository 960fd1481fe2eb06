//! Time, as the algorithms see it: nanoseconds on a monotonic `u64` scale.
//!
//! The algorithms never read a clock; the store reads one and passes `now` in.
//! Production stores use [`SystemClock`]; tests use [`ManualClock`], whose
//! clones share one time that only moves when a test calls
//! [`advance`](ManualClock::advance), so every decision is exact and
//! repeatable.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// Converts a [`Duration`] to nanoseconds, saturating at `u64::MAX`
/// (about 584 years).
pub fn duration_to_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// A source of time in nanoseconds: monotonic time for rates and
/// concurrency, and the wall-clock (Unix) time that calendar quotas need.
///
/// The origin of [`now`](Self::now) is the clock's own (process start for
/// [`SystemClock`]); only differences matter. [`unix_now`](Self::unix_now)
/// is nanoseconds since 1970-01-01T00:00:00Z, which tells the date. A
/// clock may move backwards (a test may do so on purpose); every algorithm
/// handles that without panicking and without admitting more than its
/// limit.
pub trait Clock: Send + Sync + 'static {
    /// The current time in nanoseconds since the clock's origin.
    fn now(&self) -> u64;

    /// The current wall-clock time: nanoseconds since the Unix epoch.
    fn unix_now(&self) -> u64;
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now(&self) -> u64 {
        (**self).now()
    }

    fn unix_now(&self) -> u64 {
        (**self).unix_now()
    }
}

/// The production clock: monotonic nanoseconds since the first time any
/// `SystemClock` is read in this process.
///
/// It reads the CPU's time-stamp counter through [quanta] where that
/// counter is invariant (calibrated once, at first use, against the OS
/// clock), and the OS monotonic clock elsewhere: about 10 ns a reading
/// instead of 25 ns for [`std::time::Instant`], which is a third of a
/// decision's cost. Every `SystemClock` in a process shares one origin, so
/// states written through one can be read through another.
///
/// [quanta]: https://docs.rs/quanta
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SystemClock;

struct Source {
    clock: quanta::Clock,
    origin: u64,
    /// Unix time minus monotonic time, as last measured.
    unix_offset: AtomicU64,
    /// Monotonic time of that measurement.
    synced_at: AtomicU64,
}

/// How often the wall clock is read again to follow its steps.
const RESYNC: u64 = 1_000_000_000;

fn wall() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, duration_to_nanos)
}

fn source() -> &'static Source {
    static SOURCE: OnceLock<Source> = OnceLock::new();
    SOURCE.get_or_init(|| {
        let clock = quanta::Clock::new();
        let origin = clock.raw();
        Source {
            clock,
            origin,
            unix_offset: AtomicU64::new(wall()),
            synced_at: AtomicU64::new(0),
        }
    })
}

impl SystemClock {
    /// Calibrates the clock now rather than on the first decision (the
    /// first reading in a process may take up to a few hundred ms).
    pub fn warm_up() {
        source();
    }
}

impl Clock for SystemClock {
    #[inline]
    fn now(&self) -> u64 {
        let s = source();
        // Offset by one so that no reading is ever zero: zero is the
        // "fresh" state of several algorithms.
        s.clock
            .delta_as_nanos(s.origin, s.clock.raw())
            .saturating_add(1)
    }

    /// The operating system's wall clock (a clock set before 1970 reads
    /// 0), read through the fast monotonic clock: the offset between the
    /// two is measured again every second, so a stepped wall clock is
    /// followed within a second, at a monotonic reading's cost.
    fn unix_now(&self) -> u64 {
        let s = source();
        let now = self.now();
        let synced = s.synced_at.load(Ordering::Relaxed);
        if now.saturating_sub(synced) >= RESYNC || synced == 0 {
            s.unix_offset
                .store(wall().saturating_sub(now), Ordering::Relaxed);
            s.synced_at.store(now, Ordering::Relaxed);
        }
        now.saturating_add(s.unix_offset.load(Ordering::Relaxed))
    }
}

/// A clock for tests: starts at zero, moves only when told to, and every
/// clone shares the same time. Its one reading serves as both the
/// monotonic and the Unix time, so a clock set to a date
/// ([`ManualClock::at_unix`]) tells calendar quotas that date.
///
/// ```
/// use std::time::Duration;
/// use tollgate_core::{Clock, ManualClock};
///
/// let clock = ManualClock::new();
/// let same = clock.clone();
/// clock.advance(Duration::from_millis(5));
/// assert_eq!(same.now(), 5_000_000);
/// ```
#[derive(Clone, Default)]
pub struct ManualClock {
    nanos: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock reading zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// A clock reading `unix_nanos` since the Unix epoch (the same as
    /// [`starting_at`](Self::starting_at), named for what it means).
    pub fn at_unix(unix_nanos: u64) -> Self {
        Self::starting_at(unix_nanos)
    }

    /// A clock reading `nanos`.
    pub fn starting_at(nanos: u64) -> Self {
        let clock = Self::new();
        clock.set(nanos);
        clock
    }

    /// Moves the time forward by `d` (saturating at `u64::MAX`).
    pub fn advance(&self, d: Duration) {
        self.advance_nanos(duration_to_nanos(d));
    }

    /// Moves the time forward by `nanos` (saturating at `u64::MAX`).
    pub fn advance_nanos(&self, nanos: u64) {
        let _ = self
            .nanos
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
                Some(t.saturating_add(nanos))
            });
    }

    /// Sets the time to `nanos`, backwards if need be.
    pub fn set(&self, nanos: u64) {
        self.nanos.store(nanos, Ordering::Release);
    }
}

impl Clock for ManualClock {
    #[inline]
    fn now(&self) -> u64 {
        self.nanos.load(Ordering::Acquire)
    }

    #[inline]
    fn unix_now(&self) -> u64 {
        self.now()
    }
}

impl fmt::Debug for ManualClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("ManualClock").field(&self.now()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn system_clock_is_monotonic_and_never_zero() {
        let c = SystemClock;
        let a = c.now();
        let b = c.now();
        assert!(a >= 1);
        assert!(b >= a);
    }

    #[test]
    fn the_system_clock_tells_the_date() {
        // 2026-01-01T00:00:00Z: this code was written after it.
        assert!(SystemClock.unix_now() > 1_767_225_600_000_000_000);
        // Within a millisecond of the OS wall clock (both read here).
        let (a, b) = (SystemClock.unix_now(), wall());
        assert!(a.abs_diff(b) < 1_000_000, "{a} vs {b}");
        let c = ManualClock::at_unix(1_767_225_600_000_000_000);
        assert_eq!(c.unix_now(), c.now());
    }

    #[test]
    fn manual_clock_saturates_and_goes_backwards_on_request() {
        let c = ManualClock::starting_at(u64::MAX - 1);
        c.advance(Duration::from_secs(1));
        assert_eq!(c.now(), u64::MAX);
        c.set(10);
        assert_eq!(c.now(), 10);
    }
}
