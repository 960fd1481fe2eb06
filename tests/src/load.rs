//! A load generator on loopback for the quickstart's protection (the
//! seeds' load tests: bursts of ten times the rate, plateaus at the limit,
//! slow POSTs, slow readers): each phase drives real HTTP/1.1 connections
//! and counts what was admitted against what the limits allow. The
//! `load` bench runs it long and prints figures; the `load` test runs it
//! short and checks counts (never times).

// Counts of requests a run sends (millions at most) and byte counts: no
// overflow to guard against.
#![allow(clippy::arithmetic_side_effects)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

type Error = Box<dyn std::error::Error + Send + Sync>;

/// What one phase saw.
#[derive(Debug, Clone, Default)]
pub struct Phase {
    /// Requests sent.
    pub sent: u64,
    /// Answered 2xx.
    pub admitted: u64,
    /// Answered 429.
    pub limited: u64,
    /// Answered 503 (an in-flight limit's refusal).
    pub unavailable: u64,
    /// Any other answer, or no answer.
    pub other: u64,
    /// How long the phase took.
    pub took: Duration,
    /// Latencies of the admitted requests, sorted.
    pub latencies: Vec<Duration>,
}

impl Phase {
    /// The `p`-quantile (0 to 1) of the admitted requests' latencies.
    pub fn percentile(&self, p: f64) -> Duration {
        if self.latencies.is_empty() {
            return Duration::ZERO;
        }
        #[allow(
            clippy::cast_precision_loss,
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss
        )]
        let i = ((self.latencies.len() - 1) as f64 * p.clamp(0.0, 1.0)).round() as usize;
        self.latencies.get(i).copied().unwrap_or_default()
    }

    fn count(&mut self, status: Option<StatusCode>, latency: Duration) {
        self.sent += 1;
        match status {
            Some(s) if s.is_success() => {
                self.admitted += 1;
                self.latencies.push(latency);
            }
            Some(StatusCode::TOO_MANY_REQUESTS) => self.limited += 1,
            Some(StatusCode::SERVICE_UNAVAILABLE) => self.unavailable += 1,
            _ => self.other += 1,
        }
    }

    /// Adds `other`'s counts and latencies to these (the latencies
    /// unsorted: sort before reading percentiles); the longer `took`.
    pub fn merge(&mut self, other: Phase) {
        self.took = self.took.max(other.took);
        self.sent += other.sent;
        self.admitted += other.admitted;
        self.limited += other.limited;
        self.unavailable += other.unavailable;
        self.other += other.other;
        self.latencies.extend(other.latencies);
    }
}

/// One keep-alive HTTP/1.1 connection.
struct Conn(hyper::client::conn::http1::SendRequest<Full<Bytes>>);

impl Conn {
    async fn open(addr: SocketAddr) -> Result<Self, Error> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(conn);
        Ok(Self(sender))
    }

    /// Sends `GET path` with `headers`: the response, its body unread.
    async fn send(
        &mut self,
        path: &str,
        headers: &[(&str, &str)],
    ) -> Result<http::Response<hyper::body::Incoming>, Error> {
        let mut req = Request::get(path).header(http::header::HOST, "localhost");
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        let req = req.body(Full::new(Bytes::new()))?;
        self.0.ready().await?;
        Ok(self.0.send_request(req).await?)
    }

    /// `GET path` with `headers`: its status, the body read to its end.
    async fn get(&mut self, path: &str, headers: &[(&str, &str)]) -> Option<StatusCode> {
        let res = self.send(path, headers).await.ok()?;
        let status = res.status();
        res.into_body().collect().await.ok()?;
        Some(status)
    }
}

/// Who sends: an API key, and the address a trusted proxy on loopback
/// reports for it (`X-Forwarded-For`), if any.
#[derive(Debug, Clone)]
pub struct Client {
    /// Its `x-api-key`.
    pub key: String,
    /// Its `X-Forwarded-For`.
    pub address: Option<String>,
}

impl Client {
    /// Client number `i`: key `client-<i>`, address `10.<i>` (so that
    /// each has its own per-address budgets behind a trusted proxy).
    pub fn numbered(i: u32) -> Self {
        let [_, b, c, d] = i.to_be_bytes();
        Self {
            key: format!("client-{i}"),
            address: Some(format!("10.{b}.{c}.{d}")),
        }
    }

