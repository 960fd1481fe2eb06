//! From the file's shape to a policy builder, with every problem placed
//! at its span and named by its field path.

use std::ops::Range;
use std::time::Duration;

use super::spec::Spanned;

use super::parts::{FileCost, FileKey};
use super::spec::{
    self, BandwidthSpec, ConcurrencySpec, CostSpec, FileSpec, LimitSpec, QuotaSpec, RuleSpec,
};
use crate::cost::{BodyLength, ByMethod, ByRoute, Fixed, HeaderCost, QueryCost};
use crate::key::{ClientIp, ForwardedHeader, DEFAULT_IPV6_PREFIX};
use crate::observe::DecisionLog;
use crate::policy::{AccessList, PolicyLayerBuilder, RateRule};
use crate::rate_limit::MissingKey;
use crate::MemoryStore;
use tollgate_core::calendar::{Offset, Period, Zone};
use tollgate_core::{Algorithm, ConfigError, Limit, Rate};

/// A problem: where (if known), the field path, what.
pub(super) type Problem = (Option<Range<usize>>, String, String);

fn at<T>(value: &Spanned<T>, field: String, message: impl Into<String>) -> Problem {
    (Some(value.span()), field, message.into())
}

/// Places serde's error: its span, and the field path found from it.
pub(super) fn serde_error(
    text: &str,
    origin: Option<&str>,
    e: &toml::de::Error,
) -> super::FileError {
    let span = e.span();
    let field = span
        .as_ref()
        .map(|s| field_at(text, s.start))
        .unwrap_or_default();
    let message = e.message().trim().to_owned();
    super::FileError::at(text, origin, span, field, message)
}

/// The field path of the value or key at byte `offset`: the innermost
/// `[[rules]]` entry (counted) or table header above it, and the key on
/// its line.
fn field_at(text: &str, offset: usize) -> String {
    // Through the end of the offset's line: a missing field's span is its
    // table's header, which counts.
    let line_end = text
        .get(offset..)
        .and_then(|t| t.find('\n'))
        .map_or(text.len(), |i| offset.saturating_add(i));
    let before = text.get(..line_end).unwrap_or(text);
    let mut table = String::new();
    // Entries of each `[[list]]` so far.
    let mut entries: std::collections::BTreeMap<String, usize> = Default::default();
    for line in before.lines() {
        let line = line.trim();
        if let Some(list) = line.strip_prefix("[[").and_then(|l| l.split("]]").next()) {
            let list = list.trim();
            let n = entries.entry(list.to_owned()).or_insert(0);
            table = format!("{list}[{n}]");
            *n = n.saturating_add(1);
        } else if let Some(name) = line.strip_prefix('[').and_then(|l| l.split(']').next()) {
            let name = name.trim();
            // A sub-table of the latest entry of a `[[list]]` (e.g.
            // `[concurrency.queue]`) is that entry's.
            table = match name.split_once('.') {
                Some((list, rest)) => match entries.get(list) {
                    Some(n) => format!("{list}[{}].{rest}", n.saturating_sub(1)),
                    None => name.to_owned(),
                },
                None => name.to_owned(),
            };
        }
    }
    // The key on the offending line: before its `=`, or the word at the
    // offset (an unknown key's span is the key itself).
    let line_start = before.rfind('\n').map_or(0, |i| i.saturating_add(1));
    let line = text
        .get(line_start..)
        .and_then(|l| l.lines().next())
        .unwrap_or("");
    let column = offset.saturating_sub(line_start);
    if line.trim_start().starts_with('[') {
        return table;
    }
    let key = match line.find('=') {
        Some(eq) if eq < column => line.get(..eq).unwrap_or("").trim(),
        _ => line
            .get(column..)
            .unwrap_or("")
            .split(|c: char| c == '=' || c.is_whitespace())
            .next()
            .unwrap_or(""),
    };
    let key = key.trim_matches(|c| c == '[' || c == ']' || c == '"');
    match (table.is_empty(), key.is_empty() || key.starts_with('[')) {
        (true, _) => key.to_owned(),
        (false, true) => table,
        (false, false) => format!("{table}.{key}"),
    }
}

fn whole(n: i64, value: &Spanned<i64>, field: String, least: u32) -> Result<u32, Problem> {
    plain_whole(n, &value.span(), field, least)
}

/// `n` as a cost (a `u64`) of at least 1; a problem at `span` otherwise.
fn plain_cost(n: i64, span: &Range<usize>, field: String) -> Result<u64, Problem> {
    match u64::try_from(n) {
        Ok(v) if v >= 1 => Ok(v),
        _ => Err((Some(span.clone()), field, "must be at least 1".to_owned())),
    }
}

/// `n` as a `u32` of at least `least`; a problem at `span` otherwise.
fn plain_whole(n: i64, span: &Range<usize>, field: String, least: u32) -> Result<u32, Problem> {
    let message = match u32::try_from(n) {
        Ok(v) if v >= least => return Ok(v),
        _ if n < i64::from(least) => format!("must be at least {least}"),
        _ => format!("must be at most {}", u32::MAX),
    };
    Err((Some(span.clone()), field, message))
}

pub(super) fn duration(value: &Spanned<String>, field: String) -> Result<Duration, Problem> {
    spec::duration(value.get_ref()).map_err(|m| at(value, field, m))
}

/// A field only some algorithms take: the value where `needed`; a
/// problem where it is missing (at the entry, `missing` says what is
/// needed) or given where it is not used (at the value, `unused`).
fn only_for<'v, T>(
    value: Option<&'v Spanned<T>>,
    needed: bool,
    (field, entry): (String, &Range<usize>),
    missing: String,
    unused: String,
) -> Result<Option<&'v Spanned<T>>, Problem> {
    match (value, needed) {
        (Some(v), true) => Ok(Some(v)),
        (None, true) => Err((Some(entry.clone()), field, format!("is missing: {missing}"))),
        (Some(v), false) => Err(at(v, field, unused)),
        (None, false) => Ok(None),
    }
}

/// The limit of `algorithm` from a rule's (or plan's) numbers, checked.
fn limit(
    algorithm: &str,
    rate: Option<&Spanned<String>>,
    burst: Option<&Spanned<i64>>,
    max_delay: Option<&Spanned<String>>,
    buckets: Option<&Spanned<i64>>,
    path: &str,
    whole_span: &Range<usize>,
) -> Result<Limit, Problem> {
    let field = |f: &str| format!("{path}.{f}");
    let Some(rate_text) = rate else {
        return Err((
            Some(whole_span.clone()),
            field("rate"),
            "is missing (e.g. rate = \"10/s\")".to_owned(),
        ));
    };
    let (amount, period) =
        spec::rate(rate_text.get_ref()).map_err(|m| at(rate_text, field("rate"), m))?;
    if amount == 0 {
        return Err(at(
            rate_text,
            field("rate"),
            "the amount must be at least 1",
        ));
    }
    let burst_at = burst;
    let buckets_at = buckets;
    let burst = only_for(
        burst,
        matches!(algorithm, "gcra" | "token_bucket"),
        (field("burst"), whole_span),
        format!("{algorithm} needs burst = N (at least 1)"),
        format!("is not used by {algorithm}: its limit is the rate's amount"),
    )?
    .map(|b| whole(*b.get_ref(), b, field("burst"), 1))
    .transpose()?
    .unwrap_or(0);
    let delay = only_for(
        max_delay,
        algorithm == "leaky_bucket",
        (field("max_delay"), whole_span),
        "leaky_bucket needs max_delay (e.g. \"500ms\")".to_owned(),
        format!("is only for leaky_bucket, not {algorithm}"),
    )?
    .map(|d| duration(d, field("max_delay")))
    .transpose()?
    .unwrap_or(Duration::ZERO);
    let buckets = only_for(
        buckets,
        algorithm == "sliding_buckets",
        (field("buckets"), whole_span),
        "sliding_buckets needs buckets = N (1 to 100)".to_owned(),
        format!("is only for sliding_buckets, not {algorithm}"),
    )?
    .map(|b| whole(*b.get_ref(), b, field("buckets"), 1))
    .transpose()?
    .unwrap_or(0);
    let rate = Rate::new(amount, period);
    let limit = match algorithm {
        "gcra" => Limit::gcra(rate, burst),
        "token_bucket" => Limit::token_bucket(burst, amount, period),
        "fixed_window" => Limit::fixed_window(amount, period),
        "sliding_window" => Limit::sliding_window_counter(amount, period),
        "sliding_log" => Limit::sliding_window_log(amount, period),
        "sliding_buckets" => Limit::sliding_window_buckets(amount, period, buckets),
        "leaky_bucket" => Limit::leaky_bucket(rate, delay),
        other => {
            return Err((
                Some(whole_span.clone()),
                field("algorithm"),
                format!("{other:?} is not an algorithm"),
            ))
        }
    };
    // Validate here, so the error lands on this rule's numbers.
    Algorithm::new(limit).map_err(|e| match (e.field(), burst_at) {
        ("burst" | "capacity", Some(b)) => at(b, field("burst"), e.message().to_owned()),
        ("buckets", _) => match buckets_at {
            Some(b) => at(b, field("buckets"), e.message().to_owned()),
            None => at(rate_text, field("rate"), e.message().to_owned()),
        },
        ("max_delay", Some(_)) | ("max_delay", None) => match max_delay {
            Some(d) => at(d, field("max_delay"), e.message().to_owned()),
            None => at(rate_text, field("rate"), e.message().to_owned()),
        },
        _ => at(rate_text, field("rate"), e.message().to_owned()),
    })?;
    Ok(limit)
}

