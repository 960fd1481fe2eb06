//! One layer for everything a policy file declares.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use arc_swap::ArcSwap;
use axum::body::Body;
use http::{Request, Response};
use tollgate_core::{QuotaStore, Store};
use tower_layer::Layer;
use tower_service::Service;

use super::{build, FileCost, FileError, FileKey, PolicyFile};
use crate::bandwidth::BandwidthLayer;
use crate::concurrency::AllCritical;
use crate::policy::{PolicyLayer, PolicyLayerBuilder, PolicyService};
use crate::{BoxError, ConcurrencyLayer, MemoryStore, QuotaLayer, Routes};

type Quota<St> = QuotaLayer<FileKey, FileCost, St>;
type InFlight<St> = ConcurrencyLayer<FileKey, FileCost, AllCritical, St>;
type Pacing<St> = BandwidthLayer<FileKey, St>;

/// Every limit a policy file declares, in one Tower layer: the access
/// lists and `[[rules]]` (one [`PolicyLayer`]), then each
/// `[[concurrency]]` entry, then each `[[quotas]]` entry, then each
/// `[[bandwidth]]` entry, in the file's order. Cheap refusals outside,
/// lasting charges inside: a request refused by a limit goes no further
/// in, so it spends nothing of the limits after it (a request refused
/// for want of a permit costs no quota, not even a store call to charge
/// and refund it); a limit scoped to other `routes` is passed by without
/// a word.
///
/// Reloads ([`reloader`](Self::reloader)) apply to every section at once:
/// the rules as [`Reloader`](super::Reloader) applies them, and the other
/// limits rebuilt on the same store, where an unchanged limit keeps its
/// state (its counts, its permits held) and a changed one goes on from
/// it.
///
/// Requests of any body are taken, and handed on as axum's [`Body`]
/// (boxed once; an axum body is handed on as it is), which an axum
/// `Router` and a tonic service both take; responses are a [`Body`]
/// too. The layer fits an axum `Router` (`layer` or `route_layer`), a
/// tonic `Server::builder().layer(..)`, and any Tower stack over HTTP.
///
/// ```
/// use tollgate::config::{PolicyFile, Tollgate};
/// use tollgate::MemoryStore;
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let file = PolicyFile::parse(r#"
/// [[rules]]
/// name = "per-ip"
/// key = "client-ip"
/// rate = "10/s"
/// burst = 20
///
/// [[quotas]]
/// name = "daily"
/// key = "client-ip"
/// limits = { day = 1000 }
///
/// [[concurrency]]
/// name = "downloads"
/// key = "client-ip"
/// max = 2
/// routes = ["GET /download"]
/// "#)?;
/// let gate = Tollgate::new(&file, &MemoryStore::new())?;
/// let app: axum::Router = axum::Router::new()
///     .route("/", axum::routing::get(|| async { "hi" }))
///     .route("/download", axum::routing::get(|| async { "a file" }))
///     .route_layer(gate);
/// # let _ = app;
/// # Ok(())
/// # }
/// ```
pub struct Tollgate<St: Store + QuotaStore> {
    policy: PolicyLayer<Body, St>,
    limits: Arc<ArcSwap<Limits<St>>>,
    /// Whether two limits read one key: each request then reads each key
    /// once ([`Extracted`](super::parts::Extracted)).
    remember: Arc<AtomicBool>,
    /// Rules and quotas only ([`for_decisions`](Self::for_decisions)).
    decisions_only: bool,
}

impl<St: Store + QuotaStore> Clone for Tollgate<St> {
    fn clone(&self) -> Self {
        Self {
            policy: self.policy.clone(),
            limits: Arc::clone(&self.limits),
            remember: Arc::clone(&self.remember),
            decisions_only: self.decisions_only,
        }
    }
}

impl<St: Store + QuotaStore> fmt::Debug for Tollgate<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tollgate")
            .field("rules", &self.policy.rule_names())
            .field("limits", &self.limits.load().names())
            .finish()
    }
}

/// The limits after the rules, in the order a request meets them.
pub(super) struct Limits<St: Store + QuotaStore> {
    limits: Box<[Scoped<St>]>,
    /// The file they were built from, as prepared (a reloader's `prepare`
    /// applied): a reload keeps the limits whose entries did not change.
    spec: super::spec::FileSpec,
    /// The stamps of the `[geoip]` databases it named: a limit keyed by
    /// a database's answer is built again when they change (a network
    /// list's change keeps it).
    stamps: String,
}

struct Scoped<St: Store + QuotaStore> {
    /// Where the limit applies (`None`: everywhere); the layer checks it
    /// too, this skips building its service for other routes.
    routes: Option<Routes>,
    /// The entry's list (`quotas`) and name.
    list: &'static str,
    name: String,
    limit: Limit<St>,
}

impl<St: Store + QuotaStore> Clone for Limit<St> {
    fn clone(&self) -> Self {
        match self {
            Self::Quota(l) => Self::Quota(l.clone()),
            Self::InFlight(l) => Self::InFlight(l.clone()),
            Self::Pacing(l) => Self::Pacing(l.clone()),
        }
    }
}

/// Whether what every limit after the rules reads beyond its own entry
/// (client addresses, plans, named costs, headers) is the same in both.
fn same_context(a: &super::spec::FileSpec, b: &super::spec::FileSpec) -> bool {
    // What keys read beyond their text: trusted proxies, forwarded
    // header, IPv6 prefix, `[geoip]` databases.
    a.key_context() == b.key_context()
        && a.plan_from == b.plan_from
        && a.on_store_error == b.on_store_error
        && a.costs == b.costs
        && a.headers == b.headers
        && a.legacy_headers == b.legacy_headers
        && a.route_label == b.route_label
}

enum Limit<St: Store + QuotaStore> {
    Quota(Quota<St>),
    InFlight(InFlight<St>),
    Pacing(Pacing<St>),
}

impl<St: Store + QuotaStore> Limits<St> {
    /// Bit `i`: limit `i` (of the first 64) applies to `req`. The
    /// request's path is read once for every limit's routes.
    fn applying_to<B>(&self, req: &Request<B>) -> u64 {
        let mut target = None;
        // The last routes matched, and their answer: limits of one scope
        // share theirs, and follow one another in the usual file.
        let mut last: Option<(&Routes, bool)> = None;
        let mut bits = 0u64;
        for (i, s) in self.limits.iter().take(64).enumerate() {
            let applies = match &s.routes {
                None => true,
                Some(r) => match last {
                    Some((seen, applies)) if seen.is(r) => applies,
                    _ => {
                        let target = target.get_or_insert_with(|| crate::routes::Target::of(req));
                        let applies = r.matches_target(target);
                        last = Some((r, applies));
                        applies
                    }
                },
            };
            if applies {
                bits |= 1u64
                    .checked_shl(u32::try_from(i).unwrap_or(u32::MAX))
                    .unwrap_or(0);
            }
        }
        bits
    }

