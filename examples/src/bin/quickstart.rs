//! The quickstart server: `cargo run -p tollgate-examples --bin quickstart`.
//!
//! Listens on `TOLLGATE_ADDR` (default `127.0.0.1:3000`) with the in-memory
//! store, or with Redis when `TOLLGATE_REDIS_URL` is set (a `redis://` URL,
//! or a comma-separated list of cluster nodes): several instances then
//! share one budget per client. `TOLLGATE_TRUSTED_PROXIES` (comma-separated
//! CIDRs) names the proxies whose `X-Forwarded-For` is believed. Try it:
//!
//! ```text
//! curl -i -H 'x-api-key: demo' http://127.0.0.1:3000/api/hello
//! curl -i -X POST -H 'x-api-key: demo' http://127.0.0.1:3000/api/reports
//! curl -s http://127.0.0.1:3000/metrics | grep tollgate_requests_total
//! ```

use tollgate::{FailurePolicy, MemoryStore, RedisStore};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::var("TOLLGATE_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let trusted: Vec<String> = std::env::var("TOLLGATE_TRUSTED_PROXIES")
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect();
    // The recorder first: the layers register their metrics when built.
    let metrics = tollgate_examples::prometheus()?;
    let (app, store) = match std::env::var("TOLLGATE_REDIS_URL") {
        Ok(url) if !url.trim().is_empty() => {
            // If Redis goes away, each instance keeps limiting on its own.
            let store = RedisStore::builder(&url)
                .prefix("quickstart")
                .failure_policy(FailurePolicy::fallback())
                .build()?;
            (
                tollgate_examples::quickstart_app(store, &trusted)?,
                format!("redis store at {url}"),
            )
        }
        _ => (
            tollgate_examples::quickstart_app(MemoryStore::new(), &trusted)?,
            "in-memory store".to_owned(),
        ),
    };
    let app = app.merge(tollgate_examples::metrics_route(metrics));
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!(
        "tollgate quickstart listening on http://{} ({store})",
        listener.local_addr()?
    );
    tollgate_examples::serve(listener, app).await?;
    Ok(())
}
