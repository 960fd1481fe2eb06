//! Hot keys without a store round trip per request: local leases of
//! units and a denial cache, in front of any store (see [`HotKeys`]).

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::hash::{BuildHasher, RandomState};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::Notify;
use tollgate_core::{
    duration_to_nanos, Algorithm, Clock, ConcurrencyRule, ConfigError, Decision, EscalationLimiter,
    EscalationRule, JointDecision, JointPart, Limiter, Outcome, Rule, Store, StoreError,
    SystemClock,
};

/// Local leases for hot keys, in front of a shared store (Redis): an
/// instance takes a batch of a key's units from the store in one call
/// and spends them locally, with no I/O, until they run out or the lease
/// ends; and when the store says a key is over its limit until time T, the
/// instance answers that key itself until T (a denial cache).
///
/// **The batch adapts per key.** A key starts at a batch of 1 — each
/// decision is one store call, exact — and its batch doubles each time a
/// lease is spent before it ends (the key is hot), up to
/// [`max_batch`](Self::max_batch) and to [`max_share`](Self::max_share)
/// of the rule's capacity, and halves when a lease ends with units left.
/// Units a lease still holds when the key's next lease is taken before it
/// ends (a decision that costs more than it holds) go back to the store
/// with that lease (a refund); units left when a lease ends lapse, since a
/// refund after its end could credit capacity the store's budget has
/// already regained with time.
/// With [`refill_ahead`](Self::refill_ahead), what a lease still holds
/// when the lease taken ahead replaces it lapses. A holder that dies
/// mid-lease simply
/// spent its units: the budget recovers from them at its rate, so nothing
/// is lost or gained for good.
///
/// **The bound.** Units are counted in the store when they are leased, and
/// spent locally within the lease's TTL, so leases never let the fleet
/// take more units than the store counted. What moves is *when* they are
/// admitted: up to one TTL after they were counted. Over any window, a
/// rule admits at most what it would admit over that window lengthened by
/// the TTL:
///
/// - GCRA and the token bucket: at most `rate × ttl` units beyond the
///   rule's own bound, however many instances share it (e.g. 1,000/s with
///   a 50-ms TTL: 50 units, 0.5 % of a 10-s window's 10,000);
/// - fixed window: a lease ends with the store's window (its `reset_after`,
///   counted from when the lease was asked for), so leased units are spent
///   in the window that counted them;
/// - sliding window counter: as GCRA, `limit × ttl / window`;
/// - sliding window log and leaky bucket: not leased — the log's exactness
///   and the bucket's pacing are per request; building such a rule
///   through `HotKeys` is an error naming `hot_keys`.
///
/// The price is under-admission while leases are outstanding: units one
/// instance leased and has not spent are not available to the others
/// (bounded by `max_share` per instance), and a cached denial may outlast
/// a refund by another instance (bounded by
/// [`max_denial`](Self::max_denial)). Cap the error by the TTL (how late
/// units may be spent) and the share (how much one instance may hold).
///
/// Concurrent decisions for one key on one instance share one store call
/// (single flight): while a lease is being taken, the others wait for it.
/// A key at a limit that refuses for less than a round trip (its cached
/// denials are over before they land: thousands a second against a
/// distant Redis) gains nothing from leases of one unit taken in turn:
/// its decisions go to the store side by side (at most 16 at once per
/// instance, so a flood of one key does not reach the store one call per
/// request), until the store admits one again. (With 64 tasks on one
/// key limited to 10,000 a second, local Redis: 0.70× the plain store's
/// decisions a second, where waiting in turn gave 0.41×; see
/// `benches/README.md`.)
///
/// **When the store fails.** Leases already taken keep answering until
/// they end; then the store's failure policy answers, per request. A
/// denial the policy gives (fail-closed: "retry in a second") is cached
/// like one Redis gave, so after an outage a key may stay refused for up
/// to [`max_denial`](Self::max_denial) once Redis answers again; with
/// `FailurePolicy::Fallback`, the memory store's denials are cached the
/// same way. Tested on a Cluster whose hot key's master hangs: a cached
/// denial made no store call, the key admitted only what its lease held
/// (4 of 160 requests), and after the shard resumed it admitted no more
/// than its rebuilt burst, its rate and one TTL's worth.
///
/// ```
/// use std::time::Duration;
/// use tollgate_redis::{HotKeys, RedisStore};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), tollgate_core::ConfigError> {
/// let redis = RedisStore::builder("redis://127.0.0.1:6379").prefix("my-api").build()?;
/// // Only the per-key rule is leased; others decide per request.
/// let store = HotKeys::new()
///     .ttl(Duration::from_millis(50))
///     .max_batch(64)
///     .rules(["per-key"])
///     .over(redis)?;
/// # let _ = store;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct HotKeys {
    ttl: Duration,
    max_batch: u32,
    min_batch: u32,
    max_share: f64,
    max_denial: Duration,
    max_keys: usize,
    rules: Option<Vec<String>>,
    ahead: bool,
    name: Arc<str>,
}

