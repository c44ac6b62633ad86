//! The real-time lane: a single request published to `<p>.rt.<model>` with a
//! reply queue; the worker answers with the tokens as they come and a final
//! result. [`RealtimeClient`] is the API's side, [`forward`] the worker's.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection};
use lorry_engine::{EngineError, ErrorCode, Event, EventStream, Output, TokenLogprob, ValidRequest};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::broker::{self, Publisher, Topology};
use crate::ids::AccountId;
use crate::BatcherError;

/// A real-time request on the broker.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RtRequest {
    /// The served model.
    pub model: String,
    /// The request as the API validated it (its adapter resolved to an id).
    pub request: ValidRequest,
    /// The caller, whose adapters the request may name.
    #[serde(default)]
    pub account_id: Option<AccountId>,
}

/// One message back to the API.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Reply {
    /// A piece of generated text.
    Token {
        /// The text.
        text: String,
        /// Its tokens' log-probabilities, for requests that asked.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        logprobs: Vec<TokenLogprob>,
        /// Which choice it belongs to (requests with `n` > 1).
        #[serde(default, skip_serializing_if = "crate::model::is_zero")]
        choice: u32,
    },
    /// The final result.
    Done {
        /// The model's output (boxed: it is far larger than the other replies).
        output: Box<Output>,
    },
    /// The request failed.
    Error {
        /// Stable code.
        code: ErrorCode,
        /// Explanation.
        message: String,
        /// The input field at fault, when the request itself was bad.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        param: Option<String>,
    },
}

impl Reply {
    /// An error reply.
    pub fn error(code: ErrorCode, message: &str) -> Self {
        Reply::Error {
            code,
            message: message.to_string(),
            param: None,
        }
    }

    /// The reply for an engine's error, naming the field when the input was at fault.
    pub fn engine_error(error: &EngineError) -> Self {
        match error {
            EngineError::Input(input) => Reply::Error {
                code: input.code,
                message: input.message.clone(),
                param: Some(input.param.clone()),
            },
            other => Reply::error(other.code(), &other.to_string()),
        }
    }

    /// Whether nothing follows this reply.
    pub fn is_last(&self) -> bool {
        !matches!(self, Reply::Token { .. })
    }
}

/// Where a worker sends one request's replies.
pub struct ReplyTo<'a> {
    /// A confirming channel.
    pub publisher: &'a Publisher,
    /// The API's reply queue.
    pub queue: &'a str,
    /// The request's correlation id.
    pub correlation: &'a str,
}

impl ReplyTo<'_> {
    /// Send one reply and wait for the broker's confirm.
    pub async fn send(&self, reply: &Reply) -> Result<(), BatcherError> {
        self.send_pipelined(reply).await?.wait().await
    }

    /// Send one reply without waiting for its confirm.
    async fn send_pipelined(&self, reply: &Reply) -> Result<broker::Pending, BatcherError> {
        let body = serde_json::to_vec(reply)?;
        let properties = BasicProperties::default()
            .with_correlation_id(self.correlation.into())
            .with_content_type("application/json".into());
        self.publisher
            .publish_pipelined("", self.queue, &body, properties)
            .await
    }
}

/// Replies a worker sends ahead of their confirms.
const MAX_UNCONFIRMED: usize = 64;

/// Relay an engine's events as replies until the request ends, or until
/// `cancel` fires: then the stream is dropped, which cancels the request in the engine.
pub async fn forward(
    mut events: EventStream,
    reply: &ReplyTo<'_>,
    cancel: &CancellationToken,
) -> Result<Forwarded, BatcherError> {
    let mut pending = std::collections::VecDeque::new();
    let mut first = true;
    let mut served = Forwarded::Failed;
    loop {
        let event = tokio::select! {
            _ = cancel.cancelled() => return cancelled(reply),
            event = events.recv() => event,
        };
        let Some(event) = event else { break };
        let message = match event {
            Event::Token { text, logprobs, choice } => Reply::Token { text, logprobs, choice },
            Event::Finished(output) => {
                served = Forwarded::Served(output.usage);
                Reply::Done {
                    output: Box::new(output),
                }
            }
            Event::Failed(e) => Reply::engine_error(&e),
        };
        // Tokens go out back to back; their confirms are checked with the
        // last reply's. A client that hangs up while a confirm is awaited
        // (the broker may be slow to confirm under load) ends the wait:
        // nobody reads the rest.
        pending.push_back(reply.send_pipelined(&message).await?);
        if std::mem::take(&mut first) {
            tracing::trace!(correlation = reply.correlation, "first real-time reply sent");
        }
        if pending.len() > MAX_UNCONFIRMED {
            let confirm = pending.pop_front().expect("not empty");
            tokio::select! {
                _ = cancel.cancelled() => return cancelled(reply),
                confirmed = confirm.wait() => confirmed?,
            }
        }
        if message.is_last() {
            for confirm in pending {
                confirm.wait().await?;
            }
            return Ok(served);
        }
    }
    reply
        .send(&Reply::error(ErrorCode::EngineStopped, "the engine stopped"))
        .await
        .map(|()| Forwarded::Failed)
}

