//! Policy files: every limit of a service declared in TOML — one
//! [`Tollgate`] layer (feature `axum`) or each layer by name — and
//! reloaded while the server runs (feature `config`).
//!
//! ```
//! use tollgate::config::PolicyFile;
//! use tollgate::MemoryStore;
//!
//! # fn main() -> Result<(), tollgate::config::FileError> {
//! let file = PolicyFile::parse(r#"
//!     trusted_proxies = ["10.0.0.0/8"]  # whose X-Forwarded-For is believed
//!     plan_from = "header:x-plan"       # demos only; in production: "extension"
//!
//!     [costs.api]
//!     default = 1
//!     routes = [
//!         { method = "POST", path = "/api/orders", cost = 3 },
//!         { method = "POST", path = "/api/reports", cost = 10 },
//!     ]
//!
//!     [[rules]]
//!     name = "per-key"
//!     key = "header:x-api-key | client-ip"
//!     rate = "10/s"
//!     burst = 20
//!     cost = "api"
//!     plans.pro = { rate = "100/s", burst = 200 }
//!
//!     [[rules]]
//!     name = "per-ip"
//!     key = "client-ip"
//!     rate = "100/s"
//!     burst = 400
//!     cost = "api"
//! "#)?;
//! let layer = file.layer::<axum::body::Body, _>(&MemoryStore::new())?;
//! assert_eq!(layer.rule_names(), ["per-key", "per-ip"]);
//! # Ok(())
//! # }
//! ```
//!
//! # The file
//!
//! Top level (all optional): `headers`, `legacy_headers` and
//! `route_label` (booleans; see
//! [`route_label`](crate::policy::PolicyLayerBuilder::route_label)),
//! `trusted_proxies` (CIDRs whose forwarding headers `client-ip` believes),
//! `forwarded_header` (`"x-forwarded-for"`, the default, or
//! `"forwarded"`), `ipv6_prefix` (bits an IPv6 client is keyed by, 64 by
//! default), `plan_from` (`"extension"` or `"header:<name>"`),
//! `on_store_error` (what a store's error, rather than a decision, does:
//! `"admit"`, the default, or `"refuse"` with a 429 and `Retry-After: 1`;
//! for the rules and every quota and in-flight limit without its own
//! `on_store_error`; see [`OnStoreError`](crate::OnStoreError)), named
//! `[costs.<name>]`, `[access]` (`name`, `keys_from`, `allow_keys`,
//! `deny_keys`, `allow_networks`, `deny_networks`, `deny_by_default`, and
//! `allow_networks_file` / `deny_networks_file`: files of one CIDR or
//! address a line, `#` comments, up to 1,000,000, relative to the policy
//! file — a TOR exit list, a hosting provider's ranges — read with the
//! policy file and reloaded when either changes), `[idempotency]`, `[decision_log]` and
//! `[audit]` (`rules`, the rules and access lists whose refusals are
//! recorded as `tollgate::audit` log events; `per_second`; `secret_env`
//! or `secret_file`, so that key fingerprints agree across a fleet;
//! `stream`, a Redis stream of the store the rules run on to append the
//! records to instead, with `maxlen`, about how many it keeps, 100,000 by
//! default, and `queue`, how many may wait for Redis, 10,000 by default,
//! past which they are dropped and counted; a sink set in code replaces
//! either).
//!
//! Each `[[rules]]` entry (up to 8, decided in order; a file whose limits
//! are all in its other sections needs none):
//!
//! | field | meaning |
//! |---|---|
//! | `name` | the rule's name in headers, store keys and metrics |
//! | `key` | alternatives split by `\|`, each parts joined by `+`: `header:<name>`, `fingerprint:<name>,<name>...` (a client fingerprint from up to 8 headers, e.g. `fingerprint:x-ja4,user-agent`: see [`ClientFingerprint`](crate::key::ClientFingerprint)), `client-ip`, `peer-ip`, `path`, `route`, `method`, `global`, `asn` and `country` (the client address's autonomous system or country, from `[geoip]`'s databases: `[geoip] asn = "GeoLite2-ASN.mmdb"`, `country = "GeoLite2-Country.mmdb"`, relative to the policy file, feature `geoip`) |
//! | `algorithm` | `gcra` (default), `token_bucket`, `fixed_window`, `sliding_window` (counter), `sliding_log`, `sliding_buckets`, `leaky_bucket` |
//! | `rate` | `"10/s"`, `"600/min"`, `"5/15m"`: for GCRA the sustained rate, for the token bucket the refill, for windows the limit per window, for the leaky bucket the drain rate |
//! | `burst = N` | GCRA's burst, the token bucket's capacity (not for windows or the leaky bucket) |
//! | `max_delay` | the leaky bucket's longest wait, e.g. `"500ms"` |
//! | `buckets` | `sliding_buckets`: the counters the window is cut into, 1 to 100 (the window is the rate's period) |
//! | `cost` | a number, a `[costs]` name, or a table: `default`, `max`, and one of `header`, `query`, `bytes_per_unit`, `methods = { POST = 5 }`, `routes = [{ method, path, cost }]` |
//! | `missing_key` | `"reject"` (default), `"skip"`, or `"fallback:<shared key>"` |
//! | `shadow`, `canary` | shadow mode; enforce for a share of keys (0.0–1.0) |
//! | `warn_at` | the share of capacity past which responses warn |
//! | `count_if` | statuses that count (response-aware), e.g. `[401, 403]` |
//! | `escalate` | `{ strikes, period, block, max_block }`: repeated refusals block the key |
//! | `slow_down` | `{ strikes, period, hold, steps }`: repeated refusals lower the key's rate, e.g. `steps = [50, 25]` (percent kept, 1 to 8 steps, each below the one before), one step per `strikes` refusals within `period`, for `hold`, climbing back one step per `hold` (a rule has `escalate` or `slow_down`, not both) |
//! | `charge_after` | `{ measure, per }`: charge what a request really cost once its response is known, e.g. `{ measure = "elapsed", per = "100ms" }` (the handler's time), `{ measure = "response_bytes", per = "64 KiB" }` (its `Content-Length`) or `{ measure = "reported" }` (only the handler's [`ActualCost`](crate::rate_limit::ActualCost)); a cheaper response gives the difference back, a dearer one is owed by the key's next request (see [`RateRule::charge_after`](crate::policy::RateRule::charge_after); not with `count_if`) |
//! | `messages = true` | the messages of an upgraded connection (WebSocket) spend this rule's budget too: the handler gets a [`MessageBudget`](crate::rate_limit::MessageBudget) |
//! | `challenge` | `{ difficulty, window }`: a proof-of-work challenge in its refusals (see [`ProofOfWork`](crate::policy::ProofOfWork)), signed with `[challenge]`'s secret |
//! | `plans.<plan>` | the plan's own `rate`, `burst`, `max_delay`, `buckets` (the rule's algorithm; `buckets` the rule's when absent) |
//! | `routes` | the routes it applies to, e.g. `["GET /api/download", "/files/{*path}", "/users/{id}"]` (axum's syntax; every route without it): see [`Routes`](crate::Routes) |
//!
//! Each `[[quotas]]` entry is a calendar quota, built by name as a
//! [`QuotaLayer`](crate::QuotaLayer) with [`PolicyFile::quota`]:
//!
//! | field | meaning |
//! |---|---|
//! | `name` | the quota's name (each once among the quotas) |
//! | `key` | as a rule's |
//! | `limits` | each period's limit: `{ day = 1000, month = 20000 }`; periods `minute`, `hour`, `day`, `week`, `month`, `year` |
//! | `cost` | as a rule's |
//! | `plans.<plan>` | the plan's own limits, as `limits` (the file's `plan_from` says the plan) |
//! | `soft_limit` | the share of a period past which responses warn (above 0, at most 1) |
//! | `zone` | where periods start: `"UTC"` (default), an offset (`"-05:00"`), or an IANA name (`"America/New_York"`, feature `tz`) |
//! | `missing_key`, `shadow`, `routes` | as a rule's |
//! | `on_store_error` | `"admit"` or `"refuse"` (the file's when absent) |
//!
//! Each `[[concurrency]]` entry is an in-flight limit, built by name as a
//! [`ConcurrencyLayer`](crate::ConcurrencyLayer) with
//! [`PolicyFile::concurrency`]: `name`, `key`, `max` (permits per key),
//! `cost` (permits a request holds), `plans.<plan> = max`,
//! `queue = { max_len, max_wait }`, a service-wide limit, fixed
//! (`service = { name, max }`) or adaptive (`adaptive = { name,
//! algorithm = "gradient" | "aimd", min, initial, max }`),
//! `read_only = { above, window, min_requests }`, `missing_key`, `shadow`,
//! `on_store_error`, `lease_ttl`, `retry_after`, `max_lifetime` (the longest a permit lives:
//! a stream still running then ends), `routes`. (Which requests are critical is code:
//! [`critical`](crate::concurrency::ConcurrencyLayerBuilder::critical).)
//!
//! Each `[[bandwidth]]` entry paces bodies per key, built by name as a
//! [`BandwidthLayer`](crate::bandwidth::BandwidthLayer) with
//! [`PolicyFile::bandwidth`]: `name`, `key`, `rate` (bytes a second: a
//! number or `"256 KiB/s"`), `burst` and `chunk` (bytes: a number or
//! `"64 KiB"`; `B`, `KB`, `KiB`, `MB`, `MiB`, `GB`, `GiB`), `direction`
//! (`"responses"`, `"requests"`, `"both"`), `missing_key`, `routes`.
//!
//! Each `[[retry_budgets]]` entry is a client's retry budget, built by
//! name as a [`RetryBudgetLayer`](crate::RetryBudgetLayer) with
//! [`PolicyFile::retry_budget`]: `name`, `key` (`"upstream"`, the
//! default, or a key as above), `ratio`, `min_per_second`, `window`,
//! `max_attempts`, `backoff = { base, cap }`, `max_server_wait`,
//! `deadline`, `retry_any_method`, `idempotent_paths`, `buffer_limit`,
//! `adaptive_throttling`, `retry_on` (`"error"`, HTTP statuses from 400 to
//! 599, gRPC codes by name such as `"UNAVAILABLE"`).
//!
//! `[store]` is where the limits keep their state ([`PolicyFile::store`],
//! used by [`Tollgate::from_file`]): `kind = "memory"` (the default;
//! `max_keys`, `sweep_idle_every`) or `kind = "redis"` with `url` (no
//! password in it), `url_env` or `url_file`, `prefix`, `failure_policy`
//! (`"open"`, `"closed"`, `"fallback"`, `"fallback/N"`), `timeout`,
//! `connect_timeout`, and `key_secret_env` or `key_secret_file`. Files
//! named are read relative to the working directory. A Redis store's
//! `[store.hot_keys]` table puts `HotKeys` leases in front of it (`ttl`,
//! `max_batch`, `min_batch`, `max_share`, `max_denial`, `max_keys`,
//! `refill_ahead`, and `rules`, the `[[rules]]` leased; each optional,
//! with `HotKeys`'s defaults and bounds); [`AnyStore::give_back`]
//! returns what the leases hold when an instance stops.
//!
//! [`AnyStore::give_back`]: crate::AnyStore::give_back
//!
//! `[challenge]` holds what the rules' challenges share: the secret they
//! are signed with (`secret_env` or `secret_file`, 16 to 64 bytes, the
//! same on every instance; read when the policy is built, never needed
//! to check a file) and whose challenge a refusal's is (`requester`, a
//! key; the peer's address by default).
//!
//! Names are unique across the lists (one store holds them all). A
//! [`Reloader`] checks every section of a new file (one that does not
//! load is refused). The reloader of a [`Tollgate`] applies every section
//! but `[[retry_budgets]]` (a client's layers), and `[store]` too when
//! the `Tollgate` came from [`Tollgate::from_file`] (which built the
//! store): every limit moves to the new store, from nothing there. A
//! [`PolicyLayer`]'s own applies its rules, and a change to the other
//! sections takes effect when their layers are built again (it is
//! logged).
//!
//! [`PolicyLayer`]: crate::PolicyLayer
//!
//! What a file cannot hold is code: a custom rejection, an audit sink, a
//! plan closure. Set those on the builder and declare the rest in the
//! file (see [`PolicyFile::builder`]).
//!
//! # Errors
//!
//! A file that does not load names its line, column and field:
//! `policy.toml:14:9: rules[1].burst: must be at least 1`.
//!
//! # Reload
//!
//! [`Reloader`] watches the file: on SIGHUP (Unix) and when its contents
//! change (polled; new contents are applied once two polls in a row read
//! them, so a file caught half written is never applied), it loads the
//! new file and
//! [`replace`](crate::policy::PolicyLayer::replace)s the running policy.
//! No request is dropped or charged twice: requests decided before finish
//! on the policy that decided them, later ones are decided by the new one.
//! An unchanged rule keeps its state exactly. A changed rule goes on from
//! its keys' states where their meaning allows —
//! [`Algorithm::keeps_state_of`](tollgate_core::Algorithm::keeps_state_of)
//! says when, per algorithm; on Redis the scripts read the stored state
//! under the new parameters — and starts fresh otherwise. A new file that
//! does not load is logged and counted
//! (`tollgate_config_reloads_total{outcome="rejected"}`), and the policy
//! running stays.

