//! One task per store releases and renews the leases it granted.
//!
//! Why a task: a permit's guard releases from `Drop`, which cannot await,
//! so [`LeaseKeeper::release`] hands the release over at once and the task
//! performs it — however the caller's future fares. And long work must keep
//! its permits while a dead holder's lapse: the task renews, every third of
//! the rule's lease TTL, every lease its store granted and has not
//! released ([`LiveLeases`]), in batches — one script call per Redis key
//! (so per Cluster slot) carrying all of that key's leases, calls for
//! different keys in flight together on the multiplexed connection. No
//! timer per request.
//!
//! The task never waits for Redis itself: each batch of releases and each
//! renewal round is a task of its own, at most [`MAX_RELEASE_CALLS`]
//! script calls of releases in flight, so a slow Redis neither holds renewals back
//! behind releases nor makes one slow call hold up the rest. The queue is
//! bounded ([`MAX_QUEUE`] jobs), and so are the release batches under way
//! ([`MAX_PENDING_BATCHES`]): past either a release is dropped — its lease
//! is no longer renewed and lapses within its TTL — and counted
//! (`tollgate_lease_releases_dropped_total`), where an unbounded backlog
//! would grow with a Redis that cannot keep up. (A flush waits until no
//! batch is under way: for tests and shutdown, not under load.)
//!
//! When the store and all its limiters are dropped, the channel closes and
//! the task ends; what it held lapses within a lease TTL. A release or
//! renewal that fails (Redis down, breaker open) is counted and logged by
//! the backend at most once a second, and the lease lapses on its own.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, Notify, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tollgate_core::{Lease, StoreError, StoreErrorKind};

use crate::backend::Backend;
use crate::leases::{member, LiveLeases};
use crate::scripts::SemaphoreMode;
use crate::BoxFuture;

/// Most leases in one script call (a longer batch is split).
const MAX_BATCH: usize = 256;
/// Most script calls of one renewal round in flight.
const MAX_CALLS: usize = 64;
/// Most release calls in flight: on the multiplexed connection they are
/// pipelined, so a slow Redis (200 ms away) still takes thousands of
/// releases a second.
const MAX_RELEASE_CALLS: usize = 512;
/// Most jobs taken off the queue at once.
const MAX_DRAIN: usize = 1_024;
/// Most jobs waiting in the queue.
const MAX_QUEUE: usize = 65_536;
/// Most release batches under way (in flight or waiting for a call):
/// past it a batch is dropped, as a release past a full queue is — else
/// a Redis slow enough to fall behind but quick enough to keep its
/// breaker shut would grow the parked tasks without bound.
const MAX_PENDING_BATCHES: usize = 4_096;
/// How long the task sleeps when it has nothing to renew.
const IDLE: Duration = Duration::from_secs(3_600);

type Done = oneshot::Sender<Result<(), StoreError>>;

enum Job {
    Release {
        leases: Arc<LiveLeases>,
        key: String,
        lease: Lease,
        done: Done,
    },
    /// Renew this limiter's leases from now on.
    Watch(Weak<LiveLeases>),
    /// Answer once the releases queued before are done.
    Flush(oneshot::Sender<()>),
    /// Renew every lease now; answer when done.
    Renew(oneshot::Sender<()>),
}

/// The handle of a store's lease task; the task ends when every handle is
/// dropped.
#[derive(Debug, Clone)]
pub(crate) struct LeaseKeeper {
    jobs: mpsc::Sender<Job>,
    dropped: metrics::Counter,
    /// Whether the task's end was logged.
    gone_told: Arc<std::sync::atomic::AtomicBool>,
}

fn task_gone() -> StoreError {
    StoreError::new(
        StoreErrorKind::Unavailable,
        "the Redis store's lease task has stopped (its runtime shut down)",
    )
}

