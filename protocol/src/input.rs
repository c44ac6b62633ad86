//! Request validation: parse, don't validate.
//!
//! A [`ValidRequest`] is made once, at the edge, from a JSON body; everything
//! past that trusts it. Every refusal is an [`InputError`] with a stable code
//! and the path of the field at fault, relative to the body.

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

pub use crate::constraint::Constraint;
use crate::error::ErrorCode;
pub use crate::tools::{ToolCall, Tools};
use crate::Task;

/// How token vectors become one embedding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Pooling {
    /// The first (`[CLS]`) token's vector.
    Cls,
    /// The mean over all tokens.
    Mean,
}

/// Why a request body was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct InputError {
    /// Stable machine-readable code, e.g. `unknown_field`.
    pub code: ErrorCode,
    /// The field at fault, as a path relative to the validated value (`messages[0].role`).
    pub param: String,
    /// A human-readable explanation.
    pub message: String,
}

impl InputError {
    /// An error about one field.
    pub fn new(code: ErrorCode, param: impl Into<String>, message: impl Into<String>) -> Self {
        InputError {
            code,
            param: param.into(),
            message: message.into(),
        }
    }

    /// The same error, with its field path placed under `prefix`.
    pub fn under(mut self, prefix: &str) -> Self {
        self.param = join_path(prefix, &self.param);
        self
    }
}

/// Refuses a JSON value holding U+0000 in any string or key, naming where.
///
/// The database cannot store the character in text, so a client that sends
/// it gets a 400 naming the field rather than a stored half or a failed
/// commit; every JSON body is checked once, at the edge, with this.
pub fn refuse_nul(value: &Value, path: &str) -> Result<(), InputError> {
    let at = |path: &str| {
        InputError::new(
            ErrorCode::NulCharacter,
            path,
            format!("{} holds the character U+0000, which is not accepted", display(path)),
        )
    };
    match value {
        Value::String(s) if s.contains('\0') => Err(at(path)),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .try_for_each(|(i, item)| refuse_nul(item, &format!("{path}[{i}]"))),
        Value::Object(map) => map.iter().try_for_each(|(key, item)| {
            let field = join_path(path, &key.replace('\0', "\\u0000"));
            if key.contains('\0') {
                return Err(at(&field));
            }
            refuse_nul(item, &field)
        }),
        _ => Ok(()),
    }
}

fn join_path(prefix: &str, field: &str) -> String {
    match (prefix.is_empty(), field.is_empty()) {
        (true, _) => field.to_string(),
        (false, true) => prefix.to_string(),
        (false, false) if field.starts_with('[') => format!("{prefix}{field}"),
        (false, false) => format!("{prefix}.{field}"),
    }
}

/// Reads the fields of one JSON object, refusing wrong types and, at the end, unknown fields.
pub struct Fields<'a> {
    path: String,
    object: &'a Map<String, Value>,
    seen: Vec<&'a str>,
}

impl<'a> Fields<'a> {
    /// Start reading `value`, which must be an object; `path` names it in errors.
    pub fn new(value: &'a Value, path: &str) -> Result<Self, InputError> {
        let object = value.as_object().ok_or_else(|| {
            InputError::new(
                ErrorCode::InvalidType,
                path,
                format!("{} must be a JSON object", display(path)),
            )
        })?;
        Ok(Fields {
            path: path.to_string(),
            object,
            seen: Vec::new(),
        })
    }

    /// The path of a field of this object.
    pub fn path_of(&self, name: &str) -> String {
        join_path(&self.path, name)
    }

