//! The OpenAPI document at `/openapi.json`: every route it lists is served,
//! and `schemathesis` run against a live deployment for a bounded time finds
//! no 5xx and no answer outside the document (status, content type, shape).
//! `scripts/test` installs schemathesis in a virtual environment and names
//! it in `LORRY_TEST_SCHEMATHESIS`.

use std::time::Duration;

use lorry::Role;
use serde_json::Value;

use crate::common::{spawn_app, spawn_app_with, TOKEN};

const METHODS: [&str; 5] = ["get", "put", "post", "delete", "patch"];

#[tokio::test]
async fn every_documented_route_is_served_with_its_errors_and_security() {
    // With the admin token set, so that the operator's routes are served and documented too.
    let app = spawn_app_with(Role::Serve, |s| s.api.admin_token = Some("operator".parse().unwrap())).await;
    let response = app.http.get(app.url("/openapi.json")).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "application/json");
    let doc: Value = response.json().await.unwrap();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."), "{}", doc["openapi"]);
    let paths = doc["paths"].as_object().unwrap();
    // The routes docs/API.md names, each listed.
    for path in [
        "/v1/batches",
        "/v1/batches/{id}/results",
        "/client/v4/accounts/{account_id}/ai/run/{model}",
        "/client/v4/accounts/{account_id}/ai/finetunes/{finetune_id}/finetune-assets",
        "/v1/chat/completions",
        "/v1/embeddings",
        "/v1/files/{id}/content",
        "/v1/adapters/{adapter}",
        "/v1/models/{model}",
        "/v1/account/webhook_secret/rotate",
        "/v1/usage",
        "/admin/v1/accounts/{account_id}/keys/{key_id}",
        "/readyz",
        "/metrics",
        "/openapi.json",
    ] {
        assert!(paths.contains_key(path), "{path} is missing from the document");
    }
    let codes: Vec<&str> = doc["components"]["schemas"]["ErrorCode"]["enum"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect();
    assert_eq!(codes.len(), lorry_protocol::ErrorCode::ALL.len());
    let mut operations = 0;
    for (path, item) in paths {
        for method in METHODS {
            let Some(operation) = item.get(method) else { continue };
            operations += 1;
            let open = ["/healthz", "/readyz", "/metrics", "/openapi.json"].contains(&path.as_str());
            assert_eq!(operation["security"].is_array(), !open, "{method} {path}");
            if !open {
                let scheme = if path.starts_with("/admin/") { "admin" } else { "bearer" };
                assert!(operation["security"][0].get(scheme).is_some(), "{method} {path}");
            }
            // Every operation documents the statuses its faults give, in its own shape.
            let responses = operation["responses"].as_object().unwrap();
            let error = if path.starts_with("/client/v4/") {
                "CloudflareError"
            } else {
                "ErrorBody"
            };
            for status in if open {
                &["400", "405"][..]
            } else {
                &["400", "401", "404", "413", "503"][..]
            } {
                let schema = &responses
                    .get(*status)
                    .unwrap_or_else(|| panic!("{method} {path} does not document {status}"))["content"]
                    ["application/json"]["schema"]["$ref"];
                assert_eq!(
                    schema,
                    &format!("#/components/schemas/{error}"),
                    "{method} {path} {status}"
                );
            }
            // The route is served under this method: without a token it
            // answers 401 (or, open, anything but "no such route").
            let url = app.url(
                &path
                    .replace("{account_id}", "default")
                    .replace('{', "x")
                    .replace('}', ""),
            );
            let sent = app
                .http
                .request(method.to_uppercase().parse().unwrap(), url)
                .send()
                .await
                .unwrap();
            let status = sent.status().as_u16();
            let body: Value = sent.json().await.unwrap_or(Value::Null);
            if open {
                assert!(matches!(status, 200 | 503), "{method} {path}: {status} {body}");
            } else {
                assert_eq!(status, 401, "{method} {path}: {body}");
                assert_eq!(body["error"]["code"], "invalid_token", "{method} {path}: {body}");
                // The Workers AI routes answer even the token's refusal in Cloudflare's envelope.
                assert_eq!(
                    body["success"],
                    if path.starts_with("/client/v4/") {
                        Value::Bool(false)
                    } else {
                        Value::Null
                    },
                    "{method} {path}: {body}"
                );
            }
        }
    }
    // 31 for clients and monitoring, 10 for the operator.
    assert_eq!(operations, 41, "every route of docs/API.md, once");
    app.stop().await;
}

#[tokio::test]
async fn schemathesis_finds_no_server_error_and_no_answer_outside_the_document() {
    let schemathesis = std::env::var("LORRY_TEST_SCHEMATHESIS").expect(
        "LORRY_TEST_SCHEMATHESIS names schemathesis's `st`; run the suite with scripts/test, which installs it",
    );
    let seconds: u64 = std::env::var("LORRY_TEST_SCHEMATHESIS_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(120);
    // A seed per run, printed, so that a failure can be replayed.
    let seed = std::env::var("LORRY_TEST_SCHEMATHESIS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| u64::from(std::process::id()) * 7919 % 1_000_003);
    eprintln!("schemathesis seed {seed} ({seconds} s)");
    let app = spawn_app().await;
    let batch = app.submit_echo(3, serde_json::json!({})).await;
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/schemathesis/schemathesis.toml");
    let report = tempdir();
    let run = tokio::process::Command::new(schemathesis)
        .arg("--config-file")
        .arg(config)
        .arg("run")
        .arg(app.url("/openapi.json"))
        .args(["--max-time", &seconds.to_string(), "--seed", &seed.to_string()])
        .args([
            "--checks",
            "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance",
            "--no-color",
            "--report",
            "junit",
            "--report-dir",
        ])
        .arg(&report)
        .env("LORRY_BASE_URL", &app.address)
        .env("LORRY_TOKEN", TOKEN)
        .env("LORRY_SCHEMATHESIS_BATCH", batch["id"].as_str().unwrap())
        // Its own cache lands in the run's directory, not the checkout.
        .current_dir(&report)
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(seconds + 240), run)
        .await
        .expect("schemathesis ended")
        .expect("schemathesis started");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "schemathesis found failures (seed {seed}):\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    // It ran every operation, not an empty document.
    let tested: usize = stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("Tested: "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no count of operations tested:\n{stdout}"));
    assert!(tested >= 27, "only {tested} operations tested:\n{stdout}");
    // What it covered, for the record (`--no-capture` shows it).
    let summary: Vec<&str> = stdout.lines().skip_while(|l| !l.contains("SUMMARY")).collect();
    eprintln!("{}", summary.join("\n"));
    let _ = std::fs::remove_dir_all(&report);
    app.stop().await;
}

fn tempdir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("lorry-schemathesis-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
