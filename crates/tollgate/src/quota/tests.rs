use std::convert::Infallible;

use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use tollgate_core::calendar::{unix_nanos, Offset, Period};
use tollgate_core::{ManualClock, QuotaLimiter};
use tower::{service_fn, Layer, ServiceExt};

use super::*;
use crate::cost::HeaderCost;
use crate::key::{Header, KeyBuf};
use crate::MemoryStore;

type Req = Request<String>;

async fn ok(_req: Req) -> Result<Response<String>, Infallible> {
    Ok(Response::new("ok".to_owned()))
}

fn req(key: &str, cost: u64) -> Req {
    Request::builder()
        .uri("/report")
        .header("x-api-key", key)
        .header("x-cost", cost.to_string())
        .body(String::new())
        .unwrap()
}

fn store(clock: &ManualClock) -> MemoryStore<ManualClock> {
    MemoryStore::builder().clock(clock.clone()).build().unwrap()
}

fn key(k: &str) -> Vec<u8> {
    let mut b = KeyBuf::new();
    b.push(k.as_bytes());
    b.as_bytes().to_vec()
}

#[tokio::test]
async fn a_day_and_a_month_are_charged_together_and_renew_at_their_boundaries() {
    // 2026-12-31 22:00 UTC: two hours to the end of the day, the month and
    // the year.
    let clock = ManualClock::at_unix(unix_nanos(2026, 12, 31, 22, 0, 0));
    let layer = QuotaLayer::builder("plan")
        .period(Period::Day, 10)
        .period(Period::Month, 15)
        .key(Header::named("x-api-key").unwrap())
        .cost(HeaderCost::named("x-cost", 1, 100).unwrap())
        .store(store(&clock))
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(ok));
    let res = svc.clone().oneshot(req("a", 8)).await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(
        res.headers()["ratelimit-policy"],
        "\"plan-day\";q=10;w=86400, \"plan-month\";q=15;w=2678400"
    );
    assert_eq!(
        res.headers()["ratelimit"],
        "\"plan-day\";r=2;t=7200, \"plan-month\";r=7;t=7200"
    );
    // Three do not fit today: retry at midnight, and nothing was charged.
    let res = svc.clone().oneshot(req("a", 3)).await.unwrap();
    assert_eq!(res.status(), 429);
    assert_eq!(res.headers()["retry-after"], "7200");
    let body = res.into_body().collect().await.unwrap().to_bytes();
    assert!(std::str::from_utf8(&body)
        .unwrap()
        .contains("renews in 7200 s"));
    // January: both whole again.
    clock.set(unix_nanos(2027, 1, 1, 0, 0, 0));
    let res = svc.clone().oneshot(req("a", 10)).await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(
        res.headers()["ratelimit"],
        "\"plan-day\";r=0;t=86400, \"plan-month\";r=5;t=2678400"
    );
    // Tomorrow the day is whole but the month has 5: 6 wait for February.
    clock.set(unix_nanos(2027, 1, 2, 12, 0, 0));
    let res = svc.clone().oneshot(req("a", 6)).await.unwrap();
    assert_eq!(res.status(), 429);
    let feb = (unix_nanos(2027, 2, 1, 0, 0, 0) - unix_nanos(2027, 1, 2, 12, 0, 0)) / 1_000_000_000;
    assert_eq!(res.headers()["retry-after"], feb.to_string().as_str());
    // Above a period's whole budget: never, no Retry-After.
    let res = svc.clone().oneshot(req("a", 11)).await.unwrap();
    assert_eq!(res.status(), 429);
    assert!(res.headers().get("retry-after").is_none());
}

#[tokio::test]
async fn offsets_move_midnight() {
    // 23:30 UTC on the 2nd is 08:30 on the 3rd in Tokyo.
    let clock = ManualClock::at_unix(unix_nanos(2026, 12, 2, 23, 30, 0));
    let tokyo = Offset::from_hours_minutes(9, 0).unwrap();
    let layer = QuotaLayer::builder("daily")
        .period(Period::Day, 1)
        .offset(tokyo)
        .key(Header::named("x-api-key").unwrap())
        .store(store(&clock))
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(ok));
    let res = svc.clone().oneshot(req("a", 1)).await.unwrap();
    // Tokyo's day ends at 15:00 UTC on the 3rd: 15.5 hours away.
    assert_eq!(res.headers()["ratelimit"], "\"daily\";r=0;t=55800");
    // Past UTC midnight, still the same Tokyo day.
    clock.set(unix_nanos(2026, 12, 3, 0, 30, 0));
    assert_eq!(
        svc.clone().oneshot(req("a", 1)).await.unwrap().status(),
        429
    );
    clock.set(unix_nanos(2026, 12, 3, 15, 0, 0));
    assert_eq!(
        svc.clone().oneshot(req("a", 1)).await.unwrap().status(),
        200
    );
}

