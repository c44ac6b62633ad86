//! Accounts and their API keys, as an operator manages them.

use chrono::{DateTime, Utc};
use rand::RngCore;
use serde_json::{json, Value};
use sqlx::postgres::PgRow;
use sqlx::Row;

use super::batches::{corrupt, end_unstarted};
use super::{hash_token, new_webhook_secret, Account, Result, Store};
use crate::ids::{AccountId, BatchId, KeyId};
use crate::model::RequestStatus;
use crate::quota::{QuotaChange, Quotas};

/// An account as an operator sees it.
#[derive(Debug, Clone)]
pub struct AccountRecord {
    /// Its name, which is its id.
    pub id: AccountId,
    /// When it was made.
    pub created_at: DateTime<Utc>,
    /// When it was disabled, if it is.
    pub disabled_at: Option<DateTime<Utc>>,
    /// Its own limits (`None`: the deployment's default).
    pub quotas: Quotas,
}

/// An account's quota columns.
pub(super) fn quotas_from_row(row: &PgRow) -> Quotas {
    let count = |name: &str| row.get::<Option<i64>, _>(name).map(|n| n.max(0) as u64);
    Quotas {
        queued_requests: count("quota_queued_requests"),
        realtime_per_second: row.get("quota_realtime_per_second"),
        file_bytes: count("quota_file_bytes"),
        adapters: count("quota_adapters"),
    }
}

impl AccountRecord {
    fn from_row(row: &PgRow) -> Self {
        AccountRecord {
            id: AccountId(row.get("id")),
            created_at: row.get("created_at"),
            disabled_at: row.get("disabled_at"),
            quotas: quotas_from_row(row),
        }
    }

    /// `active` or `disabled`.
    pub fn status(&self) -> &'static str {
        if self.disabled_at.is_some() {
            "disabled"
        } else {
            "active"
        }
    }

    /// The account object of the admin routes.
    pub fn to_json(&self) -> Value {
        json!({
            "id": self.id.0,
            "object": "account",
            "status": self.status(),
            "created_at": self.created_at.timestamp(),
            "disabled_at": self.disabled_at.map(|t| t.timestamp()),
            "quotas": self.quotas,
        })
    }
}

/// An API key's record; the key itself is shown once, when made, and kept only as a digest.
#[derive(Debug, Clone)]
pub struct KeyRecord {
    /// The record's id.
    pub id: KeyId,
    /// The account the key opens.
    pub account_id: AccountId,
    /// The operator's name for it.
    pub name: String,
    /// The key's first and last characters.
    pub redacted: String,
    /// When it was made.
    pub created_at: DateTime<Utc>,
    /// When it last opened a request, to the minute.
    pub last_used_at: Option<DateTime<Utc>>,
    /// When it was revoked, if it was.
    pub revoked_at: Option<DateTime<Utc>>,
}

impl KeyRecord {
    fn from_row(row: &PgRow) -> Result<Self> {
        let id: String = row.try_get("id")?;
        Ok(KeyRecord {
            id: KeyId::parse(&id).ok_or_else(|| corrupt("key id", &id))?,
            account_id: AccountId(row.try_get("account_id")?),
            name: row.try_get("name")?,
            redacted: row.try_get("redacted")?,
            created_at: row.try_get("created_at")?,
            last_used_at: row.try_get("last_used_at")?,
            revoked_at: row.try_get("revoked_at")?,
        })
    }

    /// The key object of the admin routes (without the key).
    pub fn to_json(&self) -> Value {
        json!({
            "id": self.id.as_str(),
            "object": "api_key",
            "account_id": self.account_id.0,
            "name": self.name,
            "redacted_value": self.redacted,
            "created_at": self.created_at.timestamp(),
            "last_used_at": self.last_used_at.map(|t| t.timestamp()),
            "revoked_at": self.revoked_at.map(|t| t.timestamp()),
        })
    }
}

/// A key just made: its record and the key, which is not stored.
#[derive(Debug, Clone)]
pub struct NewKey {
    /// The record.
    pub record: KeyRecord,
    /// The key, `lorry_sk_…`.
    pub value: String,
}

impl NewKey {
    /// The key object with the key in `value`, as shown once.
    pub fn to_json(&self) -> Value {
        let mut body = self.record.to_json();
        body["value"] = json!(self.value);
        body
    }
}

/// What disabling an account did.
#[derive(Debug, Clone)]
pub struct Disabled {
    /// The account after the call.
    pub account: AccountRecord,
    /// Its batches that were queued or running and are now cancelling.
    pub cancelled_batches: Vec<BatchId>,
}

