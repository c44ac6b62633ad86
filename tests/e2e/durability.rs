//! Every accepted request ends exactly once, whatever crashes.

use std::time::Duration;

use lorry::Role;
use serde_json::json;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use crate::common::{assert_each_index_once, spawn_app_with, TestApp};

/// Checks that hold after any crash: one result per request, one completion.
async fn assert_exactly_once(app: &TestApp, id: &str, total: usize) {
    let done = app.wait_until_ended(id, Duration::from_secs(120)).await;
    assert_eq!(done["status"], "completed");
    assert_eq!(done["request_counts"]["succeeded"], json!(total));
    let lines = app.fetch_jsonl(done["output_url"].as_str().unwrap()).await;
    assert_each_index_once(&lines, total);
    for line in &lines {
        let i = line["index"].as_i64().unwrap();
        assert_eq!(line["response"]["body"]["response"], format!("prompt {i}"));
    }
    let completions: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox WHERE routing_key = 'batch.completed' AND payload->>'subject' = $1",
    )
    .bind(id)
    .fetch_one(app.store.pool())
    .await
    .unwrap();
    assert_eq!(completions, 1, "the batch completed exactly once");
}

async fn redelivered(app: &TestApp, id: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM requests WHERE batch_id = $1 AND attempts > 1")
        .bind(id)
        .fetch_one(app.store.pool())
        .await
        .unwrap()
}

/// A 2,000-request batch served by a slowed `lorry worker` process, once `done` requests have succeeded.
async fn batch_in_flight(app: &TestApp, done: i64) -> (std::process::Child, String) {
    let worker = app.spawn_worker_process(&[("LORRY_ECHO_DELAY_MS", "2")]);
    let batch = app.submit_echo(2000, json!({})).await;
    let id = batch["id"].as_str().unwrap().to_string();
    app.wait_for(&id, Duration::from_secs(60), |b| {
        b["request_counts"]["succeeded"].as_i64() >= Some(done)
    })
    .await;
    (worker, id)
}

#[tokio::test]
async fn a_killed_worker_loses_no_request_and_duplicates_none() {
    let app = spawn_app_with(Role::Api, |_| {}).await;
    let (mut worker, id) = batch_in_flight(&app, 400).await;
    let id = id.as_str();

    worker.kill().expect("SIGKILL the worker");
    worker.wait().unwrap();
    let mid = app.get_json(&format!("/v1/batches/{id}")).await;
    assert_eq!(mid["status"], "in_progress", "the batch cannot finish without a worker");
    assert!(mid["request_counts"]["succeeded"].as_i64() < Some(2000));

    let mut replacement = app.spawn_worker_process(&[("LORRY_ECHO_DELAY_MS", "2")]);
    assert_exactly_once(&app, id, 2000).await;
    replacement.kill().unwrap();
    let _ = replacement.wait();
    assert!(
        redelivered(&app, id).await > 0,
        "the killed worker's requests were delivered again"
    );
}

#[tokio::test]
async fn a_worker_stopped_with_sigterm_settles_the_work_it_holds() {
    let app = spawn_app_with(Role::Api, |_| {}).await;
    let (mut worker, id) = batch_in_flight(&app, 200).await;
    let id = id.as_str();

    let term = std::process::Command::new("kill")
        .args(["-TERM", &worker.id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    let status = worker.wait().unwrap();
    assert!(status.success(), "the worker exits cleanly on SIGTERM: {status}");
    let running: i64 = sqlx::query_scalar("SELECT count(*) FROM requests WHERE batch_id = $1 AND status = 'running'")
        .bind(id)
        .fetch_one(app.store.pool())
        .await
        .unwrap();
    assert_eq!(running, 0, "nothing is left half-done");

    let mut replacement = app.spawn_worker_process(&[]);
    assert_exactly_once(&app, id, 2000).await;
    replacement.kill().unwrap();
    let _ = replacement.wait();
    assert_eq!(
        redelivered(&app, id).await,
        0,
        "a graceful stop hands back nothing to redo"
    );
}

/// A TCP proxy in front of RabbitMQ whose connections the test can cut.
struct Proxy {
    port: u16,
    connections: std::sync::Arc<tokio::sync::Mutex<JoinSet<()>>>,
}

impl Proxy {
    async fn start(upstream: String) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let connections = std::sync::Arc::new(tokio::sync::Mutex::new(JoinSet::new()));
        let held = connections.clone();
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let upstream = upstream.clone();
                held.lock().await.spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        });
        Proxy { port, connections }
    }

    /// Drop every connection through the proxy, as a network failure would.
    async fn cut(&self) -> usize {
        let mut connections = self.connections.lock().await;
        let n = connections.len();
        connections.abort_all();
        while connections.join_next().await.is_some() {}
        n
    }
}

