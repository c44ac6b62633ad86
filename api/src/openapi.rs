//! The OpenAPI document, served at `GET /openapi.json`.
//!
//! Every route is registered with its `#[utoipa::path]` description (through
//! `utoipa_axum::routes!`, so a route cannot be served without being
//! described); the shapes below are what the handlers read and write, and
//! the error responses every operation can give are added from the one table
//! of codes ([`crate::error::status`]), so that a new code shows up here
//! without anyone remembering to document it.
//!
//! Request bodies are parsed by hand (`lorry_protocol::input`), field by field
//! with a code for each fault; these types only describe them. Their
//! agreement with what the server does is checked by running `schemathesis`
//! against a live stack (`tests/e2e/openapi.rs`).
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};

use lorry_protocol::ErrorCode;
use serde::Deserialize;
use serde_json::Value;
use utoipa::openapi::path::Operation;
use utoipa::openapi::schema::{ObjectBuilder, Schema, Type};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{ContentBuilder, OpenApi, RefOr, ResponseBuilder};
use utoipa::{PartialSchema, ToSchema};

/// Tags, one per part of `docs/API.md`.
pub const NATIVE: &str = "native batches";
/// The Workers AI shape.
pub const WORKERS_AI: &str = "workers ai";
/// OpenAI's routes.
pub const OPENAI: &str = "openai";
/// LoRA adapters, both shapes.
pub const ADAPTERS: &str = "adapters";
/// Account and health.
pub const SERVICE: &str = "service";
/// The operator's routes (`LORRY_ADMIN_TOKEN`).
pub const ADMIN: &str = "admin";

// ---------------------------------------------------------------- errors

/// A stable error code (`docs/API.md`, "Errors").
pub struct Code;

impl PartialSchema for Code {
    fn schema() -> RefOr<Schema> {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .enum_values(Some(ErrorCode::ALL.iter().map(|c| c.as_str())))
            .description(Some("A stable, machine-readable error code."))
            .into()
    }
}

impl ToSchema for Code {
    fn name() -> std::borrow::Cow<'static, str> {
        "ErrorCode".into()
    }
}

/// What went wrong.
#[derive(ToSchema, Deserialize)]
pub struct ErrorObject {
    /// The error's class (`invalid_request_error`, `not_found_error`, …).
    #[schema(rename = "type")]
    kind: String,
    #[schema(value_type = Code)]
    code: String,
    /// For people; the code is what programs read.
    message: String,
    /// The field at fault as a path into the body (`requests[3].body.messages[0].role`),
    /// a header or `path`/`query`; null when the whole request is at fault.
    param: Option<String>,
}

/// `{"error": {…}}`: every error of the native and OpenAI routes.
#[derive(ToSchema, Deserialize)]
pub struct ErrorBody {
    error: ErrorObject,
}

/// One entry of Cloudflare's `errors` list.
#[derive(ToSchema, Deserialize)]
pub struct CloudflareMessage {
    /// The HTTP status times ten.
    code: u32,
    message: String,
}

/// Cloudflare's envelope around an error (the Workers AI routes).
#[derive(ToSchema, Deserialize)]
pub struct CloudflareError {
    /// Always false.
    success: bool,
    errors: Vec<CloudflareMessage>,
    messages: Vec<String>,
    /// Always null.
    #[schema(value_type = Option<Object>)]
    result: Option<Value>,
    error: ErrorObject,
}

// ---------------------------------------------------------------- model inputs

/// A chat message.
#[derive(ToSchema, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant` or `tool`.
    #[schema(pattern = "^(system|user|assistant|tool)$")]
    role: String,
    /// The text (an assistant message with `tool_calls` may leave it out).
    content: Option<String>,
    /// The calls an assistant message made.
    tool_calls: Option<Vec<ToolCall>>,
    /// The call a `tool` message answers.
    tool_call_id: Option<String>,
}

/// A function the model may call: OpenAI's `{"type": "function", "function": {…}}` or Workers AI's bare `{…}`.
#[derive(ToSchema, Deserialize)]
pub struct Tool {
    /// `function`.
    #[serde(rename = "type")]
    kind: Option<String>,
    function: Option<Function>,
    /// Workers AI's shape: the function's name here.
    name: Option<String>,
    description: Option<String>,
    #[schema(value_type = Option<Object>)]
    parameters: Option<Value>,
}

/// A function's name, description and the JSON schema of its arguments.
#[derive(ToSchema, Deserialize)]
pub struct Function {
    /// 1–64 letters, digits, `_` or `-`.
    #[schema(pattern = "^[A-Za-z0-9_-]{1,64}$")]
    name: String,
    description: Option<String>,
    /// A JSON schema (an object schema; default: no arguments).
    #[schema(value_type = Option<Object>)]
    parameters: Option<Value>,
}

