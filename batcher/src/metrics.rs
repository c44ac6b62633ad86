//! What a worker exposes at `/metrics`: the requests it ended and their
//! tokens (counted from the rows each commit wrote, so a redelivered chunk
//! is not counted twice), webhook attempts, and its engines' and adapter
//! cache's counters, read at scrape time.

use std::sync::atomic::Ordering;

use lorry_engine::adapters::Adapters;
use lorry_engine::runtime::speculative::Proposer;
use lorry_engine::{Counters, Lane};
use lorry_metrics::{Counter, Family, Text};

use crate::store::Committed;

/// A lane as a label value.
pub fn lane_label(lane: Lane) -> &'static str {
    match lane {
        Lane::Batch => "batch",
        Lane::RealTime => "real_time",
    }
}

/// The worker's own counters.
#[derive(Debug)]
pub struct WorkerMetrics {
    /// Requests ended, by lane, model and outcome (`succeeded`, `errored`, `cancelled`).
    pub requests: Family<Counter, 3>,
    /// Prompt tokens of the requests that succeeded, by lane and model.
    pub prompt_tokens: Family<Counter, 2>,
    /// Tokens they generated, by lane and model.
    pub completion_tokens: Family<Counter, 2>,
    /// Webhook attempts, by outcome (`delivered`, `retrying`, `failed`: given up).
    pub webhook_attempts: Family<Counter, 1>,
}

impl Default for WorkerMetrics {
    fn default() -> Self {
        WorkerMetrics {
            requests: Family::counters(["lane", "model", "outcome"]),
            prompt_tokens: Family::counters(["lane", "model"]),
            completion_tokens: Family::counters(["lane", "model"]),
            webhook_attempts: Family::counters(["outcome"]),
        }
    }
}

impl WorkerMetrics {
    /// Count what a commit wrote for `model` on `lane`.
    pub fn ended(&self, lane: Lane, model: &str, ended: &Committed) {
        let lane = lane_label(lane);
        for (outcome, n) in [("succeeded", ended.succeeded), ("errored", ended.errored)] {
            if n > 0 {
                self.requests.with([lane, model, outcome]).add(n);
            }
        }
        if ended.prompt_tokens > 0 {
            self.prompt_tokens.with([lane, model]).add(ended.prompt_tokens);
        }
        if ended.completion_tokens > 0 {
            self.completion_tokens.with([lane, model]).add(ended.completion_tokens);
        }
    }

    /// Count one real-time request that ended without an answer (its client left).
    pub fn cancelled(&self, model: &str) {
        self.requests
            .with([lane_label(Lane::RealTime), model, "cancelled"])
            .inc();
    }

    /// Write the worker's counters.
    pub fn render(&self, text: &mut Text) {
        text.counters(
            "lorry_requests_total",
            "Requests this worker ended, by lane, model and outcome.",
            &self.requests,
        );
        text.counters(
            "lorry_prompt_tokens_total",
            "Prompt tokens of the requests this worker ended, by lane and model.",
            &self.prompt_tokens,
        );
        text.counters(
            "lorry_completion_tokens_total",
            "Tokens generated for the requests this worker ended, by lane and model.",
            &self.completion_tokens,
        );
        text.counters(
            "lorry_webhook_attempts_total",
            "Webhook delivery attempts, by outcome (failed: the delivery was given up).",
            &self.webhook_attempts,
        );
    }
}

