//! The offline modes, run as a user runs them: the `lorry` binary on JSONL files.

use std::path::Path;
use std::process::Command;

use candle_core::Device;
use lorry_engine::fixtures::{self, Fixture};
use lorry_engine::lora::{Adapter, AdapterLimits, PackedAdapter};
use lorry_engine::models::bert::Pooling;
use lorry_engine::runtime::chat::TextModel;
use lorry_engine::runtime::embedding::Embedder;
use lorry_engine::{Task, ValidRequest};
use serde_json::{json, Value};

fn scratch(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("lorry-offline-{tag}-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The lines of a JSONL file.
fn read_jsonl(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Run `lorry <command> --model M [extra] --input I --output O` as a user would.
fn run_lorry(command: &str, model: &Path, input: &Path, output: &Path, extra: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_lorry"))
        .args([command, "--model"])
        .arg(model)
        .args(extra)
        .arg("--input")
        .arg(input)
        .arg("--output")
        .arg(output)
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap()
}

#[test]
fn lorry_embed_writes_one_normalised_embedding_per_line_in_order() {
    let dir = scratch("embed");
    let model = dir.join("model");
    fixtures::write(Fixture::TinyBert, &model).unwrap();
    let input = dir.join("in.jsonl");
    std::fs::write(
        &input,
        "{\"id\":\"a\",\"text\":\"hello world\",\"pooling\":\"cls\"}\n\n{\"id\":7,\"text\":\"another text\"}\n",
    )
    .unwrap();
    let output = dir.join("out.jsonl");
    assert!(run_lorry("embed", &model, &input, &output, &[]).status.success());
    let lines: Vec<Value> = read_jsonl(&output);
    assert_eq!(lines.len(), 2);
    assert_eq!(
        (lines[0]["id"].clone(), lines[1]["id"].clone()),
        (Value::from("a"), Value::from(7))
    );
    let embedder = Embedder::from_dir(&model, &Device::Cpu).unwrap();
    let want = [
        embedder.embed("hello world", Some(Pooling::Cls)).unwrap(),
        embedder.embed("another text", None).unwrap(),
    ];
    for (line, want) in lines.iter().zip(want) {
        let got: Vec<f32> = line["embedding"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        assert_eq!(got, want);
        let norm: f32 = got.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5);
    }
}

#[test]
fn lorry_embed_names_the_bad_line_and_writes_nothing() {
    let dir = scratch("embed-bad");
    let model = dir.join("model");
    fixtures::write(Fixture::TinyBert, &model).unwrap();
    let input = dir.join("in.jsonl");
    std::fs::write(&input, "{\"id\":1,\"text\":\"fine\"}\n{\"id\":2,\"txt\":\"typo\"}\n").unwrap();
    let output = dir.join("out.jsonl");
    let result = run_lorry("embed", &model, &input, &output, &[]);
    assert!(!result.status.success());
    let stderr = String::from_utf8_lossy(&result.stderr);
    assert!(stderr.contains("line 2") && stderr.contains("txt"), "{stderr}");
    assert!(!output.exists(), "no output is written for a bad input");
}

#[test]
fn lorry_generate_serves_raw_chat_and_stopped_requests_as_the_library_does() {
    use lorry_engine::input::{Message, Prompt};
    use lorry_engine::runtime::chat::TextModel;

    let dir = scratch("generate");
    let model_dir = dir.join("model");
    fixtures::write(Fixture::TinyLlama, &model_dir).unwrap();
    let model = TextModel::from_dir(&model_dir, &Device::Cpu).unwrap();
    let raw_ids = model.encode("Hello there").unwrap();
    let greedy = model.model.greedy(&raw_ids, 12).unwrap();
    // A stop string: the first character of the greedy text that decodes cleanly, after the first.
    let full = model.decode(&greedy).unwrap();
    let (cut, stop) = full
        .char_indices()
        .skip(1)
        .find(|(_, c)| *c != '\u{FFFD}' && !c.is_control())
        .unwrap();
    let input = dir.join("in.jsonl");
    let lines = [
        serde_json::json!({"id": 1, "prompt": "Hello there", "raw": true, "max_tokens": 12, "ignore_eos": true}),
        serde_json::json!({"id": 2, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}),
        serde_json::json!({"id": 3, "prompt": "Hello there", "raw": true, "max_tokens": 12, "ignore_eos": true, "stop": [stop.to_string()]}),
        serde_json::json!({"id": 4, "prompt": "Hello there", "raw": true, "max_tokens": 12}),
        serde_json::json!({"id": 5, "prompt": "Hello there", "raw": true, "max_tokens": 12, "ignore_eos": true,
                           "n": 2, "logprobs": true, "top_logprobs": 2}),
    ];
    std::fs::write(&input, lines.iter().map(|l| format!("{l}\n")).collect::<String>()).unwrap();
    let output = dir.join("out.jsonl");
    let result = run_lorry("generate", &model_dir, &input, &output, &[]);
    assert!(result.status.success(), "{}", String::from_utf8_lossy(&result.stderr));
    let out: Vec<Value> = read_jsonl(&output);

    assert_eq!(out[0]["token_ids"], serde_json::json!(greedy));
    assert_eq!(out[0]["text"], full.as_str());
    assert_eq!(out[0]["finish_reason"], "length");
    assert_eq!(
        out[0]["usage"],
        serde_json::json!({"prompt_tokens": raw_ids.len(), "completion_tokens": 12})
    );

    let chat = Prompt::Messages(vec![Message::text("user", "Hi")]);
    let rendered = model.render(&chat, false).unwrap();
    assert!(
        rendered.starts_with("<|user|>\nHi</s>\n") && rendered.ends_with("<|assistant|>\n"),
        "{rendered:?}"
    );
    assert_eq!(out[1]["usage"]["prompt_tokens"], model.encode(&rendered).unwrap().len());

    assert_eq!(out[2]["finish_reason"], "stop");
    assert_eq!(out[2]["text"], &full[..full.find(stop).unwrap()]);
    assert!(full.find(stop).unwrap() <= cut);

    // Without ignore_eos, generation ends at the end-of-sequence token.
    let eos = model.stop_ids()[0];
    let until_eos: Vec<u32> = match greedy.iter().position(|&t| t == eos) {
        Some(i) => greedy[..=i].to_vec(),
        None => greedy.clone(),
    };
    assert_eq!(out[3]["token_ids"], serde_json::json!(until_eos));
    let ended_by_eos = until_eos.len() < greedy.len() || until_eos.last() == Some(&eos);
    assert_eq!(out[3]["finish_reason"], if ended_by_eos { "stop" } else { "length" });

    // Two greedy choices with their logprobs: both the greedy answer.
    let choices = out[4]["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2, "{}", out[4]);
    for (i, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], i);
        assert_eq!(choice["token_ids"], serde_json::json!(greedy));
        assert_eq!(choice["logprobs"].as_array().unwrap().len(), 12);
        assert_eq!(choice["logprobs"][0]["top_logprobs"].as_array().unwrap().len(), 2);
    }
    assert_eq!(out[4]["logprobs"], choices[0]["logprobs"]);
    assert_eq!(out[4]["usage"]["completion_tokens"], 24);
}

#[test]
fn lorry_generate_names_bad_requests_and_bad_adapters() {
    let dir = scratch("generate-bad");
    let model = dir.join("model");
    fixtures::write(Fixture::TinyLlama, &model).unwrap();
    let input = dir.join("in.jsonl");
    std::fs::write(
        &input,
        "{\"id\":1,\"prompt\":\"x\"}\n{\"id\":2,\"prompt\":\"x\",\"temperature\":9}\n",
    )
    .unwrap();
    let output = dir.join("out.jsonl");
    let result = run_lorry("generate", &model, &input, &output, &[]);
    assert!(!result.status.success());
    let stderr = String::from_utf8_lossy(&result.stderr);
    assert!(
        stderr.contains("request 2") && stderr.contains("temperature"),
        "{stderr}"
    );
    assert!(!output.exists());

    std::fs::write(&input, "{\"id\":1,\"prompt\":\"x\",\"adapter\":\"other\"}\n").unwrap();
    let unknown = run_lorry("generate", &model, &input, &output, &["--adapter", "mine=/nowhere"]);
    let stderr = String::from_utf8_lossy(&unknown.stderr);
    assert!(
        !unknown.status.success() && stderr.contains("request 1") && stderr.contains("other"),
        "{stderr}"
    );

    std::fs::write(&input, "{\"id\":1,\"prompt\":\"x\",\"adapter\":\"mine\"}\n").unwrap();
    let missing = run_lorry("generate", &model, &input, &output, &["--adapter", "mine=/nowhere"]);
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(
        !missing.status.success() && stderr.contains("--adapter mine"),
        "{stderr}"
    );
    assert!(!output.exists());
}

#[test]
fn lorry_generate_serves_each_line_with_its_adapter() {
    let dir = scratch("generate-lora");
    let model_dir = dir.join("model");
    fixtures::write(Fixture::TinyLlama, &model_dir).unwrap();
    let adapters = Path::new(env!("CARGO_MANIFEST_DIR")).join("engine/tests/data/lora");
    let lines = [
        json!({"id": "a", "prompt": "the quick brown fox", "raw": true, "max_tokens": 12, "adapter": "a"}),
        json!({"id": "b", "prompt": "the quick brown fox", "raw": true, "max_tokens": 12, "adapter": "b"}),
        json!({"id": "base", "prompt": "the quick brown fox", "raw": true, "max_tokens": 12}),
    ];
    let input = dir.join("in.jsonl");
    std::fs::write(&input, lines.iter().map(|l| format!("{l}\n")).collect::<String>()).unwrap();
    let output = dir.join("out.jsonl");
    let (a, b) = (
        format!("a={}", adapters.join("adapter-a").display()),
        format!("b={}", adapters.join("adapter-b").display()),
    );
    let result = run_lorry(
        "generate",
        &model_dir,
        &input,
        &output,
        &["--adapter", &a, "--adapter", &b],
    );
    assert!(result.status.success(), "{}", String::from_utf8_lossy(&result.stderr));
    let out: Vec<Value> = read_jsonl(&output);
    let model = TextModel::from_dir(&model_dir, &Device::Cpu).unwrap();
    let packed = |name: &str| {
        PackedAdapter::new(
            &Adapter::from_dir(
                &adapters.join(name),
                &model.model.config().adapter_shape(),
                AdapterLimits::default(),
            )
            .unwrap(),
        )
    };
    let (pa, pb) = (packed("adapter-a"), packed("adapter-b"));
    let mut seen = Vec::new();
    for (line, (got, adapter)) in lines.iter().zip(out.iter().zip([Some(&pa), Some(&pb), None])) {
        let mut body = line.clone();
        body.as_object_mut().unwrap().retain(|k, _| k != "id" && k != "adapter");
        let request = ValidRequest::parse(Task::TextGeneration, &body).unwrap();
        let want = model.generate_adapted(&request, adapter).unwrap();
        assert_eq!(got["id"], line["id"]);
        assert_eq!(got["token_ids"], json!(want.token_ids), "{}", line["id"]);
        seen.push(want.token_ids);
    }
    assert!(seen[0] != seen[2] && seen[1] != seen[2], "the adapters changed nothing");
}

#[test]
fn lorry_generate_switches_speculation_and_the_prefix_cache_without_changing_greedy_output() {
    let dir = scratch("generate-speculate");
    let model_dir = dir.join("model");
    let draft_dir = dir.join("draft");
    fixtures::write(Fixture::TinyLlama, &model_dir).unwrap();
    fixtures::write(Fixture::TinyLlamaDraft, &draft_dir).unwrap();
    let adapters = Path::new(env!("CARGO_MANIFEST_DIR")).join("engine/tests/data/lora");
    let context = "a b c d a b c d a b c d ".repeat(4);
    let lines: Vec<Value> = (0..6)
        .map(|i| {
            let mut line = json!({"id": i, "prompt": format!("{context}{i}"), "raw": true, "max_tokens": 20 + i, "ignore_eos": true});
            if i % 2 == 1 {
                line["adapter"] = json!("a");
            }
            line
        })
        .collect();
    let input = dir.join("in.jsonl");
    std::fs::write(&input, lines.iter().map(|l| format!("{l}\n")).collect::<String>()).unwrap();
    let adapter = format!("a={}", adapters.join("adapter-a").display());
    let draft = format!("draft:{}", draft_dir.display());
    let mut outputs = Vec::new();
    for switches in [
        ["--speculate", "off", "--prefix-cache", "off"],
        ["--speculate", "ngram", "--prefix-cache", "on"],
        ["--speculate", draft.as_str(), "--prefix-cache", "on"],
    ] {
        let output = dir.join(format!("out-{}.jsonl", outputs.len()));
        // A small step budget spreads the prompts over steps, so later ones find earlier ones' blocks.
        // Guessing in every step: whether a measured step guesses depends on the clock.
        let mut args = vec![
            "--adapter",
            adapter.as_str(),
            "--step-tokens",
            "64",
            "--speculate-policy",
            "always",
        ];
        args.extend(switches);
        let result = run_lorry("generate", &model_dir, &input, &output, &args);
        let stderr = String::from_utf8_lossy(&result.stderr).to_string();
        assert!(result.status.success(), "{switches:?}: {stderr}");
        let tokens: Vec<Value> = read_jsonl(&output)
            .into_iter()
            .map(|l| l["token_ids"].clone())
            .collect();
        outputs.push((tokens, stderr));
    }
    assert_eq!(outputs[1].0, outputs[0].0, "prompt lookup changed an output");
    assert_eq!(outputs[2].0, outputs[0].0, "the draft model changed an output");
    // The counters are logged: blocks were reused and guesses made.
    assert!(logged(&outputs[1].1, "prefix_hit_blocks") > 0.0, "{}", outputs[1].1);
    assert!(logged(&outputs[1].1, "ngram_proposed") > 0.0, "{}", outputs[1].1);
    assert!(logged(&outputs[2].1, "draft_proposed") > 0.0, "{}", outputs[2].1);
    assert_eq!(logged(&outputs[0].1, "ngram_proposed"), 0.0, "{}", outputs[0].1);

    let bad = run_lorry(
        "generate",
        &model_dir,
        &input,
        &dir.join("x.jsonl"),
        &["--speculate", "sometimes"],
    );
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success() && stderr.contains("ngram, draft:DIR"), "{stderr}");
    let bad = run_lorry(
        "generate",
        &model_dir,
        &input,
        &dir.join("x.jsonl"),
        &["--prefix-cache", "maybe"],
    );
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("on or off"));
}

