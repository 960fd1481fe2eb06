//! Writing header values: a stack buffer, decimal numbers, shared values
//! of small numbers, warning items.

use http::header::HeaderValue;
use std::fmt;

use super::is_past;

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
/// Appends `n` in decimal to `v`.
pub(super) fn push_decimal(v: &mut Vec<u8>, n: u64) {
    let mut b = Buf::<20>::empty();
    b.push_u64(n);
    v.extend_from_slice(b.as_bytes());
}
/// Header values for the numbers most responses carry (`Retry-After`,
/// the legacy headers), built once per process: sending one is a copy of a
/// static reference, not an allocation.
const SMALL_NUMBERS: u64 = 1_024;

pub(super) fn number(n: u64) -> Option<HeaderValue> {
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
