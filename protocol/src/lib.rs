//! The contract between Lorry's serving crates and its engine.
//!
//! What a request is once it has passed the edge ([`ValidRequest`], made only
//! by [`input`]'s parsers), what an engine answers ([`Output`]), what a served
//! model accepts ([`ModelSpec`], gathered in a [`Catalog`]) and what a LoRA
//! adapter must look like ([`lora`]). Everything here is pure: no tensors, no
//! database, no network, so the API can check a request or an adapter before
//! it accepts it without linking the engine.

pub mod error;
pub mod input;
pub mod lora;
pub mod model;

use serde::{Deserialize, Serialize};

pub use error::ErrorCode;
pub use input::{InputError, ValidRequest};
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

/// The finished result of one request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Output {
    /// The model's response body, e.g. `{"response": "…"}`.
    pub body: serde_json::Value,
    /// Token accounting.
    pub usage: Usage,
    /// Generated token ids and why generation ended, from text-generation models.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion: Option<Completion>,
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
}

impl FinishReason {
    /// OpenAI's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}
