//! OpenAI's files API (`/v1/files`) and the batch input it holds.
//!
//! A batch input file is JSONL, one request per line:
//! `{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions" | "/v1/embeddings", "body"}`.
//! Every line is checked at upload (JSON, fields, a served model, the body as
//! that endpoint reads it), and a refusal names the line; nothing is stored
//! for a refused file.

use std::collections::{HashMap, HashSet};

use axum::body::Bytes;
use axum::extract::{Multipart, Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use lorry_batcher::ids::{AccountId, FileId};
use lorry_batcher::openai::Endpoint;
use lorry_batcher::store::{FileRecord, NewFile};
use lorry_protocol::input::Fields;
use lorry_protocol::{Catalog, ErrorCode};
use serde_json::{json, Value};

use crate::extract::{page, Authenticated, Form};
use crate::openai::{translate, Translated};
use crate::submit::Item;
use crate::{ApiError, AppState};

/// The largest `custom_id`.
const MAX_CUSTOM_ID: usize = 512;

/// One checked line of a batch input file.
pub struct Line {
    /// 1-based line number.
    pub number: usize,
    /// The client's id.
    pub custom_id: String,
    /// The endpoint the line targets.
    pub endpoint: Endpoint,
    /// The body, translated.
    pub request: Translated,
}

fn line_error(number: usize, error: ApiError) -> ApiError {
    let field = error.param.clone().unwrap_or_default();
    let at = if field.is_empty() {
        format!("line {number}")
    } else {
        format!("line {number}: {field}")
    };
    let mut refused = ApiError::new(error.code, format!("{at}: {}", error.message));
    refused.param = Some(format!(
        "file.line[{number}]{}{field}",
        if field.is_empty() { "" } else { "." }
    ));
    refused
}

/// Check every line of a batch input file, handing each to `each` as it is
/// read (so that checking an upload holds one line's values at a time, not
/// the file's); the first bad line is refused, named. Returns the count.
pub fn check_lines(
    catalog: &Catalog,
    max_requests: usize,
    bytes: &[u8],
    mut each: impl FnMut(Line) -> Result<(), ApiError>,
) -> Result<usize, ApiError> {
    let text = std::str::from_utf8(bytes)
        .map_err(|_| ApiError::invalid(ErrorCode::InvalidFile, "file", "the file must be UTF-8 JSON lines"))?;
    let mut count = 0;
    let mut seen = HashSet::new();
    for (i, raw) in text.lines().enumerate() {
        let number = i + 1;
        if raw.trim().is_empty() {
            continue;
        }
        if count == max_requests {
            return Err(ApiError::invalid(
                ErrorCode::TooManyRequests,
                "file",
                format!("a batch file holds at most {max_requests} requests"),
            ));
        }
        let value: Value = lorry_protocol::json::parse_str(raw).map_err(|e| {
            line_error(
                number,
                ApiError::invalid(ErrorCode::InvalidJson, "", format!("not valid JSON: {e}")),
            )
        })?;
        lorry_protocol::input::refuse_nul(&value, "").map_err(|e| line_error(number, e.into()))?;
        let line = read_line(catalog, &value).map_err(|e| line_error(number, e))?;
        let (custom_id, endpoint, request) = line;
        if !seen.insert(custom_id.clone()) {
            return Err(line_error(
                number,
                ApiError::invalid(
                    ErrorCode::DuplicateCustomId,
                    "custom_id",
                    format!("custom_id {custom_id:?} appears more than once"),
                ),
            ));
        }
        count += 1;
        each(Line {
            number,
            custom_id,
            endpoint,
            request,
        })?;
    }
    if count == 0 {
        return Err(ApiError::invalid(
            ErrorCode::EmptyFile,
            "file",
            "the file holds no requests",
        ));
    }
    Ok(count)
}

fn read_line(catalog: &Catalog, value: &Value) -> Result<(String, Endpoint, Translated), ApiError> {
    let mut f = Fields::new(value, "")?;
    let custom_id: String = f.required("custom_id", "a string")?;
    if custom_id.is_empty() || custom_id.len() > MAX_CUSTOM_ID {
        return Err(ApiError::invalid(
            ErrorCode::InvalidValue,
            "custom_id",
            format!("custom_id must be 1 to {MAX_CUSTOM_ID} characters"),
        ));
    }
    let method: String = f.required("method", "a string")?;
    if method != "POST" {
        return Err(ApiError::invalid(
            ErrorCode::InvalidValue,
            "method",
            "method must be POST",
        ));
    }
    let url: String = f.required("url", "a string")?;
    let endpoint = Endpoint::from_path(&url).ok_or_else(|| {
        ApiError::invalid(
            ErrorCode::InvalidValue,
            "url",
            "url must be /v1/chat/completions, /v1/completions or /v1/embeddings",
        )
    })?;
    let body = f
        .raw("body")
        .ok_or_else(|| ApiError::invalid(ErrorCode::MissingField, "body", "body is required"))?;
    f.deny_unknown()?;
    let request = translate(catalog, endpoint, body).map_err(|e| {
        let field = e.param.clone().unwrap_or_default();
        let mut e = e;
        e.param = Some(if field.is_empty() {
            "body".into()
        } else {
            format!("body.{field}")
        });
        e
    })?;
    if request.stream {
        return Err(ApiError::invalid(
            ErrorCode::InvalidValue,
            "body.stream",
            "a batch request cannot stream",
        ));
    }
    Ok((custom_id, endpoint, request))
}

/// The requests of a batch made from a file: every line must target `endpoint`
/// and name the same model. Returns the items and the model as the lines name it.
pub async fn batch_items(
    state: &AppState,
    account: &AccountId,
    file_id: &str,
    endpoint: Endpoint,
) -> Result<(Vec<Item>, Translated), ApiError> {
    let file = owned_file(state, account, file_id, "input_file_id").await?;
    if file.file.purpose != "batch" {
        return Err(ApiError::invalid(
            ErrorCode::InvalidFilePurpose,
            "input_file_id",
            "the input file must have been uploaded with purpose=batch",
        ));
    }
    let bytes = state.objects.get(&file.file.object_key).await?;
    let mut items = Vec::new();
    let mut first: Option<Translated> = None;
    check_lines(&state.catalog, state.config.max_requests, &bytes, |line| {
        let first = first.get_or_insert_with(|| line.request.clone());
        let path = format!("input_file_id.line[{}]", line.number);
        if line.endpoint != endpoint {
            return Err(ApiError::invalid(
                ErrorCode::EndpointMismatch,
                format!("{path}.url"),
                format!(
                    "line {}: url must be the batch's endpoint {}",
                    line.number,
                    endpoint.path()
                ),
            ));
        }
        if line.request.requested != first.requested {
            return Err(ApiError::invalid(
                ErrorCode::ModelMismatch,
                format!("{path}.body.model"),
                format!(
                    "line {}: every line of a batch must name the same model ({})",
                    line.number, first.requested
                ),
            ));
        }
        items.push(Item {
            custom_id: Some(line.custom_id),
            body: crate::submit::Body::Valid(line.request.valid),
            custom_id_path: format!("{path}.custom_id"),
            path: format!("{path}.body"),
        });
        Ok(())
    })?;
    let first = first.expect("check_lines refuses a file without lines");
    Ok((items, first))
}

/// The account's file named by `raw_id`, or 404.
pub async fn owned_file(
    state: &AppState,
    account: &AccountId,
    raw_id: &str,
    param: &str,
) -> Result<FileRecord, ApiError> {
    let missing = || ApiError::not_found(ErrorCode::FileNotFound, param, "file");
    let id = FileId::parse(raw_id).ok_or_else(missing)?;
    state.store.file(account, &id).await?.ok_or_else(missing)
}

fn multipart_error(error: axum::extract::multipart::MultipartError) -> ApiError {
    if error.status() == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::new(ErrorCode::FileTooLarge, "the file is over the size limit").with_param("file")
    } else if crate::guard::timed_out(&error) {
        crate::guard::unreadable(&error, String::new())
    } else {
        ApiError::invalid(ErrorCode::InvalidMultipart, "", error.body_text())
    }
}

