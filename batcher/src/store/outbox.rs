//! The outbox (messages to publish) and webhook deliveries (requests to send),
//! both written in the transaction that changes the state they announce.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{Postgres, Row, Transaction};

use super::{Result, Store};
use crate::ids::{AccountId, BatchId, DeliveryId};

/// The `LISTEN` channel that wakes outbox relays.
pub const OUTBOX_CHANNEL: &str = "lorry_outbox";

/// A message waiting to be published.
#[derive(Debug, Clone, PartialEq)]
pub struct OutboxMessage {
    /// Exchange; empty for the default exchange.
    pub exchange: String,
    /// Routing key (the queue name on the default exchange).
    pub routing_key: String,
    /// The JSON body.
    pub payload: Value,
}

pub(super) async fn insert_outbox(tx: &mut Transaction<'_, Postgres>, messages: &[OutboxMessage]) -> Result<()> {
    if messages.is_empty() {
        return Ok(());
    }
    let exchanges: Vec<&str> = messages.iter().map(|m| m.exchange.as_str()).collect();
    let keys: Vec<&str> = messages.iter().map(|m| m.routing_key.as_str()).collect();
    let payloads: Vec<Value> = messages.iter().map(|m| m.payload.clone()).collect();
    sqlx::query(
        "INSERT INTO outbox (exchange, routing_key, payload) SELECT * FROM UNNEST($1::text[], $2::text[], $3::jsonb[])",
    )
    .bind(&exchanges)
    .bind(&keys)
    .bind(&payloads)
    .execute(&mut **tx)
    .await?;
    sqlx::query("SELECT pg_notify($1, '')")
        .bind(OUTBOX_CHANNEL)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// A webhook delivery whose next attempt is due.
#[derive(Debug, Clone)]
pub struct DueDelivery {
    /// The `webhook-id`.
    pub id: DeliveryId,
    /// The target URL.
    pub url: String,
    /// The JSON body.
    pub payload: Value,
    /// Attempts made before this one.
    pub attempts: i32,
    /// The account's current signing secret.
    pub secret: String,
}

/// A webhook to enqueue alongside a state change.
#[derive(Debug, Clone)]
pub(crate) struct NewDelivery {
    pub account_id: AccountId,
    pub batch_id: BatchId,
    pub event_type: String,
    pub url: String,
    pub payload: Value,
}

pub(super) async fn insert_delivery(tx: &mut Transaction<'_, Postgres>, d: &NewDelivery) -> Result<()> {
    sqlx::query(
        "INSERT INTO webhook_deliveries (id, account_id, batch_id, event_type, url, payload)
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(DeliveryId::generate().as_str())
    .bind(&d.account_id.0)
    .bind(d.batch_id.as_str())
    .bind(&d.event_type)
    .bind(&d.url)
    .bind(&d.payload)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

impl Store {
    /// Run `publish` over up to `limit` unsent outbox messages, oldest first, and mark
    /// those it confirms as sent. Relays on other processes skip the rows held here.
    pub async fn relay_outbox<F, Fut>(&self, limit: i64, publish: F) -> Result<usize>
    where
        F: FnOnce(Vec<OutboxMessage>) -> Fut,
        Fut: std::future::Future<Output = Result<()>>,
    {
        let mut tx = self.pool.begin().await?;
        let rows = sqlx::query(
            "SELECT id, exchange, routing_key, payload FROM outbox WHERE sent_at IS NULL
             ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED",
        )
        .bind(limit)
        .fetch_all(&mut *tx)
        .await?;
        if rows.is_empty() {
            return Ok(0);
        }
        let ids: Vec<i64> = rows.iter().map(|r| r.get("id")).collect();
        let messages = rows
            .iter()
            .map(|r| OutboxMessage {
                exchange: r.get("exchange"),
                routing_key: r.get("routing_key"),
                payload: r.get("payload"),
            })
            .collect();
        publish(messages).await?;
        sqlx::query("UPDATE outbox SET sent_at = now() WHERE id = ANY($1)")
            .bind(&ids)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(ids.len())
    }

    /// Forget outbox rows sent longer ago than `age`.
    pub async fn prune_outbox(&self, age: Duration) -> Result<u64> {
        let done = sqlx::query("DELETE FROM outbox WHERE sent_at < now() - make_interval(secs => $1)")
            .bind(age.as_secs_f64())
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
    }

    /// Lease up to `limit` due webhook deliveries for `lease`, so no other sender takes them meanwhile.
    pub async fn lease_deliveries(&self, limit: i64, lease: Duration) -> Result<Vec<DueDelivery>> {
        let rows = sqlx::query(
            "UPDATE webhook_deliveries d SET next_attempt_at = now() + make_interval(secs => $2)
             FROM accounts a
             WHERE a.id = d.account_id AND d.id IN (
                 SELECT id FROM webhook_deliveries WHERE status = 'pending' AND next_attempt_at <= now()
                 ORDER BY next_attempt_at LIMIT $1 FOR UPDATE SKIP LOCKED)
             RETURNING d.id, d.url, d.payload, d.attempts, a.webhook_secret",
        )
        .bind(limit)
        .bind(lease.as_secs_f64())
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                let id: String = r.try_get("id")?;
                Ok(DueDelivery {
                    id: DeliveryId::parse(&id)
                        .ok_or_else(|| sqlx::Error::Decode(format!("bad delivery id {id}").into()))?,
                    url: r.try_get("url")?,
                    payload: r.try_get("payload")?,
                    attempts: r.try_get("attempts")?,
                    secret: r.try_get("webhook_secret")?,
                })
            })
            .collect()
    }

    /// Record one delivery attempt; `retry_at` is `None` once the delivery has ended.
    pub async fn record_attempt(
        &self,
        delivery: &DueDelivery,
        status_code: Option<u16>,
        error: Option<&str>,
        delivered: bool,
        retry_at: Option<DateTime<Utc>>,
    ) -> Result<()> {
        let attempt = delivery.attempts + 1;
        let status = match (delivered, retry_at) {
            (true, _) => "delivered",
            (false, Some(_)) => "pending",
            (false, None) => "failed",
        };
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT INTO webhook_attempts (delivery_id, attempt, status_code, error) VALUES ($1, $2, $3, $4)
             ON CONFLICT DO NOTHING",
        )
        .bind(delivery.id.as_str())
        .bind(attempt)
        .bind(status_code.map(i32::from))
        .bind(error)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "UPDATE webhook_deliveries SET attempts = $2, status = $3,
                 next_attempt_at = coalesce($4, next_attempt_at),
                 delivered_at = CASE WHEN $3 = 'delivered' THEN now() END
             WHERE id = $1",
        )
        .bind(delivery.id.as_str())
        .bind(attempt)
        .bind(status)
        .bind(retry_at)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }
}
