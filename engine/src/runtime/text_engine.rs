//! The text-generation engine: one OS thread owns the model, the KV cache and
//! the scheduler, and runs continuous batches; callers hold a cheap `Clone`
//! handle that implements [`Backend`].
//!
//! Each step the scheduler picks the chunks to run, the model runs them as one
//! batched forward pass over the paged cache, and every sequence that reached
//! the end of its known tokens samples one more. Requests arrive between
//! steps; a request whose event stream is dropped is cancelled at the next
//! step and its blocks freed. A failed forward pass fails the requests in that
//! step, not the engine.
//!
//! Prompts reuse the cached keys and values of any prefix already computed
//! under the same model and adapter (`prefix_cache`), and decoding sequences
//! speculate ([`crate::runtime::speculative`]): guessed tokens are verified in the same
//! batched pass, each row with its own adapter.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::Instant;

use crate::adapters::{Adapters, Lease};
use crate::lora::PackedAdapter;
use crate::models::llama::Llama;
use crate::models::llama::SeqChunk;
use crate::runtime::chat::{Decoding, TextModel};
use crate::runtime::guide::{Grammars, Guide};
use crate::runtime::kv::prefix::{self, BlockHasher};
use crate::runtime::kv::{BlockPool, KvCache};
use crate::runtime::pace::{Owed, Pace, Share, StepCost};
use crate::runtime::scheduler::{AccountKey, Chunk, Plan, Policy, Scheduler, SchedulerConfig, SeqId};
use crate::runtime::speculative::{
    choose, Acceptance, Candidate, DraftModel, Guess, Probes, Proposer, SpecConfig, SpecPolicy, SpecState,
};
use crate::{
    event_channel, AdapterShape, Backend, Completion, Content, EngineError, Event, EventStream, Events, Lane, Output,
    Request, Usage, ValidRequest,
};

/// How the engine sizes its cache and batches.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineConfig {
    /// Token slots per KV block.
    pub block_size: usize,
    /// Memory for the KV cache, in bytes (capped at what `max_seqs` full-length sequences need).
    pub kv_cache_bytes: usize,
    /// Sequences running at once.
    pub max_seqs: usize,
    /// Tokens computed per step (decoding and pre-fill together).
    pub token_budget: usize,
    /// Sequence slots only the real-time lane may use.
    pub rt_reserved_seqs: usize,
    /// Percent of the KV blocks batch admission leaves for the real-time lane.
    pub rt_reserved_blocks_percent: usize,
    /// Until the engine has measured its steps (or with no slack): steps in
    /// a row batch work sits out while real-time sequences run.
    pub rt_hold_steps: usize,
    /// Continuous (the default) or static batching.
    pub policy: Policy,
    /// Share computed prompt blocks between sequences.
    pub prefix_cache: bool,
    /// Speculative decoding.
    pub speculation: SpecConfig,
    /// While real-time work is present, how much longer (percent) than its
    /// real-time work alone a step carrying batch work may run — or, held
    /// back, how much real-time-only time batch work owes for its time in a
    /// shared step (0: no bound; batch work then sits out `rt_hold_steps`
    /// steps at a time instead).
    pub rt_step_slack_percent: usize,
    /// How long after the last real-time request steps stay bounded, so that
    /// the next one does not wait behind a long batch step.
    pub rt_linger: std::time::Duration,
    /// Steps of one token cheaper than this (milliseconds) are not paced:
    /// on so small a model a request's time is mostly outside the engine,
    /// and batch work sitting out real-time-only steps for its share of the
    /// time (the hold in time, by the same slack) costs it less.
    pub rt_pace_min_step_ms: f64,
    /// Batch work keeps any step within this many milliseconds, from the
    /// measured step cost (0: no bound but `token_budget`), so that a
    /// real-time request arriving waits at most about this long for the step
    /// in flight: pre-fill is cut, batch decodes take turns (each whole).
    pub step_max_ms: f64,
    /// The same bound while real-time work is present or was within
    /// `rt_linger` (0: `step_max_ms` throughout): a request arriving then
    /// waits at most about this long for the step in flight, while steps
    /// with no real-time traffic near keep the larger, cheaper pre-fill.
    pub rt_step_max_ms: f64,
    /// The most events a stream's reader may leave unread before its
    /// sequence is dropped ([`crate::MAX_UNREAD_EVENTS`]).
    pub max_unread_events: usize,
    /// The most rows of logits a step holds at once: the head runs over a
    /// step's sampling rows this many at a time, each group sampled before
    /// the next is computed (a sequence's rows stay in one group). 0, the
    /// default: as many as 2 MiB of the model's logits hold, at least 16.
    pub logits_rows: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            block_size: 16,
            kv_cache_bytes: 1 << 30,
            max_seqs: 64,
            token_budget: 512,
            rt_reserved_seqs: 4,
            rt_reserved_blocks_percent: 10,
            rt_hold_steps: 32,
            policy: Policy::Continuous,
            prefix_cache: true,
            speculation: SpecConfig::default(),
            rt_step_slack_percent: 30,
            rt_linger: std::time::Duration::from_secs(5),
            rt_pace_min_step_ms: 10.0,
            step_max_ms: 500.0,
            rt_step_max_ms: 50.0,
            max_unread_events: crate::MAX_UNREAD_EVENTS,
            logits_rows: 0,
        }
    }
}

/// Counters of the engine's work, read while it runs.
#[derive(Debug, Default)]
pub struct Counters {
    /// Forward passes.
    pub steps: AtomicU64,
    /// Prompt (and recomputed) tokens run.
    pub prefill_tokens: AtomicU64,
    /// Tokens sampled.
    pub generated_tokens: AtomicU64,
    /// Sequences that lost their KV blocks and were recomputed.
    pub preemptions: AtomicU64,
    /// Requests cancelled by their caller.
    pub cancelled: AtomicU64,
    /// Prompt blocks found in the prefix cache.
    pub prefix_hits: AtomicU64,
    /// Prompt blocks looked up and not found.
    pub prefix_misses: AtomicU64,
    /// Cached blocks evicted for new work.
    pub prefix_evicted: AtomicU64,
    /// Tokens guessed by prompt lookup.
    pub ngram_proposed: AtomicU64,
    /// Of those, accepted.
    pub ngram_accepted: AtomicU64,
    /// Tokens guessed by the draft model.
    pub draft_proposed: AtomicU64,
    /// Of those, accepted.
    pub draft_accepted: AtomicU64,
    /// Real-time requests ended.
    pub rt_requests: AtomicU64,
    /// Of their time in the engine: microseconds from arrival to the start of
    /// their first step (the step in flight, and any queue before it).
    pub rt_wait_us: AtomicU64,
    /// Steps that ran real-time rows, and their microseconds.
    pub rt_steps: AtomicU64,
    /// The microseconds of those steps.
    pub rt_step_us: AtomicU64,
    /// Batch tokens that rode along in those steps.
    pub rt_batch_tokens: AtomicU64,
    /// How long each forward pass took.
    pub step_seconds: lorry_metrics::Histogram,
    /// Sequences in the running batch, as of the last step.
    pub running: AtomicU64,
    /// Sequences waiting to join it.
    pub waiting: AtomicU64,
    /// KV-cache blocks nobody holds (never used, or cached and idle).
    pub kv_blocks_free: AtomicU64,
    /// KV-cache blocks in all.
    pub kv_blocks_total: AtomicU64,
}

