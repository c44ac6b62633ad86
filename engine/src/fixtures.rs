//! `lorry fixtures`: small random-weight models in Hugging Face layout
//! (`config.json`, `model.safetensors`, `tokenizer.json`,
//! `tokenizer_config.json`), seeded and reproducible bit for bit, so that tests
//! and reference data need no model hub.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};

use crate::models::ModelError;
use crate::runtime::rng::SplitMix;

/// The models `lorry fixtures` can write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fixture {
    /// A two-layer Llama with grouped-query attention and `llama3` rope scaling.
    TinyLlama,
    /// A two-layer Qwen2: q/k/v biases, tied embeddings, four query heads per KV head.
    TinyQwen2,
    /// A two-layer Gemma: GeGLU, offset RMSNorm, scaled embeddings, a given head_dim.
    TinyGemma,
    /// A two-layer BERT encoder for embeddings.
    TinyBert,
    /// The ~156M-parameter Llama the benchmarks use.
    Bench,
    /// A draft for `tiny-llama`: its first layer, embeddings and head (the
    /// same tensors, so that greedy guesses are often right).
    TinyLlamaDraft,
    /// A draft for `bench` with weights of its own (two layers, hidden 256,
    /// the same tokenizer): with random weights its guesses agree with the
    /// target no more than chance, which measures speculation's cost.
    BenchDraft,
    /// A draft for `bench` made of its first two layers, embeddings and head.
    BenchDraftShared,
    /// `bench` with its projections at a twentieth of the scale (the same
    /// seeds): each layer nudges the residual stream instead of overwriting
    /// it, so the next token depends mostly on the recent ones, greedy text
    /// repeats what followed the same tokens before (as a trained model
    /// copies from its prompt), and a draft made of its first layers guesses
    /// well. A step costs what a `bench` step costs.
    BenchSmooth,
    /// `bench-smooth`'s first two layers, embeddings and head: its draft.
    BenchSmoothDraft,
}

