//! `lorry bench structured`: what constrained decoding costs. Tokens/s of a
//! batch whose every row follows a mid-size JSON schema against the same
//! batch unconstrained, slots refilled as rows finish, in interleaved
//! rounds (greedy and at temperature 1, which kind goes first alternating);
//! and the time to compile a schema the first time (each one new) and again
//! (cached). Speculation is off: this measures the masks.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use candle_core::Device;
use lorry_engine::constraint::Constraint;
use lorry_engine::fixtures::Fixture;
use lorry_engine::runtime::chat::TextModel;
use lorry_engine::runtime::speculative::{Proposer, SpecConfig};
use lorry_engine::runtime::text_engine::{EngineConfig, TextEngine};
use lorry_engine::{collect, Backend, Lane, Request, Task, ValidRequest};
use serde_json::{json, Value};

/// `lorry bench structured`: what to measure.
#[derive(clap::Args, Debug, Clone)]
pub struct StructuredBenchArgs {
    /// A GGUF file or Hugging Face directory (default: the `bench` fixture,
    /// whose tokenizer has a token a byte; a real vocabulary makes masks dearer).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Rows decoding at once.
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// Most tokens a row generates.
    #[arg(long, default_value_t = 96)]
    pub max_tokens: u32,
    /// Rounds of each kind, interleaved.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Distinct schemas compiled for the compile-time figures.
    #[arg(long, default_value_t = 100)]
    pub schemas: usize,
}

/// An extraction schema of the size users send: eight properties, bounded
/// strings, ranges, an enum, an array and a nested object.
fn schema(variant: usize) -> Value {
    json!({
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 24},
            "category": {"enum": ["news", "sport", "science", "culture", format!("other-{variant}")]},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
            "author": {"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 20},
                "verified": {"type": "boolean"}},
                "required": ["name", "verified"], "additionalProperties": false},
            "summary": {"type": "string", "maxLength": 40},
            "language": {"type": "string", "pattern": "^[a-z]{2}$"}
        },
        "required": ["title", "category", "year", "score", "tags", "author", "summary", "language"],
        "additionalProperties": false
    })
}

fn request(i: usize, constrained: bool, max_tokens: u32, temperature: f32) -> ValidRequest {
    let mut body = json!({"prompt": format!("Record {i} as JSON:"), "raw": true, "max_tokens": max_tokens,
                          "temperature": temperature, "seed": i});
    if constrained {
        body["response_format"] =
            json!({"type": "json_schema", "json_schema": {"name": "record", "schema": schema(0)}});
    } else {
        body["ignore_eos"] = json!(true);
    }
    ValidRequest::parse(Task::TextGeneration, &body).expect("benchmark requests are valid")
}

