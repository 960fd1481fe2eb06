//! Envoy's rate limit service (`envoy.service.ratelimit.v3`,
//! `ShouldRateLimit`) over the descriptor trees of [`envoy`](crate::envoy):
//! Envoy's `ratelimit` filter, pointed at this server, gets tollgate's
//! algorithms and stores.
//!
//! Each descriptor of a request is matched on its own; `hits_addend` (the
//! descriptor's, else the request's, else 1) is its cost; a limit a
//! matched limit `replaces` is not applied; a `shadow_mode` limit counts
//! and never refuses; an `unlimited` one always allows. The request is
//! over the limit when any enforced descriptor is, and then the
//! descriptors that allowed it are given their units back: a request
//! refused costs nothing, as with tollgate's layers (Envoy's own service
//! keeps what it counted). Each status carries `current_limit`,
//! `limit_remaining` and `duration_until_reset`, and the response the
//! IETF `RateLimit` and `RateLimit-Policy` fields to add.
//! A descriptor's own `limit` override is not applied (the configured
//! limit is; logged at debug level). A store error
//! allows the descriptor (the store's failure policy already chose; a
//! gateway whose rate limit service fails usually fails open too).

use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tollgate::Limiter;

use crate::envoy::Domains;

/// The `RateLimitService` gRPC service; serve it with
/// `RateLimitServiceServer::new(Rls::new(domains))`.
pub struct Rls<L> {
    domains: Arc<arc_swap::ArcSwap<Domains<L>>>,
}

impl<L> Clone for Rls<L> {
    /// The same service: a reload through one is seen by all.
    fn clone(&self) -> Self {
        Self {
            domains: Arc::clone(&self.domains),
        }
    }
}

impl<L> std::fmt::Debug for Rls<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rls").finish_non_exhaustive()
    }
}

impl<L> Rls<L> {
    /// The service over `domains`.
    pub fn new(domains: Domains<L>) -> Self {
        Self {
            domains: Arc::new(arc_swap::ArcSwap::from_pointee(domains)),
        }
    }

    /// Decides with `domains` from now on (a reload).
    pub fn replace(&self, domains: Domains<L>) {
        self.domains.store(Arc::new(domains));
    }
}

/// One descriptor's part of a decision.
struct Part<'a, L> {
    matched: Option<crate::envoy::Matched<'a, L>>,
    cost: u64,
    negative: bool,
    decision: Option<tollgate::Decision>,
}

