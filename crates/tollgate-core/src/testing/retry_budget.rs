//! Retry budgets: deposits and withdrawals on a manual clock.

use super::*;

/// The pure [`RetryBudget`](crate::RetryBudget), applied to per-key
/// states kept here: what a [`RetryBudgetStore`] must answer.
#[derive(Debug)]
pub struct RetryBudgetReference {
    budget: crate::RetryBudget,
    states: HashMap<Vec<u8>, crate::RetryBudgetState>,
}

impl RetryBudgetReference {
    /// A reference for `rule`, every key fresh.
    pub fn new(rule: &RetryBudgetRule) -> Self {
        Self {
            budget: *rule.budget(),
            states: HashMap::new(),
        }
    }

    /// What a deposit for `key` at `now` does.
    pub fn deposit(&mut self, key: &[u8], now: u64) {
        let s = self.states.entry(key.to_vec()).or_default();
        self.budget.deposit(s, now);
    }

    /// What the pure budget answers a withdrawal for `key` at `now`.
    pub fn withdraw(&mut self, key: &[u8], now: u64) -> bool {
        let s = self.states.entry(key.to_vec()).or_default();
        self.budget.withdraw(s, now)
    }

    /// The balance of `key` at `now`, in thousandths of a retry.
    pub fn balance(&self, key: &[u8], now: u64) -> u64 {
        self.states
            .get(key)
            .map_or(self.budget.reserve_units(), |s| self.budget.balance(s, now))
    }
}

/// One retry budget of each shape the suite traces, with a clock unit
/// that crosses their slots and windows often: exact fractional ratios
/// (0.6, 0.25, 0.333), a floor, a window that is no round number of
/// seconds, and one of 10 ms (slots of 1 ms, the shortest).
pub fn retry_budget_rules() -> Vec<(RetryBudgetRule, u64)> {
    let secs = Duration::from_secs;
    [
        ("retry-0.6", 0.6, 0, secs(10), 10 * MS),
        ("retry-0.25", 0.25, 0, secs(10), 10 * MS),
        (
            "retry-0.333-floor",
            0.333,
            1,
            Duration::from_nanos(12_345_678_901),
            10 * MS,
        ),
        ("retry-floor", 0.2, 3, secs(2), 2 * MS),
        (
            "retry-short",
            0.5,
            0,
            Duration::from_nanos(10_000_007),
            10_000,
        ),
    ]
    .into_iter()
    .map(|(name, ratio, floor, window, unit)| {
        (
            RetryBudgetRule::new(name, ratio, floor, window).unwrap(),
            unit,
        )
    })
    .collect()
}

/// Runs every retry budget scenario at [`START`] and at [`UNIX_2026`]
/// (see [`run_retry_budget_at`]).
pub async fn run_retry_budget<S: RetryBudgetStore>(make: impl Fn(ManualClock) -> S) {
    run_retry_budget_at(&make, START).await;
    run_retry_budget_at(make, UNIX_2026).await;
}

/// Runs every retry budget scenario, each on a fresh store built by
/// `make` around a fresh manual clock set to `start`: a random trace
/// per rule of [`retry_budget_rules`], the clock also going back; exact
/// fractional ratios; the floor, and deposits lapsing a slot at a time;
/// the clock going back; independent keys and rules, hostile keys; and a
/// deposit whose future is dropped.
pub async fn run_retry_budget_at<S: RetryBudgetStore>(make: impl Fn(ManualClock) -> S, start: u64) {
    for (rule, unit) in retry_budget_rules() {
        let clock = ManualClock::starting_at(start);
        let trace = Trace {
            seed: 0xb0d6e7,
            steps: 400,
            unit,
            backwards: true,
        };
        retry_budget_random_trace(&make(clock.clone()), &clock, &rule, trace).await;
    }
    let clock = ManualClock::starting_at(start);
    retry_budget_fractional_ratios(&make(clock.clone()), &clock).await;
    let clock = ManualClock::starting_at(start);
    retry_budget_floor_and_lapse(&make(clock.clone()), &clock).await;
    let clock = ManualClock::starting_at(start);
    retry_budget_clock_going_back(&make(clock.clone()), &clock).await;
    let clock = ManualClock::starting_at(start);
    retry_budget_keys_are_independent(&make(clock.clone()), &clock).await;
    let clock = ManualClock::starting_at(start);
    retry_budget_deposit_survives_its_future(&make(clock.clone()), &clock).await;
}