impl Counters {
    /// Tokens one proposer guessed and, of those, accepted (prompt lookup's for `Off`, which guesses none).
    pub fn speculation(&self, proposer: Proposer) -> (&AtomicU64, &AtomicU64) {
        match proposer {
            Proposer::Draft => (&self.draft_proposed, &self.draft_accepted),
            Proposer::Ngram | Proposer::Off => (&self.ngram_proposed, &self.ngram_accepted),
        }
    }

    /// Accepted over proposed for one proposer (0 when nothing was proposed).
    pub fn acceptance(&self, proposer: Proposer) -> f64 {
        let (proposed, accepted) = self.speculation(proposer);
        let proposed = proposed.load(Ordering::Relaxed);
        accepted.load(Ordering::Relaxed) as f64 / proposed.max(1) as f64
    }
}

struct Job {
    request: ValidRequest,
    lane: Lane,
    /// When it was handed to the engine (a job waits in the inbox while a step runs).
    submitted: Instant,
    adapter: Option<Lease>,
    /// Its prefix-cache partition ([`Request::cache_partition`]).
    partition: Option<String>,
    /// Whose share of admission it counts against ([`Request::account`]).
    account: AccountKey,
    /// [`Request::backlog`].
    backlog: usize,
    events: Events,
    /// [`Request::span`].
    span: tracing::Span,
    /// Its constraint, compiled before it reaches the engine thread.
    guide: Option<Guide>,
}

/// A handle to a running engine; the engine thread stops once every handle is
/// dropped and its last request has finished.
#[derive(Clone)]
pub struct TextEngine {
    name: Arc<str>,
    shape: AdapterShape,
    jobs: std_mpsc::Sender<Job>,
    counters: Arc<Counters>,
    adapters: Option<Adapters>,
    grammars: Arc<Grammars>,
    tool_templates: crate::runtime::tools::ToolTemplates,
}

impl TextEngine {
    /// Start the engine thread for `model`, served as `name`.
    pub fn start(name: &str, model: TextModel, config: EngineConfig) -> Self {
        Self::start_with_draft(name, model, None, config)
    }

    /// [`TextEngine::start`] with a draft model for speculative decoding (a
    /// smaller model sharing the tokenizer), used when `config.speculation`
    /// names [`Proposer::Draft`].
    pub fn start_with_draft(name: &str, model: TextModel, draft: Option<Llama>, config: EngineConfig) -> Self {
        let (jobs, inbox) = std_mpsc::channel();
        let counters = Arc::new(Counters::default());
        let (ready_tx, ready_rx) = std_mpsc::channel();
        let shared = Arc::clone(&counters);
        let shape = model.model.config().adapter_shape();
        let grammars = model.grammars();
        let tool_templates = model.tool_templates();
        let thread_name = format!("lorry-engine {name}");
        let served = name.to_string();
        std::thread::Builder::new()
            .name(thread_name)
            .spawn(move || {
                let mut engine = EngineLoop::new(served, model, draft, config, shared);
                let _ = ready_tx.send(());
                engine.run(&inbox);
            })
            .expect("spawning the engine thread");
        let _ = ready_rx.recv();
        TextEngine {
            name: name.into(),
            shape,
            jobs,
            counters,
            adapters: None,
            grammars,
            tool_templates,
        }
    }

    /// Serve requests with LoRA adapters, made resident by `adapters`
    /// (without, a request naming an adapter is refused).
    pub fn with_adapters(self, adapters: Adapters) -> Self {
        TextEngine {
            adapters: Some(adapters),
            ..self
        }
    }

    /// The engine's counters.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }
}

impl Backend for TextEngine {
    fn model(&self) -> &str {
        &self.name
    }

    /// A request with an adapter waits (on the async runtime, not the engine
    /// thread) until its adapter is resident, then joins the same continuous
    /// batch as every other, whatever their adapters; the sequence holds the
    /// adapter's lease until it ends. A request for `n` > 1 choices runs
    /// each as a sequence of its own ([`crate::runtime::choices`]).
    fn submit(&self, request: Request) -> Result<EventStream, EngineError> {
        if request.input.sampling.choices() > 1 {
            return crate::runtime::choices::fan_out(self, request);
        }
        self.submit_one(request)
    }
}

impl TextEngine {
    /// Submit one sequence: [`Backend::submit`] of a request with one choice.
    pub(crate) fn submit_one(&self, request: Request) -> Result<EventStream, EngineError> {
        let (events, stream) = event_channel();
        let Request {
            input,
            lane,
            adapter,
            cache_partition,
            account,
            backlog,
            span,
        } = request;
        // Compiled here, on the caller's thread (cached per model), never on
        // the engine's: a new schema does not stall the batch.
        let guide = match crate::runtime::chat::output_constraint(&input, self.tool_templates) {
            Some(constraint) => Some(self.grammars.guide(&constraint)?),
            None => None,
        };
        let mut job = Job {
            guide,
            request: input,
            lane,
            submitted: Instant::now(),
            adapter: None,
            partition: cache_partition,
            account: account_key(account.as_deref()),
            backlog,
            events,
            span,
        };
        let Some(reference) = adapter else {
            if let Some(named) = &job.request.lora {
                return Err(EngineError::Model(format!(
                    "the request names adapter {named} but carries no reference to its files"
                )));
            }
            self.jobs.send(job).map_err(|_| EngineError::Stopped)?;
            return Ok(stream);
        };
        let Some(adapters) = self.adapters.clone() else {
            let field = job.request.adapter_field.as_str();
            return Err(EngineError::Input(lorry_protocol::model::no_adapters(
                &self.name, field,
            )));
        };
        if let Some(lease) = adapters.try_acquire(&reference) {
            // Resident: the request joins in submission order, like any other.
            job.adapter = Some(lease);
            self.jobs.send(job).map_err(|_| EngineError::Stopped)?;
            return Ok(stream);
        }
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| EngineError::Model("adapters are loaded on a tokio runtime; none is running".into()))?;
        let (jobs, shape) = (self.jobs.clone(), self.shape);
        runtime.spawn(async move {
            let lease = tokio::select! {
                lease = adapters.acquire(&reference, &shape) => lease,
                // The caller went away while the adapter loaded.
                () = job.events.closed() => return,
            };
            match lease {
                Ok(lease) => {
                    job.adapter = Some(lease);
                    if let Err(std_mpsc::SendError(job)) = jobs.send(job) {
                        job.events.send(Event::Failed(EngineError::Stopped));
                    }
                }
                Err(error) => {
                    job.events.send(Event::Failed(error));
                }
            }
        });
        Ok(stream)
    }
}

