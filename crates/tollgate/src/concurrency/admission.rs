//! A request's admission, written once: its key, weight and class, then
//! each limit in turn — the per-key limit (or a turn in its key's queue),
//! then the service's (fixed or adaptive).
//!
//! [`Limits::start`] reads the request and takes the admission as far as
//! the store answers at once ([`Limits::advance`]): on the in-memory
//! store, all the way. Where a limit needs I/O, or the request must wait
//! its turn, it stops with what it waits for ([`Io`]), and
//! [`Limits::admit`] does that, then goes on through the same steps.

use std::sync::Arc;

use http::{Method, Request};
use tokio::time::Instant;
use tollgate_core::{Acquire, ConcurrencyLimiter, Decision, Outcome, PinnedPermits, StoreError};

use super::adaptive::Adaptive;
use super::critical::Critical;
use super::limits::{Limits, PlanLimit, ServiceLimit, StoreLimit, SERVICE_KEY};
use super::permit::{Held, Holding, Permit, Release};
use super::respond::{Items, Responder};
use crate::cost::Cost;
use crate::key::{KeyBuf, KeyExtractor, Keyed};
use crate::policy::Access;
use crate::rejection::{is_grpc, LimitKind, Reason, Rejected};

/// A request let in: its permit (if any limit granted one), the header
/// items, and when it started (for an adaptive limit's samples).
#[derive(Debug)]
pub(crate) struct Admitted {
    /// The permit, or (for an upgrade) the slot offered to the handler.
    pub(crate) permit: Option<Holding>,
    pub(crate) items: Items,
    pub(crate) started: super::stamp::Stamp,
    /// An upgrade's share of the adaptive limit, held apart from the
    /// permit the handler may take, until the response's head.
    pub(crate) adaptive: Option<AdaptiveHold>,
}

impl Admitted {
    /// Caps the permit's lifetime where the layer does, from now (its
    /// admission).
    pub(crate) fn cap(&mut self, responder: &Responder) {
        if let (Some((max, _)), Some(holding)) = (&responder.lifetime, self.permit.as_mut()) {
            // A cap too far to name is none.
            if let Some(until) = tokio::time::Instant::now().checked_add(*max) {
                holding.cap(until);
            }
        }
    }

    /// When the permit's lifetime ends, where it is capped (an upgrade's
    /// too, while its handler has not taken it).
    pub(crate) fn expires_at(&self) -> Option<tokio::time::Instant> {
        self.permit.as_ref()?.expires_at()
    }

    /// Readies an admitted request for its call: for an upgrade, when the
    /// layer offers upgrades, its permit offered to the handler.
    pub(crate) fn offer<B>(&mut self, responder: &Responder, req: &mut Request<B>) {
        if responder.upgrades {
            self.offer_upgrade(responder.adaptive.as_ref(), req);
        }
    }

    /// For an upgrade request, when the layer offers upgrades: the permit
    /// moves to a slot in the request's extensions, for the handler to
    /// keep for the connection's life. Its adaptive-limit share stays
    /// here and goes back at the response's head, as every request's does
    /// (an upgraded connection may live for hours).
    pub(crate) fn offer_upgrade<B>(
        &mut self,
        adaptive: Option<&Arc<Adaptive>>,
        req: &mut Request<B>,
    ) {
        if !crate::rejection::is_upgrade(req) {
            return;
        }
        if let Some(a) = adaptive {
            let permits = self.take_adaptive();
            if permits > 0 {
                self.adaptive = Some(AdaptiveHold {
                    adaptive: Arc::clone(a),
                    permits,
                });
            }
        }
        Holding::attach(&mut self.permit, req);
    }

    /// The adaptive limit's permits the request's permit holds, taken out
    /// of it (0: none).
    pub(crate) fn take_adaptive(&mut self) -> u32 {
        match self.permit.as_mut() {
            Some(Holding::Permit(p)) => p.held_mut().take_adaptive(),
            _ => 0,
        }
    }
}

/// Permits of an adaptive limit, given back when dropped.
#[derive(Debug)]
pub(crate) struct AdaptiveHold {
    adaptive: Arc<Adaptive>,
    permits: u32,
}

impl Drop for AdaptiveHold {
    fn drop(&mut self) {
        self.adaptive.release(self.permits);
    }
}