impl Default for HotKeys {
    fn default() -> Self {
        Self::new()
    }
}

impl HotKeys {
    /// Leases of 50 ms, batches up to 64 units and 10 % of a rule's
    /// capacity, denials cached up to 1 s, up to 100,000 keys per rule,
    /// for every rule.
    pub fn new() -> Self {
        Self {
            ttl: Duration::from_millis(50),
            max_batch: 64,
            min_batch: 1,
            max_share: 0.1,
            max_denial: Duration::from_secs(1),
            max_keys: 100_000,
            rules: None,
            ahead: false,
            name: "hot".into(),
        }
    }

    /// How long a lease lasts: how late a leased unit may be spent (the
    /// bound above scales with it). From 1 ms to 10 s. Keep it well above
    /// the store's round trip and call timeout (a Redis store's default
    /// timeout is 50 ms, as is this TTL's default): a lease's TTL counts
    /// from when it was asked for, so a lease whose answer takes longer
    /// than the TTL has ended when it lands, and every decision costs a
    /// store call again.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// The most units one lease takes (at least 1; 1 turns leasing off and
    /// keeps only the denial cache and the single flight).
    pub fn max_batch(mut self, units: u32) -> Self {
        self.max_batch = units;
        self
    }

    /// The batch every key starts from, and never goes below (default 1:
    /// a cold key decides per request, exactly). Above 1 — for a distant
    /// store, e.g. a global tier 100 ms away (see
    /// [`Tiered`](crate::Tiered)) — even a key's first request takes a
    /// lease, so most decisions skip the round trip; the bound above is
    /// the same (`rate × ttl`), and a cold key holds up to this many units
    /// it may not spend. Capped by `max_batch` and `max_share`.
    pub fn min_batch(mut self, units: u32) -> Self {
        self.min_batch = units;
        self
    }

    /// The most of a rule's capacity one lease takes (above 0, at most 1).
    pub fn max_share(mut self, share: f64) -> Self {
        self.max_share = share;
        self
    }

    /// The longest a denial is answered locally (0: no denial cache).
    pub fn max_denial(mut self, max: Duration) -> Self {
        self.max_denial = max;
        self
    }

    /// Takes a key's next lease before the current one runs out (default
    /// off): once a hot key's lease is half spent, one background call
    /// takes the next, and decisions go on
    /// spending the current one meanwhile. For a distant store (another
    /// region, a global tier), so that a hot key's decisions do not wait
    /// a round trip each time a lease runs out: with a batch that lasts
    /// longer than two round trips and a TTL well above one, nearly every
    /// decision is local. The bound is unchanged (each lease's units are
    /// spent within its own TTL); an instance may hold two leases of a
    /// key at once, so up to twice [`max_share`](Self::max_share).
    pub fn refill_ahead(mut self, on: bool) -> Self {
        self.ahead = on;
        self
    }

    /// The most keys one rule keeps leases for (a key beyond decides per
    /// request, through the store). Keys longer than 64 bytes are never
    /// leased (they decide through the store), so the table of one rule
    /// holds at most `max_keys` × 64 bytes of keys; the tower layers'
    /// keys are at most 64 bytes.
    pub fn max_keys(mut self, keys: usize) -> Self {
        self.max_keys = keys;
        self
    }

    /// The `name` label of this front's metrics (`tollgate_hot_*`;
    /// default `hot`): give each `HotKeys` its own where two fronts lease
    /// rules of the same name (a regional and a global tier, two stores),
    /// so their counts do not add up as one.
    pub fn name(mut self, name: &str) -> Self {
        self.name = name.into();
        self
    }

    /// Leases only the rules named (default: every rule bound through it
    /// that can be leased — a sliding window log or a leaky bucket is
    /// decided per request, through the store). Naming one of those is an
    /// error when it is bound. A name that matches no rule is not an
    /// error (the rule may be bound later, or elsewhere): check a bound
    /// limiter with [`HotLimiter::is_leased`].
    pub fn rules<I, S>(mut self, names: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        self.rules = Some(names.into_iter().map(|n| n.as_ref().to_owned()).collect());
        self
    }

    /// Puts hot-key leases in front of `store`, on the system clock.
    /// Errors name `hot_keys`.
    pub fn over<S: Store>(self, store: S) -> Result<Hot<S>, ConfigError> {
        self.over_with_clock(store, SystemClock)
    }

