//! `spawn_app()`: a Lorry process on port 0 with its own database, queue
//! prefix and bucket, against the real Postgres, RabbitMQ and S3, so that
//! end-to-end tests run in parallel without seeing each other.

use std::process::{Child, Command, Stdio};
use std::sync::Once;
use std::time::{Duration, Instant};

use lorry::{Application, Role, Settings};
use lorry_batcher::store::Store;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

pub const TOKEN: &str = "test-token";

static TRACING: Once = Once::new();

fn init_tracing() {
    TRACING.call_once(|| {
        // `TEST_LOG=1`, or a filter of its own (`TEST_LOG=lorry_batcher=debug`);
        // errors always, so that a failing test's output says what failed
        // inside the service (the runner shows a test's output only when it fails).
        let filter = match std::env::var("TEST_LOG") {
            Ok(filter) if filter == "1" => "info,lorry=debug".to_string(),
            Ok(filter) => filter,
            Err(_) => "error".to_string(),
        };
        tracing_subscriber::fmt()
            .with_env_filter(filter.as_str())
            .with_ansi(false)
            .with_test_writer()
            .init();
    });
}

/// The PostgreSQL server test deployments make their databases on (no database name).
pub fn database_server() -> String {
    std::env::var("LORRY_TEST_DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".to_string())
}

/// Settings for a fresh, isolated deployment.
pub async fn isolated_settings() -> Settings {
    isolated_settings_on(&database_server()).await
}

/// Settings for a fresh, isolated deployment whose database is made on the
/// PostgreSQL server at `base` (a URL without a database name).
pub async fn isolated_settings_on(base: &str) -> Settings {
    let mut settings = Settings::from_env().expect("settings from the environment");
    let unique = uuid::Uuid::new_v4().simple().to_string();
    settings.services.database_url = format!("{base}/lorry_test_{unique}");
    Store::create_database(&settings.services.database_url)
        .await
        .expect("creating the test database");
    settings.services.queue_prefix = format!("lorry-test-{unique}");
    settings.services.s3_bucket = format!("lorry-test-{}", &unique[..20]);
    if settings.services.s3_endpoint.is_none() {
        settings.services.s3_endpoint = Some("http://127.0.0.1:9310".into());
    }
    if settings.services.s3_access_key.is_empty() {
        settings.services.s3_access_key = "lorry".into();
        settings.services.s3_secret_key = "lorry-secret-key".parse().unwrap();
    }
    settings.api.listen = "127.0.0.1:0".into();
    settings.api.bootstrap_token = Some(TOKEN.parse().unwrap());
    settings.webhooks.allow_private = true;
    settings.worker.sweep_interval_ms = 200;
    settings.webhooks.min_backoff_ms = 50;
    // The demo models are written once and shared by every test deployment.
    settings.models.data_dir = Some(std::env::temp_dir().join("lorry-test-data"));
    settings
}

/// The JSON of each `data:` event of a server-sent stream, `[DONE]` left out.
pub fn sse_json(text: &str) -> Vec<Value> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

