//! `lorry bench speculative` and `lorry bench prefix`: what speculative
//! decoding and the prefix cache buy on the `bench` model, each against the
//! engine without them, measured in the same run.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use candle_core::Device;
use lorry_engine::chat::TextModel;
use lorry_engine::fixtures::{self, Fixture};
use lorry_engine::gemm::Precision;
use lorry_engine::lora::PackedAdapter;
use lorry_engine::models::llama::Llama;
use lorry_engine::speculative::{Proposer, SpecConfig};
use lorry_engine::text_engine::{EngineConfig, TextEngine};
use lorry_engine::{collect, Lane, Task, ValidRequest};
use serde_json::json;

use crate::bench::random_adapter;

/// `lorry bench speculative`: what to measure.
#[derive(clap::Args, Debug, Clone)]
pub struct SpeculativeBenchArgs {
    /// Batch sizes (sequences decoding together) to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,4,8,16,32")]
    pub batch: Vec<usize>,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 96)]
    pub new_tokens: usize,
    /// The most tokens guessed per sequence per step.
    #[arg(long, default_value_t = SpecConfig::default().max_draft)]
    pub max_draft: usize,
}

/// Greedy requests on a repetitive, extraction-like prompt (a record listed
/// over and over with small changes), `count` of them, each a little different.
fn repetitive_prompt(i: usize) -> String {
    let records: String = (0..12)
        .map(|r| {
            format!(
                "id {:02}; name item-{}; status ok; owner team {};\n",
                r + i,
                r % 4,
                i % 3
            )
        })
        .collect();
    format!("Copy every record below.\n{records}id")
}

fn repetitive_requests(count: usize, new_tokens: usize) -> Vec<ValidRequest> {
    (0..count)
        .map(|i| {
            let body =
                json!({"prompt": repetitive_prompt(i), "raw": true, "max_tokens": new_tokens, "ignore_eos": true});
            ValidRequest::parse(Task::TextGeneration, &body).expect("benchmark requests are valid")
        })
        .collect()
}

/// Serve every request at once; the wall time and each output's token ids.
async fn serve(
    engine: &TextEngine,
    requests: &[ValidRequest],
    adapters: &[Option<Arc<PackedAdapter>>],
) -> anyhow::Result<(Duration, Vec<Vec<u32>>)> {
    let start = Instant::now();
    let streams: Vec<_> = requests
        .iter()
        .enumerate()
        .map(|(i, r)| engine.submit_adapted(r.clone(), Lane::Batch, adapters.get(i).cloned().flatten()))
        .collect::<Result<_, _>>()?;
    let mut outputs = Vec::new();
    for stream in streams {
        outputs.push(collect(stream).await?.completion.context("no tokens")?.token_ids);
    }
    Ok((start.elapsed(), outputs))
}

fn engine_config(max_seqs: usize, speculation: SpecConfig, prefix_cache: bool) -> EngineConfig {
    EngineConfig {
        max_seqs,
        rt_reserved_seqs: 0,
        rt_reserved_blocks_percent: 0,
        prefix_cache,
        speculation,
        ..EngineConfig::default()
    }
}

fn scratch(what: &str, fixture: Fixture) -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("lorry-bench-{what}-{}", std::process::id()));
    if !dir.join("config.json").exists() {
        eprintln!("writing the {what} fixture to {}", dir.display());
        fixtures::write(fixture, &dir)?;
    }
    Ok(dir)
}

