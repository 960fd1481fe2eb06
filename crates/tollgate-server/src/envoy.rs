//! Envoy's rate limit service configuration, as Envoy's own ratelimit
//! service reads it (one YAML file per domain), and the descriptor
//! matching it documents: a descriptor's entries walk the tree, each
//! entry matching a node of its key whose `value` is the entry's, a
//! prefix of it (`value: "/api/*"`), or absent (each value its own
//! counter); the node the last entry reaches decides.
//!
//! ```yaml
//! domain: edge
//! descriptors:
//!   - key: remote_address
//!     rate_limit: { unit: second, requests_per_unit: 10 }
//!   - key: path
//!     value: /api/reports
//!     shadow_mode: true
//!     rate_limit: { unit: minute, requests_per_unit: 5, name: reports }
//!   - key: tenant
//!     descriptors:
//!       - key: user
//!         rate_limit: { unit: second, requests_per_unit: 2, algorithm: gcra, burst: 4 }
//! ```
//!
//! tollgate's extras are optional: `algorithm` (`fixed_window`, Envoy's
//! and the default; `sliding_window`; `gcra` and `token_bucket` with a
//! `burst`).

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;
use tollgate::{Limit, Limiter, Rate, Rule, Store};

/// One domain's file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DomainSpec {
    domain: String,
    #[serde(default)]
    descriptors: Vec<DescriptorSpec>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DescriptorSpec {
    key: String,
    #[serde(default)]
    value: Option<String>,
    #[serde(default)]
    rate_limit: Option<RateLimitSpec>,
    #[serde(default)]
    descriptors: Vec<DescriptorSpec>,
    #[serde(default)]
    shadow_mode: bool,
    /// Envoy's per-descriptor stats: accepted, not used.
    #[serde(default)]
    #[allow(dead_code)]
    detailed_metric: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RateLimitSpec {
    #[serde(default)]
    unit: Option<String>,
    #[serde(default)]
    requests_per_unit: Option<u32>,
    #[serde(default)]
    unlimited: bool,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    replaces: Vec<Replaces>,
    #[serde(default)]
    algorithm: Option<String>,
    #[serde(default)]
    burst: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Replaces {
    name: String,
}

/// Why a configuration was refused: its file and the descriptor path.
#[derive(Debug)]
pub struct ConfigError(String);

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

/// Every domain's descriptor tree, its limits bound to a store.
pub struct Domains<L> {
    domains: BTreeMap<String, Vec<Node<L>>>,
}

impl<L> std::fmt::Debug for Domains<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Domains")
            .field("domains", &self.domains.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

struct Node<L> {
    key: String,
    value: Value,
    limit: Option<Bound<L>>,
    children: Vec<Node<L>>,
}

enum Value {
    /// Any value, each its own counter.
    Any,
    Exact(String),
    Prefix(String),
}

/// A node's limit.
#[derive(Debug)]
pub struct Bound<L> {
    /// The limit's name (its `name`, else its place in the tree): in the
    /// `RateLimit` fields, and what `replaces` names.
    pub name: String,
    /// What it is, as Envoy states it.
    pub requests_per_unit: u32,
    /// Its unit, as the protocol's enum numbers it.
    pub unit: i32,
    /// Its window in seconds (the fields' `w`).
    pub window_secs: u64,
    /// `None`: unlimited.
    pub limiter: Option<L>,
    /// Counted, never refused.
    pub shadow: bool,
    /// The names of the limits this one replaces when both apply.
    pub replaces: Vec<String>,
}

/// What a request's descriptor matched: its limit and its counter's key.
#[derive(Debug)]
pub struct Matched<'a, L> {
    /// The limit of the node the descriptor reached.
    pub bound: &'a Bound<L>,
    /// The counter's key: the domain and every entry, values included.
    pub key: Vec<u8>,
}

/// Reads each file: `(path, text)`. Errors name the file.
pub fn read(
    files: &[std::path::PathBuf],
) -> Result<Vec<(std::path::PathBuf, String)>, ConfigError> {
    files
        .iter()
        .map(|path| {
            std::fs::read_to_string(path)
                .map(|text| (path.clone(), text))
                .map_err(|e| ConfigError(format!("{}: cannot read: {e}", path.display())))
        })
        .collect()
}

impl<L: Limiter> Domains<L> {
    /// Reads each file (YAML, one domain each) and binds every limit to
    /// `store`. Errors name the file and the descriptor.
    pub fn load<St: Store<Limiter = L>>(
        files: &[std::path::PathBuf],
        store: &St,
    ) -> Result<Self, ConfigError> {
        Self::from_texts(&read(files)?, store)
    }

    /// [`load`](Self::load) from the files' texts, read already: each
    /// `(path, text)`.
    pub fn from_texts<St: Store<Limiter = L>>(
        texts: &[(std::path::PathBuf, String)],
        store: &St,
    ) -> Result<Self, ConfigError> {
        let mut domains = BTreeMap::new();
        for (path, text) in texts {
            let at = |m: String| ConfigError(format!("{}: {m}", path.display()));
            let spec: DomainSpec = serde_yaml_ng::from_str(text).map_err(|e| at(e.to_string()))?;
            if spec.domain.is_empty() {
                return Err(at("domain: is empty".to_owned()));
            }
            let nodes = bind(&spec.domain, &spec.descriptors, "", "", store).map_err(at)?;
            if domains.insert(spec.domain.clone(), nodes).is_some() {
                return Err(at(format!("domain {:?} is declared twice", spec.domain)));
            }
        }
        Ok(Self { domains })
    }

    /// Whether a file declares `domain`.
    pub fn knows(&self, domain: &str) -> bool {
        self.domains.contains_key(domain)
    }

    /// The limit `entries` reach in `domain`, and its counter's key; none
    /// when an entry matches no node, or the node reached has no limit.
    pub fn matched<'a>(&'a self, domain: &str, entries: &[(&str, &str)]) -> Option<Matched<'a, L>> {
        let mut level = self.domains.get(domain)?;
        let mut reached = None;
        let mut key = Vec::with_capacity(64);
        // Each part after its length: no value can pass for two.
        let mut push = |part: &[u8]| {
            key.extend_from_slice(&u32::try_from(part.len()).unwrap_or(u32::MAX).to_be_bytes());
            key.extend_from_slice(part);
        };
        push(domain.as_bytes());
        for (k, v) in entries {
            let node = find(level, k, v)?;
            push(k.as_bytes());
            push(v.as_bytes());
            reached = Some(node);
            level = &node.children;
        }
        let bound = reached?.limit.as_ref()?;
        Some(Matched { bound, key })
    }
}

