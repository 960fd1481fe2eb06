//! Allow and deny lists of client keys and IP networks.

use std::collections::HashSet;
use std::fmt;

use http::header::HeaderName;
use http::Request;
use tollgate_core::ConfigError;

use crate::ip::{Cidr, NetSet};
use crate::key::ClientIp;

/// What an [`AccessList`] says about a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Access {
    /// On an allow list: the policy's limits do not apply.
    Allowed,
    /// On a deny list (or not allowed where the list denies by default):
    /// 403 at once.
    Denied,
    /// On no list: the limits decide.
    Unlisted,
}

/// Allow and deny lists for a [`PolicyLayer`](super::PolicyLayer): client
/// keys (the values of a header, e.g. API keys) and IP networks (CIDRs,
/// IPv4 and IPv6; IPv4-mapped IPv6 addresses count as IPv4).
///
/// A deny list wins over an allow list. A request on an allow list skips
/// every limit of the policy; one on a deny list is answered 403 (gRPC
/// `PERMISSION_DENIED`) with a problem body naming the list. With
/// [`deny_by_default`](Self::deny_by_default) — for critical routes —
/// only requests on an allow list pass at all.
///
/// Network lookups cost one hash probe per distinct prefix length, so a
/// deny list of thousands of ranges costs what a handful do.
///
/// ```
/// use tollgate::key::ClientIp;
/// use tollgate::policy::AccessList;
///
/// # fn main() -> Result<(), tollgate::ConfigError> {
/// let access = AccessList::new("access")
///     .keys_from("x-api-key")?
///     .allow_keys(["internal-batch-job"])
///     .deny_keys(["key-leaked-on-2026-11-30"])
///     .client_ip(ClientIp::trusting(["10.0.0.0/8"])?)
///     .deny_networks(["203.0.113.0/24", "2001:db8:bad::/48"])?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct AccessList {
    pub(crate) name: String,
    key: Option<HeaderName>,
    allow_keys: HashSet<Box<[u8]>>,
    deny_keys: HashSet<Box<[u8]>>,
    ip: ClientIp,
    allow_nets: NetSet,
    deny_nets: NetSet,
    deny_by_default: bool,
}

impl fmt::Debug for AccessList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Keys are credentials: counts only.
        f.debug_struct("AccessList")
            .field("name", &self.name)
            .field("key", &self.key)
            .field("allow_keys", &self.allow_keys.len())
            .field("deny_keys", &self.deny_keys.len())
            .field("deny_by_default", &self.deny_by_default)
            .finish_non_exhaustive()
    }
}

