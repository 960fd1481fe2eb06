//! The headers of a quota layer.

use http::header::HeaderName;
use http::HeaderMap;
use tollgate_core::PeriodStatus;

use super::cache::{new_id, pack, remembered, NUMBERS};
use super::merge::add_items;
use super::render::Buf;
use super::{ceil_secs, field};

/// The headers of a quota layer: every period is one item, e.g.
/// `RateLimit-Policy: "daily";q=1000;w=86400` and
/// `RateLimit: "daily";r=950;t=3600` (`t`: seconds until the period ends).
/// A month's `w` is the current month's length.
#[derive(Debug, Clone)]
pub(crate) struct QuotaHeaders {
    /// Each period's `"name"`.
    names: Box<[Box<[u8]>]>,
    /// Ids of this layer's `RateLimit-Policy` and `RateLimit` values in
    /// the per-thread cache ([`remembered`]).
    ids: [u64; 2],
    pub(crate) standard: bool,
}

impl QuotaHeaders {
    /// One item per period, named `names` in order.
    pub(crate) fn new(names: &[String], standard: bool) -> Self {
        Self {
            names: names
                .iter()
                .map(|n| format!("\"{n}\"").into_bytes().into_boxed_slice())
                .collect(),
            ids: [new_id(), new_id()],
            standard,
        }
    }

    /// Adds the headers for `d`.
    pub(crate) fn apply(&self, headers: &mut HeaderMap, d: &tollgate_core::QuotaDecision) {
        if !self.standard {
            return;
        }
        let [policy_id, left_id] = self.ids;
        let policy = |p: &PeriodStatus| [p.limit, ceil_secs(p.length)];
        self.field(
            headers,
            field::ratelimit_policy(),
            policy_id,
            d,
            [b";q=", b";w="],
            policy,
        );
        let left = |p: &PeriodStatus| [p.remaining, ceil_secs(p.reset_after)];
        self.field(
            headers,
            field::ratelimit(),
            left_id,
            d,
            [b";r=", b";t="],
            left,
        );
    }

    /// Adds field `name`: one item per period, `"name";<a>=<x>;<b>=<y>`
    /// with `[x, y] = numbers(period)`, remembered under `id`.
    fn field(
        &self,
        headers: &mut HeaderMap,
        name: HeaderName,
        id: u64,
        d: &tollgate_core::QuotaDecision,
        params: [&[u8]; 2],
        numbers: impl Fn(&PeriodStatus) -> [u64; 2],
    ) {
        let mut of = [0; NUMBERS + 1];
        let packed = pack(d.periods().iter().flat_map(&numbers), &mut of);
        let value = remembered(id, packed, || {
            // Six periods with 64-byte names fit in 1 KiB.
            let mut b = Buf::<1024>::empty();
            for (i, (name, p)) in self.names.iter().zip(d.periods()).enumerate() {
                if i > 0 {
                    b.push(b", ");
                }
                b.push(name);
                for (param, n) in params.iter().zip(numbers(p)) {
                    b.push(param);
                    b.push_u64(n);
                }
            }
            b.value()
        });
        if let Some(v) = value {
            add_items(headers, name, v);
        }
    }
}
