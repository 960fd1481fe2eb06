//! The README's quickstart server, through real HTTP on loopback, on a
//! manual clock.
#![allow(missing_docs, clippy::unwrap_used, clippy::arithmetic_side_effects)]

mod common;

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use tollgate::core::ManualClock;
use tollgate::MemoryStore;
use tollgate_tests::{send, Reply};

async fn quickstart(trusted: &[&str]) -> (std::net::SocketAddr, ManualClock) {
    let clock = ManualClock::starting_at(1_000_000_000);
    let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let trusted: Vec<String> = trusted.iter().map(|s| s.to_string()).collect();
    let app = tollgate_examples::quickstart_app(store, &trusted).unwrap();
    (common::spawn(app).await, clock)
}

fn get(path: &str, key: Option<&str>) -> Request<Bytes> {
    let mut b = Request::get(path);
    if let Some(k) = key {
        b = b.header("x-api-key", k);
    }
    b.body(Bytes::new()).unwrap()
}

fn post(path: &str, key: &str) -> Request<Bytes> {
    Request::post(path)
        .header("x-api-key", key)
        .body(Bytes::new())
        .unwrap()
}

async fn hello(addr: std::net::SocketAddr, key: &str) -> Reply {
    send(addr, get("/api/hello", Some(key))).await.unwrap()
}

#[tokio::test]
async fn burst_of_twenty_then_429_with_standard_headers() {
    let (addr, clock) = quickstart(&[]).await;
    for i in 0..20 {
        let r = hello(addr, "alice").await;
        assert_eq!(r.status, 200, "request {i}: {r:?}");
        assert_eq!(
            r.item("ratelimit-policy", "per-key"),
            "\"per-key\";q=20;w=2"
        );
        assert!(r
            .item("ratelimit", "per-key")
            .starts_with(&format!("\"per-key\";r={};", 19 - i)));
        // The in-flight limits are listed beside it.
        assert_eq!(
            r.item("ratelimit-policy", "per-client"),
            "\"per-client\";q=64;qu=\"concurrent-requests\""
        );
        assert_eq!(r.item("ratelimit", "per-client"), "\"per-client\";r=63");
        assert!(r.item("ratelimit", "service").starts_with("\"service\";r="));
        // And the day's quota, whose t is the seconds to midnight UTC.
        assert_eq!(
            r.item("ratelimit-policy", "daily"),
            "\"daily\";q=1000;w=86400"
        );
        assert!(r
            .item("ratelimit", "daily")
            .starts_with(&format!("\"daily\";r={};t=", 999 - i)));
    }
    let r = hello(addr, "alice").await;
    assert_eq!(r.status, 429);
    assert_eq!(r.header("retry-after"), "1");
    assert_eq!(r.item("ratelimit", "per-key"), "\"per-key\";r=0;t=1");
    assert_eq!(r.header("content-type"), "application/problem+json");
    assert!(r.body.contains("\"rule\":\"per-key\""), "{}", r.body);

    // One interval later exactly one more request fits.
    clock.advance(Duration::from_millis(100));
    assert_eq!(hello(addr, "alice").await.status, 200);
    assert_eq!(hello(addr, "alice").await.status, 429);
}

#[tokio::test]
async fn keys_are_independent_and_health_is_not_limited() {
    let (addr, _clock) = quickstart(&[]).await;
    for _ in 0..21 {
        hello(addr, "bob").await;
    }
    assert_eq!(hello(addr, "bob").await.status, 429);
    assert_eq!(hello(addr, "carol").await.status, 200);
    for _ in 0..50 {
        let r = send(addr, get("/healthz", Some("bob"))).await.unwrap();
        assert_eq!(r.status, 200);
        assert!(r.headers.get("ratelimit").is_none());
    }
    // Unknown routes are 404s and cost nothing.
    let r = send(addr, get("/nope", Some("carol"))).await.unwrap();
    assert_eq!(r.status, 404);
    assert!(hello(addr, "carol")
        .await
        .item("ratelimit", "per-key")
        .contains("r=18"));
}

