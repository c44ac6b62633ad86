//! OpenAI's answer objects, built from stored results: the real-time routes
//! answer with them, and a batch made from a file writes its output file
//! lines with them.

use base64::Engine as _;
use lorry_engine::catalog::Task;
use lorry_engine::tools::{calls_from_json, ToolCall};
use lorry_engine::{ChoiceView, Content, FinishReason, TokenLogprob};
use serde_json::{json, Value};

use crate::ids::BatchId;
use crate::model::{FinishedRequest, RequestStatus};

/// The OpenAI endpoints a request (or a batch file's line) may target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completions,
    /// `/v1/embeddings`.
    Embeddings,
}

impl Endpoint {
    /// Every endpoint.
    pub const ALL: [Endpoint; 3] = [Endpoint::Chat, Endpoint::Completions, Endpoint::Embeddings];

    /// The route.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
            Endpoint::Embeddings => "/v1/embeddings",
        }
    }

    /// The endpoint of a route.
    pub fn from_path(path: &str) -> Option<Endpoint> {
        Endpoint::ALL.into_iter().find(|e| e.path() == path)
    }

    /// Whether models of `task` answer on this endpoint.
    pub fn serves(self, task: Task) -> bool {
        match self {
            Endpoint::Chat | Endpoint::Completions => matches!(task, Task::TextGeneration | Task::Echo),
            Endpoint::Embeddings => task == Task::Embeddings,
        }
    }
}

/// What a finished request needs to become an OpenAI answer body.
pub struct Finished<'a> {
    /// What the model produced.
    pub content: &'a Content,
    /// `stop` or `length`, for text.
    pub finish_reason: Option<&'a str>,
    /// Tokens read.
    pub prompt_tokens: i64,
    /// Tokens written.
    pub completion_tokens: i64,
    /// Each generated token's log-probability, for requests that asked.
    pub logprobs: Option<&'a [TokenLogprob]>,
    /// The tools the first choice called.
    pub tool_calls: &'a [ToolCall],
    /// The choices after the first, for requests with `n` > 1.
    pub more: Vec<ChoiceView<'a>>,
}

impl<'a> Finished<'a> {
    /// A finished text generation: its choices and usage.
    pub fn of(output: &'a lorry_engine::Output) -> Self {
        let mut views = output.views().into_iter();
        let first = views.next().expect("the first choice");
        Finished {
            content: &output.content,
            finish_reason: Some(first.finish_reason.unwrap_or(FinishReason::Stop).as_str()),
            prompt_tokens: output.usage.prompt_tokens.into(),
            completion_tokens: output.usage.completion_tokens.into(),
            logprobs: first.logprobs,
            tool_calls: first.tool_calls,
            more: views.collect(),
        }
    }
}

/// The further choices a stored result holds (`"choices"` of its body, the
/// first left out: it is the body's own `response`), owned.
fn stored_choices(body: &Value) -> Vec<StoredChoice> {
    let Some(choices) = body.get("choices").and_then(Value::as_array) else {
        return Vec::new();
    };
    choices
        .iter()
        .skip(1)
        .map(|c| {
            let finish = match c["finish_reason"].as_str() {
                Some("length") => Some(FinishReason::Length),
                Some("tool_calls") => Some(FinishReason::ToolCalls),
                Some(_) => Some(FinishReason::Stop),
                None => None,
            };
            StoredChoice {
                text: c["response"].as_str().unwrap_or_default().to_string(),
                finish_reason: finish,
                logprobs: c.get("logprobs").and_then(|l| serde_json::from_value(l.clone()).ok()),
                tool_calls: calls_from_json(c.get("tool_calls")),
            }
        })
        .collect()
}

/// A further choice of a stored result, owned.
struct StoredChoice {
    text: String,
    finish_reason: Option<FinishReason>,
    logprobs: Option<Vec<TokenLogprob>>,
    tool_calls: Vec<ToolCall>,
}

/// A chat answer's `message`: its text, or `null` with the tools it called and wrote nothing besides.
fn chat_message(text: &str, tool_calls: &[ToolCall]) -> Value {
    if tool_calls.is_empty() {
        return json!({"role": "assistant", "content": text, "refusal": null});
    }
    let content = if text.is_empty() { Value::Null } else { json!(text) };
    json!({
        "role": "assistant",
        "content": content,
        "refusal": null,
        "tool_calls": tool_calls.iter().map(ToolCall::openai_json).collect::<Vec<_>>(),
    })
}

/// A choice's `logprobs` in `endpoint`'s shape: chat's `{"content": [...],
/// "refusal": null}`, the legacy `{"tokens", "token_logprobs", ...}`, or
/// `null` where none were asked for.
pub fn logprobs_json(endpoint: Endpoint, logprobs: Option<&[TokenLogprob]>) -> Value {
    match (endpoint, logprobs) {
        (_, None) => Value::Null,
        (Endpoint::Chat, Some(items)) => json!({"content": items, "refusal": null}),
        (_, Some(items)) => TokenLogprob::legacy(items),
    }
}

