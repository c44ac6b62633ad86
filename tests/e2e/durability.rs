//! Every accepted request ends exactly once, whatever crashes: the quick
//! cases, on smaller batches (the fault matrix is `faults.rs`).

use std::time::Duration;

use lorry::Role;
use serde_json::json;

use crate::common::{assert_echo_batch_ended_once, spawn_app_with, Proxy, TestApp};

/// Checks that hold after any crash: one result per request, one completion.
async fn assert_exactly_once(app: &TestApp, id: &str, total: usize) {
    assert_echo_batch_ended_once(app, id, total, Duration::from_secs(120)).await;
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
    use futures::StreamExt;
    use lapin::options::{BasicConsumeOptions, BasicNackOptions};
    use lapin::types::FieldTable;

    // No worker yet: the relay publishes the chunk, and the test plays a worker
    // that fails it on every delivery.
    let app = spawn_app_with(Role::Api, |s| s.worker.delivery_limit = 2).await;
    let batch = app.submit_echo(3, json!({})).await;
    let id = batch["id"].as_str().unwrap();
    let connection = lorry_batcher::broker::connect(&app.settings.services.amqp_url, "test-failing-worker")
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    // The queues as the relay declares them (the same arguments), so that
    // the test never asks for one not declared yet.
    let topology =
        lorry_batcher::broker::Topology::new(&app.settings.services.queue_prefix, app.settings.worker.delivery_limit);
    topology.declare(&channel, ["@lorry/echo"]).await.unwrap();
    let mut deliveries = channel
        .basic_consume(
            &topology.batch_queue("@lorry/echo"),
            "test-failing-worker",
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    // Delivered once and redelivered up to the limit of 2: each refused.
    for attempt in 1..=3 {
        let delivery = tokio::time::timeout(Duration::from_secs(20), deliveries.next())
            .await
            .unwrap_or_else(|_| panic!("delivery {attempt} never came"))
            .expect("the consumer ended")
            .unwrap();
        delivery
            .nack(BasicNackOptions {
                requeue: true,
                ..Default::default()
            })
            .await
            .unwrap();
    }
    // The third refusal dead-letters it: a fourth delivery would reach the
    // worker below and complete the batch without errors.
    channel.close(200, "done failing").await.unwrap();

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
    use futures::StreamExt;
    use lapin::options::BasicConsumeOptions;
    use lapin::types::FieldTable;

    let proxy = Proxy::start("127.0.0.1:5672".into()).await;
    // No worker: the request waits in its lane, for as long as the timeout allows.
    let app = spawn_app_with(Role::Api, |s| {
        s.services.amqp_url = format!("amqp://guest:guest@127.0.0.1:{}/%2f", proxy.port);
        s.api.rt_timeout_secs = 3600;
    })
    .await;
    let call = tokio::spawn({
        let (http, url) = (
            app.http.clone(),
            app.url("/client/v4/accounts/default/ai/run/@lorry/echo"),
        );
        async move {
            http.post(url)
                .bearer_auth(crate::common::TOKEN)
                .json(&json!({"prompt": "waiting"}))
                .send()
                .await
                .unwrap()
        }
    });
    // Wait until the request is in its lane, seen past the proxy: taken
    // (and left unacknowledged) by a consumer of the test's own.
    let connection = lorry_batcher::broker::connect("amqp://guest:guest@127.0.0.1:5672/%2f", "test-observer")
        .await
        .unwrap();
    let queue = format!("{}.rt.@lorry/echo", app.settings.services.queue_prefix);
    let channel = connection.create_channel().await.unwrap();
    // Declared as the deployment declares it, whoever comes first.
    app.settings
        .topology()
        .declare(&channel, ["@lorry/echo"])
        .await
        .unwrap();
    let mut observer = channel
        .basic_consume(
            &queue,
            "test-observer",
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    observer.next().await.expect("the lane's consumer ended").unwrap();
    proxy.cut().await;
    let answer = call.await.unwrap();
    assert_eq!(answer.status(), 503);
    assert_eq!(answer.headers()["retry-after"], "1");
    let body: serde_json::Value = answer.json().await.unwrap();
    assert_eq!(body["error"]["code"], "service_unavailable", "{body}");
}

/// The `host:port` of `url`, and `url` with it replaced by `127.0.0.1:port`.
fn redirect(url: &str, port: u16) -> (String, String) {
    let scheme_end = url.find("://").map_or(0, |i| i + 3);
    let rest = &url[scheme_end..];
    let host_start = rest.find('@').map_or(0, |i| i + 1);
    let host_end = rest[host_start..].find('/').map_or(rest.len(), |i| host_start + i);
    let proxied = format!(
        "{}{}127.0.0.1:{port}{}",
        &url[..scheme_end],
        &rest[..host_start],
        &rest[host_end..]
    );
    (rest[host_start..host_end].to_string(), proxied)
}

#[tokio::test]
async fn postgres_down_mid_batch_loses_no_request_and_duplicates_none() {
    let base = std::env::var("LORRY_TEST_DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into());
    let proxy = Proxy::start(redirect(&format!("{base}/x"), 0).0).await;
    let app = spawn_app_with(Role::Serve, |s| {
        s.services.database_url = redirect(&s.services.database_url, proxy.port).1;
        s.worker.echo_delay_ms = 2;
        s.worker.finalize_stale_secs = 1;
    })
    .await;
    let batch = app.submit_echo(2000, json!({})).await;
    let id = batch["id"].as_str().unwrap();
    app.wait_for(id, Duration::from_secs(60), |b| {
        b["request_counts"]["succeeded"].as_i64() >= Some(400)
    })
    .await;
    // Down: every connection cut, and new ones refused until the
    // deployment has failed to reconnect a few times.
    proxy.block().await;
    proxy.wait_for_refusals(5).await;
    proxy.unblock();
    assert_exactly_once(&app, id, 2000).await;
}

#[tokio::test]
async fn s3_down_while_a_batch_ends_delays_its_output_and_loses_nothing() {
    let endpoint = std::env::var("LORRY_S3_ENDPOINT").unwrap_or_else(|_| "http://127.0.0.1:9310".into());
    let proxy = Proxy::start(redirect(&endpoint, 0).0).await;
    let app = spawn_app_with(Role::Serve, |s| {
        s.services.s3_endpoint = Some(redirect(&endpoint, proxy.port).1);
        s.worker.echo_delay_ms = 2;
        // Only the failed finalisation's own retry can end it in time: no
        // sweeper takes the batch over as stale.
        s.worker.finalize_stale_secs = 3600;
    })
    .await;
    // Down before the batch can end: its output cannot be written.
    let batch = app.submit_echo(300, json!({})).await;
    let id = batch["id"].as_str().unwrap();
    proxy.block().await;
    app.wait_for(id, Duration::from_secs(60), |b| b["status"] == "finalizing")
        .await;
    proxy.wait_for_refusals(2).await;
    let stuck = app.get_json(&format!("/v1/batches/{id}")).await;
    assert_eq!(stuck["status"], "finalizing", "no batch ends without its output");
    proxy.unblock();
    assert_exactly_once(&app, id, 300).await;
}
