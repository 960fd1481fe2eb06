//! `tollgate-server` over TLS (`[server.tls]`): the decision endpoints
//! and Envoy's rate limit service, with and without client certificates
//! (mutual TLS). Certificates are made for the test with `openssl`
//! (`tollgate_redis::testing::Certs`).
#![allow(missing_docs, clippy::unwrap_used)]

use std::path::Path;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tollgate::config::{PolicyFile, Tollgate};
use tollgate::MemoryStore;
use tollgate_redis::testing::Certs;

/// `[server]` with TLS on `certs` (and client certificates checked, if
/// `mutual`).
fn policy(certs: &Certs, mutual: bool) -> String {
    let p = |f: &str| format!("{:?}", certs.path(f).display().to_string());
    let ca = if mutual {
        format!("client_ca_file = {}\n", p("ca.crt"))
    } else {
        String::new()
    };
    format!(
        "[[rules]]\nname = \"per-client\"\nkey = \"client-ip\"\nrate = \"1/h\"\nburst = 2\n\n\
         [server.tls]\ncert_file = {}\nkey_file = {}\n{ca}",
        p("server.crt"),
        p("server.key"),
    )
}

fn pem_certs(path: &Path) -> Vec<CertificateDer<'static>> {
    CertificateDer::pem_file_iter(path)
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

/// The decision endpoints on TLS, from `policy`.
async fn serve(policy: &str) -> std::net::SocketAddr {
    let file = PolicyFile::parse(policy).unwrap();
    let tls = tollgate_server::tls::load(file.server().unwrap().tls.as_ref().unwrap()).unwrap();
    let gate = Tollgate::for_decisions(&file, &MemoryStore::new()).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = tollgate_server::decisions(gate);
    tokio::spawn(async move { tollgate_server::serve_tls(listener, &tls, app).await });
    addr
}

/// One HTTP/1.1 request over TLS, trusting the test CA (with the client
/// certificate, if `client`): the response's status line, or the error.
async fn get(
    addr: std::net::SocketAddr,
    certs: &Certs,
    client: bool,
    path: &str,
) -> Result<String, String> {
    get_from(addr, certs, client, path, "127.0.0.1").await
}

/// [`get`], from the loopback address `from` (127.0.0.1, 127.0.0.2...).
async fn get_from(
    addr: std::net::SocketAddr,
    certs: &Certs,
    client: bool,
    path: &str,
    from: &str,
) -> Result<String, String> {
    #[allow(deprecated)]
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for c in pem_certs(&certs.path("ca.crt")) {
        roots.add(c).unwrap();
    }
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let config = if client {
        builder
            .with_client_auth_cert(
                pem_certs(&certs.path("client.crt")),
                PrivateKeyDer::from_pem_file(certs.path("client.key")).unwrap(),
            )
            .unwrap()
    } else {
        builder.with_no_client_auth()
    };
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = connect_from(addr, from).await;
    let name = ServerName::try_from("localhost").unwrap();
    let mut tls = connector
        .connect(name, tcp)
        .await
        .map_err(|e| e.to_string())?;
    let req = format!(
        "GET {path} HTTP/1.1\r\nhost: localhost\r\nx-forwarded-method: GET\r\nx-forwarded-uri: /api\r\nconnection: close\r\n\r\n"
    );
    tls.write_all(req.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    tls.read_to_end(&mut out).await.map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&out).into_owned();
    Ok(text.lines().next().unwrap_or_default().to_owned())
}

#[tokio::test]
async fn the_decision_endpoints_serve_tls() {
    let certs = Certs::make();
    let addr = serve(&policy(&certs, false)).await;
    assert_eq!(
        get(addr, &certs, false, "/healthz").await.unwrap(),
        "HTTP/1.1 200 OK"
    );
    // The limit holds over TLS, keyed by the peer's address.
    for _ in 0..2 {
        assert_eq!(
            get(addr, &certs, false, "/check").await.unwrap(),
            "HTTP/1.1 200 OK"
        );
    }
    assert_eq!(
        get(addr, &certs, false, "/check").await.unwrap(),
        "HTTP/1.1 429 Too Many Requests"
    );
    // Plain HTTP on the TLS port gets no answer, and the server goes on.
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    tcp.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut out = Vec::new();
    let _ = tcp.read_to_end(&mut out).await;
    assert!(!String::from_utf8_lossy(&out).contains("200 OK"));
    assert_eq!(
        get(addr, &certs, false, "/healthz").await.unwrap(),
        "HTTP/1.1 200 OK"
    );
}

/// A TCP connection to `addr` from the loopback address `from`.
async fn connect_from(addr: std::net::SocketAddr, from: &str) -> tokio::net::TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(format!("{from}:0").parse().unwrap()).unwrap();
    socket.connect(addr).await.unwrap()
}