    /// [`over`](Self::over), on `clock` (tests pass a manual clock — the
    /// same one the store reads, e.g. Redis's `client_time`).
    pub fn over_with_clock<S: Store, C: Clock>(
        self,
        store: S,
        clock: C,
    ) -> Result<Hot<S, C>, ConfigError> {
        let ttl = duration_to_nanos(self.ttl);
        if !(1_000_000..=10_000_000_000).contains(&ttl) {
            return Err(ConfigError::new(
                "hot_keys",
                "ttl must be from 1 ms to 10 s",
            ));
        }
        if self.max_batch == 0 {
            return Err(ConfigError::new("hot_keys", "max_batch must be at least 1"));
        }
        if self.min_batch == 0 || self.min_batch > self.max_batch {
            return Err(ConfigError::new(
                "hot_keys",
                "min_batch must be from 1 to max_batch",
            ));
        }
        if !(self.max_share > 0.0 && self.max_share <= 1.0) {
            return Err(ConfigError::new(
                "hot_keys",
                "max_share must be above 0 and at most 1",
            ));
        }
        if self.max_keys == 0 {
            return Err(ConfigError::new("hot_keys", "max_keys must be at least 1"));
        }
        if !crate::store::plain_name(&self.name) {
            return Err(ConfigError::new(
                "hot_keys",
                format!("name {}", crate::store::PLAIN_NAME),
            ));
        }
        // Fleet review L13: a lease asked for is over once its TTL has
        // passed since it was asked, so a store slower than the TTL makes
        // every lease end on arrival (and halves the batch toward 1).
        if let Some(timeout) = store.call_timeout().filter(|t| self.ttl < *t) {
            tracing::warn!(
                target: "tollgate",
                ttl_ms = self.ttl.as_millis(),
                timeout_ms = timeout.as_millis(),
                "hot_keys: the lease TTL is shorter than the store's call timeout: a lease whose \
                 answer takes longer than the TTL has ended when it lands; keep the TTL above \
                 the store's round trip"
            );
        }
        Ok(Hot {
            inner: store,
            config: Arc::new(self),
            clock: Arc::new(clock),
        })
    }
}

/// A store with hot-key leases in front (see [`HotKeys`]). Concurrency
/// rules and escalation ladders go to the store as they are.
pub struct Hot<S, C = SystemClock> {
    inner: S,
    config: Arc<HotKeys>,
    clock: Arc<C>,
}

impl<S: Clone, C> Clone for Hot<S, C> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            config: Arc::clone(&self.config),
            clock: Arc::clone(&self.clock),
        }
    }
}

impl<S: fmt::Debug, C> fmt::Debug for Hot<S, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Hot")
            .field("inner", &self.inner)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl<S: Store, C: Clock> Store for Hot<S, C> {
    type Limiter = HotLimiter<S::Limiter, C>;
    type ConcurrencyLimiter = S::ConcurrencyLimiter;

    fn call_timeout(&self) -> Option<Duration> {
        self.inner.call_timeout()
    }

    fn limiter(&self, rule: &Rule) -> Result<Self::Limiter, ConfigError> {
        let named = self
            .config
            .rules
            .as_ref()
            .map(|names| names.iter().any(|n| n == rule.name()));
        let unleasable = matches!(
            rule.algorithm(),
            Algorithm::SlidingWindowLog(_) | Algorithm::LeakyBucket(_)
        );
        // Every rule (no names given) leases those that can be; a rule not
        // named is not leased.
        if named == Some(false) || (named.is_none() && unleasable) {
            return Ok(HotLimiter {
                inner: self.inner.limiter(rule)?,
                local: None,
            });
        }
        let windowed = match rule.algorithm() {
            // Named, yet cannot be leased.
            Algorithm::SlidingWindowLog(_) | Algorithm::LeakyBucket(_) => {
                return Err(ConfigError::new(
                    "hot_keys",
                    format!(
                        "rule {:?}: a sliding window log is exact per request and a leaky bucket paces each request; neither can be leased (leave it out of HotKeys::rules)",
                        rule.name()
                    ),
                ))
            }
            Algorithm::FixedWindow(_) => true,
            _ => false,
        };
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss
        )]
        let share_cap = ((rule.capacity() as f64) * self.config.max_share).floor() as u64;
        let max_batch = u64::from(self.config.max_batch)
            .min(share_cap.max(1))
            .max(1);
        let shards: Box<[_]> = (0..SHARDS).map(|_| Mutex::new(Keys::default())).collect();
        Ok(HotLimiter {
            inner: self.inner.limiter(rule)?,
            local: Some(Arc::new(Local {
                clock: Arc::clone(&self.clock),
                ttl: duration_to_nanos(self.config.ttl),
                max_denial: duration_to_nanos(self.config.max_denial),
                max_batch,
                min_batch: u64::from(self.config.min_batch).min(max_batch),
                windowed,
                per_shard: self.config.max_keys.div_ceil(SHARDS).max(1),
                hasher: RandomState::new(),
                shards,
                decisions: Count::new(
                    "tollgate_hot_decisions_total",
                    &self.config.name,
                    rule.name(),
                ),
                store_calls: Count::new(
                    "tollgate_hot_store_calls_total",
                    &self.config.name,
                    rule.name(),
                ),
                waits: Count::new("tollgate_hot_waits_total", &self.config.name, rule.name()),
                ahead: self.config.ahead,
            })),
        })
    }

    fn concurrency_limiter(
        &self,
        rule: &ConcurrencyRule,
    ) -> Result<Self::ConcurrencyLimiter, ConfigError> {
        self.inner.concurrency_limiter(rule)
    }

    fn escalation(&self, rule: &EscalationRule) -> Result<Arc<dyn EscalationLimiter>, ConfigError> {
        self.inner.escalation(rule)
    }

    fn rebinding(&self) -> Self {
        Self {
            inner: self.inner.rebinding(),
            config: Arc::clone(&self.config),
            clock: Arc::clone(&self.clock),
        }
    }

    fn checking(&self) -> Self {
        Self {
            inner: self.inner.checking(),
            config: Arc::clone(&self.config),
            clock: Arc::clone(&self.clock),
        }
    }
}