/// A call of a conversation's assistant message.
#[derive(ToSchema, Deserialize)]
pub struct ToolCall {
    id: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
    function: CalledFunction,
}

/// The function a call named and its arguments (a JSON object's text, or the object).
#[derive(ToSchema, Deserialize)]
pub struct CalledFunction {
    name: String,
    #[schema(value_type = Object)]
    arguments: Value,
}

/// `auto`, `none`, `required`, or `{"type": "function", "function": {"name"}}`.
#[derive(ToSchema, Deserialize)]
#[serde(untagged)]
pub enum ToolChoice {
    Mode(String),
    Named(NamedTool),
}

/// `{"type": "function", "function": {"name"}}`: the function that must be called.
#[derive(ToSchema, Deserialize)]
pub struct NamedTool {
    /// `function`.
    #[serde(rename = "type")]
    kind: String,
    function: NamedFunction,
}

/// The name of one of `tools`.
#[derive(ToSchema, Deserialize)]
pub struct NamedFunction {
    name: String,
}

/// One string or up to four.
#[derive(ToSchema, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// One string, 1–256 bytes.
    One(String),
    /// Up to four strings of 1–256 bytes.
    Many(Vec<String>),
}

/// `"text"`: one string or a list of 1–100.
#[derive(ToSchema, Deserialize)]
#[serde(untagged)]
pub enum Texts {
    /// One text.
    One(String),
    /// 1 to 100 texts.
    Many(Vec<String>),
}

/// A model input: text generation (`prompt` or `messages`, with sampling),
/// embeddings (`text`, `pooling`); `@lorry/echo` takes `text` as its prompt.
/// Which fields a model takes depends on its task; a field it does not take
/// is `400 unknown_field`.
#[derive(ToSchema, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelInput {
    /// A prompt.
    prompt: Option<String>,
    /// A chat, rendered with the model's chat template.
    #[schema(min_items = 1)]
    messages: Option<Vec<Message>>,
    /// Embedding models: the texts; `@lorry/echo`: the prompt.
    text: Option<Texts>,
    /// Embedding models: `cls` or `mean` (the checkpoint's own when absent).
    #[schema(pattern = "^(cls|mean)$")]
    pooling: Option<String>,
    /// Use the prompt as it is, without the chat template.
    raw: Option<bool>,
    /// Server-sent events (the real-time lane only; refused inside a batch).
    stream: Option<bool>,
    /// The adapter, by id or name (Workers AI's name for it).
    lora: Option<String>,
    /// The adapter, by id or name (the native name for it).
    adapter: Option<String>,
    /// 1–32,768 (default 256, cut to the model's context).
    #[schema(minimum = 1, maximum = 32768)]
    max_tokens: Option<u32>,
    /// 0–5; 0, the default, is greedy.
    #[schema(minimum = 0, maximum = 5)]
    temperature: Option<f64>,
    /// (0, 1].
    #[schema(exclusive_minimum = 0, maximum = 1)]
    top_p: Option<f64>,
    top_k: Option<u32>,
    seed: Option<u64>,
    stop: Option<Stop>,
    /// Up to 32 token ids that also end generation.
    stop_token_ids: Option<Vec<u32>>,
    ignore_eos: Option<bool>,
    /// 0–2.
    #[schema(minimum = 0, maximum = 2)]
    repetition_penalty: Option<f64>,
    /// −2–2.
    #[schema(minimum = -2, maximum = 2)]
    frequency_penalty: Option<f64>,
    /// −2–2.
    #[schema(minimum = -2, maximum = 2)]
    presence_penalty: Option<f64>,
    /// Structured outputs: `{"type": "text" | "json_object" | "json_schema"}`;
    /// `json_schema` is OpenAI's `{"name", "schema", "strict"?, "description"?}`
    /// or, as Workers AI sends it, the schema itself. At most one of this and
    /// the `guided_*` and `structured_outputs` fields.
    #[schema(value_type = Option<Object>)]
    response_format: Option<Value>,
    /// vLLM's structured outputs: one of `json` (a schema), `regex`, `choice`, `grammar` (Lark).
    #[schema(value_type = Option<Object>)]
    structured_outputs: Option<Value>,
    /// A JSON schema the output follows (or a string holding one).
    #[schema(value_type = Option<Object>)]
    guided_json: Option<Value>,
    /// A regular expression the whole output matches.
    guided_regex: Option<String>,
    /// The output is exactly one of these strings (1–1,024).
    #[schema(min_items = 1, max_items = 1024)]
    guided_choice: Option<Vec<String>>,
    /// A Lark grammar (llguidance's dialect) the output follows.
    guided_grammar: Option<String>,
    /// Each generated token's log-probability (`"logprobs"` in the result,
    /// OpenAI's chat items), under the model's own distribution.
    logprobs: Option<bool>,
    /// With `logprobs`: the most likely alternatives at each position, 0–20.
    #[schema(minimum = 0, maximum = 20)]
    top_logprobs: Option<u32>,
    /// Choices of the one prompt, 1–16 (text models; every choice in the result's `"choices"`).
    #[schema(minimum = 1, maximum = 16)]
    n: Option<u32>,
    /// Functions the model may call, 1–128 (the result's `"tool_calls"`).
    tools: Option<Vec<Tool>>,
    /// Whether and which tool must be called (default `auto`).
    tool_choice: Option<ToolChoice>,
    /// Several calls an answer (default true).
    parallel_tool_calls: Option<bool>,
    /// In a queued Workers AI batch: the client's id for the request, unique in the batch.
    external_reference: Option<String>,
}

