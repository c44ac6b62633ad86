//! The engine's LoRA adapters: which are resident, who is using them, and
//! when a load must wait for room.
//!
//! A request names its adapter with an [`AdapterRef`]. Before the request
//! joins the batch, the engine makes that adapter resident: it asks an
//! injected [`AdapterSource`] for the two PEFT files (the worker's host,
//! disk and S3 tiers; [`LocalFiles`] for `lorry generate`), then checks them
//! against the model and packs them on the blocking pool — never on the
//! engine thread, so the batch keeps decoding while an adapter loads.
//!
//! Resident adapters are budgeted in bytes (host memory on a CPU engine,
//! device memory on a GPU). A running sequence holds a [`Lease`] on its
//! adapter, and only adapters nobody holds are evicted, least recently used
//! first. When the budget is full of adapters in use, loads wait in arrival
//! order; once the first has waited a full `cycle`, new requests for resident
//! adapters wait too, so the ones in use drain and the waiting adapter gets
//! in (LoRAX's cycle): no adapter starves. One [`Adapters`] is shared by
//! every model a worker serves.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::ops::Deref;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::lora::{Adapter, AdapterLimits, PackedAdapter};
use crate::{AdapterShape, EngineError};

/// The adapter a request runs with, and where its source finds the files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterRef {
    /// Its stable id.
    pub id: String,
    /// The version of its files: another version is another adapter.
    pub version: i64,
    /// The size of its weights file in bytes (a load reserves twice this:
    /// packing pads each `lora_A` to 16 rows).
    pub weights_bytes: u64,
    /// Where the source finds `adapter_config.json` (an object key, a path).
    pub config: String,
    /// Where the source finds `adapter_model.safetensors`.
    pub weights: String,
}

impl AdapterRef {
    /// The adapter in a local PEFT directory, for [`LocalFiles`].
    pub fn local(dir: &Path) -> std::io::Result<AdapterRef> {
        let weights = dir.join("adapter_model.safetensors");
        Ok(AdapterRef {
            id: dir.display().to_string(),
            version: 0,
            weights_bytes: std::fs::metadata(&weights)?.len(),
            config: dir.join("adapter_config.json").display().to_string(),
            weights: weights.display().to_string(),
        })
    }
}

/// An adapter's two files, as its source hands them over.
#[derive(Debug, Clone)]
pub struct AdapterFiles {
    /// `adapter_config.json`.
    pub config: Arc<Vec<u8>>,
    /// `adapter_model.safetensors`.
    pub weights: Arc<Vec<u8>>,
}

/// Why a source could not hand over an adapter's files.
#[derive(Debug, Clone, thiserror::Error)]
pub enum SourceError {
    /// Not reachable just now (the object store is down): the request is
    /// not run, and may be delivered again.
    #[error("{0}")]
    Unavailable(String),
    /// Missing or unreadable for good.
    #[error("{0}")]
    Invalid(String),
}

/// What [`AdapterSource::fetch`] returns.
pub type Fetch<'a> = Pin<Box<dyn Future<Output = Result<AdapterFiles, SourceError>> + Send + 'a>>;

/// Where adapters' files come from; the engine asks it for each load.
pub trait AdapterSource: Send + Sync + 'static {
    /// The two files of `adapter`.
    fn fetch<'a>(&'a self, adapter: &'a AdapterRef) -> Fetch<'a>;
}

/// Files on the local disk: an [`AdapterRef`]'s `config` and `weights` are paths.
#[derive(Debug, Clone, Copy, Default)]
pub struct LocalFiles;

impl AdapterSource for LocalFiles {
    fn fetch<'a>(&'a self, adapter: &'a AdapterRef) -> Fetch<'a> {
        Box::pin(async move {
            let read = |path: &'a str| async move {
                tokio::fs::read(path)
                    .await
                    .map(Arc::new)
                    .map_err(|e| SourceError::Invalid(format!("reading {path}: {e}")))
            };
            let (config, weights) = tokio::try_join!(read(&adapter.config), read(&adapter.weights))?;
            Ok(AdapterFiles { config, weights })
        })
    }
}

/// How many adapters stay resident, and how long one may be kept waiting.
#[derive(Debug, Clone)]
pub struct AdaptersConfig {
    /// Packed adapters the engines may hold at once, in bytes.
    pub resident_bytes: usize,
    /// How long a waiting adapter waits before requests for resident adapters are held back for it.
    pub cycle: Duration,
    /// The limits an adapter's files must keep within.
    pub limits: AdapterLimits,
}

impl Default for AdaptersConfig {
    fn default() -> Self {
        AdaptersConfig {
            resident_bytes: 2 << 30,
            cycle: Duration::from_secs(2),
            limits: AdapterLimits::default(),
        }
    }
}

/// The residency counters.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AdapterStats {
    /// Requests whose adapter was resident.
    pub hits: u64,
    /// Adapters loaded (fetched, checked and packed).
    pub loads: u64,
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

const RECENT_LOADS: usize = 1024;

/// An adapter id and the version of its files.
type Key = (String, i64);

/// An adapter held resident while a sequence uses it; dereferences to the packed adapter.
pub struct Lease {
    adapter: Arc<PackedAdapter>,
    key: Key,
    shared: Arc<Shared>,
}

impl Deref for Lease {
    type Target = PackedAdapter;

