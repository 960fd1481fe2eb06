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

/// One key's lease and cached denial.
#[derive(Debug, Default)]
pub(super) struct KeyState {
    /// Units leased and not spent.
    pub(super) units: u64,
    /// When the lease ends (local clock).
    pub(super) expires: u64,
    /// Until when the key is answered "denied" locally.
    pub(super) denied_until: u64,
    /// The units the next lease asks for.
    pub(super) batch: u64,
    /// What the store had left after the last lease, and when its budget
    /// was to be whole (local clock): the headers of local decisions.
    pub(super) remaining: u64,
    pub(super) whole_at: u64,
    /// Units of the current lease spent (what a local refund may give
    /// back), and the smallest cost the cached denial refuses.
    pub(super) spent: u64,
    pub(super) denied_cost: u64,
    /// A lease being taken (for a decision, or ahead): waiters are woken
    /// when it is in.
    pub(super) flight: Option<Arc<Notify>>,
    /// A lease taken ahead (see `HotKeys::refill_ahead`): its units and
    /// when it ends, spent once the current one is out or over.
    pub(super) next: Option<(u64, u64)>,
    /// The last lease asked for got no answer (the store failed).
    pub(super) failed: bool,
    /// The store's last refusal of the key had ended by the time it
    /// landed (the key is at a limit that refuses for less than a round
    /// trip, so the denial cache cannot answer): decisions go to the
    /// store side by side until it admits one again.
    pub(super) outrun: bool,
    /// Decisions of the key at the store side by side now (`Step::Aside`).
    pub(super) aside: u32,
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
            && self.expires <= now
            && self.denied_until <= now
            && self.next.is_none_or(|(_, end)| end <= now)
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

/// The local answer of `s` at `now` to a decision of `cost`, if any.
pub(super) fn answer(s: &mut KeyState, now: u64, cost: u64, limit: u64) -> Option<Decision> {
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