/// `POST /v1/files`: multipart `purpose` (`batch`) and `file` (JSONL).
#[utoipa::path(post, path = "/v1/files", tag = crate::openapi::OPENAI,
    request_body(content = crate::openapi::FileUpload, content_type = "multipart/form-data"),
    responses((status = 200, description = "The file, every line checked", body = crate::openapi::FileObject)))]
pub async fn create(
    State(state): State<AppState>,
    Authenticated(account): Authenticated,
    Form(mut multipart): Form,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let _permit = state.upload_permit()?;
    let Upload {
        purpose,
        file,
        anchor,
        seconds,
    } = upload_parts(&mut multipart).await?;
    let expires = expires_after(anchor.as_deref(), seconds.as_deref(), "expires_after")?;
    match purpose.as_deref() {
        Some("batch") => {}
        None => {
            return Err(ApiError::invalid(
                ErrorCode::MissingField,
                "purpose",
                "purpose is required",
            ))
        }
        Some(_) => {
            return Err(ApiError::invalid(
                ErrorCode::InvalidValue,
                "purpose",
                "purpose must be batch: files here are batch input",
            ))
        }
    }
    let (filename, bytes) =
        file.ok_or_else(|| ApiError::invalid(ErrorCode::MissingField, "file", "file is required"))?;
    if filename.is_empty() || filename.len() > 255 || filename.contains(['/', '\\', '\0']) {
        return Err(ApiError::invalid(
            ErrorCode::InvalidValue,
            "file",
            "the file name must be 1 to 255 bytes without slashes or U+0000",
        ));
    }
    let lines = check_lines(&state.catalog, state.config.max_requests, &bytes, |_| Ok(()))?;
    let id = FileId::generate();
    // The key is made of ids alone: the client's name is kept in the record.
    let key = format!("accounts/{}/files/{id}", account.id);
    let size = bytes.len() as i64;
    state.objects.put(&key, bytes, "application/jsonl").await?;
    let new = NewFile {
        id,
        account_id: account.id.clone(),
        purpose: "batch".into(),
        filename,
        bytes: size,
        lines: lines as i32,
        object_key: key.clone(),
        expires_after: expires.map(|secs| secs as i64),
    };
    let limit = crate::quota::limits(&state, &account).file_bytes;
    let refusal = match state.store.insert_file(&new, limit).await {
        Ok(Ok(record)) => return Ok((StatusCode::OK, Json(record.to_json()))),
        Ok(Err(refusal)) => crate::quota::refused(refusal, ErrorCode::QuotaFileBytes, "bytes of files"),
        Err(e) => e.into(),
    };
    // Nothing half-written: the bytes go if the record could not be made.
    let _ = state.objects.delete(&key).await;
    Err(refusal)
}

