//! Who a request counts against: key extractors.
//!
//! A [`KeyExtractor`] writes the parts of a request's key into a
//! [`KeyBuf`]: an API key, a client IP, a route, or several at once. Parts
//! are length-prefixed, so `("ab", "c")` and `("a", "bc")` differ. Keys up
//! to [`MAX_RAW_KEY`] bytes are kept as they are, on the stack; longer ones
//! are hashed (SHA-256) to a fixed 33 bytes, so a 64 KiB header costs the
//! store no more than a short one and every instance of a fleet derives the
//! same key. Raw keys never reach the logs: [`KeyBuf::fingerprint`] is a
//! keyed hash for that.
//!
//! Closures are extractors: `|req: &Request<B>, key: &mut KeyBuf| -> Option<()>`,
//! returning `None` when the request has no key.
//!
//! A key the client chooses freely (an API key nobody has checked yet) can
//! be rotated for a fresh budget: key on it after authentication, or stack
//! a per-IP rule beside the per-key one.
//!
//! ```
//! use http::Request;
//! use tollgate::key::{Header, KeyBuf, KeyExtractor, KeyExtractorExt, PeerIp};
//!
//! // The API key if there is one, else the peer's IP.
//! let by_client = Header::named("x-api-key").unwrap().or(PeerIp::new());
//!
//! // A closure: the tenant from a custom header.
//! let by_tenant = |req: &Request<()>, key: &mut KeyBuf| {
//!     key.push(req.headers().get("x-tenant")?.as_bytes());
//!     Some(())
//! };
//!
//! let req = Request::builder().header("x-tenant", "acme").body(()).unwrap();
//! let mut key = KeyBuf::new();
//! assert!(by_tenant.extract(&req, &mut key).is_some());
//! assert!(by_client.extract(&req, &mut KeyBuf::new()).is_none()); // no key, no peer
//! ```

use std::fmt;
use std::hash::Hasher as _;
use std::net::IpAddr;
use std::sync::OnceLock;

use http::Request;
use sha2::{Digest, Sha256};

/// Keys up to this many bytes (parts and their length prefixes) are kept
/// as they are; longer keys are hashed.
pub const MAX_RAW_KEY: usize = 64;
// A hashed key (a tag byte and 32 bytes of SHA-256) must fit.
const _: () = assert!(MAX_RAW_KEY > 32);

/// The first byte of a hashed key. A raw key's first byte is its first
/// part's length, below 64, so the two kinds never collide.
const HASHED: u8 = 0xff;

/// A request's key, built part by part. Lives on the stack; see the
/// [module docs](self).
#[derive(Clone)]
pub struct KeyBuf {
    // A raw key (at most MAX_RAW_KEY bytes) or a hashed one (1 + 32).
    buf: [u8; MAX_RAW_KEY],
    len: usize,
    // Boxed: only long (rare, often hostile) keys pay for the hash state.
    hasher: Option<Box<Sha256>>,
}

/// A finished key, owned: kept by whatever must reach the store again
/// after the request has moved on (a retry's withdrawal, a paced body's
/// next chunk). It is the finished [`KeyBuf`] itself (at most
/// [`MAX_RAW_KEY`] bytes, or 33 if hashed), so keeping a key copies no
/// bytes out of its buffer, and its `Debug` never shows the raw key.
#[derive(Debug, Clone)]
pub(crate) struct KeyBytes(KeyBuf);

impl KeyBytes {
    /// `key`, finished.
    pub(crate) fn new(key: &mut KeyBuf) -> Self {
        key.as_bytes();
        Self(key.clone())
    }

    /// The key `extract` writes, or `fallback` as its one part when it
    /// finds none (whatever it wrote before failing is rolled back); built
    /// where it is returned, not copied there: a copy of a buffer just
    /// written stalls the CPU on the stores still in flight.
    #[inline]
    pub(crate) fn extract(
        extract: impl FnOnce(&mut KeyBuf) -> Option<()>,
        fallback: &[u8],
    ) -> Self {
        let mut key = Self(KeyBuf::new());
        if extract(&mut key.0).is_none() {
            key.0.reset(Mark::EMPTY);
            key.0.push(fallback);
        }
        key.0.as_bytes();
        key
    }

