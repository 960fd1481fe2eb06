//! One rule of a policy, and its type-erased form.

use std::sync::Arc;

use http::{Request, StatusCode};
use tollgate_core::Limit;

use crate::cost::{Cost, Fixed};
use crate::key::{KeyBuf, KeyExtractor};
use crate::rate_limit::MissingKey;

/// One rule of a [`PolicyLayer`](super::PolicyLayer): a rate limit with
/// its own name, key and cost. The key is explicit: a policy's rules
/// exist to count by different things (API key, address, route, the
/// whole service), so no rule assumes one. (The single-limit layers,
/// `RateLimitLayer`, `QuotaLayer` and `ConcurrencyLayer`, default to
/// `PeerIp`: one budget per client address.)
///
/// The cost is the rule's own too, `Fixed(1)` unless set: give the same
/// cost function to every rule that should weigh requests alike (a rule
/// per address that counts requests, not work, may leave it), and to a
/// `QuotaLayer` beside the policy, which has its own.
#[derive(Clone)]
pub struct RateRule<K, C = Fixed> {
    pub(crate) name: String,
    pub(crate) limit: Limit,
    pub(crate) key: K,
    pub(crate) cost: C,
    pub(crate) missing: MissingKey,
    pub(crate) shadow: bool,
    pub(crate) canary: Option<f64>,
    pub(crate) plans: Vec<(String, Limit)>,
    pub(crate) count_if: Option<CountIf>,
    pub(crate) ladder: Option<Ladder>,
    pub(crate) slow: Option<Slow>,
    pub(crate) challenge: Option<Arc<dyn super::Challenge>>,
    pub(crate) warn_at: Option<f64>,
    pub(crate) routes: Option<crate::Routes>,
    pub(crate) charge_after: Option<crate::rate_limit::Measure>,
    pub(crate) messages: bool,
}

/// An escalation ladder's parameters: strikes, period, first block,
/// longest block.
pub(crate) type Ladder = (
    u32,
    std::time::Duration,
    std::time::Duration,
    std::time::Duration,
);

/// A slowing ladder's parameters: strikes, period, hold, steps (percent).
pub(crate) type Slow = (u32, std::time::Duration, std::time::Duration, Vec<u8>);

/// Which responses a response-aware rule counts.
pub(crate) type CountIf = Arc<dyn Fn(StatusCode) -> bool + Send + Sync>;

impl<K: std::fmt::Debug, C: std::fmt::Debug> std::fmt::Debug for RateRule<K, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateRule")
            .field("name", &self.name)
            .field("limit", &self.limit)
            .field("key", &self.key)
            .field("cost", &self.cost)
            .field("response_aware", &self.count_if.is_some())
            .finish_non_exhaustive()
    }
}

impl<K> RateRule<K, Fixed> {
    /// A rule named `name` (headers, store keys, metrics) enforcing `limit`
    /// per `key`. Defaults: cost 1; a request without this key is refused
    /// (400, gRPC `INVALID_ARGUMENT`); enforced, not shadow.
    pub fn new(name: &str, limit: Limit, key: K) -> Self {
        Self {
            name: name.to_owned(),
            limit,
            key,
            cost: Fixed(1),
            missing: MissingKey::Reject,
            shadow: false,
            canary: None,
            plans: Vec::new(),
            count_if: None,
            ladder: None,
            slow: None,
            challenge: None,
            warn_at: None,
            routes: None,
            charge_after: None,
            messages: false,
        }
    }
}

impl<K, C> RateRule<K, C> {
    /// What a request costs under this rule (default 1).
    pub fn cost<C2>(self, cost: C2) -> RateRule<K, C2> {
        RateRule {
            name: self.name,
            limit: self.limit,
            key: self.key,
            cost,
            missing: self.missing,
            shadow: self.shadow,
            canary: self.canary,
            plans: self.plans,
            count_if: self.count_if,
            ladder: self.ladder,
            slow: self.slow,
            challenge: self.challenge,
            warn_at: self.warn_at,
            routes: self.routes,
            charge_after: self.charge_after,
            messages: self.messages,
        }
    }

