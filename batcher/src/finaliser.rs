//! Ending batches: the finaliser writes `output.jsonl` (every request, in index
//! order) and `errors.jsonl` to S3, then moves the batch to its terminal status
//! together with its events and webhook, in one transaction. The sweeper
//! expires batches past their window and picks up batches whose finaliser died.
//! A finalisation that fails (S3 or PostgreSQL unreachable) hands its batch
//! back to the sweepers after a backoff of its own (1 s doubling, at most the
//! stale period), so a batch ends soon after the service is back rather than
//! a whole stale period later.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::Utc;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::broker::Topology;
use crate::ids::{AccountId, BatchId, FileId};
use crate::model::{Batch, BatchStatus, OpenAiBatch, RequestStatus};
use crate::objects::{batch_key, ObjectStore};
use crate::openai::{output_line, Endpoint};
use crate::store::{BatchDeletion, Ending, NewFile, OutboxMessage, Store};
use crate::BatcherError;

/// How long a presigned `output_url` in a webhook stays valid.
pub const WEBHOOK_URL_TTL: Duration = Duration::from_secs(24 * 3600);

/// How often the sweeper deletes expired files and batches past retention.
pub const PURGE_EVERY: Duration = Duration::from_secs(10);

/// Remove an ended batch's objects once its rows are gone: its output and
/// error files and everything under its prefix.
pub async fn remove_batch_objects(
    objects: &ObjectStore,
    account: &AccountId,
    id: &BatchId,
    keys: &[String],
) -> Result<(), BatcherError> {
    for key in keys {
        objects.delete(key).await?;
    }
    objects.delete_prefix(&batch_key(account, id, "")).await?;
    Ok(())
}

/// How batches are ended and reported.
#[derive(Clone, Debug)]
pub struct FinaliserConfig {
    /// Take over a batch left `finalizing` this long (its finaliser died).
    pub stale_after: Duration,
    /// Report a running batch's progress at most this often.
    pub progress_every: Duration,
    /// Purge batches ended, and uploaded files made, this long ago (`None`: keep them).
    pub retention: Option<Duration>,
}

/// Ends batches and reports their progress; cheap to clone.
#[derive(Clone, Debug)]
pub struct Finaliser {
    store: Store,
    objects: ObjectStore,
    topology: Topology,
    config: FinaliserConfig,
    /// Failed finalisations so far of each batch this finaliser tried.
    failures: Arc<Mutex<HashMap<BatchId, u32>>>,
}

/// How many batches' failure counts a finaliser keeps (the oldest are
/// forgotten past it: their next retry starts the backoff again).
const FAILURES_KEPT: usize = 1024;

/// The wait before a batch whose finalisation failed `failures` times is
/// tried again: 1 s doubling, at most `stale_after`.
pub fn finalize_retry_delay(failures: u32, stale_after: Duration) -> Duration {
    let doubled = Duration::from_secs(1).saturating_mul(1u32 << failures.saturating_sub(1).min(20));
    doubled.min(stale_after)
}

impl Finaliser {
    /// A finaliser writing to `objects` and announcing on `topology`'s events exchange.
    pub fn new(store: Store, objects: ObjectStore, topology: Topology, config: FinaliserConfig) -> Self {
        Finaliser {
            store,
            objects,
            topology,
            config,
            failures: Arc::default(),
        }
    }

    /// Send a `batch.progress` event and webhook if the batch is due one.
    pub async fn report_progress(&self, id: &BatchId) -> Result<bool, BatcherError> {
        let Some(batch) = self.store.claim_progress(id, self.config.progress_every).await? else {
            return Ok(false);
        };
        let tally = self.store.tally(id).await?;
        let data = batch.to_json(&tally, None, None);
        let (event, webhook) = self.announcement("batch.progress", &batch.id, data, Utc::now());
        self.store.announce(&batch, &[event], Some(&webhook)).await?;
        Ok(true)
    }

    fn announcement(
        &self,
        event_type: &str,
        id: &BatchId,
        data: Value,
        at: chrono::DateTime<Utc>,
    ) -> (OutboxMessage, (String, Value)) {
        let event = OutboxMessage {
            exchange: self.topology.events_exchange(),
            routing_key: event_type.to_string(),
            payload: cloud_event(event_type, id, &data),
            account_id: None,
            traceparent: crate::trace::traceparent(&tracing::Span::current()),
        };
        // OpenAI's event shape (`id`, `object`, `created_at`, `type`, `data`),
        // which its SDKs' `webhooks.unwrap()` parses, with Lorry's `timestamp`.
        let webhook = json!({
            "id": format!("evt_{}", uuid::Uuid::now_v7().simple()),
            "object": "event",
            "created_at": at.timestamp(),
            "type": event_type,
            "timestamp": at.to_rfc3339(),
            "data": data,
        });
        (event, (event_type.to_string(), webhook))
    }

