//! LoRA adapters: uploads, listing, deletion, and resolving the adapter a
//! request names.
//!
//! Two shapes reach the same records:
//! - native `/v1/adapters`: one multipart request with both files (`model`,
//!   `name`, `description`, `config`, `weights`); list, get, delete;
//! - Workers AI finetunes: `POST …/ai/finetunes` makes an empty finetune,
//!   `POST …/finetunes/{id}/finetune-assets` brings one file at a time
//!   (`file_name`, `file`), `GET …/ai/finetunes` lists them.
//!
//! Every file is checked before anything is written: the configuration on its
//! own, the weights on their own, and the pair against the base model once
//! both are there. Files go to S3 under fresh keys, so a refused or
//! interrupted upload never changes what a record points to.

use std::collections::HashMap;

use axum::body::Bytes;
use axum::extract::{Multipart, Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use lorry_batcher::ids::{AccountId, AdapterId};
use lorry_batcher::objects::adapter_key;
use lorry_batcher::store::{AdapterAsset, AdapterRecord, AdapterSummary, NewAdapter, NewRequest};
use lorry_protocol::input::{AdapterField, Fields};
use lorry_protocol::lora::{self, Adapter, AdapterError};
use lorry_protocol::ErrorCode;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::error::CloudflareError;
use crate::extract::{Authenticated, Form, JsonBody};
use crate::{ApiError, AppState};

const CONFIG_FILE: &str = "adapter_config.json";
const WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// Largest `adapter_config.json`.
const MAX_CONFIG_BYTES: usize = 1 << 20;
const MAX_NAME: usize = 64;
const MAX_DESCRIPTION: usize = 1024;

/// `1–64` characters of `A–Z a–z 0–9 . _ -`, not shaped like an adapter id.
fn check_name(name: &str, param: &str) -> Result<(), ApiError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        && AdapterId::parse(name).is_none();
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid(
            ErrorCode::InvalidAdapterName,
            param,
            format!("a name is 1 to {MAX_NAME} characters of letters, digits, '.', '_' and '-'"),
        ))
    }
}

/// Refuse `len` over `max` with `code`, naming `param`.
fn at_most(len: usize, max: usize, code: ErrorCode, param: &str, what: &str) -> Result<(), ApiError> {
    if len > max {
        return Err(ApiError::invalid(code, param, format!("{what} is over {max} bytes")));
    }
    Ok(())
}

/// A new adapter record, its model, name and description checked.
fn new_adapter(
    state: &AppState,
    account: &AccountId,
    model: String,
    name: String,
    description: String,
) -> Result<NewAdapter, ApiError> {
    check_model(state, &model, "model")?;
    check_name(&name, "name")?;
    check_description(&description, "description")?;
    Ok(NewAdapter {
        id: AdapterId::generate(),
        account_id: account.clone(),
        name,
        model,
        description,
    })
}

fn check_description(description: &str, param: &str) -> Result<(), ApiError> {
    at_most(
        description.len(),
        MAX_DESCRIPTION,
        ErrorCode::InvalidValue,
        param,
        "description",
    )
}

/// The base model an adapter names: served, and taking adapters.
fn check_model(state: &AppState, model: &str, param: &str) -> Result<(), ApiError> {
    crate::submit::model(&state.catalog, model, param)?.adapter_shape(param)?;
    Ok(())
}

/// An adapter refused by the checks, as a 4xx naming the file at fault.
pub(crate) fn refused(error: AdapterError, config_param: &str, weights_param: &str) -> ApiError {
    let param = if error.in_config { config_param } else { weights_param };
    ApiError::invalid(error.code, param, error.message)
}

/// Check the pair against the base model (off the async runtime: it reads every weight).
async fn check_pair(
    state: &AppState,
    model: &str,
    config: Bytes,
    weights: Bytes,
) -> Result<Result<AdapterSummary, AdapterError>, ApiError> {
    let base = (state.catalog.adapter_base(model).copied())
        .ok_or_else(|| lorry_protocol::model::no_adapters(model, "model"))?;
    let limits = state.config.adapter_limits;
    let checked = tokio::task::spawn_blocking(move || {
        Adapter::parse(&config, &weights, &base, limits).map(|adapter| AdapterSummary {
            rank: adapter.max_rank() as i32,
            targets: adapter.targets().iter().map(|t| t.name().to_string()).collect(),
        })
    })
    .await
    .map_err(|e| ApiError::new(ErrorCode::InternalError, e.to_string()))?;
    Ok(checked)
}