struct Active {
    decoding: Decoding,
    adapter: Option<Lease>,
    events: Events,
    stream: bool,
    /// Hashes of its full blocks, when the prefix cache is on.
    hasher: Option<BlockHasher>,
    /// Its speculation, when it speculates.
    spec: Option<SpecState>,
    /// Tokens guessed for its next step.
    guess: Option<Guess>,
    /// Where a real-time request's time goes.
    trace: Option<RtTrace>,
    /// Its sequence's span, under the request's ([`Request::span`]); ends with it.
    span: tracing::Span,
}

/// A real-time request's time in the engine.
struct RtTrace {
    arrived: Instant,
    /// From submission to the start of its first step.
    waited: Option<std::time::Duration>,
    steps: u64,
    step_time: std::time::Duration,
    /// Its longest step.
    longest_step: std::time::Duration,
    batch_tokens: u64,
}

struct EngineLoop {
    model: TextModel,
    name: String,
    kv: KvCache,
    scheduler: Scheduler,
    active: HashMap<SeqId, Active>,
    context: usize,
    next_id: SeqId,
    counters: Arc<Counters>,
    block_size: usize,
    prefix_cache: bool,
    speculation: SpecConfig,
    draft: Option<DraftModel>,
    /// Every sequence's guesses' record: the prior of each one's.
    acceptance: Acceptance,
    /// Tries of sequences the measured policy leaves out.
    probes: Probes,
    /// What a step costs, measured.
    cost: StepCost,
    /// What a step of decodes alone costs (each row computes logits, as a
    /// guess's verification row does): what guesses are priced by.
    decode_cost: StepCost,
    /// When the steps' freed working memory goes back to the system.
    memory: crate::models::StepMemory,
    /// Real-time-only time batch work still owes (the hold in time).
    owed: Owed,
    /// When real-time work was last present.
    last_real_time: Option<Instant>,
    rt_slack: f64,
    rt_linger: std::time::Duration,
    rt_pace_min_step_ms: f64,
    step_max_ms: f64,
    rt_step_max_ms: f64,
    /// [`EngineConfig::max_unread_events`].
    max_unread_events: usize,
    /// Rows of logits a step computes and samples at a time
    /// ([`EngineConfig::logits_rows`], 0 resolved for the model).
    logits_rows: usize,
}

impl EngineLoop {
    fn new(
        name: String,
        model: TextModel,
        draft: Option<Llama>,
        config: EngineConfig,
        counters: Arc<Counters>,
    ) -> Self {
        let mut speculation = config.speculation;
        if speculation.proposer == Proposer::Draft && draft.is_none() {
            tracing::warn!("draft speculation asked for without a draft model: prompt lookup instead");
            speculation.proposer = Proposer::Ngram;
        }
        let draft = draft
            .filter(|_| speculation.proposer == Proposer::Draft)
            .map(DraftModel::new);
        let layout = model.model.kv_layout(config.block_size);
        let logits_group_rows = match config.logits_rows {
            0 => logits_rows(model.model.config().vocab_size),
            rows => rows,
        };
        let max_positions = model.model.config().max_position_embeddings;
        let full = config.max_seqs * max_positions.div_ceil(config.block_size);
        let blocks = (config.kv_cache_bytes / layout.bytes_per_block()).clamp(1, full.max(1));
        let scheduler = Scheduler::new(
            SchedulerConfig {
                max_seqs: config.max_seqs,
                token_budget: config.token_budget.max(config.max_seqs),
                rt_reserved_seqs: config.rt_reserved_seqs.min(config.max_seqs.saturating_sub(1)),
                rt_reserved_blocks: blocks * config.rt_reserved_blocks_percent / 100,
                rt_hold_steps: config.rt_hold_steps,
                policy: config.policy,
            },
            BlockPool::new(blocks as u32, config.block_size),
        );
        tracing::info!(
            blocks,
            block_size = config.block_size,
            mib = (blocks * layout.bytes_per_block()) >> 20,
            "KV cache"
        );
        EngineLoop {
            context: max_positions.min(scheduler.capacity_tokens()),
            kv: KvCache::new(layout, blocks),
            name,
            model,
            scheduler,
            active: HashMap::new(),
            next_id: 0,
            counters,
            block_size: config.block_size,
            prefix_cache: config.prefix_cache,
            speculation,
            draft,
            acceptance: Acceptance::new(Acceptance::ENGINE),
            probes: Probes::default(),
            cost: StepCost::default(),
            decode_cost: StepCost::finer(),
            memory: crate::models::StepMemory::default(),
            owed: Owed::default(),
            last_real_time: None,
            rt_slack: config.rt_step_slack_percent as f64 / 100.0,
            rt_linger: config.rt_linger,
            rt_pace_min_step_ms: config.rt_pace_min_step_ms,
            step_max_ms: config.step_max_ms,
            rt_step_max_ms: config.rt_step_max_ms,
            max_unread_events: config.max_unread_events,
            logits_rows: logits_group_rows,
        }
    }

    /// Whether real-time work is present or was within `rt_linger`.
    fn real_time_near(&mut self) -> bool {
        if self.scheduler.has_real_time() {
            self.last_real_time = Some(Instant::now());
        }
        self.scheduler.has_real_time() || self.last_real_time.is_some_and(|t| t.elapsed() < self.rt_linger)
    }

