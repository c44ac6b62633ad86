//! The OpenAI-compatible surface: `/v1/models`, `/v1/chat/completions`,
//! `/v1/completions` and `/v1/embeddings` on the real-time lane. Each request
//! is translated into the engine's input (the shape the batch lane and Workers
//! AI use), and each output back into OpenAI's objects; the batch files of
//! `/v1/batches` go through the same translation.

use std::convert::Infallible;

use axum::extract::{Path, State};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::{self, StreamExt};
use lorry_batcher::openai::{answer, logprobs_json, Endpoint, Finished};
use lorry_batcher::realtime::Reply;
use lorry_protocol::input::Fields;
use lorry_protocol::ErrorCode;
use lorry_protocol::Task;
use lorry_protocol::{Catalog, InputError, TokenLogprob, ValidRequest};
use serde_json::{json, Map, Value};

use crate::extract::{Authenticated, JsonBody};
use crate::{lane, submit, ApiError, AppState};

/// An OpenAI request turned into the engine's input.
#[derive(Debug, Clone, PartialEq)]
pub struct Translated {
    /// The served model.
    pub model: String,
    /// The model as the client named it (`base` or `base:adapter`), echoed in answers.
    pub requested: String,
    /// The request, validated for the model (`stream` set by the caller that streams).
    pub valid: ValidRequest,
    /// Answer with server-sent events.
    pub stream: bool,
    /// Send a last chunk with the usage.
    pub include_usage: bool,
}

/// Read an OpenAI request body for `endpoint`: every field checked, unknown
/// fields refused, each error naming the field as the client spelled it.
pub fn translate(catalog: &Catalog, endpoint: Endpoint, body: &Value) -> Result<Translated, ApiError> {
    let mut f = Fields::new(body, "")?;
    let requested: String = f.required("model", "a string")?;
    let (base, adapter) = submit::split_model(catalog, &requested);
    let spec = submit::model(catalog, base, "model")?;
    check_endpoint(spec, endpoint, adapter.is_some())?;
    let mut draft = Draft::default();
    match endpoint {
        Endpoint::Embeddings => embeddings_input(&mut f, &mut draft)?,
        Endpoint::Chat | Endpoint::Completions => {
            if endpoint == Endpoint::Chat {
                let messages = f
                    .raw("messages")
                    .ok_or_else(|| ApiError::invalid(ErrorCode::MissingField, "messages", "messages is required"))?;
                draft.input.insert("messages".into(), chat_messages(messages)?);
            } else {
                completion_prompt(&mut f, &mut draft)?;
            }
            generation_input(&mut f, endpoint, &mut draft)?;
            if let Some(name) = adapter {
                draft.input.insert("adapter".into(), Value::String(name.to_string()));
                draft.renamed.push(("adapter", "model"));
            }
        }
    }
    f.deny_unknown()?;
    let input = Value::Object(draft.input);
    let valid = spec.validate(&input).map_err(|e| rename(e, &draft.renamed))?;
    Ok(Translated {
        model: spec.name.clone(),
        requested,
        valid,
        stream: draft.stream,
        include_usage: draft.include_usage,
    })
}

/// The engine's input as it is being built from an OpenAI body.
#[derive(Default)]
struct Draft {
    input: Map<String, Value>,
    /// Engine field → the client's spelling, for errors the engine reports.
    renamed: Vec<(&'static str, &'static str)>,
    stream: bool,
    include_usage: bool,
}

/// Refuse a model the endpoint does not serve, or an adapter for a model that takes none.
fn check_endpoint(spec: &lorry_protocol::ModelSpec, endpoint: Endpoint, adapter: bool) -> Result<(), ApiError> {
    let base = &spec.name;
    if !endpoint.serves(spec.task) {
        let message = match spec.task {
            Task::Embeddings => format!("model {base} makes embeddings; use /v1/embeddings"),
            _ => format!("model {base} generates text; use /v1/chat/completions or /v1/completions"),
        };
        return Err(ApiError::invalid(ErrorCode::ModelTaskMismatch, "model", message));
    }
    if adapter {
        spec.adapter_shape("model")?;
    }
    Ok(())
}