#[tokio::test]
async fn a_dropped_broker_connection_loses_no_request_and_duplicates_none() {
    let proxy = Proxy::start("127.0.0.1:5672".into()).await;
    let app = spawn_app_with(Role::Serve, |s| {
        s.services.amqp_url = format!("amqp://guest:guest@127.0.0.1:{}/%2f", proxy.port);
        s.worker.echo_delay_ms = 2;
    })
    .await;
    let batch = app.submit_echo(2000, json!({})).await;
    let id = batch["id"].as_str().unwrap();
    app.wait_for(id, Duration::from_secs(60), |b| {
        b["request_counts"]["succeeded"].as_i64() >= Some(400)
    })
    .await;
    let cut = proxy.cut().await;
    assert!(
        cut >= 2,
        "the relay and the worker were connected through the proxy ({cut})"
    );
    assert_exactly_once(&app, id, 2000).await;
    assert!(
        redelivered(&app, id).await > 0,
        "work held by the dropped connection was delivered again"
    );
}

#[tokio::test]
async fn a_message_that_fails_every_delivery_is_dead_lettered_and_its_requests_end_errored() {
    use lapin::options::{BasicGetOptions, BasicNackOptions};

    // No worker yet: the relay publishes the chunk, and the test plays a worker
    // that fails it on every delivery.
    let app = spawn_app_with(Role::Api, |s| s.worker.delivery_limit = 2).await;
    let batch = app.submit_echo(3, json!({})).await;
    let id = batch["id"].as_str().unwrap();
    let connection = lorry_batcher::broker::connect(&app.settings.services.amqp_url, "test-failing-worker")
        .await
        .unwrap();
    let mut channel = connection.create_channel().await.unwrap();
    let queue = format!("{}.batch.@lorry/echo", app.settings.services.queue_prefix);
    let started = std::time::Instant::now();
    let mut failed = 0;
    while started.elapsed() < Duration::from_secs(20) {
        match channel.basic_get(&queue, BasicGetOptions::default()).await {
            // The queue is not declared yet, which closes the channel.
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
                channel = connection.create_channel().await.unwrap();
            }
            Ok(Some(message)) => {
                message
                    .delivery
                    .nack(BasicNackOptions {
                        requeue: true,
                        ..Default::default()
                    })
                    .await
                    .unwrap();
                failed += 1;
            }
            _ if failed > 2 => break,
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    assert_eq!(failed, 3, "delivered once and redelivered up to the limit of 2");

    let worker = crate::common::start(app.settings.clone(), Role::Worker).await;
    let done = app.wait_until_ended(id, Duration::from_secs(30)).await;
    assert_eq!(done["status"], "completed");
    assert_eq!(done["request_counts"]["errored"], 3);
    let errors = app.fetch_jsonl(done["errors_url"].as_str().unwrap()).await;
    assert_eq!(errors.len(), 3);
    assert_eq!(errors[0]["error"]["code"], "delivery_limit_exceeded");
    assert_eq!(errors[0]["error"]["retryable"], false);
    worker.stop().await;
}

#[tokio::test]
async fn a_real_time_request_in_flight_when_the_broker_connection_drops_fails_at_once() {
    use lapin::options::QueueDeclareOptions;
    use lapin::types::FieldTable;

    let proxy = Proxy::start("127.0.0.1:5672".into()).await;
    // No worker: the request waits in its lane, for as long as the timeout allows.
    let app = spawn_app_with(Role::Api, |s| {
        s.services.amqp_url = format!("amqp://guest:guest@127.0.0.1:{}/%2f", proxy.port);
        s.api.rt_timeout_secs = 3600;
    })
    .await;
    let call = tokio::spawn({
        let (http, url) = (app.http.clone(), app.url("/client/v4/accounts/default/ai/run/@lorry/echo"));
        async move {
            http.post(url)
                .bearer_auth(crate::common::TOKEN)
                .json(&json!({"prompt": "waiting"}))
                .send()
                .await
                .unwrap()
        }
    });
    // Wait until the request is in its lane, seen past the proxy.
    let connection = lorry_batcher::broker::connect("amqp://guest:guest@127.0.0.1:5672/%2f", "test-observer")
        .await
        .unwrap();
    let queue = format!("{}.rt.@lorry/echo", app.settings.services.queue_prefix);
    loop {
        let channel = connection.create_channel().await.unwrap();
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        if let Ok(q) = channel.queue_declare(&queue, passive, FieldTable::default()).await {
            if q.message_count() == 1 {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    proxy.cut().await;
    let answer = tokio::time::timeout(Duration::from_secs(120), call)
        .await
        .expect("the request waited on after its connection was gone")
        .unwrap();
    assert_eq!(answer.status(), 503);
    assert_eq!(answer.headers()["retry-after"], "1");
    let body: serde_json::Value = answer.json().await.unwrap();
    assert_eq!(body["error"]["code"], "service_unavailable", "{body}");
}
