//! `[store]`: where every limit of the file keeps its state.

use std::time::Duration;

use super::spec::Spanned;

use super::build::{duration, Problem};
#[cfg(feature = "redis")]
use super::build::{named_value, Named};
use super::spec::{HotKeysSpec, StoreSpec};

/// What `[store]` says, checked: a store to build.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum StorePlan {
    Memory {
        max_keys: Option<usize>,
        sweep_idle_every: Option<Duration>,
    },
    Redis(Box<RedisPlan>),
}

/// A Redis store's settings. The URL is read when the store is built,
/// from where the file says (never from the file itself when it holds a
/// password).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct RedisPlan {
    pub(super) url: UrlFrom,
    pub(super) prefix: Option<String>,
    pub(super) failure_policy: Option<(String, Option<u32>)>,
    pub(super) timeout: Option<Duration>,
    pub(super) connect_timeout: Option<Duration>,
    pub(super) key_secret_env: Option<String>,
    pub(super) key_secret_file: Option<String>,
    pub(super) hot_keys: Option<HotPlan>,
}

/// `[store.hot_keys]`, checked: what differs from `HotKeys::new()`.
#[derive(Debug, Clone, PartialEq, Default)]
pub(super) struct HotPlan {
    ttl: Option<Duration>,
    max_batch: Option<u32>,
    min_batch: Option<u32>,
    max_share: Option<f64>,
    max_denial: Option<Duration>,
    max_keys: Option<usize>,
    refill_ahead: Option<bool>,
    rules: Option<Vec<String>>,
}

/// Where a Redis URL comes from.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum UrlFrom {
    /// Written in the file (no password in it).
    File(String),
    /// An environment variable's value.
    Env(String),
    /// A file's contents (e.g. a mounted secret), trimmed.
    Path(String),
}

const MEMORY_ONLY: [&str; 2] = ["max_keys", "sweep_idle_every"];
const REDIS_ONLY: [&str; 10] = [
    "url",
    "url_env",
    "url_file",
    "prefix",
    "failure_policy",
    "timeout",
    "connect_timeout",
    "key_secret_env",
    "key_secret_file",
    "hot_keys",
];

fn at<T>(value: &Spanned<T>, field: &str, message: impl Into<String>) -> Problem {
    (Some(value.span()), format!("store.{field}"), message.into())
}

/// The store a file's `[store]` (or its absence: the memory store's
/// defaults) describes, checked.
pub(super) fn plan_of(spanned: Option<&Spanned<StoreSpec>>) -> Result<StorePlan, Problem> {
    match spanned {
        Some(st) => plan(st),
        None => Ok(StorePlan::Memory {
            max_keys: None,
            sweep_idle_every: None,
        }),
    }
}