/// The number a log line gives `field` (`field=12`), ANSI colours left out.
fn logged(stderr: &str, field: &str) -> f64 {
    let mut plain = String::new();
    let mut chars = stderr.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            chars.by_ref().take_while(|&c| c != 'm').for_each(drop);
        } else {
            plain.push(c);
        }
    }
    let at = plain
        .find(&format!("{field}="))
        .unwrap_or_else(|| panic!("{field} is not logged: {plain}"));
    plain[at + field.len() + 1..]
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{field} has no number: {plain}"))
}

#[test]
fn lorry_generate_reads_a_gguf_file_and_lorry_embed_refuses_one() {
    let dir = scratch("generate-gguf");
    std::fs::create_dir_all(&dir).unwrap();
    let gguf = Path::new(env!("CARGO_MANIFEST_DIR")).join("engine/tests/data/gguf/tiny-qwen2.gguf");
    let model = TextModel::open(&gguf, &Device::Cpu).unwrap();
    let bodies = [
        serde_json::json!({"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 8}),
        serde_json::json!({"prompt": "Once upon a time", "raw": true, "max_tokens": 8}),
    ];
    let input = dir.join("in.jsonl");
    let lines: String = bodies
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let mut line = b.clone();
            line["id"] = serde_json::json!(i);
            format!("{line}\n")
        })
        .collect();
    std::fs::write(&input, lines).unwrap();
    let output = dir.join("out.jsonl");
    let result = run_lorry("generate", &gguf, &input, &output, &["--speculate", "ngram"]);
    assert!(result.status.success(), "{}", String::from_utf8_lossy(&result.stderr));
    let out: Vec<Value> = read_jsonl(&output);
    for (line, body) in out.iter().zip(&bodies) {
        let alone = model
            .generate(&ValidRequest::parse(Task::TextGeneration, body).unwrap())
            .unwrap();
        assert_eq!(line["token_ids"], serde_json::json!(alone.token_ids), "{body}");
        assert_eq!(line["text"], alone.text.as_str());
    }

    let result = run_lorry("embed", &gguf, &input, &dir.join("embedded.jsonl"), &[]);
    assert!(!result.status.success());
    let stderr = String::from_utf8_lossy(&result.stderr);
    assert!(
        stderr.contains("tiny-qwen2.gguf") && stderr.contains("GGUF"),
        "{stderr}"
    );
}
