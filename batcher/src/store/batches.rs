//! Batches and their requests: creation, reads, cancellation.

use std::collections::HashMap;
use std::time::Duration;

use lorry_engine::ValidRequest;
use serde_json::Value;
use sqlx::postgres::PgRow;
use sqlx::{FromRow, Postgres, Row, Transaction};

use super::accounts::lock_active;
use super::outbox::{insert_outbox, OutboxMessage};
use super::{Result, Store};
use crate::ids::{AccountId, BatchId};
use crate::model::{
    unstarted_error, Batch, BatchStatus, BatchTimes, FinishedRequest, OpenAiBatch, RequestError, RequestStatus, Shape,
    Tally,
};
use crate::BatcherError;

/// A batch the API has validated, ready to be written.
#[derive(Debug, Clone)]
pub struct NewBatch {
    /// Its id.
    pub id: BatchId,
    /// The owner.
    pub account_id: AccountId,
    /// The served model name.
    pub model: String,
    /// The API shape it came in.
    pub shape: Shape,
    /// OpenAI's fields, for a batch made from a file.
    pub openai: Option<OpenAiBatch>,
    /// The window as given, e.g. `24h`.
    pub completion_window: String,
    /// The window as a duration.
    pub window: Duration,
    /// Client metadata.
    pub metadata: Option<Value>,
    /// The webhook target.
    pub webhook_url: Option<String>,
    /// The `Idempotency-Key` header.
    pub idempotency_key: Option<String>,
    /// A digest of the request body, to tell a retry from a reuse of the key.
    pub request_hash: String,
    /// The requests, in index order.
    pub requests: Vec<NewRequest>,
    /// Among the account's own batches, higher goes out first (-10 to 10; 0 by default).
    pub priority: i16,
}

/// One validated request of a new batch.
#[derive(Debug, Clone)]
pub struct NewRequest {
    /// The client's id.
    pub custom_id: Option<String>,
    /// The request, as validated (its adapter resolved to an id).
    pub request: ValidRequest,
}

/// What [`Store::create_batch`] did.
#[derive(Debug)]
pub enum Created {
    /// The batch was written.
    New(Batch),
    /// The idempotency key was seen before; `same_request` tells whether the body matched.
    Existing {
        /// The batch created under that key.
        batch: Batch,
        /// Whether the earlier request had the same body.
        same_request: bool,
    },
    /// The account was disabled (or deleted) after its key was checked: nothing written.
    AccountDisabled,
    /// The account's batch requests not yet ended, with these, would pass its limit: nothing written.
    OverQuota(crate::quota::OverQuota),
}

/// One page of a batch listing.
#[derive(Debug)]
pub struct Page {
    /// Newest first.
    pub batches: Vec<Batch>,
    /// Whether older batches follow.
    pub has_more: bool,
}

const BATCH_COLUMNS: &str = "id, account_id, model, shape, status, end_reason, total, completion_window, metadata,
    webhook_url, output_key, errors_key, created_at, in_progress_at, expires_at, finalizing_at, completed_at,
    failed_at, expired_at, cancelling_at, cancelled_at, openai, priority";

pub(super) fn batch_from_row(row: &PgRow) -> Result<Batch> {
    let status: String = row.try_get("status")?;
    let shape: String = row.try_get("shape")?;
    let id: String = row.try_get("id")?;
    Ok(Batch {
        id: BatchId::parse(&id).ok_or_else(|| corrupt("batch id", &id))?,
        account_id: AccountId(row.try_get("account_id")?),
        model: row.try_get("model")?,
        shape: match shape.as_str() {
            "workers_ai" => Shape::WorkersAi,
            "openai" => Shape::OpenAi,
            _ => Shape::Native,
        },
        openai: row
            .try_get::<Option<sqlx::types::Json<OpenAiBatch>>, _>("openai")?
            .map(|json| json.0),
        status: BatchStatus::parse(&status).ok_or_else(|| corrupt("batch status", &status))?,
        end_reason: row.try_get("end_reason")?,
        total: row.try_get("total")?,
        completion_window: row.try_get("completion_window")?,
        metadata: row.try_get("metadata")?,
        webhook_url: row.try_get("webhook_url")?,
        output_key: row.try_get("output_key")?,
        errors_key: row.try_get("errors_key")?,
        times: BatchTimes::from_row(row)?,
        priority: row.try_get("priority")?,
    })
}

