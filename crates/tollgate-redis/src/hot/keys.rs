//! One key's lease and cached denial, the shards that keep them, and
//! how a lease answers a decision.

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::Notify;
use tollgate_core::{Decision, Outcome};

/// How many leases a decision waits to land before it goes to the store
/// itself once the key's leases are as large as they get (see
/// `Local::plan`): at most three flights' wait, whatever the key's demand.
pub(super) const MAX_LANDINGS: u32 = 3;
pub(super) const SHARDS: usize = 16;

/// Decisions of one key that may go to the store side by side at once (an
/// outrun key, or one its store's failure policy answers), at the least:
/// see [`aside_cap`]. Beyond it, an outrun key's decisions are refused
/// here at once, and others wait for a lease; so a flood of one key costs
/// the store a bounded number of calls in flight per instance.
pub(super) const MAX_ASIDE: u32 = 16;

/// The most decisions of one key side by side at once, whatever its rate.
pub(super) const MAX_ASIDE_CAP: u32 = 256;

/// How many decisions of a key that grants `limit` per `window` (ns) may
/// be at the store side by side when its round trip is `rtt`: twice what
/// its rate frees in a round trip (so that, between them, they take all
/// it frees while they are out), at least [`MAX_ASIDE`], at most
/// [`MAX_ASIDE_CAP`].
fn aside_cap(limit: u64, window: u64, rtt: u64) -> u32 {
    let per_trip = u128::from(rtt)
        .saturating_mul(u128::from(limit))
        .saturating_mul(2)
        .checked_div(u128::from(window))
        .unwrap_or(0);
    u32::try_from(per_trip)
        .unwrap_or(MAX_ASIDE_CAP)
        .clamp(MAX_ASIDE, MAX_ASIDE_CAP)
}

/// A lease of a key's units, taken from the store in one call: spent
/// here, with no I/O, until it runs out or ends.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Lease {
    /// Units held and not spent.
    units: u64,
    /// When it ends (local clock).
    expires: u64,
    /// Units spent from it (what a refund may give back to it).
    spent: u64,
    /// The store's failure policy granted it, not the store: its units
    /// were never counted there, and never go back.
    unowned: bool,
}

impl Lease {
    /// A lease of `units`, ending at `expires`, none spent.
    pub(super) fn new(units: u64, expires: u64) -> Self {
        Self {
            units,
            expires,
            spent: 0,
            unowned: false,
        }
    }

    /// Whether the store's failure policy granted it.
    pub(super) fn unowned(&self) -> bool {
        self.unowned
    }

    /// Whether it is on at `now`.
    pub(super) fn on(&self, now: u64) -> bool {
        now < self.expires
    }

    /// The units it holds.
    pub(super) fn units(&self) -> u64 {
        self.units
    }

    /// Takes: `taken` units landed for a decision of `cost` (spent at
    /// once), ending at `expires`, beside what it still holds; `unowned`
    /// if the store's failure policy granted them.
    pub(super) fn take(&mut self, taken: u64, cost: u64, expires: u64, unowned: bool) {
        self.units = self.units.saturating_add(taken.saturating_sub(cost));
        self.spent = cost;
        self.expires = expires;
        self.unowned = unowned;
    }

    /// Spends `cost` if it holds that much and is on at `now`.
    pub(super) fn spend(&mut self, cost: u64, now: u64) -> bool {
        if cost == 0 || self.units < cost || !self.on(now) {
            return false;
        }
        self.units = self.units.saturating_sub(cost);
        self.spent = self.spent.saturating_add(cost);
        true
    }

    /// Gives it up: the units it held (for the caller to give back to the
    /// store, or let lapse).
    pub(super) fn give_back(&mut self) -> u64 {
        self.spent = 0;
        std::mem::take(&mut self.units)
    }

