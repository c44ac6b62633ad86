//! Every error a client can be told, as one stable code.
//!
//! Codes cross process boundaries as this type (serialised as their
//! `snake_case` name), never as free text; the API's `error.rs` is the one
//! place that maps each to an HTTP status.

use std::fmt;

use serde::{Deserialize, Serialize};

macro_rules! error_codes {
    ($($(#[doc = $doc:literal])* $variant:ident = $text:literal,)*) => {
        /// A stable, machine-readable error code.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
        pub enum ErrorCode {
            $($(#[doc = $doc])* #[serde(rename = $text)] $variant,)*
        }

        impl ErrorCode {
            /// Every code.
            pub const ALL: &'static [ErrorCode] = &[$(ErrorCode::$variant,)*];

            /// The code as clients see it, e.g. `unknown_field`.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(ErrorCode::$variant => $text,)*
                }
            }
        }
    };
}

error_codes! {
    // A request body or a field of it.
    /// A field of the wrong JSON type.
    InvalidType = "invalid_type",
    /// A field whose value is not allowed.
    InvalidValue = "invalid_value",
    /// A required field is absent.
    MissingField = "missing_field",
    /// A field this route does not take.
    UnknownField = "unknown_field",
    /// Two fields that exclude each other.
    ConflictingFields = "conflicting_fields",
    /// A number outside its range.
    OutOfRange = "out_of_range",
    /// A chat without messages.
    EmptyMessages = "empty_messages",
    /// A prompt that renders to no tokens.
    EmptyPrompt = "empty_prompt",
    /// A prompt (with `max_tokens`) longer than the model's context.
    ContextLengthExceeded = "context_length_exceeded",
    /// The model's chat template failed on these messages.
    TemplateError = "template_error",
    /// A token id outside the model's vocabulary.
    TokenOutOfVocabulary = "token_out_of_vocabulary",
    /// An OpenAI parameter Lorry does not serve.
    UnsupportedParameter = "unsupported_parameter",
    /// The body is not JSON.
    InvalidJson = "invalid_json",
    /// The body could not be read.
    UnreadableBody = "unreadable_body",
    /// The body did not arrive in time.
    BodyTimeout = "body_timeout",
    /// The body is over the size limit.
    BodyTooLarge = "body_too_large",
    /// A multipart body that could not be read.
    InvalidMultipart = "invalid_multipart",
    /// A multipart field given twice.
    DuplicateField = "duplicate_field",
    /// A string holding U+0000, which Lorry does not store.
    NulCharacter = "nul_character",
    /// A request of a kind this version does not know (a code from a newer peer).
    InvalidRequest = "invalid_request",
    /// A JSON schema (of `response_format` or a guided field) that cannot be served.
    InvalidSchema = "invalid_schema",
    /// A regular expression, choice or grammar that cannot be served.
    InvalidGrammar = "invalid_grammar",
    /// A constraint whose token masks ran past their limits while generating.
    ConstraintTooComplex = "constraint_too_complex",

    // Models and adapters.
    /// No model of that name is served.
    ModelNotFound = "model_not_found",
    /// The model does not do what this route asks (embeddings on a chat route).
    ModelTaskMismatch = "model_task_mismatch",
    /// The model takes no LoRA adapters.
    AdaptersNotSupported = "adapters_not_supported",
    /// No adapter of that name or id in this account.
    AdapterNotFound = "adapter_not_found",
    /// The adapter is for another model.
    AdapterModelMismatch = "adapter_model_mismatch",
    /// The adapter's files are not both uploaded and checked yet.
    AdapterNotReady = "adapter_not_ready",
    /// Another adapter of this account has the name.
    AdapterNameTaken = "adapter_name_taken",
    /// An adapter name outside the allowed characters or length.
    InvalidAdapterName = "invalid_adapter_name",
    /// An adapter file that is neither of the two PEFT files.
    InvalidFileName = "invalid_file_name",
    /// `adapter_config.json` is not valid.
    AdapterConfigInvalid = "adapter_config_invalid",
    /// An adapter file is missing.
    AdapterMissingFile = "adapter_missing_file",
    /// A LoRA tensor is missing.
    AdapterMissingTensor = "adapter_missing_tensor",
    /// A LoRA tensor holds a NaN or an infinity.
    AdapterNonfinite = "adapter_nonfinite",
    /// An adapter value (alpha, a weight, the update they make) outside what is served.
    AdapterValueOutOfRange = "adapter_value_out_of_range",
    /// A module's rank is over the limit (or zero).
    AdapterRankTooLarge = "adapter_rank_too_large",
    /// A LoRA tensor does not fit the base model.
    AdapterShapeMismatch = "adapter_shape_mismatch",
    /// `adapter_model.safetensors` is over the size limit.
    AdapterTooLarge = "adapter_too_large",
    /// A target outside the seven projections.
    AdapterUnknownTarget = "adapter_unknown_target",
    /// A PEFT option Lorry does not serve.
    AdapterUnsupported = "adapter_unsupported",
    /// `adapter_model.safetensors` is not valid.
    AdapterWeightsInvalid = "adapter_weights_invalid",

    // Batches and files.
    /// No batch of that id in this account.
    BatchNotFound = "batch_not_found",
    /// The batch has already ended.
    BatchNotCancellable = "batch_not_cancellable",
    /// The batch has not ended, so it cannot be deleted.
    BatchNotEnded = "batch_not_ended",
    /// A batch without requests.
    EmptyBatch = "empty_batch",
    /// More requests than a batch may hold.
    TooManyRequests = "too_many_requests",
    /// A `custom_id` given twice in one batch.
    DuplicateCustomId = "duplicate_custom_id",
    /// A completion window Lorry does not take.
    InvalidCompletionWindow = "invalid_completion_window",
    /// An `Idempotency-Key` header Lorry does not take.
    InvalidIdempotencyKey = "invalid_idempotency_key",
    /// An `Idempotency-Key` reused with a different body.
    IdempotencyKeyReused = "idempotency_key_reused",
    /// Metadata outside the allowed shape.
    InvalidMetadata = "invalid_metadata",
    /// A webhook URL that does not parse.
    InvalidWebhookUrl = "invalid_webhook_url",
    /// A webhook URL to a destination the deployment does not allow.
    WebhookUrlNotAllowed = "webhook_url_not_allowed",
    /// No file of that id in this account.
    FileNotFound = "file_not_found",
    /// A file over the size limit.
    FileTooLarge = "file_too_large",
    /// A file without lines.
    EmptyFile = "empty_file",
    /// A file whose contents are not what its purpose needs.
    InvalidFile = "invalid_file",
    /// A file purpose Lorry does not take.
    InvalidFilePurpose = "invalid_file_purpose",
    /// The lines of a batch file name another model than the rest.
    ModelMismatch = "model_mismatch",
    /// The lines of a batch file name another endpoint than the batch.
    EndpointMismatch = "endpoint_mismatch",

    // Who is asking, and where.
    /// A missing or unknown API token.
    InvalidToken = "invalid_token",
    /// The account in the path is not the caller's.
    AccountNotFound = "account_not_found",
    /// No such route.
    RouteNotFound = "route_not_found",
    /// An account name outside the allowed characters or length (admin routes).
    InvalidAccountName = "invalid_account_name",
    /// An account of that name exists (admin routes).
    AccountExists = "account_exists",
    /// The account's batches have not all ended, so it cannot be deleted yet (admin routes).
    AccountBusy = "account_busy",
    /// The account has no API key of that id (admin routes).
    KeyNotFound = "key_not_found",
    /// The route does not take this method.
    MethodNotAllowed = "method_not_allowed",
    /// A path and query string over the longest the API reads.
    UriTooLong = "uri_too_long",

    // Serving.
    /// The real-time lane of this model is full.
    RealtimeLaneSaturated = "realtime_lane_saturated",
    /// The account's batch requests not yet ended would pass its limit.
    QuotaQueuedRequests = "quota_queued_requests",
    /// The account's real-time requests a second are over its limit.
    QuotaRealtimeRate = "quota_realtime_rate",
    /// The account's stored files would pass its limit in bytes.
    QuotaFileBytes = "quota_file_bytes",
    /// The account holds the most adapters it may.
    QuotaAdapters = "quota_adapters",
    /// No worker answered a real-time request in time.
    RealtimeTimeout = "realtime_timeout",
    /// A backing service (Postgres, RabbitMQ, S3) is unavailable.
    ServiceUnavailable = "service_unavailable",
    /// The engine failed a request it had accepted.
    InferenceFailed = "inference_failed",
    /// A failure inside Lorry.
    InternalError = "internal_error",
    /// The engine had stopped; another worker may serve the request.
    EngineStopped = "engine_stopped",
    /// The model failed while serving the request.
    ModelError = "model_error",
    /// The request's message was delivered the most times allowed.
    DeliveryLimitExceeded = "delivery_limit_exceeded",
    /// The batch was cancelled before the request started.
    BatchCancelled = "batch_cancelled",
    /// The completion window passed before the request started.
    BatchExpired = "batch_expired",
}

impl ErrorCode {
    /// The code spelled `text`, if this version knows it.
    pub fn parse(text: &str) -> Option<Self> {
        ErrorCode::ALL.iter().copied().find(|c| c.as_str() == text)
    }

    /// Whether the same request could succeed if sent again unchanged.
    pub fn retryable(self) -> bool {
        matches!(
            self,
            ErrorCode::RealtimeLaneSaturated
                | ErrorCode::RealtimeTimeout
                | ErrorCode::ServiceUnavailable
                | ErrorCode::EngineStopped
                | ErrorCode::BatchCancelled
                | ErrorCode::BatchExpired
        )
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PartialEq<&str> for ErrorCode {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_round_trips_through_its_name_and_json() {
        let mut seen = std::collections::HashSet::new();
        for &code in ErrorCode::ALL {
            assert!(seen.insert(code.as_str()), "{code} is spelled twice");
            assert_eq!(ErrorCode::parse(code.as_str()), Some(code));
            let json = serde_json::to_string(&code).unwrap();
            assert_eq!(json, format!("\"{code}\""));
            assert_eq!(serde_json::from_str::<ErrorCode>(&json).unwrap(), code);
        }
        assert_eq!(ErrorCode::parse("no_such_code"), None);
    }
}
