//! A small set-associative cache of recently used entries, for per-thread
//! caches on the request path (header values, route counters): a set of
//! ways is picked by a hash, and a new entry takes an empty way of its
//! set, else the least recently used. Any `WAYS` entries of one set stay
//! together whatever their hashes, so a few hot entries never take turns
//! evicting each other.

/// `N` entries in sets of `WAYS` (`N` a multiple of `WAYS`), each with
/// the tick of its last use.
pub(crate) struct Ways<T, const N: usize, const WAYS: usize> {
    /// Lookups made: the clock of "least recently used".
    tick: u64,
    ways: [Option<(u64, T)>; N],
}

impl<T, const N: usize, const WAYS: usize> Ways<T, N, WAYS> {
    /// The number of sets.
    pub(crate) const SETS: usize = N / WAYS;

    pub(crate) const fn new() -> Self {
        Self {
            tick: 0,
            ways: [const { None }; N],
        }
    }

    /// The set whose hash's top bits are `hash`'s (`SETS` a power of two).
    pub(crate) fn set_of(hash: u64) -> usize {
        usize::try_from(hash.wrapping_shr(64u32.wrapping_sub(Self::SETS.trailing_zeros())))
            .unwrap_or(0)
    }

    /// The ways of `set`.
    fn set(&mut self, set: usize) -> Option<&mut [Option<(u64, T)>]> {
        let first = set.checked_mul(WAYS)?;
        self.ways.get_mut(first..first.checked_add(WAYS)?)
    }

    /// Counts a lookup and returns the tick it is at.
    pub(crate) fn tick(&mut self) -> u64 {
        self.tick = self.tick.wrapping_add(1);
        self.tick
    }

    /// The entry of `set` that `is` accepts, marked used now (at the
    /// current tick).
    pub(crate) fn find(&mut self, set: usize, is: impl Fn(&T) -> bool) -> Option<&mut T> {
        let now = self.tick;
        let (used, entry) = self.set(set)?.iter_mut().flatten().find(|(_, e)| is(e))?;
        *used = now;
        Some(entry)
    }

    /// Puts `entry` in `set`, used now: in the way of the entry `is`
    /// accepts, else an empty way, else the least recently used one's.
    pub(crate) fn put(&mut self, set: usize, is: impl Fn(&T) -> bool, entry: T) -> Option<&mut T> {
        let now = self.tick;
        let ways = self.set(set)?;
        let at = match ways
            .iter()
            .position(|w| w.as_ref().is_some_and(|(_, e)| is(e)))
        {
            Some(at) => at,
            None => ways
                .iter()
                .enumerate()
                .min_by_key(|(_, w)| w.as_ref().map_or(0, |(used, _)| used.saturating_add(1)))
                .map(|(at, _)| at)?,
        };
        let way = ways.get_mut(at)?;
        *way = Some((now, entry));
        way.as_mut().map(|(_, e)| e)
    }
}

#[cfg(test)]
mod tests {
    use super::Ways;

    #[test]
    fn a_full_set_gives_up_its_least_recently_used_entry() {
        let mut w: Ways<u32, 8, 4> = Ways::new();
        for n in 0..4 {
            w.tick();
            w.put(1, |&e| e == n, n);
        }
        // 0 used again: 1 is now the least recently used.
        w.tick();
        assert_eq!(w.find(1, |&e| e == 0).copied(), Some(0));
        w.tick();
        w.put(1, |&e| e == 9, 9);
        assert!(w.find(1, |&e| e == 1).is_none());
        for n in [0, 2, 3, 9] {
            assert_eq!(w.find(1, |&e| e == n).copied(), Some(n));
        }
        // Another set is untouched, and an entry put again keeps one way.
        assert!(w.find(0, |_| true).is_none());
        w.tick();
        w.put(1, |&e| e == 9, 9);
        assert!(w.find(1, |&e| e == 2).is_some());
        assert_eq!(Ways::<u32, 8, 4>::SETS, 2);
        assert_eq!(Ways::<u32, 8, 4>::set_of(u64::MAX), 1);
    }
}
