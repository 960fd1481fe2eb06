//! Runs `quota_decide`'s two decisions N times, for instruction counts:
//! `valgrind --tool=callgrind target/release/examples/quota_instructions quota 3000000`
//! (`window` or `quota`). Subtract a run of 1,000,000 from one of
//! 3,000,000 and divide by 2,000,000.
#![allow(missing_docs, clippy::unwrap_used, clippy::panic)]
use std::time::Duration;

use tollgate_core::calendar::{Offset, Period};
use tollgate_core::{Limit, QuotaRule, QuotaStore, Rule, Store};
use tollgate_memory::MemoryStore;

fn main() {
    let which = std::env::args().nth(1).unwrap();
    let n: usize = std::env::args().nth(2).unwrap().parse().unwrap();
    let store = MemoryStore::new();
    let key = b"bench-key-0123456789";
    match which.as_str() {
        "window" => {
            let rule = Rule::new(
                "window",
                Limit::fixed_window(u32::MAX, Duration::from_secs(86_400)),
            )
            .unwrap();
            let l = store.limiter(&rule).unwrap();
            for _ in 0..n {
                std::hint::black_box(l.decide_now(std::hint::black_box(key), 1));
            }
        }
        "quota" => {
            let rule = QuotaRule::new(
                "quota",
                &[(Period::Day, 1 << 50), (Period::Month, 1 << 51)],
                Offset::UTC,
            )
            .unwrap();
            let l = store.quota_limiter(&rule).unwrap();
            for _ in 0..n {
                let _ = std::hint::black_box(l.consume_now(std::hint::black_box(key), 1));
            }
        }
        other => panic!("unknown decision {other:?}"),
    }
}
