//! The native batch API: `/v1/batches`.

use std::collections::HashMap;

use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use lorry_batcher::ids::BatchId;
use lorry_batcher::model::{Batch, OpenAiBatch, Shape, Tally};
use lorry_batcher::openai::Endpoint;
use lorry_batcher::store::BatchDeletion;
use lorry_protocol::input::Fields;
use lorry_protocol::{Catalog, ErrorCode};
use serde_json::{json, Value};

use crate::extract::{page, Authenticated, JsonBody};
use crate::files;
use crate::submit::{self, Item, Options, Submission};
use crate::{ApiError, AppState};

/// The batch object, with fresh presigned URLs once it has ended.
pub async fn batch_json(state: &AppState, batch: &Batch, tally: &Tally) -> Result<Value, ApiError> {
    let ttl = state.config.output_url_ttl;
    let output_url = match &batch.output_key {
        Some(key) => Some(state.objects.presign_get(key, ttl).await?),
        None => None,
    };
    let errors_url = match &batch.errors_key {
        Some(key) => Some(state.objects.presign_get(key, ttl).await?),
        None => None,
    };
    Ok(batch.to_json(tally, output_url, errors_url))
}

/// The account's batch named by a path segment, or 404.
pub async fn owned_batch(
    state: &AppState,
    account: &Authenticated,
    raw_id: &str,
    param: &str,
) -> Result<Batch, ApiError> {
    let missing = || ApiError::not_found(ErrorCode::BatchNotFound, param, "batch");
    let id = BatchId::parse(raw_id).ok_or_else(missing)?;
    state.store.batch(&account.0.id, &id).await?.ok_or_else(missing)
}

/// `POST /v1/batches`.
#[utoipa::path(post, path = "/v1/batches", tag = crate::openapi::NATIVE,
    request_body = crate::openapi::BatchCreate,
    params(("Idempotency-Key" = Option<String>, Header, description = "1–255 visible ASCII: a retry with the same key and body answers the same batch")),
    responses((status = 202, description = "The batch, accepted", body = crate::openapi::Batch)))]
pub async fn create(
    State(state): State<AppState>,
    account: Authenticated,
    headers: HeaderMap,
    body: JsonBody,
) -> Result<Response, ApiError> {
    let mut f = Fields::new(&body.value, "")?;
    let read = if f.raw("input_file_id").is_some() {
        from_file(&state, &account, f).await?
    } else {
        inline(&state.catalog, f)?
    };
    let new = submit::prepare(
        &state,
        &account.0.id,
        read.submission,
        &headers,
        &body.raw,
        read.default_adapter.as_deref(),
        read.path,
    )
    .await?;
    let (batch, created) = submit::create(&state, &account.0, new).await?;
    let tally = if created {
        submit::fresh_tally(batch.total)
    } else {
        state.store.tally(&batch.id).await?
    };
    let mut response = (StatusCode::ACCEPTED, Json(batch_json(&state, &batch, &tally).await?)).into_response();
    if !created {
        response
            .headers_mut()
            .insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    Ok(response)
}

/// A submission read from either shape of `POST /v1/batches`.
pub(crate) struct Read<'a> {
    pub(crate) submission: Submission<'a>,
    /// The adapter of `model: "base:adapter"`, for requests that name none.
    default_adapter: Option<String>,
    /// Where request `i`'s adapter is named, for errors.
    path: fn(usize) -> String,
}