/// Token counts.
#[derive(ToSchema, Deserialize)]
pub struct Usage {
    prompt_tokens: u64,
    completion_tokens: u64,
    total_tokens: u64,
}

// ---------------------------------------------------------------- native batches

/// Where the completion webhook goes.
#[derive(ToSchema, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Webhook {
    /// An absolute `http(s)` URL of a public address.
    url: String,
}

/// One request of a native batch.
#[derive(ToSchema, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchItem {
    /// The client's id for it, unique in the batch (1–512 characters).
    custom_id: Option<String>,
    body: ModelInput,
}

/// A native batch.
#[derive(ToSchema, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NativeBatch {
    /// A served model, or `<model>:<adapter>`.
    #[schema(example = "@lorry/echo")]
    model: String,
    /// 1 to 50,000 requests (`LORRY_MAX_BATCH_REQUESTS`).
    #[schema(min_items = 1)]
    requests: Vec<BatchItem>,
    /// `30s`, `15m`, `24h`, `7d`; 1 s to 7 d (default `24h`).
    completion_window: Option<String>,
    /// Up to 16 keys of up to 64 characters, string values of up to 512.
    metadata: Option<BTreeMap<String, String>>,
    webhook: Option<Webhook>,
    /// Among the account's own batches, higher goes out first (-10 to 10; 0).
    #[schema(minimum = -10, maximum = 10)]
    priority: Option<i16>,
    /// OpenAI's tier names for `priority`: `auto` and `default` 0, `flex` -5,
    /// `priority` 5; not together with `priority`.
    #[schema(pattern = "^(auto|default|flex|priority)$")]
    service_tier: Option<String>,
}

/// OpenAI's `expires_after`.
#[derive(ToSchema, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExpiresAfter {
    /// `created_at`.
    #[schema(pattern = "^created_at$")]
    anchor: String,
    /// 3,600 to 2,592,000.
    #[schema(minimum = 3600, maximum = 2592000)]
    seconds: u64,
}

/// A batch from an uploaded batch file (OpenAI's shape).
#[derive(ToSchema, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileBatch {
    /// A file uploaded with purpose `batch`.
    #[schema(pattern = "^file-[0-9a-fA-F]{32}$")]
    input_file_id: String,
    /// `/v1/chat/completions`, `/v1/completions` or `/v1/embeddings`: every line must target it.
    #[schema(pattern = "^/v1/(chat/completions|completions|embeddings)$")]
    endpoint: String,
    completion_window: String,
    metadata: Option<BTreeMap<String, String>>,
    webhook: Option<Webhook>,
    /// Among the account's own batches, higher goes out first (-10 to 10; 0).
    #[schema(minimum = -10, maximum = 10)]
    priority: Option<i16>,
    /// OpenAI's tier names for `priority`: `auto` and `default` 0, `flex` -5,
    /// `priority` 5; not together with `priority`.
    #[schema(pattern = "^(auto|default|flex|priority)$")]
    service_tier: Option<String>,
    /// The lifetime of its output and error files.
    output_expires_after: Option<ExpiresAfter>,
}

/// `POST /v1/batches`: the native shape or one made from a file.
#[derive(ToSchema, Deserialize)]
#[serde(untagged)]
pub enum BatchCreate {
    /// Requests inline.
    Native(NativeBatch),
    /// Requests from a batch file.
    FromFile(FileBatch),
}

