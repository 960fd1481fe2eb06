//! The scenario matrix: one table of hostile and faulty conditions (rows),
//! run against every layer (columns) on the memory store and on Redis,
//! through real axum servers on loopback. Each cell asserts what the docs
//! promise for that layer under that condition, or says why the condition
//! does not apply to it. Adding a condition is one entry in [`ROWS`];
//! adding a layer is one entry in [`LAYERS`] and one arm in [`protect`].
//!
//! The conditions live in one place in the library too (the outcome of a
//! response, a request's key, its method and path): a defect this matrix
//! finds is fixed there, once, for every layer.
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::panic,
    clippy::arithmetic_side_effects,
    clippy::indexing_slicing
)]

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request as AxumRequest;
use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::BodyExt;
use tollgate::bandwidth::BandwidthLayer;
use tollgate::calendar::Period;
use tollgate::concurrency::{AdaptiveLimit, Aimd, ConcurrencyLayer, Gradient};
use tollgate::core::{
    Acquire, ConcurrencyLimiter, ConcurrencyRule, ConfigError, Decision, Lease, Limiter,
    QuotaDecision, QuotaLimiter, QuotaRule, QuotaStore, RetryBudgetLimiter, RetryBudgetRule,
    RetryBudgetStore, Rule, StoreError, StoreErrorKind, Withdrawal,
};
use tollgate::cost::{ByRoute, Cost as _, HeaderCost};
use tollgate::key::{Header, KeyBuf, KeyExtractor, PeerIp};
use tollgate::policy::{PolicyLayer, RateRule};
use tollgate::quota::QuotaLayer;
use tollgate::rate_limit::{ActualCost, Measure, MessageBudget};
use tollgate::retry::RetryBudgetLayer;
use tollgate::FailurePolicy;
use tollgate::{Limit, MemoryStore, OnStoreError, Rate, RateLimitLayer, RedisStore, Store};
use tollgate_redis::testing::{unique_prefix, Cluster, Server};
use tollgate_tests::{send, Reply};

mod common;
use tower::{Layer as _, Service, ServiceExt};

// ---------------------------------------------------------------------------
// The columns: layers, and the stores they run on.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layer {
    Rate,
    Policy,
    Quota,
    Concurrency,
    /// The ConcurrencyLayer with an adaptive service limit and read-only
    /// mode.
    Adaptive,
    Bandwidth,
    /// The RetryBudgetLayer, on the client side of a loopback server.
    Retry,
}

const LAYERS: [Layer; 7] = [
    Layer::Rate,
    Layer::Policy,
    Layer::Quota,
    Layer::Concurrency,
    Layer::Adaptive,
    Layer::Bandwidth,
    Layer::Retry,
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backing {
    Memory,
    Redis,
}

/// One cell's column: a layer on a store.
#[derive(Debug, Clone, Copy)]
struct Cell<'a> {
    layer: Layer,
    backing: Backing,
    /// The Redis server's URL (on Redis).
    redis: &'a str,
    /// A 3-master Redis Cluster (on Redis), for the rows that stop one.
    cluster: Option<&'a Cluster>,
    /// The limit declared in a policy file and served by a `Tollgate`
    /// (the composed layer), where it is built in code otherwise.
    file: bool,
}

/// The layers a policy file declares too: each has a second column, the
/// same limit from a file, in a `Tollgate`.
const FROM_FILES: [Layer; 5] = [
    Layer::Policy,
    Layer::Quota,
    Layer::Concurrency,
    Layer::Adaptive,
    Layer::Bandwidth,
];

/// A cell's verdict, when it does not fail.
#[derive(Debug)]
enum Verdict {
    Pass,
    /// The condition does not apply to this layer, and why.
    NotApplicable(&'static str),
}

type CellResult = Result<Verdict, String>;
type CellFuture<'a> = Pin<Box<dyn Future<Output = CellResult> + Send + 'a>>;

/// A condition: its name and the check that runs in every cell.
struct Row {
    name: &'static str,
    check: for<'a> fn(Cell<'a>) -> CellFuture<'a>,
}

// ---------------------------------------------------------------------------
// The rows.

const ROWS: &[Row] = &[
    Row {
        name: "1a no key: header absent, empty or blank",
        check: |c| Box::pin(keyless_header(c)),
    },
    Row {
        name: "1b no key: PeerIp without connect info",
        check: |c| Box::pin(keyless_peer(c)),
    },
    Row {
        name: "2 gRPC failure, trailers-only and trailing",
        check: |c| Box::pin(grpc_failure(c)),
    },
    Row {
        name: "2t a real tonic client and service: refusals are RESOURCE_EXHAUSTED",
        check: |c| Box::pin(tonic_refusals(c)),
    },
    Row {
        name: "3a HEAD costs what GET costs",
        check: |c| Box::pin(head_costs_get(c)),
    },
    Row {
        name: "3b a route under Router::nest and ::merge keeps its cost",
        check: |c| Box::pin(nested_route_cost(c)),
    },
    Row {
        name: "3c path forms make no cheaper cost",
        check: |c| Box::pin(path_forms(c)),
    },
    Row {
        name: "3d a limit scoped to routes: others pass it unkeyed and uncharged",
        check: |c| Box::pin(scoped_routes(c)),
    },
    Row {
        name: "4 long-lived responses freeze nothing",
        check: |c| Box::pin(long_bodies(c)),
    },
    Row {
        name: "4b a channel past its lifetime ends cleanly and gives its permit back",
        check: |c| Box::pin(lifetimes(c)),
    },
    Row {
        name: "5 cancellation and panics leak no permit",
        check: |c| Box::pin(cancellation(c)),
    },
    Row {
        name: "6 store dead or slow: each failure policy does what it says",
        check: |c| Box::pin(store_down(c)),
    },
    Row {
        name: "6d store slow but in time: its answers, no false 429 back to back",
        check: |c| Box::pin(store_slow_in_time(c)),
    },
    Row {
        name: "6c one Cluster master stopped: only its keys fall to the policy",
        check: |c| Box::pin(cluster_master_stopped(c)),
    },
    Row {
        name: "6b store errors at the layer: OnStoreError says what passes",
        check: |c| Box::pin(store_errors(c)),
    },
    Row {
        name: "7 rotating API keys from one address: the address's budget holds",
        check: |c| Box::pin(key_rotation(c)),
    },
    Row {
        name: "8 idempotency replays: scoped to body too, never free on a fault or failure",
        check: |c| Box::pin(idempotency(c)),
    },
    Row {
        name: "9 reload mid-traffic: all or nothing, state and code kept",
        check: |c| Box::pin(reload_mid_traffic(c)),
    },
    Row {
        name: "10 hostile values: 64 KiB and non-UTF-8 keys, server hints",
        check: |c| Box::pin(hostile_keys(c)),
    },
    Row {
        name: "10b hostile costs: 0 and u64::MAX from a header",
        check: |c| Box::pin(hostile_costs(c)),
    },
    Row {
        name: "11 a full memory store: rates limit newcomers as a group, quotas never share",
        check: |c| Box::pin(full_store(c)),
    },
    Row {
        name: "12 hedged calls: each hedge a withdrawal, none from a failing store",
        check: |c| Box::pin(hedged_calls(c)),
    },
    Row {
        name: "13 expensive calls: what a response cost is paid by its key's next requests",
        check: |c| Box::pin(expensive_calls(c)),
    },
    Row {
        name: "14 a WebSocket's messages spend its key's budget",
        check: |c| Box::pin(socket_messages(c)),
    },
    Row {
        name: "15 repeated refusals slow a key down, and it is told so",
        check: |c| Box::pin(slowed_keys(c)),
    },
    Row {
        name: "16 a service-wide in-flight limit: every client counts, every permit comes back",
        check: |c| Box::pin(service_wide(c)),
    },
];

// ---------------------------------------------------------------------------
// How a cell is set up: the backend, the layer's configuration, a server.

/// The per-key budget of every cell's layer, in cost units (for the
/// bandwidth layer, bytes).
const BUDGET: u32 = 8;
/// What `GET /r` costs.
const R_COST: u64 = 4;

/// The backend behind every layer: `/r` (which costs `R_COST` to GET)
/// and `/s` (which costs 1) answer as `x-answer` says, and count the calls
/// that reach them.
#[derive(Clone, Default)]
struct Backend {
    hits: Arc<AtomicUsize>,
}

impl Backend {
    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    fn router(&self) -> Router {
        let hits = Arc::clone(&self.hits);
        let answer = move |req: AxumRequest| {
            let hits = Arc::clone(&hits);
            async move {
                hits.fetch_add(1, Ordering::SeqCst);
                answer(req.headers())
            }
        };
        Router::new()
            .route("/r", get(answer.clone()).post(answer.clone()))
            .route("/s", get(answer.clone()).post(answer))
            // A body that stays open until the client goes away (SSE, a
            // long download).
            .route(
                "/long",
                get(|| async {
                    let body = Scripted {
                        data: Some(Bytes::from_static(b"data: hello\n\n")),
                        trailers: Some(None),
                    };
                    Response::builder()
                        .header("content-type", "text/event-stream")
                        .body(Body::new(body))
                        .unwrap()
                }),
            )
            // A 1 MiB download paced at 64 KiB every 100 ms.
            .route(
                "/download",
                get(|| async { Response::new(Body::new(Paced::download())) }),
            )
            // An upgraded connection's task: it spends `x-messages`
            // messages of cost 1 from the budget it was offered, stopping
            // at the first refused, and says how many went through.
            .route("/ws", get(messages))
            // A handler that never answers.
            .route("/hang", get(std::future::pending::<&'static str>))
            .route(
                "/panic",
                get(|| async {
                    panic!("the handler fails");
                    #[allow(unreachable_code)]
                    ""
                }),
            )
            .layer(tower_http::catch_panic::CatchPanicLayer::new())
    }
}

/// `/ws`: spends `x-messages` messages from the request's
/// `MessageBudget`; answers `x-sent` (how many were admitted) or
/// `x-sent: none` when it was offered no budget.
async fn messages(req: AxumRequest) -> Response<Body> {
    let wanted: u32 = req
        .headers()
        .get("x-messages")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .unwrap_or(0);
    let sent = match req.extensions().get::<MessageBudget>() {
        None => "none".to_owned(),
        Some(budget) => {
            let mut sent = 0;
            while sent < wanted && budget.spend(1).await.is_ok() {
                sent += 1;
            }
            sent.to_string()
        }
    };
    Response::builder()
        .header("x-sent", sent)
        .body(Body::empty())
        .unwrap()
}

/// `x-answer`: `ok` (default), `status:N`, `grpc:N` (a trailers-only gRPC
/// answer), `grpc-trailer:N` (a gRPC body, then trailers), `cost:N` (the
/// handler reports that the request cost N: an `ActualCost`).
fn answer(headers: &HeaderMap) -> Response<Body> {
    let how = headers
        .get("x-answer")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("ok");
    if let Some(n) = how.strip_prefix("cost:") {
        let mut res = Response::new(Body::from("ok"));
        res.extensions_mut().insert(ActualCost(n.parse().unwrap()));
        return res;
    }
    let grpc = |b: http::response::Builder| b.header("content-type", "application/grpc");
    if let Some(code) = how.strip_prefix("status:") {
        // `status:503;retry-after=garbage`: a status, and headers.
        let mut parts = code.split(';');
        let status = StatusCode::from_u16(parts.next().unwrap().parse().unwrap()).unwrap();
        let mut b = Response::builder().status(status);
        for header in parts {
            let (name, value) = header.split_once('=').unwrap();
            b = b.header(name, value);
        }
        return b.body(Body::from("status")).unwrap();
    }
    if let Some(code) = how.strip_prefix("grpc:") {
        return grpc(Response::builder())
            .header("grpc-status", code)
            .body(Body::empty())
            .unwrap();
    }
    if let Some(code) = how.strip_prefix("grpc-trailer:") {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_str(code).unwrap());
        let body = Scripted {
            data: Some(Bytes::from_static(b"\0\0\0\0\0")),
            trailers: Some(Some(trailers)),
        };
        return grpc(Response::builder()).body(Body::new(body)).unwrap();
    }
    Response::new(Body::from("ok"))
}

/// A body of one data frame, then trailers (`Some`) or, with `None`,
/// open until dropped (an event stream, a long download).
struct Scripted {
    data: Option<Bytes>,
    trailers: Option<Option<HeaderMap>>,
}

impl http_body::Body for Scripted {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if let Some(data) = self.data.take() {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        match self.trailers.take() {
            Some(Some(t)) => Poll::Ready(Some(Ok(Frame::trailers(t)))),
            Some(None) => {
                self.trailers = Some(None);
                Poll::Pending
            }
            None => Poll::Ready(None),
        }
    }
}

/// A paced download: `left` bytes in chunks of 64 KiB, one every 100 ms.
struct Paced {
    left: usize,
    tick: Pin<Box<tokio::time::Sleep>>,
}

impl Paced {
    const CHUNK: usize = 64 * 1024;
    const EVERY: Duration = Duration::from_millis(100);

    fn download() -> Self {
        Paced {
            left: 1024 * 1024,
            tick: Box::pin(tokio::time::sleep(Duration::ZERO)),
        }
    }
}

impl http_body::Body for Paced {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.left == 0 {
            return Poll::Ready(None);
        }
        std::task::ready!(self.tick.as_mut().poll(cx));
        let next = tokio::time::Instant::now() + Self::EVERY;
        self.tick.as_mut().reset(next);
        let n = self.left.min(Self::CHUNK);
        self.left -= n;
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(vec![b'x'; n])))))
    }
}

/// Who a request counts against, as a cell chooses.
#[derive(Debug, Clone, Copy)]
enum KeyKind {
    ApiKey,
    Peer,
    /// One key for every request (`Global`, a file's `global`).
    Global,
}

#[derive(Debug, Clone, Copy)]
struct TestKey(KeyKind);

impl<B> KeyExtractor<B> for TestKey {
    fn extract(&self, req: &Request<B>, key: &mut KeyBuf) -> Option<()> {
        match self.0 {
            KeyKind::ApiKey => Header::named("x-api-key").unwrap().extract(req, key),
            KeyKind::Peer => PeerIp::new().extract(req, key),
            KeyKind::Global => tollgate::key::Global.extract(req, key),
        }
    }

    fn is_fixed(&self) -> bool {
        matches!(self.0, KeyKind::Global)
    }
}

