//! The gRPC quickstart: a tonic server with tollgate's layers on its
//! router (`cargo run -p tollgate-examples --bin grpc-quickstart`).
//!
//! - `grpc.health.v1.Health` (tonic-health): 5 checks a second, bursts of
//!   5, per `x-api-key` metadata value, else per peer address.
//! - `tollgate.demo.v1.Inventory`, a service of its own (messages below,
//!   no code generation): 10 cost units a second per client, bursts of
//!   20, where `GetItem` costs 1 and `Report` 10; and `Watch`, a
//!   server-streaming method, at most 2 streams at once per client — the
//!   permit lasts until the stream ends or the client goes away.
//!
//! Each limit keyed by client is bounded per peer address too, at
//! [`PER_ADDRESS`](crate::PER_ADDRESS) times the client's (checks and cost
//! units, each pair decided as one; `Watch` streams, by a second
//! in-flight limit around the first): rotating `x-api-key` values from one
//! address buys nothing past the address's budget. The health service's
//! own `Watch` stream is held to 8 at once per address. (Behind a proxy
//! the peer is the proxy: key by `ClientIp` with trusted proxies there.)
//!
//! Refusals are gRPC statuses: `RESOURCE_EXHAUSTED` with
//! `grpc-retry-pushback-ms` (the wait, in milliseconds), or
//! `INVALID_ARGUMENT` for a request with no key.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::{Context, Poll};

use tollgate::concurrency::ConcurrencyLayer;
use tollgate::core::{ConcurrencyLimiter, Store};
use tollgate::cost::ByRoute;
use tollgate::key::{Header, KeyExtractorExt, PeerAddrLayer, PeerIp};
use tollgate::policy::{PolicyLayer, RateRule};
use tollgate::{Limit, Rate};
use tonic::body::Body;
use tonic::codegen::BoxFuture;
use tonic::server::NamedService;
use tonic::transport::server::TcpConnectInfo;
use tonic::{Request, Response, Status};
use tower::util::BoxCloneSyncService;
use tower::{Layer, Service, ServiceExt};

/// The messages of `tollgate.demo.v1.Inventory`, written out by hand
/// (prost derives their encoding; no `.proto` build step).
pub mod pb {
    /// Which item.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ItemRequest {
        /// The item's id.
        #[prost(string, tag = "1")]
        pub id: String,
    }

    /// An item and its stock.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Item {
        /// The item's id.
        #[prost(string, tag = "1")]
        pub id: String,
        /// Units in stock.
        #[prost(uint32, tag = "2")]
        pub stock: u32,
    }

    /// Watch an item's stock for `updates` values (the current one
    /// first, then one per change).
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct WatchRequest {
        /// The item's id.
        #[prost(string, tag = "1")]
        pub id: String,
        /// How many values to send before the stream ends.
        #[prost(uint32, tag = "2")]
        pub updates: u32,
    }
}

/// The demo service's full name.
pub const INVENTORY: &str = "tollgate.demo.v1.Inventory";
/// `GetItem`'s path (cost 1).
pub const GET_ITEM: &str = "/tollgate.demo.v1.Inventory/GetItem";
/// `Report`'s path (cost 10).
pub const REPORT: &str = "/tollgate.demo.v1.Inventory/Report";
/// `Watch`'s path (server streaming; 2 at once per client).
pub const WATCH: &str = "/tollgate.demo.v1.Inventory/Watch";

type HttpService = BoxCloneSyncService<http::Request<Body>, http::Response<Body>, Infallible>;

/// Declares a route of the tonic router: a boxed service under a gRPC
/// service name (tonic routes by `NamedService::NAME`).
macro_rules! named {
    ($(#[$doc:meta])* $ty:ident, $name:expr) => {
        $(#[$doc])*
        #[derive(Clone)]
        pub struct $ty(HttpService);

        impl std::fmt::Debug for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(stringify!($ty))
            }
        }

        impl NamedService for $ty {
            const NAME: &'static str = $name;
        }

        impl Service<http::Request<Body>> for $ty {
            type Response = http::Response<Body>;
            type Error = Infallible;
            type Future = BoxFuture<http::Response<Body>, Infallible>;

            fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
                self.0.poll_ready(cx)
            }

            fn call(&mut self, req: http::Request<Body>) -> Self::Future {
                Box::pin(self.0.call(req))
            }
        }
    };
}

