use std::time::Duration;

use crate::clock::duration_to_nanos;
use crate::{Acquire, ConfigError, Decision, Lease, Outcome};

/// A concurrency semaphore whose permits are leases with an expiry: at most
/// `max` permits held at once per key, and a lease not released within
/// `lease_ttl` lapses, so a holder that crashed (or a process that died
/// holding a Redis lease) cannot keep its permits forever. Holders of
/// long-running work [`renew`](Self::renew) their lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Semaphore {
    max: u32,
    ttl: u64,
}

/// Per-key state of [`Semaphore`]: the live leases. Holds at most `max`
/// leases (each holds at least one permit).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SemaphoreState {
    leases: Vec<LeaseEntry>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LeaseEntry {
    id: u64,
    expires: u64,
    permits: u32,
}

impl SemaphoreState {
    /// Permits held by leases that have not lapsed at `now`.
    pub fn held(&self, now: u64) -> u64 {
        self.leases
            .iter()
            .filter(|l| l.expires > now)
            .map(|l| u64::from(l.permits))
            .sum()
    }

    /// Number of leases stored (lapsed ones included until the next call).
    pub fn len(&self) -> usize {
        self.leases.len()
    }

    /// Whether no lease is stored.
    pub fn is_empty(&self) -> bool {
        self.leases.is_empty()
    }
}

impl Semaphore {
    /// The largest `max` accepted.
    pub const MAX_PERMITS: u32 = 1_000_000;

    /// Validates `max` (1 to [`Self::MAX_PERMITS`]) and `lease_ttl`
    /// (at least 1 ms).
    pub fn new(max: u32, lease_ttl: Duration) -> Result<Self, ConfigError> {
        if max == 0 || max > Self::MAX_PERMITS {
            return Err(ConfigError::new(
                "max",
                format!("must be 1 to {}", Self::MAX_PERMITS),
            ));
        }
        let ttl = duration_to_nanos(lease_ttl);
        if ttl < 1_000_000 {
            return Err(ConfigError::new("lease_ttl", "must be at least 1 ms"));
        }
        Ok(Self { max, ttl })
    }

    /// Most permits held at once.
    pub fn max(&self) -> u32 {
        self.max
    }

    /// Lease lifetime in nanoseconds.
    pub fn lease_ttl(&self) -> u64 {
        self.ttl
    }

    fn expire(state: &mut SemaphoreState, now: u64) {
        state.leases.retain(|l| l.expires > now);
    }

    fn reset_after(state: &SemaphoreState, now: u64) -> u64 {
        state
            .leases
            .iter()
            .map(|l| l.expires.saturating_sub(now))
            .max()
            .unwrap_or(0)
    }

    /// Takes `permits` under a new lease `id` (unique within the key; the
    /// store chooses it) if they are free at `now`.
    pub fn acquire(&self, state: &mut SemaphoreState, now: u64, permits: u32, id: u64) -> Acquire {
        Self::expire(state, now);
        let limit = u64::from(self.max);
        let held = state.held(now);
        let remaining = limit.saturating_sub(held);
        let reset = Self::reset_after(state, now);
        let denied = |outcome| Acquire {
            decision: Decision::with(outcome, limit, remaining, reset),
            lease: None,
        };
        if permits == 0 {
            return denied(Outcome::Allow { delay: 0 });
        }
        if permits > self.max {
            return denied(Outcome::Never);
        }
        if held.saturating_add(u64::from(permits)) > limit {
            // Upper bound: when enough leases would lapse if none is released.
            let mut order: Vec<_> = state
                .leases
                .iter()
                .map(|l| (l.expires, l.permits))
                .collect();
            order.sort_unstable();
            let excess = held
                .saturating_add(u64::from(permits))
                .saturating_sub(limit);
            let mut freed = 0u64;
            let mut retry_after = self.ttl;
            for (expires, p) in order {
                freed = freed.saturating_add(u64::from(p));
                if freed >= excess {
                    retry_after = expires.saturating_sub(now);
                    break;
                }
            }
            return denied(Outcome::Deny {
                retry_after: retry_after.max(1),
            });
        }
        let expires = now.saturating_add(self.ttl);
        state.leases.retain(|l| l.id != id);
        state.leases.push(LeaseEntry {
            id,
            expires,
            permits,
        });
        Acquire {
            decision: Decision::allow(
                limit,
                remaining.saturating_sub(u64::from(permits)),
                Self::reset_after(state, now),
            ),
            lease: Some(Lease { id, permits }),
        }
    }

