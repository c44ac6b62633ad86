//! Text in, embedding out: a BERT encoder with its tokenizer, pooled the way
//! the checkpoint's sentence-transformers configuration says.

use std::path::Path;

use candle_core::Device;
use tokenizers::{Tokenizer, TruncationParams};

use crate::input::{Prompt, ValidRequest};
use crate::models::bert::{Bert, Pooling};
use crate::models::ModelError;
use crate::runtime::serial::SerialQueue;
use crate::{Backend, Content, EngineError, ErrorCode, Event, EventStream, InputError, Output, Request, Usage};

/// An embedding model ready to serve.
pub struct Embedder {
    model: Bert,
    tokenizer: Tokenizer,
    default_pooling: Pooling,
}

impl Embedder {
    /// Load `config.json`, the weights and `tokenizer.json` from a checkpoint directory.
    pub fn from_dir(dir: &Path, device: &Device) -> Result<Self, ModelError> {
        let model = Bert::from_dir(dir, device)?;
        let mut tokenizer = Tokenizer::from_file(dir.join("tokenizer.json"))
            .map_err(|e| ModelError::Config(format!("tokenizer.json: {e}")))?;
        // Inputs longer than the model's positions are cut, as sentence-transformers does.
        let truncation = TruncationParams {
            max_length: model.config().max_position_embeddings,
            ..Default::default()
        };
        tokenizer
            .with_truncation(Some(truncation))
            .map_err(|e| ModelError::Config(format!("tokenizer.json: {e}")))?;
        tokenizer.with_padding(None);
        Ok(Embedder {
            default_pooling: sentence_transformers_pooling(dir).unwrap_or(Pooling::Mean),
            model,
            tokenizer,
        })
    }

    /// The pooling used when a request names none.
    pub(crate) fn default_pooling(&self) -> Pooling {
        self.default_pooling
    }

    /// Token ids of a text, with the tokenizer's special tokens.
    pub fn tokenize(&self, text: &str) -> Result<Vec<u32>, ModelError> {
        let encoding = self
            .tokenizer
            .encode(text, true)
            .map_err(|e| ModelError::Config(format!("tokenizing: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The L2-normalised embedding of `text`.
    pub fn embed(&self, text: &str, pooling: Option<Pooling>) -> Result<Vec<f32>, ModelError> {
        let ids = self.tokenize(text)?;
        self.model.embed(&ids, pooling.unwrap_or(self.default_pooling))
    }
}

/// `1_Pooling/config.json`, where sentence-transformers checkpoints keep their pooling.
fn sentence_transformers_pooling(dir: &Path) -> Option<Pooling> {
    let text = std::fs::read_to_string(dir.join("1_Pooling/config.json")).ok()?;
    let config: serde_json::Value = serde_json::from_str(&text).ok()?;
    if config["pooling_mode_cls_token"] == true {
        Some(Pooling::Cls)
    } else if config["pooling_mode_mean_tokens"] == true {
        Some(Pooling::Mean)
    } else {
        None
    }
}

/// An embedding model served on its own thread, one request at a time, real
/// time first; cheap to clone.
#[derive(Clone)]
pub struct EmbeddingEngine {
    name: std::sync::Arc<str>,
    queue: SerialQueue,
}

impl EmbeddingEngine {
    /// Start serving `embedder` as `name`.
    pub fn start(name: &str, embedder: Embedder) -> Self {
        let queue = SerialQueue::start(&format!("lorry-embed {name}"), move |request, events| {
            events.send(match embed_request(&embedder, &request) {
                Ok(output) => Event::Finished(output),
                Err(error) => Event::Failed(error),
            });
        });
        EmbeddingEngine {
            name: name.into(),
            queue,
        }
    }
}

/// A vector for every input text.
fn embed_request(embedder: &Embedder, request: &ValidRequest) -> Result<Output, EngineError> {
    let Prompt::Inputs(texts) = &request.prompt else {
        return Err(EngineError::Model("an embedding model takes text".into()));
    };
    let pooling = request.pooling.unwrap_or(embedder.default_pooling());
    let mut data = Vec::with_capacity(texts.len());
    let mut tokens = 0;
    for (i, text) in texts.iter().enumerate() {
        let ids = embedder.tokenize(text).map_err(|e| EngineError::Model(e.to_string()))?;
        // A text the tokenizer makes nothing of is the client's to fix, not a model failure.
        if ids.is_empty() {
            let param = if texts.len() == 1 {
                "text".to_string()
            } else {
                format!("text[{i}]")
            };
            return Err(EngineError::Input(InputError::new(
                ErrorCode::EmptyPrompt,
                param,
                "the text has no tokens to embed",
            )));
        }
        tokens += ids.len();
        data.push(
            embedder
                .model
                .embed(&ids, pooling)
                .map_err(|e| EngineError::Model(e.to_string()))?,
        );
    }
    Ok(Output {
        content: Content::Embeddings { vectors: data, pooling },
        usage: Usage {
            prompt_tokens: tokens as u32,
            completion_tokens: 0,
        },
        completion: None,
        logprobs: None,
        choices: Vec::new(),
        tool_calls: Vec::new(),
    })
}

impl Backend for EmbeddingEngine {
    fn model(&self) -> &str {
        &self.name
    }

    fn submit(&self, request: Request) -> Result<EventStream, EngineError> {
        request.without_adapter(self.model())?;
        self.queue.submit(request.input, request.lane)
    }
}
