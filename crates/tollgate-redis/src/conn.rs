//! Standalone or Cluster, behind one type.

use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use std::sync::Arc;

use tokio::sync::{Notify, OnceCell};
use tollgate_core::ConfigError;

use crate::scripts::{Reply, Script};

pub(crate) enum Conn {
    Standalone(ConnectionManager),
    /// Connected by a background task (retrying with backoff), so a store
    /// can be built while the cluster is down, and a slow first connect —
    /// seeds, slot map, every node — is never cut short by a call's
    /// timeout. Calls wait for it within their own timeout.
    Cluster(Arc<ClusterSlot>),
    /// A master found through Redis Sentinel, found again after a call
    /// fails (a master switch: the old master refuses writes, or is gone).
    Sentinel(Arc<SentinelSlot>),
}

pub(crate) struct SentinelSlot {
    client: tokio::sync::Mutex<SentinelClient>,
    /// The connection in use, and its number: a call forgets only the
    /// connection it used, never a newer one.
    conn: std::sync::Mutex<Option<(u64, MultiplexedConnection)>>,
    generation: std::sync::atomic::AtomicU64,
    timeout: Duration,
    /// A task is finding the master and connecting: calls wait for it
    /// within their own timeout, and it goes on past that timeout, so a
    /// slow first connect is never cut short.
    connecting: std::sync::atomic::AtomicBool,
    ready: Notify,
    connect_timeout: Duration,
}

impl SentinelSlot {
    /// The master's connection: the one in use, or a new one to the
    /// master the sentinels name now.
    async fn connection(self: &Arc<Self>) -> redis::RedisResult<(u64, MultiplexedConnection)> {
        use std::sync::atomic::Ordering;
        if let Some(c) = self.current() {
            return Ok(c);
        }
        let notified = self.ready.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if let Some(c) = self.current() {
            return Ok(c);
        }
        if !self.connecting.swap(true, Ordering::AcqRel) {
            let slot = Arc::clone(self);
            tokio::spawn(async move {
                let attempt = async { slot.client.lock().await.get_async_connection().await };
                match tokio::time::timeout(slot.connect_timeout, attempt).await {
                    Ok(Ok(conn)) => {
                        let n = slot.generation.fetch_add(1, Ordering::AcqRel);
                        *slot
                            .conn
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some((n, conn));
                    }
                    Ok(Err(error)) => {
                        tracing::warn!(target: "tollgate::redis", %error, "no master through the sentinels");
                    }
                    Err(_) => {
                        tracing::warn!(target: "tollgate::redis", "no master through the sentinels within the connect timeout");
                    }
                }
                slot.connecting.store(false, Ordering::Release);
                slot.ready.notify_waiters();
            });
        }
        notified.await;
        self.current().ok_or_else(|| {
            redis::RedisError::from((
                redis::ErrorKind::Io,
                "no master connection through the sentinels",
            ))
        })
    }