/// The parts of an upload: `purpose`, `file` and OpenAI's optional
/// `expires_after[anchor]` / `expires_after[seconds]`, each at most once, nothing else.
#[derive(Default)]
struct Upload {
    purpose: Option<String>,
    file: Option<(String, Bytes)>,
    anchor: Option<String>,
    seconds: Option<String>,
}

async fn upload_parts(multipart: &mut Multipart) -> Result<Upload, ApiError> {
    let mut upload = Upload::default();
    while let Some(field) = multipart.next_field().await.map_err(multipart_error)? {
        let name = field.name().unwrap_or_default().to_string();
        let text_slot = match name.as_str() {
            "purpose" => Some(&mut upload.purpose),
            "expires_after[anchor]" => Some(&mut upload.anchor),
            "expires_after[seconds]" => Some(&mut upload.seconds),
            _ => None,
        };
        let duplicate = || {
            ApiError::invalid(
                ErrorCode::DuplicateField,
                name.clone(),
                format!("{name} is given more than once"),
            )
        };
        match (name.as_str(), text_slot) {
            (_, Some(slot)) => {
                if slot.is_some() {
                    return Err(duplicate());
                }
                let bytes = field.bytes().await.map_err(multipart_error)?;
                *slot = Some(String::from_utf8_lossy(&bytes).into_owned());
            }
            ("file", None) if upload.file.is_none() => {
                let filename = field.file_name().unwrap_or("upload.jsonl").to_string();
                upload.file = Some((filename, field.bytes().await.map_err(multipart_error)?));
            }
            ("file", None) => return Err(duplicate()),
            _ => {
                return Err(ApiError::invalid(
                    ErrorCode::UnknownField,
                    name.clone(),
                    format!("unknown field {name:?}; the fields are purpose, file and expires_after"),
                ))
            }
        }
    }
    Ok(upload)
}

/// The shortest and longest `expires_after.seconds` OpenAI takes (an hour, 30 days).
pub const EXPIRES_AFTER: std::ops::RangeInclusive<u64> = 3600..=2_592_000;

