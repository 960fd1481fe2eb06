//! Escalation ladders: strikes and checks on a manual clock, answered as
//! the pure ladder answers them.

use std::collections::HashMap;
use std::time::Duration;

use super::Lcg;
use crate::algorithm::{EscalationState, Standing, Strike};
use crate::{EscalationRule, ManualClock, Store};

/// Runs the escalation scenarios on stores from `make`, at [`super::START`]
/// and at [`super::UNIX_2026`]: a ladder that blocks and one that slows.
pub async fn run_escalation<S: Store>(make: impl Fn(ManualClock) -> S) {
    let minute = Duration::from_secs(60);
    let blocks = EscalationRule::new("ladder", 3, 2 * minute, minute, 8 * minute).unwrap();
    let slows =
        EscalationRule::slow_down("slows", 3, 2 * minute, 4 * minute, &[50, 25, 10]).unwrap();
    for start in [super::START, super::UNIX_2026] {
        for seed in [1, 0xbeef] {
            for rule in [&blocks, &slows] {
                let clock = ManualClock::starting_at(start);
                escalation_random_trace(&make(clock.clone()), &clock, rule, seed).await;
            }
        }
    }
}

/// Random strikes and checks over three keys on `rule`, the clock moving
/// by steps from 1 ms to 20 minutes: every answer as the pure ladder's,
/// blocks (or steps) of several levels and forgiveness (or the climb back)
/// included.
pub async fn escalation_random_trace<S: Store>(
    store: &S,
    clock: &ManualClock,
    rule: &EscalationRule,
    seed: u64,
) {
    let ladder = store.escalation(rule).unwrap();
    let pure = *rule.escalation();
    let mut states: HashMap<u64, EscalationState> = HashMap::new();
    let mut rng = Lcg(seed);
    // Mostly short steps (a key keeps misbehaving and climbs), now and
    // then 20 minutes (longer than the 8 forgiving it).
    let steps_ms = [0, 1, 1_000, 5_000, 30_000, 60_000];
    let (mut blocks, mut highest, mut climbed) = (0, 0, 0);
    for step in 0..600 {
        let ms = if rng.below(40) == 0 {
            1_200_000
        } else {
            steps_ms[usize::try_from(rng.below(steps_ms.len() as u64)).unwrap_or(0)]
        };
        clock.advance(Duration::from_millis(ms));
        let now = crate::Clock::now(clock);
        let k = rng.below(3);
        let key = [b'k', b'0' + u8::try_from(k).unwrap_or(0)];
        let state = states.entry(k).or_default();
        if rng.below(4) == 0 {
            let got = ladder.standing(&key).await.unwrap();
            let want = pure.standing(state, now);
            assert_eq!(got, want, "step {step}: check of {key:?}");
            if let Standing::Slowed { level, .. } = want {
                climbed = climbed.max(u32::from(level < state.level));
            }
        } else {
            let got = ladder.strike(&key).await.unwrap();
            let want = pure.strike(state, now);
            assert_eq!(got, want, "step {step}: strike of {key:?} at {now}");
            if let Strike::Blocked { level, .. } | Strike::Slowed { level, .. } = want {
                blocks += 1;
                highest = highest.max(level);
            }
        }
    }
    assert!(
        blocks > 10 && highest >= 3,
        "a dull trace: {blocks} blocks or steps, top level {highest}"
    );
    assert!(
        !pure.slows() || climbed > 0,
        "a dull trace: no slowed key seen climbing back"
    );
}
