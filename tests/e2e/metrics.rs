//! `/metrics` on the API and on two worker processes' own listeners
//! (`LORRY_WORKER_LISTEN`), scraped while a batch runs, checked by
//! Prometheus's own parser (`promtool check metrics`, which also applies
//! Prometheus's naming rules), their values set against the batch; the
//! workers' `/healthz` and `/readyz`.

use std::io::Write as _;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use lorry::Role;
use serde_json::{json, Value};
use std::collections::BTreeMap;

use crate::common::{eventually, spawn_app_with, TestApp};

const MODEL: &str = "@lorry/demo-llama";

/// One sample of an exposition.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// The samples of an exposition that `promtool` has passed.
struct Scrape(Vec<Sample>);

/// Scrape `url`, have `promtool check metrics` pass it, and read its samples.
async fn scrape(app: &TestApp, url: &str) -> Scrape {
    let response = app.http.get(url).send().await.unwrap();
    assert_eq!(response.status(), 200, "GET {url}");
    let content_type = response.headers()["content-type"].to_str().unwrap().to_string();
    assert!(content_type.starts_with("text/plain; version=0.0.4"), "{content_type}");
    let text = response.text().await.unwrap();
    let promtool = std::env::var("LORRY_TEST_PROMTOOL")
        .expect("LORRY_TEST_PROMTOOL names Prometheus's promtool; run the suite with scripts/test, which fetches it");
    let mut check = Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running promtool");
    check.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let checked = check.wait_with_output().unwrap();
    assert!(
        checked.status.success(),
        "promtool refuses {url}:\n{}{}\n{text}",
        String::from_utf8_lossy(&checked.stdout),
        String::from_utf8_lossy(&checked.stderr)
    );
    Scrape(
        text.lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .map(sample)
            .collect(),
    )
}

/// One sample line: `name{key="value",...} number`, label values unescaped.
fn sample(line: &str) -> Sample {
    let end = line.find(['{', ' ']).unwrap_or_else(|| panic!("no value in {line}"));
    let name = line[..end].to_string();
    let mut labels = BTreeMap::new();
    let mut rest = &line[end..];
    if let Some(inner) = rest.strip_prefix('{') {
        let mut chars = inner.char_indices();
        let mut key = String::new();
        loop {
            let (_, c) = chars.next().unwrap_or_else(|| panic!("unterminated labels in {line}"));
            match c {
                '}' => break,
                ',' => {}
                '=' => {
                    assert_eq!(chars.next().map(|(_, c)| c), Some('"'), "{line}");
                    let mut value = String::new();
                    loop {
                        match chars.next().map(|(_, c)| c) {
                            Some('"') => break,
                            Some('\\') => match chars.next().map(|(_, c)| c) {
                                Some('n') => value.push('\n'),
                                Some(c) => value.push(c),
                                None => panic!("{line}"),
                            },
                            Some(c) => value.push(c),
                            None => panic!("unterminated value in {line}"),
                        }
                    }
                    labels.insert(std::mem::take(&mut key), value);
                }
                c => key.push(c),
            }
        }
        let consumed = chars.next().map_or(inner.len(), |(i, _)| i);
        rest = &inner[consumed..];
    }
    let value = match rest.trim() {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        number => number.parse().unwrap_or_else(|_| panic!("bad value in {line}")),
    };
    Sample { name, labels, value }
}

fn matching<'a>(scrape: &'a Scrape, name: &'a str, labels: &'a [(&str, &str)]) -> impl Iterator<Item = &'a Sample> {
    scrape.0.iter().filter(move |s| {
        s.name == name
            && labels
                .iter()
                .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
    })
}

/// The sum of the samples of `name` carrying `labels`.
fn sum(scrape: &Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    matching(scrape, name, labels).map(|s| s.value).sum()
}

