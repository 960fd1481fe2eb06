use super::cache::*;
use super::merge::SCANNED;
use super::render::*;
use super::*;
use http::header::{HeaderName, HeaderValue};
use http::HeaderMap;
use std::time::Duration;
use tollgate_core::Rule;
use tollgate_core::{Limit, Rate};

fn decision(outcome: Outcome, remaining: u64, reset: u64) -> Decision {
    Decision {
        outcome,
        limit: 20,
        remaining,
        reset_after: reset,
    }
}

#[test]
fn structured_fields_and_retry_after() {
    let rule = Rule::new("per-key", Limit::gcra(Rate::per_second(10), 20)).unwrap();
    let h = Headers::new(&rule, true, true);
    let mut m = HeaderMap::new();
    h.apply(
        &mut m,
        &decision(
            Outcome::Deny {
                retry_after: 100_000_000,
            },
            0,
            2_000_000_000,
        ),
        true,
    );
    assert_eq!(m["ratelimit-policy"], "\"per-key\";q=20;w=2");
    assert_eq!(m["ratelimit"], "\"per-key\";r=0;t=1");
    assert_eq!(m["retry-after"], "1");
    assert_eq!(m["x-ratelimit-limit"], "20");
    assert_eq!(m["x-ratelimit-remaining"], "0");
    assert_eq!(m["x-ratelimit-reset"], "1");

    let mut m = HeaderMap::new();
    h.apply(
        &mut m,
        &decision(Outcome::Allow { delay: 0 }, 17, 300_000_000),
        false,
    );
    assert_eq!(m["ratelimit"], "\"per-key\";r=17;t=1");
    assert!(m.get("retry-after").is_none());

    // A denial let through (shadow mode) reports but does not tell the
    // client to retry later.
    let mut m = HeaderMap::new();
    h.apply(
        &mut m,
        &decision(Outcome::Deny { retry_after: 1 }, 0, 1),
        false,
    );
    assert_eq!(m["ratelimit"], "\"per-key\";r=0;t=1");
    assert!(m.get("retry-after").is_none());
}

#[test]
fn remembered_values_belong_to_their_rule_and_numbers() {
    // Two rules, the same numbers: each response names its own rule,
    // however the cache's slots are shared, evicted and hit again
    // (far more values than it holds, each asked for twice).
    let rule = |name: &str| Rule::new(name, Limit::gcra(Rate::per_second(10), 20)).unwrap();
    let (a, b) = (
        Headers::new(&rule("a"), true, false),
        Headers::new(&rule("b"), true, false),
    );
    for round in 0..2 {
        for r in 0..(4 * RECENT as u64) {
            for (h, name) in [(&a, "a"), (&b, "b")] {
                let t = r % 3;
                let mut m = HeaderMap::new();
                let d = decision(Outcome::Allow { delay: 0 }, r, t * 1_000_000_000);
                h.apply(&mut m, &d, false);
                assert_eq!(
                    m["ratelimit"],
                    format!("\"{name}\";r={r};t={t}").as_str(),
                    "round {round}"
                );
            }
        }
    }
    // Two rules whose values share a set of ways (same numbers), and
    // neither is ever sent the other's.
    let mut c = Headers::new(&rule("c"), true, false);
    // (An id no other header set has: past every one made so far.)
    c.id = (new_id()..)
        .find(|&id| {
            let at = |id| Values::set_of(hash_of(id, &numbers(&[7, 1]).unwrap()));
            at(id) == at(a.id)
        })
        .unwrap();
    for _ in 0..3 {
        for (h, name) in [(&a, "a"), (&c, "c")] {
            let mut m = HeaderMap::new();
            h.apply(
                &mut m,
                &decision(Outcome::Allow { delay: 0 }, 7, 1_000_000_000),
                false,
            );
            assert_eq!(m["ratelimit"], format!("\"{name}\";r=7;t=1").as_str());
        }
    }
}