/// Requests by status. `completed` and `failed` are OpenAI's; the others are Lorry's.
#[derive(ToSchema, Deserialize)]
pub struct RequestCounts {
    total: u64,
    completed: u64,
    failed: u64,
    pending: u64,
    running: u64,
    succeeded: u64,
    errored: u64,
    canceled: u64,
    expired: u64,
}

/// A batch.
#[derive(ToSchema, Deserialize)]
pub struct Batch {
    id: String,
    /// `batch`.
    object: String,
    model: String,
    /// `validating`, `in_progress`, `finalizing`, `completed`, `failed`, `expired`, `cancelling`, `cancelled`.
    status: String,
    completion_window: String,
    request_counts: RequestCounts,
    usage: Usage,
    created_at: i64,
    in_progress_at: Option<i64>,
    expires_at: i64,
    finalizing_at: Option<i64>,
    completed_at: Option<i64>,
    failed_at: Option<i64>,
    expired_at: Option<i64>,
    cancelling_at: Option<i64>,
    cancelled_at: Option<i64>,
    /// A presigned GET of `output.jsonl` once the batch has ended.
    output_url: Option<String>,
    /// A presigned GET of `errors.jsonl` once the batch has ended.
    errors_url: Option<String>,
    #[schema(value_type = Option<Object>)]
    metadata: Option<Value>,
    /// Among the account's own batches, higher goes out first.
    priority: i16,
    /// Batches from a file: the route every line targets.
    #[schema(nullable = false)]
    endpoint: Option<String>,
    /// Batches from a file.
    #[schema(nullable = false)]
    input_file_id: Option<String>,
    /// Batches from a file: every success, once ended.
    output_file_id: Option<String>,
    /// Batches from a file: every failure, once ended.
    error_file_id: Option<String>,
}

/// A page of batches, newest first.
#[derive(ToSchema, Deserialize)]
pub struct BatchList {
    object: String,
    data: Vec<Batch>,
    first_id: Option<String>,
    last_id: Option<String>,
    has_more: bool,
}

/// A request's error in a batch's results.
#[derive(ToSchema, Deserialize)]
pub struct RequestError {
    #[schema(rename = "type")]
    kind: String,
    code: String,
    message: String,
    retryable: bool,
}

/// A successful request's answer.
#[derive(ToSchema, Deserialize)]
pub struct ResultResponse {
    status_code: u16,
    #[schema(value_type = Object)]
    body: Value,
}

/// One line of `GET /v1/batches/{id}/results` (`application/jsonl`) and of `output.jsonl`.
#[derive(ToSchema, Deserialize)]
pub struct ResultLine {
    id: String,
    custom_id: Option<String>,
    index: u64,
    /// `succeeded`, `errored`, `canceled`, `expired`.
    status: String,
    response: Option<ResultResponse>,
    error: Option<RequestError>,
    usage: Usage,
}

// ---------------------------------------------------------------- Workers AI

/// Queues a batch.
#[derive(ToSchema, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(non_snake_case)]
pub struct QueueBody {
    /// The model inputs, each with an optional `external_reference`.
    requests: Vec<ModelInput>,
    /// Queue it (or `?queueRequest=true`).
    queueRequest: Option<bool>,
    webhook: Option<Webhook>,
}

/// Polls a queued batch.
#[derive(ToSchema, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PollBody {
    /// The `request_id` the batch was queued under.
    request_id: String,
}

/// `POST /client/v4/accounts/{account_id}/ai/run/{model}`: a batch to queue,
/// a batch to poll, or one request for the real-time lane.
#[derive(ToSchema, Deserialize)]
#[serde(untagged)]
pub enum RunBody {
    /// Queue a batch.
    Queue(QueueBody),
    /// Poll one.
    Poll(PollBody),
    /// One request, answered now.
    Run(Box<ModelInput>),
}

/// Cloudflare's envelope around a result.
#[derive(ToSchema, Deserialize)]
pub struct Envelope {
    /// The route's answer: an object, or a list (the finetunes listing).
    result: Value,
    /// Always true.
    success: bool,
    errors: Vec<CloudflareMessage>,
    messages: Vec<String>,
}

/// One server-sent event of a stream: `data` a JSON object (a piece, the
/// usage, an error) or `[DONE]`; `event` is `error` for a Workers AI stream's error.
#[derive(ToSchema, Deserialize)]
pub struct ServerSentEvent {
    event: Option<String>,
    data: String,
}

// ---------------------------------------------------------------- OpenAI

