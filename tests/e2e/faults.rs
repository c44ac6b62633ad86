//! The fault matrix: a 10,000-request batch on the echo model, with a
//! completion webhook, served by `lorry api` and `lorry worker` processes
//! against real services, through one fault each: a worker killed, the API
//! killed mid-POST of a second batch, RabbitMQ restarted, PostgreSQL
//! restarted, S3 unreachable, the webhook receiver failing. Each case ends
//! with every request exactly once, the batch `completed`, one
//! `batch.completed` webhook (one `webhook-id` on every attempt), and the
//! deployment still serving.
//!
//! The services a case restarts are its own (`scripts/services own`), so
//! that nothing else on the machine loses them. These are the suite's
//! slowest tests: `./scripts/test -P quick` leaves them out.

use std::process::Child;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::Router;
use lorry::Settings;
use serde_json::{json, Value};

use crate::common::{
    assert_echo_batch_ended_once, database_server, eventually, isolated_settings_on, OwnService, Proxy, TestApp, TOKEN,
};

const N: usize = 10_000;

/// How long a batch may take to end after its fault, on a busy machine.
const END_LIMIT: Duration = Duration::from_secs(300);

/// A webhook receiver that answers 500 to its first `failures`
/// `batch.completed` calls, and 200 to every other call.
#[derive(Clone)]
struct Hook {
    url: String,
    /// Every call: its headers, body and the status it was answered.
    calls: Arc<Mutex<Vec<(HeaderMap, axum::body::Bytes, u16)>>>,
}

