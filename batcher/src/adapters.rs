//! The worker's LoRA adapter cache, in tiers:
//!
//! 1. **resident**: packed adapters the engine reads, budgeted in bytes (on a
//!    CPU engine this is host memory; on a GPU it is device memory). A request
//!    holds a [`Lease`] on its adapter while it runs, and only adapters nobody
//!    holds are evicted (least recently used first);
//! 2. **host**: the raw files of recently used adapters, budgeted in bytes;
//! 3. **disk**: the files under a local directory, budgeted in bytes;
//! 4. **S3**: the origin.
//!
//! Loads run on the async runtime and the blocking pool, never on the engine
//! thread, so the batch keeps decoding while they run; a request reaches the
//! engine only once its adapter is resident. When the resident budget is full
//! of adapters in use, loads wait in arrival order; once the first has waited
//! a full `cycle`, new requests for resident adapters wait too, so the ones in
//! use drain and the waiting adapter gets in (LoRAX's cycle): no adapter
//! starves.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use lorry_engine::lora::{Adapter, AdapterLimits, PackedAdapter};
use lorry_engine::AdapterShape;

use crate::ids::AdapterId;
use crate::objects::ObjectStore;
use crate::store::AdapterRecord;

/// How the cache is sized.
#[derive(Debug, Clone)]
pub struct AdapterCacheConfig {
    /// Packed adapters the engine may hold at once, in bytes.
    pub resident_bytes: usize,
    /// Raw adapter files kept in memory, in bytes.
    pub host_bytes: usize,
    /// Where files are kept on local disk (none: no disk tier).
    pub disk_dir: Option<PathBuf>,
    /// Most bytes the disk tier keeps.
    pub disk_bytes: u64,
    /// How long a waiting adapter waits before requests for resident adapters are held back for it.
    pub cycle: Duration,
    /// The limits uploads were checked against.
    pub limits: AdapterLimits,
}

impl Default for AdapterCacheConfig {
    fn default() -> Self {
        AdapterCacheConfig {
            resident_bytes: 2 << 30,
            host_bytes: 1 << 30,
            disk_dir: None,
            disk_bytes: 20 << 30,
            cycle: Duration::from_secs(2),
            limits: AdapterLimits::default(),
        }
    }
}

/// Where a load found the files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// The host tier (memory).
    Host,
    /// The local disk tier.
    Disk,
    /// S3.
    S3,
}

/// The cache's counters.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AdapterStats {
    /// Requests whose adapter was resident.
    pub hits: u64,
    /// Loads from the host tier.
    pub host_loads: u64,
    /// Loads from the disk tier.
    pub disk_loads: u64,
    /// Loads from S3.
    pub s3_loads: u64,
    /// Loads that failed.
    pub failed_loads: u64,
    /// Resident adapters evicted.
    pub evictions: u64,
    /// Requests that waited for room.
    pub waits: u64,
    /// Seconds each recent load took (fetch, check and pack), oldest first.
    pub load_seconds: Vec<f64>,
    /// Bytes resident now.
    pub resident_bytes: usize,
}

impl AdapterStats {
    /// Every load, whatever its origin.
    pub fn loads(&self) -> u64 {
        self.host_loads + self.disk_loads + self.s3_loads
    }
}

const RECENT_LOADS: usize = 1024;

/// Why an adapter could not be made resident.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The files could not be fetched (S3 or the disk); trying again may work.
    #[error("fetching adapter {0}: {1}")]
    Fetch(AdapterId, String),
    /// The files no longer pass the checks, or do not fit the cache.
    #[error("adapter {0}: {1}")]
    Invalid(AdapterId, String),
}

/// An adapter held resident while a request uses it.
pub struct Lease {
    adapter: Arc<PackedAdapter>,
    key: Key,
    shared: Arc<Shared>,
}

impl Lease {
    /// The packed adapter, for the engine.
    pub fn adapter(&self) -> Arc<PackedAdapter> {
        Arc::clone(&self.adapter)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        if let Some(resident) = state.resident.get_mut(&self.key) {
            resident.leases -= 1;
        }
        drop(state);
        self.shared.changed.notify_waiters();
    }
}

/// An adapter id and the version of its files.
type Key = (AdapterId, i64);

struct Resident {
    adapter: Arc<PackedAdapter>,
    bytes: usize,
    leases: usize,
    last_used: u64,
}

/// An adapter's two files in memory, and when they were last used.
struct HostFiles {
    config: Arc<Vec<u8>>,
    weights: Arc<Vec<u8>>,
    used: u64,
}

struct Waiting {
    key: Key,
    since: Instant,
    seen: Instant,
}

#[derive(Default)]
struct State {
    resident: HashMap<Key, Resident>,
    loading: HashMap<Key, usize>,
    /// Resident bytes plus bytes reserved by loads in progress.
    used: usize,
    waiting: VecDeque<Waiting>,
    host: HashMap<Key, HostFiles>,
    host_used: usize,
    tick: u64,
    stats: AdapterStats,
}