    /// Only requests to `routes` are decided by this rule; others pass
    /// it (not counted, no headers from it). An empty set is a build
    /// error.
    pub fn routes(mut self, routes: crate::Routes) -> Self {
        self.routes = Some(routes);
        self
    }

    /// The ladder's first step: once a key has used `share` (above 0, at
    /// most 1) of this rule's capacity, its admitted responses carry
    /// `RateLimit-Warning: "<name>";used=<percent>` — a client that reads
    /// it can slow down before the 429 — and the metric outcome `warned`
    /// counts them.
    pub fn warn_at(mut self, share: f64) -> Self {
        self.warn_at = Some(share);
        self
    }

    /// An escalation ladder on this rule, per key: every request the rule
    /// refuses for now is a strike; `strikes` strikes within `period` block
    /// the key for `block`, each later block twice as long up to
    /// `max_block`. A blocked key is refused (429 with `Retry-After` until
    /// the block ends) before anything else is asked, an idempotent repeat
    /// included; a key not blocked again for as long as the longest block
    /// (or `period`, if longer) after its last block ended starts again
    /// from the first step (see
    /// [`Escalation`](tollgate_core::algorithm::Escalation)). Keyless
    /// requests (a shared fallback key) neither strike nor are blocked.
    ///
    /// The ladder's state is a rule named `"<name>:ladder"` in the
    /// policy's store: the memory store and Redis keep ladders (Redis:
    /// spans up to about 26 days, and a fleet climbs one ladder). A rule
    /// on Redis with the `Closed` failure policy
    /// refuses while Redis is away, and such refusals strike too: pair
    /// ladders with `Open` or `Fallback`. A ladder on an account is a
    /// lever for locking that account out: pair it with one per address.
    pub fn escalate(
        mut self,
        strikes: u32,
        period: std::time::Duration,
        block: std::time::Duration,
        max_block: std::time::Duration,
    ) -> Self {
        self.ladder = Some((strikes, period, block, max_block));
        self
    }

    /// A slowing ladder on this rule, per key (000 §7: "on repeated
    /// overruns we lower the limit"): every request the rule refuses for
    /// now is a strike; `strikes` strikes within `period` put the key one
    /// step down `steps` — each the percent of the rule's rate and burst
    /// it keeps, e.g. `&[50, 25]` — for `hold`, and more strikes on the
    /// last step keep it there. A key climbs back one step per `hold`
    /// once its hold ends. A slowed key is still decided by the rule, at
    /// a raised cost: on a step keeping `p` percent a request of cost `c`
    /// is charged `c × 100 / p` (a request costlier than the lowered
    /// burst that fits the whole burst is charged the whole burst), and
    /// its `RateLimit` and `RateLimit-Policy` fields (and the legacy
    /// headers) state the lowered limit and what remains of it (see
    /// [`Escalation::slow_down`](tollgate_core::algorithm::Escalation::slow_down)).
    /// The refusal that puts a key a step down asks it to wait as long as
    /// the raised cost takes to free (its wait for the old cost, plus the
    /// difference at the rule's steady rate; a token bucket's, until it is
    /// whole), so that a client that keeps to `Retry-After` is not refused
    /// again at the raised cost. Keyless
    /// requests (a shared fallback key) neither strike nor are slowed.
    ///
    /// The ladder's state is a rule named `"<name>:slow"` in the
    /// policy's store (apart from [`escalate`](Self::escalate)'s
    /// `"<name>:ladder"`, so a rule that changes kinds starts afresh); a
    /// rule has one ladder: one that blocks or one that slows (both is a
    /// build error naming `slow_down`). Steps: 1 to 8 percentages, each
    /// below the one before and dividing 100 (50, 25, 20, 10, 5, 4, 2, 1),
    /// each keeping at least one request of the rule's limit (and each
    /// plan's; a build error naming `steps` otherwise); on Redis, `hold`
    /// × steps at most about 26 days.
    pub fn slow_down(
        mut self,
        strikes: u32,
        period: std::time::Duration,
        hold: std::time::Duration,
        steps: &[u8],
    ) -> Self {
        self.slow = Some((strikes, period, hold, steps.to_vec()));
        self
    }

