//! Typed settings, one group per subsystem: defaults, overridden by a TOML
//! file (`--config`), by `LORRY_*` environment variables, then by
//! command-line flags. Every operational number lives here, none in the wiring.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use anyhow::Context as _;
use lorry_api::guard::BodyPace;
use lorry_api::serve::ServeLimits;
use lorry_api::ApiConfig;
use lorry_batcher::adapters::TiersConfig;
use lorry_batcher::broker::Topology;
use lorry_batcher::finaliser::FinaliserConfig;
use lorry_batcher::objects::ObjectStoreConfig;
use lorry_batcher::relay::RelayConfig;
use lorry_batcher::webhooks::WebhookConfig;
use lorry_batcher::worker::WorkerConfig;
use lorry_engine::adapters::AdaptersConfig;
use lorry_engine::catalog::{default_models, default_specs, read_catalog_file, ModelSource};
use lorry_engine::lora::AdapterLimits;
use lorry_engine::ModelSpec;

use crate::offline::EngineArgs;

/// A secret that never prints.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// The secret itself; call only where it is used.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret([redacted])")
    }
}

impl FromStr for Secret {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Secret(s.to_string()))
    }
}

/// Everything a Lorry process needs to know, one group per subsystem.
/// Each value is a flag and an environment variable; a TOML file named by
/// `--config` (`LORRY_CONFIG`) gives defaults of its own, under the flags'
/// names (`chunk_size = 128`): defaults, then the file, then the
/// environment, then the command line.
#[derive(clap::Args, Clone, Debug)]
pub struct Settings {
    /// A TOML file of settings, keyed by flag name with underscores.
    #[arg(long, env = "LORRY_CONFIG")]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub services: Services,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub api: ApiSettings,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub worker: WorkerSettings,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub webhooks: WebhookSettings,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub models: ModelSettings,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub adapters: AdapterSettings,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub quotas: QuotaSettings,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub engine: EngineArgs,
}

/// Each account's limits, unless it has its own (`lorry accounts set-quota`); 0 is no limit.
#[derive(clap::Args, Clone, Debug)]
pub struct QuotaSettings {
    /// Batch requests an account may have accepted and not yet ended, across its batches.
    #[arg(long, env = "LORRY_QUOTA_QUEUED_REQUESTS", default_value_t = 1_000_000)]
    pub quota_queued_requests: u64,
    /// Real-time requests an account may make a second (per API process; bursts of one second's worth).
    #[arg(long, env = "LORRY_QUOTA_REALTIME_PER_SECOND", default_value_t = 100.0)]
    pub quota_realtime_per_second: f64,
    /// Bytes of files an account may hold (uploads and batch output files).
    #[arg(long, env = "LORRY_QUOTA_FILE_BYTES", default_value_t = 10 << 30)]
    pub quota_file_bytes: u64,
    /// Adapters an account may hold.
    #[arg(long, env = "LORRY_QUOTA_ADAPTERS", default_value_t = 1000)]
    pub quota_adapters: u64,
}

/// Postgres, RabbitMQ and S3.
#[derive(clap::Args, Clone, Debug)]
pub struct Services {
    /// Postgres URL.
    #[arg(
        long,
        env = "LORRY_DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/lorry"
    )]
    pub database_url: String,
    /// Postgres connections per process.
    #[arg(long, env = "LORRY_DB_POOL_SIZE", default_value_t = 16)]
    pub db_pool_size: u32,
    /// RabbitMQ URL.
    #[arg(
        long,
        env = "LORRY_AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    pub amqp_url: String,
    /// Prefix of every queue and exchange.
    #[arg(long, env = "LORRY_QUEUE_PREFIX", default_value = "lorry")]
    pub queue_prefix: String,
    /// S3-compatible endpoint; unset means AWS S3.
    #[arg(long, env = "LORRY_S3_ENDPOINT")]
    pub s3_endpoint: Option<String>,
    /// Bucket for outputs (created at start-up if missing).
    #[arg(long, env = "LORRY_S3_BUCKET", default_value = "lorry")]
    pub s3_bucket: String,
    /// S3 region.
    #[arg(long, env = "LORRY_S3_REGION", default_value = "us-east-1")]
    pub s3_region: String,
    /// S3 access key id.
    #[arg(long, env = "AWS_ACCESS_KEY_ID", default_value = "")]
    pub s3_access_key: String,
    /// S3 secret access key.
    #[arg(
        long,
        env = "AWS_SECRET_ACCESS_KEY",
        default_value = "",
        hide_env_values = true,
        hide_default_value = true
    )]
    pub s3_secret_key: Secret,
}