impl LeaseKeeper {
    /// Starts the task on the current Tokio runtime; `renew` says whether
    /// it renews on its own (every third of each rule's lease TTL).
    pub(crate) fn spawn(backend: Arc<Backend>, renew: bool) -> Self {
        let (jobs, queue) = mpsc::channel(MAX_QUEUE);
        tokio::spawn(keep(queue, backend, renew));
        Self {
            jobs,
            dropped: dropped_releases(),
            gone_told: Arc::default(),
        }
    }

    /// The task is gone (its runtime ended): said once, loudly; each
    /// release it cannot do is counted as dropped.
    fn gone(&self) -> StoreError {
        self.dropped.increment(1);
        if !self.gone_told.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "the Redis store's lease task has stopped: the runtime the store was built on \
                 has ended, so concurrency leases are no longer released or renewed — a \
                 finished request holds its permits for its lease TTL, and a request that runs \
                 longer than the TTL loses them (the limit can be exceeded); build the store on \
                 the runtime that serves"
            );
        }
        task_gone()
    }

    /// Starts renewing `leases`.
    pub(crate) fn watch(&self, leases: &Arc<LiveLeases>) {
        let job = Job::Watch(Arc::downgrade(leases));
        if let Err(mpsc::error::TrySendError::Full(job)) = self.jobs.try_send(job) {
            // Rare (a new limiter while the queue is full): not lost.
            let jobs = self.jobs.clone();
            tokio::spawn(async move { jobs.send(job).await });
        }
    }

    /// Hands the release of `lease` at `key` to the task at once; the
    /// future says when it is done, and dropping it cancels nothing.
    pub(crate) fn release(
        &self,
        leases: &Arc<LiveLeases>,
        key: String,
        lease: Lease,
    ) -> BoxFuture<Result<(), StoreError>> {
        leases.forget(&key, lease.id);
        let (done, answer) = oneshot::channel();
        // Recorded before it is sent (the task may answer at once), and
        // taken back if it cannot be.
        leases.releasing(&key, lease);
        let sent = self.jobs.try_send(Job::Release {
            leases: Arc::clone(leases),
            key,
            lease,
            done,
        });
        if let Err(
            mpsc::error::TrySendError::Full(Job::Release { key, .. })
            | mpsc::error::TrySendError::Closed(Job::Release { key, .. }),
        ) = &sent
        {
            leases.released(key, std::iter::once(lease.id));
        }
        let sent = match sent {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full(_)) => {
                // Forgotten above, so no longer renewed: it lapses.
                self.dropped.increment(1);
                Err(StoreError::new(
                    StoreErrorKind::Unavailable,
                    "the lease task's queue is full; the lease lapses within its TTL",
                ))
            }
            Err(mpsc::error::TrySendError::Closed(_)) => Err(self.gone()),
        };
        Box::pin(async move {
            sent?;
            answer.await.unwrap_or_else(|_| Err(task_gone()))
        })
    }

    /// Waits until the releases handed over before this call are done.
    pub(crate) async fn flush(&self) {
        let (done, answer) = oneshot::channel();
        if self.jobs.send(Job::Flush(done)).await.is_ok() {
            let _ = answer.await;
        }
    }

    /// Renews every lease held now; returns when done.
    pub(crate) async fn renew_now(&self) {
        let (done, answer) = oneshot::channel();
        if self.jobs.send(Job::Renew(done)).await.is_ok() {
            let _ = answer.await;
        }
    }
}

struct Watched {
    leases: Weak<LiveLeases>,
    due: Instant,
}

/// `after` from now.
fn later(after: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(after).unwrap_or(now)
}

/// The releases under way: how many batches, and a wake-up when the last
/// one is done (for flushes).
#[derive(Default)]
struct Outstanding {
    batches: std::sync::atomic::AtomicUsize,
    idle: Notify,
}

impl Outstanding {
    /// Waits until no batch is under way.
    async fn settled(&self) {
        loop {
            let idle = self.idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            if self.batches.load(Ordering::Acquire) == 0 {
                return;
            }
            idle.await;
        }
    }
}

/// Counts a batch done, even if its task was cancelled.
struct BatchDone(Arc<Outstanding>);

