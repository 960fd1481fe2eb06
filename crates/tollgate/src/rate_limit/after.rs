//! Cost measured after the fact (000 §12: expensive business logic): a
//! request is admitted on an estimate, and once its response is known
//! what it really cost is settled — the difference given back, or owed
//! and paid by the key's next request.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use http::Response;
use tokio::time::Instant;
use tollgate_core::{Decision, Outcome};

use crate::key::KeyBytes;

/// How a [`RateLimitLayer`](super::RateLimitLayer) measures what a
/// request really cost, once its response is known (see
/// [`charge_after`](super::RateLimitLayerBuilder::charge_after)). A
/// response that carries an [`ActualCost`] is charged that, whatever the
/// measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Measure {
    /// The handler's time, from the call to the response's head: one unit
    /// per `per` (rounded up).
    Elapsed {
        /// The time one unit buys.
        per: Duration,
    },
    /// The response's length as its head declares it (`Content-Length`):
    /// one unit per `per` bytes (rounded up). A streamed body of unknown
    /// length (chunked, compressed inside this layer) and a `HEAD`
    /// response count as 0 bytes, which costs the least an admitted
    /// request costs, 1: report a streamed body's cost with
    /// [`ActualCost`].
    ResponseBytes {
        /// The bytes one unit buys.
        per: u64,
    },
    /// Only what the handler reports with [`ActualCost`] (a response
    /// without one costs its estimate).
    Reported,
}

/// What a request really cost, in the rule's units: a handler puts it in
/// its response's extensions (e.g. the rows a report read), for a layer
/// built with [`charge_after`](super::RateLimitLayerBuilder::charge_after).
///
/// ```
/// use tollgate::rate_limit::ActualCost;
///
/// let mut response = http::Response::new("the report");
/// response.extensions_mut().insert(ActualCost(40));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActualCost(pub u64);

impl Measure {
    /// A build error naming `charge_after` for a unit worth nothing.
    pub(crate) fn check(self) -> Result<(), tollgate_core::ConfigError> {
        match self {
            Measure::Elapsed {
                per: Duration::ZERO,
            }
            | Measure::ResponseBytes { per: 0 } => Err(tollgate_core::ConfigError::new(
                "charge_after",
                "a unit must be worth more than zero (time or bytes)",
            )),
            _ => Ok(()),
        }
    }

    /// What `response` (to a `HEAD` request when `head`: no body sent),
    /// answered `elapsed` after its call, cost; `None` where the measure
    /// reads only what the handler reports and it reported nothing.
    fn cost<B>(self, response: &Response<B>, elapsed: Duration, head: bool) -> Option<u64> {
        if let Some(ActualCost(n)) = response.extensions().get::<ActualCost>() {
            return Some(*n);
        }
        match self {
            Measure::Elapsed { per } => Some(Self::elapsed(per, elapsed)),
            Measure::ResponseBytes { .. } if head => Some(0),
            Measure::ResponseBytes { per } => {
                let bytes = response
                    .headers()
                    .get(http::header::CONTENT_LENGTH)
                    .and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok())
                    .unwrap_or(0);
                Some(bytes.div_ceil(per.max(1)))
            }
            Measure::Reported => None,
        }
    }

    /// `elapsed` in units of `per`, rounded up.
    fn elapsed(per: Duration, elapsed: Duration) -> u64 {
        let units = elapsed.as_nanos().div_ceil(per.as_nanos().max(1));
        u64::try_from(units).unwrap_or(u64::MAX)
    }
}

/// The most keys a layer keeps debts for; a key's debt is at most this
/// many times the rule's capacity.
const MAX_DEBTORS: usize = 100_000;
const MAX_DEBT_CAPACITIES: u64 = 100;
/// The most reloads a debt follows to the table current now; past them it
/// is owed where it got to.
const MAX_RELOADS: usize = 64;

/// Gives units to, or takes them from, a key of the rule's limiter
/// (without waiting for the store).
pub(crate) type Units = Arc<dyn Fn(&[u8], u64) + Send + Sync>;

/// A key's debt: `units` owed at `since`, which the rule frees at its
/// steady rate from then on (as it would have, had they been charged).
#[derive(Debug, Clone, Copy)]
struct Debt {
    units: u64,
    since: Instant,
}

