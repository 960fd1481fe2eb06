use std::fmt;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use http_body::Body;
use tokio::time::Instant;
use tollgate_core::algorithm::RETRY_UNIT;
use tollgate_core::{ConfigError, RetryBudgetLimiter, RetryBudgetRule, RetryBudgetStore};
use tollgate_memory::MemoryStore;
use tower_layer::Layer;
use tower_service::Service;

use super::policy::{is_idempotent, server_hint, Attempt, Backoff};
use super::throttle::{Throttle, Throttles};
use super::ReplayBody;
use crate::key::{KeyBuf, KeyBytes, KeyExtractor};
use crate::observe::RetryMetrics;
use crate::outcome::Completion;
use crate::BoxError;

/// The default key of a retry budget: the upstream's host (and port), from
/// the request's URI, else its `Host` header, lower-cased as DNS names
/// compare. One budget per upstream. Credentials in the URI
/// (`user:password@`) are not part of it: they name no other upstream,
/// and a key must not carry a secret into a store.
#[derive(Debug, Clone, Copy, Default)]
pub struct Upstream;

impl<B> KeyExtractor<B> for Upstream {
    fn extract(&self, req: &Request<B>, key: &mut KeyBuf) -> Option<()> {
        let authority = match req.uri().authority() {
            Some(authority) => authority.as_str().as_bytes(),
            None => req.headers().get(http::header::HOST)?.as_bytes(),
        };
        // `user:password@host:port`: what follows the last `@`.
        let host = match authority.iter().rposition(|b| *b == b'@') {
            Some(at) => authority.get(at.saturating_add(1)..).unwrap_or_default(),
            None => authority,
        };
        if host.iter().any(u8::is_ascii_uppercase) {
            key.push(&host.to_ascii_lowercase());
        } else {
            key.push(host);
        }
        Some(())
    }
}

/// The error of a call the layer refused to make: adaptive throttling
/// judged the upstream overloaded (see
/// [`adaptive_throttling`](RetryBudgetLayerBuilder::adaptive_throttling)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Throttled;

impl fmt::Display for Throttled {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("call throttled locally: the upstream is rejecting most calls")
    }
}

impl std::error::Error for Throttled {}

/// The error of a call whose overall
/// [`deadline`](RetryBudgetLayerBuilder::deadline) passed before an
/// attempt answered (the attempt in flight is dropped).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeadlineExceeded;

impl fmt::Display for DeadlineExceeded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the call's deadline passed before an attempt answered")
    }
}

impl std::error::Error for DeadlineExceeded {}

type ClassifyFn = Arc<dyn Fn(Attempt<'_>) -> bool + Send + Sync>;

struct Shared<K, L> {
    key: K,
    budget: L,
    max_attempts: u32,
    backoff: Backoff,
    max_server_wait: Duration,
    deadline: Option<Duration>,
    classify: Option<ClassifyFn>,
    any_method: bool,
    /// Paths whose requests are safe to send again (gRPC methods).
    idempotent_paths: Arc<[Box<str>]>,
    buffer_limit: u64,
    throttle: Option<Throttles>,
    hedger: Option<super::hedge::Hedger>,
    metrics: RetryMetrics,
}

/// Retries failed calls of a client service while a retry budget allows;
/// see the [module docs](super).
pub struct RetryBudgetLayer<K = Upstream, St: RetryBudgetStore = MemoryStore> {
    shared: Arc<Shared<K, St::RetryBudgetLimiter>>,
}

impl<K, St: RetryBudgetStore> Clone for RetryBudgetLayer<K, St> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<K, St: RetryBudgetStore> fmt::Debug for RetryBudgetLayer<K, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryBudgetLayer")
            .field("rule", &self.shared.budget.rule().name())
            .field("max_attempts", &self.shared.max_attempts)
            .finish_non_exhaustive()
    }
}

impl<S, K, St: RetryBudgetStore> Layer<S> for RetryBudgetLayer<K, St> {
    type Service = RetryBudgetService<S, K, St>;

