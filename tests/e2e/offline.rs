//! The offline modes, run as a user runs them: the `lorry` binary on JSONL files.

use std::path::Path;
use std::process::Command;

use candle_core::Device;
use lorry_engine::embedding::Embedder;
use lorry_engine::fixtures::{self, Fixture};
use lorry_engine::models::bert::Pooling;
use serde_json::Value;

fn scratch(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("lorry-offline-{tag}-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn run_embed(model: &Path, input: &Path, output: &Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_lorry"))
        .args(["embed", "--model"])
        .arg(model)
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
    assert!(run_embed(&model, &input, &output).status.success());
    let lines: Vec<Value> = std::fs::read_to_string(&output)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
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
    let result = run_embed(&model, &input, &output);
    assert!(!result.status.success());
    let stderr = String::from_utf8_lossy(&result.stderr);
    assert!(stderr.contains("line 2") && stderr.contains("txt"), "{stderr}");
    assert!(!output.exists(), "no output is written for a bad input");
}
