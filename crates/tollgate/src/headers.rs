//! The standard rate-limit headers.
//!
//! - `RateLimit-Policy: "per-key";q=20;w=2` and `RateLimit: "per-key";r=17;t=1`
//!   (IETF httpapi RateLimit draft, structured-field syntax): the rule's
//!   capacity `q` over `w` seconds; `r` units remaining and `t` seconds
//!   until the budget is whole (on a denial: until the request may be
//!   retried).
//! - `Retry-After` on a denial: whole seconds, rounded up, never 0, equal to
//!   `t`, so a client honouring either header waits long enough.
//! - Optionally the legacy `X-RateLimit-Limit`, `X-RateLimit-Remaining`,
//!   `X-RateLimit-Reset` (seconds).

use std::fmt::{self, Write as _};

use http::header::{HeaderName, HeaderValue, RETRY_AFTER};
use http::HeaderMap;
use tollgate_core::{Decision, Outcome, PeriodStatus, Rule};

/// Our field names. Each is made where a map takes it, from a constant:
/// a clone of a static custom name calls through its bytes' vtable and
/// copies the result twice, each copy stalled on stores just made (perf
/// over `concurrency_overhead`: ~33 ns a response with two fields).
pub(crate) mod field {
    use http::header::HeaderName;

    macro_rules! names {
        ($($(#[$doc:meta])* $f:ident = $s:literal;)*) => {$(
            $(#[$doc])*
            #[inline]
            pub(crate) fn $f() -> HeaderName {
                const { HeaderName::from_static($s) }
            }
        )*};
    }

    names! {
        ratelimit = "ratelimit";
        ratelimit_policy = "ratelimit-policy";
        x_ratelimit_limit = "x-ratelimit-limit";
        x_ratelimit_remaining = "x-ratelimit-remaining";
        x_ratelimit_reset = "x-ratelimit-reset";
        /// Past a quota's soft limit: `Quota-Warning: "daily";used=85`,
        /// one item (the percentage used) per period past it.
        quota_warning = "quota-warning";
        /// Past a policy rule's warning share:
        /// `RateLimit-Warning: "per-key";used=85`, one item (the
        /// percentage used) per rule past it.
        ratelimit_warning = "ratelimit-warning";
    }
}

/// Whether `used` of `limit` is at least `share` of it: a warning is due.
/// In integers, the share in millionths: `0.56 × 100` is 56.00000000000001
/// in floats, and 56 used would not warn.
pub(crate) fn is_past(used: u64, limit: u64, share: f64) -> bool {
    // The share (validated: above 0, at most 1) in parts per million.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let ppm = (share * 1_000_000.0).round().clamp(0.0, 1_000_000.0) as u128;
    limit > 0 && u128::from(used).saturating_mul(1_000_000) >= ppm.saturating_mul(u128::from(limit))
}

#[cfg(test)]
mod share_tests {
    use super::is_past;

    #[test]
    fn shares_are_exact_at_their_thresholds() {
        // The review's case: 0.56 of 100 is 56.
        assert!(is_past(56, 100, 0.56));
        assert!(!is_past(55, 100, 0.56));
        for (used, limit, share) in [
            (7, 10, 0.7),
            (29, 100, 0.29),
            (3, 3, 1.0),
            (1, 3, 0.333_333),
        ] {
            assert!(is_past(used, limit, share), "{used}/{limit} at {share}");
            assert!(
                !is_past(used - 1, limit, share),
                "{}/{limit} at {share}",
                used - 1
            );
        }
        assert!(!is_past(0, 0, 0.5));
        assert!(is_past(u64::MAX, u64::MAX, 1.0));
    }
}

/// Appends the warning item `"name";used=<percent>` to `list` if `used`
/// of `limit` is at least `share` of it; returns whether it did.
pub(crate) fn push_warning<const N: usize>(
    list: &mut Buf<N>,
    name: &str,
    used: u64,
    limit: u64,
    share: f64,
) -> bool {
    if !is_past(used, limit, share) {
        return false;
    }
    if !list.as_bytes().is_empty() {
        list.push(b", ");
    }
    list.push(b"\"");
    list.push(name.as_bytes());
    list.push(b"\";used=");
    let percent = u128::from(used)
        .saturating_mul(100)
        .checked_div(u128::from(limit))
        .unwrap_or(100);
    list.push_u64(u64::try_from(percent).unwrap_or(100));
    true
}

const NANOS_PER_SEC: u64 = 1_000_000_000;

/// Whole seconds, rounded up.
pub(crate) fn ceil_secs(nanos: u64) -> u64 {
    nanos.div_ceil(NANOS_PER_SEC)
}

/// `Retry-After` seconds for a denial: rounded up, at least 1.
pub fn retry_after_secs(retry_after_nanos: u64) -> u64 {
    ceil_secs(retry_after_nanos).max(1)
}

/// The `t` a decision reports: seconds until the budget is whole, or until
/// a denied request may be retried.
pub(crate) fn t_secs(d: &Decision) -> u64 {
    match d.outcome {
        Outcome::Deny { retry_after } => retry_after_secs(retry_after),
        _ => ceil_secs(d.reset_after),
    }
}

/// A small stack buffer for formatting header values. What does not fit
/// is dropped whole, part by part; `N` is chosen so that nothing a valid
/// configuration renders is.
pub(crate) struct Buf<const N: usize = 320> {
    bytes: [u8; N],
    len: usize,
}

impl Buf {
    pub(crate) fn new() -> Self {
        Self::empty()
    }
}

impl<const N: usize> Buf<N> {
    pub(crate) fn empty() -> Self {
        Self {
            bytes: [0; N],
            len: 0,
        }
    }

    pub(crate) fn push(&mut self, s: &[u8]) {
        let end = self.len.saturating_add(s.len());
        if let Some(dst) = self.bytes.get_mut(self.len..end) {
            dst.copy_from_slice(s);
            self.len = end;
        }
    }

    /// Appends `n` in decimal, without the formatting machinery.
    pub(crate) fn push_u64(&mut self, mut n: u64) {
        let mut digits = [0u8; 20];
        let mut i = digits.len();
        loop {
            i = i.saturating_sub(1);
            if let Some(d) = digits.get_mut(i) {
                *d = b'0'.saturating_add((n % 10) as u8);
            }
            n /= 10;
            if n == 0 {
                break;
            }
        }
        self.push(digits.get(i..).unwrap_or_default());
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        self.bytes.get(..self.len).unwrap_or_default()
    }

    pub(crate) fn value(&self) -> Option<HeaderValue> {
        HeaderValue::from_bytes(self.as_bytes()).ok()
    }
}

impl<const N: usize> fmt::Write for Buf<N> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let end = self.len.checked_add(s.len()).ok_or(fmt::Error)?;
        self.bytes
            .get_mut(self.len..end)
            .ok_or(fmt::Error)?
            .copy_from_slice(s.as_bytes());
        self.len = end;
        Ok(())
    }
}

