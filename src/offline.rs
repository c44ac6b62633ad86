//! Lorry's offline modes: JSONL in, JSONL out, on one engine in this process.

use std::collections::HashMap;
use std::io::{BufRead, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context as _};
use candle_core::Device;
use futures::stream::{FuturesOrdered, StreamExt};
use indicatif::{ProgressBar, ProgressStyle};
use lorry_engine::adapters::{AdapterRef, Adapters, AdaptersConfig, LocalFiles};
use lorry_engine::lora::{Adapter, AdapterLimits};
use lorry_engine::models::bert::Pooling;
use lorry_engine::models::llama::{Llama, Products};
use lorry_engine::ops::quant::QuantType;
use lorry_engine::runtime::chat::TextModel;
use lorry_engine::runtime::embedding::Embedder;
use lorry_engine::runtime::speculative::{Proposer, SpecConfig, SpecPolicy};
use lorry_engine::runtime::text_engine::{EngineConfig, TextEngine};
use lorry_engine::{collect, Backend, Lane, Request, Task, ValidRequest};
use serde::Deserialize;
use serde_json::json;
use std::sync::atomic::Ordering;

/// `lorry generate`.
#[derive(clap::Args, Debug, Clone)]
pub struct GenerateArgs {
    /// A Llama-family checkpoint: a Hugging Face directory or a GGUF file
    /// (`llama`, `qwen2` or `gemma` architecture; its quantized blocks are
    /// multiplied as they are, or dequantized at load: `--products`).
    #[arg(long)]
    pub model: PathBuf,
    /// `NAME=DIR`: a LoRA adapter in PEFT's format (`adapter_config.json`,
    /// `adapter_model.safetensors`) that lines may name in `"adapter"`; repeatable.
    #[arg(long)]
    pub adapter: Vec<String>,
    /// JSONL: `{"id", "prompt" | "messages", "raw", "adapter", "max_tokens", "temperature",
    /// "top_p", "top_k", "seed", "stop", "ignore_eos", "response_format" | "guided_json" | "guided_regex" |
    /// "guided_choice" | "guided_grammar" | "structured_outputs", "logprobs", "top_logprobs", "n", "tools",
    /// "tool_choice", "parallel_tool_calls"}` per line.
    #[arg(long)]
    pub input: PathBuf,
    /// JSONL: `{"id", "token_ids", "text", "finish_reason", "usage", "logprobs"?, "tool_calls"?, "choices"?}` per
    /// line, in input order (`tool_calls`: `[{"id", "name", "arguments"}]`; `choices`: every choice of a line
    /// with `n` > 1, the first being the line's own fields).
    #[arg(long)]
    pub output: PathBuf,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub engine: EngineArgs,
}

