//! The store contract: where per-key state lives.
//!
//! A [`Store`] binds a rule once, when a limiter is built (validating
//! anything store-specific), and returns a handle — a [`Limiter`] or a
//! [`ConcurrencyLimiter`] — whose calls take a client key and return a
//! future. The futures are associated types rather than boxed trait
//! objects so that the in-memory store can return
//! [`std::future::Ready`]: no allocation and no boxing on its hot path,
//! while a networked store returns whatever future it needs.
//!
//! The traits are therefore generic, not object-safe; layers are generic
//! over the store.
//!
//! Keys are raw bytes of any length; a store hashes or bounds them as it
//! must. Time is the store's: the in-memory store reads its [`Clock`](crate::Clock),
//! the Redis store reads Redis's.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::algorithm::{Standing, Strike};
use crate::{
    Acquire, ConcurrencyRule, ConfigError, Decision, EscalationRule, Lease, QuotaDecision,
    QuotaRule, RetryBudgetRule, Rule, Withdrawal,
};

/// A boxed future, for the object-safe parts of the contract.
pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// A store failed to answer (network, timeout, script error). The limiter's
/// failure policy decides what the request gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreError {
    kind: StoreErrorKind,
    message: String,
}

/// What kind of store failure this was.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StoreErrorKind {
    /// The store did not answer in time.
    Timeout,
    /// The store could not be reached, or the breaker is open.
    Unavailable,
    /// The store answered with something unexpected.
    Protocol,
}

impl StoreError {
    /// A new error.
    pub fn new(kind: StoreErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// Its kind.
    pub fn kind(&self) -> StoreErrorKind {
        self.kind
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "store {:?}: {}", self.kind, self.message)
    }
}

impl std::error::Error for StoreError {}

/// Where limiter state lives: in process ([`MemoryStore`]) or shared across
/// a fleet (Redis).
///
/// [`MemoryStore`]: https://docs.rs/tollgate-memory
pub trait Store: Clone + Send + Sync + 'static {
    /// The handle for one rate rule.
    type Limiter: Limiter;
    /// The handle for one concurrency rule.
    type ConcurrencyLimiter: ConcurrencyLimiter;

    /// Binds `rule`. Called once per limiter, at build time.
    fn limiter(&self, rule: &Rule) -> Result<Self::Limiter, ConfigError>;

    /// Binds a concurrency `rule`. Called once per limiter, at build time.
    fn concurrency_limiter(
        &self,
        rule: &ConcurrencyRule,
    ) -> Result<Self::ConcurrencyLimiter, ConfigError>;

    /// A handle on this store for rebuilding a policy on reload: binding a
    /// rule through it that is bound already under its name with other
    /// parameters replaces the binding instead of failing. Where the
    /// state's meaning allows (see [`Algorithm::keeps_state_of`](crate::Algorithm::keeps_state_of)),
    /// the new binding goes on from the keys' states; otherwise it starts
    /// fresh. Limiters bound earlier keep working on what they were bound
    /// to, so requests decided before a reload finish on their own rules.
    ///
    /// The default is the store itself: a store that keeps state by rule
    /// name and algorithm outside the process (Redis) already lets new
    /// parameters go on from the stored state.
    fn rebinding(&self) -> Self {
        self.clone()
    }

    /// A handle that binds as [`rebinding`](Self::rebinding) does — the
    /// same conflicts with what is bound, the same errors — but changes
    /// nothing in the store: what it binds is kept apart and dropped with
    /// it. A reload builds its policy through one first, so that an error
    /// only this store raises (a name bound by another layer to another
    /// kind of rule) stops the reload before any rule is rebound, never
    /// half-way through.
    ///
    /// The default is [`rebinding`](Self::rebinding): right for a store
    /// whose binding changes nothing (Redis, whose state is by name). A
    /// store that wraps another forwards both.
    fn checking(&self) -> Self {
        self.rebinding()
    }

    /// A store for state that must not crowd out the rest (idempotency
    /// markers, which a client creates at will): bounded at `max_keys` of
    /// its own where the store bounds its keys (the in-memory store: a
    /// table apart, on the same clock), so that it can never push other
    /// keys into a full store's shared overflow. The default is the store
    /// itself (a store whose keys expire by themselves, as Redis's do).
    fn apart(&self, max_keys: usize) -> Self {
        let _ = max_keys;
        self.clone()
    }

    /// The longest one call to the store may take before it counts as
    /// failed (a networked store's timeout), if it has one; `None` (the
    /// default) for a store that answers in process. Layers in front of a
    /// store use it to check their own settings (a `HotKeys` lease must
    /// outlive a call).
    fn call_timeout(&self) -> Option<std::time::Duration> {
        None
    }

    /// Binds an escalation ladder. The default: this store keeps none (an
    /// error naming `escalation`).
    fn escalation(&self, rule: &EscalationRule) -> Result<Arc<dyn EscalationLimiter>, ConfigError> {
        Err(ConfigError::new(
            "escalation",
            format!(
                "ladder {:?}: this store keeps no escalation ladders",
                rule.name()
            ),
        ))
    }
}

