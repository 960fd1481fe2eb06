//! Which requests a limit applies to: path patterns in the router's
//! syntax, each with an optional method.

use std::borrow::Cow;
use std::sync::Arc;

use http::{Method, Request};
use tollgate_core::ConfigError;

use crate::key::normalize_path;
use crate::key::request::{method_of, original_path};

/// A set of routes: a request matches if its method and path match any
/// of them. Give one to a limit's builder (`routes`) to scope the limit
/// to those routes; a request elsewhere passes that limit untouched
/// (not counted, not refused, no headers from it).
///
/// Patterns use axum's syntax: literal segments, `{name}` for exactly one
/// segment, and `{*name}` (last) for one or more (`:id` and `*rest`, the
/// older syntax, are refused rather than read as literal text). A request
/// matches when any view of its path does: normalised
/// ([`normalize_path`]) as the client sent it or as the layer sees it
/// inside `Router::nest` (prefix stripped), as
/// [`ByRoute`](crate::cost::ByRoute) costs do; as a router splits it
/// (`/users/./avatar` reaches `/users/{id}/avatar` with `id` = `.`); or,
/// inside an axum router, the route it matched. So no way of writing a
/// path routed to a limited route escapes the limit. A `HEAD` matches
/// `GET` entries (a router runs the `GET` handler for it).
///
/// ```
/// use http::{Method, Request};
/// use tollgate::Routes;
///
/// let downloads = Routes::new()
///     .route(Some(Method::GET), "/api/download")?
///     .route(None, "/files/{*path}")?
///     .route(Some(Method::POST), "/users/{id}/avatar")?;
/// let req = |m: Method, p: &str| Request::builder().method(m).uri(p).body(()).unwrap();
/// assert!(downloads.matches(&req(Method::GET, "/api/download")));
/// assert!(downloads.matches(&req(Method::HEAD, "/api/download"))); // HEAD is GET
/// assert!(downloads.matches(&req(Method::DELETE, "/files/a/b.txt")));
/// assert!(downloads.matches(&req(Method::POST, "/users/7/avatar")));
/// assert!(!downloads.matches(&req(Method::POST, "/api/download")));
/// assert!(!downloads.matches(&req(Method::GET, "/files"))); // `{*path}` needs a segment
/// # Ok::<(), tollgate::ConfigError>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct Routes {
    entries: Arc<[Entry]>,
}

#[derive(Debug, Clone)]
struct Entry {
    method: Option<Method>,
    pattern: Box<[Segment]>,
    /// The whole path, where the pattern has no parameter: compared at
    /// once.
    exact: Option<Box<str>>,
    text: Box<str>,
}

#[derive(Debug, Clone, PartialEq)]
enum Segment {
    Literal(Box<str>),
    /// `{name}`: one segment.
    Param,
    /// `{*name}`: one segment or more, to the end.
    Rest,
}

impl Routes {
    /// No routes yet: add them with [`route`](Self::route). A limit given
    /// an empty set is a build error (it would apply nowhere).
    pub fn new() -> Self {
        Self::default()
    }

    /// Also requests to `pattern` with `method` (any method if `None`).
    /// An error names what is wrong with `pattern`: it must start with
    /// `/`; a `{param}` is a whole segment; `{*rest}` comes last.
    pub fn route(self, method: Option<Method>, pattern: &str) -> Result<Self, ConfigError> {
        let parsed = parse(pattern).map_err(|why| ConfigError::new("routes", why))?;
        let mut entries = self.entries.to_vec();
        let exact = parsed
            .iter()
            .all(|s| matches!(s, Segment::Literal(_)))
            .then(|| {
                let joined: String = parsed
                    .iter()
                    .filter_map(|s| match s {
                        Segment::Literal(l) => Some(format!("/{l}")),
                        _ => None,
                    })
                    .collect();
                if joined.is_empty() {
                    "/".into()
                } else {
                    joined.into_boxed_str()
                }
            });
        entries.push(Entry {
            method,
            pattern: parsed,
            exact,
            text: pattern.into(),
        });
        Ok(Self {
            entries: entries.into(),
        })
    }

