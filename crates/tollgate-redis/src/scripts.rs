//! The Lua scripts, one per algorithm, and their replies.

use tollgate_core::calendar::Period;
use tollgate_core::{
    Acquire, Algorithm, ConfigError, Decision, Lease, Outcome, PeriodStatus, QuotaDecision,
    RateAlgorithm,
};

/// A script: its source and its SHA-1, run with `EVALSHA`; a server that
/// does not have it (`NOSCRIPT`) gets it with `EVAL` on that server, or
/// (standalone, Sentinel) `SCRIPT LOAD` then `EVALSHA`.
pub(crate) struct Script {
    redis: redis::Script,
    code: &'static str,
}

impl Script {
    pub(crate) fn new(code: &'static str) -> Self {
        Self {
            redis: redis::Script::new(code),
            code,
        }
    }

    /// The `EVALSHA` invocation (redis-rs loads the script on `NOSCRIPT`).
    pub(crate) fn prepare_invoke(&self) -> redis::ScriptInvocation<'_> {
        self.redis.prepare_invoke()
    }

    /// `EVALSHA` on `keys` and `args`, or with `code`, `EVAL`.
    pub(crate) fn command(&self, eval: bool, keys: &[&str], args: &[&str]) -> redis::Cmd {
        let mut cmd = if eval {
            let mut c = redis::cmd("EVAL");
            c.arg(self.code);
            c
        } else {
            let mut c = redis::cmd("EVALSHA");
            c.arg(self.redis.get_hash());
            c
        };
        cmd.arg(keys.len()).arg(keys).arg(args);
        cmd
    }
}

macro_rules! script {
    ($name:ident, $file:literal) => {
        pub(crate) static $name: std::sync::LazyLock<Script> = std::sync::LazyLock::new(|| {
            Script::new(concat!(
                include_str!("scripts/prelude.lua"),
                include_str!(concat!("scripts/", $file))
            ))
        });
    };
}

/// A rate algorithm's file (`<name>.lua`), scoped to itself: it
/// defines `RATE.<name>`.
macro_rules! algorithm {
    ($name:literal) => {
        concat!(
            "do\n",
            include_str!(concat!("scripts/", $name, ".lua")),
            "end\n"
        )
    };
}

/// A rate algorithm's own script, and its name in `RATE` (which a joint
/// call names it by).
pub(crate) struct Rate {
    script: std::sync::LazyLock<Script>,
    name: &'static str,
}

/// The script of one rate algorithm: its function, called on `KEYS[1]`
/// with the prelude's arguments; the name is written once, here.
macro_rules! rate_script {
    ($name:ident, $algorithm:literal) => {
        pub(crate) static $name: Rate = Rate {
            script: std::sync::LazyLock::new(|| {
                Script::new(concat!(
                    include_str!("scripts/prelude.lua"),
                    algorithm!($algorithm),
                    "return RATE.",
                    $algorithm,
                    "(KEYS[1], mode, cost, ttl, {ARGV[5], ARGV[6], ARGV[7]})\n"
                ))
            }),
            name: $algorithm,
        };
    };
}

rate_script!(GCRA, "gcra");
rate_script!(TOKEN_BUCKET, "token_bucket");
rate_script!(FIXED_WINDOW, "fixed_window");
rate_script!(SLIDING_COUNTER, "sliding_window_counter");
rate_script!(SLIDING_LOG, "sliding_window_log");
rate_script!(SLIDING_BUCKETS, "sliding_window_buckets");
rate_script!(LEAKY_BUCKET, "leaky_bucket");

/// Several rate rules deciding one request together (`joint.lua`): every
/// algorithm, and the joint decision.
pub(crate) static JOINT: std::sync::LazyLock<Script> = std::sync::LazyLock::new(|| {
    Script::new(concat!(
        include_str!("scripts/prelude.lua"),
        algorithm!("gcra"),
        algorithm!("token_bucket"),
        algorithm!("fixed_window"),
        algorithm!("sliding_window_counter"),
        algorithm!("sliding_window_log"),
        algorithm!("sliding_window_buckets"),
        algorithm!("leaky_bucket"),
        include_str!("scripts/joint.lua")
    ))
});
script!(SEMAPHORE, "semaphore.lua");
script!(QUOTA, "quota.lua");
script!(RETRY_BUDGET, "retry_budget.lua");
script!(ESCALATION, "escalation.lua");

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

/// What the quota script does (`ARGV[1]`); see `quota.lua`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum QuotaMode {
    /// Charge a cost to every period, or to none (0 reads).
    Consume,
    /// Give units back to the periods that are still current.
    Refund,
    /// Forget the key's usage and grants.
    Reset,
    /// Add units to every current period's budget.
    Grant,
}

