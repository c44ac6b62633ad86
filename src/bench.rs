//! `lorry bench pipeline`: one large batch on `@lorry/echo` against a running
//! stack, timed from the client's side, with where the time went.

use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
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
