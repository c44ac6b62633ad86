//! `/admin/v1/…`: accounts and their API keys, for the operator. Served only
//! when `LORRY_ADMIN_TOKEN` is set, and only to that token.

use std::collections::HashMap;

use axum::extract::{FromRequestParts, Path, Query, State};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::Json;
use lorry_batcher::admin::{self, Deletion};
use lorry_batcher::ids::{AccountId, KeyId};
use lorry_batcher::quota::QuotaChange;
use lorry_batcher::store::KeyRecord;
use lorry_protocol::input::Fields;
use lorry_protocol::ErrorCode;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::extract::JsonBody;
use crate::{ApiError, AppState};

/// The operator, proven by `Authorization: Bearer <LORRY_ADMIN_TOKEN>`.
pub struct Admin;

/// The stored form of the admin token: its SHA-256 digest, so that a
/// comparison's time says nothing about the token.
pub fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

impl FromRequestParts<AppState> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let given = crate::extract::bearer(parts);
        let expected = state.config.admin_token_digest;
        match (given, expected) {
            (Some(token), Some(expected)) if constant_time_eq(&digest(token), &expected) => Ok(Admin),
            _ => Err(ApiError::new(
                ErrorCode::InvalidToken,
                "the admin routes take Authorization: Bearer <LORRY_ADMIN_TOKEN>",
            )),
        }
    }
}

fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The longest key name.
const MAX_KEY_NAME: usize = 128;

fn account_name(raw: &str, param: &str) -> Result<AccountId, ApiError> {
    AccountId::parse_name(raw).ok_or_else(|| {
        ApiError::invalid(
            ErrorCode::InvalidAccountName,
            param,
            format!(
                "an account name is 1 to {} of a-z, 0-9, '-' and '_', starting with a letter or a digit",
                AccountId::MAX_LEN
            ),
        )
    })
}

/// An account named in a path: one that cannot exist is as absent as one that does not.
fn path_account(raw: &str) -> Result<AccountId, ApiError> {
    AccountId::parse_name(raw).ok_or_else(account_not_found)
}

fn account_not_found() -> ApiError {
    ApiError::not_found(ErrorCode::AccountNotFound, "account_id", "account")
}

/// A key's name: 1 to 128 characters, none of them a control character.
pub fn key_name(raw: &str, param: &str) -> Result<String, ApiError> {
    let ok = !raw.is_empty() && raw.chars().count() <= MAX_KEY_NAME && !raw.chars().any(char::is_control);
    if ok {
        Ok(raw.to_string())
    } else {
        Err(ApiError::invalid(
            ErrorCode::InvalidValue,
            param,
            format!("a key name is 1 to {MAX_KEY_NAME} characters, none of them a control character"),
        ))
    }
}

/// `POST /admin/v1/accounts`: `{"name", "key_name"?}`; the account and its
/// first key, whose `value` is shown this once.
#[utoipa::path(post, path = "/admin/v1/accounts", tag = crate::openapi::ADMIN,
    request_body = crate::openapi::NewAccount,
    responses((status = 201, description = "The account, with its first key", body = crate::openapi::AdminAccount)))]
pub async fn create_account(
    State(state): State<AppState>,
    _admin: Admin,
    body: JsonBody,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let mut f = Fields::new(&body.value, "")?;
    let name: String = f.required("name", "a string")?;
    let key: Option<String> = f.optional("key_name", "a string")?;
    f.deny_unknown()?;
    let id = account_name(&name, "name")?;
    let key = key_name(key.as_deref().unwrap_or("default"), "key_name")?;
    let (account, key) = state.store.create_account(&id, &key).await?.ok_or_else(|| {
        ApiError::new(ErrorCode::AccountExists, format!("an account named {id} exists")).with_param("name")
    })?;
    let mut body = account.to_json();
    body["key"] = key.to_json();
    Ok((StatusCode::CREATED, Json(body)))
}

/// `GET /admin/v1/accounts?limit=&after=`: accounts in name order.
#[utoipa::path(get, path = "/admin/v1/accounts", tag = crate::openapi::ADMIN,
    params(("limit" = Option<u32>, Query, description = "Page size, 1–1000 (100)", minimum = 1, maximum = 1000), ("after" = Option<String>, Query, description = "The last account name of the page before", pattern = "^[a-z0-9][a-z0-9_-]{0,63}$")),
    responses((status = 200, description = "A page of accounts", body = crate::openapi::AdminAccountList)))]
