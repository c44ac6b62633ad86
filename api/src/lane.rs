//! One request on the real-time lane, for every API shape: validated,
//! adapter resolved, published, and awaited or streamed. A call dropped before
//! its last reply (the client went away) is announced to the workers, so the
//! one serving it stops and frees its sequence.

use std::time::Duration;

use lorry_batcher::realtime::{RealtimeClient, Reply, RtRequest};
use lorry_batcher::store::{Account, NewRequest};
use lorry_batcher::BatcherError;
use lorry_protocol::ErrorCode;
use lorry_protocol::{Output, ValidRequest};
use tokio::sync::mpsc;

use crate::metrics::RealtimeTally;
use crate::{adapters, ApiError, AppState};

/// How often a stream with nothing to say sends an SSE comment: the write
/// is what tells the server a client has hung up (and its request is then
/// cancelled) while it waits for a first token.
pub const STREAM_KEEP_ALIVE: Duration = Duration::from_millis(500);

/// A request published on the real-time lane.
pub struct Call {
    /// Whether the client asked for a stream.
    pub stream: bool,
    /// How many choices the request asked for.
    pub choices: u32,
    replies: mpsc::Receiver<Reply>,
    guard: Pending,
    timeout: Duration,
    tally: RealtimeTally,
}

/// Resolve the adapter `valid` names, and publish it for `model`.
/// Refused `429 quota_realtime_rate` over the account's rate.
pub async fn start(state: &AppState, account: &Account, model: &str, valid: ValidRequest) -> Result<Call, ApiError> {
    crate::quota::realtime(state, account)?;
    let account = &account.id;
    let stream = valid.stream;
    let choices = valid.sampling.choices();
    let started = std::time::Instant::now();
    let mut requests = [NewRequest {
        custom_id: None,
        request: valid,
    }];
    adapters::resolve_requests(state, account, model, &mut requests, None, |_| String::new()).await?;
    let [NewRequest { request: resolved, .. }] = requests;
    let request = RtRequest {
        model: model.to_string(),
        request: resolved,
        account_id: Some(account.clone()),
    };
    let timeout = state.config.realtime_timeout;
    let resolved_in = started.elapsed();
    let (correlation, replies) = state.realtime.submit(&request, timeout).await?;
    let tally = RealtimeTally::start(&state.metrics, model);
    tracing::trace!(
        %correlation,
        resolve_ms = resolved_in.as_secs_f64() * 1e3,
        publish_ms = (started.elapsed() - resolved_in).as_secs_f64() * 1e3,
        "real-time request published"
    );
    Ok(Call {
        stream,
        choices,
        replies,
        guard: Pending {
            client: state.realtime.clone(),
            correlation,
            open: true,
        },
        timeout,
        tally,
    })
}

impl Call {
    /// The final output, within the lane's timeout.
    pub async fn output(mut self) -> Result<Output, ApiError> {
        let answer = tokio::time::timeout(self.timeout, async {
            while let Some(reply) = self.replies.recv().await {
                self.tally.reply(&reply);
                match reply {
                    Reply::Token { .. } => {}
                    Reply::Done { output } => return Ok(*output),
                    Reply::Error { code, message, param } => return Err(engine_failure(code, message, param)),
                }
            }
            Err(engine_failure(
                ErrorCode::EngineStopped,
                "the worker went away".into(),
                None,
            ))
        })
        .await;
        match answer {
            // Nobody waits any more: stop the worker too.
            Err(_) => {
                self.tally.timed_out();
                Err(BatcherError::Timeout(self.timeout).into())
            }
            Ok(result) => {
                self.guard.open = false;
                self.guard.client.forget(&self.guard.correlation);
                result
            }
        }
    }

    /// The next reply; `None` after the last one. Dropping the call before
    /// then cancels the request.
    pub async fn next(&mut self) -> Option<Reply> {
        if !self.guard.open {
            return None;
        }
        let reply = self.replies.recv().await;
        if let Some(reply) = &reply {
            self.tally.reply(reply);
        }
        // After the last reply nothing is owed; replies that stop without
        // one (the caller was cut off for falling behind) leave the call
        // open, so that dropping it cancels the request.
        if reply.as_ref().is_some_and(Reply::is_last) {
            self.guard.open = false;
            self.guard.client.forget(&self.guard.correlation);
        }
        reply
    }
}

/// Cancels the request unless its last reply arrived.
struct Pending {
    client: RealtimeClient,
    correlation: String,
    open: bool,
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.open {
            return;
        }
        let client = self.client.clone();
        let correlation = std::mem::take(&mut self.correlation);
        tracing::debug!(%correlation, "a real-time call ended before its last reply; cancelling it");
        client.forget(&correlation);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if let Err(e) = client.cancel(&correlation).await {
                    tracing::debug!(error = %e, "could not announce a cancelled real-time request");
                }
            });
        }
    }
}

/// A bad input found by the model (a prompt too long for it, say) is the
/// client's error naming the field; a retryable failure keeps its code (503
/// with `Retry-After`); anything else is `inference_failed`, whose message
/// carries the engine's code.
pub fn engine_failure(code: ErrorCode, message: String, param: Option<String>) -> ApiError {
    match param {
        Some(param) => ApiError::invalid(code, param, message),
        // A lost broker, a stopped engine: the same request may succeed if sent again.
        None if code.retryable() => ApiError::new(code, message),
        None => ApiError::new(ErrorCode::InferenceFailed, format!("{code}: {message}")),
    }
}