/// The HTTP API.
#[derive(clap::Args, Clone, Debug)]
pub struct ApiSettings {
    /// Address the HTTP API listens on.
    #[arg(long, env = "LORRY_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: String,
    /// Ensure an account `default` whose API token is this.
    #[arg(long, env = "LORRY_BOOTSTRAP_TOKEN", hide_env_values = true)]
    pub bootstrap_token: Option<Secret>,
    /// The operator's token for the `/admin/v1` routes (accounts and keys);
    /// without it they are not served.
    #[arg(long, env = "LORRY_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<Secret>,
    /// Largest request body in bytes.
    #[arg(long, env = "LORRY_MAX_BODY_BYTES", default_value_t = 10 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Largest batch input file (`POST /v1/files`) in bytes.
    #[arg(long, env = "LORRY_MAX_FILE_BYTES", default_value_t = 200 * 1024 * 1024)]
    pub max_file_bytes: usize,
    /// Most requests in one batch.
    #[arg(long, env = "LORRY_MAX_BATCH_REQUESTS", default_value_t = 50_000)]
    pub max_batch_requests: usize,
    /// Requests per batch-lane message.
    #[arg(long, env = "LORRY_CHUNK_SIZE", default_value_t = 64)]
    pub chunk_size: usize,
    /// Real-time requests waiting per model before new ones get 429.
    #[arg(long, env = "LORRY_RT_MAX_DEPTH", default_value_t = 64)]
    pub rt_max_depth: u32,
    /// Seconds a real-time request may wait for its answer.
    #[arg(long, env = "LORRY_RT_TIMEOUT_SECS", default_value_t = 60)]
    pub rt_timeout_secs: u64,
    /// Seconds a presigned output or error file URL stays valid.
    #[arg(long, env = "LORRY_OUTPUT_URL_TTL_SECS", default_value_t = 3600)]
    pub output_url_ttl_secs: u64,
    /// Connections served at once (more are answered 503 and closed); it is
    /// lowered to leave a quarter of the process's descriptor limit free.
    #[arg(long, env = "LORRY_MAX_CONNECTIONS", default_value_t = 4096)]
    pub max_connections: usize,
    /// Seconds a request's head (or a kept-alive connection's next request) may take to arrive.
    #[arg(long, env = "LORRY_HEADER_TIMEOUT_SECS", default_value_t = 10)]
    pub header_timeout_secs: u64,
    /// Seconds a request body may take before `LORRY_BODY_MIN_RATE` applies.
    #[arg(long, env = "LORRY_BODY_TIMEOUT_SECS", default_value_t = 10)]
    pub body_timeout_secs: u64,
    /// Bytes a second a request body must average after `LORRY_BODY_TIMEOUT_SECS`, or 408.
    #[arg(long, env = "LORRY_BODY_MIN_RATE", default_value_t = 16 * 1024)]
    pub body_min_rate: u64,
    /// Uploads (batch files, adapter files) read and checked at once; more get 503.
    #[arg(long, env = "LORRY_MAX_UPLOADS", default_value_t = 2)]
    pub max_uploads: usize,
}

