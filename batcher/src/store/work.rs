//! What workers and the finaliser do to the store: claim requests, commit
//! results idempotently, and move batches to their end.

use std::time::Duration;

use chrono::{DateTime, Utc};
use lorry_engine::ValidRequest;
use serde_json::Value;
use sqlx::Row;

use super::batches::{batch_from_row, end_unstarted};
use super::outbox::{insert_delivery, insert_outbox, NewDelivery, OutboxMessage};
use super::{Result, Store};
use crate::ids::BatchId;
use crate::model::{Batch, BatchStatus, Chunk, OpenAiBatch, RequestError, RequestStatus};

/// [`Store::claim`]'s statement: `$1` the batch, `$2..$3` the chunk's indexes.
pub const CLAIM_SQL: &str =
    "UPDATE requests SET status = 'running', attempts = attempts + 1, started_at = coalesce(started_at, now())
     WHERE batch_id = $1 AND idx >= $2 AND idx < $3 AND status IN ('pending', 'running')
     RETURNING idx, request, body, attempts";

/// [`Store::commit`]'s statement: `$1` the batch, `$2..$8` the results
/// (index, status, response, error, prompt and completion tokens, finish
/// reason), `$9..$10` their least and greatest index. It answers what it
/// wrote (not what it was given: a redelivered chunk's rows already ended
/// are left alone), for the metrics. The indexes' range bounds the scan of
/// the batch's rows, so that no plan reads every open request of a large
/// batch for a few results.
pub const COMMIT_SQL: &str = "WITH written AS (
         UPDATE requests r SET status = u.status, response = u.response::json, error = u.error,
             prompt_tokens = u.pt, completion_tokens = u.ct, finish_reason = u.finish, finished_at = now()
         FROM UNNEST($2::int[], $3::text[], $4::text[], $5::jsonb[], $6::int[], $7::int[], $8::text[])
             AS u(idx, status, response, error, pt, ct, finish)
         WHERE r.batch_id = $1 AND r.idx BETWEEN $9 AND $10 AND r.idx = u.idx AND r.status = 'running'
         RETURNING r.status, r.prompt_tokens, r.completion_tokens)
     SELECT count(*), count(*) FILTER (WHERE status = 'succeeded'),
            coalesce(sum(prompt_tokens), 0)::bigint, coalesce(sum(completion_tokens), 0)::bigint
     FROM written";

/// What one [`Store::commit`] wrote.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Committed {
    /// Rows written.
    pub rows: u64,
    /// Of those, succeeded.
    pub succeeded: u64,
    /// Of those, errored.
    pub errored: u64,
    /// The prompt tokens of the rows written.
    pub prompt_tokens: u64,
    /// The tokens they generated.
    pub completion_tokens: u64,
}

/// A request a worker now holds.
#[derive(Debug, Clone)]
pub struct Claimed {
    /// Position in the batch.
    pub index: i32,
    /// The request as the API validated it.
    pub input: ClaimedInput,
    /// Deliveries so far, this one included.
    pub attempts: i32,
}

/// A claimed request's input, as stored.
#[derive(Debug, Clone)]
pub enum ClaimedInput {
    /// The typed request the API validated.
    Valid(ValidRequest),
    /// A stored request this version cannot read (why).
    Unreadable(String),
    /// The client's body, on a row written before requests were stored typed;
    /// the worker validates it.
    Legacy(Value),
}

impl ClaimedInput {
    fn read(request: Option<Value>, body: Option<Value>) -> Self {
        match (request, body) {
            (Some(request), _) => match serde_json::from_value(request) {
                Ok(valid) => ClaimedInput::Valid(valid),
                Err(e) => ClaimedInput::Unreadable(e.to_string()),
            },
            (None, Some(body)) => ClaimedInput::Legacy(body),
            (None, None) => ClaimedInput::Unreadable("the request has no stored input".into()),
        }
    }
}

/// How one request ended.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// Position in the batch.
    pub index: i32,
    /// The response body, or the error.
    pub result: std::result::Result<Value, RequestError>,
    /// Tokens.
    pub prompt_tokens: i32,
    /// Tokens.
    pub completion_tokens: i32,
    /// Why a generation ended (`stop`, `length`).
    pub finish_reason: Option<&'static str>,
}

const BATCH_RETURNING: &str = "RETURNING id, account_id, model, shape, status, end_reason, total, completion_window,
    metadata, webhook_url, output_key, errors_key, created_at, in_progress_at, expires_at, finalizing_at,
    completed_at, failed_at, expired_at, cancelling_at, cancelled_at, openai, priority";

/// How a batch ends, and what announces it.
#[derive(Debug, Clone)]
pub struct Ending {
    /// The terminal status.
    pub status: BatchStatus,
    /// When it ended.
    pub at: DateTime<Utc>,
    /// The S3 key of `output.jsonl`.
    pub output_key: String,
    /// The S3 key of `errors.jsonl`, if any request failed.
    pub errors_key: Option<String>,
    /// Events to publish.
    pub events: Vec<OutboxMessage>,
    /// The webhook to send, if the batch asked for one: (event type, body).
    pub webhook: Option<(String, Value)>,
    /// Output files to record (batches made from a file), and the batch's
    /// `openai` fields naming them.
    pub files: Vec<super::NewFile>,
    /// The batch's `openai` fields after the end.
    pub openai: Option<OpenAiBatch>,
}