/// What a row asks of the layer it protects `/r` with.
#[derive(Debug, Clone, Copy)]
struct Spec {
    key: KeyKind,
    /// The path `R_COST` is configured under.
    cost_path: &'static str,
    /// The cost read from `x-cost` (1 without it), the real parser, up
    /// to `u64::MAX`, in place of the route costs.
    header_cost: bool,
    /// A response-aware policy rule: only these statuses count.
    count_if: Option<u16>,
    /// The adaptive service limit.
    adaptive: fn() -> AdaptiveLimit,
    /// Idempotent repeats (policy): markers per client key.
    idempotency: bool,
    /// What the layer does with a store's error.
    on_store_error: OnStoreError,
    /// The rule's name.
    rule: &'static str,
    /// Its budget: units (rate, quota), permits (concurrency), bytes per
    /// second (bandwidth).
    budget: u32,
    /// The routes the limit is scoped to (method, pattern); every route
    /// if `None`.
    routes: Option<(&'static str, &'static str)>,
    /// The concurrency limit's `max_lifetime`.
    max_lifetime: Option<Duration>,
    /// A rate rule charges what the handler reports a request cost
    /// (`charge_after`, `Measure::Reported`).
    charge_after: bool,
    /// A rate rule's budget spends an upgraded connection's messages.
    messages: bool,
    /// A policy rule's slowing ladder: one refusal in a minute keeps 50 %
    /// of the limit for a minute.
    slow_down: bool,
}

fn aimd_5() -> AdaptiveLimit {
    AdaptiveLimit::Aimd(Aimd::new(1, 5, 10).unwrap())
}

/// The README's gradient: it starts probing at its minimum, 16.
fn gradient_16() -> AdaptiveLimit {
    AdaptiveLimit::Gradient(Gradient::new(16, 64, 1_000).unwrap())
}

impl Default for Spec {
    fn default() -> Self {
        Self {
            key: KeyKind::ApiKey,
            cost_path: "/r",
            header_cost: false,
            count_if: None,
            adaptive: aimd_5,
            idempotency: false,
            on_store_error: OnStoreError::Admit,
            rule: "m",
            budget: BUDGET,
            routes: None,
            max_lifetime: None,
            charge_after: false,
            messages: false,
            slow_down: false,
        }
    }
}

/// A protected app, and a way to read the adaptive limit.
struct Protected {
    router: Router,
    adaptive_limit: Option<Box<dyn Fn() -> Option<u32> + Send + Sync>>,
}

/// `spec`'s limit of `layer` as a policy file's entry (`[[rules]]`,
/// `[[quotas]]`, `[[concurrency]]` or `[[bandwidth]]`), and what the file
/// says at its top.
fn file_entry(layer: Layer, spec: &Spec) -> (String, String) {
    let key = match spec.key {
        KeyKind::ApiKey => "header:x-api-key",
        KeyKind::Peer => "peer-ip",
        KeyKind::Global => "global",
    };
    let cost = if spec.header_cost {
        format!("{{ header = \"x-cost\", default = 1, max = {} }}", i64::MAX)
    } else {
        format!(
            "{{ default = 1, routes = [{{ method = \"GET\", path = \"{}\", cost = {R_COST} }}] }}",
            spec.cost_path
        )
    };
    let mut own = String::new();
    if let Some((method, pattern)) = spec.routes {
        own.push_str(&format!("routes = [\"{method} {pattern}\"]\n"));
    }
    let refuse = spec.on_store_error == OnStoreError::Refuse;
    let (name, budget) = (spec.rule, spec.budget);
    let mut top = String::new();
    let entry = match layer {
        Layer::Policy => {
            if refuse {
                top.push_str("on_store_error = \"refuse\"\n");
            }
            if let Some(status) = spec.count_if {
                own.push_str(&format!("count_if = [{status}]\n"));
            }
            if spec.charge_after {
                own.push_str("charge_after = { measure = \"reported\" }\n");
            }
            if spec.messages {
                own.push_str("messages = true\n");
            }
            if spec.slow_down {
                own.push_str(
                    "slow_down = { strikes = 1, period = \"60s\", hold = \"60s\", steps = [50] }\n",
                );
            }
            let mut entry = format!("[[rules]]\nname = \"{name}\"\nkey = \"{key}\"\nrate = \"1/h\"\nburst = {budget}\ncost = {cost}\n{own}");
            if spec.idempotency {
                entry.push_str(&format!(
                    "\n[idempotency]\nname = \"idem\"\nkey = \"{key}\"\nttl = \"600s\"\n"
                ));
            }
            entry
        }
        Layer::Quota => {
            if refuse {
                own.push_str("on_store_error = \"refuse\"\n");
            }
            format!("[[quotas]]\nname = \"{name}\"\nkey = \"{key}\"\nlimits = {{ day = {budget} }}\ncost = {cost}\n{own}")
        }
        Layer::Concurrency | Layer::Adaptive => {
            if refuse {
                own.push_str("on_store_error = \"refuse\"\n");
            }
            if let Some(max) = spec.max_lifetime {
                own.push_str(&format!("max_lifetime = \"{}ms\"\n", max.as_millis()));
            }
            if layer == Layer::Adaptive {
                let (algorithm, min, initial, max) = match (spec.adaptive)() {
                    AdaptiveLimit::Aimd(_) => ("aimd", 1, 5, 10),
                    _ => ("gradient", 16, 64, 1_000),
                };
                // One service-wide limit a name (names are the store's).
                let svc = if name == "m" {
                    "svc".to_owned()
                } else {
                    format!("svc-{name}")
                };
                own.push_str(&format!(
                    "adaptive = {{ name = \"{svc}\", algorithm = \"{algorithm}\", min = {min}, initial = {initial}, max = {max} }}\n\
                     read_only = {{ above = 0.5, window = \"60s\" }}\n"
                ));
            }
            format!("[[concurrency]]\nname = \"{name}\"\nkey = \"{key}\"\nmax = {budget}\ncost = {cost}\n{own}")
        }
        Layer::Bandwidth => format!(
            "[[bandwidth]]\nname = \"{name}\"\nkey = \"{key}\"\nrate = {}\nburst = {budget}\n{own}",
            1 << 20
        ),
        Layer::Rate | Layer::Retry => panic!("{layer:?} has no policy file entry"),
    };
    (top, entry)
}

/// `router` behind one `Tollgate` over a policy file of `limits` (each a
/// layer and its spec), on `store`.
fn protect_file<St>(limits: &[(Layer, Spec)], store: St, router: Router) -> Protected
where
    St: Store + QuotaStore,
{
    let (mut top, mut entries) = (String::new(), String::new());
    for (layer, spec) in limits {
        let (t, e) = file_entry(*layer, spec);
        top.push_str(&t);
        entries.push_str(&format!("\n{e}"));
    }
    // Top-level keys first, then the tables.
    let text = format!("{top}{entries}");
    let file =
        tollgate::config::PolicyFile::parse(&text).unwrap_or_else(|e| panic!("{e}\n---\n{text}"));
    let gate = tollgate::config::Tollgate::new(&file, &store).unwrap_or_else(|e| panic!("{e}"));
    let adaptive_limit = limits
        .iter()
        .find(|(l, _)| matches!(l, Layer::Concurrency | Layer::Adaptive))
        .map(|(_, spec)| {
            let gate = gate.clone();
            let name = spec.rule;
            Box::new(move || gate.concurrency(name).and_then(|l| l.adaptive_limit()))
                as Box<dyn Fn() -> Option<u32> + Send + Sync>
        });
    Protected {
        router: router.layer(gate),
        adaptive_limit,
    }
}

/// `router` behind `layer` configured by `spec`, on `store`, built in
/// code or (`file`) from a policy file. The rule's name is `m` in every
/// layer.
fn protect<St>(layer: Layer, file: bool, store: St, spec: Spec, router: Router) -> Protected
where
    St: Store + QuotaStore,
{
    if file {
        return protect_file(&[(layer, spec)], store, router);
    }
    let by_route = ByRoute::new(1).route(Some(Method::GET), spec.cost_path, R_COST);
    let from_header = spec
        .header_cost
        .then(|| HeaderCost::named("x-cost", 1, u64::MAX).unwrap());
    let cost = move |req: &Request<Body>| match &from_header {
        Some(h) => h.cost(req),
        None => by_route.cost(req),
    };
    let key = TestKey(spec.key);
    let slow = Rate::new(1, Duration::from_secs(3_600));
    let routes = spec.routes.map(|(method, pattern)| {
        tollgate::Routes::new()
            .route(
                Some(Method::from_bytes(method.as_bytes()).unwrap()),
                pattern,
            )
            .unwrap()
    });
    // Every limit's builder takes the same `routes`.
    macro_rules! scoped {
        ($builder:expr) => {
            match &routes {
                Some(r) => $builder.routes(r.clone()),
                None => $builder,
            }
        };
    }
    let mut adaptive_limit = None;
    let router = match layer {
        Layer::Rate => {
            let mut b = scoped!(
                RateLimitLayer::builder(spec.rule, Limit::gcra(slow, spec.budget))
                    .key(key)
                    .cost(cost)
                    .on_store_error(spec.on_store_error)
                    .store(store)
            )
            .messages(spec.messages);
            if spec.charge_after {
                b = b.charge_after(Measure::Reported);
            }
            router.layer(b.build().unwrap())
        }
        Layer::Policy => {
            let mut rule =
                scoped!(RateRule::new(spec.rule, Limit::gcra(slow, spec.budget), key).cost(cost));
            if let Some(status) = spec.count_if {
                rule = rule.count_if(move |s| s.as_u16() == status);
            }
            if spec.charge_after {
                rule = rule.charge_after(Measure::Reported);
            }
            if spec.slow_down {
                let minute = Duration::from_secs(60);
                rule = rule.slow_down(1, minute, minute, &[50]);
            }
            rule = rule.messages(spec.messages);
            let mut policy = PolicyLayer::<Body>::builder()
                .rule(rule)
                .on_store_error(spec.on_store_error);
            if spec.idempotency {
                policy = policy.idempotency("idem", key, Duration::from_secs(600));
            }
            router.layer(policy.store(store).build().unwrap())
        }
        Layer::Quota => router.layer(
            scoped!(QuotaLayer::builder(spec.rule)
                .period(Period::Day, u64::from(spec.budget))
                .key(key)
                .cost(cost)
                .on_store_error(spec.on_store_error)
                .store(store))
            .build()
            .unwrap(),
        ),
        Layer::Concurrency | Layer::Adaptive => {
            let mut b = scoped!(ConcurrencyLayer::builder(spec.rule, spec.budget)
                .key(key)
                .cost(cost)
                .on_store_error(spec.on_store_error)
                .store(store)
                .upgrades(true));
            if layer == Layer::Adaptive {
                b = b
                    .adaptive_service_limit("svc", (spec.adaptive)())
                    .read_only_above(0.5, Duration::from_secs(60));
            }
            if let Some(max) = spec.max_lifetime {
                b = b.max_lifetime(max);
            }
            let built = b.build().unwrap();
            let handle = built.clone();
            adaptive_limit = Some(Box::new(move || handle.adaptive_limit()) as Box<_>);
            router.layer(built)
        }
        Layer::Bandwidth => router.layer(
            scoped!(BandwidthLayer::builder(spec.rule, 1 << 20, spec.budget)
                .key(key)
                .store(store))
            .build()
            .unwrap(),
        ),
        Layer::Retry => panic!("the retry layer is a client's: see `client`"),
    };
    Protected {
        router,
        adaptive_limit,
    }
}

/// The cell's store: a fresh memory store, or Redis under `policy` with a
/// prefix of its own.
fn with_store<R>(
    cell: Cell<'_>,
    policy: tollgate::FailurePolicy,
    f: impl FnOnce(StoreChoice) -> R,
) -> R {
    match cell.backing {
        Backing::Memory => f(StoreChoice::Memory(MemoryStore::new())),
        Backing::Redis => f(StoreChoice::Redis(
            RedisStore::builder(cell.redis)
                .prefix(&unique_prefix())
                .failure_policy(policy)
                .timeout(Duration::from_millis(200))
                .build()
                .unwrap(),
        )),
    }
}

/// `router` behind the cell's layer on the cell's store (Redis under
/// `policy`).
fn protect_on(
    cell: Cell<'_>,
    spec: Spec,
    router: Router,
    policy: tollgate::FailurePolicy,
) -> Protected {
    with_store(cell, policy, |store| match store {
        StoreChoice::Memory(s) => protect(cell.layer, cell.file, s, spec, router),
        StoreChoice::Redis(s) => protect(cell.layer, cell.file, s, spec, router),
    })
}

enum StoreChoice {
    Memory(MemoryStore),
    Redis(RedisStore),
}

/// Protects the backend's router for `cell` with `spec` (Redis failing
/// open) and serves it, with peer addresses unless `peer` is false.
async fn serve(cell: Cell<'_>, spec: Spec, backend: &Backend, peer: bool) -> Served {
    serve_on(
        cell,
        spec,
        backend.router(),
        peer,
        tollgate::FailurePolicy::Open,
    )
    .await
}

struct Served {
    addr: SocketAddr,
    adaptive_limit: Option<Box<dyn Fn() -> Option<u32> + Send + Sync>>,
}

async fn serve_on(
    cell: Cell<'_>,
    spec: Spec,
    router: Router,
    peer: bool,
    policy: tollgate::FailurePolicy,
) -> Served {
    let protected = protect_on(cell, spec, router, policy);
    let addr = if peer {
        common::spawn(protected.router).await
    } else {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, protected.router).await });
        addr
    };
    Served {
        addr,
        adaptive_limit: protected.adaptive_limit,
    }
}

/// The URL of a Redis that is not there: a loopback port nothing listens
/// on, so every call fails at once.
fn dead_redis() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    format!("redis://127.0.0.1:{}", l.local_addr().unwrap().port())
}

/// A client stack: the retry layer (budget on the cell's store) over a
/// loopback HTTP client to `addr`; returns it and the layer's calls.
fn client<St: RetryBudgetStore>(
    store: St,
    addr: SocketAddr,
    hedged: bool,
) -> impl Service<
    Request<Body>,
    Response = Response<Body>,
    Error = tollgate::BoxError,
    Future = impl Send,
> + Clone {
    let upstream = tower::service_fn(
        move |req: Request<tollgate::retry::ReplayBody<Body>>| async move {
            let (parts, body) = req.into_parts();
            let bytes = body.collect().await?.to_bytes();
            let reply = send(addr, Request::from_parts(parts, bytes)).await?;
            let mut res = Response::new(Body::from(reply.body));
            *res.status_mut() = reply.status;
            *res.headers_mut() = reply.headers;
            Ok::<_, tollgate::BoxError>(res)
        },
    );
    let mut builder = RetryBudgetLayer::builder("m")
        .store(store)
        .max_attempts(3)
        .backoff(Duration::from_millis(1), Duration::from_millis(2));
    if hedged {
        // Half a retry a call and no floor: a hedge every other call.
        builder = builder
            .budget(0.5, 0, Duration::from_secs(60))
            .hedge(tollgate::retry::Hedge::after(Duration::from_millis(20)));
    }
    builder.build().unwrap().layer(upstream)
}

