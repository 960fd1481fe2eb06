//! What every clone of a policy layer shares: its rules, bound to the store.

use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response};
use tollgate_core::Decision;

use super::rule::DynRule;
use crate::headers::Headers;
pub(super) use crate::key::Keyed;
use crate::key::{KeyBuf, Keying};
use crate::rate_limit::Responder;
use crate::rejection::Rejected;

/// The most rules one policy holds.
pub const MAX_RULES: usize = 8;

pub(super) type RejectFn = Arc<dyn Fn(&Rejected) -> Response<Bytes> + Send + Sync>;

/// A plan's own limiter and responder for a rule.
pub(super) type Variant<L> = (L, Arc<Responder>);

/// A rule bound to its store.
pub(super) struct Bound<B, L> {
    pub(super) rule: Box<dyn DynRule<B>>,
    pub(super) limiter: L,
    pub(super) keying: Keying,
    pub(super) responder: Arc<Responder>,
    /// A canary's share as a threshold on the key's hash: enforced below.
    pub(super) canary: Option<(u64, (u64, u64))>,
    /// Plan `i + 1`'s limiter and responder, where this rule names it.
    pub(super) plans: Box<[Option<Variant<L>>]>,
    /// A response-aware rule's test of which responses count.
    pub(super) count_if: Option<super::rule::CountIf>,
    /// The rule's challenge, and the limiter that remembers the
    /// solutions used.
    pub(super) challenge: Option<(Arc<dyn super::Challenge>, L)>,
    /// The rule's escalation ladder, per key.
    pub(super) ladder: Option<Arc<dyn tollgate_core::EscalationLimiter>>,
    /// A slowing ladder's headers, per plan (0: the default) and step:
    /// what a slowed key is told its limit is.
    pub(super) lowered: Box<[Box<[Headers]>]>,
    /// The share of capacity past which admitted responses warn.
    pub(super) warn_at: Option<f64>,
    /// What keys owe where the rule charges what requests really cost,
    /// per plan as [`lowered`](Self::lowered) is kept (empty: it does
    /// not).
    pub(super) debts: Box<[Arc<crate::rate_limit::Debts>]>,
    /// Whether an admitted upgrade is offered this rule's message budget.
    pub(super) messages: bool,
    /// Set when a reload replaced this rule by one whose refunds mean
    /// something else (another rate, another window; or dropped it): its
    /// limiters' refunds would give back by the old parameters what the
    /// new rule reads by its own, so requests still in flight make none.
    pub(super) retired: Arc<std::sync::atomic::AtomicBool>,
    /// The flags of the rules this one succeeded alike across reloads
    /// (their requests may still be in flight): set with its own, however
    /// many reloads later.
    pub(super) predecessors: std::sync::Mutex<Vec<Arc<std::sync::atomic::AtomicBool>>>,
}

impl<B, L: tollgate_core::Limiter> Bound<B, L> {
    /// Whether this rule's refunds mean under `next` what they meant here:
    /// the same name and, plan by plan, a limit whose refunds are alike
    /// ([`Algorithm::refunds_alike`](tollgate_core::Algorithm::refunds_alike)).
    fn refunds_alike(&self, next: &Self) -> bool {
        let alike = |old: &L, new: &L| new.rule().algorithm().refunds_alike(old.rule().algorithm());
        self.responder.rule == next.responder.rule
            && alike(&self.limiter, &next.limiter)
            && self.plans.len() == next.plans.len()
            && self
                .plans
                .iter()
                .zip(next.plans.iter())
                .all(|(a, b)| match (a, b) {
                    (Some((a, _)), Some((b, _))) => alike(a, b),
                    (None, None) => true,
                    _ => false,
                })
    }
}