/// Deposits `key` on `limiter` and on `reference` at the clock's time:
/// synchronously where the store can (every other deposit of a key, so
/// both paths are checked against the reference), else through the
/// future.
pub async fn retry_deposit<L: RetryBudgetLimiter>(
    limiter: &L,
    reference: &mut RetryBudgetReference,
    clock: &ManualClock,
    key: &[u8],
) {
    let now = crate::Clock::now(clock);
    let sync_turn = (reference.balance(key, now) / crate::algorithm::RETRY_UNIT).is_multiple_of(2);
    if !(sync_turn && limiter.deposit_sync(key)) {
        limiter
            .deposit(key)
            .await
            .unwrap_or_else(|e| panic!("deposit for {key:?}: {e}"));
    }
    reference.deposit(key, now);
}

/// Withdraws for `key` on `limiter` and on `reference` at the clock's
/// time, asserts they answer alike and report the same balance after
/// (`at` says where), and returns whether the retry was granted.
pub async fn retry_withdraw<L: RetryBudgetLimiter>(
    limiter: &L,
    reference: &mut RetryBudgetReference,
    clock: &ManualClock,
    key: &[u8],
    at: &str,
) -> bool {
    let now = crate::Clock::now(clock);
    let got = limiter
        .withdraw(key)
        .await
        .unwrap_or_else(|e| panic!("withdraw for {key:?}: {e}"));
    let want = reference.withdraw(key, now);
    let name = String::from_utf8_lossy(key);
    assert_eq!(
        got.balance,
        Some(reference.balance(key, now)),
        "retry budget {} {at}: the balance after a withdrawal for {name:?} at {now}",
        limiter.rule().name(),
    );
    let got = got.granted;
    assert_eq!(
        got,
        want,
        "retry budget {} {at}: withdraw for {:?} at {now} (balance before: {})",
        limiter.rule().name(),
        String::from_utf8_lossy(key),
        reference.balance(key, now)
            + if want {
                crate::algorithm::RETRY_UNIT
            } else {
                0
            },
    );
    got
}

/// Random deposits and withdrawals over three keys (a withdrawal for
/// every two deposits, in bursts), the clock moving per `trace`: every
/// withdrawal answered as the pure budget answers it. A trace of 100
/// steps or more must see withdrawals both granted and refused.
pub async fn retry_budget_random_trace<S: RetryBudgetStore>(
    store: &S,
    clock: &ManualClock,
    rule: &RetryBudgetRule,
    trace: Trace,
) {
    let limiter = store.retry_budget(rule).unwrap();
    let mut reference = RetryBudgetReference::new(rule);
    let mut rng = Lcg(trace.seed);
    let keys: [&[u8]; 3] = [b"alice", b"bob", b"carol"];
    let origin = crate::Clock::now(clock);
    let (mut granted, mut refused) = (0, 0);
    for step in 0..trace.steps {
        move_clock(
            clock,
            &mut rng,
            trace.unit,
            trace.backwards.then_some(origin),
        );
        let key = keys[rng.below(3) as usize];
        // Bursts of either, so that balances both fill and run dry.
        let times = 1 + rng.below(4);
        if rng.below(3) == 0 {
            for _ in 0..times {
                let at = format!(
                    "step {step} ({trace:?}) at +{} ns",
                    crate::Clock::now(clock) - origin
                );
                match retry_withdraw(&limiter, &mut reference, clock, key, &at).await {
                    true => granted += 1,
                    false => refused += 1,
                }
            }
        } else {
            for _ in 0..times {
                retry_deposit(&limiter, &mut reference, clock, key).await;
            }
        }
    }
    if trace.steps >= 100 {
        assert!(
            granted > 0 && refused > 0,
            "retry budget {}: (granted, refused) = ({granted}, {refused})",
            rule.name()
        );
    }
}

