//! Coarse network keys (000 §4: IP, ASN and country as coarse protection;
//! §7: deny by ASN): the client address's autonomous system or country,
//! looked up in a MaxMind-format database (GeoLite2-ASN, GeoIP2-Country,
//! or any MMDB with the same fields).

use std::path::Path;
use std::sync::Arc;

use http::Request;
use maxminddb::{PathElement, Reader};
use tollgate_core::ConfigError;

use super::{ClientIp, KeyBuf, KeyExtractor};

/// What a [`GeoIp`] key is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum GeoField {
    /// The autonomous system number (`autonomous_system_number`, as in
    /// GeoLite2-ASN): one key for every address of a hosting provider or
    /// an ISP.
    Asn,
    /// The country's ISO 3166-1 code (`country.iso_code`, as in
    /// GeoIP2-Country and -City).
    Country,
}

/// The client address's autonomous system or country as a key, from a
/// MaxMind-format database: a limit per hosting provider (a scraper's
/// addresses rotate within one ASN) or per country. An address the
/// database does not hold, or a request without a client address, has no
/// key (the rule's [`MissingKey`](super::MissingKey) decides). The client
/// address is [`ClientIp`]'s (the peer's by default: set
/// [`client_ip`](Self::client_ip) behind proxies). Keys are `as` and the
/// number, or `cc` and the code, so neither is mistaken for an address
/// key. The database is read once, when the key is built (feature
/// `geoip`).
///
/// ```no_run
/// use tollgate::key::{ClientIp, GeoField, GeoIp};
///
/// let asn = GeoIp::open("GeoLite2-ASN.mmdb", GeoField::Asn)?
///     .client_ip(ClientIp::trusting(&["10.0.0.0/8"])?);
/// # Ok::<(), tollgate::ConfigError>(())
/// ```
#[derive(Clone)]
pub struct GeoIp {
    db: Arc<Reader<Vec<u8>>>,
    field: GeoField,
    client: ClientIp,
}

impl std::fmt::Debug for GeoIp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GeoIp")
            .field("database", &self.db.metadata().database_type)
            .field("field", &self.field)
            .finish_non_exhaustive()
    }
}

impl GeoIp {
    /// Reads the database at `path`. Errors name the field `geoip`.
    pub fn open(path: impl AsRef<Path>, field: GeoField) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| {
            ConfigError::new("geoip", format!("cannot read {}: {e}", path.display()))
        })?;
        Self::from_bytes(bytes, field)
    }

    /// A database already read. Errors name the field `geoip`.
    pub fn from_bytes(bytes: Vec<u8>, field: GeoField) -> Result<Self, ConfigError> {
        let db = Reader::from_source(bytes)
            .map_err(|e| ConfigError::new("geoip", format!("not a MaxMind DB database: {e}")))?;
        // Another kind of database answers every address with no key:
        // said once, when it is read.
        let kind = &db.metadata().database_type;
        let expected = match field {
            GeoField::Asn => ["ASN", "ISP"],
            GeoField::Country => ["Country", "City"],
        };
        if !expected.iter().any(|e| kind.contains(e)) {
            tracing::warn!(
                target: "tollgate",
                database_type = %kind,
                ?field,
                "a MaxMind database of another kind than this key reads: addresses it has no \
                 field for get no key"
            );
        }
        Ok(Self {
            db: Arc::new(db),
            field,
            client: ClientIp::peer(),
        })
    }

    /// Where the client's address is read (default: the peer's).
    pub fn client_ip(mut self, client: ClientIp) -> Self {
        self.client = client;
        self
    }
}

impl<B> KeyExtractor<B> for GeoIp {
    fn extract(&self, req: &Request<B>, key: &mut KeyBuf) -> Option<()> {
        let ip = self.client.client_ip(req)?;
        let found = self.db.lookup(ip).ok()?;
        match self.field {
            GeoField::Asn => {
                let path = [PathElement::Key("autonomous_system_number")];
                let asn: u32 = found.decode_path(&path).ok()??;
                key.push(b"as");
                key.push(&asn.to_be_bytes());
            }
            GeoField::Country => {
                let path = [PathElement::Key("country"), PathElement::Key("iso_code")];
                let code: String = found.decode_path(&path).ok()??;
                key.push(b"cc");
                key.push(code.as_bytes());
            }
        }
        Some(())
    }
}

/// A small MaxMind DB writer for tests: an IPv4 database (24-bit
/// records) mapping networks to an ASN and a country.
#[cfg(test)]
pub(crate) mod testing {
    use std::net::Ipv4Addr;

