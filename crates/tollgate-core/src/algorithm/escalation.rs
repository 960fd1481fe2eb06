//! An escalation ladder: repeated violations block a key for a growing
//! time, or lower its rate step by step.

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
///
/// A ladder made with [`slow_down`](Self::slow_down) lowers the key's
/// rate instead of blocking it: see there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Escalation {
    strikes: u32,
    period: u64,
    /// The first block; a slowing ladder's hold of each step.
    block: u64,
    max_block: u64,
    forgive: u64,
    /// A slowing ladder's steps (percent of the rate), `len` of them;
    /// none for a ladder that blocks.
    steps: [u8; Escalation::MAX_STEPS],
    len: u8,
}

/// A key's place on the ladder. `since` and `until` are in the store's
/// clock (nanoseconds).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EscalationState {
    /// Strikes in the current period.
    pub strikes: u32,
    /// Blocks so far (the next block is `block × 2^level`); on a slowing
    /// ladder, the step the key was put on last.
    pub level: u32,
    /// When the current period of strikes began.
    pub since: u64,
    /// When the last block ends (or ended); on a slowing ladder, when
    /// step `level` ends (the key then climbs back one step per hold).
    pub until: u64,
}

/// Where a key stands on a ladder now, as a check finds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Standing {
    /// Neither blocked nor slowed.
    Clear,
    /// Blocked for `for_ns` more nanoseconds.
    Blocked {
        /// Nanoseconds until the block ends.
        for_ns: u64,
    },
    /// Slowed to step `level` (1 for the first) of a slowing ladder, for
    /// `for_ns` more nanoseconds before it climbs back one step.
    Slowed {
        /// The step in force (1 for the first).
        level: u32,
        /// Nanoseconds until the key climbs back one step.
        for_ns: u64,
    },
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
    /// A slowing ladder put the key on step `level` for `for_ns`
    /// nanoseconds (this strike was the last its period allows).
    Slowed {
        /// Nanoseconds until the key climbs back one step.
        for_ns: u64,
        /// The step the key is on now (1 for the first).
        level: u32,
    },
}

impl Escalation {
    /// The most strikes a ladder may ask for.
    pub const MAX_STRIKES: u32 = 1_000;

