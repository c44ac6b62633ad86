//! What an operator does to accounts that spans the database and S3: the
//! CLI (`lorry accounts`) and the admin routes (`/admin/v1`) both call it.

use crate::ids::AccountId;
use crate::objects::{account_prefix, ObjectStore};
use crate::store::{Removal, Store};
use crate::BatcherError;

/// What deleting an account did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Deletion {
    /// The account is gone, with its rows and this many S3 objects.
    Deleted {
        /// Objects removed from S3.
        objects: usize,
    },
    /// No such account.
    NotFound,
    /// The account is disabled and its open batches cancelled, but this many
    /// have not ended yet (their running requests finish first): try again.
    Busy(usize),
}

/// Delete an account and everything it owns. The account is disabled first
/// (its keys refused, its queued and running batches cancelled); once none
/// of its batches is open, its S3 objects are removed, then its rows in one
/// transaction. Each step can be repeated, so a deletion cut short is
/// finished by asking again.
pub async fn delete_account(store: &Store, objects: &ObjectStore, id: &AccountId) -> Result<Deletion, BatcherError> {
    if store.disable_account(id).await?.is_none() {
        return Ok(Deletion::NotFound);
    }
    match store.open_batches(id).await? {
        None => return Ok(Deletion::NotFound),
        Some(open) if open > 0 => return Ok(Deletion::Busy(open as usize)),
        Some(_) => {}
    }
    let removed = objects.delete_prefix(&account_prefix(id)).await?;
    Ok(match store.delete_account_rows(id).await? {
        Removal::Removed => Deletion::Deleted { objects: removed },
        Removal::NotFound => Deletion::NotFound,
        Removal::Busy(open) => Deletion::Busy(open),
    })
}
