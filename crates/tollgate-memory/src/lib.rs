//! The in-process store of [tollgate]: every limiter's per-key state in
//! this process's memory. The default store, and the fallback when Redis
//! is down.
//!
//! - **Fast.** Keys live in a sharded hash table. GCRA, token bucket, fixed
//!   window and leaky bucket states are one `AtomicU64`, updated with one
//!   compare-and-swap under the shard's read lock (governor's design); the
//!   sliding windows sit behind a per-key mutex. A retry budget's keys
//!   (upstreams: few, each used over and over) are updated under their
//!   shard's write lock alone, two atomic operations where a read lock and
//!   a mutex would take four. A concurrency limit is a
//!   count of held permits per key, also one word: acquire and release are
//!   one compare-and-swap each, however many requests are in flight. A decision neither
//!   allocates nor boxes: the store's futures are [`std::future::Ready`].
//! - **Keys of any length, never kept.** A client key is stored as a
//!   SipHash-1-3 under a per-store random secret: 8 bytes however long the
//!   key (plus 8 for a one-word state), no raw key (personal data) in
//!   memory, and without the secret nobody can aim two keys at one slot.
//!   Two keys share a slot only by accident (about n² / 2⁶³ for n live keys,
//!   a slot being 62 bits of the hash: one in 9 million for a million
//!   keys), and then they share one budget: stricter, never looser.
//! - **Self-cleaning.** A key whose state decides exactly as a fresh key's
//!   (its budget is whole again) carries no information and is dropped.
//!   Shards are swept when they grow, and one shard in turn is looked at
//!   every few thousand decisions per thread, so memory comes back after a
//!   flood of one-off keys with no background thread and nothing for the
//!   user to call ([`MemoryStore::purge_idle`] exists for tests, and
//!   [`MemoryStoreBuilder::sweep_idle_every`] sweeps on a timer, so a
//!   process that goes quiet after a flood gives its memory back).
//! - **Bounded.** [`MemoryStoreBuilder::max_keys`] caps the keys held across
//!   all rules of the store (default 1,000,000). A store at the bound
//!   drops the idle keys of the new key's shard and then of every rule,
//!   each at most every 100 ms (a sweep is a pass over every key, so a
//!   flood of new keys must not buy one per key: between sweeps a new key
//!   of a rate rule costs about two normal decisions, no write lock; a
//!   retry budget's takes the write lock for its lookup only, and quota and
//!   concurrency rules take it for the new key's reservation). If nothing
//!   is idle,
//!   a new key is decided against an
//!   **overflow state shared by all new keys of its shard**. Memory stays
//!   bounded and the flood is limited as a group: never more than one
//!   key's limit per shard, so no key gets more than its own limit. Keys
//!   already held keep their own state. [`MemoryStore::overflowed`] counts
//!   those decisions. As keys go idle and are swept, new keys get their own
//!   slots again. A key the shard recently decided in its overflow state
//!   (one of its last 256 there) starts from that state while it still holds
//!   spending, so moving never hands it a second budget; other newcomers
//!   start with a whole one. A quota never shares: a contract's count is
//!   the key's own, so a new quota key the full store cannot hold gets an
//!   error ([`MemoryQuotaLimiter::consume_now`]) and the layer's
//!   `on_store_error` answers; size `max_keys` for the distinct keys of a
//!   quota's longest period, which its keys live through.
//!
//! ```
//! use tollgate_core::{Limit, Limiter, Rate, Rule, Store};
//! use tollgate_memory::MemoryStore;
//!
//! let store = MemoryStore::new();
//! let rule = Rule::new("per-key", Limit::gcra(Rate::per_second(10), 20))?;
//! let limiter = store.limiter(&rule)?;
//!
//! // The futures are ready at once; `decide_now` skips them.
//! let first = limiter.decide_now(b"api-key-1", 15);
//! assert!(first.is_allowed());
//! assert_eq!(first.remaining, 5);
//! assert!(!limiter.decide_now(b"api-key-1", 15).is_allowed());
//! assert!(limiter.decide_now(b"api-key-2", 15).is_allowed());
//! # Ok::<(), tollgate_core::ConfigError>(())
//! ```
//!
//! [tollgate]: https://docs.rs/tollgate

#![forbid(unsafe_code)]
// The crate README, so that its example is compiled and run as a test.
#![cfg_attr(doctest, doc = include_str!("../README.md"))]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![cfg_attr(
    test,
    allow(
        clippy::unwrap_used,
        clippy::panic,
        clippy::indexing_slicing,
        clippy::arithmetic_side_effects
    )
)]

mod cell;
mod key;
mod table;

use std::collections::HashMap;
use std::fmt;
use std::future::{ready, Ready};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};

use tollgate_core::algorithm::{Escalation, Standing, Strike};
use tollgate_core::{
    Acquire, Algorithm, Clock, ConcurrencyLimiter, ConcurrencyRule, ConfigError, Decision,
    FixedWindow, Gcra, InFlight, LeakyBucket, Lease, Limiter, Quota, QuotaDecision, QuotaLimiter,
    QuotaRule, QuotaState, QuotaStore, RateAlgorithm, RetryBudget, RetryBudgetLimiter,
    RetryBudgetRule, RetryBudgetStore, Rule, Semaphore, SlidingWindowBuckets, SlidingWindowCounter,
    SlidingWindowLog, Store, StoreError, SystemClock, TokenBucket, Withdrawal,
};
use tollgate_core::{BoxFuture, EscalationLimiter, EscalationRule, PinnedPermits};

