//! What every clone of a concurrency layer shares, and the admission of a
//! request: key, weight, class, then each limit in turn.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response};
use tokio::time::Instant;
use tollgate_core::{Acquire, ConcurrencyLimiter, Decision, Outcome, StoreError};

use super::adaptive::Adaptive;
use super::permit::{Held, Holding, Permit, Release};
use super::queue::Queue;
use crate::cost::Cost;
use crate::headers::{ConcurrencyHeaders, Item};
use crate::key::{KeyBuf, KeyExtractor, Keyed, Keying};
use crate::observe::ConcurrencyMetrics;
use crate::policy::access::Listed;
use crate::policy::plan::PlanSet;
use crate::policy::Access;
use crate::rejection::{is_grpc, LimitKind, Reason, Rejected, Rendered};

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

pub(crate) type RejectFn = Arc<dyn Fn(&Rejected) -> Response<Bytes> + Send + Sync>;
pub(crate) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// The key every request shares under the service-wide limit.
pub(crate) const SERVICE_KEY: &[u8] = b"\x00service";

/// What a plan sets of the per-key limit: its most permits (a ceiling
/// under the rule's max, which is the largest plan's), the ceiling of its
/// non-critical requests, and its headers and rejection.
pub(crate) struct PlanLimit {
    pub(crate) max: u32,
    pub(crate) share: u32,
    pub(crate) responder: Arc<Responder>,
}

impl PlanLimit {
    fn ceiling(&self, critical: bool) -> u32 {
        if critical {
            self.max
        } else {
            self.share
        }
    }
}

/// A limit kept in the store.
pub(crate) struct Slot<L> {
    pub(crate) limiter: L,
    pub(crate) name: Arc<str>,
    /// The ceiling of non-critical requests.
    pub(crate) share: u32,
}

pub(crate) enum ServiceLimit<L> {
    Fixed(Slot<L>),
    Adaptive(Arc<Adaptive>),
}

/// Everything a response future needs after admission.
pub(crate) struct Responder {
    pub(crate) headers: ConcurrencyHeaders,
    pub(crate) rejection: Option<RejectFn>,
    /// The default rejections of the per-key and the service limit.
    pub(crate) rendered: [Rendered; 2],
    pub(crate) adaptive: Option<Arc<Adaptive>>,
    pub(crate) name: Arc<str>,
    /// Offer upgrade requests' permits to their handlers.
    pub(crate) upgrades: bool,
    /// Whether decisions are also counted by route.
    #[cfg_attr(not(feature = "axum"), allow(dead_code))]
    pub(crate) route_label: bool,
}

impl Responder {
    /// Counts `admission` of `req` by route, when the layer does: what was
    /// decided (a deferred admission is counted when it resolves).
    pub(crate) fn count_route<B>(&self, req: &Request<B>, admission: &Admission) {
        #[cfg(feature = "axum")]
        if self.route_label {
            let outcome = match admission {
                // Let through holding nothing (shadow mode, a store fault,
                // no key): not the limit's admission.
                Admission::Go(a) if a.permit.is_none() => return,
                Admission::Go(_) => "allowed",
                Admission::Reject(r, _) => match r.reason {
                    Reason::Limited => "limited",
                    Reason::TooCostly => "too_costly",
                    // Not a limit's decision.
                    _ => return,
                },
                Admission::Defer(_) => return,
            };
            crate::observe::count_route(&self.name, req, outcome);
        }
        #[cfg(not(feature = "axum"))]
        let _ = (req, admission);
    }

    pub(crate) fn reject(&self, rejected: &Rejected, items: &Items) -> Response<Bytes> {
        let mut res = match &self.rejection {
            Some(f) if !rejected.grpc => f(rejected),
            _ => {
                let which = usize::from(*rejected.rule != *self.name);
                match self.rendered.get(which) {
                    Some(r) => r.render(rejected),
                    None => rejected.to_problem_response(),
                }
            }
        };
        // The refusing limit's hint (a read-only refusal has no item).
        if let Some(secs) = rejected.retry_after_secs() {
            let _ = res
                .headers_mut()
                .try_insert(http::header::RETRY_AFTER, http::HeaderValue::from(secs));
        }
        self.headers.apply(res.headers_mut(), items.as_slice());
        crate::rejection::mark(res)
    }
}

