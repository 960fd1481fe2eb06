//! Bytes per key: heap held by 1,000,000 16-byte keys in tollgate's
//! `MemoryStore` (GCRA) and in governor's keyed `RateLimiter`, measured
//! with a counting allocator in one process. Prints one line per store.
// The counting allocator is the one place unsafe code is needed: it only
// forwards to the system allocator.
#![allow(
    unsafe_code,
    missing_docs,
    clippy::unwrap_used,
    clippy::arithmetic_side_effects
)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicUsize, Ordering};

use tollgate_core::{Limit, Rate, Rule, Store};
use tollgate_memory::MemoryStore;

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator unchanged, only counting bytes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size, Ordering::Relaxed);
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const KEYS: usize = 1_000_000;

fn measure(name: &str, run: impl FnOnce(&[[u8; 16]]) -> Box<dyn std::any::Any>) -> f64 {
    let keys = tollgate_benches::keys(KEYS, 4);
    let before = LIVE.load(Ordering::Relaxed);
    let held = run(&keys);
    let bytes = LIVE.load(Ordering::Relaxed) - before;
    drop(held);
    let per_key = bytes as f64 / KEYS as f64;
    println!("{name:<10} {KEYS} keys: {bytes} bytes, {per_key:.1} bytes/key");
    per_key
}

fn main() {
    // `cargo bench` passes `--bench`; a filter that names neither store skips the run.
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    if !filter.is_empty() && !filter.iter().any(|f| "bytes_per_key".contains(f.as_str())) {
        return;
    }
    let t = measure("tollgate", |keys| {
        let store = MemoryStore::new();
        let rule = Rule::new("b", Limit::gcra(Rate::per_second(1), 10)).unwrap();
        let limiter = store.limiter(&rule).unwrap();
        for k in keys {
            assert!(limiter.decide_now(k, 1).is_allowed());
        }
        assert_eq!(store.key_count(), KEYS);
        Box::new((store, limiter))
    });
    let g = measure("governor", |keys| {
        let limiter = governor::RateLimiter::keyed(
            governor::Quota::per_second(NonZeroU32::new(1).unwrap())
                .allow_burst(NonZeroU32::new(10).unwrap()),
        );
        for k in keys {
            assert!(limiter.check_key(k).is_ok());
        }
        assert_eq!(limiter.len(), KEYS);
        Box::new(limiter)
    });
    println!("ratio tollgate/governor: {:.3}", t / g);
}
