//! Standalone or Cluster, behind one type.

use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use std::sync::Arc;

use tokio::sync::Notify;
use tollgate_core::ConfigError;

use crate::scripts::{Reply, Script};

pub(crate) enum Conn {
    /// One server, connected and replaced as a Sentinel master is: a call
    /// that finds it lost (refused, dropped, `READONLY` from a master
    /// demoted behind a DNS name or a virtual IP, `MASTERDOWN`, or three
    /// hung calls in a row) has the connection made again, to whatever
    /// the address now leads to.
    Standalone(Arc<Slot<MultiplexedConnection>>, Duration),
    /// Connected by a background task, so a store can be built while the
    /// cluster is down, and a slow first connect (seeds, slot map, every
    /// node) is never cut short by a call's timeout. Replaced when calls
    /// find a node gone: redis-rs follows `MOVED`, but reconnects a dead
    /// node's address forever and never asks for the slot map again, so
    /// after a master fails over only a new connection finds the promoted
    /// replica. A node found hung (three calls in a row time out) asks a
    /// node for the slot map instead, and replaces the connection only if
    /// a slot's master changed (a hung master failed over): meanwhile only
    /// that node's slot ranges time out, and their breaker opens. A new
    /// connection (seeds, slot map, every node) would not make a stalled
    /// node answer, and a fleet that saw one node's stall used to
    /// reconnect to every node in step (fleet review M6).
    Cluster(Arc<Slot<ClusterConnection>>, Duration, Arc<SlotMap>),
    /// A master found through Redis Sentinel, found again after a call
    /// fails (a master switch: the old master refuses writes, or is gone).
    /// Each with the time a call may take on it: just under the store's
    /// call timeout, so that the call that finds a node hung says so.
    Sentinel(Arc<Slot<MultiplexedConnection>>, Duration),
}

type Connect<C> = Box<dyn Fn() -> tollgate_core::BoxFuture<redis::RedisResult<C>> + Send + Sync>;

/// A connection that is made in the background and replaced when calls
/// find it broken. A call uses the connection in use while its
/// replacement is made, so a replacement never holds calls up; only a
/// call that finds no connection at all waits (within its own timeout).
/// A connection is replaced when a call finds its node gone (refused,
/// dropped, `READONLY`, `MASTERDOWN`) or, to one server, after three calls
/// in a row found it hung (no answer in time): one slow answer is not a
/// lost node; a Cluster's hung node has the slot map read again, and the
/// connection replaced only if a master changed.
/// Connects are one at a time, run on the runtime the store was built
/// on, and are paced: after a failed one, the next waits 50 ms, doubling
/// to 2 s; after a successful one, no replacement comes within a second.
/// So a dead node costs at most a few connects a second, never one per
/// call. Every wait is jittered (a failed connect's backoff a random 50
/// to 100 % of its length, the quiet time after a connect 1 to 1.25 s,
/// and a replacement for a node found hung starts up to 250 ms after the
/// third hung call), so that a fleet whose instances all saw the same
/// stall at the same moment does not reconnect, and read the slot map, in
/// step; a node found gone (refused, reset, demoted) is replaced at once. Connects are started by calls (the breaker's probes included):
/// with no traffic, nothing reconnects until a request comes.
pub(crate) struct Slot<C> {
    /// The connection in use, and its number: trouble on a connection
    /// that was already replaced changes nothing.
    conn: std::sync::Mutex<Option<(u64, C)>>,
    generation: std::sync::atomic::AtomicU64,
    /// Connects started (each, on a Cluster, to the seeds and every node).
    attempts: std::sync::atomic::AtomicU64,
    connecting: std::sync::atomic::AtomicBool,
    /// When the next connect may start, and the failed connects in a row.
    pace: std::sync::Mutex<(tokio::time::Instant, u32)>,
    /// Calls in a row that found a node hung (reset by an answer from
    /// it), per slot range ([`range_of`]): on a Cluster, answers from
    /// healthy masters do not hide a hung one.
    hung: Box<[std::sync::atomic::AtomicU32]>,
    ready: Notify,
    /// Where connects run when the caller is on no runtime: the runtime
    /// the store was built on.
    runtime: tokio::runtime::Handle,
    connect: Connect<C>,
    connect_timeout: Duration,
    /// What it connects to, for logs.
    what: &'static str,
    /// Draws for the jitter: a random seed and a counter.
    draws: std::sync::atomic::AtomicU64,
    seed: std::hash::RandomState,
    /// What calls that find a node hung do: `None` (one server) replace
    /// the connection, a hung connection being the whole store's; a
    /// Cluster's asks a node for the slot map, and replaces the
    /// connection only if a slot's master changed (see [`Conn::Cluster`]).
    check: Option<Check<C>>,
    /// Whether such a check is under way.
    checking: std::sync::atomic::AtomicBool,
    /// Checks in a row that found no change, and when the last was
    /// (breaker clock, ns): a node hung through three within 10 s is a
    /// connection gone bad (half open, dropped by a firewall), replaced.
    unchanged: std::sync::Mutex<(u32, u64)>,
}

