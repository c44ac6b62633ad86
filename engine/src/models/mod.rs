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
/// its read buffers and the tokenizer's JSON, and a burst of long pre-fill
/// steps frees their activations; under [`tune_allocator`] glibc keeps such
/// memory for the next allocation, so without this a process stays resident
/// at its peak rather than at what it uses now.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` only walks the allocator's own free lists; it
    // takes its locks like any allocation does.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Allocations at least this large are mapped on their own by glibc (its
/// largest allowed setting, half of a 64 MiB thread heap): the model's
/// blocks and the KV cache, not a step's activations.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MMAP_THRESHOLD: i32 = 32 << 20;

/// Tune glibc's allocator for processes that run an engine: one arena, and
/// a step's buffers served from the heap and kept there for the next step
/// (allocations under 32 MiB are not mapped on their own, and free memory
/// at the top of the heap is not handed back by `free`) — each unless the
/// environment names its own value (glibc's `MALLOC_ARENA_MAX`,
/// `MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`). Memory freed past
/// what the steps use now goes back through [`StepMemory`] and
/// [`release_free_memory`] instead.
///
/// glibc's defaults kept fewer step buffers but mapped every buffer from
/// 128 KiB up on its own whenever a threshold was fixed: each product's
/// output and quantized rows in a long step were mapped, faulted in page by
/// page, zeroed by the kernel and unmapped, and a 512-token pre-fill spent
/// half its time in the kernel. With the buffers kept, a pass that ran on
/// either of the pool's threads kept them in that thread's arena, once per
/// arena; one arena holds them once, and with the buffers reused its lock
/// costs nothing measurable (docs/BENCHMARKS.md). Call it before any thread
/// starts.
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        for (variable, tunable, value) in [
            ("MALLOC_ARENA_MAX", libc::M_ARENA_MAX, 1),
            ("MALLOC_MMAP_THRESHOLD_", libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            ("MALLOC_TRIM_THRESHOLD_", libc::M_TRIM_THRESHOLD, i32::MAX),
        ] {
            if std::env::var_os(variable).is_none() {
                // SAFETY: `mallopt` only sets a tunable of the allocator;
                // M_ARENA_MAX bounds the arenas made from now on.
                unsafe {
                    libc::mallopt(tunable, value);
                }
            }
        }
    }
}

/// When a step loop's freed working memory goes back to the system: after
/// [`StepMemory::SMALL_STEPS`] steps in a row of at most half the tokens of
/// the largest step since memory last went back (a burst of pre-fill ended),
/// and when the loop runs out of work. Steps of about the same size keep
/// reusing what the allocator holds.
#[derive(Debug, Default)]
pub struct StepMemory {
    /// The most tokens a step computed since memory last went back.
    peak: usize,
    /// Steps in a row of at most half `peak`.
    small: u32,
}

impl StepMemory {
    /// Steps in a row, each at most half the peak, before memory goes back.
    pub const SMALL_STEPS: u32 = 8;

    /// A step of `tokens` ran: whether to hand free memory back now.
    pub fn after_step(&mut self, tokens: usize) -> bool {
        if tokens * 2 > self.peak {
            self.peak = self.peak.max(tokens);
            self.small = 0;
            return false;
        }
        self.small += 1;
        if self.small < Self::SMALL_STEPS {
            return false;
        }
        self.peak = tokens;
        self.small = 0;
        true
    }

    /// The loop has no work left: whether to hand free memory back now
    /// (once, if a step ran since it last went back).
    pub fn idle(&mut self) -> bool {
        let ran = self.peak > 0;
        *self = StepMemory::default();
        ran
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

#[cfg(test)]
mod tests {
    use super::StepMemory;

    #[test]
    fn memory_goes_back_once_a_burst_of_long_steps_has_ended() {
        let mut memory = StepMemory::default();
        // Pre-fill of 512 tokens a step, then decodes of 64 rows.
        for _ in 0..5 {
            assert!(!memory.after_step(512));
        }
        for _ in 1..StepMemory::SMALL_STEPS {
            assert!(!memory.after_step(64));
        }
        assert!(
            memory.after_step(64),
            "the eighth small step in a row hands memory back"
        );
        // Decoding on at the same size keeps what the allocator holds.
        for _ in 0..100 {
            assert!(!memory.after_step(64));
        }
    }

    #[test]
    fn steps_of_about_the_same_size_or_a_long_one_between_keep_the_memory() {
        let mut memory = StepMemory::default();
        assert!(!memory.after_step(512));
        // A step over half the peak, or a long one, starts the count again.
        for round in 0..50 {
            for _ in 1..StepMemory::SMALL_STEPS {
                assert!(!memory.after_step(64));
            }
            assert!(!memory.after_step(if round % 2 == 0 { 300 } else { 512 }));
        }
    }

    #[test]
    fn running_out_of_work_hands_memory_back_once_after_steps_ran() {
        let mut memory = StepMemory::default();
        assert!(!memory.idle(), "nothing ran");
        assert!(!memory.after_step(1));
        assert!(memory.idle());
        assert!(!memory.idle(), "once");
        // The count starts afresh after the loop was idle.
        assert!(!memory.after_step(64));
        assert!(!memory.after_step(40));
    }
}
