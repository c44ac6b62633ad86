//! The worker: consumes the real-time lane before the batch lane, runs each
//! request on an engine [`Backend`], commits results to Postgres idempotently
//! on (batch, index), and acks a message only after its results are durable.
//!
//! Batch work travels as [`Chunk`]s (ranges of one batch's requests), so that
//! a 10,000-request batch is ~160 messages rather than 10,000; inside a chunk
//! every request goes to the engine at once, and results are committed as they
//! finish, a few dozen rows per statement.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::stream::FuturesUnordered;
use futures::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions, QueueBindOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection};
use lorry_engine::{collect, Backend, Catalog, EngineError, ErrorCode, InputError, Lane, Request, ValidRequest};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::adapters;
use crate::broker::{self, Publisher, Topology};
use crate::finaliser::Finaliser;
use crate::ids::AccountId;
use crate::metrics::WorkerMetrics;
use crate::model::{Chunk, RequestError};
use crate::realtime::{self, Cancels, Forwarded, Reply, RtRequest};
use crate::store::{AdapterRecord, Claimed, ClaimedInput, Committed, Outcome, Store};
use crate::BatcherError;

/// How long a stopping worker waits for the work it holds.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

/// How a worker runs.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// The broker.
    pub amqp_url: String,
    /// Queue names.
    pub topology: Topology,
    /// Batch chunks held at once per model.
    pub batch_prefetch: u16,
    /// Real-time requests held at once per model.
    pub rt_prefetch: u16,
    /// Commit results once this many are waiting...
    pub flush_rows: usize,
    /// ...or once the oldest has waited this long.
    pub flush_interval: Duration,
    /// Let every account's requests reuse each other's prefix-cache blocks
    /// (otherwise each account is a cache partition of its own).
    pub share_prefix_cache: bool,
}

/// One request in flight, with its index in the batch.
type Running =
    std::pin::Pin<Box<dyn std::future::Future<Output = (i32, Result<lorry_engine::Output, EngineError>)> + Send>>;

/// Adapter records looked up while serving one chunk, by the reference requests carry.
type Records = HashMap<String, Option<AdapterRecord>>;

/// What processing one chunk did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ChunkReport {
    /// Requests taken from the store.
    pub claimed: usize,
    /// Results written (a redelivered chunk may write fewer than it ran).
    pub committed: u64,
    /// Requests the engine could not take; the chunk must be delivered again.
    pub deferred: usize,
}

/// A worker; cheap to clone.
#[derive(Clone)]
pub struct Worker {
    inner: Arc<Inner>,
}

struct Inner {
    store: Store,
    finaliser: Finaliser,
    catalog: Catalog,
    backends: HashMap<String, Arc<dyn Backend>>,
    config: WorkerConfig,
    cancels: Cancels,
    metrics: Arc<WorkerMetrics>,
    /// Whether a broker session is consuming every queue now.
    consuming: std::sync::atomic::AtomicBool,
}

impl Worker {
    /// A worker serving `backends`, whose inputs the `catalog` validates.
    pub fn new(
        store: Store,
        finaliser: Finaliser,
        catalog: Catalog,
        backends: Vec<Arc<dyn Backend>>,
        config: WorkerConfig,
    ) -> Self {
        let backends = backends.into_iter().map(|b| (b.model().to_string(), b)).collect();
        Worker {
            inner: Arc::new(Inner {
                store,
                finaliser,
                catalog,
                backends,
                config,
                cancels: Cancels::default(),
                metrics: Arc::default(),
                consuming: Default::default(),
            }),
        }
    }

    /// Whether the worker is connected to the broker and consuming every
    /// queue it serves (false while it connects or reconnects).
    pub fn is_consuming(&self) -> bool {
        self.inner.consuming.load(std::sync::atomic::Ordering::Acquire)
    }

    /// What this worker counts, for `/metrics`.
    pub fn metrics(&self) -> Arc<WorkerMetrics> {
        Arc::clone(&self.inner.metrics)
    }

    /// The models this worker serves.
    pub fn models(&self) -> Vec<String> {
        self.inner.backends.keys().cloned().collect()
    }