/// Whether the topology changed, asked on a connection (`true`: replace
/// it).
type Check<C> = Box<dyn Fn(C) -> tollgate_core::BoxFuture<bool> + Send + Sync>;

/// Within this many ns, three topology checks that find no change mean a
/// node's connection has gone bad rather than the node stalled briefly.
const PERSISTENT_HANG: u64 = 10_000_000_000;

/// The longest a replacement connect waits, at random, after the trouble
/// that asked for it.
const REPLACE_JITTER: Duration = Duration::from_millis(250);

impl<C: Clone + Send + 'static> Slot<C> {
    /// Must be called on a Tokio runtime (the store's builder is).
    fn new(
        what: &'static str,
        ranges: usize,
        connect_timeout: Duration,
        connect: Connect<C>,
        check: Option<Check<C>>,
    ) -> Arc<Self> {
        let slot = Arc::new(Self {
            conn: std::sync::Mutex::new(None),
            generation: std::sync::atomic::AtomicU64::new(0),
            attempts: std::sync::atomic::AtomicU64::new(0),
            connecting: std::sync::atomic::AtomicBool::new(false),
            pace: std::sync::Mutex::new((tokio::time::Instant::now(), 0)),
            hung: (0..ranges.max(1))
                .map(|_| std::sync::atomic::AtomicU32::new(0))
                .collect(),
            ready: Notify::new(),
            runtime: tokio::runtime::Handle::current(),
            connect,
            connect_timeout,
            what,
            draws: std::sync::atomic::AtomicU64::new(0),
            seed: std::hash::RandomState::new(),
            check,
            checking: std::sync::atomic::AtomicBool::new(false),
            unchanged: std::sync::Mutex::new((0, 0)),
        });
        slot.kick(false);
        slot
    }

    /// The connection in use, or (there is none) one made now.
    async fn connection(self: &Arc<Self>) -> redis::RedisResult<(u64, C)> {
        if let Some(c) = self.current() {
            return Ok(c);
        }
        let notified = self.ready.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if let Some(c) = self.current() {
            return Ok(c);
        }
        self.kick(false);
        notified.await;
        self.current().ok_or_else(|| {
            redis::RedisError::from((redis::ErrorKind::Io, "no Redis connection yet"))
        })
    }

    fn current(&self) -> Option<(u64, C)> {
        self.conn
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// A call on connection `n` failed as a lost node fails: replace it,
    /// unless it was replaced already (or a connect is under way).
    /// `hung`: calls found the node hung (not gone): the replacement
    /// waits a random moment, as a fleet that saw one stall would
    /// otherwise replace in step; a node found gone is replaced at once.
    fn trouble(self: &Arc<Self>, n: u64, hung: bool) {
        if self.current().is_some_and(|(m, _)| m == n) {
            self.kick(hung);
        }
    }

    /// Runs `call` on the connection in use, within `limit`; a failure
    /// that says the node is lost (see [`lost_node`]) has the connection
    /// replaced.
    async fn run<T, F, Fut>(
        self: &Arc<Self>,
        limit: Duration,
        range: usize,
        call: F,
    ) -> redis::RedisResult<T>
    where
        F: FnOnce(C) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        let (n, conn) = self.connection().await?;
        let result = match tokio::time::timeout(limit, call(conn)).await {
            Ok(result) => result,
            Err(_) => Err(redis::RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no answer from Redis",
            ))),
        };
        use std::sync::atomic::Ordering;
        let Some(hung) = self.hung.get(range).or_else(|| self.hung.first()) else {
            return result;
        };
        match &result {
            Err(e) if e.is_timeout() => {
                if hung.fetch_add(1, Ordering::AcqRel) >= 2 {
                    hung.store(0, Ordering::Release);
                    match self.check {
                        None => self.trouble(n, true),
                        Some(_) => self.check_topology(n),
                    }
                }
            }
            Err(e) if lost_node(e) => self.trouble(n, false),
            // An answer, even an error reply: the node is there.
            _ => {
                if hung.load(Ordering::Relaxed) != 0 {
                    hung.store(0, Ordering::Release);
                }
            }
        }
        result
    }

    /// Calls on connection `n` found a node hung: asks (one check at a
    /// time, on its own task, within the connect timeout) whether a slot's
    /// master changed — a hung master failed over — and only then replaces
    /// the connection.
    fn check_topology(self: &Arc<Self>, n: u64) {
        use std::sync::atomic::Ordering;
        if self.checking.swap(true, Ordering::AcqRel) {
            return;
        }
        struct Done<C>(Arc<Slot<C>>);
        impl<C> Drop for Done<C> {
            fn drop(&mut self) {
                self.0.checking.store(false, Ordering::Release);
            }
        }
        let done = Done(Arc::clone(self));
        let runtime =
            tokio::runtime::Handle::try_current().unwrap_or_else(|_| self.runtime.clone());
        runtime.spawn(async move {
            let slot = &done.0;
            let (Some(check), Some((m, conn))) = (&slot.check, slot.current()) else {
                return;
            };
            if m != n {
                return;
            }
            let moved = tokio::time::timeout(slot.connect_timeout, check(conn)).await;
            let replace = moved == Ok(true) || {
                let now = crate::breaker::now_nanos();
                let mut unchanged = slot
                    .unchanged
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                let recent = now.saturating_sub(unchanged.1) < PERSISTENT_HANG;
                *unchanged = (
                    if recent {
                        unchanged.0.saturating_add(1)
                    } else {
                        1
                    },
                    now,
                );
                unchanged.0 >= 3
            };
            if replace {
                *slot
                    .unchanged
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = (0, 0);
                slot.trouble(n, true);
            }
        });
    }

    /// A random part of `span`: from `low` (a share of 1, at most 1) of it
    /// to all of it.
    fn jitter(&self, span: Duration, low: f64) -> Duration {
        let n = self
            .draws
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        jittered(&self.seed, n, span, low)
    }

    /// Starts a connect unless one is under way; it waits for its pace.
    fn kick(self: &Arc<Self>, hung: bool) {
        use std::sync::atomic::Ordering;
        if self.connecting.swap(true, Ordering::AcqRel) {
            return;
        }
        // Made before the task, so that however the task ends (a panic,
        // its runtime shut down before it ever ran) the next call may
        // connect again, and waiters wake.
        let done = Connecting(Arc::clone(self));
        // On the caller's runtime where there is one (the runtime the store
        // was built on may be gone: a store built in a set-up runtime and
        // used from another), else on the store's.
        let runtime =
            tokio::runtime::Handle::try_current().unwrap_or_else(|_| self.runtime.clone());
        // A replacement (calls still have the old connection meanwhile)
        // waits a random moment, so a fleet does not replace in step.
        let spread = if hung && self.current().is_some() {
            self.jitter(REPLACE_JITTER, 0.0)
        } else {
            Duration::ZERO
        };
        runtime.spawn(async move {
            let slot = &done.0;
            let at = slot
                .pace
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
            let start = tokio::time::Instant::now()
                .checked_add(spread)
                .map_or(at, |t| t.max(at));
            tokio::time::sleep_until(start).await;
            slot.attempts.fetch_add(1, Ordering::AcqRel);
            let made = tokio::time::timeout(slot.connect_timeout, (slot.connect)()).await;
            let now = tokio::time::Instant::now();
            let mut pace = slot
                .pace
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            match made {
                Ok(Ok(conn)) => {
                    let n = slot.generation.fetch_add(1, Ordering::AcqRel);
                    *slot
                        .conn
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some((n, conn));
                    let quiet = slot.jitter(Duration::from_millis(1_250), 0.8);
                    *pace = (now.checked_add(quiet).unwrap_or(now), 0);
                }
                failed => {
                    // Said once at warn (a wrong host or password shows),
                    // then quietly while it keeps failing.
                    let error = match failed {
                        Ok(Err(e)) => e.to_string(),
                        _ => "no connection within the connect timeout".to_owned(),
                    };
                    if pace.1 == 0 {
                        tracing::warn!(target: "tollgate::redis", what = slot.what, %error, "Redis connect failed; retrying in the background");
                    } else {
                        tracing::debug!(target: "tollgate::redis", what = slot.what, %error, "Redis connect failed");
                    }
                    let wait = slot.jitter(
                        Duration::from_millis(50)
                            .saturating_mul(1 << pace.1.min(6))
                            .min(Duration::from_secs(2)),
                        0.5,
                    );
                    *pace = (
                        now.checked_add(wait).unwrap_or(now),
                        pace.1.saturating_add(1),
                    );
                }
            }
        });
    }
}

