//! `lorry bench speculative` and `lorry bench prefix`: what speculative
//! decoding and the prefix cache buy on the `bench` model, each against the
//! engine without them, measured in the same run.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use candle_core::Device;
use lorry_engine::adapters::AdapterRef;
use lorry_engine::fixtures::{self, Fixture};
use lorry_engine::input::Prompt;
use lorry_engine::models::llama::Llama;
use lorry_engine::ops::gemm::Precision;
use lorry_engine::runtime::chat::TextModel;
use lorry_engine::runtime::speculative::{Proposer, SpecConfig, SpecPolicy};
use lorry_engine::runtime::text_engine::{EngineConfig, TextEngine};
use lorry_engine::{collect, Backend, Lane, Request, Task, ValidRequest};
use serde_json::json;

use crate::bench::{adapter_files, local_adapters, proposed_accepted, random_adapter};

/// `lorry bench speculative`: what to measure.
#[derive(clap::Args, Debug, Clone)]
pub struct SpeculativeBenchArgs {
    /// Batch sizes (sequences decoding together) to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,4,8,32")]
    pub batch: Vec<usize>,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 96)]
    pub new_tokens: usize,
    /// The most tokens guessed per sequence per step.
    #[arg(long, default_value_t = SpecConfig::default().max_draft)]
    pub max_draft: usize,
}

fn token_request(ids: Vec<u32>, new_tokens: usize) -> ValidRequest {
    let body = json!({"prompt": "", "raw": true, "max_tokens": new_tokens, "ignore_eos": true});
    let mut request = ValidRequest::parse(Task::TextGeneration, &body).expect("benchmark requests are valid");
    request.prompt = Prompt::Tokens(ids);
    request
}

/// Tokens of each request's random opening.
const OPENING: usize = 48;

/// `count` greedy requests whose prompts already hold what the model will
/// answer, as an extraction or summary prompt holds the spans it copies: a
/// random opening `p`, a continuation `g`, then `p` again, where `g` is what
/// the model answers to that very prompt (found by iterating from its greedy
/// continuation of `p` alone, up to [`SETTLE_ROUNDS`] times). Prompt lookup
/// finds `g` in the prompt; the target decides whether to follow it. The
/// prompts that settled (answer equal to the `g` in their prompt) come
/// first; returned with each one's place among the `count` made (whose
/// adapter it was made with) and how many settled.
async fn repetitive_requests(
    model: &TextModel,
    count: usize,
    new_tokens: usize,
    adapters: &[Option<AdapterRef>],
) -> anyhow::Result<(Vec<ValidRequest>, Vec<usize>, usize)> {
    let vocab = model.model.config().vocab_size as u64;
    let openings: Vec<Vec<u32>> = (0..count)
        .map(|i| {
            let mut rng = lorry_engine::runtime::rng::SplitMix::new(7 + i as u64);
            (0..OPENING)
                .map(|_| (300 + rng.next_u64() % (vocab - 300)) as u32)
                .collect()
        })
        .collect();
    let plain = SpecConfig {
        proposer: Proposer::Off,
        ..SpecConfig::default()
    };
    let engine =
        TextEngine::start("bench", model.clone(), engine_config(count, plain, false)).with_adapters(local_adapters());
    let first: Vec<ValidRequest> = openings.iter().map(|p| token_request(p.clone(), new_tokens)).collect();
    let (_, mut continuations) = serve(&engine, &first, adapters).await?;
    let prompts = |continuations: &[Vec<u32>]| -> Vec<ValidRequest> {
        openings
            .iter()
            .zip(continuations)
            .map(|(p, g)| token_request([p.clone(), g.clone(), p.clone()].concat(), new_tokens))
            .collect()
    };
    let mut settled = vec![false; count];
    for _ in 0..SETTLE_ROUNDS {
        let (_, answers) = serve(&engine, &prompts(&continuations), adapters).await?;
        settled = answers.iter().zip(&continuations).map(|(a, g)| a == g).collect();
        continuations = answers;
        if settled.iter().all(|&s| s) {
            break;
        }
    }
    let mut order: Vec<usize> = (0..count).collect();
    order.sort_by_key(|&i| !settled[i]);
    let mut prompts: Vec<Option<ValidRequest>> = prompts(&continuations).into_iter().map(Some).collect();
    let requests = order.iter().map(|&i| prompts[i].take().expect("each once")).collect();
    Ok((requests, order, settled.iter().filter(|&&s| s).count()))
}