    /// A challenge step, between this rule's refusal and a block: past
    /// the limit, a refusal carries a challenge (header
    /// `Tollgate-Challenge`) bound to this rule, the client's key, the
    /// requester that was refused (its address by default; see
    /// [`challenge_requester`](super::PolicyLayerBuilder::challenge_requester))
    /// and a time window, e.g. a [`ProofOfWork`](super::ProofOfWork). A request
    /// that carries a solution (header `Tollgate-Solution`; one per
    /// challenged rule) passes this rule without being counted by it —
    /// the other rules still decide — and a challenge passes once: its
    /// use is remembered in the policy's store (a rule named
    /// `"<name>:challenge"`) for the challenge's lifetime, so a fleet
    /// refuses a replay too, and given back if another rule refuses the
    /// request. A request without one is refused as before and, with a
    /// ladder, strikes toward the block; a blocked key gets no challenge,
    /// and no solution passes a block. So a real user caught by a limit
    /// can go on before the block by paying some CPU, while a script gets
    /// one more try per challenge (a [`ProofOfWork`](super::ProofOfWork)
    /// issues one per key, requester and window), and cannot use up the
    /// passes of another requester. At most four `Tollgate-Solution`
    /// headers of a request are checked. If the store cannot record a use
    /// (it fails, or a full memory store pools new keys), the solution
    /// passes no rule: the rule decides as without one.
    pub fn challenge(mut self, challenge: impl super::Challenge) -> Self {
        self.challenge = Some(Arc::new(challenge));
        self
    }

    /// Makes the rule response-aware: only requests whose response `f`
    /// accepts count against it — e.g. failed logins, `|s| s == 401 ||
    /// s == 403`. A gRPC answer is tested by the status its `grpc-status`
    /// maps to ([`Completion::status`](crate::outcome::Completion::status):
    /// `UNAUTHENTICATED` is 401). The cost is taken when the request arrives, so that a
    /// burst of parallel attempts cannot overrun the limit while their
    /// responses are pending, and given back once the response shows it
    /// does not count. (A request whose service errs, or that is
    /// cancelled, keeps its charge.) Over its limit, the rule refuses
    /// every request — a correct password included — until it recovers.
    pub fn count_if<F>(mut self, f: F) -> Self
    where
        F: Fn(StatusCode) -> bool + Send + Sync + 'static,
    {
        self.count_if = Some(Arc::new(f));
        self
    }

    /// Charges what a request really cost under this rule once its
    /// response is known, measured by `measure`, as
    /// [`RateLimitLayerBuilder::charge_after`](crate::rate_limit::RateLimitLayerBuilder::charge_after)
    /// does: the request is admitted on its estimate (the rule's cost); a
    /// response that cost less gives the difference back, one that cost
    /// more leaves a debt the key's next request pays on top of its cost
    /// (or, when more is owed than the rule's limit leaves room for, is
    /// refused until enough of it is freed). A request that another rule
    /// of the policy refuses pays none of a debt: what it took is owed
    /// again. A key a slowing ladder put on a lower step settles at the
    /// step's price (each unit it really cost counts what the step charges
    /// a unit). A refusal for a debt is a refusal like any other: a strike
    /// on the rule's ladder. Debts are kept per plan by this process (see
    /// the layer's method for the bounds); a reload that keeps the rule
    /// alike keeps them (and what its requests in flight owe later), one
    /// that changes it forgets them. A rule in shadow mode, or a key a
    /// canary leaves out, measures nothing. With
    /// [`count_if`](Self::count_if) (which also settles on the response)
    /// it is a build error naming `charge_after`; so is a `per` of zero.
    pub fn charge_after(mut self, measure: crate::rate_limit::Measure) -> Self {
        self.charge_after = Some(measure);
        self
    }

