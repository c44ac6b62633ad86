//! What a worker shows its operator: `/healthz`, `/readyz` and `/metrics`
//! on a small HTTP listener of its own (`LORRY_WORKER_LISTEN`), bound before
//! the models load, so that readiness says "loading" meanwhile; and the same
//! metrics in the API's `/metrics` where one process is both.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use lorry_batcher::metrics::render_engines;
use lorry_batcher::store::Store;
use lorry_batcher::worker::Worker;
use lorry_engine::adapters::Adapters;
use lorry_engine::runtime::text_engine::TextEngine;
use lorry_metrics::Text;
use serde_json::json;

/// A worker once its models are loaded.
struct Running {
    worker: Worker,
    engines: Vec<TextEngine>,
    adapters: Adapters,
}

/// A worker as its listener sees it; cheap to clone.
#[derive(Clone)]
pub struct Observed {
    store: Store,
    running: Arc<OnceLock<Running>>,
}

impl Observed {
    /// A worker whose models are still loading.
    pub fn new(store: Store) -> Self {
        Observed {
            store,
            running: Arc::default(),
        }
    }

    /// The models are loaded and the worker consumes.
    pub fn started(&self, worker: Worker, engines: Vec<TextEngine>, adapters: Adapters) {
        let _ = self.running.set(Running {
            worker,
            engines,
            adapters,
        });
    }

    /// Write the worker's metrics (nothing while its models load).
    pub fn render(&self, text: &mut Text) {
        let Some(running) = self.running.get() else {
            return;
        };
        running.worker.metrics().render(text);
        let engines: Vec<(&str, &lorry_engine::Counters)> = running
            .engines
            .iter()
            .map(|e| (lorry_engine::Backend::model(e), e.counters()))
            .collect();
        render_engines(text, &engines, Some(&running.adapters));
    }

    /// The routes.
    pub fn router(self) -> Router {
        Router::new()
            .route("/healthz", get(|| async { Json(json!({"status": "ok"})) }))
            .route("/readyz", get(readyz))
            .route("/metrics", get(metrics))
            .fallback(|| async { (StatusCode::NOT_FOUND, Json(json!({"error": "no such route"}))) })
            .with_state(self)
    }
}

async fn metrics(State(observed): State<Observed>) -> Response {
    let mut text = Text::new();
    observed.render(&mut text);
    ([(header::CONTENT_TYPE, lorry_metrics::CONTENT_TYPE)], text.finish()).into_response()
}

/// Ready: PostgreSQL answers, the worker consumes from RabbitMQ, its models are loaded.
async fn readyz(State(observed): State<Observed>) -> Response {
    let postgres = match tokio::time::timeout(Duration::from_secs(3), observed.store.ping()).await {
        Ok(Ok(())) => "ok",
        Ok(Err(error)) => {
            tracing::warn!(%error, "readiness: PostgreSQL does not answer");
            "unreachable"
        }
        Err(_) => "no answer in time",
    };
    let running = observed.running.get();
    let models = if running.is_some() { "ok" } else { "loading" };
    let rabbitmq = match running {
        Some(r) if r.worker.is_consuming() => "ok",
        Some(_) => "not consuming",
        None => "waiting for the models",
    };
    let ready = postgres == "ok" && rabbitmq == "ok" && models == "ok";
    let body = json!({
        "status": if ready { "ready" } else { "unavailable" },
        "checks": {"postgres": postgres, "rabbitmq": rabbitmq, "models": models},
    });
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(body)).into_response()
}