#[test]
fn values_sent_again_stay_remembered() {
    let renders = std::cell::Cell::new(0);
    let render = || {
        renders.set(renders.get() + 1);
        Some(HeaderValue::from_static("x"))
    };
    // Ids whose values of [1] share one set of ways.
    let set = |id| Values::set_of(hash_of(id, &numbers(&[1]).unwrap()));
    let base = new_id();
    let ids: Vec<u64> = (base..)
        .filter(|&id| set(id) == set(base))
        .take(WAYS + 20)
        .collect();
    // A value is kept the second time it is rendered: as many values
    // as the set has ways, sent in turn, are each rendered twice.
    for _ in 0..10 {
        for &id in &ids[..WAYS] {
            remembered(id, &[1], render);
        }
    }
    assert_eq!(renders.get(), 2 * WAYS);
    // Other numbers are another value, rendered (twice) on their own.
    renders.set(0);
    for _ in 0..3 {
        remembered(ids[0], &[2], render);
        remembered(ids[0], &[1, 0], render);
    }
    assert_eq!(renders.get(), 4);
    // Two values sent on every response, and a stream of values sent
    // once into the same set: once the two are kept again (they were
    // the least recently sent when the stream began), they are never
    // rendered again.
    let (a, b) = (ids[0], ids[1]);
    for (i, &once) in ids[WAYS..].iter().enumerate() {
        if i == 2 {
            renders.set(0);
        }
        remembered(once, &[1], render);
        remembered(a, &[1], render);
        remembered(b, &[1], render);
    }
    assert_eq!(renders.get(), 18);
}

#[test]
fn remembered_multi_item_values_follow_every_number() {
    // Concurrency: two layers of the same shape but other names, an
    // adaptive q, every r; each value is the one formatted for it.
    let allow = |r| decision(Outcome::Allow { delay: 0 }, r, 0);
    let layers = [("a", "svc"), ("b", "svc")]
        .map(|(k, s)| (k, ConcurrencyHeaders::new(&[(k, Some(8)), (s, None)], true)));
    for round in 0..2 {
        for q in [10u64, 11] {
            for r in 0..8 {
                for (k, h) in &layers {
                    let mut m = HeaderMap::new();
                    h.apply(
                        &mut m,
                        &[
                            Item::new(8, Some(allow(r))),
                            Item::new(q, Some(allow(q - 1))),
                        ],
                    );
                    let want = format!("\"{k}\";r={r}, \"svc\";r={}", q - 1);
                    assert_eq!(m["ratelimit"], want.as_str(), "round {round}");
                    let policy = format!(
                        "\"{k}\";q=8;qu=\"concurrent-requests\", \"svc\";q={q};qu=\"concurrent-requests\""
                    );
                    assert_eq!(m["ratelimit-policy"], policy.as_str());
                }
            }
        }
    }
    // Rule sets: the same numbers for other rules, or the same rules
    // in another order, are other values.
    let rule = |n: &str| Rule::new(n, Limit::gcra(Rate::per_second(10), 20)).unwrap();
    let (x, y, z) = (
        Headers::new(&rule("x"), true, false),
        Headers::new(&rule("y"), true, false),
        Headers::new(&rule("z"), true, false),
    );
    for round in 0..2 {
        for r in 0..50 {
            for (set, want) in [
                ([&x, &y], format!("\"x\";r={r};t=0, \"y\";r={r};t=0")),
                ([&y, &x], format!("\"y\";r={r};t=0, \"x\";r={r};t=0")),
                ([&x, &z], format!("\"x\";r={r};t=0, \"z\";r={r};t=0")),
            ] {
                let items = set.map(|h| (h, allow(r)));
                let mut m = HeaderMap::new();
                apply_set(&mut m, &items, None, None, true, false, None);
                assert_eq!(m["ratelimit"], want.as_str(), "round {round}");
            }
        }
    }
    // Quota: two periods; the remaining count and the seconds left.
    use tollgate_core::calendar::Period;
    use tollgate_core::{PeriodStatus, QuotaDecision};
    let h = QuotaHeaders::new(&["day".to_owned(), "month".to_owned()], true);
    let s = 1_000_000_000;
    for round in 0..2 {
        for used in 0..100u64 {
            let status = |period, limit: u64, left: u64| PeriodStatus {
                period,
                limit,
                remaining: limit - used,
                reset_after: left * s,
                length: 86_400 * s,
            };
            let d = QuotaDecision::new(
                Outcome::Allow { delay: 0 },
                &[
                    status(Period::Day, 100, used % 7),
                    status(Period::Month, 3_000, 9),
                ],
            );
            let mut m = HeaderMap::new();
            h.apply(&mut m, &d);
            let want = format!(
                "\"day\";r={};t={}, \"month\";r={};t=9",
                100 - used,
                used % 7,
                3_000 - used
            );
            assert_eq!(m["ratelimit"], want.as_str(), "round {round}");
            assert_eq!(
                m["ratelimit-policy"],
                "\"day\";q=100;w=86400, \"month\";q=3000;w=86400"
            );
        }
    }
}

