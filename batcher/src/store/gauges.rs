//! Figures of the whole deployment for `/metrics`: the batch lane's queue by
//! model, and batches by status. Read by the API at most once a second.

use sqlx::Row;

use super::{Result, Store};

/// One model's queue in the batch lane.
#[derive(Debug, Clone, PartialEq)]
pub struct QueuedRequests {
    /// The model.
    pub model: String,
    /// Requests not yet started, of batches still being served.
    pub queued: u64,
    /// Seconds since the oldest batch with a request not yet started was accepted.
    pub oldest_seconds: f64,
}

impl Store {
    /// The batch lane's queue, by model (models with nothing queued left out).
    pub async fn queued_requests(&self) -> Result<Vec<QueuedRequests>> {
        // Open batches only (an index), and their unfinished requests only (another).
        let rows = sqlx::query(
            "SELECT b.model, count(*),
                    extract(epoch FROM now() - min(b.created_at))::float8
             FROM batches b JOIN requests r ON r.batch_id = b.id AND r.status IN ('pending', 'running')
             WHERE b.status IN ('in_progress', 'cancelling') AND r.status = 'pending'
             GROUP BY b.model",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| {
                Ok(QueuedRequests {
                    model: row.try_get(0)?,
                    queued: row.try_get::<i64, _>(1)?.max(0) as u64,
                    oldest_seconds: row.try_get::<Option<f64>, _>(2)?.unwrap_or(0.0).max(0.0),
                })
            })
            .collect()
    }

    /// How many batches are in each status (statuses with none left out).
    pub async fn batches_by_status(&self) -> Result<Vec<(String, u64)>> {
        let rows = sqlx::query("SELECT status, count(*) FROM batches GROUP BY status")
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|row| Ok((row.try_get(0)?, row.try_get::<i64, _>(1)?.max(0) as u64)))
            .collect()
    }
}
