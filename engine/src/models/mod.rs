//! Model implementations, the candle way: a serde config read from the
//! checkpoint converted into an internal config; each layer has `load(vb, cfg)`
//! and `forward`; weight names mirror the checkpoint. Unlike candle's own
//! models, KV caches live outside the layers, one per sequence, so that many
//! sequences share one model.

pub mod bert;
pub mod llama;

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

/// Read a checkpoint's `config.json` as `T`.
pub fn read_config<T: DeserializeOwned>(dir: &Path) -> Result<T, ModelError> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(io_error(&path))?;
    serde_json::from_str(&text).map_err(|e| ModelError::Config(e.to_string()))
}

/// Every `*.safetensors` file of a checkpoint directory, in name order.
pub fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>, ModelError> {
    let entries = std::fs::read_dir(dir).map_err(io_error(dir))?;
    let mut files: Vec<_> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(ModelError::Config(format!("no *.safetensors in {}", dir.display())));
    }
    Ok(files)
}

/// Every tensor of a checkpoint directory, its shards merged, read through
/// memory maps (the files are never copied whole into memory).
pub fn load_tensors(dir: &Path, device: &Device) -> Result<HashMap<String, Tensor>, ModelError> {
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
