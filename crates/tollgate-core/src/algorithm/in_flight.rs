use crate::{Decision, Outcome, Semaphore};

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