/// Draw `n` of `seed`: a random part of `span`, from `low` (a share of 1)
/// of it to all of it.
fn jittered(seed: &std::hash::RandomState, n: u64, span: Duration, low: f64) -> Duration {
    use std::hash::BuildHasher;
    // The top 53 bits of the draw as a fraction in [0, 1).
    #[allow(clippy::cast_precision_loss)]
    let unit = (seed.hash_one(n) >> 11) as f64 / (1_u64 << 53) as f64;
    let low = low.clamp(0.0, 1.0);
    span.mul_f64(low + (1.0 - low) * unit)
}

/// Ends a connect attempt when dropped: clears the slot's flag and wakes
/// the calls waiting for a connection.
struct Connecting<C>(Arc<Slot<C>>);

impl<C> Drop for Connecting<C> {
    fn drop(&mut self) {
        self.0
            .connecting
            .store(false, std::sync::atomic::Ordering::Release);
        self.0.ready.notify_waiters();
    }
}

/// Whether `e` says the connection is no longer to a working master: the
/// connection broke or was refused, or the server was demoted
/// (`READONLY`) or lost its master (`MASTERDOWN`). Other errors (a script
/// error, `OOM`) keep the connection. (A hung node — timeouts — is
/// counted apart, in [`Slot::run`].)
fn lost_node(e: &redis::RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || matches!(e.code(), Some("READONLY" | "MASTERDOWN"))
        // Before Redis 7 a script's write on a replica fails as a script
        // error that carries the reply: `ERR Error running script ...
        // -READONLY You can't write against a read only replica.`
        || (e.code() == Some("ERR")
            && e
                .detail()
                .is_some_and(|d| d.contains("-READONLY") || d.contains("-MASTERDOWN")))
}

