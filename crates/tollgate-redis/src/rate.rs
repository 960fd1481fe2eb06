//! Rate rules on Redis: one script call per decision.

use std::fmt;
use std::sync::Arc;

use tollgate_core::{Decision, Limiter, Rule, StoreError};

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
        rebinding: bool,
    ) -> Result<Self, tollgate_core::ConfigError> {
        crate::scripts::check_spans(rule.algorithm())?;
        let (script, params) = crate::scripts::for_algorithm(rule.algorithm());
        let on_failure = RateOnFailure::new(&backend.policy.binding(rebinding), rule)?;
        Ok(Self {
            bound: Arc::new(BoundRate {
                ttl: crate::scripts::ttl_ms(crate::scripts::state_lifetime(rule.algorithm()))
                    .to_string(),
                backend,
                rule: rule.clone(),
                format: key::Format::of(rule.algorithm()),
                script,
                params,
                on_failure,
            }),
        })
    }
}

impl BoundRate {
    /// Runs this rule's script in `mode` for `key`.
    async fn call(&self, mode: RateMode, key: &[u8], cost: u32) -> Result<Reply, StoreError> {
        let rkey = key::redis_key(&self.backend.prefix, self.format, self.rule.name(), key);
        let cost = cost.to_string();
        let now = self.backend.now_arg();
        let mut args: Vec<&str> = Vec::with_capacity(self.params.len().saturating_add(4));
        args.extend([mode.arg(), cost.as_str(), now.as_str(), self.ttl.as_str()]);
        args.extend(self.params.iter().map(String::as_str));
        self.backend.run(self.script, &[&rkey], &args).await
    }
}

impl Limiter for RedisLimiter {
    type DecideFuture = BoxFuture<Result<Decision, StoreError>>;
    type RefundFuture = BoxFuture<Result<(), StoreError>>;

    fn rule(&self) -> &Rule {
        &self.bound.rule
    }

    fn decide(&self, key: &[u8], cost: u32) -> Self::DecideFuture {
        let this = Arc::clone(&self.bound);
        let key = key.to_vec();
        Box::pin(async move {
            let reply = this.call(RateMode::Decide, &key, cost).await;
            // A fault or an unreadable reply: the failure policy answers.
            Ok(reply
                .ok()
                .and_then(|r| r.decision())
                .unwrap_or_else(|| this.on_failure.decide(&this.rule, &key, cost)))
        })
    }

    fn refund(&self, key: &[u8], cost: u32) -> Self::RefundFuture {
        let this = Arc::clone(&self.bound);
        let key = key.to_vec();
        Box::pin(async move {
            match this.call(RateMode::Refund, &key, cost).await {
                Ok(_) => Ok(()),
                Err(_) if this.on_failure.refund(&key, cost) => Ok(()),
                Err(e) => Err(e),
            }
        })
    }
}
