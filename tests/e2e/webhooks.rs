//! Completion webhooks (Standard Webhooks, verified by an independent
//! implementation) and CloudEvents on the events exchange.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::Router;
use futures::StreamExt;
use lapin::options::{BasicConsumeOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::ExchangeKind;
use lorry::Role;
use serde_json::{json, Value};

use crate::common::spawn_app_with;

/// One webhook as received: headers and body.
type Call = (HeaderMap, Vec<u8>);

#[derive(Clone, Default)]
struct Receiver {
    calls: Arc<Mutex<Vec<Call>>>,
    failures_left: Arc<Mutex<u32>>,
}

/// A webhook receiver on port 0 that answers 500 `failures` times, then 200.
async fn start_receiver(failures: u32) -> (String, Receiver) {
    let receiver = Receiver::default();
    *receiver.failures_left.lock().unwrap() = failures;
    let state = receiver.clone();
    let app = Router::new().route(
        "/hook",
        post(move |headers: HeaderMap, body: axum::body::Bytes| {
            let state = state.clone();
            async move {
                state.calls.lock().unwrap().push((headers, body.to_vec()));
                let mut left = state.failures_left.lock().unwrap();
                if *left > 0 {
                    *left -= 1;
                    StatusCode::INTERNAL_SERVER_ERROR
                } else {
                    StatusCode::OK
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://127.0.0.1:{}/hook", listener.local_addr().unwrap().port());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, receiver)
}

#[tokio::test]
async fn a_webhook_is_retried_after_failures_with_the_same_id_and_a_valid_signature() {
    let app = spawn_app_with(Role::Serve, |s| s.webhooks.min_backoff_ms = 50).await;
    let (url, receiver) = start_receiver(3).await;

    // Subscribe to the events exchange before anything happens.
    let connection = lorry_batcher::broker::connect(&app.settings.services.amqp_url, "test-events")
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    let exchange = format!("{}.events", app.settings.services.queue_prefix);
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    channel
        .exchange_declare(&exchange, ExchangeKind::Topic, durable, FieldTable::default())
        .await
        .unwrap();
    let exclusive = QueueDeclareOptions {
        exclusive: true,
        ..Default::default()
    };
    let queue = channel
        .queue_declare("", exclusive, FieldTable::default())
        .await
        .unwrap();
    channel
        .queue_bind(
            queue.name().as_str(),
            &exchange,
            "batch.*",
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut events = channel
        .basic_consume(
            queue.name().as_str(),
            "",
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();

    let batch = app.submit_echo(10, json!({"webhook": {"url": url}})).await;
    let id = batch["id"].as_str().unwrap();
    app.wait_until_ended(id, Duration::from_secs(30)).await;

    let started = Instant::now();
    while receiver.calls.lock().unwrap().len() < 4 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the webhook was not retried to success"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let calls = receiver.calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 4, "three failures, one success, nothing after");
    let ids: Vec<&str> = calls.iter().map(|(h, _)| h["webhook-id"].to_str().unwrap()).collect();
    assert!(
        ids.iter().all(|i| *i == ids[0]),
        "one webhook-id on every retry: {ids:?}"
    );

    let secret = app.get_json("/v1/account").await["webhook_secret"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(secret.starts_with("whsec_"));
    let verifier = standardwebhooks::Webhook::new(&secret).unwrap();
    for (headers, body) in &calls {
        verifier.verify(body, headers).expect("signature verifies");
    }
    let body: Value = serde_json::from_slice(&calls[3].1).unwrap();
    assert_eq!(body["type"], "batch.completed");
    assert_eq!(body["data"]["id"], id);
    assert_eq!(body["data"]["status"], "completed");
    assert_eq!(body["data"]["request_counts"]["succeeded"], 10);

    let attempts: Vec<Option<i32>> =
        sqlx::query_scalar("SELECT status_code FROM webhook_attempts WHERE delivery_id = $1 ORDER BY attempt")
            .bind(ids[0])
            .fetch_all(app.store.pool())
            .await
            .unwrap();
    assert_eq!(attempts, vec![Some(500), Some(500), Some(500), Some(200)]);

    let event = tokio::time::timeout(Duration::from_secs(10), events.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(event.routing_key.as_str(), "batch.completed");
    let event: Value = serde_json::from_slice(&event.data).unwrap();
    assert_eq!(event["specversion"], "1.0");
    assert_eq!(event["type"], "dev.lorry.batch.completed");
    assert_eq!(event["subject"], id);
    assert_eq!(event["data"]["status"], "completed");
}

#[tokio::test]
async fn a_rotated_secret_signs_later_deliveries() {
    let app = spawn_app_with(Role::Serve, |_| {}).await;
    let before = app.get_json("/v1/account").await["webhook_secret"].clone();
    let rotated = app.post("/v1/account/webhook_secret/rotate", &json!({})).await;
    assert_eq!(rotated.status(), 200);
    let rotated: Value = rotated.json().await.unwrap();
    assert_ne!(rotated["webhook_secret"], before);
    let (url, receiver) = start_receiver(0).await;
    let batch = app.submit_echo(1, json!({"webhook": {"url": url}})).await;
    app.wait_until_ended(batch["id"].as_str().unwrap(), Duration::from_secs(30))
        .await;
    let started = Instant::now();
    while receiver.calls.lock().unwrap().is_empty() {
        assert!(started.elapsed() < Duration::from_secs(30));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (headers, body) = receiver.calls.lock().unwrap()[0].clone();
    let verifier = standardwebhooks::Webhook::new(rotated["webhook_secret"].as_str().unwrap()).unwrap();
    verifier.verify(&body, &headers).expect("signed with the new secret");
}

#[tokio::test]
async fn a_long_batch_reports_progress_before_it_completes() {
    let app = spawn_app_with(Role::Serve, |s| {
        s.worker.echo_delay_ms = 5;
        s.worker.progress_interval_ms = 300;
    })
    .await;
    let (url, receiver) = start_receiver(0).await;
    let batch = app.submit_echo(400, json!({"webhook": {"url": url}})).await;
    app.wait_until_ended(batch["id"].as_str().unwrap(), Duration::from_secs(60))
        .await;
    let started = Instant::now();
    let types = loop {
        let types: Vec<String> = receiver
            .calls
            .lock()
            .unwrap()
            .iter()
            .map(|(_, body)| {
                serde_json::from_slice::<Value>(body).unwrap()["type"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect();
        if types.iter().any(|t| t == "batch.completed") {
            break types;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "no completion webhook: {types:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let progress = types.iter().filter(|t| *t == "batch.progress").count();
    assert!(progress >= 1, "progress was reported: {types:?}");
    assert!(progress <= 2000 / 300 + 2, "progress is throttled: {types:?}");
    assert_eq!(types.iter().filter(|t| *t == "batch.completed").count(), 1);
}