#[test]
fn numbers_format_like_display() {
    for n in [0, 1, 9, 10, 99, 100, 1_023, 1_024, 12_345, u64::MAX] {
        let mut b = Buf::new();
        b.push_u64(n);
        assert_eq!(b.as_bytes(), n.to_string().as_bytes());
        assert_eq!(number(n).unwrap(), n.to_string().as_str());
    }
}

#[test]
fn retry_after_rounds_up_and_is_never_zero() {
    assert_eq!(retry_after_secs(0), 1);
    assert_eq!(retry_after_secs(1), 1);
    assert_eq!(retry_after_secs(1_000_000_000), 1);
    assert_eq!(retry_after_secs(1_000_000_001), 2);
    assert_eq!(retry_after_secs(u64::MAX), 18_446_744_074);
}

#[test]
fn concurrency_items_name_every_limit() {
    let h = ConcurrencyHeaders::new(&[("per-key", Some(2)), ("service", Some(100))], true);
    let mut m = HeaderMap::new();
    let allow = decision(Outcome::Allow { delay: 0 }, 1, 0);
    let busy = decision(
        Outcome::Deny {
            retry_after: 1_000_000_000,
        },
        0,
        0,
    );
    h.apply(
        &mut m,
        &[Item::new(2, Some(allow)), Item::new(100, Some(busy))],
    );
    assert_eq!(
        m["ratelimit-policy"],
        "\"per-key\";q=2;qu=\"concurrent-requests\", \"service\";q=100;qu=\"concurrent-requests\""
    );
    assert_eq!(m["ratelimit"], "\"per-key\";r=1, \"service\";r=0;t=1");
    // An adaptive limit's q is rendered per response; an undecided
    // limit has no RateLimit item.
    let h = ConcurrencyHeaders::new(&[("per-key", Some(2)), ("adaptive", None)], true);
    let mut m = HeaderMap::new();
    h.apply(&mut m, &[Item::new(2, Some(busy)), Item::new(37, None)]);
    assert_eq!(
        m["ratelimit-policy"],
        "\"per-key\";q=2;qu=\"concurrent-requests\", \"adaptive\";q=37;qu=\"concurrent-requests\""
    );
    assert_eq!(m["ratelimit"], "\"per-key\";r=0;t=1");
    // One limit: the values are rendered ahead, the same as formatted.
    let h = ConcurrencyHeaders::new(&[("one", Some(3))], true);
    for r in 0..=3 {
        let mut m = HeaderMap::new();
        h.apply(
            &mut m,
            &[Item::new(
                3,
                Some(decision(Outcome::Allow { delay: 0 }, r, 0)),
            )],
        );
        assert_eq!(m["ratelimit"], format!("\"one\";r={r}").as_str());
        assert_eq!(
            m["ratelimit-policy"],
            "\"one\";q=3;qu=\"concurrent-requests\""
        );
    }
}

#[test]
fn joins_are_remembered_only_for_the_same_parts() {
    let rule = Rule::new("outer", Limit::gcra(Rate::per_second(10), 20)).unwrap();
    let h = Headers::new(&rule, true, false);
    for round in 0..3 {
        for r in 0..5 {
            for inner in 0..5 {
                // An inner value in fresh bytes each time (freed with
                // the response, so the next one may take its place),
                // and one that stays where it is.
                let fresh = HeaderValue::from_str(&format!("\"inner\";r={inner}")).unwrap();
                let kept = HeaderValue::from_static("\"kept\";r=9");
                for (theirs, text) in [
                    (fresh, format!("\"inner\";r={inner}")),
                    (kept, "\"kept\";r=9".to_owned()),
                ] {
                    let mut m = HeaderMap::new();
                    m.insert(field::ratelimit(), theirs);
                    h.apply(&mut m, &decision(Outcome::Allow { delay: 0 }, r, 0), false);
                    let want = format!("\"outer\";r={r};t=0, {text}");
                    assert_eq!(m["ratelimit"], want.as_str(), "round {round}");
                    assert_eq!(m.get_all("ratelimit").iter().count(), 1);
                }
            }
        }
    }
}