/// What removing an account's rows did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Removal {
    /// The rows are gone.
    Removed,
    /// No such account.
    NotFound,
    /// Nothing removed: this many of its batches have not ended (cancelling
    /// ones finish their running requests first).
    Busy(usize),
}

/// A fresh API key: `lorry_sk_` and 32 random bytes, base64url.
fn new_key_value() -> String {
    use base64::Engine as _;
    let mut key = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut key);
    format!(
        "lorry_sk_{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(key)
    )
}

/// The part of a key shown in listings.
fn redact(value: &str) -> String {
    let chars: Vec<char> = value.chars().collect();
    if chars.len() < 20 {
        return "…".into();
    }
    let head: String = chars[..13].iter().collect();
    let tail: String = chars[chars.len() - 4..].iter().collect();
    format!("{head}…{tail}")
}

const ACCOUNT_COLUMNS: &str = "id, created_at, disabled_at, \
    quota_queued_requests, quota_realtime_per_second, quota_file_bytes, quota_adapters";
const KEY_COLUMNS: &str = "id, account_id, name, redacted, created_at, last_used_at, revoked_at";

/// Lock an account's row to the end of the transaction: shared when `count`
/// is false (the account stays as it is: not disabled meanwhile), exclusive
/// of other counting writers when true (a quota checked then holds at the
/// commit). `None` if it is not there or disabled.
pub(super) async fn lock_active(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    account: &AccountId,
    count: bool,
) -> Result<Option<()>> {
    let strength = if count { "NO KEY UPDATE" } else { "SHARE" };
    let active: Option<bool> = sqlx::query_scalar(&format!(
        "SELECT disabled_at IS NULL FROM accounts WHERE id = $1 FOR {strength}"
    ))
    .bind(&account.0)
    .fetch_optional(&mut **tx)
    .await?;
    Ok((active == Some(true)).then_some(()))
}

