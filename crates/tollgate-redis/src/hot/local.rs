//! The lease table of one leased rule: planning a decision, taking,
//! spending and giving back leases, and its counts.

use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::Notify;
use tollgate_core::{Clock, Decision, Limiter, Outcome, StoreError};

use super::keys::{
    answer, end_flight, unreachable_shards, Budget, KeyState, Keys, Lease, MAX_LANDINGS, SHARDS,
};
use super::through::lease;

/// A count kept for [`HotStats`] and exported as a metric (`name` and
/// `rule` labels).
pub(super) struct Count {
    pub(super) n: AtomicU64,
    pub(super) metric: metrics::Counter,
}

impl Count {
    pub(super) fn new(name: &'static str, front: &str, rule: &str) -> Self {
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

    pub(super) fn add(&self) {
        self.n.fetch_add(1, Ordering::Relaxed);
        self.metric.increment(1);
    }

    pub(super) fn get(&self) -> u64 {
        self.n.load(Ordering::Relaxed)
    }
}

pub(super) struct Local<C> {
    pub(super) clock: Arc<C>,
    pub(super) ttl: u64,
    pub(super) max_denial: u64,
    pub(super) max_batch: u64,
    pub(super) min_batch: u64,
    /// Fixed windows: a lease ends with the store's window.
    pub(super) windowed: bool,
    /// The rule's window (ns) over which it grants its capacity: with the
    /// capacity, its rate.
    pub(super) window: u64,
    pub(super) per_shard: usize,
    pub(super) hasher: RandomState,
    pub(super) shards: Box<[Mutex<Keys>]>,
    pub(super) decisions: Count,
    pub(super) store_calls: Count,
    /// Decisions that waited for the store (their own call or another's).
    pub(super) waits: Count,
    /// Take leases ahead.
    pub(super) ahead: bool,
}

/// The longest key the lease table holds; longer ones decide through the
/// store.
pub(super) const MAX_LEASED_KEY: usize = 64;

/// A lease ahead that is due: its size, and its flight (set).
pub(super) type AheadDue = (u64, Arc<Notify>);

/// What the local state answers.
pub(super) enum Step {
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

impl<C: Clock> Local<C> {
    pub(super) fn shard(&self, key: &[u8]) -> MutexGuard<'_, Keys> {
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
    pub(super) fn local(
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
        let d = answer(s, now, cost, (limit, self.window))?;
        // Due once the lease is half spent (a key that spends less within
        // a TTL is not hot: its next lease is taken when it needs one),
        // and only where a task can take it.
        let due = self.ahead
            && d.is_allowed()
            && !s.unowned
            && s.flight.is_none()
            && s.next.is_none()
            && s.lease.units().saturating_mul(2) < s.batch
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
    pub(super) async fn refill<L: Limiter>(
        &self,
        inner: &L,
        key: &[u8],
        batch: u64,
        flight: &Arc<Notify>,
    ) {
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
                s.next = Some(Lease::new(batch, self.lease_end(sent, &d)));
                s.budget = Budget::of(&d, sent);
            }
            // Not that much left: the key runs near its limit, and its
            // next lease starts small again.
            Ok(_) => s.batch = self.min_batch,
            Err(_) => {}
        }
    }

    /// Ends the lease ahead's `flight`, if it is still the key's (the
    /// lease did not land): its waiters wake and ask the store themselves.
    pub(super) fn land_nothing(&self, key: &[u8], flight: &Arc<Notify>) {
        let mut shard = self.shard(key);
        if let Some(s) = shard.get_mut(key) {
            end_flight(s, flight);
        }
    }