/// The worker: both lanes, the outbox relay, the finaliser and its sweeper.
#[derive(clap::Args, Clone, Debug)]
pub struct WorkerSettings {
    /// Deliveries of one message before it is dead-lettered.
    #[arg(long, env = "LORRY_DELIVERY_LIMIT", default_value_t = 5)]
    pub delivery_limit: u32,
    /// Batch-lane messages a worker holds at once per model, from its batch
    /// queue and as many again from its queue ahead.
    #[arg(long, env = "LORRY_BATCH_PREFETCH", default_value_t = 4)]
    pub batch_prefetch: u16,
    /// Real-time requests a worker holds at once per model.
    #[arg(long, env = "LORRY_RT_PREFETCH", default_value_t = 16)]
    pub rt_prefetch: u16,
    /// Results committed per statement, at most.
    #[arg(long, env = "LORRY_COMMIT_ROWS", default_value_t = 32)]
    pub commit_rows: usize,
    /// Milliseconds a finished result waits for others to share its commit.
    #[arg(long, env = "LORRY_COMMIT_INTERVAL_MS", default_value_t = 50)]
    pub commit_interval_ms: u64,
    /// Milliseconds between sweeps (expiry, stalled batches).
    #[arg(long, env = "LORRY_SWEEP_INTERVAL_MS", default_value_t = 1000)]
    pub sweep_interval_ms: u64,
    /// Milliseconds between `batch.progress` events (and webhooks) of a running batch.
    #[arg(long, env = "LORRY_PROGRESS_INTERVAL_MS", default_value_t = 5000)]
    pub progress_interval_ms: u64,
    /// Seconds a batch may stay `finalizing` before a sweeper takes it over (its finaliser died).
    #[arg(long, env = "LORRY_FINALIZE_STALE_SECS", default_value_t = 60)]
    pub finalize_stale_secs: u64,
    /// Outbox messages the relay publishes per round.
    #[arg(long, env = "LORRY_RELAY_BATCH", default_value_t = 500)]
    pub relay_batch: i64,
    /// Milliseconds between the relay's polls when no notification wakes it.
    #[arg(long, env = "LORRY_RELAY_POLL_MS", default_value_t = 500)]
    pub relay_poll_ms: u64,
    /// Days after which ended batches (their rows and S3 objects) and uploaded
    /// files are deleted; 0 keeps them.
    #[arg(long, env = "LORRY_RETENTION_DAYS", default_value_t = 0)]
    pub retention_days: u64,
    /// Ready chunk messages the relay keeps in each model's batch queue (and
    /// its queue ahead); the rest wait in Postgres and go out by account, the
    /// one with the fewest chunks in flight first.
    #[arg(long, env = "LORRY_DISPATCH_DEPTH", default_value_t = 4)]
    pub dispatch_depth: u32,
    /// Milliseconds between the relay's top-ups of batch queues while chunks
    /// are held, beside the wake-up each acked chunk sends.
    #[arg(long, env = "LORRY_DISPATCH_POLL_MS", default_value_t = 200)]
    pub dispatch_poll_ms: u64,
    /// Milliseconds the echo model spends on each request (tests and benchmarks).
    #[arg(long, env = "LORRY_ECHO_DELAY_MS", default_value_t = 0)]
    pub echo_delay_ms: u64,
    /// Threads a worker's engines compute on; 0: one fewer than the CPUs, so
    /// the API, the worker's I/O and the services beside them keep a core.
    #[arg(long, env = "LORRY_ENGINE_THREADS", default_value_t = 0)]
    pub engine_threads: usize,
    /// Whose requests may reuse each other's prefix-cache blocks: `account`
    /// (each account its own: a cache hit tells nothing of another's prompts)
    /// or `deployment` (every account shares: only where all are trusted).
    #[arg(long, env = "LORRY_PREFIX_CACHE_SCOPE", default_value = "account", value_parser = ["account", "deployment"])]
    pub prefix_cache_scope: String,
    /// Where a worker serves `/healthz`, `/readyz` and `/metrics` (for
    /// example `0.0.0.0:9090`); unset, it serves none.
    #[arg(long, env = "LORRY_WORKER_LISTEN")]
    pub worker_listen: Option<String>,
}