mod build;
#[cfg(feature = "axum")]
mod gate;
mod parts;
mod reload;
mod spec;
mod store;

use std::fmt;
use std::ops::Range;
use std::path::Path;

#[cfg(feature = "axum")]
pub use gate::{AnyBody, Next, Started, Tollgate, TollgateFuture, TollgateService};
pub use parts::{FileCost, FileKey, RetryKey};
pub use reload::{Reloaded, Reloader, Triggers};

/// A policy file that loaded: parsed and checked, ready to build layers.
pub struct PolicyFile {
    spec: spec::FileSpec,
    text: String,
    origin: Option<String>,
    /// The stamps (length, modification time) of the files the text
    /// names (`[access]`'s network lists, `[geoip]`'s databases) when it
    /// was read: a reload compares them too.
    stamps: String,
}

/// Where the file came from and how many rules it holds — never its text:
/// access lists hold keys, which are credentials.
impl std::fmt::Debug for PolicyFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyFile")
            .field("origin", &self.origin)
            .field("rules", &self.spec.rules.len())
            .field("bytes", &self.text.len())
            .finish_non_exhaustive()
    }
}

/// Why a policy file did not load: where, which field, what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileError {
    origin: Option<String>,
    line: usize,
    column: usize,
    field: String,
    message: String,
}

