//! Joining our structured-field items with those an inner limiter set.

use http::header::{HeaderName, HeaderValue};
use http::HeaderMap;
use std::cell::{Cell, RefCell};

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
    // Inside a composed layer, its limits' items are joined once, as it
    // hands the response on ([`Deferred`]).
    if DEFERRING.try_with(Cell::get).unwrap_or(false) {
        let mut item = Some((name, value));
        let _ = HELD.try_with(|held| {
            if let Ok(mut held) = held.try_borrow_mut() {
                held.extend(item.take());
            }
        });
        if let Some((name, value)) = item {
            add_now(headers, name, value);
        }
        return;
    }
    add_now(headers, name, value);
}

/// [`add_items`], at once.
fn add_now(headers: &mut HeaderMap, name: HeaderName, value: HeaderValue) {
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

thread_local! {
    /// Whether a composed layer holds our fields' items back on this
    /// thread now ([`Deferred`]): read by every [`add_items`], so a flag
    /// of its own (no destructor, nothing to set up).
    static DEFERRING: Cell<bool> = const { Cell::new(false) };
    /// The items held back.
    static HELD: RefCell<Vec<(HeaderName, HeaderValue)>> = const { RefCell::new(Vec::new()) };
}

/// While alive, the items our layers add to a field (`RateLimit`,
/// `RateLimit-Policy`, the warnings) are held back, to be joined once by
/// [`finish`](Self::finish): a composed layer's limits each add theirs,
/// and the field is built once instead of joined again at every limit.
/// Started around one poll of the composed layer's inner future (its
/// limits add their items in the poll that hands the response on; the
/// service they protect adds at once, under [`AtOnce`]). Dropped
/// without `finish` (no response, an error, a panic), what was held back
/// is dropped.
#[cfg(all(feature = "axum", feature = "config"))]
pub(crate) struct Deferred {
    mark: usize,
    was: bool,
}

#[cfg(all(feature = "axum", feature = "config"))]
impl Deferred {
    pub(crate) fn start() -> Option<Self> {
        let mark = HELD
            .try_with(|held| held.try_borrow().map(|h| h.len()).ok())
            .ok()
            .flatten()?;
        let was = DEFERRING.try_with(|d| d.replace(true)).ok()?;
        Some(Self { mark, was })
    }

    /// Adds what was held back to `headers`: each field's items as the
    /// limits added them one after another would have (the outermost
    /// first, then the next, then any lines the service sent), in one
    /// line built once.
    pub(crate) fn finish(self, headers: &mut HeaderMap) {
        let _ = HELD.try_with(|held| {
            let Ok(held) = held.try_borrow() else {
                return;
            };
            let held = held.get(self.mark..).unwrap_or_default();
            // The fields, in the order first met: each name, its items'
            // count and their bytes joined. (Names differ in length, so
            // comparing them is mostly comparing lengths.)
            let mut fields = [("", 0usize, 0usize); FIELDS];
            let mut met = 0;
            let mut more = false;
            for (name, value) in held {
                let name = name.as_str();
                match fields
                    .get_mut(..met)
                    .and_then(|f| f.iter_mut().find(|f| f.0 == name))
                {
                    Some(field) => {
                        field.1 = field.1.saturating_add(1);
                        field.2 = field.2.saturating_add(2).saturating_add(value.len());
                    }
                    None => match fields.get_mut(met) {
                        Some(field) => {
                            *field = (name, 1, value.len());
                            met = met.saturating_add(1);
                        }
                        // More fields than ours: added below, one by one.
                        None => more = true,
                    },
                }
            }
            for &(field, count, len) in fields.get(..met).unwrap_or_default() {
                // This field's items, added innermost first: the
                // outermost's leads the line.
                let mut items = held.iter().rev().filter(|(n, _)| n.as_str() == field);
                let Some((name, first)) = items.next() else {
                    continue;
                };
                let value = if count == 1 {
                    Some(first.clone())
                } else {
                    let mut joined = Vec::with_capacity(len);
                    joined.extend_from_slice(first.as_bytes());
                    for (_, v) in items {
                        joined.extend_from_slice(b", ");
                        joined.extend_from_slice(v.as_bytes());
                    }
                    HeaderValue::from_maybe_shared(bytes::Bytes::from(joined)).ok()
                };
                if let Some(value) = value {
                    add_now(headers, name.clone(), value);
                }
            }
            if more {
                let known = fields.get(..met).unwrap_or_default();
                for (name, value) in held {
                    if !known.iter().any(|f| f.0 == name.as_str()) {
                        // Innermost first, as each limit would have.
                        add_now(headers, name.clone(), value.clone());
                    }
                }
            }
        });
    }
}

/// The most fields a composed layer's limits add to (`RateLimit`,
/// `RateLimit-Policy`, the two warnings, and room to spare).
#[cfg(all(feature = "axum", feature = "config"))]
const FIELDS: usize = 8;

#[cfg(all(feature = "axum", feature = "config"))]
impl Deferred {
    /// Whether nothing is held back since it started.
    pub(crate) fn holds_none(&self) -> bool {
        HELD.try_with(|held| held.try_borrow().map_or(true, |h| h.len() <= self.mark))
            .unwrap_or(true)
    }
}

#[cfg(all(feature = "axum", feature = "config"))]
impl Drop for Deferred {
    fn drop(&mut self) {
        let _ = HELD.try_with(|held| {
            if let Ok(mut held) = held.try_borrow_mut() {
                held.truncate(self.mark);
            }
        });
        let _ = DEFERRING.try_with(|d| d.set(self.was));
    }
}

/// While alive, items are added at once: around a poll of the service a
/// composed layer protects, whose own layers (and anything that reads
/// their fields) see them as they would anywhere.
#[cfg(all(feature = "axum", feature = "config"))]
pub(crate) struct AtOnce {
    was: bool,
}

#[cfg(all(feature = "axum", feature = "config"))]
impl AtOnce {
    pub(crate) fn start() -> Self {
        Self {
            was: DEFERRING.try_with(|d| d.replace(false)).unwrap_or(false),
        }
    }
}

#[cfg(all(feature = "axum", feature = "config"))]
impl Drop for AtOnce {
    fn drop(&mut self) {
        let _ = DEFERRING.try_with(|d| d.set(self.was));
    }
}
