//! The caller's account, its webhook secret and its usage.

use std::collections::HashMap;

use axum::extract::{Query, State};
use axum::Json;
use chrono::{Duration, NaiveDate, Utc};
use lorry_batcher::store::UsageGroup;
use lorry_protocol::ErrorCode;
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

/// The longest span `GET /v1/usage` answers for, in days.
const MAX_USAGE_DAYS: i64 = 366;

/// A day of `GET /v1/usage`: `YYYY-MM-DD`, or unix seconds (the UTC day they fall on).
fn usage_day(raw: &str, param: &str) -> Result<NaiveDate, ApiError> {
    let day = NaiveDate::parse_from_str(raw, "%Y-%m-%d").ok().or_else(|| {
        raw.parse::<i64>()
            .ok()
            .and_then(|secs| chrono::DateTime::from_timestamp(secs, 0))
            .map(|t| t.date_naive())
    });
    day.ok_or_else(|| {
        ApiError::invalid(
            ErrorCode::InvalidValue,
            param,
            format!("{param} must be a day (YYYY-MM-DD) or unix seconds"),
        )
    })
}

/// `GET /v1/usage?start=&end=&group_by=model,adapter,day,batch`: the
/// account's requests and tokens on both lanes, on the UTC days from `start`
/// to before `end` (the last 30 days by default), by lane and the groups asked.
#[utoipa::path(get, path = "/v1/usage", tag = crate::openapi::SERVICE,
    params(
        ("start" = Option<String>, Query, description = "First UTC day, YYYY-MM-DD or unix seconds (30 days before `end`)", pattern = "^([0-9]{4}-[0-9]{2}-[0-9]{2}|[0-9]{1,12})$"),
        ("end" = Option<String>, Query, description = "The UTC day after the last, YYYY-MM-DD or unix seconds (tomorrow)", pattern = "^([0-9]{4}-[0-9]{2}-[0-9]{2}|[0-9]{1,12})$"),
        ("group_by" = Option<String>, Query, description = "Comma-separated: model, adapter, day, batch", pattern = "^(model|adapter|day|batch)(,(model|adapter|day|batch))*$"),
    ),
    responses((status = 200, description = "The account's usage", body = crate::openapi::UsageReport)))]
pub async fn usage(
    State(state): State<AppState>,
    Authenticated(account): Authenticated,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    if let Some(unknown) = query
        .keys()
        .find(|k| !matches!(k.as_str(), "start" | "end" | "group_by"))
    {
        return Err(ApiError::invalid(
            ErrorCode::UnknownField,
            unknown.as_str(),
            format!("unknown parameter {unknown}"),
        ));
    }
    let end = match query.get("end") {
        Some(raw) => usage_day(raw, "end")?,
        None => Utc::now().date_naive() + Duration::days(1),
    };
    let start = match query.get("start") {
        Some(raw) => usage_day(raw, "start")?,
        None => end - Duration::days(30),
    };
    if start >= end || (end - start).num_days() > MAX_USAGE_DAYS {
        return Err(ApiError::invalid(
            ErrorCode::OutOfRange,
            "start",
            format!("start must be before end, at most {MAX_USAGE_DAYS} days before it"),
        ));
    }
    let mut groups = Vec::new();
    for name in query.get("group_by").map(String::as_str).unwrap_or("").split(',') {
        let name = name.trim();
        if name.is_empty() {
            continue;
        }
        let group = UsageGroup::parse(name).ok_or_else(|| {
            ApiError::invalid(
                ErrorCode::InvalidValue,
                "group_by",
                "group_by is a comma-separated list of model, adapter, day and batch",
            )
        })?;
        if !groups.contains(&group) {
            groups.push(group);
        }
    }
    let rows = state.store.usage(&account.id, start, end, &groups).await?;
    Ok(Json(json!({
        "object": "list",
        "start": start.to_string(),
        "end": end.to_string(),
        "data": rows,
    })))
}