/// What one layer's keys owe, and how it measures.
pub(crate) struct Debts {
    measure: Measure,
    capacity: u64,
    /// The rule's window, in ns: it frees `capacity` units per window.
    window: u64,
    /// How many keys owe (read without the lock: most requests find none).
    debtors: AtomicUsize,
    owed: Mutex<HashMap<Box<[u8]>, Debt>>,
    /// Gives units back to the rule's limiter (a request that cost less
    /// than its estimate).
    refund: Units,
    /// Charges a debt at once, when the table is full (if the key's
    /// budget holds it; else it is forgiven).
    charge: Units,
    /// The rule's debts after a reload ([`inherit`](Self::inherit)):
    /// requests this one decided that end later owe there. Held strongly
    /// (a reload's new layer may be dropped at once; the policy it made
    /// current keeps its own tables), and only by tables that are no
    /// longer current, which live as long as their requests in flight.
    successor: Mutex<Option<Arc<Debts>>>,
}

/// What a key's debt asks of its request.
pub(crate) enum Owed {
    /// Pay these units on top of the request's cost (0: nothing owed).
    Pay(u64),
    /// More is owed than the rule can charge with the request: refused
    /// for this many ns, until enough of it is freed.
    Wait(u64),
}

impl Debts {
    pub(crate) fn new(
        measure: Measure,
        capacity: u64,
        window: u64,
        refund: Units,
        charge: Units,
    ) -> Self {
        Self {
            measure,
            capacity,
            window,
            debtors: AtomicUsize::new(0),
            owed: Mutex::default(),
            refund,
            charge,
            successor: Mutex::new(None),
        }
    }

    /// The debts of `limiter`'s rule, measured by `measure`: refunds give
    /// units back to it, a debt charged at once is decided on it — none
    /// once `retired` is set (a reload replaced the rule by one whose
    /// units mean something else).
    pub(crate) fn of<L: tollgate_core::Limiter>(
        measure: Measure,
        limiter: &L,
        retired: Option<Arc<std::sync::atomic::AtomicBool>>,
    ) -> Arc<Self> {
        let rule = limiter.rule();
        let (give, take) = (limiter.clone(), limiter.clone());
        let live = move || !retired.as_ref().is_some_and(|r| r.load(Ordering::Acquire));
        let also = live.clone();
        Arc::new(Self::new(
            measure,
            rule.capacity(),
            rule.window(),
            Arc::new(move |key: &[u8], units| {
                if live() {
                    crate::task::finish(give.refund(key, units));
                }
            }),
            Arc::new(move |key: &[u8], units| {
                if also() {
                    crate::task::finish(take.decide(key, units));
                }
            }),
        ))
    }

    /// Takes over what `old` (the rule this one replaces in a reload)
    /// is owed, where its units mean the same here (the same measure,
    /// capacity and window): each key's debt is added to what it owes
    /// here, and what `old`'s requests still in flight owe later is owed
    /// here too.
    pub(crate) fn inherit(self: &Arc<Self>, old: &Self) {
        if std::ptr::eq(&**self, old)
            || (self.measure, self.capacity, self.window) != (old.measure, old.capacity, old.window)
        {
            return;
        }
        let now = Instant::now();
        // Under `old`'s table lock (taken first, as `owe` takes it): a
        // debt owed meanwhile lands in the table taken here, or goes on.
        let taken = {
            let mut owed = old.owed();
            *old.successor() = Some(Arc::clone(self));
            old.debtors.store(0, Ordering::Relaxed);
            std::mem::take(&mut *owed)
        };
        for (key, debt) in taken {
            self.owe(&key, old.left(debt, now));
        }
    }

    /// This table is current again (its layer installed anew): it keeps
    /// what it is owed, and forwards nothing.
    pub(crate) fn current(&self) {
        let _owed = self.owed();
        *self.successor() = None;
    }

    fn successor(&self) -> std::sync::MutexGuard<'_, Option<Arc<Debts>>> {
        self.successor
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn owed(&self) -> std::sync::MutexGuard<'_, HashMap<Box<[u8]>, Debt>> {
        self.owed.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What of `d` is still owed at `now`: its units, less what the rule
    /// freed since.
    fn left(&self, d: Debt, now: Instant) -> u64 {
        let ns = now.saturating_duration_since(d.since).as_nanos();
        let freed = ns
            .saturating_mul(u128::from(self.capacity))
            .checked_div(u128::from(self.window.max(1)))
            .unwrap_or(u128::MAX);
        d.units
            .saturating_sub(u64::try_from(freed).unwrap_or(u64::MAX))
    }

    /// How long the rule takes to free `units`, in ns (rounded up).
    fn freeing(&self, units: u64) -> u64 {
        let ns = u128::from(units)
            .saturating_mul(u128::from(self.window))
            .div_ceil(u128::from(self.capacity.max(1)));
        u64::try_from(ns).unwrap_or(u64::MAX)
    }