/// Quota review #5: an IANA zone's day runs from local midnight to local
/// midnight on the day its clocks go back (25 hours in Berlin), and its
/// `Retry-After` and `t` say when that is.
#[cfg(feature = "tz")]
#[tokio::test]
async fn an_iana_zone_s_day_ends_at_local_midnight_across_daylight_saving() {
    use tollgate_core::calendar::Zone;
    // 23:30 CET on 2026-10-25, the 25-hour day (22:30Z).
    let clock = ManualClock::at_unix(unix_nanos(2026, 10, 25, 22, 30, 0));
    let layer = QuotaLayer::builder("daily")
        .period(Period::Day, 1)
        .zone(Zone::iana("Europe/Berlin").unwrap())
        .key(Header::named("x-api-key").unwrap())
        .store(store(&clock))
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(ok));
    let res = svc.clone().oneshot(req("a", 1)).await.unwrap();
    assert_eq!(res.headers()["ratelimit"], "\"daily\";r=0;t=1800");
    assert_eq!(res.headers()["ratelimit-policy"], "\"daily\";q=1;w=90000");
    let res = svc.clone().oneshot(req("a", 1)).await.unwrap();
    assert_eq!(res.status(), 429);
    assert_eq!(res.headers()["retry-after"], "1800");
    clock.set(unix_nanos(2026, 10, 25, 23, 0, 0));
    assert_eq!(
        svc.clone().oneshot(req("a", 1)).await.unwrap().status(),
        200
    );
}

#[tokio::test]
async fn soft_limit_warns_before_the_hard_stop_and_support_can_grant_and_reset() {
    let clock = ManualClock::at_unix(unix_nanos(2026, 12, 2, 12, 0, 0));
    let layer = QuotaLayer::builder("daily")
        .period(Period::Day, 10)
        .soft_limit(0.8)
        .key(Header::named("x-api-key").unwrap())
        .store(store(&clock))
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(ok));
    for i in 1..=10u64 {
        let res = svc.clone().oneshot(req("a", 1)).await.unwrap();
        assert_eq!(res.status(), 200);
        let warning = res.headers().get("quota-warning");
        if i >= 8 {
            assert_eq!(
                warning.unwrap(),
                format!("\"daily\";used={}", i * 10).as_str()
            );
        } else {
            assert!(warning.is_none(), "request {i}");
        }
    }
    assert_eq!(
        svc.clone().oneshot(req("a", 1)).await.unwrap().status(),
        429
    );
    // Support staff give five more today, to the key the layer gives the
    // client's requests (quota-bandwidth-retry review #6: a bare b"a" is
    // another key, with whole budgets).
    let k = layer.key_for(&req("a", 1)).unwrap();
    assert_eq!(k, key("a"));
    assert_ne!(k, b"a".to_vec());
    assert_eq!(
        layer
            .usage_for(&req("a", 1))
            .await
            .unwrap()
            .unwrap()
            .periods()[0]
            .remaining,
        0
    );
    assert!(layer
        .usage_for(&Request::new(String::new()))
        .await
        .unwrap()
        .is_none());
    let usage = layer.limiter().grant(&k, 5).await.unwrap();
    assert_eq!(usage.periods()[0].remaining, 5);
    for _ in 0..5 {
        assert_eq!(
            svc.clone().oneshot(req("a", 1)).await.unwrap().status(),
            200
        );
    }
    assert_eq!(
        svc.clone().oneshot(req("a", 1)).await.unwrap().status(),
        429
    );
    assert_eq!(
        layer.limiter().consume(&k, 0).await.unwrap().periods()[0].remaining,
        0
    );
    let usage = layer.limiter().reset(&k).await.unwrap();
    assert_eq!(usage.periods()[0].remaining, 10);
    assert_eq!(
        svc.clone().oneshot(req("a", 1)).await.unwrap().status(),
        200
    );
}