/// `redis+sentinel://[user:password@]host:port[,host:port...]/service`:
/// the sentinels' addresses, and the monitored master's name. The user and
/// password are the master's (sentinels are asked without).
fn sentinel(
    url: &str,
    connect_timeout: Duration,
    timeout: Duration,
) -> Result<Option<Conn>, ConfigError> {
    // `rediss+sentinel://`: TLS to the sentinels and to the master they
    // name (its certificate checked against the system's roots, or
    // `SSL_CERT_FILE`; `#insecure` at the end checks none).
    let (tls, rest) = match (
        url.strip_prefix("rediss+sentinel://"),
        url.strip_prefix("redis+sentinel://"),
    ) {
        (Some(rest), _) => (true, rest),
        (None, Some(rest)) => (false, rest),
        (None, None) => return Ok(None),
    };
    let bad = |m: &str| {
        ConfigError::new("url", format!("sentinel URL: {m} (redis[s]+sentinel://[user:password@]host:port[,host:port]/service)"))
    };
    let (rest, insecure) = match rest.strip_suffix("#insecure") {
        Some(rest) if tls => (rest, true),
        Some(_) => return Err(bad("#insecure is for rediss+sentinel:// (TLS) only")),
        None => (rest, false),
    };
    if tls && !cfg!(feature = "tls") {
        return Err(bad(
            "rediss+sentinel:// needs tollgate-redis's `tls` feature",
        ));
    }
    if insecure {
        tracing::warn!(
            target: "tollgate::redis",
            "a rediss+sentinel:// URL ends in #insecure: neither the sentinels' nor the \
             master's certificate is verified, so anyone on the path can answer as Redis"
        );
    }
    let (hosts, service) = rest
        .rsplit_once('/')
        .ok_or_else(|| bad("no service name"))?;
    if service.is_empty() {
        return Err(bad("no service name"));
    }
    let (auth, hosts) = match hosts.rsplit_once('@') {
        Some((auth, hosts)) => (Some(auth), hosts),
        None => (None, hosts),
    };
    let sentinels: Vec<String> = hosts
        .split(',')
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .map(|h| match (tls, insecure) {
            (false, _) => format!("redis://{h}"),
            (true, false) => format!("rediss://{h}"),
            (true, true) => format!("rediss://{h}/#insecure"),
        })
        .collect();
    if sentinels.is_empty() {
        return Err(bad("no sentinel address"));
    }
    let mut info = redis::RedisConnectionInfo::default();
    if let Some(auth) = auth {
        // Read the credentials as a redis:// URL's (percent-decoded,
        // `user:password` or `:password`).
        use redis::IntoConnectionInfo as _;
        let parsed = format!("redis://{auth}@127.0.0.1/")
            .into_connection_info()
            .map_err(|_| bad("credentials that do not parse"))?;
        if let Some(user) = parsed.redis_settings().username() {
            info = info.set_username(user);
        }
        if let Some(password) = parsed.redis_settings().password() {
            info = info.set_password(password);
        }
    }
    let mut node = SentinelNodeConnectionInfo::default().set_redis_connection_info(info);
    if tls {
        // The master's password goes only over TLS, as the sentinels' do.
        node = node.set_tls_mode(if insecure {
            redis::TlsMode::Insecure
        } else {
            redis::TlsMode::Secure
        });
    }
    let client = SentinelClient::build(
        sentinels,
        service.to_owned(),
        Some(node),
        SentinelServerType::Master,
    )
    // The error names the URL's parts, never its password.
    .map_err(|e| bad(&format!("{:?}", e.kind())))?;
    let client = Arc::new(tokio::sync::Mutex::new(client));
    let slot = Slot::new(
        "sentinel master",
        1,
        connect_timeout,
        Box::new(move || {
            let client = Arc::clone(&client);
            Box::pin(async move { client.lock().await.get_async_connection().await })
        }),
        None,
    );
    // Just under the store's call timeout, so that a hung master is
    // replaced because of the call that found it so.
    Ok(Some(Conn::Sentinel(slot, timeout.mul_f64(0.9))))
}

