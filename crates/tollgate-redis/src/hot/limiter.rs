//! A leased rule's limiter: decisions from its lease, or through the
//! store.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tollgate_core::{
    Clock, Decision, JointDecision, JointPart, Limiter, Rule, StoreError, SystemClock,
};

use super::local::Local;
use super::through::{decide_through, lease, Ahead, Flagged};

/// A rule bound through [`Hot`]: decides from its key's lease when it can,
/// else through the store.
pub struct HotLimiter<L, C = SystemClock> {
    pub(super) inner: L,
    pub(super) local: Option<Arc<Local<C>>>,
}

impl<L: Clone, C> Clone for HotLimiter<L, C> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            local: self.local.clone(),
        }
    }
}

impl<L: fmt::Debug, C> fmt::Debug for HotLimiter<L, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HotLimiter")
            .field("inner", &self.inner)
            .field("leased", &self.local.is_some())
            .finish()
    }
}

/// Decisions a [`HotLimiter`] made, and the store calls they took.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HotStats {
    /// Decisions (cost above 0) made.
    pub decisions: u64,
    /// Calls to the store they took (leases, refunds of ended leases,
    /// decisions through).
    pub store_calls: u64,
    /// Decisions that waited for the store — their own call, or another
    /// decision's lease in flight; the rest were answered without waiting
    /// for I/O (a lease taken ahead is taken in the background).
    pub waits: u64,
}

impl<L, C> HotLimiter<L, C> {
    /// Decisions so far and the store calls they took (zeros for a rule
    /// that is not leased).
    pub fn stats(&self) -> HotStats {
        self.local
            .as_ref()
            .map_or_else(HotStats::default, |l| HotStats {
                decisions: l.decisions.get(),
                store_calls: l.store_calls.get(),
                waits: l.waits.get(),
            })
    }

    /// Whether this rule's keys are leased (else every decision goes
    /// through the store): a rule left out of
    /// [`HotKeys::rules`], or one that cannot be leased, is not.
    pub fn is_leased(&self) -> bool {
        self.local.is_some()
    }

    /// The limiter beneath, bound on the store itself.
    pub fn inner(&self) -> &L {
        &self.inner
    }
}

/// The future of [`HotLimiter::decide`]: ready when the lease answered.
pub struct HotFuture(Inner);

pub(super) enum Inner {
    Ready(Option<Result<Decision, StoreError>>),
    Boxed(Pin<Box<dyn Future<Output = Result<Decision, StoreError>> + Send>>),
}

impl fmt::Debug for HotFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("HotFuture")
    }
}

impl Future for HotFuture {
    type Output = Result<Decision, StoreError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.0 {
            Inner::Ready(r) => Poll::Ready(r.take().unwrap_or_else(|| {
                Err(StoreError::new(
                    tollgate_core::StoreErrorKind::Protocol,
                    "polled after completion",
                ))
            })),
            Inner::Boxed(f) => f.as_mut().poll(cx),
        }
    }
}

impl<L: Limiter, C: Clock> HotLimiter<L, C> {
    /// A leased rule's decision of a cost above 0: from the key's lease at
    /// once (`Ok`), or the future that goes through the lease's flights
    /// and the store (`Err`, saying whether the failure policy answered).
    /// `None` when the rule is not leased, or for a peek: the store
    /// answers itself.
    pub(super) fn leased(
        &self,
        key: &[u8],
        cost: u64,
    ) -> Option<Result<Decision, impl Future<Output = Flagged> + Send + 'static>> {
        let local = self.local.as_ref().filter(|_| cost > 0)?;
        let limit = self.inner.rule().capacity();
        Some(match self.decide_local(local, key, cost, limit, false) {
            Some(d) => Ok(d),
            None => Err(decide_through(
                self.inner.clone(),
                Arc::clone(local),
                key.to_vec(),
                cost,
                limit,
            )),
        })
    }

    /// A decision from the key's lease or cached denial, counted; starts
    /// the lease ahead when one is due (on the runtime this runs on; with
    /// none, the key's next decision that runs out asks the store).
    ///
    /// `owned_only`: not for a key whose last answer was its store's
    /// failure policy's (a synchronous answer cannot say so; see
    /// [`decide_sync`](Limiter::decide_sync)).
    pub(super) fn decide_local(
        &self,
        local: &Arc<Local<C>>,
        key: &[u8],
        cost: u64,
        limit: u64,
        owned_only: bool,
    ) -> Option<Decision> {
        let (d, ahead) = local.local(key, cost, limit, owned_only)?;
        local.decisions.add();
        if let Some((batch, flight)) = ahead {
            // Built before the task: however it ends — never polled (its
            // runtime shut down), dropped, a panic — the flight ends with
            // it and its waiters wake.
            let guard = Ahead {
                local: Arc::clone(local),
                key: key.to_vec(),
                flight,
            };
            let inner = self.inner.clone();
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => {
                    rt.spawn(async move {
                        guard
                            .local
                            .refill(&inner, &guard.key, batch, &guard.flight)
                            .await;
                    });
                }
                Err(_) => drop(guard),
            }
        }
        Some(d)
    }
}

impl<L: Limiter, C: Clock> Limiter for HotLimiter<L, C> {
    type DecideFuture = HotFuture;
    type RefundFuture = Pin<Box<dyn Future<Output = Result<(), StoreError>> + Send>>;