/// A chat message of OpenAI's shape: `content` a string or a list of text parts.
#[derive(ToSchema, Deserialize)]
pub struct ChatMessage {
    /// `system`, `developer`, `user`, `assistant`, `tool`.
    #[schema(pattern = "^(system|developer|user|assistant|tool)$")]
    role: String,
    /// `null` or absent on an assistant message that only calls tools.
    content: Option<ChatContent>,
    name: Option<String>,
    /// The calls an assistant message made.
    tool_calls: Option<Vec<ToolCall>>,
    /// The call a `tool` message answers.
    tool_call_id: Option<String>,
}

/// A chat message's content: a string, or text parts joined in order.
#[derive(ToSchema, Deserialize)]
#[serde(untagged)]
pub enum ChatContent {
    Text(String),
    Parts(Vec<TextPart>),
}

/// A part of a chat message's content: only text.
#[derive(ToSchema, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TextPart {
    /// `text`.
    #[serde(rename = "type")]
    #[schema(pattern = "^text$")]
    kind: String,
    text: String,
}

/// Sampling, stopping and streaming, as both OpenAI generation routes take them.
#[derive(ToSchema, Deserialize)]
pub struct OpenAiSampling {
    /// 1–32,768 (cut to the model's context).
    #[schema(minimum = 1, maximum = 32768)]
    max_tokens: Option<u32>,
    /// 0–5; 0 is greedy.
    #[schema(minimum = 0, maximum = 5)]
    temperature: Option<f64>,
    /// (0, 1].
    #[schema(exclusive_minimum = 0, maximum = 1)]
    top_p: Option<f64>,
    top_k: Option<u32>,
    seed: Option<u64>,
    stop: Option<Stop>,
    /// Up to 32 token ids that also end generation.
    #[schema(max_items = 32)]
    stop_token_ids: Option<Vec<u32>>,
    ignore_eos: Option<bool>,
    /// Choices of the one prompt, 1–16, each its own sample (the prompt's
    /// blocks shared); `usage` counts the prompt once and every choice's tokens.
    #[schema(minimum = 1, maximum = 16)]
    n: Option<u32>,
    /// −2–2.
    #[schema(minimum = -2, maximum = 2)]
    frequency_penalty: Option<f64>,
    /// −2–2.
    #[schema(minimum = -2, maximum = 2)]
    presence_penalty: Option<f64>,
    user: Option<String>,
    stream: Option<bool>,
    /// `{"include_usage": true}`: a last chunk with the usage.
    #[schema(value_type = Option<Object>)]
    stream_options: Option<Value>,
    /// Structured outputs: `{"type": "text" | "json_object" | "json_schema"}`;
    /// `json_schema` is OpenAI's `{"name", "schema", "strict"?, "description"?}`
    /// or, as Workers AI sends it, the schema itself. At most one of this and
    /// the `guided_*` and `structured_outputs` fields.
    #[schema(value_type = Option<Object>)]
    response_format: Option<Value>,
    /// vLLM's structured outputs: one of `json` (a schema), `regex`, `choice`, `grammar` (Lark).
    #[schema(value_type = Option<Object>)]
    structured_outputs: Option<Value>,
    /// A JSON schema the output follows (or a string holding one).
    #[schema(value_type = Option<Object>)]
    guided_json: Option<Value>,
    /// A regular expression the whole output matches.
    guided_regex: Option<String>,
    /// The output is exactly one of these strings (1–1,024).
    #[schema(min_items = 1, max_items = 1024)]
    guided_choice: Option<Vec<String>>,
    /// A Lark grammar (llguidance's dialect) the output follows.
    guided_grammar: Option<String>,
}

/// `POST /v1/chat/completions`.
#[derive(ToSchema, Deserialize)]
pub struct ChatRequest {
    /// `<model>` or `<model>:<adapter>`.
    #[schema(example = "@lorry/echo")]
    model: String,
    #[schema(min_items = 1)]
    messages: Vec<ChatMessage>,
    /// `max_tokens` by its newer name (not both).
    #[schema(minimum = 1, maximum = 32768)]
    max_completion_tokens: Option<u32>,
    /// Each generated token's log-probability under the model's own
    /// distribution (before temperature and any filter or constraint).
    logprobs: Option<bool>,
    /// With `logprobs: true`: the most likely alternatives at each position, 0–20.
    #[schema(minimum = 0, maximum = 20)]
    top_logprobs: Option<u32>,
    /// Functions the model may call, 1–128.
    tools: Option<Vec<Tool>>,
    /// Whether and which tool must be called (default `auto`).
    tool_choice: Option<ToolChoice>,
    /// Several calls an answer (default true).
    parallel_tool_calls: Option<bool>,
    #[serde(flatten)]
    sampling: OpenAiSampling,
}