/// How many slot ranges a Cluster store keeps apart before it has read
/// the slot map: 64 ranges of 256 slots.
pub(crate) const SLOT_RANGES: usize = 64;

/// How many masters a Cluster store keeps apart (a larger cluster shares
/// breakers between masters, by their order in the slot map).
pub(crate) const MASTERS: usize = 64;

/// Which master holds each slot, as the cluster's slot map last said: a
/// breaker and a count of hung calls per master (a lost or stalled master
/// opens its own breaker only, and keys on the others go on deciding on
/// Redis). Until the first map is read, and for a slot no master claims,
/// a slot is in one of [`SLOT_RANGES`] fixed ranges. Read again with every
/// new connection, so a promoted replica gets a breaker of its own.
pub(crate) struct SlotMap {
    /// Per slot: its range (below [`SLOT_RANGES`]) or its master's index
    /// plus [`SLOT_RANGES`].
    owner: Box<[std::sync::atomic::AtomicU8]>,
    /// The masters seen, by address, in the order first seen.
    masters: std::sync::Mutex<Vec<String>>,
    /// The last reply's ranges and masters (start, end, address), sorted:
    /// what a topology check compares with.
    last: std::sync::Mutex<Vec<(i64, i64, String)>>,
}

impl SlotMap {
    fn new() -> Self {
        Self {
            owner: (0..16_384usize)
                .map(|slot| {
                    // 256 slots a range.
                    let range = slot >> 8;
                    std::sync::atomic::AtomicU8::new(u8::try_from(range).unwrap_or(0))
                })
                .collect(),
            masters: std::sync::Mutex::new(Vec::new()),
            last: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// Breakers and hang counters a Cluster store keeps.
    pub(crate) const GROUPS: usize = SLOT_RANGES.saturating_add(MASTERS);

    /// The group of `key`: its master's, or its range's.
    fn group_of(&self, key: &str) -> usize {
        self.owner
            .get(usize::from(hash_slot(key.as_bytes())))
            .map_or(0, |g| {
                usize::from(g.load(std::sync::atomic::Ordering::Relaxed))
            })
    }

    /// Records a `CLUSTER SLOTS` reply: each slot range's master. Returns
    /// whether a range's master (by address) changed since the last reply
    /// (not on the first).
    fn record(&self, reply: &redis::Value) -> bool {
        use redis::Value;
        let Value::Array(ranges) = reply else {
            return false;
        };
        let mut seen: Vec<(i64, i64, String)> = Vec::new();
        let mut masters = self
            .masters
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for range in ranges {
            let Value::Array(parts) = range else { continue };
            let (Some(Value::Int(start)), Some(Value::Int(end)), Some(Value::Array(master))) =
                (parts.first(), parts.get(1), parts.get(2))
            else {
                continue;
            };
            let host = match master.first() {
                Some(Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
                Some(Value::SimpleString(s)) => s.clone(),
                _ => continue,
            };
            let Some(Value::Int(port)) = master.get(1) else {
                continue;
            };
            let address = format!("{host}:{port}");
            seen.push((*start, *end, address.clone()));
            let index = match masters.iter().position(|m| *m == address) {
                Some(i) => i,
                None => {
                    masters.push(address);
                    masters.len().saturating_sub(1)
                }
            };
            let group =
                u8::try_from(SLOT_RANGES.saturating_add(index.checked_rem(MASTERS).unwrap_or(0)))
                    .unwrap_or(0);
            let (Ok(start), Ok(end)) = (usize::try_from(*start), usize::try_from(*end)) else {
                continue;
            };
            for slot in self
                .owner
                .get(start..=end.min(16_383))
                .into_iter()
                .flatten()
            {
                slot.store(group, std::sync::atomic::Ordering::Relaxed);
            }
        }
        drop(masters);
        seen.sort();
        let mut last = self
            .last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let changed = !last.is_empty() && *last != seen;
        *last = seen;
        changed
    }
}

/// The Cluster hash slot of `key` (CRC16-XMODEM of its `{hash tag}`, if
/// it has one, modulo 16,384), as Redis and redis-rs compute it.
pub(crate) fn hash_slot(key: &[u8]) -> u16 {
    let tagged = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = key.get(open..)?.get(1..)?;
            let close = rest.iter().position(|&b| b == b'}')?;
            rest.get(..close).filter(|tag| !tag.is_empty())
        })
        .unwrap_or(key);
    let mut crc: u16 = 0;
    for &byte in tagged {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16_384
}

impl Conn {
    /// The Cluster slot of `key`, or `None` where every key is on one
    /// server (standalone, Sentinel).
    pub(crate) fn slot_of(&self, key: &str) -> Option<redis::cluster_routing::Slot> {
        match self {
            Self::Cluster(..) => Some(redis::cluster_routing::Slot::for_key(key)),
            Self::Standalone(..) | Self::Sentinel(..) => None,
        }
    }

    /// How many groups of keys the store keeps apart (a breaker and a
    /// hang count each): a Cluster's masters (see [`SlotMap`]); 1 where
    /// every key is on one server.
    /// Connects started so far (the first included).
    pub(crate) fn connects(&self) -> u64 {
        let started =
            |g: &std::sync::atomic::AtomicU64| g.load(std::sync::atomic::Ordering::Acquire);
        match self {
            Self::Standalone(slot, _) | Self::Sentinel(slot, _) => started(&slot.attempts),
            Self::Cluster(slot, ..) => started(&slot.attempts),
        }
    }

    pub(crate) fn ranges(&self) -> usize {
        match self {
            Self::Cluster(..) => SlotMap::GROUPS,
            Self::Standalone(..) | Self::Sentinel(..) => 1,
        }
    }

    /// Group `group`'s name in the per-node metrics: on a Cluster its
    /// master's address (`host:port`), or `unmapped` for a fixed slot
    /// range (keys called before the slot map named their master);
    /// `server` where every key is on one server (standalone, or the
    /// master a Sentinel set names).
    pub(crate) fn group_name(&self, group: usize) -> String {
        match self {
            Self::Cluster(_, _, map) => group
                .checked_sub(SLOT_RANGES)
                .and_then(|i| {
                    map.masters
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .get(i)
                        .cloned()
                })
                .unwrap_or_else(|| "unmapped".to_owned()),
            Self::Standalone(..) | Self::Sentinel(..) => "server".to_owned(),
        }
    }

    /// The group of a call on `keys` (see [`ranges`](Self::ranges)).
    pub(crate) fn range_of(&self, keys: &[&str]) -> usize {
        match (self, keys.first()) {
            (Self::Cluster(_, _, map), Some(key)) => map.group_of(key),
            _ => 0,
        }
    }

    /// `connect_timeout` bounds each attempt to connect, `timeout` each
    /// command's response.
    pub(crate) fn new(
        url: &str,
        connect_timeout: Duration,
        timeout: Duration,
        tls_root: Option<&[u8]>,
    ) -> Result<Self, ConfigError> {
        let bad = |e: redis::RedisError| ConfigError::new("url", e.to_string());
        let tls_elsewhere = || {
            ConfigError::new(
                "tls_root_cert",
                "a root certificate of your own is for a standalone rediss:// URL only",
            )
        };
        let sentinel_url =
            |u: &str| u.starts_with("redis+sentinel://") || u.starts_with("rediss+sentinel://");
        if sentinel_url(url.trim()) && tls_root.is_some() {
            return Err(ConfigError::new(
                "tls_root_cert",
                "a root certificate of your own is for a standalone rediss:// URL only; \
                 for rediss+sentinel://, put the CA in the system's roots or SSL_CERT_FILE",
            ));
        }
        if let Some(conn) = sentinel(url.trim(), connect_timeout, timeout)? {
            return Ok(conn);
        }
        let urls: Vec<&str> = url
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .collect();
        let cluster_scheme =
            |u: &str| u.starts_with("redis+cluster://") || u.starts_with("rediss+cluster://");
        if urls.is_empty() {
            return Err(ConfigError::new("url", "no Redis URL given"));
        }
        if urls
            .iter()
            .any(|u| u.starts_with("rediss") && u.ends_with("#insecure"))
        {
            // redis-rs's fragment: TLS without checking whose certificate.
            tracing::warn!(
                target: "tollgate::redis",
                "a rediss:// URL ends in #insecure: the server's certificate is not verified, \
                 so anyone on the path can answer as Redis; give the CA with tls_root_cert"
            );
        }
        if urls.len() > 1 || urls.iter().any(|u| cluster_scheme(u)) {
            if tls_root.is_some() {
                return Err(tls_elsewhere());
            }
            let nodes: Vec<String> = urls.iter().map(|u| u.replacen("+cluster", "", 1)).collect();
            let client = ClusterClient::builder(nodes)
                .connection_timeout(connect_timeout)
                .response_timeout(timeout)
                .retries(1)
                .build()
                .map_err(bad)?;
            // A cluster connect reaches the seeds (each within the
            // connect timeout), reads the slot map (a call), then
            // connects to every node.
            // Each connection reads the slot map: which master holds
            // which slots, for the breakers.
            let map = Arc::new(SlotMap::new());
            let read = Arc::clone(&map);
            let slot = Slot::new(
                "cluster",
                SlotMap::GROUPS,
                connect_timeout.saturating_mul(2).saturating_add(timeout),
                Box::new(move || {
                    let (client, map) = (client.clone(), Arc::clone(&read));
                    Box::pin(async move {
                        let mut conn = client.get_async_connection().await?;
                        let slots: redis::RedisResult<redis::Value> = redis::cmd("CLUSTER")
                            .arg("SLOTS")
                            .query_async(&mut conn)
                            .await;
                        // Without a map the fixed ranges stand.
                        if let Ok(reply) = slots {
                            map.record(&reply);
                        }
                        Ok(conn)
                    })
                }),
                // A hung node: the slot map again (from a random node, on
                // the connection in use), and a new connection only if a
                // slot's master changed.
                Some({
                    let map = Arc::clone(&map);
                    Box::new(move |mut conn: ClusterConnection| {
                        let map = Arc::clone(&map);
                        Box::pin(async move {
                            let slots: redis::RedisResult<redis::Value> = redis::cmd("CLUSTER")
                                .arg("SLOTS")
                                .query_async(&mut conn)
                                .await;
                            slots.is_ok_and(|reply| map.record(&reply))
                        })
                    })
                }),
            );
            return Ok(Conn::Cluster(slot, timeout.mul_f64(0.9), map));
        }
        let client = match tls_root {
            #[cfg(feature = "tls")]
            Some(root) => redis::Client::build_with_tls(
                url,
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(root.to_vec()),
                },
            )
            .map_err(bad)?,
            _ => redis::Client::open(url).map_err(bad)?,
        };
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(connect_timeout))
            .set_response_timeout(Some(timeout));
        let slot = Slot::new(
            "redis",
            1,
            connect_timeout,
            Box::new(move || {
                let (client, config) = (client.clone(), config.clone());
                Box::pin(async move {
                    client
                        .get_multiplexed_async_connection_with_config(&config)
                        .await
                })
            }),
            None,
        );
        // Just under the store's call timeout, as for Sentinel.
        Ok(Conn::Standalone(slot, timeout.mul_f64(0.9)))
    }