/// Locks `m`, a poisoned lock included.
fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl<B, L> Bound<B, L> {
    /// Whether a reload retired this rule: refunds are not made.
    pub(super) fn retired(&self) -> bool {
        self.retired.load(std::sync::atomic::Ordering::Acquire)
    }

    /// The limiter and responder of plan `plan` (0: the default).
    pub(super) fn at(&self, plan: u8) -> (&L, &Arc<Responder>) {
        match self.variant(plan) {
            Some(p) => (&p.0, &p.1),
            None => (&self.limiter, &self.responder),
        }
    }

    /// Where plan `plan`'s own state is kept in per-plan lists
    /// ([`lowered`](Self::lowered), [`debts`](Self::debts)): its index
    /// where this rule names the plan, else 0 (the default's).
    fn own(&self, plan: u8) -> usize {
        if self.variant(plan).is_some() {
            usize::from(plan)
        } else {
            0
        }
    }

    /// What keys on plan `plan` owe, where the rule charges after the
    /// response.
    #[inline]
    pub(super) fn debts(&self, plan: u8) -> Option<&Arc<crate::rate_limit::Debts>> {
        if self.debts.is_empty() {
            return None;
        }
        self.debts.get(self.own(plan))
    }

    /// Plan `plan`'s own limiter and responder, where this rule names it.
    fn variant(&self, plan: u8) -> Option<&Variant<L>> {
        usize::from(plan)
            .checked_sub(1)
            .and_then(|p| self.plans.get(p))
            .and_then(Option::as_ref)
    }

    /// Plan `plan`'s headers and `d` as a key on step `level` of this
    /// rule's slowing ladder is shown them: the lowered limit, and what
    /// remains of it. Level 0 (or a ladder that blocks): as they are.
    pub(super) fn shown(&self, plan: u8, level: u8, d: Decision) -> (&Headers, Decision) {
        let headers = &self.at(plan).1.headers;
        let (Some(step), Some(ladder)) = (usize::from(level).checked_sub(1), &self.ladder) else {
            return (headers, d);
        };
        let own = self.own(plan);
        // A level past the last step (a state a longer ladder left) is
        // charged as the last: so it is shown.
        let Some(lowered) = self
            .lowered
            .get(own)
            .and_then(|steps| steps.get(step).or(steps.last()))
        else {
            return (headers, d);
        };
        let slows = ladder.rule().escalation();
        let level = u32::from(level);
        let d = Decision {
            limit: slows.shown(d.limit, level),
            remaining: slows.shown(d.remaining, level),
            ..d
        };
        (lowered, d)
    }

    /// Whether this rule only watches `key` (shadow, or a canary that
    /// leaves it out).
    pub(super) fn shadows(&self, key: &[u8]) -> bool {
        if self.responder.shadow {
            return true;
        }
        self.canary.is_some_and(|c| !in_canary(c, key))
    }

    /// The request's key under this rule, into `key`, counted (a missing
    /// one in `unkeyed` or `missing_key`), and whether it is the
    /// request's own (`false` for a shared fallback key).
    pub(super) fn key(&self, req: &Request<B>, key: &mut KeyBuf) -> (Keyed, bool) {
        if !self.keying.applies(req) {
            return (Keyed::Skip, false);
        }
        let m = &self.responder.metrics;
        let extracted = self.rule.key(req, key);
        let keyed = match self.keying.resolve(
            extracted,
            key,
            &self.responder.rule,
            Some((&m.unkeyed, &m.missing_key)),
        ) {
            // A rule that only watches (shadow, or a canary's rest) must
            // never refuse: a keyless request is left to the others.
            Keyed::Reject if self.responder.shadow || self.canary.is_some() => Keyed::Skip,
            keyed => keyed,
        };
        (keyed, extracted.is_some())
    }
}

pub(super) struct Shared<B, L> {
    pub(super) rules: Box<[Bound<B, L>]>,
    /// Who a rule's challenge is issued to (see
    /// [`challenge_requester`](super::PolicyLayerBuilder::challenge_requester)),
    /// where a rule has a challenge.
    pub(super) requester: Option<Arc<dyn super::rule::DynRule<B>>>,
    pub(super) standard: bool,
    pub(super) legacy: bool,
    /// `RateLimit-Policy` listing every enforced rule, per plan: what most
    /// responses send.
    pub(super) policy: Box<[Option<http::HeaderValue>]>,
    /// The plans rules name, and where a request's plan is read.
    pub(super) plans: super::plan::Plans<B>,
    /// How many rules are enforced (not shadow).
    pub(super) enforced: usize,
    /// Whether any rule is response-aware.
    pub(super) response_aware: bool,
    /// Whether any rule has an escalation ladder.
    pub(super) laddered: bool,
    /// Whether any rule counts the messages of upgraded connections.
    pub(super) messages: bool,
    /// Whether any rule warns past a share of its capacity.
    pub(super) warns: bool,
    /// Whether decisions are also counted by route.
    #[cfg_attr(not(feature = "axum"), allow(dead_code))]
    pub(super) route_label: bool,
    /// Sampled decision logs.
    pub(super) log: Option<crate::observe::DecisionLog>,
    /// Where refusals by the audited rules (bit `i`: rule `i`) go.
    /// The audit sink, the rules it records (a mask), and whether it
    /// records the access list's denials.
    pub(super) audit: Option<(Arc<dyn crate::observe::AuditSink>, u16, bool)>,
    /// The fleet's secret its records' key fingerprints are made with
    /// (else per process).
    pub(super) audit_secret: Option<Arc<[u8]>>,
    /// Idempotent repeats go uncharged.
    pub(super) idempotency: Option<super::idempotency::Idempotency<B, L>>,
    /// Allow and deny lists, checked before any rule, and their metrics
    /// (`rule` = the list's name).
    pub(super) access: Option<super::access::Listed>,
}

/// The policy a layer and its services decide by: replaced as a whole on
/// reload ([`PolicyLayer::replace`](super::PolicyLayer::replace)). Read
/// once per request, lock-free (`arc-swap`): a request keeps the policy
/// that decided it, and an old policy is freed with its last request.
pub(super) struct Current<B, L>(
    arc_swap::ArcSwap<Shared<B, L>>,
    /// One replacement at a time: each moves what the policy now holds to
    /// the next, and must see the policy it replaces.
    std::sync::Mutex<()>,
);

