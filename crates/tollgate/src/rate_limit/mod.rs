//! Rate limiting per client, weighted per request.
//!
//! [`RateLimitLayer`] decides every request against a [`Rule`](tollgate_core::Rule)
//! for the key its [`KeyExtractor`](crate::key::KeyExtractor) finds, at the
//! cost its [`Cost`](crate::cost::Cost) function assigns, in a shared
//! [`Store`](tollgate_core::Store) (in-process memory by default).
//!
//! # Why decide in `call`
//!
//! Tower's own `RateLimit` makes callers wait in `poll_ready` until the
//! budget refills. That suits a client pacing its own calls; a server must
//! do the opposite. Its callers are other people's clients: holding them in
//! `poll_ready` holds one connection's pipeline for everybody, cannot tell
//! one client from another (readiness comes before the request), and axum
//! treats services as always ready anyway. So this layer is always ready
//! when the inner service is, decides each request in `call`, and answers
//! at once: the inner response, or a `429` with `Retry-After`. The only
//! waiting it ever does is the leaky-bucket pacer's, bounded by the rule's
//! `max_delay`.
//!
//! # Failure
//!
//! A store that errors (a Redis outage past its own failure policy) never
//! turns into a 5xx: the request is let through and the fault is logged.
//! A rejection is a response, not an error, so the connection stays up and
//! the client learns when to come back; stacks that want an error instead
//! (to handle with `HandleErrorLayer`) use [`RateLimitLayer::into_errors`].
//!
//! # Layer order
//!
//! Put the limiter outside (before) expensive work such as body parsing,
//! and inside anything that supplies its key: keyed by address, outside
//! authentication (it then protects the authentication itself), with
//! axum's `into_make_service_with_connect_info` for peer IPs; keyed by
//! user or API key, inside the layer that authenticates and inserts the
//! identity (a key a client merely sends can be rotated). See the crate
//! docs' "Stacking layers" for the order of several layers. With axum,
//! `Router::route_layer` limits only matched routes (404s are not counted)
//! and gives [`Route`](crate::key::Route) the route template.

mod after;
mod error;
mod future;
mod layer;
mod messages;
mod service;
mod shared;
#[cfg(test)]
pub(crate) mod tests;

pub use crate::key::MissingKey;
pub use after::{ActualCost, Measure};
pub(crate) use after::{Debts, Settle};
pub use error::RateLimited;
pub(crate) use future::{poll_paced, Inner, Refund, RefundFn};
pub use future::{ErrorFuture, ResponseFuture};
pub use layer::{RateLimitErrorLayer, RateLimitLayer, RateLimitLayerBuilder};
pub use messages::{MessageBudget, MessageRefused};
pub use service::{RateLimitErrorService, RateLimitService};
pub(crate) use shared::Responder;