    /// Takes back `units` a refund returns, if it is still on at `now`
    /// and they were spent from it.
    pub(super) fn refund(&mut self, units: u64, now: u64) -> bool {
        if !self.on(now) || self.spent < units {
            return false;
        }
        self.spent = self.spent.saturating_sub(units);
        self.units = self.units.saturating_add(units);
        true
    }
}

/// A refusal the store gave, kept: the key is answered "refused" here
/// until `until` for what costs at least `cost`.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Denial {
    until: u64,
    cost: u64,
}

impl Denial {
    /// Refuses a cost of at least `cost` until `until`.
    pub(super) fn new(until: u64, cost: u64) -> Self {
        Self { until, cost }
    }

    /// The wait it answers a decision of `cost` at `now` with, if it
    /// refuses it.
    pub(super) fn refuses(&self, now: u64, cost: u64) -> Option<u64> {
        (self.until > now && cost >= self.cost).then(|| self.until.saturating_sub(now))
    }

    /// Whether it is over at `now`.
    pub(super) fn over(&self, now: u64) -> bool {
        self.until <= now
    }
}

/// What the store last said of a key's budget: what it had left, and
/// when it was to be whole (local clock): the headers of local decisions.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Budget {
    remaining: u64,
    whole_at: u64,
}

impl Budget {
    /// What `d`, counted at `at`, says of the budget.
    pub(super) fn of(d: &Decision, at: u64) -> Self {
        Self {
            remaining: d.remaining,
            whole_at: at.saturating_add(d.reset_after),
        }
    }

    /// When it is whole (local clock).
    pub(super) fn whole_at(&self) -> u64 {
        self.whole_at
    }
}

/// One key's leases and cached denial.
#[derive(Debug, Default)]
pub(super) struct KeyState {
    /// The lease being spent.
    pub(super) lease: Lease,
    /// A lease taken ahead (see `HotKeys::refill_ahead`), spent once the
    /// current one is out or over.
    pub(super) next: Option<Lease>,
    /// The store's last refusal, answered here while it holds.
    pub(super) denial: Denial,
    /// The store's last word on the key's budget.
    pub(super) budget: Budget,
    /// The units the next lease asks for.
    pub(super) batch: u64,
    /// A lease being taken (for a decision, or ahead): waiters are woken
    /// when it is in.
    pub(super) flight: Option<Arc<Notify>>,
    /// The last lease asked for got no answer (the store failed).
    pub(super) failed: bool,
    /// The store's last refusal of the key had ended by the time it
    /// landed (the key is at a limit that refuses for less than a round
    /// trip, so the denial cache cannot answer): decisions go to the
    /// store side by side until it admits one again.
    pub(super) outrun: bool,
    /// Decisions of the key at the store side by side now (`Step::Aside`).
    pub(super) aside: u32,
    /// How long the store's last refusal of the key was for, and the
    /// cost it refused.
    pub(super) wait: (u64, u64),
    /// How long the key's last call answered by the store itself took
    /// (sent to landed), and when it landed.
    pub(super) rtt: u64,
    pub(super) landed_at: u64,
    /// The store's failure policy, not the store, gave the key's last
    /// answer: the current lease's units (if it was granted) are never
    /// given back to the store, which did not count them (fail-open
    /// counted nothing; a fallback counted them in its own memory, where
    /// they lapse); and until the store itself answers again, the key's
    /// decisions go through the store one by one, so that the policy
    /// answers each at its own cost (a policy's refusal of a lease — a
    /// closed store's, or a fallback memory's share too small for the
    /// batch — says nothing of a smaller cost).
    pub(super) unowned: bool,
}

impl KeyState {
    pub(super) fn idle(&self, now: u64) -> bool {
        self.flight.is_none()
            && !self.lease.on(now)
            && self.denial.over(now)
            && self.next.is_none_or(|next| !next.on(now))
    }

