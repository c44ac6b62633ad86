//! Accounts and API keys, made by the operator with the CLI (`lorry
//! accounts`, `lorry keys`) and the admin routes (`/admin/v1`): keys open
//! their account alone, revoked keys and disabled accounts are refused at
//! once, a disabled account's open batches are cancelled, and a deleted
//! account leaves nothing in the database or S3.

use std::time::Duration;

use lorry::Role;
use lorry_batcher::ids::AccountId;
use serde_json::{json, Value};

use crate::common::{eventually, spawn_app_with, TestApp, TOKEN};

const ADMIN: &str = "operator-secret";

async fn status_as(app: &TestApp, token: &str, path: &str) -> u16 {
    app.get_json_as(token, path).await.0
}

async fn admin(app: &TestApp, method: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
    admin_as(app, ADMIN, method, path, body).await
}

async fn admin_as(
    app: &TestApp,
    token: &str,
    method: reqwest::Method,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let mut request = app.http.request(method, app.url(path)).bearer_auth(token);
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
}

fn code(body: &Value) -> (&str, &str) {
    (
        body["error"]["code"].as_str().unwrap_or_default(),
        body["error"]["param"].as_str().unwrap_or_default(),
    )
}

/// The key a `create` command printed alone on its last line.
fn last_line(stdout: &str) -> String {
    stdout.lines().last().unwrap_or_default().trim().to_string()
}

