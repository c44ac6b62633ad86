//! The batch lifecycle and the shapes clients and workers exchange.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use lorry_engine::{ErrorCode, Usage};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::ids::{AccountId, BatchId};

/// Batch status, exactly OpenAI's Batch API lifecycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BatchStatus {
    /// Input is being validated (the OpenAI file flavour).
    Validating,
    /// Validation failed; nothing ran.
    Failed,
    /// Requests are being served.
    InProgress,
    /// Every request ended; the output is being written.
    Finalizing,
    /// Ended and written.
    Completed,
    /// The completion window passed; unstarted requests expired.
    Expired,
    /// Cancel asked; running requests finish.
    Cancelling,
    /// Cancelled and written.
    Cancelled,
}

impl BatchStatus {
    /// Every status, in lifecycle order.
    pub const ALL: [BatchStatus; 8] = [
        BatchStatus::Validating,
        BatchStatus::Failed,
        BatchStatus::InProgress,
        BatchStatus::Finalizing,
        BatchStatus::Completed,
        BatchStatus::Expired,
        BatchStatus::Cancelling,
        BatchStatus::Cancelled,
    ];

    /// The database and wire spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            BatchStatus::Validating => "validating",
            BatchStatus::Failed => "failed",
            BatchStatus::InProgress => "in_progress",
            BatchStatus::Finalizing => "finalizing",
            BatchStatus::Completed => "completed",
            BatchStatus::Expired => "expired",
            BatchStatus::Cancelling => "cancelling",
            BatchStatus::Cancelled => "cancelled",
        }
    }

    /// Parse the database spelling.
    pub fn parse(raw: &str) -> Option<Self> {
        serde_json::from_value(Value::String(raw.to_string())).ok()
    }

    /// Whether the batch has ended and its output is written.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            BatchStatus::Failed | BatchStatus::Completed | BatchStatus::Expired | BatchStatus::Cancelled
        )
    }
}

/// Request status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RequestStatus {
    /// Accepted, not yet started.
    Pending,
    /// A worker holds it.
    Running,
    /// Ended with a response.
    Succeeded,
    /// Ended with an error.
    Errored,
    /// Cancelled before it started.
    Canceled,
    /// The window passed before it started.
    Expired,
}

impl RequestStatus {
    /// Every status, in the order counts are shown.
    pub const ALL: [RequestStatus; 6] = [
        RequestStatus::Pending,
        RequestStatus::Running,
        RequestStatus::Succeeded,
        RequestStatus::Errored,
        RequestStatus::Canceled,
        RequestStatus::Expired,
    ];

    /// The database and wire spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            RequestStatus::Pending => "pending",
            RequestStatus::Running => "running",
            RequestStatus::Succeeded => "succeeded",
            RequestStatus::Errored => "errored",
            RequestStatus::Canceled => "canceled",
            RequestStatus::Expired => "expired",
        }
    }

    /// Parse the database spelling.
    pub fn parse(raw: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.as_str() == raw)
    }
}

/// Which API shape created a batch, which decides how it is reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// `/v1/batches`.
    Native,
    /// `/client/v4/accounts/{id}/ai/run/{model}` with `queueRequest`.
    WorkersAi,
    /// `/v1/batches` with an `input_file_id` (OpenAI's Batch API).
    OpenAi,
}

impl Shape {
    /// The database spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Shape::Native => "native",
            Shape::WorkersAi => "workers_ai",
            Shape::OpenAi => "openai",
        }
    }
}

/// Per-status request counts and token usage of one batch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tally {
    /// Requests per status.
    pub counts: BTreeMap<RequestStatus, i64>,
    /// Prompt tokens over finished requests.
    pub prompt_tokens: i64,
    /// Completion tokens over finished requests.
    pub completion_tokens: i64,
}

impl Tally {
    /// How many requests are in a status.
    pub fn count(&self, status: RequestStatus) -> i64 {
        self.counts.get(&status).copied().unwrap_or(0)
    }

    /// Whether any request has started (the Workers AI `running` state).
    pub fn any_started(&self) -> bool {
        self.count(RequestStatus::Pending) < self.counts.values().sum::<i64>()
    }

