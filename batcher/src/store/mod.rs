//! Postgres: the source of truth for accounts, batches, requests, the outbox
//! and webhook deliveries. Every query is written by hand and checked at run
//! time, so the project builds without a database.

mod accounts;
mod adapters;
mod batches;
mod files;
mod gauges;
mod outbox;
mod retention;
mod usage;
mod work;

use std::time::Duration;

use rand::RngCore;
use sha2::{Digest, Sha256};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool};

pub use accounts::{AccountRecord, Disabled, KeyRecord, NewKey, Removal};
pub use adapters::{AdapterAsset, AdapterRecord, AdapterSummary, NewAdapter};
pub use batches::{Created, NewBatch, NewRequest, Page};
pub use files::{FileRecord, NewFile};
pub use gauges::QueuedRequests;
pub use outbox::{Dispatch, DueDelivery, OutboxMessage, Room, OUTBOX_CHANNEL};
pub use retention::BatchDeletion;
pub use usage::{UsageGroup, UsageRow};
pub use work::{Claimed, ClaimedInput, Committed, Ending, Outcome, CLAIM_SQL, COMMIT_SQL};

use crate::ids::AccountId;
use crate::BatcherError;

type Result<T> = std::result::Result<T, BatcherError>;

/// A handle to the database; cheap to clone.
#[derive(Clone, Debug)]
pub struct Store {
    pool: PgPool,
}

/// An account as the API needs it.
#[derive(Debug, Clone)]
pub struct Account {
    /// The account id.
    pub id: AccountId,
    /// The `whsec_…` secret that signs its webhooks.
    pub webhook_secret: String,
    /// Its own limits, over the deployment's defaults.
    pub quotas: crate::quota::Quotas,
}

/// The stored form of an API token.
pub fn hash_token(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// A fresh Standard Webhooks secret.
pub fn new_webhook_secret() -> String {
    use base64::Engine as _;
    let mut key = [0u8; 24];
    rand::thread_rng().fill_bytes(&mut key);
    format!("whsec_{}", base64::engine::general_purpose::STANDARD.encode(key))
}

impl Store {
    /// Connect to an existing database.
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self> {
        let options: PgConnectOptions = url.parse()?;
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options)
            .await?;
        Ok(Store { pool })
    }

    /// Wrap an existing pool (tests).
    pub fn from_pool(pool: PgPool) -> Self {
        Store { pool }
    }

    /// The underlying pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Create the database named in `url` if it does not exist, using the server's `postgres` database.
    pub async fn create_database(url: &str) -> Result<()> {
        let options: PgConnectOptions = url.parse()?;
        let name = options.get_database().unwrap_or("postgres").to_string();
        let mut admin = options.database("postgres").connect().await?;
        let exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(&name)
            .fetch_one(&mut admin)
            .await?;
        if !exists {
            let quoted = name.replace('"', "\"\"");
            sqlx::query(&format!("CREATE DATABASE \"{quoted}\""))
                .execute(&mut admin)
                .await?;
        }
        Ok(())
    }

    /// Apply pending migrations.
    pub async fn migrate(&self) -> Result<()> {
        crate::MIGRATOR.run(&self.pool).await?;
        Ok(())
    }

    /// Whether the database answers.
    pub async fn ping(&self) -> Result<()> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    /// Replace an account's webhook secret; deliveries not yet sent are signed with the new one.
    pub async fn rotate_webhook_secret(&self, account: &AccountId) -> Result<String> {
        let secret = new_webhook_secret();
        sqlx::query("UPDATE accounts SET webhook_secret = $2 WHERE id = $1")
            .bind(&account.0)
            .bind(&secret)
            .execute(&self.pool)
            .await?;
        Ok(secret)
    }
}
