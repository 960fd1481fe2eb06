//! The policy layer and its builder.

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response};
use tollgate_core::{ConfigError, EscalationRule, Rule, Store};
use tollgate_memory::MemoryStore;
use tower_layer::Layer;

use super::access::{AccessList, Listed};
use super::idempotency::Idempotency;
use super::plan::{Named, Plan, Plans, Source};
use super::rule::{DynRule, Erased, RateRule};
use super::service::PolicyService;
use super::shared::{canary, Bound, Current, RejectFn, Shared, MAX_RULES};
use crate::cost::Cost;
use crate::headers::{set_policy, Headers};
use crate::key::{KeyExtractor, Keying};
use crate::observe::Metrics;
use crate::rate_limit::{MissingKey, Responder};
use crate::rejection::{LimitKind, OnStoreError, Rejected, Rendered};

/// Several rate limits decided as one: a request passes only if every
/// rule passes, and what the passing rules consumed is refunded when
/// another denies. See the [module docs](super).
///
/// Clones of a layer, and every service built from them, share one
/// policy, which [`replace`](Self::replace) swaps (a reload).
///
/// Why `B`, the request body type, is in the type (the other layers have
/// it only in their `Service` impls): a policy holds a list of rules, each
/// with a key extractor and a cost function of its own type, which it
/// keeps as trait objects so that rules can be added one by one and
/// swapped on reload. Those traits read a `Request<B>`, and a trait object
/// must name `B`. So one `PolicyLayer` serves one body type: build one per
/// stack (an axum router's `Body`, a tonic server's `tonic::body::Body`),
/// on the same store if they are to share budgets.
pub struct PolicyLayer<B, St: Store = MemoryStore> {
    pub(super) current: Arc<Current<B, St::Limiter>>,
}

impl<B, St: Store> Clone for PolicyLayer<B, St> {
    fn clone(&self) -> Self {
        Self {
            current: Arc::clone(&self.current),
        }
    }
}

impl<B, St: Store> fmt::Debug for PolicyLayer<B, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shared = self.current.load();
        let names: Vec<&str> = shared.rules.iter().map(|r| &*r.responder.rule).collect();
        f.debug_struct("PolicyLayer")
            .field("rules", &names)
            .finish_non_exhaustive()
    }
}

impl<B> PolicyLayer<B, MemoryStore> {
    /// Starts an empty policy on a new in-memory store, with the standard
    /// headers on.
    pub fn builder() -> PolicyLayerBuilder<B, MemoryStore> {
        PolicyLayerBuilder {
            rules: Vec::new(),
            store: MemoryStore::new(),
            headers: true,
            legacy_headers: false,
            rejection: None,
            access: None,
            plan_source: None,
            idempotency: None,
            log: None,
            route_label: false,
            on_store_error: OnStoreError::default(),
            requester: Arc::new(Erased {
                key: crate::key::PeerIp::new(),
                cost: crate::cost::Fixed(1),
            }),
            canary_secret: None,
            audit_secret: None,
            audit: None,
            audit_from_file: false,
            audit_per_second: 1_000,
            no_rules: false,
        }
    }
}

impl<B, St: Store> PolicyLayer<B, St> {
    /// The store's limiter of each rule, in order (e.g. to read a key's
    /// budget in a test or a dashboard), of the policy now.
    pub fn limiters(&self) -> Vec<St::Limiter> {
        let shared = self.current.load();
        shared.rules.iter().map(|r| r.limiter.clone()).collect()
    }
}

impl<B, St: Store> PolicyLayer<B, St> {
    /// Makes `next`'s policy this layer's — and that of every clone and
    /// every service built from them — from each service's next request:
    /// a reload. A request decided before goes on with the policy that
    /// decided it (its refunds and response-aware settlement included),
    /// so none is dropped or charged twice. Build `next` on the same store
    /// through [`Store::rebinding`](tollgate_core::Store::rebinding) so
    /// that rules keep their state: an unchanged rule goes on exactly
    /// where it was, a changed one from its keys' states where their
    /// meaning allows ([`Algorithm::keeps_state_of`](tollgate_core::Algorithm::keeps_state_of)).
    /// What keys owe to rules that charge after the response
    /// ([`RateRule::charge_after`](super::RateRule::charge_after)) moves to
    /// `next`'s like rules, as do debts its requests in flight incur
    /// later. `next`'s policy is this layer's from now on: serve through
    /// one of the two (a policy installed again, after another, is current
    /// again and keeps what it is owed). Replacements are one at a time.
    pub fn replace(&self, next: &PolicyLayer<B, St>) {
        let shared = next.current.load();
        self.current.replace(shared);
    }

