//! Prefix caching and speculative decoding on a real (tiny) model, inside
//! mixed-adapter continuous batches: neither changes a greedy output.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use candle_core::Device;
use lorry_engine::adapters::{AdapterRef, Adapters, AdaptersConfig, LocalFiles};
use lorry_engine::fixtures::{self, Fixture};
use lorry_engine::lora::{Adapter, AdapterLimits, PackedAdapter};
use lorry_engine::models::llama::{Llama, SeqChunk};
use lorry_engine::runtime::chat::TextModel;
use lorry_engine::runtime::kv::prefix::BlockHasher;
use lorry_engine::runtime::kv::{prefix, BlockPool, BlockTable, KvCache};
use lorry_engine::runtime::speculative::{Proposer, SpecConfig, SpecPolicy};
use lorry_engine::runtime::text_engine::{Counters, EngineConfig, TextEngine};
use lorry_engine::{collect, AdapterShape, Backend, Lane, Request, Task, ValidRequest};
use serde_json::{json, Value};

fn fixture(which: Fixture, tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lorry-spec-{tag}-{}", std::process::id()));
    fixtures::write(which, &dir).unwrap();
    dir
}

fn request(body: Value) -> ValidRequest {
    ValidRequest::parse(Task::TextGeneration, &body).unwrap()
}

/// A test adapter: packed for the reference model, and the engine's reference to its files.
#[derive(Clone)]
struct TestAdapter {
    packed: Arc<PackedAdapter>,
    files: AdapterRef,
    shape: AdapterShape,
}

impl std::ops::Deref for TestAdapter {
    type Target = PackedAdapter;

    fn deref(&self) -> &PackedAdapter {
        &self.packed
    }
}

fn adapter(name: &str, model: &TextModel) -> TestAdapter {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/lora")
        .join(name);
    let packed = Adapter::from_dir(&dir, &model.model.config().adapter_shape(), AdapterLimits::default()).unwrap();
    TestAdapter {
        packed: Arc::new(PackedAdapter::new(&packed)),
        files: AdapterRef::local(&dir).unwrap(),
        shape: model.model.config().adapter_shape(),
    }
}

fn config(speculation: SpecConfig, prefix_cache: bool) -> EngineConfig {
    EngineConfig {
        max_seqs: 16,
        token_budget: 64,
        rt_reserved_seqs: 2,
        prefix_cache,
        speculation,
        // Steps planned by the rules alone, not by the clock: step counts compare.
        rt_step_slack_percent: 0,
        step_max_ms: 0.0,
        rt_step_max_ms: 0.0,
        ..EngineConfig::default()
    }
}

/// Guessing in every step: step counts and seeded draws compare run to run
/// (the measured policy decides by the clock).
fn spec(proposer: Proposer) -> SpecConfig {
    SpecConfig {
        proposer,
        max_batch: Some(16),
        policy: SpecPolicy::Always,
        ..SpecConfig::default()
    }
}

/// Run every request at once, each with its adapter; token ids in order.
async fn run(engine: &TextEngine, requests: &[(ValidRequest, Option<TestAdapter>)]) -> Vec<Vec<u32>> {
    // A handle of the same engine that loads adapters from their
    // directories, every one resident first: each request then joins the
    // engine in submission order, so step counts compare run to run.
    let adapters = Adapters::new(Arc::new(LocalFiles), AdaptersConfig::default());
    for a in requests.iter().filter_map(|(_, a)| a.as_ref()) {
        drop(adapters.acquire(&a.files, &a.shape).await.unwrap());
    }
    let engine = engine.clone().with_adapters(adapters);
    let streams: Vec<_> = requests
        .iter()
        .enumerate()
        .map(|(i, (r, a))| {
            let lane = if i % 4 == 3 { Lane::RealTime } else { Lane::Batch };
            let adapter = a.as_ref().map(|a| a.files.clone());
            engine
                .submit(Request::new(r.clone(), lane).with_adapter(adapter))
                .unwrap()
        })
        .collect();
    let mut out = Vec::new();
    for stream in streams {
        out.push(collect(stream).await.unwrap().completion.unwrap().token_ids);
    }
    out
}