impl FileError {
    /// The 1-based line of the problem (0: the file as a whole).
    pub fn line(&self) -> usize {
        self.line
    }

    /// The 1-based column of the problem.
    pub fn column(&self) -> usize {
        self.column
    }

    /// The field, as a path: `rules[2].burst`.
    pub fn field(&self) -> &str {
        &self.field
    }

    /// What is wrong.
    pub fn message(&self) -> &str {
        &self.message
    }

    fn at(
        text: &str,
        origin: Option<&str>,
        span: Option<Range<usize>>,
        field: String,
        message: String,
    ) -> Self {
        let (line, column) = match span {
            Some(span) => position(text, span.start),
            None => (0, 0),
        };
        Self {
            origin: origin.map(str::to_owned),
            line,
            column,
            field,
            message,
        }
    }
}

impl fmt::Display for FileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(origin) = &self.origin {
            write!(f, "{origin}:")?;
        }
        if self.line > 0 {
            write!(f, "{}:{}: ", self.line, self.column)?;
        } else if self.origin.is_some() {
            f.write_str(" ")?;
        }
        if self.field.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.field, self.message)
        }
    }
}

impl std::error::Error for FileError {}

/// The text of the file at `path`; an error names the file.
pub(super) fn read_text(path: &Path) -> Result<String, FileError> {
    std::fs::read_to_string(path).map_err(|e| FileError {
        origin: Some(path.display().to_string()),
        line: 0,
        column: 0,
        field: String::new(),
        message: format!("cannot read the file: {e}"),
    })
}

/// The most bytes a network list file may hold.
const MAX_LIST_BYTES: u64 = 64 << 20;
/// The most bytes a `[geoip]` database may hold.
const MAX_DATABASE_BYTES: u64 = 1 << 30;

/// The list whose entry (or service-wide limit) holds `name` in `taken`,
/// if one does.
fn taken_by<'a>(taken: &[(&'a str, &str)], name: &str) -> Option<&'a str> {
    taken
        .iter()
        .find(|(_, n)| *n == name)
        .map(|(list, _)| *list)
}

/// The files a policy names, resolved against its directory (`dir`, the
/// policy file's; the working directory for a text without one): the
/// network lists (allow, deny) and the `[geoip]` databases (asn,
/// country), in that order.
fn named_files(spec: &spec::FileSpec, dir: Option<&Path>) -> [Option<std::path::PathBuf>; 4] {
    let at = |f: Option<&spec::Spanned<String>>| {
        f.map(|f| match dir {
            Some(d) => d.join(f.get_ref()),
            None => std::path::PathBuf::from(f.get_ref()),
        })
    };
    let access = spec.access.as_ref().map(spec::Spanned::get_ref);
    let geoip = spec.geoip.as_ref().map(spec::Spanned::get_ref);
    [
        at(access.and_then(|a| a.allow_networks_file.as_ref())),
        at(access.and_then(|a| a.deny_networks_file.as_ref())),
        at(geoip.and_then(|g| g.asn.as_ref())),
        at(geoip.and_then(|g| g.country.as_ref())),
    ]
}

/// The stamps of the `[geoip]` databases `spec` names (see [`stamps`]).
fn database_stamps(spec: &spec::FileSpec, dir: Option<&Path>) -> String {
    let [_, _, asn, country] = named_files(spec, dir);
    stamps(&[None, None, asn, country])
}

/// What a poll compares of the files a policy names, without reading
/// them: each one's length and modification time (or why it cannot be
/// read).
fn stamps(files: &[Option<std::path::PathBuf>; 4]) -> String {
    let mut out = String::new();
    for path in files.iter().flatten() {
        let stamp = match std::fs::metadata(path) {
            Ok(m) => format!("{}:{:?}", m.len(), m.modified().ok()),
            Err(e) => e.kind().to_string(),
        };
        out.push_str(&format!("\0{}\0{stamp}", path.display()));
    }
    out
}

/// Reads a file the policy names: a regular file of at most `max` bytes
/// (never a device, a pipe or a directory, which could hang or fill the
/// reload). Errors name the path, never the contents.
fn read_named(path: &Path, max: u64) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let cannot = |e: &dyn std::fmt::Display| format!("cannot read {}: {e}", path.display());
    let meta = std::fs::metadata(path).map_err(|e| cannot(&e))?;
    if !meta.is_file() {
        return Err(cannot(&"not a regular file"));
    }
    if meta.len() > max {
        return Err(cannot(&format_args!("larger than {} MiB", max >> 20)));
    }
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(max).read_to_end(&mut bytes))
        .map_err(|e| cannot(&e))?;
    Ok(bytes)
}

