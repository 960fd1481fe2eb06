//! The leases one concurrency limiter granted and has not released (so
//! the store's [`keeper`](crate::keeper) renews them), the ids of new
//! leases, and the semaphore script's arguments.
//!
//! A lease is here from its grant until its release is handed to the
//! keeper. A renewal extends a lease only while Redis still holds it under
//! the same member (its id and permits): it never re-creates one that
//! lapsed or was released. Ids are the client's ([`LeaseIds`]), drawn at
//! random per store and never repeated by it, and the script refuses one a
//! live lease of the key already has; so, unlike ids counted in Redis
//! (which start over when Redis loses its count), one holder's renewals
//! and releases never reach another holder's lease.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tollgate_core::{Lease, Semaphore, StoreError};

use crate::backend::{Backend, Fault};
use crate::scripts::{self, Reply, SemaphoreMode};

/// Ids below 2⁶², so that they never carry
/// [`LOCAL_LEASE`](crate::policy::LOCAL_LEASE).
const ID_BITS: u64 = (1 << 62) - 1;

/// The lease ids of one store: a random seed (std's [`RandomState`], keyed
/// from the operating system's randomness) plus a counter, scrambled by a
/// bijection of the 62-bit numbers. A store never gives an id twice (until
/// 2⁶² acquires); two stores give the same one with a chance of about one
/// in 2⁶² per pair of leases — and the script refuses it then.
#[derive(Debug)]
pub(crate) struct LeaseIds {
    seed: u64,
    next: AtomicU64,
}

impl LeaseIds {
    pub(crate) fn new() -> Self {
        let seed = RandomState::new().hash_one(("tollgate-redis lease ids", std::process::id()));
        Self {
            seed,
            next: AtomicU64::new(0),
        }
    }

    /// A new id: from 1 to 2⁶² − 1.
    pub(crate) fn next(&self) -> u64 {
        loop {
            let n = self.next.fetch_add(1, Ordering::Relaxed);
            let id = scramble(self.seed.wrapping_add(n) & ID_BITS);
            if id != 0 {
                return id;
            }
        }
    }
}

/// A bijection of `0..2⁶²` (xor-shifts and odd multipliers, modulo 2⁶²),
/// so that distinct counters give distinct ids that look random.
fn scramble(mut x: u64) -> u64 {
    x ^= x >> 31;
    x = x.wrapping_mul(0x7fb5_d329_728e_a185) & ID_BITS;
    x ^= x >> 27;
    x = x.wrapping_mul(0x81da_def4_bc2d_d44d) & ID_BITS;
    x ^ (x >> 33)
}

/// The semaphore script's arguments for one rule.
#[derive(Debug)]
pub(crate) struct SemaphoreArgs {
    ttl: String,
    max: String,
    lease_ttl: String,
    retry_after: String,
}

impl SemaphoreArgs {
    pub(crate) fn new(semaphore: &Semaphore) -> Self {
        Self {
            ttl: scripts::ttl_ms(semaphore.lease_ttl()).to_string(),
            max: semaphore.max().to_string(),
            lease_ttl: semaphore.lease_ttl().to_string(),
            retry_after: semaphore.retry_after().to_string(),
        }
    }

    /// Runs the script in `mode` on the leases at `key` (its hash is
    /// `key:meta`); `tail` is `ARGV[8..]`.
    pub(crate) async fn run(
        &self,
        backend: &Backend,
        mode: SemaphoreMode,
        key: &str,
        permits: u32,
        tail: &[String],
    ) -> Result<Reply, StoreError> {
        self.call(backend, mode, key, permits, tail)
            .await
            .map_err(|f| f.error)
    }

    /// [`run`](Self::run), saying on failure whether the call may have
    /// reached Redis.
    pub(crate) async fn call(
        &self,
        backend: &Backend,
        mode: SemaphoreMode,
        key: &str,
        permits: u32,
        tail: &[String],
    ) -> Result<Reply, Fault> {
        let meta = format!("{key}:meta");
        let now = backend.now_arg();
        let permits = permits.to_string();
        let mut args: Vec<&str> = Vec::with_capacity(tail.len().saturating_add(7));
        args.extend([
            mode.arg(),
            permits.as_str(),
            now.as_str(),
            self.ttl.as_str(),
            self.max.as_str(),
            self.lease_ttl.as_str(),
            self.retry_after.as_str(),
        ]);
        args.extend(tail.iter().map(String::as_str));
        backend
            .call(&scripts::SEMAPHORE, &[key, &meta], &args)
            .await
    }
}

/// A lease as the script's sorted set names it: `id:permits`.
pub(crate) fn member(lease: &Lease) -> String {
    format!("{}:{}", lease.id, lease.permits)
}