    fn layer(&self, inner: S) -> Self::Service {
        RetryBudgetService {
            inner,
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<K, St: RetryBudgetStore> RetryBudgetLayer<K, St> {
    /// The store's handle of the budget (e.g. to read a key's balance in a
    /// test or a dashboard).
    pub fn budget(&self) -> &St::RetryBudgetLimiter {
        &self.shared.budget
    }
}

impl RetryBudgetLayer<Upstream, MemoryStore> {
    /// Starts a layer whose budget is named `name` (store keys, metrics).
    /// Defaults: 20 % of recent calls over 10 s plus 10 retries a second
    /// (Finagle's, Linkerd's and tower's), up to 3 attempts, backoff from
    /// 50 ms up to 2 s with full jitter, a server's wait honoured up to
    /// 10 s, no overall deadline, one budget per upstream host, idempotent
    /// requests only, bodies buffered up to 64 KiB, no adaptive
    /// throttling, in-memory store.
    pub fn builder(name: &str) -> RetryBudgetLayerBuilder<Upstream, MemoryStore> {
        RetryBudgetLayerBuilder {
            name: name.to_owned(),
            ratio: 0.2,
            min_per_second: 10,
            window: Duration::from_secs(10),
            key: Upstream,
            store: MemoryStore::new(),
            max_attempts: 3,
            backoff: (Duration::from_millis(50), Duration::from_secs(2)),
            max_server_wait: Duration::from_secs(10),
            deadline: None,
            classify: None,
            any_method: false,
            idempotent_paths: Vec::new(),
            buffer_limit: 64 << 10,
            throttle: None,
            hedge: None,
        }
    }
}

/// Builds a [`RetryBudgetLayer`]; see [`RetryBudgetLayer::builder`].
pub struct RetryBudgetLayerBuilder<K, St> {
    name: String,
    ratio: f64,
    min_per_second: u32,
    window: Duration,
    key: K,
    store: St,
    max_attempts: u32,
    backoff: (Duration, Duration),
    max_server_wait: Duration,
    deadline: Option<Duration>,
    classify: Option<ClassifyFn>,
    any_method: bool,
    idempotent_paths: Vec<Box<str>>,
    buffer_limit: u64,
    throttle: Option<f64>,
    hedge: Option<super::Hedge>,
}

impl<K: fmt::Debug, St> fmt::Debug for RetryBudgetLayerBuilder<K, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryBudgetLayerBuilder")
            .field("name", &self.name)
            .field("ratio", &self.ratio)
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

impl<K, St> RetryBudgetLayerBuilder<K, St> {
    /// Retries may be at most `ratio` of recent calls (over `window`), plus
    /// `min_per_second` retries every second. The second part is a reserve
    /// of `min_per_second × window` retries that a burst may spend at once
    /// (see [the module docs](super#the-floor-is-a-reserve): 200 calls at
    /// 50 % failure amplify 1.70× with the defaults, 2,000 calls 1.25×);
    /// `min_per_second = 0` removes it.
    pub fn budget(mut self, ratio: f64, min_per_second: u32, window: Duration) -> Self {
        self.ratio = ratio;
        self.min_per_second = min_per_second;
        self.window = window;
        self
    }

    /// Whose budget a call draws on (default: [`Upstream`]).
    pub fn key<K2>(self, key: K2) -> RetryBudgetLayerBuilder<K2, St> {
        RetryBudgetLayerBuilder {
            name: self.name,
            ratio: self.ratio,
            min_per_second: self.min_per_second,
            window: self.window,
            key,
            store: self.store,
            max_attempts: self.max_attempts,
            backoff: self.backoff,
            max_server_wait: self.max_server_wait,
            deadline: self.deadline,
            classify: self.classify,
            any_method: self.any_method,
            idempotent_paths: self.idempotent_paths,
            buffer_limit: self.buffer_limit,
            throttle: self.throttle,
            hedge: self.hedge,
        }
    }

    /// Where the budget lives (default: a new [`MemoryStore`]); a Redis
    /// store shares one budget across a fleet of clients.
    pub fn store<St2: RetryBudgetStore>(self, store: St2) -> RetryBudgetLayerBuilder<K, St2> {
        RetryBudgetLayerBuilder {
            name: self.name,
            ratio: self.ratio,
            min_per_second: self.min_per_second,
            window: self.window,
            key: self.key,
            store,
            max_attempts: self.max_attempts,
            backoff: self.backoff,
            max_server_wait: self.max_server_wait,
            deadline: self.deadline,
            classify: self.classify,
            any_method: self.any_method,
            idempotent_paths: self.idempotent_paths,
            buffer_limit: self.buffer_limit,
            throttle: self.throttle,
            hedge: self.hedge,
        }
    }

    /// Attempts per call, the first included (default 3; 1 to 10).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts;
        self
    }

    /// Backoff between attempts: exponential from `base`, capped at `cap`,
    /// with full jitter; a server's `Retry-After` or
    /// `grpc-retry-pushback-ms` comes first, the jitter on top of it.
    pub fn backoff(mut self, base: Duration, cap: Duration) -> Self {
        self.backoff = (base, cap);
        self
    }

    /// The longest wait a server may ask for, by `Retry-After` or
    /// `grpc-retry-pushback-ms`, and still be retried (default 10 s). An
    /// answer asking for longer — a maintenance page's
    /// `Retry-After: 86400` — is returned to the caller, not waited on.
    pub fn max_server_wait(mut self, wait: Duration) -> Self {
        self.max_server_wait = wait;
        self
    }

    /// An overall deadline per call, from `call` until an attempt's
    /// response head: buffering the body, waiting for the upstream to be
    /// ready, budget calls, backoff and every attempt count. No retry is
    /// started that would wait past it, and a call still unanswered at the
    /// deadline fails with [`DeadlineExceeded`] (the attempt in flight is
    /// dropped). The response body is not covered.
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// Which outcomes are retried (default:
    /// [`Attempt::is_retryable_by_default`]).
    pub fn classify<F>(mut self, f: F) -> Self
    where
        F: Fn(Attempt<'_>) -> bool + Send + Sync + 'static,
    {
        self.classify = Some(Arc::new(f));
        self
    }

    /// Retry requests of any method (default: only idempotent methods and
    /// requests with an `Idempotency-Key`).
    pub fn retry_any_method(mut self, on: bool) -> Self {
        self.any_method = on;
        self
    }

    /// Requests to exactly `path` may be sent again whatever their method,
    /// as if they carried [`Idempotent`](super::Idempotent): name a gRPC
    /// client's idempotent unary methods, e.g.
    /// `"/grpc.health.v1.Health/Check"` (every gRPC call is a `POST`).
    pub fn idempotent_path(mut self, path: &str) -> Self {
        self.idempotent_paths.push(path.into());
        self
    }

    /// The largest request body buffered for replay (default 64 KiB, at
    /// most [`MAX_BUFFER_LIMIT`](super::MAX_BUFFER_LIMIT), at least 1).
    /// Only a request that may be retried is buffered. A body whose size
    /// hint says it is larger is sent once, as it streams, and not
    /// retried; a body of unknown length (a gRPC message, a chunked
    /// upload) is read up to the limit first: if it ends there, it is
    /// replayable; if not, what was read and the rest are sent once.
    pub fn buffer_limit(mut self, bytes: u64) -> Self {
        self.buffer_limit = bytes;
        self
    }

    /// Client-side adaptive throttling (Google SRE book, "Handling
    /// Overload"): when the upstream rejects most calls, refuse locally
    /// with probability `max(0, (requests − k·accepts) / (requests + 1))`
    /// over the last minute, so a fleet of clients stops hammering it.
    /// `k` is usually 2; a refused call fails with [`Throttled`].
    pub fn adaptive_throttling(mut self, k: f64) -> Self {
        self.throttle = Some(k);
        self
    }

    /// Hedged requests (default: none): a call that may be retried and is
    /// still unanswered after the hedge's delay is sent again, side by
    /// side, if the budget grants a retry for it; the first answer not
    /// worth a retry wins and the other attempt is dropped. A hedge is an
    /// attempt (it counts against [`max_attempts`](Self::max_attempts))
    /// and a withdrawal, so hedges and retries together stay within the
    /// budget. See [`Hedge`](super::Hedge).
    pub fn hedge(mut self, hedge: super::Hedge) -> Self {
        self.hedge = Some(hedge);
        self
    }
}

impl<K, St: RetryBudgetStore> RetryBudgetLayerBuilder<K, St> {
    /// Validates and binds the budget; every error names its field.
    pub fn build(self) -> Result<RetryBudgetLayer<K, St>, ConfigError> {
        let rule = RetryBudgetRule::new(&self.name, self.ratio, self.min_per_second, self.window)?;
        if !(1..=10).contains(&self.max_attempts) {
            return Err(ConfigError::new("max_attempts", "must be from 1 to 10"));
        }
        let (base, cap) = self.backoff;
        if base.is_zero() || cap < base || cap > Duration::from_secs(3_600) {
            return Err(ConfigError::new(
                "backoff",
                "base must be above zero and at most cap, cap at most an hour",
            ));
        }
        if self.max_server_wait > Duration::from_secs(3_600) {
            return Err(ConfigError::new(
                "max_server_wait",
                "must be at most an hour",
            ));
        }
        if self.deadline.is_some_and(|d| d.is_zero()) {
            return Err(ConfigError::new("deadline", "must be longer than zero"));
        }
        if let Some(hedge) = &self.hedge {
            hedge.validate()?;
            if self.max_attempts < 2 {
                return Err(ConfigError::new(
                    "hedge",
                    "a hedge is a second attempt: max_attempts must be at least 2",
                ));
            }
        }
        if !(1..=super::MAX_BUFFER_LIMIT).contains(&self.buffer_limit) {
            return Err(ConfigError::new(
                "buffer_limit",
                format!(
                    "must be from 1 to {} bytes (each retryable request in flight may hold this much)",
                    super::MAX_BUFFER_LIMIT
                ),
            ));
        }
        if let Some(p) = self.idempotent_paths.iter().find(|p| !p.starts_with('/')) {
            return Err(ConfigError::new(
                "idempotent_path",
                format!("{p:?} must start with '/'"),
            ));
        }
        let throttle = match self.throttle {
            Some(k) if !(1.0..=100.0).contains(&k) => {
                return Err(ConfigError::new(
                    "adaptive_throttling",
                    "k must be from 1 to 100 (2 is usual)",
                ))
            }
            Some(k) => Some(Throttles::new(k)),
            None => None,
        };
        Ok(RetryBudgetLayer {
            shared: Arc::new(Shared {
                key: self.key,
                budget: self.store.retry_budget(&rule)?,
                max_attempts: self.max_attempts,
                backoff: Backoff::new(base, cap),
                max_server_wait: self.max_server_wait,
                deadline: self.deadline,
                classify: self.classify,
                any_method: self.any_method,
                idempotent_paths: self.idempotent_paths.into(),
                buffer_limit: self.buffer_limit,
                throttle,
                hedger: self.hedge.map(super::hedge::Hedger::new),
                metrics: RetryMetrics::register(rule.name()),
            }),
        })
    }
}

/// The service of [`RetryBudgetLayer`].
pub struct RetryBudgetService<S, K, St: RetryBudgetStore> {
    inner: S,
    shared: Arc<Shared<K, St::RetryBudgetLimiter>>,
}

impl<S: Clone, K, St: RetryBudgetStore> Clone for RetryBudgetService<S, K, St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S: fmt::Debug, K, St: RetryBudgetStore> fmt::Debug for RetryBudgetService<S, K, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryBudgetService")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

pin_project_lite::pin_project! {
    /// The future of [`RetryBudgetService`]. The common call — no deadline, nothing to
    /// read of the body first — makes its first attempt in place, with no
    /// allocation; a retry, a deadline or a body to buffer continue in a
    /// boxed future of attempts, waits and budget calls.
    pub struct ResponseFuture<S, K, L, B>
    where
        S: Service<Request<ReplayBody<B>>>,
    {
        #[pin]
        state: Call<S, K, L, B>,
    }
}

type Boxed<T> = Pin<Box<dyn Future<Output = Result<T, BoxError>> + Send>>;

pin_project_lite::pin_project! {
    #[project = CallProj]
    enum Call<S, K, L, B>
    where
        S: Service<Request<ReplayBody<B>>>,
    {
        First {
            #[pin]
            attempt: S::Future,
            // What a retry needs (none for a request that is sent once).
            resume: Option<Resume<S>>,
            shared: Arc<Shared<K, L>>,
            // The upstream's adaptive throttle, where one is on.
            throttle: Option<Arc<Throttle>>,
        },
        Boxed {
            future: Boxed<S::Response>,
        },
        Refused {
            error: Option<BoxError>,
        },
    }
}

impl<S, K, L, B> fmt::Debug for ResponseFuture<S, K, L, B>
where
    S: Service<Request<ReplayBody<B>>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

/// What a call needs to send its request again: the service, the
/// request's head and buffered body, and the budget's key.
struct Resume<S> {
    inner: S,
    parts: http::request::Parts,
    buffered: Buffered,
    key: KeyBytes,
}

impl<S, K, L, B, ResB> Future for ResponseFuture<S, K, L, B>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: Send + 'static,
    K: Send + Sync + 'static,
    L: RetryBudgetLimiter,
    ResB: Send + 'static,
{
    type Output = Result<Response<ResB>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                CallProj::First {
                    attempt,
                    resume,
                    shared,
                    throttle,
                } => {
                    let result = std::task::ready!(attempt.poll(cx)).map_err(Into::into);
                    let t = throttle.as_deref();
                    let retry = after_attempt(shared, t, &result, 1, resume.is_some(), None)
                        .and_then(|wait| Some((wait, resume.take()?)));
                    let Some((wait, resume)) = retry else {
                        // Answered: a later poll gets an error, never the
                        // inner future again.
                        this.state.set(Call::Refused { error: None });
                        return Poll::Ready(result);
                    };
                    let shared = Arc::clone(shared);
                    let throttle = throttle.take();
                    let future =
                        Box::pin(retries(shared, throttle, resume, (result, 1), wait, None));
                    this.state.set(Call::Boxed { future });
                }
                CallProj::Boxed { future } => return future.as_mut().poll(cx),
                CallProj::Refused { error } => {
                    let error = error
                        .take()
                        .unwrap_or_else(|| "polled after it answered".into());
                    return Poll::Ready(Err(error));
                }
            }
        }
    }
}

