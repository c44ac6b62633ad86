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

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;

use tokio::sync::mpsc;

use crate::chat::{Decoding, TextModel};
use crate::kv::{BlockPool, KvCache};
use crate::lora::PackedAdapter;
use crate::models::llama::Config;
use crate::models::llama::SeqChunk;
use crate::scheduler::{Plan, Policy, Scheduler, SchedulerConfig, SeqId};
use crate::{Backend, Completion, EngineError, Event, EventStream, Lane, Output, Usage, ValidRequest};

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
    /// Steps in a row batch work sits out while real-time sequences run.
    pub rt_hold_steps: usize,
    /// Continuous (the default) or static batching.
    pub policy: Policy,
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
}

struct Job {
    request: ValidRequest,
    lane: Lane,
    adapter: Option<Arc<PackedAdapter>>,
    events: mpsc::UnboundedSender<Event>,
}

/// A handle to a running engine; the engine thread stops once every handle is
/// dropped and its last request has finished.
#[derive(Clone)]
pub struct TextEngine {
    name: Arc<str>,
    base: Arc<Config>,
    jobs: std_mpsc::Sender<Job>,
    counters: Arc<Counters>,
}

impl TextEngine {
    /// Start the engine thread for `model`, served as `name`.
    pub fn start(name: &str, model: TextModel, config: EngineConfig) -> Self {
        let (jobs, inbox) = std_mpsc::channel();
        let counters = Arc::new(Counters::default());
        let (ready_tx, ready_rx) = std_mpsc::channel();
        let shared = Arc::clone(&counters);
        let base = Arc::new(model.model.config().clone());
        let thread_name = format!("lorry-engine {name}");
        std::thread::Builder::new()
            .name(thread_name)
            .spawn(move || {
                let mut engine = EngineLoop::new(model, config, shared);
                let _ = ready_tx.send(());
                engine.run(&inbox);
            })
            .expect("spawning the engine thread");
        let _ = ready_rx.recv();
        TextEngine {
            name: name.into(),
            base,
            jobs,
            counters,
        }
    }

    /// The engine's counters.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// [`Backend::submit`] with a LoRA adapter: the request joins the same
    /// continuous batch as every other, whatever their adapters.
    pub fn submit_adapted(
        &self,
        request: ValidRequest,
        lane: Lane,
        adapter: Option<Arc<PackedAdapter>>,
    ) -> Result<EventStream, EngineError> {
        let (events, stream) = mpsc::unbounded_channel();
        self.jobs
            .send(Job {
                request,
                lane,
                adapter,
                events,
            })
            .map_err(|_| EngineError::Stopped)?;
        Ok(stream)
    }
}

impl Backend for TextEngine {
    fn model(&self) -> &str {
        &self.name
    }

    fn submit(&self, request: ValidRequest, lane: Lane) -> Result<EventStream, EngineError> {
        self.submit_adapted(request, lane, None)
    }

    fn counters(&self) -> Option<&Counters> {
        Some(TextEngine::counters(self))
    }

    fn adapter_base(&self) -> Option<&Config> {
        Some(&self.base)
    }

    fn submit_with_adapter(
        &self,
        request: ValidRequest,
        lane: Lane,
        adapter: Arc<PackedAdapter>,
    ) -> Result<EventStream, EngineError> {
        self.submit_adapted(request, lane, Some(adapter))
    }
}

struct Active {
    decoding: Decoding,
    adapter: Option<Arc<PackedAdapter>>,
    events: mpsc::UnboundedSender<Event>,
    stream: bool,
}

struct EngineLoop {
    model: TextModel,
    kv: KvCache,
    scheduler: Scheduler,
    active: HashMap<SeqId, Active>,
    context: usize,
    next_id: SeqId,
    counters: Arc<Counters>,
}

