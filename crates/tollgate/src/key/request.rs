//! Keys from the request's parts: a header, the path, the method, the
//! route, or one key for all — and the forms of a request's method and
//! path that every key and cost reads, so that no variant of a request
//! (`HEAD` for `GET`, `/a//b`, `/%61`, a route inside `Router::nest`)
//! makes a fresh key or a cheaper cost.

use std::borrow::Cow;

use http::header::HeaderName;
use http::Request;

use super::{KeyBuf, KeyExtractor};

/// One key for every request: a global limit.
#[derive(Debug, Clone, Copy, Default)]
pub struct Global;

impl<B> KeyExtractor<B> for Global {
    fn extract(&self, _req: &Request<B>, key: &mut KeyBuf) -> Option<()> {
        key.push(b"global");
        Some(())
    }

    fn is_fixed(&self) -> bool {
        true
    }
}

/// A header's value, e.g. an API key. Absent, empty or only whitespace:
/// no key. Surrounding whitespace is not part of the key (`" k"` is
/// `"k"`). Values are bytes; non-UTF-8 values are keys like any other.
///
/// For `Authorization` (and `Proxy-Authorization`), the key is the
/// credentials as a server reads them: the scheme in lower case, one
/// space, the credentials (`Bearer  abc`, `bearer abc` and `BEARER abc`
/// are one key, as an auth layer accepts them all), so that writing the
/// scheme another way buys no fresh budget.
#[derive(Debug, Clone)]
pub struct Header(HeaderName);

impl Header {
    /// The header `name` (case-insensitive); an invalid name is an error
    /// naming the field `header`.
    pub fn named(name: &str) -> Result<Self, tollgate_core::ConfigError> {
        header_name(name).map(Self)
    }

    /// The header `name`.
    pub fn from_name(name: HeaderName) -> Self {
        Self(name)
    }
}

impl<B> KeyExtractor<B> for Header {
    fn extract(&self, req: &Request<B>, key: &mut KeyBuf) -> Option<()> {
        let value = req.headers().get(&self.0)?.as_bytes().trim_ascii();
        if value.is_empty() {
            return None;
        }
        if self.0 == http::header::AUTHORIZATION || self.0 == http::header::PROXY_AUTHORIZATION {
            // `<scheme> <credentials>`: the scheme is case-insensitive, and
            // any run of spaces separates them.
            if let Some(space) = value.iter().position(|b| *b == b' ' || *b == b'\t') {
                let (scheme, rest) = value.split_at(space);
                let mut canonical = scheme.to_ascii_lowercase();
                canonical.push(b' ');
                canonical.extend_from_slice(rest.trim_ascii());
                key.push(&canonical);
                return Some(());
            }
        }
        key.push(value);
        Some(())
    }
}

/// A client fingerprint (000 §13, abuse signals): the values of a few
/// headers taken together — a JA4 TLS fingerprint an edge proxy sets
/// (`x-ja4`), `User-Agent`, `Accept-Language` — so that a script that
/// rotates API keys or addresses keeps one budget while its client stays
/// the same. One key per distinct combination, a header that is absent
/// being part of it (a client that sends no `User-Agent` is told apart
/// from one that does); when every header is absent there is no key (the
/// rule's [`MissingKey`](crate::key::MissingKey) decides: pair it with an
/// address key, or skip). Each header's last value counts (an edge proxy
/// that appends its value puts it after any the client sent; one that
/// sets it replaces them), trimmed, up to 512 bytes of it. 1 to 8
/// headers. Read only headers the edge sets: a value the client chooses
/// is a key the client chooses.
///
/// ```
/// use tollgate::key::ClientFingerprint;
/// let key = ClientFingerprint::of(&["x-ja4", "user-agent"])?;
/// # Ok::<(), tollgate::ConfigError>(())
/// ```
#[derive(Debug, Clone)]
pub struct ClientFingerprint(std::sync::Arc<[HeaderName]>);

impl ClientFingerprint {
    /// The most headers a fingerprint reads.
    pub const MAX_HEADERS: usize = 8;
    /// How much of each header's value counts.
    pub const MAX_VALUE: usize = 512;

    /// The fingerprint of `headers` (case-insensitive names). Errors name
    /// the field `fingerprint` (none, more than 8, a repeat) or `header`
    /// (an invalid name).
    pub fn of(headers: &[&str]) -> Result<Self, tollgate_core::ConfigError> {
        if headers.is_empty() || headers.len() > Self::MAX_HEADERS {
            return Err(tollgate_core::ConfigError::new(
                "fingerprint",
                format!("must name 1 to {} headers", Self::MAX_HEADERS),
            ));
        }
        let mut names: Vec<HeaderName> = Vec::with_capacity(headers.len());
        for h in headers {
            let name = header_name(h.trim())?;
            if names.contains(&name) {
                return Err(tollgate_core::ConfigError::new(
                    "fingerprint",
                    format!("names {name} twice"),
                ));
            }
            names.push(name);
        }
        Ok(Self(names.into()))
    }
}