/// Checks `[store]`: every field known for its kind, every value in
/// bounds. Nothing is connected to and no environment read.
pub(super) fn plan(spanned: &Spanned<StoreSpec>) -> Result<StorePlan, Problem> {
    let s = spanned.get_ref();
    let set = s.fields_set();
    let kind = s.kind.get_ref().as_str();
    let (foreign, other) = match kind {
        "memory" => (&REDIS_ONLY[..], "redis"),
        "redis" => (&MEMORY_ONLY[..], "memory"),
        _ => return Err(at(&s.kind, "kind", "must be \"memory\" or \"redis\"")),
    };
    if let Some(f) = set.iter().find(|f| foreign.contains(f)) {
        return Err((
            Some(spanned.span()),
            format!("store.{f}"),
            format!("is a setting of kind = \"{other}\", not of kind = \"{kind}\""),
        ));
    }
    let dur = |v: &Option<Spanned<String>>, f: &str| {
        v.as_ref()
            .map(|v| duration(v, format!("store.{f}")))
            .transpose()
    };
    if kind == "memory" {
        let max_keys = match &s.max_keys {
            Some(n) if *n.get_ref() < 1 => return Err(at(n, "max_keys", "must be at least 1")),
            Some(n) => Some(usize::try_from(*n.get_ref()).unwrap_or(usize::MAX)),
            None => None,
        };
        return Ok(StorePlan::Memory {
            max_keys,
            sweep_idle_every: dur(&s.sweep_idle_every, "sweep_idle_every")?,
        });
    }
    let url = match (&s.url, &s.url_env, &s.url_file) {
        (Some(u), None, None) => {
            if has_password(u.get_ref()) {
                return Err(at(
                    u,
                    "url",
                    "holds a password: name the variable that holds the URL (url_env) or a file (url_file) instead",
                ));
            }
            UrlFrom::File(u.get_ref().clone())
        }
        (None, Some(e), None) if !e.get_ref().is_empty() => UrlFrom::Env(e.get_ref().clone()),
        (None, None, Some(p)) if !p.get_ref().is_empty() => UrlFrom::Path(p.get_ref().clone()),
        (None, None, None) => {
            return Err((
                Some(spanned.span()),
                "store.url".to_owned(),
                "is missing: a Redis store needs one of url, url_env or url_file".to_owned(),
            ))
        }
        _ => {
            return Err((
                Some(spanned.span()),
                "store.url".to_owned(),
                "give one of url, url_env or url_file (not empty)".to_owned(),
            ))
        }
    };
    if let (Some(_), Some(file)) = (&s.key_secret_env, &s.key_secret_file) {
        return Err(at(
            file,
            "key_secret_file",
            "give one of key_secret_env or key_secret_file",
        ));
    }
    let failure_policy = match &s.failure_policy {
        None => None,
        Some(p) => Some(failure_policy(p)?),
    };
    let hot_keys = match &s.hot_keys {
        None => None,
        Some(h) => Some(hot_plan(h)?),
    };
    Ok(StorePlan::Redis(Box::new(RedisPlan {
        url,
        prefix: s.prefix.as_ref().map(|p| p.get_ref().clone()),
        failure_policy,
        timeout: dur(&s.timeout, "timeout")?,
        connect_timeout: dur(&s.connect_timeout, "connect_timeout")?,
        key_secret_env: s.key_secret_env.as_ref().map(|k| k.get_ref().clone()),
        key_secret_file: s.key_secret_file.as_ref().map(|k| k.get_ref().clone()),
        hot_keys,
    })))
}

/// Checks `[store.hot_keys]`: its shapes here, its bounds where
/// `HotKeys` checks them (one check, not two); an error names the field.
fn hot_plan(spanned: &Spanned<HotKeysSpec>) -> Result<HotPlan, Problem> {
    let h = spanned.get_ref();
    let field = |f: &str| format!("store.hot_keys.{f}");
    let dur = |v: &Option<Spanned<String>>, f: &str| {
        v.as_ref().map(|v| duration(v, field(f))).transpose()
    };
    let count = |v: &Option<Spanned<i64>>, f: &str| -> Result<Option<u64>, Problem> {
        v.as_ref()
            .map(|n| {
                u64::try_from(*n.get_ref())
                    .map_err(|_| (Some(n.span()), field(f), "must not be negative".to_owned()))
            })
            .transpose()
    };
    let units = |v: &Option<Spanned<i64>>, f: &str| -> Result<Option<u32>, Problem> {
        match (count(v, f)?, v) {
            (Some(n), Some(at)) => u32::try_from(n).map(Some).map_err(|_| {
                (
                    Some(at.span()),
                    field(f),
                    "must be at most 4294967295".to_owned(),
                )
            }),
            _ => Ok(None),
        }
    };
    let plan = HotPlan {
        ttl: dur(&h.ttl, "ttl")?,
        max_batch: units(&h.max_batch, "max_batch")?,
        min_batch: units(&h.min_batch, "min_batch")?,
        max_share: h.max_share.as_ref().map(|v| *v.get_ref()),
        max_denial: dur(&h.max_denial, "max_denial")?,
        max_keys: count(&h.max_keys, "max_keys")?.map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
        refill_ahead: h.refill_ahead.as_ref().map(|v| *v.get_ref()),
        rules: h.rules.as_ref().map(|v| v.get_ref().clone()),
    };
    #[cfg(feature = "redis")]
    if let Err(e) = hot_keys(&plan).check() {
        // `HotKeys`'s message starts with the setting it is about.
        let (name, span) = [
            ("ttl", h.ttl.as_ref().map(Spanned::span)),
            ("max_batch", h.max_batch.as_ref().map(Spanned::span)),
            ("min_batch", h.min_batch.as_ref().map(Spanned::span)),
            ("max_share", h.max_share.as_ref().map(Spanned::span)),
            ("max_keys", h.max_keys.as_ref().map(Spanned::span)),
        ]
        .into_iter()
        .find(|(name, _)| e.message().starts_with(name))
        .map_or(("", None), |(name, span)| (name, span));
        let path = if name.is_empty() {
            "store.hot_keys".to_owned()
        } else {
            field(name)
        };
        return Err((
            Some(span.unwrap_or_else(|| spanned.span())),
            path,
            e.message().to_owned(),
        ));
    }
    Ok(plan)
}

