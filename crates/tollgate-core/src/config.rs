//! Rule configuration, validated when a limiter is built.
//!
//! Nothing here panics: zero, overflowing and contradictory values are
//! returned as a [`ConfigError`] that names the field, so a bad config fails
//! at start-up, never at request time.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::algorithm::{
    FixedWindow, Gcra, LeakyBucket, Semaphore, SlidingWindowBuckets, SlidingWindowCounter,
    SlidingWindowLog, TokenBucket,
};
use crate::clock::duration_to_nanos;

/// A configuration value was rejected. The message names the field, and
/// where the field belongs to one item of a list (a policy's third rule),
/// [`item`](Self::item) says which.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    field: &'static str,
    message: Cow<'static, str>,
    item: Option<(&'static str, usize)>,
}

impl ConfigError {
    /// An error about `field`.
    pub fn new(field: &'static str, message: impl Into<Cow<'static, str>>) -> Self {
        Self {
            field,
            message: message.into(),
            item: None,
        }
    }

    /// The same error, about item `index` of the list `list` (`"rules"`,
    /// 2: the third rule). An error that names its item already keeps it.
    #[must_use]
    pub fn in_item(mut self, list: &'static str, index: usize) -> Self {
        self.item.get_or_insert((list, index));
        self
    }

    /// The offending field, e.g. `"burst"`.
    pub fn field(&self) -> &'static str {
        self.field
    }

    /// The list and index of the item the field belongs to, if any:
    /// `Some(("rules", 2))` for the third rule's field.
    pub fn item(&self) -> Option<(&'static str, usize)> {
        self.item
    }

    /// Why it was rejected.
    pub fn message(&self) -> &str {
        &self.message
    }
}

/// `invalid `burst`: must be at least 1`, or with its item,
/// `invalid `rules[2].burst`: must be at least 1`.
impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.item {
            Some((list, i)) => write!(f, "invalid `{list}[{i}].{}`: {}", self.field, self.message),
            None => write!(f, "invalid `{}`: {}", self.field, self.message),
        }
    }
}

impl std::error::Error for ConfigError {}

/// A steady rate: `amount` units every `period`.
///
/// Constructors never fail; the rate is checked when a rule is built
/// (an amount of zero, a zero period, or more than one unit per
/// nanosecond are errors).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Rate {
    /// Units per period.
    pub amount: u32,
    /// The period.
    pub period: Duration,
}

impl Rate {
    /// `amount` units every `period`.
    pub const fn new(amount: u32, period: Duration) -> Self {
        Self { amount, period }
    }
    /// `amount` units per second.
    pub const fn per_second(amount: u32) -> Self {
        Self::new(amount, Duration::from_secs(1))
    }
    /// `amount` units per minute.
    pub const fn per_minute(amount: u32) -> Self {
        Self::new(amount, Duration::from_secs(60))
    }
    /// `amount` units per hour.
    pub const fn per_hour(amount: u32) -> Self {
        Self::new(amount, Duration::from_secs(3_600))
    }
    /// `amount` units per day.
    pub const fn per_day(amount: u32) -> Self {
        Self::new(amount, Duration::from_secs(86_400))
    }

    /// Nanoseconds per unit, validated. `field` names the rate in errors.
    pub(crate) fn interval_nanos(&self, field: &'static str) -> Result<u64, ConfigError> {
        if self.amount == 0 {
            return Err(ConfigError::new(field, "amount must be at least 1"));
        }
        let period = duration_to_nanos(self.period);
        if period == 0 {
            return Err(ConfigError::new(field, "period must be longer than zero"));
        }
        match period.checked_div(u64::from(self.amount)) {
            Some(t) if t >= 1 => Ok(t),
            _ => Err(ConfigError::new(
                field,
                "more than one unit per nanosecond is not supported",
            )),
        }
    }
}