const ALGORITHMS: [&str; 7] = [
    "gcra",
    "token_bucket",
    "fixed_window",
    "sliding_window",
    "sliding_log",
    "sliding_buckets",
    "leaky_bucket",
];

fn cost(spec: &CostSpec, span: &Range<usize>, field: &str) -> Result<FileCost, Problem> {
    let problem = |m: String| (Some(span.clone()), field.to_owned(), m);
    // No cost is free: a cost of 0 would let a route, a method, or every
    // request no table names through uncounted.
    let num = |n: i64, f: &str| plain_cost(n, span, format!("{field}.{f}"));
    let default = num(spec.default.unwrap_or(1), "default")?;
    let max = spec.max.map(|m| num(m, "max")).transpose()?;
    let kinds = [
        spec.header.is_some(),
        spec.query.is_some(),
        spec.bytes_per_unit.is_some(),
        !spec.methods.is_empty(),
        !spec.routes.is_empty(),
    ];
    if kinds.iter().filter(|k| **k).count() > 1 {
        return Err(problem(
            "one of header, query, bytes_per_unit, methods and routes".to_owned(),
        ));
    }
    // The cost functions' own field names, as the file spells them.
    let config = |e: ConfigError| {
        let f = match e.field() {
            "cap" => "max",
            "min" => "default",
            other => other,
        };
        problem(format!("{f}: {}", e.message()))
    };
    let reads_request =
        spec.header.is_some() || spec.query.is_some() || spec.bytes_per_unit.is_some();
    if reads_request && max.is_none() {
        // A missing or unreadable value costs `max`: it must be chosen.
        return Err(problem(
            "max is missing: a cost read from the request needs max = N (the most one request is charged)".to_owned(),
        ));
    }
    if let Some(h) = &spec.header {
        return HeaderCost::named(h, default, max.unwrap_or(u64::MAX))
            .map(FileCost::Header)
            .map_err(config);
    }
    if let Some(q) = &spec.query {
        return QueryCost::named(q, default, max.unwrap_or(u64::MAX))
            .map(FileCost::Query)
            .map_err(config);
    }
    if let Some(b) = spec.bytes_per_unit {
        let per = u64::try_from(b)
            .map_err(|_| problem("bytes_per_unit: must be at least 1".to_owned()))?;
        return BodyLength::new(per, default, max.unwrap_or(u64::MAX))
            .map(FileCost::Body)
            .map_err(config);
    }
    if max.is_some() {
        return Err(problem(
            "max caps header, query and bytes_per_unit costs only".to_owned(),
        ));
    }
    if !spec.methods.is_empty() {
        let mut by = ByMethod::new(default);
        for (m, c) in &spec.methods {
            let method = method_named(m).ok_or_else(|| {
                problem(format!(
                    "methods: {m:?} is not an HTTP method (upper case, e.g. \"POST\")"
                ))
            })?;
            by = by.method(method, num(*c, &format!("methods.{m}"))?);
        }
        return Ok(FileCost::Methods(by));
    }
    if !spec.routes.is_empty() {
        let mut by = ByRoute::new(default);
        for (i, r) in spec.routes.iter().enumerate() {
            let method = match &r.method {
                None => None,
                Some(m) => Some(method_named(m).ok_or_else(|| {
                    problem(format!(
                        "routes[{i}].method: {m:?} is not an HTTP method (upper case, e.g. \"POST\")"
                    ))
                })?),
            };
            if !r.path.starts_with('/') {
                return Err(problem(format!("routes[{i}].path: must start with '/'")));
            }
            by = by.route(method, &r.path, num(r.cost, &format!("routes[{i}].cost"))?);
        }
        return Ok(FileCost::Routes(by));
    }
    Ok(FileCost::Fixed(Fixed(default)))
}

const COST_SHAPE: &str = "a cost is a whole number, the name of a [costs] entry, or a table of default, max, and one of header, query, bytes_per_unit, methods, routes";

/// A cost table's value, read as a [`CostSpec`].
fn cost_table(value: &Spanned<toml::Value>, field: &str) -> Result<CostSpec, Problem> {
    match value.get_ref() {
        toml::Value::Table(t) => t
            .clone()
            .try_into::<CostSpec>()
            .map_err(|e| at(value, field.to_owned(), e.message().trim().to_owned())),
        _ => Err(at(value, field.to_owned(), COST_SHAPE)),
    }
}

/// A `routes` list: each entry a path pattern, after a method if any
/// (`"GET /api/download"`, `"/files/{*path}"`).
pub(super) fn routes(
    list: &Spanned<Vec<Spanned<String>>>,
    field: String,
) -> Result<crate::Routes, Problem> {
    if list.get_ref().is_empty() {
        return Err(at(
            list,
            field,
            "is empty: the limit would apply to no request (leave it out for every route)",
        ));
    }
    let mut out = crate::Routes::new();
    for (i, entry) in list.get_ref().iter().enumerate() {
        let text = entry.get_ref().trim();
        let (method, pattern) = match text.split_once(char::is_whitespace) {
            Some((m, p)) => {
                let method = method_named(m).ok_or_else(|| {
                    at(
                        entry,
                        format!("{field}[{i}]"),
                        format!("{m:?} is not an HTTP method in upper case, like \"GET\""),
                    )
                })?;
                (Some(method), p.trim())
            }
            None => (None, text),
        };
        out = out
            .route(method, pattern)
            .map_err(|e| at(entry, format!("{field}[{i}]"), e.message().to_owned()))?;
    }
    Ok(out)
}

/// An HTTP method as requests carry it: upper case (a lower-case name
/// would be an extension method no request sends, silently never matched).
fn method_named(name: &str) -> Option<http::Method> {
    if name.is_empty() || name.bytes().any(|b| b.is_ascii_lowercase()) {
        return None;
    }
    http::Method::from_bytes(name.as_bytes()).ok()
}

fn rule_cost(file: &FileSpec, r: &RuleSpec, path: &str) -> Result<FileCost, Problem> {
    cost_of(file, r.cost.as_ref(), path)
}

/// The cost `c` of the entry at `path` names: a whole number, or a
/// `[costs.<name>]` table; 1 when there is none.
fn cost_of(
    file: &FileSpec,
    c: Option<&Spanned<toml::Value>>,
    path: &str,
) -> Result<FileCost, Problem> {
    let field = format!("{path}.cost");
    let Some(c) = c else {
        return Ok(FileCost::Fixed(Fixed(1)));
    };
    match c.get_ref() {
        toml::Value::Integer(n) => Ok(FileCost::Fixed(Fixed(plain_cost(*n, &c.span(), field)?))),
        toml::Value::String(name) => match file.costs.get(name) {
            Some(spec) => {
                let field = format!("costs.{name}");
                cost(&cost_table(spec, &field)?, &spec.span(), &field)
            }
            None => Err(at(c, field, format!("no [costs.{name}] is declared"))),
        },
        toml::Value::Table(_) => cost(&cost_table(c, &field)?, &c.span(), &field),
        _ => Err(at(c, field, COST_SHAPE)),
    }
}

fn share(value: &Spanned<f64>, field: String, above_zero: bool) -> Result<f64, Problem> {
    let v = *value.get_ref();
    let ok = if above_zero {
        v > 0.0 && v <= 1.0
    } else {
        (0.0..=1.0).contains(&v)
    };
    if ok {
        Ok(v)
    } else if above_zero {
        Err(at(value, field, "must be above 0 and at most 1"))
    } else {
        Err(at(value, field, "must be from 0.0 to 1.0"))
    }
}