#[tokio::test]
async fn shadow_mode_counts_but_never_refuses() {
    let clock = ManualClock::at_unix(unix_nanos(2026, 12, 2, 12, 0, 0));
    let layer = QuotaLayer::builder("daily")
        .period(Period::Day, 1)
        .shadow(true)
        .key(Header::named("x-api-key").unwrap())
        .store(store(&clock))
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(ok));
    for _ in 0..3 {
        let res = svc.clone().oneshot(req("a", 1)).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
    }
    let res = svc.clone().oneshot(req("a", 1)).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert!(res.headers().get("ratelimit").is_none(), "shadow headers");
    // Counted all along.
    let used = layer.limiter().consume(&key("a"), 0).await.unwrap();
    assert_eq!(used.periods()[0].remaining, 0);
}

#[test]
fn configuration_errors_name_the_field() {
    let e = |b: QuotaLayerBuilder<_, _, MemoryStore>| b.build().map(drop).unwrap_err().field();
    assert_eq!(e(QuotaLayer::builder("q")), "periods");
    assert_eq!(e(QuotaLayer::builder("q").period(Period::Day, 0)), "limit");
    assert_eq!(
        e(QuotaLayer::builder("q")
            .period(Period::Day, 1)
            .period(Period::Day, 2)),
        "periods"
    );
    assert_eq!(
        e(QuotaLayer::builder("q")
            .period(Period::Day, 1)
            .soft_limit(1.5)),
        "soft_limit"
    );
    assert_eq!(
        e(QuotaLayer::builder("bad name").period(Period::Day, 1)),
        "name"
    );
    let day = QuotaLayer::builder("q").period(Period::Day, 1);
    // Plans: a source is needed, names are unique, budgets valid.
    assert_eq!(e(day.plan("pro", &[(Period::Day, 10)])), "plans");
    let day = || {
        QuotaLayer::builder("q")
            .period(Period::Day, 1)
            .plan_from_extension()
    };
    assert_eq!(
        e(day()
            .plan("pro", &[(Period::Day, 10)])
            .plan("pro", &[(Period::Day, 20)])),
        "plans"
    );
    assert_eq!(e(day().plan("pro", &[(Period::Day, 0)])), "plans");
    assert_eq!(e(day().plan("pro", &[])), "plans");
    assert_eq!(e(day().plan("", &[(Period::Day, 10)])), "plans");
}

/// Access lists, as a policy's: an allowed key is not charged, a denied
/// one is refused at once with 403.
#[tokio::test]
async fn access_lists_skip_or_refuse_before_the_quota() {
    let clock = ManualClock::at_unix(unix_nanos(2026, 12, 2, 12, 0, 0));
    let list = crate::policy::AccessList::new("access")
        .keys_from("x-api-key")
        .unwrap()
        .allow_keys(["internal"])
        .deny_keys(["banned"]);
    let layer = QuotaLayer::builder("daily")
        .period(Period::Day, 1)
        .key(Header::named("x-api-key").unwrap())
        .access(list)
        .store(store(&clock))
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(ok));
    for _ in 0..3 {
        let res = svc.clone().oneshot(req("internal", 1)).await.unwrap();
        assert_eq!(res.status(), 200);
        assert!(res.headers().get("ratelimit").is_none());
    }
    let used = layer.limiter().consume(&key("internal"), 0).await.unwrap();
    assert_eq!(used.periods()[0].remaining, 1, "never charged");
    let res = svc.clone().oneshot(req("banned", 1)).await.unwrap();
    assert_eq!(res.status(), 403);
    assert_eq!(
        svc.clone().oneshot(req("a", 1)).await.unwrap().status(),
        200
    );
    assert_eq!(
        svc.clone().oneshot(req("a", 1)).await.unwrap().status(),
        429
    );
    // A key list with no header to read keys from is an error.
    let unread = crate::policy::AccessList::new("a").allow_keys(["k"]);
    let e = QuotaLayer::builder("q")
        .period(Period::Day, 1)
        .access(unread)
        .build()
        .map(drop)
        .unwrap_err();
    assert_eq!(e.field(), "access");
}

