//! The headers of a concurrency layer.

use http::header::HeaderValue;
use http::HeaderMap;
use tollgate_core::{Decision, Outcome};

use super::cache::{new_id, pack, remembered, NUMBERS};
use super::merge::add_items;
use super::render::Buf;
use super::{field, retry_after_secs};

/// The headers of a concurrency layer: every limit it enforces is one
/// item, e.g. `RateLimit-Policy: "per-key";q=2;qu="concurrent-requests",
/// "service";q=100;qu="concurrent-requests"` and `RateLimit: "per-key";r=1,
/// "service";r=57`. A denial's item carries `t` (seconds until a retry;
/// the rejection sets `Retry-After` to the same).
#[derive(Debug, Clone)]
pub(crate) struct ConcurrencyHeaders {
    /// Each limit's `"name"`.
    names: Box<[Box<[u8]>]>,
    /// The whole policy value, when every limit's `q` is fixed.
    policy: Option<HeaderValue>,
    /// Ids of this layer's `RateLimit-Policy` and `RateLimit` values in
    /// the per-thread cache ([`remembered`]).
    ids: [u64; 2],
    /// For a layer of one limit, the `RateLimit` value of every `r` from 0
    /// to `q` (up to [`CACHED`]): an allowed response sends a shared copy
    /// instead of formatting and allocating one.
    cached: Box<[HeaderValue]>,
    pub(crate) standard: bool,
}

/// The most `RateLimit` values a layer renders ahead.
const CACHED: u64 = 1_024;

/// One limit's numbers for the headers, compact: it travels in every
/// response future.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Item {
    /// The limit (an adaptive limit's current value).
    q: u32,
    /// Permits left; [`Item::NONE`] when the limit was not decided.
    r: u32,
    /// Seconds until a retry, on a denial for now; else [`Item::NONE`].
    t: u32,
}

impl Default for Item {
    fn default() -> Self {
        Self {
            q: 0,
            r: Self::NONE,
            t: Self::NONE,
        }
    }
}

fn small(n: u64) -> u32 {
    u32::try_from(n)
        .unwrap_or(Item::NONE - 1)
        .min(Item::NONE - 1)
}

impl Item {
    const NONE: u32 = u32::MAX;

    pub(crate) fn new(q: u64, decision: Option<Decision>) -> Self {
        Self {
            q: small(q),
            r: decision.map_or(Self::NONE, |d| small(d.remaining)),
            t: match decision.map(|d| d.outcome) {
                Some(Outcome::Deny { retry_after }) => small(retry_after_secs(retry_after)),
                _ => Self::NONE,
            },
        }
    }

    fn r(&self) -> Option<u64> {
        (self.r != Self::NONE).then_some(u64::from(self.r))
    }

    fn t(&self) -> Option<u64> {
        (self.t != Self::NONE).then_some(u64::from(self.t))
    }
}

impl ConcurrencyHeaders {
    /// `limits`: each limit's name and, when fixed, its maximum.
    pub(crate) fn new(limits: &[(&str, Option<u64>)], standard: bool) -> Self {
        let names: Box<[Box<[u8]>]> = limits
            .iter()
            .map(|(name, _)| format!("\"{name}\"").into_bytes().into_boxed_slice())
            .collect();
        let policy = limits
            .iter()
            .map(|(name, q)| q.map(|q| format!("\"{name}\";q={q};qu=\"concurrent-requests\"")))
            .collect::<Option<Vec<_>>>()
            .and_then(|items| HeaderValue::from_str(&items.join(", ")).ok());
        let cached: Box<[HeaderValue]> = match (limits, standard) {
            ([(name, Some(q))], true) if *q <= CACHED => (0..=*q)
                .filter_map(|r| {
                    HeaderValue::from_maybe_shared(bytes::Bytes::from(format!("\"{name}\";r={r}")))
                        .ok()
                })
                .collect(),
            _ => Box::new([]),
        };
        Self {
            names,
            policy,
            ids: [new_id(), new_id()],
            cached,
            standard,
        }
    }

    /// Adds the headers for `items` (one per limit, in order).
    pub(crate) fn apply(&self, headers: &mut HeaderMap, items: &[Item]) {
        if !self.standard {
            return;
        }
        let policy = self.policy.clone().or_else(|| {
            let mut of = [0; NUMBERS + 1];
            let of = pack(items.iter().map(|it| u64::from(it.q)), &mut of);
            remembered(self.ids[0], of, || {
                let mut b = Buf::new();
                for (i, (name, item)) in self.names.iter().zip(items).enumerate() {
                    if i > 0 {
                        b.push(b", ");
                    }
                    b.push(name);
                    b.push(b";q=");
                    b.push_u64(u64::from(item.q));
                    b.push(b";qu=\"concurrent-requests\"");
                }
                b.value()
            })
        });
        if let Some(p) = policy {
            add_items(headers, field::ratelimit_policy(), p);
        }
        if let [item] = items {
            if let (Some(r), None) = (item.r(), item.t()) {
                if let Some(v) = usize::try_from(r).ok().and_then(|r| self.cached.get(r)) {
                    add_items(headers, field::ratelimit(), v.clone());
                    return;
                }
            }
        }
        // Each item's r and t (NONE where absent) determine the value.
        let mut of = [0; NUMBERS + 1];
        let rt = items
            .iter()
            .flat_map(|it| [u64::from(it.r), u64::from(it.t)]);
        let value = remembered(self.ids[1], pack(rt, &mut of), || {
            let mut b = Buf::new();
            for (name, item) in self.names.iter().zip(items) {
                let Some(r) = item.r() else { continue };
                if !b.as_bytes().is_empty() {
                    b.push(b", ");
                }
                b.push(name);
                b.push(b";r=");
                b.push_u64(r);
                if let Some(t) = item.t() {
                    b.push(b";t=");
                    b.push_u64(t);
                }
            }
            // No item decided: no field (an empty list is not sent).
            b.value().filter(|v| !v.is_empty())
        });
        if let Some(v) = value {
            add_items(headers, field::ratelimit(), v);
        }
    }
}