    /// The same routes, in the same order: `other`'s set itself where the
    /// two are the same (so that limits of one scope share it), else this.
    #[cfg(all(feature = "axum", feature = "config"))]
    pub(crate) fn shared_with(self, other: &Self) -> Self {
        let same = |a: &Entry, b: &Entry| a.method == b.method && a.pattern == b.pattern;
        if self.entries.len() == other.entries.len()
            && self
                .entries
                .iter()
                .zip(other.entries.iter())
                .all(|(a, b)| same(a, b))
        {
            other.clone()
        } else {
            self
        }
    }

    /// Whether `other` is this very set (shared, as
    /// [`shared_with`](Self::shared_with) makes it): the same answer for
    /// every request.
    #[cfg(all(feature = "axum", feature = "config"))]
    pub(crate) fn is(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.entries, &other.entries)
    }

    /// Whether there are no routes.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Each route as written: `GET /api/download`, `/files/{*path}`.
    pub fn describe(&self) -> Vec<String> {
        self.entries
            .iter()
            .map(|e| match &e.method {
                Some(m) => format!("{m} {}", e.text),
                None => e.text.to_string(),
            })
            .collect()
    }

    /// Whether `req` goes to one of these routes.
    pub fn matches<B>(&self, req: &Request<B>) -> bool {
        self.entries.iter().any(|e| e.method_matches(req)) && self.matches_target(&Target::of(req))
    }

    /// Whether the request `target` reads goes to one of these routes: by
    /// its path in normal form (as the client sent it, or inside a nest),
    /// by its path as a router matches it (`/users/./avatar` reaches
    /// `/users/{id}/avatar` with `id` `.`), or by the route axum matched.
    pub(crate) fn matches_target(&self, target: &Target<'_>) -> bool {
        self.entries.iter().any(|e| {
            e.method
                .as_ref()
                .is_none_or(|m| m == target.method || m == target.as_get)
                && (e.path_matches(&target.original)
                    || target.local.as_deref().is_some_and(|l| e.path_matches(l))
                    || raw_matches(&e.pattern, target.raw)
                    || target
                        .raw_original
                        .is_some_and(|r| raw_matches(&e.pattern, r))
                    || target
                        .matched
                        .is_some_and(|m| template_matches(&e.pattern, m)))
        })
    }

    /// Whether `req` is in scope of `routes`: every request is, where
    /// there are none.
    #[inline]
    pub(crate) fn applies<B>(routes: Option<&Self>, req: &Request<B>) -> bool {
        routes.is_none_or(|r| r.matches(req))
    }

    /// A builder's check: a set given must have a route.
    pub(crate) fn check(routes: Option<&Self>) -> Result<(), ConfigError> {
        match routes {
            Some(r) if r.is_empty() => Err(ConfigError::new(
                "routes",
                "is empty: the limit would apply to no request",
            )),
            _ => Ok(()),
        }
    }
}

impl Entry {
    /// Whether the normalised `path` matches this route's pattern.
    #[inline]
    fn path_matches(&self, path: &str) -> bool {
        match &self.exact {
            Some(exact) => **exact == *path,
            None => path_matches(&self.pattern, path),
        }
    }

    fn method_matches<B>(&self, req: &Request<B>) -> bool {
        self.method
            .as_ref()
            .is_none_or(|m| m == req.method() || m == method_of(req))
    }
}

/// A request's method and path as routes compare them, read once for
/// every set of routes a request meets.
pub(crate) struct Target<'a> {
    method: &'a Method,
    as_get: &'a Method,
    original: Cow<'a, str>,
    /// The path inside `Router::nest`, where it differs.
    local: Option<Cow<'a, str>>,
    /// The path as the request has it (the router's view).
    raw: &'a str,
    /// The path as the client sent it, where a nest stripped a prefix.
    raw_original: Option<&'a str>,
    /// The route axum matched (`/users/{id}`), where it did.
    matched: Option<&'a str>,
}

impl<'a> Target<'a> {
    pub(crate) fn of<B>(req: &'a Request<B>) -> Self {
        let (original, local) = (original_path(req), req.uri().path());
        let original = normalize_path(original);
        // Inside a nest the layer sees a shorter path; outside, the same.
        let local = (local != &*original).then(|| normalize_path(local));
        let raw_original = original_path(req);
        Self {
            method: req.method(),
            as_get: method_of(req),
            original,
            local,
            raw: req.uri().path(),
            raw_original: (raw_original != req.uri().path()).then_some(raw_original),
            matched: matched_path(req),
        }
    }
}

