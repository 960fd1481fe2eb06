//! What every clone of a policy layer shares: its rules, bound to the store.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response};

use super::rule::DynRule;
use crate::key::KeyBuf;
use crate::rate_limit::{MissingKey, Responder};
use crate::rejection::Rejected;

/// The most rules one policy holds.
pub const MAX_RULES: usize = 8;

pub(super) type RejectFn = Arc<dyn Fn(&Rejected) -> Response<Bytes> + Send + Sync>;

/// A rule bound to its store.
pub(super) struct Bound<B, L> {
    pub(super) rule: Box<dyn DynRule<B>>,
    pub(super) limiter: L,
    pub(super) missing: MissingKey,
    pub(super) warned_missing: AtomicBool,
    pub(super) responder: Responder,
}

/// What a rule made of a request's key.
pub(super) enum Keyed {
    Key,
    Skip,
    Reject,
}

impl<B, L> Bound<B, L> {
    /// The key of a request this rule keyed before: no metrics, no
    /// warning. `false` when it had none (and was skipped or refused).
    pub(super) fn key_again(&self, req: &Request<B>, key: &mut KeyBuf) -> bool {
        if self.rule.key(req, key).is_some() {
            return true;
        }
        match &self.missing {
            MissingKey::Fallback(fallback) => {
                *key =
                    MissingKey::fallback_key(fallback, &self.warned_missing, &self.responder.rule);
                true
            }
            MissingKey::Skip | MissingKey::Reject => false,
        }
    }

    pub(super) fn key(&self, req: &Request<B>, key: &mut KeyBuf) -> Keyed {
        if self.rule.key(req, key).is_some() {
            return Keyed::Key;
        }
        let m = &self.responder.metrics;
        match &self.missing {
            MissingKey::Skip => {
                m.unkeyed.increment(1);
                Keyed::Skip
            }
            MissingKey::Reject => {
                m.missing_key.increment(1);
                Keyed::Reject
            }
            MissingKey::Fallback(fallback) => {
                *key =
                    MissingKey::fallback_key(fallback, &self.warned_missing, &self.responder.rule);
                Keyed::Key
            }
        }
    }
}

pub(super) struct Shared<B, L> {
    pub(super) rules: Box<[Bound<B, L>]>,
    pub(super) standard: bool,
    pub(super) legacy: bool,
    /// `RateLimit-Policy` listing every enforced rule: what most responses
    /// send.
    pub(super) policy: Option<http::HeaderValue>,
    /// How many rules are enforced (not shadow).
    pub(super) enforced: usize,
}