    /// The raw value of an optional field (`null` counts as absent).
    pub fn raw(&mut self, name: &'a str) -> Option<&'a Value> {
        self.seen.push(name);
        self.object.get(name).filter(|v| !v.is_null())
    }

    /// An optional field of type `T`; `expected` describes `T` in errors.
    pub fn optional<T: DeserializeOwned>(&mut self, name: &'a str, expected: &str) -> Result<Option<T>, InputError> {
        match self.raw(name) {
            None => Ok(None),
            Some(value) => T::deserialize(value).map(Some).map_err(|_| {
                let path = self.path_of(name);
                InputError::new(
                    ErrorCode::InvalidType,
                    path.clone(),
                    format!("{path} must be {expected}"),
                )
            }),
        }
    }

    /// A required field of type `T`.
    pub fn required<T: DeserializeOwned>(&mut self, name: &'a str, expected: &str) -> Result<T, InputError> {
        self.optional(name, expected)?.ok_or_else(|| {
            let path = self.path_of(name);
            InputError::new(ErrorCode::MissingField, path.clone(), format!("{path} is required"))
        })
    }

    /// Refuse any field that was not read.
    pub fn deny_unknown(self) -> Result<(), InputError> {
        match self.object.keys().find(|k| !self.seen.contains(&k.as_str())) {
            None => Ok(()),
            Some(key) => {
                let path = join_path(&self.path, key);
                Err(InputError::new(
                    ErrorCode::UnknownField,
                    path.clone(),
                    format!("unknown field {path}"),
                ))
            }
        }
    }
}

fn display(path: &str) -> &str {
    if path.is_empty() {
        "the body"
    } else {
        path
    }
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The message text.
    pub content: String,
    /// The calls an assistant message made.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// The call a `tool` message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl Message {
    /// A message of text alone.
    pub fn text(role: &str, content: impl Into<String>) -> Self {
        Message {
            role: role.to_string(),
            content: content.into(),
            ..Message::default()
        }
    }
}

/// What the model is asked to work on.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Prompt {
    /// A completion prompt.
    Text(String),
    /// A chat conversation, rendered with the model's template unless `raw`.
    Messages(Vec<Message>),
    /// Plain text (the echo model).
    Plain(String),
    /// Texts to embed, one embedding each.
    Inputs(Vec<String>),
    /// Token ids of the model's vocabulary, used as they are (callers of the
    /// engine, such as benchmarks; no route takes them).
    Tokens(Vec<u32>),
}

/// Sampling and stopping parameters, already range-checked.
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct Sampling {
    /// Upper bound on generated tokens.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    /// 0 means greedy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    /// Nucleus sampling mass, in (0, 1].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    /// Keep only the k most likely tokens.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_k: Option<u32>,
    /// Per-request seed; the same seed gives the same output whatever shares the batch.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Stop strings, at most four.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub stop: Vec<String>,
    /// Token ids that end generation besides the model's own (at most 32).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past the end-of-sequence token.
    #[serde(skip_serializing_if = "is_false")]
    pub ignore_eos: bool,
    /// Penalties are accepted for Workers AI compatibility.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub repetition_penalty: Option<f32>,
    /// See `repetition_penalty`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f32>,
    /// See `repetition_penalty`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f32>,
    /// Report each generated token's log-probability with this many of the
    /// most likely alternatives (0 to [`MAX_TOP_LOGPROBS`]); `None`: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<u8>,
    /// Choices to generate for the one prompt (1 to [`MAX_CHOICES`]); `None`: one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub n: Option<u8>,
}

impl Sampling {
    /// How many choices the request asks for.
    pub fn choices(&self) -> u32 {
        self.n.unwrap_or(1).max(1).into()
    }
}

/// The request field that named the adapter (`lora` in Workers AI's shape,
/// `adapter` in the native one), so that an error found later, on a worker,
/// names it as the client spelled it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdapterField {
    /// `lora`.
    #[default]
    Lora,
    /// `adapter`.
    Adapter,
}

impl AdapterField {
    fn is_lora(&self) -> bool {
        *self == AdapterField::Lora
    }

    /// The field's name.
    pub fn as_str(self) -> &'static str {
        match self {
            AdapterField::Lora => "lora",
            AdapterField::Adapter => "adapter",
        }
    }
}

