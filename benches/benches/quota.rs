//! A calendar-quota decision with two periods (a day and a month) against
//! tollgate's own single fixed-window decision, both in the memory store
//! on the system clock, one key. One run, group `quota_decide`.
#![allow(missing_docs, clippy::unwrap_used)]

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use tollgate_core::calendar::{Offset, Period};
use tollgate_core::{Limit, QuotaRule, QuotaStore, Rule, Store};
use tollgate_memory::MemoryStore;

fn quota_decide(c: &mut Criterion) {
    let store = MemoryStore::new();
    let window = store
        .limiter(
            &Rule::new(
                "window",
                Limit::fixed_window(u32::MAX, Duration::from_secs(86_400)),
            )
            .unwrap(),
        )
        .unwrap();
    let quota = store
        .quota_limiter(
            &QuotaRule::new(
                "quota",
                &[(Period::Day, 1 << 50), (Period::Month, 1 << 51)],
                Offset::UTC,
            )
            .unwrap(),
        )
        .unwrap();
    let key = b"bench-key-0123456789";
    let mut g = c.benchmark_group("quota_decide");
    g.bench_function("fixed_window", |b| {
        b.iter(|| window.decide_now(std::hint::black_box(key), 1))
    });
    g.bench_function("quota_day_and_month", |b| {
        b.iter(|| quota.consume_now(std::hint::black_box(key), 1))
    });
    g.finish();
}

criterion_group!(benches, quota_decide);
criterion_main!(benches);