/// `/v1/embeddings`: `input` (a string or strings), `encoding_format`, `user`.
fn embeddings_input(f: &mut Fields<'_>, draft: &mut Draft) -> Result<(), ApiError> {
    let texts = match f.raw("input") {
        None => return Err(ApiError::invalid(ErrorCode::MissingField, "input", "input is required")),
        Some(Value::String(s)) => json!([s]),
        Some(Value::Array(items)) if items.iter().all(Value::is_string) => Value::Array(items.clone()),
        Some(_) => {
            return Err(ApiError::invalid(
                ErrorCode::InvalidType,
                "input",
                "input must be a string or an array of strings (token arrays are not taken)",
            ))
        }
    };
    draft.input.insert("text".into(), texts);
    draft.renamed.push(("text", "input"));
    match f
        .optional::<String>("encoding_format", "\"float\" or \"base64\"")?
        .as_deref()
    {
        None | Some("float") | Some("base64") => {}
        Some(_) => {
            return Err(ApiError::invalid(
                ErrorCode::InvalidValue,
                "encoding_format",
                "encoding_format must be \"float\" or \"base64\"",
            ))
        }
    }
    if f.raw("dimensions").is_some() {
        return Err(ApiError::invalid(
            ErrorCode::UnsupportedParameter,
            "dimensions",
            "dimensions is not supported: embeddings have the model's own width",
        ));
    }
    f.optional::<String>("user", "a string")?;
    Ok(())
}

/// `/v1/completions`' `prompt` (one string), taken raw; `echo`, `suffix` and
/// `best_of` other than their defaults refused.
fn completion_prompt(f: &mut Fields<'_>, draft: &mut Draft) -> Result<(), ApiError> {
    let prompt = match f.raw("prompt") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(items)) if items.len() == 1 && items[0].is_string() => {
            items[0].as_str().unwrap_or_default().to_string()
        }
        Some(_) => {
            return Err(ApiError::invalid(
                ErrorCode::InvalidType,
                "prompt",
                "prompt must be a string (or an array of exactly one string)",
            ))
        }
        None => {
            return Err(ApiError::invalid(
                ErrorCode::MissingField,
                "prompt",
                "prompt is required",
            ))
        }
    };
    draft.input.insert("prompt".into(), Value::String(prompt));
    draft.input.insert("raw".into(), Value::Bool(true));
    match f.optional::<bool>("echo", "a boolean")? {
        None | Some(false) => {}
        Some(true) => return Err(unsupported("echo", "echo is not supported")),
    }
    if f.raw("suffix").is_some() {
        return Err(unsupported("suffix", "suffix is not supported"));
    }
    match f.optional::<u32>("best_of", "a positive integer")? {
        None | Some(1) => {}
        Some(_) => return Err(unsupported("best_of", "best_of must be 1")),
    }
    Ok(())
}

