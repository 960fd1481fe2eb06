//! What every clone of a concurrency layer shares: its limits, bound to
//! the store, and how a held permit goes back to them.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use std::sync::OnceLock;

use tollgate_core::{Acquire, ConcurrencyLimiter, Lease, PinnedPermits, StoreError};

use super::adaptive::Adaptive;
use super::permit::{Held, Release};
use super::queue::Queue;
use super::respond::Responder;
use super::wait::wake_when_released;
use crate::key::Keying;
use crate::observe::ConcurrencyMetrics;
use crate::policy::access::Listed;
use crate::policy::plan::PlanSet;

pub(crate) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// The key every request shares under the service-wide limit.
pub(crate) const SERVICE_KEY: &[u8] = b"\x00service";

/// What a plan sets of the per-key limit: its most permits (a ceiling
/// under the rule's max, which is the largest plan's), the ceiling of its
/// non-critical requests, and its headers and rejection.
pub(crate) struct PlanLimit {
    pub(crate) max: u32,
    pub(crate) share: u32,
    pub(crate) responder: Arc<Responder>,
}

impl PlanLimit {
    pub(super) fn ceiling(&self, critical: bool) -> u32 {
        if critical {
            self.max
        } else {
            self.share
        }
    }
}

/// A limit kept in the store: its binding, its name, and the ceiling of
/// non-critical requests under it.
pub(crate) struct StoreLimit<L> {
    pub(crate) limiter: L,
    pub(crate) name: Arc<str>,
    /// The ceiling of non-critical requests.
    pub(crate) share: u32,
    /// The limit's one key, counted apart by the store
    /// ([`ConcurrencyLimiter::pin`]), where every request has the same
    /// key and no queue waits by key: set when the limit is built (the
    /// service limit) or at the first request, which brings the request
    /// type a per-key limit's key is read from. Every lease of the limit
    /// is then granted there.
    pub(crate) pinned: OnceLock<Option<PinnedPermits>>,
}

impl<L: ConcurrencyLimiter> StoreLimit<L> {
    pub(crate) fn new(limiter: L, name: Arc<str>, share: u32) -> Self {
        Self {
            limiter,
            name,
            share,
            pinned: OnceLock::new(),
        }
    }

    /// The store's acquire at once, if it answers at once: through the
    /// pinned key where there is one (`key` is then that key).
    #[inline]
    pub(crate) fn acquire_sync(
        &self,
        key: &[u8],
        permits: u32,
        ceiling: u32,
    ) -> Option<Result<Acquire, StoreError>> {
        match self.pinned.get() {
            Some(Some(pinned)) => Some(Ok(pinned.acquire(permits, ceiling))),
            _ => self.limiter.acquire_sync(key, permits, ceiling),
        }
    }

    /// The store's acquire, through the pinned key where there is one.
    pub(crate) async fn acquire(
        &self,
        key: &[u8],
        permits: u32,
        ceiling: u32,
    ) -> Result<Acquire, StoreError> {
        match self.pinned.get() {
            Some(Some(pinned)) => Ok(pinned.acquire(permits, ceiling)),
            _ => self.limiter.acquire(key, permits, ceiling).await,
        }
    }

    /// Gives `lease` back: to the pinned key, or to the store (`None`
    /// then: the store's release is under way).
    #[inline]
    pub(crate) fn release(&self, key: &[u8], lease: Lease) -> Option<L::ReleaseFuture> {
        match self.pinned.get() {
            Some(Some(pinned)) => {
                pinned.release(lease);
                None
            }
            _ => Some(self.limiter.release(key, lease)),
        }
    }
}

pub(crate) enum ServiceLimit<L> {
    Fixed(StoreLimit<L>),
    Adaptive(Arc<Adaptive>),
}

/// The layer's limits and settings, shared by every clone of its service.
pub(crate) struct Limits<K, C, P, L> {
    pub(crate) key: K,
    pub(crate) cost: C,
    pub(crate) critical: P,
    /// The per-key limit's store binding; its max is the largest plan's,
    /// and each plan's max is a ceiling under it.
    pub(crate) per_key: StoreLimit<L>,
    pub(crate) plans: PlanSet<PlanLimit>,
    pub(crate) service: Option<ServiceLimit<L>>,
    pub(crate) queue: Option<Arc<Queue>>,
    pub(crate) keying: Keying,
    pub(crate) shadow: bool,
    pub(crate) metrics: ConcurrencyMetrics,
    /// The share of non-critical traffic, for the adaptive limit.
    pub(crate) share: Option<f64>,
    pub(crate) access: Option<Listed>,
    /// Refuse on a store error, as a closed store does (else admit).
    pub(crate) refuse_on_store_error: bool,
}

impl<K, C, P, L> Release for Limits<K, C, P, L>
where
    K: Send + Sync + 'static,
    C: Send + Sync + 'static,
    P: Send + Sync + 'static,
    L: ConcurrencyLimiter,
{
    fn release(&self, held: &mut Held) {
        if let Some(lease) = held.take_per_key() {
            let key = &*held.key;
            // The release is under way once called (a pinned key has no
            // queue to wake).
            if let Some(done) = self.per_key.release(key, lease) {
                if let Some(q) = &self.queue {
                    wake_when_released(q, q.hash(key), done);
                }
            }
        }
        match (&self.service, held.take_service()) {
            (Some(ServiceLimit::Fixed(slot)), Some(lease)) => {
                drop(slot.release(SERVICE_KEY, lease));
            }
            (Some(ServiceLimit::Adaptive(a)), _) => {
                let permits = held.take_adaptive();
                if permits > 0 {
                    a.release(permits);
                }
            }
            _ => {}
        }
        let counted = held.take_counted();
        if counted > 0 {
            self.metrics.in_flight.decrement(f64::from(counted));
        }
    }
}
