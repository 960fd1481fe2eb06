//! The permit a request holds while it is in flight, and the response body
//! that carries it to the end.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};
use tollgate_core::Lease;

use super::stamp::Stamp;

use super::adaptive::Adaptive;
use crate::outcome::Completion;

/// Gives a permit's leases back to the limits that granted them.
pub(crate) trait Release: Send + Sync + 'static {
    fn release(&self, permit: &mut Held);
}

/// What a request holds: a lease per limit that granted one, compact (it
/// travels in every response future and body, which are moved often).
/// Every lease of a request is of its weight.
#[derive(Default)]
pub(crate) struct Held {
    /// The request's key (as the store saw it), when the release reads
    /// it; else empty (no allocation).
    pub(crate) key: Box<[u8]>,
    /// The per-key limit's lease id, when [`PER_KEY`] is set.
    per_key: u64,
    /// The service limit's lease id, when [`SERVICE`] is set.
    service: u64,
    /// The request's weight: the permits of each lease, and of the
    /// adaptive limit.
    weight: u32,
    /// What is held: [`PER_KEY`], [`SERVICE`], [`ADAPTIVE`]; and
    /// [`COUNTED`] once the in-flight gauge counts the request.
    flags: u8,
}

/// Never the key itself (a client's API key, say): its length.
impl fmt::Debug for Held {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Held")
            .field("key_len", &self.key.len())
            .field(
                "per_key",
                &(self.flags & PER_KEY != 0).then_some(self.per_key),
            )
            .field(
                "service",
                &(self.flags & SERVICE != 0).then_some(self.service),
            )
            .field("adaptive", &(self.flags & ADAPTIVE != 0))
            .field("weight", &self.weight)
            .finish()
    }
}

const PER_KEY: u8 = 1;
const SERVICE: u8 = 2;
const ADAPTIVE: u8 = 4;
const COUNTED: u8 = 8;

impl Held {
    /// Holding the per-key limit's `lease`, if any, for `key`.
    #[inline]
    pub(crate) fn new(key: Box<[u8]>, per_key: Option<Lease>) -> Self {
        let mut held = Self {
            key,
            ..Self::default()
        };
        if let Some(lease) = per_key {
            held.per_key = lease.id;
            held.weight = lease.permits;
            held.flags = PER_KEY;
        }
        held
    }

    pub(crate) fn set_service(&mut self, lease: Lease) {
        // One weight for every lease held: a granted lease holds exactly
        // the permits asked (the `ConcurrencyLimiter` contract), so the
        // per-key lease's is the same.
        debug_assert!(
            self.flags & PER_KEY == 0 || self.weight == lease.permits,
            "a store granted a lease of other permits than asked"
        );
        self.service = lease.id;
        self.weight = lease.permits;
        self.flags |= SERVICE;
    }

    /// `permits` taken from an adaptive (in-process) service limit.
    pub(crate) fn set_adaptive(&mut self, permits: u32) {
        if permits > 0 {
            self.weight = permits;
            self.flags |= ADAPTIVE;
        }
    }

    /// The in-flight gauge counts this request: its weight, returned.
    pub(crate) fn set_counted(&mut self) -> u32 {
        self.flags |= COUNTED;
        self.weight
    }

    fn take(&mut self, flag: u8) -> bool {
        let had = self.flags & flag != 0;
        self.flags &= !flag;
        had
    }

    pub(crate) fn take_per_key(&mut self) -> Option<Lease> {
        self.take(PER_KEY).then_some(Lease {
            id: self.per_key,
            permits: self.weight,
        })
    }

    pub(crate) fn take_service(&mut self) -> Option<Lease> {
        self.take(SERVICE).then_some(Lease {
            id: self.service,
            permits: self.weight,
        })
    }

    /// The adaptive limit's permits (0: none).
    pub(crate) fn take_adaptive(&mut self) -> u32 {
        if self.take(ADAPTIVE) {
            self.weight
        } else {
            0
        }
    }