pub(super) fn corrupt(what: &str, value: &str) -> BatcherError {
    BatcherError::Database(sqlx::Error::Decode(format!("unexpected {what} {value:?}").into()))
}

pub(super) fn finished_from_row(row: &PgRow) -> Result<FinishedRequest> {
    let status: String = row.try_get("status")?;
    let error: Option<Value> = row.try_get("error")?;
    Ok(FinishedRequest {
        index: row.try_get("idx")?,
        custom_id: row.try_get("custom_id")?,
        status: RequestStatus::parse(&status).ok_or_else(|| corrupt("request status", &status))?,
        response: row.try_get("response")?,
        finish_reason: row.try_get("finish_reason")?,
        error: error.map(serde_json::from_value::<RequestError>).transpose()?,
        prompt_tokens: row.try_get("prompt_tokens")?,
        completion_tokens: row.try_get("completion_tokens")?,
    })
}

impl Store {
    /// Write a batch, its requests and their outbox messages in one transaction.
    pub async fn create_batch(&self, new: NewBatch, outbox: Vec<OutboxMessage>) -> Result<Created> {
        self.create_batch_within(new, outbox, 0).await
    }

    /// [`Store::create_batch`], if the account's batch requests not yet
    /// ended stay within `queued_limit` with these (0: no limit).
    pub async fn create_batch_within(
        &self,
        new: NewBatch,
        outbox: Vec<OutboxMessage>,
        queued_limit: u64,
    ) -> Result<Created> {
        let mut tx = self.pool.begin().await?;
        // Held to the commit, so that disabling the account waits for this
        // batch and then cancels it, or comes first and refuses it here; and
        // so that two batches of one account are counted one after the other.
        if lock_active(&mut tx, &new.account_id, queued_limit > 0).await?.is_none() {
            tx.rollback().await?;
            return Ok(Created::AccountDisabled);
        }
        if queued_limit > 0 {
            let queued: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM batches b JOIN requests r ON r.batch_id = b.id
                 WHERE b.account_id = $1 AND b.status IN ('validating', 'in_progress', 'cancelling', 'finalizing')
                   AND r.status IN ('pending', 'running')",
            )
            .bind(&new.account_id.0)
            .fetch_one(&mut *tx)
            .await?;
            if let Err(over) = crate::quota::within(queued as u64, new.requests.len() as u64, queued_limit) {
                tx.rollback().await?;
                return Ok(Created::OverQuota(over));
            }
        }
        let window_secs = new.window.as_secs_f64();
        let inserted = sqlx::query(&format!(
            "INSERT INTO batches (id, account_id, model, shape, status, total, completion_window, metadata,
                 webhook_url, idempotency_key, request_hash, in_progress_at, expires_at, openai, priority)
             VALUES ($1, $2, $3, $4, 'in_progress', $5, $6, $7, $8, $9, $10, now(),
                 now() + make_interval(secs => $11), $12, $13)
             ON CONFLICT (account_id, idempotency_key) DO NOTHING
             RETURNING {BATCH_COLUMNS}"
        ))
        .bind(new.id.as_str())
        .bind(&new.account_id.0)
        .bind(&new.model)
        .bind(new.shape.as_str())
        .bind(new.requests.len() as i32)
        .bind(&new.completion_window)
        .bind(&new.metadata)
        .bind(&new.webhook_url)
        .bind(&new.idempotency_key)
        .bind(&new.request_hash)
        .bind(window_secs)
        .bind(new.openai.as_ref().map(sqlx::types::Json))
        .bind(new.priority)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = inserted else {
            tx.rollback().await?;
            return self.existing_for_key(&new).await;
        };
        let batch = batch_from_row(&row)?;
        insert_requests(&mut tx, &new).await?;
        insert_outbox(&mut tx, &outbox).await?;
        tx.commit().await?;
        Ok(Created::New(batch))
    }

    async fn existing_for_key(&self, new: &NewBatch) -> Result<Created> {
        let row = sqlx::query(&format!(
            "SELECT {BATCH_COLUMNS}, request_hash FROM batches WHERE account_id = $1 AND idempotency_key = $2"
        ))
        .bind(&new.account_id.0)
        .bind(&new.idempotency_key)
        .fetch_one(&self.pool)
        .await?;
        let hash: Option<String> = row.try_get("request_hash")?;
        Ok(Created::Existing {
            batch: batch_from_row(&row)?,
            same_request: hash.as_deref() == Some(new.request_hash.as_str()),
        })
    }

    /// One of the account's batches.
    pub async fn batch(&self, account: &AccountId, id: &BatchId) -> Result<Option<Batch>> {
        let row = sqlx::query(&format!(
            "SELECT {BATCH_COLUMNS} FROM batches WHERE id = $1 AND account_id = $2"
        ))
        .bind(id.as_str())
        .bind(&account.0)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(batch_from_row).transpose()
    }

    /// A batch by id alone (workers).
    pub async fn batch_by_id(&self, id: &BatchId) -> Result<Option<Batch>> {
        let row = sqlx::query(&format!("SELECT {BATCH_COLUMNS} FROM batches WHERE id = $1"))
            .bind(id.as_str())
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(batch_from_row).transpose()
    }

    /// The account's batches, newest first, older than `after`.
    pub async fn list_batches(&self, account: &AccountId, limit: i64, after: Option<&BatchId>) -> Result<Page> {
        let rows = sqlx::query(&format!(
            "SELECT {BATCH_COLUMNS} FROM batches WHERE account_id = $1 AND ($2::text IS NULL OR id < $2)
             ORDER BY id DESC LIMIT $3"
        ))
        .bind(&account.0)
        .bind(after.map(BatchId::as_str))
        .bind(limit + 1)
        .fetch_all(&self.pool)
        .await?;
        let mut batches = rows.iter().map(batch_from_row).collect::<Result<Vec<_>>>()?;
        let has_more = batches.len() as i64 > limit;
        batches.truncate(limit as usize);
        Ok(Page { batches, has_more })
    }

    /// Request counts and usage for several batches at once.
    pub async fn tallies(&self, ids: &[&BatchId]) -> Result<HashMap<BatchId, Tally>> {
        let ids: Vec<&str> = ids.iter().map(|id| id.as_str()).collect();
        let rows = sqlx::query(
            "SELECT batch_id, status, count(*) AS n, coalesce(sum(prompt_tokens), 0)::bigint AS pt,
                    coalesce(sum(completion_tokens), 0)::bigint AS ct
             FROM requests WHERE batch_id = ANY($1) GROUP BY batch_id, status",
        )
        .bind(&ids)
        .fetch_all(&self.pool)
        .await?;
        let mut tallies: HashMap<BatchId, Tally> = HashMap::new();
        for row in rows {
            let id: String = row.try_get("batch_id")?;
            let status: String = row.try_get("status")?;
            let id = BatchId::parse(&id).ok_or_else(|| corrupt("batch id", &id))?;
            let tally = tallies.entry(id).or_default();
            let status = RequestStatus::parse(&status).ok_or_else(|| corrupt("request status", &status))?;
            tally.counts.insert(status, row.try_get("n")?);
            tally.prompt_tokens += row.try_get::<i64, _>("pt")?;
            tally.completion_tokens += row.try_get::<i64, _>("ct")?;
        }
        Ok(tallies)
    }

    /// One batch's tally.
    pub async fn tally(&self, id: &BatchId) -> Result<Tally> {
        Ok(self.tallies(&[id]).await?.remove(id).unwrap_or_default())
    }

    /// Up to `limit` finished requests of a batch after index `after`, in
    /// index order (pages of a listing too large to hold at once).
    pub async fn finished_requests_page(&self, id: &BatchId, after: i32, limit: i64) -> Result<Vec<FinishedRequest>> {
        let rows = sqlx::query(
            "SELECT idx, custom_id, status, response, finish_reason, error, prompt_tokens, completion_tokens
             FROM requests WHERE batch_id = $1 AND idx > $2 AND status NOT IN ('pending', 'running')
             ORDER BY idx LIMIT $3",
        )
        .bind(id.as_str())
        .bind(after)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(finished_from_row).collect()
    }

    /// Every finished request of a batch, in index order.
    pub async fn finished_requests(&self, id: &BatchId) -> Result<Vec<FinishedRequest>> {
        let rows = sqlx::query(
            "SELECT idx, custom_id, status, response, finish_reason, error, prompt_tokens, completion_tokens
             FROM requests WHERE batch_id = $1 AND status NOT IN ('pending', 'running') ORDER BY idx",
        )
        .bind(id.as_str())
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(finished_from_row).collect()
    }

    /// Ask a batch to stop: unstarted requests are cancelled, running ones finish.
    /// Returns the batch as it is after the call, or `None` if it is not the account's.
    pub async fn cancel_batch(&self, account: &AccountId, id: &BatchId) -> Result<Option<Batch>> {
        let mut tx = self.pool.begin().await?;
        let row = sqlx::query(&format!(
            "UPDATE batches SET status = 'cancelling', end_reason = 'cancelled', cancelling_at = now()
             WHERE id = $1 AND account_id = $2 AND status IN ('validating', 'in_progress')
             RETURNING {BATCH_COLUMNS}"
        ))
        .bind(id.as_str())
        .bind(&account.0)
        .fetch_optional(&mut *tx)
        .await?;
        if row.is_none() {
            tx.rollback().await?;
            return self.batch(account, id).await;
        }
        end_unstarted(&mut tx, id, RequestStatus::Canceled).await?;
        tx.commit().await?;
        row.as_ref().map(batch_from_row).transpose()
    }
}

