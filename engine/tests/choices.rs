//! `n` > 1 on a real (tiny, random-weight) model: each choice is what the
//! request alone gives with that choice's seed, the choices after the first
//! take the prompt's blocks from the prefix cache, pieces stream tagged with
//! their choice, usage counts the prompt once, and a reader that leaves
//! cancels every choice.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;

use candle_core::Device;
use lorry_engine::fixtures::{self, Fixture};
use lorry_engine::runtime::chat::TextModel;
use lorry_engine::runtime::choices::choice_seed;
use lorry_engine::runtime::text_engine::{EngineConfig, TextEngine};
use lorry_engine::{collect, Backend, Event, Lane, Request, Task, ValidRequest};
use serde_json::{json, Value};

fn fixture(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lorry-choices-{tag}-{}", std::process::id()));
    fixtures::write(Fixture::TinyLlama, &dir).unwrap();
    dir
}

fn request(body: Value) -> ValidRequest {
    ValidRequest::parse(Task::TextGeneration, &body).unwrap()
}

/// A prompt of several full KV blocks.
fn prompt() -> String {
    "the quick brown fox jumps over the lazy dog; ".repeat(3)
}

#[tokio::test]
async fn each_choice_is_the_request_alone_with_its_seed_and_shares_the_prompt() {
    let dir = fixture("alone");
    let model = TextModel::from_dir(&dir, &Device::Cpu).unwrap();
    let engine = TextEngine::start("tiny", model.clone(), EngineConfig::default());
    let body = json!({"prompt": prompt(), "raw": true, "max_tokens": 12, "temperature": 1.0, "seed": 5, "n": 4,
                      "logprobs": true, "top_logprobs": 1});
    let output = collect(engine.submit(Request::new(request(body.clone()), Lane::Batch)).unwrap())
        .await
        .unwrap();
    assert_eq!(output.choices.len(), 3);
    let mut completion_tokens = 0;
    for (i, view) in output.views().iter().enumerate() {
        let mut one = body.clone();
        one.as_object_mut().unwrap().remove("n");
        one["seed"] = json!(choice_seed(5, i));
        let alone = model.generate(&request(one)).unwrap();
        assert_eq!(view.text, alone.text, "choice {i}");
        assert_eq!(view.finish_reason, Some(alone.finish_reason), "choice {i}");
        assert_eq!(view.logprobs.map(<[_]>::len), alone.logprobs.as_ref().map(Vec::len));
        completion_tokens += alone.token_ids.len() as u32;
        if i == 0 {
            assert_eq!(output.usage.prompt_tokens, alone.prompt_tokens as u32);
        }
    }
    assert_eq!(output.usage.completion_tokens, completion_tokens);
    let texts: Vec<&str> = output.views().iter().map(|v| v.text).collect();
    assert!(
        texts.iter().any(|t| *t != texts[0]),
        "sampled choices all alike: {texts:?}"
    );
    // The three after the first found the prompt's full blocks cached.
    let prompt_blocks = (model.encode_raw(&prompt()).unwrap().len() - 1) / EngineConfig::default().block_size;
    assert!(prompt_blocks >= 2);
    assert_eq!(
        engine.counters().prefix_hits.load(Ordering::Relaxed),
        3 * prompt_blocks as u64
    );
    // Greedy choices are all the same answer.
    let greedy = json!({"prompt": "abc", "raw": true, "max_tokens": 6, "n": 3});
    let output = collect(engine.submit(Request::new(request(greedy), Lane::RealTime)).unwrap())
        .await
        .unwrap();
    assert!(output.views().iter().all(|v| v.text == output.content.text()));
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn streamed_choices_come_tagged_and_add_up_to_their_texts() {
    let dir = fixture("stream");
    let model = TextModel::from_dir(&dir, &Device::Cpu).unwrap();
    let engine = TextEngine::start("tiny", model, EngineConfig::default());
    let mut streamed = request(
        json!({"prompt": prompt(), "raw": true, "max_tokens": 10, "temperature": 0.9,
                                      "seed": 2, "n": 3, "ignore_eos": true}),
    );
    streamed.stream = true;
    let mut events = engine.submit(Request::new(streamed, Lane::RealTime)).unwrap();
    let mut texts = vec![String::new(); 3];
    let output = loop {
        match events.recv().await.expect("the stream ends with its result") {
            Event::Token { text, choice, .. } => texts[choice as usize].push_str(&text),
            Event::Finished(output) => break output,
            Event::Failed(e) => panic!("{e}"),
        }
    };
    let whole: Vec<&str> = output.views().iter().map(|v| v.text).collect();
    assert_eq!(texts, whole);
    assert_eq!(output.usage.completion_tokens, 30);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn a_reader_that_leaves_cancels_every_choice() {
    let dir = fixture("cancel");
    let model = TextModel::from_dir(&dir, &Device::Cpu).unwrap();
    let engine = TextEngine::start("tiny", model, EngineConfig::default());
    let mut long = request(
        json!({"prompt": "go", "raw": true, "max_tokens": 4000, "ignore_eos": true,
                                  "temperature": 1.0, "n": 3}),
    );
    long.stream = true;
    let mut events = engine.submit(Request::new(long, Lane::RealTime)).unwrap();
    // Once some choice after the first has streamed, all three are running.
    loop {
        match events.recv().await.unwrap() {
            Event::Token { choice, .. } if choice > 0 => break,
            Event::Token { .. } => {}
            other => panic!("{other:?}"),
        }
    }
    drop(events);
    // The engine ends each sequence once it sees its stream closed (or, were
    // cancelling broken, once its 4,000 tokens are done): wait until it holds
    // none, however long the machine takes, then see which it was.
    let counters = engine.counters();
    while counters.running.load(Ordering::Relaxed) + counters.waiting.load(Ordering::Relaxed) > 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(counters.cancelled.load(Ordering::Relaxed), 3);
    assert!(counters.generated_tokens.load(Ordering::Relaxed) < 3 * 4000);
    let _ = std::fs::remove_dir_all(dir);
}