/// How a real-time request [`forward`]ed ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forwarded {
    /// Its answer went out; what it used.
    Served(lorry_engine::Usage),
    /// Its error went out.
    Failed,
    /// Its client hung up first.
    Cancelled,
}

/// What [`forward`] returns once its client has hung up: nothing more to send, nothing served.
fn cancelled(reply: &ReplyTo<'_>) -> Result<Forwarded, BatcherError> {
    tracing::debug!(
        correlation = reply.correlation,
        "real-time request cancelled by its client"
    );
    Ok(Forwarded::Cancelled)
}

/// How many cancelled requests a worker remembers, for cancellations that
/// arrive before the request itself.
const REMEMBERED_CANCELS: usize = 4096;

/// A worker's real-time requests in flight, by correlation id, and the ones
/// their clients abandoned.
#[derive(Clone, Default)]
pub struct Cancels {
    inner: Arc<Mutex<CancelState>>,
}

#[derive(Default)]
struct CancelState {
    running: HashMap<String, CancellationToken>,
    early: std::collections::VecDeque<String>,
}

impl Cancels {
    /// The token of a request about to run (already cancelled if its
    /// cancellation came first); call [`Cancels::finish`] when it ends.
    pub fn start(&self, correlation: &str) -> CancellationToken {
        let token = CancellationToken::new();
        let mut state = self.inner.lock().expect("cancels lock");
        if let Some(at) = state.early.iter().position(|c| c == correlation) {
            state.early.remove(at);
            token.cancel();
        }
        state.running.insert(correlation.to_string(), token.clone());
        token
    }

    /// The request ended.
    pub fn finish(&self, correlation: &str) {
        self.inner.lock().expect("cancels lock").running.remove(correlation);
    }

    /// Cancel a request, now if it runs here, or when it arrives.
    pub fn cancel(&self, correlation: &str) {
        let mut state = self.inner.lock().expect("cancels lock");
        match state.running.get(correlation) {
            Some(token) => {
                tracing::debug!(correlation, "cancelling a real-time request");
                token.cancel()
            }
            None => {
                tracing::debug!(
                    correlation,
                    "remembering the cancellation of a request not running here"
                );
                if state.early.len() == REMEMBERED_CANCELS {
                    state.early.pop_front();
                }
                state.early.push_back(correlation.to_string());
            }
        }
    }
}

/// Who waits for replies, by correlation id, with the link whose reply queue they come to.
type Waiters = Arc<Mutex<HashMap<String, (u64, mpsc::Sender<Reply>)>>>;

/// Replies held for one caller that has not taken them (a streaming client
/// reading slower than its tokens come, with its socket's buffers full).
/// Past this the caller is cut off and its request cancelled, so that no
/// client can make the API hold an unbounded backlog.
pub const MAX_BUFFERED_REPLIES: usize = 1024;

/// Tries of [`RealtimeClient::submit`] where the broker did not take a request.
pub const SUBMIT_ATTEMPTS: u32 = 4;

/// The wait before [`RealtimeClient::submit`]'s second try, doubled before each
/// one after it.
const SUBMIT_BACKOFF: Duration = Duration::from_millis(20);

/// How one try of [`RealtimeClient::submit`] failed.
enum Submit {
    /// The broker holds no copy of the request, and a new try may find the
    /// lane's queue: tried again.
    Again(BatcherError),
    /// The lane is full, the broker unreachable, or the request's fate
    /// unknown (the connection lost before its confirm): answered as is.
    Final(BatcherError),
}

struct Link {
    /// Which link this is (replies of requests published on it come only to it).
    id: u64,
    connection: Connection,
    publisher: Publisher,
    reply_queue: String,
}

/// Links made so far in this process.
static LINKS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The API's client for the real-time lane; cheap to clone, connects lazily and
/// reconnects after the broker drops it.
#[derive(Clone)]
pub struct RealtimeClient {
    amqp_url: String,
    topology: Topology,
    max_depth: u32,
    models: Vec<String>,
    link: Arc<tokio::sync::Mutex<Option<Arc<Link>>>>,
    waiters: Waiters,
}