    fn deref(&self) -> &PackedAdapter {
        &self.adapter
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

struct Resident {
    adapter: Arc<PackedAdapter>,
    bytes: usize,
    leases: usize,
    last_used: u64,
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
    tick: u64,
    stats: AdapterStats,
}

struct Shared {
    state: Mutex<State>,
    changed: tokio::sync::Notify,
    source: Arc<dyn AdapterSource>,
    config: AdaptersConfig,
    /// How long each successful load took (fetch, check and pack).
    load_time: lorry_metrics::Histogram,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The resident adapters; cheap to clone, shared by every model a worker serves.
#[derive(Clone)]
pub struct Adapters {
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

/// An adapter that cannot be served (it is not fetched again for this request).
fn unservable(id: &str, why: impl std::fmt::Display) -> EngineError {
    EngineError::Model(format!("adapter {id} could not be served: {why}"))
}

impl Adapters {
    /// Adapters whose files come from `source`.
    pub fn new(source: Arc<dyn AdapterSource>, config: AdaptersConfig) -> Self {
        Adapters {
            shared: Arc::new(Shared {
                state: Mutex::new(State::default()),
                changed: tokio::sync::Notify::new(),
                source,
                config,
                load_time: lorry_metrics::Histogram::seconds(),
            }),
        }
    }

    /// How long each successful load took, in seconds.
    pub fn load_time(&self) -> lorry_metrics::HistogramSnapshot {
        self.shared.load_time.snapshot()
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> AdapterStats {
        let state = self.shared.lock();
        let mut stats = state.stats.clone();
        stats.resident_bytes = state.resident.values().map(|r| r.bytes).sum();
        stats
    }

    /// Make `adapter` resident for a model of shape `base`, and hold it until
    /// the lease is dropped. Waits while the resident budget is full of
    /// adapters in use. A source that cannot be reached gives
    /// [`EngineError::Unavailable`]; files that do not fit, or fail the
    /// checks, [`EngineError::Model`].
    pub async fn acquire(&self, adapter: &AdapterRef, base: &AdapterShape) -> Result<Lease, EngineError> {
        let key: Key = (adapter.id.clone(), adapter.version);
        let estimate = usize::try_from(adapter.weights_bytes)
            .unwrap_or(usize::MAX)
            .saturating_mul(2);
        let budget = self.shared.config.resident_bytes;
        if estimate > budget {
            return Err(unservable(
                &adapter.id,
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
                Step::Load(bytes) => return self.load(adapter, base, key, bytes).await,
                Step::Wait => {
                    // Woken by any change; a timeout re-checks the cycle.
                    let _ = tokio::time::timeout(recheck(&self.shared.config), notified).await;
                }
            }
        }
    }

    /// A lease on `adapter` at once if it is resident and no other adapter
    /// waits for room; otherwise [`Adapters::acquire`] decides.
    pub fn try_acquire(&self, adapter: &AdapterRef) -> Option<Lease> {
        let key: Key = (adapter.id.clone(), adapter.version);
        let mut state = self.shared.lock();
        let state = &mut *state;
        if !state.waiting.is_empty() {
            return None;
        }
        state.tick += 1;
        let resident = state.resident.get_mut(&key)?;
        resident.leases += 1;
        resident.last_used = state.tick;
        state.stats.hits += 1;
        Some(Lease {
            adapter: Arc::clone(&resident.adapter),
            key,
            shared: Arc::clone(&self.shared),
        })
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

    /// Fetch, check and pack an adapter into the room reserved for it.
    async fn load(
        &self,
        adapter: &AdapterRef,
        base: &AdapterShape,
        key: Key,
        reserved: usize,
    ) -> Result<Lease, EngineError> {
        let shared = &self.shared;
        let mut reservation = Reservation {
            shared,
            key: key.clone(),
            bytes: reserved,
            done: false,
        };
        let started = Instant::now();
        let loaded = async {
            let files = shared.source.fetch(adapter).await.map_err(|e| match e {
                SourceError::Unavailable(why) => {
                    tracing::warn!(adapter = %adapter.id, error = %why, "could not fetch an adapter; the request may be delivered again");
                    EngineError::Unavailable(format!("adapter {}: {why}", adapter.id))
                }
                SourceError::Invalid(why) => unservable(&adapter.id, why),
            })?;
            let (base, limits) = (*base, shared.config.limits);
            tokio::task::spawn_blocking(move || {
                Adapter::parse(&files.config, &files.weights, &base, limits).map(|adapter| PackedAdapter::new(&adapter))
            })
            .await
            .map_err(|e| unservable(&adapter.id, e))?
            .map_err(|e| unservable(&adapter.id, format_args!("{}: {}", e.code, e.message)))
        }
        .await;
        let seconds = started.elapsed().as_secs_f64();
        let mut state = shared.lock();
        reservation.done = true;
        state.loading.remove(&key);
        state.used -= reserved;
        let result = match loaded {
            Ok(packed) => {
                let bytes = packed.bytes();
                let packed = Arc::new(packed);
                state.used += bytes;
                state.tick += 1;
                let tick = state.tick;
                state.resident.insert(
                    key.clone(),
                    Resident {
                        adapter: Arc::clone(&packed),
                        bytes,
                        leases: 1,
                        last_used: tick,
                    },
                );
                shared.load_time.observe(seconds);
                let stats = &mut state.stats;
                stats.loads += 1;
                if stats.load_seconds.len() == RECENT_LOADS {
                    stats.load_seconds.remove(0);
                }
                stats.load_seconds.push(seconds);
                tracing::info!(adapter = %key.0, bytes, seconds, "adapter loaded");
                Ok(Lease {
                    adapter: packed,
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
}

/// How often a waiting request looks again when nothing wakes it.
fn recheck(config: &AdaptersConfig) -> Duration {
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