    fn names(&self) -> Vec<&str> {
        self.limits.iter().map(|s| s.name.as_str()).collect()
    }

    /// Builds every limit after the rules that `file` declares, on
    /// `store`.
    pub(super) fn build(
        file: &PolicyFile,
        store: &St,
        before: Option<&Self>,
        decisions_only: bool,
    ) -> Result<Self, FileError> {
        let spec = &file.spec;
        if decisions_only {
            let left: Vec<&str> = (spec
                .concurrency
                .iter()
                .map(|c| c.get_ref().name.get_ref().as_str()))
            .chain(
                spec.bandwidth
                    .iter()
                    .map(|b| b.get_ref().name.get_ref().as_str()),
            )
            .collect();
            if !left.is_empty() {
                tracing::warn!(
                    target: "tollgate::config",
                    limits = %left.join(", "),
                    "in-flight limits and pacing need to see the response: a decision endpoint \
                     leaves them out"
                );
            }
        }
        // A decision endpoint never sees a response: no in-flight limits
        // or pacing.
        let mut out = Vec::new();
        // Read once (file metadata), for every entry keyed by a database.
        let stamps = file.database_stamps();
        let mut section = |list, entries, build: &dyn Fn(&str) -> Result<Limit<St>, FileError>| {
            entries_of(file, &stamps, before, list, entries, build, &mut out)
        };
        section(
            "concurrency",
            Entries::InFlight(if decisions_only {
                &[][..]
            } else {
                &spec.concurrency
            }),
            &|name| file.concurrency(name, store).map(Limit::InFlight),
        )?;
        section("quotas", Entries::Quota(&spec.quotas), &|name| {
            file.quota(name, store).map(Limit::Quota)
        })?;
        section(
            "bandwidth",
            Entries::Pacing(if decisions_only {
                &[][..]
            } else {
                &spec.bandwidth
            }),
            &|name| file.bandwidth(name, store).map(Limit::Pacing),
        )?;
        Ok(Self {
            limits: out.into(),
            spec: spec.clone(),
            stamps,
        })
    }
}

/// Refuses what a decision alone cannot do: what needs the response (a
/// rule's `count_if`, `charge_after`), the connection (`messages`) or the
/// body (`[idempotency]`, costs by `bytes_per_unit`).
fn decidable(file: &PolicyFile) -> Result<(), FileError> {
    let spec = &file.spec;
    let never = |span, field: String, why: &str| {
        Err(file.placed((
            Some(span),
            field,
            format!("{why}: a decision endpoint never sees it"),
        )))
    };
    for (i, r) in spec.rules.iter().enumerate() {
        let r = r.get_ref();
        if let Some(c) = &r.count_if {
            return never(
                c.span(),
                format!("rules[{i}].count_if"),
                "counts by the response's status",
            );
        }
        if let Some(c) = &r.charge_after {
            return never(
                c.span(),
                format!("rules[{i}].charge_after"),
                "charges what the response cost",
            );
        }
        if let Some(m) = r.messages.as_ref().filter(|m| *m.get_ref()) {
            return never(
                m.span(),
                format!("rules[{i}].messages"),
                "counts an upgraded connection's messages",
            );
        }
    }
    if let Some(idem) = &spec.idempotency {
        return never(
            idem.span(),
            "idempotency".to_owned(),
            "tells repeats apart by the request's body",
        );
    }
    let by_bytes = |v: &toml::Value| {
        v.as_table()
            .is_some_and(|t| t.contains_key("bytes_per_unit"))
    };
    for (name, cost) in &spec.costs {
        if by_bytes(cost.get_ref()) {
            return never(
                cost.span(),
                format!("costs.{name}.bytes_per_unit"),
                "charges by the body's length",
            );
        }
    }
    let inline = spec
        .rules
        .iter()
        .enumerate()
        .filter_map(|(i, r)| {
            r.get_ref()
                .cost
                .as_ref()
                .map(|c| (format!("rules[{i}].cost"), c))
        })
        .chain(spec.quotas.iter().enumerate().filter_map(|(i, q)| {
            q.get_ref()
                .cost
                .as_ref()
                .map(|c| (format!("quotas[{i}].cost"), c))
        }));
    for (field, cost) in inline {
        if by_bytes(cost.get_ref()) {
            return never(
                cost.span(),
                format!("{field}.bytes_per_unit"),
                "charges by the body's length",
            );
        }
    }
    Ok(())
}

