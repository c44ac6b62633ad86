//! Typed settings: defaults, overridden by `LORRY_*` environment variables,
//! overridden by command-line flags.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use anyhow::Context as _;
use lorry_batcher::adapters::AdapterCacheConfig;
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

/// Everything a Lorry process needs to know.
#[derive(clap::Args, Clone, Debug)]
pub struct Settings {
    /// Postgres URL.
    #[arg(
        long,
        env = "LORRY_DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/lorry"
    )]
    pub database_url: String,
    /// RabbitMQ URL.
    #[arg(
        long,
        env = "LORRY_AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    pub amqp_url: String,
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
    /// Address the HTTP API listens on.
    #[arg(long, env = "LORRY_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: String,
    /// Prefix of every queue and exchange.
    #[arg(long, env = "LORRY_QUEUE_PREFIX", default_value = "lorry")]
    pub queue_prefix: String,
    /// Ensure an account `default` whose API token is this.
    #[arg(long, env = "LORRY_BOOTSTRAP_TOKEN", hide_env_values = true)]
    pub bootstrap_token: Option<Secret>,
    /// Allow webhook targets on loopback and private networks.
    #[arg(long, env = "LORRY_WEBHOOK_ALLOW_PRIVATE", value_parser = clap::builder::BoolishValueParser::new())]
    pub webhook_allow_private: bool,
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
    /// Deliveries of one message before it is dead-lettered.
    #[arg(long, env = "LORRY_DELIVERY_LIMIT", default_value_t = 5)]
    pub delivery_limit: u32,
    /// Real-time requests waiting per model before new ones get 429.
    #[arg(long, env = "LORRY_RT_MAX_DEPTH", default_value_t = 64)]
    pub rt_max_depth: u32,
    /// Seconds a real-time request may wait for its answer.
    #[arg(long, env = "LORRY_RT_TIMEOUT_SECS", default_value_t = 60)]
    pub rt_timeout_secs: u64,
    /// Batch-lane messages a worker holds at once per model.
    #[arg(long, env = "LORRY_BATCH_PREFETCH", default_value_t = 4)]
    pub batch_prefetch: u16,
    /// Milliseconds between sweeps (expiry, stalled batches).
    #[arg(long, env = "LORRY_SWEEP_INTERVAL_MS", default_value_t = 1000)]
    pub sweep_interval_ms: u64,
    /// Milliseconds between `batch.progress` events (and webhooks) of a running batch.
    #[arg(long, env = "LORRY_PROGRESS_INTERVAL_MS", default_value_t = 5000)]
    pub progress_interval_ms: u64,
    /// Milliseconds before the first webhook retry; later retries double, with jitter.
    #[arg(long, env = "LORRY_WEBHOOK_MIN_BACKOFF_MS", default_value_t = 1000)]
    pub webhook_min_backoff_ms: u64,
    /// Webhook attempts before a delivery is given up.
    #[arg(long, env = "LORRY_WEBHOOK_MAX_ATTEMPTS", default_value_t = 10)]
    pub webhook_max_attempts: u32,
    /// Milliseconds the echo model spends on each request (tests and benchmarks).
    #[arg(long, env = "LORRY_ECHO_DELAY_MS", default_value_t = 0)]
    pub echo_delay_ms: u64,
    /// The model catalogue: a JSON file mapping served names to checkpoint
    /// directories. Unset: `@lorry/echo`, `@lorry/demo-llama` and `@lorry/demo-bge`.
    #[arg(long, env = "LORRY_MODELS")]
    pub models: Option<PathBuf>,
    /// Where Lorry keeps its own files (the demo models); `$XDG_DATA_HOME/lorry`
    /// or `~/.local/share/lorry` when unset.
    #[arg(long, env = "LORRY_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Highest LoRA rank an uploaded adapter may have.
    #[arg(long, env = "LORRY_ADAPTER_MAX_RANK", default_value_t = 32)]
    pub adapter_max_rank: usize,
    /// Largest `adapter_model.safetensors` an upload may bring, in bytes.
    #[arg(long, env = "LORRY_ADAPTER_MAX_BYTES", default_value_t = 300 * 1024 * 1024)]
    pub adapter_max_bytes: usize,
    /// Memory a worker gives packed adapters in use, in MiB (the resident tier).
    #[arg(long, env = "LORRY_ADAPTER_RESIDENT_MIB", default_value_t = 2048)]
    pub adapter_resident_mib: usize,
    /// Memory a worker gives raw adapter files, in MiB (the host tier).
    #[arg(long, env = "LORRY_ADAPTER_HOST_MIB", default_value_t = 1024)]
    pub adapter_host_mib: usize,
    /// Disk a worker gives adapter files under the data directory, in MiB.
    #[arg(long, env = "LORRY_ADAPTER_DISK_MIB", default_value_t = 20480)]
    pub adapter_disk_mib: u64,
    /// Milliseconds an adapter waits for room before requests for resident ones are held back for it.
    #[arg(long, env = "LORRY_ADAPTER_CYCLE_MS", default_value_t = 2000)]
    pub adapter_cycle_ms: u64,
    /// Threads a worker's engines compute on; 0: one fewer than the CPUs, so
    /// the API, the worker's I/O and the services beside them keep a core.
    #[arg(long, env = "LORRY_ENGINE_THREADS", default_value_t = 0)]
    pub engine_threads: usize,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub engine: EngineArgs,
}