    fn request_counts(&self) -> Value {
        let failed = self.count(RequestStatus::Errored)
            + self.count(RequestStatus::Canceled)
            + self.count(RequestStatus::Expired);
        let mut counts = serde_json::Map::new();
        counts.insert("total".into(), json!(self.counts.values().sum::<i64>()));
        counts.insert("completed".into(), json!(self.count(RequestStatus::Succeeded)));
        counts.insert("failed".into(), json!(failed));
        for status in RequestStatus::ALL {
            counts.insert(status.as_str().into(), json!(self.count(status)));
        }
        Value::Object(counts)
    }

    fn usage(&self) -> Value {
        Usage::json(self.prompt_tokens, self.completion_tokens)
    }
}

/// A batch as stored.
#[derive(Debug, Clone)]
pub struct Batch {
    /// Its id.
    pub id: BatchId,
    /// The owning account.
    pub account_id: AccountId,
    /// The served model name.
    pub model: String,
    /// The API shape that created it.
    pub shape: Shape,
    /// For a batch made from a file: OpenAI's fields.
    pub openai: Option<OpenAiBatch>,
    /// Lifecycle status.
    pub status: BatchStatus,
    /// `cancelled` or `expired` once either was asked.
    pub end_reason: Option<String>,
    /// Number of requests.
    pub total: i32,
    /// The window as given, e.g. `24h`.
    pub completion_window: String,
    /// Client metadata.
    pub metadata: Option<Value>,
    /// Where the completion webhook goes.
    pub webhook_url: Option<String>,
    /// The S3 key of `output.jsonl`, once written.
    pub output_key: Option<String>,
    /// The S3 key of `errors.jsonl`, once written.
    pub errors_key: Option<String>,
    /// Lifecycle timestamps.
    pub times: BatchTimes,
    /// Among the account's own batches, higher goes out first.
    pub priority: i16,
}

/// OpenAI's fields of a batch made from a batch file, stored with it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpenAiBatch {
    /// The route every line targets (`/v1/chat/completions`, …).
    pub endpoint: String,
    /// The uploaded file the requests came from.
    pub input_file_id: String,
    /// The model as the lines named it (`base` or `base:adapter`).
    pub model: String,
    /// The output file, once the batch has ended with any success.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_file_id: Option<String>,
    /// The error file, once the batch has ended with any failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_file_id: Option<String>,
    /// OpenAI's `output_expires_after.seconds`: the output and error files
    /// expire this long after they are made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_expires_after: Option<u64>,
}

/// A batch's lifecycle timestamps, read from a row by their column names.
#[derive(Debug, Clone, sqlx::FromRow)]
#[allow(missing_docs)]
pub struct BatchTimes {
    pub created_at: DateTime<Utc>,
    pub in_progress_at: Option<DateTime<Utc>>,
    pub expires_at: DateTime<Utc>,
    pub finalizing_at: Option<DateTime<Utc>>,
    pub completed_at: Option<DateTime<Utc>>,
    pub failed_at: Option<DateTime<Utc>>,
    pub expired_at: Option<DateTime<Utc>>,
    pub cancelling_at: Option<DateTime<Utc>>,
    pub cancelled_at: Option<DateTime<Utc>>,
}

fn unix(t: Option<DateTime<Utc>>) -> Value {
    t.map_or(Value::Null, |t| json!(t.timestamp()))
}

impl Batch {
    /// The batch object clients see (OpenAI's shape plus Lorry's counts).
    pub fn to_json(&self, tally: &Tally, output_url: Option<String>, errors_url: Option<String>) -> Value {
        let t = &self.times;
        let mut value = json!({
            "id": self.id,
            "object": "batch",
            "model": self.model,
            "status": self.status,
            "completion_window": self.completion_window,
            "request_counts": tally.request_counts(),
            "usage": tally.usage(),
            "created_at": t.created_at.timestamp(),
            "in_progress_at": unix(t.in_progress_at),
            "expires_at": t.expires_at.timestamp(),
            "finalizing_at": unix(t.finalizing_at),
            "completed_at": unix(t.completed_at),
            "failed_at": unix(t.failed_at),
            "expired_at": unix(t.expired_at),
            "cancelling_at": unix(t.cancelling_at),
            "cancelled_at": unix(t.cancelled_at),
            "output_url": output_url,
            "errors_url": errors_url,
            "metadata": self.metadata.clone().unwrap_or(Value::Null),
            "priority": self.priority,
        });
        // OpenAI's fields for a batch made from a file.
        if let (Some(openai), Some(map)) = (&self.openai, value.as_object_mut()) {
            map.insert("endpoint".into(), json!(openai.endpoint));
            map.insert("input_file_id".into(), json!(openai.input_file_id));
            map.insert("model".into(), json!(openai.model));
            map.insert("output_file_id".into(), json!(openai.output_file_id));
            map.insert("error_file_id".into(), json!(openai.error_file_id));
            map.insert("errors".into(), Value::Null);
        }
        value
    }
}

