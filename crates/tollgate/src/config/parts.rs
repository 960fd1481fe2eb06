//! Keys and costs a file names, as extractors and cost functions.

use std::sync::Arc;

use http::Request;

use crate::cost::{BodyLength, ByMethod, ByRoute, Cost, Fixed, HeaderCost, QueryCost};
use crate::key::{
    ClientFingerprint, ClientIp, Global, Header, KeyBuf, KeyExtractor, Method, Or, Path, PeerIp,
};

/// One part of a file's key.
#[derive(Debug, Clone)]
enum Part {
    Header(Header),
    Fingerprint(ClientFingerprint),
    ClientIp(ClientIp),
    PeerIp(PeerIp),
    Path,
    Method,
    Global,
    #[cfg(feature = "axum")]
    Route,
    #[cfg(feature = "geoip")]
    Geo(crate::key::GeoIp),
}

impl<B> KeyExtractor<B> for Part {
    fn extract(&self, req: &Request<B>, key: &mut KeyBuf) -> Option<()> {
        match self {
            Part::Header(h) => h.extract(req, key),
            Part::Fingerprint(f) => f.extract(req, key),
            Part::ClientIp(ip) => ip.extract(req, key),
            Part::PeerIp(ip) => ip.extract(req, key),
            Part::Path => Path.extract(req, key),
            Part::Method => Method.extract(req, key),
            Part::Global => Global.extract(req, key),
            #[cfg(feature = "axum")]
            Part::Route => crate::key::Route.extract(req, key),
            #[cfg(feature = "geoip")]
            Part::Geo(g) => g.extract(req, key),
        }
    }

    fn is_fixed(&self) -> bool {
        matches!(self, Part::Global)
    }
}

/// Whose budget a `[[retry_budgets]]` entry's call draws on: the
/// upstream's host (`key = "upstream"`, the default), or a key as the
/// other entries write it.
#[derive(Debug, Clone)]
pub enum RetryKey {
    /// [`Upstream`](crate::retry::Upstream).
    Upstream,
    /// A [`FileKey`].
    File(FileKey),
}

impl<B> KeyExtractor<B> for RetryKey {
    fn extract(&self, req: &Request<B>, key: &mut KeyBuf) -> Option<()> {
        match self {
            Self::Upstream => crate::retry::Upstream.extract(req, key),
            Self::File(k) => k.extract(req, key),
        }
    }

    fn is_fixed(&self) -> bool {
        match self {
            Self::Upstream => false,
            Self::File(k) => KeyExtractor::<B>::is_fixed(k),
        }
    }
}

/// A key a policy file declares, e.g. `"header:x-api-key | client-ip"`.
/// It writes the same store keys as the extractors built in code
/// (`Header::named("x-api-key")?.or(ClientIp::…)`), so moving a rule
/// between code and a file keeps its clients' state.
///
/// Behind a [`Tollgate`](super::Tollgate) whose limits read one key in
/// several places, each distinct key is read from a request once: the
/// first limit that reads it remembers it for the others.
#[derive(Debug, Clone)]
pub struct FileKey {
    node: Node,
    /// What the key means: its text's parts and what they read beyond
    /// themselves ([`FileSpec::key_context`](super::spec::FileSpec::key_context)),
    /// hashed. Two keys of one meaning read the same key of a request.
    meaning: u64,
}

/// How many keys a request remembers: the first this many distinct keys
/// its limits read (more are read where met, as without it).
const REMEMBERED: usize = 4;

/// The keys a request's limits have read, each read once: put in the
/// request's extensions by a [`Tollgate`](super::Tollgate) whose limits
/// share keys, filled by the first limit that reads each
/// ([`FileKey::extract`]), copied by the others. A key not found is
/// remembered too.
pub(crate) struct Extracted(std::sync::Mutex<Remembered>);

#[derive(Clone, Default)]
struct Remembered {
    len: usize,
    keys: [(u64, Option<KeyBuf>); REMEMBERED],
    /// Route costs computed, by meaning ([`ByRoute::meaning`]).
    costs_len: usize,
    costs: [(u64, u64); REMEMBERED],
}

