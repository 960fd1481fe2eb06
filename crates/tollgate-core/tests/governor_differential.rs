//! Our GCRA against governor's, on the same random traces with the same
//! fake clock: the same allow / deny / never sequence, the same wait time
//! on a denial, the same remaining burst on an admission.
//!
//! governor measures time from the moment a limiter is built (its
//! `FakeRelativeClock` starts at zero) and treats a stored zero as "no state
//! yet", as our GCRA does. Our clock here is governor's plus an offset
//! (zero included), and governor's clock may already have moved before the
//! first request, so both "fresh key at time zero" and "fresh key late on
//! the time axis" are covered.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects,
    missing_docs
)]

mod support;

use std::num::NonZeroU32;
use std::time::Duration;

use governor::clock::{Clock as _, FakeRelativeClock};
use governor::middleware::StateInformationMiddleware;
use governor::{InsufficientCapacity, Quota, RateLimiter};
use proptest::prelude::*;
use support::Jump;
use tollgate_core::{Gcra, Outcome, Rate, RateAlgorithm};

/// One step: move the clock, then ask for `cost` on `key`; `single` asks
/// governor with `check()` rather than `check_n(1)` when the cost is 1.
#[derive(Debug, Clone, Copy)]
struct Step {
    jump: Jump,
    cost_seed: u32,
    key: u8,
    single: bool,
}

fn step() -> impl Strategy<Value = Step> {
    (support::forward_jump(), any::<u32>(), 0u8..2, any::<bool>()).prop_map(
        |(jump, cost_seed, key, single)| Step {
            jump,
            cost_seed,
            key,
            single,
        },
    )
}

/// governor's answer, reduced to ours: allowed (with the remaining burst
/// when known), denied with a wait, or never.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    Allow(Option<u64>),
    Deny(u64),
    Never,
}

fn ours(gcra: &Gcra, state: &mut u64, now: u64, cost: u64, with_remaining: bool) -> Answer {
    let d = gcra.decide(state, now, cost);
    match d.outcome {
        Outcome::Allow { delay } => {
            assert_eq!(delay, 0, "GCRA never delays");
            Answer::Allow(with_remaining.then_some(d.remaining))
        }
        Outcome::Deny { retry_after } => Answer::Deny(retry_after),
        Outcome::Never => Answer::Never,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn gcra_agrees_with_governor(
        period in prop_oneof![1u64..=10, 10u64..=1_000, 1_000_000u64..=1_000_000_000],
        burst in 1u32..=50,
        offset in prop_oneof![
            Just(0u64),
            1u64..=1_000_000,
            1_000_000_000_000u64..=1_000_000_000_000_000_000,
        ],
        lead in prop_oneof![Just(0u64), 1u64..=10_000_000_000],
        steps in proptest::collection::vec(step(), 1..=200),
    ) {
        let quota = Quota::with_period(Duration::from_nanos(period))
            .unwrap()
            .allow_burst(NonZeroU32::new(burst).unwrap());
        let clock = FakeRelativeClock::default();
        let direct = RateLimiter::direct_with_clock(quota, clock.clone())
            .with_middleware::<StateInformationMiddleware>();
        let keyed = RateLimiter::dashmap_with_clock(quota, clock.clone());
        let gcra = Gcra::new(Rate::new(1, Duration::from_nanos(period)), burst).unwrap();

        let mut direct_state = 0u64;
        let mut keyed_state = [0u64; 2];
        clock.advance(Duration::from_nanos(lead));
        let mut g_now = lead;
        let mut hint = 0;

        for (i, s) in steps.iter().enumerate() {
            let next = s.jump.apply(g_now, period, hint);
            clock.advance(Duration::from_nanos(next - g_now));
            g_now = next;
            prop_assert_eq!(clock.now().as_u64(), g_now);
            let now = offset + g_now;
            let cost = s.cost_seed % (burst + 1) + 1;
            let n = NonZeroU32::new(cost).unwrap();

            // The direct limiter, with the remaining burst on admission.
            let theirs = if cost == 1 && s.single {
                match direct.check() {
                    Ok(snapshot) => Answer::Allow(Some(snapshot.remaining_burst_capacity().into())),
                    Err(not_until) => {
                        Answer::Deny(not_until.wait_time_from(clock.now()).as_nanos() as u64)
                    }
                }
            } else {
                match direct.check_n(n) {
                    Ok(Ok(snapshot)) => Answer::Allow(Some(snapshot.remaining_burst_capacity().into())),
                    Ok(Err(not_until)) => {
                        Answer::Deny(not_until.wait_time_from(clock.now()).as_nanos() as u64)
                    }
                    Err(InsufficientCapacity(max)) => {
                        prop_assert_eq!(max, burst);
                        Answer::Never
                    }
                }
            };
            let mine = ours(&gcra, &mut direct_state, now, u64::from(cost), true);
            prop_assert_eq!(
                mine, theirs,
                "direct, step {} at governor {} / ours {}: cost {}", i, g_now, now, cost
            );

            // The keyed limiter, one of two keys.
            let key = s.key;
            let theirs = if cost == 1 && s.single {
                match keyed.check_key(&key) {
                    Ok(()) => Answer::Allow(None),
                    Err(not_until) => {
                        Answer::Deny(not_until.wait_time_from(clock.now()).as_nanos() as u64)
                    }
                }
            } else {
                match keyed.check_key_n(&key, n) {
                    Ok(Ok(())) => Answer::Allow(None),
                    Ok(Err(not_until)) => {
                        Answer::Deny(not_until.wait_time_from(clock.now()).as_nanos() as u64)
                    }
                    Err(InsufficientCapacity(_)) => Answer::Never,
                }
            };
            let mine = ours(&gcra, &mut keyed_state[usize::from(key)], now, u64::from(cost), false);
            prop_assert_eq!(
                mine, theirs,
                "key {}, step {} at governor {} / ours {}: cost {}", key, i, g_now, now, cost
            );

            hint = match mine {
                Answer::Deny(wait) => wait,
                _ => gcra.decide(&mut direct_state.clone(), now, 0).reset_after,
            };
        }
    }
}
