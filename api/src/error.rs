//! Errors as clients see them, mapped to HTTP in exactly this one place.
//!
//! Every error has a stable [`ErrorCode`], and `param` names the field at
//! fault: `{"error":{"type","code","message","param"}}`. [`status`] is the
//! one table from codes to HTTP statuses; every error body, the Workers AI
//! envelope and both streaming shapes' error events are renderings of
//! [`ApiError`]. Internal failures are logged here and answered with a
//! generic message.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use lorry_batcher::BatcherError;
use lorry_protocol::{ErrorCode, InputError};
use serde_json::json;

/// The HTTP status of every code.
pub fn status(code: ErrorCode) -> StatusCode {
    use ErrorCode::*;
    match code {
        InvalidType
        | InvalidValue
        | MissingField
        | UnknownField
        | ConflictingFields
        | OutOfRange
        | EmptyMessages
        | EmptyPrompt
        | ContextLengthExceeded
        | TemplateError
        | TokenOutOfVocabulary
        | UnsupportedParameter
        | InvalidJson
        | NulCharacter
        | UnreadableBody
        | InvalidMultipart
        | DuplicateField
        | InvalidRequest
        | InvalidSchema
        | InvalidGrammar
        | ConstraintTooComplex
        | ModelTaskMismatch
        | AdaptersNotSupported
        | AdapterModelMismatch
        | InvalidAdapterName
        | InvalidFileName
        | AdapterConfigInvalid
        | AdapterMissingFile
        | AdapterMissingTensor
        | AdapterNonfinite
        | AdapterValueOutOfRange
        | AdapterRankTooLarge
        | AdapterShapeMismatch
        | AdapterUnknownTarget
        | AdapterUnsupported
        | AdapterWeightsInvalid
        | EmptyBatch
        | TooManyRequests
        | DuplicateCustomId
        | InvalidCompletionWindow
        | InvalidIdempotencyKey
        | InvalidMetadata
        | InvalidWebhookUrl
        | WebhookUrlNotAllowed
        | EmptyFile
        | InvalidFile
        | InvalidFilePurpose
        | ModelMismatch
        | EndpointMismatch
        | InvalidAccountName => StatusCode::BAD_REQUEST,
        InvalidToken => StatusCode::UNAUTHORIZED,
        MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
        UriTooLong => StatusCode::URI_TOO_LONG,
        ModelNotFound | AdapterNotFound | BatchNotFound | FileNotFound | AccountNotFound | RouteNotFound
        | KeyNotFound => StatusCode::NOT_FOUND,
        AdapterNameTaken | AdapterNotReady | BatchNotCancellable | BatchNotEnded | IdempotencyKeyReused
        | AccountExists | AccountBusy => StatusCode::CONFLICT,
        BodyTooLarge | AdapterTooLarge | FileTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
        BodyTimeout => StatusCode::REQUEST_TIMEOUT,
        RealtimeLaneSaturated | QuotaQueuedRequests | QuotaRealtimeRate | QuotaFileBytes | QuotaAdapters => {
            StatusCode::TOO_MANY_REQUESTS
        }
        RealtimeTimeout => StatusCode::GATEWAY_TIMEOUT,
        ServiceUnavailable | EngineStopped => StatusCode::SERVICE_UNAVAILABLE,
        InferenceFailed | ModelError | DeliveryLimitExceeded | BatchCancelled | BatchExpired => StatusCode::BAD_GATEWAY,
        InternalError => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// An error answer.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// Stable machine-readable code; it decides the HTTP status.
    pub code: ErrorCode,
    /// Human-readable message.
    pub message: String,
    /// The field at fault.
    pub param: Option<String>,
    /// Seconds to wait before retrying (429, 503).
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// An error with a code.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        // Every answer that asks to be retried says when.
        let retry_after = match code {
            ErrorCode::RealtimeLaneSaturated | ErrorCode::ServiceUnavailable | ErrorCode::QuotaRealtimeRate => Some(1),
            ErrorCode::AccountBusy => Some(5),
            ErrorCode::QuotaQueuedRequests | ErrorCode::QuotaFileBytes | ErrorCode::QuotaAdapters => Some(60),
            _ => None,
        };
        ApiError {
            code,
            message: message.into(),
            param: None,
            retry_after,
        }
    }

    /// An error about one field.
    pub fn invalid(code: ErrorCode, param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::new(code, message).with_param(param)
    }

    /// Name the field at fault.
    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    /// Ask the client to come back in `seconds`.
    pub fn retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds);
        self
    }

    /// A 404 for anything the caller may not see or that does not exist.
    pub fn not_found(code: ErrorCode, param: &str, what: &str) -> Self {
        ApiError::new(code, format!("no such {what}")).with_param(param)
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        status(self.code)
    }

    /// The error class, as in OpenAI's error shape.
    pub fn kind(&self) -> &'static str {
        match self.status() {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            s if s.is_server_error() => "api_error",
            _ => "invalid_request_error",
        }
    }

    /// The error body.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"type": self.kind(), "code": self.code, "message": self.message, "param": self.param}})
    }
}

