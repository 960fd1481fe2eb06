//! What every clone of a concurrency layer shares: its limits, bound to
//! the store, and how a held permit goes back to them.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use tollgate_core::{ConcurrencyLimiter, PinnedPermits};

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
    /// The per-key limit's one key, counted apart by the store (a fixed
    /// key, no queue, a store that pins): set at the first request, which
    /// brings the request type the key is read for.
    pub(crate) pinned: std::sync::OnceLock<Option<PinnedPermits>>,
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
            if let Some(Some(pinned)) = self.pinned.get() {
                // Every lease of a pinned key was granted there (the pin
                // is set before the first acquire), and no queue waits.
                pinned.release(lease);
            } else {
                self.release_per_key(&held.key, lease);
            }
        }
        match (&self.service, held.take_service()) {
            (Some(ServiceLimit::Fixed(slot)), Some(lease)) => {
                drop(slot.limiter.release(SERVICE_KEY, lease));
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

impl<K, C, P, L: ConcurrencyLimiter> Limits<K, C, P, L> {
    fn release_per_key(&self, key: &[u8], lease: tollgate_core::Lease) {
        // The release is under way once called.
        let done = self.per_key.limiter.release(key, lease);
        if let Some(q) = &self.queue {
            wake_when_released(q, q.hash(key), done);
        }
    }
}