#[test]
fn stacked_layers_share_one_field() {
    let rule = Rule::new("per-key", Limit::gcra(Rate::per_second(10), 20)).unwrap();
    let h = Headers::new(&rule, true, false);
    let mut m = HeaderMap::new();
    m.insert(
        field::ratelimit(),
        HeaderValue::from_static("\"inner\";r=1"),
    );
    h.apply(&mut m, &decision(Outcome::Allow { delay: 0 }, 17, 0), false);
    assert_eq!(m["ratelimit"], "\"per-key\";r=17;t=0, \"inner\";r=1");
    assert_eq!(m.get_all("ratelimit").iter().count(), 1);
}

#[test]
fn an_inner_field_is_found_among_few_fields_or_many() {
    let rule = Rule::new("outer", Limit::gcra(Rate::per_second(10), 20)).unwrap();
    let h = Headers::new(&rule, true, false);
    // Around SCANNED, where the search for the name changes method;
    // the inner field first, last, or absent.
    for others in [0, 1, SCANNED - 1, SCANNED, SCANNED + 1, 3 * SCANNED] {
        for inner in [None, Some(0), Some(others)] {
            let mut m = HeaderMap::new();
            for i in 0..=others {
                if inner == Some(i) {
                    m.insert(field::ratelimit(), HeaderValue::from_static("\"in\";r=1"));
                }
                if i < others {
                    let name = HeaderName::try_from(format!("x-other-{i}")).unwrap();
                    m.insert(name, HeaderValue::from_static("1"));
                }
            }
            h.apply(&mut m, &decision(Outcome::Allow { delay: 0 }, 3, 0), false);
            let want = match inner {
                Some(_) => "\"outer\";r=3;t=0, \"in\";r=1",
                None => "\"outer\";r=3;t=0",
            };
            let case = format!("{others} others, inner at {inner:?}");
            assert_eq!(m["ratelimit"], want, "{case}");
            assert_eq!(m.get_all("ratelimit").iter().count(), 1, "{case}");
            assert_eq!(m.get_all("ratelimit-policy").iter().count(), 1, "{case}");
        }
    }
}

#[test]
fn every_field_line_of_an_inner_limiter_is_kept() {
    let rule = Rule::new("outer", Limit::gcra(Rate::per_second(10), 20)).unwrap();
    let h = Headers::new(&rule, true, false);
    let mut m = HeaderMap::new();
    m.append(field::ratelimit(), HeaderValue::from_static("\"a\";r=1"));
    m.append(field::ratelimit(), HeaderValue::from_static(""));
    m.append(field::ratelimit(), HeaderValue::from_static("\"b\";r=2"));
    h.apply(&mut m, &decision(Outcome::Allow { delay: 0 }, 17, 0), false);
    assert_eq!(m["ratelimit"], "\"outer\";r=17;t=0, \"a\";r=1, \"b\";r=2");
    assert_eq!(m.get_all("ratelimit").iter().count(), 1);
}

#[test]
fn a_rule_set_lists_every_rule_in_one_field() {
    let a = Rule::new("per-key", Limit::gcra(Rate::per_second(10), 20)).unwrap();
    let b = Rule::new("per-ip", Limit::fixed_window(100, Duration::from_secs(60))).unwrap();
    let (ha, hb) = (Headers::new(&a, true, true), Headers::new(&b, true, true));
    let mut m = HeaderMap::new();
    let deny = Decision {
        outcome: Outcome::Deny {
            retry_after: 30_000_000_000,
        },
        limit: 100,
        remaining: 0,
        reset_after: 30_000_000_000,
    };
    let items = [
        (&ha, decision(Outcome::Allow { delay: 0 }, 17, 300_000_000)),
        (&hb, deny),
    ];
    apply_set(
        &mut m,
        &items,
        None,
        Some(30_000_000_000),
        true,
        true,
        Some(1),
    );
    assert_eq!(
        m["ratelimit-policy"],
        "\"per-key\";q=20;w=2, \"per-ip\";q=100;w=60"
    );
    assert_eq!(m["ratelimit"], "\"per-key\";r=17;t=1, \"per-ip\";r=0;t=30");
    assert_eq!(m["retry-after"], "30");
    // The legacy headers describe the rule that holds the request back.
    assert_eq!(m["x-ratelimit-limit"], "100");
    assert_eq!(m["x-ratelimit-reset"], "30");
}

