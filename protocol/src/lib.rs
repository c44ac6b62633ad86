//! The contract between Lorry's serving crates and its engine.
//!
//! What a request is once it has passed the edge ([`ValidRequest`], made only
//! by [`input`]'s parsers), what an engine answers ([`Output`]), what a served
//! model accepts ([`ModelSpec`], gathered in a [`Catalog`]) and what a LoRA
//! adapter must look like ([`lora`]). Everything here is pure: no tensors, no
//! database, no network, so the API can check a request or an adapter before
//! it accepts it without linking the engine.

pub mod constraint;
pub mod error;
pub mod input;
pub mod json;
pub mod lora;
pub mod model;
pub mod tools;

use serde::{Deserialize, Serialize};

pub use error::ErrorCode;
pub use input::{InputError, ValidRequest, MAX_CHOICES, MAX_TOP_LOGPROBS};
pub use model::{AdapterShape, Catalog, ModelSpec, ECHO_MODEL};

/// What a model does, which decides the input it accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    /// Returns its input's text: the pipeline's test and benchmark model.
    Echo,
    /// Text generation from a prompt or chat messages.
    TextGeneration,
    /// One normalised vector per input text.
    Embeddings,
}

/// Which lane a request arrived on; the real-time lane is always served first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Lane {
    /// Interactive traffic: admitted before anything on the batch lane.
    RealTime,
    /// Batch work: fills whatever capacity the real-time lane leaves.
    Batch,
}

/// Token accounting for one request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Tokens in the prompt, after any chat template.
    pub prompt_tokens: u32,
    /// Tokens generated.
    pub completion_tokens: u32,
}

impl Usage {
    /// `{"prompt_tokens", "completion_tokens", "total_tokens"}`: the usage
    /// object of every API shape, for one request or a batch's totals.
    pub fn json(prompt_tokens: i64, completion_tokens: i64) -> serde_json::Value {
        serde_json::json!({
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        })
    }

    /// [`Usage::json`] of this request.
    pub fn to_json(self) -> serde_json::Value {
        Usage::json(self.prompt_tokens.into(), self.completion_tokens.into())
    }
}

/// What a model produced for one request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Content {
    /// Generated text.
    Text(String),
    /// One vector per input text, pooled as `pooling` says.
    Embeddings {
        /// The vectors, in input order.
        vectors: Vec<Vec<f32>>,
        /// How token vectors became one.
        pooling: input::Pooling,
    },
}

impl Content {
    /// The generated text; empty for embeddings.
    pub fn text(&self) -> &str {
        match self {
            Content::Text(text) => text,
            Content::Embeddings { .. } => "",
        }
    }

    /// The result as a batch stores it and Workers AI answers it:
    /// `{"response": text}`, or `{"shape": [n, d], "data": [[…]], "pooling"}`.
    pub fn result_body(&self) -> serde_json::Value {
        match self {
            Content::Text(text) => serde_json::json!({ "response": text }),
            Content::Embeddings { vectors, pooling } => {
                let width = vectors.first().map_or(0, Vec::len);
                serde_json::json!({"shape": [vectors.len(), width], "data": vectors, "pooling": pooling})
            }
        }
    }

    /// A stored result read back: the inverse of [`Content::result_body`]
    /// (a body that is neither shape reads as empty text).
    pub fn from_result_body(body: &serde_json::Value) -> Content {
        if let Some(text) = body.get("response").and_then(serde_json::Value::as_str) {
            return Content::Text(text.to_string());
        }
        let pooling = body.get("pooling").and_then(|p| serde_json::from_value(p.clone()).ok());
        match (body.get("data"), pooling) {
            (Some(data), Some(pooling)) => Content::Embeddings {
                vectors: serde_json::from_value(data.clone()).unwrap_or_default(),
                pooling,
            },
            _ => Content::Text(String::new()),
        }
    }
}

/// The finished result of one request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Output {
    /// What the model produced.
    pub content: Content,
    /// Token accounting.
    pub usage: Usage,
    /// Generated token ids and why generation ended, from text-generation models.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion: Option<Completion>,
    /// Each generated token's log-probability, for requests that asked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<Vec<TokenLogprob>>,
    /// The choices after the first of a request that asked for `n` > 1
    /// (the first is the fields above; `usage` counts the prompt once and
    /// every choice's tokens).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub choices: Vec<Choice>,
    /// The tools the model called (its text is what it wrote besides them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<tools::ToolCall>,
}

