//! The Workers AI shape: `POST /client/v4/accounts/{account_id}/ai/run/{model}`.
//!
//! - `{"requests":[…]}` with `?queueRequest=true` (or `"queueRequest": true`)
//!   queues a batch and answers `{"result":{"status":"queued","request_id","model"}}`.
//! - `{"request_id"}` polls it: `queued`, `running`, or the responses.
//! - Anything else is one request on the real-time lane, streamed as
//!   server-sent events when `"stream": true`.

use std::collections::HashMap;
use std::convert::Infallible;

use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::{self, StreamExt};
use lorry_batcher::model::{BatchStatus, RequestStatus, Shape};
use lorry_batcher::realtime::Reply;
use lorry_batcher::store::Account;
use lorry_protocol::input::Fields;
use lorry_protocol::tools::ToolCall;
use lorry_protocol::ErrorCode;
use lorry_protocol::{Output, Usage, ValidRequest};
use serde_json::{json, Value};

use crate::batches::owned_batch;
use crate::error::CloudflareError;
use crate::extract::{Authenticated, JsonBody};
use crate::submit::{self, Item, Options, Submission};
use crate::{lane, ApiError, AppState};

fn envelope(result: Value) -> Json<Value> {
    Json(json!({"result": result, "success": true, "errors": [], "messages": []}))
}

/// `POST /client/v4/accounts/{account_id}/ai/run/{model}`.
#[utoipa::path(post, path = "/client/v4/accounts/{account_id}/ai/run/{model}", tag = crate::openapi::WORKERS_AI,
    request_body = crate::openapi::RunBody,
    params(("account_id" = String, Path, description = "The token's account"), ("model" = String, Path, description = "A served model's name (it may hold slashes)"),
        ("queueRequest" = Option<bool>, Query, description = "Queue the body's `requests` as a batch"),
        ("Idempotency-Key" = Option<String>, Header, description = "For a queued batch: as on `POST /v1/batches`")),
    responses((status = 200, description = "A queued batch's id, a polled batch's state or responses, or one request's answer (with `stream`, server-sent events)",
        content((crate::openapi::Envelope = "application/json"), (crate::openapi::ServerSentEvent = "text/event-stream")))))]
pub async fn run(
    State(state): State<AppState>,
    account: Authenticated,
    Path((account_id, model)): Path<(String, String)>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: JsonBody,
) -> Result<Response, CloudflareError> {
    if account_id != account.0.id.0 {
        return Err(ApiError::not_found(ErrorCode::AccountNotFound, "account_id", "account").into());
    }
    let model = model.trim_start_matches('/');
    let spec = submit::model(&state.catalog, model, "model")?;
    let queued_in_query = match query.get("queueRequest").map(String::as_str) {
        None | Some("false") => false,
        Some("true") => true,
        Some(_) => {
            return Err(ApiError::invalid(
                ErrorCode::InvalidValue,
                "queueRequest",
                "queueRequest must be true or false",
            )
            .into())
        }
    };
    match read_run(spec, queued_in_query, &body.value)? {
        Run::Poll(request_id) => poll(&state, &account, &request_id).await,
        Run::Queue(submission) => queue(&state, &account, submission, &headers, &body.raw).await,
        Run::RealTime(valid) => realtime(&state, &account.0, model, valid).await,
    }
}

/// What a body on the run route asks for.
pub(crate) enum Run<'a> {
    /// The state or the responses of the batch queued under this id.
    Poll(String),
    /// A batch to queue.
    Queue(Submission<'a>),
    /// One request for the real-time lane.
    RealTime(ValidRequest),
}

/// Read a body on the run route for `spec`: a poll (`request_id`), a batch
/// to queue (`queueRequest`, in the query or the body), or one request.
pub(crate) fn read_run<'a>(
    spec: &'a lorry_protocol::ModelSpec,
    queued_in_query: bool,
    body: &Value,
) -> Result<Run<'a>, ApiError> {
    let object = body
        .as_object()
        .ok_or_else(|| ApiError::invalid(ErrorCode::InvalidType, "", "the body must be a JSON object"))?;
    if object.contains_key("request_id") {
        let mut f = Fields::new(body, "")?;
        let request_id: String = f.required("request_id", "a string")?;
        f.raw("queueRequest");
        f.deny_unknown()?;
        return Ok(Run::Poll(request_id));
    }
    let queued_in_body = match object.get("queueRequest") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::invalid(
                ErrorCode::InvalidType,
                "queueRequest",
                "queueRequest must be a boolean",
            ))
        }
    };
    if queued_in_query || queued_in_body {
        return Ok(Run::Queue(queued(spec, body)?));
    }
    let mut input = body.clone();
    if let Some(map) = input.as_object_mut() {
        map.remove("queueRequest");
    }
    Ok(Run::RealTime(spec.validate(&input)?))
}

async fn queue(
    state: &AppState,
    account: &Authenticated,
    submission: Submission<'_>,
    headers: &HeaderMap,
    raw: &[u8],
) -> Result<Response, CloudflareError> {
    let new = submit::prepare(state, &account.0.id, submission, headers, raw, None, |i| {
        format!("requests[{i}]")
    })
    .await?;
    let (batch, _) = submit::create(state, &account.0, new).await?;
    Ok(envelope(json!({"status": "queued", "request_id": batch.id, "model": batch.model})).into_response())
}

