//! Structured outputs on a real (tiny, random-weight) model: every output a
//! constraint allows to finish parses and validates; constraints inside
//! mixed-adapter continuous batches, with speculation on, give what each
//! request gives alone.

use std::path::PathBuf;
use std::sync::Arc;

use candle_core::Device;
use lorry_engine::adapters::{AdapterRef, Adapters, AdaptersConfig, LocalFiles};
use lorry_engine::fixtures::{self, Fixture};
use lorry_engine::lora::{Adapter, AdapterLimits, PackedAdapter};
use lorry_engine::models::llama::Llama;
use lorry_engine::runtime::chat::{FinishReason, TextModel};
use lorry_engine::runtime::speculative::{Proposer, SpecConfig, SpecPolicy};
use lorry_engine::runtime::text_engine::{EngineConfig, TextEngine};
use lorry_engine::{collect, Backend, Content, Lane, Request, Task, ValidRequest};
use serde_json::{json, Value};

fn fixture(which: Fixture, tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lorry-structured-{tag}-{}", std::process::id()));
    fixtures::write(which, &dir).unwrap();
    dir
}

fn request(body: Value) -> ValidRequest {
    ValidRequest::parse(Task::TextGeneration, &body).unwrap()
}

/// xorshift64*: the schemas are the same on every run.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }

    fn range(&mut self, lo: i64, hi: i64) -> i64 {
        lo + self.below((hi - lo + 1) as u64) as i64
    }
}

const NAMES: [&str; 8] = ["id", "name", "tags", "score", "ok", "kind", "items", "note"];

/// A random schema of the kinds extraction asks for: nested objects,
/// arrays with bounds, enums, bounded numbers, required and optional
/// properties, `anyOf`; strings and arrays bounded so that a random model
/// can finish them.
fn schema(rng: &mut Rng, depth: u32) -> Value {
    let kinds = if depth >= 3 { 6 } else { 9 };
    match rng.below(kinds) {
        0 => json!({"type": "boolean"}),
        1 => {
            let lo = rng.range(-50, 50);
            json!({"type": "integer", "minimum": lo, "maximum": lo + rng.range(0, 200)})
        }
        2 => json!({"type": "string", "minLength": rng.range(0, 2), "maxLength": rng.range(2, 8)}),
        3 => {
            let pool = [
                json!("red"),
                json!("green"),
                json!(3),
                json!(null),
                json!("a b"),
                json!(true),
            ];
            let n = rng.range(1, 4) as usize;
            let start = rng.below(pool.len() as u64) as usize;
            let values: Vec<Value> = (0..n).map(|i| pool[(start + i) % pool.len()].clone()).collect();
            json!({"enum": values})
        }
        4 => json!({"type": "number", "minimum": rng.range(-10, 0), "maximum": rng.range(1, 10)}),
        5 => json!({"type": "null"}),
        6 | 7 if depth < 3 => object(rng, depth),
        6 => json!({"type": "array", "items": schema(rng, depth + 1), "maxItems": rng.range(1, 3)}),
        7 => {
            let min = rng.range(0, 1);
            json!({"type": "array", "items": schema(rng, depth + 1), "minItems": min, "maxItems": min + rng.range(1, 2)})
        }
        _ => json!({"anyOf": [schema(rng, depth + 1), schema(rng, depth + 1)]}),
    }
}

fn object(rng: &mut Rng, depth: u32) -> Value {
    let n = rng.range(1, 4) as usize;
    let start = rng.below(NAMES.len() as u64) as usize;
    let names: Vec<&str> = (0..n).map(|i| NAMES[(start + i) % NAMES.len()]).collect();
    let properties: serde_json::Map<String, Value> = names
        .iter()
        .map(|name| (name.to_string(), schema(rng, depth + 1)))
        .collect();
    let required: Vec<&str> = names.iter().copied().filter(|_| rng.below(3) > 0).collect();
    json!({"type": "object", "properties": properties, "required": required, "additionalProperties": false})
}

fn text(content: &Content) -> &str {
    match content {
        Content::Text(text) => text,
        other => panic!("not text: {other:?}"),
    }
}

