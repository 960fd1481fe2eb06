//! TLS on the decision endpoints and Envoy's rate limit service
//! (`[server.tls]`), with rustls: the server's certificate, and
//! optionally the CA a client's certificate must be signed by (mutual
//! TLS, as a service mesh's sidecars present).
//!
//! Both services take their connections from one accept loop each that
//! runs every handshake on a task of its own, under a deadline and two
//! caps, so that clients that never finish a handshake can neither hold
//! the listener nor crowd out the others: at most
//! [`MAX_HANDSHAKES_PER_ADDRESS`] under way per client address (an IPv6
//! address by its /64), and at most [`MAX_HANDSHAKES`] in all, beyond
//! which connections wait in the kernel's backlog (not refused) until one
//! ends. A connection refused for its address is counted in
//! `tollgate_server_tls_refused_total{reason}`.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::server::TlsStream;
use tollgate::config::TlsFiles;

/// How long a client has to finish its handshake.
pub const HANDSHAKE: Duration = Duration::from_secs(5);
/// Handshakes under way at once, in all; connections beyond wait in the
/// kernel's backlog until one ends.
pub const MAX_HANDSHAKES: usize = 1024;
/// Handshakes under way at once from one client address (an IPv6
/// address by its /64); a connection beyond is closed at once.
pub const MAX_HANDSHAKES_PER_ADDRESS: u32 = 16;

/// The server's TLS settings, read and checked ([`load`]).
#[derive(Clone)]
pub struct Tls {
    http: Arc<rustls::ServerConfig>,
    grpc: Arc<rustls::ServerConfig>,
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
    // ambiguous (and a panic) where a build enables two. *ring*: rustls
    // now prefers aws-lc-rs (post-quantum key exchange), whose C build
    // would weigh on every build of the server; the classical suites
    // *ring* has are what Envoy and NGINX offer.
    #[allow(deprecated)]
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("server.tls: {e}"))?;
    let builder = match &files.client_ca_file {
        None => builder.with_no_client_auth(),
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
            builder.with_client_cert_verifier(verifier)
        }
    };
    let config = builder.with_single_cert(certs, key).map_err(|e| {
        format!("server.tls.key_file: does not go with cert_file, or cannot be used: {e}")
    })?;
    let alpn = |protocol: &[u8]| {
        let mut c = config.clone();
        c.alpn_protocols = vec![protocol.to_vec()];
        Arc::new(c)
    };
    Ok(Tls {
        http: alpn(b"http/1.1"),
        // gRPC clients (Envoy, grpc-go) ask for h2 by ALPN.
        grpc: alpn(b"h2"),
    })
}

/// A connection whose handshake finished, and its peer.
type Accepted = (TlsStream<TcpStream>, SocketAddr);

/// Handshakes under way per client address.
#[derive(Default)]
struct PerAddress(Mutex<HashMap<IpAddr, u32>>);

impl PerAddress {
    /// Counts one more from `ip`, if it has fewer than the cap under way.
    fn enter(self: &Arc<Self>, ip: IpAddr) -> Option<Leave> {
        let ip = coarse(ip);
        let mut map = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let n = map.entry(ip).or_insert(0);
        if *n >= MAX_HANDSHAKES_PER_ADDRESS {
            return None;
        }
        *n = n.saturating_add(1);
        Some(Leave(Arc::clone(self), ip))
    }
}

/// One handshake of an address under way; counted out when dropped.
struct Leave(Arc<PerAddress>, IpAddr);

impl Drop for Leave {
    fn drop(&mut self) {
        let mut map = (self.0).0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = map.get_mut(&self.1) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                map.remove(&self.1);
            }
        }
    }
}

/// An IPv6 address by its /64 (one client's share of addresses), an
/// IPv4 one (or an IPv4-mapped IPv6 one) as it is.
fn coarse(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let mut o = v6.octets();
                o[8..].fill(0);
                IpAddr::V6(o.into())
            }
        },
        v4 => v4,
    }
}