/// Which algorithm a rate rule uses, with its parameters (not yet
/// validated; [`Rule::new`] validates).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Limit {
    /// Generic cell rate algorithm: a smooth `rate` with bursts of up to
    /// `burst` (the same as a continuously refilled token bucket, in one
    /// 64-bit word).
    Gcra {
        /// The sustained rate.
        rate: Rate,
        /// The most that may be consumed at once from a full budget.
        burst: u32,
    },
    /// Token bucket with discrete refills (Envoy's model): holds up to
    /// `capacity` tokens and gains `refill` tokens at every multiple of
    /// `interval`.
    TokenBucket {
        /// Most tokens the bucket holds.
        capacity: u32,
        /// Tokens added at each refill.
        refill: u32,
        /// Time between refills.
        interval: Duration,
    },
    /// At most `limit` per aligned window of length `window`.
    FixedWindow {
        /// Units per window.
        limit: u32,
        /// Window length (at least 1 ms).
        window: Duration,
    },
    /// Sliding window counter: the previous window's count weighted by how
    /// much of it still overlaps the sliding window, plus the current one.
    SlidingWindowCounter {
        /// Units per window.
        limit: u32,
        /// Window length.
        window: Duration,
    },
    /// Sliding window of `buckets` counters, rotated exactly: at most
    /// `limit` in the last `buckets` buckets (see
    /// [`SlidingWindowBuckets`] for its error against a sliding log).
    SlidingWindowBuckets {
        /// Units per window.
        limit: u32,
        /// Window length (at least 1 ms a bucket).
        window: Duration,
        /// Buckets in the window (1 to `SlidingWindowBuckets::MAX_BUCKETS`).
        buckets: u32,
    },
    /// Sliding window log: exact, keeps one entry per admitted request
    /// (at most `limit` entries per key, `limit` at most
    /// `SlidingWindowLog::MAX_LIMIT`).
    SlidingWindowLog {
        /// Units per window.
        limit: u32,
        /// Window length.
        window: Duration,
    },
    /// Leaky bucket as a pacer: requests leave at `rate`; one that would
    /// wait longer than `max_delay` for its turn is denied. (The tollgate
    /// layer waits with tokio's timer: the runtime must have time enabled,
    /// as axum's and tonic's servers do. A request cancelled while it waits
    /// keeps its place in the queue.)
    LeakyBucket {
        /// The drain rate.
        rate: Rate,
        /// The longest a request may be delayed.
        max_delay: Duration,
    },
}

impl Limit {
    /// GCRA at `rate` with bursts of `burst`.
    pub const fn gcra(rate: Rate, burst: u32) -> Self {
        Self::Gcra { rate, burst }
    }
    /// A token bucket of `capacity`, adding `refill` tokens every `interval`.
    pub const fn token_bucket(capacity: u32, refill: u32, interval: Duration) -> Self {
        Self::TokenBucket {
            capacity,
            refill,
            interval,
        }
    }
    /// `limit` per fixed `window`.
    pub const fn fixed_window(limit: u32, window: Duration) -> Self {
        Self::FixedWindow { limit, window }
    }
    /// `limit` per sliding `window`, approximated by two counters.
    pub const fn sliding_window_counter(limit: u32, window: Duration) -> Self {
        Self::SlidingWindowCounter { limit, window }
    }
    /// `limit` per sliding `window` of `buckets` counters, each dropped
    /// whole once the window has passed it: memory O(`buckets`).
    pub const fn sliding_window_buckets(limit: u32, window: Duration, buckets: u32) -> Self {
        Self::SlidingWindowBuckets {
            limit,
            window,
            buckets,
        }
    }
    /// `limit` per sliding `window`, exact.
    pub const fn sliding_window_log(limit: u32, window: Duration) -> Self {
        Self::SlidingWindowLog { limit, window }
    }
    /// A pacer draining at `rate` that delays requests up to `max_delay`.
    pub const fn leaky_bucket(rate: Rate, max_delay: Duration) -> Self {
        Self::LeakyBucket { rate, max_delay }
    }
}

/// A validated algorithm with its parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(missing_docs)] // each variant is documented on its type
pub enum Algorithm {
    Gcra(Gcra),
    TokenBucket(TokenBucket),
    FixedWindow(FixedWindow),
    SlidingWindowCounter(SlidingWindowCounter),
    SlidingWindowBuckets(SlidingWindowBuckets),
    SlidingWindowLog(SlidingWindowLog),
    LeakyBucket(LeakyBucket),
}

impl Algorithm {
    /// Validates `limit`.
    pub fn new(limit: Limit) -> Result<Self, ConfigError> {
        Ok(match limit {
            Limit::Gcra { rate, burst } => Self::Gcra(Gcra::new(rate, burst)?),
            Limit::TokenBucket {
                capacity,
                refill,
                interval,
            } => Self::TokenBucket(TokenBucket::new(capacity, refill, interval)?),
            Limit::FixedWindow { limit, window } => {
                Self::FixedWindow(FixedWindow::new(limit, window)?)
            }
            Limit::SlidingWindowCounter { limit, window } => {
                Self::SlidingWindowCounter(SlidingWindowCounter::new(limit, window)?)
            }
            Limit::SlidingWindowBuckets {
                limit,
                window,
                buckets,
            } => Self::SlidingWindowBuckets(SlidingWindowBuckets::new(limit, window, buckets)?),
            Limit::SlidingWindowLog { limit, window } => {
                Self::SlidingWindowLog(SlidingWindowLog::new(limit, window)?)
            }
            Limit::LeakyBucket { rate, max_delay } => {
                Self::LeakyBucket(LeakyBucket::new(rate, max_delay)?)
            }
        })
    }