/// Most releases of one key carried on an acquire
/// ([`LiveLeases::carried`]).
const MAX_CARRIED: usize = 64;

/// The leases one concurrency limiter granted and has not released, by
/// Redis key; and the releases handed to the keeper that Redis has not
/// answered yet, which an acquire of the same key carries (so that a
/// client whose next request follows its last response at once never
/// meets its own released lease: the release may still be on its way,
/// behind a slow Redis or a busy keeper, when the acquire is sent).
#[derive(Debug)]
pub(crate) struct LiveLeases {
    pub(crate) args: SemaphoreArgs,
    pub(crate) every: Duration,
    held: Mutex<HashMap<String, HashMap<u64, u32>>>,
    releasing: Mutex<HashMap<String, Vec<Lease>>>,
    pub(crate) renewing: AtomicBool,
}

impl LiveLeases {
    pub(crate) fn new(semaphore: &Semaphore) -> Arc<Self> {
        Arc::new(Self {
            args: SemaphoreArgs::new(semaphore),
            every: Duration::from_nanos(semaphore.lease_ttl() / 3),
            held: Mutex::new(HashMap::new()),
            releasing: Mutex::new(HashMap::new()),
            renewing: AtomicBool::new(false),
        })
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, HashMap<u64, u32>>> {
        // The map stays consistent whatever panicked while it was locked.
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn lock_releasing(&self) -> MutexGuard<'_, HashMap<String, Vec<Lease>>> {
        // As `lock`: consistent whatever panicked while it was locked.
        self.releasing
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Records a lease Redis granted.
    pub(crate) fn hold(&self, key: String, lease: Lease) {
        self.lock()
            .entry(key)
            .or_default()
            .insert(lease.id, lease.permits);
    }

    /// Stops renewing a lease (released, or lapsed in Redis).
    pub(crate) fn forget(&self, key: &str, id: u64) {
        let mut held = self.lock();
        if let Some(leases) = held.get_mut(key) {
            leases.remove(&id);
            if leases.is_empty() {
                held.remove(key);
            }
        }
    }

    /// Records a release handed to the keeper (at most [`MAX_CARRIED`]
    /// a key; past them a release only goes its own way).
    pub(crate) fn releasing(&self, key: &str, lease: Lease) {
        let mut releasing = self.lock_releasing();
        let leases = releasing.entry(key.to_owned()).or_default();
        if leases.len() < MAX_CARRIED {
            leases.push(lease);
        }
    }

    /// Forgets releases of `key` that Redis has answered (or that an
    /// acquire carried), by id.
    pub(crate) fn released(&self, key: &str, ids: impl Iterator<Item = u64> + Clone) {
        let mut releasing = self.lock_releasing();
        if let Some(leases) = releasing.get_mut(key) {
            leases.retain(|l| !ids.clone().any(|id| id == l.id));
            if leases.is_empty() {
                releasing.remove(key);
            }
        }
    }

    /// The releases of `key` still on their way, taken for an acquire to
    /// carry: Redis applies them before it counts. Taken, not copied, so
    /// that acquires of a busy key do not each carry the same list (one
    /// multiplexed connection keeps the calls in order: an acquire sent
    /// after this one finds them applied). If the call fails they are not
    /// put back: their own release calls still land.
    pub(crate) fn carried(&self, key: &str) -> Vec<Lease> {
        let mut releasing = self.lock_releasing();
        releasing.remove(key).unwrap_or_default()
    }

    /// Leases held now, by key.
    pub(crate) fn snapshot(&self) -> Vec<(String, Vec<Lease>)> {
        self.lock()
            .iter()
            .map(|(key, leases)| {
                let leases = leases
                    .iter()
                    .map(|(&id, &permits)| Lease { id, permits })
                    .collect();
                (key.clone(), leases)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_distinct_nonzero_and_below_2_62() {
        let ids = LeaseIds::new();
        let mut seen = std::collections::HashSet::new();
        for _ in 0..100_000 {
            let id = ids.next();
            assert!(id != 0 && id <= ID_BITS, "{id}");
            assert!(seen.insert(id), "{id} given twice");
        }
        // Two stores start from different seeds.
        assert_ne!(LeaseIds::new().next(), LeaseIds::new().next());
        // The scramble is a bijection: distinct inputs, distinct outputs,
        // also next to the seed's wrap-around.
        let wrap: std::collections::HashSet<u64> = (0..1_000u64)
            .map(|n| scramble(ID_BITS.wrapping_sub(500).wrapping_add(n) & ID_BITS))
            .collect();
        assert_eq!(wrap.len(), 1_000);
    }
}
