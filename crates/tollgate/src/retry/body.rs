//! The body a retried request is sent with: buffered (replayable), or the
//! original stream (sent once).

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

pin_project! {
    /// A request body as the retry layer sends it: the whole body, buffered
    /// so that every attempt sends the same bytes, or — for a body too
    /// large or of unknown length to buffer — the original stream, which
    /// can be sent only once (such a request is not retried).
    #[derive(Debug)]
    pub struct ReplayBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    #[derive(Debug)]
    enum Kind<B> {
        Buffered { data: Option<Bytes> },
        Stream { #[pin] body: B },
    }
}

impl<B> ReplayBody<B> {
    pub(crate) fn buffered(data: Bytes) -> Self {
        Self {
            kind: Kind::Buffered {
                data: (!data.is_empty()).then_some(data),
            },
        }
    }

    pub(crate) fn stream(body: B) -> Self {
        Self {
            kind: Kind::Stream { body },
        }
    }
}

impl<B> Body for ReplayBody<B>
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
            KindProj::Buffered { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            KindProj::Stream { body } => body.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Buffered { data } => data.is_none(),
            Kind::Stream { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Buffered { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Kind::Stream { body } => body.size_hint(),
        }
    }
}