    #[inline]
    pub(crate) fn as_bytes(&self) -> &[u8] {
        self.0.raw()
    }

    /// Builds a key in `slot` (not copied there: see
    /// [`extract`](Self::extract)) with `build`, which says whether to
    /// keep it; a key not kept leaves the slot empty.
    #[inline]
    pub(crate) fn build_in<R>(
        slot: &mut Option<Self>,
        build: impl FnOnce(&mut KeyBuf) -> (bool, R),
    ) -> R {
        let key = slot.insert(Self(KeyBuf::new()));
        let (keep, result) = build(&mut key.0);
        if keep {
            key.0.as_bytes();
        } else {
            *slot = None;
        }
        result
    }
}

/// A point to roll a [`KeyBuf`] back to (see [`KeyBuf::mark`]).
#[derive(Debug, Clone)]
pub struct Mark {
    len: usize,
    hasher: Option<Box<Sha256>>,
}

impl Mark {
    /// An empty key's.
    const EMPTY: Mark = Mark {
        len: 0,
        hasher: None,
    };
}

impl Default for KeyBuf {
    fn default() -> Self {
        Self::new()
    }
}

impl KeyBuf {
    /// An empty key.
    pub fn new() -> Self {
        Self {
            buf: [0; MAX_RAW_KEY],
            len: 0,
            hasher: None,
        }
    }

    /// Appends one part.
    pub fn push(&mut self, part: &[u8]) {
        // The usual part (shorter than 128 bytes, into a raw key): its
        // one-byte length written in place, then the part (a copy of a
        // length known only now is a call; one for the prefix too cost
        // ~15 instructions a part).
        if self.hasher.is_none() && part.len() < 0x80 {
            let end = self.len.saturating_add(1).saturating_add(part.len());
            if end <= MAX_RAW_KEY {
                if let Some((len, dst)) = self
                    .buf
                    .get_mut(self.len..end)
                    .and_then(|d| d.split_first_mut())
                {
                    #[allow(clippy::cast_possible_truncation)]
                    {
                        *len = part.len() as u8;
                    }
                    dst.copy_from_slice(part);
                    self.len = end;
                    return;
                }
            }
        }
        self.push_slow(part);
    }

    /// [`push`](Self::push) of a long part, or into a long key.
    #[cold]
    fn push_slow(&mut self, part: &[u8]) {
        let mut prefix = [0u8; 10];
        let prefix = varint(part.len(), &mut prefix);
        if let Some(h) = &mut self.hasher {
            h.update(prefix);
            h.update(part);
            return;
        }
        let end = self
            .len
            .saturating_add(prefix.len())
            .saturating_add(part.len());
        match self.buf.get_mut(self.len..end) {
            Some(dst) if end <= MAX_RAW_KEY => {
                let (p, rest) = dst.split_at_mut(prefix.len());
                p.copy_from_slice(prefix);
                rest.copy_from_slice(part);
                self.len = end;
            }
            _ => {
                let mut h = Box::new(Sha256::new());
                h.update(self.raw());
                h.update(prefix);
                h.update(part);
                self.hasher = Some(h);
            }
        }
    }

    /// Appends an IP address as a part: 4 bytes for IPv4 (IPv4-mapped IPv6
    /// included), 16 for IPv6 with only the first `v6_prefix` bits kept.
    pub fn push_ip(&mut self, ip: IpAddr, v6_prefix: u8) {
        match canonical(ip) {
            IpAddr::V4(v4) => self.push(&v4.octets()),
            IpAddr::V6(v6) => {
                let bits = u32::from(v6_prefix.min(128));
                let mask = u128::MAX
                    .checked_shl(128u32.saturating_sub(bits))
                    .unwrap_or(0);
                self.push(&(u128::from(v6) & mask).to_be_bytes());
            }
        }
    }

    /// The bytes of a key already finished ([`as_bytes`](Self::as_bytes)
    /// was called since its last part), without `&mut`.
    #[inline]
    pub(crate) fn raw_bytes(&self) -> &[u8] {
        self.raw()
    }

    #[inline]
    fn raw(&self) -> &[u8] {
        self.buf.get(..self.len).unwrap_or_default()
    }

    /// Whether nothing was pushed.
    pub fn is_empty(&self) -> bool {
        self.len == 0 && self.hasher.is_none()
    }

