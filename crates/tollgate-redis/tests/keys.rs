//! What the store finds at its keys: keys name the service, the algorithm
//! and its state's layout, and state the scripts do not recognise reads as
//! absent — never as an error.
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects
)]

use std::time::Duration;

use tollgate_core::calendar::{Offset, Period};
use tollgate_core::testing::{self, UNIX_2026};
use tollgate_core::{
    ConcurrencyLimiter, ConcurrencyRule, Limit, Limiter, ManualClock, QuotaLimiter, QuotaRule,
    QuotaStore, Rate, Rule, Store,
};
use tollgate_redis::testing::{unique_prefix, Server};
use tollgate_redis::RedisStore;

fn store(server: &Server, prefix: &str, clock: &ManualClock) -> RedisStore {
    RedisStore::builder(&server.url())
        .prefix(prefix)
        .client_time(clock.clone())
        .timeout(Duration::from_secs(2))
        .lease_renewal(false)
        .build()
        .unwrap()
}

/// The format tag of each of the suite's rules, as keys carry it.
fn tag(rule: &Rule) -> &'static str {
    match rule.name() {
        "gcra" => "gcra1",
        "token-bucket" => "tb1",
        "fixed-window" => "fw1",
        "sliding-counter" => "swc1",
        "sliding-log" => "swl1",
        "sliding-buckets" => "swb1",
        "leaky-bucket" => "lb1",
        other => panic!("no tag for {other}"),
    }
}

/// Things that are not a state of ours, as `redis-cli` arguments after the
/// key: other types, and each type with content no script writes. A
/// sliding log's first entry is well formed, so that the bad one is met
/// only when the script reads on.
fn garbage() -> Vec<Row> {
    let now = UNIX_2026.to_string();
    let rows: Vec<Vec<&str>> = vec![
        vec!["SET", "garbage"],
        vec!["SET", ""],
        vec!["SET", "184467440737095516160"],
        vec!["SET", "12:ab"],
        vec!["SET", "1 x"],
        vec!["SET", "-5"],
        // A window of buckets: a count that is not one, too many buckets
        // (the suite's rule has 4), a bucket number past 2^53.
        vec!["SET", "12:1,x"],
        vec!["SET", "5:1,2,3,4,5,6"],
        vec!["SET", "99999999999999999999:1"],
        vec!["SET", "5:"],
        vec!["RPUSH", "x", "y", "z"],
        vec!["RPUSH", "5"],
        vec!["RPUSH", "2", "not-a-time", "1"],
        vec!["RPUSH", "3", &now, "1", "bad", "2"],
        vec!["HSET", "start", "x", "current", "1", "previous", "0"],
        vec!["HSET", "current", "-1"],
        vec![
            "HSET",
            "start",
            &now,
            "current",
            "99999999999999999999",
            "previous",
            "0",
        ],
        vec!["SADD", "member"],
        vec!["ZADD", "1", "member"],
    ];
    rows.into_iter()
        .map(|r| r.into_iter().map(str::to_owned).collect())
        .collect()
}

/// `redis-cli` arguments after the key.
type Row = Vec<String>;

fn plant(server: &Server, key: &str, row: &[String]) {
    server.cli(&["DEL", key]);
    let mut args: Vec<&str> = vec![&row[0], key];
    args.extend(row[1..].iter().map(String::as_str));
    server.cli(&args);
}

