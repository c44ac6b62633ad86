//! Tool calls in the model family's own format.
//!
//! A model's chat template says which format its family was trained on:
//! Qwen2.5 and Hermes write `<tool_call>{"name", "arguments"}</tool_call>`,
//! Llama 3.x writes a bare JSON object `{"name", "parameters"}` (after
//! `<|python_tag|>` at times, several joined by `;`), Mistral writes
//! `[TOOL_CALLS]` and a JSON array. A template that renders `tools` itself is
//! given them; one that does not (SmolLM2's, the demo model's) gets them in a
//! system message in the Hermes format, its calls and results rendered as
//! Hermes text too, and its output read as Hermes.
//!
//! The output is read for calls once it ends: the text before the first call
//! is the message's content; a call that does not parse, or names a function
//! not offered, leaves the whole text as content. While it streams, text that
//! could begin a call is held back. `required` and a named function are
//! enforced by a Lark grammar of the format with each function's parameters
//! schema inline, so the calls always parse.

use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{json, Value};

use crate::input::{Constraint, Message, ToolCall, Tools};
use crate::runtime::rng::SplitMix;

/// How a model family writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>` (Qwen2.5, Hermes).
    Hermes,
    /// `{"name": …, "parameters": {…}}`, optionally after `<|python_tag|>`, several joined by `;` (Llama 3.x).
    Llama3Json,
    /// `[TOOL_CALLS] [{"name": …, "arguments": {…}}]` (Mistral).
    Mistral,
}

/// A model's tool-call format and whether its template renders tools itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ToolSyntax {
    /// The format its output is read in.
    pub format: ToolFormat,
    /// Whether the template takes `tools` and tool messages itself.
    pub native: bool,
}

/// A model's tool formats: its chat template's, and that of its `tool_use`
/// template where it ships one (Hermes models do), which is rendered instead
/// when a request shows the model tools, as transformers does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ToolTemplates {
    /// The chat template's.
    pub chat: ToolSyntax,
    /// The `tool_use` template's, where there is one.
    pub tool_use: Option<ToolSyntax>,
}

impl ToolTemplates {
    /// Whether a request offering `tools` renders with the `tool_use` template.
    pub fn uses_tool_template(&self, tools: Option<&Tools>) -> bool {
        self.tool_use.is_some() && tools.is_some_and(Tools::active)
    }

    /// The format a request offering `tools` is rendered and read in.
    pub fn syntax(&self, tools: Option<&Tools>) -> ToolSyntax {
        match self.tool_use {
            Some(syntax) if self.uses_tool_template(tools) => syntax,
            _ => self.chat,
        }
    }
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";
const MISTRAL_TAG: &str = "[TOOL_CALLS]";

impl ToolSyntax {
    /// The format a chat template's source implies.
    pub fn detect(template: Option<&str>) -> ToolSyntax {
        let source = template.unwrap_or_default();
        let takes_tools = source.contains("tools");
        let format = if source.contains(MISTRAL_TAG) {
            ToolFormat::Mistral
        } else if source.contains(HERMES_OPEN) {
            ToolFormat::Hermes
        } else if source.contains(PYTHON_TAG) || (takes_tools && source.contains("\"parameters\"")) {
            ToolFormat::Llama3Json
        } else {
            return ToolSyntax {
                format: ToolFormat::Hermes,
                native: false,
            };
        };
        ToolSyntax {
            format,
            native: takes_tools,
        }
    }

    /// The messages as the template takes them (Hugging Face's shape:
    /// `tool_calls` of `{"id", "type", "function": {"name", "arguments": {…}}}`,
    /// `tool_call_id` on tool messages). Without native support the tools go
    /// into a system message and calls and results become Hermes text.
    pub fn messages(&self, messages: &[Message], tools: Option<&Tools>) -> Vec<Value> {
        let offered = tools.filter(|t| t.active());
        if self.native {
            return messages.iter().map(|m| self.native_message(m)).collect();
        }
        let mut out: Vec<Value> = Vec::with_capacity(messages.len() + 1);
        if let Some(tools) = offered {
            let prompt = hermes_system_prompt(tools);
            match messages.first() {
                Some(first) if first.role == "system" => {
                    out.push(json!({"role": "system", "content": format!("{}\n\n{prompt}", first.content)}));
                }
                _ => out.push(json!({"role": "system", "content": prompt})),
            }
        }
        let skip = usize::from(offered.is_some() && messages.first().is_some_and(|m| m.role == "system"));
        for m in &messages[skip..] {
            let value = match m.role.as_str() {
                "assistant" if !m.tool_calls.is_empty() => {
                    let mut text = m.content.clone();
                    for call in &m.tool_calls {
                        if !text.is_empty() {
                            text.push('\n');
                        }
                        let body = json!({"name": call.name, "arguments": arguments_value(call)});
                        text.push_str(&format!("{HERMES_OPEN}\n{body}\n{HERMES_CLOSE}"));
                    }
                    json!({"role": "assistant", "content": text})
                }
                "tool" => {
                    json!({"role": "user", "content": format!("<tool_response>\n{}\n</tool_response>", m.content)})
                }
                _ => json!({"role": m.role, "content": m.content}),
            };
            out.push(value);
        }
        out
    }