use crate::key::KeyHash;
use crate::table::{Shared, Slot, Table};

/// The default [`MemoryStoreBuilder::max_keys`].
pub const DEFAULT_MAX_KEYS: usize = 1_000_000;

/// The default [`MemoryStoreBuilder::shards`].
pub const DEFAULT_SHARDS: usize = 64;

/// The in-process store. Cheap to clone; clones share all state.
///
/// See the [crate docs](crate) for how keys are held, cleaned up and
/// bounded.
pub struct MemoryStore<C = SystemClock> {
    inner: Arc<Inner<C>>,
    /// Binding a rule of a bound name with other parameters replaces the
    /// binding (see [`Store::rebinding`]).
    rebinding: bool,
    /// A checking handle's own bindings ([`Store::checking`]): read over
    /// the store's, never written to them.
    staged: Option<Arc<Bindings<C>>>,
}

/// Rules bound by name.
type Bindings<C> = Mutex<HashMap<String, Bound<C>>>;

struct Inner<C> {
    shared: Arc<Shared<C>>,
    shards: usize,
    rules: Bindings<C>,
}

enum Bound<C> {
    Rate(Algorithm, AnyTable<C>),
    Concurrency(Semaphore, Arc<Table<InFlight, C>>),
    Quota(Quota, Arc<Table<Quota, C>>),
    RetryBudget(RetryBudget, Arc<Table<RetryBudget, C>>),
    Escalation(Escalation, Arc<Table<Escalation, C>>),
}

impl<C> Clone for MemoryStore<C> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
            rebinding: self.rebinding,
            staged: self.staged.clone(),
        }
    }
}

impl<C> fmt::Debug for MemoryStore<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("keys", &self.inner.shared.keys.load(Ordering::Relaxed))
            .field("max_keys", &self.inner.shared.max_keys)
            .field("shards", &self.inner.shards)
            .finish_non_exhaustive()
    }
}

impl MemoryStore<SystemClock> {
    /// A store on the system clock with the default bounds.
    pub fn new() -> Self {
        Self::with_clock(SystemClock)
    }

    /// A builder, to set the clock, the key bound or the shard count.
    pub fn builder() -> MemoryStoreBuilder<SystemClock> {
        MemoryStoreBuilder {
            clock: SystemClock,
            max_keys: DEFAULT_MAX_KEYS,
            shards: DEFAULT_SHARDS,
            sweep_every: None,
        }
    }
}

impl Default for MemoryStore<SystemClock> {
    fn default() -> Self {
        Self::new()
    }
}

impl<C: Clock> MemoryStore<C> {
    /// A store reading `clock`, with the default bounds.
    pub fn with_clock(clock: C) -> Self {
        Self::from_parts(Arc::new(clock), DEFAULT_MAX_KEYS, DEFAULT_SHARDS)
    }

    fn from_parts(clock: Arc<C>, max_keys: usize, shards: usize) -> Self {
        Self {
            inner: Arc::new(Inner {
                shared: Arc::new(Shared::new(clock, max_keys)),
                shards,
                rules: Mutex::new(HashMap::new()),
            }),
            rebinding: false,
            staged: None,
        }
    }

    /// Keys currently held, across all rules.
    pub fn key_count(&self) -> usize {
        self.inner.shared.keys.load(Ordering::Acquire)
    }

    /// Decisions made against a shard's shared overflow state because the
    /// store was full (for a quota, which never shares: calls answered
    /// with an error because the store could not hold the key).
    pub fn overflowed(&self) -> u64 {
        self.inner.shared.overflowed.load(Ordering::Relaxed)
    }

    /// Drops every idle key now and returns how many. Never needed for
    /// correctness or to bound memory; useful in tests and in a process
    /// that goes quiet after a flood.
    pub fn purge_idle(&self) -> usize {
        let now = self.inner.shared.clock.now();
        let rules = self
            .inner
            .rules
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        rules
            .values()
            .map(|bound| match bound {
                Bound::Rate(_, table) => dispatch!(table, t => t.purge(now)),
                Bound::Concurrency(_, t) => t.purge(now),
                Bound::Quota(_, t) => t.purge(t.now()),
                Bound::RetryBudget(_, t) => t.purge(now),
                Bound::Escalation(_, t) => t.purge(now),
            })
            .sum()
    }
}

/// Builds a [`MemoryStore`].
#[derive(Debug, Clone)]
pub struct MemoryStoreBuilder<C> {
    clock: C,
    max_keys: usize,
    shards: usize,
    sweep_every: Option<std::time::Duration>,
}

impl<C: Clock> MemoryStoreBuilder<C> {
    /// The clock to read (default: [`SystemClock`]). Tests pass a
    /// [`ManualClock`](tollgate_core::ManualClock).
    pub fn clock<C2: Clock>(self, clock: C2) -> MemoryStoreBuilder<C2> {
        MemoryStoreBuilder {
            clock,
            max_keys: self.max_keys,
            shards: self.shards,
            sweep_every: self.sweep_every,
        }
    }

