//! The paced body: data frames go out no faster than the key's byte
//! budget allows.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::time::Sleep;
use tollgate_core::{Decision, Limiter, Outcome, StoreError};

use crate::key::KeyBytes;
use crate::observe::BandwidthMetrics;

/// Paces one body against a key's byte budget in the store: it takes
/// tokens a chunk at a time (one store call per chunk, not per frame),
/// spends them on the bytes it lets out, and waits — on Tokio's timer —
/// when the budget has none. It holds at most one frame: the one being let
/// out, split where the tokens run out.
pub(crate) struct Pacer<L: Limiter> {
    limiter: L,
    metrics: Arc<BandwidthMetrics>,
    key: KeyBytes,
    chunk: u32,
    /// Tokens taken from the store and not spent yet.
    credit: u64,
    /// The rest of the frame being let out.
    pending: Option<Bytes>,
    /// Tokens asked for in the decision under way: a chunk, or less for
    /// the end of a body known to be shorter than one.
    asked: u64,
    /// What the body says is left after the pending frame, at most (its
    /// size hint's upper bound, if it has one).
    rest: Option<u64>,
    /// The wait for tokens, kept and reset rather than made anew.
    sleep: Option<Pin<Box<Sleep>>>,
    waiting: bool,
    deciding: Option<Pin<Box<L::DecideFuture>>>,
}

impl<L: Limiter> Pacer<L> {
    pub(crate) fn new(
        limiter: L,
        metrics: Arc<BandwidthMetrics>,
        key: KeyBytes,
        chunk: u32,
    ) -> Self {
        Self {
            limiter,
            metrics,
            key,
            chunk,
            credit: 0,
            pending: None,
            asked: 0,
            rest: None,
            sleep: None,
            waiting: false,
            deciding: None,
        }
    }

    /// Takes in the store's answer to a chunk. `false`: stop pacing (the
    /// store failed, or the chunk can never fit), and let the body through
    /// as it comes — a store outage must not stall responses.
    fn answer(&mut self, answer: Result<Decision, StoreError>) -> bool {
        match answer {
            Ok(d) => match d.outcome {
                Outcome::Allow { .. } => {
                    self.credit = self.credit.saturating_add(self.asked);
                    true
                }
                Outcome::Deny { retry_after } => {
                    let wait = Duration::from_nanos(retry_after);
                    // Up to an eighth more, at random: bodies of one key
                    // refused together do not all wake together, each to
                    // be refused again but one.
                    let wait =
                        wait.saturating_add(wait.mul_f64(crate::observe::random_unit() / 8.0));
                    self.metrics.wait.record(wait.as_secs_f64());
                    let at = tokio::time::Instant::now()
                        .checked_add(wait)
                        .unwrap_or_else(tokio::time::Instant::now);
                    match &mut self.sleep {
                        Some(sleep) => sleep.as_mut().reset(at),
                        None => self.sleep = Some(Box::pin(tokio::time::sleep_until(at))),
                    }
                    self.waiting = true;
                    true
                }
                Outcome::Never => {
                    self.metrics.unpaced.increment(1);
                    false
                }
            },
            Err(error) => {
                self.metrics.unpaced.increment(1);
                tracing::debug!(target: "tollgate", %error, "bandwidth store failed; body no longer paced");
                false
            }
        }
    }

    /// Gives unspent tokens back (the body ended or was dropped).
    fn refund(&mut self) {
        let credit = std::mem::take(&mut self.credit);
        if credit > 0 {
            crate::task::finish(self.limiter.refund(self.key.as_bytes(), credit));
        }
    }

    /// The next data to let out, or `Pending` while the budget is empty.
    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Next> {
        loop {
            if let (true, Some(sleep)) = (self.waiting, &mut self.sleep) {
                ready!(sleep.as_mut().poll(cx));
                self.waiting = false;
            }
            if let Some(deciding) = &mut self.deciding {
                let answer = ready!(deciding.as_mut().poll(cx));
                self.deciding = None;
                if !self.answer(answer) {
                    return Poll::Ready(Next::Stop(self.pending.take()));
                }
                continue;
            }
            let Some(data) = &mut self.pending else {
                return Poll::Ready(Next::Empty);
            };
            if self.credit > 0 {
                let n = usize::try_from(self.credit)
                    .unwrap_or(usize::MAX)
                    .min(data.len());
                let out = data.split_to(n);
                self.credit = self.credit.saturating_sub(n as u64);
                self.metrics.bytes.increment(n as u64);
                if data.is_empty() {
                    self.pending = None;
                }
                return Poll::Ready(Next::Data(out));
            }
            // A chunk, or what is left of a body known to be shorter: a
            // short answer waits for its own bytes, not for a chunk's. (A
            // body of unknown length takes whole chunks: one store call a
            // chunk, not one a frame.)
            let chunk = u64::from(self.chunk);
            self.asked = match self.rest {
                Some(rest) => chunk.min((data.len() as u64).saturating_add(rest)).max(1),
                None => chunk,
            };
            match self.limiter.decide_sync(self.key.as_bytes(), self.asked) {
                Some(answer) => {
                    if !self.answer(answer) {
                        return Poll::Ready(Next::Stop(self.pending.take()));
                    }
                }
                None => {
                    self.deciding = Some(Box::pin(
                        self.limiter.decide(self.key.as_bytes(), self.asked),
                    ));
                }
            }
        }
    }
}