    /// Remembers the current contents, to [`reset`](Self::reset) to them
    /// if an extractor fails half-way.
    pub fn mark(&self) -> Mark {
        Mark {
            len: self.len,
            hasher: self.hasher.clone(),
        }
    }

    /// Rolls back to `mark`.
    #[inline]
    pub fn reset(&mut self, mark: Mark) {
        self.len = mark.len;
        self.hasher = mark.hasher;
    }

    /// The key's bytes: at most [`MAX_RAW_KEY`] bytes, or 33 if hashed.
    #[inline]
    pub fn as_bytes(&mut self) -> &[u8] {
        if self.hasher.is_some() {
            self.finish_hash();
        }
        self.raw()
    }

    /// Writes a long key's hash in place of its raw bytes.
    #[cold]
    #[inline(never)]
    fn finish_hash(&mut self) {
        if let Some(h) = self.hasher.take() {
            let digest = h.finalize();
            if let Some((tag, rest)) = self.buf.split_first_mut() {
                *tag = HASHED;
                if let Some(dst) = rest.get_mut(..digest.len()) {
                    dst.copy_from_slice(&digest);
                }
            }
            self.len = 1 + 32;
        }
    }

    /// A keyed hash of the key for logs and traces, so that raw keys
    /// (API keys, IPs: personal data) are never written out. Stable within
    /// a process, unlinkable across processes.
    pub fn fingerprint(&mut self) -> Fingerprint {
        Fingerprint::of(self.as_bytes())
    }
}

impl fmt::Debug for KeyBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print the raw key.
        f.debug_struct("KeyBuf")
            .field("len", &self.len)
            .field("hashed", &self.hasher.is_some())
            .finish_non_exhaustive()
    }
}

/// A keyed hash of a client key, printable in logs (16 hex digits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub u64);

impl Fingerprint {
    /// The fingerprint of a finished key's bytes.
    pub(crate) fn of(key: &[u8]) -> Self {
        static SECRET: OnceLock<(u64, u64)> = OnceLock::new();
        let (k0, k1) = *SECRET.get_or_init(|| {
            use std::hash::BuildHasher;
            let s = std::collections::hash_map::RandomState::new();
            (s.hash_one(1u8), s.hash_one(2u8))
        });
        let mut h = siphasher::sip::SipHasher13::new_with_keys(k0, k1);
        h.write(key);
        Fingerprint(h.finish())
    }

