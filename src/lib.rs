//! The `lorry` binary's library: settings, start-up and the offline modes
//! (the benchmarks are the `lorry-bench` crate).
//!
//! Start-up follows zero-to-production: [`Application::build`] connects,
//! migrates and binds; [`Application::port`] tells where it listens;
//! [`Application::run_until_stopped`] serves until SIGTERM, Ctrl-C or
//! [`Application::stopper`] says stop, then drains.

pub mod observe;
pub mod offline;
pub mod operator;
pub mod settings;
pub mod telemetry;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use candle_core::Device;
use lorry_api::serve::{serve, ServeLimits};
use lorry_api::AppState;
use lorry_batcher::adapters::AdapterTiers;
use lorry_batcher::broker::Topology;
use lorry_batcher::finaliser::Finaliser;
use lorry_batcher::objects::ObjectStore;
use lorry_batcher::realtime::RealtimeClient;
use lorry_batcher::relay;
use lorry_batcher::store::Store;
use lorry_batcher::webhooks::WebhookSender;
use lorry_batcher::worker::Worker;
use lorry_engine::adapters::Adapters;
use lorry_engine::catalog::ModelSource;
use lorry_engine::runtime::echo::{EchoConfig, EchoEngine};
use lorry_engine::runtime::embedding::{Embedder, EmbeddingEngine};
use lorry_engine::runtime::text_engine::TextEngine;
use lorry_engine::{Backend, Catalog, Task};
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::observe::Observed;
pub use settings::{Secret, Settings};

/// Logs (and traces, with `LORRY_OTLP_ENDPOINT`) for a process named
/// `lorry`; see [`telemetry`]. Keep the guard until the process ends.
pub fn init_logging() -> telemetry::Telemetry {
    telemetry::init("lorry")
}

/// Which parts of Lorry a process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// API and worker in one process.
    Serve,
    /// The HTTP API (and an outbox relay).
    Api,
    /// A worker: both lanes, finaliser, sweeper, webhooks (and an outbox relay).
    Worker,
}

impl Role {
    /// The service name its traces carry.
    pub fn service_name(self) -> &'static str {
        match self {
            Role::Serve => "lorry",
            Role::Api => "lorry-api",
            Role::Worker => "lorry-worker",
        }
    }

    fn has_api(self) -> bool {
        matches!(self, Role::Serve | Role::Api)
    }

    fn has_worker(self) -> bool {
        matches!(self, Role::Serve | Role::Worker)
    }
}

/// A built, not yet running, Lorry process.
pub struct Application {
    listener: Option<(TcpListener, axum::Router, ServeLimits)>,
    port: Option<u16>,
    worker_port: Option<u16>,
    tasks: JoinSet<()>,
    stop: CancellationToken,
    text_engines: Vec<TextEngine>,
}

/// Connect to Postgres, create the database if asked, and apply migrations.
pub async fn open_store(settings: &Settings, create: bool) -> anyhow::Result<Store> {
    if create {
        Store::create_database(&settings.services.database_url)
            .await
            .context("creating the database")?;
    }
    let store = Store::connect(&settings.services.database_url, settings.services.db_pool_size)
        .await
        .context("connecting to Postgres (create the database with `lorry migrate`)")?;
    store.migrate().await.context("applying migrations")?;
    Ok(store)
}