/// `pattern`'s segments, normalised as request paths are.
fn parse(pattern: &str) -> Result<Box<[Segment]>, String> {
    if !pattern.starts_with('/') {
        return Err(format!("{pattern:?} must start with \"/\""));
    }
    if pattern.contains(['?', '#']) {
        return Err(format!(
            "{pattern:?}: a route is a path, without a query or a fragment"
        ));
    }
    let parts: Vec<&str> = pattern.split('/').filter(|s| !s.is_empty()).collect();
    let last = parts.len().saturating_sub(1);
    let mut out = Vec::with_capacity(parts.len());
    for (i, part) in parts.iter().enumerate() {
        let segment = match part.strip_prefix('{').and_then(|p| p.strip_suffix('}')) {
            Some(name) => {
                let (rest, name) = match name.strip_prefix('*') {
                    Some(name) => (true, name),
                    None => (false, name),
                };
                if name.is_empty() || name.contains(['{', '}', '*']) {
                    return Err(format!(
                        "{pattern:?}: {part:?} is not a parameter like \"{{id}}\" or \"{{*rest}}\""
                    ));
                }
                if rest && i != last {
                    return Err(format!("{pattern:?}: {part:?} must be the last segment"));
                }
                if rest {
                    Segment::Rest
                } else {
                    Segment::Param
                }
            }
            None if part.starts_with([':', '*']) => {
                return Err(format!(
                    "{pattern:?}: {part:?} would be a path of its own: write parameters as \"{{id}}\" and \"{{*rest}}\" (axum 0.8's syntax)"
                ))
            }
            None if part.contains(['{', '}']) => {
                return Err(format!(
                "{pattern:?}: {part:?} mixes a parameter with text: a parameter is a whole segment"
            ))
            }
            None if *part == "." || *part == ".." || part.contains('%') => {
                return Err(format!(
                    "{pattern:?}: write {part:?} as the path it stands for"
                ))
            }
            None => Segment::Literal((*part).into()),
        };
        out.push(segment);
    }
    Ok(out.into())
}

/// The route axum matched, where the layer sits inside a router.
fn matched_path<B>(req: &Request<B>) -> Option<&str> {
    #[cfg(feature = "axum")]
    if let Some(m) = req.extensions().get::<axum::extract::MatchedPath>() {
        return Some(m.as_str());
    }
    let _ = req;
    None
}

/// Whether `path`, as a router splits it (no normalising: `.` and empty
/// segments are segments, a trailing `/` is one more), matches `pattern`.
fn raw_matches(pattern: &[Segment], path: &str) -> bool {
    let mut left = path.strip_prefix('/');
    if pattern.is_empty() {
        return left == Some("");
    }
    for want in pattern {
        let Some(text) = left else { return false };
        let (segment, after) = match text.split_once('/') {
            Some((segment, after)) => (segment, Some(after)),
            None => (text, None),
        };
        let fits = match want {
            Segment::Rest => return !text.is_empty(),
            Segment::Param => !segment.is_empty(),
            Segment::Literal(l) => segment == &**l,
        };
        if !fits {
            return false;
        }
        left = after;
    }
    left.is_none()
}

/// Whether the route template axum matched (`/users/{id}/avatar`) is
/// `pattern`, whatever its parameters are named.
fn template_matches(pattern: &[Segment], template: &str) -> bool {
    let mut segments = template.split('/').filter(|s| !s.is_empty());
    for want in pattern {
        let Some(segment) = segments.next() else {
            return false;
        };
        let fits = match want {
            Segment::Rest => segment.starts_with("{*"),
            Segment::Param => segment.starts_with('{') && !segment.starts_with("{*"),
            Segment::Literal(l) => segment == &**l,
        };
        if !fits {
            return false;
        }
    }
    segments.next().is_none()
}