/// Tokens/s with and without speculation at each batch size, for prompt
/// lookup and for two draft models, then in a mixed-adapter batch.
pub async fn speculative(args: &SpeculativeBenchArgs) -> anyhow::Result<()> {
    let target = scratch("bench", Fixture::Bench)?;
    let model = TextModel::from_dir(&target, &Device::Cpu)?;
    let drafts: Vec<(&str, Llama)> = vec![
        (
            "draft: bench-draft (own random weights)",
            Llama::from_dir(&scratch("bench-draft", Fixture::BenchDraft)?, &Device::Cpu)?,
        ),
        (
            "draft: bench-draft-shared (bench's first 2 of 8 layers)",
            Llama::from_dir(&scratch("bench-draft-shared", Fixture::BenchDraftShared)?, &Device::Cpu)?,
        ),
    ];
    let max_batch = args.batch.iter().copied().max().unwrap_or(1);
    let proposers: Vec<(&str, Proposer, Option<Llama>)> =
        std::iter::once(("ngram (prompt lookup)", Proposer::Ngram, None))
            .chain(
                drafts
                    .into_iter()
                    .map(|(name, draft)| (name, Proposer::Draft, Some(draft))),
            )
            .collect();
    let spec = |proposer, max_batch| SpecConfig {
        proposer,
        max_draft: args.max_draft,
        max_batch,
        ..SpecConfig::default()
    };
    println!(
        "Greedy, repetitive prompts (~{} tokens), {} new tokens each; speculation forced on at every batch size.\n",
        repetitive_prompt(0).len(),
        args.new_tokens
    );
    println!("| proposer | batch | adapters | tok/s off | tok/s on | speed-up | acceptance | tokens/step/seq | output identical |");
    println!("|---|---:|---|---:|---:|---:|---:|---:|---|");
    let mut cases: Vec<(usize, bool)> = args.batch.iter().map(|&b| (b, false)).collect();
    cases.push((max_batch, true));
    eprintln!("making {max_batch} random rank-16 adapters");
    let config = model.model.config().clone();
    let adapters: Vec<Option<Arc<PackedAdapter>>> = (0..max_batch)
        .map(|i| {
            Some(Arc::new(
                random_adapter(&config, 16, Precision::F32, 1000 + i as u64).packed(),
            ))
        })
        .collect();
    for (name, proposer, draft) in &proposers {
        for &(batch, mixed) in &cases {
            let requests = repetitive_requests(batch, args.new_tokens);
            let adapters: &[Option<Arc<PackedAdapter>>] = if mixed { &adapters[..batch] } else { &[] };
            let off = TextEngine::start(
                "bench",
                model.clone(),
                engine_config(batch, spec(Proposer::Off, 0), false),
            );
            serve(&off, &requests[..1], &[]).await?; // warm up
            let (plain, want) = serve(&off, &requests, adapters).await?;
            let on = TextEngine::start_with_draft(
                "bench",
                model.clone(),
                draft.clone(),
                engine_config(batch, spec(*proposer, usize::MAX), false),
            );
            serve(&on, &requests[..1], &[]).await?;
            let c = on.counters();
            let (steps0, generated0) = (
                c.steps.load(Ordering::Relaxed),
                c.generated_tokens.load(Ordering::Relaxed),
            );
            let (proposed0, accepted0) = proposed_accepted(&on, *proposer);
            let (fast, got) = serve(&on, &requests, adapters).await?;
            let steps = c.steps.load(Ordering::Relaxed) - steps0;
            let generated = c.generated_tokens.load(Ordering::Relaxed) - generated0;
            let (proposed, accepted) = proposed_accepted(&on, *proposer);
            let tokens = (batch * args.new_tokens) as f64;
            println!(
                "| {name} | {batch} | {} | {:.1} | {:.1} | {:.2}x | {:.0}% | {:.2} | {} |",
                if mixed { "32 distinct" } else { "none" },
                tokens / plain.as_secs_f64(),
                tokens / fast.as_secs_f64(),
                plain.as_secs_f64() / fast.as_secs_f64(),
                100.0 * (accepted - accepted0) as f64 / (proposed - proposed0).max(1) as f64,
                generated as f64 / steps.max(1) as f64 / batch as f64,
                if got == want { "yes" } else { "NO" },
            );
        }
    }
    Ok(())
}

fn proposed_accepted(engine: &TextEngine, proposer: Proposer) -> (u64, u64) {
    let c = engine.counters();
    let (p, a) = match proposer {
        Proposer::Draft => (&c.draft_proposed, &c.draft_accepted),
        _ => (&c.ngram_proposed, &c.ngram_accepted),
    };
    (p.load(Ordering::Relaxed), a.load(Ordering::Relaxed))
}

/// `lorry bench prefix`: what to measure.
#[derive(clap::Args, Debug, Clone)]
pub struct PrefixBenchArgs {
    /// Tokens of the shared prefix in the first scenario.
    #[arg(long, default_value_t = 1024)]
    pub prefix_tokens: usize,
    /// Rounds of each measurement; the best is kept.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
}

fn text_of(seed: &str, tokens: usize) -> String {
    // One token a byte on the fixtures' tokenizer.
    format!("{seed} lorem ipsum dolor sit amet, consectetur adipiscing elit; ")
        .chars()
        .cycle()
        .take(tokens)
        .collect()
}

fn prompt(text: String, new_tokens: usize) -> ValidRequest {
    let body = json!({"prompt": text, "raw": true, "max_tokens": new_tokens, "ignore_eos": true});
    ValidRequest::parse(Task::TextGeneration, &body).expect("benchmark requests are valid")
}

