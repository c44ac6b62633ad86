//! Router tests: the API in-process through `oneshot`, on a fresh database per
//! test. Every class of bad input gets a 4xx naming the field, and nothing is
//! persisted.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use lorry_api::{router, ApiConfig, AppState};
use lorry_batcher::broker::Topology;
use lorry_batcher::objects::{ObjectStore, ObjectStoreConfig};
use lorry_batcher::realtime::RealtimeClient;
use lorry_batcher::store::Store;
use lorry_protocol::Catalog;
use serde_json::{json, Value};
use sqlx::PgPool;
use tower::ServiceExt;

const TOKEN: &str = "router-token";
const OTHER_TOKEN: &str = "other-token";

async fn state(pool: PgPool) -> AppState {
    let store = Store::from_pool(pool);
    store.ensure_account("default", TOKEN).await.unwrap();
    store.ensure_account("other", OTHER_TOKEN).await.unwrap();
    let objects = ObjectStore::new(&ObjectStoreConfig {
        endpoint: Some("http://127.0.0.1:9".into()),
        bucket: "unused".into(),
        region: "us-east-1".into(),
        access_key: "k".into(),
        secret_key: "s".into(),
    });
    let topology = Topology::new("lorry-router-test", 5);
    AppState::new(
        store,
        objects,
        RealtimeClient::new("amqp://127.0.0.1:9", topology.clone(), vec![], 64),
        Arc::new(Catalog::builtin()),
        Arc::new(ApiConfig {
            topology,
            chunk_size: 64,
            max_requests: 50_000,
            max_body_bytes: 10 * 1024 * 1024,
            max_file_bytes: 1 << 20,
            allow_private_webhooks: false,
            realtime_timeout: Duration::from_secs(5),
            output_url_ttl: Duration::from_secs(60),
            adapter_limits: lorry_protocol::lora::AdapterLimits::default(),
            body_pace: lorry_api::guard::BodyPace {
                grace: Duration::from_secs(10),
                min_bytes_per_sec: 1024,
            },
            max_uploads: 2,
            admin_token_digest: None,
            quotas: lorry_batcher::quota::Limits::NONE,
        }),
    )
}

