//! `lorry`: the batch inference service's one binary.

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use lorry::offline::{self, EmbedArgs, GenerateArgs};
use lorry::operator::{self, AccountsCommand, KeysCommand};
use lorry::{open_store, Application, Role, Settings};
use lorry_engine::fixtures::{self, Fixture};

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
    /// Accounts: create, list, disable, enable, delete.
    #[command(subcommand)]
    Accounts(AccountsCommand),
    /// An account's API keys: create, list, revoke.
    #[command(subcommand)]
    Keys(KeysCommand),
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
    /// Benchmarks: runs `lorry-bench` (built beside this binary by
    /// `cargo build --release -p lorry-bench`) with the same arguments.
    #[command(disable_help_flag = true)]
    Bench {
        /// `pipeline`, `engine`, `lora`, `isolation`, `speculative`, `prefix` or `fairness`, and their flags.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, num_args = 0..)]
        args: Vec<std::ffi::OsString>,
    },
}

/// Replace this process with the `lorry-bench` binary beside it.
fn forward_to_bench(args: Vec<std::ffi::OsString>) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("locating this binary")?;
    let bench = exe.with_file_name("lorry-bench");
    if !bench.exists() {
        anyhow::bail!(
            "{} is not built: the benchmarks are their own binary (cargo build --release -p lorry-bench)",
            bench.display()
        );
    }
    use std::os::unix::process::CommandExt as _;
    let error = std::process::Command::new(&bench).args(args).exec();
    Err(error).with_context(|| format!("running {}", bench.display()))
}

/// The command line, with the settings file (`--config FILE`, or
/// `LORRY_CONFIG`) giving the defaults of the flags it names.
fn parse_cli() -> anyhow::Result<Cli> {
    use clap::{CommandFactory as _, FromArgMatches as _};
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let mut file = std::env::var_os("LORRY_CONFIG").map(std::path::PathBuf::from);
    for (i, arg) in args.iter().enumerate() {
        let arg = arg.to_string_lossy();
        if let Some(path) = arg.strip_prefix("--config=") {
            file = Some(path.into());
        } else if arg == "--config" {
            file = args.get(i + 1).map(std::path::PathBuf::from);
        }
    }
    let command = lorry::settings::with_file_defaults(Cli::command(), file.as_deref())?;
    let matches = command.get_matches_from(args);
    Ok(Cli::from_arg_matches(&matches)?)
}

fn main() -> anyhow::Result<()> {
    let cli = parse_cli()?;
    // Before the runtime's threads start: see `tune_allocator`.
    if matches!(
        cli.command,
        Command::Serve(_) | Command::Worker(_) | Command::Generate(_) | Command::Embed(_)
    ) {
        lorry_engine::models::tune_allocator();
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?
        .block_on(run(cli))
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let role = match &cli.command {
        Command::Serve(_) => Some(Role::Serve),
        Command::Api(_) => Some(Role::Api),
        Command::Worker(_) => Some(Role::Worker),
        _ => None,
    };
    let _telemetry = lorry::telemetry::init(role.map_or("lorry", Role::service_name));
    let (settings, role) = match cli.command {
        Command::Serve(s) => (s, Role::Serve),
        Command::Api(s) => (s, Role::Api),
        Command::Worker(s) => (s, Role::Worker),
        Command::Migrate(s) => {
            open_store(&s, true).await?;
            tracing::info!("database ready");
            return Ok(());
        }
        Command::Accounts(command) => return operator::accounts(command).await,
        Command::Keys(command) => return operator::keys(command).await,
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
        Command::Bench { args } => return forward_to_bench(args),
    };
    let app = Application::build(settings, role).await?;
    if let Some(port) = app.port() {
        tracing::info!(port, ?role, "listening");
    }
    app.run_until_stopped().await
}