/// Ratios are exact to the thousandth: 0.6 buys three retries per five
/// calls (not one per call, tower#857), 0.25 one per four, 0.333 none
/// for three calls and one for four.
pub async fn retry_budget_fractional_ratios<S: RetryBudgetStore>(store: &S, clock: &ManualClock) {
    let ten = Duration::from_secs(10);
    for (name, ratio, calls, retries) in [
        ("ratio-0.6", 0.6, 5, 3),
        ("ratio-0.6-more", 0.6, 10, 6),
        ("ratio-0.25", 0.25, 7, 1),
        ("ratio-0.25-even", 0.25, 8, 2),
        ("ratio-0.333", 0.333, 3, 0),
        ("ratio-0.333-four", 0.333, 4, 1),
        ("ratio-0.333-many", 0.333, 301, 100),
        ("ratio-1.5", 1.5, 3, 4),
    ] {
        let rule = RetryBudgetRule::new(name, ratio, 0, ten).unwrap();
        let limiter = store.retry_budget(&rule).unwrap();
        let mut reference = RetryBudgetReference::new(&rule);
        for _ in 0..calls {
            retry_deposit(&limiter, &mut reference, clock, b"k").await;
        }
        let mut granted = 0;
        for i in 0..retries + 3 {
            let at = format!("after {calls} calls, retry {i}");
            granted +=
                usize::from(retry_withdraw(&limiter, &mut reference, clock, b"k", &at).await);
        }
        assert_eq!(granted, retries, "{name}: {calls} calls");
    }
}

/// With no calls, the floor alone: `min_per_second × window` retries,
/// then none. Deposits lapse a slot at a time: a deposit counts until
/// the start of the tenth slot after its own — a nanosecond before, it
/// does; at it, it does not — and so do withdrawals, which give the
/// floor back as they lapse.
pub async fn retry_budget_floor_and_lapse<S: RetryBudgetStore>(store: &S, clock: &ManualClock) {
    let rule = RetryBudgetRule::new("floor", 0.2, 10, Duration::from_secs(2)).unwrap();
    let limiter = store.retry_budget(&rule).unwrap();
    let mut reference = RetryBudgetReference::new(&rule);
    let key = b"quiet";
    let mut granted = 0;
    for i in 0..25 {
        let at = format!("floor, retry {i}");
        granted += usize::from(retry_withdraw(&limiter, &mut reference, clock, key, &at).await);
    }
    assert_eq!(granted, 20, "10 a second over 2 s");
    // Ten calls buy two more.
    for _ in 0..10 {
        retry_deposit(&limiter, &mut reference, clock, key).await;
    }
    for i in 0..3 {
        let at = format!("after ten calls, retry {i}");
        retry_withdraw(&limiter, &mut reference, clock, key, &at).await;
    }
    // A window on, all of it has lapsed: the floor is whole again.
    clock.advance(Duration::from_secs(2));
    let mut granted = 0;
    for i in 0..25 {
        let at = format!("a window on, retry {i}");
        granted += usize::from(retry_withdraw(&limiter, &mut reference, clock, key, &at).await);
    }
    assert_eq!(granted, 20);

    // Exactly when a deposit lapses: one call buys one retry.
    let rule = RetryBudgetRule::new("lapse", 1.0, 0, Duration::from_secs(1)).unwrap();
    let limiter = store.retry_budget(&rule).unwrap();
    let mut reference = RetryBudgetReference::new(&rule);
    let slot = rule.budget().window() / crate::algorithm::RETRY_SLOTS as u64;
    clock.advance_nanos(slot / 3 + 17);
    let at_deposit = crate::Clock::now(clock);
    for key in [&b"before"[..], b"at"] {
        retry_deposit(&limiter, &mut reference, clock, key).await;
    }
    let lapse = (at_deposit / slot + 10) * slot;
    clock.set(lapse - 1);
    assert!(
        retry_withdraw(
            &limiter,
            &mut reference,
            clock,
            b"before",
            "1 ns before the lapse"
        )
        .await
    );
    clock.set(lapse);
    assert!(!retry_withdraw(&limiter, &mut reference, clock, b"at", "at the lapse").await);
}

