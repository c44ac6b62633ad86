//! Benchmarks that print tables. `lorry bench pipeline`: one large batch on
//! `@lorry/echo` against a running stack, timed from the client's side.
//! `lorry bench engine`: the packed product kernels against candle, decode
//! rates in each weight precision against the machine's rooflines, and
//! continuous against static batching.

use std::time::{Duration, Instant};

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use lorry_engine::adapters::{AdapterRef, Adapters, AdaptersConfig, LocalFiles};
use lorry_engine::lora::{Adapter, AdapterLimits, LoraWeights, PackedAdapter, Target};
use lorry_engine::models::llama::{Config, Products};
use lorry_engine::ops::gemm::{self, Kernel, PackedMatrix, PairKernel, Precision};
use lorry_engine::ops::quant::{QuantKernel, QuantMatrix, QuantType};

use anyhow::{bail, Context as _};
use lorry_engine::fixtures::{self, Fixture};
use lorry_engine::runtime::chat::TextModel;
use lorry_engine::runtime::scheduler::Policy;
use lorry_engine::runtime::speculative::{Proposer, SpecConfig, SpecPolicy};
use lorry_engine::runtime::text_engine::{EngineConfig, TextEngine};
use lorry_engine::{collect, Backend, Lane, Request, Task, ValidRequest};
use serde_json::{json, Value};

/// What to submit and where.
#[derive(clap::Args, Debug, Clone)]
pub struct PipelineArgs {
    /// Requests in the batch.
    #[arg(long, default_value_t = 10_000)]
    pub requests: usize,
    /// The API's base URL.
    #[arg(long, env = "LORRY_URL", default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// An API token.
    #[arg(long, env = "LORRY_TOKEN")]
    pub token: String,
    /// The model.
    #[arg(long, default_value = "@lorry/echo")]
    pub model: String,
    /// Runs; each is reported.
    #[arg(long, default_value_t = 1)]
    pub runs: usize,
}

/// The timeline of one run, measured from the start of the POST.
#[derive(Debug, Clone)]
pub struct PipelineRun {
    /// Requests submitted.
    pub requests: usize,
    /// POST until its 202.
    pub post: Duration,
    /// Until the first result was visible.
    pub first_result: Duration,
    /// Until every request had a result.
    pub all_results: Duration,
    /// Until the batch was `completed` (output written).
    pub completed: Duration,
}

/// Run the benchmark and print its table.
pub async fn pipeline(args: &PipelineArgs) -> anyhow::Result<Vec<PipelineRun>> {
    let http = reqwest::Client::new();
    let mut runs = Vec::new();
    for _ in 0..args.runs {
        runs.push(one_run(&http, args).await?);
    }
    print_table(&runs);
    Ok(runs)
}

async fn one_run(http: &reqwest::Client, args: &PipelineArgs) -> anyhow::Result<PipelineRun> {
    let requests: Vec<Value> = (0..args.requests)
        .map(|i| json!({"custom_id": format!("r{i}"), "body": {"prompt": format!("request number {i} of the pipeline benchmark")}}))
        .collect();
    let body = serde_json::to_vec(&json!({"model": args.model, "requests": requests}))?;
    let started = Instant::now();
    let response = http
        .post(format!("{}/v1/batches", args.url))
        .bearer_auth(&args.token)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .context("posting the batch")?;
    let post = started.elapsed();
    if response.status().as_u16() != 202 {
        bail!("POST answered {}: {}", response.status(), response.text().await?);
    }
    let batch: Value = response.json().await?;
    let id = batch["id"].as_str().context("batch id")?.to_string();
    let (mut first_result, mut all_results) = (None, None);
    loop {
        let batch: Value = http
            .get(format!("{}/v1/batches/{id}", args.url))
            .bearer_auth(&args.token)
            .send()
            .await?
            .json()
            .await?;
        let counts = &batch["request_counts"];
        let finished = counts["total"].as_i64().unwrap_or(0)
            - counts["pending"].as_i64().unwrap_or(0)
            - counts["running"].as_i64().unwrap_or(0);
        if finished > 0 && first_result.is_none() {
            first_result = Some(started.elapsed());
        }
        if finished as usize == args.requests && all_results.is_none() {
            all_results = Some(started.elapsed());
        }
        match batch["status"].as_str() {
            Some("completed") => break,
            Some("failed" | "expired" | "cancelled") => {
                bail!("the batch ended {}", batch["status"])
            }
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    let completed = started.elapsed();
    Ok(PipelineRun {
        requests: args.requests,
        post,
        first_result: first_result.unwrap_or(completed),
        all_results: all_results.unwrap_or(completed),
        completed,
    })
}

fn print_table(runs: &[PipelineRun]) {
    println!("| requests | POST (s) | first result (s) | all results (s) | completed (s) | requests/s |");
    println!("|---:|---:|---:|---:|---:|---:|");
    for r in runs {
        println!(
            "| {} | {:.3} | {:.3} | {:.3} | {:.3} | {:.0} |",
            r.requests,
            r.post.as_secs_f64(),
            r.first_result.as_secs_f64(),
            r.all_results.as_secs_f64(),
            r.completed.as_secs_f64(),
            r.requests as f64 / r.completed.as_secs_f64(),
        );
    }
    println!();
    println!(
        "POST: validation and one transaction (batch, requests, outbox). first result: relay, broker, first chunk."
    );
    println!(
        "all results: serving and committing every chunk. completed: output.jsonl to S3 and the final transaction."
    );
}

/// `lorry bench engine`: what to measure.
#[derive(clap::Args, Debug, Clone)]
pub struct EngineBenchArgs {
    /// A Llama-family checkpoint (a Hugging Face directory or a GGUF file); the `bench` fixture, written to a temporary directory, when absent.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Weight precisions to write the `bench` fixture in and decode with (without `--model`).
    #[arg(long, value_delimiter = ',', default_value = "f32,f16")]
    pub dtype: Vec<String>,
    /// The products to measure each model with, in turn (`native`: a GGUF
    /// file's quantized blocks as they are, other weights in their own
    /// precision; `exact`: every weight dequantized at load; `q8_0`, `q4_1`,
    /// `q4_0`, `q4_k`, `q5_k`, `q6_k`: the projections quantized at load, as
    /// `--quantize`).
    #[arg(long, value_delimiter = ',', default_value = "native")]
    pub products: Vec<String>,
    /// Batch sizes to decode at.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64")]
    pub batch: Vec<usize>,
    /// Prompt length, in tokens.
    #[arg(long, default_value_t = 32)]
    pub prompt_tokens: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 128)]
    pub new_tokens: usize,
    /// Requests in the continuous-versus-static comparison (0 skips it).
    #[arg(long, default_value_t = 128)]
    pub tail_requests: usize,
    /// Sequences at once in that comparison.
    #[arg(long, default_value_t = 32)]
    pub tail_batch: usize,
    /// `off`: decode with speculation off (the model's rate); `compare`: also
    /// a second engine without speculation, prompt lookup guessing in every
    /// step and prompt lookup under the measured policy (the service's
    /// default), on the same prompts: the four in turn for `--rounds` rounds at
    /// each batch size, each round against its own run without speculation,
    /// the median ratio and its range printed.
    #[arg(long, default_value = "off", value_parser = ["off", "compare"])]
    pub speculation: String,
    /// Rounds of `--speculation compare`.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Decode runs at each batch size, the memory's read rate measured again
    /// just before and after each (the better of the two is that run's
    /// memory roofline): the table gives the run whose share of its
    /// roofline is the median, and the range of the runs' shares.
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// The prompts: `lorem` (a numbered lorem ipsum of `--prompt-tokens`) or
    /// `questions` (a different question on each row, answered in prose:
    /// the prompt's length is its own).
    #[arg(long, default_value = "lorem", value_parser = ["lorem", "questions"])]
    pub prompts: String,
}