fn load(counter: &std::sync::atomic::AtomicU64) -> u64 {
    counter.load(Ordering::Relaxed)
}

/// Greedy requests whose prompts repeat themselves, for base and two
/// adapters, mixed in one batch.
fn repetitive(model: &TextModel) -> Vec<(ValidRequest, Option<TestAdapter>)> {
    let adapters = [
        None,
        Some(adapter("adapter-a", model)),
        Some(adapter("adapter-b", model)),
    ];
    (0..9)
        .map(|i| {
            let phrase = ["one two three four ", "alpha beta gamma ", "the cat sat on the mat "][i % 3];
            let body =
                json!({"prompt": phrase.repeat(3 + i % 4), "raw": true, "max_tokens": 24 + 4 * i, "ignore_eos": true});
            (request(body), adapters[(i / 3 + i) % 3].clone())
        })
        .collect()
}

#[tokio::test]
async fn greedy_output_is_the_same_with_and_without_speculation_for_both_proposers() {
    let target = fixture(Fixture::TinyLlama, "target");
    let draft = fixture(Fixture::TinyLlamaDraft, "draft");
    let model = TextModel::from_dir(&target, &Device::Cpu).unwrap();
    let requests = repetitive(&model);
    let plain = TextEngine::start("tiny", model.clone(), config(spec(Proposer::Off), false));
    let want = run(&plain, &requests).await;
    for (i, ((r, a), tokens)) in requests.iter().zip(&want).enumerate() {
        let alone = model.generate_adapted(r, a.as_deref()).unwrap();
        assert_eq!(tokens, &alone.token_ids, "request {i} without speculation");
    }
    assert_eq!(load(&plain.counters().ngram_proposed), 0);

    let ngram = TextEngine::start("tiny", model.clone(), config(spec(Proposer::Ngram), true));
    assert_eq!(run(&ngram, &requests).await, want, "prompt lookup changed an output");
    let c = ngram.counters();
    assert!(load(&c.ngram_accepted) > 0, "prompt lookup guessed nothing right");
    // Steps saved, each request alone: in a mixed batch the step count also
    // depends on when each request joined the running engine, which the
    // clock decides.
    let (mut with, mut without) = (0, 0);
    for (i, request) in requests.iter().enumerate() {
        let steps = |engine: &TextEngine| load(&engine.counters().steps);
        let (before_with, before_without) = (steps(&ngram), steps(&plain));
        assert_eq!(run(&ngram, std::slice::from_ref(request)).await[0], want[i]);
        assert_eq!(run(&plain, std::slice::from_ref(request)).await[0], want[i]);
        let (alone_with, alone_without) = (steps(&ngram) - before_with, steps(&plain) - before_without);
        assert!(
            alone_with <= alone_without,
            "request {i}: {alone_with} steps with speculation, {alone_without} without"
        );
        (with, without) = (with + alone_with, without + alone_without);
    }
    assert!(with < without, "speculation saved no step: {with} vs {without}");

    let draft_model = Llama::from_dir(&draft, &Device::Cpu).unwrap();
    let drafted = TextEngine::start_with_draft(
        "tiny",
        model.clone(),
        Some(draft_model),
        config(spec(Proposer::Draft), true),
    );
    assert_eq!(
        run(&drafted, &requests).await,
        want,
        "the draft model changed an output"
    );
    let c = drafted.counters();
    assert!(
        load(&c.draft_proposed) > 0 && load(&c.draft_accepted) > 0,
        "the draft guessed nothing right"
    );
    assert_eq!(load(&c.ngram_proposed), 0);

    // The measured policy: whatever it decides step by step, the same output.
    let measured = TextEngine::start(
        "tiny",
        model.clone(),
        config(
            SpecConfig {
                policy: SpecPolicy::Measured,
                ..spec(Proposer::Ngram)
            },
            true,
        ),
    );
    assert_eq!(
        run(&measured, &requests).await,
        want,
        "the measured policy changed an output"
    );

    // A batch larger than the policy's limit does not speculate.
    let mut limited = spec(Proposer::Ngram);
    limited.max_batch = Some(0);
    let off = TextEngine::start("tiny", model.clone(), config(limited, false));
    assert_eq!(run(&off, &requests).await, want);
    assert_eq!(load(&off.counters().ngram_proposed), 0);
    for dir in [target, draft] {
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[tokio::test]
async fn sampled_requests_speculate_when_asked_and_keep_their_limits() {
    let target = fixture(Fixture::TinyLlama, "sampled");
    let model = TextModel::from_dir(&target, &Device::Cpu).unwrap();
    let mut sampled = spec(Proposer::Ngram);
    sampled.sampled = true;
    let engine = TextEngine::start("tiny", model.clone(), config(sampled, true));
    // Cold enough that the tiny random model's text repeats, so prompt lookup guesses.
    let requests: Vec<_> = (0..6)
        .map(|i| {
            let body = json!({"prompt": "a b c a b c a b c ".repeat(2), "raw": true, "max_tokens": 30 + i,
                              "ignore_eos": true, "temperature": 0.05, "seed": i});
            (request(body), None)
        })
        .collect();
    let outputs = run(&engine, &requests).await;
    for (i, tokens) in outputs.iter().enumerate() {
        assert_eq!(tokens.len(), 30 + i, "request {i} keeps its max_tokens");
    }
    assert!(load(&engine.counters().ngram_proposed) > 0);
    // Seeded sampling is reproducible when the batch is the same.
    let again = TextEngine::start("tiny", model, config(sampled, true));
    assert_eq!(run(&again, &requests).await, outputs);
    let _ = std::fs::remove_dir_all(target);
}

fn counters(c: &Counters) -> (u64, u64, u64) {
    (load(&c.prefix_hits), load(&c.prefix_misses), load(&c.prefix_evicted))
}

#[tokio::test]
async fn cached_prefixes_are_reused_only_under_the_same_adapter_and_change_no_output() {
    let dir = fixture(Fixture::TinyLlama, "prefix");
    let model = TextModel::from_dir(&dir, &Device::Cpu).unwrap();
    let a = adapter("adapter-a", &model);
    let engine = TextEngine::start("tiny", model.clone(), config(spec(Proposer::Off), true));
    let context = "Answer from this context only. ".repeat(4);
    let ask = |question: &str, adapter: &Option<TestAdapter>| {
        let body = json!({"prompt": format!("{context}{question}"), "raw": true, "max_tokens": 8, "ignore_eos": true});
        (request(body), adapter.clone())
    };
    let mut seen = (0, 0, 0);
    let mut step = |engine: &TextEngine| {
        let now = counters(engine.counters());
        let delta = (now.0 - seen.0, now.1 - seen.1);
        seen = now;
        delta
    };
    for (question, adapter, hits) in [
        ("Who?", None, false),
        ("Where?", None, true),
        ("Who?", Some(a.clone()), false),
        ("When?", Some(a.clone()), true),
        ("Why?", None, true),
    ] {
        let r = ask(question, &adapter);
        let got = run(&engine, std::slice::from_ref(&r)).await;
        let alone = model.generate_adapted(&r.0, r.1.as_deref()).unwrap();
        assert_eq!(got[0], alone.token_ids, "{question} with {:?}", adapter.is_some());
        let (hit, missed) = step(&engine);
        if hits {
            assert!(hit >= 7 && missed <= 1, "{question}: {hit} hits, {missed} misses");
        } else {
            assert_eq!(hit, 0, "{question}: nothing cached under this adapter yet");
        }
    }

    // Eviction pressure: a cache of 24 blocks, prompts of 8 to 11 blocks, many prefixes.
    let small = EngineConfig {
        kv_cache_bytes: 24 * model.model.kv_layout(16).bytes_per_block(),
        max_seqs: 4,
        rt_reserved_seqs: 1,
        ..config(spec(Proposer::Ngram), true)
    };
    let engine = TextEngine::start("tiny", model.clone(), small);
    let requests: Vec<_> = (0..12)
        .map(|i| {
            let body = json!({"prompt": format!("{} {}", ["north ", "south ", "east "][i % 3].repeat(24 + i), i),
                              "raw": true, "max_tokens": 10, "ignore_eos": true});
            (request(body), if i % 2 == 0 { None } else { Some(a.clone()) })
        })
        .collect();
    let outputs = run(&engine, &requests).await;
    for (i, ((r, adapter), tokens)) in requests.iter().zip(&outputs).enumerate() {
        assert_eq!(
            tokens,
            &model.generate_adapted(r, adapter.as_deref()).unwrap().token_ids,
            "request {i}"
        );
    }
    let (hits, _, evicted) = counters(engine.counters());
    assert!(hits > 0 && evicted > 0, "{hits} hits, {evicted} evictions");
    let _ = std::fs::remove_dir_all(dir);
}

/// Logits after a prompt whose first blocks come, shared and unchanged, from
/// another sequence's cache equal those of a full pre-fill (within 1e-4).
#[test]
fn a_shared_prefix_gives_the_logits_of_a_full_prefill() {
    let dir = fixture(Fixture::TinyLlama, "logits");
    let model = TextModel::from_dir(&dir, &Device::Cpu).unwrap();
    let llama = &model.model;
    let a = adapter("adapter-a", &model);
    let layout = llama.kv_layout(16);
    let shared: Vec<u32> = (0..40).map(|i| (i * 7 % 250) as u32 + 3).collect();
    let mut second = shared[..32].to_vec();
    second.extend([9, 8, 7, 6, 5, 4, 3, 21, 22, 23, 24, 25, 26]);
    for adapter in [None, Some(&*a)] {
        let mut pool = BlockPool::new(32, 16);
        let mut kv = KvCache::new(layout, 32);
        let ns = prefix::namespace("tiny", adapter.map(PackedAdapter::key), None);
        // The first sequence computes its prompt and its full blocks are cached.
        let mut first = BlockTable::default();
        first.append(&mut pool, shared.len()).unwrap();
        let chunk = |tokens, start, blocks, adapter| SeqChunk {
            tokens,
            start,
            blocks,
            logits: 1,
            adapter,
        };
        llama
            .forward_batch(&[chunk(&shared, 0, first.blocks(), adapter)], &mut kv)
            .unwrap();
        let mut hasher = BlockHasher::new(ns, 16);
        for (block, hash) in first.blocks().iter().zip(hasher.update(&shared)) {
            pool.register(*block, *hash);
        }
        // The second finds its two leading blocks and computes only the rest.
        let mut hasher = BlockHasher::new(ns, 16);
        let found = pool.claim(hasher.update(&second[..second.len() - 1]));
        assert_eq!(found.len(), 2);
        assert_eq!(&found[..], &first.blocks()[..2], "shared, not copied");
        let mut table = BlockTable::shared(&pool, found);
        table.append(&mut pool, second.len() - 32).unwrap();
        let cached = llama
            .forward_batch(&[chunk(&second[32..], 32, table.blocks(), adapter)], &mut kv)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        // Against the whole prompt computed from scratch.
        let mut fresh_kv = KvCache::new(layout, 8);
        let mut fresh_pool = BlockPool::new(8, 16);
        let mut fresh = BlockTable::default();
        fresh.append(&mut fresh_pool, second.len()).unwrap();
        let full = llama
            .forward_batch(&[chunk(&second, 0, fresh.blocks(), adapter)], &mut fresh_kv)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        for (x, y) in cached[0].iter().zip(&full[0]) {
            assert!((x - y).abs() <= 1e-4 * y.abs().max(1.0), "{x} vs {y}");
        }
        // A different adapter finds nothing.
        let other = prefix::namespace("tiny", Some(&[0; 32]), None);
        assert_eq!(pool.cached_prefix(BlockHasher::new(other, 16).update(&second)).0, 0);
    }
    let _ = std::fs::remove_dir_all(dir);
}