#[derive(clap::Parser)]
struct SettingsOnly {
    #[command(flatten)]
    settings: Settings,
}

impl Settings {
    /// Defaults overridden by the environment (no command line).
    pub fn from_env() -> Result<Self, clap::Error> {
        use clap::Parser as _;
        SettingsOnly::try_parse_from(["lorry"]).map(|s| s.settings)
    }

    /// The data directory, resolved.
    pub fn data_dir(&self) -> PathBuf {
        if let Some(dir) = &self.data_dir {
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
        match &self.models {
            Some(file) => Ok(read_catalog_file(file)?),
            None => {
                let dir = self.data_dir();
                let (sources, why) = default_models(&dir)
                    .with_context(|| format!("reading the default models under {}", dir.display()))?;
                if let Some(why) = why {
                    tracing::warn!("{why}");
                }
                Ok(sources)
            }
        }
    }

    /// The manifests of [`Settings::model_sources`], resolved without reading
    /// any weights or writing the demo models: what the API role needs.
    pub fn model_specs(&self) -> anyhow::Result<Vec<ModelSpec>> {
        match &self.models {
            Some(file) => Ok(read_catalog_file(file)?.iter().map(ModelSource::spec).collect()),
            None => {
                let dir = self.data_dir();
                let (specs, why) = default_specs(&dir)
                    .with_context(|| format!("reading the default models under {}", dir.display()))?;
                if let Some(why) = why {
                    tracing::warn!("{why}");
                }
                Ok(specs)
            }
        }
    }

    /// What an uploaded adapter must keep within.
    pub fn adapter_limits(&self) -> AdapterLimits {
        AdapterLimits {
            max_rank: self.adapter_max_rank,
            max_bytes: self.adapter_max_bytes,
        }
    }

    /// The worker's adapter cache sizes.
    pub fn adapter_cache(&self) -> AdapterCacheConfig {
        AdapterCacheConfig {
            resident_bytes: self.adapter_resident_mib << 20,
            host_bytes: self.adapter_host_mib << 20,
            disk_dir: Some(self.data_dir().join("adapters")),
            disk_bytes: self.adapter_disk_mib << 20,
            cycle: Duration::from_millis(self.adapter_cycle_ms),
            limits: self.adapter_limits(),
        }
    }

    /// Threads the engines compute on: `engine_threads`, or one fewer than the CPUs.
    pub fn engine_threads(&self) -> usize {
        match self.engine_threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get().saturating_sub(1).max(1)),
            n => n,
        }
    }

    /// The real-time timeout.
    pub fn rt_timeout(&self) -> Duration {
        Duration::from_secs(self.rt_timeout_secs)
    }
}