impl RealtimeClient {
    /// A client for the lanes of `models` that refuses new requests while
    /// `max_depth` wait in a lane.
    pub fn new(amqp_url: &str, topology: Topology, models: Vec<String>, max_depth: u32) -> Self {
        RealtimeClient {
            amqp_url: amqp_url.to_string(),
            topology,
            max_depth,
            models,
            link: Arc::default(),
            waiters: Arc::default(),
        }
    }

    async fn link(&self) -> Result<Arc<Link>, BatcherError> {
        let mut guard = self.link.lock().await;
        let healthy = |l: &&Arc<Link>| l.connection.status().connected() && l.publisher.channel().status().connected();
        if let Some(link) = guard.as_ref().filter(healthy) {
            return Ok(Arc::clone(link));
        }
        let connection = broker::connect(&self.amqp_url, "lorry-api").await?;
        let publisher = Publisher::open(&connection).await?;
        self.topology
            .declare(publisher.channel(), self.models.iter().map(String::as_str))
            .await?;
        let replies = connection.create_channel().await?;
        let reply_queue = broker::private_queue(&replies).await?;
        let mut consumer = replies
            .basic_consume(&reply_queue, "", BasicConsumeOptions::default(), FieldTable::default())
            .await?;
        let waiters = Arc::clone(&self.waiters);
        let id = LINKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tokio::spawn(async move {
            while let Some(Ok(delivery)) = consumer.next().await {
                let _ = delivery.ack(BasicAckOptions::default()).await;
                dispatch(&waiters, &delivery);
            }
            // The reply queue went with the connection: nothing more will come
            // to those waiting on it, so they hear so now, not at their timeout.
            let lost = Reply::error(
                ErrorCode::ServiceUnavailable,
                "the connection to the broker was lost before the answer came; retry",
            );
            let mut waiters = waiters.lock().expect("waiters lock");
            waiters.retain(|_, (link, tx)| {
                let on_this_link = *link == id;
                if on_this_link {
                    let _ = tx.try_send(lost.clone());
                }
                !on_this_link
            });
        });
        let link = Arc::new(Link {
            id,
            connection,
            publisher,
            reply_queue,
        });
        *guard = Some(Arc::clone(&link));
        Ok(link)
    }

    /// Whether the broker is reachable.
    pub async fn ping(&self) -> Result<(), BatcherError> {
        self.link().await.map(|_| ())
    }