    /// Whether the keys' states of a rule that used `old` stay meaningful
    /// under `self`, so that a reloaded rule can go on from them: the same
    /// algorithm, with the parameters its state depends on unchanged.
    ///
    /// - GCRA and the leaky bucket store a time (when the key's budget is
    ///   whole again, or its queue's tail): any new rate, burst or delay
    ///   goes on from it. A key that had spent its budget is whole again
    ///   when it would have been under the old rule, then runs at the new
    ///   rate: such a reload grants no fresh burst — and a loosened rule
    ///   with a slow old rate keeps a spent key waiting up to the old
    ///   rule's window.
    /// - The token bucket stores a count of refills: it goes on when the
    ///   refill amount and interval stay. A new capacity applies at once:
    ///   raising it by `n` gives every key `n` more tokens.
    /// - The windows (fixed, sliding counter, sliding log) store counts of
    ///   the current window: they go on when the window's length stays (a
    ///   new limit applies to the counts so far).
    ///
    /// Anything else — another algorithm, another window length, another
    /// refill — starts from fresh states: every key's whole budget.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate_core::{Algorithm, Limit, Rate};
    ///
    /// let old = Algorithm::new(Limit::gcra(Rate::per_second(10), 20)).unwrap();
    /// let faster = Algorithm::new(Limit::gcra(Rate::per_second(50), 100)).unwrap();
    /// assert!(faster.keeps_state_of(&old));
    /// let window = Algorithm::new(Limit::fixed_window(10, Duration::from_secs(1))).unwrap();
    /// assert!(!window.keeps_state_of(&old));
    /// ```
    pub fn keeps_state_of(&self, old: &Algorithm) -> bool {
        match (self, old) {
            (Self::Gcra(a), Self::Gcra(b)) => a.state_shape() == b.state_shape(),
            (Self::TokenBucket(a), Self::TokenBucket(b)) => a.state_shape() == b.state_shape(),
            (Self::FixedWindow(a), Self::FixedWindow(b)) => a.state_shape() == b.state_shape(),
            (Self::SlidingWindowCounter(a), Self::SlidingWindowCounter(b)) => {
                a.state_shape() == b.state_shape()
            }
            (Self::SlidingWindowBuckets(a), Self::SlidingWindowBuckets(b)) => {
                a.state_shape() == b.state_shape()
            }
            (Self::SlidingWindowLog(a), Self::SlidingWindowLog(b)) => {
                a.state_shape() == b.state_shape()
            }
            (Self::LeakyBucket(a), Self::LeakyBucket(b)) => a.state_shape() == b.state_shape(),
            _ => false,
        }
    }

    /// Whether a refund made by `old`'s parameters gives back, on a state
    /// this algorithm now reads, what a refund of its own would: the same
    /// algorithm, or one whose refunds do not depend on what changed (a
    /// GCRA or leaky bucket of the same rate, whatever its burst or
    /// delay; a window of the same length, whatever its limit). A request
    /// decided before a reload that changed its rule refunds only then.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate_core::{Algorithm, Limit, Rate};
    ///
    /// let old = Algorithm::new(Limit::gcra(Rate::per_second(10), 20)).unwrap();
    /// let wider = Algorithm::new(Limit::gcra(Rate::per_second(10), 50)).unwrap();
    /// let faster = Algorithm::new(Limit::gcra(Rate::per_second(1_000), 20)).unwrap();
    /// assert!(wider.refunds_alike(&old));
    /// assert!(!faster.refunds_alike(&old));
    /// let window = Algorithm::new(Limit::fixed_window(10, Duration::from_secs(1))).unwrap();
    /// assert!(!window.refunds_alike(&old));
    /// ```
    pub fn refunds_alike(&self, old: &Algorithm) -> bool {
        if self == old {
            return true;
        }
        match (self, old) {
            (Self::Gcra(a), Self::Gcra(b)) => a.refund_shape() == b.refund_shape(),
            (Self::LeakyBucket(a), Self::LeakyBucket(b)) => a.refund_shape() == b.refund_shape(),
            (Self::FixedWindow(a), Self::FixedWindow(b)) => a.state_shape() == b.state_shape(),
            (Self::SlidingWindowCounter(a), Self::SlidingWindowCounter(b)) => {
                a.state_shape() == b.state_shape()
            }
            (Self::SlidingWindowBuckets(a), Self::SlidingWindowBuckets(b)) => {
                a.state_shape() == b.state_shape()
            }
            (Self::SlidingWindowLog(a), Self::SlidingWindowLog(b)) => {
                a.state_shape() == b.state_shape()
            }
            _ => false,
        }
    }