async fn call(state: &AppState, method: &str, uri: &str, token: Option<&str>, body: Vec<u8>) -> (StatusCode, Value) {
    let mut request = Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", "application/json");
    if let Some(token) = token {
        request = request.header("authorization", format!("Bearer {token}"));
    }
    let response = router(state.clone())
        .oneshot(request.body(Body::from(body)).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

fn batch(requests: Value) -> Value {
    json!({"model": "@lorry/echo", "requests": requests})
}

fn with(mut base: Value, key: &str, value: Value) -> Value {
    base[key] = value;
    base
}

async fn persisted(pool: &PgPool) -> (i64, i64, i64) {
    let count = |table: &'static str| async move {
        sqlx::query_scalar::<_, i64>(&format!("SELECT count(*) FROM {table}"))
            .fetch_one(pool)
            .await
            .unwrap()
    };
    (count("batches").await, count("requests").await, count("outbox").await)
}

#[sqlx::test(migrator = "lorry_batcher::MIGRATOR")]
async fn every_class_of_bad_input_is_refused_with_its_code_and_field_and_nothing_is_persisted(pool: PgPool) {
    let state = state(pool.clone()).await;
    let one = json!([{"body": {"prompt": "x"}}]);
    let too_many: Vec<Value> = (0..50_001).map(|_| json!({"body": {"prompt": "x"}})).collect();
    let mut huge = b"{\"model\":\"@lorry/echo\",\"requests\":[{\"body\":{\"prompt\":\"".to_vec();
    huge.extend(std::iter::repeat_n(b'a', 10 * 1024 * 1024));
    huge.extend(b"\"}}]}");
    let json_body = |v: Value| serde_json::to_vec(&v).unwrap();
    let cases: Vec<(&str, Vec<u8>, StatusCode, &str, &str)> = vec![
        (
            "malformed JSON",
            b"{\"model\": ".to_vec(),
            StatusCode::BAD_REQUEST,
            "invalid_json",
            "",
        ),
        (
            "body not an object",
            b"[1]".to_vec(),
            StatusCode::BAD_REQUEST,
            "invalid_type",
            "",
        ),
        (
            "model of the wrong type",
            json_body(json!({"model": 5, "requests": one})),
            StatusCode::BAD_REQUEST,
            "invalid_type",
            "model",
        ),
        (
            "unknown top-level field",
            json_body(with(batch(one.clone()), "colour", json!("red"))),
            StatusCode::BAD_REQUEST,
            "unknown_field",
            "colour",
        ),
        (
            "unknown field in an item",
            json_body(batch(json!([{"body": {"prompt": "x"}, "url": "/v1"}]))),
            StatusCode::BAD_REQUEST,
            "unknown_field",
            "requests[0].url",
        ),
        (
            "unknown field in a model input",
            json_body(batch(json!([{"body": {"prompt": "x", "bogus": 1}}]))),
            StatusCode::BAD_REQUEST,
            "unknown_field",
            "requests[0].body.bogus",
        ),
        (
            "wrong type in a model input",
            json_body(batch(json!([{"body": {"prompt": "x"}}, {"body": {"prompt": ["x"]}}]))),
            StatusCode::BAD_REQUEST,
            "invalid_type",
            "requests[1].body.prompt",
        ),
        (
            "out-of-range sampling",
            json_body(batch(json!([{"body": {"prompt": "x", "temperature": 7}}]))),
            StatusCode::BAD_REQUEST,
            "out_of_range",
            "requests[0].body.temperature",
        ),
        (
            "a message with a bad role",
            json_body(batch(
                json!([{"body": {"messages": [{"role": "robot", "content": "x"}]}}]),
            )),
            StatusCode::BAD_REQUEST,
            "invalid_value",
            "requests[0].body.messages[0].role",
        ),
        (
            "an item without a body",
            json_body(batch(json!([{"custom_id": "a"}]))),
            StatusCode::BAD_REQUEST,
            "missing_field",
            "requests[0].body",
        ),
        (
            "no requests field",
            json_body(json!({"model": "@lorry/echo"})),
            StatusCode::BAD_REQUEST,
            "missing_field",
            "requests",
        ),
        (
            "requests not an array",
            json_body(batch(json!({"a": 1}))),
            StatusCode::BAD_REQUEST,
            "invalid_type",
            "requests",
        ),
        (
            "zero requests",
            json_body(batch(json!([]))),
            StatusCode::BAD_REQUEST,
            "empty_batch",
            "requests",
        ),
        (
            "more than 50,000 requests",
            json_body(batch(Value::Array(too_many))),
            StatusCode::BAD_REQUEST,
            "too_many_requests",
            "requests",
        ),
        (
            "body over the limit",
            huge,
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            "",
        ),
        (
            "unknown model",
            json_body(json!({"model": "@cf/nope", "requests": one})),
            StatusCode::NOT_FOUND,
            "model_not_found",
            "model",
        ),
        (
            "duplicate custom_id",
            json_body(batch(
                json!([{"custom_id": "a", "body": {"prompt": "x"}}, {"custom_id": "a", "body": {"prompt": "y"}}]),
            )),
            StatusCode::BAD_REQUEST,
            "duplicate_custom_id",
            "requests[1].custom_id",
        ),
        (
            "invalid webhook URL",
            json_body(with(batch(one.clone()), "webhook", json!({"url": "not a url"}))),
            StatusCode::BAD_REQUEST,
            "invalid_webhook_url",
            "webhook.url",
        ),
        (
            "private webhook URL",
            json_body(with(
                batch(one.clone()),
                "webhook",
                json!({"url": "http://127.0.0.1:8080/hook"}),
            )),
            StatusCode::BAD_REQUEST,
            "webhook_url_not_allowed",
            "webhook.url",
        ),
        (
            "unknown webhook field",
            json_body(with(
                batch(one.clone()),
                "webhook",
                json!({"url": "https://example.com", "secret": "x"}),
            )),
            StatusCode::BAD_REQUEST,
            "unknown_field",
            "webhook.secret",
        ),
        (
            "bad completion window",
            json_body(with(batch(one.clone()), "completion_window", json!("forever"))),
            StatusCode::BAD_REQUEST,
            "invalid_completion_window",
            "completion_window",
        ),
        (
            "priority out of range",
            json_body(with(batch(one.clone()), "priority", json!(11))),
            StatusCode::BAD_REQUEST,
            "out_of_range",
            "priority",
        ),
        (
            "priority not an integer",
            json_body(with(batch(one.clone()), "priority", json!("high"))),
            StatusCode::BAD_REQUEST,
            "invalid_type",
            "priority",
        ),
        (
            "unknown service tier",
            json_body(with(batch(one.clone()), "service_tier", json!("scale"))),
            StatusCode::BAD_REQUEST,
            "invalid_value",
            "service_tier",
        ),
        (
            "service tier not a string",
            json_body(with(batch(one.clone()), "service_tier", json!(5))),
            StatusCode::BAD_REQUEST,
            "invalid_type",
            "service_tier",
        ),
        (
            "priority and service tier both",
            json_body(with(
                with(batch(one.clone()), "priority", json!(1)),
                "service_tier",
                json!("flex"),
            )),
            StatusCode::BAD_REQUEST,
            "conflicting_fields",
            "service_tier",
        ),
        (
            "bad metadata",
            json_body(with(batch(one.clone()), "metadata", json!({"n": 1}))),
            StatusCode::BAD_REQUEST,
            "invalid_metadata",
            "metadata",
        ),
        (
            "file-based batch naming no file of the account",
            json_body(
                json!({"input_file_id": "file_1", "endpoint": "/v1/chat/completions", "completion_window": "24h"}),
            ),
            StatusCode::NOT_FOUND,
            "file_not_found",
            "input_file_id",
        ),
        (
            "file-based batch with an unknown endpoint",
            json_body(json!({"input_file_id": "file_1", "endpoint": "/v1/images", "completion_window": "24h"})),
            StatusCode::BAD_REQUEST,
            "invalid_value",
            "endpoint",
        ),
    ];
    for (name, body, status, code, param) in cases {
        let (got, error) = call(&state, "POST", "/v1/batches", Some(TOKEN), body).await;
        assert_eq!(got, status, "{name}: {error}");
        assert_eq!(error["error"]["code"], code, "{name}: {error}");
        let param = if param.is_empty() { Value::Null } else { json!(param) };
        assert_eq!(error["error"]["param"], param, "{name}: {error}");
        assert!(
            error["error"]["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{name}"
        );
    }
    assert_eq!(
        persisted(&pool).await,
        (0, 0, 0),
        "a refused batch leaves nothing behind"
    );
}

#[sqlx::test(migrator = "lorry_batcher::MIGRATOR")]
async fn requests_without_a_valid_token_are_unauthorised(pool: PgPool) {
    let state = state(pool.clone()).await;
    let body = serde_json::to_vec(&batch(json!([{"body": {"prompt": "x"}}]))).unwrap();
    let (status, error) = call(&state, "POST", "/v1/batches", None, body.clone()).await;
    assert_eq!(
        (status, error["error"]["code"].as_str()),
        (StatusCode::UNAUTHORIZED, Some("invalid_token"))
    );
    let (status, _) = call(&state, "POST", "/v1/batches", Some("wrong"), body).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _) = call(&state, "GET", "/v1/account", None, vec![]).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(persisted(&pool).await, (0, 0, 0));
    // Without LORRY_ADMIN_TOKEN there is no admin surface at all.
    for token in [None, Some(TOKEN)] {
        let (status, error) = call(&state, "GET", "/admin/v1/accounts", token, vec![]).await;
        assert_eq!(
            (status, error["error"]["code"].as_str()),
            (StatusCode::NOT_FOUND, Some("route_not_found"))
        );
    }
}

#[sqlx::test(migrator = "lorry_batcher::MIGRATOR")]
async fn a_revoked_key_or_a_disabled_account_is_refused_from_the_commit_on(pool: PgPool) {
    use lorry_batcher::ids::AccountId;
    let state = state(pool.clone()).await;
    let acme = AccountId::parse_name("acme").unwrap();
    let (account, first) = state.store.create_account(&acme, "default").await.unwrap().unwrap();
    assert_eq!(account.status(), "active");
    assert!(
        state.store.create_account(&acme, "again").await.unwrap().is_none(),
        "names are unique"
    );
    let second = state.store.create_key(&acme, "second").await.unwrap().unwrap();
    for key in [&first.value, &second.value] {
        let (status, body) = call(&state, "GET", "/v1/account", Some(key), vec![]).await;
        assert_eq!((status, body["id"].as_str()), (StatusCode::OK, Some("acme")));
    }
    // Use is noted once a minute at most.
    let used: Option<chrono::DateTime<chrono::Utc>> =
        sqlx::query_scalar("SELECT last_used_at FROM api_keys WHERE id = $1")
            .bind(first.record.id.as_str())
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(used.is_some());
    call(&state, "GET", "/v1/account", Some(&first.value), vec![]).await;
    let again: Option<chrono::DateTime<chrono::Utc>> =
        sqlx::query_scalar("SELECT last_used_at FROM api_keys WHERE id = $1")
            .bind(first.record.id.as_str())
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(used, again);

    state.store.revoke_key(&acme, &second.record.id).await.unwrap().unwrap();
    let (status, _) = call(&state, "GET", "/v1/account", Some(&second.value), vec![]).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let other = AccountId("other".into());
    assert!(
        state
            .store
            .revoke_key(&other, &first.record.id)
            .await
            .unwrap()
            .is_none(),
        "another account's key cannot be revoked through it"
    );

    // A batch queued before the account is disabled is cancelled with it.
    let body = serde_json::to_vec(&batch(json!([{"body": {"prompt": "x"}}, {"body": {"prompt": "y"}}]))).unwrap();
    let (status, queued) = call(&state, "POST", "/v1/batches", Some(&first.value), body.clone()).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{queued}");
    let (status, theirs) = call(&state, "POST", "/v1/batches", Some(TOKEN), body).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    let disabled = state.store.disable_account(&acme).await.unwrap().unwrap();
    assert_eq!(disabled.account.status(), "disabled");
    assert_eq!(disabled.cancelled_batches.len(), 1);
    assert_eq!(disabled.cancelled_batches[0].as_str(), queued["id"].as_str().unwrap());
    let (status, _) = call(&state, "GET", "/v1/account", Some(&first.value), vec![]).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let statuses: Vec<(String, String)> =
        sqlx::query_as("SELECT b.status, r.status FROM batches b JOIN requests r ON r.batch_id = b.id WHERE b.id = $1")
            .bind(queued["id"].as_str().unwrap())
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(statuses.len(), 2);
    assert!(
        statuses.iter().all(|(b, r)| b == "cancelling" && r == "canceled"),
        "{statuses:?}"
    );
    let (_, still) = call(
        &state,
        "GET",
        &format!("/v1/batches/{}", theirs["id"].as_str().unwrap()),
        Some(TOKEN),
        vec![],
    )
    .await;
    assert_eq!(still["status"], "in_progress", "another account's batch runs on");
    let again = state.store.disable_account(&acme).await.unwrap().unwrap();
    assert_eq!(
        again.account.disabled_at, disabled.account.disabled_at,
        "disabling twice keeps the first time"
    );
    assert!(again.cancelled_batches.is_empty());

    state.store.enable_account(&acme).await.unwrap().unwrap();
    let (status, _) = call(&state, "GET", "/v1/account", Some(&first.value), vec![]).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = call(&state, "GET", "/v1/account", Some(&second.value), vec![]).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "a revoked key stays revoked");
}