    /// Most keys held at once across all rules (default
    /// `DEFAULT_MAX_KEYS`, 1,000,000). See the crate docs for what happens when the
    /// store is full.
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys;
        self
    }

    /// Shards per rule: a power of two from 1 to 4096 (default
    /// `DEFAULT_SHARDS`, 64). More shards, less lock contention between keys.
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = shards;
        self
    }

    /// Drops idle keys on a thread of the store's own every `every` (at
    /// least 1 s; default: no thread), so that memory comes back when
    /// a process goes quiet after a flood: without it idle keys are
    /// dropped as decisions go on (every few thousand per thread) and when
    /// the store is full, and a process that gets no request keeps what
    /// it held. Tables shrink once a sweep leaves them mostly empty. The
    /// thread skips shards in use and ends when the store and its limiters
    /// are dropped. A key is idle when its state is whole again: a rate's
    /// within its burst's time, a quota's when its longest period ends.
    pub fn sweep_idle_every(mut self, every: std::time::Duration) -> Self {
        self.sweep_every = Some(every);
        self
    }

    /// Validates and builds.
    pub fn build(self) -> Result<MemoryStore<C>, ConfigError> {
        // Each sweep passes over every key (under each shard's lock in
        // turn): not more often than once a second.
        if self
            .sweep_every
            .is_some_and(|e| e < std::time::Duration::from_secs(1))
        {
            return Err(ConfigError::new("sweep_idle_every", "must be at least 1 s"));
        }
        if self.max_keys == 0 {
            return Err(ConfigError::new("max_keys", "must be at least 1"));
        }
        if !self.shards.is_power_of_two() || self.shards > 4096 {
            return Err(ConfigError::new(
                "shards",
                "must be a power of two from 1 to 4096",
            ));
        }
        let store = MemoryStore::from_parts(Arc::new(self.clock), self.max_keys, self.shards);
        if let Some(every) = self.sweep_every {
            let shared = Arc::downgrade(&store.inner.shared);
            std::thread::Builder::new()
                .name("tollgate-sweep".into())
                .spawn(move || loop {
                    std::thread::sleep(every);
                    let Some(shared) = shared.upgrade() else {
                        return;
                    };
                    shared.sweep_idle();
                })
                .map_err(|e| {
                    ConfigError::new("sweep_idle_every", format!("no sweeping thread: {e}"))
                })?;
        }
        Ok(store)
    }
}

/// A table of any rate algorithm.
enum AnyTable<C> {
    Gcra(Arc<Table<Gcra, C>>),
    TokenBucket(Arc<Table<TokenBucket, C>>),
    FixedWindow(Arc<Table<FixedWindow, C>>),
    SlidingWindowCounter(Arc<Table<SlidingWindowCounter, C>>),
    SlidingWindowBuckets(Arc<Table<SlidingWindowBuckets, C>>),
    SlidingWindowLog(Arc<Table<SlidingWindowLog, C>>),
    LeakyBucket(Arc<Table<LeakyBucket, C>>),
}

/// Runs `$body` with `$t` bound to the table, whatever its algorithm.
macro_rules! dispatch {
    ($table:expr, $t:ident => $body:expr) => {
        match $table {
            AnyTable::Gcra($t) => $body,
            AnyTable::TokenBucket($t) => $body,
            AnyTable::FixedWindow($t) => $body,
            AnyTable::SlidingWindowCounter($t) => $body,
            AnyTable::SlidingWindowBuckets($t) => $body,
            AnyTable::SlidingWindowLog($t) => $body,
            AnyTable::LeakyBucket($t) => $body,
        }
    };
}
use dispatch;

impl<C> Clone for AnyTable<C> {
    fn clone(&self) -> Self {
        match self {
            Self::Gcra(t) => Self::Gcra(Arc::clone(t)),
            Self::TokenBucket(t) => Self::TokenBucket(Arc::clone(t)),
            Self::FixedWindow(t) => Self::FixedWindow(Arc::clone(t)),
            Self::SlidingWindowCounter(t) => Self::SlidingWindowCounter(Arc::clone(t)),
            Self::SlidingWindowBuckets(t) => Self::SlidingWindowBuckets(Arc::clone(t)),
            Self::SlidingWindowLog(t) => Self::SlidingWindowLog(Arc::clone(t)),
            Self::LeakyBucket(t) => Self::LeakyBucket(Arc::clone(t)),
        }
    }
}

impl<C: Clock> AnyTable<C> {
    /// A table of `algorithm` over this one's states, where they stay
    /// meaningful under it ([`Algorithm::keeps_state_of`]).
    fn sharing(&self, old: &Algorithm, algorithm: &Algorithm) -> Option<Self> {
        if !algorithm.keeps_state_of(old) {
            return None;
        }
        Some(match (self, algorithm) {
            (Self::Gcra(t), Algorithm::Gcra(a)) => Self::Gcra(t.sharing(*a)),
            (Self::TokenBucket(t), Algorithm::TokenBucket(a)) => Self::TokenBucket(t.sharing(*a)),
            (Self::FixedWindow(t), Algorithm::FixedWindow(a)) => Self::FixedWindow(t.sharing(*a)),
            (Self::SlidingWindowCounter(t), Algorithm::SlidingWindowCounter(a)) => {
                Self::SlidingWindowCounter(t.sharing(*a))
            }
            (Self::SlidingWindowBuckets(t), Algorithm::SlidingWindowBuckets(a)) => {
                Self::SlidingWindowBuckets(t.sharing(*a))
            }
            (Self::SlidingWindowLog(t), Algorithm::SlidingWindowLog(a)) => {
                Self::SlidingWindowLog(t.sharing(*a))
            }
            (Self::LeakyBucket(t), Algorithm::LeakyBucket(a)) => Self::LeakyBucket(t.sharing(*a)),
            _ => return None,
        })
    }