impl Hook {
    async fn start(failures: usize) -> Hook {
        let calls: Arc<Mutex<Vec<(HeaderMap, axum::body::Bytes, u16)>>> = Arc::default();
        let completions_failed: Arc<Mutex<usize>> = Arc::default();
        let (seen, failed) = (calls.clone(), completions_failed.clone());
        let app = Router::new().route(
            "/hook",
            post(move |headers: HeaderMap, body: axum::body::Bytes| {
                let (seen, failed) = (seen.clone(), failed.clone());
                async move {
                    let event: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                    let failing = event["type"] == "batch.completed" && {
                        let mut failed = failed.lock().unwrap();
                        let fail = *failed < failures;
                        *failed += usize::from(fail);
                        fail
                    };
                    let status = if failing {
                        StatusCode::INTERNAL_SERVER_ERROR
                    } else {
                        StatusCode::OK
                    };
                    seen.lock().unwrap().push((headers, body, status.as_u16()));
                    status
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://127.0.0.1:{}/hook", listener.local_addr().unwrap().port());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Hook { url, calls }
    }

    /// The `batch.completed` calls for batch `id`: their `webhook-id`s and statuses.
    fn completions(&self, id: &str) -> Vec<(String, u16)> {
        self.calls
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, body, _)| {
                let event: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
                event["type"] == "batch.completed" && event["data"]["id"] == id
            })
            .map(|(headers, _, status)| (headers["webhook-id"].to_str().unwrap().to_string(), *status))
            .collect()
    }
}

/// Where a case's deployment finds its services.
struct Services {
    /// A PostgreSQL server URL without a database name.
    database: String,
    amqp: Option<String>,
    s3: Option<String>,
}

impl Default for Services {
    fn default() -> Self {
        Services {
            database: database_server(),
            amqp: None,
            s3: None,
        }
    }
}

/// One case's deployment: `lorry api` and `lorry worker` processes, a
/// webhook receiver, and the 10,000-request batch under way.
struct Case {
    app: TestApp,
    api: tokio::process::Child,
    port: u16,
    workers: Vec<Child>,
    hook: Hook,
    batch: String,
}

impl Case {
    /// Start the deployment with `workers` workers (each with `worker_env`
    /// on top of the deployment's), submit the batch, and return once
    /// `done` of its requests have succeeded.
    async fn start(services: Services, workers: usize, worker_env: &[(&str, &str)], hook: Hook, done: i64) -> Case {
        let mut settings: Settings = isolated_settings_on(&services.database).await;
        if let Some(amqp) = services.amqp {
            settings.services.amqp_url = amqp;
        }
        if let Some(s3) = services.s3 {
            settings.services.s3_endpoint = Some(s3);
        }
        let env = crate::common::child_env(&settings);
        let (api, address) = crate::common::spawn_api_process(&env, 0).await;
        let port = address.rsplit(':').next().unwrap().parse().unwrap();
        let app = TestApp::attach(settings, address).await;
        let workers = (0..workers).map(|_| app.spawn_worker_process(worker_env)).collect();
        let batch = app.submit_echo(N, json!({"webhook": {"url": hook.url}})).await;
        let batch = batch["id"].as_str().unwrap().to_string();
        let case = Case {
            app,
            api,
            port,
            workers,
            hook,
            batch,
        };
        case.app
            .wait_for(&case.batch, Duration::from_secs(120), |b| {
                b["request_counts"]["succeeded"].as_i64() >= Some(done)
            })
            .await;
        case
    }

    /// Wait until the API's `/readyz` reports `check` (`postgres`,
    /// `rabbitmq`, `s3`) as `ok` or not: the deployment has seen the fault,
    /// or its end.
    async fn wait_until_ready_says(&self, check: &str, ok: bool) {
        eventually(Duration::from_secs(60), || async {
            let answer = self.app.http.get(self.app.url("/readyz")).send().await;
            let body: Value = match answer {
                Ok(answer) => answer.json().await.unwrap_or(Value::Null),
                Err(e) => return Err(format!("/readyz: {e}")),
            };
            if (body["checks"][check] == "ok") == ok {
                Ok(())
            } else {
                Err(format!("/readyz never said {check} ok={ok}: {body}"))
            }
        })
        .await
    }

    /// Every check that must hold after any fault, for batch `id` of `total` requests.
    async fn assert_exactly_once(&self, id: &str, total: usize) {
        let app = &self.app;
        assert_echo_batch_ended_once(app, id, total, END_LIMIT).await;

        // One completion webhook, delivered, with one id on every attempt.
        let calls = eventually(Duration::from_secs(60), || async {
            let calls = self.hook.completions(id);
            if calls.iter().any(|(_, status)| *status == 200) {
                Ok(calls)
            } else {
                Err(format!("no batch.completed webhook was delivered for {id}: {calls:?}"))
            }
        })
        .await;
        assert!(
            calls.iter().all(|(webhook_id, _)| *webhook_id == calls[0].0),
            "one webhook-id on every attempt: {calls:?}"
        );
        let secret = app.get_json("/v1/account").await["webhook_secret"]
            .as_str()
            .unwrap()
            .to_string();
        let verifier = standardwebhooks::Webhook::new(&secret).unwrap();
        for (headers, body, _) in self.hook.calls.lock().unwrap().iter() {
            verifier.verify(body, headers).expect("every call is signed");
        }
    }

    /// The deployment still serves: its processes are up, and a new batch ends.
    async fn assert_still_serving(&mut self) {
        assert!(
            self.api.try_wait().unwrap().is_none(),
            "the API process is still running"
        );
        for worker in &mut self.workers {
            assert!(worker.try_wait().unwrap().is_none(), "a worker process exited");
        }
        let health = self.app.get("/healthz").await;
        assert_eq!(health.status(), 200);
        let after = self.app.submit_echo(3, json!({})).await;
        let after = self
            .app
            .wait_until_ended(after["id"].as_str().unwrap(), Duration::from_secs(60))
            .await;
        assert_eq!(after["status"], "completed");
        assert_eq!(after["request_counts"]["succeeded"], 3);
    }

    /// The batch has not ended: a fault now strikes it mid-way.
    async fn assert_under_way(&self) {
        let batch = self.app.get_json(&format!("/v1/batches/{}", self.batch)).await;
        assert_eq!(batch["status"], "in_progress", "{batch:#}");
        assert!(
            batch["request_counts"]["succeeded"].as_i64() < Some(N as i64 / 2),
            "{batch:#}"
        );
    }

    /// The batch's requests that were delivered more than once.
    async fn redelivered(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM requests WHERE batch_id = $1 AND attempts > 1")
            .bind(&self.batch)
            .fetch_one(self.app.store.pool())
            .await
            .unwrap()
    }

    /// Check everything, then stop the processes.
    async fn finish(mut self) {
        let batch = self.batch.clone();
        self.assert_exactly_once(&batch, N).await;
        self.assert_still_serving().await;
        for worker in &mut self.workers {
            let _ = worker.kill();
            let _ = worker.wait();
        }
        let _ = self.api.kill().await;
    }
}

#[tokio::test]
async fn fault_matrix_a_worker_killed_mid_batch() {
    let hook = Hook::start(0).await;
    let mut case = Case::start(Services::default(), 2, &[("LORRY_ECHO_DELAY_MS", "2")], hook, 2000).await;
    case.assert_under_way().await;
    let mut killed = case.workers.remove(0);
    killed.kill().expect("SIGKILL a worker");
    killed.wait().unwrap();
    let mid = case.app.get_json(&format!("/v1/batches/{}", case.batch)).await;
    assert!(mid["request_counts"]["succeeded"].as_i64() < Some(N as i64), "{mid:#}");
    let batch = case.batch.clone();
    case.assert_exactly_once(&batch, N).await;
    assert!(
        case.redelivered().await > 0,
        "the killed worker's requests were delivered again"
    );
    case.finish().await;
}

#[tokio::test]
async fn fault_matrix_the_api_killed_mid_post_of_a_second_batch() {
    let hook = Hook::start(0).await;
    let mut case = Case::start(Services::default(), 1, &[("LORRY_ECHO_DELAY_MS", "1")], hook, 2000).await;
    case.assert_under_way().await;
    let requests: Vec<Value> = (0..N)
        .map(|i| json!({"custom_id": format!("req-{i}"), "body": {"prompt": format!("prompt {i}")}}))
        .collect();
    let body = json!({"model": "@lorry/echo", "requests": requests, "webhook": {"url": case.hook.url}});
    let key = uuid::Uuid::new_v4().to_string();
    let post = {
        let (http, url, body, key) = (case.app.http.clone(), case.app.url("/v1/batches"), body, key.clone());
        move || {
            let (http, url, body, key) = (http.clone(), url.clone(), body.clone(), key.clone());
            async move {
                http.post(url)
                    .bearer_auth(TOKEN)
                    .header("Idempotency-Key", key)
                    .json(&body)
                    .send()
                    .await
            }
        }
    };
    let first = tokio::spawn(post());
    // Killed once it is writing the batch (or, on a fast machine, once it has answered).
    let during_write = loop {
        let writing: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND state <> 'idle' AND query ILIKE '%INSERT INTO requests%'",
        )
        .fetch_one(case.app.store.pool())
        .await
        .unwrap();
        // Asked again at once: the query's round trip paces the loop, and
        // the write may last only a moment.
        if writing > 0 || first.is_finished() {
            break writing > 0;
        }
    };
    case.api.kill().await.expect("SIGKILL the API");
    let answered = first.await.unwrap().is_ok();
    eprintln!("killed while writing the batch: {during_write}; the first POST answered: {answered}");
    // The API comes back on its address, as a supervisor would restart it,
    // and the client retries with its key.
    let (api, _) = case.app.spawn_api_process(case.port).await;
    case.api = api;
    let retried = post().await.unwrap();
    assert!(retried.status().is_success(), "the retry: {}", retried.status());
    let second: Value = retried.json().await.unwrap();
    let batches: i64 = sqlx::query_scalar("SELECT count(*) FROM batches WHERE idempotency_key = $1")
        .bind(&key)
        .fetch_one(case.app.store.pool())
        .await
        .unwrap();
    assert_eq!(batches, 1, "one batch, however the first POST ended");
    case.assert_exactly_once(second["id"].as_str().unwrap(), N).await;
    case.finish().await;
}

/// Start a `kind` (`postgres` or `rabbitmq`, also the name of its check in
/// `/readyz`) of the case's own, stop it mid-batch the way `how` says
/// (`stop`: cleanly; `crash`: killed), wait until the API's `/readyz` has
/// seen it gone, start it again, and check the batch through.
async fn restarted(kind: &'static str, how: &str) {
    let service = OwnService::start(kind).await;
    let services = match kind {
        "postgres" => Services {
            database: service.url(),
            ..Services::default()
        },
        _ => Services {
            amqp: Some(service.url()),
            ..Services::default()
        },
    };
    let hook = Hook::start(0).await;
    let case = Case::start(services, 1, &[("LORRY_ECHO_DELAY_MS", "1")], hook, 2000).await;
    case.assert_under_way().await;
    service.run(how).await;
    case.wait_until_ready_says(kind, false).await;
    service.run("start").await;
    case.wait_until_ready_says(kind, true).await;
    eprintln!(
        "{kind} {how}: requests delivered more than once: {}",
        case.redelivered().await
    );
    case.finish().await;
}

#[tokio::test]
async fn fault_matrix_rabbitmq_restarted() {
    restarted("rabbitmq", "stop").await;
}

#[tokio::test]
async fn fault_matrix_rabbitmq_killed_and_restarted() {
    restarted("rabbitmq", "crash").await;
}

#[tokio::test]
async fn fault_matrix_postgres_restarted() {
    restarted("postgres", "stop").await;
}

#[tokio::test]
async fn fault_matrix_postgres_crashed_and_restarted() {
    restarted("postgres", "crash").await;
}

#[tokio::test]
async fn fault_matrix_s3_unreachable_while_the_batch_ends() {
    let endpoint = std::env::var("LORRY_S3_ENDPOINT").unwrap_or_else(|_| "http://127.0.0.1:9310".into());
    let upstream = endpoint.trim_start_matches("http://").trim_end_matches('/').to_string();
    let proxy = Proxy::start(upstream).await;
    let hook = Hook::start(0).await;
    let services = Services {
        s3: Some(format!("http://127.0.0.1:{}", proxy.port)),
        ..Services::default()
    };
    let case = Case::start(services, 1, &[("LORRY_ECHO_DELAY_MS", "1")], hook, 2000).await;
    case.assert_under_way().await;
    // Unreachable from here until the batch has tried, and failed, to write its output.
    proxy.block().await;
    case.wait_until_ready_says("s3", false).await;
    let stuck = case
        .app
        .wait_for(&case.batch, END_LIMIT, |b| b["status"] == "finalizing")
        .await;
    assert_eq!(stuck["request_counts"]["succeeded"], json!(N));
    let refused = proxy.refused();
    proxy.wait_for_refusals(refused + 3).await;
    let still = case.app.get_json(&format!("/v1/batches/{}", case.batch)).await;
    assert_eq!(still["status"], "finalizing", "no batch ends without its output");
    proxy.unblock();
    case.finish().await;
}

#[tokio::test]
async fn fault_matrix_the_webhook_receiver_failing() {
    // Eight failed attempts: against the default backoff (1 s doubling,
    // with jitter) they span 4¼ to 8½ minutes, the five minutes;
    // here the first backoff is 10 ms, the same attempts a hundredfold faster.
    let hook = Hook::start(8).await;
    let env = [("LORRY_ECHO_DELAY_MS", "1"), ("LORRY_WEBHOOK_MIN_BACKOFF_MS", "10")];
    let case = Case::start(Services::default(), 1, &env, hook, 2000).await;
    let batch = case.batch.clone();
    case.assert_exactly_once(&batch, N).await;
    let calls = case.hook.completions(&batch);
    let failed = calls.iter().filter(|(_, status)| *status == 500).count();
    assert_eq!(failed, 8, "the receiver failed eight times first: {calls:?}");
    assert_eq!(calls.last().map(|(_, status)| *status), Some(200), "{calls:?}");
    assert_eq!(
        calls.iter().filter(|(_, status)| *status == 200).count(),
        1,
        "delivered once: {calls:?}"
    );
    case.finish().await;
}