/// Garbage of every kind at the exact key a rule uses: every answer is the
/// one a fresh key gets (made side by side on another key, at the same
/// times), and no call fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unrecognised_rate_state_reads_as_absent() {
    let Some(server) = Server::start() else {
        return;
    };
    let prefix = unique_prefix();
    let clock = ManualClock::starting_at(UNIX_2026);
    let store = store(&server, &prefix, &clock);
    for rule in testing::rules() {
        let limiter = store.limiter(&rule).unwrap();
        let capacity = rule.capacity();
        for (n, row) in garbage().iter().enumerate() {
            let dirty = format!("dirty-{n}");
            let clean = format!("clean-{n}");
            let key = store.key_name(tag(&rule), rule.name(), dirty.as_bytes());
            plant(&server, &key, row);
            let at = |step: &str| format!("rule {} garbage {row:?}: {step}", rule.name());
            // A refund first: it must not fail, nor make the key fresher
            // than fresh.
            limiter.refund(dirty.as_bytes(), 1).await.unwrap();
            for (step, cost) in [("peek", 0), ("one", 1), ("two", 2), ("all", capacity)] {
                let got = limiter.decide(dirty.as_bytes(), cost).await.unwrap();
                let want = limiter.decide(clean.as_bytes(), cost).await.unwrap();
                assert_eq!(got, want, "{}", at(step));
            }
            clock.advance(Duration::from_millis(250));
            let got = limiter.decide(dirty.as_bytes(), 1).await.unwrap();
            let want = limiter.decide(clean.as_bytes(), 1).await.unwrap();
            assert_eq!(got, want, "{}", at("later"));
        }
    }
    let stats = store.stats();
    assert_eq!((stats.errors, stats.timeouts), (0, 0), "{stats:?}");
}

/// The same for the semaphore's two keys, the lease set and its hash:
/// each case plants garbage at one or both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unrecognised_leases_read_as_absent() {
    let Some(server) = Server::start() else {
        return;
    };
    let prefix = unique_prefix();
    let clock = ManualClock::starting_at(UNIX_2026);
    let store = store(&server, &prefix, &clock);
    let rule = ConcurrencyRule::new("conc", 3, Duration::from_secs(10)).unwrap();
    let sem = store.concurrency_limiter(&rule).unwrap();
    let base = (UNIX_2026 / 1_000_000_000).to_string();
    let owned = |r: &[&str]| -> Vec<String> { r.iter().map(|s| (*s).to_owned()).collect() };
    let mut cases: Vec<(Option<Row>, Option<Row>)> = Vec::new();
    for row in garbage() {
        cases.push((Some(row.clone()), None));
        cases.push((None, Some(row)));
    }
    let base = format!("base:{base}");
    for row in [
        // Leases without their base; with a base that does not parse;
        // with a lease that does not parse, lapsed (so read at once).
        vec!["ZADD", "5", "1:1"],
        vec!["ZADD", "-inf", "base:abc", "5", "1:1"],
        vec!["ZADD", "-inf", &base, "5", "junk"],
        vec!["ZADD", "-inf", &base, "5", "1:x"],
    ] {
        cases.push((Some(owned(&row)), None));
        cases.push((
            Some(owned(&row)),
            Some(owned(&["HSET", "held", "x", "next", "7"])),
        ));
    }
    // A live lease that does not parse, read when the lost count is
    // mended from the leases. (With the count there, live leases are not
    // read: they are read only as they lapse or are released.)
    cases.push((Some(owned(&["ZADD", "-inf", &base, "+inf", "1:x"])), None));
    for (n, (leases, hash)) in cases.iter().enumerate() {
        let dirty = format!("dirty-{n}");
        let clean = format!("clean-{n}");
        let key = store.key_name("sem2", "conc", dirty.as_bytes());
        server.cli(&["DEL", &key, &format!("{key}:meta")]);
        if let Some(row) = leases {
            plant(&server, &key, row);
        }
        if let Some(row) = hash {
            plant(&server, &format!("{key}:meta"), row);
        }
        let at = |step: &str| format!("leases {leases:?} hash {hash:?}: {step}");
        assert_eq!(
            sem.held(dirty.as_bytes()).await.unwrap(),
            0,
            "{}",
            at("held")
        );
        let mut held = Vec::new();
        for (step, permits) in [("peek", 0), ("one", 1), ("two", 2), ("more", 1)] {
            let got = sem
                .acquire(dirty.as_bytes(), permits, u32::MAX)
                .await
                .unwrap();
            let want = sem
                .acquire(clean.as_bytes(), permits, u32::MAX)
                .await
                .unwrap();
            // Lease ids are each lease's own; all else is alike.
            assert_eq!(got.decision, want.decision, "{}", at(step));
            assert_eq!(
                got.lease.map(|l| l.permits),
                want.lease.map(|l| l.permits),
                "{}",
                at(step)
            );
            held.extend(got.lease.map(|l| (dirty.clone(), l)));
            held.extend(want.lease.map(|l| (clean.clone(), l)));
        }
        for (k, lease) in held {
            sem.release(k.as_bytes(), lease).await.unwrap();
        }
        assert_eq!(
            sem.held(dirty.as_bytes()).await.unwrap(),
            0,
            "{}",
            at("released")
        );
    }
    let stats = store.stats();
    assert_eq!((stats.errors, stats.timeouts), (0, 0), "{stats:?}");
}

