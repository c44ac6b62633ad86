//! The worker's sources of LoRA adapter files, in tiers, for the engine's
//! adapter manager ([`lorry_engine::adapters`]), which decides what is
//! resident and asks [`AdapterTiers`] for the files of each adapter it loads:
//!
//! 1. **host**: the raw files of recently used adapters, budgeted in bytes;
//! 2. **disk**: the files under a local directory, budgeted in bytes;
//! 3. **S3**: the origin.
//!
//! [`reference`] turns an adapter's record into the engine's [`AdapterRef`]:
//! its id and version, and the object keys of its two files.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use lorry_engine::adapters::{AdapterFiles, AdapterRef, AdapterSource, Fetch, SourceError};
use lorry_engine::EngineError;

use crate::objects::ObjectStore;
use crate::store::AdapterRecord;

/// How the tiers are sized.
#[derive(Debug, Clone)]
pub struct TiersConfig {
    /// Raw adapter files kept in memory, in bytes.
    pub host_bytes: usize,
    /// Where files are kept on local disk (none: no disk tier).
    pub disk_dir: Option<PathBuf>,
    /// Most bytes the disk tier keeps.
    pub disk_bytes: u64,
}

impl Default for TiersConfig {
    fn default() -> Self {
        TiersConfig {
            host_bytes: 1 << 30,
            disk_dir: None,
            disk_bytes: 20 << 30,
        }
    }
}

/// Fetches served by each tier.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TierStats {
    /// From the host tier.
    pub host: u64,
    /// From the local disk tier.
    pub disk: u64,
    /// From S3.
    pub s3: u64,
}

/// The engine's reference to `record`'s adapter: its id and version, and
/// the object keys of its files. A record without both files cannot be served.
pub fn reference(record: &AdapterRecord) -> Result<AdapterRef, EngineError> {
    let (Some(config), Some(weights)) = (&record.config_key, &record.weights_key) else {
        return Err(EngineError::Model(format!(
            "adapter {} could not be served: a file is missing",
            record.id
        )));
    };
    Ok(AdapterRef {
        id: record.id.to_string(),
        version: record.version(),
        weights_bytes: record.weights_bytes.unwrap_or(0).max(0) as u64,
        config: config.clone(),
        weights: weights.clone(),
    })
}

/// An adapter id and the version of its files.
type Key = (String, i64);

/// An adapter's two files in memory, and when they were last used.
struct HostFiles {
    files: AdapterFiles,
    used: u64,
}

#[derive(Default)]
struct State {
    host: HashMap<Key, HostFiles>,
    host_used: usize,
    tick: u64,
    stats: TierStats,
}

struct Shared {
    state: Mutex<State>,
    objects: ObjectStore,
    config: TiersConfig,
}

/// The tiers; cheap to clone.
#[derive(Clone)]
pub struct AdapterTiers {
    shared: Arc<Shared>,
}

impl AdapterSource for AdapterTiers {
    fn fetch<'a>(&'a self, adapter: &'a AdapterRef) -> Fetch<'a> {
        Box::pin(self.files(adapter))
    }
}

impl AdapterTiers {
    /// Tiers whose origin is `objects`.
    pub fn new(objects: ObjectStore, config: TiersConfig) -> Self {
        AdapterTiers {
            shared: Arc::new(Shared {
                state: Mutex::new(State::default()),
                objects,
                config,
            }),
        }
    }

