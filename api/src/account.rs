//! The caller's account and its webhook secret.

use axum::extract::State;
use axum::Json;
use serde_json::{json, Value};

use crate::extract::Authenticated;
use crate::{ApiError, AppState};

/// `GET /v1/account`.
#[utoipa::path(get, path = "/v1/account", tag = crate::openapi::SERVICE,
    responses((status = 200, description = "The caller's account", body = crate::openapi::Account)))]
pub async fn show(State(state): State<AppState>, Authenticated(account): Authenticated) -> Json<Value> {
    Json(json!({
        "id": account.id,
        "object": "account",
        "webhook_secret": account.webhook_secret,
        "limits": crate::quota::limits(&state, &account),
    }))
}

/// `POST /v1/account/webhook_secret/rotate`: a new secret signs every delivery from now on.
#[utoipa::path(post, path = "/v1/account/webhook_secret/rotate", tag = crate::openapi::SERVICE,
    responses((status = 200, description = "The account with its new secret", body = crate::openapi::Account)))]
pub async fn rotate(
    State(state): State<AppState>,
    Authenticated(account): Authenticated,
) -> Result<Json<Value>, ApiError> {
    let secret = state.store.rotate_webhook_secret(&account.id).await?;
    Ok(Json(json!({
        "id": account.id,
        "object": "account",
        "webhook_secret": secret,
        "limits": crate::quota::limits(&state, &account),
    })))
}
