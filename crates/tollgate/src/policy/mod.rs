//! Policies: several rate limits decided as one.
//!
//! A [`PolicyLayer`] holds an ordered list of rules ([`RateRule`]), each
//! with its own name, limit, key and cost — per API key, per client IP,
//! per route, global. A request passes only if every rule admits it.
//! When one rule denies, what the others consumed is **refunded**, so a
//! request that was not served costs no rule anything; two stacked
//! [`RateLimitLayer`](crate::RateLimitLayer)s, by contrast, charge the
//! outer rule for requests the inner one denies.
//!
//! - **Headers** list every enforced rule that decided the request, in
//!   order, in one `RateLimit-Policy` and one `RateLimit` field:
//!   `RateLimit-Policy: "per-key";q=20;w=2, "per-ip";q=400;w=4` (a rule
//!   skipped for a missing key, one whose store failed, and one only
//!   watching are left out). Legacy `X-RateLimit-*` headers describe the
//!   rule a 429 names, else the one with the least left.
//! - **A denial** names the rule that holds the request back: one that can
//!   never admit it (a cost above its capacity) first, else the one that
//!   asks for the longest wait, whose wait is the `Retry-After`. The
//!   items of rules refunded for it show their budget after the refund
//!   (`r`), and as `t` the time they answered before it: an upper bound.
//! - **Plans**: a rule can give each plan (free, pro, enterprise, ...) its
//!   own limit ([`RateRule::plan`]); the request's plan comes from a
//!   [`Plan`] extension that authentication sets, a header (demos only),
//!   or a closure. Each plan keeps its own state, so a key that changes
//!   plan is judged by the new one from its next request; an unknown plan
//!   is the default (the rule's own limit).
//! - **Response-aware** rules ([`RateRule::count_if`]) count only the
//!   requests whose response they are told to — failed logins per
//!   account and per address, say. The cost is taken up front (parallel
//!   attempts cannot overrun the limit) and given back when the response
//!   does not count. The test sees the HTTP status, or for a gRPC answer
//!   the status its `grpc-status` maps to ([`Completion::status`]:
//!   `UNAUTHENTICATED` is 401, `PERMISSION_DENIED` 403), so one test
//!   serves HTTP and gRPC; a gRPC status sent in trailers after a
//!   streamed body is not seen (the answer counts as 200).
//!
//! [`Completion::status`]: crate::outcome::Completion::status
//! - **Idempotent repeats**
//!   ([`idempotency`](PolicyLayerBuilder::idempotency)): a request sent
//!   again with the same `Idempotency-Key` by the same client within a
//!   TTL is served uncharged; concurrent duplicates race on one atomic
//!   store decision, so exactly one is charged. A first request takes its
//!   marker only once the rules admit it, so a refused one leaves nothing
//!   for a duplicate to pass on; a store that cannot record a marker (a
//!   full memory store) charges the repeats too.
//! - **Warnings** ([`RateRule::warn_at`]): past a share of a rule's
//!   capacity, admitted responses carry `RateLimit-Warning:
//!   "<rule>";used=<percent>`, the ladder's first step before the 429.
//! - **Escalation ladders** ([`RateRule::escalate`]): each request a rule
//!   refuses is a strike against the key; enough strikes within a period
//!   block the key (429 until the block ends, before any rule is asked)
//!   for a time that doubles per block up to a cap, and a key out of
//!   trouble long enough starts over. The ladder lives in the store, so
//!   a fleet on Redis escalates together.
//! - **Challenges** ([`RateRule::challenge`]), the step between a refusal
//!   and a block: past the limit, the 429 carries a challenge bound to the
//!   rule, the key and a time window — a [`ProofOfWork`], or any
//!   [`Challenge`] — and a request with its solution passes the rule once
//!   (the store remembers used solutions, fleet-wide). Unsolved refusals
//!   still strike toward the block.
//! - **Decision logs** ([`decision_log`](PolicyLayerBuilder::decision_log)):
//!   a sampled `tracing` event per rule (target `tollgate::decision`):
//!   rule, outcome, remaining, reason, and a keyed hash of the key.
//! - **Audit trails** ([`audit`](PolicyLayerBuilder::audit)): refusals by
//!   chosen rules go to an [`AuditSink`](crate::observe::AuditSink), e.g.
//!   a Redis stream that never delays a request.
//! - **Access lists** ([`AccessList`]), checked before any rule: keys
//!   and IP networks on an allow list skip every limit, those on a deny
//!   list get 403 (gRPC `PERMISSION_DENIED`) at once, and a list can deny
//!   by default for critical routes.
//! - **Pacing** rules (the leaky bucket) delay the request by the longest
//!   delay any of them asks; a request cancelled while it waits gives
//!   every rule its cost back, and its idempotency marker.
//! - **Shadow and canary rules never refuse**, a keyless request
//!   included: it is left to the other rules.
//! - **Shadow** rules decide and count, but never deny and send no
//!   headers. A **canary** ([`RateRule::canary`]) enforces a new rule for a
//!   share of keys, chosen by a keyed hash of the rule's name and the key
//!   (the same on every instance), and shadows it for the rest.
//! - **Stores**: the in-memory store decides every rule in `call`, with no
//!   allocation for the decisions of up to [`MAX_RULES`] rules (the header
//!   values are allocated, as for one rule), and refunds at once on a
//!   denial. The Redis store decides the rules together
//!   ([`Limiter::decide_joint`](tollgate_core::Limiter::decide_joint);
//!   other networked stores, `HotKeys` and the tiered store among them,
//!   decide them side by side, one call each, then refund on a denial):
//!   - **Redis, standalone or Sentinel**: one script call for all the
//!     rules, atomic. Either every rule is charged, or — an enforced rule
//!     denies — none is, so a denial needs no refund and no other request
//!     ever sees a charge that is taken back. (Refunds remain for a paced
//!     request cancelled while it waits, and for response-aware rules.)
//!   - **Redis Cluster**: rules whose keys share a hash slot are one call,
//!     atomic as above. Each rule's key carries its own hash tag, so rules
//!     seldom share a slot (about one pair in 16,384): on Cluster the rules
//!     are in practice decided side by side, one call each, and what they
//!     charged is refunded on a denial. Between that charge and its refund, another request of the
//!     same key may see the rule's budget lower than it ends up: a denied
//!     request can briefly hold back a concurrent one, never let one more
//!     through.
//!   - A request cancelled during the call keeps what it was charged, as a
//!     single rule's does.
//! - A refund gives back what the rule's algorithm can give back: exact
//!   for GCRA, token bucket, fixed window, leaky bucket and sliding window
//!   counter; the sliding window log gives back its oldest units (see
//!   [`SlidingWindowLog`](tollgate_core::SlidingWindowLog)).
//!
//! ```
//! use http::{Request, Response, StatusCode};
//! use tower::{service_fn, Layer, ServiceExt};
//! use tollgate::key::{Global, Header};
//! use tollgate::policy::{PolicyLayer, RateRule};
//! use tollgate::{Limit, Rate};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let layer = PolicyLayer::builder()
//!     // 10 a second per API key, bursts of 20...
//!     .rule(RateRule::new(
//!         "per-key",
//!         Limit::gcra(Rate::per_second(10), 20),
//!         Header::named("x-api-key")?,
//!     ))
//!     // ...and 2 a second for the whole service.
//!     .rule(RateRule::new("global", Limit::gcra(Rate::per_second(2), 2), Global))
//!     .build()?;
//! let svc = layer.layer(service_fn(|_req: Request<String>| async {
//!     Ok::<_, std::convert::Infallible>(Response::new(String::new()))
//! }));
//! let call = |key: &str| {
//!     let req = Request::get("/").header("x-api-key", key).body(String::new());
//!     svc.clone().oneshot(req.unwrap())
//! };
//! assert_eq!(call("a").await?.status(), StatusCode::OK);
//! let res = call("b").await?;
//! assert_eq!(
//!     res.headers()["ratelimit-policy"],
//!     "\"per-key\";q=20;w=2, \"global\";q=2;w=1"
//! );
//! // The global rule is spent: the third call is refused, and "c"'s own
//! // budget is refunded.
//! let res = call("c").await?;
//! assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
//! assert_eq!(res.headers()["ratelimit"], "\"per-key\";r=20;t=0, \"global\";r=0;t=1");
//! # Ok(())
//! # }
//! ```

pub(crate) mod access;
mod challenge;
mod decide;
mod future;
mod idempotency;
mod layer;
pub(crate) mod plan;
mod rule;
mod service;
mod shared;
#[cfg(test)]
pub(crate) mod tests;
mod walk;

pub use access::{Access, AccessList};
pub use challenge::{Challenge, ProofOfWork, CHALLENGE_HEADER, SOLUTION_HEADER};
pub use future::PolicyFuture;
pub use layer::{PolicyLayer, PolicyLayerBuilder};
pub use plan::Plan;
pub use rule::RateRule;
pub use service::PolicyService;
pub use shared::MAX_RULES;