/// A request to `path` with `key` as `x-api-key` (none: no header).
fn req(method: Method, path: &str, key: Option<&[u8]>) -> Request<Bytes> {
    let mut b = Request::builder().method(method).uri(path);
    if let Some(k) = key {
        b = b.header("x-api-key", HeaderValue::from_bytes(k).unwrap());
    }
    b.body(Bytes::new()).unwrap()
}

/// The same request as a gRPC call (POST, `application/grpc`).
fn grpc_req(path: &str, key: Option<&[u8]>, answer: &str) -> Request<Bytes> {
    let mut r = req(Method::POST, path, key);
    r.headers_mut()
        .insert("content-type", HeaderValue::from_static("application/grpc"));
    r.headers_mut()
        .insert("x-answer", HeaderValue::from_str(answer).unwrap());
    r
}

fn expect(cond: bool, what: impl FnOnce() -> String) -> Result<(), String> {
    if cond {
        Ok(())
    } else {
        Err(what())
    }
}

/// `r=` of the rule `m` in a reply's `RateLimit` header, if shown.
fn remaining(reply: &Reply) -> Option<u64> {
    reply
        .item("ratelimit", "m")
        .split(';')
        .find_map(|p| p.strip_prefix("r="))
        .and_then(|r| r.parse().ok())
}

// ---------------------------------------------------------------------------
// Row 1: keyless requests meet the layer's MissingKey policy, whose default
// (Reject: 400, gRPC INVALID_ARGUMENT) is the same on every layer.

async fn keyless_header(cell: Cell<'_>) -> CellResult {
    if cell.layer == Layer::Retry {
        return Ok(Verdict::NotApplicable(
            "a retry budget is keyed by upstream, which every request has",
        ));
    }
    let backend = Backend::default();
    let s = serve(cell, Spec::default(), &backend, true).await;
    for (what, key) in [
        ("absent", None),
        ("empty", Some(&b""[..])),
        ("blank", Some(b"  \t")),
    ] {
        let r = send(s.addr, req(Method::GET, "/r", key)).await.unwrap();
        expect(r.status == StatusCode::BAD_REQUEST, || {
            format!("key {what}: HTTP {} (want 400)", r.status)
        })?;
        let r = send(s.addr, grpc_req("/r", key, "grpc:0")).await.unwrap();
        expect(r.header("grpc-status") == "3", || {
            format!(
                "key {what}, gRPC: grpc-status {:?} (want 3)",
                r.header("grpc-status")
            )
        })?;
    }
    expect(backend.hits() == 0, || {
        format!("{} keyless requests reached the service", backend.hits())
    })?;
    Ok(Verdict::Pass)
}

async fn keyless_peer(cell: Cell<'_>) -> CellResult {
    if cell.layer == Layer::Retry {
        return Ok(Verdict::NotApplicable(
            "a retry budget is keyed by upstream, which every request has",
        ));
    }
    let backend = Backend::default();
    let spec = Spec {
        key: KeyKind::Peer,
        ..Spec::default()
    };
    let s = serve(cell, spec, &backend, false).await;
    let r = send(s.addr, req(Method::GET, "/r", None)).await.unwrap();
    expect(r.status == StatusCode::BAD_REQUEST, || {
        format!("no connect info: HTTP {} (want 400)", r.status)
    })?;
    expect(backend.hits() == 0, || {
        "a keyless request reached the service".into()
    })?;
    Ok(Verdict::Pass)
}

// ---------------------------------------------------------------------------
// Row 2: a gRPC failure (HTTP 200 with grpc-status) is a failure to every
// layer that reads outcomes.

async fn grpc_failure(cell: Cell<'_>) -> CellResult {
    match cell.layer {
        Layer::Adaptive => grpc_failure_adaptive(cell).await,
        Layer::Policy => grpc_failure_count_if(cell).await,
        Layer::Retry => grpc_failure_retry(cell).await,
        Layer::Rate | Layer::Quota | Layer::Concurrency | Layer::Bandwidth => Ok(
            Verdict::NotApplicable("decides before the response; reads no outcome"),
        ),
    }
}

/// AIMD and read-only mode see `UNAVAILABLE` as a drop, whether it comes
/// in a trailers-only answer or in trailers; `OK` is a success.
async fn grpc_failure_adaptive(cell: Cell<'_>) -> CellResult {
    for (form, failing) in [
        ("grpc:14", true),
        ("grpc-trailer:14", true),
        ("grpc:0", false),
        ("grpc-trailer:0", false),
        // What a rate limiter answers a client over its own budget (an
        // inner tollgate layer among them): no sign of overload, or any
        // client could drive the service's limit down.
        ("grpc:8", false),
        ("status:429", false),
    ] {
        let backend = Backend::default();
        let s = serve(cell, Spec::default(), &backend, true).await;
        for i in 0..25u32 {
            let key = format!("k{i}");
            let mut r = req(Method::GET, "/s", Some(key.as_bytes()));
            r.headers_mut()
                .insert("x-answer", HeaderValue::from_static(form));
            let reply = send(s.addr, r).await.unwrap();
            let answered = match form.strip_prefix("status:") {
                Some(code) => StatusCode::from_u16(code.parse().unwrap()).unwrap(),
                None => StatusCode::OK,
            };
            expect(reply.status == answered, || {
                format!("{form}: request {i} got HTTP {}", reply.status)
            })?;
        }
        let limit = (s.adaptive_limit.as_ref().unwrap())().unwrap();
        let write = send(s.addr, req(Method::POST, "/s", Some(b"w")))
            .await
            .unwrap();
        if failing {
            expect(limit < 5, || {
                format!("{form}: AIMD limit {limit}, want below 5")
            })?;
            expect(write.status == StatusCode::SERVICE_UNAVAILABLE, || {
                format!(
                    "{form}: a write while failing got {} (want read-only 503)",
                    write.status
                )
            })?;
        } else {
            expect(limit >= 5, || format!("{form}: AIMD limit fell to {limit}"))?;
            expect(write.status == StatusCode::OK, || {
                format!("{form}: a write while healthy got {}", write.status)
            })?;
        }
    }
    Ok(Verdict::Pass)
}

/// A response-aware rule counting 401 counts gRPC `UNAUTHENTICATED`, and
/// not `OK`.
async fn grpc_failure_count_if(cell: Cell<'_>) -> CellResult {
    let backend = Backend::default();
    let spec = Spec {
        count_if: Some(401),
        ..Spec::default()
    };
    let s = serve(cell, spec, &backend, true).await;
    // POST costs 1 (the default): eight OK calls all pass and count nothing.
    for i in 0..2 * BUDGET {
        let r = send(s.addr, grpc_req("/r", Some(b"ok"), "grpc:0"))
            .await
            .unwrap();
        expect(r.header("grpc-status") == "0", || {
            format!(
                "OK call {i} refused: grpc-status {}",
                r.header("grpc-status")
            )
        })?;
    }
    for i in 0..BUDGET {
        let r = send(s.addr, grpc_req("/r", Some(b"bad"), "grpc:16"))
            .await
            .unwrap();
        expect(r.header("grpc-status") == "16", || {
            format!(
                "failed call {i}: grpc-status {} (want 16)",
                r.header("grpc-status")
            )
        })?;
    }
    let r = send(s.addr, grpc_req("/r", Some(b"bad"), "grpc:16"))
        .await
        .unwrap();
    expect(r.header("grpc-status") == "8", || {
        format!(
            "after {BUDGET} UNAUTHENTICATED, grpc-status {} (want 8, RESOURCE_EXHAUSTED)",
            r.header("grpc-status")
        )
    })?;
    Ok(Verdict::Pass)
}

/// The retry layer retries a GET answered `UNAVAILABLE`, trailers-only.
async fn grpc_failure_retry(cell: Cell<'_>) -> CellResult {
    let attempts = retried(cell, tollgate::FailurePolicy::Open, "grpc:14", "grpc:0").await?;
    expect(attempts == 2, || {
        format!("{attempts} attempts for one UNAVAILABLE, want 2")
    })?;
    Ok(Verdict::Pass)
}

/// One GET through the cell's retry client (its budget under `policy`)
/// to an upstream that answers `fail`, then `ok`, alternately; the
/// attempts the upstream saw.
async fn retried(
    cell: Cell<'_>,
    policy: tollgate::FailurePolicy,
    fail: &'static str,
    ok: &'static str,
) -> Result<usize, String> {
    retried_on(cell, policy, fail, ok, false).await
}

/// [`retried`], on a store whose every call fails when `failing`.
async fn retried_on(
    cell: Cell<'_>,
    policy: tollgate::FailurePolicy,
    fail: &'static str,
    ok: &'static str,
    failing: bool,
) -> Result<usize, String> {
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&calls);
    let upstream = Router::new().route(
        "/r",
        get(move || {
            let n = seen.fetch_add(1, Ordering::SeqCst);
            let mut h = HeaderMap::new();
            let how = if n.is_multiple_of(2) { fail } else { ok };
            h.insert("x-answer", HeaderValue::from_static(how));
            async move { answer(&h) }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, upstream).await });
    let call = with_store(cell, policy, |store| match (store, failing) {
        (StoreChoice::Memory(s), false) => {
            Box::pin(call_once(client(s, addr, false))) as CallFuture
        }
        (StoreChoice::Redis(s), false) => Box::pin(call_once(client(s, addr, false))),
        (StoreChoice::Memory(s), true) => Box::pin(call_once(client(Failing(s), addr, false))),
        (StoreChoice::Redis(s), true) => Box::pin(call_once(client(Failing(s), addr, false))),
    });
    call.await?;
    Ok(calls.load(Ordering::SeqCst))
}

type CallFuture = Pin<Box<dyn Future<Output = Result<(), String>> + Send>>;

async fn call_once<C>(client: C) -> Result<(), String>
where
    C: Service<Request<Body>, Response = Response<Body>, Error = tollgate::BoxError>,
{
    let req = Request::get("http://upstream.test/r")
        .body(Body::empty())
        .unwrap();
    client.oneshot(req).await.map_err(|e| e.to_string())?;
    Ok(())
}

// ---------------------------------------------------------------------------
// Row 3: method and path forms cost what the route costs.

fn no_cost(cell: Cell<'_>) -> Option<Verdict> {
    match cell.layer {
        Layer::Bandwidth => Some(Verdict::NotApplicable(
            "paces bytes; a request has no cost of its own",
        )),
        Layer::Retry => Some(Verdict::NotApplicable(
            "a client's budget counts attempts, not costs",
        )),
        _ => None,
    }
}

/// What `GET /r` left of `m`'s budget, for `cell`'s layer.
fn left_after_one() -> u64 {
    u64::from(BUDGET) - R_COST
}

/// `reply` (to `what`) was charged what a first `GET /r` is.
fn charged_as_get(what: &str, reply: &Reply) -> Result<(), String> {
    expect(remaining(reply) == Some(left_after_one()), || {
        format!(
            "{what} (HTTP {}) left {:?} of {BUDGET}; a GET /r leaves {}",
            reply.status,
            remaining(reply),
            left_after_one()
        )
    })
}

async fn head_costs_get(cell: Cell<'_>) -> CellResult {
    if let Some(v) = no_cost(cell) {
        return Ok(v);
    }
    let backend = Backend::default();
    let s = serve(cell, Spec::default(), &backend, true).await;
    let r = send(s.addr, req(Method::HEAD, "/r", Some(b"h")))
        .await
        .unwrap();
    expect(r.status == StatusCode::OK, || {
        format!("HEAD: HTTP {}", r.status)
    })?;
    charged_as_get("HEAD /r", &r)?;
    Ok(Verdict::Pass)
}

async fn nested_route_cost(cell: Cell<'_>) -> CellResult {
    if let Some(v) = no_cost(cell) {
        return Ok(v);
    }
    for how in ["nest", "merge"] {
        let backend = Backend::default();
        let spec = Spec {
            cost_path: "/api/r",
            ..Spec::default()
        };
        // The layer sits on the inner router, as an app protecting one
        // part of itself does.
        let inner = backend.router();
        let s = match how {
            "nest" => {
                let outer = |protected: Router| Router::new().nest("/api", protected);
                serve_wrapped(cell, spec, inner, outer).await
            }
            _ => {
                let inner = Router::new().nest("/api", inner);
                let outer = |protected: Router| {
                    Router::new()
                        .route("/other", get(|| async { "other" }))
                        .merge(protected)
                };
                serve_wrapped(cell, spec, inner, outer).await
            }
        };
        let r = send(s, req(Method::GET, "/api/r", Some(b"n")))
            .await
            .unwrap();
        expect(r.status == StatusCode::OK, || {
            format!("{how}: HTTP {}", r.status)
        })?;
        charged_as_get(&format!("{how}: GET /api/r"), &r)?;
    }
    Ok(Verdict::Pass)
}

/// Serves `outer(inner behind the cell's layer)`.
async fn serve_wrapped(
    cell: Cell<'_>,
    spec: Spec,
    inner: Router,
    outer: impl FnOnce(Router) -> Router,
) -> SocketAddr {
    let protected = protect_on(cell, spec, inner, tollgate::FailurePolicy::Open);
    common::spawn(outer(protected.router)).await
}

async fn path_forms(cell: Cell<'_>) -> CellResult {
    if let Some(v) = no_cost(cell) {
        return Ok(v);
    }
    for path in ["/%72", "//r", "/x/../r", "/./r", "/r/"] {
        let backend = Backend::default();
        let s = serve(cell, Spec::default(), &backend, true).await;
        // The router may not route these forms; the limiter, in front of
        // it, must still charge what /r costs.
        let r = send(s.addr, req(Method::GET, path, Some(b"p")))
            .await
            .unwrap();
        charged_as_get(&format!("GET {path}"), &r)?;
    }
    Ok(Verdict::Pass)
}

