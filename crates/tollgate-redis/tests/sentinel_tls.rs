//! Sentinel over TLS (fleet review L5): `rediss+sentinel://` reaches a
//! TLS-only sentinel and the TLS-only master it names, so the master's
//! password never goes in clear. The certificates are checked against
//! the system's roots, here `SSL_CERT_FILE` naming the test's own CA.
//! (Its own test binary: the test sets that variable for the process.)
#![cfg(feature = "tls")]
#![allow(missing_docs, clippy::unwrap_used, clippy::panic)]

use std::time::Duration;

use tollgate_core::{Limit, Limiter, Rate, Rule, Store};
use tollgate_redis::testing::{unique_prefix, Tls};
use tollgate_redis::{FailurePolicy, RedisLimiter, RedisStore};

fn limiter(url: &str) -> RedisLimiter {
    let rule = Rule::new("per-key", Limit::gcra(Rate::per_minute(1), 2)).unwrap();
    RedisStore::builder(url)
        .prefix(&unique_prefix())
        .timeout(Duration::from_secs(2))
        .failure_policy(FailurePolicy::Closed)
        .build()
        .unwrap()
        .limiter(&rule)
        .unwrap()
}

/// Whether Redis itself decided for `limiter` (2 of 2, then refused with
/// the script's wait of about a minute), not its Closed failure policy
/// (refused, 1 s).
async fn redis_answers(limiter: &RedisLimiter) -> bool {
    let first = limiter.decide(b"k", 1).await.unwrap();
    if !first.is_allowed() {
        assert_eq!(first.retry_after(), Some(Duration::from_secs(1)));
        return false;
    }
    assert_eq!(first.remaining, 1);
    assert_eq!(limiter.decide(b"k", 1).await.unwrap().remaining, 0);
    let wait = limiter
        .decide(b"k", 1)
        .await
        .unwrap()
        .retry_after()
        .unwrap();
    assert!(wait > Duration::from_secs(50), "{wait:?}");
    true
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_reaches_a_tls_sentinel_and_its_tls_master() {
    let Some(tls) = Tls::start() else {
        return;
    };
    // The master requires a password: it goes to the master over TLS.
    let master = tls.server(Some("s3cret"));
    let sentinel = tls.sentinel(&master, Some("s3cret"));
    let at = format!(":s3cret@127.0.0.1:{}/tollgate", sentinel.port);
    // Plain text to a TLS-only sentinel: no answer.
    assert!(!redis_answers(&limiter(&format!("redis+sentinel://{at}"))).await);
    // TLS, but the CA is not among the roots: no answer either.
    assert!(!redis_answers(&limiter(&format!("rediss+sentinel://{at}"))).await);
    // `#insecure` checks no certificate (and warns).
    assert!(redis_answers(&limiter(&format!("rediss+sentinel://{at}#insecure"))).await);
    // The CA among the roots: the sentinel, then the master, over TLS.
    std::env::set_var("SSL_CERT_FILE", tls.path("ca.crt"));
    assert!(redis_answers(&limiter(&format!("rediss+sentinel://{at}"))).await);
    // The master's password is sent (a wrong one gets no answer).
    let wrong = format!(
        "rediss+sentinel://:wrong@127.0.0.1:{}/tollgate",
        sentinel.port
    );
    assert!(!redis_answers(&limiter(&wrong)).await);
    // `#insecure` is for TLS: on a plain URL, an error.
    let e = RedisStore::builder(&format!("redis+sentinel://{at}#insecure"))
        .prefix("p")
        .build()
        .unwrap_err();
    assert_eq!(e.field(), "url");
    assert!(!e.to_string().contains("s3cret"), "{e}");
    // A root of one's own is for a standalone URL: here, an error that
    // says where the CA goes.
    let e = RedisStore::builder(&format!("rediss+sentinel://{at}"))
        .prefix("p")
        .tls_root_cert(tls.ca())
        .build()
        .unwrap_err();
    assert_eq!(e.field(), "tls_root_cert");
    assert!(e.message().contains("SSL_CERT_FILE"), "{e}");
}