/// `POST /v1/completions`.
#[derive(ToSchema, Deserialize)]
pub struct CompletionRequest {
    /// `<model>` or `<model>:<adapter>`.
    #[schema(example = "@lorry/echo")]
    model: String,
    /// Used as it is: no chat template.
    prompt: String,
    /// Each generated token's log-probability with this many alternatives, 0–5.
    #[schema(minimum = 0, maximum = 5)]
    logprobs: Option<u32>,
    #[serde(flatten)]
    sampling: OpenAiSampling,
}

/// `POST /v1/embeddings`.
#[derive(ToSchema, Deserialize)]
pub struct EmbeddingsRequest {
    #[schema(example = "@lorry/demo-bge")]
    model: String,
    /// A string or up to 100.
    input: Texts,
    /// `float` or `base64` (little-endian f32).
    encoding_format: Option<String>,
    user: Option<String>,
}

/// A chat completion, a text completion, or (streamed) their chunks as server-sent events.
#[derive(ToSchema, Deserialize)]
pub struct Completion {
    id: String,
    /// `chat.completion` or `text_completion`.
    object: String,
    created: i64,
    model: String,
    #[schema(value_type = Vec<Object>)]
    choices: Vec<Value>,
    usage: Usage,
}

/// Embeddings.
#[derive(ToSchema, Deserialize)]
pub struct EmbeddingList {
    object: String,
    #[schema(value_type = Vec<Object>)]
    data: Vec<Value>,
    model: String,
    #[schema(value_type = Object)]
    usage: Value,
}

/// A served model.
#[derive(ToSchema, Deserialize)]
pub struct Model {
    id: String,
    object: String,
    created: i64,
    owned_by: String,
    /// `text-generation` or `embeddings`.
    task: String,
    /// Whether it takes LoRA adapters.
    adapters: bool,
    /// An account's adapter, listed as `base:adapter`: its base model.
    parent: Option<String>,
    /// An account's adapter: its id.
    adapter: Option<String>,
}

/// Every served model.
#[derive(ToSchema, Deserialize)]
pub struct ModelList {
    object: String,
    data: Vec<Model>,
}

/// `POST /v1/files`.
#[derive(ToSchema, Deserialize)]
pub struct FileUpload {
    /// `batch`.
    purpose: String,
    /// JSONL: `{"custom_id","method":"POST","url","body"}` a line.
    #[schema(value_type = String, format = Binary)]
    file: Vec<u8>,
    /// `created_at`, with `expires_after[seconds]`.
    #[serde(rename = "expires_after[anchor]")]
    #[schema(rename = "expires_after[anchor]")]
    expires_after_anchor: Option<String>,
    /// 3,600 to 2,592,000: the file is deleted that long after it is made.
    #[serde(rename = "expires_after[seconds]")]
    #[schema(rename = "expires_after[seconds]")]
    expires_after_seconds: Option<u64>,
}

/// An uploaded file.
#[derive(ToSchema, Deserialize)]
pub struct FileObject {
    id: String,
    object: String,
    bytes: u64,
    created_at: i64,
    filename: String,
    purpose: String,
    status: String,
    /// When it is deleted (`expires_after`), or null.
    expires_at: Option<i64>,
}

/// A page of files.
#[derive(ToSchema, Deserialize)]
pub struct FileList {
    object: String,
    data: Vec<FileObject>,
    first_id: Option<String>,
    last_id: Option<String>,
    has_more: bool,
}

/// What was deleted.
#[derive(ToSchema, Deserialize)]
pub struct Deleted {
    id: String,
    object: String,
    deleted: bool,
}

// ---------------------------------------------------------------- adapters

/// `POST /v1/adapters`.
#[derive(ToSchema, Deserialize)]
pub struct AdapterUpload {
    /// The base model, one that takes adapters.
    model: String,
    /// 1–64 of `A–Z a–z 0–9 . _ -`, unique in the account.
    name: String,
    description: Option<String>,
    /// `adapter_config.json` (PEFT), at most 1 MiB.
    #[schema(value_type = String, format = Binary)]
    config: Vec<u8>,
    /// `adapter_model.safetensors`: f32, f16 or bf16 LoRA weights.
    #[schema(value_type = String, format = Binary)]
    weights: Vec<u8>,
}

/// A LoRA adapter.
#[derive(ToSchema, Deserialize)]
pub struct Adapter {
    id: String,
    object: String,
    name: String,
    model: String,
    description: String,
    /// `ready`, or `pending` while a Workers AI finetune waits for a file.
    status: String,
    rank: Option<u32>,
    targets: Option<Vec<String>>,
    bytes: Option<u64>,
    sha256: Option<String>,
    created_at: i64,
    modified_at: i64,
}