/// Observations of the histograms `name` carrying `labels`.
fn observations(scrape: &Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    sum(scrape, &format!("{name}_count"), labels)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Workers(Vec<Child>);

impl Drop for Workers {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[tokio::test]
async fn metrics_of_the_api_and_two_workers_add_up_to_what_they_served() {
    let app = spawn_app_with(Role::Api, |_| {}).await;
    let ports = [free_port(), free_port()];
    let _workers = Workers(
        ports
            .iter()
            .map(|port| {
                let listen = format!("127.0.0.1:{port}");
                // Speculation guesses tokens the counts below do not predict.
                app.spawn_worker_process(&[("LORRY_WORKER_LISTEN", &listen), ("LORRY_SPECULATE", "off")])
            })
            .collect(),
    );
    let worker_urls: Vec<String> = ports.iter().map(|p| format!("http://127.0.0.1:{p}")).collect();

    // Each worker is live, and ready once its models are loaded and it consumes.
    for url in &worker_urls {
        let ready = eventually(Duration::from_secs(120), || async {
            let Ok(response) = app.http.get(format!("{url}/readyz")).send().await else {
                return Err(format!("{url} does not listen yet"));
            };
            let status = response.status().as_u16();
            let body: Value = response.json().await.unwrap();
            if status == 200 {
                Ok(body)
            } else {
                assert_eq!(status, 503, "{body}");
                Err(format!("{url} is not ready: {body}"))
            }
        })
        .await;
        assert_eq!(
            ready,
            json!({"status": "ready", "checks": {"postgres": "ok", "rabbitmq": "ok", "models": "ok"}})
        );
        let health: Value = app
            .http
            .get(format!("{url}/healthz"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(health["status"], "ok");
    }

    // A batch whose requests make known numbers of tokens.
    let requests: Vec<Value> = (0..48)
        .map(|i| json!({"body": {"prompt": format!("count {i}"), "raw": true, "max_tokens": 3 + i % 5, "ignore_eos": true}}))
        .collect();
    let completion: i64 = (0..48).map(|i| 3 + i % 5).sum();
    let response = app
        .post("/v1/batches", &json!({"model": MODEL, "requests": requests}))
        .await;
    assert_eq!(response.status(), 202);
    let batch: Value = response.json().await.unwrap();
    let id = batch["id"].as_str().unwrap().to_string();

    // Scraped while it runs: every exposition passes promtool.
    let during = scrape(&app, &app.url("/metrics")).await;
    assert!(
        matching(&during, "lorry_queue_depth", &[("lane", "batch"), ("model", MODEL)])
            .next()
            .is_some(),
        "the batch lane's queue of {MODEL} is shown"
    );
    for url in &worker_urls {
        scrape(&app, &format!("{url}/metrics")).await;
    }
    let done = app.wait_until_ended(&id, Duration::from_secs(180)).await;
    assert_eq!(done["request_counts"]["completed"], 48, "{done}");
    assert_eq!(done["usage"]["completion_tokens"], completion, "{done}");

    // One real-time request, through the API.
    let answer: Value = app
        .post(
            &format!("/client/v4/accounts/default/ai/run/{MODEL}"),
            &json!({"prompt": "hello", "raw": true, "max_tokens": 5, "ignore_eos": true}),
        )
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(answer["success"], true, "{answer}");

    // The workers' counts add up to what the batch and the request say.
    let batch_labels = [("lane", "batch"), ("model", MODEL)];
    let (workers, summed) = eventually(Duration::from_secs(30), || async {
        let mut scrapes = Vec::new();
        for url in &worker_urls {
            scrapes.push(scrape(&app, &format!("{url}/metrics")).await);
        }
        let total = |name: &str, labels: &[(&str, &str)]| scrapes.iter().map(|s| sum(s, name, labels)).sum::<f64>();
        let summed = (
            total(
                "lorry_requests_total",
                &[("lane", "batch"), ("model", MODEL), ("outcome", "succeeded")],
            ),
            total(
                "lorry_requests_total",
                &[("lane", "real_time"), ("outcome", "succeeded")],
            ),
            total("lorry_engine_sequences", &[("state", "running")]),
        );
        if summed == (48.0, 1.0, 0.0) {
            Ok((scrapes, summed))
        } else {
            Err(format!("the workers count (batch, real time, running) {summed:?}"))
        }
    })
    .await;
    eprintln!("workers: {summed:?}");
    let total = |name: &str, labels: &[(&str, &str)]| workers.iter().map(|s| sum(s, name, labels)).sum::<f64>();
    assert_eq!(total("lorry_completion_tokens_total", &batch_labels), completion as f64);
    assert_eq!(
        total("lorry_prompt_tokens_total", &batch_labels),
        done["usage"]["prompt_tokens"].as_f64().unwrap()
    );
    assert_eq!(total("lorry_completion_tokens_total", &[("lane", "real_time")]), 5.0);
    assert_eq!(total("lorry_requests_total", &[("outcome", "errored")]), 0.0);
    // Every token the requests report was sampled by an engine (a request
    // run twice, after a preemption or a redelivery, is sampled twice).
    let generated = total("lorry_engine_generated_tokens_total", &[("model", MODEL)]);
    assert!(generated >= (completion + 5) as f64, "{generated} tokens sampled");
    let steps = total("lorry_engine_steps_total", &[("model", MODEL)]);
    let timed: f64 = workers
        .iter()
        .map(|s| observations(s, "lorry_engine_step_duration_seconds", &[("model", MODEL)]))
        .sum();
    assert!(steps > 0.0 && timed == steps, "{steps} steps, {timed} timed");
    for scrape in &workers {
        // Idle now: no block is held (cached blocks count as free).
        assert_eq!(
            sum(scrape, "lorry_engine_kv_blocks", &[("model", MODEL), ("state", "used")]),
            0.0
        );
        assert!(sum(scrape, "lorry_engine_kv_blocks", &[("model", MODEL), ("state", "free")]) > 0.0);
    }
    // No label names an account, an adapter or a request.
    for scrape in &workers {
        for sample in &scrape.0 {
            for key in [
                "account",
                "account_id",
                "adapter",
                "request_id",
                "batch_id",
                "custom_id",
            ] {
                assert!(!sample.labels.contains_key(key), "{} has {key}", sample.name);
            }
        }
    }

    // The API: its HTTP requests by route, the real-time request's latency, the queues, the batches.
    let api = scrape(&app, &app.url("/metrics")).await;
    assert!(
        sum(
            &api,
            "lorry_http_requests_total",
            &[("method", "POST"), ("route", "/v1/batches"), ("status", "202")]
        ) == 1.0
    );
    assert!(
        sum(
            &api,
            "lorry_http_requests_total",
            &[("method", "GET"), ("route", "/v1/batches/{id}"), ("status", "200")]
        ) >= 1.0
    );
    let rt = [("model", MODEL)];
    assert_eq!(
        sum(
            &api,
            "lorry_realtime_requests_total",
            &[("model", MODEL), ("outcome", "succeeded")]
        ),
        1.0
    );
    assert_eq!(
        observations(&api, "lorry_realtime_time_to_first_token_seconds", &rt),
        1.0
    );
    assert_eq!(observations(&api, "lorry_realtime_request_duration_seconds", &rt), 1.0);
    // The queues and batches are read again once a second.
    eventually(Duration::from_secs(10), || async {
        let api = scrape(&app, &app.url("/metrics")).await;
        let figures = (
            sum(&api, "lorry_queue_depth", &batch_labels),
            sum(&api, "lorry_queue_oldest_age_seconds", &batch_labels),
            sum(&api, "lorry_batches", &[("status", "completed")]),
            sum(&api, "lorry_batches", &[]),
        );
        if figures == (0.0, 0.0, 1.0, 1.0) {
            Ok(())
        } else {
            Err(format!("the queue, its oldest, completed and all batches: {figures:?}"))
        }
    })
    .await;

    // A path nobody routes is counted under no label of the client's choosing.
    let _ = app.get("/no/such/path/%00").await;
    let api = eventually(Duration::from_secs(5), || async {
        let api = scrape(&app, &app.url("/metrics")).await;
        if sum(&api, "lorry_http_requests_total", &[("route", "unmatched")]) >= 1.0 {
            Ok(api)
        } else {
            Err("the unrouted request is not counted".to_string())
        }
    })
    .await;
    assert!(api
        .0
        .iter()
        .all(|s| s.labels.get("route").is_none_or(|r| !r.contains("no/such"))));
    app.stop().await;
}

#[tokio::test]
async fn one_process_serving_api_and_worker_shows_both_in_one_exposition() {
    let app = crate::common::spawn_app().await;
    let done = app
        .run_batch(
            &json!({"model": MODEL, "requests": [{"body": {"prompt": "x", "raw": true, "max_tokens": 2, "ignore_eos": true}}]}),
            Duration::from_secs(60),
        )
        .await;
    assert_eq!(done["request_counts"]["completed"], 1);
    let metrics = scrape(&app, &app.url("/metrics")).await;
    let batch = [("lane", "batch"), ("model", MODEL), ("outcome", "succeeded")];
    assert_eq!(sum(&metrics, "lorry_requests_total", &batch), 1.0);
    assert!(sum(&metrics, "lorry_engine_steps_total", &[("model", MODEL)]) > 0.0);
    assert_eq!(
        sum(&metrics, "lorry_http_requests_total", &[("route", "/v1/batches")]),
        1.0
    );
    app.stop().await;
}
