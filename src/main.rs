//! `lorry`: the batch inference service's one binary.

use clap::{Parser, Subcommand};
use lorry::bench::{self, EngineBenchArgs, LoraBenchArgs, PipelineArgs};
use lorry::isolation::{self, IsolationArgs};
use lorry::offline::{self, EmbedArgs, GenerateArgs};
use lorry::speedups::{self, PrefixBenchArgs, SpeculativeBenchArgs};
use lorry::{open_store, Application, Role, Settings};
use lorry_engine::fixtures::{self, Fixture};
use tracing_subscriber::EnvFilter;

#[derive(Parser)]
#[command(
    name = "lorry",
    version,
    about = "Asynchronous batch inference with many LoRA adapters"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the API and a worker in one process (local runs).
    Serve(Settings),
    /// Run the HTTP API.
    Api(Settings),
    /// Run a worker.
    Worker(Settings),
    /// Create the database if it is missing and apply migrations.
    Migrate(Settings),
    /// Generate for every line of a JSONL file with a Llama-family model (offline batch mode).
    Generate(GenerateArgs),
    /// Embed every line of a JSONL file with a BERT-family model.
    Embed(EmbedArgs),
    /// Write a small random-weight model in Hugging Face layout (seeded, reproducible).
    Fixtures {
        /// tiny-llama, tiny-qwen2, tiny-gemma, tiny-bert or bench.
        name: String,
        /// Where to write it.
        dir: std::path::PathBuf,
        /// Weight precision: f32, f16 or bf16.
        #[arg(long, default_value = "f32")]
        dtype: String,
    },
    /// Benchmarks.
    #[command(subcommand)]
    Bench(Bench),
}

#[derive(Subcommand)]
enum Bench {
    /// One large batch on the echo model against a running stack.
    Pipeline(PipelineArgs),
    /// Decode rates of the engine on the `bench` model against the machine's rooflines.
    Engine(EngineBenchArgs),
    /// Decode rates with LoRA adapters: none, one shared, many mixed, group by group.
    Lora(LoraBenchArgs),
    /// Real-time latency against a running stack, idle and while a large batch drains.
    Isolation(IsolationArgs),
    /// Tokens/s with speculative decoding (prompt lookup, draft models) against without.
    Speculative(SpeculativeBenchArgs),
    /// Pre-fill and batch time with the prefix cache against without.
    Prefix(PrefixBenchArgs),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_env("LORRY_LOG").unwrap_or_else(|_| EnvFilter::new("info")))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let (settings, role) = match cli.command {
        Command::Serve(s) => (s, Role::Serve),
        Command::Api(s) => (s, Role::Api),
        Command::Worker(s) => (s, Role::Worker),
        Command::Migrate(s) => {
            open_store(&s, true).await?;
            tracing::info!("database ready");
            return Ok(());
        }
        Command::Generate(args) => {
            offline::generate(&args).await?;
            return Ok(());
        }
        Command::Embed(args) => {
            offline::embed(&args)?;
            return Ok(());
        }
        Command::Fixtures { name, dir, dtype } => {
            let fixture = Fixture::parse(&name)
                .ok_or_else(|| anyhow::anyhow!("unknown fixture {name}; one of {}", Fixture::NAMES.join(", ")))?;
            let dtype = fixtures::parse_dtype(&dtype)
                .ok_or_else(|| anyhow::anyhow!("unknown --dtype {dtype}; one of f32, f16, bf16"))?;
            fixtures::write_as(fixture, &dir, dtype)?;
            return Ok(());
        }
        Command::Bench(Bench::Pipeline(args)) => {
            bench::pipeline(&args).await?;
            return Ok(());
        }
        Command::Bench(Bench::Engine(args)) => {
            bench::engine(&args).await?;
            return Ok(());
        }
        Command::Bench(Bench::Lora(args)) => {
            bench::lora(&args).await?;
            return Ok(());
        }
        Command::Bench(Bench::Isolation(args)) => {
            isolation::isolation(&args).await?;
            return Ok(());
        }
        Command::Bench(Bench::Speculative(args)) => {
            speedups::speculative(&args).await?;
            return Ok(());
        }
        Command::Bench(Bench::Prefix(args)) => {
            speedups::prefix(&args).await?;
            return Ok(());
        }
    };
    let app = Application::build(settings, role).await?;
    if let Some(port) = app.port() {
        tracing::info!(port, ?role, "listening");
    }
    app.run_until_stopped().await
}
