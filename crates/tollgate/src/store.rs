//! [`AnyStore`]: the store chosen at run time (memory in development,
//! Redis in production) behind one type, so that the layers built on it
//! have one type too.

use std::fmt;
use std::future::{Future, Ready};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tollgate_core::{
    Acquire, BoxFuture, ConcurrencyLimiter, ConcurrencyRule, ConfigError, Decision,
    EscalationLimiter, EscalationRule, JointDecision, JointPart, Lease, Limiter, QuotaDecision,
    QuotaLimiter, QuotaRule, QuotaStore, RetryBudgetLimiter, RetryBudgetRule, RetryBudgetStore,
    Rule, Store, StoreError, Withdrawal,
};
use tollgate_memory::{
    MemoryConcurrencyLimiter, MemoryLimiter, MemoryQuotaLimiter, MemoryRetryBudget, MemoryStore,
};
#[cfg(feature = "redis")]
use tollgate_redis::{
    Hot, HotLimiter, RedisConcurrencyLimiter, RedisLimiter, RedisQuotaLimiter, RedisRetryBudget,
    RedisStore,
};

/// A store picked at run time: [`MemoryStore`] or (feature `redis`)
/// `RedisStore`, with or without `HotKeys` leases in front, as one type.
///
/// Every store trait is generic (its futures are associated types, so the
/// memory store's are not boxed), so a layer's type names its store. When
/// the store is a deployment choice — memory in development and tests,
/// Redis in production — build every layer on an `AnyStore` and the
/// layers, and the service stack around them, have one type whichever
/// store it holds: no generic function and no second copy of a tonic
/// `Server::builder()` chain. Memory decisions stay synchronous (no
/// allocation, no boxing); the one cost is a branch on the variant.
///
/// ```
/// use tollgate::{AnyStore, Limit, MemoryStore, Rate, RateLimitLayer};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// // e.g. `match std::env::var("REDIS_URL") { Ok(url) => RedisStore::builder(&url)...build()?.into(), .. }`
/// let store: AnyStore = MemoryStore::new().into();
/// let limit = RateLimitLayer::builder("api", Limit::gcra(Rate::per_second(10), 20))
///     .store(store.clone())
///     .build()?;
/// # let _ = limit;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct AnyStore(Inner);

#[derive(Clone)]
enum Inner {
    Memory(MemoryStore),
    #[cfg(feature = "redis")]
    Redis(RedisStore),
    /// Rate rules leased (those `HotKeys` leases); the rest as `Redis`.
    #[cfg(feature = "redis")]
    Hot(Hot<RedisStore>),
}

impl fmt::Debug for AnyStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Inner::Memory(s) => f.debug_tuple("AnyStore").field(s).finish(),
            #[cfg(feature = "redis")]
            Inner::Redis(s) => f.debug_tuple("AnyStore").field(s).finish(),
            #[cfg(feature = "redis")]
            Inner::Hot(s) => f.debug_tuple("AnyStore").field(s).finish(),
        }
    }
}

impl AnyStore {
    /// Which store this is: `"memory"` or `"redis"` (with or without
    /// `HotKeys` in front).
    pub fn kind(&self) -> &'static str {
        match &self.0 {
            Inner::Memory(_) => "memory",
            #[cfg(feature = "redis")]
            Inner::Redis(_) | Inner::Hot(_) => "redis",
        }
    }

    /// The Redis store, if this is one (leased or not).
    #[cfg(feature = "redis")]
    pub fn redis(&self) -> Option<&RedisStore> {
        match &self.0 {
            Inner::Memory(_) => None,
            Inner::Redis(s) => Some(s),
            Inner::Hot(hot) => Some(hot.store()),
        }
    }

    /// Whether `HotKeys` leases are in front of the store.
    pub fn is_leased(&self) -> bool {
        #[cfg(feature = "redis")]
        if let Inner::Hot(_) = &self.0 {
            return true;
        }
        false
    }

    /// Gives back to the store what its `HotKeys` leases still hold (see
    /// `Hot::give_back`), for an instance that stops once it serves no
    /// more requests; the units given back (0 without leases).
    pub async fn give_back(&self) -> u64 {
        #[cfg(feature = "redis")]
        if let Inner::Hot(hot) = &self.0 {
            return hot.give_back().await;
        }
        0
    }
}

impl From<MemoryStore> for AnyStore {
    fn from(store: MemoryStore) -> Self {
        Self(Inner::Memory(store))
    }
}

