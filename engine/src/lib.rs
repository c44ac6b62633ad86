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
pub mod fuzzing;
pub mod lora;
pub mod models;
pub mod ops;
pub mod runtime;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::mpsc;

pub use adapters::AdapterRef;
pub use runtime::text_engine::{Counters, EngineConfig, TextEngine};

pub use catalog::ECHO_MODEL;
pub use lorry_protocol::{
    constraint, input, tools, AdapterShape, Catalog, Choice, ChoiceView, Completion, Content, ErrorCode, FinishReason,
    InputError, Lane, ModelSpec, Output, Task, TokenLogprob, TopLogprob, Usage, ValidRequest,
};

/// What a backend reports while serving one request.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A piece of generated text, in order.
    Token {
        /// The text.
        text: String,
        /// Its tokens' log-probabilities, for requests that asked (else empty).
        logprobs: Vec<TokenLogprob>,
        /// Which choice it belongs to (0 but for requests with `n` > 1).
        choice: u32,
    },
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
    /// The request's reader left [`MAX_UNREAD_EVENTS`] unread; the engine
    /// dropped the request rather than hold more for it.
    #[error("the reader of this stream fell too far behind; the request was dropped")]
    Overrun,
}

impl EngineError {
    /// Whether running the same request again could succeed.
    pub fn retryable(&self) -> bool {
        matches!(
            self,
            EngineError::Stopped | EngineError::Unavailable(_) | EngineError::Overrun
        )
    }

    /// A stable machine-readable code.
    pub fn code(&self) -> ErrorCode {
        match self {
            EngineError::Stopped => ErrorCode::EngineStopped,
            EngineError::Input(e) => e.code,
            EngineError::Model(_) => ErrorCode::ModelError,
            EngineError::Unavailable(_) => ErrorCode::ServiceUnavailable,
            EngineError::Overrun => ErrorCode::ServiceUnavailable,
        }
    }
}

/// The most events a request's reader may leave unread. An engine never
/// waits for a reader (one engine step serves every sequence), so a stream
/// whose reader falls further behind (a worker that cannot publish) is ended
/// instead: its sequence is dropped and its last event is
/// [`EngineError::Overrun`]. What an engine holds for one request is bounded
/// by this, not by the request's `max_tokens`.
pub const MAX_UNREAD_EVENTS: usize = 1024;

/// The events of one request, in order; dropping it cancels the request.
#[derive(Debug)]
pub struct EventStream {
    events: mpsc::UnboundedReceiver<Event>,
    unread: Arc<AtomicUsize>,
}

impl EventStream {
    /// The next event, or `None` once the engine has dropped the request.
    pub async fn recv(&mut self) -> Option<Event> {
        let event = self.events.recv().await;
        if event.is_some() {
            self.unread.fetch_sub(1, Ordering::AcqRel);
        }
        event
    }

    /// The next event if one is waiting, without waiting.
    pub fn try_recv(&mut self) -> Result<Event, mpsc::error::TryRecvError> {
        let event = self.events.try_recv()?;
        self.unread.fetch_sub(1, Ordering::AcqRel);
        Ok(event)
    }
}

/// Where an engine sends one request's events.
#[derive(Debug, Clone)]
pub struct Events {
    events: mpsc::UnboundedSender<Event>,
    unread: Arc<AtomicUsize>,
}

impl Events {
    /// Send an event; false when the reader has gone (the request is cancelled).
    pub fn send(&self, event: Event) -> bool {
        self.unread.fetch_add(1, Ordering::AcqRel);
        let sent = self.events.send(event).is_ok();
        if !sent {
            self.unread.fetch_sub(1, Ordering::AcqRel);
        }
        sent
    }

    /// Whether the reader has gone.
    pub fn is_closed(&self) -> bool {
        self.events.is_closed()
    }

    /// Waits until the reader has gone.
    pub async fn closed(&self) {
        self.events.closed().await
    }

    /// How many events sent the reader has not taken yet.
    pub fn unread(&self) -> usize {
        self.unread.load(Ordering::Acquire)
    }
}

/// A request's event channel: the engine's end and the reader's.
pub fn event_channel() -> (Events, EventStream) {
    let (events, stream) = mpsc::unbounded_channel();
    let unread = Arc::new(AtomicUsize::new(0));
    (
        Events {
            events,
            unread: Arc::clone(&unread),
        },
        EventStream { events: stream, unread },
    )
}

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
    /// Whose share of the engine the request counts against (an account):
    /// when several accounts' batch sequences wait, the account with the
    /// fewest running is admitted first (an account with a smaller backlog
    /// than the largest counts its running ones at half), so one account's
    /// many queued requests do not hold up another's. `None` is an account
    /// of its own.
    pub account: Option<String>,
    /// Requests of the same account held elsewhere, not yet handed to this
    /// engine (a dispatcher's backlog): counted in the account's backlog
    /// beside those running and waiting here, the latest figure an
    /// account's request brought standing for the account.
    pub backlog: usize,
    /// The span the request's work belongs to: an engine records its
    /// sequence under it, and each step the sequence took part in.
    pub span: tracing::Span,
}

impl Request {
    /// A request on the base model.
    pub fn new(input: ValidRequest, lane: Lane) -> Self {
        Request {
            input,
            lane,
            adapter: None,
            cache_partition: None,
            account: None,
            backlog: 0,
            span: tracing::Span::none(),
        }
    }

    /// The same request, traced under `span`.
    pub fn in_span(self, span: tracing::Span) -> Self {
        Request { span, ..self }
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

    /// The same request, counted against `account`'s share of the engine.
    pub fn for_account(self, account: Option<String>) -> Self {
        Request { account, ..self }
    }

    /// The same request, with `backlog` of its account's requests held elsewhere ([`Request::backlog`]).
    pub fn with_backlog(self, backlog: usize) -> Self {
        Request { backlog, ..self }
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
            Event::Token { .. } => {}
            Event::Finished(output) => return Ok(output),
            Event::Failed(error) => return Err(error),
        }
    }
    Err(EngineError::Stopped)
}
