//! TLS (`rediss://`) against a TLS-only `redis-server`, with a CA the test
//! makes itself: the store verifies the server against that CA, and one
//! that does not trust it gets no answer from Redis (its failure policy
//! answers).
#![cfg(feature = "tls")]
#![allow(missing_docs, clippy::unwrap_used, clippy::panic)]

use std::time::Duration;

use tollgate_core::{Limit, Limiter, Rate, Rule, Store};
use tollgate_redis::testing::{unique_prefix, Tls};
use tollgate_redis::{FailurePolicy, RedisStore};

fn store(url: &str, root: Option<Vec<u8>>) -> RedisStore {
    let mut b = RedisStore::builder(url)
        .prefix(&unique_prefix())
        .timeout(Duration::from_secs(2))
        .failure_policy(FailurePolicy::Closed);
    if let Some(root) = root {
        b = b.tls_root_cert(root);
    }
    b.build().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_with_a_ca_of_its_own() {
    let Some(tls) = Tls::start() else {
        return;
    };
    let server = tls.server(None);
    let port = server.port;
    let url = format!("rediss://127.0.0.1:{port}");
    let rule = Rule::new("per-key", Limit::gcra(Rate::per_minute(1), 2)).unwrap();
    let ca = tls.ca();
    let trusted = store(&url, Some(ca)).limiter(&rule).unwrap();
    // Redis answers over TLS: 2 of 2, then refused with the script's wait
    // (the Closed failure policy would say 1 s).
    assert_eq!(trusted.decide(b"k", 1).await.unwrap().remaining, 1);
    assert_eq!(trusted.decide(b"k", 1).await.unwrap().remaining, 0);
    let wait = trusted
        .decide(b"k", 1)
        .await
        .unwrap()
        .retry_after()
        .unwrap();
    assert!(
        wait > Duration::from_secs(50) && wait <= Duration::from_secs(60),
        "{wait:?}"
    );
    // Without the CA, the server's certificate is not trusted: no answer
    // from Redis, so the failure policy's (Closed: refused, 1 s).
    let untrusted = store(&url, None).limiter(&rule).unwrap();
    let d = untrusted.decide(b"other", 1).await.unwrap();
    assert!(!d.is_allowed());
    assert_eq!(d.retry_after(), Some(Duration::from_secs(1)));
    // A root of its own is for a standalone URL: elsewhere, an error.
    for url in [
        "redis+cluster://127.0.0.1:1",
        "redis+sentinel://127.0.0.1:1/x",
    ] {
        let e = RedisStore::builder(url)
            .prefix("p")
            .tls_root_cert(b"pem".to_vec())
            .build()
            .unwrap_err();
        assert_eq!(e.field(), "tls_root_cert");
    }
}
