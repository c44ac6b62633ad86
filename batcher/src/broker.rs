//! RabbitMQ: the queue topology, connections, and publishing with confirms.
//!
//! Every name starts with the configured prefix (`LORRY_QUEUE_PREFIX`), so
//! stacks and parallel tests sharing one broker never see each other's work:
//! - `<p>.batch.<model>` and `<p>.rt.<model>`: durable quorum queues with a
//!   delivery limit; a message delivered that many times goes to the
//!   dead-letter exchange `<p>.dlx` and its queue `<p>.dlq`.
//! - `<p>.events`: a topic exchange of CloudEvents, routed by event type.
//! - `<p>.rt.cancel`: a fanout exchange on which the API announces real-time
//!   requests whose client went away; every worker binds a private queue to it.

use futures::future::try_join_all;
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::publisher_confirm::Confirmation;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::store::OutboxMessage;
use crate::BatcherError;

type Result<T> = std::result::Result<T, BatcherError>;

const DEAD_LETTER_KEY: &str = "dead";

/// The names of one deployment's queues and exchanges.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    prefix: String,
    delivery_limit: u32,
}

impl Topology {
    /// Names under `prefix`; a message is dead-lettered after `delivery_limit` deliveries.
    pub fn new(prefix: &str, delivery_limit: u32) -> Self {
        Topology {
            prefix: prefix.to_string(),
            delivery_limit: delivery_limit.max(1),
        }
    }

    /// The batch lane of a model.
    pub fn batch_queue(&self, model: &str) -> String {
        format!("{}.batch.{model}", self.prefix)
    }

    /// The batch lane's queue ahead of a model: fair dispatch routes there
    /// the chunks of an account far behind another in chunks in flight, and
    /// workers consume it beside the batch queue with a prefetch of its own.
    pub fn batch_ahead_queue(&self, model: &str) -> String {
        ahead_queue(&self.batch_queue(model))
    }

    /// The real-time lane of a model.
    pub fn rt_queue(&self, model: &str) -> String {
        format!("{}.rt.{model}", self.prefix)
    }

    /// The dead-letter exchange.
    pub fn dead_letter_exchange(&self) -> String {
        format!("{}.dlx", self.prefix)
    }

    /// The dead-letter queue.
    pub fn dead_letter_queue(&self) -> String {
        format!("{}.dlq", self.prefix)
    }

    /// The topic exchange of batch events.
    pub fn events_exchange(&self) -> String {
        format!("{}.events", self.prefix)
    }

    /// The fanout exchange of real-time cancellations.
    pub fn rt_cancel_exchange(&self) -> String {
        format!("{}.rt.cancel", self.prefix)
    }

    /// Declare the shared exchanges and queues and both lanes of every model (idempotent).
    pub async fn declare<'a>(&self, channel: &Channel, models: impl IntoIterator<Item = &'a str>) -> Result<()> {
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        };
        channel
            .exchange_declare(
                &self.events_exchange(),
                ExchangeKind::Topic,
                durable,
                FieldTable::default(),
            )
            .await?;
        channel
            .exchange_declare(
                &self.dead_letter_exchange(),
                ExchangeKind::Direct,
                durable,
                FieldTable::default(),
            )
            .await?;
        channel
            .exchange_declare(
                &self.rt_cancel_exchange(),
                ExchangeKind::Fanout,
                ExchangeDeclareOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let dlq = self.dead_letter_queue();
        channel.queue_declare(&dlq, durable_queue(), quorum(None)).await?;
        channel
            .queue_bind(
                &dlq,
                &self.dead_letter_exchange(),
                DEAD_LETTER_KEY,
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
        for model in models {
            for queue in [
                self.batch_queue(model),
                self.batch_ahead_queue(model),
                self.rt_queue(model),
            ] {
                let args = quorum(Some((self.delivery_limit, &self.dead_letter_exchange())));
                channel.queue_declare(&queue, durable_queue(), args).await?;
            }
        }
        Ok(())
    }
}

/// The queue ahead of batch queue `lane` ([`Topology::batch_ahead_queue`]).
pub fn ahead_queue(lane: &str) -> String {
    format!("{lane}.ahead")
}

fn durable_queue() -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        ..Default::default()
    }
}