/// Review of the TLS listener: clients that open connections and never
/// finish a handshake hold at most 16 handshakes of their address; a
/// further connection from it is closed at once, and other addresses are
/// served all along.
#[tokio::test]
async fn stalled_handshakes_hold_only_their_own_address() {
    let certs = Certs::make();
    let addr = serve(&policy(&certs, false)).await;
    let mut stalled = Vec::new();
    for _ in 0..16 {
        stalled.push(connect_from(addr, "127.0.0.1").await);
    }
    // The 17th from the same address: closed without a word (bounded
    // wait, only for a failure to show).
    let mut extra = connect_from(addr, "127.0.0.1").await;
    let mut buf = [0u8; 16];
    let read = tokio::time::timeout(std::time::Duration::from_secs(20), extra.read(&mut buf))
        .await
        .expect("closed at once");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    // Another address is served meanwhile.
    assert_eq!(
        get_from(addr, &certs, false, "/healthz", "127.0.0.2")
            .await
            .unwrap(),
        "HTTP/1.1 200 OK"
    );
    // Once they go, the address is served again.
    drop(stalled);
    let mut served = false;
    for _ in 0..100 {
        if get(addr, &certs, false, "/healthz").await == Ok("HTTP/1.1 200 OK".to_owned()) {
            served = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(served);
}

#[tokio::test]
async fn mutual_tls_serves_only_clients_the_ca_signed() {
    let certs = Certs::make();
    let addr = serve(&policy(&certs, true)).await;
    assert_eq!(
        get(addr, &certs, true, "/healthz").await.unwrap(),
        "HTTP/1.1 200 OK"
    );
    // Without a certificate: refused in the handshake (TLS 1.3 reports it
    // on the first read).
    assert!(get(addr, &certs, false, "/healthz").await.is_err());
}

#[tokio::test]
async fn envoy_s_rate_limit_service_serves_tls() {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
    let certs = Certs::make();
    let file = PolicyFile::parse(&policy(&certs, false)).unwrap();
    let tls = tollgate_server::tls::load(file.server().unwrap().tls.as_ref().unwrap()).unwrap();
    let config = certs.path("rls.yaml");
    std::fs::write(
        &config,
        "domain: edge\ndescriptors:\n  - key: k\n    rate_limit: { unit: hour, requests_per_unit: 1 }\n",
    )
    .unwrap();
    let store = MemoryStore::new();
    let rls = tollgate_server::rls::Rls::new(
        tollgate_server::envoy::Domains::load(&[config], &store).unwrap(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { tollgate_server::rls::serve_with(listener, rls, Some(&tls)).await });
    let ca = std::fs::read(certs.path("ca.crt")).unwrap();
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(ca))
        .domain_name("localhost");
    let mut client = None;
    for _ in 0..50 {
        let endpoint = tonic::transport::Endpoint::from_shared(format!("https://{addr}"))
            .unwrap()
            .tls_config(tls.clone())
            .unwrap();
        if let Ok(channel) = endpoint.connect().await {
            client = Some(RateLimitServiceClient::new(channel));
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let mut client = client.expect("the rate limit service over TLS");
    let ask = || RateLimitRequest {
        domain: "edge".to_owned(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "k".to_owned(),
                value: "v".to_owned(),
            }],
            ..RateLimitDescriptor::default()
        }],
        hits_addend: 0,
    };
    let code = |r: tonic::Response<_>| {
        let r: envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse = r.into_inner();
        Code::try_from(r.overall_code).unwrap()
    };
    assert_eq!(
        code(client.should_rate_limit(ask()).await.unwrap()),
        Code::Ok
    );
    assert_eq!(
        code(client.should_rate_limit(ask()).await.unwrap()),
        Code::OverLimit
    );
}

#[test]
fn bad_tls_files_are_named_and_keys_never_printed() {
    let certs = Certs::make();
    let files = |policy: String| {
        PolicyFile::parse(&policy)
            .unwrap()
            .server()
            .unwrap()
            .tls
            .unwrap()
    };
    // The key where the certificate should be, and the reverse.
    let swapped = policy(&certs, false)
        .replace("server.crt", "TMP")
        .replace("server.key", "server.crt")
        .replace("TMP", "server.key");
    let e = tollgate_server::tls::load(&files(swapped)).unwrap_err();
    assert!(
        e.starts_with("server.tls.cert_file: holds no certificate"),
        "{e}"
    );
    let key = std::fs::read_to_string(certs.path("server.key")).unwrap();
    let body = key.lines().nth(1).unwrap();
    assert!(!e.contains(body), "{e}");
    let missing = policy(&certs, false).replace("server.key", "nowhere.key");
    let e = tollgate_server::tls::load(&files(missing)).unwrap_err();
    assert!(e.starts_with("server.tls.key_file: cannot read"), "{e}");
    // A key that is not the certificate's.
    let other = policy(&certs, false).replace("server.key", "client.key");
    let e = tollgate_server::tls::load(&files(other)).unwrap_err();
    assert!(
        e.starts_with("server.tls.key_file: does not go with cert_file"),
        "{e}"
    );
    // An empty name is refused when the file is read.
    let e = PolicyFile::parse(&policy(&certs, false).replace(
        &format!("{:?}", certs.path("server.crt").display().to_string()),
        "\"\"",
    ))
    .unwrap_err();
    assert_eq!(e.field(), "server.tls.cert_file");
    assert_eq!(e.line(), 8);
}

/// Review of the TLS listener: dropped (a server that stops), it stops
/// accepting and its port is free, so clients are refused and go
/// elsewhere rather than being handed a handshake and a reset.
#[tokio::test]
async fn a_dropped_tls_listener_frees_its_port() {
    let certs = Certs::make();
    let file = PolicyFile::parse(&policy(&certs, false)).unwrap();
    let tls = tollgate_server::tls::load(file.server().unwrap().tls.as_ref().unwrap()).unwrap();
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = tcp.local_addr().unwrap();
    let listener = tollgate_server::tls::listener(tcp, &tls).unwrap();
    // Its accept loop has taken a connection, and waits for the next.
    let first = tokio::net::TcpStream::connect(addr).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    drop(listener);
    drop(first);
    let mut freed = false;
    for _ in 0..200 {
        if tokio::net::TcpListener::bind(addr).await.is_ok() {
            freed = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(freed, "the port is still held");
}