    /// The names of the policy's rules now, in order.
    pub fn rule_names(&self) -> Vec<String> {
        let shared = self.current.load();
        shared
            .rules
            .iter()
            .map(|r| r.responder.rule.to_string())
            .collect()
    }
}

impl<S, B, St: Store> Layer<S> for PolicyLayer<B, St> {
    type Service = PolicyService<S, B, St>;

    fn layer(&self, inner: S) -> Self::Service {
        PolicyService {
            inner,
            current: Arc::clone(&self.current),
        }
    }
}

/// One rule, waiting for the store it will be bound to.
struct Unbound<B> {
    name: String,
    limit: tollgate_core::Limit,
    rule: Box<dyn DynRule<B>>,
    missing: MissingKey,
    shadow: bool,
    canary: Option<f64>,
    plans: Vec<(String, tollgate_core::Limit)>,
    count_if: Option<super::rule::CountIf>,
    ladder: Option<super::rule::Ladder>,
    slow: Option<super::rule::Slow>,
    challenge: Option<Arc<dyn super::Challenge>>,
    warn_at: Option<f64>,
    routes: Option<crate::Routes>,
    charge_after: Option<crate::rate_limit::Measure>,
    messages: bool,
}

/// The most plans one policy knows.
const MAX_PLANS: usize = 32;

/// Builds a [`PolicyLayer`]; see [`PolicyLayer::builder`].
pub struct PolicyLayerBuilder<B, St> {
    rules: Vec<Unbound<B>>,
    store: St,
    headers: bool,
    legacy_headers: bool,
    rejection: Option<RejectFn>,
    access: Option<AccessList>,
    plan_source: Option<Source<B>>,
    idempotency: Option<(String, Box<dyn DynRule<B>>, std::time::Duration)>,
    log: Option<crate::observe::DecisionLog>,
    audit: Option<(Arc<dyn crate::observe::AuditSink>, Vec<String>)>,
    /// The audit sink is a policy file's (code has not set one since).
    audit_from_file: bool,
    audit_per_second: u32,
    route_label: bool,
    on_store_error: OnStoreError,
    requester: Arc<dyn DynRule<B>>,
    canary_secret: Option<Arc<[u8]>>,
    audit_secret: Option<Arc<[u8]>>,
    /// A policy of no rules builds (a file whose limits are all in other
    /// sections: its access lists and the rest still apply).
    no_rules: bool,
}

impl<B, St> fmt::Debug for PolicyLayerBuilder<B, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.rules.iter().map(|r| r.name.as_str()).collect();
        f.debug_struct("PolicyLayerBuilder")
            .field("rules", &names)
            .finish_non_exhaustive()
    }
}

impl<B, St> PolicyLayerBuilder<B, St> {
    /// Adds a rule; rules are decided, and listed in headers, in the order
    /// they are added (at most [`MAX_RULES`]).
    pub fn rule<K, C>(mut self, rule: RateRule<K, C>) -> Self
    where
        K: KeyExtractor<B>,
        C: Cost<B>,
    {
        self.rules.push(Unbound {
            name: rule.name,
            limit: rule.limit,
            rule: Box::new(Erased {
                key: rule.key,
                cost: rule.cost,
            }),
            missing: rule.missing,
            shadow: rule.shadow,
            canary: rule.canary,
            plans: rule.plans,
            count_if: rule.count_if,
            ladder: rule.ladder,
            slow: rule.slow,
            challenge: rule.challenge,
            warn_at: rule.warn_at,
            routes: rule.routes,
            charge_after: rule.charge_after,
            messages: rule.messages,
        });
        self
    }