/// A request that passed validation; made by [`ValidRequest::parse`] at the
/// edge, then stored and queued as it is (serialised), never re-validated.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ValidRequest {
    /// The input.
    pub prompt: Prompt,
    /// Skip the chat template.
    #[serde(default, skip_serializing_if = "is_false")]
    pub raw: bool,
    /// Stream tokens back (real-time lane only).
    #[serde(default, skip_serializing_if = "is_false")]
    pub stream: bool,
    /// A LoRA adapter: the client's name or id, which the API resolves to the
    /// adapter's id before the request is stored or queued.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<String>,
    /// The field that named it, for errors.
    #[serde(default, skip_serializing_if = "AdapterField::is_lora")]
    pub adapter_field: AdapterField,
    /// Sampling parameters.
    #[serde(default, skip_serializing_if = "Sampling::is_default")]
    pub sampling: Sampling,
    /// How token vectors become one embedding (embedding models; their default when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pooling: Option<Pooling>,
    /// What the generated text must match (structured outputs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub constraint: Option<Constraint>,
    /// The functions the model may call (chat).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Box<Tools>>,
}

impl Sampling {
    fn is_default(&self) -> bool {
        *self == Sampling::default()
    }
}

/// Serialised requests leave out what is off (they are stored by the thousand).
fn is_false(value: &bool) -> bool {
    !value
}

/// The largest `max_tokens` a request may ask for.
pub const MAX_TOKENS_LIMIT: u32 = 32_768;
/// The longest `stop` string, in bytes.
pub const MAX_STOP_BYTES: usize = 256;

/// The most choices `n` may ask for.
pub const MAX_CHOICES: u32 = 16;

/// The most alternatives `top_logprobs` may ask for at each position.
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// The most ids `stop_token_ids` may hold.
pub const MAX_STOP_TOKEN_IDS: usize = 32;
/// The most texts one embeddings request may carry.
pub const MAX_EMBEDDING_INPUTS: usize = 100;
const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];

impl ValidRequest {
    /// Validate a request body for a model of the given task.
    pub fn parse(task: Task, body: &Value) -> Result<ValidRequest, InputError> {
        let mut f = Fields::new(body, "")?;
        if task == Task::Embeddings {
            return parse_embeddings(f);
        }
        let prompt_text: Option<String> = f.optional("prompt", "a string")?;
        let messages = f.raw("messages").map(parse_messages).transpose()?;
        let text: Option<String> = match task {
            Task::Echo => f.optional("text", "a string")?,
            Task::TextGeneration | Task::Embeddings => None,
        };
        let raw = f.optional("raw", "a boolean")?.unwrap_or(false);
        let stream = f.optional("stream", "a boolean")?.unwrap_or(false);
        let (lora, adapter_field) = parse_adapter(&mut f)?;
        let sampling = parse_sampling(&mut f)?;
        let constraint = match crate::constraint::parse(&mut f)? {
            Some((_, field)) if task == Task::Echo => {
                return Err(InputError::new(
                    ErrorCode::UnsupportedParameter,
                    field,
                    "the echo model returns its input; it takes no constraint on its output",
                ))
            }
            found => found.map(|(constraint, _)| constraint),
        };
        let tools = crate::tools::parse(&mut f)?;
        if tools.is_some() && task == Task::Echo {
            return Err(InputError::new(
                ErrorCode::UnsupportedParameter,
                "tools",
                "the echo model returns its input; it calls no tools",
            ));
        }
        if tools.as_ref().is_some_and(Tools::active) && constraint.is_some() {
            return Err(InputError::new(
                ErrorCode::ConflictingFields,
                "tools",
                "give tools (unless tool_choice is none) or a structured output's format, not both",
            ));
        }
        if task == Task::Echo && sampling.logprobs.is_some() {
            return Err(InputError::new(
                ErrorCode::UnsupportedParameter,
                "logprobs",
                "the echo model returns its input; it has no token probabilities",
            ));
        }
        if task == Task::Echo && sampling.n.is_some() {
            return Err(InputError::new(
                ErrorCode::UnsupportedParameter,
                "n",
                "the echo model returns its input once",
            ));
        }
        f.deny_unknown()?;
        let prompt = match (prompt_text, messages, text) {
            (Some(p), None, None) => Prompt::Text(p),
            (None, Some(m), None) => Prompt::Messages(m),
            (None, None, Some(t)) => Prompt::Plain(t),
            (None, None, None) => {
                return Err(InputError::new(
                    ErrorCode::MissingField,
                    "prompt",
                    "one of prompt or messages is required",
                ))
            }
            _ => {
                return Err(InputError::new(
                    ErrorCode::ConflictingFields,
                    "messages",
                    "give exactly one of prompt, messages or text",
                ))
            }
        };
        Ok(ValidRequest {
            prompt,
            raw,
            stream,
            lora,
            adapter_field,
            sampling,
            pooling: None,
            constraint,
            tools: tools.map(Box::new),
        })
    }