impl<S, K, St: RetryBudgetStore, B, ResB> Service<Request<B>> for RetryBudgetService<S, K, St>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    K: KeyExtractor<B>,
    ResB: Send + 'static,
{
    type Response = Response<ResB>;
    type Error = BoxError;
    type Future = ResponseFuture<S, K, St::RetryBudgetLimiter, B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // The service polled ready makes the first attempt; a clone waits
        // for the next caller's poll_ready.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let shared = Arc::clone(&self.shared);
        let boxed = |future: Boxed<Response<ResB>>| ResponseFuture {
            state: Call::Boxed { future },
        };
        // A call with a deadline runs under its timer.
        if let Some(at) = shared.deadline.and_then(|d| Instant::now().checked_add(d)) {
            return boxed(Box::pin(async move {
                match tokio::time::timeout_at(at, run(shared, inner, req, Some(at))).await {
                    Ok(result) => result,
                    Err(_) => Err(Box::new(DeadlineExceeded) as BoxError),
                }
            }));
        }
        let replayable = is_replayable(&shared, &req);
        // A body to read before the first attempt, or a hedge to race
        // against it: in the boxed future.
        if replayable && (!req.body().is_end_stream() || shared.hedger.is_some()) {
            return boxed(Box::pin(run(shared, inner, req, None)));
        }
        let key = key(&shared, &req);
        let throttle = match throttle(&shared, &key) {
            Ok(t) => t,
            Err(error) => {
                return ResponseFuture {
                    state: Call::Refused { error: Some(error) },
                }
            }
        };
        deposit(&shared, &key);
        let (parts, body) = req.into_parts();
        // Each part is moved once, into where it stays: the future every
        // call returns is large, and each move of it is a copy.
        if !replayable {
            let attempt = inner.call(Request::from_parts(parts, ReplayBody::inner(body)));
            return ResponseFuture {
                state: Call::First {
                    attempt,
                    resume: None,
                    shared,
                    throttle,
                },
            };
        }
        let first = Request::from_parts(parts.clone(), ReplayBody::replay(Bytes::new(), None));
        ResponseFuture {
            state: Call::First {
                attempt: inner.call(first),
                resume: Some(Resume {
                    inner,
                    parts,
                    buffered: (Bytes::new(), None),
                    key,
                }),
                shared,
                throttle,
            },
        }
    }
}

