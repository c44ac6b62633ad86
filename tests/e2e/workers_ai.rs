//! The Workers AI shape: queue a batch, poll it, run one request in real time.

use std::time::{Duration, Instant};

use lorry::Role;
use serde_json::{json, Value};

use crate::common::spawn_app_with;

const RUN: &str = "/client/v4/accounts/default/ai/run/@lorry/echo";

#[tokio::test]
async fn a_workers_ai_batch_is_queued_and_polled_to_completion() {
    let app = spawn_app_with(Role::Serve, |s| s.worker.echo_delay_ms = 2).await;
    let requests: Vec<Value> = (0..100)
        .map(|i| match i % 3 {
            0 => json!({"prompt": format!("p{i}"), "external_reference": format!("ref-{i}")}),
            1 => json!({"messages": [{"role": "user", "content": format!("m{i}")}], "max_tokens": 16}),
            _ => json!({"text": format!("t{i}")}),
        })
        .collect();
    let queued = app
        .post(&format!("{RUN}?queueRequest=true"), &json!({"requests": requests}))
        .await;
    assert_eq!(queued.status(), 200);
    let queued: Value = queued.json().await.unwrap();
    assert_eq!(queued["success"], true);
    assert_eq!(queued["errors"], json!([]));
    assert_eq!(queued["result"]["status"], "queued");
    assert_eq!(queued["result"]["model"], "@lorry/echo");
    let request_id = queued["result"]["request_id"].as_str().unwrap().to_string();

    let started = Instant::now();
    let mut seen = Vec::new();
    let result = loop {
        let polled: Value = app
            .post(RUN, &json!({"request_id": request_id}))
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(polled["success"], true, "{polled}");
        if polled["result"]["responses"].is_array() {
            break polled["result"].clone();
        }
        seen.push(polled["result"]["status"].as_str().unwrap().to_string());
        assert!(started.elapsed() < Duration::from_secs(30));
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(seen.iter().all(|s| s == "queued" || s == "running"), "{seen:?}");
    let responses = result["responses"].as_array().unwrap();
    assert_eq!(responses.len(), 100);
    assert_eq!(
        responses[0],
        json!({"id": 0, "result": {"response": "p0"}, "success": true, "external_reference": "ref-0"})
    );
    assert_eq!(responses[1]["result"]["response"], "m1");
    assert_eq!(responses[2]["result"]["response"], "t2");
    assert_eq!(result["usage"]["prompt_tokens"], 100);

    // The same batch is visible through the native API.
    let native = app.get_json(&format!("/v1/batches/{request_id}")).await;
    assert_eq!(native["status"], "completed");
}

#[tokio::test]
async fn queue_request_in_the_body_queues_too_and_bad_items_are_named() {
    let app = spawn_app_with(Role::Api, |_| {}).await;
    let ok = app
        .post(RUN, &json!({"queueRequest": true, "requests": [{"prompt": "a"}]}))
        .await;
    assert_eq!(ok.status(), 200);
    let bad = app
        .post(
            RUN,
            &json!({"queueRequest": true, "requests": [{"prompt": "a"}, {"prompt": 5}]}),
        )
        .await;
    assert_eq!(bad.status(), 400);
    let bad: Value = bad.json().await.unwrap();
    assert_eq!(bad["success"], false);
    assert_eq!(bad["error"]["code"], "invalid_type");
    assert_eq!(bad["error"]["param"], "requests[1].prompt");
    assert!(bad["errors"][0]["message"].as_str().unwrap().contains("invalid_type"));
}

#[tokio::test]
async fn another_accounts_path_and_unknown_requests_are_not_found() {
    let app = spawn_app_with(Role::Api, |_| {}).await;
    let other = app
        .post(
            "/client/v4/accounts/someone-else/ai/run/@lorry/echo?queueRequest=true",
            &json!({"requests": [{"prompt": "a"}]}),
        )
        .await;
    assert_eq!(other.status(), 404);
    let unknown = app
        .post(RUN, &json!({"request_id": "batch_0123456789abcdef0123456789abcdef"}))
        .await;
    assert_eq!(unknown.status(), 404);
    let unknown: Value = unknown.json().await.unwrap();
    assert_eq!(unknown["error"]["param"], "request_id");
}