    /// How batch work shares the next step: within the pace while
    /// real-time work runs on a model whose steps are worth pacing; else,
    /// once the steps' cost is known, the hold in time; before that (or with
    /// no slack), `rt_hold_steps` at a time. (Between real-time requests the
    /// batch lane runs free, within the step bound that their nearness sets.)
    fn share(&self) -> Share {
        let Some(one_token_ms) = self.cost.predict(1) else {
            return Share::Counted;
        };
        if self.rt_slack <= 0.0 {
            Share::Counted
        } else if self.scheduler.has_real_time() && one_token_ms >= self.rt_pace_min_step_ms {
            Share::Paced(Pace {
                cost: self.cost,
                slack: self.rt_slack,
            })
        } else {
            Share::Timed {
                sits_out: self.owed.sits_out(),
            }
        }
    }

    fn run(&mut self, inbox: &std_mpsc::Receiver<Job>) {
        loop {
            self.publish_occupancy();
            if self.scheduler.is_idle() {
                if self.memory.idle() {
                    crate::models::release_free_memory();
                }
                match inbox.recv() {
                    Ok(job) => self.accept(job),
                    Err(_) => return,
                }
            }
            while let Ok(job) = inbox.try_recv() {
                self.accept(job);
            }
            self.drop_cancelled();
            if !self.scheduler.is_idle() {
                self.step();
            }
        }
    }

    /// Sequences and KV blocks in use now, for whoever reads the counters.
    fn publish_occupancy(&self) {
        let (running, waiting) = self.scheduler.counts();
        let c = &self.counters;
        c.running.store(running as u64, Ordering::Relaxed);
        c.waiting.store(waiting as u64, Ordering::Relaxed);
        c.kv_blocks_free
            .store(self.scheduler.free_blocks() as u64, Ordering::Relaxed);
        c.kv_blocks_total
            .store(self.scheduler.total_blocks() as u64, Ordering::Relaxed);
    }

    fn accept(&mut self, mut job: Job) {
        match self.model.start_guided(&job.request, self.context, job.guide.take()) {
            Ok(decoding) => {
                let id = self.next_id;
                self.next_id += 1;
                let mut hasher = self.prefix_cache.then(|| {
                    let namespace = prefix::namespace(
                        &self.name,
                        job.adapter.as_deref().map(PackedAdapter::key),
                        job.partition.as_deref(),
                    );
                    BlockHasher::new(namespace, self.block_size)
                });
                let hashes = hasher
                    .as_mut()
                    .map_or_else(Vec::new, |h| h.update(&decoding.tokens).to_vec());
                if job.lane == Lane::Batch {
                    self.scheduler.held_elsewhere(job.account, job.backlog);
                }
                self.scheduler
                    .add(id, job.lane, job.account, decoding.tokens.len(), hashes);
                let speculates = self.speculation.proposer != Proposer::Off
                    && (decoding.is_greedy() || self.speculation.sampled)
                    && self.speculation.max_draft > 0;
                let stream = job.request.stream;
                let span = if job.span.is_disabled() {
                    tracing::Span::none()
                } else {
                    tracing::info_span!(
                        parent: &job.span,
                        "engine.sequence",
                        model = %self.name,
                        lane = ?job.lane,
                        prompt_tokens = decoding.tokens.len(),
                    )
                };
                self.active.insert(
                    id,
                    Active {
                        decoding,
                        adapter: job.adapter,
                        events: job.events,
                        stream,
                        hasher,
                        spec: speculates.then(|| SpecState::new(self.speculation.max_draft)),
                        guess: None,
                        span,
                        trace: (job.lane == Lane::RealTime).then_some(RtTrace {
                            arrived: job.submitted,
                            waited: None,
                            steps: 0,
                            step_time: std::time::Duration::ZERO,
                            longest_step: std::time::Duration::ZERO,
                            batch_tokens: 0,
                        }),
                    },
                );
            }
            Err(error) => {
                job.events.send(Event::Failed(error));
            }
        }
    }