/// How many leases a decision waits to land before it goes to the store
/// itself once the key's leases are as large as they get (see
/// `Local::plan`): at most three flights' wait, whatever the key's demand.
const MAX_LANDINGS: u32 = 3;
const SHARDS: usize = 16;

/// One key's lease and cached denial.
#[derive(Debug, Default)]
struct KeyState {
    /// Units leased and not spent.
    units: u64,
    /// When the lease ends (local clock).
    expires: u64,
    /// Until when the key is answered "denied" locally.
    denied_until: u64,
    /// The units the next lease asks for.
    batch: u64,
    /// What the store had left after the last lease, and when its budget
    /// was to be whole (local clock): the headers of local decisions.
    remaining: u64,
    whole_at: u64,
    /// Units of the current lease spent (what a local refund may give
    /// back), and the smallest cost the cached denial refuses.
    spent: u64,
    denied_cost: u64,
    /// A lease being taken (for a decision, or ahead): waiters are woken
    /// when it is in.
    flight: Option<Arc<Notify>>,
    /// A lease taken ahead (see `HotKeys::refill_ahead`): its units and
    /// when it ends, spent once the current one is out or over.
    next: Option<(u64, u64)>,
    /// The last lease asked for got no answer (the store failed).
    failed: bool,
    /// The store's last refusal of the key had ended by the time it
    /// landed (the key is at a limit that refuses for less than a round
    /// trip, so the denial cache cannot answer): decisions go to the
    /// store side by side until it admits one again.
    outrun: bool,
    /// Decisions of the key at the store side by side now (`Step::Aside`).
    aside: u32,
    /// The store's failure policy, not the store, gave the key's last
    /// answer: the current lease's units (if it was granted) are never
    /// given back to the store, which did not count them (fail-open
    /// counted nothing; a fallback counted them in its own memory, where
    /// they lapse); and until the store itself answers again, the key's
    /// decisions go through the store one by one, so that the policy
    /// answers each at its own cost (a policy's refusal of a lease — a
    /// closed store's, or a fallback memory's share too small for the
    /// batch — says nothing of a smaller cost).
    unowned: bool,
}

impl KeyState {
    fn idle(&self, now: u64) -> bool {
        self.flight.is_none()
            && self.expires <= now
            && self.denied_until <= now
            && self.next.is_none_or(|(_, end)| end <= now)
    }
}

/// One shard's keys and their leases.
#[derive(Default)]
struct Keys {
    map: HashMap<Box<[u8]>, KeyState>,
    /// When the shard was last swept for idle keys (local clock).
    swept: u64,
}

impl std::ops::Deref for Keys {
    type Target = HashMap<Box<[u8]>, KeyState>;
    fn deref(&self) -> &Self::Target {
        &self.map
    }
}

impl std::ops::DerefMut for Keys {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.map
    }
}

/// A count kept for [`HotStats`] and exported as a metric (`name` and
/// `rule` labels).
struct Count {
    n: AtomicU64,
    metric: metrics::Counter,
}

impl Count {
    fn new(name: &'static str, front: &str, rule: &str) -> Self {
        metrics::describe_counter!(
            "tollgate_hot_decisions_total",
            "Decisions of a rule leased by HotKeys"
        );
        metrics::describe_counter!(
            "tollgate_hot_store_calls_total",
            "Store calls those decisions took (leases, give-backs, decisions through)"
        );
        metrics::describe_counter!(
            "tollgate_hot_waits_total",
            "Decisions that waited for the store (their own call or another's lease)"
        );
        Self {
            n: AtomicU64::new(0),
            metric: metrics::counter!(name, "name" => front.to_owned(), "rule" => rule.to_owned()),
        }
    }

