//! The quickstart's `GET /metrics`: Prometheus text of what its layers
//! decided, through real HTTP. (Its own test binary: the recorder is
//! global to the process.)
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::arithmetic_side_effects,
    clippy::indexing_slicing
)]

mod common;

use bytes::Bytes;
use http::Request;
use tollgate::MemoryStore;
use tollgate_tests::send;

fn get(path: &str, key: &str) -> Request<Bytes> {
    Request::get(path)
        .header("x-api-key", key)
        .body(Bytes::new())
        .unwrap()
}

/// The sum of the samples `name{labels, ...}` in Prometheus text, if any.
fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    // The sum of the series with these labels (as PromQL's `sum`).
    text.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next())
        .filter_map(|v| v.parse::<f64>().ok())
        .fold(None, |sum, v| Some(sum.unwrap_or(0.0) + v))
}

/// Every `tollgate_*` name in `text` (PromQL, YAML, JSON).
fn names_in(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("tollgate_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        names.push(tail[..end].to_owned());
        rest = &tail[end..];
    }
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quickstart_serves_what_its_layers_decided_as_prometheus_text() {
    let handle = tollgate_examples::prometheus().unwrap();
    let app = tollgate_examples::quickstart_app(MemoryStore::new(), &[])
        .unwrap()
        .merge(tollgate_examples::metrics_route(handle));
    let addr = common::spawn(app).await;
    for _ in 0..25 {
        send(addr, get("/api/hello", "metered")).await.unwrap();
    }
    // Scrapes are not limited.
    let mut text = String::new();
    for _ in 0..30 {
        let r = send(addr, get("/metrics", "metered")).await.unwrap();
        assert_eq!(r.status, 200);
        assert!(r.header("content-type").starts_with("text/plain"));
        text = r.body;
    }
    let requests = "tollgate_requests_total";
    assert_eq!(
        sample(
            &text,
            requests,
            &[("rule", "per-key"), ("outcome", "allowed")]
        ),
        Some(20.0),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            requests,
            &[("rule", "per-key"), ("outcome", "limited")]
        ),
        Some(5.0),
        "{text}"
    );
    // The policy counts by plan, and (route_label in its file) by route.
    assert_eq!(
        sample(
            &text,
            requests,
            &[
                ("rule", "per-key"),
                ("plan", "default"),
                ("outcome", "limited")
            ]
        ),
        Some(5.0),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            "tollgate_route_requests_total",
            &[
                ("rule", "per-key"),
                ("route", "/api/hello"),
                ("outcome", "allowed")
            ]
        ),
        Some(20.0),
        "{text}"
    );
    assert!(sample(
        &text,
        "tollgate_concurrency_in_flight",
        &[("rule", "per-client")]
    )
    .is_some());
    assert!(text.contains("tollgate_retry_after_seconds"), "{text}");
    // What each decision left (25 of the per-key rule's), and what the
    // day's quota had used at each of its 20: at most 20 of 1,000.
    assert_eq!(
        sample(
            &text,
            "tollgate_remaining_ratio_count",
            &[("rule", "per-key")]
        ),
        Some(25.0),
        "{text}"
    );
    // Histograms with fixed buckets: the 20 quota decisions had used
    // 1/1,000 to 20/1,000 of the day (counting their own charge): ten at
    // most 1 %, all at most 5 %, and 0.21 in all.
    let bucket = |le: &str| {
        sample(
            &text,
            "tollgate_quota_used_ratio_bucket",
            &[("rule", "daily"), ("period", "day"), ("le", le)],
        )
    };
    assert_eq!(bucket("0.05"), Some(20.0), "{text}");
    assert_eq!(bucket("0.01"), Some(10.0), "{text}");
    assert_eq!(bucket("0"), Some(0.0), "{text}");
    let sum = sample(
        &text,
        "tollgate_quota_used_ratio_sum",
        &[("rule", "daily"), ("period", "day")],
    );
    assert!(sum.is_some_and(|s| (s - 0.21).abs() < 1e-9), "{sum:?}");
    // The dashboard and the alerts use only metrics that exist. The Redis
    // store's register when one is built.
    let redis = tollgate_redis::testing::Server::start();
    let _store = redis.as_ref().map(|r| {
        tollgate::RedisStore::builder(&r.url())
            .prefix(&tollgate_redis::testing::unique_prefix())
            .build()
            .unwrap()
    });
    let text = send(addr, get("/metrics", "metered")).await.unwrap().body;
    let exported: std::collections::HashSet<&str> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .collect();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let dashboard = std::fs::read_to_string(root.join("examples/grafana/tollgate.json")).unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&dashboard).unwrap();
    let mut exprs: Vec<String> = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            exprs.push(target["expr"].as_str().unwrap().to_owned());
        }
    }
    assert!(exprs.len() >= 6, "{exprs:?}");
    let alerts = std::fs::read_to_string(root.join("examples/prometheus/alerts.yml")).unwrap();
    let alert_count = alerts.matches("- alert:").count();
    assert_eq!(alert_count, 5);
    exprs.push(alerts);
    if redis.is_some() {
        for name in exprs.iter().flat_map(|e| names_in(e)) {
            assert!(
                exported.contains(name.as_str()),
                "{name} is not exported:\n{text}"
            );
        }
    }
    // Every metric is tollgate's, and no label carries a client key.
    for line in text
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        assert!(line.starts_with("tollgate_"), "{line}");
        assert!(!line.contains("metered"), "a client key in a label: {line}");
    }
}