/// Each plan has budgets of its own, kept apart from the default's; an
/// unknown plan is the default; a key's plan change applies at its next
/// request; support staff reach a plan's usage through its limiter.
#[tokio::test]
async fn each_plan_has_its_own_budgets() {
    let clock = ManualClock::at_unix(unix_nanos(2026, 12, 2, 12, 0, 0));
    let layer = QuotaLayer::builder("daily")
        .period(Period::Day, 2)
        .plan("pro", &[(Period::Day, 5), (Period::Month, 100)])
        .plan_from_extension()
        .key(Header::named("x-api-key").unwrap())
        .store(store(&clock))
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(ok));
    let on = |k: &str, plan: Option<&str>| {
        let mut r = req(k, 1);
        if let Some(p) = plan {
            r.extensions_mut().insert(crate::policy::Plan::new(p));
        }
        r
    };
    // Free (no plan, or an unknown one): 2 a day.
    for plan in [None, Some("gold")] {
        let res = svc.clone().oneshot(on("a", plan)).await.unwrap();
        assert_eq!(res.status(), 200);
        assert_eq!(res.headers()["ratelimit-policy"], "\"daily\";q=2;w=86400");
    }
    assert_eq!(
        svc.clone().oneshot(on("a", None)).await.unwrap().status(),
        429
    );
    // The same key on pro: the pro budgets, whole (the free ones are
    // kept apart), shown in the headers.
    let res = svc.clone().oneshot(on("a", Some("pro"))).await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(
        res.headers()["ratelimit-policy"],
        "\"daily-day\";q=5;w=86400, \"daily-month\";q=100;w=2678400"
    );
    assert_eq!(
        res.headers()["ratelimit"],
        "\"daily-day\";r=4;t=43200, \"daily-month\";r=99;t=2548800"
    );
    for _ in 0..4 {
        let res = svc.clone().oneshot(on("a", Some("pro"))).await.unwrap();
        assert_eq!(res.status(), 200);
    }
    let res = svc.clone().oneshot(on("a", Some("pro"))).await.unwrap();
    assert_eq!(res.status(), 429);
    assert_eq!(res.headers()["retry-after"], "43200");
    // Back on free: still spent.
    assert_eq!(
        svc.clone().oneshot(on("a", None)).await.unwrap().status(),
        429
    );
    // Administration per plan.
    let pro = layer.plan_limiter("pro").unwrap();
    assert_eq!(
        pro.consume(&key("a"), 0).await.unwrap().periods()[0].remaining,
        0
    );
    assert_eq!(
        layer
            .limiter()
            .consume(&key("a"), 0)
            .await
            .unwrap()
            .periods()[0]
            .remaining,
        0
    );
    pro.grant(&key("a"), 1).await.unwrap();
    assert_eq!(
        svc.clone()
            .oneshot(on("a", Some("pro")))
            .await
            .unwrap()
            .status(),
        200
    );
    assert!(layer.plan_limiter("gold").is_none());
}

/// Each period's used share is recorded at every decision, by rule and
/// period, never by key.
#[tokio::test]
async fn what_each_period_has_used_is_recorded_at_each_decision() {
    let recorder = crate::rate_limit::tests::Recorded::default();
    let clock = ManualClock::at_unix(unix_nanos(2026, 12, 3, 12, 0, 0));
    let layer = metrics::with_local_recorder(&recorder, || {
        QuotaLayer::builder("plan")
            .period(Period::Day, 4)
            .period(Period::Month, 10)
            .key(Header::named("x-api-key").unwrap())
            .cost(HeaderCost::named("x-cost", 1, 100).unwrap())
            .store(store(&clock))
            .build()
            .unwrap()
    });
    let svc = layer.layer(service_fn(ok));
    for (cost, status) in [(1, 200), (2, 200), (2, 429)] {
        let res = svc.clone().oneshot(req("secret", cost)).await.unwrap();
        assert_eq!(res.status(), status);
    }
    // Admitted: what the charge brought it to; refused: what it stood at.
    assert_eq!(
        recorder.samples("tollgate_quota_used_ratio{rule=plan,period=day}"),
        [0.25, 0.75, 0.75]
    );
    assert_eq!(
        recorder.samples("tollgate_quota_used_ratio{rule=plan,period=month}"),
        [0.1, 0.3, 0.3]
    );
}