/// Reads the files the policy names into the spec: the network lists
/// (text) and, with the `geoip` feature, the databases.
fn read_files(spec: &mut spec::FileSpec, files: &[Option<std::path::PathBuf>; 4]) {
    let [allow, deny, asn, country] = files;
    if let Some(access) = spec.access.as_mut().map(spec::Spanned::get_mut) {
        for (path, loaded) in [allow, deny].into_iter().zip(access.loaded.iter_mut()) {
            *loaded = path.as_ref().map(|p| {
                read_named(p, MAX_LIST_BYTES).and_then(|b| {
                    String::from_utf8(b).map_err(|_| format!("{}: not text", p.display()))
                })
            });
        }
    }
    if let Some(geoip) = spec.geoip.as_mut().map(spec::Spanned::get_mut) {
        for (i, (path, loaded)) in [asn, country]
            .into_iter()
            .zip(geoip.loaded.iter_mut())
            .enumerate()
        {
            let Some(path) = path else { continue };
            #[cfg(feature = "geoip")]
            {
                let field = if i == 0 {
                    crate::key::GeoField::Asn
                } else {
                    crate::key::GeoField::Country
                };
                *loaded = Some(read_named(path, MAX_DATABASE_BYTES).and_then(|b| {
                    crate::key::GeoIp::from_bytes(b, field).map_err(|e| e.message().to_owned())
                }));
            }
            #[cfg(not(feature = "geoip"))]
            {
                let _ = (i, path, MAX_DATABASE_BYTES);
                *loaded = Some(Err("[geoip] needs tollgate's geoip feature".to_owned()));
            }
        }
    }
}

/// The 1-based line and column (in characters) of byte `offset`.
fn position(text: &str, offset: usize) -> (usize, usize) {
    let before = text.get(..offset).unwrap_or(text);
    let line = before.matches('\n').count().saturating_add(1);
    let start = before.rfind('\n').map_or(0, |i| i.saturating_add(1));
    let column = before
        .get(start..)
        .map_or(0, |l| l.chars().count())
        .saturating_add(1);
    (line, column)
}

impl PolicyFile {
    /// Parses and checks a policy file's text. Everything that can be
    /// checked without a store is checked here.
    pub fn parse(text: &str) -> Result<Self, FileError> {
        Self::parse_from(text, None)
    }

    /// Reads and parses the file at `path`; errors start with the path.
    pub fn read(path: impl AsRef<Path>) -> Result<Self, FileError> {
        let path = path.as_ref();
        Self::parse_from(&read_text(path)?, Some(path.display().to_string()))
    }

    fn parse_from(text: &str, origin: Option<String>) -> Result<Self, FileError> {
        let file = Self::parse_unchecked(text, origin)?;
        file.check::<()>(|b| b)?;
        Ok(file)
    }

    /// Parses `text` and checks its fields, but does not build it (the
    /// caller checks the build, e.g. with its own customisation).
    pub(super) fn parse_unchecked(text: &str, origin: Option<String>) -> Result<Self, FileError> {
        let mut file = Self::parse_shape(text, origin)?;
        let files = named_files(&file.spec, file.dir());
        read_files(&mut file.spec, &files);
        Ok(file)
    }

    /// Parses `text` without reading the files it names (their stamps
    /// only: what a poll compares).
    pub(super) fn parse_shape(text: &str, origin: Option<String>) -> Result<Self, FileError> {
        let spec: spec::FileSpec =
            toml::from_str(text).map_err(|e| build::serde_error(text, origin.as_deref(), &e))?;
        let mut file = Self {
            spec,
            text: text.to_owned(),
            origin,
            stamps: String::new(),
        };
        file.stamps = stamps(&named_files(&file.spec, file.dir()));
        Ok(file)
    }

    /// Where the files the text names are: the policy file's directory.
    fn dir(&self) -> Option<&Path> {
        self.origin.as_deref().and_then(|o| Path::new(o).parent())
    }

    /// The stamps of its `[geoip]` databases, as they are now.
    pub(super) fn database_stamps(&self) -> String {
        database_stamps(&self.spec, self.dir())
    }

    /// The text and the stamps of the files it names (length and
    /// modification time): what a reload compares to tell whether
    /// anything changed.
    pub(super) fn watched(&self) -> String {
        format!("{}{}", self.text, self.stamps)
    }

    /// Checks everything a store does not decide by building the file's
    /// policy (with `customize`'s additions) on a throwaway memory store,
    /// recording no metrics. A file whose rules name plans but that sets
    /// no `plan_from` passes: the plan source may come from code (a
    /// closure); [`layer`](Self::layer) refuses it if none does.
    pub(crate) fn check<B>(
        &self,
        customize: impl FnOnce(
            crate::policy::PolicyLayerBuilder<B, crate::MemoryStore>,
        ) -> crate::policy::PolicyLayerBuilder<B, crate::MemoryStore>,
    ) -> Result<(), FileError> {
        // The challenge secret is read when the policy is built for real:
        // a check on another machine (`tollgate-check`) needs only the
        // file's shape.
        let mut b = build::builder::<B>(&self.spec, build::Secrets::Placeholder)
            .map_err(|p| self.placed(p))?;
        if self.spec.plan_from.is_none() {
            b = b.plan_from_extension();
        }
        let b = customize(b);
        metrics::with_local_recorder(&metrics::NoopRecorder, || b.build())
            .map(drop)
            .map_err(|e| self.config_error(&e))?;
        if let Some(st) = &self.spec.store {
            store::plan(st).map_err(|p| self.placed(p))?;
        }
        self.server()?;
        // Every other limit, built on a throwaway store: each name once
        // in its list.
        // Names are one store's: a quota named like a rule would be
        // refused by the store the layers share.
        let mut taken: Vec<(&str, &str)> = names(&self.spec.rules, |r| &r.name)
            .into_iter()
            .map(|n| ("rules", n))
            .collect();
        for (list, names) in [
            ("quotas", self.quota_names()),
            ("concurrency", self.concurrency_names()),
            ("bandwidth", self.bandwidth_names()),
            ("retry_budgets", self.retry_budget_names()),
        ] {
            for (i, name) in names.iter().enumerate() {
                if let Some(other) = taken_by(&taken, name) {
                    let e = tollgate_core::ConfigError::new(
                        "name",
                        format!("the name {name:?} is taken by another entry of [[{other}]]"),
                    );
                    return Err(self.config_error(&e.in_item(list, i)));
                }
                taken.push((list, name));
                self.check_entry(list, i)?
                    .map_err(|e| self.config_error(&e.in_item(list, i)))?;
            }
        }
        // A fixed service-wide limit's name is one store's too: two
        // entries' limits of one name would count each other's requests,
        // each against its own limit. (An adaptive limit counts in the
        // process, each entry its own.)
        for (i, c) in self.spec.concurrency.iter().enumerate() {
            let Some(service) = &c.get_ref().service else {
                continue;
            };
            let name = &service.get_ref().name;
            if let Some(other) = taken_by(&taken, name.get_ref()) {
                return Err(self.placed((
                    Some(name.span()),
                    format!("concurrency[{i}].service.name"),
                    format!(
                        "the name {:?} is taken by another entry of [[{other}]] or its service-wide limit",
                        name.get_ref()
                    ),
                )));
            }
            taken.push(("concurrency", name.get_ref()));
        }
        Ok(())
    }