#[test]
fn policy_window_is_whole_seconds() {
    let rule = Rule::new("w", Limit::fixed_window(5, Duration::from_millis(1_500))).unwrap();
    let h = Headers::new(&rule, true, false);
    let mut m = HeaderMap::new();
    h.apply(&mut m, &decision(Outcome::Allow { delay: 0 }, 4, 0), false);
    assert_eq!(m["ratelimit-policy"], "\"w\";q=5;w=2");
    assert!(m.get("x-ratelimit-limit").is_none());
}

#[test]
fn shares_are_exact_at_their_thresholds() {
    // The review's case: 0.56 of 100 is 56.
    assert!(is_past(56, 100, 0.56));
    assert!(!is_past(55, 100, 0.56));
    for (used, limit, share) in [
        (7, 10, 0.7),
        (29, 100, 0.29),
        (3, 3, 1.0),
        (1, 3, 0.333_333),
    ] {
        assert!(is_past(used, limit, share), "{used}/{limit} at {share}");
        assert!(
            !is_past(used - 1, limit, share),
            "{}/{limit} at {share}",
            used - 1
        );
    }
    assert!(!is_past(0, 0, 0.5));
    assert!(is_past(u64::MAX, u64::MAX, 1.0));
}

#[test]
fn fields_held_back_read_as_items_added_one_after_another() {
    // A composed layer holds its limits' items back and builds each field
    // once: the result must be what adding them one by one gives, with
    // the service's own lines kept after ours, for our usual fields and
    // for more fields than it groups at once.
    let mut names: Vec<HeaderName> = [
        "ratelimit",
        "ratelimit-policy",
        "ratelimit",
        "quota-warning",
    ]
    .into_iter()
    .map(HeaderName::from_static)
    .collect();
    for i in 0..10 {
        names.push(HeaderName::from_bytes(format!("x-field-{i}").as_bytes()).unwrap());
        names.push(HeaderName::from_static("ratelimit"));
    }
    let items: Vec<(HeaderName, HeaderValue)> = names
        .into_iter()
        .enumerate()
        .map(|(i, n)| {
            (
                n,
                HeaderValue::from_str(&format!("\"l{i}\";r={i}")).unwrap(),
            )
        })
        .collect();
    let service = || {
        let mut m = HeaderMap::new();
        m.append("ratelimit", HeaderValue::from_static("\"svc\";r=1"));
        m.append("ratelimit", HeaderValue::from_static("\"svc2\";r=2"));
        m.append("x-field-3", HeaderValue::from_static("theirs"));
        m
    };
    let mut one_by_one = service();
    for (n, v) in &items {
        add_items(&mut one_by_one, n.clone(), v.clone());
    }
    let mut held_back = service();
    let deferred = Deferred::start().unwrap();
    for (n, v) in &items {
        add_items(&mut held_back, n.clone(), v.clone());
    }
    assert_eq!(held_back, service(), "nothing is added while held back");
    deferred.finish(&mut held_back);
    assert_eq!(held_back, one_by_one);
    // Held back and dropped without a response: nothing is kept, and
    // items are added at once again.
    let dropped = Deferred::start().unwrap();
    add_items(
        &mut HeaderMap::new(),
        HeaderName::from_static("ratelimit"),
        HeaderValue::from_static("\"x\""),
    );
    drop(dropped);
    let mut m = HeaderMap::new();
    add_items(
        &mut m,
        HeaderName::from_static("ratelimit"),
        HeaderValue::from_static("\"y\""),
    );
    assert_eq!(m["ratelimit"], "\"y\"");
    let again = Deferred::start().unwrap();
    assert!(again.holds_none());
}