/// What `--prompts questions` asks about.
const TOPICS: [&str; 32] = [
    "a refrigerator",
    "photosynthesis",
    "a bicycle gear",
    "the immune system",
    "a compass",
    "bread rising",
    "a rainbow",
    "a steam engine",
    "the tides",
    "a vaccine",
    "an electric motor",
    "a volcano",
    "the heart",
    "a telescope",
    "compound interest",
    "a thermostat",
    "wind turbines",
    "the water cycle",
    "a camera lens",
    "earthquakes",
    "a lock and key",
    "composting",
    "a microwave oven",
    "bird migration",
    "a solar panel",
    "the stock market",
    "a piano",
    "glaciers",
    "a battery",
    "sleep",
    "a parachute",
    "coffee brewing",
];

/// `--prompts questions`'s `i`-th prompt.
fn question(i: usize) -> String {
    let topic = TOPICS[i % TOPICS.len()];
    match i / TOPICS.len() {
        0 => format!("Question: Explain in detail how {topic} works, step by step.\nAnswer:"),
        n => format!("Question {n}: Describe the history of {topic} and why it matters.\nAnswer:"),
    }
}

/// The machine's ceilings, measured in the same run.
struct Ceilings {
    /// Bytes per second, reading memory on every core.
    bandwidth: f64,
    /// f32 multiply-adds (×2) per second on registers alone, every core busy.
    peak_flops: f64,
    /// The same in a large candle matmul (2048³).
    gemm_flops: f64,
}

/// The memory's read rate as the decode kernel itself reads: a buffer the
/// size of a model's f32 weights (one token row through a packed matrix),
/// on every core. Whatever of it the caches keep between passes, they keep
/// for the model too.
struct MemoryProbe {
    packed: PackedMatrix,
    ones: Vec<f32>,
}

impl MemoryProbe {
    /// A buffer of `weight_bytes` (at least 64 MiB).
    fn new(weight_bytes: usize) -> Self {
        const INPUTS: usize = 1024;
        let outputs = (weight_bytes / 4).max(1 << 24) / INPUTS;
        MemoryProbe {
            packed: PackedMatrix::from_f32(&vec![1f32; outputs * INPUTS], outputs, INPUTS),
            ones: vec![1f32; INPUTS],
        }
    }

    /// Bytes a second, the best of `runs` reads of the whole buffer.
    fn rate(&self, runs: usize) -> f64 {
        let mut best = f64::MAX;
        for _ in 0..runs.max(1) {
            let start = Instant::now();
            std::hint::black_box(self.packed.matmul(&self.ones, 1));
            best = best.min(start.elapsed().as_secs_f64());
        }
        self.packed.bytes() as f64 / best
    }
}

/// The ceilings for a model that reads `weight_bytes` each step.
fn measure_ceilings(weight_bytes: usize) -> anyhow::Result<Ceilings> {
    let bandwidth = MemoryProbe::new(weight_bytes).rate(5);
    let n = 2048;
    let a = Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu)?;
    let b = Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu)?;
    let mut best = f64::MAX;
    for _ in 0..4 {
        let start = Instant::now();
        std::hint::black_box(a.matmul(&b)?);
        best = best.min(start.elapsed().as_secs_f64());
    }
    Ok(Ceilings {
        bandwidth,
        peak_flops: gemm::peak_flops(),
        gemm_flops: 2.0 * (n * n * n) as f64 / best,
    })
}

/// One run of the products table: matrix `i` of the step times `m` rows `x`.
type Run<'a> = Box<dyn Fn(usize, &[f32], usize) -> Vec<f32> + 'a>;

/// A products-table run on packed panels.
fn panel_run(matrices: &[PackedMatrix], kernel: Kernel) -> Run<'_> {
    Box::new(move |i, x, m| {
        let mut out = vec![0f32; m * matrices[i].outputs()];
        matrices[i].matmul_into(x, m, &mut out, kernel);
        out
    })
}

/// One step's products (every layer's own weights, so that they stream from
/// memory as in the model), timed at each batch size: candle's `matmul`
/// against the packed kernel in each precision, and the quantized kernels
/// on the same weights in `Q8_0` and `Q4_1` (rates counted as the f32
/// product's multiply-adds).
fn products(config: &Config, batches: &[usize]) -> anyhow::Result<()> {
    let shapes = config.matmul_shapes();
    let weights: Vec<Tensor> = shapes
        .iter()
        .flat_map(|&(n, k, count)| (0..count).map(move |_| (n, k)))
        .map(|(n, k)| Tensor::randn(0f32, 0.02, (n, k), &Device::Cpu))
        .collect::<candle_core::Result<_>>()?;
    let flops_per_row: usize = weights.iter().map(|w| 2 * w.elem_count()).sum();
    let packed: Vec<(&str, Vec<PackedMatrix>)> = [("f32", DType::F32), ("f16", DType::F16), ("bf16", DType::BF16)]
        .into_iter()
        .map(|(name, dtype)| {
            let packed = weights
                .iter()
                .map(|w| PackedMatrix::from_tensor(&w.to_dtype(dtype)?))
                .collect::<candle_core::Result<Vec<_>>>()?;
            Ok((name, packed))
        })
        .collect::<candle_core::Result<_>>()?;
    println!(
        "products of one decode step ({} matrices, {:.1}M weights), GFLOP/s:\n",
        weights.len(),
        flops_per_row as f64 / 2e6
    );
    // Every SIMD kernel this CPU has on f32 (the best first), the best on the halves.
    let kernels: Vec<Kernel> = Kernel::available()
        .into_iter()
        .filter(|k| *k != Kernel::Portable)
        .collect();
    let best = *kernels.first().unwrap_or(&Kernel::Portable);
    // The same weights in GGUF's blocks.
    let blocks: Vec<(&str, Vec<QuantMatrix>)> = [
        ("Q8_0", QuantType::Q8_0, GgmlDType::Q8_0),
        ("Q4_1", QuantType::Q4_1, GgmlDType::Q4_1),
        ("Q4_K", QuantType::Q4K, GgmlDType::Q4K),
        ("Q6_K", QuantType::Q6K, GgmlDType::Q6K),
    ]
    .into_iter()
    // The K-quants where every matrix's inputs are whole super-blocks.
    .filter(|&(_, ty, _)| {
        weights
            .iter()
            .all(|w| w.dim(1).is_ok_and(|k| k.is_multiple_of(ty.block_weights())))
    })
    .map(|(name, ty, ggml)| {
        let matrices = weights
            .iter()
            .map(|w| {
                let (n, k) = w.dims2()?;
                let data = QTensor::quantize(w, ggml)?.data()?.into_owned();
                QuantMatrix::from_blocks(ty, &data, n, k, None).map_err(|e| anyhow::anyhow!("{e}"))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok((name, matrices))
    })
    .collect::<anyhow::Result<_>>()?;
    // Half precision as bf16 pairs (the models' f16 and bf16 weights where
    // the CPU multiplies bf16) on every pair kernel this CPU has.
    let pairs: Vec<PackedMatrix> = if gemm::bf16_dot_available() {
        weights
            .iter()
            .map(|w| PackedMatrix::from_tensor_dot(&w.to_dtype(DType::BF16)?))
            .collect::<candle_core::Result<_>>()?
    } else {
        Vec::new()
    };
    let mut runs: Vec<(String, Run<'_>)> = Vec::new();
    for (i, (name, matrices)) in packed.iter().enumerate() {
        if i == 0 {
            for &kernel in &kernels {
                runs.push((format!("{name} {kernel:?}"), panel_run(matrices, kernel)));
            }
        } else {
            runs.push((format!("{name} {best:?}"), panel_run(matrices, best)));
        }
    }
    // Half precision as bf16 pairs on every pair kernel this CPU has.
    for kernel in PairKernel::available()
        .into_iter()
        .filter(|k| !pairs.is_empty() && *k != PairKernel::Portable)
    {
        let pairs = &pairs;
        let run: Run<'_> = Box::new(move |i, x, m| {
            let mut out = vec![0f32; m * pairs[i].outputs()];
            pairs[i].matmul_pairs_into(x, m, &mut out, kernel);
            out
        });
        runs.push((format!("bf16 pairs {kernel:?}"), run));
    }
    // The 32-weight blocks on every quantized kernel this CPU has, the
    // K-quants on the best two.
    for (name, matrices) in &blocks {
        for kernel in QuantKernel::available()
            .into_iter()
            .filter(|k| *k != QuantKernel::Portable)
            .take(if name.ends_with("_K") { 2 } else { usize::MAX })
        {
            let run: Run<'_> = Box::new(move |i, x, m| {
                let mut out = vec![0f32; m * matrices[i].outputs()];
                matrices[i].matmul_into(x, m, &mut out, kernel);
                out
            });
            runs.push((format!("{name} {kernel:?}"), run));
        }
    }
    println!(
        "| rows | candle matmul | {} | best vs candle |",
        runs.iter().map(|r| r.0.as_str()).collect::<Vec<_>>().join(" | ")
    );
    println!("|---:|---:|{}---:|", "---:|".repeat(runs.len()));
    for &m in batches {
        let inputs: Vec<Tensor> = weights
            .iter()
            .map(|w| Tensor::randn(0f32, 1.0, (m, w.dim(1)?), &Device::Cpu))
            .collect::<candle_core::Result<_>>()?;
        let rows: Vec<Vec<f32>> = inputs
            .iter()
            .map(|x| x.flatten_all()?.to_vec1::<f32>())
            .collect::<candle_core::Result<_>>()?;
        let rate = |seconds: f64| (m * flops_per_row) as f64 / seconds / 1e9;
        // candle's better orientation at this size: x·Wᵀ, or W·xᵀ transposed back.
        let candle = best_of(3, || {
            for (w, x) in weights.iter().zip(&inputs) {
                std::hint::black_box(x.matmul(&w.t()?)?);
            }
            Ok(())
        })?
        .min(best_of(3, || {
            for (w, x) in weights.iter().zip(&inputs) {
                std::hint::black_box(w.matmul(&x.t()?)?);
            }
            Ok(())
        })?);
        let mut times = Vec::new();
        for (_, run) in &runs {
            times.push(best_of(3, || {
                for (i, x) in rows.iter().enumerate() {
                    std::hint::black_box(run(i, x, m));
                }
                Ok(())
            })?);
        }
        println!(
            "| {m} | {:.1} | {} | {:.2}x |",
            rate(candle),
            times
                .iter()
                .map(|t| format!("{:.1}", rate(*t)))
                .collect::<Vec<_>>()
                .join(" | "),
            candle / times[0]
        );
    }
    println!();
    Ok(())
}