#[tokio::test]
async fn rotating_api_keys_from_one_address_share_its_budget() {
    let (addr, _clock) = quickstart(&[]).await;
    // Every key is fresh; the address's burst of 400 is what runs out.
    for i in 0..400 {
        let r = hello(addr, &format!("key-{i}")).await;
        assert_eq!(r.status, 200, "request {i}: {r:?}");
        assert!(r
            .item("ratelimit", "per-ip")
            .contains(&format!("r={};", 399 - i)));
    }
    let r = hello(addr, "key-fresh").await;
    assert_eq!(r.status, 429, "{r:?}");
    assert!(r.body.contains("\"rule\":\"per-ip\""), "{}", r.body);
    // The refused request cost its key nothing.
    assert_eq!(r.item("ratelimit", "per-key"), "\"per-key\";r=20;t=0");
    // Both rules are listed; the quota inside was never reached.
    assert_eq!(
        r.item("ratelimit-policy", "per-key"),
        "\"per-key\";q=20;w=2"
    );
    assert_eq!(r.item("ratelimit-policy", "per-ip"), "\"per-ip\";q=400;w=4");
    assert!(!r.header("ratelimit-policy").contains("daily"), "{r:?}");
}

/// Every limit keyed by API key is bounded per address too: rotating
/// `x-api-key` from one address buys its day's quota, its downloads and
/// its requests in flight only up to the address's.
#[tokio::test]
async fn rotating_api_keys_buys_nothing_past_the_address() {
    let (addr, clock) = quickstart(&[]).await;
    // Downloads: 8 at once per address, whatever the keys.
    let mut open = Vec::new();
    for i in 0..8 {
        open.push(start_download(addr, &format!("dl-{i}")).await);
        clock.advance(Duration::from_secs(1));
    }
    let r = send(addr, get("/api/download", Some("dl-fresh")))
        .await
        .unwrap();
    assert_eq!(r.status, 429, "{r:?}");
    assert!(
        r.body.contains("\"rule\":\"downloads-address\""),
        "{}",
        r.body
    );
    // In flight: the eight downloads hold eight of the address's 256.
    let r = send(addr, get("/api/hello", Some("in-flight")))
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(
        r.item("ratelimit-policy", "per-address"),
        "\"per-address\";q=256;qu=\"concurrent-requests\""
    );
    assert_eq!(r.item("ratelimit", "per-address"), "\"per-address\";r=247");
    drop(open);
    // The day: 10,000 units per address. What is left of it goes in
    // reports of 10, each from a fresh key (whose own day is barely
    // touched); the address's rate (400 units, 100 a second) is waited
    // out on the manual clock.
    let left: u64 = r
        .item("ratelimit", "daily-address")
        .split(['=', ';'])
        .nth(2)
        .and_then(|n| n.parse().ok())
        .unwrap();
    assert!(left > 9_900, "{r:?}");
    for i in 0..left / 10 {
        if i % 40 == 0 {
            clock.advance(Duration::from_secs(4));
        }
        let r = send(addr, post("/api/reports", &format!("day-{i}")))
            .await
            .unwrap();
        assert_eq!(r.status, 200, "report {i}: {r:?}");
    }
    clock.advance(Duration::from_secs(4));
    let r = send(addr, post("/api/reports", "day-fresh")).await.unwrap();
    assert_eq!(r.status, 429, "{r:?}");
    assert!(r.body.contains("\"rule\":\"daily-address\""), "{}", r.body);
}

#[tokio::test]
async fn the_pro_plan_gets_ten_times_the_rate() {
    let (addr, _clock) = quickstart(&[]).await;
    let pro = || {
        Request::get("/api/hello")
            .header("x-api-key", "paying")
            .header("x-plan", "pro")
            .body(Bytes::new())
            .unwrap()
    };
    let r = send(addr, pro()).await.unwrap();
    assert_eq!(
        r.item("ratelimit-policy", "per-key"),
        "\"per-key\";q=200;w=2"
    );
    // Ten times the daily quota too, kept apart from the free plan's.
    assert_eq!(
        r.item("ratelimit-policy", "daily"),
        "\"daily\";q=10000;w=86400"
    );
    for i in 1..200 {
        let r = send(addr, pro()).await.unwrap();
        assert_eq!(r.status, 200, "request {i}");
    }
    assert_eq!(send(addr, pro()).await.unwrap().status, 429);
    // The same key on the free plan has its own, smaller budget.
    let free = hello(addr, "paying").await;
    assert_eq!(free.item("ratelimit", "per-key"), "\"per-key\";r=19;t=1");
    assert_eq!(
        free.item("ratelimit-policy", "daily"),
        "\"daily\";q=1000;w=86400"
    );
    assert!(free
        .item("ratelimit", "daily")
        .starts_with("\"daily\";r=999;"));
}