/// The most fields [`add_items`] scans for its name instead of looking it
/// up.
const SCANNED: usize = 8;

/// Sets a structured-field list header to `value`, or, when another
/// limiter (an inner layer) put items there already, lists ours first and
/// theirs after, in one field line. The common case, a field nobody set,
/// is one append.
pub(crate) fn add_items(headers: &mut HeaderMap, name: HeaderName, value: HeaderValue) {
    // An empty list must not be sent (RFC 8941), nor joined into ", x".
    if value.is_empty() {
        return;
    }
    // The common case, a field nobody set, is one append: cheaper than an
    // entry's insert (which takes http's displacing path even into an
    // empty slot). A few fields (a handler's own) are scanned for the
    // name rather than hashing it twice; in a larger map, the entry
    // decides. A full map drops ours; it never panics.
    if headers.keys_len() <= SCANNED && !headers.keys().any(|k| *k == name) {
        let _ = headers.try_append(name, value);
        return;
    }
    let mut entry = match headers.try_entry(name) {
        Ok(http::header::Entry::Vacant(vacant)) => {
            let _ = vacant.try_insert(value);
            return;
        }
        Ok(http::header::Entry::Occupied(entry)) => entry,
        Err(_) => return,
    };
    // An inner limiter sent items already: ours first, then every line of
    // theirs, one line, built in one allocation of the exact size.
    let ours = value.as_bytes();
    let theirs = || entry.iter().filter(|v| !v.is_empty());
    let join = || {
        // The exact size, so that the bytes are handed over as they are.
        let len = theirs().fold(ours.len(), |n, v| {
            n.saturating_add(2).saturating_add(v.len())
        });
        let mut joined = Vec::with_capacity(len);
        joined.extend_from_slice(ours);
        for inner in theirs() {
            joined.extend_from_slice(b", ");
            joined.extend_from_slice(inner.as_bytes());
        }
        HeaderValue::from_maybe_shared(bytes::Bytes::from(joined)).ok()
    };
    // One line of theirs (the usual stack): the same two values are
    // joined on most responses (both mostly come from the cache, so their
    // bytes stay where they are), and the join is remembered by where the
    // two parts' bytes are. A value found is used only if it is their
    // join, byte for byte: bytes freed and reused for others never match.
    let mut lines = entry.iter();
    let joined = match (lines.next(), lines.next()) {
        (Some(inner), None) if !inner.is_empty() => {
            let at = |v: &[u8]| v.as_ptr() as usize as u64;
            let (i, o) = (inner.as_bytes(), ours);
            let key = [at(o), o.len() as u64, at(i), i.len() as u64];
            let is_join = |v: &HeaderValue| {
                let v = v.as_bytes();
                v.len() == o.len().saturating_add(2).saturating_add(i.len())
                    && v.starts_with(o)
                    && v.ends_with(i)
                    && v.get(o.len()..o.len().saturating_add(2)) == Some(&b", "[..])
            };
            remembered_if(JOIN, &key, is_join, join)
        }
        _ => join(),
    };
    match joined {
        Some(joined) => drop(entry.insert(joined)),
        // Not a header value (it always is): theirs, then ours.
        None => entry.append(value),
    }
}

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

