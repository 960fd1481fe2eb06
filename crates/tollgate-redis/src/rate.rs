//! Rate rules on Redis: one script call per decision, and one per hash
//! slot for the rules that decide a request together.

use std::fmt;
use std::sync::Arc;

use tollgate_core::{
    Decision, JointDecision, JointPart, Limiter, Rule, StoreError, StoreErrorKind,
};

use crate::backend::Backend;
use crate::key;
use crate::policy::RateOnFailure;
use crate::scripts::{RateMode, Reply, Script};
use crate::BoxFuture;

/// A rate rule bound to a [`RedisStore`](crate::RedisStore). Cheap to
/// clone.
#[derive(Clone)]
pub struct RedisLimiter {
    bound: Arc<BoundRate>,
}

struct BoundRate {
    backend: Arc<Backend>,
    rule: Rule,
    format: key::Format,
    script: &'static Script,
    /// The algorithm's name in the joint script.
    name: &'static str,
    params: Vec<String>,
    ttl: String,
    on_failure: RateOnFailure,
}

impl fmt::Debug for RedisLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLimiter")
            .field("rule", &self.bound.rule)
            .finish_non_exhaustive()
    }
}

impl RedisLimiter {
    pub(crate) fn new(
        backend: Arc<Backend>,
        rule: &Rule,
        rebinding: crate::policy::Rebind,
    ) -> Result<Self, tollgate_core::ConfigError> {
        crate::scripts::check_spans(rule.algorithm())?;
        let script = crate::scripts::for_algorithm(rule.algorithm());
        let on_failure = RateOnFailure::new(&backend.policy.binding(rebinding), rule)?;
        Ok(Self {
            bound: Arc::new(BoundRate {
                ttl: crate::scripts::ttl_ms(crate::scripts::state_lifetime(rule.algorithm()))
                    .to_string(),
                backend,
                rule: rule.clone(),
                format: key::Format::of(rule.algorithm()),
                script: script.script,
                name: script.name,
                params: script.params,
                on_failure,
            }),
        })
    }
}

impl BoundRate {
    fn redis_key(&self, key: &[u8]) -> String {
        self.backend.names.name(self.format, self.rule.name(), key)
    }

    /// Runs this rule's script in `mode` on `rkey` (the key's
    /// [`redis_key`](Self::redis_key)).
    async fn call(&self, mode: RateMode, rkey: &str, cost: u64) -> Result<Reply, StoreError> {
        let cost = crate::scripts::lua_number(cost).to_string();
        let now = self.backend.now_arg();
        let mut args: Vec<&str> = Vec::with_capacity(self.params.len().saturating_add(4));
        args.extend([mode.arg(), cost.as_str(), now.as_str(), self.ttl.as_str()]);
        args.extend(self.params.iter().map(String::as_str));
        self.backend.run(self.script, &[rkey], &args).await
    }

    /// Decides `key` (stored under `rkey`) at `cost` alone: Redis's
    /// answer, or (a fault or an unreadable reply) the failure policy's;
    /// and whether the failure policy gave it.
    async fn decide(&self, key: &[u8], rkey: &str, cost: u64) -> (JointDecision, bool) {
        let reply = self.call(RateMode::Decide, rkey, cost).await;
        match reply.ok().and_then(|r| r.decision()) {
            Some(d) => (
                JointDecision {
                    consumed: d.is_allowed() && cost > 0,
                    decision: Ok(d),
                    failed: false,
                },
                false,
            ),
            None => (self.failed(key, cost), true),
        }
    }

    /// What the failure policy answers for `key` at `cost`, and whether it
    /// consumed it.
    fn failed(&self, key: &[u8], cost: u64) -> JointDecision {
        let decision = self.on_failure.decide(&self.rule, key, cost);
        JointDecision {
            consumed: decision.is_allowed() && self.on_failure.consumes(),
            decision: Ok(decision),
            failed: true,
        }
    }
}