/// One further choice of a request with `n` > 1.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Choice {
    /// Its text.
    pub text: String,
    /// Its tokens and why it ended.
    pub completion: Completion,
    /// Its tokens' log-probabilities, for requests that asked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<Vec<TokenLogprob>>,
    /// The tools it called.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<tools::ToolCall>,
}

/// One choice of an answer, the first or a further one, as the answer
/// shapes render them.
#[derive(Debug, Clone, Copy)]
pub struct ChoiceView<'a> {
    /// Its text.
    pub text: &'a str,
    /// Why it ended (`None`: a result with no token record, read as `stop`).
    pub finish_reason: Option<FinishReason>,
    /// Its tokens' log-probabilities, for requests that asked.
    pub logprobs: Option<&'a [TokenLogprob]>,
    /// The tools it called.
    pub tool_calls: &'a [tools::ToolCall],
}

impl Output {
    /// The result as a batch stores it: [`Content::result_body`], with
    /// `"logprobs"` (OpenAI's chat items) for requests that asked and
    /// `"tool_calls"` (Workers AI's `{"id", "name", "arguments"}`) for
    /// answers that called tools.
    pub fn result_body(&self) -> serde_json::Value {
        let mut body = self.content.result_body();
        if let Some(logprobs) = &self.logprobs {
            body["logprobs"] = serde_json::json!(logprobs);
        }
        if !self.tool_calls.is_empty() {
            body["tool_calls"] = tools::ToolCall::results_json(&self.tool_calls);
        }
        if !self.choices.is_empty() {
            // Every choice, the first included, as `{"index", "response", "finish_reason", "logprobs"?}`.
            let choices: Vec<serde_json::Value> = self
                .views()
                .iter()
                .enumerate()
                .map(|(index, c)| {
                    let mut choice = serde_json::json!({
                        "index": index,
                        "response": c.text,
                        "finish_reason": c.finish_reason.unwrap_or(FinishReason::Stop).as_str(),
                    });
                    if let Some(logprobs) = c.logprobs {
                        choice["logprobs"] = serde_json::json!(logprobs);
                    }
                    if !c.tool_calls.is_empty() {
                        choice["tool_calls"] = tools::ToolCall::results_json(c.tool_calls);
                    }
                    choice
                })
                .collect();
            body["choices"] = serde_json::Value::Array(choices);
        }
        body
    }

    /// Every choice, in order: the first (this output's own fields), then [`Output::choices`].
    pub fn views(&self) -> Vec<ChoiceView<'_>> {
        let first = ChoiceView {
            text: self.content.text(),
            finish_reason: self.completion.as_ref().map(|c| c.finish_reason),
            logprobs: self.logprobs.as_deref(),
            tool_calls: &self.tool_calls,
        };
        std::iter::once(first)
            .chain(self.choices.iter().map(|c| ChoiceView {
                text: &c.text,
                finish_reason: Some(c.completion.finish_reason),
                logprobs: c.logprobs.as_deref(),
                tool_calls: &c.tool_calls,
            }))
            .collect()
    }
}

/// One generated token's log-probability under the model, with the most
/// likely alternatives at its position: an item of OpenAI's chat
/// `logprobs.content`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    /// The token's text; a token that is not whole UTF-8 reads `bytes:` and its bytes escaped (`bytes:\xe2\x80`).
    pub token: String,
    /// The token's bytes.
    pub bytes: Vec<u8>,
    /// Its natural log-probability.
    #[serde(serialize_with = "decimal")]
    pub logprob: f32,
    /// The most likely tokens at its position, most likely first.
    #[serde(default)]
    pub top_logprobs: Vec<TopLogprob>,
}

/// One alternative at a position.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TopLogprob {
    /// See [`TokenLogprob::token`].
    pub token: String,
    /// The token's bytes.
    pub bytes: Vec<u8>,
    /// Its natural log-probability.
    #[serde(serialize_with = "decimal")]
    pub logprob: f32,
}

/// An f32 as the f64 of its shortest decimal (`-0.1`, not
/// `-0.10000000149011612`), so JSON carries the digits the value has.
fn shortest(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(x as f64)
}

fn decimal<S: serde::Serializer>(x: &f32, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_f64(shortest(*x))
}

