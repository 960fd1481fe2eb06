//! `tollgate-server policy.toml`: the decision endpoints over a policy
//! file's rules and quotas, on the file's `[store]`, listening where its
//! `[server]` says (default `127.0.0.1:8081`; `TOLLGATE_SERVER_ADDR`
//! overrides it). The file reloads on SIGHUP and when it changes. On
//! ctrl-c or SIGTERM it stops taking requests, finishes those under way,
//! and gives back what `[store.hot_keys]` leases still hold.

use std::net::SocketAddr;
use std::time::Duration;

/// Where the decision endpoints listen without a `[server] listen`.
const DEFAULT_LISTEN: &str = "127.0.0.1:8081";
/// Where Envoy's rate limit service listens without a `[server] grpc`.
const DEFAULT_GRPC: &str = "127.0.0.1:8082";
/// How long stopping waits for the rate limit service to drain, and then
/// for leased units to go back.
const SHUTDOWN: Duration = Duration::from_secs(10);

#[tokio::main]
async fn main() {
    tollgate_server::init_logs();
    if let Err(e) = run().await {
        eprintln!("tollgate-server: {e}");
        std::process::exit(2);
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let path = std::env::args_os()
        .nth(1)
        .or_else(|| std::env::var_os("TOLLGATE_POLICY"))
        .ok_or("usage: tollgate-server policy.toml (or TOLLGATE_POLICY=policy.toml)")?;
    // Before the limits are built: each registers its metrics then.
    let metrics = tollgate_server::metrics::prometheus()?;
    let loaded = tollgate_server::Loaded::load(&path)?;
    let store_now = loaded.current_store();
    let tollgate_server::Loaded {
        settings,
        gate,
        reloader,
        envoy,
        ..
    } = loaded;
    reloader.spawn(Duration::from_secs(2));
    let listen: SocketAddr = match std::env::var("TOLLGATE_SERVER_ADDR") {
        Ok(addr) if !addr.trim().is_empty() => addr.trim().parse()?,
        _ => settings.listen.unwrap_or(DEFAULT_LISTEN.parse()?),
    };
    let tls = settings
        .tls
        .as_ref()
        .map(tollgate_server::tls::load)
        .transpose()?;
    let mut app = tollgate_server::decisions(gate);
    match settings.metrics {
        Some(addr) => {
            let listener = tokio::net::TcpListener::bind(addr).await?;
            println!("metrics on http://{}/metrics", listener.local_addr()?);
            let route = tollgate_server::metrics::metrics_route(metrics);
            tokio::spawn(async move { tollgate_server::serve(listener, route).await });
        }
        None => app = app.merge(tollgate_server::metrics::metrics_route(metrics)),
    }
    let mut rls_task = None;
    if let Some(envoy) = &envoy {
        let grpc = settings.grpc.unwrap_or(DEFAULT_GRPC.parse()?);
        let listener = tokio::net::TcpListener::bind(grpc).await?;
        println!(
            "Envoy rate limit service on {} ({} files)",
            listener.local_addr()?,
            settings.envoy.len()
        );
        envoy.watch(Duration::from_secs(2));
        let (rls, tls) = (envoy.rls(), tls.clone());
        rls_task = Some(tokio::spawn(async move {
            if let Err(e) = tollgate_server::rls::serve_with(listener, rls, tls.as_ref()).await {
                tracing::error!(error = %e, "the rate limit service stopped");
            }
        }));
    }
    let listener = tokio::net::TcpListener::bind(listen).await?;
    println!(
        "tollgate-server deciding for {} on {}://{} (/check, /auth_request)",
        std::path::Path::new(&path).display(),
        if tls.is_some() { "https" } else { "http" },
        listener.local_addr()?
    );
    match &tls {
        Some(tls) => tollgate_server::serve_tls(listener, tls, app).await?,
        None => tollgate_server::serve(listener, app).await?,
    }
    // Both services drained (each stops on the same signal): what leases
    // hold goes back to the fleet now, not when their TTL ends.
    if let Some(task) = rls_task {
        let _ = tokio::time::timeout(SHUTDOWN, task).await;
    }
    let store = store_now();
    if store.is_leased() {
        match tokio::time::timeout(SHUTDOWN, store.give_back()).await {
            Ok(units) => tracing::info!(units, "stopped; leased units given back"),
            Err(_) => {
                tracing::warn!("stopped; leased units not all given back in time (they lapse)")
            }
        }
    }
    Ok(())
}