/// The native shape: `{"model", "requests": [{"custom_id"?, "body"}], …}`.
pub(crate) fn inline<'a>(catalog: &'a Catalog, mut f: Fields<'_>) -> Result<Read<'a>, ApiError> {
    let model_name: String = f.required("model", "a string")?;
    let requests = f
        .raw("requests")
        .ok_or_else(|| ApiError::invalid(ErrorCode::MissingField, "requests", "requests is required"))?;
    let items = native_items(requests)?;
    let options = Options {
        completion_window: f.optional("completion_window", "a string")?,
        metadata: f.raw("metadata").cloned(),
        webhook_url: submit::webhook_url(&mut f)?,
        openai: None,
        priority: submit::priority(&mut f)?,
    };
    f.optional::<String>("endpoint", "a string")?;
    f.deny_unknown()?;
    let (base, default_adapter) = submit::split_model(catalog, &model_name);
    let spec = submit::model(catalog, base, "model")?;
    if default_adapter.is_some() {
        spec.adapter_shape("model")?;
    }
    Ok(Read {
        submission: Submission {
            spec,
            shape: Shape::Native,
            items,
            options,
        },
        default_adapter: default_adapter.map(str::to_string),
        path: |i| format!("requests[{i}].body"),
    })
}

/// OpenAI's shape: `{"input_file_id", "endpoint", "completion_window", "metadata"?}`;
/// the requests come from the file, each line's body translated as its endpoint reads it.
async fn from_file<'a>(state: &'a AppState, account: &Authenticated, mut f: Fields<'_>) -> Result<Read<'a>, ApiError> {
    let file_id: String = f.required("input_file_id", "a string")?;
    let endpoint: String = f.required("endpoint", "a string")?;
    let endpoint = Endpoint::from_path(&endpoint).ok_or_else(|| {
        ApiError::invalid(
            ErrorCode::InvalidValue,
            "endpoint",
            "endpoint must be /v1/chat/completions, /v1/completions or /v1/embeddings",
        )
    })?;
    let completion_window: Option<String> = f.optional("completion_window", "a string")?;
    let metadata = f.raw("metadata").cloned();
    let webhook_url = submit::webhook_url(&mut f)?;
    let priority = submit::priority(&mut f)?;
    let output_expires_after = match f.raw("output_expires_after") {
        None => None,
        Some(raw) => {
            let mut e = Fields::new(raw, "output_expires_after")?;
            let anchor: Option<String> = e.optional("anchor", "a string")?;
            let seconds: Option<u64> = e.optional("seconds", "a whole number")?;
            e.deny_unknown()?;
            files::expires_after(
                anchor.as_deref(),
                seconds.map(|s| s.to_string()).as_deref(),
                "output_expires_after",
            )?
        }
    };
    f.deny_unknown()?;
    let (items, first) = files::batch_items(state, &account.0.id, &file_id, endpoint).await?;
    let options = Options {
        completion_window,
        metadata,
        webhook_url,
        openai: Some(OpenAiBatch {
            endpoint: endpoint.path().to_string(),
            input_file_id: file_id,
            model: first.requested.clone(),
            output_file_id: None,
            error_file_id: None,
            output_expires_after,
        }),
        priority,
    };
    let spec = submit::model(&state.catalog, &first.model, "model")?;
    Ok(Read {
        submission: Submission {
            spec,
            shape: Shape::OpenAi,
            items,
            options,
        },
        default_adapter: None,
        path: |i| format!("input_file_id.line[{}].body.model", i + 1),
    })
}

fn native_items(requests: &Value) -> Result<Vec<Item>, ApiError> {
    let list = requests
        .as_array()
        .ok_or_else(|| ApiError::invalid(ErrorCode::InvalidType, "requests", "requests must be an array"))?;
    list.iter()
        .enumerate()
        .map(|(i, item)| {
            let path = format!("requests[{i}]");
            let mut f = Fields::new(item, &path)?;
            let custom_id: Option<String> = f.optional("custom_id", "a string")?;
            let body = f
                .raw("body")
                .ok_or_else(|| {
                    ApiError::invalid(
                        ErrorCode::MissingField,
                        format!("{path}.body"),
                        format!("{path}.body is required"),
                    )
                })?
                .clone();
            f.deny_unknown()?;
            Ok(Item {
                custom_id,
                body: submit::Body::Json(body),
                custom_id_path: format!("{path}.custom_id"),
                path: format!("{path}.body"),
            })
        })
        .collect()
}

