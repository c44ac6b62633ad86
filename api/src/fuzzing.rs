//! The API's parsers on untrusted bytes, without a database or a broker:
//! the entry points of the `cargo fuzz` targets (`fuzz/`) and of the tests
//! that replay their corpora. Each reads a body as its route does and
//! returns the refusal, if any; a panic, or a refusal with a status that is
//! not 4xx, is a bug.

use std::time::Duration;

use axum::http::HeaderMap;
use lorry_batcher::broker::Topology;
use lorry_batcher::ids::AccountId;
use lorry_batcher::openai::Endpoint;
use lorry_protocol::input::Fields;
use lorry_protocol::lora::AdapterLimits;
use lorry_protocol::{AdapterShape, Catalog, ModelSpec, Task};
use serde_json::Value;

use crate::{batches, files, guard, openai, submit, workers_ai, ApiConfig, ApiError};

/// What a route's checks need: the served models and the API's limits.
pub struct Routes {
    catalog: Catalog,
    config: ApiConfig,
}

/// The OpenAI routes [`Routes::openai`] reads.
pub const OPENAI_ROUTES: [&str; 3] = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"];

/// The models [`Routes::new`] serves: `@lorry/echo`, a text-generation
/// model that takes adapters (the shape of the engine's tiny Llama fixture,
/// whose test adapters fit it), and an embedding model.
pub const MODELS: [&str; 3] = [lorry_protocol::ECHO_MODEL, "@lorry/text", "@lorry/embed"];

impl Default for Routes {
    fn default() -> Self {
        Routes::new()
    }
}

impl Routes {
    /// The three [`MODELS`], with the deployment's default limits.
    pub fn new() -> Self {
        let mut catalog = Catalog::builtin();
        catalog.insert(ModelSpec {
            name: MODELS[1].into(),
            task: Task::TextGeneration,
            adapters: Some(AdapterShape {
                num_layers: 2,
                hidden_size: 64,
                intermediate_size: 160,
                num_heads: 4,
                num_kv_heads: 2,
                head_dim: 16,
            }),
        });
        catalog.insert(ModelSpec {
            name: MODELS[2].into(),
            task: Task::Embeddings,
            adapters: None,
        });
        Routes {
            catalog,
            config: ApiConfig {
                topology: Topology::new("fuzz", 5),
                chunk_size: 64,
                max_requests: 50_000,
                max_body_bytes: 10 << 20,
                max_file_bytes: 200 << 20,
                allow_private_webhooks: false,
                realtime_timeout: Duration::from_secs(60),
                output_url_ttl: Duration::from_secs(3600),
                adapter_limits: AdapterLimits::default(),
                body_pace: guard::BodyPace {
                    grace: Duration::from_secs(10),
                    min_bytes_per_sec: 16 << 10,
                },
                max_uploads: 2,
                admin_token_digest: None,
                quotas: lorry_batcher::quota::Limits::NONE,
            },
        }
    }

    /// `POST /v1/batches` with its requests inline.
    pub fn native_batch(&self, body: &[u8]) -> Result<(), ApiError> {
        let value = json_body(body)?;
        let read = batches::inline(&self.catalog, Fields::new(&value, "")?)?;
        self.validate(read.submission, body)
    }

    /// `POST /client/v4/accounts/{account_id}/ai/run/{model}` for `model`:
    /// a queued batch, a poll, or one request for the real-time lane.
    pub fn workers_ai(&self, model: &str, body: &[u8]) -> Result<(), ApiError> {
        let value = json_body(body)?;
        let spec = submit::model(&self.catalog, model, "model")?;
        if let workers_ai::Run::Queue(submission) = workers_ai::read_run(spec, false, &value)? {
            self.validate(submission, body)?;
        }
        Ok(())
    }

    /// An OpenAI route's body (`/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`).
    pub fn openai(&self, path: &str, body: &[u8]) -> Result<(), ApiError> {
        let endpoint = Endpoint::from_path(path).expect("an OpenAI route");
        let value = json_body(body)?;
        openai::translate(&self.catalog, endpoint, &value).map(|_| ())
    }

    /// A batch input file, as `POST /v1/files` checks it.
    pub fn batch_file(&self, bytes: &[u8]) -> Result<usize, ApiError> {
        files::check_lines(&self.catalog, self.config.max_requests, bytes, |_| Ok(()))
    }

    fn validate(&self, submission: submit::Submission<'_>, raw: &[u8]) -> Result<(), ApiError> {
        let account = AccountId("fuzz".into());
        submit::validate(&self.config, &account, submission, &HeaderMap::new(), raw).map(|_| ())
    }
}

/// A body of a JSON route, as every such route reads it: strict JSON, no U+0000.
pub fn json_body(bytes: &[u8]) -> Result<Value, ApiError> {
    crate::extract::parse_json(bytes)
}

/// An uploaded `adapter_config.json`, checked on its own.
pub fn adapter_config(bytes: &[u8]) -> Result<(), ApiError> {
    lorry_protocol::lora::check_config(bytes, AdapterLimits::default()).map_err(refused)
}

/// An uploaded `adapter_model.safetensors`, checked against [`MODELS`]' text model.
pub fn adapter_weights(bytes: &[u8]) -> Result<(), ApiError> {
    let routes = Routes::new();
    let base = routes
        .catalog
        .adapter_base(MODELS[1])
        .expect("the text model takes adapters");
    lorry_protocol::lora::check_weights(bytes, base, AdapterLimits::default()).map_err(refused)
}

/// Panics unless `outcome` is a success or a refusal the client is told is
/// its own fault (4xx): no input may make the API answer 5xx.
pub fn refused_with_4xx<T>(outcome: Result<T, ApiError>) {
    if let Err(error) = outcome {
        let status = error.status();
        assert!(
            status.is_client_error(),
            "{status} for client input: {:?} {}",
            error.code,
            error.message
        );
    }
}

fn refused(error: lorry_protocol::lora::AdapterError) -> ApiError {
    crate::adapters::refused(error, "config", "weights")
}
