//! The gRPC quickstart: `cargo run -p tollgate-examples --bin grpc-quickstart`.
//!
//! A tonic server on `TOLLGATE_GRPC_ADDR` (default `127.0.0.1:50051`), on
//! the in-memory store or, when `TOLLGATE_REDIS_URL` is set, on Redis (one
//! [`AnyStore`](tollgate::AnyStore) type either way, so one server), with tollgate's layers on its router: the standard health
//! service limited to 5 checks a second per `x-api-key` (else per peer
//! address), and a demo inventory service with per-method costs and at
//! most 2 `Watch` streams at once per client (see
//! [`tollgate_examples::grpc`]). Try it with grpcurl:
//!
//! ```text
//! grpcurl -plaintext -H 'x-api-key: demo' 127.0.0.1:50051 grpc.health.v1.Health/Check
//! ```

use tollgate::{AnyStore, FailurePolicy, MemoryStore, RedisStore};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    tollgate_examples::init_logs();
    let addr = tollgate_examples::grpc::grpc_addr()?;
    let store: AnyStore = match std::env::var("TOLLGATE_REDIS_URL") {
        Ok(url) if !url.trim().is_empty() => RedisStore::builder(&url)
            .prefix("grpc-quickstart")
            .failure_policy(FailurePolicy::fallback())
            .build()?
            .into(),
        _ => MemoryStore::new().into(),
    };
    let kind = store.kind();
    let app = tollgate_examples::grpc::grpc_app(store)?;
    // The stock moves every few seconds, so `Watch` streams have news.
    let stock = app.stock.clone();
    tokio::spawn(async move {
        let mut units = 100u32;
        loop {
            tokio::time::sleep(std::time::Duration::from_secs(3)).await;
            units = units.checked_sub(1).unwrap_or(100);
            stock.set(units);
        }
    });
    let listener = tokio::net::TcpListener::bind(addr).await?;
    println!(
        "tollgate grpc-quickstart listening on {} ({kind} store)",
        listener.local_addr()?
    );
    tollgate_examples::grpc::serve_grpc(listener, app, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await?;
    Ok(())
}