impl Application {
    /// Connect to every backing service and prepare the role's tasks.
    pub async fn build(settings: Settings, role: Role) -> anyhow::Result<Self> {
        let store = open_store(&settings, false).await?;
        if let Some(token) = &settings.api.bootstrap_token {
            store.ensure_account("default", token.expose()).await?;
        }
        let objects = ObjectStore::new(&settings.object_store());
        objects.ensure_bucket().await.context("reaching the S3 bucket")?;
        let topology = settings.topology();
        // Only a worker reads (or writes) model files; the API needs the manifests alone.
        let (sources, catalog) = if role.has_worker() {
            let sources = settings.model_sources()?;
            let catalog = Catalog::with_models(sources.iter().map(ModelSource::spec));
            (sources, catalog)
        } else {
            (Vec::new(), Catalog::with_models(settings.model_specs()?))
        };
        let stop = CancellationToken::new();
        let mut tasks = JoinSet::new();
        tasks.spawn(relay::run(store.clone(), settings.relay(catalog.names()), stop.clone()));
        let mut text_engines = Vec::new();
        let mut worker_port = None;
        let observed = role.has_worker().then(|| Observed::new(store.clone()));
        if let Some(observed) = &observed {
            // Bound before the models load: meanwhile `/readyz` says so.
            if let Some(address) = &settings.worker.worker_listen {
                let listener = TcpListener::bind(address)
                    .await
                    .with_context(|| format!("binding the worker's listener on {address}"))?;
                worker_port = Some(listener.local_addr()?.port());
                tracing::info!("the worker's /healthz, /readyz and /metrics listen on {address}");
                let limits = settings.serve_limits(open_files_limit());
                let router = observed.clone().router();
                let stopped = stop.clone();
                tasks.spawn(async move {
                    let served = serve(listener, router, limits, async move { stopped.cancelled().await }).await;
                    if let Err(error) = served {
                        tracing::error!(%error, "the worker's listener stopped");
                    }
                });
            }
            let adapters = Adapters::new(
                Arc::new(AdapterTiers::new(objects.clone(), settings.adapter_tiers())),
                settings.adapter_residency(),
            );
            let backends;
            (backends, text_engines) = start_backends(&settings, &sources, &adapters).await?;
            let worker = spawn_worker(
                &settings, &store, &objects, &topology, &catalog, backends, &stop, &mut tasks,
            );
            observed.started(worker, text_engines.clone(), adapters);
        }
        let mut app = Application {
            listener: None,
            port: None,
            worker_port,
            tasks,
            stop,
            text_engines,
        };
        if role.has_api() {
            let mut state = api_state(&settings, store, objects, topology, catalog);
            if let Some(observed) = observed {
                // One process, one `/metrics`: the worker's families follow the API's.
                state = state.with_more_metrics(Arc::new(move |text| observed.render(text)));
            }
            let listener = TcpListener::bind(&settings.api.listen)
                .await
                .with_context(|| format!("binding {}", settings.api.listen))?;
            app.port = Some(listener.local_addr()?.port());
            let limits = settings.serve_limits(open_files_limit());
            tracing::info!(
                max_connections = limits.max_connections,
                "listening on {}",
                settings.api.listen
            );
            app.listener = Some((listener, lorry_api::router(state), limits));
        }
        Ok(app)
    }

    /// The text-generation engines this process's worker runs (none without
    /// a worker role), whose counters say what they did.
    pub fn text_engines(&self) -> &[TextEngine] {
        &self.text_engines
    }

    /// The port the API listens on, if this process serves it.
    pub fn port(&self) -> Option<u16> {
        self.port
    }

    /// The port of the worker's own listener, if it has one (`LORRY_WORKER_LISTEN`).
    pub fn worker_port(&self) -> Option<u16> {
        self.worker_port
    }

    /// A token that stops the process when cancelled.
    pub fn stopper(&self) -> CancellationToken {
        self.stop.clone()
    }

    /// Serve until stopped (SIGTERM, Ctrl-C or the stopper), then drain.
    pub async fn run_until_stopped(mut self) -> anyhow::Result<()> {
        let stop = self.stop.clone();
        tokio::spawn({
            let stop = stop.clone();
            async move {
                shutdown_signal().await;
                stop.cancel();
            }
        });
        if let Some((listener, router, limits)) = self.listener.take() {
            let graceful = stop.clone();
            serve(listener, router, limits, async move { graceful.cancelled().await }).await?;
        } else {
            stop.cancelled().await;
        }
        while self.tasks.join_next().await.is_some() {}
        Ok(())
    }
}

/// The process's limit on open files, raised first to the most it may be
/// (every connection costs one).
fn open_files_limit() -> u64 {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => limit,
        Err(error) => {
            tracing::warn!(%error, "the open-files limit could not be read; assuming 1024");
            1024
        }
    }
}

