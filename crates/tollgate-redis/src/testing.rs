//! Redis servers for tests (feature `testing`): each test starts its own
//! `redis-server` processes on free loopback ports (standalone, or a
//! 3-master cluster), so tests never share state with each other or with a
//! Redis on 6379. `redis-server` and `redis-cli` must be on `PATH`; with
//! `TOLLGATE_REQUIRE_REDIS=1` a missing `redis-server` fails the test,
//! otherwise the test is skipped with a message.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::arithmetic_side_effects,
    clippy::expect_used
)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// A `redis-server` child process, killed on drop.
#[derive(Debug)]
pub struct Server {
    /// Its port on 127.0.0.1.
    pub port: u16,
    child: Option<Child>,
    dir: PathBuf,
    cluster: bool,
}

fn available() -> bool {
    let found = Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        if std::env::var("TOLLGATE_REQUIRE_REDIS").is_ok_and(|v| v == "1") {
            panic!("redis-server is not on PATH and TOLLGATE_REQUIRE_REDIS=1");
        }
        eprintln!(
            "skipping: redis-server is not on PATH (set TOLLGATE_REQUIRE_REDIS=1 to fail instead)"
        );
    }
    found
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The highest port a cluster node may take: its bus listens on the
/// port + 10000, so a node above it refuses to start ("port number too
/// high"), and Linux hands out ports up to 60999.
const MAX_CLUSTER_PORT: u16 = 55_535;

/// A free port a cluster node can use.
fn free_cluster_port() -> u16 {
    for _ in 0..1_000 {
        let port = free_port();
        if port <= MAX_CLUSTER_PORT {
            return port;
        }
    }
    panic!("no free port at or below {MAX_CLUSTER_PORT}");
}

fn scratch_dir() -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "tollgate-redis-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn ping(port: u16) -> bool {
    Command::new("redis-cli")
        .args(["-p", &port.to_string(), "ping"])
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"PONG"))
}

impl Server {
    /// A server on a port `pick` chooses: a port found free may be taken
    /// by another test (or, for a cluster node, its bus port + 10000 may
    /// be) before redis-server binds it, so a server that exits at once
    /// is started again on another port, up to five times.
    fn spawn_on(pick: fn() -> u16, dir: PathBuf, cluster: bool) -> Self {
        for _ in 0..4 {
            if let Some(server) = Self::try_spawn(pick(), dir.clone(), cluster) {
                return server;
            }
        }
        Self::spawn(pick(), dir, cluster)
    }

