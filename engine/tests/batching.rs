//! Continuous batching on a real (tiny) model: a batch never changes a
//! result, whatever the step budget, the cache size or the preemptions;
//! cancellation frees a request's place; streams add up to the result.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use candle_core::Device;
use lorry_engine::adapters::{AdapterRef, Adapters, AdaptersConfig, LocalFiles};
use lorry_engine::fixtures::{self, Fixture};
use lorry_engine::lora::{Adapter, AdapterLimits, PackedAdapter};
use lorry_engine::runtime::chat::{FinishReason, TextModel};
use lorry_engine::runtime::text_engine::{EngineConfig, TextEngine};
use lorry_engine::{collect, Backend, EngineError, ErrorCode, Event, Lane, Request, Task, ValidRequest};
use serde_json::{json, Value};

fn model(tag: &str) -> (TextModel, PathBuf) {
    let dir = std::env::temp_dir().join(format!("lorry-batching-{tag}-{}", std::process::id()));
    fixtures::write(Fixture::TinyLlama, &dir).unwrap();
    (TextModel::from_dir(&dir, &Device::Cpu).unwrap(), dir)
}

fn request(body: Value) -> ValidRequest {
    ValidRequest::parse(Task::TextGeneration, &body).unwrap()
}

/// Prompts of many lengths, greedy and sampled, some cut by a stop string
/// taken from the middle of what they would generate otherwise.
fn mixed_requests(model: &TextModel) -> Vec<ValidRequest> {
    (0..14)
        .map(|i| {
            let prompt = "the quick brown fox jumps over the lazy dog ".repeat(1 + i % 5);
            let mut body = json!({"prompt": prompt, "raw": true, "max_tokens": 6 + 3 * i, "ignore_eos": i % 3 == 0});
            if i % 2 == 1 {
                body["temperature"] = json!(0.9);
                body["top_k"] = json!(50);
                body["seed"] = json!(100 + i);
            }
            if i % 4 == 2 {
                let text = model.generate(&request(body.clone())).unwrap().text;
                let middle: String = text.chars().skip(text.chars().count() / 2).take(1).collect();
                body["stop"] = json!([middle]);
            }
            if i % 7 == 3 {
                body = json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 9, "seed": 3});
            }
            request(body)
        })
        .collect()
}

fn engine_config(kv_cache_bytes: usize, token_budget: usize) -> EngineConfig {
    EngineConfig {
        kv_cache_bytes,
        token_budget,
        max_seqs: 8,
        rt_reserved_seqs: 2,
        ..EngineConfig::default()
    }
}

/// Every request through `engine` at once, half on each lane; results in order.
async fn run_all(engine: &TextEngine, requests: &[ValidRequest]) -> Vec<lorry_engine::Output> {
    let streams: Vec<_> = requests
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let lane = if i % 2 == 0 { Lane::Batch } else { Lane::RealTime };
            engine.submit(Request::new(r.clone(), lane)).unwrap()
        })
        .collect();
    let mut outputs = Vec::new();
    for stream in streams {
        outputs.push(collect(stream).await.unwrap());
    }
    outputs
}

/// Fewer forward passes than tokens: requests shared steps.
fn assert_batched(engine: &TextEngine) {
    let steps = engine.counters().steps.load(Ordering::Relaxed);
    let generated = engine.counters().generated_tokens.load(Ordering::Relaxed);
    assert!(
        steps < generated,
        "{steps} steps for {generated} tokens: nothing was batched"
    );
}

fn assert_same_as_alone(model: &TextModel, requests: &[ValidRequest], outputs: &[lorry_engine::Output]) {
    for (i, (r, out)) in requests.iter().zip(outputs).enumerate() {
        let alone = model.generate(r).unwrap();
        let completion = out.completion.as_ref().unwrap();
        assert_eq!(completion.token_ids, alone.token_ids, "request {i}: tokens differ");
        assert_eq!(completion.finish_reason, alone.finish_reason, "request {i}");
        assert_eq!(out.content.text(), alone.text, "request {i}");
        assert_eq!(out.usage.prompt_tokens as usize, alone.prompt_tokens, "request {i}");
        assert_eq!(
            out.usage.completion_tokens as usize,
            alone.token_ids.len(),
            "request {i}"
        );
    }
}

