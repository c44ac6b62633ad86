//! Tokenizers built from a GGUF file's metadata (no `tokenizer.json` beside
//! the file), as `tokenizers::Tokenizer`s:
//!
//! - `tokenizer.ggml.model = "gpt2"`: byte-level BPE from `tokens` and
//!   `merges`, split first as `tokenizer.ggml.pre` names (the pre-tokenizers
//!   of the Hugging Face tokenizers llama.cpp's converter recognised:
//!   GPT-2's, SmolLM's, Llama 3's, Qwen2's);
//! - `tokenizer.ggml.model = "llama"`: SentencePiece's BPE from `tokens` and
//!   `scores` (merges ranked by score, as transformers' converter extracts
//!   them), byte fallback, a `▁` prefix.
//!
//! Control tokens (`token_type` 3) are special tokens, user-defined ones (4)
//! added tokens; `add_bos_token`/`add_eos_token` become the post-processor,
//! so `encode(text, true)` is what `tokenizer(text)` gives in transformers.

use candle_core::quantized::gguf_file::Value;
use serde_json::{json, Value as Json};
use tokenizers::Tokenizer;

use crate::models::gguf::GgufFile;
use crate::models::ModelError;

/// Llama 3's split.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// The `tokenizer.ggml.pre` names of Llama 3's tokenizer.
const LLAMA3_NAMES: [&str; 4] = ["llama-bpe", "llama3", "llama-v3", "falcon3"];
/// Qwen2's split: Llama 3's with digits one by one.
const QWEN2_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// `token_type` of a control token.
const CONTROL: i64 = 3;
/// `token_type` of a user-defined token.
const USER_DEFINED: i64 = 4;

/// The special tokens a text model needs besides its tokenizer.
#[derive(Debug, Clone, Default)]
pub struct Specials {
    /// Text of the beginning-of-sequence token (for chat templates).
    pub bos_token: String,
    /// Text of the end-of-sequence token (for chat templates).
    pub eos_token: String,
    /// Tokens that end generation: end of sequence, of turn, of message.
    pub stop_ids: Vec<u32>,
}

fn strings(file: &GgufFile, key: &str) -> Result<Vec<String>, ModelError> {
    let Some(values) = file.array(key)? else {
        return Err(missing(file, key));
    };
    values
        .iter()
        .map(|v| match v {
            Value::String(s) => Ok(s.clone()),
            _ => Err(file.error(format!("{key} holds a non-string"))),
        })
        .collect()
}