impl Store {
    /// Make sure an account `id` exists, opened by `token` as its key named
    /// `bootstrap` (replacing an earlier bootstrap key): the bootstrap
    /// account of local runs and tests.
    pub async fn ensure_account(&self, id: &str, token: &str) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("INSERT INTO accounts (id, webhook_secret) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING")
            .bind(id)
            .bind(new_webhook_secret())
            .execute(&mut *tx)
            .await?;
        let hash = hash_token(token);
        sqlx::query("DELETE FROM api_keys WHERE account_id = $1 AND name = 'bootstrap' AND key_hash <> $2")
            .bind(id)
            .bind(&hash)
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "INSERT INTO api_keys (id, account_id, name, key_hash, redacted) VALUES ($1, $2, 'bootstrap', $3, $4)
             ON CONFLICT (key_hash) DO NOTHING",
        )
        .bind(KeyId::generate().as_str())
        .bind(id)
        .bind(&hash)
        .bind(redact(token))
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// The active account this API key opens, if any; notes the key's use (to the minute).
    pub async fn account_by_token(&self, token: &str) -> Result<Option<Account>> {
        let row = sqlx::query(
            "WITH found AS (
                 SELECT k.id AS key_id, a.id, a.webhook_secret,
                        a.quota_queued_requests, a.quota_realtime_per_second, a.quota_file_bytes, a.quota_adapters
                 FROM api_keys k JOIN accounts a ON a.id = k.account_id
                 WHERE k.key_hash = $1 AND k.revoked_at IS NULL AND a.disabled_at IS NULL
             ), used AS (
                 UPDATE api_keys SET last_used_at = now()
                 WHERE id = (SELECT key_id FROM found)
                   AND (last_used_at IS NULL OR last_used_at < now() - interval '1 minute')
             )
             SELECT * FROM found",
        )
        .bind(hash_token(token))
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.map(|r| Account {
            id: AccountId(r.get("id")),
            webhook_secret: r.get("webhook_secret"),
            quotas: quotas_from_row(&r),
        }))
    }

    /// Make an account and its first key; `None` if the name is taken.
    pub async fn create_account(&self, id: &AccountId, key_name: &str) -> Result<Option<(AccountRecord, NewKey)>> {
        let mut tx = self.pool.begin().await?;
        let row = sqlx::query(&format!(
            "INSERT INTO accounts (id, webhook_secret) VALUES ($1, $2)
             ON CONFLICT (id) DO NOTHING RETURNING {ACCOUNT_COLUMNS}"
        ))
        .bind(&id.0)
        .bind(new_webhook_secret())
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        let key = insert_key(&mut tx, id, key_name).await?;
        tx.commit().await?;
        Ok(Some((AccountRecord::from_row(&row), key)))
    }

    /// An account, active or not.
    pub async fn account_record(&self, id: &AccountId) -> Result<Option<AccountRecord>> {
        let row = sqlx::query(&format!("SELECT {ACCOUNT_COLUMNS} FROM accounts WHERE id = $1"))
            .bind(&id.0)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.as_ref().map(AccountRecord::from_row))
    }

    /// Accounts in name order, `limit` of them after `after`.
    pub async fn list_accounts(&self, limit: i64, after: Option<&AccountId>) -> Result<Vec<AccountRecord>> {
        let rows = sqlx::query(&format!(
            "SELECT {ACCOUNT_COLUMNS} FROM accounts WHERE $1::text IS NULL OR id > $1 ORDER BY id LIMIT $2"
        ))
        .bind(after.map(|a| a.0.as_str()))
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.iter().map(AccountRecord::from_row).collect())
    }

    /// Disable an account: its keys are refused from the commit on, and its
    /// queued and running batches are cancelled (unstarted requests end
    /// `cancelled`, running ones finish) in the same transaction. Disabling a
    /// disabled account changes nothing. `None` if there is no such account.
    pub async fn disable_account(&self, id: &AccountId) -> Result<Option<Disabled>> {
        let mut tx = self.pool.begin().await?;
        let row = sqlx::query(&format!(
            "UPDATE accounts SET disabled_at = coalesce(disabled_at, now()) WHERE id = $1 RETURNING {ACCOUNT_COLUMNS}"
        ))
        .bind(&id.0)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        let cancelled: Vec<String> = sqlx::query_scalar(
            "UPDATE batches SET status = 'cancelling', end_reason = 'cancelled', cancelling_at = now()
             WHERE account_id = $1 AND status IN ('validating', 'in_progress') RETURNING id",
        )
        .bind(&id.0)
        .fetch_all(&mut *tx)
        .await?;
        let mut cancelled_batches = Vec::with_capacity(cancelled.len());
        for raw in cancelled {
            let batch = BatchId::parse(&raw).ok_or_else(|| corrupt("batch id", &raw))?;
            end_unstarted(&mut tx, &batch, RequestStatus::Canceled).await?;
            cancelled_batches.push(batch);
        }
        tx.commit().await?;
        Ok(Some(Disabled {
            account: AccountRecord::from_row(&row),
            cancelled_batches,
        }))
    }

    /// Change an account's own limits; `None` if there is no such account.
    pub async fn set_quotas(&self, id: &AccountId, change: &QuotaChange) -> Result<Option<AccountRecord>> {
        let count = |c: Option<Option<u64>>| (c.is_some(), c.flatten().map(|n| n.min(i64::MAX as u64) as i64));
        let (queued_set, queued) = count(change.queued_requests);
        let (files_set, files) = count(change.file_bytes);
        let (adapters_set, adapters) = count(change.adapters);
        let row = sqlx::query(&format!(
            "UPDATE accounts SET
                 quota_queued_requests = CASE WHEN $2 THEN $3 ELSE quota_queued_requests END,
                 quota_realtime_per_second = CASE WHEN $4 THEN $5 ELSE quota_realtime_per_second END,
                 quota_file_bytes = CASE WHEN $6 THEN $7 ELSE quota_file_bytes END,
                 quota_adapters = CASE WHEN $8 THEN $9 ELSE quota_adapters END
             WHERE id = $1 RETURNING {ACCOUNT_COLUMNS}"
        ))
        .bind(&id.0)
        .bind(queued_set)
        .bind(queued)
        .bind(change.realtime_per_second.is_some())
        .bind(change.realtime_per_second.flatten())
        .bind(files_set)
        .bind(files)
        .bind(adapters_set)
        .bind(adapters)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.as_ref().map(AccountRecord::from_row))
    }

    /// Let a disabled account's keys in again (its cancelled batches stay cancelled).
    pub async fn enable_account(&self, id: &AccountId) -> Result<Option<AccountRecord>> {
        let row = sqlx::query(&format!(
            "UPDATE accounts SET disabled_at = NULL WHERE id = $1 RETURNING {ACCOUNT_COLUMNS}"
        ))
        .bind(&id.0)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.as_ref().map(AccountRecord::from_row))
    }

    /// How many of an account's batches have not ended; `None` if there is no such account.
    pub async fn open_batches(&self, id: &AccountId) -> Result<Option<i64>> {
        let open: Option<i64> = sqlx::query_scalar(
            "SELECT (SELECT count(*) FROM batches b WHERE b.account_id = a.id
                       AND b.status NOT IN ('completed', 'failed', 'expired', 'cancelled'))
             FROM accounts a WHERE a.id = $1",
        )
        .bind(&id.0)
        .fetch_optional(&self.pool)
        .await?;
        Ok(open)
    }

    /// Remove an account's rows: its keys, batches and their requests,
    /// webhook deliveries, files and adapters, in one transaction, if none
    /// of its batches is still open. The caller removes its objects from S3
    /// first.
    pub async fn delete_account_rows(&self, id: &AccountId) -> Result<Removal> {
        let mut tx = self.pool.begin().await?;
        // The account row is locked first, so no batch is made for it meanwhile.
        let exists: Option<String> = sqlx::query_scalar("SELECT id FROM accounts WHERE id = $1 FOR UPDATE")
            .bind(&id.0)
            .fetch_optional(&mut *tx)
            .await?;
        if exists.is_none() {
            return Ok(Removal::NotFound);
        }
        let open: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM batches WHERE account_id = $1
               AND status NOT IN ('completed', 'failed', 'expired', 'cancelled')",
        )
        .bind(&id.0)
        .fetch_one(&mut *tx)
        .await?;
        if open > 0 {
            return Ok(Removal::Busy(open as usize));
        }
        for statement in [
            "DELETE FROM webhook_attempts WHERE delivery_id IN (SELECT id FROM webhook_deliveries WHERE account_id = $1)",
            "DELETE FROM webhook_deliveries WHERE account_id = $1",
            "DELETE FROM requests WHERE batch_id IN (SELECT id FROM batches WHERE account_id = $1)",
            "DELETE FROM batches WHERE account_id = $1",
            "DELETE FROM files WHERE account_id = $1",
            "DELETE FROM adapters WHERE account_id = $1",
            "DELETE FROM outbox WHERE account_id = $1",
            "DELETE FROM dispatch_turns WHERE account_id = $1",
            "DELETE FROM accounts WHERE id = $1",
        ] {
            sqlx::query(statement).bind(&id.0).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(Removal::Removed)
    }

    /// A new key for an account; `None` if there is no such account.
    pub async fn create_key(&self, account: &AccountId, name: &str) -> Result<Option<NewKey>> {
        let mut tx = self.pool.begin().await?;
        let exists: Option<String> = sqlx::query_scalar("SELECT id FROM accounts WHERE id = $1 FOR SHARE")
            .bind(&account.0)
            .fetch_optional(&mut *tx)
            .await?;
        if exists.is_none() {
            return Ok(None);
        }
        let key = insert_key(&mut tx, account, name).await?;
        tx.commit().await?;
        Ok(Some(key))
    }

    /// An account's keys, revoked ones too, oldest first; `None` if there is no such account.
    pub async fn list_keys(&self, account: &AccountId) -> Result<Option<Vec<KeyRecord>>> {
        if self.account_record(account).await?.is_none() {
            return Ok(None);
        }
        let rows = sqlx::query(&format!(
            "SELECT {KEY_COLUMNS} FROM api_keys WHERE account_id = $1 ORDER BY created_at, id"
        ))
        .bind(&account.0)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(KeyRecord::from_row).collect::<Result<_>>().map(Some)
    }

    /// Revoke one of an account's keys: refused from the commit on. `None`
    /// if the account has no such key; revoking twice keeps the first time.
    pub async fn revoke_key(&self, account: &AccountId, key: &KeyId) -> Result<Option<KeyRecord>> {
        let row = sqlx::query(&format!(
            "UPDATE api_keys SET revoked_at = coalesce(revoked_at, now())
             WHERE account_id = $1 AND id = $2 RETURNING {KEY_COLUMNS}"
        ))
        .bind(&account.0)
        .bind(key.as_str())
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(KeyRecord::from_row).transpose()
    }
}

async fn insert_key(tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, account: &AccountId, name: &str) -> Result<NewKey> {
    let value = new_key_value();
    let row = sqlx::query(&format!(
        "INSERT INTO api_keys (id, account_id, name, key_hash, redacted) VALUES ($1, $2, $3, $4, $5)
         RETURNING {KEY_COLUMNS}"
    ))
    .bind(KeyId::generate().as_str())
    .bind(&account.0)
    .bind(name)
    .bind(hash_token(&value))
    .bind(redact(&value))
    .fetch_one(&mut **tx)
    .await?;
    Ok(NewKey {
        record: KeyRecord::from_row(&row)?,
        value,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_long_random_and_shown_redacted() {
        let a = new_key_value();
        let b = new_key_value();
        assert_ne!(a, b);
        assert!(a.starts_with("lorry_sk_") && a.len() == 9 + 43, "{a}");
        let shown = redact(&a);
        assert!(
            shown.starts_with(&a[..13]) && shown.ends_with(&a[a.len() - 4..]),
            "{shown}"
        );
        assert!(shown.chars().count() < 20, "{shown} shows too much");
        assert_eq!(redact("short"), "…");
    }
}
