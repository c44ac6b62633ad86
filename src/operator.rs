//! `lorry accounts …` and `lorry keys …`: the operator's commands, straight
//! against the deployment's database (and S3, to delete an account). The
//! same operations are served under `/admin/v1` with `LORRY_ADMIN_TOKEN`.
//!
//! The commands that make a key print it alone on their last line, so that
//! scripts read it with `tail -n 1`; it is shown this once.

use anyhow::{bail, Context as _};
use lorry_batcher::admin::{self, Deletion};
use lorry_batcher::ids::{AccountId, KeyId};
use lorry_batcher::objects::ObjectStore;
use lorry_batcher::quota::QuotaChange;
use lorry_batcher::store::{AccountRecord, KeyRecord};

use crate::{open_store, Settings};

/// `lorry accounts …`.
#[derive(clap::Subcommand)]
pub enum AccountsCommand {
    /// Make an account and its first API key (printed alone on the last line).
    Create {
        /// The account's name, which is its id: 1–64 of a-z, 0-9, '-' and '_'.
        name: String,
        /// The first key's name.
        #[arg(long, default_value = "default")]
        key_name: String,
        #[command(flatten)]
        settings: Box<Settings>,
    },
    /// Every account, with its status.
    List {
        #[command(flatten)]
        settings: Box<Settings>,
    },
    /// Refuse the account's keys from now on and cancel its queued and running batches.
    Disable {
        /// The account's name.
        name: String,
        #[command(flatten)]
        settings: Box<Settings>,
    },
    /// Set an account's own limits (a number, 0 for no limit, or `default`
    /// for the deployment's); limits not named are left as they are.
    SetQuota {
        /// The account's name.
        name: String,
        /// Batch requests accepted and not yet ended.
        #[arg(long)]
        queued_requests: Option<Limit>,
        /// Real-time requests a second.
        #[arg(long)]
        realtime_per_second: Option<Limit>,
        /// Bytes of files held.
        #[arg(long)]
        file_bytes: Option<Limit>,
        /// Adapters held.
        #[arg(long)]
        adapters: Option<Limit>,
        #[command(flatten)]
        settings: Box<Settings>,
    },
    /// Let a disabled account's keys in again (cancelled batches stay cancelled).
    Enable {
        /// The account's name.
        name: String,
        #[command(flatten)]
        settings: Box<Settings>,
    },
    /// Disable the account, wait for its batches to end, then delete its
    /// keys, batches, files and adapters, rows and S3 objects.
    Delete {
        /// The account's name.
        name: String,
        /// Seconds to wait for its batches to end (cancelling ones finish their running requests).
        #[arg(long, default_value_t = 300)]
        wait_secs: u64,
        #[command(flatten)]
        settings: Box<Settings>,
    },
}

/// `lorry keys …`.
#[derive(clap::Subcommand)]
pub enum KeysCommand {
    /// Make another API key for an account (printed alone on the last line).
    Create {
        /// The account's name.
        account: String,
        /// The key's name.
        #[arg(long, default_value = "default")]
        name: String,
        #[command(flatten)]
        settings: Box<Settings>,
    },
    /// An account's keys, revoked ones too (never their values).
    List {
        /// The account's name.
        account: String,
        #[command(flatten)]
        settings: Box<Settings>,
    },
    /// Refuse a key from now on.
    Revoke {
        /// The account's name.
        account: String,
        /// The key's id (`key_…`, from `lorry keys list`).
        key_id: String,
        #[command(flatten)]
        settings: Box<Settings>,
    },
}

/// A limit on the command line: a number (0: no limit) or `default`.
#[derive(Clone, Copy, Debug)]
pub struct Limit(Option<f64>);

impl std::str::FromStr for Limit {
    type Err = String;

    fn from_str(raw: &str) -> Result<Self, String> {
        if raw == "default" {
            return Ok(Limit(None));
        }
        match raw.parse::<f64>() {
            Ok(n) if n.is_finite() && n >= 0.0 => Ok(Limit(Some(n))),
            _ => Err(format!("{raw:?}: a number from 0 (no limit), or `default`")),
        }
    }
}

impl Limit {
    fn count(self) -> anyhow::Result<Option<u64>> {
        match self.0 {
            None => Ok(None),
            Some(n) if n.fract() == 0.0 && n <= i64::MAX as f64 => Ok(Some(n as u64)),
            Some(n) => bail!("{n} is not a whole number"),
        }
    }
}

fn account_name(raw: &str) -> anyhow::Result<AccountId> {
    AccountId::parse_name(raw).with_context(|| {
        format!(
            "{raw:?} is not an account name: 1 to {} of a-z, 0-9, '-' and '_', starting with a letter or a digit",
            AccountId::MAX_LEN
        )
    })
}

fn key_name(raw: &str) -> anyhow::Result<&str> {
    if raw.is_empty() || raw.chars().count() > 128 || raw.chars().any(char::is_control) {
        bail!("a key name is 1 to 128 characters, none of them a control character");
    }
    Ok(raw)
}

fn time(t: Option<chrono::DateTime<chrono::Utc>>) -> String {
    t.map(|t| t.format("%Y-%m-%d %H:%M:%SZ").to_string())
        .unwrap_or_else(|| "-".into())
}