    fn new(algorithm: &Algorithm, shards: usize, shared: Arc<Shared<C>>) -> Self {
        match algorithm {
            Algorithm::Gcra(a) => Self::Gcra(Table::registered(*a, shards, shared)),
            Algorithm::TokenBucket(a) => Self::TokenBucket(Table::registered(*a, shards, shared)),
            Algorithm::FixedWindow(a) => Self::FixedWindow(Table::registered(*a, shards, shared)),
            Algorithm::SlidingWindowCounter(a) => {
                Self::SlidingWindowCounter(Table::registered(*a, shards, shared))
            }
            Algorithm::SlidingWindowBuckets(a) => {
                Self::SlidingWindowBuckets(Table::registered(*a, shards, shared))
            }
            Algorithm::SlidingWindowLog(a) => {
                Self::SlidingWindowLog(Table::registered(*a, shards, shared))
            }
            Algorithm::LeakyBucket(a) => Self::LeakyBucket(Table::registered(*a, shards, shared)),
        }
    }
}

fn conflict() -> ConfigError {
    ConfigError::new(
        "name",
        "a rule of this name is already bound to this store with other parameters",
    )
}

impl<C: Clock> Store for MemoryStore<C> {
    type Limiter = MemoryLimiter<C>;
    type ConcurrencyLimiter = MemoryConcurrencyLimiter<C>;

    /// A handle that replaces a binding of other parameters (see
    /// [`Store::rebinding`]): a rate rule goes on from its keys' states
    /// where [`Algorithm::keeps_state_of`] allows, a concurrency rule keeps
    /// its held permits, a ladder its strikes and blocks, a quota its usage
    /// where only its budgets or its offset change ([`Quota::keeps_state_of`](tollgate_core::Quota::keeps_state_of));
    /// retry budgets of new parameters start fresh.
    fn rebinding(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
            rebinding: true,
            staged: None,
        }
    }

    /// A rebinding handle whose bindings stay its own (see
    /// [`Store::checking`]): a name bound to another kind of rule, here or
    /// by another layer, fails as it would through
    /// [`rebinding`](Store::rebinding), and nothing bound in the store
    /// changes.
    fn checking(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
            rebinding: true,
            staged: Some(Arc::default()),
        }
    }

    /// A new store on the same clock, with `max_keys` of its own (at least
    /// 1) and as many shards: its keys never take this store's places.
    fn apart(&self, max_keys: usize) -> Self {
        Self::from_parts(
            Arc::clone(&self.inner.shared.clock),
            max_keys.max(1),
            self.inner.shards,
        )
    }

    /// Binds `rule`. Binding a rule of the same name and parameters again
    /// shares its state; the same name with other parameters is an error
    /// (except through [`rebinding`](Store::rebinding)).
    fn limiter(&self, rule: &Rule) -> Result<MemoryLimiter<C>, ConfigError> {
        self.bind(
            rule.name(),
            |shards, shared| {
                Bound::Rate(
                    rule.algorithm().clone(),
                    AnyTable::new(rule.algorithm(), shards, shared),
                )
            },
            |old| match old {
                Bound::Rate(algorithm, table) => table
                    .sharing(algorithm, rule.algorithm())
                    .map(|t| Bound::Rate(rule.algorithm().clone(), t)),
                _ => None,
            },
            |bound| match bound {
                Bound::Rate(algorithm, table) if algorithm == rule.algorithm() => {
                    Some(MemoryLimiter {
                        rule: rule.clone(),
                        table: table.clone(),
                    })
                }
                _ => None,
            },
        )
    }

    /// Binds a concurrency `rule`; the same sharing rules as
    /// [`limiter`](Self::limiter).
    fn concurrency_limiter(
        &self,
        rule: &ConcurrencyRule,
    ) -> Result<MemoryConcurrencyLimiter<C>, ConfigError> {
        let sem = rule.semaphore();
        self.bind(
            rule.name(),
            |shards, shared| {
                Bound::Concurrency(*sem, Table::registered(sem.in_flight(), shards, shared))
            },
            // Permits held stay held under the new maximum.
            |old| match old {
                Bound::Concurrency(_, table) => {
                    Some(Bound::Concurrency(*sem, table.sharing(sem.in_flight())))
                }
                _ => None,
            },
            |bound| match bound {
                Bound::Concurrency(semaphore, table) if semaphore == sem => {
                    Some(MemoryConcurrencyLimiter {
                        rule: rule.clone(),
                        table: Arc::clone(table),
                        // A checking handle changes nothing of the store's.
                        pins: self.staged.is_none(),
                    })
                }
                _ => None,
            },
        )
    }

    /// Binds an escalation ladder; the same sharing rules as
    /// [`limiter`](Self::limiter). The ladder is this process's.
    fn escalation(&self, rule: &EscalationRule) -> Result<Arc<dyn EscalationLimiter>, ConfigError> {
        let ladder = *rule.escalation();
        let limiter = self.bind(
            rule.name(),
            |shards, shared| Bound::Escalation(ladder, Table::registered(ladder, shards, shared)),
            // Strikes and blocks carry over to the new ladder.
            |old| match old {
                Bound::Escalation(_, table) => {
                    Some(Bound::Escalation(ladder, table.sharing(ladder)))
                }
                _ => None,
            },
            |bound| match bound {
                Bound::Escalation(l, table) if *l == ladder => Some(MemoryEscalation {
                    rule: rule.clone(),
                    table: Arc::clone(table),
                }),
                _ => None,
            },
        )?;
        Ok(Arc::new(limiter))
    }
}

