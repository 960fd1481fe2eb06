//! Prometheus text of what the limits decide: a recorder for the
//! `metrics` facade with fixed histogram buckets, and `GET /metrics`.

use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// How often the Prometheus recorder's upkeep runs: at most this long's
/// histogram samples are held between drains.
pub const METRICS_UPKEEP: std::time::Duration = std::time::Duration::from_secs(1);

/// The histogram buckets of [`prometheus`]: a 1-2-5 ladder from 1 ms (or
/// one unit) to 1,000,000, which covers `Retry-After` seconds, remaining
/// units, quota shares and waits.
pub const HISTOGRAM_BUCKETS: &[f64] = &[
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0,
    200.0, 500.0, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5, 5e5, 1e6,
];

/// The buckets of the `*_ratio` histograms (shares from 0 to 1), finer
/// near the ends where alerts look.
pub const RATIO_BUCKETS: &[f64] = &[
    0.0, 0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0,
];

/// Installs a Prometheus recorder for the `metrics` facade, once per
/// process (later calls return the same handle), and a thread that runs
/// its upkeep every [`METRICS_UPKEEP`]. Call it **before** building the
/// layers: each registers its metrics when it is built.
///
/// The upkeep is not optional. A recorder installed with
/// `install_recorder` keeps every histogram sample (16 bytes or so, three
/// or four per request here) until something drains them — a scrape, or
/// `run_upkeep` — so a server nobody scrapes grows by ~50 bytes a
/// request without it. (`PrometheusBuilder::install`, with the exporter's
/// `http-listener` feature, starts such a task itself.)
pub fn prometheus() -> Result<PrometheusHandle, String> {
    static HANDLE: std::sync::OnceLock<Result<PrometheusHandle, String>> =
        std::sync::OnceLock::new();
    HANDLE
        .get_or_init(|| {
            // Histograms with fixed buckets, not the exporter's default
            // summaries: a summary keeps a high-accuracy sketch per time
            // bucket whose size grows with the spread of the values seen
            // (megabytes under a flood), and summaries cannot be summed
            // across instances anyway. Buckets are a fixed few counters
            // per series. One ladder serves seconds and units alike.
            let handle = PrometheusBuilder::new()
                .set_buckets(HISTOGRAM_BUCKETS)
                .map_err(|e| e.to_string())?
                .set_buckets_for_metric(
                    metrics_exporter_prometheus::Matcher::Suffix("_ratio".to_owned()),
                    RATIO_BUCKETS,
                )
                .map_err(|e| e.to_string())?
                .install_recorder()
                .map_err(|e| e.to_string())?;
            let upkeep = handle.clone();
            std::thread::Builder::new()
                .name("metrics-upkeep".into())
                .spawn(move || loop {
                    std::thread::sleep(METRICS_UPKEEP);
                    upkeep.run_upkeep();
                })
                .map_err(|e| e.to_string())?;
            Ok(handle)
        })
        .clone()
}

/// `GET /metrics`: the Prometheus text of every metric the layers
/// record (all named `tollgate_*`). Not limited: a scraper must always
/// get through.
pub fn metrics_route(handle: PrometheusHandle) -> Router {
    Router::new().route(
        "/metrics",
        get(move || {
            let text = handle.render();
            async move {
                (
                    [(
                        axum::http::header::CONTENT_TYPE,
                        "text/plain; version=0.0.4",
                    )],
                    text,
                )
            }
        }),
    )
}
