//! Turning a submitted batch into a [`NewBatch`] (parse, don't validate) and
//! writing it. Both API shapes come through here.

use std::collections::HashSet;
use std::time::Duration;

use axum::http::HeaderMap;
use lorry_batcher::ids::{AccountId, BatchId};
use lorry_batcher::model::{Batch, Chunk, OpenAiBatch, RequestStatus, Shape, Tally};
use lorry_batcher::quota::Refusal;
use lorry_batcher::store::{Account, Created, NewBatch, NewRequest, OutboxMessage};
use lorry_batcher::webhooks::{check_url, UrlProblem};
use lorry_protocol::input::Fields;
use lorry_protocol::ErrorCode;
use lorry_protocol::{Catalog, ModelSpec, ValidRequest};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use crate::{ApiConfig, ApiError, AppState};

/// The default completion window.
pub const DEFAULT_WINDOW: &str = "24h";
const MAX_WINDOW: Duration = Duration::from_secs(7 * 24 * 3600);
const MAX_CUSTOM_ID: usize = 512;
const MAX_IDEMPOTENCY_KEY: usize = 255;

/// A submitted request's input: the client's JSON, or a request a
/// translator (OpenAI's batch file lines) has already validated.
pub enum Body {
    /// To validate against the model.
    Json(Value),
    /// Validated.
    Valid(ValidRequest),
}

/// One submitted request before validation: where it sits and what it says.
pub struct Item {
    /// The client's id.
    pub custom_id: Option<String>,
    /// The model input.
    pub body: Body,
    /// The JSON path of the input, for errors (`requests[3].body`).
    pub path: String,
    /// The JSON path of the custom id, for errors.
    pub custom_id_path: String,
}

/// The batch-level options both shapes share.
#[derive(Default)]
pub struct Options {
    /// e.g. `24h`.
    pub completion_window: Option<String>,
    /// Up to 16 string pairs.
    pub metadata: Option<Value>,
    /// Webhook target.
    pub webhook_url: Option<String>,
    /// OpenAI's fields, for a batch made from a file.
    pub openai: Option<OpenAiBatch>,
    /// Among the account's own batches, higher goes out first.
    pub priority: i16,
}

/// The lowest and highest batch `priority`.
pub const PRIORITY: std::ops::RangeInclusive<i16> = -10..=10;

/// OpenAI's `service_tier` names, as batch priorities: `flex` waits behind the
/// account's other batches, `priority` goes ahead of them.
pub const SERVICE_TIERS: [(&str, i16); 4] = [("auto", 0), ("default", 0), ("flex", -5), ("priority", 5)];

/// The optional `priority` (an integer from -10 to 10) or `service_tier` (one
/// of [`SERVICE_TIERS`]' names); 0 by default, both together refused.
pub fn priority(fields: &mut Fields<'_>) -> Result<i16, ApiError> {
    let tier = fields.raw("service_tier");
    let Some(raw) = fields.raw("priority") else {
        return tier.map_or(Ok(0), service_tier);
    };
    if tier.is_some() {
        return Err(ApiError::invalid(
            ErrorCode::ConflictingFields,
            "service_tier",
            "give priority or service_tier, not both",
        ));
    }
    let out_of_range = || {
        ApiError::invalid(
            ErrorCode::OutOfRange,
            "priority",
            format!(
                "priority must be an integer from {} to {}",
                PRIORITY.start(),
                PRIORITY.end()
            ),
        )
    };
    let n = raw
        .as_i64()
        .ok_or_else(|| ApiError::invalid(ErrorCode::InvalidType, "priority", "priority must be an integer"))?;
    i16::try_from(n)
        .ok()
        .filter(|p| PRIORITY.contains(p))
        .ok_or_else(out_of_range)
}

