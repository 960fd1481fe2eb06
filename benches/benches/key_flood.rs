//! A key flood against a full memory store (`mem_key_flood`): 10,000,000
//! distinct keys, one decision each, into `max_keys = 1,000,000`, on a rule
//! of 1 per minute with bursts of 100 (so no flooded key goes idle while
//! the flood lasts), with 1,000 known keys decided between them.
//!
//! Prints: the peak RSS; the mean time of a known key's decision before the
//! flood (a normal decision) and of a flood key's once the store is full;
//! a known key's p50 / p99 / worst decision time before and during the
//! flood; and, for comparison, the same store full under ordinary traffic
//! (keys it already holds, no new ones): its mean decision and a known
//! key's percentiles, what a million-key store costs without any flood. Not a criterion bench: it measures distributions over one long
//! run, which criterion's per-iteration model does not. One thread.
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects,
    clippy::cast_precision_loss
)]

use std::time::{Duration, Instant};

use tollgate_core::{Limit, Rate, Rule, Store};
use tollgate_memory::MemoryStore;

const FLOOD: u64 = 10_000_000;
const MAX_KEYS: usize = 1_000_000;
const KNOWN: u64 = 1_000;

fn key(prefix: u8, n: u64) -> [u8; 9] {
    let mut k = [prefix; 9];
    k[1..].copy_from_slice(&n.to_le_bytes());
    k
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p) as usize]
}

fn peak_rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

fn main() {
    let store = MemoryStore::builder().max_keys(MAX_KEYS).build().unwrap();
    let rule = Rule::new("flood", Limit::gcra(Rate::per_minute(1), 100)).unwrap();
    let limiter = store.limiter(&rule).unwrap();
    for n in 0..KNOWN {
        limiter.decide_now(&key(b'k', n), 1);
    }
    // Before: known keys only.
    let mut before = Vec::with_capacity(200_000);
    for i in 0..200_000u64 {
        let k = key(b'k', i % KNOWN);
        let t = Instant::now();
        std::hint::black_box(limiter.decide_now(&k, 1));
        before.push(t.elapsed());
    }
    let normal = before.iter().sum::<Duration>() / before.len() as u32;
    // The flood, a known key after every ten flood keys.
    let mut during = Vec::with_capacity((FLOOD / 10) as usize);
    let (mut full_time, mut full_count) = (Duration::ZERO, 0u64);
    let mut known = 0u64;
    for n in 0..FLOOD {
        let k = key(b'f', n);
        let t = Instant::now();
        std::hint::black_box(limiter.decide_now(&k, 1));
        let took = t.elapsed();
        if store.key_count() >= MAX_KEYS {
            full_time += took;
            full_count += 1;
        }
        if n % 10 == 0 {
            let k = key(b'k', known % KNOWN);
            known += 1;
            let t = Instant::now();
            std::hint::black_box(limiter.decide_now(&k, 1));
            during.push(t.elapsed());
        }
    }
    // The same store, full, under ordinary traffic: keys it already holds
    // (the first flood keys, admitted before it filled), in random order,
    // a known key after every ten. What a store of this size costs a known
    // key without any flood: the memory system's share of the figure above.
    let mut held = Vec::with_capacity((FLOOD / 10) as usize);
    let mut held_time = Duration::ZERO;
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for n in 0..(FLOOD / 2) {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let k = key(b'f', (x >> 33) % (MAX_KEYS as u64 - KNOWN));
        let t = Instant::now();
        std::hint::black_box(limiter.decide_now(&k, 1));
        held_time += t.elapsed();
        if n % 10 == 0 {
            let k = key(b'k', known % KNOWN);
            known += 1;
            let t = Instant::now();
            std::hint::black_box(limiter.decide_now(&k, 1));
            held.push(t.elapsed());
        }
    }
    before.sort_unstable();
    during.sort_unstable();
    held.sort_unstable();
    let flood_mean = full_time / full_count.max(1) as u32;
    println!("mem_key_flood: {FLOOD} keys into max_keys = {MAX_KEYS}, {KNOWN} known keys");
    println!(
        "  peak RSS: {:.1} MiB; keys held at the end: {}",
        peak_rss_mib(),
        store.key_count()
    );
    println!(
        "  decision, mean: normal (known key, before) {normal:?}; flood key at full {flood_mean:?} ({:.2}x) over {full_count} decisions",
        flood_mean.as_nanos() as f64 / normal.as_nanos() as f64
    );
    let spread = |label: &str, samples: &[Duration], against: Option<(&str, &[Duration])>| {
        let p99 = percentile(samples, 0.99);
        let ratio = against.map_or(String::new(), |(name, other)| {
            let x = p99.as_nanos() as f64 / percentile(other, 0.99).as_nanos() as f64;
            format!(" (p99 {x:.2}x {name})")
        });
        println!(
            "  {label}: p50 {:?} p99 {p99:?} worst {:?}{ratio}",
            percentile(samples, 0.5),
            samples[samples.len() - 1]
        );
    };
    spread("known key before", &before, None);
    spread("known key during", &during, Some(("before", &before)));
    let held_mean = held_time / (FLOOD / 2) as u32;
    println!(
        "  full store, no flood (keys it holds): decision mean {held_mean:?} (flood key {:.2}x this)",
        flood_mean.as_nanos() as f64 / held_mean.as_nanos() as f64
    );
    spread("known key, full store, no flood", &held, None);
    let x = percentile(&during, 0.99).as_nanos() as f64 / percentile(&held, 0.99).as_nanos() as f64;
    println!("  flood p99 {x:.2}x the full store's without a flood");
}