    /// The most that may be consumed at once (the `q` of `RateLimit-Policy`).
    pub fn capacity(&self) -> u64 {
        use crate::algorithm::RateAlgorithm as _;
        match self {
            Self::Gcra(a) => a.capacity(),
            Self::TokenBucket(a) => a.capacity(),
            Self::FixedWindow(a) => a.capacity(),
            Self::SlidingWindowCounter(a) => a.capacity(),
            Self::SlidingWindowBuckets(a) => a.capacity(),
            Self::SlidingWindowLog(a) => a.capacity(),
            Self::LeakyBucket(a) => a.capacity(),
        }
    }

    /// One instance's share of this limit when `instances` enforce it
    /// apart (see [`Rule::divided`]).
    pub fn divided(&self, instances: u32) -> Result<Self, ConfigError> {
        use crate::algorithm::RateAlgorithm as _;
        if instances == 0 {
            return Err(ConfigError::new("instances", "must be at least 1"));
        }
        let n = u64::from(instances);
        // A count's share, rounded down, never below one unit.
        let part = |count: u64| {
            u32::try_from(count.checked_div(n).unwrap_or(count).max(1)).unwrap_or(u32::MAX)
        };
        // A time stretched `k` times: a rate divided.
        let stretch = |nanos: u64, k: u64| {
            nanos
                .checked_mul(k)
                .map(Duration::from_nanos)
                .ok_or_else(|| {
                    ConfigError::new(
                        "instances",
                        "the divided rate is slower than one unit in 584 years",
                    )
                })
        };
        Ok(match self {
            Self::Gcra(a) => Self::Gcra(Gcra::new(
                Rate::new(1, stretch(a.interval(), n)?),
                part(a.capacity()),
            )?),
            Self::TokenBucket(a) => {
                // `k` tokens every `m` intervals, `k` at most the share's
                // capacity (a larger refill would overflow the bucket) and
                // `k / m` at most the share of the rate: the largest such
                // rate among the 64 largest `k` (exact where the bucket can
                // hold it: 100 every 100 ms among 4 is 25 every 100 ms).
                let capacity = part(a.capacity());
                let r = u64::from(a.refill());
                let top = r.min(u64::from(capacity)).max(1);
                let mut best = (1_u64, n.div_ceil(r).max(1));
                for k in top.saturating_sub(63).max(1)..=top {
                    let m = k.saturating_mul(n).div_ceil(r).max(1);
                    let better = u128::from(k).saturating_mul(u128::from(best.1))
                        > u128::from(best.0).saturating_mul(u128::from(m));
                    if better {
                        best = (k, m);
                    }
                }
                let refill = u32::try_from(best.0).unwrap_or(u32::MAX);
                Self::TokenBucket(TokenBucket::new(
                    capacity,
                    refill,
                    stretch(a.interval(), best.1)?,
                )?)
            }
            Self::FixedWindow(a) => Self::FixedWindow(FixedWindow::new(
                part(a.capacity()),
                Duration::from_nanos(a.window()),
            )?),
            Self::SlidingWindowCounter(a) => Self::SlidingWindowCounter(SlidingWindowCounter::new(
                part(a.capacity()),
                Duration::from_nanos(a.window()),
            )?),
            Self::SlidingWindowBuckets(a) => Self::SlidingWindowBuckets(SlidingWindowBuckets::new(
                part(a.capacity()),
                Duration::from_nanos(a.window()),
                a.buckets(),
            )?),
            Self::SlidingWindowLog(a) => Self::SlidingWindowLog(SlidingWindowLog::new(
                part(a.capacity()),
                Duration::from_nanos(a.window()),
            )?),
            // The queue's longest wait stays: at the divided rate it
            // holds the share of the requests.
            Self::LeakyBucket(a) => Self::LeakyBucket(LeakyBucket::new(
                Rate::new(1, stretch(a.interval(), n)?),
                Duration::from_nanos(a.max_delay()),
            )?),
        })
    }