fn multipart_error(error: axum::extract::multipart::MultipartError) -> ApiError {
    if error.status() == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::new(ErrorCode::AdapterTooLarge, "the upload is over the adapter size limit")
    } else if crate::guard::timed_out(&error) {
        crate::guard::unreadable(&error, String::new())
    } else {
        ApiError::invalid(ErrorCode::InvalidMultipart, "", error.body_text())
    }
}

/// Every part of a multipart body, by field name; a field given twice is refused.
async fn parts(mut multipart: Multipart, allowed: &[&str]) -> Result<HashMap<String, Bytes>, ApiError> {
    let mut parts = HashMap::new();
    while let Some(field) = multipart.next_field().await.map_err(multipart_error)? {
        let name = field.name().unwrap_or_default().to_string();
        if !allowed.contains(&name.as_str()) {
            return Err(ApiError::invalid(
                ErrorCode::UnknownField,
                name.clone(),
                format!("unknown field {name:?}; the fields are {}", allowed.join(", ")),
            ));
        }
        let data = field.bytes().await.map_err(multipart_error)?;
        if parts.insert(name.clone(), data).is_some() {
            return Err(ApiError::invalid(
                ErrorCode::DuplicateField,
                name.clone(),
                format!("{name} is given more than once"),
            ));
        }
    }
    Ok(parts)
}

fn text_part(parts: &HashMap<String, Bytes>, name: &str) -> Result<Option<String>, ApiError> {
    parts
        .get(name)
        .map(|bytes| {
            let text = String::from_utf8(bytes.to_vec())
                .map_err(|_| ApiError::invalid(ErrorCode::InvalidType, name, format!("{name} must be UTF-8 text")))?;
            lorry_protocol::input::refuse_nul(&Value::String(text.clone()), name)?;
            Ok(text)
        })
        .transpose()
}

fn config_size(config: &Bytes, param: &str) -> Result<(), ApiError> {
    at_most(
        config.len(),
        MAX_CONFIG_BYTES,
        ErrorCode::AdapterConfigInvalid,
        param,
        CONFIG_FILE,
    )
}

/// Write one checked file under a fresh key.
async fn put_asset(
    state: &AppState,
    account: &AccountId,
    id: &AdapterId,
    file: &str,
    data: Bytes,
) -> Result<AdapterAsset, ApiError> {
    let key = adapter_key(account, id, &format!("{}-{file}", uuid::Uuid::now_v7().simple()));
    let asset = if file == CONFIG_FILE {
        AdapterAsset::Config { key: key.clone() }
    } else {
        AdapterAsset::Weights {
            key: key.clone(),
            bytes: data.len() as i64,
            sha256: hex::encode(Sha256::digest(&data)),
        }
    };
    let content_type = if file == CONFIG_FILE {
        "application/json"
    } else {
        "application/octet-stream"
    };
    state.objects.put(&key, data, content_type).await?;
    Ok(asset)
}

/// Delete objects no record points to any more; a failure only leaves garbage.
async fn forget_objects(state: &AppState, keys: impl IntoIterator<Item = Option<String>>) {
    for key in keys.into_iter().flatten() {
        if let Err(e) = state.objects.delete(&key).await {
            tracing::warn!(key, error = %e, "could not delete an adapter file");
        }
    }
}

fn asset_key(asset: &AdapterAsset) -> String {
    match asset {
        AdapterAsset::Config { key } | AdapterAsset::Weights { key, .. } => key.clone(),
    }
}

fn adapter_not_found(param: &str) -> ApiError {
    ApiError::not_found(ErrorCode::AdapterNotFound, param, "adapter")
}

/// The account's adapter named by a path segment (id or name), or 404 naming `param`.
async fn owned_adapter(
    state: &AppState,
    account: &AccountId,
    reference: &str,
    param: &str,
) -> Result<AdapterRecord, ApiError> {
    state
        .store
        .find_adapter(account, reference)
        .await?
        .ok_or_else(|| adapter_not_found(param))
}

/// `POST /v1/adapters`: multipart `model`, `name`, `description`?, `config`, `weights`.
#[utoipa::path(post, path = "/v1/adapters", tag = crate::openapi::ADAPTERS,
    request_body(content = crate::openapi::AdapterUpload, content_type = "multipart/form-data"),
    responses((status = 201, description = "The adapter, checked against its base model", body = crate::openapi::Adapter)))]