#[cfg(feature = "redis")]
impl From<RedisStore> for AnyStore {
    fn from(store: RedisStore) -> Self {
        Self(Inner::Redis(store))
    }
}

#[cfg(feature = "redis")]
impl From<Hot<RedisStore>> for AnyStore {
    fn from(store: Hot<RedisStore>) -> Self {
        Self(Inner::Hot(store))
    }
}

/// The future of an [`AnyStore`] handle: the memory store's answer, ready
/// at once, or the Redis store's future.
pub struct AnyFuture<T>(FutureInner<T>);

enum FutureInner<T> {
    Ready(Option<T>),
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    Boxed(BoxFuture<T>),
}

impl<T> fmt::Debug for AnyFuture<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.0 {
            FutureInner::Ready(_) => "AnyFuture::Ready",
            FutureInner::Boxed(_) => "AnyFuture::Boxed",
        })
    }
}

impl<T> From<Ready<T>> for AnyFuture<T> {
    fn from(ready: Ready<T>) -> Self {
        Self(FutureInner::Ready(Some(ready.into_inner())))
    }
}

#[cfg(feature = "redis")]
impl<T> From<BoxFuture<T>> for AnyFuture<T> {
    fn from(future: BoxFuture<T>) -> Self {
        Self(FutureInner::Boxed(future))
    }
}

/// A leased decision's future, boxed (a lease's own answers come without
/// one, through `decide_sync`).
#[cfg(feature = "redis")]
impl From<tollgate_redis::HotFuture> for AnyFuture<Result<Decision, StoreError>> {
    fn from(future: tollgate_redis::HotFuture) -> Self {
        Self(FutureInner::Boxed(Box::pin(future)))
    }
}

impl<T> Unpin for AnyFuture<T> {}

impl<T> Future for AnyFuture<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        match &mut self.0 {
            FutureInner::Ready(value) => match value.take() {
                Some(value) => Poll::Ready(value),
                // Polled after it completed: a caller's bug; stay pending
                // rather than panic.
                None => Poll::Pending,
            },
            FutureInner::Boxed(future) => future.as_mut().poll(cx),
        }
    }
}