/// The `HotKeys` a checked `[store.hot_keys]` describes.
#[cfg(feature = "redis")]
fn hot_keys(plan: &HotPlan) -> tollgate_redis::HotKeys {
    let mut h = tollgate_redis::HotKeys::new();
    if let Some(t) = plan.ttl {
        h = h.ttl(t);
    }
    if let Some(n) = plan.max_batch {
        h = h.max_batch(n);
    }
    if let Some(n) = plan.min_batch {
        h = h.min_batch(n);
    }
    if let Some(share) = plan.max_share {
        h = h.max_share(share);
    }
    if let Some(t) = plan.max_denial {
        h = h.max_denial(t);
    }
    if let Some(n) = plan.max_keys {
        h = h.max_keys(n);
    }
    if let Some(on) = plan.refill_ahead {
        h = h.refill_ahead(on);
    }
    if let Some(rules) = &plan.rules {
        h = h.rules(rules);
    }
    h
}

/// `open`, `closed`, `fallback`, or `fallback/N` (the limit shared by N
/// instances while Redis is away).
fn failure_policy(p: &Spanned<String>) -> Result<(String, Option<u32>), Problem> {
    let text = p.get_ref().trim();
    let shape = "must be \"open\", \"closed\", \"fallback\" or \"fallback/N\" (N instances share each limit while Redis is away)";
    match text.split_once('/') {
        None if ["open", "closed", "fallback"].contains(&text) => Ok((text.to_owned(), None)),
        Some(("fallback", n)) => match n.trim().parse::<u32>() {
            Ok(n) if n >= 1 => Ok(("fallback".to_owned(), Some(n))),
            _ => Err(at(p, "failure_policy", shape)),
        },
        _ => Err(at(p, "failure_policy", shape)),
    }
}

/// Whether a Redis URL (or a comma-separated list of them) carries a
/// password: `redis://user:secret@host`, `redis://:secret@host`, a
/// Sentinel list's `redis+sentinel://:p,w@h1,h2/svc` (its password may
/// hold a comma), or a query's `pass=` (`redis+unix:///r.sock?pass=...`,
/// its key percent-encoded or not).
fn has_password(url: &str) -> bool {
    let in_authority = |one: &str| {
        let rest = one.split_once("://").map_or(one, |(_, r)| r);
        let authority = rest.split(['/', '?', '#']).next().unwrap_or(rest);
        authority
            .rsplit_once('@')
            .and_then(|(creds, _)| creds.split_once(':'))
            .is_some_and(|(_, password)| !password.is_empty())
    };
    let in_query = |one: &str| {
        one.split_once('?').is_some_and(|(_, query)| {
            query.split('&').any(|pair| {
                let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
                // `p%61ss` is `pass` (as redis-rs decodes the query).
                let key = crate::key::request::decode_unreserved(key.as_bytes());
                matches!(key.as_slice(), b"pass" | b"password") && !value.is_empty()
            })
        })
    };
    in_authority(url) || url.split(',').any(|one| in_authority(one) || in_query(one))
}