    fn native_message(&self, m: &Message) -> Value {
        let mut value = json!({"role": m.role, "content": m.content});
        if !m.tool_calls.is_empty() {
            value["tool_calls"] = m
                .tool_calls
                .iter()
                .map(|call| {
                    json!({
                        "id": self.wire_id(&call.id),
                        "type": "function",
                        "function": {"name": call.name, "arguments": arguments_value(call)},
                    })
                })
                .collect();
        }
        if let Some(id) = &m.tool_call_id {
            value["tool_call_id"] = json!(self.wire_id(id));
        }
        value
    }

    /// The `tools` a native template is given (`None` where it is not).
    pub fn template_tools(&self, tools: Option<&Tools>) -> Option<Value> {
        tools.filter(|t| self.native && t.active()).map(Tools::template_json)
    }

    /// A call's id as the family's template takes it: Mistral's are nine
    /// letters and digits (the last nine of the client's, padded).
    fn wire_id(&self, id: &str) -> String {
        if self.format != ToolFormat::Mistral {
            return id.to_string();
        }
        let kept: Vec<char> = id.chars().filter(char::is_ascii_alphanumeric).collect();
        let tail: String = kept[kept.len().saturating_sub(9)..].iter().collect();
        format!("{tail:0>9}")
    }

    /// The calls in a finished output and where its content ends (the
    /// text before the first call, trailing whitespace left out), or `None`
    /// where the output holds no well-formed call of an offered function.
    pub fn split(&self, text: &str, tools: &Tools) -> Option<(usize, Vec<ToolCall>)> {
        let (start, bodies) = match self.format {
            ToolFormat::Hermes => hermes_bodies(text)?,
            ToolFormat::Llama3Json => llama_bodies(text)?,
            ToolFormat::Mistral => mistral_bodies(text)?,
        };
        let arguments_key = match self.format {
            ToolFormat::Llama3Json => "parameters",
            _ => "arguments",
        };
        let mut calls = Vec::with_capacity(bodies.len());
        for body in bodies {
            let name = body.get("name")?.as_str()?;
            if !tools.callable().any(|f| f.name == name) {
                return None;
            }
            let arguments = body.get(arguments_key).or_else(|| body.get("arguments"))?;
            if !arguments.is_object() {
                return None;
            }
            calls.push(ToolCall {
                id: self.new_id(),
                name: name.to_string(),
                arguments: arguments.to_string(),
            });
        }
        if calls.is_empty() {
            return None;
        }
        if !tools.parallel {
            calls.truncate(1);
        }
        Some((text[..start].trim_end().len(), calls))
    }

    /// How much of unfinished output may be streamed: everything before
    /// text that is, or could grow into, the start of a call.
    pub fn streamable(&self, text: &str) -> usize {
        let end = match self.format {
            ToolFormat::Hermes => marker_free(text, HERMES_OPEN),
            // The tag is a special token a decoded text may have lost: an output opening an array may be calls.
            ToolFormat::Mistral if text.trim_start().is_empty() || text.trim_start().starts_with('[') => 0,
            ToolFormat::Mistral => marker_free(text, MISTRAL_TAG),
            ToolFormat::Llama3Json => {
                let lead = text.trim_start();
                if lead.is_empty()
                    || lead.starts_with('{')
                    || lead.starts_with(PYTHON_TAG)
                    || PYTHON_TAG.starts_with(lead)
                {
                    0
                } else {
                    text.len()
                }
            }
        };
        text[..end].trim_end().len()
    }

    /// The grammar that makes the output calls (for `required` or a named
    /// function): the format's wrapping around each call's JSON schema; one
    /// call, or one or more where parallel calls are allowed.
    pub fn grammar(&self, tools: &Tools) -> Constraint {
        let arguments_key = match self.format {
            ToolFormat::Llama3Json => "parameters",
            _ => "arguments",
        };
        let mut schema = tools.call_schema(arguments_key);
        let several = tools.parallel && tools.callable().count() > 0;
        let grammar = match self.format {
            ToolFormat::Hermes => {
                compact(&mut schema);
                let start = if several { "call (\"\\n\" call)*" } else { "call" };
                format!("start: {start}\ncall: \"<tool_call>\\n\" body \"\\n</tool_call>\"\nbody: %json {schema}\n")
            }
            ToolFormat::Llama3Json => {
                compact(&mut schema);
                let start = if several { "body (\";\" body)*" } else { "body" };
                format!("start: {start}\nbody: %json {schema}\n")
            }
            ToolFormat::Mistral => {
                let mut array = json!({"type": "array", "items": schema, "minItems": 1});
                if !several {
                    array["maxItems"] = json!(1);
                }
                compact(&mut array);
                format!("start: \"[TOOL_CALLS]\" body\nbody: %json {array}\n")
            }
        };
        Constraint::Grammar { grammar }
    }