/// The client address `client-ip` keys read, as the file says (trusted
/// proxies, their header, the IPv6 prefix), and that prefix.
fn client_ip(file: &FileSpec) -> Result<(ClientIp, u8), Problem> {
    let v6_prefix = match &file.ipv6_prefix {
        None => DEFAULT_IPV6_PREFIX,
        Some(p) if (32..=128).contains(p.get_ref()) => *p.get_ref(),
        Some(p) => {
            return Err(at(
                p,
                "ipv6_prefix".to_owned(),
                "must be from 32 to 128 (64 keys each subscriber's /64; below 32 whole networks share one budget)",
            ))
        }
    };
    let trusted: &[String] = file.trusted_proxies.as_ref().map_or(&[], |t| t.get_ref());
    let mut client = ClientIp::trusting(trusted).map_err(|e| {
        let span = file.trusted_proxies.as_ref().map(Spanned::span);
        (span, "trusted_proxies".to_owned(), e.message().to_owned())
    })?;
    if let Some(h) = &file.forwarded_header {
        client = client.header(match h.get_ref().to_ascii_lowercase().as_str() {
            "x-forwarded-for" => ForwardedHeader::XForwardedFor,
            "forwarded" => ForwardedHeader::Forwarded,
            _ => {
                return Err(at(
                    h,
                    "forwarded_header".to_owned(),
                    "must be \"x-forwarded-for\" or \"forwarded\"",
                ))
            }
        });
    }
    Ok((client.ipv6_prefix(v6_prefix), v6_prefix))
}

/// What `missing_key` says at `field`.
fn missing_key(m: &Spanned<String>, field: String) -> Result<MissingKey, Problem> {
    Ok(match m.get_ref().as_str() {
        "reject" => MissingKey::Reject,
        "skip" => MissingKey::Skip,
        other => match other.strip_prefix("fallback:") {
            Some(k) if !k.is_empty() => {
                MissingKey::Fallback(bytes::Bytes::copy_from_slice(k.as_bytes()))
            }
            _ => {
                return Err(at(
                    m,
                    field,
                    "must be \"reject\", \"skip\" or \"fallback:<shared key>\"",
                ))
            }
        },
    })
}

/// `[audit]`'s Redis stream, if it names one: its name, `maxlen`
/// (default 100,000; 1 to 10,000,000) and `queue` (default 10,000; 1 to
/// 2^20).
pub(super) fn audit_stream(
    a: &super::spec::AuditSpec,
) -> Result<Option<(&str, usize, usize)>, Problem> {
    let bounded = |v: Option<&Spanned<i64>>, field: &str, default: usize, max: usize| {
        let Some(v) = v else { return Ok(default) };
        usize::try_from(*v.get_ref())
            .ok()
            .filter(|n| (1..=max).contains(n))
            .ok_or_else(|| {
                at(
                    v,
                    format!("audit.{field}"),
                    format!("must be from 1 to {max}"),
                )
            })
    };
    let maxlen = bounded(a.maxlen.as_ref(), "maxlen", 100_000, 10_000_000)?;
    let queue = bounded(a.queue.as_ref(), "queue", 10_000, 1 << 20)?;
    let Some(stream) = &a.stream else {
        for (v, field) in [(&a.maxlen, "maxlen"), (&a.queue, "queue")] {
            if let Some(v) = v {
                return Err(at(
                    v,
                    format!("audit.{field}"),
                    "is a stream's: set stream too",
                ));
            }
        }
        return Ok(None);
    };
    let name = stream.get_ref();
    if name.is_empty()
        || name.len() > 128
        || name.chars().any(|c| c.is_control() || c.is_whitespace())
    {
        return Err(at(
            stream,
            "audit.stream".to_owned(),
            "must be 1 to 128 characters, no spaces or control characters",
        ));
    }
    Ok(Some((name.as_str(), maxlen, queue)))
}

/// `on_store_error` at `field` (an entry's, else the file's); `None`
/// where neither says.
fn on_store_error(
    own: Option<&Spanned<String>>,
    file: &FileSpec,
    field: String,
) -> Result<Option<crate::OnStoreError>, Problem> {
    let (v, field) = match (own, &file.on_store_error) {
        (Some(v), _) => (v, field),
        (None, Some(v)) => (v, "on_store_error".to_owned()),
        (None, None) => return Ok(None),
    };
    match v.get_ref().as_str() {
        "admit" => Ok(Some(crate::OnStoreError::Admit)),
        "refuse" => Ok(Some(crate::OnStoreError::Refuse)),
        _ => Err(at(v, field, "must be \"admit\" or \"refuse\"")),
    }
}

/// `$b` with its plan source from `plan_from` (`$p`): `"extension"` or
/// `"header:<name>"`. (A macro: the builders of the policy, quota and
/// concurrency layers each have these methods, and no trait in common.)
macro_rules! plan_source {
    ($b:expr, $p:expr) => {{
        let p: &Spanned<String> = $p;
        match p.get_ref().as_str() {
            "extension" => $b.plan_from_extension(),
            other => match other.strip_prefix("header:") {
                Some(h) => $b
                    .plan_from_header(h.trim())
                    .map_err(|e| at(p, "plan_from".to_owned(), e.message().to_owned()))?,
                None => {
                    return Err(at(
                        p,
                        "plan_from".to_owned(),
                        "must be \"extension\" or \"header:<name>\"",
                    ))
                }
            },
        }
    }};
}

/// The file's `plan_from`, for the entry `spanned` (at `field`) that
/// names plans: a file that names plans must say where they come from.
fn plan_from<'a, T>(
    file: &'a FileSpec,
    spanned: &Spanned<T>,
    field: String,
) -> Result<&'a Spanned<String>, Problem> {
    file.plan_from.as_ref().ok_or_else(|| {
        at(
            spanned,
            field,
            "plans are named, but the file sets no plan_from",
        )
    })
}

/// A builder holding everything `file` declares.
/// Where the challenge secret comes from when a builder is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Secrets {
    /// Read from where `[challenge]` says (building for real).
    Read,
    /// A stand-in: checking a file's shape, on a machine that may not
    /// hold the secret.
    Placeholder,
}

/// The challenge secret `[challenge]` names.
fn challenge_secret(file: &FileSpec, secrets: Secrets) -> Result<Option<Vec<u8>>, Problem> {
    let Some(c) = &file.challenge else {
        return Ok(None);
    };
    let spec = c.get_ref();
    read_secret(
        (c, "challenge"),
        (spec.secret_env.as_ref(), spec.secret_file.as_ref()),
        secrets,
        true,
    )
}