/// Completion webhooks.
#[derive(clap::Args, Clone, Debug)]
pub struct WebhookSettings {
    /// Allow webhook targets on loopback and private networks.
    #[arg(long = "webhook-allow-private", env = "LORRY_WEBHOOK_ALLOW_PRIVATE", value_parser = clap::builder::BoolishValueParser::new())]
    pub allow_private: bool,
    /// Milliseconds before the first webhook retry; later retries double, with jitter.
    #[arg(
        long = "webhook-min-backoff-ms",
        env = "LORRY_WEBHOOK_MIN_BACKOFF_MS",
        default_value_t = 1000
    )]
    pub min_backoff_ms: u64,
    /// Seconds the webhook retry backoff grows to, at most.
    #[arg(
        long = "webhook-max-backoff-secs",
        env = "LORRY_WEBHOOK_MAX_BACKOFF_SECS",
        default_value_t = 3600
    )]
    pub max_backoff_secs: u64,
    /// Webhook attempts before a delivery is given up.
    #[arg(
        long = "webhook-max-attempts",
        env = "LORRY_WEBHOOK_MAX_ATTEMPTS",
        default_value_t = 10
    )]
    pub max_attempts: u32,
    /// Seconds one webhook attempt may take.
    #[arg(
        long = "webhook-timeout-secs",
        env = "LORRY_WEBHOOK_TIMEOUT_SECS",
        default_value_t = 10
    )]
    pub timeout_secs: u64,
    /// Milliseconds between looks for due deliveries.
    #[arg(long = "webhook-poll-ms", env = "LORRY_WEBHOOK_POLL_MS", default_value_t = 200)]
    pub poll_ms: u64,
}

/// Which models are served, and where Lorry keeps its files.
#[derive(clap::Args, Clone, Debug)]
pub struct ModelSettings {
    /// The model catalogue: a JSON file mapping served names to checkpoint
    /// directories or GGUF files. Unset: the default models (SmolLM2 and
    /// all-MiniLM where fetched, else the demo models).
    #[arg(long = "models", env = "LORRY_MODELS", value_name = "MODELS")]
    pub catalogue: Option<PathBuf>,
    /// Where Lorry keeps its own files (the demo models); `$XDG_DATA_HOME/lorry`
    /// or `~/.local/share/lorry` when unset.
    #[arg(long, env = "LORRY_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
}

/// LoRA adapters: what an upload may hold, and what a worker keeps of them.
#[derive(clap::Args, Clone, Debug)]
pub struct AdapterSettings {
    /// Highest LoRA rank an uploaded adapter may have.
    #[arg(long = "adapter-max-rank", env = "LORRY_ADAPTER_MAX_RANK", default_value_t = 32)]
    pub max_rank: usize,
    /// Largest `adapter_model.safetensors` an upload may bring, in bytes.
    #[arg(long = "adapter-max-bytes", env = "LORRY_ADAPTER_MAX_BYTES", default_value_t = 300 * 1024 * 1024)]
    pub max_bytes: usize,
    /// Memory a worker gives packed adapters in use, in MiB (the resident tier).
    #[arg(
        long = "adapter-resident-mib",
        env = "LORRY_ADAPTER_RESIDENT_MIB",
        default_value_t = 2048
    )]
    pub resident_mib: usize,
    /// Memory a worker gives raw adapter files, in MiB (the host tier).
    #[arg(long = "adapter-host-mib", env = "LORRY_ADAPTER_HOST_MIB", default_value_t = 1024)]
    pub host_mib: usize,
    /// Disk a worker gives adapter files under the data directory, in MiB.
    #[arg(long = "adapter-disk-mib", env = "LORRY_ADAPTER_DISK_MIB", default_value_t = 20480)]
    pub disk_mib: u64,
    /// Milliseconds an adapter waits for room before requests for resident ones are held back for it.
    #[arg(long = "adapter-cycle-ms", env = "LORRY_ADAPTER_CYCLE_MS", default_value_t = 2000)]
    pub cycle_ms: u64,
}

#[derive(clap::Parser)]
struct SettingsOnly {
    #[command(flatten)]
    settings: Settings,
}

impl Settings {
    /// Defaults, then the file `LORRY_CONFIG` names, then the environment (no command line).
    pub fn from_env() -> anyhow::Result<Self> {
        use clap::{CommandFactory as _, FromArgMatches as _};
        let file = std::env::var_os("LORRY_CONFIG").map(PathBuf::from);
        let command = with_file_defaults(SettingsOnly::command(), file.as_deref())?;
        let matches = command.try_get_matches_from(["lorry"])?;
        Ok(SettingsOnly::from_arg_matches(&matches)?.settings)
    }