/// An escalation ladder bound to a [`MemoryStore`].
pub struct MemoryEscalation<C = SystemClock> {
    rule: EscalationRule,
    table: Arc<Table<Escalation, C>>,
}

impl<C> fmt::Debug for MemoryEscalation<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryEscalation")
            .field("rule", &self.rule)
            .finish_non_exhaustive()
    }
}

impl<C: Clock> MemoryEscalation<C> {
    /// [`EscalationLimiter::standing`] without the future (a peek: a key
    /// not stored is clear, and nothing is stored).
    pub fn standing_now(&self, key: &[u8]) -> Standing {
        let t = &self.table;
        let now = t.now();
        t.update(key, now, false, |s| t.kind.standing(s, now))
    }

    /// [`EscalationLimiter::strike`] without the future. A store too full
    /// to hold the key counts nothing: a ladder never uses the shared
    /// overflow state (its block would fall on every new key of the shard,
    /// innocent or not).
    pub fn strike_now(&self, key: &[u8]) -> Strike {
        let t = &self.table;
        let now = t.now();
        match t.update_in(key, now, false, |s| t.kind.strike(s, now)) {
            (strike, Slot::Own) => strike,
            (_, Slot::Overflow) => Strike::Counted { strikes: 0 },
        }
    }
}

impl<C: Clock> EscalationLimiter for MemoryEscalation<C> {
    fn rule(&self) -> &EscalationRule {
        &self.rule
    }

    fn standing(&self, key: &[u8]) -> BoxFuture<Result<Standing, StoreError>> {
        Box::pin(ready(Ok(self.standing_now(key))))
    }

    fn strike(&self, key: &[u8]) -> BoxFuture<Result<Strike, StoreError>> {
        Box::pin(ready(Ok(self.strike_now(key))))
    }

    fn standing_sync(&self, key: &[u8]) -> Option<Result<Standing, StoreError>> {
        Some(Ok(self.standing_now(key)))
    }

    fn strike_sync(&self, key: &[u8]) -> Option<Result<Strike, StoreError>> {
        Some(Ok(self.strike_now(key)))
    }
}

impl<C: Clock> MemoryStore<C> {
    /// Binds a rule by name: the first binding creates its table (with
    /// `make`), later ones share it if `get` accepts what is bound —
    /// the same kind of rule with the same parameters — and fail naming
    /// `name` otherwise.
    fn bind<T>(
        &self,
        name: &str,
        make: impl FnOnce(usize, Arc<Shared<C>>) -> Bound<C>,
        carry: impl FnOnce(&Bound<C>) -> Option<Bound<C>>,
        get: impl Fn(&Bound<C>) -> Option<T>,
    ) -> Result<T, ConfigError> {
        use std::collections::hash_map::Entry;
        let mut rules = self
            .inner
            .rules
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // A checking handle reads its own bindings over the store's, and
        // writes only its own.
        let mut staged = self
            .staged
            .as_ref()
            .map(|s| s.lock().unwrap_or_else(PoisonError::into_inner));
        let old = staged
            .as_ref()
            .and_then(|s| s.get(name))
            .or_else(|| rules.get(name));
        let next = match old {
            None => make(self.inner.shards, Arc::clone(&self.inner.shared)),
            Some(old) => {
                if let Some(found) = get(old) {
                    return Ok(found);
                }
                if !self.rebinding {
                    return Err(conflict());
                }
                let next = carry(old)
                    .unwrap_or_else(|| make(self.inner.shards, Arc::clone(&self.inner.shared)));
                // A reload rebinds a rule's parameters, never a name bound
                // to another kind of rule (a quota named like a rate rule).
                if std::mem::discriminant(old) != std::mem::discriminant(&next) {
                    return Err(conflict());
                }
                next
            }
        };
        let table = match staged.as_mut() {
            Some(staged) => &mut **staged,
            None => &mut *rules,
        };
        let bound = match table.entry(name.to_owned()) {
            Entry::Occupied(mut slot) => {
                slot.insert(next);
                slot.into_mut()
            }
            Entry::Vacant(slot) => slot.insert(next),
        };
        get(bound).ok_or_else(conflict)
    }
}

/// A rate rule bound to a [`MemoryStore`].
pub struct MemoryLimiter<C = SystemClock> {
    rule: Rule,
    table: AnyTable<C>,
}

impl<C> Clone for MemoryLimiter<C> {
    fn clone(&self) -> Self {
        Self {
            rule: self.rule.clone(),
            table: self.table.clone(),
        }
    }
}

impl<C> fmt::Debug for MemoryLimiter<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryLimiter")
            .field("rule", &self.rule)
            .finish_non_exhaustive()
    }
}

impl<C: Clock> MemoryLimiter<C> {
    /// [`Limiter::decide`] without the future.
    #[inline]
    pub fn decide_now(&self, key: &[u8], cost: u64) -> Decision {
        dispatch!(&self.table, t => {
            let now = t.now();
            t.update(key, now, cost > 0, |s| t.kind.decide(s, now, cost))
        })
    }