struct Shared {
    state: Mutex<State>,
    changed: tokio::sync::Notify,
    objects: ObjectStore,
    config: AdapterCacheConfig,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The cache; cheap to clone, shared by every model a worker serves.
#[derive(Clone)]
pub struct AdapterCache {
    shared: Arc<Shared>,
}

/// Frees a load's reservation if the load is abandoned.
struct Reservation<'a> {
    shared: &'a Shared,
    key: Key,
    bytes: usize,
    done: bool,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if !self.done {
            let mut state = self.shared.lock();
            state.loading.remove(&self.key);
            state.used -= self.bytes;
            drop(state);
            self.shared.changed.notify_waiters();
        }
    }
}

enum Step {
    Leased(Lease),
    Load(usize),
    Wait,
}

impl AdapterCache {
    /// A cache whose origin is `objects`.
    pub fn new(objects: ObjectStore, config: AdapterCacheConfig) -> Self {
        AdapterCache {
            shared: Arc::new(Shared {
                state: Mutex::new(State::default()),
                changed: tokio::sync::Notify::new(),
                objects,
                config,
            }),
        }
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> AdapterStats {
        let state = self.shared.lock();
        let mut stats = state.stats.clone();
        stats.resident_bytes = state.resident.values().map(|r| r.bytes).sum();
        stats
    }

    /// Make `record`'s adapter resident for a model of shape `base`, and hold
    /// it until the lease is dropped. Waits while the resident budget is full
    /// of adapters in use.
    pub async fn acquire(&self, record: &AdapterRecord, base: &AdapterShape) -> Result<Lease, LoadError> {
        let key: Key = (record.id.clone(), record.version());
        // Packing pads each lora_A to 16 rows: at most twice the file.
        let estimate = (record.weights_bytes.unwrap_or(0).max(0) as usize).saturating_mul(2);
        let budget = self.shared.config.resident_bytes;
        if estimate > budget {
            return Err(LoadError::Invalid(
                key.0,
                format!("needs up to {estimate} bytes resident; this worker holds {budget}"),
            ));
        }
        let mut counted_wait = false;
        loop {
            let notified = self.shared.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            match self.step(&key, estimate, &mut counted_wait) {
                Step::Leased(lease) => return Ok(lease),
                Step::Load(bytes) => return self.load(record, base, key, bytes).await,
                Step::Wait => {
                    // Woken by any change; a timeout re-checks the cycle.
                    let _ = tokio::time::timeout(recheck(&self.shared.config), notified).await;
                }
            }
        }
    }

    fn step(&self, key: &Key, estimate: usize, counted_wait: &mut bool) -> Step {
        let config = &self.shared.config;
        let mut state = self.shared.lock();
        let state = &mut *state;
        state.tick += 1;
        let now = Instant::now();
        // Waiters refresh their place each time they look; one that stopped looking has gone.
        let stale = 3 * recheck(config);
        state.waiting.retain(|w| now.duration_since(w.seen) < stale);
        let starved = state
            .waiting
            .front()
            .is_some_and(|w| &w.key != key && now.duration_since(w.since) >= config.cycle);
        if let Some(resident) = state.resident.get_mut(key) {
            if !starved {
                resident.leases += 1;
                resident.last_used = state.tick;
                state.stats.hits += 1;
                return Step::Leased(Lease {
                    adapter: Arc::clone(&resident.adapter),
                    key: key.clone(),
                    shared: Arc::clone(&self.shared),
                });
            }
        } else if !state.loading.contains_key(key) {
            let first = state.waiting.front().is_none_or(|w| &w.key == key);
            if first {
                evict_until(state, config.resident_bytes.saturating_sub(estimate));
                if state.used + estimate <= config.resident_bytes {
                    if state.waiting.front().is_some_and(|w| &w.key == key) {
                        state.waiting.pop_front();
                    }
                    state.used += estimate;
                    state.loading.insert(key.clone(), estimate);
                    return Step::Load(estimate);
                }
            }
            match state.waiting.iter_mut().find(|w| &w.key == key) {
                Some(w) => w.seen = now,
                None => state.waiting.push_back(Waiting {
                    key: key.clone(),
                    since: now,
                    seen: now,
                }),
            }
        }
        if !*counted_wait {
            *counted_wait = true;
            state.stats.waits += 1;
        }
        Step::Wait
    }

    async fn load(
        &self,
        record: &AdapterRecord,
        base: &AdapterShape,
        key: Key,
        reserved: usize,
    ) -> Result<Lease, LoadError> {
        let shared = &self.shared;
        let mut reservation = Reservation {
            shared,
            key: key.clone(),
            bytes: reserved,
            done: false,
        };
        let started = Instant::now();
        let loaded = async {
            let (config, weights, origin) = self.fetch(record, &key).await?;
            let base = *base;
            let limits = shared.config.limits;
            let packed = tokio::task::spawn_blocking(move || {
                Adapter::parse(&config, &weights, &base, limits).map(|adapter| PackedAdapter::new(&adapter))
            })
            .await
            .map_err(|e| LoadError::Invalid(key.0.clone(), e.to_string()))?
            .map_err(|e| LoadError::Invalid(key.0.clone(), format!("{}: {}", e.code, e.message)))?;
            Ok::<_, LoadError>((packed, origin))
        }
        .await;
        let seconds = started.elapsed().as_secs_f64();
        let mut state = shared.lock();
        reservation.done = true;
        state.loading.remove(&key);
        state.used -= reserved;
        let result = match loaded {
            Ok((packed, origin)) => {
                let bytes = packed.bytes();
                let adapter = Arc::new(packed);
                state.used += bytes;
                state.tick += 1;
                let tick = state.tick;
                state.resident.insert(
                    key.clone(),
                    Resident {
                        adapter: Arc::clone(&adapter),
                        bytes,
                        leases: 1,
                        last_used: tick,
                    },
                );
                let stats = &mut state.stats;
                match origin {
                    Origin::Host => stats.host_loads += 1,
                    Origin::Disk => stats.disk_loads += 1,
                    Origin::S3 => stats.s3_loads += 1,
                }
                if stats.load_seconds.len() == RECENT_LOADS {
                    stats.load_seconds.remove(0);
                }
                stats.load_seconds.push(seconds);
                tracing::info!(adapter = %key.0, bytes, ?origin, seconds, "adapter loaded");
                Ok(Lease {
                    adapter,
                    key,
                    shared: Arc::clone(shared),
                })
            }
            Err(e) => {
                state.stats.failed_loads += 1;
                tracing::warn!(error = %e, "adapter load failed");
                Err(e)
            }
        };
        drop(state);
        shared.changed.notify_waiters();
        result
    }

    /// The two files, from the nearest tier that has them.
    async fn fetch(
        &self,
        record: &AdapterRecord,
        key: &Key,
    ) -> Result<(Arc<Vec<u8>>, Arc<Vec<u8>>, Origin), LoadError> {
        let shared = &self.shared;
        {
            let mut state = shared.lock();
            state.tick += 1;
            let tick = state.tick;
            if let Some(files) = state.host.get_mut(key) {
                files.used = tick;
                return Ok((Arc::clone(&files.config), Arc::clone(&files.weights), Origin::Host));
            }
        }
        let fail = |e: String| LoadError::Fetch(key.0.clone(), e);
        let disk = shared
            .config
            .disk_dir
            .as_ref()
            .map(|dir| dir.join(key.0.as_str()).join(key.1.to_string()));
        let mut origin = Origin::S3;
        let mut files = None;
        if let Some(dir) = &disk {
            if let (Ok(config), Ok(weights)) = (
                tokio::fs::read(dir.join("adapter_config.json")).await,
                tokio::fs::read(dir.join("adapter_model.safetensors")).await,
            ) {
                if record.weights_bytes == Some(weights.len() as i64) {
                    origin = Origin::Disk;
                    files = Some((config, weights));
                }
            }
        }
        let (config, weights) = match files {
            Some(files) => files,
            None => {
                let (Some(config_key), Some(weights_key)) = (&record.config_key, &record.weights_key) else {
                    return Err(LoadError::Invalid(key.0.clone(), "a file is missing".into()));
                };
                let (config, weights) =
                    tokio::try_join!(shared.objects.get(config_key), shared.objects.get(weights_key))
                        .map_err(|e| fail(e.to_string()))?;
                if let Some(dir) = &disk {
                    if let Err(e) = write_disk(dir, &config, &weights, shared.config.disk_bytes).await {
                        tracing::warn!(error = %e, "could not keep an adapter on disk");
                    }
                }
                (config, weights)
            }
        };
        let (config, weights) = (Arc::new(config), Arc::new(weights));
        let mut state = shared.lock();
        let state = &mut *state;
        let size = config.len() + weights.len();
        if size <= shared.config.host_bytes {
            while state.host_used + size > shared.config.host_bytes {
                let Some(oldest) = state
                    .host
                    .iter()
                    .min_by_key(|(_, files)| files.used)
                    .map(|(k, _)| k.clone())
                else {
                    break;
                };
                if let Some(files) = state.host.remove(&oldest) {
                    state.host_used -= files.config.len() + files.weights.len();
                }
            }
            let files = HostFiles {
                config: Arc::clone(&config),
                weights: Arc::clone(&weights),
                used: state.tick,
            };
            if state.host.insert(key.clone(), files).is_none() {
                state.host_used += size;
            }
        }
        Ok((config, weights, origin))
    }
}

/// How often a waiting request looks again when nothing wakes it.
fn recheck(config: &AdapterCacheConfig) -> Duration {
    (config.cycle / 4).clamp(Duration::from_millis(10), Duration::from_secs(1))
}

/// Evict unleased adapters, least recently used first, until at most `target` bytes are in use.
fn evict_until(state: &mut State, target: usize) {
    while state.used > target {
        let victim = state
            .resident
            .iter()
            .filter(|(_, r)| r.leases == 0)
            .min_by_key(|(_, r)| r.last_used)
            .map(|(k, _)| k.clone());
        let Some(victim) = victim else {
            return;
        };
        if let Some(resident) = state.resident.remove(&victim) {
            state.used -= resident.bytes;
            state.stats.evictions += 1;
        }
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
