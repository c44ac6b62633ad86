//! Lorry's offline modes: JSONL in, JSONL out, on one engine in this process.

use std::io::{BufRead, BufWriter, Write};
use std::path::PathBuf;

use anyhow::{bail, Context as _};
use candle_core::Device;
use indicatif::{ProgressBar, ProgressStyle};
use lorry_engine::chat::TextModel;
use lorry_engine::embedding::Embedder;
use lorry_engine::models::bert::Pooling;
use lorry_engine::{Task, ValidRequest};
use serde::Deserialize;
use serde_json::json;

/// `lorry generate`.
#[derive(clap::Args, Debug, Clone)]
pub struct GenerateArgs {
    /// A Llama-family checkpoint directory.
    #[arg(long)]
    pub model: PathBuf,
    /// `NAME=DIR`: a LoRA adapter to serve (arrives with multi-LoRA).
    #[arg(long)]
    pub adapter: Vec<String>,
    /// JSONL: `{"id", "prompt" | "messages", "raw", "adapter", "max_tokens", "temperature",
    /// "top_p", "top_k", "seed", "stop", "ignore_eos"}` per line.
    #[arg(long)]
    pub input: PathBuf,
    /// JSONL: `{"id", "token_ids", "text", "finish_reason", "usage"}` per line, in input order.
    #[arg(long)]
    pub output: PathBuf,
}

/// Generate for every line of the input.
pub fn generate(args: &GenerateArgs) -> anyhow::Result<()> {
    if !args.adapter.is_empty() {
        bail!("--adapter: LoRA adapters are not served yet; they arrive with multi-LoRA support");
    }
    let lines: Vec<serde_json::Value> = read_lines(&args.input)?;
    let mut requests = Vec::with_capacity(lines.len());
    for (n, mut line) in lines.into_iter().enumerate() {
        let object = line
            .as_object_mut()
            .with_context(|| format!("request {}: not a JSON object", n + 1))?;
        let id = object.remove("id").unwrap_or(serde_json::Value::Null);
        match object.remove("adapter") {
            None | Some(serde_json::Value::Null) => {}
            Some(_) => bail!("request {id}: adapters are not served yet; they arrive with multi-LoRA support"),
        }
        let request = ValidRequest::parse(Task::TextGeneration, &line)
            .map_err(|e| anyhow::anyhow!("request {id}: {} ({}: {})", e.message, e.code, e.param))?;
        requests.push((id, request));
    }
    let model =
        TextModel::from_dir(&args.model, &Device::Cpu).with_context(|| format!("loading {}", args.model.display()))?;
    let out = std::fs::File::create(&args.output).with_context(|| format!("creating {}", args.output.display()))?;
    let mut out = BufWriter::new(out);
    let bar = progress(requests.len(), "generate");
    for (id, request) in requests {
        let g = model.generate(&request).with_context(|| format!("request {id}"))?;
        let usage = json!({"prompt_tokens": g.prompt_tokens, "completion_tokens": g.token_ids.len()});
        let line = json!({"id": id, "token_ids": g.token_ids, "text": g.text, "finish_reason": g.finish_reason, "usage": usage});
        serde_json::to_writer(&mut out, &line)?;
        out.write_all(b"\n")?;
        bar.inc(1);
    }
    bar.finish();
    out.flush()?;
    Ok(())
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
fn read_lines<T: for<'de> Deserialize<'de>>(path: &PathBuf) -> anyhow::Result<Vec<T>> {
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
