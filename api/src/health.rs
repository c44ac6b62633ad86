//! Liveness and readiness.

use std::future::Future;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use serde_json::{json, Value};

use crate::AppState;

/// The process is up.
#[utoipa::path(get, path = "/healthz", tag = crate::openapi::SERVICE,
    responses((status = 200, description = "The process is up", body = crate::openapi::Health)))]
pub async fn healthz() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

/// Postgres, RabbitMQ and S3 are all reachable.
#[utoipa::path(get, path = "/readyz", tag = crate::openapi::SERVICE,
    responses(
        (status = 200, description = "PostgreSQL, RabbitMQ and S3 all answer", body = crate::openapi::Ready),
        (status = 503, description = "A backing service does not answer", body = crate::openapi::Ready),
    ))]
pub async fn readyz(State(state): State<AppState>) -> (StatusCode, Json<Value>) {
    let (db, broker, s3) = tokio::join!(
        bounded(state.store.ping()),
        bounded(state.realtime.ping()),
        bounded(state.objects.ping())
    );
    let check = |r: &Result<(), String>| match r {
        Ok(()) => json!("ok"),
        Err(e) => json!(e),
    };
    let ready = db.is_ok() && broker.is_ok() && s3.is_ok();
    let body = json!({
        "status": if ready { "ready" } else { "unavailable" },
        "checks": {"postgres": check(&db), "rabbitmq": check(&broker), "s3": check(&s3)},
    });
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(body))
}

/// How long one readiness check may take: a service that accepts connections
/// but never answers is as unavailable as one that refuses them.
const CHECK_TIMEOUT: Duration = Duration::from_secs(3);

/// A check's outcome as anyone may see it (`/readyz` takes no token): a
/// fixed word; what the backend said goes to the log.
async fn bounded(check: impl Future<Output = Result<(), lorry_batcher::BatcherError>>) -> Result<(), String> {
    match tokio::time::timeout(CHECK_TIMEOUT, check).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(error)) => {
            tracing::warn!(%error, "readiness check failed");
            Err("unreachable".into())
        }
        Err(_) => Err("no answer in time".into()),
    }
}
