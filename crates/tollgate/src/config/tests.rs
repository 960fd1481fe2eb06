use std::convert::Infallible;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use tollgate_core::{Limiter, ManualClock, Store};
use tower::{service_fn, Layer, Service, ServiceExt};

use super::*;
use crate::MemoryStore;

type Req = Request<String>;

const QUICK: &str = r#"
plan_from = "header:x-plan"

[costs.api]
default = 1
routes = [
    { method = "POST", path = "/api/orders", cost = 3 },
    { method = "POST", path = "/api/reports", cost = 10 },
]

[[rules]]
name = "per-key"
key = "header:x-api-key | client-ip"
rate = "10/s"
burst = 20
cost = "api"
plans.pro = { rate = "100/s", burst = 200 }

[[rules]]
name = "per-ip"
key = "client-ip"
rate = "100/s"
burst = 400
cost = "api"
"#;

fn store(clock: &ManualClock) -> MemoryStore<ManualClock> {
    MemoryStore::builder().clock(clock.clone()).build().unwrap()
}

fn req(method: &str, path: &str, key: &str) -> Req {
    let mut r = Request::builder()
        .method(method)
        .uri(path)
        .header("x-api-key", key)
        .body(String::new())
        .unwrap();
    r.extensions_mut()
        .insert("203.0.113.9:4000".parse::<std::net::SocketAddr>().unwrap());
    r
}

/// A `GET /` with API key `k` from the peer `ip`.
fn from(ip: &str) -> Req {
    let mut r = req("GET", "/", "k");
    r.extensions_mut().insert(
        format!("{ip}:4000")
            .parse::<std::net::SocketAddr>()
            .unwrap(),
    );
    r
}

async fn status<S>(svc: &mut S, r: Req) -> (StatusCode, Option<String>)
where
    S: Service<Req, Response = Response<String>, Error = Infallible>,
{
    let res = svc.ready().await.unwrap().call(r).await.unwrap();
    let policy = res
        .headers()
        .get("ratelimit-policy")
        .map(|v| v.to_str().unwrap().to_owned());
    (res.status(), policy)
}

fn ok_service(
) -> impl Service<Req, Response = Response<String>, Error = Infallible, Future = impl Send> + Clone + Send
{
    service_fn(|_r: Req| async { Ok::<_, Infallible>(Response::new("ok".to_owned())) })
}

