//! Lorry's HTTP surface (axum).
//!
//! The API validates everything before it accepts anything, writes a batch,
//! its requests and its outbox in one transaction, and answers only after the
//! commit. It never batches and never runs a model: real-time requests are
//! handed to the real-time lane and awaited.
#![forbid(unsafe_code)]

mod account;
mod adapters;
mod batches;
pub mod error;
mod extract;
mod files;
pub mod guard;
mod health;
mod lane;
pub mod openai;
pub mod serve;
mod submit;
mod workers_ai;

use std::sync::Arc;
use std::time::Duration;

use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use axum::Router;
use lorry_batcher::broker::Topology;
use lorry_batcher::objects::ObjectStore;
use lorry_batcher::realtime::RealtimeClient;
use lorry_batcher::store::Store;
use lorry_protocol::lora::AdapterLimits;
use lorry_protocol::Catalog;
use lorry_protocol::ErrorCode;

pub use error::ApiError;

/// The API's settings.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// Queue names, for the outbox messages a batch writes.
    pub topology: Topology,
    /// Requests per batch-lane message.
    pub chunk_size: usize,
    /// Most requests in one batch.
    pub max_requests: usize,
    /// Largest request body, in bytes.
    pub max_body_bytes: usize,
    /// Largest batch input file, in bytes.
    pub max_file_bytes: usize,
    /// Allow webhook targets on loopback and private networks.
    pub allow_private_webhooks: bool,
    /// How long a real-time request may wait for its answer.
    pub realtime_timeout: Duration,
    /// How long a presigned `output_url` stays valid.
    pub output_url_ttl: Duration,
    /// What an uploaded adapter must keep within.
    pub adapter_limits: AdapterLimits,
    /// The slowest a request body may arrive.
    pub body_pace: guard::BodyPace,
    /// Uploads (batch files, adapter files) read and checked at once; more
    /// are answered 503 with `Retry-After` (each may hold its whole file).
    pub max_uploads: usize,
}

/// What every handler can reach; cheap to clone.
#[derive(Clone)]
pub struct AppState {
    /// Postgres.
    pub store: Store,
    /// S3.
    pub objects: ObjectStore,
    /// The real-time lane.
    pub realtime: RealtimeClient,
    /// The served models.
    pub catalog: Arc<Catalog>,
    /// Settings.
    pub config: Arc<ApiConfig>,
    /// Permits for uploads in progress.
    uploads: Arc<tokio::sync::Semaphore>,
}

impl AppState {
    /// The state of an API over these services, with these settings.
    pub fn new(
        store: Store,
        objects: ObjectStore,
        realtime: RealtimeClient,
        catalog: Arc<Catalog>,
        config: Arc<ApiConfig>,
    ) -> Self {
        let uploads = Arc::new(tokio::sync::Semaphore::new(config.max_uploads.max(1)));
        AppState {
            store,
            objects,
            realtime,
            catalog,
            config,
            uploads,
        }
    }

    /// A permit to read and check one upload, or 503 while the most allowed are in progress.
    pub(crate) fn upload_permit(&self) -> Result<tokio::sync::OwnedSemaphorePermit, ApiError> {
        self.uploads.clone().try_acquire_owned().map_err(|_| {
            ApiError::new(
                ErrorCode::ServiceUnavailable,
                "the most uploads allowed at once are in progress; retry shortly",
            )
        })
    }
}

/// The whole HTTP API.
pub fn router(state: AppState) -> Router {
    let limit = state.config.max_body_bytes;
    // Both adapter files in one body, the configuration capped at 1 MiB.
    let upload_limit = state.config.adapter_limits.max_bytes + (2 << 20);
    let uploads = DefaultBodyLimit::max(upload_limit);
    Router::new()
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(health::readyz))
        .route("/v1/account", get(account::show))
        .route("/v1/account/webhook_secret/rotate", post(account::rotate))
        .route(
            "/v1/adapters",
            post(adapters::create).layer(uploads).get(adapters::list),
        )
        .route("/v1/adapters/{adapter}", get(adapters::show).delete(adapters::delete))
        .route(
            "/client/v4/accounts/{account_id}/ai/finetunes",
            post(adapters::create_finetune).get(adapters::list_finetunes),
        )
        .route(
            "/client/v4/accounts/{account_id}/ai/finetunes/{finetune_id}/finetune-assets",
            post(adapters::upload_asset).layer(uploads),
        )
        .route("/v1/models", get(openai::models))
        .route("/v1/models/{*model}", get(openai::model))
        .route("/v1/chat/completions", post(openai::chat))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/embeddings", post(openai::embeddings))
        .route(
            "/v1/files",
            post(files::create)
                .layer(DefaultBodyLimit::max(state.config.max_file_bytes))
                .get(files::list),
        )
        .route("/v1/files/{id}", get(files::show).delete(files::delete))
        .route("/v1/files/{id}/content", get(files::content))
        .route("/v1/batches", post(batches::create).get(batches::list))
        .route("/v1/batches/{id}", get(batches::show))
        .route("/v1/batches/{id}/cancel", post(batches::cancel))
        .route("/v1/batches/{id}/results", get(batches::results))
        .route(
            "/client/v4/accounts/{account_id}/ai/run/{*model}",
            post(workers_ai::run),
        )
        .fallback(|| async { ApiError::new(ErrorCode::RouteNotFound, "no such route") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(ErrorCode::MethodNotAllowed, "the route does not take this method")
        })
        .layer(DefaultBodyLimit::max(limit))
        .layer(axum::middleware::from_fn_with_state(
            state.config.body_pace,
            guard::body_pace,
        ))
        .layer(axum::middleware::from_fn(guard::uri))
        .with_state(state)
}