    /// Trusts `ranges` (CIDRs) as proxies for `client-ip` keys when the
    /// file names none itself (`trusted_proxies`): e.g. from the
    /// environment of a server whose file is shared across deployments.
    /// Errors name `trusted_proxies`.
    pub fn default_trusted_proxies(mut self, ranges: &[String]) -> Result<Self, FileError> {
        if self.spec.trusted_proxies.is_none() && !ranges.is_empty() {
            self.spec.trusted_proxies = Some(spec::Spanned::new(0..0, ranges.to_vec()));
            self.builder::<()>()?;
        }
        Ok(self)
    }

    /// The text the file was read from.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Builds the file's policy on `store`.
    pub fn layer<B, St: tollgate_core::Store>(
        &self,
        store: &St,
    ) -> Result<crate::policy::PolicyLayer<B, St>, FileError> {
        self.audit_stream(store, self.builder::<B>()?.store(store.clone()))?
            .build()
            .map_err(|e| self.config_error(&e))
    }

    /// `b` with `[audit] stream` as its audit sink: a Redis stream of
    /// `store`, which must be a Redis store (the file's `[store]`, or a
    /// `RedisStore` given to the layer); `b` as it is without `stream`.
    pub(crate) fn audit_stream<B, St: tollgate_core::Store>(
        &self,
        store: &St,
        b: crate::policy::PolicyLayerBuilder<B, St>,
    ) -> Result<crate::policy::PolicyLayerBuilder<B, St>, FileError> {
        let Some(audit) = &self.spec.audit else {
            return Ok(b);
        };
        // A sink set in code stays.
        if !b.audits_as_the_file_says() {
            return Ok(b);
        }
        let Some((stream, maxlen, queue)) =
            build::audit_stream(audit.get_ref()).map_err(|p| self.placed(p))?
        else {
            return Ok(b);
        };
        let a = audit.get_ref();
        let rules: Vec<&str> = a.rules.get_ref().iter().map(String::as_str).collect();
        let span = a.stream.as_ref().map(spec::Spanned::span);
        #[cfg(feature = "redis")]
        {
            let any = store as &dyn std::any::Any;
            let redis = any.downcast_ref::<crate::RedisStore>().or_else(|| {
                any.downcast_ref::<crate::AnyStore>()
                    .and_then(crate::AnyStore::redis)
            });
            if let Some(redis) = redis {
                let sink = redis.audit_stream(stream, maxlen, queue).map_err(|e| {
                    // The store's `capacity` is the file's `queue`.
                    let field = match e.field() {
                        "capacity" => "queue",
                        f => f,
                    };
                    self.placed((
                        span.clone(),
                        format!("audit.{field}"),
                        e.message().to_owned(),
                    ))
                })?;
                return Ok(b.audit(sink, &rules));
            }
        }
        #[cfg(not(feature = "redis"))]
        let _ = (store, rules);
        Err(self.placed((
            span,
            "audit.stream".to_owned(),
            format!(
                "a Redis stream needs a Redis store: [store] kind = \"redis\", or a RedisStore or AnyStore of one given to the layer (this one is a {})",
                std::any::type_name::<St>()
            ),
        )))
    }