    /// Where every rule's state lives (default: a new [`MemoryStore`]).
    pub fn store<St2: Store>(self, store: St2) -> PolicyLayerBuilder<B, St2> {
        PolicyLayerBuilder {
            rules: self.rules,
            store,
            headers: self.headers,
            legacy_headers: self.legacy_headers,
            rejection: self.rejection,
            access: self.access,
            plan_source: self.plan_source,
            idempotency: self.idempotency,
            log: self.log,
            route_label: self.route_label,
            audit: self.audit,
            audit_from_file: self.audit_from_file,
            audit_per_second: self.audit_per_second,
            on_store_error: self.on_store_error,
            requester: self.requester,
            canary_secret: self.canary_secret,
            audit_secret: self.audit_secret,
            no_rules: self.no_rules,
        }
    }

    /// Lets a policy of no rules build: a policy file whose limits are all
    /// in its other sections.
    #[cfg(feature = "config")]
    pub(crate) fn allow_no_rules(mut self) -> Self {
        self.no_rules = true;
        self
    }

    /// A secret (16 to 64 bytes, the same on every instance) that audit
    /// records' key fingerprints are made with, so that a fleet's records
    /// of one client agree ("who was blocked 40 times today" across
    /// instances and restarts). Without one, fingerprints are per process.
    /// Either way no record holds a raw key. Errors name `audit_secret`.
    pub fn audit_secret(mut self, secret: &[u8]) -> Self {
        self.audit_secret = Some(secret.into());
        self
    }

    /// A secret (16 to 64 bytes, the same on every instance) mixed into
    /// which keys a [canary](super::RateRule::canary) enforces. Without
    /// one, membership is a hash of the rule's name and the key, which
    /// anyone who knows the rule's name (it is in `RateLimit-Policy`) can
    /// compute, and a client that picks its own key (an API key not yet
    /// checked) can pick one outside the share for the whole rollout.
    /// Errors name `canary_secret`. (A keyless request is never in a
    /// canary's share: while the share is below 1, a canaried rule lets it
    /// through as if it were shadowed.)
    pub fn canary_secret(mut self, secret: &[u8]) -> Self {
        self.canary_secret = Some(secret.into());
        self
    }

    /// Who a rule's challenge is issued to (default: [`PeerIp`](crate::key::PeerIp),
    /// the connection's address; behind proxies,
    /// [`ClientIp`](crate::key::ClientIp) with the trusted ones). A
    /// challenge, and the pass its solution buys, belong to the requester
    /// that was refused: one solved from another address does not pass,
    /// and uses up nothing of the owner's. So an attacker who locked an
    /// account and solves its challenges first takes no pass from the
    /// account's owner on the owner's own network.
    pub fn challenge_requester<K: KeyExtractor<B>>(mut self, key: K) -> Self {
        self.requester = Arc::new(Erased {
            key,
            cost: crate::cost::Fixed(1),
        });
        self
    }

    /// What a rule does when the store answers it with an error (default:
    /// [`OnStoreError::Admit`], the rule admits; `Refuse`: the rule refuses
    /// as a closed store does, and the others are given back what they
    /// charged).
    pub fn on_store_error(mut self, on: OnStoreError) -> Self {
        self.on_store_error = on;
        self
    }

    /// An audit trail: every refusal by one of the rules named in `rules`
    /// (each that said no to a refused request, a block, a 400 for a
    /// missing key; shadow and canary-watched rules refuse nothing) is
    /// handed to `sink` —
    /// e.g. a Redis stream (`RedisAudit`, from `RedisStore::audit_stream`,
    /// which never delays a request). The access list's name in `rules`
    /// records its denials too (reason `denied`, the key a fingerprint of
    /// the list's key header, else of the client address). Errors name the
    /// field `audit` (a name no rule or access list has).
    ///
    /// A client that floods refused requests is recorded once per rule
    /// and second, its repeats counted in
    /// `tollgate_audit_folded_total{rule}`; and at most
    /// [`audit_per_second`](Self::audit_per_second) records of each audited
    /// rule (and access list) go to the sink each second, the rest counted
    /// in `tollgate_audit_suppressed_total{rule}` — at most that figure
    /// times the audited names in all. So refusals, cheap to make, do not
    /// turn into as many writes (on Redis, on the connection the decisions
    /// use), and a flood on one rule does not silence another's records.
    pub fn audit<A: crate::observe::AuditSink>(mut self, sink: A, rules: &[&str]) -> Self {
        let rules = rules.iter().map(|r| (*r).to_owned()).collect();
        self.audit = Some((Arc::new(sink), rules));
        self.audit_from_file = false;
        self
    }