    fn add(&self) {
        self.n.fetch_add(1, Ordering::Relaxed);
        self.metric.increment(1);
    }

    fn get(&self) -> u64 {
        self.n.load(Ordering::Relaxed)
    }
}

struct Local<C> {
    clock: Arc<C>,
    ttl: u64,
    max_denial: u64,
    max_batch: u64,
    min_batch: u64,
    /// Fixed windows: a lease ends with the store's window.
    windowed: bool,
    per_shard: usize,
    hasher: RandomState,
    shards: Box<[Mutex<Keys>]>,
    decisions: Count,
    store_calls: Count,
    /// Decisions that waited for the store (their own call or another's).
    waits: Count,
    /// Take leases ahead.
    ahead: bool,
}

/// The longest key the lease table holds; longer ones decide through the
/// store.
const MAX_LEASED_KEY: usize = 64;

/// A lease ahead that is due: its size, and its flight (set).
type AheadDue = (u64, Arc<Notify>);

/// What the local state answers.
enum Step {
    /// Decided here.
    Done(Decision),
    /// Take a lease of this many units (units left from an ended lease
    /// to give back first).
    Take { batch: u64, give_back: u64 },
    /// Another decision is taking a lease: wait for it.
    Wait(Arc<Notify>),
    /// No room to keep the key: decide through the store.
    Through,
    /// Decide through the store beside the key's other decisions (the
    /// key is outrun, or its store's policy answers): counted in the
    /// key's `aside`, which the caller's guard gives back.
    Aside,
}

/// Most decisions of one key that go to the store side by side at once
/// (an outrun key, or one its store's failure policy answers); the rest
/// wait for a lease as a key at its limit did before, so a flood of one
/// key costs the store at most this many calls in flight per instance.
const MAX_ASIDE: u32 = 16;

