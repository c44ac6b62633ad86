//! The batcher's error type.

/// Errors crossing the batcher's boundary.
#[derive(Debug, thiserror::Error)]
pub enum BatcherError {
    /// Postgres refused or failed a statement.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// A migration failed to apply.
    #[error("migration: {0}")]
    Migration(#[from] sqlx::migrate::MigrateError),
    /// RabbitMQ refused or failed an operation.
    #[error("broker: {0}")]
    Broker(#[from] lapin::Error),
    /// The broker connection or a consumer ended.
    #[error("broker connection lost: {0}")]
    BrokerLost(String),
    /// The broker did not confirm a publish (nacked or returned as unroutable).
    #[error("broker did not confirm the message to {0}")]
    NotConfirmed(String),
    /// The object store failed.
    #[error("object store: {0}")]
    ObjectStore(String),
    /// A message or stored document was not the JSON we wrote.
    #[error("malformed message: {0}")]
    Malformed(#[from] serde_json::Error),
    /// The real-time lane did not answer in time.
    #[error("the real-time lane did not answer within {0:?}")]
    Timeout(std::time::Duration),
    /// The real-time lane holds more waiting requests than it is allowed to.
    #[error("the real-time lane is saturated")]
    Saturated,
    /// The model named is not served by any worker's catalogue.
    #[error("unknown model {0}")]
    UnknownModel(String),
}
