//! Extractors that turn raw requests into trusted values or [`ApiError`]s.

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{header, StatusCode};
use lorry_batcher::store::Account;
use lorry_protocol::ErrorCode;
use serde_json::Value;

use crate::{ApiError, AppState};

/// The account behind the request's bearer token.
pub struct Authenticated(pub Account);

/// The token of an `Authorization: Bearer <token>` header, if there is one.
pub fn bearer(parts: &Parts) -> Option<&str> {
    parts
        .headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|t| !t.is_empty())
}

impl FromRequestParts<AppState> for Authenticated {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let unauthorized = |message: &str| ApiError::new(ErrorCode::InvalidToken, message);
        let token = bearer(parts).ok_or_else(|| unauthorized("an Authorization: Bearer <token> header is required"))?;
        let started = std::time::Instant::now();
        let account = state.store.account_by_token(token).await?;
        tracing::trace!(ms = started.elapsed().as_secs_f64() * 1e3, "token looked up");
        match account {
            Some(account) => Ok(Authenticated(account)),
            None => Err(unauthorized("the API token is not valid")),
        }
    }
}

/// A JSON body, with the raw bytes kept (for idempotency digests).
pub struct JsonBody {
    /// The parsed value.
    pub value: Value,
    /// The bytes it came from.
    pub raw: Bytes,
}

impl<S: Send + Sync> FromRequest<S> for JsonBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let raw = Bytes::from_request(req, state).await.map_err(|rejection| {
            if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::new(ErrorCode::BodyTooLarge, "the request body is over the limit")
            } else {
                crate::guard::unreadable(&rejection, rejection.body_text())
            }
        })?;
        let value = parse_json(&raw)?;
        Ok(JsonBody { value, raw })
    }
}

/// A JSON body read strictly (a key named twice refused) with no U+0000 in any string.
pub fn parse_json(raw: &[u8]) -> Result<Value, ApiError> {
    let value = lorry_protocol::json::parse(raw)
        .map_err(|e| ApiError::new(ErrorCode::InvalidJson, format!("the body is not valid JSON: {e}")))?;
    lorry_protocol::input::refuse_nul(&value, "")?;
    Ok(value)
}

/// A multipart body, its rejection (no boundary, wrong content type) in the
/// API's error shape.
pub struct Form(pub axum::extract::Multipart);

impl<S: Send + Sync> FromRequest<S> for Form {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        axum::extract::Multipart::from_request(req, state)
            .await
            .map(Form)
            .map_err(|rejection| ApiError::invalid(ErrorCode::InvalidMultipart, "content-type", rejection.body_text()))
    }
}

/// A listing's `limit` (1 to `max`, `default` when absent) and `after` (an id
/// `parse` accepts, described as `what` in errors) from its query string.
pub fn page<T>(
    query: &std::collections::HashMap<String, String>,
    default: i64,
    max: i64,
    parse: impl Fn(&str) -> Option<T>,
    what: &str,
) -> Result<(i64, Option<T>), ApiError> {
    let limit = match query.get("limit") {
        None => default,
        Some(raw) => raw
            .parse::<i64>()
            .ok()
            .filter(|n| (1..=max).contains(n))
            .ok_or_else(|| {
                ApiError::invalid(
                    ErrorCode::InvalidValue,
                    "limit",
                    format!("limit must be an integer from 1 to {max}"),
                )
            })?,
    };
    let after = match query.get("after") {
        None => None,
        Some(raw) => Some(
            parse(raw)
                .ok_or_else(|| ApiError::invalid(ErrorCode::InvalidValue, "after", format!("after must be {what}")))?,
        ),
    };
    Ok((limit, after))
}
