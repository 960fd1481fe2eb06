use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::{Acquire, Decision, Lease, Outcome, Semaphore};

/// A concurrency limit as an in-process counter: the state is the number of
/// permits a key holds, one `u64`, so acquire and release are one
/// compare-and-swap each, whatever the number of holders.
///
/// Unlike [`Semaphore`], nothing lapses: in one process a permit is held by
/// a guard that releases it when dropped, and a holder that dies takes the
/// process (and the count) with it. The same ceilings and retry hint apply
/// as for the semaphore; see its docs.
///
/// ```
/// use std::time::Duration;
/// use tollgate_core::{ConcurrencyRule, Outcome};
///
/// let rule = ConcurrencyRule::new("downloads", 2, Duration::from_secs(30))?;
/// let counter = rule.semaphore().in_flight();
/// let mut held = 0; // a fresh key
/// assert!(counter.acquire(&mut held, 1, 2).is_allowed());
/// assert!(counter.acquire(&mut held, 1, 2).is_allowed());
/// assert!(matches!(counter.acquire(&mut held, 1, 2).outcome, Outcome::Deny { .. }));
/// counter.release(&mut held, 1);
/// assert_eq!(held, 1);
/// # Ok::<(), tollgate_core::ConfigError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct InFlight {
    max: u32,
    retry_after: u64,
}

impl InFlight {
    pub(crate) fn from_semaphore(semaphore: &Semaphore) -> Self {
        Self {
            max: semaphore.max(),
            retry_after: semaphore.retry_after(),
        }
    }

    /// Most permits held at once.
    pub fn max(&self) -> u32 {
        self.max
    }

    /// Takes `permits` if, with them, the key holds at most `ceiling`
    /// (clamped to `max`). Permits above the ceiling are
    /// [`Outcome::Never`]; 0 peeks. `remaining` is counted against the
    /// ceiling.
    #[inline]
    pub fn acquire(&self, held: &mut u64, permits: u32, ceiling: u32) -> Decision {
        let limit = u64::from(self.max);
        let ceiling = u64::from(ceiling.min(self.max));
        let permits = u64::from(permits);
        let remaining = ceiling.saturating_sub(*held);
        let outcome = if permits == 0 {
            Outcome::Allow { delay: 0 }
        } else if permits > ceiling {
            Outcome::Never
        } else if permits > remaining {
            Outcome::Deny {
                retry_after: self.retry_after,
            }
        } else {
            *held = held.saturating_add(permits);
            return Decision::allow(limit, remaining.saturating_sub(permits), 0);
        };
        Decision::with(outcome, limit, remaining, 0)
    }

    /// Gives back `permits` (never below zero).
    #[inline]
    pub fn release(&self, held: &mut u64, permits: u32) {
        *held = held.saturating_sub(u64::from(permits));
    }

    /// Whether a key holding `held` permits is idle (holds none).
    #[inline]
    pub fn is_idle(&self, held: u64) -> bool {
        held == 0
    }
}

/// (For stores: the update of one key's word.)
///
/// Runs `f` on a copy of `word`'s value and publishes the result with one
/// compare-and-swap, retrying on a race (governor's trick). A result that
/// leaves the value unchanged (a denial, a peek) writes nothing, so refused
/// traffic does not bounce the cache line between cores.
#[doc(hidden)]
#[inline]
pub fn update_word<R>(word: &AtomicU64, mut f: impl FnMut(&mut u64) -> R) -> R {
    let mut current = word.load(Ordering::Acquire);
    loop {
        let mut next = current;
        let result = f(&mut next);
        if next == current {
            return result;
        }
        match word.compare_exchange_weak(current, next, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return result,
            Err(actual) => current = actual,
        }
    }
}

/// One key's permits, kept by a store apart from its table of keys, so
/// that a caller whose every request has that key (a service-wide limit)
/// takes and gives them back with one compare-and-swap each, no lookup
/// and no hashing: see [`ConcurrencyLimiter::pin`](crate::ConcurrencyLimiter::pin).
///
/// The store counts the key here for every caller from then on: an
/// acquire, a release or a count of the key through the store reads and
/// writes the same word, and a lease granted here can go back either way.
///
/// ```
/// use std::sync::{atomic::AtomicU64, Arc};
/// use std::time::Duration;
/// use tollgate_core::{ConcurrencyRule, PinnedPermits};
///
/// let rule = ConcurrencyRule::new("service", 2, Duration::from_secs(30))?;
/// let pinned = PinnedPermits::new(Arc::new(AtomicU64::new(0)), &rule, 7);
/// let lease = pinned.acquire(2, u32::MAX).lease.expect("granted");
/// assert!(!pinned.acquire(1, u32::MAX).decision.is_allowed());
/// pinned.release(lease);
/// assert_eq!(pinned.held(), 0);
/// # Ok::<(), tollgate_core::ConfigError>(())
/// ```
#[derive(Debug, Clone)]
pub struct PinnedPermits {
    held: Arc<AtomicU64>,
    counter: InFlight,
    lease_id: u64,
}

impl PinnedPermits {
    /// The permits counted in `held`, under `rule`'s limit; each lease
    /// granted gets `lease_id` (the store's id for the key's leases, so
    /// that its own release finds them).
    pub fn new(held: Arc<AtomicU64>, rule: &crate::ConcurrencyRule, lease_id: u64) -> Self {
        Self {
            held,
            counter: rule.semaphore().in_flight(),
            lease_id,
        }
    }

    /// [`ConcurrencyLimiter::acquire`](crate::ConcurrencyLimiter::acquire)
    /// of the pinned key, at once.
    #[inline]
    pub fn acquire(&self, permits: u32, ceiling: u32) -> Acquire {
        let decision = update_word(&self.held, |held| {
            self.counter.acquire(held, permits, ceiling)
        });
        let granted = decision.is_allowed() && permits > 0;
        Acquire {
            decision,
            lease: granted.then_some(Lease {
                id: self.lease_id,
                permits,
            }),
        }
    }

    /// Gives `lease` back (never below zero): a lease of this key, granted
    /// here or by the store.
    #[inline]
    pub fn release(&self, lease: Lease) {
        debug_assert_eq!(lease.id, self.lease_id, "a lease of another key");
        update_word(&self.held, |held| self.counter.release(held, lease.permits));
    }

    /// The permits the key holds now.
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn counts_against_the_ceiling_and_never_underflows() {
        let sem = Semaphore::new(4, Duration::from_secs(1)).unwrap();
        let c = sem.in_flight();
        let mut held = 0;
        let d = c.acquire(&mut held, 3, 3);
        assert_eq!(
            (d.is_allowed(), d.remaining, d.limit, held),
            (true, 0, 4, 3)
        );
        let d = c.acquire(&mut held, 1, 3);
        assert_eq!(
            d.outcome,
            Outcome::Deny {
                retry_after: 1_000_000_000
            }
        );
        assert_eq!(held, 3, "a denial changes nothing");
        assert!(c.acquire(&mut held, 1, 4).is_allowed());
        assert_eq!(c.acquire(&mut held, 5, 9).outcome, Outcome::Never);
        assert_eq!(c.acquire(&mut held, 4, 3).outcome, Outcome::Never);
        let peek = c.acquire(&mut held, 0, 4);
        assert_eq!((peek.is_allowed(), peek.remaining, held), (true, 0, 4));
        c.release(&mut held, 4);
        assert!(c.is_idle(held));
        c.release(&mut held, 1);
        assert_eq!(held, 0);
    }
}
