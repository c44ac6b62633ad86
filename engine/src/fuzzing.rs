//! The engine's loaders on untrusted bytes: the entry points of the
//! `cargo fuzz` targets (`fuzz/`) and of the tests that replay their corpora.
//! Each returns the refusal, if any; a panic or an abort is a bug.

use std::io::Cursor;
use std::path::Path;

use crate::models::gguf::GgufFile;
use crate::models::llama::{Config, LlamaConfigFile};
use crate::models::ModelError;

/// A GGUF file's header, metadata and tensor directory, and the model
/// configuration read from them, as `lorry serve` reads a `.gguf` path.
pub fn gguf(bytes: &[u8]) -> Result<Config, ModelError> {
    let file = GgufFile::read(&mut Cursor::new(bytes), bytes.len() as u64, Path::new("fuzz.gguf"))?;
    file.config()
}

/// A Hugging Face `config.json` of a Llama-family checkpoint.
pub fn llama_config(bytes: &[u8]) -> Result<Config, ModelError> {
    serde_json::from_slice::<LlamaConfigFile>(bytes)
        .map_err(|e| ModelError::Config(e.to_string()))?
        .into_config()
}
