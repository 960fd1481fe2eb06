//! An audit trail of refusals in a Redis stream: batched, bounded, and
//! never in a request's way.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use crate::backend::Backend;

/// One audit record: field names and values, as `XADD` stores them.
pub type AuditFields = Vec<(&'static str, String)>;

/// A Redis stream that audit records are appended to (`XADD <prefix>:<name>
/// MAXLEN ~ <maxlen> * ...`), from a [`RedisStore`](crate::RedisStore)'s
/// connection.
///
/// [`record`](Self::record) never waits: it hands the record to a bounded
/// queue and returns; one task per stream drains the queue in batches (a
/// pipeline of up to 256 `XADD`s a call). When the queue is full — Redis
/// is slow or away — the record is dropped and counted, in
/// [`dropped`](Self::dropped) and the metric
/// `tollgate_audit_dropped_total{stream}`: an audit trail must never
/// delay, let alone fail, the requests it describes. A batch Redis does
/// not take is counted as dropped whole, though part of it may have been
/// written (the count is an upper bound), and a batch retried after a
/// broken connection may be written twice. The queue holds at most
/// 2^20 records.
///
/// The batches share the store's connection (a pipeline of `XADD`s can
/// sit ahead of a decision's script call on it) and its call timeout. The
/// task lives as long as a clone of the sink does; records still queued
/// when the process exits are lost. The records' key hashes are keyed per
/// process: one client's hash differs between instances and restarts.
#[derive(Clone)]
pub struct RedisAudit {
    queue: mpsc::Sender<AuditFields>,
    dropped: Arc<AtomicU64>,
    metric: metrics::Counter,
    stream: Arc<str>,
}

impl fmt::Debug for RedisAudit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisAudit")
            .field("stream", &self.stream)
            .field("dropped", &self.dropped())
            .finish_non_exhaustive()
    }
}

/// Records sent in one pipeline at most.
const BATCH: usize = 256;

impl RedisAudit {
    pub(crate) fn spawn(
        backend: Arc<Backend>,
        runtime: &tokio::runtime::Handle,
        stream: String,
        maxlen: usize,
        capacity: usize,
    ) -> Self {
        let (queue, mut rx) = mpsc::channel::<AuditFields>(capacity.clamp(1, 1 << 20));
        let dropped = Arc::new(AtomicU64::new(0));
        metrics::describe_counter!(
            "tollgate_audit_dropped_total",
            "Audit records dropped because the queue to Redis was full or Redis did not take them"
        );
        let metric = metrics::counter!("tollgate_audit_dropped_total", "stream" => stream.clone());
        let key = format!("{}:{stream}", backend.prefix);
        let (lost, lost_metric) = (Arc::clone(&dropped), metric.clone());
        runtime.spawn(async move {
            let mut batch = Vec::with_capacity(BATCH);
            while rx.recv_many(&mut batch, BATCH).await > 0 {
                let sent = tokio::time::timeout(
                    backend.timeout.max(Duration::from_secs(1)),
                    backend.conn().xadd_batch(&key, maxlen, &batch),
                )
                .await;
                if !matches!(sent, Ok(Ok(()))) {
                    let n = u64::try_from(batch.len()).unwrap_or(u64::MAX);
                    lost.fetch_add(n, Ordering::Relaxed);
                    lost_metric.increment(n);
                }
                batch.clear();
            }
        });
        Self {
            queue,
            dropped,
            metric,
            stream: stream.into(),
        }
    }

    /// Queues `fields` for the stream; never waits. `false` when the
    /// record was dropped (the queue is full).
    pub fn record(&self, fields: AuditFields) -> bool {
        if self.queue.try_send(fields).is_ok() {
            return true;
        }
        self.dropped.fetch_add(1, Ordering::Relaxed);
        self.metric.increment(1);
        false
    }

    /// Records dropped so far (queue full, or a batch Redis did not take).
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// This sink, kept without keeping its task alive.
    pub(crate) fn keep(&self) -> Kept {
        Kept {
            queue: self.queue.downgrade(),
            dropped: Arc::clone(&self.dropped),
            metric: self.metric.clone(),
            stream: Arc::clone(&self.stream),
        }
    }
}

/// A [`RedisAudit`] a store remembers, so that asking for the same stream
/// again (a policy reloaded) gives the same queue and task rather than a
/// new one each time. Weak: once no sink is left, its task ends as it
/// would have.
pub(crate) struct Kept {
    queue: mpsc::WeakSender<AuditFields>,
    dropped: Arc<AtomicU64>,
    metric: metrics::Counter,
    stream: Arc<str>,
}

impl Kept {
    /// The sink, if any clone of it is still alive.
    pub(crate) fn upgrade(&self) -> Option<RedisAudit> {
        Some(RedisAudit {
            queue: self.queue.upgrade()?,
            dropped: Arc::clone(&self.dropped),
            metric: self.metric.clone(),
            stream: Arc::clone(&self.stream),
        })
    }
}