fn config(speculation: SpecConfig) -> EngineConfig {
    EngineConfig {
        max_seqs: 64,
        token_budget: 256,
        rt_reserved_seqs: 2,
        speculation,
        rt_step_slack_percent: 0,
        step_max_ms: 0.0,
        rt_step_max_ms: 0.0,
        ..EngineConfig::default()
    }
}

fn spec(proposer: Proposer) -> SpecConfig {
    SpecConfig {
        proposer,
        max_batch: Some(64),
        policy: SpecPolicy::Always,
        ..SpecConfig::default()
    }
}

/// The engine's handle with every adapter of `requests` resident, so each
/// request joins in submission order.
async fn with_adapters(engine: &TextEngine, requests: &[(ValidRequest, Option<AdapterRef>)]) -> TextEngine {
    let adapters = Adapters::new(Arc::new(LocalFiles), AdaptersConfig::default());
    for files in requests.iter().filter_map(|(_, a)| a.as_ref()) {
        drop(adapters.acquire(files, &engine_shape()).await.unwrap());
    }
    engine.clone().with_adapters(adapters)
}

fn engine_shape() -> lorry_engine::AdapterShape {
    let dir = fixture(Fixture::TinyLlama, "shape");
    let shape = Llama::from_dir(&dir, &Device::Cpu).unwrap().config().adapter_shape();
    let _ = std::fs::remove_dir_all(dir);
    shape
}

async fn run(
    engine: &TextEngine,
    requests: &[(ValidRequest, Option<AdapterRef>)],
) -> Vec<(String, FinishReason, Vec<u32>)> {
    let engine = with_adapters(engine, requests).await;
    let streams: Vec<_> = requests
        .iter()
        .enumerate()
        .map(|(i, (r, a))| {
            let lane = if i % 5 == 4 { Lane::RealTime } else { Lane::Batch };
            engine
                .submit(Request::new(r.clone(), lane).with_adapter(a.clone()))
                .unwrap()
        })
        .collect();
    let mut out = Vec::new();
    for stream in streams {
        let output = collect(stream).await.unwrap();
        let completion = output.completion.unwrap();
        out.push((
            text(&output.content).to_string(),
            completion.finish_reason,
            completion.token_ids,
        ));
    }
    out
}

fn lora(name: &str) -> (AdapterRef, PackedAdapter) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/lora")
        .join(name);
    let packed = Adapter::from_dir(&dir, &engine_shape(), AdapterLimits::default()).unwrap();
    (AdapterRef::local(&dir).unwrap(), PackedAdapter::new(&packed))
}

/// Each output that finished parses and validates; the rest ran out of tokens.
fn check_valid(schemas: &[Value], outputs: &[(String, FinishReason, Vec<u32>)]) -> usize {
    let mut finished = 0;
    for (i, (schema, (text, finish, _))) in schemas.iter().zip(outputs).enumerate() {
        if *finish == FinishReason::Length {
            continue;
        }
        finished += 1;
        let value: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("output {i} {text:?} is no JSON: {e}"));
        let validator = jsonschema::validator_for(schema).unwrap();
        if let Err(error) = validator.validate(&value) {
            panic!("output {i} {text} breaks its schema {schema}: {error}");
        }
    }
    finished
}