/// Whether `req` may be sent more than once: retries are configured, and
/// it is idempotent (or every method may be retried).
fn is_replayable<K, L, B>(shared: &Shared<K, L>, req: &Request<B>) -> bool {
    shared.max_attempts > 1
        && (shared.any_method
            || is_idempotent(req.method(), req.headers())
            || req.extensions().get::<super::Idempotent>().is_some()
            || shared
                .idempotent_paths
                .iter()
                .any(|p| **p == *req.uri().path()))
}

/// Adaptive throttling's verdict on a new call to the upstream `key`:
/// `Err` when it is refused locally (that upstream rejects most calls);
/// else its throttle, to count the call's outcome on.
fn throttle<K, L>(
    shared: &Shared<K, L>,
    key: &KeyBytes,
) -> Result<Option<Arc<Throttle>>, BoxError> {
    let Some(throttles) = &shared.throttle else {
        return Ok(None);
    };
    let throttle = throttles.of(key.as_bytes());
    if throttle.refuse(shared.backoff.random()) {
        // A request the application made, not accepted (SRE book).
        throttle.record(false);
        shared.metrics.throttled.increment(1);
        return Err(Box::new(Throttled));
    }
    Ok(Some(throttle))
}

/// The budget key of a call that is made: [`deposit`] follows.
fn key<K, L, B>(shared: &Shared<K, L>, req: &Request<B>) -> KeyBytes
where
    K: KeyExtractor<B>,
{
    KeyBytes::extract(|buf| shared.key.extract(req, buf), b"\x02unkeyed")
}