/// Write the engines' counters (`engines`: each text engine's model and
/// counters) and the adapter cache's.
pub fn render_engines(text: &mut Text, engines: &[(&str, &Counters)], adapters: Option<&Adapters>) {
    let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed) as f64;
    let per_model = |text: &mut Text, name: &str, help: &str, counter: bool, read: &dyn Fn(&Counters) -> f64| {
        let mut samples = if counter {
            text.counter(name, help)
        } else {
            text.gauge(name, help)
        };
        for (model, counters) in engines {
            samples.sample(&[("model", model)], read(counters));
        }
    };
    per_model(text, "lorry_engine_steps_total", "Forward passes.", true, &|c| {
        load(&c.steps)
    });
    per_model(
        text,
        "lorry_engine_prefill_tokens_total",
        "Prompt (and recomputed) tokens run.",
        true,
        &|c| load(&c.prefill_tokens),
    );
    per_model(
        text,
        "lorry_engine_generated_tokens_total",
        "Tokens sampled (guesses accepted included).",
        true,
        &|c| load(&c.generated_tokens),
    );
    per_model(
        text,
        "lorry_engine_preemptions_total",
        "Sequences that lost their KV blocks and were recomputed.",
        true,
        &|c| load(&c.preemptions),
    );
    let mut sequences = text.gauge(
        "lorry_engine_sequences",
        "Sequences in the running batch and waiting to join it.",
    );
    for (model, c) in engines {
        sequences.sample(&[("model", model), ("state", "running")], load(&c.running));
        sequences.sample(&[("model", model), ("state", "waiting")], load(&c.waiting));
    }
    let mut blocks = text.gauge(
        "lorry_engine_kv_blocks",
        "KV-cache blocks held by sequences (used) and not (free: never used, or cached and idle).",
    );
    for (model, c) in engines {
        let free = load(&c.kv_blocks_free);
        blocks.sample(&[("model", model), ("state", "used")], load(&c.kv_blocks_total) - free);
        blocks.sample(&[("model", model), ("state", "free")], free);
    }
    let mut steps = text.histogram("lorry_engine_step_duration_seconds", "How long each forward pass took.");
    for (model, c) in engines {
        steps.sample(&[("model", model)], &c.step_seconds.snapshot());
    }
    per_model(
        text,
        "lorry_prefix_cache_hits_total",
        "Prompt blocks found in the prefix cache.",
        true,
        &|c| load(&c.prefix_hits),
    );
    per_model(
        text,
        "lorry_prefix_cache_misses_total",
        "Prompt blocks looked up in the prefix cache and not found.",
        true,
        &|c| load(&c.prefix_misses),
    );
    per_model(
        text,
        "lorry_prefix_cache_evictions_total",
        "Cached blocks evicted for new work.",
        true,
        &|c| load(&c.prefix_evicted),
    );
    let proposers = [("ngram", Proposer::Ngram), ("draft", Proposer::Draft)];
    type Read = fn(&Counters, Proposer) -> f64;
    let guesses: [(&str, &str, Read); 2] = [
        (
            "lorry_speculation_proposed_tokens_total",
            "Tokens guessed by speculative decoding, by proposer.",
            |c, p| c.speculation(p).0.load(Ordering::Relaxed) as f64,
        ),
        (
            "lorry_speculation_accepted_tokens_total",
            "Guessed tokens the model accepted, by proposer.",
            |c, p| c.speculation(p).1.load(Ordering::Relaxed) as f64,
        ),
    ];
    for (name, help, read) in guesses {
        let mut samples = text.counter(name, help);
        for (model, c) in engines {
            for (label, proposer) in proposers {
                samples.sample(&[("model", model), ("proposer", label)], read(c, proposer));
            }
        }
    }
    let Some(adapters) = adapters else {
        return;
    };
    let stats = adapters.stats();
    text.gauge(
        "lorry_adapter_cache_resident_bytes",
        "Bytes of packed LoRA adapters resident for the engines.",
    )
    .sample(&[], stats.resident_bytes as f64);
    text.counter(
        "lorry_adapter_loads_total",
        "Adapter loads (fetch, check, pack), by outcome.",
    )
    .sample(&[("outcome", "loaded")], stats.loads as f64)
    .sample(&[("outcome", "failed")], stats.failed_loads as f64);
    text.counter("lorry_adapter_evictions_total", "Resident adapters evicted.")
        .sample(&[], stats.evictions as f64);
    text.counter(
        "lorry_adapter_cache_hits_total",
        "Requests whose adapter was already resident.",
    )
    .sample(&[], stats.hits as f64);
    text.histogram(
        "lorry_adapter_load_duration_seconds",
        "How long each successful adapter load took.",
    )
    .sample(&[], &adapters.load_time());
}