#[tonic::async_trait]
impl<L: Limiter + Send + Sync + 'static> RateLimitService for Rls<L> {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        let req = request.into_inner();
        let domains = self.domains.load_full();
        let default_cost = if req.hits_addend == 0 {
            1
        } else {
            u64::from(req.hits_addend)
        };
        let mut parts: Vec<Part<'_, L>> = req
            .descriptors
            .iter()
            .map(|d| {
                let entries: Vec<(&str, &str)> = d
                    .entries
                    .iter()
                    .map(|e| (e.key.as_str(), e.value.as_str()))
                    .collect();
                if d.limit.is_some() {
                    // Envoy's per-descriptor override (from dynamic
                    // metadata): not applied; the configured limit is.
                    tracing::debug!(domain = %req.domain, "a descriptor's limit override is not applied");
                }
                Part {
                    matched: domains.matched(&req.domain, &entries),
                    cost: d.hits_addend.as_ref().map_or(default_cost, |h| h.value),
                    negative: d.is_negative_hits,
                    decision: None,
                }
            })
            .collect();
        // A limit another matched limit replaces does not apply.
        let replaced: Vec<&str> = parts
            .iter()
            .filter_map(|p| p.matched.as_ref().map(|m| m.bound))
            .flat_map(|b| b.replaces.iter().map(String::as_str))
            .collect();
        for p in &mut parts {
            if p.matched
                .as_ref()
                .is_some_and(|m| replaced.contains(&m.bound.name.as_str()))
            {
                p.matched = None;
            }
        }
        if !req.descriptors.is_empty() && !domains.knows(&req.domain) {
            tracing::debug!(domain = %req.domain, "a rate limit request for an unknown domain: allowed");
        }
        // Negative hits give units back; the rest are decided together:
        // one step where the store has one, and an enforced denial
        // consumes nothing of the others.
        for p in &parts {
            if let (true, Some(m)) = (p.negative, &p.matched) {
                if let Some(limiter) = &m.bound.limiter {
                    if let Err(e) = limiter.refund(&m.key, p.cost).await {
                        tracing::warn!(error = %e, "a negative hit was not given back");
                    }
                }
            }
        }
        let decided: Vec<usize> = (0..parts.len())
            .filter(|i| {
                parts.get(*i).is_some_and(|p| {
                    !p.negative
                        && p.matched
                            .as_ref()
                            .is_some_and(|m| m.bound.limiter.is_some())
                })
            })
            .collect();
        let joint: Vec<tollgate::core::JointPart<'_, L>> = decided
            .iter()
            .filter_map(|i| {
                let p = parts.get(*i)?;
                let m = p.matched.as_ref()?;
                Some(tollgate::core::JointPart {
                    limiter: m.bound.limiter.as_ref()?,
                    key: &m.key,
                    cost: p.cost,
                    enforced: !m.bound.shadow,
                })
            })
            .collect();
        // All or nothing: what an enforced denial leaves consumed (a
        // store without a one-step joint, or leases, decide each part on
        // its own) goes back.
        let mut answers = match joint.as_slice() {
            // One descriptor (the common case): its rule's own decision,
            // not the store's general joint step (on Redis, the rule's
            // script rather than the joint script's dispatch); nothing
            // else to give back.
            [one] => vec![tollgate::core::JointDecision::alone(
                one.limiter.decide(one.key, one.cost).await,
                one.cost,
            )],
            parts => tollgate::core::decide_parts(parts).await,
        };
        tollgate::core::give_back_if_denied(&joint, &mut answers).await;
        drop(joint);
        let mut over = false;
        for (i, answer) in decided.iter().zip(answers) {
            let Some(p) = parts.get_mut(*i) else { continue };
            match answer.decision {
                Ok(d) => {
                    over |= !d.is_allowed() && p.matched.as_ref().is_some_and(|m| !m.bound.shadow);
                    p.decision = Some(d);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "a descriptor was allowed for want of the store")
                }
            }
        }
        let mut policy = Vec::new();
        let mut fields = Vec::new();
        let statuses = parts
            .iter()
            .map(|p| {
                let Some(m) = &p.matched else {
                    return DescriptorStatus {
                        code: Code::Ok.into(),
                        ..DescriptorStatus::default()
                    };
                };
                let Some(d) = &p.decision else {
                    // Unlimited (or negative hits): nothing is counted.
                    return DescriptorStatus {
                        code: Code::Ok.into(),
                        limit_remaining: if m.bound.limiter.is_none() {
                            u32::MAX
                        } else {
                            0
                        },
                        ..DescriptorStatus::default()
                    };
                };
                let refused = !d.is_allowed() && !m.bound.shadow;
                let reset = std::time::Duration::from_nanos(d.reset_after);
                let remaining = if refused { 0 } else { d.remaining };
                if !m.bound.shadow {
                    let name = field_name(&m.bound.name);
                    policy.push(format!(
                        "\"{name}\";q={};w={}",
                        m.bound.requests_per_unit, m.bound.window_secs
                    ));
                    fields.push(format!(
                        "\"{name}\";r={remaining};t={}",
                        reset
                            .as_secs()
                            .saturating_add(u64::from(reset.subsec_nanos() > 0))
                    ));
                }
                DescriptorStatus {
                    code: if refused { Code::OverLimit } else { Code::Ok }.into(),
                    current_limit: Some(RateLimit {
                        name: m.bound.name.clone(),
                        requests_per_unit: m.bound.requests_per_unit,
                        unit: m.bound.unit,
                    }),
                    limit_remaining: u32::try_from(remaining).unwrap_or(u32::MAX),
                    duration_until_reset: Some(envoy_types::pb::google::protobuf::Duration {
                        seconds: i64::try_from(reset.as_secs()).unwrap_or(i64::MAX),
                        nanos: i32::try_from(reset.subsec_nanos()).unwrap_or(0),
                    }),
                    quota: None,
                }
            })
            .collect();
        let mut response_headers_to_add = Vec::new();
        if !policy.is_empty() {
            response_headers_to_add.push(HeaderValue {
                key: "RateLimit-Policy".to_owned(),
                value: policy.join(", "),
                ..HeaderValue::default()
            });
            response_headers_to_add.push(HeaderValue {
                key: "RateLimit".to_owned(),
                value: fields.join(", "),
                ..HeaderValue::default()
            });
        }
        Ok(tonic::Response::new(RateLimitResponse {
            overall_code: if over { Code::OverLimit } else { Code::Ok }.into(),
            statuses,
            response_headers_to_add,
            ..RateLimitResponse::default()
        }))
    }
}

/// The texts of `files` as one value (an unreadable file by its error),
/// to see whether any changed.
fn contents(files: &[std::path::PathBuf]) -> Vec<Result<String, String>> {
    files
        .iter()
        .map(|f| std::fs::read_to_string(f).map_err(|e| e.to_string()))
        .collect()
}