/// A queued batch's body: `{"requests": [model input, "external_reference"?], "webhook"?}`.
fn queued<'a>(spec: &'a lorry_protocol::ModelSpec, body: &Value) -> Result<Submission<'a>, ApiError> {
    let mut f = Fields::new(body, "")?;
    f.raw("queueRequest");
    let requests = f.raw("requests").ok_or_else(|| {
        ApiError::invalid(
            ErrorCode::MissingField,
            "requests",
            "a queued request needs requests: [...]",
        )
    })?;
    let list = requests
        .as_array()
        .ok_or_else(|| ApiError::invalid(ErrorCode::InvalidType, "requests", "requests must be an array"))?;
    let options = Options {
        webhook_url: submit::webhook_url(&mut f)?,
        ..Options::default()
    };
    f.deny_unknown()?;
    let items = list
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let path = format!("requests[{i}]");
            let mut input = item.clone();
            let reference = match input.as_object_mut().and_then(|m| m.remove("external_reference")) {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => Some(s),
                Some(_) => {
                    let param = format!("{path}.external_reference");
                    return Err(ApiError::invalid(
                        ErrorCode::InvalidType,
                        param,
                        "external_reference must be a string",
                    ));
                }
            };
            Ok(Item {
                custom_id: reference,
                body: submit::Body::Json(input),
                custom_id_path: format!("{path}.external_reference"),
                path,
            })
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    Ok(Submission {
        spec,
        shape: Shape::WorkersAi,
        items,
        options,
    })
}

async fn poll(state: &AppState, account: &Authenticated, request_id: &str) -> Result<Response, CloudflareError> {
    let batch = owned_batch(state, account, request_id, "request_id").await?;
    let tally = state.store.tally(&batch.id).await?;
    if !batch.status.is_terminal() {
        let status = if tally.any_started() || batch.status == BatchStatus::Finalizing {
            "running"
        } else {
            "queued"
        };
        let result = json!({"status": status, "request_id": batch.id, "model": batch.model});
        return Ok(envelope(result).into_response());
    }
    // `{"result":{"status","request_id","responses":[…],"usage"},"success":true,…}`,
    // the responses read and sent a page at a time.
    let usage = Usage::json(tally.prompt_tokens, tally.completion_tokens);
    let head = format!(
        r#"{{"result":{{"status":{},"request_id":{},"responses":["#,
        json!(batch.status),
        json!(batch.id)
    );
    let tail = format!(r#"],"usage":{usage}}},"success":true,"errors":[],"messages":[]}}"#);
    let responses = crate::batches::finished_pieces(state, &batch.id, |body, written, r, _| {
        if written > 0 {
            body.push(b',');
        }
        serde_json::to_writer(&mut *body, &response_line(r))
    })
    .await?;
    let piece = |text: String| Ok::<_, lorry_batcher::BatcherError>(axum::body::Bytes::from(text));
    let body = stream::once(async move { piece(head) })
        .chain(responses)
        .chain(stream::once(async move { piece(tail) }));
    Ok((
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        axum::body::Body::from_stream(body),
    )
        .into_response())
}

/// One request of a polled batch that has ended.
fn response_line(r: &lorry_batcher::model::FinishedRequest) -> Value {
    let mut line = json!({"id": r.index, "success": r.status == RequestStatus::Succeeded});
    match (&r.response, &r.error) {
        (Some(response), _) => line["result"] = response.clone(),
        (None, error) => line["error"] = json!(error),
    }
    if let Some(reference) = &r.custom_id {
        line["external_reference"] = json!(reference);
    }
    line
}

async fn realtime(
    state: &AppState,
    account: &Account,
    model: &str,
    valid: ValidRequest,
) -> Result<Response, CloudflareError> {
    let call = lane::start(state, account, model, valid).await?;
    if call.stream {
        return Ok(stream_replies(call).into_response());
    }
    let output = call.output().await?;
    let usage = usage_json(&output);
    let mut result = output.result_body();
    if let Some(map) = result.as_object_mut() {
        map.insert("usage".into(), usage);
    }
    Ok(envelope(result).into_response())
}

fn usage_json(output: &Output) -> Value {
    output.usage.to_json()
}

/// Workers AI's stream: `data: {"response": "<piece>"}` events (with
/// `"logprobs"`, its tokens', where asked; a piece of a further choice of a
/// request with `n` > 1 with its `"index"`), then `data: [DONE]`.
/// A client that goes away drops the call, which cancels the request.
fn stream_replies(call: lane::Call) -> Sse<impl futures::Stream<Item = Result<Event, Infallible>>> {
    let events = stream::unfold(call, |mut call| async move {
        let events = match call.next().await? {
            Reply::Token { text, logprobs, choice } => {
                let mut piece = json!({"response": text});
                if choice > 0 {
                    piece["index"] = json!(choice);
                }
                if !logprobs.is_empty() {
                    piece["logprobs"] = json!(logprobs);
                }
                vec![Event::default().data(piece.to_string())]
            }
            Reply::Done { output } => {
                // The tools each choice called, once it has ended, then the usage.
                let mut events: Vec<Event> = output
                    .views()
                    .iter()
                    .enumerate()
                    .filter(|(_, c)| !c.tool_calls.is_empty())
                    .map(|(index, c)| {
                        let mut calls = json!({"response": "", "tool_calls": ToolCall::results_json(c.tool_calls)});
                        if index > 0 {
                            calls["index"] = json!(index);
                        }
                        Event::default().data(calls.to_string())
                    })
                    .collect();
                let usage = json!({"response": "", "usage": usage_json(&output)}).to_string();
                events.extend([Event::default().data(usage), Event::default().data("[DONE]")]);
                events
            }
            Reply::Error { code, message, param } => {
                let error = lane::engine_failure(code, message, param);
                vec![Event::default().event("error").data(error.body().to_string())]
            }
        };
        Some((stream::iter(events), call))
    })
    .flatten()
    .map(Ok);
    Sse::new(events).keep_alive(axum::response::sse::KeepAlive::new().interval(crate::lane::STREAM_KEEP_ALIVE))
}