#[tokio::test]
async fn orders_cost_three_and_reports_ten_from_one_budget() {
    let (addr, _clock) = quickstart(&[]).await;
    let r = send(addr, post("/api/reports", "dana")).await.unwrap();
    assert_eq!(r.status, 200);
    assert!(r.item("ratelimit", "per-key").contains("r=10;"), "{r:?}");
    let r = send(addr, post("/api/orders", "dana")).await.unwrap();
    assert!(r.item("ratelimit", "per-key").contains("r=7;"), "{r:?}");
    let r = send(addr, post("/api/reports", "dana")).await.unwrap();
    assert_eq!(r.status, 429, "a report does not fit in 7");
    assert_eq!(r.header("retry-after"), "1");
    // Cheaper calls still fit.
    assert_eq!(
        send(addr, post("/api/orders", "dana"))
            .await
            .unwrap()
            .status,
        200
    );
    assert_eq!(hello(addr, "dana").await.status, 200);
}

#[tokio::test]
async fn spoofed_forwarded_for_from_an_untrusted_peer_changes_nothing() {
    let (addr, _clock) = quickstart(&[]).await;
    for i in 0..20 {
        let req = Request::get("/api/hello")
            .header("x-forwarded-for", format!("10.0.0.{i}"))
            .body(Bytes::new())
            .unwrap();
        assert_eq!(send(addr, req).await.unwrap().status, 200);
    }
    // Every request counted against the peer (127.0.0.1) whatever it claimed.
    let req = Request::get("/api/hello")
        .header("x-forwarded-for", "203.0.113.99")
        .body(Bytes::new())
        .unwrap();
    assert_eq!(send(addr, req).await.unwrap().status, 429);
}

#[tokio::test]
async fn forwarded_for_from_a_trusted_proxy_is_the_client() {
    let (addr, _clock) = quickstart(&["127.0.0.1/32"]).await;
    let from = |client: &str| {
        Request::get("/api/hello")
            .header("x-forwarded-for", format!("6.6.6.6, {client}"))
            .body(Bytes::new())
            .unwrap()
    };
    for _ in 0..20 {
        assert_eq!(send(addr, from("198.51.100.1")).await.unwrap().status, 200);
    }
    assert_eq!(send(addr, from("198.51.100.1")).await.unwrap().status, 429);
    // Another client behind the same proxy has its own budget; the spoofed
    // leftmost entry (6.6.6.6) is not the key.
    assert_eq!(send(addr, from("198.51.100.2")).await.unwrap().status, 200);
}

/// Opens a download and reads its headers and first chunk; the rest stays
/// unread, on the returned connection.
async fn start_download(
    addr: std::net::SocketAddr,
    key: &str,
) -> (
    http::Response<hyper::body::Incoming>,
    hyper::client::conn::http1::SendRequest<http_body_util::Empty<Bytes>>,
) {
    start_download_on(addr, key, "free").await
}

/// [`start_download`] on plan `plan`.
async fn start_download_on(
    addr: std::net::SocketAddr,
    key: &str,
    plan: &str,
) -> (
    http::Response<hyper::body::Incoming>,
    hyper::client::conn::http1::SendRequest<http_body_util::Empty<Bytes>>,
) {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    let req = Request::get("/api/download")
        .header("x-api-key", key)
        .header("x-plan", plan)
        .header("host", "localhost")
        .body(http_body_util::Empty::new())
        .unwrap();
    let mut res = sender.send_request(req).await.unwrap();
    assert_eq!(res.status(), 200);
    use http_body_util::BodyExt;
    let first = res.body_mut().frame().await.unwrap().unwrap();
    assert!(!first.into_data().unwrap().is_empty());
    (res, sender)
}

