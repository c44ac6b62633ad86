//! LoRA adapter records. The files live in S3; a record names them and is
//! `ready` once both were checked together against the base model. Every
//! read is scoped to the owning account: another account's adapter does not
//! exist, by id or by name.

use chrono::{DateTime, Utc};
use serde_json::{json, Value};
use sqlx::postgres::PgRow;
use sqlx::Row;

use super::accounts::lock_active;
use super::{Result, Store};
use crate::ids::{AccountId, AdapterId};
use crate::quota::{within, Refusal};

/// One adapter as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterRecord {
    /// `lora_…`.
    pub id: AdapterId,
    /// The owner.
    pub account_id: AccountId,
    /// Unique within the account.
    pub name: String,
    /// The base model it adapts.
    pub model: String,
    /// Free text.
    pub description: String,
    /// Both files are there and were checked together.
    pub ready: bool,
    /// S3 key of `adapter_config.json`, once uploaded.
    pub config_key: Option<String>,
    /// S3 key of `adapter_model.safetensors`, once uploaded.
    pub weights_key: Option<String>,
    /// Size of the weights file.
    pub weights_bytes: Option<i64>,
    /// SHA-256 of the weights file, hex.
    pub weights_sha256: Option<String>,
    /// Highest rank of any module, once ready.
    pub rank: Option<i32>,
    /// Adapted projections, once ready.
    pub targets: Vec<String>,
    /// When it was created.
    pub created_at: DateTime<Utc>,
    /// When a file last changed.
    pub modified_at: DateTime<Utc>,
}

impl AdapterRecord {
    fn from_row(row: &PgRow) -> Self {
        AdapterRecord {
            id: AdapterId::parse(row.get::<&str, _>("id")).expect("adapter ids are written by Lorry"),
            account_id: AccountId(row.get("account_id")),
            name: row.get("name"),
            model: row.get("model"),
            description: row.get("description"),
            ready: row.get::<&str, _>("status") == "ready",
            config_key: row.get("config_key"),
            weights_key: row.get("weights_key"),
            weights_bytes: row.get("weights_bytes"),
            weights_sha256: row.get("weights_sha256"),
            rank: row.get("rank"),
            targets: row.get::<Option<Vec<String>>, _>("targets").unwrap_or_default(),
            created_at: row.get("created_at"),
            modified_at: row.get("modified_at"),
        }
    }

    /// Changes whenever a file is replaced: what caches key on beside the id.
    pub fn version(&self) -> i64 {
        self.modified_at.timestamp_micros()
    }

    /// `ready` or `pending`.
    pub fn status(&self) -> &'static str {
        if self.ready {
            "ready"
        } else {
            "pending"
        }
    }

    /// The native API's view.
    pub fn to_json(&self) -> Value {
        json!({
            "id": self.id,
            "object": "adapter",
            "name": self.name,
            "model": self.model,
            "description": self.description,
            "status": self.status(),
            "rank": self.rank,
            "targets": self.targets,
            "bytes": self.weights_bytes,
            "sha256": self.weights_sha256,
            "created_at": self.created_at.timestamp(),
            "modified_at": self.modified_at.timestamp(),
        })
    }
}

/// A new adapter record.
#[derive(Debug, Clone)]
pub struct NewAdapter {
    /// Its id (the files' S3 keys are made from it).
    pub id: AdapterId,
    /// The owner.
    pub account_id: AccountId,
    /// Unique within the account.
    pub name: String,
    /// The base model.
    pub model: String,
    /// Free text.
    pub description: String,
}

/// One uploaded file, checked and written to S3.
#[derive(Debug, Clone)]
pub enum AdapterAsset {
    /// `adapter_config.json` at this key.
    Config {
        /// Its S3 key.
        key: String,
    },
    /// `adapter_model.safetensors` at this key.
    Weights {
        /// Its S3 key.
        key: String,
        /// Its size.
        bytes: i64,
        /// Its SHA-256, hex.
        sha256: String,
    },
}

/// What an adapter checked as a whole looks like.
#[derive(Debug, Clone)]
pub struct AdapterSummary {
    /// Highest rank of any module.
    pub rank: i32,
    /// Adapted projections.
    pub targets: Vec<String>,
}