    /// The prompt's text as one string (chat messages joined by newlines).
    pub fn prompt_text(&self) -> String {
        match &self.prompt {
            Prompt::Text(t) | Prompt::Plain(t) => t.clone(),
            Prompt::Messages(m) => m.iter().map(|m| m.content.as_str()).collect::<Vec<_>>().join("\n"),
            Prompt::Inputs(texts) => texts.join("\n"),
            Prompt::Tokens(ids) => ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" "),
        }
    }
}

/// `{"text": string | [strings], "pooling"?: "cls" | "mean"}`.
fn parse_embeddings(mut f: Fields<'_>) -> Result<ValidRequest, InputError> {
    let texts = match f.raw("text") {
        None => return Err(InputError::new(ErrorCode::MissingField, "text", "text is required")),
        Some(Value::String(t)) => vec![t.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_str().map(str::to_string).ok_or_else(|| {
                    InputError::new(
                        ErrorCode::InvalidType,
                        format!("text[{i}]"),
                        format!("text[{i}] must be a string"),
                    )
                })
            })
            .collect::<Result<Vec<_>, _>>()?,
        Some(_) => {
            return Err(InputError::new(
                ErrorCode::InvalidType,
                "text",
                "text must be a string or an array of strings",
            ))
        }
    };
    if texts.is_empty() || texts.len() > MAX_EMBEDDING_INPUTS {
        return Err(InputError::new(
            ErrorCode::InvalidValue,
            "text",
            format!("text takes 1 to {MAX_EMBEDDING_INPUTS} strings"),
        ));
    }
    let pooling = f.optional("pooling", "\"cls\" or \"mean\"")?;
    f.deny_unknown()?;
    Ok(ValidRequest {
        prompt: Prompt::Inputs(texts),
        raw: false,
        stream: false,
        lora: None,
        adapter_field: AdapterField::Lora,
        sampling: Sampling::default(),
        pooling,
        constraint: None,
        tools: None,
    })
}

/// `lora` (Workers AI) or `adapter` (native), at most one, never empty.
fn parse_adapter(f: &mut Fields<'_>) -> Result<(Option<String>, AdapterField), InputError> {
    let lora: Option<String> = f.optional("lora", "a string")?;
    let adapter: Option<String> = f.optional("adapter", "a string")?;
    let (name, field) = match (lora, adapter) {
        (Some(_), Some(_)) => {
            return Err(InputError::new(
                ErrorCode::ConflictingFields,
                "adapter",
                "give lora or adapter, not both",
            ))
        }
        (Some(name), None) => (Some(name), AdapterField::Lora),
        (None, Some(name)) => (Some(name), AdapterField::Adapter),
        (None, None) => (None, AdapterField::Lora),
    };
    let param = field.as_str();
    if name.as_deref().is_some_and(|n| n.is_empty() || n.len() > 128) {
        return Err(InputError::new(
            ErrorCode::InvalidValue,
            param,
            format!("{param} must name an adapter in 1 to 128 characters"),
        ));
    }
    Ok((name, field))
}