#[tokio::test]
async fn the_pro_plan_downloads_four_at_once() {
    let (addr, clock) = quickstart(&[]).await;
    let mut open = Vec::new();
    for _ in 0..4 {
        open.push(start_download_on(addr, "gina", "pro").await);
        // Paced on the manual clock: a second refills the burst.
        clock.advance(Duration::from_secs(1));
    }
    let items = open.last().unwrap().0.headers()["ratelimit"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(items.contains("\"downloads\";r=0"), "{items}");
    let fifth = Request::get("/api/download")
        .header("x-api-key", "gina")
        .header("x-plan", "pro")
        .body(Bytes::new())
        .unwrap();
    let r = send(addr, fifth).await.unwrap();
    assert_eq!(r.status, 429, "{r:?}");
    assert_eq!(
        r.item("ratelimit-policy", "downloads"),
        "\"downloads\";q=4;qu=\"concurrent-requests\""
    );
    drop(open);
}

#[tokio::test]
async fn a_third_download_is_refused_while_two_are_in_flight() {
    let (addr, clock) = quickstart(&[]).await;
    let one = start_download(addr, "erin").await;
    // Downloads are paced on the store's (manual) clock: the first one
    // spent erin's 64 KiB burst; a second refills it.
    clock.advance(Duration::from_secs(1));
    let two = start_download(addr, "erin").await;
    let items = one.0.headers()["ratelimit"].to_str().unwrap().to_owned();
    assert!(items.contains("\"downloads\";r=1"), "{items}");
    let r = send(addr, get("/api/download", Some("erin")))
        .await
        .unwrap();
    assert_eq!(r.status, 429, "{r:?}");
    assert_eq!(
        r.item("ratelimit-policy", "downloads"),
        "\"downloads\";q=2;qu=\"concurrent-requests\""
    );
    assert_eq!(r.item("ratelimit", "downloads"), "\"downloads\";r=0;t=1");
    assert_eq!(r.header("retry-after"), "1");
    assert!(r.body.contains("\"rule\":\"downloads\""), "{}", r.body);
    // Another client downloads meanwhile.
    let other = start_download(addr, "frank").await;
    // The first client hangs up on one download: its permit comes back.
    drop(one);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let r = send(addr, get("/api/download", Some("erin")));
        let r = tokio::time::timeout(Duration::from_millis(200), r).await;
        match r {
            // Admitted: the download streams (4 s); the status is enough.
            Err(_) => break,
            Ok(r) => assert_eq!(r.unwrap().status, 429),
        }
        assert!(tokio::time::Instant::now() < deadline, "never released");
    }
    drop((two, other));
}

fn login(user: &str, password: &str) -> Request<Bytes> {
    Request::post("/login")
        .header("content-type", "application/json")
        .body(Bytes::from(format!(
            r#"{{"user":"{user}","password":"{password}"}}"#
        )))
        .unwrap()
}

#[tokio::test]
async fn five_failed_logins_lock_the_account_for_the_rest_of_the_window() {
    let (addr, clock) = quickstart(&[]).await;
    let r = send(addr, login("ann", "demo")).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.body, "Welcome, ann.\n");
    for i in 0..5 {
        clock.advance(Duration::from_secs(60));
        let r = send(addr, login("ann", "guess")).await.unwrap();
        assert_eq!(r.status, 401, "failure {i}: {r:?}");
        // The ladder's first step: a warning from the third failure on.
        let warning = r.headers.get("ratelimit-warning");
        if i < 2 {
            assert!(warning.is_none(), "failure {i}: {r:?}");
        } else {
            let want = format!("\"failed-logins-user\";used={}", (i + 1) * 20);
            assert_eq!(warning.unwrap(), want.as_str(), "failure {i}");
        }
    }
    // Locked: the right password too, until the first failure (at 1 min)
    // leaves the 15-minute window (at 16 min; now 5 min).
    let r = send(addr, login("ann", "demo")).await.unwrap();
    assert_eq!(r.status, 429, "{r:?}");
    assert_eq!(r.header("retry-after"), "660");
    assert!(r.body.contains("failed-logins-user"), "{}", r.body);
    // Another account from the same address is not locked.
    assert_eq!(send(addr, login("bob", "demo")).await.unwrap().status, 200);
    // Once the first failure leaves the window, one more try is allowed.
    clock.advance(Duration::from_secs(660));
    assert_eq!(send(addr, login("ann", "demo")).await.unwrap().status, 200);
}

/// A locked account's 429 carries a proof-of-work challenge: its owner
/// solves it and logs in once; a replay of the solution is refused.
#[tokio::test]
async fn a_locked_out_owner_gets_in_by_solving_the_challenge() {
    let (addr, _clock) = quickstart(&[]).await;
    for _ in 0..5 {
        assert_eq!(send(addr, login("cat", "guess")).await.unwrap().status, 401);
    }
    let r = send(addr, login("cat", "demo")).await.unwrap();
    assert_eq!(r.status, 429, "{r:?}");
    let challenge = r.header("tollgate-challenge").to_owned();
    assert!(challenge.starts_with("pow1."), "{r:?}");
    let solution = tollgate::policy::ProofOfWork::solve(&challenge, 20).unwrap();
    let solved = || {
        let mut req = login("cat", "demo");
        req.headers_mut()
            .insert("tollgate-solution", solution.parse().unwrap());
        req
    };
    let r = send(addr, solved()).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.body, "Welcome, cat.\n");
    assert_eq!(send(addr, solved()).await.unwrap().status, 429);
}

