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
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, OnceLock};

use http::header::{HeaderName, FORWARDED};
use http::Request;
use sha2::{Digest, Sha256};

use crate::ip::{forwarded_for, Cidr};

/// Keys up to this many bytes (parts and their length prefixes) are kept
/// as they are; longer keys are hashed.
pub const MAX_RAW_KEY: usize = 64;

/// The first byte of a hashed key. A raw key's first byte is its first
/// part's length, below 64, so the two kinds never collide.
const HASHED: u8 = 0xff;

/// A request's key, built part by part. Lives on the stack; see the
/// [module docs](self).
#[derive(Clone)]
pub struct KeyBuf {
    buf: [u8; 1 + 32 + MAX_RAW_KEY],
    len: usize,
    // Boxed: only long (rare, often hostile) keys pay for the hash state.
    hasher: Option<Box<Sha256>>,
}

/// A finished key, owned and compact: kept by whatever must reach the
/// store again after the request has moved on (a permit's release, a
/// paced body's next chunk). A finished [`KeyBuf`] is at most
/// [`MAX_RAW_KEY`] bytes (longer keys are hashed), so the long form is
/// never used in practice.
#[derive(Debug, Clone)]
pub(crate) enum KeyBytes {
    Short { len: u8, bytes: [u8; 64] },
    Long(Box<[u8]>),
}

impl Default for KeyBytes {
    fn default() -> Self {
        KeyBytes::Short {
            len: 0,
            bytes: [0; 64],
        }
    }
}

impl KeyBytes {
    pub(crate) fn new(key: &mut KeyBuf) -> Self {
        let key = key.as_bytes();
        let mut bytes = [0; 64];
        match (bytes.get_mut(..key.len()), u8::try_from(key.len())) {
            (Some(dst), Ok(len)) => {
                dst.copy_from_slice(key);
                KeyBytes::Short { len, bytes }
            }
            _ => KeyBytes::Long(key.into()),
        }
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        match self {
            KeyBytes::Short { len, bytes } => bytes.get(..usize::from(*len)).unwrap_or_default(),
            KeyBytes::Long(key) => key,
        }
    }
}

/// A point to roll a [`KeyBuf`] back to (see [`KeyBuf::mark`]).
#[derive(Debug, Clone)]
pub struct Mark {
    len: usize,
    hasher: Option<Box<Sha256>>,
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
            buf: [0; 1 + 32 + MAX_RAW_KEY],
            len: 0,
            hasher: None,
        }
    }

    /// Appends one part.
    pub fn push(&mut self, part: &[u8]) {
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
    pub fn reset(&mut self, mark: Mark) {
        self.len = mark.len;
        self.hasher = mark.hasher;
    }

    /// The key's bytes: at most [`MAX_RAW_KEY`] bytes, or 33 if hashed.
    pub fn as_bytes(&mut self) -> &[u8] {
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
        self.raw()
    }

    /// A keyed hash of the key for logs and traces, so that raw keys
    /// (API keys, IPs: personal data) are never written out. Stable within
    /// a process, unlinkable across processes.
    pub fn fingerprint(&mut self) -> Fingerprint {
        static SECRET: OnceLock<(u64, u64)> = OnceLock::new();
        let (k0, k1) = *SECRET.get_or_init(|| {
            use std::hash::BuildHasher;
            let s = std::collections::hash_map::RandomState::new();
            (s.hash_one(1u8), s.hash_one(2u8))
        });
        let mut h = siphasher::sip::SipHasher13::new_with_keys(k0, k1);
        h.write(self.as_bytes());
        Fingerprint(h.finish())
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
/// [`MissingKey`](crate::MissingKey) policy decides what happens then).
///
/// Implemented by the ready-made extractors in this module, by tuples of
/// extractors (every part, in order: e.g. API key *and* route), and by
/// closures `Fn(&Request<B>, &mut KeyBuf) -> Option<()>`.
pub trait KeyExtractor<B>: Clone + Send + Sync + 'static {
    /// Pushes this request's key parts into `key`.
    fn extract(&self, req: &Request<B>, key: &mut KeyBuf) -> Option<()>;
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
}

/// One key for every request: a global limit.
#[derive(Debug, Clone, Copy, Default)]
pub struct Global;

impl<B> KeyExtractor<B> for Global {
    fn extract(&self, _req: &Request<B>, key: &mut KeyBuf) -> Option<()> {
        key.push(b"global");
        Some(())
    }
}

/// A header's value, e.g. an API key. Absent or empty: no key. Values are
/// bytes; non-UTF-8 values are keys like any other.
#[derive(Debug, Clone)]
pub struct Header(HeaderName);

impl Header {
    /// The header `name` (case-insensitive); an invalid name is an error
    /// naming the field `header`.
    pub fn named(name: &str) -> Result<Self, tollgate_core::ConfigError> {
        header_name(name).map(Self)
    }

    /// The header `name`.
    pub fn from_name(name: HeaderName) -> Self {
        Self(name)
    }
}

impl<B> KeyExtractor<B> for Header {
    fn extract(&self, req: &Request<B>, key: &mut KeyBuf) -> Option<()> {
        let value = req.headers().get(&self.0)?.as_bytes();
        if value.is_empty() {
            return None;
        }
        key.push(value);
        Some(())
    }
}

/// Parses a configured header name; the error names the field `header`.
pub(crate) fn header_name(name: &str) -> Result<HeaderName, tollgate_core::ConfigError> {
    HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
        tollgate_core::ConfigError::new("header", format!("{name:?} is not a valid header name"))
    })
}