    /// What the store's answer `d`, asked at `sent` and landed at `now`,
    /// says of the key beside its decision: who gave it (`unowned`: the
    /// store's failure policy), the round trip, and whether it refused
    /// for less than that (`outrun`), and for how long and what cost.
    /// A failure policy's answer says nothing of the store's round trip
    /// (it comes after a timeout), and is not counted as one.
    pub(super) fn landed(
        &mut self,
        d: &Decision,
        cost: u64,
        (sent, now): (u64, u64),
        unowned: bool,
    ) {
        self.unowned = unowned;
        self.outrun = !unowned && outrun(d, sent, now);
        if !unowned {
            self.rtt = now.saturating_sub(sent);
            self.landed_at = now;
        }
        if let Outcome::Deny { retry_after } = d.outcome {
            self.wait = (retry_after, cost);
        }
    }

    /// [`aside_cap`] for this key's last round trip.
    pub(super) fn aside_cap(&self, limit: u64, window: u64) -> u32 {
        aside_cap(limit, window, self.rtt)
    }

    /// A refusal of an outrun key made here at `now` for a decision of
    /// `cost`, without asking the store, if its last refusal says what the
    /// store would answer: it refused as much (or less), and the store
    /// last answered the key within eight round trips (a key quiet for
    /// longer may have its budget back, and is asked again).
    pub(super) fn refusal(&self, now: u64, cost: u64, limit: u64) -> Option<Decision> {
        let (wait, refused) = self.wait;
        let recent = now.saturating_sub(self.landed_at) <= self.rtt.max(1).saturating_mul(8);
        if !self.outrun || cost == 0 || cost < refused || cost > limit || !recent {
            return None;
        }
        let wait = wait.max(1);
        Some(Decision {
            outcome: Outcome::Deny { retry_after: wait },
            limit,
            remaining: 0,
            reset_after: self.budget.whole_at.saturating_sub(now).max(wait),
        })
    }

    /// The store refused a decision of `cost` for `wait` at `at`
    /// (capped at `max`): kept as the key's denial.
    pub(super) fn refused(&mut self, d: &Decision, cost: u64, (at, wait, max): (u64, u64, u64)) {
        self.denial = Denial::new(at.saturating_add(wait.min(max)), cost);
        self.budget = Budget::of(d, at);
    }
}