    fn drop_cancelled(&mut self) {
        let cancelled: Vec<SeqId> = self
            .active
            .iter()
            .filter(|(_, a)| a.events.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in cancelled {
            self.end(id);
            self.counters.cancelled.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn end(&mut self, id: SeqId) -> Option<Active> {
        self.scheduler.remove(id);
        if let Some(draft) = &mut self.draft {
            draft.forget(id);
        }
        let active = self.active.remove(&id)?;
        if let Some(trace) = &active.trace {
            let c = &self.counters;
            let waited = trace.waited.unwrap_or_default();
            c.rt_requests.fetch_add(1, Ordering::Relaxed);
            c.rt_wait_us.fetch_add(waited.as_micros() as u64, Ordering::Relaxed);
            tracing::debug!(
                waited_ms = waited.as_secs_f64() * 1e3,
                steps = trace.steps,
                step_ms = trace.step_time.as_secs_f64() * 1e3,
                longest_step_ms = trace.longest_step.as_secs_f64() * 1e3,
                batch_tokens_alongside = trace.batch_tokens,
                in_engine_ms = trace.arrived.elapsed().as_secs_f64() * 1e3,
                one_token_step_ms = self.cost.predict(1).unwrap_or(f64::NAN),
                "real-time request ended"
            );
        }
        Some(active)
    }

    /// A plan's tokens by lane: real time's and batch's (real-time
    /// requests are the traced ones).
    fn tokens_by_lane(&self, plan: &Plan) -> (usize, usize) {
        plan.chunks.iter().fold((0, 0), |(rt, batch), chunk| {
            if self.active.get(&chunk.id).is_some_and(|a| a.trace.is_some()) {
                (rt + chunk.len, batch)
            } else {
                (rt, batch + chunk.len)
            }
        })
    }

    /// Keep the hold in time's account: what batch work took of the step
    /// over its real-time work alone (all of it, with none).
    fn owe(&mut self, rt_tokens: usize, batch_tokens: usize, ms: f64) {
        let alone = match rt_tokens {
            0 => 0.0,
            n => self.cost.predict(n).unwrap_or(ms),
        };
        self.owed.observe(ms, alone, batch_tokens > 0, self.rt_slack);
    }

    /// Guess tokens for the sequences that decode next: as the policy
    /// decides, from their acceptance and the measured step cost, or in every
    /// step while few decode.
    fn propose(&mut self) -> Result<(), String> {
        if self.speculation.proposer == Proposer::Off {
            return Ok(());
        }
        let mut ids = self.scheduler.decoding();
        let decoding = ids.len();
        if decoding > self.speculation.batch_limit() {
            return Ok(());
        }
        ids.sort_unstable();
        let (proposer, policy) = (self.speculation.proposer, self.speculation.policy);
        let engine_rate = self.acceptance.engine_rate();
        // Who may guess, prompt lookup's guesses (a draft model's come once
        // their number is chosen), and what each could take.
        let mut wanting: Vec<(SeqId, Option<Vec<u32>>, u32)> = Vec::new();
        let mut candidates: Vec<Candidate> = Vec::new();
        for &id in &ids {
            let Some(active) = self.active.get_mut(&id) else {
                continue;
            };
            if active.guess.is_some() {
                continue; // guessed for a step it sat out; still valid
            }
            let Some(spec) = &mut active.spec else { continue };
            let most = match policy {
                SpecPolicy::Always => spec.next_k(),
                SpecPolicy::Measured => spec.max(),
            };
            // Guesses past the request's last token would be wasted.
            let k = most.min(active.decoding.remaining().saturating_sub(1));
            let lookup = (proposer == Proposer::Ngram)
                .then(|| crate::runtime::speculative::ngram_proposal(&active.decoding.tokens, k));
            let available = lookup.as_ref().map_or(k, Vec::len);
            if available == 0 {
                continue;
            }
            wanting.push((id, lookup, spec.idle()));
            candidates.push(Candidate {
                available,
                acceptance: spec.acceptance(engine_rate),
            });
        }
        let taken = match policy {
            SpecPolicy::Always => candidates.iter().map(|c| c.available).collect(),
            SpecPolicy::Measured => {
                let (cost, decode_cost) = (&self.cost, &self.decode_cost);
                let mut taken = choose(decoding, &candidates, |tokens| decode_cost.predict_within(tokens, cost));
                let left_out: Vec<(usize, u32, usize)> = (0..candidates.len())
                    .filter(|&i| taken[i] == 0)
                    .map(|i| (i, wanting[i].2, candidates[i].available))
                    .collect();
                if let Some((i, k)) = self.probes.pick(decoding, &left_out) {
                    taken[i] = k;
                }
                taken
            }
        };
        let mut drafting: Vec<(SeqId, usize)> = Vec::new();
        for ((id, lookup, _), &k) in wanting.into_iter().zip(&taken) {
            let Some(active) = self.active.get_mut(&id) else {
                continue;
            };
            if let Some(spec) = &mut active.spec {
                spec.stepped(k > 0);
            }
            if k == 0 {
                continue;
            }
            match lookup {
                Some(mut tokens) => {
                    tokens.truncate(k);
                    // Guesses the constraint would refuse are not worth verifying.
                    tokens.truncate(active.decoding.admissible(&tokens));
                    if tokens.is_empty() {
                        continue;
                    }
                    self.scheduler.propose(id, tokens.len());
                    active.guess = Some(Guess {
                        tokens,
                        q: None,
                        proposer: Proposer::Ngram,
                    });
                }
                None => drafting.push((id, k)),
            }
        }
        let Some(draft) = &mut self.draft else {
            return Ok(());
        };
        if drafting.is_empty() {
            return Ok(());
        }
        let ks: HashMap<SeqId, usize> = drafting.iter().copied().collect();
        let mut wants: Vec<(SeqId, &mut Decoding, usize)> = self
            .active
            .iter_mut()
            .filter_map(|(&id, a)| Some((id, &mut a.decoding, *ks.get(&id)?)))
            .collect();
        wants.sort_unstable_by_key(|w| w.0);
        let guesses = draft.propose(&mut wants)?;
        let ids: Vec<SeqId> = wants.iter().map(|w| w.0).collect();
        for (id, mut guess) in ids.into_iter().zip(guesses) {
            let Some(active) = self.active.get_mut(&id) else {
                continue;
            };
            // Deterministic guesses the constraint refuses are cut; guesses drawn
            // from the draft's distribution are not, since choosing how many to
            // verify by their values would bias the output (verification
            // rejects them exactly instead).
            if guess.q.is_none() {
                let admissible = active.decoding.admissible(&guess.tokens);
                guess.tokens.truncate(admissible);
            }
            if guess.tokens.is_empty() {
                continue;
            }
            self.scheduler.propose(id, guess.tokens.len());
            active.guess = Some(guess);
        }
        Ok(())
    }

    fn step(&mut self) {
        if let Err(error) = self.propose() {
            // A failing draft model costs speed, not requests.
            tracing::error!(%error, "speculation failed; decoding without it");
            self.speculation.proposer = Proposer::Off;
        }
        let near = self.real_time_near();
        let share = self.share();
        // Until a step was measured, and without a bound, only the token budget counts.
        let bound = step_bound_ms(self.step_max_ms, self.rt_step_max_ms, near);
        let max_tokens = if bound > 0.0 && self.cost.predict(1).is_some() {
            self.cost.tokens_within(bound, 1, self.scheduler.token_budget())
        } else {
            usize::MAX
        };
        let plan = self.scheduler.schedule(share, max_tokens);
        self.counters
            .preemptions
            .fetch_add(plan.preempted.len() as u64, Ordering::Relaxed);
        if plan.chunks.is_empty() {
            return;
        }
        // A panic in the model ends this step's requests, not the engine.
        // The pass runs on a worker of the compute pool, which then takes part in
        // its own parallel loops instead of waking both workers for each of them;
        // the pool's other workers stay awake until it ends (`hot_pass`).
        let started = Instant::now();
        let mut guides = self.take_unprepared_guides(&plan);
        let result = std::thread::scope(|scope| {
            // Constrained rows' masks for their next token, on a thread of
            // their own while the pass runs.
            let masks = (!guides.is_empty()).then(|| {
                scope.spawn(|| {
                    for (_, guide) in guides.iter_mut() {
                        guide.prepare();
                    }
                })
            });
            let result = run_caught("the forward pass", || self.forward(&plan));
            if let Some(masks) = masks {
                // A panic inside the grammar engine leaves the mask to be computed when sampling.
                let _ = masks.join();
            }
            result
        });
        for (id, guide) in guides {
            if let Some(active) = self.active.get_mut(&id) {
                active.decoding.restore_guide(guide);
            }
        }
        let (rt_tokens, batch_tokens) = self.tokens_by_lane(&plan);
        match result {
            Ok(hidden) => {
                self.scheduler.step_done(&plan);
                self.head_and_sample(&plan, &hidden, started, batch_tokens);
            }
            Err(error) => {
                // What failed inside is for the operator's log, never the client's answer.
                tracing::error!(%error, "forward pass failed");
                self.note_step(plan.chunks.iter(), plan.chunks.len(), started, batch_tokens);
                self.fail(plan.chunks.iter().map(|c| c.id));
            }
        }
        let took = started.elapsed();
        self.counters.step_seconds.observe_duration(took);
        let ms = took.as_secs_f64() * 1e3;
        self.cost.observe(rt_tokens + batch_tokens, ms);
        if plan.chunks.iter().all(|c| c.samples && c.len == 1 + c.draft) {
            self.decode_cost.observe(rt_tokens + batch_tokens, ms);
        }
        self.owe(rt_tokens, batch_tokens, ms);
        if self.memory.after_step(rt_tokens + batch_tokens) {
            crate::models::release_free_memory();
        }
        if rt_tokens > 0 {
            let c = &self.counters;
            c.rt_steps.fetch_add(1, Ordering::Relaxed);
            c.rt_step_us.fetch_add(took.as_micros() as u64, Ordering::Relaxed);
            c.rt_batch_tokens.fetch_add(batch_tokens as u64, Ordering::Relaxed);
        }
        let stats = self.scheduler.prefix_stats();
        self.counters.prefix_hits.store(stats.hits, Ordering::Relaxed);
        self.counters.prefix_misses.store(stats.misses, Ordering::Relaxed);
        self.counters.prefix_evicted.store(stats.evicted, Ordering::Relaxed);
    }

    /// The logits of the plan's sampling chunks from `hidden` (the pass's
    /// rows before the head), a group of rows at a time, each group sampled
    /// before the next is computed: a step holds one group's logits, not
    /// every row's (64 rows of a 49,152-token vocabulary are 12.6 MB). The
    /// chunks of a group are noted in their traces as the group is sampled,
    /// the others once every group is.
    fn head_and_sample(&mut self, plan: &Plan, hidden: &candle_core::Tensor, started: Instant, batch_tokens: usize) {
        let sampling: Vec<&Chunk> = plan.chunks.iter().filter(|c| c.samples).collect();
        let mut row = 0;
        for group in head_groups(&sampling, self.logits_rows) {
            let rows: usize = group.iter().map(|c| 1 + c.draft).sum();
            let model = &self.model.model;
            let logits = run_caught("the model's head", || {
                let part = hidden.narrow(0, row, rows).map_err(|e| e.to_string())?;
                let logits = model.head(&part).map_err(|e| e.to_string())?;
                StepLogits::new(logits).map_err(|e| e.to_string())
            });
            row += rows;
            self.note_step(group.iter().copied(), plan.chunks.len(), started, batch_tokens);
            match logits {
                Ok(logits) => logits.read(|rows, vocab| self.sample(group, rows, vocab)),
                Err(error) => {
                    tracing::error!(%error, "the model's head failed");
                    self.fail(group.iter().map(|c| c.id));
                }
            }
        }
        self.note_step(
            plan.chunks.iter().filter(|c| !c.samples),
            plan.chunks.len(),
            started,
            batch_tokens,
        );
    }

    /// Each of `chunks`' sequences ran in a step of `sequences` begun at
    /// `started`, its part of it done now: its span notes the step, and a
    /// real-time request's trace counts it.
    fn note_step<'c>(
        &mut self,
        chunks: impl Iterator<Item = &'c Chunk>,
        sequences: usize,
        started: Instant,
        batch_tokens: usize,
    ) {
        let took = started.elapsed();
        for chunk in chunks {
            let Some(active) = self.active.get_mut(&chunk.id) else {
                continue;
            };
            if !active.span.is_disabled() {
                tracing::info!(
                    target: "lorry::trace",
                    parent: &active.span,
                    tokens = chunk.len,
                    sequences,
                    step_ms = took.as_secs_f64() * 1e3,
                    "engine.step"
                );
            }
            if let Some(trace) = active.trace.as_mut() {
                trace.waited.get_or_insert(started.duration_since(trace.arrived));
                trace.steps += 1;
                trace.step_time += took;
                trace.longest_step = trace.longest_step.max(took);
                trace.batch_tokens += batch_tokens as u64;
            }
        }
    }

    /// End `ids`' requests as failed by the model: their blocks go, caching
    /// none of what the step wrote.
    fn fail(&mut self, ids: impl Iterator<Item = SeqId>) {
        let told = "the model failed on a step this request was part of";
        for id in ids {
            self.scheduler.discard(id);
            if let Some(active) = self.end(id) {
                active.events.send(Event::Failed(EngineError::Model(told.into())));
            }
        }
    }

    /// The grammars of the plan's sampling chunks whose next mask is not
    /// known yet, taken out of their sequences while the pass runs.
    fn take_unprepared_guides(&mut self, plan: &Plan) -> Vec<(SeqId, Guide)> {
        let mut guides = Vec::new();
        for chunk in plan.chunks.iter().filter(|c| c.samples) {
            let Some(active) = self.active.get_mut(&chunk.id) else {
                continue;
            };
            if active.decoding.guide_mut().is_some_and(|g| !g.is_prepared()) {
                if let Some(guide) = active.decoding.take_guide() {
                    guides.push((chunk.id, guide));
                }
            }
        }
        guides
    }

    /// Run the plan's chunks as one batch; the rows before the head of each
    /// sampling chunk (one row, and one more per guessed token), in plan
    /// order.
    fn forward(&mut self, plan: &Plan) -> Result<candle_core::Tensor, String> {
        // A chunk with guesses runs its last known token and the guesses.
        let guessed: Vec<Option<Vec<u32>>> = plan
            .chunks
            .iter()
            .map(|c| {
                let active = &self.active[&c.id];
                let guess = active.guess.as_ref().filter(|_| c.draft > 0)?;
                let mut tokens = active.decoding.tokens[c.start..].to_vec();
                tokens.extend(&guess.tokens[..c.draft]);
                Some(tokens)
            })
            .collect();
        let chunks: Vec<SeqChunk<'_>> = plan
            .chunks
            .iter()
            .zip(&guessed)
            .map(|(c, guessed)| SeqChunk {
                tokens: match guessed {
                    Some(tokens) => tokens,
                    None => &self.active[&c.id].decoding.tokens[c.start..c.start + c.len],
                },
                start: c.start,
                blocks: self.scheduler.blocks(c.id),
                logits: if c.samples { 1 + c.draft } else { 0 },
                adapter: self.active[&c.id].adapter.as_deref(),
            })
            .collect();
        let prefill: usize = plan
            .chunks
            .iter()
            .filter(|c| c.len > 1 + c.draft || !c.samples)
            .map(|c| c.len - c.draft)
            .sum();
        self.counters.steps.fetch_add(1, Ordering::Relaxed);
        self.counters
            .prefill_tokens
            .fetch_add(prefill as u64, Ordering::Relaxed);
        self.model
            .model
            .forward_hidden(&chunks, &mut self.kv)
            .map_err(|e| e.to_string())
    }

    /// Sample each of `chunks` (sampling chunks) from its rows of `rows`,
    /// their logits `vocab` wide, in order.
    fn sample(&mut self, chunks: &[&Chunk], rows: &[f32], vocab: usize) {
        let mut rows = rows.chunks_exact(vocab.max(1));
        for &chunk in chunks {
            let logits: Vec<&[f32]> = rows.by_ref().take(1 + chunk.draft).collect();
            let Some(active) = self.active.get_mut(&chunk.id) else {
                continue;
            };
            // Tokens known before this step; the chunk's last `draft` tokens are guesses.
            let known = chunk.start + chunk.len - chunk.draft;
            let guess = active.guess.take();
            let verified = match &guess {
                Some(guess) if chunk.draft > 0 => {
                    let drafts = &guess.tokens[..chunk.draft];
                    let q = guess.q.as_ref().map(|q| &q[..chunk.draft]);
                    active.decoding.verify(drafts, q, &logits)
                }
                _ => Ok((Vec::new(), 0)),
            };
            let (tokens, accepted) = match verified {
                Ok(verified) => verified,
                Err(error) => {
                    if let Some(active) = self.end(chunk.id) {
                        active.events.send(Event::Failed(error));
                    }
                    continue;
                }
            };
            if let (Some(guess), Some(spec)) = (&guess, &mut active.spec) {
                if chunk.draft > 0 {
                    spec.observe(chunk.draft, accepted);
                    self.acceptance.observe(chunk.draft, accepted);
                    let (proposed, hits) = self.counters.speculation(guess.proposer);
                    proposed.fetch_add(chunk.draft as u64, Ordering::Relaxed);
                    hits.fetch_add(accepted as u64, Ordering::Relaxed);
                }
            }
            let mut outcome = Ok(None);
            let mut pushed = 0;
            if tokens.is_empty() {
                outcome = active.decoding.push(logits[0], &self.model);
                pushed = 1;
            } else {
                // Verified token i was chosen at the position of logits row i.
                for (&token, row) in tokens.iter().zip(&logits) {
                    outcome = active.decoding.push_token(token, row, &self.model);
                    pushed += 1;
                    if !matches!(outcome, Ok(None)) {
                        break;
                    }
                }
            }
            self.counters
                .generated_tokens
                .fetch_add(pushed as u64, Ordering::Relaxed);
            // Keys and values are valid for the known tokens and the accepted guesses emitted.
            self.scheduler.rollback(chunk.id, known + accepted.min(pushed));
            let hashes = active
                .hasher
                .as_mut()
                .map_or(&[][..], |h| h.update(&active.decoding.tokens));
            self.scheduler.append_tokens(chunk.id, pushed, hashes);
            let delta = match &outcome {
                Ok(_) if active.stream => active.decoding.stream_delta(&self.model),
                _ => Ok(None),
            };
            match (outcome, delta) {
                (Err(error), _) | (_, Err(error)) => {
                    if let Some(active) = self.end(chunk.id) {
                        active.events.send(Event::Failed(error));
                    }
                }
                // A reader this far behind is not waited for (nothing else
                // would run meanwhile): its sequence goes, and its blocks with it.
                (Ok(_), Ok(Some(_))) if active.events.unread() >= self.max_unread_events => {
                    let active = self.end(chunk.id).expect("the sequence is active");
                    active.events.send(Event::Failed(EngineError::Overrun));
                    self.counters.cancelled.fetch_add(1, Ordering::Relaxed);
                }
                (Ok(finished), Ok(delta)) => {
                    // Log-probabilities go with the text they come with, and
                    // any left when the request ends with the last (empty) piece.
                    let text = match delta {
                        None if finished.is_some() && active.stream && active.decoding.logprobs_pending() => {
                            Some(String::new())
                        }
                        delta => delta,
                    };
                    if let Some(text) = text {
                        let logprobs = active.decoding.stream_logprobs(&self.model);
                        active.events.send(Event::Token {
                            text,
                            logprobs,
                            choice: 0,
                        });
                    }
                    if finished.is_some() {
                        let active = self.end(chunk.id).expect("the sequence is active");
                        active
                            .events
                            .send(Event::Finished(output(active.decoding, &self.model)));
                    }
                }
            }
        }
    }
}

/// `f` on a worker of the compute pool, kept awake through it
/// ([`crate::ops::hot_pass`]); a panic in it is an error naming `what`, and
/// ends the step's requests rather than the engine.
fn run_caught<T: Send>(what: &str, f: impl FnOnce() -> Result<T, String> + Send) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| crate::ops::hot_pass(f)))
        .unwrap_or_else(|panic| Err(format!("{what} panicked: {}", panic_text(&panic))))
}

