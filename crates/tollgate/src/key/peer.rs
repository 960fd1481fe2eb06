//! The peer address of servers that record it in their own type.

use std::fmt;
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::task::{Context, Poll};

use http::Request;
use tower_layer::Layer;
use tower_service::Service;

/// Copies the peer's address from a server's own connect-info extension
/// into a [`SocketAddr`] extension, where [`PeerIp`](super::PeerIp),
/// [`ClientIp`](super::ClientIp) and access lists read it.
///
/// axum's `ConnectInfo<SocketAddr>` is read as it is; other servers record
/// the peer in a type of their own — tonic in `TcpConnectInfo` — which
/// tollgate cannot name without depending on them. Without this layer,
/// such a server's requests have no peer address: a `PeerIp` rule then
/// refuses them as keyless (or, with a fallback key, makes every client
/// share one budget). Put it outside the limits:
///
/// ```
/// use std::net::SocketAddr;
/// use tollgate::key::PeerAddrLayer;
///
/// // With tonic: `PeerAddrLayer::new(|info: &TcpConnectInfo| info.remote_addr())`,
/// // then `Server::builder().layer(peer).layer(limits)`. Over TLS, tonic
/// // records `TlsConnectInfo<TcpConnectInfo>` instead:
/// // `|info: &TlsConnectInfo<TcpConnectInfo>| info.get_ref().remote_addr()`.
/// struct ConnectInfo {
///     remote: Option<SocketAddr>,
/// }
/// let peer = PeerAddrLayer::new(|info: &ConnectInfo| info.remote);
/// ```
pub struct PeerAddrLayer<T> {
    get: fn(&T) -> Option<SocketAddr>,
    _info: PhantomData<fn(&T)>,
}

impl<T> PeerAddrLayer<T> {
    /// Reads the peer address out of the `T` extension with `get`.
    pub fn new(get: fn(&T) -> Option<SocketAddr>) -> Self {
        Self {
            get,
            _info: PhantomData,
        }
    }
}

impl<T> Clone for PeerAddrLayer<T> {
    fn clone(&self) -> Self {
        Self {
            get: self.get,
            _info: PhantomData,
        }
    }
}

impl<T> fmt::Debug for PeerAddrLayer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PeerAddrLayer")
            .field("info", &std::any::type_name::<T>())
            .finish()
    }
}

impl<S, T> Layer<S> for PeerAddrLayer<T> {
    type Service = PeerAddr<S, T>;

    fn layer(&self, inner: S) -> Self::Service {
        PeerAddr {
            inner,
            get: self.get,
            _info: PhantomData,
        }
    }
}

/// The service of [`PeerAddrLayer`].
pub struct PeerAddr<S, T> {
    inner: S,
    get: fn(&T) -> Option<SocketAddr>,
    _info: PhantomData<fn(&T)>,
}

impl<S: Clone, T> Clone for PeerAddr<S, T> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            get: self.get,
            _info: PhantomData,
        }
    }
}

impl<S: fmt::Debug, T> fmt::Debug for PeerAddr<S, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PeerAddr")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, T, B> Service<Request<B>> for PeerAddr<S, T>
where
    S: Service<Request<B>>,
    T: Send + Sync + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        if super::ip::peer_addr_quiet(&req).is_none() {
            if let Some(addr) = req.extensions().get::<T>().and_then(self.get) {
                req.extensions_mut().insert(addr);
            }
        }
        self.inner.call(req)
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::time::Duration;

    use http::{Request, Response};
    use tower::{service_fn, Layer, ServiceExt};

    use super::*;
    use crate::key::PeerIp;
    use crate::{Limit, RateLimitLayer};

    /// A server's own connect info, as tonic's `TcpConnectInfo` is.
    #[derive(Clone)]
    struct ServerConnectInfo {
        remote: Option<SocketAddr>,
    }

    #[tokio::test]
    async fn a_servers_own_connect_info_keys_peer_ip_rules() {
        let limits =
            RateLimitLayer::builder("per-peer", Limit::fixed_window(1, Duration::from_secs(60)))
                .key(PeerIp::new())
                .build()
                .unwrap();
        let peer = PeerAddrLayer::new(|info: &ServerConnectInfo| info.remote);
        let svc = peer.layer(limits.layer(service_fn(|_req: Request<String>| async {
            Ok::<_, Infallible>(Response::new(String::new()))
        })));
        let from = |addr: Option<&str>| {
            let mut r = Request::new(String::new());
            r.extensions_mut().insert(ServerConnectInfo {
                remote: addr.map(|a| a.parse().unwrap()),
            });
            r
        };
        let status = |r| {
            let svc = svc.clone();
            async move { svc.oneshot(r).await.unwrap().status() }
        };
        // Each peer its own budget.
        assert_eq!(status(from(Some("192.0.2.1:1000"))).await, 200);
        assert_eq!(status(from(Some("192.0.2.2:1000"))).await, 200);
        assert_eq!(status(from(Some("192.0.2.1:2000"))).await, 429);
        // No address anywhere: keyless, refused (not pooled).
        assert_eq!(status(from(None)).await, 400);
    }
}