/// A first attempt is made: counted, and deposited in the budget (in
/// memory at once; a networked store's deposit runs on its own).
fn deposit<K, L: RetryBudgetLimiter>(shared: &Shared<K, L>, key: &KeyBytes) {
    shared.metrics.calls.increment(1);
    if !shared.budget.deposit_sync(key.as_bytes()) {
        crate::task::finish(shared.budget.deposit(key.as_bytes()));
    }
}

/// A body read in full: its bytes and its trailers, if any.
type Buffered = (Bytes, Option<Box<HeaderMap>>);

/// Reads `body` in full, trailers included, if it is at most `limit` bytes
/// (by its size hint and in fact); `Err` gives a body that cannot be
/// buffered back.
async fn buffer<B>(body: B, limit: u64) -> Result<Result<Buffered, ReplayBody<B>>, BoxError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let hint = body.size_hint();
    if hint.lower() > limit {
        return Ok(Err(ReplayBody::inner(body)));
    }
    // Nothing to read (no data, no trailers): the common GET.
    if body.is_end_stream() {
        return Ok(Ok((Bytes::new(), None)));
    }
    let declared = hint.upper().is_some_and(|upper| upper <= limit);
    // Boxed, so that what is left of it can follow what was read.
    let mut body = Box::pin(body);
    // Sized for what the body says it holds (at most `limit`), so that a
    // declared length is read without the doublings of a growing buffer.
    let mut data = Vec::with_capacity(usize::try_from(hint.lower()).unwrap_or(0));
    let mut trailers: Option<HeaderMap> = None;
    while let Some(frame) = poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
        match frame.map_err(Into::into)?.into_data() {
            Ok(chunk) => {
                data.extend_from_slice(&chunk);
                if data.len() as u64 > limit {
                    if declared {
                        return Err("request body longer than its size hint".into());
                    }
                    // Longer than the limit: what was read, then the
                    // rest, once.
                    return Ok(Err(ReplayBody::prefixed(Bytes::from(data), body)));
                }
            }
            Err(frame) => {
                if let Ok(more) = frame.into_trailers() {
                    trailers.get_or_insert_with(HeaderMap::new).extend(more);
                }
            }
        }
    }
    // What a body of unknown length grew beyond its size is not kept for
    // the call's life (up to twice its length otherwise).
    data.shrink_to_fit();
    Ok(Ok((Bytes::from(data), trailers.map(Box::new))))
}

