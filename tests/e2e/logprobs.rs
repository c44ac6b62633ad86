//! Log-probabilities through the service: OpenAI's chat and legacy shapes,
//! whole and streamed, Workers AI's shape, batch items and batch files, and
//! refusals naming the field.

use std::time::Duration;

use serde_json::{json, Value};

use crate::common::{spawn_app, sse_json};
use crate::openai::run_batch_file;

const LLAMA: &str = "@lorry/demo-llama";

/// Chat's `logprobs.content`: each item's shape, its alternatives most likely
/// first and holding the chosen token's own probability or more.
fn check_items(items: &[Value], top: usize) {
    assert!(!items.is_empty());
    for item in items {
        let token = item["token"].as_str().unwrap();
        let bytes: Vec<u8> = item["bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap() as u8)
            .collect();
        if !token.starts_with("bytes:") {
            assert_eq!(token.as_bytes(), bytes.as_slice(), "{item}");
        }
        let logprob = item["logprob"].as_f64().unwrap();
        assert!(logprob <= 0.0, "{item}");
        let alts = item["top_logprobs"].as_array().unwrap();
        assert_eq!(alts.len(), top, "{item}");
        let values: Vec<f64> = alts.iter().map(|a| a["logprob"].as_f64().unwrap()).collect();
        assert!(values.windows(2).all(|w| w[0] >= w[1]), "{item}");
        if let Some(best) = values.first() {
            assert!(*best >= logprob - 1e-6, "{item}");
        }
    }
}

#[tokio::test]
async fn real_time_answers_carry_logprobs_in_openai_and_workers_ai_shapes() {
    let app = spawn_app().await;
    let chat = json!({"model": LLAMA, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8,
                      "ignore_eos": true, "logprobs": true, "top_logprobs": 3});
    let whole: Value = app.post("/v1/chat/completions", &chat).await.json().await.unwrap();
    let items = whole["choices"][0]["logprobs"]["content"].as_array().unwrap().clone();
    assert_eq!(
        items.len() as u64,
        whole["usage"]["completion_tokens"].as_u64().unwrap(),
        "{whole}"
    );
    check_items(&items, 3);
    assert_eq!(whole["choices"][0]["logprobs"]["refusal"], Value::Null);

    // Streamed: the chunks' items, in order, are the whole answer's.
    let mut streamed_body = chat.clone();
    streamed_body["stream"] = json!(true);
    let events = app
        .post("/v1/chat/completions", &streamed_body)
        .await
        .text()
        .await
        .unwrap();
    let streamed: Vec<Value> = sse_json(&events)
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(streamed, items, "streamed logprobs differ from the whole answer's");

    // Without logprobs, `null` as OpenAI answers.
    let mut plain = chat.clone();
    plain.as_object_mut().unwrap().remove("logprobs");
    plain.as_object_mut().unwrap().remove("top_logprobs");
    let answer: Value = app.post("/v1/chat/completions", &plain).await.json().await.unwrap();
    assert_eq!(answer["choices"][0]["logprobs"], Value::Null, "{answer}");

    // The legacy shape: tokens, their logprobs, alternatives as objects, offsets.
    let completion = json!({"model": LLAMA, "prompt": "one two three", "max_tokens": 6, "ignore_eos": true,
                            "logprobs": 2});
    let answer: Value = app.post("/v1/completions", &completion).await.json().await.unwrap();
    let legacy = &answer["choices"][0]["logprobs"];
    let tokens = legacy["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), 6, "{answer}");
    assert_eq!(legacy["token_logprobs"].as_array().unwrap().len(), 6);
    let offsets: Vec<u64> = legacy["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_u64().unwrap())
        .collect();
    assert_eq!(offsets[0], 0);
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{legacy}");
    for top in legacy["top_logprobs"].as_array().unwrap() {
        let n = top.as_object().unwrap().len();
        assert!((1..=2).contains(&n), "{legacy}");
    }

    // Workers AI's shape: the chat items beside the response.
    let run = format!("/client/v4/accounts/default/ai/run/{LLAMA}");
    let native = json!({"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8, "ignore_eos": true,
                        "logprobs": true, "top_logprobs": 3});
    let answer: Value = app.post(&run, &native).await.json().await.unwrap();
    assert_eq!(answer["result"]["logprobs"].as_array().unwrap(), &items, "{answer}");
    app.stop().await;
}

#[tokio::test]
async fn batch_items_and_batch_files_keep_their_logprobs() {
    let app = spawn_app().await;
    let body = json!({"messages": [{"role": "user", "content": "tell me"}], "max_tokens": 6, "ignore_eos": true,
                      "logprobs": true, "top_logprobs": 2});
    let done = app
        .run_batch(
            &json!({"model": LLAMA, "requests": [{"body": body}, {"body": {"prompt": "no logprobs", "max_tokens": 2}}]}),
            Duration::from_secs(120),
        )
        .await;
    assert_eq!(done["status"], "completed", "{done}");
    let lines = app.fetch_jsonl(done["output_url"].as_str().unwrap()).await;
    let items = lines[0]["response"]["body"]["logprobs"]
        .as_array()
        .cloned()
        .unwrap_or_else(|| panic!("{}", lines[0]));
    assert_eq!(items.len(), 6);
    check_items(&items, 2);
    assert!(lines[1]["response"]["body"].get("logprobs").is_none(), "{}", lines[1]);

    // The same request from a batch file, answered in OpenAI's output line.
    let line = json!({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"model": LLAMA, "messages": [{"role": "user", "content": "tell me"}], "max_tokens": 6,
                               "ignore_eos": true, "logprobs": true, "top_logprobs": 2}});
    let answer = run_batch_file(&app, "logprobs.jsonl", &[line]).await.remove(0);
    let content = &answer["response"]["body"]["choices"][0]["logprobs"]["content"];
    assert_eq!(content.as_array().unwrap(), &items, "{answer}");
    app.stop().await;
}

#[tokio::test]
async fn bad_logprobs_fields_are_refused_naming_the_field() {
    let app = spawn_app().await;
    let chat = |extra: Value| {
        let mut body = json!({"model": LLAMA, "messages": [{"role": "user", "content": "hi"}]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    let cases = [
        (
            "/v1/chat/completions",
            chat(json!({"logprobs": true, "top_logprobs": 21})),
            "invalid_value",
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"top_logprobs": 2})),
            "invalid_value",
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"logprobs": 3})),
            "invalid_type",
            "logprobs",
        ),
        (
            "/v1/completions",
            json!({"model": LLAMA, "prompt": "p", "logprobs": 6}),
            "invalid_value",
            "logprobs",
        ),
        (
            "/v1/completions",
            json!({"model": LLAMA, "prompt": "p", "logprobs": true}),
            "invalid_type",
            "logprobs",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "@lorry/echo", "messages": [{"role": "user", "content": "hi"}], "logprobs": true}),
            "unsupported_parameter",
            "logprobs",
        ),
    ];
    for (route, body, code, param) in cases {
        let response = app.post(route, &body).await;
        assert_eq!(response.status(), 400, "{body}");
        let error: Value = response.json().await.unwrap();
        assert_eq!(
            (error["error"]["code"].as_str(), error["error"]["param"].as_str()),
            (Some(code), Some(param)),
            "{body}: {error}"
        );
    }
    app.stop().await;
}
