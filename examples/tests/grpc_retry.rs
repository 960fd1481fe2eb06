//! A real tonic client, its channel wrapped in tollgate's retry budget,
//! against a real tonic server that fails calls with `UNAVAILABLE`: a call
//! marked idempotent (by its path or by the `Idempotent` extension) is
//! retried with the same message; an unmarked one (every gRPC call is a
//! POST) is not; a negative `grpc-retry-pushback-ms` stops retries.
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::panic,
    clippy::arithmetic_side_effects
)]

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tollgate::retry::{Idempotent, ReplayBody, RetryBudgetLayer};
use tonic::metadata::MetadataMap;
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
use tower::ServiceBuilder;

/// A health service that fails its first `failures` checks with
/// `UNAVAILABLE` (and the pushback `pushback`, if any), then serves; it
/// keeps every request's service name.
#[derive(Clone)]
struct Flaky {
    failures: usize,
    pushback: Option<&'static str>,
    seen: Arc<std::sync::Mutex<Vec<String>>>,
    calls: Arc<AtomicUsize>,
}

type Watch = Pin<Box<dyn tokio_stream::Stream<Item = Result<HealthCheckResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Health for Flaky {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        self.seen.lock().unwrap().push(request.into_inner().service);
        if n < self.failures {
            let mut meta = MetadataMap::new();
            if let Some(ms) = self.pushback {
                meta.insert("grpc-retry-pushback-ms", ms.parse().unwrap());
            }
            return Err(Status::with_metadata(Code::Unavailable, "down", meta));
        }
        Ok(Response::new(HealthCheckResponse {
            status: ServingStatus::Serving as i32,
        }))
    }

    type WatchStream = Watch;

    async fn watch(
        &self,
        _request: Request<HealthCheckRequest>,
    ) -> Result<Response<Watch>, Status> {
        Err(Status::unimplemented("not here"))
    }
}

/// Serves `flaky` on loopback; a channel to it.
async fn serve(flaky: Flaky) -> Channel {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(HealthServer::new(flaky))
            .serve_with_incoming(incoming),
    );
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

fn flaky(failures: usize, pushback: Option<&'static str>) -> Flaky {
    Flaky {
        failures,
        pushback,
        seen: Arc::default(),
        calls: Arc::default(),
    }
}

/// A health client whose channel retries within a budget; `paths` are
/// the methods marked idempotent.
async fn client(
    flaky: &Flaky,
    paths: &[&str],
) -> HealthClient<
    impl tonic::client::GrpcService<
            tonic::body::Body,
            Error = tollgate::BoxError,
            ResponseBody = tonic::body::Body,
            Future = impl Send,
        > + Clone,
> {
    let channel = serve(flaky.clone()).await;
    let mut retry = RetryBudgetLayer::builder("health")
        .max_attempts(3)
        .backoff(Duration::from_millis(1), Duration::from_millis(2));
    for p in paths {
        retry = retry.idempotent_path(p);
    }
    let stack = ServiceBuilder::new()
        .layer(retry.build().unwrap())
        // The channel takes tonic's body: the replayed one, boxed in it.
        .map_request(|req: http::Request<ReplayBody<tonic::body::Body>>| {
            req.map(tonic::body::Body::new)
        })
        .service(channel);
    HealthClient::new(stack)
}

fn check(service: &str) -> Request<HealthCheckRequest> {
    Request::new(HealthCheckRequest {
        service: service.to_owned(),
    })
}

#[tokio::test]
async fn a_marked_path_is_retried_with_the_same_message() {
    let server = flaky(1, None);
    let mut health = client(&server, &["/grpc.health.v1.Health/Check"]).await;
    let res = health.check(check("inventory")).await.unwrap();
    assert_eq!(res.into_inner().status, ServingStatus::Serving as i32);
    assert_eq!(server.calls.load(Ordering::SeqCst), 2);
    assert_eq!(*server.seen.lock().unwrap(), ["inventory", "inventory"]);
}

#[tokio::test]
async fn the_idempotent_extension_marks_one_call() {
    let server = flaky(1, None);
    let mut health = client(&server, &[]).await;
    let mut req = check("orders");
    req.extensions_mut().insert(Idempotent);
    health.check(req).await.unwrap();
    assert_eq!(server.calls.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn an_unmarked_call_is_a_post_sent_once() {
    let server = flaky(1, None);
    let mut health = client(&server, &[]).await;
    let err = health.check(check("orders")).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
    assert_eq!(server.calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_negative_pushback_means_do_not_retry() {
    let server = flaky(1, Some("-1"));
    let mut health = client(&server, &["/grpc.health.v1.Health/Check"]).await;
    let err = health.check(check("orders")).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
    assert_eq!(server.calls.load(Ordering::SeqCst), 1);
    // A pushback the client honours: retried once it has waited.
    let server = flaky(1, Some("20"));
    let mut health = client(&server, &["/grpc.health.v1.Health/Check"]).await;
    health.check(check("orders")).await.unwrap();
    assert_eq!(server.calls.load(Ordering::SeqCst), 2);
}