/// The sampling and streaming fields both generation endpoints share.
fn generation_input(f: &mut Fields<'_>, endpoint: Endpoint, draft: &mut Draft) -> Result<(), ApiError> {
    let max_tokens: Option<Value> = f.raw("max_tokens").cloned();
    let max_completion: Option<Value> = if endpoint == Endpoint::Chat {
        f.raw("max_completion_tokens").cloned()
    } else {
        None
    };
    match (max_tokens, max_completion) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                ErrorCode::ConflictingFields,
                "max_completion_tokens",
                "give max_tokens or max_completion_tokens, not both",
            ))
        }
        (Some(n), None) => {
            draft.input.insert("max_tokens".into(), n);
        }
        (None, Some(n)) => {
            draft.input.insert("max_tokens".into(), n);
            draft.renamed.push(("max_tokens", "max_completion_tokens"));
        }
        (None, None) => {}
    }
    for name in [
        "temperature",
        "top_p",
        "seed",
        "stop",
        "frequency_penalty",
        "presence_penalty",
        // Extensions other OpenAI-compatible servers take too.
        "top_k",
        "ignore_eos",
        "stop_token_ids",
    ]
    .into_iter()
    .chain(lorry_protocol::constraint::FIELDS)
    {
        if let Some(value) = f.raw(name) {
            draft.input.insert(name.into(), value.clone());
        }
    }
    if let Some(n) = f.raw("n") {
        draft.input.insert("n".into(), n.clone());
    }
    for name in ["tools", "tool_choice", "parallel_tool_calls"] {
        match f.raw(name) {
            None => {}
            Some(value) if endpoint == Endpoint::Chat => {
                draft.input.insert(name.into(), value.clone());
            }
            Some(_) => return Err(unsupported(name, "tools are offered on chat completions")),
        }
    }
    for name in ["functions", "function_call"] {
        if f.raw(name).is_some() {
            return Err(unsupported(
                name,
                "the deprecated functions fields are not served; give tools and tool_choice",
            ));
        }
    }
    if endpoint == Endpoint::Chat {
        // `logprobs` (a boolean) and `top_logprobs` as the engine takes them.
        for name in ["logprobs", "top_logprobs"] {
            if let Some(value) = f.raw(name) {
                draft.input.insert(name.into(), value.clone());
            }
        }
    } else {
        // The legacy endpoint's `logprobs`: how many alternatives, 0 to 5.
        match f.optional::<u32>("logprobs", "an integer from 0 to 5")? {
            None => {}
            Some(n) if n <= MAX_LEGACY_LOGPROBS => {
                draft.input.insert("logprobs".into(), Value::Bool(true));
                draft.input.insert("top_logprobs".into(), json!(n));
            }
            Some(_) => {
                return Err(ApiError::invalid(
                    ErrorCode::InvalidValue,
                    "logprobs",
                    format!("logprobs must be from 0 to {MAX_LEGACY_LOGPROBS}"),
                ))
            }
        }
    }
    draft.stream = f.optional("stream", "a boolean")?.unwrap_or(false);
    if let Some(options) = f.raw("stream_options") {
        let mut o = Fields::new(options, "stream_options")?;
        draft.include_usage = o.optional("include_usage", "a boolean")?.unwrap_or(false);
        o.deny_unknown()?;
        if !draft.stream {
            return Err(ApiError::invalid(
                ErrorCode::InvalidValue,
                "stream_options",
                "stream_options is only allowed with stream: true",
            ));
        }
    }
    f.optional::<String>("user", "a string")?;
    Ok(())
}

/// The most alternatives `/v1/completions` reports at a position, as OpenAI's.
const MAX_LEGACY_LOGPROBS: u32 = 5;

fn unsupported(param: &str, message: &str) -> ApiError {
    ApiError::invalid(ErrorCode::UnsupportedParameter, param, message)
}

/// An engine error about one of its fields, named as the client spelled it.
pub fn rename(mut error: InputError, renamed: &[(&str, &str)]) -> InputError {
    error.param = renamed_param(&error.param, renamed);
    error
}

/// A field path in the engine's spelling (`text[2]`) in the client's (`input[2]`).
fn renamed_param(param: &str, renamed: &[(&str, &str)]) -> String {
    for (engine, client) in renamed {
        if param == *engine {
            return client.to_string();
        }
        if let Some(rest) = param.strip_prefix(engine).filter(|r| r.starts_with('[')) {
            return format!("{client}{rest}");
        }
    }
    param.to_string()
}