/// The most rounds [`repetitive_requests`] spends settling each prompt's copy.
const SETTLE_ROUNDS: usize = 3;

/// Serve every request at once; the wall time and each output's token ids.
async fn serve(
    engine: &TextEngine,
    requests: &[ValidRequest],
    adapters: &[Option<AdapterRef>],
) -> anyhow::Result<(Duration, Vec<Vec<u32>>)> {
    serve_in_flight(engine, requests, adapters, requests.len()).await
}

/// Serve the requests in order, keeping `in_flight` of them submitted: as
/// one finishes the next goes in, as a batch service keeps its slots full.
/// The wall time and each output's token ids.
async fn serve_in_flight(
    engine: &TextEngine,
    requests: &[ValidRequest],
    adapters: &[Option<AdapterRef>],
    in_flight: usize,
) -> anyhow::Result<(Duration, Vec<Vec<u32>>)> {
    use futures::stream::{FuturesUnordered, StreamExt};
    let start = Instant::now();
    let submit = |i: usize| -> anyhow::Result<_> {
        let adapter = adapters.get(i).cloned().flatten();
        let stream = engine.submit(Request::new(requests[i].clone(), Lane::Batch).with_adapter(adapter))?;
        Ok(async move { (i, collect(stream).await) })
    };
    let mut running = FuturesUnordered::new();
    let mut next = 0;
    while next < requests.len().min(in_flight.max(1)) {
        running.push(submit(next)?);
        next += 1;
    }
    let mut outputs = vec![Vec::new(); requests.len()];
    while let Some((i, output)) = running.next().await {
        outputs[i] = output?.completion.context("no tokens")?.token_ids;
        if next < requests.len() {
            running.push(submit(next)?);
            next += 1;
        }
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
        // No real-time lane here: steps bounded only by the token budget.
        step_max_ms: 0.0,
        rt_step_max_ms: 0.0,
        ..EngineConfig::default()
    }
}

pub(crate) fn scratch(what: &str, fixture: Fixture) -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("lorry-bench-{what}-{}", std::process::id()));
    if !dir.join("config.json").exists() {
        eprintln!("writing the {what} fixture to {}", dir.display());
        fixtures::write(fixture, &dir)?;
    }
    Ok(dir)
}

/// One engine's run over every case: its times, outputs and counters.
struct Measured {
    seconds: Vec<f64>,
    outputs: Vec<Vec<Vec<u32>>>,
    /// Proposed, accepted, steps and tokens per case.
    counts: Vec<(u64, u64, u64, u64)>,
}

/// Requests served per decoding slot in each case: slots freed by sequences
/// that finish early are taken by the next request, as in a service, so a
/// few long rows at the end do not set the time.
const REQUESTS_PER_SLOT: usize = 2;

/// Serve each case (`batch` sequences decoding at once, from
/// `REQUESTS_PER_SLOT × batch` requests, mixed adapters or none) on one engine
/// whose prefix cache already holds every prompt, so that the time is decoding.
async fn measure(
    engine: &TextEngine,
    proposer: Proposer,
    cases: &[(usize, bool)],
    [requests, adapted]: [&[ValidRequest]; 2],
    adapters: &[Option<AdapterRef>],
) -> anyhow::Result<Measured> {
    let largest = REQUESTS_PER_SLOT * cases.iter().map(|c| c.0).max().unwrap_or(1);
    let warm = |requests: &[ValidRequest]| -> Vec<ValidRequest> {
        requests[..largest]
            .iter()
            .map(|r| {
                let mut r = r.clone();
                r.sampling.max_tokens = Some(1);
                r
            })
            .collect()
    };
    serve(engine, &warm(requests), &[]).await?;
    if cases.iter().any(|c| c.1) {
        serve(engine, &warm(adapted), adapters).await?;
    }
    let mut measured = Measured {
        seconds: Vec::new(),
        outputs: Vec::new(),
        counts: Vec::new(),
    };
    for &(batch, mixed) in cases {
        let c = engine.counters();
        let before = (
            proposed_accepted(engine, proposer),
            c.steps.load(Ordering::Relaxed),
            c.generated_tokens.load(Ordering::Relaxed),
        );
        let count = REQUESTS_PER_SLOT * batch;
        let (time, outputs) = if mixed {
            serve_in_flight(engine, &adapted[..count], &adapters[..count], batch).await?
        } else {
            serve_in_flight(engine, &requests[..count], &[], batch).await?
        };
        let after = (
            proposed_accepted(engine, proposer),
            c.steps.load(Ordering::Relaxed),
            c.generated_tokens.load(Ordering::Relaxed),
        );
        measured.seconds.push(time.as_secs_f64());
        measured.outputs.push(outputs);
        measured.counts.push((
            after.0 .0 - before.0 .0,
            after.0 .1 - before.0 .1,
            after.1 - before.1,
            after.2 - before.2,
        ));
    }
    Ok(measured)
}

