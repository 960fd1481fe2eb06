//! Calendar quotas on Redis: one script call per operation (`quota.lua`),
//! one hash per rule and client key, holding one window per period.
//!
//! The script finds where each period starts and ends as
//! [`tollgate_core::calendar`] does — on Redis's `TIME` (or the client's
//! Unix time), at the rule's offset — and decides as
//! [`Quota`](tollgate_core::Quota) does. The key lives until the end of
//! its longest period plus a margin, so an instance that restarts finds
//! what was spent, and an idle key vanishes.

use std::fmt;
use std::sync::Arc;

use tollgate_core::calendar::Period;
use tollgate_core::{Quota, QuotaDecision, QuotaLimiter, QuotaRule, StoreError, StoreErrorKind};

use crate::backend::Backend;
use crate::key;
use crate::policy::QuotaOnFailure;
use crate::scripts::{QuotaMode, QUOTA};
use crate::BoxFuture;

/// How long a quota's key outlives the end of its longest period: room
/// for instances whose clocks disagree (with
/// [`client_time`](crate::RedisStoreBuilder::client_time)).
const TTL_MARGIN_MS: u64 = 60_000;

/// A quota rule bound to a [`RedisStore`](crate::RedisStore). Cheap to
/// clone.
///
/// A consume (or a read) that Redis does not answer gets the store's
/// failure policy's answer: [`Open`](crate::FailurePolicy::Open) admits and
/// reports whole budgets, [`Closed`](crate::FailurePolicy::Closed) denies,
/// retry in a second, [`Fallback`](crate::FailurePolicy::Fallback) counts
/// in process memory. A refund, a reset or a grant that does not reach
/// Redis is an error (never made in that memory, which did not see the
/// charge: giving it back there would admit more than the limit), so that
/// support staff and callers know it did not happen.
#[derive(Clone)]
pub struct RedisQuotaLimiter {
    bound: Arc<BoundQuota>,
}

struct BoundQuota {
    backend: Arc<Backend>,
    rule: QuotaRule,
    periods: Vec<Period>,
    /// `ARGV[6..]`: the offset, then each period's name and budget (for a
    /// fixed offset; an IANA zone's are made per call).
    params: Vec<String>,
    margin: String,
    on_failure: QuotaOnFailure,
}

impl fmt::Debug for RedisQuotaLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisQuotaLimiter")
            .field("rule", &self.bound.rule)
            .finish_non_exhaustive()
    }
}

impl RedisQuotaLimiter {
    pub(crate) fn new(
        backend: Arc<Backend>,
        rule: &QuotaRule,
        mode: crate::policy::Rebind,
    ) -> Result<Self, tollgate_core::ConfigError> {
        let quota = rule.quota();
        // A fixed offset: the script computes the periods' bounds. An IANA
        // zone: the call passes them (see `call`).
        let mut params = vec![quota
            .zone()
            .fixed()
            .map_or_else(|| "zone".to_owned(), |o| o.seconds().to_string())];
        for (period, limit) in quota.periods() {
            params.push(period.name().to_owned());
            params.push(limit.to_string());
        }
        let on_failure = QuotaOnFailure::new(&backend.policy.binding(mode), rule)?;
        Ok(Self {
            bound: Arc::new(BoundQuota {
                backend,
                rule: rule.clone(),
                periods: quota.periods().map(|(p, _)| p).collect(),
                params,
                margin: TTL_MARGIN_MS.to_string(),
                on_failure,
            }),
        })
    }
}

impl BoundQuota {
    /// Runs the script in `mode` for `key`: the decision, or why there is
    /// none (no answer, or an unreadable one).
    async fn call(
        &self,
        mode: QuotaMode,
        key: &[u8],
        cost: u64,
        grant: u64,
    ) -> Result<QuotaDecision, StoreError> {
        let rkey = self
            .backend
            .names
            .name(key::Format::Quota, self.rule.name(), key);
        let cost = crate::scripts::lua_number(cost).to_string();
        let grant = grant.min(Quota::MAX_LIMIT).to_string();
        let zone = self.rule.quota().zone();
        let mut zoned = Vec::new();
        let now = if zone.fixed().is_some() {
            self.backend.now_arg()
        } else {
            // In an IANA zone the client computes each period's bounds
            // (local midnights across daylight saving time; Lua has no
            // time zone database), at its own time, which the script
            // then decides at: one instant for both.
            let now = self.backend.unix_now();
            for (period, limit) in self.rule.quota().periods() {
                let (start, end) = period.bounds_in(now, zone);
                zoned.extend([
                    period.name().to_owned(),
                    limit.to_string(),
                    (start / 1_000_000_000).to_string(),
                    (end / 1_000_000_000).to_string(),
                ]);
            }
            now.to_string()
        };
        let mut args: Vec<&str> = Vec::with_capacity(self.params.len().saturating_add(5));
        args.extend([
            mode.arg(),
            cost.as_str(),
            now.as_str(),
            self.margin.as_str(),
            grant.as_str(),
        ]);
        if zoned.is_empty() {
            args.extend(self.params.iter().map(String::as_str));
        } else {
            args.push("zone");
            args.extend(zoned.iter().map(String::as_str));
        }
        let reply = self.backend.run(&QUOTA, &[&rkey], &args).await?;
        reply.quota(&self.periods).ok_or_else(|| {
            StoreError::new(StoreErrorKind::Protocol, "unreadable reply to a quota call")
        })
    }
}

impl QuotaLimiter for RedisQuotaLimiter {
    type Future = BoxFuture<Result<QuotaDecision, StoreError>>;

    fn rule(&self) -> &QuotaRule {
        &self.bound.rule
    }

    fn consume(&self, key: &[u8], cost: u64) -> Self::Future {
        let this = Arc::clone(&self.bound);
        let key = key.to_vec();
        Box::pin(async move {
            let answer = this.call(QuotaMode::Consume, &key, cost, 0).await;
            // A fault or an unreadable reply: the failure policy answers.
            answer.or_else(|_| {
                let now = this.backend.unix_now();
                this.on_failure.consume(&this.rule, &key, cost, now)
            })
        })
    }

    fn refund(&self, key: &[u8], cost: u64) -> Self::Future {
        let this = Arc::clone(&self.bound);
        let key = key.to_vec();
        Box::pin(async move {
            this.call(QuotaMode::Refund, &key, cost, 0)
                .await
                .or_else(|e| this.on_failure.refund(&key, cost).ok_or(e))
        })
    }

    fn reset(&self, key: &[u8]) -> Self::Future {
        let this = Arc::clone(&self.bound);
        let key = key.to_vec();
        Box::pin(async move { this.call(QuotaMode::Reset, &key, 0, 0).await })
    }

    fn grant(&self, key: &[u8], units: u64) -> Self::Future {
        let this = Arc::clone(&self.bound);
        let key = key.to_vec();
        Box::pin(async move { this.call(QuotaMode::Grant, &key, 0, units).await })
    }

    /// Redis's answer, or the error: never the failure policy's.
    fn usage(&self, key: &[u8]) -> Self::Future {
        let this = Arc::clone(&self.bound);
        let key = key.to_vec();
        Box::pin(async move { this.call(QuotaMode::Consume, &key, 0, 0).await })
    }
}