/// Declares one `AnyStore` handle type over the memory and Redis handles,
/// with a `match` that forwards a call to whichever it holds.
macro_rules! handle {
    ($(#[$doc:meta])* $name:ident, $memory:ident, $redis:ident) => {
        $(#[$doc])*
        #[derive(Clone, Debug)]
        pub struct $name(HandleInner<$memory, HandleRedis!($redis)>);
    };
    ($(#[$doc:meta])* $name:ident, $memory:ident, $redis:ident, $hot:ty) => {
        $(#[$doc])*
        #[derive(Clone, Debug)]
        pub struct $name(HandleInner<$memory, HandleRedis!($redis), HandleRedis!($hot)>);
    };
}

/// The Redis handle type, or `()` without the `redis` feature.
#[cfg(feature = "redis")]
macro_rules! HandleRedis {
    ($redis:ty) => {
        $redis
    };
}
#[cfg(not(feature = "redis"))]
macro_rules! HandleRedis {
    ($redis:ty) => {
        std::convert::Infallible
    };
}

/// A handle of the memory store, of Redis, or (rate limiters only) of
/// Redis behind `HotKeys`; `H` is `Infallible` where there is none.
#[derive(Clone, Debug)]
enum HandleInner<M, R, H = std::convert::Infallible> {
    Memory(M),
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    Redis(R),
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    Hot(H),
}

/// Forwards `$call` to the handle `$self` holds, turning its future into
/// an [`AnyFuture`].
macro_rules! forward {
    ($self:expr, |$h:ident| $call:expr) => {
        match &$self.0 {
            HandleInner::Memory($h) => AnyFuture::from($call),
            #[cfg(feature = "redis")]
            HandleInner::Redis($h) => AnyFuture::from($call),
            #[cfg(not(feature = "redis"))]
            HandleInner::Redis(never) => match *never {},
            HandleInner::Hot(never) => match *never {},
        }
    };
    (plain $self:expr, |$h:ident| $call:expr) => {
        match &$self.0 {
            HandleInner::Memory($h) => $call,
            #[cfg(feature = "redis")]
            HandleInner::Redis($h) => $call,
            #[cfg(not(feature = "redis"))]
            HandleInner::Redis(never) => match *never {},
            HandleInner::Hot(never) => match *never {},
        }
    };
    // A rate limiter's: leased too.
    (hot $self:expr, |$h:ident| $call:expr) => {
        match &$self.0 {
            HandleInner::Memory($h) => AnyFuture::from($call),
            #[cfg(feature = "redis")]
            HandleInner::Redis($h) => AnyFuture::from($call),
            #[cfg(feature = "redis")]
            HandleInner::Hot($h) => AnyFuture::from($call),
            #[cfg(not(feature = "redis"))]
            HandleInner::Redis(never) => match *never {},
            #[cfg(not(feature = "redis"))]
            HandleInner::Hot(never) => match *never {},
        }
    };
    (hot plain $self:expr, |$h:ident| $call:expr) => {
        match &$self.0 {
            HandleInner::Memory($h) => $call,
            #[cfg(feature = "redis")]
            HandleInner::Redis($h) => $call,
            #[cfg(feature = "redis")]
            HandleInner::Hot($h) => $call,
            #[cfg(not(feature = "redis"))]
            HandleInner::Redis(never) => match *never {},
            #[cfg(not(feature = "redis"))]
            HandleInner::Hot(never) => match *never {},
        }
    };
}

handle!(
    /// An [`AnyStore`]'s rate limiter.
    AnyLimiter,
    MemoryLimiter,
    RedisLimiter,
    HotLimiter<RedisLimiter>
);
handle!(
    /// An [`AnyStore`]'s concurrency limiter.
    AnyConcurrencyLimiter,
    MemoryConcurrencyLimiter,
    RedisConcurrencyLimiter
);
handle!(
    /// An [`AnyStore`]'s quota limiter.
    AnyQuotaLimiter,
    MemoryQuotaLimiter,
    RedisQuotaLimiter
);
handle!(
    /// An [`AnyStore`]'s retry budget.
    AnyRetryBudget,
    MemoryRetryBudget,
    RedisRetryBudget
);

impl Store for AnyStore {
    type Limiter = AnyLimiter;
    type ConcurrencyLimiter = AnyConcurrencyLimiter;

    fn limiter(&self, rule: &Rule) -> Result<AnyLimiter, ConfigError> {
        Ok(AnyLimiter(match &self.0 {
            Inner::Memory(s) => HandleInner::Memory(s.limiter(rule)?),
            #[cfg(feature = "redis")]
            Inner::Redis(s) => HandleInner::Redis(s.limiter(rule)?),
            #[cfg(feature = "redis")]
            Inner::Hot(s) => HandleInner::Hot(s.limiter(rule)?),
        }))
    }

    fn concurrency_limiter(
        &self,
        rule: &ConcurrencyRule,
    ) -> Result<AnyConcurrencyLimiter, ConfigError> {
        Ok(AnyConcurrencyLimiter(match &self.0 {
            Inner::Memory(s) => HandleInner::Memory(s.concurrency_limiter(rule)?),
            #[cfg(feature = "redis")]
            Inner::Redis(s) => HandleInner::Redis(s.concurrency_limiter(rule)?),
            #[cfg(feature = "redis")]
            Inner::Hot(s) => HandleInner::Redis(s.concurrency_limiter(rule)?),
        }))
    }

    fn rebinding(&self) -> Self {
        Self(match &self.0 {
            Inner::Memory(s) => Inner::Memory(s.rebinding()),
            #[cfg(feature = "redis")]
            Inner::Redis(s) => Inner::Redis(s.rebinding()),
            #[cfg(feature = "redis")]
            Inner::Hot(s) => Inner::Hot(s.rebinding()),
        })
    }

    fn checking(&self) -> Self {
        Self(match &self.0 {
            Inner::Memory(s) => Inner::Memory(s.checking()),
            #[cfg(feature = "redis")]
            Inner::Redis(s) => Inner::Redis(s.checking()),
            #[cfg(feature = "redis")]
            Inner::Hot(s) => Inner::Hot(s.checking()),
        })
    }

    fn apart(&self, max_keys: usize) -> Self {
        Self(match &self.0 {
            Inner::Memory(s) => Inner::Memory(s.apart(max_keys)),
            #[cfg(feature = "redis")]
            Inner::Redis(s) => Inner::Redis(s.apart(max_keys)),
            #[cfg(feature = "redis")]
            Inner::Hot(s) => Inner::Hot(s.apart(max_keys)),
        })
    }

    fn call_timeout(&self) -> Option<std::time::Duration> {
        match &self.0 {
            Inner::Memory(s) => s.call_timeout(),
            #[cfg(feature = "redis")]
            Inner::Redis(s) => s.call_timeout(),
            #[cfg(feature = "redis")]
            Inner::Hot(s) => s.call_timeout(),
        }
    }

    fn escalation(&self, rule: &EscalationRule) -> Result<Arc<dyn EscalationLimiter>, ConfigError> {
        match &self.0 {
            Inner::Memory(s) => s.escalation(rule),
            #[cfg(feature = "redis")]
            Inner::Redis(s) => s.escalation(rule),
            #[cfg(feature = "redis")]
            Inner::Hot(s) => s.escalation(rule),
        }
    }
}

impl QuotaStore for AnyStore {
    type QuotaLimiter = AnyQuotaLimiter;

    fn quota_limiter(&self, rule: &QuotaRule) -> Result<AnyQuotaLimiter, ConfigError> {
        Ok(AnyQuotaLimiter(match &self.0 {
            Inner::Memory(s) => HandleInner::Memory(s.quota_limiter(rule)?),
            #[cfg(feature = "redis")]
            Inner::Redis(s) => HandleInner::Redis(s.quota_limiter(rule)?),
            #[cfg(feature = "redis")]
            Inner::Hot(s) => HandleInner::Redis(s.quota_limiter(rule)?),
        }))
    }
}

impl RetryBudgetStore for AnyStore {
    type RetryBudgetLimiter = AnyRetryBudget;

    fn retry_budget(&self, rule: &RetryBudgetRule) -> Result<AnyRetryBudget, ConfigError> {
        Ok(AnyRetryBudget(match &self.0 {
            Inner::Memory(s) => HandleInner::Memory(s.retry_budget(rule)?),
            #[cfg(feature = "redis")]
            Inner::Redis(s) => HandleInner::Redis(s.retry_budget(rule)?),
            #[cfg(feature = "redis")]
            Inner::Hot(s) => HandleInner::Redis(s.retry_budget(rule)?),
        }))
    }
}

impl Limiter for AnyLimiter {
    type DecideFuture = AnyFuture<Result<Decision, StoreError>>;
    type RefundFuture = AnyFuture<Result<(), StoreError>>;

    fn rule(&self) -> &Rule {
        forward!(hot plain self, |l| l.rule())
    }

    fn decide(&self, key: &[u8], cost: u64) -> Self::DecideFuture {
        forward!(hot self, |l| l.decide(key, cost))
    }

    fn refund(&self, key: &[u8], cost: u64) -> Self::RefundFuture {
        forward!(hot self, |l| l.refund(key, cost))
    }

    fn decide_exact(&self, key: &[u8], cost: u64) -> Self::DecideFuture {
        forward!(hot self, |l| l.decide_exact(key, cost))
    }

    fn decide_sync(&self, key: &[u8], cost: u64) -> Option<Result<Decision, StoreError>> {
        forward!(hot plain self, |l| l.decide_sync(key, cost))
    }

    fn decide_exact_sync(&self, key: &[u8], cost: u64) -> Option<Result<Decision, StoreError>> {
        forward!(hot plain self, |l| l.decide_exact_sync(key, cost))
    }

    /// Jointly where every part is of one store (as every limiter of one
    /// `AnyStore` is), through that store's own joint step.
    fn decide_joint(parts: &[JointPart<'_, Self>]) -> Option<BoxFuture<Vec<JointDecision>>> {
        fn each<'a, L>(
            parts: &[JointPart<'a, AnyLimiter>],
            pick: impl Fn(&'a AnyLimiter) -> Option<&'a L>,
        ) -> Option<Vec<JointPart<'a, L>>> {
            parts
                .iter()
                .map(|p| {
                    Some(JointPart {
                        limiter: pick(p.limiter)?,
                        key: p.key,
                        cost: p.cost,
                        enforced: p.enforced,
                    })
                })
                .collect()
        }
        if let Some(memory) = each(parts, |l| match &l.0 {
            HandleInner::Memory(m) => Some(m),
            _ => None,
        }) {
            return MemoryLimiter::decide_joint(&memory);
        }
        #[cfg(feature = "redis")]
        if let Some(redis) = each(parts, |l| match &l.0 {
            HandleInner::Redis(r) => Some(r),
            _ => None,
        }) {
            return RedisLimiter::decide_joint(&redis);
        }
        #[cfg(feature = "redis")]
        if let Some(hot) = each(parts, |l| match &l.0 {
            HandleInner::Hot(h) => Some(h),
            _ => None,
        }) {
            return HotLimiter::decide_joint(&hot);
        }
        None
    }
}

impl ConcurrencyLimiter for AnyConcurrencyLimiter {
    type AcquireFuture = AnyFuture<Result<Acquire, StoreError>>;
    type ReleaseFuture = AnyFuture<Result<(), StoreError>>;
    type HeldFuture = AnyFuture<Result<u64, StoreError>>;

    fn rule(&self) -> &ConcurrencyRule {
        forward!(plain self, |l| l.rule())
    }

    fn acquire(&self, key: &[u8], permits: u32, ceiling: u32) -> Self::AcquireFuture {
        forward!(self, |l| l.acquire(key, permits, ceiling))
    }

    fn acquire_sync(
        &self,
        key: &[u8],
        permits: u32,
        ceiling: u32,
    ) -> Option<Result<Acquire, StoreError>> {
        forward!(plain self, |l| l.acquire_sync(key, permits, ceiling))
    }

    fn release(&self, key: &[u8], lease: Lease) -> Self::ReleaseFuture {
        forward!(self, |l| l.release(key, lease))
    }

    fn releases_by_lease(&self) -> bool {
        forward!(plain self, |l| l.releases_by_lease())
    }

    fn pin(&self, key: &[u8]) -> Option<tollgate_core::PinnedPermits> {
        forward!(plain self, |l| l.pin(key))
    }

    fn held(&self, key: &[u8]) -> Self::HeldFuture {
        forward!(self, |l| l.held(key))
    }
}

impl QuotaLimiter for AnyQuotaLimiter {
    type Future = AnyFuture<Result<QuotaDecision, StoreError>>;

    fn rule(&self) -> &QuotaRule {
        forward!(plain self, |l| l.rule())
    }

    fn consume(&self, key: &[u8], cost: u64) -> Self::Future {
        forward!(self, |l| l.consume(key, cost))
    }

    fn consume_sync(&self, key: &[u8], cost: u64) -> Option<Result<QuotaDecision, StoreError>> {
        forward!(plain self, |l| l.consume_sync(key, cost))
    }

    fn refund(&self, key: &[u8], cost: u64) -> Self::Future {
        forward!(self, |l| l.refund(key, cost))
    }

    fn reset(&self, key: &[u8]) -> Self::Future {
        forward!(self, |l| l.reset(key))
    }

    fn usage(&self, key: &[u8]) -> Self::Future {
        forward!(self, |l| l.usage(key))
    }

    fn grant(&self, key: &[u8], units: u64) -> Self::Future {
        forward!(self, |l| l.grant(key, units))
    }
}

impl RetryBudgetLimiter for AnyRetryBudget {
    type DepositFuture = AnyFuture<Result<(), StoreError>>;
    type WithdrawFuture = AnyFuture<Result<Withdrawal, StoreError>>;

    fn rule(&self) -> &RetryBudgetRule {
        forward!(plain self, |l| l.rule())
    }

    fn deposit(&self, key: &[u8]) -> Self::DepositFuture {
        forward!(self, |l| l.deposit(key))
    }

    fn withdraw(&self, key: &[u8]) -> Self::WithdrawFuture {
        forward!(self, |l| l.withdraw(key))
    }

    fn deposit_sync(&self, key: &[u8]) -> bool {
        forward!(plain self, |l| l.deposit_sync(key))
    }

    fn withdraw_sync(&self, key: &[u8]) -> Option<Result<Withdrawal, StoreError>> {
        forward!(plain self, |l| l.withdraw_sync(key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_core::{Limit, Rate};

    #[test]
    fn a_memory_any_store_decides_at_once_and_jointly() {
        let store = AnyStore::from(MemoryStore::new());
        assert_eq!(store.kind(), "memory");
        let rule = Rule::new("any", Limit::gcra(Rate::per_second(1), 2)).unwrap();
        let limiter = store.limiter(&rule).unwrap();
        assert!(limiter.decide_sync(b"k", 1).unwrap().unwrap().is_allowed());
        assert!(limiter.decide_sync(b"k", 1).unwrap().unwrap().is_allowed());
        assert!(!limiter.decide_sync(b"k", 1).unwrap().unwrap().is_allowed());
        let part = JointPart {
            limiter: &limiter,
            key: b"other",
            cost: 1,
            enforced: true,
        };
        // The memory store has no joint step (the policy decides its rules
        // one by one, synchronously); neither has its AnyStore.
        assert!(AnyLimiter::decide_joint(&[part]).is_none());
        let refund = limiter.refund(b"k", 1);
        assert!(matches!(refund.0, FutureInner::Ready(Some(Ok(())))));
        assert!(limiter.decide_sync(b"k", 1).unwrap().unwrap().is_allowed());
    }
}
