use std::fmt;

use crate::rejection::{LimitKind, Reason, Rejected};

/// The error of [`RateLimitErrorService`](super::RateLimitErrors): the request
/// was rejected. Carries everything the HTTP rejection would have said.
#[derive(Debug, Clone)]
pub struct RateLimited(pub Rejected);

impl fmt::Display for RateLimited {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.reason {
            Reason::Limited => match self.0.kind {
                LimitKind::Concurrency => {
                    write!(f, "concurrency limit \"{}\" reached", self.0.rule)
                }
                _ => write!(f, "rate limit \"{}\" exceeded", self.0.rule),
            },
            Reason::TooCostly => write!(
                f,
                "request costs more than rule \"{}\" allows at once",
                self.0.rule
            ),
            Reason::MissingKey => write!(f, "request has no key for rule \"{}\"", self.0.rule),
            Reason::Denied => write!(f, "access denied by list \"{}\"", self.0.rule),
            Reason::Blocked => write!(
                f,
                "blocked by \"{}\" after repeated violations",
                self.0.rule
            ),
            Reason::ReadOnly => {
                write!(f, "service is read-only for now (rule \"{}\")", self.0.rule)
            }
        }
    }
}

impl std::error::Error for RateLimited {}
