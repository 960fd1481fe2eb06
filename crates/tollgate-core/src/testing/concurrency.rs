//! Concurrency: permits and leases.

use super::*;

/// Permits: up to `max` per key, then denied with the rule's retry hint;
/// a ceiling holds a class of traffic to a share (critical reserve);
/// permits above the ceiling are `Never`; release frees; `held` counts;
/// keys are independent; hostile keys are ordinary keys. What every store
/// does, whether its permits lapse or not (see [`lease_expiry`]).
pub async fn concurrency_permits<S: Store>(store: &S, clock: &ManualClock) {
    let rule = ConcurrencyRule::new("conc", 3, Duration::from_secs(10))
        .unwrap()
        .with_retry_after(Duration::from_millis(1_500))
        .unwrap();
    let sem = store.concurrency_limiter(&rule).unwrap();
    let key = b"tenant";
    let all = u32::MAX;
    let a = sem.acquire(key, 2, all).await.unwrap();
    let lease_a = a.lease.expect("first acquire");
    assert_eq!((a.decision.limit, a.decision.remaining), (3, 1));
    assert_eq!(lease_a.permits, 2);
    clock.advance(Duration::from_secs(4));
    // Held to 2 of 3: a second class of traffic gets no more.
    let shared = sem.acquire(key, 1, 2).await.unwrap();
    assert!(shared.lease.is_none(), "{shared:?}");
    assert_eq!(
        shared.decision.outcome,
        Outcome::Deny {
            retry_after: 1_500 * MS
        }
    );
    assert_eq!(
        sem.acquire(key, 3, 2).await.unwrap().decision.outcome,
        Outcome::Never
    );
    let b = sem.acquire(key, 1, all).await.unwrap();
    let lease_b = b.lease.expect("second acquire");
    assert_eq!(lease_b.permits, 1);
    assert_eq!(b.decision.remaining, 0);
    let c = sem.acquire(key, 1, all).await.unwrap();
    assert!(c.lease.is_none());
    assert_eq!(
        c.decision.outcome,
        Outcome::Deny {
            retry_after: 1_500 * MS
        }
    );
    assert_eq!(
        sem.acquire(key, 4, all).await.unwrap().decision.outcome,
        Outcome::Never
    );
    let peek = sem.acquire(key, 0, all).await.unwrap();
    assert!(peek.decision.is_allowed() && peek.lease.is_none());
    assert_eq!(sem.held(key).await.unwrap(), 3);
    // Another key, hostile ones included, is untouched.
    for other in [&b"other"[..], b"", b"{slot}\r\n", &[0xff; 300][..]] {
        let o = sem.acquire(other, 3, all).await.unwrap();
        let lease = o.lease.expect("independent key");
        assert_eq!(sem.held(other).await.unwrap(), 3);
        sem.release(other, lease).await.unwrap();
        assert_eq!(sem.held(other).await.unwrap(), 0);
    }
    sem.release(key, lease_b).await.unwrap();
    assert_eq!(sem.held(key).await.unwrap(), 2);
    let d = sem.acquire(key, 1, all).await.unwrap();
    let lease_d = d.lease.expect("after release");
    sem.release(key, lease_a).await.unwrap();
    sem.release(key, lease_d).await.unwrap();
    assert_eq!(sem.held(key).await.unwrap(), 0);
    assert_eq!(sem.held(b"never-seen").await.unwrap(), 0);
    // A release whose future is dropped unpolled still happens (this is
    // how a guard releases from `Drop`).
    let e = sem
        .acquire(key, 3, all)
        .await
        .unwrap()
        .lease
        .expect("whole");
    drop(sem.release(key, e));
    let mut freed = false;
    for _ in 0..2_000 {
        if sem.held(key).await.unwrap() == 0 {
            freed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(freed, "a dropped release future cancelled the release");
    // A store that finds leases by the lease alone is given no key.
    if sem.releases_by_lease() {
        let f = sem.acquire(key, 2, all).await.unwrap().lease.expect("two");
        let g = sem
            .acquire(b"other", 1, all)
            .await
            .unwrap()
            .lease
            .expect("one");
        sem.release(b"", f).await.unwrap();
        sem.release(key, g).await.unwrap();
        assert_eq!(sem.held(key).await.unwrap(), 0);
        assert_eq!(sem.held(b"other").await.unwrap(), 0);
    }
}

/// For stores whose permits are leases that lapse (networked stores): a
/// lease that is never released lapses after the rule's lease TTL, and
/// frees its permits. A store that renews the leases of live holders must
/// have its renewal off for this scenario, which moves the clock past the
/// TTL while the lease is still held.
pub async fn lease_expiry<S: Store>(store: &S, clock: &ManualClock) {
    let rule = ConcurrencyRule::new("lapse", 2, Duration::from_secs(10)).unwrap();
    let sem = store.concurrency_limiter(&rule).unwrap();
    let key = b"crashed";
    let lease = sem.acquire(key, 2, u32::MAX).await.unwrap().lease;
    assert!(lease.is_some());
    clock.advance(Duration::from_millis(9_999));
    assert_eq!(sem.held(key).await.unwrap(), 2);
    assert!(sem.acquire(key, 1, u32::MAX).await.unwrap().lease.is_none());
    clock.advance(Duration::from_millis(1));
    assert_eq!(sem.held(key).await.unwrap(), 0, "the lease should lapse");
    let again = sem.acquire(key, 2, u32::MAX).await.unwrap();
    assert!(again.lease.is_some(), "{again:?}");
}