/// The store `plan` describes: a memory store at once; a Redis store with
/// its URL read from where the file says (its connection task starts on
/// the current Tokio runtime). Errors name the field, never a secret.
pub(super) fn build(plan: &StorePlan) -> Result<crate::AnyStore, (String, String)> {
    let named = |field: &str, e: tollgate_core::ConfigError| {
        (format!("store.{field}"), e.message().to_owned())
    };
    match plan {
        StorePlan::Memory {
            max_keys,
            sweep_idle_every,
        } => {
            let mut b = crate::MemoryStore::builder();
            if let Some(n) = max_keys {
                b = b.max_keys(*n);
            }
            if let Some(every) = sweep_idle_every {
                b = b.sweep_idle_every(*every);
            }
            let store = b.build().map_err(|e| {
                let field = e.field();
                named(field, e)
            })?;
            Ok(store.into())
        }
        #[cfg(feature = "redis")]
        StorePlan::Redis(r) => {
            let store = redis(r)?;
            match &r.hot_keys {
                None => Ok(store.into()),
                Some(plan) => hot_keys(plan)
                    .over(store)
                    .map(Into::into)
                    .map_err(|e| ("store.hot_keys".to_owned(), e.message().to_owned())),
            }
        }
        #[cfg(not(feature = "redis"))]
        StorePlan::Redis(_) => Err((
            "store.kind".to_owned(),
            "is \"redis\", and this build has no Redis store (the crate's `redis` feature)"
                .to_owned(),
        )),
    }
}

#[cfg(feature = "redis")]
fn redis(r: &RedisPlan) -> Result<crate::RedisStore, (String, String)> {
    let named =
        |n: Named<'_>, field: &str| named_value(n).map_err(|m| (format!("store.{field}"), m));
    let url = match &r.url {
        UrlFrom::File(u) => u.clone(),
        UrlFrom::Env(var) => named(Named::Env(var), "url_env")?,
        UrlFrom::Path(path) => named(Named::File(path), "url_file")?,
    };
    let mut b = crate::RedisStore::builder(&url);
    if let Some(p) = &r.prefix {
        b = b.prefix(p);
    }
    if let Some((policy, n)) = &r.failure_policy {
        use crate::FailurePolicy;
        b = b.failure_policy(match (policy.as_str(), n) {
            ("open", _) => FailurePolicy::Open,
            ("closed", _) => FailurePolicy::Closed,
            (_, Some(n)) => FailurePolicy::fallback_share(*n),
            _ => FailurePolicy::fallback(),
        });
    }
    if let Some(t) = r.timeout {
        b = b.timeout(t);
    }
    if let Some(t) = r.connect_timeout {
        b = b.connect_timeout(t);
    }
    if let Some(var) = &r.key_secret_env {
        b = b.key_secret(named(Named::Env(var), "key_secret_env")?);
    }
    if let Some(path) = &r.key_secret_file {
        b = b.key_secret(named(Named::File(path), "key_secret_file")?);
    }
    // A builder's error names its own field (`url`, `timeout`); the URL
    // itself is never part of the message.
    b.build().map_err(|e| {
        if e.field() == "prefix" && r.prefix.is_none() {
            return (
                "store.prefix".to_owned(),
                "is missing: name your service (prefix = \"my-service\") so that its keys, and budgets, are not shared with other services on this Redis".to_owned(),
            );
        }
        let field = match e.field() {
            "url" => match &r.url {
                UrlFrom::File(_) => "url",
                UrlFrom::Env(_) => "url_env",
                UrlFrom::Path(_) => "url_file",
            },
            "key_secret" if r.key_secret_file.is_some() => "key_secret_file",
            "key_secret" => "key_secret_env",
            f => f,
        };
        (format!("store.{field}"), e.message().to_owned())
    })
}

#[cfg(test)]
mod tests {
    use super::has_password;

    #[test]
    fn passwords_in_urls_are_seen() {
        for (url, secret) in [
            ("redis://127.0.0.1:6379", false),
            ("redis://:s3cret@h:6379/0", true),
            ("rediss://app:s3cret@h", true),
            ("redis://app@h", false),
            ("redis://app:@h", false),
            ("redis+sentinel://h1,h2/mymaster", false),
            ("redis://h/0?x=a@b", false),
            ("redis://h1:7000,redis://:pw@h2:7001", true),
            ("redis+unix:///run/redis.sock?db=1&pass=s3cret", true),
            ("redis+unix:///run/redis.sock?db=1", false),
            ("redis+unix:///run/redis.sock?p%61ss=s3cret", true),
            ("redis+sentinel://:p,w@h1,h2/svc", true),
            ("redis+sentinel://h1,h2/svc", false),
        ] {
            assert_eq!(has_password(url), secret, "{url}");
        }
    }
}
