//! The server of `benches/e2e.sh`'s peer mode (`PEER=1`): one process,
//! three routes, so that wrk compares them on the same server —
//! `GET /healthz` unlimited, `GET /tollgate` behind tollgate's
//! `RateLimitLayer` and `GET /governor` behind tower_governor's layer,
//! each one GCRA limit per `x-api-key` that allows every request, with
//! its headers on (the `layer_overhead` stacks, served over TCP). All
//! three are the same router nested the same way, so the limited routes'
//! ratios charge the limits alone.
//! Listens on `TOLLGATE_ADDR` (default 127.0.0.1:3999).
#![allow(missing_docs, clippy::unwrap_used)]
use axum::Router;
use tollgate_benches::layer;

fn main() {
    let addr = std::env::var("TOLLGATE_ADDR").unwrap_or_else(|_| "127.0.0.1:3999".to_owned());
    let app = Router::new()
        .nest("/healthz", layer::router())
        .nest("/tollgate", layer::tollgate_allowing())
        .nest("/governor", layer::governor_allowing());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(&addr).await.unwrap();
        axum::serve(listener, app).await.unwrap();
    });
}