    /// What `key` owes of a request that leaves `room` units of the
    /// rule's capacity: all of it, paid with the request, if it fits;
    /// else a wait until it does.
    pub(crate) fn take(&self, key: &[u8], room: u64) -> Owed {
        if self.debtors.load(Ordering::Relaxed) == 0 {
            return Owed::Pay(0);
        }
        let now = Instant::now();
        let mut owed = self.owed();
        let Some(d) = owed.get(key).copied() else {
            return Owed::Pay(0);
        };
        let left = self.left(d, now);
        if left > room {
            return Owed::Wait(self.freeing(left.saturating_sub(room)));
        }
        owed.remove(key);
        self.debtors.store(owed.len(), Ordering::Relaxed);
        Owed::Pay(left)
    }

    /// `key` owes `units` more (what it owed freeing at the rule's rate,
    /// at most 100 capacities in all). A full table first drops the debts
    /// freed already; still full, the debt is charged at once if the
    /// key's budget holds it, and forgiven if not.
    pub(crate) fn owe(&self, key: &[u8], units: u64) {
        if units == 0 {
            return;
        }
        // Down the chain of reloads, to the table current now (a bounded
        // walk: the chain is as long as the reloads a request outlived).
        let mut next: Option<Arc<Debts>> = None;
        for _ in 0..MAX_RELOADS {
            let here = next.as_deref().unwrap_or(self);
            match here.owe_here(key, units, false) {
                Some(successor) => next = Some(successor),
                None => return,
            }
        }
        let here = next.as_deref().unwrap_or(self);
        here.owe_here(key, units, true);
    }

    /// [`owe`](Self::owe) in this table, unless it has a successor (then
    /// returned, checked under the table's lock) and `here` is not set.
    fn owe_here(&self, key: &[u8], units: u64, here: bool) -> Option<Arc<Debts>> {
        let now = Instant::now();
        let cap = self.capacity.saturating_mul(MAX_DEBT_CAPACITIES);
        let mut owed = self.owed();
        if !here {
            if let Some(next) = self.successor().clone() {
                return Some(next);
            }
        }
        if let Some(d) = owed.get_mut(key) {
            let left = self.left(*d, now);
            *d = Debt {
                units: left.saturating_add(units).min(cap),
                since: now,
            };
            return None;
        }
        if owed.len() >= MAX_DEBTORS {
            owed.retain(|_, d| self.left(*d, now) > 0);
        }
        if owed.len() < MAX_DEBTORS {
            owed.insert(
                key.into(),
                Debt {
                    units: units.min(cap),
                    since: now,
                },
            );
            self.debtors.store(owed.len(), Ordering::Relaxed);
            return None;
        }
        drop(owed);
        (self.charge)(key, units.min(self.capacity));
        None
    }
}

/// One admitted request's settlement, for when its response is known —
/// or for when it ends without one (its future dropped, its service
/// failed): then a request that was never charged owes again what it took
/// of the key's debt, and one whose handler ran is charged its time so far
/// (with [`Measure::Elapsed`]).
pub(crate) struct Settle {
    debts: Arc<Debts>,
    key: KeyBytes,
    /// What the request was charged for itself (its debt aside).
    estimate: u64,
    /// What each unit it really cost is charged: more than 1 for a key a
    /// slowing ladder put on a lower step (its requests cost more).
    share: u64,
    /// What its estimate costs at that price: above `estimate` where the
    /// step's price was capped at the rule's whole limit (what lies
    /// between is forgiven, as the cap forgave it).
    full: u64,
    /// What it took of the key's debt.
    paid: u64,
    started: Instant,
    /// Whether the request was charged and its handler called.
    called: bool,
    /// Its charge stands, whatever happens now (no refund will come): if
    /// it ends before its handler is called, the debt it paid stays paid.
    kept: bool,
    /// A `HEAD` request: no body is sent.
    head: bool,
    /// Settled already.
    done: bool,
}

impl Settle {
    pub(crate) fn new(
        debts: Arc<Debts>,
        key: KeyBytes,
        estimate: u64,
        paid: u64,
        head: bool,
    ) -> Self {
        Self {
            debts,
            key,
            estimate,
            share: 1,
            full: estimate,
            paid,
            started: Instant::now(),
            called: false,
            kept: false,
            head,
            done: false,
        }
    }

    /// The request was charged and its handler is called now: its time
    /// counts from here (not the store's round trip, nor a pacing wait).
    pub(crate) fn calling(mut self: Box<Self>) -> Box<Self> {
        self.call();
        self
    }

    /// Its charge stands from now on: no refund will come (see
    /// [`Drop`]).
    pub(crate) fn keep(&mut self) {
        self.kept = true;
    }

    /// Its charge may be given back after all (a paced request's, while it
    /// waits): dropped uncalled, it owes its debt again.
    pub(crate) fn unkeep(&mut self) {
        self.kept = false;
    }

