//! The leases one concurrency limiter granted and has not released (so
//! the store's [`keeper`](crate::keeper) renews them), and the semaphore
//! script's arguments.
//!
//! A lease is here from its grant until its release is handed to the
//! keeper, so a released lease is never renewed after its release ran (a
//! renewal only extends leases still in Redis, and never brings one back).

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tollgate_core::{Lease, Semaphore, StoreError};

use crate::backend::Backend;
use crate::scripts::{self, Reply, SemaphoreMode};

/// The semaphore script's arguments for one rule.
#[derive(Debug)]
pub(crate) struct SemaphoreArgs {
    ttl: String,
    max: String,
    lease_ttl: String,
    retry_after: String,
}

impl SemaphoreArgs {
    pub(crate) fn new(semaphore: &Semaphore) -> Self {
        Self {
            ttl: scripts::ttl_ms(semaphore.lease_ttl()).to_string(),
            max: semaphore.max().to_string(),
            lease_ttl: semaphore.lease_ttl().to_string(),
            retry_after: semaphore.retry_after().to_string(),
        }
    }

    /// Runs the script in `mode` on the leases at `key` (its hash is
    /// `key:meta`); `tail` is `ARGV[8..]`.
    pub(crate) async fn run(
        &self,
        backend: &Backend,
        mode: SemaphoreMode,
        key: &str,
        permits: u32,
        tail: &[String],
    ) -> Result<Reply, StoreError> {
        let meta = format!("{key}:meta");
        let now = backend.now_arg();
        let permits = permits.to_string();
        let mut args: Vec<&str> = Vec::with_capacity(tail.len().saturating_add(7));
        args.extend([
            mode.arg(),
            permits.as_str(),
            now.as_str(),
            self.ttl.as_str(),
            self.max.as_str(),
            self.lease_ttl.as_str(),
            self.retry_after.as_str(),
        ]);
        args.extend(tail.iter().map(String::as_str));
        backend.run(&scripts::SEMAPHORE, &[key, &meta], &args).await
    }
}

pub(crate) fn member(lease: &Lease) -> String {
    format!("{}:{}", lease.id, lease.permits)
}

/// The leases one concurrency limiter granted and has not released, by
/// Redis key.
#[derive(Debug)]
pub(crate) struct LiveLeases {
    pub(crate) args: SemaphoreArgs,
    pub(crate) every: Duration,
    held: Mutex<HashMap<String, HashMap<u64, u32>>>,
    pub(crate) renewing: AtomicBool,
}

impl LiveLeases {
    pub(crate) fn new(semaphore: &Semaphore) -> Arc<Self> {
        Arc::new(Self {
            args: SemaphoreArgs::new(semaphore),
            every: Duration::from_nanos(semaphore.lease_ttl() / 3),
            held: Mutex::new(HashMap::new()),
            renewing: AtomicBool::new(false),
        })
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, HashMap<u64, u32>>> {
        // The map stays consistent whatever panicked while it was locked.
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records a lease Redis granted.
    pub(crate) fn hold(&self, key: String, lease: Lease) {
        self.lock()
            .entry(key)
            .or_default()
            .insert(lease.id, lease.permits);
    }

    /// Stops renewing a lease (released, or lapsed in Redis).
    pub(crate) fn forget(&self, key: &str, id: u64) {
        let mut held = self.lock();
        if let Some(leases) = held.get_mut(key) {
            leases.remove(&id);
            if leases.is_empty() {
                held.remove(key);
            }
        }
    }

    /// Leases held now, by key.
    pub(crate) fn snapshot(&self) -> Vec<(String, Vec<Lease>)> {
        self.lock()
            .iter()
            .map(|(key, leases)| {
                let leases = leases
                    .iter()
                    .map(|(&id, &permits)| Lease { id, permits })
                    .collect();
                (key.clone(), leases)
            })
            .collect()
    }
}
