//! Plans: free, pro, enterprise — each with its own limits.

use std::fmt;
use std::sync::Arc;

use http::header::HeaderName;
use http::Request;

/// The plan a request is on, as authentication middleware records it: put
/// a `Plan` into the request's extensions and build the policy with
/// [`plan_from_extension`](super::PolicyLayerBuilder::plan_from_extension).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Plan(pub Arc<str>);

impl Plan {
    /// The plan named `name`.
    pub fn new(name: &str) -> Self {
        Self(Arc::from(name))
    }
}

type PlanFn<B> = Arc<dyn Fn(&Request<B>) -> Option<Plan> + Send + Sync>;

/// Where a policy reads a request's plan.
pub(crate) enum Source<B> {
    Extension,
    Header(HeaderName),
    Fn(PlanFn<B>),
}

impl<B> Clone for Source<B> {
    fn clone(&self) -> Self {
        match self {
            Source::Extension => Source::Extension,
            Source::Header(h) => Source::Header(h.clone()),
            Source::Fn(f) => Source::Fn(Arc::clone(f)),
        }
    }
}

impl<B> fmt::Debug for Source<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Extension => f.write_str("Extension"),
            Source::Header(h) => write!(f, "Header({h})"),
            Source::Fn(_) => f.write_str("Fn"),
        }
    }
}

/// The plans a policy knows, in the order rules named them; plan `0` is
/// the default (the rules' own limits), plan `i + 1` is `names[i]`.
pub(crate) struct Plans<B> {
    pub(crate) names: Vec<Box<str>>,
    pub(crate) source: Option<Source<B>>,
}

impl<B> Plans<B> {
    /// The plan index of `name`, if a rule names it.
    pub(crate) fn index(&self, name: &[u8]) -> Option<u8> {
        let i = self.names.iter().position(|n| n.as_bytes() == name)?;
        u8::try_from(i.checked_add(1)?).ok()
    }

    /// The plan of `req`: `0` (the default) when it has none or one no
    /// rule names.
    pub(crate) fn of(&self, req: &Request<B>) -> u8 {
        let found = match &self.source {
            None => None,
            Some(Source::Extension) => req
                .extensions()
                .get::<Plan>()
                .and_then(|p| self.index(p.0.as_bytes())),
            Some(Source::Header(h)) => req.headers().get(h).and_then(|v| self.index(v.as_bytes())),
            Some(Source::Fn(f)) => f(req).and_then(|p| self.index(p.0.as_bytes())),
        };
        found.unwrap_or(0)
    }
}
