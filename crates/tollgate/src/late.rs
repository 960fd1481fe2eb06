//! For the unit tests: a store, the memory store whose concurrency
//! acquires and retry-budget withdrawals answer late, as a distant Redis
//! does (under `tokio::time::pause()`, exactly `delay` late); and a
//! service that is ready only when a test says so.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tollgate_core::{
    Acquire, Clock, ConcurrencyLimiter, ConcurrencyRule, ConfigError, Lease, RetryBudgetLimiter,
    RetryBudgetRule, RetryBudgetStore, Rule, Store, StoreError, Withdrawal,
};

use crate::MemoryStore;

/// `MemoryStore`, its acquires and withdrawals `delay` late (decided when
/// the delay is over: dropped before, they take nothing).
pub(crate) struct Late<C>(pub(crate) MemoryStore<C>, pub(crate) Duration);

impl<C> Clone for Late<C> {
    fn clone(&self) -> Self {
        Self(self.0.clone(), self.1)
    }
}

/// A limiter of [`Late`].
#[derive(Clone)]
pub(crate) struct LateLimiter<L>(L, Duration);

type Boxed<T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send>>;

impl<C: Clock> Store for Late<C> {
    type Limiter = <MemoryStore<C> as Store>::Limiter;
    type ConcurrencyLimiter = LateLimiter<<MemoryStore<C> as Store>::ConcurrencyLimiter>;

    fn limiter(&self, rule: &Rule) -> Result<Self::Limiter, ConfigError> {
        self.0.limiter(rule)
    }

    fn concurrency_limiter(
        &self,
        rule: &ConcurrencyRule,
    ) -> Result<Self::ConcurrencyLimiter, ConfigError> {
        Ok(LateLimiter(self.0.concurrency_limiter(rule)?, self.1))
    }
}

impl<C: Clock> RetryBudgetStore for Late<C> {
    type RetryBudgetLimiter = LateLimiter<<MemoryStore<C> as RetryBudgetStore>::RetryBudgetLimiter>;

    fn retry_budget(
        &self,
        rule: &RetryBudgetRule,
    ) -> Result<Self::RetryBudgetLimiter, ConfigError> {
        Ok(LateLimiter(self.0.retry_budget(rule)?, self.1))
    }
}

impl<L: ConcurrencyLimiter> ConcurrencyLimiter for LateLimiter<L> {
    type AcquireFuture = Boxed<Acquire>;
    type ReleaseFuture = L::ReleaseFuture;
    type HeldFuture = L::HeldFuture;

    fn rule(&self) -> &ConcurrencyRule {
        self.0.rule()
    }

    fn acquire(&self, key: &[u8], permits: u32, ceiling: u32) -> Self::AcquireFuture {
        let (inner, delay, key) = (self.0.clone(), self.1, key.to_vec());
        Box::pin(async move {
            tokio::time::sleep(delay).await;
            inner.acquire(&key, permits, ceiling).await
        })
    }

    fn release(&self, key: &[u8], lease: Lease) -> Self::ReleaseFuture {
        self.0.release(key, lease)
    }

    fn held(&self, key: &[u8]) -> Self::HeldFuture {
        self.0.held(key)
    }
}

impl<L: RetryBudgetLimiter> RetryBudgetLimiter for LateLimiter<L> {
    type DepositFuture = L::DepositFuture;
    type WithdrawFuture = Boxed<Withdrawal>;

    fn rule(&self) -> &RetryBudgetRule {
        self.0.rule()
    }

    fn deposit(&self, key: &[u8]) -> Self::DepositFuture {
        self.0.deposit(key)
    }

    fn withdraw(&self, key: &[u8]) -> Self::WithdrawFuture {
        let (inner, delay, key) = (self.0.clone(), self.1, key.to_vec());
        Box::pin(async move {
            tokio::time::sleep(delay).await;
            inner.withdraw(&key).await
        })
    }
}

/// A service that is ready only while `open` is set (it never wakes a
/// caller it kept waiting).
#[derive(Clone)]
pub(crate) struct Gated<S> {
    pub(crate) open: std::sync::Arc<std::sync::atomic::AtomicBool>,
    pub(crate) inner: S,
}

impl<S: tower_service::Service<R>, R> tower_service::Service<R> for Gated<S> {
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), S::Error>> {
        if self.open.load(std::sync::atomic::Ordering::Relaxed) {
            self.inner.poll_ready(cx)
        } else {
            std::task::Poll::Pending
        }
    }

    fn call(&mut self, req: R) -> S::Future {
        self.inner.call(req)
    }
}