    /// The policy window in nanoseconds (the `w` of `RateLimit-Policy`):
    /// the time over which `capacity` is granted.
    pub fn window(&self) -> u64 {
        use crate::algorithm::RateAlgorithm as _;
        match self {
            Self::Gcra(a) => a.window(),
            Self::TokenBucket(a) => a.window(),
            Self::FixedWindow(a) => a.window(),
            Self::SlidingWindowCounter(a) => a.window(),
            Self::SlidingWindowBuckets(a) => a.window(),
            Self::SlidingWindowLog(a) => a.window(),
            Self::LeakyBucket(a) => a.window(),
        }
    }
}

/// Longest rule name, in bytes.
pub const MAX_RULE_NAME_LEN: usize = 64;

fn validate_name(name: &str) -> Result<(), ConfigError> {
    if name.is_empty() || name.len() > MAX_RULE_NAME_LEN {
        return Err(ConfigError::new(
            "name",
            format!("must be 1 to {MAX_RULE_NAME_LEN} bytes long"),
        ));
    }
    // The name appears in headers (inside a structured-field string), in
    // store keys and in metric labels: keep it to a safe token alphabet.
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
    {
        return Err(ConfigError::new(
            "name",
            "may contain only ASCII letters, digits, '-', '_', '.' and ':'",
        ));
    }
    Ok(())
}

/// A named, validated rate rule. Cheap to clone.
///
/// ```
/// use tollgate_core::{Limit, Rate, Rule};
///
/// let rule = Rule::new("per-key", Limit::gcra(Rate::per_second(10), 20)).unwrap();
/// assert_eq!(rule.capacity(), 20);
/// assert_eq!(rule.window(), 2_000_000_000); // 20 units at 10/s: 2 s
///
/// let err = Rule::new("per-key", Limit::gcra(Rate::per_second(10), 0)).unwrap_err();
/// assert_eq!(err.field(), "burst");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    name: Arc<str>,
    algorithm: Algorithm,
}

impl Rule {
    /// Validates the name and the limit.
    pub fn new(name: impl AsRef<str>, limit: Limit) -> Result<Self, ConfigError> {
        let name = name.as_ref();
        validate_name(name)?;
        Ok(Self {
            name: name.into(),
            algorithm: Algorithm::new(limit)?,
        })
    }

    /// The rule's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The validated algorithm.
    pub fn algorithm(&self) -> &Algorithm {
        &self.algorithm
    }

    /// See [`Algorithm::capacity`].
    pub fn capacity(&self) -> u64 {
        self.algorithm.capacity()
    }

    /// See [`Algorithm::window`].
    pub fn window(&self) -> u64 {
        self.algorithm.window()
    }

    /// This rule's share for one of `instances` that enforce it apart,
    /// with the same name: every rate, burst and window limit divided by
    /// `instances`, rounded down, and never below one unit (so a fleet
    /// larger than a limit admits one unit per instance). Redis's
    /// `FailurePolicy::fallback_share` decides in memory with it during
    /// an outage, so that a fleet of `instances` admits about the limit,
    /// not `instances` times it.
    ///
    /// ```
    /// use tollgate_core::{Limit, Rate, Rule};
    ///
    /// let rule = Rule::new("per-key", Limit::gcra(Rate::per_second(100), 40))?;
    /// let share = rule.divided(4)?;
    /// assert_eq!(share.capacity(), 10);
    /// assert_eq!(share.name(), "per-key");
    /// assert_eq!(rule.divided(0).unwrap_err().field(), "instances");
    /// # Ok::<(), tollgate_core::ConfigError>(())
    /// ```
    pub fn divided(&self, instances: u32) -> Result<Self, ConfigError> {
        Ok(Self {
            name: self.name.clone(),
            algorithm: self.algorithm.divided(instances)?,
        })
    }
}

/// A named, validated concurrency rule: at most `max` permits held at once
/// per key; a lease not released within `lease_ttl` lapses, so a crashed
/// holder cannot keep its permits forever.
///
/// ```
/// use std::time::Duration;
/// use tollgate_core::ConcurrencyRule;
///
/// let rule = ConcurrencyRule::new("reports", 4, Duration::from_secs(60)).unwrap();
/// assert_eq!(rule.semaphore().max(), 4);
/// assert_eq!(
///     ConcurrencyRule::new("reports", 0, Duration::from_secs(60)).unwrap_err().field(),
///     "max"
/// );
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConcurrencyRule {
    name: Arc<str>,
    semaphore: Semaphore,
}

impl ConcurrencyRule {
    /// Validates the name, `max` and `lease_ttl`.
    pub fn new(name: impl AsRef<str>, max: u32, lease_ttl: Duration) -> Result<Self, ConfigError> {
        let name = name.as_ref();
        validate_name(name)?;
        Ok(Self {
            name: name.into(),
            semaphore: Semaphore::new(max, lease_ttl)?,
        })
    }