pub async fn create(
    State(state): State<AppState>,
    Authenticated(account): Authenticated,
    Form(multipart): Form,
) -> Result<Response, ApiError> {
    let _permit = state.upload_permit()?;
    let parts = parts(multipart, &["model", "name", "description", "config", "weights"]).await?;
    let model = text_part(&parts, "model")?
        .ok_or_else(|| ApiError::invalid(ErrorCode::MissingField, "model", "model names the base model"))?;
    let name = text_part(&parts, "name")?
        .ok_or_else(|| ApiError::invalid(ErrorCode::MissingField, "name", "name is required"))?;
    let description = text_part(&parts, "description")?.unwrap_or_default();
    let new = new_adapter(&state, &account.id, model, name, description)?;
    let missing = |param: &str, file: &str| {
        ApiError::invalid(
            ErrorCode::AdapterMissingFile,
            param,
            format!("{param} must carry {file}"),
        )
    };
    let config = parts
        .get("config")
        .cloned()
        .ok_or_else(|| missing("config", CONFIG_FILE))?;
    let weights = parts
        .get("weights")
        .cloned()
        .ok_or_else(|| missing("weights", WEIGHTS_FILE))?;
    config_size(&config, "config")?;
    if state.store.find_adapter(&account.id, &new.name).await?.is_some() {
        return Err(name_taken(&new.name));
    }
    let summary = check_pair(&state, &new.model, config.clone(), weights.clone())
        .await?
        .map_err(|e| refused(e, "config", "weights"))?;
    let config = put_asset(&state, &account.id, &new.id, CONFIG_FILE, config).await?;
    let weights = match put_asset(&state, &account.id, &new.id, WEIGHTS_FILE, weights).await {
        Ok(weights) => weights,
        Err(e) => {
            forget_objects(&state, [Some(asset_key(&config))]).await;
            return Err(e);
        }
    };
    let keys = [Some(asset_key(&config)), Some(asset_key(&weights))];
    let limit = crate::quota::limits(&state, &account).adapters;
    let error = match state
        .store
        .insert_adapter(&new, Some((config, weights, summary)), limit)
        .await
    {
        Ok(Ok(Some(record))) => return Ok((StatusCode::CREATED, Json(record.to_json())).into_response()),
        Ok(Ok(None)) => name_taken(&new.name),
        Ok(Err(refusal)) => over_adapters(refusal),
        Err(e) => e.into(),
    };
    forget_objects(&state, keys).await;
    Err(error)
}

fn over_adapters(refusal: lorry_batcher::quota::Refusal) -> ApiError {
    crate::quota::refused(refusal, ErrorCode::QuotaAdapters, "adapters")
}

fn name_taken(name: &str) -> ApiError {
    ApiError::new(
        ErrorCode::AdapterNameTaken,
        format!("this account already has an adapter named {name}"),
    )
    .with_param("name")
}

/// `GET /v1/adapters`.
#[utoipa::path(get, path = "/v1/adapters", tag = crate::openapi::ADAPTERS,
    params(("limit" = Option<u32>, Query, description = "Page size, 1–1000 (100)", minimum = 1, maximum = 1000), ("after" = Option<String>, Query, description = "The last adapter id of the page before", pattern = "^lora_[0-9a-fA-F]{32}$")),
    responses((status = 200, description = "Adapters, newest first", body = crate::openapi::AdapterList)))]
pub async fn list(
    State(state): State<AppState>,
    Authenticated(account): Authenticated,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    let (adapters, has_more) = list_page(&state, &account.id, &query).await?;
    let data: Vec<Value> = adapters.iter().map(AdapterRecord::to_json).collect();
    Ok(Json(json!({
        "object": "list",
        "data": data,
        "first_id": adapters.first().map(|a| &a.id),
        "last_id": adapters.last().map(|a| &a.id),
        "has_more": has_more,
    })))
}

/// One page of the account's adapters (`limit` 1 to 1000, 100 by default; `after` an adapter id).
async fn list_page(
    state: &AppState,
    account: &AccountId,
    query: &HashMap<String, String>,
) -> Result<(Vec<AdapterRecord>, bool), ApiError> {
    let (limit, after) = crate::extract::page(query, 100, 1000, AdapterId::parse, "an adapter id")?;
    Ok(state.store.list_adapters(account, limit, after.as_ref()).await?)
}