/// The header items of one request: the per-key limit, then the service's.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Items {
    items: [Item; 2],
    len: usize,
}

impl Items {
    fn new(len: usize) -> Self {
        Self {
            items: [Item::default(); 2],
            len,
        }
    }

    fn set(&mut self, i: usize, q: u64, decision: Option<Decision>) {
        if let Some(item) = self.items.get_mut(i) {
            *item = Item::new(q, decision);
        }
    }

    pub(crate) fn as_slice(&self) -> &[Item] {
        self.items.get(..self.len).unwrap_or_default()
    }
}

/// A request let in: its permit (if any limit granted one), the header
/// items, and when it started (for an adaptive limit's samples).
#[derive(Debug)]
pub(crate) struct Admitted {
    /// The permit, or (for an upgrade) the slot offered to the handler.
    pub(crate) permit: Option<Holding>,
    pub(crate) items: Items,
    pub(crate) started: Option<Instant>,
    /// An upgrade's share of the adaptive limit, held apart from the
    /// permit the handler may take, until the response's head.
    pub(crate) adaptive: Option<AdaptiveHold>,
}

impl Admitted {
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
        if !super::permit::is_upgrade(req) {
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
    /// Needs I/O or a wait in the queue; nothing is held.
    Defer(Deferred),
}

/// What the asynchronous admission starts from.
pub(crate) struct Deferred {
    key: KeyBuf,
    permits: u32,
    critical: bool,
    grpc: bool,
    /// Join the key's queue first (others wait, or the limit is full).
    queued: bool,
    /// The request's plan ([`PlanSet::index`]).
    plan: u8,
    /// Whether the per-key limit applies (a keyless request skips it).
    keyed: bool,
}

/// The outcome of one limit's acquire.
enum Step {
    Granted(Option<tollgate_core::Lease>, Decision),
    /// Let through without a permit (shadow denial, store fault).
    Pass(Option<Decision>),
    Reject(Reason, Decision),
    /// Denied for now, and the queue may hold the request.
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

pub(crate) struct Shared<K, C, P, L> {
    pub(crate) key: K,
    pub(crate) cost: C,
    pub(crate) critical: P,
    /// The per-key limit's store binding; its max is the largest plan's,
    /// and each plan's max is a ceiling under it.
    pub(crate) per_key: Slot<L>,
    pub(crate) plans: PlanSet<PlanLimit>,
    pub(crate) service: Option<ServiceLimit<L>>,
    pub(crate) queue: Option<Arc<Queue>>,
    pub(crate) keying: Keying,
    pub(crate) shadow: bool,
    pub(crate) metrics: ConcurrencyMetrics,
    /// The share of non-critical traffic, for the adaptive limit.
    pub(crate) share: Option<f64>,
    pub(crate) access: Option<Listed>,
    /// Refuse on a store error, as a closed store does (else admit).
    pub(crate) refuse_on_store_error: bool,
}

fn is_safe(method: &Method) -> bool {
    matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
}

impl<K, C, P, L> Shared<K, C, P, L>
where
    L: ConcurrencyLimiter,
{
    fn items(&self, plan: &PlanLimit) -> Items {
        let mut items = Items::new(if self.service.is_some() { 2 } else { 1 });
        items.set(0, u64::from(plan.max), None);
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

    /// Reads one store acquire: granted, let through, refused, or (when
    /// `queue` and the queue exists) waiting.
    #[inline(always)]
    fn step(&self, result: Result<Acquire, StoreError>, queue: bool) -> Step {
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

    fn ceiling(&self, slot: &Slot<L>, critical: bool) -> u32 {
        if critical {
            u32::MAX
        } else {
            slot.share
        }
    }

    fn count(&self, reason: Reason) {
        match reason {
            Reason::TooCostly => self.metrics.too_costly.increment(1),
            _ => self.metrics.limited.increment(1),
        }
    }
}

impl<K, C, P, L> Shared<K, C, P, L>
where
    L: ConcurrencyLimiter,
    Self: Release,
{
    /// Admits `req` without waiting when the store needs no I/O and the
    /// request need not queue; otherwise defers.
    pub(crate) fn start<B>(self: &Arc<Self>, req: &Request<B>, plan: u8) -> Admission
    where
        K: KeyExtractor<B>,
        C: Cost<B>,
        P: Critical<B>,
    {
        // A keyless request let through, or one on an allow list, skips
        // the per-key limit only: the service limit and read-only mode
        // still apply.
        let mut keyed = true;
        if let Some(listed) = &self.access {
            match listed.check(req) {
                Access::Unlisted => {}
                Access::Allowed => keyed = false,
                Access::Denied => {
                    let r = listed.denied(LimitKind::Concurrency, is_grpc(req));
                    return Admission::Reject(r, Items::new(0));
                }
            }
        }
        let mut key = KeyBuf::new();
        if keyed {
            let m = &self.metrics;
            let extracted = self.key.extract(req, &mut key);
            match self.keying.resolve(
                extracted,
                &mut key,
                &self.per_key.name,
                Some((&m.unkeyed, &m.missing_key)),
            ) {
                Keyed::Key => {}
                Keyed::Skip => keyed = false,
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
        // Permits are a u32: a cost above that is above any limit anyway.
        let permits = u32::try_from(self.cost.cost(req)).unwrap_or(u32::MAX);
        let critical = self.critical.is_critical(req);
        // Finish the key (hash it if it is long) once, here.
        key.as_bytes();
        let deferred = |key, queued| {
            Admission::Defer(Deferred {
                key,
                permits,
                critical,
                grpc: is_grpc(req),
                queued,
                plan,
                keyed,
            })
        };
        let step = if keyed {
            if let Some(q) = &self.queue {
                // Others wait for this key: join them (a critical request
                // tries first, at its full ceiling).
                if !critical && q.has_waiters(q.hash(key.as_bytes())) {
                    return deferred(key, true);
                }
            }
            let ceiling = self.plans.get(plan).ceiling(critical);
            let Some(result) = self
                .per_key
                .limiter
                .acquire_sync(key.as_bytes(), permits, ceiling)
            else {
                return deferred(key, false);
            };
            let step = self.step(result, true);
            if matches!(step, Step::Wait(_)) {
                return deferred(key, true);
            }
            step
        } else {
            Step::Pass(None)
        };
        let service = match &self.service {
            // Only once the per-key limit let the request in: a refused
            // request must take nothing it would not give back.
            Some(ServiceLimit::Fixed(slot)) if step.admits() => {
                let ceiling = self.ceiling(slot, critical);
                match slot.limiter.acquire_sync(SERVICE_KEY, permits, ceiling) {
                    Some(result) => Some(result),
                    None => {
                        // A store that answers one limit at once answers
                        // both; should it not, start over asynchronously.
                        drop(self.guard(&mut key, &step));
                        return deferred(key, false);
                    }
                }
            }
            _ => None,
        };
        let guard = self.guard(&mut key, &step);
        // Whether the request is gRPC matters only to a rejection.
        match self.finish(guard, step, service, (permits, critical, plan), false) {
            Admission::Reject(mut r, items) => {
                r.grpc = is_grpc(req);
                Admission::Reject(r, items)
            }
            other => other,
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
    fn finish(
        self: &Arc<Self>,
        mut guard: Permit,
        step: Step,
        service: Option<Result<Acquire, StoreError>>,
        (permits, critical, plan): (u32, bool, u8),
        grpc: bool,
    ) -> Admission {
        let limit = self.plans.get(plan);
        let mut items = self.items(limit);
        items.set(0, u64::from(limit.max), step.decision());
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
            (Some(ServiceLimit::Fixed(slot)), Some(result)) => {
                let step = self.step(result, false);
                let q = u64::from(slot.limiter.rule().semaphore().max());
                items.set(1, q, step.decision());
                (Some(&slot.name), step)
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

    fn started(&self) -> Option<Instant> {
        matches!(self.service, Some(ServiceLimit::Adaptive(_))).then(Instant::now)
    }

    /// Admits a deferred request: acquires through the store's futures and
    /// waits in the queue if it must.
    pub(crate) async fn admit(self: Arc<Self>, d: Deferred) -> Admission {
        let Deferred {
            mut key,
            permits,
            critical,
            grpc,
            queued,
            plan,
            keyed,
        } = d;
        // A queued wait is counted from here, the first acquire included.
        let arrived = Instant::now();
        let limit = self.plans.get(plan);
        let ceiling = limit.ceiling(critical);
        // Others may have joined the key's queue since `start` looked: a
        // non-critical request goes behind them, not past.
        let queued = queued
            || (!critical
                && keyed
                && self
                    .queue
                    .as_ref()
                    .is_some_and(|q| q.has_waiters(q.hash(key.as_bytes()))));
        let step = if !keyed {
            Step::Pass(None)
        } else if queued {
            self.wait_turn(
                &mut key,
                permits,
                (ceiling, limit.max),
                critical,
                (arrived, None),
            )
            .await
        } else {
            // Not cut off at the queue's deadline: an idle key would be
            // refused for a slow store (which its own timeout bounds); its
            // time counts against the wait that may follow.
            let first = self
                .per_key
                .limiter
                .acquire(key.as_bytes(), permits, ceiling)
                .await;
            match self.step(first, true) {
                Step::Wait(d) => {
                    self.wait_turn(
                        &mut key,
                        permits,
                        (ceiling, limit.max),
                        critical,
                        (arrived, Some(d)),
                    )
                    .await
                }
                step => step,
            }
        };
        let guard = self.guard(&mut key, &step);
        let service = match &self.service {
            Some(ServiceLimit::Fixed(slot)) if step.admits() => Some(
                slot.limiter
                    .acquire(SERVICE_KEY, permits, self.ceiling(slot, critical))
                    .await,
            ),
            _ => None,
        };
        self.finish(guard, step, service, (permits, critical, plan), grpc)
    }

    /// Waits in `key`'s queue until the head of it gets a permit, the wait
    /// runs out (`max_wait` after the request `arrived`; `first` is what its
    /// first acquire answered, if it made one; an acquire still
    /// in flight then included: it is given up, and a lease it got goes
    /// back), or the queue is full. A critical request tries whenever
    /// it wakes, wherever it stands: the reserve is for it, and a
    /// non-critical head held to its share must not keep it waiting.
    async fn wait_turn(
        &self,
        key: &mut KeyBuf,
        permits: u32,
        (ceiling, max): (u32, u32),
        critical: bool,
        (arrived, first): (Instant, Option<Decision>),
    ) -> Step {
        let Some(queue) = &self.queue else {
            return Step::Pass(None);
        };
        let limiter = &self.per_key.limiter;
        // What a refusal reports: the last acquire's answer, if any.
        let refused = |last: Option<Decision>| {
            let d = last.map_or_else(|| timed_out(limiter, max), |d| with_hint(d, limiter));
            Step::Reject(Reason::Limited, d)
        };
        let hash = queue.hash(key.as_bytes());
        let deadline = arrived.checked_add(queue.max_wait).unwrap_or(arrived);
        let Some(place) = queue.join(hash, critical) else {
            self.metrics.queue_full.increment(1);
            let peek = limiter.acquire(key.as_bytes(), 0, ceiling).await.ok();
            return refused(peek.map(|a| a.decision));
        };
        // The first acquire's answer, until a later one says more.
        let mut last = first;
        // Backs off while nothing here wakes it (see `queue`).
        let mut recheck = queue.recheck;
        let mut on_timer = false;
        loop {
            let head = place.is_head();
            if Instant::now() >= deadline {
                // No acquire sent to be given up at once.
                self.metrics.queue_timeout.increment(1);
                return refused(last);
            }
            if head || critical {
                if on_timer {
                    self.metrics.rechecks.increment(1);
                }
                let acquire = limiter.acquire(key.as_bytes(), permits, ceiling);
                let Ok(got) = tokio::time::timeout_at(deadline, acquire).await else {
                    self.metrics.queue_timeout.increment(1);
                    return refused(last);
                };
                match self.step(got, true) {
                    Step::Wait(d) => last = Some(d),
                    Step::Granted(lease, d) => {
                        self.metrics.queued.increment(1);
                        return Step::Granted(lease, d);
                    }
                    other => return other,
                }
            }
            let now = Instant::now();
            if now >= deadline {
                self.metrics.queue_timeout.increment(1);
                return refused(last);
            }
            // Only those that try look again on a timer (for releases this
            // process does not see); the rest wait to be woken.
            let until = if head || critical {
                deadline.min(now.checked_add(recheck).unwrap_or(deadline))
            } else {
                deadline
            };
            let woken = place.wait(until).await;
            on_timer = !woken;
            if on_timer && (head || critical) {
                recheck = recheck.saturating_mul(2);
            }
        }
    }
}

/// A queued request's refusal when its wait ran out before any acquire
/// answered.
fn timed_out<L: ConcurrencyLimiter>(limiter: &L, max: u32) -> Decision {
    with_hint(
        Decision {
            outcome: Outcome::Deny { retry_after: 0 },
            limit: u64::from(max),
            remaining: 0,
            reset_after: 0,
        },
        limiter,
    )
}

/// The decision with the rule's retry hint as its `retry_after`.
fn with_hint<L: ConcurrencyLimiter>(mut d: Decision, limiter: &L) -> Decision {
    d.outcome = Outcome::Deny {
        retry_after: limiter.rule().semaphore().retry_after(),
    };
    d
}

impl<K, C, P, L> Release for Shared<K, C, P, L>
where
    K: Send + Sync + 'static,
    C: Send + Sync + 'static,
    P: Send + Sync + 'static,
    L: ConcurrencyLimiter,
{
    fn release(&self, held: &mut Held) {
        if let Some(lease) = held.take_per_key() {
            let key = &*held.key;
            // The release is under way once called.
            let done = self.per_key.limiter.release(key, lease);
            if let Some(q) = &self.queue {
                wake_when_released(q, q.hash(key), done);
            }
        }
        match (&self.service, held.take_service()) {
            (Some(ServiceLimit::Fixed(slot)), Some(lease)) => {
                drop(slot.limiter.release(SERVICE_KEY, lease));
            }
            (Some(ServiceLimit::Adaptive(a)), _) => {
                let permits = held.take_adaptive();
                if permits > 0 {
                    a.release(permits);
                }
            }
            _ => {}
        }
        let counted = held.take_counted();
        if counted > 0 {
            self.metrics.in_flight.decrement(f64::from(counted));
        }
    }
}

/// Wakes the head of a key's queue once a release of that key is done: at
/// once for a store that released already (in memory), from a task when
/// the release is still on its way to Redis — so the waiter does not wake
/// to find the permit still held. Without waiters, nothing to wait for.
fn wake_when_released<F>(queue: &Arc<Queue>, key: u64, done: F)
where
    F: Future<Output = Result<(), StoreError>> + Send + 'static,
{
    if !queue.anyone_waiting() {
        return;
    }
    let later = Arc::clone(queue);
    crate::task::finish(async move {
        let _ = done.await;
        later.wake(key);
    });
}
