//! Escalation ladders: strikes and checks on a manual clock, answered as
//! the pure ladder answers them.

use std::collections::HashMap;
use std::time::Duration;

use super::Lcg;
use crate::algorithm::{EscalationState, Strike};
use crate::{EscalationRule, ManualClock, Store};

/// Runs the escalation scenarios on stores from `make`, at [`super::START`]
/// and at [`super::UNIX_2026`].
pub async fn run_escalation<S: Store>(make: impl Fn(ManualClock) -> S) {
    for start in [super::START, super::UNIX_2026] {
        for seed in [1, 0xbeef] {
            let clock = ManualClock::starting_at(start);
            escalation_random_trace(&make(clock.clone()), &clock, seed).await;
        }
    }
}

/// Random strikes and checks over three keys, the clock moving by steps
/// from 1 ms to 20 minutes: every answer as the pure ladder's, blocks of
/// several levels and forgiveness included.
pub async fn escalation_random_trace<S: Store>(store: &S, clock: &ManualClock, seed: u64) {
    let minute = Duration::from_secs(60);
    let rule = EscalationRule::new("ladder", 3, 2 * minute, minute, 8 * minute).unwrap();
    let ladder = store.escalation(&rule).unwrap();
    let pure = *rule.escalation();
    let mut states: HashMap<u64, EscalationState> = HashMap::new();
    let mut rng = Lcg(seed);
    // Mostly short steps (a key keeps misbehaving and climbs), now and
    // then 20 minutes (longer than the 8 forgiving it).
    let steps_ms = [0, 1, 1_000, 5_000, 30_000, 60_000];
    let (mut blocks, mut highest) = (0, 0);
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
            let got = ladder.blocked(&key).await.unwrap();
            assert_eq!(
                got,
                pure.blocked(state, now),
                "step {step}: check of {key:?}"
            );
        } else {
            let got = ladder.strike(&key).await.unwrap();
            let want = pure.strike(state, now);
            assert_eq!(got, want, "step {step}: strike of {key:?} at {now}");
            if let Strike::Blocked { level, .. } = want {
                blocks += 1;
                highest = highest.max(level);
            }
        }
    }
    assert!(
        blocks > 10 && highest >= 3,
        "a dull trace: {blocks} blocks, top level {highest}"
    );
}
