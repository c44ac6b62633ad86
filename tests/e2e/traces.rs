//! OpenTelemetry traces: `lorry serve` exporting over OTLP/HTTP to a
//! collector (a real OTLP/HTTP endpoint here, decoding the protobuf bodies
//! with OpenTelemetry's own message types). A batch submitted with a client's
//! `traceparent` is one trace from the HTTP request through the outbox and
//! RabbitMQ to the worker's chunk and each engine sequence and its steps; a
//! real-time request likewise.

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use prost::Message as _;
use serde_json::{json, Value};

use crate::common::{child_env, eventually, isolated_settings, TOKEN};

const MODEL: &str = "@lorry/demo-llama";

/// A span as the collector received it.
#[derive(Debug, Clone)]
struct Span {
    service: String,
    trace: String,
    id: String,
    parent: String,
    name: String,
    events: Vec<String>,
}

/// An OTLP/HTTP collector on loopback: what it received.
async fn collector() -> (String, Arc<Mutex<Vec<Span>>>) {
    let spans: Arc<Mutex<Vec<Span>>> = Arc::default();
    let received = Arc::clone(&spans);
    let app = axum::Router::new().route(
        "/v1/traces",
        post(move |body: Bytes| {
            let received = Arc::clone(&received);
            async move {
                let request = ExportTraceServiceRequest::decode(body).expect("an OTLP protobuf body");
                let mut spans = received.lock().unwrap();
                for resource in request.resource_spans {
                    let service = resource
                        .resource
                        .iter()
                        .flat_map(|r| &r.attributes)
                        .find(|a| a.key == "service.name")
                        .and_then(|a| a.value.as_ref())
                        .map(|v| format!("{:?}", v.value))
                        .unwrap_or_default();
                    for scope in resource.scope_spans {
                        for span in scope.spans {
                            spans.push(Span {
                                service: service.clone(),
                                trace: hex(&span.trace_id),
                                id: hex(&span.span_id),
                                parent: hex(&span.parent_span_id),
                                name: span.name,
                                events: span.events.into_iter().map(|e| e.name).collect(),
                            });
                        }
                    }
                }
                // An empty ExportTraceServiceResponse.
                ([("content-type", "application/x-protobuf")], Vec::<u8>::new())
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, spans)
}

/// The spans received so far of the trace `trace` (hex).
fn in_trace(spans: &Mutex<Vec<Span>>, trace: &str) -> Vec<Span> {
    spans
        .lock()
        .unwrap()
        .iter()
        .filter(|s| s.trace == trace)
        .cloned()
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn a_request_is_one_trace_from_http_through_the_broker_to_the_engines_steps() {
    let (endpoint, spans) = collector().await;
    let settings = isolated_settings().await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut command = Command::new(env!("CARGO_BIN_EXE_lorry"));
    command
        .arg("serve")
        .envs(child_env(&settings))
        .env("LORRY_LISTEN", format!("127.0.0.1:{port}"))
        .env("LORRY_BOOTSTRAP_TOKEN", TOKEN)
        .env("LORRY_OTLP_ENDPOINT", &endpoint)
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        // One token a step, so that a sequence's steps are counted below.
        .env("LORRY_SPECULATE", "off");
    if std::env::var_os("TEST_LOG").is_none() {
        command.stdout(Stdio::null()).stderr(Stdio::null());
    }
    let _serve = Killed(command.spawn().expect("starting lorry serve"));
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    eventually(Duration::from_secs(120), || async {
        match http.get(format!("{base}/readyz")).send().await {
            Ok(r) if r.status() == 200 => Ok(()),
            other => Err(format!("lorry serve is not ready: {other:?}")),
        }
    })
    .await;

    // The client's own span, whose child the API's span must be.
    let (batch_trace, client_span) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    let response = http
        .post(format!("{base}/v1/batches"))
        .bearer_auth(TOKEN)
        .header("traceparent", format!("00-{batch_trace}-{client_span}-01"))
        .json(&json!({"model": MODEL, "requests": (0..3)
            .map(|i| json!({"body": {"prompt": format!("t {i}"), "raw": true, "max_tokens": 3, "ignore_eos": true}}))
            .collect::<Vec<_>>()}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 202);
    let id = response.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    eventually(Duration::from_secs(120), || async {
        let batch: Value = http
            .get(format!("{base}/v1/batches/{id}"))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if batch["status"] == "completed" {
            Ok(())
        } else {
            Err(format!("the batch has not completed: {batch}"))
        }
    })
    .await;

    let rt_trace = "0af7651916cd43dd8448eb211c80319c";
    let answer: Value = http
        .post(format!("{base}/client/v4/accounts/default/ai/run/{MODEL}"))
        .bearer_auth(TOKEN)
        .header("traceparent", format!("00-{rt_trace}-b7ad6b7169203331-01"))
        .json(&json!({"prompt": "hello", "raw": true, "max_tokens": 4, "ignore_eos": true}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(answer["success"], true, "{answer}");

    // The batch: HTTP request → (outbox, RabbitMQ) → the worker's chunk → each sequence, with its steps.
    let batch = eventually(Duration::from_secs(30), || async {
        let traced = in_trace(&spans, batch_trace);
        // Spans arrive as they end, in the exporter's batches: the chunk's
        // ends after its sequences' (once its results are committed).
        let count = |name: &str| traced.iter().filter(|s| s.name == name).count();
        let sequences = count("engine.sequence");
        if sequences == 3 && count("lorry.chunk") == 1 && count("POST /v1/batches") == 1 {
            Ok(traced)
        } else {
            Err(format!(
                "{sequences} engine sequences in the batch's trace so far: {traced:#?}"
            ))
        }
    })
    .await;
    let by_name: HashMap<&str, Vec<&Span>> = batch.iter().fold(HashMap::new(), |mut m, s| {
        m.entry(s.name.as_str()).or_default().push(s);
        m
    });
    let http_span = by_name["POST /v1/batches"][0];
    assert_eq!(
        http_span.parent, client_span,
        "the API's span is the client's span's child"
    );
    assert!(http_span.service.contains("lorry"), "{http_span:?}");
    let chunk = by_name["lorry.chunk"][0];
    assert_eq!(
        chunk.parent, http_span.id,
        "the chunk's span follows the request through the broker"
    );
    for sequence in &by_name["engine.sequence"] {
        assert_eq!(sequence.parent, chunk.id);
        // Three tokens: the prompt's step samples the first, two more steps the rest.
        let steps = sequence.events.iter().filter(|e| *e == "engine.step").count();
        assert_eq!(steps, 3, "{sequence:?}");
    }

    // The real-time request: HTTP → RabbitMQ → the worker → its sequence.
    let realtime = eventually(Duration::from_secs(30), || async {
        let traced = in_trace(&spans, rt_trace);
        let has = |name: &str| traced.iter().any(|s| s.name == name);
        if has("engine.sequence")
            && has("lorry.realtime")
            && has("POST /client/v4/accounts/{account_id}/ai/run/{*model}")
        {
            Ok(traced)
        } else {
            Err(format!("the real-time trace so far: {traced:#?}"))
        }
    })
    .await;
    let named = |name: &str| {
        realtime
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no {name} in {realtime:#?}"))
    };
    let http_span = named("POST /client/v4/accounts/{account_id}/ai/run/{*model}");
    let served = named("lorry.realtime");
    assert_eq!(served.parent, http_span.id);
    assert_eq!(named("engine.sequence").parent, served.id);
}
