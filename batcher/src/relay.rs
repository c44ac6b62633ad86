//! The outbox relay: publishes what the store has committed, with confirms.
//!
//! A row is marked sent only after the broker confirmed it, so a crash between
//! the API's commit and the publish loses nothing; a crash between the confirm
//! and the mark publishes a message twice, which consumers tolerate (results
//! commit idempotently). Relays on several processes share the work through
//! `FOR UPDATE SKIP LOCKED`. They wake on `NOTIFY`, and poll as a fallback.
//!
//! The batch lane's chunks are held in the outbox under their account and
//! published by fair dispatch: while a model's queue holds fewer ready
//! messages than `dispatch_depth`, the relay tops it up, the account with the
//! fewest chunks in flight first, taking turns among equals
//! (`Store::dispatch_fair`); a worker marks a chunk served as it acks it
//! (`Store::chunk_done`). The queue stays shallow, so a batch submitted
//! behind another account's large one waits for a few chunks, not for all
//! of it, and an account far behind another goes to the lane's queue ahead,
//! which workers consume beside it, waiting for none; what is held is in
//! Postgres, so it survives any process's crash, and any number of workers
//! consume the queues.

use std::time::Duration;

use sqlx::postgres::PgListener;
use tokio_util::sync::CancellationToken;

use crate::broker::{self, Publisher, Topology};
use crate::store::{Dispatch, Room, Store, OUTBOX_CHANNEL};
use crate::BatcherError;

/// How a relay runs.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// The broker.
    pub amqp_url: String,
    /// Queue names.
    pub topology: Topology,
    /// Models whose lanes must exist before anything is published to them.
    pub models: Vec<String>,
    /// Rows per transaction.
    pub batch_size: i64,
    /// Longest sleep when nothing wakes the relay.
    pub poll: Duration,
    /// Ready chunk messages the fair dispatch keeps in each batch queue.
    pub dispatch_depth: u32,
    /// How often the relay tops up batch queues while chunks are held.
    pub dispatch_poll: Duration,
}

/// Publish everything unsent; returns how many messages went out.
pub async fn drain(store: &Store, publisher: &Publisher, batch_size: i64) -> Result<usize, BatcherError> {
    let mut total = 0;
    loop {
        let sent = store
            .relay_outbox(
                batch_size,
                |messages| async move { publisher.publish_all(&messages).await },
            )
            .await?;
        total += sent;
        if sent == 0 {
            return Ok(total);
        }
    }
}

/// Run until `stop`, reconnecting after broker or database failures.
pub async fn run(store: Store, config: RelayConfig, stop: CancellationToken) {
    broker::reconnecting("the outbox relay", &stop, || session(&store, &config, &stop)).await
}

async fn session(store: &Store, config: &RelayConfig, stop: &CancellationToken) -> Result<(), BatcherError> {
    let connection = broker::connect(&config.amqp_url, "lorry-relay").await?;
    let publisher = Publisher::open(&connection).await?;
    config
        .topology
        .declare(publisher.channel(), config.models.iter().map(String::as_str))
        .await?;
    let mut listener = PgListener::connect_with(store.pool()).await?;
    listener.listen(OUTBOX_CHANNEL).await?;
    loop {
        drain(store, &publisher, config.batch_size).await?;
        let sleep = match dispatch(store, &publisher, config.dispatch_depth).await? {
            // Workers take what goes ahead at once: top it up again soon,
            // rather than on the next ack (also when another relay had the
            // lane: its round may have missed chunks that came in meanwhile).
            Dispatched { went_ahead: true, .. } => AHEAD_POLL.min(config.dispatch_poll),
            Dispatched { holding: true, .. } => config.dispatch_poll,
            Dispatched { holding: false, .. } => config.poll,
        };
        tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            notified = listener.recv() => {
                notified?;
                // One round answers every notification already here (a
                // burst of acks, or those that came in during the last
                // round): it reads the outbox as it is now.
                while listener.next_buffered().is_some() {}
            }
            _ = tokio::time::sleep(sleep) => {}
        }
    }
}

/// How soon a relay tops up again after a round that had room in a queue
/// ahead and published there.
const AHEAD_POLL: Duration = Duration::from_millis(10);

/// What a round of [`dispatch`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dispatched {
    /// Chunks were held on some lane.
    pub holding: bool,
    /// A lane's queue ahead had room, and chunks were published or another
    /// relay was dispatching the lane: worth a look again soon.
    pub went_ahead: bool,
}

/// Top up every batch queue whose chunks are held, and its queue ahead, to
/// `depth` ready messages each, by account (`Store::dispatch_fair`).
pub async fn dispatch(store: &Store, publisher: &Publisher, depth: u32) -> Result<Dispatched, BatcherError> {
    let lanes = store.held_lanes().await?;
    let mut went_ahead = false;
    for (lane, accounts) in &lanes {
        let free = |ready: u32| depth.saturating_sub(ready) as usize;
        let mut one_account = *accounts == 1;
        let soon = loop {
            // Only an account behind another that still holds chunks goes ahead.
            let ahead = if one_account {
                0
            } else {
                free(ready(publisher, &broker::ahead_queue(lane)).await?)
            };
            let room = Room {
                queue: free(ready(publisher, lane).await?),
                ahead,
                queue_depth: depth as usize,
                one_account,
            };
            let round = store
                .dispatch_fair(
                    lane,
                    room,
                    |messages| async move { publisher.publish_all(&messages).await },
                )
                .await?;
            match round {
                Dispatch::Sent(sent) => break room.ahead > 0 && sent > 0,
                // Another relay's round may have read the lanes before the
                // chunks going ahead came in: look again soon.
                Dispatch::Busy => break room.ahead > 0,
                // Another account's chunks came in after the lanes were read.
                Dispatch::Stale => one_account = false,
            }
        };
        went_ahead |= soon;
    }
    Ok(Dispatched {
        holding: !lanes.is_empty(),
        went_ahead,
    })
}

/// Messages ready in `queue` (a passive declare).
async fn ready(publisher: &Publisher, queue: &str) -> Result<u32, BatcherError> {
    Ok(publisher
        .channel()
        .queue_declare(
            queue,
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await?
        .message_count())
}