/// One escalation ladder bound to a store (see
/// [`Escalation`](crate::algorithm::Escalation)): where a key stands
/// (blocked, slowed or clear), and strikes. Object-safe (a policy holds
/// ladders of one store beside its rules); the in-memory store answers
/// synchronously.
pub trait EscalationLimiter: Send + Sync + 'static {
    /// The ladder.
    fn rule(&self) -> &EscalationRule;

    /// Where `key` stands now: blocked (for how long), slowed (on which
    /// step) or clear. Changes nothing.
    fn standing(&self, key: &[u8]) -> BoxFuture<Result<Standing, StoreError>>;

    /// A violation by `key`: counts a strike, blocking (or slowing) at
    /// the last.
    fn strike(&self, key: &[u8]) -> BoxFuture<Result<Strike, StoreError>>;

    /// [`standing`](Self::standing) at once, for stores that need no I/O.
    fn standing_sync(&self, key: &[u8]) -> Option<Result<Standing, StoreError>> {
        let _ = key;
        None
    }

    /// [`strike`](Self::strike) at once, for stores that need no I/O.
    fn strike_sync(&self, key: &[u8]) -> Option<Result<Strike, StoreError>> {
        let _ = key;
        None
    }
}

/// One rate rule bound to a store: decide-and-consume, refund, peek.
pub trait Limiter: Clone + Send + Sync + 'static {
    /// Future of [`decide`](Self::decide).
    type DecideFuture: Future<Output = Result<Decision, StoreError>> + Send + 'static;
    /// Future of [`refund`](Self::refund).
    type RefundFuture: Future<Output = Result<(), StoreError>> + Send + 'static;

    /// The rule this limiter enforces.
    fn rule(&self) -> &Rule;

    /// Decides a request of `cost` for `key` and consumes the cost if it
    /// is admitted. Cost 0 peeks: it reports the budget and consumes
    /// nothing.
    fn decide(&self, key: &[u8], cost: u64) -> Self::DecideFuture;

    /// Gives back `cost` consumed earlier for `key` (a later rule in a
    /// chain denied the request).
    fn refund(&self, key: &[u8], cost: u64) -> Self::RefundFuture;

    /// [`decide`](Self::decide), answered from the store's own state
    /// only: where the store cannot answer and a failure policy would
    /// answer in its place (admit everything, refuse everything, decide in
    /// local memory), this resolves to `Err` instead. For checks whose
    /// answer must be true, not merely safe: whether an idempotency marker
    /// is held (a stand-in "held" would make any request free) or a
    /// challenge's solution was used before (a stand-in "fresh" would make
    /// it reusable). The default is `decide`, which is exact for a store
    /// with no failure policy (it answers or fails).
    fn decide_exact(&self, key: &[u8], cost: u64) -> Self::DecideFuture {
        self.decide(key, cost)
    }

    /// [`decide_exact`](Self::decide_exact) at once, for stores that need
    /// no I/O; `None` means "call `decide_exact`" and must not consume
    /// anything. The default is [`decide_sync`](Self::decide_sync), exact
    /// for a store whose every answer is its own.
    fn decide_exact_sync(&self, key: &[u8], cost: u64) -> Option<Result<Decision, StoreError>> {
        self.decide_sync(key, cost)
    }

    /// The decision at once, for stores that need no I/O (the in-memory
    /// store): `Some` is exactly what [`decide`](Self::decide) would have
    /// resolved to. Layers use it to skip their asynchronous path (and the
    /// clone of the inner service it needs). The default, `None`, means
    /// "call `decide`"; it must not consume anything.
    fn decide_sync(&self, key: &[u8], cost: u64) -> Option<Result<Decision, StoreError>> {
        let _ = (key, cost);
        None
    }

    /// Decides one request under several rules of this store together,
    /// in fewer round trips than one per rule where the store can, and
    /// atomically where it can: the rules it decides in one step either
    /// all consume their cost (no enforced rule among them denies) or
    /// none does, so no other request ever sees a charge that is refunded
    /// a moment later. Each answer says whether its cost was consumed;
    /// whoever refunds on a denial refunds only those.
    ///
    /// `Some` resolves to one answer per part, in order. `None` (the
    /// default) means the store has no such step: decide each rule with
    /// [`decide`](Self::decide).
    fn decide_joint(parts: &[JointPart<'_, Self>]) -> Option<BoxFuture<Vec<JointDecision>>> {
        let _ = parts;
        None
    }
}