/// Where a value the file does not hold (a secret, a URL with a
/// password) is: an environment variable, or a file.
#[derive(Debug, Clone, Copy)]
pub(super) enum Named<'a> {
    Env(&'a str),
    File(&'a str),
}

/// The value `named` holds: the variable's value, or the file's contents
/// trimmed. The error says which could not be read, never a value.
pub(super) fn named_value(named: Named<'_>) -> Result<String, String> {
    match named {
        Named::Env(var) => std::env::var(var)
            .map_err(|_| format!("the environment variable {var} is not set (or not UTF-8)")),
        Named::File(path) => std::fs::read_to_string(path)
            .map(|t| t.trim().to_owned())
            .map_err(|e| format!("cannot read {path}: {e}")),
    }
}

/// A secret of `section` (16 to 64 bytes) from the variable or the file
/// it names (one of them; `required`: one must be named): read when
/// building for real, a stand-in when checking. Errors name the field,
/// never the secret.
fn read_secret<T>(
    (whole, section): (&Spanned<T>, &str),
    (env, file): (Option<&Spanned<String>>, Option<&Spanned<String>>),
    secrets: Secrets,
    required: bool,
) -> Result<Option<Vec<u8>>, Problem> {
    let secret = match (env, file) {
        (Some(_), Some(f)) => {
            return Err(at(f, format!("{section}.secret_file"), "give one of secret_env or secret_file"))
        }
        (None, None) if required => {
            return Err(at(whole, format!("{section}.secret_env"), "is missing: name the variable (secret_env) or the file (secret_file) that holds the secret"))
        }
        (None, None) => return Ok(None),
        _ if secrets == Secrets::Placeholder => return Ok(Some(vec![0x5a; 32])),
        (Some(var), None) => named_value(Named::Env(var.get_ref()))
            .map_err(|m| at(var, format!("{section}.secret_env"), m))?,
        (None, Some(path)) => named_value(Named::File(path.get_ref()))
            .map_err(|m| at(path, format!("{section}.secret_file"), m))?,
    };
    if !(16..=64).contains(&secret.len()) {
        let (span, field) = match (env, file) {
            (Some(v), _) => (v.span(), "secret_env"),
            (_, Some(f)) => (f.span(), "secret_file"),
            _ => (whole.span(), ""),
        };
        return Err((
            Some(span),
            format!("{section}.{field}"),
            "the secret must be 16 to 64 bytes".to_owned(),
        ));
    }
    Ok(Some(secret.into_bytes()))
}

pub(super) fn builder<B>(
    file: &FileSpec,
    secrets: Secrets,
) -> Result<PolicyLayerBuilder<B, MemoryStore>, Problem> {
    let secret = challenge_secret(file, secrets)?;
    let (client, v6_prefix) = client_ip(file)?;
    let mut b = crate::policy::PolicyLayer::builder()
        .headers(file.headers.unwrap_or(true))
        .legacy_headers(file.legacy_headers.unwrap_or(false));
    if let Some(on) = &file.route_label {
        #[cfg(feature = "axum")]
        {
            b = b.route_label(*on.get_ref());
        }
        #[cfg(not(feature = "axum"))]
        if *on.get_ref() {
            return Err(at(
                on,
                "route_label".to_owned(),
                "needs tollgate's axum feature (routes are axum's matched paths)",
            ));
        }
    }
    if let Some(p) = &file.plan_from {
        b = plan_source!(b, p);
    }
    if let Some(on) = on_store_error(None, file, String::new())? {
        b = b.on_store_error(on);
    }
    if file.rules.is_empty() {
        let others = !file.quotas.is_empty()
            || !file.concurrency.is_empty()
            || !file.bandwidth.is_empty()
            || !file.retry_budgets.is_empty();
        if !others {
            return Err((
                None,
                "rules".to_owned(),
                "declare a limit: [[rules]] (1 to 8), [[quotas]], [[concurrency]], [[bandwidth]] or [[retry_budgets]]".to_owned(),
            ));
        }
        // The rules' layer passes every request (its access lists, if
        // any, still apply): the limits are in the other sections.
        b = b.allow_no_rules();
    }
    for (i, r) in file.rules.iter().enumerate() {
        b = b.rule(rule(file, r, i, &client, v6_prefix, secret.as_deref())?);
    }
    if let Some(requester) = file
        .challenge
        .as_ref()
        .and_then(|c| c.get_ref().requester.as_ref())
    {
        let key = FileKey::parse(requester.get_ref(), &client, v6_prefix, file)
            .map_err(|m| at(requester, "challenge.requester".to_owned(), m))?;
        b = b.challenge_requester(key);
    }
    if let Some(a) = &file.access {
        b = b.access(access(a, &client)?);
    }
    // A database named but not read is an error where it is named, used
    // by a rule or not.
    if let Some(g) = &file.geoip {
        let g = g.get_ref();
        for ((named, field), loaded) in [(&g.asn, "geoip.asn"), (&g.country, "geoip.country")]
            .into_iter()
            .zip(&g.loaded)
        {
            if let (Some(named), Some(Err(e))) = (named, loaded) {
                return Err(at(named, field.to_owned(), e.clone()));
            }
        }
    }
    if let Some(idem) = &file.idempotency {
        let s = idem.get_ref();
        let key = FileKey::parse(s.key.get_ref(), &client, v6_prefix, file)
            .map_err(|m| at(&s.key, "idempotency.key".to_owned(), m))?;
        if s.key.get_ref().trim() == "global" {
            return Err(at(
                &s.key,
                "idempotency.key".to_owned(),
                "must name the client: with \"global\" any client could repeat another's Idempotency-Key for free",
            ));
        }
        let ttl = duration(&s.ttl, "idempotency.ttl".to_owned())?;
        b = b.idempotency(s.name.get_ref(), key, ttl);
    }
    if let Some(log) = &file.decision_log {
        let s = log.get_ref();
        let l = DecisionLog::new()
            .allowed(s.allowed.unwrap_or(0.0))
            .limited(s.limited.unwrap_or(0.0));
        if !l.is_valid() {
            return Err(at(
                log,
                "decision_log".to_owned(),
                "the shares must be from 0.0 to 1.0",
            ));
        }
        b = b.decision_log(l);
    }
    if let Some(audit) = &file.audit {
        let s = audit.get_ref();
        let rules: Vec<&str> = s.rules.get_ref().iter().map(String::as_str).collect();
        // A stream's bounds are checked here; it is attached where the
        // store is known (`PolicyFile::audit_stream`).
        audit_stream(s)?;
        b = b.audit(crate::observe::LogAudit, &rules).audit_from_file();
        if let Some(n) = &s.per_second {
            let n = u32::try_from(*n.get_ref())
                .ok()
                .filter(|n| *n >= 1)
                .ok_or_else(|| {
                    at(
                        n,
                        "audit.per_second".to_owned(),
                        "must be from 1 to 4294967295",
                    )
                })?;
            b = b.audit_per_second(n);
        }
        if let Some(key) = read_secret(
            (audit, "audit"),
            (s.secret_env.as_ref(), s.secret_file.as_ref()),
            secrets,
            false,
        )? {
            b = b.audit_secret(&key);
        }
    }
    Ok(b)
}

fn rule(
    file: &FileSpec,
    spanned: &Spanned<RuleSpec>,
    i: usize,
    client: &ClientIp,
    v6_prefix: u8,
    secret: Option<&[u8]>,
) -> Result<RateRule<FileKey, FileCost>, Problem> {
    let r = spanned.get_ref();
    let path = format!("rules[{i}]");
    let field = |f: &str| format!("{path}.{f}");
    let algorithm = match &r.algorithm {
        None => "gcra",
        Some(a) => ALGORITHMS
            .iter()
            .copied()
            .find(|n| *n == a.get_ref().as_str())
            .ok_or_else(|| {
                at(
                    a,
                    field("algorithm"),
                    format!("must be one of {}", ALGORITHMS.join(", ")),
                )
            })?,
    };
    let lim = limit(
        algorithm,
        r.rate.as_ref(),
        r.burst.as_ref(),
        r.max_delay.as_ref(),
        r.buckets.as_ref(),
        &path,
        &spanned.span(),
    )?;
    let base = tollgate_core::Rule::new(r.name.get_ref(), lim)
        .map_err(|e| at(&r.name, field("name"), e.message().to_owned()))?;
    let key = FileKey::parse(r.key.get_ref(), client, v6_prefix, file)
        .map_err(|m| at(&r.key, field("key"), m))?;
    let file_cost = rule_cost(file, r, &path)?;
    let costliest = file_cost.costliest();
    let mut rule = RateRule::new(r.name.get_ref(), lim, key).cost(file_cost);
    let mut capacity = base.capacity();
    if let Some(m) = &r.missing_key {
        rule = rule.on_missing_key(missing_key(m, field("missing_key"))?);
    }
    if let Some(list) = &r.routes {
        rule = rule.routes(routes(list, field("routes"))?);
    }
    if let Some(c) = &r.challenge {
        let spec = c.get_ref();
        let secret = secret.ok_or_else(|| {
            at(
                c,
                field("challenge"),
                "needs the secret of a [challenge] section (secret_env or secret_file)",
            )
        })?;
        let difficulty = u8::try_from(*spec.difficulty.get_ref()).map_err(|_| {
            at(
                &spec.difficulty,
                field("challenge.difficulty"),
                "must be 1 to 32 bits",
            )
        })?;
        let window = duration(&spec.window, field("challenge.window"))?;
        let pow = crate::policy::ProofOfWork::new(secret, difficulty, window).map_err(|e| {
            let (span, name) = match e.field() {
                "difficulty" => (spec.difficulty.span(), "challenge.difficulty"),
                "window" => (spec.window.span(), "challenge.window"),
                _ => (c.span(), "challenge"),
            };
            (Some(span), field(name), e.message().to_owned())
        })?;
        rule = rule.challenge(pow);
    }
    if let Some(s) = r.shadow {
        rule = rule.shadow(s);
    }
    if let Some(c) = &r.canary {
        rule = rule.canary(share(c, field("canary"), false)?);
    }
    if let Some(w) = &r.warn_at {
        rule = rule.warn_at(share(w, field("warn_at"), true)?);
    }
    if let Some(statuses) = &r.count_if {
        let mut codes = Vec::with_capacity(statuses.get_ref().len());
        for s in statuses.get_ref() {
            let code = http::StatusCode::from_u16(*s)
                .ok()
                .filter(|_| (100..=599).contains(s))
                .ok_or_else(|| {
                    at(
                        statuses,
                        field("count_if"),
                        format!("{s} is not an HTTP status"),
                    )
                })?;
            codes.push(code);
        }
        if codes.is_empty() {
            return Err(at(statuses, field("count_if"), "name at least one status"));
        }
        rule = rule.count_if(move |s| codes.contains(&s));
    }
    if let Some(e) = &r.escalate {
        let e = e.get_ref();
        let strikes = whole(
            *e.strikes.get_ref(),
            &e.strikes,
            field("escalate.strikes"),
            1,
        )?;
        rule = rule.escalate(
            strikes,
            duration(&e.period, field("escalate.period"))?,
            duration(&e.block, field("escalate.block"))?,
            duration(&e.max_block, field("escalate.max_block"))?,
        );
        // The ladder's own checks, placed on the ladder.
        tollgate_core::EscalationRule::new(
            format!("{}:ladder", r.name.get_ref()),
            strikes,
            duration(&e.period, String::new())?,
            duration(&e.block, String::new())?,
            duration(&e.max_block, String::new())?,
        )
        .map_err(|err| {
            let spans = [
                ("period", e.period.span()),
                ("block", e.block.span()),
                ("max_block", e.max_block.span()),
            ];
            ladder_error(
                &err,
                field(&format!("escalate.{}", err.field())),
                &spans,
                e.strikes.span(),
            )
        })?;
    }
    if let Some(sd) = &r.slow_down {
        let sd = sd.get_ref();
        let strikes = whole(
            *sd.strikes.get_ref(),
            &sd.strikes,
            field("slow_down.strikes"),
            1,
        )?;
        let steps: Vec<u8> = sd
            .steps
            .get_ref()
            .iter()
            .map(|&p| u8::try_from(p).unwrap_or(0))
            .collect();
        let period = duration(&sd.period, field("slow_down.period"))?;
        let hold = duration(&sd.hold, field("slow_down.hold"))?;
        // The ladder's own checks, placed on the ladder.
        tollgate_core::EscalationRule::slow_down(
            format!("{}:slow", r.name.get_ref()),
            strikes,
            period,
            hold,
            &steps,
        )
        .map_err(|err| {
            let spans = [
                ("period", sd.period.span()),
                ("hold", sd.hold.span()),
                ("steps", sd.steps.span()),
            ];
            ladder_error(
                &err,
                field(&format!("slow_down.{}", err.field())),
                &spans,
                sd.strikes.span(),
            )
        })?;
        if let Some(e) = &r.escalate {
            return Err(at(
                e,
                field("escalate"),
                "a rule has one ladder: escalate (blocks) or slow_down (lowers the rate), \
                 not both",
            ));
        }
        rule = rule.slow_down(strikes, period, hold, &steps);
        // A request whose cost the file knows must fit every step's share
        // of the limit (charged the whole burst otherwise, it would keep
        // more than the step's share).
        if let (Some((cost, what)), Some(&least)) = (costliest.as_ref(), steps.last()) {
            let kept = base.capacity().saturating_mul(u64::from(least)) / 100;
            if *cost > kept {
                return Err(at(
                    &sd.steps,
                    field("slow_down.steps"),
                    format!(
                        "{least} % of the limit keeps {kept}, less than {what} costs ({cost}): \
                         such a request would not be slowed"
                    ),
                ));
            }
        }
    }
    if let Some(c) = &r.charge_after {
        if r.count_if.is_some() {
            return Err(at(
                c,
                field("charge_after"),
                "a rule settles on its response one way: count_if (which responses count) \
                 or charge_after (what they cost), not both",
            ));
        }
        rule = rule.charge_after(charge_after(c, &field("charge_after"))?);
    }
    if let Some(m) = &r.messages {
        rule = rule.messages(*m.get_ref());
    }
    for (plan, p) in &r.plans {
        let LimitSpec {
            rate,
            burst,
            max_delay,
            buckets,
        } = p.get_ref();
        let lim = limit(
            algorithm,
            rate.as_ref(),
            burst.as_ref(),
            max_delay.as_ref(),
            buckets.as_ref().or(r.buckets.as_ref()),
            &format!("{path}.plans.{plan}"),
            &p.span(),
        )?;
        // (An invalid plan limit is reported when the policy is built.)
        let plan_capacity = tollgate_core::Algorithm::new(lim).map_or(0, |a| a.capacity());
        capacity = capacity.max(plan_capacity);
        rule = rule.plan(plan, lim);
    }
    never_passes(
        costliest,
        r.cost.as_ref(),
        (capacity, "rule"),
        field("cost"),
    )?;
    Ok(rule)
}

/// A rule's `charge_after`, read at `field`.
fn charge_after(
    c: &Spanned<super::spec::ChargeAfterSpec>,
    field: &str,
) -> Result<crate::rate_limit::Measure, Problem> {
    use crate::rate_limit::Measure;
    let spec = c.get_ref();
    let per_field = format!("{field}.per");
    let per = || {
        spec.per.as_ref().ok_or_else(|| {
            at(
                c,
                per_field.clone(),
                "is needed: what one unit buys (a duration for elapsed, bytes for response_bytes)",
            )
        })
    };
    let measure = match spec.measure.get_ref().as_str() {
        "elapsed" => {
            let per = per()?;
            let text = per
                .get_ref()
                .as_str()
                .ok_or_else(|| at(per, per_field.clone(), "is not a duration like \"100ms\""))?;
            let d = spec::duration(text).map_err(|m| at(per, per_field.clone(), m))?;
            Measure::Elapsed { per: d }
        }
        "response_bytes" => Measure::ResponseBytes {
            per: u64::from(bytes(per()?, per_field.clone(), false)?),
        },
        "reported" => {
            if let Some(p) = &spec.per {
                return Err(at(
                    p,
                    per_field,
                    "is not taken by reported: the handler reports the units",
                ));
            }
            Measure::Reported
        }
        _ => {
            return Err(at(
                &spec.measure,
                format!("{field}.measure"),
                "must be one of elapsed, response_bytes, reported",
            ))
        }
    };
    measure.check().map_err(|e| {
        let span = spec.per.as_ref().map_or_else(|| c.span(), Spanned::span);
        (Some(span), per_field, e.message().to_owned())
    })?;
    Ok(measure)
}

/// A ladder's own error (`escalate`'s, `slow_down`'s), as `field`, placed
/// on the value of the field it names among `spans`, else on `strikes`.
fn ladder_error(
    err: &tollgate_core::ConfigError,
    field: String,
    spans: &[(&str, Range<usize>)],
    strikes: Range<usize>,
) -> Problem {
    let span = spans
        .iter()
        .find(|(name, _)| *name == err.field())
        .map_or(strikes, |(_, span)| span.clone());
    (Some(span), field, err.message().to_owned())
}

/// The most networks one list file may hold.
const MAX_LISTED: usize = 1_000_000;

fn access(a: &Spanned<super::spec::AccessSpec>, client: &ClientIp) -> Result<AccessList, Problem> {
    let s = a.get_ref();
    let name = s.name.as_ref().map_or("access", |n| n.get_ref().as_str());
    let mut list = AccessList::new(name).client_ip(client.clone());
    if let Some(h) = &s.keys_from {
        list = list
            .keys_from(h.get_ref())
            .map_err(|e| at(h, "access.keys_from".to_owned(), e.message().to_owned()))?;
    }
    list = list
        .allow_keys(s.allow_keys.iter())
        .deny_keys(s.deny_keys.iter());
    if let Some(n) = &s.allow_networks {
        list = list.allow_networks(n.get_ref()).map_err(|e| {
            at(
                n,
                "access.allow_networks".to_owned(),
                e.message().to_owned(),
            )
        })?;
    }
    if let Some(n) = &s.deny_networks {
        list = list
            .deny_networks(n.get_ref())
            .map_err(|e| at(n, "access.deny_networks".to_owned(), e.message().to_owned()))?;
    }
    // The list files, line by line (an error names the line).
    let files = [
        (&s.allow_networks_file, "access.allow_networks_file"),
        (&s.deny_networks_file, "access.deny_networks_file"),
    ];
    for ((file, field), loaded) in files.into_iter().zip(&s.loaded) {
        let (Some(file), Some(loaded)) = (file, loaded) else {
            continue;
        };
        let text = loaded
            .as_ref()
            .map_err(|e| at(file, field.to_owned(), e.clone()))?;
        let entries = text
            .lines()
            .enumerate()
            .map(|(n, line)| (n, line.split('#').next().unwrap_or_default().trim()))
            .filter(|(_, line)| !line.is_empty());
        let mut count = 0usize;
        for (n, cidr) in entries {
            count = count.saturating_add(1);
            if count > MAX_LISTED {
                return Err(at(
                    file,
                    field.to_owned(),
                    format!("holds more than {MAX_LISTED} networks"),
                ));
            }
            let added = if field == "access.allow_networks_file" {
                list.allow_networks([cidr])
            } else {
                list.deny_networks([cidr])
            };
            // The line is not repeated: a file named by mistake (a
            // secret's) must not be printed in an error.
            list = added.map_err(|_| {
                at(
                    file,
                    field.to_owned(),
                    format!(
                        "line {}: not a network (a CIDR such as 192.0.2.0/24, or an address; \
                         allowed networks no wider than /8 for IPv4, /32 for IPv6)",
                        n.saturating_add(1)
                    ),
                )
            })?;
        }
    }
    if let Some(d) = s.deny_by_default {
        list = list.deny_by_default(d);
    }
    if (!s.allow_keys.is_empty() || !s.deny_keys.is_empty()) && s.keys_from.is_none() {
        return Err(at(
            a,
            "access.keys_from".to_owned(),
            "key lists need keys_from (the header that carries the key)",
        ));
    }
    Ok(list)
}

/// Places a builder's error: one about a rule names it
/// ([`ConfigError::item`]); the rest belong to the file's top-level
/// tables.
pub(super) fn config_error(file: &FileSpec, e: &ConfigError) -> Option<Problem> {
    let message = e.message();
    if let Some((list, i)) = e.item() {
        let (span, name) = entry_field(file, list, i, e.field());
        return Some((span, format!("{list}[{i}].{name}"), message.to_owned()));
    }
    let span = match e.field() {
        "access" => file.access.as_ref().map(Spanned::span),
        "idempotency" => file.idempotency.as_ref().map(Spanned::span),
        "plans" => file.plan_from.as_ref().map(Spanned::span),
        "decision_log" => file.decision_log.as_ref().map(Spanned::span),
        "audit" | "audit_secret" => file.audit.as_ref().map(Spanned::span),
        _ => None,
    };
    Some((span, e.field().to_owned(), message.to_owned()))
}

/// A cost known at load above every plan's `capacity`: such a request
/// could never pass (always 429). Surely a mistake; said at `cost`.
/// (`kind`: what the entry is, `rule` or `limit`, for the message.)
fn never_passes(
    costliest: Option<(u64, String)>,
    cost: Option<&Spanned<toml::Value>>,
    (capacity, kind): (u64, &str),
    field: String,
) -> Result<(), Problem> {
    match (costliest, cost) {
        (Some((n, what)), Some(c)) if n > capacity => Err(at(
            c,
            field,
            format!(
                "{what} costs {n}, more than this {kind} ever admits at once ({capacity}, every plan included): such a request could never pass"
            ),
        )),
        _ => Ok(()),
    }
}

/// The key `key` of the entry at `path` names, read as the file says
/// (`client-ip` by its trusted proxies and IPv6 prefix).
fn file_key(file: &FileSpec, key: &Spanned<String>, path: &str) -> Result<FileKey, Problem> {
    let (client, v6_prefix) = client_ip(file)?;
    FileKey::parse(key.get_ref(), &client, v6_prefix, file)
        .map_err(|m| at(key, format!("{path}.key"), m))
}

/// Each period's limit of a `limits` table (or a plan's) at `field`.
fn periods(
    table: &Spanned<std::collections::BTreeMap<String, Spanned<i64>>>,
    field: &str,
) -> Result<Vec<(Period, u64)>, Problem> {
    let mut periods = Vec::with_capacity(table.get_ref().len());
    for (name, limit) in table.get_ref() {
        let f = format!("{field}.{name}");
        let period = Period::ALL
            .into_iter()
            .find(|p| p.name() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = Period::ALL.iter().map(|p| p.name()).collect();
                at(
                    limit,
                    f.clone(),
                    format!("is not a period: one of {}", names.join(", ")),
                )
            })?;
        periods.push((period, plain_cost(*limit.get_ref(), &limit.span(), f)?));
    }
    if periods.is_empty() {
        return Err(at(
            table,
            field.to_owned(),
            "name at least one period, e.g. { day = 1000 }",
        ));
    }
    Ok(periods)
}

