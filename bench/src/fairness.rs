//! `lorry bench fairness`: account B's small batch alone, then submitted
//! behind account A's large batch, against a running stack (the issue's
//! scenario: two workers, the demo text model). Prints B's time to
//! `completed` in both phases, their ratio, and how far A had got.

use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use serde_json::{json, Value};

/// What to submit and where.
#[derive(clap::Args, Debug, Clone)]
pub struct FairnessArgs {
    /// The API's base URL.
    #[arg(long, env = "LORRY_URL", default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// Account A's API token (the large batch).
    #[arg(long, env = "LORRY_TOKEN")]
    pub token: String,
    /// Account B's API token (the small batch): another account's key, e.g.
    /// the last line of `lorry accounts create bench-b`.
    #[arg(long)]
    pub other_token: String,
    /// A text-generation model the stack serves.
    #[arg(long, default_value = "@lorry/demo-llama")]
    pub model: String,
    /// Requests in A's batch.
    #[arg(long, default_value_t = 50_000)]
    pub large: usize,
    /// Requests in B's batch.
    #[arg(long, default_value_t = 500)]
    pub small: usize,
    /// Tokens each request generates.
    #[arg(long, default_value_t = 16)]
    pub new_tokens: u32,
    /// A's results to wait for before B submits, so that B arrives behind a batch already draining.
    #[arg(long, default_value_t = 200)]
    pub head_start: i64,
    /// Runs of B's batch in each phase (alone, then one after another behind A's); the median is compared.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
}

fn batch_body(args: &FairnessArgs, n: usize, tag: &str) -> Value {
    let requests: Vec<Value> = (0..n)
        .map(|i| {
            json!({"body": {"prompt": format!("{tag} request {i}: a short line about the sea"),
                            "max_tokens": args.new_tokens, "ignore_eos": true}})
        })
        .collect();
    json!({"model": args.model, "requests": requests})
}

async fn submit(http: &reqwest::Client, args: &FairnessArgs, token: &str, body: &Value) -> anyhow::Result<String> {
    let response = http
        .post(format!("{}/v1/batches", args.url))
        .bearer_auth(token)
        .json(body)
        .send()
        .await
        .context("posting a batch")?;
    if response.status().as_u16() != 202 {
        bail!("POST answered {}: {}", response.status(), response.text().await?);
    }
    let batch: Value = response.json().await?;
    Ok(batch["id"].as_str().context("batch id")?.to_string())
}

async fn batch(http: &reqwest::Client, args: &FairnessArgs, token: &str, id: &str) -> anyhow::Result<Value> {
    Ok(http
        .get(format!("{}/v1/batches/{id}", args.url))
        .bearer_auth(token)
        .send()
        .await?
        .json()
        .await?)
}

fn finished(batch: &Value) -> i64 {
    let counts = &batch["request_counts"];
    counts["total"].as_i64().unwrap_or(0)
        - counts["pending"].as_i64().unwrap_or(0)
        - counts["running"].as_i64().unwrap_or(0)
}

/// Submit B's batch and wait for it to complete; its time from the POST.
async fn run_small(http: &reqwest::Client, args: &FairnessArgs, tag: &str) -> anyhow::Result<Duration> {
    let body = batch_body(args, args.small, tag);
    let started = Instant::now();
    let id = submit(http, args, &args.other_token, &body).await?;
    loop {
        let b = batch(http, args, &args.other_token, &id).await?;
        match b["status"].as_str() {
            Some("completed") => return Ok(started.elapsed()),
            Some("failed" | "expired" | "cancelled") => bail!("B's batch ended {}", b["status"]),
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

fn median(times: &[Duration]) -> Duration {
    let mut sorted = times.to_vec();
    sorted.sort();
    sorted[sorted.len() / 2]
}

fn seconds(times: &[Duration]) -> String {
    times
        .iter()
        .map(|t| format!("{:.2}", t.as_secs_f64()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Run the benchmark and print its table.
pub async fn fairness(args: &FairnessArgs) -> anyhow::Result<()> {
    if args.runs == 0 {
        bail!("--runs must be at least 1");
    }
    let http = reqwest::Client::new();
    eprintln!("idle: B's {} requests alone, {} times", args.small, args.runs);
    let mut alone = Vec::new();
    for run in 0..args.runs {
        alone.push(run_small(&http, args, &format!("idle {run}")).await?);
    }
    let idle = median(&alone);
    eprintln!(
        "idle: {:.2} s; submitting A's {} requests",
        idle.as_secs_f64(),
        args.large
    );
    let large = submit(&http, args, &args.token, &batch_body(args, args.large, "large")).await?;
    loop {
        let a = batch(&http, args, &args.token, &large).await?;
        if finished(&a) >= args.head_start {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // B's batches one after another while A's drains.
    let mut behind = Vec::new();
    let mut a_meanwhile = Vec::new();
    for run in 0..args.runs {
        let a_before = finished(&batch(&http, args, &args.token, &large).await?);
        if a_before >= args.large as i64 {
            bail!("A's batch ended before B's run {run}: make --large larger");
        }
        eprintln!("A is draining ({a_before} finished); B submits behind it");
        behind.push(run_small(&http, args, &format!("shared {run}")).await?);
        let a_after = finished(&batch(&http, args, &args.token, &large).await?);
        a_meanwhile.push(a_after - a_before);
    }
    // A's batch is not needed any more.
    let _ = http
        .post(format!("{}/v1/batches/{large}/cancel", args.url))
        .bearer_auth(&args.token)
        .send()
        .await;
    let shared = median(&behind);
    println!(
        "| B's batch ({} requests x {} tokens, {}) | time to completed (s), median | runs (s) | A's requests finished meanwhile |",
        args.small, args.new_tokens, args.model
    );
    println!("|---|---:|---|---|");
    println!("| alone | {:.2} | {} | - |", idle.as_secs_f64(), seconds(&alone));
    println!(
        "| behind A's {} requests | {:.2} | {} | {} |",
        args.large,
        shared.as_secs_f64(),
        seconds(&behind),
        a_meanwhile.iter().map(i64::to_string).collect::<Vec<_>>().join(", ")
    );
    println!();
    println!(
        "ratio behind / alone: {:.2}x (goal <= 2.5x); in arrival order B would wait for all of A's batch",
        shared.as_secs_f64() / idle.as_secs_f64()
    );
    Ok(())
}
