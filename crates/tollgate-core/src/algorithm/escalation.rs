//! An escalation ladder: repeated violations block a key for a growing
//! time.

use std::time::Duration;

use crate::clock::duration_to_nanos;
use crate::config::ConfigError;

/// An escalation ladder against abuse (credential stuffing, scraping).
///
/// A key earns a **strike** each time it is refused for being over a
/// limit. `strikes` strikes within `period` (counted from the first)
/// **block** the key: the first block lasts `block`, each block after it
/// twice as long as the last, up to `max_block`. While blocked, a key is
/// refused without its limits being asked, and earns no strikes. A key
/// that stays out of trouble for as long as the longest block after its
/// last block ended (or `period`, if longer) starts again from the first
/// step.
///
/// ```
/// use std::time::Duration;
/// use tollgate_core::algorithm::{Escalation, EscalationState, Strike};
///
/// let minute = Duration::from_secs(60);
/// let ladder = Escalation::new(3, 15 * minute, 15 * minute, 24 * 60 * minute)?;
/// let (mut s, ns) = (EscalationState::default(), 1_000_000_000u64);
/// assert_eq!(ladder.strike(&mut s, 0), Strike::Counted { strikes: 1 });
/// assert_eq!(ladder.strike(&mut s, ns), Strike::Counted { strikes: 2 });
/// // The third strike blocks for 15 minutes...
/// assert_eq!(ladder.strike(&mut s, 2 * ns), Strike::Blocked { for_ns: 900 * ns, level: 1 });
/// assert_eq!(ladder.blocked(&s, 3 * ns), Some(899 * ns));
/// // ...and the next block, 30.
/// let after = 902 * ns;
/// for i in 0..2 {
///     ladder.strike(&mut s, after + i);
/// }
/// assert_eq!(ladder.strike(&mut s, after + 2), Strike::Blocked { for_ns: 1_800 * ns, level: 2 });
/// # Ok::<(), tollgate_core::ConfigError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Escalation {
    strikes: u32,
    period: u64,
    block: u64,
    max_block: u64,
    forgive: u64,
}

/// A key's place on the ladder. `since` and `until` are in the store's
/// clock (nanoseconds).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EscalationState {
    /// Strikes in the current period.
    pub strikes: u32,
    /// Blocks so far (the next block is `block × 2^level`).
    pub level: u32,
    /// When the current period of strikes began.
    pub since: u64,
    /// When the last block ends (or ended).
    pub until: u64,
}

/// What a strike came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strike {
    /// Counted: `strikes` in the current period, short of a block.
    Counted {
        /// Strikes in the current period, this one included.
        strikes: u32,
    },
    /// The key is blocked for `for_ns` more nanoseconds: this strike
    /// started a block (of `level`), or one was already running (then no
    /// strike was counted).
    Blocked {
        /// Nanoseconds until the block ends.
        for_ns: u64,
        /// How many blocks the key has had, this one included.
        level: u32,
    },
}

impl Escalation {
    /// The most strikes a ladder may ask for.
    pub const MAX_STRIKES: u32 = 1_000;

    /// A ladder: `strikes` (1 to 1,000) strikes within `period` block for
    /// `block`, doubling per block up to `max_block` (at least `block`).
    /// Errors name the field.
    pub fn new(
        strikes: u32,
        period: Duration,
        block: Duration,
        max_block: Duration,
    ) -> Result<Self, ConfigError> {
        if strikes == 0 || strikes > Self::MAX_STRIKES {
            return Err(ConfigError::new(
                "strikes",
                format!("must be 1 to {}", Self::MAX_STRIKES),
            ));
        }
        let period = duration_to_nanos(period);
        if period == 0 {
            return Err(ConfigError::new("period", "must be longer than zero"));
        }
        let block = duration_to_nanos(block);
        if block == 0 {
            return Err(ConfigError::new("block", "must be longer than zero"));
        }
        let max_block = duration_to_nanos(max_block);
        if max_block < block {
            return Err(ConfigError::new("max_block", "must be at least block"));
        }
        Ok(Self {
            strikes,
            period,
            block,
            max_block,
            forgive: max_block.max(period),
        })
    }

    /// Strikes that block.
    pub fn strikes(&self) -> u32 {
        self.strikes
    }

    /// The period strikes are counted over, in nanoseconds.
    pub fn period(&self) -> u64 {
        self.period
    }

    /// The first block, in nanoseconds.
    pub fn block(&self) -> u64 {
        self.block
    }

    /// The longest block, in nanoseconds.
    pub fn max_block(&self) -> u64 {
        self.max_block
    }

    /// How long after its last block a key starts from the first step
    /// again, in nanoseconds.
    pub fn forgive(&self) -> u64 {
        self.forgive
    }

    /// The block of `level` (1 for the first), in nanoseconds.
    pub fn block_of(&self, level: u32) -> u64 {
        let doublings = level.saturating_sub(1).min(63);
        self.block
            .saturating_mul(1u64 << doublings)
            .min(self.max_block)
    }