    /// Run one chunk: claim, serve, commit; then finalise the batch if it has ended.
    pub async fn process_chunk(&self, chunk: &Chunk) -> Result<ChunkReport, BatcherError> {
        let inner = &self.inner;
        let (spec, backend) = match (inner.catalog.get(&chunk.model), inner.backends.get(&chunk.model)) {
            (Some(spec), Some(backend)) => (spec, backend),
            _ => return Err(BatcherError::UnknownModel(chunk.model.clone())),
        };
        let claimed = inner.store.claim(chunk).await?;
        tracing::debug!(
            batch = %chunk.batch_id,
            account = %chunk.account_id,
            start = chunk.start,
            end = chunk.end,
            claimed = claimed.len(),
            "chunk claimed"
        );
        let mut report = ChunkReport {
            claimed: claimed.len(),
            ..Default::default()
        };
        let mut ready = Vec::new();
        let mut running: FuturesUnordered<Running> = FuturesUnordered::new();
        let mut records = Records::default();
        // The account's requests still held back by the dispatch, for the
        // engine's share by account.
        let backlog = chunk.behind as usize * (chunk.end - chunk.start).max(0) as usize;
        for Claimed { index, input, .. } in claimed {
            let request = match input {
                ClaimedInput::Valid(request) => request,
                // Rows stored before requests were kept typed.
                ClaimedInput::Legacy(body) => match spec.validate(&body) {
                    Ok(request) => request,
                    Err(e) => {
                        ready.push(outcome(index, Err(e.into())));
                        continue;
                    }
                },
                ClaimedInput::Unreadable(why) => {
                    let error = InputError::new(
                        ErrorCode::InvalidRequest,
                        "",
                        format!("unreadable stored request: {why}"),
                    );
                    ready.push(outcome(index, Err(error.into())));
                    continue;
                }
            };
            let request = match self
                .engine_request(&chunk.account_id, request, Lane::Batch, &mut records)
                .await?
            {
                Ok(request) => request.with_backlog(backlog),
                Err(e) => {
                    ready.push(outcome(index, Err(e)));
                    continue;
                }
            };
            // A request whose adapter must load waits for it off the engine
            // thread; the rest of the batch runs meanwhile.
            match backend.submit(request) {
                Ok(events) => running.push(Box::pin(async move { (index, collect(events).await) })),
                Err(e) if e.retryable() => report.deferred += 1,
                Err(e) => ready.push(outcome(index, Err(e))),
            }
        }
        let interval = inner.config.flush_interval;
        let mut last_flush = Instant::now();
        let mut commits = std::time::Duration::ZERO;
        while !running.is_empty() {
            tokio::select! {
                Some((index, result)) = running.next() => match result {
                    Err(e) if e.retryable() => report.deferred += 1,
                    result => ready.push(outcome(index, result)),
                },
                _ = tokio::time::sleep_until(last_flush + interval) => {}
            }
            if ready.len() >= inner.config.flush_rows || last_flush.elapsed() >= interval {
                let began = Instant::now();
                report.committed += self.commit(chunk, &std::mem::take(&mut ready)).await?;
                last_flush = Instant::now();
                commits += last_flush - began;
            }
        }
        let began = Instant::now();
        report.committed += self.commit(chunk, &ready).await?;
        let last_commit = began.elapsed();
        tracing::debug!(
            batch = %chunk.batch_id,
            start = chunk.start,
            committed = report.committed,
            deferred = report.deferred,
            commit_ms = (commits + last_commit).as_secs_f64() * 1e3,
            last_commit_ms = last_commit.as_secs_f64() * 1e3,
            "chunk served"
        );
        inner.finaliser.report_progress(&chunk.batch_id).await?;
        if report.deferred == 0 {
            inner.finaliser.try_finalize(&chunk.batch_id).await?;
        }
        Ok(report)
    }

