//! What a request costs: cost functions.
//!
//! A [`Cost`] weighs a request in units of the rule's budget: a read 1, a
//! write 3, a report 10, a batch its size. A cost above the rule's
//! capacity can never be admitted and is answered with a 429 that says so
//! (no `Retry-After`). Cost 0 is free (a peek).
//!
//! Closures are cost functions: `|req: &Request<B>| -> u64`.
//!
//! ```
//! use http::{Method, Request};
//! use tollgate::cost::{ByRoute, Cost, HeaderCost};
//!
//! let by_route = ByRoute::new(1)
//!     .route(Some(Method::POST), "/api/orders", 3)
//!     .route(Some(Method::POST), "/api/reports", 10);
//! let req = Request::post("/api/reports").body(()).unwrap();
//! assert_eq!(by_route.cost(&req), 10);
//!
//! // A batch endpoint: `x-batch-size` items, at most 100 counted.
//! let batch = HeaderCost::named("x-batch-size", 1, 100).unwrap();
//! let req = Request::post("/batch").header("x-batch-size", "5000").body(()).unwrap();
//! assert_eq!(batch.cost(&req), 100);
//! ```

use std::sync::Arc;

use http::header::{HeaderName, CONTENT_LENGTH};
use http::{Method, Request};
use tollgate_core::ConfigError;

use crate::key::normalize_path;
use crate::key::request::{method_of, original_path};

/// Weighs a request.
pub trait Cost<B>: Clone + Send + Sync + 'static {
    /// The units `req` consumes.
    fn cost(&self, req: &Request<B>) -> u64;
}

impl<B, F> Cost<B> for F
where
    F: Fn(&Request<B>) -> u64 + Clone + Send + Sync + 'static,
{
    fn cost(&self, req: &Request<B>) -> u64 {
        self(req)
    }
}

/// The same cost for every request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fixed(pub u64);

impl Default for Fixed {
    fn default() -> Self {
        Self(1)
    }
}

impl<B> Cost<B> for Fixed {
    fn cost(&self, _req: &Request<B>) -> u64 {
        self.0
    }
}

/// A cost per method, with a default for the rest.
#[derive(Debug, Clone)]
pub struct ByMethod {
    default: u64,
    table: Arc<[(Method, u64)]>,
}

impl ByMethod {
    /// Every method costs `default` until told otherwise.
    pub fn new(default: u64) -> Self {
        Self {
            default,
            table: Arc::new([]),
        }
    }

    /// `method` costs `cost`.
    pub fn method(self, method: Method, cost: u64) -> Self {
        let mut table = self.table.to_vec();
        table.retain(|(m, _)| *m != method);
        table.push((method, cost));
        Self {
            default: self.default,
            table: table.into(),
        }
    }

    /// The costliest entry: its cost and what it is (for a check that a
    /// limit can ever admit it).
    #[cfg(feature = "config")]
    pub(crate) fn costliest(&self) -> (u64, String) {
        self.table
            .iter()
            .fold((self.default, "the default".to_owned()), |best, (m, c)| {
                if *c > best.0 {
                    (*c, format!("method {m}"))
                } else {
                    best
                }
            })
    }
}

/// A `HEAD` without an entry of its own costs what `GET` does: a router
/// runs the `GET` handler for it.
impl<B> Cost<B> for ByMethod {
    fn cost(&self, req: &Request<B>) -> u64 {
        let find = |method: &Method| self.table.iter().find(|(m, _)| m == method);
        find(req.method())
            .or_else(|| find(method_of(req)))
            .map_or(self.default, |(_, c)| *c)
    }
}

/// A cost per exact path (and optionally method), with a default: the
/// classic "a read costs 1, a report 10".
#[derive(Debug, Clone)]
pub struct ByRoute {
    default: u64,
    routes: Arc<[RouteCost]>,
    /// What it charges, as a number: two tables of the same entries
    /// charge a request alike (a composed layer computes it once).
    #[cfg_attr(not(feature = "config"), allow(dead_code))]
    meaning: u64,
}