impl TokenLogprob {
    /// The `token` string of `bytes`: their text where it is UTF-8, else
    /// `bytes:` and each byte as `\xNN`.
    pub fn spell(bytes: &[u8]) -> String {
        match std::str::from_utf8(bytes) {
            Ok(text) => text.to_string(),
            Err(_) => {
                let escaped: String = bytes.iter().map(|b| format!("\\x{b:02x}")).collect();
                format!("bytes:{escaped}")
            }
        }
    }

    /// A logprob as JSON can carry it: a non-finite one as −9999, as OpenAI reports the unlikeliest.
    pub fn finite(logprob: f32) -> f32 {
        if logprob.is_finite() {
            logprob
        } else {
            -9999.0
        }
    }

    /// These tokens as the legacy completions endpoint reports them:
    /// `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, each
    /// position's alternatives an object from token to logprob.
    pub fn legacy(items: &[TokenLogprob]) -> serde_json::Value {
        let mut offset = 0usize;
        let mut offsets = Vec::with_capacity(items.len());
        for item in items {
            offsets.push(offset);
            offset += item.token.chars().count();
        }
        let top: Vec<serde_json::Value> = items
            .iter()
            .map(|item| {
                let mut map = serde_json::Map::new();
                for alt in &item.top_logprobs {
                    map.entry(alt.token.clone())
                        .or_insert(serde_json::json!(shortest(alt.logprob)));
                }
                serde_json::Value::Object(map)
            })
            .collect();
        serde_json::json!({
            "tokens": items.iter().map(|i| i.token.as_str()).collect::<Vec<_>>(),
            "token_logprobs": items.iter().map(|i| shortest(i.logprob)).collect::<Vec<_>>(),
            "top_logprobs": top,
            "text_offset": offsets,
        })
    }
}

/// The token-level result of a text generation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Completion {
    /// Generated ids only (an end-of-sequence token included).
    pub token_ids: Vec<u32>,
    /// Why generation ended.
    pub finish_reason: FinishReason,
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// The end-of-sequence token or a stop string.
    Stop,
    /// `max_tokens`, or the model's context.
    Length,
    /// The model called tools.
    ToolCalls,
}

impl FinishReason {
    /// OpenAI's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::ToolCalls => "tool_calls",
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn item(token: &[u8], logprob: f32, top: &[(&str, f32)]) -> TokenLogprob {
        TokenLogprob {
            token: TokenLogprob::spell(token),
            bytes: token.to_vec(),
            logprob,
            top_logprobs: top
                .iter()
                .map(|&(t, l)| TopLogprob {
                    token: t.into(),
                    bytes: t.as_bytes().to_vec(),
                    logprob: l,
                })
                .collect(),
        }
    }

    #[test]
    fn tokens_that_are_not_whole_utf8_are_spelled_as_bytes() {
        assert_eq!(TokenLogprob::spell(b" the"), " the");
        assert_eq!(TokenLogprob::spell(&[0xe2, 0x80]), "bytes:\\xe2\\x80");
        assert_eq!(TokenLogprob::finite(f32::NEG_INFINITY), -9999.0);
        assert_eq!(TokenLogprob::finite(-1.5), -1.5);
    }

    #[test]
    fn the_legacy_shape_has_offsets_and_alternatives_by_token() {
        let items = [
            item(b"Hi", -0.5, &[("Hi", -0.5), ("Yo", -1.0)]),
            item("é".as_bytes(), -2.0, &[("a", -0.1)]),
            item(b"!", -0.25, &[]),
        ];
        assert_eq!(
            TokenLogprob::legacy(&items),
            json!({"tokens": ["Hi", "é", "!"], "token_logprobs": [-0.5, -2.0, -0.25],
                   "top_logprobs": [{"Hi": -0.5, "Yo": -1.0}, {"a": -0.1}, {}], "text_offset": [0, 2, 3]})
        );
    }

    #[test]
    fn a_result_body_carries_logprobs_only_where_asked() {
        let mut output = Output {
            content: Content::Text("Hi".into()),
            usage: Usage::default(),
            completion: None,
            logprobs: None,
            choices: Vec::new(),
            tool_calls: Vec::new(),
        };
        assert_eq!(output.result_body(), json!({"response": "Hi"}));
        output.logprobs = Some(vec![item(b"Hi", -0.5, &[])]);
        assert_eq!(
            output.result_body(),
            json!({"response": "Hi", "logprobs": [{"token": "Hi", "bytes": [72, 105], "logprob": -0.5, "top_logprobs": []}]})
        );
    }
}