    /// The same rule whose denials tell clients to retry after
    /// `retry_after` (default one second; from 1 ms to a day). When a
    /// permit frees depends on other requests, so this is a hint.
    pub fn with_retry_after(self, retry_after: Duration) -> Result<Self, ConfigError> {
        Ok(Self {
            semaphore: self.semaphore.with_retry_after(retry_after)?,
            ..self
        })
    }

    /// The rule's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The validated semaphore parameters.
    pub fn semaphore(&self) -> &Semaphore {
        &self.semaphore
    }

    /// This rule's share for one of `instances` that enforce it apart:
    /// `max` divided by `instances`, rounded down, at least one permit
    /// (see [`Rule::divided`]).
    pub fn divided(&self, instances: u32) -> Result<Self, ConfigError> {
        if instances == 0 {
            return Err(ConfigError::new("instances", "must be at least 1"));
        }
        let s = &self.semaphore;
        let max = s.max().checked_div(instances).unwrap_or(1).max(1);
        Ok(Self {
            name: self.name.clone(),
            semaphore: Semaphore::new(max, Duration::from_nanos(s.lease_ttl()))?
                .with_retry_after(Duration::from_nanos(s.retry_after()))?,
        })
    }
}

/// A named, validated calendar quota: budgets per period per key (see
/// [`Quota`](crate::Quota)).
///
/// ```
/// use tollgate_core::calendar::{Offset, Period};
/// use tollgate_core::QuotaRule;
///
/// let rule = QuotaRule::new("plan", &[(Period::Day, 1_000), (Period::Month, 20_000)], Offset::UTC)?;
/// assert_eq!(rule.quota().periods().count(), 2);
/// # Ok::<(), tollgate_core::ConfigError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaRule {
    name: Arc<str>,
    quota: crate::Quota,
}

impl QuotaRule {
    /// Validates the name and the periods.
    pub fn new(
        name: impl AsRef<str>,
        periods: &[(crate::calendar::Period, u64)],
        zone: impl Into<crate::calendar::Zone>,
    ) -> Result<Self, ConfigError> {
        let name = name.as_ref();
        validate_name(name)?;
        Ok(Self {
            name: name.into(),
            quota: crate::Quota::new(periods, zone)?,
        })
    }

    /// The rule's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The validated quota.
    pub fn quota(&self) -> &crate::Quota {
        &self.quota
    }

    /// This rule's share for one of `instances` that enforce it apart:
    /// every period's budget divided by `instances`, rounded down, at
    /// least one unit (see [`Rule::divided`]).
    pub fn divided(&self, instances: u32) -> Result<Self, ConfigError> {
        if instances == 0 {
            return Err(ConfigError::new("instances", "must be at least 1"));
        }
        let n = u64::from(instances);
        let periods: Vec<_> = self
            .quota
            .periods()
            .map(|(period, limit)| (period, limit.checked_div(n).unwrap_or(1).max(1)))
            .collect();
        Ok(Self {
            name: self.name.clone(),
            quota: crate::Quota::new(&periods, self.quota.zone().clone())?,
        })
    }
}

/// A named, validated retry budget (see [`RetryBudget`](crate::RetryBudget)).
///
/// ```
/// use std::time::Duration;
/// use tollgate_core::RetryBudgetRule;
///
/// // Finagle's and Linkerd's defaults: 20 % over 10 s, 10 retries a second.
/// let rule = RetryBudgetRule::new("upstream", 0.2, 10, Duration::from_secs(10))?;
/// assert_eq!(rule.budget().deposit_units(), 200);
/// # Ok::<(), tollgate_core::ConfigError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryBudgetRule {
    name: Arc<str>,
    budget: crate::RetryBudget,
}

impl RetryBudgetRule {
    /// Validates the name and the budget.
    pub fn new(
        name: impl AsRef<str>,
        ratio: f64,
        min_per_second: u32,
        window: Duration,
    ) -> Result<Self, ConfigError> {
        let name = name.as_ref();
        validate_name(name)?;
        Ok(Self {
            name: name.into(),
            budget: crate::RetryBudget::new(ratio, min_per_second, window)?,
        })
    }

    /// The rule's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The validated budget.
    pub fn budget(&self) -> &crate::RetryBudget {
        &self.budget
    }
}

/// An escalation ladder with its name: what an
/// [`EscalationLimiter`](crate::EscalationLimiter) enforces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EscalationRule {
    name: Arc<str>,
    escalation: crate::algorithm::Escalation,
}