    /// [`Limiter::refund`] without the future.
    pub fn refund_now(&self, key: &[u8], cost: u64) {
        dispatch!(&self.table, t => {
            let now = t.now();
            t.update(key, now, false, |s| t.kind.refund(s, now, cost))
        })
    }
}

impl<C: Clock> Limiter for MemoryLimiter<C> {
    type DecideFuture = Ready<Result<Decision, StoreError>>;
    type RefundFuture = Ready<Result<(), StoreError>>;

    fn rule(&self) -> &Rule {
        &self.rule
    }

    #[inline]
    fn decide(&self, key: &[u8], cost: u64) -> Self::DecideFuture {
        ready(Ok(self.decide_now(key, cost)))
    }

    #[inline]
    fn decide_sync(&self, key: &[u8], cost: u64) -> Option<Result<Decision, StoreError>> {
        Some(Ok(self.decide_now(key, cost)))
    }

    /// `Err` where the key is not the store's own (the store is full, and
    /// the shard's shared overflow state answered): an answer about the
    /// key must not come from a state every new key shares.
    fn decide_exact(&self, key: &[u8], cost: u64) -> Self::DecideFuture {
        ready(self.decide_exact_now(key, cost))
    }

    fn decide_exact_sync(&self, key: &[u8], cost: u64) -> Option<Result<Decision, StoreError>> {
        Some(self.decide_exact_now(key, cost))
    }

    fn refund(&self, key: &[u8], cost: u64) -> Self::RefundFuture {
        self.refund_now(key, cost);
        ready(Ok(()))
    }
}

impl<C: Clock> MemoryLimiter<C> {
    /// [`Limiter::decide_exact`] without the future.
    fn decide_exact_now(&self, key: &[u8], cost: u64) -> Result<Decision, StoreError> {
        dispatch!(&self.table, t => {
            let now = t.now();
            match t.update_in(key, now, cost > 0, |s| t.kind.decide(s, now, cost)) {
                (d, table::Slot::Own) => Ok(d),
                (_, table::Slot::Overflow) => Err(StoreError::new(
                    tollgate_core::StoreErrorKind::Unavailable,
                    "the store is full: its shared overflow state answered",
                )),
            }
        })
    }
}

/// A concurrency rule bound to a [`MemoryStore`]: a count of held permits
/// per key ([`InFlight`]), one atomic word, acquired and released with one
/// compare-and-swap each. Permits do not lapse: in one process a permit's
/// guard releases it when dropped. The rule's lease TTL is not used.
///
/// When the store is full, a new key's permits are counted in its shard's
/// shared overflow state (see the crate docs), and released there. A key
/// that gets its own slot while permits it took in the overflow state are
/// still held is counted in its slot from zero: until those earlier
/// requests end, it can hold up to twice its limit. This needs the store
/// to be full (a flood of more than `max_keys` live keys) and lasts as long
/// as the requests that took the overflow permits.
///
/// A lease's id says where its key is kept, so a release neither reads nor
/// hashes the key ([`releases_by_lease`](ConcurrencyLimiter::releases_by_lease));
/// its top bit is always clear, free for a store that wraps this one to
/// mark the leases it granted here.
pub struct MemoryConcurrencyLimiter<C = SystemClock> {
    rule: ConcurrencyRule,
    table: Arc<Table<InFlight, C>>,
    /// Whether [`pin`](ConcurrencyLimiter::pin) may pin (not for a
    /// checking handle's binding).
    pins: bool,
}

impl<C> Clone for MemoryConcurrencyLimiter<C> {
    fn clone(&self) -> Self {
        Self {
            rule: self.rule.clone(),
            table: Arc::clone(&self.table),
            pins: self.pins,
        }
    }
}

impl<C> fmt::Debug for MemoryConcurrencyLimiter<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryConcurrencyLimiter")
            .field("rule", &self.rule)
            .finish_non_exhaustive()
    }
}

impl<C: Clock> MemoryConcurrencyLimiter<C> {
    /// [`ConcurrencyLimiter::acquire`] without the future.
    #[inline]
    pub fn acquire_now(&self, key: &[u8], permits: u32, ceiling: u32) -> Acquire {
        let t = &self.table;
        let now = t.now();
        let hash = t.hash(key);
        let (decision, slot) = t.update_at(hash, now, false, |held| {
            t.kind.acquire(held, permits, ceiling)
        });
        let granted = decision.is_allowed() && permits > 0;
        Acquire {
            decision,
            lease: granted.then_some(Lease {
                // Where the key is kept, so its release need not hash it.
                id: hash.lease_id(matches!(slot, Slot::Overflow)),
                permits,
            }),
        }
    }

    /// [`ConcurrencyLimiter::release`] without the future. The lease says
    /// where its permits are counted, so `key` is not read (nor hashed):
    /// give back only leases this limiter granted.
    #[inline]
    pub fn release_now(&self, key: &[u8], lease: Lease) {
        let _ = key;
        let t = &self.table;
        let release = |held: &mut u64| t.kind.release(held, lease.permits);
        let (hash, overflow) = KeyHash::from_lease_id(lease.id);
        if overflow {
            t.update_overflow(hash, release);
        } else {
            t.update_at(hash, t.now(), false, release);
        }
    }