    /// Marks the audit sink as a policy file's: one its `[audit] stream`
    /// may replace, where a sink code set stays.
    pub(crate) fn audit_from_file(mut self) -> Self {
        self.audit_from_file = self.audit.is_some();
        self
    }

    /// Whether the audit sink is a policy file's (see
    /// [`audit_from_file`](Self::audit_from_file)).
    pub(crate) fn audits_as_the_file_says(&self) -> bool {
        self.audit_from_file
    }

    /// At most `n` audit records a second for each audited rule or access
    /// list of this policy (default 1,000; at least 1, else `build` fails
    /// naming `audit`).
    pub fn audit_per_second(mut self, n: u32) -> Self {
        self.audit_per_second = n;
        self
    }

    /// Sampled decision logs (see [`DecisionLog`](crate::observe::DecisionLog)):
    /// one `tracing` event per rule that decided a sampled request.
    /// Errors name the field `decision_log` (shares from 0 to 1).
    pub fn decision_log(mut self, log: crate::observe::DecisionLog) -> Self {
        self.log = Some(log);
        self
    }

    /// Idempotent repeats go uncharged: a `POST` or `PATCH` sent again
    /// with the same `Idempotency-Key` by the same client (`client`'s key)
    /// to the same route (axum's matched route, else the normalised path),
    /// with the same body as far as its headers say (`Content-Length`,
    /// `Content-Type`, and RFC 9530's `Content-Digest` and `Repr-Digest`
    /// when sent), within `ttl` (at most a day) of the first, is let
    /// through without charging any rule — the service answers it from its
    /// idempotency store. The layer does not read the body itself (it
    /// would hold every body before deciding, refused ones too), so the
    /// body's scope is what the client declares: a padded body of the same
    /// length, or a digest that was never checked, passes as a repeat —
    /// which is why the service must answer repeats from its own store. A
    /// request that declares neither a length nor a digest (chunked, most
    /// gRPC calls) carries no marker and is charged. For a stricter scope,
    /// make `client` a tuple of extractors, e.g. the API key and a header
    /// your clients must send. Concurrent duplicates race on one atomic
    /// store decision, so exactly one of them is charged. A first request
    /// that the rules refuse, that the service answers with a 4xx or 5xx
    /// (by its head: a gRPC status in trailers is not seen) or an error,
    /// or that is cancelled before its response, gives its marker back (a
    /// retry of it is charged; on Redis the give-back is asynchronous, so
    /// a retry sent at once may still find it), and a request
    /// whose marker the store could not read or record — it failed, and
    /// its failure policy answered instead — is charged like any other,
    /// whatever that policy is. Only for services that deduplicate by
    /// `Idempotency-Key` on every `POST`/`PATCH` route behind the layer,
    /// per the same client as `client`: a route that ignores the header
    /// would serve a repeat for free. The marker is a rule named `name` in
    /// the policy's store.
    pub fn idempotency<K>(mut self, name: &str, client: K, ttl: std::time::Duration) -> Self
    where
        K: KeyExtractor<B>,
    {
        let client: Box<dyn DynRule<B>> = Box::new(Erased {
            key: client,
            cost: crate::cost::Fixed(1),
        });
        self.idempotency = Some((name.to_owned(), client, ttl));
        self
    }

    /// Reads a request's plan from its [`Plan`] extension, set by
    /// authentication middleware: the way to choose plans in production.
    pub fn plan_from_extension(mut self) -> Self {
        self.plan_source = Some(Source::Named(Named::Extension));
        self
    }

    /// Reads a request's plan from header `name`. Only for demos and
    /// trusted internal callers: a client that sets the header chooses its
    /// own plan. Errors name the field `header`.
    pub fn plan_from_header(mut self, name: &str) -> Result<Self, ConfigError> {
        self.plan_source = Some(Source::Named(Named::Header(crate::key::header_name(name)?)));
        Ok(self)
    }

    /// Chooses a request's plan with `f` (e.g. from a claim of a token
    /// another layer verified).
    pub fn plan_from<F>(mut self, f: F) -> Self
    where
        F: Fn(&Request<B>) -> Option<Plan> + Send + Sync + 'static,
    {
        self.plan_source = Some(Source::Fn(Arc::new(f)));
        self
    }