    /// The request's key is on a lower step of a slowing ladder: it was
    /// charged `charged` for itself, and each unit it really cost counts
    /// `share` (what the step charges a unit), so that a cheap or a
    /// costly response settles at the step's price.
    pub(crate) fn slowed(&mut self, charged: u64, share: u64) {
        self.share = share.max(1);
        self.full = self.estimate.saturating_mul(self.share).max(charged);
        self.estimate = charged;
    }

    /// [`calling`](Self::calling), in place.
    pub(crate) fn call(&mut self) {
        self.called = true;
        self.started = Instant::now();
    }

    /// What the key owes, taken for a request of `cost` under a rule of
    /// `capacity` (see [`Debts::take`]): `Ok(units)` to add to its cost
    /// (owed again if the request is not charged after all), or the
    /// refusal while more is owed than the rule can charge with it. A
    /// request the rule can never admit pays none (the debt stays): the
    /// rule tells it so, where a debt's wait would send it back for
    /// nothing.
    pub(crate) fn take_owed(&mut self, capacity: u64, cost: u64) -> Result<u64, Decision> {
        if cost > capacity {
            return Ok(0);
        }
        match self
            .debts
            .take(self.key.as_bytes(), capacity.saturating_sub(cost))
        {
            Owed::Pay(units) => {
                self.paid = units;
                Ok(units)
            }
            Owed::Wait(ns) => Err(Decision {
                outcome: Outcome::Deny { retry_after: ns },
                limit: capacity,
                remaining: 0,
                reset_after: ns,
            }),
        }
    }

    /// The request was not charged (refused, or its store failed): what
    /// it took of the key's debt is owed again.
    pub(crate) fn unpaid(mut self) {
        self.done = true;
        self.debts.owe(self.key.as_bytes(), self.paid);
    }

    /// Its response is known: a cost above the estimate is owed, one
    /// below it given back (an admitted request costs at least one
    /// unit).
    pub(crate) fn finish<B>(mut self, response: &Response<B>) {
        self.done = true;
        let elapsed = self.started.elapsed();
        if let Some(actual) = self.debts.measure.cost(response, elapsed, self.head) {
            self.settle(actual);
        }
    }

    fn settle(&self, actual: u64) {
        let actual = actual.max(1).saturating_mul(self.share);
        let key = self.key.as_bytes();
        if actual > self.full {
            self.debts.owe(key, actual.saturating_sub(self.full));
        } else if actual < self.estimate {
            (self.debts.refund)(key, self.estimate.saturating_sub(actual));
        }
    }
}

impl Drop for Settle {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        if !self.called {
            // Never charged (its decision or its pacing wait given up,
            // which gives its cost back): the debt it took is owed again.
            // Charged for good, it stays paid.
            if !self.kept {
                self.debts.owe(self.key.as_bytes(), self.paid);
            }
            return;
        }
        // Its handler ran and gave no response (failed, or given up): its
        // time so far is what it cost.
        if let Measure::Elapsed { per } = self.debts.measure {
            self.settle(Measure::elapsed(per, self.started.elapsed()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Debts, Measure, Owed};
    use std::sync::Arc;

    fn table() -> Arc<Debts> {
        Arc::new(Debts::new(
            Measure::Reported,
            100,
            60_000_000_000,
            Arc::new(|_: &[u8], _| {}),
            Arc::new(|_: &[u8], _| {}),
        ))
    }

    fn owes(d: &Debts, key: &[u8]) -> u64 {
        match d.take(key, u64::MAX) {
            Owed::Pay(units) => units,
            Owed::Wait(_) => u64::MAX,
        }
    }

    /// A reload moves what keys owe to the rule's successor, and what is
    /// owed to the old table later goes on there; a table current again
    /// keeps what it is owed, and two tables never lead to each other.
    #[test]
    fn debts_follow_the_rule_and_stop_at_the_table_current_now() {
        let (a, b) = (table(), table());
        a.owe(b"k", 5);
        b.inherit(&a);
        assert_eq!(owes(&a, b"k"), 0, "moved");
        a.owe(b"k", 3);
        assert_eq!(owes(&b, b"k"), 8, "the old table's later debt goes on");
        // a is installed again: b's debts move back, and a forwards none.
        b.owe(b"j", 4);
        a.current();
        a.inherit(&b);
        b.owe(b"j", 1);
        assert_eq!(owes(&a, b"j"), 5);
        a.owe(b"i", 2);
        assert_eq!(owes(&a, b"i"), 2, "owed where it is current");
        assert_eq!(owes(&b, b"i"), 0);
    }
}