fn quorum(dead_letter: Option<(u32, &str)>) -> FieldTable {
    let mut args = FieldTable::default();
    args.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
    if let Some((limit, exchange)) = dead_letter {
        args.insert("x-delivery-limit".into(), AMQPValue::LongInt(limit as i32));
        args.insert("x-dead-letter-exchange".into(), AMQPValue::LongString(exchange.into()));
        args.insert(
            "x-dead-letter-routing-key".into(),
            AMQPValue::LongString(DEAD_LETTER_KEY.into()),
        );
        // Dead-letter at least once: a dead-lettered chunk must still end its requests.
        args.insert(
            "x-dead-letter-strategy".into(),
            AMQPValue::LongString("at-least-once".into()),
        );
        args.insert("x-overflow".into(), AMQPValue::LongString("reject-publish".into()));
    }
    args
}

/// A server-named queue only this connection uses, gone with it; returns its name.
pub async fn private_queue(channel: &Channel) -> Result<String> {
    let queue = channel
        .queue_declare(
            "",
            QueueDeclareOptions {
                exclusive: true,
                auto_delete: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    Ok(queue.name().to_string())
}

/// Run `session` until it ends cleanly or `stop` is cancelled, starting it
/// again after each failure with exponential backoff (100 ms doubling to 5 s).
pub async fn reconnecting<F, Fut>(what: &str, stop: &CancellationToken, mut session: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    let mut backoff = Duration::from_millis(100);
    while !stop.is_cancelled() {
        match session().await {
            Ok(()) => return,
            Err(e) => {
                tracing::warn!(error = %e, "{what} lost the broker or the database; reconnecting");
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// How long opening a broker connection may take before it counts as failed:
/// a broker that accepts TCP but never completes the handshake must not hang its caller.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);

/// Open a connection on the tokio runtime, named so operators can find it.
pub async fn connect(url: &str, name: &str) -> Result<Connection> {
    let properties = ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio)
        .with_connection_name(name.into());
    match tokio::time::timeout(CONNECT_TIMEOUT, Connection::connect(url, properties)).await {
        Ok(connection) => Ok(connection?),
        Err(_) => Err(BatcherError::BrokerLost(format!(
            "no answer from the broker within {CONNECT_TIMEOUT:?}"
        ))),
    }
}

/// A channel in confirm mode.
#[derive(Clone)]
pub struct Publisher {
    channel: Channel,
}

impl Publisher {
    /// Open a confirming channel on `connection`.
    pub async fn open(connection: &Connection) -> Result<Self> {
        let channel = connection.create_channel().await?;
        channel.confirm_select(ConfirmSelectOptions::default()).await?;
        Ok(Publisher { channel })
    }

    /// The underlying channel.
    pub fn channel(&self) -> &Channel {
        &self.channel
    }

    /// Publish persistent JSON messages and wait until the broker has confirmed
    /// (and routed) every one of them.
    pub async fn publish_all(&self, messages: &[OutboxMessage]) -> Result<()> {
        let pending = messages.iter().map(|m| async move {
            let body = serde_json::to_vec(&m.payload)?;
            let properties = crate::trace::with_traceparent(json_properties(), m.traceparent.as_deref());
            self.publish(&m.exchange, &m.routing_key, &body, properties).await
        });
        try_join_all(pending).await?;
        Ok(())
    }

    /// Publish one message with `properties` and wait for its confirm.
    pub async fn publish(&self, exchange: &str, key: &str, body: &[u8], properties: BasicProperties) -> Result<()> {
        self.publish_pipelined(exchange, key, body, properties)
            .await?
            .wait()
            .await
    }

    /// Publish one message without waiting for its confirm, so that messages
    /// on this channel follow each other without a round trip each (the
    /// broker keeps their order); the returned confirm is awaited later.
    pub async fn publish_pipelined(
        &self,
        exchange: &str,
        key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<Pending> {
        let options = BasicPublishOptions {
            mandatory: exchange.is_empty(),
            ..Default::default()
        };
        let confirm = self
            .channel
            .basic_publish(exchange, key, options, body, properties)
            .await?;
        Ok(Pending {
            key: key.to_string(),
            confirm,
        })
    }
}

/// A published message whose confirm has not been awaited yet.
pub struct Pending {
    key: String,
    confirm: lapin::publisher_confirm::PublisherConfirm,
}

impl Pending {
    /// Wait until the broker has confirmed (and routed) the message.
    pub async fn wait(self) -> Result<()> {
        match self.confirm.await? {
            Confirmation::Ack(None) | Confirmation::NotRequested => Ok(()),
            Confirmation::Ack(Some(_)) | Confirmation::Nack(_) => Err(BatcherError::NotConfirmed(self.key)),
        }
    }
}

/// Persistent JSON.
pub fn json_properties() -> BasicProperties {
    BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type("application/json".into())
}
