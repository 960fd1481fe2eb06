//! Many threads on one key never admit more than the limit allows for the
//! time that passed on the (manual) clock.
#![allow(missing_docs, clippy::unwrap_used, clippy::arithmetic_side_effects)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use tollgate_core::{Clock, Limit, ManualClock, Rate, Rule, Store};
use tollgate_memory::MemoryStore;

const THREADS: usize = 8;
const CALLS: usize = 20_000;

/// Runs `THREADS` threads of `CALLS` decisions of cost 1 on one key while
/// another thread advances the clock by `step` a fixed number of times;
/// returns (admitted, elapsed ns).
fn hammer(limit: Limit, step: Duration) -> (u64, u64) {
    let clock = ManualClock::starting_at(1_000_000_000_000);
    let start = clock.now();
    let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let limiter = store.limiter(&Rule::new("hot", limit).unwrap()).unwrap();
    let admitted = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let ticker = {
        let (clock, done) = (clock.clone(), Arc::clone(&done));
        thread::spawn(move || {
            for _ in 0..2_000 {
                if done.load(Ordering::Relaxed) {
                    break;
                }
                clock.advance(step);
                thread::yield_now();
            }
        })
    };
    let workers: Vec<_> = (0..THREADS)
        .map(|_| {
            let (limiter, admitted) = (limiter.clone(), Arc::clone(&admitted));
            thread::spawn(move || {
                for _ in 0..CALLS {
                    if limiter.decide_now(b"one-key", 1).is_allowed() {
                        admitted.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    done.store(true, Ordering::Relaxed);
    ticker.join().unwrap();
    (admitted.load(Ordering::Relaxed), clock.now() - start)
}

#[test]
fn gcra_admits_at_most_burst_plus_rate_times_elapsed() {
    // 1,000/s (1 ms apart), burst 50; the ticker moves time in 0.3 ms steps.
    let (admitted, elapsed) = hammer(
        Limit::gcra(Rate::per_second(1_000), 50),
        Duration::from_micros(300),
    );
    let bound = 50 + elapsed / 1_000_000;
    assert!(admitted <= bound, "admitted {admitted} > {bound}");
    assert!(
        admitted >= 50,
        "the burst itself was not admitted: {admitted}"
    );
}

#[test]
fn fixed_window_admits_at_most_limit_per_window() {
    let (admitted, elapsed) = hammer(
        Limit::fixed_window(100, Duration::from_millis(10)),
        Duration::from_micros(700),
    );
    // Windows touched: those the run overlapped, at most elapsed/10ms + 1.
    let bound = 100 * (elapsed / 10_000_000 + 1);
    assert!(admitted <= bound, "admitted {admitted} > {bound}");
    assert!(admitted >= 100);
}

#[test]
fn sliding_log_admits_at_most_limit_per_window() {
    let (admitted, elapsed) = hammer(
        Limit::sliding_window_log(100, Duration::from_millis(10)),
        Duration::from_micros(700),
    );
    let bound = 100 * (elapsed / 10_000_000 + 1);
    assert!(admitted <= bound, "admitted {admitted} > {bound}");
    assert!(admitted >= 100);
}

#[test]
fn frozen_clock_admits_exactly_the_burst() {
    // No ticker movement at all: exactly the capacity, however many threads race.
    for limit in [
        Limit::gcra(Rate::per_second(1), 37),
        Limit::token_bucket(37, 1, Duration::from_secs(1)),
        Limit::fixed_window(37, Duration::from_secs(1)),
        Limit::sliding_window_counter(37, Duration::from_secs(1)),
        Limit::sliding_window_log(37, Duration::from_secs(1)),
        Limit::leaky_bucket(Rate::per_second(1), Duration::from_secs(36)),
    ] {
        let (admitted, _) = hammer(limit, Duration::ZERO);
        assert_eq!(admitted, 37, "{limit:?}");
    }
}