/// Rows of logits a step computes and samples at a time over a vocabulary
/// of `vocab` tokens: as many as 2 MiB hold (a small vocabulary's whole
/// step at once), and at least 16, which the head's products take in whole
/// panels (64 rows of a 49,152-token vocabulary are 12.6 MB, 16 are 3.1).
fn logits_rows(vocab: usize) -> usize {
    ((2 << 20) / (vocab.max(1) * std::mem::size_of::<f32>())).max(16)
}

/// `chunks` (sampling chunks, `1 + draft` rows each) in groups of whole
/// chunks of at most `rows` rows, in order; a chunk with more rows than
/// that is a group of its own.
fn head_groups<'p, 'c>(chunks: &'p [&'c Chunk], rows: usize) -> Vec<&'p [&'c Chunk]> {
    let mut groups = Vec::new();
    let (mut first, mut taken) = (0, 0);
    for (i, chunk) in chunks.iter().enumerate() {
        let needs = 1 + chunk.draft;
        if i > first && taken + needs > rows {
            groups.push(&chunks[first..i]);
            (first, taken) = (i, 0);
        }
        taken += needs;
    }
    if first < chunks.len() {
        groups.push(&chunks[first..]);
    }
    groups
}

/// The scheduler's key for an account: a digest of its name (`None`, the
/// requests without one, is a key of its own).
fn account_key(account: Option<&str>) -> AccountKey {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::hash::DefaultHasher::new();
    account.hash(&mut hasher);
    hasher.finish()
}

