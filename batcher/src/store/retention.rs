//! Deleting ended batches and expired files: their rows here, their objects
//! by the caller (after the rows, so that nothing points at a missing object).

use std::time::Duration;

use sqlx::Row;

use super::{Result, Store};
use crate::ids::{AccountId, BatchId, FileId};

/// What deleting a batch did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchDeletion {
    /// No such batch in the account.
    NotFound,
    /// It has not ended: cancel it first.
    NotEnded,
    /// Its rows are gone; these S3 objects are to be removed (its output and
    /// error files, and whatever else is under its prefix).
    Deleted {
        /// The keys of its output and error files.
        keys: Vec<String>,
    },
}

impl Store {
    /// Delete an ended batch's rows: its requests, webhook deliveries, the
    /// OpenAI file records of its output and error files, and the batch.
    pub async fn delete_batch(&self, account: &AccountId, id: &BatchId) -> Result<BatchDeletion> {
        let mut tx = self.pool.begin().await?;
        let row = sqlx::query("SELECT status, openai FROM batches WHERE id = $1 AND account_id = $2 FOR UPDATE")
            .bind(id.as_str())
            .bind(&account.0)
            .fetch_optional(&mut *tx)
            .await?;
        let Some(row) = row else {
            return Ok(BatchDeletion::NotFound);
        };
        let status: String = row.get("status");
        if !matches!(status.as_str(), "completed" | "failed" | "expired" | "cancelled") {
            return Ok(BatchDeletion::NotEnded);
        }
        let openai: Option<serde_json::Value> = row.get("openai");
        let file_ids: Vec<String> = openai
            .iter()
            .flat_map(|o| [o.get("output_file_id"), o.get("error_file_id")])
            .flatten()
            .filter_map(|v| v.as_str().map(str::to_string))
            .collect();
        let keys: Vec<String> =
            sqlx::query_scalar("DELETE FROM files WHERE account_id = $1 AND id = ANY($2) RETURNING object_key")
                .bind(&account.0)
                .bind(&file_ids)
                .fetch_all(&mut *tx)
                .await?;
        for statement in [
            "DELETE FROM webhook_attempts WHERE delivery_id IN (SELECT id FROM webhook_deliveries WHERE batch_id = $1)",
            "DELETE FROM webhook_deliveries WHERE batch_id = $1",
            "DELETE FROM requests WHERE batch_id = $1",
            "DELETE FROM batches WHERE id = $1",
        ] {
            sqlx::query(statement).bind(id.as_str()).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(BatchDeletion::Deleted { keys })
    }

    /// Up to `limit` batches that ended more than `age` ago, with their accounts.
    pub async fn batches_ended_before(&self, age: Duration, limit: i64) -> Result<Vec<(AccountId, BatchId)>> {
        let rows = sqlx::query(
            "SELECT account_id, id FROM batches
             WHERE status IN ('completed', 'failed', 'expired', 'cancelled')
               AND coalesce(completed_at, failed_at, expired_at, cancelled_at) < now() - make_interval(secs => $1)
             ORDER BY coalesce(completed_at, failed_at, expired_at, cancelled_at) LIMIT $2",
        )
        .bind(age.as_secs_f64())
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .iter()
            .filter_map(|r| Some((AccountId(r.get("account_id")), BatchId::parse(r.get("id"))?)))
            .collect())
    }

    /// Delete up to `limit` file records that have expired, or (with `age`)
    /// uploads older than it; returns their object keys, to be removed.
    pub async fn delete_expired_files(&self, age: Option<Duration>, limit: i64) -> Result<Vec<(FileId, String)>> {
        let rows = sqlx::query(
            "DELETE FROM files WHERE id IN (
                 SELECT id FROM files
                 WHERE expires_at < now()
                    OR ($1::float8 IS NOT NULL AND purpose = 'batch' AND created_at < now() - make_interval(secs => $1))
                 LIMIT $2)
             RETURNING id, object_key",
        )
        .bind(age.map(|a| a.as_secs_f64()))
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .iter()
            .filter_map(|r| Some((FileId::parse(r.get("id"))?, r.get("object_key"))))
            .collect())
    }
}
