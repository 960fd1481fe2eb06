//! The seeds' load tests, short (000 §11, §15): the quickstart under a
//! burst of ten times its rate, a plateau at its limit and above it, slow
//! POSTs and slow readers, over real HTTP on loopback. The store's clock
//! is a manual one, so every bound is a count: exactly the burst, then
//! exactly the rate, whatever this machine's speed. (The long version,
//! with latencies and memory, is the `load` bench example.)
#![allow(missing_docs, clippy::unwrap_used, clippy::arithmetic_side_effects)]

mod common;

use std::time::Duration;

use http::StatusCode;
use tollgate::core::ManualClock;
use tollgate::MemoryStore;
use tollgate_tests::load::{at_once, get_once, slow_posts, slow_reader, Client};

async fn quickstart() -> (std::net::SocketAddr, ManualClock) {
    let clock = ManualClock::starting_at(1_000_000_000);
    let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let app = tollgate_examples::quickstart_app(store, &[]).unwrap();
    (common::spawn(app).await, clock)
}

/// A client's budget is 10 a second in bursts of 20 (`per-key`): ten
/// times that at once admits the burst and nothing more; at the rate,
/// everything; at twice the rate, half.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_ten_times_the_rate_admits_the_burst_then_the_rate() {
    let (addr, clock) = quickstart().await;
    let burst = at_once(addr, "/api/hello", "bursty", 200, 16)
        .await
        .unwrap();
    assert_eq!(burst.sent, 200);
    assert_eq!(burst.admitted, 20, "{burst:?}");
    assert_eq!(burst.limited, 180, "{burst:?}");
    // A plateau at the limit: one request each 100 ms, all admitted.
    let mut plateau = (0, 0);
    for _ in 0..50 {
        clock.advance(Duration::from_millis(100));
        let step = at_once(addr, "/api/hello", "bursty", 1, 1).await.unwrap();
        plateau = (plateau.0 + step.admitted, plateau.1 + step.limited);
    }
    assert_eq!(plateau, (50, 0));
    // Twice the rate: one of each two.
    let mut above = (0, 0);
    for _ in 0..20 {
        clock.advance(Duration::from_millis(100));
        let step = at_once(addr, "/api/hello", "bursty", 2, 1).await.unwrap();
        above = (above.0 + step.admitted, above.1 + step.limited);
    }
    assert_eq!(above, (20, 20));
    // Another client was never touched by it.
    let other = at_once(addr, "/api/hello", "calm", 20, 4).await.unwrap();
    assert_eq!(other.admitted, 20);
}

/// Slow POSTs (a body sent a byte at a time) hold nothing: the orders
/// route answers without waiting for the body, so each is answered
/// before its body is whole, and other clients are served meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_posts_hold_no_permits() {
    let (addr, _clock) = quickstart().await;
    let posts = tokio::spawn(slow_posts(
        addr,
        "/api/orders",
        32,
        1_000,
        Duration::from_millis(20),
        Duration::from_secs(3),
    ));
    let served = at_once(addr, "/api/hello", "meanwhile", 20, 4)
        .await
        .unwrap();
    assert_eq!(served.admitted, 20);
    let (answered, closed) = posts.await.unwrap().unwrap();
    assert_eq!((answered, closed), (32, 0));
}

/// Slow readers hold their download permits while they read, and only
/// their own: a client's third download is refused while two are under
/// way, another client's is served, and once the readers go their
/// permits come back (none leaked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_readers_hold_only_their_own_permits() {
    let (addr, _clock) = quickstart().await;
    let hold = Duration::from_secs(30);
    let reader = Client {
        key: "reader".to_owned(),
        address: None,
    };
    let a = slow_reader(addr, "/api/download", &reader, 1_024, hold)
        .await
        .unwrap();
    let b = slow_reader(addr, "/api/download", &reader, 1_024, hold)
        .await
        .unwrap();
    assert_eq!((a.status, b.status), (StatusCode::OK, StatusCode::OK));
    let third = get_once(addr, "/api/download", "reader", true)
        .await
        .unwrap();
    assert_eq!(third, StatusCode::TOO_MANY_REQUESTS);
    let other = get_once(addr, "/api/download", "other", true)
        .await
        .unwrap();
    assert_eq!(other, StatusCode::OK);
    a.stop();
    b.stop();
    let mut back = false;
    for _ in 0..200 {
        if get_once(addr, "/api/download", "reader", true)
            .await
            .unwrap()
            == StatusCode::OK
        {
            back = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(back, "the readers' permits came back");
}
