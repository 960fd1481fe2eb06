//! `ClientIp` behind trusted proxies: `X-Forwarded-For` / `Forwarded`
//! lines built from addresses in every spelling the parser accepts, mixed
//! with arbitrary bytes; an arbitrary peer; and (sometimes) arbitrary
//! trusted ranges. Where every entry is a well-formed address, the result
//! is checked against the documented rule (right to left, skip trusted).
#![no_main]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use arbitrary::Arbitrary;
use http::header::{HeaderName, HeaderValue, FORWARDED};
use http::Request;
use libfuzzer_sys::fuzz_target;
use tollgate::key::{ClientIp, ForwardedHeader, KeyBuf, KeyExtractor, PeerIp, MAX_RAW_KEY};

#[derive(Debug, Clone, Copy, Arbitrary)]
enum Addr {
    /// One of a few addresses inside the trusted ranges.
    Trusted(u8),
    V4(Ipv4Addr),
    V6(Ipv6Addr),
}

#[derive(Debug, Arbitrary)]
enum Entry {
    /// An address in one of the spellings the selected header accepts.
    Ip { addr: Addr, style: u8, port: u16 },
    /// Anything.
    Raw(Vec<u8>),
}

#[derive(Debug, Arbitrary)]
enum Line {
    Entries(Vec<Entry>, u8),
    Raw(Vec<u8>),
}

#[derive(Debug, Arbitrary)]
struct Input {
    lines: Vec<Line>,
    /// Lines of the header not selected (must be ignored).
    other: Vec<Vec<u8>>,
    peer: Option<(Addr, u16)>,
    use_forwarded: bool,
    v6_prefix: u8,
    /// Extra trusted ranges as configured text (a config, not a request:
    /// must be an error or a range, never a panic).
    extra_ranges: Vec<String>,
}

const TRUSTED: [&str; 5] = [
    "10.0.0.0/8",
    "192.168.1.1",
    "::1/128",
    "2001:db8::/32",
    "::ffff:172.16.0.0/108",
];

const TRUSTED_ADDRS: [&str; 7] = [
    "10.0.0.1",
    "10.255.255.255",
    "192.168.1.1",
    "::1",
    "2001:db8::7",
    "::ffff:172.16.3.4",
    "::ffff:10.1.2.3",
];

fn ip(a: Addr) -> IpAddr {
    match a {
        Addr::Trusted(i) => TRUSTED_ADDRS[usize::from(i) % TRUSTED_ADDRS.len()]
            .parse()
            .unwrap(),
        Addr::V4(v4) => IpAddr::V4(v4),
        Addr::V6(v6) => IpAddr::V6(v6),
    }
}

fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// `TRUSTED`, by hand.
fn trusted(ip: IpAddr) -> bool {
    match canonical(ip) {
        IpAddr::V4(v4) => {
            let o = v4.octets();
            o[0] == 10 || o == [192, 168, 1, 1] || (o[0] == 172 && (o[1] & 0xf0) == 16)
        }
        IpAddr::V6(v6) => {
            let s = v6.segments();
            v6 == Ipv6Addr::LOCALHOST || (s[0] == 0x2001 && s[1] == 0xdb8)
        }
    }
}

/// How an address is written in the selected header.
fn render(ip: IpAddr, style: u8, port: u16, forwarded: bool) -> String {
    let sock = SocketAddr::new(ip, port);
    let bracketed = match ip {
        IpAddr::V6(v6) => format!("[{v6}]"),
        v4 => v4.to_string(),
    };
    if forwarded {
        match style % 6 {
            0 => format!("for={ip}"),
            1 => format!("for=\"{sock}\""),
            2 => format!("proto=https;for={ip};by=_hidden"),
            3 => format!(" For = {ip} "),
            4 => format!("for=\"{bracketed}\""),
            _ => format!("by=\"{bracketed}\";FOR={sock};host=example.com"),
        }
    } else {
        match style % 5 {
            0 => ip.to_string(),
            1 => format!("  {ip}\t"),
            2 => format!("\"{ip}\""),
            3 => sock.to_string(),
            _ => bracketed,
        }
    }
}

fn check_key(key: &mut KeyBuf) {
    let bytes = key.as_bytes();
    assert!(bytes.len() <= MAX_RAW_KEY || (bytes.len() == 33 && bytes[0] == 0xff));
}