/// `GET /v1/adapters/{id or name}`.
#[utoipa::path(get, path = "/v1/adapters/{adapter}", tag = crate::openapi::ADAPTERS,
    params(("adapter" = String, Path, description = "An adapter's id or name")),
    responses((status = 200, description = "The adapter", body = crate::openapi::Adapter)))]
pub async fn show(
    State(state): State<AppState>,
    Authenticated(account): Authenticated,
    Path(reference): Path<String>,
) -> Result<Json<Value>, ApiError> {
    Ok(Json(
        owned_adapter(&state, &account.id, &reference, "adapter")
            .await?
            .to_json(),
    ))
}

/// `DELETE /v1/adapters/{id or name}`: the record goes at once, then its files.
/// Requests already accepted with it end with `adapter_not_found`.
#[utoipa::path(delete, path = "/v1/adapters/{adapter}", tag = crate::openapi::ADAPTERS,
    params(("adapter" = String, Path, description = "An adapter's id or name")),
    responses((status = 200, description = "The adapter is gone", body = crate::openapi::Deleted)))]
pub async fn delete(
    State(state): State<AppState>,
    Authenticated(account): Authenticated,
    Path(reference): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let record = owned_adapter(&state, &account.id, &reference, "adapter").await?;
    let deleted = state
        .store
        .delete_adapter(&account.id, &record.id)
        .await?
        .ok_or_else(|| adapter_not_found("adapter"))?;
    forget_objects(&state, [deleted.config_key, deleted.weights_key]).await;
    Ok(Json(json!({"id": record.id, "object": "adapter", "deleted": true})))
}

fn envelope(result: Value) -> Json<Value> {
    Json(json!({"result": result, "success": true, "errors": [], "messages": []}))
}

fn owner(account: &AccountId, account_id: &str) -> Result<(), ApiError> {
    if account.0 != account_id {
        return Err(ApiError::not_found(ErrorCode::AccountNotFound, "account_id", "account"));
    }
    Ok(())
}

/// A finetune as Workers AI describes it.
fn finetune_json(record: &AdapterRecord) -> Value {
    json!({
        "id": record.id,
        "name": record.name,
        "description": record.description,
        "model": record.model,
        "public": false,
        "status": record.status(),
        "created_at": record.created_at.to_rfc3339(),
        "modified_at": record.modified_at.to_rfc3339(),
    })
}

/// `POST /client/v4/accounts/{account_id}/ai/finetunes`: `{"model", "name", "description"?}`.
#[utoipa::path(post, path = "/client/v4/accounts/{account_id}/ai/finetunes", tag = crate::openapi::ADAPTERS,
    params(("account_id" = String, Path, description = "The token's account")),
    request_body = crate::openapi::FinetuneCreate,
    responses((status = 200, description = "An empty finetune, waiting for its two files", body = crate::openapi::Envelope)))]
pub async fn create_finetune(
    State(state): State<AppState>,
    Authenticated(account): Authenticated,
    Path(account_id): Path<String>,
    body: JsonBody,
) -> Result<Json<Value>, CloudflareError> {
    owner(&account.id, &account_id)?;
    let mut f = Fields::new(&body.value, "")?;
    let model: String = f.required("model", "a string")?;
    let name: String = f.required("name", "a string")?;
    let description: String = f.optional("description", "a string")?.unwrap_or_default();
    // Cloudflare's SDK sends `public`; a finetune here is its account's alone.
    if f.optional::<bool>("public", "a boolean")? == Some(true) {
        return Err(ApiError::invalid(
            ErrorCode::UnsupportedParameter,
            "public",
            "public finetunes are not offered: a finetune is its account's alone",
        )
        .into());
    }
    f.deny_unknown()?;
    let new = new_adapter(&state, &account.id, model, name, description)?;
    let limit = crate::quota::limits(&state, &account).adapters;
    let record = state
        .store
        .insert_adapter(&new, None, limit)
        .await?
        .map_err(over_adapters)?
        .ok_or_else(|| name_taken(&new.name))?;
    Ok(envelope(finetune_json(&record)))
}

