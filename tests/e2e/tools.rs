//! Tool calls through the service beyond the OpenAI SDK's flows (which
//! `sdk.rs` drives): Workers AI's shape whole and streamed, a native batch
//! item and a batch file's line — each a required call of the offered
//! function with its arguments, the same on both lanes for one seed.

use std::time::Duration;

use serde_json::{json, Value};

use crate::common::{spawn_app, sse_json};
use crate::openai::run_batch_file;

const LLAMA: &str = "@lorry/demo-llama";
const RUN: &str = "/client/v4/accounts/default/ai/run";

/// A call's name and arguments in Workers AI's shape (`arguments` an object).
fn call_of(call: &Value) -> (String, Value) {
    assert!(call["id"].as_str().unwrap().starts_with("call_"), "{call}");
    (call["name"].as_str().unwrap().to_string(), call["arguments"].clone())
}

#[tokio::test]
async fn a_required_call_comes_back_in_every_shape_and_lane() {
    let app = spawn_app().await;
    // Workers AI's bare function shape.
    let tools = json!([{"name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                       "required": ["city"], "additionalProperties": false}}]);
    let body = json!({"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools,
                      "tool_choice": "required", "parallel_tool_calls": false, "temperature": 1.0, "seed": 7,
                      "max_tokens": 100});
    let answer: Value = app.post(&format!("{RUN}/{LLAMA}"), &body).await.json().await.unwrap();
    assert_eq!(answer["success"], true, "{answer}");
    let result = &answer["result"];
    assert_eq!(result["response"], "", "{result}");
    let (name, arguments) = call_of(&result["tool_calls"][0]);
    assert_eq!(name, "get_weather");
    assert!(
        arguments["city"].is_string() && arguments.as_object().unwrap().len() == 1,
        "{arguments}"
    );

    // Streamed: no text of the call, then one event with the calls, then the usage.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = sse_json(
        &app.post(&format!("{RUN}/{LLAMA}"), &streamed)
            .await
            .text()
            .await
            .unwrap(),
    );
    assert!(events.iter().all(|e| e["response"] == ""), "{events:?}");
    let calls: Vec<&Value> = events.iter().filter(|e| e.get("tool_calls").is_some()).collect();
    assert_eq!(calls.len(), 1, "{events:?}");
    assert_eq!(call_of(&calls[0]["tool_calls"][0]), (name.clone(), arguments.clone()));
    assert!(events.last().unwrap().get("usage").is_some(), "{events:?}");

    // A native batch item: the same call, stored in the result.
    let done = app
        .run_batch(
            &json!({"model": LLAMA, "requests": [{"body": body}]}),
            Duration::from_secs(120),
        )
        .await;
    assert_eq!(done["status"], "completed", "{done}");
    let lines = app.fetch_jsonl(done["output_url"].as_str().unwrap()).await;
    let stored = &lines[0]["response"]["body"];
    assert_eq!(
        call_of(&stored["tool_calls"][0]),
        (name.clone(), arguments.clone()),
        "{stored}"
    );

    // A batch file's line, answered as the chat route answers.
    let mut chat = body.clone();
    chat["model"] = json!(LLAMA);
    chat["tools"] = json!([{"type": "function", "function": tools[0]}]);
    let line = json!({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": chat});
    let answer = run_batch_file(&app, "tools.jsonl", &[line]).await.remove(0);
    let choice = &answer["response"]["body"]["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{answer}");
    assert_eq!(choice["message"]["content"], Value::Null, "{answer}");
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], name.as_str());
    let from_file: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(from_file, arguments, "the batch file's line answered differently");
    app.stop().await;
}