    /// The fingerprint of `key` under `secret`: the same on every instance
    /// that shares the secret (so a fleet's audit records of one client
    /// agree), and still no way back to the key without the secret.
    pub(crate) fn keyed(secret: &[u8], key: &[u8]) -> Self {
        use sha2::{Digest, Sha256};
        let digest = Sha256::new()
            .chain_update(b"tollgate fingerprint\0")
            .chain_update(secret)
            .chain_update(b"\0")
            .chain_update(key)
            .finalize();
        let mut word = [0u8; 8];
        for (w, d) in word.iter_mut().zip(digest.iter()) {
            *w = *d;
        }
        Fingerprint(u64::from_le_bytes(word))
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

fn varint(mut n: usize, out: &mut [u8; 10]) -> &[u8] {
    let mut len = out.len();
    for (i, slot) in out.iter_mut().enumerate() {
        if n < 0x80 {
            *slot = n as u8;
            len = i.saturating_add(1);
            break;
        }
        *slot = (n as u8 & 0x7f) | 0x80;
        n >>= 7;
    }
    out.get(..len).unwrap_or_default()
}

fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// Writes a request's key. `None`: the request has no key (the layer's
/// [`crate::MissingKey`] policy decides what happens then).
///
/// Implemented by the ready-made extractors in this module, by tuples of
/// extractors (every part, in order: e.g. API key *and* route), and by
/// closures `Fn(&Request<B>, &mut KeyBuf) -> Option<()>`.
pub trait KeyExtractor<B>: Clone + Send + Sync + 'static {
    /// Pushes this request's key parts into `key`.
    fn extract(&self, req: &Request<B>, key: &mut KeyBuf) -> Option<()>;

    /// Whether `extract` writes one key for every request, never none
    /// ([`Global`]): a limit so keyed is service-wide, and may count its
    /// key apart from the store's table, with no lookup
    /// ([`ConcurrencyLimiter::pin`](tollgate_core::ConcurrencyLimiter::pin)).
    /// `false` (the default) unless the extractor says so.
    ///
    /// Say `true` only of an extractor that reads nothing of the request:
    /// a concurrency layer then reads the key of its first request only,
    /// and counts every later request under it (whatever key `extract`
    /// would have written for it).
    fn is_fixed(&self) -> bool {
        false
    }
}

impl<B, F> KeyExtractor<B> for F
where
    F: Fn(&Request<B>, &mut KeyBuf) -> Option<()> + Clone + Send + Sync + 'static,
{
    fn extract(&self, req: &Request<B>, key: &mut KeyBuf) -> Option<()> {
        self(req, key)
    }
}

macro_rules! tuple_extractor {
    ($($name:ident),+) => {
        impl<B, $($name: KeyExtractor<B>),+> KeyExtractor<B> for ($($name,)+) {
            #[allow(non_snake_case)]
            fn extract(&self, req: &Request<B>, key: &mut KeyBuf) -> Option<()> {
                let ($($name,)+) = self;
                $($name.extract(req, key)?;)+
                Some(())
            }

            #[allow(non_snake_case)]
            fn is_fixed(&self) -> bool {
                let ($($name,)+) = self;
                true $(&& $name.is_fixed())+
            }
        }
    };
}
tuple_extractor!(A);
tuple_extractor!(A, B2);
tuple_extractor!(A, B2, C);
tuple_extractor!(A, B2, C, D);

/// Combinators for the ready-made extractors (for closures, use
/// [`Or::new`]).
pub trait KeyExtractorExt: Sized {
    /// This extractor's key, or `other`'s when this one finds none.
    fn or<O>(self, other: O) -> Or<Self, O> {
        Or(self, other)
    }
}

macro_rules! ext {
    ($($t:ty),*) => { $(impl KeyExtractorExt for $t {})* };
}
ext!(Global, Header, Path, Method, PeerIp, ClientIp);
#[cfg(feature = "axum")]
ext!(Route);
impl<A, O> KeyExtractorExt for Or<A, O> {}

/// The first extractor's key, else the second's. See [`KeyExtractorExt::or`].
#[derive(Debug, Clone)]
pub struct Or<A, O>(A, O);

impl<A, O> Or<A, O> {
    /// `first`'s key, else `second`'s.
    pub fn new(first: A, second: O) -> Self {
        Self(first, second)
    }
}

impl<B, A: KeyExtractor<B>, O: KeyExtractor<B>> KeyExtractor<B> for Or<A, O> {
    fn extract(&self, req: &Request<B>, key: &mut KeyBuf) -> Option<()> {
        // Both branches are tagged, so "API key 1.2.3.4" is not "IP
        // 1.2.3.4", and in a chain `a.or(b).or(c)` every branch has its own
        // path of tags.
        let mark = key.mark();
        key.push(b"\x01or0");
        if self.0.extract(req, key).is_some() {
            return Some(());
        }
        key.reset(mark);
        key.push(b"\x01or1");
        self.1.extract(req, key)
    }

    /// The first's key is the key, when it is fixed.
    fn is_fixed(&self) -> bool {
        self.0.is_fixed()
    }
}

#[cfg(feature = "geoip")]
pub(crate) mod geo;
mod ip;
mod missing;
mod peer;
pub(crate) mod request;

#[cfg(feature = "geoip")]
pub use geo::{GeoField, GeoIp};
pub use ip::{peer_addr, ClientIp, ForwardedHeader, PeerIp, DEFAULT_IPV6_PREFIX};
pub use missing::MissingKey;
pub(crate) use missing::{Keyed, Keying};
pub use peer::{PeerAddr, PeerAddrLayer};
pub(crate) use request::header_name;
#[cfg(feature = "axum")]
pub use request::Route;
pub use request::{normalize_path, ClientFingerprint, Global, Header, Method, Path};

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use super::*;

    fn bytes(k: &mut KeyBuf) -> Vec<u8> {
        k.as_bytes().to_vec()
    }

    #[test]
    fn parts_are_length_prefixed() {
        let (mut a, mut b) = (KeyBuf::new(), KeyBuf::new());
        a.push(b"ab");
        a.push(b"c");
        b.push(b"a");
        b.push(b"bc");
        assert_ne!(bytes(&mut a), bytes(&mut b));
    }

