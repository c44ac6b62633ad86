//! A hostile client: connections held open, bodies trickled, U+0000 in every
//! place a client can put text, and a tenant timing another's prompts
//! through the prefix cache.

use std::sync::atomic::Ordering;

use lorry::Role;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::{spawn_app_with, TestApp, TOKEN};

fn host(app: &TestApp) -> String {
    app.address.trim_start_matches("http://").to_string()
}

/// Everything the server sends until it closes the connection.
async fn read_until_closed(stream: &mut TcpStream) -> String {
    let mut received = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => received.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&received).into_owned()
}

#[tokio::test]
async fn connections_over_the_cap_are_answered_503_and_the_cap_frees_as_they_close() {
    let app = spawn_app_with(Role::Api, |s| {
        s.api.max_connections = 3;
        s.api.header_timeout_secs = 3600;
    })
    .await;
    let mut holders = Vec::new();
    for _ in 0..3 {
        let mut held = TcpStream::connect(host(&app)).await.unwrap();
        held.write_all(b"GET /healthz HTTP/1.1\r\nhost: lorry\r\n")
            .await
            .unwrap();
        holders.push(held);
    }
    // The listener takes connections in order: these three hold every slot.
    let mut extra = TcpStream::connect(host(&app)).await.unwrap();
    extra
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: lorry\r\n\r\n")
        .await
        .unwrap();
    let answer = read_until_closed(&mut extra).await;
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("retry-after: 1"), "{answer}");
    assert!(answer.contains(r#""code":"service_unavailable""#), "{answer}");

    // The held requests finish, served, and their connections close: their
    // slots come back (the server frees a slot just after closing its
    // connection, so a request sent at that instant may still be shed).
    for mut held in holders {
        held.write_all(b"connection: close\r\n\r\n").await.unwrap();
        let answer = read_until_closed(&mut held).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }
    loop {
        let health = reqwest::get(app.url("/healthz")).await.unwrap();
        if health.status() != 503 {
            assert_eq!(health.status(), 200);
            break;
        }
    }
}

#[tokio::test]
async fn a_connection_that_dawdles_over_its_head_or_sits_idle_is_closed() {
    let app = spawn_app_with(Role::Api, |s| s.api.header_timeout_secs = 1).await;
    // One header line, then nothing.
    let mut slow = TcpStream::connect(host(&app)).await.unwrap();
    slow.write_all(b"GET /healthz HTTP/1.1\r\n").await.unwrap();
    let answer = read_until_closed(&mut slow).await;
    assert!(!answer.contains("200 OK"), "{answer}");

    // A kept-alive connection that sends nothing after its first request.
    let mut idle = TcpStream::connect(host(&app)).await.unwrap();
    idle.write_all(b"GET /healthz HTTP/1.1\r\nhost: lorry\r\n\r\n")
        .await
        .unwrap();
    let answer = read_until_closed(&mut idle).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

#[tokio::test]
async fn a_body_that_falls_behind_its_pace_is_answered_408_and_closed() {
    let app = spawn_app_with(Role::Api, |s| {
        s.api.body_timeout_secs = 1;
        s.api.body_min_rate = 1000;
    })
    .await;
    let mut slow = TcpStream::connect(host(&app)).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: lorry\r\nauthorization: Bearer {TOKEN}\r\n\
         content-type: application/json\r\ncontent-length: 100000\r\n\r\n{{\"model\""
    );
    slow.write_all(head.as_bytes()).await.unwrap();
    let answer = read_until_closed(&mut slow).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains(r#""code":"body_timeout""#), "{answer}");
    assert!(answer.to_ascii_lowercase().contains("connection: close"), "{answer}");
}

#[tokio::test]
async fn u0000_anywhere_in_client_input_is_a_400_naming_the_field() {
    let app = spawn_app_with(Role::Api, |_| {}).await;
    let refused = |response: reqwest::Response, param: &'static str| async move {
        let status = response.status();
        let body: Value = response.json().await.unwrap();
        assert_eq!(status, 400, "{body}");
        assert_eq!(body["error"]["code"], "nul_character", "{body}");
        assert_eq!(body["error"]["param"], param, "{body}");
    };
    let nul = "a\u{0}b";
    let run = "/client/v4/accounts/default/ai/run/@lorry/echo";
    refused(app.post(run, &json!({"prompt": nul})).await, "prompt").await;
    refused(
        app.post(
            "/v1/chat/completions",
            &json!({"model": "@lorry/echo", "messages": [{"role": "user", "content": nul}]}),
        )
        .await,
        "messages[0].content",
    )
    .await;
    refused(
        app.post(
            "/v1/batches",
            &json!({"model": "@lorry/echo", "requests": [{"custom_id": nul, "body": {"prompt": "x"}}]}),
        )
        .await,
        "requests[0].custom_id",
    )
    .await;
    refused(
        app.post(
            "/v1/batches",
            &json!({"model": "@lorry/echo", "metadata": {"k": nul}, "requests": [{"body": {"prompt": "x"}}]}),
        )
        .await,
        "metadata.k",
    )
    .await;
    refused(app.post("/v1/chat/completions", &json!({"model": nul})).await, "model").await;
    refused(
        app.post(
            "/client/v4/accounts/default/ai/finetunes",
            &json!({"name": nul, "model": "@lorry/demo-llama"}),
        )
        .await,
        "name",
    )
    .await;
    refused(app.get("/v1/batches?after=x%00").await, "query").await;
    refused(app.get("/v1/batches/batch_%00").await, "path").await;
    refused(app.get("/v1/models/%40lorry%2F%00").await, "path").await;
    let not_utf8 = app.get("/v1/batches/%ff%fe").await;
    assert_eq!(not_utf8.status(), 400);
    let body: Value = not_utf8.json().await.unwrap();
    assert_eq!(body["error"]["param"], "path", "{body}");

    // A line of an uploaded batch file: refused at upload, not by every batch made from it.
    let lines = format!(
        "{}\n{}\n",
        json!({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
               "body": {"model": "@lorry/echo", "messages": [{"role": "user", "content": "x"}]}}),
        json!({"custom_id": "b", "method": "POST", "url": "/v1/chat/completions",
               "body": {"model": "@lorry/echo", "messages": [{"role": "user", "content": nul}]}}),
    );
    let form = reqwest::multipart::Form::new()
        .text("purpose", "batch")
        .part("file", reqwest::multipart::Part::text(lines).file_name("in.jsonl"));
    let upload = app
        .http
        .post(app.url("/v1/files"))
        .bearer_auth(TOKEN)
        .multipart(form)
        .send()
        .await
        .unwrap();
    refused(upload, "file.line[2].body.messages[0].content").await;
}

/// The prefix cache's hits so far, over every text engine.
fn prefix_hits(app: &TestApp) -> u64 {
    app.text_engines
        .iter()
        .map(|e| e.counters().prefix_hits.load(Ordering::Relaxed))
        .sum()
}

async fn run_as(app: &TestApp, token: &str, account: &str, prompt: &str) {
    let answer = app
        .http
        .post(app.url(&format!("/client/v4/accounts/{account}/ai/run/@lorry/demo-llama")))
        .bearer_auth(token)
        .json(&json!({"prompt": prompt, "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200, "{}", answer.text().await.unwrap());
}

#[tokio::test]
async fn one_accounts_prompts_never_warm_the_prefix_cache_for_another() {
    let prompt = "the quick brown fox jumps over the lazy dog and keeps on running far away ".repeat(6);
    for (scope, shared) in [("account", false), ("deployment", true)] {
        let app = spawn_app_with(Role::Serve, |s| s.worker.prefix_cache_scope = scope.into()).await;
        app.store.ensure_account("other", "other-token").await.unwrap();
        run_as(&app, TOKEN, "default", &prompt).await;
        let after_first = prefix_hits(&app);
        run_as(&app, "other-token", "other", &prompt).await;
        let after_other = prefix_hits(&app);
        run_as(&app, TOKEN, "default", &prompt).await;
        let after_again = prefix_hits(&app);
        assert!(after_again > after_other, "{scope}: an account reuses its own blocks");
        assert_eq!(
            after_other > after_first,
            shared,
            "{scope}: another account's request hit the cache: {after_first} → {after_other}"
        );
        app.stop().await;
    }
}

#[tokio::test]
async fn odd_requests_are_answered_in_the_json_error_shape_with_the_field_named() {
    let app = spawn_app_with(Role::Api, |_| {}).await;
    let error = |response: reqwest::Response, status: u16, code: &'static str, param: Value| async move {
        assert_eq!(response.status(), status);
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["error"]["code"], code, "{body}");
        assert_eq!(body["error"]["param"], param, "{body}");
    };
    // A method the route does not take.
    let delete = app
        .http
        .delete(app.url("/v1/batches"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    error(delete, 405, "method_not_allowed", Value::Null).await;
    // A path or a query string over 8 KiB, on any route, with or without a token.
    let long = "x".repeat(9 << 10);
    let path = app
        .http
        .get(app.url(&format!("/v1/batches/{long}")))
        .send()
        .await
        .unwrap();
    error(path, 414, "uri_too_long", json!("path")).await;
    let query = app
        .http
        .get(app.url(&format!("/v1/batches?after={long}")))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    error(query, 414, "uri_too_long", json!("query")).await;
    let workers_ai = app
        .http
        .post(app.url(&format!("/client/v4/accounts/default/ai/run/{long}")))
        .send()
        .await
        .unwrap();
    assert_eq!(workers_ai.status(), 414);
    let envelope: Value = workers_ai.json().await.unwrap();
    assert_eq!(envelope["success"], false, "{envelope}");
    assert_eq!(envelope["error"]["code"], "uri_too_long", "{envelope}");
    // A multipart route sent JSON.
    error(
        app.post("/v1/files", &json!({"purpose": "batch"})).await,
        400,
        "invalid_multipart",
        json!("content-type"),
    )
    .await;
    let batch = |extra: Value| {
        let mut body = json!({"model": "@lorry/echo", "requests": [{"body": {"prompt": "x"}}]});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        body
    };
    error(
        app.post("/v1/batches", &batch(json!({"completion_window": "+5m"})))
            .await,
        400,
        "invalid_completion_window",
        json!("completion_window"),
    )
    .await;
    error(
        app.post(
            "/v1/batches",
            &json!({"model": "@lorry/echo", "requests": [{"body": {"prompt": "x", "stream": true}}]}),
        )
        .await,
        400,
        "invalid_value",
        json!("requests[0].body.stream"),
    )
    .await;
    let twice = app
        .http
        .post(app.url("/v1/batches"))
        .bearer_auth(TOKEN)
        .header("content-type", "application/json")
        .body(r#"{"model": "@lorry/echo", "model": "@lorry/demo-llama", "requests": [{"body": {"prompt": "x"}}]}"#)
        .send()
        .await
        .unwrap();
    error(twice, 400, "invalid_json", Value::Null).await;
    let long_stop = "s".repeat(1 << 20);
    error(
        app.post(
            "/v1/batches",
            &json!({"model": "@lorry/echo", "requests": [{"body": {"prompt": "x", "stop": long_stop}}]}),
        )
        .await,
        400,
        "invalid_value",
        json!("requests[0].body.stop"),
    )
    .await;
}