impl Extracted {
    pub(crate) fn new() -> Self {
        Self(std::sync::Mutex::new(Remembered::default()))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Remembered> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The key of `meaning` into `key` (empty): as remembered, else read
    /// by `read` and remembered (while there is room).
    fn extract(
        &self,
        meaning: u64,
        key: &mut KeyBuf,
        read: impl FnOnce(&mut KeyBuf) -> Option<()>,
    ) -> Option<()> {
        {
            let seen = self.lock();
            let len = seen.len;
            if let Some((_, found)) = seen.keys.iter().take(len).find(|(m, _)| *m == meaning) {
                return found.as_ref().map(|k| key.clone_from(k));
            }
        }
        // Read outside the lock.
        let read = read(key);
        let mut seen = self.lock();
        let len = seen.len;
        if let Some(slot) = seen.keys.get_mut(len) {
            *slot = (meaning, read.map(|()| key.clone()));
            seen.len = len.saturating_add(1);
        }
        read
    }
}

impl Extracted {
    /// The cost of `meaning`: as remembered, else computed by `compute`
    /// and remembered (while there is room).
    fn cost(&self, meaning: u64, compute: impl FnOnce() -> u64) -> u64 {
        {
            let seen = self.lock();
            let len = seen.costs_len;
            if let Some((_, c)) = seen.costs.iter().take(len).find(|(m, _)| *m == meaning) {
                return *c;
            }
        }
        // Computed outside the lock.
        let cost = compute();
        let mut seen = self.lock();
        let len = seen.costs_len;
        if seen.costs.iter().take(len).any(|(m, _)| *m == meaning) {
            return cost;
        }
        if let Some(slot) = seen.costs.get_mut(len) {
            *slot = (meaning, cost);
            seen.costs_len = len.saturating_add(1);
        }
        cost
    }
}

impl Clone for Extracted {
    fn clone(&self) -> Self {
        Self(std::sync::Mutex::new(self.lock().clone()))
    }
}

#[derive(Debug, Clone)]
enum Node {
    /// Every part, in order (a tuple).
    All(Arc<[Part]>),
    /// The first's key, else the second's (`Or`).
    Or(Arc<Or<Node, Node>>),
}

impl<B> KeyExtractor<B> for Node {
    fn extract(&self, req: &Request<B>, key: &mut KeyBuf) -> Option<()> {
        match self {
            Node::All(parts) => {
                for part in parts.iter() {
                    part.extract(req, key)?;
                }
                Some(())
            }
            Node::Or(or) => or.extract(req, key),
        }
    }

    fn is_fixed(&self) -> bool {
        match self {
            Node::All(parts) => parts.iter().all(KeyExtractor::<B>::is_fixed),
            Node::Or(or) => KeyExtractor::<B>::is_fixed(&**or),
        }
    }
}

impl<B> KeyExtractor<B> for FileKey {
    fn extract(&self, req: &Request<B>, key: &mut KeyBuf) -> Option<()> {
        if key.is_empty() {
            if let Some(seen) = req.extensions().get::<Extracted>() {
                return seen.extract(self.meaning, key, |key| self.read(req, key));
            }
        }
        self.read(req, key)
    }

