//! Which requests are critical: they may use every permit, the others a
//! share, so the rest stays in reserve for them.

use http::Request;

/// Decides whether a request is critical: critical requests may use every
/// permit; the others at most the configured share, so the rest stays in
/// reserve for the critical ones (Stripe's critical reserve).
///
/// Closures are classifiers: `|req: &Request<B>| -> bool`.
pub trait Critical<B>: Clone + Send + Sync + 'static {
    /// Whether `req` is critical.
    fn is_critical(&self, req: &Request<B>) -> bool;
}

impl<B, F> Critical<B> for F
where
    F: Fn(&Request<B>) -> bool + Clone + Send + Sync + 'static,
{
    fn is_critical(&self, req: &Request<B>) -> bool {
        self(req)
    }
}

/// Every request is critical: no reserve (the default).
#[derive(Debug, Clone, Copy, Default)]
pub struct AllCritical;

impl<B> Critical<B> for AllCritical {
    fn is_critical(&self, _req: &Request<B>) -> bool {
        true
    }
}
