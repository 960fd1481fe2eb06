//! One rule enforced against two stores: a regional one, exact and near,
//! and a global one, coarse and far (see [`Tiered`]).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use tollgate_core::{
    ConcurrencyRule, ConfigError, Decision, EscalationLimiter, EscalationRule, Limiter, Outcome,
    Rule, Store, StoreError,
};

/// A rule enforced against two stores at once: a request passes only if
/// both the regional and the global store admit it.
///
/// The intended pair: a **regional** Redis next to the instances — exact,
/// with low latency — and a **global** Redis shared by every region, far
/// away (100 ms round trips), put behind [`HotKeys`](crate::HotKeys) with
/// a large `ttl` and `min_batch`, so that most decisions spend a lease
/// locally instead of crossing the ocean. Both are asked at once; a
/// request one refuses is refunded to the other.
///
/// **Consistency.** Within a region, the regional store's guarantee holds
/// exactly. Across regions, the global store bounds the sum: at most its
/// limit plus its leases' bound (`rate × ttl` for GCRA; see
/// [`HotKeys`](crate::HotKeys)), plus what each region admitted while the
/// global store was unreachable. **When the global store is unreachable**
/// (an error, or — better — its own `FailurePolicy::Open` answering),
/// the regional limit alone holds: no region is ever limited more than by
/// its own rule because the far store is away, and none admits more than
/// its regional limit. When the regional store fails, its failure policy
/// answers as it would alone.
///
/// **The trade-off of a leased global tier.** A region decides most
/// requests from units it leased ahead, so the far round trip is paid once
/// a lease, not once a request (tested: two regions 50 ms from the global
/// Redis, 120 decisions each, 8 and 4 of them waited for it); in exchange
/// the global limit is approximate: a region's unspent lease is not
/// available to the others until it ends (up to `max_share` of the limit
/// under-admitted elsewhere meanwhile), and ended leases may have admitted
/// up to `rate × ttl` more. The regional limit stays exact.
///
/// Both stores bind the rule under the same name (the global tier with
/// its own parameters where [`global_rule`](Self::global_rule) says);
/// give the global one its own prefix if both are one Redis. Concurrency rules and escalation
/// ladders go to the regional store alone.
///
/// ```
/// use tollgate_core::{Limit, Rate, Rule, Store};
/// use tollgate_memory::MemoryStore;
/// use tollgate_redis::{HotKeys, Tiered};
///
/// # fn main() -> Result<(), tollgate_core::ConfigError> {
/// // (Two Redis stores in production; memory here.)
/// let regional = MemoryStore::new();
/// let global = HotKeys::new().min_batch(16).over(MemoryStore::new())?;
/// let store = Tiered::new(regional, global);
/// let rule = Rule::new("per-org", Limit::gcra(Rate::per_second(100), 100))?;
/// let limiter = store.limiter(&rule)?;
/// # let _ = limiter;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Tiered<R, G> {
    regional: R,
    global: G,
    /// The global tier's rule for a rule (default: the rule itself).
    global_rule: Option<GlobalRule>,
}

/// How the global tier's rule is made from a rule.
type GlobalRule = Arc<dyn Fn(&Rule) -> Result<Rule, ConfigError> + Send + Sync>;

impl<R: fmt::Debug, G: fmt::Debug> fmt::Debug for Tiered<R, G> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tiered")
            .field("regional", &self.regional)
            .field("global", &self.global)
            .field("global_rule", &self.global_rule.is_some())
            .finish()
    }
}

impl<R, G> Tiered<R, G> {
    /// `regional` and `global` as one store.
    pub fn new(regional: R, global: G) -> Self {
        Self {
            regional,
            global,
            global_rule: None,
        }
    }

    /// The global tier's rule for each rule (default: the same rule, so
    /// the global limit equals a region's). A regional limit of 100 a
    /// second per org and a global one of 250 across three regions:
    /// `.global_rule(|r| Rule::new(r.name(), Limit::gcra(Rate::per_second(250), 250)))`.
    /// Errors it returns are the binding's. It keeps the rule's name (the
    /// global store's keys are named by it).
    #[must_use]
    pub fn global_rule(
        mut self,
        f: impl Fn(&Rule) -> Result<Rule, ConfigError> + Send + Sync + 'static,
    ) -> Self {
        self.global_rule = Some(Arc::new(f));
        self
    }
}

impl<R: Store, G: Store> Store for Tiered<R, G> {
    type Limiter = TieredLimiter<R::Limiter, G::Limiter>;
    type ConcurrencyLimiter = R::ConcurrencyLimiter;

    /// The longer of the tiers' timeouts.
    fn call_timeout(&self) -> Option<std::time::Duration> {
        self.regional.call_timeout().max(self.global.call_timeout())
    }

    fn limiter(&self, rule: &Rule) -> Result<Self::Limiter, ConfigError> {
        let global = match &self.global_rule {
            Some(f) => {
                let global = f(rule)?;
                if global.name() != rule.name() {
                    return Err(ConfigError::new(
                        "global_rule",
                        format!(
                            "the global rule of {:?} must keep its name (got {:?})",
                            rule.name(),
                            global.name()
                        ),
                    ));
                }
                self.global.limiter(&global)?
            }
            None => self.global.limiter(rule)?,
        };
        Ok(TieredLimiter(Arc::new((
            self.regional.limiter(rule)?,
            global,
        ))))
    }

