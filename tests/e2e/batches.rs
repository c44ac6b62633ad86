//! The native batch lifecycle: submit, poll, results, output, cancel, expiry, idempotency.

use std::time::Duration;

use lorry::Role;
use serde_json::json;

use crate::common::{assert_each_index_once, spawn_app, spawn_app_with};

#[tokio::test]
async fn a_native_batch_runs_to_completion_with_output_in_s3() {
    let app = spawn_app().await;
    let batch = app
        .submit_echo(300, json!({"metadata": {"job": "nightly"}, "completion_window": "1h"}))
        .await;
    assert_eq!(batch["object"], "batch");
    assert_eq!(batch["status"], "in_progress");
    assert_eq!(batch["request_counts"]["total"], 300);
    assert_eq!(batch["metadata"]["job"], "nightly");
    let id = batch["id"].as_str().unwrap();

    let done = app.wait_until_ended(id, Duration::from_secs(30)).await;
    assert_eq!(done["status"], "completed");
    assert_eq!(done["request_counts"]["succeeded"], 300);
    assert_eq!(done["request_counts"]["completed"], 300);
    assert_eq!(done["request_counts"]["failed"], 0);
    assert_eq!(done["usage"]["prompt_tokens"], 600);
    assert!(done["completed_at"].is_i64() && done["finalizing_at"].is_i64());
    assert!(done["errors_url"].is_null());

    let lines = app.fetch_jsonl(done["output_url"].as_str().unwrap()).await;
    assert_each_index_once(&lines, 300);
    assert_eq!(lines[7]["custom_id"], "req-7");
    assert_eq!(lines[7]["status"], "succeeded");
    assert_eq!(
        lines[7]["response"],
        json!({"status_code": 200, "body": {"response": "prompt 7"}})
    );
    assert_eq!(lines[7]["error"], json!(null));

    let results = app.get(&format!("/v1/batches/{id}/results")).await;
    assert_eq!(results.headers()["content-type"], "application/jsonl");
    assert_eq!(results.text().await.unwrap().lines().count(), 300);
}

#[tokio::test]
async fn results_stream_in_index_order_across_pages() {
    // More than two pages of the listing (it reads 1,000 results at a time).
    let app = spawn_app().await;
    let batch = app.submit_echo(2_345, json!({})).await;
    let id = batch["id"].as_str().unwrap();
    let done = app.wait_until_ended(id, Duration::from_secs(120)).await;
    assert_eq!(done["status"], "completed");
    let text = app
        .get(&format!("/v1/batches/{id}/results"))
        .await
        .text()
        .await
        .unwrap();
    let indices: Vec<i64> = text
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["index"]
                .as_i64()
                .unwrap()
        })
        .collect();
    assert_eq!(indices, (0..2_345).collect::<Vec<i64>>());
    // Polled through the Workers AI shape, the same results come in one
    // JSON answer, also read and sent a page at a time.
    let polled = app
        .post(
            "/client/v4/accounts/default/ai/run/@lorry/echo",
            &json!({"request_id": id}),
        )
        .await;
    assert_eq!(polled.headers()["content-type"], "application/json");
    let polled: serde_json::Value = polled.json().await.unwrap();
    assert_eq!(polled["success"], true);
    assert_eq!(polled["errors"], json!([]));
    assert_eq!(polled["result"]["status"], "completed");
    assert_eq!(polled["result"]["request_id"], id);
    assert_eq!(polled["result"]["usage"], done["usage"]);
    let responses = polled["result"]["responses"].as_array().unwrap();
    let ids: Vec<i64> = responses.iter().map(|r| r["id"].as_i64().unwrap()).collect();
    assert_eq!(ids, (0..2_345).collect::<Vec<i64>>());
    assert!(responses.iter().all(|r| r["success"] == true), "{}", responses[0]);
}

#[tokio::test]
async fn results_are_readable_while_the_batch_runs() {
    let app = spawn_app_with(Role::Serve, |s| s.worker.echo_delay_ms = 5).await;
    let batch = app.submit_echo(400, json!({})).await;
    let id = batch["id"].as_str().unwrap();
    let partial = app
        .wait_for(id, Duration::from_secs(30), |b| {
            b["request_counts"]["succeeded"].as_i64() > Some(0)
        })
        .await;
    assert_eq!(partial["status"], "in_progress");
    let text = app
        .get(&format!("/v1/batches/{id}/results"))
        .await
        .text()
        .await
        .unwrap();
    let lines = text.lines().count();
    assert!(lines > 0 && lines < 400, "partial results: {lines} lines");
    app.wait_until_ended(id, Duration::from_secs(60)).await;
}

#[tokio::test]
async fn listing_pages_newest_first() {
    let app = spawn_app_with(Role::Api, |_| {}).await;
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(app.submit_echo(1, json!({})).await["id"].as_str().unwrap().to_string());
    }
    let page = app.get_json("/v1/batches?limit=2").await;
    assert_eq!(page["object"], "list");
    assert_eq!(page["has_more"], true);
    assert_eq!(page["data"][0]["id"], ids[2].as_str());
    assert_eq!(page["data"][1]["id"], ids[1].as_str());
    let last = page["last_id"].as_str().unwrap();
    let rest = app.get_json(&format!("/v1/batches?limit=2&after={last}")).await;
    assert_eq!(rest["has_more"], false);
    assert_eq!(rest["data"].as_array().unwrap().len(), 1);
    assert_eq!(rest["data"][0]["id"], ids[0].as_str());
}

