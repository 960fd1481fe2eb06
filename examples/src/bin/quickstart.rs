//! The quickstart server: `cargo run -p tollgate-examples --bin quickstart`.
//!
//! Listens on `TOLLGATE_ADDR` (default `127.0.0.1:3000`) with the in-memory
//! store. `TOLLGATE_TRUSTED_PROXIES` (comma-separated CIDRs) names the
//! proxies whose `X-Forwarded-For` is believed. Try it:
//!
//! ```text
//! curl -i -H 'x-api-key: demo' http://127.0.0.1:3000/api/hello
//! curl -i -X POST -H 'x-api-key: demo' http://127.0.0.1:3000/api/reports
//! ```

use tollgate::MemoryStore;

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
    let app = tollgate_examples::quickstart_app(MemoryStore::new(), &trusted)?;
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!(
        "tollgate quickstart listening on http://{} (in-memory store)",
        listener.local_addr()?
    );
    tollgate_examples::serve(listener, app).await?;
    Ok(())
}
