//! `n` > 1 through the service: OpenAI's chat and completions, whole and
//! streamed, a batch item and a batch file's line, usage as OpenAI counts
//! it, and refusals naming the field.

use std::time::Duration;

use serde_json::{json, Value};

use crate::common::{spawn_app, sse_json};
use crate::openai::run_batch_file;

const LLAMA: &str = "@lorry/demo-llama";

#[tokio::test]
async fn several_choices_come_back_whole_streamed_and_from_batches() {
    let app = spawn_app().await;
    let chat = json!({"model": LLAMA, "messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 8,
                      "ignore_eos": true, "temperature": 1.0, "seed": 11, "n": 3});
    let whole: Value = app.post("/v1/chat/completions", &chat).await.json().await.unwrap();
    let choices = whole["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3, "{whole}");
    let texts: Vec<String> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            assert_eq!(c["index"], i, "{whole}");
            assert_eq!(c["finish_reason"], "length");
            c["message"]["content"].as_str().unwrap().to_string()
        })
        .collect();
    assert!(texts.iter().any(|t| *t != texts[0]), "{texts:?}");
    // The prompt once, every choice's tokens.
    assert_eq!(whole["usage"]["completion_tokens"], 24, "{whole}");
    let one: Value = app
        .post("/v1/chat/completions", &{
            let mut one = chat.clone();
            one["n"] = json!(1);
            one
        })
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(whole["usage"]["prompt_tokens"], one["usage"]["prompt_tokens"]);
    assert_eq!(
        one["choices"][0]["message"]["content"],
        texts[0].as_str(),
        "n: 1 is the first choice"
    );

    // Streamed: every choice opens, its pieces carry its index, each ends.
    let mut streamed_body = chat.clone();
    streamed_body["stream"] = json!(true);
    let events = app
        .post("/v1/chat/completions", &streamed_body)
        .await
        .text()
        .await
        .unwrap();
    let mut streamed = vec![String::new(); 3];
    let mut finished = 0;
    for chunk in sse_json(&events) {
        let choice = &chunk["choices"][0];
        let index = choice["index"].as_u64().unwrap() as usize;
        if let Some(piece) = choice["delta"]["content"].as_str() {
            streamed[index].push_str(piece);
        }
        if choice["finish_reason"].is_string() {
            finished += 1;
        }
    }
    assert_eq!(streamed, texts);
    assert_eq!(finished, 3);

    // The legacy route.
    let completion = json!({"model": LLAMA, "prompt": "once upon", "max_tokens": 4, "ignore_eos": true,
                            "temperature": 1.0, "n": 2});
    let answer: Value = app.post("/v1/completions", &completion).await.json().await.unwrap();
    assert_eq!(answer["choices"].as_array().unwrap().len(), 2, "{answer}");
    assert_eq!(answer["choices"][1]["index"], 1);

    // A native batch item: every choice in the result's `choices`.
    let body = json!({"messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 8,
                      "ignore_eos": true, "temperature": 1.0, "seed": 11, "n": 3});
    let done = app
        .run_batch(
            &json!({"model": LLAMA, "requests": [{"body": body}]}),
            Duration::from_secs(120),
        )
        .await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["usage"]["completion_tokens"], 24, "{done}");
    let lines = app.fetch_jsonl(done["output_url"].as_str().unwrap()).await;
    let result = &lines[0]["response"]["body"];
    let stored: Vec<&str> = result["choices"]
        .as_array()
        .unwrap_or_else(|| panic!("{result}"))
        .iter()
        .map(|c| c["response"].as_str().unwrap())
        .collect();
    assert_eq!(stored, texts, "the batch lane answered differently");
    assert_eq!(result["response"], texts[0].as_str());

    // A batch file's line, answered as the chat route answers.
    let line = json!({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": chat});
    let answer = run_batch_file(&app, "choices.jsonl", &[line]).await.remove(0);
    let from_file: Vec<&str> = answer["response"]["body"]["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["message"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(from_file, texts, "{answer}");
    assert_eq!(answer["response"]["body"]["usage"]["completion_tokens"], 24);
    app.stop().await;
}

#[tokio::test]
async fn a_bad_n_is_refused_naming_it() {
    let app = spawn_app().await;
    let chat = |model: &str, n: Value| json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "n": n});
    for (body, code) in [
        (chat(LLAMA, json!(17)), "invalid_value"),
        (chat(LLAMA, json!(0)), "invalid_value"),
        (chat(LLAMA, json!("2")), "invalid_type"),
        (chat("@lorry/echo", json!(2)), "unsupported_parameter"),
    ] {
        let response = app.post("/v1/chat/completions", &body).await;
        assert_eq!(response.status(), 400, "{body}");
        let error: Value = response.json().await.unwrap();
        assert_eq!(
            (error["error"]["code"].as_str(), error["error"]["param"].as_str()),
            (Some(code), Some("n")),
            "{body}: {error}"
        );
    }
    app.stop().await;
}