impl<B> KeyExtractor<B> for ClientFingerprint {
    fn extract(&self, req: &Request<B>, key: &mut KeyBuf) -> Option<()> {
        let mut any = false;
        for name in self.0.iter() {
            let last = req.headers().get_all(name).iter().next_back();
            match last.map(|v| v.as_bytes().trim_ascii()) {
                Some(value) => {
                    any = true;
                    let value = value.get(..Self::MAX_VALUE).unwrap_or(value);
                    // Length first: ("a", "bc") and ("ab", "c") differ.
                    let len = u16::try_from(value.len()).unwrap_or(u16::MAX);
                    key.push(&len.to_be_bytes());
                    key.push(value);
                }
                // Absent: a length no value has.
                None => key.push(&u16::MAX.to_be_bytes()),
            }
        }
        any.then_some(())
    }
}

/// Parses a configured header name; the error names the field `header`.
pub(crate) fn header_name(name: &str) -> Result<HeaderName, tollgate_core::ConfigError> {
    HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
        tollgate_core::ConfigError::new("header", format!("{name:?} is not a valid header name"))
    })
}

/// The request path (`/users/42`), as the client sent it before any
/// `Router::nest` stripped a prefix, and normalised ([`normalize_path`]):
/// `/users//42`, `/users/./42` and `/%75sers/42` are one key. Every
/// distinct URL is a key; to limit per route template (`/users/{id}`) use
/// [`Route`] (axum).
#[derive(Debug, Clone, Copy, Default)]
pub struct Path;

impl<B> KeyExtractor<B> for Path {
    fn extract(&self, req: &Request<B>, key: &mut KeyBuf) -> Option<()> {
        key.push(normalize_path(original_path(req)).as_bytes());
        Some(())
    }
}

/// The request method; `HEAD` is `GET` (a router answers a `HEAD` with
/// the `GET` handler, so it is the same work and the same budget).
#[derive(Debug, Clone, Copy, Default)]
pub struct Method;

impl<B> KeyExtractor<B> for Method {
    fn extract(&self, req: &Request<B>, key: &mut KeyBuf) -> Option<()> {
        key.push(method_of(req).as_str().as_bytes());
        Some(())
    }
}

/// The matched route template (axum's `MatchedPath`, e.g. `/users/{id}`).
/// Present when the layer is added with `Router::route_layer`, or inside a
/// router; absent (no key) otherwise.
#[cfg(feature = "axum")]
#[derive(Debug, Clone, Copy, Default)]
pub struct Route;

#[cfg(feature = "axum")]
impl<B> KeyExtractor<B> for Route {
    fn extract(&self, req: &Request<B>, key: &mut KeyBuf) -> Option<()> {
        let path = req.extensions().get::<axum::extract::MatchedPath>()?;
        key.push(path.as_str().as_bytes());
        Some(())
    }
}

/// The method a request is charged and keyed as: `HEAD` runs the `GET`
/// handler (axum, hyper and most routers do that), so it is `GET`.
pub(crate) fn method_of<B>(req: &Request<B>) -> &http::Method {
    if req.method() == http::Method::HEAD {
        &http::Method::GET
    } else {
        req.method()
    }
}

/// The path the client sent: axum's `OriginalUri` (set by the outermost
/// router, before `Router::nest` strips its prefix) when present, else
/// the request's own.
pub(crate) fn original_path<B>(req: &Request<B>) -> &str {
    #[cfg(feature = "axum")]
    if let Some(original) = req.extensions().get::<axum::extract::OriginalUri>() {
        return original.0.path();
    }
    req.uri().path()
}

/// A path in one form for every way of writing it (RFC 3986 §6.2.2, and
/// what routers do): percent-encoded unreserved characters decoded
/// (`%61` is `a`), other escapes upper-cased (`%2f` is `%2F`), empty
/// segments dropped (`//` is `/`), dot-segments resolved (`/a/./b/../c`
/// is `/a/c`; never above the root), a trailing slash dropped (`/a/` is
/// `/a`: a `NormalizePathLayer` inside would serve it as `/a`). Paths
/// already in that form (the usual case) are not copied.
pub fn normalize_path(path: &str) -> Cow<'_, str> {
    let b = path.as_bytes();
    if is_normal(b) {
        return Cow::Borrowed(path);
    }
    let decoded = decode_unreserved(b);
    let mut segments: Vec<&[u8]> = Vec::new();
    for segment in decoded.split(|c| *c == b'/') {
        match segment {
            b"" | b"." => {}
            b".." => {
                segments.pop();
            }
            s => segments.push(s),
        }
    }
    let mut out = Vec::with_capacity(decoded.len().saturating_add(1));
    for s in &segments {
        out.push(b'/');
        out.extend_from_slice(s);
    }
    if out.is_empty() {
        out.push(b'/');
    }
    // Only ASCII was decoded, and only escapes of ASCII: still UTF-8 where
    // the input was; a lossy read never panics where it was not.
    Cow::Owned(String::from_utf8_lossy(&out).into_owned())
}

