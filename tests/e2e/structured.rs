//! Structured outputs through the service: batch items in every shape, the
//! real-time routes (streamed too), and refusals naming the field with
//! nothing stored.

use std::time::Duration;

use serde_json::{json, Value};

use crate::common::spawn_app;

const LLAMA: &str = "@lorry/demo-llama";

fn schema() -> Value {
    json!({"type": "object", "properties": {"label": {"enum": ["spam", "ham"]},
           "score": {"type": "integer", "minimum": 0, "maximum": 9}},
           "required": ["label", "score"], "additionalProperties": false})
}

fn check(text: &str) {
    let value: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?} is no JSON: {e}"));
    assert!(["spam", "ham"].contains(&value["label"].as_str().unwrap()), "{value}");
    assert!(value["score"].as_u64().unwrap() <= 9, "{value}");
    assert_eq!(value.as_object().unwrap().len(), 2, "{value}");
}

#[tokio::test]
async fn batch_items_and_real_time_requests_follow_their_constraints() {
    let app = spawn_app().await;
    let bodies = [
        json!({"prompt": "classify: win money now", "raw": true, "max_tokens": 64, "temperature": 1, "seed": 1,
               "response_format": {"type": "json_schema", "json_schema": {"name": "verdict", "strict": true, "schema": schema()}}}),
        json!({"messages": [{"role": "user", "content": "classify: lunch at noon?"}], "max_tokens": 64,
               "response_format": {"type": "json_schema", "json_schema": schema()}}),
        json!({"prompt": "answer:", "raw": true, "guided_choice": ["yes", "no"], "temperature": 1, "seed": 3}),
        json!({"prompt": "code:", "raw": true, "structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}}),
        json!({"prompt": "plain", "raw": true, "max_tokens": 4, "ignore_eos": true}),
    ];
    let requests: Vec<Value> = bodies.iter().map(|b| json!({"body": b})).collect();
    let done = app
        .run_batch(&json!({"model": LLAMA, "requests": requests}), Duration::from_secs(120))
        .await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["request_counts"]["succeeded"], 5, "{done}");
    let lines = app.fetch_jsonl(done["output_url"].as_str().unwrap()).await;
    let text = |i: usize| lines[i]["response"]["body"]["response"].as_str().unwrap().to_string();
    check(&text(0));
    check(&text(1));
    assert!(["yes", "no"].contains(&text(2).as_str()), "{}", text(2));
    let code = text(3);
    assert!(
        code.len() == 6
            && code[..2].bytes().all(|b| b.is_ascii_uppercase())
            && code[3..].bytes().all(|b| b.is_ascii_digit()),
        "{code}"
    );

    // The real-time lane: Workers AI's shape, and OpenAI's chat, whole and streamed.
    let run = format!("/client/v4/accounts/default/ai/run/{LLAMA}");
    let answer: Value = app.post(&run, &bodies[1]).await.json().await.unwrap();
    assert_eq!(answer["success"], true, "{answer}");
    assert_eq!(
        answer["result"]["response"].as_str().unwrap(),
        text(1),
        "the lanes answered differently"
    );
    let chat = json!({"model": LLAMA, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64,
                      "response_format": {"type": "json_object"}});
    let whole: Value = app.post("/v1/chat/completions", &chat).await.json().await.unwrap();
    let content = whole["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    if whole["choices"][0]["finish_reason"] == "stop" {
        assert!(
            serde_json::from_str::<Value>(&content).unwrap().is_object(),
            "{content}"
        );
    }
    let mut streamed_body = chat.clone();
    streamed_body["stream"] = json!(true);
    let events = app
        .post("/v1/chat/completions", &streamed_body)
        .await
        .text()
        .await
        .unwrap();
    let streamed: String = events
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| v["choices"][0]["delta"]["content"].as_str().map(str::to_string))
        .collect();
    assert_eq!(streamed, content, "streamed and whole answers differ");
    app.stop().await;
}

#[tokio::test]
async fn a_constraint_that_cannot_be_served_is_refused_naming_its_field_and_nothing_is_stored() {
    let app = spawn_app().await;
    let cases = [
        (
            json!({"prompt": "p", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "string", "minLength": 3, "maxLength": 1}}, "required": ["a"]}}}}),
            "invalid_schema",
            "requests[1].body.response_format.json_schema.schema",
        ),
        (
            json!({"prompt": "p", "guided_regex": "(a"}),
            "invalid_grammar",
            "requests[1].body.guided_regex",
        ),
        (
            json!({"prompt": "p", "guided_choice": ["a"], "guided_regex": "a"}),
            "conflicting_fields",
            "requests[1].body.guided_choice",
        ),
    ];
    for (bad, code, param) in cases {
        let body = json!({"model": LLAMA, "requests": [{"body": {"prompt": "fine"}}, {"body": bad}]});
        let response = app.post("/v1/batches", &body).await;
        assert_eq!(response.status(), 400);
        let error: Value = response.json().await.unwrap();
        assert_eq!(
            (error["error"]["code"].as_str(), error["error"]["param"].as_str()),
            (Some(code), Some(param)),
            "{error}"
        );
    }
    // OpenAI's route names the client's own field.
    let chat = json!({"model": LLAMA, "messages": [{"role": "user", "content": "hi"}],
                      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}});
    let response = app.post("/v1/chat/completions", &chat).await;
    assert_eq!(response.status(), 400);
    let error: Value = response.json().await.unwrap();
    assert_eq!(error["error"]["code"], "invalid_schema", "{error}");
    assert_eq!(error["error"]["param"], "response_format.json_schema.schema");
    // The echo model takes no constraint.
    let echo = json!({"model": "@lorry/echo", "requests": [{"body": {"prompt": "p", "guided_choice": ["a"]}}]});
    let response = app.post("/v1/batches", &echo).await;
    assert_eq!(response.status(), 400);
    let listed = app.get_json("/v1/batches").await;
    assert_eq!(listed["data"], json!([]), "a refused batch left something: {listed}");
    app.stop().await;
}
