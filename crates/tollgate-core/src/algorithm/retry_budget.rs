use std::time::Duration;

use crate::clock::duration_to_nanos;
use crate::ConfigError;

/// How many slots a budget's window is cut into: deposits lapse a slot at
/// a time, so a deposit counts for between 90 % and 100 % of the window.
pub const RETRY_SLOTS: usize = 10;

/// One unit of retry, in the budget's fixed-point units: a retry withdraws
/// this much; a call deposits `ratio × UNIT` (so a ratio is exact to a
/// thousandth, and 0.6 is 0.6 — tower's `TpsBudget` truncated a 0.6 ratio
/// so that it allowed one retry per request, tower#857).
pub const UNIT: u64 = 1_000;

/// Slots before the current one that are still in the window.
const SPAN: u64 = RETRY_SLOTS as u64 - 1;

/// A retry budget: retries stay under a share of recent calls plus a floor,
/// so a struggling upstream sees at most `1 + ratio` times its normal load
/// from retries, never `max_attempts` times — what turns an outage into a
/// retry storm.
///
/// Every call deposits `ratio`; every retry withdraws one; deposits lapse
/// after `window` (in [`RETRY_SLOTS`] steps). The floor — `min_per_second`
/// retries every second — lets a quiet client still retry. These are the
/// semantics and defaults of Finagle, Linkerd and tower's `TpsBudget`:
/// 20 % over 10 s, with a floor of 10 retries a second.
///
/// ```
/// use std::time::Duration;
/// use tollgate_core::{RetryBudget, RetryBudgetState};
///
/// // 20 % of calls, no floor.
/// let budget = RetryBudget::new(0.2, 0, Duration::from_secs(10))?;
/// let mut state = RetryBudgetState::default();
/// let now = 1_000_000_000;
/// for _ in 0..10 {
///     budget.deposit(&mut state, now);
/// }
/// assert!(budget.withdraw(&mut state, now));
/// assert!(budget.withdraw(&mut state, now));
/// assert!(!budget.withdraw(&mut state, now), "10 calls buy 2 retries");
/// // Ten seconds on, those calls have lapsed.
/// assert_eq!(budget.balance(&state, now + 10_000_000_000), 0);
/// # Ok::<(), tollgate_core::ConfigError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RetryBudget {
    /// Deposit per call, in thousandths of a retry.
    deposit: u64,
    /// The floor over the window, in thousandths of a retry.
    reserve: u64,
    /// Slot length in ns.
    slot: u64,
}

/// One slot of a [`RetryBudgetState`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct RetrySlot {
    /// The slot's index (`time / slot length`) plus one; 0 is unused.
    pub index: u64,
    /// Thousandths of a retry deposited in it.
    pub deposited: u64,
    /// Thousandths withdrawn in it.
    pub withdrawn: u64,
}

/// Per-key state of a [`RetryBudget`]: the window's slots.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct RetryBudgetState {
    /// The slots, indexed by slot index modulo [`RETRY_SLOTS`].
    pub slots: [RetrySlot; RETRY_SLOTS],
}

impl RetryBudget {
    /// Validates: `ratio` from 0 to 1000 (0 allows only the floor),
    /// `min_per_second` up to a million, `window` from 10 ms to a day, and
    /// a budget that can ever allow a retry. Errors name the field.
    pub fn new(ratio: f64, min_per_second: u32, window: Duration) -> Result<Self, ConfigError> {
        if !(0.0..=1_000.0).contains(&ratio) {
            return Err(ConfigError::new("ratio", "must be from 0 to 1000"));
        }
        if min_per_second > 1_000_000 {
            return Err(ConfigError::new(
                "min_per_second",
                "must be at most 1,000,000",
            ));
        }
        let window = duration_to_nanos(window);
        if !(10_000_000..=86_400_000_000_000).contains(&window) {
            return Err(ConfigError::new("window", "must be from 10 ms to 1 day"));
        }
        // Thousandths, rounded: exact for any ratio given to three places.
        let scaled = (ratio * UNIT as f64).round();
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let deposit = scaled as u64; // in 0..=10⁶ after the check above
        if deposit == 0 && min_per_second == 0 {
            return Err(ConfigError::new(
                "ratio",
                "with no floor (min_per_second 0), a ratio under 0.0005 never allows a retry",
            ));
        }
        let reserve = u128::from(min_per_second)
            .saturating_mul(u128::from(UNIT))
            .saturating_mul(u128::from(window))
            .checked_div(1_000_000_000)
            .unwrap_or(0);
        Ok(Self {
            deposit,
            reserve: u64::try_from(reserve).unwrap_or(u64::MAX),
            slot: window.checked_div(RETRY_SLOTS as u64).unwrap_or(1).max(1),
        })
    }