async fn submit_as(app: &TestApp, token: &str, n: usize) -> Value {
    let requests: Vec<Value> = (0..n).map(|i| json!({"body": {"prompt": format!("p{i}")}})).collect();
    let response = app
        .http
        .post(app.url("/v1/batches"))
        .bearer_auth(token)
        .json(&json!({"model": "@lorry/echo", "requests": requests}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 202, "{}", response.text().await.unwrap());
    response.json().await.unwrap()
}

#[tokio::test]
async fn accounts_and_keys_made_with_the_cli_open_their_account_alone_until_revoked_or_disabled() {
    let app = spawn_app_with(Role::Serve, |_| {}).await;

    let (ok, stdout, stderr) = app.lorry(&["accounts", "create", "acme"]);
    assert!(ok, "accounts create: {stderr}");
    let first = last_line(&stdout);
    assert!(
        first.starts_with("lorry_sk_"),
        "the key alone on the last line: {stdout}"
    );
    let me = app
        .http
        .get(app.url("/v1/account"))
        .bearer_auth(&first)
        .send()
        .await
        .unwrap();
    assert_eq!(me.status(), 200);
    assert_eq!(me.json::<Value>().await.unwrap()["id"], "acme");

    let (ok, _, stderr) = app.lorry(&["accounts", "create", "acme"]);
    assert!(!ok && stderr.contains("exists"), "a second acme: {stderr}");
    let (ok, _, stderr) = app.lorry(&["accounts", "create", "Not A Name"]);
    assert!(!ok && stderr.contains("not an account name"), "{stderr}");

    let (ok, stdout, stderr) = app.lorry(&["keys", "create", "acme", "--name", "ci runner"]);
    assert!(ok, "keys create: {stderr}");
    let second = last_line(&stdout);
    assert!(second.starts_with("lorry_sk_") && second != first);
    assert_eq!(status_as(&app, &second, "/v1/account").await, 200);

    // Listed by name, redacted: neither key's value is printed again.
    let (ok, listing, stderr) = app.lorry(&["keys", "list", "acme"]);
    assert!(ok, "keys list: {stderr}");
    assert_eq!(listing.lines().count(), 2, "{listing}");
    assert!(
        listing.contains("default") && listing.contains("ci runner"),
        "{listing}"
    );
    assert!(!listing.contains(&first) && !listing.contains(&second), "{listing}");
    let used = listing.lines().find(|l| l.contains("default")).unwrap();
    assert!(!used.contains("last used -"), "the first key's use is recorded: {used}");
    let (ok, accounts, _) = app.lorry(&["accounts", "list"]);
    assert!(
        ok && accounts.contains("acme") && accounts.contains("default"),
        "{accounts}"
    );

    // Tenants stay apart: acme sees none of default's batches.
    let theirs = app.submit_echo(2, json!({})).await;
    let path = format!("/v1/batches/{}", theirs["id"].as_str().unwrap());
    assert_eq!(status_as(&app, &first, &path).await, 404);
    assert_eq!(status_as(&app, TOKEN, &path).await, 200);

    // A revoked key is refused at once; the other still opens the account.
    let second_id = listing
        .lines()
        .find(|l| l.contains("ci runner"))
        .and_then(|l| l.split_whitespace().next())
        .unwrap()
        .to_string();
    let (ok, _, stderr) = app.lorry(&["keys", "revoke", "acme", &second_id]);
    assert!(ok, "keys revoke: {stderr}");
    assert_eq!(status_as(&app, &second, "/v1/account").await, 401);
    assert_eq!(status_as(&app, &first, "/v1/account").await, 200);
    let (ok, _, stderr) = app.lorry(&["keys", "revoke", "default", &second_id]);
    assert!(!ok && stderr.contains("no key"), "another account's key: {stderr}");

    // Disabled: every key refused at once, on every route; enabled: back.
    let (ok, _, stderr) = app.lorry(&["accounts", "disable", "acme"]);
    assert!(ok, "accounts disable: {stderr}");
    assert_eq!(status_as(&app, &first, "/v1/account").await, 401);
    assert_eq!(status_as(&app, &first, "/v1/batches").await, 401);
    assert_eq!(
        status_as(&app, TOKEN, "/v1/account").await,
        200,
        "other accounts unaffected"
    );
    let (ok, _, _) = app.lorry(&["accounts", "enable", "acme"]);
    assert!(ok);
    assert_eq!(status_as(&app, &first, "/v1/account").await, 200);
    assert_eq!(
        status_as(&app, &second, "/v1/account").await,
        401,
        "revoked stays revoked"
    );

    let (ok, stdout, stderr) = app.lorry(&["accounts", "delete", "acme"]);
    assert!(ok, "accounts delete: {stderr}");
    assert!(stdout.contains("deleted acme"), "{stdout}");
    assert_eq!(status_as(&app, &first, "/v1/account").await, 401);
    let (ok, _, stderr) = app.lorry(&["keys", "list", "acme"]);
    assert!(!ok && stderr.contains("no account"), "{stderr}");
    app.stop().await;
}

#[tokio::test]
async fn the_admin_routes_serve_the_operator_alone_and_delete_an_account_once_its_batches_end() {
    // The API alone: a disabled account's cancelled batch stays `cancelling`
    // until a worker's finaliser ends it, which makes the busy case certain.
    let app = spawn_app_with(Role::Api, |s| s.api.admin_token = Some(ADMIN.parse().unwrap())).await;
    use reqwest::Method;

    // Only the operator's token opens them.
    for token in [TOKEN, "", "operator-secreT"] {
        let (status, body) = admin_as(&app, token, Method::GET, "/admin/v1/accounts", None).await;
        assert_eq!((status, code(&body).0), (401, "invalid_token"), "{token:?}");
    }
    let (status, _) = admin_as(&app, ADMIN, Method::GET, "/v1/account", None).await;
    assert_eq!(status, 401, "the admin token is not an account's key");

    // Made, with the first key shown once; refused with a code naming the field.
    let (status, made) = admin(&app, Method::POST, "/admin/v1/accounts", Some(json!({"name": "beta"}))).await;
    assert_eq!(status, 201, "{made}");
    assert_eq!(
        (made["id"].as_str(), made["status"].as_str()),
        (Some("beta"), Some("active"))
    );
    let key = made["key"]["value"].as_str().unwrap().to_string();
    assert_eq!(made["key"]["name"], "default");
    assert_eq!(status_as(&app, &key, "/v1/account").await, 200);
    for (body, status_code, error) in [
        (json!({"name": "beta"}), 409, ("account_exists", "name")),
        (json!({"name": "Beta!"}), 400, ("invalid_account_name", "name")),
        (json!({"name": ""}), 400, ("invalid_account_name", "name")),
        (json!({}), 400, ("missing_field", "name")),
        (json!({"name": 7}), 400, ("invalid_type", "name")),
        (json!({"name": "gamma", "plan": "gold"}), 400, ("unknown_field", "plan")),
        (
            json!({"name": "gamma", "key_name": ""}),
            400,
            ("invalid_value", "key_name"),
        ),
    ] {
        let (status, answer) = admin(&app, Method::POST, "/admin/v1/accounts", Some(body.clone())).await;
        assert_eq!((status, code(&answer)), (status_code, error), "{body}: {answer}");
    }
    let (_, gamma) = admin(&app, Method::GET, "/admin/v1/accounts/gamma", None).await;
    assert_eq!(code(&gamma).0, "account_not_found", "nothing half-written: {gamma}");

    // Listed in name order, paged.
    let (status, page) = admin(&app, Method::GET, "/admin/v1/accounts?limit=1", None).await;
    assert_eq!(status, 200);
    assert_eq!(
        (page["data"][0]["id"].as_str(), page["has_more"].as_bool()),
        (Some("beta"), Some(true))
    );
    let (_, rest) = admin(&app, Method::GET, "/admin/v1/accounts?after=beta", None).await;
    assert_eq!(rest["data"][0]["id"], "default");
    assert_eq!(rest["has_more"], false);

    // Keys: made, listed without values, revoked.
    let (status, second) = admin(
        &app,
        Method::POST,
        "/admin/v1/accounts/beta/keys",
        Some(json!({"name": "nightly"})),
    )
    .await;
    assert_eq!(status, 201, "{second}");
    let second_key = second["value"].as_str().unwrap().to_string();
    let second_id = second["id"].as_str().unwrap().to_string();
    assert_eq!(status_as(&app, &second_key, "/v1/account").await, 200);
    let (_, keys) = admin(&app, Method::GET, "/admin/v1/accounts/beta/keys", None).await;
    let listed = keys["data"].as_array().unwrap();
    assert_eq!(listed.len(), 2);
    assert!(listed.iter().all(|k| k.get("value").is_none()), "{keys}");
    assert!(!keys.to_string().contains(&key) && !keys.to_string().contains(&second_key));
    let (status, revoked) = admin(
        &app,
        Method::DELETE,
        &format!("/admin/v1/accounts/beta/keys/{second_id}"),
        None,
    )
    .await;
    assert_eq!(status, 200);
    assert!(revoked["revoked_at"].is_i64(), "{revoked}");
    assert_eq!(status_as(&app, &second_key, "/v1/account").await, 401);
    for path in [
        format!("/admin/v1/accounts/default/keys/{second_id}"),
        "/admin/v1/accounts/beta/keys/key_nope".to_string(),
    ] {
        let (status, body) = admin(&app, Method::DELETE, &path, None).await;
        assert_eq!((status, code(&body).0), (404, "key_not_found"), "{path}");
    }
    for path in ["/admin/v1/accounts/nobody", "/admin/v1/accounts/NOBODY/keys"] {
        let (status, body) = admin(&app, Method::GET, path, None).await;
        assert_eq!((status, code(&body).0), (404, "account_not_found"), "{path}");
    }

    // Beta's work: a file in S3 and a queued batch (no worker runs yet).
    let line = json!({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                      "body": {"model": "@lorry/echo", "prompt": "x"}});
    let upload = app.upload_file(&key, &[], format!("{line}\n").into_bytes()).await;
    assert_eq!(upload.status(), 200, "{}", upload.text().await.unwrap());
    let queued = submit_as(&app, &key, 5).await;
    let queued_id = queued["id"].as_str().unwrap().to_string();
    let ours = app.submit_echo(3, json!({})).await;
    assert!(app.bucket_keys().await.iter().any(|k| k.starts_with("accounts/beta/")));

    // Disabled: refused at once, its queued batch cancelled, other accounts untouched.
    let (status, disabled) = admin(&app, Method::POST, "/admin/v1/accounts/beta/disable", None).await;
    assert_eq!(status, 200, "{disabled}");
    assert_eq!(disabled["status"], "disabled");
    assert_eq!(disabled["cancelled_batches"], json!([queued_id]));
    assert_eq!(status_as(&app, &key, "/v1/account").await, 401);
    let batch = app
        .store
        .batch_by_id(&lorry_batcher::ids::BatchId::parse(&queued_id).unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(batch.status.as_str(), "cancelling");

    // Deleting waits for that batch to end: no worker, so it is busy.
    let (status, busy) = admin(&app, Method::DELETE, "/admin/v1/accounts/beta", None).await;
    assert_eq!((status, code(&busy)), (409, ("account_busy", "account_id")), "{busy}");

    // A worker's finaliser ends it: the default account's batch completes, beta's is cancelled.
    let mut worker = app.spawn_worker_process(&[]);
    let done = app
        .wait_until_ended(ours["id"].as_str().unwrap(), Duration::from_secs(120))
        .await;
    assert_eq!(done["status"], "completed");
    let deleted = eventually(Duration::from_secs(120), || async {
        let (status, body) = admin(&app, Method::DELETE, "/admin/v1/accounts/beta", None).await;
        if status == 200 {
            return Ok(body);
        }
        assert_eq!(code(&body).0, "account_busy", "{body}");
        Err("beta's batch never ended".to_string())
    })
    .await;
    assert_eq!(deleted, json!({"id": "beta", "object": "account", "deleted": true}));
    worker.kill().unwrap();
    worker.wait().unwrap();

    // Nothing of beta is left: no rows, no objects; the default account's output stays.
    let keys = app.bucket_keys().await;
    assert!(!keys.iter().any(|k| k.starts_with("accounts/beta/")), "{keys:?}");
    assert!(keys.iter().any(|k| k.starts_with("accounts/default/")), "{keys:?}");
    for table in ["batches", "files", "adapters", "webhook_deliveries"] {
        let left: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {table} WHERE account_id = 'beta'"))
            .fetch_one(app.store.pool())
            .await
            .unwrap();
        assert_eq!(left, 0, "{table}");
    }
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM requests WHERE batch_id = $1")
        .bind(&queued_id)
        .fetch_one(app.store.pool())
        .await
        .unwrap();
    assert_eq!(left, 0, "requests");
    let (status, _) = admin(&app, Method::GET, "/admin/v1/accounts/beta", None).await;
    assert_eq!(status, 404);
    // The name is free again, with nothing of the old account in it.
    let (status, again) = admin(&app, Method::POST, "/admin/v1/accounts", Some(json!({"name": "beta"}))).await;
    assert_eq!(status, 201);
    let fresh = again["key"]["value"].as_str().unwrap();
    let (_, listing) = app.get_json_as(fresh, "/v1/batches").await;
    assert_eq!(listing["data"], json!([]));
    app.stop().await;
}

#[tokio::test]
async fn each_quota_is_refused_with_its_code_and_retry_after_and_nothing_half_written() {
    // The API alone, so queued batches stay queued and the count is certain.
    let app = spawn_app_with(Role::Api, |s| {
        s.api.admin_token = Some(ADMIN.parse().unwrap());
        s.api.rt_timeout_secs = 1;
        s.quotas.quota_queued_requests = 5;
        s.quotas.quota_realtime_per_second = 0.01;
        s.quotas.quota_file_bytes = 300;
        s.quotas.quota_adapters = 1;
    })
    .await;
    use reqwest::Method;
    let refused = |response: &reqwest::Response| {
        (
            response.status().as_u16(),
            response
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok())
                .is_some_and(|s| s >= 1),
        )
    };
    let batches = |app: &TestApp| {
        let pool = app.store.pool().clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM batches")
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let me = app.get_json("/v1/account").await;
    assert_eq!(
        me["limits"],
        json!({"queued_requests": 5, "realtime_per_second": 0.01, "file_bytes": 300, "adapters": 1})
    );

    // Queued batch requests: 6 at once are over; 5 fit; then even 1 is over.
    let body = |n: usize| {
        let requests: Vec<Value> = (0..n).map(|i| json!({"body": {"prompt": format!("p{i}")}})).collect();
        json!({"model": "@lorry/echo", "requests": requests})
    };
    let response = app.post("/v1/batches", &body(6)).await;
    assert_eq!(refused(&response), (429, true));
    let error: Value = response.json().await.unwrap();
    assert_eq!(code(&error).0, "quota_queued_requests", "{error}");
    assert_eq!(error["error"]["type"], "rate_limit_error");
    assert_eq!(batches(&app).await, 0, "nothing half-written");
    assert_eq!(app.post("/v1/batches", &body(5)).await.status(), 202);
    let response = app.post("/v1/batches", &body(1)).await;
    assert_eq!(refused(&response), (429, true));
    // The Workers AI shape gives the same code, in its envelope.
    let response = app
        .post(
            "/client/v4/accounts/default/ai/run/@lorry/echo?queueRequest=true",
            &json!({"requests": [{"prompt": "x"}]}),
        )
        .await;
    assert_eq!(refused(&response), (429, true));
    let error: Value = response.json().await.unwrap();
    assert_eq!(code(&error).0, "quota_queued_requests", "{error}");
    assert_eq!(batches(&app).await, 1);
    // The account's own limit wins: 0 is no limit.
    let (status, account) = admin(
        &app,
        Method::PATCH,
        "/admin/v1/accounts/default",
        Some(json!({"quotas": {"queued_requests": 0}})),
    )
    .await;
    assert_eq!(status, 200, "{account}");
    assert_eq!(account["quotas"]["queued_requests"], 0);
    assert_eq!(account["quotas"]["adapters"], Value::Null);
    assert_eq!(app.post("/v1/batches", &body(6)).await.status(), 202);
    for (change, error) in [
        (
            json!({"quotas": {"queued_requests": -1}}),
            ("invalid_type", "quotas.queued_requests"),
        ),
        (
            json!({"quotas": {"adapters": 1.5}}),
            ("invalid_type", "quotas.adapters"),
        ),
        (
            json!({"quotas": {"realtime_per_second": "fast"}}),
            ("invalid_type", "quotas.realtime_per_second"),
        ),
        (json!({"quotas": {"seats": 3}}), ("unknown_field", "quotas.seats")),
        (json!({"quotas": 3}), ("invalid_type", "quotas")),
        (json!({"plan": "gold"}), ("unknown_field", "plan")),
    ] {
        let (status, answer) = admin(&app, Method::PATCH, "/admin/v1/accounts/default", Some(change.clone())).await;
        assert_eq!((status, code(&answer)), (400, error), "{change}: {answer}");
    }

    // Real-time requests a second: a bucket of one at 0.01/s. The first is
    // let through (no worker answers it: 504); the second is refused at once.
    let chat = json!({"model": "@lorry/echo", "messages": [{"role": "user", "content": "hi"}]});
    let first = app.post("/v1/chat/completions", &chat).await;
    assert!(
        matches!(first.status().as_u16(), 503 | 504),
        "let through: {}",
        first.status()
    );
    let second = app.post("/v1/chat/completions", &chat).await;
    assert_eq!(refused(&second), (429, true));
    let error: Value = second.json().await.unwrap();
    assert_eq!(code(&error).0, "quota_realtime_rate");
    let retry: u64 = app
        .post("/v1/chat/completions", &chat)
        .await
        .headers()
        .get("retry-after")
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((90..=100).contains(&retry), "the next token is ~100 s away: {retry}");
    // Lifted for this account alone (0: no limit).
    let (status, _) = admin(
        &app,
        Method::PATCH,
        "/admin/v1/accounts/default",
        Some(json!({"quotas": {"realtime_per_second": 0}})),
    )
    .await;
    assert_eq!(status, 200);
    let lifted = app.post("/v1/chat/completions", &chat).await.status().as_u16();
    assert!(matches!(lifted, 503 | 504), "let through: {lifted}");

    // Stored file bytes: 200 + 200 is over 300; the refused upload leaves no object.
    let line = json!({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                      "body": {"model": "@lorry/echo", "prompt": "y".repeat(100)}});
    let file = format!("{line}\n").into_bytes();
    assert!(file.len() > 150 && file.len() <= 300, "{}", file.len());
    let upload = |bytes: Vec<u8>| app.upload_file(TOKEN, &[], bytes);
    assert_eq!(upload(file.clone()).await.status(), 200);
    let objects = app.bucket_keys().await.len();
    let response = upload(file.clone()).await;
    assert_eq!(refused(&response), (429, true));
    let error: Value = response.json().await.unwrap();
    assert_eq!(code(&error).0, "quota_file_bytes", "{error}");
    assert_eq!(
        app.bucket_keys().await.len(),
        objects,
        "the refused file's bytes are gone"
    );
    let files: i64 = sqlx::query_scalar("SELECT count(*) FROM files")
        .fetch_one(app.store.pool())
        .await
        .unwrap();
    assert_eq!(files, 1);

    // Adapters: one, then the second refused.
    let finetunes = "/client/v4/accounts/default/ai/finetunes";
    let made = app
        .post(finetunes, &json!({"model": "@lorry/demo-llama", "name": "one"}))
        .await;
    assert_eq!(made.status(), 200, "{}", made.text().await.unwrap());
    let response = app
        .post(finetunes, &json!({"model": "@lorry/demo-llama", "name": "two"}))
        .await;
    assert_eq!(refused(&response), (429, true));
    let error: Value = response.json().await.unwrap();
    assert_eq!(code(&error).0, "quota_adapters", "{error}");
    let adapters: i64 = sqlx::query_scalar("SELECT count(*) FROM adapters")
        .fetch_one(app.store.pool())
        .await
        .unwrap();
    assert_eq!(adapters, 1);
    app.stop().await;
}

#[tokio::test]
async fn usage_counts_both_lanes_as_their_results_do_and_only_the_callers() {
    let app = spawn_app_with(Role::Serve, |_| {}).await;
    let other = AccountId::parse_name("other").unwrap();
    let (_, other_key) = app.store.create_account(&other, "default").await.unwrap().unwrap();

    let batch = app.submit_echo(7, json!({})).await;
    let batch_id = batch["id"].as_str().unwrap().to_string();
    let done = app.wait_until_ended(&batch_id, Duration::from_secs(60)).await;
    assert_eq!(done["status"], "completed");
    let mut realtime = (0, 0, 0);
    for i in 0..3 {
        let answer: Value = app
            .post(
                "/v1/chat/completions",
                &json!({"model": "@lorry/echo", "messages": [{"role": "user", "content": format!("one two {i}")}]}),
            )
            .await
            .json()
            .await
            .unwrap();
        realtime.0 += 1;
        realtime.1 += answer["usage"]["prompt_tokens"].as_i64().unwrap();
        realtime.2 += answer["usage"]["completion_tokens"].as_i64().unwrap();
    }
    // The worker counts a real-time request once its answer is out.
    let usage = |query: &'static str, token: String| {
        let app = &app;
        async move { app.get_json_as(&token, &format!("/v1/usage{query}")).await }
    };
    let totals = eventually(Duration::from_secs(30), || async {
        let (status, body) = usage("?group_by=model", TOKEN.to_string()).await;
        assert_eq!(status, 200, "{body}");
        let rt = body["data"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["lane"] == "realtime")
            .cloned();
        if rt.as_ref().is_some_and(|r| r["requests"] == 3) {
            Ok(body)
        } else {
            Err(format!("{body}"))
        }
    })
    .await;
    let rows = totals["data"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{totals}");
    let batch_row = rows.iter().find(|r| r["lane"] == "batch").unwrap();
    assert_eq!(batch_row["model"], "@lorry/echo");
    assert_eq!(batch_row["requests"], 7);
    assert_eq!(
        batch_row["input_tokens"], done["usage"]["prompt_tokens"],
        "the batch object's usage"
    );
    assert_eq!(batch_row["output_tokens"], done["usage"]["completion_tokens"]);
    let rt_row = rows.iter().find(|r| r["lane"] == "realtime").unwrap();
    assert_eq!(
        (
            rt_row["requests"].as_i64(),
            rt_row["input_tokens"].as_i64(),
            rt_row["output_tokens"].as_i64()
        ),
        (Some(realtime.0), Some(realtime.1), Some(realtime.2))
    );

    // By batch and day: the batch's own row, today's date.
    let (_, by) = usage("?group_by=batch,day,adapter", TOKEN.to_string()).await;
    let row = by["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["lane"] == "batch")
        .unwrap()
        .clone();
    assert_eq!(row["batch_id"], batch_id.as_str());
    assert_eq!(row["adapter"], "");
    assert_eq!(row["day"], chrono::Utc::now().date_naive().to_string());
    assert!(row.get("model").is_none(), "only the groups asked for: {row}");
    // Another account sees none of it; a span without the day sees nothing.
    let (_, theirs) = usage("", other_key.value.clone()).await;
    assert_eq!(theirs["data"], json!([]), "{theirs}");
    let (_, before) = usage("?start=2020-01-01&end=2020-02-01", TOKEN.to_string()).await;
    assert_eq!(before["data"], json!([]));
    for (query, param) in [
        ("?group_by=account", "group_by"),
        ("?start=yesterday", "start"),
        ("?end=2020-13-01", "end"),
        ("?start=2020-02-01&end=2020-01-01", "start"),
        ("?start=2020-01-01&end=2022-01-01", "start"),
        ("?limit=5", "limit"),
    ] {
        let (status, body) = usage(query, TOKEN.to_string()).await;
        assert_eq!((status, code(&body).1), (400, param), "{query}: {body}");
    }
    app.stop().await;
}

#[tokio::test]
async fn logs_are_one_json_object_a_line_with_lorry_log_format_json() {
    let app = spawn_app_with(Role::Api, |_| {}).await;
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_lorry"))
        .arg("migrate")
        .envs(app.child_env())
        .env("LORRY_LOG_FORMAT", "json")
        .env("LORRY_LOG", "info")
        .output()
        .unwrap();
    assert!(output.status.success());
    let stderr = String::from_utf8(output.stderr).unwrap();
    let lines: Vec<Value> = stderr
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?} is not JSON: {e}")))
        .collect();
    assert!(
        lines
            .iter()
            .any(|l| l["fields"]["message"] == "database ready" && l["level"] == "INFO"),
        "{stderr}"
    );
    app.stop().await;
}