    /// What the in-flight gauge counted (0: nothing).
    pub(crate) fn take_counted(&mut self) -> u32 {
        if self.take(COUNTED) {
            self.weight
        } else {
            0
        }
    }

    /// Whether no limit's permits are held.
    pub(crate) fn is_empty(&self) -> bool {
        self.flags & (PER_KEY | SERVICE | ADAPTIVE) == 0
    }

    /// Whether nothing is left to give back: no permits, and no count in
    /// the in-flight gauge.
    fn is_settled(&self) -> bool {
        self.flags == 0
    }
}

/// An owned guard: the leases of one request, released exactly once, when
/// it is dropped — whether the response body finished, failed or was
/// dropped, or the request was cancelled before it had a response.
pub struct Permit {
    owner: Arc<dyn Release>,
    held: Held,
    /// The end of its lifetime, where the layer caps it
    /// ([`max_lifetime`](super::ConcurrencyLayerBuilder::max_lifetime)).
    until: Stamp,
}

impl Permit {
    pub(crate) fn new(owner: Arc<dyn Release>, held: Held) -> Self {
        Self {
            owner,
            held,
            until: Stamp::NONE,
        }
    }

    pub(crate) fn held_mut(&mut self) -> &mut Held {
        &mut self.held
    }

    /// Caps the permit's lifetime at `until`.
    pub(crate) fn set_until(&mut self, until: Instant) {
        self.until = Stamp::at(until);
    }

    /// When the permit's lifetime ends, where the layer caps it
    /// ([`max_lifetime`](super::ConcurrencyLayerBuilder::max_lifetime));
    /// `None` if it does not.
    pub fn expires_at(&self) -> Option<Instant> {
        self.until.get()
    }

    /// Resolves when the permit's lifetime ends (never, if the layer sets
    /// none): an upgraded connection's task selects on it to close the
    /// connection cleanly at the cap (a WebSocket `Close` frame, say),
    /// then drops the permit.
    pub async fn expired(&self) {
        match self.until.get() {
            Some(until) => tokio::time::sleep_until(until).await,
            None => std::future::pending().await,
        }
    }

    /// Releases now (the same as dropping it).
    pub fn release(self) {}
}

impl Drop for Permit {
    fn drop(&mut self) {
        if !self.held.is_settled() {
            self.owner.release(&mut self.held);
        }
    }
}

impl fmt::Debug for Permit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit")
            .field("held", &self.held)
            .finish_non_exhaustive()
    }
}

/// The permit of an upgrade request (WebSocket, HTTP/2 extended CONNECT),
/// offered to the handler in the request's extensions when the layer is
/// built with [`upgrades(true)`](super::ConcurrencyLayerBuilder::upgrades):
/// take it and move it into the upgraded connection's task to count the
/// connection until it closes. Not taken, it is released with the (empty)
/// `101` response body. Where the layer caps a permit's lifetime
/// ([`max_lifetime`](super::ConcurrencyLayerBuilder::max_lifetime)), the
/// connection's task ends the connection when
/// [`Permit::expired`] resolves: the layer cannot close a connection it
/// does not hold.
///
/// ```
/// use axum::Extension;
/// use tollgate::concurrency::UpgradePermit;
///
/// async fn ws_handler(Extension(slot): Extension<UpgradePermit>) -> &'static str {
///     let permit = slot.take();
///     tokio::spawn(async move {
///         let serve = async { /* ... serve the upgraded connection ... */ };
///         match &permit {
///             // Served until the connection closes or its lifetime ends.
///             Some(p) => tokio::select! {
///                 () = serve => {}
///                 () = p.expired() => { /* send a Close frame */ }
///             },
///             None => serve.await,
///         }
///         drop(permit); // released when the connection closes
///     });
///     "upgrading"
/// }
/// ```
#[derive(Debug, Clone)]
pub struct UpgradePermit(Arc<std::sync::Mutex<Option<Permit>>>);

impl UpgradePermit {
    pub(crate) fn new(permit: Permit) -> Self {
        Self(Arc::new(std::sync::Mutex::new(Some(permit))))
    }