fuzz_target!(|input: Input| {
    let forwarded = input.use_forwarded;
    let (name, other) = if forwarded {
        (FORWARDED, HeaderName::from_static("x-forwarded-for"))
    } else {
        (HeaderName::from_static("x-forwarded-for"), FORWARDED)
    };
    let mut req = Request::builder().body(()).unwrap();
    // The chain as the oracle sees it: `None` where an entry is not a
    // well-formed address; `exact` while every entry's meaning is known.
    let mut chain: Vec<IpAddr> = Vec::new();
    let mut exact = true;
    for line in &input.lines {
        let text = match line {
            Line::Raw(bytes) => {
                exact = false;
                bytes.clone()
            }
            Line::Entries(entries, sep) => {
                let sep = [",", ", ", " ,", " , "][usize::from(*sep) % 4];
                let parts: Vec<Vec<u8>> = entries
                    .iter()
                    .map(|e| match e {
                        Entry::Ip { addr, style, port } => {
                            let ip = ip(*addr);
                            chain.push(ip);
                            render(ip, *style, *port, forwarded).into_bytes()
                        }
                        Entry::Raw(b) => {
                            exact = false;
                            b.clone()
                        }
                    })
                    .collect();
                parts.join(sep.as_bytes())
            }
        };
        match HeaderValue::from_bytes(&text) {
            Ok(v) => {
                req.headers_mut().append(name.clone(), v);
            }
            // Our own entries are valid header text; only raw ones fail.
            Err(_) => assert!(!exact),
        }
    }
    if input
        .lines
        .iter()
        .any(|l| matches!(l, Line::Entries(e, _) if e.is_empty()))
    {
        // An empty line is one empty (malformed) entry.
        exact = false;
    }
    for line in &input.other {
        if let Ok(v) = HeaderValue::from_bytes(line) {
            req.headers_mut().append(other.clone(), v);
        }
    }
    let peer = input.peer.map(|(a, port)| SocketAddr::new(ip(a), port));
    if let Some(peer) = peer {
        req.extensions_mut().insert(peer);
    }

    let header = if forwarded {
        ForwardedHeader::Forwarded
    } else {
        ForwardedHeader::XForwardedFor
    };
    let base = ClientIp::trusting(TRUSTED).unwrap().header(header);
    let mut extractors = vec![base.clone()];
    if !input.extra_ranges.is_empty() {
        let ranges = TRUSTED
            .iter()
            .map(|s| s.to_string())
            .chain(input.extra_ranges.iter().cloned());
        if let Ok(c) = ClientIp::trusting(ranges) {
            extractors.push(c.header(header));
        }
    }
    for c in extractors {
        let c = c.ipv6_prefix(input.v6_prefix);
        let ip = c.client_ip(&req);
        // A client IP only when there is a peer; a key exactly when there
        // is a client IP.
        assert!(ip.is_none() || peer.is_some());
        let mut key = KeyBuf::new();
        let got = c.extract(&req, &mut key);
        assert_eq!(got.is_some(), ip.is_some());
        check_key(&mut key);
        if let Some(ip) = ip {
            // The key is the client IP's key; mapped addresses are IPv4.
            let mut want = KeyBuf::new();
            want.push_ip(ip, input.v6_prefix);
            assert_eq!(key.as_bytes(), want.as_bytes());
            assert_eq!(ip, canonical(ip));
        }
    }

    // The documented rule, for chains of well-formed entries.
    if let Some(peer) = peer {
        let got = base.client_ip(&req);
        let peer = canonical(peer.ip());
        if !trusted(peer) {
            // An untrusted peer is the client, whatever the headers say.
            assert_eq!(got, Some(peer));
        } else if exact {
            // A trusted peer is no client: the first untrusted hop from
            // the right, else the leftmost of an all-trusted chain.
            let mut want = None;
            for &hop in chain.iter().rev() {
                let hop = canonical(hop);
                want = Some(hop);
                if !trusted(hop) {
                    break;
                }
            }
            assert_eq!(got, want, "chain {chain:?}");
        }
    }

    let mut key = KeyBuf::new();
    let _ = PeerIp::new()
        .ipv6_prefix(input.v6_prefix)
        .extract(&req, &mut key);
    check_key(&mut key);
});