named!(
    /// The health service behind its rate limit.
    LimitedHealth,
    "grpc.health.v1.Health"
);
named!(
    /// The inventory service behind its policy and concurrency limit.
    LimitedInventory,
    "tollgate.demo.v1.Inventory"
);

/// Boxes a layered service, its response body made tonic's.
fn boxed<S, B>(svc: S) -> HttpService
where
    S: Service<http::Request<Body>, Response = http::Response<B>, Error = Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    BoxCloneSyncService::new(svc.map_response(|res| res.map(Body::new)))
}

/// The stock the demo serves, which tests (and the binary's ticker)
/// change.
#[derive(Debug, Clone)]
pub struct Stock(Arc<tokio::sync::watch::Sender<u32>>);

impl Stock {
    /// Sets the stock, waking every `Watch` stream.
    pub fn set(&self, units: u32) {
        self.0.send_replace(units);
    }
}

/// The gRPC quickstart's services, with their limits on `store`, and a
/// handle on the watch limit (to read permits held, e.g. in tests).
#[derive(Debug)]
pub struct GrpcApp<C> {
    /// The health service, limited.
    pub health: LimitedHealth,
    /// The inventory service, limited.
    pub inventory: LimitedInventory,
    /// Marks services serving or not.
    pub reporter: tonic_health::server::HealthReporter,
    /// The demo stock.
    pub stock: Stock,
    /// The `Watch` streams' concurrency limiter.
    pub watchers: C,
}

/// Builds the gRPC quickstart on `store`.
pub fn grpc_app<S: Store>(store: S) -> Result<GrpcApp<S::ConcurrencyLimiter>, crate::Error>
where
    S::ConcurrencyLimiter: Clone,
{
    // The client: its `x-api-key` metadata, else its address (tonic's
    // connect info, copied by `PeerAddrLayer` outside the router).
    let client = Header::named("x-api-key")?.or(PeerIp::new());
    let per = crate::PER_ADDRESS;
    let (reporter, health) = tonic_health::server::health_reporter();
    // Per client, and per address: one decision.
    let health_limit = PolicyLayer::builder()
        .rule(RateRule::new(
            "health",
            Limit::gcra(Rate::per_second(5), 5),
            client.clone(),
        ))
        .rule(RateRule::new(
            "health-address",
            Limit::gcra(Rate::per_second(5 * per), 5 * per),
            PeerIp::new(),
        ))
        .store(store.clone())
        .build()?;
    // Health's `Watch` is a server stream: open ones held per address.
    let health_streams = ConcurrencyLayer::builder("health-streams-address", 8)
        .key(PeerIp::new())
        .store(store.clone())
        .build()?;
    let health = LimitedHealth(boxed(health_limit.layer(health_streams.layer(health))));

    let (tx, _) = tokio::sync::watch::channel(100u32);
    let stock = Stock(Arc::new(tx));
    let watchers = ConcurrencyLayer::builder("watchers", 2)
        .key(client.clone())
        .store(store.clone())
        .build()?;
    let watchers_address = ConcurrencyLayer::builder("watchers-address", 2 * per)
        .key(PeerIp::new())
        .store(store.clone())
        .build()?;
    let watch_limiter = watchers.limiter().clone();
    // `Watch` as an HTTP service, so that the concurrency layers wrap its
    // response body: the permits last as long as the stream.
    let watch_stock = stock.clone();
    let watch = boxed(
        watchers_address.layer(watchers.layer(tower::service_fn(move |req| {
            let method = Streams(watch_stock.clone());
            async move {
                let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::default());
                Ok::<_, Infallible>(grpc.server_streaming(method, req).await)
            }
        }))),
    );
    let costs = ByRoute::new(1).route(None, REPORT, 10);
    let policy = PolicyLayer::builder()
        .rule(
            RateRule::new("per-client", Limit::gcra(Rate::per_second(10), 20), client)
                .cost(costs.clone()),
        )
        .rule(
            RateRule::new(
                "per-address",
                Limit::gcra(Rate::per_second(10 * per), 20 * per),
                PeerIp::new(),
            )
            .cost(costs),
        )
        .store(store)
        .build()?;
    let inventory = LimitedInventory(boxed(policy.layer(Inventory {
        stock: stock.clone(),
        watch,
    })));
    Ok(GrpcApp {
        health,
        inventory,
        reporter,
        stock,
        watchers: watch_limiter,
    })
}

