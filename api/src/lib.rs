//! Lorry's HTTP surface (axum).
//!
//! The API validates everything before it accepts anything, writes a batch,
//! its requests and its outbox in one transaction, and answers only after the
//! commit. It never batches and never runs a model: real-time requests are
//! handed to the real-time lane and awaited.
#![forbid(unsafe_code)]

mod account;
mod adapters;
pub mod admin;
mod batches;
pub mod error;
mod extract;
mod files;
pub mod fuzzing;
pub mod guard;
mod health;
mod lane;
pub mod metrics;
pub mod openai;
mod openapi;
pub mod quota;
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
use utoipa::OpenApi as _;
use utoipa_axum::router::{OpenApiRouter, UtoipaMethodRouterExt};
use utoipa_axum::routes;

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
    /// The deployment's per-account limits (an account's own win).
    pub quotas: lorry_batcher::quota::Limits,
    /// The SHA-256 digest of `LORRY_ADMIN_TOKEN`; without it the `/admin/v1`
    /// routes are not served at all.
    pub admin_token_digest: Option<[u8; 32]>,
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
    /// Each account's real-time token bucket, in this process.
    pub(crate) realtime_rate: Arc<quota::RealtimeRate>,
    /// What this process counts.
    pub metrics: Arc<metrics::ApiMetrics>,
    /// More families for `/metrics` (a worker's, in the same process).
    pub(crate) more_metrics: Option<metrics::MoreMetrics>,
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
            realtime_rate: Arc::default(),
            metrics: Arc::default(),
            more_metrics: None,
        }
    }

    /// The same state, whose `/metrics` also writes what `more` writes.
    pub fn with_more_metrics(self, more: metrics::MoreMetrics) -> Self {
        AppState {
            more_metrics: Some(more),
            ..self
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

/// The whole HTTP API, and its OpenAPI document at `/openapi.json`.
pub fn router(state: AppState) -> Router {
    let limit = state.config.max_body_bytes;
    // Both adapter files in one body, the configuration capped at 1 MiB.
    let upload_limit = state.config.adapter_limits.max_bytes + (2 << 20);
    let uploads = DefaultBodyLimit::max(upload_limit);
    let files_limit = DefaultBodyLimit::max(state.config.max_file_bytes);
    // Every route is registered with its description, so none goes undocumented.
    let api = OpenApiRouter::with_openapi(openapi::Base::openapi())
        .routes(routes!(health::healthz))
        .routes(routes!(health::readyz))
        .routes(routes!(metrics::metrics))
        .routes(routes!(account::show))
        .routes(routes!(account::rotate))
        .routes(routes!(account::usage))
        .routes(routes!(adapters::create).layer(uploads))
        .routes(routes!(adapters::list))
        .routes(routes!(adapters::show, adapters::delete))
        .routes(routes!(adapters::create_finetune, adapters::list_finetunes))
        .routes(routes!(adapters::upload_asset).layer(uploads))
        .routes(routes!(openai::models))
        .routes(routes!(openai::chat))
        .routes(routes!(openai::completions))
        .routes(routes!(openai::embeddings))
        .routes(routes!(files::create).layer(files_limit))
        .routes(routes!(files::list))
        .routes(routes!(files::show, files::delete))
        .routes(routes!(files::content))
        .routes(routes!(batches::create, batches::list))
        .routes(routes!(batches::show, batches::delete))
        .routes(routes!(batches::cancel))
        .routes(routes!(batches::results));
    let api = if state.config.admin_token_digest.is_some() {
        api.routes(routes!(admin::create_account, admin::list_accounts))
            .routes(routes!(
                admin::show_account,
                admin::update_account,
                admin::delete_account
            ))
            .routes(routes!(admin::disable_account))
            .routes(routes!(admin::enable_account))
            .routes(routes!(admin::create_key, admin::list_keys))
            .routes(routes!(admin::revoke_key))
    } else {
        api
    };
    let (router, doc) = api.split_for_parts();
    // Model names hold slashes: these two take the rest of the path (their
    // descriptions are in `openapi::Base`, under `{model}`).
    let router = router.route("/v1/models/{*model}", get(openai::model)).route(
        "/client/v4/accounts/{account_id}/ai/run/{*model}",
        post(workers_ai::run),
    );
    let document =
        axum::body::Bytes::from(serde_json::to_vec(&openapi::finish(doc)).expect("the OpenAPI document serialises"));
    router
        .route(
            "/openapi.json",
            get(move || async move { ([(axum::http::header::CONTENT_TYPE, "application/json")], document) }),
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
        .layer(axum::middleware::from_fn(error::cloudflare_envelope))
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&state.metrics),
            metrics::track,
        ))
        .layer(axum::middleware::from_fn(request_id))
        .with_state(state)
}

/// The header every answer carries: this request's id.
pub const REQUEST_ID: &str = "x-request-id";

/// Give every request an id of its own (`req_` and 32 hex digits; a
/// client's own `x-request-id` is replaced), answered in `x-request-id` and
/// recorded on the request's span (`http.request_id`, with its logs and
/// trace), so that a client's report can be found. The outermost layer:
/// every answer has one.
async fn request_id(mut request: axum::extract::Request, next: axum::middleware::Next) -> axum::response::Response {
    let id = format!("req_{}", uuid::Uuid::now_v7().simple());
    let value = axum::http::HeaderValue::from_str(&id).expect("an id is a valid header value");
    request.headers_mut().insert(REQUEST_ID, value.clone());
    let mut response = next.run(request).await;
    response.headers_mut().insert(REQUEST_ID, value);
    response
}
