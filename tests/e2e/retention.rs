//! Retention: `DELETE /v1/batches/{id}` for an ended batch, files that expire
//! (`expires_after`, a batch's `output_expires_after`), and the sweeper's
//! purge of what expired and of what is older than `LORRY_RETENTION_DAYS`.

use std::time::Duration;

use lorry_batcher::finaliser::{Finaliser, FinaliserConfig};
use lorry_batcher::objects::ObjectStore;
use serde_json::{json, Value};

use crate::common::{spawn_app_with, TestApp, TOKEN};

async fn upload(app: &TestApp, fields: &[(&str, &str)], body: Vec<u8>) -> (u16, Value) {
    let response = app.upload_file(TOKEN, fields, body).await;
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

fn lines(n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| {
            format!(
                "{}\n",
                json!({"custom_id": format!("r{i}"), "method": "POST", "url": "/v1/completions",
                       "body": {"model": "@lorry/echo", "prompt": format!("line {i}")}})
            )
        })
        .collect::<String>()
        .into_bytes()
}

fn finaliser(app: &TestApp, retention: Option<Duration>) -> Finaliser {
    Finaliser::new(
        app.store.clone(),
        ObjectStore::new(&app.settings.object_store()),
        app.settings.topology(),
        FinaliserConfig {
            stale_after: Duration::from_secs(60),
            progress_every: Duration::from_secs(3600),
            retention,
        },
    )
}

async fn delete(app: &TestApp, path: &str) -> (u16, Value) {
    let response = app.http.delete(app.url(path)).bearer_auth(TOKEN).send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

#[tokio::test]
async fn an_ended_batch_is_deleted_with_its_files_and_what_expired_is_purged() {
    let app = spawn_app_with(lorry::Role::Serve, |s| s.worker.echo_delay_ms = 1).await;

    // expires_after on an upload: both parts, in OpenAI's range.
    let (status, file) = upload(
        &app,
        &[
            ("expires_after[anchor]", "created_at"),
            ("expires_after[seconds]", "3600"),
        ],
        lines(3),
    )
    .await;
    assert_eq!(status, 200, "{file}");
    assert_eq!(
        file["expires_at"].as_i64(),
        Some(file["created_at"].as_i64().unwrap() + 3600)
    );
    for (fields, param) in [
        (
            &[
                ("expires_after[anchor]", "created_at"),
                ("expires_after[seconds]", "60"),
            ][..],
            "expires_after.seconds",
        ),
        (
            &[
                ("expires_after[anchor]", "last_active_at"),
                ("expires_after[seconds]", "3600"),
            ][..],
            "expires_after.anchor",
        ),
        (&[("expires_after[seconds]", "3600")][..], "expires_after.anchor"),
    ] {
        let (status, body) = upload(&app, fields, lines(1)).await;
        assert_eq!((status, body["error"]["param"].as_str()), (400, Some(param)), "{body}");
    }

    // A batch from it whose output files expire after an hour.
    let response = app
        .post(
            "/v1/batches",
            &json!({"input_file_id": file["id"], "endpoint": "/v1/completions", "completion_window": "24h",
                    "output_expires_after": {"anchor": "created_at", "seconds": 7200}}),
        )
        .await;
    assert_eq!(response.status(), 202, "{}", response.text().await.unwrap());
    let from_file: Value = response.json().await.unwrap();
    let from_file_id = from_file["id"].as_str().unwrap().to_string();
    let ended = app.wait_until_ended(&from_file_id, Duration::from_secs(60)).await;
    let output_id = ended["output_file_id"].as_str().unwrap().to_string();
    let output = app.get_json(&format!("/v1/files/{output_id}")).await;
    let lifetime = output["expires_at"].as_i64().unwrap() - output["created_at"].as_i64().unwrap();
    assert!((7199..=7201).contains(&lifetime), "{output}");
    let response = app
        .post(
            "/v1/batches",
            &json!({"input_file_id": file["id"], "endpoint": "/v1/completions", "completion_window": "24h",
                    "output_expires_after": {"anchor": "created_at", "seconds": 10}}),
        )
        .await;
    assert_eq!(response.status(), 400);

    // A running batch cannot be deleted; once ended it goes, objects and all.
    let running = app.submit_echo(2000, json!({})).await;
    let running_id = running["id"].as_str().unwrap().to_string();
    let (status, body) = delete(&app, &format!("/v1/batches/{running_id}")).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (409, Some("batch_not_ended")),
        "{body}"
    );
    app.post(&format!("/v1/batches/{running_id}/cancel"), &json!({})).await;
    app.wait_until_ended(&running_id, Duration::from_secs(60)).await;
    let prefix = format!("accounts/default/batches/{from_file_id}/");
    assert!(app.bucket_keys().await.iter().any(|k| k.starts_with(&prefix)));
    let (status, body) = delete(&app, &format!("/v1/batches/{from_file_id}")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body, json!({"id": from_file_id, "object": "batch", "deleted": true}));
    assert_eq!(app.get(&format!("/v1/batches/{from_file_id}")).await.status(), 404);
    assert_eq!(
        app.get(&format!("/v1/files/{output_id}")).await.status(),
        404,
        "its output file went with it"
    );
    assert!(!app.bucket_keys().await.iter().any(|k| k.starts_with(&prefix)));
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM requests WHERE batch_id = $1")
        .bind(&from_file_id)
        .fetch_one(app.store.pool())
        .await
        .unwrap();
    assert_eq!(left, 0);
    let (status, _) = delete(&app, &format!("/v1/batches/{from_file_id}")).await;
    assert_eq!(status, 404, "deleting twice");
    assert_eq!(
        app.get_json(&format!("/v1/files/{}", file["id"].as_str().unwrap()))
            .await["id"],
        file["id"],
        "the input file is the client's own"
    );

    // An expired file is purged, record and bytes; nothing else is, without a retention period.
    let (_, short) = upload(&app, &[], lines(1)).await;
    sqlx::query("UPDATE files SET expires_at = now() - interval '1 second' WHERE id = $1")
        .bind(short["id"].as_str().unwrap())
        .execute(app.store.pool())
        .await
        .unwrap();
    let objects = app.bucket_keys().await.len();
    // (The deployment's own sweeper may get to it first: what counts is that it is gone.)
    let (_, batches) = finaliser(&app, None).purge().await.unwrap();
    assert_eq!(batches, 0, "no retention period: no batch is purged");
    assert_eq!(
        app.get(&format!("/v1/files/{}", short["id"].as_str().unwrap()))
            .await
            .status(),
        404
    );
    assert_eq!(app.bucket_keys().await.len(), objects - 1);

    // A retention period of zero: every ended batch and every upload goes.
    let (files, batches) = finaliser(&app, Some(Duration::ZERO)).purge().await.unwrap();
    assert_eq!((files, batches), (1, 1), "the input file, and the cancelled batch");
    assert_eq!(app.get(&format!("/v1/batches/{running_id}")).await.status(), 404);
    let keys = app.bucket_keys().await;
    assert!(keys.is_empty(), "{keys:?}");
    app.stop().await;
}