/// Review finding 8 (quota): requests an inner limit refused, or the
/// service failed, were charged like served ones.
#[tokio::test]
async fn a_request_that_was_not_served_gets_its_charge_back() {
    let clock = ManualClock::at_unix(unix_nanos(2026, 12, 2, 12, 0, 0));
    let quota = |refund: bool| {
        QuotaLayer::builder("day")
            .period(Period::Day, 100)
            .key(Header::named("x-api-key").unwrap())
            .cost(HeaderCost::named("x-cost", 1, 100).unwrap())
            .store(store(&clock))
            .refund_unserved(refund)
            .build()
            .unwrap()
    };
    // The service answers as `x-answer` says; an inner rate limit of one
    // request refuses the second of each key.
    let service = |req: Req| async move {
        let mut res = Response::new(String::new());
        match req.headers().get("x-answer").map(|v| v.as_bytes()) {
            Some(b"500") => *res.status_mut() = StatusCode::INTERNAL_SERVER_ERROR,
            Some(b"404") => *res.status_mut() = StatusCode::NOT_FOUND,
            Some(b"grpc-14") => {
                res.headers_mut()
                    .insert("content-type", "application/grpc".parse().unwrap());
                res.headers_mut()
                    .insert("grpc-status", "14".parse().unwrap());
            }
            _ => {}
        }
        Ok::<_, Infallible>(res)
    };
    let inner_limit =
        crate::RateLimitLayer::builder("inner", crate::Limit::gcra(crate::Rate::per_hour(1), 1))
            .key(Header::named("x-api-key").unwrap())
            .build()
            .unwrap();
    let with = |key: &str, answer: &str| {
        let mut r = req(key, 10);
        r.headers_mut().insert("x-answer", answer.parse().unwrap());
        r
    };
    let left = |res: &Response<String>| {
        res.headers()["ratelimit"]
            .to_str()
            .unwrap()
            .split(";t=")
            .next()
            .unwrap()
            .to_owned()
    };
    let layer = quota(true);
    let svc = layer.layer(inner_limit.layer(service_fn(service)));
    // Served: charged. A 404 is an answer: charged.
    let res = svc.clone().oneshot(with("a", "200")).await.unwrap();
    assert_eq!(left(&res), "\"day\";r=90");
    // The inner limit refuses a's second: given back.
    let res = svc.clone().oneshot(with("a", "200")).await.unwrap();
    assert_eq!(res.status(), 429);
    let usage = layer.limiter().consume(&key("a"), 0).await.unwrap();
    assert_eq!(usage.periods()[0].remaining, 90);
    // And the refusal's own header says so: 90 left, not 80.
    assert_eq!(
        res.headers()["ratelimit"]
            .to_str()
            .unwrap()
            .split(", ")
            .find(|i| i.starts_with("\"day\""))
            .map(|i| i.split(";t=").next().unwrap()),
        Some("\"day\";r=90")
    );
    for (k, answer, charged) in [
        ("b", "500", false),
        ("c", "grpc-14", false),
        ("d", "404", true),
    ] {
        svc.clone().oneshot(with(k, answer)).await.unwrap();
        let usage = layer.limiter().consume(&key(k), 0).await.unwrap();
        let want = if charged { 90 } else { 100 };
        assert_eq!(usage.periods()[0].remaining, want, "{answer}");
    }
    // Off: every admitted request is charged.
    let layer = quota(false);
    let svc = layer.layer(service_fn(service));
    svc.clone().oneshot(with("e", "500")).await.unwrap();
    let usage = layer.limiter().consume(&key("e"), 0).await.unwrap();
    assert_eq!(usage.periods()[0].remaining, 90);
}

/// Review finding 13 (quota): a request too costly for the day was told
/// it costs more than the month's budget, which it did not.
#[tokio::test]
async fn a_request_no_period_can_hold_names_the_budget_it_exceeds() {
    let clock = ManualClock::at_unix(unix_nanos(2026, 12, 2, 12, 0, 0));
    let layer = QuotaLayer::builder("plan")
        .period(Period::Day, 1_000)
        .period(Period::Month, 20_000)
        .key(Header::named("x-api-key").unwrap())
        .cost(HeaderCost::named("x-cost", 1, 100_000).unwrap())
        .store(store(&clock))
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(ok));
    let res = svc.oneshot(req("a", 5_000)).await.unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    let body = res.into_body().collect().await.unwrap().to_bytes();
    let body = std::str::from_utf8(&body).unwrap();
    assert!(body.contains("(1000)"), "{body}");
    assert!(!body.contains("20000"), "{body}");
}