/// Where periods start: `UTC`, an offset from it (`+05:30`, `-04:00`),
/// or an IANA time zone (feature `tz`).
pub(super) fn zone(value: &Spanned<String>, field: String) -> Result<Zone, Problem> {
    let text = value.get_ref().trim();
    if text.eq_ignore_ascii_case("utc") || text == "Z" {
        return Ok(Zone::UTC);
    }
    if let Some(sign) = text.chars().next().filter(|c| *c == '+' || *c == '-') {
        let bad = || {
            at(
                value,
                field.clone(),
                "an offset is +HH:MM or -HH:MM, e.g. \"-05:00\"",
            )
        };
        let (h, m) = text
            .get(1..)
            .and_then(|t| t.split_once(':'))
            .ok_or_else(bad)?;
        // Digits only (no second sign), two for the minutes.
        let digits = |t: &str| {
            (!t.is_empty() && t.len() <= 2 && t.bytes().all(|b| b.is_ascii_digit()))
                .then(|| t.parse::<i32>().ok())
                .flatten()
        };
        let (Some(h), Some(m)) = (digits(h), digits(m).filter(|_| m.len() == 2)) else {
            return Err(bad());
        };
        if m >= 60 {
            return Err(at(value, field, "minutes must be below 60"));
        }
        // The sign is the whole offset's: -00:30 is west of UTC.
        let seconds = h.saturating_mul(3_600).saturating_add(m.saturating_mul(60));
        let seconds = if sign == '-' {
            seconds.saturating_neg()
        } else {
            seconds
        };
        let offset = Offset::from_seconds(seconds)
            .map_err(|e| at(value, field.clone(), e.message().to_owned()))?;
        return Ok(offset.into());
    }
    #[cfg(feature = "tz")]
    {
        Zone::iana(text).map_err(|e| at(value, field, e.message().to_owned()))
    }
    #[cfg(not(feature = "tz"))]
    Err(at(
        value,
        field,
        "an IANA time zone needs tollgate's tz feature (or give an offset such as \"-05:00\")",
    ))
}

