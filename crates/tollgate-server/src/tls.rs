//! TLS on the decision endpoints and Envoy's rate limit service
//! (`[server.tls]`), with rustls: the server's certificate, and
//! optionally the CA a client's certificate must be signed by (mutual
//! TLS, as a service mesh's sidecars present).

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::server::TlsStream;
use tollgate::config::TlsFiles;

/// How long a client has to finish its handshake.
const HANDSHAKE: Duration = Duration::from_secs(10);
/// Handshakes under way at once; a connection beyond is closed at once,
/// so that a flood of idle connections cannot hold the listener.
const MAX_HANDSHAKES: usize = 1024;

/// The server's TLS settings, read and checked ([`load`]).
#[derive(Clone)]
pub struct Tls {
    http: Arc<rustls::ServerConfig>,
    grpc: tonic::transport::ServerTlsConfig,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls").finish_non_exhaustive()
    }
}

fn read(path: &Path, field: &str) -> Result<Vec<u8>, String> {
    std::fs::read(path)
        .map_err(|e| format!("server.tls.{field}: cannot read {}: {e}", path.display()))
}

fn certificates(pem: &[u8], field: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("server.tls.{field}: not PEM certificates: {e}"))?;
    if certs.is_empty() {
        return Err(format!("server.tls.{field}: holds no certificate (PEM)"));
    }
    Ok(certs)
}

/// Reads and checks the files `[server.tls]` names: errors name the
/// field, never a key's contents.
pub fn load(files: &TlsFiles) -> Result<Tls, String> {
    let cert_pem = read(&files.cert_file, "cert_file")?;
    let key_pem = read(&files.key_file, "key_file")?;
    let certs = certificates(&cert_pem, "cert_file")?;
    let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|_| {
        "server.tls.key_file: holds no private key (PEM: PKCS#8, PKCS#1 or SEC1)".to_owned()
    })?;
    // One crypto provider, named: not the process default, which is
    // ambiguous (and a panic) where a build enables two. *ring*, as
    // tonic's TLS here: rustls now prefers aws-lc-rs (post-quantum key
    // exchange), whose C build would weigh on every build of the server;
    // the classical suites *ring* has are what Envoy and NGINX offer.
    #[allow(deprecated)]
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("server.tls: {e}"))?;
    let (builder, client_ca) = match &files.client_ca_file {
        None => (builder.with_no_client_auth(), None),
        Some(path) => {
            let pem = read(path, "client_ca_file")?;
            let mut roots = rustls::RootCertStore::empty();
            for cert in certificates(&pem, "client_ca_file")? {
                roots
                    .add(cert)
                    .map_err(|e| format!("server.tls.client_ca_file: {e}"))?;
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider,
            )
            .build()
            .map_err(|e| format!("server.tls.client_ca_file: {e}"))?;
            (builder.with_client_cert_verifier(verifier), Some(pem))
        }
    };
    let mut http = builder.with_single_cert(certs, key).map_err(|e| {
        format!("server.tls.key_file: does not go with cert_file, or cannot be used: {e}")
    })?;
    http.alpn_protocols = vec![b"http/1.1".to_vec()];
    let mut grpc = tonic::transport::ServerTlsConfig::new()
        .identity(tonic::transport::Identity::from_pem(&cert_pem, &key_pem));
    if let Some(pem) = client_ca {
        grpc = grpc.client_ca_root(tonic::transport::Certificate::from_pem(pem));
    }
    Ok(Tls {
        http: Arc::new(http),
        grpc,
    })
}

impl Tls {
    /// The gRPC server's settings (Envoy's rate limit service).
    pub(crate) fn grpc(&self) -> tonic::transport::ServerTlsConfig {
        self.grpc.clone()
    }
}

/// A listener whose connections are TLS: each handshake on a task of its
/// own (with a deadline), so that a slow client never holds up the
/// others' accepts. An axum [`Listener`](axum::serve::Listener).
#[derive(Debug)]
pub struct TlsListener {
    incoming: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
}

/// Accepts TLS connections on `tcp` (see [`TlsListener`]).
pub fn listener(tcp: TcpListener, tls: &Tls) -> std::io::Result<TlsListener> {
    let local = tcp.local_addr()?;
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::clone(&tls.http));
    let (tx, incoming) = mpsc::channel(64);
    let handshakes = Arc::new(Semaphore::new(MAX_HANDSHAKES));
    tokio::spawn(async move {
        while !tx.is_closed() {
            let (stream, peer) = match tcp.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors and the like: pause, as
                    // axum's own listener does.
                    tracing::debug!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let Ok(permit) = Arc::clone(&handshakes).try_acquire_owned() else {
                tracing::debug!(%peer, "too many TLS handshakes under way: connection closed");
                continue;
            };
            let (acceptor, tx) = (acceptor.clone(), tx.clone());
            tokio::spawn(async move {
                let _permit = permit;
                match tokio::time::timeout(HANDSHAKE, acceptor.accept(stream)).await {
                    Ok(Ok(stream)) => {
                        let _ = tx.send((stream, peer)).await;
                    }
                    Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                    Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                }
            });
        }
    });
    Ok(TlsListener { incoming, local })
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.incoming.recv().await {
            Some(accepted) => accepted,
            // The accept task ended (it only does once this is dropped).
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(self.local)
    }
}