/// What the API's handlers share.
fn api_state(
    settings: &Settings,
    store: Store,
    objects: ObjectStore,
    topology: Topology,
    catalog: Catalog,
) -> AppState {
    AppState::new(
        store,
        objects,
        RealtimeClient::new(
            &settings.services.amqp_url,
            topology,
            catalog.names(),
            settings.api.rt_max_depth,
        ),
        Arc::new(catalog),
        Arc::new(settings.api_config()),
    )
}

/// Load every model of the catalogue and start its engine (off the async runtime: loading reads the weights).
async fn start_backends(
    settings: &Settings,
    sources: &[ModelSource],
    adapters: &Adapters,
) -> anyhow::Result<(Vec<Arc<dyn Backend>>, Vec<TextEngine>)> {
    // The engines' products run on rayon's global pool, sized once per process.
    let threads = settings.engine_threads();
    match rayon::ThreadPoolBuilder::new().num_threads(threads).build_global() {
        Ok(()) => tracing::info!(threads, "engine threads"),
        Err(_) => tracing::debug!("the engine thread pool was already sized in this process"),
    }
    let echo = EchoEngine::start(EchoConfig {
        delay: Duration::from_millis(settings.worker.echo_delay_ms),
    });
    let mut backends: Vec<Arc<dyn Backend>> = vec![Arc::new(echo)];
    let mut text_engines = Vec::new();
    for source in sources.iter().cloned() {
        let config = settings.engine.config();
        let engine_args = settings.engine.clone();
        let adapters = adapters.clone();
        let started = tokio::task::spawn_blocking(move || -> anyhow::Result<(Arc<dyn Backend>, Option<TextEngine>)> {
            let context = || format!("loading {} from {}", source.name, source.dir.display());
            Ok(match source.task {
                Task::Embeddings => {
                    let embedder = Embedder::from_dir(&source.dir, &Device::Cpu).with_context(context)?;
                    (Arc::new(EmbeddingEngine::start(&source.name, embedder)), None)
                }
                _ => {
                    let model = engine_args
                        .open_model(&source.dir, source.quantize)
                        .with_context(context)?;
                    let draft = engine_args
                        .draft_for(&model, source.draft.as_deref())
                        .with_context(context)?;
                    let engine =
                        TextEngine::start_with_draft(&source.name, model, draft, config).with_adapters(adapters);
                    (Arc::new(engine.clone()), Some(engine))
                }
            })
        });
        let (backend, text_engine) = started.await??;
        tracing::info!(model = backend.model(), "serving");
        backends.push(backend);
        text_engines.extend(text_engine);
    }
    Ok((backends, text_engines))
}

#[allow(clippy::too_many_arguments)]
fn spawn_worker(
    settings: &Settings,
    store: &Store,
    objects: &ObjectStore,
    topology: &Topology,
    catalog: &Catalog,
    backends: Vec<Arc<dyn Backend>>,
    stop: &CancellationToken,
    tasks: &mut JoinSet<()>,
) -> Worker {
    let finaliser = Finaliser::new(store.clone(), objects.clone(), topology.clone(), settings.finaliser());
    let worker = Worker::new(
        store.clone(),
        finaliser.clone(),
        catalog.clone(),
        backends,
        settings.worker_config(),
    );
    let webhooks = WebhookSender::new(store.clone(), settings.webhook_config()).counting_into(worker.metrics());
    let webhook_poll = Duration::from_millis(settings.webhooks.poll_ms);
    let sweep = Duration::from_millis(settings.worker.sweep_interval_ms);
    tasks.spawn({
        let stop = stop.clone();
        let worker = worker.clone();
        async move { worker.run(stop).await }
    });
    tasks.spawn({
        let stop = stop.clone();
        async move { finaliser.run(sweep, stop).await }
    });
    tasks.spawn({
        let stop = stop.clone();
        async move { webhooks.run(webhook_poll, stop).await }
    });
    worker
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing the SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
