//! `lorry-bench`: the benchmarks' binary (`lorry bench …` forwards here).

use clap::Parser;
use lorry_bench::bench::{self, EngineBenchArgs, LoraBenchArgs, PipelineArgs};
use lorry_bench::fairness::{self, FairnessArgs};
use lorry_bench::isolation::{self, IsolationArgs};
use lorry_bench::speedups::{self, PrefixBenchArgs, SpeculativeBenchArgs};
use lorry_bench::structured::{self, StructuredBenchArgs};

#[derive(Parser)]
#[command(name = "lorry-bench", version, about = "Lorry's benchmarks; each prints a table")]
enum Bench {
    /// One large batch on the echo model against a running stack.
    Pipeline(PipelineArgs),
    /// Decode rates of the engine on the `bench` model (or `--model`) against the machine's rooflines.
    Engine(EngineBenchArgs),
    /// Decode rates with LoRA adapters: none, one shared, many mixed, group by group.
    Lora(LoraBenchArgs),
    /// Real-time latency against a running stack, idle and while a large batch drains.
    Isolation(IsolationArgs),
    /// Tokens/s with speculative decoding (prompt lookup, draft models) against without.
    Speculative(SpeculativeBenchArgs),
    /// Pre-fill and batch time with the prefix cache against without.
    Prefix(PrefixBenchArgs),
    /// Another account's small batch alone, then behind a large batch, against a running stack.
    Fairness(FairnessArgs),
    /// Tokens/s with every row under a JSON schema against unconstrained, and schema compile times.
    Structured(StructuredBenchArgs),
}

fn main() -> anyhow::Result<()> {
    let bench = Bench::parse();
    // The benchmarks that run an engine in this process run it as the
    // service does (before the runtime's threads start).
    if !matches!(bench, Bench::Pipeline(_) | Bench::Isolation(_) | Bench::Fairness(_)) {
        lorry_engine::models::tune_allocator();
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run(bench))
}

async fn run(bench: Bench) -> anyhow::Result<()> {
    let _telemetry = lorry::init_logging();
    match bench {
        Bench::Pipeline(args) => bench::pipeline(&args).await.map(drop),
        Bench::Engine(args) => bench::engine(&args).await,
        Bench::Lora(args) => bench::lora(&args).await,
        Bench::Isolation(args) => isolation::isolation(&args).await,
        Bench::Speculative(args) => speedups::speculative(&args).await,
        Bench::Prefix(args) => speedups::prefix(&args).await,
        Bench::Fairness(args) => fairness::fairness(&args).await,
        Bench::Structured(args) => structured::structured(&args).await,
    }
}
