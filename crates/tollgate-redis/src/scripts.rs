//! The Lua scripts, one per algorithm, and their replies.

use tollgate_core::{Acquire, Algorithm, Decision, Lease, Outcome, RateAlgorithm};

/// A script: its source, loaded with `EVALSHA` (and `EVAL` on `NOSCRIPT`).
pub(crate) type Script = redis::Script;

macro_rules! script {
    ($name:ident, $file:literal) => {
        pub(crate) static $name: std::sync::LazyLock<Script> = std::sync::LazyLock::new(|| {
            redis::Script::new(concat!(
                include_str!("scripts/prelude.lua"),
                include_str!(concat!("scripts/", $file))
            ))
        });
    };
}

script!(GCRA, "gcra.lua");
script!(TOKEN_BUCKET, "token_bucket.lua");
script!(FIXED_WINDOW, "fixed_window.lua");
script!(SLIDING_COUNTER, "sliding_window_counter.lua");
script!(SLIDING_LOG, "sliding_window_log.lua");
script!(LEAKY_BUCKET, "leaky_bucket.lua");
script!(SEMAPHORE, "semaphore.lua");

/// What a rate script does (`ARGV[1]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RateMode {
    /// Decide on a request of `cost` and consume it if admitted.
    Decide,
    /// Give back `cost` consumed earlier.
    Refund,
}

impl RateMode {
    pub(crate) fn arg(self) -> &'static str {
        match self {
            Self::Decide => "decide",
            Self::Refund => "refund",
        }
    }
}

/// What the semaphore script does (`ARGV[1]`); see `semaphore.lua`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SemaphoreMode {
    /// Take permits under a new lease, up to a ceiling.
    Acquire,
    /// Drop leases (a batch of one key's).
    Release,
    /// Extend leases that are still live (a batch of one key's).
    Renew,
    /// Count the permits held.
    Held,
}

impl SemaphoreMode {
    pub(crate) fn arg(self) -> &'static str {
        match self {
            Self::Acquire => "acquire",
            Self::Release => "release",
            Self::Renew => "renew",
            Self::Held => "held",
        }
    }
}

/// The script for `algorithm` and its parameters (`ARGV[5..]`).
pub(crate) fn for_algorithm(algorithm: &Algorithm) -> (&'static Script, Vec<String>) {
    match algorithm {
        Algorithm::Gcra(a) => (
            &GCRA,
            vec![a.interval().to_string(), a.capacity().to_string()],
        ),
        Algorithm::TokenBucket(a) => (
            &TOKEN_BUCKET,
            vec![
                a.capacity().to_string(),
                a.refill().to_string(),
                a.interval().to_string(),
            ],
        ),
        Algorithm::FixedWindow(a) => (
            &FIXED_WINDOW,
            vec![a.capacity().to_string(), a.window().to_string()],
        ),
        Algorithm::SlidingWindowCounter(a) => (
            &SLIDING_COUNTER,
            vec![a.capacity().to_string(), a.window().to_string()],
        ),
        Algorithm::SlidingWindowLog(a) => (
            &SLIDING_LOG,
            vec![a.capacity().to_string(), a.window().to_string()],
        ),
        Algorithm::LeakyBucket(a) => (
            &LEAKY_BUCKET,
            vec![a.interval().to_string(), a.max_delay().to_string()],
        ),
    }
}

/// How long after its last write a key's state can still matter: its TTL
/// (plus a margin). A sliding window counter's current count still weighs
/// in the next window; a leaky bucket's queue can reach `max_delay` plus
/// one interval ahead.
pub(crate) fn state_lifetime(algorithm: &Algorithm) -> u64 {
    match algorithm {
        Algorithm::SlidingWindowCounter(a) => a.window().saturating_mul(2),
        Algorithm::LeakyBucket(a) => a.max_delay().saturating_add(a.interval()),
        other => other.window(),
    }
}

/// TTL margin on every key beyond its rule's window.
const TTL_MARGIN_MS: u64 = 1_000;

/// The TTL in ms of a key whose state matters `window_nanos`: every
/// write sets it, so idle keys vanish.
pub(crate) fn ttl_ms(window_nanos: u64) -> u64 {
    window_nanos
        .div_ceil(1_000_000)
        .saturating_add(TTL_MARGIN_MS)
}

/// Scripts compute in doubles, and times on Redis's clock are about 10¹⁷
/// ns, where a double resolves about 16 ns: intervals and windows must be
/// far coarser than that to stay exact. Returns the error naming the field.
pub(crate) fn check_precision(algorithm: &Algorithm) -> Result<(), tollgate_core::ConfigError> {
    const MIN_INTERVAL: u64 = 1_000;
    const MIN_WINDOW: u64 = 1_000_000;
    let (field, value, min) = match algorithm {
        Algorithm::Gcra(a) => ("rate", a.interval(), MIN_INTERVAL),
        Algorithm::LeakyBucket(a) => ("rate", a.interval(), MIN_INTERVAL),
        Algorithm::TokenBucket(a) => ("interval", a.interval(), MIN_INTERVAL),
        Algorithm::FixedWindow(a) => ("window", a.window(), MIN_WINDOW),
        Algorithm::SlidingWindowCounter(a) => ("window", a.window(), MIN_WINDOW),
        Algorithm::SlidingWindowLog(a) => ("window", a.window(), MIN_WINDOW),
    };
    if value < min {
        return Err(tollgate_core::ConfigError::new(
            field,
            if min == MIN_INTERVAL {
                "the Redis store supports at most one unit per microsecond per key"
            } else {
                "the Redis store supports windows of at least 1 ms"
            },
        ));
    }
    Ok(())
}

/// A script's reply: integers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reply(pub(crate) Vec<i64>);

fn nonneg(x: i64) -> u64 {
    u64::try_from(x).unwrap_or(0)
}

impl Reply {
    /// `{kind, a, limit, remaining, reset}`: kind 0 allow (a = delay),
    /// 1 deny (a = retry after), 2 never. `None` if malformed.
    pub(crate) fn decision(&self) -> Option<Decision> {
        let [kind, a, limit, remaining, reset, ..] = self.0.as_slice() else {
            return None;
        };
        let outcome = match kind {
            0 => Outcome::Allow { delay: nonneg(*a) },
            1 => Outcome::Deny {
                retry_after: nonneg(*a),
            },
            2 => Outcome::Never,
            _ => return None,
        };
        Some(Decision {
            outcome,
            limit: nonneg(*limit),
            remaining: nonneg(*remaining),
            reset_after: nonneg(*reset),
        })
    }

    /// A decision and, at index 5, the lease id.
    pub(crate) fn acquire(&self, permits: u32) -> Option<Acquire> {
        let decision = self.decision()?;
        let lease = match (decision.is_allowed() && permits > 0, self.0.get(5)) {
            (true, Some(id)) => Some(Lease {
                id: nonneg(*id),
                permits,
            }),
            _ => None,
        };
        Some(Acquire { decision, lease })
    }

    /// `{n}`: a count. `None` if malformed.
    pub(crate) fn count(&self) -> Option<u64> {
        self.0.first().map(|n| nonneg(*n))
    }

    /// `{f1, f2, ...}`: one flag per lease of a batch, 1 if it was live.
    pub(crate) fn flags(&self) -> impl Iterator<Item = bool> + '_ {
        self.0.iter().map(|f| *f == 1)
    }
}