/// Whether the normalised `path` matches `pattern` (bytes: every request
/// is matched against every scoped limit's routes).
fn path_matches(pattern: &[Segment], path: &str) -> bool {
    let mut segments = path
        .as_bytes()
        .split(|c| *c == b'/')
        .filter(|s| !s.is_empty());
    for want in pattern {
        match want {
            Segment::Rest => return segments.next().is_some(),
            Segment::Param => {
                if segments.next().is_none() {
                    return false;
                }
            }
            Segment::Literal(l) => {
                if segments.next() != Some(l.as_bytes()) {
                    return false;
                }
            }
        }
    }
    segments.next().is_none()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(method: Method, uri: &str) -> Request<()> {
        Request::builder().method(method).uri(uri).body(()).unwrap()
    }

    #[test]
    fn patterns_match_as_the_router_routes() {
        let r = Routes::new()
            .route(None, "/")
            .unwrap()
            .route(Some(Method::GET), "/users/{id}")
            .unwrap()
            .route(None, "/static/{*path}")
            .unwrap();
        assert!(r.matches(&req(Method::GET, "/")));
        assert!(r.matches(&req(Method::GET, "/users/7")));
        assert!(r.matches(&req(Method::HEAD, "/users/7")));
        assert!(!r.matches(&req(Method::PUT, "/users/7")));
        assert!(!r.matches(&req(Method::GET, "/users")));
        assert!(!r.matches(&req(Method::GET, "/users/7/posts")));
        assert!(r.matches(&req(Method::PUT, "/static/a")));
        assert!(r.matches(&req(Method::PUT, "/static/a/b/c.css")));
        assert!(!r.matches(&req(Method::PUT, "/static")));
        assert!(!r.matches(&req(Method::PUT, "/staticx/a")));
    }

    #[test]
    fn a_path_written_another_way_is_the_same_path() {
        let r = Routes::new()
            .route(Some(Method::POST), "/api/reports/")
            .unwrap();
        for same in [
            "/api/reports",
            "/api//reports",
            "/api/./reports/",
            "/api/x/../reports",
            "/%61pi/reports",
            "/api/reports?x=1",
        ] {
            assert!(r.matches(&req(Method::POST, same)), "{same}");
        }
        assert!(!r.matches(&req(Method::POST, "/api/reports/x/..%2F")));
        assert!(!r.matches(&req(Method::POST, "/api")));
    }

    /// Review of the routes: a router matches the path as sent, so
    /// `/users/./avatar` reaches `/users/{id}/avatar`; the limit applies
    /// there too, and wherever axum says it matched the route.
    #[test]
    fn the_routers_view_of_a_path_is_matched_too() {
        let r = Routes::new()
            .route(Some(Method::POST), "/users/{id}/avatar")
            .unwrap()
            .route(None, "/files/{*path}")
            .unwrap();
        for path in [
            "/users/./avatar",
            "/users/../avatar",
            "/users/%2E%2E/avatar",
            "/files//",
            "/files/x/..",
            "/files/./",
        ] {
            let method = if path.starts_with("/users") {
                Method::POST
            } else {
                Method::GET
            };
            assert!(r.matches(&req(method, path)), "{path}");
        }
        assert!(!r.matches(&req(Method::POST, "/users//avatar")));
        assert!(!r.matches(&req(Method::POST, "/users/7/avatar/x")));
        // Inside a router: the route axum matched, its parameters named
        // as they may be.
        let users = parse("/users/{id}/avatar").unwrap();
        assert!(template_matches(&users, "/users/{user}/avatar"));
        assert!(!template_matches(&users, "/users/{*rest}"));
        assert!(!template_matches(&users, "/users/{id}"));
        assert!(!template_matches(&users, "/users/{id}/avatar/{x}"));
        assert!(template_matches(&parse("/f/{*p}").unwrap(), "/f/{*path}"));
        assert!(template_matches(&parse("/").unwrap(), "/"));
    }

    #[test]
    fn bad_patterns_are_named() {
        for (bad, why) in [
            ("api", "must start with"),
            ("/a/{*rest}/b", "last segment"),
            ("/a/{}", "not a parameter"),
            ("/a/{id}.png", "whole segment"),
            ("/a/{x{y}}", "not a parameter"),
            ("/a/../b", "as the path"),
            ("/a/%2e", "as the path"),
            ("/users/:id", "axum 0.8's syntax"),
            ("/files/*path", "axum 0.8's syntax"),
            ("/a?x=1", "without a query"),
            ("/a#b", "without a query"),
        ] {
            let e = Routes::new().route(None, bad).unwrap_err();
            assert_eq!(e.field(), "routes");
            assert!(e.to_string().contains(why), "{bad}: {e}");
        }
        assert!(Routes::check(Some(&Routes::new())).is_err());
        assert!(Routes::check(None).is_ok());
        assert!(Routes::applies::<()>(None, &req(Method::GET, "/x")));
    }
}
