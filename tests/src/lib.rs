//! Helpers for the end-to-end tests: a real HTTP/1.1 client over loopback
//! TCP, and a raw-bytes client for requests no well-behaved client sends.

pub mod load;

use std::net::SocketAddr;

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A response, fully read.
#[derive(Debug)]
pub struct Reply {
    /// Its status.
    pub status: StatusCode,
    /// Its headers.
    pub headers: HeaderMap,
    /// Its body, as text (lossy).
    pub body: String,
}

impl Reply {
    /// The item of a structured-field list header (`RateLimit`,
    /// `RateLimit-Policy`) that names `rule`, e.g. `"per-key";r=3;t=1`, or
    /// `""`.
    pub fn item(&self, name: &str, rule: &str) -> &str {
        let quoted = format!("\"{rule}\";");
        self.header(name)
            .split(", ")
            .find(|item| item.starts_with(&quoted))
            .unwrap_or("")
    }

    /// A header's value as text, or `""`.
    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }
}

/// Sends `req` to `addr` over a fresh HTTP/1.1 connection.
pub async fn send(
    addr: SocketAddr,
    req: Request<Bytes>,
) -> Result<Reply, Box<dyn std::error::Error + Send + Sync>> {
    let stream = TcpStream::connect(addr).await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let (parts, body) = req.into_parts();
    let mut req = Request::from_parts(parts, Full::new(body));
    if !req.headers().contains_key(http::header::HOST) {
        req.headers_mut().insert(
            http::header::HOST,
            http::HeaderValue::from_static("localhost"),
        );
    }
    let res = sender.send_request(req).await?;
    let (parts, body) = res.into_parts();
    let body = body.collect().await?.to_bytes();
    Ok(Reply {
        status: parts.status,
        headers: parts.headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

/// Writes `raw` bytes as a request and returns the response's status code
/// (0 if the server closed the connection without answering).
pub async fn send_raw(addr: SocketAddr, raw: &[u8]) -> std::io::Result<u16> {
    let mut stream = TcpStream::connect(addr).await?;
    stream.write_all(raw).await?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(chunk.get(..n).unwrap_or_default());
        if buf.windows(4).any(|w| w == b"\r\n\r\n") {
            break;
        }
    }
    let line = String::from_utf8_lossy(&buf);
    Ok(line
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0))
}