/// The quota builder of `file`'s `[[quotas]]` entry `i`, on a new memory
/// store: everything it declares, checked but not yet bound to a store.
pub(super) fn quota(
    file: &FileSpec,
    i: usize,
) -> Result<crate::quota::QuotaLayerBuilder<FileKey, FileCost, MemoryStore>, Problem> {
    let Some(spanned) = file.quotas.get(i) else {
        return Err((None, "quotas".to_owned(), format!("no quota {i}")));
    };
    let q: &QuotaSpec = spanned.get_ref();
    let path = format!("quotas[{i}]");
    let field = |f: &str| format!("{path}.{f}");
    let key = file_key(file, &q.key, &path)?;
    let cost = cost_of(file, q.cost.as_ref(), &path)?;
    let costliest = cost.costliest();
    let mut b = crate::QuotaLayer::builder(q.name.get_ref())
        .key(key)
        .cost(cost);
    if let Some(on) = on_store_error(q.on_store_error.as_ref(), file, field("on_store_error"))? {
        b = b.on_store_error(on);
    }
    // What one request may cost at most and still pass: its plan's
    // smallest period limit, the most of any plan.
    let default = periods(&q.limits, &field("limits"))?;
    let mut capacity = default.iter().map(|(_, n)| *n).min().unwrap_or(0);
    for (period, limit) in default {
        b = b.period(period, limit);
    }
    for (plan, limits) in &q.plans {
        let limits = periods(limits, &field(&format!("plans.{plan}")))?;
        capacity = capacity.max(limits.iter().map(|(_, n)| *n).min().unwrap_or(0));
        b = b.plan(plan, &limits);
    }
    never_passes(
        costliest,
        q.cost.as_ref(),
        (capacity, "limit"),
        field("cost"),
    )?;
    if !q.plans.is_empty() {
        b = plan_source!(b, plan_from(file, spanned, field("plans"))?);
    }
    if let Some(m) = &q.missing_key {
        b = b.on_missing_key(missing_key(m, field("missing_key"))?);
    }
    if let Some(list) = &q.routes {
        b = b.routes(routes(list, field("routes"))?);
    }
    if let Some(s) = &q.soft_limit {
        b = b.soft_limit(*s.get_ref());
    }
    if let Some(z) = &q.zone {
        b = b.zone(zone(z, field("zone"))?);
    }
    if let Some(s) = q.shadow {
        b = b.shadow(s);
    }
    Ok(b.headers(file.headers.unwrap_or(true)))
}

/// The concurrency builder of `file`'s `[[concurrency]]` entry `i`, on a
/// new memory store.
pub(super) fn concurrency(
    file: &FileSpec,
    i: usize,
) -> Result<
    crate::concurrency::ConcurrencyLayerBuilder<
        FileKey,
        FileCost,
        crate::concurrency::AllCritical,
        MemoryStore,
    >,
    Problem,