/// OpenAI's `expires_after`: the anchor (`created_at`, the only one) and the
/// seconds after it, both given or neither; `param` names the object.
pub fn expires_after(anchor: Option<&str>, seconds: Option<&str>, param: &str) -> Result<Option<u64>, ApiError> {
    match (anchor, seconds) {
        (None, None) => Ok(None),
        (Some(anchor), Some(seconds)) => {
            if anchor != "created_at" {
                return Err(ApiError::invalid(
                    ErrorCode::InvalidValue,
                    format!("{param}.anchor"),
                    format!("{param}.anchor must be created_at"),
                ));
            }
            seconds
                .trim()
                .parse::<u64>()
                .ok()
                .filter(|s| EXPIRES_AFTER.contains(s))
                .map(Some)
                .ok_or_else(|| {
                    ApiError::invalid(
                        ErrorCode::OutOfRange,
                        format!("{param}.seconds"),
                        format!(
                            "{param}.seconds must be a whole number from {} to {}",
                            EXPIRES_AFTER.start(),
                            EXPIRES_AFTER.end()
                        ),
                    )
                })
        }
        (None, Some(_)) => Err(ApiError::invalid(
            ErrorCode::MissingField,
            format!("{param}.anchor"),
            format!("{param}.anchor is required with {param}.seconds"),
        )),
        (Some(_), None) => Err(ApiError::invalid(
            ErrorCode::MissingField,
            format!("{param}.seconds"),
            format!("{param}.seconds is required with {param}.anchor"),
        )),
    }
}

/// `GET /v1/files?purpose&limit&after`: newest first.
#[utoipa::path(get, path = "/v1/files", tag = crate::openapi::OPENAI,
    params(("purpose" = Option<String>, Query, description = "Only files of this purpose"), ("limit" = Option<u32>, Query, description = "Page size, 1–10,000 (100)", minimum = 1, maximum = 10000), ("after" = Option<String>, Query, description = "The last file id of the page before", pattern = "^file-[0-9a-fA-F]{32}$")),
    responses((status = 200, description = "Files, newest first", body = crate::openapi::FileList)))]
pub async fn list(
    State(state): State<AppState>,
    Authenticated(account): Authenticated,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    let (limit, after) = page(&query, 100, 10_000, FileId::parse, "a file id")?;
    let purpose = query.get("purpose").map(String::as_str);
    let (files, has_more) = state
        .store
        .list_files(&account.id, purpose, limit, after.as_ref())
        .await?;
    Ok(Json(json!({
        "object": "list",
        "data": files.iter().map(FileRecord::to_json).collect::<Vec<_>>(),
        "first_id": files.first().map(|f| &f.file.id),
        "last_id": files.last().map(|f| &f.file.id),
        "has_more": has_more,
    })))
}

/// `GET /v1/files/{id}`.
#[utoipa::path(get, path = "/v1/files/{id}", tag = crate::openapi::OPENAI,
    params(("id" = String, Path, description = "A file id", pattern = "^file-[0-9a-fA-F]{32}$")),
    responses((status = 200, description = "The file", body = crate::openapi::FileObject)))]
pub async fn show(
    State(state): State<AppState>,
    Authenticated(account): Authenticated,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    Ok(Json(owned_file(&state, &account.id, &id, "file_id").await?.to_json()))
}

/// `GET /v1/files/{id}/content`.
#[utoipa::path(get, path = "/v1/files/{id}/content", tag = crate::openapi::OPENAI,
    params(("id" = String, Path, description = "A file id", pattern = "^file-[0-9a-fA-F]{32}$")),
    responses((status = 200, description = "The file's bytes", content_type = "application/jsonl", body = String)))]
pub async fn content(
    State(state): State<AppState>,
    Authenticated(account): Authenticated,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let file = owned_file(&state, &account.id, &id, "file_id").await?;
    // Passed on as S3 sends it: memory is a piece per response, not the file.
    let bytes = state.objects.get_stream(&file.file.object_key).await?;
    Ok((
        [(header::CONTENT_TYPE, "application/jsonl")],
        axum::body::Body::from_stream(bytes),
    )
        .into_response())
}

/// `DELETE /v1/files/{id}`: the record first, then the bytes.
#[utoipa::path(delete, path = "/v1/files/{id}", tag = crate::openapi::OPENAI,
    params(("id" = String, Path, description = "A file id", pattern = "^file-[0-9a-fA-F]{32}$")),
    responses((status = 200, description = "The file is gone", body = crate::openapi::Deleted)))]
pub async fn delete(
    State(state): State<AppState>,
    Authenticated(account): Authenticated,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let file = owned_file(&state, &account.id, &id, "file_id").await?;
    let deleted = state
        .store
        .delete_file(&account.id, &file.file.id)
        .await?
        .ok_or_else(|| ApiError::not_found(ErrorCode::FileNotFound, "file_id", "file"))?;
    if let Err(e) = state.objects.delete(&deleted.file.object_key).await {
        tracing::warn!(file = %deleted.file.id, error = %e, "could not delete a file's bytes");
    }
    Ok(Json(json!({"id": deleted.file.id, "object": "file", "deleted": true})))
}