/// The parameters of each rule in `joint.lua`'s arguments (its stride is
/// four more): as many as the algorithm with the most takes.
const JOINT_PARAMS: usize = 3;

/// One rule of a joint decision, owned for its script call.
struct Part {
    bound: Arc<BoundRate>,
    rkey: String,
    key: Vec<u8>,
    cost: u64,
    enforced: bool,
}

/// Which parts share a script call: on Cluster those whose keys share a
/// hash slot, elsewhere all of them. A key met twice (one rule given
/// twice) goes to another call, since a joint decision reads each key
/// once.
fn calls(backend: &Backend, parts: &[Part]) -> Vec<Vec<usize>> {
    let mut calls: Vec<(Option<redis::cluster_routing::Slot>, Vec<usize>)> = Vec::new();
    for (i, part) in parts.iter().enumerate() {
        let slot = backend.conn().slot_of(&part.rkey);
        let joins = calls.iter_mut().find(|(s, members)| {
            *s == slot
                && !members
                    .iter()
                    .any(|&j| parts.get(j).is_some_and(|p| p.rkey == part.rkey))
        });
        match joins {
            Some((_, members)) => members.push(i),
            None => calls.push((slot, vec![i])),
        }
    }
    calls.into_iter().map(|(_, members)| members).collect()
}

/// Decides `members` of `parts` in one script call: all of them consume,
/// or (an enforced one denies) none does. A fault or an unreadable reply:
/// each rule's failure policy answers. Each answer says whether the
/// failure policy gave it.
async fn decide_together(
    backend: &Backend,
    parts: &[Part],
    members: &[usize],
) -> Vec<(JointDecision, bool)> {
    let chosen: Vec<&Part> = members.iter().filter_map(|&i| parts.get(i)).collect();
    if let [one] = chosen.as_slice() {
        return vec![one.bound.decide(&one.key, &one.rkey, one.cost).await];
    }
    let now = backend.now_arg();
    let costs: Vec<String> = chosen
        .iter()
        .map(|p| crate::scripts::lua_number(p.cost).to_string())
        .collect();
    let keys: Vec<&str> = chosen.iter().map(|p| p.rkey.as_str()).collect();
    let mut args: Vec<&str> = Vec::with_capacity(chosen.len().saturating_mul(7).saturating_add(4));
    args.extend(["decide", "0", now.as_str(), "0"]);
    for (p, cost) in chosen.iter().zip(&costs) {
        let enforced = if p.enforced { "1" } else { "0" };
        args.extend([p.bound.name, cost.as_str(), p.bound.ttl.as_str(), enforced]);
        debug_assert!(p.bound.params.len() <= JOINT_PARAMS);
        let params = p.bound.params.iter().map(String::as_str);
        args.extend(params.chain(std::iter::repeat("")).take(JOINT_PARAMS));
    }
    let reply = backend.run(&crate::scripts::JOINT, &keys, &args).await;
    match reply.ok().and_then(|r| r.joint(chosen.len())) {
        Some((applied, decisions)) => decisions
            .into_iter()
            .zip(&chosen)
            .map(|(d, p)| {
                let answer = JointDecision {
                    consumed: applied && d.is_allowed() && p.cost > 0,
                    decision: Ok(d),
                    failed: false,
                };
                (answer, false)
            })
            .collect(),
        None => chosen
            .iter()
            .map(|p| (p.bound.failed(&p.key, p.cost), true))
            .collect(),
    }
}

impl Limiter for RedisLimiter {
    type DecideFuture = BoxFuture<Result<Decision, StoreError>>;
    type RefundFuture = BoxFuture<Result<(), StoreError>>;

    fn rule(&self) -> &Rule {
        &self.bound.rule
    }

    fn decide(&self, key: &[u8], cost: u64) -> Self::DecideFuture {
        let this = Arc::clone(&self.bound);
        let key = key.to_vec();
        let rkey = this.redis_key(&key);
        Box::pin(async move { this.decide(&key, &rkey, cost).await.0.decision })
    }

