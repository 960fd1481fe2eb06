//! Keys from the client's address: the peer's, or the one trusted
//! proxies report in `X-Forwarded-For` / `Forwarded`.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use http::header::{HeaderName, FORWARDED};
use http::Request;

use super::{canonical, KeyBuf, KeyExtractor};
use crate::ip::{forwarded_for, Cidr};

/// The peer's socket address, from the request extensions: a
/// [`SocketAddr`] or, with the `axum` feature, axum's
/// `ConnectInfo<SocketAddr>` (serve with
/// `into_make_service_with_connect_info::<SocketAddr>()`).
///
/// A request with neither is a server set up without connect info, not a
/// client's fault: every layer keyed by the peer then answers each request
/// with its `MissingKey` policy (a 400 by default). So that this is not
/// silent, the first such request logs a warning naming the fix, and then
/// at most one a minute (target `tollgate`).
pub fn peer_addr<B>(req: &Request<B>) -> Option<SocketAddr> {
    let addr = peer_addr_quiet(req);
    if addr.is_none() && NO_CONNECT_INFO.due(unix_secs()) {
        tracing::warn!(
            target: "tollgate",
            "a request carries no peer address, so limits keyed by PeerIp or ClientIp \
             cannot key it: serve axum with \
             `into_make_service_with_connect_info::<SocketAddr>()`, or add \
             `tollgate::key::PeerAddrLayer` to a tonic server or a plain hyper stack"
        );
    }
    addr
}

/// [`peer_addr`] without the warning: for `PeerAddrLayer`, which looks
/// before it inserts the address.
pub(crate) fn peer_addr_quiet<B>(req: &Request<B>) -> Option<SocketAddr> {
    #[cfg(feature = "axum")]
    if let Some(info) = req
        .extensions()
        .get::<axum::extract::ConnectInfo<SocketAddr>>()
    {
        return Some(info.0);
    }
    req.extensions().get::<SocketAddr>().copied()
}

/// The warning about missing connect info, at most once per interval.
static NO_CONNECT_INFO: Every = Every::new(60);

fn unix_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A gate that opens once, then at most once every `secs` seconds.
#[derive(Debug)]
pub(crate) struct Every {
    secs: u64,
    /// Unix seconds of the last opening plus one (0: never opened).
    last: std::sync::atomic::AtomicU64,
}

impl Every {
    pub(crate) const fn new(secs: u64) -> Self {
        Self {
            secs,
            last: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Whether the gate opens at `now` (Unix seconds); one caller wins.
    pub(crate) fn due(&self, now: u64) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        let last = self.last.load(Relaxed);
        // (A clock stepped back past the last opening opens it too.)
        let stepped_back = now.saturating_add(1) < last;
        if last != 0 && !stepped_back && now.saturating_add(1) < last.saturating_add(self.secs) {
            return false;
        }
        self.last
            .compare_exchange(last, now.saturating_add(1), Relaxed, Relaxed)
            .is_ok()
    }
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
#[non_exhaustive]
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
/// If every hop is trusted, the leftmost is the client (an internal
/// caller inside the trusted ranges). Otherwise a trusted proxy is never
/// taken for the client: a trusted peer that forwards no header, or a chain
/// whose walk stops at an entry that is not an IP address (`unknown`, an
/// obfuscated `Forwarded` name, a stray byte), gives no client IP — the
/// request is keyless, and the layer's [`MissingKey`](crate::MissingKey)
/// policy decides — rather than the proxy's, which would pool everyone
/// behind it into one budget (and into any allow list that names the
/// proxies' network).
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
    /// The peer's address, trusting no proxy (what [`PeerIp`] keys by).
    pub fn peer() -> Self {
        Self {
            trusted: Arc::new([]),
            header: ForwardedHeader::XForwardedFor,
            v6_prefix: DEFAULT_IPV6_PREFIX,
        }
    }

    /// Trusts proxies in `ranges` (CIDRs like `10.0.0.0/8`, `::1/128`, or
    /// bare addresses); reads `X-Forwarded-For`.
    pub fn trusting<I, S>(ranges: I) -> Result<Self, tollgate_core::ConfigError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let trusted = ranges
            .into_iter()
            .map(|r| Cidr::narrow(r.as_ref(), "trusted_proxies"))
            .collect::<Result<Vec<_>, _>>()?;
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
        // The leftmost entry of a chain of trusted hops: none yet (a
        // trusted peer is not a client).
        let mut client = None;
        // Multiple header lines form one list, in order; walk it backwards.
        // Entries are decoded one by one: a stray non-UTF-8 byte to the
        // left (client-controlled) must not hide the entries our proxies
        // appended to its right. An entry that is not an address ends the
        // walk with no client: what stands left of it cannot be told.
        for value in req.headers().get_all(name).iter().rev() {
            for entry in value.as_bytes().rsplit(|b| *b == b',') {
                let entry = std::str::from_utf8(entry).ok()?;
                let parsed = match self.header {
                    ForwardedHeader::XForwardedFor => parse_ip(entry),
                    ForwardedHeader::Forwarded => forwarded_for(entry).and_then(parse_ip),
                };
                let ip = canonical(parsed?);
                if !self.is_trusted(ip) {
                    return Some(ip);
                }
                client = Some(ip);
            }
        }
        client
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

    #[test]
    fn the_missing_connect_info_warning_is_rate_limited() {
        let gate = Every::new(60);
        assert!(gate.due(1_000), "the first request warns");
        assert!(!gate.due(1_000));
        assert!(!gate.due(1_059), "then nothing for a minute");
        assert!(gate.due(1_060), "then once a minute");
        assert!(!gate.due(1_061));
        // A clock that steps back does not silence it.
        let gate = Every::new(60);
        assert!(gate.due(0));
        assert!(!gate.due(0));
        assert!(gate.due(60));
        assert!(gate.due(10), "stepped back 50 s");
        assert!(!gate.due(11));
    }
}