/// `GET /client/v4/accounts/{account_id}/ai/finetunes`.
#[utoipa::path(get, path = "/client/v4/accounts/{account_id}/ai/finetunes", tag = crate::openapi::ADAPTERS,
    params(("account_id" = String, Path, description = "The token's account"), ("limit" = Option<u32>, Query, description = "Page size, 1–1000 (100)", minimum = 1, maximum = 1000), ("after" = Option<String>, Query, description = "The last adapter id of the page before", pattern = "^lora_[0-9a-fA-F]{32}$")),
    responses((status = 200, description = "The account's finetunes", body = crate::openapi::Envelope)))]
pub async fn list_finetunes(
    State(state): State<AppState>,
    Authenticated(account): Authenticated,
    Path(account_id): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<Value>, CloudflareError> {
    owner(&account.id, &account_id)?;
    let (adapters, _) = list_page(&state, &account.id, &query).await?;
    Ok(envelope(Value::Array(adapters.iter().map(finetune_json).collect())))
}

/// `POST /client/v4/accounts/{account_id}/ai/finetunes/{finetune}/finetune-assets`:
/// multipart `file_name` (`adapter_config.json` | `adapter_model.safetensors`) and `file`.
/// A file given again replaces the one before, once it passes the same checks.
#[utoipa::path(post, path = "/client/v4/accounts/{account_id}/ai/finetunes/{finetune_id}/finetune-assets", tag = crate::openapi::ADAPTERS,
    params(("account_id" = String, Path, description = "The token's account"), ("finetune_id" = String, Path, description = "A finetune's id or name")),
    request_body(content = crate::openapi::FinetuneAsset, content_type = "multipart/form-data"),
    responses((status = 200, description = "The file, checked", body = crate::openapi::Envelope)))]
pub async fn upload_asset(
    State(state): State<AppState>,
    Authenticated(account): Authenticated,
    Path((account_id, finetune)): Path<(String, String)>,
    Form(multipart): Form,
) -> Result<Json<Value>, CloudflareError> {
    owner(&account.id, &account_id)?;
    let record = owned_adapter(&state, &account.id, &finetune, "finetune_id").await?;
    let _permit = state.upload_permit()?;
    let parts = parts(multipart, &["file_name", "file"]).await?;
    let file_name = text_part(&parts, "file_name")?
        .ok_or_else(|| ApiError::invalid(ErrorCode::MissingField, "file_name", "file_name is required"))?;
    let data = parts.get("file").cloned().ok_or_else(|| {
        ApiError::invalid(
            ErrorCode::AdapterMissingFile,
            "file",
            format!("file must carry {file_name}"),
        )
    })?;
    let (config, weights) = asset_and_partner(&state, &record, &file_name, &data).await?;
    let summary = match (config, weights) {
        (Some(config), Some(weights)) => Some(
            check_pair(&state, &record.model, config, weights)
                .await?
                .map_err(|e| refused(e, "file", "file"))?,
        ),
        _ => None,
    };
    let asset = put_asset(&state, &account.id, &record.id, &file_name, data).await?;
    let updated = match state
        .store
        .set_adapter_asset(&record.id, &asset, summary.as_ref())
        .await
    {
        Ok(updated) => updated,
        Err(e) => {
            forget_objects(&state, [Some(asset_key(&asset))]).await;
            return Err(ApiError::from(e).into());
        }
    };
    let updated = recheck_pair(&state, &record.id, &asset, updated).await?;
    let replaced = match asset {
        AdapterAsset::Config { .. } => record.config_key,
        AdapterAsset::Weights { .. } => record.weights_key,
    };
    forget_objects(&state, [replaced]).await;
    // Cloudflare's asset reply, with the finetune's status.
    let uploaded_at = updated.modified_at.to_rfc3339();
    Ok(envelope(json!({
        "id": uuid::Uuid::now_v7().to_string(),
        "bucket_name": state.objects.bucket(),
        "created_at": uploaded_at,
        "modified_at": uploaded_at,
        "finetune_id": updated.id,
        "file_name": file_name,
        "status": updated.status(),
    })))
}