/// End a batch's requests that have not started with `status`, and drop its
/// chunks not yet dispatched.
pub(super) async fn end_unstarted(
    tx: &mut Transaction<'_, Postgres>,
    id: &BatchId,
    status: RequestStatus,
) -> Result<u64> {
    let error = serde_json::to_value(unstarted_error(status))?;
    let done = sqlx::query(
        "UPDATE requests SET status = $2, error = $3, finished_at = now() WHERE batch_id = $1 AND status = 'pending'",
    )
    .bind(id.as_str())
    .bind(status.as_str())
    .bind(error)
    .execute(&mut **tx)
    .await?;
    // Its chunks still held for fair dispatch have nothing left to serve.
    sqlx::query("DELETE FROM outbox WHERE sent_at IS NULL AND account_id IS NOT NULL AND payload->>'batch_id' = $1")
        .bind(id.as_str())
        .execute(&mut **tx)
        .await?;
    Ok(done.rows_affected())
}

async fn insert_requests(tx: &mut Transaction<'_, Postgres>, new: &NewBatch) -> Result<()> {
    // One statement per 5,000 rows keeps each bind array well under Postgres' limits.
    for (chunk_no, chunk) in new.requests.chunks(5_000).enumerate() {
        let first = (chunk_no * 5_000) as i32;
        let idx: Vec<i32> = (first..first + chunk.len() as i32).collect();
        let custom_ids: Vec<Option<&str>> = chunk.iter().map(|r| r.custom_id.as_deref()).collect();
        // Sent as text and cast to `json`, so that objects keep their keys' order (see migration 0012).
        let requests: Vec<String> = chunk
            .iter()
            .map(|r| serde_json::to_string(&r.request))
            .collect::<std::result::Result<_, _>>()?;
        sqlx::query(
            "INSERT INTO requests (batch_id, idx, custom_id, request)
             SELECT $1, i, c, r::json FROM UNNEST($2::int[], $3::text[], $4::text[]) AS t(i, c, r)",
        )
        .bind(new.id.as_str())
        .bind(&idx)
        .bind(&custom_ids)
        .bind(&requests)
        .execute(&mut **tx)
        .await?;
    }
    Ok(())
}