/// OpenAI messages → the engine's `{role, content}` list: content as a string
/// or as text parts; `developer` is a system message.
fn chat_messages(value: &Value) -> Result<Value, ApiError> {
    let items = value
        .as_array()
        .ok_or_else(|| ApiError::invalid(ErrorCode::InvalidType, "messages", "messages must be an array"))?;
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let path = format!("messages[{i}]");
        let mut f = Fields::new(item, &path)?;
        let role: String = f.required("role", "a string")?;
        let role = if role == "developer" {
            "system".to_string()
        } else {
            role
        };
        let content = match f.raw("content") {
            None => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for (j, part) in parts.iter().enumerate() {
                    let mut p = Fields::new(part, &format!("{path}.content[{j}]"))?;
                    let kind: String = p.required("type", "a string")?;
                    if kind != "text" {
                        return Err(ApiError::invalid(
                            ErrorCode::UnsupportedParameter,
                            format!("{path}.content[{j}].type"),
                            "only text content parts are supported",
                        ));
                    }
                    let piece: String = p.required("text", "a string")?;
                    p.deny_unknown()?;
                    text.push_str(&piece);
                }
                text
            }
            Some(_) => {
                return Err(ApiError::invalid(
                    ErrorCode::InvalidType,
                    format!("{path}.content"),
                    format!("{path}.content must be a string or an array of text parts"),
                ))
            }
        };
        f.optional::<String>("name", "a string")?;
        let mut message = json!({"role": role, "content": content});
        // A call's answer, and the calls an earlier answer made, as the engine reads them.
        for name in ["tool_calls", "tool_call_id"] {
            if let Some(value) = f.raw(name) {
                message[name] = value.clone();
            }
        }
        f.deny_unknown()?;
        out.push(message);
    }
    Ok(Value::Array(out))
}

fn now() -> i64 {
    chrono::Utc::now().timestamp()
}

fn model_json(spec: &lorry_protocol::ModelSpec) -> Value {
    let task = match spec.task {
        Task::Embeddings => "embeddings",
        Task::TextGeneration | Task::Echo => "text-generation",
    };
    json!({
        "id": spec.name,
        "object": "model",
        "created": 0,
        "owned_by": "lorry",
        "task": task,
        "adapters": spec.takes_adapters(),
    })
}

/// `GET /v1/models`.
#[utoipa::path(get, path = "/v1/models", tag = crate::openapi::OPENAI,
    responses((status = 200, description = "Every served model", body = crate::openapi::ModelList)))]
pub async fn models(
    State(state): State<AppState>,
    Authenticated(account): Authenticated,
) -> Result<Json<Value>, ApiError> {
    let mut data: Vec<Value> = state.catalog.iter().map(model_json).collect();
    data.sort_by(|a, b| a["id"].as_str().cmp(&b["id"].as_str()));
    // Then the account's own adapters, ready to use, as OpenAI lists
    // fine-tuned models: `base:adapter`, newest first.
    let (adapters, _) = state
        .store
        .list_adapters(&account.id, MAX_LISTED_ADAPTERS, None)
        .await?;
    data.extend(
        adapters
            .iter()
            .filter(|a| a.ready && state.catalog.get(&a.model).is_some())
            .map(adapter_model_json),
    );
    Ok(Json(json!({"object": "list", "data": data})))
}

/// The most adapters `GET /v1/models` lists (the default adapter quota);
/// `GET /v1/adapters` pages through any number.
const MAX_LISTED_ADAPTERS: i64 = 1000;

/// An account's adapter as a model of OpenAI's list: `base:adapter`, owned by the account.
fn adapter_model_json(adapter: &lorry_batcher::store::AdapterRecord) -> Value {
    json!({
        "id": format!("{}:{}", adapter.model, adapter.name),
        "object": "model",
        "created": adapter.created_at.timestamp(),
        "owned_by": adapter.account_id.to_string(),
        "task": "text-generation",
        "adapters": false,
        "parent": adapter.model,
        "adapter": adapter.id.as_str(),
    })
}

/// `GET /v1/models/{model}` (the name may hold slashes).
#[utoipa::path(get, path = "/v1/models/{model}", tag = crate::openapi::OPENAI,
    params(("model" = String, Path, description = "A served model's name (it may hold slashes)")),
    responses((status = 200, description = "The model", body = crate::openapi::Model)))]
pub async fn model(
    State(state): State<AppState>,
    Authenticated(account): Authenticated,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    if let (base, Some(adapter)) = submit::split_model(&state.catalog, &name) {
        let found = state.store.find_adapter(&account.id, adapter).await?;
        return match found {
            Some(record) if record.ready && record.model == base => Ok(Json(adapter_model_json(&record))),
            _ => Err(
                ApiError::new(ErrorCode::ModelNotFound, format!("model {name} is not served here")).with_param("model"),
            ),
        };
    }
    Ok(Json(model_json(submit::model(&state.catalog, &name, "model")?)))
}

