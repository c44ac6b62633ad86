//! Lorry's inference engine, behind the narrow seam the batcher uses.
//!
//! The seam follows text-generation-inference's `Backend`: the caller hands a
//! [`ValidRequest`] to a [`Backend`] and gets back a stream of [`Event`]s. The
//! caller never sees a batch or a tensor, and this crate knows nothing of HTTP,
//! Postgres, RabbitMQ or S3.
//!
//! The request and output types, and input validation, are
//! [`lorry_protocol`]'s, re-exported here: the API links that crate, not this one.

pub mod adapters;
pub mod catalog;
pub mod fixtures;
pub mod lora;
pub mod models;
pub mod ops;
pub mod runtime;

use tokio::sync::mpsc;

pub use adapters::AdapterRef;
pub use runtime::text_engine::{Counters, EngineConfig, TextEngine};

pub use catalog::ECHO_MODEL;
pub use lorry_protocol::{
    input, AdapterShape, Catalog, Completion, Content, ErrorCode, FinishReason, InputError, Lane, ModelSpec, Output,
    Task, Usage, ValidRequest,
};

/// What a backend reports while serving one request.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A piece of generated text, in order.
    Token(String),
    /// The request finished; the last event on a successful stream.
    Finished(Output),
    /// The request failed; the last event on a failed stream.
    Failed(EngineError),
}

/// Errors that end one request (never the process).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    /// The engine has shut down and accepts no more work; another worker may succeed.
    #[error("the engine has stopped")]
    Stopped,
    /// The request was valid at the edge but the model cannot serve it.
    #[error("invalid input: {0}")]
    Input(#[from] InputError),
    /// The model failed while serving the request.
    #[error("model failure: {0}")]
    Model(String),
    /// Something the request needs (its adapter's files) could not be had
    /// just now; the request was not run, and may be delivered again.
    #[error("unavailable: {0}")]
    Unavailable(String),
}

impl EngineError {
    /// Whether running the same request again could succeed.
    pub fn retryable(&self) -> bool {
        matches!(self, EngineError::Stopped | EngineError::Unavailable(_))
    }

    /// A stable machine-readable code.
    pub fn code(&self) -> ErrorCode {
        match self {
            EngineError::Stopped => ErrorCode::EngineStopped,
            EngineError::Input(e) => e.code,
            EngineError::Model(_) => ErrorCode::ModelError,
            EngineError::Unavailable(_) => ErrorCode::ServiceUnavailable,
        }
    }
}

/// The events of one request, in order; dropping it cancels the request.
pub type EventStream = mpsc::UnboundedReceiver<Event>;

/// What a backend is asked to run: a validated request, its lane, and the
/// adapter it runs with (whose files the engine fetches, checks and packs
/// itself; see [`adapters`]).
#[derive(Debug, Clone)]
pub struct Request {
    /// The request as the API validated it.
    pub input: ValidRequest,
    /// Batch or real time.
    pub lane: Lane,
    /// The adapter `input` names, resolved to its files.
    pub adapter: Option<AdapterRef>,
    /// Whose prefix-cache blocks the request may reuse: blocks computed for
    /// one partition (an account) are never reused by another, so a
    /// request's speed tells nothing of what another tenant sent. `None`
    /// is a partition of its own, shared by every request without one.
    pub cache_partition: Option<String>,
}

impl Request {
    /// A request on the base model.
    pub fn new(input: ValidRequest, lane: Lane) -> Self {
        Request {
            input,
            lane,
            adapter: None,
            cache_partition: None,
        }
    }

    /// The same request with an adapter.
    pub fn with_adapter(self, adapter: Option<AdapterRef>) -> Self {
        Request { adapter, ..self }
    }

    /// The same request in prefix-cache partition `partition`.
    pub fn in_cache_partition(self, partition: Option<String>) -> Self {
        Request {
            cache_partition: partition,
            ..self
        }
    }

    /// The refusal a backend that serves no adapters gives a request that
    /// names one; `Ok` when it names none.
    pub fn without_adapter(&self, model: &str) -> Result<(), EngineError> {
        match (&self.adapter, &self.input.lora) {
            (None, None) => Ok(()),
            _ => Err(EngineError::Input(lorry_protocol::model::no_adapters(
                model,
                self.input.adapter_field.as_str(),
            ))),
        }
    }
}

/// A model being served; cheap to share between tasks.
pub trait Backend: Send + Sync + 'static {
    /// The served model name, e.g. `@lorry/echo`.
    fn model(&self) -> &str;
    /// Queue a request; its events arrive on the returned stream.
    fn submit(&self, request: Request) -> Result<EventStream, EngineError>;
}

/// Drain a stream to its final result.
pub async fn collect(mut events: EventStream) -> Result<Output, EngineError> {
    while let Some(event) = events.recv().await {
        match event {
            Event::Token(_) => {}
            Event::Finished(output) => return Ok(output),
            Event::Failed(error) => return Err(error),
        }
    }
    Err(EngineError::Stopped)
}