/// `GET /v1/batches/{id}`.
#[utoipa::path(get, path = "/v1/batches/{id}", tag = crate::openapi::NATIVE,
    params(("id" = String, Path, description = "A batch id", pattern = "^batch_[0-9a-fA-F]{32}$")),
    responses((status = 200, description = "The batch", body = crate::openapi::Batch)))]
pub async fn show(
    State(state): State<AppState>,
    account: Authenticated,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let batch = owned_batch(&state, &account, &id, "id").await?;
    let tally = state.store.tally(&batch.id).await?;
    Ok(Json(batch_json(&state, &batch, &tally).await?))
}

/// `GET /v1/batches?limit&after`: newest first.
#[utoipa::path(get, path = "/v1/batches", tag = crate::openapi::NATIVE,
    params(("limit" = Option<u32>, Query, description = "Page size, 1–100 (20)", minimum = 1, maximum = 100), ("after" = Option<String>, Query, description = "The last batch id of the page before", pattern = "^batch_[0-9a-fA-F]{32}$")),
    responses((status = 200, description = "Batches, newest first", body = crate::openapi::BatchList)))]
pub async fn list(
    State(state): State<AppState>,
    account: Authenticated,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    let (limit, after) = page(&query, 20, 100, BatchId::parse, "a batch id")?;
    let page = state.store.list_batches(&account.0.id, limit, after.as_ref()).await?;
    let ids: Vec<&BatchId> = page.batches.iter().map(|b| &b.id).collect();
    let mut tallies = state.store.tallies(&ids).await?;
    let mut data = Vec::with_capacity(page.batches.len());
    for batch in &page.batches {
        let tally = tallies.remove(&batch.id).unwrap_or_default();
        data.push(batch_json(&state, batch, &tally).await?);
    }
    Ok(Json(json!({
        "object": "list",
        "data": data,
        "first_id": page.batches.first().map(|b| &b.id),
        "last_id": page.batches.last().map(|b| &b.id),
        "has_more": page.has_more,
    })))
}

/// `POST /v1/batches/{id}/cancel`: unstarted requests are cancelled; running ones finish.
#[utoipa::path(post, path = "/v1/batches/{id}/cancel", tag = crate::openapi::NATIVE,
    params(("id" = String, Path, description = "A batch id", pattern = "^batch_[0-9a-fA-F]{32}$")),
    responses((status = 200, description = "The batch, cancelling", body = crate::openapi::Batch)))]
pub async fn cancel(
    State(state): State<AppState>,
    account: Authenticated,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let batch = owned_batch(&state, &account, &id, "id").await?;
    let batch = state
        .store
        .cancel_batch(&account.0.id, &batch.id)
        .await?
        .ok_or_else(|| ApiError::not_found(ErrorCode::BatchNotFound, "id", "batch"))?;
    if batch.status.is_terminal() || batch.status == lorry_batcher::model::BatchStatus::Finalizing {
        return Err(ApiError::new(
            ErrorCode::BatchNotCancellable,
            format!("the batch is {} and can no longer be cancelled", batch.status.as_str()),
        )
        .with_param("id"));
    }
    let tally = state.store.tally(&batch.id).await?;
    Ok(Json(batch_json(&state, &batch, &tally).await?))
}

/// `DELETE /v1/batches/{id}`: an ended batch's requests, results, output
/// and error files (records and S3 objects) are deleted.
#[utoipa::path(delete, path = "/v1/batches/{id}", tag = crate::openapi::NATIVE,
    params(("id" = String, Path, description = "A batch id", pattern = "^batch_[0-9a-fA-F]{32}$")),
    responses((status = 200, description = "The batch is gone", body = crate::openapi::Deleted)))]