    /// Counts the messages of upgraded connections (WebSockets) in this
    /// rule's budget too (default off), as
    /// [`RateLimitLayerBuilder::messages`](crate::rate_limit::RateLimitLayerBuilder::messages)
    /// does: an admitted upgrade request carries a
    /// [`MessageBudget`](crate::rate_limit::MessageBudget) bound to this
    /// rule (at the request's plan) and its key. Where several rules of a
    /// policy, or several layers, count messages, the one budget spends on
    /// all of them, at the whole rate (a slowing ladder's step slows
    /// requests, not messages). A key this rule only watches (shadow, or a
    /// canary that leaves it out) is not offered this rule's budget; a
    /// request a solved challenge passed past the rule is.
    pub fn messages(mut self, on: bool) -> Self {
        self.messages = on;
        self
    }

    /// The limit of this rule for requests on plan `plan` (see
    /// [`plan_from_extension`](super::PolicyLayerBuilder::plan_from_extension)
    /// and its siblings); requests on no plan, or on one the rule does not
    /// name, get the rule's own limit. Each plan keeps its own state, so a
    /// key whose plan changes is judged by its new plan from its next
    /// request on (and a client that can switch plans gets one budget per
    /// plan: take the plan from authentication, not from what the client
    /// sends).
    ///
    /// Make the rule's own limit the **tightest**: it is what a request
    /// gets whose plan is missing or unknown (an unauthenticated path, a
    /// stripped header), so a default looser than a named plan rewards
    /// removing the plan.
    pub fn plan(mut self, plan: &str, limit: Limit) -> Self {
        self.plans.retain(|(p, _)| p != plan);
        self.plans.push((plan.to_owned(), limit));
        self
    }

    /// What to do with a request this rule finds no key in (default:
    /// [`MissingKey::Reject`]). [`MissingKey::Skip`] leaves such a request
    /// to the other rules, e.g. a per-user rule for anonymous traffic.
    pub fn on_missing_key(mut self, missing: MissingKey) -> Self {
        self.missing = missing;
        self
    }

    /// Shadow mode: the rule decides and counts (metrics
    /// `outcome="shadow_limited"`), but never holds a request back and
    /// sends no headers that would make clients back off.
    pub fn shadow(mut self, shadow: bool) -> Self {
        self.shadow = shadow;
        self
    }

    /// A canary: the rule is enforced for a share of keys (0.0 to 1.0)
    /// and runs in [shadow](Self::shadow) for the rest. Which keys are in
    /// the share is decided by a keyed hash of the rule's name and the
    /// key, so it is the same on every instance and across restarts, and
    /// a key stays in (or out) as the share grows: raising 0.05 to 0.25
    /// keeps the first 5 % enforced.
    pub fn canary(mut self, share: f64) -> Self {
        self.canary = Some(share);
        self
    }
}

/// A rule's key and cost, with the request body type fixed and the
/// extractor types erased, so rules of different types share one list.
pub(crate) trait DynRule<B>: Send + Sync {
    fn key(&self, req: &Request<B>, key: &mut KeyBuf) -> Option<()>;
    fn cost(&self, req: &Request<B>) -> u64;
}

pub(crate) struct Erased<K, C> {
    pub(crate) key: K,
    pub(crate) cost: C,
}

impl<B, K: KeyExtractor<B>, C: Cost<B>> DynRule<B> for Erased<K, C> {
    fn key(&self, req: &Request<B>, key: &mut KeyBuf) -> Option<()> {
        self.key.extract(req, key)
    }

    fn cost(&self, req: &Request<B>) -> u64 {
        self.cost.cost(req)
    }
}
