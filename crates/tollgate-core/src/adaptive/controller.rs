use super::aimd::AimdState;
use super::gradient_state::GradientState;
use super::AdaptiveLimit;

/// One completed request, as the controller sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// How long the request took, in nanoseconds: from admission to the
    /// response's head (the layers sample there, so that a long body —
    /// an event stream, a download — neither holds the limit nor reads as
    /// latency), or to its trailers for a gRPC answer whose status comes
    /// in them.
    pub rtt: u64,
    /// Whether the request failed because the backend was overloaded
    /// (a timeout, a 503, a rejection from further down). Failures that
    /// are the client's fault (a 404, a 400) are not drops.
    pub dropped: bool,
    /// Requests in flight when this one completed, counting itself.
    pub in_flight: u32,
}

/// A running adaptive limit: feed it every completed request, read the
/// current limit before admitting one.
///
/// The limit is always within the configuration's `[min, max]`, whatever
/// the samples (zero or huge RTTs, a clock that goes backwards).
#[derive(Debug)]
pub struct Controller {
    state: Running,
}

#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // one per limiter: 200 bytes, no box to chase per sample
enum Running {
    Aimd(AimdState),
    Gradient(GradientState),
}

impl Controller {
    /// A controller at the configuration's `initial` limit. `seed` drives
    /// the jitter of [`Gradient`](super::Gradient)'s re-probing, so that
    /// controllers built at the same moment do not probe in step; give each
    /// instance its own (a process id, a hash of the host name and route).
    ///
    /// A gradient controller first measures its baseline: its limit is `min`
    /// until the first probe ends, then `initial`.
    pub fn new(limit: &AdaptiveLimit, seed: u64) -> Self {
        let state = match limit {
            AdaptiveLimit::Aimd(config) => Running::Aimd(AimdState::new(config)),
            AdaptiveLimit::Gradient(config) => Running::Gradient(GradientState::new(config, seed)),
        };
        Self { state }
    }

    /// The current limit on requests in flight.
    pub fn limit(&self) -> u32 {
        match &self.state {
            Running::Aimd(s) => s.limit(),
            Running::Gradient(s) => s.limit(),
        }
    }

    /// Time passing at `now` with no sample to feed: a gradient probe that
    /// has run its longest (10 s) ends, so a service whose requests give
    /// no samples (every one a long stream; no traffic) is not held at
    /// `min`. Call it now and then when requests are being refused.
    /// Returns the limit.
    pub fn on_tick(&mut self, now: u64) -> u32 {
        match &mut self.state {
            Running::Aimd(s) => s.limit(),
            Running::Gradient(s) => s.on_tick(now),
        }
    }

    /// Feeds one completed request at `now` (monotonic nanoseconds, the
    /// caller's clock) and returns the new limit.
    pub fn on_sample(&mut self, now: u64, sample: Sample) -> u32 {
        match &mut self.state {
            Running::Aimd(s) => s.on_sample(sample),
            Running::Gradient(s) => s.on_sample(now, sample),
        }
    }
}
