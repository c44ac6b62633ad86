//! LoRA adapters through the service: uploaded in both shapes, checked
//! against the base model, kept private to their account, and served in the
//! same batches as base-model requests with the engine's own answers.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use candle_core::{Device, Tensor};
use lorry_engine::lora::{Adapter, AdapterLimits, PackedAdapter};
use lorry_engine::runtime::chat::TextModel;
use lorry_engine::{Task, ValidRequest};
use reqwest::multipart::{Form, Part};
use serde_json::{json, Value};

use crate::common::{spawn_app, spawn_app_with, TestApp, TOKEN};

const MODEL: &str = "@lorry/demo-llama";
const FINETUNES: &str = "/client/v4/accounts/default/ai/finetunes";
const RUN: &str = "/client/v4/accounts/default/ai/run/@lorry/demo-llama";

fn reference_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("engine/tests/data/lora")
        .join(name)
}

fn file(name: &str, which: &str) -> Vec<u8> {
    std::fs::read(reference_dir(name).join(which)).unwrap()
}

fn part(bytes: Vec<u8>, file_name: &str) -> Part {
    Part::bytes(bytes).file_name(file_name.to_string())
}

/// `POST /v1/adapters` with the given text fields and files.
async fn upload(app: &TestApp, token: &str, fields: &[(&str, &str)], files: Vec<(&str, Vec<u8>)>) -> (u16, Value) {
    let mut form = Form::new();
    for (name, value) in fields {
        form = form.text(name.to_string(), value.to_string());
    }
    for (name, bytes) in files {
        let file_name = if name == "config" {
            "adapter_config.json"
        } else {
            "adapter_model.safetensors"
        };
        form = form.part(name.to_string(), part(bytes, file_name));
    }
    let response = app
        .http
        .post(app.url("/v1/adapters"))
        .bearer_auth(token)
        .multipart(form)
        .send()
        .await
        .unwrap();
    (response.status().as_u16(), response.json().await.unwrap())
}

async fn upload_reference(app: &TestApp, name: &str, dir: &str) -> (u16, Value) {
    upload(
        app,
        TOKEN,
        &[("model", MODEL), ("name", name), ("description", "reference adapter")],
        vec![
            ("config", file(dir, "adapter_config.json")),
            ("weights", file(dir, "adapter_model.safetensors")),
        ],
    )
    .await
}

/// `POST …/finetunes/{id}/finetune-assets`.
async fn upload_asset(app: &TestApp, finetune: &str, file_name: &str, bytes: Vec<u8>) -> (u16, Value) {
    let form = Form::new()
        .text("file_name", file_name.to_string())
        .part("file", part(bytes, file_name));
    let response = app
        .http
        .post(app.url(&format!("{FINETUNES}/{finetune}/finetune-assets")))
        .bearer_auth(TOKEN)
        .multipart(form)
        .send()
        .await
        .unwrap();
    (response.status().as_u16(), response.json().await.unwrap())
}

fn error_of(body: &Value) -> (String, String) {
    // Both shapes carry `error` (Workers AI's envelope adds `errors`).
    let error = &body["error"];
    (
        error["code"].as_str().unwrap_or_default().to_string(),
        error["param"].as_str().unwrap_or_default().to_string(),
    )
}

/// The engine's own answer for `body` with the reference adapter `dir` (or none).
fn expected(model: &TextModel, body: &Value, dir: Option<&str>) -> String {
    let mut body = body.clone();
    body.as_object_mut()
        .unwrap()
        .retain(|k, _| k != "lora" && k != "adapter");
    let request = ValidRequest::parse(Task::TextGeneration, &body).unwrap();
    let adapter = dir.map(|dir| {
        PackedAdapter::new(
            &Adapter::from_dir(
                &reference_dir(dir),
                &model.model.config().adapter_shape(),
                AdapterLimits::default(),
            )
            .unwrap(),
        )
    });
    model.generate_adapted(&request, adapter.as_ref()).unwrap().text
}

