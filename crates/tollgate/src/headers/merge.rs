//! Joining our structured-field items with those an inner limiter set.

use http::header::{HeaderName, HeaderValue};
use http::HeaderMap;

use super::cache::{remembered_if, JOIN};

/// The most fields [`add_items`] scans for its name instead of looking it
/// up.
pub(super) const SCANNED: usize = 8;

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