/// The same for a quota's hash: other types, and fields that are not
/// "start used bonus" as the script writes them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unrecognised_quota_state_reads_as_absent() {
    let Some(server) = Server::start() else {
        return;
    };
    let prefix = unique_prefix();
    let clock = ManualClock::starting_at(UNIX_2026);
    let store = store(&server, &prefix, &clock);
    let rule =
        QuotaRule::new("plan", &[(Period::Day, 5), (Period::Month, 9)], Offset::UTC).unwrap();
    let quota = store.quota_limiter(&rule).unwrap();
    let today = (UNIX_2026 / 1_000_000_000 / 86_400 * 86_400).to_string();
    let mut rows = garbage();
    for field in [
        "x".to_owned(),
        String::new(),
        format!("{today} 1"),
        format!("{today} 1 0 0"),
        format!("{today} -1 0"),
        format!("{today} 1 x"),
        format!("{today} 1 99999999999999999"),
        // A bonus above 2^52, a start past the u64 of ns.
        format!("{today} 1 4503599627370497"),
        "99999999999 1 0".to_owned(),
        format!("{today}  1 0"),
    ] {
        rows.push(vec!["HSET".into(), "day".into(), field.clone()]);
        rows.push(vec![
            "HSET".into(),
            "month".into(),
            format!("{today} 2 0"),
            "day".into(),
            field,
        ]);
    }
    for (n, row) in rows.iter().enumerate() {
        let dirty = format!("dirty-{n}");
        let clean = format!("clean-{n}");
        plant(
            &server,
            &store.key_name("q1", "plan", dirty.as_bytes()),
            row,
        );
        let at = |step: &str| format!("quota garbage {row:?}: {step}");
        let (dirty, clean) = (dirty.as_bytes(), clean.as_bytes());
        assert_eq!(
            quota.refund(dirty, 1).await.unwrap(),
            quota.refund(clean, 1).await.unwrap(),
            "{}",
            at("refund")
        );
        for (step, cost) in [
            ("read", 0),
            ("one", 1),
            ("two", 2),
            ("all", 5),
            ("never", 6),
        ] {
            let got = quota.consume(dirty, cost).await.unwrap();
            let want = quota.consume(clean, cost).await.unwrap();
            assert_eq!(got, want, "{}", at(step));
        }
        assert_eq!(
            quota.grant(dirty, 2).await.unwrap(),
            quota.grant(clean, 2).await.unwrap(),
            "{}",
            at("grant")
        );
    }
    let stats = store.stats();
    assert_eq!((stats.errors, stats.timeouts), (0, 0), "{stats:?}");
}

/// A rule whose algorithm changes (as during a rolling deploy, instances
/// of both at once) keeps one state per algorithm, each in a key that
/// names it; a key of the layout before format tags is never read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_name_the_algorithm_and_its_format() {
    let Some(server) = Server::start() else {
        return;
    };
    let prefix = unique_prefix();
    let clock = ManualClock::starting_at(UNIX_2026);
    let store = store(&server, &prefix, &clock);
    let old = Rule::new("api", Limit::gcra(Rate::per_second(1), 3)).unwrap();
    let new = Rule::new("api", Limit::fixed_window(3, Duration::from_secs(1))).unwrap();
    // Before format tags, rate keys were `{r|rule|key}`.
    let untagged = store.key_name("r", "api", b"k");
    server.cli(&["SET", &untagged, "garbage"]);
    let (old, new) = (store.limiter(&old).unwrap(), store.limiter(&new).unwrap());
    assert!(old.decide(b"k", 3).await.unwrap().is_allowed());
    assert!(!old.decide(b"k", 1).await.unwrap().is_allowed());
    // The other algorithm's instances start from their own, whole budget.
    assert_eq!(new.decide(b"k", 0).await.unwrap().remaining, 3);
    assert!(new.decide(b"k", 2).await.unwrap().is_allowed());
    assert!(!old.decide(b"k", 1).await.unwrap().is_allowed());
    let listed = server.cli(&["--scan", "--pattern", &format!("{prefix}:*")]);
    let mut names: Vec<&str> = listed.lines().filter(|l| !l.is_empty()).collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            store.key_name("fw1", "api", b"k"),
            store.key_name("gcra1", "api", b"k"),
            untagged,
        ]
    );
    let stats = store.stats();
    assert_eq!((stats.errors, stats.timeouts), (0, 0), "{stats:?}");
}