#[tokio::test]
async fn uploaded_adapters_serve_mixed_batches_with_the_engines_answers() {
    let app = spawn_app().await;
    let llama = TextModel::from_dir(&app.settings.data_dir().join("models/demo-llama"), &Device::Cpu).unwrap();

    // Native: both files at once.
    let (status, a) = upload_reference(&app, "alpha", "adapter-a").await;
    assert_eq!(status, 201, "{a}");
    assert_eq!(
        (a["status"].as_str(), a["rank"].as_i64()),
        (Some("ready"), Some(8)),
        "{a}"
    );
    assert_eq!(a["targets"].as_array().unwrap().len(), 7, "{a}");

    // Workers AI: an empty finetune, then one file at a time (weights first).
    // Cloudflare's SDK sends `public`: false is taken, true refused.
    let public = app
        .post(FINETUNES, &json!({"model": MODEL, "name": "open", "public": true}))
        .await;
    assert_eq!(public.status(), 400);
    let public: Value = public.json().await.unwrap();
    assert_eq!(
        (&public["success"], error_of(&public)),
        (&json!(false), ("unsupported_parameter".into(), "public".into())),
        "{public}"
    );
    let created: Value = app
        .post(
            FINETUNES,
            &json!({"model": MODEL, "name": "beta", "description": "b", "public": false}),
        )
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(created["success"], true, "{created}");
    let beta = created["result"]["id"].as_str().unwrap().to_string();
    let pending = app
        .post(RUN, &json!({"prompt": "x", "raw": true, "lora": "beta"}))
        .await;
    assert_eq!(pending.status(), 409);
    let (status, body) = upload_asset(
        &app,
        &beta,
        "adapter_model.safetensors",
        file("adapter-b", "adapter_model.safetensors"),
    )
    .await;
    assert_eq!(
        (status, body["result"]["status"].as_str()),
        (200, Some("pending")),
        "{body}"
    );
    // Cloudflare's asset reply.
    let asset = &body["result"];
    assert_eq!(asset["bucket_name"], json!(app.settings.services.s3_bucket), "{body}");
    assert_eq!(asset["finetune_id"], json!(beta), "{body}");
    assert_eq!(asset["file_name"], "adapter_model.safetensors", "{body}");
    assert!(asset["id"].as_str().is_some_and(|id| id.len() == 36), "{body}");
    for stamp in ["created_at", "modified_at"] {
        assert!(
            chrono::DateTime::parse_from_rfc3339(asset[stamp].as_str().unwrap_or("")).is_ok(),
            "{stamp}: {body}"
        );
    }
    let (status, body) = upload_asset(
        &app,
        &beta,
        "adapter_config.json",
        file("adapter-b", "adapter_config.json"),
    )
    .await;
    assert_eq!(
        (status, body["result"]["status"].as_str()),
        (200, Some("ready")),
        "{body}"
    );
    let listed = app.get_json(FINETUNES).await;
    let names: Vec<&str> = listed["result"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["beta", "alpha"], "{listed}");
    let native = app.get_json("/v1/adapters/beta").await;
    assert_eq!(native["id"].as_str(), Some(beta.as_str()));

    // One native batch mixing base requests, both adapters by name and by id, both fields.
    let prompts = ["the quick brown fox", "once upon a time", "lorry"];
    let mut bodies = Vec::new();
    for (i, prompt) in prompts.iter().enumerate() {
        let base = json!({"prompt": prompt, "raw": true, "max_tokens": 10, "ignore_eos": true, "seed": i});
        let with = |field: &str, value: &str| {
            let mut body = base.clone();
            body[field] = json!(value);
            body
        };
        bodies.push((base.clone(), None));
        bodies.push((with("adapter", "alpha"), Some("adapter-a")));
        bodies.push((with("lora", a["id"].as_str().unwrap()), Some("adapter-a")));
        bodies.push((with("adapter", &beta), Some("adapter-b")));
        bodies.push((with("lora", "beta"), Some("adapter-b")));
    }
    let requests: Vec<Value> = bodies
        .iter()
        .enumerate()
        .map(|(i, (body, _))| json!({"custom_id": format!("r{i}"), "body": body}))
        .collect();
    let done = app
        .run_batch(&json!({"model": MODEL, "requests": requests}), Duration::from_secs(120))
        .await;
    assert_eq!(done["request_counts"]["succeeded"], bodies.len(), "{done}");
    let lines = app.fetch_jsonl(done["output_url"].as_str().unwrap()).await;
    let by_id: HashMap<String, Value> = lines
        .into_iter()
        .map(|l| (l["custom_id"].as_str().unwrap().to_string(), l))
        .collect();
    let mut answers = HashMap::new();
    for (i, (body, dir)) in bodies.iter().enumerate() {
        let got = &by_id[&format!("r{i}")]["response"]["body"]["response"];
        let want = expected(&llama, body, *dir);
        assert_eq!(got, &json!(want), "request {i} ({dir:?})");
        answers.insert((body["prompt"].to_string(), *dir), want);
    }
    for prompt in prompts {
        let key = |dir| (json!(prompt).to_string(), dir);
        assert_ne!(
            answers[&key(Some("adapter-a"))],
            answers[&key(None)],
            "adapter a changed nothing"
        );
        assert_ne!(
            answers[&key(Some("adapter-b"))],
            answers[&key(None)],
            "adapter b changed nothing"
        );
    }

    // `base:adapter` as the batch's model gives every request that adapter.
    let body = json!({"prompt": "once upon a time", "raw": true, "max_tokens": 10, "ignore_eos": true});
    let batch = json!({"model": format!("{MODEL}:alpha"), "requests": [{"body": body}]});
    let done = app.run_batch(&batch, Duration::from_secs(60)).await;
    let lines = app.fetch_jsonl(done["output_url"].as_str().unwrap()).await;
    assert_eq!(
        lines[0]["response"]["body"]["response"],
        json!(expected(&llama, &body, Some("adapter-a")))
    );

    // Workers AI: real time and queued, `lora` by name.
    let body =
        json!({"prompt": "the quick brown fox", "raw": true, "max_tokens": 10, "ignore_eos": true, "lora": "beta"});
    let answer: Value = app.post(RUN, &body).await.json().await.unwrap();
    assert_eq!(
        answer["result"]["response"],
        json!(expected(&llama, &body, Some("adapter-b"))),
        "{answer}"
    );
    let queued: Value = app
        .post(
            &format!("{RUN}?queueRequest=true"),
            &json!({"requests": [body.clone()]}),
        )
        .await
        .json()
        .await
        .unwrap();
    let id = queued["result"]["request_id"].as_str().unwrap().to_string();
    let finished = app.wait_until_ended(&id, Duration::from_secs(60)).await;
    assert_eq!(finished["request_counts"]["succeeded"], 1, "{finished}");
    let polled: Value = app.post(RUN, &json!({"request_id": id})).await.json().await.unwrap();
    assert_eq!(
        polled["result"]["responses"][0]["result"]["response"],
        json!(expected(&llama, &body, Some("adapter-b"))),
        "{polled}"
    );

    // Deleting removes the record and the files; later requests are refused.
    let deleted = app
        .http
        .delete(app.url("/v1/adapters/alpha"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(deleted.status(), 200);
    let keys = app.bucket_keys().await;
    let alpha = a["id"].as_str().unwrap();
    assert!(!keys.iter().any(|k| k.contains(alpha)), "{keys:?}");
    assert_eq!(keys.iter().filter(|k| k.contains(&beta)).count(), 2, "{keys:?}");
    let refused = app
        .post(
            "/v1/batches",
            &json!({"model": MODEL, "requests": [{"body": {"prompt": "x", "adapter": "alpha"}}]}),
        )
        .await;
    assert_eq!(refused.status(), 404);
    let body: Value = refused.json().await.unwrap();
    assert_eq!(
        error_of(&body),
        ("adapter_not_found".into(), "requests[0].body.adapter".into())
    );
    app.stop().await;
}

/// A safetensors file holding `tensors`.
fn safetensors(tensors: &[(&str, Tensor)]) -> Vec<u8> {
    let dir = std::env::temp_dir().join(format!("lorry-adapter-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("adapter_model.safetensors");
    let map: HashMap<String, Tensor> = tensors.iter().map(|(k, t)| (k.to_string(), t.clone())).collect();
    candle_core::safetensors::save(&map, &path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    bytes
}

#[tokio::test]
async fn every_bad_upload_is_refused_by_code_and_leaves_nothing() {
    let app = spawn_app_with(lorry::Role::Serve, |s| s.adapters.max_bytes = 60_000).await;
    let config = file("adapter-b", "adapter_config.json");
    let weights = file("adapter-b", "adapter_model.safetensors");
    let hidden = 64;
    let key = |m: &str| format!("base_model.model.model.layers.0.self_attn.q_proj.lora_{m}.weight");
    let a = Tensor::zeros((4, hidden), candle_core::DType::F32, &Device::Cpu).unwrap();
    let b = Tensor::zeros((hidden, 4), candle_core::DType::F32, &Device::Cpu).unwrap();
    let edit = |f: &dyn Fn(&mut Value)| {
        let mut value: Value = serde_json::from_slice(&config).unwrap();
        f(&mut value);
        serde_json::to_vec(&value).unwrap()
    };
    let nan = Tensor::new(&[[f32::NAN; 64]; 4], &Device::Cpu).unwrap();
    let fields = [("model", MODEL), ("name", "bad")];
    type Case<'a> = (
        &'a str,
        Vec<(&'a str, &'a str)>,
        Vec<(&'a str, Vec<u8>)>,
        u16,
        &'a str,
        &'a str,
    );
    let cases: Vec<Case> = vec![
        (
            "config not JSON",
            fields.to_vec(),
            vec![("config", b"{".to_vec()), ("weights", weights.clone())],
            400,
            "adapter_config_invalid",
            "config",
        ),
        (
            "rank over the limit",
            fields.to_vec(),
            vec![("config", edit(&|c| c["r"] = json!(64))), ("weights", weights.clone())],
            400,
            "adapter_rank_too_large",
            "config",
        ),
        (
            "unknown target",
            fields.to_vec(),
            vec![
                ("config", edit(&|c| c["target_modules"] = json!(["q_proj", "lm_head"]))),
                ("weights", weights.clone()),
            ],
            400,
            "adapter_unknown_target",
            "config",
        ),
        (
            "DoRA",
            fields.to_vec(),
            vec![
                ("config", edit(&|c| c["use_dora"] = json!(true))),
                ("weights", weights.clone()),
            ],
            400,
            "adapter_unsupported",
            "config",
        ),
        (
            "weights not safetensors",
            fields.to_vec(),
            vec![("config", config.clone()), ("weights", b"not a tensor file".to_vec())],
            400,
            "adapter_weights_invalid",
            "weights",
        ),
        (
            "wrong shape",
            fields.to_vec(),
            vec![
                ("config", config.clone()),
                (
                    "weights",
                    safetensors(&[
                        (
                            &key("A"),
                            Tensor::zeros((4, 7), candle_core::DType::F32, &Device::Cpu).unwrap(),
                        ),
                        (&key("B"), b.clone()),
                    ]),
                ),
            ],
            400,
            "adapter_shape_mismatch",
            "weights",
        ),
        (
            "half a pair",
            fields.to_vec(),
            vec![
                ("config", config.clone()),
                ("weights", safetensors(&[(&key("A"), a.clone())])),
            ],
            400,
            "adapter_missing_tensor",
            "weights",
        ),
        (
            "NaN",
            fields.to_vec(),
            vec![
                ("config", config.clone()),
                (
                    "weights",
                    safetensors(&[(&key("A"), nan.clone()), (&key("B"), b.clone())]),
                ),
            ],
            400,
            "adapter_nonfinite",
            "weights",
        ),
        (
            "too large",
            fields.to_vec(),
            vec![
                ("config", file("adapter-a", "adapter_config.json")),
                ("weights", file("adapter-a", "adapter_model.safetensors")),
            ],
            413,
            "adapter_too_large",
            "weights",
        ),
        (
            "no weights",
            fields.to_vec(),
            vec![("config", config.clone())],
            400,
            "adapter_missing_file",
            "weights",
        ),
        (
            "no model",
            vec![("name", "bad")],
            vec![("config", config.clone()), ("weights", weights.clone())],
            400,
            "missing_field",
            "model",
        ),
        (
            "unknown model",
            vec![("model", "@lorry/nope"), ("name", "bad")],
            vec![("config", config.clone()), ("weights", weights.clone())],
            404,
            "model_not_found",
            "model",
        ),
        (
            "embedding model",
            vec![("model", "@lorry/demo-bge"), ("name", "bad")],
            vec![("config", config.clone()), ("weights", weights.clone())],
            400,
            "adapters_not_supported",
            "model",
        ),
        (
            "bad name",
            vec![("model", MODEL), ("name", "no spaces")],
            vec![("config", config.clone()), ("weights", weights.clone())],
            400,
            "invalid_adapter_name",
            "name",
        ),
    ];
    for (what, fields, files, status, code, param) in cases {
        let (got, body) = upload(&app, TOKEN, &fields, files).await;
        assert_eq!(got, status, "{what}: {body}");
        assert_eq!(error_of(&body), (code.to_string(), param.to_string()), "{what}: {body}");
    }
    assert_eq!(app.get_json("/v1/adapters").await["data"], json!([]));
    assert!(app.bucket_keys().await.is_empty(), "a refused upload left files");

    // A name is taken once per account.
    let (status, _) = upload(
        &app,
        TOKEN,
        &fields,
        vec![("config", config.clone()), ("weights", weights.clone())],
    )
    .await;
    assert_eq!(status, 201);
    let (status, body) = upload(
        &app,
        TOKEN,
        &fields,
        vec![("config", config.clone()), ("weights", weights.clone())],
    )
    .await;
    assert_eq!(
        (status, error_of(&body)),
        (409, ("adapter_name_taken".into(), "name".into()))
    );

    // Workers AI assets: each file is checked alone, then the pair.
    let created: Value = app
        .post(FINETUNES, &json!({"model": MODEL, "name": "ft"}))
        .await
        .json()
        .await
        .unwrap();
    let ft = created["result"]["id"].as_str().unwrap().to_string();
    let (status, body) = upload_asset(&app, &ft, "model.bin", weights.clone()).await;
    assert_eq!(
        (status, error_of(&body)),
        (400, ("invalid_file_name".into(), "file_name".into()))
    );
    let nan_file = safetensors(&[(&key("A"), nan), (&key("B"), b.clone())]);
    let (status, body) = upload_asset(&app, &ft, "adapter_model.safetensors", nan_file).await;
    assert_eq!(
        (status, error_of(&body)),
        (400, ("adapter_nonfinite".into(), "file".into()))
    );
    let (status, _) = upload_asset(&app, &ft, "adapter_config.json", config.clone()).await;
    assert_eq!(status, 200);
    // Well-formed alone, but rank 4 where the configuration says 8 and a layer the base lacks.
    let far = "base_model.model.model.layers.99.self_attn.q_proj.lora_A.weight";
    let (status, body) = upload_asset(&app, &ft, "adapter_model.safetensors", safetensors(&[(far, a.clone())])).await;
    assert_eq!(
        (status, error_of(&body)),
        (400, ("adapter_shape_mismatch".into(), "file".into()))
    );
    let (status, body) = upload_asset(&app, &ft, "adapter_config.json", b"[]".to_vec()).await;
    assert_eq!(
        (status, error_of(&body)),
        (400, ("adapter_config_invalid".into(), "file".into()))
    );
    let listed = app.get_json(FINETUNES).await;
    let ft_now = listed["result"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["id"] == json!(ft))
        .unwrap()
        .clone();
    assert_eq!(ft_now["status"], "pending", "{listed}");
    // The finetune holds its one good file; the refused ones left nothing.
    let keys = app.bucket_keys().await;
    assert_eq!(keys.iter().filter(|k| k.contains(&ft)).count(), 1, "{keys:?}");
    let (status, body) = upload(
        &app,
        TOKEN,
        &[("model", MODEL), ("name", "ft")],
        vec![("config", config), ("weights", weights)],
    )
    .await;
    assert_eq!((status, error_of(&body).0.as_str()), (409, "adapter_name_taken"));
    let refused = app.post(RUN, &json!({"prompt": "x", "lora": ft})).await;
    assert_eq!(refused.status(), 409);
    app.stop().await;
}

#[tokio::test]
async fn another_account_can_neither_see_nor_use_an_adapter() {
    let app = spawn_app().await;
    let (status, mine) = upload_reference(&app, "private", "adapter-b").await;
    assert_eq!(status, 201, "{mine}");
    let id = mine["id"].as_str().unwrap();
    app.store.ensure_account("other", "other-token").await.unwrap();
    let as_other =
        |method: reqwest::Method, path: &str| app.http.request(method, app.url(path)).bearer_auth("other-token");
    for reference in [id, "private"] {
        let shown = as_other(reqwest::Method::GET, &format!("/v1/adapters/{reference}"))
            .send()
            .await
            .unwrap();
        assert_eq!(shown.status(), 404, "{reference}");
        let deleted = as_other(reqwest::Method::DELETE, &format!("/v1/adapters/{reference}"))
            .send()
            .await
            .unwrap();
        assert_eq!(deleted.status(), 404, "{reference}");
        let batch = as_other(reqwest::Method::POST, "/v1/batches")
            .json(&json!({"model": MODEL, "requests": [{"body": {"prompt": "x", "adapter": reference}}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(batch.status(), 404, "{reference}");
        let body: Value = batch.json().await.unwrap();
        assert_eq!(
            error_of(&body),
            ("adapter_not_found".into(), "requests[0].body.adapter".into())
        );
        let run = as_other(
            reqwest::Method::POST,
            "/client/v4/accounts/other/ai/run/@lorry/demo-llama",
        )
        .json(&json!({"prompt": "x", "lora": reference}))
        .send()
        .await
        .unwrap();
        assert_eq!(run.status(), 404, "{reference}");
        let assets = as_other(
            reqwest::Method::POST,
            &format!("/client/v4/accounts/other/ai/finetunes/{reference}/finetune-assets"),
        )
        .multipart(
            Form::new()
                .text("file_name", "adapter_config.json")
                .part("file", part(b"{}".to_vec(), "adapter_config.json")),
        )
        .send()
        .await
        .unwrap();
        assert_eq!(assets.status(), 404, "{reference}");
    }
    let listed: Value = as_other(reqwest::Method::GET, "/v1/adapters")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(listed["data"], json!([]));
    let finetunes: Value = as_other(reqwest::Method::GET, "/client/v4/accounts/other/ai/finetunes")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(finetunes["result"], json!([]));
    // The owner's model list holds it as OpenAI lists fine-tuned models; the other's does not.
    let listed_as = format!("{MODEL}:private");
    let models = app.get_json("/v1/models").await;
    let entry = crate::common::listed_model(&models, &listed_as);
    assert_eq!(
        (&entry["owned_by"], &entry["parent"], &entry["adapter"]),
        (&json!("default"), &json!(MODEL), &json!(id))
    );
    assert_eq!(app.get_json(&format!("/v1/models/{listed_as}")).await, entry);
    let (_, theirs) = app.get_json_as("other-token", "/v1/models").await;
    assert!(
        theirs["data"].as_array().unwrap().iter().all(|m| m["parent"].is_null()),
        "{theirs}"
    );
    let (shown, _) = app.get_json_as("other-token", &format!("/v1/models/{listed_as}")).await;
    assert_eq!(shown, 404);
    // Another account's path is not this account's.
    let foreign = as_other(reqwest::Method::GET, FINETUNES).send().await.unwrap();
    assert_eq!(foreign.status(), 404);
    // Names are per account: the other account may use the same one.
    let (status, theirs) = upload(
        &app,
        "other-token",
        &[("model", MODEL), ("name", "private")],
        vec![
            ("config", file("adapter-a", "adapter_config.json")),
            ("weights", file("adapter-a", "adapter_model.safetensors")),
        ],
    )
    .await;
    assert_eq!(status, 201, "{theirs}");
    assert_ne!(theirs["id"], mine["id"]);
    // Each account's name still means its own adapter.
    assert_eq!(app.get_json("/v1/adapters/private").await["id"], mine["id"]);
    app.stop().await;
}

#[tokio::test]
async fn an_adapter_deleted_after_its_requests_were_accepted_ends_each_with_one_error() {
    // No worker yet: the batch waits in the queue while its adapter is deleted.
    let app = spawn_app_with(lorry::Role::Api, |_| {}).await;
    let (status, adapter) = upload_reference(&app, "short-lived", "adapter-b").await;
    assert_eq!(status, 201, "{adapter}");
    let body = |adapter: Option<&str>| {
        let mut body = json!({"prompt": "x", "raw": true, "max_tokens": 4});
        if let Some(name) = adapter {
            body["adapter"] = json!(name);
        }
        json!({"body": body})
    };
    let requests = [body(Some("short-lived")), body(None), body(Some("short-lived"))];
    let response = app
        .post("/v1/batches", &json!({"model": MODEL, "requests": requests}))
        .await;
    assert_eq!(response.status(), 202);
    let batch: Value = response.json().await.unwrap();
    let deleted = app
        .http
        .delete(app.url("/v1/adapters/short-lived"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(deleted.status(), 200);

    let worker = crate::common::start(app.settings.clone(), lorry::Role::Worker).await;
    let done = app
        .wait_until_ended(batch["id"].as_str().unwrap(), Duration::from_secs(60))
        .await;
    assert_eq!(done["request_counts"]["succeeded"], 1, "{done}");
    assert_eq!(done["request_counts"]["errored"], 2, "{done}");
    let errors = app.fetch_jsonl(done["errors_url"].as_str().unwrap()).await;
    let failed: Vec<(i64, &str)> = errors
        .iter()
        .map(|l| (l["index"].as_i64().unwrap(), l["error"]["code"].as_str().unwrap()))
        .collect();
    assert_eq!(failed, [(0, "adapter_not_found"), (2, "adapter_not_found")]);
    worker.stop().await;
    app.stop().await;
}