    /// The data directory, resolved.
    pub fn data_dir(&self) -> PathBuf {
        if let Some(dir) = &self.models.data_dir {
            return dir.clone();
        }
        let home = std::env::var_os("HOME")
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        std::env::var_os("XDG_DATA_HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| home.join(".local/share"))
            .join("lorry")
    }

    /// The served models other than the echo model: the catalogue file's, or
    /// the default ones (SmolLM2 and all-MiniLM where fetched, else the demo models).
    pub fn model_sources(&self) -> anyhow::Result<Vec<ModelSource>> {
        match &self.models.catalogue {
            Some(file) => Ok(read_catalog_file(file)?),
            None => {
                let dir = self.data_dir();
                let (sources, why) = default_models(&dir)
                    .with_context(|| format!("reading the default models under {}", dir.display()))?;
                warn_defaults(why);
                Ok(sources)
            }
        }
    }

    /// The manifests of [`Settings::model_sources`], resolved without reading
    /// any weights or writing the demo models: what the API role needs.
    pub fn model_specs(&self) -> anyhow::Result<Vec<ModelSpec>> {
        match &self.models.catalogue {
            Some(file) => Ok(read_catalog_file(file)?.iter().map(ModelSource::spec).collect()),
            None => {
                let dir = self.data_dir();
                let (specs, why) = default_specs(&dir)
                    .with_context(|| format!("reading the default models under {}", dir.display()))?;
                warn_defaults(why);
                Ok(specs)
            }
        }
    }

    /// What an uploaded adapter must keep within.
    pub fn adapter_limits(&self) -> AdapterLimits {
        AdapterLimits {
            max_rank: self.adapters.max_rank,
            max_bytes: self.adapters.max_bytes,
        }
    }

    /// How much the engines keep resident of adapters, and the cycle.
    pub fn adapter_residency(&self) -> AdaptersConfig {
        let a = &self.adapters;
        AdaptersConfig {
            resident_bytes: a.resident_mib << 20,
            cycle: Duration::from_millis(a.cycle_ms),
            limits: self.adapter_limits(),
        }
    }

    /// The worker's tiers of adapter files.
    pub fn adapter_tiers(&self) -> TiersConfig {
        let a = &self.adapters;
        TiersConfig {
            host_bytes: a.host_mib << 20,
            disk_dir: Some(self.data_dir().join("adapters")),
            disk_bytes: a.disk_mib << 20,
        }
    }

    /// Threads the engines compute on: `engine_threads`, or one fewer than the CPUs.
    pub fn engine_threads(&self) -> usize {
        match self.worker.engine_threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get().saturating_sub(1).max(1)),
            n => n,
        }
    }

    /// The real-time timeout.
    pub fn rt_timeout(&self) -> Duration {
        Duration::from_secs(self.api.rt_timeout_secs)
    }

    /// The S3 bucket.
    pub fn object_store(&self) -> ObjectStoreConfig {
        let s = &self.services;
        ObjectStoreConfig {
            endpoint: s.s3_endpoint.clone(),
            bucket: s.s3_bucket.clone(),
            region: s.s3_region.clone(),
            access_key: s.s3_access_key.clone(),
            secret_key: s.s3_secret_key.expose().to_string(),
        }
    }

    /// The queues and exchanges.
    pub fn topology(&self) -> Topology {
        Topology::new(&self.services.queue_prefix, self.worker.delivery_limit)
    }

    /// The outbox relay, publishing for `models`.
    pub fn relay(&self, models: Vec<String>) -> RelayConfig {
        RelayConfig {
            amqp_url: self.services.amqp_url.clone(),
            topology: self.topology(),
            models,
            batch_size: self.worker.relay_batch,
            poll: Duration::from_millis(self.worker.relay_poll_ms),
            dispatch_depth: self.worker.dispatch_depth.max(1),
            dispatch_poll: Duration::from_millis(self.worker.dispatch_poll_ms.max(1)),
        }
    }

    /// The API's limits.
    pub fn api_config(&self) -> ApiConfig {
        let a = &self.api;
        ApiConfig {
            topology: self.topology(),
            chunk_size: a.chunk_size,
            max_requests: a.max_batch_requests,
            max_body_bytes: a.max_body_bytes,
            max_file_bytes: a.max_file_bytes,
            allow_private_webhooks: self.webhooks.allow_private,
            realtime_timeout: self.rt_timeout(),
            output_url_ttl: Duration::from_secs(a.output_url_ttl_secs),
            adapter_limits: self.adapter_limits(),
            body_pace: BodyPace {
                grace: Duration::from_secs(a.body_timeout_secs),
                min_bytes_per_sec: a.body_min_rate.max(1),
            },
            max_uploads: a.max_uploads.max(1),
            quotas: self.quota_defaults(),
            admin_token_digest: a
                .admin_token
                .as_ref()
                .filter(|t| !t.expose().is_empty())
                .map(|t| lorry_api::admin::digest(t.expose())),
        }
    }

    /// The deployment's per-account limits.
    pub fn quota_defaults(&self) -> lorry_batcher::quota::Limits {
        let q = &self.quotas;
        lorry_batcher::quota::Limits {
            queued_requests: q.quota_queued_requests,
            realtime_per_second: if q.quota_realtime_per_second.is_finite() {
                q.quota_realtime_per_second.max(0.0)
            } else {
                0.0
            },
            file_bytes: q.quota_file_bytes,
            adapters: q.quota_adapters,
        }
    }

    /// The listener's bounds: `LORRY_MAX_CONNECTIONS`, kept to three
    /// quarters of the descriptor limit (`open_files`) so that the database
    /// pool, the broker, S3, model files and the shedding of connections
    /// over the cap always find descriptors.
    pub fn serve_limits(&self, open_files: u64) -> ServeLimits {
        let headroom = (open_files / 4).max(64);
        let fits = open_files.saturating_sub(headroom).max(1);
        ServeLimits {
            max_connections: (self.api.max_connections as u64).clamp(1, fits) as usize,
            header_timeout: Duration::from_secs(self.api.header_timeout_secs.max(1)),
            drain_timeout: Duration::from_secs(30),
        }
    }

    /// How batches are ended and reported.
    pub fn finaliser(&self) -> FinaliserConfig {
        FinaliserConfig {
            stale_after: Duration::from_secs(self.worker.finalize_stale_secs),
            progress_every: Duration::from_millis(self.worker.progress_interval_ms),
            retention: (self.worker.retention_days > 0)
                .then(|| Duration::from_secs(self.worker.retention_days.saturating_mul(24 * 3600))),
        }
    }

    /// The worker's consumers and commits.
    pub fn worker_config(&self) -> WorkerConfig {
        let w = &self.worker;
        WorkerConfig {
            amqp_url: self.services.amqp_url.clone(),
            topology: self.topology(),
            batch_prefetch: w.batch_prefetch,
            rt_prefetch: w.rt_prefetch,
            flush_rows: w.commit_rows,
            flush_interval: Duration::from_millis(w.commit_interval_ms),
            share_prefix_cache: w.prefix_cache_scope == "deployment",
        }
    }

    /// Webhook delivery.
    pub fn webhook_config(&self) -> WebhookConfig {
        let w = &self.webhooks;
        WebhookConfig {
            min_backoff: Duration::from_millis(w.min_backoff_ms),
            max_backoff: Duration::from_secs(w.max_backoff_secs),
            max_attempts: w.max_attempts,
            timeout: Duration::from_secs(w.timeout_secs),
            allow_private: w.allow_private,
        }
    }
}