    /// Allow and deny lists, checked before any rule: an allowed request
    /// skips every limit, a denied one gets 403 at once.
    pub fn access(mut self, list: AccessList) -> Self {
        self.access = Some(list);
        self
    }

    /// Whether to send `RateLimit-Policy` and `RateLimit` (default on).
    pub fn headers(mut self, on: bool) -> Self {
        self.headers = on;
        self
    }

    /// Also counts decisions by route: `tollgate_route_requests_total{rule,
    /// route, outcome}` (outcomes `allowed`, `limited`, `too_costly`,
    /// `shadow_limited`), where `route` is axum's matched route (e.g.
    /// `/api/items/{id}`: a template, so the series stay few) or
    /// `unmatched` (default off). A separate name from
    /// `tollgate_requests_total`, so sums of that one never count a request
    /// twice. The route is only known per request: each thread keeps the
    /// counters it used lately and looks each up in the metrics registry
    /// again after a few thousand counts, so a recorder installed after
    /// traffic began, or a series an exporter dropped while idle, is found
    /// again within that many counts.
    #[cfg(feature = "axum")]
    pub fn route_label(mut self, on: bool) -> Self {
        self.route_label = on;
        self
    }

    /// Whether to send `X-RateLimit-Limit`, `-Remaining` and `-Reset`, for
    /// the most restrictive rule (default off).
    pub fn legacy_headers(mut self, on: bool) -> Self {
        self.legacy_headers = on;
        self
    }

    /// Builds the HTTP rejection yourself (gRPC requests keep the standard
    /// `RESOURCE_EXHAUSTED` answer). The layer adds the rate-limit headers
    /// and `Retry-After` to what it returns.
    pub fn rejection<F>(mut self, f: F) -> Self
    where
        F: Fn(&Rejected) -> Response<Bytes> + Send + Sync + 'static,
    {
        self.rejection = Some(Arc::new(f));
        self
    }
}