impl From<InputError> for ApiError {
    fn from(e: InputError) -> Self {
        let error = ApiError::new(e.code, e.message);
        // An empty path is the body itself: no field to name.
        if e.param.is_empty() {
            error
        } else {
            error.with_param(e.param)
        }
    }
}

impl From<BatcherError> for ApiError {
    fn from(e: BatcherError) -> Self {
        match e {
            BatcherError::Saturated => ApiError::new(
                ErrorCode::RealtimeLaneSaturated,
                "the real-time lane is full; retry shortly or submit a batch",
            ),
            BatcherError::Timeout(after) => ApiError::new(
                ErrorCode::RealtimeTimeout,
                format!("no worker answered within {}s", after.as_secs()),
            ),
            other => {
                tracing::error!(error = %other, "internal failure");
                ApiError::new(
                    ErrorCode::ServiceUnavailable,
                    "a backing service is unavailable; retry shortly",
                )
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = self.body();
        let mut response = self.respond(body);
        response.extensions_mut().insert(Plain(self));
        response
    }
}

/// The header that tells OpenAI's SDKs whether to retry an answer; they
/// retry every 409 (and 408, 429, 5xx) without it.
pub const SHOULD_RETRY: &str = "x-should-retry";

/// Whether the same request might succeed later. False for the conflicts
/// that are final (the name is taken, the batch has ended, the key was used
/// for another body, the account exists): those answers carry
/// `x-should-retry: false`. Other codes leave retrying to the client's
/// rules (409s that pass, like an adapter still loading, included).
pub fn should_retry(code: ErrorCode) -> bool {
    use ErrorCode::*;
    !matches!(
        code,
        AdapterNameTaken | BatchNotCancellable | IdempotencyKeyReused | AccountExists
    )
}

/// The error behind a response in the plain shape, for [`cloudflare_envelope`].
#[derive(Clone)]
struct Plain(ApiError);

/// On the Workers AI routes every error comes in Cloudflare's envelope,
/// whoever found it: the handler, an extractor (the token, the JSON body, a
/// multipart form), a guard or the router. The outermost layer: it re-renders
/// the plain shape, keeping the status and headers.
pub async fn cloudflare_envelope(request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let workers_ai = request.uri().path().starts_with("/client/v4/");
    let response = next.run(request).await;
    if !workers_ai {
        return response;
    }
    let Some(Plain(error)) = response.extensions().get::<Plain>().cloned() else {
        return response;
    };
    let (mut parts, _) = response.into_parts();
    parts.extensions.remove::<Plain>();
    parts.headers.remove(header::CONTENT_LENGTH);
    let body = serde_json::to_vec(&error.cloudflare_body()).expect("an error body serialises");
    Response::from_parts(parts, axum::body::Body::from(body))
}

impl ApiError {
    /// `body` with this error's status and `Retry-After`.
    fn respond(&self, body: serde_json::Value) -> Response {
        let mut response = (self.status(), Json(body)).into_response();
        if let Some(secs) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if !should_retry(self.code) {
            response
                .headers_mut()
                .insert(SHOULD_RETRY, HeaderValue::from_static("false"));
        }
        response
    }

    /// The Workers AI envelope: the `error` object plus Cloudflare's
    /// `success`/`errors`/`messages`/`result` fields.
    pub fn cloudflare_body(&self) -> serde_json::Value {
        let mut body = self.body();
        body["success"] = json!(false);
        body["result"] = serde_json::Value::Null;
        body["messages"] = json!([]);
        body["errors"] = json!([{"code": self.status().as_u16() as u32 * 10, "message": format!("{}: {}", self.code, self.message)}]);
        body
    }
}

/// The Workers AI envelope around an error: the same `error` object, plus
/// Cloudflare's `success`/`errors`/`messages`/`result` fields.
pub struct CloudflareError(pub ApiError);

impl From<ApiError> for CloudflareError {
    fn from(e: ApiError) -> Self {
        CloudflareError(e)
    }
}

impl From<BatcherError> for CloudflareError {
    fn from(e: BatcherError) -> Self {
        CloudflareError(e.into())
    }
}

impl From<InputError> for CloudflareError {
    fn from(e: InputError) -> Self {
        CloudflareError(e.into())
    }
}

impl IntoResponse for CloudflareError {
    fn into_response(self) -> Response {
        let body = self.0.cloudflare_body();
        self.0.respond(body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every code's status, written out apart from [`status`] so that a
    /// change to the table is a change to this pin too.
    const PINNED: &[(u16, &[&str])] = &[
        (
            400,
            &[
                "invalid_type",
                "invalid_value",
                "missing_field",
                "unknown_field",
                "conflicting_fields",
                "out_of_range",
                "empty_messages",
                "empty_prompt",
                "context_length_exceeded",
                "template_error",
                "token_out_of_vocabulary",
                "unsupported_parameter",
                "invalid_json",
                "nul_character",
                "unreadable_body",
                "invalid_multipart",
                "duplicate_field",
                "invalid_request",
                "invalid_schema",
                "invalid_grammar",
                "constraint_too_complex",
                "model_task_mismatch",
                "adapters_not_supported",
                "adapter_model_mismatch",
                "invalid_adapter_name",
                "invalid_file_name",
                "adapter_config_invalid",
                "adapter_missing_file",
                "adapter_missing_tensor",
                "adapter_nonfinite",
                "adapter_value_out_of_range",
                "adapter_rank_too_large",
                "adapter_shape_mismatch",
                "adapter_unknown_target",
                "adapter_unsupported",
                "adapter_weights_invalid",
                "empty_batch",
                "too_many_requests",
                "duplicate_custom_id",
                "invalid_completion_window",
                "invalid_idempotency_key",
                "invalid_metadata",
                "invalid_webhook_url",
                "webhook_url_not_allowed",
                "empty_file",
                "invalid_file",
                "invalid_file_purpose",
                "model_mismatch",
                "endpoint_mismatch",
                "invalid_account_name",
            ],
        ),
        (401, &["invalid_token"]),
        (
            404,
            &[
                "model_not_found",
                "adapter_not_found",
                "batch_not_found",
                "file_not_found",
                "account_not_found",
                "route_not_found",
                "key_not_found",
            ],
        ),
        (
            409,
            &[
                "adapter_name_taken",
                "adapter_not_ready",
                "batch_not_cancellable",
                "batch_not_ended",
                "idempotency_key_reused",
                "account_exists",
                "account_busy",
            ],
        ),
        (405, &["method_not_allowed"]),
        (408, &["body_timeout"]),
        (414, &["uri_too_long"]),
        (413, &["body_too_large", "adapter_too_large", "file_too_large"]),
        (
            429,
            &[
                "realtime_lane_saturated",
                "quota_queued_requests",
                "quota_realtime_rate",
                "quota_file_bytes",
                "quota_adapters",
            ],
        ),
        (500, &["internal_error"]),
        (
            502,
            &[
                "inference_failed",
                "model_error",
                "delivery_limit_exceeded",
                "batch_cancelled",
                "batch_expired",
            ],
        ),
        (503, &["service_unavailable", "engine_stopped"]),
        (504, &["realtime_timeout"]),
    ];

    #[test]
    fn every_code_has_its_pinned_status_and_renders_one_body() {
        let mut pinned = 0;
        for &(want, codes) in PINNED {
            for &text in codes {
                let code = ErrorCode::parse(text).unwrap_or_else(|| panic!("{text} is not a code"));
                let error = ApiError::invalid(code, "field", "what went wrong");
                assert_eq!(error.status().as_u16(), want, "{text}");
                let body = error.body();
                assert_eq!(body["error"]["code"], text);
                assert_eq!(body["error"]["param"], "field");
                assert_eq!(body["error"]["message"], "what went wrong");
                let kind = match want {
                    401 => "authentication_error",
                    404 => "not_found_error",
                    429 => "rate_limit_error",
                    500.. => "api_error",
                    _ => "invalid_request_error",
                };
                assert_eq!(body["error"]["type"], kind, "{text}");
                let envelope = error.cloudflare_body();
                assert_eq!(envelope["error"], body["error"]);
                assert_eq!(envelope["success"], false);
                assert_eq!(envelope["errors"][0]["code"], u32::from(want) * 10);
                let retry = matches!(text, "realtime_lane_saturated" | "service_unavailable" | "account_busy")
                    || text.starts_with("quota_");
                assert_eq!(error.retry_after.is_some(), retry, "{text}");
                pinned += 1;
            }
        }
        assert_eq!(pinned, ErrorCode::ALL.len(), "every code is pinned once");
    }

    #[test]
    fn a_response_carries_the_status_and_retry_after() {
        let response = ApiError::new(ErrorCode::RealtimeLaneSaturated, "full").into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()[header::RETRY_AFTER], "1");
        let response = CloudflareError(ApiError::new(ErrorCode::BatchNotFound, "no")).into_response();
        assert_eq!(response.status(), StatusCode::NOT_FOUND);
    }

    #[test]
    fn only_the_final_conflicts_tell_sdks_not_to_retry() {
        let mut told = Vec::new();
        for &code in ErrorCode::ALL {
            let response = ApiError::new(code, "x").into_response();
            match response.headers().get(SHOULD_RETRY) {
                Some(value) => {
                    assert_eq!(value, "false");
                    assert_eq!(response.status(), StatusCode::CONFLICT, "{code}");
                    told.push(code.as_str());
                }
                None => assert!(should_retry(code)),
            }
        }
        assert_eq!(
            told,
            [
                "adapter_name_taken",
                "batch_not_cancellable",
                "idempotency_key_reused",
                "account_exists"
            ]
        );
    }
}