/// The node of `key` matching `value` among `level`: an exact value, then
/// the longest prefix, then a node of any value.
fn find<'a, L>(level: &'a [Node<L>], key: &str, value: &str) -> Option<&'a Node<L>> {
    let of_key = || level.iter().filter(|n| n.key == key);
    of_key()
        .find(|n| matches!(&n.value, Value::Exact(v) if v == value))
        .or_else(|| {
            of_key()
                .filter(|n| matches!(&n.value, Value::Prefix(p) if value.starts_with(p.as_str())))
                .max_by_key(|n| match &n.value {
                    Value::Prefix(p) => p.len(),
                    _ => 0,
                })
        })
        .or_else(|| of_key().find(|n| matches!(n.value, Value::Any)))
}

fn bind<St: Store>(
    domain: &str,
    specs: &[DescriptorSpec],
    path: &str,
    path_key: &str,
    store: &St,
) -> Result<Vec<Node<St::Limiter>>, String> {
    let mut nodes = Vec::with_capacity(specs.len());
    for (i, d) in specs.iter().enumerate() {
        let here = if path.is_empty() {
            format!("descriptors[{i}]")
        } else {
            format!("{path}.descriptors[{i}]")
        };
        if d.key.is_empty() {
            return Err(format!("{here}.key: is empty"));
        }
        let value = match d.value.as_deref() {
            // An empty value is no value, as Envoy's service reads it.
            None | Some("") => Value::Any,
            Some(v) => match v.strip_suffix('*') {
                Some(prefix) if !prefix.contains('*') => Value::Prefix(prefix.to_owned()),
                _ if v.contains('*') => {
                    return Err(format!(
                        "{here}.value: {v:?}: a '*' may only end a value (a prefix)"
                    ))
                }
                _ => Value::Exact(v.to_owned()),
            },
        };
        let same = |n: &Node<St::Limiter>| {
            n.key == d.key
                && match (&n.value, &value) {
                    (Value::Any, Value::Any) => true,
                    (Value::Exact(a), Value::Exact(b)) | (Value::Prefix(a), Value::Prefix(b)) => {
                        a == b
                    }
                    _ => false,
                }
        };
        if nodes.iter().any(same) {
            return Err(format!(
                "{here}: another descriptor at this level has the same key and value"
            ));
        }
        let place = match &d.value {
            Some(v) if !v.is_empty() => format!("{path_key}/{}={v}", d.key),
            _ => format!("{path_key}/{}", d.key),
        };
        let limit = match &d.rate_limit {
            None => None,
            Some(r) => Some(bound(domain, r, d.shadow_mode, &here, &place, store)?),
        };
        let children = bind(domain, &d.descriptors, &here, &place, store)?;
        nodes.push(Node {
            key: d.key.clone(),
            value,
            limit,
            children,
        });
    }
    Ok(nodes)
}