/// Tokens/s with and without speculation at each batch size, for prompt
/// lookup and for two draft models, then in a mixed-adapter batch.
pub async fn speculative(args: &SpeculativeBenchArgs) -> anyhow::Result<()> {
    let target = scratch("bench-smooth", Fixture::BenchSmooth)?;
    let model = TextModel::open(&target, &Device::Cpu)?;
    let max_batch = args.batch.iter().copied().max().unwrap_or(1);
    // Each batch size without adapters, and with a distinct adapter per sequence.
    let mut cases: Vec<(usize, bool)> = args.batch.iter().flat_map(|&b| [(b, false), (b, b > 1)]).collect();
    cases.sort_unstable();
    cases.dedup();
    let count = REQUESTS_PER_SLOT * max_batch;
    // More candidate prompts than the cases use: the cases take those whose
    // answer is in the prompt first.
    let candidates = count + count / 2;
    eprintln!("making {candidates} random rank-16 adapters");
    let config = model.model.config().clone();
    let random: Vec<_> = (0..candidates)
        .map(|i| random_adapter(&config, 16, Precision::F32, 1000 + i as u64))
        .collect();
    let adapter_dir = std::env::temp_dir().join(format!("lorry-bench-adapters-{}", std::process::id()));
    let made: Vec<Option<AdapterRef>> = adapter_files(&random, &adapter_dir)?.into_iter().map(Some).collect();
    // Each row's prompt holds its own greedy continuation: with its adapter for the mixed cases.
    eprintln!("making the workload: each opening's greedy continuation");
    let (requests, _, settled) = repetitive_requests(&model, candidates, args.new_tokens, &[]).await?;
    let (adapted, order, adapted_settled) = repetitive_requests(&model, candidates, args.new_tokens, &made).await?;
    let adapters: Vec<Option<AdapterRef>> = order.iter().map(|&i| made[i].clone()).collect();
    let spec = |proposer, policy| SpecConfig {
        proposer,
        max_draft: args.max_draft,
        max_batch: Some(usize::MAX),
        policy,
        ..SpecConfig::default()
    };
    let policy = |proposer| {
        SpecConfig {
            proposer,
            ..SpecConfig::default()
        }
        .batch_limit()
    };
    // Each proposer's engine, speculating at every batch size, then prompt
    // lookup as the service runs it; a draft by its fixture's name.
    let runs = vec![
        ("off", Proposer::Off, SpecPolicy::Always, None),
        (
            "ngram (prompt lookup), every step",
            Proposer::Ngram,
            SpecPolicy::Always,
            None,
        ),
        (
            "ngram, measured policy (the default)",
            Proposer::Ngram,
            SpecPolicy::Measured,
            None,
        ),
        (
            "draft: bench-draft (own random weights)",
            Proposer::Draft,
            SpecPolicy::Always,
            Some(("bench-draft", Fixture::BenchDraft)),
        ),
        (
            "draft: bench-smooth-draft (the target's first 2 of 8 layers)",
            Proposer::Draft,
            SpecPolicy::Always,
            Some(("bench-smooth-draft", Fixture::BenchSmoothDraft)),
        ),
    ];
    let mut results = Vec::new();
    for (name, proposer, how, draft) in &runs {
        eprintln!("measuring {name}");
        let draft = match draft {
            Some((what, fixture)) => Some(Llama::open(&scratch(what, *fixture)?, &Device::Cpu)?),
            None => None,
        };
        let engine = TextEngine::start_with_draft(
            "bench",
            model.clone(),
            draft,
            engine_config(max_batch, spec(*proposer, *how), true),
        )
        .with_adapters(local_adapters());
        results.push(measure(&engine, *proposer, &cases, [&requests, &adapted], &adapters).await?);
    }
    println!(
        "Target `bench-smooth`. Greedy requests whose {}-token prompts hold the answer (a random opening, a \
         continuation, the opening again, where the continuation is what the model answers to that prompt: it is \
         for {settled} of {candidates} candidate prompts, {adapted_settled} of {candidates} with their adapters, \
         and each case takes those first, so up to {count} requests a case hold their answer). Prompts cached before the timed runs, so the time is decoding; {} new tokens each; \
         {REQUESTS_PER_SLOT}× batch requests a case, `batch` of them decoding at once (a finished one's slot \
         goes to the next). `every step`: speculation forced on at every batch size. `measured policy`: \
         the service's default, guesses taken per step from measured acceptance and step cost. A draft model \
         speculates by default only while at most {} sequences decode. Step cost: a step's time with \
         speculation against one without.\n",
        2 * OPENING + args.new_tokens,
        args.new_tokens,
        policy(Proposer::Draft),
    );
    println!(
        "| proposer | batch | adapters | tok/s off | tok/s on | speed-up | acceptance | tokens/step/seq | step cost | output identical |"
    );
    println!("|---|---:|---|---:|---:|---:|---:|---:|---:|---|");
    let off = &results[0];
    for ((name, _, _, _), run) in runs.iter().zip(&results).skip(1) {
        for (i, &(batch, mixed)) in cases.iter().enumerate() {
            let tokens = (REQUESTS_PER_SLOT * batch * args.new_tokens) as f64;
            let (proposed, accepted, steps, generated) = run.counts[i];
            let off_steps = off.counts[i].2;
            println!(
                "| {name} | {batch} | {} | {:.1} | {:.1} | {:.2}x | {:.0}% | {:.2} | {:.2}x | {} |",
                if mixed {
                    format!("{batch} distinct")
                } else {
                    "none".to_string()
                },
                tokens / off.seconds[i],
                tokens / run.seconds[i],
                off.seconds[i] / run.seconds[i],
                100.0 * accepted as f64 / proposed.max(1) as f64,
                generated as f64 / steps.max(1) as f64 / batch as f64,
                (run.seconds[i] / steps.max(1) as f64) / (off.seconds[i] / off_steps.max(1) as f64),
                if run.outputs[i] == off.outputs[i] { "yes" } else { "NO" },
            );
        }
    }
    let _ = std::fs::remove_dir_all(&adapter_dir);
    Ok(())
}