    #[test]
    fn an_extracted_key_is_the_extractors_or_only_the_fallback() {
        let mut want = KeyBuf::new();
        want.push(b"upstream");
        let found = KeyBytes::extract(
            |k| {
                k.push(b"upstream");
                Some(())
            },
            b"fallback",
        );
        assert_eq!(found.as_bytes(), bytes(&mut want));
        // An extractor that wrote part of a key and then found none
        // leaves nothing of it: the fallback alone, as a fresh key.
        let mut fallback = KeyBuf::new();
        fallback.push(b"fallback");
        for partial in [&b"part"[..], &[b'x'; 100][..]] {
            let missing = KeyBytes::extract(
                |k| {
                    k.push(partial);
                    None
                },
                b"fallback",
            );
            assert_eq!(missing.as_bytes(), bytes(&mut fallback));
        }
        // A long key is finished: hashed to its fixed length.
        let long = KeyBytes::extract(
            |k| {
                k.push(&[b'x'; 100]);
                Some(())
            },
            b"fallback",
        );
        assert_eq!(long.as_bytes().len(), 33);
        assert_eq!(long.as_bytes()[0], HASHED);
    }

    #[test]
    fn long_keys_are_hashed_to_a_fixed_length_and_stay_distinct() {
        let mut a = KeyBuf::new();
        a.push(&[b'x'; 65_536]);
        let mut b = KeyBuf::new();
        let mut other = vec![b'x'; 65_536];
        other[65_535] = b'y';
        b.push(&other);
        let (a, b) = (bytes(&mut a), bytes(&mut b));
        assert_eq!(a.len(), 33);
        assert_eq!(a[0], HASHED);
        assert_ne!(a, b);
        // The same long key hashes the same way (fleet-wide agreement).
        let mut c = KeyBuf::new();
        c.push(&[b'x'; 65_536]);
        assert_eq!(bytes(&mut c), a);
        // A raw key can never look like a hashed one.
        let mut raw = KeyBuf::new();
        raw.push(&[0xff; 62]);
        assert_ne!(bytes(&mut raw)[0], HASHED);
        assert!(raw.as_bytes().len() <= MAX_RAW_KEY);
    }

    #[test]
    fn mark_and_reset_undo_a_failed_extractor_even_after_hashing() {
        let mut k = KeyBuf::new();
        k.push(b"tenant");
        let want = bytes(&mut k.clone());
        let mark = k.mark();
        k.push(&[0u8; 100]);
        k.reset(mark);
        assert_eq!(bytes(&mut k), want);
    }

    #[test]
    fn ipv6_keys_keep_the_prefix_and_mapped_v4_is_v4() {
        let mut a = KeyBuf::new();
        a.push_ip("2001:db8:1:2:aaaa::1".parse().unwrap(), 64);
        let mut b = KeyBuf::new();
        b.push_ip("2001:db8:1:2:bbbb::2".parse().unwrap(), 64);
        assert_eq!(bytes(&mut a), bytes(&mut b));
        let mut c = KeyBuf::new();
        c.push_ip("::ffff:1.2.3.4".parse().unwrap(), 64);
        let mut d = KeyBuf::new();
        d.push_ip("1.2.3.4".parse().unwrap(), 64);
        assert_eq!(bytes(&mut c), bytes(&mut d));
    }

    fn req(peer: &str, xff: &[&str]) -> Request<()> {
        let mut b = Request::builder();
        for v in xff {
            b = b.header("x-forwarded-for", *v);
        }
        let mut r = b.body(()).unwrap();
        r.extensions_mut()
            .insert(peer.parse::<SocketAddr>().unwrap());
        r
    }