impl<C: Clock> Local<C> {
    fn shard(&self, key: &[u8]) -> MutexGuard<'_, Keys> {
        let i = usize::try_from(self.hasher.hash_one(key)).unwrap_or(0) % SHARDS;
        // SHARDS entries; `i` is below it.
        let shard = self.shards.get(i).or_else(|| self.shards.first());
        match shard {
            Some(m) => m.lock().unwrap_or_else(PoisonError::into_inner),
            None => unreachable_shards(),
        }
    }

    /// A local answer, if the lease or the denial cache has one, and the
    /// size of a lease to take ahead, if one is due now (it is marked in
    /// flight: the caller must take it, see [`refill`](Self::refill)).
    fn local(
        &self,
        key: &[u8],
        cost: u64,
        limit: u64,
        owned_only: bool,
    ) -> Option<(Decision, Option<AheadDue>)> {
        let now = self.clock.now();
        let mut shard = self.shard(key);
        let s = shard.get_mut(key)?;
        if owned_only && s.unowned {
            return None;
        }
        let d = answer(s, now, cost, limit)?;
        // Due once the lease is half spent (a key that spends less within
        // a TTL is not hot: its next lease is taken when it needs one),
        // and only where a task can take it.
        let due = self.ahead
            && d.is_allowed()
            && !s.unowned
            && s.flight.is_none()
            && s.next.is_none()
            && s.units.saturating_mul(2) < s.batch
            && tokio::runtime::Handle::try_current().is_ok();
        if !due {
            return Some((d, None));
        }
        // Hot enough to run a lease half down: a bigger one next.
        s.batch = s.batch.saturating_mul(2).clamp(1, self.max_batch);
        let flight = Arc::new(Notify::new());
        s.flight = Some(Arc::clone(&flight));
        s.failed = false;
        Some((d, Some((s.batch, flight))))
    }

    /// Takes a lease of `batch` units for `key` ahead of need (marked in
    /// flight by [`local`](Self::local)): it becomes the key's next lease.
    /// A refusal or a fault takes nothing; the key's next decision that
    /// finds no units asks the store itself.
    async fn refill<L: Limiter>(&self, inner: &L, key: &[u8], batch: u64, flight: &Arc<Notify>) {
        let sent = self.clock.now();
        self.store_calls.add();
        let (d, unowned) = lease(inner, key, batch).await;
        let mut shard = self.shard(key);
        let Some(s) = shard.get_mut(key) else { return };
        if !end_flight(s, flight) {
            // Not this lease's flight any more: nothing to land on.
            return;
        }
        s.failed = d.is_err();
        match d {
            // A lease the failure policy granted is not taken ahead: the
            // key's next decision asks the store (or its policy) again.
            Ok(_) if unowned => {}
            Ok(d) if d.is_allowed() => {
                s.next = Some((batch, self.lease_end(sent, &d)));
                s.remaining = d.remaining;
                s.whole_at = sent.saturating_add(d.reset_after);
            }
            // Not that much left: the key runs near its limit, and its
            // next lease starts small again.
            Ok(_) => s.batch = self.min_batch,
            Err(_) => {}
        }
    }

    /// Ends the lease ahead's `flight`, if it is still the key's (the
    /// lease did not land): its waiters wake and ask the store themselves.
    fn land_nothing(&self, key: &[u8], flight: &Arc<Notify>) {
        let mut shard = self.shard(key);
        if let Some(s) = shard.get_mut(key) {
            end_flight(s, flight);
        }
    }

    /// When a lease counted by the store at `sent` ends: its TTL later, or
    /// with the store's window (fixed windows).
    fn lease_end(&self, sent: u64, d: &Decision) -> u64 {
        let end = sent.saturating_add(self.ttl);
        if self.windowed {
            end.min(sent.saturating_add(d.reset_after))
        } else {
            end
        }
    }

    /// The next step for a decision that the local state could not answer.
    /// `waited`: the decision already waited for [`MAX_LANDINGS`] leases
    /// to land, and none left anything for it. If the key's leases are as
    /// large as they get, it goes to the store now, side by side with the
    /// others, rather than waiting again or taking the next lease in turn:
    /// a key whose leases serve one or two decisions (a small burst), or
    /// whose demand outruns its largest lease, would otherwise get one
    /// round trip per lease, one after another, and a queue that grows
    /// without bound. (While leases still grow, the next one is larger:
    /// waiting for it saves the store calls.)
    fn plan(&self, key: &[u8], cost: u64, limit: u64, landed: u32) -> Step {
        let waited = landed >= MAX_LANDINGS;
        if key.len() > MAX_LEASED_KEY {
            // Kept out of the table, which holds keys as they are.
            return Step::Through;
        }
        let now = self.clock.now();
        let mut shard = self.shard(key);
        if !shard.contains_key(key) && shard.len() >= self.per_shard {
            // Swept at most once a TTL: under a flood of new keys, the
            // rest go through the store rather than each sweeping.
            if now.saturating_sub(shard.swept) < self.ttl {
                return Step::Through;
            }
            shard.swept = now;
            shard.retain(|_, s| !s.idle(now));
            if shard.len() >= self.per_shard {
                return Step::Through;
            }
        }
        let s = shard.entry(key.into()).or_default();
        if let Some(d) = answer(s, now, cost, limit) {
            return Step::Done(d);
        }
        // The key's last refusal was over before it landed: the key is at
        // a limit the denial cache cannot hold (it refuses for less than a
        // round trip), where leases of one unit would serve one decision
        // per round trip, in turn. Ask the store side by side, as without
        // `HotKeys`, until it admits again (then leases start over, at the
        // smallest batch).
        if (s.outrun || s.unowned) && s.aside < MAX_ASIDE {
            s.aside = s.aside.saturating_add(1);
            return Step::Aside;
        }
        if waited && s.batch.max(cost) >= self.max_batch && s.aside < MAX_ASIDE {
            s.aside = s.aside.saturating_add(1);
            return Step::Aside;
        }
        if let Some(flight) = &s.flight {
            return Step::Wait(Arc::clone(flight));
        }
        // Adapt: a lease spent before its end means a hot key; one that
        // ended with units left, a cooler one.
        // A new lease replaces the old one: what the old one holds (too
        // little for this cost) goes back to the store while it is on (a
        // window's lease, while its window is). Once it has ended, its
        // units lapse: the store's budget may have refilled meanwhile (a
        // GCRA's idle time, a bucket at capacity), and a refund then would
        // credit capacity that time already gave back — up to another
        // `rate × ttl` beyond the bound.
        let ended = s.expires <= now;
        let recent = if self.windowed {
            // The lease's window is still the store's, and stays so for a
            // TTL more: a give-back that reached the store after its window
            // rolled over would come off the next window's count.
            !ended && now.saturating_add(self.ttl) < s.whole_at
        } else {
            !ended
        };
        let left = std::mem::take(&mut s.units);
        let give_back = if recent && !s.unowned { left } else { 0 };
        s.spent = 0;
        if s.batch == 0 {
            s.batch = self.min_batch;
        } else if !ended {
            s.batch = s.batch.saturating_mul(2).min(self.max_batch);
        } else if left > 0 {
            s.batch = (s.batch / 2).max(self.min_batch);
        }
        s.flight = Some(Arc::new(Notify::new()));
        s.failed = false;
        Step::Take {
            batch: s.batch.max(cost),
            give_back,
        }
    }

    /// Records what the store answered to a lease of `taken` units for a
    /// decision of `cost`, wakes the waiters, and returns the decision.
    /// `sent`: when the store call started. Times run from it, not from
    /// the answer, so a lease never outlives its TTL (or its window) as
    /// counted from when the store counted it.
    fn settle(
        &self,
        key: &[u8],
        cost: u64,
        taken: u64,
        sent: u64,
        (d, unowned): (&Result<Decision, StoreError>, bool),
    ) {
        let now = sent;
        let mut shard = self.shard(key);
        let Some(s) = shard.get_mut(key) else { return };
        if let Some(flight) = s.flight.take() {
            flight.notify_waiters();
        }
        s.failed = d.is_err();
        let Ok(d) = d else { return };
        s.unowned = unowned;
        s.outrun = !unowned && outrun(d, sent, self.clock.now());
        match d.outcome {
            Outcome::Allow { .. } => {
                s.units = s.units.saturating_add(taken.saturating_sub(cost));
                s.spent = cost;
                s.expires = self.lease_end(now, d);
                s.remaining = d.remaining;
                s.whole_at = now.saturating_add(d.reset_after);
            }
            // Refused this request's own cost (or, a closed store's
            // policy, every cost alike): nothing for it until then.
            Outcome::Deny { retry_after }
                if taken <= cost || (unowned && *d == Decision::closed(d.limit)) =>
            {
                s.denied_until = now.saturating_add(retry_after.min(self.max_denial));
                s.denied_cost = cost;
                s.remaining = d.remaining;
                s.whole_at = now.saturating_add(d.reset_after);
                s.batch = self.min_batch;
            }
            // Refused a batch (the next lease starts small again), or
            // never: nothing cached for this cost.
            Outcome::Deny { .. } | Outcome::Never => s.batch = self.min_batch,
        }
    }

    /// Whether the key's last answer came from its store's failure policy.
    fn unowned(&self, key: &[u8]) -> bool {
        self.shard(key).get(key).is_some_and(|s| s.unowned)
    }

    /// Records what the store answered a decision made through it (not a
    /// lease) for a key the table holds: a refusal is cached as a lease's
    /// is, and an admission ends the refused spell (the next decision
    /// takes a lease again).
    fn after_through(
        &self,
        key: &[u8],
        cost: u64,
        sent: u64,
        (d, unowned): (&Result<Decision, StoreError>, bool),
    ) {
        let mut shard = self.shard(key);
        let (Some(s), Ok(d)) = (shard.get_mut(key), d) else {
            return;
        };
        s.unowned = unowned;
        s.outrun = !unowned && outrun(d, sent, self.clock.now());
        if let Outcome::Deny { retry_after } = d.outcome {
            s.denied_until = sent.saturating_add(retry_after.min(self.max_denial));
            s.denied_cost = cost;
            s.remaining = d.remaining;
            s.whole_at = sent.saturating_add(d.reset_after);
        }
    }

    /// Gives `units` back to the local lease, if it is still on and they
    /// were spent from it — counted as its latest spends, since a refund
    /// follows its charge within one request. A charge from a lease that
    /// has since been replaced goes back to the store, which caps it as
    /// its algorithm does.
    fn refund_local(&self, key: &[u8], units: u64) -> bool {
        let now = self.clock.now();
        let mut shard = self.shard(key);
        match shard.get_mut(key) {
            Some(s) if s.expires > now && s.spent >= units => {
                s.spent = s.spent.saturating_sub(units);
                s.units = s.units.saturating_add(units);
                true
            }
            _ => false,
        }
    }
}

