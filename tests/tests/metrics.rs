//! The quickstart's `GET /metrics`: Prometheus text of what its layers
//! decided, through real HTTP. (Its own test binary: the recorder is
//! global to the process.)
#![allow(missing_docs, clippy::unwrap_used, clippy::arithmetic_side_effects)]

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

/// The value of the sample `name{labels}` in Prometheus text, if present.
fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .find(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test]
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
    assert!(sample(
        &text,
        "tollgate_concurrency_in_flight",
        &[("rule", "per-client")]
    )
    .is_some());
    assert!(text.contains("tollgate_retry_after_seconds"), "{text}");
    // Every metric is tollgate's, and no label carries a client key.
    for line in text
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        assert!(line.starts_with("tollgate_"), "{line}");
        assert!(!line.contains("metered"), "a client key in a label: {line}");
    }
}