impl Fixture {
    /// Parse the name used on the command line.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "tiny-llama" => Some(Fixture::TinyLlama),
            "tiny-qwen2" => Some(Fixture::TinyQwen2),
            "tiny-gemma" => Some(Fixture::TinyGemma),
            "tiny-bert" => Some(Fixture::TinyBert),
            "bench" => Some(Fixture::Bench),
            "tiny-llama-draft" => Some(Fixture::TinyLlamaDraft),
            "bench-draft" => Some(Fixture::BenchDraft),
            "bench-draft-shared" => Some(Fixture::BenchDraftShared),
            "bench-smooth" => Some(Fixture::BenchSmooth),
            "bench-smooth-draft" => Some(Fixture::BenchSmoothDraft),
            _ => None,
        }
    }

    /// The names `parse` accepts.
    pub const NAMES: [&'static str; 10] = [
        "tiny-llama",
        "tiny-qwen2",
        "tiny-gemma",
        "tiny-bert",
        "bench",
        "tiny-llama-draft",
        "bench-draft",
        "bench-draft-shared",
        "bench-smooth",
        "bench-smooth-draft",
    ];

    /// How much larger than `1/√fan_in` the projections' standard deviation is.
    fn gain(self) -> f64 {
        match self {
            Fixture::BenchSmooth | Fixture::BenchSmoothDraft => 0.1,
            _ => 2.0,
        }
    }

    /// What seeds the weights: drafts made of their target's first layers
    /// share its seeds (and so its tensors); others have their own.
    fn salt(self) -> &'static str {
        match self {
            Fixture::BenchDraft => "bench-draft/",
            _ => "",
        }
    }

    pub(crate) fn config(self) -> Value {
        let common = json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "torch_dtype": "float32",
            "bos_token_id": 0,
            "eos_token_id": 1,
            "pad_token_id": 2,
            "rms_norm_eps": 1e-5,
            "hidden_act": "silu",
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": true,
        });
        let specific = match self {
            Fixture::TinyLlama => json!({
                "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 288,
                "max_position_embeddings": 2048, "rope_theta": 10000.0, "tie_word_embeddings": false,
                "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            }),
            Fixture::TinyQwen2 => json!({
                "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 288,
                "max_position_embeddings": 512, "rope_theta": 1000000.0, "tie_word_embeddings": true,
                "rms_norm_eps": 1e-6, "use_sliding_window": false,
            }),
            Fixture::TinyGemma => json!({
                "architectures": ["GemmaForCausalLM"], "model_type": "gemma",
                "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 288,
                "max_position_embeddings": 512, "rope_theta": 10000.0, "tie_word_embeddings": true,
                "rms_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
            }),
            Fixture::TinyBert => {
                return json!({
                    "architectures": ["BertModel"], "model_type": "bert", "torch_dtype": "float32",
                    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
                    "hidden_act": "gelu", "max_position_embeddings": 128, "type_vocab_size": 2, "vocab_size": 288,
                    "layer_norm_eps": 1e-12, "pad_token_id": 2, "hidden_dropout_prob": 0.0,
                    "attention_probs_dropout_prob": 0.0, "position_embedding_type": "absolute",
                })
            }
            Fixture::Bench => json!({
                "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
                "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000,
                "max_position_embeddings": 4096, "rope_theta": 10000.0, "tie_word_embeddings": false,
            }),
            Fixture::BenchDraft => json!({
                "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 32000,
                "max_position_embeddings": 4096, "rope_theta": 10000.0, "tie_word_embeddings": false,
            }),
            Fixture::BenchSmooth => return Fixture::Bench.config(),
            Fixture::TinyLlamaDraft | Fixture::BenchDraftShared | Fixture::BenchSmoothDraft => {
                let (target, layers) = match self {
                    Fixture::TinyLlamaDraft => (Fixture::TinyLlama, 1),
                    _ => (Fixture::Bench, 2),
                };
                let mut config = target.config();
                config["num_hidden_layers"] = json!(layers);
                return config;
            }
        };
        let mut config = common;
        if let (Some(c), Some(s)) = (config.as_object_mut(), specific.as_object()) {
            c.extend(s.clone());
        }
        config
    }
}