    /// What the file declares, one line per limit, in the file's words:
    /// its rules, quotas, in-flight limits and pacing, each with its key
    /// and numbers (for `tollgate-check`, and for logs at start).
    pub fn describe(&self) -> Vec<String> {
        use std::fmt::Write as _;
        let value = |v: &toml::Value| match v {
            toml::Value::String(s) => s.clone(),
            toml::Value::Integer(n) => n.to_string(),
            toml::Value::Float(x) => x.to_string(),
            toml::Value::Boolean(b) => b.to_string(),
            _ => "(a table)".to_owned(),
        };
        let plans = |names: Vec<&String>| {
            if names.is_empty() {
                String::new()
            } else {
                let names: Vec<&str> = names.iter().map(|n| n.as_str()).collect();
                format!("; plans {}", names.join(", "))
            }
        };
        // Where a limit applies: the routes it names, else every route.
        let scope = |routes: &Option<spec::Spanned<Vec<spec::Spanned<String>>>>| match routes {
            Some(list) => {
                let list: Vec<&str> = list
                    .get_ref()
                    .iter()
                    .map(|r| r.get_ref().as_str())
                    .collect();
                format!("; on {}", list.join(", "))
            }
            None => String::new(),
        };
        let mut lines = Vec::new();
        for r in &self.spec.rules {
            let r = r.get_ref();
            let mut line = format!(
                "rule {:?}: key {}; {}",
                r.name.get_ref(),
                r.key.get_ref(),
                r.algorithm
                    .as_ref()
                    .map_or("gcra", |a| a.get_ref().as_str())
            );
            if let Some(rate) = &r.rate {
                let _ = write!(line, " {}", rate.get_ref());
            }
            if let Some(burst) = &r.burst {
                let _ = write!(line, ", burst {}", burst.get_ref());
            }
            if let Some(c) = &r.cost {
                let _ = write!(line, "; cost {}", value(c.get_ref()));
            }
            line.push_str(&plans(r.plans.keys().collect()));
            line.push_str(&scope(&r.routes));
            lines.push(line);
        }
        for q in &self.spec.quotas {
            let q = q.get_ref();
            let limits: Vec<String> = q
                .limits
                .get_ref()
                .iter()
                .map(|(p, n)| format!("{n} a {p}", n = n.get_ref()))
                .collect();
            let mut line = format!(
                "quota {:?}: key {}; {}",
                q.name.get_ref(),
                q.key.get_ref(),
                limits.join(", ")
            );
            if let Some(c) = &q.cost {
                let _ = write!(line, "; cost {}", value(c.get_ref()));
            }
            if let Some(z) = &q.zone {
                let _ = write!(line, "; zone {}", z.get_ref());
            }
            line.push_str(&plans(q.plans.keys().collect()));
            line.push_str(&scope(&q.routes));
            lines.push(line);
        }
        for c in &self.spec.concurrency {
            let c = c.get_ref();
            let mut line = format!(
                "in flight {:?}: key {}; at most {} per key",
                c.name.get_ref(),
                c.key.get_ref(),
                c.max.get_ref()
            );
            if let Some(q) = &c.queue {
                let q = q.get_ref();
                let _ = write!(
                    line,
                    "; queue {} for {}",
                    q.max_len.get_ref(),
                    q.max_wait.get_ref()
                );
            }
            if let Some(sv) = &c.service {
                let sv = sv.get_ref();
                let _ = write!(
                    line,
                    "; service {:?} at most {}",
                    sv.name.get_ref(),
                    sv.max.get_ref()
                );
            }
            if let Some(a) = &c.adaptive {
                let a = a.get_ref();
                let _ = write!(
                    line,
                    "; service {:?} adaptive ({}) from {} to {}, starting at {}",
                    a.name.get_ref(),
                    a.algorithm.get_ref(),
                    a.min.get_ref(),
                    a.max.get_ref(),
                    a.initial.get_ref()
                );
            }
            line.push_str(&plans(c.plans.keys().collect()));
            line.push_str(&scope(&c.routes));
            lines.push(line);
        }
        for w in &self.spec.bandwidth {
            let w = w.get_ref();
            let bytes = |v: &toml::Value, unit: &str| match v {
                toml::Value::Integer(n) => format!("{n} bytes{unit}"),
                other => value(other),
            };
            lines.push(format!(
                "bandwidth {:?}: key {}; {}, bursts of {}; {}{}",
                w.name.get_ref(),
                w.key.get_ref(),
                bytes(w.rate.get_ref(), "/s"),
                bytes(w.burst.get_ref(), ""),
                w.direction
                    .as_ref()
                    .map_or("responses", |d| d.get_ref().as_str()),
                scope(&w.routes)
            ));
        }
        for r in &self.spec.retry_budgets {
            let r = r.get_ref();
            let mut line = format!(
                "retry budget {:?}: key {}",
                r.name.get_ref(),
                r.key.as_ref().map_or("upstream", |k| k.get_ref().as_str())
            );
            if let Some(ratio) = &r.ratio {
                let _ = write!(line, "; ratio {}", ratio.get_ref());
            }
            if let Some(n) = &r.max_attempts {
                let _ = write!(line, "; at most {} attempts", n.get_ref());
            }
            lines.push(line);
        }
        lines
    }

    /// The store the file's `[store]` section describes: the in-memory
    /// store (the default, also without the section), or Redis, its URL
    /// read from the file (`url`, which may not hold a password), an
    /// environment variable (`url_env`) or a file (`url_file`), as is the
    /// key secret (`key_secret_env`). A Redis store starts its connection
    /// task on the current Tokio runtime. Errors name the field, never a
    /// secret.
    ///
    /// ```toml
    /// [store]
    /// kind = "redis"
    /// url_env = "REDIS_URL"           # redis://, rediss://, redis+sentinel://, a Cluster's list
    /// prefix = "my-service"
    /// failure_policy = "fallback/4"   # open, closed, fallback, fallback/N instances
    /// timeout = "50ms"
    /// ```
    pub fn store(&self) -> Result<crate::AnyStore, FileError> {
        let plan = store::plan_of(self.spec.store.as_ref()).map_err(|p| self.placed(p))?;
        store::build(&plan).map_err(|(field, message)| {
            let span = self.spec.store.as_ref().map(spec::Spanned::span);
            FileError::at(&self.text, self.origin.as_deref(), span, field, message)
        })
    }

    /// What `[server]` says: where `tollgate-server` listens. Errors name
    /// the field (an address that is not `host:port` with an IP).
    pub fn server(&self) -> Result<ServerSettings, FileError> {
        let Some(server) = &self.spec.server else {
            return Ok(ServerSettings::default());
        };
        let addr = |v: &Option<spec::Spanned<String>>, field: &str| {
            v.as_ref()
                .map(|a| {
                    a.get_ref()
                        .trim()
                        .parse::<std::net::SocketAddr>()
                        .map_err(|_| {
                            self.placed((
                                Some(a.span()),
                                format!("server.{field}"),
                                format!(
                                    "{:?} is not an address like \"127.0.0.1:8081\"",
                                    a.get_ref()
                                ),
                            ))
                        })
                })
                .transpose()
        };
        let s = server.get_ref();
        let path = |v: &spec::Spanned<String>, field: &str| {
            if v.get_ref().trim().is_empty() {
                return Err(self.placed((
                    Some(v.span()),
                    format!("server.tls.{field}"),
                    "must name a file".to_owned(),
                )));
            }
            Ok(std::path::PathBuf::from(v.get_ref()))
        };
        let tls = match &s.tls {
            None => None,
            Some(t) => {
                let t = t.get_ref();
                Some(TlsFiles {
                    cert_file: path(&t.cert_file, "cert_file")?,
                    key_file: path(&t.key_file, "key_file")?,
                    client_ca_file: t
                        .client_ca_file
                        .as_ref()
                        .map(|c| path(c, "client_ca_file"))
                        .transpose()?,
                })
            }
        };
        Ok(ServerSettings {
            listen: addr(&s.listen, "listen")?,
            metrics: addr(&s.metrics, "metrics")?,
            grpc: addr(&s.grpc, "grpc")?,
            envoy: s.envoy.iter().map(std::path::PathBuf::from).collect(),
            tls,
        })
    }