    /// [`spawn`](Self::spawn), or `None` if the server exits before it
    /// answers (its port was taken).
    fn try_spawn(port: u16, dir: PathBuf, cluster: bool) -> Option<Self> {
        let mut server = Self::start_process(port, dir, cluster);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !ping(port) {
            let exited = server
                .child
                .as_mut()
                .is_some_and(|c| c.try_wait().is_ok_and(|s| s.is_some()));
            if exited || Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(server)
    }

    fn spawn(port: u16, dir: PathBuf, cluster: bool) -> Self {
        let server = Self::start_process(port, dir, cluster);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !ping(port) {
            assert!(
                Instant::now() < deadline,
                "redis-server on {port} did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }

    fn start_process(port: u16, dir: PathBuf, cluster: bool) -> Self {
        let mut cmd = Command::new("redis-server");
        cmd.args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            dir.to_str().unwrap(),
        ]);
        if cluster {
            cmd.args([
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                &format!("nodes-{port}.conf"),
                "--cluster-node-timeout",
                "2000",
            ]);
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        Self {
            port,
            child: Some(child),
            dir,
            cluster,
        }
    }

    /// A standalone server, or `None` (skip) if redis-server is missing.
    pub fn start() -> Option<Self> {
        available().then(|| Self::spawn_on(free_port, scratch_dir(), false))
    }

    /// Its `redis://` URL.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Runs `redis-cli` against it and returns its output.
    pub fn cli(&self, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Calls of scripts it has run (`INFO commandstats`: `EVALSHA` and
    /// `EVAL`), 0 if it does not answer.
    pub fn script_calls(&self) -> u64 {
        script_calls_in(&self.cli(&["INFO", "commandstats"]))
    }

    /// Whether it runs (it was not killed).
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Suspends the process (a hung Redis: connections stay open, nothing
    /// answers) or resumes it.
    pub fn pause(&self, paused: bool) {
        if let Some(c) = &self.child {
            let signal = if paused { "-STOP" } else { "-CONT" };
            let _ = Command::new("kill")
                .args([signal, &c.id().to_string()])
                .status();
        }
    }

    /// Kills the server (a crash, as far as clients can tell).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same port.
    pub fn restart(&mut self) {
        self.kill();
        let again = Self::spawn(self.port, self.dir.clone(), self.cluster);
        *self = again;
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A 3-master Redis Cluster on free ports (optionally with a replica per
/// master).
#[derive(Debug)]
pub struct Cluster {
    /// Its nodes.
    pub nodes: Vec<Server>,
}

impl Cluster {
    /// Three masters, slots assigned, `cluster_state:ok`; `None` (skip)
    /// if redis-server is missing.
    pub fn start() -> Option<Self> {
        Self::start_with(0)
    }

    /// Three masters, each with a replica in sync, `cluster_state:ok`
    /// (nodes 0 to 2 are the masters at first); `None` (skip) if
    /// redis-server is missing.
    pub fn start_with_replicas() -> Option<Self> {
        let cluster = Self::start_with(1)?;
        // `redis-cli --cluster create` makes the first nodes listed the
        // masters; `master_holding` relies on it.
        for n in cluster.nodes.iter().take(3) {
            assert!(
                n.cli(&["ROLE"]).starts_with("master"),
                "node {} is not a master",
                n.port
            );
        }
        wait_for(20, "replicas in sync", || {
            cluster.nodes.iter().all(|n| {
                let info = n.cli(&["INFO", "replication"]);
                info.contains("role:master") || info.contains("master_link_status:up")
            })
        });
        Some(cluster)
    }

    fn start_with(replicas: usize) -> Option<Self> {
        if !available() {
            return None;
        }
        let dir = scratch_dir();
        let nodes: Vec<Server> = (0..3 * (1 + replicas))
            .map(|_| Server::spawn_on(free_cluster_port, dir.clone(), true))
            .collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "cluster create: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let cluster = Self { nodes };
        cluster.wait_until_ok();
        Some(cluster)
    }

    /// Waits until every live node says `cluster_state:ok`.
    pub fn wait_until_ok(&self) {
        wait_for(30, "cluster_state:ok", || {
            self.nodes
                .iter()
                .filter(|n| n.is_running())
                .all(|n| n.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok"))
        });
    }

    /// How many keys each of the first three nodes (the masters at first)
    /// holds.
    fn key_counts(&self) -> Vec<u64> {
        self.nodes
            .iter()
            .take(3)
            .map(|n| n.cli(&["DBSIZE"]).trim().parse().unwrap_or(0))
            .collect()
    }

    /// The master (of the first three nodes) that holds the key `write`
    /// writes first (its key count changes): `None` if none changed.
    pub async fn master_holding<F: std::future::Future<Output = ()>>(
        &self,
        write: impl FnOnce() -> F,
    ) -> Option<usize> {
        let before = self.key_counts();
        write().await;
        let after = self.key_counts();
        (0..after.len()).find(|&i| before.get(i) != after.get(i))
    }

    /// The index of the live replica of the master at `master`, if any.
    pub fn replica_of(&self, master: usize) -> Option<usize> {
        let port = self.nodes.get(master)?.port;
        self.nodes.iter().position(|n| {
            n.is_running()
                && n.cli(&["INFO", "replication"])
                    .contains(&format!("master_port:{port}"))
        })
    }

    /// The seed-node list, comma-separated.
    pub fn url(&self) -> String {
        self.nodes
            .iter()
            .map(|n| format!("redis://127.0.0.1:{}", n.port))
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// The Cluster hash slot of a Redis key (CRC16 of its `{hash tag}`, as
/// Redis computes it).
pub fn hash_slot(key: &str) -> u16 {
    crate::conn::hash_slot(key.as_bytes())
}

/// A prefix no other store in this process uses.
pub fn unique_prefix() -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!("t{}", N.fetch_add(1, Ordering::Relaxed))
}

/// A master, its replica and one Redis Sentinel watching them (as
/// `tollgate`), on free ports; [`failover`](Self::failover) promotes the
/// replica.
#[derive(Debug)]
pub struct Sentinels {
    /// The first master.
    pub master: Server,
    /// Its replica (the master after a failover).
    pub replica: Server,
    sentinel: Option<Child>,
    /// The sentinel's port.
    pub sentinel_port: u16,
}

/// Runs `redis-cli -p port args...` and returns its output.
fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Waits up to `secs` for `f`, panicking with `what` after.
fn wait_for(secs: u64, what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl Sentinels {
    /// The three processes, replication up and the sentinel aware of the
    /// replica; `None` (skip) if redis-server is missing.
    pub fn start() -> Option<Self> {
        let master = Server::start()?;
        let replica = Server::start()?;
        let m = master.port.to_string();
        assert_eq!(replica.cli(&["REPLICAOF", "127.0.0.1", &m]).trim(), "OK");
        wait_for(20, "replication", || {
            replica
                .cli(&["INFO", "replication"])
                .contains("master_link_status:up")
        });
        let port = free_port();
        let dir = scratch_dir();
        let conf = dir.join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {}\nsentinel monitor tollgate 127.0.0.1 {m} 1\nsentinel down-after-milliseconds tollgate 1000\nsentinel failover-timeout tollgate 5000\n",
                dir.display()
            ),
        )
        .unwrap();
        let child = Command::new("redis-server")
            .arg(&conf)
            .arg("--sentinel")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let set = Self {
            master,
            replica,
            sentinel: Some(child),
            sentinel_port: port,
        };
        wait_for(10, "the sentinel", || ping(port));
        let r = set.replica.port.to_string();
        wait_for(30, "the sentinel to see the replica", || {
            cli(port, &["SENTINEL", "replicas", "tollgate"]).contains(&r)
        });
        Some(set)
    }

    /// The store URL: `redis+sentinel://127.0.0.1:<port>/tollgate`.
    pub fn url(&self) -> String {
        format!("redis+sentinel://127.0.0.1:{}/tollgate", self.sentinel_port)
    }

    /// The master's port as the sentinel says.
    pub fn master_port(&self) -> u16 {
        cli(
            self.sentinel_port,
            &["SENTINEL", "get-master-addr-by-name", "tollgate"],
        )
        .lines()
        .nth(1)
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or(0)
    }

    /// Fails the master over to the replica, and waits until the sentinel
    /// names it.
    pub fn failover(&self) {
        let to = self.replica.port;
        wait_for(30, "a failover", || {
            if self.master_port() == to {
                return true;
            }
            // Refused while the sentinel is not ready (e.g. a failover is
            // already in progress): ask again.
            let _ = cli(self.sentinel_port, &["SENTINEL", "FAILOVER", "tollgate"]);
            std::thread::sleep(Duration::from_millis(200));
            self.master_port() == to
        });
    }
}

impl Drop for Sentinels {
    fn drop(&mut self) {
        if let Some(mut c) = self.sentinel.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A TCP proxy on a free loopback port that delays every chunk, each way,
/// by a fixed time (latency without a bandwidth limit, order kept), as a
/// distant Redis looks: round trips take twice the delay. Runs on the
/// current Tokio runtime until dropped.
#[derive(Debug)]
pub struct Delayed {
    /// Its port on 127.0.0.1.
    pub port: u16,
    /// Where new connections go (a virtual IP's failover moves it).
    target: std::sync::Arc<std::sync::atomic::AtomicU16>,
    task: tokio::task::JoinHandle<()>,
}

impl Delayed {
    /// Proxies to `127.0.0.1:target`, delaying each way by `delay`.
    pub async fn start(target: u16, delay: Duration) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let target = std::sync::Arc::new(std::sync::atomic::AtomicU16::new(target));
        let to = std::sync::Arc::clone(&target);
        let task = tokio::spawn(async move {
            // The connections' tasks end with the proxy's.
            let mut conns = tokio::task::JoinSet::new();
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    // Out of descriptors, say: try again shortly.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                let target = to.load(std::sync::atomic::Ordering::SeqCst);
                let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", target)).await else {
                    continue;
                };
                // No Nagle: the delay is the one configured.
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                conns.spawn(delay_one_way(cr, sw, delay));
                conns.spawn(delay_one_way(sr, cw, delay));
            }
        });
        Self { port, target, task }
    }

    /// Sends new connections to `127.0.0.1:target` from now on (the
    /// connections made before stay where they are), as a DNS name or a
    /// virtual IP moves to a new master.
    pub fn retarget(&self, target: u16) {
        self.target
            .store(target, std::sync::atomic::Ordering::SeqCst);
    }

    /// Its `redis://` URL.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

impl Drop for Delayed {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copies `from` to `to`, each chunk `delay` after it was read.
async fn delay_one_way(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    delay: Duration,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    let writer = tokio::spawn(async move {
        while let Some((at, chunk)) = rx.recv().await {
            tokio::time::sleep_until(at).await;
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
    });
    let mut buf = vec![0u8; 64 << 10];
    loop {
        match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                let at = tokio::time::Instant::now() + delay;
                let chunk = buf.get(..n).unwrap_or_default().to_vec();
                if tx.send((at, chunk)).is_err() {
                    break;
                }
            }
        }
    }
    drop(tx);
    let _ = writer.await;
}

/// The script calls (`EVALSHA` and `EVAL`) an `INFO commandstats` reply
/// counts.
pub fn script_calls_in(commandstats: &str) -> u64 {
    commandstats
        .lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
        .filter_map(|l| {
            l.split("calls=")
                .nth(1)?
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

/// TLS for tests: a CA of the test's own, a certificate for 127.0.0.1
/// signed by it, and TLS-only `redis-server` processes (standalone, or a
/// sentinel) using them. `openssl` must be on `PATH`.
#[derive(Debug)]
pub struct Tls {
    dir: PathBuf,
    /// Removes the directory when dropped.
    _certs: Certs,
}

/// Certificates for tests, made with `openssl` (which must be on
/// `PATH`) in a directory of their own, removed on drop: a CA
/// (`ca.crt`, `ca.key`), a server certificate for 127.0.0.1 and
/// localhost (`server.crt`, `server.key`) and a client certificate
/// (`client.crt`, `client.key`, extended key usage clientAuth), both
/// signed by the CA.
#[derive(Debug)]
pub struct Certs {
    dir: PathBuf,
}

impl Certs {
    /// Makes them (panics if `openssl` fails: a test's setup).
    pub fn make() -> Self {
        let certs = Self { dir: scratch_dir() };
        certs.openssl(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "1",
            "-subj",
            "/CN=tollgate test CA",
        ]);
        std::fs::write(
            certs.path("server.cnf"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
        )
        .unwrap();
        std::fs::write(certs.path("client.cnf"), "extendedKeyUsage=clientAuth\n").unwrap();
        for (who, ext) in [("server", "server.cnf"), ("client", "client.cnf")] {
            let (key, csr, crt) = (
                format!("{who}.key"),
                format!("{who}.csr"),
                format!("{who}.crt"),
            );
            certs.openssl(&[
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                &key,
                "-out",
                &csr,
                "-subj",
                &format!("/CN={who}"),
            ]);
            certs.openssl(&[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                &crt,
                "-days",
                "1",
                "-extfile",
                ext,
            ]);
        }
        certs
    }

    fn openssl(&self, args: &[&str]) {
        let ok = Command::new("openssl")
            .args(args)
            .current_dir(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap()
            .success();
        assert!(ok, "openssl {args:?}");
    }

    /// The path of one of its files (`ca.crt`, `server.crt`, ...).
    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }
}

impl Drop for Certs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Tls {
    /// The certificates, or `None` (skip) where `redis-server` is missing
    /// or was built without TLS (it came with Redis 6.0, and a build
    /// without `BUILD_TLS=yes` has none: `.ci/redis-versions` builds 5.0
    /// and 6.2 so).
    pub fn start() -> Option<Self> {
        if !available() {
            return None;
        }
        // A made-up directive after `tls-port` stops the server at once:
        // a build with TLS stops on it, one without on `tls-port`.
        let built = Command::new("redis-server")
            .args(["--tls-port", "0", "--port", "0", "--not-a-directive", "0"])
            .output()
            .is_ok_and(|o| {
                let said = [&o.stdout[..], &o.stderr[..]].concat();
                !String::from_utf8_lossy(&said).contains(">>> 'tls-port")
            });
        if !built {
            eprintln!("skipping: this redis-server was built without TLS");
            return None;
        }
        let certs = Certs::make();
        Some(Self {
            dir: certs.dir.clone(),
            _certs: certs,
        })
    }

    /// The path of one of its files (`ca.crt`, `server.crt`, ...).
    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }

    /// The CA's certificate (PEM).
    pub fn ca(&self) -> Vec<u8> {
        std::fs::read(self.path("ca.crt")).unwrap()
    }

    /// The settings of a TLS-only server (or sentinel) on `port`, in a
    /// config file's syntax.
    fn config(&self, port: u16) -> String {
        let p = |f: &str| self.path(f).display().to_string();
        format!(
            "port 0\ntls-port {port}\nbind 127.0.0.1\ntls-cert-file {}\ntls-key-file {}\n\
             tls-ca-cert-file {}\ntls-auth-clients no\ntls-replication yes\ndir {}\n",
            p("server.crt"),
            p("server.key"),
            p("ca.crt"),
            self.dir.display()
        )
    }

    /// A TLS-only `redis-server` (no plain port), killed on drop; with
    /// `password`, one that requires it.
    pub fn server(&self, password: Option<&str>) -> TlsProcess {
        let auth = password.map_or_else(String::new, |p| format!("requirepass {p}\n"));
        self.spawn(
            "server",
            &format!("save \"\"\nappendonly no\n{auth}"),
            false,
        )
    }

    /// A TLS-only sentinel monitoring `master` (a [`server`](Self::server)
    /// of this CA, which requires `password` if given) as service
    /// `tollgate`, killed on drop; it reaches the master over TLS too.
    pub fn sentinel(&self, master: &TlsProcess, password: Option<&str>) -> TlsProcess {
        let auth = password.map_or_else(String::new, |p| {
            format!("sentinel auth-pass tollgate {p}\n")
        });
        let extra = format!(
            "sentinel monitor tollgate 127.0.0.1 {} 1\nsentinel down-after-milliseconds tollgate 1000\n{auth}",
            master.port
        );
        self.spawn("sentinel", &extra, true)
    }

    fn spawn(&self, name: &str, extra: &str, sentinel: bool) -> TlsProcess {
        let port = free_port();
        let conf = self.path(&format!("{name}-{port}.conf"));
        std::fs::write(&conf, format!("{}{extra}", self.config(port))).unwrap();
        let mut command = Command::new("redis-server");
        command.arg(&conf);
        if sentinel {
            command.arg("--sentinel");
        }
        let child = command
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let process = TlsProcess {
            port,
            child: Some(child),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "the TLS {name} did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        process
    }
}

/// A TLS-only `redis-server` or sentinel of [`Tls`], killed on drop.
#[derive(Debug)]
pub struct TlsProcess {
    /// Its TLS port on 127.0.0.1.
    pub port: u16,
    child: Option<Child>,
}

impl Drop for TlsProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
