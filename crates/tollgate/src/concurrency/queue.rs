//! A bounded FIFO queue per key, for requests that may wait a little for a
//! permit instead of being turned away at once.
//!
//! Only the request at the head of a key's queue tries to acquire (and
//! critical requests, wherever they stand: the reserve is theirs); a
//! release of that key wakes the head and the first critical waiter, and
//! the head leaving (got its permit, timed out, cancelled) wakes the next, so
//! a wake-up is never lost with the waiter that received it. Newcomers join behind the waiters instead of
//! overtaking them. Releases this process does not see (another instance
//! on a shared store, another layer on the same rule) are caught by the
//! head re-checking on a timer that backs off: `recheck`, then twice that,
//! and so on, so a request that waits its whole `max_wait` makes about
//! `1 + log2(max_wait / recheck)` store calls (5 for the usual tenth),
//! not one every `recheck` — a queue fills when its keys are saturated,
//! which is when a shared store is busiest.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;

/// Most requests waiting at once across all keys of one layer, so a flood
/// of distinct keys cannot grow the queue without bound.
pub(crate) const MAX_WAITING: usize = 100_000;

/// The keys' lines are kept in this many maps, each behind a lock of its
/// own (by the key's hash), so waiters of unrelated keys do not contend.
const SHARDS: usize = 16;

/// One waiter: its wake-up, and whether it is critical.
type Waiter = (Arc<Notify>, bool);
type Lines = HashMap<u64, VecDeque<Waiter>>;

#[derive(Debug)]
pub(crate) struct Queue {
    pub(crate) max_len: usize,
    pub(crate) max_wait: Duration,
    pub(crate) recheck: Duration,
    keys: Box<[Mutex<Lines>]>,
    waiting: AtomicUsize,
    hasher: RandomState,
    /// `tollgate_concurrency_queue_depth{rule}`: requests waiting now.
    depth: metrics::Gauge,
}

impl Queue {
    pub(crate) fn new(max_len: usize, max_wait: Duration, rule: &str) -> Self {
        metrics::describe_gauge!(
            "tollgate_concurrency_queue_depth",
            "Requests waiting in a tollgate concurrency queue, by rule"
        );
        Self {
            max_len,
            max_wait,
            // Often enough to notice a release elsewhere well within the
            // wait, rarely enough to cost nothing.
            recheck: (max_wait.checked_div(10).unwrap_or_default())
                .clamp(Duration::from_millis(5), Duration::from_millis(100)),
            keys: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            waiting: AtomicUsize::new(0),
            hasher: RandomState::new(),
            depth: metrics::gauge!("tollgate_concurrency_queue_depth", "rule" => rule.to_owned()),
        }
    }

    pub(crate) fn hash(&self, key: &[u8]) -> u64 {
        self.hasher.hash_one(key)
    }

    /// The shard that holds `key`'s line, locked.
    fn lock(&self, key: u64) -> MutexGuard<'_, Lines> {
        // The high bits: the map inside hashes the key again.
        let i = usize::try_from(key >> 60).unwrap_or(0) % SHARDS;
        match self.keys.get(i).or_else(|| self.keys.first()) {
            Some(m) => m.lock().unwrap_or_else(PoisonError::into_inner),
            None => unreachable_shards(),
        }
    }

    /// Whether anyone waits for `key` (cheap when nobody waits at all).
    #[inline]
    pub(crate) fn has_waiters(&self, key: u64) -> bool {
        self.waiting.load(Ordering::Acquire) > 0 && self.lock(key).contains_key(&key)
    }

    /// Joins the back of `key`'s queue; `None` when it is full.
    pub(crate) fn join(self: &Arc<Self>, key: u64, critical: bool) -> Option<Place> {
        let mut keys = self.lock(key);
        if self.waiting.load(Ordering::Acquire) >= MAX_WAITING {
            return None;
        }
        let line = keys.entry(key).or_default();
        if line.len() >= self.max_len {
            // Full (`max_len` is at least 1, so the line is not empty).
            return None;
        }
        let notify = Arc::new(Notify::new());
        line.push_back((Arc::clone(&notify), critical));
        self.waiting.fetch_add(1, Ordering::AcqRel);
        self.depth.increment(1.0);
        Some(Place {
            queue: Arc::clone(self),
            key,
            notify,
        })
    }

    /// Whether anyone waits at all.
    #[inline]
    pub(crate) fn anyone_waiting(&self) -> bool {
        self.waiting.load(Ordering::Acquire) > 0
    }

    /// Wakes the head of `key`'s queue and the first critical waiter
    /// behind it (a permit of that key was freed: a non-critical head held
    /// to its share may not use it, a critical waiter may). One each, so a
    /// release costs at most two acquires however many wait.
    pub(crate) fn wake(&self, key: u64) {
        if self.waiting.load(Ordering::Acquire) == 0 {
            return;
        }
        if let Some(line) = self.lock(key).get(&key) {
            let mut waiters = line.iter();
            if let Some((head, _)) = waiters.next() {
                head.notify_one();
            }
            if let Some((critical, _)) = waiters.find(|(_, critical)| *critical) {
                critical.notify_one();
            }
        }
    }
}

/// A place in a key's queue. Dropping it leaves the queue (and wakes the
/// next waiter if this one was at the head).
#[derive(Debug)]
pub(crate) struct Place {
    queue: Arc<Queue>,
    key: u64,
    notify: Arc<Notify>,
}

impl Place {
    pub(crate) fn is_head(&self) -> bool {
        self.queue
            .lock(self.key)
            .get(&self.key)
            .and_then(VecDeque::front)
            .is_some_and(|(head, _)| Arc::ptr_eq(head, &self.notify))
    }

    /// Waits until woken (`true`), or until `until` (`false`).
    pub(crate) async fn wait(&self, until: tokio::time::Instant) -> bool {
        tokio::time::timeout_at(until, self.notify.notified())
            .await
            .is_ok()
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut keys = self.queue.lock(self.key);
        let Some(line) = keys.get_mut(&self.key) else {
            return;
        };
        let was_head = line
            .front()
            .is_some_and(|(head, _)| Arc::ptr_eq(head, &self.notify));
        line.retain(|(w, _)| !Arc::ptr_eq(w, &self.notify));
        self.queue.waiting.fetch_sub(1, Ordering::AcqRel);
        self.queue.depth.decrement(1.0);
        match line.front() {
            // The next in line may find a permit free now.
            Some((next, _)) if was_head => next.notify_one(),
            Some(_) => {}
            None => {
                keys.remove(&self.key);
            }
        }
    }
}

#[allow(clippy::panic)]
fn unreachable_shards() -> ! {
    // `keys` has SHARDS > 0 maps from construction.
    panic!("queue without shards")
}