/// Serve `requests`, `batch` at a time; generated tokens and seconds.
async fn serve(engine: &TextEngine, requests: Vec<ValidRequest>, batch: usize) -> anyhow::Result<(u64, f64)> {
    use futures::stream::{FuturesUnordered, StreamExt};
    let started = Instant::now();
    let mut pending = requests.into_iter();
    let mut running = FuturesUnordered::new();
    let submit = |r: ValidRequest| -> anyhow::Result<_> {
        let stream = engine.submit(Request::new(r, Lane::Batch))?;
        Ok(collect(stream))
    };
    for r in pending.by_ref().take(batch) {
        running.push(submit(r)?);
    }
    let mut tokens = 0;
    while let Some(output) = running.next().await {
        tokens += output?.completion.context("no tokens")?.token_ids.len() as u64;
        if let Some(r) = pending.next() {
            running.push(submit(r)?);
        }
    }
    Ok((tokens, started.elapsed().as_secs_f64()))
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Constrained against unconstrained decoding; schema compile times.
pub async fn structured(args: &StructuredBenchArgs) -> anyhow::Result<()> {
    let path = match &args.model {
        Some(path) => path.clone(),
        None => crate::speedups::scratch("bench", Fixture::Bench)?,
    };
    let model = TextModel::open(&path, &Device::Cpu)?;
    let config = EngineConfig {
        max_seqs: args.batch,
        rt_reserved_seqs: 0,
        rt_reserved_blocks_percent: 0,
        speculation: SpecConfig {
            proposer: Proposer::Off,
            ..SpecConfig::default()
        },
        step_max_ms: 0.0,
        rt_step_max_ms: 0.0,
        ..EngineConfig::default()
    };
    // The first constrained request on a model builds its vocabulary's token trie.
    let started = Instant::now();
    model
        .grammars()
        .guide(&Constraint::JsonSchema { schema: schema(0) })
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let first = started.elapsed().as_secs_f64() * 1e3;
    let engine = TextEngine::start("structured", model.clone(), config);
    println!(
        "Speculation off. {} rows at once, {} requests a round, at most {} tokens each; \
         unconstrained rows run to the limit, constrained ones end with their JSON.\n",
        args.batch,
        2 * args.batch,
        args.max_tokens
    );
    serve(&engine, vec![request(0, true, 8, 1.0), request(1, false, 8, 1.0)], 2).await?;
    println!("| round | temperature | unconstrained tok/s | constrained tok/s | constrained / unconstrained | constrained tokens a row |");
    println!("|---:|---:|---:|---:|---:|---:|");
    let mut ratios: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    for round in 0..args.rounds.max(1) {
        for (t, temperature) in [0.0f32, 1.0].into_iter().enumerate() {
            let n = 2 * args.batch;
            let base = round * n;
            let rows = |constrained| {
                (base..base + n)
                    .map(|i| request(i, constrained, args.max_tokens, temperature))
                    .collect()
            };
            // Which kind runs first alternates by round, so neither always follows the other.
            let ((plain_tokens, plain_s), (guided_tokens, guided_s)) = if round % 2 == 0 {
                let plain = serve(&engine, rows(false), args.batch).await?;
                (plain, serve(&engine, rows(true), args.batch).await?)
            } else {
                let guided = serve(&engine, rows(true), args.batch).await?;
                (serve(&engine, rows(false), args.batch).await?, guided)
            };
            let (plain, guided) = (plain_tokens as f64 / plain_s, guided_tokens as f64 / guided_s);
            ratios[t].push(guided / plain);
            println!(
                "| {} | {temperature} | {plain:.1} | {guided:.1} | {:.3}x | {:.1} |",
                round + 1,
                guided / plain,
                guided_tokens as f64 / n as f64
            );
        }
    }
    for (t, ratios) in ratios.iter_mut().enumerate() {
        ratios.sort_by(f64::total_cmp);
        println!("\nMedian ratio at temperature {t}: {:.3}x", percentile(ratios, 0.5));
    }
    println!();

    // Compile times: each schema new to the model's cache, then each again.
    let grammars = model.grammars();
    let constraints: Vec<Constraint> = (1..=args.schemas.max(1))
        .map(|v| Constraint::JsonSchema { schema: schema(v) })
        .collect();
    let mut time = |c: &Constraint| -> anyhow::Result<f64> {
        let started = Instant::now();
        grammars.guide(c).map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(started.elapsed().as_secs_f64() * 1e3)
    };
    let mut cold = constraints
        .iter()
        .map(&mut time)
        .collect::<anyhow::Result<Vec<f64>>>()?;
    let mut warm = constraints[constraints.len().saturating_sub(32)..]
        .iter()
        .map(&mut time)
        .collect::<anyhow::Result<Vec<f64>>>()?;
    cold.sort_by(f64::total_cmp);
    warm.sort_by(f64::total_cmp);
    println!(
        "| schema compile ({} schemas, vocabulary of {}) | p50 ms | p99 ms |",
        cold.len(),
        model.model.config().vocab_size
    );
    println!("|---|---:|---:|");
    println!("| first constrained request on the model (its token trie built, once) | {first:.1} | |");
    println!(
        "| first time | {:.2} | {:.2} |",
        percentile(&cold, 0.5),
        percentile(&cold, 0.99)
    );
    println!(
        "| again (cached) | {:.3} | {:.3} |",
        percentile(&warm, 0.5),
        percentile(&warm, 0.99)
    );
    Ok(())
}
