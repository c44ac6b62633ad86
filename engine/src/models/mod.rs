//! Model implementations, the candle way: a serde config read from the
//! checkpoint converted into an internal config; each layer has `load(vb, cfg)`
//! and `forward`; weight names mirror the checkpoint. Unlike candle's own
//! models, KV caches live outside the layers, one per sequence, so that many
//! sequences share one model.

pub mod bert;
pub mod llama;

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