    /// Commit `outcomes` of `chunk`'s requests; how many rows were written.
    async fn commit(&self, chunk: &Chunk, outcomes: &[Outcome]) -> Result<u64, BatcherError> {
        let written = self.inner.store.commit(&chunk.batch_id, outcomes).await?;
        self.inner.metrics.ended(Lane::Batch, &chunk.model, &written);
        Ok(written.rows)
    }

    /// The record of the adapter `request` names, looked up once per chunk;
    /// an adapter deleted since the request was accepted ends it with `adapter_not_found`.
    async fn adapter_record(
        &self,
        account: &AccountId,
        request: &ValidRequest,
        records: &mut Records,
    ) -> Result<Result<AdapterRecord, EngineError>, BatcherError> {
        let reference = request.lora.clone().unwrap_or_default();
        if !records.contains_key(&reference) {
            let found = self.inner.store.find_adapter(account, &reference).await?;
            records.insert(reference.clone(), found.filter(|r| r.ready));
        }
        Ok(records[&reference].clone().ok_or_else(|| {
            EngineError::Input(InputError::new(
                ErrorCode::AdapterNotFound,
                request.adapter_field.as_str(),
                format!("adapter {reference} no longer exists"),
            ))
        }))
    }

    /// What the engine is asked to run for `request`: with the adapter it
    /// names resolved to the files of the version stored now.
    async fn engine_request(
        &self,
        account: &AccountId,
        request: ValidRequest,
        lane: Lane,
        records: &mut Records,
    ) -> Result<Result<Request, EngineError>, BatcherError> {
        let partition = (!self.inner.config.share_prefix_cache).then(|| account.0.clone());
        let span = tracing::Span::current();
        if request.lora.is_none() {
            return Ok(Ok(Request::new(request, lane)
                .in_cache_partition(partition)
                .for_account(Some(account.0.clone()))
                .in_span(span)));
        }
        let adapter = self
            .adapter_record(account, &request, records)
            .await?
            .and_then(|record| adapters::reference(&record));
        Ok(adapter.map(|adapter| {
            Request::new(request, lane)
                .with_adapter(Some(adapter))
                .in_cache_partition(partition)
                .for_account(Some(account.0.clone()))
                .in_span(span)
        }))
    }

    /// End a dead-lettered chunk's unfinished requests with a non-retryable error.
    pub async fn process_dead_letter(&self, chunk: &Chunk) -> Result<u64, BatcherError> {
        let error = RequestError {
            kind: "errored".into(),
            code: ErrorCode::DeliveryLimitExceeded.as_str().into(),
            message: "the request failed on every delivery and was dead-lettered".into(),
            retryable: false,
        };
        let ended = self.inner.store.fail_chunk(chunk, &error).await?;
        let written = Committed {
            rows: ended,
            errored: ended,
            ..Committed::default()
        };
        self.inner.metrics.ended(Lane::Batch, &chunk.model, &written);
        self.inner.finaliser.try_finalize(&chunk.batch_id).await?;
        Ok(ended)
    }

    /// Consume until `stop`, reconnecting to the broker whenever the connection drops.
    pub async fn run(&self, stop: CancellationToken) {
        broker::reconnecting("the worker", &stop, || self.session(&stop)).await
    }

    async fn session(&self, stop: &CancellationToken) -> Result<(), BatcherError> {
        let inner = &self.inner;
        let connection = broker::connect(&inner.config.amqp_url, "lorry-worker").await?;
        let topology = &inner.config.topology;
        let models = self.models();
        let setup = connection.create_channel().await?;
        topology.declare(&setup, models.iter().map(String::as_str)).await?;
        let replies = Publisher::open(&connection).await?;
        let mut consumers = JoinSet::new();
        // Bound before any real-time request is taken, so that no cancellation
        // of a request this session serves can be published where nobody hears it.
        consumers.spawn(
            self.clone()
                .follow_cancels(cancel_consumer(&connection, topology).await?, stop.clone()),
        );
        for model in &models {
            let rt = consumer(&connection, &topology.rt_queue(model), inner.config.rt_prefetch, 10).await?;
            consumers.spawn(self.clone().consume(rt, Kind::RealTime(replies.clone()), stop.clone()));
            // The batch queue and its queue ahead, each with a prefetch of its own.
            for queue in [topology.batch_queue(model), topology.batch_ahead_queue(model)] {
                let batch = consumer(&connection, &queue, inner.config.batch_prefetch, 0).await?;
                consumers.spawn(self.clone().consume(batch, Kind::Batch, stop.clone()));
            }
        }
        let dlq = consumer(&connection, &topology.dead_letter_queue(), 1, 0).await?;
        consumers.spawn(self.clone().consume(dlq, Kind::DeadLetter, stop.clone()));
        // Consumers end on `stop` after their work in hand is settled, or when the connection drops.
        inner.consuming.store(true, std::sync::atomic::Ordering::Release);
        let mut outcome = Ok(());
        while let Some(ended) = consumers.join_next().await {
            inner.consuming.store(false, std::sync::atomic::Ordering::Release);
            if let Ok(Err(e)) = ended {
                outcome = Err(e);
                consumers.abort_all();
            }
        }
        let _ = connection.close(200, "worker stopping").await;
        outcome
    }