> {
    let Some(spanned) = file.concurrency.get(i) else {
        return Err((None, "concurrency".to_owned(), format!("no entry {i}")));
    };
    let c: &ConcurrencySpec = spanned.get_ref();
    let path = format!("concurrency[{i}]");
    let field = |f: &str| format!("{path}.{f}");
    let key = file_key(file, &c.key, &path)?;
    let max = whole(*c.max.get_ref(), &c.max, field("max"), 1)?;
    let cost = cost_of(file, c.cost.as_ref(), &path)?;
    let costliest = cost.costliest();
    let mut b = crate::ConcurrencyLayer::builder(c.name.get_ref(), max)
        .key(key)
        .cost(cost);
    if let Some(on) = on_store_error(c.on_store_error.as_ref(), file, field("on_store_error"))? {
        b = b.on_store_error(on);
    }
    let mut capacity = u64::from(max);
    for (plan, m) in &c.plans {
        let plan_max = whole(*m.get_ref(), m, field(&format!("plans.{plan}")), 1)?;
        capacity = capacity.max(u64::from(plan_max));
        b = b.plan(plan, plan_max);
    }
    never_passes(
        costliest,
        c.cost.as_ref(),
        (capacity, "limit"),
        field("cost"),
    )?;
    if !c.plans.is_empty() {
        b = plan_source!(b, plan_from(file, spanned, field("plans"))?);
    }
    if let Some(q) = &c.queue {
        let q = q.get_ref();
        let len = whole(*q.max_len.get_ref(), &q.max_len, field("queue.max_len"), 1)?;
        let wait = duration(&q.max_wait, field("queue.max_wait"))?;
        b = b.queue(usize::try_from(len).unwrap_or(usize::MAX), wait);
    }
    if let Some(sv) = &c.service {
        if c.adaptive.is_some() {
            return Err(at(
                sv,
                field("service"),
                "a service limit is fixed (service) or adaptive (adaptive), not both",
            ));
        }
        let sv = sv.get_ref();
        b = b.service_limit(
            sv.name.get_ref(),
            whole(*sv.max.get_ref(), &sv.max, field("service.max"), 1)?,
        );
    }
    if let Some(a) = &c.adaptive {
        let a = a.get_ref();
        let n =
            |v: &Spanned<i64>, f: &str| whole(*v.get_ref(), v, field(&format!("adaptive.{f}")), 1);
        let (min, initial, max) = (
            n(&a.min, "min")?,
            n(&a.initial, "initial")?,
            n(&a.max, "max")?,
        );
        let place = |e: ConfigError| {
            let v = match e.field() {
                "min" => &a.min,
                "initial" => &a.initial,
                _ => &a.max,
            };
            at(
                v,
                field(&format!("adaptive.{}", e.field())),
                e.message().to_owned(),
            )
        };
        let limit = match a.algorithm.get_ref().as_str() {
            "gradient" => tollgate_core::adaptive::AdaptiveLimit::Gradient(
                tollgate_core::adaptive::Gradient::new(min, initial, max).map_err(place)?,
            ),
            "aimd" => tollgate_core::adaptive::AdaptiveLimit::Aimd(
                tollgate_core::adaptive::Aimd::new(min, initial, max).map_err(place)?,
            ),
            _ => {
                return Err(at(
                    &a.algorithm,
                    field("adaptive.algorithm"),
                    "must be \"gradient\" or \"aimd\"",
                ))
            }
        };
        b = b.adaptive_service_limit(a.name.get_ref(), limit);
    }
    if let Some(r) = &c.read_only {
        let r = r.get_ref();
        let window = duration(&r.window, field("read_only.window"))?;
        b = b.read_only_above(*r.above.get_ref(), window);
        if let Some(n) = &r.min_requests {
            b = b.read_only_min_requests(whole(
                *n.get_ref(),
                n,
                field("read_only.min_requests"),
                1,
            )?);
        }
    }
    if let Some(m) = &c.missing_key {
        b = b.on_missing_key(missing_key(m, field("missing_key"))?);
    }
    if let Some(list) = &c.routes {
        b = b.routes(routes(list, field("routes"))?);
    }
    if let Some(s) = c.shadow {
        b = b.shadow(s);
    }
    if let Some(t) = &c.lease_ttl {
        b = b.lease_ttl(duration(t, field("lease_ttl"))?);
    }
    if let Some(t) = &c.retry_after {
        b = b.retry_after(duration(t, field("retry_after"))?);
    }
    if let Some(t) = &c.max_lifetime {
        b = b.max_lifetime(duration(t, field("max_lifetime"))?);
    }
    Ok(b.headers(file.headers.unwrap_or(true)))
}

/// A number of bytes: a whole number, or a string such as `"64 KiB"`
/// (`B`, `KB`, `KiB`, `MB`, `MiB`, `GB`, `GiB`; with `per_second`, ending
/// in `/s`), at least 1 and at most `u32::MAX`.
fn bytes(value: &Spanned<toml::Value>, field: String, per_second: bool) -> Result<u32, Problem> {
    let example = if per_second {
        "\"256 KiB/s\""
    } else {
        "\"64 KiB\""
    };
    let bad = || {
        at(
            value,
            field.clone(),
            format!("is not a number of bytes like {example}"),
        )
    };
    let n: u64 = match value.get_ref() {
        toml::Value::Integer(n) => u64::try_from(*n).map_err(|_| bad())?,
        toml::Value::String(text) => {
            let mut text = text.trim();
            if per_second {
                text = text.strip_suffix("/s").ok_or_else(bad)?.trim_end();
            }
            let split = text
                .find(|c: char| !c.is_ascii_digit())
                .unwrap_or(text.len());
            let (digits, unit) = text.split_at(split);
            let n: u64 = digits.parse().map_err(|_| bad())?;
            let unit: u64 = match unit.trim() {
                "" | "B" => 1,
                "KB" => 1_000,
                "KiB" => 1 << 10,
                "MB" => 1_000_000,
                "MiB" => 1 << 20,
                "GB" => 1_000_000_000,
                "GiB" => 1 << 30,
                _ => return Err(bad()),
            };
            n.checked_mul(unit).ok_or_else(|| {
                at(
                    value,
                    field.clone(),
                    format!("must be at most {} bytes", u32::MAX),
                )
            })?
        }
        _ => return Err(bad()),
    };
    match u32::try_from(n) {
        Ok(v) if v >= 1 => Ok(v),
        Ok(_) => Err(at(value, field, "must be at least 1 byte")),
        Err(_) => Err(at(
            value,
            field,
            format!("must be at most {} bytes", u32::MAX),
        )),
    }
}

/// The bandwidth builder of `file`'s `[[bandwidth]]` entry `i`, on a new
/// memory store.
pub(super) fn bandwidth(
    file: &FileSpec,
    i: usize,
) -> Result<crate::bandwidth::BandwidthLayerBuilder<FileKey, MemoryStore>, Problem> {
    let Some(spanned) = file.bandwidth.get(i) else {
        return Err((None, "bandwidth".to_owned(), format!("no entry {i}")));
    };
    let w: &BandwidthSpec = spanned.get_ref();
    let path = format!("bandwidth[{i}]");
    let field = |f: &str| format!("{path}.{f}");
    let key = file_key(file, &w.key, &path)?;
    let rate = bytes(&w.rate, field("rate"), true)?;
    let burst = bytes(&w.burst, field("burst"), false)?;
    let mut b = crate::bandwidth::BandwidthLayer::builder(w.name.get_ref(), rate, burst).key(key);
    if let Some(d) = &w.direction {
        use crate::bandwidth::Direction;
        b = b.direction(match d.get_ref().as_str() {
            "responses" => Direction::Responses,
            "requests" => Direction::Requests,
            "both" => Direction::Both,
            _ => {
                return Err(at(
                    d,
                    field("direction"),
                    "must be \"responses\", \"requests\" or \"both\"",
                ))
            }
        });
    }
    if let Some(c) = &w.chunk {
        b = b.chunk(bytes(c, field("chunk"), false)?);
    }
    if let Some(m) = &w.missing_key {
        b = b.on_missing_key(missing_key(m, field("missing_key"))?);
    }
    if let Some(list) = &w.routes {
        b = b.routes(routes(list, field("routes"))?);
    }
    Ok(b)
}