fn warn_defaults(why: Option<String>) {
    if let Some(why) = why {
        tracing::warn!("{why}");
    }
}

/// `command` with the settings `file` gives as the defaults of its flags,
/// in every subcommand that takes them: keys are flag names with
/// underscores; an unknown key, or a value of a type no flag takes, is an
/// error naming it.
pub fn with_file_defaults(command: clap::Command, file: Option<&Path>) -> anyhow::Result<clap::Command> {
    let Some(file) = file else {
        return Ok(command);
    };
    let text = std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let table: toml::Table = text.parse().with_context(|| format!("{}: not TOML", file.display()))?;
    let mut defaults = Vec::new();
    for (key, value) in table {
        let text = match value {
            toml::Value::String(s) => s,
            toml::Value::Integer(n) => n.to_string(),
            toml::Value::Float(x) => x.to_string(),
            toml::Value::Boolean(b) => b.to_string(),
            _ => anyhow::bail!("{}: {key} must be a string, a number or a boolean", file.display()),
        };
        defaults.push((key.replace('_', "-"), text));
    }
    let mut command = command;
    let mut known = std::collections::HashSet::new();
    for (long, value) in &defaults {
        command = apply_default(command, long, value, &mut known);
    }
    if let Some((long, _)) = defaults.iter().find(|(long, _)| !known.contains(long)) {
        anyhow::bail!("{}: {} is not a setting", file.display(), long.replace('-', "_"));
    }
    Ok(command)
}