    /// Nanoseconds `state` stays blocked at `now`, if it is.
    pub fn blocked(&self, state: &EscalationState, now: u64) -> Option<u64> {
        (state.until > now).then(|| state.until.saturating_sub(now))
    }

    /// A violation at `now`: counts a strike, and blocks when it is the
    /// last the ladder allows in its period.
    pub fn strike(&self, state: &mut EscalationState, now: u64) -> Strike {
        if let Some(for_ns) = self.blocked(state, now) {
            return Strike::Blocked {
                for_ns,
                level: state.level,
            };
        }
        // Out of trouble for long enough: back to the first step.
        if state.level > 0 && now >= state.until.saturating_add(self.forgive) {
            state.level = 0;
        }
        if state.strikes == 0 || now.saturating_sub(state.since) >= self.period {
            state.strikes = 0;
            state.since = now;
        }
        state.strikes = state.strikes.saturating_add(1);
        if state.strikes < self.strikes {
            return Strike::Counted {
                strikes: state.strikes,
            };
        }
        state.level = state.level.saturating_add(1);
        let for_ns = self.block_of(state.level);
        state.until = now.saturating_add(for_ns);
        state.strikes = 0;
        state.since = now;
        Strike::Blocked {
            for_ns,
            level: state.level,
        }
    }

    /// Whether `state` carries nothing at `now`: no block running, no
    /// strike in its period, and no block level left to forgive.
    pub fn is_idle(&self, state: &EscalationState, now: u64) -> bool {
        self.blocked(state, now).is_none()
            && (state.strikes == 0 || now.saturating_sub(state.since) >= self.period)
            && (state.level == 0 || now >= state.until.saturating_add(self.forgive))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    fn ladder() -> Escalation {
        Escalation::new(
            3,
            Duration::from_secs(60),
            Duration::from_secs(10),
            Duration::from_secs(35),
        )
        .unwrap()
    }

    #[test]
    fn strikes_within_a_period_block_for_a_doubling_time_up_to_the_cap() {
        let l = ladder();
        let mut s = EscalationState::default();
        let mut now = S;
        let mut blocks = Vec::new();
        for _ in 0..4 {
            for _ in 0..2 {
                assert!(matches!(l.strike(&mut s, now), Strike::Counted { .. }));
            }
            match l.strike(&mut s, now) {
                Strike::Blocked { for_ns, level } => blocks.push((for_ns / S, level)),
                other => panic!("{other:?}"),
            }
            // While blocked: refused, and no strikes counted.
            assert!(l.blocked(&s, now + S).is_some());
            assert_eq!(
                l.strike(&mut s, now + S),
                Strike::Blocked {
                    for_ns: s.until - now - S,
                    level: s.level
                }
            );
            now = s.until;
            assert_eq!(l.blocked(&s, now), None, "released at the end");
        }
        assert_eq!(blocks, vec![(10, 1), (20, 2), (35, 3), (35, 4)]);
    }

    #[test]
    fn strikes_lapse_with_their_period_and_blocks_are_forgiven() {
        let l = ladder();
        let mut s = EscalationState::default();
        l.strike(&mut s, 0);
        l.strike(&mut s, S);
        // The period began at 0: at 60 s it starts again.
        assert_eq!(l.strike(&mut s, 60 * S), Strike::Counted { strikes: 1 });
        for t in [61, 62] {
            l.strike(&mut s, t * S);
        }
        assert_eq!(s.level, 1);
        assert!(!l.is_idle(&s, 70 * S));
        // Forgiven 60 s (the period, longer than the 35 s cap) after the
        // block ended at 72 s: the next block is the first again.
        let later = 72 * S + 60 * S;
        assert!(l.is_idle(&s, later));
        for t in 0..2 {
            l.strike(&mut s, later + t);
        }
        assert_eq!(
            l.strike(&mut s, later + 2),
            Strike::Blocked {
                for_ns: 10 * S,
                level: 1
            }
        );
    }

    #[test]
    fn configuration_errors_name_the_field_and_extremes_do_not_overflow() {
        let d = Duration::from_secs;
        assert_eq!(
            Escalation::new(0, d(1), d(1), d(1)).unwrap_err().field(),
            "strikes"
        );
        assert_eq!(
            Escalation::new(1_001, d(1), d(1), d(1))
                .unwrap_err()
                .field(),
            "strikes"
        );
        assert_eq!(
            Escalation::new(1, d(0), d(1), d(1)).unwrap_err().field(),
            "period"
        );
        assert_eq!(
            Escalation::new(1, d(1), d(0), d(1)).unwrap_err().field(),
            "block"
        );
        assert_eq!(
            Escalation::new(1, d(1), d(2), d(1)).unwrap_err().field(),
            "max_block"
        );
        let l = Escalation::new(1, Duration::MAX, Duration::MAX, Duration::MAX).unwrap();
        let mut s = EscalationState::default();
        for now in [0, u64::MAX - 1, u64::MAX] {
            let _ = l.strike(&mut s, now);
            let _ = l.is_idle(&s, now);
        }
        assert_eq!(l.block_of(u32::MAX), l.max_block());
    }
}
