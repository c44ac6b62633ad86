//! The official `openai` Python SDK against Lorry, base_url only: models,
//! chat (whole and streamed), completions, embeddings, errors, files +
//! batches to completion and output download, `x-request-id` (the SDK's
//! `_request_id`), a final 409 sent once by a client that retries 409s
//! (`x-should-retry: false`), and the completion webhook verified and parsed
//! by `client.webhooks.unwrap()`, and structured outputs through
//! `client.beta.chat.completions.parse` with a Pydantic model. `scripts/test` installs the SDK
//! in a virtual environment and names its interpreter in
//! `LORRY_TEST_OPENAI_PYTHON`.

use std::time::Duration;

use serde_json::{json, Value};

use crate::common::{spawn_app, TOKEN};

const RUN: &str = "/client/v4/accounts/default/ai/run";

#[tokio::test]
async fn the_official_openai_sdk_runs_every_flow() {
    let python = std::env::var("LORRY_TEST_OPENAI_PYTHON").expect(
        "LORRY_TEST_OPENAI_PYTHON names a Python with the openai package; run the suite with scripts/test, which makes one",
    );
    let app = spawn_app().await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/sdk/openai_flows.py");
    let run = tokio::process::Command::new(python)
        .arg(script)
        .env("LORRY_BASE_URL", &app.address)
        .env("LORRY_TOKEN", TOKEN)
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(300), run)
        .await
        .expect("the SDK script ended")
        .expect("the SDK script started");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "the SDK script failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: Value = serde_json::from_str(stdout.trim()).expect("the script prints one JSON report");

    // What the SDK got is the engine's own greedy answer, on every route.
    let answer = |body: Value, model: &'static str| {
        let app = &app;
        async move {
            let v: Value = app.post(&format!("{RUN}/{model}"), &body).await.json().await.unwrap();
            assert_eq!(v["success"], true, "{v}");
            v["result"].clone()
        }
    };
    let chat = answer(
        json!({"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6, "ignore_eos": true}),
        "@lorry/demo-llama",
    )
    .await;
    assert_eq!(report["chat"], chat["response"], "{report}");
    assert_eq!(
        report["batch"],
        json!([chat["response"], chat["response"], chat["response"]])
    );
    let completion = answer(
        json!({"prompt": "Once upon", "raw": true, "max_tokens": 4, "ignore_eos": true}),
        "@lorry/demo-llama",
    )
    .await;
    assert_eq!(report["completion"], completion["response"]);
    assert_eq!(report["webhook"], "batch.completed");
    // The parse helper's Pydantic model, filled from a constrained answer.
    let parsed = &report["parsed"];
    assert!(["spam", "ham"].contains(&parsed["label"].as_str().unwrap()), "{parsed}");
    assert!(parsed["score"].as_u64().unwrap() <= 9, "{parsed}");
    // The SDK's logprobs are the engine's for the same request.
    let scored = answer(
        json!({"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 5, "ignore_eos": true,
               "logprobs": true, "top_logprobs": 2}),
        "@lorry/demo-llama",
    )
    .await;
    let own: Vec<&Value> = scored["logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| &t["logprob"])
        .collect();
    let got: Vec<&Value> = report["logprobs"].as_array().unwrap().iter().collect();
    assert_eq!(got, own, "{report}");
    let several = answer(
        json!({"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6, "ignore_eos": true,
               "n": 3, "temperature": 1, "seed": 4}),
        "@lorry/demo-llama",
    )
    .await;
    let own: Vec<&Value> = several["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| &c["response"])
        .collect();
    assert_eq!(report["choices"].as_array().unwrap().iter().collect::<Vec<_>>(), own);
    let embedded = answer(json!({"text": ["a first text", "second"]}), "@lorry/demo-bge").await;
    assert_eq!(report["embedding"], embedded["data"][1]);
    app.stop().await;
}