impl Drop for BatchDone {
    fn drop(&mut self) {
        if self.0.batches.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

/// The task: jobs as they come, renewals when due. It starts work and goes
/// back to its queue: it never waits for Redis.
async fn keep(mut queue: mpsc::Receiver<Job>, backend: Arc<Backend>, renew: bool) {
    let mut watched: Vec<Watched> = Vec::new();
    let calls = Arc::new(Semaphore::new(MAX_RELEASE_CALLS));
    let outstanding = Arc::new(Outstanding::default());
    let timer = tokio::time::sleep(IDLE);
    tokio::pin!(timer);
    loop {
        tokio::select! {
            job = queue.recv() => {
                // Every handle is gone: so is the store.
                let Some(job) = job else { return };
                let mut jobs = vec![job];
                while jobs.len() < MAX_DRAIN {
                    match queue.try_recv() {
                        Ok(job) => jobs.push(job),
                        Err(_) => break,
                    }
                }
                handle(&backend, jobs, &mut watched, &calls, &outstanding);
            }
            () = &mut timer => {
                if renew {
                    renew_due(&backend, &mut watched);
                }
            }
        }
        match watched.iter().map(|w| w.due).min().filter(|_| renew) {
            Some(next) if timer.deadline() != next => timer.as_mut().reset(next),
            None if timer.is_elapsed() => timer.as_mut().reset(later(IDLE)),
            _ => {}
        }
    }
}

struct KeyReleases {
    leases: Arc<LiveLeases>,
    batch: Vec<(Lease, Done)>,
}

fn handle(
    backend: &Arc<Backend>,
    jobs: Vec<Job>,
    watched: &mut Vec<Watched>,
    calls: &Arc<Semaphore>,
    outstanding: &Arc<Outstanding>,
) {
    // By Redis key: one script call per key (and batch).
    let mut releases: HashMap<String, KeyReleases> = HashMap::new();
    let mut flushed = Vec::new();
    for job in jobs {
        match job {
            Job::Release {
                leases,
                key,
                lease,
                done,
            } => releases
                .entry(key)
                .or_insert_with(|| KeyReleases {
                    leases,
                    batch: Vec::new(),
                })
                .batch
                .push((lease, done)),
            Job::Watch(leases) => {
                watched.retain(|w| w.leases.strong_count() > 0);
                if let Some(l) = leases.upgrade() {
                    watched.push(Watched {
                        due: later(l.every),
                        leases,
                    });
                }
            }
            Job::Flush(done) => flushed.push(done),
            Job::Renew(done) => {
                let all: Vec<_> = watched.iter().filter_map(|w| w.leases.upgrade()).collect();
                let backend = Arc::clone(backend);
                tokio::spawn(async move {
                    for leases in all {
                        renew_round(&backend, leases).await;
                    }
                    let _ = done.send(());
                });
            }
        }
    }
    for (key, KeyReleases { leases, batch }) in releases {
        let mut batch = batch.into_iter().peekable();
        while batch.peek().is_some() {
            let chunk: Vec<(Lease, Done)> = batch.by_ref().take(MAX_BATCH).collect();
            if outstanding.batches.load(Ordering::Acquire) >= MAX_PENDING_BATCHES {
                // Forgotten already, so no longer renewed: they lapse.
                leases.released(&key, chunk.iter().map(|(lease, _)| lease.id));
                dropped(chunk);
                continue;
            }
            outstanding.batches.fetch_add(1, Ordering::AcqRel);
            let done = BatchDone(Arc::clone(outstanding));
            let (backend, leases, key) = (Arc::clone(backend), Arc::clone(&leases), key.clone());
            let calls = Arc::clone(calls);
            tokio::spawn(async move {
                let _done = done;
                // At most MAX_RELEASE_CALLS release calls in flight; the
                // rest wait here, not in the task's loop.
                let _call = calls.acquire_owned().await;
                release_batch(backend, leases, key, chunk).await;
            });
        }
    }
    if !flushed.is_empty() {
        let outstanding = Arc::clone(outstanding);
        tokio::spawn(async move {
            outstanding.settled().await;
            for done in flushed {
                let _ = done.send(());
            }
        });
    }
}

/// `tollgate_lease_releases_dropped_total{store="redis"}`.
fn dropped_releases() -> metrics::Counter {
    metrics::describe_counter!(
        "tollgate_lease_releases_dropped_total",
        "Concurrency lease releases dropped: the lease task had too many waiting (the leases lapse within their TTL)"
    );
    metrics::counter!("tollgate_lease_releases_dropped_total", "store" => "redis")
}

/// Drops a batch of releases that the task cannot take on: each lease
/// lapses within its TTL; counted, and each waiter told.
fn dropped(chunk: Vec<(Lease, Done)>) {
    let count = u64::try_from(chunk.len()).unwrap_or(u64::MAX);
    dropped_releases().increment(count);
    for (_, done) in chunk {
        let _ = done.send(Err(StoreError::new(
            StoreErrorKind::Unavailable,
            "too many releases under way; the lease lapses within its TTL",
        )));
    }
}

async fn release_batch(
    backend: Arc<Backend>,
    leases: Arc<LiveLeases>,
    key: String,
    batch: Vec<(Lease, Done)>,
) {
    let members: Vec<String> = batch.iter().map(|(lease, _)| member(lease)).collect();
    let result = leases
        .args
        .run(&backend, SemaphoreMode::Release, &key, 0, &members)
        .await
        .map(drop);
    // Answered (or failed: the leases lapse): acquires carry them no more.
    leases.released(&key, batch.iter().map(|(lease, _)| lease.id));
    for (_, done) in batch {
        let _ = done.send(result.clone());
    }
}

/// Starts a renewal round for every watched limiter that is due (unless
/// its last round is still running) and drops the limiters that are gone.
fn renew_due(backend: &Arc<Backend>, watched: &mut Vec<Watched>) {
    let now = Instant::now();
    watched.retain_mut(|w| {
        let Some(leases) = w.leases.upgrade() else {
            return false;
        };
        if w.due <= now {
            w.due = later(leases.every);
            if !leases.renewing.swap(true, Ordering::AcqRel) {
                let backend = Arc::clone(backend);
                tokio::spawn(async move {
                    let _round = Renewing(Arc::clone(&leases));
                    renew_round(&backend, leases).await;
                });
            }
        }
        true
    });
}

/// Marks a limiter's round over, even if the round was cancelled.
struct Renewing(Arc<LiveLeases>);

impl Drop for Renewing {
    fn drop(&mut self) {
        self.0.renewing.store(false, Ordering::Release);
    }
}

/// Renews every lease `leases` holds: one call per key and batch.
async fn renew_round(backend: &Arc<Backend>, leases: Arc<LiveLeases>) {
    let mut calls = JoinSet::new();
    for (key, held) in leases.snapshot() {
        for chunk in held.chunks(MAX_BATCH) {
            if calls.len() >= MAX_CALLS {
                calls.join_next().await;
            }
            calls.spawn(renew_batch(
                Arc::clone(backend),
                Arc::clone(&leases),
                key.clone(),
                chunk.to_vec(),
            ));
        }
    }
    while calls.join_next().await.is_some() {}
}

async fn renew_batch(
    backend: Arc<Backend>,
    leases: Arc<LiveLeases>,
    key: String,
    batch: Vec<Lease>,
) {
    let members: Vec<String> = batch.iter().map(member).collect();
    let Ok(reply) = leases
        .args
        .run(&backend, SemaphoreMode::Renew, &key, 0, &members)
        .await
    else {
        // Logged by the backend; the next round tries again.
        return;
    };
    // A lease gone from Redis (lapsed, or Redis lost it) is not renewed
    // again: a renewal never brings a lease back.
    for (lease, live) in batch.iter().zip(reply.flags()) {
        if !live {
            leases.forget(&key, lease.id);
        }
    }
}