    fn rule(&self) -> &Rule {
        self.inner.rule()
    }

    /// The store's own answer: never a lease's (a lease is an estimate)
    /// nor the failure policy's.
    fn decide_exact(&self, key: &[u8], cost: u64) -> HotFuture {
        HotFuture(Inner::Boxed(Box::pin(self.inner.decide_exact(key, cost))))
    }

    fn decide(&self, key: &[u8], cost: u64) -> HotFuture {
        match self.leased(key, cost) {
            None => HotFuture(Inner::Boxed(Box::pin(self.inner.decide(key, cost)))),
            Some(Ok(d)) => HotFuture(Inner::Ready(Some(Ok(d)))),
            Some(Err(through)) => HotFuture(Inner::Boxed(Box::pin(async move { through.await.0 }))),
        }
    }

    /// Each leased part decided as [`decide`](Self::decide) decides it,
    /// side by side, and the parts not leased (rules left out of
    /// [`HotKeys::rules`](super::HotKeys::rules), peeks) together in the
    /// store's own joint step (one call); each answer says whether the
    /// store's failure policy gave it (a lease or a refusal it granted,
    /// or its answer through the store), so that a policy counts no strike
    /// on a refusal that says nothing about the client. Not atomic across
    /// leased parts: an admitted part is
    /// consumed, and the caller refunds it if another refuses — except an
    /// admission the failure policy gave, which is never refunded (Redis
    /// never counted it).
    fn decide_joint(
        parts: &[JointPart<'_, Self>],
    ) -> Option<tollgate_core::BoxFuture<Vec<JointDecision>>> {
        /// Answers to some of the parts, by index.
        type Answers = crate::BoxFuture<Vec<(usize, JointDecision)>>;
        // What a lease answers (or takes a lease for), part by part; what
        // is not leased (a rule left out of `rules`, or a peek) together,
        // in the store's own joint step where it has one: one call, not
        // one per rule.
        let mut calls: Vec<Answers> = Vec::new();
        let mut through: Vec<(usize, JointPart<'_, L>)> = Vec::new();
        for (i, p) in parts.iter().enumerate() {
            let (limiter, key, cost) = (p.limiter, p.key, p.cost);
            let flagged: crate::BoxFuture<Flagged> = match limiter.leased(key, cost) {
                None => {
                    through.push((
                        i,
                        JointPart {
                            limiter: &limiter.inner,
                            key,
                            cost,
                            enforced: p.enforced,
                        },
                    ));
                    continue;
                }
                Some(Ok(d)) => {
                    let failed = limiter.local.as_ref().is_some_and(|l| l.unowned(key));
                    Box::pin(std::future::ready((Ok(d), failed)))
                }
                Some(Err(through)) => Box::pin(through),
            };
            calls.push(Box::pin(async move {
                let (decision, failed) = flagged.await;
                vec![(i, JointDecision::flagged(decision, cost, failed))]
            }));
        }
        let inner: Vec<JointPart<'_, L>> = through.iter().map(|(_, p)| *p).collect();
        let at: Vec<usize> = through.iter().map(|(i, _)| *i).collect();
        match (inner.is_empty(), L::decide_joint(&inner)) {
            (true, _) => {}
            (false, Some(together)) => calls.push(Box::pin(async move {
                at.into_iter().zip(together.await).collect()
            })),
            (false, None) => {
                for (i, p) in through {
                    let (inner, key, cost) = (p.limiter.clone(), p.key.to_vec(), p.cost);
                    calls.push(Box::pin(async move {
                        let (decision, failed) = lease(&inner, &key, cost).await;
                        vec![(i, JointDecision::flagged(decision, cost, failed))]
                    }));
                }
            }
        }
        let n = parts.len();
        Some(Box::pin(async move {
            let mut answers: Vec<(usize, JointDecision)> = tollgate_core::join_all(calls)
                .await
                .into_iter()
                .flatten()
                .collect();
            answers.sort_by_key(|(i, _)| *i);
            debug_assert_eq!(answers.len(), n);
            answers.into_iter().map(|(_, a)| a).collect()
        }))
    }

    /// Never from a lease: an exact answer is the store's.
    fn decide_exact_sync(&self, _key: &[u8], _cost: u64) -> Option<Result<Decision, StoreError>> {
        None
    }

    fn decide_sync(&self, key: &[u8], cost: u64) -> Option<Result<Decision, StoreError>> {
        let local = self.local.as_ref()?;
        if cost == 0 {
            return None;
        }
        // Not for a key the failure policy answers: the decision must say
        // so (a policy strikes no ladder on it), which only
        // `decide_joint`'s answers can.
        let d = self.decide_local(local, key, cost, self.inner.rule().capacity(), true)?;
        Some(Ok(d))
    }

    fn refund(&self, key: &[u8], cost: u64) -> Self::RefundFuture {
        if let Some(local) = &self.local {
            // Back into the lease while it lasts: it goes back to the
            // store with the lease's other units.
            if local.refund_local(key, cost) {
                return Box::pin(std::future::ready(Ok(())));
            }
            // The key's store answered through its failure policy: the
            // charge was never the store's to give back.
            if local.unowned(key) {
                return Box::pin(std::future::ready(Ok(())));
            }
        }
        Box::pin(self.inner.refund(key, cost))
    }
}