/// One section's entries, as the file holds them.
enum Entries<'a> {
    InFlight(&'a [super::spec::Spanned<super::spec::ConcurrencySpec>]),
    Quota(&'a [super::spec::Spanned<super::spec::QuotaSpec>]),
    Pacing(&'a [super::spec::Spanned<super::spec::BandwidthSpec>]),
}

type RoutesSpec = Option<super::spec::Spanned<Vec<super::spec::Spanned<String>>>>;

impl Entries<'_> {
    /// Entry `i`'s name and routes.
    fn entry(&self, i: usize) -> Option<(&String, &RoutesSpec)> {
        match self {
            Self::InFlight(e) => e
                .get(i)
                .map(|e| (e.get_ref().name.get_ref(), &e.get_ref().routes)),
            Self::Quota(e) => e
                .get(i)
                .map(|e| (e.get_ref().name.get_ref(), &e.get_ref().routes)),
            Self::Pacing(e) => e
                .get(i)
                .map(|e| (e.get_ref().name.get_ref(), &e.get_ref().routes)),
        }
    }

    /// Whether entry `i`'s key reads a `[geoip]` database.
    fn reads_databases(&self, i: usize) -> bool {
        let key = match self {
            Self::InFlight(e) => e.get(i).map(|e| &e.get_ref().key),
            Self::Quota(e) => e.get(i).map(|e| &e.get_ref().key),
            Self::Pacing(e) => e.get(i).map(|e| &e.get_ref().key),
        };
        key.is_some_and(|k| {
            super::spec::key_parts(k.get_ref())
                .iter()
                .flatten()
                .any(|p| matches!(*p, "asn" | "country"))
        })
    }

    fn len(&self) -> usize {
        match self {
            Self::InFlight(e) => e.len(),
            Self::Quota(e) => e.len(),
            Self::Pacing(e) => e.len(),
        }
    }

    /// Whether `old` holds entry `i` as it is.
    fn unchanged_in(&self, i: usize, old: &super::spec::FileSpec) -> bool {
        fn holds<T: PartialEq>(
            list: &[super::spec::Spanned<T>],
            e: Option<&super::spec::Spanned<T>>,
        ) -> bool {
            e.is_some_and(|e| list.iter().any(|o| o.get_ref() == e.get_ref()))
        }
        match self {
            Self::InFlight(e) => holds(&old.concurrency, e.get(i)),
            Self::Quota(e) => holds(&old.quotas, e.get(i)),
            Self::Pacing(e) => holds(&old.bandwidth, e.get(i)),
        }
    }
}

/// Builds `entries` of `[[list]]` into `out`, each with its routes; on a
/// reload, an entry that neither changed nor reads anything that changed
/// beyond it keeps the limit `before` built, which goes on as it runs (its
/// in-process state — an adaptive limit, a queue, read-only mode; store
/// state is kept either way). `stamps`: the `[geoip]` databases' now (an
/// entry keyed by one is built again when they differ from `before`'s).
fn entries_of<St: Store + QuotaStore>(
    file: &PolicyFile,
    stamps: &str,
    before: Option<&Limits<St>>,
    list: &'static str,
    entries: Entries<'_>,
    build: &dyn Fn(&str) -> Result<Limit<St>, FileError>,
    out: &mut Vec<Scoped<St>>,
) -> Result<(), FileError> {
    for i in 0..entries.len() {
        let Some((name, routes)) = entries.entry(i) else {
            continue;
        };
        let kept = before
            .filter(|b| same_context(&b.spec, &file.spec) && entries.unchanged_in(i, &b.spec))
            // A database read anew (its file changed) answers anew.
            .filter(|b| !(entries.reads_databases(i) && b.stamps != stamps))
            .and_then(|b| b.limits.iter().find(|s| s.list == list && s.name == *name))
            .map(|s| s.limit.clone());
        let limit = match kept {
            Some(limit) => limit,
            None => build(name)?,
        };
        let routes = routes
            .as_ref()
            .map(|l| build::routes(l, format!("{list}[{i}].routes")))
            .transpose()
            .map_err(|p| file.placed(p))?
            // Limits of one scope share its routes: a request is matched
            // against them once.
            .map(|r| {
                out.iter()
                    .filter_map(|s| s.routes.as_ref())
                    .fold(r, |r, seen| r.shared_with(seen))
            });
        out.push(Scoped {
            routes,
            list,
            name: name.clone(),
            limit,
        });
    }
    Ok(())
}

impl<St: Store + QuotaStore> Tollgate<St> {
    /// Every limit `file` declares, on `store`. Errors name the file's
    /// line and field. The file's `[store]`, if any, is not read: the
    /// limits run on `store` ([`from_file`](Self::from_file) builds the
    /// file's).
    pub fn new(file: &PolicyFile, store: &St) -> Result<Self, FileError> {
        Self::with(file, store, |b| b)
    }

    /// [`new`](Self::new), with what a file cannot hold added to the
    /// rules' builder (a rejection, an audit sink, a plan closure). Give
    /// a [`reloader`](Self::reloader) the same closure, so that a reload
    /// keeps them.
    pub fn with<F>(file: &PolicyFile, store: &St, customize: F) -> Result<Self, FileError>
    where
        F: Fn(PolicyLayerBuilder<Body, MemoryStore>) -> PolicyLayerBuilder<Body, MemoryStore>,
    {
        let policy = file
            .audit_stream(
                store,
                customize(file.builder::<Body>()?).store(store.clone()),
            )?
            .build()
            .map_err(|e| file.config_error(&e))?;
        let limits = Limits::build(file, store, None, false)?;
        Ok(Self {
            policy,
            limits: Arc::new(ArcSwap::from_pointee(limits)),
            remember: Arc::new(AtomicBool::new(super::parts::reads_repeat(
                &file.spec, false,
            ))),
            decisions_only: false,
        })
    }

    /// The limits of `file` that a decision alone can enforce — its rules
    /// and quotas — for a decision endpoint that sees a request but never
    /// its response (`tollgate-server`, behind a gateway's
    /// `auth_request`). In-flight limits and pacing need the response's
    /// lifetime: they are left out, and said so in the log.
    ///
    /// What needs the response or the body is refused, naming its field:
    /// a rule's `count_if` (the status it counts is never seen),
    /// `[idempotency]` (its markers hash the body), a cost by
    /// `bytes_per_unit` (the body's length).
    pub fn for_decisions(file: &PolicyFile, store: &St) -> Result<Self, FileError> {
        decidable(file)?;
        let policy = file
            .audit_stream(store, file.builder::<Body>()?.store(store.clone()))?
            .build()
            .map_err(|e| file.config_error(&e))?;
        let limits = Limits::build(file, store, None, true)?;
        Ok(Self {
            policy,
            limits: Arc::new(ArcSwap::from_pointee(limits)),
            remember: Arc::new(AtomicBool::new(super::parts::reads_repeat(
                &file.spec, true,
            ))),
            decisions_only: true,
        })
    }

    /// The rules' layer, which this one runs first (its rule names, its
    /// limiters).
    pub fn policy(&self) -> &PolicyLayer<Body, St> {
        &self.policy
    }

    /// The names of the limits after the rules, in the order a request
    /// meets them: in-flight limits, quotas, pacing.
    pub fn limit_names(&self) -> Vec<String> {
        self.limits
            .load()
            .names()
            .into_iter()
            .map(str::to_owned)
            .collect()
    }

    /// The running in-flight limit of the `[[concurrency]]` entry named
    /// `name` (for its [`adaptive_limit`](crate::ConcurrencyLayer::adaptive_limit),
    /// [`limiter`](crate::ConcurrencyLayer::limiter)): the one a reload
    /// put in place.
    pub fn concurrency(&self, name: &str) -> Option<InFlight<St>> {
        self.limits
            .load()
            .limits
            .iter()
            .find_map(|s| match &s.limit {
                Limit::InFlight(l) if s.name == name => Some(l.clone()),
                _ => None,
            })
    }

    /// The running quota of the `[[quotas]]` entry named `name` (for its
    /// [`usage_for`](crate::QuotaLayer::usage_for) and
    /// [`limiter`](crate::QuotaLayer::limiter), a support tool's view).
    pub fn quota(&self, name: &str) -> Option<Quota<St>> {
        self.limits
            .load()
            .limits
            .iter()
            .find_map(|s| match &s.limit {
                Limit::Quota(l) if s.name == name => Some(l.clone()),
                _ => None,
            })
    }

    /// A [`Reloader`](super::Reloader) that keeps this layer in step with
    /// the file at `path` (which `file` was read from): every section
    /// applies on reload. `customize` as given to [`with`](Self::with)
    /// (`|b| b` for none).
    pub fn reloader<F>(
        &self,
        path: impl AsRef<std::path::Path>,
        file: &PolicyFile,
        store: St,
        customize: F,
    ) -> super::Reloader<Body, St>
    where
        F: Fn(PolicyLayerBuilder<Body, MemoryStore>) -> PolicyLayerBuilder<Body, MemoryStore>
            + Send
            + Sync
            + 'static,
        St: Send + Sync + 'static,
    {
        let limits = Arc::clone(&self.limits);
        let remember = Arc::clone(&self.remember);
        let decisions_only = self.decisions_only;
        super::Reloader::new(path, file, store, &self.policy)
            .customize(customize)
            .with_audit_stream()
            .also(move |file, store, fresh| {
                if decisions_only {
                    decidable(file)?;
                }
                // On a new store, no limit carries over (its state, and
                // its handles, are the old store's).
                let before = limits.load();
                let before = (!fresh).then_some(&**before);
                let next = Limits::build(file, store, before, decisions_only)?;
                let repeat = super::parts::reads_repeat(&file.spec, decisions_only);
                let (limits, remember) = (Arc::clone(&limits), Arc::clone(&remember));
                Ok(Box::new(move || {
                    limits.store(Arc::new(next));
                    remember.store(repeat, Ordering::Relaxed);
                }))
            })
    }
}

/// What [`Tollgate::decisions_from_file`] starts: the limits, their
/// reloader, and the store they start on.
pub type Started = (
    Tollgate<crate::AnyStore>,
    super::Reloader<Body, crate::AnyStore>,
    crate::AnyStore,
);

impl Tollgate<crate::AnyStore> {
    /// Everything the file at `path` declares, the store included
    /// (`[store]`; the in-memory store without it), and a
    /// [`Reloader`](super::Reloader) for it: call
    /// [`spawn`](super::Reloader::spawn) to reload on SIGHUP and on
    /// change. Call it inside a Tokio runtime (a Redis store starts its
    /// connection task). Every section applies on reload, `[store]`
    /// included: a changed `[store]` is built (a store that cannot be,
    /// e.g. its URL's variable unset, refuses the reload and the running
    /// policy stays) and every limit moves to it, counting there from
    /// what it holds (nothing, for a store new to this service: bursts
    /// and quotas start whole). Requests under way finish on the store
    /// they started on, so until they end the new store does not count
    /// their permits; leases the old store holds go back to it. A
    /// `[store]` that reads differently but means the same (a default
    /// written out) is no change.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use tollgate::config::Tollgate;
    ///
    /// # async fn run() -> Result<(), tollgate::config::FileError> {
    /// let (gate, reloader) = Tollgate::from_file("policy.toml")?;
    /// reloader.spawn(Duration::from_secs(2));
    /// let app: axum::Router = axum::Router::new()
    ///     .route("/", axum::routing::get(|| async { "hi" }))
    ///     .route_layer(gate);
    /// # let _ = app;
    /// # Ok(())
    /// # }
    /// ```
    pub fn from_file(
        path: impl AsRef<std::path::Path>,
    ) -> Result<(Self, super::Reloader<Body, crate::AnyStore>), FileError> {
        let path = path.as_ref();
        let file = PolicyFile::read(path)?;
        let (gate, reloader, _) = Self::from_file_as(path, &file, false, |_| Ok(()), |_| {})?;
        Ok((gate, reloader))
    }

    /// [`from_file`](Self::from_file) for a decision server, from `file`
    /// (read from `path`): [`for_decisions`](Self::for_decisions)'s limits
    /// (what a decision cannot hold is refused), and two hooks for
    /// whatever else decides on the file's store (an Envoy rate limit
    /// service): a reload that changes `[store]` asks `check` whether it
    /// can move to the new store (an error refuses the reload, naming
    /// `store`, before anything moved), then calls `moved` with it once
    /// the limits moved. Returns the store the limits start on.
    pub fn decisions_from_file<C, M>(
        path: impl AsRef<std::path::Path>,
        file: &PolicyFile,
        check: C,
        moved: M,
    ) -> Result<Started, FileError>
    where
        C: Fn(&crate::AnyStore) -> Result<(), String> + Send + Sync + 'static,
        M: Fn(&crate::AnyStore) + Send + Sync + 'static,
    {
        Self::from_file_as(path.as_ref(), file, true, check, moved)
    }

    /// [`from_file`](Self::from_file), or [`decisions_from_file`](Self::decisions_from_file)
    /// when `decisions`; and the store the limits start on.
    fn from_file_as<C, M>(
        path: &std::path::Path,
        file: &PolicyFile,
        decisions: bool,
        check: C,
        moved: M,
    ) -> Result<Started, FileError>
    where
        C: Fn(&crate::AnyStore) -> Result<(), String> + Send + Sync + 'static,
        M: Fn(&crate::AnyStore) + Send + Sync + 'static,
    {
        let store = file.store()?;
        let gate = if decisions {
            Self::for_decisions(file, &store)?
        } else {
            Self::new(file, &store)?
        };
        let reloader = gate.reloader(path, file, store.clone(), |b| b).restore(
            move |file: &PolicyFile| {
                let store = file.store()?;
                check(&store).map_err(|m| {
                    file.config_error(&crate::ConfigError::new(
                        "store",
                        format!("the new store cannot be moved to: {m}"),
                    ))
                })?;
                Ok(store)
            },
            move |old: crate::AnyStore, new: &crate::AnyStore| {
                moved(new);
                // Leases the old store still holds go back to it, not lapse.
                if let (true, Ok(rt)) = (old.is_leased(), tokio::runtime::Handle::try_current()) {
                    drop(rt.spawn(async move { old.give_back().await }));
                }
            },
        );
        Ok((gate, reloader, store))
    }
}

impl<S, St> Layer<S> for Tollgate<St>
where
    St: Store + QuotaStore,
{
    type Service = TollgateService<PolicyService<Next<S, St>, Body, St>>;

    fn layer(&self, inner: S) -> Self::Service {
        TollgateService {
            inner: AnyBody(self.policy.layer(Next {
                inner,
                limits: Arc::clone(&self.limits),
                now: None,
                from: 0,
                applies: 0,
            })),
            remember: Arc::clone(&self.remember),
        }
    }
}

/// A [`Tollgate`]'s service: it takes a request of any body, handed on
/// as a [`Body`] ([`AnyBody`]), and where two of its limits read one key
/// it has the request read each key once.
#[derive(Clone)]
pub struct TollgateService<N> {
    inner: AnyBody<N>,
    remember: Arc<AtomicBool>,
}

impl<N: fmt::Debug> fmt::Debug for TollgateService<N> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.fmt(f)
    }
}