#[sqlx::test(migrator = "lorry_batcher::MIGRATOR")]
async fn another_accounts_batch_is_not_found_and_cannot_be_cancelled(pool: PgPool) {
    let state = state(pool.clone()).await;
    let body = serde_json::to_vec(&batch(json!([{"body": {"prompt": "x"}}]))).unwrap();
    let (status, created) = call(&state, "POST", "/v1/batches", Some(TOKEN), body).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    let id = created["id"].as_str().unwrap();
    for (method, uri) in [
        ("GET", format!("/v1/batches/{id}")),
        ("GET", format!("/v1/batches/{id}/results")),
        ("POST", format!("/v1/batches/{id}/cancel")),
    ] {
        let (status, error) = call(&state, method, &uri, Some(OTHER_TOKEN), vec![]).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{method} {uri}");
        assert_eq!(error["error"]["code"], "batch_not_found");
    }
    let (_, listing) = call(&state, "GET", "/v1/batches", Some(OTHER_TOKEN), vec![]).await;
    assert_eq!(listing["data"], json!([]));
    let (status, _) = call(&state, "GET", &format!("/v1/batches/{id}"), Some(TOKEN), vec![]).await;
    assert_eq!(status, StatusCode::OK);
}

#[sqlx::test(migrator = "lorry_batcher::MIGRATOR")]
async fn unknown_ids_bad_cursors_and_ended_batches_are_refused(pool: PgPool) {
    let state = state(pool.clone()).await;
    for id in ["batch_0123456789abcdef0123456789abcdef", "nonsense"] {
        let (status, error) = call(&state, "GET", &format!("/v1/batches/{id}"), Some(TOKEN), vec![]).await;
        assert_eq!(
            (status, error["error"]["param"].as_str()),
            (StatusCode::NOT_FOUND, Some("id"))
        );
    }
    let (status, error) = call(&state, "GET", "/v1/batches?limit=0", Some(TOKEN), vec![]).await;
    assert_eq!(
        (status, error["error"]["param"].as_str()),
        (StatusCode::BAD_REQUEST, Some("limit"))
    );
    let (status, error) = call(&state, "GET", "/v1/batches?after=xyz", Some(TOKEN), vec![]).await;
    assert_eq!(
        (status, error["error"]["param"].as_str()),
        (StatusCode::BAD_REQUEST, Some("after"))
    );

    let body = serde_json::to_vec(&batch(json!([{"body": {"prompt": "x"}}]))).unwrap();
    let (_, created) = call(&state, "POST", "/v1/batches", Some(TOKEN), body).await;
    let id = created["id"].as_str().unwrap();
    sqlx::query("UPDATE batches SET status = 'completed' WHERE id = $1")
        .bind(id)
        .execute(&pool)
        .await
        .unwrap();
    let (status, error) = call(&state, "POST", &format!("/v1/batches/{id}/cancel"), Some(TOKEN), vec![]).await;
    assert_eq!(
        (status, error["error"]["code"].as_str()),
        (StatusCode::CONFLICT, Some("batch_not_cancellable"))
    );
}