/// The classifier's verdict on an attempt.
fn classify<K, L>(shared: &Shared<K, L>, attempt: Attempt<'_>) -> bool {
    match &shared.classify {
        Some(f) => f(attempt),
        None => attempt.is_retryable_by_default(),
    }
}

/// The call, when it has a deadline or a body to read first: budget,
/// attempts and waits. `deadline`, when set, is when the caller's timer
/// cuts it off; no retry is started that would wait past it.
async fn run<S, K, L, B, ResB>(
    shared: Arc<Shared<K, L>>,
    mut inner: S,
    req: Request<B>,
    deadline: Option<Instant>,
) -> Result<Response<ResB>, BoxError>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<ResB>> + Clone,
    S::Error: Into<BoxError>,
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
    K: KeyExtractor<B>,
    L: RetryBudgetLimiter,
{
    let key = key(&shared, &req);
    let throttle = throttle(&shared, &key)?;
    let replayable = is_replayable(&shared, &req);
    let (parts, body) = req.into_parts();
    let (buffered, stream) = if replayable {
        match buffer(body, shared.buffer_limit).await? {
            Ok(data) => (Some(data), None),
            Err(body) => (None, Some(body)),
        }
    } else {
        (None, Some(ReplayBody::inner(body)))
    };
    deposit(&shared, &key);
    let first = match (&buffered, stream) {
        (Some((data, trailers)), _) => {
            ReplayBody::replay(data.clone(), trailers.as_deref().cloned())
        }
        (_, Some(body)) => body,
        (None, None) => return Err("a request without a body".into()),
    };
    let first = Request::from_parts(parts.clone(), first);
    let (result, attempts) = match (&shared.hedger, &buffered) {
        (Some(hedger), Some((data, trailers))) => {
            let again = || {
                let body = ReplayBody::replay(data.clone(), trailers.as_deref().cloned());
                Request::from_parts(parts.clone(), body)
            };
            hedged(&shared, hedger, &mut inner, first, again, &key, deadline).await
        }
        _ => (attempt(&mut inner, first).await, 1),
    };
    let t = throttle.as_deref();
    let replayable = buffered.is_some();
    let Some(wait) = after_attempt(&shared, t, &result, attempts, replayable, deadline) else {
        return result;
    };
    let Some(buffered) = buffered else {
        return result;
    };
    let resume = Resume {
        inner,
        parts,
        buffered,
        key,
    };
    retries(shared, throttle, resume, (result, attempts), wait, deadline).await
}