/// The request path (`/users/42`). Every distinct URL is a key; to limit
/// per route template (`/users/{id}`) use [`Route`] (axum).
#[derive(Debug, Clone, Copy, Default)]
pub struct Path;

impl<B> KeyExtractor<B> for Path {
    fn extract(&self, req: &Request<B>, key: &mut KeyBuf) -> Option<()> {
        key.push(req.uri().path().as_bytes());
        Some(())
    }
}

/// The request method.
#[derive(Debug, Clone, Copy, Default)]
pub struct Method;

impl<B> KeyExtractor<B> for Method {
    fn extract(&self, req: &Request<B>, key: &mut KeyBuf) -> Option<()> {
        key.push(req.method().as_str().as_bytes());
        Some(())
    }
}

/// The matched route template (axum's `MatchedPath`, e.g. `/users/{id}`).
/// Present when the layer is added with `Router::route_layer`, or inside a
/// router; absent (no key) otherwise.
#[cfg(feature = "axum")]
#[derive(Debug, Clone, Copy, Default)]
pub struct Route;

#[cfg(feature = "axum")]
impl<B> KeyExtractor<B> for Route {
    fn extract(&self, req: &Request<B>, key: &mut KeyBuf) -> Option<()> {
        let path = req.extensions().get::<axum::extract::MatchedPath>()?;
        key.push(path.as_str().as_bytes());
        Some(())
    }
}

/// The peer's socket address, from the request extensions: a
/// [`SocketAddr`] or, with the `axum` feature, axum's
/// `ConnectInfo<SocketAddr>` (serve with
/// `into_make_service_with_connect_info::<SocketAddr>()`).
pub fn peer_addr<B>(req: &Request<B>) -> Option<SocketAddr> {
    #[cfg(feature = "axum")]
    if let Some(info) = req
        .extensions()
        .get::<axum::extract::ConnectInfo<SocketAddr>>()
    {
        return Some(info.0);
    }
    req.extensions().get::<SocketAddr>().copied()
}

/// Default IPv6 prefix kept in IP keys: a /64 is what one subscriber
/// usually holds, and would otherwise hand them 2⁶⁴ fresh keys.
pub const DEFAULT_IPV6_PREFIX: u8 = 64;

/// The peer's IP (the TCP connection's remote address). Behind a proxy
/// this is the proxy; use [`ClientIp`] there.
#[derive(Debug, Clone, Copy)]
pub struct PeerIp {
    v6_prefix: u8,
}

impl Default for PeerIp {
    fn default() -> Self {
        Self::new()
    }
}

impl PeerIp {
    /// IPv6 peers keyed by their /64.
    pub fn new() -> Self {
        Self {
            v6_prefix: DEFAULT_IPV6_PREFIX,
        }
    }

    /// How many leading bits of an IPv6 address form the key (0 to 128).
    pub fn ipv6_prefix(mut self, bits: u8) -> Self {
        self.v6_prefix = bits.min(128);
        self
    }
}

impl<B> KeyExtractor<B> for PeerIp {
    fn extract(&self, req: &Request<B>, key: &mut KeyBuf) -> Option<()> {
        key.push_ip(peer_addr(req)?.ip(), self.v6_prefix);
        Some(())
    }
}

/// Which header carries the proxy chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForwardedHeader {
    /// `X-Forwarded-For: client, proxy1, proxy2`.
    XForwardedFor,
    /// `Forwarded: for=client, for=proxy1` (RFC 7239).
    Forwarded,
}