/// A store names its service: without a prefix, `build` fails and says
/// so. The connect timeout, like the call timeout, must not be zero.
#[tokio::test]
async fn a_store_must_be_given_a_prefix() {
    let url = "redis://127.0.0.1:1";
    let err = RedisStore::builder(url).build().unwrap_err();
    assert_eq!(err.field(), "prefix");
    assert!(err.message().contains("name your service"), "{err}");
    assert_eq!(
        RedisStore::builder(url)
            .prefix("")
            .build()
            .unwrap_err()
            .field(),
        "prefix"
    );
    let err = RedisStore::builder(url)
        .prefix("svc")
        .connect_timeout(Duration::ZERO)
        .build()
        .unwrap_err();
    assert_eq!(err.field(), "connect_timeout");
    assert!(RedisStore::builder(url)
        .prefix("svc")
        .connect_timeout(Duration::from_millis(100))
        .build()
        .is_ok());
}

/// Review finding 7 (policy-security): a 43-character API key (32 random
/// bytes in base64url, the commonest shape) was stored in the key name as
/// it is, for `SCAN`, `MONITOR` and every RDB file to show. No client key
/// reaches a name now; under a `key_secret` the names are keyed, and only
/// instances with the same secret share a budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_client_key_reaches_a_key_name_and_a_secret_keys_them() {
    let Some(server) = Server::start() else {
        return;
    };
    let prefix = unique_prefix();
    let with = |secret: Option<&str>| {
        let b = RedisStore::builder(&server.url())
            .prefix(&prefix)
            .timeout(Duration::from_secs(2));
        match secret {
            Some(s) => b.key_secret(s.as_bytes()),
            None => b,
        }
        .build()
        .unwrap()
    };
    let rule = Rule::new("per-key", Limit::gcra(Rate::per_second(1), 2)).unwrap();
    let token = b"Yx3kP0q9Zf7LmN2sT5vW8bC1dE4gH6jK9oR2uX5zA7c";
    let (a, b) = (
        with(Some("fleet secret, 16+")),
        with(Some("fleet secret, 16+")),
    );
    let (other, plain) = (with(Some("another secret..")), with(None));
    let (la, lb) = (a.limiter(&rule).unwrap(), b.limiter(&rule).unwrap());
    assert!(la.decide(token, 2).await.unwrap().is_allowed());
    // The same secret: one budget.
    assert!(!lb.decide(token, 1).await.unwrap().is_allowed());
    // Another secret, or none: other names, other budgets.
    for store in [&other, &plain] {
        let l = store.limiter(&rule).unwrap();
        assert!(l.decide(token, 2).await.unwrap().is_allowed());
    }
    let listed = server.cli(&["--scan", "--pattern", &format!("{prefix}:*")]);
    let names: Vec<&str> = listed.lines().filter(|l| !l.is_empty()).collect();
    assert_eq!(names.len(), 3, "{names:?}");
    for name in names {
        assert!(!name.contains("Yx3kP0q9"), "{name}");
    }
    let short = RedisStore::builder(&server.url())
        .prefix(&prefix)
        .key_secret(&b"short"[..])
        .build();
    assert_eq!(short.unwrap_err().field(), "key_secret");
}