async fn scoped_routes(cell: Cell<'_>) -> CellResult {
    if cell.layer == Layer::Retry {
        return Ok(Verdict::NotApplicable("a client's layer: no routes"));
    }
    // A body's pace has no fields to read: there the keyless requests tell.
    let fields = cell.layer != Layer::Bandwidth;
    let backend = Backend::default();
    let spec = Spec {
        routes: Some(("GET", "/r")),
        ..Spec::default()
    };
    let s = serve(cell, spec, &backend, true).await;
    // Out of scope: another route, another method, no key at all (in
    // scope, the default refuses it with a 400). Nothing is charged and
    // the limit says nothing.
    for (method, path, key) in [
        (Method::GET, "/s", Some(&b"k"[..])),
        (Method::POST, "/r", Some(b"k")),
        (Method::GET, "/s", None),
        (Method::POST, "/r", None),
    ] {
        let r = send(s.addr, req(method.clone(), path, key)).await.unwrap();
        expect(r.status == StatusCode::OK, || {
            format!("{method} {path} (key {key:?}): HTTP {}", r.status)
        })?;
        expect(!fields || remaining(&r).is_none(), || {
            format!("{method} {path} out of scope has the limit's fields: {r:?}")
        })?;
    }
    // In scope, in every form of the path and by HEAD: the first charge
    // is the only one so far; a keyless one is refused.
    let r = send(s.addr, req(Method::HEAD, "/x/../r/", Some(b"k")))
        .await
        .unwrap();
    if fields {
        charged_as_get("HEAD /x/../r/ after four out of scope", &r)?;
    }
    let r = send(s.addr, req(Method::GET, "/r", None)).await.unwrap();
    expect(r.status == StatusCode::BAD_REQUEST, || {
        format!("GET /r without a key: HTTP {}", r.status)
    })?;
    Ok(Verdict::Pass)
}

// ---------------------------------------------------------------------------
// Row 4: responses that stay open (SSE, downloads) hold what they should
// and nothing more: the service keeps admitting.

/// An open request: its head read, its body left open (and the
/// connection with it) until dropped.
struct Open {
    status: StatusCode,
    _body: hyper::body::Incoming,
    _conn: tokio::task::JoinHandle<()>,
}

/// Sends `GET path` with `key` and returns once the head has come back,
/// leaving the body unread and the connection open.
async fn open(addr: SocketAddr, path: &str, key: &str) -> Open {
    open_with(addr, path, key, &[]).await
}

/// [`open`], with extra headers.
async fn open_with(addr: SocketAddr, path: &str, key: &str, headers: &[(&str, &str)]) -> Open {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    let conn = tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut req = Request::get(path)
        .header("host", "localhost")
        .header("x-api-key", key)
        .body(http_body_util::Empty::<Bytes>::new())
        .unwrap();
    for (name, value) in headers {
        req.headers_mut().insert(
            http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
            HeaderValue::from_str(value).unwrap(),
        );
    }
    let res = sender.send_request(req).await.unwrap();
    let status = res.status();
    Open {
        status,
        _body: res.into_body(),
        _conn: conn,
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self._conn.abort();
    }
}

async fn long_bodies(cell: Cell<'_>) -> CellResult {
    if cell.layer == Layer::Retry {
        return Ok(Verdict::NotApplicable(
            "a client layer: its caller reads a long body, no budget is held",
        ));
    }
    let backend = Backend::default();
    let spec = Spec {
        adaptive: gradient_16,
        ..Spec::default()
    };
    // Sixteen clients hold an event stream open from boot, when the
    // gradient probes at its minimum of 16; then sixteen paced 1 MiB
    // downloads; then sixteen requests that ask for an upgrade (a layer
    // that offers upgrades hands their permits to the handler).
    let upgrade: &[(&str, &str)] = &[("upgrade", "websocket"), ("connection", "upgrade")];
    for (what, path, headers) in [
        ("event streams", "/long", &[][..]),
        ("paced 1 MiB downloads", "/download", &[][..]),
        ("upgrade streams", "/long", upgrade),
    ] {
        let s = serve(cell, spec, &backend, true).await;
        let mut streams = Vec::new();
        for i in 0..16 {
            let o = open_with(s.addr, path, &format!("sse-{i}"), headers).await;
            expect(o.status == StatusCode::OK, || {
                format!("{what}: stream {i}: HTTP {}", o.status)
            })?;
            streams.push(o);
        }
        for i in 0..32 {
            let key = format!("new-{i}");
            let r = send(s.addr, req(Method::GET, "/s", Some(key.as_bytes())))
                .await
                .unwrap();
            expect(r.status == StatusCode::OK, || {
                format!(
                    "with 16 {what} open, new request {i} got HTTP {}: {}",
                    r.status, r.body
                )
            })?;
        }
        drop(streams);
    }
    Ok(Verdict::Pass)
}

// ---------------------------------------------------------------------------
// Row 4b: a concurrency limit's `max_lifetime` ends a stream still running
// then, cleanly, and its permit comes back; a request that says `Upgrade`
// but is served as any other is no way round it (issue 34 item 3).

async fn lifetimes(cell: Cell<'_>) -> CellResult {
    match cell.layer {
        Layer::Concurrency | Layer::Adaptive => {}
        Layer::Retry => {
            return Ok(Verdict::NotApplicable(
                "a client layer: holds nothing while a channel lives",
            ))
        }
        Layer::Rate | Layer::Policy | Layer::Quota => {
            return Ok(Verdict::NotApplicable(
                "charges on arrival and holds no permit while a channel lives: a channel's \
                 lifetime is the ConcurrencyLayer's max_lifetime",
            ))
        }
        Layer::Bandwidth => {
            return Ok(Verdict::NotApplicable(
                "paces a channel's bytes and holds no permit while it lives: a channel's \
                 lifetime is the ConcurrencyLayer's max_lifetime",
            ))
        }
    }
    let backend = Backend::default();
    let spec = Spec {
        adaptive: gradient_16,
        max_lifetime: Some(Duration::from_millis(300)),
        ..Spec::default()
    };
    let s = serve(cell, spec, &backend, true).await;
    let upgrade: &[(&str, &str)] = &[("upgrade", "websocket"), ("connection", "upgrade")];
    for (what, headers) in [
        ("event streams", &[][..]),
        ("streams that say Upgrade", upgrade),
    ] {
        let mut streams = Vec::new();
        for i in 0..BUDGET {
            let o = open_with(s.addr, "/long", "chan", headers).await;
            expect(o.status == StatusCode::OK, || {
                format!("{what}: stream {i}: HTTP {}", o.status)
            })?;
            streams.push(o);
        }
        let full = send(s.addr, req(Method::GET, "/s", Some(b"chan")))
            .await
            .unwrap();
        expect(full.status == StatusCode::TOO_MANY_REQUESTS, || {
            format!(
                "{what}: the key's permits held, a new request got HTTP {}",
                full.status
            )
        })?;
        // Each ends by itself at the cap (well within 10 s), without an
        // error: the client reads a whole response.
        for (i, o) in streams.iter_mut().enumerate() {
            let ended = tokio::time::timeout(Duration::from_secs(10), async {
                while let Some(frame) = o._body.frame().await {
                    frame.map_err(|e| e.to_string())?;
                }
                Ok::<(), String>(())
            })
            .await;
            expect(matches!(ended, Ok(Ok(()))), || {
                format!("{what}: stream {i} did not end cleanly at its lifetime: {ended:?}")
            })?;
        }
        let again = send(s.addr, req(Method::GET, "/s", Some(b"chan")))
            .await
            .unwrap();
        expect(again.status == StatusCode::OK, || {
            format!(
                "{what}: after the streams ended, a new request got HTTP {}",
                again.status
            )
        })?;
    }
    Ok(Verdict::Pass)
}

// ---------------------------------------------------------------------------
// Row 5: a request cancelled before its response or mid-body, and one
// whose handler panics, give back what they hold.

async fn cancellation(cell: Cell<'_>) -> CellResult {
    match cell.layer {
        Layer::Concurrency | Layer::Adaptive => {}
        Layer::Rate | Layer::Policy | Layer::Quota => {
            return Ok(Verdict::NotApplicable(
                "charges on arrival and holds nothing; no refund on cancellation is promised",
            ))
        }
        Layer::Bandwidth => {
            return Ok(Verdict::NotApplicable(
                "holds no permit; a dropped body's unspent bytes go back (bandwidth unit tests)",
            ))
        }
        Layer::Retry => {
            return Ok(Verdict::NotApplicable(
                "holds no permit; a withdrawn retry is spent when it is sent",
            ))
        }
    }
    let backend = Backend::default();
    // An adaptive limit of at least the key's 8 (requests that hang hold
    // it until their head, as they should).
    let spec = Spec {
        adaptive: gradient_16,
        ..Spec::default()
    };
    let s = serve(cell, spec, &backend, true).await;
    // Each phase fills the key's 8 permits (which only works if the last
    // phase's all came back), checks the key is full, and cancels them.
    for (what, path) in [
        ("mid-body", "/long"),
        ("before the response", "/hang"),
        ("mid-body again", "/long"),
    ] {
        let held = fill(s.addr, path, what).await?;
        let r = send(s.addr, req(Method::GET, "/s", Some(b"c")))
            .await
            .unwrap();
        expect(r.status == StatusCode::TOO_MANY_REQUESTS, || {
            format!(
                "{what}: the key's 8 permits are held, yet HTTP {}",
                r.status
            )
        })?;
        for h in held {
            h.abort();
        }
    }
    fill(s.addr, "/long", "after the last cancellation").await?;
    // A panicking handler (behind CatchPanicLayer) releases its permit.
    for i in 0..2 * BUDGET {
        let r = send(s.addr, req(Method::GET, "/panic", Some(b"p")))
            .await
            .unwrap();
        expect(r.status == StatusCode::INTERNAL_SERVER_ERROR, || {
            format!("panic {i}: HTTP {}", r.status)
        })?;
    }
    let r = send(s.addr, req(Method::GET, "/s", Some(b"p")))
        .await
        .unwrap();
    expect(r.status == StatusCode::OK, || {
        format!("after panics: HTTP {}", r.status)
    })?;
    Ok(Verdict::Pass)
}

