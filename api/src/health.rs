//! Liveness and readiness.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use serde_json::{json, Value};

use crate::AppState;

/// The process is up.
pub async fn healthz() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

/// Postgres, RabbitMQ and S3 are all reachable.
pub async fn readyz(State(state): State<AppState>) -> (StatusCode, Json<Value>) {
    let (db, broker, s3) = tokio::join!(state.store.ping(), state.realtime.ping(), state.objects.ping());
    let check = |r: &Result<(), lorry_batcher::BatcherError>| match r {
        Ok(()) => json!("ok"),
        Err(e) => json!(e.to_string()),
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
