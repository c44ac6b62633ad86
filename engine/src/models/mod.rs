//! Model implementations, the candle way: a serde config read from the
//! checkpoint converted into an internal config; each layer has `load(vb, cfg)`
//! and `forward`; weight names mirror the checkpoint. Unlike candle's own
//! models, KV caches live outside the layers, one per sequence, so that many
//! sequences share one model.

pub mod bert;
pub mod gguf;
pub mod llama;
pub mod vocab;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde::de::DeserializeOwned;

/// Errors loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// `config.json` is missing, unreadable or not a config we serve.
    #[error("config.json: {0}")]
    Config(String),
    /// A GGUF file is malformed or holds what is not served; the message
    /// names the file and the field.
    #[error("{0}")]
    Gguf(String),
    /// A tensor is missing, has the wrong shape, or a file is unreadable.
    #[error("weights: {0}")]
    Weights(#[from] candle_core::Error),
    /// Reading a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> ModelError + '_ {
    move |source| ModelError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Hand the pages the allocator holds free back to the system. A load frees
/// its read buffers and the tokenizer's JSON, and glibc keeps such memory
/// (after a free of a large block it raises its own thresholds for giving
/// pages back), so without this a process stays resident at its loading
/// peak rather than at what the weights hold.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` only walks the allocator's own free lists; it
    // takes its locks like any allocation does.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Bound what glibc's allocator keeps of freed memory, in processes that run
/// an engine: one arena per CPU the process may use, and free memory at the
/// top of a heap handed back past 1 MiB — each unless the environment names
/// its own value (glibc's `MALLOC_ARENA_MAX`, `MALLOC_TRIM_THRESHOLD_`).
/// glibc's default allows eight arenas a core and raises its trim threshold
/// after each large free, so every engine thread's arena kept a step's
/// working memory for the next step. One arena for all holds it once, but the
/// engine's threads, allocating at once, then wait on its lock (a decode
/// step at batch 32 took 5–20% longer on 2-core machines: docs/BENCHMARKS.md).
/// Call it before any thread starts.
pub fn limit_allocator_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
            let cpus = std::thread::available_parallelism().map_or(1, usize::from);
            // SAFETY: `mallopt` only sets a tunable of the allocator;
            // M_ARENA_MAX bounds the arenas made from now on.
            unsafe {
                libc::mallopt(libc::M_ARENA_MAX, i32::try_from(cpus).unwrap_or(i32::MAX));
            }
        }
        if std::env::var_os("MALLOC_TRIM_THRESHOLD_").is_none() {
            // SAFETY: as above; a fixed threshold also stops glibc raising it.
            unsafe {
                libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 20);
            }
        }
    }
}

/// Read a checkpoint's `config.json` as `T`.
pub fn read_config<T: DeserializeOwned>(dir: &Path) -> Result<T, ModelError> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(io_error(&path))?;
    serde_json::from_str(&text).map_err(|e| ModelError::Config(e.to_string()))
}

/// The weight files of a checkpoint directory: the shards that
/// `model.safetensors.index.json` names where there is one, else
/// `model.safetensors` where there is one, else every `*.safetensors` in name
/// order. Other files beside them (a `consolidated.safetensors`, an
/// `adapter_model.safetensors`) are not weights of the model and are ignored.
pub(crate) fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>, ModelError> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        #[derive(serde::Deserialize)]
        struct Index {
            weight_map: std::collections::BTreeMap<String, String>,
        }
        let text = std::fs::read_to_string(&index).map_err(io_error(&index))?;
        let parsed: Index =
            serde_json::from_str(&text).map_err(|e| ModelError::Config(format!("{}: {e}", index.display())))?;
        let mut files: Vec<PathBuf> = Vec::new();
        for shard in parsed.weight_map.values() {
            if shard.contains('/') || shard.contains('\\') || shard.starts_with('.') {
                return Err(ModelError::Config(format!(
                    "{}: shard {shard:?} is not a file name in the directory",
                    index.display()
                )));
            }
            let path = dir.join(shard);
            if !files.contains(&path) {
                files.push(path);
            }
        }
        files.sort();
        if files.is_empty() {
            return Err(ModelError::Config(format!(
                "{}: weight_map names no shard",
                index.display()
            )));
        }
        return Ok(files);
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    let entries = std::fs::read_dir(dir).map_err(io_error(dir))?;
    let mut files: Vec<_> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            !name.starts_with("consolidated") && !name.starts_with("adapter_model")
        })
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(ModelError::Config(format!("no *.safetensors in {}", dir.display())));
    }
    Ok(files)
}

/// Every tensor of a checkpoint directory, its shards merged, read through
/// memory maps (the files are never copied whole into memory).
pub(crate) fn load_tensors(dir: &Path, device: &Device) -> Result<HashMap<String, Tensor>, ModelError> {
    let files = safetensors_files(dir)?;
    // SAFETY: the maps are read-only and dropped before this returns; every
    // tensor is copied (and converted) out of them. A checkpoint rewritten while
    // it loads is the one hazard, as with any reader of a file being changed.
    let mapped = unsafe { candle_core::safetensors::MmapedSafetensors::multi(&files)? };
    let mut tensors = HashMap::new();
    for (name, _) in mapped.tensors() {
        let tensor = mapped
            .load(&name, device)
            .map_err(|e| candle_core::Error::Msg(format!("tensor {name}: {e}")))?;
        tensors.insert(name, tensor);
    }
    Ok(tensors)
}