    async fn consume(
        self,
        (channel, mut deliveries): (Channel, lapin::Consumer),
        kind: Kind,
        stop: CancellationToken,
    ) -> Result<(), BatcherError> {
        let mut in_flight = JoinSet::new();
        let ended = loop {
            let next = tokio::select! {
                _ = stop.cancelled() => break Ok(()),
                next = deliveries.next() => next,
            };
            let delivery = match next {
                Some(Ok(delivery)) => delivery,
                Some(Err(e)) => break Err(BatcherError::from(e)),
                None => break Err(BatcherError::BrokerLost("the consumer was cancelled".into())),
            };
            let worker = self.clone();
            let kind = kind.clone();
            in_flight.spawn(async move { worker.handle(delivery, kind).await });
            while in_flight.try_join_next().is_some() {}
        };
        if ended.is_ok() {
            // Graceful stop: finish and settle what this consumer holds.
            let _ =
                tokio::time::timeout(SHUTDOWN_GRACE, async { while in_flight.join_next().await.is_some() {} }).await;
        }
        drop(channel);
        ended
    }

    /// Cancel the real-time requests whose clients went away, as the API announces them.
    async fn follow_cancels(
        self,
        (channel, mut deliveries): (Channel, lapin::Consumer),
        stop: CancellationToken,
    ) -> Result<(), BatcherError> {
        let ended = loop {
            let next = tokio::select! {
                _ = stop.cancelled() => break Ok(()),
                next = deliveries.next() => next,
            };
            match next {
                Some(Ok(delivery)) => {
                    if let Ok(correlation) = std::str::from_utf8(&delivery.data) {
                        self.inner.cancels.cancel(correlation);
                    }
                }
                Some(Err(e)) => break Err(BatcherError::from(e)),
                None => break Err(BatcherError::BrokerLost("the cancel consumer was cancelled".into())),
            }
        };
        drop(channel);
        ended
    }

    async fn handle(&self, delivery: Delivery, kind: Kind) {
        // The message's work, in the trace of the request that sent it.
        let span = match &kind {
            Kind::RealTime(_) => {
                tracing::info_span!("lorry.realtime", otel.kind = "consumer", queue = %delivery.routing_key)
            }
            Kind::Batch => tracing::info_span!("lorry.chunk", otel.kind = "consumer", queue = %delivery.routing_key),
            Kind::DeadLetter => tracing::info_span!("lorry.dead_letter", otel.kind = "consumer"),
        };
        crate::trace::follow(&span, crate::trace::from_message(&delivery.properties).as_deref());
        let settled = async {
            match &kind {
                Kind::RealTime(replies) => self.handle_realtime(&delivery, replies).await,
                Kind::Batch | Kind::DeadLetter => self.handle_chunk(&delivery, matches!(kind, Kind::DeadLetter)).await,
            }
        }
        .instrument(span)
        .await;
        let result = match settled {
            Settle::Ack => delivery.ack(BasicAckOptions::default()).await,
            Settle::Retry => {
                tokio::time::sleep(Duration::from_millis(200)).await;
                delivery
                    .nack(BasicNackOptions {
                        requeue: true,
                        ..Default::default()
                    })
                    .await
            }
        };
        if let Err(e) = result {
            // The channel is gone; the broker will deliver the message again.
            tracing::debug!(error = %e, "could not settle a delivery");
        }
        if matches!(kind, Kind::Batch | Kind::DeadLetter) {
            // A chunk served (acked, or dead-lettered) is no longer in flight
            // for the fair dispatch; either way, wake the relays, which keep
            // the batch queue only a few chunks deep and top it up now.
            let served = match (&settled, serde_json::from_slice::<Chunk>(&delivery.data)) {
                (Settle::Ack, Ok(chunk)) => Some(chunk),
                _ => None,
            };
            let woken = match &served {
                Some(chunk) => self.inner.store.chunk_done(chunk).await,
                None if matches!(kind, Kind::Batch) => self.inner.store.notify_outbox().await,
                None => Ok(()),
            };
            if let Err(e) = woken {
                tracing::debug!(error = %e, "could not wake the outbox relays");
            }
        }
    }