    /// [`ConcurrencyLimiter::held`] without the future: the permits `key`
    /// holds in its own slot. (Permits granted while the store was full
    /// are counted in the shard's shared overflow state, not here.)
    pub fn held_now(&self, key: &[u8]) -> u64 {
        let t = &self.table;
        t.update(key, t.now(), false, |held| *held)
    }
}

impl<C: Clock> ConcurrencyLimiter for MemoryConcurrencyLimiter<C> {
    type AcquireFuture = Ready<Result<Acquire, StoreError>>;
    type ReleaseFuture = Ready<Result<(), StoreError>>;
    type HeldFuture = Ready<Result<u64, StoreError>>;

    fn rule(&self) -> &ConcurrencyRule {
        &self.rule
    }

    fn acquire(&self, key: &[u8], permits: u32, ceiling: u32) -> Self::AcquireFuture {
        ready(Ok(self.acquire_now(key, permits, ceiling)))
    }

    #[inline]
    fn acquire_sync(
        &self,
        key: &[u8],
        permits: u32,
        ceiling: u32,
    ) -> Option<Result<Acquire, StoreError>> {
        Some(Ok(self.acquire_now(key, permits, ceiling)))
    }

    fn release(&self, key: &[u8], lease: Lease) -> Self::ReleaseFuture {
        self.release_now(key, lease);
        ready(Ok(()))
    }

    fn releases_by_lease(&self) -> bool {
        true
    }

    fn held(&self, key: &[u8]) -> Self::HeldFuture {
        ready(Ok(self.held_now(key)))
    }

    /// The key's count, moved out of the table into a word of its own
    /// (see [`PinnedPermits`]). Kept for as long as the binding's rule is
    /// (never swept), and outside `max_keys` and
    /// [`key_count`](MemoryStore::key_count): for a key every request of
    /// a limit shares. A rule's table pins at most 16 keys (then `None`:
    /// the key stays in the table), and a checking handle's binding
    /// ([`Store::checking`]) none.
    fn pin(&self, key: &[u8]) -> Option<PinnedPermits> {
        if !self.pins {
            return None;
        }
        let t = &self.table;
        let hash = t.hash(key);
        let cell = t.pin(hash)?;
        Some(PinnedPermits::new(cell, &self.rule, hash.lease_id(false)))
    }
}

impl<C: Clock> QuotaStore for MemoryStore<C> {
    type QuotaLimiter = MemoryQuotaLimiter<C>;

    /// Binds a quota `rule`; the same sharing rules as
    /// [`limiter`](Store::limiter). Quotas live in this process: a restart
    /// forgets them (use the Redis store to keep them).
    fn quota_limiter(&self, rule: &QuotaRule) -> Result<MemoryQuotaLimiter<C>, ConfigError> {
        let quota = rule.quota();
        self.bind(
            rule.name(),
            |shards, shared| {
                Bound::Quota(
                    quota.clone(),
                    Table::registered(quota.clone(), shards, shared),
                )
            },
            // A quota's windows belong to its periods: the same periods
            // with other budgets or another offset go on from each key's
            // usage (as the Redis store's do); other periods start fresh.
            |old| match old {
                Bound::Quota(q, table) if quota.keeps_state_of(q) => {
                    Some(Bound::Quota(quota.clone(), table.sharing(quota.clone())))
                }
                _ => None,
            },
            |bound| match bound {
                Bound::Quota(q, table) if q == quota => Some(MemoryQuotaLimiter {
                    rule: rule.clone(),
                    table: Arc::clone(table),
                }),
                _ => None,
            },
        )
    }
}

/// A quota rule bound to a [`MemoryStore`], on the store clock's wall time
/// ([`Clock::unix_now`]).
pub struct MemoryQuotaLimiter<C = SystemClock> {
    rule: QuotaRule,
    table: Arc<Table<Quota, C>>,
}

impl<C> Clone for MemoryQuotaLimiter<C> {
    fn clone(&self) -> Self {
        Self {
            rule: self.rule.clone(),
            table: Arc::clone(&self.table),
        }
    }
}

impl<C> fmt::Debug for MemoryQuotaLimiter<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryQuotaLimiter")
            .field("rule", &self.rule)
            .finish_non_exhaustive()
    }
}

impl<C: Clock> MemoryQuotaLimiter<C> {
    /// [`QuotaLimiter::consume`] without the future: `Err` when the store
    /// is full and cannot hold `key` (a quota is never decided in a state
    /// other keys share; see [`QuotaLimiter::consume`]).
    #[inline]
    pub fn consume_now(&self, key: &[u8], cost: u64) -> Result<QuotaDecision, StoreError> {
        let t = &self.table;
        let now = t.now();
        // Written in place: the decision is ~260 bytes, and returning it
        // through the lock's closure and the table copied it twice.
        let mut out = QuotaDecision::EMPTY;
        let (_, slot) = t.update_in(key, now, cost > 0, |s| {
            t.kind.decide_into(s, now, cost, &mut out)
        });
        own(slot).map(|()| out)
    }

    /// [`QuotaLimiter::refund`] without the future.
    pub fn refund_now(&self, key: &[u8], cost: u64) -> QuotaDecision {
        let t = &self.table;
        let now = t.now();
        t.update(key, now, false, |s| {
            t.kind.refund(s, now, cost);
            t.kind.decide(s, now, 0)
        })
    }