/// One uploaded file checked alone (as `file_name` says it is), with the
/// adapter's other file where it is already stored: `(config, weights)`.
async fn asset_and_partner(
    state: &AppState,
    record: &AdapterRecord,
    file_name: &str,
    data: &Bytes,
) -> Result<(Option<Bytes>, Option<Bytes>), ApiError> {
    let limits = state.config.adapter_limits;
    // The other file, when it is already there, for the check of the pair.
    let pair = match file_name {
        CONFIG_FILE => {
            config_size(data, "file")?;
            lora::check_config(data, limits).map_err(|e| refused(e, "file", "file"))?;
            let weights = match &record.weights_key {
                Some(key) => Some(Bytes::from(state.objects.get(key).await?)),
                None => None,
            };
            (Some(data.clone()), weights)
        }
        WEIGHTS_FILE => {
            let checked = {
                let data = data.clone();
                let base = (state.catalog.adapter_base(&record.model).copied())
                    .ok_or_else(|| lorry_protocol::model::no_adapters(&record.model, "model"))?;
                tokio::task::spawn_blocking(move || lora::check_weights(&data, &base, limits))
                    .await
                    .map_err(|e| ApiError::new(ErrorCode::InternalError, e.to_string()))?
            };
            checked.map_err(|e| refused(e, "file", "file"))?;
            let config = match &record.config_key {
                Some(key) => Some(Bytes::from(state.objects.get(key).await?)),
                None => None,
            };
            (config, Some(data.clone()))
        }
        other => {
            return Err(ApiError::invalid(
                ErrorCode::InvalidFileName,
                "file_name",
                format!("file_name {other:?} is neither {CONFIG_FILE} nor {WEIGHTS_FILE}"),
            ))
        }
    };
    Ok(pair)
}

/// An upload of the other file that ran at the same time saw this one
/// missing: with both now there, check the pair once more.
async fn recheck_pair(
    state: &AppState,
    id: &AdapterId,
    asset: &AdapterAsset,
    updated: AdapterRecord,
) -> Result<AdapterRecord, ApiError> {
    let updated = match (&updated.config_key, &updated.weights_key) {
        (Some(config_key), Some(weights_key)) if !updated.ready => {
            let (config, weights) = tokio::try_join!(state.objects.get(config_key), state.objects.get(weights_key))?;
            match check_pair(state, &updated.model, config.into(), weights.into()).await? {
                Ok(summary) => state.store.set_adapter_asset(id, asset, Some(&summary)).await?,
                // They do not fit together: it stays pending until either is sent again.
                Err(_) => updated,
            }
        }
        _ => updated,
    };
    Ok(updated)
}

/// Look up the account's adapter `reference` for a request to `model`.
pub async fn resolve(
    state: &AppState,
    account: &AccountId,
    model: &str,
    reference: &str,
    param: &str,
) -> Result<AdapterId, ApiError> {
    let record = state.store.find_adapter(account, reference).await?.ok_or_else(|| {
        ApiError::new(
            ErrorCode::AdapterNotFound,
            format!("no adapter {reference:?} in this account"),
        )
        .with_param(param)
    })?;
    if record.model != model {
        return Err(ApiError::invalid(
            ErrorCode::AdapterModelMismatch,
            param,
            format!("adapter {reference} adapts {}, not {model}", record.model),
        ));
    }
    if !record.ready {
        return Err(ApiError::new(
            ErrorCode::AdapterNotReady,
            format!("adapter {reference} is missing a file; upload {CONFIG_FILE} and {WEIGHTS_FILE}"),
        )
        .with_param(param));
    }
    Ok(record.id)
}

/// Resolve the adapter every request names (`lora` or `adapter`, or
/// `default` from the model name), and rewrite it to the adapter's id, which
/// is what workers look up. `path(i)` is request `i`'s body path, for errors.
pub async fn resolve_requests(
    state: &AppState,
    account: &AccountId,
    model: &str,
    requests: &mut [NewRequest],
    default: Option<&str>,
    path: impl Fn(usize) -> String,
) -> Result<(), ApiError> {
    let mut resolved: HashMap<String, AdapterId> = HashMap::new();
    for (i, NewRequest { request, .. }) in requests.iter_mut().enumerate() {
        let (reference, param) = match (request.lora.clone(), default) {
            (Some(reference), _) => {
                let (at, field) = (path(i), request.adapter_field.as_str());
                let param = if at.is_empty() {
                    field.to_string()
                } else {
                    format!("{at}.{field}")
                };
                (reference, param)
            }
            (None, Some(reference)) => {
                request.adapter_field = AdapterField::Adapter;
                (reference.to_string(), "model".to_string())
            }
            (None, None) => continue,
        };
        let id = match resolved.get(&reference) {
            Some(id) => id.clone(),
            None => {
                let id = resolve(state, account, model, &reference, &param).await?;
                resolved.insert(reference, id.clone());
                id
            }
        };
        request.lora = Some(id.to_string());
    }
    Ok(())
}
