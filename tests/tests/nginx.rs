//! A real NGINX, configured with `examples/nginx/tollgate.conf` (its
//! `auth_request` to `tollgate-server`), in front of a small upstream:
//! each client, by its `X-Forwarded-For`, gets its limit, a refusal is a
//! `429` with `Retry-After` and never reaches the upstream.
//!
//! Needs `nginx` (Debian: nginx-light, which has the auth_request
//! module). Without it the test skips, or fails with
//! `TOLLGATE_REQUIRE_NGINX=1` (as CI sets).
#![allow(missing_docs, clippy::unwrap_used, clippy::arithmetic_side_effects)]

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use tollgate::config::{PolicyFile, Tollgate};
use tollgate::MemoryStore;
use tollgate_tests::send;

const POLICY: &str = r#"
trusted_proxies = ["127.0.0.1/32"]

[[rules]]
name = "per-client"
key = "client-ip"
rate = "1/h"
burst = 2
"#;

/// The nginx binary, if this machine has one.
fn nginx() -> Option<String> {
    ["nginx", "/usr/sbin/nginx"]
        .into_iter()
        .find(|bin| {
            Command::new(bin)
                .arg("-v")
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
        .map(str::to_owned)
}

/// An NGINX process, stopped when dropped.
struct Nginx(Child);

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn free_port() -> u16 {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    l.local_addr().unwrap().port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_auth_request_enforces_each_clients_limit() {
    let Some(bin) = nginx() else {
        assert!(
            std::env::var_os("TOLLGATE_REQUIRE_NGINX").is_none(),
            "TOLLGATE_REQUIRE_NGINX is set and there is no nginx"
        );
        eprintln!("skipped: no nginx on this machine");
        return;
    };
    // The decision server.
    let file = PolicyFile::parse(POLICY).unwrap();
    let gate = Tollgate::for_decisions(&file, &MemoryStore::new()).unwrap();
    let decisions = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let decisions_addr = decisions.local_addr().unwrap();
    tokio::spawn(tollgate_server::serve(
        decisions,
        tollgate_server::decisions(gate),
    ));
    // The upstream, counting what reaches it.
    let hits = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&hits);
    let upstream = axum::Router::new().fallback(move || {
        counted.fetch_add(1, Ordering::SeqCst);
        async { "upstream ok\n" }
    });
    let upstream_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream_addr = upstream_listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(upstream_listener, upstream).await });
    // NGINX with the example's server block, its addresses replaced.
    let port = free_port().await;
    let dir = std::env::temp_dir().join(format!("tollgate-nginx-{}-{port}", std::process::id()));
    std::fs::create_dir_all(dir.join("tmp")).unwrap();
    let example = include_str!("../../examples/nginx/tollgate.conf")
        .replace("127.0.0.1:8080", &upstream_addr.to_string())
        .replace("127.0.0.1:8081", &decisions_addr.to_string())
        .replace("listen 127.0.0.1:8000", &format!("listen 127.0.0.1:{port}"));
    std::fs::write(dir.join("tollgate.conf"), example).unwrap();
    let d = dir.display();
    std::fs::write(
        dir.join("nginx.conf"),
        format!(
            "daemon off;\nmaster_process off;\nworker_processes 1;\nerror_log {d}/error.log;\npid {d}/nginx.pid;\n\
             events {{ worker_connections 64; }}\n\
             http {{\n  access_log off;\n  client_body_temp_path {d}/tmp;\n  proxy_temp_path {d}/tmp;\n  \
             fastcgi_temp_path {d}/tmp;\n  uwsgi_temp_path {d}/tmp;\n  scgi_temp_path {d}/tmp;\n  \
             include {d}/tollgate.conf;\n}}\n"
        ),
    )
    .unwrap();
    let _nginx = Nginx(
        Command::new(&bin)
            .arg("-p")
            .arg(&dir)
            .arg("-c")
            .arg(dir.join("nginx.conf"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut up = false;
    for _ in 0..100 {
        if tokio::net::TcpStream::connect(addr).await.is_ok() {
            up = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let log = || std::fs::read_to_string(dir.join("error.log")).unwrap_or_default();
    assert!(up, "nginx did not start: {}", log());
    let from = |ip: &str| {
        Request::get("/api/hello")
            .header("x-forwarded-for", ip)
            .body(Bytes::new())
            .unwrap()
    };
    // Two a client; the third is refused by NGINX, from the decision.
    for i in 0..2 {
        let r = send(addr, from("203.0.113.9")).await.unwrap();
        assert_eq!(r.status, 200, "request {i}: {r:?} {}", log());
        assert_eq!(r.body, "upstream ok\n");
        assert!(r.header("ratelimit").contains("\"per-client\";r="), "{r:?}");
    }
    let r = send(addr, from("203.0.113.9")).await.unwrap();
    assert_eq!(r.status, 429, "{r:?} {}", log());
    let wait: u64 = r.header("retry-after").parse().unwrap();
    assert!((3590..=3600).contains(&wait), "{r:?}");
    assert!(
        r.header("ratelimit").contains("\"per-client\";r=0"),
        "{r:?}"
    );
    assert_eq!(
        hits.load(Ordering::SeqCst),
        2,
        "a refusal reached the upstream"
    );
    // Another client is another budget; what a client writes left of
    // its own address in X-Forwarded-For is not its address: NGINX
    // appends the peer it saw, and the server reads right to left,
    // skipping the trusted proxy only.
    for spoof in ["198.51.100.1", "198.51.100.2", "198.51.100.3"] {
        let r = send(addr, from(&format!("{spoof}, 203.0.113.10")))
            .await
            .unwrap();
        let want = if spoof.ends_with('3') { 429 } else { 200 };
        assert_eq!(r.status, want, "{spoof}: {r:?}");
    }
    // A refusal that is not a rate's keeps its own status: an unreadable
    // X-Forwarded-For names no client, and the rule refuses a request
    // without its key (400, not a 429 to retry).
    let r = send(
        addr,
        Request::get("/api/hello")
            .header("x-forwarded-for", "bad")
            .body(Bytes::new())
            .unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 400, "{r:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