/// A `service_tier` name's priority.
fn service_tier(raw: &Value) -> Result<i16, ApiError> {
    let refuse = |code| {
        let names: Vec<String> = SERVICE_TIERS.iter().map(|(name, _)| format!("\"{name}\"")).collect();
        ApiError::invalid(
            code,
            "service_tier",
            format!("service_tier must be one of {}", names.join(", ")),
        )
    };
    let name = raw.as_str().ok_or_else(|| refuse(ErrorCode::InvalidType))?;
    SERVICE_TIERS
        .iter()
        .find(|(tier, _)| *tier == name)
        .map(|&(_, priority)| priority)
        .ok_or_else(|| refuse(ErrorCode::InvalidValue))
}

/// Look a model up, or refuse with 404 naming `param`.
pub fn model<'a>(catalog: &'a Catalog, name: &str, param: &str) -> Result<&'a ModelSpec, ApiError> {
    catalog.get(name).ok_or_else(|| {
        ApiError::new(ErrorCode::ModelNotFound, format!("model {name} is not served here")).with_param(param)
    })
}

/// `base:adapter` (OpenAI's fine-tuned model names) → the base model and the
/// adapter every request uses unless it names its own. A served name that
/// holds a colon is taken whole.
pub fn split_model<'a>(catalog: &Catalog, model: &'a str) -> (&'a str, Option<&'a str>) {
    if catalog.get(model).is_some() {
        return (model, None);
    }
    match model.rsplit_once(':') {
        Some((base, adapter)) if !adapter.is_empty() && catalog.get(base).is_some() => (base, Some(adapter)),
        _ => (model, None),
    }
}

/// A submission as read from either API shape.
pub struct Submission<'a> {
    /// The model.
    pub spec: &'a ModelSpec,
    /// Which API shape it came in.
    pub shape: Shape,
    /// Its requests, in order.
    pub items: Vec<Item>,
    /// Batch-level options.
    pub options: Options,
}

/// Validate a whole submission into a batch ready to write.
pub fn validate(
    config: &ApiConfig,
    account: &AccountId,
    submission: Submission<'_>,
    headers: &HeaderMap,
    raw: &[u8],
) -> Result<NewBatch, ApiError> {
    let Submission {
        spec,
        shape,
        items,
        options,
    } = submission;
    let requests = check_requests(config.max_requests, spec, items)?;
    let completion_window = options.completion_window.unwrap_or_else(|| DEFAULT_WINDOW.to_string());
    let window = parse_window(&completion_window)?;
    let metadata = options.metadata.map(check_metadata).transpose()?;
    let webhook_url = options
        .webhook_url
        .map(|url| allowed_webhook(config, &url))
        .transpose()?;
    Ok(NewBatch {
        id: BatchId::generate(),
        account_id: account.clone(),
        model: spec.name.clone(),
        shape,
        completion_window,
        window,
        metadata,
        webhook_url,
        idempotency_key: idempotency_key(headers)?,
        request_hash: hex::encode(Sha256::digest(raw)),
        openai: options.openai,
        requests,
        priority: options.priority,
    })
}

/// Every request checked against the model, `custom_id`s unique.
fn check_requests(max_requests: usize, spec: &ModelSpec, items: Vec<Item>) -> Result<Vec<NewRequest>, ApiError> {
    if items.is_empty() {
        return Err(ApiError::invalid(
            ErrorCode::EmptyBatch,
            "requests",
            "requests must hold at least one request",
        ));
    }
    if items.len() > max_requests {
        return Err(ApiError::invalid(
            ErrorCode::TooManyRequests,
            "requests",
            format!("a batch holds at most {max_requests} requests"),
        ));
    }
    let mut seen = HashSet::new();
    let mut requests = Vec::with_capacity(items.len());
    for item in items {
        let request = match item.body {
            Body::Json(body) => spec.validate(&body).map_err(|e| e.under(&item.path))?,
            Body::Valid(request) => request,
        };
        if request.stream {
            return Err(ApiError::invalid(
                ErrorCode::InvalidValue,
                format!("{}.stream", item.path),
                "a batch request cannot stream",
            ));
        }
        if let Some(id) = &item.custom_id {
            if id.is_empty() || id.len() > MAX_CUSTOM_ID {
                return Err(ApiError::invalid(
                    ErrorCode::InvalidValue,
                    item.custom_id_path,
                    format!("custom_id must be 1 to {MAX_CUSTOM_ID} characters"),
                ));
            }
            if !seen.insert(id.clone()) {
                return Err(ApiError::invalid(
                    ErrorCode::DuplicateCustomId,
                    item.custom_id_path,
                    format!("custom_id {id:?} appears more than once"),
                ));
            }
        }
        requests.push(NewRequest {
            custom_id: item.custom_id,
            request,
        });
    }
    Ok(requests)
}