pub async fn list_accounts(
    State(state): State<AppState>,
    _admin: Admin,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    let (limit, after) = crate::extract::page(&query, 100, 1000, AccountId::parse_name, "an account name")?;
    let mut accounts = state.store.list_accounts(limit + 1, after.as_ref()).await?;
    let has_more = accounts.len() as i64 > limit;
    accounts.truncate(limit as usize);
    Ok(Json(json!({
        "object": "list",
        "data": accounts.iter().map(|a| a.to_json()).collect::<Vec<_>>(),
        "first_id": accounts.first().map(|a| &a.id.0),
        "last_id": accounts.last().map(|a| &a.id.0),
        "has_more": has_more,
    })))
}

/// `GET /admin/v1/accounts/{account_id}`.
#[utoipa::path(get, path = "/admin/v1/accounts/{account_id}", tag = crate::openapi::ADMIN,
    params(("account_id" = String, Path, description = "An account's name")),
    responses((status = 200, description = "The account", body = crate::openapi::AdminAccount)))]
pub async fn show_account(
    State(state): State<AppState>,
    _admin: Admin,
    Path(account_id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let id = path_account(&account_id)?;
    let account = state.store.account_record(&id).await?.ok_or_else(account_not_found)?;
    Ok(Json(account.to_json()))
}

/// `DELETE /admin/v1/accounts/{account_id}`: the account is disabled and its
/// open batches cancelled; once they have ended, its S3 objects and rows go.
/// Until then `409 account_busy` with `Retry-After` (the account stays disabled).
#[utoipa::path(delete, path = "/admin/v1/accounts/{account_id}", tag = crate::openapi::ADMIN,
    params(("account_id" = String, Path, description = "An account's name")),
    responses((status = 200, description = "The account is gone", body = crate::openapi::Deleted)))]
pub async fn delete_account(
    State(state): State<AppState>,
    _admin: Admin,
    Path(account_id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let id = path_account(&account_id)?;
    match admin::delete_account(&state.store, &state.objects, &id).await? {
        Deletion::Deleted { .. } => Ok(Json(json!({"id": id.0, "object": "account", "deleted": true}))),
        Deletion::NotFound => Err(account_not_found()),
        Deletion::Busy(open) => Err(ApiError::new(
            ErrorCode::AccountBusy,
            format!("the account is disabled and its batches cancelled; {open} of them have not ended yet, try again"),
        )
        .with_param("account_id")),
    }
}

/// `PATCH /admin/v1/accounts/{account_id}`: `{"quotas": {"queued_requests",
/// "realtime_per_second", "file_bytes", "adapters"}}`, each a number (0: no
/// limit) or `null` (the deployment's default); limits not named are left.
#[utoipa::path(patch, path = "/admin/v1/accounts/{account_id}", tag = crate::openapi::ADMIN,
    params(("account_id" = String, Path, description = "An account's name")),
    request_body = crate::openapi::AccountChange,
    responses((status = 200, description = "The account, with its own limits", body = crate::openapi::AdminAccount)))]
pub async fn update_account(
    State(state): State<AppState>,
    _admin: Admin,
    Path(account_id): Path<String>,
    body: JsonBody,
) -> Result<Json<Value>, ApiError> {
    let id = path_account(&account_id)?;
    let mut f = Fields::new(&body.value, "")?;
    let raw = f.raw("quotas").cloned();
    f.deny_unknown()?;
    let change = match raw {
        Some(raw) => quota_change(&raw)?,
        None => QuotaChange::default(),
    };
    let account = state
        .store
        .set_quotas(&id, &change)
        .await?
        .ok_or_else(account_not_found)?;
    Ok(Json(account.to_json()))
}

/// The `quotas` object of a change: each limit a number or `null`.
pub fn quota_change(raw: &Value) -> Result<QuotaChange, ApiError> {
    let object = raw
        .as_object()
        .ok_or_else(|| ApiError::invalid(ErrorCode::InvalidType, "quotas", "quotas must be a JSON object"))?;
    let mut change = QuotaChange::default();
    for (name, value) in object {
        let param = format!("quotas.{name}");
        let count = || -> Result<Option<u64>, ApiError> {
            if value.is_null() {
                return Ok(None);
            }
            value.as_u64().map(Some).ok_or_else(|| {
                ApiError::invalid(
                    ErrorCode::InvalidType,
                    &param,
                    format!("{param} must be a whole number from 0 (no limit), or null (the default)"),
                )
            })
        };
        match name.as_str() {
            "queued_requests" => change.queued_requests = Some(count()?),
            "file_bytes" => change.file_bytes = Some(count()?.map(|n| n.min(i64::MAX as u64))),
            "adapters" => change.adapters = Some(count()?),
            "realtime_per_second" => {
                change.realtime_per_second = Some(match value {
                    Value::Null => None,
                    v => Some(v.as_f64().filter(|r| r.is_finite() && *r >= 0.0).ok_or_else(|| {
                        ApiError::invalid(
                            ErrorCode::InvalidType,
                            &param,
                            format!("{param} must be a number from 0 (no limit), or null (the default)"),
                        )
                    })?),
                })
            }
            _ => {
                return Err(ApiError::invalid(
                    ErrorCode::UnknownField,
                    &param,
                    format!("unknown field {param}"),
                ))
            }
        }
    }
    Ok(change)
}