/// The mixed requests through an engine of `config` all at once, each
/// result checked against the request alone and the steps shared; the
/// outputs, in order.
async fn mixed_requests_batched_as_alone(tag: &str, config: EngineConfig) -> Vec<lorry_engine::Output> {
    let (reference, dir) = model(tag);
    let requests = mixed_requests(&reference);
    let engine = TextEngine::start("tiny", TextModel::from_dir(&dir, &Device::Cpu).unwrap(), config);
    let outputs = run_all(&engine, &requests).await;
    assert_same_as_alone(&reference, &requests, &outputs);
    assert_batched(&engine);
    let _ = std::fs::remove_dir_all(dir);
    outputs
}

#[tokio::test]
async fn a_batched_run_gives_the_same_results_as_each_request_alone() {
    // A 24-token step budget splits every longer prompt into chunks.
    let outputs = mixed_requests_batched_as_alone("same", engine_config(1 << 30, 24)).await;
    assert!(outputs
        .iter()
        .any(|o| o.completion.as_ref().unwrap().finish_reason == FinishReason::Stop));
}

#[tokio::test]
async fn a_steps_logits_taken_a_few_rows_at_a_time_give_the_same_results() {
    // Eight sequences at once, their logits three rows at a time; a
    // sequence with more rows (its guesses) is a group of its own.
    let config = EngineConfig {
        logits_rows: 3,
        ..engine_config(1 << 30, 24)
    };
    mixed_requests_batched_as_alone("head-groups", config).await;
}

