//! BERT-family encoders for embeddings (bge-small/base/large, all-MiniLM
//! style): CLS or mean pooling, L2-normalised.
//!
//! Follows "BERT: Pre-training of Deep Bidirectional Transformers for Language
//! Understanding" (Devlin et al., 2019) as implemented by Hugging Face
//! transformers' `modeling_bert.py`: post-LayerNorm residual blocks, learned
//! absolute positions, exact (erf) GELU; pooling as sentence-transformers does.

use std::path::Path;

use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{embedding, layer_norm, linear, Embedding, LayerNorm, Linear, VarBuilder};
use serde::Deserialize;

use super::{load_tensors, read_config, ModelError};

type Result<T> = std::result::Result<T, ModelError>;

/// `config.json` of a BERT checkpoint.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[allow(missing_docs)]
pub struct BertConfig {
    pub model_type: Option<String>,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    pub max_position_embeddings: usize,
    #[serde(default = "two")]
    pub type_vocab_size: usize,
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    pub hidden_act: Option<String>,
}

fn two() -> usize {
    2
}

fn default_eps() -> f64 {
    1e-12
}

pub use lorry_protocol::input::Pooling;

#[derive(Debug, Clone)]
struct SelfAttention {
    query: Linear,
    key: Linear,
    value: Linear,
    dense: Linear,
    norm: LayerNorm,
    heads: usize,
}

impl SelfAttention {
    fn load(vb: VarBuilder, cfg: &BertConfig) -> Result<Self> {
        let h = cfg.hidden_size;
        let s = vb.pp("self");
        let out = vb.pp("output");
        Ok(SelfAttention {
            query: linear(h, h, s.pp("query"))?,
            key: linear(h, h, s.pp("key"))?,
            value: linear(h, h, s.pp("value"))?,
            dense: linear(h, h, out.pp("dense"))?,
            norm: layer_norm(h, cfg.layer_norm_eps, out.pp("LayerNorm"))?,
            heads: cfg.num_attention_heads,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, seq, hidden) = x.dims3()?;
        let d = hidden / self.heads;
        let split =
            |t: Tensor| -> Result<Tensor> { Ok(t.reshape((b, seq, self.heads, d))?.transpose(1, 2)?.contiguous()?) };
        let q = split(self.query.forward(x)?)?;
        let k = split(self.key.forward(x)?)?;
        let v = split(self.value.forward(x)?)?;
        let scores = (q.matmul(&k.t()?)? / (d as f64).sqrt())?;
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let context = probs.matmul(&v)?.transpose(1, 2)?.reshape((b, seq, hidden))?;
        Ok(self.norm.forward(&(self.dense.forward(&context)? + x)?)?)
    }
}

#[derive(Debug, Clone)]
struct Layer {
    attention: SelfAttention,
    intermediate: Linear,
    output: Linear,
    norm: LayerNorm,
}

impl Layer {
    fn load(vb: VarBuilder, cfg: &BertConfig) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        Ok(Layer {
            attention: SelfAttention::load(vb.pp("attention"), cfg)?,
            intermediate: linear(h, i, vb.pp("intermediate").pp("dense"))?,
            output: linear(i, h, vb.pp("output").pp("dense"))?,
            norm: layer_norm(h, cfg.layer_norm_eps, vb.pp("output").pp("LayerNorm"))?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.attention.forward(x)?;
        let inner = self.intermediate.forward(&x)?.gelu_erf()?;
        Ok(self.norm.forward(&(self.output.forward(&inner)? + x)?)?)
    }
}

/// A BERT encoder producing sentence embeddings.
#[derive(Debug, Clone)]
pub struct Bert {
    word_embeddings: Embedding,
    position_embeddings: Embedding,
    token_type_embeddings: Embedding,
    embeddings_norm: LayerNorm,
    layers: Vec<Layer>,
    config: BertConfig,
}

impl Bert {
    /// Load from a `VarBuilder` rooted where `embeddings.…` and `encoder.…` live.
    pub fn load(vb: VarBuilder, cfg: &BertConfig) -> Result<Self> {
        let e = vb.pp("embeddings");
        let h = cfg.hidden_size;
        Ok(Bert {
            word_embeddings: embedding(cfg.vocab_size, h, e.pp("word_embeddings"))?,
            position_embeddings: embedding(cfg.max_position_embeddings, h, e.pp("position_embeddings"))?,
            token_type_embeddings: embedding(cfg.type_vocab_size, h, e.pp("token_type_embeddings"))?,
            embeddings_norm: layer_norm(h, cfg.layer_norm_eps, e.pp("LayerNorm"))?,
            layers: (0..cfg.num_hidden_layers)
                .map(|i| Layer::load(vb.pp("encoder").pp("layer").pp(i), cfg))
                .collect::<Result<Vec<_>>>()?,
            config: cfg.clone(),
        })
    }

    /// Load a checkpoint directory (weights under `bert.` or at the root).
    pub fn from_dir(dir: &Path, device: &Device) -> Result<Self> {
        let cfg: BertConfig = read_config(dir)?;
        if !matches!(cfg.model_type.as_deref(), None | Some("bert")) {
            return Err(ModelError::Config(format!(
                "model_type {:?} is not BERT",
                cfg.model_type
            )));
        }
        if !matches!(cfg.hidden_act.as_deref(), None | Some("gelu")) {
            return Err(ModelError::Config(format!(
                "activation {:?} is not supported",
                cfg.hidden_act
            )));
        }
        let tensors = load_tensors(dir, device)?;
        let prefixed = tensors.contains_key("bert.embeddings.word_embeddings.weight");
        let vb = VarBuilder::from_tensors(tensors, DType::F32, device);
        Bert::load(if prefixed { vb.pp("bert") } else { vb }, &cfg)
    }

    /// The configuration.
    pub fn config(&self) -> &BertConfig {
        &self.config
    }

    /// The L2-normalised embedding of one tokenised text.
    pub fn embed(&self, tokens: &[u32], pooling: Pooling) -> Result<Vec<f32>> {
        if tokens.is_empty() || tokens.len() > self.config.max_position_embeddings {
            return Err(ModelError::Config(format!(
                "{} tokens: an embedding input takes 1 to {}",
                tokens.len(),
                self.config.max_position_embeddings
            )));
        }
        // On the compute pool with its other threads awake, as a text pass runs.
        crate::ops::hot_pass(|| self.encode(tokens, pooling))
    }

    /// [`Bert::embed`]'s pass, on tokens it has checked.
    fn encode(&self, tokens: &[u32], pooling: Pooling) -> Result<Vec<f32>> {
        let device = self.word_embeddings.embeddings().device();
        let ids = Tensor::new(tokens, device)?.unsqueeze(0)?;
        let positions = Tensor::arange(0u32, tokens.len() as u32, device)?.unsqueeze(0)?;
        let types = ids.zeros_like()?;
        let x = (self.word_embeddings.forward(&ids)?
            + self.position_embeddings.forward(&positions)?
            + self.token_type_embeddings.forward(&types)?)?;
        let mut x = self.embeddings_norm.forward(&x)?;
        for layer in &self.layers {
            x = layer.forward(&x)?;
        }
        let pooled = match pooling {
            Pooling::Cls => x.narrow(1, 0, 1)?.squeeze(1)?,
            Pooling::Mean => x.mean(1)?,
        };
        let norm = pooled
            .sqr()?
            .sum_keepdim(D::Minus1)?
            .sqrt()?
            .clamp(1e-12, f64::INFINITY)?;
        Ok(pooled.broadcast_div(&norm)?.flatten_all()?.to_vec1()?)
    }
}