/// Appends `n` in decimal to `v`.
fn push_decimal(v: &mut Vec<u8>, n: u64) {
    let mut b = Buf::<20>::empty();
    b.push_u64(n);
    v.extend_from_slice(b.as_bytes());
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

/// Header values for the numbers most responses carry (`Retry-After`,
/// the legacy headers), built once per process: sending one is a copy of a
/// static reference, not an allocation.
const SMALL_NUMBERS: u64 = 1_024;

fn number(n: u64) -> Option<HeaderValue> {
    static TABLE: std::sync::OnceLock<Box<[HeaderValue]>> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        (0..SMALL_NUMBERS)
            .map(|i| HeaderValue::from_static(Box::leak(i.to_string().into_boxed_str())))
            .collect()
    });
    if let Some(v) = usize::try_from(n).ok().and_then(|i| table.get(i)) {
        return Some(v.clone());
    }
    let mut b = Buf::new();
    b.push_u64(n);
    b.value()
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

/// How many header values each thread remembers.
const RECENT: usize = 128;

/// The ways of a set: how many values that map to one place are kept.
const WAYS: usize = 4;

/// The most numbers a remembered value is keyed by (two rules' or
/// periods' three numbers each); a value of more is rendered every time.
const NUMBERS: usize = 6;

/// A header value and what it was rendered for.
struct Remembered {
    /// The hash of `id` and `key` (their set is part of it): a way that
    /// holds another value is passed over on one comparison.
    hash: u64,
    id: u64,
    key: Numbers,
    /// `None` the first time the value is seen: only a value sent again
    /// is kept (keeping one means sharing its bytes, an allocation a
    /// one-off value would pay for nothing).
    value: Option<HeaderValue>,
}

/// A thread's remembered values.
type Values = crate::ways::Ways<Remembered, RECENT, WAYS>;

/// The numbers a value is rendered from, and how many there are.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Numbers {
    len: u8,
    numbers: [u64; NUMBERS],
}

/// The id of a rule set's `RateLimit` values (their numbers name the
/// rules); [`new_id`] never returns it.
const SET: u64 = u64::MAX;

/// The id of joined fields (keyed by where their parts' bytes are);
/// [`new_id`] never returns it.
const JOIN: u64 = u64::MAX - 1;