/// `POST /v1/chat/completions`.
#[utoipa::path(post, path = "/v1/chat/completions", tag = crate::openapi::OPENAI,
    request_body = crate::openapi::ChatRequest,
    responses((status = 200, description = "The completion, or with `stream` its chunks as server-sent events",
        content((crate::openapi::Completion = "application/json"), (crate::openapi::ServerSentEvent = "text/event-stream")))))]
pub async fn chat(state: State<AppState>, account: Authenticated, body: JsonBody) -> Result<Response, ApiError> {
    generate(state, account, body, Endpoint::Chat).await
}

/// `POST /v1/completions`.
#[utoipa::path(post, path = "/v1/completions", tag = crate::openapi::OPENAI,
    request_body = crate::openapi::CompletionRequest,
    responses((status = 200, description = "The completion, or with `stream` its chunks as server-sent events",
        content((crate::openapi::Completion = "application/json"), (crate::openapi::ServerSentEvent = "text/event-stream")))))]
pub async fn completions(state: State<AppState>, account: Authenticated, body: JsonBody) -> Result<Response, ApiError> {
    generate(state, account, body, Endpoint::Completions).await
}

/// `POST /v1/embeddings`.
#[utoipa::path(post, path = "/v1/embeddings", tag = crate::openapi::OPENAI,
    request_body = crate::openapi::EmbeddingsRequest,
    responses((status = 200, description = "One vector a text", body = crate::openapi::EmbeddingList)))]
pub async fn embeddings(
    State(state): State<AppState>,
    account: Authenticated,
    body: JsonBody,
) -> Result<Response, ApiError> {
    let request = translate(&state.catalog, Endpoint::Embeddings, &body.value)?;
    let base64 = body.value["encoding_format"] == "base64";
    let call = lane::start(&state, &account.0, &request.model, request.valid.clone()).await?;
    // What the engine finds of a text (one it makes no tokens of) names it as the client did.
    let output = call.output().await.map_err(|mut e| {
        e.param = e.param.map(|p| renamed_param(&p, &[("text", "input")]));
        e
    })?;
    let done = Finished {
        content: &output.content,
        finish_reason: None,
        prompt_tokens: output.usage.prompt_tokens as i64,
        completion_tokens: 0,
        logprobs: None,
        tool_calls: &[],
        more: Vec::new(),
    };
    Ok(Json(answer(
        Endpoint::Embeddings,
        "",
        now(),
        &request.requested,
        &done,
        base64,
    ))
    .into_response())
}

async fn generate(
    State(state): State<AppState>,
    account: Authenticated,
    body: JsonBody,
    endpoint: Endpoint,
) -> Result<Response, ApiError> {
    let mut request = translate(&state.catalog, endpoint, &body.value)?;
    request.valid.stream = request.stream;
    let prefix = if endpoint == Endpoint::Chat { "chatcmpl" } else { "cmpl" };
    let id = format!("{prefix}-{}", uuid::Uuid::new_v4().simple());
    let call = lane::start(&state, &account.0, &request.model, request.valid.clone())
        .await
        .map_err(|mut e| {
            // The adapter came from `model: "base:adapter"`.
            if e.param.as_deref() == Some("adapter") {
                e.param = Some("model".into());
            }
            e
        })?;
    if request.stream {
        return Ok(stream_chunks(call, endpoint, id, request).into_response());
    }
    let output = call.output().await?;
    let done = Finished::of(&output);
    Ok(Json(answer(endpoint, &id, now(), &request.requested, &done, false)).into_response())
}

