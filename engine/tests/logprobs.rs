//! Log-probabilities: against transformers on the tiny fixtures (within
//! 1e-4), the same alone, batched, streamed and with speculation, and always
//! the model's own distribution — before temperature, filters and a
//! constraint's mask. Reference data: `tests/reference/make_logprobs_reference.py`.

use std::path::PathBuf;

use candle_core::Device;
use lorry_engine::fixtures::{self, Fixture};
use lorry_engine::input::Prompt;
use lorry_engine::models::llama::Llama;
use lorry_engine::runtime::chat::TextModel;
use lorry_engine::runtime::speculative::{Proposer, SpecConfig, SpecPolicy};
use lorry_engine::runtime::text_engine::{EngineConfig, TextEngine};
use lorry_engine::{collect, Backend, Event, Lane, Output, Request, Task, TokenLogprob, ValidRequest};
use serde_json::{json, Value};

/// The most a log-probability may differ from transformers' (float32 sums in another order).
const TOLERANCE: f32 = 1e-4;

fn fixture(which: Fixture, tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lorry-logprobs-{tag}-{}", std::process::id()));
    fixtures::write(which, &dir).unwrap();
    dir
}

fn reference(name: &str) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(format!("logprobs-{name}.json"));
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn ids(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

/// The reference's prompt (token ids, used as they are), greedy, as many
/// tokens as it recorded, end tokens ignored, `top` alternatives.
fn request(reference: &Value, extra: Value) -> ValidRequest {
    let steps = reference["steps"].as_array().unwrap().len();
    let mut body = json!({"prompt": "-", "raw": true, "max_tokens": steps, "ignore_eos": true,
                          "logprobs": true, "top_logprobs": reference["top"]});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    let mut request = ValidRequest::parse(Task::TextGeneration, &body).unwrap();
    request.prompt = Prompt::Tokens(ids(&reference["prompt_ids"]));
    request
}

/// Every position's token, log-probability and alternatives as transformers gives them.
fn check_against_reference(name: &str, model: &TextModel, reference: &Value, token_ids: &[u32], got: &[TokenLogprob]) {
    let bytes = model.grammars();
    let bytes = bytes.token_bytes();
    let steps = reference["steps"].as_array().unwrap();
    assert_eq!(got.len(), steps.len(), "{name}: one entry a generated token");
    for (i, (step, item)) in steps.iter().zip(got).enumerate() {
        let token = step["token"].as_u64().unwrap() as u32;
        assert_eq!(token_ids[i], token, "{name}: token {i} differs from transformers");
        assert_eq!(item.bytes, bytes[token as usize], "{name}: token {i}'s bytes");
        assert_eq!(item.token, TokenLogprob::spell(&item.bytes));
        let want = step["logprob"].as_f64().unwrap() as f32;
        assert!(
            (item.logprob - want).abs() <= TOLERANCE,
            "{name}: token {i}'s logprob {} against transformers' {want}",
            item.logprob
        );
        let top_ids = ids(&step["top_ids"]);
        assert_eq!(item.top_logprobs.len(), top_ids.len());
        for (j, (alt, id)) in item.top_logprobs.iter().zip(&top_ids).enumerate() {
            assert_eq!(alt.bytes, bytes[*id as usize], "{name}: position {i}'s alternative {j}");
            let want = step["top_logprobs"][j].as_f64().unwrap() as f32;
            assert!(
                (alt.logprob - want).abs() <= TOLERANCE,
                "{name}: position {i}'s alternative {j}: {} against {want}",
                alt.logprob
            );
        }
    }
}

fn check(name: &str, which: Fixture) {
    let dir = fixture(which, name);
    let model = TextModel::from_dir(&dir, &Device::Cpu).unwrap();
    let expected = reference(name);
    let generation = model.generate(&request(&expected, json!({}))).unwrap();
    let logprobs = generation.logprobs.expect("logprobs were asked for");
    check_against_reference(name, &model, &expected, &generation.token_ids, &logprobs);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn tiny_llama_logprobs_match_transformers() {
    check("tiny-llama", Fixture::TinyLlama);
}

#[test]
fn tiny_qwen2_logprobs_match_transformers() {
    check("tiny-qwen2", Fixture::TinyQwen2);
}

#[test]
fn tiny_gemma_logprobs_match_transformers() {
    check("tiny-gemma", Fixture::TinyGemma);
}

fn config(proposer: Proposer) -> EngineConfig {
    EngineConfig {
        max_seqs: 16,
        token_budget: 256,
        rt_reserved_seqs: 2,
        speculation: SpecConfig {
            proposer,
            max_batch: Some(64),
            policy: SpecPolicy::Always,
            ..SpecConfig::default()
        },
        rt_step_slack_percent: 0,
        step_max_ms: 0.0,
        rt_step_max_ms: 0.0,
        ..EngineConfig::default()
    }
}

/// `request` among seven others (sampled, repetitive, with and without
/// logprobs), its output, and its streamed pieces joined.
async fn batched(engine: &TextEngine, request: &ValidRequest) -> (Output, String, Vec<TokenLogprob>) {
    let mut streams = Vec::new();
    for i in 0..7u64 {
        let body = json!({"prompt": "ab ab ab ab ab ab ".repeat(1 + i as usize % 3), "raw": true,
                          "max_tokens": 12 + i, "temperature": 0.8, "seed": i, "logprobs": i % 2 == 0});
        let other = ValidRequest::parse(Task::TextGeneration, &body).unwrap();
        streams.push(engine.submit(Request::new(other, Lane::Batch)).unwrap());
    }
    let mut streamed = request.clone();
    streamed.stream = true;
    let mut events = engine.submit(Request::new(streamed, Lane::RealTime)).unwrap();
    let (mut text, mut pieces, mut output) = (String::new(), Vec::new(), None);
    while let Some(event) = events.recv().await {
        match event {
            Event::Token { text: t, logprobs, .. } => {
                text.push_str(&t);
                pieces.extend(logprobs);
            }
            Event::Finished(o) => output = Some(o),
            Event::Failed(e) => panic!("{e}"),
        }
    }
    for stream in streams {
        collect(stream).await.unwrap();
    }
    (output.expect("the request finished"), text, pieces)
}

#[tokio::test]
async fn batched_streamed_and_speculative_logprobs_are_those_of_the_request_alone() {
    let target = fixture(Fixture::TinyLlama, "engine");
    let draft = fixture(Fixture::TinyLlamaDraft, "engine-draft");
    let model = TextModel::from_dir(&target, &Device::Cpu).unwrap();
    let expected = reference("tiny-llama");
    let request = request(&expected, json!({}));
    let alone = model.generate(&request).unwrap();
    let alone_logprobs = alone.logprobs.clone().unwrap();
    let engines = [
        (
            "no speculation",
            TextEngine::start("tiny", model.clone(), config(Proposer::Off)),
        ),
        (
            "prompt lookup",
            TextEngine::start("tiny", model.clone(), config(Proposer::Ngram)),
        ),
        (
            "a draft model",
            TextEngine::start_with_draft(
                "tiny",
                model.clone(),
                Some(Llama::from_dir(&draft, &Device::Cpu).unwrap()),
                config(Proposer::Draft),
            ),
        ),
    ];
    for (what, engine) in engines {
        let (output, text, pieces) = batched(&engine, &request).await;
        let logprobs = output.logprobs.clone().expect("logprobs were asked for");
        let token_ids = output.completion.as_ref().unwrap().token_ids.clone();
        assert_eq!(token_ids, alone.token_ids, "{what}: tokens");
        check_against_reference(what, &model, &expected, &token_ids, &logprobs);
        // The same positions, the same alternatives, the same values to the
        // last place or within the reference tolerance (a verification pass
        // scores several positions at once).
        for (i, (a, b)) in logprobs.iter().zip(&alone_logprobs).enumerate() {
            assert_eq!(a.bytes, b.bytes);
            assert!((a.logprob - b.logprob).abs() <= TOLERANCE, "{what}: position {i}");
            let alts = |t: &TokenLogprob| t.top_logprobs.iter().map(|x| x.bytes.clone()).collect::<Vec<_>>();
            assert_eq!(alts(a), alts(b), "{what}: position {i}'s alternatives");
        }
        assert_eq!(text, output.content.text(), "{what}: streamed text");
        assert_eq!(
            pieces, logprobs,
            "{what}: streamed logprobs are the final ones, in order"
        );
    }
    for dir in [target, draft] {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// log-softmax of the model's logits after each prefix, as the request's tokens were generated.
fn teacher_forced(model: &TextModel, prompt: &[u32], generated: &[u32]) -> Vec<Vec<f32>> {
    let mut cache = model.model.new_cache();
    let mut input = prompt.to_vec();
    let mut out = Vec::new();
    for &token in generated {
        let logits = model
            .model
            .forward(&input, &mut cache)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let z = max + logits.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
        out.push(logits.iter().map(|&x| (x as f64 - z) as f32).collect());
        input = vec![token];
    }
    out
}

#[test]
fn logprobs_are_the_models_own_whatever_the_temperature_filters_or_constraint() {
    let dir = fixture(Fixture::TinyLlama, "raw");
    let model = TextModel::from_dir(&dir, &Device::Cpu).unwrap();
    let cases = [
        json!({"temperature": 2.5, "seed": 7}),
        json!({"temperature": 0.7, "top_k": 3, "top_p": 0.5, "seed": 1}),
        json!({"guided_choice": ["alpha beta", "gamma"], "max_tokens": 20, "ignore_eos": false}),
        json!({"guided_regex": "[a-f]{3,9}", "temperature": 1.0, "seed": 3, "max_tokens": 20, "ignore_eos": false}),
    ];
    let expected = reference("tiny-llama");
    let prompt = ids(&expected["prompt_ids"]);
    for case in cases {
        let generation = model.generate(&request(&expected, case.clone())).unwrap();
        let logprobs = generation.logprobs.unwrap();
        // Every generated token is scored (an end token that finished a constrained output excepted).
        let scored = &generation.token_ids[..logprobs.len()];
        assert!(generation.token_ids.len() - logprobs.len() <= 1, "{case}");
        let want = teacher_forced(&model, &prompt, scored);
        for (i, (item, row)) in logprobs.iter().zip(&want).enumerate() {
            let token = scored[i] as usize;
            assert!(
                (item.logprob - row[token]).abs() <= 1e-5,
                "{case}: position {i}: {} against the model's {}",
                item.logprob,
                row[token]
            );
            // The alternatives are the model's best, whatever the constraint allows.
            let best = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert!(
                (item.top_logprobs[0].logprob - best).abs() <= 1e-5,
                "{case}: position {i}"
            );
            assert!(item.top_logprobs.windows(2).all(|w| w[0].logprob >= w[1].logprob));
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn without_logprobs_none_are_reported_and_top_zero_reports_the_chosen_token_alone() {
    let dir = fixture(Fixture::TinyLlama, "off");
    let model = TextModel::from_dir(&dir, &Device::Cpu).unwrap();
    let expected = reference("tiny-llama");
    let mut off = request(&expected, json!({}));
    off.sampling.logprobs = None;
    assert_eq!(model.generate(&off).unwrap().logprobs, None);
    let chosen_only = model.generate(&request(&expected, json!({"top_logprobs": 0}))).unwrap();
    let logprobs = chosen_only.logprobs.unwrap();
    assert_eq!(logprobs.len(), chosen_only.token_ids.len());
    assert!(logprobs.iter().all(|l| l.top_logprobs.is_empty() && l.logprob <= 0.0));
    let _ = std::fs::remove_dir_all(dir);
}