/// The OpenAI answer body of a finished request.
pub fn answer(endpoint: Endpoint, id: &str, created: i64, model: &str, done: &Finished<'_>, base64: bool) -> Value {
    let usage = lorry_engine::Usage::json(done.prompt_tokens, done.completion_tokens);
    let text = done.content.text();
    let finish_reason = done.finish_reason.unwrap_or("stop");
    let logprobs = logprobs_json(endpoint, done.logprobs);
    let further = |i: usize, c: &ChoiceView<'_>| {
        let finish_reason = c.finish_reason.unwrap_or(FinishReason::Stop).as_str();
        let logprobs = logprobs_json(endpoint, c.logprobs);
        match endpoint {
            Endpoint::Chat => json!({
                "index": i + 1,
                "message": chat_message(c.text, c.tool_calls),
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }),
            _ => json!({"index": i + 1, "text": c.text, "logprobs": logprobs, "finish_reason": finish_reason}),
        }
    };
    let more = done.more.iter().enumerate().map(|(i, c)| further(i, c));
    match endpoint {
        Endpoint::Chat => json!({
            "id": id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": std::iter::once(json!({
                "index": 0,
                "message": chat_message(text, done.tool_calls),
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            })).chain(more).collect::<Vec<_>>(),
            "usage": usage,
        }),
        Endpoint::Completions => json!({
            "id": id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": std::iter::once(json!({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}))
                .chain(more)
                .collect::<Vec<_>>(),
            "usage": usage,
        }),
        Endpoint::Embeddings => {
            let rows = match done.content {
                Content::Embeddings { vectors, .. } => vectors.as_slice(),
                Content::Text(_) => &[],
            };
            let data: Vec<Value> = rows
                .iter()
                .enumerate()
                .map(|(index, row)| {
                    let embedding = if base64 {
                        let bytes: Vec<u8> = row.iter().flat_map(|x| x.to_le_bytes()).collect();
                        Value::String(base64::engine::general_purpose::STANDARD.encode(bytes))
                    } else {
                        json!(row)
                    };
                    json!({"object": "embedding", "index": index, "embedding": embedding})
                })
                .collect();
            json!({
                "object": "list",
                "data": data,
                "model": model,
                "usage": {"prompt_tokens": done.prompt_tokens, "total_tokens": done.prompt_tokens},
            })
        }
    }
}

/// One line of a batch's output or error file, in OpenAI's format:
/// `{"id","custom_id","response":{"status_code","request_id","body"},"error"}`.
pub fn output_line(batch: &BatchId, endpoint: Endpoint, model: &str, created: i64, request: &FinishedRequest) -> Value {
    let request_id = format!("{batch}-{}", request.index);
    let id = format!(
        "batch_req_{}_{}",
        batch.as_str().trim_start_matches("batch_"),
        request.index
    );
    match (&request.response, request.status) {
        (Some(body), RequestStatus::Succeeded) => {
            let content = Content::from_result_body(body);
            let logprobs: Option<Vec<TokenLogprob>> = body
                .get("logprobs")
                .and_then(|l| serde_json::from_value(l.clone()).ok());
            let stored = stored_choices(body);
            let tool_calls = calls_from_json(body.get("tool_calls"));
            let done = Finished {
                content: &content,
                finish_reason: request.finish_reason.as_deref(),
                prompt_tokens: request.prompt_tokens.into(),
                completion_tokens: request.completion_tokens.into(),
                logprobs: logprobs.as_deref(),
                tool_calls: &tool_calls,
                more: stored
                    .iter()
                    .map(|c| ChoiceView {
                        text: &c.text,
                        finish_reason: c.finish_reason,
                        logprobs: c.logprobs.as_deref(),
                        tool_calls: &c.tool_calls,
                    })
                    .collect(),
            };
            let prefix = match endpoint {
                Endpoint::Chat => "chatcmpl",
                Endpoint::Completions => "cmpl",
                Endpoint::Embeddings => "emb",
            };
            let body = answer(
                endpoint,
                &format!("{prefix}-{request_id}"),
                created,
                model,
                &done,
                false,
            );
            json!({
                "id": id,
                "custom_id": request.custom_id,
                "response": {"status_code": 200, "request_id": request_id, "body": body},
                "error": null,
            })
        }
        _ => {
            let error = request.error.as_ref();
            json!({
                "id": id,
                "custom_id": request.custom_id,
                "response": null,
                "error": {
                    "code": error.map(|e| e.code.as_str()).unwrap_or("request_failed"),
                    "message": error.map(|e| e.message.as_str()).unwrap_or("the request failed"),
                },
            })
        }
    }
}