    /// Finalise the batch if all its requests have ended and nobody else is on it.
    pub async fn try_finalize(&self, id: &BatchId) -> Result<bool, BatcherError> {
        match self.store.begin_finalizing(id).await? {
            Some(batch) => self.finalize(batch).await,
            None => Ok(false),
        }
    }

    /// Write the output of a batch in `finalizing` and end it. If that
    /// fails, the batch is handed back to the sweepers after its backoff.
    pub async fn finalize(&self, batch: Batch) -> Result<bool, BatcherError> {
        let id = batch.id.clone();
        let outcome = self.write_ending(batch).await;
        let failures = {
            let mut failures = self.failures.lock().unwrap();
            if outcome.is_ok() {
                failures.remove(&id);
                return outcome;
            }
            if failures.len() >= FAILURES_KEPT {
                failures.clear();
            }
            let count = failures.entry(id.clone()).or_insert(0);
            *count += 1;
            *count
        };
        let delay = finalize_retry_delay(failures, self.config.stale_after);
        match self
            .store
            .retry_finalizing_after(&id, self.config.stale_after, delay)
            .await
        {
            Ok(_) => tracing::warn!(batch = %id, failures, retry_in = ?delay, "finalising failed"),
            // The stale period hands it back instead.
            Err(e) => tracing::warn!(batch = %id, failures, error = %e, "finalising failed; not rescheduled"),
        }
        outcome
    }

    async fn write_ending(&self, batch: Batch) -> Result<bool, BatcherError> {
        let finished = self.store.finished_requests(&batch.id).await?;
        let rendered = Rendered::of(&batch, &finished)?;
        let output_key = batch_key(&batch.account_id, &batch.id, "output.jsonl");
        let (output_bytes, errors_bytes) = (rendered.output.len(), rendered.errors.len());
        self.objects
            .put(&output_key, rendered.output, "application/jsonl")
            .await?;
        let errors_key = if rendered.errors.is_empty() {
            None
        } else {
            let key = batch_key(&batch.account_id, &batch.id, "errors.jsonl");
            self.objects.put(&key, rendered.errors, "application/jsonl").await?;
            Some(key)
        };
        let output = (output_key.as_str(), output_bytes, rendered.output_lines);
        let errors = errors_key
            .as_deref()
            .map(|key| (key, errors_bytes, rendered.error_lines));
        let (files, openai_fields) = match rendered.openai {
            true => openai_files(&batch, output, errors),
            false => (Vec::new(), None),
        };
        let status = match batch.end_reason.as_deref() {
            Some("cancelled") => BatchStatus::Cancelled,
            Some("expired") => BatchStatus::Expired,
            _ => BatchStatus::Completed,
        };
        let at = Utc::now();
        let ended = ended(&batch, status, at, openai_fields.clone());
        let tally = self.store.tally(&batch.id).await?;
        let output_url = self.objects.presign_get(&output_key, WEBHOOK_URL_TTL).await?;
        let errors_url = match &errors_key {
            Some(key) => Some(self.objects.presign_get(key, WEBHOOK_URL_TTL).await?),
            None => None,
        };
        let data = ended.to_json(&tally, Some(output_url), errors_url);
        let (event, webhook) = self.announcement(&format!("batch.{}", status.as_str()), &batch.id, data, at);
        let ending = Ending {
            status,
            at,
            output_key,
            errors_key,
            events: vec![event],
            webhook: Some(webhook),
            files,
            openai: openai_fields,
        };
        let done = self.store.finish(&batch, &ending).await?;
        if done {
            tracing::info!(batch = %batch.id, status = status.as_str(), "batch ended");
        }
        Ok(done)
    }

    /// One sweep: expire batches past their window, finalise batches left open
    /// with nothing running, and take over stale finalisations.
    pub async fn sweep(&self) -> Result<usize, BatcherError> {
        let mut ended = 0;
        self.store.expire_due().await?;
        for id in self.store.ready_to_finalize(100).await? {
            ended += usize::from(self.try_finalize(&id).await?);
        }
        for batch in self.store.reclaim_stale_finalizing(self.config.stale_after).await? {
            ended += usize::from(self.finalize(batch).await?);
        }
        Ok(ended)
    }

    /// Delete expired files, and batches and uploads past the retention
    /// period, rows first, then their objects; returns how many of each.
    pub async fn purge(&self) -> Result<(usize, usize), BatcherError> {
        let mut files = 0;
        loop {
            let expired = self.store.delete_expired_files(self.config.retention, 100).await?;
            for (_, key) in &expired {
                self.objects.delete(key).await?;
            }
            files += expired.len();
            if expired.len() < 100 {
                break;
            }
        }
        let mut batches = 0;
        if let Some(age) = self.config.retention {
            loop {
                let due = self.store.batches_ended_before(age, 100).await?;
                for (account, id) in &due {
                    if let BatchDeletion::Deleted { keys } = self.store.delete_batch(account, id).await? {
                        remove_batch_objects(&self.objects, account, id, &keys).await?;
                        batches += 1;
                    }
                }
                if due.len() < 100 {
                    break;
                }
            }
        }
        Ok((files, batches))
    }