impl<N, B, ResB> Service<Request<B>> for TollgateService<N>
where
    AnyBody<N>: Service<Request<B>, Response = Response<ResB>>,
{
    type Response = Response<ResB>;
    type Error = <AnyBody<N> as Service<Request<B>>>::Error;
    type Future = TollgateFuture<<AnyBody<N> as Service<Request<B>>>::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        if self.remember.load(Ordering::Relaxed) {
            req.extensions_mut().insert(super::parts::Extracted::new());
        }
        TollgateFuture {
            inner: self.inner.call(req),
        }
    }
}

pin_project_lite::pin_project! {
    /// The future of a [`TollgateService`]: its limits' `RateLimit` and
    /// `RateLimit-Policy` items are joined into each field once, as the
    /// response leaves (each limit adding to the field another had set
    /// built it again, once a limit).
    pub struct TollgateFuture<F> {
        #[pin]
        inner: F,
    }
}

impl<F: fmt::Debug> fmt::Debug for TollgateFuture<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.fmt(f)
    }
}

impl<F, ResB, E> Future for TollgateFuture<F>
where
    F: Future<Output = Result<Response<ResB>, E>>,
{
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // The limits add their items in the poll that hands the response
        // on; the service they protect adds at once ([`AtOnce`]).
        let deferred = crate::headers::Deferred::start();
        let mut polled = self.project().inner.poll(cx);
        if let Some(deferred) = deferred {
            match &mut polled {
                Poll::Ready(Ok(response)) => deferred.finish(response.headers_mut()),
                // Our limits add items only in the poll that hands the
                // response on (one that awaited after adding them would
                // lose them here: the tests run with this check).
                Poll::Pending => {
                    debug_assert!(deferred.holds_none(), "items held back, no response")
                }
                Poll::Ready(Err(_)) => {}
            }
        }
        polled
    }
}