fn print_account(account: &AccountRecord) {
    let own = |n: Option<String>| n.unwrap_or_else(|| "default".into());
    let q = &account.quotas;
    println!(
        "{:<24} {:<9} created {}  disabled {}  quotas: queued_requests {} realtime_per_second {} file_bytes {} adapters {}",
        account.id.0,
        account.status(),
        time(Some(account.created_at)),
        time(account.disabled_at),
        own(q.queued_requests.map(|n| n.to_string())),
        own(q.realtime_per_second.map(|n| n.to_string())),
        own(q.file_bytes.map(|n| n.to_string())),
        own(q.adapters.map(|n| n.to_string())),
    );
}

fn print_key(key: &KeyRecord) {
    println!(
        "{}  {:<20} {:<20} created {}  last used {}  revoked {}",
        key.id,
        key.name,
        key.redacted,
        time(Some(key.created_at)),
        time(key.last_used_at),
        time(key.revoked_at)
    );
}

/// Run `lorry accounts …`.
pub async fn accounts(command: AccountsCommand) -> anyhow::Result<()> {
    match command {
        AccountsCommand::Create {
            name,
            key_name: key,
            settings,
        } => {
            let id = account_name(&name)?;
            let key = key_name(&key)?;
            let store = open_store(&settings, false).await?;
            let Some((account, key)) = store.create_account(&id, key).await? else {
                bail!("an account named {id} exists");
            };
            print_account(&account);
            print_key(&key.record);
            println!("{}", key.value);
        }
        AccountsCommand::List { settings } => {
            let store = open_store(&settings, false).await?;
            let mut after = None;
            loop {
                let page = store.list_accounts(500, after.as_ref()).await?;
                for account in &page {
                    print_account(account);
                }
                match page.last() {
                    Some(last) if page.len() == 500 => after = Some(last.id.clone()),
                    _ => break,
                }
            }
        }
        AccountsCommand::Disable { name, settings } => {
            let id = account_name(&name)?;
            let store = open_store(&settings, false).await?;
            let disabled = store
                .disable_account(&id)
                .await?
                .with_context(|| format!("no account named {id}"))?;
            print_account(&disabled.account);
            for batch in &disabled.cancelled_batches {
                println!("cancelled {batch}");
            }
        }
        AccountsCommand::SetQuota {
            name,
            queued_requests,
            realtime_per_second,
            file_bytes,
            adapters,
            settings,
        } => {
            let id = account_name(&name)?;
            let change = QuotaChange {
                queued_requests: queued_requests.map(Limit::count).transpose()?,
                realtime_per_second: realtime_per_second.map(|l| l.0),
                file_bytes: file_bytes.map(Limit::count).transpose()?,
                adapters: adapters.map(Limit::count).transpose()?,
            };
            let store = open_store(&settings, false).await?;
            let account = store
                .set_quotas(&id, &change)
                .await?
                .with_context(|| format!("no account named {id}"))?;
            print_account(&account);
        }
        AccountsCommand::Enable { name, settings } => {
            let id = account_name(&name)?;
            let store = open_store(&settings, false).await?;
            let account = store
                .enable_account(&id)
                .await?
                .with_context(|| format!("no account named {id}"))?;
            print_account(&account);
        }
        AccountsCommand::Delete {
            name,
            wait_secs,
            settings,
        } => {
            let id = account_name(&name)?;
            let store = open_store(&settings, false).await?;
            let objects = ObjectStore::new(&settings.object_store());
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(wait_secs);
            loop {
                match admin::delete_account(&store, &objects, &id).await? {
                    Deletion::Deleted { objects } => {
                        println!("deleted {id} ({objects} objects)");
                        return Ok(());
                    }
                    Deletion::NotFound => bail!("no account named {id}"),
                    Deletion::Busy(open) if std::time::Instant::now() < deadline => {
                        eprintln!("{id} is disabled; waiting for {open} batches to end");
                        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
                    }
                    Deletion::Busy(open) => bail!(
                        "{id} is disabled and its batches cancelled, but {open} have not ended; run delete again later"
                    ),
                }
            }
        }
    }
    Ok(())
}

/// Run `lorry keys …`.
pub async fn keys(command: KeysCommand) -> anyhow::Result<()> {
    match command {
        KeysCommand::Create {
            account,
            name,
            settings,
        } => {
            let id = account_name(&account)?;
            let name = key_name(&name)?;
            let store = open_store(&settings, false).await?;
            let key = store
                .create_key(&id, name)
                .await?
                .with_context(|| format!("no account named {id}"))?;
            print_key(&key.record);
            println!("{}", key.value);
        }
        KeysCommand::List { account, settings } => {
            let id = account_name(&account)?;
            let store = open_store(&settings, false).await?;
            let keys = store
                .list_keys(&id)
                .await?
                .with_context(|| format!("no account named {id}"))?;
            for key in &keys {
                print_key(key);
            }
        }
        KeysCommand::Revoke {
            account,
            key_id,
            settings,
        } => {
            let id = account_name(&account)?;
            let key = KeyId::parse(&key_id).with_context(|| format!("{key_id:?} is not a key id (key_…)"))?;
            let store = open_store(&settings, false).await?;
            let key = store
                .revoke_key(&id, &key)
                .await?
                .with_context(|| format!("{id} has no key {key_id}"))?;
            print_key(&key);
        }
    }
    Ok(())
}
