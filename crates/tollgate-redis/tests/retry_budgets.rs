//! Retry budgets on Redis: the core's suite on standalone and cluster, a
//! budget shared by a fleet, its keys and their TTL, state the script does
//! not recognise, and the failure policy when Redis dies.
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects
)]

use std::time::{Duration, Instant};

use tollgate_core::testing::{self, START, UNIX_2026};
use tollgate_core::{ManualClock, RetryBudgetLimiter, RetryBudgetRule, RetryBudgetStore};
use tollgate_memory::MemoryStore;
use tollgate_redis::testing::{unique_prefix, Cluster, Server};
use tollgate_redis::{FailurePolicy, RedisStore};

fn factory(url: String) -> impl Fn(ManualClock) -> RedisStore {
    move |clock| {
        RedisStore::builder(&url)
            .prefix(&unique_prefix())
            .client_time(clock)
            .timeout(Duration::from_secs(2))
            .build()
            .unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_redis_passes_the_retry_budget_suite() {
    let Some(server) = Server::start() else {
        return;
    };
    testing::run_retry_budget(factory(server.url())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_passes_the_retry_budget_suite() {
    let Some(cluster) = Cluster::start() else {
        return;
    };
    testing::run_retry_budget(factory(cluster.url())).await;
}

/// Longer traces of our own, at both starts, with other seeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_retry_budget_traces_match_the_reference() {
    let Some(server) = Server::start() else {
        return;
    };
    let make = factory(server.url());
    for start in [START, UNIX_2026] {
        for (rule, unit) in testing::retry_budget_rules() {
            for seed in [7, 0xfeed] {
                let clock = ManualClock::starting_at(start);
                let trace = testing::Trace {
                    seed,
                    steps: 800,
                    unit,
                    backwards: true,
                };
                testing::retry_budget_random_trace(&make(clock.clone()), &clock, &rule, trace)
                    .await;
            }
        }
    }
}

/// 20 % of calls, no floor, over a minute.
fn shared_rule() -> RetryBudgetRule {
    RetryBudgetRule::new("upstream", 0.2, 0, Duration::from_secs(60)).unwrap()
}

fn instance(url: &str, prefix: &str) -> RedisStore {
    RedisStore::builder(url)
        .prefix(prefix)
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap()
}

/// Two instances (two stores, on Redis's own `TIME`) share one budget:
/// 100 calls split between them buy 20 retries, and both asking at once,
/// 30 times each, get 20 together — where budgets of their own would have
/// granted each its own share of its calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_share_one_budget() {
    let Some(server) = Server::start() else {
        return;
    };
    let prefix = unique_prefix();
    let (a, b) = (
        instance(&server.url(), &prefix),
        instance(&server.url(), &prefix),
    );
    let (ra, rb) = (
        a.retry_budget(&shared_rule()).unwrap(),
        b.retry_budget(&shared_rule()).unwrap(),
    );
    for i in 0..100 {
        let r = if i % 3 == 0 { &ra } else { &rb };
        r.deposit(b"payments").await.unwrap();
    }
    // Each instance's deposits reach Redis within 10 ms, or at once on a
    // flush.
    rb.flush().await;
    assert_eq!(ra.balance(b"payments").await.unwrap(), 20_000);
    let mut asks = tokio::task::JoinSet::new();
    for i in 0..60 {
        let r = if i % 2 == 0 { ra.clone() } else { rb.clone() };
        asks.spawn(async move { r.withdraw(b"payments").await.unwrap().granted });
    }
    let mut granted = 0;
    while let Some(answer) = asks.join_next().await {
        granted += usize::from(answer.unwrap());
    }
    assert_eq!(granted, 20, "two instances withdrew more than one budget");
    assert_eq!(rb.balance(b"payments").await.unwrap(), 0);
    assert!(!ra.withdraw(b"payments").await.unwrap().granted);
    // Another key of the same rule has nothing.
    assert!(!rb.withdraw(b"orders").await.unwrap().granted);
    // A deposit made from a thread outside any runtime, its future
    // dropped there, runs on the store's runtime.
    let rc = ra.clone();
    std::thread::spawn(move || {
        for _ in 0..5 {
            drop(rc.deposit(b"payments"));
        }
    })
    .join()
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while rb.balance(b"payments").await.unwrap() < 1_000 {
        assert!(Instant::now() < deadline, "the deposits never ran");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(rb.withdraw(b"payments").await.unwrap().granted);
    for s in [&a, &b] {
        let stats = s.stats();
        assert_eq!((stats.errors, stats.timeouts), (0, 0), "{stats:?}");
    }
}

/// One hash per rule and key, `<prefix>:{rb1|rule|h:<digest>}`, a field per
/// slot position ("index deposited withdrawn"), living the window plus a
/// second after its last write. Reads and refused withdrawals write
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_budget_keys_expire_with_their_window() {
    let Some(server) = Server::start() else {
        return;
    };
    let prefix = unique_prefix();
    let clock = ManualClock::at_unix(UNIX_2026);
    let store = RedisStore::builder(&server.url())
        .prefix(&prefix)
        .client_time(clock.clone())
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let rule = RetryBudgetRule::new("api", 0.5, 1, Duration::from_secs(30)).unwrap();
    let budget = store.retry_budget(&rule).unwrap();
    let key = store.key_name("rb1", "api", b"tenant");
    let exists = || server.cli(&["exists", &key]).trim().to_owned();
    // The floor: 1 a second over 30 s.
    assert_eq!(budget.balance(b"tenant").await.unwrap(), 30_000);
    assert_eq!(exists(), "0", "a read wrote");
    // Refused withdrawals write nothing: spend the floor elsewhere first.
    let none = RetryBudgetRule::new("none", 0.5, 0, Duration::from_secs(30)).unwrap();
    let none = store.retry_budget(&none).unwrap();
    assert!(!none.withdraw(b"tenant").await.unwrap().granted);
    assert_eq!(
        server
            .cli(&["exists", &store.key_name("rb1", "none", b"tenant")])
            .trim(),
        "0",
        "a refused withdrawal wrote"
    );
    budget.deposit(b"tenant").await.unwrap();
    budget.deposit(b"tenant").await.unwrap();
    assert!(budget.withdraw(b"tenant").await.unwrap().granted);
    // Slots of 3 s: index floor(now / 3 s) + 1, at position index % 10.
    let index = UNIX_2026 / 3_000_000_000 + 1;
    let field = (index % 10).to_string();
    assert_eq!(
        server.cli(&["hgetall", &key]).trim(),
        format!("{field}\n{index} 1000 1000")
    );
    let ttl: u64 = server.cli(&["pttl", &key]).trim().parse().unwrap();
    assert!(ttl <= 31_000 && ttl > 26_000, "TTL {ttl} ms");
    assert_eq!(budget.balance(b"tenant").await.unwrap(), 30_000);
    // A window on, the slot has lapsed (the key is still there: real
    // time has not passed).
    clock.advance(Duration::from_secs(30));
    assert_eq!(budget.balance(b"tenant").await.unwrap(), 30_000);
}

/// Things that are not a budget of ours, as `redis-cli` arguments after
/// the key: other types, and hashes with fields no script writes.
fn garbage() -> Vec<Vec<String>> {
    let index = UNIX_2026 / 1_000_000_000 + 1;
    let field = (index % 10).to_string();
    let mut rows: Vec<Vec<String>> = [
        &["SET", "garbage"][..],
        &["RPUSH", "x", "y"],
        &["SADD", "member"],
        &["ZADD", "1", "member"],
    ]
    .iter()
    .map(|r| r.iter().map(|s| (*s).to_owned()).collect())
    .collect();
    for value in [
        "x".to_owned(),
        String::new(),
        format!("{index} 1000"),
        format!("{index} 1000 0 0"),
        format!("{index} -1000 0"),
        format!("{index} 1000 x"),
        format!("{index}  1000 0"),
        // A count past 2^49; a slot at the wrong position; index 0.
        format!("{index} 999999999999999 0"),
        format!("{} 5000 0", index + 1),
        "0 5000 0".to_owned(),
        format!("{index} 5000 99999999999999999999"),
    ] {
        rows.push(vec!["HSET".into(), field.clone(), value.clone()]);
        // A good slot beside the bad one: the whole state goes.
        let other = ((index + 9) % 10).to_string();
        rows.push(vec![
            "HSET".into(),
            other,
            format!("{} 4000 0", index - 1),
            field.clone(),
            value,
        ]);
    }
    rows
}

/// Garbage at the exact key a budget uses: every answer is a fresh key's
/// (made side by side on another key), and no call fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unrecognised_retry_budget_state_reads_as_absent() {
    let Some(server) = Server::start() else {
        return;
    };
    let prefix = unique_prefix();
    let clock = ManualClock::at_unix(UNIX_2026);
    let store = RedisStore::builder(&server.url())
        .prefix(&prefix)
        .client_time(clock.clone())
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    // Slots of a second.
    let rule = RetryBudgetRule::new("rb", 1.0, 0, Duration::from_secs(10)).unwrap();
    let budget = store.retry_budget(&rule).unwrap();
    for (n, row) in garbage().iter().enumerate() {
        let (dirty, clean) = (format!("dirty-{n}"), format!("clean-{n}"));
        let key = store.key_name("rb1", "rb", dirty.as_bytes());
        server.cli(&["DEL", &key]);
        let mut args: Vec<&str> = vec![&row[0], &key];
        args.extend(row[1..].iter().map(String::as_str));
        server.cli(&args);
        let (dirty, clean) = (dirty.as_bytes(), clean.as_bytes());
        let at = |step: &str| format!("garbage {row:?}: {step}");
        assert_eq!(
            budget.balance(dirty).await.unwrap(),
            budget.balance(clean).await.unwrap(),
            "{}",
            at("balance")
        );
        assert_eq!(
            budget.withdraw(dirty).await.unwrap().granted,
            budget.withdraw(clean).await.unwrap().granted,
            "{}",
            at("withdraw")
        );
        for d in [dirty, clean] {
            budget.deposit(d).await.unwrap();
            budget.deposit(d).await.unwrap();
        }
        for step in ["first", "second", "third"] {
            assert_eq!(
                budget.withdraw(dirty).await.unwrap().granted,
                budget.withdraw(clean).await.unwrap().granted,
                "{}",
                at(step)
            );
        }
    }
    let stats = store.stats();
    assert_eq!((stats.errors, stats.timeouts), (0, 0), "{stats:?}");
}

const TIMEOUT: Duration = Duration::from_millis(50);
/// Scheduling slack on a loaded 2-core machine.
const SLACK: Duration = Duration::from_millis(250);

fn policy_store(server: &Server, policy: FailurePolicy) -> RedisStore {
    RedisStore::builder(&server.url())
        .prefix(&unique_prefix())
        .timeout(TIMEOUT)
        .failure_policy(policy)
        .breaker(3, Duration::from_millis(200))
        .build()
        .unwrap()
}

async fn timed<T>(what: &str, call: impl std::future::Future<Output = T>) -> T {
    let start = Instant::now();
    let out = call.await;
    let took = start.elapsed();
    assert!(took <= TIMEOUT + SLACK, "{what} took {took:?}");
    out
}

/// Redis dies: within the timeout, Open grants every retry, Closed none,
/// Fallback spends the process's own budget (deposits go there too); a
/// deposit or a read with no memory to take it is an error. Back on
/// Redis, the shared budget answers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_budgets_follow_the_failure_policy_when_redis_dies() {
    let Some(mut server) = Server::start() else {
        return;
    };
    let rule = RetryBudgetRule::new("faults-rb", 0.5, 0, Duration::from_secs(60)).unwrap();
    let open = policy_store(&server, FailurePolicy::Open);
    let closed = policy_store(&server, FailurePolicy::Closed);
    let fallback = policy_store(&server, FailurePolicy::Fallback(MemoryStore::new()));
    let (bo, bc, bf) = (
        open.retry_budget(&rule).unwrap(),
        closed.retry_budget(&rule).unwrap(),
        fallback.retry_budget(&rule).unwrap(),
    );
    for b in [&bo, &bc, &bf] {
        assert!(
            !b.withdraw(b"k").await.unwrap().granted,
            "no calls, no floor"
        );
        b.deposit(b"k").await.unwrap();
        b.deposit(b"k").await.unwrap();
        // In Redis before it dies.
        b.flush().await;
    }

    server.kill();
    for _ in 0..5 {
        // The failure policy answers, and cannot say what is left.
        let open = timed("open withdraw", bo.withdraw(b"k")).await.unwrap();
        assert_eq!(open, tollgate_core::Withdrawal::blind(true));
        let closed = timed("closed withdraw", bc.withdraw(b"k")).await.unwrap();
        assert_eq!(closed, tollgate_core::Withdrawal::blind(false));
    }
    // Deposits are counted in the process, and those that cannot reach
    // Redis are lost where no memory takes them (the budget errs toward
    // fewer retries).
    timed("open deposit", bo.deposit(b"k")).await.unwrap();
    timed("closed deposit", bc.deposit(b"k")).await.unwrap();
    timed("open flush", bo.flush()).await;
    assert!(timed("open balance", bo.balance(b"k")).await.is_err());
    // Fallback: the memory budget starts empty (Redis's deposits are not
    // there); four calls buy two retries.
    assert!(
        !timed("fallback withdraw", bf.withdraw(b"k"))
            .await
            .unwrap()
            .granted
    );
    for _ in 0..4 {
        timed("fallback deposit", bf.deposit(b"k")).await.unwrap();
    }
    assert_eq!(
        timed("fallback balance", bf.balance(b"k")).await.unwrap(),
        2_000
    );
    let mut granted = 0;
    for _ in 0..4 {
        let w = timed("fallback withdraw", bf.withdraw(b"k")).await.unwrap();
        granted += usize::from(w.granted);
        // The memory budget answers; the shared balance is unknown.
        assert_eq!(w.balance, None);
    }
    assert_eq!(granted, 2);

    server.restart();
    let start = Instant::now();
    let ok_before = open.stats().ok;
    while open.stats().ok == ok_before {
        assert!(start.elapsed() < Duration::from_secs(10), "never recovered");
        let _ = bo.balance(b"probe").await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Back on Redis (fresh: the restarted server kept nothing).
    assert!(!bo.withdraw(b"k").await.unwrap().granted);
    bo.deposit(b"k").await.unwrap();
    bo.deposit(b"k").await.unwrap();
    assert!(bo.withdraw(b"k").await.unwrap().granted);
    assert!(!bo.withdraw(b"k").await.unwrap().granted);
}

/// Quota-bandwidth-retry review #9: every client call was a script call
/// (and two tasks). Deposits are now counted in the process and go to
/// Redis in batches — every 10 ms, or just before the key's next
/// withdrawal, so withdrawals stay exact: 2,000 calls to one upstream
/// make a handful of script calls, and a withdrawal right after them sees
/// every one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deposits_are_batched_and_withdrawals_see_them() {
    let Some(server) = Server::start() else {
        return;
    };
    let store = instance(&server.url(), &unique_prefix());
    let rule = RetryBudgetRule::new("batched", 0.1, 0, Duration::from_secs(60)).unwrap();
    let budget = store.retry_budget(&rule).unwrap();
    let before = server.script_calls();
    let started = Instant::now();
    for i in 0..2_000u32 {
        assert!(budget.deposit_sync(b"upstream"));
        if i % 200 == 199 {
            // Calls spread over a little time, as a client's are.
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    let w = budget.withdraw(b"upstream").await.unwrap();
    assert!(w.granted);
    assert_eq!(
        w.balance,
        Some(199_000),
        "2,000 calls at 0.1, one retry taken"
    );
    let calls = server.script_calls() - before;
    // A flush every 10 ms while they ran, then the withdrawal.
    let ticks = started.elapsed().as_millis() as u64 / 10 + 2;
    eprintln!(
        "{calls} script calls for 2,000 deposits and a withdrawal over {:?}",
        started.elapsed()
    );
    assert!(
        calls <= ticks + 1,
        "{calls} script calls for 2,000 deposits and a withdrawal ({ticks} flushes at most)"
    );
    // Bound twice, one budget: what one binding counted, the other sees.
    let again = store.retry_budget(&rule).unwrap();
    assert!(budget.deposit_sync(b"other"));
    assert_eq!(again.balance(b"other").await.unwrap(), 100);
}