/// Generate for every line of the input, all of it in continuous batches on one engine.
pub async fn generate(args: &GenerateArgs) -> anyhow::Result<()> {
    let mut adapter_dirs: HashMap<String, PathBuf> = HashMap::new();
    for spec in &args.adapter {
        let (name, dir) = spec
            .split_once('=')
            .filter(|(n, d)| !n.is_empty() && !d.is_empty())
            .with_context(|| format!("--adapter {spec}: expected NAME=DIR"))?;
        if adapter_dirs.insert(name.to_string(), PathBuf::from(dir)).is_some() {
            bail!("--adapter {name}: named twice");
        }
    }
    let requests = generate_requests(&args.input, &adapter_dirs)?;
    let model = args.engine.open_model(&args.model, None)?;
    // Each adapter is checked here, so that a bad one is named before any work.
    let mut adapters: HashMap<String, AdapterRef> = HashMap::new();
    for (name, dir) in &adapter_dirs {
        Adapter::from_dir(dir, &model.model.config().adapter_shape(), AdapterLimits::default())
            .map_err(|e| anyhow::anyhow!("--adapter {name}: {e}"))?;
        let reference = AdapterRef::local(dir).with_context(|| format!("--adapter {name}"))?;
        adapters.insert(name.clone(), reference);
    }
    let draft = args.engine.draft_for(&model, None)?;
    let engine = TextEngine::start_with_draft("offline", model, draft, args.engine.config())
        .with_adapters(Adapters::new(Arc::new(LocalFiles), AdaptersConfig::default()));
    let out = std::fs::File::create(&args.output).with_context(|| format!("creating {}", args.output.display()))?;
    let mut out = BufWriter::new(out);
    let bar = progress(requests.len(), "generate");
    let mut pending = FuturesOrdered::new();
    for (id, request, adapter) in requests {
        let adapter = adapter.map(|name| adapters[&name].clone());
        let events = engine.submit(Request::new(request, Lane::Batch).with_adapter(adapter))?;
        let bar = bar.clone();
        pending.push_back(async move {
            let result = collect(events).await;
            bar.inc(1);
            (id, result)
        });
    }
    // Results are written in input order, each as soon as those before it are done.
    while let Some((id, result)) = pending.next().await {
        let output = result.with_context(|| format!("request {id}"))?;
        let completion = output.completion.context("the engine returned no tokens")?;
        let mut line = json!({
            "id": id,
            "token_ids": completion.token_ids,
            "text": output.content.text(),
            "finish_reason": completion.finish_reason,
            "usage": {"prompt_tokens": output.usage.prompt_tokens, "completion_tokens": output.usage.completion_tokens},
        });
        if let Some(logprobs) = &output.logprobs {
            line["logprobs"] = json!(logprobs);
        }
        if !output.tool_calls.is_empty() {
            line["tool_calls"] = lorry_engine::tools::ToolCall::results_json(&output.tool_calls);
        }
        if !output.choices.is_empty() {
            // `n` > 1: the first choice above, and every choice here.
            let first = lorry_engine::Choice {
                text: output.content.text().to_string(),
                completion,
                logprobs: output.logprobs.clone(),
                tool_calls: output.tool_calls.clone(),
            };
            let choices: Vec<_> = std::iter::once(&first)
                .chain(&output.choices)
                .enumerate()
                .map(|(index, c)| {
                    let mut choice = json!({"index": index, "token_ids": c.completion.token_ids, "text": c.text,
                                            "finish_reason": c.completion.finish_reason});
                    if let Some(logprobs) = &c.logprobs {
                        choice["logprobs"] = json!(logprobs);
                    }
                    if !c.tool_calls.is_empty() {
                        choice["tool_calls"] = lorry_engine::tools::ToolCall::results_json(&c.tool_calls);
                    }
                    choice
                })
                .collect();
            line["choices"] = json!(choices);
        }
        serde_json::to_writer(&mut out, &line)?;
        out.write_all(b"\n")?;
    }
    bar.finish();
    out.flush()?;
    log_counters(engine.counters());
    Ok(())
}

/// Every line of a `lorry generate` input checked before any work: its `id`,
/// the request, and the `--adapter` name it uses.
#[allow(clippy::type_complexity)]
fn generate_requests(
    input: &Path,
    adapter_dirs: &HashMap<String, PathBuf>,
) -> anyhow::Result<Vec<(serde_json::Value, ValidRequest, Option<String>)>> {
    let lines: Vec<serde_json::Value> = read_lines(input)?;
    let mut requests = Vec::with_capacity(lines.len());
    for (n, mut line) in lines.into_iter().enumerate() {
        let object = line
            .as_object_mut()
            .with_context(|| format!("request {}: not a JSON object", n + 1))?;
        let id = object.remove("id").unwrap_or(serde_json::Value::Null);
        let adapter = match object.remove("adapter") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(name)) if adapter_dirs.contains_key(&name) => Some(name),
            Some(other) => bail!("request {id}: adapter {other} is not one of the --adapter names"),
        };
        let request = ValidRequest::parse(Task::TextGeneration, &line)
            .map_err(|e| anyhow::anyhow!("request {id}: {} ({}: {})", e.message, e.code, e.param))?;
        requests.push((id, request, adapter));
    }
    Ok(requests)
}

/// What the engine did, for the log.
fn log_counters(c: &lorry_engine::runtime::text_engine::Counters) {
    tracing::info!(
        steps = c.steps.load(Ordering::Relaxed),
        generated = c.generated_tokens.load(Ordering::Relaxed),
        preemptions = c.preemptions.load(Ordering::Relaxed),
        prefix_hit_blocks = c.prefix_hits.load(Ordering::Relaxed),
        prefix_miss_blocks = c.prefix_misses.load(Ordering::Relaxed),
        prefix_evicted_blocks = c.prefix_evicted.load(Ordering::Relaxed),
        ngram_proposed = c.ngram_proposed.load(Ordering::Relaxed),
        ngram_acceptance = c.acceptance(Proposer::Ngram),
        draft_proposed = c.draft_proposed.load(Ordering::Relaxed),
        draft_acceptance = c.acceptance(Proposer::Draft),
        "done"
    );
}

