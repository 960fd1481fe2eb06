//! Standalone or Cluster, behind one type.

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use tokio::sync::OnceCell;
use tollgate_core::ConfigError;

use crate::scripts::{Reply, Script};

pub(crate) enum Conn {
    Standalone(ConnectionManager),
    /// Connected on first use, so a store can be built while the cluster
    /// is down; a failed connect is retried on the next call.
    Cluster(Box<(ClusterClient, OnceCell<ClusterConnection>)>),
}

impl Conn {
    pub(crate) fn new(url: &str, timeout: Duration) -> Result<Self, ConfigError> {
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
                .connection_timeout(timeout)
                .response_timeout(timeout)
                .retries(1)
                .build()
                .map_err(bad)?;
            return Ok(Conn::Cluster(Box::new((client, OnceCell::new()))));
        }
        let client = redis::Client::open(url).map_err(bad)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(500));
        let manager = ConnectionManager::new_lazy_with_config(client, config).map_err(bad)?;
        Ok(Conn::Standalone(manager))
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
            Conn::Cluster(cluster) => {
                let (client, cell) = &**cluster;
                let conn = cell
                    .get_or_try_init(|| client.get_async_connection())
                    .await?;
                invocation.invoke_async(&mut conn.clone()).await?
            }
        };
        Ok(Reply(reply))
    }
}