fn numbers(file: &GgufFile, key: &str) -> Result<Option<Vec<f64>>, ModelError> {
    let Some(values) = file.array(key)? else {
        return Ok(None);
    };
    values
        .iter()
        .map(|v| match v {
            Value::F32(x) => Ok(*x as f64),
            Value::F64(x) => Ok(*x),
            Value::I32(x) => Ok(*x as f64),
            Value::U32(x) => Ok(*x as f64),
            Value::I8(x) => Ok(*x as f64),
            Value::U8(x) => Ok(*x as f64),
            Value::I64(x) => Ok(*x as f64),
            _ => Err(file.error(format!("{key} holds a non-number"))),
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

fn missing(file: &GgufFile, key: &str) -> ModelError {
    file.error(format!("metadata {key} is missing (the tokenizer is built from it)"))
}

/// The tokenizer and special tokens of a GGUF file.
pub fn from_gguf(file: &GgufFile) -> Result<(Tokenizer, Specials), ModelError> {
    let model = match file.get("tokenizer.ggml.model") {
        Some(Value::String(m)) => m.clone(),
        Some(_) => return Err(file.error("metadata tokenizer.ggml.model is not a string")),
        None => return Err(missing(file, "tokenizer.ggml.model")),
    };
    let tokens = strings(file, "tokenizer.ggml.tokens")?;
    let types: Vec<i64> = numbers(file, "tokenizer.ggml.token_type")?
        .map(|t| t.into_iter().map(|x| x as i64).collect())
        .unwrap_or_else(|| vec![1; tokens.len()]);
    if types.len() != tokens.len() {
        return Err(file.error("tokenizer.ggml.token_type and tokenizer.ggml.tokens differ in length"));
    }
    let id = |key: &str| token_id(file, key, tokens.len());
    let bos = id("tokenizer.ggml.bos_token_id")?;
    let eos = id("tokenizer.ggml.eos_token_id")?;
    let unk = id("tokenizer.ggml.unknown_token_id")?;
    let mut stop_ids: Vec<u32> = Vec::new();
    for key in ["eos_token_id", "eot_token_id", "eom_token_id"] {
        if let Some(id) = id(&format!("tokenizer.ggml.{key}"))? {
            if !stop_ids.contains(&id) {
                stop_ids.push(id);
            }
        }
    }
    let spm = match model.as_str() {
        "gpt2" => false,
        "llama" => true,
        other => {
            return Err(file.error(format!(
                "tokenizer.ggml.model {other:?} is not supported (gpt2 and llama are)"
            )))
        }
    };
    let pre = match file.get("tokenizer.ggml.pre") {
        Some(Value::String(p)) => p.clone(),
        _ => "default".to_string(),
    };
    // Where the file does not say, llama.cpp adds BOS for SentencePiece and Llama 3 vocabularies.
    let add_bos = file
        .bool("tokenizer.ggml.add_bos_token")?
        .unwrap_or(spm || LLAMA3_NAMES.contains(&pre.as_str()));
    let add_eos = file.bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
    let vocab: serde_json::Map<String, Json> = tokens.iter().enumerate().map(|(i, t)| (t.clone(), json!(i))).collect();
    let mut spec = if spm {
        let scores = numbers(file, "tokenizer.ggml.scores")?.ok_or_else(|| missing(file, "tokenizer.ggml.scores"))?;
        if scores.len() != tokens.len() {
            return Err(file.error("tokenizer.ggml.scores and tokenizer.ggml.tokens differ in length"));
        }
        let prefix = file.bool("tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
        sentencepiece(vocab, &tokens, &scores, unk.map(|u| tokens[u as usize].clone()), prefix)
    } else {
        let merges = strings(file, "tokenizer.ggml.merges")?;
        byte_level(vocab, merges, &pre).map_err(|e| file.error(e))?
    };
    spec["added_tokens"] = added_tokens(&tokens, &types);
    spec["post_processor"] = post_processor(
        &tokens,
        add_bos.then_some(bos).flatten(),
        add_eos.then_some(eos).flatten(),
    );
    let tokenizer: Tokenizer = spec
        .to_string()
        .parse()
        .map_err(|e| file.error(format!("building the tokenizer: {e}")))?;
    let text = |id: Option<u32>| id.map(|i| tokens[i as usize].clone()).unwrap_or_default();
    Ok((
        tokenizer,
        Specials {
            bos_token: text(bos),
            eos_token: text(eos),
            stop_ids,
        },
    ))
}

/// The token id metadata `key` holds, checked against the vocabulary's size.
fn token_id(file: &GgufFile, key: &str, vocabulary: usize) -> Result<Option<u32>, ModelError> {
    match file.uint(key)? {
        Some(id) if (id as usize) < vocabulary => Ok(Some(id as u32)),
        Some(id) => Err(file.error(format!("{key} = {id} is outside the vocabulary"))),
        None => Ok(None),
    }
}

/// Control tokens (special) and user-defined ones, as `tokenizer.json`'s `added_tokens`.
fn added_tokens(tokens: &[String], types: &[i64]) -> Json {
    tokens
        .iter()
        .zip(types)
        .enumerate()
        .filter(|(_, (_, &t))| t == CONTROL || t == USER_DEFINED)
        .map(|(i, (content, &t))| {
            json!({"id": i, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": t == CONTROL})
        })
        .collect()
}

/// Byte-level BPE with the split `pre` names.
fn byte_level(vocab: serde_json::Map<String, Json>, merges: Vec<String>, pre: &str) -> Result<Json, String> {
    let split = |pattern: &str| json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false});
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let (normalizer, pre_tokenizer, ignore_merges) = match pre {
        "default" | "gpt-2" | "gpt2" => (Json::Null, byte_level(true), false),
        // llama.cpp splits these digits first too.
        "smollm" | "starcoder" | "refact" => (
            Json::Null,
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
            false,
        ),
        // Llama 3's split; llama.cpp takes a word found whole in the
        // vocabulary as it is (ignore_merges) for Llama 3's own names only.
        name if LLAMA3_NAMES.contains(&name) => (
            Json::Null,
            json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_SPLIT), byte_level(false)]}),
            true,
        ),
        "smaug-bpe" | "dbrx" => (
            Json::Null,
            json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_SPLIT), byte_level(false)]}),
            false,
        ),
        // llama.cpp (and transformers' GGUF loader) split Qwen2's text
        // without the NFC normalisation its tokenizer.json adds.
        "qwen2" | "deepseek-r1-qwen" => (
            Json::Null,
            json!({"type": "Sequence", "pretokenizers": [split(QWEN2_SPLIT), byte_level(false)]}),
            false,
        ),
        other => {
            return Err(format!(
                "tokenizer.ggml.pre {other:?} is not supported (default, gpt-2, smollm, starcoder, refact, \
                 llama-bpe, llama3, smaug-bpe, falcon3, dbrx, qwen2 and deepseek-r1-qwen are)"
            ))
        }
    };
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges},
    }))
}