    /// `networks`: (network, prefix length, ASN, country code).
    pub(crate) fn database(networks: &[(Ipv4Addr, u8, u32, &str)]) -> Vec<u8> {
        // The data section: one record per network.
        let mut data = Vec::new();
        let mut offsets = Vec::new();
        for (_, _, asn, cc) in networks {
            offsets.push(data.len());
            map(&mut data, 2);
            string(&mut data, "autonomous_system_number");
            uint(&mut data, 6, u64::from(*asn));
            string(&mut data, "country");
            map(&mut data, 1);
            string(&mut data, "iso_code");
            string(&mut data, cc);
        }
        // The tree: node 0 is the root; a record is a node number, the
        // node count (no data), or node count + 16 + a data offset.
        let mut nodes: Vec<[Option<Leaf>; 2]> = vec![[None, None]];
        for (i, (net, len, _, _)) in networks.iter().enumerate() {
            let bits = u32::from(*net);
            let mut node = 0;
            for depth in 0..*len {
                let bit = usize::from((bits >> (31 - depth)) & 1 == 1);
                if depth + 1 == *len {
                    nodes[node][bit] = Some(Leaf::Data(offsets[i]));
                    break;
                }
                node = match nodes[node][bit] {
                    Some(Leaf::Node(n)) => n,
                    _ => {
                        nodes.push([None, None]);
                        let n = nodes.len() - 1;
                        nodes[node][bit] = Some(Leaf::Node(n));
                        n
                    }
                };
            }
        }
        let count = nodes.len();
        let mut out = Vec::new();
        for node in &nodes {
            for leaf in node {
                let record = match leaf {
                    None => count,
                    Some(Leaf::Node(n)) => *n,
                    Some(Leaf::Data(offset)) => count + 16 + offset,
                };
                let r = u32::try_from(record).unwrap();
                out.extend_from_slice(&r.to_be_bytes()[1..]);
            }
        }
        out.extend_from_slice(&[0; 16]);
        out.extend_from_slice(&data);
        out.extend_from_slice(b"\xAB\xCD\xEFMaxMind.com");
        map(&mut out, 9);
        string(&mut out, "binary_format_major_version");
        uint(&mut out, 5, 2);
        string(&mut out, "binary_format_minor_version");
        uint(&mut out, 5, 0);
        string(&mut out, "build_epoch");
        // uint64: an extended type (9 = 7 + 2).
        out.extend_from_slice(&[0x04, 2, 0, 0, 0, 0]);
        string(&mut out, "database_type");
        string(&mut out, "Test-ASN-Country");
        string(&mut out, "description");
        map(&mut out, 0);
        string(&mut out, "ip_version");
        uint(&mut out, 5, 4);
        string(&mut out, "languages");
        // An empty array: extended type 11 = 7 + 4.
        out.extend_from_slice(&[0x00, 4]);
        string(&mut out, "node_count");
        uint(&mut out, 6, u64::try_from(count).unwrap());
        string(&mut out, "record_size");
        uint(&mut out, 5, 24);
        out
    }

    enum Leaf {
        Node(usize),
        Data(usize),
    }

    fn map(out: &mut Vec<u8>, entries: u8) {
        out.push((7 << 5) | entries);
    }

    fn string(out: &mut Vec<u8>, s: &str) {
        let len = u8::try_from(s.len()).unwrap();
        assert!(len < 29);
        out.push((2 << 5) | len);
        out.extend_from_slice(s.as_bytes());
    }

    /// An unsigned integer of type `kind` (5: uint16, 6: uint32), in as
    /// few bytes as it needs.
    fn uint(out: &mut Vec<u8>, kind: u8, n: u64) {
        let bytes = n.to_be_bytes();
        let skip = bytes.iter().take_while(|b| **b == 0).count();
        let used = &bytes[skip..];
        out.push((kind << 5) | u8::try_from(used.len()).unwrap());
        out.extend_from_slice(used);
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, SocketAddr};

    use super::*;

    fn db() -> Vec<u8> {
        testing::database(&[
            (Ipv4Addr::new(198, 51, 100, 0), 24, 64_500, "DE"),
            (Ipv4Addr::new(203, 0, 113, 0), 25, 64_501, "FR"),
            (Ipv4Addr::new(203, 0, 113, 128), 25, 64_500, "DE"),
        ])
    }

    fn key_of(geo: &GeoIp, addr: &str) -> Option<Vec<u8>> {
        let mut req = Request::get("/").body(()).unwrap();
        if !addr.is_empty() {
            req.extensions_mut()
                .insert(addr.parse::<SocketAddr>().unwrap());
        }
        let mut key = KeyBuf::new();
        geo.extract(&req, &mut key)?;
        Some(key.as_bytes().to_vec())
    }

    #[test]
    fn addresses_of_one_network_share_its_key() {
        let asn = GeoIp::from_bytes(db(), GeoField::Asn).unwrap();
        let country = GeoIp::from_bytes(db(), GeoField::Country).unwrap();
        let a = key_of(&asn, "198.51.100.7:1").unwrap();
        // Another address of AS64500, in another network.
        assert_eq!(key_of(&asn, "203.0.113.200:1"), Some(a.clone()));
        assert_ne!(key_of(&asn, "203.0.113.7:1"), Some(a));
        assert_eq!(
            key_of(&country, "198.51.100.7:1"),
            key_of(&country, "203.0.113.129:1")
        );
        assert_ne!(
            key_of(&country, "198.51.100.7:1"),
            key_of(&country, "203.0.113.1:1")
        );
        // An ASN key is never an address or country key.
        assert_ne!(
            key_of(&asn, "198.51.100.7:1"),
            key_of(&country, "198.51.100.7:1")
        );
        // Not in the database, an IPv6 address in an IPv4 one, or no
        // address at all: no key.
        assert_eq!(key_of(&asn, "192.0.2.1:1"), None);
        assert_eq!(key_of(&asn, "[2001:db8::1]:1"), None);
        assert_eq!(key_of(&asn, ""), None);
    }

    #[test]
    fn a_database_that_is_not_one_is_an_error_naming_geoip() {
        let e = GeoIp::from_bytes(b"not a database".to_vec(), GeoField::Asn).unwrap_err();
        assert_eq!(e.field(), "geoip");
        let e = GeoIp::open("/nonexistent/GeoLite2-ASN.mmdb", GeoField::Asn).unwrap_err();
        assert_eq!(e.field(), "geoip");
        // A cut database is refused too, not read past its end.
        let mut cut = db();
        cut.truncate(cut.len() / 2);
        assert!(GeoIp::from_bytes(cut, GeoField::Country).is_err());
    }
}
