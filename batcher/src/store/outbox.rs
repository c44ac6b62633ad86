//! The outbox (messages to publish) and webhook deliveries (requests to send),
//! both written in the transaction that changes the state they announce.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{Postgres, Row, Transaction};

use super::{Result, Store};
use crate::ids::{AccountId, BatchId, DeliveryId};
use crate::model::Chunk;

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

    /// `chunk`, published by fair dispatch, has been served (acked or
    /// dead-lettered): it is no longer in flight. Wakes the relays, whose fair
    /// dispatch keeps the batch queue only a few chunks deep and tops it up now.
    pub async fn chunk_done(&self, chunk: &Chunk) -> Result<()> {
        sqlx::query(
            "WITH done AS (
                 UPDATE outbox SET done_at = now()
                 WHERE account_id = $1 AND sent_at IS NOT NULL AND done_at IS NULL
                   AND payload->>'batch_id' = $2 AND (payload->>'start')::int = $3
             )
             SELECT pg_notify($4, '')",
        )
        .bind(&chunk.account_id.0)
        .bind(chunk.batch_id.as_str())
        .bind(chunk.start)
        .bind(OUTBOX_CHANNEL)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Wake the outbox relays (`NOTIFY`).
    pub async fn notify_outbox(&self) -> Result<()> {
        sqlx::query("SELECT pg_notify($1, '')")
            .bind(OUTBOX_CHANNEL)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// The lanes (routing keys) holding chunks for fair dispatch, each with
    /// how many accounts hold them.
    pub async fn held_lanes(&self) -> Result<Vec<(String, i64)>> {
        Ok(sqlx::query_as(
            "SELECT routing_key, count(DISTINCT account_id) FROM outbox
             WHERE sent_at IS NULL AND account_id IS NOT NULL GROUP BY routing_key",
        )
        .fetch_all(&self.pool)
        .await?)
    }

    /// Publish up to `room` of the chunks held for `lane`, a chunk at a time
    /// to the account with the fewest in flight (published, not yet
    /// [`Store::chunk_done`]), among equals the one whose last turn is
    /// oldest (or that never had one): accounts with as many in flight take
    /// turns, one chunk each a round, and an account that arrives behind
    /// another's large batch goes first until it has as many. Each account's
    /// chunks go by its batches' priority, highest first, then oldest
    /// first. Marks them sent after `publish`
    /// confirms them, and records each account's turn. One relay dispatches
    /// a lane at a time (others find it locked and skip it); returns how
    /// many went out.
    ///
    /// An account at least half `room.queue_depth` chunks in flight behind
    /// another goes to the lane's queue ahead ([`crate::broker::ahead_queue`])
    /// instead, up to `room.ahead` chunks, and while it is that far behind and
    /// there was room ahead takes no place in the lane's queue: workers
    /// consume the queue ahead beside the lane's, so its chunks wait neither
    /// for the chunks ready in the lane's queue nor for a worker to ack one.
    pub async fn dispatch_fair<F, Fut>(&self, lane: &str, room: Room, publish: F) -> Result<Dispatch>
    where
        F: FnOnce(Vec<OutboxMessage>) -> Fut,
        Fut: std::future::Future<Output = Result<()>>,
    {
        if room.queue + room.ahead == 0 {
            return Ok(Dispatch::Sent(0));
        }
        let mut tx = self.pool.begin().await?;
        let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock(hashtext('lorry-dispatch:' || $1))")
            .bind(lane)
            .fetch_one(&mut *tx)
            .await?;
        if !locked {
            return Ok(Dispatch::Busy);
        }
        let rows = sqlx::query(
            "SELECT o.id, o.exchange, o.payload, o.account_id, o.priority, o.traceparent, t.turn, f.in_flight, a.held
             FROM (SELECT account_id, count(*) AS held FROM outbox
                   WHERE sent_at IS NULL AND routing_key = $1 AND account_id IS NOT NULL
                   GROUP BY account_id) a
             LEFT JOIN dispatch_turns t ON t.routing_key = $1 AND t.account_id = a.account_id
             CROSS JOIN LATERAL (
                 SELECT count(*) AS in_flight FROM outbox f
                 WHERE f.account_id = a.account_id AND f.routing_key = $1
                   AND f.sent_at IS NOT NULL AND f.done_at IS NULL
             ) f
             CROSS JOIN LATERAL (
                 SELECT o.id, o.exchange, o.payload, o.account_id, coalesce(b.priority, 0::smallint) AS priority,
                        o.traceparent FROM outbox o
                 LEFT JOIN batches b ON b.id = o.payload->>'batch_id'
                 WHERE o.sent_at IS NULL AND o.routing_key = $1 AND o.account_id = a.account_id
                 ORDER BY 5 DESC, o.id LIMIT $2
             ) o",
        )
        .bind(lane)
        .bind((room.queue + room.ahead) as i64)
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
                    in_flight: r.try_get("in_flight")?,
                    held: r.try_get("held")?,
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
        if room.one_account && held.iter().any(|h| h.account != held[0].account) {
            return Ok(Dispatch::Stale);
        }
        // Each account's chunks in flight and held, for the round's log (its
        // rows come together, each with the account's figures).
        let accounts = tracing::enabled!(tracing::Level::DEBUG).then(|| {
            let mut accounts: Vec<(String, i64, i64)> =
                held.iter().map(|h| (h.account.clone(), h.in_flight, h.held)).collect();
            accounts.dedup();
            accounts
        });
        let ahead = crate::broker::ahead_queue(lane);
        let chosen = take_turns(held, room, &ahead);
        tracing::debug!(
            lane,
            queue_room = room.queue,
            ahead_room = room.ahead,
            accounts = ?accounts.unwrap_or_default(),
            sent = chosen.len(),
            sent_ahead = chosen.iter().filter(|h| h.message.routing_key == ahead).count(),
            "dispatch round"
        );
        if chosen.is_empty() {
            return Ok(Dispatch::Sent(0));
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
        Ok(Dispatch::Sent(ids.len()))
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

/// What a round of [`Store::dispatch_fair`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dispatch {
    /// This many chunks went out (none: nothing held, or no room for it).
    Sent(usize),
    /// Another relay was dispatching the lane: nothing went out here.
    Busy,
    /// Nothing went out: the room was sized while one account held chunks
    /// ([`Room::one_account`]) and another's have been committed since.
    /// Size it again, with the queue ahead: routed as if alone, the
    /// newcomer's chunks would join the lane's queue behind the other's.
    Stale,
}

/// The places fair dispatch may fill on a lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Room {
    /// Chunks the lane's queue may take now.
    pub queue: usize,
    /// Chunks its queue ahead may take now.
    pub ahead: usize,
    /// The lane's queue's depth: an account more chunks in flight behind another goes ahead.
    pub queue_depth: usize,
    /// Sized while one account held chunks on the lane: the queue ahead was
    /// not looked at (`ahead` is 0), and a round that finds another
    /// account's chunks publishes nothing.
    pub one_account: bool,
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
    /// The account's chunks on the lane published and not yet served.
    in_flight: i64,
    /// The account's chunks on the lane held (this one among them).
    held: i64,
    message: OutboxMessage,
}

/// What of `held` goes out now: first, up to `room.ahead` chunks, routed to
/// `ahead`, of accounts at least half `room.queue_depth` chunks in flight
/// behind another account (whose other chunks, when there was room ahead,
/// stay held until there is more: in the lane's queue they would wait behind
/// the other's); then up to `room.queue`, a chunk at a time to the account
/// with the fewest in flight, and among equals to the one whose last turn is
/// oldest (never first): accounts with as many in flight take turns, one chunk
/// each a round, and one with fewer (an account just arrived behind another's
/// large batch) goes first until it has as many. Each account's chunks go
/// highest priority first, then oldest first.
fn take_turns(mut held: Vec<Held>, room: Room, ahead: &str) -> Vec<Held> {
    held.sort_by(|a, b| {
        (a.turn.is_some(), a.turn, &a.account, -a.priority, a.id).cmp(&(
            b.turn.is_some(),
            b.turn,
            &b.account,
            -b.priority,
            b.id,
        ))
    });
    // Each account's chunks, the accounts in the order of their last turn.
    struct Queue {
        chunks: std::collections::VecDeque<Held>,
        in_flight: i64,
        /// Its place in the order of turns (a turn taken moves it last).
        turn: usize,
        /// Its chunks held, before this round.
        held: i64,
    }
    let mut queues: Vec<Queue> = Vec::new();
    for h in held {
        match queues.last_mut() {
            Some(queue) if queue.chunks.back().is_some_and(|last| last.account == h.account) => {
                queue.chunks.push_back(h)
            }
            _ => queues.push(Queue {
                in_flight: h.in_flight,
                held: h.held,
                turn: queues.len(),
                chunks: std::collections::VecDeque::from([h]),
            }),
        }
    }
    let mut next_turn = queues.len();
    let mut chosen = Vec::with_capacity(room.queue + room.ahead);
    let mut take = |queues: &mut Vec<Queue>, at: usize, to: Option<&str>, chosen: &mut Vec<Held>| {
        let queue = &mut queues[at];
        if let Some(mut h) = queue.chunks.pop_front() {
            if let Some(to) = to {
                h.message.routing_key = to.to_string();
            }
            queue.held -= 1;
            // What of the account's is still held behind it, for the engines.
            if let Value::Object(payload) = &mut h.message.payload {
                payload.insert("behind".into(), Value::from(queue.held.max(0)));
            }
            chosen.push(h);
        }
        queue.in_flight += 1;
        queue.turn = next_turn;
        next_turn += 1;
    };
    // At least half a queue behind another account: its chunks go ahead, and
    // while the queue ahead had room this round, the rest wait for more there
    // rather than join the lane's queue behind the other's.
    let gap = (room.queue_depth as i64 / 2).max(1);
    let wait_ahead = room.ahead > 0;
    let behind = |queues: &[Queue], i: usize| {
        let most = queues
            .iter()
            .enumerate()
            .filter(|&(j, _)| j != i)
            .map(|(_, q)| q.in_flight)
            .max();
        most.is_some_and(|m| queues[i].in_flight + gap <= m)
    };
    for _ in 0..room.ahead {
        let Some(at) = (0..queues.len())
            .filter(|&i| !queues[i].chunks.is_empty() && behind(&queues, i))
            .min_by_key(|&i| (queues[i].in_flight, queues[i].turn))
        else {
            break;
        };
        take(&mut queues, at, Some(ahead), &mut chosen);
    }
    for _ in 0..room.queue {
        let Some(at) = (0..queues.len())
            .filter(|&i| !queues[i].chunks.is_empty())
            .filter(|&i| !wait_ahead || !behind(&queues, i))
            .min_by_key(|&i| (queues[i].in_flight, queues[i].turn))
        else {
            break;
        };
        take(&mut queues, at, None, &mut chosen);
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
            in_flight: 0,
            held: 0,
            message: OutboxMessage {
                exchange: String::new(),
                routing_key: "lane".into(),
                payload: Value::Null,
                account_id: None,
                traceparent: None,
            },
        }
    }

    fn room(queue: usize) -> Room {
        Room {
            queue,
            ahead: 0,
            queue_depth: 2,
            one_account: false,
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
        let chosen = take_turns(rows.clone(), room(4), "ahead");
        let expect = |v: &[(&str, i64)]| v.iter().map(|(a, i)| (a.to_string(), *i)).collect::<Vec<_>>();
        assert_eq!(ids(&chosen), expect(&[("b", 9), ("a", 1), ("b", 10), ("a", 2)]));
        // Room for more than is held: everything, still interleaved.
        assert_eq!(ids(&take_turns(rows.clone(), room(10), "ahead")).len(), 5);
        // One slot: the account whose turn is oldest.
        let older = vec![held(1, "a", Some(7)), held(5, "c", Some(3))];
        assert_eq!(ids(&take_turns(older, room(1), "ahead")), expect(&[("c", 5)]));
        assert!(take_turns(Vec::new(), room(3), "ahead").is_empty());
        // Within an account, its higher-priority batch's chunks go first.
        let mut urgent = held(20, "a", Some(7));
        urgent.priority = 5;
        let rows = vec![held(1, "a", Some(7)), urgent, held(2, "a", Some(7))];
        assert_eq!(
            ids(&take_turns(rows, room(3), "ahead")),
            expect(&[("a", 20), ("a", 1), ("a", 2)])
        );
    }

    #[test]
    fn the_account_with_fewest_chunks_in_flight_goes_first_until_it_has_as_many() {
        let expect = |v: &[(&str, i64)]| v.iter().map(|(a, i)| (a.to_string(), *i)).collect::<Vec<_>>();
        // `a` has three chunks in flight, `b` (whose turn is newer) one: `b`
        // takes two places, then they alternate, oldest turn first.
        let in_flight = |mut h: Held, n: i64| {
            h.in_flight = n;
            h
        };
        let rows = vec![
            in_flight(held(1, "a", Some(3)), 3),
            in_flight(held(2, "a", Some(3)), 3),
            in_flight(held(3, "a", Some(3)), 3),
            in_flight(held(10, "b", Some(8)), 1),
            in_flight(held(11, "b", Some(8)), 1),
            in_flight(held(12, "b", Some(8)), 1),
            in_flight(held(13, "b", Some(8)), 1),
        ];
        assert_eq!(
            ids(&take_turns(rows.clone(), room(6), "ahead")),
            expect(&[("b", 10), ("b", 11), ("a", 1), ("b", 12), ("a", 2), ("b", 13)])
        );
        // An account with none left held takes no place, whatever it has in flight.
        let rows = vec![in_flight(held(1, "a", Some(3)), 9), in_flight(held(2, "a", Some(3)), 9)];
        assert_eq!(ids(&take_turns(rows, room(5), "ahead")), expect(&[("a", 1), ("a", 2)]));
    }

    #[test]
    fn an_account_a_queue_behind_goes_ahead_and_waits_there_then_takes_turns() {
        let expect = |v: &[(&str, i64, &str)]| {
            v.iter()
                .map(|(a, i, q)| (a.to_string(), *i, q.to_string()))
                .collect::<Vec<_>>()
        };
        let routed = |chosen: &[Held]| {
            chosen
                .iter()
                .map(|h| (h.account.clone(), h.id, h.message.routing_key.clone()))
                .collect::<Vec<_>>()
        };
        let with = |id: i64, account: &str, in_flight: i64| Held {
            in_flight,
            ..held(id, account, Some(1))
        };
        // `a` has six in flight, `b` one: with a queue two deep, `b` is at
        // least half a queue (one chunk) behind until it has six in flight,
        // so five of its chunks go ahead; the lane's queue then takes `a`'s
        // (six each, its turn older), and `b`, a chunk behind again, waits
        // for room ahead.
        let rows: Vec<Held> = (1..=4)
            .map(|i| with(i, "a", 6))
            .chain((10..=15).map(|i| with(i, "b", 1)))
            .collect();
        let room = Room {
            queue: 4,
            ahead: 5,
            queue_depth: 2,
            one_account: false,
        };
        assert_eq!(
            routed(&take_turns(rows.clone(), room, "lane.ahead")),
            expect(&[
                ("b", 10, "lane.ahead"),
                ("b", 11, "lane.ahead"),
                ("b", 12, "lane.ahead"),
                ("b", 13, "lane.ahead"),
                ("b", 14, "lane.ahead"),
                ("a", 1, "lane"),
                ("a", 2, "lane"),
                ("a", 3, "lane"),
                ("a", 4, "lane"),
            ])
        );
        // Room ahead for two: `b`'s other chunks wait for more there rather
        // than join the lane's queue behind `a`'s while `b` is that far behind.
        let room = Room { ahead: 2, ..room };
        assert_eq!(
            routed(&take_turns(rows.clone(), room, "lane.ahead")),
            expect(&[
                ("b", 10, "lane.ahead"),
                ("b", 11, "lane.ahead"),
                ("a", 1, "lane"),
                ("a", 2, "lane"),
                ("a", 3, "lane"),
                ("a", 4, "lane"),
            ])
        );
        // No room ahead this round: `b` takes the lane's queue, first.
        let room = Room { ahead: 0, ..room };
        assert_eq!(
            routed(&take_turns(rows.clone(), room, "lane.ahead")),
            expect(&[
                ("b", 10, "lane"),
                ("b", 11, "lane"),
                ("b", 12, "lane"),
                ("b", 13, "lane"),
            ])
        );
        // `b` less than half a queue behind (of four) takes the lane's queue, first.
        let near: Vec<Held> = (1..=2)
            .map(|i| with(i, "a", 6))
            .chain((10..=11).map(|i| with(i, "b", 5)))
            .collect();
        let deeper = Room { queue_depth: 4, ..room };
        assert_eq!(
            routed(&take_turns(near, deeper, "lane.ahead")),
            expect(&[("b", 10, "lane"), ("a", 1, "lane"), ("b", 11, "lane"), ("a", 2, "lane")])
        );
        // One account alone never goes ahead, however much it has in flight.
        let alone: Vec<Held> = (1..=3).map(|i| with(i, "a", 0)).collect();
        let room = Room {
            queue: 0,
            ahead: 3,
            ..room
        };
        assert!(take_turns(alone, room, "lane.ahead").is_empty());
    }
}