/// Accepts on `tcp` and hands each connection whose handshake (with
/// `config`) finished in time to `tx`, until `tx` is closed.
fn accept_loop(tcp: TcpListener, config: Arc<rustls::ServerConfig>) -> mpsc::Receiver<Accepted> {
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let (tx, rx) = mpsc::channel(64);
    let handshakes = Arc::new(Semaphore::new(MAX_HANDSHAKES));
    let per_address = Arc::new(PerAddress::default());
    let refused = metrics::counter!("tollgate_server_tls_refused_total", "reason" => "per_address");
    let timed_out = metrics::counter!("tollgate_server_tls_refused_total", "reason" => "timeout");
    tokio::spawn(async move {
        loop {
            // Room for one more handshake first: beyond the cap,
            // connections wait in the backlog, not refused.
            let permit = tokio::select! {
                () = tx.closed() => break,
                p = Arc::clone(&handshakes).acquire_owned() => match p {
                    Ok(p) => p,
                    Err(_) => break,
                },
            };
            let accepted = tokio::select! {
                () = tx.closed() => break,
                a = tcp.accept() => a,
            };
            let (stream, peer) = match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors and the like: pause, as
                    // axum's own listener does.
                    tracing::debug!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let Some(leave) = per_address.enter(peer.ip()) else {
                refused.increment(1);
                tracing::debug!(%peer, "too many TLS handshakes from this address: closed");
                continue;
            };
            let (acceptor, tx, timed_out) = (acceptor.clone(), tx.clone(), timed_out.clone());
            tokio::spawn(async move {
                let handshake = tokio::time::timeout(HANDSHAKE, acceptor.accept(stream)).await;
                drop((permit, leave));
                match handshake {
                    Ok(Ok(stream)) => {
                        let _ = tx.send((stream, peer)).await;
                    }
                    Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                    Err(_) => {
                        timed_out.increment(1);
                        tracing::debug!(%peer, "TLS handshake timed out");
                    }
                }
            });
        }
    });
    rx
}

/// A listener whose connections are TLS (see the [module docs](self)):
/// an axum [`Listener`](axum::serve::Listener). Dropped, it stops
/// accepting and closes its socket.
#[derive(Debug)]
pub struct TlsListener {
    incoming: mpsc::Receiver<Accepted>,
    local: SocketAddr,
}

/// Accepts TLS connections for the decision endpoints on `tcp`.
pub fn listener(tcp: TcpListener, tls: &Tls) -> std::io::Result<TlsListener> {
    let local = tcp.local_addr()?;
    Ok(TlsListener {
        incoming: accept_loop(tcp, Arc::clone(&tls.http)),
        local,
    })
}

/// The connections of Envoy's rate limit service on `tcp`, as tonic's
/// `serve_with_incoming` takes them (ALPN `h2`).
pub(crate) fn grpc_incoming(
    tcp: TcpListener,
    tls: &Tls,
) -> impl tokio_stream::Stream<Item = Result<TlsStream<TcpStream>, std::io::Error>> {
    use tokio_stream::StreamExt;
    tokio_stream::wrappers::ReceiverStream::new(accept_loop(tcp, Arc::clone(&tls.grpc)))
        .map(|(stream, _)| Ok(stream))
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_counted_by_client() {
        let per = Arc::new(PerAddress::default());
        let a: IpAddr = "2001:db8::1".parse().unwrap();
        let same_64: IpAddr = "2001:db8::ffff:1".parse().unwrap();
        let other: IpAddr = "2001:db8:0:1::1".parse().unwrap();
        let held: Vec<_> = (0..MAX_HANDSHAKES_PER_ADDRESS)
            .map(|_| per.enter(a).unwrap())
            .collect();
        assert!(per.enter(same_64).is_none());
        assert!(per.enter(other).is_some());
        drop(held);
        assert!(per.enter(same_64).is_some());
        // Counted out to nothing: no entry left behind.
        assert!(per.0.lock().unwrap().is_empty());
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        assert_eq!(coarse(mapped), "10.0.0.1".parse::<IpAddr>().unwrap());
    }
}