/// One streamed chunk of choice `index`: a delta of text (with its tokens'
/// log-probabilities where asked), or the end with its finish reason.
#[allow(clippy::too_many_arguments)]
fn chunk(
    endpoint: Endpoint,
    id: &str,
    created: i64,
    request: &Translated,
    index: u32,
    text: Option<&str>,
    logprobs: Option<&[TokenLogprob]>,
    finish: Option<&str>,
) -> Value {
    let logprobs = logprobs_json(endpoint, logprobs);
    let choice = match endpoint {
        Endpoint::Chat => {
            let delta = match text {
                Some(t) => json!({"content": t}),
                None => json!({}),
            };
            json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
        }
        _ => json!({"index": index, "text": text.unwrap_or_default(), "logprobs": logprobs, "finish_reason": finish}),
    };
    let object = if endpoint == Endpoint::Chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let mut value = json!({
        "id": id,
        "object": object,
        "created": created,
        "model": request.requested,
        "choices": [choice],
    });
    if request.include_usage {
        value["usage"] = Value::Null;
    }
    value
}

/// OpenAI's stream: a first chunk with the assistant's role (chat; one for
/// each choice), one chunk per piece of text (its choice's `index`), a last
/// chunk with the finish reason for each choice, the usage chunk when asked,
/// then `data: [DONE]`. An error mid-stream is an `error` object.
/// A client that goes away drops the call, which cancels the request.
fn stream_chunks(
    call: lane::Call,
    endpoint: Endpoint,
    id: String,
    request: Translated,
) -> Sse<impl futures::Stream<Item = Result<Event, Infallible>>> {
    let created = now();
    let data = |v: Value| Event::default().data(v.to_string());
    let mut first = Vec::new();
    if endpoint == Endpoint::Chat {
        for index in 0..call.choices {
            let mut opening = chunk(endpoint, &id, created, &request, index, Some(""), None, None);
            opening["choices"][0]["delta"] = json!({"role": "assistant", "content": ""});
            first.push(data(opening));
        }
    }
    let rest = stream::unfold((call, id, request), move |(mut call, id, request)| async move {
        let events = match call.next().await? {
            Reply::Token { text, logprobs, choice } => {
                let logprobs = request.valid.sampling.logprobs.map(|_| logprobs.as_slice());
                vec![data(chunk(
                    endpoint,
                    &id,
                    created,
                    &request,
                    choice,
                    Some(&text),
                    logprobs,
                    None,
                ))]
            }
            Reply::Done { output } => {
                let views = output.views();
                // The tools a choice called, in one delta each, once it has ended.
                let mut events: Vec<Event> = views
                    .iter()
                    .enumerate()
                    .filter(|(_, choice)| endpoint == Endpoint::Chat && !choice.tool_calls.is_empty())
                    .map(|(index, choice)| {
                        let mut delta = chunk(endpoint, &id, created, &request, index as u32, None, None, None);
                        let calls: Vec<Value> = choice
                            .tool_calls
                            .iter()
                            .enumerate()
                            .map(|(k, call)| {
                                let mut call = call.openai_json();
                                call["index"] = json!(k);
                                call
                            })
                            .collect();
                        delta["choices"][0]["delta"] = json!({"tool_calls": calls});
                        data(delta)
                    })
                    .collect();
                events.extend(views.iter().enumerate().map(|(index, choice)| {
                    let finish = choice.finish_reason.unwrap_or(lorry_protocol::FinishReason::Stop);
                    data(chunk(
                        endpoint,
                        &id,
                        created,
                        &request,
                        index as u32,
                        None,
                        None,
                        Some(finish.as_str()),
                    ))
                }));
                if request.include_usage {
                    let mut last = chunk(endpoint, &id, created, &request, 0, None, None, None);
                    last["choices"] = json!([]);
                    last["usage"] = output.usage.to_json();
                    events.push(data(last));
                }
                events.push(Event::default().data("[DONE]"));
                events
            }
            Reply::Error { code, message, param } => {
                let error = lane::engine_failure(code, message, param);
                vec![data(error.body()), Event::default().data("[DONE]")]
            }
        };
        Some((stream::iter(events), (call, id, request)))
    })
    .flatten();
    Sse::new(stream::iter(first).chain(rest).map(Ok))
        .keep_alive(axum::response::sse::KeepAlive::new().interval(lane::STREAM_KEEP_ALIVE))
}