    /// A new call id: OpenAI's `call_` and 24 letters and digits, or Mistral's nine.
    fn new_id(&self) -> String {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let mut rng =
            SplitMix::new(nanos ^ NEXT.fetch_add(1, Ordering::Relaxed).rotate_left(32) ^ u64::from(std::process::id()));
        const ALPHABET: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
        let mut pick = |n: usize| -> String {
            (0..n)
                .map(|_| ALPHABET[(rng.next_u64() % ALPHABET.len() as u64) as usize] as char)
                .collect()
        };
        match self.format {
            ToolFormat::Mistral => pick(9),
            _ => format!("call_{}", pick(24)),
        }
    }
}

/// JSON inside a grammar generated without whitespace between tokens.
fn compact(schema: &mut Value) {
    if let Value::Object(fields) = schema {
        fields.insert("x-guidance".into(), json!({"whitespace_flexible": false}));
    }
}

/// A call's arguments as a JSON value (their text where it is not JSON).
fn arguments_value(call: &ToolCall) -> Value {
    serde_json::from_str(&call.arguments).unwrap_or_else(|_| json!(call.arguments))
}

/// Qwen2.5's system prompt for tools, which Hermes-format models follow.
fn hermes_system_prompt(tools: &Tools) -> String {
    let listed: Vec<String> = tools
        .template_json()
        .as_array()
        .map(|items| items.iter().map(crate::runtime::chat::python_json).collect())
        .unwrap_or_default();
    format!(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{}\n</tools>\n\n\
         For each function call, return a json object with function name and arguments within \
         <tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>",
        listed.join("\n")
    )
}

/// Where `marker` starts in `text`, or where a tail that could grow into it starts (else the end).
fn marker_free(text: &str, marker: &str) -> usize {
    if let Some(at) = text.find(marker) {
        return at;
    }
    (1..marker.len())
        .rev()
        .find(|&n| {
            n <= text.len() && text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..])
        })
        .map_or(text.len(), |n| text.len() - n)
}

/// Hermes blocks: every `<tool_call>…</tool_call>` from the first (the last
/// may be unclosed where the output ended), nothing but whitespace between.
fn hermes_bodies(text: &str) -> Option<(usize, Vec<Value>)> {
    let start = text.find(HERMES_OPEN)?;
    let mut rest = &text[start..];
    let mut bodies = Vec::new();
    while let Some(after) = rest.strip_prefix(HERMES_OPEN) {
        let (inner, next) = match after.find(HERMES_CLOSE) {
            Some(end) => (&after[..end], &after[end + HERMES_CLOSE.len()..]),
            None => (after, ""),
        };
        bodies.push(serde_json::from_str::<Value>(inner.trim()).ok()?);
        rest = next.trim_start();
    }
    rest.is_empty().then_some((start, bodies))
}

/// Llama 3.x: the whole output is calls, JSON objects joined by `;`.
fn llama_bodies(text: &str) -> Option<(usize, Vec<Value>)> {
    let lead = text.len() - text.trim_start().len();
    let body = text.trim_start();
    let body = body.strip_prefix(PYTHON_TAG).unwrap_or(body).trim_start();
    if !body.starts_with('{') {
        return None;
    }
    let mut bodies = Vec::new();
    let mut rest = body;
    while !rest.is_empty() {
        let mut stream = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let value = stream.next()?.ok()?;
        bodies.push(value);
        rest = rest[stream.byte_offset()..].trim_start();
        rest = rest.strip_prefix(';').unwrap_or(rest).trim_start();
    }
    Some((lead, bodies))
}

/// Mistral: `[TOOL_CALLS]` and a JSON array of calls (or one call); the
/// array alone where the tag, a special token, was decoded away.
fn mistral_bodies(text: &str) -> Option<(usize, Vec<Value>)> {
    let (start, body) = match text.find(MISTRAL_TAG) {
        Some(start) => (start, &text[start + MISTRAL_TAG.len()..]),
        None if text.trim_start().starts_with("[{") => (text.len() - text.trim_start().len(), text),
        None => return None,
    };
    let value: Value = serde_json::from_str(body.trim()).ok()?;
    let bodies = match value {
        Value::Array(items) => items,
        object @ Value::Object(_) => vec![object],
        _ => return None,
    };
    Some((start, bodies))
}
