use std::time::Duration;

use crate::clock::duration_to_nanos;
use crate::{Acquire, ConfigError, Decision, Lease, Outcome};

/// A concurrency semaphore whose permits are leases with an expiry: at most
/// `max` permits held at once per key, and a lease not released within
/// `lease_ttl` lapses, so a holder that crashed (or a process that died
/// holding a Redis lease) cannot keep its permits forever. Holders of
/// long-running work [`renew`](Self::renew) their lease.
///
/// This is the model of a distributed store's leases (the Redis store runs
/// it in Lua). An in-process store needs no expiry — a holder that dies
/// takes the process with it — and counts with [`InFlight`](crate::InFlight).
///
/// An acquire names a *ceiling*: the most permits the key may hold once
/// this acquire is granted — the rule's `max`, or less for traffic held to
/// a share of it (a critical reserve). Permits above the ceiling are
/// [`Outcome::Never`] for that acquire. A denial's `retry_after` is the
/// rule's retry hint: when a permit frees depends on other requests, which
/// no store can know.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Semaphore {
    max: u32,
    ttl: u64,
    retry_after: u64,
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

    /// The retry hint of a denial unless told otherwise: one second.
    pub const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);

    /// Validates `max` (1 to [`Self::MAX_PERMITS`]) and `lease_ttl`
    /// (at least 1 ms). Denials carry [`Self::DEFAULT_RETRY_AFTER`].
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
        Ok(Self {
            max,
            ttl,
            retry_after: duration_to_nanos(Self::DEFAULT_RETRY_AFTER),
        })
    }

    /// The same semaphore whose denials tell clients to retry after
    /// `retry_after` (at least 1 ms, at most a day).
    pub fn with_retry_after(self, retry_after: Duration) -> Result<Self, ConfigError> {
        let retry_after = duration_to_nanos(retry_after);
        if !(1_000_000..=86_400_000_000_000).contains(&retry_after) {
            return Err(ConfigError::new(
                "retry_after",
                "must be from 1 ms to 1 day",
            ));
        }
        Ok(Self {
            retry_after,
            ..self
        })
    }

    /// The retry hint of a denial, in nanoseconds.
    pub fn retry_after(&self) -> u64 {
        self.retry_after
    }

    /// `ceiling` clamped to `max`.
    pub fn ceiling(&self, ceiling: u32) -> u32 {
        ceiling.min(self.max)
    }

    /// The in-process counter with the same `max` and retry hint.
    pub fn in_flight(&self) -> crate::InFlight {
        crate::InFlight::from_semaphore(self)
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
    /// store chooses it) if, with them, the key holds at most `ceiling`
    /// permits at `now` (see the type's docs). `remaining` is counted
    /// against the ceiling.
    pub fn acquire(
        &self,
        state: &mut SemaphoreState,
        now: u64,
        permits: u32,
        ceiling: u32,
        id: u64,
    ) -> Acquire {
        Self::expire(state, now);
        let limit = u64::from(self.max);
        let ceiling = u64::from(self.ceiling(ceiling));
        let held = state.held(now);
        let remaining = ceiling.saturating_sub(held);
        let reset = Self::reset_after(state, now);
        let denied = |outcome| Acquire {
            decision: Decision::with(outcome, limit, remaining, reset),
            lease: None,
        };
        if permits == 0 {
            return denied(Outcome::Allow { delay: 0 });
        }
        if u64::from(permits) > ceiling {
            return denied(Outcome::Never);
        }
        if held.saturating_add(u64::from(permits)) > ceiling {
            return denied(Outcome::Deny {
                retry_after: self.retry_after,
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
        let a = sem.acquire(&mut s, 0, 1, 2, 1);
        let b = sem.acquire(&mut s, S, 1, 2, 2);
        assert!(a.decision.is_allowed() && b.decision.is_allowed());
        assert_eq!(b.decision.remaining, 0);
        let c = sem.acquire(&mut s, 2 * S, 1, 2, 3);
        assert_eq!(c.lease, None);
        assert_eq!(c.decision.outcome, Outcome::Deny { retry_after: S });
        assert!(sem.release(&mut s, 2 * S, 1));
        assert!(!sem.release(&mut s, 2 * S, 1), "released twice");
        assert!(sem.acquire(&mut s, 2 * S, 1, 2, 3).decision.is_allowed());
        // Lease 2 lapses at 31 s; renewing lease 3 keeps it.
        assert!(sem.renew(&mut s, 20 * S, 3));
        assert_eq!(s.held(31 * S), 1);
        assert!(!sem.renew(&mut s, 31 * S, 2));
        assert!(sem.is_idle(&s, 51 * S));
        assert_eq!(
            sem.acquire(&mut s, 0, 3, 2, 9).decision.outcome,
            Outcome::Never
        );
    }

    #[test]
    fn a_ceiling_holds_back_a_share() {
        let sem = Semaphore::new(10, Duration::from_secs(30))
            .unwrap()
            .with_retry_after(Duration::from_millis(250))
            .unwrap();
        let mut s = SemaphoreState::default();
        // Held to 8 of 10: the ninth permit is refused, for now.
        let a = sem.acquire(&mut s, 0, 8, 8, 1);
        assert!(a.decision.is_allowed());
        assert_eq!(a.decision.remaining, 0);
        assert_eq!(
            sem.acquire(&mut s, 0, 1, 8, 2).decision.outcome,
            Outcome::Deny {
                retry_after: 250_000_000
            }
        );
        // Beyond the share altogether: never, for this class.
        assert_eq!(
            sem.acquire(&mut s, 0, 9, 8, 3).decision.outcome,
            Outcome::Never
        );
        // The full ceiling still admits the reserve; above max clamps.
        assert!(sem.acquire(&mut s, 0, 2, u32::MAX, 4).decision.is_allowed());
        assert!(!sem.acquire(&mut s, 0, 1, u32::MAX, 5).decision.is_allowed());
        assert_eq!(
            Semaphore::new(1, Duration::from_secs(1))
                .unwrap()
                .with_retry_after(Duration::ZERO)
                .unwrap_err()
                .field(),
            "retry_after"
        );
    }

    #[test]
    fn renewal_with_the_clock_back_never_shortens_the_lease() {
        // Found by the property tests: a renewal with the clock 0.5 ms back
        // used to move the expiry back by 0.5 ms, freeing the permit early.
        let sem = Semaphore::new(1, Duration::from_millis(1)).unwrap();
        let mut s = SemaphoreState::default();
        let now = 10_000_000;
        assert!(sem.acquire(&mut s, now, 1, 1, 7).decision.is_allowed());
        assert!(sem.renew(&mut s, now - 500_000, 7));
        assert_eq!(s.held(now + 999_999), 1);
        assert!(!sem
            .acquire(&mut s, now + 600_000, 1, 1, 8)
            .decision
            .is_allowed());
        // Forward, a renewal extends as before.
        assert!(sem.renew(&mut s, now + 900_000, 7));
        assert_eq!(s.held(now + 1_899_999), 1);
        assert_eq!(s.held(now + 1_900_000), 0);
    }
}
