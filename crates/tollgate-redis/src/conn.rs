//! Standalone or Cluster, behind one type.

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
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
    ) -> Result<Self, ConfigError> {
        let bad = |e: redis::RedisError| ConfigError::new("url", e.to_string());
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
            let nodes: Vec<String> = urls.iter().map(|u| u.replacen("+cluster", "", 1)).collect();
            let client = ClusterClient::builder(nodes)
                .connection_timeout(connect_timeout)
                .response_timeout(timeout)
                .retries(1)
                .build()
                .map_err(bad)?;
            return Ok(Conn::Cluster(ClusterSlot::spawn_connect(client)));
        }
        let client = redis::Client::open(url).map_err(bad)?;
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
        };
        Ok(Reply(reply))
    }
}