/// How the engine batches: `lorry generate` and the workers share these flags.
#[derive(clap::Args, Debug, Clone)]
pub struct EngineArgs {
    /// Memory for each model's KV cache, in MiB.
    #[arg(long, env = "LORRY_KV_CACHE_MB", default_value_t = 1024)]
    pub kv_cache_mb: usize,
    /// Sequences in one continuous batch.
    #[arg(long, env = "LORRY_MAX_SEQS", default_value_t = 64)]
    pub max_seqs: usize,
    /// Tokens computed per engine step (decoding plus chunked pre-fill).
    #[arg(long, env = "LORRY_STEP_TOKENS", default_value_t = 512)]
    pub step_tokens: usize,
    /// Until the engine has measured its steps' cost (its first few steps), or
    /// always with `--rt-step-slack-percent 0`: steps in a row batch work sits
    /// out while real-time requests run (0: batch and real-time rows always
    /// share steps).
    #[arg(long, env = "LORRY_RT_HOLD_STEPS", default_value_t = 32)]
    pub rt_hold_steps: usize,
    /// While real-time requests run, how much longer, in percent, than their
    /// own work alone a step carrying batch work may take: batch rows and
    /// pre-fill ride along only within it (0: no bound; batch work sits out
    /// `--rt-hold-steps` steps at a time instead).
    #[arg(long, env = "LORRY_RT_STEP_SLACK_PERCENT", default_value_t = 30)]
    pub rt_step_slack_percent: usize,
    /// Milliseconds after the last real-time request that steps stay bounded,
    /// so that the next one does not wait behind a long batch step.
    #[arg(long, env = "LORRY_RT_LINGER_MS", default_value_t = 5000)]
    pub rt_linger_ms: u64,
    /// Models whose one-token step is cheaper than this many milliseconds hold
    /// batch work back instead of pacing every step: while real-time requests
    /// run, batch work sits out real-time-only steps for what its last shared
    /// step took over the real-time work alone, divided by the slack (their
    /// requests' time is mostly outside the engine).
    #[arg(long, env = "LORRY_RT_PACE_MIN_STEP_MS", default_value_t = 10.0)]
    pub rt_pace_min_step_ms: f64,
    /// Batch work keeps every step within this many milliseconds, from the
    /// measured step cost (pre-fill cut, decodes taking turns, each whole),
    /// so that a real-time request arriving while no other runs waits at
    /// most about this long for the step in flight (0: only `--token-budget`
    /// bounds a step).
    #[arg(long, env = "LORRY_STEP_MAX_MS", default_value_t = 500.0)]
    pub step_max_ms: f64,
    /// The same bound while real-time requests run or ran within
    /// `--rt-linger-ms` (0: `--step-max-ms` throughout).
    #[arg(long, env = "LORRY_RT_STEP_MAX_MS", default_value_t = 50.0)]
    pub rt_step_max_ms: f64,
    /// Reuse the computed keys and values of prompt prefixes already seen
    /// (same model, same adapter): `on` or `off`.
    #[arg(long, env = "LORRY_PREFIX_CACHE", default_value = "on", value_parser = on_off, action = clap::ArgAction::Set)]
    pub prefix_cache: bool,
    /// Speculative decoding: `ngram` (prompt lookup), `draft:DIR` (a draft
    /// model sharing the tokenizer), `draft` (the draft the catalogue names
    /// next to each model; prompt lookup for models without one) or `off`.
    #[arg(long, env = "LORRY_SPECULATE", default_value = "ngram", value_parser = Speculate::parse)]
    pub speculate: Speculate,
    /// Speculate only in steps where at most this many sequences decode
    /// [default: no limit for prompt lookup under the measured policy, 32
    /// under `always`; 2 for a draft model].
    #[arg(long, env = "LORRY_SPECULATE_MAX_BATCH")]
    pub speculate_max_batch: Option<usize>,
    /// How a step decides to guess: `measured` (from each sequence's
    /// acceptance and the measured step cost, so that guesses are taken only
    /// where they are expected to pay) or `always` (every step, within
    /// `--speculate-max-batch`).
    #[arg(long, env = "LORRY_SPECULATE_POLICY", default_value = "measured", value_parser = SpecPolicy::parse)]
    pub speculate_policy: SpecPolicy,
    /// Speculate for sampled requests too (their output distribution is
    /// unchanged, but a seed's draws then depend on what shares the batch
    /// and, under the measured policy, on the steps' timings).
    #[arg(long, env = "LORRY_SPECULATE_SAMPLED", default_value_t = false)]
    pub speculate_sampled: bool,
    /// How weights are multiplied: `native` (a GGUF file's `Q8_0`, `Q4_0`,
    /// `Q4_1`, `Q5_0`, `Q5_1`, `Q4_K`, `Q5_K` and `Q6_K` blocks as they are,
    /// each token row quantized to 8-bit blocks; f16 and bf16 projections with
    /// bf16 dot products where the CPU has AVX-512 BF16) or `exact` (every
    /// weight dequantized at load, half precision widened in the product,
    /// token rows in f32: transformers' arithmetic, several times the bytes a
    /// step reads).
    #[arg(long, env = "LORRY_PRODUCTS", default_value = "native", value_parser = products)]
    pub products: Products,
    /// Quantize a checkpoint's f32, f16 and bf16 projections at load (weight
    /// only): `q8_0`, `q4_1`, `q4_0`, `q4_k`, `q5_k` or `q6_k` (llama.cpp's
    /// fallback where a projection's inputs are not whole super-blocks),
    /// multiplied as a GGUF file's blocks are. A catalogue entry's own
    /// `"quantize"` wins over this.
    #[arg(long, env = "LORRY_QUANTIZE", value_parser = QuantType::parse)]
    pub quantize: Option<QuantType>,
}