fn seed_for(name: &str) -> u64 {
    // FNV-1a over the tensor name: each tensor's values do not depend on the others.
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

fn random(name: &str, shape: &[usize], mean: f64, std: f64) -> candle_core::Result<Tensor> {
    let mut rng = SplitMix::new(seed_for(name));
    let n: usize = shape.iter().product();
    let values: Vec<f32> = (0..n).map(|_| (mean + std * rng.normal()) as f32).collect();
    Tensor::from_vec(values, shape, &Device::Cpu)
}

fn llama_weights(config: &Value, salt: &str, gain: f64) -> candle_core::Result<HashMap<String, Tensor>> {
    let get = |k: &str| config[k].as_u64().unwrap_or(0) as usize;
    let (h, inter, vocab) = (get("hidden_size"), get("intermediate_size"), get("vocab_size"));
    let (heads, kv) = (get("num_attention_heads"), get("num_key_value_heads"));
    let d = config["head_dim"].as_u64().map_or(h / heads, |d| d as usize);
    let qwen2 = config["model_type"] == "qwen2";
    // Gemma stores RMSNorm weights as offsets from 1.
    let norm_mean = if config["model_type"] == "gemma" { 0.0 } else { 1.0 };
    let mut w = HashMap::new();
    let mut add = |name: String, shape: &[usize], mean: f64, std: f64| {
        let t = random(&format!("{salt}{name}"), shape, mean, std)?;
        w.insert(name, t);
        Ok::<_, candle_core::Error>(())
    };
    let tied = config["tie_word_embeddings"].as_bool().unwrap_or(false);
    // Gemma multiplies embeddings by √hidden: start them that much smaller.
    let embed_std = if norm_mean == 0.0 { 1.0 / (h as f64).sqrt() } else { 1.0 };
    add("model.embed_tokens.weight".into(), &[vocab, h], 0.0, embed_std)?;
    for i in 0..get("num_hidden_layers") {
        let p = format!("model.layers.{i}");
        // Twice the usual scale (`gain`): random layers then change the residual stream
        // enough that greedy output depends on the context rather than repeating itself.
        let linear_std = |fan_in: usize| gain / (fan_in as f64).sqrt();
        for (proj, out) in [("q_proj", heads * d), ("k_proj", kv * d), ("v_proj", kv * d)] {
            add(format!("{p}.self_attn.{proj}.weight"), &[out, h], 0.0, linear_std(h))?;
            if qwen2 {
                add(format!("{p}.self_attn.{proj}.bias"), &[out], 0.0, 0.1)?;
            }
        }
        add(
            format!("{p}.self_attn.o_proj.weight"),
            &[h, heads * d],
            0.0,
            linear_std(heads * d),
        )?;
        add(format!("{p}.mlp.gate_proj.weight"), &[inter, h], 0.0, linear_std(h))?;
        add(format!("{p}.mlp.up_proj.weight"), &[inter, h], 0.0, linear_std(h))?;
        add(format!("{p}.mlp.down_proj.weight"), &[h, inter], 0.0, linear_std(inter))?;
        add(format!("{p}.input_layernorm.weight"), &[h], norm_mean, 0.1)?;
        add(format!("{p}.post_attention_layernorm.weight"), &[h], norm_mean, 0.1)?;
    }
    add("model.norm.weight".into(), &[h], norm_mean, 0.1)?;
    if !tied {
        add("lm_head.weight".into(), &[vocab, h], 0.0, 1.0 / (h as f64).sqrt())?;
    }
    Ok(w)
}

fn put(w: &mut HashMap<String, Tensor>, name: String, shape: &[usize], mean: f64, std: f64) -> candle_core::Result<()> {
    let t = random(&name, shape, mean, std)?;
    w.insert(name, t);
    Ok(())
}

fn bert_weights(config: &Value) -> candle_core::Result<HashMap<String, Tensor>> {
    let get = |k: &str| config[k].as_u64().unwrap_or(0) as usize;
    let (h, inter) = (get("hidden_size"), get("intermediate_size"));
    let mut w = HashMap::new();
    put(
        &mut w,
        "embeddings.word_embeddings.weight".into(),
        &[get("vocab_size"), h],
        0.0,
        1.0,
    )?;
    put(
        &mut w,
        "embeddings.position_embeddings.weight".into(),
        &[get("max_position_embeddings"), h],
        0.0,
        0.5,
    )?;
    put(
        &mut w,
        "embeddings.token_type_embeddings.weight".into(),
        &[get("type_vocab_size"), h],
        0.0,
        0.5,
    )?;
    let mut norms = vec!["embeddings.LayerNorm".to_string()];
    for i in 0..get("num_hidden_layers") {
        let p = format!("encoder.layer.{i}");
        let dense = [
            ("attention.self.query", h, h),
            ("attention.self.key", h, h),
            ("attention.self.value", h, h),
            ("attention.output.dense", h, h),
            ("intermediate.dense", inter, h),
            ("output.dense", h, inter),
        ];
        for (name, out, fan_in) in dense {
            put(
                &mut w,
                format!("{p}.{name}.weight"),
                &[out, fan_in],
                0.0,
                2.0 / (fan_in as f64).sqrt(),
            )?;
            put(&mut w, format!("{p}.{name}.bias"), &[out], 0.0, 0.1)?;
        }
        norms.push(format!("{p}.attention.output.LayerNorm"));
        norms.push(format!("{p}.output.LayerNorm"));
    }
    for name in norms {
        put(&mut w, format!("{name}.weight"), &[h], 1.0, 0.1)?;
        put(&mut w, format!("{name}.bias"), &[h], 0.0, 0.1)?;
    }
    Ok(w)
}

/// GPT-2's byte-to-character table for byte-level BPE.
pub(crate) fn bytes_to_unicode() -> Vec<char> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut chars: Vec<u32> = printable.clone();
    let mut extra = 0;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            printable.push(b);
            chars.push(256 + extra);
            extra += 1;
        }
    }
    let mut table = vec!['\0'; 256];
    for (b, c) in printable.into_iter().zip(chars) {
        table[b as usize] = char::from_u32(c).unwrap_or('?');
    }
    table
}

