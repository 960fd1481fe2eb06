//! The body of a limited service's responses.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

/// A response body a limiter can answer in: the layers (rate, quota,
/// policy, concurrency) pass the inner service's responses through as
/// they are, body and all, and make a rejection (its problem document,
/// or an empty gRPC body) in the same type. So an axum app's responses
/// stay `axum::body::Body`, which axum then does not box again.
///
/// Implemented for axum's `Body` (feature `axum`), tonic's `Body`
/// (feature `tonic`), `String`, `http_body_util::Full<Bytes>`,
/// `BoxBody` and `UnsyncBoxBody` over `Bytes`, the bodies of tollgate's
/// own concurrency and bandwidth layers over any of these (so layers
/// stack), and [`ResponseBody<B>`] for any body `B`: a service whose body
/// is none of these is wrapped with [`ResponseBody::wrap`] (for example
/// with tower-http's `MapResponseBodyLayer::new(ResponseBody::wrap)`)
/// below the layer.
///
/// ```
/// use bytes::Bytes;
/// use tollgate::RejectionBody;
///
/// let body = <String as RejectionBody>::rejection(Bytes::from_static(b"{}"));
/// assert_eq!(body, "{}");
/// ```
#[diagnostic::on_unimplemented(
    message = "tollgate cannot answer a rejection in the body type `{Self}`",
    note = "for tonic's `tonic::body::Body`, enable tollgate's `tonic` feature; for axum's `Body`, its `axum` feature (on by default)",
    note = "for any other body, wrap the inner service's responses with `tollgate::ResponseBody::wrap` (e.g. tower-http's `MapResponseBodyLayer::new(ResponseBody::wrap)`)"
)]
pub trait RejectionBody: Body<Data = Bytes> + Sized {
    /// A body that sends `bytes` (a rejection's whole body).
    fn rejection(bytes: Bytes) -> Self;
}

impl RejectionBody for String {
    /// Rejection bodies are UTF-8 (JSON, or empty for gRPC).
    fn rejection(bytes: Bytes) -> Self {
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

impl RejectionBody for http_body_util::Full<Bytes> {
    fn rejection(bytes: Bytes) -> Self {
        http_body_util::Full::new(bytes)
    }
}

impl<E: 'static> RejectionBody for http_body_util::combinators::UnsyncBoxBody<Bytes, E> {
    fn rejection(bytes: Bytes) -> Self {
        use http_body_util::BodyExt;
        http_body_util::Full::new(bytes)
            .map_err(|never| match never {})
            .boxed_unsync()
    }
}

impl<E: 'static> RejectionBody for http_body_util::combinators::BoxBody<Bytes, E> {
    fn rejection(bytes: Bytes) -> Self {
        use http_body_util::BodyExt;
        http_body_util::Full::new(bytes)
            .map_err(|never| match never {})
            .boxed()
    }
}

impl<E: 'static> RejectionBody for Pin<Box<dyn Body<Data = Bytes, Error = E> + Send>> {
    fn rejection(bytes: Bytes) -> Self {
        use http_body_util::BodyExt;
        Box::pin(http_body_util::Full::new(bytes).map_err(|never| match never {}))
    }
}

/// The rejection on the left.
impl<L, R> RejectionBody for http_body_util::Either<L, R>
where
    L: RejectionBody,
    L::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    R: Body<Data = Bytes>,
    R::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    fn rejection(bytes: Bytes) -> Self {
        http_body_util::Either::Left(L::rejection(bytes))
    }
}

#[cfg(feature = "axum")]
impl RejectionBody for axum::body::Body {
    fn rejection(bytes: Bytes) -> Self {
        axum::body::Body::from(bytes)
    }
}

#[cfg(feature = "tonic")]
impl RejectionBody for tonic::body::Body {
    fn rejection(bytes: Bytes) -> Self {
        if bytes.is_empty() {
            return tonic::body::Body::empty();
        }
        tonic::body::Body::new(http_body_util::Full::new(bytes))
    }
}

impl<B: Body<Data = Bytes>> RejectionBody for ResponseBody<B> {
    fn rejection(bytes: Bytes) -> Self {
        Self::full(bytes)
    }
}