    async fn handle_chunk(&self, delivery: &Delivery, dead: bool) -> Settle {
        if dead && delivery.properties.reply_to().is_some() {
            // A real-time request (they carry a reply queue; chunks do not)
            // that expired in its queue or failed every delivery: its caller
            // has already been answered (a timeout), so there is nothing to end.
            tracing::info!("dropping a dead-lettered real-time request; its caller timed out");
            return Settle::Ack;
        }
        let chunk: Chunk = match serde_json::from_slice(&delivery.data) {
            Ok(chunk) => chunk,
            Err(e) => {
                tracing::error!(error = %e, "dropping a message that is not a chunk");
                return Settle::Ack;
            }
        };
        let result = if dead {
            self.process_dead_letter(&chunk).await.map(|_| ChunkReport::default())
        } else {
            self.process_chunk(&chunk).await
        };
        match result {
            Ok(report) if report.deferred == 0 => Settle::Ack,
            Ok(report) => {
                tracing::warn!(batch = %chunk.batch_id, deferred = report.deferred, "engine refused work; requeueing");
                Settle::Retry
            }
            Err(e) => {
                tracing::warn!(batch = %chunk.batch_id, error = %e, "chunk failed; requeueing");
                Settle::Retry
            }
        }
    }

    async fn handle_realtime(&self, delivery: &Delivery, replies: &Publisher) -> Settle {
        let (Some(reply_to), Some(correlation)) = (
            delivery.properties.reply_to().as_ref(),
            delivery.properties.correlation_id().as_ref(),
        ) else {
            tracing::error!("dropping a real-time request without reply_to or correlation_id");
            return Settle::Ack;
        };
        let reply = realtime::ReplyTo {
            publisher: replies,
            queue: reply_to.as_str(),
            correlation: correlation.as_str(),
        };
        let request: RtRequest = match serde_json::from_slice(&delivery.data) {
            Ok(r) => r,
            Err(e) => {
                let _ = reply
                    .send(&Reply::error(ErrorCode::InternalError, &e.to_string()))
                    .await;
                return Settle::Ack;
            }
        };
        tracing::trace!(%correlation, "real-time request taken");
        let inner = &self.inner;
        let cancel = inner.cancels.start(correlation.as_str());
        let adapter = request.request.lora.clone();
        let started = match inner.backends.get(&request.model) {
            Some(backend) => Ok((request.request, backend)),
            None => Err(EngineError::Model(format!(
                "model {} is not served here",
                request.model
            ))),
        };
        let sent = match started {
            Ok((valid, backend)) => {
                let account = request.account_id.clone().unwrap_or_else(|| AccountId(String::new()));
                let submitted = match self
                    .engine_request(&account, valid, Lane::RealTime, &mut Records::default())
                    .await
                {
                    Ok(request) => request.and_then(|request| backend.submit(request)),
                    Err(error) => {
                        tracing::warn!(%error, "the adapter of a real-time request could not be looked up");
                        Err(EngineError::Unavailable(
                            "the adapter's record could not be read".into(),
                        ))
                    }
                };
                match submitted {
                    Ok(events) => realtime::forward(events, &reply, &cancel).await,
                    Err(e) => reply.send(&Reply::engine_error(&e)).await.map(|()| Forwarded::Failed),
                }
            }
            Err(e) => reply.send(&Reply::engine_error(&e)).await.map(|()| Forwarded::Failed),
        };
        inner.cancels.finish(correlation.as_str());
        // Labelled only with a model served here: label values stay few.
        let model = if inner.backends.contains_key(&request.model) {
            request.model.as_str()
        } else {
            "unknown"
        };
        let ended = match sent {
            Ok(Forwarded::Served(usage)) => Committed {
                rows: 1,
                succeeded: 1,
                prompt_tokens: usage.prompt_tokens.into(),
                completion_tokens: usage.completion_tokens.into(),
                ..Committed::default()
            },
            Ok(Forwarded::Cancelled) => {
                inner.metrics.cancelled(model);
                Committed::default()
            }
            Ok(Forwarded::Failed) | Err(_) => Committed {
                rows: 1,
                errored: 1,
                ..Committed::default()
            },
        };
        inner.metrics.ended(Lane::RealTime, model, &ended);
        match sent {
            // A request served is counted for its account once its answer is out.
            Ok(Forwarded::Served(usage)) => {
                if let Some(account) = &request.account_id {
                    let recorded = inner
                        .store
                        .record_realtime_usage(
                            account,
                            &request.model,
                            adapter.as_deref(),
                            usage.prompt_tokens,
                            usage.completion_tokens,
                        )
                        .await;
                    if let Err(e) = recorded {
                        tracing::warn!(error = %e, "could not record a real-time request's usage");
                    }
                }
            }
            Ok(Forwarded::Failed | Forwarded::Cancelled) => {}
            Err(e) => tracing::debug!(error = %e, "could not answer a real-time request"),
        }
        Settle::Ack
    }
}