    #[test]
    fn client_ip_reads_right_to_left_and_ignores_untrusted_peers() {
        let c = ClientIp::trusting(["10.0.0.0/8", "192.168.1.1"]).unwrap();
        let ip = |s: &str| Some(s.parse::<IpAddr>().unwrap());
        // Untrusted peer: its header is ignored.
        assert_eq!(c.client_ip(&req("8.8.8.8:1", &["1.1.1.1"])), ip("8.8.8.8"));
        // Trusted chain: skip trusted hops from the right.
        assert_eq!(
            c.client_ip(&req(
                "10.0.0.1:1",
                &["6.6.6.6, 7.7.7.7", "10.2.2.2, 192.168.1.1"]
            )),
            ip("7.7.7.7")
        );
        // Garbage stops the walk with no client: a trusted hop is never
        // one (review finding 17).
        assert_eq!(
            c.client_ip(&req("10.0.0.1:1", &["1.1.1.1, nonsense, 10.3.3.3"])),
            None
        );
        // All trusted: the leftmost.
        assert_eq!(
            c.client_ip(&req("10.0.0.1:1", &["10.9.9.9"])),
            ip("10.9.9.9")
        );
        // A trusted peer that forwards nothing: no client either.
        assert_eq!(c.client_ip(&req("10.0.0.1:1", &[])), None);
        // Ports and brackets.
        assert_eq!(
            c.client_ip(&req("10.0.0.1:1", &["[2001:db8::1]:443, 1.2.3.4:80"])),
            ip("1.2.3.4")
        );
    }

    #[test]
    fn forwarded_header_is_read_the_same_way() {
        let c = ClientIp::trusting(["10.0.0.0/8"])
            .unwrap()
            .header(ForwardedHeader::Forwarded);
        let mut r = Request::builder()
            .header(
                "forwarded",
                "for=6.6.6.6, for=\"[2001:db8::7]:4711\";proto=https, for=10.0.0.9",
            )
            .body(())
            .unwrap();
        r.extensions_mut()
            .insert("10.0.0.1:1".parse::<SocketAddr>().unwrap());
        assert_eq!(c.client_ip(&r), Some("2001:db8::7".parse().unwrap()));
    }

    #[test]
    fn bad_trusted_ranges_are_config_errors() {
        for bad in ["10.0.0.0/33", "nonsense", "::/129", "1.2.3.4/"] {
            assert_eq!(
                ClientIp::trusting([bad]).unwrap_err().field(),
                "trusted_proxies",
                "{bad}"
            );
        }
    }

    #[test]
    fn non_utf8_bytes_left_of_the_proxies_do_not_hide_the_client() {
        let c = ClientIp::trusting(["10.0.0.0/8"]).unwrap();
        let mut r = Request::builder()
            .header(
                "x-forwarded-for",
                http::HeaderValue::from_bytes(b"\xff, 203.0.113.7").unwrap(),
            )
            .body(())
            .unwrap();
        r.extensions_mut()
            .insert("10.0.0.1:1".parse::<SocketAddr>().unwrap());
        assert_eq!(c.client_ip(&r), Some("203.0.113.7".parse().unwrap()));
    }

    #[test]
    fn chained_or_branches_never_share_a_key() {
        let k = Header::named("x-api-key")
            .unwrap()
            .or(Header::named("x-user").unwrap())
            .or(PeerIp::new());
        let mut by_user = Request::builder()
            .header("x-user", "abcd")
            .body(())
            .unwrap();
        by_user
            .extensions_mut()
            .insert("1.1.1.1:1".parse::<SocketAddr>().unwrap());
        let mut by_ip = Request::builder().body(()).unwrap();
        by_ip
            .extensions_mut()
            .insert("97.98.99.100:1".parse::<SocketAddr>().unwrap());
        let (mut a, mut b) = (KeyBuf::new(), KeyBuf::new());
        k.extract(&by_user, &mut a).unwrap();
        k.extract(&by_ip, &mut b).unwrap();
        assert_ne!(bytes(&mut a), bytes(&mut b));
    }

    #[test]
    fn or_falls_back_with_a_distinct_tag() {
        let k = Header::named("x-api-key")
            .unwrap()
            .or(Header::named("x-ip").unwrap());
        let r = Request::builder()
            .header("x-ip", "1.2.3.4")
            .body(())
            .unwrap();
        let mut a = KeyBuf::new();
        k.extract(&r, &mut a).unwrap();
        let r2 = Request::builder()
            .header("x-api-key", "1.2.3.4")
            .body(())
            .unwrap();
        let mut b = KeyBuf::new();
        k.extract(&r2, &mut b).unwrap();
        assert_ne!(bytes(&mut a), bytes(&mut b));
    }
}
