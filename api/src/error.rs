//! Errors as clients see them, mapped to HTTP in exactly this one place.
//!
//! Every error has a stable `code`, and `param` names the field at fault:
//! `{"error":{"type","code","message","param"}}`. Internal failures are
//! logged here and answered with a generic message.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use lorry_batcher::BatcherError;
use lorry_protocol::InputError;
use serde_json::json;

/// An error answer.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Stable machine-readable code.
    pub code: &'static str,
    /// Human-readable message.
    pub message: String,
    /// The field at fault.
    pub param: Option<String>,
    /// Seconds to wait before retrying (429, 503).
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// An error with a status and code.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
            param: None,
            retry_after: None,
        }
    }

    /// A 400 about one field.
    pub fn invalid(code: &'static str, param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, code, message).with_param(param)
    }

    /// Name the field at fault.
    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    /// A 404 for anything the caller may not see or that does not exist.
    pub fn not_found(code: &'static str, param: &str, what: &str) -> Self {
        ApiError::new(StatusCode::NOT_FOUND, code, format!("no such {what}")).with_param(param)
    }

    /// The error class, as in OpenAI's error shape.
    pub fn kind(&self) -> &'static str {
        match self.status {
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
        let error = ApiError::new(StatusCode::BAD_REQUEST, e.code, e.message);
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
            BatcherError::Saturated => {
                let mut err = ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "realtime_lane_saturated",
                    "the real-time lane is full; retry shortly or submit a batch",
                );
                err.retry_after = Some(1);
                err
            }
            BatcherError::Timeout(after) => ApiError::new(
                StatusCode::GATEWAY_TIMEOUT,
                "realtime_timeout",
                format!("no worker answered within {}s", after.as_secs()),
            ),
            other => {
                tracing::error!(error = %other, "internal failure");
                let mut err = ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "service_unavailable",
                    "a backing service is unavailable; retry shortly",
                );
                err.retry_after = Some(1);
                err
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        if let Some(secs) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
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
        let e = self.0;
        let mut body = e.body();
        body["success"] = json!(false);
        body["result"] = serde_json::Value::Null;
        body["messages"] = json!([]);
        body["errors"] =
            json!([{"code": e.status.as_u16() as u32 * 10, "message": format!("{}: {}", e.code, e.message)}]);
        let mut response = (e.status, Json(body)).into_response();
        if let Some(secs) = e.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}