/// `POST /admin/v1/accounts/{account_id}/disable`: its keys are refused at
/// once; its queued and running batches are cancelled (listed in
/// `cancelled_batches`). Real-time requests already running finish.
#[utoipa::path(post, path = "/admin/v1/accounts/{account_id}/disable", tag = crate::openapi::ADMIN,
    params(("account_id" = String, Path, description = "An account's name")),
    responses((status = 200, description = "The account, disabled", body = crate::openapi::AdminAccount)))]
pub async fn disable_account(
    State(state): State<AppState>,
    _admin: Admin,
    Path(account_id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let id = path_account(&account_id)?;
    let disabled = state.store.disable_account(&id).await?.ok_or_else(account_not_found)?;
    let mut body = disabled.account.to_json();
    body["cancelled_batches"] = json!(disabled.cancelled_batches);
    Ok(Json(body))
}

/// `POST /admin/v1/accounts/{account_id}/enable`: its keys work again; batches cancelled stay cancelled.
#[utoipa::path(post, path = "/admin/v1/accounts/{account_id}/enable", tag = crate::openapi::ADMIN,
    params(("account_id" = String, Path, description = "An account's name")),
    responses((status = 200, description = "The account, active", body = crate::openapi::AdminAccount)))]
pub async fn enable_account(
    State(state): State<AppState>,
    _admin: Admin,
    Path(account_id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let id = path_account(&account_id)?;
    let account = state.store.enable_account(&id).await?.ok_or_else(account_not_found)?;
    Ok(Json(account.to_json()))
}

/// `POST /admin/v1/accounts/{account_id}/keys`: `{"name"}`; the key's `value` is shown this once.
#[utoipa::path(post, path = "/admin/v1/accounts/{account_id}/keys", tag = crate::openapi::ADMIN,
    params(("account_id" = String, Path, description = "An account's name")),
    request_body = crate::openapi::NewKey,
    responses((status = 201, description = "The key, with its value", body = crate::openapi::ApiKey)))]
pub async fn create_key(
    State(state): State<AppState>,
    _admin: Admin,
    Path(account_id): Path<String>,
    body: JsonBody,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let id = path_account(&account_id)?;
    let mut f = Fields::new(&body.value, "")?;
    let name: Option<String> = f.optional("name", "a string")?;
    f.deny_unknown()?;
    let name = key_name(name.as_deref().unwrap_or("default"), "name")?;
    let key = state
        .store
        .create_key(&id, &name)
        .await?
        .ok_or_else(account_not_found)?;
    Ok((StatusCode::CREATED, Json(key.to_json())))
}

/// `GET /admin/v1/accounts/{account_id}/keys`: every key, revoked ones too, without their values.
#[utoipa::path(get, path = "/admin/v1/accounts/{account_id}/keys", tag = crate::openapi::ADMIN,
    params(("account_id" = String, Path, description = "An account's name")),
    responses((status = 200, description = "The account's keys", body = crate::openapi::ApiKeyList)))]
pub async fn list_keys(
    State(state): State<AppState>,
    _admin: Admin,
    Path(account_id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let id = path_account(&account_id)?;
    let keys = state.store.list_keys(&id).await?.ok_or_else(account_not_found)?;
    Ok(Json(
        json!({"object": "list", "data": keys.iter().map(KeyRecord::to_json).collect::<Vec<_>>()}),
    ))
}

/// `DELETE /admin/v1/accounts/{account_id}/keys/{key_id}`: the key is refused from now on.
#[utoipa::path(delete, path = "/admin/v1/accounts/{account_id}/keys/{key_id}", tag = crate::openapi::ADMIN,
    params(("account_id" = String, Path, description = "An account's name"), ("key_id" = String, Path, description = "A key's id (`key_…`)")),
    responses((status = 200, description = "The key, revoked", body = crate::openapi::ApiKey)))]
pub async fn revoke_key(
    State(state): State<AppState>,
    _admin: Admin,
    Path((account_id, key_id)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    let id = path_account(&account_id)?;
    let not_found = || ApiError::not_found(ErrorCode::KeyNotFound, "key_id", "key");
    let key = KeyId::parse(&key_id).ok_or_else(not_found)?;
    let key = state.store.revoke_key(&id, &key).await?.ok_or_else(not_found)?;
    Ok(Json(key.to_json()))
}
