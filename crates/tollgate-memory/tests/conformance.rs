//! The core's store conformance suite, against the memory store.
#![allow(missing_docs, clippy::unwrap_used)]

use tollgate_memory::MemoryStore;

#[tokio::test]
async fn memory_store_passes_the_conformance_suite() {
    tollgate_core::testing::run(|clock| MemoryStore::builder().clock(clock).build().unwrap()).await;
}

#[tokio::test]
async fn conformance_holds_with_one_shard_and_many() {
    for shards in [1, 4096] {
        tollgate_core::testing::run(|clock| {
            MemoryStore::builder()
                .clock(clock)
                .shards(shards)
                .build()
                .unwrap()
        })
        .await;
    }
}

#[tokio::test]
async fn memory_store_passes_the_quota_suite() {
    tollgate_core::testing::run_quota(|clock| MemoryStore::builder().clock(clock).build().unwrap())
        .await;
}

#[tokio::test]
async fn memory_store_passes_the_retry_budget_suite() {
    tollgate_core::testing::run_retry_budget(|clock| {
        MemoryStore::builder().clock(clock).build().unwrap()
    })
    .await;
}

#[tokio::test]
async fn memory_store_passes_the_escalation_suite() {
    tollgate_core::testing::run_escalation(|clock| {
        MemoryStore::builder().clock(clock).build().unwrap()
    })
    .await;
}