/// `what` folded into the meaning `so_far`.
fn meaning_with(so_far: u64, what: impl std::hash::Hash) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (so_far, what).hash(&mut h);
    h.finish()
}

/// One entry of a [`ByRoute`] table: method (any if `None`), path, cost.
type RouteCost = (Option<Method>, Box<str>, u64);

impl ByRoute {
    /// Every request costs `default` until told otherwise.
    pub fn new(default: u64) -> Self {
        Self {
            default,
            routes: Arc::new([]),
            meaning: meaning_with(0, default),
        }
    }

    /// Requests to exactly `path` (with `method`, or any method if `None`)
    /// cost `cost`. The first matching route wins. Paths compare
    /// normalised; under `Router::nest`, the full path (`/api/orders`) and
    /// the one inside the nest (`/orders`) both match.
    pub fn route(self, method: Option<Method>, path: &str, cost: u64) -> Self {
        let mut routes = self.routes.to_vec();
        let path: Box<str> = normalize_path(path).into();
        let meaning = meaning_with(
            self.meaning,
            (method.as_ref().map(Method::as_str), &path, cost),
        );
        routes.push((method, path, cost));
        Self {
            default: self.default,
            routes: routes.into(),
            meaning,
        }
    }

    /// What it charges, as a number: equal for tables of the same
    /// entries, in the same order.
    #[cfg(feature = "config")]
    pub(crate) fn meaning(&self) -> u64 {
        self.meaning
    }

    /// The costliest entry: its cost and what it is.
    #[cfg(feature = "config")]
    pub(crate) fn costliest(&self) -> (u64, String) {
        self.routes.iter().fold(
            (self.default, "the default".to_owned()),
            |best, (m, path, c)| {
                if *c <= best.0 {
                    return best;
                }
                let what = match m {
                    Some(m) => format!("route {m} {path}"),
                    None => format!("route {path}"),
                };
                (*c, what)
            },
        )
    }
}

/// A route's path matches in its normalised form
/// ([`crate::key::normalize_path`]), as the client sent it
/// or as the layer sees it inside `Router::nest` (prefix stripped), so
/// `/api/orders` and `/orders` both name a nested `/orders`. The first
/// matching route wins, and a `HEAD` matches `GET` entries too (a router
/// runs the `GET` handler for it): list a `HEAD` entry before the `GET`
/// one to price it apart.
impl<B> Cost<B> for ByRoute {
    fn cost(&self, req: &Request<B>) -> u64 {
        let (original, local) = (original_path(req), req.uri().path());
        let original = normalize_path(original);
        // Inside a nest the layer sees a shorter path; outside, the same.
        let local = (local != &*original).then(|| normalize_path(local));
        let (method, as_get) = (req.method(), method_of(req));
        self.routes
            .iter()
            .find(|(m, p, _)| {
                (**p == *original || local.as_deref().is_some_and(|l| **p == *l))
                    && m.as_ref().is_none_or(|m| m == method || m == as_get)
            })
            .map_or(self.default, |(_, _, c)| *c)
    }
}

/// Parses a decimal count, saturating at `u64::MAX`; `None` if not a number.
fn parse_count(s: &[u8]) -> Option<u64> {
    let s = s.trim_ascii();
    if s.is_empty() || !s.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(s.iter().fold(0u64, |n, d| {
        n.saturating_mul(10)
            .saturating_add(u64::from(d.saturating_sub(b'0')))
    }))
}

fn check_cap(default: u64, cap: u64) -> Result<(), ConfigError> {
    if cap == 0 {
        return Err(ConfigError::new("cap", "must be at least 1"));
    }
    if default == 0 {
        // Leaving the header out must not make a request free.
        return Err(ConfigError::new("default", "must be at least 1"));
    }
    if default > cap {
        return Err(ConfigError::new("default", "must not exceed `cap`"));
    }
    Ok(())
}