    /// Whether `other`'s `[store]` describes the same store as this
    /// file's (checked plans compared: a default written out, or a
    /// duration written otherwise, is the same store).
    pub(crate) fn same_store(&self, other: &Self) -> bool {
        let plan = |f: &Self| store::plan_of(f.spec.store.as_ref());
        match (plan(self), plan(other)) {
            (Ok(a), Ok(b)) => a == b,
            _ => self.spec.store == other.spec.store,
        }
    }

    /// The names of the file's `[[quotas]]`, in the file's order.
    pub fn quota_names(&self) -> Vec<&str> {
        names(&self.spec.quotas, |q| &q.name)
    }

    /// The names of the file's `[[concurrency]]` limits, in order.
    pub fn concurrency_names(&self) -> Vec<&str> {
        names(&self.spec.concurrency, |c| &c.name)
    }

    /// The names of the file's `[[bandwidth]]` limits, in order.
    pub fn bandwidth_names(&self) -> Vec<&str> {
        names(&self.spec.bandwidth, |b| &b.name)
    }

    /// The calendar quota the file declares as the `[[quotas]]` entry
    /// named `name`, on `store` (a [`QuotaLayer`](crate::QuotaLayer)).
    /// Errors name the entry's line and field; an unknown name names
    /// `quotas`.
    pub fn quota<St: tollgate_core::QuotaStore>(
        &self,
        name: &str,
        store: &St,
    ) -> Result<crate::QuotaLayer<FileKey, FileCost, St>, FileError> {
        let i = self.entry("quotas", &self.quota_names(), name)?;
        let b = build::quota(&self.spec, i).map_err(|p| self.placed(p))?;
        b.store(store.clone())
            .build()
            .map_err(|e| self.config_error(&e.in_item("quotas", i)))
    }

    /// The in-flight limits the file declares as the `[[concurrency]]`
    /// entry named `name`, on `store` (a
    /// [`ConcurrencyLayer`](crate::ConcurrencyLayer)). Errors as
    /// [`quota`](Self::quota)'s.
    pub fn concurrency<St: tollgate_core::Store>(
        &self,
        name: &str,
        store: &St,
    ) -> Result<
        crate::ConcurrencyLayer<FileKey, FileCost, crate::concurrency::AllCritical, St>,
        FileError,
    > {
        let i = self.entry("concurrency", &self.concurrency_names(), name)?;
        let b = build::concurrency(&self.spec, i).map_err(|p| self.placed(p))?;
        b.store(store.clone())
            .build()
            .map_err(|e| self.config_error(&e.in_item("concurrency", i)))
    }

    /// The pacing the file declares as the `[[bandwidth]]` entry named
    /// `name`, on `store` (a
    /// [`BandwidthLayer`](crate::bandwidth::BandwidthLayer)). Errors as
    /// [`quota`](Self::quota)'s.
    pub fn bandwidth<St: tollgate_core::Store>(
        &self,
        name: &str,
        store: &St,
    ) -> Result<crate::bandwidth::BandwidthLayer<FileKey, St>, FileError> {
        let i = self.entry("bandwidth", &self.bandwidth_names(), name)?;
        let b = build::bandwidth(&self.spec, i).map_err(|p| self.placed(p))?;
        b.store(store.clone())
            .build()
            .map_err(|e| self.config_error(&e.in_item("bandwidth", i)))
    }

    /// The names of the file's `[[retry_budgets]]`, in order.
    pub fn retry_budget_names(&self) -> Vec<&str> {
        names(&self.spec.retry_budgets, |r| &r.name)
    }

    /// The retry budget the file declares as the `[[retry_budgets]]`
    /// entry named `name`, on `store` (a
    /// [`RetryBudgetLayer`](crate::RetryBudgetLayer), for a client's
    /// stack). Errors as [`quota`](Self::quota)'s.
    ///
    /// ```toml
    /// [[retry_budgets]]
    /// name = "payments-api"
    /// key = "upstream"                  # the default: one budget per upstream host
    /// ratio = 0.1                       # retries at most 10 % of calls...
    /// min_per_second = 5                # ...plus 5 a second
    /// window = "10s"
    /// max_attempts = 3
    /// backoff = { base = "50ms", cap = "2s" }
    /// deadline = "5s"
    /// retry_on = ["error", 502, 503, 504, "UNAVAILABLE"]
    /// ```
    pub fn retry_budget<St: tollgate_core::RetryBudgetStore>(
        &self,
        name: &str,
        store: &St,
    ) -> Result<crate::RetryBudgetLayer<RetryKey, St>, FileError> {
        let i = self.entry("retry_budgets", &self.retry_budget_names(), name)?;
        let b = build::retry_budget(&self.spec, i).map_err(|p| self.placed(p))?;
        b.store(store.clone())
            .build()
            .map_err(|e| self.config_error(&e.in_item("retry_budgets", i)))
    }