/// Whether `d`, asked for at `sent` and landed at `now`, is a refusal
/// whose wait was over when it landed.
fn outrun(d: &Decision, sent: u64, now: u64) -> bool {
    match d.outcome {
        Outcome::Deny { retry_after } => sent.saturating_add(retry_after) <= now,
        Outcome::Allow { .. } | Outcome::Never => false,
    }
}

/// Asks `inner` for a lease of `units` for `key`: its answer, and whether
/// the store's failure policy gave it rather than the store (a store that
/// decides rules together says so; for others, never).
async fn lease<L: Limiter>(inner: &L, key: &[u8], units: u64) -> Flagged {
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

/// Ends `flight` if it is still `s`'s, waking its waiters; `false` when
/// the key has another flight, or none.
fn end_flight(s: &mut KeyState, flight: &Arc<Notify>) -> bool {
    if !s.flight.as_ref().is_some_and(|f| Arc::ptr_eq(f, flight)) {
        return false;
    }
    s.flight = None;
    flight.notify_waiters();
    true
}

#[allow(clippy::panic)]
fn unreachable_shards() -> ! {
    // `shards` has SHARDS > 0 entries from construction.
    panic!("hot-key table without shards")
}

/// The local answer of `s` at `now` to a decision of `cost`, if any.
fn answer(s: &mut KeyState, now: u64, cost: u64, limit: u64) -> Option<Decision> {
    // The cached denial refuses what costs at least what it refused.
    if s.denied_until > now && cost >= s.denied_cost {
        let wait = s.denied_until.saturating_sub(now);
        return Some(Decision {
            outcome: Outcome::Deny { retry_after: wait },
            limit,
            remaining: 0,
            reset_after: s.whole_at.saturating_sub(now).max(wait),
        });
    }
    // The current lease is out or over: the one taken ahead, if it is
    // still on, takes its place (what the current one held lapses).
    if cost > 0 && (s.units < cost || now >= s.expires) {
        if let Some((units, end)) = s.next.take() {
            // What the replaced lease still holds lapses (fewer than this
            // cost, or its time is over): given back later, it could
            // credit a later window than the one that counted it.
            if now < end {
                s.spent = 0;
                s.units = units;
                s.expires = end;
            }
        }
    }
    if cost > 0 && s.units >= cost && now < s.expires {
        s.units = s.units.saturating_sub(cost);
        s.spent = s.spent.saturating_add(cost);
        let ahead = s.next.map_or(0, |(units, _)| units);
        return Some(Decision {
            outcome: Outcome::Allow { delay: 0 },
            limit,
            remaining: s.remaining.saturating_add(s.units).saturating_add(ahead),
            reset_after: s.whole_at.saturating_sub(now),
        });
    }
    None
}

/// A rule bound through [`Hot`]: decides from its key's lease when it can,
/// else through the store.
pub struct HotLimiter<L, C = SystemClock> {
    inner: L,
    local: Option<Arc<Local<C>>>,
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

enum Inner {
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
    fn leased(
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
    fn decide_local(
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

    /// Each part decided as [`decide`](Self::decide) decides it, side by
    /// side, each answer saying whether the store's failure policy gave it
    /// (a lease or a refusal it granted, or its answer through the store),
    /// so that a policy counts no strike on a refusal that says nothing
    /// about the client. Not atomic across parts: an admitted part is
    /// consumed, and the caller refunds it if another refuses — except an
    /// admission the failure policy gave, which is never refunded (Redis
    /// never counted it).
    fn decide_joint(
        parts: &[JointPart<'_, Self>],
    ) -> Option<tollgate_core::BoxFuture<Vec<JointDecision>>> {
        let calls: Vec<crate::BoxFuture<Flagged>> = parts
            .iter()
            .map(|p| {
                let (limiter, key, cost) = (p.limiter, p.key, p.cost);
                match limiter.leased(key, cost) {
                    // Not leased, or a peek: the store's own answer.
                    None => {
                        let (inner, key) = (limiter.inner.clone(), key.to_vec());
                        Box::pin(async move { lease(&inner, &key, cost).await })
                            as crate::BoxFuture<Flagged>
                    }
                    Some(Ok(d)) => {
                        let failed = limiter.local.as_ref().is_some_and(|l| l.unowned(key));
                        Box::pin(std::future::ready((Ok(d), failed)))
                    }
                    Some(Err(through)) => Box::pin(through),
                }
            })
            .collect();
        let costs: Vec<u64> = parts.iter().map(|p| p.cost).collect();
        Some(Box::pin(async move {
            tollgate_core::join_all(calls)
                .await
                .into_iter()
                .zip(costs)
                .map(|((decision, failed), cost)| JointDecision {
                    // What the failure policy admitted is not the store's
                    // to give back: a refund would credit Redis with a
                    // charge it never made (or go to the wrong store).
                    consumed: cost > 0
                        && !failed
                        && decision.as_ref().is_ok_and(Decision::is_allowed),
                    decision,
                    failed,
                })
                .collect()
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

/// A decision, and whether the store's failure policy gave it.
type Flagged = (Result<Decision, StoreError>, bool);

/// A decision that the key's lease could not answer at once: it waits for
/// a lease in flight, takes one, or goes to the store, as the key's state
/// says (see `Local::plan`). Also says whether the store's failure policy
/// answered.
async fn decide_through<L: Limiter, C: Clock>(
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
struct Aside<'a, C: Clock> {
    local: &'a Local<C>,
    key: &'a [u8],
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
struct Ahead<C: Clock> {
    local: Arc<Local<C>>,
    key: Vec<u8>,
    flight: Arc<Notify>,
}

impl<C: Clock> Drop for Ahead<C> {
    fn drop(&mut self) {
        self.local.land_nothing(&self.key, &self.flight);
    }
}

/// Ends a flight if its future is dropped mid-way (a cancelled request):
/// the waiters wake and one of them takes the lease.
struct Flight<'a, C: Clock> {
    local: &'a Local<C>,
    key: &'a [u8],
    done: bool,
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