/// Whether `b` is a path in [`normalize_path`]'s form already: from `/`,
/// no escape, no empty segment, no `.` or `..` segment, no trailing `/`
/// (one pass over the bytes: every request's path is looked at).
fn is_normal(b: &[u8]) -> bool {
    if b.first() != Some(&b'/') || (b.len() > 1 && b.last() == Some(&b'/')) {
        return false;
    }
    let mut segment_start = 0;
    for (i, &c) in b.iter().enumerate() {
        match c {
            b'%' => return false,
            b'/' if i > 0 => {
                // The segment that ends here: empty, `.` or `..`.
                let segment = b.get(segment_start..i).unwrap_or_default();
                if matches!(segment, b"" | b"." | b"..") {
                    return false;
                }
                segment_start = i.saturating_add(1);
            }
            b'/' => segment_start = 1,
            _ => {}
        }
    }
    let last = b.get(segment_start..).unwrap_or_default();
    !(segment_start < b.len() && matches!(last, b"." | b".."))
}

/// `%XX` of an unreserved character (ALPHA, DIGIT, `-._~`) decoded, any
/// other escape's hex upper-cased, a broken escape kept as it is.
pub(crate) fn decode_unreserved(b: &[u8]) -> Vec<u8> {
    let hex = |c: Option<&u8>| c.and_then(|c| char::from(*c).to_digit(16));
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while let Some(&c) = b.get(i) {
        let escape = match c {
            b'%' => hex(b.get(i.saturating_add(1))).zip(hex(b.get(i.saturating_add(2)))),
            _ => None,
        };
        let Some((hi, lo)) = escape else {
            out.push(c);
            i = i.saturating_add(1);
            continue;
        };
        let byte = u8::try_from(hi.saturating_mul(16).saturating_add(lo)).unwrap_or(0);
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(byte);
        } else {
            const HEX: &[u8; 16] = b"0123456789ABCDEF";
            let digit = |d: u32| usize::try_from(d).ok().and_then(|d| HEX.get(d)).copied();
            out.push(b'%');
            out.extend(digit(hi));
            out.extend(digit(lo));
        }
        i = i.saturating_add(3);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fingerprint tells clients apart by the headers taken together,
    /// an absent header included, and never by how values split.
    #[test]
    fn a_fingerprint_is_its_headers_taken_together() {
        let fp = ClientFingerprint::of(&["x-ja4", "User-Agent"]).unwrap();
        let key_of = |headers: &[(&str, &[u8])]| {
            let mut req = Request::get("/").body(()).unwrap();
            for (name, value) in headers {
                req.headers_mut().append(
                    HeaderName::from_bytes(name.as_bytes()).unwrap(),
                    http::HeaderValue::from_bytes(value).unwrap(),
                );
            }
            let mut key = KeyBuf::new();
            fp.extract(&req, &mut key)?;
            Some(key.as_bytes().to_vec())
        };
        let bot = key_of(&[("x-ja4", b"t13d1516h2"), ("user-agent", b"curl/8")]).unwrap();
        // A value the client sends before the edge's appended one is not
        // read: the edge's, last, is.
        assert_eq!(
            key_of(&[
                ("x-ja4", b"chosen-by-client"),
                ("x-ja4", b"t13d1516h2"),
                ("user-agent", b"curl/8")
            ]),
            Some(bot.clone())
        );
        // The same client with another API key or address: the same key.
        assert_eq!(
            key_of(&[
                ("user-agent", b" curl/8 "),
                ("x-ja4", b"t13d1516h2"),
                ("x-api-key", b"rotated")
            ]),
            Some(bot.clone())
        );
        assert_ne!(
            key_of(&[("x-ja4", b"t13d1516h2"), ("user-agent", b"curl/9")]),
            Some(bot.clone())
        );
        // Absent is not empty, and values do not run into each other.
        let no_ua = key_of(&[("x-ja4", b"t13d1516h2")]).unwrap();
        assert_ne!(no_ua, bot);
        assert_ne!(
            key_of(&[("x-ja4", b"t13d1516h2"), ("user-agent", b"")]),
            Some(no_ua)
        );
        assert_ne!(
            key_of(&[("x-ja4", b"ab"), ("user-agent", b"c")]),
            key_of(&[("x-ja4", b"a"), ("user-agent", b"bc")])
        );
        // Nothing to read: no key (the rule's MissingKey decides).
        assert_eq!(key_of(&[("x-api-key", b"k")]), None);
        // Huge and non-UTF-8 values are keys, cut at 512 bytes.
        let long = vec![0xffu8; 100_000];
        let mut longer = long.clone();
        longer.push(b'a');
        assert_eq!(
            key_of(&[("x-ja4", &long[..])]),
            key_of(&[("x-ja4", &longer[..])])
        );
        for bad in [&[][..], &["a"; 9], &["a", "A"], &["bad header"]] {
            assert!(ClientFingerprint::of(bad).is_err(), "{bad:?}");
        }
    }

    /// Policy-security review #16: keyed on `Authorization`, every way of
    /// writing the scheme (64 case variants of `Bearer`, any run of
    /// spaces) was a fresh budget for one token.
    #[test]
    fn an_authorization_scheme_written_another_way_is_the_same_key() {
        let key_of = |header: &str, value: &str| {
            let req = Request::get("/").header(header, value).body(()).unwrap();
            let mut key = KeyBuf::new();
            Header::named(header).unwrap().extract(&req, &mut key)?;
            Some(key.as_bytes().to_vec())
        };
        let one = key_of("authorization", "Bearer abc").unwrap();
        for variant in [
            "bearer abc",
            "BEARER abc",
            "Bearer   abc",
            "bEaReR\tabc ",
            " Bearer abc",
        ] {
            assert_eq!(
                key_of("authorization", variant).unwrap(),
                one,
                "{variant:?}"
            );
        }
        assert_ne!(key_of("authorization", "Bearer abd").unwrap(), one);
        assert_ne!(key_of("authorization", "Basic abc").unwrap(), one);
        // Other headers keep their bytes (an API key is case-sensitive).
        assert_ne!(
            key_of("x-api-key", "Bearer abc"),
            key_of("x-api-key", "bearer abc")
        );
    }

    #[test]
    fn paths_in_every_form_normalise_to_one() {
        for (raw, want) in [
            ("/orders", "/orders"),
            ("/%6frders", "/orders"),
            ("/%6Frders", "/orders"),
            ("//orders", "/orders"),
            ("/api//orders/", "/api/orders"),
            ("/orders/", "/orders"),
            ("/api/./orders", "/api/orders"),
            ("/api/x/../orders", "/api/orders"),
            ("/%2e%2e/orders", "/orders"),
            ("/../../orders", "/orders"),
            ("/a%2fb", "/a%2Fb"),
            ("/a%zz", "/a%zz"),
            ("/a%", "/a%"),
            ("/", "/"),
            ("", "/"),
            ("/..", "/"),
            ("/%ff", "/%FF"),
        ] {
            assert_eq!(normalize_path(raw), want, "{raw}");
        }
        assert!(matches!(normalize_path("/users/42"), Cow::Borrowed(_)));
    }

    /// The one-pass check says what the definition says, on every path of
    /// up to six characters from an alphabet of the characters that
    /// matter.
    #[test]
    fn the_quick_check_is_the_definition() {
        let defined = |p: &str| {
            let b = p.as_bytes();
            b.first() == Some(&b'/')
                && (b.len() == 1 || b.last() != Some(&b'/'))
                && !b.contains(&b'%')
                && !b.windows(2).any(|w| w == b"//")
                && !p.split('/').any(|s| s == "." || s == "..")
        };
        let alphabet = ['/', '.', 'a', '%'];
        let mut paths = vec![String::new()];
        for _ in 0..6 {
            let longer: Vec<String> = paths
                .iter()
                .flat_map(|p| alphabet.iter().map(move |c| format!("{p}{c}")))
                .collect();
            for p in paths.iter().chain(&longer) {
                assert_eq!(super::is_normal(p.as_bytes()), defined(p), "{p:?}");
            }
            paths = longer;
        }
    }

    #[test]
    fn head_is_get_and_blank_headers_are_no_key() {
        let head = Request::head("/x").body(()).unwrap();
        assert_eq!(method_of(&head), http::Method::GET);
        let h = Header::named("x-api-key").unwrap();
        for blank in ["", " ", "\t \t"] {
            let req = Request::get("/")
                .header("x-api-key", blank)
                .body(())
                .unwrap();
            assert!(h.extract(&req, &mut KeyBuf::new()).is_none(), "{blank:?}");
        }
        let (mut a, mut b) = (KeyBuf::new(), KeyBuf::new());
        let padded = Request::get("/")
            .header("x-api-key", " k ")
            .body(())
            .unwrap();
        let plain = Request::get("/").header("x-api-key", "k").body(()).unwrap();
        h.extract(&padded, &mut a).unwrap();
        h.extract(&plain, &mut b).unwrap();
        assert_eq!(a.as_bytes(), b.as_bytes());
    }
}
