//! TLS (`rediss://`) against a TLS-only `redis-server`, with a CA the test
//! makes itself: the store verifies the server against that CA, and one
//! that does not trust it gets no answer from Redis (its failure policy
//! answers).
#![cfg(feature = "tls")]
#![allow(missing_docs, clippy::unwrap_used, clippy::panic)]

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tollgate_core::{Limit, Limiter, Rate, Rule, Store};
use tollgate_redis::testing::unique_prefix;
use tollgate_redis::{FailurePolicy, RedisStore};

fn run(dir: &Path, args: &[&str]) {
    let ok = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap()
        .success();
    assert!(ok, "openssl {args:?}");
}

/// A CA and a server certificate for 127.0.0.1 signed by it.
fn certificates(dir: &Path) {
    run(
        dir,
        &[
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
        ],
    );
    run(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=localhost",
        ],
    );
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
    )
    .unwrap();
    run(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.crt",
            "-days",
            "1",
            "-extfile",
            "ext.cnf",
        ],
    );
}

struct TlsServer(Child);

impl Drop for TlsServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn store(url: &str, root: Option<Vec<u8>>) -> RedisStore {
    let mut b = RedisStore::builder(url)
        .prefix(&unique_prefix())
        .timeout(Duration::from_secs(2))
        .failure_policy(FailurePolicy::Closed);
    if let Some(root) = root {
        b = b.tls_root_cert(root);
    }
    b.build().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_with_a_ca_of_its_own() {
    if Command::new("redis-server")
        .arg("--version")
        .output()
        .is_err()
    {
        assert!(
            std::env::var("TOLLGATE_REQUIRE_REDIS").map_or(true, |v| v != "1"),
            "redis-server is not on PATH and TOLLGATE_REQUIRE_REDIS=1"
        );
        return;
    }
    // TLS came with Redis 6.0, and a build without `BUILD_TLS=yes` has
    // none (`.ci/redis-versions` builds 5.0 and 6.2 so): nothing to test.
    // (A made-up directive after `tls-port` stops the server at once: a
    // build with TLS stops on it, one without on `tls-port`.)
    let tls_built = Command::new("redis-server")
        .args(["--tls-port", "0", "--port", "0", "--not-a-directive", "0"])
        .output()
        .is_ok_and(|o| {
            let said = [&o.stdout[..], &o.stderr[..]].concat();
            !String::from_utf8_lossy(&said).contains(">>> 'tls-port")
        });
    if !tls_built {
        return;
    }
    let dir = std::env::temp_dir().join(format!("tollgate-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    certificates(&dir);
    let port = free_port();
    let p = |f: &str| dir.join(f).display().to_string();
    let _server = TlsServer(
        Command::new("redis-server")
            .args([
                "--port",
                "0",
                "--tls-port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
            ])
            .args([
                "--tls-cert-file",
                &p("server.crt"),
                "--tls-key-file",
                &p("server.key"),
            ])
            .args([
                "--tls-ca-cert-file",
                &p("ca.crt"),
                "--tls-auth-clients",
                "no",
            ])
            .args(["--save", "", "--appendonly", "no", "--dir", &p("")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "the TLS server did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let url = format!("rediss://127.0.0.1:{port}");
    let rule = Rule::new("per-key", Limit::gcra(Rate::per_minute(1), 2)).unwrap();
    let ca = std::fs::read(dir.join("ca.crt")).unwrap();
    let trusted = store(&url, Some(ca)).limiter(&rule).unwrap();
    // Redis answers over TLS: 2 of 2, then refused with the script's wait
    // (the Closed failure policy would say 1 s).
    assert_eq!(trusted.decide(b"k", 1).await.unwrap().remaining, 1);
    assert_eq!(trusted.decide(b"k", 1).await.unwrap().remaining, 0);
    let wait = trusted
        .decide(b"k", 1)
        .await
        .unwrap()
        .retry_after()
        .unwrap();
    assert!(
        wait > Duration::from_secs(50) && wait <= Duration::from_secs(60),
        "{wait:?}"
    );
    // Without the CA, the server's certificate is not trusted: no answer
    // from Redis, so the failure policy's (Closed: refused, 1 s).
    let untrusted = store(&url, None).limiter(&rule).unwrap();
    let d = untrusted.decide(b"other", 1).await.unwrap();
    assert!(!d.is_allowed());
    assert_eq!(d.retry_after(), Some(Duration::from_secs(1)));
    // A root of its own is for a standalone URL: elsewhere, an error.
    for url in [
        "redis+cluster://127.0.0.1:1",
        "redis+sentinel://127.0.0.1:1/x",
    ] {
        let e = RedisStore::builder(url)
            .prefix("p")
            .tls_root_cert(b"pem".to_vec())
            .build()
            .unwrap_err();
        assert_eq!(e.field(), "tls_root_cert");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