/// One rule's part in a joint decision ([`Limiter::decide_joint`]).
#[derive(Debug)]
pub struct JointPart<'a, L> {
    /// The rule, bound to the store.
    pub limiter: &'a L,
    /// The request's key under this rule.
    pub key: &'a [u8],
    /// The request's cost under this rule (0 peeks).
    pub cost: u64,
    /// Whether this rule's denial denies the request; `false` for a rule
    /// that only watches (shadow), whose decision is recorded but never
    /// holds the others back.
    pub enforced: bool,
}

impl<L> Clone for JointPart<'_, L> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<L> Copy for JointPart<'_, L> {}

/// One rule's answer in a joint decision ([`Limiter::decide_joint`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JointDecision {
    /// What the rule decided. A rule decided together with an enforced
    /// rule that denied shows what it would have left had the request
    /// been admitted, as a decision that is then refunded does.
    pub decision: Result<Decision, StoreError>,
    /// Whether the rule's cost was consumed: `false` when it denied, when
    /// a rule decided in the same step denied (nothing was written), or
    /// when a failure policy answered without counting anything.
    pub consumed: bool,
    /// Whether the store's failure policy answered, not the store: the
    /// decision says nothing about the client (a layer counts no strike
    /// toward a block on such a denial).
    pub failed: bool,
}

impl JointDecision {
    /// A rule's answer decided on its own (not in one step with others):
    /// what it admitted at a cost above 0 is consumed.
    pub fn alone(decision: Result<Decision, StoreError>, cost: u64) -> Self {
        Self::flagged(decision, cost, false)
    }

    /// [`alone`](Self::alone), saying whether the store's failure policy
    /// gave it (`failed`): what the policy admitted is not consumed — the
    /// store never counted it, so a refund would credit the store with a
    /// charge it never made (or go to the wrong store).
    pub fn flagged(decision: Result<Decision, StoreError>, cost: u64, failed: bool) -> Self {
        Self {
            consumed: cost > 0 && !failed && decision.as_ref().is_ok_and(Decision::is_allowed),
            decision,
            failed,
        }
    }
}