/// A page of adapters, newest first.
#[derive(ToSchema, Deserialize)]
pub struct AdapterList {
    object: String,
    data: Vec<Adapter>,
    first_id: Option<String>,
    last_id: Option<String>,
    has_more: bool,
}

/// `POST …/ai/finetunes`: an empty finetune.
#[derive(ToSchema, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FinetuneCreate {
    model: String,
    name: String,
    description: Option<String>,
    /// Only `false`: a finetune is its account's alone (`true`: `400 unsupported_parameter`).
    public: Option<bool>,
}

/// `POST …/finetunes/{finetune_id}/finetune-assets`: one of the two files.
#[derive(ToSchema, Deserialize)]
pub struct FinetuneAsset {
    /// `adapter_config.json` or `adapter_model.safetensors`.
    file_name: String,
    #[schema(value_type = String, format = Binary)]
    file: Vec<u8>,
}

// ---------------------------------------------------------------- account and health

/// The caller's account.
#[derive(ToSchema, Deserialize)]
pub struct Account {
    id: String,
    object: String,
    /// `whsec_…`: signs the account's webhooks.
    webhook_secret: String,
    /// The limits that apply to it (0: no limit).
    limits: Limits,
}

/// The limits that apply to an account: its own, else the deployment's (0: no limit).
#[derive(ToSchema, Deserialize)]
pub struct Limits {
    queued_requests: u64,
    realtime_per_second: f64,
    file_bytes: u64,
    adapters: u64,
}

/// `POST /admin/v1/accounts`.
#[derive(ToSchema, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewAccount {
    /// The account's name and id: 1–64 of `a–z 0–9 - _`, starting with a letter or a digit.
    name: String,
    /// The first key's name (`default`).
    key_name: Option<String>,
}

/// An account, as the operator sees it.
#[derive(ToSchema, Deserialize)]
pub struct AdminAccount {
    id: String,
    object: String,
    /// `active` or `disabled`.
    status: String,
    created_at: i64,
    disabled_at: Option<i64>,
    /// Its own limits (null: the deployment's default).
    quotas: Quotas,
    /// On creation: the first key, with its value.
    key: Option<ApiKey>,
    /// On disabling: the batches it cancelled.
    cancelled_batches: Option<Vec<String>>,
}

/// An account's own limits: each a number (0: no limit) or null (the deployment's default).
#[derive(ToSchema, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Quotas {
    /// Batch requests accepted and not yet ended, across its batches.
    #[schema(minimum = 0)]
    queued_requests: Option<u64>,
    /// Real-time requests a second (per API process).
    #[schema(minimum = 0)]
    realtime_per_second: Option<f64>,
    /// Bytes of files held.
    #[schema(minimum = 0)]
    file_bytes: Option<u64>,
    /// Adapters held.
    #[schema(minimum = 0)]
    adapters: Option<u64>,
}

/// `PATCH /admin/v1/accounts/{account_id}`.
#[derive(ToSchema, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AccountChange {
    /// The limits to change; those not named are left as they are.
    quotas: Option<Quotas>,
}

/// A page of accounts, in name order.
#[derive(ToSchema, Deserialize)]
pub struct AdminAccountList {
    object: String,
    data: Vec<AdminAccount>,
    first_id: Option<String>,
    last_id: Option<String>,
    has_more: bool,
}

/// `POST /admin/v1/accounts/{account_id}/keys`.
#[derive(ToSchema, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewKey {
    /// 1–128 characters, no control characters (`default`).
    name: Option<String>,
}

/// An API key's record.
#[derive(ToSchema, Deserialize)]
pub struct ApiKey {
    /// `key_…`.
    id: String,
    object: String,
    account_id: String,
    name: String,
    /// The key's first and last characters.
    redacted_value: String,
    /// The key itself, shown once: when it is made.
    value: Option<String>,
    created_at: i64,
    /// When it last opened a request, to the minute.
    last_used_at: Option<i64>,
    revoked_at: Option<i64>,
}

/// An account's keys, oldest first.
#[derive(ToSchema, Deserialize)]
pub struct ApiKeyList {
    object: String,
    data: Vec<ApiKey>,
}

/// One group's usage: the lane and the groups asked for.
#[derive(ToSchema, Deserialize)]
pub struct UsageRow {
    /// `batch` or `realtime`.
    lane: String,
    model: Option<String>,
    /// The adapter's id, `""` for none.
    adapter: Option<String>,
    /// `YYYY-MM-DD`, UTC.
    day: Option<String>,
    /// `""` on the real-time lane.
    batch_id: Option<String>,
    /// Requests that succeeded.
    requests: i64,
    input_tokens: i64,
    output_tokens: i64,
}