/// The entry for `id` in a `GET /v1/models` answer.
pub fn listed_model(models: &Value, id: &str) -> Value {
    models["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["id"] == id)
        .cloned()
        .unwrap_or_else(|| panic!("{id} missing from {models}"))
}

/// Try `attempt` until it gives `Ok`, every 50 ms; panic with its last
/// `Err` once `limit` has passed. The tests' one way of waiting for a
/// condition that comes true in the background.
pub async fn eventually<T, F, Fut>(limit: Duration, mut attempt: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let started = Instant::now();
    loop {
        match attempt().await {
            Ok(done) => return done,
            Err(why) => assert!(started.elapsed() < limit, "{why}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A running Lorry.
pub struct TestApp {
    pub address: String,
    /// The broker itself, even when the app reaches it through a proxy.
    broker_url: String,
    pub settings: Settings,
    pub store: Store,
    pub http: reqwest::Client,
    stop: CancellationToken,
    handle: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
    /// The text-generation engines of this process's worker.
    pub text_engines: Vec<lorry_engine::runtime::text_engine::TextEngine>,
}

/// Wait until every dead-letter worker of the machine's broker node has
/// finished starting. RabbitMQ 3.10 starts one for each quorum queue with
/// at-least-once dead-lettering as the queue comes up; a queue deleted while
/// its worker is still starting crashes that worker twice, and two crashes
/// within 5 s take down the node's supervisor of all such workers, after
/// which every declare of such a queue, in every test, fails with
/// INTERNAL_ERROR until the node restarts. `sys:get_state` is answered only
/// once a worker's start (its checkout on the queue) is done. Where the CLI
/// cannot reach the node, nothing is waited for.
pub fn dead_letter_workers_started() {
    let _ = Command::new("rabbitmqctl")
        .args([
            "-q",
            "eval",
            "[catch sys:get_state(P, 30000) || {_, P, _, _} <- supervisor:which_children(rabbit_fifo_dlx_sup), is_pid(P)], ok.",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// Start Lorry in this process with `role` and settings adjusted by `tweak`.
pub async fn spawn_app_with(role: Role, tweak: impl FnOnce(&mut Settings)) -> TestApp {
    init_tracing();
    let mut settings = isolated_settings().await;
    let broker_url = settings.services.amqp_url.clone();
    tweak(&mut settings);
    let mut app = start(settings, role).await;
    app.broker_url = broker_url;
    app
}

/// API and worker in one process, default settings.
pub async fn spawn_app() -> TestApp {
    spawn_app_with(Role::Serve, |_| {}).await
}

pub async fn start(settings: Settings, role: Role) -> TestApp {
    let app = Application::build(settings.clone(), role)
        .await
        .expect("building the app");
    let port = app.port().unwrap_or(0);
    let stop = app.stopper();
    let text_engines = app.text_engines().to_vec();
    let handle = tokio::spawn(app.run_until_stopped());
    let store = Store::connect(&settings.services.database_url, 4).await.unwrap();
    TestApp {
        address: format!("http://127.0.0.1:{port}"),
        broker_url: settings.services.amqp_url.clone(),
        settings,
        store,
        http: reqwest::Client::new(),
        stop,
        handle: Some(handle),
        text_engines,
    }
}

impl TestApp {
    /// A handle on a deployment whose processes the test runs itself (no
    /// Lorry in this process), its API at `address`.
    pub async fn attach(settings: Settings, address: String) -> TestApp {
        let store = Store::connect(&settings.services.database_url, 4).await.unwrap();
        TestApp {
            address,
            broker_url: settings.services.amqp_url.clone(),
            settings,
            store,
            http: reqwest::Client::new(),
            stop: CancellationToken::new(),
            handle: None,
            text_engines: Vec::new(),
        }
    }

    /// Start `lorry api` as a real process of this deployment on `port`
    /// (0: any free one); returns it and its address once it listens.
    pub async fn spawn_api_process(&self, port: u16) -> (tokio::process::Child, String) {
        spawn_api_process(&self.child_env(), port).await
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.address)
    }

    pub async fn post(&self, path: &str, body: &Value) -> reqwest::Response {
        self.http
            .post(self.url(path))
            .bearer_auth(TOKEN)
            .json(body)
            .send()
            .await
            .unwrap()
    }

    pub async fn get(&self, path: &str) -> reqwest::Response {
        self.http.get(self.url(path)).bearer_auth(TOKEN).send().await.unwrap()
    }

    pub async fn get_json(&self, path: &str) -> Value {
        let response = self.get(path).await;
        assert!(response.status().is_success(), "GET {path}: {}", response.status());
        response.json().await.unwrap()
    }

    /// Submit a native batch of echo requests; returns the batch object.
    pub async fn submit_echo(&self, n: usize, extra: Value) -> Value {
        let requests: Vec<Value> = (0..n)
            .map(|i| json!({"custom_id": format!("req-{i}"), "body": {"prompt": format!("prompt {i}")}}))
            .collect();
        let mut body = json!({"model": "@lorry/echo", "requests": requests});
        if let (Some(target), Some(more)) = (body.as_object_mut(), extra.as_object()) {
            target.extend(more.clone());
        }
        let response = self.post("/v1/batches", &body).await;
        assert_eq!(response.status(), 202, "{}", response.text().await.unwrap());
        response.json().await.unwrap()
    }

    /// Poll a batch until `done` holds for it, or panic after `limit`.
    pub async fn wait_for(&self, id: &str, limit: Duration, done: impl Fn(&Value) -> bool) -> Value {
        eventually(limit, || async {
            let batch = self.get_json(&format!("/v1/batches/{id}")).await;
            if done(&batch) {
                Ok(batch)
            } else {
                Err(format!("batch never reached the state awaited: {batch:#}"))
            }
        })
        .await
    }

    /// Submit a native batch (`202` expected) and wait until it has ended; the ended batch.
    pub async fn run_batch(&self, body: &Value, limit: Duration) -> Value {
        let response = self.post("/v1/batches", body).await;
        assert_eq!(response.status(), 202);
        let batch: Value = response.json().await.unwrap();
        self.wait_until_ended(batch["id"].as_str().unwrap(), limit).await
    }

    /// Poll until the batch has ended.
    pub async fn wait_until_ended(&self, id: &str, limit: Duration) -> Value {
        self.wait_for(id, limit, |b| {
            matches!(
                b["status"].as_str(),
                Some("completed" | "cancelled" | "expired" | "failed")
            )
        })
        .await
    }

    /// Fetch the lines of a presigned URL's JSONL document.
    pub async fn fetch_jsonl(&self, url: &str) -> Vec<Value> {
        let response = self.http.get(url).send().await.unwrap();
        assert!(response.status().is_success(), "GET {url}: {}", response.status());
        let text = response.text().await.unwrap();
        text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
    }

    /// `GET path` with another account's token: the status and the JSON answer (`null` if none).
    pub async fn get_json_as(&self, token: &str, path: &str) -> (u16, Value) {
        let response = self.http.get(self.url(path)).bearer_auth(token).send().await.unwrap();
        let status = response.status().as_u16();
        (status, response.json().await.unwrap_or(Value::Null))
    }

    /// `POST /v1/files` with `purpose=batch`, these extra form fields and `body` as the file.
    pub async fn upload_file(&self, token: &str, fields: &[(&str, &str)], body: Vec<u8>) -> reqwest::Response {
        let mut form = reqwest::multipart::Form::new().text("purpose", "batch");
        for (name, value) in fields {
            form = form.text(name.to_string(), value.to_string());
        }
        form = form.part("file", reqwest::multipart::Part::bytes(body).file_name("in.jsonl"));
        self.http
            .post(self.url("/v1/files"))
            .bearer_auth(token)
            .multipart(form)
            .send()
            .await
            .unwrap()
    }

    /// Every object key in the deployment's bucket.
    pub async fn bucket_keys(&self) -> Vec<String> {
        let services = &self.settings.services;
        let config = aws_sdk_s3::Config::builder()
            .behavior_version(aws_sdk_s3::config::BehaviorVersion::latest())
            .endpoint_url(services.s3_endpoint.clone().unwrap())
            .region(aws_sdk_s3::config::Region::new(services.s3_region.clone()))
            .credentials_provider(aws_sdk_s3::config::Credentials::new(
                services.s3_access_key.clone(),
                services.s3_secret_key.expose().to_string(),
                None,
                None,
                "test",
            ))
            .force_path_style(true)
            .build();
        let client = aws_sdk_s3::Client::from_conf(config);
        let listed = client
            .list_objects_v2()
            .bucket(&services.s3_bucket)
            .send()
            .await
            .unwrap();
        listed
            .contents()
            .iter()
            .filter_map(|o| o.key().map(str::to_string))
            .collect()
    }

    /// Run the `lorry` binary against this deployment: its exit status, stdout and stderr.
    pub fn lorry(&self, args: &[&str]) -> (bool, String, String) {
        let output = Command::new(env!("CARGO_BIN_EXE_lorry"))
            .args(args)
            .envs(self.child_env())
            .output()
            .expect("running lorry");
        (
            output.status.success(),
            String::from_utf8(output.stdout).unwrap(),
            String::from_utf8(output.stderr).unwrap(),
        )
    }

    /// Environment for a `lorry` child process of this deployment.
    pub fn child_env(&self) -> Vec<(String, String)> {
        child_env(&self.settings)
    }

    /// Start `lorry worker` as a real process of this deployment.
    pub fn spawn_worker_process(&self, extra: &[(&str, &str)]) -> Child {
        let mut command = Command::new(env!("CARGO_BIN_EXE_lorry"));
        command.arg("worker").envs(self.child_env());
        for (k, v) in extra {
            command.env(k, v);
        }
        if std::env::var_os("TEST_LOG").is_none() {
            command.stdout(Stdio::null()).stderr(Stdio::null());
        }
        command.spawn().expect("starting lorry worker")
    }

    /// Stop the app and wait for it to drain.
    pub async fn stop(mut self) {
        self.stop.cancel();
        if let Some(handle) = self.handle.take() {
            let _ = tokio::time::timeout(Duration::from_secs(30), handle).await;
        }
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        self.stop.cancel();
        // Quorum queues outlive their test unless deleted.
        let prefix = self.settings.services.queue_prefix.clone();
        let url = self.broker_url.clone();
        let _ = std::thread::spawn(move || {
            dead_letter_workers_started();
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(delete_topology(&url, &prefix));
        })
        .join();
    }
}

async fn delete_topology(url: &str, prefix: &str) {
    use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
    let Ok(connection) = lorry_batcher::broker::connect(url, "lorry-test-cleanup").await else {
        return;
    };
    let Ok(channel) = connection.create_channel().await else {
        return;
    };
    // Every model a test deployment serves has a queue per lane.
    let models = ["@lorry/echo", "@lorry/demo-llama", "@lorry/demo-bge"];
    let lanes = models
        .iter()
        .flat_map(|m| [format!("batch.{m}"), format!("batch.{m}.ahead"), format!("rt.{m}")]);
    for queue in lanes.chain(["dlq".to_string()]) {
        let _ = channel
            .queue_delete(&format!("{prefix}.{queue}"), QueueDeleteOptions::default())
            .await;
    }
    for exchange in ["events", "dlx", "rt.cancel"] {
        let _ = channel
            .exchange_delete(&format!("{prefix}.{exchange}"), ExchangeDeleteOptions::default())
            .await;
    }
    let _ = connection.close(200, "cleanup").await;
}

/// An echo batch of `total` requests (`prompt {i}` each) has ended within
/// `limit`, `completed`, with every request's own answer exactly once in its
/// output and one `batch.completed` event: what must hold after any fault.
pub async fn assert_echo_batch_ended_once(app: &TestApp, id: &str, total: usize, limit: Duration) {
    let done = app.wait_until_ended(id, limit).await;
    assert_eq!(done["status"], "completed", "{done:#}");
    assert_eq!(done["request_counts"]["succeeded"], json!(total), "{done:#}");
    let lines = app.fetch_jsonl(done["output_url"].as_str().unwrap()).await;
    assert_each_index_once(&lines, total);
    for line in &lines {
        let i = line["index"].as_i64().unwrap();
        assert_eq!(line["response"]["body"]["response"], format!("prompt {i}"));
    }
    let completions: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox WHERE routing_key = 'batch.completed' AND payload->>'subject' = $1",
    )
    .bind(id)
    .fetch_one(app.store.pool())
    .await
    .unwrap();
    assert_eq!(completions, 1, "the batch completed exactly once");
}

/// Every request of an ended batch appears exactly once in `output.jsonl`, in index order.
pub fn assert_each_index_once(lines: &[Value], total: usize) {
    assert_eq!(lines.len(), total, "output.jsonl holds one line per request");
    for (i, line) in lines.iter().enumerate() {
        assert_eq!(line["index"], json!(i), "line {i} is out of order or duplicated");
    }
}

/// A TCP proxy in front of a service (RabbitMQ, PostgreSQL, S3) whose
/// connections a test can cut, and whose new connections it can refuse for
/// as long as it likes: a network failure or a restart, for this test's
/// deployment alone (other tests on the machine keep the service).
pub struct Proxy {
    pub port: u16,
    connections: std::sync::Arc<tokio::sync::Mutex<tokio::task::JoinSet<()>>>,
    blocked: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Connections refused while blocked, watched by [`Proxy::wait_for_refusals`].
    refused: tokio::sync::watch::Receiver<u64>,
}

impl Proxy {
    pub async fn start(upstream: String) -> Proxy {
        use std::sync::atomic::Ordering;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let connections = std::sync::Arc::new(tokio::sync::Mutex::new(tokio::task::JoinSet::new()));
        let blocked = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (refusals, refused) = tokio::sync::watch::channel(0u64);
        let (held, is_blocked) = (connections.clone(), blocked.clone());
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                if is_blocked.load(Ordering::SeqCst) {
                    drop(inbound);
                    refusals.send_modify(|n| *n += 1);
                    continue;
                }
                let upstream = upstream.clone();
                held.lock().await.spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        });
        Proxy {
            port,
            connections,
            blocked,
            refused,
        }
    }

    /// Drop every connection through the proxy, as a network failure would.
    pub async fn cut(&self) -> usize {
        let mut connections = self.connections.lock().await;
        let n = connections.len();
        connections.abort_all();
        while connections.join_next().await.is_some() {}
        n
    }

    /// Cut every connection and refuse new ones until [`Proxy::unblock`]: the service is down.
    pub async fn block(&self) -> usize {
        self.blocked.store(true, std::sync::atomic::Ordering::SeqCst);
        self.cut().await
    }

    /// The service is back.
    pub fn unblock(&self) {
        self.blocked.store(false, std::sync::atomic::Ordering::SeqCst);
    }

    /// How many connections it has refused so far.
    pub fn refused(&self) -> u64 {
        *self.refused.borrow()
    }

    /// Wait until the deployment has tried, and failed, to reach the service `n` times.
    pub async fn wait_for_refusals(&self, n: u64) {
        let mut refused = self.refused.clone();
        refused.wait_for(|&count| count >= n).await.expect("the proxy stopped");
    }
}

/// Environment for a `lorry` child process of the deployment `s` describes.
pub fn child_env(s: &Settings) -> Vec<(String, String)> {
    vec![
        ("LORRY_DATABASE_URL".into(), s.services.database_url.clone()),
        ("LORRY_AMQP_URL".into(), s.services.amqp_url.clone()),
        (
            "LORRY_S3_ENDPOINT".into(),
            s.services.s3_endpoint.clone().unwrap_or_default(),
        ),
        ("LORRY_S3_BUCKET".into(), s.services.s3_bucket.clone()),
        ("LORRY_S3_REGION".into(), s.services.s3_region.clone()),
        ("AWS_ACCESS_KEY_ID".into(), s.services.s3_access_key.clone()),
        (
            "AWS_SECRET_ACCESS_KEY".into(),
            s.services.s3_secret_key.expose().to_string(),
        ),
        ("LORRY_QUEUE_PREFIX".into(), s.services.queue_prefix.clone()),
        ("LORRY_SWEEP_INTERVAL_MS".into(), s.worker.sweep_interval_ms.to_string()),
        ("LORRY_WEBHOOK_ALLOW_PRIVATE".into(), "true".into()),
        ("LORRY_DATA_DIR".into(), s.data_dir().display().to_string()),
    ]
}

/// Start `lorry api` with the environment `env` on `port` (0: any free
/// one); returns the process and its address once it says it listens. Its
/// log is drained (and shown with `TEST_LOG`).
pub async fn spawn_api_process(env: &[(String, String)], port: u16) -> (tokio::process::Child, String) {
    use tokio::io::AsyncBufReadExt;
    let port = if port == 0 { free_port() } else { port };
    let mut api = tokio::process::Command::new(env!("CARGO_BIN_EXE_lorry"))
        .arg("api")
        .envs(env.iter().cloned())
        .env("LORRY_LISTEN", format!("127.0.0.1:{port}"))
        .env("LORRY_BOOTSTRAP_TOKEN", TOKEN)
        .env("LORRY_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("starting lorry api");
    let show = std::env::var_os("TEST_LOG").is_some();
    let mut log = tokio::io::BufReader::new(api.stderr.take().unwrap()).lines();
    loop {
        match log.next_line().await.unwrap() {
            Some(line) if line.contains("listening on") => break,
            Some(line) if show => eprintln!("api: {line}"),
            Some(_) => {}
            None => panic!("lorry api exited before it listened: {:?}", api.wait().await),
        }
    }
    tokio::spawn(async move {
        while let Ok(Some(line)) = log.next_line().await {
            if show {
                eprintln!("api: {line}");
            }
        }
    });
    (api, format!("http://127.0.0.1:{port}"))
}

/// A TCP port on loopback that nothing listened on a moment ago, below the
/// kernel's ephemeral range where there is room: a service a test stops and
/// starts again on it (an API process, a RabbitMQ node, a PostgreSQL server)
/// cannot find it taken meanwhile as the source port of some connection,
/// which a port handed out by the kernel can be under a busy suite.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let ephemeral_from = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768);
    const FROM: u32 = 10_000;
    if ephemeral_from > FROM + 1_000 {
        let span = ephemeral_from - FROM;
        // Each test process starts somewhere else in the range, and walks on from there.
        let start = std::process::id().wrapping_mul(2_654_435_761)
            ^ std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos());
        for _ in 0..span {
            let port = FROM + start.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed)) % span;
            if std::net::TcpListener::bind(("127.0.0.1", port as u16)).is_ok() {
                return port as u16;
            }
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A PostgreSQL server or RabbitMQ node of this test's own
/// (`scripts/services own`), which the test may stop, crash and start again
/// without touching anyone else's; removed, data and all, when dropped.
pub struct OwnService {
    kind: &'static str,
    dir: std::path::PathBuf,
    pub port: u16,
}

impl OwnService {
    /// Make and start one: `kind` is `postgres` or `rabbitmq`.
    pub async fn start(kind: &'static str) -> OwnService {
        let root = std::env::temp_dir().join("lorry-own");
        std::fs::create_dir_all(&root).unwrap();
        let port = free_port();
        let service = OwnService {
            kind,
            dir: root.join(format!("{kind}-{port}")),
            port,
        };
        service.run("start").await;
        service
    }

    /// Its URL as Lorry's settings take it: a PostgreSQL server without a
    /// database name, or an AMQP URL.
    pub fn url(&self) -> String {
        match self.kind {
            "postgres" => format!("postgres://postgres@127.0.0.1:{}", self.port),
            _ => format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port),
        }
    }

    /// `start`, `stop` (clean), `crash` (killed) or `remove`.
    pub async fn run(&self, action: &str) {
        let status = tokio::process::Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/services"))
            .args(["own", self.kind])
            .arg(&self.dir)
            .args([&self.port.to_string(), action])
            .env("LORRY_OWN_OWNER", std::process::id().to_string())
            .status()
            .await
            .expect("running scripts/services");
        assert!(
            status.success(),
            "scripts/services own {} {action}: {status}",
            self.kind
        );
    }
}

impl Drop for OwnService {
    fn drop(&mut self) {
        let _ = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/services"))
            .args(["own", self.kind])
            .arg(&self.dir)
            .args([&self.port.to_string(), "remove"])
            .status();
    }
}