/// A count from a header (a batch size), clamped to `1..=cap`: a client
/// cannot make a request free by claiming zero items. Absent: `default`.
/// Not a number: `cap` (a client that sends nonsense pays the most).
#[derive(Debug, Clone)]
pub struct HeaderCost {
    name: HeaderName,
    default: u64,
    cap: u64,
}

impl HeaderCost {
    /// Reads header `name`; errors name the field (`header`, `cap`,
    /// `default`).
    pub fn named(name: &str, default: u64, cap: u64) -> Result<Self, ConfigError> {
        check_cap(default, cap)?;
        let name = crate::key::header_name(name)?;
        Ok(Self { name, default, cap })
    }
}

impl<B> Cost<B> for HeaderCost {
    fn cost(&self, req: &Request<B>) -> u64 {
        match req.headers().get(&self.name) {
            None => self.default,
            Some(v) => parse_count(v.as_bytes()).map_or(self.cap, |n| n.clamp(1, self.cap)),
        }
    }
}

/// A count from a query parameter (`?count=25`), clamped to `1..=cap`.
/// Absent: `default`. Not a number: `cap`. Names and values are decoded
/// as `application/x-www-form-urlencoded` (`%63ount=9` is `count=9`, as
/// axum's `Query` reads it), and a parameter given twice counts at its
/// largest: a client cannot hide the count the handler will use.
#[derive(Debug, Clone)]
pub struct QueryCost {
    param: Box<str>,
    default: u64,
    cap: u64,
}

impl QueryCost {
    /// Reads query parameter `param`.
    pub fn named(param: &str, default: u64, cap: u64) -> Result<Self, ConfigError> {
        check_cap(default, cap)?;
        if param.is_empty() {
            return Err(ConfigError::new("param", "must not be empty"));
        }
        Ok(Self {
            param: param.into(),
            default,
            cap,
        })
    }
}

impl<B> Cost<B> for QueryCost {
    fn cost(&self, req: &Request<B>) -> u64 {
        let Some(query) = req.uri().query() else {
            return self.default;
        };
        query
            .split('&')
            .filter_map(|pair| {
                let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
                form_eq(k.as_bytes(), self.param.as_bytes()).then_some(v)
            })
            .map(|v| {
                let mut buf = [0u8; 24];
                form_decode(v.as_bytes(), &mut buf)
                    .and_then(parse_count)
                    .map_or(self.cap, |n| n.clamp(1, self.cap))
            })
            .max()
            .unwrap_or(self.default)
    }
}

/// Decodes one form-encoded byte at the start of `raw`: `+` is a space,
/// `%XY` the byte XY, anything else itself (a `%` without two hex digits
/// too, as the WHATWG URL standard has it). Returns it and the bytes used.
fn form_byte(raw: &[u8]) -> Option<(u8, usize)> {
    let hex = |b: u8| {
        char::from(b)
            .to_digit(16)
            .and_then(|d| u8::try_from(d).ok())
    };
    match raw {
        [b'+', ..] => Some((b' ', 1)),
        [b'%', h, l, ..] => match (hex(*h), hex(*l)) {
            (Some(h), Some(l)) => Some((h.saturating_mul(16).saturating_add(l), 3)),
            _ => Some((b'%', 1)),
        },
        [b, ..] => Some((*b, 1)),
        [] => None,
    }
}

/// Whether form-encoded `raw` decodes to exactly `want`.
fn form_eq(mut raw: &[u8], want: &[u8]) -> bool {
    let mut want = want.iter();
    while let Some((b, used)) = form_byte(raw) {
        if want.next() != Some(&b) {
            return false;
        }
        raw = raw.get(used..).unwrap_or_default();
    }
    want.next().is_none()
}