    /// Requests waiting in each model's real-time queue (a queue no worker has
    /// declared yet counts none). Asked on a channel of its own: a passive
    /// declare of a missing queue closes the channel it was asked on.
    pub async fn lane_depths(&self) -> Result<Vec<(String, u32)>, BatcherError> {
        let link = self.link().await?;
        let mut channel = link.connection.create_channel().await?;
        let mut depths = Vec::with_capacity(self.models.len());
        for model in &self.models {
            let declared = channel
                .queue_declare(
                    &self.topology.rt_queue(model),
                    QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await;
            match declared {
                Ok(queue) => depths.push((model.clone(), queue.message_count())),
                Err(_) => {
                    depths.push((model.clone(), 0));
                    channel = link.connection.create_channel().await?;
                }
            }
        }
        let _ = channel.close(200, "depths read").await;
        Ok(depths)
    }

    /// Publish a request; its replies arrive on the returned channel. The message
    /// expires unserved after `timeout`. Where the broker did not take it —
    /// the lane's queue missing (deleted, or not yet ready: another declarer
    /// may still be making it when this link's declare returns) or the
    /// message returned or refused — it is published again, up to
    /// [`SUBMIT_ATTEMPTS`] tries in all, on a link that declares the lanes
    /// afresh where the failure closed the last one. A publish whose fate is
    /// unknown (the connection lost before its confirm) is not repeated.
    pub async fn submit(
        &self,
        request: &RtRequest,
        timeout: Duration,
    ) -> Result<(String, mpsc::Receiver<Reply>), BatcherError> {
        let mut attempt = 1;
        loop {
            match self.submit_once(request, timeout).await {
                Ok(submitted) => return Ok(submitted),
                Err(Submit::Again(e)) if attempt < SUBMIT_ATTEMPTS => {
                    tracing::debug!(error = %e, attempt, "the broker did not take a real-time request; asking again");
                    tokio::time::sleep(SUBMIT_BACKOFF * (1 << (attempt - 1))).await;
                    attempt += 1;
                }
                Err(Submit::Again(e) | Submit::Final(e)) => return Err(e),
            }
        }
    }

    /// One try of [`RealtimeClient::submit`].
    async fn submit_once(
        &self,
        request: &RtRequest,
        timeout: Duration,
    ) -> Result<(String, mpsc::Receiver<Reply>), Submit> {
        let link = self.link().await.map_err(Submit::Final)?;
        let queue = self.topology.rt_queue(&request.model);
        let depth = link
            .publisher
            .channel()
            .queue_declare(
                &queue,
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| Submit::Again(e.into()))?
            .message_count();
        if depth >= self.max_depth {
            return Err(Submit::Final(BatcherError::Saturated));
        }
        let correlation = uuid::Uuid::new_v4().simple().to_string();
        let (tx, rx) = mpsc::channel(MAX_BUFFERED_REPLIES);
        self.waiters
            .lock()
            .expect("waiters lock")
            .insert(correlation.clone(), (link.id, tx));
        let properties = broker::json_properties()
            .with_reply_to(link.reply_queue.as_str().into())
            .with_correlation_id(correlation.as_str().into())
            .with_expiration(timeout.as_millis().to_string().into());
        let traceparent = crate::trace::traceparent(&tracing::Span::current());
        let properties = crate::trace::with_traceparent(properties, traceparent.as_deref());
        let body = serde_json::to_vec(request).map_err(|e| Submit::Final(e.into()))?;
        if let Err(e) = link.publisher.publish("", &queue, &body, properties).await {
            self.forget(&correlation);
            return Err(match e {
                // Returned or refused: the broker holds no copy.
                BatcherError::NotConfirmed(_) => Submit::Again(e),
                e => Submit::Final(e),
            });
        }
        Ok((correlation, rx))
    }

    /// Stop waiting for a request's replies.
    pub fn forget(&self, correlation: &str) {
        self.waiters.lock().expect("waiters lock").remove(correlation);
    }

    /// Tell every worker that nobody waits for this request any more, so the
    /// one serving it stops and frees its sequence.
    pub async fn cancel(&self, correlation: &str) -> Result<(), BatcherError> {
        self.forget(correlation);
        let link = self.link().await?;
        let exchange = self.topology.rt_cancel_exchange();
        link.publisher
            .publish(&exchange, "", correlation.as_bytes(), BasicProperties::default())
            .await
    }
}

fn dispatch(waiters: &Waiters, delivery: &lapin::message::Delivery) {
    let Some(correlation) = delivery.properties.correlation_id().as_ref() else {
        return;
    };
    let Ok(reply) = serde_json::from_slice::<Reply>(&delivery.data) else {
        return;
    };
    tracing::trace!(
        correlation = correlation.as_str(),
        last = reply.is_last(),
        "real-time reply received"
    );
    deliver(waiters, correlation.as_str(), reply);
}

/// Hand `reply` to whoever waits for `correlation`: the last one ends the
/// wait; one that finds the caller [`MAX_BUFFERED_REPLIES`] behind cuts it off.
fn deliver(waiters: &Waiters, correlation: &str, reply: Reply) {
    let mut waiters = waiters.lock().expect("waiters lock");
    let last = reply.is_last();
    let kept = match waiters.get(correlation).map(|(_, tx)| tx.try_send(reply)) {
        None | Some(Ok(())) => true,
        Some(Err(mpsc::error::TrySendError::Closed(_))) => false,
        Some(Err(mpsc::error::TrySendError::Full(_))) => {
            // Dropping the sender ends the caller's stream: it hears no
            // more, and its call, dropped, cancels the request.
            tracing::info!(
                correlation,
                "a real-time caller fell {MAX_BUFFERED_REPLIES} replies behind; cutting it off"
            );
            false
        }
    };
    if last || !kept {
        waiters.remove(correlation);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_caller_that_falls_too_far_behind_is_cut_off_after_what_it_was_owed() {
        let waiters = Waiters::default();
        let (tx, mut rx) = mpsc::channel(MAX_BUFFERED_REPLIES);
        waiters.lock().unwrap().insert("slow".into(), (0, tx));
        let token = |i: usize| Reply::Token {
            text: format!("t{i}"),
            logprobs: Vec::new(),
            choice: 0,
        };
        for i in 0..MAX_BUFFERED_REPLIES {
            deliver(&waiters, "slow", token(i));
        }
        assert!(waiters.lock().unwrap().contains_key("slow"), "within the bound");
        deliver(&waiters, "slow", token(MAX_BUFFERED_REPLIES));
        assert!(!waiters.lock().unwrap().contains_key("slow"), "one past it: cut off");
        for i in 0..MAX_BUFFERED_REPLIES {
            assert_eq!(rx.try_recv().unwrap(), token(i));
        }
        assert!(matches!(rx.try_recv(), Err(mpsc::error::TryRecvError::Disconnected)));
        // Replies for a caller no longer waiting go nowhere.
        deliver(&waiters, "slow", token(0));
        assert!(waiters.lock().unwrap().is_empty());
    }
}