/// The first attempt, and its hedge if it is still unanswered after the
/// hedge's delay and the budget grants one: the answer, and how many
/// attempts were made (1 or 2). The first answer not worth a retry wins
/// and the other attempt is dropped; one worth a retry waits for the
/// other, whose answer is then the call's.
async fn hedged<S, K, L, B, ResB>(
    shared: &Shared<K, L>,
    hedger: &super::hedge::Hedger,
    inner: &mut S,
    first: Request<ReplayBody<B>>,
    again: impl FnOnce() -> Request<ReplayBody<B>>,
    key: &KeyBytes,
    deadline: Option<Instant>,
) -> (Result<Response<ResB>, BoxError>, u32)
where
    S: Service<Request<ReplayBody<B>>, Response = Response<ResB>> + Clone,
    S::Error: Into<BoxError>,
    L: RetryBudgetLimiter,
{
    use super::hedge::{race, Raced};
    let mut other = inner.clone();
    let started = Instant::now();
    let mut first = std::pin::pin!(attempt(inner, first));
    let delay = hedger.delay();
    let hedge_at = started.checked_add(delay);
    // No hedge the caller's deadline would cut off before it could help.
    let Some(hedge_at) = hedge_at.filter(|at| deadline.is_none_or(|d| *at < d)) else {
        let result = first.await;
        hedger.record(started.elapsed());
        return (result, 1);
    };
    let mut sleep = std::pin::pin!(tokio::time::sleep_until(hedge_at));
    let early = poll_fn(|cx| {
        if let Poll::Ready(result) = first.as_mut().poll(cx) {
            return Poll::Ready(Some(result));
        }
        sleep.as_mut().poll(cx).map(|()| None)
    })
    .await;
    if let Some(result) = early {
        hedger.record(started.elapsed());
        return (result, 1);
    }
    // The withdrawal (a store call, on Redis) runs while the first
    // attempt may still answer: an answer is never held up by it.
    let mut withdrawal = std::pin::pin!(withdraw(shared, key));
    let granted = poll_fn(|cx| {
        if let Poll::Ready(result) = first.as_mut().poll(cx) {
            return Poll::Ready(Err(result));
        }
        withdrawal.as_mut().poll(cx).map(Ok)
    })
    .await;
    match granted {
        Err(result) => {
            hedger.record(started.elapsed());
            return (result, 1);
        }
        Ok(false) => {
            let result = first.await;
            hedger.record(started.elapsed());
            return (result, 1);
        }
        Ok(true) => {}
    }
    shared.metrics.hedges.increment(1);
    let hedge_started = Instant::now();
    let mut second = std::pin::pin!(attempt(&mut other, again()));
    let worth_retrying = |result: &Result<Response<ResB>, BoxError>| match result {
        Ok(res) => classify(
            shared,
            Attempt::Response {
                status: res.status(),
                headers: res.headers(),
            },
        ),
        Err(error) => classify(shared, Attempt::Error(error)),
    };
    // An answer worth a retry waits for the other attempt, but no longer
    // than the hedge's own delay: then it is the call's answer (and the
    // retries, if any, follow), where a hung attempt would hold it.
    let patience = delay;
    let result = match race(first.as_mut(), second.as_mut()).await {
        Raced::First(result) => {
            hedger.record(started.elapsed());
            if !worth_retrying(&result) {
                return (result, 2);
            }
            match tokio::time::timeout(patience, second.as_mut()).await {
                Ok(other) => {
                    hedger.record(hedge_started.elapsed());
                    other
                }
                Err(_) => result,
            }
        }
        Raced::Second(result) => {
            hedger.record(hedge_started.elapsed());
            // The first attempt took at least this long (a lower bound:
            // without it, the slow calls hedges win would leave the
            // percentile, and the hedge rate would climb).
            hedger.record(started.elapsed());
            if !worth_retrying(&result) {
                return (result, 2);
            }
            match tokio::time::timeout(patience, first.as_mut()).await {
                Ok(other) => other,
                Err(_) => result,
            }
        }
    };
    (result, 2)
}

/// Withdraws a retry (or hedge) from the budget of `key`: whether it was
/// granted. A store that fails grants none. Records the balance, and a
/// refusal as exhausted.
async fn withdraw<K, L: RetryBudgetLimiter>(shared: &Shared<K, L>, key: &KeyBytes) -> bool {
    let m = &shared.metrics;
    let answer = match shared.budget.withdraw_sync(key.as_bytes()) {
        Some(answer) => answer,
        None => shared.budget.withdraw(key.as_bytes()).await,
    };
    if let Some(balance) = answer.as_ref().ok().and_then(|w| w.balance) {
        #[allow(clippy::cast_precision_loss)] // a metric's value
        m.budget.record(balance as f64 / RETRY_UNIT as f64);
    }
    let granted = answer.is_ok_and(|w| w.granted);
    if !granted {
        m.exhausted.increment(1);
    }
    granted
}