/// Decides `parts` together: in one step where their store has one
/// ([`Limiter::decide_joint`]), else one call per part, side by side
/// ([`JointDecision::alone`]). The answers are in the parts' order.
///
/// Not every joint step is all or nothing (leases decide each part on its
/// own), and one call per part never is: an answer may be consumed while
/// an enforced part denied. A caller that must not charge a denied
/// request gives those back — [`give_back_if_denied`] does.
pub async fn decide_parts<L: Limiter>(parts: &[JointPart<'_, L>]) -> Vec<JointDecision> {
    if let Some(together) = L::decide_joint(parts) {
        return together.await;
    }
    let each = parts
        .iter()
        .map(|p| Box::pin(p.limiter.decide(p.key, p.cost)))
        .collect();
    join_all(each)
        .await
        .into_iter()
        .zip(parts)
        .map(|(decision, p)| JointDecision::alone(decision, p.cost))
        .collect()
}

/// Whether an enforced part of `parts` was denied in `answers` (a store
/// error is not a denial: its failure policy answers it).
fn denied<L>(parts: &[JointPart<'_, L>], answers: &[JointDecision]) -> bool {
    parts
        .iter()
        .zip(answers)
        .any(|(p, a)| p.enforced && a.decision.as_ref().is_ok_and(|d| !d.is_allowed()))
}

/// All or nothing after [`decide_parts`]: when an enforced part was
/// denied, every part consumed is refunded (side by side) and marked not
/// consumed, so a refused request is charged nothing. A refund the store
/// fails is not retried: its units come back with the rule's time.
pub async fn give_back_if_denied<L: Limiter>(
    parts: &[JointPart<'_, L>],
    answers: &mut [JointDecision],
) {
    if !denied(parts, answers) {
        return;
    }
    let refunds = parts
        .iter()
        .zip(answers.iter_mut())
        .filter_map(|(p, a)| std::mem::take(&mut a.consumed).then_some(p))
        .map(|p| Box::pin(p.limiter.refund(p.key, p.cost)))
        .collect();
    join_all(refunds).await;
}

/// Awaits `futures` side by side, in the caller's task; their outputs in
/// order. What layers and stores use to make a request's store calls
/// together without a dependency for it.
pub async fn join_all<F: Future + Unpin>(futures: Vec<F>) -> Vec<F::Output> {
    let mut slots: Vec<(F, Option<F::Output>)> = futures.into_iter().map(|f| (f, None)).collect();
    std::future::poll_fn(|cx| {
        let mut waiting = false;
        for (future, out) in &mut slots {
            if out.is_none() {
                match Pin::new(future).poll(cx) {
                    std::task::Poll::Ready(v) => *out = Some(v),
                    std::task::Poll::Pending => waiting = true,
                }
            }
        }
        if waiting {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    slots.into_iter().filter_map(|(_, out)| out).collect()
}

/// One concurrency rule bound to a store: acquire and release leases.
///
/// A lease is released exactly once, by whoever holds it (the layers move
/// it into a guard that releases on drop). A release is under way as soon
/// as [`release`](Self::release) returns, so a synchronous `Drop` can
/// release by calling it and dropping the future: an in-process store
/// releases at once; a networked store hands the release to a background
/// task, and a lease it could not release lapses after the rule's lease
/// TTL. Awaiting the future waits until the release is done. A networked store also
/// renews the leases it granted and that are not released yet, in batches
/// from one background task, so long work keeps its permits while a dead
/// holder's lapse.
pub trait ConcurrencyLimiter: Clone + Send + Sync + 'static {
    /// Future of [`acquire`](Self::acquire).
    type AcquireFuture: Future<Output = Result<Acquire, StoreError>> + Send + 'static;
    /// Future of [`release`](Self::release): resolves when the release is
    /// done. Dropping it does not cancel the release.
    type ReleaseFuture: Future<Output = Result<(), StoreError>> + Send + 'static;
    /// Future of [`held`](Self::held).
    type HeldFuture: Future<Output = Result<u64, StoreError>> + Send + 'static;

    /// The rule this limiter enforces.
    fn rule(&self) -> &ConcurrencyRule;

    /// Takes `permits` for `key` under a new lease if, with them, the key
    /// holds at most `ceiling` permits: the rule's `max` (pass `u32::MAX`),
    /// or less for traffic held to a share of it. Permits above the
    /// ceiling can never be granted ([`Outcome::Never`](crate::Outcome::Never));
    /// 0 peeks. A denial's `retry_after` is the rule's retry hint.
    ///
    /// The layers drop an acquire's future unresolved (a client that went
    /// away, a queue's deadline): a lease granted for a dropped future
    /// must go back, not hold its permits (the Redis store runs the call
    /// as a task of its own, which releases what it got when nobody reads
    /// it).
    fn acquire(&self, key: &[u8], permits: u32, ceiling: u32) -> Self::AcquireFuture;

    /// The acquire at once, for stores that need no I/O; `None` (the
    /// default) means "call [`acquire`](Self::acquire)" and must not take
    /// anything.
    fn acquire_sync(
        &self,
        key: &[u8],
        permits: u32,
        ceiling: u32,
    ) -> Option<Result<Acquire, StoreError>> {
        let _ = (key, permits, ceiling);
        None
    }

    /// Gives `lease` back for `key`; see the trait docs. Releasing a lease
    /// twice is a bug in the caller; stores do not promise to notice. A
    /// granted lease holds exactly the permits asked for (callers that
    /// hold several limits' leases for one request rely on it).
    fn release(&self, key: &[u8], lease: Lease) -> Self::ReleaseFuture;

    /// Whether [`release`](Self::release) finds a lease's permits by the
    /// lease alone, without reading `key` (`false`, the default, unless a
    /// store says so). A caller may then pass an empty key, and need not
    /// keep a copy of it for as long as the lease is held.
    fn releases_by_lease(&self) -> bool {
        false
    }

    /// The permits `key` holds now.
    fn held(&self, key: &[u8]) -> Self::HeldFuture;

    /// `key`'s permits as a handle that acquires and releases at once,
    /// without looking the key up, for a caller whose every request has
    /// that key (a service-wide limit, bound once). From then on the
    /// store counts the key there for every caller. `None` (the default):
    /// the store keeps no such handle; use [`acquire`](Self::acquire) and
    /// [`release`](Self::release).
    fn pin(&self, key: &[u8]) -> Option<crate::PinnedPermits> {
        let _ = key;
        None
    }
}

/// A store that keeps calendar quotas. A separate trait from [`Store`] so
/// that a store can add quotas without every other store following at
/// once; the in-memory store keeps them per process (a restart forgets
/// them), the Redis store keeps them across restarts.
pub trait QuotaStore: Store {
    /// The handle for one quota rule.
    type QuotaLimiter: QuotaLimiter;

    /// Binds a quota `rule`. Called once per limiter, at build time.
    fn quota_limiter(&self, rule: &QuotaRule) -> Result<Self::QuotaLimiter, ConfigError>;
}

/// One quota rule bound to a store: consume, and the administration that
/// support staff need (read a key's usage, reset it, grant extra units).
/// Time is the store's wall clock (Unix time; Redis's `TIME`).
pub trait QuotaLimiter: Clone + Send + Sync + 'static {
    /// Future of every call.
    type Future: Future<Output = Result<QuotaDecision, StoreError>> + Send + 'static;

    /// The rule this limiter enforces.
    fn rule(&self) -> &QuotaRule;

    /// Charges `cost` to every period of `key`'s quota if it fits them all.
    /// Cost 0 reads the usage.
    fn consume(&self, key: &[u8], cost: u64) -> Self::Future;

    /// [`consume`](Self::consume) at once, for stores that need no I/O;
    /// `None` (the default) means "call `consume`".
    fn consume_sync(&self, key: &[u8], cost: u64) -> Option<Result<QuotaDecision, StoreError>> {
        let _ = (key, cost);
        None
    }

    /// Gives `cost` back to the periods that are still current.
    fn refund(&self, key: &[u8], cost: u64) -> Self::Future;

    /// Forgets everything `key` used (and was granted); returns the usage
    /// after: whole budgets.
    fn reset(&self, key: &[u8]) -> Self::Future;

    /// Adds `units` to every current period's budget for `key`.
    fn grant(&self, key: &[u8], units: u64) -> Self::Future;

    /// What `key` has used, as the store holds it: for dashboards and
    /// support tools, which must show the truth or an error — never what
    /// a failure policy answers in the store's place (a fail-open store
    /// would report whole budgets). The default is `consume(key, 0)`,
    /// exact for a store with no failure policy.
    fn usage(&self, key: &[u8]) -> Self::Future {
        self.consume(key, 0)
    }
}

/// A store that keeps retry budgets (see [`RetryBudget`](crate::RetryBudget)):
/// in memory a budget is per process; in Redis a fleet shares one.
pub trait RetryBudgetStore: Store {
    /// The handle for one retry budget.
    type RetryBudgetLimiter: RetryBudgetLimiter;

    /// Binds a retry budget `rule`. Called once per layer, at build time.
    fn retry_budget(&self, rule: &RetryBudgetRule)
        -> Result<Self::RetryBudgetLimiter, ConfigError>;
}

/// One retry budget bound to a store, per key (an upstream host, a route).
pub trait RetryBudgetLimiter: Clone + Send + Sync + 'static {
    /// Future of [`deposit`](Self::deposit).
    type DepositFuture: Future<Output = Result<(), StoreError>> + Send + 'static;
    /// Future of [`withdraw`](Self::withdraw): whether a retry may go,
    /// and the balance left.
    type WithdrawFuture: Future<Output = Result<Withdrawal, StoreError>> + Send + 'static;

    /// The rule this limiter enforces.
    fn rule(&self) -> &RetryBudgetRule;

    /// A call was made for `key`: deposit. Under way when this returns (a
    /// caller may drop the future).
    fn deposit(&self, key: &[u8]) -> Self::DepositFuture;

    /// A retry is wanted for `key`: withdraw one if the budget allows.
    fn withdraw(&self, key: &[u8]) -> Self::WithdrawFuture;

    /// [`deposit`](Self::deposit) at once, for stores that need no I/O:
    /// `true` when it is done; `false` (the default) means "call
    /// `deposit`" (and nothing was deposited).
    fn deposit_sync(&self, key: &[u8]) -> bool {
        let _ = key;
        false
    }

    /// [`withdraw`](Self::withdraw) at once, for stores that need no I/O;
    /// `None` (the default) means "call `withdraw`".
    fn withdraw_sync(&self, key: &[u8]) -> Option<Result<Withdrawal, StoreError>> {
        let _ = key;
        None
    }
}
