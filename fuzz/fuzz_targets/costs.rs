//! The cost functions on arbitrary headers, query strings (percent- and
//! plus-encoded), methods, paths and `Content-Length`, checked against a
//! plain reference model.
#![no_main]

use arbitrary::Arbitrary;
use http::header::{HeaderValue, CONTENT_LENGTH};
use http::{Method, Request, Uri};
use libfuzzer_sys::fuzz_target;
use tollgate::cost::{BodyLength, ByMethod, ByRoute, Cost, HeaderCost, QueryCost};

#[derive(Debug, Arbitrary)]
struct Input {
    method: Vec<u8>,
    /// Whole URI, or (if it does not parse) a path and a query appended.
    uri: Vec<u8>,
    query: Vec<u8>,
    count_header: Option<Vec<u8>>,
    content_length: Option<Vec<u8>>,
    header_cfg: (String, u64, u64),
    query_cfg: (String, u64, u64),
    body_cfg: (u64, u64, u64),
    methods: Vec<(Vec<u8>, u64)>,
    routes: Vec<(Option<Vec<u8>>, String, u64)>,
    default: u64,
}

/// `application/x-www-form-urlencoded` decoding, the plain way.
fn decode(raw: &[u8]) -> Vec<u8> {
    let hex = |b: u8| (b as char).to_digit(16).map(|d| d as u8);
    let mut out = Vec::new();
    let mut i = 0;
    while i < raw.len() {
        match raw[i] {
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b'%' if i + 2 < raw.len() => match (hex(raw[i + 1]), hex(raw[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push(h * 16 + l);
                    i += 3;
                }
                _ => {
                    out.push(b'%');
                    i += 1;
                }
            },
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    out
}

fn count(s: &[u8]) -> Option<u64> {
    let s = s.trim_ascii();
    if s.is_empty() || !s.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(s.iter().fold(0u64, |n, d| {
        n.saturating_mul(10).saturating_add(u64::from(d - b'0'))
    }))
}

fn clamp(n: Option<u64>, cap: u64) -> u64 {
    n.map_or(cap, |n| n.clamp(1, cap))
}

fn query_reference(query: Option<&str>, param: &str, default: u64, cap: u64) -> u64 {
    let Some(query) = query else { return default };
    query
        .split('&')
        .filter_map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (decode(k.as_bytes()) == param.as_bytes()).then(|| decode(v.as_bytes()))
        })
        // The implementation decodes into 24 bytes: a longer value is no
        // count and pays the cap (never less than the reference).
        .map(|v| {
            if v.len() > 24 {
                cap
            } else {
                clamp(count(&v), cap)
            }
        })
        .max()
        .unwrap_or(default)
}

fuzz_target!(|input: Input| {
    let mut req = Request::builder().body(()).unwrap();
    if let Ok(m) = Method::from_bytes(&input.method) {
        *req.method_mut() = m;
    }
    let uri = Uri::try_from(input.uri.as_slice()).ok().or_else(|| {
        let mut s = b"/p?".to_vec();
        s.extend_from_slice(&input.query);
        Uri::try_from(s).ok()
    });
    if let Some(u) = uri {
        *req.uri_mut() = u;
    }
    if let Some(Ok(v)) = input.count_header.as_deref().map(HeaderValue::from_bytes) {
        req.headers_mut().insert("x-count", v);
    }
    if let Some(Ok(v)) = input.content_length.as_deref().map(HeaderValue::from_bytes) {
        req.headers_mut().insert(CONTENT_LENGTH, v);
    }

    // HeaderCost: absent → default, else within 1..=cap.
    let (name, d, c) = &input.header_cfg;
    for h in [
        HeaderCost::named("x-count", 1, 100).ok(),
        HeaderCost::named("x-count", *d, *c).ok(),
        HeaderCost::named(name, *d, *c).ok(),
    ]
    .into_iter()
    .flatten()
    {
        let _ = h.cost(&req);
    }
    if let Ok(h) = HeaderCost::named("x-count", *d, *c) {
        let got = h.cost(&req);
        match req.headers().get("x-count") {
            None => assert_eq!(got, *d),
            Some(v) => assert_eq!(got, clamp(count(v.as_bytes()), *c)),
        }
    }

    // QueryCost against the reference decoder.
    let (param, d, c) = &input.query_cfg;
    let query = req.uri().query();
    for q in [
        QueryCost::named("count", 1, 10_000)
            .ok()
            .map(|q| (q, "count", 1, 10_000)),
        QueryCost::named(param, *d, *c)
            .ok()
            .map(|q| (q, param.as_str(), *d, *c)),
    ]
    .into_iter()
    .flatten()
    {
        let (q, p, d, c) = q;
        assert_eq!(q.cost(&req), query_reference(query, p, d, c), "{query:?}");
    }

    // ByMethod: the last entry for the method, else the default.
    let mut by_method = ByMethod::new(input.default);
    let mut table: Vec<(Method, u64)> = Vec::new();
    for (m, c) in &input.methods {
        if let Ok(m) = Method::from_bytes(m) {
            by_method = by_method.method(m.clone(), *c);
            table.retain(|(x, _)| *x != m);
            table.push((m, *c));
        }
    }
    let want = table
        .iter()
        .find(|(m, _)| m == req.method())
        .map_or(input.default, |(_, c)| *c);
    assert_eq!(by_method.cost(&req), want);

    // ByRoute: the first matching route, else the default.
    let mut by_route = ByRoute::new(input.default);
    let mut routes = Vec::new();
    for (m, p, c) in &input.routes {
        let m = match m {
            None => None,
            Some(m) => match Method::from_bytes(m) {
                Ok(m) => Some(m),
                Err(_) => continue,
            },
        };
        by_route = by_route.route(m.clone(), p, *c);
        routes.push((m, p.clone(), *c));
    }
    // Also a route for exactly this request's path.
    let path = req.uri().path().to_owned();
    by_route = by_route.route(None, &path, 7);
    routes.push((None, path, 7));
    let want = routes
        .iter()
        .find(|(m, p, _)| p == req.uri().path() && m.as_ref().is_none_or(|m| m == req.method()))
        .map_or(input.default, |(_, _, c)| *c);
    assert_eq!(by_route.cost(&req), want);

    // BodyLength: within min..=cap; unknown → cap.
    let (bpu, min, cap) = input.body_cfg;
    if let Ok(b) = BodyLength::new(bpu, min, cap) {
        let got = b.cost(&req);
        assert!((min..=cap).contains(&got));
        let len = req
            .headers()
            .get(CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok());
        match len {
            None => assert_eq!(got, cap),
            Some(len) => {
                let units = len / bpu + u64::from(len % bpu != 0);
                assert_eq!(got, units.clamp(min, cap));
            }
        }
    }
    if let Ok(b) = BodyLength::new(1024, 1, 100) {
        let _ = b.cost(&req);
    }
});