// Returned by value once per request; boxing the large variant would cost
// the fast path an allocation.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Admission {
    Go(Admitted),
    Reject(Rejected, Items),
    /// Needs I/O or a wait in the queue: [`Limits::admit`] goes on
    /// (boxed: the fast path returns the other two).
    Defer(Box<(Pending, Io)>),
}

/// An admission under way: what it read from the request, and the
/// per-key limit's answer once it has one.
pub(crate) struct Pending {
    pub(super) key: KeyBuf,
    pub(super) permits: u32,
    pub(super) critical: bool,
    pub(super) grpc: bool,
    /// The request's plan ([`PlanSet::index`](crate::policy::plan::PlanSet::index)).
    pub(super) plan: u8,
    /// Whether the per-key limit applies (a keyless or allow-listed
    /// request skips it).
    pub(super) keyed: bool,
    /// The per-key limit's answer.
    pub(super) per_key: Option<Step>,
}

/// What an admission waits for.
pub(crate) enum Io {
    /// The per-key limit's acquire.
    PerKey,
    /// A turn in the key's queue: others wait for the key, or the limit is
    /// full (its answer, when the request asked it first).
    Queue(Option<Decision>),
    /// The fixed service limit's acquire; the per-key lease is held.
    Service(Permit),
}

/// The outcome of one limit's acquire.
pub(crate) enum Step {
    Granted(Option<tollgate_core::Lease>, Decision),
    /// Let through without a permit of this limit: a shadow refusal (with
    /// its decision), a store fault, a request the limit does not apply to
    /// (keyless, allow-listed; no service limit).
    Pass(Option<Decision>),
    Reject(Reason, Decision),
    /// Refused for now, and the queue may hold the request.
    Wait(Decision),
}

impl Step {
    /// Whether the request goes on to the next limit.
    fn admits(&self) -> bool {
        matches!(self, Step::Granted(..) | Step::Pass(_))
    }

    fn decision(&self) -> Option<Decision> {
        match self {
            Step::Granted(_, d) | Step::Reject(_, d) | Step::Wait(d) => Some(*d),
            Step::Pass(d) => *d,
        }
    }
}

fn is_safe(method: &Method) -> bool {
    matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
}

impl<K, C, P, L> Limits<K, C, P, L>
where
    L: ConcurrencyLimiter,
{
    /// The header items of a request decided `per_key` by the per-key
    /// limit (the service limit's item is set once it decides); none where
    /// the layer sends no headers.
    #[inline(always)]
    fn items(&self, plan: &PlanLimit, per_key: Option<Decision>) -> Items {
        if !plan.responder.headers.standard {
            return Items::new(0);
        }
        let mut items = Items::new(if self.service.is_some() { 2 } else { 1 });
        items.set(0, u64::from(plan.max), per_key);
        if let Some(ServiceLimit::Adaptive(a)) = &self.service {
            // Its `q` is in the policy even when it is not decided.
            items.set(1, u64::from(a.limit()), None);
        }
        items
    }

    fn rejected(
        &self,
        rule: &Arc<str>,
        reason: Reason,
        grpc: bool,
        d: Option<Decision>,
    ) -> Rejected {
        Rejected {
            rule: Arc::clone(rule),
            kind: LimitKind::Concurrency,
            reason,
            decision: d,
            grpc,
        }
    }

    /// The per-key limit's key counted apart by the store
    /// ([`StoreLimit::pinned`]), pinned at the first request: where the
    /// key is fixed ([`KeyExtractor::is_fixed`]), no queue waits by key,
    /// and the store pins.
    #[inline]
    fn pinned<B>(&self, req: &Request<B>) -> Option<&PinnedPermits>
    where
        K: KeyExtractor<B>,
    {
        // (Known when compiled for most extractors: no check at all.)
        if !self.key.is_fixed() {
            return None;
        }
        self.per_key.pinned.get_or_init(|| self.pin(req)).as_ref()
    }

    #[cold]
    fn pin<B>(&self, req: &Request<B>) -> Option<PinnedPermits>
    where
        K: KeyExtractor<B>,
    {
        if self.queue.is_some() {
            return None;
        }
        let mut key = KeyBuf::new();
        self.key.extract(req, &mut key)?;
        self.per_key.limiter.pin(key.as_bytes())
    }

    /// Reads one store acquire: granted, let through, refused, or (when
    /// `queue` and the queue exists) waiting.
    #[inline(always)]
    pub(super) fn step(&self, result: Result<Acquire, StoreError>, queue: bool) -> Step {
        let acquire = match result {
            Ok(a) => a,
            Err(error) => {
                self.metrics.store_error.increment(1);
                crate::observe::store_fault("concurrency", &self.per_key.name, &error);
                if !self.refuse_on_store_error {
                    return Step::Pass(None);
                }
                // As a closed store answers: no permit, retry in a second.
                let max = u64::from(self.per_key.limiter.rule().semaphore().max());
                return self.step(
                    Ok(Acquire {
                        decision: Decision::closed(max),
                        lease: None,
                    }),
                    false,
                );
            }
        };
        let d = acquire.decision;
        match d.outcome {
            Outcome::Allow { .. } => Step::Granted(acquire.lease, d),
            Outcome::Deny { .. } if queue && self.queue.is_some() && !self.shadow => Step::Wait(d),
            _ if self.shadow => {
                self.metrics.shadow_limited.increment(1);
                Step::Pass(Some(d))
            }
            Outcome::Deny { .. } => Step::Reject(Reason::Limited, d),
            Outcome::Never => Step::Reject(Reason::TooCostly, d),
        }
    }

    fn ceiling(&self, limit: &StoreLimit<L>, critical: bool) -> u32 {
        if critical {
            u32::MAX
        } else {
            limit.share
        }
    }

    fn count(&self, reason: Reason) {
        match reason {
            Reason::TooCostly => self.metrics.too_costly.increment(1),
            _ => self.metrics.limited.increment(1),
        }
    }

    /// Whether others wait in `key`'s queue (a non-critical request then
    /// goes behind them, not past).
    #[inline(always)]
    fn others_wait(&self, p: &Pending) -> bool {
        !p.critical
            && p.keyed
            && self
                .queue
                .as_ref()
                .is_some_and(|q| q.has_waiters(q.hash(p.key.raw_bytes())))
    }
}