async fn announce(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    batch: &Batch,
    events: &[OutboxMessage],
    webhook: Option<&(String, Value)>,
) -> Result<()> {
    insert_outbox(tx, events).await?;
    if let (Some(url), Some((event_type, payload))) = (&batch.webhook_url, webhook) {
        let delivery = NewDelivery {
            account_id: batch.account_id.clone(),
            batch_id: batch.id.clone(),
            event_type: event_type.clone(),
            url: url.clone(),
            payload: payload.clone(),
        };
        insert_delivery(tx, &delivery).await?;
    }
    Ok(())
}

impl Store {
    /// Take the chunk's unfinished requests. A redelivered chunk takes back the
    /// requests its earlier holder left running.
    pub async fn claim(&self, chunk: &Chunk) -> Result<Vec<Claimed>> {
        let rows = sqlx::query(CLAIM_SQL)
            .bind(chunk.batch_id.as_str())
            .bind(chunk.start)
            .bind(chunk.end)
            .fetch_all(&self.pool)
            .await?;
        let mut claimed = rows
            .iter()
            .map(|r| {
                Ok(Claimed {
                    index: r.try_get("idx")?,
                    input: ClaimedInput::read(r.try_get("request")?, r.try_get("body")?),
                    attempts: r.try_get("attempts")?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        claimed.sort_by_key(|c| c.index);
        Ok(claimed)
    }

    /// Write results; a request that already has one keeps it. Returns how many were written.
    pub async fn commit(&self, batch: &BatchId, outcomes: &[Outcome]) -> Result<Committed> {
        if outcomes.is_empty() {
            return Ok(Committed::default());
        }
        let mut idx = Vec::with_capacity(outcomes.len());
        let mut status = Vec::with_capacity(outcomes.len());
        let mut response = Vec::with_capacity(outcomes.len());
        let mut error = Vec::with_capacity(outcomes.len());
        let mut pt = Vec::with_capacity(outcomes.len());
        let mut ct = Vec::with_capacity(outcomes.len());
        let mut finish = Vec::with_capacity(outcomes.len());
        for o in outcomes {
            finish.push(o.finish_reason);
            idx.push(o.index);
            pt.push(o.prompt_tokens);
            ct.push(o.completion_tokens);
            match &o.result {
                Ok(body) => {
                    status.push(RequestStatus::Succeeded.as_str());
                    response.push(Some(serde_json::to_string(body)?));
                    error.push(None);
                }
                Err(e) => {
                    status.push(RequestStatus::Errored.as_str());
                    response.push(None);
                    error.push(Some(serde_json::to_value(e)?));
                }
            }
        }
        let row = sqlx::query(COMMIT_SQL)
            .bind(batch.as_str())
            .bind(&idx)
            .bind(&status)
            .bind(&response)
            .bind(&error)
            .bind(&pt)
            .bind(&ct)
            .bind(&finish)
            .bind(idx.iter().min())
            .bind(idx.iter().max())
            .fetch_one(&self.pool)
            .await?;
        let count = |i: usize| -> Result<u64> { Ok(row.try_get::<i64, _>(i)?.max(0) as u64) };
        let rows = count(0)?;
        let succeeded = count(1)?;
        Ok(Committed {
            rows,
            succeeded,
            errored: rows - succeeded,
            prompt_tokens: count(2)?,
            completion_tokens: count(3)?,
        })
    }

    /// End every unfinished request of a chunk with `error` (the dead-letter path).
    pub async fn fail_chunk(&self, chunk: &Chunk, error: &RequestError) -> Result<u64> {
        let done = sqlx::query(
            "UPDATE requests SET status = 'errored', error = $4, finished_at = now()
             WHERE batch_id = $1 AND idx >= $2 AND idx < $3 AND status IN ('pending', 'running')",
        )
        .bind(chunk.batch_id.as_str())
        .bind(chunk.start)
        .bind(chunk.end)
        .bind(serde_json::to_value(error)?)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }

    /// Move a batch whose requests have all ended to `finalizing`; `None` if it is not
    /// ready or another finaliser got there first.
    pub async fn begin_finalizing(&self, id: &BatchId) -> Result<Option<Batch>> {
        let row = sqlx::query(&format!(
            "UPDATE batches SET status = 'finalizing', finalizing_at = now()
             WHERE id = $1 AND status IN ('in_progress', 'cancelling')
               AND NOT EXISTS (SELECT 1 FROM requests WHERE batch_id = $1 AND status IN ('pending', 'running'))
             {BATCH_RETURNING}"
        ))
        .bind(id.as_str())
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(batch_from_row).transpose()
    }

    /// Batches whose finaliser has been silent for `age` (it died): lease them again.
    pub async fn reclaim_stale_finalizing(&self, age: Duration) -> Result<Vec<Batch>> {
        let rows = sqlx::query(&format!(
            "UPDATE batches SET finalizing_at = now()
             WHERE status = 'finalizing' AND finalizing_at < now() - make_interval(secs => $1)
             {BATCH_RETURNING}"
        ))
        .bind(age.as_secs_f64())
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(batch_from_row).collect()
    }

    /// Hand a batch whose finalisation failed back to the sweepers in
    /// `delay`: its claim dated as if taken `stale_after - delay` ago, so that
    /// [`Store::reclaim_stale_finalizing`] takes it then. False if it is no
    /// longer finalising.
    pub async fn retry_finalizing_after(&self, id: &BatchId, stale_after: Duration, delay: Duration) -> Result<bool> {
        let back = stale_after.saturating_sub(delay);
        let done = sqlx::query(
            "UPDATE batches SET finalizing_at = now() - make_interval(secs => $2)
             WHERE id = $1 AND status = 'finalizing'",
        )
        .bind(id.as_str())
        .bind(back.as_secs_f64())
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Open batches with no unfinished request left (e.g. cancelled while nothing ran).
    pub async fn ready_to_finalize(&self, limit: i64) -> Result<Vec<BatchId>> {
        let ids: Vec<String> = sqlx::query_scalar(
            "SELECT id FROM batches b WHERE status IN ('in_progress', 'cancelling')
               AND NOT EXISTS (SELECT 1 FROM requests r WHERE r.batch_id = b.id AND r.status IN ('pending', 'running'))
             LIMIT $1",
        )
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        Ok(ids.iter().filter_map(|id| BatchId::parse(id)).collect())
    }

    /// Write a batch's end, with its events and webhook, if it is still finalising.
    pub async fn finish(&self, batch: &Batch, ending: &Ending) -> Result<bool> {
        let mut tx = self.pool.begin().await?;
        let done = sqlx::query(
            "UPDATE batches SET status = $2, output_key = $3, errors_key = $4, openai = coalesce($6, openai),
                 completed_at = CASE WHEN $2 = 'completed' THEN $5 END,
                 expired_at = CASE WHEN $2 = 'expired' THEN $5 END,
                 cancelled_at = CASE WHEN $2 = 'cancelled' THEN $5 END
             WHERE id = $1 AND status = 'finalizing'",
        )
        .bind(batch.id.as_str())
        .bind(ending.status.as_str())
        .bind(&ending.output_key)
        .bind(&ending.errors_key)
        .bind(ending.at)
        .bind(ending.openai.as_ref().map(sqlx::types::Json))
        .execute(&mut *tx)
        .await?;
        if done.rows_affected() == 0 {
            tx.rollback().await?;
            return Ok(false);
        }
        for file in &ending.files {
            super::files::insert_file(&mut tx, file).await?;
        }
        announce(&mut tx, batch, &ending.events, ending.webhook.as_ref()).await?;
        tx.commit().await?;
        Ok(true)
    }

    /// Take the right to report a running batch's progress, at most once per `every`
    /// (and not in its first `every`); `None` if it is not due.
    pub async fn claim_progress(&self, id: &BatchId, every: Duration) -> Result<Option<Batch>> {
        let row = sqlx::query(&format!(
            "UPDATE batches SET progress_at = now()
             WHERE id = $1 AND status = 'in_progress'
               AND coalesce(progress_at, created_at) < now() - make_interval(secs => $2)
             {BATCH_RETURNING}"
        ))
        .bind(id.as_str())
        .bind(every.as_secs_f64())
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(batch_from_row).transpose()
    }

    /// Publish events and send a webhook about a batch, without changing it.
    pub async fn announce(
        &self,
        batch: &Batch,
        events: &[OutboxMessage],
        webhook: Option<&(String, Value)>,
    ) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        announce(&mut tx, batch, events, webhook).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Expire open batches past their window: unstarted requests end `expired`,
    /// running ones finish. Returns the batches touched.
    pub async fn expire_due(&self) -> Result<Vec<BatchId>> {
        let ids: Vec<String> = sqlx::query_scalar(
            "SELECT id FROM batches WHERE status = 'in_progress' AND end_reason IS NULL AND expires_at < now()",
        )
        .fetch_all(&self.pool)
        .await?;
        let mut expired = Vec::new();
        for id in ids.iter().filter_map(|id| BatchId::parse(id)) {
            let mut tx = self.pool.begin().await?;
            let marked = sqlx::query(
                "UPDATE batches SET end_reason = 'expired' WHERE id = $1 AND status = 'in_progress' AND end_reason IS NULL",
            )
            .bind(id.as_str())
            .execute(&mut *tx)
            .await?;
            if marked.rows_affected() == 1 {
                end_unstarted(&mut tx, &id, RequestStatus::Expired).await?;
                tx.commit().await?;
                expired.push(id);
            }
        }
        Ok(expired)
    }
}