#[tokio::test]
async fn an_idempotency_key_returns_the_same_batch_and_refuses_a_different_body() {
    let app = spawn_app_with(Role::Api, |_| {}).await;
    let body = json!({"model": "@lorry/echo", "requests": [{"body": {"prompt": "once"}}]});
    let send = |body: serde_json::Value| {
        app.http
            .post(app.url("/v1/batches"))
            .bearer_auth(crate::common::TOKEN)
            .header("Idempotency-Key", "key-1")
            .json(&body)
            .send()
    };
    let first = send(body.clone()).await.unwrap();
    assert_eq!(first.status(), 202);
    let first: serde_json::Value = first.json().await.unwrap();
    let again = send(body.clone()).await.unwrap();
    assert_eq!(again.status(), 202);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    let again: serde_json::Value = again.json().await.unwrap();
    assert_eq!(again["id"], first["id"]);

    let other = send(json!({"model": "@lorry/echo", "requests": [{"body": {"prompt": "twice"}}]}))
        .await
        .unwrap();
    assert_eq!(other.status(), 409);
    let error: serde_json::Value = other.json().await.unwrap();
    assert_eq!(error["error"]["code"], "idempotency_key_reused");
    let batches: i64 = sqlx::query_scalar("SELECT count(*) FROM batches")
        .fetch_one(app.store.pool())
        .await
        .unwrap();
    assert_eq!(batches, 1);
}

#[tokio::test]
async fn cancel_ends_unstarted_requests_and_lets_running_ones_finish() {
    let app = spawn_app_with(Role::Serve, |s| s.worker.echo_delay_ms = 10).await;
    let batch = app.submit_echo(500, json!({})).await;
    let id = batch["id"].as_str().unwrap();
    app.wait_for(id, Duration::from_secs(30), |b| {
        b["request_counts"]["succeeded"].as_i64() >= Some(20)
    })
    .await;
    let cancelled = app.post(&format!("/v1/batches/{id}/cancel"), &json!({})).await;
    assert_eq!(cancelled.status(), 200);
    let cancelled: serde_json::Value = cancelled.json().await.unwrap();
    assert!(
        matches!(cancelled["status"].as_str(), Some("cancelling")),
        "{cancelled}"
    );

    let done = app.wait_until_ended(id, Duration::from_secs(30)).await;
    assert_eq!(done["status"], "cancelled");
    let counts = &done["request_counts"];
    let (ok, canceled) = (
        counts["succeeded"].as_i64().unwrap(),
        counts["canceled"].as_i64().unwrap(),
    );
    assert!(ok >= 20 && canceled > 0, "{counts}");
    assert_eq!(ok + canceled, 500);
    assert!(done["cancelled_at"].is_i64());

    let lines = app.fetch_jsonl(done["output_url"].as_str().unwrap()).await;
    assert_each_index_once(&lines, 500);
    let errors = app.fetch_jsonl(done["errors_url"].as_str().unwrap()).await;
    assert_eq!(errors.len() as i64, canceled);
    assert_eq!(errors[0]["error"]["code"], "batch_cancelled");

    let again = app.post(&format!("/v1/batches/{id}/cancel"), &json!({})).await;
    assert_eq!(again.status(), 409);
    let again: serde_json::Value = again.json().await.unwrap();
    assert_eq!(again["error"]["code"], "batch_not_cancellable");
}

#[tokio::test]
async fn a_batch_past_its_window_expires_its_unstarted_requests() {
    let app = spawn_app_with(Role::Serve, |s| s.worker.echo_delay_ms = 20).await;
    let batch = app.submit_echo(300, json!({"completion_window": "1s"})).await;
    let id = batch["id"].as_str().unwrap();
    let done = app.wait_until_ended(id, Duration::from_secs(30)).await;
    assert_eq!(done["status"], "expired");
    let counts = &done["request_counts"];
    let (ok, expired) = (
        counts["succeeded"].as_i64().unwrap(),
        counts["expired"].as_i64().unwrap(),
    );
    assert!(ok > 0 && expired > 0, "{counts}");
    assert_eq!(ok + expired, 300);
    let lines = app.fetch_jsonl(done["output_url"].as_str().unwrap()).await;
    assert_each_index_once(&lines, 300);
    let first_expired = lines.iter().find(|l| l["status"] == "expired").unwrap();
    assert_eq!(first_expired["error"]["code"], "batch_expired");
}

#[tokio::test]
async fn readiness_reports_every_backing_service() {
    let app = spawn_app_with(Role::Api, |_| {}).await;
    let health = app.http.get(app.url("/healthz")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    let ready = app.http.get(app.url("/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 200);
    let ready: serde_json::Value = ready.json().await.unwrap();
    assert_eq!(ready["checks"], json!({"postgres": "ok", "rabbitmq": "ok", "s3": "ok"}));
}