/// A step's logits: read in place from the pass's own tensor, or, where that
/// is not a contiguous f32 tensor in memory, copied once. At a large
/// vocabulary they are megabytes a step (64 rows of SmolLM2's 49,152: 12.6
/// MB), and a copy of them doubled what a step holds.
enum StepLogits {
    InPlace(candle_core::Tensor, usize),
    Copied(Vec<f32>, usize),
}

impl StepLogits {
    fn new(logits: candle_core::Tensor) -> candle_core::Result<Self> {
        let vocab = logits.dims().last().copied().unwrap_or(0);
        let readable = {
            let (storage, layout) = logits.storage_and_layout();
            in_place(&storage, layout).is_some()
        };
        Ok(if readable {
            StepLogits::InPlace(logits, vocab)
        } else {
            let rows = logits.flatten_all()?.to_dtype(candle_core::DType::F32)?.to_vec1()?;
            StepLogits::Copied(rows, vocab)
        })
    }

    /// `f` on the rows, one after another, and their width.
    fn read<R>(&self, f: impl FnOnce(&[f32], usize) -> R) -> R {
        match self {
            StepLogits::Copied(rows, vocab) => f(rows, *vocab),
            StepLogits::InPlace(logits, vocab) => {
                let (storage, layout) = logits.storage_and_layout();
                // Readable: checked when made, and a tensor does not change.
                f(in_place(&storage, layout).unwrap_or(&[]), *vocab)
            }
        }
    }
}

