//! Shared helpers for tollgate's criterion benches (see `benches/`).
//!
//! Run them with `cargo bench -p tollgate-benches`; the figures and how to
//! read them are in this folder's README.

/// `n` distinct pseudo-random 16-byte keys (SplitMix64), the same on every
/// run so results compare run to run.
pub fn keys(n: usize, seed: u64) -> Vec<[u8; 16]> {
    let mut state = seed;
    let mut next = move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    (0..n)
        .map(|_| {
            let mut key = [0u8; 16];
            key[..8].copy_from_slice(&next().to_le_bytes());
            key[8..].copy_from_slice(&next().to_le_bytes());
            key
        })
        .collect()
}

/// The stacks of the `layer_overhead` group, shared by the bench and the
/// `layer_instructions` example: an axum router with one handler, bare or
/// behind each limiter, keyed on `x-api-key`, headers on.
pub mod layer {
    use std::time::Duration;

    use axum::body::Body;
    use axum::http::{HeaderValue, Request};
    use axum::routing::get;
    use axum::Router;
    use tollgate::key::Header;
    use tollgate::{Limit, Rate, RateLimitLayer};
    use tower_governor::governor::GovernorConfigBuilder;
    use tower_governor::key_extractor::KeyExtractor;
    use tower_governor::{GovernorError, GovernorLayer};

    /// The router alone.
    pub fn router() -> Router {
        Router::new().route("/", get(|| async { "ok" }))
    }

    /// The request every stack serves.
    pub fn request() -> Request<Body> {
        let mut req = Request::new(Body::empty());
        req.headers_mut().insert(
            "x-api-key",
            HeaderValue::from_static("bench-key-0123456789"),
        );
        req
    }

    /// tower_governor's key from the `x-api-key` header (`HeaderValue`: a
    /// cheap clone, the fairest owned key it allows).
    #[derive(Clone, Debug)]
    pub struct ApiKey;

    impl KeyExtractor for ApiKey {
        type Key = HeaderValue;

        fn extract<T>(&self, req: &Request<T>) -> Result<Self::Key, GovernorError> {
            req.headers()
                .get("x-api-key")
                .cloned()
                .ok_or(GovernorError::UnableToExtractKey)
        }
    }

    /// The router behind tollgate's layer enforcing `limit`.
    pub fn tollgate(limit: Limit) -> Router {
        let key = Header::named("x-api-key").unwrap_or_else(|e| unreachable!("{e}"));
        let layer = RateLimitLayer::builder("bench", limit)
            .key(key)
            .build()
            .unwrap_or_else(|e| unreachable!("{e}"));
        router().layer(layer)
    }

    /// A quota no request exhausts: one unit per ns, a burst worth a second.
    pub fn tollgate_allowing() -> Router {
        tollgate(Limit::gcra(Rate::per_second(1_000_000_000), 1_000_000_000))
    }

    /// One unit a day: after the first request, every call is a 429.
    pub fn tollgate_denying() -> Router {
        tollgate(Limit::gcra(Rate::per_day(1), 1))
    }

    /// The router behind tower_governor's layer: one cell per `period`,
    /// bursts of `burst`.
    pub fn governor(period: Duration, burst: u32) -> Router {
        let config = GovernorConfigBuilder::default()
            .period(period)
            .burst_size(burst)
            .key_extractor(ApiKey)
            .use_headers()
            .finish()
            .unwrap_or_else(|| unreachable!("valid governor config"));
        router().layer(GovernorLayer::new(config))
    }

    /// tower_governor with a quota no request exhausts.
    pub fn governor_allowing() -> Router {
        governor(Duration::from_nanos(1), 1_000_000_000)
    }

    /// tower_governor with one cell a day.
    pub fn governor_denying() -> Router {
        governor(Duration::from_secs(86_400), 1)
    }
}

/// The stacks of the `concurrency_overhead` group: the same router as
/// [`layer`], bare, behind tollgate's per-key concurrency limit (in-memory
/// store, keyed on `x-api-key`, headers on), and behind tower's global
/// `ConcurrencyLimitLayer` with `LoadShedLayer` (so it answers at once
/// rather than waiting, as tollgate does).
pub mod concurrency {
    use axum::body::Body;
    use axum::Router;
    use tollgate::concurrency::ConcurrencyLayer;
    use tollgate::key::{Header, KeyExtractor};

    use crate::layer::router;

    /// The router behind tollgate's per-key limit of `max` in flight,
    /// with the standard headers on (the default) or off.
    pub fn tollgate(max: u32, headers: bool) -> Router {
        let key = Header::named("x-api-key").unwrap_or_else(|e| unreachable!("{e}"));
        keyed(key, max, headers)
    }