impl EscalationRule {
    /// Validates the name and the ladder (see
    /// [`Escalation::new`](crate::algorithm::Escalation::new)).
    pub fn new(
        name: impl AsRef<str>,
        strikes: u32,
        period: Duration,
        block: Duration,
        max_block: Duration,
    ) -> Result<Self, ConfigError> {
        let name = name.as_ref();
        validate_name(name)?;
        Ok(Self {
            name: name.into(),
            escalation: crate::algorithm::Escalation::new(strikes, period, block, max_block)?,
        })
    }

    /// A slowing ladder, validated (see
    /// [`Escalation::slow_down`](crate::algorithm::Escalation::slow_down)).
    pub fn slow_down(
        name: impl AsRef<str>,
        strikes: u32,
        period: Duration,
        hold: Duration,
        steps: &[u8],
    ) -> Result<Self, ConfigError> {
        let name = name.as_ref();
        validate_name(name)?;
        Ok(Self {
            name: name.into(),
            escalation: crate::algorithm::Escalation::slow_down(strikes, period, hold, steps)?,
        })
    }

    /// The rule's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The validated ladder.
    pub fn escalation(&self) -> &crate::algorithm::Escalation {
        &self.escalation
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (Limit::gcra(Rate::per_second(0), 1), "rate"),
            (Limit::gcra(Rate::new(1, Duration::ZERO), 1), "rate"),
            (
                Limit::gcra(Rate::new(2, Duration::from_nanos(1)), 1),
                "rate",
            ),
            (Limit::gcra(Rate::per_second(1), 0), "burst"),
            (Limit::gcra(Rate::per_day(1), u32::MAX), "burst"),
            (
                Limit::token_bucket(0, 1, Duration::from_secs(1)),
                "capacity",
            ),
            (Limit::token_bucket(1, 0, Duration::from_secs(1)), "refill"),
            (Limit::token_bucket(1, 1, Duration::ZERO), "interval"),
            (Limit::token_bucket(1, 5, Duration::from_nanos(2)), "refill"),
            (Limit::fixed_window(0, Duration::from_secs(1)), "limit"),
            (Limit::fixed_window(1, Duration::from_micros(10)), "window"),
            (
                Limit::sliding_window_counter(0, Duration::from_secs(1)),
                "limit",
            ),
            (Limit::sliding_window_counter(1, Duration::ZERO), "window"),
            (
                Limit::sliding_window_log(0, Duration::from_secs(1)),
                "limit",
            ),
            (
                Limit::sliding_window_log(SlidingWindowLog::MAX_LIMIT + 1, Duration::from_secs(1)),
                "limit",
            ),
            (Limit::sliding_window_log(1, Duration::ZERO), "window"),
            (
                Limit::sliding_window_buckets(0, Duration::from_secs(1), 2),
                "limit",
            ),
            (
                Limit::sliding_window_buckets(1, Duration::from_secs(1), 0),
                "buckets",
            ),
            (
                Limit::sliding_window_buckets(1, Duration::from_millis(5), 10),
                "window",
            ),
            (
                Limit::leaky_bucket(Rate::per_second(0), Duration::ZERO),
                "rate",
            ),
        ];
        for (limit, field) in cases {
            let err = Rule::new("r", limit).expect_err(&format!("{limit:?} must be rejected"));
            assert_eq!(err.field(), field, "{limit:?}: {err}");
            assert!(err.to_string().contains(field));
        }
    }

    #[test]
    fn names_are_checked() {
        let ok = Limit::fixed_window(1, Duration::from_secs(1));
        assert!(Rule::new("per-key:v1.api_x", ok).is_ok());
        for bad in ["", "has space", "quote\"", "brace{", &"x".repeat(65), "é"] {
            assert_eq!(Rule::new(bad, ok).unwrap_err().field(), "name", "{bad:?}");
        }
    }

    #[test]
    fn rates_divide_down_to_nanoseconds() {
        assert_eq!(Rate::per_second(10).interval_nanos("rate"), Ok(100_000_000));
        assert_eq!(
            Rate::new(1, Duration::from_nanos(1)).interval_nanos("rate"),
            Ok(1)
        );
        assert_eq!(
            Rate::new(1, Duration::MAX).interval_nanos("rate"),
            Ok(u64::MAX)
        );
    }

    /// A divided limit admits at most its share: over a long run, the
    /// shares of `n` instances together admit no more than the whole rule
    /// (plus one burst each), and at least most of it where the division
    /// is exact.
    #[test]
    fn a_divided_rule_admits_its_share() {
        fn admitted(algorithm: &Algorithm, seconds: u64) -> u64 {
            // One unit asked every millisecond, for `seconds`.
            fn run<A: crate::algorithm::RateAlgorithm>(a: &A, seconds: u64) -> u64 {
                let mut state = A::State::default();
                let mut admitted = 0;
                for ms in 0..seconds * 1_000 {
                    if a.decide(&mut state, 1_000_000_000 + ms * 1_000_000, 1)
                        .is_allowed()
                    {
                        admitted += 1;
                    }
                }
                admitted
            }
            match algorithm {
                Algorithm::Gcra(a) => run(a, seconds),
                Algorithm::TokenBucket(a) => run(a, seconds),
                Algorithm::FixedWindow(a) => run(a, seconds),
                Algorithm::SlidingWindowCounter(a) => run(a, seconds),
                Algorithm::SlidingWindowBuckets(a) => run(a, seconds),
                Algorithm::SlidingWindowLog(a) => run(a, seconds),
                Algorithm::LeakyBucket(a) => run(a, seconds),
            }
        }
        let limits = [
            Limit::gcra(Rate::per_second(100), 40),
            Limit::token_bucket(100, 10, Duration::from_millis(100)),
            Limit::token_bucket(100, 1, Duration::from_millis(10)),
            Limit::token_bucket(100, 19, Duration::from_millis(100)),
            Limit::fixed_window(100, Duration::from_secs(1)),
            Limit::sliding_window_counter(100, Duration::from_secs(1)),
            Limit::sliding_window_buckets(100, Duration::from_secs(1), 10),
            Limit::sliding_window_log(100, Duration::from_secs(1)),
            Limit::leaky_bucket(Rate::per_second(100), Duration::from_millis(100)),
        ];
        for limit in limits {
            let whole = Algorithm::new(limit).unwrap();
            let all = admitted(&whole, 20);
            for n in [2_u32, 4, 5] {
                let share = whole.divided(n).unwrap();
                // A leaky bucket's capacity counts the request at the
                // head of the queue too: one unit each beyond the share.
                let slack = match whole {
                    Algorithm::LeakyBucket(_) => u64::from(n),
                    _ => 0,
                };
                assert!(
                    share.capacity() * u64::from(n) <= whole.capacity() + slack,
                    "{limit:?} / {n}"
                );
                let fleet = admitted(&share, 20) * u64::from(n);
                assert!(
                    fleet <= all + share.capacity() * u64::from(n),
                    "{limit:?} / {n}: {fleet} > {all}"
                );
                // Rounding keeps each share under its part; at most a
                // tenth under it here (a refill of 19 among 10: 9 tokens
                // every 5 intervals, 95 % of the share).
                assert!(fleet * 10 >= all * 9, "{limit:?} / {n}: {fleet} of {all}");
            }
        }
        // More instances than units: one unit each, never none.
        let small = Algorithm::new(Limit::fixed_window(3, Duration::from_secs(1))).unwrap();
        assert_eq!(small.divided(10).unwrap().capacity(), 1);
        assert_eq!(small.divided(0).unwrap_err().field(), "instances");
        // A slow rate divided past what a nanosecond count holds is an error.
        let slow = Algorithm::new(Limit::gcra(
            Rate::new(1, Duration::from_secs(86_400 * 365 * 500)),
            1,
        ))
        .unwrap();
        assert_eq!(slow.divided(2).unwrap_err().field(), "instances");
    }

    #[test]
    fn divided_concurrency_and_quota_rules() {
        use crate::calendar::{Offset, Period};
        let rule = ConcurrencyRule::new("c", 10, Duration::from_secs(30))
            .unwrap()
            .with_retry_after(Duration::from_millis(250))
            .unwrap();
        let share = rule.divided(4).unwrap();
        assert_eq!(share.semaphore().max(), 2);
        assert_eq!(share.semaphore().lease_ttl(), rule.semaphore().lease_ttl());
        assert_eq!(share.semaphore().retry_after(), 250_000_000);
        assert_eq!(rule.divided(20).unwrap().semaphore().max(), 1);
        assert_eq!(rule.divided(0).unwrap_err().field(), "instances");

        let quota = QuotaRule::new(
            "q",
            &[(Period::Day, 1_000), (Period::Month, 2)],
            Offset::UTC,
        )
        .unwrap();
        let share = quota.divided(3).unwrap();
        let periods: Vec<_> = share.quota().periods().collect();
        assert_eq!(periods, [(Period::Day, 333), (Period::Month, 1)]);
        assert_eq!(quota.divided(0).unwrap_err().field(), "instances");
    }
}