    /// Sweep every `interval` until `stop`.
    pub async fn run(&self, interval: Duration, stop: CancellationToken) {
        let mut pruned_at = tokio::time::Instant::now();
        let mut purged_at: Option<tokio::time::Instant> = None;
        loop {
            if let Err(e) = self.sweep().await {
                tracing::warn!(error = %e, "sweep failed");
            }
            if pruned_at.elapsed() > Duration::from_secs(3600) {
                let _ = self.store.prune_outbox(Duration::from_secs(24 * 3600)).await;
                pruned_at = tokio::time::Instant::now();
            }
            if purged_at.is_none_or(|at| at.elapsed() > PURGE_EVERY.max(interval)) {
                match self.purge().await {
                    Ok((0, 0)) => {}
                    Ok((files, batches)) => tracing::info!(files, batches, "purged what expired"),
                    Err(e) => tracing::warn!(error = %e, "purge failed"),
                }
                purged_at = Some(tokio::time::Instant::now());
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(interval) => {}
            }
        }
    }
}

/// A batch event in CloudEvents 1.0 JSON form.
pub fn cloud_event(event_type: &str, batch: &BatchId, data: &Value) -> Value {
    json!({
        "specversion": "1.0",
        "id": uuid::Uuid::now_v7().to_string(),
        "source": "lorry/batches",
        "type": format!("dev.lorry.{event_type}"),
        "subject": batch,
        "time": Utc::now().to_rfc3339(),
        "datacontenttype": "application/json",
        "data": data,
    })
}

/// A finished batch's output and error files, rendered in its API shape.
struct Rendered {
    output: Vec<u8>,
    output_lines: i32,
    errors: Vec<u8>,
    error_lines: i32,
    /// Written in OpenAI's line format (a batch made from a file).
    openai: bool,
}

impl Rendered {
    /// Every ended request's line, in index order. A batch made from a file
    /// writes OpenAI's lines: every success in the output file, every failure
    /// in the error file; other batches write every line to the output and
    /// repeat the failures in the error file.
    fn of(batch: &Batch, finished: &[crate::model::FinishedRequest]) -> Result<Self, BatcherError> {
        let openai = batch
            .openai
            .as_ref()
            .and_then(|o| Some((Endpoint::from_path(&o.endpoint)?, o.model.clone())));
        let created = batch.times.created_at.timestamp();
        let mut rendered = Rendered {
            output: Vec::new(),
            output_lines: 0,
            errors: Vec::new(),
            error_lines: 0,
            openai: openai.is_some(),
        };
        for request in finished {
            let line = match &openai {
                Some((endpoint, model)) => output_line(&batch.id, *endpoint, model, created, request),
                None => request.result_line(&batch.id),
            };
            let mut line = serde_json::to_vec(&line)?;
            line.push(b'\n');
            let failed = request.status != RequestStatus::Succeeded;
            if failed {
                rendered.errors.extend_from_slice(&line);
                rendered.error_lines += 1;
            }
            if !failed || openai.is_none() {
                rendered.output.extend_from_slice(&line);
                rendered.output_lines += 1;
            }
        }
        Ok(rendered)
    }
}

/// A batch made from a file records its output and error files as OpenAI
/// files (`(key, bytes, lines)` each) and names them in its `openai` fields.
fn openai_files(
    batch: &Batch,
    output: (&str, usize, i32),
    errors: Option<(&str, usize, i32)>,
) -> (Vec<NewFile>, Option<OpenAiBatch>) {
    let Some(fields) = &batch.openai else {
        return (Vec::new(), None);
    };
    let mut fields = fields.clone();
    let mut files = Vec::new();
    let mut record = |name: &str, (key, bytes, lines): (&str, usize, i32)| {
        let file = NewFile {
            id: FileId::generate(),
            account_id: batch.account_id.clone(),
            purpose: "batch_output".into(),
            filename: name.into(),
            bytes: bytes as i64,
            lines,
            object_key: key.into(),
            expires_after: fields.output_expires_after.map(|secs| secs.min(i64::MAX as u64) as i64),
        };
        let id = file.id.to_string();
        files.push(file);
        id
    };
    if output.2 > 0 {
        fields.output_file_id = Some(record("output.jsonl", output));
    }
    if let Some(errors) = errors {
        fields.error_file_id = Some(record("errors.jsonl", errors));
    }
    (files, Some(fields))
}

/// The batch as it will read once ended with `status` at `at`.
fn ended(batch: &Batch, status: BatchStatus, at: chrono::DateTime<Utc>, openai: Option<OpenAiBatch>) -> Batch {
    let mut ended = batch.clone();
    ended.status = status;
    ended.openai = openai.or(ended.openai);
    match status {
        BatchStatus::Cancelled => ended.times.cancelled_at = Some(at),
        BatchStatus::Expired => ended.times.expired_at = Some(at),
        _ => ended.times.completed_at = Some(at),
    }
    ended
}