/// Set the default of the flag `--long` in `command` and its subcommands.
fn apply_default(
    mut command: clap::Command,
    long: &str,
    value: &str,
    known: &mut std::collections::HashSet<String>,
) -> clap::Command {
    let id = command
        .get_arguments()
        .find(|a| a.get_long() == Some(long) && a.get_env().is_some())
        .map(|a| a.get_id().clone());
    if let Some(id) = id {
        known.insert(long.to_string());
        command = command.mut_arg(id, |a| a.default_value(value.to_string()));
    }
    let names: Vec<String> = command.get_subcommands().map(|c| c.get_name().to_string()).collect();
    for name in names {
        command = command.mut_subcommand(name, |sub| apply_default(sub, long, value, known));
    }
    command
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory as _, FromArgMatches as _};

    use super::*;

    fn parse(file: &Path, args: &[&str]) -> anyhow::Result<Settings> {
        let command = with_file_defaults(SettingsOnly::command(), Some(file))?;
        let matches = command.try_get_matches_from(args)?;
        Ok(SettingsOnly::from_arg_matches(&matches)?.settings)
    }

    fn file(name: &str, text: &str) -> PathBuf {
        let path = std::env::temp_dir().join(format!("lorry-settings-{}-{name}.toml", std::process::id()));
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn a_settings_file_gives_defaults_that_flags_override() {
        let path = file(
            "layers",
            "chunk_size = 128\nwebhook_timeout_secs = 3\ns3_bucket = \"from-file\"\nwebhook_allow_private = true\n",
        );
        let from_file = parse(&path, &["lorry"]).unwrap();
        assert_eq!(from_file.api.chunk_size, 128);
        assert_eq!(from_file.webhook_config().timeout, Duration::from_secs(3));
        assert_eq!(from_file.services.s3_bucket, "from-file");
        assert!(from_file.webhooks.allow_private);
        // Untouched settings keep their defaults.
        assert_eq!(from_file.worker.relay_batch, 500);
        let flagged = parse(&path, &["lorry", "--chunk-size", "7"]).unwrap();
        assert_eq!(flagged.api.chunk_size, 7);
        let _ = std::fs::remove_file(path);
    }

    #[test]
    fn a_settings_file_applies_inside_subcommands() {
        let path = file("sub", "rt_prefetch = 3\n");
        let command = clap::Command::new("lorry").subcommand(SettingsOnly::command().name("worker"));
        let matches = with_file_defaults(command, Some(&path))
            .unwrap()
            .try_get_matches_from(["lorry", "worker"])
            .unwrap();
        let (_, sub) = matches.subcommand().unwrap();
        let settings = SettingsOnly::from_arg_matches(sub).unwrap().settings;
        assert_eq!(settings.worker_config().rt_prefetch, 3);
        let _ = std::fs::remove_file(path);
    }

    #[test]
    fn an_unknown_or_mistyped_setting_is_refused_by_name() {
        let path = file("unknown", "chunk_sise = 1\n");
        let error = parse(&path, &["lorry"]).unwrap_err().to_string();
        assert!(error.contains("chunk_sise is not a setting"), "{error}");
        let path = file("mistyped", "chunk_size = \"many\"\n");
        let error = format!("{:#}", parse(&path, &["lorry"]).unwrap_err());
        assert!(error.contains("chunk-size"), "{error}");
        let path = file("table", "[worker]\nrt_prefetch = 1\n");
        assert!(parse(&path, &["lorry"]).is_err());
        let _ = std::fs::remove_file(path);
    }
}