    fn headers(&self) -> Vec<(&str, &str)> {
        let mut h = vec![("x-api-key", self.key.as_str())];
        if let Some(a) = &self.address {
            h.push(("x-forwarded-for", a.as_str()));
        }
        h
    }
}

/// `rate` requests a second of `GET path` as `client`, spread over
/// `connections` keep-alive connections, for `duration`: what was
/// admitted. Each request is due at its time in the schedule and sent
/// then, or as soon as its connection's previous answer is in (each
/// connection waits for its answers); latency runs from the send, so a
/// server slower than the schedule shows as requests sent late.
pub async fn paced(
    addr: SocketAddr,
    path: &str,
    client: &Client,
    rate: u32,
    duration: Duration,
    connections: usize,
) -> Result<Phase, Error> {
    let connections = connections.max(1);
    let start = Instant::now();
    let interval = Duration::from_secs(1) / rate.max(1);
    let total = duration.as_nanos() / interval.as_nanos().max(1);
    let total = u64::try_from(total).unwrap_or(u64::MAX);
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..connections {
        let mut conn = Conn::open(addr).await?;
        let (next, path, client) = (Arc::clone(&next), path.to_owned(), client.clone());
        tasks.push(tokio::spawn(async move {
            let mut phase = Phase::default();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= total {
                    break;
                }
                let due = start + interval * u32::try_from(i).unwrap_or(u32::MAX);
                tokio::time::sleep_until(due.into()).await;
                let sent = Instant::now();
                let status = conn.get(&path, &client.headers()).await;
                phase.count(status, sent.elapsed());
            }
            phase
        }));
    }
    gather(tasks, start).await
}

/// The phases of `tasks`, merged, timed from `start`.
async fn gather(
    tasks: Vec<tokio::task::JoinHandle<Phase>>,
    start: Instant,
) -> Result<Phase, Error> {
    let mut phase = Phase::default();
    for t in tasks {
        phase.merge(t.await?);
    }
    phase.took = start.elapsed();
    phase.latencies.sort();
    Ok(phase)
}

/// `n` requests of `GET path` as client `key`, sent as fast as
/// `connections` keep-alive connections carry them (a burst).
pub async fn at_once(
    addr: SocketAddr,
    path: &str,
    key: &str,
    n: u64,
    connections: usize,
) -> Result<Phase, Error> {
    let start = Instant::now();
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..connections.max(1) {
        let mut conn = Conn::open(addr).await?;
        let (next, path, key) = (Arc::clone(&next), path.to_owned(), key.to_owned());
        tasks.push(tokio::spawn(async move {
            let mut phase = Phase::default();
            while next.fetch_add(1, Ordering::Relaxed) < n {
                let sent = Instant::now();
                let status = conn.get(&path, &[("x-api-key", &key)]).await;
                phase.count(status, sent.elapsed());
            }
            phase
        }));
    }
    gather(tasks, start).await
}