/// Decodes form-encoded `raw` into `buf`; `None` if it does not fit (no
/// count is that long).
fn form_decode<'a>(mut raw: &[u8], buf: &'a mut [u8; 24]) -> Option<&'a [u8]> {
    let mut len = 0;
    while let Some((b, used)) = form_byte(raw) {
        *buf.get_mut(len)? = b;
        len = len.saturating_add(1);
        raw = raw.get(used..).unwrap_or_default();
    }
    buf.get(..len)
}

/// The request body's declared size (`Content-Length`), one unit per
/// `bytes_per_unit` bytes rounded up, at least `min`, at most `cap`.
/// A body of unknown length (streamed, no `Content-Length`) costs `cap`.
#[derive(Debug, Clone, Copy)]
pub struct BodyLength {
    bytes_per_unit: u64,
    min: u64,
    cap: u64,
}

impl BodyLength {
    /// One unit per `bytes_per_unit` bytes; `min` must be at least 1 (a
    /// cost of 0 would make empty bodies free).
    pub fn new(bytes_per_unit: u64, min: u64, cap: u64) -> Result<Self, ConfigError> {
        if min == 0 {
            return Err(ConfigError::new("min", "must be at least 1"));
        }
        check_cap(min, cap).map_err(|e| {
            if e.field() == "default" {
                ConfigError::new("min", "must not exceed `cap`")
            } else {
                e
            }
        })?;
        if bytes_per_unit == 0 {
            return Err(ConfigError::new("bytes_per_unit", "must be at least 1"));
        }
        Ok(Self {
            bytes_per_unit,
            min,
            cap,
        })
    }
}

