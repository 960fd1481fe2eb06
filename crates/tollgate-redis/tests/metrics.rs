//! The store's metrics carry its name, so that two stores (a `Tiered`
//! pair on one prefix) read apart.
#![allow(missing_docs, clippy::unwrap_used)]

use std::sync::{Arc, Mutex};

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use tollgate_redis::RedisStore;

/// Records the keys registered: name and labels.
#[derive(Default, Clone)]
struct Keys(Arc<Mutex<Vec<String>>>);

impl Keys {
    fn push(&self, key: &Key) {
        let mut labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        labels.sort();
        self.0
            .lock()
            .unwrap()
            .push(format!("{}{{{}}}", key.name(), labels.join(",")));
    }
}

impl Recorder for Keys {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        self.push(key);
        Counter::noop()
    }
    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        self.push(key);
        Gauge::noop()
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        self.push(key);
        Histogram::noop()
    }
}

#[tokio::test]
async fn two_stores_on_one_prefix_have_metrics_of_their_own() {
    let keys = Keys::default();
    metrics::with_local_recorder(&keys, || {
        // Nothing listens there: a store is built without waiting.
        for name in ["regional", "global"] {
            RedisStore::builder("redis://127.0.0.1:1")
                .prefix("shop")
                .name(name)
                .build()
                .unwrap();
        }
        RedisStore::builder("redis://127.0.0.1:1")
            .prefix("billing")
            .build()
            .unwrap();
    });
    let keys = keys.0.lock().unwrap().clone();
    for name in ["regional", "global", "billing"] {
        for metric in [
            format!("tollgate_store_calls_total{{name={name},result=timeout,store=redis}}"),
            format!("tollgate_store_call_seconds{{name={name},store=redis}}"),
        ] {
            assert!(keys.contains(&metric), "{metric} not in {keys:?}");
        }
        assert!(
            keys.iter()
                .any(|k| k.starts_with(&format!("tollgate_store_breaker_open{{name={name},"))),
            "{keys:?}"
        );
    }
    let err = RedisStore::builder("redis://127.0.0.1:1")
        .prefix("shop")
        .name("no spaces")
        .build()
        .unwrap_err();
    assert_eq!(err.field(), "name");
}

#[tokio::test]
async fn a_leased_rule_s_counts_are_metrics_by_rule() {
    use tollgate_core::{Limit, Rate, Rule, Store};
    let keys = Keys::default();
    let rule = Rule::new("hot-rule", Limit::gcra(Rate::per_second(10), 10)).unwrap();
    metrics::with_local_recorder(&keys, || {
        tollgate_redis::HotKeys::new()
            .over(tollgate_memory::MemoryStore::new())
            .unwrap()
            .limiter(&rule)
            .unwrap();
        // A second front leasing a rule of the same name counts apart.
        tollgate_redis::HotKeys::new()
            .name("global")
            .over(tollgate_memory::MemoryStore::new())
            .unwrap()
            .limiter(&rule)
            .unwrap();
    });
    let keys = keys.0.lock().unwrap().clone();
    for name in [
        "tollgate_hot_decisions_total",
        "tollgate_hot_store_calls_total",
        "tollgate_hot_waits_total",
    ] {
        for front in ["hot", "global"] {
            let metric = format!("{name}{{name={front},rule=hot-rule}}");
            assert!(keys.contains(&metric), "{metric} not in {keys:?}");
        }
    }
    let err = tollgate_redis::HotKeys::new()
        .name("no spaces")
        .over(tollgate_memory::MemoryStore::new())
        .map(drop)
        .unwrap_err();
    assert_eq!(err.field(), "hot_keys");
}