    /// Fetches served by each tier so far.
    pub fn stats(&self) -> TierStats {
        self.lock().stats.clone()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.shared
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Count a fetch from disk or S3, and keep its files in the host tier
    /// (evicting the least recently used) if they fit at all.
    fn keep(&self, key: Key, files: &AdapterFiles, from_disk: bool) {
        let budget = self.shared.config.host_bytes;
        let mut state = self.lock();
        let state = &mut *state;
        if from_disk {
            state.stats.disk += 1;
        } else {
            state.stats.s3 += 1;
        }
        let size = files.config.len() + files.weights.len();
        if size <= budget {
            while state.host_used + size > budget {
                let Some(oldest) = state
                    .host
                    .iter()
                    .min_by_key(|(_, host)| host.used)
                    .map(|(k, _)| k.clone())
                else {
                    break;
                };
                if let Some(host) = state.host.remove(&oldest) {
                    state.host_used -= host.files.config.len() + host.files.weights.len();
                }
            }
            let host = HostFiles {
                files: files.clone(),
                used: state.tick,
            };
            if state.host.insert(key, host).is_none() {
                state.host_used += size;
            }
        }
    }

    /// The two files, from the nearest tier that has them.
    async fn files(&self, adapter: &AdapterRef) -> Result<AdapterFiles, SourceError> {
        let shared = &self.shared;
        let key: Key = (adapter.id.clone(), adapter.version);
        {
            let mut state = self.lock();
            state.tick += 1;
            let tick = state.tick;
            if let Some(host) = state.host.get_mut(&key) {
                host.used = tick;
                let files = host.files.clone();
                state.stats.host += 1;
                return Ok(files);
            }
        }
        let disk = shared
            .config
            .disk_dir
            .as_ref()
            .map(|dir| dir.join(&adapter.id).join(adapter.version.to_string()));
        let mut from_disk = false;
        let mut found = None;
        if let Some(dir) = &disk {
            if let (Ok(config), Ok(weights)) = (
                tokio::fs::read(dir.join("adapter_config.json")).await,
                tokio::fs::read(dir.join("adapter_model.safetensors")).await,
            ) {
                if adapter.weights_bytes == weights.len() as u64 {
                    from_disk = true;
                    found = Some((config, weights));
                }
            }
        }
        let (config, weights) = match found {
            Some(files) => files,
            None => {
                let (config, weights) = tokio::try_join!(
                    shared.objects.get(&adapter.config),
                    shared.objects.get(&adapter.weights)
                )
                .map_err(|e| SourceError::Unavailable(e.to_string()))?;
                if let Some(dir) = &disk {
                    if let Err(e) = write_disk(dir, &config, &weights, shared.config.disk_bytes).await {
                        tracing::warn!(error = %e, "could not keep an adapter on disk");
                    }
                }
                (config, weights)
            }
        };
        let files = AdapterFiles {
            config: Arc::new(config),
            weights: Arc::new(weights),
        };
        self.keep(key, &files, from_disk);
        tracing::debug!(adapter = %adapter.id, from_disk, "adapter files fetched");
        Ok(files)
    }
}

/// Keep the files under `dir` (written aside, then renamed), then trim the
/// disk tier to `budget`, oldest first.
async fn write_disk(dir: &Path, config: &[u8], weights: &[u8], budget: u64) -> std::io::Result<()> {
    let parent = dir.parent().and_then(Path::parent).unwrap_or(dir).to_path_buf();
    let staging = dir.with_extension(format!("tmp-{}", uuid::Uuid::now_v7().simple()));
    tokio::fs::create_dir_all(&staging).await?;
    tokio::fs::write(staging.join("adapter_config.json"), config).await?;
    tokio::fs::write(staging.join("adapter_model.safetensors"), weights).await?;
    if tokio::fs::rename(&staging, dir).await.is_err() {
        // Another load wrote it first.
        let _ = tokio::fs::remove_dir_all(&staging).await;
    }
    tokio::task::spawn_blocking(move || trim_disk(&parent, budget))
        .await
        .map_err(std::io::Error::other)?
}

/// `root/<adapter>/<version>/…`: remove whole versions, least recently written first.
fn trim_disk(root: &Path, budget: u64) -> std::io::Result<()> {
    let mut versions = Vec::new();
    for adapter in std::fs::read_dir(root)? {
        let adapter = adapter?.path();
        if !adapter.is_dir() {
            continue;
        }
        for version in std::fs::read_dir(&adapter)? {
            let version = version?.path();
            let mut bytes = 0;
            let mut modified = std::time::SystemTime::UNIX_EPOCH;
            for file in std::fs::read_dir(&version)? {
                let meta = file?.metadata()?;
                bytes += meta.len();
                modified = modified.max(meta.modified()?);
            }
            versions.push((modified, bytes, version));
        }
    }
    let mut total: u64 = versions.iter().map(|(_, b, _)| b).sum();
    versions.sort();
    for (_, bytes, version) in versions {
        if total <= budget {
            break;
        }
        std::fs::remove_dir_all(&version)?;
        total -= bytes;
    }
    Ok(())
}