/// The client's IP behind trusted proxies.
///
/// If the peer is not a trusted proxy, the peer is the client and the
/// forwarding header is ignored (anyone can send one). If it is, the chain
/// is read **right to left**, skipping addresses inside the trusted ranges;
/// the first address outside them is the client. The leftmost entries are
/// whatever the client chose to send, so they are never trusted blindly.
/// If every hop is trusted, the leftmost is the client; an entry that is
/// not an IP address stops the walk at the last trusted hop before it.
///
/// ```
/// use http::Request;
/// use std::net::SocketAddr;
/// use tollgate::key::{ClientIp, KeyBuf, KeyExtractor};
///
/// let client_ip = ClientIp::trusting(["10.0.0.0/8"]).unwrap();
/// let mut req = Request::builder()
///     .header("x-forwarded-for", "6.6.6.6, 203.0.113.7, 10.1.2.3")
///     .body(())
///     .unwrap();
/// req.extensions_mut().insert("10.0.0.1:5000".parse::<SocketAddr>().unwrap());
/// assert_eq!(client_ip.client_ip(&req), Some("203.0.113.7".parse().unwrap()));
/// ```
#[derive(Debug, Clone)]
pub struct ClientIp {
    trusted: Arc<[Cidr]>,
    header: ForwardedHeader,
    v6_prefix: u8,
}

impl ClientIp {
    /// Trusts proxies in `ranges` (CIDRs like `10.0.0.0/8`, `::1/128`, or
    /// bare addresses); reads `X-Forwarded-For`.
    pub fn trusting<I, S>(ranges: I) -> Result<Self, tollgate_core::ConfigError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let trusted = ranges
            .into_iter()
            .map(|r| r.as_ref().parse::<Cidr>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| tollgate_core::ConfigError::new("trusted_proxies", e))?;
        Ok(Self {
            trusted: trusted.into(),
            header: ForwardedHeader::XForwardedFor,
            v6_prefix: DEFAULT_IPV6_PREFIX,
        })
    }

    /// Reads `header` instead of `X-Forwarded-For`.
    pub fn header(mut self, header: ForwardedHeader) -> Self {
        self.header = header;
        self
    }

    /// How many leading bits of an IPv6 address form the key (0 to 128).
    pub fn ipv6_prefix(mut self, bits: u8) -> Self {
        self.v6_prefix = bits.min(128);
        self
    }

    fn is_trusted(&self, ip: IpAddr) -> bool {
        let ip = canonical(ip);
        self.trusted.iter().any(|c| c.contains(ip))
    }

    /// The client IP of `req`, as described on [`ClientIp`].
    pub fn client_ip<B>(&self, req: &Request<B>) -> Option<IpAddr> {
        let peer = canonical(peer_addr(req)?.ip());
        if !self.is_trusted(peer) {
            return Some(peer);
        }
        let name = match self.header {
            ForwardedHeader::XForwardedFor => &X_FORWARDED_FOR,
            ForwardedHeader::Forwarded => &FORWARDED,
        };
        let mut client = peer;
        // Multiple header lines form one list, in order; walk it backwards.
        // Entries are decoded one by one: a stray non-UTF-8 byte to the
        // left (client-controlled) must not hide the entries our proxies
        // appended to its right.
        for value in req.headers().get_all(name).iter().rev() {
            for entry in value.as_bytes().rsplit(|b| *b == b',') {
                let Ok(entry) = std::str::from_utf8(entry) else {
                    return Some(client);
                };
                let parsed = match self.header {
                    ForwardedHeader::XForwardedFor => parse_ip(entry),
                    ForwardedHeader::Forwarded => forwarded_for(entry).and_then(parse_ip),
                };
                let Some(ip) = parsed else {
                    return Some(client);
                };
                client = canonical(ip);
                if !self.is_trusted(client) {
                    return Some(client);
                }
            }
        }
        Some(client)
    }
}

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// Parses `1.2.3.4`, `1.2.3.4:80`, `2001:db8::1`, `[2001:db8::1]:80`,
/// with surrounding spaces and quotes.
fn parse_ip(s: &str) -> Option<IpAddr> {
    let s = s.trim().trim_matches('"');
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Some(ip);
    }
    if let Ok(sa) = s.parse::<SocketAddr>() {
        return Some(sa.ip());
    }
    let inner = s.strip_prefix('[')?.split(']').next()?;
    inner.parse::<Ipv6Addr>().ok().map(IpAddr::V6)
}

impl<B> KeyExtractor<B> for ClientIp {
    fn extract(&self, req: &Request<B>, key: &mut KeyBuf) -> Option<()> {
        key.push_ip(self.client_ip(req)?, self.v6_prefix);
        Some(())
    }
}

#[cfg(test)]
mod tests {
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
        // Garbage stops the walk at the last trusted hop.
        assert_eq!(
            c.client_ip(&req("10.0.0.1:1", &["1.1.1.1, nonsense, 10.3.3.3"])),
            ip("10.3.3.3")
        );
        // All trusted: the leftmost.
        assert_eq!(
            c.client_ip(&req("10.0.0.1:1", &["10.9.9.9"])),
            ip("10.9.9.9")
        );
        // No header: the peer.
        assert_eq!(c.client_ip(&req("10.0.0.1:1", &[])), ip("10.0.0.1"));
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
