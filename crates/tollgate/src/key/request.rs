//! Keys from the request's parts: a header, the path, the method, the
//! route, or one key for all.

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
}

/// A header's value, e.g. an API key. Absent or empty: no key. Values are
/// bytes; non-UTF-8 values are keys like any other.
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
        let value = req.headers().get(&self.0)?.as_bytes();
        if value.is_empty() {
            return None;
        }
        key.push(value);
        Some(())
    }
}

/// Parses a configured header name; the error names the field `header`.
pub(crate) fn header_name(name: &str) -> Result<HeaderName, tollgate_core::ConfigError> {
    HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
        tollgate_core::ConfigError::new("header", format!("{name:?} is not a valid header name"))
    })
}

/// The request path (`/users/42`). Every distinct URL is a key; to limit
/// per route template (`/users/{id}`) use [`Route`] (axum).
#[derive(Debug, Clone, Copy, Default)]
pub struct Path;

impl<B> KeyExtractor<B> for Path {
    fn extract(&self, req: &Request<B>, key: &mut KeyBuf) -> Option<()> {
        key.push(req.uri().path().as_bytes());
        Some(())
    }
}

/// The request method.
#[derive(Debug, Clone, Copy, Default)]
pub struct Method;

impl<B> KeyExtractor<B> for Method {
    fn extract(&self, req: &Request<B>, key: &mut KeyBuf) -> Option<()> {
        key.push(req.method().as_str().as_bytes());
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
