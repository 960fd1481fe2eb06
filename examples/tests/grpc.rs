//! The gRPC quickstart through a real tonic client on loopback, on a
//! manual clock: limits arrive as gRPC statuses with a pushback, and a
//! streaming call holds its permit until the stream ends.
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::panic,
    clippy::arithmetic_side_effects
)]

use std::time::Duration;

use http::uri::PathAndQuery;
use tollgate::core::ManualClock;
use tollgate::MemoryStore;
use tollgate_examples::grpc::{self, pb, GrpcApp};
use tonic::transport::Channel;
use tonic::{Code, Request, Status};
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

type Watchers = <MemoryStore<ManualClock> as tollgate::core::Store>::ConcurrencyLimiter;

struct Server {
    channel: Channel,
    stock: grpc::Stock,
    watchers: Watchers,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn start() -> Server {
    let clock = ManualClock::starting_at(1_000_000_000);
    let store = MemoryStore::builder().clock(clock).build().unwrap();
    let app: GrpcApp<Watchers> = grpc::grpc_app(store).unwrap();
    let (stock, watchers) = (app.stock.clone(), app.watchers.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(grpc::serve_grpc(listener, app, async {
        let _ = stopped.await;
    }));
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    Server {
        channel,
        stock,
        watchers,
        _stop: stop,
    }
}

fn with_key<T>(msg: T, key: Option<&str>) -> Request<T> {
    let mut req = Request::new(msg);
    if let Some(k) = key {
        req.metadata_mut().insert("x-api-key", k.parse().unwrap());
    }
    req
}

async fn check(channel: &Channel, key: Option<&str>) -> Result<(), Status> {
    let mut health = HealthClient::new(channel.clone());
    health
        .check(with_key(
            HealthCheckRequest {
                service: String::new(),
            },
            key,
        ))
        .await
        .map(|_| ())
}

async fn unary(channel: &Channel, path: &'static str, key: &str) -> Result<pb::Item, Status> {
    let mut grpc = tonic::client::Grpc::new(channel.clone());
    grpc.ready().await.unwrap();
    grpc.unary(
        with_key(
            pb::ItemRequest {
                id: "widget".into(),
            },
            Some(key),
        ),
        PathAndQuery::from_static(path),
        tonic_prost::ProstCodec::<pb::ItemRequest, pb::Item>::default(),
    )
    .await
    .map(tonic::Response::into_inner)
}

async fn watch(
    channel: &Channel,
    key: &str,
    updates: u32,
) -> Result<tonic::codec::Streaming<pb::Item>, Status> {
    let mut grpc = tonic::client::Grpc::new(channel.clone());
    grpc.ready().await.unwrap();
    grpc.server_streaming(
        with_key(
            pb::WatchRequest {
                id: "widget".into(),
                updates,
            },
            Some(key),
        ),
        PathAndQuery::from_static(grpc::WATCH),
        tonic_prost::ProstCodec::<pb::WatchRequest, pb::Item>::default(),
    )
    .await
    .map(tonic::Response::into_inner)
}

fn pushback_ms(status: &Status) -> i64 {
    status
        .metadata()
        .get("grpc-retry-pushback-ms")
        .unwrap_or_else(|| panic!("no pushback: {status:?}"))
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

#[tokio::test]
async fn health_checks_are_limited_per_key_with_a_pushback() {
    let s = start().await;
    for _ in 0..5 {
        check(&s.channel, Some("a")).await.unwrap();
    }
    let refused = check(&s.channel, Some("a")).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted);
    // 5 a second: the next check in 200 ms (the clock stands still).
    assert_eq!(pushback_ms(&refused), 200);
    assert_eq!(refused.message(), "Rate limit \"health\" exceeded.");
    // Another key has its own budget; with no key, the peer address is
    // the key (tonic's connect info, read through PeerAddrLayer).
    check(&s.channel, Some("b")).await.unwrap();
    for _ in 0..5 {
        check(&s.channel, None).await.unwrap();
    }
    assert_eq!(
        check(&s.channel, None).await.unwrap_err().code(),
        Code::ResourceExhausted
    );
}

#[tokio::test]
async fn methods_cost_what_they_are_worth() {
    let s = start().await;
    // A report costs 10 of the 20: two pass, a third is refused.
    for _ in 0..2 {
        assert_eq!(
            unary(&s.channel, grpc::REPORT, "a").await.unwrap().stock,
            100
        );
    }
    let refused = unary(&s.channel, grpc::REPORT, "a").await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted);
    // 10 units at 10 a second: one second.
    assert_eq!(pushback_ms(&refused), 1_000);
    // GetItem costs 1: twenty for another client.
    for _ in 0..20 {
        unary(&s.channel, grpc::GET_ITEM, "b").await.unwrap();
    }
    assert_eq!(
        unary(&s.channel, grpc::GET_ITEM, "b")
            .await
            .unwrap_err()
            .code(),
        Code::ResourceExhausted
    );
}

/// Waits until `key` holds `n` watch permits (the server releases a
/// permit as the stream's last frame goes out, which may be a moment
/// after the client has read it).
async fn until_held(s: &Server, key: &str, n: u64) {
    for _ in 0..500 {
        if grpc::watchers_held(&s.watchers, key).await == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "{key} holds {} watch permits, not {n}",
        grpc::watchers_held(&s.watchers, key).await
    );
}

#[tokio::test]
async fn a_stream_holds_its_permit_until_it_ends() {
    let s = start().await;
    let mut a = watch(&s.channel, "k", 2).await.unwrap();
    let mut b = watch(&s.channel, "k", 2).await.unwrap();
    assert_eq!(a.message().await.unwrap().unwrap().stock, 100);
    assert_eq!(b.message().await.unwrap().unwrap().stock, 100);
    assert_eq!(grpc::watchers_held(&s.watchers, "k").await, 2);
    // Two streams open: a third is refused at once.
    let refused = watch(&s.channel, "k", 1).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted);
    // Another client is not.
    let mut other = watch(&s.channel, "other", 1).await.unwrap();
    assert!(other.message().await.unwrap().is_some());
    // The stock changes: both streams send their last value and end.
    s.stock.set(99);
    for stream in [&mut a, &mut b] {
        assert_eq!(stream.message().await.unwrap().unwrap().stock, 99);
        assert!(stream.message().await.unwrap().is_none());
    }
    until_held(&s, "k", 0).await;
    // A stream the client drops (cancels) gives its permit back too.
    let mut c = watch(&s.channel, "k", 5).await.unwrap();
    assert!(c.message().await.unwrap().is_some());
    assert_eq!(grpc::watchers_held(&s.watchers, "k").await, 1);
    drop(c);
    until_held(&s, "k", 0).await;
    let mut d = watch(&s.channel, "k", 1).await.unwrap();
    assert!(d.message().await.unwrap().is_some());
}