impl EngineLoop {
    fn new(model: TextModel, config: EngineConfig, counters: Arc<Counters>) -> Self {
        let layout = model.model.kv_layout(config.block_size);
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
            model,
            scheduler,
            active: HashMap::new(),
            next_id: 0,
            counters,
        }
    }

    fn run(&mut self, inbox: &std_mpsc::Receiver<Job>) {
        loop {
            if self.scheduler.is_idle() {
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

    fn accept(&mut self, job: Job) {
        match self.model.start(&job.request, self.context) {
            Ok(decoding) => {
                let id = self.next_id;
                self.next_id += 1;
                self.scheduler.add(id, job.lane, decoding.tokens.len());
                let stream = job.request.stream;
                self.active.insert(
                    id,
                    Active {
                        decoding,
                        adapter: job.adapter,
                        events: job.events,
                        stream,
                    },
                );
            }
            Err(error) => {
                let _ = job.events.send(Event::Failed(error));
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
        self.active.remove(&id)
    }

    fn step(&mut self) {
        let plan = self.scheduler.schedule();
        self.counters
            .preemptions
            .fetch_add(plan.preempted.len() as u64, Ordering::Relaxed);
        if plan.chunks.is_empty() {
            return;
        }
        // A panic in the model ends this step's requests, not the engine.
        // The pass runs on a worker of the compute pool, which then takes part in
        // its own parallel loops instead of waking both workers for each of them.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| rayon::scope(|_| self.forward(&plan))))
            .unwrap_or_else(|panic| Err(format!("the forward pass panicked: {}", panic_text(&panic))));
        match result {
            Ok(rows) => self.sample(&plan, &rows),
            Err(error) => {
                tracing::error!(%error, "forward pass failed");
                for chunk in &plan.chunks {
                    if let Some(active) = self.end(chunk.id) {
                        let _ = active.events.send(Event::Failed(EngineError::Model(error.clone())));
                    }
                }
            }
        }
    }

    /// Run the plan's chunks as one batch; the logits of each sampling chunk, in plan order.
    fn forward(&mut self, plan: &Plan) -> Result<Vec<Vec<f32>>, String> {
        let chunks: Vec<SeqChunk<'_>> = plan
            .chunks
            .iter()
            .map(|c| SeqChunk {
                tokens: &self.active[&c.id].decoding.tokens[c.start..c.start + c.len],
                start: c.start,
                blocks: self.scheduler.blocks(c.id),
                logits: c.samples,
                adapter: self.active[&c.id].adapter.as_deref(),
            })
            .collect();
        let prefill: usize = plan
            .chunks
            .iter()
            .filter(|c| c.len > 1 || !c.samples)
            .map(|c| c.len)
            .sum();
        self.counters.steps.fetch_add(1, Ordering::Relaxed);
        self.counters
            .prefill_tokens
            .fetch_add(prefill as u64, Ordering::Relaxed);
        let logits = self
            .model
            .model
            .forward_batch(&chunks, &mut self.kv)
            .map_err(|e| e.to_string())?;
        logits.to_vec2::<f32>().map_err(|e| e.to_string())
    }

    fn sample(&mut self, plan: &Plan, rows: &[Vec<f32>]) {
        let sampling = plan.chunks.iter().filter(|c| c.samples);
        for (chunk, logits) in sampling.zip(rows) {
            let Some(active) = self.active.get_mut(&chunk.id) else {
                continue;
            };
            self.counters.generated_tokens.fetch_add(1, Ordering::Relaxed);
            let pushed = active.decoding.push(logits, &self.model);
            let delta = match &pushed {
                Ok(_) if active.stream => active.decoding.stream_delta(&self.model),
                _ => Ok(None),
            };
            match (pushed, delta) {
                (Err(error), _) | (_, Err(error)) => {
                    if let Some(active) = self.end(chunk.id) {
                        let _ = active.events.send(Event::Failed(error));
                    }
                }
                (Ok(finished), Ok(delta)) => {
                    if let Some(text) = delta {
                        let _ = active.events.send(Event::Token(text));
                    }
                    if finished.is_some() {
                        let active = self.end(chunk.id).expect("the sequence is active");
                        let _ = active
                            .events
                            .send(Event::Finished(output(active.decoding, &self.model)));
                    } else {
                        self.scheduler.append_token(chunk.id);
                    }
                }
            }
        }
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
        body: serde_json::json!({ "response": generation.text }),
        usage: Usage {
            prompt_tokens: generation.prompt_tokens as u32,
            completion_tokens: generation.token_ids.len() as u32,
        },
        completion: Some(Completion {
            token_ids: generation.token_ids,
            finish_reason: generation.finish_reason,
        }),
    }
}