fn parse_messages(value: &Value) -> Result<Vec<Message>, InputError> {
    let items = value
        .as_array()
        .ok_or_else(|| InputError::new(ErrorCode::InvalidType, "messages", "messages must be an array"))?;
    if items.is_empty() {
        return Err(InputError::new(
            ErrorCode::EmptyMessages,
            "messages",
            "messages must not be empty",
        ));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let mut f = Fields::new(item, &format!("messages[{i}]"))?;
            let role: String = f.required("role", "a string")?;
            if !ROLES.contains(&role.as_str()) {
                let path = f.path_of("role");
                return Err(InputError::new(
                    ErrorCode::InvalidValue,
                    path.clone(),
                    format!("{path} must be one of {}", ROLES.join(", ")),
                ));
            }
            let calls = match f.raw("tool_calls") {
                Some(calls) if role == "assistant" => {
                    crate::tools::parse_message_calls(calls, &f.path_of("tool_calls"))?
                }
                Some(_) => {
                    let path = f.path_of("tool_calls");
                    return Err(InputError::new(
                        ErrorCode::InvalidValue,
                        path.clone(),
                        format!("{path} belongs to assistant messages"),
                    ));
                }
                None => Vec::new(),
            };
            // An assistant message that only calls tools may leave its content out.
            let content: String = if calls.is_empty() {
                f.required("content", "a string")?
            } else {
                f.optional("content", "a string")?.unwrap_or_default()
            };
            let tool_call_id: Option<String> = f.optional("tool_call_id", "a string")?;
            if tool_call_id.is_some() && role != "tool" {
                let path = f.path_of("tool_call_id");
                return Err(InputError::new(
                    ErrorCode::InvalidValue,
                    path.clone(),
                    format!("{path} belongs to tool messages"),
                ));
            }
            f.deny_unknown()?;
            Ok(Message {
                role,
                content,
                tool_calls: calls,
                tool_call_id,
            })
        })
        .collect()
}

fn parse_sampling(f: &mut Fields<'_>) -> Result<Sampling, InputError> {
    let max_tokens: Option<u32> = f.optional("max_tokens", "a positive integer")?;
    if let Some(n) = max_tokens {
        in_range(f, "max_tokens", n as f64, 1.0, MAX_TOKENS_LIMIT as f64)?;
    }
    let temperature = ranged(f, "temperature", 0.0, 5.0)?;
    let top_p = ranged(f, "top_p", 0.0, 1.0)?;
    if top_p == Some(0.0) {
        return Err(InputError::new(
            ErrorCode::InvalidValue,
            "top_p",
            "top_p must be greater than 0",
        ));
    }
    let top_k: Option<u32> = f.optional("top_k", "a non-negative integer")?;
    let seed: Option<u64> = f.optional("seed", "a non-negative integer")?;
    let stop = match f.raw("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(v) => serde_json::from_value::<Vec<String>>(v.clone()).map_err(|_| {
            InputError::new(
                ErrorCode::InvalidType,
                "stop",
                "stop must be a string or an array of strings",
            )
        })?,
    };
    if stop.len() > 4 || stop.iter().any(|s| s.is_empty() || s.len() > MAX_STOP_BYTES) {
        return Err(InputError::new(
            ErrorCode::InvalidValue,
            "stop",
            format!("stop takes at most 4 non-empty strings of at most {MAX_STOP_BYTES} bytes"),
        ));
    }
    let stop_token_ids: Vec<u32> = f
        .optional("stop_token_ids", "an array of token ids")?
        .unwrap_or_default();
    if stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
        return Err(InputError::new(
            ErrorCode::InvalidValue,
            "stop_token_ids",
            format!("stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} token ids"),
        ));
    }
    Ok(Sampling {
        max_tokens,
        temperature,
        top_p,
        top_k,
        seed,
        stop,
        stop_token_ids,
        ignore_eos: f.optional("ignore_eos", "a boolean")?.unwrap_or(false),
        repetition_penalty: ranged(f, "repetition_penalty", 0.0, 2.0)?,
        frequency_penalty: ranged(f, "frequency_penalty", -2.0, 2.0)?,
        presence_penalty: ranged(f, "presence_penalty", -2.0, 2.0)?,
        logprobs: parse_logprobs(f)?,
        n: match f.optional::<u32>("n", "an integer from 1 to 16")? {
            Some(n) if !(1..=MAX_CHOICES).contains(&n) => {
                return Err(InputError::new(
                    ErrorCode::InvalidValue,
                    "n",
                    format!("n must be from 1 to {MAX_CHOICES}"),
                ))
            }
            Some(1) | None => None,
            Some(n) => Some(n as u8),
        },
    })
}