impl<B, St: Store> PolicyLayerBuilder<B, St> {
    /// Validates every rule and binds it to the store. Errors name the
    /// field: `rules` for the list, or the rule's own field.
    pub fn build(self) -> Result<PolicyLayer<B, St>, ConfigError> {
        if self
            .canary_secret
            .as_ref()
            .is_some_and(|s| !(16..=64).contains(&s.len()))
        {
            return Err(ConfigError::new("canary_secret", "must be 16 to 64 bytes"));
        }
        if self
            .audit_secret
            .as_ref()
            .is_some_and(|s| !(16..=64).contains(&s.len()))
        {
            return Err(ConfigError::new("audit_secret", "must be 16 to 64 bytes"));
        }
        if (self.rules.is_empty() && !self.no_rules) || self.rules.len() > MAX_RULES {
            return Err(ConfigError::new(
                "rules",
                format!("a policy holds 1 to {MAX_RULES} rules"),
            ));
        }
        // Every plan any rule names, in order of first mention.
        let mut names: Vec<Box<str>> = Vec::new();
        for (plan, _) in self.rules.iter().flat_map(|r| &r.plans) {
            if !names.iter().any(|n| **n == **plan) {
                names.push(plan.as_str().into());
            }
        }
        if names.len() > MAX_PLANS {
            return Err(ConfigError::new(
                "plans",
                format!("a policy knows at most {MAX_PLANS} plans"),
            ));
        }
        if self.log.is_some_and(|l| !l.is_valid()) {
            return Err(ConfigError::new(
                "decision_log",
                "the shares must be from 0.0 to 1.0",
            ));
        }
        if !names.is_empty() && self.plan_source.is_none() {
            return Err(ConfigError::new(
                "plans",
                "rules name plans, but no plan source is set (plan_from_extension, plan_from_header or plan_from)",
            ));
        }
        let access = self
            .access
            .map(|list| Listed::new(list, crate::observe::REQUESTS))
            .transpose()?;
        // Every name the store will hold must be unique: a rule `api:pro`
        // next to rule `api`'s plan `pro` would share one budget.
        let mut stored = std::collections::HashSet::new();
        for (i, r) in self.rules.iter().enumerate() {
            let plan_names = r.plans.iter().map(|(p, _)| format!("{}:{p}", r.name));
            let plan_names = plan_names.chain(r.ladder.map(|_| format!("{}:ladder", r.name)));
            let plan_names = plan_names.chain(r.slow.as_ref().map(|_| format!("{}:slow", r.name)));
            let plan_names = plan_names.chain(
                r.challenge
                    .as_ref()
                    .map(|_| format!("{}:challenge", r.name)),
            );
            for name in std::iter::once(r.name.clone()).chain(plan_names) {
                if !stored.insert(name.clone()) {
                    return Err(ConfigError::new(
                        "name",
                        format!(
                            "the name {name:?} is taken (rules and their plans share the store)"
                        ),
                    )
                    .in_item("rules", i));
                }
            }
        }
        if let Some((name, _, _)) = &self.idempotency {
            if stored.contains(name) {
                return Err(ConfigError::new(
                    "idempotency",
                    format!("the name {name:?} is taken by a rule"),
                ));
            }
        }
        let mut bound = Vec::with_capacity(self.rules.len());
        // Files that load but mean little: said once, at build (review #9).
        if !self.rules.is_empty() {
            if self.rules.iter().all(|r| r.shadow) {
                tracing::warn!(
                    target: "tollgate",
                    "every rule of this policy is in shadow mode: it counts, and refuses nothing"
                );
            }
            if self.rules.iter().all(|r| r.missing == MissingKey::Skip) {
                tracing::warn!(
                    target: "tollgate",
                    "every rule of this policy lets a request with no key through unlimited \
                     (missing_key = skip): a client that sends no key is never limited"
                );
            }
        }
        for r in &self.rules {
            if let Some((1, _, block, _)) = r.ladder {
                if block > std::time::Duration::from_secs(86_400) {
                    tracing::warn!(
                        target: "tollgate",
                        rule = %r.name,
                        "one refusal blocks a key for more than a day (escalate: 1 strike)"
                    );
                }
            }
        }
        for (i, r) in self.rules.into_iter().enumerate() {
            // Whatever a rule's binding refuses names the rule, so that a
            // policy file's error points at its line.
            let at = |e: ConfigError| e.in_item("rules", i);
            let rule = Rule::new(&r.name, r.limit).map_err(at)?;
            crate::Routes::check(r.routes.as_ref()).map_err(at)?;
            if bound
                .iter()
                .any(|b: &Bound<B, St::Limiter>| *b.responder.rule == *rule.name())
            {
                return Err(ConfigError::new(
                    "name",
                    format!("the name {:?} is taken by another rule", rule.name()),
                )
                .in_item("rules", i));
            }
            let canary = match r.canary {
                None => None,
                Some(1.0) => None,
                Some(share) if (0.0..1.0).contains(&share) => {
                    Some(canary(rule.name(), share, self.canary_secret.as_deref()))
                }
                Some(_) => {
                    return Err(
                        ConfigError::new("canary", "the share must be from 0.0 to 1.0")
                            .in_item("rules", i),
                    )
                }
            };
            let limiter = self.store.limiter(&rule).map_err(at)?;
            // Metrics carry a `plan` label where the policy has plans.
            let responder = |rule: &Rule, plan: Option<&str>| {
                Arc::new(Responder {
                    rule: rule.name().into(),
                    headers: Headers::new(rule, self.headers, self.legacy_headers),
                    shadow: r.shadow,
                    rejection: self.rejection.clone(),
                    rendered: Rendered::new(LimitKind::Rate, rule.name()),
                    metrics: Metrics::register_plan(rule.name(), plan),
                    on_store_error: self.on_store_error.answer(rule.capacity()),
                    // Counted by the policy, rule by rule.
                    route_label: false,
                })
            };
            // Each kind of ladder keeps its own state: a key blocked by
            // one is not slowed by the other (nor the reverse) when the
            // rule changes kinds.
            let ladder = match (r.ladder, r.slow) {
                (None, None) => None,
                (Some(_), Some(_)) => {
                    return Err(at(ConfigError::new(
                        "slow_down",
                        "a rule has one ladder: escalate (blocks) or slow_down (lowers the \
                         rate), not both",
                    )))
                }
                (Some((strikes, period, block, max_block)), None) => Some(
                    EscalationRule::new(
                        format!("{}:ladder", rule.name()),
                        strikes,
                        period,
                        block,
                        max_block,
                    )
                    .map_err(at)?,
                ),
                (None, Some((strikes, period, hold, steps))) => Some(
                    EscalationRule::slow_down(
                        format!("{}:slow", rule.name()),
                        strikes,
                        period,
                        hold,
                        &steps,
                    )
                    .map_err(at)?,
                ),
            };
            let ladder = match ladder {
                Some(ladder) => Some(self.store.escalation(&ladder).map_err(at)?),
                None => None,
            };
            // The headers of each step of a slowing ladder, per plan: a
            // slowed key is told its lowered limit.
            // Every step must hold one request of cost 1 (a slowed key
            // pays in raised costs): else the step would slow nothing
            // while its headers said 0.
            let lowered =
                |rule: &Rule, plan: Option<&str>| -> Result<Box<[Headers]>, ConfigError> {
                    let Some(slows) = ladder.as_ref().map(|l| l.rule().escalation()) else {
                        return Ok(Box::default());
                    };
                    (1..=slows.steps().len())
                        .map(|level| {
                            let level = u32::try_from(level).unwrap_or(u32::MAX);
                            let capacity = slows.shown(rule.capacity(), level);
                            if capacity == 0 {
                                let of = plan.map(|p| format!("plan {p:?}'s ")).unwrap_or_default();
                                return Err(at(ConfigError::new(
                                    "steps",
                                    format!(
                                    "{of}limit of {} cannot keep {} %: a slowed key pays raised \
                                     costs, so the limit (burst) must hold at least {} requests",
                                    rule.capacity(),
                                    slows.percent(level),
                                    slows.charge(1, level)
                                ),
                                )));
                            }
                            Ok(Headers::lowered(
                                rule,
                                capacity,
                                self.headers,
                                self.legacy_headers,
                            ))
                        })
                        .collect()
                };
            let mut lowered_plans = Vec::with_capacity(names.len().saturating_add(1));
            lowered_plans.push(lowered(&rule, None)?);
            let default_plan = (!names.is_empty()).then_some("default");
            let mut plans = Vec::with_capacity(names.len());
            for plan in &names {
                let Some((_, limit)) = r.plans.iter().find(|(p, _)| **p == **plan) else {
                    lowered_plans.push(Box::default());
                    plans.push(None);
                    continue;
                };
                // Its own state in the store; the rule's name in headers.
                let stored = Rule::new(format!("{}:{plan}", rule.name()), *limit).map_err(at)?;
                let shown = Rule::new(rule.name(), *limit).map_err(at)?;
                lowered_plans.push(lowered(&shown, Some(plan))?);
                plans.push(Some((
                    self.store.limiter(&stored).map_err(at)?,
                    responder(&shown, Some(plan)),
                )));
            }
            if r.warn_at.is_some_and(|s| !(s > 0.0 && s <= 1.0)) {
                return Err(
                    ConfigError::new("warn_at", "the share must be above 0 and at most 1")
                        .in_item("rules", i),
                );
            }
            // Set when a reload replaces the rule by one unlike it.
            let retired = Arc::<std::sync::atomic::AtomicBool>::default();
            // What keys owe, per plan (see `Bound::debts`).
            let debts: Box<[_]> = match r.charge_after {
                None => Box::default(),
                Some(_) if r.count_if.is_some() => {
                    return Err(at(ConfigError::new(
                        "charge_after",
                        "a rule settles on its response one way: count_if (which responses \
                         count) or charge_after (what they cost), not both",
                    )))
                }
                Some(measure) => {
                    measure.check().map_err(at)?;
                    // Shadow mode changes nothing: no debts.
                    if r.shadow {
                        Box::default()
                    } else {
                        let of = |l: &St::Limiter| {
                            crate::rate_limit::Debts::of(measure, l, Some(Arc::clone(&retired)))
                        };
                        let default = of(&limiter);
                        std::iter::once(Arc::clone(&default))
                            .chain(plans.iter().map(|p| match p {
                                Some((l, _)) => of(l),
                                None => Arc::clone(&default),
                            }))
                            .collect()
                    }
                }
            };
            // Solutions used, each remembered for its challenge's lifetime.
            let challenge = match r.challenge {
                None => None,
                Some(c) => {
                    let once =
                        tollgate_core::Limit::gcra(tollgate_core::Rate::new(1, c.lifetime()), 1);
                    let used = Rule::new(format!("{}:challenge", rule.name()), once).map_err(at)?;
                    Some((c, self.store.limiter(&used).map_err(at)?))
                }
            };
            bound.push(Bound {
                rule: r.rule,
                challenge,
                limiter,
                keying: Keying::new(r.missing).scoped(r.routes),
                canary,
                responder: responder(&rule, default_plan),
                plans: plans.into(),
                count_if: r.count_if,
                ladder,
                lowered: lowered_plans.into(),
                warn_at: r.warn_at,
                debts,
                messages: r.messages,
                retired,
                predecessors: std::sync::Mutex::default(),
            });
        }
        let enforced = || bound.iter().filter(|b| !b.responder.shadow);
        let policy = (0..=names.len())
            .map(|p| {
                let p = u8::try_from(p).unwrap_or(0);
                set_policy(enforced().map(|b| &b.at(p).1.headers))
            })
            .collect();
        let count = enforced().count();
        let audit = match self.audit {
            None => None,
            Some((sink, names)) => {
                if names.is_empty() {
                    return Err(ConfigError::new("audit", "name at least one rule"));
                }
                let mut mask = 0u16;
                for name in &names {
                    // The access list's name audits its denials.
                    if access.as_ref().is_some_and(|a| **a.name() == **name) {
                        continue;
                    }
                    let Some(i) = bound.iter().position(|b| *b.responder.rule == **name) else {
                        return Err(ConfigError::new(
                            "audit",
                            format!("no rule or access list is named {name:?}"),
                        ));
                    };
                    mask |= super::decide::bit(i);
                }
                let denials = access
                    .as_ref()
                    .is_some_and(|a| names.iter().any(|n| **n == **a.name()));
                if self.audit_per_second == 0 {
                    return Err(ConfigError::new(
                        "audit",
                        "at least one record a second (audit_per_second)",
                    ));
                }
                let audited: Vec<Arc<str>> = names.iter().map(|n| n.as_str().into()).collect();
                let gate = crate::observe::AuditGate::new(sink, self.audit_per_second, &audited);
                let sink: Arc<dyn crate::observe::AuditSink> = Arc::new(gate);
                Some((sink, mask, denials))
            }
        };
        let idempotency = match self.idempotency {
            None => None,
            Some((name, client, ttl)) => {
                if ttl.is_zero() || ttl > super::idempotency::MAX_TTL {
                    return Err(ConfigError::new(
                        "idempotency",
                        "the TTL must be longer than zero and at most a day (86400 s)",
                    ));
                }
                let rule = Rule::new(
                    &name,
                    tollgate_core::Limit::gcra(tollgate_core::Rate::new(1, ttl), 1),
                )?;
                Some(Idempotency {
                    client,
                    // Their own table (in memory): markers a client makes
                    // at will never fill the rules' store.
                    limiter: self
                        .store
                        .apart(super::idempotency::MAX_MARKERS)
                        .limiter(&rule)?,
                    metrics: Metrics::register(&name),
                    name: Arc::from(name.as_str()),
                })
            }
        };
        let response_aware = bound.iter().any(|b| b.count_if.is_some());
        let laddered = bound.iter().any(|b| b.ladder.is_some());
        let messages = bound.iter().any(|b| b.messages);
        let warns = bound.iter().any(|b| b.warn_at.is_some());
        let requester = bound
            .iter()
            .any(|b| b.challenge.is_some())
            .then_some(self.requester);
        Ok(PolicyLayer {
            current: Arc::new(Current::new(Shared {
                rules: bound.into(),
                requester,
                audit_secret: self.audit_secret,
                standard: self.headers,
                legacy: self.legacy_headers,
                policy,
                plans: Plans {
                    names,
                    source: self.plan_source,
                },
                enforced: count,
                response_aware,
                laddered,
                messages,
                warns,
                log: self.log,
                route_label: self.route_label,
                audit,
                idempotency,
                access,
            })),
        })
    }
}