impl<K, C, P, L> Limits<K, C, P, L>
where
    L: ConcurrencyLimiter,
    Self: Release,
{
    /// Reads `req` (the access lists, its key, read-only mode, its weight
    /// and class), then admits it as far as the store answers at once.
    pub(crate) fn start<B>(self: &Arc<Self>, req: &Request<B>, plan: u8) -> Admission
    where
        K: KeyExtractor<B>,
        C: Cost<B>,
        P: Critical<B>,
    {
        // Built where the admission keeps it: the key is written in place.
        let mut p = Pending {
            key: KeyBuf::new(),
            permits: 0,
            critical: false,
            // Read when it matters: for a refusal, or a deferred admission.
            grpc: false,
            plan,
            keyed: true,
            per_key: None,
        };
        // A keyless request let through, or one on an allow list, skips
        // the per-key limit only: the service limit and read-only mode
        // still apply.
        if let Some(listed) = &self.access {
            match listed.check(req) {
                Access::Unlisted => {}
                Access::Allowed => p.keyed = false,
                Access::Denied => {
                    let r = listed.denied(LimitKind::Concurrency, is_grpc(req));
                    return Admission::Reject(r, Items::new(0));
                }
            }
        }
        // A pinned key is not read: it is the same for every request.
        if p.keyed && self.pinned(req).is_none() {
            let m = &self.metrics;
            let extracted = self.key.extract(req, &mut p.key);
            match self.keying.resolve(
                extracted,
                &mut p.key,
                &self.per_key.name,
                Some((&m.unkeyed, &m.missing_key)),
            ) {
                Keyed::Key => {}
                Keyed::Skip => p.keyed = false,
                Keyed::Reject => {
                    let r =
                        self.rejected(&self.per_key.name, Reason::MissingKey, is_grpc(req), None);
                    return Admission::Reject(r, Items::new(0));
                }
            }
        }
        if let Some(ServiceLimit::Adaptive(a)) = &self.service {
            if !is_safe(req.method()) && a.degraded() && !self.shadow {
                self.metrics.read_only.increment(1);
                let d = Decision {
                    outcome: Outcome::Deny {
                        retry_after: a.retry_after(),
                    },
                    limit: u64::from(a.limit()),
                    remaining: 0,
                    reset_after: 0,
                };
                let r = self.rejected(&a.name, Reason::ReadOnly, is_grpc(req), Some(d));
                return Admission::Reject(r, Items::new(0));
            }
        }
        // Finish the key (hash it if it is long) once, here.
        p.key.as_bytes();
        // Permits are a u32: a cost above that is above any limit.
        p.permits = u32::try_from(self.cost.cost(req)).unwrap_or(u32::MAX);
        p.critical = self.critical.is_critical(req);
        match self.advance(p) {
            Admission::Reject(mut r, items) => {
                r.grpc = is_grpc(req);
                Admission::Reject(r, items)
            }
            Admission::Defer(mut deferred) => {
                deferred.0.grpc = is_grpc(req);
                Admission::Defer(deferred)
            }
            go => go,
        }
    }

    /// The admission's steps, as far as the store answers at once: the
    /// per-key limit (unless the request must queue), then the service
    /// limit, then [`complete`](Self::complete). Where one needs I/O or a
    /// turn in the queue, [`Admission::Defer`] says which.
    #[inline(always)]
    fn advance(self: &Arc<Self>, mut p: Pending) -> Admission {
        let step = match p.per_key.take() {
            Some(step) => step,
            None if !p.keyed => Step::Pass(None),
            None => {
                // Others wait for this key: join them (a critical request
                // tries first, at its full ceiling).
                if self.others_wait(&p) {
                    return Admission::Defer(Box::new((p, Io::Queue(None))));
                }
                let ceiling = self.plans.get(p.plan).ceiling(p.critical);
                let acquired = self
                    .per_key
                    .acquire_sync(p.key.raw_bytes(), p.permits, ceiling);
                match acquired.map(|result| self.step(result, true)) {
                    None => return Admission::Defer(Box::new((p, Io::PerKey))),
                    Some(Step::Wait(d)) => {
                        return Admission::Defer(Box::new((p, Io::Queue(Some(d)))))
                    }
                    Some(step) => step,
                }
            }
        };
        let guard = self.guard(&mut p.key, &step);
        // Only once the per-key limit let the request in: a refused
        // request must take nothing it would not give back.
        let service = match &self.service {
            Some(ServiceLimit::Fixed(limit)) if step.admits() => {
                let ceiling = self.ceiling(limit, p.critical);
                match limit.acquire_sync(SERVICE_KEY, p.permits, ceiling) {
                    Some(result) => Some(result),
                    None => {
                        p.per_key = Some(step);
                        return Admission::Defer(Box::new((p, Io::Service(guard))));
                    }
                }
            }
            _ => None,
        };
        self.complete(guard, step, service, &p)
    }

    /// Goes on with a deferred admission: does what it waits for (`io`),
    /// then the rest of its steps, through the store's futures where they
    /// need I/O.
    pub(crate) async fn admit(self: Arc<Self>, deferred: Box<(Pending, Io)>) -> Admission {
        let (mut p, mut io) = *deferred;
        // A queued wait is counted from here, the first acquire included.
        let arrived = Instant::now();
        loop {
            match io {
                // Others may have joined the key's queue since `start`
                // looked: a non-critical request goes behind them.
                Io::PerKey if self.others_wait(&p) => {
                    p.per_key = Some(self.wait_turn(&p, (arrived, None)).await);
                }
                Io::PerKey => {
                    // Not cut off at the queue's deadline: an idle key
                    // would be refused for a slow store (which its own
                    // timeout bounds); its time counts against the wait
                    // that may follow.
                    let ceiling = self.plans.get(p.plan).ceiling(p.critical);
                    let first = self
                        .per_key
                        .acquire(p.key.raw_bytes(), p.permits, ceiling)
                        .await;
                    p.per_key = Some(match self.step(first, true) {
                        Step::Wait(d) => self.wait_turn(&p, (arrived, Some(d))).await,
                        step => step,
                    });
                }
                Io::Queue(first) => {
                    p.per_key = Some(self.wait_turn(&p, (arrived, first)).await);
                }
                Io::Service(guard) => {
                    let step = p.per_key.take().unwrap_or(Step::Pass(None));
                    let Some(ServiceLimit::Fixed(limit)) = &self.service else {
                        return self.complete(guard, step, None, &p);
                    };
                    let ceiling = self.ceiling(limit, p.critical);
                    let result = limit.acquire(SERVICE_KEY, p.permits, ceiling).await;
                    return self.complete(guard, step, Some(result), &p);
                }
            }
            match self.advance(p) {
                Admission::Defer(next) => (p, io) = *next,
                done => return done,
            }
        }
    }

    /// The per-key lease `step` granted, in a guard that gives it back if
    /// the admission goes no further (a later limit refuses, or the
    /// request is cancelled while the next limit is asked).
    #[inline(always)]
    fn guard(self: &Arc<Self>, key: &mut KeyBuf, step: &Step) -> Permit {
        let per_key = match step {
            Step::Granted(lease, _) => *lease,
            _ => None,
        };
        // The key is kept for the release only where it is read: by a
        // store that finds a lease by its key, or to wake the key's queue.
        let keep = per_key.is_some()
            && (self.queue.is_some() || !self.per_key.limiter.releases_by_lease());
        let owner: Arc<dyn Release> = Arc::clone(self) as Arc<dyn Release>;
        let key = if keep {
            key.as_bytes().into()
        } else {
            Box::default()
        };
        Permit::new(owner, Held::new(key, per_key))
    }

    /// Completes the admission once the per-key limit has answered
    /// (`step`) and the fixed service limit has (`service`): takes the
    /// adaptive limit's permits, gives the per-key lease back if a later
    /// limit refuses, and wraps what is held in a [`Permit`].
    #[inline(always)]
    fn complete(
        self: &Arc<Self>,
        mut guard: Permit,
        step: Step,
        service: Option<Result<Acquire, StoreError>>,
        p: &Pending,
    ) -> Admission {
        let (permits, critical, grpc) = (p.permits, p.critical, p.grpc);
        let limit = self.plans.get(p.plan);
        let mut items = self.items(limit, step.decision());
        match step {
            Step::Granted(..) | Step::Pass(_) => {}
            Step::Reject(reason, d) => {
                self.count(reason);
                // The plan's limit (the store rule's is the largest plan's).
                let d = Decision {
                    limit: u64::from(limit.max),
                    ..d
                };
                let r = self.rejected(&self.per_key.name, reason, grpc, Some(d));
                return Admission::Reject(r, items);
            }
            Step::Wait(d) => {
                self.count(Reason::Limited);
                let d = Decision {
                    limit: u64::from(limit.max),
                    ..d
                };
                let r = self.rejected(&self.per_key.name, Reason::Limited, grpc, Some(d));
                return Admission::Reject(r, items);
            }
        }
        let (name, step) = match (&self.service, service) {
            (Some(ServiceLimit::Fixed(limit)), Some(result)) => {
                let step = self.step(result, false);
                let q = u64::from(limit.limiter.rule().semaphore().max());
                items.set(1, q, step.decision());
                (Some(&limit.name), step)
            }
            (Some(ServiceLimit::Adaptive(a)), _) => {
                let share = if critical { None } else { self.share };
                let d = a.try_acquire(permits, share);
                items.set(1, u64::from(a.limit()), Some(d));
                let step = match d.outcome {
                    Outcome::Allow { .. } => {
                        guard.held_mut().set_adaptive(permits);
                        Step::Granted(None, d)
                    }
                    _ if self.shadow => {
                        self.metrics.shadow_limited.increment(1);
                        Step::Pass(Some(d))
                    }
                    Outcome::Deny { .. } => Step::Reject(Reason::Limited, d),
                    Outcome::Never => Step::Reject(Reason::TooCostly, d),
                };
                (Some(&a.name), step)
            }
            _ => (None, Step::Pass(None)),
        };
        match step {
            Step::Granted(lease, _) => {
                if let Some(lease) = lease {
                    guard.held_mut().set_service(lease);
                }
            }
            Step::Reject(reason, d) => {
                self.count(reason);
                drop(guard);
                let name = name.unwrap_or(&self.per_key.name);
                let r = self.rejected(name, reason, grpc, Some(d));
                return Admission::Reject(r, items);
            }
            Step::Pass(_) | Step::Wait(_) => {}
        }
        self.metrics.allowed.increment(1);
        let permit = if guard.held_mut().is_empty() {
            None
        } else {
            let weight = guard.held_mut().set_counted();
            self.metrics.in_flight.increment(f64::from(weight));
            Some(guard)
        };
        Admission::Go(Admitted {
            permit: permit.map(Holding::Permit),
            items,
            started: self.started(),
            adaptive: None,
        })
    }

    fn started(&self) -> super::stamp::Stamp {
        match self.service {
            Some(ServiceLimit::Adaptive(_)) => super::stamp::Stamp::at(Instant::now()),
            _ => super::stamp::Stamp::NONE,
        }
    }
}