/// What a pacer lets out next.
enum Next {
    /// Data the budget covers.
    Data(Bytes),
    /// Pacing stopped; the rest of the pending frame, if any, goes out as
    /// it is.
    Stop(Option<Bytes>),
    /// Nothing pending: read the body.
    Empty,
}

impl<L: Limiter> Drop for Pacer<L> {
    fn drop(&mut self) {
        self.refund();
    }
}

pin_project! {
    /// A request or response body paced to a byte rate per key (see
    /// [`BandwidthLayer`](super::BandwidthLayer)), or passed through as is
    /// when the layer does not pace that direction or the request has no
    /// key.
    pub struct PacedBody<B, L: Limiter> {
        #[pin]
        body: B,
        pacer: Option<Pacer<L>>,
    }
}

impl<B: fmt::Debug, L: Limiter> fmt::Debug for PacedBody<B, L> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PacedBody")
            .field("body", &self.body)
            .field("paced", &self.pacer.is_some())
            .finish()
    }
}

impl<B, L: Limiter> PacedBody<B, L> {
    pub(crate) fn new(body: B, pacer: Option<Pacer<L>>) -> Self {
        Self { body, pacer }
    }
}

/// An outer layer's rejection, not paced.
impl<B, L> crate::RejectionBody for PacedBody<B, L>
where
    B: crate::RejectionBody,
    L: Limiter,
{
    fn rejection(bytes: Bytes) -> Self {
        Self::new(B::rejection(bytes), None)
    }
}

impl<B, L> Body for PacedBody<B, L>
where
    B: Body<Data = Bytes>,
    L: Limiter,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let mut this = self.project();
        loop {
            let Some(pacer) = this.pacer.as_mut() else {
                return this.body.poll_frame(cx);
            };
            match ready!(pacer.poll_next(cx)) {
                Next::Data(data) => return Poll::Ready(Some(Ok(Frame::data(data)))),
                // No longer paced: the rest goes out as it comes.
                Next::Stop(rest) => {
                    *this.pacer = None;
                    if let Some(data) = rest {
                        return Poll::Ready(Some(Ok(Frame::data(data))));
                    }
                    continue;
                }
                Next::Empty => {}
            }
            let frame = ready!(this.body.as_mut().poll_frame(cx));
            match frame {
                Some(Ok(frame)) => match frame.into_data() {
                    // Covered by the credit in hand (an empty frame always
                    // is): out as it came.
                    Ok(data) if data.len() as u64 <= pacer.credit => {
                        pacer.credit = pacer.credit.saturating_sub(data.len() as u64);
                        pacer.metrics.bytes.increment(data.len() as u64);
                        return Poll::Ready(Some(Ok(Frame::data(data))));
                    }
                    Ok(data) => {
                        pacer.rest = this.body.size_hint().upper();
                        pacer.pending = Some(data);
                    }
                    // Trailers and other frames cost nothing.
                    Err(frame) => return Poll::Ready(Some(Ok(frame))),
                },
                end => {
                    // Done (or failed): unspent tokens go back.
                    pacer.refund();
                    return Poll::Ready(end);
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.pacer.as_ref().is_none_or(|p| p.pending.is_none()) && self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let mut hint = self.body.size_hint();
        if let Some(pending) = self.pacer.as_ref().and_then(|p| p.pending.as_ref()) {
            let n = pending.len() as u64;
            // Upper first: `set_lower` asserts the lower is not above it.
            if let Some(upper) = hint.upper() {
                hint.set_upper(upper.saturating_add(n));
            }
            hint.set_lower(hint.lower().saturating_add(n));
        }
        hint
    }
}
