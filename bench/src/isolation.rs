//! `lorry bench isolation`: real-time latency on a running stack, idle and
//! while a large batch drains on the same workers.
//!
//! Real-time requests (short chat prompts, `new_tokens` tokens each, streamed
//! through `/v1/chat/completions`) go out at a steady rate, open loop: each
//! starts on its schedule whether or not the earlier ones have answered. Time
//! to first token is the first piece of text; total latency is `[DONE]`. The
//! same schedule runs on an idle stack, then again once a `flood`-request
//! batch on the same model is running. The batch's own end-to-end throughput
//! is reported when it completes.

use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use futures::StreamExt;
use serde_json::{json, Value};

/// What to measure and where.
#[derive(clap::Args, Debug, Clone)]
pub struct IsolationArgs {
    /// The API's base URL.
    #[arg(long, env = "LORRY_URL", default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// An API token.
    #[arg(long, env = "LORRY_TOKEN")]
    pub token: String,
    /// A text-generation model the stack serves.
    #[arg(long, default_value = "@lorry/demo-llama")]
    pub model: String,
    /// Real-time requests per second.
    #[arg(long, default_value_t = 8.0)]
    pub rate: f64,
    /// Real-time requests in each phase.
    #[arg(long, default_value_t = 240)]
    pub requests: usize,
    /// Tokens each real-time request generates.
    #[arg(long, default_value_t = 16)]
    pub new_tokens: u32,
    /// Requests in the batch that floods the stack.
    #[arg(long, default_value_t = 10_000)]
    pub flood: usize,
    /// Tokens each batch request generates (enough that the batch outlasts the probe).
    #[arg(long, default_value_t = 32)]
    pub flood_tokens: u32,
    /// Seconds the flood runs before its rate alone is measured: longer than
    /// the engine keeps pacing after the last real-time request
    /// (`LORRY_RT_LINGER_MS`), so that the idle phase's probes are behind it.
    #[arg(long, default_value_t = 8.0)]
    pub settle_secs: f64,
}

/// One real-time request's timings, or why it got none.
enum Probe {
    Answered { first_token: Duration, total: Duration },
    Refused(u16),
    Failed(String),
}

async fn probe(http: reqwest::Client, args: IsolationArgs, i: usize) -> Probe {
    let body = json!({
        "model": args.model,
        "messages": [{"role": "user", "content": format!("Say something about the number {i}.")}],
        "max_tokens": args.new_tokens,
        "ignore_eos": true,
        "stream": true,
    });
    let started = Instant::now();
    let response = match http
        .post(format!("{}/v1/chat/completions", args.url))
        .bearer_auth(&args.token)
        .json(&body)
        .send()
        .await
    {
        Ok(r) => r,
        Err(e) => return Probe::Failed(e.to_string()),
    };
    if !response.status().is_success() {
        return Probe::Refused(response.status().as_u16());
    }
    let mut stream = response.bytes_stream();
    let mut seen = String::new();
    let mut first_token = None;
    while let Some(piece) = stream.next().await {
        match piece {
            Ok(bytes) => seen.push_str(&String::from_utf8_lossy(&bytes)),
            Err(e) => return Probe::Failed(e.to_string()),
        }
        if first_token.is_none() && seen.contains("\"content\":\"") && has_text(&seen) {
            first_token = Some(started.elapsed());
        }
        if seen.contains("data: [DONE]") {
            let total = started.elapsed();
            return Probe::Answered {
                first_token: first_token.unwrap_or(total),
                total,
            };
        }
    }
    Probe::Failed("the stream ended before [DONE]".into())
}

/// Whether a chunk with non-empty text has arrived (the first chat chunk carries only the role).
fn has_text(seen: &str) -> bool {
    seen.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .any(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|t| !t.is_empty())
        })
}