pin_project_lite::pin_project! {
    /// The protected service's future, polled with our fields' items added
    /// at once (its layers, and what reads their fields, see them as
    /// anywhere else).
    struct AtOnce<F> {
        #[pin]
        inner: F,
    }
}

impl<F: Future> Future for AtOnce<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let _at_once = crate::headers::AtOnce::start();
        self.project().inner.poll(cx)
    }
}

/// The rest of a [`Tollgate`] after the rules: the limits from `from` on,
/// then the service. Each limit's service is made for the request (a
/// layer's service is a few `Arc`s), its future boxed.
pub struct Next<S, St: Store + QuotaStore> {
    inner: S,
    limits: Arc<ArcSwap<Limits<St>>>,
    /// The limits this request started with: a reload meanwhile changes
    /// the next request, not this one.
    now: Option<Arc<Limits<St>>>,
    from: usize,
    /// Bit `i`: limit `i` applies to this request (its routes read once,
    /// by the first `Next`); limits from 64 on are matched where met.
    applies: u64,
}

impl<S: Clone, St: Store + QuotaStore> Clone for Next<S, St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            limits: Arc::clone(&self.limits),
            now: self.now.clone(),
            from: self.from,
            applies: self.applies,
        }
    }
}

impl<S, St: Store + QuotaStore> fmt::Debug for Next<S, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Next")
            .field("from", &self.from)
            .finish_non_exhaustive()
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, St, ResB> Service<Request<Body>> for Next<S, St>
where
    S: Service<Request<Body>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResB: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
    St: Store + QuotaStore,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Response<Body>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // The protected service's code adds items at once (see `AtOnce`).
        let _at_once = crate::headers::AtOnce::start();
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let (limits, applies) = match &self.now {
            Some(now) => (Arc::clone(now), self.applies),
            None => {
                let limits = self.limits.load_full();
                let applies = limits.applying_to(&req);
                (limits, applies)
            }
        };
        // The service made ready goes on with the request.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let found = limits
            .limits
            .iter()
            .enumerate()
            .skip(self.from)
            .find(|(i, s)| match u32::try_from(*i) {
                Ok(bit) if bit < 64 => applies.checked_shr(bit).is_some_and(|b| b & 1 == 1),
                _ => Routes::applies(s.routes.as_ref(), &req),
            });
        let Some((at, scoped)) = found else {
            // The keys remembered are these limits' reading of the
            // request: the service, and any layer in it (which may see
            // another path, under a nested router), reads its own.
            let mut req = req;
            req.extensions_mut().remove::<super::parts::Extracted>();
            let mut inner = inner;
            let call = {
                let _at_once = crate::headers::AtOnce::start();
                AtOnce {
                    inner: inner.call(req),
                }
            };
            return Box::pin(async move { Ok(call.await?.map(Body::new)) });
        };
        let next = Next {
            inner,
            limits: Arc::clone(&self.limits),
            now: Some(Arc::clone(&limits)),
            from: at.saturating_add(1),
            applies,
        };
        match &scoped.limit {
            Limit::Quota(l) => Box::pin(call_now(l.layer(next), req)),
            Limit::InFlight(l) => {
                let call = call_now(l.layer(next), req);
                Box::pin(async move { Ok(call.await?.map(Body::new)) })
            }
            Limit::Pacing(l) => {
                let call = call_now(l.layer(AnyBody(next)), req);
                Box::pin(async move { Ok(call.await?.map(Body::new)) })
            }
        }
    }
}

pin_project_lite::pin_project! {
    /// [`call_now`]'s future: the call's, or, for a service not ready at
    /// once, one that waits until it is and then calls.
    #[project = CalledProj]
    enum Called<F, O> {
        Now { #[pin] call: F },
        Later { call: BoxFuture<O> },
    }
}

/// Calls `svc` with `req` at once if it is ready now (the usual case: a
/// limit's service is ready when the rest of the chain is, which its
/// caller made ready), else once it is ([`oneshot`]). Where it is ready,
/// neither the service nor the request is moved into a future of their
/// own (a copy of both per limit per request otherwise).
fn call_now<S, R>(mut svc: S, req: R) -> Called<S::Future, Result<S::Response, S::Error>>
where
    S: Service<R> + Send + 'static,
    S::Future: Send + 'static,
    S::Response: Send + 'static,
    S::Error: Send + 'static,
    R: Send + 'static,
{
    let mut cx = Context::from_waker(std::task::Waker::noop());
    match svc.poll_ready(&mut cx) {
        Poll::Ready(Ok(())) => Called::Now {
            call: svc.call(req),
        },
        Poll::Ready(Err(e)) => Called::Later {
            call: Box::pin(std::future::ready(Err(e))),
        },
        // Polled again, with the caller's waker, by `oneshot`.
        Poll::Pending => Called::Later {
            call: Box::pin(oneshot(svc, req)),
        },
    }
}

impl<F: Future> Future for Called<F, F::Output> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            CalledProj::Now { call } => call.poll(cx),
            CalledProj::Later { call } => call.as_mut().poll(cx),
        }
    }
}

/// A service called once it is ready: the future of `S::call` after
/// `S::poll_ready`.
async fn oneshot<S, R>(mut svc: S, req: R) -> Result<S::Response, S::Error>
where
    S: Service<R>,
{
    std::future::poll_fn(|cx| svc.poll_ready(cx)).await?;
    svc.call(req).await
}