    /// Redis's answer, or `Err`: never the failure policy's.
    fn decide_exact(&self, key: &[u8], cost: u64) -> Self::DecideFuture {
        let this = Arc::clone(&self.bound);
        let rkey = this.redis_key(key);
        Box::pin(async move {
            this.call(RateMode::Decide, &rkey, cost)
                .await?
                .decision()
                .ok_or_else(|| {
                    StoreError::new(StoreErrorKind::Protocol, "unreadable rate script reply")
                })
        })
    }

    fn refund(&self, key: &[u8], cost: u64) -> Self::RefundFuture {
        let this = Arc::clone(&self.bound);
        let key = key.to_vec();
        Box::pin(async move {
            match this
                .call(RateMode::Refund, &this.redis_key(&key), cost)
                .await
            {
                Ok(_) => Ok(()),
                Err(_) if this.on_failure.refund(&key, cost) => Ok(()),
                Err(e) => Err(e),
            }
        })
    }

    /// One script call for the rules whose keys share a Cluster slot —
    /// on a standalone or Sentinel store, for all of them — which either
    /// consumes every rule's cost or none; the calls for different slots
    /// run side by side, and what one consumed is refunded by the caller
    /// when another denies. (On Cluster each rule's key carries its own
    /// hash tag, so rules seldom share a slot.) A key given twice (one
    /// rule asked twice for one key) goes to a call of its own. A single
    /// part is decided by its rule's own script, as `decide` would, and
    /// its answer says whether the failure policy gave it (what `decide`
    /// cannot say). `None` for no parts, or parts of more than one store.
    fn decide_joint(parts: &[JointPart<'_, Self>]) -> Option<BoxFuture<Vec<JointDecision>>> {
        let backend = Arc::clone(&parts.first()?.limiter.bound.backend);
        let one_store = parts
            .iter()
            .all(|p| Arc::ptr_eq(&p.limiter.bound.backend, &backend));
        if !one_store {
            return None;
        }
        let parts: Vec<Part> = parts
            .iter()
            .map(|p| Part {
                rkey: p.limiter.bound.redis_key(p.key),
                bound: Arc::clone(&p.limiter.bound),
                key: p.key.to_vec(),
                cost: p.cost,
                enforced: p.enforced,
            })
            .collect();
        Some(Box::pin(async move {
            let calls = calls(&backend, &parts);
            let answers = tollgate_core::join_all(
                calls
                    .iter()
                    .map(|members| Box::pin(decide_together(&backend, &parts, members)))
                    .collect(),
            )
            .await;
            let mut out: Vec<Option<(JointDecision, bool)>> = parts.iter().map(|_| None).collect();
            for (members, answers) in calls.iter().zip(answers) {
                for (&i, answer) in members.iter().zip(answers) {
                    if let Some(slot) = out.get_mut(i) {
                        *slot = Some(answer);
                    }
                }
            }
            let mut answers: Vec<(JointDecision, bool)> = out
                .into_iter()
                .zip(&parts)
                .map(|(answer, p)| answer.unwrap_or_else(|| (p.bound.failed(&p.key, p.cost), true)))
                .collect();
            // A denial refunds what the failure policy's memory charged
            // here, to that memory: the caller's refund would go to Redis,
            // which never saw the charge.
            let denied = answers.iter().zip(&parts).any(|((a, _), p)| {
                p.enforced && a.decision.as_ref().is_ok_and(|d| !d.is_allowed())
            });
            if denied {
                for ((answer, from_policy), p) in answers.iter_mut().zip(&parts) {
                    if *from_policy && answer.consumed {
                        p.bound.on_failure.refund(&p.key, p.cost);
                        answer.consumed = false;
                    }
                }
            }
            answers.into_iter().map(|(answer, _)| answer).collect()
        }))
    }
}
