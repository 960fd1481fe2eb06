//! Header values remembered per thread, so that sending one most
//! responses carry is a reference count, not a format and an allocation.

use http::header::HeaderValue;

/// How many header values each thread remembers.
pub(super) const RECENT: usize = 128;

/// The ways of a set: how many values that map to one place are kept.
pub(super) const WAYS: usize = 4;

/// The most numbers a remembered value is keyed by (two rules' or
/// periods' three numbers each); a value of more is rendered every time.
pub(super) const NUMBERS: usize = 6;

/// A header value and what it was rendered for.
pub(super) struct Remembered {
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
pub(super) type Values = crate::ways::Ways<Remembered, RECENT, WAYS>;

/// The numbers a value is rendered from, and how many there are.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) struct Numbers {
    len: u8,
    numbers: [u64; NUMBERS],
}

/// The id of a rule set's `RateLimit` values (their numbers name the
/// rules); [`new_id`] never returns it.
pub(super) const SET: u64 = u64::MAX;

/// The id of joined fields (keyed by where their parts' bytes are);
/// [`new_id`] never returns it.
pub(super) const JOIN: u64 = u64::MAX - 1;

/// Ids for the values [`remembered`] keeps apart: each header set (and
/// each of its fields) takes its own, unique in the process.
pub(super) fn new_id() -> u64 {
    static IDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    IDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// The key of the numbers `of`; `None` when there are more than
/// [`NUMBERS`].
pub(super) fn numbers(of: &[u64]) -> Option<Numbers> {
    let mut numbers = [0; NUMBERS];
    numbers.get_mut(..of.len())?.copy_from_slice(of);
    Some(Numbers {
        len: u8::try_from(of.len()).ok()?,
        numbers,
    })
}

/// `values` in `out`, as a slice; all of `out` (one more than a value
/// may be keyed by, so it is not remembered) when there are more.
pub(super) fn pack(values: impl Iterator<Item = u64>, out: &mut [u64; NUMBERS + 1]) -> &[u64] {
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
pub(super) fn hash_of(id: u64, key: &Numbers) -> u64 {
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
pub(super) fn remembered(
    id: u64,
    of: &[u64],
    render: impl FnOnce() -> Option<HeaderValue>,
) -> Option<HeaderValue> {
    remembered_if(id, of, |_| true, render)
}

/// [`remembered`] for a key that may not determine the value: a value
/// found is sent only if `valid` accepts it, else it is rendered (and
/// kept) again.
pub(super) fn remembered_if(
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