pub async fn delete(
    State(state): State<AppState>,
    account: Authenticated,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let not_found = || ApiError::not_found(ErrorCode::BatchNotFound, "id", "batch");
    let id = BatchId::parse(&id).ok_or_else(not_found)?;
    match state.store.delete_batch(&account.0.id, &id).await? {
        BatchDeletion::NotFound => Err(not_found()),
        BatchDeletion::NotEnded => Err(ApiError::new(
            ErrorCode::BatchNotEnded,
            "the batch has not ended; cancel it and delete it once it is cancelled",
        )
        .with_param("id")),
        BatchDeletion::Deleted { keys } => {
            // The rows are gone; objects left by a failure here are unreachable.
            if let Err(e) =
                lorry_batcher::finaliser::remove_batch_objects(&state.objects, &account.0.id, &id, &keys).await
            {
                tracing::warn!(batch = %id, error = %e, "a deleted batch's objects could not all be removed");
            }
            Ok(Json(json!({"id": id, "object": "batch", "deleted": true})))
        }
    }
}

/// `GET /v1/batches/{id}/results`: one JSON line per finished request, in index order.
#[utoipa::path(get, path = "/v1/batches/{id}/results", tag = crate::openapi::NATIVE,
    params(("id" = String, Path, description = "A batch id", pattern = "^batch_[0-9a-fA-F]{32}$")),
    responses((status = 200, description = "One line per finished request, in index order", content_type = "application/jsonl", body = crate::openapi::ResultLine)))]
pub async fn results(
    State(state): State<AppState>,
    account: Authenticated,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let batch = owned_batch(&state, &account, &id, "id").await?;
    let lines = finished_pieces(&state, &batch.id, |body, _, request, batch| {
        serde_json::to_writer(&mut *body, &request.result_line(batch))?;
        body.push(b'\n');
        Ok(())
    })
    .await?;
    Ok((
        [(header::CONTENT_TYPE, "application/jsonl")],
        axum::body::Body::from_stream(lines),
    )
        .into_response())
}

/// A batch's finished requests as pieces of a response body, in index order,
/// each written by `write` (given the piece, how many were written before it,
/// the request and the batch id). The first page is read before answering, so
/// that a database failure is a clean 503; the rest are read a page at a time
/// as the client takes them (memory: one page per response, however large
/// the batch). A failure part way ends the body early, logged.
pub async fn finished_pieces<W>(
    state: &AppState,
    batch: &BatchId,
    write: W,
) -> Result<impl futures::Stream<Item = Result<axum::body::Bytes, lorry_batcher::BatcherError>> + use<W>, ApiError>
where
    W: Fn(&mut Vec<u8>, usize, &lorry_batcher::model::FinishedRequest, &BatchId) -> serde_json::Result<()>
        + Send
        + 'static,
{
    let first = state.store.finished_requests_page(batch, -1, RESULTS_PAGE).await?;
    let pages = futures::stream::try_unfold(
        (Some(first), None, 0usize, state.store.clone(), batch.clone(), write),
        |(first, after, written, store, id, write)| async move {
            let page = match (first, after) {
                (Some(page), _) => page,
                (None, Some(after)) => store.finished_requests_page(&id, after, RESULTS_PAGE).await?,
                (None, None) => return Ok(None),
            };
            let Some(last) = page.last().map(|r| r.index) else {
                return Ok(None);
            };
            let mut body = Vec::with_capacity(page.len() * 256);
            for (n, request) in page.iter().enumerate() {
                write(&mut body, written + n, request, &id).map_err(lorry_batcher::BatcherError::from)?;
            }
            // A short page is the last one.
            let after = (page.len() as i64 == RESULTS_PAGE).then_some(last);
            let written = written + page.len();
            Ok::<_, lorry_batcher::BatcherError>(Some((
                axum::body::Bytes::from(body),
                (None, after, written, store, id, write),
            )))
        },
    );
    Ok(futures::StreamExt::inspect(pages, |page| {
        if let Err(error) = page {
            tracing::error!(%error, "a results listing failed part way; its response ends early");
        }
    }))
}

/// Results read and sent at a time by `GET /v1/batches/{id}/results`.
const RESULTS_PAGE: i64 = 1000;