#[tokio::test]
async fn preempted_sequences_are_recomputed_to_the_same_result() {
    let (reference, dir) = model("preempt");
    let requests = mixed_requests(&reference);
    // Room for 320 tokens: enough for any one request, far from enough for eight.
    let layout = reference.model.kv_layout(16);
    let engine = TextEngine::start(
        "tiny",
        TextModel::from_dir(&dir, &Device::Cpu).unwrap(),
        engine_config(20 * layout.bytes_per_block(), 64),
    );
    let outputs = run_all(&engine, &requests).await;
    assert_same_as_alone(&reference, &requests, &outputs);
    assert!(
        engine.counters().preemptions.load(Ordering::Relaxed) > 0,
        "the cache never ran short"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn a_dropped_stream_cancels_its_request_and_others_carry_on() {
    let (reference, dir) = model("cancel");
    let engine = TextEngine::start("tiny", reference, engine_config(1 << 30, 64));
    let long = request(json!({"prompt": "a", "raw": true, "max_tokens": 400, "ignore_eos": true, "stream": true}));
    let mut events = engine.submit(Request::new(long, Lane::Batch)).unwrap();
    assert!(matches!(events.recv().await, Some(Event::Token { .. })));
    drop(events);
    let short = request(json!({"prompt": "b", "raw": true, "max_tokens": 3, "ignore_eos": true}));
    let out = collect(engine.submit(Request::new(short, Lane::Batch)).unwrap())
        .await
        .unwrap();
    assert_eq!(out.usage.completion_tokens, 3);
    assert_eq!(engine.counters().cancelled.load(Ordering::Relaxed), 1);
    assert!(engine.counters().generated_tokens.load(Ordering::Relaxed) < 400);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn a_stream_whose_reader_falls_too_far_behind_is_dropped_with_what_it_was_owed() {
    let (reference, dir) = model("overrun");
    let config = EngineConfig {
        max_unread_events: 8,
        ..engine_config(1 << 30, 64)
    };
    let engine = TextEngine::start("tiny", reference, config);
    let body = json!({"prompt": "a", "raw": true, "max_tokens": 200, "ignore_eos": true, "stream": true});
    let mut behind = engine
        .submit(Request::new(request(body.clone()), Lane::RealTime))
        .unwrap();
    // A request beside it runs to the end. It does not stream (it gets its
    // result whole), so no reader of this test, however slowly the machine
    // schedules it, can fall behind on it.
    let mut whole = body.clone();
    whole["stream"] = json!(false);
    let kept_up = collect(engine.submit(Request::new(request(whole), Lane::RealTime)).unwrap())
        .await
        .unwrap();
    assert_eq!(kept_up.usage.completion_tokens, 200);
    // The one never read was dropped once 8 of its events were waiting:
    // it gets those, then the overrun, and the engine stopped generating for it.
    let mut tokens = 0;
    let last = loop {
        match behind.recv().await.expect("the stream ends with an event") {
            Event::Token { .. } => tokens += 1,
            other => break other,
        }
    };
    assert_eq!(tokens, 8);
    assert_eq!(last, Event::Failed(EngineError::Overrun));
    assert_eq!(EngineError::Overrun.code(), ErrorCode::ServiceUnavailable);
    assert!(behind.recv().await.is_none());
    let c = engine.counters();
    assert_eq!(c.cancelled.load(Ordering::Relaxed), 1);
    assert!(c.generated_tokens.load(Ordering::Relaxed) < 2 * 200);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn streamed_text_adds_up_to_the_result_and_holds_back_stop_strings() {
    let (reference, dir) = model("stream");
    let engine = TextEngine::start("tiny", reference, engine_config(1 << 30, 64));
    for body in [
        json!({"prompt": "hello", "raw": true, "max_tokens": 40, "ignore_eos": true, "stream": true}),
        json!({"prompt": "hello", "raw": true, "max_tokens": 40, "stream": true, "stop": ["e", "zq"], "seed": 9, "temperature": 1.0}),
    ] {
        let mut events = engine.submit(Request::new(request(body), Lane::RealTime)).unwrap();
        let mut streamed = String::new();
        let out = loop {
            match events.recv().await.unwrap() {
                Event::Token { text, .. } => streamed.push_str(&text),
                Event::Finished(out) => break out,
                Event::Failed(e) => panic!("{e}"),
            }
        };
        assert_eq!(streamed, out.content.text());
    }
    // Both were real-time requests, traced in the counters; no batch work rode along.
    let c = engine.counters();
    assert_eq!(c.rt_requests.load(Ordering::Relaxed), 2);
    assert!(c.rt_steps.load(Ordering::Relaxed) >= 2);
    assert!(c.rt_step_us.load(Ordering::Relaxed) > 0);
    assert_eq!(c.rt_batch_tokens.load(Ordering::Relaxed), 0);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn a_prompt_longer_than_the_context_fails_alone() {
    let (reference, dir) = model("long");
    let engine = TextEngine::start("tiny", reference, engine_config(1 << 30, 64));
    let long = request(json!({"prompt": "z".repeat(2100), "raw": true}));
    let err = collect(engine.submit(Request::new(long, Lane::Batch)).unwrap())
        .await
        .unwrap_err();
    match err {
        EngineError::Input(e) => assert_eq!(
            (e.code.as_str(), e.param.as_str()),
            ("context_length_exceeded", "prompt")
        ),
        other => panic!("{other:?}"),
    }
    let ok = request(json!({"prompt": "z", "raw": true, "max_tokens": 2}));
    assert!(collect(engine.submit(Request::new(ok, Lane::Batch)).unwrap())
        .await
        .is_ok());
    let _ = std::fs::remove_dir_all(dir);
}

fn adapter_dir(name: &str) -> PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/lora")
        .join(name)
}

/// The adapter packed for the reference model, and the engine's reference to its files.
fn reference_adapter(name: &str, model: &TextModel) -> (Arc<PackedAdapter>, AdapterRef) {
    let dir = adapter_dir(name);
    let adapter = Adapter::from_dir(&dir, &model.model.config().adapter_shape(), AdapterLimits::default()).unwrap();
    (Arc::new(PackedAdapter::new(&adapter)), AdapterRef::local(&dir).unwrap())
}

#[tokio::test]
async fn requests_for_different_adapters_share_a_batch_and_keep_their_results() {
    let (reference, dir) = model("adapters");
    let adapters = [
        None,
        Some(reference_adapter("adapter-a", &reference)),
        Some(reference_adapter("adapter-b", &reference)),
    ];
    let requests = mixed_requests(&reference);
    // Both adapters resident before the requests go in, so that they join in submission order.
    let resident = Adapters::new(Arc::new(LocalFiles), AdaptersConfig::default());
    let shape = reference.model.config().adapter_shape();
    for (_, files) in adapters.iter().flatten() {
        drop(resident.acquire(files, &shape).await.unwrap());
    }
    let engine = TextEngine::start(
        "tiny",
        TextModel::from_dir(&dir, &Device::Cpu).unwrap(),
        engine_config(1 << 30, 24),
    )
    .with_adapters(resident);
    let streams: Vec<_> = requests
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let adapter = adapters[i % 3].as_ref().map(|(_, files)| files.clone());
            engine
                .submit(Request::new(r.clone(), Lane::Batch).with_adapter(adapter))
                .unwrap()
        })
        .collect();
    let mut differ = 0;
    for (i, (r, stream)) in requests.iter().zip(streams).enumerate() {
        let out = collect(stream).await.unwrap();
        let packed = adapters[i % 3].as_ref().map(|(packed, _)| &**packed);
        let alone = reference.generate_adapted(r, packed).unwrap();
        let tokens = &out.completion.as_ref().unwrap().token_ids;
        assert_eq!(tokens, &alone.token_ids, "request {i}");
        if adapters[i % 3].is_some() && *tokens != reference.generate(r).unwrap().token_ids {
            differ += 1;
        }
    }
    assert!(differ > 0, "no adapter changed any output");
    assert_batched(&engine);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn an_adapter_that_cannot_be_had_fails_its_request_alone() {
    let (reference, dir) = model("adapter-refusals");
    let short = || request(json!({"prompt": "z", "raw": true, "max_tokens": 2}));
    // No adapters configured: a request with one is refused by name at submission.
    let bare = TextEngine::start("tiny", reference.clone(), engine_config(1 << 30, 24));
    let files = AdapterRef::local(&adapter_dir("adapter-a")).unwrap();
    let refused = bare
        .submit(Request::new(short(), Lane::Batch).with_adapter(Some(files.clone())))
        .unwrap_err();
    assert_eq!(refused.code(), ErrorCode::AdaptersNotSupported, "{refused:?}");

    let engine = TextEngine::start("tiny", reference, engine_config(1 << 30, 24))
        .with_adapters(Adapters::new(Arc::new(LocalFiles), AdaptersConfig::default()));
    // Files that are not there fail the request, and not retryably.
    let mut missing = files.clone();
    missing.weights = dir.join("nowhere.safetensors").display().to_string();
    let failed = collect(
        engine
            .submit(Request::new(short(), Lane::Batch).with_adapter(Some(missing)))
            .unwrap(),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(failed, EngineError::Model(_)) && !failed.retryable(),
        "{failed:?}"
    );
    // A request naming an adapter without a reference to its files is refused.
    let mut named = short();
    named.lora = Some("unresolved".into());
    assert!(engine.submit(Request::new(named, Lane::Batch)).is_err());
    // The engine serves the others as before.
    collect(engine.submit(Request::new(short(), Lane::Batch)).unwrap())
        .await
        .unwrap();
    collect(
        engine
            .submit(Request::new(short(), Lane::Batch).with_adapter(Some(files)))
            .unwrap(),
    )
    .await
    .unwrap();
    let _ = std::fs::remove_dir_all(dir);
}

/// The accounts of the sequences the engine ended, in the order it ended
/// them: a sequence's span ("engine.sequence") closes on the engine's thread
/// when it ends, under the request's span, named here for its account.
#[derive(Clone, Default)]
struct EndOrder(Arc<(std::sync::Mutex<Vec<&'static str>>, std::sync::Condvar)>);

impl EndOrder {
    /// How many have ended so far.
    fn len(&self) -> usize {
        self.0 .0.lock().unwrap().len()
    }

    /// The order, once `count` have ended (or what has after a minute).
    fn once(&self, count: usize) -> Vec<&'static str> {
        let (ended, closed) = &*self.0;
        let ended = closed
            .wait_timeout_while(ended.lock().unwrap(), std::time::Duration::from_secs(60), |e| {
                e.len() < count
            })
            .unwrap()
            .0;
        ended.clone()
    }
}

impl<S> tracing_subscriber::Layer<S> for EndOrder
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fn on_close(&self, id: tracing::span::Id, ctx: tracing_subscriber::layer::Context<'_, S>) {
        let Some(span) = ctx.span(&id) else { return };
        if span.name() != "engine.sequence" {
            return;
        }
        if let Some(account) = span
            .parent()
            .map(|parent| parent.name())
            .filter(|name| name.starts_with("account_"))
        {
            self.0 .0.lock().unwrap().push(&account["account_".len()..]);
            self.0 .1.notify_all();
        }
    }
}

#[tokio::test]
async fn an_accounts_few_requests_behind_anothers_many_are_not_served_after_all_of_them() {
    // Eight slots; account a's 200 requests queued before account b's 8, all
    // of one length. In arrival order b's would end after every one of a's
    // still queued; admitted by account, b's take two of every three slots
    // that free once they arrive. The order is the engine's own (its
    // sequences' spans close as it ends them), not that of the tasks
    // reading the streams, which may fall behind it.
    use tracing_subscriber::layer::SubscriberExt;
    let order = EndOrder::default();
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(order.clone())).unwrap();
    let (reference, dir) = model("accounts");
    let config = EngineConfig {
        max_seqs: 8,
        rt_reserved_seqs: 0,
        ..engine_config(1 << 30, 64)
    };
    let engine = TextEngine::start("tiny", reference, config);
    let body =
        |i: usize| request(json!({"prompt": format!("line {i}"), "raw": true, "max_tokens": 6, "ignore_eos": true}));
    let mut streams = Vec::new();
    let mut ended_before_b = 0;
    for (account, count) in [("a", 200), ("b", 8)] {
        for i in 0..count {
            let span = match account {
                "a" => tracing::info_span!("account_a"),
                _ => tracing::info_span!("account_b"),
            };
            let request = Request::new(body(i), Lane::Batch)
                .for_account(Some(account.to_string()))
                .in_span(span);
            streams.push(engine.submit(request).unwrap());
        }
        if account == "b" {
            // Counted once b's are in the engine's inbox: the engine takes
            // them in at its next step, so those ending until then ended
            // before b's could be admitted.
            ended_before_b = order.len();
        }
    }
    for events in streams {
        collect(events).await.unwrap();
    }
    // A sequence's span closes just after its last event is sent.
    let ended = order.once(208);
    assert_eq!(ended.len(), 208, "every sequence's span closed: {}", ended.concat());
    let last_b = ended.iter().rposition(|a| *a == "b").unwrap();
    // Once b's are queued: the eight running end, b's take their slots two
    // for one, and b's last runs its six tokens beside seven others.
    assert!(
        last_b < ended_before_b + 8 + 12 + 8,
        "b's last request ended {}th of 208, {ended_before_b} having ended before b's were queued: {}",
        last_b + 1,
        ended.concat()
    );
    let _ = std::fs::remove_dir_all(dir);
}
