//! The real-time lane: answered by a worker over RabbitMQ, streamed, and
//! refused with 429 when saturated while batches are still accepted.

use std::time::Duration;

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;

use lorry::Role;
use serde_json::{json, Value};

use crate::common::spawn_app_with;

const RUN: &str = "/client/v4/accounts/default/ai/run/@lorry/echo";

#[tokio::test]
async fn a_real_time_request_is_answered_and_can_stream() {
    let app = spawn_app_with(Role::Serve, |_| {}).await;
    let answer = app
        .post(RUN, &json!({"messages": [{"role": "user", "content": "hello there"}]}))
        .await;
    assert_eq!(answer.status(), 200);
    let answer: Value = answer.json().await.unwrap();
    assert_eq!(answer["success"], true);
    assert_eq!(answer["result"]["response"], "hello there");
    assert_eq!(answer["result"]["usage"]["completion_tokens"], 2);

    let stream = app.post(RUN, &json!({"prompt": "one two three", "stream": true})).await;
    assert_eq!(stream.headers()["content-type"], "text/event-stream");
    let text = stream.text().await.unwrap();
    let data: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(data.last(), Some(&"[DONE]"));
    let pieces: String = data
        .iter()
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| v["response"].as_str().map(str::to_string))
        .collect();
    assert_eq!(pieces, "one two three");
}

#[tokio::test]
async fn a_saturated_real_time_lane_answers_429_while_batches_are_accepted() {
    // No worker: real-time requests wait in the lane until it is full. They
    // must not expire meanwhile, however slow the machine: a long timeout
    // (the worker that arrives later answers them).
    let app = spawn_app_with(Role::Api, |s| {
        s.api.rt_max_depth = 2;
        s.api.rt_timeout_secs = 600;
    })
    .await;
    let waiting: Vec<_> = (0..2)
        .map(|_| {
            let (http, url) = (app.http.clone(), app.url(RUN));
            tokio::spawn(async move {
                http.post(url)
                    .bearer_auth(crate::common::TOKEN)
                    .json(&json!({"prompt": "x"}))
                    .send()
                    .await
            })
        })
        .collect();
    // Wait until both are queued, then one more is refused at once.
    let connection = lorry_batcher::broker::connect(&app.settings.services.amqp_url, "test-depth")
        .await
        .unwrap();
    let queue = format!("{}.rt.@lorry/echo", app.settings.services.queue_prefix);
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    // Waits for the condition alone; a lane that never fills is the harness's
    // timeout to report (nextest's `terminate-after`).
    loop {
        // A failed passive declare closes its channel: use a fresh one each time.
        let channel = connection.create_channel().await.unwrap();
        if let Ok(q) = channel.queue_declare(&queue, passive, FieldTable::default()).await {
            if q.message_count() >= 2 {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let response = app.post(RUN, &json!({"prompt": "one more"})).await;
    let refused = (response.status() == 429).then_some(response);
    let refused = refused.expect("the lane never reported saturation");
    assert_eq!(refused.headers()["retry-after"], "1");
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["code"], "realtime_lane_saturated");

    // The OpenAI route shares the lane, and refuses the same way, in OpenAI's shape.
    let refused = app
        .post(
            "/v1/chat/completions",
            &json!({"model": "@lorry/echo", "messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
    assert_eq!(refused.status(), 429);
    assert_eq!(refused.headers()["retry-after"], "1");
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["type"], "rate_limit_error");

    let batch = app.submit_echo(5, json!({})).await;
    assert_eq!(batch["status"], "in_progress");
    // A worker arrives: the batch accepted during saturation completes.
    let worker = crate::common::start(app.settings.clone(), Role::Worker).await;
    let id = batch["id"].as_str().unwrap();
    let ended = app.wait_until_ended(id, Duration::from_secs(60)).await;
    assert_eq!(ended["status"], "completed", "{ended}");
    assert_eq!(ended["request_counts"]["completed"], 5);
    for w in waiting {
        let response = w.await.unwrap().unwrap();
        assert!(matches!(response.status().as_u16(), 200 | 504), "{}", response.status());
    }
    worker.stop().await;
}