/// `lorry bench prefix`: what to measure.
#[derive(clap::Args, Debug, Clone)]
pub struct PrefixBenchArgs {
    /// Tokens of the shared prefix in the first scenario.
    #[arg(long, default_value_t = 1024)]
    pub prefix_tokens: usize,
    /// Rounds of the first scenario; the best is kept.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Requests in the second scenario, each a chunk under one instruction.
    #[arg(long, default_value_t = 280)]
    pub chunks: usize,
    /// Tokens of that instruction.
    #[arg(long, default_value_t = 192)]
    pub instruction_tokens: usize,
    /// Tokens of each chunk.
    #[arg(long, default_value_t = 24)]
    pub chunk_tokens: usize,
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
    let model = TextModel::open(&target, &Device::Cpu)?;
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

    // 2. Chunks under one instruction; 3. a chat of 8 turns. Once each.
    let instruction = text_of("Summarise the following chunk in one line", args.instruction_tokens);
    let chunks: Vec<ValidRequest> = (0..args.chunks)
        .map(|i| {
            prompt(
                format!("{instruction}{}", text_of(&format!("chunk {i}"), args.chunk_tokens)),
                4,
            )
        })
        .collect();
    println!("| workload | cache off s | cache on s | speed-up | prompt blocks hit |");
    println!("|---|---:|---:|---:|---:|");
    let (cached, plain) = (start(true), start(false));
    let off_s = serve(&plain, &chunks, &[]).await?.0.as_secs_f64();
    let on = serve(&cached, &chunks, &[]).await?.0.as_secs_f64();
    let mut hit_rate = hits(&cached);
    println!(
        "| {} chunks × ({}-token instruction + {}) → 4 tokens | {off_s:.2} | {on:.2} | {:.2}x | {:.0}% |",
        args.chunks,
        args.instruction_tokens,
        args.chunk_tokens,
        off_s / on,
        100.0 * hit_rate
    );
    let (mut on_runs, mut off_runs) = (Vec::new(), Vec::new());
    {
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