fn networks<I, S>(field: &'static str, cidrs: I, set: &mut NetSet) -> Result<(), ConfigError>
where
    I: IntoIterator<Item = S>,
    S: AsRef<str>,
{
    for c in cidrs {
        // A wide range is a mistake where it lets requests in; denying
        // one fails closed, which may be meant (all of IPv6, say).
        let c: Cidr = if field == "deny_networks" {
            c.as_ref()
                .parse()
                .map_err(|e: String| ConfigError::new(field, e))?
        } else {
            Cidr::narrow(c.as_ref(), field)?
        };
        set.insert(c);
    }
    Ok(())
}

impl AccessList {
    /// An empty list named `name` (metrics, the 403's `rule`), reading
    /// client IPs as the peer's address (see [`client_ip`](Self::client_ip)).
    pub fn new(name: &str) -> Self {
        Self {
            name: name.to_owned(),
            key: None,
            allow_keys: HashSet::new(),
            deny_keys: HashSet::new(),
            ip: ClientIp::peer(),
            allow_nets: NetSet::default(),
            deny_nets: NetSet::default(),
            deny_by_default: false,
        }
    }

    /// The header whose value is the client key the key lists hold (e.g.
    /// `x-api-key`); errors name the field `header`.
    pub fn keys_from(mut self, header: &str) -> Result<Self, ConfigError> {
        self.key = Some(crate::key::header_name(header)?);
        Ok(self)
    }

    /// Keys that skip every limit. The list is checked before any
    /// authentication, by comparing what the client sends: an allowed key
    /// must be a high-entropy secret (a long random token), never a name
    /// such as `"ops"` that anyone can guess and send.
    pub fn allow_keys<I, S>(mut self, keys: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<[u8]>,
    {
        self.allow_keys
            .extend(keys.into_iter().map(|k| k.as_ref().into()));
        self
    }

    /// Keys refused with 403.
    pub fn deny_keys<I, S>(mut self, keys: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<[u8]>,
    {
        self.deny_keys
            .extend(keys.into_iter().map(|k| k.as_ref().into()));
        self
    }

    /// How the client's address is read (default: the peer's; behind
    /// proxies, a [`ClientIp`] that trusts them).
    pub fn client_ip(mut self, ip: ClientIp) -> Self {
        self.ip = ip;
        self
    }

    /// Networks that skip every limit; errors name `allow_networks`.
    pub fn allow_networks<I, S>(mut self, cidrs: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        networks("allow_networks", cidrs, &mut self.allow_nets)?;
        Ok(self)
    }

    /// Networks refused with 403; errors name `deny_networks`.
    pub fn deny_networks<I, S>(mut self, cidrs: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        networks("deny_networks", cidrs, &mut self.deny_nets)?;
        Ok(self)
    }

    /// Refuse every request no allow list holds (for critical routes:
    /// only listed keys or networks pass).
    pub fn deny_by_default(mut self, on: bool) -> Self {
        self.deny_by_default = on;
        self
    }

    /// What makes the lists a mistake, if anything: key lists with no
    /// header to read keys from (they could never match), or denying by
    /// default with nothing allowed (every request refused).
    pub(crate) fn mistake(&self) -> Option<&'static str> {
        if self.key.is_none() && !(self.allow_keys.is_empty() && self.deny_keys.is_empty()) {
            return Some("key lists need keys_from (the header that carries the key)");
        }
        if self.deny_by_default && self.allow_keys.is_empty() && self.allow_nets.is_empty() {
            return Some("deny_by_default with nothing allowed refuses every request");
        }
        None
    }

    /// What the lists say about `req`. A request that carries its key
    /// header more than once is denied if *any* of them is a denied key
    /// (a server behind may read another one than the first), and is
    /// allowed by key only when it carries exactly one.
    pub fn check<B>(&self, req: &Request<B>) -> Access {
        let mut keys = self
            .key
            .as_ref()
            .map(|name| req.headers().get_all(name).iter())
            .into_iter()
            .flatten()
            .map(http::HeaderValue::as_bytes);
        let first = keys.next();
        let more = keys.next();
        let denied_key = first
            .into_iter()
            .chain(more)
            .chain(keys)
            .any(|k| self.deny_keys.contains(k));
        let needs_ip = !self.allow_nets.is_empty() || !self.deny_nets.is_empty();
        let ip = needs_ip.then(|| self.ip.client_ip(req)).flatten();
        if denied_key || ip.is_some_and(|ip| self.deny_nets.contains(ip)) {
            return Access::Denied;
        }
        let only = if more.is_none() { first } else { None };
        if only.is_some_and(|k| self.allow_keys.contains(k))
            || ip.is_some_and(|ip| self.allow_nets.contains(ip))
        {
            return Access::Allowed;
        }
        if self.deny_by_default {
            Access::Denied
        } else {
            Access::Unlisted
        }
    }
}

/// An access list in a layer of one limit (quota, concurrency): the list,
/// its counters, its name.
pub(crate) struct Listed {
    list: AccessList,
    allowed: metrics::Counter,
    denied: metrics::Counter,
    name: std::sync::Arc<str>,
}

impl Listed {
    /// Checks the list as a policy does; errors name the field `access`.
    /// Its outcomes are counted in the layer's series `metric`, under the
    /// list's name.
    pub(crate) fn new(
        list: AccessList,
        metric: &'static str,
    ) -> Result<Self, tollgate_core::ConfigError> {
        if let Some(mistake) = list.mistake() {
            return Err(tollgate_core::ConfigError::new("access", mistake));
        }
        let counter = |outcome: &'static str| metrics::counter!(metric, "rule" => list.name.clone(), "outcome" => outcome);
        Ok(Self {
            allowed: counter("listed_allowed"),
            denied: counter("denied"),
            name: list.name.as_str().into(),
            list,
        })
    }

    /// What the lists say of `req`, counted: `Allowed` skips the limit,
    /// `Denied` is refused with [`denied`](Self::denied).
    pub(crate) fn check<B>(&self, req: &Request<B>) -> Access {
        let access = self.list.check(req);
        match access {
            Access::Allowed => self.allowed.increment(1),
            Access::Denied => self.denied.increment(1),
            Access::Unlisted => {}
        }
        access
    }

    /// The list's name.
    pub(crate) fn name(&self) -> &std::sync::Arc<str> {
        &self.name
    }

    /// Who a request is, as the list reads it, for an audit record: its
    /// key header's values, else its client address (empty if neither).
    pub(crate) fn who<B>(&self, req: &Request<B>) -> crate::key::KeyBuf {
        let mut who = crate::key::KeyBuf::new();
        let keys = self
            .list
            .key
            .as_ref()
            .map(|name| req.headers().get_all(name).iter())
            .into_iter()
            .flatten();
        let mut any = false;
        for k in keys {
            who.push(k.as_bytes());
            any = true;
        }
        if !any {
            if let Some(ip) = self.list.ip.client_ip(req) {
                who.push(ip.to_string().as_bytes());
            }
        }
        who
    }

    /// The refusal of a denied request (403, or gRPC `PERMISSION_DENIED`).
    pub(crate) fn denied(
        &self,
        kind: crate::rejection::LimitKind,
        grpc: bool,
    ) -> crate::rejection::Rejected {
        crate::rejection::Rejected {
            rule: std::sync::Arc::clone(&self.name),
            kind,
            reason: crate::rejection::Reason::Denied,
            decision: None,
            grpc,
        }
    }
}
