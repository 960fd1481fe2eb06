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

/// Where a request's plan is read by name: its [`Plan`] extension, or a
/// header. (What every layer offers; the policy also takes a closure.)
#[derive(Debug, Clone)]
pub(crate) enum Named {
    Extension,
    Header(HeaderName),
}

impl Named {
    /// `req`'s plan, as the index in `names` plus one (0: none, or one
    /// `names` does not hold).
    pub(crate) fn of<B>(&self, names: &[Box<str>], req: &Request<B>) -> u8 {
        let found = match self {
            Named::Extension => req
                .extensions()
                .get::<Plan>()
                .and_then(|p| index(names, p.0.as_bytes())),
            Named::Header(h) => req
                .headers()
                .get(h)
                .and_then(|v| index(names, v.as_bytes())),
        };
        found.unwrap_or(0)
    }
}

/// The plan index of `name` in `names`: its position plus one.
fn index(names: &[Box<str>], name: &[u8]) -> Option<u8> {
    let i = names.iter().position(|n| n.as_bytes() == name)?;
    u8::try_from(i.checked_add(1)?).ok()
}

/// Where a policy reads a request's plan.
pub(crate) enum Source<B> {
    Named(Named),
    Fn(PlanFn<B>),
}

impl<B> Clone for Source<B> {
    fn clone(&self) -> Self {
        match self {
            Source::Named(n) => Source::Named(n.clone()),
            Source::Fn(f) => Source::Fn(Arc::clone(f)),
        }
    }
}

impl<B> fmt::Debug for Source<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Named(n) => n.fmt(f),
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
        index(&self.names, name)
    }

    /// The plan of `req`: `0` (the default) when it has none or one no
    /// rule names.
    pub(crate) fn of(&self, req: &Request<B>) -> u8 {
        match &self.source {
            None => 0,
            Some(Source::Named(n)) => n.of(&self.names, req),
            Some(Source::Fn(f)) => f(req).and_then(|p| self.index(p.0.as_bytes())).unwrap_or(0),
        }
    }
}

/// The plans of a layer of one rule (quota, concurrency): names, where
/// to read them, and what each plan is bound to.
pub(crate) struct PlanSet<T> {
    pub(crate) names: Vec<Box<str>>,
    pub(crate) source: Option<Named>,
    /// The default plan's binding.
    pub(crate) default: T,
    /// `plans[i]`: plan `names[i]`'s.
    pub(crate) plans: Vec<T>,
}

impl<T> PlanSet<T> {
    /// What `req`'s plan is bound to (the default's for none or an
    /// unknown one).
    pub(crate) fn of<B>(&self, req: &Request<B>) -> &T {
        self.get(self.index(req))
    }

    /// `req`'s plan: 0 the default (none, or one the layer does not
    /// know), `i` plan `names[i - 1]`.
    pub(crate) fn index<B>(&self, req: &Request<B>) -> u8 {
        self.source.as_ref().map_or(0, |s| s.of(&self.names, req))
    }

    /// What plan `i` (as [`index`](Self::index) gives it) is bound to.
    pub(crate) fn get(&self, i: u8) -> &T {
        usize::from(i)
            .checked_sub(1)
            .and_then(|i| self.plans.get(i))
            .unwrap_or(&self.default)
    }
}

/// Checks the plan names of a layer of one rule: at least one character,
/// at most 32, no two alike, and a source to read them from. Errors name
/// the field `plans`.
pub(crate) fn named_plans<'a>(
    names: impl Iterator<Item = &'a str>,
    has_source: bool,
) -> Result<Vec<Box<str>>, tollgate_core::ConfigError> {
    let mut out: Vec<Box<str>> = Vec::new();
    for name in names {
        if name.is_empty() || name.len() > 32 {
            return Err(tollgate_core::ConfigError::new(
                "plans",
                format!("plan name {name:?} must be 1 to 32 bytes"),
            ));
        }
        if out.iter().any(|n| **n == *name) {
            return Err(tollgate_core::ConfigError::new(
                "plans",
                format!("plan {name:?} is given twice"),
            ));
        }
        out.push(name.into());
    }
    if out.len() >= usize::from(u8::MAX) {
        return Err(tollgate_core::ConfigError::new(
            "plans",
            "at most 254 plans",
        ));
    }
    if !out.is_empty() && !has_source {
        return Err(tollgate_core::ConfigError::new(
            "plans",
            "plans are named, but no plan source is set (plan_from_extension or plan_from_header)",
        ));
    }
    Ok(out)
}

/// The plan-source methods of a layer builder of one limit, whose
/// `cfg.plan_source` holds a [`Named`] source: written once for the
/// quota and concurrency builders.
macro_rules! plan_source_methods {
    () => {
        /// Reads a request's plan from its [`Plan`](crate::policy::Plan)
        /// extension, set by authentication middleware: the way to choose
        /// plans in production (a middleware of your own can set it from
        /// anything else).
        pub fn plan_from_extension(mut self) -> Self {
            self.cfg.plan_source = Some($crate::policy::plan::Named::Extension);
            self
        }

        /// Reads a request's plan from header `name`. Only for demos and
        /// trusted internal callers: a client must never choose its own
        /// plan. Errors name the field `header`.
        pub fn plan_from_header(mut self, name: &str) -> Result<Self, tollgate_core::ConfigError> {
            self.cfg.plan_source = Some($crate::policy::plan::Named::Header(
                $crate::key::header_name(name)?,
            ));
            Ok(self)
        }
    };
}
pub(crate) use plan_source_methods;