fn bound<St: Store>(
    domain: &str,
    r: &RateLimitSpec,
    shadow: bool,
    here: &str,
    place: &str,
    store: &St,
) -> Result<Bound<St::Limiter>, String> {
    let field = |f: &str| format!("{here}.rate_limit.{f}");
    // Shown (statuses, fields) and what `replaces` names: its `name`, else
    // its place in the tree (`remote_address`, `tenant=acme/user`).
    let name = match &r.name {
        Some(n) if !n.is_empty() => n.clone(),
        _ => place.trim_start_matches('/').to_owned(),
    };
    let replaces = r.replaces.iter().map(|x| x.name.clone()).collect();
    if r.unlimited {
        return Ok(Bound {
            name,
            requests_per_unit: 0,
            unit: 0,
            window_secs: 0,
            limiter: None,
            shadow,
            replaces,
        });
    }
    let unit = r
        .unit
        .as_deref()
        .ok_or_else(|| format!("{}: is missing", field("unit")))?;
    let (secs, code) = match unit.to_ascii_lowercase().as_str() {
        "second" => (1, 1),
        "minute" => (60, 2),
        "hour" => (3_600, 3),
        "day" => (86_400, 4),
        "week" => (604_800, 7),
        "month" => (2_592_000, 5),
        "year" => (31_536_000, 6),
        _ => {
            return Err(format!(
                "{}: {unit:?} is not a unit: second, minute, hour, day, week, month or year",
                field("unit")
            ))
        }
    };
    let n = r
        .requests_per_unit
        .filter(|n| *n > 0)
        .ok_or_else(|| format!("{}: must be at least 1", field("requests_per_unit")))?;
    let window = Duration::from_secs(secs);
    let limit = match r.algorithm.as_deref().unwrap_or("fixed_window") {
        "fixed_window" => Limit::fixed_window(n, window),
        "sliding_window" => Limit::sliding_window_counter(n, window),
        "gcra" => Limit::gcra(Rate::new(n, window), r.burst.unwrap_or(n)),
        "token_bucket" => Limit::token_bucket(r.burst.unwrap_or(n), n, window),
        other => {
            return Err(format!(
                "{}: {other:?} is not one of fixed_window, sliding_window, gcra, token_bucket",
                field("algorithm")
            ))
        }
    };
    // Stored by a digest of the domain and the node's place: names are
    // free text and may repeat, and a descriptor added elsewhere in the
    // file leaves every other counter where it is.
    let digest = {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        h.update(
            u64::try_from(domain.len())
                .unwrap_or(u64::MAX)
                .to_be_bytes(),
        );
        h.update(domain.as_bytes());
        h.update(place.as_bytes());
        h.finalize()
    };
    let hex: String = digest.iter().take(12).map(|b| format!("{b:02x}")).collect();
    let rule = Rule::new(format!("rls:{hex}"), limit)
        .map_err(|e| format!("{}: {}", field(e.field()), e.message()))?;
    let limiter = store
        .limiter(&rule)
        .map_err(|e| format!("{}: {}", field(e.field()), e.message()))?;
    Ok(Bound {
        name,
        requests_per_unit: n,
        unit: code,
        window_secs: secs,
        limiter: Some(limiter),
        shadow,
        replaces,
    })
}