pin_project! {
    /// The inner service's body, or the layer's own bytes: a rejection's
    /// problem document.
    #[derive(Debug)]
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    #[derive(Debug)]
    enum Kind<B> {
        Inner { #[pin] body: B },
        Full { data: Option<Bytes>, trailers: Option<HeaderMap> },
    }
}

impl<B> ResponseBody<B> {
    /// Wraps a service's `body`, for a body type that is not a
    /// [`RejectionBody`] of its own (hyper's `Incoming` from a proxied
    /// upstream, a body type of the application's): map the responses
    /// below the layer.
    ///
    /// ```
    /// use std::convert::Infallible;
    ///
    /// use bytes::Bytes;
    /// use http::{Request, Response};
    /// use http_body_util::Empty;
    /// use tollgate::{key::Global, Limit, Rate, RateLimitLayer, ResponseBody};
    /// use tower::{service_fn, ServiceBuilder, ServiceExt};
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # tokio::runtime::Builder::new_current_thread().enable_time().build()?.block_on(async {
    /// // A body type that cannot carry a rejection.
    /// let upstream = service_fn(|_req: Request<String>| async {
    ///     Ok::<_, Infallible>(Response::new(Empty::<Bytes>::new()))
    /// });
    /// let svc = ServiceBuilder::new()
    ///     .layer(
    ///         RateLimitLayer::builder("api", Limit::gcra(Rate::per_second(10), 20))
    ///             .key(Global)
    ///             .build()?,
    ///     )
    ///     .map_response(|res: Response<Empty<Bytes>>| res.map(ResponseBody::wrap))
    ///     .service(upstream);
    /// let res = svc.oneshot(Request::new(String::new())).await?;
    /// assert_eq!(res.status(), 200);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # })
    /// # }
    /// ```
    pub fn wrap(body: B) -> Self {
        Self::inner(body)
    }

    pub(crate) fn inner(body: B) -> Self {
        Self {
            kind: Kind::Inner { body },
        }
    }

    pub(crate) fn full(data: Bytes) -> Self {
        Self::replay(data, None)
    }

    /// `data`, then `trailers` if any: a buffered body sent again.
    pub(crate) fn replay(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        Self {
            kind: Kind::Full {
                data: (!data.is_empty()).then_some(data),
                trailers,
            },
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().kind.project() {
            KindProj::Inner { body } => body.poll_frame(cx),
            KindProj::Full { data, trailers } => Poll::Ready(
                data.take()
                    .map(Frame::data)
                    .or_else(|| trailers.take().map(Frame::trailers))
                    .map(Ok),
            ),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Full { data, trailers } => data.is_none() && trailers.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body } => body.size_hint(),
            Kind::Full { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;

    async fn read<B: RejectionBody>() -> Bytes
    where
        B::Error: std::fmt::Debug,
    {
        let body = B::rejection(Bytes::from_static(b"{\"status\":429}"));
        assert_eq!(body.size_hint().exact(), Some(14));
        body.collect()
            .await
            .map(|c| c.to_bytes())
            .unwrap_or_default()
    }

    #[tokio::test]
    async fn every_rejection_body_sends_the_rejection_as_it_is() {
        let want = Bytes::from_static(b"{\"status\":429}");
        assert_eq!(read::<String>().await, want);
        assert_eq!(read::<http_body_util::Full<Bytes>>().await, want);
        assert_eq!(
            read::<http_body_util::combinators::UnsyncBoxBody<Bytes, std::io::Error>>().await,
            want
        );
        assert_eq!(
            read::<http_body_util::combinators::BoxBody<Bytes, std::io::Error>>().await,
            want
        );
        assert_eq!(read::<ResponseBody<String>>().await, want);
        assert_eq!(
            read::<Pin<Box<dyn Body<Data = Bytes, Error = std::io::Error> + Send>>>().await,
            want
        );
        assert_eq!(
            read::<http_body_util::Either<String, http_body_util::Empty<Bytes>>>().await,
            want
        );
        assert_eq!(read::<crate::concurrency::PermitBody<String>>().await, want);
        #[cfg(feature = "axum")]
        assert_eq!(read::<axum::body::Body>().await, want);
        #[cfg(feature = "tonic")]
        assert_eq!(read::<tonic::body::Body>().await, want);
        // A wrapped body of a type of its own is passed through.
        let inner = ResponseBody::wrap(http_body_util::Empty::<Bytes>::new());
        assert!(inner.is_end_stream());
    }
}
