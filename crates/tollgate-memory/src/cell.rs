//! How a table holds one key's state: a lone atomic word for one-word
//! states, a mutex for the rest.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use tollgate_core::{
    FixedWindow, Gcra, LeakyBucket, RateAlgorithm, SlidingWindowBuckets, SlidingWindowCounter,
    SlidingWindowLog, TokenBucket,
};

/// A container for one key's state.
pub(crate) trait Cell<S>: Send + Sync + 'static {
    fn new(state: S) -> Self;
    /// Runs `f` on the state and stores the result atomically.
    fn update<R>(&self, f: impl FnMut(&mut S) -> R) -> R;
    /// Reads the state (for idleness checks).
    fn with<R>(&self, f: impl FnOnce(&S) -> R) -> R;
    /// [`update`](Self::update) with the cell held exclusively (under its
    /// shard's write lock): no locking of its own.
    fn update_mut<R>(&mut self, f: impl FnMut(&mut S) -> R) -> R;
}

impl Cell<u64> for AtomicU64 {
    fn new(state: u64) -> Self {
        AtomicU64::new(state)
    }

    /// Governor's trick ([`update_word`](tollgate_core::update_word)):
    /// compute on a copy, publish with one compare-and-swap.
    #[inline]
    fn update<R>(&self, f: impl FnMut(&mut u64) -> R) -> R {
        tollgate_core::update_word(self, f)
    }

    #[inline]
    fn with<R>(&self, f: impl FnOnce(&u64) -> R) -> R {
        f(&self.load(Ordering::Acquire))
    }

    #[inline]
    fn update_mut<R>(&mut self, mut f: impl FnMut(&mut u64) -> R) -> R {
        f(self.get_mut())
    }
}

impl<S: Send + 'static> Cell<S> for Mutex<S> {
    fn new(state: S) -> Self {
        Mutex::new(state)
    }

    fn update<R>(&self, mut f: impl FnMut(&mut S) -> R) -> R {
        // The closures never panic, but a poisoned lock must not take the
        // limiter down with it.
        f(&mut self.lock().unwrap_or_else(PoisonError::into_inner))
    }

    fn with<R>(&self, f: impl FnOnce(&S) -> R) -> R {
        f(&self.lock().unwrap_or_else(PoisonError::into_inner))
    }

    #[inline]
    fn update_mut<R>(&mut self, mut f: impl FnMut(&mut S) -> R) -> R {
        f(self.get_mut().unwrap_or_else(PoisonError::into_inner))
    }
}

/// Which cell an algorithm's state lives in.
pub(crate) trait Stored: RateAlgorithm {
    type Cell: Cell<Self::State>;
}

impl Stored for Gcra {
    type Cell = AtomicU64;
}
impl Stored for TokenBucket {
    type Cell = AtomicU64;
}
impl Stored for FixedWindow {
    type Cell = AtomicU64;
}
impl Stored for LeakyBucket {
    type Cell = AtomicU64;
}
impl Stored for SlidingWindowCounter {
    type Cell = Mutex<Self::State>;
}
impl Stored for SlidingWindowBuckets {
    type Cell = Mutex<Self::State>;
}
impl Stored for SlidingWindowLog {
    type Cell = Mutex<Self::State>;
}