/// `--speculate`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Speculate {
    /// No speculation.
    Off,
    /// Prompt lookup.
    Ngram,
    /// A draft model: this directory, or the catalogue's.
    Draft(Option<PathBuf>),
}

impl Speculate {
    fn parse(value: &str) -> Result<Self, String> {
        match value {
            "off" => Ok(Speculate::Off),
            "ngram" => Ok(Speculate::Ngram),
            "draft" => Ok(Speculate::Draft(None)),
            _ => match value.strip_prefix("draft:") {
                Some(dir) if !dir.is_empty() => Ok(Speculate::Draft(Some(PathBuf::from(dir)))),
                _ => Err(format!("{value:?}: expected ngram, draft:DIR, draft or off")),
            },
        }
    }
}

fn products(value: &str) -> Result<Products, String> {
    match value {
        "native" => Ok(Products::Native),
        "exact" => Ok(Products::Exact),
        _ => Err(format!("{value:?}: expected native or exact")),
    }
}

fn on_off(value: &str) -> Result<bool, String> {
    match value {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("{value:?}: expected on or off")),
    }
}

impl EngineArgs {
    /// Load the text-generation checkpoint at `path` with these flags'
    /// products, quantized at load to `quantize` (a catalogue entry's) or
    /// else to `--quantize`.
    pub fn open_model(&self, path: &Path, quantize: Option<QuantType>) -> anyhow::Result<TextModel> {
        let products = match (self.products, quantize.or(self.quantize)) {
            (Products::Exact, Some(_)) => bail!("quantizing at load needs the native products (LORRY_PRODUCTS=native)"),
            (_, Some(ty)) => Products::Quantize(ty),
            (products, None) => products,
        };
        TextModel::open_with(path, &Device::Cpu, products).with_context(|| format!("loading {}", path.display()))
    }

