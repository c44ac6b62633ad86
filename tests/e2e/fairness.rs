//! Fair share in the batch lane: chunks wait in the outbox under their
//! account and go out taking turns, so a batch submitted behind another
//! account's large one is served beside it, not after it.

use std::time::Duration;

use lorry::Role;
use lorry_batcher::ids::AccountId;
use serde_json::{json, Value};

use crate::common::{eventually, spawn_app_with};

#[tokio::test]
async fn a_small_batch_behind_another_accounts_large_one_finishes_while_the_large_one_runs() {
    // The echo model serves one request at a time, 2 ms each: the large batch
    // takes seconds, a chunk of the small one a fraction of a second.
    let app = spawn_app_with(Role::Serve, |s| s.worker.echo_delay_ms = 2).await;
    let other = AccountId::parse_name("small").unwrap();
    let (_, key) = app.store.create_account(&other, "default").await.unwrap().unwrap();

    let large = app.submit_echo(3000, json!({})).await;
    let large_id = large["id"].as_str().unwrap().to_string();
    // Wait until the large batch is being served, so the small one arrives behind it.
    app.wait_for(&large_id, Duration::from_secs(60), |b| {
        b["request_counts"]["completed"].as_i64().unwrap_or(0) > 0
    })
    .await;
    let requests: Vec<Value> = (0..100)
        .map(|i| json!({"body": {"prompt": format!("small {i}")}}))
        .collect();
    let response = app
        .http
        .post(app.url("/v1/batches"))
        .bearer_auth(&key.value)
        .json(&json!({"model": "@lorry/echo", "requests": requests}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 202);
    let small: Value = response.json().await.unwrap();
    let small_id = small["id"].as_str().unwrap().to_string();

    eventually(Duration::from_secs(120), || async {
        let (_, small) = app.get_json_as(&key.value, &format!("/v1/batches/{small_id}")).await;
        if small["status"] == "completed" {
            Ok(())
        } else {
            Err(format!("the small batch never finished: {small}"))
        }
    })
    .await;
    let large = app.get_json(&format!("/v1/batches/{large_id}")).await;
    let done = large["request_counts"]["completed"].as_i64().unwrap();
    // In arrival order the small batch would have waited for all 3,000; taking
    // turns, it waits for the few chunks already in the queue and the workers.
    assert!(
        done < 2000,
        "the small batch finished only after {done} of the large one's 3,000 requests"
    );
    eprintln!("the small batch finished after {done} of the large batch's 3,000 requests");
    let large = app.wait_until_ended(&large_id, Duration::from_secs(120)).await;
    assert_eq!(large["request_counts"]["completed"], 3000, "nothing lost: {large}");
    // Every chunk the fair dispatch published was marked served as its worker acked it.
    let in_flight: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox WHERE account_id IS NOT NULL AND (sent_at IS NULL OR done_at IS NULL)",
    )
    .fetch_one(app.store.pool())
    .await
    .unwrap();
    assert_eq!(in_flight, 0, "chunks still held or in flight after both batches ended");
    app.stop().await;
}