#[tokio::test]
async fn twenty_failed_logins_from_one_address_lock_every_account_there() {
    let (addr, _clock) = quickstart(&[]).await;
    for i in 0..20 {
        let r = send(addr, login(&format!("user-{i}"), "guess"))
            .await
            .unwrap();
        assert_eq!(r.status, 401, "failure {i}: {r:?}");
    }
    let r = send(addr, login("fresh", "demo")).await.unwrap();
    assert_eq!(r.status, 429, "{r:?}");
    assert!(r.body.contains("failed-logins-ip"), "{}", r.body);
}

#[tokio::test]
async fn who_keeps_trying_while_locked_is_blocked_for_longer_each_time() {
    let (addr, clock) = quickstart(&[]).await;
    for _ in 0..5 {
        assert_eq!(send(addr, login("cat", "guess")).await.unwrap().status, 401);
    }
    // Locked until the first failure leaves the window (15 min); three
    // refused tries within it block the account for 15 minutes.
    for _ in 0..2 {
        let r = send(addr, login("cat", "demo")).await.unwrap();
        assert_eq!(r.header("retry-after"), "900", "{r:?}");
    }
    // (The block ends when the lock does: the answer stays the lock's.)
    let r = send(addr, login("cat", "demo")).await.unwrap();
    assert_eq!(r.status, 429);
    assert_eq!(r.header("retry-after"), "900");
    clock.advance(Duration::from_secs(899));
    let r = send(addr, login("cat", "demo")).await.unwrap();
    assert_eq!(r.status, 429, "{r:?}");
    assert_eq!(r.header("retry-after"), "1", "{r:?}");
    clock.advance(Duration::from_secs(1));
    assert_eq!(send(addr, login("cat", "demo")).await.unwrap().status, 200);
    // Locked and blocked again: the block is twice as long.
    for _ in 0..5 {
        send(addr, login("cat", "guess")).await.unwrap();
    }
    for _ in 0..2 {
        send(addr, login("cat", "demo")).await.unwrap();
    }
    let r = send(addr, login("cat", "demo")).await.unwrap();
    assert_eq!(r.header("retry-after"), "1800", "{r:?}");
    assert!(r.body.contains("Blocked by"), "{}", r.body);
    // The failures leave the window after 15 minutes; the block holds.
    clock.advance(Duration::from_secs(901));
    let r = send(addr, login("cat", "demo")).await.unwrap();
    assert_eq!(r.status, 429, "{r:?}");
    assert_eq!(r.header("retry-after"), "899");
    clock.advance(Duration::from_secs(899));
    assert_eq!(send(addr, login("cat", "demo")).await.unwrap().status, 200);
}

/// Policy-security review #15: the account key was the raw `user`, so
/// `Ann`, `aNN` and `ann ` were three budgets for one account; and a login
/// without `Content-Type: application/json` was charged, then given back
/// when the handler refused it (415), a free request that re-dated the
/// account's failures.
#[tokio::test]
async fn an_account_is_one_budget_however_its_name_is_written() {
    let (addr, _clock) = quickstart(&[]).await;
    for user in ["Ann", "aNN", "ann ", " ANN", "ann"] {
        assert_eq!(send(addr, login(user, "guess")).await.unwrap().status, 401);
    }
    let r = send(addr, login("ANN", "demo")).await.unwrap();
    assert_eq!(
        r.status, 429,
        "five failures of one account, however written"
    );
    // No JSON content type: refused before any limit, charged nothing.
    let mut plain = login("bob", "guess");
    plain.headers_mut().remove("content-type");
    for _ in 0..10 {
        assert_eq!(send(addr, plain.clone()).await.unwrap().status, 415);
    }
    assert_eq!(send(addr, login("bob", "demo")).await.unwrap().status, 200);
    let r = send(addr, login("bob", "guess")).await.unwrap();
    assert_eq!(
        r.header("ratelimit-warning"),
        "",
        "bob has one failure, no warning yet"
    );
}