/// Serves `app` on `listener` until `shutdown` resolves: the peer address
/// copied out of tonic's connect info first, then the limited services.
pub async fn serve_grpc<C>(
    listener: tokio::net::TcpListener,
    app: GrpcApp<C>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    let peer = PeerAddrLayer::new(|info: &TcpConnectInfo| info.remote_addr());
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    tonic::transport::Server::builder()
        .layer(peer)
        .add_service(app.health)
        .add_service(app.inventory)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
}

/// The inventory's methods (`Watch` comes through its limit).
#[derive(Clone)]
struct Inventory {
    stock: Stock,
    watch: HttpService,
}

impl Service<http::Request<Body>> for Inventory {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<http::Response<Body>, Infallible>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let stock = self.stock.clone();
        match req.uri().path() {
            GET_ITEM | REPORT => Box::pin(async move {
                let item = Unary(stock);
                let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::default());
                Ok(grpc.unary(item, req).await)
            }),
            WATCH => {
                let watch = self.watch.clone();
                Box::pin(watch.oneshot(req))
            }
            _ => Box::pin(async { Ok(Status::unimplemented("no such method").into_http()) }),
        }
    }
}

/// `GetItem` and `Report`: the item and its stock.
struct Unary(Stock);

impl tonic::server::UnaryService<pb::ItemRequest> for Unary {
    type Response = pb::Item;
    type Future = BoxFuture<Response<pb::Item>, Status>;

    fn call(&mut self, request: Request<pb::ItemRequest>) -> Self::Future {
        let stock = *self.0 .0.borrow();
        let id = request.into_inner().id;
        Box::pin(async move { Ok(Response::new(pb::Item { id, stock })) })
    }
}

struct Streams(Stock);

type ItemStream = tokio_stream::wrappers::ReceiverStream<Result<pb::Item, Status>>;

impl tonic::server::ServerStreamingService<pb::WatchRequest> for Streams {
    type Response = pb::Item;
    type ResponseStream = ItemStream;
    type Future = BoxFuture<Response<ItemStream>, Status>;

    fn call(&mut self, request: Request<pb::WatchRequest>) -> Self::Future {
        let mut changes = self.0 .0.subscribe();
        let pb::WatchRequest { id, updates } = request.into_inner();
        Box::pin(async move {
            let (tx, rx) = tokio::sync::mpsc::channel(4);
            tokio::spawn(async move {
                for sent in 0..updates {
                    if sent > 0 {
                        // The next change, or the client leaving.
                        tokio::select! {
                            changed = changes.changed() => if changed.is_err() { return },
                            () = tx.closed() => return,
                        }
                    }
                    let stock = *changes.borrow_and_update();
                    let item = pb::Item {
                        id: id.clone(),
                        stock,
                    };
                    if tx.send(Ok(item)).await.is_err() {
                        return;
                    }
                }
            });
            Ok(Response::new(ItemStream::new(rx)))
        })
    }
}

/// The permits `watchers` holds for a client keyed by `x-api-key: key`.
pub async fn watchers_held<C: ConcurrencyLimiter>(watchers: &C, key: &str) -> u64 {
    use tollgate::key::{KeyBuf, KeyExtractor};
    let req = http::Request::builder()
        .header("x-api-key", key)
        .body(())
        .unwrap_or_default();
    let mut buf = KeyBuf::new();
    let client = match Header::named("x-api-key") {
        Ok(h) => h.or(PeerIp::new()),
        Err(_) => return 0,
    };
    if client.extract(&req, &mut buf).is_none() {
        return 0;
    }
    watchers.held(buf.as_bytes()).await.unwrap_or(0)
}

/// Where the binary listens by default.
pub const DEFAULT_GRPC_ADDR: &str = "127.0.0.1:50051";

/// The address from `TOLLGATE_GRPC_ADDR`, else the default.
pub fn grpc_addr() -> Result<SocketAddr, std::net::AddrParseError> {
    std::env::var("TOLLGATE_GRPC_ADDR")
        .unwrap_or_else(|_| DEFAULT_GRPC_ADDR.to_owned())
        .parse()
}