/// A webhook target the deployment allows.
fn allowed_webhook(config: &ApiConfig, url: &str) -> Result<String, ApiError> {
    check_url(url, config.allow_private_webhooks)
        .map(|u| u.to_string())
        .map_err(|problem| {
            let code = match problem {
                UrlProblem::Invalid => ErrorCode::InvalidWebhookUrl,
                UrlProblem::Private => ErrorCode::WebhookUrlNotAllowed,
            };
            ApiError::invalid(code, "webhook.url", problem.to_string())
        })
}

/// [`validate`], then resolve the adapter each request names (or `default`)
/// to its id, so the batch is written only with adapters the account has;
/// `path` names request `i`'s body in errors.
pub async fn prepare(
    state: &AppState,
    account: &AccountId,
    submission: Submission<'_>,
    headers: &HeaderMap,
    raw: &[u8],
    default: Option<&str>,
    path: impl Fn(usize) -> String,
) -> Result<NewBatch, ApiError> {
    let model = submission.spec.name.clone();
    let mut new = validate(&state.config, account, submission, headers, raw)?;
    crate::adapters::resolve_requests(state, account, &model, &mut new.requests, default, path).await?;
    Ok(new)
}

fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(value) = headers.get("idempotency-key") else {
        return Ok(None);
    };
    match value.to_str() {
        Ok(key) if !key.is_empty() && key.len() <= MAX_IDEMPOTENCY_KEY => Ok(Some(key.to_string())),
        _ => Err(ApiError::invalid(
            ErrorCode::InvalidIdempotencyKey,
            "Idempotency-Key",
            format!("the Idempotency-Key header must be 1 to {MAX_IDEMPOTENCY_KEY} visible ASCII characters"),
        )),
    }
}

/// `30s`, `15m`, `24h` or `7d`, between one second and seven days.
pub fn parse_window(raw: &str) -> Result<Duration, ApiError> {
    let bad = || {
        ApiError::invalid(
            ErrorCode::InvalidCompletionWindow,
            "completion_window",
            "completion_window must look like 30s, 15m, 24h or 7d, and be at most 7d",
        )
    };
    let split = raw.len().checked_sub(1).ok_or_else(bad)?;
    let (number, unit) = raw.split_at(split);
    if number.is_empty() || !number.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let n: u64 = number.parse().map_err(|_| bad())?;
    let secs = match unit {
        "s" => n,
        "m" => n.checked_mul(60).ok_or_else(bad)?,
        "h" => n.checked_mul(3600).ok_or_else(bad)?,
        "d" => n.checked_mul(86_400).ok_or_else(bad)?,
        _ => return Err(bad()),
    };
    let window = Duration::from_secs(secs);
    if window.is_zero() || window > MAX_WINDOW {
        return Err(bad());
    }
    Ok(window)
}

fn check_metadata(value: Value) -> Result<Value, ApiError> {
    let bad = |message: &str| ApiError::invalid(ErrorCode::InvalidMetadata, "metadata", message);
    let map: Map<String, Value> = match value {
        Value::Object(map) => map,
        _ => return Err(bad("metadata must be an object of strings")),
    };
    if map.len() > 16 {
        return Err(bad("metadata holds at most 16 keys"));
    }
    for (key, v) in &map {
        let ok = key.len() <= 64 && v.as_str().is_some_and(|s| s.len() <= 512);
        if !ok {
            return Err(bad(
                "metadata keys are at most 64 characters, values strings of at most 512",
            ));
        }
    }
    Ok(Value::Object(map))
}