    fn concurrency_limiter(
        &self,
        rule: &ConcurrencyRule,
    ) -> Result<Self::ConcurrencyLimiter, ConfigError> {
        self.regional.concurrency_limiter(rule)
    }

    fn escalation(&self, rule: &EscalationRule) -> Result<Arc<dyn EscalationLimiter>, ConfigError> {
        self.regional.escalation(rule)
    }

    fn rebinding(&self) -> Self {
        Self {
            regional: self.regional.rebinding(),
            global: self.global.rebinding(),
            global_rule: self.global_rule.clone(),
        }
    }

    fn checking(&self) -> Self {
        Self {
            regional: self.regional.checking(),
            global: self.global.checking(),
            global_rule: self.global_rule.clone(),
        }
    }
}

/// A rule bound to a [`Tiered`] store.
pub struct TieredLimiter<RL, GL>(Arc<(RL, GL)>);

impl<RL, GL> Clone for TieredLimiter<RL, GL> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<RL: fmt::Debug, GL: fmt::Debug> fmt::Debug for TieredLimiter<RL, GL> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("TieredLimiter").field(&self.0).finish()
    }
}

impl<RL, GL> TieredLimiter<RL, GL> {
    /// The regional store's limiter.
    pub fn regional(&self) -> &RL {
        &self.0 .0
    }

    /// The global store's limiter.
    pub fn global(&self) -> &GL {
        &self.0 .1
    }
}

type Boxed<T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send>>;

/// The two answers as one: both must admit; the longer wait wins.
fn combine(r: Decision, g: Decision) -> Decision {
    let outcome = match (r.outcome, g.outcome) {
        (Outcome::Never, _) | (_, Outcome::Never) => Outcome::Never,
        (Outcome::Deny { retry_after: a }, Outcome::Deny { retry_after: b }) => Outcome::Deny {
            retry_after: a.max(b),
        },
        (Outcome::Deny { retry_after }, _) | (_, Outcome::Deny { retry_after }) => {
            Outcome::Deny { retry_after }
        }
        (Outcome::Allow { delay: a }, Outcome::Allow { delay: b }) => {
            Outcome::Allow { delay: a.max(b) }
        }
    };
    // The headers show the tighter of the two.
    let (limit, remaining) = if g.remaining < r.remaining {
        (g.limit, g.remaining)
    } else {
        (r.limit, r.remaining)
    };
    Decision {
        outcome,
        limit,
        remaining,
        reset_after: r.reset_after.max(g.reset_after),
    }
}

impl<RL: Limiter, GL: Limiter> Limiter for TieredLimiter<RL, GL> {
    type DecideFuture = Boxed<Decision>;
    type RefundFuture = Boxed<()>;

    fn rule(&self) -> &Rule {
        self.0 .0.rule()
    }

    fn decide(&self, key: &[u8], cost: u64) -> Boxed<Decision> {
        let both = Arc::clone(&self.0);
        let (rf, gf) = (both.0.decide(key, cost), both.1.decide(key, cost));
        let key = key.to_vec();
        Box::pin(async move {
            let (r, g) = tokio::join!(rf, gf);
            let r = match r {
                Ok(r) => r,
                Err(e) => {
                    // Nothing is admitted: give the global store back
                    // what it took.
                    if cost > 0 && g.as_ref().is_ok_and(Decision::is_allowed) {
                        let _ = both.1.refund(&key, cost).await;
                    }
                    return Err(e);
                }
            };
            let g = match g {
                Ok(g) => g,
                Err(e) => {
                    // The far store is away: the regional limit holds.
                    tracing::debug!(target: "tollgate", error = %e, "global store failed; regional decision alone");
                    return Ok(r);
                }
            };
            let d = combine(r, g);
            if cost > 0 && !d.is_allowed() {
                // Give back what the one that admitted took.
                if r.is_allowed() {
                    let _ = both.0.refund(&key, cost).await;
                }
                if g.is_allowed() {
                    let _ = both.1.refund(&key, cost).await;
                }
            }
            Ok(d)
        })
    }

    /// The regional store's own answer (concurrency rules and ladders
    /// live there too): a marker or a used challenge is exact within a
    /// region, and across regions each region judges its own.
    fn decide_exact(&self, key: &[u8], cost: u64) -> Boxed<Decision> {
        Box::pin(self.0 .0.decide_exact(key, cost))
    }

    fn refund(&self, key: &[u8], cost: u64) -> Boxed<()> {
        let both = Arc::clone(&self.0);
        let (rf, gf) = (both.0.refund(key, cost), both.1.refund(key, cost));
        Box::pin(async move {
            let (r, g) = tokio::join!(rf, gf);
            // A global refund that fails only leaves the far budget a
            // little lower until it recovers.
            let _ = g;
            r
        })
    }
}