    fn current(&self) -> Option<(u64, MultiplexedConnection)> {
        self.conn
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Forgets connection `n` (if it is still the one in use): the next
    /// call asks the sentinels again.
    pub(crate) fn forget(&self, n: u64) {
        let mut conn = self
            .conn
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if conn.as_ref().is_some_and(|(m, _)| *m == n) {
            *conn = None;
        }
    }
}

/// Whether `e` says the connection is no longer to a working master: the
/// connection broke or hangs, or the server was demoted (`READONLY`) or
/// lost its master (`MASTERDOWN`). Other errors (a script error, `OOM`)
/// keep the connection.
fn lost_master(e: &redis::RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || matches!(e.code(), Some("READONLY" | "MASTERDOWN"))
}

/// `redis+sentinel://[user:password@]host:port[,host:port...]/service`:
/// the sentinels' addresses, and the monitored master's name. The user and
/// password are the master's (sentinels are asked without).
fn sentinel(
    url: &str,
    connect_timeout: Duration,
    timeout: Duration,
) -> Result<Option<Conn>, ConfigError> {
    let Some(rest) = url.strip_prefix("redis+sentinel://") else {
        return Ok(None);
    };
    let bad = |m: &str| {
        ConfigError::new("url", format!("sentinel URL: {m} (redis+sentinel://[user:password@]host:port[,host:port]/service)"))
    };
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
        .map(|h| format!("redis://{h}"))
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
    let node = SentinelNodeConnectionInfo::default().set_redis_connection_info(info);
    let client = SentinelClient::build(
        sentinels,
        service.to_owned(),
        Some(node),
        SentinelServerType::Master,
    )
    // The error names the URL's parts, never its password.
    .map_err(|e| bad(&format!("{:?}", e.kind())))?;
    Ok(Some(Conn::Sentinel(Arc::new(SentinelSlot {
        client: tokio::sync::Mutex::new(client),
        conn: std::sync::Mutex::new(None),
        connecting: std::sync::atomic::AtomicBool::new(false),
        ready: Notify::new(),
        connect_timeout,
        generation: std::sync::atomic::AtomicU64::new(0),
        // Just under the store's call timeout, so that a hung master is
        // forgotten by the call that found it so.
        timeout: timeout.mul_f64(0.9),
    }))))
}

pub(crate) struct ClusterSlot {
    conn: OnceCell<ClusterConnection>,
    ready: Notify,
}

impl ClusterSlot {
    fn spawn_connect(client: ClusterClient) -> Arc<Self> {
        let slot = Arc::new(Self {
            conn: OnceCell::new(),
            ready: Notify::new(),
        });
        let weak = Arc::downgrade(&slot);
        tokio::spawn(async move {
            let mut backoff = Duration::from_millis(50);
            loop {
                let result = client.get_async_connection().await;
                // Stop once the store is gone.
                let Some(slot) = weak.upgrade() else { return };
                match result {
                    Ok(conn) => {
                        let _ = slot.conn.set(conn);
                        slot.ready.notify_waiters();
                        return;
                    }
                    Err(error) => {
                        // Said once at warn (a wrong host or password shows),
                        // then quietly while it keeps retrying.
                        if backoff == Duration::from_millis(50) {
                            tracing::warn!(target: "tollgate::redis", %error, "cluster connect failed; retrying in the background");
                        } else {
                            tracing::debug!(target: "tollgate::redis", %error, "cluster connect failed; retrying");
                        }
                    }
                }
                drop(slot);
                tokio::time::sleep(backoff).await;
                backoff = backoff.saturating_mul(2).min(Duration::from_secs(2));
            }
        });
        slot
    }

    async fn connection(&self) -> ClusterConnection {
        loop {
            if let Some(c) = self.conn.get() {
                return c.clone();
            }
            let notified = self.ready.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(c) = self.conn.get() {
                return c.clone();
            }
            notified.await;
        }
    }
}

impl Conn {
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
        if let Some(conn) = sentinel(url.trim(), connect_timeout, timeout)? {
            if tls_root.is_some() {
                return Err(tls_elsewhere());
            }
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
            return Ok(Conn::Cluster(ClusterSlot::spawn_connect(client)));
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
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(connect_timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(500));
        let manager = ConnectionManager::new_lazy_with_config(client, config).map_err(bad)?;
        Ok(Conn::Standalone(manager))
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
            Conn::Standalone(manager) => pipe.query_async(&mut manager.clone()).await,
            Conn::Cluster(slot) => {
                let mut conn = slot.connection().await;
                pipe.query_async(&mut conn).await
            }
            Conn::Sentinel(slot) => {
                let (n, mut conn) = slot.connection().await?;
                let r = pipe.query_async(&mut conn).await;
                if r.as_ref().is_err_and(lost_master) {
                    slot.forget(n);
                }
                r
            }
        }
    }

    pub(crate) async fn invoke(
        &self,
        script: &Script,
        keys: &[&str],
        args: &[&str],
    ) -> redis::RedisResult<Reply> {
        let mut invocation = script.prepare_invoke();
        for k in keys {
            invocation.key(*k);
        }
        for a in args {
            invocation.arg(*a);
        }
        let reply: Vec<i64> = match self {
            Conn::Standalone(manager) => invocation.invoke_async(&mut manager.clone()).await?,
            Conn::Cluster(slot) => {
                let mut conn = slot.connection().await;
                invocation.invoke_async(&mut conn).await?
            }
            Conn::Sentinel(slot) => {
                let (n, mut conn) = slot.connection().await?;
                let call = invocation.invoke_async(&mut conn);
                match tokio::time::timeout(slot.timeout, call).await {
                    Ok(Ok(reply)) => reply,
                    Ok(Err(e)) => {
                        // READONLY from a demoted master, or a dead one:
                        // ask the sentinels again next time.
                        if lost_master(&e) {
                            slot.forget(n);
                        }
                        return Err(e);
                    }
                    Err(_) => {
                        // A master that hangs.
                        slot.forget(n);
                        return Err(redis::RedisError::from(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            "no answer from the master",
                        )));
                    }
                }
            }
        };
        Ok(Reply(reply))
    }
}