    /// The router behind tollgate's limit of `max` in flight for the
    /// whole service (key [`Global`](tollgate::key::Global)), without
    /// headers: the work tower's global semaphore does, plus holding the
    /// permit to the body's end.
    pub fn tollgate_global(max: u32) -> Router {
        keyed(tollgate::key::Global, max, false)
    }

    /// The router behind tollgate's limit of `max` in flight per `key`.
    fn keyed<K>(key: K, max: u32, headers: bool) -> Router
    where
        K: KeyExtractor<Body> + Send + Sync + 'static,
    {
        let layer = ConcurrencyLayer::builder("bench", max)
            .key(key)
            .headers(headers)
            .build()
            .unwrap_or_else(|e| unreachable!("{e}"));
        router().layer(layer)
    }

    /// The router behind a global limit of `max` built by hand from
    /// tower's parts, holding each permit until the response body ends
    /// (what tower-http PR #447 asks tower for): tokio's semaphore, a
    /// permit taken in `call` (a full limit answers 503 at once), and a
    /// body wrapper that drops it. The like-for-like peer of
    /// [`tollgate_global`]: the same work, no keys, no headers.
    pub fn tower_body(max: usize) -> Router {
        router().layer(held::HeldLayer::new(max))
    }

    /// The router behind tower's global limit of `max`, shedding load.
    pub fn tower(max: usize) -> Router {
        router().layer(
            tower::ServiceBuilder::new()
                .layer(axum::error_handling::HandleErrorLayer::new(
                    |_: tower::BoxError| async { axum::http::StatusCode::SERVICE_UNAVAILABLE },
                ))
                .layer(tower::load_shed::LoadShedLayer::new())
                .layer(tower::limit::ConcurrencyLimitLayer::new(max)),
        )
    }

    /// A semaphore permit held to the end of the response body, written
    /// the way a tower user would write it.
    // pin-project-lite takes no docs on an enum variant's fields.
    #[allow(missing_docs)]
    pub mod held {
        use std::future::Future;
        use std::pin::Pin;
        use std::sync::Arc;
        use std::task::{Context, Poll};

        use axum::body::Body;
        use axum::http::{Request, Response, StatusCode};
        use http_body::{Frame, SizeHint};
        use pin_project_lite::pin_project;
        use tokio::sync::{OwnedSemaphorePermit, Semaphore};
        use tower::{Layer, Service};

        /// Limits a service to `max` requests in flight, bodies included.
        #[derive(Clone, Debug)]
        pub struct HeldLayer(Arc<Semaphore>);

        impl HeldLayer {
            /// A limit of `max` requests in flight.
            pub fn new(max: usize) -> Self {
                Self(Arc::new(Semaphore::new(max)))
            }
        }

        impl<S> Layer<S> for HeldLayer {
            type Service = Held<S>;

            fn layer(&self, inner: S) -> Held<S> {
                Held {
                    inner,
                    semaphore: Arc::clone(&self.0),
                }
            }
        }

        /// The service of [`HeldLayer`].
        #[derive(Clone, Debug)]
        pub struct Held<S> {
            inner: S,
            semaphore: Arc<Semaphore>,
        }

        impl<S> Service<Request<Body>> for Held<S>
        where
            S: Service<Request<Body>, Response = Response<Body>>,
        {
            type Response = Response<HeldBody>;
            type Error = S::Error;
            type Future = HeldFuture<S::Future>;

            fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
                self.inner.poll_ready(cx)
            }

            fn call(&mut self, req: Request<Body>) -> Self::Future {
                match Arc::clone(&self.semaphore).try_acquire_owned() {
                    Ok(permit) => HeldFuture::Running {
                        future: self.inner.call(req),
                        permit: Some(permit),
                    },
                    Err(_) => HeldFuture::Shed,
                }
            }
        }

        pin_project! {
            /// Response future of [`Held`].
            #[project = HeldProj]
            pub enum HeldFuture<F> {
                /// The inner service's future, and the permit it holds.
                Running {
                    #[pin]
                    future: F,
                    permit: Option<OwnedSemaphorePermit>,
                },
                /// The limit was full: 503 at once.
                Shed,
            }
        }

        impl<F, E> Future for HeldFuture<F>
        where
            F: Future<Output = Result<Response<Body>, E>>,
        {
            type Output = Result<Response<HeldBody>, E>;

            fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
                match self.project() {
                    HeldProj::Running { future, permit } => {
                        let res = std::task::ready!(future.poll(cx))?;
                        Poll::Ready(Ok(res.map(|body| HeldBody {
                            body,
                            permit: permit.take(),
                        })))
                    }
                    HeldProj::Shed => {
                        let mut res = Response::new(HeldBody {
                            body: Body::empty(),
                            permit: None,
                        });
                        *res.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
                        Poll::Ready(Ok(res))
                    }
                }
            }
        }

        pin_project! {
            /// A response body holding its request's permit until it ends
            /// or is dropped.
            #[derive(Debug)]
            pub struct HeldBody {
                #[pin]
                body: Body,
                permit: Option<OwnedSemaphorePermit>,
            }
        }

        impl http_body::Body for HeldBody {
            type Data = <Body as http_body::Body>::Data;
            type Error = <Body as http_body::Body>::Error;

            fn poll_frame(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
            ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
                let this = self.project();
                let frame = std::task::ready!(this.body.poll_frame(cx));
                if frame.is_none() {
                    // The body's end: the request is done.
                    this.permit.take();
                }
                Poll::Ready(frame)
            }

            fn is_end_stream(&self) -> bool {
                self.body.is_end_stream()
            }

            fn size_hint(&self) -> SizeHint {
                self.body.size_hint()
            }
        }
    }
}