    /// The sections a reload does not apply that differ from `before`'s
    /// (`[[quotas]]`, `[[concurrency]]`, `[[bandwidth]]`, and `[costs]`
    /// where any of them names one).
    pub(crate) fn unapplied_changes(&self, before: &Self) -> Vec<&'static str> {
        let (a, b) = (&self.spec, &before.spec);
        let mut changed: Vec<&'static str> = [
            (a.quotas != b.quotas, "[[quotas]]"),
            (a.concurrency != b.concurrency, "[[concurrency]]"),
            (a.bandwidth != b.bandwidth, "[[bandwidth]]"),
            (!self.same_store(before), "[store]"),
            (a.retry_budgets != b.retry_budgets, "[[retry_budgets]]"),
            (a.server != b.server, "[server]"),
        ]
        .into_iter()
        .filter_map(|(differs, section)| differs.then_some(section))
        .collect();
        let others = !a.quotas.is_empty() || !a.concurrency.is_empty() || !a.bandwidth.is_empty();
        if others && a.costs != b.costs {
            changed.push("[costs]");
        }
        changed
    }

    /// Builds entry `i` of `[[list]]` on a throwaway memory store,
    /// recording no metrics: the file's problem, or the builder's error.
    fn check_entry(
        &self,
        list: &str,
        i: usize,
    ) -> Result<Result<(), tollgate_core::ConfigError>, FileError> {
        let quiet = &metrics::NoopRecorder;
        Ok(match list {
            "quotas" => {
                let b = build::quota(&self.spec, i).map_err(|p| self.placed(p))?;
                metrics::with_local_recorder(quiet, || b.build().map(drop))
            }
            "concurrency" => {
                let b = build::concurrency(&self.spec, i).map_err(|p| self.placed(p))?;
                metrics::with_local_recorder(quiet, || b.build().map(drop))
            }
            "bandwidth" => {
                let b = build::bandwidth(&self.spec, i).map_err(|p| self.placed(p))?;
                metrics::with_local_recorder(quiet, || b.build().map(drop))
            }
            _ => {
                let b = build::retry_budget(&self.spec, i).map_err(|p| self.placed(p))?;
                metrics::with_local_recorder(quiet, || b.build().map(drop))
            }
        })
    }

    /// The index of the `[[list]]` entry named `name`.
    fn entry(&self, list: &str, names: &[&str], name: &str) -> Result<usize, FileError> {
        names
            .iter()
            .position(|n| *n == name)
            .ok_or_else(|| FileError {
                origin: self.origin.clone(),
                line: 0,
                column: 0,
                field: list.to_owned(),
                message: format!("no [[{list}]] entry is named {name:?}"),
            })
    }

    /// A problem, placed in the file.
    fn placed(&self, (span, field, message): build::Problem) -> FileError {
        FileError::at(&self.text, self.origin.as_deref(), span, field, message)
    }

    /// A builder holding everything the file declares, on a new memory
    /// store: add what a file cannot hold (a rejection, an audit sink, a
    /// plan closure), set the store, and build. Errors of `build` map back
    /// to the file with [`config_error`](Self::config_error). `[audit]
    /// stream` needs the store, so this builder records to the log: the
    /// stream is attached by [`layer`](Self::layer), [`Reloader::load`]
    /// and [`Tollgate`].
    pub fn builder<B>(
        &self,
    ) -> Result<crate::policy::PolicyLayerBuilder<B, crate::MemoryStore>, FileError> {
        build::builder(&self.spec, build::Secrets::Read).map_err(|(span, field, message)| {
            FileError::at(&self.text, self.origin.as_deref(), span, field, message)
        })
    }

    /// Places a builder's [`ConfigError`](tollgate_core::ConfigError)
    /// in the file: at the rule it names
    /// ([`ConfigError::item`](tollgate_core::ConfigError::item)), or the
    /// file.
    pub fn config_error(&self, e: &tollgate_core::ConfigError) -> FileError {
        build::config_error(&self.spec, e)
            .map(|(span, field, message)| {
                FileError::at(&self.text, self.origin.as_deref(), span, field, message)
            })
            .unwrap_or_else(|| FileError {
                origin: self.origin.clone(),
                line: 0,
                column: 0,
                field: e.field().to_owned(),
                message: e.message().to_owned(),
            })
    }
}

#[cfg(feature = "schema")]
fn without_null(v: &mut serde_json::Value) {
    use serde_json::Value;
    match v {
        Value::Object(map) => {
            if map.get("default") == Some(&Value::Null) {
                map.remove("default");
            }
            if let Some(Value::Array(types)) = map.get_mut("type") {
                types.retain(|t| t != "null");
                if let [only] = types.as_slice() {
                    let only = only.clone();
                    map.insert("type".into(), only);
                }
            }
            if let Some(Value::Array(any)) = map.get_mut("anyOf") {
                any.retain(|a| a.get("type").is_none_or(|t| t != "null"));
                if let [only] = any.as_slice() {
                    let only = only.clone();
                    map.remove("anyOf");
                    if let Value::Object(inner) = only {
                        for (k, val) in inner {
                            map.entry(k).or_insert(val);
                        }
                    }
                }
            }
            map.values_mut().for_each(without_null);
        }
        Value::Array(items) => items.iter_mut().for_each(without_null),
        _ => {}
    }
}

/// Where `tollgate-server` listens, as the file's `[server]` says
/// ([`PolicyFile::server`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServerSettings {
    /// The decision endpoints' address.
    pub listen: Option<std::net::SocketAddr>,
    /// Where `/metrics` is served (on `listen` if `None`).
    pub metrics: Option<std::net::SocketAddr>,
    /// Where Envoy's rate limit service (gRPC) listens.
    pub grpc: Option<std::net::SocketAddr>,
    /// The Envoy ratelimit configuration files it decides by.
    pub envoy: Vec<std::path::PathBuf>,
    /// TLS on `listen` and `grpc` (`[server.tls]`).
    pub tls: Option<TlsFiles>,
}

/// `[server.tls]`: the files `tollgate-server` reads when it starts (they
/// are not read to check a policy file).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TlsFiles {
    /// The certificate chain (PEM), the server's own first.
    pub cert_file: std::path::PathBuf,
    /// Its private key (PEM).
    pub key_file: std::path::PathBuf,
    /// CA certificates (PEM) a client's certificate must be signed by
    /// (mutual TLS); `None` serves every client.
    pub client_ca_file: Option<std::path::PathBuf>,
}

/// A JSON Schema (draft 2020-12) of the policy file, generated from the
/// types that read it: editors that read JSON Schema (through
/// taplo's `#:schema` directive or Even Better TOML's settings) check a
/// file while it is written. The crate ships it as `policy.schema.json`.
/// It describes the file's shape: names, types, which fields each entry
/// takes; the bounds a value must keep and how entries refer to each
/// other are checked when the file loads ([`PolicyFile::parse`],
/// `tollgate-check`).
/// TOML has no null: an optional field is one left out, so the schema's
/// `null` alternatives (of `Option` fields) and `null` defaults go.
#[cfg(feature = "schema")]
pub fn json_schema() -> String {
    let mut schema = schemars::schema_for!(spec::FileSpec);
    schema.insert("title".into(), "tollgate policy file".into());
    schema.insert(
        "description".into(),
        "Every limit of a service: [[rules]], [[quotas]], [[concurrency]], [[bandwidth]], \
         [[retry_budgets]], [store] (see the tollgate crate's `config` module)"
            .into(),
    );
    let mut value = schema.to_value();
    without_null(&mut value);
    let mut text = serde_json::to_string_pretty(&value).unwrap_or_default();
    text.push('\n');
    text
}

/// The names of `list`'s entries (`name` reads one).
fn names<T>(list: &[spec::Spanned<T>], name: impl Fn(&T) -> &spec::Spanned<String>) -> Vec<&str> {
    list.iter()
        .map(|e| name(e.get_ref()).get_ref().as_str())
        .collect()
}

#[cfg(test)]
mod tests;