/// One attempt: the service made ready, then called.
async fn attempt<S, B, ResB>(
    inner: &mut S,
    request: Request<ReplayBody<B>>,
) -> Result<Response<ResB>, BoxError>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<ResB>>,
    S::Error: Into<BoxError>,
{
    poll_fn(|cx| inner.poll_ready(cx))
        .await
        .map_err(Into::into)?;
    inner.call(request).await.map_err(Into::into)
}

/// What follows attempt number `attempt`, which ended in `result`: the
/// wait before a retry, or `None` when the result is the answer — not
/// worth a retry, not possible (`replayable` false, attempts used up),
/// the server says it cannot help, or asks for a longer wait than the
/// caller gives, or the wait would pass the `deadline`. Records the
/// outcome on the upstream's adaptive `throttle`.
fn after_attempt<K, L, ResB>(
    shared: &Shared<K, L>,
    throttle: Option<&Throttle>,
    result: &Result<Response<ResB>, BoxError>,
    attempt: u32,
    replayable: bool,
    deadline: Option<Instant>,
) -> Option<Duration> {
    let (retryable, hint) = match result {
        Ok(res) => {
            let (status, headers) = (res.status(), res.headers());
            if let Some(t) = throttle {
                // Refused for overload (429, 502, 503, 504, gRPC
                // `UNAVAILABLE` and `RESOURCE_EXHAUSTED`): not an accept.
                t.record(!Completion::from_parts(status, headers).is_refusal());
            }
            let retryable = classify(shared, Attempt::Response { status, headers });
            // What the server says about when: read only for a retry.
            let hint = if retryable {
                server_hint(status, headers)
            } else {
                None
            };
            (retryable, hint)
        }
        Err(error) => {
            if let Some(t) = throttle {
                t.record(false);
            }
            (
                classify(shared, Attempt::Error(error)),
                Some(Duration::ZERO),
            )
        }
    };
    let hint = hint.filter(|hint| {
        retryable && replayable && attempt < shared.max_attempts && *hint <= shared.max_server_wait
    })?;
    // The server's hint plus the backoff's jitter: clients told to come
    // back in a second do not all come back in the same millisecond.
    let wait = hint.saturating_add(shared.backoff.wait(attempt.saturating_sub(1)));
    if deadline.is_some_and(|d| Instant::now().checked_add(wait).is_none_or(|at| at >= d)) {
        return None;
    }
    Some(wait)
}

/// The retries after a first attempt that ended in `result` and asked for
/// `wait`: the budget's withdrawal, the wait, the attempt, again while
/// the budget and the attempts allow.
async fn retries<S, K, L, B, ResB>(
    shared: Arc<Shared<K, L>>,
    throttle: Option<Arc<Throttle>>,
    mut resume: Resume<S>,
    (mut result, mut attempts): (Result<Response<ResB>, BoxError>, u32),
    mut wait: Duration,
    deadline: Option<Instant>,
) -> Result<Response<ResB>, BoxError>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<ResB>>,
    S::Error: Into<BoxError>,
    L: RetryBudgetLimiter,
{
    let m = &shared.metrics;
    loop {
        // A store that fails allows no retry: retrying is never needed to
        // stay up, and a storm is what the budget is for.
        if !withdraw(&shared, &resume.key).await {
            return result;
        }
        // The withdrawal took its time (a store far away): if the wait no
        // longer fits before the deadline, the answer in hand goes back,
        // rather than a `DeadlineExceeded` in the middle of the wait. The
        // withdrawn retry is spent unused (the budget has no give-back):
        // it errs toward fewer retries.
        if deadline.is_some_and(|d| Instant::now().checked_add(wait).is_none_or(|at| at >= d)) {
            return result;
        }
        drop(result);
        m.retries.increment(1);
        tokio::time::sleep(wait).await;
        let (data, trailers) = &resume.buffered;
        let body = ReplayBody::replay(data.clone(), trailers.as_deref().cloned());
        let request = Request::from_parts(resume.parts.clone(), body);
        result = attempt(&mut resume.inner, request).await;
        attempts = attempts.saturating_add(1);
        match after_attempt(
            &shared,
            throttle.as_deref(),
            &result,
            attempts,
            true,
            deadline,
        ) {
            Some(next) => wait = next,
            None => return result,
        }
    }
}