/// The `retry_overhead` group's peer, shared by the bench and the
/// `retry_instructions` example: tower's `Retry` with a `TpsBudget`, and
/// the request every stack is called with.
pub mod retry {
    use std::convert::Infallible;
    use std::future::{ready, Ready};
    use std::sync::Arc;
    use std::time::Duration;

    use axum::http::{Request, Response};
    use tollgate::retry::{ReplayBody, RetryBudgetLayer};
    use tower::retry::budget::{Budget, TpsBudget};
    use tower::retry::{Policy, RetryLayer};
    use tower::{service_fn, BoxError, Layer, Service};

    /// The upstream of every stack: answers 200 at once.
    fn upstream<B>(
    ) -> impl Service<Request<B>, Response = Response<String>, Error = Infallible, Future: Send>
           + Clone
           + Send {
        service_fn(|_req: Request<B>| async { Ok::<_, Infallible>(Response::new(String::new())) })
    }

    /// The upstream called directly.
    pub fn bare(
    ) -> impl Service<Request<String>, Response = Response<String>, Error = Infallible> + Clone
    {
        upstream()
    }

    /// The upstream behind tollgate's `RetryBudgetLayer` (memory store,
    /// default budget: 20 % over 10 s, 10 retries a second).
    pub fn tollgate(
    ) -> impl Service<Request<String>, Response = Response<String>, Error = BoxError> + Clone {
        RetryBudgetLayer::builder("bench")
            .build()
            .unwrap_or_else(|e| unreachable!("{e}"))
            .layer(upstream::<ReplayBody<String>>())
    }

    /// [`tollgate`] with one budget for every upstream (key
    /// [`Global`](tollgate::key::Global)), as tower's `TpsBudget` is.
    pub fn tollgate_global(
    ) -> impl Service<Request<String>, Response = Response<String>, Error = BoxError> + Clone {
        RetryBudgetLayer::builder("bench")
            .key(tollgate::key::Global)
            .build()
            .unwrap_or_else(|e| unreachable!("{e}"))
            .layer(upstream::<ReplayBody<String>>())
    }

    /// [`tollgate`] with its budget in `store` (a Redis store: one budget
    /// for a fleet).
    pub fn tollgate_on<St: tollgate::core::RetryBudgetStore>(
        store: St,
    ) -> impl Service<Request<String>, Response = Response<String>, Error = BoxError> + Clone {
        RetryBudgetLayer::builder("bench")
            .store(store)
            .build()
            .unwrap_or_else(|e| unreachable!("{e}"))
            .layer(upstream::<ReplayBody<String>>())
    }

    /// The upstream behind tower's `Retry` with a `TpsBudget` of the same
    /// budget.
    pub fn tower(
    ) -> impl Service<Request<String>, Response = Response<String>, Error = Infallible> + Clone
    {
        let budget = Arc::new(TpsBudget::new(Duration::from_secs(10), 10, 0.2));
        RetryLayer::new(Tps(budget)).layer(upstream())
    }

    /// tower's retry policy: retry 5xx while the budget allows; deposit
    /// on success.
    #[derive(Debug, Clone)]
    pub struct Tps(pub Arc<TpsBudget>);

    impl<E> Policy<Request<String>, Response<String>, E> for Tps {
        type Future = Ready<()>;

        fn retry(
            &mut self,
            _req: &mut Request<String>,
            result: &mut Result<Response<String>, E>,
        ) -> Option<Self::Future> {
            match result {
                Ok(res) if !res.status().is_server_error() => {
                    self.0.deposit();
                    None
                }
                _ => self.0.withdraw().then(|| ready(())),
            }
        }

        fn clone_request(&mut self, req: &Request<String>) -> Option<Request<String>> {
            let mut clone = Request::new(req.body().clone());
            *clone.method_mut() = req.method().clone();
            *clone.uri_mut() = req.uri().clone();
            *clone.headers_mut() = req.headers().clone();
            Some(clone)
        }
    }

    /// A small GET to an upstream.
    pub fn request() -> Request<String> {
        Request::get("http://upstream.bench/items")
            .body(String::new())
            .unwrap_or_default()
    }
}
