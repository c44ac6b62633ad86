//! Files of the OpenAI files API: batch input uploaded by clients and the
//! output and error files of ended batches. The bytes live in S3; a record
//! names them. Every read is scoped to the owning account.

use chrono::{DateTime, Utc};
use serde_json::{json, Value};
use sqlx::postgres::PgRow;
use sqlx::{Postgres, Row, Transaction};

use super::accounts::lock_active;
use super::{Result, Store};
use crate::ids::{AccountId, FileId};
use crate::quota::{within, Refusal};

/// One file as stored: what was recorded, and when.
#[derive(Debug, Clone, PartialEq)]
pub struct FileRecord {
    /// Its id, owner, purpose, name, size and key.
    pub file: NewFile,
    /// When it was created.
    pub created_at: DateTime<Utc>,
}

impl FileRecord {
    fn from_row(row: &PgRow) -> Self {
        FileRecord {
            file: NewFile {
                id: FileId::parse(row.get::<&str, _>("id")).expect("file ids are written by Lorry"),
                account_id: AccountId(row.get("account_id")),
                purpose: row.get("purpose"),
                filename: row.get("filename"),
                bytes: row.get("bytes"),
                lines: row.get("lines"),
                object_key: row.get("object_key"),
                expires_after: row
                    .get::<Option<DateTime<Utc>>, _>("expires_at")
                    .map(|at| (at - row.get::<DateTime<Utc>, _>("created_at")).num_seconds()),
            },
            created_at: row.get("created_at"),
        }
    }

    /// OpenAI's file object.
    pub fn to_json(&self) -> Value {
        let file = &self.file;
        json!({
            "id": file.id,
            "object": "file",
            "bytes": file.bytes,
            "created_at": self.created_at.timestamp(),
            "filename": file.filename,
            "purpose": file.purpose,
            "status": "processed",
            "status_details": null,
            "expires_at": file.expires_after.map(|after| self.created_at.timestamp() + after),
        })
    }
}

/// A file to record.
#[derive(Debug, Clone, PartialEq)]
pub struct NewFile {
    /// Its id.
    pub id: FileId,
    /// The owner.
    pub account_id: AccountId,
    /// `batch` or `batch_output`.
    pub purpose: String,
    /// Its name.
    pub filename: String,
    /// Size.
    pub bytes: i64,
    /// JSON lines in it.
    pub lines: i32,
    /// Where the bytes are.
    pub object_key: String,
    /// Seconds after its creation when it is deleted, if it expires (the
    /// database's clock places both instants, so they are exactly this far apart).
    pub expires_after: Option<i64>,
}

const FILE_COLUMNS: &str = "id, account_id, purpose, filename, bytes, lines, object_key, created_at, expires_at";

pub(super) async fn insert_file(tx: &mut Transaction<'_, Postgres>, file: &NewFile) -> Result<()> {
    sqlx::query(
        "INSERT INTO files (id, account_id, purpose, filename, bytes, lines, object_key, expires_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, now() + $8::float8 * interval '1 second')",
    )
    .bind(file.id.as_str())
    .bind(&file.account_id.0)
    .bind(&file.purpose)
    .bind(&file.filename)
    .bind(file.bytes)
    .bind(file.lines)
    .bind(&file.object_key)
    .bind(file.expires_after)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

impl Store {
    /// Record a file whose bytes are already in S3, if the account's files
    /// stay within `limit` bytes with it (0: no limit) and it is not disabled.
    pub async fn insert_file(&self, file: &NewFile, limit: u64) -> Result<std::result::Result<FileRecord, Refusal>> {
        let mut tx = self.pool.begin().await?;
        if lock_active(&mut tx, &file.account_id, limit > 0).await?.is_none() {
            return Ok(Err(Refusal::AccountDisabled));
        }
        if limit > 0 {
            let stored: i64 =
                sqlx::query_scalar("SELECT coalesce(sum(bytes), 0)::bigint FROM files WHERE account_id = $1")
                    .bind(&file.account_id.0)
                    .fetch_one(&mut *tx)
                    .await?;
            if let Err(over) = within(stored as u64, file.bytes.max(0) as u64, limit) {
                return Ok(Err(Refusal::OverQuota(over)));
            }
        }
        insert_file(&mut tx, file).await?;
        tx.commit().await?;
        Ok(Ok(self
            .file(&file.account_id, &file.id)
            .await?
            .expect("a file just written is there")))
    }

    /// The account's file, if it has one by that id.
    pub async fn file(&self, account: &AccountId, id: &FileId) -> Result<Option<FileRecord>> {
        let row = sqlx::query(&format!(
            "SELECT {FILE_COLUMNS} FROM files WHERE account_id = $1 AND id = $2"
        ))
        .bind(&account.0)
        .bind(id.as_str())
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.as_ref().map(FileRecord::from_row))
    }

    /// The account's files, newest first: up to `limit`, older than `after` if given,
    /// and whether more follow.
    pub async fn list_files(
        &self,
        account: &AccountId,
        purpose: Option<&str>,
        limit: i64,
        after: Option<&FileId>,
    ) -> Result<(Vec<FileRecord>, bool)> {
        let rows = sqlx::query(&format!(
            "SELECT {FILE_COLUMNS} FROM files
             WHERE account_id = $1 AND ($2::text IS NULL OR purpose = $2) AND ($3::text IS NULL OR id < $3)
             ORDER BY id DESC LIMIT $4"
        ))
        .bind(&account.0)
        .bind(purpose)
        .bind(after.map(FileId::as_str))
        .bind(limit + 1)
        .fetch_all(&self.pool)
        .await?;
        let mut files: Vec<FileRecord> = rows.iter().map(FileRecord::from_row).collect();
        let more = files.len() as i64 > limit;
        files.truncate(limit as usize);
        Ok((files, more))
    }

    /// Delete the account's file record; returns it if there was one.
    pub async fn delete_file(&self, account: &AccountId, id: &FileId) -> Result<Option<FileRecord>> {
        let row = sqlx::query(&format!(
            "DELETE FROM files WHERE account_id = $1 AND id = $2 RETURNING {FILE_COLUMNS}"
        ))
        .bind(&account.0)
        .bind(id.as_str())
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.as_ref().map(FileRecord::from_row))
    }
}