/// Keeps `rls` in step with its configuration `files` on `store`: reloads
/// on SIGHUP (Unix) and when their contents change (read every `poll`;
/// new contents apply once two reads in a row agree, so a file caught
/// half written never applies). A set that does not load is logged and
/// the running one stays; it is checked on a handle that binds nothing in
/// the store before it is bound, so a rejected set changes no counter.
pub fn watch<St>(
    files: Vec<std::path::PathBuf>,
    store: St,
    rls: Rls<St::Limiter>,
    poll: std::time::Duration,
) -> tokio::task::JoinHandle<()>
where
    St: tollgate::Store + Send + Sync + 'static,
    St::Limiter: Send + Sync + 'static,
{
    watch_files(files, poll, move |files| {
        reload(files, &store, &rls);
    })
}

/// Calls `reload` with `files` on SIGHUP (Unix) and when their contents
/// change (read every `poll`; new contents once two reads in a row
/// agree).
pub(crate) fn watch_files<F>(
    files: Vec<std::path::PathBuf>,
    poll: std::time::Duration,
    mut reload: F,
) -> tokio::task::JoinHandle<()>
where
    F: FnMut(&[std::path::PathBuf]) + Send + 'static,
{
    // What runs now: read here, not when the task first runs, so that a
    // change made meanwhile is seen as one.
    let mut applied = contents(&files);
    let mut settling = applied.clone();
    tokio::spawn(async move {
        let mut triggers = tollgate::config::Triggers::new(poll);
        loop {
            // `true`: a SIGHUP, which reloads whatever the files hold.
            let signalled = triggers.next().await;
            let now = contents(&files);
            if !signalled {
                if now == applied {
                    continue;
                }
                if now != settling {
                    settling = now;
                    continue;
                }
            }
            reload(&files);
            applied = now.clone();
            settling = now;
        }
    })
}

/// Loads `files` into `rls` on `store`: checked on a handle that binds
/// nothing first, then bound (rebinding: unchanged limits keep their
/// counts). A set that does not load is logged and the running one
/// stays. Returns the texts it applied.
pub(crate) fn reload<St>(
    files: &[std::path::PathBuf],
    store: &St,
    rls: &Rls<St::Limiter>,
) -> Option<Vec<(std::path::PathBuf, String)>>
where
    St: tollgate::Store,
{
    let loaded = crate::envoy::read(files).and_then(|texts| {
        crate::envoy::Domains::from_texts(&texts, &store.checking())?;
        let domains = crate::envoy::Domains::from_texts(&texts, &store.rebinding())?;
        Ok((domains, texts))
    });
    match loaded {
        Ok((domains, texts)) => {
            rls.replace(domains);
            tracing::info!("Envoy rate limit configuration reloaded");
            Some(texts)
        }
        Err(e) => {
            tracing::error!(
                error = %e,
                "Envoy rate limit configuration rejected; the running one stays"
            );
            None
        }
    }
}

/// Serves Envoy's rate limit service (and `grpc.health.v1`, reporting it
/// serving) on `listener`, until [`shutdown`](crate::shutdown).
pub async fn serve<L: Limiter + Send + Sync + 'static>(
    listener: tokio::net::TcpListener,
    rls: Rls<L>,
) -> Result<(), tonic::transport::Error> {
    serve_with(listener, rls, None).await
}

/// [`serve`] over TLS (`[server.tls]`, read by
/// [`tls::load`](crate::tls::load)), or without it (`None`).
pub async fn serve_with<L: Limiter + Send + Sync + 'static>(
    listener: tokio::net::TcpListener,
    rls: Rls<L>,
    tls: Option<&crate::tls::Tls>,
) -> Result<(), tonic::transport::Error> {
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_serving::<RateLimitServiceServer<Rls<L>>>()
        .await;
    let router = tonic::transport::Server::builder()
        .add_service(health)
        .add_service(RateLimitServiceServer::new(rls));
    match tls {
        // Handshakes as the decision endpoints' (see `tls`): a deadline,
        // and caps per address and in all.
        Some(tls) => {
            router
                .serve_with_incoming_shutdown(
                    crate::tls::grpc_incoming(listener, tls),
                    crate::shutdown(),
                )
                .await
        }
        None => {
            router
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::TcpListenerStream::new(listener),
                    crate::shutdown(),
                )
                .await
        }
    }
}

/// `name` as a structured field string's content: printable ASCII, with
/// `"` and `\` escaped (a configuration's names are free text).
fn field_name(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for c in name.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            ' '..='~' => out.push(c),
            _ => out.push('?'),
        }
    }
    out
}
