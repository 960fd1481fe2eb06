//! A circuit breaker: stop calling a Redis that keeps failing, probe it
//! now and then, and go back to it as soon as it answers.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Monotonic nanoseconds for the breaker (the store passes them in, so
/// tests can pass their own).
pub(crate) fn now_nanos() -> u64 {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    let origin = *ORIGIN.get_or_init(Instant::now);
    u64::try_from(origin.elapsed().as_nanos())
        .unwrap_or(u64::MAX)
        .saturating_add(1)
}

#[derive(Debug)]
pub(crate) struct Breaker {
    threshold: u32,
    cooldown: u64,
    failures: AtomicU32,
    /// 0: closed. Otherwise the instant until which calls are skipped.
    open_until: AtomicU64,
    probing: AtomicBool,
}

/// What the breaker lets a call do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pass {
    /// Call Redis.
    Call,
    /// Call Redis as the one probe of an open breaker.
    Probe,
    /// Do not call Redis.
    Skip,
}

impl Breaker {
    pub(crate) fn new(threshold: u32, cooldown: Duration) -> Self {
        Self {
            threshold: threshold.max(1),
            cooldown: u64::try_from(cooldown.as_nanos()).unwrap_or(u64::MAX),
            failures: AtomicU32::new(0),
            open_until: AtomicU64::new(0),
            probing: AtomicBool::new(false),
        }
    }

    pub(crate) fn pass(&self, now: u64) -> Pass {
        let until = self.open_until.load(Ordering::Acquire);
        if until == 0 {
            return Pass::Call;
        }
        if now < until {
            return Pass::Skip;
        }
        match self
            .probing
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => Pass::Probe,
            Err(_) => Pass::Skip,
        }
    }

    pub(crate) fn success(&self, pass: Pass) {
        self.failures.store(0, Ordering::Release);
        if pass == Pass::Probe || self.open_until.load(Ordering::Acquire) != 0 {
            self.open_until.store(0, Ordering::Release);
            self.probing.store(false, Ordering::Release);
        }
    }

    /// Records a failure; returns whether it opened the breaker (closed
    /// until now: a failed probe, or failures of calls that were in flight
    /// when it opened, keep it open and say so only once).
    pub(crate) fn failure(&self, pass: Pass, now: u64) -> bool {
        let failures = self
            .failures
            .fetch_add(1, Ordering::AcqRel)
            .saturating_add(1);
        if pass == Pass::Probe || failures >= self.threshold {
            let was = self
                .open_until
                .swap(now.saturating_add(self.cooldown), Ordering::AcqRel);
            self.probing.store(false, Ordering::Release);
            return was == 0;
        }
        false
    }

    /// Takes a pass that settles itself: dropped before `success` or
    /// `failure` (the call was cancelled), a probe gives its place back, so
    /// the breaker can never be left waiting for a probe that will not
    /// report.
    pub(crate) fn enter(&self, now: u64) -> Attempt<'_> {
        Attempt {
            breaker: self,
            pass: self.pass(now),
            settled: false,
        }
    }

    pub(crate) fn is_open(&self) -> bool {
        self.open_until.load(Ordering::Acquire) != 0
    }
}

/// A pass that settles itself; see [`Breaker::enter`].
#[derive(Debug)]
pub(crate) struct Attempt<'a> {
    breaker: &'a Breaker,
    pass: Pass,
    settled: bool,
}

impl Attempt<'_> {
    pub(crate) fn pass(&self) -> Pass {
        self.pass
    }

    pub(crate) fn success(mut self) {
        self.settled = true;
        self.breaker.success(self.pass);
    }

    /// Records a failure; returns whether the breaker (re)opened.
    pub(crate) fn failure(mut self, now: u64) -> bool {
        self.settled = true;
        self.breaker.failure(self.pass, now)
    }
}

impl Drop for Attempt<'_> {
    fn drop(&mut self) {
        // A probe whose caller went away says nothing about Redis: free the
        // probe's place so the next call probes, and leave the rest as is.
        if !self.settled && self.pass == Pass::Probe {
            self.breaker.probing.store(false, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn opens_after_threshold_and_probes_once_after_cooldown() {
        let b = Breaker::new(2, Duration::from_millis(20));
        assert_eq!(b.pass(0), Pass::Call);
        assert!(!b.failure(Pass::Call, 0));
        assert!(b.failure(Pass::Call, MS), "it opens");
        // Calls that were in flight fail too: it was open already (the
        // fault is logged once, not once each).
        assert!(!b.failure(Pass::Call, MS));
        assert_eq!(b.pass(20 * MS), Pass::Skip);
        assert_eq!(b.pass(21 * MS), Pass::Probe);
        assert_eq!(b.pass(21 * MS), Pass::Skip, "only one probe at a time");
        assert!(
            !b.failure(Pass::Probe, 22 * MS),
            "a failed probe keeps it open"
        );
        assert_eq!(b.pass(41 * MS), Pass::Skip);
        let p = b.pass(42 * MS);
        assert_eq!(p, Pass::Probe);
        b.success(p);
        assert_eq!(b.pass(42 * MS), Pass::Call);
        assert!(!b.is_open());
    }

    #[test]
    fn a_cancelled_probe_does_not_leave_the_breaker_stuck() {
        let b = Breaker::new(1, Duration::ZERO);
        b.failure(Pass::Call, 1);
        let attempt = b.enter(1);
        assert_eq!(attempt.pass(), Pass::Probe);
        drop(attempt); // the caller's future was dropped mid-call
                       // The next attempt may probe again rather than skip forever.
        let again = b.enter(now_nanos().saturating_add(1));
        assert_eq!(again.pass(), Pass::Probe);
        again.success();
        assert_eq!(b.pass(1), Pass::Call);
    }
}