/// SentencePiece's BPE, merges ranked by the score of what they make.
fn sentencepiece(
    vocab: serde_json::Map<String, Json>,
    tokens: &[String],
    scores: &[f64],
    unk: Option<String>,
    add_space_prefix: bool,
) -> Json {
    let merges = merges_from_scores(tokens, scores);
    let mut normalizers = vec![json!({"type": "Replace", "pattern": {"String": " "}, "content": "▁"})];
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": "▁"}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if add_space_prefix {
        normalizers.insert(0, json!({"type": "Prepend", "prepend": "▁"}));
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": null,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {"type": "BPE", "dropout": null, "unk_token": unk, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true,
                  "ignore_merges": false, "vocab": vocab,
                  "merges": merges.into_iter().map(|(a, b)| json!([a, b])).collect::<Vec<_>>()},
    })
}

/// Every split of every token into two tokens, ranked by the token's score
/// (ties by the halves' scores), as transformers' `SentencePieceExtractor`.
fn merges_from_scores(tokens: &[String], scores: &[f64]) -> Vec<(String, String)> {
    let mut score_of: std::collections::HashMap<&str, f64> = std::collections::HashMap::new();
    for (t, &s) in tokens.iter().zip(scores) {
        score_of.insert(t.as_str(), s);
    }
    let mut merges: Vec<(&str, &str, f64)> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for t in tokens {
        if !seen.insert(t.as_str()) {
            continue;
        }
        let piece_score = score_of[t.as_str()];
        let mut local: Vec<(&str, &str, f64)> = t
            .char_indices()
            .skip(1)
            .map(|(i, _)| (&t[..i], &t[i..]))
            .filter(|(l, r)| score_of.contains_key(l) && score_of.contains_key(r))
            .map(|(l, r)| (l, r, piece_score))
            .collect();
        local.sort_by(|a, b| {
            let key = |x: &(&str, &str, f64)| (score_of[x.0], score_of[x.1]);
            key(b).partial_cmp(&key(a)).unwrap_or(std::cmp::Ordering::Equal)
        });
        merges.extend(local);
    }
    merges.sort_by(|a, b| b.2.partial_cmp(&a.2).unwrap_or(std::cmp::Ordering::Equal));
    merges
        .into_iter()
        .map(|(l, r, _)| (l.to_string(), r.to_string()))
        .collect()
}