    /// Takes the permit (`None` if it was taken, or released already).
    pub fn take(&self) -> Option<Permit> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }
}

/// What a response body holds: the permit itself, or the slot an upgrade
/// handler may have taken it from.
#[derive(Debug)]
pub(crate) enum Holding {
    // Never read: held for its `Drop`.
    #[allow(dead_code)]
    Permit(Permit),
    // Never read either: held for its `Drop`.
    #[allow(dead_code)]
    Upgrade(Offered),
}

impl Holding {
    /// Caps the lifetime of the permit held here (not one offered to an
    /// upgrade's handler already).
    pub(crate) fn cap(&mut self, until: Instant) {
        if let Holding::Permit(p) = self {
            p.set_until(until);
        }
    }

    /// When the permit held here expires, if its lifetime is capped: an
    /// upgrade's too, while it waits in the slot (a request that says
    /// `Upgrade` but is served as any other holds its permit there, and
    /// must not outlive the cap for it).
    pub(crate) fn expires_at(&self) -> Option<Instant> {
        match self {
            Holding::Permit(p) => p.expires_at(),
            Holding::Upgrade(Offered(slot)) => slot
                .0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .as_ref()
                .and_then(Permit::expires_at),
        }
    }

    /// For an upgrade request (the caller checks), when the layer offers
    /// upgrades: the permit moves to a slot in the request's extensions,
    /// for the handler.
    pub(crate) fn attach<B>(holding: &mut Option<Self>, req: &mut http::Request<B>) {
        if let Some(Holding::Permit(_)) = holding {
            if let Some(Holding::Permit(permit)) = holding.take() {
                let slot = UpgradePermit::new(permit);
                req.extensions_mut().insert(slot.clone());
                *holding = Some(Holding::Upgrade(Offered(slot)));
            }
        }
    }
}

/// The slot of an upgrade's permit, as the response body holds it: a
/// permit the handler did not take goes with the `101` response's body —
/// when it is dropped unread, as hyper drops an empty body, too — not
/// whenever the last clone of the slot goes (a handler that kept the
/// extension would hold the permit for as long as it lives).
#[derive(Debug)]
pub(crate) struct Offered(UpgradePermit);

impl Drop for Offered {
    fn drop(&mut self) {
        drop(self.0.take());
    }
}

/// An adaptive limit's sample that waits for the body's end: a gRPC
/// answer whose status comes in the trailers.
pub(crate) struct Sampling {
    adaptive: Arc<Adaptive>,
    rtt: u64,
}

impl fmt::Debug for Sampling {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sampling").field("rtt", &self.rtt).finish()
    }
}

impl Sampling {
    pub(crate) fn new(adaptive: Arc<Adaptive>, rtt: u64) -> Self {
        Self { adaptive, rtt }
    }

    fn complete(self, completion: Completion) {
        self.adaptive.complete(self.rtt, completion);
    }
}

/// Where a response's permit has a capped lifetime: the timer that ends
/// the body.
pub(crate) struct Lifetime {
    sleep: Pin<Box<Sleep>>,
    /// A gRPC stream ends with trailers (`UNAVAILABLE`), as a server's
    /// maximum connection age ends one, so clients reconnect.
    grpc: bool,
    ended: metrics::Counter,
    /// The body was ended at the cap.
    cut: bool,
}

impl fmt::Debug for Lifetime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lifetime")
            .field("deadline", &self.sleep.deadline())
            .field("cut", &self.cut)
            .finish_non_exhaustive()
    }
}

impl Lifetime {
    /// The lifetime of a response whose permit is held in `holding` (one
    /// whose lifetime is capped), `grpc` if it is a gRPC stream.
    pub(crate) fn of(
        holding: Option<&Holding>,
        grpc: bool,
        ended: &metrics::Counter,
    ) -> Option<Box<Self>> {
        let until = holding?.expires_at()?;
        Some(Box::new(Self {
            sleep: Box::pin(tokio::time::sleep_until(until)),
            grpc,
            ended: ended.clone(),
            cut: false,
        }))
    }
}