/// Pre-fill of a second request sharing a long prefix; a batch of chunks
/// sharing an instruction; a multi-turn chat: each with the cache on and off.
pub async fn prefix(args: &PrefixBenchArgs) -> anyhow::Result<()> {
    let target = scratch("bench", Fixture::Bench)?;
    let model = TextModel::from_dir(&target, &Device::Cpu)?;
    let off = SpecConfig {
        proposer: Proposer::Off,
        ..SpecConfig::default()
    };
    let start = |cache| TextEngine::start("bench", model.clone(), engine_config(64, off, cache));
    let best = |runs: &[f64]| runs.iter().copied().fold(f64::MAX, f64::min);

    // 1. A shared 1,024-token prefix: the first request pre-fills it, the second reuses it.
    let shared = text_of("context", args.prefix_tokens);
    let (mut first, mut second, mut uncached) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..args.rounds.max(1) {
        let cached = start(true);
        let plain = start(false);
        let q = |n: usize| prompt(format!("{shared}{}", text_of(&format!("question {round} {n}"), 32)), 1);
        serve(&cached, &[prompt(text_of("warm", 16), 1)], &[]).await?;
        serve(&plain, &[prompt(text_of("warm", 16), 1)], &[]).await?;
        first.push(serve(&cached, &[q(1)], &[]).await?.0.as_secs_f64());
        second.push(serve(&cached, &[q(2)], &[]).await?.0.as_secs_f64());
        uncached.push(serve(&plain, &[q(2)], &[]).await?.0.as_secs_f64());
    }
    let (first, second, uncached) = (best(&first), best(&second), best(&uncached));
    println!(
        "Pre-fill (one request alone, to its first token) of {} + 32 tokens:\n",
        args.prefix_tokens
    );
    println!("| request | ms | of the first |");
    println!("|---|---:|---:|");
    println!("| first (cold cache) | {:.1} | 100% |", first * 1e3);
    println!(
        "| second, sharing the prefix | {:.1} | {:.1}% |",
        second * 1e3,
        100.0 * second / first
    );
    println!(
        "| second, cache off | {:.1} | {:.1}% |\n",
        uncached * 1e3,
        100.0 * uncached / first
    );

    // 2. 280 chunks under one 256-token instruction; 3. a chat of 8 turns.
    let instruction = text_of("Summarise the following chunk in one line", 256);
    let chunks: Vec<ValidRequest> = (0..280)
        .map(|i| prompt(format!("{instruction}{}", text_of(&format!("chunk {i}"), 64)), 4))
        .collect();
    println!("| workload | cache off s | cache on s | speed-up | prompt blocks hit |");
    println!("|---|---:|---:|---:|---:|");
    let (mut on_runs, mut off_runs, mut hit_rate) = (Vec::new(), Vec::new(), 0.0);
    for _ in 0..args.rounds.max(1) {
        let (cached, plain) = (start(true), start(false));
        off_runs.push(serve(&plain, &chunks, &[]).await?.0.as_secs_f64());
        on_runs.push(serve(&cached, &chunks, &[]).await?.0.as_secs_f64());
        hit_rate = hits(&cached);
    }
    let (on, off_s) = (best(&on_runs), best(&off_runs));
    println!(
        "| 280 chunks × (256-token instruction + 64) → 4 tokens | {off_s:.2} | {on:.2} | {:.2}x | {:.0}% |",
        off_s / on,
        100.0 * hit_rate
    );
    let (mut on_runs, mut off_runs) = (Vec::new(), Vec::new());
    for _ in 0..args.rounds.max(1) {
        for (cache, runs) in [(true, &mut on_runs), (false, &mut off_runs)] {
            let engine = start(cache);
            let mut conversation = text_of("system: be brief", 200);
            let began = Instant::now();
            for turn in 0..8 {
                conversation.push_str(&text_of(&format!("user turn {turn}"), 48));
                let (_, out) = serve(&engine, &[prompt(conversation.clone(), 16)], &[]).await?;
                // The reply joins the history as the tokens it was.
                conversation.push_str(&model.decode(&out[0]).unwrap_or_default());
            }
            runs.push(began.elapsed().as_secs_f64());
            if cache {
                hit_rate = hits(&engine);
            }
        }
    }
    let (on, off_s) = (best(&on_runs), best(&off_runs));
    println!(
        "| chat, 8 turns (200-token system prompt, 48-token messages, 16-token replies) | {off_s:.2} | {on:.2} | {:.2}x | {:.0}% |",
        off_s / on,
        100.0 * hit_rate
    );
    Ok(())
}

fn hits(engine: &TextEngine) -> f64 {
    let c = engine.counters();
    let (h, m) = (
        c.prefix_hits.load(Ordering::Relaxed),
        c.prefix_misses.load(Ordering::Relaxed),
    );
    h as f64 / (h + m).max(1) as f64
}
