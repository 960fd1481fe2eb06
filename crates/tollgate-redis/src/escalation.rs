//! Escalation ladders on Redis: one script call per check and per strike
//! (`escalation.lua`), one string per ladder and client key, so a fleet
//! escalates together: strikes earned on any instance count toward one
//! block, and a block holds on every instance.

use std::fmt;
use std::sync::Arc;

use tollgate_core::algorithm::{Standing, Strike};
use tollgate_core::{
    BoxFuture, ConfigError, EscalationLimiter, EscalationRule, Store, StoreError, StoreErrorKind,
};

use crate::backend::Backend;
use crate::key;
use crate::scripts::{EscalationMode, ESCALATION};

/// An escalation ladder bound to a [`RedisStore`](crate::RedisStore),
/// shared by every instance that binds the same ladder under the same
/// prefix. The script does the core's
/// [`Escalation`](tollgate_core::algorithm::Escalation) arithmetic exactly,
/// on Redis's clock.
///
/// When Redis does not answer: with
/// [`Fallback`](crate::FailurePolicy::Fallback), the process's own ladder
/// in that memory store answers (each instance escalates on its own until
/// Redis is back); otherwise the error goes to the caller (a policy then
/// treats the key as not blocked and logs the fault: a Redis outage
/// blocks nobody).
pub struct RedisEscalation {
    backend: Arc<Backend>,
    rule: EscalationRule,
    /// `ARGV[5..]`: strikes, period, block (a slowing ladder's hold),
    /// longest block, forgiveness, a slowing ladder's steps.
    params: [String; 6],
    fallback: Option<Arc<dyn EscalationLimiter>>,
}

impl fmt::Debug for RedisEscalation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisEscalation")
            .field("rule", &self.rule)
            .finish_non_exhaustive()
    }
}

impl RedisEscalation {
    pub(crate) fn new(
        backend: Arc<Backend>,
        rule: &EscalationRule,
        rebinding: crate::policy::Rebind,
    ) -> Result<Self, ConfigError> {
        let l = rule.escalation();
        crate::scripts::check_span("period", l.period())?;
        crate::scripts::check_span("max_block", l.max_block())?;
        // A slowed key's climb back, the longest its state lives.
        let steps = u64::try_from(l.steps().len()).unwrap_or(u64::MAX);
        crate::scripts::check_span("hold", l.block().saturating_mul(steps))?;
        // Not divided among a fleet: a strike counts wherever it lands.
        let fallback = match backend.policy.binding(rebinding).memory() {
            Some((memory, _)) => Some(memory.escalation(rule)?),
            None => None,
        };
        Ok(Self {
            params: [
                l.strikes().to_string(),
                l.period().to_string(),
                l.block().to_string(),
                l.max_block().to_string(),
                l.forgive().to_string(),
                steps.to_string(),
            ],
            backend,
            rule: rule.clone(),
            fallback,
        })
    }

    /// Runs the script in `mode` for `key`.
    fn call(
        self: &Arc<Self>,
        mode: EscalationMode,
        key: &[u8],
    ) -> BoxFuture<Result<(u8, u64, u32), StoreError>> {
        let this = Arc::clone(self);
        let rkey = this
            .backend
            .names
            .name(key::Format::Escalation, this.rule.name(), key);
        let now = this.backend.now_arg();
        Box::pin(async move {
            let [strikes, period, block, max_block, forgive, steps] = &this.params;
            let args = [
                mode.arg(),
                "0",
                &now,
                "0",
                strikes,
                period,
                block,
                max_block,
                forgive,
                steps,
            ];
            let reply = this.backend.run(&ESCALATION, &[&rkey], &args).await?;
            reply.escalation().ok_or_else(|| {
                StoreError::new(
                    StoreErrorKind::Protocol,
                    "unreadable reply to a ladder call",
                )
            })
        })
    }
}

/// The handle a store gives out: the ladder behind an `Arc`, so that its
/// futures own what they need.
pub(crate) struct Shared(pub(crate) Arc<RedisEscalation>);

impl EscalationLimiter for Shared {
    fn rule(&self) -> &EscalationRule {
        &self.0.rule
    }

    fn standing(&self, key: &[u8]) -> BoxFuture<Result<Standing, StoreError>> {
        let call = self.0.call(EscalationMode::Check, key);
        let fallback = self.0.fallback.clone();
        let key = key.to_vec();
        Box::pin(async move {
            match call.await {
                Ok((1, for_ns, _)) => Ok(Standing::Blocked { for_ns }),
                Ok((3, for_ns, level)) => Ok(Standing::Slowed { level, for_ns }),
                Ok(_) => Ok(Standing::Clear),
                Err(e) => match fallback {
                    Some(m) => m.standing(&key).await,
                    None => Err(e),
                },
            }
        })
    }

    fn strike(&self, key: &[u8]) -> BoxFuture<Result<Strike, StoreError>> {
        let call = self.0.call(EscalationMode::Strike, key);
        let fallback = self.0.fallback.clone();
        let key = key.to_vec();
        Box::pin(async move {
            match call.await {
                Ok((1, for_ns, level)) => Ok(Strike::Blocked { for_ns, level }),
                Ok((3, for_ns, level)) => Ok(Strike::Slowed { for_ns, level }),
                Ok((_, strikes, _)) => Ok(Strike::Counted {
                    strikes: u32::try_from(strikes).unwrap_or(u32::MAX),
                }),
                Err(e) => match fallback {
                    Some(m) => m.strike(&key).await,
                    None => Err(e),
                },
            }
        })
    }
}