/// Policy-security review #5: the gRPC quickstart keyed everything on
/// `x-api-key`, else the peer, with no bound per address, so a fresh key
/// per call bought a fresh budget without end. Now each limit has an
/// address's bound beside it: from one address, rotating keys gets
/// `PER_ADDRESS` times one client's budget, then refusals.
#[tokio::test]
async fn rotating_keys_from_one_address_buys_only_the_address_budget() {
    let s = start().await;
    let per = tollgate_examples::PER_ADDRESS as usize;
    // Health: 5 a client, 5 × PER_ADDRESS an address.
    for i in 0..5 * per {
        check(&s.channel, Some(&format!("h{i}"))).await.unwrap();
    }
    let refused = check(&s.channel, Some("h-fresh")).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted);
    // Watch: 2 streams a client, 2 × PER_ADDRESS an address.
    let mut open = Vec::new();
    for i in 0..2 * per {
        let mut w = watch(&s.channel, &format!("w{i}"), 2).await.unwrap();
        assert_eq!(w.message().await.unwrap().unwrap().stock, 100);
        open.push(w);
    }
    let refused = watch(&s.channel, "w-fresh", 2).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted);
    assert!(
        refused.message().contains("watchers-address"),
        "{refused:?}"
    );
    // Every call costs the policy's units, GetItem 1: 20 a client,
    // 20 × PER_ADDRESS an address, of which the watch calls took theirs
    // (the refused one too: rates count attempts).
    let mut served = 0;
    for i in 0..20 * per {
        match unary(&s.channel, grpc::GET_ITEM, &format!("g{i}")).await {
            Ok(_) => served += 1,
            Err(e) => {
                assert_eq!(e.code(), Code::ResourceExhausted);
                assert!(e.message().contains("per-address"), "{e:?}");
                break;
            }
        }
    }
    assert_eq!(served, 20 * per - (2 * per + 1));
}