/// Slow POSTs under way (see [`slow_posts`]).
#[derive(Debug)]
pub struct SlowPosts {
    statuses: Arc<std::sync::Mutex<Vec<u16>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl SlowPosts {
    /// The statuses of the answers in so far (0: closed without one).
    pub fn answered(&self) -> Vec<u16> {
        self.statuses.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Waits for every client to end: the statuses of the answers.
    pub async fn finish(mut self) -> Vec<u16> {
        for t in std::mem::take(&mut self.tasks) {
            let _ = t.await;
        }
        self.answered()
    }
}

/// One connection per client, each starting a `POST path` with a body of
/// `length` bytes and sending it one byte every `every` (a slow POST),
/// for at most `hold`: the answer's status is recorded when it comes,
/// and the body goes on trickling after it (a client that does not read
/// answers) until the server closes the connection.
pub async fn slow_posts(
    addr: SocketAddr,
    path: &str,
    clients: &[Client],
    length: usize,
    every: Duration,
    hold: Duration,
) -> Result<SlowPosts, Error> {
    let statuses = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for client in clients {
        let mut stream = TcpStream::connect(addr).await?;
        let mut head =
            format!("POST {path} HTTP/1.1\r\nhost: localhost\r\ncontent-length: {length}\r\n");
        for (name, value) in client.headers() {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("\r\n");
        let statuses = Arc::clone(&statuses);
        tasks.push(tokio::spawn(async move {
            let record = |status: u16| {
                if let Ok(mut s) = statuses.lock() {
                    s.push(status);
                }
            };
            if stream.write_all(head.as_bytes()).await.is_err() {
                record(0);
                return;
            }
            let start = Instant::now();
            let mut got = Vec::new();
            let mut answered = false;
            let mut sent = 0;
            while sent < length && start.elapsed() < hold {
                if let Ok(Ok(())) = tokio::time::timeout(every, stream.readable()).await {
                    let mut buf = [0u8; 1024];
                    match stream.try_read(&mut buf) {
                        Ok(0) => break,
                        Ok(n) => got.extend_from_slice(buf.get(..n).unwrap_or_default()),
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(_) => break,
                    }
                }
                if !answered {
                    if let Some(status) = status_of(&got) {
                        record(status);
                        answered = true;
                    }
                }
                if stream.write_all(b"x").await.is_err() {
                    break;
                }
                sent += 1;
            }
            if !answered {
                record(status_of(&got).unwrap_or(0));
            }
        }));
    }
    Ok(SlowPosts { statuses, tasks })
}

/// The status of an HTTP/1.1 response whose status line `bytes` hold.
fn status_of(bytes: &[u8]) -> Option<u16> {
    if !bytes.contains(&b'\n') {
        return None;
    }
    let line = bytes.split(|b| *b == b'\n').next()?;
    std::str::from_utf8(line)
        .ok()?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// A download read slowly: its status at once, its body read in the
/// background at the pace asked for, until it ends, `hold` passes or
/// [`stop`](Self::stop) (which closes the connection).
#[derive(Debug)]
pub struct SlowReader {
    /// The response's status.
    pub status: StatusCode,
    task: tokio::task::JoinHandle<usize>,
}

impl SlowReader {
    /// Stops reading and closes the connection.
    pub fn stop(&self) {
        self.task.abort();
    }

    /// Waits for the reading to end (the body's end, or `hold`): the
    /// body bytes read.
    pub async fn finish(self) -> usize {
        self.task.await.unwrap_or(0)
    }
}

/// `GET path` as `client`, its body read at `per_second` bytes a
/// second for at most `hold` (a slow reader, e.g. a phone on a poor
/// link): see [`SlowReader`].
pub async fn slow_reader(
    addr: SocketAddr,
    path: &str,
    client: &Client,
    per_second: usize,
    hold: Duration,
) -> Result<SlowReader, Error> {
    let mut conn = Conn::open(addr).await?;
    let res = conn.send(path, &client.headers()).await?;
    let status = res.status();
    let mut body = res.into_body();
    let task = tokio::spawn(async move {
        let _conn = conn;
        let end = tokio::time::Instant::now() + hold;
        let mut read = 0usize;
        // Each frame taken when the pace allows it: the server's writes
        // wait on the socket's buffers meanwhile, as for a slow link.
        loop {
            let frame = tokio::select! {
                () = tokio::time::sleep_until(end) => return read,
                f = body.frame() => f,
            };
            let Some(Ok(frame)) = frame else { return read };
            let n = frame.data_ref().map_or(0, Bytes::len);
            read += n;
            #[allow(clippy::cast_precision_loss)]
            let pause = Duration::from_secs_f64(n as f64 / per_second.max(1) as f64);
            tokio::select! {
                () = tokio::time::sleep_until(end) => return read,
                () = tokio::time::sleep(pause) => {}
            }
        }
    });
    Ok(SlowReader { status, task })
}

/// One `GET path` as client `key` on a connection of its own: its
/// status, the body read to its end (or dropped at once if `drop_body`).
pub async fn get_once(
    addr: SocketAddr,
    path: &str,
    key: &str,
    drop_body: bool,
) -> Result<StatusCode, Error> {
    let mut conn = Conn::open(addr).await?;
    let res = conn.send(path, &[("x-api-key", key)]).await?;
    let status = res.status();
    if !drop_body {
        res.into_body().collect().await?;
    }
    Ok(status)
}

/// This process's resident memory, in bytes (Linux; 0 elsewhere).
pub fn rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb.saturating_mul(1024))
}