    /// When a lease counted by the store at `sent` ends: its TTL later, or
    /// with the store's window (fixed windows).
    pub(super) fn lease_end(&self, sent: u64, d: &Decision) -> u64 {
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
    pub(super) fn plan(&self, key: &[u8], cost: u64, limit: u64, landed: u32) -> Step {
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
        if let Some(d) = answer(s, now, cost, (limit, self.window)) {
            return Step::Done(d);
        }
        // The key's last refusal was over before it landed: the key is at
        // a limit the denial cache cannot hold (it refuses for less than a
        // round trip), where leases of one unit would serve one decision
        // per round trip, in turn. Ask the store side by side, as without
        // `HotKeys`, until it admits again (then leases start over, at the
        // smallest batch).
        // (Beyond the cap, `answer` refused such a key's excess.)
        let cap = s.aside_cap(limit, self.window);
        if (s.outrun || s.unowned) && s.aside < cap {
            s.aside = s.aside.saturating_add(1);
            return Step::Aside;
        }
        if waited && s.batch.max(cost) >= self.max_batch && s.aside < cap {
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
        let ended = !s.lease.on(now);
        let recent = self.returnable(&s.lease, s, now);
        let left = s.lease.give_back();
        let give_back = if recent { left } else { 0 };
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
    pub(super) fn settle(
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
        s.landed(d, cost, (sent, self.clock.now()), unowned);
        match d.outcome {
            Outcome::Allow { .. } => {
                s.lease.take(taken, cost, self.lease_end(now, d), unowned);
                s.budget = Budget::of(d, now);
            }
            // Refused this request's own cost (or, a closed store's
            // policy, every cost alike): nothing for it until then.
            Outcome::Deny { retry_after }
                if taken <= cost || (unowned && *d == Decision::closed(d.limit)) =>
            {
                s.refused(d, cost, (now, retry_after, self.max_denial));
                s.batch = self.min_batch;
            }
            // Refused a batch (the next lease starts small again), or
            // never: nothing cached for this cost.
            Outcome::Deny { .. } | Outcome::Never => s.batch = self.min_batch,
        }
    }

    /// Whether what `lease` (of the key `s`) holds may go back to the
    /// store at `now`: while it is on, and (a window's lease) while its
    /// window is the store's and stays so for a TTL more — a give-back
    /// that reached the store after its window rolled over would come off
    /// the next window's count. Never a lease the store's failure policy
    /// granted (the store did not count it), whatever the key's later
    /// answers were.
    fn returnable(&self, lease: &Lease, s: &KeyState, now: u64) -> bool {
        let on = lease.on(now) && !lease.unowned();
        if self.windowed {
            on && now.saturating_add(self.ttl) < s.budget.whole_at()
        } else {
            on
        }
    }

    /// Gives up every lease (the instance is stopping): each key's units
    /// that may still go back to the store, for the caller to refund; the
    /// rest lapse. Keys decide through new leases afterwards.
    pub(super) fn surrender(&self) -> Vec<(Box<[u8]>, u64)> {
        let now = self.clock.now();
        let mut back = Vec::new();
        for shard in self.shards.iter() {
            let mut keys = shard.lock().unwrap_or_else(PoisonError::into_inner);
            for (key, s) in keys.map.iter_mut() {
                let mut units = 0u64;
                if self.returnable(&s.lease, s, now) {
                    units = units.saturating_add(s.lease.give_back());
                } else {
                    s.lease.give_back();
                }
                if let Some(mut next) = s.next.take() {
                    if self.returnable(&next, s, now) {
                        units = units.saturating_add(next.give_back());
                    }
                }
                if units > 0 {
                    back.push((key.clone(), units));
                }
            }
        }
        back
    }

    /// Whether the key's last answer came from its store's failure policy.
    pub(super) fn unowned(&self, key: &[u8]) -> bool {
        self.shard(key).get(key).is_some_and(|s| s.unowned)
    }

    /// Records what the store answered a decision made through it (not a
    /// lease) for a key the table holds: a refusal is cached as a lease's
    /// is, and an admission ends the refused spell (the next decision
    /// takes a lease again).
    pub(super) fn after_through(
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
        s.landed(d, cost, (sent, self.clock.now()), unowned);
        if let Outcome::Deny { retry_after } = d.outcome {
            s.refused(d, cost, (sent, retry_after, self.max_denial));
        }
    }

    /// Gives `units` back to the local lease, if it is still on and they
    /// were spent from it — counted as its latest spends, since a refund
    /// follows its charge within one request. A charge from a lease that
    /// has since been replaced goes back to the store, which caps it as
    /// its algorithm does.
    pub(super) fn refund_local(&self, key: &[u8], units: u64) -> bool {
        let now = self.clock.now();
        let mut shard = self.shard(key);
        shard
            .get_mut(key)
            .is_some_and(|s| s.lease.refund(units, now))
    }
}
