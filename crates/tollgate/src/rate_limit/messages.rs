//! A rate rule's budget for the messages of one upgraded connection.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tollgate_core::{BoxFuture, Decision, Limiter, Outcome, StoreError};

use super::shared::Responder;
use crate::key::KeyBytes;

/// A [`RateLimitLayer`](super::RateLimitLayer)'s budget for the messages
/// of one upgraded connection (a WebSocket, 000 §12), offered to the
/// upgrade's handler in the request's extensions when the layer is built
/// with [`messages(true)`](super::RateLimitLayerBuilder::messages). The
/// connection's task calls [`spend`](Self::spend) for each message it
/// receives, with the message's cost: the rule decides it for the key the
/// upgrade request had, in the same budget its requests draw on, so a
/// client cannot get round a request limit by moving to one long-lived
/// socket. What to do with a refused message (drop it, answer an error
/// frame, close the connection) is the handler's: the layer does not read
/// the connection.
///
/// ```
/// use std::time::Duration;
/// use axum::{routing::get, Extension, Router};
/// use tollgate::{key::Header, Limit, RateLimitLayer, Rate};
/// use tollgate::rate_limit::MessageBudget;
///
/// async fn ws(budget: Option<Extension<MessageBudget>>) -> &'static str {
///     if let Some(Extension(budget)) = budget {
///         tokio::spawn(async move {
///             // For each message received on the upgraded socket:
///             if let Err(refused) = budget.spend(1).await {
///                 // e.g. answer an error frame, or close with 1008.
///                 let _wait = refused.retry_after();
///             }
///         });
///     }
///     "upgrading"
/// }
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let layer = RateLimitLayer::builder("chat", Limit::gcra(Rate::per_second(10), 20))
///     .key(Header::named("x-api-key")?)
///     .messages(true)
///     .build()?;
/// let app: Router = Router::new().route("/ws", get(ws)).layer(layer);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct MessageBudget(Arc<dyn Spend>);

impl fmt::Debug for MessageBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MessageBudget")
            .field("rule", &self.rule())
            .finish_non_exhaustive()
    }
}

/// A message a [`MessageBudget`] refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessageRefused {
    rule: Arc<str>,
    decision: Decision,
}

impl MessageRefused {
    /// The rule that refused the message.
    pub fn rule(&self) -> &str {
        &self.rule
    }

    /// When the same message would be admitted; `None` when it never can
    /// (its cost is above the rule's whole capacity), or the store failed
    /// and the rule refuses then.
    pub fn retry_after(&self) -> Option<Duration> {
        self.decision.retry_after()
    }

    /// The rule's decision.
    pub fn decision(&self) -> &Decision {
        &self.decision
    }
}

impl fmt::Display for MessageRefused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.decision.outcome {
            Outcome::Deny { retry_after } => write!(
                f,
                "rate limit {:?} exceeded by a message; retry after {} s",
                self.rule,
                crate::headers::retry_after_secs(retry_after)
            ),
            _ => write!(f, "a message too costly for rate limit {:?}", self.rule),
        }
    }
}

impl std::error::Error for MessageRefused {}

impl MessageBudget {
    pub(crate) fn new<L: Limiter>(limiter: L, key: KeyBytes, responder: Arc<Responder>) -> Self {
        Self(Arc::new(Bound {
            limiter,
            key,
            responder,
        }))
    }

    /// Decides a message of `cost` (0 peeks): admitted, it is charged to
    /// the connection's key (on a pacing rule, once it has waited its
    /// turn); refused, it is not. A store that fails
    /// answers as the rule's failure policy does
    /// ([`on_store_error`](super::RateLimitLayerBuilder::on_store_error)):
    /// admitted by default. The rule's metrics count the outcomes
    /// `message_allowed` and `message_limited`.
    pub async fn spend(&self, cost: u64) -> Result<(), MessageRefused> {
        let decided = match self.0.spend_sync(cost) {
            Some(answer) => answer,
            None => self.0.spend(cost).await,
        };
        let responder = self.0.responder();
        let decision = match decided {
            Ok(d) => d,
            Err(e) => {
                responder.metrics.store_error.increment(1);
                crate::observe::store_fault("rate", &responder.rule, &e);
                match responder.on_store_error {
                    None => return Ok(()),
                    Some(d) => d,
                }
            }
        };
        if let Some(delay) = decision.delay() {
            // A pacing rule admits a message once it has waited its turn.
            responder.metrics.message_allowed.increment(1);
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            return Ok(());
        }
        if responder.shadow {
            responder.metrics.message_allowed.increment(1);
            return Ok(());
        }
        responder.metrics.message_limited.increment(1);
        Err(MessageRefused {
            rule: Arc::clone(&responder.rule),
            decision,
        })
    }

    /// The rule's name.
    pub fn rule(&self) -> &str {
        &self.0.responder().rule
    }
}

/// A rule's limiter bound to one connection's key.
trait Spend: Send + Sync + 'static {
    fn spend(&self, cost: u64) -> BoxFuture<Result<Decision, StoreError>>;
    fn spend_sync(&self, cost: u64) -> Option<Result<Decision, StoreError>>;
    fn responder(&self) -> &Responder;
}

struct Bound<L> {
    limiter: L,
    key: KeyBytes,
    responder: Arc<Responder>,
}

impl<L: Limiter> Spend for Bound<L> {
    fn spend(&self, cost: u64) -> BoxFuture<Result<Decision, StoreError>> {
        Box::pin(self.limiter.decide(self.key.as_bytes(), cost))
    }

    fn spend_sync(&self, cost: u64) -> Option<Result<Decision, StoreError>> {
        self.limiter.decide_sync(self.key.as_bytes(), cost)
    }

    fn responder(&self) -> &Responder {
        &self.responder
    }
}