/// BOS before and EOS after each sequence, as asked.
fn post_processor(tokens: &[String], bos: Option<u32>, eos: Option<u32>) -> Json {
    let mut single = Vec::new();
    let mut pair = Vec::new();
    let mut special_tokens = serde_json::Map::new();
    let mut special = |id: u32| {
        let text = tokens[id as usize].clone();
        special_tokens.insert(text.clone(), json!({"id": text, "ids": [id], "tokens": [text]}));
        json!({"SpecialToken": {"id": text, "type_id": 0}})
    };
    let seq = |name: &str| json!({"Sequence": {"id": name, "type_id": 0}});
    if let Some(b) = bos {
        let t = special(b);
        single.push(t.clone());
        pair.push(t);
    }
    single.push(seq("A"));
    pair.push(seq("A"));
    if let Some(e) = eos {
        let t = special(e);
        single.push(t.clone());
        pair.push(t);
    }
    if let Some(b) = bos {
        pair.push(special(b));
    }
    pair.push(seq("B"));
    if let Some(e) = eos {
        pair.push(special(e));
    }
    json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": special_tokens})
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
    use candle_core::{DType, Device, Tensor};

    use super::*;

    /// A GGUF file holding only a byte-level vocabulary with `merges`, split as `pre` names.
    fn byte_level_file(pre: &str, extra: &[&str], merges: &[&str]) -> GgufFile {
        let mut tokens: Vec<String> = vec!["<|begin_of_text|>".into(), "<|end_of_text|>".into()];
        tokens.extend(crate::fixtures::bytes_to_unicode().iter().map(|c| c.to_string()));
        tokens.extend(extra.iter().map(|t| t.to_string()));
        let types: Vec<Value> = (0..tokens.len())
            .map(|i| Value::I32(if i < 2 { 3 } else { 1 }))
            .collect();
        let metadata = [
            ("general.architecture", Value::String("llama".into())),
            ("tokenizer.ggml.model", Value::String("gpt2".into())),
            ("tokenizer.ggml.pre", Value::String(pre.into())),
            (
                "tokenizer.ggml.tokens",
                Value::Array(tokens.into_iter().map(Value::String).collect()),
            ),
            ("tokenizer.ggml.token_type", Value::Array(types)),
            (
                "tokenizer.ggml.merges",
                Value::Array(merges.iter().map(|m| Value::String(m.to_string())).collect()),
            ),
            ("tokenizer.ggml.bos_token_id", Value::U32(0)),
            ("tokenizer.ggml.eos_token_id", Value::U32(1)),
        ];
        let embedding = QTensor::quantize(
            &Tensor::zeros((4, 32), DType::F32, &Device::Cpu).unwrap(),
            GgmlDType::F32,
        )
        .unwrap();
        let path = std::env::temp_dir().join(format!("lorry-vocab-{pre}-{}.gguf", std::process::id()));
        let mut out = std::fs::File::create(&path).unwrap();
        let metadata: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
        gguf_file::write(&mut out, &metadata, &[("token_embd.weight", &embedding)]).unwrap();
        GgufFile::open(&path).unwrap()
    }

    #[test]
    fn llama3_vocabularies_split_digits_by_three_and_add_bos_unless_told() {
        let merges = ["1 2", "3 4", "12 3"];
        let (llama3, specials) = from_gguf(&byte_level_file("llama-bpe", &["12", "34", "123"], &merges)).unwrap();
        let id = |t: &str| llama3.token_to_id(t).unwrap();
        // "123" then "4": the split keeps "1234" from merging as 12|34.
        assert_eq!(llama3.encode("1234", true).unwrap().get_ids(), [0, id("123"), id("4")]);
        assert_eq!(specials.stop_ids, vec![1]);
        let (gpt2, _) = from_gguf(&byte_level_file("gpt-2", &["12", "34", "123"], &merges)).unwrap();
        assert_eq!(gpt2.encode("1234", true).unwrap().get_ids(), [id("12"), id("34")]);
        assert!(from_gguf(&byte_level_file("unheard-of", &[], &[]))
            .unwrap_err()
            .to_string()
            .contains("tokenizer.ggml.pre \"unheard-of\" is not supported"));
    }

    #[test]
    fn merges_come_from_scores_best_first() {
        let tokens: Vec<String> = ["a", "b", "c", "ab", "bc", "abc"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let scores = [-1.0, -1.0, -1.0, -2.0, -3.0, -4.0];
        let merges = merges_from_scores(&tokens, &scores);
        let pairs: Vec<(&str, &str)> = merges.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
        assert_eq!(pairs, vec![("a", "b"), ("b", "c"), ("a", "bc"), ("ab", "c")]);
    }
}