/// The best wall time of `runs` runs of `f`, in seconds.
fn best_of(runs: usize, mut f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    let mut best = f64::MAX;
    for _ in 0..runs {
        let start = Instant::now();
        f()?;
        best = best.min(start.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// Requests of `prompt_tokens` bytes each (one token a byte on the fixtures' tokenizer), greedy, to `new_tokens`.
fn bench_requests(count: usize, prompt_tokens: usize, new_tokens: &dyn Fn(usize) -> usize) -> Vec<ValidRequest> {
    requests_of(count, &|i| bench_text(i, prompt_tokens), new_tokens)
}

/// Request `i`'s prompt text, `chars` characters.
fn bench_text(i: usize, chars: usize) -> String {
    format!("{i:04} lorem ipsum dolor sit amet consectetur ")
        .chars()
        .cycle()
        .take(chars)
        .collect()
}

/// The length of each of `count` requests' prompt text ([`bench_text`])
/// that makes `prompt_tokens` tokens on `model`'s own tokenizer (the fewest
/// characters that make that many).
fn prompt_lengths(model: &TextModel, count: usize, prompt_tokens: usize) -> anyhow::Result<Vec<usize>> {
    let mut lengths = Vec::with_capacity(count);
    for i in 0..count {
        let tokens = |chars: usize| model.encode_raw(&bench_text(i, chars)).map(|t| t.len());
        let (mut low, mut high) = (0, prompt_tokens.max(1));
        while tokens(high)? < prompt_tokens {
            (low, high) = (high, 2 * high);
        }
        while high - low > 1 {
            let mid = (low + high) / 2;
            if tokens(mid)? < prompt_tokens {
                low = mid;
            } else {
                high = mid;
            }
        }
        lengths.push(high);
    }
    Ok(lengths)
}

fn requests_of(count: usize, text: &dyn Fn(usize) -> String, new_tokens: &dyn Fn(usize) -> usize) -> Vec<ValidRequest> {
    (0..count)
        .map(|i| {
            let text = text(i);
            let body = json!({"prompt": text, "raw": true, "max_tokens": new_tokens(i), "ignore_eos": true});
            ValidRequest::parse(Task::TextGeneration, &body).expect("benchmark requests are valid")
        })
        .collect()
}

/// Serve every request at once; the wall time until the last finishes.
async fn timed(engine: &TextEngine, requests: &[ValidRequest]) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let streams: Vec<_> = requests
        .iter()
        .map(|r| engine.submit(Request::new(r.clone(), Lane::Batch)))
        .collect::<Result<_, _>>()?;
    for stream in streams {
        collect(stream).await?;
    }
    Ok(start.elapsed())
}

/// The engine as this benchmark measures it: speculation off, since it
/// measures the model's decode rate, not how often guesses are accepted.
fn bench_engine_config(max_seqs: usize, policy: Policy) -> EngineConfig {
    bench_engine_speculating(
        max_seqs,
        policy,
        SpecConfig {
            proposer: Proposer::Off,
            ..Default::default()
        },
    )
}

/// The same engine with `speculation`.
fn bench_engine_speculating(max_seqs: usize, policy: Policy, speculation: SpecConfig) -> EngineConfig {
    EngineConfig {
        max_seqs,
        rt_reserved_seqs: 0,
        rt_reserved_blocks_percent: 0,
        policy,
        // No real-time lane here: steps bounded only by the token budget, as measured before the bound.
        step_max_ms: 0.0,
        rt_step_max_ms: 0.0,
        // Each batch size runs its prompts twice (pre-fill alone, then whole):
        // the second run must compute them again for the difference to be decoding.
        prefix_cache: false,
        speculation,
        ..EngineConfig::default()
    }
}

/// `proposer`'s guesses on `engine` so far: proposed and accepted.
pub(crate) fn proposed_accepted(engine: &TextEngine, proposer: Proposer) -> (u64, u64) {
    let (proposed, accepted) = engine.counters().speculation(proposer);
    (proposed.load(Ordering::Relaxed), accepted.load(Ordering::Relaxed))
}

/// This process's resident memory in bytes (Linux), for the load line.
/// The benchmark's own buffers are freed before the model loads.
fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

fn checkpoint_bytes(path: &std::path::Path) -> u64 {
    if path.is_file() {
        return path.metadata().map(|m| m.len()).unwrap_or(0);
    }
    std::fs::read_dir(path)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// A `--products` name: `native`, `exact`, or a type to quantize the
/// projections to at load.
fn parse_products(name: &str) -> anyhow::Result<Products> {
    match name {
        "native" => Ok(Products::Native),
        "exact" => Ok(Products::Exact),
        other => QuantType::parse(other)
            .map(Products::Quantize)
            .map_err(|why| anyhow::anyhow!("--products {why}; or native, exact")),
    }
}

/// The product kernels against candle, decode rates at each batch size and
/// weight precision against the rooflines, then continuous versus static batching.
pub async fn engine(args: &EngineBenchArgs) -> anyhow::Result<()> {
    let scratch = std::env::temp_dir().join(format!("lorry-bench-model-{}", std::process::id()));
    let ways: Vec<(String, Products)> = args
        .products
        .iter()
        .map(|name| Ok((name.clone(), parse_products(name)?)))
        .collect::<anyhow::Result<_>>()?;
    let checkpoints: Vec<(String, PathBuf)> = match &args.model {
        Some(dir) => vec![("checkpoint".to_string(), dir.clone())],
        None => args
            .dtype
            .iter()
            .map(|name| {
                let dtype = fixtures::parse_dtype(name).with_context(|| format!("unknown --dtype {name}"))?;
                let dir = scratch.join(name);
                eprintln!("writing the bench fixture in {name} to {}", dir.display());
                fixtures::write_as(Fixture::Bench, &dir, dtype)?;
                Ok((name.clone(), dir))
            })
            .collect::<anyhow::Result<_>>()?,
    };
    // Each checkpoint with each of the products, named by both where both vary.
    let mut models: Vec<(String, PathBuf, Products)> = Vec::new();
    for (name, dir) in &checkpoints {
        for (how, products) in &ways {
            let label = match (checkpoints.len(), ways.len()) {
                (1, _) => how.clone(),
                (_, 1) => name.clone(),
                _ => format!("{name} {how}"),
            };
            models.push((label, dir.clone(), *products));
        }
    }
    let Some((_, first, _)) = models.first() else {
        bail!("no model to measure: give --model or at least one --dtype");
    };
    let config = lorry_engine::models::llama::Llama::config_of(first)?;
    let params = config.matmul_params() as f64;
    eprintln!("measuring the machine's ceilings");
    let ceilings = measure_ceilings(config.matmul_params() * 4)?;
    println!(
        "machine: {} threads; memory read {:.1} GB/s; f32 FMA peak {:.1} GFLOP/s; candle matmul 2048^3 {:.1} GFLOP/s",
        rayon::current_num_threads(),
        ceilings.bandwidth / 1e9,
        ceilings.peak_flops / 1e9,
        ceilings.gemm_flops / 1e9
    );
    println!(
        "model: {:.1}M matmul parameters; kernel: {}\n",
        params / 1e6,
        match Kernel::best() {
            Kernel::Avx512 => "AVX2/FMA/F16C with AVX-512VL's 32 registers",
            Kernel::Avx2 => "AVX2/FMA/F16C",
            _ => "portable",
        }
    );
    eprintln!("timing the products");
    products(&config, &args.batch)?;
    let compute_roof = ceilings.peak_flops.max(ceilings.gemm_flops);
    let compare = args.speculation == "compare";
    let mut compared: Vec<String> = Vec::new();
    println!(
        "| weights | batch | decode tok/s | ms/step | memory roofline tok/s | compute roofline tok/s | of roofline | vs batch 1 | prompt tok/s |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut reference = None;
    let mut loads = Vec::new();
    for (name, dir, products) in &models {
        let started = Instant::now();
        let model = TextModel::open_with(dir, &Device::Cpu, *products)?;
        let seconds = started.elapsed().as_secs_f64();
        loads.push(format!(
            "{name}: {seconds:.2} s; {:.0} MB of checkpoint, {:.0} MB of projection weights as served ({} bytes each), process resident {:.0} MB",
            checkpoint_bytes(dir) as f64 / 1e6,
            params * model.model.weight_bytes_per_param() / 1e6,
            model.model.weight_bytes_per_param(),
            resident_bytes().unwrap_or(0) as f64 / 1e6
        ));
        let weight_bytes = params * model.model.weight_bytes_per_param();
        let max_batch = args.batch.iter().copied().max().unwrap_or(1);
        let engine = TextEngine::start(
            "bench",
            model.clone(),
            bench_engine_config(max_batch, Policy::Continuous),
        );
        // With `--speculation compare`: prompt lookup in every step and under
        // the measured policy, and a second engine without speculation (what
        // two identical engines differ by on this machine).
        let beside: Vec<TextEngine> = [
            (Proposer::Off, SpecPolicy::Measured),
            (Proposer::Ngram, SpecPolicy::Always),
            (Proposer::Ngram, SpecPolicy::Measured),
        ]
        .into_iter()
        .filter(|_| compare)
        .map(|(proposer, policy)| {
            let speculation = SpecConfig {
                proposer,
                max_batch: Some(usize::MAX),
                policy,
                ..Default::default()
            };
            TextEngine::start(
                "bench",
                model.clone(),
                bench_engine_speculating(max_batch, Policy::Continuous, speculation),
            )
        })
        .collect();
        // Prompts of `--prompt-tokens` on this model's tokenizer, found once.
        let lengths = prompt_lengths(&model, max_batch, args.prompt_tokens)?;
        let text = |i: usize| match args.prompts.as_str() {
            "questions" => question(i),
            _ => bench_text(i, lengths[i]),
        };
        let requests = |count: usize, new_tokens: usize| requests_of(count, &text, &|_| new_tokens);
        // What a decoding step reads besides the weights: each row's keys
        // and values (f32) at every position it sees, in every layer; on
        // average over the decode, its prompt and half its new tokens.
        let shape = model.model.config();
        let kv_per_position = (shape.num_layers * shape.num_kv_heads * shape.head_dim * 2 * 4) as f64;
        let kv_bytes: Vec<f64> = (0..max_batch)
            .map(|i| Ok(kv_per_position * (model.encode_raw(&text(i))?.len() as f64 + args.new_tokens as f64 / 2.0)))
            .collect::<anyhow::Result<_>>()?;
        loads.last_mut().expect("pushed above").push_str(&format!(
            ", the KV cache's reads a decoding step {:.1} MB a row",
            kv_bytes[0] / 1e6
        ));
        for engine in std::iter::once(&engine).chain(&beside) {
            timed(engine, &requests(1, 2)).await?; // warm up
        }
        let steps = (args.new_tokens - 1) as f64;
        // Decode seconds of `batch` sequences: a whole run less its pre-fill alone.
        let decode_seconds = |engine: &TextEngine, batch: usize| {
            let engine = engine.clone();
            let (prefill, whole) = (requests(batch, 1), requests(batch, args.new_tokens));
            async move {
                let prefill = timed(&engine, &prefill).await?;
                let total = timed(&engine, &whole).await?;
                anyhow::Ok((prefill, total.saturating_sub(prefill).as_secs_f64()))
            }
        };
        // Read between the decode runs; made after the loading line's
        // resident memory was read, and dropped with the model.
        let probe = MemoryProbe::new(config.matmul_params() * 4);
        let mut batch_one = None;
        for &batch in &args.batch {
            let step_bytes = weight_bytes + kv_bytes[..batch].iter().sum::<f64>();
            let compute_roof = compute_roof / (2.0 * params);
            // Each run: its pre-fill and decode seconds, and its memory
            // roofline from the better of the reads either side of it.
            let mut runs = Vec::new();
            for _ in 0..args.repeat.max(1) {
                let before = probe.rate(3);
                let (prefill, decode) = decode_seconds(&engine, batch).await?;
                let bandwidth = before.max(probe.rate(3));
                runs.push((prefill, decode, batch as f64 * bandwidth / step_bytes));
            }
            // Each run's share of its roofline (none without decode figures).
            let share = |&(_, decode, memory_roof): &(Duration, f64, f64)| {
                let rate = batch as f64 * steps / decode;
                (decode > 0.0).then(|| rate / memory_roof.min(compute_roof))
            };
            runs.sort_by(|a, b| share(a).unwrap_or(0.0).total_cmp(&share(b).unwrap_or(0.0)));
            let shares: Vec<f64> = runs.iter().filter_map(share).collect();
            let (_, decode, memory_roof) = runs[runs.len() / 2];
            let mut prefills: Vec<Duration> = runs.iter().map(|r| r.0).collect();
            prefills.sort();
            let prefill = prefills[prefills.len() / 2];
            if compare {
                // Rounds of the four in turn (each round starting one later),
                // each round's times against its own engine without speculation.
                let engines: Vec<&TextEngine> = std::iter::once(&engine).chain(&beside).collect();
                let mut ratios = vec![Vec::new(); beside.len()];
                let mut plain = Vec::new();
                let mut counts = vec![(0, 0); beside.len()];
                for round in 0..args.rounds.max(1) {
                    let mut seconds = vec![0.0; engines.len()];
                    for turn in 0..engines.len() {
                        let i = (round + turn) % engines.len();
                        let before = proposed_accepted(engines[i], Proposer::Ngram);
                        seconds[i] = decode_seconds(engines[i], batch).await?.1;
                        if i > 0 {
                            let after = proposed_accepted(engines[i], Proposer::Ngram);
                            let c = &mut counts[i - 1];
                            (c.0, c.1) = (c.0 + after.0 - before.0, c.1 + after.1 - before.1);
                        }
                    }
                    plain.push(batch as f64 * steps / seconds[0]);
                    for (i, ratio) in ratios.iter_mut().enumerate() {
                        ratio.push(seconds[0] / seconds[i + 1]);
                    }
                }
                // Sorted: the median, lowest and highest.
                let sorted = |mut values: Vec<f64>| {
                    values.sort_by(f64::total_cmp);
                    (values[values.len() / 2], values[0], values[values.len() - 1])
                };
                let mut row = format!("| {name} | {batch} | {:.1} |", sorted(plain).0);
                // The second engine without speculation has no guesses column.
                for (i, (ratio, (proposed, accepted))) in ratios.into_iter().zip(&counts).enumerate() {
                    let (median, low, high) = sorted(ratio);
                    row += &format!(" {median:.3}x ({low:.3}–{high:.3}) |");
                    if i > 0 {
                        row += &format!(" {accepted} of {proposed} |");
                    }
                }
                compared.push(row);
            }
            // With a few steps of decoding (`--new-tokens 2`, for the prompt's
            // rate) the two runs' difference is mostly noise, or nothing: no
            // decode figures then.
            let decoded = if decode > 0.0 && steps >= 8.0 {
                let rate = batch as f64 * steps / decode;
                let speedup = rate / *batch_one.get_or_insert(rate);
                let range = match shares.as_slice() {
                    [low, .., high] => format!(" ({:.0}–{:.0}%)", 100.0 * low, 100.0 * high),
                    _ => String::new(),
                };
                format!(
                    "{rate:.1} | {:.1} | {memory_roof:.1} | {compute_roof:.1} | {:.0}%{range} | {speedup:.1}x",
                    1e3 * decode / steps,
                    100.0 * rate / memory_roof.min(compute_roof)
                )
            } else {
                format!("– | – | {memory_roof:.1} | {compute_roof:.1} | – | –")
            };
            println!(
                "| {name} | {batch} | {decoded} | {:.1} |",
                (batch * args.prompt_tokens) as f64 / prefill.as_secs_f64()
            );
        }
        drop(engine);
        drop(beside);
        reference.get_or_insert(model);
    }
    println!(
        "\nloading (reading the checkpoint, dequantizing, packing the panels): {}",
        loads.join(", ")
    );
    if args.tail_requests > 0 {
        if let Some(model) = &reference {
            continuous_versus_static(model, args).await?;
        }
    }
    println!("(speculation off: this measures the model's decode rate)");
    if args.repeat > 1 {
        println!(
            "({} decode runs at each batch size, the memory's read rate measured just before and after each, the \
             better of the two its roofline: the run whose share of its roofline is the median, the range of the \
             runs' shares beside it; the prompt's rate the median of the runs')",
            args.repeat
        );
    }
    if compare {
        println!(
            "\nSpeculation against none, decode tok/s: {} rounds of four engines in turn on the same prompts, each \
             round's time without speculation over each engine's; median (lowest–highest). `again`: a second \
             engine without speculation, what two identical engines differ by here. `every step`: prompt lookup \
             guessing in every step. `measured`: prompt lookup under the measured policy, the service's default. \
             Guesses kept: of those made, all rounds.\n",
            args.rounds.max(1)
        );
        println!(
            "| weights | batch | off tok/s | again / off | every step / off | guesses kept | measured / off | guesses kept |"
        );
        println!("|---|---:|---:|---:|---:|---:|---:|---:|");
        for row in &compared {
            println!("{row}");
        }
    }
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(())
}

/// Long-tailed output lengths (log-normal, median 20 tokens, capped at 512), served both ways.
async fn continuous_versus_static(model: &TextModel, args: &EngineBenchArgs) -> anyhow::Result<()> {
    let mut rng = lorry_engine::runtime::rng::SplitMix::new(7);
    let lengths: Vec<usize> = (0..args.tail_requests)
        .map(|_| ((3.0 + rng.normal()).exp().round() as usize).clamp(4, 512))
        .collect();
    let requests = bench_requests(args.tail_requests, args.prompt_tokens, &|i| lengths[i]);
    let tokens: usize = lengths.iter().sum();
    let longest = lengths.iter().max().copied().unwrap_or(0);
    println!(
        "\n{} requests, {tokens} tokens to generate (longest {longest}), at most {} at once\n",
        args.tail_requests, args.tail_batch
    );
    println!("| batching | wall s | tok/s (requested tokens) | steps | continuous is faster by |");
    println!("|---|---:|---:|---:|---:|");
    // A step budget that pre-fills a whole batch at once, as static batching does.
    let config = |policy| EngineConfig {
        token_budget: args.tail_batch * args.prompt_tokens,
        ..bench_engine_config(args.tail_batch, policy)
    };
    let mut runs = Vec::new();
    // Fixed-shape static batching (a padded batch, as `generate` in transformers
    // runs one): every row of a batch is computed until its longest request ends.
    let engine = TextEngine::start("bench", model.clone(), config(Policy::Continuous));
    let mut wall = 0.0;
    for wave in (0..args.tail_requests).collect::<Vec<_>>().chunks(args.tail_batch) {
        let longest = wave.iter().map(|&i| lengths[i]).max().unwrap_or(1);
        let padded = bench_requests(wave.len(), args.prompt_tokens, &|_| longest);
        wall += timed(&engine, &padded).await?.as_secs_f64();
    }
    runs.push((
        "static, fixed-shape batches",
        wall,
        engine.counters().steps.load(Ordering::Relaxed),
    ));
    drop(engine);
    for (name, policy) in [
        ("static, finished rows leave", Policy::Static),
        ("continuous", Policy::Continuous),
    ] {
        let engine = TextEngine::start("bench", model.clone(), config(policy));
        let wall = timed(&engine, &requests).await?.as_secs_f64();
        runs.push((name, wall, engine.counters().steps.load(Ordering::Relaxed)));
    }
    let continuous = runs[2].1;
    for (name, wall, steps) in runs {
        println!(
            "| {name} | {wall:.2} | {:.1} | {steps} | {:.2}x |",
            tokens as f64 / wall,
            wall / continuous
        );
    }
    Ok(())
}

/// `lorry bench lora`: what to measure.
#[derive(clap::Args, Debug, Clone)]
pub struct LoraBenchArgs {
    /// A Llama-family checkpoint; the `bench` fixture (f32), written to a temporary directory, when absent.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Sequences decoding at once, each with its own adapter in the mixed run.
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// Adapter rank, on all seven projections.
    #[arg(long, default_value_t = 16)]
    pub rank: usize,
    /// The adapters' weight precision: f32, f16 or bf16.
    #[arg(long, default_value = "f32")]
    pub adapter_dtype: String,
    /// The base's products (as `lorry bench engine --products`): `native`
    /// (a GGUF file's quantized blocks as they are, other weights in their
    /// own precision), `exact`, or `q8_0`, `q4_1`, `q4_0`, `q4_k`, `q5_k`,
    /// `q6_k`: the projections quantized at load, as `--quantize`.
    #[arg(long, default_value = "native")]
    pub products: String,
    /// Prompt length, in tokens.
    #[arg(long, default_value_t = 32)]
    pub prompt_tokens: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 64)]
    pub new_tokens: usize,
    /// Rounds of the no-adapter, shared and mixed runs, interleaved; each run's best is kept.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Cold loads of a rank-`rank` adapter from S3 (`LORRY_S3_ENDPOINT` and
    /// the AWS keys, as `lorry serve` reads them) to time; 0 skips them.
    #[arg(long, default_value_t = 40)]
    pub cold_loads: usize,
}

/// A random rank-`rank` adapter on every projection of every layer (seeded),
/// its weights as stored in `precision`.
pub(crate) fn random_adapter(config: &Config, rank: usize, precision: Precision, seed: u64) -> Adapter {
    let mut rng = lorry_engine::runtime::rng::SplitMix::new(seed);
    let round = move |v: f32| match precision {
        Precision::F32 => v,
        Precision::F16 => half::f16::from_f32(v).to_f32(),
        Precision::Bf16 => half::bf16::from_f32(v).to_f32(),
    };
    let mut values = |n: usize, std: f64| -> Vec<f32> { (0..n).map(|_| round((std * rng.normal()) as f32)).collect() };
    let mut modules = std::collections::BTreeMap::new();
    for layer in 0..config.num_layers {
        for target in Target::ALL {
            let (out, inputs) = target.shape(&config.adapter_shape());
            let weights = LoraWeights {
                rank,
                scale: 2.0,
                a: values(rank * inputs, 0.02),
                b: values(out * rank, 0.02),
                precision,
            };
            modules.insert((layer, target), weights);
        }
    }
    Adapter { modules }
}

/// Serve `requests` (each with its adapter) at once; the decode rate, pre-fill left out.
/// Decode tokens a second, and the tokens each request got: the bench's
/// requests `first..` at once, request `first + i` with `adapters[i]`.
async fn decode_rate(
    engine: &TextEngine,
    args: &LoraBenchArgs,
    first: usize,
    adapters: &[Option<AdapterRef>],
) -> anyhow::Result<(f64, Vec<Vec<u32>>)> {
    let run = |new_tokens: usize| {
        let mut requests = bench_requests(first + adapters.len(), args.prompt_tokens, &|_| new_tokens);
        let requests = requests.split_off(first);
        async move {
            let start = Instant::now();
            let streams: Vec<_> = requests
                .into_iter()
                .zip(adapters)
                .map(|(r, a)| engine.submit(Request::new(r, Lane::Batch).with_adapter(a.clone())))
                .collect::<Result<_, _>>()?;
            let mut tokens = Vec::new();
            for stream in streams {
                tokens.push(
                    collect(stream)
                        .await?
                        .completion
                        .map(|c| c.token_ids)
                        .unwrap_or_default(),
                );
            }
            anyhow::Ok((start.elapsed(), tokens))
        }
    };
    let (prefill, _) = run(1).await?;
    let (total, tokens) = run(args.new_tokens).await?;
    let decode = total.saturating_sub(prefill).as_secs_f64();
    Ok((adapters.len() as f64 * (args.new_tokens - 1) as f64 / decode, tokens))
}

/// Decode steps of each kind timed in [`step_times`].
const STEP_ROUNDS: usize = 60;

/// The model's decode step alone, without the engine around it: `batch`
/// rows with no adapter, with `adapters[0]` shared, and with a distinct
/// adapter each, one step of each kind in turn, `STEP_ROUNDS` times. Steps
/// of one round see the same machine, so each round's ratios hold where its
/// speed drifts; their medians are reported.
fn step_times<'a>(
    model: &lorry_engine::models::llama::Llama,
    args: &LoraBenchArgs,
    adapters: &'a [Arc<PackedAdapter>],
) -> anyhow::Result<StepTimes> {
    use lorry_engine::models::llama::SeqChunk;
    use lorry_engine::runtime::kv::{BlockPool, BlockTable, KvCache};
    let (n, prompt) = (args.batch, args.prompt_tokens.max(1));
    let block = 16;
    let blocks = n * (prompt + 1).div_ceil(block);
    let mut pool = BlockPool::new(blocks as u32, block);
    let mut kv = KvCache::new(model.kv_layout(block), blocks);
    let mut tables = Vec::new();
    for _ in 0..n {
        let mut table = BlockTable::default();
        table
            .append(&mut pool, prompt + 1)
            .context("the pool was sized to fit")?;
        tables.push(table);
    }
    let tokens: Vec<u32> = (0..prompt as u32).map(|t| 3 + t % 200).collect();
    // The prompts, or one step after them.
    let chunks = |adapters: Vec<Option<&'a PackedAdapter>>, step: bool| -> Vec<SeqChunk<'_>> {
        tables
            .iter()
            .zip(adapters)
            .map(|(table, adapter)| SeqChunk {
                tokens: if step { &tokens[..1] } else { &tokens },
                start: if step { prompt } else { 0 },
                blocks: table.blocks(),
                logits: 1,
                adapter,
            })
            .collect()
    };
    // Each pass on one of the pool's threads with the others kept awake, as
    // the engine runs it (`hot_pass`), not from outside the pool.
    let mut forward = |batch: &[SeqChunk<'_>]| lorry_engine::ops::hot_pass(|| model.forward_batch(batch, &mut kv));
    forward(&chunks(vec![None; n], false))?;
    let kinds: [Vec<Option<&'a PackedAdapter>>; 3] = [
        vec![None; n],
        vec![Some(&*adapters[0]); n],
        (0..n).map(|i| Some(&*adapters[i % adapters.len()])).collect(),
    ];
    // Steps in turn, each round's ratios taken within the round.
    let mut times = [Vec::new(), Vec::new(), Vec::new()];
    for round in 0..=STEP_ROUNDS {
        for (kind, times) in kinds.iter().zip(&mut times) {
            let batch = chunks(kind.clone(), true);
            let start = Instant::now();
            forward(&batch)?;
            if round > 0 {
                times.push(start.elapsed().as_secs_f64());
            }
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let ratios = |kind: usize| median(times[0].iter().zip(&times[kind]).map(|(none, t)| none / t).collect());
    Ok(StepTimes {
        none: median(times[0].clone()),
        shared: median(times[1].clone()),
        mixed: median(times[2].clone()),
        shared_ratio: ratios(1),
        mixed_ratio: ratios(2),
    })
}

/// [`step_times`]' figures: median seconds a step, and the median of each
/// round's ratio to the step without adapters.
struct StepTimes {
    none: f64,
    shared: f64,
    mixed: f64,
    shared_ratio: f64,
    mixed_ratio: f64,
}

/// No adapter, one shared adapter, a distinct adapter per sequence in one
/// batch, and the same adapters served group by group.
pub async fn lora(args: &LoraBenchArgs) -> anyhow::Result<()> {
    let scratch = std::env::temp_dir().join(format!("lorry-bench-lora-{}", std::process::id()));
    let dir = match &args.model {
        Some(dir) => dir.clone(),
        None => {
            eprintln!("writing the bench fixture to {}", scratch.display());
            fixtures::write(Fixture::Bench, &scratch)?;
            scratch.clone()
        }
    };
    let model = TextModel::open_with(&dir, &Device::Cpu, parse_products(&args.products)?)?;
    let config = model.model.config().clone();
    let model_bytes_per_param = model.model.weight_bytes_per_param();
    let precision = fixtures::parse_dtype(&args.adapter_dtype)
        .map(gemm::precision_of)
        .with_context(|| format!("unknown --adapter-dtype {}", args.adapter_dtype))?;
    eprintln!("making {} random rank-{} adapters", args.batch, args.rank);
    let random: Vec<Adapter> = (0..args.batch)
        .map(|i| random_adapter(&config, args.rank, precision, 1000 + i as u64))
        .collect();
    let adapters: Vec<Arc<PackedAdapter>> = random.iter().map(|a| Arc::new(PackedAdapter::new(a))).collect();
    // The engine loads them as a worker does, from their PEFT files.
    let files = adapter_files(&random, &scratch.join("adapters"))?;
    let llama = model.model.clone();
    // Speculation off: every step decodes one token a sequence, so the runs
    // differ only in their adapters (prompt lookup would accept more or
    // fewer guesses as the adapters change the text). The prefix cache off:
    // a decode rate subtracts a pre-fill-only run from a full one, and both
    // must compute the same pre-fill (with the cache on, whichever came first
    // for a prompt and adapter computed it and the other reused it).
    let engine_config = EngineConfig {
        prefix_cache: false,
        ..bench_engine_config(args.batch, Policy::Continuous)
    };
    let engine = TextEngine::start("bench", model, engine_config).with_adapters(local_adapters());
    decode_rate(&engine, args, 0, &[None]).await?; // warm up
    let n = args.batch;
    let mixed_adapters: Vec<_> = files.iter().cloned().map(Some).collect();
    // Every adapter resident before the timed runs.
    decode_rate(&engine, args, 0, &mixed_adapters).await?;
    // Rounds of the three runs, interleaved, keeping each one's best: a
    // machine whose speed drifts moves all three alike.
    let (mut none, mut shared, mut mixed) = (0f64, 0f64, 0f64);
    let (mut base_tokens, mut mixed_tokens) = (Vec::new(), Vec::new());
    for round in 0..args.rounds.max(1) {
        eprintln!("round {}/{}", round + 1, args.rounds.max(1));
        let (rate, tokens) = decode_rate(&engine, args, 0, &vec![None; n]).await?;
        (none, base_tokens) = (none.max(rate), tokens);
        shared = shared.max(decode_rate(&engine, args, 0, &vec![Some(files[0].clone()); n]).await?.0);
        let (rate, tokens) = decode_rate(&engine, args, 0, &mixed_adapters).await?;
        (mixed, mixed_tokens) = (mixed.max(rate), tokens);
    }
    // Group by group: each adapter's requests (here one each) as their own batch, one after another.
    let mut tokens = 0.0;
    let mut seconds = 0.0;
    let mut alone_tokens = Vec::new();
    for (i, adapter) in mixed_adapters.iter().enumerate() {
        let (rate, mut got) = decode_rate(&engine, args, i, std::slice::from_ref(adapter)).await?;
        tokens += (args.new_tokens - 1) as f64;
        seconds += (args.new_tokens - 1) as f64 / rate;
        alone_tokens.push(got.pop().unwrap_or_default());
    }
    let grouped = tokens / seconds;
    // The mixed batch decoded each sequence as its adapter alone does (the
    // group-by-group run of the same prompt), and not as the base model does.
    let same_as_alone = mixed_tokens.iter().zip(&alone_tokens).filter(|(a, b)| a == b).count();
    let changed = mixed_tokens.iter().zip(&base_tokens).filter(|(a, b)| a != b).count();
    println!(
        "{}, {} products, {n} sequences, rank {} on q/k/v/o/gate/up/down, {} adapter weights, {} new tokens each, best of {} rounds\n",
        args.model.as_ref().map_or("bench model".to_string(), |m| m.display().to_string()),
        args.products,
        args.rank,
        args.adapter_dtype,
        args.new_tokens,
        args.rounds.max(1)
    );
    println!("| run | decode tok/s | vs no adapter |");
    println!("|---|---:|---:|");
    for (name, rate) in [
        ("no adapter".to_string(), none),
        ("one shared adapter".to_string(), shared),
        (format!("{n} distinct adapters in one batch"), mixed),
        (format!("the same {n}, group by group"), grouped),
    ] {
        println!("| {name} | {rate:.1} | {:.2}x |", rate / none);
    }
    println!("\nmixed against group by group: {:.2}x", mixed / grouped);
    println!(
        "tokens of the mixed batch: {same_as_alone} of {n} sequences as their adapter alone gives them, {changed} of {n} unlike the base model's"
    );
    let steps = step_times(&llama, args, &adapters)?;
    println!(
        "one decode step of {n} rows alone, steps of each kind in turn, medians of {STEP_ROUNDS} rounds: no adapter {:.1} ms, one shared {:.1} ms ({:.2}x), {n} distinct {:.1} ms ({:.2}x)",
        steps.none * 1e3,
        steps.shared * 1e3,
        steps.shared_ratio,
        steps.mixed * 1e3,
        steps.mixed_ratio,
    );
    // The most the mixed run could keep: the base step as measured, plus
    // reading every distinct adapter's weights once at the machine's memory rate.
    let bandwidth = measure_ceilings(config.matmul_params() * 4)?.bandwidth;
    let adapter_bytes: usize = adapters.iter().map(|a| a.bytes()).sum();
    let step = n as f64 / none;
    let ceiling = step / (step + adapter_bytes as f64 / bandwidth);
    println!(
        "the {n} adapters hold {:.0} MB against {:.0} MB of base weights; read once a step at {:.1} GB/s on top of the base step ({:.1} ms), the mixed run could keep at most {ceiling:.2}x",
        adapter_bytes as f64 / 1e6,
        config.matmul_params() as f64 * model_bytes_per_param / 1e6,
        bandwidth / 1e9,
        step * 1e3
    );
    if args.cold_loads > 0 {
        let adapter = random_adapter(&config, args.rank, precision, 7);
        if let Err(e) = cold_loads(args, &engine, &config, &adapter, none, &scratch).await {
            println!("\ncold loads from S3 skipped: {e:#}");
        }
    }
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(())
}

/// `adapter` as PEFT writes it: `adapter_config.json` and `adapter_model.safetensors`.
fn peft_files(adapter: &Adapter, dir: &std::path::Path) -> anyhow::Result<(Vec<u8>, Vec<u8>)> {
    let mut tensors = std::collections::HashMap::new();
    let mut rank = 0;
    for ((layer, target), m) in &adapter.modules {
        rank = m.rank;
        let dtype = match m.precision {
            Precision::F32 => DType::F32,
            Precision::F16 => DType::F16,
            Precision::Bf16 => DType::BF16,
        };
        let inputs = m.a.len() / m.rank;
        let outputs = m.b.len() / m.rank;
        let name = |half: &str| {
            format!(
                "base_model.model.model.layers.{layer}.{}.{}.lora_{half}.weight",
                target.block(),
                target.name()
            )
        };
        let a = Tensor::from_vec(m.a.clone(), (m.rank, inputs), &Device::Cpu)?.to_dtype(dtype)?;
        let b = Tensor::from_vec(m.b.clone(), (outputs, m.rank), &Device::Cpu)?.to_dtype(dtype)?;
        tensors.insert(name("A"), a);
        tensors.insert(name("B"), b);
    }
    std::fs::create_dir_all(dir)?;
    let path = dir.join("adapter_model.safetensors");
    candle_core::safetensors::save(&tensors, &path)?;
    let targets: Vec<&str> = Target::ALL.iter().map(|t| t.name()).collect();
    let config = json!({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets});
    Ok((serde_json::to_vec(&config)?, std::fs::read(&path)?))
}

/// `adapters` written as PEFT files, one directory each under `dir`; the
/// engine's references to them.
pub(crate) fn adapter_files(adapters: &[Adapter], dir: &std::path::Path) -> anyhow::Result<Vec<AdapterRef>> {
    adapters
        .iter()
        .enumerate()
        .map(|(i, adapter)| {
            let at = dir.join(i.to_string());
            let (config, _) = peft_files(adapter, &at)?;
            std::fs::write(at.join("adapter_config.json"), config)?;
            Ok(AdapterRef::local(&at)?)
        })
        .collect()
}

/// Adapters loaded from local files, every one the benchmarks make kept resident.
pub(crate) fn local_adapters() -> Adapters {
    Adapters::new(
        Arc::new(LocalFiles),
        AdaptersConfig {
            resident_bytes: 1 << 40,
            limits: AdapterLimits {
                max_rank: 256,
                max_bytes: 1 << 40,
            },
            ..AdaptersConfig::default()
        },
    )
}

pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    let at = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[at.min(sorted.len() - 1)]
}

/// Cold loads through the engine's adapter manager over the worker's tiers (S3 → check → pack, no
/// disk or memory copy to help), then the base model's decode rate while
/// loads run beside it.
async fn cold_loads(
    args: &LoraBenchArgs,
    engine: &TextEngine,
    config: &Config,
    adapter: &Adapter,
    base_rate: f64,
    scratch: &std::path::Path,
) -> anyhow::Result<()> {
    use lorry_batcher::adapters::{reference, AdapterTiers, TiersConfig};
    use lorry_batcher::ids::{AccountId, AdapterId};
    use lorry_batcher::objects::{adapter_key, ObjectStore, ObjectStoreConfig};
    use lorry_batcher::store::AdapterRecord;

    let settings = lorry::Settings::from_env()?;
    let objects = ObjectStore::new(&ObjectStoreConfig {
        bucket: format!("lorry-bench-{}", std::process::id()),
        ..settings.object_store()
    });
    objects.ensure_bucket().await.context("reaching S3")?;
    let (config_file, weights) = peft_files(adapter, &scratch.join("adapter"))?;
    let account = AccountId("bench".into());
    let mut records = Vec::new();
    // Each load is of a distinct adapter (its own id and objects), so nothing is cached.
    for _ in 0..args.cold_loads * 2 {
        let id = AdapterId::generate();
        let (config_key, weights_key) = (
            adapter_key(&account, &id, "adapter_config.json"),
            adapter_key(&account, &id, "adapter_model.safetensors"),
        );
        objects
            .put(&config_key, config_file.clone(), "application/json")
            .await?;
        objects
            .put(&weights_key, weights.clone(), "application/octet-stream")
            .await?;
        let now = chrono::Utc::now();
        records.push(AdapterRecord {
            id,
            account_id: account.clone(),
            name: String::new(),
            model: "bench".into(),
            description: String::new(),
            ready: true,
            config_key: Some(config_key),
            weights_key: Some(weights_key),
            weights_bytes: Some(weights.len() as i64),
            weights_sha256: None,
            rank: Some(args.rank as i32),
            targets: vec![],
            created_at: now,
            modified_at: now,
        });
    }
    // Nothing kept in memory or on disk: every load comes from S3.
    let tiers = AdapterTiers::new(
        objects.clone(),
        TiersConfig {
            host_bytes: 0,
            disk_dir: None,
            ..TiersConfig::default()
        },
    );
    let cache = Adapters::new(
        Arc::new(tiers),
        AdaptersConfig {
            resident_bytes: 64 * weights.len(),
            ..AdaptersConfig::default()
        },
    );
    let (timed, beside) = records.split_at(args.cold_loads);
    let mut fetch = Vec::new();
    for record in timed {
        let start = Instant::now();
        objects.get(record.weights_key.as_deref().unwrap_or_default()).await?;
        fetch.push(start.elapsed().as_secs_f64());
        drop(cache.acquire(&reference(record)?, &config.adapter_shape()).await?);
    }
    let mut loads = cache.stats().load_seconds;
    loads.sort_by(f64::total_cmp);
    fetch.sort_by(f64::total_cmp);

    // The base model decodes while adapters load one after another beside it.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let loader = tokio::spawn({
        let (cache, config, stop) = (cache.clone(), config.clone(), Arc::clone(&stop));
        let beside = beside.to_vec();
        async move {
            let mut done = 0;
            for record in beside.iter().cycle() {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                // Evict it again so every load is cold.
                let fresh = AdapterRecord {
                    modified_at: chrono::Utc::now(),
                    ..record.clone()
                };
                let loaded = match reference(&fresh) {
                    Ok(fresh) => cache.acquire(&fresh, &config.adapter_shape()).await.is_ok(),
                    Err(_) => false,
                };
                if loaded {
                    done += 1;
                }
            }
            done
        }
    });
    let n = args.batch;
    let start = Instant::now();
    let loading_rate = decode_rate(engine, args, 0, &vec![None; n]).await?.0;
    let seconds = start.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let loaded = loader.await?;
    // Alone again, right after: the machine's speed drifts between the runs above.
    let base_rate = base_rate.max(decode_rate(engine, args, 0, &vec![None; n]).await?.0);
    let mb = weights.len() as f64 / 1e6;
    println!(
        "\ncold load of a {mb:.1} MB rank-{} adapter ({}) from S3, {} loads, one at a time:\n",
        args.rank, args.adapter_dtype, args.cold_loads
    );
    println!("| | p50 ms | p99 ms |");
    println!("|---|---:|---:|");
    println!(
        "| S3 GET of the weights | {:.1} | {:.1} |",
        1e3 * percentile(&fetch, 0.5),
        1e3 * percentile(&fetch, 0.99)
    );
    println!(
        "| cold load (GET both files, check, pack) | {:.1} | {:.1} |",
        1e3 * percentile(&loads, 0.5),
        1e3 * percentile(&loads, 0.99)
    );
    println!(
        "\nbase decode, {n} sequences: {base_rate:.1} tok/s alone (best of before and after), {loading_rate:.1} tok/s while {loaded} adapters loaded beside it in {seconds:.1} s ({:.2}x)",
        loading_rate / base_rate
    );
    Ok(())
}