/// Entry `i` of `[[retry_budgets]]`, as a builder on a memory store.
pub(super) fn retry_budget(
    file: &FileSpec,
    i: usize,
) -> Result<crate::retry::RetryBudgetLayerBuilder<super::RetryKey, MemoryStore>, Problem> {
    use super::RetryKey;
    let Some(spanned) = file.retry_budgets.get(i) else {
        return Err((None, "retry_budgets".to_owned(), format!("no entry {i}")));
    };
    let r: &super::spec::RetrySpec = spanned.get_ref();
    let path = format!("retry_budgets[{i}]");
    let field = |f: &str| format!("{path}.{f}");
    let key = match &r.key {
        None => RetryKey::Upstream,
        Some(k) if k.get_ref().trim() == "upstream" => RetryKey::Upstream,
        Some(k) => RetryKey::File(file_key(file, k, &path)?),
    };
    let mut b = crate::retry::RetryBudgetLayer::builder(r.name.get_ref()).key(key);
    if r.ratio.is_some() || r.min_per_second.is_some() || r.window.is_some() {
        let ratio = r.ratio.as_ref().map_or(0.2, |v| *v.get_ref());
        let floor = match &r.min_per_second {
            None => 10,
            Some(n) => u32::try_from(*n.get_ref())
                .map_err(|_| at(n, field("min_per_second"), "must be from 0 to 4294967295"))?,
        };
        let window = match &r.window {
            None => Duration::from_secs(10),
            Some(w) => duration(w, field("window"))?,
        };
        b = b.budget(ratio, floor, window);
    }
    if let Some(n) = &r.max_attempts {
        b = b.max_attempts(whole(*n.get_ref(), n, field("max_attempts"), 1)?);
    }
    if let Some(bo) = &r.backoff {
        let bo = bo.get_ref();
        b = b.backoff(
            duration(&bo.base, field("backoff.base"))?,
            duration(&bo.cap, field("backoff.cap"))?,
        );
    }
    if let Some(w) = &r.max_server_wait {
        b = b.max_server_wait(duration(w, field("max_server_wait"))?);
    }
    if let Some(d) = &r.deadline {
        b = b.deadline(duration(d, field("deadline"))?);
    }
    if let Some(any) = r.retry_any_method {
        b = b.retry_any_method(any);
    }
    for p in &r.idempotent_paths {
        b = b.idempotent_path(p);
    }
    if let Some(l) = &r.buffer_limit {
        b = b.buffer_limit(u64::from(bytes(l, field("buffer_limit"), false)?));
    }
    if let Some(k) = &r.adaptive_throttling {
        b = b.adaptive_throttling(*k.get_ref());
    }
    if let Some(list) = &r.retry_on {
        let on = retry_on(list, &field("retry_on"))?;
        b = b.classify(move |attempt| on.retries(&attempt));
    }
    Ok(b)
}

/// Which outcomes a file's retry budget retries.
#[derive(Debug, Default)]
struct RetryOn {
    /// An error of the inner service (a connect error, a timeout).
    errors: bool,
    statuses: Vec<u16>,
    grpc: Vec<u16>,
}

impl RetryOn {
    fn retries(&self, attempt: &crate::retry::Attempt<'_>) -> bool {
        use crate::outcome::{Completion, GrpcCode};
        use crate::retry::Attempt;
        match attempt {
            Attempt::Error(_) => self.errors && attempt.is_retryable_by_default(),
            // Read as every layer reads an answer: `grpc-status` on an
            // HTTP 200 is a gRPC outcome; any other status is HTTP's,
            // which a gRPC client reads as the code gRPC maps it to (a
            // load balancer's 503 is `UNAVAILABLE`).
            Attempt::Response { status, headers } => match Completion::from_parts(*status, headers)
            {
                Completion::Grpc(code) => code != GrpcCode::OK && self.grpc.contains(&code.0),
                Completion::Response(s) => {
                    self.statuses.contains(&s.as_u16())
                        || grpc_of_http(s.as_u16()).is_some_and(|c| self.grpc.contains(&c))
                }
                Completion::Error => false,
            },
        }
    }
}

/// The gRPC code a gRPC client reads an HTTP status without one as
/// (gRPC's "HTTP to gRPC status code mapping").
fn grpc_of_http(status: u16) -> Option<u16> {
    match status {
        200 => None,
        400 => Some(13),                   // INTERNAL
        401 => Some(16),                   // UNAUTHENTICATED
        403 => Some(7),                    // PERMISSION_DENIED
        404 => Some(12),                   // UNIMPLEMENTED
        429 | 502 | 503 | 504 => Some(14), // UNAVAILABLE
        _ => Some(2),                      // UNKNOWN
    }
}

/// The gRPC status codes by name, as `retry_on` names them.
const GRPC_CODES: [&str; 17] = [
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
];

fn retry_on(list: &Spanned<Vec<Spanned<toml::Value>>>, field: &str) -> Result<RetryOn, Problem> {
    let mut on = RetryOn::default();
    for (i, v) in list.get_ref().iter().enumerate() {
        let bad = || {
            at(
                v,
                format!("{field}[{i}]"),
                "must be \"error\", an HTTP status from 400 to 599, or a gRPC code by name (\"UNAVAILABLE\")",
            )
        };
        match v.get_ref() {
            toml::Value::Integer(n) if (400..=599).contains(n) => {
                on.statuses.push(u16::try_from(*n).map_err(|_| bad())?);
            }
            toml::Value::String(s) if s == "error" => on.errors = true,
            toml::Value::String(s) => {
                let code = GRPC_CODES
                    .iter()
                    .position(|c| c == s)
                    .filter(|c| *c != 0)
                    .ok_or_else(bad)?;
                on.grpc.push(u16::try_from(code).map_err(|_| bad())?);
            }
            _ => return Err(bad()),
        }
    }
    Ok(on)
}

/// Where a builder's error about field `field` of entry `i` of `[[list]]`
/// lies in the file, and the file's name for that field (the builders
/// name some fields otherwise: a bandwidth's `bytes_per_second` is the
/// file's `rate`). Else the entry, and the builder's name.
fn entry_field(
    file: &FileSpec,
    list: &str,
    i: usize,
    field: &'static str,
) -> (Option<Range<usize>>, String) {
    fn span<T>(v: &Spanned<T>) -> Option<Range<usize>> {
        Some(v.span())
    }
    let found: Option<(Option<Range<usize>>, &str)> = match list {
        // A name's error is the entry's (a name taken, or too long with a
        // plan's suffix): placed at the entry.
        "rules" => file.rules.get(i).map(|r| match field {
            "rules" | "name" => (Some(r.span()), "name"),
            // A slowing ladder's step its limit cannot keep.
            "steps" => match &r.get_ref().slow_down {
                Some(sd) => (span(&sd.get_ref().steps), "slow_down.steps"),
                None => (Some(r.span()), field),
            },
            _ => (Some(r.span()), field),
        }),
        "quotas" => file.quotas.get(i).map(|q| {
            let v = q.get_ref();
            match field {
                "limit" | "periods" => (span(&v.limits), "limits"),
                "soft_limit" => (v.soft_limit.as_ref().and_then(span), "soft_limit"),
                "time_zone" | "offset" => (v.zone.as_ref().and_then(span), "zone"),
                _ => (Some(q.span()), field),
            }
        }),
        "concurrency" => file.concurrency.get(i).map(|c| {
            let v = c.get_ref();
            match field {
                "max" => (span(&v.max), "max"),
                "queue" => (v.queue.as_ref().and_then(span), "queue"),
                "service_limit" => match (&v.service, &v.adaptive) {
                    (Some(s), _) => (span(s), "service"),
                    (None, Some(a)) => (span(a), "adaptive"),
                    _ => (Some(c.span()), field),
                },
                "read_only" => (v.read_only.as_ref().and_then(span), "read_only"),
                "lease_ttl" => (v.lease_ttl.as_ref().and_then(span), "lease_ttl"),
                "retry_after" => (v.retry_after.as_ref().and_then(span), "retry_after"),
                "max_lifetime" => (v.max_lifetime.as_ref().and_then(span), "max_lifetime"),
                _ => (Some(c.span()), field),
            }
        }),
        "bandwidth" => file.bandwidth.get(i).map(|w| {
            let v = w.get_ref();
            match field {
                "bytes_per_second" | "rate" => (span(&v.rate), "rate"),
                "burst" => (span(&v.burst), "burst"),
                "chunk" => (v.chunk.as_ref().and_then(span), "chunk"),
                _ => (Some(w.span()), field),
            }
        }),
        "retry_budgets" => file.retry_budgets.get(i).map(|r| {
            let v = r.get_ref();
            match field {
                "ratio" => (v.ratio.as_ref().and_then(span), "ratio"),
                "min_per_second" => (v.min_per_second.as_ref().and_then(span), "min_per_second"),
                "window" => (v.window.as_ref().and_then(span), "window"),
                "max_attempts" => (v.max_attempts.as_ref().and_then(span), "max_attempts"),
                "backoff" => (v.backoff.as_ref().and_then(span), "backoff"),
                "buffer_limit" => (v.buffer_limit.as_ref().and_then(span), "buffer_limit"),
                "adaptive_throttling" => (
                    v.adaptive_throttling.as_ref().and_then(span),
                    "adaptive_throttling",
                ),
                _ => (Some(r.span()), field),
            }
        }),
        _ => None,
    };
    match found {
        Some((span, name)) => (span, name.to_owned()),
        None => (None, field.to_owned()),
    }
}
