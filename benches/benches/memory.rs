//! In-memory decisions: tollgate's `MemoryStore` (GCRA) against governor's
//! keyed `RateLimiter` (`check_key`), same quota, same keys, one run.
//!
//! Groups (names fixed so runs compare): `mem_hot_key` (one key, every
//! decision allowed), `mem_100k_keys` (100,000 keys in random order),
//! `mem_contended` (two threads on one key; time per decision per thread).
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects
)]

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use governor::{Quota, RateLimiter};
use tollgate_core::{Limit, Rate, Rule, Store};
use tollgate_memory::{MemoryLimiter, MemoryStore};

// A quota no bench exhausts: one unit per nanosecond and a burst worth a
// second, so every decision is an allowed one (the common case) even when a
// thread is preempted between reading the clock and updating the state.
const PER_SECOND: u32 = 1_000_000_000;
const BURST: u32 = 1_000_000_000;

type Governor = governor::DefaultKeyedRateLimiter<[u8; 16]>;

fn governor() -> Governor {
    RateLimiter::keyed(
        Quota::per_second(NonZeroU32::new(PER_SECOND).unwrap())
            .allow_burst(NonZeroU32::new(BURST).unwrap()),
    )
}

fn tollgate() -> MemoryLimiter {
    let rule = Rule::new("bench", Limit::gcra(Rate::per_second(PER_SECOND), BURST)).unwrap();
    MemoryStore::new().limiter(&rule).unwrap()
}

fn hot_key(c: &mut Criterion) {
    let mut g = c.benchmark_group("mem_hot_key");
    let key = tollgate_benches::keys(1, 1)[0];
    let t = tollgate();
    g.bench_function("tollgate", |b| {
        b.iter(|| assert!(t.decide_now(black_box(&key), 1).is_allowed()))
    });
    let gov = governor();
    g.bench_function("governor", |b| {
        b.iter(|| assert!(gov.check_key(black_box(&key)).is_ok()))
    });
    g.finish();
}

fn many_keys(c: &mut Criterion) {
    let mut g = c.benchmark_group("mem_100k_keys");
    let keys = tollgate_benches::keys(100_000, 2);
    let t = tollgate();
    let mut i = 0;
    g.bench_function("tollgate", |b| {
        b.iter(|| {
            i = (i + 1) % keys.len();
            assert!(t.decide_now(black_box(&keys[i]), 1).is_allowed())
        })
    });
    let gov = governor();
    let mut i = 0;
    g.bench_function("governor", |b| {
        b.iter(|| {
            i = (i + 1) % keys.len();
            assert!(gov.check_key(black_box(&keys[i])).is_ok())
        })
    });
    g.finish();
}

/// Two threads run `iters` decisions each on one key, started together;
/// the wall time is the time per decision per thread.
fn two_threads(iters: u64, decide: impl Fn() -> bool + Send + Sync + 'static) -> Duration {
    let decide = Arc::new(decide);
    let barrier = Arc::new(Barrier::new(3));
    let workers: Vec<_> = (0..2)
        .map(|_| {
            let (decide, barrier) = (Arc::clone(&decide), Arc::clone(&barrier));
            thread::spawn(move || {
                barrier.wait();
                for _ in 0..iters {
                    assert!(decide());
                }
            })
        })
        .collect();
    barrier.wait();
    let start = Instant::now();
    for w in workers {
        w.join().unwrap();
    }
    start.elapsed()
}

fn contended(c: &mut Criterion) {
    let mut g = c.benchmark_group("mem_contended");
    let key = tollgate_benches::keys(1, 3)[0];
    let t = tollgate();
    g.bench_function("tollgate", |b| {
        b.iter_custom(|iters| {
            let t = t.clone();
            two_threads(iters, move || t.decide_now(black_box(&key), 1).is_allowed())
        })
    });
    let gov = Arc::new(governor());
    g.bench_function("governor", |b| {
        b.iter_custom(|iters| {
            let gov = Arc::clone(&gov);
            two_threads(iters, move || gov.check_key(black_box(&key)).is_ok())
        })
    });
    g.finish();
}

criterion_group!(benches, hot_key, many_keys, contended);
criterion_main!(benches);