    /// Appends `entries` to the stream `key` in one pipeline (`XADD key
    /// MAXLEN ~ maxlen * field value ...` each).
    pub(crate) async fn xadd_batch(
        &self,
        key: &str,
        maxlen: usize,
        entries: &[Vec<(&'static str, String)>],
    ) -> redis::RedisResult<()> {
        let mut pipe = redis::pipe();
        for fields in entries {
            let cmd = pipe
                .cmd("XADD")
                .arg(key)
                .arg("MAXLEN")
                .arg("~")
                .arg(maxlen)
                .arg("*");
            for (name, value) in fields {
                cmd.arg(*name).arg(value);
            }
            cmd.ignore();
        }
        match self {
            // A batch of up to 256 entries: the writer's own time, at
            // least a second, bounds it.
            Conn::Cluster(slot, limit, map) => {
                let pipe = &pipe;
                let limit = (*limit).max(Duration::from_secs(1));
                slot.run(limit, map.group_of(key), |mut c| async move {
                    pipe.query_async(&mut c).await
                })
                .await
            }
            Conn::Standalone(slot, limit) | Conn::Sentinel(slot, limit) => {
                let pipe = &pipe;
                let limit = (*limit).max(Duration::from_secs(1));
                slot.run(
                    limit,
                    0,
                    |mut c| async move { pipe.query_async(&mut c).await },
                )
                .await
            }
        }
    }

    pub(crate) async fn invoke(
        &self,
        script: &Script,
        keys: &[&str],
        args: &[&str],
    ) -> redis::RedisResult<Reply> {
        let reply: Vec<i64> = match self {
            Conn::Cluster(slot, limit, map) => {
                // Not redis-rs's `SCRIPT LOAD` on `NOSCRIPT`: on a Cluster
                // that goes to every node and fails if any one does not
                // answer, so a master that lost its scripts (restarted,
                // promoted) could not get them back while another node
                // is down. `EVAL` goes where the keys are, and caches the
                // script there.
                let range = keys.first().map_or(0, |k| map.group_of(k));
                slot.run(*limit, range, |mut c| async move {
                    match script.command(false, keys, args).query_async(&mut c).await {
                        Err(e)
                            if e.kind()
                                == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
                        {
                            script.command(true, keys, args).query_async(&mut c).await
                        }
                        other => other,
                    }
                })
                .await?
            }
            Conn::Standalone(slot, limit) | Conn::Sentinel(slot, limit) => {
                let mut invocation = script.prepare_invoke();
                for k in keys {
                    invocation.key(*k);
                }
                for a in args {
                    invocation.arg(*a);
                }
                let invocation = &invocation;
                slot.run(*limit, 0, |mut c| async move {
                    invocation.invoke_async(&mut c).await
                })
                .await?
            }
        };
        Ok(Reply(reply))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconnect_waits_are_jittered_within_their_span() {
        let span = Duration::from_secs(2);
        let (a, b) = (std::hash::RandomState::new(), std::hash::RandomState::new());
        let draws: Vec<Duration> = (0..200).map(|n| jittered(&a, n, span, 0.5)).collect();
        assert!(draws
            .iter()
            .all(|d| (Duration::from_secs(1)..=span).contains(d)));
        // Spread over the span, not in step: both halves of it are drawn,
        // and two instances (seeds) draw differently.
        let low = draws
            .iter()
            .filter(|d| **d < Duration::from_millis(1_500))
            .count();
        assert!((40..=160).contains(&low), "{low} of 200 in the lower half");
        let other: Vec<Duration> = (0..200).map(|n| jittered(&b, n, span, 0.5)).collect();
        assert_ne!(draws, other);
        assert!((0..50).all(|n| jittered(&a, n, REPLACE_JITTER, 0.0) <= REPLACE_JITTER));
    }

    #[test]
    fn hash_slots_are_redis_own() {
        // Redis's documented examples, and redis-rs's own computation.
        assert_eq!(hash_slot(b"123456789"), 0x31C3); // CRC16-XMODEM's check value
        assert_eq!(hash_slot(b"foo"), 12_182);
        assert_eq!(hash_slot(b"{user1000}.following"), hash_slot(b"user1000"));
        assert_eq!(hash_slot(b"foo{}{bar}"), hash_slot(b"foo{}{bar}"));
        for key in [
            "a",
            "tollgate:{gcra1|r|h:abc}",
            "x{}y",
            "{a}{b}",
            "",
            "{",
            "}{x}",
        ] {
            assert_eq!(
                redis::cluster_routing::Slot::new(hash_slot(key.as_bytes())),
                Some(redis::cluster_routing::Slot::for_key(key)),
                "{key:?}"
            );
        }
    }

    #[test]
    fn the_slot_map_puts_each_master_s_slots_in_a_group_of_its_own() {
        use redis::Value;
        let map = SlotMap::new();
        // Before a map: fixed ranges of 256 slots.
        let key_in = |slots: std::ops::RangeInclusive<u16>| {
            (0..1_000_000)
                .map(|i| format!("k{i}"))
                .find(|k| slots.contains(&hash_slot(k.as_bytes())))
                .unwrap()
        };
        // Both in the fixed range 21 (slots 5,376 to 5,631), on either
        // side of the first master's last slot.
        let (a, b) = (key_in(5_376..=5_460), key_in(5_461..=5_631));
        assert_eq!(map.group_of(&a), map.group_of(&b), "one range of 256");
        let master = |port: i64| {
            Value::Array(vec![
                Value::BulkString(b"127.0.0.1".to_vec()),
                Value::Int(port),
                Value::BulkString(b"id".to_vec()),
            ])
        };
        let range = |start: i64, end: i64, port: i64| {
            Value::Array(vec![Value::Int(start), Value::Int(end), master(port)])
        };
        let three = || {
            Value::Array(vec![
                range(0, 5_460, 7000),
                range(5_461, 10_922, 7001),
                range(10_923, 16_383, 7002),
            ])
        };
        assert!(!map.record(&three()), "the first reply is no change");
        assert!(!map.record(&three()), "the same masters");
        assert_ne!(map.group_of(&a), map.group_of(&b), "two masters");
        assert_eq!(map.group_of(&a), SLOT_RANGES);
        assert_eq!(map.group_of(&b), SLOT_RANGES + 1);
        // A failover: the replica at 7003 now holds 7000's slots.
        assert!(map.record(&Value::Array(vec![
            range(0, 5_460, 7003),
            range(5_461, 10_922, 7001),
            range(10_923, 16_383, 7002),
        ])));
        assert_eq!(map.group_of(&a), SLOT_RANGES + 3);
        // By address, not by breaker group: past 64 masters seen, a move
        // between two addresses that share a group is still a change.
        let other = SlotMap::new();
        let one = |port| Value::Array(vec![range(0, 16_383, port)]);
        for port in 8000..8070 {
            other.record(&one(port));
        }
        assert!(!other.record(&one(8069)));
        assert!(other.record(&one(8069 - 64)));
        // Garbage changes nothing.
        map.record(&Value::Int(3));
        map.record(&Value::Array(vec![Value::Array(vec![Value::Int(1)])]));
        assert_eq!(map.group_of(&b), SLOT_RANGES + 1);
    }
}