/// `logprobs` (a boolean) and `top_logprobs` (0 to [`MAX_TOP_LOGPROBS`],
/// only with `logprobs: true`), as OpenAI's chat takes them.
fn parse_logprobs(f: &mut Fields<'_>) -> Result<Option<u8>, InputError> {
    let wanted: bool = f.optional("logprobs", "a boolean")?.unwrap_or(false);
    let top: Option<u32> = f.optional("top_logprobs", "an integer from 0 to 20")?;
    match (wanted, top) {
        (_, Some(n)) if n > MAX_TOP_LOGPROBS => Err(InputError::new(
            ErrorCode::InvalidValue,
            "top_logprobs",
            format!("top_logprobs must be from 0 to {MAX_TOP_LOGPROBS}"),
        )),
        (false, Some(_)) => Err(InputError::new(
            ErrorCode::InvalidValue,
            "top_logprobs",
            "top_logprobs needs logprobs: true",
        )),
        (true, top) => Ok(Some(top.unwrap_or(0) as u8)),
        (false, None) => Ok(None),
    }
}

fn ranged<'a>(f: &mut Fields<'a>, name: &'a str, lo: f64, hi: f64) -> Result<Option<f32>, InputError> {
    let value: Option<f64> = f.optional(name, "a number")?;
    if let Some(v) = value {
        in_range(f, name, v, lo, hi)?;
    }
    Ok(value.map(|v| v as f32))
}

