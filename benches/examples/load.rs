//! The quickstart under load on loopback (the seeds' load tests, 000 §11
//! and §15): a burst of ten times the rate, a long plateau at the limit,
//! then the same plateau beside slow POSTs and beside slow readers. For
//! each phase: what the clients at the limit had admitted against the
//! limit's own bound (over-admission), p50/p99 latency of the admitted
//! requests, and the server's memory (this process's RSS, server and
//! clients together) before and after.
//!
//! ```text
//! cargo run --release -p tollgate-benches --example load
//! PLATEAU=60 BURST=10 CLIENTS=10 cargo run --release -p tollgate-benches --example load
//! ```
//!
//! Every client has its own API key and, through a trusted proxy on
//! loopback (`X-Forwarded-For`), its own address. The quickstart's
//! `per-key` rule is 10 a second in bursts of 20: a client at ten times
//! that may have at most 20 + 10 × t admitted in t seconds.

#![allow(
    clippy::arithmetic_side_effects,
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_precision_loss
)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tollgate::MemoryStore;
use tollgate_tests::load::{paced, rss, slow_posts, slow_reader, Client, Phase};

/// The quickstart's `per-key` rate and burst.
const RATE: u32 = 10;
const BURST: u64 = 20;

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

async fn serve() -> SocketAddr {
    let app = tollgate_examples::quickstart_app(MemoryStore::new(), &["127.0.0.1/32".to_owned()])
        .expect("the quickstart");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a port");
    let addr = listener.local_addr().expect("its address");
    tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
    });
    addr
}

/// `clients` clients (numbered from `first`) at `rate` a second each
/// for `secs` seconds, side by side: their phases merged, and the most
/// any one of them had admitted beyond its bound (20 + 10 × t).
async fn clients_at(
    addr: SocketAddr,
    first: u32,
    clients: u32,
    rate: u32,
    secs: u64,
) -> (Phase, i64) {
    let tasks: Vec<_> = (first..first + clients)
        .map(|i| {
            tokio::spawn(async move {
                paced(
                    addr,
                    "/api/hello",
                    &Client::numbered(i),
                    rate,
                    Duration::from_secs(secs),
                    2,
                )
                .await
                .expect("a phase")
            })
        })
        .collect();
    let mut all = Phase::default();
    let mut worst = i64::MIN;
    for t in tasks {
        let p = t.await.expect("a client");
        let bound = BURST as f64 + f64::from(RATE) * p.took.as_secs_f64();
        worst = worst.max(p.admitted as i64 - bound.floor() as i64);
        all.merge(p);
    }
    all.latencies.sort();
    (all, worst)
}

fn row(name: &str, p: &Phase, worst: i64, before: u64, after: u64) {
    println!(
        "| {name} | {} | {} | {} | {} | {:+} | {:.2?} / {:.2?} | {:.1} → {:.1} MB |",
        p.sent,
        p.admitted,
        p.limited,
        p.unavailable + p.other,
        worst,
        p.percentile(0.5),
        p.percentile(0.99),
        before as f64 / 1e6,
        after as f64 / 1e6,
    );
}

#[tokio::main]
async fn main() {
    let plateau = env("PLATEAU", 60);
    let burst_secs = env("BURST", 10);
    let clients = u32::try_from(env("CLIENTS", 10)).unwrap_or(10);
    let addr = serve().await;
    println!(
        "| phase | sent | admitted | 429 | other | most over the bound (per client) | p50 / p99 admitted | RSS |"
    );
    println!("|---|---:|---:|---:|---:|---:|---|---|");

    // Ten times the rate.
    let before = rss();
    let (p, worst) = clients_at(addr, 0, clients, RATE * 10, burst_secs).await;
    row(
        &format!("10x the rate, {burst_secs} s"),
        &p,
        worst,
        before,
        rss(),
    );

    // At the limit, new clients (whole budgets).
    let before = rss();
    let (p, worst) = clients_at(addr, 1_000, clients, RATE, plateau).await;
    row(
        &format!("at the limit, {plateau} s"),
        &p,
        worst,
        before,
        rss(),
    );

    // At the limit beside 200 slow POSTs (a byte every 100 ms, each
    // from a client and address of its own).
    let before = rss();
    let slow: Vec<Client> = (0..200).map(|i| Client::numbered(5_000 + i)).collect();
    let posts = slow_posts(
        addr,
        "/api/orders",
        &slow,
        10_000,
        Duration::from_millis(100),
        Duration::from_secs(plateau.min(30)),
    )
    .await
    .expect("slow posts");
    let (p, worst) = clients_at(addr, 2_000, clients, RATE, plateau.min(30)).await;
    let statuses = posts.finish().await;
    let ok = statuses.iter().filter(|s| (200..300).contains(*s)).count();
    row(
        &format!(
            "at the limit beside 200 slow POSTs ({ok} answered 2xx before their body was whole, {} otherwise)",
            statuses.len() - ok
        ),
        &p,
        worst,
        before,
        rss(),
    );

    // At the limit beside 50 clients reading two downloads each at 16 KiB/s.
    let before = rss();
    let started = Instant::now();
    let hold = Duration::from_secs(plateau.min(30));
    let mut readers = Vec::new();
    for i in 0..50u32 {
        for _ in 0..2 {
            readers.push(
                slow_reader(
                    addr,
                    "/api/download",
                    &Client::numbered(3_000 + i),
                    16 << 10,
                    hold,
                )
                .await
                .expect("a reader"),
            );
        }
    }
    let refused = readers.iter().filter(|r| !r.status.is_success()).count();
    let (p, worst) = clients_at(addr, 4_000, clients, RATE, plateau.min(30)).await;
    let mut read = 0usize;
    for r in readers {
        read += r.finish().await;
    }
    row(
        &format!(
            "at the limit beside 100 slow downloads ({refused} refused, {:.1} MB read in {:.0?})",
            read as f64 / 1e6,
            started.elapsed()
        ),
        &p,
        worst,
        before,
        rss(),
    );
}