/// `GET /v1/usage`.
#[derive(ToSchema, Deserialize)]
pub struct UsageReport {
    object: String,
    start: String,
    end: String,
    data: Vec<UsageRow>,
}

/// `{"status":"ok"}`.
#[derive(ToSchema, Deserialize)]
pub struct Health {
    status: String,
}

/// Each backing service's check: `ok`, or what is wrong.
#[derive(ToSchema, Deserialize)]
pub struct Checks {
    postgres: String,
    rabbitmq: String,
    s3: String,
}

/// `ready` or `unavailable`, with each check.
#[derive(ToSchema, Deserialize)]
pub struct Ready {
    status: String,
    checks: Checks,
}

// ---------------------------------------------------------------- the document

/// The parts of the document no route carries: title, security, error shapes.
#[derive(utoipa::OpenApi)]
#[openapi(
    info(
        title = "Lorry",
        description = "Asynchronous batch inference: native batches, the Workers AI shape, OpenAI's routes and LoRA adapters. See docs/API.md."
    ),
    components(schemas(ErrorBody, CloudflareError)),
    paths(document, crate::openai::model, crate::workers_ai::run),
    tags(
        (name = NATIVE, description = "Native batches"),
        (name = WORKERS_AI, description = "The Workers AI shape"),
        (name = OPENAI, description = "OpenAI-compatible routes, files and batches"),
        (name = ADAPTERS, description = "LoRA adapters"),
        (name = SERVICE, description = "Account and health"),
        (name = ADMIN, description = "Accounts and API keys, for the operator (served only with LORRY_ADMIN_TOKEN set)"),
    )
)]
pub struct Base;

/// Routes that need no token.
const OPEN: [&str; 4] = ["/healthz", "/readyz", "/metrics", "/openapi.json"];

/// Finishes the document the router collected: the bearer scheme on every
/// route that needs a token, and every error status each can answer, in the
/// route's own error shape.
pub fn finish(mut doc: OpenApi) -> OpenApi {
    let components = doc.components.get_or_insert_with(Default::default);
    components.add_security_scheme(
        "bearer",
        SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
    );
    components.add_security_scheme(
        "admin",
        SecurityScheme::Http(
            HttpBuilder::new()
                .scheme(HttpAuthScheme::Bearer)
                .description(Some("LORRY_ADMIN_TOKEN"))
                .build(),
        ),
    );
    let statuses: BTreeSet<u16> = ErrorCode::ALL
        .iter()
        .map(|&c| crate::error::status(c).as_u16())
        .collect();
    for (path, item) in doc.paths.paths.iter_mut() {
        let open = OPEN.contains(&path.as_str());
        let shape = if path.starts_with("/client/v4/") {
            "CloudflareError"
        } else {
            "ErrorBody"
        };
        for operation in operations(item) {
            if !open {
                let scheme = if path.starts_with("/admin/") { "admin" } else { "bearer" };
                operation.security = Some(vec![utoipa::openapi::security::SecurityRequirement::new(
                    scheme,
                    Vec::<String>::new(),
                )]);
            }
            for status in &statuses {
                // The open routes answer only what a URI or method fault gives.
                if open && !matches!(status, 400 | 405) {
                    continue;
                }
                let key = status.to_string();
                if operation.responses.responses.contains_key(&key) {
                    continue;
                }
                let response = ResponseBuilder::new()
                    .description(reason(*status))
                    .content(
                        "application/json",
                        ContentBuilder::new()
                            .schema(Some(RefOr::Ref(utoipa::openapi::Ref::from_schema_name(shape))))
                            .build(),
                    )
                    .build();
                operation.responses.responses.insert(key, RefOr::T(response));
            }
        }
    }
    doc
}

fn operations(item: &mut utoipa::openapi::PathItem) -> impl Iterator<Item = &mut Operation> {
    [
        item.get.as_mut(),
        item.put.as_mut(),
        item.post.as_mut(),
        item.delete.as_mut(),
        item.patch.as_mut(),
    ]
    .into_iter()
    .flatten()
}

fn reason(status: u16) -> String {
    let text = axum::http::StatusCode::from_u16(status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("error");
    let codes: Vec<&str> = ErrorCode::ALL
        .iter()
        .filter(|&&c| crate::error::status(c).as_u16() == status)
        .map(|c| c.as_str())
        .collect();
    format!("{text}: {}", codes.join(", "))
}

/// `GET /openapi.json`: this document.
#[utoipa::path(get, path = "/openapi.json", tag = SERVICE,
    responses((status = 200, description = "The OpenAPI document", content_type = "application/json", body = Object)))]
pub async fn document() {}
