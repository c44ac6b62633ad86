//! Lorry's offline modes: JSONL in, JSONL out, on one engine in this process.

use std::io::{BufRead, BufWriter, Write};
use std::path::PathBuf;

use anyhow::{bail, Context as _};
use candle_core::Device;
use indicatif::{ProgressBar, ProgressStyle};
use lorry_engine::embedding::Embedder;
use lorry_engine::models::bert::Pooling;
use serde::Deserialize;
use serde_json::json;

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
