//! What the two comparisons share: limitador's request, a task's loop of
//! decisions, and their rounds' statistics.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// limitador's context for one hit of `key` as descriptor variable `var`.
pub fn context(var: &str, key: &str) -> limitador::limit::Context<'static> {
    HashMap::from([(var.to_owned(), key.to_owned())]).into()
}

/// Whether limitador's async limiter admits one hit of `key` (variable
/// `var`, namespace `bench`), counting it if so.
pub async fn limitador_admits(l: &limitador::AsyncRateLimiter, var: &str, key: &str) -> bool {
    !l.check_rate_limited_and_update(&"bench".into(), &context(var, key), 1)
        .await
        .unwrap()
        .limited
}

/// One task of a round: asks `decide` until `deadline`, keeping each
/// answer's latency and counting each admission in `admitted`; `None`
/// from `decide` (a decision that stalled) ends the task.
pub async fn decide_until<F, Fut>(
    deadline: Instant,
    admitted: &AtomicU64,
    mut decide: F,
) -> Vec<Duration>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<bool>>,
{
    let mut latencies = Vec::new();
    while Instant::now() < deadline {
        let at = Instant::now();
        match decide().await {
            Some(true) => {
                admitted.fetch_add(1, Ordering::Relaxed);
            }
            Some(false) => {}
            None => break,
        }
        latencies.push(at.elapsed());
        // A decision answered at once (a lease, memory) never yields; in
        // a server, each request's I/O does. Without this, the tasks whose
        // decision waits on Redis starve behind those that never wait, and
        // their wait is counted as the limiter's.
        tokio::task::coop::consume_budget().await;
    }
    latencies
}

/// The `p`-quantile (0 to 1) of `sorted`.
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(i).copied().unwrap_or_default()
}

/// The median of `v` (the upper one of an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}
