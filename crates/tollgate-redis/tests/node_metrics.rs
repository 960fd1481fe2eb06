//! Shard balance (fleet review, issue 30): a Cluster store's calls are
//! counted per master, by address, so one node taking more than its
//! share shows. (Its own test binary: the recorder is global to the
//! process.)
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::arithmetic_side_effects,
    clippy::indexing_slicing
)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use tollgate_core::{Limit, Limiter, Rule, Store};
use tollgate_redis::testing::{unique_prefix, Cluster};
use tollgate_redis::RedisStore;

/// Counts every counter by name and labels (`name{k=v,...}`, sorted).
#[derive(Default, Clone)]
struct Counts(Arc<Mutex<HashMap<String, Arc<AtomicU64>>>>);

impl Counts {
    /// The counts of `tollgate_store_node_calls_total` with `result` of
    /// the store named `store`, by node.
    fn by_node(&self, store: &str, result: &str) -> HashMap<String, u64> {
        let head = "tollgate_store_node_calls_total{";
        let mut nodes = HashMap::new();
        for (key, count) in self.0.lock().unwrap().iter() {
            let Some(labels) = key.strip_prefix(head) else {
                continue;
            };
            let labels: HashMap<&str, &str> = labels
                .trim_end_matches('}')
                .split(',')
                .filter_map(|kv| kv.split_once('='))
                .collect();
            if labels.get("name") == Some(&store) && labels.get("result") == Some(&result) {
                let node = labels.get("node").copied().unwrap_or_default().to_owned();
                *nodes.entry(node).or_insert(0) += count.load(Ordering::Relaxed);
            }
        }
        nodes
    }
}

impl Recorder for Counts {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        let mut labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        labels.sort();
        let name = format!("{}{{{}}}", key.name(), labels.join(","));
        let cell = Arc::clone(self.0.lock().unwrap().entry(name).or_default());
        Counter::from_arc(cell)
    }
    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }
    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_stores_calls_are_counted_per_master() {
    let counts = Counts::default();
    metrics::set_global_recorder(counts.clone()).unwrap();
    let Some(cluster) = tokio::task::spawn_blocking(Cluster::start).await.unwrap() else {
        return;
    };
    let store = RedisStore::builder(&cluster.url())
        .prefix(&unique_prefix())
        .name("balance")
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let rule = Rule::new(
        "per-key",
        Limit::fixed_window(1_000, Duration::from_secs(60)),
    )
    .unwrap();
    let limiter = store.limiter(&rule).unwrap();
    // Keys spread over every slot: each master takes its share.
    for i in 0..600 {
        limiter.decide(format!("k{i}").as_bytes(), 1).await.unwrap();
    }
    let ok = counts.by_node("balance", "ok");
    assert_eq!(
        ok.values().sum::<u64>(),
        600,
        "every call counted once: {ok:?}"
    );
    let masters: Vec<String> = cluster.nodes[..3]
        .iter()
        .map(|n| n.url().trim_start_matches("redis://").to_owned())
        .collect();
    for master in &masters {
        // (Calls made before the slot map was read count as `unmapped`.)
        let share = ok.get(master).copied().unwrap_or(0);
        assert!(share >= 100, "{master}: {share} of 600 in {ok:?}");
    }
    // One hot key: the master that holds it takes every call, under its
    // own address; the others none.
    let holder = cluster
        .master_holding(|| async {
            limiter.decide(b"hot", 1).await.unwrap();
        })
        .await
        .unwrap();
    for _ in 1..300 {
        limiter.decide(b"hot", 1).await.unwrap();
    }
    let after = counts.by_node("balance", "ok");
    let grown: Vec<(String, u64)> = masters
        .iter()
        .map(|m| {
            (
                m.clone(),
                after.get(m).unwrap_or(&0) - ok.get(m).unwrap_or(&0),
            )
        })
        .filter(|(_, n)| *n > 0)
        .collect();
    assert_eq!(grown, [(masters[holder].clone(), 300)]);
}
