//! The OpenAI-compatible surface over HTTP: models, chat and text completions
//! (whole and streamed), embeddings, files and file-based batches, and a
//! streaming client that goes away cancelling its sequence in the engine.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use base64::Engine as _;
use futures::StreamExt;
use lorry_engine::Backend;
use serde_json::{json, Value};

use lorry::Role;

use crate::common::{spawn_app, spawn_app_with, TestApp, TOKEN};

const LLAMA: &str = "@lorry/demo-llama";
const BGE: &str = "@lorry/demo-bge";
const RUN: &str = "/client/v4/accounts/default/ai/run";

/// The `data:` payloads of a server-sent event stream.
fn sse_data(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}

async fn run_text(app: &TestApp, body: Value) -> String {
    let answer: Value = app.post(&format!("{RUN}/{LLAMA}"), &body).await.json().await.unwrap();
    assert_eq!(answer["success"], true, "{answer}");
    answer["result"]["response"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn models_chat_completions_and_embeddings_answer_in_openai_shapes() {
    let app = spawn_app().await;

    let models = app.get_json("/v1/models").await;
    assert_eq!(models["object"], "list");
    let find = |id: &str| crate::common::listed_model(&models, id);
    assert_eq!(find(LLAMA)["task"], "text-generation");
    assert_eq!(find(LLAMA)["adapters"], true);
    assert_eq!(find(BGE)["task"], "embeddings");
    assert_eq!(find(BGE)["object"], "model");
    assert_eq!(app.get_json(&format!("/v1/models/{LLAMA}")).await, find(LLAMA));
    let missing = app.get("/v1/models/no-such-model").await;
    assert_eq!(missing.status(), 404);

    // Chat: the same greedy tokens as the Workers AI route on the same messages.
    let messages = json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello there"}]);
    let want = run_text(&app, json!({"messages": messages, "max_tokens": 6, "ignore_eos": true})).await;
    let chat = app
        .post(
            "/v1/chat/completions",
            &json!({"model": LLAMA, "messages": messages, "max_completion_tokens": 6, "ignore_eos": true, "temperature": 0}),
        )
        .await;
    assert_eq!(chat.status(), 200);
    let chat: Value = chat.json().await.unwrap();
    assert_eq!(chat["object"], "chat.completion", "{chat}");
    assert!(chat["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(chat["model"], LLAMA);
    assert_eq!(chat["choices"][0]["message"]["role"], "assistant");
    assert_eq!(chat["choices"][0]["message"]["content"], json!(want));
    assert_eq!(chat["choices"][0]["finish_reason"], "length");
    assert_eq!(chat["usage"]["completion_tokens"], 6);
    let usage = &chat["usage"];
    assert_eq!(
        usage["total_tokens"].as_i64().unwrap(),
        usage["prompt_tokens"].as_i64().unwrap() + 6
    );

    // Streamed: a role chunk, text chunks, the finish, the usage, [DONE].
    let stream = app
        .post(
            "/v1/chat/completions",
            &json!({"model": LLAMA, "messages": messages, "max_tokens": 6, "ignore_eos": true,
                    "stream": true, "stream_options": {"include_usage": true}}),
        )
        .await;
    assert_eq!(stream.headers()["content-type"], "text/event-stream");
    let data = sse_data(&stream.text().await.unwrap());
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, want);
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 6);
    assert_eq!(chunks[chunks.len() - 2]["choices"][0]["finish_reason"], "length");

    // Text completion: the prompt as it is, no template.
    let want = run_text(
        &app,
        json!({"prompt": "Once upon", "raw": true, "max_tokens": 5, "ignore_eos": true}),
    )
    .await;
    let done: Value = app
        .post(
            "/v1/completions",
            &json!({"model": LLAMA, "prompt": "Once upon", "max_tokens": 5, "ignore_eos": true}),
        )
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(done["object"], "text_completion", "{done}");
    assert_eq!(done["choices"][0]["text"], json!(want));

    // Embeddings: the Workers AI route's vectors, as floats and as base64.
    let reference: Value = app
        .post(&format!("{RUN}/{BGE}"), &json!({"text": ["a first text", "second"]}))
        .await
        .json()
        .await
        .unwrap();
    let floats: Value = app
        .post(
            "/v1/embeddings",
            &json!({"model": BGE, "input": ["a first text", "second"]}),
        )
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(floats["object"], "list", "{floats}");
    assert_eq!(floats["data"][1]["index"], 1);
    assert_eq!(floats["data"][1]["embedding"], reference["result"]["data"][1]);
    assert!(floats["usage"]["prompt_tokens"].as_i64().unwrap() > 0);
    let packed: Value = app
        .post(
            "/v1/embeddings",
            &json!({"model": BGE, "input": "second", "encoding_format": "base64"}),
        )
        .await
        .json()
        .await
        .unwrap();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(packed["data"][0]["embedding"].as_str().unwrap())
        .unwrap();
    let decoded: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let want: Vec<f32> = serde_json::from_value(reference["result"]["data"][1].clone()).unwrap();
    assert_eq!(decoded, want);

    // Refusals in OpenAI's error shape, naming the field as the client spelled it.
    for (body, code, param) in [
        (
            json!({"model": LLAMA, "messages": messages, "n": 17}),
            "invalid_value",
            "n",
        ),
        (
            json!({"model": LLAMA, "messages": messages, "bogus": 1}),
            "unknown_field",
            "bogus",
        ),
        (
            json!({"model": LLAMA, "messages": messages, "functions": [{"name": "f"}]}),
            "unsupported_parameter",
            "functions",
        ),
        (
            json!({"model": LLAMA, "messages": messages, "tools": [{"type": "function", "function": {"name": "f"}}],
                   "tool_choice": {"type": "function", "function": {"name": "g"}}}),
            "invalid_value",
            "tool_choice.function.name",
        ),
        (
            json!({"model": LLAMA, "messages": messages, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strnig"}}}}}]}),
            "invalid_schema",
            "tools[0].function.parameters",
        ),
        (
            json!({"model": LLAMA, "messages": messages, "tools": [{"type": "function", "function": {"name": "f"}}],
                   "response_format": {"type": "json_object"}}),
            "conflicting_fields",
            "tools",
        ),
        (
            json!({"model": LLAMA, "messages": messages, "max_completion_tokens": 0}),
            "out_of_range",
            "max_completion_tokens",
        ),
        (
            json!({"model": LLAMA, "messages": [{"role": "robot", "content": "x"}]}),
            "invalid_value",
            "messages[0].role",
        ),
        (
            json!({"model": BGE, "messages": messages}),
            "model_task_mismatch",
            "model",
        ),
        (
            json!({"model": "nope", "messages": messages}),
            "model_not_found",
            "model",
        ),
        (
            json!({"model": format!("{LLAMA}:no-such-adapter"), "messages": messages}),
            "adapter_not_found",
            "model",
        ),
        (
            json!({"model": LLAMA, "messages": messages, "stream_options": {"include_usage": true}}),
            "invalid_value",
            "stream_options",
        ),
    ] {
        let refused = app.post("/v1/chat/completions", &body).await;
        let status = refused.status().as_u16();
        let error: Value = refused.json().await.unwrap();
        assert!((400..500).contains(&status), "{body}: {status} {error}");
        assert_eq!(error["error"]["code"], code, "{body}: {error}");
        assert_eq!(error["error"]["param"], param, "{body}: {error}");
        assert!(error["error"]["type"].is_string());
    }
    let refused: Value = app
        .post("/v1/embeddings", &json!({"model": BGE, "input": [1, 2]}))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(refused["error"]["param"], "input", "{refused}");
    // A text the model's tokenizer makes nothing of is the client's fault
    // (400), found by the engine and named as the client named it.
    for (input, param) in [(json!(""), "input"), (json!(["a", ""]), "input[1]")] {
        let refused = app.post("/v1/embeddings", &json!({"model": BGE, "input": input})).await;
        assert_eq!(refused.status(), 400);
        let refused: Value = refused.json().await.unwrap();
        assert_eq!(refused["error"]["code"], "empty_prompt", "{refused}");
        assert_eq!(refused["error"]["param"], param, "{refused}");
    }
    app.stop().await;
}

/// A catalogue serving tiny-llama with a context of 40,000 tokens, so that a
/// request may ask for [`MAX_TOKENS_LIMIT`] tokens: a generation that takes
/// seconds however fast the engine is.
fn long_context_catalogue() -> std::path::PathBuf {
    use lorry_engine::fixtures::{self, Fixture};
    let dir = std::env::temp_dir().join(format!("lorry-e2e-long-context-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    fixtures::write(Fixture::TinyLlama, &dir.join("long")).unwrap();
    let config_path = dir.join("long/config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["max_position_embeddings"] = json!(40_000);
    std::fs::write(&config_path, config.to_string()).unwrap();
    let file = dir.join("models.json");
    std::fs::write(&file, json!({LONG: "long"}).to_string()).unwrap();
    file
}

const LONG: &str = "@cf/lorry/long-context";
const MAX_TOKENS_LIMIT: u64 = lorry_engine::input::MAX_TOKENS_LIMIT as u64;

#[tokio::test]
async fn a_streaming_client_that_goes_away_frees_its_sequence() {
    let catalogue = long_context_catalogue();
    let app = spawn_app_with(Role::Serve, |s| s.models.catalogue = Some(catalogue)).await;
    let engine = app
        .text_engines
        .iter()
        .find(|b| b.model() == LONG)
        .expect("the catalogue's model runs here")
        .clone();
    let counters = engine.counters();
    let before = counters.cancelled.load(Ordering::Relaxed);
    let generated_before = counters.generated_tokens.load(Ordering::Relaxed);
    let response = app
        .http
        .post(app.url("/v1/chat/completions"))
        .bearer_auth(TOKEN)
        .json(
            &json!({"model": LONG, "messages": [{"role": "user", "content": "go on"}],
                      "max_tokens": MAX_TOKENS_LIMIT, "ignore_eos": true, "stream": true}),
        )
        .send()
        .await
        .unwrap();
    let mut body = response.bytes_stream();
    // Wait for the first piece of text, then hang up.
    let mut seen = String::new();
    while !seen.contains("\"content\":\"") || seen.matches("data: ").count() < 3 {
        let piece = body.next().await.expect("the stream is open").unwrap();
        seen.push_str(&String::from_utf8_lossy(&piece));
    }
    drop(body);
    let started = Instant::now();
    while counters.cancelled.load(Ordering::Relaxed) == before {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the engine never saw the request cancelled"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "streamed: hang-up to the engine dropping the sequence: {:?}",
        started.elapsed()
    );
    let generated = counters.generated_tokens.load(Ordering::Relaxed) - generated_before;
    assert!(
        generated < MAX_TOKENS_LIMIT,
        "the sequence ran to the end: {generated} tokens"
    );
    // The engine serves the next request.
    let next: Value = app
        .post(
            "/v1/chat/completions",
            &json!({"model": LONG, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        )
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(next["object"], "chat.completion", "{next}");
    app.stop().await;
}

#[tokio::test]
async fn a_client_that_hangs_up_before_its_answer_frees_its_sequence() {
    use tokio::io::AsyncWriteExt;

    let catalogue = long_context_catalogue();
    let app = spawn_app_with(Role::Serve, |s| s.models.catalogue = Some(catalogue)).await;
    let engine = app.text_engines.iter().find(|b| b.model() == LONG).unwrap().clone();
    let counters = engine.counters();
    let before = counters.cancelled.load(Ordering::Relaxed);
    // A whole (not streamed) answer of the most tokens a request may ask
    // for, asked over a raw connection that is closed once the engine has it.
    let body = json!({"model": LONG, "messages": [{"role": "user", "content": "go on"}],
                      "max_tokens": MAX_TOKENS_LIMIT, "ignore_eos": true})
    .to_string();
    let mut client = tokio::net::TcpStream::connect(app.address.trim_start_matches("http://"))
        .await
        .unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: lorry\r\nauthorization: Bearer {TOKEN}\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    client.write_all(head.as_bytes()).await.unwrap();
    client.write_all(body.as_bytes()).await.unwrap();
    // Wait until the engine decodes it, then hang up.
    let generated_before = counters.generated_tokens.load(Ordering::Relaxed);
    while counters.generated_tokens.load(Ordering::Relaxed) == generated_before {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(client);
    let started = Instant::now();
    while counters.cancelled.load(Ordering::Relaxed) == before {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    eprintln!(
        "whole answer: hang-up to the engine dropping the sequence: {:?}",
        started.elapsed()
    );
    app.stop().await;
}

pub(crate) async fn upload(app: &TestApp, name: &str, body: Vec<u8>) -> reqwest::Response {
    let form = reqwest::multipart::Form::new().text("purpose", "batch").part(
        "file",
        reqwest::multipart::Part::bytes(body).file_name(name.to_string()),
    );
    app.http
        .post(app.url("/v1/files"))
        .bearer_auth(TOKEN)
        .multipart(form)
        .send()
        .await
        .unwrap()
}

pub(crate) fn jsonl(lines: &[Value]) -> Vec<u8> {
    lines.iter().map(|l| format!("{l}\n")).collect::<String>().into_bytes()
}

/// Run `lines` as a `/v1/chat/completions` batch file until it completes; its output file's lines.
pub(crate) async fn run_batch_file(app: &TestApp, name: &str, lines: &[Value]) -> Vec<Value> {
    let file: Value = upload(app, name, jsonl(lines)).await.json().await.unwrap();
    let created: Value = app
        .post(
            "/v1/batches",
            &json!({"input_file_id": file["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}),
        )
        .await
        .json()
        .await
        .unwrap();
    let ended = app
        .wait_until_ended(created["id"].as_str().unwrap(), Duration::from_secs(120))
        .await;
    assert_eq!(ended["status"], "completed", "{ended}");
    let output = app
        .get(&format!(
            "/v1/files/{}/content",
            ended["output_file_id"].as_str().unwrap()
        ))
        .await
        .text()
        .await
        .unwrap();
    output.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

#[tokio::test]
async fn files_and_batches_run_to_completion_with_openai_output_files() {
    let app = spawn_app().await;
    let line = |id: &str, content: &str| {
        json!({"custom_id": id, "method": "POST", "url": "/v1/chat/completions",
               "body": {"model": LLAMA, "messages": [{"role": "user", "content": content}], "max_tokens": 4, "ignore_eos": true}})
    };
    // Too long for the model's context: accepted, then fails in the engine.
    let long = "word ".repeat(2000);
    let lines = [line("a", "first"), line("b", "second"), line("c", &long)];
    let uploaded = upload(&app, "requests.jsonl", jsonl(&lines)).await;
    assert_eq!(uploaded.status(), 200);
    let file: Value = uploaded.json().await.unwrap();
    assert_eq!(file["object"], "file");
    assert_eq!(file["purpose"], "batch");
    assert_eq!(file["filename"], "requests.jsonl");
    let file_id = file["id"].as_str().unwrap().to_string();
    assert!(file_id.starts_with("file-"));
    assert_eq!(
        app.get_json(&format!("/v1/files/{file_id}")).await["bytes"],
        file["bytes"]
    );
    let content = app
        .get(&format!("/v1/files/{file_id}/content"))
        .await
        .bytes()
        .await
        .unwrap();
    assert_eq!(content.to_vec(), jsonl(&lines));

    let created = app
        .post(
            "/v1/batches",
            &json!({"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h",
                    "metadata": {"job": "nightly"}}),
        )
        .await;
    assert_eq!(created.status(), 202);
    let batch: Value = created.json().await.unwrap();
    assert_eq!(batch["endpoint"], "/v1/chat/completions", "{batch}");
    assert_eq!(batch["input_file_id"], json!(file_id));
    let id = batch["id"].as_str().unwrap().to_string();
    let ended = app.wait_until_ended(&id, Duration::from_secs(120)).await;
    assert_eq!(ended["status"], "completed", "{ended}");
    assert_eq!(ended["request_counts"]["total"], 3);
    assert_eq!(ended["request_counts"]["completed"], 2);
    assert_eq!(ended["request_counts"]["failed"], 1);

    let output_id = ended["output_file_id"].as_str().expect("an output file").to_string();
    let output = app
        .get(&format!("/v1/files/{output_id}/content"))
        .await
        .text()
        .await
        .unwrap();
    let output: Vec<Value> = output.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(output.len(), 2);
    for (got, (custom_id, content)) in output.iter().zip([("a", "first"), ("b", "second")]) {
        assert_eq!(got["custom_id"], custom_id);
        assert_eq!(got["error"], Value::Null);
        assert_eq!(got["response"]["status_code"], 200);
        let body = &got["response"]["body"];
        assert_eq!(body["object"], "chat.completion");
        assert_eq!(body["model"], LLAMA);
        assert_eq!(body["choices"][0]["finish_reason"], "length");
        let want = run_text(
            &app,
            json!({"messages": [{"role": "user", "content": content}], "max_tokens": 4, "ignore_eos": true}),
        )
        .await;
        assert_eq!(body["choices"][0]["message"]["content"], json!(want));
        assert_eq!(body["usage"]["completion_tokens"], 4);
    }
    let error_id = ended["error_file_id"].as_str().expect("an error file").to_string();
    let errors = app
        .get(&format!("/v1/files/{error_id}/content"))
        .await
        .text()
        .await
        .unwrap();
    let errors: Vec<Value> = errors.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(errors.len(), 1);
    assert_eq!(errors[0]["custom_id"], "c");
    assert_eq!(errors[0]["error"]["code"], "context_length_exceeded", "{}", errors[0]);
    let outputs = app.get_json("/v1/files?purpose=batch_output").await;
    assert_eq!(outputs["data"].as_array().unwrap().len(), 2, "{outputs}");

    // Deleting a file removes it for good.
    let deleted: Value = app
        .http
        .delete(app.url(&format!("/v1/files/{file_id}")))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(deleted["deleted"], true);
    assert_eq!(app.get(&format!("/v1/files/{file_id}")).await.status(), 404);
    app.stop().await;
}

#[tokio::test]
async fn bad_batch_files_are_refused_naming_the_line_and_nothing_is_kept() {
    let app = spawn_app().await;
    let good = json!({"custom_id": "ok", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"model": LLAMA, "messages": [{"role": "user", "content": "x"}]}});
    let mut bad_role = good.clone();
    bad_role["custom_id"] = json!("two");
    bad_role["body"]["messages"][0]["role"] = json!("robot");
    let mut bad_url = good.clone();
    bad_url["custom_id"] = json!("two");
    bad_url["url"] = json!("/v1/images");
    let mut other_model = good.clone();
    other_model["custom_id"] = json!("two");
    other_model["body"]["model"] = json!("@lorry/echo");
    let cases: Vec<(Vec<u8>, &str, &str)> = vec![
        (
            b"{\"custom_id\": \"ok\"\nnot json\n".to_vec(),
            "invalid_json",
            "file.line[1]",
        ),
        (
            jsonl(&[good.clone(), bad_role]),
            "invalid_value",
            "file.line[2].body.messages[0].role",
        ),
        (jsonl(&[good.clone(), bad_url]), "invalid_value", "file.line[2].url"),
        (
            jsonl(&[good.clone(), good.clone()]),
            "duplicate_custom_id",
            "file.line[2].custom_id",
        ),
        (Vec::new(), "empty_file", "file"),
    ];
    for (body, code, param) in cases {
        let refused = upload(&app, "in.jsonl", body).await;
        assert_eq!(refused.status(), 400);
        let error: Value = refused.json().await.unwrap();
        assert_eq!(error["error"]["code"], code, "{error}");
        assert_eq!(error["error"]["param"], param, "{error}");
    }
    assert_eq!(app.get_json("/v1/files").await["data"], json!([]));

    // Lines valid alone, but not one batch: two models.
    let file: Value = upload(&app, "mixed.jsonl", jsonl(&[good.clone(), other_model]))
        .await
        .json()
        .await
        .unwrap();
    let refused = app
        .post(
            "/v1/batches",
            &json!({"input_file_id": file["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}),
        )
        .await;
    assert_eq!(refused.status(), 400);
    let error: Value = refused.json().await.unwrap();
    assert_eq!(error["error"]["code"], "model_mismatch", "{error}");
    let refused: Value = app
        .post(
            "/v1/batches",
            &json!({"input_file_id": file["id"], "endpoint": "/v1/embeddings", "completion_window": "24h"}),
        )
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(refused["error"]["code"], "endpoint_mismatch", "{refused}");
    let missing: Value = app
        .post(
            "/v1/batches",
            &json!({"input_file_id": "file-0123456789abcdef0123456789abcdef", "endpoint": "/v1/chat/completions"}),
        )
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(missing["error"]["code"], "file_not_found", "{missing}");
    assert_eq!(app.get_json("/v1/batches").await["data"], json!([]));
    app.stop().await;
}