/// The probes of one phase, on a fixed schedule.
async fn phase(http: &reqwest::Client, args: &IsolationArgs) -> Vec<Probe> {
    let every = Duration::from_secs_f64(1.0 / args.rate.max(0.01));
    let start = tokio::time::Instant::now();
    let mut tasks = Vec::with_capacity(args.requests);
    for i in 0..args.requests {
        tokio::time::sleep_until(start + every * i as u32).await;
        tasks.push(tokio::spawn(probe(http.clone(), args.clone(), i)));
    }
    let mut probes = Vec::with_capacity(tasks.len());
    for task in tasks {
        probes.push(task.await.unwrap_or_else(|e| Probe::Failed(e.to_string())));
    }
    probes
}

struct Summary {
    answered: usize,
    refused: usize,
    failed: usize,
    first_token: (f64, f64),
    total: (f64, f64),
}

fn summarise(probes: &[Probe]) -> Summary {
    let mut first = Vec::new();
    let mut total = Vec::new();
    let (mut refused, mut failed) = (0, 0);
    for p in probes {
        match p {
            Probe::Answered { first_token, total: t } => {
                first.push(first_token.as_secs_f64() * 1e3);
                total.push(t.as_secs_f64() * 1e3);
            }
            Probe::Refused(_) => refused += 1,
            Probe::Failed(e) => {
                tracing::warn!(error = %e, "a real-time probe failed");
                failed += 1
            }
        }
    }
    first.sort_by(f64::total_cmp);
    total.sort_by(f64::total_cmp);
    let pct = |v: &[f64], p: f64| {
        if v.is_empty() {
            f64::NAN
        } else {
            crate::bench::percentile(v, p)
        }
    };
    Summary {
        answered: first.len(),
        refused,
        failed,
        first_token: (pct(&first, 0.5), pct(&first, 0.99)),
        total: (pct(&total, 0.5), pct(&total, 0.99)),
    }
}

/// Requests of the batch that have succeeded so far.
async fn succeeded(http: &reqwest::Client, args: &IsolationArgs, id: &str) -> anyhow::Result<i64> {
    let state = batch_state(http, args, id).await?;
    Ok(state["request_counts"]["succeeded"].as_i64().unwrap_or(0))
}

async fn batch_state(http: &reqwest::Client, args: &IsolationArgs, id: &str) -> anyhow::Result<Value> {
    Ok(http
        .get(format!("{}/v1/batches/{id}", args.url))
        .bearer_auth(&args.token)
        .send()
        .await?
        .json()
        .await?)
}

