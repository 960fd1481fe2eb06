//! Concurrency on Redis: permits are leases with an expiry (the core's
//! [`Semaphore`](tollgate_core::Semaphore), run by `semaphore.lua`), so a
//! holder that dies cannot keep its permits; the store's lease task
//! releases them for guards and renews them for live holders (see
//! [`keeper`](crate::keeper)).

use std::fmt;
use std::future::ready;
use std::sync::Arc;
use std::time::Duration;

use tollgate_core::{
    Acquire, ConcurrencyLimiter, ConcurrencyRule, ConfigError, Lease, StoreError, StoreErrorKind,
};

use crate::backend::Backend;
use crate::keeper::LeaseKeeper;
use crate::key;
use crate::leases::{member, LeaseIds, LiveLeases};
use crate::policy::{ConcurrencyOnFailure, LOCAL_LEASE};
use crate::scripts::{Acquired, SemaphoreMode};
use crate::BoxFuture;

/// The shortest lease TTL the store takes: its lease task renews every
/// third of the TTL, over the network, and a lease must not lapse while a
/// renewal is on its way.
const MIN_LEASE_TTL: Duration = Duration::from_secs(1);

/// How many ids an acquire tries before it gives up (each refusal means
/// a live lease of the key has the id: about 2⁻⁶² likely).
const ID_ATTEMPTS: u32 = 3;

/// A concurrency rule bound to a [`RedisStore`](crate::RedisStore): leases
/// in a sorted set per key, held permits counted beside it, so every
/// operation is O(log n) in the leases of the key, amortised: two rare
/// steps are O(n), a re-base of the scores when their base is 26 days old
/// (a key never idle that long) and a recount when Redis evicted the
/// key's count. Cheap to clone.
///
/// [`release`](ConcurrencyLimiter::release) hands the lease to the
/// store's lease task at once (dropping its future cancels nothing); the
/// same task renews the leases this store holds. Leases granted by the
/// failure policy while Redis was unreachable are released where they were
/// granted.
///
/// The store chooses each lease's id (random, see `leases.rs`) before
/// it asks Redis, so a lease is never lost track of: an acquire runs as a
/// task of its own, and if its future is dropped before Redis answers
/// (the request was cancelled), a lease Redis granted is released when
/// the answer comes; if the answer misses the timeout or cannot be read,
/// the failure policy answers and the lease Redis may have granted under
/// that id is released, best effort, by the lease task. Should that
/// release fail too, the lease lapses after its TTL.
///
/// Binding a rule whose lease TTL is under a second fails
/// (`lease_ttl`): leases are renewed every third of it, over the network.
#[derive(Clone)]
pub struct RedisConcurrencyLimiter {
    bound: Arc<BoundConcurrency>,
}

struct BoundConcurrency {
    backend: Arc<Backend>,
    keeper: LeaseKeeper,
    ids: Arc<LeaseIds>,
    leases: Arc<LiveLeases>,
    rule: ConcurrencyRule,
    on_failure: ConcurrencyOnFailure,
}

impl fmt::Debug for RedisConcurrencyLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisConcurrencyLimiter")
            .field("rule", &self.bound.rule)
            .finish_non_exhaustive()
    }
}

impl RedisConcurrencyLimiter {
    pub(crate) fn new(
        backend: Arc<Backend>,
        keeper: LeaseKeeper,
        ids: Arc<LeaseIds>,
        rule: &ConcurrencyRule,
        mode: crate::policy::Rebind,
    ) -> Result<Self, ConfigError> {
        if Duration::from_nanos(rule.semaphore().lease_ttl()) < MIN_LEASE_TTL {
            return Err(ConfigError::new(
                "lease_ttl",
                "the Redis store needs a lease TTL of at least 1 s: it renews leases every \
                 third of their TTL over the network, and a shorter TTL lets leases lapse \
                 mid-request whenever a round trip is slow",
            ));
        }
        crate::scripts::check_span("lease_ttl", rule.semaphore().lease_ttl())?;
        let on_failure = ConcurrencyOnFailure::new(&backend.policy.binding(mode), rule)?;
        let leases = LiveLeases::new(rule.semaphore());
        keeper.watch(&leases);
        Ok(Self {
            bound: Arc::new(BoundConcurrency {
                backend,
                keeper,
                ids,
                leases,
                rule: rule.clone(),
                on_failure,
            }),
        })
    }
}

/// An acquire's answer on its way to the caller: a lease nobody took out
/// of it is released when it is dropped.
struct Granted {
    got: Option<Acquire>,
    bound: Arc<BoundConcurrency>,
    key: Vec<u8>,
}

impl Drop for Granted {
    fn drop(&mut self) {
        if let Some(lease) = self.got.take().and_then(|g| g.lease) {
            drop(self.bound.release(&self.key, lease));
        }
    }
}