/// The trailers a gRPC stream ends with at its permit's lifetime.
fn lifetime_trailers() -> http::HeaderMap {
    let mut t = http::HeaderMap::new();
    t.insert("grpc-status", http::HeaderValue::from_static("14"));
    t.insert(
        "grpc-message",
        http::HeaderValue::from_static("stream%20lifetime%20reached"),
    );
    t
}

pin_project! {
    /// The body of a concurrency-limited response: the inner service's body
    /// (or the limiter's rejection), holding the request's [`Permit`] until
    /// its last frame has been read, it fails, or it is dropped. A client
    /// that reads slowly keeps its permit, as it should: the response is
    /// still in flight. Where the layer caps a permit's lifetime, the body
    /// ends there.
    #[derive(Debug)]
    pub struct PermitBody<B> {
        #[pin]
        body: B,
        permit: Option<Holding>,
        // A gRPC answer's sample, completed by its trailers.
        sampling: Option<Box<Sampling>>,
        // The permit's capped lifetime, which ends the body.
        lifetime: Option<Box<Lifetime>>,
    }
}

impl<B> PermitBody<B> {
    pub(crate) fn new(body: B, permit: Option<Holding>, sampling: Option<Box<Sampling>>) -> Self {
        Self {
            body,
            permit,
            sampling,
            lifetime: None,
        }
    }

    /// Ends the body at `lifetime`, if it has one.
    pub(crate) fn lasting(mut self, lifetime: Option<Box<Lifetime>>) -> Self {
        self.lifetime = lifetime;
        self
    }
}

/// An outer layer's rejection, holding no permit.
impl<B: crate::RejectionBody> crate::RejectionBody for PermitBody<B> {
    fn rejection(bytes: Bytes) -> Self {
        Self::new(B::rejection(bytes), None, None)
    }
}

impl<B> Body for PermitBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let mut this = self.project();
        if let Some(lifetime) = this.lifetime.as_mut() {
            if lifetime.cut {
                return Poll::Ready(None);
            }
            if lifetime.sleep.as_mut().poll(cx).is_ready() {
                // The permit's lifetime is over: the body ends cleanly (a
                // chunked or streamed response's end; a gRPC stream's
                // trailers), the permit goes back, and a stream cut short
                // is no latency sample.
                lifetime.cut = true;
                lifetime.ended.increment(1);
                drop(this.permit.take());
                drop(this.sampling.take());
                if lifetime.grpc {
                    return Poll::Ready(Some(Ok(Frame::trailers(lifetime_trailers()))));
                }
                return Poll::Ready(None);
            }
        }
        let polled = this.body.as_mut().poll_frame(cx);
        let done = match &polled {
            Poll::Ready(None | Some(Err(_))) => true,
            Poll::Ready(Some(Ok(_))) => this.body.is_end_stream(),
            Poll::Pending => false,
        };
        if let (Poll::Ready(frame), Some(_)) = (&polled, this.sampling.as_ref()) {
            let completion = match frame {
                Some(Ok(f)) => match f.trailers_ref() {
                    Some(t) => Some(Completion::from_trailers(Some(t))),
                    // A body that says it ended after this data frame is
                    // not polled again: it ended without trailers.
                    None if done => Some(Completion::from_trailers(None)),
                    None => None,
                },
                Some(Err(_)) => Some(Completion::Error),
                None => Some(Completion::from_trailers(None)),
            };
            if let Some(completion) = completion {
                if let Some(sampling) = this.sampling.take() {
                    sampling.complete(completion);
                }
            }
        }
        if done {
            // The response is over: free the permit now, not when the
            // server gets round to dropping the body.
            drop(this.permit.take());
            // (Checked first: the drop of a lifetime is out of line, and
            // most bodies have none.)
            if this.lifetime.is_some() {
                drop(this.lifetime.take());
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.lifetime.as_ref().is_some_and(|l| l.cut) || self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        if self.lifetime.as_ref().is_some_and(|l| l.cut) {
            return SizeHint::with_exact(0);
        }
        self.body.size_hint()
    }
}
