//! CIDR ranges and `Forwarded` parsing for [`ClientIp`](crate::key::ClientIp).

use std::net::IpAddr;
use std::str::FromStr;

/// An IP range: an address and a prefix length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Cidr {
    net: u128,
    mask: u128,
    v4: bool,
}

fn bits(ip: IpAddr) -> (u128, bool) {
    match ip {
        IpAddr::V4(v4) => (u128::from(u32::from(v4)), true),
        IpAddr::V6(v6) => (u128::from(v6), false),
    }
}

impl Cidr {
    pub(crate) fn contains(&self, ip: IpAddr) -> bool {
        let (b, v4) = bits(ip);
        v4 == self.v4 && b & self.mask == self.net
    }
}

impl FromStr for Cidr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let (addr, len) = match s.split_once('/') {
            Some((a, l)) => (a, Some(l)),
            None => (s, None),
        };
        let ip: IpAddr = addr
            .parse()
            .map_err(|_| format!("{s:?} is not an IP address or CIDR range"))?;
        let (b, v4) = bits(ip);
        let width: u32 = if v4 { 32 } else { 128 };
        let len = match len {
            None => width,
            Some(l) => l
                .parse::<u32>()
                .ok()
                .filter(|l| *l <= width)
                .ok_or_else(|| format!("{s:?} has an invalid prefix length"))?,
        };
        // An IPv4-mapped IPv6 range is an IPv4 range: addresses are
        // compared in their canonical (IPv4) form.
        if let IpAddr::V6(v6) = ip {
            if let (Some(v4), Some(len4)) = (v6.to_ipv4_mapped(), len.checked_sub(96)) {
                return Self::from_str(&format!("{v4}/{len4}"));
            }
        }
        let keep = u128::MAX
            .checked_shl(128u32.saturating_sub(len))
            .unwrap_or(0);
        let mask = if v4 { keep >> 96 } else { keep };
        Ok(Self {
            net: b & mask,
            mask,
            v4,
        })
    }
}

/// The `for=` value of one `Forwarded` element (`for=1.2.3.4;proto=http`).
pub(crate) fn forwarded_for(element: &str) -> Option<&str> {
    element.split(';').find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        k.trim().eq_ignore_ascii_case("for").then_some(v.trim())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_contain_what_they_should() {
        let c: Cidr = "10.0.0.0/8".parse().unwrap();
        assert!(c.contains("10.255.0.1".parse().unwrap()));
        assert!(!c.contains("11.0.0.1".parse().unwrap()));
        assert!(!c.contains("::a00:1".parse().unwrap()));
        let all: Cidr = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains("1.2.3.4".parse().unwrap()));
        let v6: Cidr = "2001:db8::/32".parse().unwrap();
        assert!(v6.contains("2001:db8:ffff::1".parse().unwrap()));
        let mapped: Cidr = "::ffff:10.0.0.0/104".parse().unwrap();
        assert!(mapped.contains("10.1.2.3".parse().unwrap()));
        let one: Cidr = "192.168.1.1".parse().unwrap();
        assert!(one.contains("192.168.1.1".parse().unwrap()));
        assert!(!one.contains("192.168.1.2".parse().unwrap()));
    }
}
