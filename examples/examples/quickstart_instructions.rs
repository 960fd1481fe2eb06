//! Drives the quickstart's app in process, for instruction counts of the
//! end-to-end figure's two routes without the network, the kernel or wrk:
//! `valgrind --tool=callgrind target/release/examples/quickstart_instructions /api/hello 3000`
//! (or `/healthz`). The app is built as the quickstart builds it (memory
//! store, a Prometheus recorder, loopback trusted as the proxy); every
//! request carries one of `KEYS` (default 20,000) rotating API keys and
//! client addresses, as `benches/e2e.sh` sends them, and each key is seen
//! once before the counted requests. Subtract a run of 1,000 from one of
//! 3,000 and divide by 2,000.
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::panic,
    clippy::arithmetic_side_effects
)]

use std::net::SocketAddr;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use tollgate::MemoryStore;
use tower::ServiceExt;

fn main() {
    let path = std::env::args().nth(1).unwrap();
    let n: usize = std::env::args().nth(2).unwrap().parse().unwrap();
    let keys: usize = std::env::var("KEYS").map_or(20_000, |k| k.parse().unwrap());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    rt.block_on(async {
        let _metrics = tollgate_examples::prometheus().unwrap();
        let trusted = vec!["127.0.0.1".to_owned()];
        let policy = tollgate_examples::quickstart_policy(None, &trusted).unwrap();
        let (app, _layer) =
            tollgate_examples::quickstart_app_with(MemoryStore::new(), &trusted, &policy).unwrap();
        // Routes made once, as `axum::serve` does for each connection.
        let app = app.with_state(());
        let peer: SocketAddr = "127.0.0.1:40000".parse().unwrap();
        let request = |i: usize| {
            let ip = format!("10.{}.{}.{}", i / 65_536, (i / 256) % 256, i % 256);
            let mut req = Request::get(path.as_str())
                .header("x-api-key", format!("k{i}"))
                .header("x-forwarded-for", ip)
                .body(Body::empty())
                .unwrap();
            req.extensions_mut().insert(ConnectInfo(peer));
            req
        };
        for i in 0..(keys + n) {
            let res = app.clone().oneshot(request(i % keys)).await.unwrap();
            assert_eq!(res.status(), StatusCode::OK);
            res.into_body().collect().await.unwrap();
        }
    });
}