/// A failed request's error, as clients see it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestError {
    /// Error class, e.g. `model_error`, `expired`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Stable code.
    pub code: String,
    /// Human-readable message.
    pub message: String,
    /// Whether submitting the same request again could succeed.
    pub retryable: bool,
}

/// One finished request, as stored.
#[derive(Debug, Clone)]
pub struct FinishedRequest {
    /// Position in the batch.
    pub index: i32,
    /// The client's id, if any.
    pub custom_id: Option<String>,
    /// Terminal status.
    pub status: RequestStatus,
    /// The model's response body, when it succeeded.
    pub response: Option<Value>,
    /// Why a generation ended (`stop`, `length`).
    pub finish_reason: Option<String>,
    /// The error, when it did not.
    pub error: Option<RequestError>,
    /// Tokens.
    pub prompt_tokens: i32,
    /// Tokens.
    pub completion_tokens: i32,
}

impl FinishedRequest {
    /// The native results line (`/v1/batches/{id}/results`, `output.jsonl`).
    pub fn result_line(&self, batch: &BatchId) -> Value {
        json!({
            "id": format!("{batch}-{}", self.index),
            "custom_id": self.custom_id,
            "index": self.index,
            "status": self.status,
            "response": self.response.as_ref().map(|body| json!({"status_code": 200, "body": body})),
            "error": self.error,
            "usage": Usage::json(self.prompt_tokens.into(), self.completion_tokens.into()),
        })
    }
}

/// The error written for requests that end without running.
pub fn unstarted_error(status: RequestStatus) -> RequestError {
    let (code, message) = match status {
        RequestStatus::Canceled => (
            ErrorCode::BatchCancelled,
            "the batch was cancelled before this request started",
        ),
        _ => (
            ErrorCode::BatchExpired,
            "the completion window passed before this request started",
        ),
    };
    RequestError {
        kind: status.as_str().to_string(),
        code: code.as_str().to_string(),
        message: message.to_string(),
        retryable: true,
    }
}

/// A unit of batch work on the broker: a contiguous range of one batch's requests.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Chunk {
    /// The batch.
    pub batch_id: BatchId,
    /// The account that owns it.
    pub account_id: AccountId,
    /// The model it runs on.
    pub model: String,
    /// First request index, inclusive.
    pub start: i32,
    /// Last request index, exclusive.
    pub end: i32,
    /// Chunks of the same account's still held back for dispatch on its lane
    /// when this one was published (the fair dispatch stamps it): the engine
    /// counts them in the account's backlog, so that an account whose whole
    /// batch is in the workers is told from one draining a large batch.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub behind: u32,
}

/// For `skip_serializing_if`: a count left out of a message when it is 0.
pub(crate) fn is_zero(n: &u32) -> bool {
    *n == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_round_trip_through_their_spelling() {
        for s in RequestStatus::ALL {
            assert_eq!(RequestStatus::parse(s.as_str()), Some(s));
        }
        assert_eq!(BatchStatus::parse("in_progress"), Some(BatchStatus::InProgress));
        assert_eq!(BatchStatus::parse("done"), None);
    }

    #[test]
    fn counts_follow_openai_and_add_lorrys_own() {
        let mut tally = Tally::default();
        tally.counts.insert(RequestStatus::Succeeded, 3);
        tally.counts.insert(RequestStatus::Errored, 1);
        tally.counts.insert(RequestStatus::Expired, 2);
        let counts = tally.request_counts();
        assert_eq!(counts["total"], 6);
        assert_eq!(counts["completed"], 3);
        assert_eq!(counts["failed"], 3);
        assert_eq!(counts["pending"], 0);
        assert!(tally.any_started());
    }
}
