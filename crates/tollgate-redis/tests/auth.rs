//! Redis with ACL users: the store authenticates with the user and
//! password of its URL, and the password never shows in its errors or
//! its `Debug` output.
#![allow(missing_docs, clippy::unwrap_used)]

use std::time::Duration;

use tollgate_core::{Limit, Limiter, Rate, Rule, Store};
use tollgate_redis::testing::{unique_prefix, Server};
use tollgate_redis::{FailurePolicy, RedisStore};

const PASSWORD: &str = "s3cret-pw-do-not-log";

fn store(url: &str, policy: FailurePolicy) -> RedisStore {
    RedisStore::builder(url)
        .prefix(&unique_prefix())
        .timeout(Duration::from_secs(2))
        .failure_policy(policy)
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acl_user_from_the_url_and_a_password_that_never_shows() {
    let Some(server) = Server::start() else {
        return;
    };
    // A user of its own, with a password.
    let ok = server.cli(&[
        "ACL",
        "SETUSER",
        "limiter",
        "on",
        &format!(">{PASSWORD}"),
        "~*",
        "+@all",
    ]);
    // ACL users came with Redis 6.0: on Redis 5.0 (which
    // `.ci/redis-versions` runs) there is nothing to test here.
    if ok.contains("unknown command")
        && server.cli(&["INFO", "server"]).contains("redis_version:5.")
    {
        return;
    }
    assert_eq!(ok.trim(), "OK");
    let port = server.url().rsplit(':').next().unwrap().to_owned();
    let rule = Rule::new("per-key", Limit::gcra(Rate::per_second(1), 1)).unwrap();

    let good = store(
        &format!("redis://limiter:{PASSWORD}@127.0.0.1:{port}"),
        FailurePolicy::Closed,
    );
    let l = good.limiter(&rule).unwrap();
    assert!(l.decide(b"k", 1).await.unwrap().is_allowed());
    // Redis kept the state (the failure policy would refuse too, so look
    // at Redis).
    assert!(!l.decide(b"k", 1).await.unwrap().is_allowed());
    assert!(server.cli(&["DBSIZE"]).trim().parse::<u64>().unwrap() >= 1);

    // A wrong password: the failure policy answers (Closed: refused), and
    // nothing the store shows carries the password.
    let bad_url = format!("redis://limiter:wrong-{PASSWORD}@127.0.0.1:{port}");
    let bad = store(&bad_url, FailurePolicy::Closed);
    let l = bad.limiter(&rule).unwrap();
    assert!(!l.decide(b"k2", 1).await.unwrap().is_allowed());
    assert!(!format!("{bad:?}").contains(PASSWORD));
    assert!(!format!("{:?}", RedisStore::builder(&bad_url)).contains(PASSWORD));

    // A URL that does not parse: the error names the field, not the secret.
    let e = RedisStore::builder(&format!("redis://limiter:{PASSWORD}@127.0.0.1:notaport"))
        .prefix("p")
        .build()
        .unwrap_err();
    assert_eq!(e.field(), "url");
    assert!(!e.to_string().contains(PASSWORD), "{e}");
}