/// Special tokens, then one token per byte: a byte-level BPE without merges.
fn tokenizer_json() -> Value {
    let specials = ["<s>", "</s>", "<pad>"];
    let mut vocab = serde_json::Map::new();
    for (i, s) in specials.iter().enumerate() {
        vocab.insert((*s).to_string(), json!(i));
    }
    for (b, c) in bytes_to_unicode().into_iter().enumerate() {
        vocab.insert(c.to_string(), json!(specials.len() + b));
    }
    let added: Vec<Value> = specials
        .iter()
        .enumerate()
        .map(|(i, s)| json!({"id": i, "content": s, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
        .collect();
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": []},
    })
}

const CHAT_TEMPLATE: &str = "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}";

fn write_json(path: &Path, value: &Value) -> Result<(), ModelError> {
    let text = serde_json::to_string_pretty(value).map_err(|e| ModelError::Config(e.to_string()))?;
    std::fs::write(path, text).map_err(|source| ModelError::Io {
        path: path.display().to_string(),
        source,
    })
}

/// Write a fixture model into `dir` (created if missing), in f32.
pub fn write(fixture: Fixture, dir: &Path) -> Result<(), ModelError> {
    write_as(fixture, dir, DType::F32)
}

/// The names of the weight precisions `write_as` takes.
pub fn parse_dtype(name: &str) -> Option<DType> {
    match name {
        "f32" | "float32" => Some(DType::F32),
        "f16" | "float16" => Some(DType::F16),
        "bf16" | "bfloat16" => Some(DType::BF16),
        _ => None,
    }
}

/// Write a fixture model into `dir` with its weights in `dtype` (f32, f16 or
/// bf16): the same values as the f32 fixture, rounded.
pub fn write_as(fixture: Fixture, dir: &Path, dtype: DType) -> Result<(), ModelError> {
    std::fs::create_dir_all(dir).map_err(|source| ModelError::Io {
        path: dir.display().to_string(),
        source,
    })?;
    let mut config = fixture.config();
    config["torch_dtype"] = json!(match dtype {
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        _ => "float32",
    });
    write_json(&dir.join("config.json"), &config)?;
    let weights = match fixture {
        Fixture::TinyBert => bert_weights(&config)?,
        _ => llama_weights(&config, fixture.salt(), fixture.gain())?,
    };
    let weights = weights
        .into_iter()
        .map(|(name, t)| Ok((name, t.to_dtype(dtype)?)))
        .collect::<candle_core::Result<HashMap<_, _>>>()?;
    candle_core::safetensors::save(&weights, dir.join("model.safetensors"))?;
    write_json(&dir.join("tokenizer.json"), &tokenizer_json())?;
    write_json(
        &dir.join("tokenizer_config.json"),
        &json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
            "add_bos_token": false, "model_max_length": config["max_position_embeddings"],
            "chat_template": CHAT_TEMPLATE,
        }),
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_generator_is_reproducible_and_roughly_normal() {
        let a = random("x", &[1000], 0.0, 1.0).unwrap().to_vec1::<f32>().unwrap();
        let b = random("x", &[1000], 0.0, 1.0).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(a, b);
        let mean = a.iter().sum::<f32>() / 1000.0;
        let var = a.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / 1000.0;
        assert!(mean.abs() < 0.1 && (var - 1.0).abs() < 0.15, "mean {mean} var {var}");
    }

    #[test]
    fn byte_level_table_covers_every_byte_once() {
        let table = bytes_to_unicode();
        let unique: std::collections::HashSet<char> = table.iter().copied().collect();
        assert_eq!(unique.len(), 256);
        assert_eq!(table[b'A' as usize], 'A');
        assert_eq!(table[b' ' as usize], 'Ġ');
    }
}