/// Ids for the values [`remembered`] keeps apart: each header set (and
/// each of its fields) takes its own, unique in the process.
fn new_id() -> u64 {
    static IDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    IDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// The key of the numbers `of`; `None` when there are more than
/// [`NUMBERS`].
fn numbers(of: &[u64]) -> Option<Numbers> {
    let mut numbers = [0; NUMBERS];
    numbers.get_mut(..of.len())?.copy_from_slice(of);
    Some(Numbers {
        len: u8::try_from(of.len()).ok()?,
        numbers,
    })
}

/// `values` in `out`, as a slice; all of `out` (one more than a value
/// may be keyed by, so it is not remembered) when there are more.
fn pack(values: impl Iterator<Item = u64>, out: &mut [u64; NUMBERS + 1]) -> &[u64] {
    let mut n = 0usize;
    for v in values {
        if let Some(slot) = out.get_mut(n) {
            *slot = v;
        }
        n = n.saturating_add(1);
    }
    match out.get(..n) {
        Some(packed) => packed,
        None => out,
    }
}

/// The hash of (`id`, `key`); its top bits pick the set of ways where
/// the value is remembered.
fn hash_of(id: u64, key: &Numbers) -> u64 {
    let start = id.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ u64::from(key.len);
    key.numbers.iter().fold(start, |h, &n| {
        h.rotate_left(23)
            .wrapping_add(n)
            .wrapping_mul(0xc2b2_ae3d_27d4_eb4f)
    })
}

/// The value that header set `id` renders from `of`: a shared copy (a
/// reference count) of one this thread rendered lately when there is one,
/// else `render`'s. Most responses carry one of a few values (a key's
/// first request, a key at its limit, the same quota second), so sending
/// one is seldom a format, a byte-by-byte check, an allocation and a free.
/// Per thread, four-way set-associative, least recently sent out first
/// ([`RECENT`] entries a thread, allocated on the thread's first use): a
/// hit takes no lock and touches no shared cache line. A value is kept
/// the second time it is rendered, so one-off values cost what they did
/// without the cache. The caller's `id` and `of` must determine the
/// value.
fn remembered(
    id: u64,
    of: &[u64],
    render: impl FnOnce() -> Option<HeaderValue>,
) -> Option<HeaderValue> {
    remembered_if(id, of, |_| true, render)
}

/// [`remembered`] for a key that may not determine the value: a value
/// found is sent only if `valid` accepts it, else it is rendered (and
/// kept) again.
fn remembered_if(
    id: u64,
    of: &[u64],
    valid: impl Fn(&HeaderValue) -> bool,
    render: impl FnOnce() -> Option<HeaderValue>,
) -> Option<HeaderValue> {
    thread_local! {
        static VALUES: std::cell::RefCell<Option<Box<Values>>> =
            const { std::cell::RefCell::new(None) };
    }
    let Some(key) = numbers(of) else {
        return render();
    };
    // Four ways: the values a response sends together seldom take turns
    // evicting each other; a new value takes an empty way, else the
    // least recently sent's.
    let hash = hash_of(id, &key);
    let set = Values::set_of(hash);
    let this = |e: &Remembered| e.hash == hash && e.id == id && e.key == key;
    // What the set knows of the value: kept (a copy to send), or seen
    // once before.
    let known = VALUES
        .try_with(|values| {
            let mut values = values.try_borrow_mut().ok()?;
            let values = values.get_or_insert_with(|| Box::new(Values::new()));
            values.tick();
            Some(values.find(set, this)?.value.clone())
        })
        .ok()
        .flatten();
    let seen = match known {
        Some(Some(value)) if valid(&value) => return Some(value),
        Some(_) => true,
        None => false,
    };
    let value = render()?;
    // Remembered: the value itself if it was seen before, else that it
    // was seen (a thread being torn down just renders).
    let _ = VALUES.try_with(|values| {
        let Ok(mut values) = values.try_borrow_mut() else {
            return;
        };
        if let Some(values) = values.as_mut() {
            let entry = Remembered {
                hash,
                id,
                key,
                value: seen.then(|| value.clone()),
            };
            values.put(set, this, entry);
        }
    });
    Some(value)
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tollgate_core::{Limit, Rate};

    fn decision(outcome: Outcome, remaining: u64, reset: u64) -> Decision {
        Decision {
            outcome,
            limit: 20,
            remaining,
            reset_after: reset,
        }
    }

    #[test]
    fn structured_fields_and_retry_after() {
        let rule = Rule::new("per-key", Limit::gcra(Rate::per_second(10), 20)).unwrap();
        let h = Headers::new(&rule, true, true);
        let mut m = HeaderMap::new();
        h.apply(
            &mut m,
            &decision(
                Outcome::Deny {
                    retry_after: 100_000_000,
                },
                0,
                2_000_000_000,
            ),
            true,
        );
        assert_eq!(m["ratelimit-policy"], "\"per-key\";q=20;w=2");
        assert_eq!(m["ratelimit"], "\"per-key\";r=0;t=1");
        assert_eq!(m["retry-after"], "1");
        assert_eq!(m["x-ratelimit-limit"], "20");
        assert_eq!(m["x-ratelimit-remaining"], "0");
        assert_eq!(m["x-ratelimit-reset"], "1");

        let mut m = HeaderMap::new();
        h.apply(
            &mut m,
            &decision(Outcome::Allow { delay: 0 }, 17, 300_000_000),
            false,
        );
        assert_eq!(m["ratelimit"], "\"per-key\";r=17;t=1");
        assert!(m.get("retry-after").is_none());

        // A denial let through (shadow mode) reports but does not tell the
        // client to retry later.
        let mut m = HeaderMap::new();
        h.apply(
            &mut m,
            &decision(Outcome::Deny { retry_after: 1 }, 0, 1),
            false,
        );
        assert_eq!(m["ratelimit"], "\"per-key\";r=0;t=1");
        assert!(m.get("retry-after").is_none());
    }

    #[test]
    fn remembered_values_belong_to_their_rule_and_numbers() {
        // Two rules, the same numbers: each response names its own rule,
        // however the cache's slots are shared, evicted and hit again
        // (far more values than it holds, each asked for twice).
        let rule = |name: &str| Rule::new(name, Limit::gcra(Rate::per_second(10), 20)).unwrap();
        let (a, b) = (
            Headers::new(&rule("a"), true, false),
            Headers::new(&rule("b"), true, false),
        );
        for round in 0..2 {
            for r in 0..(4 * RECENT as u64) {
                for (h, name) in [(&a, "a"), (&b, "b")] {
                    let t = r % 3;
                    let mut m = HeaderMap::new();
                    let d = decision(Outcome::Allow { delay: 0 }, r, t * 1_000_000_000);
                    h.apply(&mut m, &d, false);
                    assert_eq!(
                        m["ratelimit"],
                        format!("\"{name}\";r={r};t={t}").as_str(),
                        "round {round}"
                    );
                }
            }
        }
        // Two rules whose values share a set of ways (same numbers), and
        // neither is ever sent the other's.
        let mut c = Headers::new(&rule("c"), true, false);
        // (An id no other header set has: past every one made so far.)
        c.id = (new_id()..)
            .find(|&id| {
                let at = |id| Values::set_of(hash_of(id, &numbers(&[7, 1]).unwrap()));
                at(id) == at(a.id)
            })
            .unwrap();
        for _ in 0..3 {
            for (h, name) in [(&a, "a"), (&c, "c")] {
                let mut m = HeaderMap::new();
                h.apply(
                    &mut m,
                    &decision(Outcome::Allow { delay: 0 }, 7, 1_000_000_000),
                    false,
                );
                assert_eq!(m["ratelimit"], format!("\"{name}\";r=7;t=1").as_str());
            }
        }
    }

    #[test]
    fn values_sent_again_stay_remembered() {
        let renders = std::cell::Cell::new(0);
        let render = || {
            renders.set(renders.get() + 1);
            Some(HeaderValue::from_static("x"))
        };
        // Ids whose values of [1] share one set of ways.
        let set = |id| Values::set_of(hash_of(id, &numbers(&[1]).unwrap()));
        let base = new_id();
        let ids: Vec<u64> = (base..)
            .filter(|&id| set(id) == set(base))
            .take(WAYS + 20)
            .collect();
        // A value is kept the second time it is rendered: as many values
        // as the set has ways, sent in turn, are each rendered twice.
        for _ in 0..10 {
            for &id in &ids[..WAYS] {
                remembered(id, &[1], render);
            }
        }
        assert_eq!(renders.get(), 2 * WAYS);
        // Other numbers are another value, rendered (twice) on their own.
        renders.set(0);
        for _ in 0..3 {
            remembered(ids[0], &[2], render);
            remembered(ids[0], &[1, 0], render);
        }
        assert_eq!(renders.get(), 4);
        // Two values sent on every response, and a stream of values sent
        // once into the same set: once the two are kept again (they were
        // the least recently sent when the stream began), they are never
        // rendered again.
        let (a, b) = (ids[0], ids[1]);
        for (i, &once) in ids[WAYS..].iter().enumerate() {
            if i == 2 {
                renders.set(0);
            }
            remembered(once, &[1], render);
            remembered(a, &[1], render);
            remembered(b, &[1], render);
        }
        assert_eq!(renders.get(), 18);
    }

    #[test]
    fn remembered_multi_item_values_follow_every_number() {
        // Concurrency: two layers of the same shape but other names, an
        // adaptive q, every r; each value is the one formatted for it.
        let allow = |r| decision(Outcome::Allow { delay: 0 }, r, 0);
        let layers = [("a", "svc"), ("b", "svc")]
            .map(|(k, s)| (k, ConcurrencyHeaders::new(&[(k, Some(8)), (s, None)], true)));
        for round in 0..2 {
            for q in [10u64, 11] {
                for r in 0..8 {
                    for (k, h) in &layers {
                        let mut m = HeaderMap::new();
                        h.apply(
                            &mut m,
                            &[
                                Item::new(8, Some(allow(r))),
                                Item::new(q, Some(allow(q - 1))),
                            ],
                        );
                        let want = format!("\"{k}\";r={r}, \"svc\";r={}", q - 1);
                        assert_eq!(m["ratelimit"], want.as_str(), "round {round}");
                        let policy = format!(
                            "\"{k}\";q=8;qu=\"concurrent-requests\", \"svc\";q={q};qu=\"concurrent-requests\""
                        );
                        assert_eq!(m["ratelimit-policy"], policy.as_str());
                    }
                }
            }
        }
        // Rule sets: the same numbers for other rules, or the same rules
        // in another order, are other values.
        let rule = |n: &str| Rule::new(n, Limit::gcra(Rate::per_second(10), 20)).unwrap();
        let (x, y, z) = (
            Headers::new(&rule("x"), true, false),
            Headers::new(&rule("y"), true, false),
            Headers::new(&rule("z"), true, false),
        );
        for round in 0..2 {
            for r in 0..50 {
                for (set, want) in [
                    ([&x, &y], format!("\"x\";r={r};t=0, \"y\";r={r};t=0")),
                    ([&y, &x], format!("\"y\";r={r};t=0, \"x\";r={r};t=0")),
                    ([&x, &z], format!("\"x\";r={r};t=0, \"z\";r={r};t=0")),
                ] {
                    let items = set.map(|h| (h, allow(r)));
                    let mut m = HeaderMap::new();
                    apply_set(&mut m, &items, None, None, true, false, None);
                    assert_eq!(m["ratelimit"], want.as_str(), "round {round}");
                }
            }
        }
        // Quota: two periods; the remaining count and the seconds left.
        use tollgate_core::calendar::Period;
        use tollgate_core::{PeriodStatus, QuotaDecision};
        let h = QuotaHeaders::new(&["day".to_owned(), "month".to_owned()], true);
        let s = 1_000_000_000;
        for round in 0..2 {
            for used in 0..100u64 {
                let status = |period, limit: u64, left: u64| PeriodStatus {
                    period,
                    limit,
                    remaining: limit - used,
                    reset_after: left * s,
                    length: 86_400 * s,
                };
                let d = QuotaDecision::new(
                    Outcome::Allow { delay: 0 },
                    &[
                        status(Period::Day, 100, used % 7),
                        status(Period::Month, 3_000, 9),
                    ],
                );
                let mut m = HeaderMap::new();
                h.apply(&mut m, &d);
                let want = format!(
                    "\"day\";r={};t={}, \"month\";r={};t=9",
                    100 - used,
                    used % 7,
                    3_000 - used
                );
                assert_eq!(m["ratelimit"], want.as_str(), "round {round}");
                assert_eq!(
                    m["ratelimit-policy"],
                    "\"day\";q=100;w=86400, \"month\";q=3000;w=86400"
                );
            }
        }
    }

    #[test]
    fn numbers_format_like_display() {
        for n in [0, 1, 9, 10, 99, 100, 1_023, 1_024, 12_345, u64::MAX] {
            let mut b = Buf::new();
            b.push_u64(n);
            assert_eq!(b.as_bytes(), n.to_string().as_bytes());
            assert_eq!(number(n).unwrap(), n.to_string().as_str());
        }
    }

    #[test]
    fn retry_after_rounds_up_and_is_never_zero() {
        assert_eq!(retry_after_secs(0), 1);
        assert_eq!(retry_after_secs(1), 1);
        assert_eq!(retry_after_secs(1_000_000_000), 1);
        assert_eq!(retry_after_secs(1_000_000_001), 2);
        assert_eq!(retry_after_secs(u64::MAX), 18_446_744_074);
    }

    #[test]
    fn concurrency_items_name_every_limit() {
        let h = ConcurrencyHeaders::new(&[("per-key", Some(2)), ("service", Some(100))], true);
        let mut m = HeaderMap::new();
        let allow = decision(Outcome::Allow { delay: 0 }, 1, 0);
        let busy = decision(
            Outcome::Deny {
                retry_after: 1_000_000_000,
            },
            0,
            0,
        );
        h.apply(
            &mut m,
            &[Item::new(2, Some(allow)), Item::new(100, Some(busy))],
        );
        assert_eq!(
            m["ratelimit-policy"],
            "\"per-key\";q=2;qu=\"concurrent-requests\", \"service\";q=100;qu=\"concurrent-requests\""
        );
        assert_eq!(m["ratelimit"], "\"per-key\";r=1, \"service\";r=0;t=1");
        // An adaptive limit's q is rendered per response; an undecided
        // limit has no RateLimit item.
        let h = ConcurrencyHeaders::new(&[("per-key", Some(2)), ("adaptive", None)], true);
        let mut m = HeaderMap::new();
        h.apply(&mut m, &[Item::new(2, Some(busy)), Item::new(37, None)]);
        assert_eq!(
            m["ratelimit-policy"],
            "\"per-key\";q=2;qu=\"concurrent-requests\", \"adaptive\";q=37;qu=\"concurrent-requests\""
        );
        assert_eq!(m["ratelimit"], "\"per-key\";r=0;t=1");
        // One limit: the values are rendered ahead, the same as formatted.
        let h = ConcurrencyHeaders::new(&[("one", Some(3))], true);
        for r in 0..=3 {
            let mut m = HeaderMap::new();
            h.apply(
                &mut m,
                &[Item::new(
                    3,
                    Some(decision(Outcome::Allow { delay: 0 }, r, 0)),
                )],
            );
            assert_eq!(m["ratelimit"], format!("\"one\";r={r}").as_str());
            assert_eq!(
                m["ratelimit-policy"],
                "\"one\";q=3;qu=\"concurrent-requests\""
            );
        }
    }

    #[test]
    fn joins_are_remembered_only_for_the_same_parts() {
        let rule = Rule::new("outer", Limit::gcra(Rate::per_second(10), 20)).unwrap();
        let h = Headers::new(&rule, true, false);
        for round in 0..3 {
            for r in 0..5 {
                for inner in 0..5 {
                    // An inner value in fresh bytes each time (freed with
                    // the response, so the next one may take its place),
                    // and one that stays where it is.
                    let fresh = HeaderValue::from_str(&format!("\"inner\";r={inner}")).unwrap();
                    let kept = HeaderValue::from_static("\"kept\";r=9");
                    for (theirs, text) in [
                        (fresh, format!("\"inner\";r={inner}")),
                        (kept, "\"kept\";r=9".to_owned()),
                    ] {
                        let mut m = HeaderMap::new();
                        m.insert(field::ratelimit(), theirs);
                        h.apply(&mut m, &decision(Outcome::Allow { delay: 0 }, r, 0), false);
                        let want = format!("\"outer\";r={r};t=0, {text}");
                        assert_eq!(m["ratelimit"], want.as_str(), "round {round}");
                        assert_eq!(m.get_all("ratelimit").iter().count(), 1);
                    }
                }
            }
        }
    }

    #[test]
    fn stacked_layers_share_one_field() {
        let rule = Rule::new("per-key", Limit::gcra(Rate::per_second(10), 20)).unwrap();
        let h = Headers::new(&rule, true, false);
        let mut m = HeaderMap::new();
        m.insert(
            field::ratelimit(),
            HeaderValue::from_static("\"inner\";r=1"),
        );
        h.apply(&mut m, &decision(Outcome::Allow { delay: 0 }, 17, 0), false);
        assert_eq!(m["ratelimit"], "\"per-key\";r=17;t=0, \"inner\";r=1");
        assert_eq!(m.get_all("ratelimit").iter().count(), 1);
    }

    #[test]
    fn an_inner_field_is_found_among_few_fields_or_many() {
        let rule = Rule::new("outer", Limit::gcra(Rate::per_second(10), 20)).unwrap();
        let h = Headers::new(&rule, true, false);
        // Around SCANNED, where the search for the name changes method;
        // the inner field first, last, or absent.
        for others in [0, 1, SCANNED - 1, SCANNED, SCANNED + 1, 3 * SCANNED] {
            for inner in [None, Some(0), Some(others)] {
                let mut m = HeaderMap::new();
                for i in 0..=others {
                    if inner == Some(i) {
                        m.insert(field::ratelimit(), HeaderValue::from_static("\"in\";r=1"));
                    }
                    if i < others {
                        let name = HeaderName::try_from(format!("x-other-{i}")).unwrap();
                        m.insert(name, HeaderValue::from_static("1"));
                    }
                }
                h.apply(&mut m, &decision(Outcome::Allow { delay: 0 }, 3, 0), false);
                let want = match inner {
                    Some(_) => "\"outer\";r=3;t=0, \"in\";r=1",
                    None => "\"outer\";r=3;t=0",
                };
                let case = format!("{others} others, inner at {inner:?}");
                assert_eq!(m["ratelimit"], want, "{case}");
                assert_eq!(m.get_all("ratelimit").iter().count(), 1, "{case}");
                assert_eq!(m.get_all("ratelimit-policy").iter().count(), 1, "{case}");
            }
        }
    }

    #[test]
    fn every_field_line_of_an_inner_limiter_is_kept() {
        let rule = Rule::new("outer", Limit::gcra(Rate::per_second(10), 20)).unwrap();
        let h = Headers::new(&rule, true, false);
        let mut m = HeaderMap::new();
        m.append(field::ratelimit(), HeaderValue::from_static("\"a\";r=1"));
        m.append(field::ratelimit(), HeaderValue::from_static(""));
        m.append(field::ratelimit(), HeaderValue::from_static("\"b\";r=2"));
        h.apply(&mut m, &decision(Outcome::Allow { delay: 0 }, 17, 0), false);
        assert_eq!(m["ratelimit"], "\"outer\";r=17;t=0, \"a\";r=1, \"b\";r=2");
        assert_eq!(m.get_all("ratelimit").iter().count(), 1);
    }

    #[test]
    fn a_rule_set_lists_every_rule_in_one_field() {
        let a = Rule::new("per-key", Limit::gcra(Rate::per_second(10), 20)).unwrap();
        let b = Rule::new("per-ip", Limit::fixed_window(100, Duration::from_secs(60))).unwrap();
        let (ha, hb) = (Headers::new(&a, true, true), Headers::new(&b, true, true));
        let mut m = HeaderMap::new();
        let deny = Decision {
            outcome: Outcome::Deny {
                retry_after: 30_000_000_000,
            },
            limit: 100,
            remaining: 0,
            reset_after: 30_000_000_000,
        };
        let items = [
            (&ha, decision(Outcome::Allow { delay: 0 }, 17, 300_000_000)),
            (&hb, deny),
        ];
        apply_set(
            &mut m,
            &items,
            None,
            Some(30_000_000_000),
            true,
            true,
            Some(1),
        );
        assert_eq!(
            m["ratelimit-policy"],
            "\"per-key\";q=20;w=2, \"per-ip\";q=100;w=60"
        );
        assert_eq!(m["ratelimit"], "\"per-key\";r=17;t=1, \"per-ip\";r=0;t=30");
        assert_eq!(m["retry-after"], "30");
        // The legacy headers describe the rule that holds the request back.
        assert_eq!(m["x-ratelimit-limit"], "100");
        assert_eq!(m["x-ratelimit-reset"], "30");
    }

    #[test]
    fn policy_window_is_whole_seconds() {
        let rule = Rule::new("w", Limit::fixed_window(5, Duration::from_millis(1_500))).unwrap();
        let h = Headers::new(&rule, true, false);
        let mut m = HeaderMap::new();
        h.apply(&mut m, &decision(Outcome::Allow { delay: 0 }, 4, 0), false);
        assert_eq!(m["ratelimit-policy"], "\"w\";q=5;w=2");
        assert!(m.get("x-ratelimit-limit").is_none());
    }
}