impl QuotaMode {
    pub(crate) fn arg(self) -> &'static str {
        match self {
            Self::Consume => "consume",
            Self::Refund => "refund",
            Self::Reset => "reset",
            Self::Grant => "grant",
        }
    }
}

/// What the retry budget script does (`ARGV[1]`); see `retry_budget.lua`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RetryBudgetMode {
    /// A call was made: deposit the rule's share of a retry.
    Deposit,
    /// A retry is wanted: withdraw one if the balance has it.
    Withdraw,
    /// Read the balance.
    Balance,
}

impl RetryBudgetMode {
    pub(crate) fn arg(self) -> &'static str {
        match self {
            Self::Deposit => "deposit",
            Self::Withdraw => "withdraw",
            Self::Balance => "balance",
        }
    }
}

/// What the escalation script does (`ARGV[1]`); see `escalation.lua`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EscalationMode {
    /// Where does the key stand? Writes nothing.
    Check,
    /// A violation: count a strike.
    Strike,
}

impl EscalationMode {
    pub(crate) fn arg(self) -> &'static str {
        match self {
            Self::Check => "check",
            Self::Strike => "strike",
        }
    }
}

/// A rate rule's script: the algorithm's own, its name in `RATE` (for
/// [`JOINT`]), and its parameters (`ARGV[5..]`).
pub(crate) struct RateScript {
    pub(crate) script: &'static Script,
    pub(crate) name: &'static str,
    pub(crate) params: Vec<String>,
}