#[tokio::test]
async fn a_file_declares_what_the_builder_does() {
    let clock = ManualClock::new();
    let file = PolicyFile::parse(QUICK).unwrap();
    let layer = file.layer::<String, _>(&store(&clock)).unwrap();
    assert_eq!(layer.rule_names(), ["per-key", "per-ip"]);
    let mut svc = layer.layer(ok_service());
    let (s, policy) = status(&mut svc, req("GET", "/api/hello", "a")).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        policy.as_deref(),
        Some(r#""per-key";q=20;w=2, "per-ip";q=400;w=4"#)
    );
    // Reports cost 10 of the 20: two pass, the third is refused.
    for _ in 0..1 {
        assert_eq!(
            status(&mut svc, req("POST", "/api/reports", "b")).await.0,
            StatusCode::OK
        );
    }
    assert_eq!(
        status(&mut svc, req("POST", "/api/reports", "b")).await.0,
        StatusCode::OK
    );
    assert_eq!(
        status(&mut svc, req("POST", "/api/reports", "b")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    // The pro plan has its own budget of 200.
    let mut pro = req("POST", "/api/reports", "b");
    pro.headers_mut().insert("x-plan", "pro".parse().unwrap());
    assert_eq!(status(&mut svc, pro).await.0, StatusCode::OK);
    // Keyless requests fall to the client IP.
    let mut anon = req("GET", "/", "x");
    anon.headers_mut().remove("x-api-key");
    assert_eq!(status(&mut svc, anon).await.0, StatusCode::OK);
}

#[test]
fn file_keys_write_the_same_store_keys_as_code() {
    use crate::key::{ClientIp, Header, KeyBuf, KeyExtractor, KeyExtractorExt};
    let client = ClientIp::trusting(["10.0.0.0/8"]).unwrap();
    let spec: super::spec::FileSpec = toml::from_str("").unwrap();
    let file = FileKey::parse("header:x-api-key | client-ip", &client, 64, &spec).unwrap();
    let code = Header::named("x-api-key").unwrap().or(client.clone());
    let three = FileKey::parse("header:a | header:b + path | global", &client, 64, &spec).unwrap();
    let three_code = Header::named("a")
        .unwrap()
        .or((Header::named("b").unwrap(), crate::key::Path))
        .or(crate::key::Global);
    for r in [req("GET", "/x", "k1"), {
        let mut r = req("GET", "/y", "k");
        r.headers_mut().remove("x-api-key");
        r.headers_mut().insert("b", "bee".parse().unwrap());
        r
    }] {
        let (mut a, mut b) = (KeyBuf::new(), KeyBuf::new());
        assert_eq!(file.extract(&r, &mut a), code.extract(&r, &mut b));
        assert_eq!(a.as_bytes(), b.as_bytes());
        let (mut a, mut b) = (KeyBuf::new(), KeyBuf::new());
        assert_eq!(three.extract(&r, &mut a), three_code.extract(&r, &mut b));
        assert_eq!(a.as_bytes(), b.as_bytes());
    }
}

#[tokio::test]
async fn a_route_cost_several_limits_share_is_computed_once_a_request() {
    // Two rules and two quotas charge the named cost "api"; a third
    // table, "other", prices the same route apart and is its own.
    let text = r#"
[costs.api]
default = 1
routes = [{ method = "POST", path = "/orders", cost = 3 }]

[costs.other]
default = 1
routes = [{ method = "POST", path = "/orders", cost = 5 }]

[[rules]]
name = "a"
key = "header:x-api-key"
rate = "1/h"
burst = 100
cost = "api"

[[rules]]
name = "b"
key = "header:x-api-key"
rate = "1/h"
burst = 100
cost = "api"

[[quotas]]
name = "qa"
key = "header:x-api-key"
limits = { day = 100 }
cost = "api"

[[quotas]]
name = "qo"
key = "header:x-api-key"
limits = { day = 100 }
cost = "other"
"#;
    let mut svc = empty_behind(text);
    let costed = || super::parts::COSTED.with(std::cell::Cell::get);
    let before = costed();
    let r = Request::post("/orders")
        .header("x-api-key", "k")
        .body(axum::body::Body::empty())
        .unwrap();
    let res = call_once(&mut svc, r).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(costed() - before, 2, "one computation a table");
    let field = res.headers()["ratelimit"].to_str().unwrap().to_owned();
    for (name, left) in [("a", 97), ("b", 97), ("qa", 97), ("qo", 95)] {
        let item = field
            .split(", ")
            .find(|i| i.starts_with(&format!("\"{name}\";")))
            .unwrap_or_else(|| panic!("{name} in {field}"));
        assert!(item.contains(&format!(";r={left}")), "{name}: {item}");
    }
    // Keys that do not repeat: the named cost alone is worth remembering.
    let text = r#"
[costs.api]
default = 1
routes = [{ method = "POST", path = "/orders", cost = 3 }]

[[rules]]
name = "a"
key = "header:x-a"
rate = "1/h"
burst = 100
cost = "api"

[[quotas]]
name = "q"
key = "header:x-b"
limits = { day = 100 }
cost = "api"
"#;
    let mut svc = empty_behind(text);
    let before = costed();
    let r = Request::post("/orders")
        .header("x-a", "k")
        .header("x-b", "k")
        .body(axum::body::Body::empty())
        .unwrap();
    assert_eq!(call_once(&mut svc, r).await.status(), StatusCode::OK);
    assert_eq!(costed() - before, 1);
}

#[test]
fn a_file_key_is_fixed_as_the_code_it_stands_for_is() {
    // A fixed key (every request's the same) is counted apart by a store
    // that pins it: a file's `global` must say so as `Global` does.
    use crate::key::{ClientIp, KeyExtractor, KeyExtractorExt};
    let client = ClientIp::trusting(["10.0.0.0/8"]).unwrap();
    let spec: super::spec::FileSpec = toml::from_str("").unwrap();
    let fixed = |text: &str| {
        let key = FileKey::parse(text, &client, 64, &spec).unwrap();
        KeyExtractor::<String>::is_fixed(&key)
    };
    for (text, expected) in [
        ("global", true),
        ("global + global", true),
        ("global | client-ip", true),
        ("client-ip | global", false),
        ("global + path", false),
        ("header:x-api-key", false),
    ] {
        assert_eq!(fixed(text), expected, "{text}");
    }
    fn is_fixed(key: impl KeyExtractor<String>) -> bool {
        key.is_fixed()
    }
    assert!(is_fixed(crate::key::Global));
    assert!(is_fixed(crate::key::Global.or(client.clone())));
    assert!(!is_fixed((crate::key::Global, crate::key::Path)));
}

/// The error `text` gives, as `line:column: field: message`.
fn error(text: &str) -> String {
    shown(&PolicyFile::parse(text).unwrap_err())
}

/// `e` as `line:column: field: message`.
fn shown(e: &FileError) -> String {
    format!(
        "{}:{}: {}: {}",
        e.line(),
        e.column(),
        e.field(),
        e.message()
    )
}

#[test]
fn load_errors_name_the_line_and_the_field() {
    let rule = |extra: &str| {
        format!("[[rules]]\nname = \"a\"\nkey = \"global\"\nrate = \"1/s\"\nburst = 1\n\n[[rules]]\nname = \"b\"\nkey = \"global\"\n{extra}\n")
    };
    // The issue's example.
    let e = error(&rule("rate = \"1/s\"\nburst = 0"));
    assert_eq!(e, "11:9: rules[1].burst: must be at least 1");
    assert!(
        error(&rule("rate = \"1/s\"\nbrust = 5"))
            .starts_with("11:1: rules[1].brust: unknown field"),
        "{}",
        error(&rule("rate = \"1/s\"\nbrust = 5"))
    );
    assert_eq!(
        error(&rule("rate = \"1 per s\"\nburst = 2")),
        "10:8: rules[1].rate: \"1 per s\" is not a rate like \"10/s\", \"600/min\" or \"5/15m\""
    );
    assert!(error(&rule("rate = \"1/s\"")).contains("rules[1].burst: is missing"));
    assert!(error(&rule(
        "algorithm = \"fixed_window\"\nrate = \"5/m\"\nburst = 2"
    ))
    .starts_with("12:9: rules[1].burst: is not used by fixed_window"));
    // A sliding window of buckets: `buckets` is its own, required, and
    // checked where it is written.
    let buckets = |extra: &str| {
        rule(&format!(
            "algorithm = \"sliding_buckets\"\nrate = \"5/s\"\n{extra}"
        ))
    };
    assert_eq!(
        error(&buckets("buckets = 101")),
        "12:11: rules[1].buckets: must be 1 to 100"
    );
    assert_eq!(
        error(&buckets("buckets = 0")),
        "12:11: rules[1].buckets: must be at least 1"
    );
    assert_eq!(
        error(&buckets("buckets = 2000")),
        "12:11: rules[1].buckets: must be 1 to 100"
    );
    assert!(error(&buckets(""))
        .starts_with("7:1: rules[1].buckets: is missing: sliding_buckets needs buckets"));
    assert_eq!(
        error(&rule(
            "algorithm = \"sliding_buckets\"\nrate = \"5/50ms\"\nbuckets = 100"
        )),
        "11:8: rules[1].rate: must be at least 1 ms for each bucket"
    );
    assert!(error(&rule("rate = \"1/s\"\nburst = 2\nbuckets = 4"))
        .starts_with("12:11: rules[1].buckets: is only for sliding_buckets, not gcra"));
    assert!(error(&buckets(
        "buckets = 4\nplans.pro = { rate = \"9/s\", buckets = 500 }"
    ))
    .contains("rules[1].plans.pro.buckets: must be 1 to 100"));
    assert!(error(&rule("algorithm = \"magic\"\nrate = \"5/m\""))
        .starts_with("10:13: rules[1].algorithm: must be one of"));
    assert!(error(&rule("rate = \"1/s\"\nburst = 2\ncost = \"pricey\""))
        .starts_with("12:8: rules[1].cost: no [costs.pricey] is declared"));
    assert!(error(&rule("rate = \"1/s\"\nburst = 2\nkey2 = 1"))
        .contains("rules[1].key2: unknown field"));
    assert!(error(&rule("rate = \"1/s\"\nburst = 2\ncost = [1]"))
        .starts_with("12:8: rules[1].cost: a cost is a whole number"));
    assert!(error(&rule(
        "rate = \"1/s\"\nburst = 2\ncost = { header = \"x-cost\", colour = 1 }"
    ))
    .contains("rules[1].cost: unknown field `colour`"));
    assert!(error(&rule("rate = \"1/s\"\nburst = 2\nwarn_at = 1.5"))
        .starts_with("12:11: rules[1].warn_at: must be above 0"));
    assert!(
        error(&rule("rate = \"1/s\"\nburst = 2\nmissing_key = \"maybe\""))
            .contains("rules[1].missing_key")
    );
    assert!(error(&rule("rate = \"1/s\"\nburst = 2\ncount_if = [999]"))
        .contains("rules[1].count_if: 999 is not an HTTP status"));
    assert!(error(&rule(
        "rate = \"1/s\"\nburst = 2\nplans.pro = { rate = \"5/s\", burst = 0 }"
    ))
    .contains("rules[1].plans.pro.burst: must be at least 1"));
    assert!(
        error(&rule("rate = \"1/s\"\nburst = \"ten\""))
            .starts_with("11:9: rules[1].burst: invalid type"),
        "{}",
        error(&rule("rate = \"1/s\"\nburst = \"ten\""))
    );
    // A plan whose stored name ("<rule>:<plan>") is past 64 bytes: found
    // when the plan is bound, named at its rule (policy-security review
    // #9: it had no line).
    let long_plan = format!(
        "rate = \"1/s\"\nburst = 2\nplans.{} = {{ rate = \"5/s\", burst = 5 }}",
        "p".repeat(63)
    );
    let e = error(&format!("plan_from = \"extension\"\n{}", rule(&long_plan)));
    assert!(e.starts_with("8:1: rules[1].name: "), "{e}");
    // A rule name twice: placed at the second rule.
    let twice = "[[rules]]\nname = \"a\"\nkey = \"global\"\nrate = \"1/s\"\nburst = 1\n[[rules]]\nname = \"a\"\nkey = \"global\"\nrate = \"1/s\"\nburst = 1\n";
    assert!(
        error(twice).starts_with("6:1: rules[1].name: "),
        "{}",
        error(twice)
    );
    // Top-level fields.
    assert!(error(&format!(
        "trusted_proxies = [\"10.0.0.0/33\"]\n{}",
        rule("rate = \"1/s\"\nburst = 1")
    ))
    .starts_with("1:19: trusted_proxies:"));
    assert!(
        error("[[rules]]\nname = \"a\"\nkey = \"cookie\"\nrate = \"1/s\"\nburst = 1\n")
            .starts_with("3:7: rules[0].key: \"cookie\" is not a key part")
    );
    assert!(error(
        "[[rules]]\nname = \"a\"\nkey = \"fingerprint:x-ja4,X-JA4\"\nrate = \"1/s\"\nburst = 1\n"
    )
    .starts_with("3:7: rules[0].key: names x-ja4 twice"));
    assert_eq!(
        error(""),
        "0:0: rules: declare a limit: [[rules]] (1 to 8), [[quotas]], [[concurrency]], [[bandwidth]] or [[retry_budgets]]"
    );
    assert!(
        error("[[rules]\nname = 1").starts_with("1:"),
        "{}",
        error("[[rules]\nname = 1")
    );
    // The Display form starts with the file when read from one.
    let dir = std::env::temp_dir().join(format!("tollgate-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bad.toml");
    std::fs::write(&path, rule("rate = \"1/s\"\nburst = 0")).unwrap();
    let shown = PolicyFile::read(&path).unwrap_err().to_string();
    assert_eq!(
        shown,
        format!(
            "{}:11:9: rules[1].burst: must be at least 1",
            path.display()
        )
    );
    let missing = PolicyFile::read(dir.join("absent.toml")).unwrap_err();
    assert!(missing.message().starts_with("cannot read the file"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn every_option_loads() {
    let text = r#"
headers = true
legacy_headers = true
trusted_proxies = ["10.0.0.0/8", "::1"]
forwarded_header = "forwarded"
ipv6_prefix = 56
plan_from = "extension"

[access]
name = "lists"
keys_from = "x-api-key"
allow_keys = ["internal"]
deny_keys = ["leaked"]
allow_networks = ["192.0.2.0/24"]
deny_networks = ["203.0.113.0/24", "2001:db8::/32"]

[idempotency]
name = "idem"
key = "header:x-api-key"
ttl = "24h"

[decision_log]
allowed = 0.01
limited = 1.0

[[rules]]
name = "tb"
key = "header:x-api-key + route"
algorithm = "token_bucket"
rate = "5/s"
burst = 10
cost = { header = "x-cost", default = 1, max = 50 }
missing_key = "fallback:anonymous"

[[rules]]
name = "fw"
key = "peer-ip"
algorithm = "fixed_window"
rate = "100/min"
cost = { query = "count", max = 10 }
shadow = true

[[rules]]
name = "swc"
key = "path + method"
algorithm = "sliding_window"
rate = "50/10s"
cost = { default = 1, methods = { POST = 5, DELETE = 2 } }
canary = 0.25
missing_key = "skip"

[[rules]]
name = "log"
key = "header:x-user"
algorithm = "sliding_log"
rate = "5/15m"
count_if = [401, 403]
warn_at = 0.6
escalate = { strikes = 3, period = "15m", block = "15m", max_block = "24h" }

[[rules]]
name = "swb"
key = "header:x-user"
algorithm = "sliding_buckets"
rate = "60/min"
buckets = 6
plans.gold = { rate = "600/min", buckets = 12 }
slow_down = { strikes = 5, period = "1m", hold = "10m", steps = [50, 25, 10] }

[[rules]]
name = "lb"
key = "global"
algorithm = "leaky_bucket"
rate = "100/s"
max_delay = "250ms"
cost = { bytes_per_unit = 1024, default = 1, max = 64 }
plans.gold = { rate = "1000/s", max_delay = "1s" }
"#;
    let file = PolicyFile::parse(text).unwrap();
    let layer = file.layer::<String, _>(&MemoryStore::new()).unwrap();
    assert_eq!(layer.rule_names(), ["tb", "fw", "swc", "log", "swb", "lb"]);
}

/// Issue 34 item 4: `[access]` refuses the networks a file lists (a TOR
/// exit list, a hosting provider's ranges), and a change to that file
/// reloads like a change to the policy file.
#[tokio::test]
async fn a_network_list_file_is_read_and_reloaded_with_the_policy() {
    let clock = ManualClock::new();
    let dir = std::env::temp_dir().join(format!("tollgate-lists-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("policy.toml");
    let list = dir.join("tor-exits.txt");
    std::fs::write(&list, "# exits\n198.51.100.7\n\n2001:db8::/32  # a range\n").unwrap();
    std::fs::write(
        &path,
        "[access]\ndeny_networks_file = \"tor-exits.txt\"\n\n[[rules]]\nname = \"r\"\nkey = \"global\"\nrate = \"100/s\"\nburst = 100\n",
    )
    .unwrap();
    let (layer, reloader) = Reloader::<String, _>::load(&path, store(&clock)).unwrap();
    let mut svc = layer.layer(ok_service());
    assert_eq!(
        status(&mut svc, from("198.51.100.7")).await.0,
        StatusCode::FORBIDDEN
    );
    assert_eq!(
        status(&mut svc, from("198.51.100.8")).await.0,
        StatusCode::OK
    );
    // The list grows; the policy file does not change: a reload applies it.
    std::fs::write(&list, "198.51.100.7\n198.51.100.8\n").unwrap();
    assert_eq!(reloader.reload().unwrap(), Reloaded::Applied);
    assert_eq!(
        status(&mut svc, from("198.51.100.8")).await.0,
        StatusCode::FORBIDDEN
    );
    assert_eq!(reloader.reload().unwrap(), Reloaded::Unchanged);
    // A bad line: refused, naming the line; the running list stays.
    std::fs::write(&list, "198.51.100.8\n10.0.0.0/99 hunter2\n").unwrap();
    let e = shown(&reloader.reload().unwrap_err());
    assert!(
        e.contains("access.deny_networks_file: line 2: not a network"),
        "{e}"
    );
    assert!(!e.contains("hunter2"), "a line is never repeated: {e}");
    assert_eq!(
        status(&mut svc, from("198.51.100.7")).await.0,
        StatusCode::FORBIDDEN
    );
    // A list that cannot be read: refused at its field.
    std::fs::remove_file(&list).unwrap();
    let e = shown(&reloader.reload().unwrap_err());
    assert!(
        e.starts_with("2:22: access.deny_networks_file: cannot read"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 34 item 4: a rule per autonomous system, from `[geoip]`'s
/// database: a scraper's addresses rotating within one ASN share one
/// budget; an address the database does not hold has no key.
#[cfg(feature = "geoip")]
#[tokio::test]
async fn a_rule_per_autonomous_system_from_the_files_database() {
    use std::net::Ipv4Addr;
    let clock = ManualClock::new();
    let dir = std::env::temp_dir().join(format!("tollgate-geoip-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("asn.mmdb"),
        crate::key::geo::testing::database(&[
            (Ipv4Addr::new(198, 51, 100, 0), 24, 64_500, "DE"),
            (Ipv4Addr::new(203, 0, 113, 0), 24, 64_500, "DE"),
        ]),
    )
    .unwrap();
    let path = dir.join("policy.toml");
    std::fs::write(
        &path,
        "[geoip]\nasn = \"asn.mmdb\"\n\n[[rules]]\nname = \"per-asn\"\nkey = \"asn\"\nalgorithm = \"fixed_window\"\nrate = \"2/10s\"\nmissing_key = \"skip\"\n",
    )
    .unwrap();
    let layer = PolicyFile::read(&path)
        .unwrap()
        .layer::<String, _>(&store(&clock))
        .unwrap();
    let mut svc = layer.layer(ok_service());
    assert_eq!(
        status(&mut svc, from("198.51.100.1")).await.0,
        StatusCode::OK
    );
    assert_eq!(
        status(&mut svc, from("203.0.113.9")).await.0,
        StatusCode::OK
    );
    assert_eq!(
        status(&mut svc, from("198.51.100.77")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    // Not in the database: no key, skipped.
    for _ in 0..3 {
        assert_eq!(status(&mut svc, from("192.0.2.1")).await.0, StatusCode::OK);
    }
    // A key part whose database is not declared, or cannot be read.
    let e = error("[[rules]]\nname = \"a\"\nkey = \"country\"\nrate = \"1/s\"\nburst = 1\n");
    assert!(
        e.starts_with("3:7: rules[0].key: the key part country needs [geoip] country"),
        "{e}"
    );
    std::fs::write(dir.join("asn.mmdb"), b"garbage").unwrap();
    let e = shown(&PolicyFile::read(&path).unwrap_err());
    assert!(
        e.contains("rules[0].key: [geoip] asn: not a MaxMind DB database"),
        "{e}"
    );
    // A database named and not read is an error where it is named, used
    // or not; a directory is not a database.
    std::fs::write(
        &path,
        "[geoip]\ncountry = \".\"\n\n[[rules]]\nname = \"g\"\nkey = \"global\"\nrate = \"1/s\"\nburst = 1\n",
    )
    .unwrap();
    let e = shown(&PolicyFile::read(&path).unwrap_err());
    assert!(e.starts_with("2:11: geoip.country: cannot read"), "{e}");
    assert!(e.contains("not a regular file"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_reload_keeps_unchanged_rules_and_rejects_bad_files() {
    let clock = ManualClock::new();
    let dir = std::env::temp_dir().join(format!("tollgate-reload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("policy.toml");
    let v1 = "[[rules]]\nname = \"per-key\"\nkey = \"header:x-api-key\"\nrate = \"1/min\"\nburst = 2\n\n[[rules]]\nname = \"global\"\nkey = \"global\"\nrate = \"1/min\"\nburst = 100\n";
    std::fs::write(&path, v1).unwrap();
    let (layer, reloader) = Reloader::<String, _>::load(&path, store(&clock)).unwrap();
    let mut svc = layer.layer(ok_service());
    for _ in 0..2 {
        assert_eq!(
            status(&mut svc, req("GET", "/", "a")).await.0,
            StatusCode::OK
        );
    }
    assert_eq!(
        status(&mut svc, req("GET", "/", "a")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(reloader.reload().unwrap(), Reloaded::Unchanged);

    // v2: per-key unchanged; global's burst cut to 2 (GCRA: it goes on
    // from its state, where 2 of 100 are spent); a third rule.
    let v2 = v1.replace("burst = 100", "burst = 3")
        + "\n[[rules]]\nname = \"per-path\"\nkey = \"path\"\nrate = \"1/min\"\nburst = 1\n";
    std::fs::write(&path, &v2).unwrap();
    assert_eq!(reloader.reload().unwrap(), Reloaded::Applied);
    assert_eq!(layer.rule_names(), ["per-key", "global", "per-path"]);
    // per-key kept its state: "a" is still refused.
    assert_eq!(
        status(&mut svc, req("GET", "/", "a")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    // global has one unit left of 3 (2 spent before the reload).
    let (s, policy) = status(&mut svc, req("GET", "/one", "b")).await;
    assert_eq!(s, StatusCode::OK);
    assert!(policy.unwrap().contains(r#""global";q=3"#));
    assert_eq!(
        status(&mut svc, req("GET", "/two", "c")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );

    // A bad file: rejected, and the running policy stays.
    std::fs::write(&path, v2.replace("burst = 3", "burst = 0")).unwrap();
    let e = reloader.reload().unwrap_err();
    assert_eq!(e.field(), "rules[1].burst");
    assert_eq!(layer.rule_names(), ["per-key", "global", "per-path"]);
    assert_eq!(
        status(&mut svc, req("GET", "/three", "d")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    // A minute on, one more unit per rule.
    clock.advance(Duration::from_secs(60));
    assert_eq!(
        status(&mut svc, req("GET", "/four", "e")).await.0,
        StatusCode::OK
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn a_request_decided_before_a_reload_finishes_on_its_policy() {
    // A response-aware rule: the charge taken at arrival is given back
    // when the response does not count. A reload between the two must
    // neither drop the give-back nor charge again.
    let clock = ManualClock::new();
    let v1 = "[[rules]]\nname = \"fails\"\nkey = \"header:x-api-key\"\nrate = \"1/min\"\nburst = 3\ncount_if = [401]\n";
    let st = store(&clock);
    let layer = PolicyFile::parse(v1)
        .unwrap()
        .layer::<String, _>(&st)
        .unwrap();
    let (release, gate) = tokio::sync::oneshot::channel::<()>();
    let gate = std::sync::Arc::new(tokio::sync::Mutex::new(Some(gate)));
    let inner = service_fn(move |_r: Req| {
        let gate = gate.clone();
        async move {
            if let Some(g) = gate.lock().await.take() {
                let _ = g.await;
            }
            Ok::<_, Infallible>(Response::new("ok".to_owned()))
        }
    });
    let mut svc = layer.layer(inner);
    let pending = tokio::spawn(svc.ready().await.unwrap().call(req("GET", "/", "k")));
    tokio::task::yield_now().await;
    let key = {
        use crate::key::{Header, KeyBuf, KeyExtractor};
        let mut buf = KeyBuf::new();
        Header::named("x-api-key")
            .unwrap()
            .extract(&req("GET", "/", "k"), &mut buf)
            .unwrap();
        buf.as_bytes().to_vec()
    };
    let limiter = layer.limiters().into_iter().next().unwrap();
    assert_eq!(limiter.decide(&key, 0).await.unwrap().remaining, 2);
    // Reload with another burst (GCRA goes on from the state).
    let v2 = v1.replace("burst = 3", "burst = 5");
    let next = PolicyFile::parse(&v2)
        .unwrap()
        .layer::<String, _>(&st.rebinding())
        .unwrap();
    layer.replace(&next);
    release.send(()).unwrap();
    assert_eq!(pending.await.unwrap().unwrap().status(), StatusCode::OK);
    // The 200 did not count: its charge is back, under the new burst.
    let limiter = layer.limiters().into_iter().next().unwrap();
    assert_eq!(limiter.decide(&key, 0).await.unwrap().remaining, 5);
}

/// A rule keyed by a client fingerprint: a client that rotates its API
/// key keeps one budget; a request without any of the headers falls to
/// the next alternative (its address).
#[tokio::test]
async fn a_fingerprint_key_follows_a_client_across_its_api_keys() {
    let clock = ManualClock::new();
    let text = "[[rules]]\nname = \"fp\"\nkey = \"fingerprint:x-ja4,user-agent | peer-ip\"\nalgorithm = \"fixed_window\"\nrate = \"2/10s\"\n";
    let layer = PolicyFile::parse(text)
        .unwrap()
        .layer::<String, _>(&store(&clock))
        .unwrap();
    let mut svc = layer.layer(ok_service());
    let bot = |key: &str| {
        let mut r = req("GET", "/", key);
        r.headers_mut()
            .insert("x-ja4", "t13d1516h2".parse().unwrap());
        r.headers_mut()
            .insert("user-agent", "curl/8".parse().unwrap());
        r
    };
    assert_eq!(status(&mut svc, bot("k1")).await.0, StatusCode::OK);
    assert_eq!(status(&mut svc, bot("k2")).await.0, StatusCode::OK);
    assert_eq!(
        status(&mut svc, bot("k3")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    // No fingerprint headers: keyed by address, its own budget.
    assert_eq!(
        status(&mut svc, req("GET", "/", "k1")).await.0,
        StatusCode::OK
    );
}

#[tokio::test]
async fn a_files_slowing_ladder_lowers_a_keys_rate_and_says_so() {
    let clock = ManualClock::new();
    let text = "[[rules]]\nname = \"per-key\"\nkey = \"header:x-api-key\"\nalgorithm = \"fixed_window\"\nrate = \"2/10s\"\nslow_down = { strikes = 1, period = \"1m\", hold = \"1m\", steps = [50] }\n";
    let layer = PolicyFile::parse(text)
        .unwrap()
        .layer::<String, _>(&store(&clock))
        .unwrap();
    let mut svc = layer.layer(ok_service());
    for _ in 0..2 {
        assert_eq!(
            status(&mut svc, req("GET", "/", "a")).await.0,
            StatusCode::OK
        );
    }
    // One refusal: "a" keeps 50 % of the rate for a minute.
    assert_eq!(
        status(&mut svc, req("GET", "/", "a")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    clock.advance(std::time::Duration::from_secs(10));
    assert_eq!(
        status(&mut svc, req("GET", "/", "a")).await,
        (StatusCode::OK, Some("\"per-key\";q=1;w=10".to_owned()))
    );
    assert_eq!(
        status(&mut svc, req("GET", "/", "a")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        status(&mut svc, req("GET", "/", "b")).await,
        (StatusCode::OK, Some("\"per-key\";q=2;w=10".to_owned()))
    );
}

#[test]
fn a_slowing_ladders_errors_name_its_fields() {
    let rule = "[[rules]]\nname = \"a\"\nkey = \"global\"\nrate = \"1/s\"\nburst = 1\n";
    let e = error(&format!(
        "{rule}slow_down = {{ strikes = 3, period = \"1m\", hold = \"1m\", steps = [50, 60] }}\n"
    ));
    assert!(
        e.starts_with("6:64: rules[0].slow_down.steps: must be 1 to 8"),
        "{e}"
    );
    let e = error(&format!(
        "{rule}slow_down = {{ strikes = 3, period = \"1m\", hold = \"0s\", steps = [50] }}\n"
    ));
    assert!(e.starts_with("6:50: rules[0].slow_down.hold:"), "{e}");
    // A step that keeps less of the limit than a request costs.
    let e = error("[[rules]]\nname = \"a\"\nkey = \"global\"\nrate = \"1/s\"\nburst = 4\ncost = 3\nslow_down = { strikes = 3, period = \"1m\", hold = \"1m\", steps = [50, 25] }\n");
    assert!(
        e.contains("rules[0].slow_down.steps: 25 % of the limit keeps 1, less than every request costs (3)"),
        "{e}"
    );
    let both = format!(
        "{rule}escalate = {{ strikes = 3, period = \"1m\", block = \"1m\", max_block = \"1h\" }}\nslow_down = {{ strikes = 3, period = \"1m\", hold = \"1m\", steps = [50] }}\n"
    );
    let e = error(&both);
    assert!(
        e.starts_with("6:12: rules[0].escalate: a rule has one ladder"),
        "{e}"
    );
}

#[test]
fn more_errors_land_where_the_mistake_is() {
    // A rule without a required field: at its header, named by index.
    let missing = "[[rules]]\nname = \"a\"\nkey = \"global\"\nrate = \"1/s\"\nburst = 1\n\n[[rules]]\nname = \"b\"\nrate = \"1/s\"\nburst = 1\n";
    let e = error(missing);
    assert!(e.starts_with("7:1: rules[1]: missing field `key`"), "{e}");
    // A ladder's error on the ladder's own field.
    let ladder = "[[rules]]\nname = \"a\"\nkey = \"global\"\nrate = \"1/s\"\nburst = 1\nescalate = { strikes = 3, period = \"0s\", block = \"1m\", max_block = \"1h\" }\n";
    let e = error(ladder);
    assert!(e.starts_with("6:36: rules[0].escalate.period:"), "{e}");
    // A lower-case method would never match a request.
    let lower = "[[rules]]\nname = \"a\"\nkey = \"global\"\nrate = \"1/s\"\nburst = 1\ncost = { methods = { post = 5 } }\n";
    assert!(
        error(lower).contains("\"post\" is not an HTTP method"),
        "{}",
        error(lower)
    );
    // A cost read from the request needs its cap.
    let uncapped = "[[rules]]\nname = \"a\"\nkey = \"global\"\nrate = \"1/s\"\nburst = 1\ncost = { header = \"x-cost\" }\n";
    assert!(
        error(uncapped).contains("rules[0].cost: max is missing"),
        "{}",
        error(uncapped)
    );
}

#[test]
fn plans_may_take_their_source_from_code() {
    let text = "[[rules]]\nname = \"a\"\nkey = \"global\"\nrate = \"1/s\"\nburst = 1\nplans.pro = { rate = \"5/s\", burst = 5 }\n";
    let file = PolicyFile::parse(text).unwrap();
    // No source in the file or the code: refused when built.
    let e = file.layer::<String, _>(&MemoryStore::new()).unwrap_err();
    assert_eq!(e.field(), "plans");
    // A closure from code.
    let layer = file
        .builder::<String>()
        .unwrap()
        .plan_from(|_r: &Req| Some(crate::policy::Plan::new("pro")))
        .build();
    assert!(layer.is_ok());
}

#[tokio::test]
async fn a_reload_prepares_every_file_and_a_bad_one_rebinds_nothing() {
    let clock = ManualClock::new();
    let dir = std::env::temp_dir().join(format!("tollgate-prepare-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("policy.toml");
    let v1 = "[[rules]]\nname = \"per-client\"\nkey = \"client-ip\"\nrate = \"1/min\"\nburst = 1\n\n[[rules]]\nname = \"audited\"\nkey = \"global\"\nrate = \"100/s\"\nburst = 100\n";
    std::fs::write(&path, v1).unwrap();
    let trusted = vec!["10.0.0.0/8".to_owned()];
    struct Sink;
    impl crate::observe::AuditSink for Sink {
        fn record(&self, _: &crate::observe::AuditRecord) {}
    }
    let st = store(&clock);
    let first = PolicyFile::read(&path)
        .unwrap()
        .default_trusted_proxies(&trusted)
        .unwrap();
    let layer = first
        .builder::<String>()
        .unwrap()
        .audit(Sink, &["audited"])
        .store(st.clone())
        .build()
        .unwrap();
    let t = trusted.clone();
    let reloader = Reloader::new(&path, &first, st, &layer)
        .prepare(move |f| f.default_trusted_proxies(&t))
        .customize(|b| b.audit(Sink, &["audited"]));
    let mut svc = layer.layer(ok_service());
    // Behind the proxy 10.0.0.1, clients are told apart by X-Forwarded-For.
    let from = |client: &str| {
        let mut r = req("GET", "/", "k");
        r.extensions_mut()
            .insert("10.0.0.1:4000".parse::<std::net::SocketAddr>().unwrap());
        r.headers_mut()
            .insert("x-forwarded-for", client.parse().unwrap());
        r
    };
    assert_eq!(
        status(&mut svc, from("198.51.100.1")).await.0,
        StatusCode::OK
    );
    assert_eq!(
        status(&mut svc, from("198.51.100.1")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    // v2: another algorithm for per-client, and no rule "audited", which
    // the code's customisation audits: an error found only after
    // per-client is bound. Rejected, and per-client must not have been
    // rebound on the way.
    let v2 = "[[rules]]\nname = \"per-client\"\nkey = \"client-ip\"\nalgorithm = \"fixed_window\"\nrate = \"1/min\"\n";
    std::fs::write(&path, v2).unwrap();
    assert_eq!(reloader.reload().unwrap_err().field(), "audit");
    // v3: v1 and another rule. per-client kept its state (a rebinding to
    // the fixed window and back would have started it afresh), and the
    // proxies still apply: another client behind the proxy is admitted.
    let v3 = format!(
        "{v1}\n[[rules]]\nname = \"global\"\nkey = \"global\"\nrate = \"100/s\"\nburst = 100\n"
    );
    std::fs::write(&path, v3).unwrap();
    assert_eq!(reloader.reload().unwrap(), Reloaded::Applied);
    assert_eq!(
        status(&mut svc, from("198.51.100.1")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        status(&mut svc, from("198.51.100.2")).await.0,
        StatusCode::OK
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A cost known at load that no plan of the rule could ever admit is a
/// mistake the load reports; one some plan admits, or one read from the
/// request, is not.
#[test]
fn a_cost_no_plan_could_ever_admit_is_refused_at_load() {
    let rule = |cost: &str, plans: &str| {
        format!("[[rules]]\nname = \"a\"\nkey = \"global\"\nrate = \"10/s\"\nburst = 20\ncost = {cost}\n{plans}\n")
    };
    assert_eq!(
        error(&rule("30", "")),
        "6:8: rules[0].cost: every request costs 30, more than this rule ever admits at once (20, every plan included): such a request could never pass"
    );
    let routes =
        "{ default = 1, routes = [{ method = \"POST\", path = \"/api/reports\", cost = 50 }] }";
    assert!(error(&rule(routes, "")).starts_with(
        "6:8: rules[0].cost: route POST /api/reports costs 50, more than this rule ever admits at once (20,"
    ));
    let methods = "{ default = 1, methods = { DELETE = 21 } }";
    assert!(error(&rule(methods, "")).contains("method DELETE costs 21"));
    // The pro plan admits a report: free clients cannot make one (their
    // requests are refused), which may be the point.
    assert!(PolicyFile::parse(&rule(
        routes,
        "plans.pro = { rate = \"100/s\", burst = 200 }"
    ))
    .is_ok());
    // Read from the request: its max may exceed the burst.
    assert!(PolicyFile::parse(&rule(
        "{ header = \"x-cost\", default = 1, max = 1000 }",
        ""
    ))
    .is_ok());
    // At the capacity exactly: admitted when the bucket is full.
    assert!(PolicyFile::parse(&rule("20", "")).is_ok());
}

/// Review finding 9: files that load but mean something absurd are
/// refused, each with its line and field.
#[test]
fn files_that_would_load_but_mean_nothing_sane_are_refused() {
    let rule = "[[rules]]\nname = \"a\"\nkey = \"client-ip\"\nrate = \"1/s\"\nburst = 1\n";
    let with = |head: &str, tail: &str| format!("{head}\n{rule}{tail}");
    // Proxies that trust every peer to name itself.
    for all in ["0.0.0.0/0", "::/0", "10.0.0.0/4"] {
        let e = error(&with(&format!("trusted_proxies = [\"{all}\"]"), ""));
        assert!(e.starts_with("1:") && e.contains("trusted_proxies"), "{e}");
        assert!(e.contains("nearly every address"), "{e}");
    }
    // IPv6 keys finer than a subscriber's allocation, or one for the world.
    for bits in [0, 16, 31] {
        let e = error(&with(&format!("ipv6_prefix = {bits}"), ""));
        assert!(
            e.starts_with("1:15: ipv6_prefix: must be from 32 to 128"),
            "{e}"
        );
    }
    // A cost of 0 makes requests free.
    let e = error(&format!("{rule}cost = 0\n"));
    assert!(
        e.starts_with("6:8: rules[0].cost: must be at least 1"),
        "{e}"
    );
    let costs = "[costs.api]\ndefault = 0\nroutes = [{ path = \"/x\", cost = 2 }]\n";
    let e = error(&format!("{costs}\n{rule}cost = \"api\"\n"));
    assert!(e.contains("costs.api.default: must be at least 1"), "{e}");
    // Idempotency markers shared by every client.
    let e = error(&with(
        "",
        "\n[idempotency]\nname = \"idem\"\nkey = \"global\"\nttl = \"1h\"\n",
    ));
    assert!(e.contains("idempotency.key: must name the client"), "{e}");
    // A day at most.
    let e = error(&with(
        "",
        "\n[idempotency]\nname = \"idem\"\nkey = \"client-ip\"\nttl = \"48h\"\n",
    ));
    assert!(e.contains("idempotency"), "{e}");
    assert!(e.contains("at most a day"), "{e}");
    // Access lists that allow, or deny, everything.
    let e = error(&with(
        "",
        "\n[access]\nname = \"l\"\nallow_networks = [\"0.0.0.0/0\"]\n",
    ));
    assert!(e.contains("nearly every address"), "{e}");
    let e = error(&with(
        "",
        "\n[access]\nname = \"l\"\ndeny_by_default = true\n",
    ));
    assert!(e.contains("refuses every request"), "{e}");
}

/// Review finding 19: `{:?}` of a policy file printed the file, access
/// lists' keys included.
#[test]
fn a_policy_files_debug_shows_no_keys() {
    let file = PolicyFile::parse(
        "[[rules]]\nname = \"a\"\nkey = \"global\"\nrate = \"1/s\"\nburst = 1\n\n\
         [access]\nname = \"l\"\nkeys_from = \"x-api-key\"\nallow_keys = [\"sk_live_secret\"]\n",
    )
    .unwrap();
    let shown = format!("{file:?}");
    assert!(!shown.contains("sk_live_secret"), "{shown}");
    assert!(shown.contains("rules: 1"), "{shown}");
}

/// Review finding 8: a poll could read a file an editor was still writing
/// and, cut at a rule's end, apply it without the rules after it. A poll
/// applies a text only once the poll before read it too.
#[tokio::test]
async fn a_poll_never_applies_a_file_caught_half_written() {
    let clock = ManualClock::new();
    let dir = std::env::temp_dir().join(format!("tollgate-torn-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("policy.toml");
    let one = "[[rules]]\nname = \"a\"\nkey = \"global\"\nrate = \"1/s\"\nburst = 1\n";
    let two =
        format!("{one}\n[[rules]]\nname = \"b\"\nkey = \"global\"\nrate = \"1/s\"\nburst = 1\n");
    std::fs::write(&path, &two).unwrap();
    let st = store(&clock);
    let (layer, reloader) = Reloader::<String, _>::load(&path, st).unwrap();
    // The editor has written the first rule of a new version so far.
    std::fs::write(&path, format!("{one}# being edited\n")).unwrap();
    assert_eq!(reloader.poll_once().unwrap(), Reloaded::Unchanged);
    assert_eq!(
        layer.rule_names(),
        ["a", "b"],
        "a half-written file was applied"
    );
    // Done: the next poll sees a new text, the one after applies it.
    let three =
        format!("{two}\n[[rules]]\nname = \"c\"\nkey = \"global\"\nrate = \"1/s\"\nburst = 1\n");
    std::fs::write(&path, &three).unwrap();
    assert_eq!(reloader.poll_once().unwrap(), Reloaded::Unchanged);
    assert_eq!(reloader.poll_once().unwrap(), Reloaded::Applied);
    assert_eq!(layer.rule_names(), ["a", "b", "c"]);
    // A SIGHUP (an explicit reload) applies at once.
    std::fs::write(&path, one).unwrap();
    assert_eq!(reloader.reload().unwrap(), Reloaded::Applied);
    assert_eq!(layer.rule_names(), ["a"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Policy-security review #8.1: a layer built with a custom rejection
/// and a reloader made without the same `customize` lost the rejection on
/// the first reload, silently. `load_with` builds both from one closure.
#[tokio::test]
async fn a_reload_keeps_what_load_with_added() {
    let dir = std::env::temp_dir().join(format!("tollgate-load-with-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("policy.toml");
    let rule = |rate: &str| {
        format!(
            "[[rules]]\nname = \"one\"\nkey = \"header:x-api-key\"\nrate = \"{rate}\"\nburst = 1\n"
        )
    };
    std::fs::write(&path, rule("1/min")).unwrap();
    let (layer, reloader) = Reloader::<String, _>::load_with(&path, MemoryStore::new(), |b| {
        b.rejection(|_| {
            let mut res = http::Response::new(bytes::Bytes::from_static(b"custom"));
            *res.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            res
        })
    })
    .unwrap();
    let mut svc = layer.layer(ok_service());
    assert_eq!(
        status(&mut svc, req("GET", "/", "k")).await.0,
        StatusCode::OK
    );
    let refused = status(&mut svc, req("GET", "/", "k")).await.0;
    assert_eq!(
        refused,
        StatusCode::SERVICE_UNAVAILABLE,
        "the custom rejection"
    );
    std::fs::write(&path, rule("2/min")).unwrap();
    assert_eq!(reloader.reload().unwrap(), Reloaded::Applied);
    assert_eq!(
        status(&mut svc, req("GET", "/", "k2")).await.0,
        StatusCode::OK
    );
    let refused = status(&mut svc, req("GET", "/", "k2")).await.0;
    assert_eq!(
        refused,
        StatusCode::SERVICE_UNAVAILABLE,
        "still the custom rejection after the reload"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Policy-security review #8.2: a reload checked only on a throwaway
/// store, so an error only the running store raises — a rule named like
/// another layer's rule of another kind — stopped the build after the
/// rules before it were rebound: the failed reload had changed
/// `per-client`'s binding, and a later one started its budgets afresh.
/// Now it is checked on the running store, which nothing changes, first.
#[tokio::test]
async fn a_reload_only_the_running_store_refuses_rebinds_nothing() {
    let clock = ManualClock::new();
    let dir = std::env::temp_dir().join(format!("tollgate-stage-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("policy.toml");
    let v1 = "[[rules]]\nname = \"per-client\"\nkey = \"header:x-api-key\"\nrate = \"1/min\"\nburst = 1\n";
    std::fs::write(&path, v1).unwrap();
    let st = store(&clock);
    // Another layer's in-flight limit, on the same store.
    let _other = st
        .concurrency_limiter(
            &tollgate_core::ConcurrencyRule::new("in-flight", 4, Duration::from_secs(30)).unwrap(),
        )
        .unwrap();
    let first = PolicyFile::read(&path).unwrap();
    let layer = first
        .builder::<String>()
        .unwrap()
        .store(st.clone())
        .build()
        .unwrap();
    let reloader = Reloader::new(&path, &first, st.clone(), &layer);
    // v2: per-client as a fixed window, then a rate rule named like the
    // other layer's concurrency rule: a fresh store takes it, the running
    // one does not.
    let v2 = "[[rules]]\nname = \"per-client\"\nkey = \"header:x-api-key\"\nalgorithm = \"fixed_window\"\nrate = \"1/min\"\n\n[[rules]]\nname = \"in-flight\"\nkey = \"global\"\nrate = \"100/s\"\nburst = 100\n";
    std::fs::write(&path, v2).unwrap();
    assert!(reloader.reload().is_err());
    // per-client is bound as v1 has it: binding v1's rule again shares it
    // (a rebinding would make it a conflict).
    let v1_rule = tollgate_core::Rule::new(
        "per-client",
        tollgate_core::Limit::gcra(tollgate_core::Rate::per_minute(1), 1),
    )
    .unwrap();
    assert!(
        st.limiter(&v1_rule).is_ok(),
        "a failed reload rebound per-client"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Policy-security review (the review of the walk): a builder error about
/// a rule the file does not hold (added in code after the file's) still
/// names the rule; one about a file's rule is placed at its line.
#[test]
fn builder_errors_name_their_rule_by_index() {
    let file = PolicyFile::parse(QUICK).unwrap();
    let past = tollgate_core::ConfigError::new("burst", "must be at least 1").in_item("rules", 40);
    let e = file.config_error(&past);
    assert_eq!((e.field(), e.line()), ("rules[40].burst", 0));
    let first = tollgate_core::ConfigError::new("burst", "must be at least 1").in_item("rules", 0);
    let e = file.config_error(&first);
    assert_eq!(e.field(), "rules[0].burst");
    assert!(e.line() > 0, "{e}");
}

/// `QUICK` with calendar quotas: a day per client (more on the pro
/// plan), and one per address.
fn with_quotas(extra: &str) -> String {
    format!(
        r#"{QUICK}
[[quotas]]
name = "daily"
key = "header:x-api-key | client-ip"
limits = {{ day = 2 }}
cost = {{ default = 1, routes = [{{ method = "POST", path = "/api/orders", cost = 3 }}] }}
soft_limit = 0.5
plans.pro = {{ day = 4 }}

[[quotas]]
name = "daily-address"
key = "client-ip"
limits = {{ day = 100, month = 1000 }}
zone = "-05:00"
{extra}"#
    )
}

/// Issue 32, a first step: a policy file declares calendar quotas too,
/// each built as a `QuotaLayer` by name, with its key, cost, plans and
/// soft limit.
#[tokio::test]
async fn a_file_declares_quotas_as_well() {
    // Noon, 2026-12-05 UTC: no period ends during the test.
    let clock = ManualClock::starting_at(1_796_472_000_000_000_000);
    let file = PolicyFile::parse(&with_quotas("")).unwrap();
    assert_eq!(file.quota_names(), ["daily", "daily-address"]);
    let daily = file.quota("daily", &store(&clock)).unwrap();
    assert_eq!(daily.rule_name(), "daily");
    let mut svc = daily.layer(ok_service());
    // A read costs 1 of the day's 2; the soft limit (half) warns.
    assert_eq!(
        status(&mut svc, req("GET", "/a", "k")).await.0,
        StatusCode::OK
    );
    assert_eq!(
        status(&mut svc, req("GET", "/a", "k")).await.0,
        StatusCode::OK
    );
    assert_eq!(
        status(&mut svc, req("GET", "/a", "k")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    // An order costs 3, over a fresh client's day of 2; the pro plan's 4
    // has room for it.
    assert_eq!(
        status(&mut svc, req("POST", "/api/orders", "other"))
            .await
            .0,
        StatusCode::TOO_MANY_REQUESTS
    );
    let mut pro = req("POST", "/api/orders", "pro-client");
    pro.headers_mut().insert("x-plan", "pro".parse().unwrap());
    assert_eq!(status(&mut svc, pro).await.0, StatusCode::OK);
    // The other quota: per address, two periods, its own zone.
    let address = file.quota("daily-address", &store(&clock)).unwrap();
    assert_eq!(address.rule_name(), "daily-address");
    // An unknown name.
    let e = file.quota("weekly", &store(&clock)).unwrap_err();
    assert_eq!(e.field(), "quotas");
}

#[test]
fn quota_errors_name_the_line_and_the_field() {
    let e = |extra: &str| error(&with_quotas(extra));
    let last = with_quotas("").lines().count();
    let at = |line: usize, rest: &str| format!("{line}:{rest}");
    let q = |body: &str| format!("\n[[quotas]]\nname = \"q\"\nkey = \"global\"\n{body}");
    assert_eq!(
        e(&q("limits = { fortnight = 5 }")),
        at(last + 5, "24: quotas[2].limits.fortnight: is not a period: one of minute, hour, day, week, month, year")
    );
    assert_eq!(
        e(&q("limits = { day = 0 }")),
        at(last + 5, "18: quotas[2].limits.day: must be at least 1")
    );
    assert_eq!(
        e(&q("limits = {}")),
        at(
            last + 5,
            "10: quotas[2].limits: name at least one period, e.g. { day = 1000 }"
        )
    );
    assert!(
        e(&q("limits = { day = 5 }\nsoft_limit = 1.5")).starts_with(&at(
            last + 6,
            "14: quotas[2].soft_limit: must be more than 0 and at most 1"
        ))
    );
    assert!(
        e(&q("limits = { day = 5 }\ncost = \"pricey\"")).starts_with(&at(
            last + 6,
            "8: quotas[2].cost: no [costs.pricey] is declared"
        ))
    );
    assert!(e(&q("limits = { day = 5 }\nzone = \"+25:00\""))
        .starts_with(&at(last + 6, "8: quotas[2].zone: ")));
    assert!(e(&q("limits = { day = 5 }\nmissing_key = \"maybe\""))
        .starts_with(&at(last + 6, "15: quotas[2].missing_key: must be")));
    assert!(e(&q("limits = { day = 5 }\nlimts = 3"))
        .starts_with(&at(last + 6, "1: quotas[2].limts: unknown field")));
    assert!(
        e(&q("")).starts_with(&format!(
            "{}:1: quotas[2]: missing field `limits`",
            last + 2
        )),
        "{}",
        e(&q(""))
    );
    // A name twice: the second is refused, at its entry.
    assert!(
        e("\n[[quotas]]\nname = \"daily\"\nkey = \"global\"\nlimits = { day = 1 }").starts_with(
            &at(
                last + 2,
                "1: quotas[2].name: the name \"daily\" is taken by another entry of [[quotas]]"
            )
        )
    );
    // Plans with no plan source in the file.
    let no_source = with_quotas("").replace("plan_from = \"header:x-plan\"", "");
    assert!(error(&no_source).contains("plan"), "{}", error(&no_source));
}

/// `QUICK` with in-flight limits and download pacing.
fn with_limits(extra: &str) -> String {
    format!(
        r#"{QUICK}
[[concurrency]]
name = "per-client"
key = "header:x-api-key"
max = 1
plans.pro = 2
queue = {{ max_len = 4, max_wait = "50ms" }}
adaptive = {{ name = "service", algorithm = "aimd", min = 4, initial = 8, max = 64 }}
read_only = {{ above = 0.5, window = "10s", min_requests = 20 }}
lease_ttl = "30s"

[[bandwidth]]
name = "download-rate"
key = "client-ip"
rate = "256 KiB/s"
burst = 65536
direction = "both"
chunk = "16 KiB"
{extra}"#
    )
}

/// Issue 32: a policy file declares in-flight limits and pacing too,
/// each built by name.
#[tokio::test(start_paused = true)]
async fn a_file_declares_in_flight_limits_and_pacing() {
    let clock = ManualClock::starting_at(1_796_472_000_000_000_000);
    let file = PolicyFile::parse(&with_limits("")).unwrap();
    assert_eq!(file.concurrency_names(), ["per-client"]);
    assert_eq!(file.bandwidth_names(), ["download-rate"]);
    let layer = file.concurrency("per-client", &store(&clock)).unwrap();
    assert_eq!(layer.rule_name(), "per-client");
    assert_eq!(layer.adaptive_limit(), Some(8));
    let svc = layer.layer(ok_service());
    // One in flight per key: the first response holds its permit until
    // its body is done; the second waits its 50 ms in the queue, then is
    // refused. The pro plan holds two.
    let first = svc.clone().oneshot(req("GET", "/a", "k")).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    let second = svc.clone().oneshot(req("GET", "/a", "k")).await.unwrap();
    assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
    let pro = || {
        let mut r = req("GET", "/a", "p");
        r.headers_mut().insert("x-plan", "pro".parse().unwrap());
        r
    };
    let _p1 = svc.clone().oneshot(pro()).await.unwrap();
    let p2 = svc.clone().oneshot(pro()).await.unwrap();
    assert_eq!(p2.status(), StatusCode::OK);
    drop(first);
    assert_eq!(
        svc.clone()
            .oneshot(req("GET", "/a", "k"))
            .await
            .unwrap()
            .status(),
        StatusCode::OK
    );
    file.bandwidth("download-rate", &store(&clock)).unwrap();
}

#[test]
fn in_flight_and_pacing_errors_name_the_line_and_the_field() {
    let e = |extra: &str| error(&with_limits(extra));
    let last = with_limits("").lines().count();
    let c = |body: &str| format!("\n[[concurrency]]\nname = \"c\"\nkey = \"global\"\n{body}");
    let b = |body: &str| format!("\n[[bandwidth]]\nname = \"b\"\nkey = \"global\"\n{body}");
    let at = |line: usize, rest: &str| format!("{line}:{rest}");
    assert!(
        e(&c("max = 0")).starts_with(&at(last + 5, "7: concurrency[1].max: must be at least 1"))
    );
    assert!(e(&c("max = 2\nmax_lifetime = \"0s\"")).starts_with(&at(
        last + 6,
        "16: concurrency[1].max_lifetime: must be longer than zero"
    )));
    assert!(
        e(&c("max = 2\nqueue = { max_len = 0, max_wait = \"1s\" }")).starts_with(&at(
            last + 6,
            "21: concurrency[1].queue.max_len: must be at least 1"
        ))
    );
    let adaptive = "max = 2\nadaptive = { name = \"s\", algorithm = \"gradient\", min = 8, initial = 4, max = 16 }";
    assert!(
        e(&c(adaptive)).contains("concurrency[1].adaptive."),
        "{}",
        e(&c(adaptive))
    );
    assert!(e(&c("max = 2\nadaptive = { name = \"s\", algorithm = \"vegas\", min = 1, initial = 1, max = 1 }"))
        .contains("concurrency[1].adaptive.algorithm: must be \"gradient\" or \"aimd\""));
    assert!(e(&c("max = 2\nservice = { name = \"s\", max = 9 }\nadaptive = { name = \"t\", algorithm = \"aimd\", min = 1, initial = 1, max = 2 }"))
        .contains("concurrency[1].service: a service limit is fixed"));
    assert!(
        e(&c("max = 2\nadaptive = { name = \"s\", algorithm = \"aimd\", min = 1, initial = 1, max = 2 }\nread_only = { above = 2.0, window = \"1s\" }"))
            .contains("concurrency[1].read_only: error_rate must be between 0 and 1")
    );
    assert!(
        e(&c("max = 2\nplans.pro = 0")).contains("concurrency[1].plans.pro: must be at least 1")
    );
    assert!(e(&b("rate = \"256 KiB\"\nburst = 1")).starts_with(&at(
        last + 5,
        "8: bandwidth[1].rate: is not a number of bytes like \"256 KiB/s\""
    )));
    assert!(e(&b("rate = \"1 parsec/s\"\nburst = 1"))
        .contains("bandwidth[1].rate: is not a number of bytes"));
    assert!(e(&b("rate = 100\nburst = 0")).contains("bandwidth[1].burst: must be at least 1 byte"));
    assert!(e(&b("rate = \"8 GiB/s\"\nburst = 1")).contains("bandwidth[1].rate: must be at most"));
    assert!(e(&b("rate = 100\nburst = 10\ndirection = \"sideways\""))
        .contains("bandwidth[1].direction: must be \"responses\", \"requests\" or \"both\""));
    // The builder's own checks, placed: a chunk above the burst.
    assert!(
        e(&b("rate = 100\nburst = 10\nchunk = 20")).contains("bandwidth[1].chunk"),
        "{}",
        e(&b("rate = 100\nburst = 10\nchunk = 20"))
    );
    // Each name once per list.
    assert!(e("\n[[bandwidth]]\nname = \"download-rate\"\nkey = \"global\"\nrate = 1\nburst = 1")
        .contains("bandwidth[1].name: the name \"download-rate\" is taken by another entry of [[bandwidth]]"));
}

/// Review of the new sections: offsets keep their sign (`-00:30` is west
/// of UTC; a second sign is refused), the builders' own bounds are
/// placed at the file's fields, names are one store's across the lists,
/// and a reload says which sections it does not apply.
#[test]
fn offsets_bounds_names_and_unapplied_sections() {
    use tollgate_core::calendar::Offset;
    let zone =
        |text: &str| super::build::zone(&spec::Spanned::new(0..0, text.to_owned()), "zone".into());
    assert_eq!(
        zone("-00:30").unwrap().fixed(),
        Some(Offset::from_seconds(-1_800).unwrap())
    );
    assert_eq!(
        zone("+5:30").unwrap().fixed(),
        Some(Offset::from_seconds(19_800).unwrap())
    );
    assert_eq!(zone("UTC").unwrap().fixed(), Some(Offset::UTC));
    for bad in [
        "--05:00",
        "+-05:00",
        "+05:+30",
        "+05:3",
        "+05:30:00",
        "+0530",
        "+05:60",
        "+19:00",
    ] {
        assert!(zone(bad).is_err(), "{bad}");
    }
    let e = |extra: &str| error(&with_limits(extra));
    let last = with_limits("").lines().count();
    let b = |body: &str| format!("\n[[bandwidth]]\nname = \"b\"\nkey = \"global\"\n{body}");
    let c = |body: &str| format!("\n[[concurrency]]\nname = \"c\"\nkey = \"global\"\n{body}");
    // The builder's bound (a billion bytes a second), at `rate`'s line.
    assert!(
        e(&b("rate = \"1 GiB/s\"\nburst = 1"))
            .starts_with(&format!("{}:8: bandwidth[1].rate: ", last + 5)),
        "{}",
        e(&b("rate = \"1 GiB/s\"\nburst = 1"))
    );
    assert!(e(&c(
        "max = 2\nqueue = { max_len = 20000, max_wait = \"1s\" }"
    ))
    .starts_with(&format!("{}:9: concurrency[1].queue: ", last + 6)));
    assert!(
        e(&c("max = 2\nread_only = { above = 1.0, window = \"1s\" }"))
            .starts_with(&format!("{}:13: concurrency[1].read_only: ", last + 6))
    );
    // A quota named like a rule.
    assert!(
        e("\n[[quotas]]\nname = \"per-key\"\nkey = \"global\"\nlimits = { day = 1 }").contains(
            "quotas[0].name: the name \"per-key\" is taken by another entry of [[rules]]"
        )
    );
    // A reload names what it does not apply.
    let before = PolicyFile::parse(&with_limits("")).unwrap();
    let after = PolicyFile::parse(&with_limits("").replace("max = 1\n", "max = 3\n")).unwrap();
    assert_eq!(after.unapplied_changes(&before), ["[[concurrency]]"]);
    assert!(before.unapplied_changes(&before).is_empty());
}

/// The README's configuration example loads, and declares what it says.
#[cfg(feature = "tz")]
#[test]
fn the_readme_configuration_example_loads() {
    let readme = include_str!("../../../../README.md");
    let section = readme.split("## Configuration").nth(1).unwrap();
    let example = section
        .split("```toml\n")
        .nth(1)
        .and_then(|s| s.split("```").next())
        .unwrap();
    let file = PolicyFile::parse(example).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(file.quota_names(), ["daily"]);
    assert_eq!(file.concurrency_names(), ["per-client"]);
    assert_eq!(file.bandwidth_names(), ["download-rate"]);
    assert_eq!(file.describe().len(), 4);
    // The second example, a client's retries and the store, loads with
    // the first.
    let second = section
        .split("```toml\n")
        .nth(2)
        .and_then(|s| s.split("```").next())
        .unwrap();
    let file = PolicyFile::parse(&format!("{example}\n{second}")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(file.retry_budget_names(), ["payments"]);
    assert_eq!(file.describe().len(), 5);
}

/// Review of the new sections: a cost known at load above every plan's
/// limit could never pass, and is refused at `cost` (as a rule's is).
#[test]
fn a_cost_no_plan_can_hold_is_refused_at_load() {
    let e = error(&with_quotas("").replace(
        "cost = { default = 1, routes = [{ method = \"POST\", path = \"/api/orders\", cost = 3 }] }",
        "cost = \"api\"",
    ));
    assert!(e.contains("quotas[0].cost: "), "{e}");
    assert!(e.contains("could never pass"), "{e}");
    let e = error(&with_limits("").replace("max = 1\n", "max = 1\ncost = 3\n"));
    assert!(e.contains("concurrency[0].cost: every request costs 3, more than this limit ever admits at once (2, every plan included)"), "{e}");
}

/// A sub-table of a `[[list]]` entry keeps the entry's index in an
/// error's field path; a table of its own (`[costs.api]`) does not.
#[test]
fn a_sub_table_of_an_entry_is_named_by_the_entry() {
    let text = with_limits(
        "\n[[concurrency]]\nname = \"c\"\nkey = \"global\"\nmax = 2\n\n[concurrency.queue]\nmax_len = 3\nmax_wiat = \"1s\"\n",
    );
    let e = error(&text);
    assert!(
        e.contains(": concurrency[1].queue.max_wiat: unknown field"),
        "{e}"
    );
    // A `[[rules]]` entry's plan table after it is the entry's too.
    let plan = error(
        "plan_from = \"extension\"\n[[rules]]\nname = \"a\"\nkey = \"global\"\nrate = \"1/s\"\nburst = 1\n\n[rules.plans.pro]\nrate = \"2/s\"\nburts = 2\n",
    );
    assert!(
        plan.contains(": rules[0].plans.pro.burts: unknown field"),
        "{plan}"
    );
}

/// Issue 32: which routes a limit applies to is declared in the file;
/// a request elsewhere passes the limit uncharged, and `describe` says
/// where each applies.
#[tokio::test]
async fn a_file_scopes_each_limit_to_its_routes() {
    let clock = ManualClock::starting_at(1_796_472_000_000_000_000);
    let text = r#"
[[rules]]
name = "reports"
key = "header:x-api-key"
rate = "1/h"
burst = 1
routes = ["POST /api/reports", "/api/reports/{id}"]

[[quotas]]
name = "downloads"
key = "header:x-api-key"
limits = { day = 1 }
routes = ["GET /files/{*path}"]
"#;
    let file = PolicyFile::parse(text).unwrap();
    assert_eq!(
        file.describe(),
        [
            "rule \"reports\": key header:x-api-key; gcra 1/h, burst 1; on POST /api/reports, /api/reports/{id}",
            "quota \"downloads\": key header:x-api-key; 1 a day; on GET /files/{*path}",
        ]
    );
    let mut policy = file
        .layer::<String, _>(&store(&clock))
        .unwrap()
        .layer(ok_service());
    let mut quota = file
        .quota("downloads", &store(&clock))
        .unwrap()
        .layer(ok_service());
    for _ in 0..3 {
        // Out of scope: no key needed, nothing charged.
        assert_eq!(
            status(&mut policy, req("GET", "/api/reports", "")).await.0,
            StatusCode::OK
        );
        assert_eq!(
            status(&mut quota, req("GET", "/files", "")).await.0,
            StatusCode::OK
        );
        assert_eq!(
            status(&mut quota, req("POST", "/files/a", "k")).await.0,
            StatusCode::OK
        );
    }
    for (method, path) in [("POST", "/api/reports"), ("DELETE", "/api/reports/7")] {
        let mut policy = file
            .layer::<String, _>(&store(&clock))
            .unwrap()
            .layer(ok_service());
        assert_eq!(
            status(&mut policy, req(method, path, "k")).await.0,
            StatusCode::OK
        );
        assert_eq!(
            status(&mut policy, req(method, path, "k")).await.0,
            StatusCode::TOO_MANY_REQUESTS,
            "{method} {path}"
        );
    }
    assert_eq!(
        status(&mut quota, req("HEAD", "/files/a/b", "k")).await.0,
        StatusCode::OK
    );
    assert_eq!(
        status(&mut quota, req("GET", "/files/c", "k")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[test]
fn route_errors_name_the_entry_and_the_route() {
    const BASE: &str = "[[rules]]\nname = \"base\"\nkey = \"global\"\nrate = \"1/s\"\nburst = 1\n";
    let q = |routes: &str| {
        error(&format!(
            "{BASE}[[quotas]]\nname = \"q\"\nkey = \"global\"\nlimits = {{ day = 5 }}\nroutes = {routes}\n"
        ))
    };
    assert_eq!(
        q("[]"),
        "10:10: quotas[0].routes: is empty: the limit would apply to no request (leave it out for every route)"
    );
    assert_eq!(
        q(r#"["/a", "get /b"]"#),
        "10:17: quotas[0].routes[1]: \"get\" is not an HTTP method in upper case, like \"GET\""
    );
    assert_eq!(
        q(r#"["/a/{*rest}/b"]"#),
        "10:11: quotas[0].routes[0]: \"/a/{*rest}/b\": \"{*rest}\" must be the last segment"
    );
    assert!(q(r#"["a"]"#).starts_with("10:11: quotas[0].routes[0]: \"a\" must start with"));
    let c = error(&format!(
        "{BASE}[[concurrency]]\nname = \"c\"\nkey = \"global\"\nmax = 1\nroutes = [\"/x/{{id}}.png\"]\n"
    ));
    assert!(c.starts_with("10:11: concurrency[0].routes[0]: "), "{c}");
    let b = error(&format!(
        "{BASE}[[bandwidth]]\nname = \"b\"\nkey = \"global\"\nrate = 1\nburst = 1\nroutes = [\"x\"]\n"
    ));
    assert!(b.starts_with("11:11: bandwidth[0].routes[0]: "), "{b}");
    let r =
        error("[[rules]]\nname = \"r\"\nkey = \"global\"\nrate = \"1/s\"\nburst = 1\nroutes = [\"PUT\"]\n");
    assert!(
        r.starts_with("6:11: rules[0].routes[0]: \"PUT\" must start with"),
        "{r}"
    );
}

/// Issue 32: `[store]` names the store: memory (the default) or Redis,
/// its URL and key secret from the environment or a file, never printed.
#[tokio::test]
async fn the_store_section_builds_the_store_and_keeps_secrets_out_of_errors() {
    const BASE: &str =
        "[[rules]]\nname = \"base\"\nkey = \"global\"\nrate = \"1/s\"\nburst = 1\n\n";
    let file = |store: &str| PolicyFile::parse(&format!("{BASE}[store]\n{store}"));
    let error = |store: &str| shown(&file(store).unwrap_err());
    // No section, or kind = "memory": the in-memory store.
    assert!(PolicyFile::parse(BASE).unwrap().store().is_ok());
    let mem = file("kind = \"memory\"\nmax_keys = 1000\nsweep_idle_every = \"10s\"\n").unwrap();
    assert!(matches!(mem.store(), Ok(s) if format!("{s:?}").contains("Memory")));
    assert_eq!(
        error("kind = \"etcd\"\n"),
        "8:8: store.kind: must be \"memory\" or \"redis\""
    );
    assert_eq!(
        error("kind = \"memory\"\nprefix = \"x\"\n"),
        "7:1: store.prefix: is a setting of kind = \"redis\", not of kind = \"memory\""
    );
    assert_eq!(
        error("kind = \"memory\"\nmax_keys = 0\n"),
        "9:12: store.max_keys: must be at least 1"
    );
    assert_eq!(
        error("kind = \"redis\"\nprefix = \"x\"\n"),
        "7:1: store.url: is missing: a Redis store needs one of url, url_env or url_file"
    );
    // A password in the file is refused, and not repeated.
    let e = error("kind = \"redis\"\nurl = \"redis://app:hunter2@h:6379\"\nprefix = \"x\"\n");
    assert!(e.starts_with("9:7: store.url: holds a password"), "{e}");
    assert!(!e.contains("hunter2"), "{e}");
    assert!(
        error("kind = \"redis\"\nurl_env = \"U\"\nfailure_policy = \"fallback/0\"\n")
            .starts_with("10:18: store.failure_policy: must be")
    );
    assert!(
        error("kind = \"redis\"\nurl_env = \"U\"\ntimeout = \"soon\"\n")
            .starts_with("10:11: store.timeout: ")
    );
    // The URL from a variable that is not set: named, and no value.
    let redis = file(
        "kind = \"redis\"\nurl_env = \"TOLLGATE_TEST_UNSET_URL\"\nprefix = \"t\"\nfailure_policy = \"fallback/4\"\n",
    )
    .unwrap();
    let e = redis.store().unwrap_err();
    assert_eq!(e.field(), "store.url_env");
    assert!(e.message().contains("TOLLGATE_TEST_UNSET_URL"), "{e}");
    // From a file: read and trimmed; a builder's error names the
    // file's field.
    let dir = std::env::temp_dir().join(format!("tollgate-store-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let url_file = dir.join("url");
    std::fs::write(&url_file, "redis://:s3cret@127.0.0.1:1\n").unwrap();
    let from_file = |extra: &str| {
        file(&format!(
            "kind = \"redis\"\nurl_file = {:?}\n{extra}",
            url_file.display().to_string()
        ))
        .unwrap()
        .store()
    };
    let e = from_file("").unwrap_err();
    assert_eq!(e.field(), "store.prefix", "{e}");
    assert!(!e.to_string().contains("s3cret"), "{e}");
    assert!(from_file("prefix = \"t\"\ntimeout = \"50ms\"\n").is_ok());
    assert!(
        e.message()
            .starts_with("is missing: name your service (prefix = "),
        "{e}"
    );
    // The key secret from a file (16 to 64 bytes), or from one place only.
    let secret = dir.join("secret");
    std::fs::write(&secret, "0123456789abcdef0123\n").unwrap();
    let with_secret = format!(
        "prefix = \"t\"\nkey_secret_file = {:?}\n",
        secret.display().to_string()
    );
    assert!(from_file(&with_secret).is_ok());
    std::fs::write(&secret, "short").unwrap();
    let e = from_file(&with_secret).unwrap_err();
    assert_eq!(e.field(), "store.key_secret_file", "{e}");
    assert!(!e.to_string().contains("short"), "{e}");
    assert!(error(
        "kind = \"redis\"\nurl_env = \"U\"\nkey_secret_env = \"K\"\nkey_secret_file = \"f\"\n"
    )
    .contains("store.key_secret_file: give one of key_secret_env or key_secret_file"));
    // `[store.hot_keys]`: HotKeys's own bounds, each error at its value.
    let hot = |table: &str| {
        error(&format!(
            "kind = \"redis\"\nurl_env = \"U\"\n[store.hot_keys]\n{table}"
        ))
    };
    assert_eq!(
        hot("ttl = \"20s\"\n"),
        "11:7: store.hot_keys.ttl: ttl must be from 1 ms to 10 s"
    );
    assert_eq!(
        hot("max_share = 0.0\n"),
        "11:13: store.hot_keys.max_share: max_share must be above 0 and at most 1"
    );
    assert_eq!(
        hot("max_batch = 4\nmin_batch = 9\n"),
        "12:13: store.hot_keys.min_batch: min_batch must be from 1 to max_batch"
    );
    assert_eq!(
        hot("max_keys = -1\n"),
        "11:12: store.hot_keys.max_keys: must not be negative"
    );
    assert!(hot("ahead = true\n").contains("unknown field `ahead`"));
    assert_eq!(
        error("kind = \"memory\"\n[store.hot_keys]\nttl = \"1s\"\n"),
        "7:1: store.hot_keys: is a setting of kind = \"redis\", not of kind = \"memory\""
    );
    let leased = file(
        "kind = \"redis\"\nurl = \"redis://127.0.0.1:1\"\nprefix = \"t\"\n[store.hot_keys]\nttl = \"100ms\"\nrefill_ahead = true\nrules = [\"base\"]\n",
    )
    .unwrap()
    .store()
    .unwrap();
    assert!(leased.is_leased());
    // A password in a Unix socket URL's query is a password too.
    assert!(error(
        "kind = \"redis\"\nurl = \"redis+unix:///run/r.sock?pass=pw\"\nprefix = \"t\"\n"
    )
    .contains("store.url: holds a password"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Issue 32: a client's retry budget from the file: its budget, its
/// attempts, and which outcomes it retries.
#[tokio::test(start_paused = true)]
async fn a_file_declares_retry_budgets_for_clients() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let text = format!(
        "{QUICK}\n[[retry_budgets]]\nname = \"upstream\"\nmax_attempts = 3\nbackoff = {{ base = \"1ms\", cap = \"5ms\" }}\nretry_on = [\"error\", 500, \"UNAVAILABLE\"]\n\n[[retry_budgets]]\nname = \"per-tenant\"\nkey = \"header:x-tenant\"\nratio = 0.5\nmin_per_second = 0\n"
    );
    let file = PolicyFile::parse(&text).unwrap();
    assert_eq!(file.retry_budget_names(), ["upstream", "per-tenant"]);
    assert!(file
        .describe()
        .contains(&"retry budget \"upstream\": key upstream; at most 3 attempts".to_owned()));
    // An upstream that answers `answer` (a status, or a gRPC code) and
    // counts its calls.
    let calls_for = |status: u16, grpc: Option<&'static str>| {
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&calls);
        let svc = service_fn(move |_r: Request<crate::retry::ReplayBody<String>>| {
            counted.fetch_add(1, Ordering::SeqCst);
            let mut res = Response::new(String::new());
            *res.status_mut() = StatusCode::from_u16(status).unwrap();
            if let Some(code) = grpc {
                res.headers_mut()
                    .insert("grpc-status", code.parse().unwrap());
            }
            async move { Ok::<_, Infallible>(res) }
        });
        (calls, svc)
    };
    let layer = file.retry_budget("upstream", &MemoryStore::new()).unwrap();
    for (status, grpc, attempts) in [
        (500, None, 3),       // named: retried
        (500, Some("2"), 3),  // an HTTP 500, whatever its grpc-status says
        (503, None, 3),       // UNAVAILABLE to a gRPC client, which it names
        (404, None, 1),       // UNIMPLEMENTED to one: not named
        (200, Some("2"), 1),  // UNKNOWN: not named
        (200, Some("14"), 3), // UNAVAILABLE
        (200, Some("8"), 1),  // RESOURCE_EXHAUSTED, not named
        (200, None, 1),
    ] {
        let (calls, svc) = calls_for(status, grpc);
        let _ = layer
            .layer(svc)
            .oneshot(
                Request::get("http://api.example/x")
                    .body(String::new())
                    .unwrap(),
            )
            .await;
        assert_eq!(calls.load(Ordering::SeqCst), attempts, "{status} {grpc:?}");
    }
    // Errors name the entry and the field.
    let e = |entry: &str| {
        error(&format!(
            "{QUICK}\n[[retry_budgets]]\nname = \"r\"\n{entry}"
        ))
    };
    let last = QUICK.lines().count();
    assert_eq!(
        e("retry_on = [\"error\", 200]\n"),
        format!("{}:22: retry_budgets[0].retry_on[1]: must be \"error\", an HTTP status from 400 to 599, or a gRPC code by name (\"UNAVAILABLE\")", last + 4)
    );
    assert!(e("retry_on = [\"OK\"]\n").contains("retry_budgets[0].retry_on[0]"));
    assert!(
        e("ratio = -0.5\n").starts_with(&format!("{}:9: retry_budgets[0].ratio: ", last + 4)),
        "{}",
        e("ratio = -0.5\n")
    );
    assert!(e("max_attempts = 0\n").contains("retry_budgets[0].max_attempts"));
    assert!(e("key = \"header:\"\n").contains("retry_budgets[0].key"));
    assert!(e("backoff = { base = \"1ms\" }\n").contains("missing field `cap`"));
    // A name another list holds.
    let taken = error(&format!("{QUICK}\n[[retry_budgets]]\nname = \"per-key\"\n"));
    assert!(
        taken.contains("retry_budgets[0].name: the name \"per-key\" is taken"),
        "{taken}"
    );
}

/// Issue 32: the JSON Schema checked in (`policy.schema.json`) is the one
/// the file's types generate; `TOLLGATE_BLESS=1` writes it anew.
#[cfg(feature = "schema")]
#[test]
fn the_checked_in_schema_is_the_generated_one() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/policy.schema.json");
    let generated = super::json_schema();
    if std::env::var_os("TOLLGATE_BLESS").is_some() {
        std::fs::write(path, &generated).unwrap();
    }
    let checked_in = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        checked_in == generated,
        "policy.schema.json is stale: TOLLGATE_BLESS=1 cargo test -p tollgate --features schema --lib schema"
    );
    let v: serde_json::Value = serde_json::from_str(&generated).unwrap();
    for section in [
        "rules",
        "quotas",
        "concurrency",
        "bandwidth",
        "retry_budgets",
        "store",
        "access",
        "idempotency",
        "decision_log",
        "costs",
        "plan_from",
    ] {
        assert!(v["properties"].get(section).is_some(), "{section}");
    }
    // Unknown fields are refused, as the file's reader refuses them.
    assert_eq!(v["additionalProperties"], false);
    let quota = &v["$defs"]["QuotaSpec"];
    assert_eq!(quota["additionalProperties"], false, "{quota}");
    let required: Vec<&str> = quota["required"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap())
        .collect();
    assert_eq!(required, ["name", "key", "limits"]);
    // Bounds, from the constants the builders check against: an editor
    // refuses what loading the file would.
    let rule = &v["$defs"]["RuleSpec"]["properties"];
    assert_eq!(rule["burst"]["minimum"], 1, "{rule}");
    assert_eq!(rule["burst"]["maximum"], u32::MAX);
    assert_eq!(rule["buckets"]["minimum"], 1);
    assert_eq!(
        rule["buckets"]["maximum"],
        tollgate_core::SlidingWindowBuckets::MAX_BUCKETS
    );
    assert_eq!(rule["canary"]["maximum"], 1.0);
    assert_eq!(rule["warn_at"]["exclusiveMinimum"], 0);
    assert_eq!(
        v["$defs"]["EscalateSpec"]["properties"]["strikes"]["maximum"],
        tollgate_core::algorithm::Escalation::MAX_STRIKES
    );
    assert_eq!(
        v["$defs"]["HotKeysSpec"]["properties"]["max_share"]["maximum"],
        1
    );
}

/// Issue 32: a rule's proof-of-work challenge from the file, its secret
/// from the environment or a file; checking a file needs no secret.
#[tokio::test]
async fn a_file_declares_challenges_and_reads_their_secret_when_built() {
    let var = format!("TOLLGATE_TEST_CHALLENGE_{}", std::process::id());
    let text = |section: &str| {
        format!(
            "[challenge]\n{section}\nrequester = \"client-ip\"\n\n[[rules]]\nname = \"login\"\nkey = \"header:x-user\"\nrate = \"1/h\"\nburst = 1\nchallenge = {{ difficulty = 8, window = \"60s\" }}\n"
        )
    };
    let with_env = text(&format!("secret_env = \"{var}\""));
    // Checked without the secret: the shape alone.
    let file = PolicyFile::parse(&with_env).unwrap();
    let e = file.layer::<String, _>(&MemoryStore::new()).unwrap_err();
    assert_eq!(e.field(), "challenge.secret_env", "{e}");
    assert!(e.message().contains(&var), "{e}");
    std::env::set_var(&var, "a secret every instance shares");
    let mut svc = file
        .layer::<String, _>(&MemoryStore::new())
        .unwrap()
        .layer(ok_service());
    let login = || {
        let mut r = req("POST", "/login", "");
        r.headers_mut().insert("x-user", "alice".parse().unwrap());
        r
    };
    assert_eq!(
        svc.ready()
            .await
            .unwrap()
            .call(login())
            .await
            .unwrap()
            .status(),
        StatusCode::OK
    );
    let refused = svc.ready().await.unwrap().call(login()).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let challenge = refused.headers()["tollgate-challenge"]
        .to_str()
        .unwrap()
        .to_owned();
    // Solved, it passes once.
    let solution = crate::policy::ProofOfWork::solve(&challenge, 20).unwrap();
    let mut solved = login();
    solved
        .headers_mut()
        .insert("tollgate-solution", solution.parse().unwrap());
    assert_eq!(
        svc.ready()
            .await
            .unwrap()
            .call(solved)
            .await
            .unwrap()
            .status(),
        StatusCode::OK
    );
    // Errors name the field; the secret is never shown.
    let bad = |section: &str, rule: &str| {
        error(&format!(
            "[challenge]\n{section}\n\n[[rules]]\nname = \"r\"\nkey = \"global\"\nrate = \"1/s\"\nburst = 1\n{rule}\n"
        ))
    };
    let ok_secret = format!("secret_env = \"{var}\"");
    assert!(bad(
        &ok_secret,
        "challenge = { difficulty = 33, window = \"60s\" }"
    )
    .contains("rules[0].challenge.difficulty: must be 1 to 32 bits"));
    assert!(bad(
        &ok_secret,
        "challenge = { difficulty = 8, window = \"2h\" }"
    )
    .contains("rules[0].challenge.window: must be whole seconds"));
    assert!(bad("", "challenge = { difficulty = 8, window = \"60s\" }")
        .contains("challenge.secret_env: is missing"));
    assert!(bad("secret_env = \"A\"\nsecret_file = \"/x\"", "")
        .contains("challenge.secret_file: give one of secret_env or secret_file"));
    let no_section = error("[[rules]]\nname = \"r\"\nkey = \"global\"\nrate = \"1/s\"\nburst = 1\nchallenge = { difficulty = 8, window = \"60s\" }\n");
    assert!(
        no_section.contains("rules[0].challenge: needs the secret of a [challenge] section"),
        "{no_section}"
    );
    std::env::set_var(&var, "short");
    let e = file.layer::<String, _>(&MemoryStore::new()).unwrap_err();
    assert_eq!(e.field(), "challenge.secret_env");
    assert!(!e.to_string().contains("short"), "{e}");
}

/// Issue 32: `[audit]` records a file's refusals (rules and access lists
/// named) as `tollgate::audit` log events, with a keyed fingerprint of
/// the client and never its key; its bounds are the builder's.
#[tokio::test]
async fn the_audit_section_records_refusals_as_log_events() {
    let events = crate::policy::tests::Events(std::sync::Arc::default(), "tollgate::audit");
    let _guard = tracing::subscriber::set_default(events.clone());
    const RULE: &str =
        "[[rules]]\nname = \"per-client\"\nkey = \"header:x-api-key\"\nrate = \"1/min\"\nburst = 1\n\n";
    let file = PolicyFile::parse(&format!(
        "{RULE}[audit]\nrules = [\"per-client\"]\nper_second = 5\n"
    ))
    .unwrap();
    let clock = ManualClock::new();
    let mut svc = file
        .layer::<String, _>(&store(&clock))
        .unwrap()
        .layer(ok_service());
    assert_eq!(
        status(&mut svc, req("GET", "/", "sekrit-key")).await.0,
        StatusCode::OK
    );
    assert!(events.0.lock().unwrap().is_empty());
    assert_eq!(
        status(&mut svc, req("GET", "/", "sekrit-key")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    let lines = events.0.lock().unwrap().clone();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].contains("rule=per-client") && lines[0].contains("reason=limited"),
        "{lines:?}"
    );
    assert!(!lines[0].contains("sekrit"), "{lines:?}");
    let error = |audit: &str| {
        shown(
            &PolicyFile::parse(&format!("{RULE}[audit]\n{audit}"))
                .and_then(|f| f.layer::<String, _>(&store(&clock)).map(drop))
                .unwrap_err(),
        )
    };
    assert_eq!(
        error("rules = [\"per-client\"]\nper_second = 0\n"),
        "9:14: audit.per_second: must be from 1 to 4294967295"
    );
    assert!(
        error("rules = [\"nobody\"]\n").starts_with("7:1: audit: "),
        "{}",
        error("rules = [\"nobody\"]\n")
    );
    assert!(
        error("rules = [\"per-client\"]\nsecret_env = \"A\"\nsecret_file = \"b\"\n")
            .contains("audit.secret_file: give one of secret_env or secret_file")
    );
    // A secret from a file: read when built, 16 to 64 bytes, never shown.
    let dir = std::env::temp_dir().join(format!("tollgate-audit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("secret");
    std::fs::write(&path, "short-secret").unwrap();
    let with_file = format!(
        "rules = [\"per-client\"]\nsecret_file = {:?}\n",
        path.display().to_string()
    );
    let e = error(&with_file);
    assert!(
        e.contains("audit.secret_file: the secret must be 16 to 64 bytes"),
        "{e}"
    );
    assert!(!e.contains("short-secret"), "{e}");
    std::fs::write(&path, "a-secret-of-twenty-four!").unwrap();
    let file = PolicyFile::parse(&format!("{RULE}[audit]\n{with_file}")).unwrap();
    assert!(file.layer::<String, _>(&store(&clock)).is_ok());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A `Tollgate` whose limits share keys has each request read each
/// distinct key once (two keys here, read by four limits), and each limit
/// still counts by its own key: the tenant's rule by tenant, the key's
/// quota by API key.
#[tokio::test]
async fn a_tollgate_reads_each_distinct_key_once_a_request() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let text = r#"
[[rules]]
name = "per-key"
key = "header:x-api-key"
rate = "1/h"
burst = 10

[[rules]]
name = "per-tenant"
key = " header: X-Tenant "
rate = "1/h"
burst = 2

[[quotas]]
name = "daily"
key = "header:x-api-key"
limits = { day = 3 }

[[concurrency]]
name = "tenant"
key = "header:x-tenant"
max = 5
"#;
    let file = PolicyFile::parse(text).unwrap();
    let gate = super::Tollgate::new(&file, &MemoryStore::new()).unwrap();
    // The service sees none of what the limits remembered (under a
    // nested router its layers may read another path).
    let remembered = Arc::new(AtomicUsize::new(usize::MAX));
    let seen = Arc::clone(&remembered);
    let mut svc = gate.layer(service_fn(move |r: Request<axum::body::Body>| {
        seen.store(
            usize::from(r.extensions().get::<super::parts::Extracted>().is_some()),
            Ordering::Relaxed,
        );
        async { Ok::<_, Infallible>(Response::new(axum::body::Body::empty())) }
    }));
    let reads = || super::parts::READS.with(std::cell::Cell::get);
    let mut send = async |key: &str, tenant: &str| {
        let r = Request::get("/")
            .header("x-api-key", key)
            .header("x-tenant", tenant)
            .body(axum::body::Body::empty())
            .unwrap();
        ServiceExt::<Request<axum::body::Body>>::ready(&mut svc)
            .await
            .unwrap()
            .call(r)
            .await
            .unwrap()
            .status()
    };
    // One tenant, three API keys: the tenant's burst of 2, then refused.
    let before = reads();
    assert_eq!(send("k1", "t").await, StatusCode::OK);
    assert_eq!(
        reads() - before,
        2,
        "two distinct keys read, for four limits"
    );
    assert_eq!(remembered.load(Ordering::Relaxed), 0);
    assert_eq!(send("k2", "t").await, StatusCode::OK);
    assert_eq!(send("k3", "t").await, StatusCode::TOO_MANY_REQUESTS);
    // One API key, four tenants: its daily 3, then refused by the quota.
    for t in ["u1", "u2", "u3"] {
        assert_eq!(send("k9", t).await, StatusCode::OK, "{t}");
    }
    assert_eq!(send("k9", "u4").await, StatusCode::TOO_MANY_REQUESTS);

    // Keys that do not repeat are read where met, as before.
    let mut svc = empty_behind(
        "[[rules]]\nname = \"a\"\nkey = \"header:x-api-key\"\nrate = \"1/h\"\nburst = 1\n\n\
         [[quotas]]\nname = \"q\"\nkey = \"header:x-tenant\"\nlimits = { day = 9 }\n",
    );
    let before = reads();
    let r = Request::get("/")
        .header("x-api-key", "k")
        .header("x-tenant", "t")
        .body(axum::body::Body::empty())
        .unwrap();
    let res = call_once(&mut svc, r).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(reads() - before, 2, "each limit reads its own key");
}

/// A service answering 200 with an empty body, behind a `Tollgate` of
/// the file `text`, on a memory store.
fn empty_behind(
    text: &str,
) -> impl Service<Request<axum::body::Body>, Response = Response<axum::body::Body>, Error = Infallible>
{
    let file = PolicyFile::parse(text).unwrap();
    let gate = super::Tollgate::new(&file, &MemoryStore::new()).unwrap();
    gate.layer(service_fn(|_r: Request<axum::body::Body>| async {
        Ok::<_, Infallible>(Response::new(axum::body::Body::empty()))
    }))
}

/// `req` through `svc`, made ready first.
async fn call_once<S, B>(svc: &mut S, req: Request<axum::body::Body>) -> Response<B>
where
    S: Service<Request<axum::body::Body>, Response = Response<B>, Error = Infallible>,
{
    ServiceExt::<Request<axum::body::Body>>::ready(svc)
        .await
        .unwrap()
        .call(req)
        .await
        .unwrap()
}

#[test]
fn on_store_error_is_admit_or_refuse_and_names_its_field() {
    let top = "on_store_error = \"deny\"\n\n[[rules]]\nname = \"a\"\nkey = \"global\"\nrate = \"1/s\"\nburst = 1\n";
    assert_eq!(
        error(top),
        "1:18: on_store_error: must be \"admit\" or \"refuse\""
    );
    let quota = "[[quotas]]\nname = \"q\"\nkey = \"global\"\nlimits = { day = 1 }\non_store_error = \"closed\"\n";
    assert_eq!(
        error(quota),
        "5:18: quotas[0].on_store_error: must be \"admit\" or \"refuse\""
    );
    let conc = "on_store_error = \"refuse\"\n\n[[concurrency]]\nname = \"c\"\nkey = \"global\"\nmax = 1\non_store_error = \"open\"\n";
    assert_eq!(
        error(conc),
        "7:18: concurrency[0].on_store_error: must be \"admit\" or \"refuse\""
    );
    assert!(PolicyFile::parse(&conc.replace("\"open\"", "\"admit\"")).is_ok());
}

/// Two fixed service-wide limits of one name would count each other's
/// requests (their counts are one store key), each against its own
/// limit: refused at load, naming the second. Adaptive limits count in
/// the process, each its own: one name twice is fine.
#[test]
fn a_service_wide_limit_s_name_is_the_store_s_too() {
    let two = format!(
        "{}\n{}",
        service_named("a", "svc"),
        service_named("b", "svc")
    );
    let e = error(&two);
    assert!(
        e.starts_with("11:20: concurrency[1].service.name: the name \"svc\" is taken"),
        "{e}"
    );
    let e = error(&format!(
        "{}\n{}",
        service_named("a", "x"),
        service_named("b", "a")
    ));
    assert!(e.contains("concurrency[1].service.name"), "{e}");
    assert!(PolicyFile::parse(&format!(
        "{}\n{}",
        service_named("a", "svc"),
        service_named("b", "svc-b")
    ))
    .is_ok());
    let adaptive = |name: &str| {
        format!("[[concurrency]]\nname = \"{name}\"\nkey = \"global\"\nmax = 4\nadaptive = {{ name = \"svc\", algorithm = \"aimd\", min = 1, initial = 5, max = 10 }}\n")
    };
    assert!(PolicyFile::parse(&format!("{}\n{}", adaptive("a"), adaptive("b"))).is_ok());
}

fn service_named(name: &str, svc: &str) -> String {
    format!("[[concurrency]]\nname = \"{name}\"\nkey = \"global\"\nmax = 4\nservice = {{ name = \"{svc}\", max = 10 }}\n")
}

/// A `Tollgate` sends each list field as one line, its limits' items in
/// the order a request meets them (rules, in-flight limits, quotas) and
/// the service's own items (two lines of them) last, as layers stacked
/// by hand join them.
#[tokio::test]
async fn a_tollgate_sends_its_limits_fields_in_one_line_in_order() {
    let text = r#"
[[rules]]
name = "per-key"
key = "header:x-api-key"
rate = "1/h"
burst = 10

[[quotas]]
name = "daily"
key = "header:x-api-key"
limits = { day = 5 }

[[concurrency]]
name = "in-flight"
key = "header:x-api-key"
max = 3
"#;
    let file = PolicyFile::parse(text).unwrap();
    let gate = super::Tollgate::new(&file, &MemoryStore::new()).unwrap();
    let mut svc = gate.layer(service_fn(|_r: Request<axum::body::Body>| async {
        let mut res = Response::new(axum::body::Body::empty());
        res.headers_mut().append(
            "ratelimit",
            http::HeaderValue::from_static("\"upstream\";r=1"),
        );
        res.headers_mut().append(
            "ratelimit",
            http::HeaderValue::from_static("\"upstream-2\";r=2"),
        );
        Ok::<_, Infallible>(res)
    }));
    let r = Request::get("/")
        .header("x-api-key", "k")
        .body(axum::body::Body::empty())
        .unwrap();
    let res = ServiceExt::<Request<axum::body::Body>>::ready(&mut svc)
        .await
        .unwrap()
        .call(r)
        .await
        .unwrap();
    let lines = |name: &str| -> Vec<String> {
        res.headers()
            .get_all(name)
            .iter()
            .map(|v| v.to_str().unwrap().to_owned())
            .collect()
    };
    let rl = lines("ratelimit");
    assert_eq!(rl.len(), 1, "{rl:?}");
    let items: Vec<&str> = rl[0].split(", ").collect();
    assert_eq!(items.len(), 5, "{rl:?}");
    assert!(items[0].starts_with("\"per-key\";r=9;t="), "{rl:?}");
    assert_eq!(items[1], "\"in-flight\";r=2");
    assert!(items[2].starts_with("\"daily\";r=4;t="), "{rl:?}");
    assert_eq!(items[3..], ["\"upstream\";r=1", "\"upstream-2\";r=2"]);
    assert_eq!(
        lines("ratelimit-policy"),
        ["\"per-key\";q=10;w=36000, \"in-flight\";q=3;qu=\"concurrent-requests\", \"daily\";q=5;w=86400"]
    );
}

/// A quota keyed by autonomous system reads the database anew when the
/// database file changes (a reload it triggers): an address moved to
/// another ASN counts there, not on its old ASN's spent quota.
#[cfg(feature = "geoip")]
#[tokio::test]
async fn a_limit_keyed_by_a_database_follows_the_database_on_reload() {
    use std::net::Ipv4Addr;
    let dir = std::env::temp_dir().join(format!("tollgate-geoip-reload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let db = |asn: u32, extra: bool| {
        let mut nets = vec![(Ipv4Addr::new(198, 51, 100, 0), 24, asn, "DE")];
        if extra {
            nets.push((Ipv4Addr::new(203, 0, 113, 0), 24, 64_999, "FR"));
        }
        std::fs::write(
            dir.join("asn.mmdb"),
            crate::key::geo::testing::database(&nets),
        )
        .unwrap();
    };
    db(64_500, false);
    let path = dir.join("policy.toml");
    std::fs::write(
        &path,
        "[geoip]\nasn = \"asn.mmdb\"\n\n[[quotas]]\nname = \"per-asn\"\nkey = \"asn\"\nlimits = { day = 1 }\n",
    )
    .unwrap();
    let file = PolicyFile::read(&path).unwrap();
    let store = MemoryStore::new();
    let gate = super::Tollgate::new(&file, &store).unwrap();
    let reloader = gate.reloader(&path, &file, store, |b| b);
    let svc = gate.layer(service_fn(|_r: Request<axum::body::Body>| async {
        Ok::<_, Infallible>(Response::new(axum::body::Body::empty()))
    }));
    let from = || {
        let mut r = Request::get("/").body(axum::body::Body::empty()).unwrap();
        r.extensions_mut()
            .insert("198.51.100.7:4000".parse::<std::net::SocketAddr>().unwrap());
        r
    };
    let ok = StatusCode::OK;
    let refused = StatusCode::TOO_MANY_REQUESTS;
    assert_eq!(svc.clone().oneshot(from()).await.unwrap().status(), ok);
    assert_eq!(svc.clone().oneshot(from()).await.unwrap().status(), refused);
    // The network moves to another ASN: its quota is that ASN's, whole.
    db(64_501, true);
    assert!(matches!(reloader.reload(), Ok(super::Reloaded::Applied)));
    assert_eq!(svc.clone().oneshot(from()).await.unwrap().status(), ok);
    assert_eq!(svc.clone().oneshot(from()).await.unwrap().status(), refused);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A limit's service is called at once when it is ready, and otherwise
/// once it is: behind a service that is ready only on every other poll
/// (so the chain finds it not ready when it calls), every request of a
/// `Tollgate` is still served and charged.
#[tokio::test]
async fn a_tollgate_waits_for_a_service_not_ready_at_once() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::{Context, Poll};

    /// Ready on every other poll; a call it was not made ready for is
    /// answered 500.
    #[derive(Clone)]
    struct Fickle(Arc<AtomicUsize>, bool);
    impl tower::Service<Request<axum::body::Body>> for Fickle {
        type Response = Response<axum::body::Body>;
        type Error = Infallible;
        type Future = std::future::Ready<Result<Self::Response, Infallible>>;
        fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            self.1 = self.0.fetch_add(1, Ordering::SeqCst) % 2 == 1;
            if self.1 {
                Poll::Ready(Ok(()))
            } else {
                cx.waker().wake_by_ref();
                Poll::Pending
            }
        }
        fn call(&mut self, _r: Request<axum::body::Body>) -> Self::Future {
            let mut res = Response::new(axum::body::Body::empty());
            if !std::mem::take(&mut self.1) {
                *res.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
            }
            std::future::ready(Ok(res))
        }
    }
    let file = PolicyFile::parse(
        "[[quotas]]\nname = \"q\"\nkey = \"header:x-api-key\"\nlimits = { day = 3 }\n",
    )
    .unwrap();
    let gate = super::Tollgate::new(&file, &MemoryStore::new()).unwrap();
    let polls = Arc::new(AtomicUsize::new(0));
    let svc = gate.layer(Fickle(Arc::clone(&polls), false));
    let req = || {
        Request::get("/")
            .header("x-api-key", "k")
            .body(axum::body::Body::empty())
            .unwrap()
    };
    let mut statuses = Vec::new();
    for _ in 0..4 {
        statuses.push(svc.clone().oneshot(req()).await.unwrap().status().as_u16());
    }
    assert_eq!(statuses, [200, 200, 200, 429]);
    assert!(
        polls.load(Ordering::SeqCst) > 8,
        "the service was polled as ready each time"
    );
}

/// Issue 32: a file's rule charges what a request really cost
/// (`charge_after`) and counts an upgrade's messages (`messages`).
#[tokio::test(start_paused = true)]
async fn a_files_rule_charges_after_the_response_and_counts_messages() {
    use crate::rate_limit::MessageBudget;
    let clock = ManualClock::new();
    let text = "[[rules]]\nname = \"per-key\"\nkey = \"header:x-api-key\"\nalgorithm = \"fixed_window\"\nrate = \"10/1m\"\ncharge_after = { measure = \"elapsed\", per = \"100ms\" }\nmessages = true\n";
    let layer = PolicyFile::parse(text)
        .unwrap()
        .layer::<String, _>(&store(&clock))
        .unwrap();
    let kept = std::sync::Arc::new(std::sync::Mutex::new(None));
    let k2 = std::sync::Arc::clone(&kept);
    let mut svc = layer.layer(service_fn(move |r: Req| {
        *k2.lock().unwrap() = r.extensions().get::<MessageBudget>().cloned();
        async move {
            if r.uri().path() == "/slow" {
                tokio::time::sleep(Duration::from_millis(800)).await;
            }
            Ok::<_, Infallible>(Response::new(String::new()))
        }
    }));
    // 800 ms at 100 ms a unit: 8 where 1 was charged, 7 owed.
    let slow = status(&mut svc, req("GET", "/slow", "a")).await;
    assert_eq!(slow.0, StatusCode::OK);
    // The next pays 1 and the 7: 10 - 1 - 8 leaves 1, for one message.
    let mut upgrade = req("GET", "/", "a");
    upgrade
        .headers_mut()
        .insert("upgrade", "websocket".parse().unwrap());
    assert_eq!(status(&mut svc, upgrade).await.0, StatusCode::OK);
    let budget = kept.lock().unwrap().take().expect("a message budget");
    budget.spend(1).await.unwrap();
    assert_eq!(budget.spend(1).await.unwrap_err().rule(), "per-key");
    assert_eq!(
        status(&mut svc, req("GET", "/", "a")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[test]
fn charge_after_errors_name_their_field() {
    let rule = "[[rules]]\nname = \"a\"\nkey = \"global\"\nrate = \"1/s\"\nburst = 1\n";
    for (extra, want) in [
        (
            "charge_after = { measure = \"cpu\" }",
            "6:28: rules[0].charge_after.measure: must be one of elapsed, response_bytes, reported",
        ),
        (
            "charge_after = { measure = \"elapsed\" }",
            "6:16: rules[0].charge_after.per: is needed",
        ),
        (
            "charge_after = { measure = \"elapsed\", per = 5 }",
            "6:45: rules[0].charge_after.per: is not a duration",
        ),
        (
            "charge_after = { measure = \"elapsed\", per = \"0s\" }",
            "6:45: rules[0].charge_after.per: a unit must be worth more than zero",
        ),
        (
            "charge_after = { measure = \"response_bytes\", per = \"lots\" }",
            "6:52: rules[0].charge_after.per: is not a number of bytes",
        ),
        (
            "charge_after = { measure = \"reported\", per = 1 }",
            "6:46: rules[0].charge_after.per: is not taken by reported",
        ),
        (
            "count_if = [401]\ncharge_after = { measure = \"reported\" }",
            "7:16: rules[0].charge_after: a rule settles on its response one way",
        ),
    ] {
        let e = error(&format!("{rule}{extra}\n"));
        assert!(e.starts_with(want), "{extra}: {e}");
    }
    // Each measure loads.
    for ok in [
        "{ measure = \"elapsed\", per = \"250ms\" }",
        "{ measure = \"response_bytes\", per = \"64 KiB\" }",
        "{ measure = \"response_bytes\", per = 1024 }",
        "{ measure = \"reported\" }",
    ] {
        let file = PolicyFile::parse(&format!("{rule}charge_after = {ok}\n")).unwrap();
        file.layer::<String, _>(&MemoryStore::new()).unwrap();
    }
}
