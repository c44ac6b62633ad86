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
    /// For the batch lane's chunks: the account it is held under until the
    /// relay's fair dispatch publishes it (`None`: published at once, in order).
    pub account_id: Option<AccountId>,
    /// The trace context of the request that wrote it (W3C `traceparent`),
    /// published in the message's headers.
    pub traceparent: Option<String>,
}

pub(super) async fn insert_outbox(tx: &mut Transaction<'_, Postgres>, messages: &[OutboxMessage]) -> Result<()> {
    if messages.is_empty() {
        return Ok(());
    }
    let exchanges: Vec<&str> = messages.iter().map(|m| m.exchange.as_str()).collect();
    let keys: Vec<&str> = messages.iter().map(|m| m.routing_key.as_str()).collect();
    let payloads: Vec<Value> = messages.iter().map(|m| m.payload.clone()).collect();
    let accounts: Vec<Option<&str>> = messages
        .iter()
        .map(|m| m.account_id.as_ref().map(|a| a.0.as_str()))
        .collect();
    let traces: Vec<Option<&str>> = messages.iter().map(|m| m.traceparent.as_deref()).collect();
    sqlx::query(
        "INSERT INTO outbox (exchange, routing_key, payload, account_id, traceparent)
         SELECT * FROM UNNEST($1::text[], $2::text[], $3::jsonb[], $4::text[], $5::text[])",
    )
    .bind(&exchanges)
    .bind(&keys)
    .bind(&payloads)
    .bind(&accounts)
    .bind(&traces)
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
            "SELECT id, exchange, routing_key, payload, traceparent FROM outbox WHERE sent_at IS NULL AND account_id IS NULL
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
                account_id: None,
                traceparent: r.get("traceparent"),
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

    /// Wake the outbox relays (`NOTIFY`).
    pub async fn notify_outbox(&self) -> Result<()> {
        sqlx::query("SELECT pg_notify($1, '')")
            .bind(OUTBOX_CHANNEL)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// The lanes (routing keys) holding chunks for fair dispatch.
    pub async fn held_lanes(&self) -> Result<Vec<String>> {
        Ok(sqlx::query_scalar(
            "SELECT DISTINCT routing_key FROM outbox WHERE sent_at IS NULL AND account_id IS NOT NULL",
        )
        .fetch_all(&self.pool)
        .await?)
    }

    /// Publish up to `room` of the chunks held for `lane`, taking turns by
    /// account: the account whose last turn is oldest (or that never had
    /// one) goes first, one chunk each in that order, round after round,
    /// each account's chunks by its batches' priority, highest first, then
    /// oldest first. Marks them sent after `publish`
    /// confirms them, and records each account's turn. One relay dispatches
    /// a lane at a time (others find it locked and skip it); returns how
    /// many went out.
    pub async fn dispatch_fair<F, Fut>(&self, lane: &str, room: usize, publish: F) -> Result<usize>
    where
        F: FnOnce(Vec<OutboxMessage>) -> Fut,
        Fut: std::future::Future<Output = Result<()>>,
    {
        if room == 0 {
            return Ok(0);
        }
        let mut tx = self.pool.begin().await?;
        let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock(hashtext('lorry-dispatch:' || $1))")
            .bind(lane)
            .fetch_one(&mut *tx)
            .await?;
        if !locked {
            return Ok(0);
        }
        let rows = sqlx::query(
            "SELECT o.id, o.exchange, o.payload, o.account_id, o.priority, o.traceparent, t.turn
             FROM (SELECT DISTINCT account_id FROM outbox
                   WHERE sent_at IS NULL AND routing_key = $1 AND account_id IS NOT NULL) a
             LEFT JOIN dispatch_turns t ON t.routing_key = $1 AND t.account_id = a.account_id
             CROSS JOIN LATERAL (
                 SELECT o.id, o.exchange, o.payload, o.account_id, coalesce(b.priority, 0::smallint) AS priority,
                        o.traceparent FROM outbox o
                 LEFT JOIN batches b ON b.id = o.payload->>'batch_id'
                 WHERE o.sent_at IS NULL AND o.routing_key = $1 AND o.account_id = a.account_id
                 ORDER BY 5 DESC, o.id LIMIT $2
             ) o",
        )
        .bind(lane)
        .bind(room as i64)
        .fetch_all(&mut *tx)
        .await?;
        let held = rows
            .iter()
            .map(|r| {
                Ok(Held {
                    id: r.try_get("id")?,
                    account: r.try_get("account_id")?,
                    priority: r.try_get("priority")?,
                    turn: r.try_get("turn")?,
                    message: OutboxMessage {
                        exchange: r.try_get("exchange")?,
                        routing_key: lane.to_string(),
                        payload: r.try_get("payload")?,
                        account_id: None,
                        traceparent: r.try_get("traceparent")?,
                    },
                })
            })
            .collect::<std::result::Result<Vec<Held>, sqlx::Error>>()?;
        let chosen = take_turns(held, room);
        if chosen.is_empty() {
            return Ok(0);
        }
        let ids: Vec<i64> = chosen.iter().map(|h| h.id).collect();
        // Each account's new turn, in the order of its last chunk here.
        let mut order: Vec<&str> = Vec::new();
        for held in chosen.iter().rev() {
            if !order.contains(&held.account.as_str()) {
                order.push(&held.account);
            }
        }
        order.reverse();
        let order: Vec<String> = order.into_iter().map(str::to_string).collect();
        publish(chosen.into_iter().map(|h| h.message).collect()).await?;
        sqlx::query("UPDATE outbox SET sent_at = now() WHERE id = ANY($1)")
            .bind(&ids)
            .execute(&mut *tx)
            .await?;
        for account in &order {
            sqlx::query(
                "INSERT INTO dispatch_turns (routing_key, account_id, turn) VALUES ($1, $2, nextval('dispatch_turn'))
                 ON CONFLICT (routing_key, account_id) DO UPDATE SET turn = EXCLUDED.turn",
            )
            .bind(lane)
            .bind(account)
            .execute(&mut *tx)
            .await?;
        }
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

/// A chunk held for fair dispatch.
#[derive(Debug, Clone)]
struct Held {
    id: i64,
    account: String,
    /// Its batch's priority.
    priority: i16,
    /// The account's last turn on the lane (`None`: never).
    turn: Option<i64>,
    message: OutboxMessage,
}

/// Up to `room` of `held`, one an account a round: accounts in the order of
/// their last turn (never first), each one's chunks highest priority first,
/// then oldest first.
fn take_turns(mut held: Vec<Held>, room: usize) -> Vec<Held> {
    held.sort_by(|a, b| {
        (a.turn.is_some(), a.turn, &a.account, -a.priority, a.id).cmp(&(
            b.turn.is_some(),
            b.turn,
            &b.account,
            -b.priority,
            b.id,
        ))
    });
    let mut queues: Vec<std::collections::VecDeque<Held>> = Vec::new();
    for h in held {
        match queues.last_mut() {
            Some(queue) if queue.back().is_some_and(|last| last.account == h.account) => queue.push_back(h),
            _ => queues.push(std::collections::VecDeque::from([h])),
        }
    }
    let mut chosen = Vec::with_capacity(room);
    while chosen.len() < room && queues.iter().any(|q| !q.is_empty()) {
        for queue in queues.iter_mut() {
            if chosen.len() == room {
                break;
            }
            if let Some(h) = queue.pop_front() {
                chosen.push(h);
            }
        }
    }
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(id: i64, account: &str, turn: Option<i64>) -> Held {
        Held {
            id,
            account: account.into(),
            priority: 0,
            turn,
            message: OutboxMessage {
                exchange: String::new(),
                routing_key: "lane".into(),
                payload: Value::Null,
                account_id: None,
                traceparent: None,
            },
        }
    }

    fn ids(chosen: &[Held]) -> Vec<(String, i64)> {
        chosen.iter().map(|h| (h.account.clone(), h.id)).collect()
    }

    #[test]
    fn accounts_take_turns_oldest_turn_first_each_ones_chunks_in_order() {
        // `a` has had a turn; `b` never: `b` goes first, then they alternate.
        let rows = vec![
            held(3, "a", Some(7)),
            held(1, "a", Some(7)),
            held(2, "a", Some(7)),
            held(9, "b", None),
            held(10, "b", None),
        ];
        let chosen = take_turns(rows.clone(), 4);
        let expect = |v: &[(&str, i64)]| v.iter().map(|(a, i)| (a.to_string(), *i)).collect::<Vec<_>>();
        assert_eq!(ids(&chosen), expect(&[("b", 9), ("a", 1), ("b", 10), ("a", 2)]));
        // Room for more than is held: everything, still interleaved.
        assert_eq!(ids(&take_turns(rows.clone(), 10)).len(), 5);
        // One slot: the account whose turn is oldest.
        let older = vec![held(1, "a", Some(7)), held(5, "c", Some(3))];
        assert_eq!(ids(&take_turns(older, 1)), expect(&[("c", 5)]));
        assert!(take_turns(Vec::new(), 3).is_empty());
        // Within an account, its higher-priority batch's chunks go first.
        let mut urgent = held(20, "a", Some(7));
        urgent.priority = 5;
        let rows = vec![held(1, "a", Some(7)), urgent, held(2, "a", Some(7))];
        assert_eq!(ids(&take_turns(rows, 3)), expect(&[("a", 20), ("a", 1), ("a", 2)]));
    }
}
