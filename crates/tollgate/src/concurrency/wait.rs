//! A request's wait in its key's queue, and the wake-up of the head of
//! a queue when a permit of its key is released.

use std::future::Future;
use std::sync::Arc;

use tokio::time::Instant;
use tollgate_core::{ConcurrencyLimiter, Decision, Outcome, StoreError};

use super::admission::{Pending, Step};
use super::limits::Limits;
use super::queue::Queue;
use crate::rejection::Reason;

impl<K, C, P, L> Limits<K, C, P, L>
where
    L: ConcurrencyLimiter,
{
    /// Waits in the request's key's queue until the head of it gets a permit, the wait
    /// runs out (`max_wait` after the request `arrived`; `first` is what its
    /// first acquire answered, if it made one; an acquire still
    /// in flight then included: it is given up, and a lease it got goes
    /// back), or the queue is full. A critical request tries whenever
    /// it wakes, wherever it stands: the reserve is for it, and a
    /// non-critical head held to its share must not keep it waiting.
    pub(super) async fn wait_turn(
        &self,
        p: &Pending,
        (arrived, first): (Instant, Option<Decision>),
    ) -> Step {
        let limit = self.plans.get(p.plan);
        let (ceiling, max) = (limit.ceiling(p.critical), limit.max);
        let (key, permits, critical) = (p.key.raw_bytes(), p.permits, p.critical);
        let Some(queue) = &self.queue else {
            return Step::Pass(None);
        };
        let limiter = &self.per_key.limiter;
        // What a refusal reports: the last acquire's answer, if any.
        let refused = |last: Option<Decision>| {
            let d = last.map_or_else(|| timed_out(limiter, max), |d| with_hint(d, limiter));
            Step::Reject(Reason::Limited, d)
        };
        let hash = queue.hash(key);
        let deadline = arrived.checked_add(queue.max_wait).unwrap_or(arrived);
        let Some(place) = queue.join(hash, critical) else {
            self.metrics.queue_full.increment(1);
            let peek = limiter.acquire(key, 0, ceiling).await.ok();
            return refused(peek.map(|a| a.decision));
        };
        // The first acquire's answer, until a later one says more.
        let mut last = first;
        // Backs off while nothing here wakes it (see `queue`).
        let mut recheck = queue.recheck;
        let mut on_timer = false;
        loop {
            let head = place.is_head();
            if Instant::now() >= deadline {
                // No acquire sent to be given up at once.
                self.metrics.queue_timeout.increment(1);
                return refused(last);
            }
            if head || critical {
                if on_timer {
                    self.metrics.rechecks.increment(1);
                }
                let acquire = limiter.acquire(key, permits, ceiling);
                let Ok(got) = tokio::time::timeout_at(deadline, acquire).await else {
                    self.metrics.queue_timeout.increment(1);
                    return refused(last);
                };
                match self.step(got, true) {
                    Step::Wait(d) => last = Some(d),
                    Step::Granted(lease, d) => {
                        self.metrics.queued.increment(1);
                        return Step::Granted(lease, d);
                    }
                    other => return other,
                }
            }
            let now = Instant::now();
            if now >= deadline {
                self.metrics.queue_timeout.increment(1);
                return refused(last);
            }
            // Only those that try look again on a timer (for releases this
            // process does not see); the rest wait to be woken.
            let until = if head || critical {
                deadline.min(now.checked_add(recheck).unwrap_or(deadline))
            } else {
                deadline
            };
            let woken = place.wait(until).await;
            on_timer = !woken;
            if on_timer && (head || critical) {
                recheck = recheck.saturating_mul(2);
            }
        }
    }
}

/// A queued request's refusal when its wait ran out before any acquire
/// answered.
fn timed_out<L: ConcurrencyLimiter>(limiter: &L, max: u32) -> Decision {
    with_hint(
        Decision {
            outcome: Outcome::Deny { retry_after: 0 },
            limit: u64::from(max),
            remaining: 0,
            reset_after: 0,
        },
        limiter,
    )
}

/// The decision with the rule's retry hint as its `retry_after`.
fn with_hint<L: ConcurrencyLimiter>(mut d: Decision, limiter: &L) -> Decision {
    d.outcome = Outcome::Deny {
        retry_after: limiter.rule().semaphore().retry_after(),
    };
    d
}

/// Wakes the head of a key's queue once a release of that key is done: at
/// once for a store that released already (in memory), from a task when
/// the release is still on its way to Redis — so the waiter does not wake
/// to find the permit still held. Without waiters, nothing to wait for.
pub(super) fn wake_when_released<F>(queue: &Arc<Queue>, key: u64, done: F)
where
    F: Future<Output = Result<(), StoreError>> + Send + 'static,
{
    if !queue.anyone_waiting() {
        return;
    }
    let later = Arc::clone(queue);
    crate::task::finish(async move {
        let _ = done.await;
        later.wake(key);
    });
}