#[sqlx::test(migrator = "lorry_batcher::MIGRATOR")]
async fn a_batch_is_written_with_one_outbox_message_per_chunk(pool: PgPool) {
    let state = state(pool.clone()).await;
    let requests: Vec<Value> = (0..130).map(|i| json!({"body": {"prompt": format!("p{i}")}})).collect();
    let body = serde_json::to_vec(&batch(Value::Array(requests))).unwrap();
    let (status, created) = call(&state, "POST", "/v1/batches", Some(TOKEN), body).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    assert_eq!(created["request_counts"]["pending"], 130);
    assert_eq!(persisted(&pool).await, (1, 130, 3));
    let ranges: Vec<(i32, i32)> =
        sqlx::query_as("SELECT (payload->>'start')::int, (payload->>'end')::int FROM outbox ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(ranges, vec![(0, 64), (64, 128), (128, 130)]);
}

#[sqlx::test(migrator = "lorry_batcher::MIGRATOR")]
async fn openai_service_tier_names_set_the_batch_priority(pool: PgPool) {
    let state = state(pool.clone()).await;
    let one = json!([{"body": {"prompt": "p"}}]);
    for (tier, priority) in [
        (None, 0),
        (Some("auto"), 0),
        (Some("default"), 0),
        (Some("flex"), -5),
        (Some("priority"), 5),
    ] {
        let mut body = batch(one.clone());
        if let Some(tier) = tier {
            body = with(body, "service_tier", json!(tier));
        }
        let (status, created) = call(
            &state,
            "POST",
            "/v1/batches",
            Some(TOKEN),
            serde_json::to_vec(&body).unwrap(),
        )
        .await;
        assert_eq!(status, StatusCode::ACCEPTED, "{tier:?}: {created}");
        assert_eq!(created["priority"], priority, "{tier:?}: {created}");
        let id = created["id"].as_str().unwrap();
        let stored: i16 = sqlx::query_scalar("SELECT priority FROM batches WHERE id = $1")
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(stored, priority, "{tier:?}");
    }
}

#[sqlx::test(migrator = "lorry_batcher::MIGRATOR")]
async fn every_answer_carries_a_request_id_of_its_own(pool: PgPool) {
    let state = state(pool).await;
    let long_query = format!("/v1/batches?{}", "a".repeat(9000));
    let cases: &[(&str, &str, Option<&str>, StatusCode)] = &[
        ("GET", "/healthz", None, StatusCode::OK),
        ("GET", "/v1/account", Some(TOKEN), StatusCode::OK),
        ("GET", "/v1/account", None, StatusCode::UNAUTHORIZED),
        ("GET", "/no/such/route", Some(TOKEN), StatusCode::NOT_FOUND),
        ("PATCH", "/v1/batches", Some(TOKEN), StatusCode::METHOD_NOT_ALLOWED),
        ("GET", &long_query, Some(TOKEN), StatusCode::URI_TOO_LONG),
        (
            "GET",
            "/client/v4/accounts/default/ai/finetunes",
            None,
            StatusCode::UNAUTHORIZED,
        ),
    ];
    let mut seen = std::collections::HashSet::new();
    for &(method, uri, token, want) in cases {
        let mut request = Request::builder()
            .method(method)
            .uri(uri)
            .header("x-request-id", "client-chosen");
        if let Some(token) = token {
            request = request.header("authorization", format!("Bearer {token}"));
        }
        let response = router(state.clone())
            .oneshot(request.body(Body::empty()).unwrap())
            .await
            .unwrap();
        assert_eq!(response.status(), want, "{method} {uri}");
        let id = response.headers()["x-request-id"].to_str().unwrap().to_string();
        assert!(
            id.len() == 36 && id.starts_with("req_") && id[4..].bytes().all(|b| b.is_ascii_hexdigit()),
            "{method} {uri}: {id}"
        );
        assert!(seen.insert(id), "one id per request");
    }
}

#[sqlx::test(migrator = "lorry_batcher::MIGRATOR")]
async fn a_final_conflict_tells_the_sdks_not_to_retry_it(pool: PgPool) {
    let state = state(pool).await;
    let body = serde_json::to_vec(&batch(json!([{"body": {"prompt": "x"}}]))).unwrap();
    let send = |body: Vec<u8>| {
        let request = Request::builder()
            .method("POST")
            .uri("/v1/batches")
            .header("content-type", "application/json")
            .header("authorization", format!("Bearer {TOKEN}"))
            .header("idempotency-key", "the-key")
            .body(Body::from(body))
            .unwrap();
        router(state.clone()).oneshot(request)
    };
    let first = send(body).await.unwrap();
    assert_eq!(first.status(), StatusCode::ACCEPTED);
    assert!(first.headers().get("x-should-retry").is_none());
    // The same key with another body: final.
    let other = serde_json::to_vec(&batch(json!([{"body": {"prompt": "y"}}]))).unwrap();
    let reused = send(other).await.unwrap();
    assert_eq!(reused.status(), StatusCode::CONFLICT);
    assert_eq!(reused.headers()["x-should-retry"], "false");
}