/// One shard's keys and their leases.
#[derive(Default)]
pub(super) struct Keys {
    pub(super) map: HashMap<Box<[u8]>, KeyState>,
    /// When the shard was last swept for idle keys (local clock).
    pub(super) swept: u64,
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

/// Whether `d`, asked for at `sent` and landed at `now`, is a refusal
/// whose wait was over when it landed.
pub(super) fn outrun(d: &Decision, sent: u64, now: u64) -> bool {
    match d.outcome {
        Outcome::Deny { retry_after } => sent.saturating_add(retry_after) <= now,
        Outcome::Allow { .. } | Outcome::Never => false,
    }
}

/// Ends `flight` if it is still `s`'s, waking its waiters; `false` when
/// the key has another flight, or none.
pub(super) fn end_flight(s: &mut KeyState, flight: &Arc<Notify>) -> bool {
    if !s.flight.as_ref().is_some_and(|f| Arc::ptr_eq(f, flight)) {
        return false;
    }
    s.flight = None;
    flight.notify_waiters();
    true
}

#[allow(clippy::panic)]
pub(super) fn unreachable_shards() -> ! {
    // `shards` has SHARDS > 0 entries from construction.
    panic!("hot-key table without shards")
}

/// The local answer of `s` at `now` to a decision of `cost`, if any, for
/// a rule that grants `limit` per `window` (ns).
pub(super) fn answer(
    s: &mut KeyState,
    now: u64,
    cost: u64,
    (limit, window): (u64, u64),
) -> Option<Decision> {
    // The cached denial refuses what costs at least what it refused.
    if let Some(wait) = s.denial.refuses(now, cost) {
        return Some(Decision {
            outcome: Outcome::Deny { retry_after: wait },
            limit,
            remaining: 0,
            reset_after: s.budget.whole_at.saturating_sub(now).max(wait),
        });
    }
    // The current lease is out or over: the one taken ahead, if it is
    // still on, takes its place (what the current one held lapses: given
    // back later, it could credit a later window than the one that
    // counted it).
    if cost > 0 && (s.lease.units < cost || !s.lease.on(now)) {
        if let Some(next) = s.next.take().filter(|next| next.on(now)) {
            s.lease = next;
        }
    }
    if s.lease.spend(cost, now) {
        let ahead = s.next.map_or(0, |next| next.units);
        return Some(Decision {
            outcome: Outcome::Allow { delay: 0 },
            limit,
            remaining: s
                .budget
                .remaining
                .saturating_add(s.lease.units)
                .saturating_add(ahead),
            reset_after: s.budget.whole_at.saturating_sub(now),
        });
    }
    // As many of an outrun key's decisions as take, between them, all that
    // its rate frees are at the store now, and its last answer was a
    // refusal: this one is refused here at once, as the store would most
    // likely refuse it, rather than wait in line behind them (a limiter
    // refuses the excess; it does not queue it). When the store admits
    // one again, the key leases again.
    if s.aside >= s.aside_cap(limit, window) {
        return s.refusal(now, cost, limit);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    /// A key refused for less than a round trip (outrun) is refused here
    /// only as the store would refuse it: a cost at least the one it
    /// refused, at most the limit (above it, the store says `Never`), and
    /// while the store answered within eight round trips (a key quiet for
    /// longer may have its budget back).
    #[test]
    fn a_local_refusal_answers_only_what_the_store_would() {
        let mut s = KeyState::default();
        let d = Decision {
            outcome: Outcome::Deny {
                retry_after: MS / 10,
            },
            limit: 100,
            remaining: 0,
            reset_after: MS,
        };
        // Sent at 1 s, landed 2 ms later: over before it landed.
        s.landed(&d, 1, (1_000 * MS, 1_002 * MS), false);
        assert!(s.outrun);
        let refused = s.refusal(1_003 * MS, 1, 100).unwrap();
        assert_eq!(
            refused.outcome,
            Outcome::Deny {
                retry_after: MS / 10
            }
        );
        assert!(s.refusal(1_003 * MS, 101, 100).is_none(), "above the limit");
        assert!(s.refusal(1_003 * MS, 0, 100).is_none(), "a peek");
        assert!(s.refusal(1_018 * MS, 1, 100).is_some());
        assert!(s.refusal(1_019 * MS, 1, 100).is_none(), "stale");
        // A refusal of 5 says nothing of a cost of 1.
        s.landed(&d, 5, (1_000 * MS, 1_002 * MS), false);
        assert!(s.refusal(1_003 * MS, 1, 100).is_none());
        assert!(s.refusal(1_003 * MS, 5, 100).is_some());
        // A failure policy's answer: neither a round trip nor outrun.
        s.landed(&d, 1, (1_000 * MS, 1_250 * MS), true);
        assert!(!s.outrun);
        assert_eq!(s.rtt, 2 * MS);
    }

    /// Twice what the rate frees in a round trip, from 16 to 256: 20,000 a
    /// second (a burst of 100 over 5 ms) frees 40 in 2 ms; 16 would take
    /// 8,000 a second between them.
    #[test]
    fn decisions_side_by_side_take_what_the_rate_frees() {
        assert_eq!(aside_cap(100, 5 * MS, 2 * MS), 80);
        assert_eq!(aside_cap(10, 2 * MS, 2 * MS), 20);
        assert_eq!(aside_cap(10, 10 * MS, MS / 2), MAX_ASIDE);
        assert_eq!(aside_cap(u64::MAX, 1, u64::MAX), MAX_ASIDE_CAP);
        assert_eq!(aside_cap(10, 0, MS), MAX_ASIDE);
        assert_eq!(aside_cap(10, MS, 0), MAX_ASIDE);
    }
}