/// Holds `BUDGET` requests of key `c` to `path` open (one permit each),
/// each retried until admitted (a permit released on Redis, or by a
/// server noticing a closed connection, comes back a moment later); an
/// error if that takes five seconds.
async fn fill(
    addr: SocketAddr,
    path: &'static str,
    what: &str,
) -> Result<Vec<tokio::task::JoinHandle<()>>, String> {
    let mut held = Vec::new();
    for i in 0..BUDGET {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            if path == "/hang" {
                // Admitted, it never answers; refused, it answers at once.
                let call = send(addr, req(Method::GET, path, Some(b"c")));
                let task = tokio::spawn(async move {
                    let _ = call.await;
                });
                tokio::time::sleep(Duration::from_millis(20)).await;
                if !task.is_finished() {
                    held.push(task);
                    break;
                }
            } else {
                let o = open(addr, path, "c").await;
                if o.status == StatusCode::OK {
                    held.push(tokio::spawn(async move {
                        let _o = o;
                        std::future::pending::<()>().await;
                    }));
                    break;
                }
            }
            if tokio::time::Instant::now() > deadline {
                return Err(format!("{what}: permit {i} never came back"));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    Ok(held)
}

// ---------------------------------------------------------------------------
// Row 6: the store is down; each failure policy does what it says, at the
// layer.

async fn store_down(cell: Cell<'_>) -> CellResult {
    if cell.backing == Backing::Memory {
        return Ok(Verdict::NotApplicable("the in-process store cannot fail"));
    }
    if cell.layer == Layer::Bandwidth {
        return Ok(Verdict::NotApplicable(
            "pacing never refuses: a failed store stops pacing the body (documented)",
        ));
    }
    // Dead (nothing listens), and slow: every answer later than the
    // store's 200 ms timeout, through a proxy that delays each way.
    let port: u16 = cell.redis.rsplit(':').next().unwrap().parse().unwrap();
    let slow = tollgate_redis::testing::Delayed::start(port, Duration::from_millis(300)).await;
    for (fault, url) in [("dead", dead_redis()), ("slow", slow.url())] {
        store_fault(cell, fault, &url).await?;
    }
    Ok(Verdict::Pass)
}

/// Row 6 for one kind of fault: the store at `url` is dead or slow.
async fn store_fault(cell: Cell<'_>, fault: &str, url: &str) -> Result<(), String> {
    let cell = Cell { redis: url, ..cell };
    for (name, policy) in [
        ("Open", FailurePolicy::Open),
        ("Closed", FailurePolicy::Closed),
        ("Fallback", FailurePolicy::fallback()),
    ] {
        if cell.layer == Layer::Retry {
            store_down_retry(cell, name, policy)
                .await
                .map_err(|e| format!("{fault}: {e}"))?;
            continue;
        }
        let backend = Backend::default();
        let s = serve_on(cell, Spec::default(), backend.router(), true, policy).await;
        let mut statuses = Vec::new();
        // GET /r costs 4 of 8: two fit a limit that holds.
        for _ in 0..3 {
            let r = send(s.addr, req(Method::GET, "/r", Some(b"s")))
                .await
                .unwrap();
            statuses.push(r.status.as_u16());
        }
        let want: &[u16] = match (name, cell.layer) {
            ("Open", _) => &[200, 200, 200],
            ("Closed", _) => &[429, 429, 429],
            // A concurrency permit is back once each response is read.
            ("Fallback", Layer::Concurrency | Layer::Adaptive) => &[200, 200, 200],
            _ => &[200, 200, 429],
        };
        expect(statuses == want, || {
            format!("{fault}, {name}: statuses {statuses:?}, want {want:?}")
        })?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Row 6d: a Redis 20 ms away each way, well within the store's timeout:
// its answers are its own (a limit holds exactly, though the policy would
// admit everything), and clients that send their next request as soon as
// the last response ended are never refused by their own released
// permits, whose releases may still be on their way.

async fn store_slow_in_time(cell: Cell<'_>) -> CellResult {
    if cell.backing == Backing::Memory {
        return Ok(Verdict::NotApplicable(
            "the in-process store answers at once",
        ));
    }
    match cell.layer {
        Layer::Bandwidth => {
            return Ok(Verdict::NotApplicable(
                "pacing never refuses: a slow store only delays the body",
            ))
        }
        Layer::Retry => {
            return Ok(Verdict::NotApplicable(
                "a client layer: its budget's deposits and withdrawals are rows 6 and 10",
            ))
        }
        _ => {}
    }
    let port: u16 = cell.redis.rsplit(':').next().unwrap().parse().unwrap();
    let slow = tollgate_redis::testing::Delayed::start(port, Duration::from_millis(20)).await;
    let url = slow.url();
    let cell = Cell {
        redis: &url,
        ..cell
    };
    let backend = Backend::default();
    let s = serve_on(
        cell,
        Spec::default(),
        backend.router(),
        true,
        FailurePolicy::Open,
    )
    .await;
    match cell.layer {
        Layer::Concurrency | Layer::Adaptive => {
            // The key's 8 permits, 8 clients, 12 requests each, back to back.
            let mut clients = tokio::task::JoinSet::new();
            for c in 0..8 {
                let addr = s.addr;
                clients.spawn(async move {
                    let mut refused = Vec::new();
                    for i in 0..12 {
                        let r = send(addr, req(Method::GET, "/s", Some(b"b2b")))
                            .await
                            .unwrap();
                        if r.status != StatusCode::OK {
                            refused.push(format!("client {c}, request {i}: HTTP {}", r.status));
                        }
                    }
                    refused
                });
            }
            let mut refused = Vec::new();
            while let Some(r) = clients.join_next().await {
                refused.extend(r.unwrap());
            }
            expect(refused.is_empty(), || {
                format!("refused by permits their own responses gave back: {refused:?}")
            })?;
        }
        _ => {
            // GET /s costs 1 of 8: eight pass, the ninth is the store's 429
            // (failing open would pass it).
            let mut statuses = Vec::new();
            for _ in 0..9 {
                let r = send(s.addr, req(Method::GET, "/s", Some(b"b2b")))
                    .await
                    .unwrap();
                statuses.push(r.status.as_u16());
            }
            let want = [200, 200, 200, 200, 200, 200, 200, 200, 429];
            expect(statuses == want, || {
                format!("statuses {statuses:?}, want {want:?}")
            })?;
        }
    }
    Ok(Verdict::Pass)
}

/// A retry budget on a dead store: `Open` grants every retry (as if there
/// were no budget), `Closed` none, `Fallback` what a fresh local budget
/// (its floor) grants.
async fn store_down_retry(
    cell: Cell<'_>,
    name: &str,
    policy: tollgate::FailurePolicy,
) -> Result<(), String> {
    let attempts = retried(cell, policy, "status:503", "ok").await?;
    let want = if name == "Closed" { 1 } else { 2 };
    expect(attempts == want, || {
        format!("{name}: {attempts} attempts for one 503, want {want}")
    })
}

// ---------------------------------------------------------------------------
// Row 6b: a store that answers with an error (no failure policy of its own
// answers for it): each layer does what its `on_store_error` says.

/// The cell's store, every call of which fails.
#[derive(Clone)]
struct Failing<S>(S);

#[derive(Clone)]
struct FailingHandle<L>(L);

fn store_error<T>() -> std::future::Ready<Result<T, StoreError>> {
    std::future::ready(Err(failed()))
}

fn failed() -> StoreError {
    StoreError::new(StoreErrorKind::Unavailable, "the matrix's failing store")
}

impl<S: Store> Store for Failing<S> {
    type Limiter = FailingHandle<S::Limiter>;
    type ConcurrencyLimiter = FailingHandle<S::ConcurrencyLimiter>;
    fn limiter(&self, rule: &Rule) -> Result<Self::Limiter, ConfigError> {
        self.0.limiter(rule).map(FailingHandle)
    }
    fn concurrency_limiter(
        &self,
        rule: &ConcurrencyRule,
    ) -> Result<Self::ConcurrencyLimiter, ConfigError> {
        self.0.concurrency_limiter(rule).map(FailingHandle)
    }
}

impl<S: QuotaStore> QuotaStore for Failing<S> {
    type QuotaLimiter = FailingHandle<S::QuotaLimiter>;
    fn quota_limiter(&self, rule: &QuotaRule) -> Result<Self::QuotaLimiter, ConfigError> {
        self.0.quota_limiter(rule).map(FailingHandle)
    }
}

impl<L: Limiter> Limiter for FailingHandle<L> {
    type DecideFuture = std::future::Ready<Result<Decision, StoreError>>;
    type RefundFuture = std::future::Ready<Result<(), StoreError>>;
    fn rule(&self) -> &Rule {
        self.0.rule()
    }
    fn decide(&self, _key: &[u8], _cost: u64) -> Self::DecideFuture {
        store_error()
    }
    fn refund(&self, _key: &[u8], _cost: u64) -> Self::RefundFuture {
        store_error()
    }
}

impl<L: ConcurrencyLimiter> ConcurrencyLimiter for FailingHandle<L> {
    type AcquireFuture = std::future::Ready<Result<Acquire, StoreError>>;
    type ReleaseFuture = std::future::Ready<Result<(), StoreError>>;
    type HeldFuture = std::future::Ready<Result<u64, StoreError>>;
    fn rule(&self) -> &ConcurrencyRule {
        self.0.rule()
    }
    fn acquire(&self, _key: &[u8], _permits: u32, _ceiling: u32) -> Self::AcquireFuture {
        store_error()
    }
    fn release(&self, _key: &[u8], _lease: Lease) -> Self::ReleaseFuture {
        store_error()
    }
    fn held(&self, _key: &[u8]) -> Self::HeldFuture {
        store_error()
    }
}

impl<S: RetryBudgetStore> RetryBudgetStore for Failing<S> {
    type RetryBudgetLimiter = FailingHandle<S::RetryBudgetLimiter>;
    fn retry_budget(
        &self,
        rule: &RetryBudgetRule,
    ) -> Result<Self::RetryBudgetLimiter, ConfigError> {
        self.0.retry_budget(rule).map(FailingHandle)
    }
}

impl<L: RetryBudgetLimiter> RetryBudgetLimiter for FailingHandle<L> {
    type DepositFuture = std::future::Ready<Result<(), StoreError>>;
    type WithdrawFuture = std::future::Ready<Result<Withdrawal, StoreError>>;
    fn rule(&self) -> &RetryBudgetRule {
        self.0.rule()
    }
    fn deposit(&self, _key: &[u8]) -> Self::DepositFuture {
        store_error()
    }
    fn withdraw(&self, _key: &[u8]) -> Self::WithdrawFuture {
        store_error()
    }
}

impl<L: QuotaLimiter> QuotaLimiter for FailingHandle<L> {
    type Future = std::future::Ready<Result<QuotaDecision, StoreError>>;
    fn rule(&self) -> &QuotaRule {
        self.0.rule()
    }
    fn consume(&self, _key: &[u8], _cost: u64) -> Self::Future {
        store_error()
    }
    fn refund(&self, _key: &[u8], _cost: u64) -> Self::Future {
        store_error()
    }
    fn reset(&self, _key: &[u8]) -> Self::Future {
        store_error()
    }
    fn grant(&self, _key: &[u8], _units: u64) -> Self::Future {
        store_error()
    }
}

async fn store_errors(cell: Cell<'_>) -> CellResult {
    match cell.layer {
        Layer::Bandwidth => {
            return Ok(Verdict::NotApplicable(
                "pacing never refuses: a failed store stops pacing the body (documented)",
            ))
        }
        Layer::Retry => {
            // A budget whose store fails grants no retry: one attempt for
            // a 503 that a working budget retries.
            let attempts = retried_on(cell, FailurePolicy::Open, "status:503", "ok", true).await?;
            expect(attempts == 1, || {
                format!("{attempts} attempts for one 503 on a failing budget store, want 1")
            })?;
            return Ok(Verdict::Pass);
        }
        _ => {}
    }
    for on in [OnStoreError::Admit, OnStoreError::Refuse] {
        let backend = Backend::default();
        let spec = Spec {
            on_store_error: on,
            ..Spec::default()
        };
        let protected = with_store(cell, tollgate::FailurePolicy::Open, |store| match store {
            StoreChoice::Memory(s) => {
                protect(cell.layer, cell.file, Failing(s), spec, backend.router())
            }
            StoreChoice::Redis(s) => {
                protect(cell.layer, cell.file, Failing(s), spec, backend.router())
            }
        });
        let s = common::spawn(protected.router).await;
        let mut statuses = Vec::new();
        for _ in 0..3 {
            let r = send(s, req(Method::GET, "/r", Some(b"e"))).await.unwrap();
            if on == OnStoreError::Refuse {
                expect(r.header("retry-after") == "1", || {
                    format!("Refuse: retry-after {:?}, want 1", r.header("retry-after"))
                })?;
            }
            statuses.push(r.status.as_u16());
        }
        let want: &[u16] = match on {
            OnStoreError::Admit => &[200, 200, 200],
            _ => &[429, 429, 429],
        };
        expect(statuses == want, || {
            format!("{on:?}: statuses {statuses:?}, want {want:?}")
        })?;
        let served = backend.hits();
        let want_served = if on == OnStoreError::Admit { 3 } else { 0 };
        expect(served == want_served, || {
            format!("{on:?}: the service served {served}, want {want_served}")
        })?;
    }
    Ok(Verdict::Pass)
}

// ---------------------------------------------------------------------------
// Row 7: a limit keyed by API key, paired with the same limit keyed by the
// client's address (as the quickstart pairs every limit): a client that
// rotates its API key gets a fresh per-key budget each time, and nothing
// past the address's.

async fn key_rotation(cell: Cell<'_>) -> CellResult {
    match cell.layer {
        Layer::Bandwidth => return Ok(Verdict::NotApplicable(
            "paces rather than refuses: a per-address pace needs a clock this row does not control",
        )),
        Layer::Retry => {
            return Ok(Verdict::NotApplicable(
                "a client's budget has no client key",
            ))
        }
        _ => {}
    }
    let backend = Backend::default();
    let per_address = Spec {
        key: KeyKind::Peer,
        rule: "m-address",
        budget: 2 * BUDGET,
        ..Spec::default()
    };
    let (addr_layer, inner) = match cell.layer {
        // One policy holds both rules.
        Layer::Policy => (None, Layer::Policy),
        Layer::Adaptive => (Some(Layer::Concurrency), Layer::Adaptive),
        other => (Some(other), other),
    };
    let router = with_store(cell, FailurePolicy::Open, |store| match store {
        StoreChoice::Memory(s) => paired(cell, inner, addr_layer, s, per_address, backend.router()),
        StoreChoice::Redis(s) => paired(cell, inner, addr_layer, s, per_address, backend.router()),
    });
    let addr = common::spawn(router).await;
    let concurrency = matches!(cell.layer, Layer::Concurrency | Layer::Adaptive);
    let (path, passes) = if concurrency {
        // Held bodies, one permit each: 16 for the address.
        ("/long", 2 * BUDGET as usize)
    } else {
        // `GET /r` costs 4: the address's 16 hold four.
        ("/r", (2 * BUDGET / R_COST as u32) as usize)
    };
    let mut statuses = Vec::new();
    let mut held = Vec::new();
    for i in 0..passes + 2 {
        let key = format!("rotated-{i}");
        if concurrency {
            let open = open(addr, path, &key).await;
            statuses.push(open.status.as_u16());
            held.push(open);
        } else {
            let r = send(addr, req(Method::GET, path, Some(key.as_bytes())))
                .await
                .unwrap();
            if r.status == StatusCode::TOO_MANY_REQUESTS {
                expect(r.body.contains("m-address"), || {
                    format!("refused by another rule: {}", r.body)
                })?;
            }
            statuses.push(r.status.as_u16());
        }
    }
    let want: Vec<u16> = (0..passes + 2)
        .map(|i| if i < passes { 200 } else { 429 })
        .collect();
    expect(statuses == want, || {
        format!("rotating keys: statuses {statuses:?}, want {want:?}")
    })?;
    Ok(Verdict::Pass)
}

/// `router` behind the cell's layer keyed by API key and, outside it, the
/// same kind of limit keyed by address (`per_address`); for the policy,
/// one policy with both rules.
fn paired<St>(
    cell: Cell<'_>,
    layer: Layer,
    addr_layer: Option<Layer>,
    store: St,
    per_address: Spec,
    router: Router,
) -> Router
where
    St: Store + QuotaStore,
{
    if cell.file {
        // One file, as the quickstart's: both limits in one `Tollgate`.
        let outer = addr_layer.unwrap_or(layer);
        let limits = [(layer, Spec::default()), (outer, per_address)];
        return protect_file(&limits, store, router).router;
    }
    match addr_layer {
        Some(outer) => {
            let inner = protect(layer, false, store.clone(), Spec::default(), router).router;
            protect(outer, false, store, per_address, inner).router
        }
        None => {
            let slow = Rate::new(1, Duration::from_secs(3_600));
            let cost = ByRoute::new(1).route(Some(Method::GET), "/r", R_COST);
            let policy = PolicyLayer::<Body>::builder()
                .rule(
                    RateRule::new("m", Limit::gcra(slow, BUDGET), TestKey(KeyKind::ApiKey))
                        .cost(cost.clone()),
                )
                .rule(
                    RateRule::new(
                        "m-address",
                        Limit::gcra(slow, 2 * BUDGET),
                        TestKey(KeyKind::Peer),
                    )
                    .cost(cost),
                )
                .store(store)
                .build()
                .unwrap();
            router.layer(policy)
        }
    }
}

// ---------------------------------------------------------------------------
// Row 8: an idempotent repeat is free only for the same client, method
// and route, and never when the store could not answer.

fn with_idem(method: Method, path: &str, key: &[u8], idem: &str) -> Request<Bytes> {
    let mut r = req(method, path, Some(key));
    r.headers_mut()
        .insert("idempotency-key", HeaderValue::from_str(idem).unwrap());
    r
}

async fn idempotency(cell: Cell<'_>) -> CellResult {
    if cell.layer != Layer::Policy {
        return Ok(Verdict::NotApplicable("has no idempotent repeats"));
    }
    let spec = Spec {
        idempotency: true,
        ..Spec::default()
    };
    let backend = Backend::default();
    let s = serve(cell, spec, &backend, true).await;
    // POST costs 1 of 8.
    let first = send(s.addr, with_idem(Method::POST, "/s", b"i", "K"))
        .await
        .unwrap();
    expect(remaining(&first) == Some(7), || {
        format!("first: left {:?}", remaining(&first))
    })?;
    for _ in 0..3 {
        let r = send(s.addr, with_idem(Method::POST, "/s", b"i", "K"))
            .await
            .unwrap();
        expect(
            r.status == StatusCode::OK && remaining(&r).is_none(),
            || {
                format!(
                    "repeat: HTTP {}, left {:?} (want 200, uncharged)",
                    r.status,
                    remaining(&r)
                )
            },
        )?;
    }
    // Another route, another client: charged.
    let other = send(s.addr, with_idem(Method::POST, "/r", b"i", "K"))
        .await
        .unwrap();
    expect(remaining(&other) == Some(6), || {
        format!("K on another route: left {:?}, want 6", remaining(&other))
    })?;
    let stranger = send(s.addr, with_idem(Method::POST, "/s", b"j", "K"))
        .await
        .unwrap();
    expect(remaining(&stranger) == Some(7), || {
        format!(
            "K from another client: left {:?}, want 7",
            remaining(&stranger)
        )
    })?;
    // K with another body (its length says so): charged.
    let mut other_body = with_idem(Method::POST, "/s", b"i", "K");
    *other_body.body_mut() = Bytes::from_static(b"another body");
    let other_body = send(s.addr, other_body).await.unwrap();
    expect(remaining(&other_body) == Some(5), || {
        format!(
            "K with another body: left {:?}, want 5",
            remaining(&other_body)
        )
    })?;
    // A first request the service fails keeps no marker: its retry is
    // charged, not replayed free.
    for want in [4, 3] {
        let mut failed = with_idem(Method::POST, "/s", b"i", "F");
        failed
            .headers_mut()
            .insert("x-answer", HeaderValue::from_static("status:500"));
        let r = send(s.addr, failed).await.unwrap();
        expect(remaining(&r) == Some(want), || {
            format!(
                "a failed first request's retry: HTTP {}, left {:?}, want {want}",
                r.status,
                remaining(&r)
            )
        })?;
    }
    if cell.backing == Backing::Memory {
        return Ok(Verdict::Pass);
    }
    // Redis down: a random Idempotency-Key is no repeat under any policy.
    let down = dead_redis();
    let cell = Cell {
        redis: &down,
        ..cell
    };
    for (name, policy, want) in [
        ("Closed", FailurePolicy::Closed, [429u16; 10]),
        ("Fallback", FailurePolicy::fallback(), {
            let mut w = [200u16; 10];
            w[8] = 429;
            w[9] = 429;
            w
        }),
    ] {
        let s = serve_on(cell, spec, Backend::default().router(), true, policy).await;
        let mut got = [0u16; 10];
        for (i, g) in got.iter_mut().enumerate() {
            let idem = format!("random-{i}");
            *g = send(s.addr, with_idem(Method::POST, "/s", b"i", &idem))
                .await
                .unwrap()
                .status
                .as_u16();
        }
        expect(got == want, || {
            format!("{name}, Redis down, fresh Idempotency-Keys: {got:?}, want {want:?}")
        })?;
    }
    Ok(Verdict::Pass)
}

// ---------------------------------------------------------------------------
// Row 9: a policy file reloaded while requests run: each request is
// decided by the old policy or the new one, never a mix; a rule the reload
// leaves as it was keeps its state; what only code can set (a custom
// rejection) is still there afterwards.

const RELOAD_V1: &str = r#"
[[rules]]
name = "m"
key = "header:x-api-key"
rate = "1/h"
burst = 8
cost = { default = 1, routes = [{ method = "GET", path = "/r", cost = 4 }] }
"#;

/// V1 and one more rule.
fn reload_v2() -> String {
    format!(
        "{RELOAD_V1}\n[[rules]]\nname = \"extra\"\nkey = \"header:x-api-key\"\nrate = \"1/h\"\nburst = 100\n"
    )
}

/// What only code can add: a rejection of the service's own.
fn custom_rejection(
    b: tollgate::policy::PolicyLayerBuilder<Body, MemoryStore>,
) -> tollgate::policy::PolicyLayerBuilder<Body, MemoryStore> {
    b.rejection(|r| {
        let mut res = Response::new(Bytes::from(format!("custom: {}", r.rule)));
        *res.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
        res
    })
}

async fn reload_mid_traffic(cell: Cell<'_>) -> CellResult {
    if cell.file {
        return reload_file_mid_traffic(cell).await;
    }
    if cell.layer != Layer::Policy {
        return Ok(Verdict::NotApplicable(
            "declared in code: its column from a policy file reloads",
        ));
    }
    let dir = std::env::temp_dir().join(format!("tollgate-matrix-{}", unique_prefix()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("policy.toml");
    std::fs::write(&path, RELOAD_V1).unwrap();
    let file = tollgate::config::PolicyFile::read(&path).map_err(|e| e.to_string())?;
    let backend = Backend::default();
    let (router, reloader) = with_store(cell, FailurePolicy::Open, |store| match store {
        StoreChoice::Memory(s) => reloadable(&path, &file, s, backend.router()),
        StoreChoice::Redis(s) => reloadable(&path, &file, s, backend.router()),
    });
    let addr = common::spawn(router).await;
    let get = || send(addr, req(Method::GET, "/r", Some(b"k")));

    // One request under v1: 4 of 8 left.
    let first = get().await.unwrap();
    let v1_policy = first.header("ratelimit-policy").to_owned();
    expect(
        first.status == StatusCode::OK && remaining(&first) == Some(4),
        || format!("v1: {} r={:?}", first.status, remaining(&first)),
    )?;
    // v2 adds a rule; `m` is as it was, so it keeps its 4.
    std::fs::write(&path, reload_v2()).unwrap();
    expect(reload(&reloader)? == "applied", || {
        "v2 was not applied".into()
    })?;
    let second = get().await.unwrap();
    let v2_policy = second.header("ratelimit-policy").to_owned();
    expect(
        second.status == StatusCode::OK && remaining(&second) == Some(0),
        || {
            format!(
                "after the reload: {} r={:?} (an unchanged rule keeps its state)",
                second.status,
                remaining(&second)
            )
        },
    )?;
    expect(
        v2_policy.contains("\"extra\"") && !v1_policy.contains("\"extra\""),
        || format!("policies: v1 {v1_policy:?}, v2 {v2_policy:?}"),
    )?;
    // The custom rejection is still the one answering.
    let third = get().await.unwrap();
    expect(
        third.status == StatusCode::SERVICE_UNAVAILABLE && third.body == "custom: m",
        || {
            format!(
                "after the reload, a refusal: {} {:?}",
                third.status, third.body
            )
        },
    )?;

    // Reloads back and forth while requests run: every response was
    // decided by one policy whole.
    let seen = flip_under_traffic(addr, "/r", &path, reloader, |v2| {
        if v2 {
            reload_v2()
        } else {
            RELOAD_V1.to_owned()
        }
    })
    .await?;
    for (status, policy) in seen {
        expect(
            status == StatusCode::OK && (policy == v1_policy || policy == v2_policy),
            || format!("mid-reload: {status} under policy {policy:?}"),
        )?;
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(Verdict::Pass)
}

/// Row 9 for a `Tollgate` over the cell's limit in a file: a reload
/// that adds a second limit of the same section keeps the first's state
/// (its units spent, its permits held), and while reloads flip between
/// the two files, every response is decided by one file whole.
async fn reload_file_mid_traffic(cell: Cell<'_>) -> CellResult {
    let layer = cell.layer;
    let dir = std::env::temp_dir().join(format!("tollgate-matrix-{}", unique_prefix()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("policy.toml");
    let text = |extra: bool| {
        let (mut top, mut entries) = file_entry(layer, &Spec::default());
        if extra {
            let spec = Spec {
                rule: "extra",
                budget: 100,
                ..Spec::default()
            };
            let (t, e) = file_entry(layer, &spec);
            top.push_str(&t);
            entries.push_str(&format!("\n{e}"));
        }
        format!("{top}{entries}")
    };
    std::fs::write(&path, text(false)).unwrap();
    let file = tollgate::config::PolicyFile::read(&path).map_err(|e| e.to_string())?;
    let backend = Backend::default();
    let (router, reloader) = with_store(cell, FailurePolicy::Open, |store| {
        fn gate<St: Store + QuotaStore + Send + Sync + 'static>(
            path: &std::path::Path,
            file: &tollgate::config::PolicyFile,
            store: St,
            router: Router,
        ) -> (Router, Reload) {
            let gate = tollgate::config::Tollgate::new(file, &store).unwrap();
            let reloader = gate.reloader(path, file, store, |b| b);
            (router.layer(gate), Box::new(move || reloader.reload()))
        }
        match store {
            StoreChoice::Memory(s) => gate(&path, &file, s, backend.router()),
            StoreChoice::Redis(s) => gate(&path, &file, s, backend.router()),
        }
    });
    let addr = common::spawn(router).await;
    let (path_of_traffic, policy_header) = match layer {
        Layer::Policy | Layer::Quota => {
            // One request under v1: 4 of 8 left; after the reload, the
            // unchanged limit has 0 left.
            let get = || send(addr, req(Method::GET, "/r", Some(b"k")));
            let first = get().await.unwrap();
            expect(
                first.status == StatusCode::OK && remaining(&first) == Some(4),
                || format!("v1: {} r={:?}", first.status, remaining(&first)),
            )?;
            std::fs::write(&path, text(true)).unwrap();
            expect(reload(&reloader)? == "applied", || {
                "v2 was not applied".into()
            })?;
            let second = get().await.unwrap();
            expect(
                second.status == StatusCode::OK && remaining(&second) == Some(0),
                || {
                    format!(
                        "after the reload: {} r={:?} (an unchanged limit keeps its state)",
                        second.status,
                        remaining(&second)
                    )
                },
            )?;
            expect(
                second.header("ratelimit-policy").contains("\"extra\""),
                || format!("v2's policy: {:?}", second.header("ratelimit-policy")),
            )?;
            ("/r", true)
        }
        Layer::Concurrency | Layer::Adaptive => {
            // v1's permits held across the reload still count.
            let mut held = Vec::new();
            for i in 0..BUDGET {
                let o = open(addr, "/long", "k").await;
                expect(o.status == StatusCode::OK, || {
                    format!("permit {i}: {}", o.status)
                })?;
                held.push(o);
            }
            std::fs::write(&path, text(true)).unwrap();
            expect(reload(&reloader)? == "applied", || {
                "v2 was not applied".into()
            })?;
            let past = open(addr, "/long", "k").await;
            expect(past.status == StatusCode::TOO_MANY_REQUESTS, || {
                format!(
                    "after the reload, a permit past the {BUDGET} held: {} (held permits must still count)",
                    past.status
                )
            })?;
            drop(past);
            drop(held.pop());
            let mut back = false;
            for _ in 0..100 {
                if open(addr, "/long", "k").await.status == StatusCode::OK {
                    back = true;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            expect(back, || {
                "a permit given back after the reload never came back".into()
            })?;
            drop(held);
            // `/s` holds one permit (`/r` four: two at once would pass
            // the adaptive limit's 5).
            ("/s", true)
        }
        // Pacing sends no limit fields: every body whole is what counts.
        _ => ("/r", false),
    };

    let seen = flip_under_traffic(addr, path_of_traffic, &path, reloader, text).await?;
    let mut policies = std::collections::BTreeSet::new();
    for (status, policy) in seen {
        expect(status == StatusCode::OK, || {
            format!("mid-reload: {status} under policy {policy:?}")
        })?;
        policies.insert(policy);
    }
    let _ = std::fs::remove_dir_all(&dir);
    if policy_header {
        // Each response names the limits of one file: `m` alone, or `m`
        // and `extra`.
        for p in &policies {
            let whole = p.contains("\"m\"")
                && (p.matches("\"extra\"").count() <= 1)
                && p.matches("\"m\"").count() == 1;
            expect(whole, || {
                format!("mid-reload: a policy of no one file: {p:?}")
            })?;
        }
    }
    Ok(Verdict::Pass)
}

/// Four clients send 25 requests each (a key each) to `route` at `addr`
/// while the file at `path` flips between `text(false)` and `text(true)`,
/// each reloaded at once; what each response said (its status and
/// `RateLimit-Policy`).
async fn flip_under_traffic(
    addr: SocketAddr,
    route: &'static str,
    path: &std::path::Path,
    reloader: Reload,
    text: impl Fn(bool) -> String,
) -> Result<Vec<(StatusCode, String)>, String> {
    let sent = Arc::new(AtomicUsize::new(0));
    let mut clients = Vec::new();
    for c in 0..4u8 {
        let sent = Arc::clone(&sent);
        clients.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            for i in 0..25u32 {
                let key = format!("mid-{c}-{i}");
                let r = send(addr, req(Method::GET, route, Some(key.as_bytes())))
                    .await
                    .unwrap();
                sent.fetch_add(1, Ordering::SeqCst);
                seen.push((r.status, r.header("ratelimit-policy").to_owned()));
            }
            seen
        }));
    }
    let mut flips = 0;
    while sent.load(Ordering::SeqCst) < 100 && flips < 1_000 {
        std::fs::write(path, text(flips % 2 == 1)).unwrap();
        reload(&reloader)?;
        flips += 1;
        tokio::task::yield_now().await;
    }
    let mut seen = Vec::new();
    for client in clients {
        seen.extend(client.await.unwrap());
    }
    expect(flips > 1, || format!("only {flips} reloads ran"))?;
    Ok(seen)
}

type Reload =
    Box<dyn Fn() -> Result<tollgate::config::Reloaded, tollgate::config::FileError> + Send>;

/// The policy in `file` on `store` with the custom rejection, in front of
/// `router`, and a way to reload it from `path`.
fn reloadable<St: Store>(
    path: &std::path::Path,
    file: &tollgate::config::PolicyFile,
    store: St,
    router: Router,
) -> (Router, Reload)
where
    St::Limiter: Send + Sync,
{
    let layer = custom_rejection(file.builder::<Body>().unwrap())
        .store(store.clone())
        .build()
        .unwrap();
    let reloader =
        tollgate::config::Reloader::new(path, file, store, &layer).customize(custom_rejection);
    (router.layer(layer), Box::new(move || reloader.reload()))
}

fn reload(reloader: &Reload) -> Result<&'static str, String> {
    match reloader() {
        Ok(tollgate::config::Reloaded::Applied) => Ok("applied"),
        Ok(_) => Ok("unchanged"),
        Err(e) => Err(format!("a reload failed: {e}")),
    }
}

// ---------------------------------------------------------------------------
// Row 10: hostile key values are keys like any other: limited, never a
// 5xx.

async fn hostile_keys(cell: Cell<'_>) -> CellResult {
    if cell.layer == Layer::Retry {
        return hostile_hints(cell).await;
    }
    if cell.layer == Layer::Bandwidth {
        return Ok(Verdict::NotApplicable(
            "paces bytes; refuses nothing a key could dodge",
        ));
    }
    let backend = Backend::default();
    let s = serve(cell, Spec::default(), &backend, true).await;
    let big = vec![b'k'; 64 * 1024];
    for (what, key) in [("64 KiB", &big[..]), ("non-UTF-8", &b"\xff\xfe\x80"[..])] {
        let first = send(s.addr, req(Method::GET, "/r", Some(key)))
            .await
            .unwrap();
        expect(first.status == StatusCode::OK, || {
            format!("{what} key: HTTP {}", first.status)
        })?;
        charged_as_get(&format!("{what} key: GET /r"), &first)?;
        if matches!(cell.layer, Layer::Concurrency | Layer::Adaptive) {
            continue; // a permit is back when its response was read
        }
        send(s.addr, req(Method::GET, "/r", Some(key)))
            .await
            .unwrap();
        let third = send(s.addr, req(Method::GET, "/r", Some(key)))
            .await
            .unwrap();
        expect(third.status == StatusCode::TOO_MANY_REQUESTS, || {
            format!("{what} key: third GET got HTTP {} (want 429)", third.status)
        })?;
    }
    Ok(Verdict::Pass)
}

/// Costs a client names: `u64::MAX` is refused (429, never a 500 or a
/// panic) and charges nothing; 0 is clamped to 1 (a client cannot make a
/// request free: `HeaderCost` documents it). After both, what is left is
/// the budget less that one unit: a request for all of it passes and
/// leaves nothing. (In flight, the unit came back with its response: the
/// per-key limit shows the whole budget, less the request itself.)
async fn hostile_costs(cell: Cell<'_>) -> CellResult {
    match cell.layer {
        Layer::Retry => {
            return Ok(Verdict::NotApplicable(
                "a retry costs one withdrawal; no cost function",
            ))
        }
        Layer::Bandwidth => return Ok(Verdict::NotApplicable("its cost is the body's bytes")),
        _ => {}
    }
    let backend = Backend::default();
    let spec = Spec {
        header_cost: true,
        ..Spec::default()
    };
    let s = serve(cell, spec, &backend, true).await;
    let costing = |cost: &str| {
        let mut r = req(Method::GET, "/s", Some(b"k"));
        r.headers_mut()
            .insert("x-cost", HeaderValue::from_str(cost).unwrap());
        r
    };
    let max = send(s.addr, costing(&u64::MAX.to_string())).await.unwrap();
    expect(max.status == StatusCode::TOO_MANY_REQUESTS, || {
        format!("cost u64::MAX: HTTP {} (want 429)", max.status)
    })?;
    expect(backend.hits() == 0, || {
        "cost u64::MAX reached the service".into()
    })?;
    let zero = send(s.addr, costing("0")).await.unwrap();
    expect(zero.status == StatusCode::OK, || {
        format!("cost 0: HTTP {}", zero.status)
    })?;
    expect(remaining(&zero) == Some(u64::from(BUDGET) - 1), || {
        format!("cost 0 (clamped to 1): {:?} left", remaining(&zero))
    })?;
    let in_flight = matches!(cell.layer, Layer::Concurrency | Layer::Adaptive);
    let (rest, left) = match cell.layer {
        // The unit came back; the adaptive service limit (at most 5)
        // caps what one request may take: one more, 7 left.
        Layer::Adaptive => (1, 7),
        Layer::Concurrency => (u64::from(BUDGET), 0),
        _ => (u64::from(BUDGET) - 1, 0),
    };
    let last = send(s.addr, costing(&rest.to_string())).await.unwrap();
    expect(last.status == StatusCode::OK, || {
        format!(
            "cost {rest} after costs u64::MAX and 0: HTTP {} (in flight: {in_flight})",
            last.status
        )
    })?;
    expect(remaining(&last) == Some(left), || {
        format!(
            "after cost {rest}: {:?} left, want {left}",
            remaining(&last)
        )
    })?;
    Ok(Verdict::Pass)
}

/// The retry client's hostile values are the server's hints: a
/// `Retry-After` or `grpc-retry-pushback-ms` that is garbage, negative,
/// past `u64`, or longer than the client will wait is no invitation to
/// retry (one attempt); a date in the past or 0 is (two).
async fn hostile_hints(cell: Cell<'_>) -> CellResult {
    let cases: &[(&'static str, usize)] = &[
        ("status:503;retry-after=garbage", 1),
        ("status:503;retry-after=-5", 1),
        ("status:503;retry-after=99999999999999999999", 1),
        ("status:503;retry-after=1.5", 1),
        ("status:503;retry-after=3600", 1),
        ("status:503;retry-after=Wed, 21 Oct 2015 07:28:00 GMT", 2),
        ("status:503;retry-after=0", 2),
        ("status:503;grpc-retry-pushback-ms=-1", 1),
        ("status:503;grpc-retry-pushback-ms=soon", 1),
        ("status:503;grpc-retry-pushback-ms=99999999999999999999", 1),
    ];
    for (fail, want) in cases {
        let attempts = retried(cell, FailurePolicy::Open, fail, "ok").await?;
        expect(attempts == *want, || {
            format!("{fail}: {attempts} attempts, want {want}")
        })?;
    }
    Ok(Verdict::Pass)
}

/// A real tonic service (the standard health service) behind the cell's
/// layer, served over HTTP/2 on loopback, and a real tonic client: within
/// the budget calls succeed; past it the client gets `RESOURCE_EXHAUSTED`
/// (a status, not a transport error) with a retry hint in its metadata,
/// and the service is not called. For in-flight limits the budget is held
/// by open `Watch` streams, as a long-lived gRPC call holds it.
async fn tonic_refusals(cell: Cell<'_>) -> CellResult {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    match cell.layer {
        Layer::Bandwidth => {
            return Ok(Verdict::NotApplicable(
                "paces a call's bytes; refuses no call",
            ))
        }
        Layer::Retry => {
            return Ok(Verdict::NotApplicable(
                "a client's layer: a real tonic client and a failing tonic \
                 service drive it in the examples' grpc_retry test",
            ))
        }
        _ => {}
    }
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    let router = tonic::service::Routes::new(health).into_axum_router();
    let served = serve_on(cell, Spec::default(), router, true, FailurePolicy::Open).await;
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", served.addr))
        .unwrap()
        .connect()
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let keyed = |msg| {
        let mut r = tonic::Request::new(msg);
        r.metadata_mut().insert("x-api-key", "k".parse().unwrap());
        r
    };
    let check = || {
        let mut client = HealthClient::new(channel.clone());
        async move {
            client
                .check(keyed(HealthCheckRequest {
                    service: String::new(),
                }))
                .await
        }
    };
    let in_flight = matches!(cell.layer, Layer::Concurrency | Layer::Adaptive);
    // What each holds open: in-flight limits, streams; the rest, nothing.
    let mut streams = Vec::new();
    // (The adaptive service limit lets a stream's share go at its
    // headers, so that long calls freeze nothing: the per-key limit holds
    // them.)
    let budget = BUDGET;
    for i in 0..budget {
        if in_flight {
            let mut client = HealthClient::new(channel.clone());
            let stream = client
                .watch(keyed(HealthCheckRequest {
                    service: String::new(),
                }))
                .await
                .map_err(|s| format!("watch {i}: {s:?}"))?;
            streams.push(stream);
        } else {
            check().await.map_err(|s| format!("call {i}: {s:?}"))?;
        }
    }
    let refused = match check().await {
        Ok(_) => return Err(format!("call {} past the budget: OK", budget + 1)),
        Err(status) => status,
    };
    expect(refused.code() == tonic::Code::ResourceExhausted, || {
        format!(
            "past the budget: {:?} (want RESOURCE_EXHAUSTED)",
            refused.code()
        )
    })?;
    expect(refused.metadata().get("retry-after").is_some(), || {
        format!("no retry-after in {:?}", refused.metadata())
    })?;
    // The streams' permits come back when they end.
    drop(streams);
    if in_flight {
        let mut back = false;
        for _ in 0..50 {
            if check().await.is_ok() {
                back = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        expect(back, || "permits not back after the streams ended".into())?;
    }
    Ok(Verdict::Pass)
}

/// Row 6's Cluster clause: one of three masters stopped (SIGSTOP), the
/// layer's store failing closed. Twenty-four clients at once, each a key
/// of its own spread over the slots: the stopped master's get the
/// policy's 429 (`Retry-After: 1`) within the store's timeout; every other
/// client is decided by Redis (200, and Redis's own count). A breaker or
/// a hang count kept for the whole Cluster sends every client to the
/// policy.
async fn cluster_master_stopped(cell: Cell<'_>) -> CellResult {
    match (cell.layer, cell.backing) {
        (_, Backing::Memory) => return Ok(Verdict::NotApplicable("one process: no nodes")),
        (Layer::Bandwidth, _) => {
            return Ok(Verdict::NotApplicable(
                "pacing never refuses: a failed store stops pacing the body (documented)",
            ))
        }
        (Layer::Retry, _) => {
            return Ok(Verdict::NotApplicable(
                "a budget per upstream is one key on one master: the store's faults tests stop it",
            ))
        }
        _ => {}
    }
    let Some(cluster) = cell.cluster else {
        return Err("no Cluster".into());
    };
    cluster.wait_until_ok();
    let url = cluster.url();
    let on_cluster = Cell {
        redis: &url,
        ..cell
    };
    let backend = Backend::default();
    let s = serve_on(
        on_cluster,
        Spec::default(),
        backend.router(),
        true,
        FailurePolicy::Closed,
    )
    .await;
    // Connected to every master (the slot map read) before one stops.
    let keys: Vec<String> = (0..24).map(|i| format!("c{i}")).collect();
    for warm in ["w0", "w1", "w2", "w3"] {
        let reply = send(s.addr, req(Method::GET, "/s", Some(warm.as_bytes())))
            .await
            .unwrap();
        expect(reply.status == StatusCode::OK, || {
            format!("before the stop ({warm}): HTTP {}", reply.status)
        })?;
    }
    /// Resumes the stopped node however the cell ends (a panic, a
    /// timeout), so the next cell finds the Cluster whole.
    struct Resume<'a>(&'a Server);
    impl Drop for Resume<'_> {
        fn drop(&mut self) {
            self.0.pause(false);
        }
    }
    let stopped = &cluster.nodes[1];
    stopped.pause(true);
    let resume = Resume(stopped);
    // Two waves: the first finds the stopped master (its calls time out,
    // and count toward its breaker); in the second, every other client
    // must still be decided by Redis.
    let mut waves = Vec::new();
    for _ in 0..2 {
        waves.push(
            futures_join(
                keys.iter()
                    .map(|key| send(s.addr, req(Method::GET, "/s", Some(key.as_bytes()))))
                    .collect(),
            )
            .await,
        );
    }
    drop(resume);
    // Each client's answer is its master's: the same in both waves.
    let in_flight = matches!(cell.layer, Layer::Concurrency | Layer::Adaptive);
    let mut by_redis: Vec<Vec<bool>> = Vec::new();
    for (wave, replies) in waves.into_iter().enumerate() {
        let mut this = Vec::new();
        for (key, reply) in keys.iter().zip(replies) {
            let reply = reply.map_err(|e| format!("{key}: {e}"))?;
            match reply.status {
                StatusCode::OK => {
                    // In flight, the first wave's permits came back.
                    let spent = if in_flight { 0 } else { wave as u64 };
                    let want = u64::from(BUDGET) - 1 - spent;
                    expect(remaining(&reply) == Some(want), || {
                        format!(
                            "wave {wave}, {key}: 200 with {:?} left, not Redis's count ({want})",
                            remaining(&reply)
                        )
                    })?;
                    this.push(true);
                }
                StatusCode::TOO_MANY_REQUESTS => {
                    expect(reply.header("retry-after") == "1", || {
                        format!("{key}: 429 without the closed policy's Retry-After: 1")
                    })?;
                    this.push(false);
                }
                other => return Err(format!("{key}: HTTP {other}")),
            }
        }
        by_redis.push(this);
    }
    let healthy = by_redis[0].iter().filter(|r| **r).count();
    expect((8..24).contains(&healthy), || {
        format!("{healthy} of 24 clients decided by Redis while one master of three stopped")
    })?;
    expect(by_redis[0] == by_redis[1], || {
        let lost = by_redis[0]
            .iter()
            .zip(&by_redis[1])
            .filter(|(a, b)| **a && !**b)
            .count();
        format!("second wave: {lost} clients of healthy masters fell to the policy")
    })?;
    Ok(Verdict::Pass)
}

/// Awaits `futures` side by side.
async fn futures_join<F: Future + Send + 'static>(futures: Vec<F>) -> Vec<F::Output>
where
    F::Output: Send + 'static,
{
    let handles: Vec<_> = futures.into_iter().map(tokio::spawn).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}

// ---------------------------------------------------------------------------
// The run: every row, every layer, both stores.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenario_matrix() {
    // The backend's deliberate panics are expected: keep them quiet.
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if info.payload().downcast_ref::<&str>() != Some(&"the handler fails") {
            report(info);
        }
    }));
    // Without redis-server (and without TOLLGATE_REQUIRE_REDIS=1, which
    // fails instead), the memory cells still run.
    let server = Server::start();
    let redis = server.as_ref().map(Server::url);
    let cluster = match &server {
        Some(_) => tokio::task::spawn_blocking(Cluster::start).await.unwrap(),
        None => None,
    };
    let mut skipped = 0;
    let mut failures = Vec::new();
    let (mut passed, mut not_applicable) = (0, 0);
    let mut table = String::new();
    let columns = LAYERS
        .iter()
        .map(|&l| (l, false))
        .chain(FROM_FILES.iter().map(|&l| (l, true)));
    let columns: Vec<(Layer, bool)> = columns.collect();
    for row in ROWS {
        for &(layer, file) in &columns {
            for backing in [Backing::Memory, Backing::Redis] {
                let url = match (backing, &redis) {
                    (Backing::Memory, _) => "",
                    (Backing::Redis, Some(url)) => url,
                    (Backing::Redis, None) => {
                        skipped += 1;
                        continue;
                    }
                };
                let cell = Cell {
                    layer,
                    backing,
                    redis: url,
                    cluster: cluster.as_ref(),
                    file,
                };
                let column = if file {
                    format!("{layer:?}/file")
                } else {
                    format!("{layer:?}")
                };
                let verdict = tokio::time::timeout(Duration::from_secs(60), (row.check)(cell))
                    .await
                    .unwrap_or_else(|_| Err("timed out".into()));
                let mark = match verdict {
                    Ok(Verdict::Pass) => {
                        passed += 1;
                        "pass".to_owned()
                    }
                    Ok(Verdict::NotApplicable(why)) => {
                        not_applicable += 1;
                        format!("n/a: {why}")
                    }
                    Err(e) => {
                        failures.push(format!("{} × {column} × {backing:?}: {e}", row.name));
                        format!("FAIL: {e}")
                    }
                };
                table.push_str(&format!(
                    "{:<55} {column:<17} {backing:<7?} {mark}\n",
                    row.name
                ));
            }
        }
    }
    println!("{table}");
    println!(
        "matrix: {} conditions × {} columns ({} layers in code, {} from a policy file) × 2 stores: {passed} passed, {not_applicable} not applicable, {} failed, {skipped} skipped (no redis-server)",
        ROWS.len(),
        columns.len(),
        LAYERS.len(),
        FROM_FILES.len(),
        failures.len()
    );
    assert!(passed > 0, "the matrix ran no cell");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---------------------------------------------------------------------------
// Row 11: a key flood fills the memory store (`max_keys`). A rate limit
// decides the newcomers in a state they share: together they get no more
// than one key's limit (documented). A quota is a contract: a newcomer is
// never charged for another's calls (the layer's `OnStoreError` answers
// for a key the store cannot hold), and the keys held keep their counts.

async fn full_store(cell: Cell<'_>) -> CellResult {
    if cell.backing == Backing::Redis {
        return Ok(Verdict::NotApplicable(
            "Redis holds every key: no key bound in the process",
        ));
    }
    match cell.layer {
        Layer::Rate | Layer::Policy | Layer::Quota => {}
        Layer::Concurrency | Layer::Adaptive => {
            return Ok(Verdict::NotApplicable(
                "in-flight permits of newcomers are counted as a group and released there \
                 (the memory store's bounds tests)",
            ))
        }
        Layer::Bandwidth => {
            return Ok(Verdict::NotApplicable(
                "pacing newcomers as a group slows, never refuses",
            ))
        }
        Layer::Retry => {
            return Ok(Verdict::NotApplicable(
                "a retry budget is keyed by upstream: a few keys, no flood",
            ))
        }
    }
    for on in [OnStoreError::Admit, OnStoreError::Refuse] {
        let store = MemoryStore::builder()
            .max_keys(2)
            .shards(1)
            .build()
            .unwrap();
        let backend = Backend::default();
        let spec = Spec {
            on_store_error: on,
            ..Spec::default()
        };
        let s = common::spawn(protect(cell.layer, cell.file, store, spec, backend.router()).router)
            .await;
        // Two clients fill the store.
        for k in [&b"a"[..], b"b"] {
            let r = send(s, req(Method::GET, "/s", Some(k))).await.unwrap();
            expect(r.status == StatusCode::OK, || {
                format!("{k:?}: HTTP {}", r.status)
            })?;
        }
        // Twelve newcomers, one unit each.
        let mut statuses = Vec::new();
        for n in 0..12 {
            let key = format!("new-{n}");
            let r = send(s, req(Method::GET, "/s", Some(key.as_bytes())))
                .await
                .unwrap();
            if r.status == StatusCode::TOO_MANY_REQUESTS && r.header("retry-after").is_empty() {
                return Err(format!("{key}: a 429 without Retry-After"));
            }
            statuses.push(r.status.as_u16());
        }
        let admitted = statuses.iter().filter(|&&s| s == 200).count();
        if cell.layer == Layer::Quota {
            // Nobody's count: each newcomer gets what OnStoreError says.
            let want = if on == OnStoreError::Admit { 12 } else { 0 };
            expect(admitted == want, || {
                format!("{on:?}: {statuses:?}, want {want} admitted (no shared window)")
            })?;
        } else {
            expect(admitted == BUDGET as usize, || {
                format!("{on:?}: newcomers admitted {admitted}, want one key's budget {BUDGET}")
            })?;
        }
        // "a" kept its own count: the rest of its budget, then a refusal.
        let mut left = 0;
        while left <= BUDGET {
            let r = send(s, req(Method::GET, "/s", Some(b"a"))).await.unwrap();
            if r.status != StatusCode::OK {
                break;
            }
            left += 1;
        }
        expect(left == BUDGET - 1, || {
            format!("{on:?}: \"a\" had {left} units left, want {}", BUDGET - 1)
        })?;
    }
    Ok(Verdict::Pass)
}

// ---------------------------------------------------------------------------
// Row 12: hedged requests (the retry layer's `hedge`) against an upstream
// slow enough that every call is worth a hedge. Each hedge is a
// withdrawal from the budget (half a retry a call, no floor): ten calls
// make at most fifteen attempts, and some hedges are sent; a budget store
// that fails grants none, and each call is one attempt.

async fn hedged_calls(cell: Cell<'_>) -> CellResult {
    if cell.layer != Layer::Retry {
        return Ok(Verdict::NotApplicable(
            "a hedge is the retry layer's (a client's second attempt)",
        ));
    }
    for failing in [false, true] {
        let calls = Arc::new(AtomicUsize::new(0));
        let seen = Arc::clone(&calls);
        let upstream = Router::new().route(
            "/r",
            get(move || {
                seen.fetch_add(1, Ordering::SeqCst);
                async {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    "slow"
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, upstream).await });
        let policy = tollgate::FailurePolicy::Closed;
        type Calls = Pin<Box<dyn Future<Output = Result<(), String>> + Send>>;
        let run = with_store(cell, policy, |store| -> Calls {
            match (store, failing) {
                (StoreChoice::Memory(s), false) => Box::pin(ten_calls(client(s, addr, true))),
                (StoreChoice::Redis(s), false) => Box::pin(ten_calls(client(s, addr, true))),
                (StoreChoice::Memory(s), true) => {
                    Box::pin(ten_calls(client(Failing(s), addr, true)))
                }
                (StoreChoice::Redis(s), true) => {
                    Box::pin(ten_calls(client(Failing(s), addr, true)))
                }
            }
        });
        run.await?;
        // Hedges dropped at their call's answer may still be counted by
        // the upstream a moment later: let them land.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let attempts = calls.load(Ordering::SeqCst);
        if failing {
            expect(attempts == 10, || {
                format!("{attempts} attempts for 10 calls on a failing budget store, want 10")
            })?;
        } else {
            expect((11..=15).contains(&attempts), || {
                format!(
                    "{attempts} attempts for 10 hedged calls at half a retry each, want 11 to 15"
                )
            })?;
        }
    }
    Ok(Verdict::Pass)
}

/// Ten calls, one after another, through `client`.
async fn ten_calls<C>(client: C) -> Result<(), String>
where
    C: Service<Request<Body>, Response = Response<Body>, Error = tollgate::BoxError> + Clone,
{
    for _ in 0..10 {
        call_once(client.clone()).await?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Row 13: a call whose cost is known only afterwards (a report, a search):
// the handler reports it, and the key's next requests pay what it cost
// beyond the estimate. A cost no budget holds refuses the key for a while
// (429, Retry-After), never a 500.

async fn expensive_calls(cell: Cell<'_>) -> CellResult {
    match cell.layer {
        Layer::Rate | Layer::Policy => {}
        Layer::Quota => {
            return Ok(Verdict::NotApplicable(
                "a quota charges when the request arrives; settling afterwards is a rate rule's",
            ))
        }
        Layer::Concurrency | Layer::Adaptive => {
            return Ok(Verdict::NotApplicable(
                "a permit is held for as long as the call takes: its real cost already",
            ))
        }
        Layer::Bandwidth => {
            return Ok(Verdict::NotApplicable(
                "counts the bytes themselves as they pass",
            ))
        }
        Layer::Retry => return Ok(Verdict::NotApplicable("a client's budget of retries")),
    }
    let spec = Spec {
        charge_after: true,
        ..Spec::default()
    };
    let s = serve(cell, spec, &Backend::default(), true).await;
    let call = |key: &'static [u8], cost: Option<&str>| {
        let mut r = req(Method::GET, "/s", Some(key));
        if let Some(c) = cost {
            r.headers_mut()
                .insert("x-answer", HeaderValue::from_str(c).unwrap());
        }
        send(s.addr, r)
    };
    // Estimated at 1 of 8, reported 6: 5 owed.
    let first = call(b"k", Some("cost:6")).await.unwrap();
    expect(
        first.status == StatusCode::OK && remaining(&first) == Some(7),
        || {
            format!(
                "the costly call: HTTP {}, left {:?}, want 200 and 7",
                first.status,
                remaining(&first)
            )
        },
    )?;
    // The next pays 1 and the 5; then 1 is left for one more.
    let mut got = Vec::new();
    for _ in 0..3 {
        let r = call(b"k", None).await.unwrap();
        got.push((r.status.as_u16(), remaining(&r)));
    }
    let want = vec![(200, Some(1)), (200, Some(0)), (429, Some(0))];
    expect(got == want, || format!("after it: {got:?}, want {want:?}"))?;
    // A cost no budget can hold: the key waits, it is not an error.
    let huge = call(b"j", Some(&format!("cost:{}", u64::MAX)))
        .await
        .unwrap();
    expect(huge.status == StatusCode::OK, || {
        format!("a reported u64::MAX: HTTP {}", huge.status)
    })?;
    let after = call(b"j", None).await.unwrap();
    expect(
        after.status == StatusCode::TOO_MANY_REQUESTS && !after.header("retry-after").is_empty(),
        || {
            format!(
                "after u64::MAX: HTTP {}, Retry-After {:?}",
                after.status,
                after.header("retry-after")
            )
        },
    )?;
    Ok(Verdict::Pass)
}

// ---------------------------------------------------------------------------
// Row 14: a client moves its traffic to one long-lived socket: each
// message spends the budget its key's requests draw on.

async fn socket_messages(cell: Cell<'_>) -> CellResult {
    match cell.layer {
        Layer::Rate | Layer::Policy => {}
        Layer::Quota => {
            return Ok(Verdict::NotApplicable(
                "counts requests against a calendar period; a socket's messages are a rate rule's",
            ))
        }
        Layer::Concurrency | Layer::Adaptive => {
            return Ok(Verdict::NotApplicable(
                "a socket holds one permit for its life (max_lifetime caps it: row 4b)",
            ))
        }
        Layer::Bandwidth => {
            return Ok(Verdict::NotApplicable(
                "paces the upgrade response's bytes; a socket's frames are the application's",
            ))
        }
        Layer::Retry => return Ok(Verdict::NotApplicable("a client's budget of retries")),
    }
    let spec = Spec {
        messages: true,
        ..Spec::default()
    };
    let s = serve(cell, spec, &Backend::default(), true).await;
    let ws = |upgrade: bool| {
        let mut r = req(Method::GET, "/ws", Some(b"k"));
        r.headers_mut()
            .insert("x-messages", HeaderValue::from_static("20"));
        if upgrade {
            r.headers_mut()
                .insert("upgrade", HeaderValue::from_static("websocket"));
            r.headers_mut()
                .insert("connection", HeaderValue::from_static("upgrade"));
        }
        send(s.addr, r)
    };
    // A plain request is offered no budget (and costs 1 of 8).
    let plain = ws(false).await.unwrap();
    expect(plain.header("x-sent") == "none", || {
        format!(
            "a plain request: x-sent {:?}, want none",
            plain.header("x-sent")
        )
    })?;
    // The upgrade costs 1: 6 left, so 6 of its 20 messages go through.
    let upgraded = ws(true).await.unwrap();
    expect(upgraded.header("x-sent") == "6", || {
        format!(
            "an upgrade's messages: HTTP {}, x-sent {:?}, want 6 of 20",
            upgraded.status,
            upgraded.header("x-sent")
        )
    })?;
    // The messages spent the key's budget: its requests are refused.
    let after = send(s.addr, req(Method::GET, "/s", Some(b"k")))
        .await
        .unwrap();
    expect(after.status == StatusCode::TOO_MANY_REQUESTS, || {
        format!(
            "a request after the messages: HTTP {}, want 429",
            after.status
        )
    })?;
    Ok(Verdict::Pass)
}

// ---------------------------------------------------------------------------
// Row 15: a key that keeps hitting its limit is slowed (a policy rule's
// slowing ladder): it keeps half its limit for a while, and its
// `RateLimit-Policy` says so; another key keeps the whole.

async fn slowed_keys(cell: Cell<'_>) -> CellResult {
    if cell.layer != Layer::Policy {
        return Ok(Verdict::NotApplicable(
            "slowing ladders are a policy rule's",
        ));
    }
    let spec = Spec {
        slow_down: true,
        ..Spec::default()
    };
    let s = serve(cell, spec, &Backend::default(), true).await;
    let get = |key: &'static [u8]| send(s.addr, req(Method::GET, "/r", Some(key)));
    let q = |r: &Reply| {
        r.item("ratelimit-policy", "m")
            .split(';')
            .find_map(|p| p.strip_prefix("q="))
            .and_then(|q| q.parse::<u64>().ok())
    };
    // /r costs 4 of 8: two, then a refusal (a strike: slowed).
    let mut got = Vec::new();
    for _ in 0..4 {
        let r = get(b"k").await.unwrap();
        got.push((r.status.as_u16(), q(&r)));
    }
    let want = vec![
        (200, Some(8)),
        (200, Some(8)),
        (429, Some(4)),
        (429, Some(4)),
    ];
    expect(got == want, || format!("key k: {got:?}, want {want:?}"))?;
    let other = get(b"j").await.unwrap();
    expect(
        other.status == StatusCode::OK && q(&other) == Some(8),
        || {
            format!(
                "another key: HTTP {}, q {:?}, want 200 and 8",
                other.status,
                q(&other)
            )
        },
    )?;
    Ok(Verdict::Pass)
}

// ---------------------------------------------------------------------------
// Row 16: an in-flight limit keyed `Global` (one key for every request,
// which the memory store counts apart from its table, with no lookup):
// open responses of different clients all count against it, and every
// permit comes back when their connections drop, so the limit fills
// again, round after round.

async fn service_wide(cell: Cell<'_>) -> CellResult {
    match cell.layer {
        Layer::Concurrency => {}
        Layer::Adaptive => {
            return Ok(Verdict::NotApplicable(
                "the adaptive limit is service-wide already (rows 4 and 5)",
            ))
        }
        Layer::Rate | Layer::Policy | Layer::Quota | Layer::Bandwidth => {
            return Ok(Verdict::NotApplicable(
                "a fixed key is one budget in the store like any other; only in-flight limits count it apart",
            ))
        }
        Layer::Retry => {
            return Ok(Verdict::NotApplicable(
                "a client layer's budget is keyed by upstream",
            ))
        }
    }
    let spec = Spec {
        key: KeyKind::Global,
        ..Spec::default()
    };
    let s = serve(cell, spec, &Backend::default(), true).await;
    for round in 0..3 {
        // BUDGET clients, one open response each (retried until admitted:
        // a permit of the last round may be on its way back).
        let mut held = Vec::new();
        for i in 0..BUDGET {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            loop {
                let o = open(s.addr, "/long", &format!("client-{round}-{i}")).await;
                if o.status == StatusCode::OK {
                    held.push(o);
                    break;
                }
                if tokio::time::Instant::now() > deadline {
                    return Err(format!("round {round}: permit {i} never came back"));
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        let r = send(s.addr, req(Method::GET, "/s", Some(b"another-client")))
            .await
            .unwrap();
        expect(r.status == StatusCode::TOO_MANY_REQUESTS, || {
            format!(
                "round {round}: {BUDGET} clients hold the service's {BUDGET} permits, yet another got HTTP {}",
                r.status
            )
        })?;
        expect(r.headers.contains_key("retry-after"), || {
            format!("round {round}: a refusal without Retry-After")
        })?;
        drop(held);
    }
    Ok(Verdict::Pass)
}
