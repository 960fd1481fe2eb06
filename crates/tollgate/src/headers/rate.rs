//! The headers of a rate rule, and of a set of rules answered together.

use std::fmt::Write as _;

use http::header::{HeaderValue, RETRY_AFTER};
use http::HeaderMap;
use tollgate_core::{Decision, Outcome, Rule};

use super::cache::{new_id, pack, remembered, NUMBERS, SET};
use super::merge::add_items;
use super::render::{number, push_decimal, Buf};
use super::{ceil_secs, field, retry_after_secs, t_secs};

/// The `RateLimit-Policy` value listing `rules` in order, for a rule set
/// to build once: most responses list every rule.
pub(crate) fn set_policy<'a>(rules: impl Iterator<Item = &'a Headers>) -> Option<HeaderValue> {
    let mut v = Vec::new();
    for h in rules {
        if let Some(p) = &h.policy {
            if !v.is_empty() {
                v.extend_from_slice(b", ");
            }
            v.extend_from_slice(p.as_bytes());
        }
    }
    HeaderValue::from_maybe_shared(bytes::Bytes::from(v)).ok()
}
/// Sets the `RateLimit-Policy` and `RateLimit` fields of a rule set, one
/// item per rule, in order (each `(rule's headers, decision)`), merged
/// with whatever an inner layer set; `Retry-After` when `retry_after`
/// (nanoseconds) is given; and the legacy headers of the most restrictive
/// item (or of item `named`, the rule a rejection names) when `legacy`.
/// `policy` is the `RateLimit-Policy` of exactly these items when the
/// caller has it built (see [`set_policy`]).
pub(crate) fn apply_set(
    headers: &mut HeaderMap,
    items: &[(&Headers, Decision)],
    policy: Option<&HeaderValue>,
    retry_after: Option<u64>,
    standard: bool,
    legacy: bool,
    named: Option<usize>,
) {
    if let Some(v) = retry_after.and_then(|r| number(retry_after_secs(r))) {
        let _ = headers.try_insert(RETRY_AFTER, v);
    }
    if standard && !items.is_empty() {
        let policy = match policy {
            Some(p) => Some(p.clone()),
            None => set_policy(items.iter().map(|(h, _)| *h)),
        };
        if let Some(v) = policy {
            add_items(headers, field::ratelimit_policy(), v);
        }
        // Which rules, in order, and their numbers determine the value.
        let mut of = [0; NUMBERS + 1];
        let rules = items
            .iter()
            .flat_map(|(h, d)| [h.id, d.remaining, t_secs(d)]);
        let value = remembered(SET, pack(rules, &mut of), || {
            // One allocation, handed to the header value without a copy.
            let mut state = Vec::with_capacity(items.len().saturating_mul(48));
            for (i, (h, d)) in items.iter().enumerate() {
                if i > 0 {
                    state.extend_from_slice(b", ");
                }
                h.push_item(&mut state, d.remaining, t_secs(d));
            }
            HeaderValue::from_maybe_shared(bytes::Bytes::from(state)).ok()
        });
        if let Some(v) = value {
            add_items(headers, field::ratelimit(), v);
        }
    }
    let tightest = named.and_then(|i| items.get(i)).or_else(|| {
        items.iter().min_by_key(|(_, d)| match d.outcome {
            Outcome::Allow { .. } => (1, d.remaining),
            _ => (0, 0),
        })
    });
    if let (true, Some((h, d))) = (legacy, tightest) {
        h.apply_legacy(headers, d);
    }
}
/// Which headers to send, precomputed per layer.
#[derive(Debug, Clone)]
pub(crate) struct Headers {
    /// Tells this rule's `RateLimit` values from other rules' in the
    /// per-thread cache ([`remembered`]); unique in the process.
    pub(crate) id: u64,
    /// `"name";r=`, the start of every `RateLimit` value.
    prefix: Box<[u8]>,
    policy: Option<HeaderValue>,
    limit: Option<HeaderValue>,
    pub(crate) standard: bool,
    pub(crate) legacy: bool,
}

impl Headers {
    pub(crate) fn new(rule: &Rule, standard: bool, legacy: bool) -> Self {
        Self::lowered(rule, rule.capacity(), standard, legacy)
    }

    /// `rule`'s headers stating `capacity` as its limit (a key a slowing
    /// ladder put on a lower step is told its lowered limit).
    pub(crate) fn lowered(rule: &Rule, capacity: u64, standard: bool, legacy: bool) -> Self {
        let w = ceil_secs(rule.window()).max(1);
        let mut policy = Buf::new();
        let policy = write!(policy, "\"{}\";q={capacity};w={w}", rule.name())
            .ok()
            .and_then(|()| policy.value());
        Self {
            id: new_id(),
            prefix: format!("\"{}\";r=", rule.name()).into_bytes().into(),
            policy,
            limit: number(capacity),
            standard,
            legacy,
        }
    }

    /// Adds the headers for `d`, and `Retry-After` when `rejected` and the
    /// decision is a denial for now (never on a response the inner service
    /// produced, e.g. in shadow mode).
    pub(crate) fn apply(&self, headers: &mut HeaderMap, d: &Decision, rejected: bool) {
        let t = t_secs(d);
        if let (true, Outcome::Deny { retry_after }) = (rejected, d.outcome) {
            if let Some(v) = number(retry_after_secs(retry_after)) {
                let _ = headers.try_insert(RETRY_AFTER, v);
            }
        }
        if self.standard {
            if let Some(p) = &self.policy {
                add_items(headers, field::ratelimit_policy(), p.clone());
            }
            if let Some(v) = self.rate_limit(d.remaining, t) {
                add_items(headers, field::ratelimit(), v);
            }
        }
        if self.legacy {
            self.apply_legacy(headers, d);
        }
    }

    /// The `RateLimit` value `"name";r=<r>;t=<t>`: a shared copy of one
    /// this thread rendered lately when there is one (most responses of a
    /// rule carry one of a few values: a key's first request, a key at its
    /// limit), else rendered and remembered.
    fn rate_limit(&self, r: u64, t: u64) -> Option<HeaderValue> {
        remembered(self.id, &[r, t], || {
            let mut item = Vec::with_capacity(self.prefix.len().saturating_add(24));
            self.push_item(&mut item, r, t);
            HeaderValue::from_maybe_shared(bytes::Bytes::from(item)).ok()
        })
    }

    /// Appends this rule's `RateLimit` item, `"name";r=<r>;t=<t>`.
    fn push_item(&self, out: &mut Vec<u8>, r: u64, t: u64) {
        out.extend_from_slice(&self.prefix);
        push_decimal(out, r);
        out.extend_from_slice(b";t=");
        push_decimal(out, t);
    }

    /// `X-RateLimit-Limit`, `-Remaining` and `-Reset` for `d`.
    fn apply_legacy(&self, headers: &mut HeaderMap, d: &Decision) {
        if let Some(l) = &self.limit {
            let _ = headers.try_insert(field::x_ratelimit_limit(), l.clone());
        }
        if let Some(v) = number(d.remaining) {
            let _ = headers.try_insert(field::x_ratelimit_remaining(), v);
        }
        if let Some(v) = number(t_secs(d)) {
            let _ = headers.try_insert(field::x_ratelimit_reset(), v);
        }
    }
}
