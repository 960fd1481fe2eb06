//! The quickstart server: `cargo run -p tollgate-examples --bin quickstart`.
//!
//! Listens on `TOLLGATE_ADDR` (default `127.0.0.1:3000`) with the in-memory
//! store, or with Redis when `TOLLGATE_REDIS_URL` is set (a `redis://` URL,
//! or a comma-separated list of cluster nodes): several instances then
//! share one budget per client. `TOLLGATE_TRUSTED_PROXIES` (comma-separated
//! CIDRs) names the proxies whose `X-Forwarded-For` is believed.
//! `TOLLGATE_KEY_SECRET` (16 to 64 bytes, the same on every instance)
//! keys the Redis key names, so no client key can be read back from Redis.
//! `TOLLGATE_CONFIG` names a policy file to use instead of the built-in
//! `examples/quickstart.toml`; the server reloads it on SIGHUP and when it
//! changes, and refuses to start if it does not load.
//! `TOLLGATE_METRICS_ADDR` serves `/metrics` on a listener of its own (an
//! internal address) and not on the public one; unset, the demo serves it
//! on its public port for convenience. Try it:
//!
//! ```text
//! curl -i -H 'x-api-key: demo' http://127.0.0.1:3000/api/hello
//! curl -i -X POST -H 'x-api-key: demo' http://127.0.0.1:3000/api/reports
//! curl -s http://127.0.0.1:3000/metrics | grep tollgate_requests_total
//! ```

use std::path::PathBuf;
use std::time::Duration;

use tollgate::{AnyStore, FailurePolicy, MemoryStore, RedisStore};

/// Builds the app on `store` (memory or Redis, chosen at run time), and
/// starts reloading the policy file if one is named.
fn app(
    store: AnyStore,
    trusted: &[String],
    config: Option<&PathBuf>,
) -> Result<axum::Router, Box<dyn std::error::Error + Send + Sync>> {
    let policy = tollgate_examples::quickstart_policy(config.map(PathBuf::as_path), trusted)?;
    let (app, layer) = tollgate_examples::quickstart_app_with(store.clone(), trusted, &policy)?;
    if let Some(path) = config {
        // Every reloaded file gets the environment's proxies, as the first.
        let trusted = trusted.to_vec();
        layer
            .reloader(path, &policy, store, |b| b)
            .prepare(move |f| f.default_trusted_proxies(&trusted))
            .spawn(Duration::from_secs(2));
        println!(
            "policy from {} (reloads on SIGHUP and on change)",
            path.display()
        );
    }
    Ok(app)
}

/// `url` with any password masked (`redis://user:***@host`), for logs:
/// one URL, or a comma-separated list of cluster nodes.
fn without_password(url: &str) -> String {
    url.split(',')
        .map(|one| {
            let Some((scheme, rest)) = one.split_once("://") else {
                return one.to_owned();
            };
            let Some((creds, host)) = rest.rsplit_once('@') else {
                return one.to_owned();
            };
            let masked = match creds.split_once(':') {
                Some((user, _)) => format!("{user}:***"),
                None => "***".to_owned(),
            };
            format!("{scheme}://{masked}@{host}")
        })
        .collect::<Vec<_>>()
        .join(",")
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    tollgate_examples::init_logs();
    let addr = std::env::var("TOLLGATE_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let trusted: Vec<String> = std::env::var("TOLLGATE_TRUSTED_PROXIES")
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect();
    let config = std::env::var_os("TOLLGATE_CONFIG")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from);
    // The recorder first: the layers register their metrics when built.
    let metrics = tollgate_examples::prometheus()?;
    // The store is a deployment choice: one `AnyStore` type either way, so
    // the app is built once.
    let (store, shown): (AnyStore, String) = match std::env::var("TOLLGATE_REDIS_URL") {
        Ok(url) if !url.trim().is_empty() => {
            // If Redis goes away, each instance keeps limiting on its own.
            let mut builder = RedisStore::builder(&url)
                .prefix("quickstart")
                .failure_policy(FailurePolicy::fallback());
            // Key names keyed by the fleet's secret: no client key can be
            // read back from Redis.
            if let Ok(secret) = std::env::var("TOLLGATE_KEY_SECRET") {
                builder = builder.key_secret(secret);
            }
            let shown = format!("redis store at {}", without_password(&url));
            (builder.build()?.into(), shown)
        }
        // Idle keys are dropped every 10 s, so memory comes back when
        // traffic stops after a flood.
        _ => {
            let store = MemoryStore::builder()
                .sweep_idle_every(std::time::Duration::from_secs(10))
                .build()?;
            (store.into(), "in-memory store".to_owned())
        }
    };
    let built = app(store, &trusted, config.as_ref()).map(|a| (a, shown));
    let (app, store) = match built {
        Ok(built) => built,
        Err(e) => {
            // A policy file that does not load: say where, and stop.
            eprintln!("tollgate quickstart: {e}");
            std::process::exit(2);
        }
    };
    // `/metrics` names rules and plans and shows the Redis breaker's
    // state (which tells a flood when the store is failing open): on an
    // internal listener when one is named, else on the public port (a
    // demo's convenience).
    let metrics_addr = std::env::var("TOLLGATE_METRICS_ADDR")
        .ok()
        .filter(|a| !a.trim().is_empty());
    let app = match &metrics_addr {
        Some(internal) => {
            let listener = tokio::net::TcpListener::bind(internal).await?;
            println!(
                "metrics on http://{}/metrics (internal)",
                listener.local_addr()?
            );
            let metrics = tollgate_examples::metrics_route(metrics);
            tokio::spawn(async move { axum::serve(listener, metrics).await });
            app
        }
        None => app.merge(tollgate_examples::metrics_route(metrics)),
    };
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!(
        "tollgate quickstart listening on http://{} ({store})",
        listener.local_addr()?
    );
    tollgate_examples::serve(listener, app).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn no_password_is_printed() {
        use super::without_password as shown;
        assert_eq!(shown("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
        assert_eq!(shown("redis://:s3cret@h:6379/0"), "redis://:***@h:6379/0");
        assert_eq!(shown("rediss://app:s3cret@h"), "rediss://app:***@h");
        assert_eq!(
            shown("redis://a:p@h1:1,redis://a:p@h2:2"),
            "redis://a:***@h1:1,redis://a:***@h2:2"
        );
        assert!(!shown("redis://u:p@ss@h").contains("p@ss"));
    }
}