#[derive(Clone)]
enum Kind {
    RealTime(Publisher),
    Batch,
    DeadLetter,
}

enum Settle {
    Ack,
    Retry,
}

fn outcome(index: i32, result: Result<lorry_engine::Output, EngineError>) -> Outcome {
    match result {
        Ok(output) => Outcome {
            index,
            result: Ok(output.result_body()),
            prompt_tokens: output.usage.prompt_tokens as i32,
            completion_tokens: output.usage.completion_tokens as i32,
            finish_reason: output.completion.as_ref().map(|c| c.finish_reason.as_str()),
        },
        Err(e) => Outcome {
            index,
            result: Err(RequestError {
                kind: "errored".into(),
                code: e.code().as_str().into(),
                message: e.to_string(),
                retryable: e.retryable(),
            }),
            prompt_tokens: 0,
            completion_tokens: 0,
            finish_reason: None,
        },
    }
}

/// A private queue bound to the cancellation exchange, gone with the connection.
async fn cancel_consumer(
    connection: &Connection,
    topology: &Topology,
) -> Result<(Channel, lapin::Consumer), BatcherError> {
    let channel = connection.create_channel().await?;
    let queue = broker::private_queue(&channel).await?;
    channel
        .queue_bind(
            &queue,
            &topology.rt_cancel_exchange(),
            "",
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let options = BasicConsumeOptions {
        no_ack: true,
        ..Default::default()
    };
    let consumer = channel
        .basic_consume(&queue, "", options, FieldTable::default())
        .await?;
    Ok((channel, consumer))
}

async fn consumer(
    connection: &Connection,
    queue: &str,
    prefetch: u16,
    priority: i32,
) -> Result<(Channel, lapin::Consumer), BatcherError> {
    let channel = connection.create_channel().await?;
    channel.basic_qos(prefetch.max(1), BasicQosOptions::default()).await?;
    let mut args = FieldTable::default();
    args.insert("x-priority".into(), AMQPValue::LongInt(priority));
    let consumer = channel
        .basic_consume(queue, "", BasicConsumeOptions::default(), args)
        .await?;
    Ok((channel, consumer))
}
