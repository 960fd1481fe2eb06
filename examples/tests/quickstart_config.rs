//! The quickstart binary with a policy file: it refuses to start on a bad
//! one, naming the field, and reloads a good one on SIGHUP.
#![allow(missing_docs, clippy::unwrap_used, clippy::panic)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The built-in policy, its per-key rule at 1 a minute in bursts of
/// `burst`.
fn policy(burst: u32) -> String {
    let text = include_str!("../quickstart.toml");
    let per_key = "rate = \"10/s\"\nburst = 20\n";
    assert!(text.contains(per_key));
    text.replacen(per_key, &format!("rate = \"1/min\"\nburst = {burst}\n"), 1)
}

fn dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("tollgate-qs-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The status of `GET /api/hello` with `x-api-key: key`.
fn hello(addr: &str, key: &str) -> u16 {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET /api/hello HTTP/1.1\r\nhost: x\r\nx-api-key: {key}\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn a_bad_policy_file_stops_the_server_naming_the_field() {
    let d = dir("bad");
    let path = d.join("policy.toml");
    std::fs::write(&path, policy(0)).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_quickstart"))
        .env("TOLLGATE_CONFIG", &path)
        .env("TOLLGATE_ADDR", "127.0.0.1:0")
        .env_remove("TOLLGATE_REDIS_URL")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let line = policy(0).lines().position(|l| l == "burst = 0").unwrap() + 1;
    assert!(
        stderr.contains(&format!(
            "{}:{line}:9: rules[0].burst: must be at least 1",
            path.display()
        )),
        "{stderr}"
    );
    std::fs::remove_dir_all(&d).unwrap();
}

#[cfg(unix)]
#[test]
fn the_policy_file_reloads_on_sighup() {
    let d = dir("hup");
    let path = d.join("policy.toml");
    std::fs::write(&path, policy(1)).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_quickstart"))
        .env("TOLLGATE_CONFIG", &path)
        .env("TOLLGATE_ADDR", "127.0.0.1:0")
        .env_remove("TOLLGATE_REDIS_URL")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let addr = loop {
        let line = lines.next().unwrap().unwrap();
        if let Some(rest) = line.split("http://").nth(1) {
            break rest.split_whitespace().next().unwrap().to_owned();
        }
    };
    assert_eq!(hello(&addr, "k"), 200);
    assert_eq!(hello(&addr, "k"), 429);
    // A bigger burst; GCRA goes on from the key's state, so the key has
    // 4 more at once. SIGHUP reloads (the file watcher would too, within
    // its 2-s poll).
    std::fs::write(&path, policy(5)).unwrap();
    let pid = child.id().to_string();
    assert!(Command::new("kill")
        .args(["-HUP", &pid])
        .status()
        .unwrap()
        .success());
    let deadline = Instant::now() + Duration::from_secs(20);
    while hello(&addr, "k") == 429 {
        assert!(Instant::now() < deadline, "the policy did not reload");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Reloaded: "k" got 1 of its 4, and has 3 left.
    for _ in 0..3 {
        assert_eq!(hello(&addr, "k"), 200);
    }
    assert_eq!(hello(&addr, "k"), 429);
    child.kill().unwrap();
    child.wait().unwrap();
    std::fs::remove_dir_all(&d).unwrap();
}

/// The status of `GET path` at `addr`.
fn get(addr: &str, path: &str) -> u16 {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Policy-security review #20: the quickstart served `/metrics` (rule and
/// plan names, the Redis breaker's state) on its public port only. With
/// `TOLLGATE_METRICS_ADDR` it serves them on that listener, and the
/// public port has none.
#[test]
fn metrics_go_to_their_own_listener_when_named() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_quickstart"))
        .env("TOLLGATE_ADDR", "127.0.0.1:0")
        .env("TOLLGATE_METRICS_ADDR", "127.0.0.1:0")
        .env_remove("TOLLGATE_REDIS_URL")
        .env_remove("TOLLGATE_CONFIG")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let (mut public, mut internal) = (None, None);
    while public.is_none() || internal.is_none() {
        let line = lines.next().unwrap().unwrap();
        let Some(rest) = line.split("http://").nth(1) else {
            continue;
        };
        let addr = rest.split(['/', ' ']).next().unwrap().to_owned();
        if line.starts_with("metrics on") {
            internal = Some(addr);
        } else if line.contains("listening on") {
            public = Some(addr);
        }
    }
    let (public, internal) = (public.unwrap(), internal.unwrap());
    assert_eq!(get(&public, "/healthz"), 200);
    assert_eq!(get(&public, "/metrics"), 404, "metrics on the public port");
    assert_eq!(get(&internal, "/metrics"), 200);
    child.kill().unwrap();
    child.wait().unwrap();
}
