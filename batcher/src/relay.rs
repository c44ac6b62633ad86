//! The outbox relay: publishes what the store has committed, with confirms.
//!
//! A row is marked sent only after the broker confirmed it, so a crash between
//! the API's commit and the publish loses nothing; a crash between the confirm
//! and the mark publishes a message twice, which consumers tolerate (results
//! commit idempotently). Relays on several processes share the work through
//! `FOR UPDATE SKIP LOCKED`. They wake on `NOTIFY`, and poll as a fallback.

use std::time::Duration;

use sqlx::postgres::PgListener;
use tokio_util::sync::CancellationToken;

use crate::broker::{self, Publisher, Topology};
use crate::store::{Store, OUTBOX_CHANNEL};
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
        tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            notified = listener.recv() => { notified?; }
            _ = tokio::time::sleep(config.poll) => {}
        }
    }
}
