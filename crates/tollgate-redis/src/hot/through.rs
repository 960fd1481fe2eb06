//! Decisions that go to the store: a lease taken for a decision, a
//! decision through the store beside the key's others, and the guards
//! that end what a dropped decision started.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::Notify;
use tollgate_core::{Clock, Decision, JointPart, Limiter, Outcome, StoreError};

use super::local::{Local, Step};

/// Asks `inner` for a lease of `units` for `key`: its answer, and whether
/// the store's failure policy gave it rather than the store (a store that
/// decides rules together says so; for others, never).
pub(super) async fn lease<L: Limiter>(inner: &L, key: &[u8], units: u64) -> Flagged {
    let part = JointPart {
        limiter: inner,
        key,
        cost: units,
        enforced: true,
    };
    let Some(joint) = L::decide_joint(std::slice::from_ref(&part)) else {
        return (inner.decide(key, units).await, false);
    };
    match joint.await.into_iter().next() {
        Some(answer) => (answer.decision, answer.failed),
        None => (inner.decide(key, units).await, false),
    }
}

/// A decision, and whether the store's failure policy gave it.
pub(super) type Flagged = (Result<Decision, StoreError>, bool);

/// A decision that the key's lease could not answer at once: it waits for
/// a lease in flight, takes one, or goes to the store, as the key's state
/// says (see `Local::plan`). Also says whether the store's failure policy
/// answered.
pub(super) async fn decide_through<L: Limiter, C: Clock>(
    inner: L,
    local: Arc<Local<C>>,
    key: Vec<u8>,
    cost: u64,
    limit: u64,
) -> (Result<Decision, StoreError>, bool) {
    local.decisions.add();
    let mut waited = false;
    let mut landed = 0;
    loop {
        let step = local.plan(&key, cost, limit, landed);
        if !waited && matches!(step, Step::Through | Step::Take { .. }) {
            waited = true;
            local.waits.add();
        }
        match step {
            Step::Done(d) => return (Ok(d), local.unowned(&key)),
            Step::Through => {
                local.store_calls.add();
                return lease(&inner, &key, cost).await;
            }
            Step::Aside => {
                let _aside = Aside {
                    local: &local,
                    key: &key,
                };
                local.store_calls.add();
                let sent = local.clock.now();
                let (d, unowned) = lease(&inner, &key, cost).await;
                local.after_through(&key, cost, sent, (&d, unowned));
                return (d, unowned);
            }
            Step::Wait(flight) => {
                let notified = flight.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                // The flight may have landed between `plan` and
                // `enable`: wait only if it is still in the air.
                let still_flying = {
                    let mut shard = local.shard(&key);
                    shard
                        .get_mut(key.as_slice())
                        .and_then(|s| s.flight.as_ref().map(|f| Arc::ptr_eq(f, &flight)))
                        .unwrap_or(false)
                };
                if still_flying {
                    if !waited {
                        waited = true;
                        local.waits.add();
                    }
                    notified.await;
                }
                landed = landed.saturating_add(1);
                // The lease failed (the store did not answer): go
                // to the store, whose failure policy answers, side
                // by side, rather than each waiter in turn taking
                // a lease that times out.
                let failed = local
                    .shard(&key)
                    .get(key.as_slice())
                    .is_some_and(|s| s.failed);
                if failed {
                    if !waited {
                        local.waits.add();
                    }
                    local.store_calls.add();
                    return lease(&inner, &key, cost).await;
                }
            }
            Step::Take { batch, give_back } => {
                let guard = Flight {
                    local: &local,
                    key: &key,
                    done: false,
                };
                if give_back > 0 {
                    local.store_calls.add();
                    // A failed give-back only means the units lapse.
                    // Polled once here (so it is on the connection
                    // before the lease below), then on a task of its
                    // own, not waited for: a cancelled request still
                    // gives them back, and a hung store costs this
                    // decision one timeout, not one per call.
                    let mut refund = Box::pin(inner.refund(&key, give_back));
                    match tokio::runtime::Handle::try_current() {
                        Ok(rt) => {
                            // Polled once here, so that it is on
                            // the connection before the lease is.
                            let first = std::future::poll_fn(|cx| {
                                std::task::Poll::Ready(refund.as_mut().poll(cx).is_ready())
                            })
                            .await;
                            if !first {
                                drop(rt.spawn(refund));
                            }
                        }
                        Err(_) => {
                            let _ = refund.await;
                        }
                    }
                }
                let sent = local.clock.now();
                local.store_calls.add();
                let mut taken = batch;
                let (mut d, mut unowned) = lease(&inner, &key, batch).await;
                // Not enough for a batch: ask for what is left
                // (the denial says how much), at least this
                // request's cost.
                // The failure policy refused the batch: ask again
                // for this cost alone (a fallback memory's share
                // may hold it), unless the policy refuses every
                // cost alike (a closed store: asking again would
                // only cost another timeout).
                let again = match &d {
                    Ok(d) if unowned => !d.is_allowed() && *d != Decision::closed(d.limit),
                    Ok(d) => matches!(d.outcome, Outcome::Deny { .. }),
                    Err(_) => false,
                };
                if let (true, Ok(Decision { remaining, .. })) = (again && batch > cost, &d) {
                    // (Below the cost: ask for the cost alone, for
                    // the exact wait the denial cache keeps.)
                    let left = if unowned {
                        cost
                    } else {
                        (*remaining).min(batch).max(cost)
                    };
                    local.store_calls.add();
                    taken = left;
                    (d, unowned) = lease(&inner, &key, left).await;
                }
                local.settle(&key, cost, taken, sent, (&d, unowned));
                let mut guard = guard;
                guard.done = true;
                let d = d.map(|mut d| {
                    if d.is_allowed() {
                        // The rest of the batch is this client's too.
                        d.remaining = d.remaining.saturating_add(taken.saturating_sub(cost));
                    }
                    d
                });
                return (d, unowned);
            }
        }
    }
}

/// A decision at the store beside the key's others (`Step::Aside`): its
/// place is given back however it ends.
pub(super) struct Aside<'a, C: Clock> {
    pub(super) local: &'a Local<C>,
    pub(super) key: &'a [u8],
}

impl<C: Clock> Drop for Aside<'_, C> {
    fn drop(&mut self) {
        let mut shard = self.local.shard(self.key);
        if let Some(s) = shard.get_mut(self.key) {
            s.aside = s.aside.saturating_sub(1);
        }
    }
}

/// A lease taken ahead, in its task: when the task ends (however it
/// does), a flight still set — it did not land — ends, and its waiters
/// wake and ask the store themselves.
pub(super) struct Ahead<C: Clock> {
    pub(super) local: Arc<Local<C>>,
    pub(super) key: Vec<u8>,
    pub(super) flight: Arc<Notify>,
}

impl<C: Clock> Drop for Ahead<C> {
    fn drop(&mut self) {
        self.local.land_nothing(&self.key, &self.flight);
    }
}

/// Ends a flight if its future is dropped mid-way (a cancelled request):
/// the waiters wake and one of them takes the lease.
pub(super) struct Flight<'a, C: Clock> {
    pub(super) local: &'a Local<C>,
    pub(super) key: &'a [u8],
    pub(super) done: bool,
}

impl<C: Clock> Drop for Flight<'_, C> {
    fn drop(&mut self) {
        if !self.done {
            let mut shard = self.local.shard(self.key);
            if let Some(s) = shard.get_mut(self.key) {
                if let Some(flight) = s.flight.take() {
                    flight.notify_waiters();
                }
            }
        }
    }
}