impl<B, L> Current<B, L> {
    pub(super) fn new(shared: Shared<B, L>) -> Self {
        Self(
            arc_swap::ArcSwap::from_pointee(shared),
            std::sync::Mutex::new(()),
        )
    }

    /// The policy now.
    #[inline]
    pub(super) fn load(&self) -> Arc<Shared<B, L>> {
        self.0.load_full()
    }

    /// Makes `next` the policy of every service from its next request,
    /// and retires the rules it changes or drops (see [`Bound::retired`]).
    pub(super) fn replace(&self, next: Arc<Shared<B, L>>)
    where
        L: tollgate_core::Limiter,
    {
        let _one_at_a_time = lock(&self.1);
        let now = self.0.load();
        if Arc::ptr_eq(&now, &next) {
            return;
        }
        // `next` is current from here (perhaps again: a layer installed
        // anew): its rules are live, and its debt tables forward nothing.
        for rule in next.rules.iter() {
            rule.retired
                .store(false, std::sync::atomic::Ordering::Release);
            for debts in rule.debts.iter() {
                debts.current();
            }
        }
        // What keys owe moves first: a request the new policy decides
        // finds its key's debt there.
        for rule in now.rules.iter() {
            if let Some(successor) = next.rules.iter().find(|n| rule.refunds_alike(n)) {
                for (new, old) in successor.debts.iter().zip(rule.debts.iter()) {
                    new.inherit(old);
                }
            }
        }
        let old = self.0.swap(Arc::clone(&next));
        for rule in old.rules.iter() {
            let mut flags = std::mem::take(&mut *lock(&rule.predecessors));
            flags.push(Arc::clone(&rule.retired));
            match next.rules.iter().find(|n| rule.refunds_alike(n)) {
                // Its successor carries its flags on.
                Some(successor) => lock(&successor.predecessors).extend(flags),
                None => {
                    for flag in flags {
                        flag.store(true, std::sync::atomic::Ordering::Release);
                    }
                }
            }
        }
    }
}

/// A canary's threshold on the key hash for `share`, and the hash's keys,
/// derived from the rule's name: the same on every instance.
pub(super) fn canary(name: &str, share: f64, secret: Option<&[u8]>) -> (u64, (u64, u64)) {
    use sha2::{Digest, Sha256};
    let mut hasher = Sha256::new().chain_update(b"tollgate canary\0");
    if let Some(secret) = secret {
        hasher = hasher
            .chain_update(b"secret\0")
            .chain_update(secret)
            .chain_update(b"\0");
    }
    let digest = hasher.chain_update(name.as_bytes()).finalize();
    let word = |i: usize| {
        let mut b = [0u8; 8];
        if let Some(src) = digest.get(i..i.saturating_add(8)) {
            b.copy_from_slice(src);
        }
        u64::from_le_bytes(b)
    };
    // share × 2^64 (share is below 1).
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let threshold = (share * 18_446_744_073_709_551_616.0) as u64;
    (threshold, (word(0), word(8)))
}

/// Whether `key` is in the share of a canary `(threshold, hash keys)`.
pub(super) fn in_canary((threshold, (k0, k1)): (u64, (u64, u64)), key: &[u8]) -> bool {
    use std::hash::Hasher as _;
    let mut h = siphasher::sip::SipHasher13::new_with_keys(k0, k1);
    h.write(key);
    h.finish() < threshold
}

#[cfg(test)]
mod tests {
    use super::{canary, in_canary};

    #[test]
    fn a_canary_takes_its_share_of_keys_stably() {
        for share in [0.01, 0.25, 0.5, 0.9] {
            let c = canary("new-rule", share, None);
            let n = 100_000u32;
            let inside = (0..n).filter(|i| in_canary(c, &i.to_be_bytes())).count();
            #[allow(clippy::cast_precision_loss)]
            let got = inside as f64 / f64::from(n);
            assert!((got - share).abs() <= 0.02, "share {share}: {got}");
            // The same on another instance: it depends on the name only.
            assert_eq!(canary("new-rule", share, None), c);
        }
        // Growing the share keeps every key already in.
        let (small, large) = (canary("r", 0.05, None), canary("r", 0.25, None));
        for i in 0..10_000u32 {
            let k = i.to_be_bytes();
            assert!(!in_canary(small, &k) || in_canary(large, &k));
        }
        // Another rule's canary picks other keys.
        assert_ne!(canary("other", 0.25, None).1, canary("r", 0.25, None).1);
        // With the fleet's secret, membership is no longer computable from
        // the rule's name (policy-security review #12): another secret,
        // or none, picks other keys; the same secret the same ones.
        let secret = Some(&b"a secret every instance shares"[..]);
        assert_ne!(canary("r", 0.25, secret).1, canary("r", 0.25, None).1);
        assert_ne!(
            canary("r", 0.25, secret).1,
            canary("r", 0.25, Some(&b"another secret, a guess"[..])).1
        );
        assert_eq!(canary("r", 0.25, secret), canary("r", 0.25, secret));
    }
}