impl Store {
    /// Write a new adapter record; `None` when the account already has one of that name.
    /// With `files` (config, weights, summary) it is ready at once. Refused
    /// when the account would hold more than `limit` adapters (0: no limit),
    /// or was disabled meanwhile.
    pub async fn insert_adapter(
        &self,
        new: &NewAdapter,
        files: Option<(AdapterAsset, AdapterAsset, AdapterSummary)>,
        limit: u64,
    ) -> Result<std::result::Result<Option<AdapterRecord>, Refusal>> {
        let mut tx = self.pool.begin().await?;
        if lock_active(&mut tx, &new.account_id, limit > 0).await?.is_none() {
            return Ok(Err(Refusal::AccountDisabled));
        }
        if limit > 0 {
            let held: i64 = sqlx::query_scalar("SELECT count(*) FROM adapters WHERE account_id = $1")
                .bind(&new.account_id.0)
                .fetch_one(&mut *tx)
                .await?;
            if let Err(over) = within(held as u64, 1, limit) {
                return Ok(Err(Refusal::OverQuota(over)));
            }
        }
        let row = sqlx::query(
            "INSERT INTO adapters (id, account_id, name, model, description, status)
             VALUES ($1, $2, $3, $4, $5, 'pending')
             ON CONFLICT (account_id, name) DO NOTHING
             RETURNING *",
        )
        .bind(new.id.as_str())
        .bind(&new.account_id.0)
        .bind(&new.name)
        .bind(&new.model)
        .bind(&new.description)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            return Ok(Ok(None));
        };
        let mut record = AdapterRecord::from_row(&row);
        if let Some((config, weights, summary)) = files {
            for asset in [config, weights] {
                record = set_asset(&mut *tx, &new.id, &asset, Some(&summary)).await?;
            }
        }
        tx.commit().await?;
        Ok(Ok(Some(record)))
    }

    /// The account's adapter named by `reference`: an adapter id or a name.
    pub async fn find_adapter(&self, account: &AccountId, reference: &str) -> Result<Option<AdapterRecord>> {
        let column = if AdapterId::parse(reference).is_some() {
            "id"
        } else {
            "name"
        };
        let row = sqlx::query(&format!(
            "SELECT * FROM adapters WHERE account_id = $1 AND {column} = $2"
        ))
        .bind(&account.0)
        .bind(reference)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.as_ref().map(AdapterRecord::from_row))
    }

    /// Up to `limit` of the account's adapters, newest first, after the
    /// adapter `after` when given; and whether more follow.
    pub async fn list_adapters(
        &self,
        account: &AccountId,
        limit: i64,
        after: Option<&AdapterId>,
    ) -> Result<(Vec<AdapterRecord>, bool)> {
        let rows = sqlx::query(
            "SELECT * FROM adapters WHERE account_id = $1 AND ($2::text IS NULL OR id < $2)
             ORDER BY id DESC LIMIT $3",
        )
        .bind(&account.0)
        .bind(after.map(AdapterId::as_str))
        .bind(limit + 1)
        .fetch_all(&self.pool)
        .await?;
        let mut adapters: Vec<AdapterRecord> = rows.iter().map(AdapterRecord::from_row).collect();
        let more = adapters.len() as i64 > limit;
        adapters.truncate(limit as usize);
        Ok((adapters, more))
    }

    /// Record an uploaded file; with `summary` the adapter becomes ready.
    pub async fn set_adapter_asset(
        &self,
        id: &AdapterId,
        asset: &AdapterAsset,
        summary: Option<&AdapterSummary>,
    ) -> Result<AdapterRecord> {
        set_asset(&self.pool, id, asset, summary).await
    }

    /// Delete the account's adapter; the deleted record, if there was one.
    pub async fn delete_adapter(&self, account: &AccountId, id: &AdapterId) -> Result<Option<AdapterRecord>> {
        let row = sqlx::query("DELETE FROM adapters WHERE account_id = $1 AND id = $2 RETURNING *")
            .bind(&account.0)
            .bind(id.as_str())
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.as_ref().map(AdapterRecord::from_row))
    }
}

async fn set_asset<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    id: &AdapterId,
    asset: &AdapterAsset,
    summary: Option<&AdapterSummary>,
) -> Result<AdapterRecord> {
    let (rank, targets) = match summary {
        Some(s) => (Some(s.rank), Some(s.targets.clone())),
        None => (None, None),
    };
    let (config_key, weights) = match asset {
        AdapterAsset::Config { key } => (Some(key.as_str()), None),
        AdapterAsset::Weights { key, bytes, sha256 } => (None, Some((key.as_str(), *bytes, sha256.as_str()))),
    };
    let query = sqlx::query(
        "UPDATE adapters SET config_key = COALESCE($2, config_key), weights_key = COALESCE($3, weights_key),
             weights_bytes = COALESCE($4, weights_bytes), weights_sha256 = COALESCE($5, weights_sha256),
             status = CASE WHEN $6::INTEGER IS NULL THEN status ELSE 'ready' END,
             rank = COALESCE($6, rank), targets = COALESCE($7, targets), modified_at = now()
         WHERE id = $1 RETURNING *",
    )
    .bind(id.as_str())
    .bind(config_key)
    .bind(weights.map(|w| w.0))
    .bind(weights.map(|w| w.1))
    .bind(weights.map(|w| w.2))
    .bind(rank)
    .bind(targets);
    let row = query.fetch_one(executor).await?;
    Ok(AdapterRecord::from_row(&row))
}