/// Run the benchmark and print its table.
pub async fn isolation(args: &IsolationArgs) -> anyhow::Result<()> {
    let http = reqwest::Client::new();
    // Warm up: the model's first requests pay for page faults and thread start.
    for i in 0..4 {
        if let Probe::Failed(e) = probe(http.clone(), args.clone(), i).await.map_refusal() {
            bail!("the stack does not answer real-time requests on {}: {e}", args.model);
        }
    }
    eprintln!("idle: {} real-time requests at {}/s", args.requests, args.rate);
    let idle = summarise(&phase(&http, args).await);

    let requests: Vec<Value> = (0..args.flood)
        .map(|i| {
            json!({"custom_id": format!("f{i}"), "body": {
                "messages": [{"role": "user", "content": format!("Write about item {i} of the flood.")}],
                "max_tokens": args.flood_tokens, "ignore_eos": true}})
        })
        .collect();
    let posted = Instant::now();
    let response = http
        .post(format!("{}/v1/batches", args.url))
        .bearer_auth(&args.token)
        .json(&json!({"model": args.model, "requests": requests}))
        .send()
        .await
        .context("posting the flood")?;
    if response.status().as_u16() != 202 {
        bail!(
            "the flood's POST answered {}: {}",
            response.status(),
            response.text().await?
        );
    }
    let batch: Value = response.json().await?;
    let id = batch["id"].as_str().context("batch id")?.to_string();
    // Probe once the flood is running on the worker.
    loop {
        let state = batch_state(&http, args, &id).await?;
        let counts = &state["request_counts"];
        if counts["running"].as_i64().unwrap_or(0) + counts["succeeded"].as_i64().unwrap_or(0) > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The batch alone for as long as a probe phase lasts, then with the probes.
    let window = Duration::from_secs_f64(args.requests as f64 / args.rate.max(0.01));
    eprintln!("flood of {} running; the batch alone for {window:?}", args.flood);
    tokio::time::sleep(Duration::from_secs_f64(args.settle_secs.max(0.0))).await;
    let (done_before, alone_from) = (succeeded(&http, args, &id).await?, Instant::now());
    tokio::time::sleep(window).await;
    let (done_alone, alone_seconds) = (succeeded(&http, args, &id).await?, alone_from.elapsed().as_secs_f64());
    eprintln!("probing again");
    let probed_from = Instant::now();
    let flooded = summarise(&phase(&http, args).await);
    let (done_probed, probed_seconds) = (succeeded(&http, args, &id).await?, probed_from.elapsed().as_secs_f64());
    let tokens_per = f64::from(args.flood_tokens);
    let alone_rate = (done_alone - done_before) as f64 * tokens_per / alone_seconds;
    let probed_rate = (done_probed - done_alone) as f64 * tokens_per / probed_seconds;
    let after = batch_state(&http, args, &id).await?;
    let left = after["request_counts"]["pending"].as_i64().unwrap_or(0)
        + after["request_counts"]["running"].as_i64().unwrap_or(0);

    let ended = loop {
        let state = batch_state(&http, args, &id).await?;
        match state["status"].as_str() {
            Some("completed") => break state,
            Some("failed" | "expired" | "cancelled") => bail!("the flood ended {}", state["status"]),
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    let drained = posted.elapsed().as_secs_f64();
    let tokens = ended["usage"]["completion_tokens"].as_f64().unwrap_or(0.0);

    println!(
        "Real-time lane, {} requests at {}/s ({} new tokens each, streamed), model {}",
        args.requests, args.rate, args.new_tokens, args.model
    );
    println!();
    println!("| phase | answered | 429 | failed | TTFT p50 (ms) | TTFT p99 (ms) | total p50 (ms) | total p99 (ms) |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for (name, s) in [
        ("idle", &idle),
        (&*format!("{}-request batch draining", args.flood), &flooded),
    ] {
        println!(
            "| {name} | {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} |",
            s.answered, s.refused, s.failed, s.first_token.0, s.first_token.1, s.total.0, s.total.1
        );
    }
    println!();
    println!(
        "p99 under flood / idle p99: TTFT {:.2}x, total {:.2}x (goal <= 1.5x); {left} batch requests still waiting when the probe ended",
        flooded.first_token.1 / idle.first_token.1,
        flooded.total.1 / idle.total.1
    );
    if left == 0 {
        println!(
            "Batch tokens/s while it drains: {alone_rate:.0} alone; with the real-time requests not measured: the flood ended before the probes did (raise --flood)"
        );
    } else {
        // The real-time requests' own tokens are work the engine does in
        // the batch lane's place: were they as cheap as batch tokens, the
        // batch lane could keep at most what they leave of its alone rate.
        let real_time_rate = flooded.answered as f64 * f64::from(args.new_tokens) / probed_seconds;
        let bound = (alone_rate - real_time_rate).max(0.0);
        println!(
            "Batch tokens/s while it drains: {alone_rate:.0} alone, {probed_rate:.0} with the real-time requests ({:.2}x; goal >= 0.8x)",
            probed_rate / alone_rate.max(1e-9)
        );
        println!(
            "Real-time tokens/s meanwhile: {real_time_rate:.0}; the batch lane's rate if those cost as much as its own: {bound:.0} ({:.2}x alone); both lanes together {:.0} tokens/s ({:.2}x the batch lane alone)",
            bound / alone_rate.max(1e-9),
            probed_rate + real_time_rate,
            (probed_rate + real_time_rate) / alone_rate.max(1e-9)
        );
    }
    println!(
        "Batch: {} requests x {} tokens, POST to completed in {drained:.1} s: {:.0} requests/s, {:.0} generated tokens/s",
        args.flood,
        args.flood_tokens,
        args.flood as f64 / drained,
        tokens / drained
    );
    Ok(())
}

impl Probe {
    fn map_refusal(self) -> Probe {
        match self {
            Probe::Refused(status) => Probe::Failed(format!("answered {status}")),
            other => other,
        }
    }
}
