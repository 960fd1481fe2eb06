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

type Gate = tollgate::config::Tollgate<MemoryStore<ManualClock>>;

/// The quickstart on a manual clock, and its limits.
async fn quickstart() -> (std::net::SocketAddr, ManualClock, Gate) {
    let clock = ManualClock::starting_at(1_000_000_000);
    let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let policy = tollgate_examples::quickstart_policy(None, &[]).unwrap();
    let (app, gate) = tollgate_examples::quickstart_app_with(store, &[], &policy).unwrap();
    (common::spawn(app).await, clock, gate)
}

/// The permits `key` (from loopback) holds now under the in-flight
/// limit `name`.
async fn held(gate: &Gate, name: &str, key: &str) -> u64 {
    let mut req = http::Request::get("/api/download")
        .header("x-api-key", key)
        .body(())
        .unwrap();
    req.extensions_mut()
        .insert("127.0.0.1:1".parse::<std::net::SocketAddr>().unwrap());
    gate.concurrency(name)
        .unwrap()
        .held_for(&req)
        .await
        .unwrap()
}

/// A client's budget is 10 a second in bursts of 20 (`per-key`): ten
/// times that at once admits the burst and nothing more; at the rate,
/// everything; at twice the rate, half.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_ten_times_the_rate_admits_the_burst_then_the_rate() {
    let (addr, clock, _) = quickstart().await;
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

/// Slow POSTs (a body sent a byte at a time, going on after the answer)
/// hold nothing: the orders route answers without waiting for the body,
/// every one with a 200, and while their bodies still trickle no client
/// holds a permit of the in-flight limits; others are served meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_posts_hold_no_permits() {
    let (addr, _clock, gate) = quickstart().await;
    let clients: Vec<Client> = (0..16)
        .map(|i| Client {
            key: format!("slow-post-{i}"),
            address: None,
        })
        .collect();
    let posts = slow_posts(
        addr,
        "/api/orders",
        &clients,
        1_000,
        Duration::from_millis(20),
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    let mut answered = Vec::new();
    for _ in 0..250 {
        answered = posts.answered();
        if answered.len() == clients.len() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(answered, vec![200; clients.len()]);
    // Bodies still trickling: no permit held, per client or per address.
    for c in &clients {
        assert_eq!(held(&gate, "per-client", &c.key).await, 0);
    }
    assert_eq!(held(&gate, "per-address", "any").await, 0);
    let served = at_once(addr, "/api/hello", "meanwhile", 20, 4)
        .await
        .unwrap();
    assert_eq!(served.admitted, 20);
    posts.finish().await;
}

/// Slow readers hold their download permits while they read, and only
/// their own: a client's third download is refused while two are under
/// way, another client's is served, and once the readers go their
/// permits come back (none leaked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_readers_hold_only_their_own_permits() {
    let (addr, _clock, gate) = quickstart().await;
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
    // What the slow POSTs' test reads: two permits held here.
    assert_eq!(held(&gate, "downloads", "reader").await, 2);
    assert_eq!(held(&gate, "per-address", "reader").await, 2);
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
    // Both permits come back (a leaked one would leave room for one
    // reader only): two readers again, and a third refused.
    let mut again = Vec::new();
    for _ in 0..200 {
        let r = slow_reader(addr, "/api/download", &reader, 1_024, hold)
            .await
            .unwrap();
        if r.status == StatusCode::OK {
            again.push(r);
            if again.len() == 2 {
                break;
            }
        } else {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert_eq!(again.len(), 2, "the readers' permits came back");
    let third = get_once(addr, "/api/download", "reader", true)
        .await
        .unwrap();
    assert_eq!(third, StatusCode::TOO_MANY_REQUESTS);
    for r in &again {
        r.stop();
    }
}