    /// The most steps a slowing ladder may have.
    pub const MAX_STEPS: usize = 8;

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
            steps: [0; Self::MAX_STEPS],
            len: 0,
        })
    }

    /// A ladder that lowers a key's rate instead of blocking it (000 §7:
    /// "on repeated overruns we lower the limit"). `strikes` strikes
    /// within `period` put the key one step down `steps` — each the
    /// percent of the rate it keeps, e.g. `[50, 25]` — for `hold`; past
    /// the last step, more strikes keep the key there for another `hold`.
    /// Once its hold ends, a key climbs back one step per `hold` until it
    /// has its whole rate again. A slowed key is still decided by its
    /// limit, at a cost raised to match: on a step keeping `p` percent,
    /// a request of cost `c` is charged `c × 100 / p`, so it gets `p`
    /// percent of the rate and of the burst.
    ///
    /// `steps`: 1 to [`MAX_STEPS`](Self::MAX_STEPS) percentages, each
    /// below the one before and each a whole share of the rate (one that
    /// divides 100: 50, 25, 20, 10, 5, 4, 2 or 1), so that the charge is
    /// exact and a key is shown what it gets. Errors name the field.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate_core::algorithm::{Escalation, EscalationState, Standing, Strike};
    ///
    /// let minute = Duration::from_secs(60);
    /// let ladder = Escalation::slow_down(2, minute, 10 * minute, &[50, 25])?;
    /// let (mut s, ns) = (EscalationState::default(), 1_000_000_000u64);
    /// ladder.strike(&mut s, 0);
    /// assert_eq!(ladder.strike(&mut s, ns), Strike::Slowed { for_ns: 600 * ns, level: 1 });
    /// // Half the rate: a request of cost 1 is charged 2.
    /// assert_eq!(ladder.charge(1, 1), 2);
    /// ladder.strike(&mut s, 2 * ns);
    /// assert_eq!(ladder.strike(&mut s, 3 * ns), Strike::Slowed { for_ns: 600 * ns, level: 2 });
    /// // Ten minutes later, back to 50 %; ten more, the whole rate.
    /// assert_eq!(ladder.standing(&s, 603 * ns), Standing::Slowed { level: 1, for_ns: 600 * ns });
    /// assert_eq!(ladder.standing(&s, 1_203 * ns), Standing::Clear);
    /// # Ok::<(), tollgate_core::ConfigError>(())
    /// ```
    pub fn slow_down(
        strikes: u32,
        period: Duration,
        hold: Duration,
        steps: &[u8],
    ) -> Result<Self, ConfigError> {
        let bad = || {
            ConfigError::new(
                "steps",
                format!(
                    "must be 1 to {} percentages, each below the one before and dividing 100 \
                     (50, 25, 20, 10, 5, 4, 2, 1)",
                    Self::MAX_STEPS
                ),
            )
        };
        let mut kept = [0; Self::MAX_STEPS];
        if steps.is_empty() || steps.len() > Self::MAX_STEPS {
            return Err(bad());
        }
        let mut above = 100;
        for (slot, &p) in kept.iter_mut().zip(steps) {
            if p >= above || 100u8.checked_rem(p) != Some(0) {
                return Err(bad());
            }
            *slot = p;
            above = p;
        }
        let hold = duration_to_nanos(hold);
        if hold == 0 {
            return Err(ConfigError::new("hold", "must be longer than zero"));
        }
        let mut ladder = Self::new(
            strikes,
            period,
            Duration::from_nanos(hold),
            Duration::from_nanos(hold),
        )?;
        ladder.steps = kept;
        ladder.len = u8::try_from(steps.len()).map_err(|_| bad())?;
        Ok(ladder)
    }

    /// A slowing ladder's steps, in percent of the rate (empty for a
    /// ladder that blocks).
    pub fn steps(&self) -> &[u8] {
        self.steps.get(..usize::from(self.len)).unwrap_or_default()
    }

    /// Whether this ladder slows keys down (else it blocks them).
    pub fn slows(&self) -> bool {
        self.len > 0
    }

    /// The percent of the rate a key keeps on step `level` (100 at 0).
    pub fn percent(&self, level: u32) -> u8 {
        let Some(i) = level.checked_sub(1) else {
            return 100;
        };
        let i = usize::try_from(i).unwrap_or(usize::MAX);
        let steps = self.steps();
        steps.get(i).or(steps.last()).copied().unwrap_or(100)
    }

    /// What a request of `cost` is charged on step `level`:
    /// `cost × 100 / percent`, saturating.
    pub fn charge(&self, cost: u64, level: u32) -> u64 {
        let share = 100u64
            .checked_div(u64::from(self.percent(level)))
            .unwrap_or(1);
        cost.saturating_mul(share)
    }

    /// `units` of the whole rate as a key on step `level` sees them (its
    /// limit and what remains, in its headers): `⌊units × percent / 100⌋`.
    pub fn shown(&self, units: u64, level: u32) -> u64 {
        let shown = u128::from(units).saturating_mul(u128::from(self.percent(level))) / 100;
        u64::try_from(shown).unwrap_or(u64::MAX)
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

    /// Nanoseconds `state` stays blocked at `now`, if it is (never, on a
    /// slowing ladder).
    pub fn blocked(&self, state: &EscalationState, now: u64) -> Option<u64> {
        (!self.slows() && state.until > now).then(|| state.until.saturating_sub(now))
    }

    /// A slowing ladder's step in force at `now` and when it ends: the
    /// step `state` was put on, less one per hold since its hold ended.
    /// `(0, 0)` when the key has its whole rate.
    fn in_force(&self, state: &EscalationState, now: u64) -> (u32, u64) {
        // A state left by a ladder with more steps counts from this one's
        // last.
        let level = state.level.min(u32::from(self.len));
        if level == 0 {
            return (0, 0);
        }
        let Some(past) = now.checked_sub(state.until) else {
            return (level, state.until);
        };
        let climbed = past.checked_div(self.block).unwrap_or(0).saturating_add(1);
        match u32::try_from(climbed) {
            Ok(climbed) if climbed < level => (
                level.saturating_sub(climbed),
                state
                    .until
                    .saturating_add(u64::from(climbed).saturating_mul(self.block)),
            ),
            _ => (0, 0),
        }
    }

    /// Where `state` stands at `now`.
    pub fn standing(&self, state: &EscalationState, now: u64) -> Standing {
        if !self.slows() {
            return match self.blocked(state, now) {
                Some(for_ns) => Standing::Blocked { for_ns },
                None => Standing::Clear,
            };
        }
        match self.in_force(state, now) {
            (0, _) => Standing::Clear,
            (level, until) => Standing::Slowed {
                level,
                for_ns: until.saturating_sub(now),
            },
        }
    }

    /// A violation at `now`: counts a strike, and blocks (or slows the key
    /// a step down) when it is the last the ladder allows in its period.
    pub fn strike(&self, state: &mut EscalationState, now: u64) -> Strike {
        if self.slows() {
            (state.level, state.until) = self.in_force(state, now);
            if !self.counted(state, now) {
                return Strike::Counted {
                    strikes: state.strikes,
                };
            }
            state.level = state.level.saturating_add(1).min(u32::from(self.len));
            state.until = now.saturating_add(self.block);
            return Strike::Slowed {
                for_ns: self.block,
                level: state.level,
            };
        }
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
        if !self.counted(state, now) {
            return Strike::Counted {
                strikes: state.strikes,
            };
        }
        state.level = state.level.saturating_add(1);
        let for_ns = self.block_of(state.level);
        state.until = now.saturating_add(for_ns);
        Strike::Blocked {
            for_ns,
            level: state.level,
        }
    }

    /// Counts a strike at `now` in the current period (a new one if it
    /// lapsed); `true` when it is the last the period allows, which starts
    /// the next period.
    fn counted(&self, state: &mut EscalationState, now: u64) -> bool {
        if state.strikes == 0 || now.saturating_sub(state.since) >= self.period {
            state.strikes = 0;
            state.since = now;
        }
        state.strikes = state.strikes.saturating_add(1);
        if state.strikes < self.strikes {
            return false;
        }
        state.strikes = 0;
        state.since = now;
        true
    }

    /// Whether `state` carries nothing at `now`: no block running and no
    /// step in force, no strike in its period, and no block level left to
    /// forgive.
    pub fn is_idle(&self, state: &EscalationState, now: u64) -> bool {
        let lapsed = state.strikes == 0 || now.saturating_sub(state.since) >= self.period;
        if self.slows() {
            return lapsed && self.in_force(state, now).0 == 0;
        }
        self.blocked(state, now).is_none()
            && lapsed
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

    fn slowing() -> Escalation {
        Escalation::slow_down(
            2,
            Duration::from_secs(60),
            Duration::from_secs(100),
            &[50, 25],
        )
        .unwrap()
    }

    #[test]
    fn a_slowing_ladder_steps_down_per_period_of_strikes_and_back_up_per_hold() {
        let l = slowing();
        let mut s = EscalationState::default();
        assert_eq!(l.strike(&mut s, 0), Strike::Counted { strikes: 1 });
        assert_eq!(
            l.strike(&mut s, S),
            Strike::Slowed {
                for_ns: 100 * S,
                level: 1
            }
        );
        // Never blocked: a slowed key is still decided by its limit.
        assert_eq!(l.blocked(&s, 2 * S), None);
        assert_eq!(
            l.standing(&s, 2 * S),
            Standing::Slowed {
                level: 1,
                for_ns: 99 * S
            }
        );
        l.strike(&mut s, 3 * S);
        assert_eq!(
            l.strike(&mut s, 4 * S),
            Strike::Slowed {
                for_ns: 100 * S,
                level: 2
            }
        );
        // Past the last step: held there for another hold.
        l.strike(&mut s, 50 * S);
        assert_eq!(
            l.strike(&mut s, 51 * S),
            Strike::Slowed {
                for_ns: 100 * S,
                level: 2
            }
        );
        // The hold ends at 151 s: one step back per 100 s.
        assert_eq!(
            l.standing(&s, 150 * S),
            Standing::Slowed {
                level: 2,
                for_ns: S
            }
        );
        assert_eq!(
            l.standing(&s, 151 * S),
            Standing::Slowed {
                level: 1,
                for_ns: 100 * S
            }
        );
        assert!(!l.is_idle(&s, 250 * S));
        assert_eq!(l.standing(&s, 251 * S), Standing::Clear);
        assert!(l.is_idle(&s, 251 * S));
        // A state from a ladder of more steps counts from this one's last.
        let deeper = EscalationState {
            level: 5,
            until: 300 * S,
            ..EscalationState::default()
        };
        assert_eq!(
            l.standing(&deeper, 350 * S),
            Standing::Slowed {
                level: 1,
                for_ns: 50 * S
            }
        );
        // Struck again on step 1 (in force at 200 s): down to 2 again.
        let mut t = s;
        l.strike(&mut t, 200 * S);
        assert_eq!(
            l.strike(&mut t, 201 * S),
            Strike::Slowed {
                for_ns: 100 * S,
                level: 2
            }
        );
    }

    #[test]
    fn a_slowed_key_is_charged_its_share_of_the_rate_and_shown_it() {
        let l = slowing();
        assert_eq!((l.charge(1, 0), l.charge(1, 1), l.charge(1, 2)), (1, 2, 4));
        assert_eq!(l.charge(3, 1), 6);
        // Beyond the last step, the last.
        assert_eq!(l.charge(1, 9), 4);
        assert_eq!(
            (l.shown(100, 0), l.shown(100, 1), l.shown(100, 2)),
            (100, 50, 25)
        );
        let tenth = Escalation::slow_down(1, Duration::from_secs(1), Duration::from_secs(1), &[10])
            .unwrap();
        assert_eq!((tenth.charge(1, 1), tenth.charge(3, 1)), (10, 30));
        assert_eq!(tenth.charge(u64::MAX, 1), u64::MAX);
        assert_eq!(tenth.shown(u64::MAX, 1), u64::MAX / 10);
        // What is shown fits exactly: 37 units hold 3 requests of 10.
        assert_eq!(tenth.shown(37, 1), 3);
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
        let slow = |steps: &[u8], hold| Escalation::slow_down(1, d(1), d(hold), steps);
        for steps in [
            &[][..],
            &[100],
            &[0],
            &[30],
            &[50, 50],
            &[25, 50],
            &[50, 25, 20, 10, 5, 4, 2, 1, 1],
        ] {
            assert_eq!(slow(steps, 1).unwrap_err().field(), "steps", "{steps:?}");
        }
        assert_eq!(slow(&[50], 0).unwrap_err().field(), "hold");
        assert_eq!(
            Escalation::slow_down(0, d(1), d(1), &[50])
                .unwrap_err()
                .field(),
            "strikes"
        );
        let l = Escalation::slow_down(1, Duration::MAX, Duration::MAX, &[50, 1]).unwrap();
        let mut s = EscalationState::default();
        for now in [0, u64::MAX - 1, u64::MAX] {
            let _ = l.strike(&mut s, now);
            let _ = l.standing(&s, now);
            let _ = l.is_idle(&s, now);
        }
    }
}