/// The clock going back a little keeps what was spent: slots from later
/// by less than a window count until they lapse. A slot a whole window
/// or more ahead (a clock far off) neither counts nor collects deposits.
pub async fn retry_budget_clock_going_back<S: RetryBudgetStore>(store: &S, clock: &ManualClock) {
    let rule = RetryBudgetRule::new("back", 1.0, 0, Duration::from_secs(10)).unwrap();
    let limiter = store.retry_budget(&rule).unwrap();
    let mut reference = RetryBudgetReference::new(&rule);
    let start = crate::Clock::now(clock);
    let key = b"k";
    clock.set(start + 20 * SECOND);
    retry_deposit(&limiter, &mut reference, clock, key).await;
    assert!(retry_withdraw(&limiter, &mut reference, clock, key, "at 20 s").await);
    // Back 5 s: the later slot's withdrawal still counts.
    clock.set(start + 15 * SECOND);
    assert!(!retry_withdraw(&limiter, &mut reference, clock, key, "back at 15 s").await);
    retry_deposit(&limiter, &mut reference, clock, key).await;
    assert!(retry_withdraw(&limiter, &mut reference, clock, key, "a call at 15 s").await);
    // Back 10 s, to the position of the 20 s slot a window earlier: that
    // slot is a clock far off; the deposits start the slot afresh.
    clock.set(start + 10 * SECOND);
    retry_deposit(&limiter, &mut reference, clock, key).await;
    retry_deposit(&limiter, &mut reference, clock, key).await;
    for i in 0..3 {
        let at = format!("back at 10 s, retry {i}");
        retry_withdraw(&limiter, &mut reference, clock, key, &at).await;
    }
    for t in [24, 29, 30, 31, 35, 40] {
        clock.set(start + t * SECOND);
        let at = format!("forward again at {t} s");
        retry_withdraw(&limiter, &mut reference, clock, key, &at).await;
        retry_deposit(&limiter, &mut reference, clock, key).await;
    }
}

/// One key's budget is not another's, two rules keep separate budgets
/// for one key, the same rule bound twice shares one, and hostile keys
/// (empty, binary, braces, CRLF, 1 MiB) are ordinary keys.
pub async fn retry_budget_keys_are_independent<S: RetryBudgetStore>(
    store: &S,
    _clock: &ManualClock,
) {
    let ten = Duration::from_secs(10);
    let a = store
        .retry_budget(&RetryBudgetRule::new("retry-a", 1.0, 0, ten).unwrap())
        .unwrap();
    let b = store
        .retry_budget(&RetryBudgetRule::new("retry-b", 1.0, 0, ten).unwrap())
        .unwrap();
    a.deposit(b"k1").await.unwrap();
    assert!(
        !a.withdraw(b"k2").await.unwrap().granted,
        "k2 spent k1's budget"
    );
    assert!(
        !b.withdraw(b"k1").await.unwrap().granted,
        "rule b spent rule a's"
    );
    let a2 = store
        .retry_budget(&RetryBudgetRule::new("retry-a", 1.0, 0, ten).unwrap())
        .unwrap();
    assert!(
        a2.withdraw(b"k1").await.unwrap().granted,
        "the rule bound twice"
    );
    assert!(!a.withdraw(b"k1").await.unwrap().granted);

    let hostile = store
        .retry_budget(&RetryBudgetRule::new("retry-hostile", 1.0, 0, ten).unwrap())
        .unwrap();
    let mut big = vec![b'x'; 1 << 20];
    let mut keys: Vec<Vec<u8>> = vec![
        Vec::new(),
        b"\0".to_vec(),
        b"\r\nSET evil 1\r\n".to_vec(),
        b"{slot}".to_vec(),
        b"}{".to_vec(),
        vec![0xff, 0xfe, 0x00, 0x80],
        "ключ🔑".as_bytes().to_vec(),
        big.clone(),
    ];
    big[(1 << 20) - 1] = b'y';
    keys.push(big);
    for key in &keys {
        hostile.deposit(key).await.unwrap();
    }
    // Each key's one retry, and no more: keys that shared a budget would
    // grant a second.
    for key in &keys {
        let n = key.len();
        assert!(
            hostile.withdraw(key).await.unwrap().granted,
            "key of {n} bytes lost its deposit"
        );
        assert!(
            !hostile.withdraw(key).await.unwrap().granted,
            "key of {n} bytes collided"
        );
    }
}

/// A deposit whose future is dropped unpolled still happens (a caller
/// need not wait for it).
pub async fn retry_budget_deposit_survives_its_future<S: RetryBudgetStore>(
    store: &S,
    _clock: &ManualClock,
) {
    let rule = RetryBudgetRule::new("dropped", 1.0, 0, Duration::from_secs(10)).unwrap();
    let limiter = store.retry_budget(&rule).unwrap();
    drop(limiter.deposit(b"k"));
    let mut deposited = false;
    for _ in 0..2_000 {
        // A refused withdrawal changes nothing.
        if limiter.withdraw(b"k").await.unwrap().granted {
            deposited = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(deposited, "a dropped deposit future cancelled the deposit");
    assert!(!limiter.withdraw(b"k").await.unwrap().granted);
}