    /// The engine configuration these flags describe.
    pub fn config(&self) -> EngineConfig {
        EngineConfig {
            kv_cache_bytes: self.kv_cache_mb << 20,
            max_seqs: self.max_seqs,
            token_budget: self.step_tokens,
            rt_hold_steps: self.rt_hold_steps,
            rt_step_slack_percent: self.rt_step_slack_percent,
            rt_linger: std::time::Duration::from_millis(self.rt_linger_ms),
            rt_pace_min_step_ms: self.rt_pace_min_step_ms,
            step_max_ms: self.step_max_ms,
            rt_step_max_ms: self.rt_step_max_ms,
            prefix_cache: self.prefix_cache,
            speculation: SpecConfig {
                proposer: match self.speculate {
                    Speculate::Off => Proposer::Off,
                    Speculate::Ngram => Proposer::Ngram,
                    Speculate::Draft(_) => Proposer::Draft,
                },
                max_batch: self.speculate_max_batch,
                sampled: self.speculate_sampled,
                policy: self.speculate_policy,
                ..SpecConfig::default()
            },
            ..EngineConfig::default()
        }
    }

    /// The draft model for `model` (served from `catalogued`, the draft the
    /// catalogue names, if any), checked to share its vocabulary; `None` when
    /// speculation does not use one.
    pub fn draft_for(&self, model: &TextModel, catalogued: Option<&Path>) -> anyhow::Result<Option<Llama>> {
        let dir = match &self.speculate {
            Speculate::Draft(Some(dir)) => dir.as_path(),
            Speculate::Draft(None) => match catalogued {
                Some(dir) => dir,
                None => return Ok(None),
            },
            _ => return Ok(None),
        };
        let draft = Llama::open(dir, &Device::Cpu).with_context(|| format!("loading the draft {}", dir.display()))?;
        let (want, got) = (model.model.config().vocab_size, draft.config().vocab_size);
        if want != got {
            bail!(
                "the draft {} has a vocabulary of {got} tokens, its target {want}: a draft must share the tokenizer",
                dir.display()
            );
        }
        Ok(Some(draft))
    }
}

/// `lorry embed`.
#[derive(clap::Args, Debug, Clone)]
pub struct EmbedArgs {
    /// A BERT-family checkpoint directory.
    #[arg(long)]
    pub model: PathBuf,
    /// JSONL: `{"id", "text", "pooling"?: "cls" | "mean"}` per line.
    #[arg(long)]
    pub input: PathBuf,
    /// JSONL: `{"id", "embedding": [...]}` per line, in input order.
    #[arg(long)]
    pub output: PathBuf,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EmbedLine {
    id: serde_json::Value,
    text: String,
    pooling: Option<Pooling>,
}

fn progress(total: usize, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(total as u64);
    let style = ProgressStyle::with_template("{prefix} {wide_bar} {pos}/{len} [{elapsed_precise} < {eta_precise}]")
        .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    bar.set_prefix(what.to_string());
    bar
}

/// Read and check every input line before any work starts, naming the first bad line.
fn read_lines<T: for<'de> Deserialize<'de>>(path: &Path) -> anyhow::Result<Vec<T>> {
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut lines = Vec::new();
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("reading {}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let parsed = serde_json::from_str(&line).with_context(|| format!("{} line {}", path.display(), n + 1))?;
        lines.push(parsed);
    }
    if lines.is_empty() {
        bail!("{} holds no requests", path.display());
    }
    Ok(lines)
}

/// Embed every line of the input.
pub fn embed(args: &EmbedArgs) -> anyhow::Result<()> {
    if lorry_engine::models::gguf::is_gguf(&args.model) {
        bail!(
            "{}: lorry embed serves BERT-family checkpoint directories; GGUF files are served as text-generation models (lorry generate)",
            args.model.display()
        );
    }
    let lines: Vec<EmbedLine> = read_lines(&args.input)?;
    let embedder =
        Embedder::from_dir(&args.model, &Device::Cpu).with_context(|| format!("loading {}", args.model.display()))?;
    let out = std::fs::File::create(&args.output).with_context(|| format!("creating {}", args.output.display()))?;
    let mut out = BufWriter::new(out);
    let bar = progress(lines.len(), "embed");
    for line in lines {
        let embedding = embedder
            .embed(&line.text, line.pooling)
            .with_context(|| format!("request {}", line.id))?;
        serde_json::to_writer(&mut out, &json!({"id": line.id, "embedding": embedding}))?;
        out.write_all(b"\n")?;
        bar.inc(1);
    }
    bar.finish();
    out.flush()?;
    Ok(())
}