impl<B> Cost<B> for BodyLength {
    fn cost(&self, req: &Request<B>) -> u64 {
        let Some(len) = req
            .headers()
            .get(CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
        else {
            return self.cap;
        };
        let units = len.div_ceil(self.bytes_per_unit);
        units.clamp(self.min, self.cap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(method: Method, uri: &str) -> Request<()> {
        Request::builder().method(method).uri(uri).body(()).unwrap()
    }

    #[test]
    fn by_method_and_route() {
        let m = ByMethod::new(1)
            .method(Method::POST, 3)
            .method(Method::POST, 4);
        assert_eq!(m.cost(&req(Method::GET, "/")), 1);
        assert_eq!(m.cost(&req(Method::POST, "/")), 4);
        let r = ByRoute::new(1)
            .route(Some(Method::POST), "/orders", 3)
            .route(None, "/reports", 10);
        assert_eq!(r.cost(&req(Method::POST, "/orders")), 3);
        assert_eq!(r.cost(&req(Method::GET, "/orders")), 1);
        assert_eq!(r.cost(&req(Method::GET, "/reports?x=1")), 10);
    }

    #[test]
    fn head_costs_what_get_costs_unless_priced_apart() {
        let m = ByMethod::new(1).method(Method::GET, 5);
        assert_eq!(m.cost(&req(Method::HEAD, "/")), 5);
        let m = m.method(Method::HEAD, 2);
        assert_eq!(m.cost(&req(Method::HEAD, "/")), 2);
        // The first matching route wins; HEAD matches GET entries, so an
        // "any method" entry after them cannot make it cheaper.
        let r = ByRoute::new(1)
            .route(Some(Method::GET), "/dl", 8)
            .route(None, "/dl", 1);
        assert_eq!(r.cost(&req(Method::HEAD, "/dl")), 8);
        let r =
            ByRoute::new(1)
                .route(Some(Method::HEAD), "/dl", 2)
                .route(Some(Method::GET), "/dl", 8);
        assert_eq!(r.cost(&req(Method::HEAD, "/dl")), 2);
        assert_eq!(r.cost(&req(Method::GET, "/dl")), 8);
    }

    #[test]
    fn route_paths_compare_in_one_form() {
        let r = ByRoute::new(1).route(Some(Method::POST), "/api/orders", 3);
        for form in [
            "/api/orders",
            "//api/orders",
            "/api/./orders",
            "/%61pi/orders",
            "/api/x/../orders",
        ] {
            assert_eq!(r.cost(&req(Method::POST, form)), 3, "{form}");
        }
    }

    #[test]
    fn header_and_query_counts_are_capped_and_hostile_values_pay_the_cap() {
        let h = HeaderCost::named("x-n", 1, 50).unwrap();
        let with = |v: &[u8]| {
            let mut r = req(Method::POST, "/");
            r.headers_mut()
                .insert("x-n", http::HeaderValue::from_bytes(v).unwrap());
            h.cost(&r)
        };
        assert_eq!(h.cost(&req(Method::POST, "/")), 1);
        assert_eq!(with(b"7"), 7);
        assert_eq!(with(b"0"), 1, "a claimed zero still costs one");
        assert_eq!(with(b"000"), 1);
        assert_eq!(with(b" 7 "), 7);
        assert_eq!(with(b"99999999999999999999999"), 50);
        assert_eq!(with(b"-1"), 50);
        assert_eq!(with(b"\xff\xfe"), 50);
        let q = QueryCost::named("count", 1, 20).unwrap();
        assert_eq!(q.cost(&req(Method::GET, "/?a=1&count=5")), 5);
        assert_eq!(q.cost(&req(Method::GET, "/?count=lots")), 20);
        assert_eq!(q.cost(&req(Method::GET, "/?count=0")), 1);
        assert_eq!(q.cost(&req(Method::GET, "/?counter=5")), 1);
        assert_eq!(HeaderCost::named("x-n", 5, 0).unwrap_err().field(), "cap");
        assert_eq!(
            HeaderCost::named("x-n", 5, 4).unwrap_err().field(),
            "default"
        );
        assert_eq!(
            HeaderCost::named("bad name", 1, 4).unwrap_err().field(),
            "header"
        );
    }

    #[test]
    fn query_costs_are_read_as_the_handler_reads_them() {
        let q = QueryCost::named("count", 1, 10_000).unwrap();
        let cost = |uri: &str| q.cost(&req(Method::GET, uri));
        // Percent-encoded names and values are the same parameter.
        assert_eq!(cost("/x?%63ount=10000"), 10_000);
        assert_eq!(cost("/x?count=%31%30"), 10);
        assert_eq!(cost("/x?co%75nt=5&other=1"), 5);
        // Given twice, the larger counts, whatever the order.
        assert_eq!(cost("/x?count=1&count=500"), 500);
        assert_eq!(cost("/x?count=500&count=1"), 500);
        assert_eq!(cost("/x?count=1&%63ount=9000"), 9_000);
        // Malformed encodings and values pay the cap; `+` is a space.
        assert_eq!(cost("/x?count=%zz"), 10_000);
        assert_eq!(cost("/x?count=1%"), 10_000);
        assert_eq!(cost("/x?count=+7"), 7);
        assert_eq!(cost(&format!("/x?count={}", "9".repeat(40))), 10_000);
        // Other names, even close ones, are not the parameter.
        assert_eq!(cost("/x?counts=9&coun=9&%2563ount=9"), 1);
        assert_eq!(cost("/x?"), 1);
    }

    #[test]
    fn body_length_rounds_up_and_charges_unknown_lengths_the_cap() {
        let b = BodyLength::new(1024, 1, 100).unwrap();
        let with = |len: Option<&str>| {
            let mut r = req(Method::POST, "/");
            if let Some(len) = len {
                r.headers_mut().insert(CONTENT_LENGTH, len.parse().unwrap());
            }
            b.cost(&r)
        };
        assert_eq!(with(Some("0")), 1);
        assert_eq!(with(Some("1025")), 2);
        assert_eq!(with(Some("18446744073709551615")), 100);
        assert_eq!(with(None), 100);
        assert_eq!(
            BodyLength::new(0, 1, 2).unwrap_err().field(),
            "bytes_per_unit"
        );
    }
}