fn in_range(f: &Fields<'_>, name: &str, value: f64, lo: f64, hi: f64) -> Result<(), InputError> {
    if (lo..=hi).contains(&value) {
        return Ok(());
    }
    let path = f.path_of(name);
    Err(InputError::new(
        ErrorCode::OutOfRange,
        path.clone(),
        format!("{path} must be between {lo} and {hi}"),
    ))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_prompt_with_sampling_parses() {
        let req = ValidRequest::parse(
            Task::TextGeneration,
            &json!({"prompt": "hi", "max_tokens": 8, "temperature": 0, "stop": "x"}),
        )
        .unwrap();
        assert_eq!(req.prompt, Prompt::Text("hi".into()));
        assert_eq!(req.sampling.max_tokens, Some(8));
        assert_eq!(req.sampling.stop, vec!["x".to_string()]);
    }

    #[test]
    fn an_unknown_field_is_named() {
        let err = ValidRequest::parse(Task::Echo, &json!({"prompt": "hi", "bogus": 1})).unwrap_err();
        assert_eq!((err.code.as_str(), err.param.as_str()), ("unknown_field", "bogus"));
    }

    #[test]
    fn a_wrong_type_inside_messages_names_the_path() {
        let err = ValidRequest::parse(Task::Echo, &json!({"messages": [{"role": "user", "content": 3}]})).unwrap_err();
        assert_eq!(
            (err.code.as_str(), err.param.as_str()),
            ("invalid_type", "messages[0].content")
        );
        let err = err.under("requests[7].body");
        assert_eq!(err.param, "requests[7].body.messages[0].content");
    }

    #[test]
    fn text_is_only_for_the_echo_model() {
        assert!(ValidRequest::parse(Task::Echo, &json!({"text": "a"})).is_ok());
        let err = ValidRequest::parse(Task::TextGeneration, &json!({"text": "a"})).unwrap_err();
        assert_eq!(err.code.as_str(), "unknown_field");
    }

    #[test]
    fn out_of_range_and_missing_inputs_are_refused() {
        let err = ValidRequest::parse(Task::Echo, &json!({"prompt": "a", "temperature": 9})).unwrap_err();
        assert_eq!((err.code.as_str(), err.param.as_str()), ("out_of_range", "temperature"));
        let err = ValidRequest::parse(Task::Echo, &json!({"max_tokens": 3})).unwrap_err();
        assert_eq!(err.code.as_str(), "missing_field");
        let err = ValidRequest::parse(Task::Echo, &json!({"prompt": "a", "messages": []})).unwrap_err();
        assert_eq!(err.code.as_str(), "empty_messages");
        let err = ValidRequest::parse(Task::Echo, &json!([1])).unwrap_err();
        assert_eq!(err.code.as_str(), "invalid_type");
    }

    #[test]
    fn logprobs_take_a_boolean_and_up_to_twenty_alternatives() {
        let parse = |body| ValidRequest::parse(Task::TextGeneration, &body);
        let logprobs = |body| parse(body).unwrap().sampling.logprobs;
        assert_eq!(logprobs(json!({"prompt": "a"})), None);
        assert_eq!(logprobs(json!({"prompt": "a", "logprobs": false})), None);
        assert_eq!(logprobs(json!({"prompt": "a", "logprobs": true})), Some(0));
        assert_eq!(
            logprobs(json!({"prompt": "a", "logprobs": true, "top_logprobs": 20})),
            Some(20)
        );
        for (body, code, param) in [
            (
                json!({"prompt": "a", "logprobs": true, "top_logprobs": 21}),
                "invalid_value",
                "top_logprobs",
            ),
            (
                json!({"prompt": "a", "top_logprobs": 2}),
                "invalid_value",
                "top_logprobs",
            ),
            (
                json!({"prompt": "a", "logprobs": false, "top_logprobs": 2}),
                "invalid_value",
                "top_logprobs",
            ),
            (json!({"prompt": "a", "logprobs": 1}), "invalid_type", "logprobs"),
            (
                json!({"prompt": "a", "logprobs": true, "top_logprobs": -1}),
                "invalid_type",
                "top_logprobs",
            ),
        ] {
            let err = parse(body.clone()).unwrap_err();
            assert_eq!((err.code.as_str(), err.param.as_str()), (code, param), "{body}");
        }
        let err = ValidRequest::parse(Task::Echo, &json!({"prompt": "a", "logprobs": true})).unwrap_err();
        assert_eq!(
            (err.code.as_str(), err.param.as_str()),
            ("unsupported_parameter", "logprobs")
        );
    }

    #[test]
    fn a_valid_request_travels_as_json_and_comes_back_the_same() {
        let bodies = [
            json!({"messages": [{"role": "user", "content": "hi"}], "adapter": "a1", "max_tokens": 3,
                   "stop": ["x"], "seed": 7, "temperature": 0.5, "stream": true}),
            json!({"prompt": "p", "raw": true, "lora": "l", "stop_token_ids": [1, 2], "ignore_eos": true}),
            json!({"prompt": "p", "logprobs": true, "top_logprobs": 20}),
        ];
        for body in bodies {
            let request = ValidRequest::parse(Task::TextGeneration, &body).unwrap();
            let travelled: ValidRequest = serde_json::from_value(serde_json::to_value(&request).unwrap()).unwrap();
            assert_eq!(travelled, request);
        }
        let embed = ValidRequest::parse(Task::Embeddings, &json!({"text": ["a", "b"], "pooling": "mean"})).unwrap();
        let travelled: ValidRequest = serde_json::from_value(serde_json::to_value(&embed).unwrap()).unwrap();
        assert_eq!(travelled, embed);
        assert_eq!(travelled.adapter_field, AdapterField::Lora);
    }
}