    /// The window's length in nanoseconds.
    pub fn window(&self) -> u64 {
        self.slot.saturating_mul(RETRY_SLOTS as u64)
    }

    /// The deposit per call, in thousandths of a retry.
    pub fn deposit_units(&self) -> u64 {
        self.deposit
    }

    /// The floor over the window, in thousandths of a retry.
    pub fn reserve_units(&self) -> u64 {
        self.reserve
    }

    fn index(&self, now: u64) -> u64 {
        now.checked_div(self.slot).unwrap_or(0).saturating_add(1)
    }

    /// Whether slot index `s` counts at slot index `index`: in the window,
    /// or later by less than a window (the clock went back a little, or a
    /// client's clock runs ahead). A slot a whole window or more ahead is
    /// a clock far off: it would otherwise keep counting until the clock
    /// caught up, and it does not count.
    fn counts(s: u64, index: u64) -> bool {
        s != 0 && s >= index.saturating_sub(SPAN) && s <= index.saturating_add(SPAN)
    }

    /// The slot `now` falls in, reset unless it is now's. (Another index
    /// at now's position is a whole window or more away, either way.)
    fn slot_mut<'a>(&self, state: &'a mut RetryBudgetState, now: u64) -> Option<&'a mut RetrySlot> {
        let index = self.index(now);
        let at = usize::try_from(index.checked_rem(RETRY_SLOTS as u64).unwrap_or(0)).unwrap_or(0);
        let slot = state.slots.get_mut(at)?;
        if slot.index != index {
            *slot = RetrySlot {
                index,
                deposited: 0,
                withdrawn: 0,
            };
        }
        Some(slot)
    }

    /// Thousandths of a retry available at `now`: the floor plus what the
    /// window's calls deposited, less what its retries withdrew.
    pub fn balance(&self, state: &RetryBudgetState, now: u64) -> u64 {
        let index = self.index(now);
        let (mut deposited, mut withdrawn) = (self.reserve, 0u64);
        for s in &state.slots {
            if Self::counts(s.index, index) {
                deposited = deposited.saturating_add(s.deposited);
                withdrawn = withdrawn.saturating_add(s.withdrawn);
            }
        }
        deposited.saturating_sub(withdrawn)
    }

    /// A call was made: deposit.
    pub fn deposit(&self, state: &mut RetryBudgetState, now: u64) {
        if let Some(slot) = self.slot_mut(state, now) {
            slot.deposited = slot.deposited.saturating_add(self.deposit);
        }
    }

    /// A retry is wanted: withdraws one retry and returns `true` if the
    /// balance allows it; `false` (and nothing changes) if not.
    pub fn withdraw(&self, state: &mut RetryBudgetState, now: u64) -> bool {
        if self.balance(state, now) < UNIT {
            return false;
        }
        match self.slot_mut(state, now) {
            Some(slot) => {
                slot.withdrawn = slot.withdrawn.saturating_add(UNIT);
                true
            }
            None => false,
        }
    }

    /// Whether `state` carries nothing at `now`: every slot has lapsed.
    pub fn is_idle(&self, state: &RetryBudgetState, now: u64) -> bool {
        let index = self.index(now);
        state.slots.iter().all(|s| !Self::counts(s.index, index))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn fractional_ratios_are_exact() {
        // 0.6: three retries per five calls, not one per call (tower#857).
        let b = RetryBudget::new(0.6, 0, Duration::from_secs(10)).unwrap();
        let mut s = RetryBudgetState::default();
        for _ in 0..5 {
            b.deposit(&mut s, S);
        }
        let granted = (0..5).filter(|_| b.withdraw(&mut s, S)).count();
        assert_eq!(granted, 3);
        let b = RetryBudget::new(0.25, 0, Duration::from_secs(10)).unwrap();
        let mut s = RetryBudgetState::default();
        for _ in 0..7 {
            b.deposit(&mut s, S);
        }
        assert_eq!((0..5).filter(|_| b.withdraw(&mut s, S)).count(), 1);
    }

    #[test]
    fn the_floor_allows_quiet_clients_to_retry_and_deposits_lapse() {
        let b = RetryBudget::new(0.2, 10, Duration::from_secs(10)).unwrap();
        let mut s = RetryBudgetState::default();
        // No calls at all: the floor is 10/s over 10 s.
        assert_eq!((0..200).filter(|_| b.withdraw(&mut s, S)).count(), 100);
        assert!(!b.withdraw(&mut s, S));
        // The withdrawals lapse with their window.
        assert!(b.withdraw(&mut s, 11 * S));
        assert!(b.is_idle(&RetryBudgetState::default(), S));
        assert!(!b.is_idle(&s, 11 * S));
        assert!(b.is_idle(&s, 30 * S));
    }

    /// The table in `tollgate::retry`'s docs: the floor is a reserve of
    /// `min_per_second × window` retries on top of the ratio.
    #[test]
    fn the_floor_is_a_reserve_on_top_of_the_share() {
        for (calls, retries) in [(200, 140), (2_000, 500), (20_000, 4_100)] {
            let b = RetryBudget::new(0.2, 10, Duration::from_secs(10)).unwrap();
            let mut s = RetryBudgetState::default();
            for _ in 0..calls {
                b.deposit(&mut s, S);
            }
            let granted = (0..calls).filter(|_| b.withdraw(&mut s, S)).count();
            assert_eq!(granted, retries, "{calls} calls");
        }
    }

    #[test]
    fn the_clock_going_back_keeps_what_was_withdrawn() {
        let b = RetryBudget::new(1.0, 0, Duration::from_secs(10)).unwrap();
        let mut s = RetryBudgetState::default();
        b.deposit(&mut s, 20 * S);
        assert!(b.withdraw(&mut s, 20 * S));
        // Back 5 s: the later slot still counts its withdrawal.
        assert!(!b.withdraw(&mut s, 15 * S));
    }

    #[test]
    fn a_slot_written_by_a_clock_far_ahead_neither_counts_nor_collects() {
        let b = RetryBudget::new(0.2, 0, Duration::from_secs(10)).unwrap();
        let mut s = RetryBudgetState::default();
        // A client whose clock is an hour ahead deposits there...
        let ahead = 3_600 * S + 5 * S;
        for _ in 0..100 {
            b.deposit(&mut s, ahead);
        }
        // ...clients on time neither see it nor add to it: 5 calls at 0.2
        // make one retry, and that lapses with the window, as always.
        assert_eq!(b.balance(&s, 5 * S), 0);
        for _ in 0..5 {
            b.deposit(&mut s, 5 * S);
        }
        assert!(b.withdraw(&mut s, 5 * S));
        assert!(!b.withdraw(&mut s, 5 * S));
        for _ in 0..50 {
            b.deposit(&mut s, 5 * S);
        }
        assert_eq!(b.balance(&s, 16 * S), 0, "deposits outlived their window");
    }

    #[test]
    fn configuration_errors_name_the_field() {
        let e = |r, m, w| RetryBudget::new(r, m, w).unwrap_err().field();
        let ten = Duration::from_secs(10);
        assert_eq!(e(-0.1, 10, ten), "ratio");
        assert_eq!(e(f64::NAN, 10, ten), "ratio");
        assert_eq!(e(0.0, 0, ten), "ratio");
        assert_eq!(e(0.2, 2_000_000, ten), "min_per_second");
        assert_eq!(e(0.2, 10, Duration::ZERO), "window");
        assert!(RetryBudget::new(0.0, 1, ten).is_ok());
        let b = RetryBudget::new(1_000.0, 1_000_000, Duration::from_secs(86_400)).unwrap();
        let mut s = RetryBudgetState::default();
        for t in [0, 1, u64::MAX] {
            b.deposit(&mut s, t);
            let _ = b.withdraw(&mut s, t);
            let _ = b.balance(&s, t);
        }
    }
}