impl BoundConcurrency {
    /// Acquires, and keeps a granted lease alive; gives back what the
    /// caller needs to hand the lease back should it be gone.
    async fn acquire(
        self: Arc<Self>,
        key: Vec<u8>,
        permits: u32,
        ceiling: u32,
    ) -> (Acquire, Arc<Self>, Vec<u8>) {
        let rkey = self.redis_key(&key);
        let ceiling = self.rule.semaphore().ceiling(ceiling);
        let got = self.acquire_in_redis(&rkey, permits, ceiling).await;
        // A fault or an unreadable reply: the failure policy answers.
        let got = match got {
            Some(got) => {
                if let Some(lease) = got.lease {
                    self.leases.hold(rkey, lease);
                }
                got
            }
            None => self.on_failure.acquire(&self.rule, &key, permits, ceiling),
        };
        (got, self, key)
    }

    /// Asks Redis for `permits` at `rkey` under an id of the store's,
    /// another if a live lease has it; `None` if there is no answer.
    async fn acquire_in_redis(&self, rkey: &str, permits: u32, ceiling: u32) -> Option<Acquire> {
        let ceiling = ceiling.to_string();
        // This store's releases of the key still on their way: Redis
        // applies them first, so that a request that follows its own
        // response at once is not refused by the lease it gave back.
        let mut carried = self.leases.carried(rkey);
        for _ in 0..ID_ATTEMPTS {
            let id = self.ids.next();
            let mut tail = vec![ceiling.clone(), id.to_string()];
            tail.extend(carried.iter().map(member));
            let reply = self
                .leases
                .args
                .call(&self.backend, SemaphoreMode::Acquire, rkey, permits, &tail)
                .await;
            // Sent once: an id taken makes a second call, which carries
            // them no more (the first applied them, or failed and their
            // own release calls will).
            carried.clear();
            let (maybe_granted, answer) = match reply {
                Ok(reply) => (true, reply.acquire(permits, id)),
                Err(fault) => (fault.maybe_sent, None),
            };
            match answer {
                Some(Acquired::Answer(got)) => return Some(got),
                Some(Acquired::IdTaken) => continue,
                None => {
                    // The script may have run and granted a lease whose
                    // answer is lost: hand its release to the lease task
                    // (a release of a lease that is not there does
                    // nothing), so that it does not hold permits for a
                    // whole TTL.
                    if maybe_granted && permits > 0 {
                        drop(self.keeper.release(
                            &self.leases,
                            rkey.to_owned(),
                            Lease { id, permits },
                        ));
                    }
                    return None;
                }
            }
        }
        None
    }

    fn release(&self, key: &[u8], lease: Lease) -> BoxFuture<Result<(), StoreError>> {
        if lease.id & LOCAL_LEASE != 0 {
            self.on_failure.release(key, lease);
            return Box::pin(ready(Ok(())));
        }
        self.keeper
            .release(&self.leases, self.redis_key(key), lease)
    }

    fn redis_key(&self, key: &[u8]) -> String {
        self.backend
            .names
            .name(key::Format::Semaphore, self.rule.name(), key)
    }
}

impl ConcurrencyLimiter for RedisConcurrencyLimiter {
    type AcquireFuture = BoxFuture<Result<Acquire, StoreError>>;
    type ReleaseFuture = BoxFuture<Result<(), StoreError>>;
    type HeldFuture = BoxFuture<Result<u64, StoreError>>;

    fn rule(&self) -> &ConcurrencyRule {
        &self.bound.rule
    }

    fn acquire(&self, key: &[u8], permits: u32, ceiling: u32) -> Self::AcquireFuture {
        let bound = Arc::clone(&self.bound);
        let key = key.to_vec();
        let acquire = async move { bound.acquire(key, permits, ceiling).await };
        // The call runs as a task of its own, so that a caller that gives
        // up (a cancelled request) cannot strand a lease Redis granted
        // anyway: the task hands it straight back. Outside a runtime (no
        // task to spawn), it runs in the caller's future.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return Box::pin(async move { Ok(acquire.await.0) });
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        runtime.spawn(async move {
            let (got, bound, key) = acquire.await;
            // Whether the send fails (the caller is gone) or the answer
            // is dropped unread (it went before reading it), the lease
            // goes back.
            let _ = tx.send(Granted {
                got: Some(got),
                bound,
                key,
            });
        });
        Box::pin(async move {
            rx.await.ok().and_then(|mut g| g.got.take()).ok_or_else(|| {
                StoreError::new(StoreErrorKind::Unavailable, "the acquire task was dropped")
            })
        })
    }

    fn release(&self, key: &[u8], lease: Lease) -> Self::ReleaseFuture {
        self.bound.release(key, lease)
    }

    fn held(&self, key: &[u8]) -> Self::HeldFuture {
        let bound = Arc::clone(&self.bound);
        let rkey = bound.redis_key(key);
        let key = key.to_vec();
        Box::pin(async move {
            let counted = bound
                .leases
                .args
                .run(&bound.backend, SemaphoreMode::Held, &rkey, 0, &[])
                .await
                .and_then(|reply| {
                    reply.count().ok_or_else(|| {
                        StoreError::new(StoreErrorKind::Protocol, "unreadable reply to held")
                    })
                });
            counted.or_else(|e| bound.on_failure.held(&key, e))
        })
    }
}