/// A tensor's values in order, where it is a contiguous f32 tensor in memory.
fn in_place<'a>(storage: &'a candle_core::Storage, layout: &candle_core::Layout) -> Option<&'a [f32]> {
    let (start, end) = layout.contiguous_offsets()?;
    match storage {
        candle_core::Storage::Cpu(cpu) => cpu.as_slice::<f32>().ok().and_then(|values| values.get(start..end)),
        _ => None,
    }
}

fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("unknown")
}

fn output(decoding: Decoding, model: &TextModel) -> Output {
    let generation = decoding.into_generation(model);
    Output {
        content: Content::Text(generation.text),
        usage: Usage {
            prompt_tokens: generation.prompt_tokens as u32,
            completion_tokens: generation.token_ids.len() as u32,
        },
        completion: Some(Completion {
            token_ids: generation.token_ids,
            finish_reason: generation.finish_reason,
        }),
        logprobs: generation.logprobs,
        choices: Vec::new(),
        tool_calls: generation.tool_calls,
    }
}

/// The bound on a step's time (0: none): `step_max_ms`, or the tighter
/// `rt_step_max_ms` while real-time work is near (either 0: the other alone).
fn step_bound_ms(step_max_ms: f64, rt_step_max_ms: f64, near: bool) -> f64 {
    match (near && rt_step_max_ms > 0.0, step_max_ms > 0.0) {
        (false, _) => step_max_ms,
        (true, true) => step_max_ms.min(rt_step_max_ms),
        (true, false) => rt_step_max_ms,
    }
}

#[cfg(test)]
mod tests {
    use super::{head_groups, step_bound_ms, Chunk, StepLogits};

    #[test]
    fn a_steps_sampling_chunks_go_to_the_head_in_groups_of_whole_chunks() {
        let chunk = |id: u64, draft: usize| Chunk {
            id,
            start: 0,
            len: 1 + draft,
            samples: true,
            draft,
        };
        let chunks = [
            chunk(1, 0),
            chunk(2, 1),
            chunk(3, 0),
            chunk(4, 5),
            chunk(5, 0),
            chunk(6, 0),
        ];
        let refs: Vec<&Chunk> = chunks.iter().collect();
        let ids = |rows: usize| -> Vec<Vec<u64>> {
            head_groups(&refs, rows)
                .iter()
                .map(|group| group.iter().map(|c| c.id).collect())
                .collect()
        };
        // Rows 1, 2, 1, 6, 1, 1: a group fills to its rows, and the chunk
        // with six rows goes alone rather than be split.
        assert_eq!(ids(4), vec![vec![1, 2, 3], vec![4], vec![5, 6]]);
        assert_eq!(ids(3), vec![vec![1, 2], vec![3], vec![4], vec![5, 6]]);
        assert_eq!(ids(1), vec![vec![1], vec![2], vec![3], vec![4], vec![5], vec![6]]);
        assert_eq!(ids(usize::MAX), vec![vec![1, 2, 3, 4, 5, 6]]);
        assert!(head_groups(&[], 4).is_empty());
    }

    #[test]
    fn a_steps_logits_are_about_two_mib_at_a_time_and_at_least_16_rows() {
        assert_eq!(super::logits_rows(288), 1820);
        assert_eq!(super::logits_rows(32_768), 16);
        assert_eq!(super::logits_rows(49_152), 16);
        assert_eq!(super::logits_rows(151_936), 16);
        assert_eq!(super::logits_rows(0), (2 << 20) / 4);
    }

    #[test]
    fn a_steps_logits_are_read_row_after_row_in_place_or_copied() {
        let values: Vec<f32> = (0..12).map(|v| v as f32).collect();
        let rows = candle_core::Tensor::from_vec(values.clone(), (3, 4), &candle_core::Device::Cpu).unwrap();
        let read = |logits: StepLogits| logits.read(|rows, vocab| (rows.to_vec(), vocab));
        // Contiguous f32: the tensor itself.
        let logits = StepLogits::new(rows.clone()).unwrap();
        assert!(matches!(logits, StepLogits::InPlace(..)));
        assert_eq!(read(logits), (values.clone(), 4));
        // A narrowed view starts inside its storage: read from its offset.
        let tail = rows.narrow(0, 1, 2).unwrap();
        assert_eq!(read(StepLogits::new(tail).unwrap()), (values[4..].to_vec(), 4));
        // Not laid out in order, or not f32: copied once, in row order.
        let transposed = rows.t().unwrap();
        let logits = StepLogits::new(transposed.clone()).unwrap();
        assert!(matches!(logits, StepLogits::Copied(..)));
        let expected: Vec<f32> = transposed.to_vec2::<f32>().unwrap().concat();
        assert_eq!(read(logits), (expected, 3));
        let half = rows.to_dtype(candle_core::DType::F16).unwrap();
        assert_eq!(read(StepLogits::new(half).unwrap()), (values, 4));
    }

    #[test]
    fn steps_are_bounded_tighter_while_real_time_work_is_near() {
        // Nothing near: the deployment-wide bound, whatever the real-time one.
        assert_eq!(step_bound_ms(500.0, 50.0, false), 500.0);
        assert_eq!(step_bound_ms(0.0, 50.0, false), 0.0);
        // Near: the tighter of the two, or whichever is set.
        assert_eq!(step_bound_ms(500.0, 50.0, true), 50.0);
        assert_eq!(step_bound_ms(30.0, 50.0, true), 30.0);
        assert_eq!(step_bound_ms(0.0, 50.0, true), 50.0);
        assert_eq!(step_bound_ms(500.0, 0.0, true), 500.0);
        assert_eq!(step_bound_ms(0.0, 0.0, true), 0.0);
    }
}