/// A request body of any kind, as the rest of the stack takes it: a
/// [`Body`] (axum's, which boxes any other once and an axum body not at
/// all). What a pacing layer hands on (its paced body) goes on as a
/// [`Body`] this way.
#[derive(Clone)]
pub struct AnyBody<N>(N);

impl<N: fmt::Debug> fmt::Debug for AnyBody<N> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl<N, B> Service<Request<B>> for AnyBody<N>
where
    N: Service<Request<Body>>,
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = N::Response;
    type Error = N::Error;
    type Future = N::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        self.0.call(req.map(Body::new))
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::time::Duration;

    use http::StatusCode;
    use tollgate_core::ManualClock;
    use tower::{service_fn, ServiceExt};

    use super::*;

    const FILE: &str = r#"
[[rules]]
name = "rate"
key = "header:x-api-key"
rate = "1/s"
burst = 2

[[quotas]]
name = "daily"
key = "header:x-api-key"
limits = { day = 3 }

[[concurrency]]
name = "slow"
key = "header:x-api-key"
max = 1
routes = ["GET /slow"]
"#;

    /// A body that never ends: a response that holds what it holds.
    struct Open;

    impl http_body::Body for Open {
        type Data = bytes::Bytes;
        type Error = Infallible;
        fn poll_frame(
            self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, Infallible>>> {
            Poll::Pending
        }
    }

    fn app(
        gate: &Tollgate<MemoryStore<ManualClock>>,
    ) -> impl Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Clone {
        gate.layer(service_fn(|r: Request<Body>| async move {
            Ok::<_, Infallible>(if r.uri().path() == "/slow" {
                Response::new(Body::new(Open))
            } else {
                Response::new(Body::from("ok"))
            })
        }))
    }

    fn req(path: &str, key: &str) -> Request<Body> {
        Request::get(path)
            .header("x-api-key", key)
            .body(Body::empty())
            .unwrap()
    }

    fn store(clock: &ManualClock) -> MemoryStore<ManualClock> {
        MemoryStore::builder().clock(clock.clone()).build().unwrap()
    }

    /// What `rule`'s item of the `RateLimit` field says is left.
    fn left(res: &Response<Body>, rule: &str) -> Option<u64> {
        let field = res.headers().get("ratelimit")?.to_str().ok()?;
        let item = field
            .split(", ")
            .find(|i| i.starts_with(&format!("{rule:?};")))?;
        item.split(';')
            .find_map(|p| p.strip_prefix("r="))?
            .parse()
            .ok()
    }

    async fn send<S>(svc: &S, r: Request<Body>) -> Response<Body>
    where
        S: Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Clone,
    {
        svc.clone().oneshot(r).await.unwrap()
    }

    #[tokio::test]
    async fn one_layer_stacks_rules_then_in_flight_limits_then_quotas() {
        // Noon UTC: no day ends during the test.
        let clock = ManualClock::starting_at(1_796_472_000_000_000_000);
        let file = PolicyFile::parse(FILE).unwrap();
        let gate = Tollgate::new(&file, &store(&clock)).unwrap();
        assert_eq!(gate.limit_names(), ["slow", "daily"]);
        let svc = app(&gate);
        // The burst of 2 passes and draws on the day's 3; the third is
        // refused by the rate, before the quota: it costs none of the day.
        let r = send(&svc, req("/a", "k")).await;
        assert_eq!((r.status(), left(&r, "daily")), (StatusCode::OK, Some(2)));
        assert_eq!(send(&svc, req("/a", "k")).await.status(), StatusCode::OK);
        let r = send(&svc, req("/a", "k")).await;
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        clock.advance(Duration::from_secs(1));
        // One request a second from here: the day's last unit, then the
        // quota refuses.
        let r = send(&svc, req("/a", "k")).await;
        assert_eq!((r.status(), left(&r, "daily")), (StatusCode::OK, Some(0)));
        clock.advance(Duration::from_secs(1));
        let r = send(&svc, req("/a", "k")).await;
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert!(r.headers().get("retry-after").is_some());
        // The in-flight limit applies to GET /slow alone: one open
        // response there refuses a second, not a request elsewhere.
        let held = send(&svc, req("/slow", "s")).await;
        assert_eq!(held.status(), StatusCode::OK);
        clock.advance(Duration::from_secs(1));
        let r = send(&svc, req("/slow", "s")).await;
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        clock.advance(Duration::from_secs(1));
        assert_eq!(send(&svc, req("/a", "s")).await.status(), StatusCode::OK);
        // The permit goes back with the body.
        drop(held);
        clock.advance(Duration::from_secs(1));
        assert_eq!(send(&svc, req("/slow", "s")).await.status(), StatusCode::OK);
    }

    /// A composed layer builds each field once, as its limits' items
    /// joined one after another would read: the outermost first, then
    /// each inner one, then the lines the service sent. A layer inside the
    /// service sees its own limits' fields at once, as anywhere else.
    #[tokio::test]
    async fn each_field_is_built_once_and_the_service_sees_its_own_at_once() {
        use crate::key::Header;
        use tollgate_core::{Limit, Rate};
        let clock = ManualClock::starting_at(1_796_472_000_000_000_000);
        let file = PolicyFile::parse(FILE).unwrap();
        let gate = Tollgate::new(&file, &store(&clock)).unwrap();
        // The service: a handler that sends a field of its own (two
        // lines), behind a rate limit of its own, behind a layer that
        // copies what it sees of `RateLimit` into `x-seen`.
        let handler = service_fn(|_r: Request<Body>| async move {
            let mut res = Response::new(Body::from("ok"));
            res.headers_mut()
                .append("ratelimit", http::HeaderValue::from_static("\"svc\";r=5"));
            res.headers_mut()
                .append("ratelimit", http::HeaderValue::from_static("\"svc2\";r=6"));
            Ok::<_, Infallible>(res)
        });
        let own = crate::RateLimitLayer::builder("own", Limit::gcra(Rate::per_second(1), 9))
            .key(Header::named("x-api-key").unwrap())
            .store(store(&clock))
            .build()
            .unwrap();
        let seen = tower::util::MapResponseLayer::new(|mut res: Response<Body>| {
            let seen = res
                .headers()
                .get_all("ratelimit")
                .iter()
                .cloned()
                .collect::<Vec<_>>();
            for v in seen {
                res.headers_mut().append("x-seen", v);
            }
            res
        });
        let inner = seen.layer(own.layer(handler));
        let svc = gate.layer(
            tower::util::MapResponseLayer::new(|r: Response<_>| r.map(Body::new)).layer(inner),
        );
        let res = svc.clone().oneshot(req("/a", "k")).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        let lines = |name: &str| {
            res.headers()
                .get_all(name)
                .iter()
                .map(|v| v.to_str().unwrap().to_owned())
                .collect::<Vec<_>>()
        };
        // The service's own limit joined its item with the handler's at
        // once: the layer above it saw one line.
        assert_eq!(
            lines("x-seen"),
            ["\"own\";r=8;t=1, \"svc\";r=5, \"svc2\";r=6"]
        );
        // The composed layer's limits lead, outermost first: the rule,
        // then the day's quota; then the service's line.
        let field = lines("ratelimit");
        assert_eq!(field.len(), 1, "{field:?}");
        let names: Vec<&str> = field[0]
            .split(", ")
            .map(|item| item.split(';').next().unwrap())
            .collect();
        assert_eq!(
            names,
            ["\"rate\"", "\"daily\"", "\"own\"", "\"svc\"", "\"svc2\""]
        );
        let policy = lines("ratelimit-policy");
        assert_eq!(policy.len(), 1, "{policy:?}");
        assert!(policy[0].starts_with("\"rate\";q=2"), "{policy:?}");
    }

    /// Limits of one scope share its routes, matched once per request;
    /// a scope written alike but for its method, or another path, is its
    /// own.
    #[tokio::test]
    async fn limits_of_one_scope_share_its_routes() {
        let clock = ManualClock::starting_at(1_796_472_000_000_000_000);
        let mut text = FILE.to_owned();
        for (i, routes) in [r#"["/a"]"#, r#"["/a"]"#, r#"["GET /a"]"#, r#"["/b"]"#]
            .iter()
            .enumerate()
        {
            text.push_str(&format!(
                "\n[[quotas]]\nname = \"q{i}\"\nkey = \"global\"\nlimits = {{ day = 9 }}\nroutes = {routes}\n"
            ));
        }
        let file = PolicyFile::parse(&text).unwrap();
        let gate = Tollgate::new(&file, &store(&clock)).unwrap();
        let limits = gate.limits.load_full();
        let scope = |name: &str| {
            let s = limits.limits.iter().find(|s| s.name == name).unwrap();
            s.routes.as_ref().unwrap().clone()
        };
        assert!(scope("q0").is(&scope("q1")));
        assert!(!scope("q0").is(&scope("q2")) && !scope("q0").is(&scope("q3")));
        let svc = app(&gate);
        let items = |r: &Response<Body>| {
            ["q0", "q1", "q2", "q3"]
                .into_iter()
                .filter(|q| left(r, q).is_some())
                .collect::<Vec<_>>()
        };
        let mut post = req("/a", "post");
        *post.method_mut() = http::Method::POST;
        // (A key each: the file's rule allows two at once.)
        assert_eq!(
            items(&send(&svc, req("/a", "get")).await),
            ["q0", "q1", "q2"]
        );
        assert_eq!(items(&send(&svc, post).await), ["q0", "q1"]);
        assert_eq!(items(&send(&svc, req("/b", "b")).await), ["q3"]);
        assert!(items(&send(&svc, req("/c", "c")).await).is_empty());
    }

    /// Routes are read once per request for the first 64 limits, and
    /// where met for the rest: both scope alike.
    #[tokio::test]
    async fn limits_past_the_sixty_fourth_are_scoped_too() {
        let clock = ManualClock::starting_at(1_796_472_000_000_000_000);
        let mut text = FILE.to_owned();
        for i in 0..70 {
            text.push_str(&format!(
                "\n[[quotas]]\nname = \"q{i}\"\nkey = \"global\"\nlimits = {{ day = 1 }}\nroutes = [\"/q{i}\"]\n"
            ));
        }
        let file = PolicyFile::parse(&text).unwrap();
        let gate = Tollgate::new(&file, &store(&clock)).unwrap();
        let svc = app(&gate);
        for path in ["/q0", "/q63", "/q64", "/q69"] {
            let key = format!("key-{path}");
            assert_eq!(send(&svc, req(path, &key)).await.status(), StatusCode::OK);
            clock.advance(Duration::from_secs(1));
            let r = send(&svc, req(path, &key)).await;
            assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS, "{path}");
            clock.advance(Duration::from_secs(1));
        }
        // Elsewhere, none of them: only the rule and the day's quota.
        let r = send(&svc, req("/q", "other")).await;
        assert_eq!(r.status(), StatusCode::OK);
        let field = r.headers()["ratelimit"].to_str().unwrap();
        assert!(!field.contains("\"q"), "{field}");
    }

    /// Review of the composed layer: a reload keeps the limits whose
    /// entries did not change as they run — an adaptive limit what it
    /// learned — and builds the changed ones afresh.
    #[tokio::test]
    async fn a_reload_keeps_an_unchanged_limits_process_state() {
        let clock = ManualClock::starting_at(1_796_472_000_000_000_000);
        let text = format!(
            "{FILE}\n[[concurrency]]\nname = \"adaptive\"\nkey = \"header:x-api-key\"\nmax = 100\nadaptive = {{ name = \"svc\", algorithm = \"aimd\", min = 1, initial = 8, max = 16 }}\n"
        );
        let dir = std::env::temp_dir().join(format!("tollgate-keep-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("policy.toml");
        std::fs::write(&path, &text).unwrap();
        // Proxies trusted from outside the file, as the quickstart does:
        // applied to every file read (review: a reload compared the
        // prepared file with the raw one and kept nothing).
        let proxies = ["10.0.0.0/8".to_owned()];
        let file = PolicyFile::read(&path)
            .unwrap()
            .default_trusted_proxies(&proxies)
            .unwrap();
        let st = store(&clock);
        let gate = Tollgate::new(&file, &st).unwrap();
        let reloader = gate
            .reloader(&path, &file, st, |b| b)
            .prepare(move |f| f.default_trusted_proxies(&proxies));
        let svc = gate.layer(service_fn(|_r: Request<Body>| async move {
            let mut res = Response::new(Body::empty());
            *res.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            Ok::<_, Infallible>(res)
        }));
        let adaptive = || gate.concurrency("adaptive").unwrap().adaptive_limit();
        assert_eq!(adaptive(), Some(8));
        // A 503 is a drop: the limit backs off.
        let _ = send(&svc, req("/a", "k")).await;
        let learned = adaptive().unwrap();
        assert!(learned < 8, "{learned}");
        // Another rate, the same in-flight entry: what it learned stays.
        std::fs::write(&path, text.replace("rate = \"1/s\"", "rate = \"2/s\"")).unwrap();
        reloader.reload().unwrap();
        assert_eq!(adaptive(), Some(learned));
        // Its own entry changed: built afresh.
        std::fs::write(
            &path,
            text.replace("rate = \"1/s\"", "rate = \"2/s\"")
                .replace("max = 100", "max = 99"),
        )
        .unwrap();
        reloader.reload().unwrap();
        assert_eq!(adaptive(), Some(8));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Review of the composed layer: a file of quotas (or in-flight
    /// limits) alone needs no rule; one may come with a reload.
    #[tokio::test]
    async fn a_file_without_rules_is_its_other_limits() {
        let clock = ManualClock::starting_at(1_796_472_000_000_000_000);
        let quota_only =
            "[[quotas]]\nname = \"daily\"\nkey = \"header:x-api-key\"\nlimits = { day = 1 }\n";
        let dir = std::env::temp_dir().join(format!("tollgate-norules-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("policy.toml");
        std::fs::write(&path, quota_only).unwrap();
        let file = PolicyFile::read(&path).unwrap();
        let st = store(&clock);
        let gate = Tollgate::new(&file, &st).unwrap();
        assert!(gate.policy().rule_names().is_empty());
        let reloader = gate.reloader(&path, &file, st, |b| b);
        let svc = app(&gate);
        let r = send(&svc, req("/a", "k")).await;
        assert_eq!((r.status(), left(&r, "daily")), (StatusCode::OK, Some(0)));
        assert_eq!(
            r.headers()["ratelimit-policy"],
            "\"daily\";q=1;w=86400",
            "no fields of an empty policy"
        );
        assert_eq!(
            send(&svc, req("/a", "k")).await.status(),
            StatusCode::TOO_MANY_REQUESTS
        );
        // A rule added by a reload applies from then on.
        std::fs::write(
            &path,
            format!("{quota_only}\n[[rules]]\nname = \"rate\"\nkey = \"global\"\nrate = \"1/h\"\nburst = 1\n"),
        )
        .unwrap();
        reloader.reload().unwrap();
        assert_eq!(
            send(&svc, req("/a", "other")).await.status(),
            StatusCode::OK
        );
        let r = send(&svc, req("/a", "third")).await;
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert!(
            r.headers()["ratelimit"]
                .to_str()
                .unwrap()
                .contains("\"rate\""),
            "{r:?}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Review of the server: what needs the response or the body is
    /// refused for a decision endpoint, naming its field, where it would
    /// silently do nothing (a `count_if` rule never counts; idempotency
    /// markers and body-length costs read a body that is not there).
    #[test]
    fn a_decision_endpoint_refuses_what_it_cannot_see() {
        let base = "[[rules]]\nname = \"r\"\nkey = \"global\"\nrate = \"1/s\"\nburst = 5\n";
        let refused = |extra: &str| {
            let file = PolicyFile::parse(&format!("{base}{extra}")).unwrap();
            let e = Tollgate::for_decisions(&file, &MemoryStore::new()).unwrap_err();
            format!("{}: {}", e.field(), e.message())
        };
        assert!(refused("count_if = [401]\n")
            .starts_with("rules[0].count_if: counts by the response's status"));
        // Review: the endpoint's stub answers at once with no body, so an
        // elapsed or response_bytes charge would give back all but 1 of
        // every cost.
        assert!(
            refused("charge_after = { measure = \"elapsed\", per = \"100ms\" }\n")
                .starts_with("rules[0].charge_after: charges what the response cost")
        );
        assert!(refused("messages = true\n")
            .starts_with("rules[0].messages: counts an upgraded connection's messages"));
        let file = PolicyFile::parse(&format!("{base}messages = false\n")).unwrap();
        assert!(Tollgate::for_decisions(&file, &MemoryStore::new()).is_ok());
        assert!(refused(
            "\n[idempotency]\nname = \"idem\"\nkey = \"header:x-api-key\"\nttl = \"1h\"\n"
        )
        .starts_with("idempotency: tells repeats apart by the request's body"));
        assert!(refused("cost = { bytes_per_unit = 1024, max = 100 }\n")
            .starts_with("rules[0].cost.bytes_per_unit: charges by the body's length"));
        assert!(
            refused("cost = \"up\"\n[costs.up]\nbytes_per_unit = 1024\nmax = 100\n")
                .starts_with("costs.up.bytes_per_unit")
        );
        // The same file builds as a layer, which sees both.
        let file = PolicyFile::parse(&format!("{base}count_if = [401]\n")).unwrap();
        assert!(Tollgate::new(&file, &MemoryStore::new()).is_ok());
    }

    #[tokio::test]
    async fn a_reload_applies_every_section_and_keeps_each_limits_state() {
        let clock = ManualClock::starting_at(1_796_472_000_000_000_000);
        let dir = std::env::temp_dir().join(format!("tollgate-gate-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("policy.toml");
        std::fs::write(&path, FILE).unwrap();
        let file = PolicyFile::read(&path).unwrap();
        let st = store(&clock);
        let gate = Tollgate::new(&file, &st).unwrap();
        let reloader = gate.reloader(&path, &file, st, |b| b);
        let svc = app(&gate);
        let r = send(&svc, req("/a", "k")).await;
        assert_eq!(left(&r, "daily"), Some(2));
        // A new rate and a larger day: the day's count goes on (1 used of
        // 10), and the in-flight limit grows to 2.
        let next = FILE
            .replace("rate = \"1/s\"", "rate = \"100/s\"")
            .replace("day = 3", "day = 10")
            .replace("max = 1", "max = 2");
        std::fs::write(&path, &next).unwrap();
        assert_eq!(reloader.reload().unwrap(), super::super::Reloaded::Applied);
        clock.advance(Duration::from_secs(1));
        let r = send(&svc, req("/a", "k")).await;
        assert_eq!((r.status(), left(&r, "daily")), (StatusCode::OK, Some(8)));
        let _one = send(&svc, req("/slow", "s")).await;
        let two = send(&svc, req("/slow", "s")).await;
        assert_eq!(two.status(), StatusCode::OK);
        // A file whose quota cannot be built is refused whole: the new
        // rate in it does not apply either.
        let bad = next
            .replace("rate = \"100/s\"", "rate = \"1/h\"")
            .replace("day = 10", "day = 0");
        std::fs::write(&path, bad).unwrap();
        let e = reloader.reload().unwrap_err();
        assert_eq!(e.field(), "quotas[0].limits.day", "{e}");
        for _ in 0..2 {
            assert_eq!(send(&svc, req("/a", "r")).await.status(), StatusCode::OK);
        }
        clock.advance(Duration::from_secs(1));
        // 100 a second refills the burst in a second; 1 an hour would not.
        assert_eq!(send(&svc, req("/a", "r")).await.status(), StatusCode::OK);
        let r = send(&svc, req("/a", "k")).await;
        assert_eq!(left(&r, "daily"), Some(7));
        // The in-flight limit is 2 still.
        assert_eq!(
            send(&svc, req("/slow", "s")).await.status(),
            StatusCode::TOO_MANY_REQUESTS
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