#[tokio::test]
async fn sampled_outputs_under_generated_schemas_parse_and_validate_or_end_at_the_length() {
    let dir = fixture(Fixture::TinyLlama, "schemas");
    let model = TextModel::from_dir(&dir, &Device::Cpu).unwrap();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let schemas: Vec<Value> = (0..200).map(|_| object(&mut rng, 0)).collect();
    let requests: Vec<(ValidRequest, Option<AdapterRef>)> = schemas
        .iter()
        .enumerate()
        .map(|(i, schema)| {
            let body = json!({"prompt": format!("record {i}:"), "raw": true, "temperature": 1.0, "seed": i,
                              "max_tokens": 300, "response_format": {"type": "json_schema", "json_schema": schema}});
            (request(body), None)
        })
        .collect();
    let engine = TextEngine::start("tiny", model.clone(), config(spec(Proposer::Off)));
    let outputs = run(&engine, &requests).await;
    let finished = check_valid(&schemas, &outputs);
    assert!(
        finished >= 180,
        "only {finished} of 200 outputs finished within 300 tokens"
    );

    // The first 64 in one mixed-adapter batch with speculation on.
    let (a, _) = lora("adapter-a");
    let (b, _) = lora("adapter-b");
    let mixed: Vec<(ValidRequest, Option<AdapterRef>)> = requests[..64]
        .iter()
        .enumerate()
        .map(|(i, (r, _))| (r.clone(), [None, Some(a.clone()), Some(b.clone())][i % 3].clone()))
        .collect();
    let speculating = TextEngine::start("tiny", model, config(spec(Proposer::Ngram)));
    let outputs = run(&speculating, &mixed).await;
    let finished = check_valid(&schemas[..64], &outputs);
    assert!(
        finished >= 56,
        "only {finished} of 64 outputs finished within 300 tokens"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn greedy_constrained_outputs_are_the_same_alone_batched_and_with_speculation() {
    let target = fixture(Fixture::TinyLlama, "greedy");
    let draft = fixture(Fixture::TinyLlamaDraft, "greedy-draft");
    let model = TextModel::from_dir(&target, &Device::Cpu).unwrap();
    let (a, packed_a) = lora("adapter-a");
    let adapters = [None, Some((a, packed_a))];
    let constraints = [
        json!({"response_format": {"type": "json_object"}}),
        json!({"guided_regex": "[0-9]{3}-[a-z]{2,4}( [a-z]+)?"}),
        json!({"guided_choice": ["yes", "no", "maybe so"]}),
        json!({"guided_grammar": "start: item (\",\" item)*\nitem: /[a-c]+/ | \"x\" item"}),
        json!({"guided_json": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
               "t": {"type": "array", "items": {"enum": ["p", "q"]}, "maxItems": 6}}, "required": ["n", "t"],
               "additionalProperties": false}}),
    ];
    let mut requests = Vec::new();
    for i in 0..15 {
        // Prompts that repeat themselves, so prompt lookup guesses.
        let mut body = json!({"prompt": "one two three one two three one two three ".repeat(1 + i % 3),
                              "raw": true, "max_tokens": 40});
        for (k, v) in constraints[i % constraints.len()].as_object().unwrap() {
            body[k] = v.clone();
        }
        requests.push((request(body), adapters[i % 2].clone()));
    }
    let alone: Vec<(String, FinishReason, Vec<u32>)> = requests
        .iter()
        .map(|(r, a)| {
            let g = model.generate_adapted(r, a.as_ref().map(|a| &a.1)).unwrap();
            (g.text, g.finish_reason, g.token_ids)
        })
        .collect();
    for (i, (text, finish, _)) in alone.iter().enumerate() {
        if *finish == FinishReason::Length {
            continue;
        }
        match i % constraints.len() {
            0 => assert!(serde_json::from_str::<Value>(text).unwrap().is_object(), "{text}"),
            2 => assert!(["yes", "no", "maybe so"].contains(&text.as_str()), "{text}"),
            4 => assert!(serde_json::from_str::<Value>(text).unwrap()["n"].as_u64().unwrap() < 100),
            _ => {}
        }
    }
    let by_ref: Vec<(ValidRequest, Option<AdapterRef>)> = requests
        .iter()
        .map(|(r, a)| (r.clone(), a.as_ref().map(|a| a.0.clone())))
        .collect();
    let plain = TextEngine::start("tiny", model.clone(), config(spec(Proposer::Off)));
    assert_eq!(
        run(&plain, &by_ref).await,
        alone,
        "batching changed a constrained output"
    );
    let ngram = TextEngine::start("tiny", model.clone(), config(spec(Proposer::Ngram)));
    assert_eq!(
        run(&ngram, &by_ref).await,
        alone,
        "prompt lookup changed a constrained output"
    );
    assert!(
        ngram
            .counters()
            .ngram_proposed
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0
    );
    let draft_model = Llama::from_dir(&draft, &Device::Cpu).unwrap();
    let drafted = TextEngine::start_with_draft("tiny", model, Some(draft_model), config(spec(Proposer::Draft)));
    assert_eq!(
        run(&drafted, &by_ref).await,
        alone,
        "the draft model changed a constrained output"
    );
    for dir in [target, draft] {
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[tokio::test]
async fn a_schema_too_long_for_max_tokens_ends_at_the_length_and_regexes_and_choices_hold() {
    let dir = fixture(Fixture::TinyLlama, "length");
    let model = TextModel::from_dir(&dir, &Device::Cpu).unwrap();
    let long = json!({"type": "object", "properties": {"s": {"type": "string", "minLength": 40, "maxLength": 40}},
                      "required": ["s"], "additionalProperties": false});
    let cut = model
        .generate(&request(
            json!({"prompt": "x", "raw": true, "max_tokens": 10, "guided_json": long}),
        ))
        .unwrap();
    assert_eq!(cut.finish_reason, FinishReason::Length);
    assert_eq!(cut.token_ids.len(), 10);
    assert!(cut.text.starts_with("{\"s\":\""), "{}", cut.text);

    for seed in 0..8 {
        let body = json!({"prompt": "x", "raw": true, "temperature": 1.0, "seed": seed, "max_tokens": 64,
                          "guided_regex": "(ab|cd)+[0-9]{2}"});
        let g = model.generate(&request(body)).unwrap();
        if g.finish_reason == FinishReason::Stop {
            let t = g.text.as_bytes();
            assert!(
                t.len() >= 4 && t[t.len() - 2..].iter().all(u8::is_ascii_digit),
                "{}",
                g.text
            );
            assert!(
                t[..t.len() - 2].chunks(2).all(|p| p == b"ab" || p == b"cd"),
                "{}",
                g.text
            );
        }
        let body = json!({"prompt": "x", "raw": true, "temperature": 1.0, "seed": seed,
                          "structured_outputs": {"choice": ["alpha", "beta", "al"]}});
        let g = model.generate(&request(body)).unwrap();
        assert_eq!(g.finish_reason, FinishReason::Stop);
        assert!(["alpha", "beta", "al"].contains(&g.text.as_str()), "{}", g.text);
    }

    // A string's pattern, through the engine: the one text it allows.
    let engine = TextEngine::start("tiny", model, config(spec(Proposer::Off)));
    let body = json!({"prompt": "x", "raw": true, "guided_json": {"type": "string", "pattern": "^a{2}$"}});
    let stream = engine.submit(Request::new(request(body), Lane::Batch)).unwrap();
    let output = collect(stream).await.unwrap();
    assert_eq!(text(&output.content), "\"aa\"");
    assert_eq!(output.completion.unwrap().finish_reason, FinishReason::Stop);
    let _ = std::fs::remove_dir_all(dir);
}

/// SmolLM2-135M-Instruct's GGUF, as `scripts/test` fetches it.
fn smollm2_gguf() -> PathBuf {
    let path = std::env::var_os("LORRY_TEST_SMOLLM2_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/lorry/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    assert!(
        path.exists(),
        "no SmolLM2 at {}: run the tests through scripts/test",
        path.display()
    );
    path
}

#[tokio::test]
async fn smollm2_follows_a_schema_and_a_choice_through_its_own_vocabulary() {
    let model = TextModel::open(&smollm2_gguf(), &Device::Cpu).unwrap();
    let schema = json!({"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["city", "country", "population_millions"], "additionalProperties": false});
    let question = json!([{"role": "user", "content": "What is the capital of France? Answer in JSON."}]);
    let structured = request(json!({"messages": question, "max_tokens": 64,
        "response_format": {"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}}}));
    let chosen = request(json!({"messages": question, "guided_choice": ["Paris", "London", "Rome", "Berlin"]}));
    let alone: Vec<_> = [&structured, &chosen]
        .iter()
        .map(|r| {
            let g = model.generate(r).unwrap();
            (g.text, g.finish_reason, g.token_ids)
        })
        .collect();
    assert_eq!(alone[0].1, FinishReason::Stop, "{:?}", alone[0]);
    let value: Value = serde_json::from_str(&alone[0].0).unwrap();
    assert!(jsonschema::validator_for(&schema).unwrap().is_valid(&value), "{value}");
    assert_eq!(alone[1].1, FinishReason::Stop);
    assert!(
        ["Paris", "London", "Rome", "Berlin"].contains(&alone[1].0.as_str()),
        "{:?}",
        alone[1]
    );
    assert_eq!(value["city"], "Paris", "{value}");
    // Speculating in a batch, both give what they gave alone.
    let engine = TextEngine::start("smollm2", model, config(spec(Proposer::Ngram)));
    let batched = run(&engine, &[(structured, None), (chosen, None)]).await;
    assert_eq!(batched, alone);
}