    /// [`QuotaLimiter::reset`] without the future.
    pub fn reset_now(&self, key: &[u8]) -> QuotaDecision {
        let t = &self.table;
        let now = t.now();
        t.update(key, now, false, |s| {
            *s = QuotaState::default();
            t.kind.decide(s, now, 0)
        })
    }

    /// [`QuotaLimiter::grant`] without the future: `Err` when the store is
    /// full and cannot hold `key` (the units would be lost).
    pub fn grant_now(&self, key: &[u8], units: u64) -> Result<QuotaDecision, StoreError> {
        let t = &self.table;
        let now = t.now();
        let (d, slot) = t.update_in(key, now, false, |s| t.kind.grant(s, now, units));
        own(slot).map(|()| d)
    }
}

/// `Err` where a quota's key could not be stored (the store is full).
fn own(slot: Slot) -> Result<(), StoreError> {
    match slot {
        Slot::Own => Ok(()),
        Slot::Overflow => Err(StoreError::new(
            tollgate_core::StoreErrorKind::Unavailable,
            "the store is full (max_keys): a quota is only decided on the key's own count, \
             so a key it cannot hold is not decided",
        )),
    }
}

impl<C: Clock> QuotaLimiter for MemoryQuotaLimiter<C> {
    type Future = Ready<Result<QuotaDecision, StoreError>>;

    fn rule(&self) -> &QuotaRule {
        &self.rule
    }

    fn consume(&self, key: &[u8], cost: u64) -> Self::Future {
        ready(self.consume_now(key, cost))
    }

    #[inline]
    fn consume_sync(&self, key: &[u8], cost: u64) -> Option<Result<QuotaDecision, StoreError>> {
        Some(self.consume_now(key, cost))
    }

    fn refund(&self, key: &[u8], cost: u64) -> Self::Future {
        ready(Ok(self.refund_now(key, cost)))
    }

    fn reset(&self, key: &[u8]) -> Self::Future {
        ready(Ok(self.reset_now(key)))
    }

    fn grant(&self, key: &[u8], units: u64) -> Self::Future {
        ready(self.grant_now(key, units))
    }
}

impl<C: Clock> RetryBudgetStore for MemoryStore<C> {
    type RetryBudgetLimiter = MemoryRetryBudget<C>;

    /// Binds a retry budget; the same sharing rules as
    /// [`limiter`](Store::limiter). The budget is this process's.
    fn retry_budget(&self, rule: &RetryBudgetRule) -> Result<MemoryRetryBudget<C>, ConfigError> {
        let budget = *rule.budget();
        self.bind(
            rule.name(),
            |shards, shared| Bound::RetryBudget(budget, Table::registered(budget, shards, shared)),
            |_| None,
            |bound| match bound {
                Bound::RetryBudget(b, table) if *b == budget => Some(MemoryRetryBudget {
                    rule: rule.clone(),
                    table: Arc::clone(table),
                }),
                _ => None,
            },
        )
    }
}

/// A retry budget bound to a [`MemoryStore`].
pub struct MemoryRetryBudget<C = SystemClock> {
    rule: RetryBudgetRule,
    table: Arc<Table<RetryBudget, C>>,
}

impl<C> Clone for MemoryRetryBudget<C> {
    fn clone(&self) -> Self {
        Self {
            rule: self.rule.clone(),
            table: Arc::clone(&self.table),
        }
    }
}

impl<C> fmt::Debug for MemoryRetryBudget<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRetryBudget")
            .field("rule", &self.rule)
            .finish_non_exhaustive()
    }
}

impl<C: Clock> MemoryRetryBudget<C> {
    /// [`RetryBudgetLimiter::deposit`] without the future.
    pub fn deposit_now(&self, key: &[u8]) {
        let t = &self.table;
        let now = t.now();
        t.update(key, now, true, |s| t.kind.deposit(s, now));
    }

    /// [`RetryBudgetLimiter::withdraw`] without the future.
    pub fn withdraw_now(&self, key: &[u8]) -> Withdrawal {
        let t = &self.table;
        let now = t.now();
        t.update(key, now, true, |s| {
            let granted = t.kind.withdraw(s, now);
            Withdrawal::new(granted, t.kind.balance(s, now))
        })
    }

    /// The balance of `key` in thousandths of a retry.
    pub fn balance_now(&self, key: &[u8]) -> u64 {
        let t = &self.table;
        let now = t.now();
        t.update(key, now, false, |s| t.kind.balance(s, now))
    }
}

impl<C: Clock> RetryBudgetLimiter for MemoryRetryBudget<C> {
    type DepositFuture = Ready<Result<(), StoreError>>;
    type WithdrawFuture = Ready<Result<Withdrawal, StoreError>>;

    fn rule(&self) -> &RetryBudgetRule {
        &self.rule
    }

    fn deposit(&self, key: &[u8]) -> Self::DepositFuture {
        self.deposit_now(key);
        ready(Ok(()))
    }

    fn withdraw(&self, key: &[u8]) -> Self::WithdrawFuture {
        ready(Ok(self.withdraw_now(key)))
    }

    fn deposit_sync(&self, key: &[u8]) -> bool {
        self.deposit_now(key);
        true
    }

    fn withdraw_sync(&self, key: &[u8]) -> Option<Result<Withdrawal, StoreError>> {
        Some(Ok(self.withdraw_now(key)))
    }
}
