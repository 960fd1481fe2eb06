//! Cost measured after the fact (000 §12: expensive business logic): a
//! request is admitted on an estimate, and once its response is known
//! what it really cost is settled — the difference given back, or owed
//! and paid by the key's next request.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use http::Response;
use tokio::time::Instant;

use crate::key::KeyBytes;

/// How a [`RateLimitLayer`](super::RateLimitLayer) measures what a
/// request really cost, once its response is known (see
/// [`charge_after`](super::RateLimitLayerBuilder::charge_after)). A
/// response that carries an [`ActualCost`] is charged that, whatever the
/// measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Measure {
    /// The handler's time, from the call to the response's head: one unit
    /// per `per` (rounded up).
    Elapsed {
        /// The time one unit buys.
        per: Duration,
    },
    /// The response's length as its head declares it (`Content-Length`,
    /// or an exact size hint): one unit per `per` bytes (rounded up). A
    /// streamed body of unknown length counts as 0 bytes: report its cost
    /// with [`ActualCost`].
    ResponseBytes {
        /// The bytes one unit buys.
        per: u64,
    },
    /// Only what the handler reports with [`ActualCost`] (a response
    /// without one costs its estimate).
    Reported,
}

/// What a request really cost, in the rule's units: a handler puts it in
/// its response's extensions (e.g. the rows a report read), for a layer
/// built with [`charge_after`](super::RateLimitLayerBuilder::charge_after).
///
/// ```
/// use tollgate::rate_limit::ActualCost;
///
/// let mut response = http::Response::new("the report");
/// response.extensions_mut().insert(ActualCost(40));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActualCost(pub u64);

impl Measure {
    /// What `response`, answered `elapsed` after its call, cost.
    fn cost<B>(self, response: &Response<B>, elapsed: Duration) -> Option<u64> {
        if let Some(ActualCost(n)) = response.extensions().get::<ActualCost>() {
            return Some(*n);
        }
        match self {
            Measure::Elapsed { per } => {
                let units = elapsed.as_nanos().div_ceil(per.as_nanos().max(1));
                Some(u64::try_from(units).unwrap_or(u64::MAX))
            }
            Measure::ResponseBytes { per } => {
                let bytes = response
                    .headers()
                    .get(http::header::CONTENT_LENGTH)
                    .and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok())
                    .unwrap_or(0);
                Some(bytes.div_ceil(per.max(1)))
            }
            Measure::Reported => None,
        }
    }
}

/// Gives units to, or takes them from, a key of the rule's limiter
/// (without waiting for the store).
pub(crate) type Units = Arc<dyn Fn(&[u8], u64) + Send + Sync>;

/// The most keys a layer keeps debts for; a key's debt is at most this
/// many times the rule's capacity.
const MAX_DEBTORS: usize = 100_000;
const MAX_DEBT_CAPACITIES: u64 = 100;

/// What one layer's keys owe, and how it measures.
pub(crate) struct Debts {
    measure: Measure,
    capacity: u64,
    owed: Mutex<HashMap<Box<[u8]>, u64>>,
    /// Gives units back to the rule's limiter (a request that cost less
    /// than its estimate).
    refund: Units,
    /// Charges what fits now, when the table is full (best effort).
    charge: Units,
}

impl Debts {
    pub(crate) fn new(
        measure: Measure,
        capacity: u64,
        refund: Units,
        charge: Units,
    ) -> Self {
        Self {
            measure,
            capacity,
            owed: Mutex::default(),
            refund,
            charge,
        }
    }

    fn owed(&self) -> std::sync::MutexGuard<'_, HashMap<Box<[u8]>, u64>> {
        self.owed.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes what `key` owes, up to `room` (what the rule can charge on
    /// top of the request's own cost): the rest stays owed.
    pub(crate) fn take(&self, key: &[u8], room: u64) -> u64 {
        let mut owed = self.owed();
        let Some(debt) = owed.get_mut(key) else {
            return 0;
        };
        let paid = (*debt).min(room);
        *debt = debt.saturating_sub(paid);
        if *debt == 0 {
            owed.remove(key);
        }
        paid
    }

    /// `key` owes `units` more (at most 100 capacities in all); a full
    /// table charges what fits now instead.
    pub(crate) fn owe(&self, key: &[u8], units: u64) {
        if units == 0 {
            return;
        }
        let cap = self.capacity.saturating_mul(MAX_DEBT_CAPACITIES);
        let mut owed = self.owed();
        if let Some(debt) = owed.get_mut(key) {
            *debt = debt.saturating_add(units).min(cap);
            return;
        }
        if owed.len() < MAX_DEBTORS {
            owed.insert(key.into(), units.min(cap));
            return;
        }
        drop(owed);
        (self.charge)(key, units.min(self.capacity));
    }
}

/// One admitted request's settlement, for when its response is known.
pub(crate) struct Settle {
    debts: Arc<Debts>,
    key: KeyBytes,
    estimate: u64,
    /// What it paid of the key's debt (given back to the debt if the
    /// request is refused).
    paid: u64,
    started: Instant,
}

impl Settle {
    pub(crate) fn new(debts: Arc<Debts>, key: KeyBytes, estimate: u64, paid: u64) -> Self {
        Self {
            debts,
            key,
            estimate,
            paid,
            started: Instant::now(),
        }
    }

    /// The request was not charged (refused, or its store failed): what
    /// it took of the key's debt is owed again.
    pub(crate) fn unpaid(self) {
        let Self {
            debts, key, paid, ..
        } = self;
        if paid > 0 {
            let mut owed = debts.owed();
            let debt = owed.entry(key.as_bytes().into()).or_insert(0);
            *debt = debt.saturating_add(paid);
        }
    }

    /// Its response is known: a cost above the estimate is owed, one
    /// below it is given back.
    pub(crate) fn finish<B>(self, response: &Response<B>) {
        let Some(actual) = self.debts.measure.cost(response, self.started.elapsed()) else {
            return;
        };
        let key = self.key.as_bytes();
        if actual > self.estimate {
            self.debts.owe(key, actual.saturating_sub(self.estimate));
        } else if actual < self.estimate {
            (self.debts.refund)(key, self.estimate.saturating_sub(actual));
        }
    }
}