/// The `webhook` option: `{"url": …}`.
pub fn webhook_url(fields: &mut Fields<'_>) -> Result<Option<String>, ApiError> {
    let Some(raw) = fields.raw("webhook") else {
        return Ok(None);
    };
    let mut webhook = Fields::new(raw, "webhook")?;
    let url: String = webhook.required("url", "a string")?;
    webhook.deny_unknown()?;
    Ok(Some(url))
}

/// Write the batch and the messages that will carry its requests to workers.
/// Returns the batch and whether it was created by this call (false: an idempotent replay).
pub async fn create(state: &AppState, account: &Account, new: NewBatch) -> Result<(Batch, bool), ApiError> {
    let queue = state.config.topology.batch_queue(&new.model);
    let total = new.requests.len() as i32;
    let chunk = state.config.chunk_size.max(1) as i32;
    let mut outbox = Vec::with_capacity((total / chunk + 1) as usize);
    let traceparent = lorry_batcher::trace::traceparent(&tracing::Span::current());
    for start in (0..total).step_by(chunk as usize) {
        let message = Chunk {
            batch_id: new.id.clone(),
            account_id: new.account_id.clone(),
            model: new.model.clone(),
            start,
            end: (start + chunk).min(total),
            behind: 0,
        };
        outbox.push(OutboxMessage {
            exchange: String::new(),
            routing_key: queue.clone(),
            payload: serde_json::to_value(&message).map_err(lorry_batcher::BatcherError::from)?,
            // Held for the relay's fair dispatch, which goes by account.
            account_id: Some(new.account_id.clone()),
            // The trace of this request goes on with the chunk's message.
            traceparent: traceparent.clone(),
        });
    }
    let limit = crate::quota::limits(state, account).queued_requests;
    match state.store.create_batch_within(new, outbox, limit).await? {
        Created::New(batch) => Ok((batch, true)),
        Created::Existing {
            batch,
            same_request: true,
        } => Ok((batch, false)),
        Created::Existing { .. } => Err(ApiError::new(
            ErrorCode::IdempotencyKeyReused,
            "this Idempotency-Key was used for a different request",
        )
        .with_param("Idempotency-Key")),
        Created::AccountDisabled => Err(crate::quota::refused(
            Refusal::AccountDisabled,
            ErrorCode::QuotaQueuedRequests,
            "",
        )),
        Created::OverQuota(over) => Err(crate::quota::refused(
            Refusal::OverQuota(over),
            ErrorCode::QuotaQueuedRequests,
            "batch requests not yet ended",
        )),
    }
}

/// The tally of a batch nobody has touched yet.
pub fn fresh_tally(total: i32) -> Tally {
    let mut tally = Tally::default();
    tally.counts.insert(RequestStatus::Pending, total as i64);
    tally
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_parse_within_bounds() {
        assert_eq!(parse_window("24h").unwrap(), Duration::from_secs(86_400));
        assert_eq!(parse_window("2s").unwrap(), Duration::from_secs(2));
        for bad in ["", "h", "0s", "8d", "24", "1w", "-1h", "99999999999999999999d"] {
            assert_eq!(
                parse_window(bad).unwrap_err().code,
                "invalid_completion_window",
                "{bad}"
            );
        }
    }

    #[test]
    fn metadata_is_sixteen_short_strings_at_most() {
        assert!(check_metadata(serde_json::json!({"a": "b"})).is_ok());
        assert!(check_metadata(serde_json::json!({"a": 1})).is_err());
        assert!(check_metadata(serde_json::json!(["a"])).is_err());
        let many: Map<String, Value> = (0..17).map(|i| (i.to_string(), Value::from("x"))).collect();
        assert!(check_metadata(Value::Object(many)).is_err());
    }
}
