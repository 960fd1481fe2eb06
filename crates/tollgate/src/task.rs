//! Finishing a store call nobody waits for (a release, a refund) without
//! dropping it half-done.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Waker};

/// Runs `fut` to completion: at once if it is ready on its first poll (an
/// in-memory store), else as a task on the current Tokio runtime (a store
/// that goes over the network). Returns whether it finished at once. With
/// no runtime to run it on, it is dropped: what it would have given back
/// lapses on its own (a Redis lease by its TTL, a refund is lost).
pub(crate) fn finish<F>(fut: F) -> bool
where
    F: Future + Send + 'static,
{
    let mut fut: Pin<Box<F>> = Box::pin(fut);
    let mut cx = Context::from_waker(Waker::noop());
    if fut.as_mut().poll(&mut cx).is_ready() {
        return true;
    }
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(async move {
            fut.await;
        });
    }
    false
}
