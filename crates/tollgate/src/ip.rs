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

    /// Whether the range is wider than any one network's: shorter than
    /// /8 for IPv4, /32 for IPv6 (a regional registry's allocation).
    /// Trusting or listing such a range is a mistake (`0.0.0.0/0`
    /// trusts every peer to name its own address), not a configuration.
    pub(crate) fn is_sweeping(&self) -> bool {
        let len = self.mask.count_ones();
        if self.v4 {
            len < 8
        } else {
            len < 32
        }
    }

    /// Parses `s` for the configuration field `field`, refusing a range
    /// that sweeps in nearly every address (see [`is_sweeping`](Self::is_sweeping)).
    pub(crate) fn narrow(s: &str, field: &'static str) -> Result<Self, tollgate_core::ConfigError> {
        let c: Cidr = s
            .parse()
            .map_err(|e: String| tollgate_core::ConfigError::new(field, e))?;
        if c.is_sweeping() {
            return Err(tollgate_core::ConfigError::new(
                field,
                format!(
                    "{:?} covers nearly every address (shorter than /8 for IPv4, /32 for IPv6): name your own networks",
                    s.trim()
                ),
            ));
        }
        Ok(c)
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

/// A set of CIDR ranges, looked up in one hash probe per distinct prefix
/// length (not one comparison per range): lists of thousands of ranges
/// cost what a handful do. IPv4-mapped IPv6 addresses match IPv4 ranges.
#[derive(Debug, Clone, Default)]
pub(crate) struct NetSet {
    /// (family is IPv4, mask) -> the networks under that mask.
    by_mask: Vec<((bool, u128), std::collections::HashSet<u128>)>,
}

impl NetSet {
    pub(crate) fn insert(&mut self, c: Cidr) {
        let at = (c.v4, c.mask);
        match self.by_mask.iter_mut().find(|(m, _)| *m == at) {
            Some((_, set)) => {
                set.insert(c.net);
            }
            None => self.by_mask.push((at, std::iter::once(c.net).collect())),
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.by_mask.is_empty()
    }

    pub(crate) fn contains(&self, ip: IpAddr) -> bool {
        let (b, v4) = bits(ip.to_canonical());
        self.by_mask
            .iter()
            .any(|((family, mask), set)| *family == v4 && set.contains(&(b & mask)))
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

    #[test]
    fn net_sets_match_every_range_and_fold_mapped_addresses() {
        let mut set = NetSet::default();
        for r in [
            "10.0.0.0/8",
            "192.168.1.0/24",
            "203.0.113.7",
            "2001:db8::/32",
            "::/0",
        ] {
            set.insert(r.parse().unwrap());
        }
        let has = |ip: &str| set.contains(ip.parse().unwrap());
        assert!(has("10.1.2.3"));
        assert!(has("192.168.1.255"));
        assert!(!has("192.168.2.1"));
        assert!(has("203.0.113.7"));
        assert!(!has("203.0.113.8"));
        // IPv4-mapped IPv6 is IPv4: in 10/8, not in ::/0.
        assert!(has("::ffff:10.9.9.9"));
        assert!(!has("::ffff:11.0.0.1"));
        assert!(has("2001:db8:1::1"));
        assert!(has("fe80::1"), "::/0 holds every IPv6 address");
        let mut v4_only = NetSet::default();
        v4_only.insert("0.0.0.0/0".parse().unwrap());
        assert!(v4_only.contains("1.2.3.4".parse().unwrap()));
        assert!(!v4_only.contains("2001:db8::1".parse().unwrap()));
        assert!(v4_only.contains("::ffff:1.2.3.4".parse().unwrap()));
        // Thousands of ranges of one length: one probe.
        let mut many = NetSet::default();
        for i in 0..5_000u32 {
            many.insert(
                format!("{}.{}.{}.0/24", 100 + i / 65_536, (i / 256) % 256, i % 256)
                    .parse()
                    .unwrap(),
            );
        }
        assert_eq!(many.by_mask.len(), 1);
        assert!(many.contains("100.19.135.5".parse().unwrap()));
        assert!(!many.contains("100.19.136.1".parse().unwrap()));
    }
}
