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
pub struct MessageBudget(Arc<[Arc<dyn Spend>]>);

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
    /// (its cost is above the rule's whole capacity). (A store that failed
    /// under `OnStoreError::Refuse` answers 1 s.)
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
        Self(Arc::new([Arc::new(Bound {
            limiter,
            key,
            responder,
        }) as Arc<dyn Spend>]))
    }

    /// This budget and `inner`'s, together: a request that passes several
    /// rate layers carries one budget, whose messages spend on every rule
    /// (the outer layer's first).
    pub(crate) fn and(&self, inner: &Self) -> Self {
        Self(self.0.iter().chain(inner.0.iter()).cloned().collect())
    }

    /// Decides a message of `cost` (0 peeks) on every rule the budget
    /// holds (one per rate layer that offered it, the outermost first):
    /// admitted by all, it is charged to the connection's key on each (on
    /// a pacing rule, once it has waited its turn: dropped while it
    /// waits, it is given back); refused by one, the others' charges are
    /// given back and the first refusal is returned. A store that fails
    /// answers as its rule's failure policy does
    /// ([`on_store_error`](super::RateLimitLayerBuilder::on_store_error)):
    /// admitted by default. Each rule's metrics count the outcomes
    /// `message_allowed` and `message_limited` (a rule in shadow mode
    /// refuses nothing: `shadow_limited`).
    pub async fn spend(&self, cost: u64) -> Result<(), MessageRefused> {
        let mut delay = Duration::ZERO;
        for (i, part) in self.0.iter().enumerate() {
            match decide(&**part, cost).await {
                Ok(wait) => delay = delay.max(wait),
                Err(refused) => {
                    for admitted in self.0.iter().take(i) {
                        admitted.give_back(cost);
                    }
                    return Err(refused);
                }
            }
        }
        if !delay.is_zero() {
            // A pacing rule admits a message once it has waited its turn;
            // a wait given up gives the charges back.
            let mut pending = GiveBack(Some((self, cost)));
            tokio::time::sleep(delay).await;
            pending.0 = None;
        }
        Ok(())
    }

    /// The rules' names, the outermost first, joined by `, `.
    pub fn rule(&self) -> String {
        let names: Vec<&str> = self.0.iter().map(|p| &*p.responder().rule).collect();
        names.join(", ")
    }
}

/// Gives a message's charges back if dropped while set (its pacing wait
/// given up).
struct GiveBack<'a>(Option<(&'a MessageBudget, u64)>);

impl Drop for GiveBack<'_> {
    fn drop(&mut self) {
        if let Some((budget, cost)) = self.0.take() {
            for part in budget.0.iter() {
                part.give_back(cost);
            }
        }
    }
}

/// One rule's decision of a message: admitted (after how long a wait),
/// or refused.
async fn decide(part: &dyn Spend, cost: u64) -> Result<Duration, MessageRefused> {
    let decided = match part.spend_sync(cost) {
        Some(answer) => answer,
        None => part.spend(cost).await,
    };
    let responder = part.responder();
    let decision = match decided {
        Ok(d) => d,
        Err(e) => {
            responder.metrics.store_error.increment(1);
            crate::observe::store_fault("rate", &responder.rule, &e);
            match responder.on_store_error {
                None => return Ok(Duration::ZERO),
                Some(d) => d,
            }
        }
    };
    match decision.delay() {
        // Shadow mode changes nothing: no pacing either.
        Some(_) if responder.shadow => {
            responder.metrics.message_allowed.increment(1);
            Ok(Duration::ZERO)
        }
        Some(delay) => {
            responder.metrics.message_allowed.increment(1);
            Ok(delay)
        }
        None if responder.shadow => {
            responder.metrics.shadow_limited.increment(1);
            Ok(Duration::ZERO)
        }
        None => {
            responder.metrics.message_limited.increment(1);
            Err(MessageRefused {
                rule: Arc::clone(&responder.rule),
                decision,
            })
        }
    }
}

/// A rule's limiter bound to one connection's key.
trait Spend: Send + Sync + 'static {
    fn spend(&self, cost: u64) -> BoxFuture<Result<Decision, StoreError>>;
    fn spend_sync(&self, cost: u64) -> Option<Result<Decision, StoreError>>;
    /// Gives back `cost` charged earlier.
    fn give_back(&self, cost: u64);
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

    fn give_back(&self, cost: u64) {
        if cost > 0 {
            crate::task::finish(self.limiter.refund(self.key.as_bytes(), cost));
        }
    }

    fn responder(&self) -> &Responder {
        &self.responder
    }
}