    fn is_fixed(&self) -> bool {
        KeyExtractor::<B>::is_fixed(&self.node)
    }
}

#[cfg(test)]
thread_local! {
    /// Keys read from requests on this thread (not copied).
    pub(crate) static READS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    /// Route costs computed on this thread (not remembered).
    pub(crate) static COSTED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

impl FileKey {
    /// The key, read from `req`.
    fn read<B>(&self, req: &Request<B>, key: &mut KeyBuf) -> Option<()> {
        #[cfg(test)]
        READS.with(|r| r.set(r.get().saturating_add(1)));
        self.node.extract(req, key)
    }
}

impl FileKey {
    /// Reads a key: alternatives split by `|`, parts joined by `+`; a
    /// part is `header:<name>`, `fingerprint:<name>,<name>...`,
    /// `client-ip`, `peer-ip`, `path`, `route`, `method`, `global`, or
    /// `asn` and `country` (from `geo`, the `[geoip]` databases). `client`
    /// is the `client-ip` extractor.
    pub(super) fn parse(
        text: &str,
        client: &ClientIp,
        v6_prefix: u8,
        file: &super::spec::FileSpec,
    ) -> Result<Self, String> {
        let geo = file.geo();
        let mut alternatives = Vec::new();
        for parts in super::spec::key_parts(text) {
            let mut all = Vec::with_capacity(parts.len());
            for part in parts {
                all.push(match part {
                    "client-ip" => Part::ClientIp(client.clone()),
                    "peer-ip" => Part::PeerIp(PeerIp::new().ipv6_prefix(v6_prefix)),
                    "path" => Part::Path,
                    "method" => Part::Method,
                    "global" => Part::Global,
                    #[cfg(feature = "axum")]
                    "route" => Part::Route,
                    "asn" | "country" => geo_part(part, client, geo)?,
                    _ => match (part.strip_prefix("header:"), part.strip_prefix("fingerprint:")) {
                        (Some(name), _) => Part::Header(
                            Header::named(name.trim()).map_err(|e| e.message().to_owned())?,
                        ),
                        (_, Some(names)) => Part::Fingerprint(
                            ClientFingerprint::of(&names.split(',').collect::<Vec<_>>())
                                .map_err(|e| e.message().to_owned())?,
                        ),
                        _ => {
                            return Err(format!(
                                "{part:?} is not a key part (header:<name>, fingerprint:<name>,<name>..., client-ip, peer-ip, path, route, method, global, asn, country)"
                            ))
                        }
                    },
                });
            }
            alternatives.push(Node::All(all.into()));
        }
        let mut alternatives = alternatives.into_iter();
        let first = alternatives
            .next()
            .ok_or_else(|| "the key is empty".to_owned())?;
        // `a | b | c` is `a.or(b).or(c)`.
        Ok(Self {
            node: alternatives.fold(first, |acc, next| Node::Or(Arc::new(Or::new(acc, next)))),
            meaning: meaning(text, file),
        })
    }
}

/// What the key `text` of `file` means, as a number: its parts, and what
/// they read beyond themselves.
fn meaning(text: &str, file: &super::spec::FileSpec) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    file.key_context().hash(&mut h);
    // As read: header names in any case, spaces around names dropped.
    for alternative in super::spec::key_parts(text) {
        alternative.len().hash(&mut h);
        for part in alternative {
            part.chars()
                .filter(|c| !c.is_whitespace())
                .map(|c| c.to_ascii_lowercase())
                .collect::<String>()
                .hash(&mut h);
        }
    }
    h.finish()
}

/// Whether two of `file`'s limits read one key, or charge one named
/// cost: then a request's keys and route costs are worth remembering
/// ([`Extracted`]).
pub(super) fn reads_repeat(file: &super::spec::FileSpec, decisions_only: bool) -> bool {
    // A decision endpoint has no in-flight limits or pacing.
    let (concurrency, bandwidth) = if decisions_only {
        (&[][..], &[][..])
    } else {
        (&file.concurrency[..], &file.bandwidth[..])
    };
    let keys = file
        .rules
        .iter()
        .map(|r| &r.get_ref().key)
        .chain(file.quotas.iter().map(|q| &q.get_ref().key))
        .chain(concurrency.iter().map(|c| &c.get_ref().key))
        .chain(bandwidth.iter().map(|b| &b.get_ref().key));
    let mut seen = std::collections::HashSet::new();
    if keys
        .map(|k| meaning(k.get_ref(), file))
        .any(|m| !seen.insert(m))
    {
        return true;
    }
    let in_flight = concurrency.iter().map(|c| c.get_ref().cost.as_ref());
    let costs = file
        .rules
        .iter()
        .map(|r| r.get_ref().cost.as_ref())
        .chain(file.quotas.iter().map(|q| q.get_ref().cost.as_ref()))
        .chain(in_flight);
    let mut named = std::collections::HashSet::new();
    costs
        .filter_map(|c| c.and_then(|c| c.get_ref().as_str()))
        .any(|name| !named.insert(name))
}

/// The key part `asn` or `country`: the client address's, in the
/// `[geoip]` database the file names.
fn geo_part(part: &str, client: &ClientIp, geo: &super::spec::Geo) -> Result<Part, String> {
    let loaded = if part == "asn" { &geo[0] } else { &geo[1] };
    match loaded {
        None => Err(format!(
            "the key part {part} needs [geoip] {part} = \"<database>\""
        )),
        Some(Err(e)) => Err(format!("[geoip] {part}: {e}")),
        #[cfg(feature = "geoip")]
        Some(Ok(db)) => Ok(Part::Geo(db.clone().client_ip(client.clone()))),
        #[cfg(not(feature = "geoip"))]
        Some(Ok(())) => {
            let _ = client;
            Err("[geoip] needs tollgate's geoip feature".to_owned())
        }
    }
}

/// A cost a policy file declares.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum FileCost {
    /// `cost = 3`.
    Fixed(Fixed),
    /// `cost = { header = "x-cost", default = 1, max = 100 }`.
    Header(HeaderCost),
    /// `cost = { query = "count", default = 1, max = 100 }`.
    Query(QueryCost),
    /// `cost = { bytes_per_unit = 1024, default = 1, max = 1000 }`.
    Body(BodyLength),
    /// `cost = { default = 1, methods = { POST = 5 } }`.
    Methods(ByMethod),
    /// `cost = { default = 1, routes = [{ method = "POST", path = "/api/orders", cost = 3 }] }`.
    Routes(ByRoute),
}

impl FileCost {
    /// The largest cost known at load (a fixed one, a method's, a
    /// route's) and what it is; `None` for costs read from the request
    /// (their `max` may well exceed a limit: such a request is refused).
    pub(crate) fn costliest(&self) -> Option<(u64, String)> {
        match self {
            FileCost::Fixed(c) => Some((c.0, "every request".to_owned())),
            FileCost::Methods(c) => Some(c.costliest()),
            FileCost::Routes(c) => Some(c.costliest()),
            FileCost::Header(_) | FileCost::Query(_) | FileCost::Body(_) => None,
        }
    }
}

impl<B> Cost<B> for FileCost {
    fn cost(&self, req: &Request<B>) -> u64 {
        match self {
            FileCost::Fixed(c) => Cost::<B>::cost(c, req),
            FileCost::Header(c) => Cost::<B>::cost(c, req),
            FileCost::Query(c) => Cost::<B>::cost(c, req),
            FileCost::Body(c) => Cost::<B>::cost(c, req),
            FileCost::Methods(c) => Cost::<B>::cost(c, req),
            // Behind a `Tollgate` whose limits share it, computed once a
            // request (it normalises and compares the path).
            FileCost::Routes(c) => {
                let compute = || {
                    #[cfg(test)]
                    COSTED.with(|n| n.set(n.get().saturating_add(1)));
                    Cost::<B>::cost(c, req)
                };
                match req.extensions().get::<Extracted>() {
                    Some(seen) => seen.cost(c.meaning(), compute),
                    None => compute(),
                }
            }
        }
    }
}