/// The script for `algorithm`.
pub(crate) fn for_algorithm(algorithm: &Algorithm) -> RateScript {
    let (rate, params): (&Rate, _) = match algorithm {
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
        Algorithm::SlidingWindowBuckets(a) => (
            &SLIDING_BUCKETS,
            vec![
                a.capacity().to_string(),
                a.bucket().to_string(),
                a.buckets().to_string(),
            ],
        ),
        Algorithm::SlidingWindowLog(a) => (
            &SLIDING_LOG,
            vec![a.capacity().to_string(), a.window().to_string()],
        ),
        Algorithm::LeakyBucket(a) => (
            &LEAKY_BUCKET,
            vec![a.interval().to_string(), a.max_delay().to_string()],
        ),
    };
    RateScript {
        script: &rate.script,
        name: rate.name,
        params,
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

/// The longest span of time, in ns, the scripts take: 2⁵¹ ns, about 26
/// days. They compute in doubles, exact for integers up to 2⁵³, with
/// times relative to now, clamped to ±2⁵² (see `prelude.lua`): a state
/// a whole span ahead stays exact while the clock steps back by up to
/// another 2⁵¹ ns, and sums of a relative time and a span or two stay
/// exact. (Intervals and windows have no lower bound: the arithmetic is
/// exact down to 1 ns.)
pub(crate) const MAX_SPAN: u64 = 1 << 51;

/// `Ok` if `value` ns fits [`MAX_SPAN`]; the error names `field`.
pub(crate) fn check_span(field: &'static str, value: u64) -> Result<(), ConfigError> {
    if value > MAX_SPAN {
        return Err(ConfigError::new(
            field,
            "the Redis store computes exactly with spans of time up to 2^51 ns (about 26 days); \
             this rule's is longer (for budgets over months, use a calendar quota)",
        ));
    }
    Ok(())
}

/// Refuses a rate rule whose spans the scripts cannot count exactly:
/// GCRA's burst × interval, a token bucket's refills to fill it × the
/// interval, a window, a leaky bucket's interval and longest delay.
pub(crate) fn check_spans(algorithm: &Algorithm) -> Result<(), ConfigError> {
    match algorithm {
        Algorithm::Gcra(a) => {
            check_span("rate", a.interval())?;
            check_span("burst", a.window())
        }
        Algorithm::TokenBucket(a) => check_span("interval", a.window()),
        Algorithm::FixedWindow(a) => check_span("window", a.window()),
        Algorithm::SlidingWindowCounter(a) => check_span("window", a.window()),
        Algorithm::SlidingWindowBuckets(a) => check_span("window", a.window()),
        Algorithm::SlidingWindowLog(a) => check_span("window", a.window()),
        Algorithm::LeakyBucket(a) => {
            check_span("rate", a.interval())?;
            check_span("max_delay", a.max_delay())
        }
    }
}

const NANOS: u64 = 1_000_000_000;

/// What the semaphore script answers an acquire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Acquired {
    /// The decision, with the lease if granted.
    Answer(Acquire),
    /// A lease of the key already has this id (and permits): none was
    /// taken; ask again under another id.
    IdTaken,
}

/// `{kind, a, limit, remaining, reset}` as a decision (see
/// [`Reply::decision`]); `None` if malformed.
fn decision_of(row: &[i64]) -> Option<Decision> {
    let [kind, a, limit, remaining, reset, ..] = row else {
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
        decision_of(&self.0)
    }

    /// `{applied, then five numbers per rule}` (see `joint.lua`) for `n`
    /// rules: whether the writes were made, and each rule's decision.
    /// `None` if malformed.
    pub(crate) fn joint(&self, n: usize) -> Option<(bool, Vec<Decision>)> {
        let [applied @ (0 | 1), rest @ ..] = self.0.as_slice() else {
            return None;
        };
        if rest.len() != n.checked_mul(5)? {
            return None;
        }
        let decisions = rest
            .chunks_exact(5)
            .map(decision_of)
            .collect::<Option<Vec<_>>>()?;
        Some((*applied == 1, decisions))
    }

    /// The answer to an acquire of `permits` under the lease id `id`: a
    /// decision (a lease if admitted), or kind 3, the id is taken.
    pub(crate) fn acquire(&self, permits: u32, id: u64) -> Option<Acquired> {
        if self.0.first() == Some(&3) {
            return Some(Acquired::IdTaken);
        }
        let decision = self.decision()?;
        let lease = (decision.is_allowed() && permits > 0).then_some(Lease { id, permits });
        Some(Acquired::Answer(Acquire { decision, lease }))
    }

    /// `{kind, now_n, wait_s, then per period: budget, remaining, end_s,
    /// length_s}` (see `quota.lua`), for `periods` in order. `None` if
    /// malformed.
    pub(crate) fn quota(&self, periods: &[Period]) -> Option<QuotaDecision> {
        let [kind, now_n, wait_s, rest @ ..] = self.0.as_slice() else {
            return None;
        };
        if rest.len() != periods.len().checked_mul(4)? {
            return None;
        }
        // Whole seconds from now's second, less now's nanoseconds.
        let after = |s: i64| {
            nonneg(s)
                .saturating_mul(NANOS)
                .saturating_sub(nonneg(*now_n))
        };
        let outcome = match kind {
            0 => Outcome::Allow { delay: 0 },
            1 => Outcome::Deny {
                retry_after: after(*wait_s).max(1),
            },
            2 => Outcome::Never,
            _ => return None,
        };
        let statuses: Vec<PeriodStatus> = periods
            .iter()
            .zip(rest.chunks_exact(4))
            .map(|(&period, row)| match row {
                [budget, remaining, end, length] => PeriodStatus {
                    period,
                    limit: nonneg(*budget),
                    remaining: nonneg(*remaining),
                    reset_after: after(*end),
                    length: nonneg(*length).saturating_mul(NANOS),
                },
                _ => PeriodStatus {
                    period,
                    limit: 0,
                    remaining: 0,
                    reset_after: 0,
                    length: 0,
                },
            })
            .collect();
        Some(QuotaDecision::new(outcome, &statuses))
    }

    /// `{granted, balance}` (see `retry_budget.lua`): whether a
    /// withdrawal was granted, and the balance after, in thousandths of a
    /// retry. `None` if malformed.
    pub(crate) fn retry_budget(&self) -> Option<(bool, u64)> {
        match self.0.as_slice() {
            [granted @ (0 | 1), balance] if *balance >= 0 => {
                Some((*granted == 1, nonneg(*balance)))
            }
            _ => None,
        }
    }

    /// `{kind, a, level}` (see `escalation.lua`): a counted strike (kind
    /// 0, a = strikes), a block (1, a = ns left), a check that found
    /// none (2), or a step of a slowing ladder (3, a = ns left on it).
    /// `None` if malformed.
    pub(crate) fn escalation(&self) -> Option<(u8, u64, u32)> {
        match self.0.as_slice() {
            [kind @ 0..=3, a, level] if *a >= 0 && *level >= 0 => Some((
                u8::try_from(*kind).ok()?,
                nonneg(*a),
                u32::try_from(*level).unwrap_or(u32::MAX),
            )),
            _ => None,
        }
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

/// A count as a script reads it: Lua 5.1 numbers are doubles, exact up to
/// 2^53, so any larger count (a cost up to `u64::MAX`) is sent as 2^53 + 2
/// — exact, and larger than any budget a script can count exactly, so it
/// still never fits — instead of rounding down onto a budget it exceeds.
pub(crate) fn lua_number(n: u64) -> u64 {
    const EXACT: u64 = 1 << 53;
    if n > EXACT {
        EXACT + 2
    } else {
        n
    }
}