    /// Releases lease `id`. Returns whether it was still held (a lease that
    /// lapsed, or was released already, is not).
    pub fn release(&self, state: &mut SemaphoreState, now: u64, id: u64) -> bool {
        let before = state.leases.len();
        state.leases.retain(|l| l.id != id || l.expires <= now);
        let released = state.leases.len() != before;
        Self::expire(state, now);
        released
    }

    /// Extends lease `id` to `now + lease_ttl`. Returns whether it was
    /// still held. A renewal never shortens a lease (as it would if the
    /// clock had gone back).
    pub fn renew(&self, state: &mut SemaphoreState, now: u64, id: u64) -> bool {
        Self::expire(state, now);
        match state.leases.iter_mut().find(|l| l.id == id) {
            Some(lease) => {
                lease.expires = lease.expires.max(now.saturating_add(self.ttl));
                true
            }
            None => false,
        }
    }

    /// Whether `state` holds no live lease at `now`.
    pub fn is_idle(&self, state: &SemaphoreState, now: u64) -> bool {
        state.leases.iter().all(|l| l.expires <= now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn leases_bound_concurrency_and_lapse() {
        let sem = Semaphore::new(2, Duration::from_secs(30)).unwrap();
        let mut s = SemaphoreState::default();
        let a = sem.acquire(&mut s, 0, 1, 1);
        let b = sem.acquire(&mut s, S, 1, 2);
        assert!(a.decision.is_allowed() && b.decision.is_allowed());
        assert_eq!(b.decision.remaining, 0);
        let c = sem.acquire(&mut s, 2 * S, 1, 3);
        assert_eq!(c.lease, None);
        assert_eq!(
            c.decision.outcome,
            Outcome::Deny {
                retry_after: 28 * S
            }
        );
        assert!(sem.release(&mut s, 2 * S, 1));
        assert!(!sem.release(&mut s, 2 * S, 1), "released twice");
        assert!(sem.acquire(&mut s, 2 * S, 1, 3).decision.is_allowed());
        // Lease 2 lapses at 31 s; renewing lease 3 keeps it.
        assert!(sem.renew(&mut s, 20 * S, 3));
        assert_eq!(s.held(31 * S), 1);
        assert!(!sem.renew(&mut s, 31 * S, 2));
        assert!(sem.is_idle(&s, 51 * S));
        assert_eq!(
            sem.acquire(&mut s, 0, 3, 9).decision.outcome,
            Outcome::Never
        );
    }

    #[test]
    fn renewal_with_the_clock_back_never_shortens_the_lease() {
        // Found by the property tests: a renewal with the clock 0.5 ms back
        // used to move the expiry back by 0.5 ms, freeing the permit early.
        let sem = Semaphore::new(1, Duration::from_millis(1)).unwrap();
        let mut s = SemaphoreState::default();
        let now = 10_000_000;
        assert!(sem.acquire(&mut s, now, 1, 7).decision.is_allowed());
        assert!(sem.renew(&mut s, now - 500_000, 7));
        assert_eq!(s.held(now + 999_999), 1);
        assert!(!sem
            .acquire(&mut s, now + 600_000, 1, 8)
            .decision
            .is_allowed());
        // Forward, a renewal extends as before.
        assert!(sem.renew(&mut s, now + 900_000, 7));
        assert_eq!(s.held(now + 1_899_999), 1);
        assert_eq!(s.held(now + 1_900_000), 0);
    }
}
